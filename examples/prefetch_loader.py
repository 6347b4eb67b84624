"""An asyncio prefetching loader: two batches upload while the current one is consumed.

    python examples/prefetch_loader.py [--batches 16] [--mib 32] [--consume-ms 8]

Each step consumes one batch on the device (modelled here by an awaited
device-time interval, as a model's forward pass would be awaited) and
downloads a result. The loader keeps the next two batches uploading while the
current one is consumed, and the result download of step k runs while step
k + 1 is consumed. It prints the serial schedule, the prefetched one, the
transfer time alone, and how much of the overlappable time (the shorter of
transfers and device work) the prefetching hid. The results are kept, each in
a fresh output, as a first version of such a loader would: on a VM the first
touch of each fresh output page costs more than its copy, which is what the
serial schedule's excess over transfers + work is. Passing reused arrays as
``out=`` to ``rt.download`` removes it.
Every batch and result is verified.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

import ferry


def make_batches(count: int, nbytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(nbytes // 4).astype(np.float32) for _ in range(count)]


async def consume(dev: ferry.DeviceArray, seconds: float) -> None:
    """Stand-in for device work on the batch (a forward pass the program awaits)."""
    await asyncio.sleep(seconds)


async def prefetching(rt: ferry.Runtime, batches: list[np.ndarray], depth: int = 2) -> AsyncIterator[Any]:
    """Yield device batches in order, keeping ``depth`` uploads in flight ahead of the consumer."""
    queue: deque[ferry.PendingUpload] = deque()
    source = iter(batches)
    for batch in source:
        queue.append(rt.upload(batch))
        if len(queue) == depth:
            break
    while queue:
        _, dev = await queue.popleft()
        nxt = next(source, None)
        if nxt is not None:
            queue.append(rt.upload(nxt))
        yield dev


async def run_prefetched(rt: ferry.Runtime, batches: list[np.ndarray], consume_s: float) -> list[np.ndarray]:
    results: list[np.ndarray] = []
    downloads: deque[ferry.PendingDownload] = deque()
    async for dev in prefetching(rt, batches):
        await consume(dev, consume_s)
        downloads.append(rt.download(dev))  # the result of this step downloads during the next
        if len(downloads) > 1:
            results.append((await downloads.popleft())[1])
    while downloads:
        results.append((await downloads.popleft())[1])
    return results


async def run_serial(rt: ferry.Runtime, batches: list[np.ndarray], consume_s: float) -> list[np.ndarray]:
    results = []
    for batch in batches:
        _, dev = await rt.upload(batch)
        await consume(dev, consume_s)
        results.append((await rt.download(dev))[1])
    return results


async def transfers_alone(rt: ferry.Runtime, batches: list[np.ndarray]) -> None:
    for batch in batches:
        _, dev = await rt.upload(batch)
        await rt.download(dev)


def timed(coro: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = asyncio.run(coro)
    return time.perf_counter() - start, value


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--consume-ms", type=float, default=8.0)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    batches = make_batches(args.batches, args.mib << 20)
    consume_s = args.consume_ms / 1e3
    with ferry.Runtime(args.backend) as rt:
        asyncio.run(transfers_alone(rt, batches[:2]))  # warm pools and lanes
        t_transfer, _ = timed(transfers_alone(rt, batches))
        t_serial, serial = timed(run_serial(rt, batches, consume_s))
        t_prefetch, prefetched = timed(run_prefetched(rt, batches, consume_s))
        for got in (serial, prefetched):
            assert all(np.array_equal(a, b) for a, b in zip(got, batches, strict=True)), "wrong bytes"
        t_consume = consume_s * len(batches)
        # transfer time still exposed in the prefetched schedule, beyond the device work it overlaps
        exposed = max(0.0, t_prefetch - max(t_consume, t_transfer))
        hidden = 1.0 - exposed / min(t_consume, t_transfer) if t_transfer > 0 else 0.0
        print(f"ferry prefetch loader on {rt.backend}: {len(batches)} batches of {args.mib} MiB, "
              f"{args.consume_ms:.1f} ms of device work each")
        print(f"  transfers alone        {t_transfer * 1e3:8.1f} ms")
        print(f"  device work alone      {t_consume * 1e3:8.1f} ms")
        print(f"  serial schedule        {t_serial * 1e3:8.1f} ms")
        print(f"  prefetched schedule    {t_prefetch * 1e3:8.1f} ms")
        print(f"  exposed beyond max(work, transfers) {exposed * 1e3:6.1f} ms: "
              f"{hidden * 100:.1f} % of the overlappable time hidden (all bytes verified)")
    return {"transfer": t_transfer, "serial": t_serial, "prefetched": t_prefetch, "hidden": hidden}


if __name__ == "__main__":
    main()
