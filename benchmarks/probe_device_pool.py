"""Probe the stream-ordered device pool: the cost of a fresh array, and memory under a long prefetch.

    python benchmarks/probe_device_pool.py [--backend cuda] [--quick] [--batches 10000] [--mib 32]

1. ``rt.empty`` of 8 to 256 MiB from a warm pool (the target is <= 10 us), against
   the driver's own calls on the same machine: ``cuMemAllocFromPoolAsync`` plus the
   synchronization of ferry's allocation stream (what ``rt.empty`` pays the driver),
   and ``cuMemAlloc`` + ``cuMemFree`` (what a fresh array cost before the pool).
   Each figure is the median over many calls; each ``rt.empty`` is dropped at
   once, so its free is issued (stream-ordered) by the next call, as in a loop.
2. ``--batches`` pageable batches of ``--mib`` MiB through ``ferry.prefetch``
   (to PyTorch when it is installed, with a matrix product per batch as the
   model; else ferry arrays read on a side stream), printing the pool's reserved
   and used bytes every tenth of the run: the reserved bytes must stop growing.

Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import ferry
from ferry import testing
from ferry._runtime import parts_of

MiB = 1 << 20


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def empty_costs(rt: ferry.Runtime, sizes: list[int], reps: int) -> None:
    print(f"fresh device arrays ({rt.backend}, {rt.info().get('device_pool')}), median of {reps} calls")
    print(f"{'size':>8} | {'rt.empty':>10} | {'pool alloc + sync':>17} | {'cuMemAlloc + cuMemFree':>22}")
    backend = testing.backend_of(rt)
    memory = parts_of(rt).memory
    for n in sizes:
        for _ in range(3):  # warm: the pool reserves this size once
            rt.empty(n, np.uint8)
        rt.poll()
        fresh = []
        for _ in range(reps):
            start = time.perf_counter()
            dev = rt.empty(n, np.uint8)  # also issues the free of the previous one (deferred)
            fresh.append(time.perf_counter() - start)
            del dev
        rt.poll()
        pool = []
        if memory.pool is not None:
            for _ in range(reps):
                start = time.perf_counter()
                ptr = backend.mem_pool_alloc(memory.pool, n, memory.alloc_stream)
                pool.append(time.perf_counter() - start)
                backend.mem_free_async(ptr, memory.alloc_stream)
        legacy = []
        for _ in range(max(3, reps // 10)):  # slow: fewer calls
            start = time.perf_counter()
            ptr = backend.mem_alloc(n)
            backend.mem_free(ptr)
            legacy.append(time.perf_counter() - start)
        pool_us = f"{_median_us(pool):.1f} us" if pool else "n/a (no pool)"
        print(f"{n // MiB:>5} MiB | {_median_us(fresh):>7.1f} us | {pool_us:>17} | {_median_us(legacy):>19.1f} us")


def _model(torch: Any) -> Any:
    weight = torch.randn(256, 256, device="cuda")

    def step(x: Any) -> Any:
        rows = x.view(-1, 256)[:4096]
        return (rows @ weight).sum()

    return step


def long_prefetch(rt: ferry.Runtime, batches: int, nbytes: int) -> None:
    try:
        import torch

        use_torch = rt.backend == "cuda" and torch.cuda.is_available()
    except ImportError:
        use_torch = False
    pool = [np.random.default_rng(k).standard_normal(nbytes // 4).astype(np.float32) for k in range(8)]
    consumer = "PyTorch matmul per batch" if use_torch else "a read on a side stream per batch"
    print(f"\n{batches} batches of {nbytes // MiB} MiB through ferry.prefetch ({consumer})")
    print(f"{'batches':>8} | {'reserved':>12} | {'used':>12} | {'elapsed':>8}")
    source = (pool[k % len(pool)] for k in range(batches))
    every = max(1, batches // 10)
    start = time.perf_counter()
    reserved = []
    if use_torch:
        step = _model(torch)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for k, x in enumerate(ferry.prefetch(source, runtime=rt, to="torch")):
                y = step(x)
                if k % every == every - 1:
                    y.item()  # a training loop's occasional sync (a logged loss)
                    stats = rt.stats()
                    reserved.append(stats.device_pool_reserved_bytes)
                    print(f"{k + 1:>8} | {stats.device_pool_reserved_bytes / MiB:>8.1f} MiB | "
                          f"{stats.device_pool_used_bytes / MiB:>8.1f} MiB | {time.perf_counter() - start:>6.1f} s")
    else:
        side = testing.side_stream(rt)
        for k, dev in enumerate(ferry.prefetch(source, runtime=rt, stream=side)):
            if rt.backend == "emulated":
                testing.consume(rt, side, dev._ptr, 4096).result()
            if k % every == every - 1:
                stats = rt.stats()
                reserved.append(stats.device_pool_reserved_bytes)
                print(f"{k + 1:>8} | {stats.device_pool_reserved_bytes / MiB:>8.1f} MiB | "
                      f"{stats.device_pool_used_bytes / MiB:>8.1f} MiB | {time.perf_counter() - start:>6.1f} s")
    half = reserved[len(reserved) // 2:]
    verdict = "stopped growing" if half and max(half) == min(half) else "still changing in the second half"
    print(f"reserved bytes over the second half of the run: {verdict} (max {max(reserved) / MiB:.1f} MiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--quick", action="store_true", help="fewer calls and batches")
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--mib", type=int, default=32)
    args = parser.parse_args(argv)
    sizes = [8 * MiB, 32 * MiB, 64 * MiB, 256 * MiB]
    with ferry.Runtime(args.backend) as rt:
        empty_costs(rt, sizes, reps=100 if args.quick else 1000)
    with ferry.Runtime(args.backend) as rt:
        long_prefetch(rt, args.batches // 10 if args.quick else args.batches, args.mib * MiB)


if __name__ == "__main__":
    main()
