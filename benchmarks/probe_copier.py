"""Where a mid-size pageable copy goes with the host copy shared by helper threads, on a GPU.

    PYTHONPATH=src python3 benchmarks/probe_copier.py [--sizes 1,4,8] [--helpers 0,1,3,5]

For each size (MiB) and direction it times, interleaved in rounds, with raw driver calls
(``cuda.bindings``, so every variant pays the same Python cost per call):

* ``driver``: the driver's own pageable copy (``cuMemcpyHtoD`` / ``cuMemcpyDtoH`` from a NumPy array);
* ``copier hN sK``: the payload copied between the array and a pinned block by a
  ``ferry._native._engine.Copier`` with N helpers (0: the caller alone), the DMA cut into K segments,
  each enqueued once its part is copied (upload), or one DMA then the copy out (download); then
  ``cuStreamSynchronize``; a download enqueues its K segments with an event each and copies each
  out once its event completed. ``nt`` marks streaming stores.

Median microseconds and GB/s of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from cuda.bindings import driver as d

from ferry._native._engine import Copier


def check(result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err):
        raise SystemExit(f"probe_copier: CUresult {int(err)}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def build(n: int, hp: int, op: int, dptr: int, pinned: int, stream: Any, events: list[Any],
          copiers: dict[tuple[int, int, bool], Copier], segments: list[int]) -> dict[str, Callable[[], None]]:
    """The variants of one size."""
    variants: dict[str, Callable[[], None]] = {
        "h2d driver": lambda: check(d.cuMemcpyHtoD(dptr, hp, n)),
        "d2h driver": lambda: check(d.cuMemcpyDtoH(op, dptr, n)),
    }
    for (h, p, nt), cp in copiers.items():
        for k in segments:
            seg = -(-n // k)

            def up(cp: Copier = cp, seg: int = seg, nt: bool = nt) -> None:
                for off in range(0, n, seg):
                    m = min(seg, n - off)
                    cp.copy(pinned + off, hp + off, m, nt)
                    check(d.cuMemcpyHtoDAsync(dptr + off, pinned + off, m, stream))
                check(d.cuStreamSynchronize(stream))

            variants[f"h2d copier h{h} s{k} p{p}{' nt' if nt else ''}"] = up
        for k in segments:
            seg = -(-n // k)

            def down(cp: Copier = cp, seg: int = seg, nt: bool = nt) -> None:
                parts = []
                for i, off in enumerate(range(0, n, seg)):
                    m = min(seg, n - off)
                    check(d.cuMemcpyDtoHAsync(pinned + off, dptr + off, m, stream))
                    check(d.cuEventRecord(events[i], stream))
                    parts.append((i, off, m))
                for i, off, m in parts:
                    check(d.cuEventSynchronize(events[i]))
                    cp.copy(op + off, pinned + off, m, nt)

            variants[f"d2h copier h{h} s{k} p{p}{' nt' if nt else ''}"] = down
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--sizes", type=ints, default=[1, 4, 8])
    parser.add_argument("--helpers", type=ints, default=[0, 1, 3, 5])
    parser.add_argument("--segments", type=ints, default=[1, 2, 4])
    parser.add_argument("--piece-kib", type=ints, default=[128])
    parser.add_argument("--spin-us", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()
    check(d.cuInit(0))
    dev = check(d.cuDeviceGet(0))
    ctx = check(d.cuDevicePrimaryCtxRetain(dev))
    check(d.cuCtxSetCurrent(ctx))
    top = max(args.sizes) << 20
    pinned = int(check(d.cuMemHostAlloc(top, 1)))
    dptr = check(d.cuMemAlloc(top))
    stream = check(d.cuStreamCreate(1))
    events = [check(d.cuEventCreate(2)) for _ in range(max(args.segments))]  # CU_EVENT_DISABLE_TIMING
    copiers = {(h, p, nt): Copier(h, spin_us=args.spin_us, piece_bytes=p << 10) if h else Copier(0)
               for h in args.helpers for p in args.piece_kib for nt in (False, True)}
    for mib in args.sizes:
        n = mib << 20
        host = np.random.default_rng(mib).integers(0, 255, n, dtype=np.uint8)
        out = np.zeros_like(host)
        hp, op = host.ctypes.data, out.ctypes.data
        variants = build(n, hp, op, int(dptr), pinned, stream, events, copiers, args.segments)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()
        for _ in range(args.repeat):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        check(d.cuMemcpyDtoH(op, dptr, n))
        assert (out == host).all(), "probe_copier: the data did not survive"
        print(f"\n{mib} MiB")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:32s} {med * 1e6:9.1f} us {n / med / 1e9:6.1f} GB/s  min {min(ts) * 1e6:8.1f} us")
    for cp in copiers.values():
        cp.close()


if __name__ == "__main__":
    main()
