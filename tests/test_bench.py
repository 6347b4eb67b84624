"""The bench groups' plumbing: ``pipeline``, ``gil`` and the ``host_copies`` ceiling run, verify
what they move, report, and feed the checks table. On the emulated device (and on a GPU, where
one is usable: the ``rt`` fixture's ``cuda`` parameter); the figures themselves are not asserted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import testing
from ferry._bench import _gil, _pipeline
from ferry._bench._groups import GROUPS, Context, case_count
from ferry._bench._peers import load_peers
from ferry._bench._protocol import Budget, Result, measure_interleaved
from ferry._bench._report import compute_checks, markdown, verdict

pytestmark = pytest.mark.slow  # subprocesses or whole bench groups: the full run has them

MiB = 1 << 20


def _context(rt: ferry.Runtime, labels: list[str]) -> Context:
    peers, _ = load_peers(rt)
    return Context(rt, peers, Budget(seconds=0.01, min_reps=2), True, labels.append)


@pytest.fixture
def small_plan(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One 8 MiB configuration with a 2 ms step, few steps: the plumbing, quickly."""
    small = _pipeline.Plan([_pipeline.Config(8 * MiB, 2e-3)], steps=4, warmup=3, repeats=1)
    monkeypatch.setattr(_pipeline, "plan", lambda emulated, quick: small)
    yield


def _checks(results: list[Result], prefix: str) -> dict[str, Any]:
    return {c.name: c for c in compute_checks(results) if c.name.startswith(prefix)}


def test_pipeline_runs_every_contender_and_verifies_it(rt: ferry.Runtime, small_plan: None) -> None:
    labels: list[str] = []
    ctx = _context(rt, labels)
    GROUPS["pipeline"](ctx)
    assert len(ctx.results) == len(labels) == case_count("pipeline", ctx) == len(_pipeline.CONTENDERS)
    rows = {(r.impl, r.route): r for r in ctx.results}
    for key in [("floor", "work_only"), ("floor", "transfers_only"), ("ferry", "fresh"), ("ferry", "ring")]:
        r = rows[key]
        assert r.valid is True, r.note
        assert len(r.samples) == 1 and r.samples[0] > 0
        assert r.config == "8 MiB, 2 ms"
    if rt.backend == "emulated":
        for key in [("torch", "cuda"), ("torch", "best")]:
            assert rows[key].samples == [] and rows[key].note.startswith("skipped")
    elif "torch" in ctx.peers:
        assert rows[("torch", "best")].valid is True, rows[("torch", "best")].note
        assert rows[("torch", "cuda")].valid is True, rows[("torch", "cuda")].note
    prefetch = rows[("ferry", "prefetch")]
    assert prefetch.valid is True if hasattr(ferry, "prefetch") else prefetch.note.startswith("skipped")
    checks = _checks(ctx.results, "pipeline 8 MiB, 2 ms:")
    assert len(checks) == 4
    floor = checks["pipeline 8 MiB, 2 ms: ferry within 1.05x of max(work alone, transfers alone)"]
    fresh = checks["pipeline 8 MiB, 2 ms: ferry fresh arrays within 1.05x of a ring"]
    assert floor.passed is not None and fresh.passed is not None
    if rt.backend == "emulated":
        assert verdict(floor, "emulated") == "n/a (emulated)"
    report = markdown({"backend": rt.backend}, ctx.results, compute_checks(ctx.results))
    assert "### 8 MiB, 2 ms" in report and "| ferry ring |" in report


