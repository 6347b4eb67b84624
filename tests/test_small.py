"""Small transfers at driver speed (issue 16): the small pageable route, batches submitted as one
device batch at block exit, the compiled CUDA path and its fallbacks. Each test runs on the emulated
device and, where one is usable, on a GPU (the ``rt`` fixture)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _native, testing
from ferry._backends._base import DeviceError
from ferry._routes._small import MAX_SLOTS, SLOT_BYTES
from ferry._runtime import parts_of

KiB = 1 << 10


def counts(rt: ferry.Runtime) -> dict[str, int]:
    return testing.fast_path_counts(rt)


def settle(rt: ferry.Runtime) -> None:
    deadline = time.monotonic() + 10
    gc.collect()
    rt.poll()
    while rt.stats().retiring and time.monotonic() < deadline:
        time.sleep(0.001)
        rt.poll()


# -- the small pageable route ----------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 16, 4 * KiB, SLOT_BYTES])
def test_small_arrays_take_the_small_route_and_arrive_intact(rt: ferry.Runtime, nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dev = rt.empty(nbytes, np.uint8)
    before = counts(rt)
    _, dev = rt.upload(data, dev).wait()
    out = np.zeros_like(data)
    _, got = rt.download(dev, out).wait()
    after = counts(rt)
    assert got is out and np.array_equal(out, data)
    assert after["small_uploads"] == before["small_uploads"] + 1
    assert after["small_downloads"] == before["small_downloads"] + 1
    assert out.flags.writeable and data.flags.writeable


def test_new_destinations_and_outputs_take_it_too(rt: ferry.Runtime) -> None:
    data = np.arange(1000, dtype=np.float64).reshape(10, 100)
    before = counts(rt)
    dev = rt.to_device(data)
    back = rt.to_host(dev)
    after = counts(rt)
    assert dev.shape == (10, 100) and dev.dtype == np.float64
    assert np.array_equal(back, data) and back.flags.writeable and back.flags.c_contiguous
    assert after["small_uploads"] - before["small_uploads"] == 1
    assert after["small_downloads"] - before["small_downloads"] == 1


def test_arrays_are_read_only_while_pending_and_the_slots_are_reused(rt: ferry.Runtime) -> None:
    data = np.arange(256, dtype=np.int32)
    dev = rt.empty(256, np.int32)
    with testing.hold(rt, "both"):
        pending = rt.upload(data, dev)
        assert not data.flags.writeable and pending.is_ready() is False
    _, dev = pending.wait()
    assert data.flags.writeable
    allocations = rt.stats().pinned_allocations
    out = np.empty_like(data)
    for _ in range(200):
        _, dev = rt.upload(data, dev).wait()
        dev, _ = rt.download(dev, out).wait()
    assert np.array_equal(out, data)
    now = counts(rt)
    assert rt.stats().pinned_allocations <= allocations + 1  # the download ring's one slot at most
    assert now["small_upload_slots"] == 1 and now["small_download_slots"] == 1


def test_a_full_ring_hands_over_to_the_full_path(rt: ferry.Runtime) -> None:
    arrays = [np.full(64, i % 251, np.uint8) for i in range(MAX_SLOTS + 8)]
    devs = [rt.empty(64, np.uint8) for _ in arrays]
    before = counts(rt)["small_uploads"]
    with testing.hold(rt, "upload"):
        handles = [rt.upload(a, d) for a, d in zip(arrays, devs, strict=True)]
        assert counts(rt)["small_uploads"] - before == MAX_SLOTS  # then every slot is in flight
    for h, a in zip(handles, arrays, strict=True):
        _, dev = h.wait()
        assert np.array_equal(rt.to_host(dev), a)
    assert counts(rt)["small_upload_slots"] == MAX_SLOTS


def test_what_the_small_route_does_not_take_goes_the_full_way(rt: ferry.Runtime) -> None:
    start = counts(rt)
    strided = np.arange(200, dtype=np.int16)[::2]
    _, dev = rt.upload(strided).wait()
    large = np.ones(SLOT_BYTES + 1, np.uint8)
    _, big = rt.upload(large).wait()
    column = np.zeros((100, 2), np.int16)[:, 0]
    rt.download(dev, column).wait()
    assert np.array_equal(column, strided)
    with rt.batch():
        batched = rt.upload(np.ones(10, np.uint8))
    batched.wait()
    reg_data = np.arange(64, dtype=np.uint8)
    registration = rt.register(reg_data)
    rt.upload(reg_data).wait()
    registration.release()
    assert counts(rt)["small_uploads"] == start["small_uploads"]
    assert counts(rt)["small_downloads"] == start["small_downloads"]
    big.close()
    assert np.array_equal(rt.to_host(dev), strided)


def test_refusals_are_the_full_paths_own(rt: ferry.Runtime) -> None:
    dev = rt.empty(10, np.float32)
    with pytest.raises(ferry.TransferSubmitError, match="shape/dtype mismatch"):
        rt.upload(np.zeros(10, np.float64), dev)
    frozen = np.zeros(10, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ferry.TransferSubmitError, match="read-only"):
        rt.download(dev, frozen)
    with pytest.raises(ferry.TransferSubmitError, match="fixed-size"):
        rt.upload(np.array([object()] * 3))
    assert dev.state == "owned" and rt.stats().device_bytes >= 40


def test_a_dropped_small_transfer_retires_and_restores_the_array(rt: ferry.Runtime) -> None:
    data = np.arange(100, dtype=np.uint8)
    dev = rt.empty(100, np.uint8)
    rt.upload(data, dev)  # dropped
    assert not data.flags.writeable
    settle(rt)
    assert data.flags.writeable and dev.state == "closed"
    assert rt.stats().in_flight == 0


def test_hand_off_of_a_small_upload(rt: ferry.Runtime) -> None:
    data = np.arange(32, dtype=np.float32)
    pending = rt.upload(data)
    dev = pending.hand_off()
    assert dev.state == "owned"
    assert np.array_equal(rt.to_host(dev), data)  # ordered after the upload on the device
    source, same = pending.wait()
    assert source is data and same is dev and data.flags.writeable


def test_a_failed_small_upload_abandons_its_slot(emu: ferry.Runtime) -> None:
    data = np.arange(64, dtype=np.uint8)
    dev = emu.empty(64, np.uint8)
    emu.upload(data, dev).wait()
    testing.fail_next_copy(emu)
    pending = emu.upload(data, dev)
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()
    assert dev.state == "abandoned" and data.flags.writeable
    assert emu.stats().abandoned_bytes >= SLOT_BYTES
    assert counts(emu)["small_upload_slots"] == 0  # the slot the DMA may still touch is gone
    fresh = emu.to_device(data)  # a new slot
    assert np.array_equal(emu.to_host(fresh), data) and counts(emu)["small_upload_slots"] == 1


def test_a_failed_small_download_publishes_nothing(emu: ferry.Runtime) -> None:
    dev = emu.to_device(np.arange(64, dtype=np.uint8))
    out = np.full(64, 7, np.uint8)
    testing.fail_next_copy(emu)
    pending = emu.download(dev, out)
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()
    assert np.all(out == 7) and out.flags.writeable


def test_the_small_route_runs_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "load", lambda: None)
    with ferry.Runtime("emulated") as rt:
        data = np.arange(77, dtype=np.int16)
        before = counts(rt)["small_uploads"]
        assert np.array_equal(rt.to_host(rt.to_device(data)), data)
        assert counts(rt)["small_uploads"] == before + 1


# -- batches: one device batch per stream at block exit ------------------------------------------------------


class Recorder:
    """Wraps a backend's ``copy_batch``: what each device batch carried, in order."""

    def __init__(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[bool, list[int], list[int], list[int]]] = []
        inner = backend.copy_batch

        def copy_batch(upload: bool, dsts: list[int], srcs: list[int], sizes: list[int], stream: Any,
                       event: Any) -> None:
            self.calls.append((upload, list(dsts), list(srcs), list(sizes)))
            inner(upload, dsts, srcs, sizes, stream, event)

        monkeypatch.setattr(backend, "copy_batch", copy_batch)


