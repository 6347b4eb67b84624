"""The ``loader`` bench group on the emulated device: its plumbing, its verification and its checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ferry
from ferry._bench import _loader
from ferry._bench._groups import GROUPS, Context, case_count
from ferry._bench._protocol import Budget, Result
from ferry._bench._report import Check, _find, compute_checks, markdown

# the loader's fork workers come from a process with ferry's threads, as they do in use (see docs/loader.md)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")]


def _context(rt: ferry.Runtime) -> Context:
    return Context(rt, {}, Budget(seconds=0.01, min_reps=2), True, lambda _: None)


def _row(results: list[Result], impl: str, route: str) -> Result:
    (row,) = [r for r in results if r.impl == impl and r.route == route]
    return row


def test_the_group_runs_resident_and_ferry_dataloader_and_verifies_every_batch(emu: ferry.Runtime) -> None:
    ctx = _context(emu)
    GROUPS["loader"](ctx)
    assert case_count("loader", ctx) == len(_loader.CONTENDERS)
    resident = _row(ctx.results, "floor", "tabular: resident")
    ours = _row(ctx.results, "ferry", "tabular: dataloader")
    cpu = _row(ctx.results, "ferry", "tabular: dataloader, main-thread CPU per batch in the loader")
    assert resident.valid is True and ours.valid is True
    assert len(ours.samples) == len(resident.samples) == 1 and ours.median > 0 and cpu.median > 0
    assert "1 batch(es) not through the ring" in ours.note
    for impl, route in [("torch", "cuda"), ("torch", "pinned_non_blocking"), ("ferry", "prefetch")]:
        assert _row(ctx.results, impl, f"tabular: {route}").note.startswith("skipped")
    checks = {c.name: c for c in compute_checks(ctx.results) if c.name.startswith("loader")}
    assert checks["loader tabular: ring size constant after the first epoch"].passed is True
    assert "x" in checks["loader tabular: ferry.DataLoader vs resident data"].measured
    assert checks["loader image: ferry.DataLoader vs resident data"].passed is None  # not measured here
    tabular_cpu = checks["loader tabular: main-thread CPU per 32 MiB batch in ferry.DataLoader"]
    assert tabular_cpu.measured.endswith(" ms") and tabular_cpu.target == "<= 0.3 ms"
    assert cpu.note.startswith("mean per batch ") and "by module: " in cpu.note and " ferry/" in cpu.note
    report = markdown({"backend": "emulated"}, ctx.results, compute_checks(ctx.results))
    assert "tabular: dataloader" in report
    assert emu.stats().registered_bytes == 0


def test_a_wrong_batch_fails_the_row(emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    original = _loader.PoolDataset.__getitem__

    def corrupted(self: Any, i: int) -> Any:
        x, label = original(self, i)
        if i == 21 and ferry.get_worker_info() is not None:  # in a worker only: the resident run is right
            x = x + np.float32(1)
        return x, label

    monkeypatch.setattr(_loader.PoolDataset, "__getitem__", corrupted)
    ctx = _context(emu)
    GROUPS["loader"](ctx)
    assert _row(ctx.results, "floor", "tabular: resident").valid is True
    assert _row(ctx.results, "ferry", "tabular: dataloader").valid is False


def _result(impl: str, route: str, seconds: float, direction: str = "h2d") -> Result:
    return Result("loader", impl, route, direction, 48 << 20, samples=[seconds], valid=True if direction == "h2d"
                  else None)


@pytest.mark.parametrize(("ours", "pinned", "cpu", "passed"), [
    (0.0105, 0.0287, 0.2e-3, (True, True, True)),
    (0.0125, 0.0287, 0.2e-3, (False, True, True)),
    (0.0105, 0.0200, 0.5e-3, (True, False, False)),
])
def test_the_checks_hold_the_targets(ours: float, pinned: float, cpu: float, passed: tuple[bool, ...]) -> None:
    results = [
        _result("floor", "image: resident", 0.0094),
        _result("torch", "image: pinned_non_blocking", pinned),
        _result("ferry", "image: dataloader", ours),
        _result("ferry", "image: dataloader, main-thread CPU per batch in the loader", cpu, "host"),
    ]
    checks = {c.name: c.passed for c in _loader.loader_checks(results, Check, _find)}
    assert (checks["loader image: ferry.DataLoader vs resident data"],
            checks["loader image: ferry.DataLoader faster than DataLoader(pin_memory=True) + non_blocking"],
            checks["loader image: main-thread CPU per 48 MiB batch in ferry.DataLoader"]) == passed
    assert checks["loader tabular: ferry.DataLoader vs resident data"] is None
    assert checks["loader tabular: main-thread CPU per 32 MiB batch in ferry.DataLoader"] is None  # not measured
