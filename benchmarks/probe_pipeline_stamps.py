"""``pipeline`` contenders interleaved round by round, every timed run's result arrivals kept.

    PYTHONPATH=src python3 benchmarks/probe_pipeline_stamps.py --mib 8 --work-ms 1 --rounds 8 --steps 60
        [--contenders work_only,prefetch,fresh,best] [--helpers N] [--lanes N] [--json FILE]

Per contender: the bench's sample (the least-squares slope of the arrivals, ``steady_step``) and the
two-ended difference it replaced, each run's; the per-step intervals' p50, p90 and max, and how many
exceed 1.5x the p50 (stalls). A slow run that is slow at every step differs from one that stalls now
and then, and a two-ended figure above the slope says an end stamp was late. ``--json`` keeps every
stamp. Needs a GPU and PyTorch (``--backend emulated`` for a smoke test).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import statistics
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

import ferry
from ferry._bench import _pipeline as pl
from ferry._bench._protocol import Result

RUNS: list[Any] = []
_Run = pl.Run


class RecordingRun(_Run):  # type: ignore[misc]
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        RUNS.append(self)


pl.Run = RecordingRun  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--work-ms", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--contenders", default="work_only,prefetch,fresh,best")
    ap.add_argument("--lanes", type=int, default=0)
    ap.add_argument("--helpers", type=int, default=-1)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    options: dict[str, int] = {}
    if args.lanes:
        options["lanes"] = args.lanes
    if args.helpers >= 0:
        options["lane_helpers"] = args.helpers
    rt = ferry.Runtime(args.backend, staging=ferry.StagingConfig(**options) if options else None)
    peers: dict[str, Any] = {}
    torch: Any = None
    if args.backend == "cuda":
        torch = importlib.import_module("torch")
        peers["torch"] = SimpleNamespace(torch=torch)
    ctx = SimpleNamespace(rt=rt, peers=peers)
    work = pl.make_work(ctx, args.work_ms * 1e-3, args.mib * pl.MiB)
    warmup = 4
    total = warmup + args.steps
    p = pl.Plan([], steps=args.steps, warmup=warmup, repeats=1)
    batches = pl.Batches(args.mib * pl.MiB, total)
    outs = [np.full(batches.n, np.nan, np.float32) for _ in range(total)]
    pinned = ([torch.empty(batches.n, dtype=torch.float32, pin_memory=True) for _ in range(total)]
              if torch is not None else [])
    impls = {"work_only": "floor", "transfers_only": "floor", "best": "torch", "cuda": "torch"}
    names = args.contenders.split(",")
    shifts = iter(range(1, 1 << 20))
    stamps: dict[str, list[list[float]]] = {n: [] for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    info = rt.info()
    print(f"# {args.mib} MiB {args.work_ms:g} ms, lanes {options or 'default'}: {info.get('staging_threads', '')}; "
          f"{work.detail}", flush=True)
    try:
        for _ in range(args.rounds):
            for name in names:
                result = Result("pipeline", impls.get(name, "ferry"), name, "both", args.mib * pl.MiB)
                RUNS.clear()
                pl._contend(result, p, work, batches, outs, pinned, shifts, ctx, torch, ferry.prefetch)
                if not result.valid:
                    print(f"{name}: INVALID {result.note}")
                    continue
                samples[name].extend(result.samples)
                stamps[name].append(list(RUNS[-1].stamps[warmup - 1:]))
    finally:
        work.close()
        rt.close()
    print(f"{'contender':12} {'slope':>9} {'2-ended':>9} {'min':>9} {'max':>9} | per-step interval p50 p90 max (us), "
          "stalls > 1.5x p50")
    for name in names:
        if not samples[name]:
            continue
        med = statistics.median(samples[name]) * 1e6
        two_ended = statistics.median((run[-1] - run[0]) / (len(run) - 1) for run in stamps[name]) * 1e6
        ivs = [b - a for run in stamps[name] for a, b in itertools.pairwise(run)]
        ivs_us = sorted(x * 1e6 for x in ivs)
        p50 = ivs_us[len(ivs_us) // 2]
        p90 = ivs_us[int(len(ivs_us) * 0.9)]
        stalls = sum(1 for x in ivs_us if x > 1.5 * p50)
        per_run = " ".join(f"{s * 1e6:.0f}" for s in samples[name])
        low, high = min(samples[name]) * 1e6, max(samples[name]) * 1e6
        print(f"{name:12} {med:9.1f} {two_ended:9.1f} {low:9.1f} {high:9.1f} | "
              f"{p50:7.1f} {p90:7.1f} {ivs_us[-1]:8.1f} {stalls:4d}/{len(ivs_us)}  runs: {per_run}")
    ratios = []
    if "prefetch" in samples and "best" in samples and samples["best"]:
        ratios = [a / b for a, b in zip(samples["prefetch"], samples["best"], strict=True)]
        print("paired prefetch/best per round:", " ".join(f"{r:.4f}" for r in ratios),
              f"median {statistics.median(ratios):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": samples, "stamps": stamps}, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
