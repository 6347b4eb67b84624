"""What one driver call costs from Python: cuda-bindings against ctypes, on a GPU.

    PYTHONPATH=src python3 benchmarks/probe_calls.py
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable

import numpy as np
from cuda.bindings import driver as d

import ferry
from ferry import testing
from ferry._runtime import parts_of


def per_call(fn: Callable[[], object], n: int = 20000) -> float:
    for _ in range(1000):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples) * 1e9


def main() -> None:
    rt = ferry.Runtime("cuda")
    be = testing.backend_of(rt)
    stream, event = parts_of(rt).h2d, be.event_create()
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    hptr, dptr = buf.ptr, dev.ptr
    lib = ctypes.CDLL("libcuda.so.1")
    cp = getattr(lib, "cuMemcpyHtoDAsync_v2", None) or lib.cuMemcpyHtoDAsync  # the stand-in driver has no _v2
    q, rec, sync = lib.cuEventQuery, lib.cuEventRecord, lib.cuEventSynchronize
    q.argtypes = [ctypes.c_void_p]
    rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    cp.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    sync.argtypes = [ctypes.c_void_p]
    ev_i, st_i = int(event), int(stream)
    d.cuEventRecord(event, stream)
    d.cuEventSynchronize(event)
    rows = {
        "bindings cuEventQuery": per_call(lambda: d.cuEventQuery(event)),
        "ctypes   cuEventQuery": per_call(lambda: q(ev_i)),
        "bindings cuEventRecord": per_call(lambda: d.cuEventRecord(event, stream)),
        "ctypes   cuEventRecord": per_call(lambda: rec(ev_i, st_i)),
        "bindings copy+record+sync 16 B": per_call(
            lambda: (d.cuMemcpyHtoDAsync(dptr, hptr, 16, stream), d.cuEventRecord(event, stream),
                     d.cuEventSynchronize(event)), 5000),
        "ctypes   copy+record+sync 16 B": per_call(
            lambda: (cp(dptr, hptr, 16, st_i), rec(ev_i, st_i), sync(ev_i)), 5000),
        # what ferry's wait() does instead of cuEventSynchronize: poll cuEventQuery (interruptible)
        "bindings copy+record+event_wait 16 B": per_call(
            lambda: (d.cuMemcpyHtoDAsync(dptr, hptr, 16, stream), d.cuEventRecord(event, stream),
                     be.event_wait(event, 1.0)), 5000),
    }
    calls = be._calls
    if calls is not None:  # the compiled path's own calls, no Python between them
        rows["compiled htod_record+event_wait 16 B"] = per_call(
            lambda: (calls.htod_record(dptr, hptr, 16, st_i, ev_i), calls.event_wait(ev_i, 1.0)), 5000)
        rows["compiled htod_record+event_synchronize 16 B"] = per_call(
            lambda: (calls.htod_record(dptr, hptr, 16, st_i, ev_i), calls.event_synchronize(ev_i)), 5000)

    def ctypes_poll() -> None:
        cp(dptr, hptr, 16, st_i)
        rec(ev_i, st_i)
        while q(ev_i) == 600:
            pass

    rows["ctypes   copy+record+query loop 16 B"] = per_call(ctypes_poll, 5000)
    box = {"b": buf, "d": dev}
    up = rt.upload_pending
    split = {"submit": 0.0, "wait": 0.0, "n": 0}

    def ferry_split() -> None:
        clock = time.perf_counter
        t0 = clock()
        p = up(box["b"], box["d"])
        t1 = clock()
        box["b"], box["d"] = p.wait()
        t2 = clock()
        split["submit"] += t1 - t0
        split["wait"] += t2 - t1
        split["n"] += 1

    per_call(ferry_split, 5000)
    rows["ferry upload_pending alone (in the loop)"] = split["submit"] / split["n"] * 1e9
    rows["ferry wait alone (in the loop)"] = split["wait"] / split["n"] * 1e9

    def ferry_rt() -> None:
        box["b"], box["d"] = rt.upload_pending(box["b"], box["d"]).wait()

    rows["ferry upload_pending+wait 16 B"] = per_call(ferry_rt, 5000)
    # ferry's own Python: the same with the device calls replaced by no-ops
    be.memcpy_htod = lambda *a: None
    be.htod_record = lambda *a: None
    be.event_record = lambda *a: None
    be.event_synchronize = lambda *a: None
    be.event_wait = lambda *a: True
    rows["ferry python only (no device calls)"] = per_call(ferry_rt, 20000)
    for name, ns in rows.items():
        print(f"{name:40s} {ns / 1000:8.2f} us")


if __name__ == "__main__":
    main()
