"""Pageable NumPy routes: direct, staged in chunks, and registered; on every backend."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

import ferry
import ferry._native
from ferry import testing

MiB = 1 << 20
# small slots and few lanes so that modest payloads cross many chunks and every lane
SMALL = ferry.StagingConfig(slot_bytes=256 << 10, slots_per_lane=2, lanes=3, direct_bytes=64 << 10)


@pytest.fixture(autouse=True, params=["native", "python"])
def staging_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both staging engines: the compiled one and the pure-Python one."""
    if request.param == "python":
        monkeypatch.setenv("FERRY_NATIVE", "0")
    else:
        monkeypatch.delenv("FERRY_NATIVE", raising=False)
        if ferry._native.load() is None:
            pytest.skip(f"the native engine does not run here: {ferry._native.status()}")
    return str(request.param)


@pytest.fixture
def srt(backend_name: str) -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime(backend_name, staging=SMALL)
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


def random_array(shape: tuple[int, ...], dtype: object, seed: int) -> np.ndarray:
    dt = np.dtype(dtype)
    count = int(np.prod(shape)) * dt.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=count, dtype=np.uint8)
    if dt == np.bool_:
        raw %= 2
    return raw.view(dt).reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (random float bits include NaNs)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def settle(rt: ferry.Runtime) -> None:
    deadline = time.monotonic() + 20
    while rt.stats().retiring and time.monotonic() < deadline:
        rt.poll()
        time.sleep(0.001)
    assert rt.stats().retiring == 0


# sizes: empty, tiny, direct route, exactly one slot, many chunks with a ragged tail
SIZES = [0, 16, 40_000, 256 << 10, 3 * MiB + 12_345]


@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_on_every_route(srt: ferry.Runtime, nbytes: int) -> None:
    data = random_array((nbytes,), np.uint8, nbytes)
    source, dev = srt.upload(data).wait()
    assert source is data and dev.shape == data.shape
    dev, out = srt.download(dev).wait()
    assert same(out, data)


@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.int16, "S3", np.dtype([("x", "<u2"), ("y", "<f4")])])
def test_typed_arrays_round_trip_through_the_lanes(srt: ferry.Runtime, dtype: object) -> None:
    data = random_array((333, 1024), dtype, 3)
    dev = srt.empty(data.shape, data.dtype)
    data2, dev2 = srt.upload(data, dev).wait()
    assert data2 is data and dev2 is dev
    out = np.empty_like(data)
    _, got = srt.download(dev, out).wait()
    assert got is out
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[::2],  # strided rows
        lambda a: a[:, 3:700:3],  # strided columns
        lambda a: a.T,  # transposed
        lambda a: a.reshape(64, 100, 128)[:, ::-1, 5:],  # 3-d, reversed axis
    ],
)
def test_non_contiguous_sources_and_outputs(srt: ferry.Runtime, make: object) -> None:
    base = random_array((6400, 128), np.float32, 4).reshape(6400, 128)
    view = make(base)  # type: ignore[operator]
    assert not view.flags.c_contiguous
    before = srt.stats().host_copied_bytes
    _, dev = srt.upload(view).wait()
    assert srt.stats().host_copied_bytes - before == view.nbytes  # copied once, not twice
    assert same(srt.to_host(dev), view)
    target_base = np.zeros((base.shape[0] * 2, base.shape[1]), np.float32)
    target = make(target_base[::2])  # a strided output of the same shape
    if target.shape == view.shape:
        _, got = srt.download(dev, target).wait()
        assert same(got, view)


def test_each_payload_byte_is_copied_once_by_the_host(srt: ferry.Runtime) -> None:
    data = random_array((5 * MiB + 7,), np.uint8, 5)
    start = srt.stats().host_copied_bytes
    _, dev = srt.upload(data).wait()
    assert srt.stats().host_copied_bytes - start == data.nbytes
    _, out = srt.download(dev).wait()
    assert srt.stats().host_copied_bytes - start == 2 * data.nbytes
    assert same(out, data)


