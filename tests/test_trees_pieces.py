"""A tree's leaves as one job of many pieces: one compiled check, no copy on the caller's thread."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import numpy as np
import pytest

import ferry
import ferry._trees as ferry_trees
from conftest import eventually as wait_for
from ferry import _native, testing
from ferry._memory._leaves import FEW_RANGES
from ferry._runtime import parts_of
from ferry._state import OWNED

KiB, MiB = 1 << 10, 1 << 20


def _compiled(rt: ferry.Runtime) -> bool:
    return parts_of(rt).host.direct.copier is not None


def _state(count: int, nbytes: int, seed: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.integers(0, 255, nbytes, dtype=np.uint8) for i in range(count)}


def _jobs(rt: ferry.Runtime) -> tuple[int, int]:
    staged = parts_of(rt).host.staged
    return staged.tree_jobs, staged.tree_leaves


@pytest.fixture
def native(emu: ferry.Runtime) -> ferry.Runtime:
    if not _compiled(emu):
        pytest.skip("one job for a tree needs the compiled engine")
    return emu


@pytest.fixture
def any_native(rt: ferry.Runtime) -> ferry.Runtime:
    """Each backend (the GPU where there is one), on the compiled engine."""
    if not _compiled(rt):
        pytest.skip("one job for a tree needs the compiled engine")
    return rt


def test_a_state_dict_is_one_job_each_way(any_native: ferry.Runtime) -> None:
    rt = any_native
    state = _state(40, 100 * KiB + 3, 1)  # odd sizes: chunks cut across leaves
    jobs = _jobs(rt)
    source, device = rt.upload_tree(state).wait()
    assert source is state and _jobs(rt) == (jobs[0] + 1, jobs[1] + 40)
    _, back = rt.download_tree(device).wait()  # fresh outputs
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    out = {k: np.zeros_like(v) for k, v in state.items()}
    _, filled = rt.download_tree(device, out).wait()  # a reused out= tree
    assert filled is out and all(np.array_equal(out[k], v) for k, v in state.items())
    assert all(a.flags.writeable for a in out.values())
    assert _jobs(rt) == (jobs[0] + 3, jobs[1] + 120)
    changed = {k: v[::-1].copy() for k, v in state.items()}
    _, again = rt.upload_tree(changed, device).wait()  # into the same device arrays
    assert again is device and _jobs(rt)[0] == jobs[0] + 4
    _, back = rt.download_tree(device).wait()
    assert all(np.array_equal(back[k], v) for k, v in changed.items())


def test_the_caller_copies_nothing_while_the_lanes_are_held(native: ferry.Runtime) -> None:
    rt = native
    config = parts_of(rt).host.config
    staging = config.lanes * config.slots_per_lane * config.slot_bytes
    state = _state(-(-2 * staging // MiB), MiB, 2)  # twice what every slot holds
    _, device = rt.upload_tree({k: np.zeros_like(v) for k, v in state.items()}).wait()
    before = rt.stats().host_copied_bytes
    with testing.hold(rt, "upload"):
        pending = rt.upload_tree(state, device)  # returns although nothing can move
        assert not pending.is_ready()
        assert rt.stats().host_copied_bytes == before  # nothing was copied on this thread
        assert all(not a.flags.writeable for a in state.values())  # every leaf leased meanwhile
    pending.wait()
    assert all(a.flags.writeable for a in state.values())
    _, back = rt.download_tree(device).wait()
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    assert rt.stats().host_copied_bytes >= before + 2 * sum(a.nbytes for a in state.values())


def test_a_failed_chunk_fails_the_tree_and_abandons_its_destinations(native: ferry.Runtime) -> None:
    rt = native
    state = _state(12, 300 * KiB, 3)
    _, device = rt.upload_tree(state).wait()
    testing.fail_next_copy(rt, after=1)  # the second chunk's copy (the leaves are back to back: few chunks)
    pending = rt.upload_tree({k: v + 1 for k, v in state.items()}, device)
    with pytest.raises(ferry.TransferFailedError, match=r"leaf .* failed on the device"):
        pending.wait()
    assert {d.state for d in device.values()} == {"abandoned"}  # one job: none of its arrays is trusted
    # a refused tree changes nothing, and the runtime goes on working
    fresh = _state(5, 64 * KiB, 4)
    _, dev2 = rt.upload_tree(fresh).wait()
    _, back = rt.download_tree(dev2).wait()
    assert all(np.array_equal(back[k], v) for k, v in fresh.items())


def test_odd_leaves_take_the_checked_way_and_change_nothing_when_refused(native: ferry.Runtime) -> None:
    rt = native
    state = _state(6, 64 * KiB, 5)
    _, device = rt.upload_tree(state).wait()
    jobs = _jobs(rt)
    twice = dict(device)
    twice["layer5.weight"] = device["layer0.weight"]  # one destination twice
    with pytest.raises(ferry.TransferSubmitError, match="same destination"):
        rt.upload_tree(state, twice)
    busy = rt.download(device["layer3.weight"])  # read-leased: no upload destination until waited
    with pytest.raises(ferry.TransferSubmitError, match=r"\['layer3.weight'\].*read-leased"):
        rt.upload_tree(state, device)
    assert all(a.flags.writeable for a in state.values()) and device["layer0.weight"].state == "owned"
    busy.wait()
    strided = dict(state)
    strided["layer1.weight"] = np.repeat(state["layer1.weight"], 2)[::2]  # not C-contiguous: leaf by leaf
    rt.upload_tree(strided, device).wait()
    assert _jobs(rt) == jobs  # none went as one job
    assert all(d.state == "owned" for d in device.values())
    assert all(a.flags.writeable for a in state.values())
    _, got = rt.download_tree(device).wait()
    assert all(np.array_equal(got[k], v) for k, v in strided.items())


def test_pinned_leaves_of_a_tree_go_as_dmas_from_one_block(any_native: ferry.Runtime) -> None:
    rt = any_native
    state = _state(50, 64 * KiB, 6)
    _, device = rt.upload_tree(state).wait()
    copied = rt.stats().host_copied_bytes
    jobs = _jobs(rt)
    for _ in range(3):
        _, host = rt.download_tree(device, pinned=True).wait()
        assert all(np.array_equal(host[k], v) for k, v in state.items())
        assert all(type(a) is np.ndarray and a.flags.writeable for a in host.values())
        _, again = rt.upload_tree(host, device).wait()
        assert again is device
        del host
        gc.collect()
    assert rt.stats().host_copied_bytes == copied and _jobs(rt) == jobs  # DMAs only: no staging
    pool = rt.stats().pinned_pool_bytes
    for _ in range(3):
        _, host = rt.download_tree(device, pinned=True).wait()
        del host
        gc.collect()
    assert rt.stats().pinned_pool_bytes == pool  # the block goes back and is reused


def test_a_view_of_one_pinned_leaf_keeps_the_tree_block(any_native: ferry.Runtime) -> None:
    rt = any_native
    state = _state(4, 64 * KiB, 7)
    _, device = rt.upload_tree(state).wait()
    _, host = rt.download_tree(device, pinned=True).wait()
    leaves = parts_of(rt).host.pinned_leaves
    live = leaves.live_bytes
    keep = host["layer2.weight"][10:20]
    del host
    gc.collect()
    assert leaves.live_bytes == live  # a view is alive: the block stays out of the pool
    assert np.array_equal(keep, state["layer2.weight"][10:20])
    del keep
    gc.collect()
    assert leaves.live_bytes == live - live  # the last view went: the block is back


def test_the_engine_packs_pieces_that_follow_each_other_on_the_device() -> None:
    module = _native.load()
    if module is None:
        pytest.skip("the compiled extension is not built")
    device = np.zeros(MiB, np.uint8)
    rng = np.random.default_rng(8)
    sizes = [100, 5000, 70000, 3, 200000, 0, 65536]
    hosts = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    offsets, at = [], 0
    for i, n in enumerate(sizes):
        at += 17 if i == 4 else 0  # a gap before the fifth piece: its bytes are never written
        offsets.append(at)
        at += n
    base = device.ctypes.data
    for direction in ("upload", "download"):
        engine = module.Engine(direction, mode="emulated", lanes=3, slots_per_lane=2, slot_bytes=64 * KiB,
                               min_chunk_bytes=4 * KiB, bandwidth=50e9, latency=1e-6)
        try:
            outs = hosts if direction == "upload" else [np.zeros_like(h) for h in hosts]
            table = np.array([(h.ctypes.data, base + off, h.nbytes) for h, off in zip(outs, offsets, strict=True)],
                             np.uint64)
            job = engine.submit_pieces(table.tobytes())
            assert job.wait(10) and job.error is None
            # 65536-byte chunks: [100 + 5000 + 60436], [9564 + 3], 200000 cut in four, the last with the
            # 65536 that follow it (cut again at the chunk's end): 7 chunks, 7 DMAs
            assert job.chunks == 7 and job.nbytes == sum(sizes)
            for h, o in zip(hosts, outs, strict=True):
                assert np.array_equal(h, o)
        finally:
            engine.close()
    assert not device[offsets[4] - 17:offsets[4]].any()
    with pytest.raises(ValueError, match="triples"):
        module.Engine("upload", mode="emulated").submit_pieces(b"\0" * 5)


def test_a_fresh_tree_is_one_allocation_freed_with_its_last_leaf(rt: ferry.Runtime) -> None:
    start = rt.stats().device_bytes
    state = _state(5, 1000, 9)  # 1000 bytes each: every leaf starts at a multiple of 256
    _, device = rt.upload_tree(state).wait()
    ptrs = [d.ptr for d in device.values()]
    assert [b - a for a, b in itertools.pairwise(ptrs)] == [1024] * 4  # back to back
    assert rt.stats().device_bytes == start + 5 * 1024
    back = rt.download_tree(device).wait()[1]
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    views = list(device.values())
    del device
    views[0].close()
    assert views[0].state == "closed" and rt.stats().device_bytes == start + 5 * 1024  # the others use it
    assert np.array_equal(rt.to_host(views[4]), state["layer4.weight"])
    for view in views[1:3]:
        view.close()
    del view
    del views  # the last two collected: the allocation is freed at the next call
    gc.collect()
    rt.poll()
    assert rt.stats().device_bytes == start
    # a dropped upload of a fresh tree frees it once the copy is proven complete
    rt.upload_tree(state)
    gc.collect()
    assert wait_for(lambda: (rt.poll(), rt.stats().device_bytes == start)[1])
    # the runtime closes with live leaves: each is closed, the allocation freed once (no violation)
    _, kept = rt.upload_tree(state).wait()
    rt.close()
    assert {d.state for d in kept.values()} == {"closed"}


def test_an_abandoned_leaf_keeps_the_whole_allocation(emu: ferry.Runtime) -> None:
    rt = emu
    state = _state(4, 64 * KiB, 10)
    testing.fail_next_copy(rt)
    pending = rt.upload_tree(state)
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()
    held = rt.stats().device_bytes
    assert held >= 4 * 64 * KiB
    del pending
    gc.collect()
    rt.poll()
    assert rt.stats().device_bytes == held  # never freed: the device may still touch it


def test_large_trees_move_as_one_job_with_every_byte_right(any_native: ferry.Runtime) -> None:
    rt = any_native
    big = rt.backend == "cuda"
    odd = {f"odd{i}": v for i, v in enumerate(_state(3, 8 * MiB + 1, 12).values())}  # unaligned sizes
    state = _state(64 if big else 8, MiB, 11) | odd | {"tiny": np.arange(3, dtype=np.int64)}
    jobs = _jobs(rt)
    _, device = rt.upload_tree(state).wait()
    out = {k: np.empty_like(v) for k, v in state.items()}
    _, filled = rt.download_tree(device, out).wait()
    assert all(np.array_equal(filled[k], v) for k, v in state.items())
    _, back = rt.download_tree(device).wait()
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    assert _jobs(rt)[0] == jobs[0] + 3
    # handed off to a consumer stream, as a whole tree: ordered after every chunk on the device
    pending = rt.upload_tree({k: v[::-1].copy() for k, v in state.items()}, device)
    handed = pending.hand_off()
    assert handed is device
    _, again = rt.download_tree(device).wait()
    assert all(np.array_equal(again[k], v[::-1]) for k, v in state.items())
    pending.wait()


def test_fresh_leaves_of_every_shape_and_dtype_are_whole_device_arrays(rt: ferry.Runtime) -> None:
    # the fresh destinations are made together (one compiled call where the extension runs): each must be
    # an ordinary owned DeviceArray with its host leaf's shape, dtype and size, at a 256-byte aligned offset
    rng = np.random.default_rng(21)
    state: dict[str, np.ndarray[Any, Any]] = {
        "matrix": rng.random((3, 5, 7)).astype(np.float32),
        "empty": np.empty((0, 4), np.int16),
        "scalar": np.array(7.5),
        "odd": rng.integers(0, 255, 1001, dtype=np.uint8),
        "record": np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        "big_endian": np.arange(10, dtype=">u4"),
    }
    jobs = _jobs(rt)[0]
    _, device = rt.upload_tree(state).wait()
    assert list(device) == list(state)
    if _compiled(rt):
        assert _jobs(rt)[0] == jobs + 1  # one job: an empty leaf has an address of its own in the allocation
    for key, host in state.items():
        leaf = device[key]
        assert type(leaf) is ferry.DeviceArray
        assert (leaf.shape, leaf.dtype, leaf.nbytes, leaf.state) == (host.shape, host.dtype, host.nbytes, "owned")
        assert leaf.size == host.size and leaf.device == 0 and "owned" in repr(leaf)
        if host.nbytes:
            assert np.array_equal(rt.to_host(leaf), host)
    ptrs = [d.ptr for d in device.values() if d.nbytes]  # (leaf by leaf, an empty array has no address)
    assert all(p % 256 == 0 for p in ptrs) and ptrs == sorted(ptrs)
    _, back = rt.download_tree(device).wait()
    assert all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in state.items())
    # each view is a full array: an upload into one, a close of one, the runtime's close for the others
    rt.upload(np.zeros((3, 5, 7), np.float32), device["matrix"]).wait()
    assert not rt.to_host(device["matrix"]).any()
    device["odd"].close()
    assert device["odd"].state == "closed"
    with pytest.raises(ferry.TransferSubmitError, match="closed"):
        rt.to_host(device["odd"])
    rt.close()
    assert {d.state for d in device.values()} == {"closed"}


def _mixed_state(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    """Runs of same-shaped leaves (padded and unpadded), multi-dimensional ones, odd dtypes, an empty leaf,
    a scalar and one leaf above the shared size: every way the outputs are laid out."""
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray[Any, Any]] = {}
    for i in range(12):  # 1000 bytes each: a run whose rows are padded to 1024
        state[f"padded{i}"] = rng.integers(0, 255, (10, 25, 4), dtype=np.uint8)
    for i in range(10):  # 512 bytes each: back to back
        state[f"block{i}"] = rng.random((8, 8)).astype(np.float64)
    for i in range(9):  # a record dtype of 12 bytes whose rows are padded
        state[f"record{i}"] = np.array([(i, 1.5 * i)] * 5, dtype=[("a", "<i4"), ("b", "<f8")])
    state["empty"] = np.empty((0, 3), np.float32)
    state["scalar"] = np.array(3.25)
    state["big"] = rng.integers(0, 255, 2 << 20, dtype=np.uint8)
    state["tail"] = rng.random(7).astype(np.float16)
    return state


@pytest.mark.parametrize("pinned", [False, True])
def test_fresh_host_leaves_are_whole_independent_arrays(any_native: ferry.Runtime, pinned: bool) -> None:
    # fresh outputs (pageable or pinned) are made in runs of same-shaped leaves, as views of one allocation:
    # each must be a C-contiguous, writable array of its own shape, dtype and bytes, independent of the others
    rt = any_native
    state = _mixed_state(22)
    _, device = rt.upload_tree(state).wait()
    jobs, copied = _jobs(rt)[0], rt.stats().host_copied_bytes
    _, host = rt.download_tree(device, pinned=pinned).wait()
    assert _jobs(rt)[0] == jobs + (not pinned)  # one job (pageable) or one record of DMAs, not leaf by leaf
    if pinned:
        assert rt.stats().host_copied_bytes == copied  # DMAs only: no staging
    assert list(host) == list(state)
    for key, want in state.items():
        got = host[key]
        assert type(got) is np.ndarray and got.flags.c_contiguous and got.flags.writeable
        assert (got.shape, got.dtype, got.nbytes) == (want.shape, want.dtype, want.nbytes)
        assert np.array_equal(got, want)
    del got
    ends = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in host.values() if a.nbytes)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ends))  # no two overlap
    host["padded3"][...] = 0  # writing one leaf leaves its neighbours alone
    host["block4"].fill(-1.0)
    assert np.array_equal(host["padded2"], state["padded2"]) and np.array_equal(host["padded4"], state["padded4"])
    assert np.array_equal(host["block3"], state["block3"]) and np.array_equal(host["block5"], state["block5"])
    # one leaf kept alone keeps its bytes (the allocation lives while any leaf does)
    leaves = parts_of(rt).host.pinned_leaves
    live = leaves.live_bytes
    keep, kept_record = host["padded5"], host["record7"]  # a row of a run, a leaf made alone
    del host
    gc.collect()
    assert leaves.live_bytes == live  # (pinned) the block stays out of the pool while a leaf lives
    assert np.array_equal(keep, state["padded5"]) and np.array_equal(kept_record, state["record7"])
    # a later round's outputs are new arrays, not the kept ones' memory
    _, again = rt.download_tree(device, pinned=pinned).wait()
    assert np.array_equal(again["padded5"], state["padded5"]) and not np.shares_memory(again["padded5"], keep)
    del again, keep, kept_record
    gc.collect()
    if pinned:
        assert leaves.live_bytes == live - live  # every leaf went: both blocks are back in the pool


def test_pinned_leaves_found_for_many_ranges_at_once(any_native: ferry.Runtime) -> None:
    rt = any_native
    leaves = parts_of(rt).host.pinned_leaves
    _, device = rt.upload_tree(_state(3, 4 * KiB, 23)).wait()
    _, a = rt.download_tree(device, pinned=True).wait()
    _, b = rt.download_tree(device, pinned=True).wait()
    other = np.empty(4 * KiB, np.uint8)
    arrays = [*a.values(), other, *b.values()]
    ptrs = [x.ctypes.data for x in arrays]
    sizes = [x.nbytes for x in arrays]
    assert leaves.covering_many(ptrs, sizes) == [leaves.covering(p, n) for p, n in zip(ptrs, sizes, strict=True)]
    many = (ptrs + [p + 1 for p in ptrs] + ptrs) * 2  # past FEW_RANGES: the vectorised search, also mid-leaf
    many_sizes = (sizes + [n - 1 for n in sizes] + [n + 1 for n in sizes]) * 2
    assert len(many) > FEW_RANGES
    assert leaves.covering_many(many, many_sizes) == [leaves.covering(p, n) for p, n in zip(many, many_sizes,
                                                                                            strict=True)]
    found = leaves.covering_many(ptrs, sizes)
    assert found[3] is None and all(f is not None for i, f in enumerate(found) if i != 3)
    assert found[0] is found[1] is found[2] and found[4] is not found[0]  # one block for each tree
    assert leaves.covering_many([ptrs[0]], [64 << 20]) == [None]  # past the block's end
    assert leaves.covering_many([], []) == []


def test_the_compiled_leaf_helpers_change_nothing_when_refused(emu: ferry.Runtime) -> None:
    module = _native.load()
    if module is None:
        pytest.skip("the compiled extension is not built here")
    rt = emu
    a, b = rt.empty((4,), np.float32), rt.empty((8,), np.uint8)
    with pytest.raises(TypeError):
        module.mark_leaves([a, "not an array", b], "in_flight", 1)
    assert a.state == b.state == "owned" and a._leases == b._leases == 0  # nothing changed
    module.mark_leaves((a, b), None, 2)
    assert a._leases == b._leases == 2 and a.state == "read_leased"
    module.mark_leaves([a, b], None, -2)
    assert a.state == b.state == "owned"
    # fresh views: None (nothing made) unless every host is an exact ndarray
    assert module.slab_views([np.zeros(3), memoryview(b"abc")], [24, 3], rt, None, 1 << 20, "owned", 0) is None
    with pytest.raises(TypeError):
        module.slab_views([np.zeros(3)], ["24"], rt, None, 1 << 20, "owned", 0)


def test_a_pinned_offload_queues_its_copies_before_it_makes_the_leaves(
    any_native: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = any_native
    state = _state(12, 64 * KiB + 5, 31)
    _, device = rt.upload_tree(state).wait()
    submitted = rt.stats().submitted
    seen: list[int] = []
    made = ferry_trees.views

    def views(*args: Any) -> Any:
        seen.append(rt.stats().submitted)  # the copy is queued by the time the leaves are made
        return made(*args)

    monkeypatch.setattr(ferry_trees, "views", views)
    _, host = rt.download_tree(device, pinned=True).wait()
    assert seen == [submitted + 1]
    assert all(np.array_equal(host[k], v) for k, v in state.items())
    leaves = parts_of(rt).host.pinned_leaves
    ptrs = [a.ctypes.data for a in host.values()]
    assert all(leaves.covering(p, a.nbytes) is not None for p, a in zip(ptrs, host.values(), strict=True))
    assert len({leaves.covering(p, 1) for p in ptrs}) == 1  # one block for the tree


def test_a_pinned_offload_whose_leaves_cannot_be_made_publishes_nothing_and_keeps_the_sources(
    any_native: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = any_native
    state = _state(6, 32 * KiB, 37)
    _, device = rt.upload_tree(state).wait()
    leaves = parts_of(rt).host.pinned_leaves
    live = leaves.live_bytes

    def views(*args: Any) -> Any:
        raise MemoryError("no memory for the views")

    monkeypatch.setattr(ferry_trees, "views", views)
    with pytest.raises(ferry.TransferSubmitError, match="could not make the tree's 6 host leaves"):
        rt.download_tree(device, pinned=True)
    monkeypatch.undo()
    gc.collect()
    assert leaves.live_bytes == live  # the block went back once its copy was waited
    assert rt.stats().in_flight == 0
    assert all(d.state == "owned" for d in device.values())  # the sources are owned and usable
    _, back = rt.download_tree(device, pinned=True).wait()
    assert all(np.array_equal(back[k], v) for k, v in state.items())


def test_device_pieces_answers_what_leaf_pieces_answers_for_the_same_layout(emu: ferry.Runtime) -> None:
    module = _native.load()
    if module is None:
        pytest.skip("the compiled extension is not built here")
    rt = emu
    state = _state(5, 3 * KiB + 1, 41)
    _, device = rt.upload_tree(state).wait()
    _, host = rt.download_tree(device, pinned=True).wait()
    devices, hosts = list(device.values()), list(host.values())
    base = min(a.ctypes.data for a in hosts)
    offsets = [a.ctypes.data - base for a in hosts]
    want = module.leaf_pieces(hosts, devices, rt, OWNED, False)
    assert want is not None and module.device_pieces(devices, rt, OWNED, base, offsets) == want
    assert module.device_pieces([], rt, OWNED, base, []) == (b"", 0)
    # not the common case: None, nothing changed
    assert module.device_pieces([*devices[:2], "no array"], rt, OWNED, base, offsets[:3]) is None
    assert module.device_pieces(devices, object(), OWNED, base, offsets) is None  # another runtime's
    assert module.device_pieces(devices, rt, OWNED, base, [*offsets[:4], "x"]) is None
    assert module.device_pieces(devices, rt, OWNED, base, [*offsets[:4], -1]) is None
    assert module.device_pieces(devices, rt, OWNED, 2**64 - 8, offsets) is None  # past the address space
    devices[1].close()
    assert module.device_pieces(devices, rt, OWNED, base, offsets) is None  # closed
    with pytest.raises(TypeError):
        module.device_pieces(devices, rt, OWNED, base, offsets[:2])
    with pytest.raises(TypeError):
        module.device_pieces(tuple(devices), rt, OWNED, base, offsets)
    with pytest.raises(OverflowError):
        module.device_pieces(devices, rt, OWNED, -1, offsets)
