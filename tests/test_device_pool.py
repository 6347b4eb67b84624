"""The stream-ordered device pool and frees ordered after every consumer (emulated device).

The emulated device checks stream order by happens-before: a free that is not
ordered after a use queued on another stream is a violation even when the use
happened to run first, so each test ends with ``violations == []``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import eventually
from ferry import testing
from ferry._interop._dlpack import Imported

MiB = 1 << 20




def used(rt: ferry.Runtime) -> int:
    rt.poll()  # frees of arrays collected since the last call are issued here
    return rt.stats().device_pool_used_bytes


def slow_kernel(rt: ferry.Runtime, stream: int, seconds: float) -> None:
    """A long kernel on ``stream`` (it fills a scratch array that is exported, and dropped at once)."""
    testing.produce(rt, stream, rt.empty(16, np.uint8).ptr, 16, 0, delay=seconds)


@contextlib.contextmanager
def held(rt: ferry.Runtime, stream: int) -> Iterator[Callable[[], None]]:
    """Work queued on ``stream`` from now on waits for a gate (emulated device), so it is still
    pending for certain; the yielded function opens the gate, and so does the end of the block."""
    backend = testing.backend_of(rt)
    gate = backend.gate_create()
    backend.stream_wait_gate(backend.stream_from_handle(stream), gate)
    try:
        yield lambda: backend.gate_open(gate)
    finally:
        backend.gate_open(gate)


def address_through_dlpack(dev: ferry.DeviceArray, stream: int) -> tuple[int, Imported]:
    """The address a DLPack consumer on ``stream`` gets (the capsule is kept until released)."""
    imported = Imported(dev.__dlpack__(stream=stream))
    return imported.ptr, imported


# -- the pool ------------------------------------------------------------------------------------------------


def test_fresh_arrays_come_from_the_pool_and_go_back_to_it(emu: ferry.Runtime) -> None:
    assert "stream-ordered pool" in emu.info()["device_pool"]
    dev = emu.empty(8 * MiB, np.uint8)
    stats = emu.stats()
    assert stats.device_pool_used_bytes >= 8 * MiB and stats.device_pool_reserved_bytes >= 8 * MiB
    del dev
    assert eventually(lambda: used(emu) == 0)
    reserved = emu.stats().device_pool_reserved_bytes
    assert reserved >= 8 * MiB  # kept for the next batch
    for _ in range(50):  # the same size again and again: served from what the pool keeps
        dev = emu.empty(8 * MiB, np.uint8)
        del dev
        emu.poll()
    assert eventually(lambda: used(emu) == 0)
    assert emu.stats().device_pool_reserved_bytes == reserved


def test_a_fresh_array_is_usable_on_any_stream_at_once(emu: ferry.Runtime) -> None:
    """The allocation is ordered before every stream's first use with no event and no host wait
    of the caller: a producer and a reader on a side stream right away are not violations."""
    side = testing.side_stream(emu)
    dev = emu.empty(MiB, np.uint8)
    waits = testing.host_waits(emu)
    testing.produce(emu, side, dev.ptr, MiB, 0x42, delay=0.0)
    seen = testing.consume(emu, side, dev.ptr, MiB)
    assert testing.host_waits(emu) == waits
    assert np.all(seen.result() == 0x42)
    _, out = emu.download(dev).wait()  # ferry's copy stream: ordered too (the read finished on the host)
    assert np.all(out == 0x42)


def test_trim_gives_unused_memory_back(emu: ferry.Runtime) -> None:
    arrays = [emu.empty(4 * MiB, np.uint8) for _ in range(4)]
    kept = arrays.pop()
    del arrays
    assert eventually(lambda: used(emu) == emu.stats().device_bytes)
    assert emu.stats().device_pool_reserved_bytes >= 16 * MiB
    emu.trim()
    stats = emu.stats()
    assert stats.device_pool_reserved_bytes == stats.device_pool_used_bytes >= 4 * MiB  # in use stays
    del kept
    assert eventually(lambda: used(emu) == 0)
    emu.trim(keep_bytes=0)
    assert emu.stats().device_pool_reserved_bytes == 0
    with pytest.raises(TypeError):
        emu.trim("all")  # type: ignore[arg-type]


def test_device_pool_limit_bounds_what_the_pool_keeps_at_synchronization_points() -> None:
    with ferry.Runtime("emulated", device_pool_limit=6 * MiB) as rt:
        arrays = [rt.empty(4 * MiB, np.uint8) for _ in range(4)]  # past the limit: still allocated
        assert rt.stats().device_pool_reserved_bytes >= 16 * MiB
        del arrays
        assert eventually(lambda: used(rt) == 0)
        rt.to_host(rt.to_device(np.zeros(16, np.uint8)))  # waits: a synchronization point
        assert rt.stats().device_pool_reserved_bytes <= 6 * MiB
        assert testing.violations(rt) == []
    with pytest.raises(ValueError, match="device_pool_limit"):
        ferry.Runtime("emulated", device_pool_limit=-1)
    with pytest.raises(TypeError):
        ferry.Runtime("emulated", device_pool_limit=1.5)  # type: ignore[arg-type]


def test_an_allocation_past_the_devices_memory_trims_the_pool_and_retries(emu: ferry.Runtime) -> None:
    backend = testing.backend_of(emu)
    arrays = [emu.empty(8 * MiB, np.uint8) for _ in range(4)]
    del arrays
    assert eventually(lambda: used(emu) == 0)
    backend.memory_bytes = 40 * MiB  # 32 MiB reserved and free: a 16 MiB block only fits after a trim
    dev = emu.empty(16 * MiB, np.uint8)
    assert dev.nbytes == 16 * MiB and emu.stats().device_pool_reserved_bytes <= 40 * MiB
    with pytest.raises(MemoryError, match="out of memory"):
        emu.empty(64 * MiB, np.uint8)
    assert emu.stats().device_bytes == 16 * MiB  # the refused allocation changed nothing


def test_an_allocation_that_finds_the_device_full_waits_for_memory_a_consumer_still_reads(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = testing.backend_of(emu)
    consumer = testing.side_stream(emu)
    dev = emu.to_device(np.full(16 * MiB, 5, np.uint8))
    dev.record_stream(consumer)
    with held(emu, consumer) as go:
        seen = testing.consume(emu, consumer, dev._ptr, 16 * MiB)
        del dev
        assert used(emu) >= 16 * MiB  # dropped, but the consumer's read is queued: not freed
        backend.memory_bytes = 40 * MiB  # 32 MiB more fits only once that memory is back
        waited = []  # whether the read had run when the allocation began to wait for it
        real_wait = backend.event_wait

        def event_wait(event: Any, timeout: float | None = None) -> bool:
            waited.append(seen.ran())
            go()  # the consumer's read runs now, while the allocation waits for it
            return bool(real_wait(event, timeout))

        monkeypatch.setattr(backend, "event_wait", event_wait)
        big = emu.empty(32 * MiB, np.uint8)  # waits (bounded, interruptible) for the consumer, then reuses
        monkeypatch.undo()
    assert waited and not waited[0]
    assert big.nbytes == 32 * MiB
    assert seen.ran() and np.all(seen.result() == 5)
    assert testing.violations(emu) == []


def test_memory_a_consumer_stream_used_is_reused_once_its_work_is_done(emu: ferry.Runtime) -> None:
    # what the emulated pool can show: every free runs once the consumer's reads completed, and the
    # memory is reused. It does not model CUDA's rule that a block freed on another stream is reused
    # only once the host saw that free complete, which made the pool grow on the H200:
    # tests/test_device_pool_gpu.py::test_memory_a_torch_consumer_used_is_reused_by_the_pool covers that.
    consumer = testing.side_stream(emu)
    data = np.full(MiB, 9, np.uint8)
    reads = []  # each keeps the host array its read lands in
    for _ in range(50):
        dev = emu.to_device(data)
        dev.record_stream(consumer)
        reads.append(testing.consume(emu, consumer, dev._ptr, 4096))
        del dev
    assert eventually(lambda: used(emu) == 0)  # every free ran once the consumer's reads completed
    assert all(np.all(read.result() == 9) for read in reads)
    # reused, not one block per array. How many blocks are in use at once above depends on how far the
    # consumer's thread lags the submitting one (a stalled consumer is right to hold them all), so the
    # reuse is shown where the consumer keeps up: each read is waited for before the next array
    reserved = emu.stats().device_pool_reserved_bytes
    for _ in range(50):
        dev = emu.to_device(data)
        dev.record_stream(consumer)
        read = testing.consume(emu, consumer, dev._ptr, 4096)
        del dev
        assert np.all(read.result() == 9)
    assert emu.stats().device_pool_reserved_bytes <= reserved + 4 * MiB  # not 50 MiB more
    assert testing.violations(emu) == []


def test_an_allocation_looks_at_a_few_awaiting_frees_however_many_wait(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry._memory._device import REAP_LOOKAHEAD

    backend = testing.backend_of(emu)
    consumer = testing.side_stream(emu)
    data = np.full(4096, 3, np.uint8)
    reads = []
    with held(emu, consumer):  # everything below queues behind the gate
        for _ in range(40):
            dev = emu.to_device(data)
            dev.record_stream(consumer)
            reads.append(testing.consume(emu, consumer, dev._ptr, 4096))
            del dev
        emu.poll()  # 40 frees now wait for the consumer
        queries = []
        real_query = backend.event_query
        monkeypatch.setattr(backend, "event_query", lambda event: queries.append(event) or real_query(event))
        fresh = emu.empty(4096, np.uint8)
        assert len(queries) <= REAP_LOOKAHEAD  # not one per waiting free
        assert used(emu) >= 41 * 4096  # nothing freed under the consumer
        monkeypatch.undo()
    assert all(np.all(read.result() == 3) for read in reads)
    assert eventually(lambda: used(emu) == fresh.nbytes)  # then every free ran
    assert testing.violations(emu) == []


def test_the_transfer_path_never_waits_on_the_host_for_memory(emu: ferry.Runtime) -> None:
    consumer = testing.side_stream(emu)
    data = np.arange(64 * 1024, dtype=np.uint8)
    emu.to_device(data)  # warm the pinned pool
    waits = testing.host_waits(emu)
    for _ in range(20):  # fresh destination, hand-off, drop: the free is stream-ordered
        pending = emu.upload(data)
        dev = pending.hand_off(consumer)
        del dev, pending
        emu.poll()
    assert testing.host_waits(emu) == waits


# -- frees ordered after consumers ---------------------------------------------------------------------------


def test_a_hand_off_stream_orders_the_free_after_the_consumers_work(emu: ferry.Runtime) -> None:
    data = (np.arange(MiB) % 249).astype(np.uint8)
    consumer = testing.side_stream(emu)
    buf = emu.pinned(MiB)
    buf.as_array()[:] = data
    dev = emu.empty(MiB, np.uint8)
    pending = emu.upload_pending(buf, dev)
    dev = pending.hand_off(consumer)
    with held(emu, consumer):  # the consumer's work waits for a gate
        seen = testing.consume(emu, consumer, dev._ptr, MiB)  # then the read (_ptr: no export)
        pending.wait()
        del dev, pending  # the last references (a waited handle keeps its result), while the read is queued
        emu.poll()
        assert not seen.ran()
        assert emu.stats().device_pool_used_bytes >= MiB  # not back in the pool before the read
    assert np.array_equal(seen.result(), data)  # the read saw the bytes: nothing was freed under it
    assert eventually(lambda: used(emu) == 0)
    assert testing.violations(emu) == []


def test_the_stream_a_dlpack_consumer_names_orders_the_free(emu: ferry.Runtime) -> None:
    consumer = testing.side_stream(emu)
    dev = emu.to_device(np.full(MiB, 7, np.uint8))
    ptr, imported = address_through_dlpack(dev, consumer)
    with held(emu, consumer):
        seen = testing.consume(emu, consumer, ptr, MiB)
        imported.release()  # the consumer is done with the capsule: its queued read is not
        del dev
        emu.poll()
        assert not seen.ran()
    assert np.all(seen.result() == 7)
    assert eventually(lambda: used(emu) == 0)


def test_record_stream_orders_the_free_after_each_stream(emu: ferry.Runtime) -> None:
    first, second = testing.side_stream(emu), testing.side_stream(emu)
    dev = emu.to_device(np.full(MiB, 3, np.uint8))
    dev.record_stream(first)
    dev.record_stream(second)
    dev.record_stream(second)  # once is enough
    slow_kernel(emu, second, 0.2)
    reads = [testing.consume(emu, s, dev._ptr, MiB) for s in (first, second)]
    del dev
    emu.poll()
    assert all(np.all(r.result() == 3) for r in reads)
    assert eventually(lambda: used(emu) == 0)
    with pytest.raises(TypeError, match="not a stream"):
        emu.empty(4).record_stream("side")


@pytest.mark.slow
def test_an_export_with_no_known_stream_is_freed_only_after_the_device_was_idle(emu: ferry.Runtime) -> None:
    """The CUDA Array Interface names no consumer stream: the free waits for the whole device."""
    backend = testing.backend_of(emu)
    syncs = backend.device_syncs
    consumer = testing.side_stream(emu)
    dev = emu.to_device(np.full(MiB, 9, np.uint8))
    ptr = dev.__cuda_array_interface__["data"][0]
    with held(emu, consumer):
        seen = testing.consume(emu, consumer, ptr, MiB)
        waits = testing.host_waits(emu)
        del dev
        emu.poll()  # hands the memory to the background thread: the caller does not wait
        assert testing.host_waits(emu) == waits
        assert emu.stats().device_pool_used_bytes >= MiB
    assert np.all(seen.result() == 9)
    assert eventually(lambda: used(emu) == 0)
    assert backend.device_syncs > syncs


def test_ptr_is_an_export_with_no_known_stream_until_record_stream_names_it(emu: ferry.Runtime) -> None:
    backend = testing.backend_of(emu)
    consumer = testing.side_stream(emu)
    a = emu.to_device(np.full(MiB, 1, np.uint8))
    seen = testing.consume(emu, consumer, a.ptr, MiB)
    del a
    emu.poll()
    assert np.all(seen.result() == 1)
    assert eventually(lambda: used(emu) == 0 and backend.device_syncs > 0)
    syncs = backend.device_syncs
    b = emu.to_device(np.full(MiB, 2, np.uint8))
    seen = testing.consume(emu, consumer, b.ptr, MiB)
    b.record_stream(consumer)  # every use is on this stream: no device-wide wait needed
    del b
    emu.poll()
    assert np.all(seen.result() == 2)
    assert eventually(lambda: used(emu) == 0)
    assert backend.device_syncs == syncs


def test_an_event_recorded_again_stands_for_its_newest_record(emu: ferry.Runtime) -> None:
    """CUDA's rule, kept by the emulated device: a stream's wait is for the record that was newest
    when it was made, and an event's older record that completes after a newer one changes nothing
    for the event. (The latter made the event pending again, so a stream that waited for the newer
    record waited forever: runtimes whose pooled events were re-recorded on another stream hung in
    close(), as two ferry.prefetch runs on two consumer streams did.)"""
    backend = testing.backend_of(emu)
    slow, fast, waiter = backend.stream_create(), backend.stream_create(), backend.stream_create()
    scratch = emu.empty(4096, np.uint8)
    event = backend.event_create()
    try:
        testing.produce(emu, backend.stream_handle(slow), scratch.ptr, 4096, 1, delay=0.1)  # slow is busy
        backend.event_record(event, slow)  # the older record: completes after the fill
        backend.stream_wait_event(waiter, event)  # a wait made for the older record
        backend.event_record(event, fast)  # the newer one: at once
        seen = testing.consume(emu, backend.stream_handle(waiter), scratch.ptr, 4096)
        backend.event_synchronize(event)
        assert (seen.result() == 1).all()  # the wait held for its own record, not the newer one
        backend.stream_synchronize(slow)  # the older record has completed, after the newer one
        assert backend.event_query(event)  # still the newer record's state
        backend.stream_wait_event(waiter, event)
        backend.stream_synchronize(waiter)  # nothing waits for the older record
    finally:
        backend.stream_synchronize(slow)
        for stream in (slow, fast, waiter):
            backend.stream_destroy(stream)
        backend.event_destroy(event)


def test_the_sanitizer_flags_a_free_not_ordered_after_a_queued_use(emu: ferry.Runtime) -> None:
    """The check the tests above rely on: a free racing a read on another stream is reported,
    even when the read has already run."""
    backend = testing.backend_of(emu)
    consumer = testing.side_stream(emu)
    stream = backend.stream_create()
    try:
        pool = backend.mem_pool_create(None)
        ptr = backend.mem_pool_alloc(pool, 4096, stream)
        seen = testing.consume(emu, consumer, ptr, 4096)
        seen.result()  # the read ran, and the host saw it: a free now is ordered after it
        backend.mem_free_async(ptr, stream)
        assert backend.violations == []
        ptr = backend.mem_pool_alloc(pool, 4096, stream)
        racing = testing.consume(emu, consumer, ptr, 4096)
        time.sleep(0.05)  # the read has run, but nothing orders the free after it
        backend.mem_free_async(ptr, stream)
        assert any("could race the free" in v for v in backend.violations)
        racing.result()  # (the read's output must outlive the read)
        backend.mem_pool_destroy(pool)
    finally:
        backend.violations.clear()
        backend.stream_synchronize(stream)
        backend.stream_destroy(stream)


def test_close_frees_arrays_still_used_elsewhere_after_their_consumers() -> None:
    rt = ferry.Runtime("emulated")
    consumer = testing.side_stream(rt)
    slow_kernel(rt, consumer, 0.2)
    by_stream = rt.to_device(np.full(MiB, 4, np.uint8))
    by_stream.record_stream(consumer)
    unknown = rt.to_device(np.full(MiB, 5, np.uint8))
    reads = [testing.consume(rt, consumer, by_stream._ptr, MiB),
             testing.consume(rt, consumer, unknown.__cuda_array_interface__["data"][0], MiB)]
    rt.close()  # frees after the consumer's reads, which ran by the time it returns
    assert all(r.ran() for r in reads)
    assert [int(r._out[0]) for r in reads] == [4, 5]
    assert testing.violations(rt) == []
    assert testing.backend_of(rt).live_allocations() == (0, 0)
    stats = rt.stats()
    assert stats.device_bytes == 0 and stats.device_pool_reserved_bytes == 0


def test_without_memory_pools_cuMemAlloc_serves_and_frees_wait_for_consumers(  # noqa: N802
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FERRY_EMULATED_POOLS", "0")
    with ferry.Runtime("emulated") as rt:
        assert "cuMemAlloc" in rt.info()["device_pool"]
        consumer = testing.side_stream(rt)
        data = (np.arange(MiB) % 13).astype(np.uint8)
        dev = rt.upload(data).hand_off(consumer)
        slow_kernel(rt, consumer, 0.2)
        seen = testing.consume(rt, consumer, dev._ptr, MiB)
        assert rt.stats().device_pool_used_bytes >= MiB
        del dev
        rt.poll()
        assert np.array_equal(seen.result(), data)
        assert eventually(lambda: used(rt) == 0)
        assert testing.violations(rt) == []
        assert np.array_equal(rt.to_host(rt.to_device(data)), data)


def test_dropped_arrays_are_collected_and_freed_in_order_at_scale(emu: ferry.Runtime) -> None:
    consumer = testing.side_stream(emu)
    data = np.ones(4096, np.uint8)
    reads = []
    for i in range(300):
        if i % 3 == 0:  # handed to the consumer, which reads it
            dev = emu.upload(data).hand_off(consumer)
            reads.append(testing.consume(emu, consumer, dev._ptr, 4096))
        else:  # handed off unattached, or waited
            dev = emu.upload(data).hand_off() if i % 3 == 1 else emu.upload(data).wait()[1]
        del dev
    gc.collect()
    assert eventually(lambda: used(emu) == 0)
    assert testing.violations(emu) == []
    assert all(np.all(r.result() == 1) for r in reads)
