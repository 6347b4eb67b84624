"""Pinned trees as few DMAs as their layout allows: one DMA per run of leaves that follow each other.

A fresh device tree (views of one device allocation) downloaded into fresh pinned leaves (one pooled
block) has the same layout on both sides: each leaf at the next multiple of 256 bytes. Where the leaves'
sizes are not multiples of 256 the same padding separates them on both sides; that padding belongs to no
leaf of the fresh host block, so the run goes on across it and the whole tree is still one DMA. Host leaves
of the caller's (an ``out=`` tree, or pinned leaves uploaded) are never written beyond their own bytes.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferry
from ferry import testing
from ferry._routes._groups import _runs, merged_runs
from ferry._runtime import parts_of

KiB = 1 << 10


def _counting(rt: ferry.Runtime) -> dict[str, int]:
    backend = testing.backend_of(rt)
    seen = {"d2h": 0, "h2d": 0, "batch": 0}
    for key, name in (("d2h", "dtoh_record"), ("h2d", "htod_record"), ("batch", "copy_batch")):
        fn = getattr(backend, name)

        def wrapper(*args: Any, _fn: Any = fn, _key: str = key) -> Any:
            seen[_key] += 1
            return _fn(*args)

        setattr(backend, name, wrapper)
    return seen


def _odd_tree(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    sizes = [1000, 3, 70 * KiB + 1, 2000, 300 * KiB + 5, 17, 4096, 129]  # mostly not multiples of 256
    tree: dict[str, Any] = {f"w{i}": rng.integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    tree["f16"] = rng.standard_normal((3, 5)).astype(np.float16)
    return tree


@pytest.fixture
def native(emu: ferry.Runtime) -> ferry.Runtime:
    if parts_of(emu).host.direct.copier is None:
        pytest.skip("one record for a tree needs the compiled extension")
    return emu


def test_an_offload_of_odd_sized_leaves_is_still_one_dma(native: ferry.Runtime) -> None:
    rt = native
    tree = _odd_tree(1)
    _, dev = rt.upload_tree(tree).wait()
    seen = _counting(rt)
    for _ in range(3):
        before = dict(seen)
        _, host = rt.download_tree(dev, pinned=True).wait()
        assert all(np.array_equal(host[k], v) and host[k].dtype == v.dtype for k, v in tree.items())
        assert (seen["d2h"] - before["d2h"], seen["batch"] - before["batch"]) == (1, 0)
        # the reload writes the device side: the caller's pinned leaves, exactly their bytes, DMA by DMA
        _, back = rt.upload_tree(host, dev).wait()
        assert back is dev
        del host
        gc.collect()
    _, again = rt.download_tree(dev).wait()
    assert all(np.array_equal(again[k], v) for k, v in tree.items())


def test_pinned_leaves_of_the_caller_are_filled_without_their_gaps(native: ferry.Runtime) -> None:
    # two slices of one pinned leaf as an out= tree: the bytes between them are the caller's and must stay,
    # even where the device leaves have the same gap between them
    rt = native
    src = {"a": np.full(1000, 1, np.uint8), "b": np.full(976, 2, np.uint8)}
    _, dev = rt.upload_tree(src).wait()  # one device allocation: b at offset 1024
    _, block = rt.download_tree({"x": rt.to_device(np.zeros(4096, np.uint8)),
                                 "y": rt.to_device(np.zeros(8, np.uint8))}, pinned=True).wait()
    whole = block["x"]
    whole[:] = 9
    out = {"a": whole[0:1000], "b": whole[1024:2000]}  # a gap of 24 bytes on both sides
    seen = _counting(rt)
    _, filled = rt.download_tree(dev, out).wait()
    assert filled is out
    assert (whole[0:1000] == 1).all() and (whole[1024:2000] == 2).all()
    assert (whole[1000:1024] == 9).all() and (whole[2000:] == 9).all()  # the caller's bytes stay
    assert seen["d2h"] + seen["batch"] >= 1


def _compiled_merge() -> Any:
    """The compiled ``merge_runs`` wherever the extension is built (also under ``FERRY_NATIVE=0``), else None."""
    try:
        from ferry._native import _engine
    except ImportError:
        return None
    return lambda pieces, padded=False: _engine.merge_runs(pieces, 256 if padded else 0)


_MERGES = [pytest.param(_runs, id="runs"), pytest.param(merged_runs, id="numpy"),
           pytest.param(_compiled_merge(), id="compiled",
                        marks=pytest.mark.skipif(_compiled_merge() is None, reason="the extension is not built"))]


@pytest.mark.parametrize("_runs", _MERGES)
def test_runs_merge_across_equal_padding_only_when_asked(_runs: Any) -> None:
    def pieces(*rows: tuple[int, int, int]) -> bytes:
        return np.array(rows, np.uint64).tobytes()

    rows = ((1000, 5000, 100), (1256, 5256, 50), (1306, 5306, 10), (1316, 9000, 8), (4000, 9300, 0))
    assert _runs(pieces(*rows)) == ([1000, 1256, 1316], [5000, 5256, 9000], [100, 60, 8])
    assert _runs(pieces(*rows), padded=True) == ([1000, 1316], [5000, 9000], [316, 8])
    # a gap of ALIGN bytes or more, unequal gaps, or a piece before the previous one's end: no merge
    far = ((0, 0, 10), (266, 266, 10), (300, 310, 10), (290, 400, 5))
    assert _runs(pieces(*far), padded=True) == ([0, 266, 300, 290], [0, 266, 310, 400], [10, 10, 10, 5])


_ROWS = st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 4096), st.integers(0, 600)), max_size=40)


@pytest.mark.skipif(_compiled_merge() is None, reason="the extension is not built")
@settings(max_examples=300, deadline=None)
@given(starts=_ROWS, padded=st.booleans(), contiguous=st.booleans())
def test_the_compiled_run_merge_answers_as_its_numpy_twin(starts: list[tuple[int, int, int]], padded: bool,
                                                           contiguous: bool) -> None:
    """Random pieces (laid back to back with random gaps, or anywhere): the compiled merge and the NumPy one
    give the same runs, padded or not, empty pieces and pieces that go backwards included."""
    rows, h, d = [], 1 << 20, 1 << 30
    for gap_h, gap_d, n in starts:
        if contiguous:  # back to back with small gaps: runs form
            h, d = h + gap_h % 300, d + gap_d % 300
            rows.append((h, d, n))
            h, d = h + n, d + n
        else:
            rows.append((gap_h, gap_d, n))
    pieces = np.array(rows, np.uint64).reshape(-1, 3).tobytes()
    merge = _compiled_merge()
    assert merge(pieces, padded) == merged_runs(pieces, padded)


def test_a_handed_off_tree_notes_the_stream_once_per_allocation(native: ferry.Runtime) -> None:
    # every leaf of a tree of views of one device allocation is handed back owned; the consumer stream is
    # noted for the allocation once, not once per view
    rt = native
    tree = {f"w{i}": np.full(512, i % 200, np.uint8) for i in range(300)}
    _, dev = rt.upload_tree(tree).wait()
    slab = dev["w0"]._memory
    assert all(d._memory is slab for d in dev.values())
    memory = slab.memory
    noted: list[int] = []
    note = memory.note_stream

    def counted(ptr: int, stream: Any) -> None:
        noted.append(ptr)
        note(ptr, stream)

    memory.note_stream = counted
    try:
        stream = testing.side_stream(rt)
        pending = rt.upload_tree(tree, dev)
        handed = pending.hand_off(stream)
    finally:
        del memory.note_stream
    assert handed is dev and all(d.state == "owned" for d in dev.values())
    assert noted == [slab._ptr]
    _, back = rt.download_tree(dev).wait()
    assert all(np.array_equal(back[k], v) for k, v in tree.items())
