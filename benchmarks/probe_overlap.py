"""Is an 8 MiB copy hidden behind host work? ferry against the raw driver, same schedule.

    PYTHONPATH=src python3 benchmarks/probe_overlap.py
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
from cuda.bindings import driver as d

import ferry
from ferry import testing
from ferry._bench._groups import _calibrate, host_work
from ferry._bench._protocol import Budget, measure

MiB = 1 << 20


def median_us(fn: Callable[[], object], reps: int = 300) -> float:
    return statistics.median(measure(fn, Budget(seconds=0.0, min_reps=reps, max_reps=reps, warmup=20))) * 1e6


def main() -> None:
    rt = ferry.Runtime("cuda")
    n = 8 * MiB
    box = {"dev": rt.to_device(np.arange(n, dtype=np.uint8)), "buf": rt.pinned(n)}

    def copy() -> None:
        box["dev"], box["buf"] = rt.download_pending(box["dev"], box["buf"]).wait()

    t_copy = median_us(copy)
    iterations = _calibrate(t_copy * 0.9e-6)
    t_host = median_us(lambda: host_work(iterations))

    def overlapped() -> None:
        p = rt.download_pending(box["dev"], box["buf"])
        host_work(iterations)
        box["dev"], box["buf"] = p.wait()

    def overlapped_poll() -> None:
        p = rt.download_pending(box["dev"], box["buf"])
        p.is_ready()
        host_work(iterations)
        box["dev"], box["buf"] = p.wait()

    be = testing.backend_of(rt)
    stream, event = be.stream_create(), be.event_create()
    hptr, dptr = box["buf"].ptr, box["dev"].ptr

    def raw_overlapped() -> None:
        d.cuMemcpyDtoHAsync(hptr, dptr, n, stream)
        d.cuEventRecord(event, stream)
        host_work(iterations)
        d.cuEventSynchronize(event)

    def raw_overlapped_query() -> None:
        d.cuMemcpyDtoHAsync(hptr, dptr, n, stream)
        d.cuEventRecord(event, stream)
        d.cuStreamQuery(stream)
        host_work(iterations)
        d.cuEventSynchronize(event)

    print(f"copy {t_copy:.1f} us, host {t_host:.1f} us")
    for name, fn in (("ferry overlapped", overlapped), ("ferry overlapped + is_ready", overlapped_poll),
                     ("raw overlapped", raw_overlapped), ("raw overlapped + stream query", raw_overlapped_query)):
        t = median_us(fn)
        print(f"{name:32s} {t:8.1f} us = {t / max(t_copy, t_host):.3f}x max")


if __name__ == "__main__":
    main()
