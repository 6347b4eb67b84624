"""Leaves of a tree copied together: pinned leaves and small pageable leaves as one record per group."""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _trees, testing
from ferry._routes import _groups as _leafgroups

KiB = 1 << 10


@pytest.fixture(autouse=True)
def _groups_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group route: what a tree takes when one job of many pieces cannot carry it (the pure-Python
    engine, a mix of pinned and pageable leaves); tests/test_trees_pieces.py covers the one-job route."""
    monkeypatch.setattr(_trees, "pieces_ready", lambda rt, upload: False)


def small_tree(n: int, size: int = 4 * KiB, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"leaf{i}": rng.integers(0, 255, size, dtype=np.uint8) for i in range(n)}


def test_small_leaves_go_up_and_down_as_a_few_records(rt: ferry.Runtime) -> None:
    tree = small_tree(200)
    before = rt.stats().submitted
    pending = rt.upload_tree(tree)
    assert all(not a.flags.writeable for a in tree.values())  # leased while pending
    _, device = pending.wait()
    assert all(a.flags.writeable for a in tree.values())
    assert rt.stats().submitted - before == 1  # 800 KiB: one staging block, one record
    assert all(d.state == "owned" for d in device.values())
    before = rt.stats().submitted
    _, back = rt.download_tree(device).wait()
    assert rt.stats().submitted - before == 1
    assert all(np.array_equal(back[k], v) for k, v in tree.items())
    out = {k: np.zeros_like(v) for k, v in tree.items()}
    pending = rt.download_tree(device, out)
    assert all(not a.flags.writeable for a in out.values())
    _, filled = pending.wait()
    assert filled is out and all(a.flags.writeable for a in out.values())
    assert all(np.array_equal(out[k], v) for k, v in tree.items())
    assert rt.stats().in_flight == 0 and rt.stats().staging_pinned_bytes == 0


def test_small_leaves_past_a_block_split_into_groups(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_leafgroups, "GROUP_BYTES", 64 * KiB)
    tree = small_tree(64, 4 * KiB, seed=1)  # 256 KiB: four groups
    before = rt.stats().submitted
    _, device = rt.upload_tree(tree).wait()
    assert rt.stats().submitted - before == 4
    _, back = rt.download_tree(device).wait()
    assert all(np.array_equal(back[k], v) for k, v in tree.items())


def test_small_leaves_downloaded_into_fresh_outputs_split_into_groups_too(
        rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_leafgroups, "GROUP_BYTES", 64 * KiB)
    tree = small_tree(64, 4 * KiB, seed=2)  # 256 KiB: four groups each way, not one block for the whole tree
    _, device = rt.upload_tree(tree).wait()
    before = rt.stats().submitted
    _, back = rt.download_tree(device).wait()
    assert rt.stats().submitted - before == 4
    assert all(np.array_equal(back[k], v) for k, v in tree.items())


def test_pinned_leaves_are_one_record_for_the_tree(rt: ferry.Runtime) -> None:
    tree = small_tree(50, 8 * KiB, seed=2)
    tree["big"] = np.arange(1 << 20, dtype=np.uint8)  # one DMA of its own, same record
    _, device = rt.upload_tree(tree).wait()
    _, host = rt.download_tree(device, pinned=True).wait()
    assert all(np.array_equal(host[k], v) for k, v in tree.items())
    copied = rt.stats().host_copied_bytes
    before = rt.stats().submitted
    pending = rt.upload_tree(host, device)
    assert all(not a.flags.writeable for a in host.values())
    pending.wait()
    assert rt.stats().submitted - before == 1
    assert rt.stats().host_copied_bytes == copied  # no staging copy
    assert all(a.flags.writeable for a in host.values())
    fill = {k: np.zeros_like(v) for k, v in tree.items()}
    _, dev2 = rt.upload_tree(fill).wait()
    before = rt.stats().submitted
    rt.download_tree(dev2, host).wait()  # into the pinned leaves: one record again
    assert rt.stats().submitted - before == 1
    assert all(not a.any() for a in host.values())


def test_a_group_handed_off_gives_owned_arrays_ordered_after_it(rt: ferry.Runtime) -> None:
    tree = small_tree(30, 2 * KiB, seed=3)
    pending = rt.upload_tree(tree)
    handed = pending.hand_off()
    assert all(isinstance(d, ferry.DeviceArray) and d.state == "owned" for d in handed.values())
    _, back = rt.download_tree(handed).wait()
    assert all(np.array_equal(back[k], v) for k, v in tree.items())
    source, device = pending.wait()
    assert source is tree
    assert all(device[k] is handed[k] for k in tree)
    assert rt.stats().in_flight == 0


def test_a_failed_group_fails_the_tree_and_abandons_its_leaves(emu: ferry.Runtime) -> None:
    tree = small_tree(20, 4 * KiB, seed=4)
    _, device = emu.upload_tree(tree).wait()
    _, host = emu.download_tree(device, pinned=True).wait()
    testing.fail_next_copy(emu, after=3)
    pending = emu.upload_tree(host, device)
    with pytest.raises(ferry.TransferFailedError, match="copied together with 19 other leaves"):
        pending.wait()
    assert all(d.state == "abandoned" for d in device.values())
    assert emu.stats().in_flight == 0
    fresh = small_tree(5, seed=5)  # the runtime goes on working
    _, dev2 = emu.upload_tree(fresh).wait()
    _, back = emu.download_tree(dev2).wait()
    assert all(np.array_equal(back[k], v) for k, v in fresh.items())


def test_a_refused_group_enqueue_changes_nothing(emu: ferry.Runtime) -> None:
    from ferry._backends._base import DeviceError

    tree = small_tree(10, seed=6)
    _, device = emu.upload_tree(tree).wait()
    backend = testing.backend_of(emu)

    def refusing(*args: object) -> None:
        raise DeviceError("refused for the test", enqueued=False)

    backend.copy_batch = refusing
    try:
        with pytest.raises(ferry.TransferSubmitError, match="refused"):
            emu.upload_tree(tree, device)
    finally:
        del backend.copy_batch
    assert all(d.state == "owned" for d in device.values())
    assert all(a.flags.writeable for a in tree.values())
    assert emu.stats().in_flight == 0 and emu.stats().staging_pinned_bytes == 0


def test_the_collector_is_paused_only_during_the_call(rt: ferry.Runtime) -> None:
    tree = small_tree(3)
    assert gc.isenabled()
    rt.upload_tree(tree).wait()
    assert gc.isenabled()
    gc.disable()
    try:
        rt.upload_tree(tree).wait()
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()


def test_many_pinned_leaves_are_found_and_purged_after_they_die(rt: ferry.Runtime) -> None:
    leaves = rt._parts.host.pinned_leaves
    made = leaves.arrays([((100 + i,), np.dtype(np.uint8)) for i in range(300)])
    assert all(leaves.covering(int(a.ctypes.data), a.nbytes) is not None for a in made)
    kept = made[::2]
    ptrs = [int(a.ctypes.data) for a in made[1::2]]
    del made
    gc.collect()
    assert all(leaves.covering(p, 1) is None for p in ptrs)
    assert all(leaves.covering(int(a.ctypes.data), a.nbytes) is not None for a in kept)
    one = leaves.array((5,), np.dtype(np.float32))  # the dead entries are dropped at the next insert
    assert len(leaves._leaves) == len(kept) + 1
    assert leaves.covering(int(one.ctypes.data), one.nbytes) is not None


def test_a_failed_pageable_group_gives_the_sources_back_writable(emu: ferry.Runtime) -> None:
    tree = small_tree(12, 4 * KiB, seed=7)  # copied through a staging block: the device never touches them
    testing.fail_next_copy(emu, after=2)
    pending = emu.upload_tree(tree)
    with pytest.raises(ferry.TransferFailedError, match="copied together"):
        pending.wait()
    assert all(a.flags.writeable for a in tree.values())
    assert emu.stats().in_flight == 0
    assert emu.stats().abandoned_bytes > 0  # the staging block: never reused


def test_a_tree_submitted_inside_a_batch_copies_its_groups_when_the_batch_ends(rt: ferry.Runtime) -> None:
    tree = small_tree(40, 2 * KiB, seed=8)
    _, device = rt.upload_tree(tree).wait()
    _, host = rt.download_tree(device, pinned=True).wait()
    fresh = small_tree(40, 2 * KiB, seed=9)
    with rt.batch():
        up = rt.upload_tree(fresh, device)  # a pageable group
    up.wait()
    with rt.batch():
        down = rt.download_tree(device, host)  # a pinned group
    down.wait()
    assert all(np.array_equal(host[k], v) for k, v in fresh.items())
    assert rt.stats().in_flight == 0


def test_collector_pauses_nest_across_threads() -> None:
    from ferry._routes._groups import gc_paused

    assert gc.isenabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def second() -> None:
        first_in.wait(10)
        with gc_paused():
            second_in.set()
            first_out.wait(10)
            seen.append(gc.isenabled())  # the first pause ended, this one is still open
    thread = threading.Thread(target=second)
    thread.start()
    with gc_paused():
        first_in.set()
        second_in.wait(10)
    first_out.set()
    thread.join(10)
    assert seen == [False]
    assert gc.isenabled()  # the last pause ended: the collector runs again


def test_a_leaf_submitted_elsewhere_while_its_tree_is_submitted_refuses_the_tree(emu: ferry.Runtime) -> None:
    rt = emu
    small = rt.empty((16,), np.float32)  # a small leaf's destination: it goes in a group, after the large leaf
    backing = rt.empty((300_000,), np.float32)
    sneaky: list[Any] = []
    reads = [0]

    class Foreign(testing.ForeignArray):  # reading its interface lets another submission take ``small``
        @property  # type: ignore[override]
        def __cuda_array_interface__(self) -> dict[str, Any]:
            reads[0] += 1
            if reads[0] == 3:
                sneaky.append(rt.upload(np.full(16, 2, np.float32), small))
            return self._cai  # type: ignore[no-any-return]

        @__cuda_array_interface__.setter
        def __cuda_array_interface__(self, value: dict[str, Any]) -> None:
            self._cai = value

    foreign = Foreign(backing, stream=None)
    reads[0] = 0
    with pytest.raises(ferry.TransferSubmitError, match="changed while its tree was submitted"):
        rt.upload_tree({"big": np.ones(300_000, np.float32), "small": np.ones(16, np.float32)},
                       {"big": foreign, "small": small})
    assert len(sneaky) == 1
    _, back = sneaky[0].wait()  # the other submission owns ``small``, and gets it back alone
    assert back is small and small.state == "owned"
    assert np.array_equal(rt.to_host(small), np.full(16, 2, np.float32))
    assert testing.violations(rt) == []
