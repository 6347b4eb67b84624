"""What one staging chunk's enqueue costs the calling thread, on a GPU: ``cuMemcpyHtoDAsync`` (or
``DtoH``) from pinned memory plus ``cuEventRecord``, timed alone, by size, by event kind, and with
other threads copying host memory at the same time (as the staging lanes do).

    PYTHONPATH=src python3 benchmarks/probe_enqueue.py

The calls are the compiled ones (``ferry._native`` ``Calls``, one C call: copy then record, no GIL
release); each sample times that call alone (the device is idle: the previous copy was waited for
outside the timing). Median of ``--repeat`` samples, microseconds. ``--busy N`` adds N threads that
``memmove`` 8 MiB between pageable buffers in a loop (the GIL released) while the samples are taken.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from typing import Any

import numpy as np
from cuda.bindings import driver as d

import ferry
from ferry import testing
from ferry._native._engine import memcopy


def check(result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err):
        raise SystemExit(f"probe_enqueue: CUresult {int(err)}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=60)
    parser.add_argument("--busy", type=lambda s: [int(x) for x in s.split(",")], default=[0, 7])
    args = parser.parse_args()
    rt = ferry.Runtime("cuda")
    be = testing.backend_of(rt)
    calls = be._calls
    if calls is None:
        raise SystemExit("probe_enqueue: the compiled calls are not in use (build the extension)")
    sizes = [16, 64 << 10, 1 << 20, 4 << 20]
    top = max(sizes)
    portable = int(check(d.cuMemHostAlloc(top, 1)))  # CU_MEMHOSTALLOC_PORTABLE, as the lanes' slots
    plain = int(check(d.cuMemHostAlloc(top, 0)))
    dev = int(check(d.cuMemAlloc(top)))
    stream = int(check(d.cuStreamCreate(1)))  # non-blocking, as a lane's
    ev_plain = be.event_create(blocking=False)
    ev_blocking = be.event_create(blocking=True)
    stop = threading.Event()
    source = np.ones(1 << 20, np.uint8)

    def busy() -> None:
        a, b = np.ones(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
        while not stop.is_set():
            ctypes.memmove(b.ctypes.data, a.ctypes.data, a.nbytes)

    for nbusy in args.busy:
        threads = [threading.Thread(target=busy, daemon=True) for _ in range(nbusy)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        print(f"-- {nbusy} other threads copying host memory")
        print(f"{'what':44s} " + " ".join(f"{n:>9d}B" for n in sizes))
        for label, host, ev, upload, before in (
            ("h2d portable pinned, blocking-sync event", portable, ev_blocking, True, None),
            ("h2d portable pinned, spinning event", portable, ev_plain, True, None),
            ("h2d plain pinned, spinning event", plain, ev_plain, True, None),
            ("h2d portable pinned, no event", portable, 0, True, None),
            ("d2h portable pinned, blocking-sync event", portable, ev_blocking, False, None),
            # what a lane does: its chunk's host copy (1 MiB into the pinned slot) right before the enqueue
            ("h2d after a 1 MiB memcpy into the slot", portable, ev_blocking, True, False),
            ("h2d after a 1 MiB streaming copy", portable, ev_blocking, True, True),
        ):
            row = []
            for n in sizes:
                samples = []
                for _ in range(args.repeat):
                    if before is not None:
                        memcopy(portable, source.ctypes.data, source.nbytes, before)
                    t0 = time.perf_counter()
                    if upload:
                        calls.htod_record(dev, host, n, stream, ev)
                    else:
                        calls.dtoh_record(host, dev, n, stream, ev)
                    t1 = time.perf_counter()
                    check(d.cuStreamSynchronize(stream))
                    samples.append(t1 - t0)
                row.append(statistics.median(samples) * 1e6)
            print(f"{label:44s} " + " ".join(f"{v:9.2f}us" for v in row))
        samples = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            calls.event_record(ev_blocking, stream)
            samples.append(time.perf_counter() - t0)
            check(d.cuStreamSynchronize(stream))
        print(f"{'cuEventRecord alone (blocking-sync event)':44s} {statistics.median(samples) * 1e6:9.2f}us")
        stop.set()
        for t in threads:
            t.join()
        stop.clear()
    a, b = np.ones(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    for nt in (False, True):
        best = min(timed(lambda nt=nt: memcopy(b.ctypes.data, a.ctypes.data, a.nbytes, nt)) for _ in range(20))
        print(f"8 MiB host copy, {'streaming' if nt else 'memcpy'}: {a.nbytes / best / 1e9:.1f} GB/s")
    rt.close()


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