def test_pipeline_catches_results_that_were_not_written(emu: ferry.Runtime, small_plan: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    step = _pipeline.EmulatedWork.step

    def forgetful(self: Any, x: Any, shift: float) -> Any:  # every third step leaves its result unwritten
        if self.turn % 3 == 2:
            result = self.results[self.turn % len(self.results)]
            self.turn += 1
            return testing.ForeignArray(result, stream=self.handle)
        return step(self, x, shift)

    monkeypatch.setattr(_pipeline.EmulatedWork, "step", forgetful)
    ctx = _context(emu, [])
    GROUPS["pipeline"](ctx)
    rows = {(r.impl, r.route): r for r in ctx.results}
    for key in [("ferry", "fresh"), ("ferry", "ring")]:
        assert rows[key].valid is False and "wrong results at steps" in rows[key].note
        assert rows[key].samples == []  # the timed runs stop at the first wrong one
    assert rows[("floor", "transfers_only")].valid is True  # no device work: nothing was forgotten
    checks = _checks(ctx.results, "pipeline 8 MiB, 2 ms: ferry")
    assert checks and all(c.passed is None for c in checks.values())  # an invalid row is not measured


def test_pipeline_contenders_take_turns_round_by_round(emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # a drift of the machine must land on every contender alike: one untimed round, then each timed
    # round runs every contender once
    plan = _pipeline.Plan([_pipeline.Config(8 * MiB, 1e-3)], steps=3, warmup=3, repeats=2)
    monkeypatch.setattr(_pipeline, "plan", lambda emulated, quick: plan)
    order: list[str] = []

    def spying(fn: Any) -> Any:
        def spy(run: Any, *args: Any, **kwargs: Any) -> str:
            order.append(fn.__name__ + ("_ring" if kwargs.get("ring") else ""))
            note: str = fn(run, *args, **kwargs)
            return note

        return spy

    for name in ("run_work_only", "run_transfers_only", "run_ferry", "run_prefetch"):
        monkeypatch.setattr(_pipeline, name, spying(getattr(_pipeline, name)))
    ctx = _context(emu, [])
    GROUPS["pipeline"](ctx)
    one_round = ["run_work_only", "run_transfers_only", "run_ferry", "run_ferry_ring", "run_prefetch"]
    assert order == one_round * 3
    rows = {(r.impl, r.route): r for r in ctx.results}
    for impl, route in [("floor", "work_only"), ("ferry", "fresh"), ("ferry", "prefetch")]:
        assert rows[(impl, route)].valid is True and len(rows[(impl, route)].samples) == 2


def test_a_contender_that_raises_is_reported_and_the_rest_run(emu: ferry.Runtime, small_plan: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(run: Any, *, ring: bool) -> str:
        raise RuntimeError("a contender that breaks")

    monkeypatch.setattr(_pipeline, "run_ferry", broken)
    ctx = _context(emu, [])
    GROUPS["pipeline"](ctx)
    rows = {(r.impl, r.route): r for r in ctx.results}
    for key in [("ferry", "fresh"), ("ferry", "ring")]:
        assert rows[key].valid is False and "a contender that breaks" in rows[key].note
    assert rows[("floor", "transfers_only")].valid is True and rows[("floor", "work_only")].valid is True


def test_batches_are_checked_in_closed_form() -> None:
    batches = _pipeline.Batches(1 * MiB, 3)
    out = batches.arrays[2] * np.float32(2) + np.float32(7)
    assert batches.check(out, 2, 2.0, 7.0)
    assert not batches.check(out, 1, 2.0, 7.0)
    assert not batches.check(out, 2, 2.0, 8.0)
    out[12345] += 1
    assert not batches.check(out, 2, 2.0, 7.0)
    _pipeline.poison([out])
    assert math.isnan(out[0]) and not batches.check(out, 2, 2.0, 7.0)


def test_gil_group_measures_the_loop_beside_each_background(rt: ferry.Runtime) -> None:
    labels: list[str] = []
    ctx = _context(rt, labels)
    GROUPS["gil"](ctx)
    assert len(ctx.results) == len(labels) == case_count("gil", ctx) == len(_gil.ROUTES)
    rows = {r.route: r for r in ctx.results}
    assert rows["idle"].samples and rows["idle"].valid is None
    for route in ("beside_ferry_upload", "beside_ferry_download"):
        assert rows[route].valid is True, rows[route].note
        assert rows[route].samples and "GB/s" in rows[route].note
    if "torch" in ctx.peers:
        assert rows["beside_torch_pinning"].valid is True, rows["beside_torch_pinning"].note
    else:
        assert rows["beside_torch_pinning"].note.startswith("skipped")
    (check,) = _checks(ctx.results, "python loop").values()
    assert check.passed is not None and "idle speed" in check.measured


def test_host_copies_measures_the_memcpy_ceiling_beside_the_pageable_routes(rt: ferry.Runtime) -> None:
    labels: list[str] = []
    ctx = _context(rt, labels)
    GROUPS["host_copies"](ctx)
    assert len(ctx.results) == len(labels) == case_count("host_copies", ctx)
    ceilings = [r for r in ctx.results if r.impl == "memcpy_mt"]
    assert {r.route for r in ceilings} == {"pageable_to_pageable", "pageable_to_pinned", "pinned_to_pageable"}
    assert len(ceilings) == 3 * (1 if rt.backend == "emulated" else 2)
    lanes = ferry._runtime.parts_of(rt).staging.lanes
    for r in ceilings:
        assert r.valid is True and r.samples and r.gbps > 0, r.note
        assert f"{lanes} threads" in r.note
    checks = _checks(ctx.results, "pageable")
    for d in ("h2d", "d2h"):
        assert checks[f"pageable {d} 64 MiB vs multi-threaded memcpy ceiling"].passed is not None
        at_256 = checks[f"pageable {d} 256 MiB vs multi-threaded memcpy ceiling"].passed
        assert (at_256 is None) == (rt.backend == "emulated")  # 256 MiB on a GPU only (CI's memory)
    report = markdown({"backend": rt.backend}, ctx.results, compute_checks(ctx.results))
    assert "| memcpy_mt | pageable_to_pinned | host | 64 MiB |" in report


def _row(group: str, impl: str, route: str, seconds: float, nbytes: int = 64 * MiB, direction: str = "h2d",
         config: str = "") -> Result:
    return Result(group, impl, route, direction, nbytes, samples=[seconds], valid=True, config=config)


def test_checks_read_the_pipeline_ceiling_and_gil_rows() -> None:
    c = "32 MiB, 1 ms"
    gb = 1e9
    results = [
        _row("pipeline", "floor", "work_only", 1.0e-3, config=c),
        _row("pipeline", "floor", "transfers_only", 2.0e-3, config=c),
        _row("pipeline", "ferry", "fresh", 2.05e-3, config=c),
        _row("pipeline", "ferry", "ring", 1.9e-3, config=c),
        _row("pipeline", "torch", "best", 2.2e-3, config=c),
        Result("pipeline", "ferry", "prefetch", "both", 32 * MiB, note="skipped: no prefetch", config=c),
        _row("host_copies", "memcpy_mt", "pageable_to_pinned", 64 * MiB / (40 * gb), direction="host"),
        _row("host_copies", "memcpy_mt", "pinned_to_pageable", 64 * MiB / (30 * gb), direction="host"),
        _row("host_copies", "ferry", "pageable", 64 * MiB / (37 * gb)),  # 0.925x and >= 35: pass
        _row("host_copies", "ferry", "pageable", 64 * MiB / (28 * gb), direction="d2h"),  # 0.93x, ceiling < 35
        Result("gil", "python_loop", "idle", "host", 0, samples=[10e-3]),
        Result("gil", "python_loop", "beside_ferry_upload", "host", 64 * MiB, samples=[10.5e-3], valid=True,
               note="background moved 30.0 GB/s (9 transfers of 64 MiB)"),
    ]
    checks = {ch.name: ch for ch in compute_checks(results)}
    assert checks[f"pipeline {c}: ferry <= PyTorch best practice"].passed is True
    floor = checks[f"pipeline {c}: ferry within 1.05x of max(work alone, transfers alone)"]
    assert floor.passed is True and "1.025x" in floor.measured
    assert checks[f"pipeline {c}: ferry fresh arrays within 1.05x of a ring"].passed is False  # 1.079x
    assert checks[f"pipeline {c}: ferry.prefetch <= PyTorch best practice"].passed is None
    assert checks["pageable h2d 64 MiB vs multi-threaded memcpy ceiling"].passed is True
    assert checks["pageable d2h 64 MiB vs multi-threaded memcpy ceiling"].passed is True
    assert checks["pageable h2d 256 MiB vs multi-threaded memcpy ceiling"].passed is None
    gil = checks["python loop beside pageable uploads in a background thread"]
    assert gil.passed is True and "30.0 GB/s" in gil.measured
    assert verdict(gil, "cuda") == "pass" and verdict(gil, "emulated") == "n/a (emulated)"
    # 36 GB/s against a 40 GB/s ceiling is 0.9x but under 35 only when the ceiling allows it
    results[8] = _row("host_copies", "ferry", "pageable", 64 * MiB / (34.5 * gb))
    results[6] = _row("host_copies", "memcpy_mt", "pageable_to_pinned", 64 * MiB / (38 * gb), direction="host")
    checks = {ch.name: ch for ch in compute_checks(results)}
    assert checks["pageable h2d 64 MiB vs multi-threaded memcpy ceiling"].passed is False


def test_steady_step_is_the_slope_and_shrugs_off_a_late_end_stamp() -> None:
    steady = [0.5 + 1e-3 * k for k in range(41)]  # 1 ms per step
    assert _pipeline.steady_step(steady) == pytest.approx(1e-3, rel=1e-9)
    for late in (0, -1):  # the host noticed the first or the last arrival 2 ms late
        stamps = list(steady)
        stamps[late] += 2e-3
        two_ended = (stamps[-1] - stamps[0]) / 40
        assert abs(two_ended - 1e-3) == pytest.approx(2e-3 / 40)
        error = abs(_pipeline.steady_step(stamps) - 1e-3)
        assert error == pytest.approx(6 * 2e-3 / (41 * 42))  # 6 d / (n (n + 1)): 7x less than d / (n - 1)
    stalled = steady[:21] + [t + 4e-3 for t in steady[21:]]  # a 4 ms stall inside the window counts
    assert _pipeline.steady_step(stalled) > 1e-3 + 0.5 * 4e-3 / 40
    with pytest.raises(ValueError):
        _pipeline.steady_step([1.0])


def test_a_runs_sample_leaves_out_the_ramp_up_and_the_drain() -> None:
    warmup, steps = 3, 20
    stamps = [1e-3 * k for k in range(warmup + steps)]
    assert _pipeline.run_sample(stamps, warmup) == pytest.approx(1e-3, rel=1e-9)
    slow = list(stamps)
    slow[0] -= 5e-3  # a slow ramp-up
    slow[-1] += 2e-3  # the drain: the last result noticed late
    assert _pipeline.run_sample(slow, warmup) == pytest.approx(1e-3, rel=1e-9)
    stalled = slow[:warmup + 5] + [t + 2e-3 for t in slow[warmup + 5:]]  # a stall inside the steady state counts
    assert _pipeline.run_sample(stalled, warmup) > 1e-3 + 0.5 * 2e-3 / steps


def _peer_rows(work: list[float], best: float, prefetch: float) -> list[Result]:
    c = "8 MiB, 8 ms"
    return [
        Result("pipeline", "floor", "work_only", "both", 8 * MiB, samples=work, valid=True, config=c),
        _row("pipeline", "torch", "best", best, config=c),
        _row("pipeline", "ferry", "prefetch", prefetch, config=c),
    ]


@pytest.mark.parametrize(("work", "best", "prefetch", "passed", "tie"), [
    ([7.840e-3, 7.841e-3, 7.842e-3], 7.838e-3, 7.836e-3, True, False),  # faster: a plain pass
    ([7.840e-3, 7.841e-3, 7.842e-3], 7.838e-3, 7.845e-3, True, True),  # 1.0009x of best, 1.0005x of the floor
    ([7.840e-3, 7.841e-3, 7.842e-3], 7.838e-3, 7.860e-3, False, False),  # 1.0024x of the floor: slower
    ([7.840e-3, 7.841e-3, 7.842e-3], 7.700e-3, 7.845e-3, False, False),  # best 1.8% under the floor: no tie
    ([7.840e-3, 7.841e-3, 7.842e-3], 6.000e-3, 9.600e-3, False, False),  # however far under it
    ([7.840e-3, 7.841e-3, 7.842e-3], 7.820e-3, 7.845e-3, False, False),  # best 0.27% under: past the resolution
    ([7.800e-3, 7.841e-3, 7.900e-3], 7.838e-3, 7.860e-3, True, True),  # a noisy floor (1.3%) resolves less
    ([7.800e-3, 7.841e-3, 7.900e-3], 7.780e-3, 7.880e-3, False, False),  # ...but not 1.29% over best
])
def test_prefetch_against_torch_best_passes_below_it_or_in_a_tie_on_the_device_floor(
        work: list[float], best: float, prefetch: float, passed: bool, tie: bool) -> None:
    check = _checks(_peer_rows(work, best, prefetch), "pipeline 8 MiB, 8 ms: ferry.prefetch")
    (only,) = check.values()
    assert only.passed is passed
    assert ("a tie on the device floor" in only.measured) is tie
    assert only.target == "<= 1.0x, or both on the device floor"


def test_no_tie_without_the_work_alone_row() -> None:
    rows = _peer_rows([7.841e-3], 7.838e-3, 7.845e-3)[1:]  # 1.0005x of best, no floor measured
    (only,) = _checks(rows, "pipeline 8 MiB, 8 ms: ferry.prefetch").values()
    assert only.passed is False and "tie" not in only.measured


def test_a_contender_that_fails_mid_run_leaves_the_next_one_a_clean_slate(
        emu: ferry.Runtime, small_plan: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}

    def wrap_once_broken(self: Any, dev: Any) -> Any:  # the 4th step of the first ferry run fails
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("the consumer failed mid-run")
        return dev

    monkeypatch.setattr(_pipeline.EmulatedWork, "wrap", wrap_once_broken)
    ctx = _context(emu, [])
    GROUPS["pipeline"](ctx)
    rows = {(r.impl, r.route): r for r in ctx.results}
    assert rows[("ferry", "fresh")].valid is False and "mid-run" in rows[("ferry", "fresh")].note
    assert rows[("ferry", "ring")].valid is True, rows[("ferry", "ring")].note  # in flight was drained


def test_host_drift_warns_only_past_the_bound() -> None:
    from ferry._bench._protocol import HOST_DRIFT, host_drift, host_speed

    assert host_speed(iterations=2_000, rounds=2) > 0
    assert host_drift(10.0, 10.0) is None
    assert host_drift(10.0, 10.0 * HOST_DRIFT) is None and host_drift(10.0, 10.0 / HOST_DRIFT) is None
    slower = host_drift(10.0, 5.0)
    assert slower is not None and "10.0" in slower and "5.0" in slower and "0.50x" in slower
    assert host_drift(5.0, 10.0) is not None


def test_the_report_gives_the_hosts_speed_before_and_after_and_warns_of_a_drift(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench measures a reference Python loop before and after its groups: the report says
    both figures, and a host that slowed down between them is named in the report and on stderr."""
    import argparse

    import ferry._bench as bench

    speeds = iter([12.0, 6.0])
    monkeypatch.setattr(bench, "host_speed", lambda: next(speeds))
    args = argparse.Namespace(groups="latency", seconds=0.001, quick=True, no_files=True, out=None)
    assert bench.run(emu, args) == 0
    out, err = capsys.readouterr()
    assert "- host_speed: a Python loop ran at 12.0 M iterations/s before the groups, 6.0 after" in out
    assert "- host_warning: the host's speed changed during the run" in out
    assert "warning: the host's speed changed during the run" in err


def test_measure_interleaved_times_each_op_in_blocks_round_by_round() -> None:
    calls: list[str] = []
    ops = [(lambda: calls.append("a"), None), (lambda: calls.append("b"), lambda: calls.append("setup-b"))]
    samples = measure_interleaved(ops, Budget(seconds=0.0, min_reps=20, max_reps=20, warmup=1), rounds=4)
    assert [len(s) for s in samples] == [20, 20]  # 4 rounds of 5 repeats each
    timed = [c for c in calls if c != "setup-b"]
    assert calls.count("setup-b") == timed.count("b")  # the setup runs before every repeat of its op
    # each round: a's warm-up and block, then b's: the ops alternate block by block
    blocks = [timed[0]]
    for c in timed[1:]:
        if c != blocks[-1]:
            blocks.append(c)
    assert blocks == ["a", "b"] * 4


def test_the_latency_group_times_ferry_and_its_peers_together() -> None:
    with ferry.Runtime("emulated") as rt:
        ctx = Context(rt, {}, Budget(0.01, 3, 50, 1), True, lambda _: None)
        GROUPS["latency"](ctx)
        rows = [(r.impl, r.direction, r.nbytes) for r in ctx.results]
        assert rows == [("ferry", d, n) for n in (16, 64) for d in ("h2d", "d2h")]
        assert all(r.valid and r.samples for r in ctx.results)
