"""What pinning a pageable array in place costs, on a GPU: cuMemHostRegister and
cuMemHostUnregister per size, and a whole register -> DMA -> unregister round trip
against ferry's staged route.

    PYTHONPATH=src python3 benchmarks/probe_register.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from cuda.bindings import driver as d

import ferry

MiB = 1 << 20


def check(result: object) -> object:
    err = result[0] if isinstance(result, tuple) else result
    if int(err):
        raise RuntimeError(f"driver error {err}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def main() -> None:
    rt = ferry.Runtime("cuda")
    stream = check(d.cuStreamCreate(1))
    print(f"{'size':>8} {'register':>10} {'unregister':>11} {'dma':>9} {'on-the-fly GB/s':>16} {'staged GB/s':>12}")
    for n in (1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB):
        host = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)  # resident, as a user's array
        dev = rt.empty(n, np.uint8)
        reg, unreg, dma, total = [], [], [], []
        for _ in range(7):
            t0 = time.perf_counter()
            check(d.cuMemHostRegister(host.ctypes.data, n, 0))
            t1 = time.perf_counter()
            check(d.cuMemcpyHtoDAsync(dev.ptr, host.ctypes.data, n, stream))
            check(d.cuStreamSynchronize(stream))
            t2 = time.perf_counter()
            check(d.cuMemHostUnregister(host.ctypes.data))
            t3 = time.perf_counter()
            reg.append(t1 - t0)
            dma.append(t2 - t1)
            unreg.append(t3 - t2)
            total.append(t3 - t0)
        staged = []
        for _ in range(7):
            t0 = time.perf_counter()
            rt.upload(host, dev).wait()
            staged.append(time.perf_counter() - t0)
        med = statistics.median
        print(
            f"{n // MiB:>6}Mi {med(reg) * 1e6:>8.0f}us {med(unreg) * 1e6:>9.0f}us {med(dma) * 1e6:>7.0f}us "
            f"{n / med(total) / 1e9:>16.1f} {n / med(staged) / 1e9:>12.1f}",
            flush=True,
        )
        dev.close()
    rt.close()


if __name__ == "__main__":
    main()
