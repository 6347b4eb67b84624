"""A quick probe of ferry's hot paths against the raw driver on a GPU.

Not the benchmark (that is ``python -m ferry bench``): a short sanity pass to
run right after the test suite in one device call.
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
from cuda.bindings import driver as d

import ferry


def median_us(fn, repeat: int = 2000, warmup: int = 200) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def main() -> None:
    rt = ferry.Runtime("cuda")
    backend = rt._backend
    stream = rt._h2d
    event = backend.event_create()
    small = rt.pinned(16)
    dev = rt.empty(16, np.uint8)
    hptr, dptr = small.ptr, dev.ptr

    def raw() -> None:
        d.cuMemcpyHtoDAsync(dptr, hptr, 16, stream)
        d.cuEventRecord(event, stream)
        d.cuEventSynchronize(event)

    state = {"buf": small, "dev": dev}

    def ferry_rt() -> None:
        state["buf"], state["dev"] = rt.upload_pending(state["buf"], state["dev"]).wait()

    print(f"16 B upload submit+wait: raw {median_us(raw):.2f} us, ferry {median_us(ferry_rt):.2f} us")

    n = 256 << 20
    big = rt.pinned(n)
    bdev = rt.empty(n, np.uint8)
    for direction in ("h2d", "d2h"):
        def raw_big() -> None:
            if direction == "h2d":
                d.cuMemcpyHtoDAsync(bdev.ptr, big.ptr, n, stream)
            else:
                d.cuMemcpyDtoHAsync(big.ptr, bdev.ptr, n, stream)
            d.cuEventRecord(event, stream)
            d.cuEventSynchronize(event)

        box = {"b": big, "d": bdev}

        def ferry_big() -> None:
            if direction == "h2d":
                box["b"], box["d"] = rt.upload_pending(box["b"], box["d"]).wait()
            else:
                box["d"], box["b"] = rt.download_pending(box["d"], box["b"]).wait()

        t_raw = median_us(raw_big, 20, 3)
        t_f = median_us(ferry_big, 20, 3)
        print(f"256 MiB {direction}: raw {n / t_raw / 1e3:.1f} GB/s, ferry {n / t_f / 1e3:.1f} GB/s")

    # Does waiting release the GIL? Count a Python loop in another thread during a wait.
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    c0 = count[0]
    start = time.perf_counter()
    for _ in range(10):
        big, bdev = rt.upload_pending(big, bdev).wait()
    elapsed = time.perf_counter() - start
    c1 = count[0]
    stop.set()
    t.join()
    print(f"other thread ran {c1 - c0} iterations during {elapsed * 1e3:.1f} ms of waits")
    print(rt.stats())
    rt.close()


if __name__ == "__main__":
    main()