def test_staging_memory_is_bounded_by_the_lanes_not_the_payload(srt: ferry.Runtime) -> None:
    data = random_array((24 * MiB,), np.uint8, 6)
    _, dev = srt.upload(data).wait()
    _, out = srt.download(dev).wait()
    assert same(out, data)
    stats = srt.stats()
    bound = 2 * SMALL.pinned_bytes  # both directions' slots
    assert stats.staging_pinned_bytes <= bound
    assert stats.pinned_pool_bytes <= bound + 2 * MiB  # no tensor-sized pinned allocation


def test_shape_and_dtype_mismatches_are_refused_and_change_nothing(srt: ferry.Runtime) -> None:
    data = np.arange(1000, dtype=np.float32)
    dev = srt.empty(1000, np.float64)
    with pytest.raises(ferry.TransferSubmitError, match="shape/dtype mismatch"):
        srt.upload(data, dev)
    with pytest.raises(ferry.TransferSubmitError, match="shape/dtype mismatch"):
        srt.upload(data, srt.empty(999, np.float32))
    with pytest.raises(ferry.TransferSubmitError, match="shape/dtype mismatch"):
        srt.download(dev, np.empty(1000, np.float32))
    with pytest.raises(ferry.TransferSubmitError, match="NumPy array"):
        srt.upload([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ferry.TransferSubmitError, match="fixed-size"):
        srt.upload(np.array([object()] * 3))
    with pytest.raises(ferry.TransferSubmitError, match="read-only"):
        frozen = np.empty(1000, np.float64)
        frozen.flags.writeable = False
        srt.download(dev, frozen)
    assert dev.state == "owned" and data.flags.writeable
    device_bytes = srt.stats().device_bytes
    with pytest.raises(ferry.TransferSubmitError):
        srt.upload(np.arange(10), dev)  # refused; nothing allocated for it stays behind
    assert srt.stats().device_bytes == device_bytes


@pytest.mark.parametrize("nbytes", [1000, 2 * MiB])
def test_arrays_are_read_only_while_pending_and_restored_at_wait(srt: ferry.Runtime, nbytes: int) -> None:
    data = random_array((nbytes,), np.uint8, 7)
    with testing.hold(srt, "both"):
        pending = srt.upload(data)
        assert not data.flags.writeable
        with pytest.raises(ValueError):
            data[0] = 1
        assert pending.is_ready() is False
    _, dev = pending.wait()
    assert data.flags.writeable
    out = np.empty_like(data)
    with testing.hold(srt, "download"):
        pending2 = srt.download(dev, out)
        assert not out.flags.writeable
        with pytest.raises(ferry.TransferSubmitError, match="read-only"):
            srt.download(dev, out)  # the output of a pending download
        assert pending2.is_ready() is False
    pending2.wait()
    assert out.flags.writeable and same(out, data)


def test_an_array_already_read_only_stays_read_only(srt: ferry.Runtime) -> None:
    data = np.arange(100_000, dtype=np.int64)
    data.flags.writeable = False
    srt.upload(data).wait()
    assert not data.flags.writeable


def test_two_pending_uploads_of_one_array_restore_it_once_both_are_done(srt: ferry.Runtime) -> None:
    data = random_array((MiB,), np.uint8, 8)
    with testing.hold(srt, "upload"):
        first = srt.upload(data)
        second = srt.upload(data)
    first.wait()
    assert not data.flags.writeable  # the second still reads it
    _, dev = second.wait()
    assert data.flags.writeable
    assert same(srt.to_host(dev), data)


def test_many_staged_transfers_in_flight_complete_correctly(srt: ferry.Runtime) -> None:
    arrays = [random_array((int(n),), np.uint8, i) for i, n in enumerate([900_000, 70_000, 2 * MiB, 5, 1_300_000])]
    uploads = [srt.upload(a) for a in arrays]
    devs = [u.wait()[1] for u in reversed(uploads)][::-1]
    downloads = [srt.download(d) for d in devs]
    for a, d in zip(arrays, downloads, strict=True):
        assert same(d.wait()[1], a)


def test_a_dropped_staged_handle_is_retired_and_restores_the_array(srt: ferry.Runtime) -> None:
    data = random_array((2 * MiB,), np.uint8, 9)
    dev = srt.empty(data.shape, data.dtype)
    srt.upload(data, dev)  # dropped
    assert not data.flags.writeable
    settle(srt)
    gc.collect()
    assert data.flags.writeable
    assert dev.state == "closed"


def test_a_failure_in_the_middle_of_a_staged_download_publishes_nothing(backend_name: str) -> None:
    if backend_name != "emulated":
        pytest.skip("fault injection needs the emulated device")
    rt = ferry.Runtime("emulated", staging=SMALL)
    try:
        data = random_array((3 * MiB,), np.uint8, 10)
        _, dev = rt.upload(data).wait()
        out = np.zeros_like(data)
        testing.fail_next_copy(rt, after=5)  # the sixth chunk's DMA fails
        pending = rt.download(dev, out)
        with pytest.raises(ferry.TransferFailedError):
            pending.wait()
        assert dev.state == "abandoned"
        assert out.flags.writeable  # the lanes are done with it; it is the caller's again
        assert not same(out, data)  # and it was never completed
        # the runtime goes on working, with fresh slots
        fresh = random_array((3 * MiB,), np.uint8, 11)
        assert same(rt.to_host(rt.to_device(fresh)), fresh)
        stats = rt.stats()
        assert stats.failed == 1
    finally:
        rt.close()


def test_a_failed_staged_upload_abandons_the_destination(backend_name: str) -> None:
    if backend_name != "emulated":
        pytest.skip("fault injection needs the emulated device")
    rt = ferry.Runtime("emulated", staging=SMALL)
    try:
        data = random_array((2 * MiB,), np.uint8, 12)
        testing.fail_next_copy(rt, after=2)
        pending = rt.upload(data)
        with pytest.raises(ferry.TransferFailedError):
            pending.wait()
        assert data.flags.writeable
        with pytest.raises(ferry.TransferFailedError):
            pending.is_ready()
        assert rt.stats().abandoned_bytes >= data.nbytes
    finally:
        rt.close()


# -- registered arrays --------------------------------------------------------------------------------


def test_registered_arrays_take_the_pinned_route_with_no_host_copy(srt: ferry.Runtime) -> None:
    data = random_array((2 * MiB,), np.uint8, 13)
    out = np.zeros_like(data)
    reg_in, reg_out = srt.register(data), srt.register(out)
    assert srt.stats().registered_bytes == 4 * MiB
    start = srt.stats().host_copied_bytes
    _, dev = srt.upload(data).wait()
    _, got = srt.download(dev, out).wait()
    assert got is out and same(out, data)
    assert srt.stats().host_copied_bytes == start
    reg_in.release()
    reg_out.release()
    assert srt.stats().registered_bytes == 0
    reg_in.release()  # idempotent


def test_a_registration_is_never_released_while_a_transfer_uses_it(srt: ferry.Runtime) -> None:
    data = random_array((MiB,), np.uint8, 14)
    with srt.register(data) as reg:
        with testing.hold(srt, "upload"):
            pending = srt.upload(data)
            assert reg.in_use == 1
            with pytest.raises(ferry.BufferMovedError, match="still use"):
                reg.release()
        pending.wait()
        assert reg.in_use == 0
    assert not reg.active


def test_overlapping_registrations_are_refused(srt: ferry.Runtime) -> None:
    data = np.zeros(MiB, np.uint8)
    with srt.register(data), pytest.raises(ferry.FerryError, match="overlaps"):
        srt.register(data[1000:])
    with pytest.raises(TypeError):
        srt.register(data[::2])


def test_many_registrations_each_cover_exactly_their_own_memory(srt: ferry.Runtime) -> None:
    # registrations are kept sorted for a bisect lookup: pieces of one buffer with gaps between
    # them, registered and released out of order; a view inside a piece takes the registered route
    # (no host copy), one over a gap or across two pieces does not
    rng = np.random.default_rng(5)
    buf = np.arange(64 * 4096, dtype=np.uint32).view(np.uint8)
    pieces = [(i * 16384, i * 16384 + 12288) for i in range(64)]  # 12 KiB pieces, 4 KiB gaps
    order = rng.permutation(len(pieces))
    regs = {int(i): srt.register(buf[pieces[i][0]:pieces[i][1]]) for i in order}
    with pytest.raises(ferry.FerryError, match="overlaps"):
        srt.register(buf[pieces[7][1] - 8:pieces[8][0] + 8])  # reaches into both neighbours
    srt.register(buf[pieces[7][1]:pieces[8][0]]).release()  # the gap itself is free

    def copied(view: np.ndarray) -> int:  # host bytes the upload of view copied
        start = srt.stats().host_copied_bytes
        _, dev = srt.upload(view).wait()
        copied = srt.stats().host_copied_bytes - start
        assert same(srt.to_host(dev), view)
        return copied

    for i in rng.permutation(len(pieces))[:40]:
        a, b = pieces[int(i)]
        lo = int(rng.integers(a, b - 64))
        released = int(i) % 3 == 0
        if released:
            regs.pop(int(i)).release()
        assert copied(buf[lo:lo + 64]) == (64 if released else 0)
        assert copied(buf[b - 32:b + 32]) == 64  # runs into the gap
    assert copied(buf[pieces[9][1]:pieces[10][0]]) == 4096  # a gap
    for reg in regs.values():
        reg.release()
    assert srt.stats().registered_bytes == 0


def test_close_unpins_registrations(backend_name: str) -> None:
    rt = ferry.Runtime(backend_name)
    data = np.ones(MiB, np.uint8)
    reg = rt.register(data)
    rt.close()
    assert not reg.active
    rt2 = ferry.Runtime(backend_name)
    try:
        rt2.register(data).release()  # pinnable again: it was unpinned
    finally:
        rt2.close()


def test_a_fresh_output_is_allocated_when_none_is_given(srt: ferry.Runtime) -> None:
    data = random_array((700, 3000), np.float32, 15)
    _, dev = srt.upload(data).wait()
    source, out = srt.download(dev).wait()
    assert source is dev
    assert out.shape == data.shape and out.dtype == data.dtype and out.flags.writeable
    assert same(out, data)
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None  # the caller owns it outright


def test_fresh_outputs_reuse_resident_memory_only_after_every_view_died(srt: ferry.Runtime) -> None:
    data = random_array((2 * MiB,), np.uint8, 16)
    _, dev = srt.upload(data).wait()
    _, first = srt.download(dev).wait()
    first_addr = first.ctypes.data
    view = first[10:20]
    del first
    gc.collect()
    _, second = srt.download(dev).wait()
    assert second.ctypes.data != first_addr  # a live view keeps the block out of reuse
    second_addr = second.ctypes.data
    assert same(second, data)
    view[:] = 7  # still the caller's memory
    del view, second
    gc.collect()
    assert srt.stats().host_cache_bytes >= 2 * 2 * MiB
    _, third = srt.download(dev).wait()
    assert third.ctypes.data in (first_addr, second_addr)
    assert same(third, data)


def test_chunk_sizes_spread_over_lanes_within_the_bounds() -> None:
    config = ferry.StagingConfig(slot_bytes=4 * MiB, lanes=12, min_chunk_bytes=1 * MiB)
    assert config.chunk_bytes(8 * MiB) == 1 * MiB  # 8 lanes wake, not 12 tiny ones
    assert config.chunk_bytes(24 * MiB) == 2 * MiB  # every lane works
    assert config.chunk_bytes(1 << 30) == 4 * MiB  # never more than a slot
    small_slots = ferry.StagingConfig(slot_bytes=256 << 10)  # below the default smallest chunk: slots win
    assert small_slots.chunk_bytes(64 * MiB) == 256 << 10
    with pytest.raises(ValueError, match="min_chunk_bytes"):
        ferry.StagingConfig(min_chunk_bytes=100)
