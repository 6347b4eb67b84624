"""Bursts: direct-sized transfers submitted back to back go to the staging lanes, not the caller's thread."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ferry
from ferry import testing
from ferry._routes._direct import BURST_MIN_BYTES
from ferry._runtime import parts_of

MiB = 1 << 20


def _native(rt: ferry.Runtime) -> bool:
    return parts_of(rt).host.direct.copier is not None


def bursts(rt: ferry.Runtime) -> int:
    return int(parts_of(rt).host.direct.bursts)


def arrays(count: int, nbytes: int = MiB, seed: int = 0) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(count)]


def test_a_burst_of_uploads_goes_to_the_lanes_and_keeps_the_contract(rt: ferry.Runtime) -> None:
    if not _native(rt):
        pytest.skip("bursts go to the compiled engine only")
    data = arrays(16)
    pending = [rt.upload(a) for a in data]
    assert bursts(rt) >= len(data) - 1  # the first one alone was direct
    assert all(not a.flags.writeable for a in data)  # in flight: read-only, as for any upload
    results = [p.wait() for p in pending]
    assert all(a.flags.writeable for a in data)
    for (src, dev), a in zip(results, data, strict=True):
        assert src is a
        assert np.array_equal(rt.to_host(dev), a)


def test_a_burst_of_downloads_goes_to_the_lanes(rt: ferry.Runtime) -> None:
    if not _native(rt):
        pytest.skip("bursts go to the compiled engine only")
    data = arrays(12, 2 * MiB, 1)
    devices = [rt.to_device(a) for a in data]
    before = bursts(rt)
    outs = [np.zeros_like(a) for a in data]
    pending = [rt.download(d, o) for d, o in zip(devices, outs, strict=True)]
    assert bursts(rt) - before >= len(data) - 1
    for p, o, a in zip(pending, outs, data, strict=True):
        _, got = p.wait()
        assert got is o and np.array_equal(o, a)


def test_one_at_a_time_small_ones_and_batches_stay_direct(emu: ferry.Runtime) -> None:
    data = arrays(4)
    for a in data:
        emu.upload(a).wait()  # waited before the next: no burst
    small = arrays(8, BURST_MIN_BYTES // 2, 2)
    pending = [emu.upload(a) for a in small]  # below the burst size
    with emu.batch():
        batched = [emu.upload(a) for a in data]
    assert bursts(emu) == 0
    for p in pending + batched:
        p.wait()


def test_the_pure_python_engine_keeps_bursts_direct() -> None:
    with ferry.Runtime("emulated", staging=ferry.StagingConfig(engine="python")) as rt:
        data = arrays(6)
        pending = [rt.upload(a) for a in data]
        assert bursts(rt) == 0
        for p, a in zip(pending, data, strict=True):
            assert np.array_equal(rt.to_host(p.wait()[1]), a)


def test_a_failed_transfer_of_a_burst_abandons_only_its_own_objects(emu: ferry.Runtime) -> None:
    if not _native(emu):
        pytest.skip("bursts go to the compiled engine only")
    data = arrays(4, MiB, 3)
    first = emu.upload(data[0])
    testing.fail_next_copy(emu)
    failing = emu.upload(data[1])  # a burst's: the engine's job fails
    assert bursts(emu) == 1
    with pytest.raises(ferry.TransferFailedError):
        failing.wait()
    assert data[1].flags.writeable  # the caller's array is the caller's again
    _, dev = first.wait()
    assert np.array_equal(emu.to_host(dev), data[0])
    assert emu.stats().abandoned >= 1


def test_a_burst_upload_is_handed_off_and_read_back_in_order(emu: ferry.Runtime) -> None:
    if not _native(emu):
        pytest.skip("bursts go to the compiled engine only")
    data = arrays(3, MiB, 4)
    pending = [emu.upload(a) for a in data]
    handed = [p.hand_off() for p in pending]
    backs = [emu.download(d) for d in handed]  # ordered after the uploads by ferry itself
    for b, a in zip(backs, data, strict=True):
        assert np.array_equal(b.wait()[1], a)
    for p in pending:
        p.wait()


def test_a_tree_of_large_leaves_shares_the_lanes(emu: ferry.Runtime) -> None:
    if not _native(emu):
        pytest.skip("bursts go to the compiled engine only")
    tree = {f"w{i}": a for i, a in enumerate(arrays(10, MiB, 5))}
    staged = parts_of(emu).host.staged
    jobs, carried = staged.tree_jobs, staged.tree_leaves
    _, dev = emu.upload_tree(tree).wait()
    assert (staged.tree_jobs, staged.tree_leaves) == (jobs + 1, carried + 10)  # one job for every leaf
    _, back = emu.download_tree(dev).wait()
    assert all(np.array_equal(back[k], v) for k, v in tree.items())


def test_a_fresh_small_upload_allocates_in_its_own_submission(emu: ferry.Runtime) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    small = parts_of(emu).host.small
    before = testing.fast_path_counts(emu)["small_uploads"]
    src, dev = emu.upload(a).wait()
    assert src is a and dev.shape == (2, 3) and dev.dtype == np.float32
    assert np.array_equal(emu.to_host(dev), a)
    assert testing.fast_path_counts(emu)["small_uploads"] == before + 1  # the small route carried it
    slots = (small.up.count, len(small.up.free))
    memory = parts_of(emu).memory

    def refuse(nbytes: int) -> int:
        raise MemoryError("no device memory for the test")

    real = memory.alloc
    memory.alloc = refuse  # type: ignore[method-assign]
    try:
        with pytest.raises(MemoryError):
            emu.upload(a)
    finally:
        memory.alloc = real  # type: ignore[method-assign]
    assert (small.up.count, len(small.up.free)) == slots  # the slot went back
    assert a.flags.writeable
    assert np.array_equal(emu.to_host(emu.upload(a).wait()[1]), a)
    emu.close()
    with pytest.raises(ferry.RuntimeClosedError):
        emu.upload(a)
