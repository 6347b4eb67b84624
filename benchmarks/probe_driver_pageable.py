"""Does the driver's own pageable copy scale over threads? On a GPU.

    PYTHONPATH=src python3 benchmarks/probe_driver_pageable.py

Splits a pageable array into equal parts, each copied by its own worker thread
with one ``cuMemcpyHtoDAsync``/``cuMemcpyDtoHAsync`` on its own stream (the
driver stages pageable memory itself, inside the call, with the GIL released)
followed by a stream synchronize. Prints GB/s per size and thread count.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cuda.bindings import driver as d

import ferry
from ferry import testing

MiB = 1 << 20


def main() -> None:
    rt = ferry.Runtime("cuda")
    ctx = testing.backend_of(rt)._ctx
    local = threading.local()

    def stream() -> object:
        if not hasattr(local, "stream"):
            d.cuCtxSetCurrent(ctx)
            local.stream = d.cuStreamCreate(1)[1]
        return local.stream

    with ThreadPoolExecutor(16) as pool:
        for n in (8 * MiB, 32 * MiB, 256 * MiB):
            host = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
            out = np.empty_like(host)
            dev = rt.empty(n, np.uint8)
            cells = []
            hp, op, dp = host.ctypes.data, out.ctypes.data, dev.ptr
            for threads in (1, 2, 4, 8, 16):
                part = n // threads

                def up(i: int, part: int = part, hp: int = hp, dp: int = dp) -> None:
                    s = stream()
                    d.cuMemcpyHtoDAsync(dp + i * part, hp + i * part, part, s)
                    d.cuStreamSynchronize(s)

                def down(i: int, part: int = part, op: int = op, dp: int = dp) -> None:
                    s = stream()
                    d.cuMemcpyDtoHAsync(op + i * part, dp + i * part, part, s)
                    d.cuStreamSynchronize(s)

                result = []
                for fn in (up, down):
                    samples = []
                    for _ in range(9):
                        t = time.perf_counter()
                        list(pool.map(fn, range(threads)))
                        samples.append(time.perf_counter() - t)
                    result.append(n / statistics.median(samples[2:]) / 1e9)
                assert np.array_equal(out, host)
                cells.append(f"{threads:2d}t {result[0]:5.1f}/{result[1]:5.1f}")
            print(f"{n // MiB:4d} MiB up/down GB/s: " + "  ".join(cells), flush=True)
            dev.close()
    rt.close()


if __name__ == "__main__":
    main()
