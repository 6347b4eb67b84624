"""The main thread's CPU time per ``next(it)`` of ferry.DataLoader, with a consumer that sleeps.

Batches shaped like the loader bench's image workload (one float32 array of N x 3 x H x W and one
int64 label array; smaller with ``--side``), worker processes (fork), persistent workers,
prefetch_factor 4. The consumer sleeps ``--step`` ms per batch (the model). The figure is
``time.thread_time()`` around ``next(it)`` (sleeping excluded), median and mean per batch over the
timed batches; ``--profile`` adds a cProfile (thread-time clock) split by module and the top functions.

Emulated device: ``python benchmarks/probe_loader_cpu.py``. The CUDA backend on the stand-in driver:
build ``gcc -O2 -shared -fPIC -o /tmp/fake/libcuda.so.1 benchmarks/fake_cuda.c -ldl`` and run with
``LD_LIBRARY_PATH=/tmp/fake ... --backend cuda``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import numpy as np

import ferry

POOL = 61


class Images:
    def __init__(self, side: int, length: int) -> None:
        rng = np.random.default_rng(0)
        self.pool = [rng.standard_normal((3, side, side), dtype=np.float32) for _ in range(POOL)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.pool[i % POOL], i


def _where(filename: str) -> str:
    if filename == "~":
        return "builtins"
    parts = filename.split("/")
    if "ferry" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("ferry"):])
    return parts[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="emulated")
    ap.add_argument("--side", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--step", type=float, nargs="+", default=[15.0, 4.0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25, help="functions listed by the profile")
    args = ap.parse_args()
    rt = ferry.Runtime(args.backend)
    total = args.warmup + args.steps
    dataset = Images(args.side, total * args.batch)
    loader = ferry.DataLoader(dataset, batch_size=args.batch, num_workers=args.workers, persistent_workers=True,
                              prefetch_factor=4, multiprocessing_context="fork", runtime=rt)
    mib = 3 * args.side * args.side * 4 * args.batch / 2**20
    print(f"backend {rt.backend}, {mib:.1f} MiB batches, {args.workers} workers")
    try:
        for x, _ in loader:  # the untimed epoch: workers start, the ring is sized
            del x
        for step in args.step:
            for _ in range(args.epochs):
                cpu = []
                it = iter(loader)
                for k in range(total):
                    before = time.thread_time()
                    x, y = next(it)
                    taken = time.thread_time() - before
                    if k >= args.warmup:
                        cpu.append(taken)
                    time.sleep(step / 1e3)
                    del x, y
                for _ in it:
                    pass
                q = statistics.quantiles(cpu, n=4)
                print(f"step {step:5.1f} ms: main-thread CPU per next() median {statistics.median(cpu) * 1e3:.3f} ms,"
                      f" quartiles {q[0] * 1e3:.3f}-{q[2] * 1e3:.3f} ms, min {min(cpu) * 1e3:.3f} ms,"
                      f" mean {statistics.fmean(cpu) * 1e3:.3f} ms, max {max(cpu) * 1e3:.3f} ms")
            if args.profile:
                profile = cProfile.Profile(time.thread_time)
                it = iter(loader)
                for k in range(total):
                    if k >= args.warmup:
                        profile.enable()
                    x, y = next(it)
                    if k >= args.warmup:
                        profile.disable()
                    time.sleep(step / 1e3)
                    del x, y
                for _ in it:
                    pass
                stats = pstats.Stats(profile)
                shares: dict[str, float] = {}
                for (filename, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
                    shares[_where(filename)] = shares.get(_where(filename), 0.0) + own
                spent = sum(shares.values())
                calls = sum(v[1] for v in stats.stats.values()) / args.steps  # type: ignore[attr-defined]
                driver = sum(v[2] for (f, _, name), v in stats.stats.items()  # type: ignore[attr-defined]
                             if f == "~" and ("htod_record" in name or "copy_batch" in name))
                print(f"  profile: {calls:.0f} calls per batch, {(spent - driver) / args.steps * 1e3:.3f} ms/batch"
                      " under the profiler outside the driver's copy calls: " + ", ".join(
                    f"{w} {100 * s / spent:.0f}%" for w, s in sorted(shares.items(), key=lambda kv: -kv[1])[:9]))
                top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]  # type: ignore[attr-defined]
                for (filename, line, name), (_, calls, own, cum, _) in top:
                    print(f"    {own / args.steps * 1e6:6.1f} us own {cum / args.steps * 1e6:6.1f} us cum "
                          f"{calls / args.steps:5.2f} calls  {_where(filename)}:{line}({name})")
    finally:
        loader.close()
        rt.close()


if __name__ == "__main__":
    main()
