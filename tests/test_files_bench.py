"""The ``files`` bench group runs on the emulated device (a toy checkpoint), verifies every row and feeds
the checks table; the figures themselves are not asserted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ferry
from ferry._bench import _files
from ferry._bench._groups import GROUPS, Context, case_count
from ferry._bench._peers import load_peers
from ferry._bench._protocol import Budget
from ferry._bench._report import compute_checks


def test_the_files_group_verifies_every_row(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    if rt.backend == "cuda":  # on a GPU the real checkpoint (GiBs): small shapes keep the test short
        monkeypatch.setattr(_files, "checkpoint_shapes", lambda emulated, quick: _files.decoder_shapes(2, 256, 512,
                                                                                                         4096, 64))
    monkeypatch.setenv("FERRY_BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(_files, "can_drop_caches", lambda: False)  # a test never drops the machine's cache
    labels: list[str] = []
    peers, _ = load_peers(rt)
    ctx = Context(rt, peers, Budget(seconds=0.01, min_reps=2), True, labels.append)
    GROUPS["files"](ctx)
    assert len(ctx.results) == len(labels) == case_count("files", ctx)
    for r in ctx.results:
        assert r.valid is not False, (r.impl, r.route, r.direction, r.note)
        if r.route != "host_memory" and r.valid is not None:  # (valid None: not measurable here, said in the note)
            assert r.samples and all(s > 0 for s in r.samples), (r.impl, r.route)
    routes = {(r.impl, r.route, r.direction) for r in ctx.results}
    assert {("ceiling", "pread", "warm"), ("ceiling", "pread", "cold"), ("ferry", "load_safetensors", "warm"),
            ("ferry", "load_safetensors", "cold"), ("ceiling", "pwrite", "save"),
            ("ferry", "save_safetensors", "save")} <= routes
    names = {c.name: c for c in compute_checks(ctx.results)}
    for name in ("checkpoint load, warm, vs the parallel pread ceiling", "checkpoint load, warm",
                 "checkpoint load, cold, vs the parallel pread ceiling (cold, the faster of buffered and O_DIRECT)",
                 "checkpoint save vs the parallel pwrite ceiling", "host memory during a load, above the pools"):
        assert names[name].measured != "not measured", name
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_has_the_decoders_shape() -> None:
    shapes = _files.checkpoint_shapes(emulated=False, quick=False)
    params = sum(int(__import__("numpy").prod(s)) for s in shapes.values())
    assert 1.4e9 < params < 1.8e9 and 300 < len(shapes) < 400


def test_the_verification_keeps_no_mapping_and_cold_runs_prove_they_were_cold(tmp_path: Path) -> None:
    """A mapping's touched pages survive a drop of the page cache: the reference must read, never map, or
    the next "cold" load reads a warm file. And a cold run measures how much of the file was resident."""
    path = str(tmp_path / "model.safetensors")
    _files.write_checkpoint(path, _files.decoder_shapes(1, 64, 128, 512, 16))
    ref = _files.Reference(path)
    assert all(ref.bytes_of(k).size == b - a for k, (a, b) in ref.spans.items())
    with open("/proc/self/maps") as f:
        assert os.path.realpath(path) not in f.read()
    cold = _files.Cold(path, drop=False)
    cold.before()
    cold.before()
    note = cold.note()
    if cold.evicts:  # a disk: the file's pages were evicted and the note proves it
        assert cold.honest() and "% of the file resident at the start" in note and "NOT cold" not in note
    else:  # tmpfs keeps them: the cold runs read with O_DIRECT instead, and the note says so
        assert "O_DIRECT" in note
    cold.resident = [0.5]
    assert not cold.honest() and "NOT cold" in cold.note()
