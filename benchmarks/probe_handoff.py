"""Where the time of a download submitted right after a producer kernel goes, on a GPU with CuPy.

    PYTHONPATH=src python3 benchmarks/probe_handoff.py

Times each step of ``download_pending`` on a foreign (CuPy) array whose producer
kernel is still running, against the same submission with the producer idle.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

import cupy

import ferry
from ferry import Runtime

SPIN = r"""
extern "C" __global__ void spin(unsigned char* p, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    p[0] = 1;
}
"""

spent: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str) -> None:
    inner = getattr(Runtime, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            spent[name].append(time.perf_counter() - start)

    setattr(Runtime, name, wrapper)


def main() -> None:
    for name in ("_device_side", "_order_before", "_enqueue", "_maintain_if_needed", "download_pending"):
        timed(name)
    rt = ferry.Runtime("cuda")
    n = 8 << 20
    kernel = cupy.RawKernel(SPIN, "spin")
    clock_khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        array = cupy.zeros(n, cupy.uint8)
    buf = rt.pinned(n)
    for busy in (False, True, False, True):
        spent.clear()
        for _ in range(50):
            if busy:
                with stream:
                    kernel((1,), (1,), (array, cupy.int64(int(clock_khz * 1e3 * 10e-3))))
            else:
                time.sleep(0.01)
            with stream:
                _, buf = rt.download_pending(array, buf).wait()
        print("producer running" if busy else "producer idle   ", "  ".join(
            f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in spent.items()
        ))
    start = time.perf_counter()
    for _ in range(1000):
        _ = array.__cuda_array_interface__
    print(f"cupy __cuda_array_interface__: {(time.perf_counter() - start) * 1e3:.2f} us")
    buf.close()
    rt.close()


if __name__ == "__main__":
    main()