@pytest.fixture
def recorder(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    yield Recorder(testing.backend_of(rt), monkeypatch)


def test_a_batch_starts_its_copies_at_block_exit_in_one_device_batch(rt: ferry.Runtime, recorder: Recorder) -> None:
    n = 50
    bufs = [rt.pinned(256 + i) for i in range(n)]
    devs = [rt.empty(256 + i, np.uint8) for i in range(n)]
    for i, b in enumerate(bufs):
        b.as_array()[:] = i
    with rt.batch():
        handles = [rt.upload_pending(b, d) for b, d in zip(bufs, devs, strict=True)]
        assert recorder.calls == []  # nothing enqueued inside the block
    assert len(recorder.calls) == 1
    upload, dsts, srcs, sizes = recorder.calls[0]
    assert upload and dsts == [d._ptr for d in devs] and sizes == [256 + i for i in range(n)]
    assert srcs == [h._record.moved[0]._block.ptr for h in handles]  # submission order
    for i, h in enumerate(handles):
        _, dev = h.wait()
        assert np.all(rt.to_host(dev) == i)


def test_a_long_batch_goes_to_the_device_in_segments_while_it_is_built(rt: ferry.Runtime,
                                                                       recorder: Recorder) -> None:
    from ferry._completion import SEGMENT_COPIES

    count = 2 * SEGMENT_COPIES + 88
    bufs = [rt.pinned(64) for _ in range(count)]
    for i, b in enumerate(bufs):
        b.as_array()[:] = i % 251
    devs = [rt.empty(64, np.uint8) for _ in range(count)]
    events = rt.stats().events
    with rt.batch():
        handles = []
        for b, d in zip(bufs, devs, strict=True):
            handles.append(rt.upload_pending(b, d))
            if len(handles) == SEGMENT_COPIES:
                assert recorder.calls == []
            if len(handles) == SEGMENT_COPIES + 1:
                assert len(recorder.calls) == 1  # the first segment went once the next copy came
    assert [len(c[1]) for c in recorder.calls] == [SEGMENT_COPIES, SEGMENT_COPIES, 88]
    assert [d for c in recorder.calls for d in c[1]] == [d._ptr for d in devs]
    assert rt.stats().events <= events + 3
    for i, h in enumerate(handles):
        _, dev = h.wait()
        if i % 97 == 0:
            assert np.all(rt.to_host(dev) == i % 251)


def test_both_directions_in_one_batch_make_one_device_batch_each(rt: ferry.Runtime, recorder: Recorder) -> None:
    sources = [rt.to_device(np.full(100, i, np.uint8)) for i in range(10)]
    bufs = [rt.pinned(100) for _ in range(10)]
    for b in bufs:
        b.as_array()[:] = 200
    targets = [rt.empty(100, np.uint8) for _ in range(10)]
    with rt.batch():
        downs = [rt.download_pending(s, rt.pinned(100)) for s in sources]
        ups = [rt.upload_pending(b, t) for b, t in zip(bufs, targets, strict=True)]
    assert sorted(c[0] for c in recorder.calls) == [False, True]
    assert all(len(c[1]) == 10 for c in recorder.calls)
    for i, h in enumerate(downs):
        _, buf = h.wait()
        assert np.all(buf.as_array() == i)
    for h in ups:
        _, dev = h.wait()
        assert np.all(rt.to_host(dev) == 200)


def test_waiting_inside_the_block_submits_what_came_before(rt: ferry.Runtime, recorder: Recorder) -> None:
    dev = rt.to_device(np.arange(100, dtype=np.uint8))
    with rt.batch():
        first = rt.download_pending(dev, rt.pinned(100))
        second = rt.download_pending(dev, rt.pinned(100))
        _, buf = second.wait()  # flushes the segment: both copies, one device batch
        assert len(recorder.calls) == 1 and len(recorder.calls[0][1]) == 2
        third = rt.download_pending(dev, rt.pinned(100))
    assert len(recorder.calls) == 2 and len(recorder.calls[1][1]) == 1
    for h in (first, third):
        _, b = h.wait()
        assert np.array_equal(b.as_array(), np.arange(100, dtype=np.uint8))
    assert np.array_equal(buf.as_array(), np.arange(100, dtype=np.uint8))


def test_a_destination_repeated_in_a_segment_starts_a_new_device_batch(emu: ferry.Runtime,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(testing.backend_of(emu), monkeypatch)
    backing = emu.empty(64, np.uint8)
    foreign = testing.ForeignArray(backing, stream=None)  # another library's memory: not tracked by ferry
    first, second = emu.pinned(64), emu.pinned(64)
    first.as_array()[:] = 1
    second.as_array()[:] = 2
    with emu.batch():
        a = emu.upload_pending(first, foreign)
        b = emu.upload_pending(second, foreign)
    assert [len(c[1]) for c in recorder.calls] == [1, 1]  # stream order between the two, not any order
    a.wait()
    b.wait()
    assert np.all(emu.to_host(backing) == 2)


def test_a_full_segment_the_device_refuses_fails_its_transfers_at_once(emu: ferry.Runtime,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry._completion import SEGMENT_COPIES

    def refuse(*args: Any) -> None:
        raise DeviceError("refused by the test", code=1)

    monkeypatch.setattr(testing.backend_of(emu), "copy_batch", refuse)
    devs = [emu.empty(8, np.uint8) for _ in range(SEGMENT_COPIES + 1)]
    with emu.batch():
        handles = [emu.upload_pending(emu.pinned(8), d) for d in devs]
        stats = emu.stats()
        assert stats.failed == SEGMENT_COPIES and stats.in_flight == 1  # the first segment failed at once
    for h in handles:
        with pytest.raises(ferry.TransferFailedError):
            h.wait()
    assert all(d.state == "abandoned" for d in devs)


def test_a_batch_the_device_refuses_fails_its_transfers(emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> None:
        raise DeviceError("refused by the test", code=1)

    monkeypatch.setattr(testing.backend_of(emu), "copy_batch", refuse)
    bufs = [emu.pinned(64) for _ in range(3)]
    devs = [emu.empty(64, np.uint8) for _ in range(3)]
    with emu.batch():
        handles = [emu.upload_pending(b, d) for b, d in zip(bufs, devs, strict=True)]
    for h in handles:
        with pytest.raises(ferry.TransferFailedError):
            h.wait()
    assert all(d.state == "abandoned" for d in devs) and emu.stats().failed == 3


def test_device_to_device_copies_in_a_batch_keep_their_order(emulated_pair: tuple[ferry.Runtime, ferry.Runtime]
                                                              ) -> None:
    a, b = emulated_pair
    src = a.to_device(np.arange(1000, dtype=np.int32))
    dst = b.empty(1000, np.int32)
    with b.batch():
        pending = b.copy_pending(src, dst)
    src, dst = pending.wait()
    assert np.array_equal(b.to_host(dst), np.arange(1000, dtype=np.int32))


# -- the compiled CUDA path ------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_runs_the_compiled_path_when_the_extension_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_CUDA_FAST_PATH", raising=False)  # the default
    with ferry.Runtime("cuda") as rt:
        info = rt.info()
        if _native.load() is None:
            assert info["fast_path"].startswith("cuda.bindings")
            return
        assert info["fast_path"].startswith("native")
        # "waits" counts the compiled event waits, and how many a wait() makes depends on when the copy
        # ends: one if within SPIN_BASE (50 us) of the wait, a second event_wait after it, and the watcher's
        # event_synchronize calls once it sleeps. So each copy's stream is synchronized first (through
        # cuda.bindings, not a compiled wait): the copy is complete, and wait() asks the compiled path once.
        backend, parts = testing.backend_of(rt), parts_of(rt)
        before = counts(rt)
        buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
        buf.as_array()[:] = 9
        upload = rt.upload_pending(buf, dev)
        backend.stream_synchronize(parts.h2d)
        buf, dev = upload.wait()
        download = rt.download_pending(dev, buf)
        backend.stream_synchronize(parts.d2h)
        dev, buf = download.wait()
        after = counts(rt)
        assert np.all(buf.as_array() == 9)
        assert after["copies"] - before["copies"] == 2 and after["waits"] - before["waits"] == 2
        buf, dev = rt.upload_pending(buf, dev).wait()  # not synchronized: the copy may still run
        assert counts(rt)["waits"] - after["waits"] >= 1  # however long it ran, wait() asked the compiled path
        after = counts(rt)
        with rt.batch():
            handles = [rt.upload_pending(rt.pinned(4096), rt.empty(4096, np.uint8)) for _ in range(20)]
        for h in handles:
            h.wait()
        batched = counts(rt)
        if info["fast_path"].startswith("native (batches: cuMemcpyBatchAsync"):
            now = testing.backend_of(rt).fast_path
            assert now == info["fast_path"], now  # the driver took the batch's description
            assert batched["batches"] - after["batches"] == 1
            assert batched["batched_copies"] - after["batched_copies"] == 20
        else:
            assert batched["copies"] - after["copies"] == 20


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["FERRY_NATIVE=0", "FERRY_CUDA_FAST_PATH=0", "FERRY_MEMCPY_BATCH=0"])
def test_cuda_fallbacks_move_the_same_bytes(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    name, value = how.split("=")
    monkeypatch.delenv("FERRY_CUDA_FAST_PATH", raising=False)  # the compiled path, then each way out of it
    monkeypatch.setenv(name, value)
    with ferry.Runtime("cuda") as rt:
        fast_path = rt.info()["fast_path"]
        if name in ("FERRY_NATIVE", "FERRY_CUDA_FAST_PATH"):
            assert fast_path.startswith("cuda.bindings")
        elif _native.load() is not None:
            assert fast_path.startswith("native (batches: a loop")
        data = [np.full(4096, i, np.uint8) for i in range(30)]
        bufs = [rt.pinned(4096) for _ in data]
        for b, d in zip(bufs, data, strict=True):
            b.as_array()[:] = d
        devs = [rt.empty(4096, np.uint8) for _ in data]
        with rt.batch():
            handles = [rt.upload_pending(b, d) for b, d in zip(bufs, devs, strict=True)]
        for h, d in zip(handles, data, strict=True):
            _, dev = h.wait()
            assert np.array_equal(rt.to_host(dev), d)
        small = np.arange(100, dtype=np.float32)
        assert np.array_equal(rt.to_host(rt.to_device(small)), small)
