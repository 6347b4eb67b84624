"""A training-style loader on ``ferry.prefetch``: the next batches upload while the model works.

    python examples/prefetch_loader.py [--batches 16] [--mib 32] [--consume-ms 8] [--depth 2]
                                       [--backend auto] [--asyncio]

Each step hands one pageable float32 batch to a "model" that works on it on
the device for about ``--consume-ms`` and checks it (a checksum computed on
the device, compared at the end with the one computed on the host).

* With a GPU and PyTorch: the batches come as torch tensors
  (``ferry.prefetch(..., to="torch")``) and the model is matrix products on
  PyTorch's current stream, calibrated with CUDA events.
* With a GPU and CuPy (no PyTorch): the same with CuPy arrays.
* Otherwise, on the emulated device: the batches come as ferry arrays handed
  to a side stream, and the model is a stand-in kernel on that stream (a
  delayed fill of a scratch array), then a read of the batch's first bytes.

It times four schedules: the transfers alone, the device work alone, a
serial loop (upload, wait, work, wait for the work) and the loop on
``ferry.prefetch`` (never waiting on the host for a batch; the model's stream
waits on the device). It prints how much of the overlappable time (the
shorter of transfers and work) the prefetching hid, and verifies every batch.
One untimed pass comes first: it warms the pinned pool, the staging lanes and
the device pool (a cold pool grows during the first batches). On the emulated
device the streams are threads on the host's cores: with few cores the figures
show their contention, not a GPU's behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ferry
from ferry import testing


def make_batches(count: int, nbytes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 100, nbytes // 4).astype(np.float32) for _ in range(count)]


class Model:
    """Device work on one batch; ``checksum`` comes back for verification."""

    to: Any = None  # what ferry.prefetch converts the batches to
    stream: Any = None  # the stream the work runs on, for ferry.prefetch (None: the library's current one)
    name = ""

    def step(self, x: Any) -> Any:
        raise NotImplementedError

    def to_device(self, rt: ferry.Runtime, batch: np.ndarray) -> Any:
        """A batch uploaded and waited for (the serial schedule)."""
        return self.convert(rt.to_device(batch))

    def convert(self, dev: ferry.DeviceArray) -> Any:
        return dev

    def finish(self, checks: list[Any]) -> list[float]:
        """Wait for the work; the checksums it computed."""
        raise NotImplementedError

    def expected(self, batch: np.ndarray) -> float:
        return float(batch.astype(np.float64).sum())


class TorchModel(Model):
    to = "torch"

    def __init__(self, torch: Any, seconds: float) -> None:
        self.torch = torch
        self.name = "PyTorch matrix products on its current stream"
        self.a = torch.randn(2048, 2048, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.a @ self.a  # warm
        start.record()
        for _ in range(10):
            self.a @ self.a
        end.record()
        end.synchronize()
        self.reps = max(1, round(seconds / (start.elapsed_time(end) / 1e3 / 10)))

    def step(self, x: Any) -> Any:
        for _ in range(self.reps):
            self.a @ self.a
        return x.to(self.torch.float64).sum()

    def convert(self, dev: ferry.DeviceArray) -> Any:
        return self.torch.from_dlpack(dev)

    def finish(self, checks: list[Any]) -> list[float]:
        self.torch.cuda.synchronize()
        return [float(c) for c in checks]


class CupyModel(Model):
    to = "cupy"

    def __init__(self, cupy: Any, seconds: float) -> None:
        self.cupy = cupy
        self.name = "CuPy matrix products on its current stream"
        self.a = cupy.random.standard_normal((2048, 2048), dtype=cupy.float32)
        self.a @ self.a
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(10):
            self.a @ self.a
        end.record()
        end.synchronize()
        self.reps = max(1, round(seconds / (cupy.cuda.get_elapsed_time(start, end) / 1e3 / 10)))

    def step(self, x: Any) -> Any:
        for _ in range(self.reps):
            self.a @ self.a
        return x.astype(self.cupy.float64).sum()

    def convert(self, dev: ferry.DeviceArray) -> Any:
        return self.cupy.from_dlpack(dev)

    def finish(self, checks: list[Any]) -> list[float]:
        self.cupy.cuda.get_current_stream().synchronize()
        return [float(c) for c in checks]


class EmulatedModel(Model):
    """A stand-in for a model on the emulated device: a kernel of ``seconds`` on a side stream,
    then a read of the batch's first 1024 values there."""

    def __init__(self, rt: ferry.Runtime, seconds: float) -> None:
        self.rt = rt
        self.seconds = seconds
        self.name = f"a {seconds * 1e3:g} ms stand-in kernel on a side stream (emulated device)"
        self.stream = testing.side_stream(rt)
        self.scratch = rt.empty(4096, np.uint8)
        self.scratch_ptr = self.scratch.ptr

    def step(self, x: Any) -> Any:
        testing.produce(self.rt, self.stream, self.scratch_ptr, 4096, 0, delay=self.seconds)
        ptr = x.ptr  # a raw address: ferry cannot know on which stream it is used...
        x.record_stream(self.stream)  # ...so say so: its memory returns to the pool after this stream's work
        return testing.consume(self.rt, self.stream, ptr, 4096)

    def finish(self, checks: list[Any]) -> list[float]:
        return [float(np.frombuffer(c.result().tobytes(), np.float32).astype(np.float64).sum()) for c in checks]

    def expected(self, batch: np.ndarray) -> float:
        return float(batch[:1024].astype(np.float64).sum())


