"""A small pinned round trip, ferry against the raw bindings loop, timed interleaved.

On the stand-in driver with a device latency (``FAKECUDA_LATENCY_NS``, see fake_cuda.c) this shows
ferry's critical-path cost (its work before the copy is enqueued and after the copy's completion is
noticed) on a CPU machine; on a GPU it measures the real thing::

    gcc -O2 -shared -fPIC -o /tmp/fake/libcuda.so.1 benchmarks/fake_cuda.c -ldl
    LD_LIBRARY_PATH=/tmp/fake FAKECUDA_LATENCY_NS=5000 PYTHONPATH=src python3 benchmarks/probe_small_latency.py
    PYTHONPATH=src python3 benchmarks/probe_small_latency.py          # on a GPU

Each round times a block of each case in turn, so a host that changes speed affects all alike.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import numpy as np
from cuda.bindings import driver as d

import ferry
from ferry import testing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nbytes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--pageable", action="store_true", help="rt.upload / rt.download of a NumPy array instead")
    args = parser.parse_args()
    n = args.nbytes
    rt = ferry.Runtime("cuda")
    be = testing.backend_of(rt)
    stream, event = be.stream_create(), be.event_create()
    hbuf, dev = rt.pinned(n), rt.empty(n, np.uint8)
    rbuf, rdev = rt.pinned(n), rt.empty(n, np.uint8)
    hptr, dptr = rbuf.ptr, rdev.ptr
    host = np.zeros(n, np.uint8)
    if args.pageable:  # the raw driver's own pageable copy, from and to a NumPy array
        hptr = host.ctypes.data
    copy_h2d, copy_d2h, record, sync = d.cuMemcpyHtoDAsync, d.cuMemcpyDtoHAsync, d.cuEventRecord, d.cuEventSynchronize
    box = {"b": hbuf, "d": dev}
    up, down = rt.upload_pending, rt.download_pending

    def raw_h2d() -> None:
        copy_h2d(dptr, hptr, n, stream)
        record(event, stream)
        sync(event)

    def raw_d2h() -> None:
        copy_d2h(hptr, dptr, n, stream)
        record(event, stream)
        sync(event)

    def ferry_h2d() -> None:
        box["b"], box["d"] = up(box["b"], box["d"]).wait()

    def ferry_d2h() -> None:
        box["d"], box["b"] = down(box["d"], box["b"]).wait()

    if args.pageable:
        upload, download = rt.upload, rt.download

        def ferry_h2d() -> None:
            _, box["d"] = upload(host, box["d"]).wait()

        def ferry_d2h() -> None:
            box["d"], _ = download(box["d"], host).wait()

    cases: dict[str, Callable[[], None]] = {
        "raw h2d": raw_h2d, "ferry h2d": ferry_h2d, "raw d2h": raw_d2h, "ferry d2h": ferry_d2h,
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    split: dict[str, list[tuple[int, int]]] = {k: [] for k in cases}
    last = _stand_in_split()
    clock = time.perf_counter
    for op in cases.values():
        for _ in range(args.block):
            op()
    for _ in range(args.rounds):
        for name, op in cases.items():
            s = samples[name]
            for _ in range(args.block):
                t0 = clock()
                op()
                t1 = clock()
                s.append(t1 - t0)
                if last is not None:
                    copied, done = last()
                    split[name].append((copied - int(t0 * 1e9), int(t1 * 1e9) - done))
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    for k, v in med.items():
        print(f"{k:10s} median {v:7.2f} us  min {min(samples[k]) * 1e6:7.2f} us")
    if last is not None:
        print("the stand-in's split: the caller's work before the copy's enqueue / after its completion")
        for k, v in split.items():
            before = statistics.median(b for b, _ in v) / 1e3
            after = statistics.median(a for _, a in v) / 1e3
            print(f"{k:10s} before {before:6.2f} us  after {after:6.2f} us")
    for direction in ("h2d", "d2h"):
        f, r = med["ferry " + direction], med["raw " + direction]
        print(f"{direction}: ferry / raw = {f / r:.3f}x (+{f - r:.2f} us)")
    box["b"].close()
    rbuf.close()
    rt.close()


def _stand_in_split() -> Callable[[], tuple[int, int]] | None:
    """The stand-in driver's (enqueue, completion) times of the last copy, when it keeps them."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").fake_last_copy
    except (OSError, AttributeError):
        return None
    out = (ctypes.c_ulonglong * 2)()

    def last() -> tuple[int, int]:
        fn(out)
        return out[0], out[1]

    return last


if __name__ == "__main__":
    main()
