"""The ``trees`` bench group runs on the emulated device (and a GPU), verifies what it moves, and
turns the targets into checks; the figures themselves are not asserted."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ferry
from ferry._bench import _trees
from ferry._bench._groups import GROUPS, Context, case_count
from ferry._bench._peers import load_peers
from ferry._bench._protocol import Budget
from ferry._bench._report import compute_checks, markdown

pytestmark = pytest.mark.slow


def _context(rt: ferry.Runtime, labels: list[str]) -> Context:
    peers, _ = load_peers(rt)
    return Context(rt, peers, Budget(seconds=0.005, min_reps=2), True, labels.append)


def test_the_trees_group_runs_every_case_and_verifies_it(rt: ferry.Runtime) -> None:
    labels: list[str] = []
    ctx = _context(rt, labels)
    GROUPS["trees"](ctx)
    rows = [r for r in ctx.results if r.group == "trees"]
    assert len(rows) == len(labels) == case_count("trees", ctx)
    # with PyTorch but without TensorDict one row says why TensorDict was not run; every other row ran
    skipped = [r for r in rows if r.config == "peers"]
    assert all(r.route == "skipped" and r.note.startswith(("not installed", "unusable")) for r in skipped)
    rows = [r for r in rows if r.config != "peers"]
    assert all(r.valid is True and r.samples for r in rows), [(r.config, r.route, r.note) for r in rows if not r.valid]
    shapes = {r.config for r in rows}
    assert {"256 x 16 MiB", "2048 x 1 MiB", "16384 x 64 KiB", "1.5B mixed"} <= shapes
    for shape in ("256 x 16 MiB", "16384 x 64 KiB"):
        routes = {(r.impl, r.route, r.direction) for r in rows if r.config == shape}
        assert {("ferry", "pageable", "h2d"), ("ferry", "pinned", "h2d"), ("ferry", "fresh", "d2h"),
                ("ferry", "out", "d2h"), ("ferry", "pinned", "d2h")} <= routes
        assert any(impl == "memcpy_mt" for impl, _, _ in routes)
    names = {c.name: c for c in compute_checks(ctx.results)}
    assert names["pinned pool bounded over offload/reload rounds"].passed is True
    assert names["trees 2048 x 1 MiB d2h into a reused out= tree"].passed is not None
    assert names["upload_tree of 2,048 leaves returns (into a device tree)"].passed is not None
    assert names["upload_tree of 2,048 leaves returns (fresh)"].passed is not None
    fresh = [r for r in rows if r.config == "2048-leaf submit" and r.route == "upload_tree submit, fresh"]
    assert len(fresh) == 1 and fresh[0].valid is True
    report = markdown({"backend": rt.backend}, ctx.results, compute_checks(ctx.results))
    assert "## trees" in report and "| 1.5B mixed | ferry | pinned | d2h |" in report


def test_the_trees_group_catches_wrong_bytes(emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    real = emu.download_tree

    class Wrong:
        def __init__(self, pending: Any, fresh: bool) -> None:
            self.pending, self.fresh = pending, fresh

        def wait(self) -> Any:
            source, host = self.pending.wait()
            if self.fresh:
                leaf = next(iter(host.values()))
                leaf.reshape(-1).view(np.uint8)[0] ^= 1  # one byte of one leaf
            return source, host

    def wrong(tree: Any, out: Any = None, *, pinned: bool = False) -> Any:
        return Wrong(real(tree, out, pinned=pinned), out is None and not pinned)

    monkeypatch.setattr(emu, "download_tree", wrong)
    ctx = _context(emu, [])
    monkeypatch.setattr(_trees, "shapes", lambda emulated, quick: [("2048 x 1 MiB", _trees._uniform(4, 1 << 20))])
    GROUPS["trees"](ctx)
    rows = {(r.config, r.impl, r.route, r.direction): r for r in ctx.results if r.group == "trees"}
    fresh = rows[("2048 x 1 MiB", "ferry", "fresh", "d2h")]
    assert fresh.valid is False and fresh.samples == []
    assert rows[("2048 x 1 MiB", "ferry", "out", "d2h")].valid is True
    names = {c.name: c for c in compute_checks(ctx.results)}
    assert names["trees 2048 x 1 MiB d2h fresh pageable vs first-touch + fill ceiling"].passed is None
