"""One ``pipeline`` configuration, its contenders interleaved round by round, for A/B questions.

    PYTHONPATH=src python3 benchmarks/probe_pipeline.py --mib 8 --work-ms 1 [--steps 60] [--rounds 5]
        [--contenders prefetch,fresh,best,work_only] [--host-wait-hand-off] [--nap-off] [--no-mark]
        [--lanes N] [--helpers N] [--stamps [--json FILE]]

The bench's ``pipeline`` group runs each contender's repeats back to back, so a drift of the machine
(clocks, other tenants) lands on one contender. Here every round runs each contender once, in turn,
on the same calibrated device work and the same batches; the report gives each contender's median
and min over rounds of the per-step wall time (steady state, as in the group), with every result
verified. ``--host-wait-hand-off`` adds variants of the ferry contenders whose staged hand-off
waits on the host for the whole upload (the native engine's behaviour before its hand-off by
posted events), to compare the two on one machine; ``--nap-off`` adds variants whose waits sleep on the watcher at
once past their spin (as before the nap), ``--no-mark`` one of ``ferry.prefetch`` without its
per-step mark on the consumer's stream. Needs a GPU and PyTorch (or CuPy).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import itertools
import json
import pstats
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

import ferry
from ferry import _completion
from ferry._bench import _pipeline as pl
from ferry._bench._protocol import Result
from ferry._prefetch import Prefetcher
from ferry._routes import _native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--contenders", default="work_only,transfers_only,fresh,ring,prefetch,best")
    parser.add_argument("--host-wait-hand-off", action="store_true")
    parser.add_argument("--nap-off", action="store_true",
                        help="add variants of the ferry contenders whose waits do not nap past their spin "
                             "(they sleep on the watcher's wake-up at once, as before the nap)")
    parser.add_argument("--no-mark", action="store_true",
                        help="add a variant of ferry.prefetch without its per-step mark on the consumer's stream")
    parser.add_argument("--backend", default="cuda", help="cuda, or emulated for a smoke test")
    parser.add_argument("--lanes", type=int, default=0, help="StagingConfig(lanes=...) (0: the default)")
    parser.add_argument("--helpers", type=int, default=-1,
                        help="StagingConfig(lane_helpers=...) (-1: the default, auto)")
    parser.add_argument("--stamps", action="store_true",
                        help="keep every timed run's result arrivals: the two-ended figure beside the slope, "
                             "and the per-step intervals (p50, p90, max, stalls over 1.5x p50)")
    parser.add_argument("--json", default="", metavar="FILE", help="with --stamps: write every stamp there")
    parser.add_argument("--phases", action="store_true",
                        help="also time the host's phases of the hand-written fresh pipeline")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="with --phases: run it again under cProfile and print the N costliest functions")
    args = parser.parse_args()

    options: dict[str, int] = {}
    if args.lanes:
        options["lanes"] = args.lanes
    if args.helpers >= 0:
        options["lane_helpers"] = args.helpers
    staging = ferry.StagingConfig(**options) if options else None
    rt = ferry.Runtime(args.backend, staging=staging)
    peers: dict[str, Any] = {}
    torch: Any = None
    if args.backend == "cuda":
        try:
            torch = importlib.import_module("torch")
            peers["torch"] = SimpleNamespace(torch=torch)
        except ImportError:
            pass
    ctx = SimpleNamespace(rt=rt, peers=peers)
    work = pl.make_work(ctx, args.work_ms * 1e-3, args.mib * pl.MiB)
    warmup = 4
    total = warmup + args.steps
    p = pl.Plan([], steps=args.steps, warmup=warmup, repeats=1)
    batches = pl.Batches(args.mib * pl.MiB, total)
    outs = [np.full(batches.n, np.nan, np.float32) for _ in range(total)]
    pinned_outs = ([torch.empty(batches.n, dtype=torch.float32, pin_memory=True) for _ in range(total)]
                   if torch is not None else [])
    impls = {"work_only": "floor", "transfers_only": "floor", "best": "torch", "cuda": "torch"}
    names = [c for c in args.contenders.split(",") if c]
    variants: list[tuple[str, str, str]] = []  # label, route, patch ("": none)
    for name in names:
        variants.append((name, name, ""))
        ours = impls.get(name, "ferry") in ("ferry", "floor") and name != "work_only"
        if args.host_wait_hand_off and ours:
            variants.append((f"{name}+host_wait", name, "host_wait"))
        if args.nap_off and ours:
            variants.append((f"{name}+nap_off", name, "nap_off"))
        if args.no_mark and name == "prefetch":
            variants.append((f"{name}+no_mark", name, "no_mark"))
    events_order_after = _native.NativeEngine.order_after
    nap_window = _completion.NAP_WINDOW
    mark = Prefetcher._mark

    def host_wait(self: Any, job: Any, stream: Any) -> None:
        if self.cuda:
            job.wait_done()
        else:
            events_order_after(self, job, stream)

    samples: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    stamps: dict[str, list[list[float]]] = {label: [] for label, _, _ in variants}

    def no_mark(self: Any, stream: Any) -> None:
        return None

    runs = _keep_runs() if args.stamps else []
    notes: dict[str, str] = {}
    shifts = iter(range(1, 1 << 20))
    print(f"# {rt.info()['name']}: {args.mib} MiB, {args.work_ms:g} ms of {work.kind} work per step; "
          f"{args.steps} timed steps, {args.rounds} rounds; {work.detail}")
    try:
        for _ in range(args.rounds):
            for label, route, patch in variants:
                _native.NativeEngine.order_after = (  # type: ignore[method-assign]
                    host_wait if patch == "host_wait" else events_order_after)
                _completion.NAP_WINDOW = 0.0 if patch == "nap_off" else nap_window
                Prefetcher._mark = no_mark if patch == "no_mark" else mark  # type: ignore[method-assign]
                result = Result("pipeline", impls.get(route, "ferry"), route, "both", args.mib * pl.MiB)
                runs.clear()
                pl._contend(result, p, work, batches, outs, pinned_outs, shifts, ctx, torch, ferry.prefetch)
                if not result.valid:
                    notes[label] = result.note
                samples[label].extend(result.samples)
                if runs and result.samples:
                    stamps[label].append(list(runs[-1].stamps[warmup - 1:]))  # the drain too
        if args.phases:
            phases(rt, work, batches, outs, total, warmup)
            phases(rt, work, batches, outs, total, warmup, keep=True)
            if args.profile:
                profiler = cProfile.Profile()
                profiler.runcall(phases, rt, work, batches, outs, total, warmup)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        if args.profile and "prefetch" in names:
            print("# one timed run of the prefetch contender under cProfile")
            profiler = cProfile.Profile()
            result = Result("pipeline", "ferry", "prefetch", "both", args.mib * pl.MiB)
            profiler.runcall(pl._contend, result, p, work, batches, outs, pinned_outs, shifts, ctx, torch,
                             ferry.prefetch)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    finally:
        _native.NativeEngine.order_after = events_order_after  # type: ignore[method-assign]
        _completion.NAP_WINDOW = nap_window
        Prefetcher._mark = mark  # type: ignore[method-assign]
        work.close()
        rt.close()
    print(f"{'contender':28} {'median':>10} {'min':>10} {'max':>10}  (per step)")
    for label, values in samples.items():
        if values:
            print(f"{label:28} {statistics.median(values) * 1e6:9.1f}us {min(values) * 1e6:9.1f}us "
                  f"{max(values) * 1e6:9.1f}us  {notes.get(label, '')}")
        else:
            print(f"{label:28} no sample  {notes.get(label, '')}")
    if args.stamps:
        print_stamps(stamps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "samples": samples, "stamps": stamps}, f)


def _keep_runs() -> list[Any]:
    """Make the group keep each run it makes (the last one is the timed run of a ``_contend``)."""
    kept: list[Any] = []

    class KeptRun(pl.Run):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            kept.append(self)

    pl.Run = KeptRun  # type: ignore[misc]
    return kept


def print_stamps(stamps: dict[str, list[list[float]]]) -> None:
    """Per contender, medians over runs: the slope of the steady state (the bench's sample: the
    drain, the last result, left out), the two-ended figure over the same stamps, and the drain's
    own interval; the steady state's per-step intervals (p50, p90, max) and how many exceed 1.5x
    the p50."""
    print(f"{'contender':28} {'slope':>9} {'2-ended':>9} {'drain':>9} | per-step interval p50, p90, max; "
          "stalls > 1.5x p50")
    for label, runs in stamps.items():
        if not runs:
            continue
        steady = [run[:-1] for run in runs]  # the stamps from warmup - 1 on: as run_sample takes them
        slope = statistics.median(pl.steady_step(run) for run in steady) * 1e6
        two_ended = statistics.median((run[-1] - run[0]) / (len(run) - 1) for run in steady) * 1e6
        drain = statistics.median(run[-1] - run[-2] for run in runs) * 1e6
        intervals = sorted((b - a) * 1e6 for run in steady for a, b in itertools.pairwise(run))
        p50 = intervals[len(intervals) // 2]
        p90 = intervals[int(len(intervals) * 0.9)]
        stalls = sum(1 for x in intervals if x > 1.5 * p50)
        print(f"{label:28} {slope:8.1f}us {two_ended:8.1f}us {drain:8.1f}us | {p50:.1f}, {p90:.1f}, "
              f"{intervals[-1]:.1f} us; {stalls}/{len(intervals)}")


def phases(rt: Any, work: Any, batches: Any, outs: list[Any], total: int, warmup: int, keep: bool = False) -> None:
    """The hand-written fresh pipeline (``run_ferry``'s order), each host phase timed: where the
    main thread spends a step, and how long it sleeps in waits."""
    names = ["submit", "hand_off", "launch", "download", "finish"]
    spent = dict.fromkeys(names, 0.0)
    consumer = work.consumer()
    ups: list[Any] = []
    downs: list[Any] = []
    clock = time.perf_counter
    with contextlib.ExitStack() as stack:
        for out in outs:
            stack.enter_context(rt.register(out))
        for j in range(min(pl.DEPTH, total)):
            ups.append(rt.upload(batches.arrays[j]))
        start = 0.0
        for k in range(total):
            if k == warmup:
                spent = dict.fromkeys(names, 0.0)
                start = clock()
            t0 = clock()
            if k + pl.DEPTH < total:
                ups.append(rt.upload(batches.arrays[k + pl.DEPTH]))
            t1 = clock()
            upload = ups.pop(0)
            dev = upload.hand_off(consumer)
            t2 = clock()
            x = work.wrap(dev)
            y = work.step(x, 1.0)
            t3 = clock()
            downs.append((upload, rt.download(y, outs[k]), dev, y, x if keep else None))
            t4 = clock()
            if len(downs) > 1:
                up, down, *_ = downs.pop(0)
                down.wait()
                up.wait()
            t5 = clock()
            for name, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                spent[name] += dt
        elapsed = clock() - start
        for up, down, *_ in downs:
            down.wait()
            up.wait()
    steps = total - warmup
    print(f"phases of the fresh pipeline{' (inputs kept a step)' if keep else ''}, per step (us): "
          f"{elapsed / steps * 1e6:.1f} total; "
          + ", ".join(f"{name} {spent[name] / steps * 1e6:.1f}" for name in names))


if __name__ == "__main__":
    main()