def make_model(rt: ferry.Runtime, seconds: float) -> Model:
    if rt.backend == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return TorchModel(torch, seconds)
        except ImportError:
            pass
        try:
            import cupy

            return CupyModel(cupy, seconds)
        except ImportError:
            pass
        raise SystemExit("this example needs PyTorch or CuPy on a GPU (or --backend emulated)")
    return EmulatedModel(rt, seconds)


def transfers_alone(rt: ferry.Runtime, batches: list[np.ndarray]) -> None:
    for batch in batches:
        rt.upload(batch).wait()


def work_alone(model: Model, resident: Any, steps: int) -> None:
    model.finish([model.step(resident) for _ in range(steps)])


def serial(rt: ferry.Runtime, model: Model, batches: list[np.ndarray]) -> list[float]:
    sums = []
    for batch in batches:
        x = model.to_device(rt, batch)  # the host waits for the upload...
        sums += model.finish([model.step(x)])  # ...and for the work
    return sums


def prefetched(rt: ferry.Runtime, model: Model, batches: list[np.ndarray], depth: int) -> list[float]:
    checks = [model.step(x) for x in ferry.prefetch(batches, depth, runtime=rt, to=model.to, stream=model.stream)]
    return model.finish(checks)


async def prefetched_async(rt: ferry.Runtime, model: Model, batches: list[np.ndarray], depth: int) -> list[float]:
    checks = []
    async for x in ferry.prefetch(batches, depth, runtime=rt, to=model.to, stream=model.stream):
        checks.append(model.step(x))
        await asyncio.sleep(0)  # the event loop runs between steps
    return model.finish(checks)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--consume-ms", type=float, default=8.0)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--asyncio", action="store_true", help="consume with `async for`")
    args = parser.parse_args(argv)
    batches = make_batches(args.batches, args.mib << 20)
    with ferry.Runtime(args.backend) as rt:
        model = make_model(rt, args.consume_ms / 1e3)
        resident = model.to_device(rt, batches[0])
        # one untimed pass: the pinned pool, the staging lanes, and the device pool grown to what a
        # prefetch of this depth keeps alive (a cold pool grows during the first batches)
        transfers_alone(rt, batches[:2])
        serial(rt, model, batches[:2])
        prefetched(rt, model, batches, args.depth)
        t_transfer, _ = timed(lambda: transfers_alone(rt, batches))
        t_work, _ = timed(lambda: work_alone(model, resident, len(batches)))
        t_serial, got_serial = timed(lambda: serial(rt, model, batches))
        if args.asyncio:
            t_prefetch, got = timed(lambda: asyncio.run(prefetched_async(rt, model, batches, args.depth)))
        else:
            t_prefetch, got = timed(lambda: prefetched(rt, model, batches, args.depth))
        expected = [model.expected(b) for b in batches]
        for sums in (got_serial, got):
            assert np.allclose(sums, expected, rtol=1e-6), "a batch did not arrive intact"
        exposed = max(0.0, t_prefetch - max(t_work, t_transfer))  # beyond the longer of the two
        hidden = 1.0 - exposed / min(t_work, t_transfer) if min(t_work, t_transfer) > 0 else 0.0
        stats = rt.stats()
        print(f"ferry.prefetch on {rt.backend}: {len(batches)} batches of {args.mib} MiB, depth {args.depth}; "
              f"the model: {model.name}")
        print(f"  transfers alone        {t_transfer * 1e3:8.1f} ms")
        print(f"  device work alone      {t_work * 1e3:8.1f} ms")
        print(f"  serial schedule        {t_serial * 1e3:8.1f} ms")
        print(f"  ferry.prefetch         {t_prefetch * 1e3:8.1f} ms")
        print(f"  exposed beyond max(work, transfers) {exposed * 1e3:6.1f} ms: {max(hidden, 0.0) * 100:.1f} % of "
              f"the overlappable time hidden (every batch verified)")
        print(f"  device pool: {stats.device_pool_reserved_bytes / 2**20:.0f} MiB reserved (kept for the next "
              f"epoch; rt.trim() gives it back)")
    return {"transfer": t_transfer, "serial": t_serial, "prefetched": t_prefetch, "hidden": hidden}


if __name__ == "__main__":
    main()
