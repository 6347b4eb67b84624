"""rt.batch(): one completion event shared by the transfers submitted inside it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ferry
from ferry import testing


def test_a_batch_shares_one_event_per_stream_and_every_transfer_is_right(rt: ferry.Runtime) -> None:
    n = 200
    data = [np.full(4096, i % 251, np.uint8) for i in range(n)]
    devs = [rt.empty(4096, np.uint8) for _ in range(n)]
    bufs = [rt.pinned(4096) for _ in range(n)]
    for b, d in zip(bufs, data, strict=True):
        b.as_array()[:] = d
    rt.upload_pending(rt.pinned(8), rt.empty(8, np.uint8)).wait()  # warm the event pool
    events_before = rt.stats().events
    with rt.batch():
        handles = [rt.upload_pending(b, d) for b, d in zip(bufs, devs, strict=True)]
        assert rt.stats().events == events_before  # no event per transfer
    assert rt.stats().events <= events_before + 1
    for h in reversed(handles):
        h.wait()
    outs = [rt.to_host(d) for d in devs]
    assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))


def test_polling_or_waiting_inside_a_batch_closes_its_segment(rt: ferry.Runtime) -> None:
    dev = rt.to_device(np.arange(1000, dtype=np.int32))
    with rt.batch():
        first = rt.download_pending(dev, rt.pinned(4000))
        deadline = time.monotonic() + 10
        while not first.is_ready() and time.monotonic() < deadline:  # never deadlocks
            time.sleep(0.001)
        assert first.is_ready()
        second = rt.download_pending(dev, rt.pinned(4000))
        _, buf = second.wait()  # waits inside the block
        assert np.array_equal(buf.as_array(np.int32), np.arange(1000))
    first.wait()


def test_dropped_batched_handles_are_retired(rt: ferry.Runtime) -> None:
    dev = rt.empty(4096, np.uint8)
    with rt.batch():
        for _ in range(10):
            rt.download_pending(dev, rt.pinned(4096))
    deadline = time.monotonic() + 10
    while rt.stats().retiring and time.monotonic() < deadline:
        rt.poll()
    stats = rt.stats()
    assert stats.retiring == 0 and stats.completed == stats.submitted
    assert dev.state == "owned"


def test_a_failure_inside_a_batch_fails_the_transfers_sharing_its_event(emu: ferry.Runtime) -> None:
    dev = emu.to_device(np.arange(100, dtype=np.int64))
    testing.fail_next_copy(emu, after=1)
    with emu.batch():
        handles = [emu.download_pending(dev, emu.pinned(800)) for _ in range(3)]
    failed = 0
    for h in handles:
        with pytest.raises(ferry.TransferFailedError):
            h.wait()
        failed += 1
    assert failed == 3 and emu.stats().failed == 3  # completion of none can be proven
    assert dev.state == "abandoned"


def test_the_emulated_device_is_reentrant_for_a_finalizer_on_its_own_threads(emu: ferry.Runtime) -> None:
    """A collection can run a finalizer on an emulated stream worker while the worker holds the device's
    lock; a finalizer that polls a handle then flushes a batch into the device from that thread. Here the
    same thread holds the lock, submits and polls (which flushes): it must not wait for itself."""
    from ferry._backends import _emulated

    buf, dev = emu.pinned(64), emu.empty(64, np.uint8)
    buf.as_array()[:] = 7
    done: list[ferry.Pending[object]] = []

    def inside_the_lock() -> None:
        with _emulated._SYSTEM_LOCK:  # as a stream worker mid-operation
            with emu.batch():
                pending = emu.upload_pending(buf, dev)  # waits in the batch's open segment
                pending.is_ready()  # flushes it: the device's copy call takes the lock again
            done.append(pending)

    worker = threading.Thread(target=inside_the_lock, daemon=True)
    worker.start()
    worker.join(30)
    assert len(done) == 1, "the device's lock is not reentrant: the thread waited for itself"
    _, dev = done[0].wait(timeout=30)
    assert np.all(emu.to_host(dev) == 7)


def test_a_finalizer_that_polls_a_batched_handle_mid_submission_is_safe(emu: ferry.Runtime) -> None:
    # a garbage collection can run inside a submission (any allocation), and a finalizer may poll a
    # handle of the open batch, which flushes the segment the submission is joining: the submission
    # must then start a new segment, never write into the flushed one
    import gc

    handles: list[ferry.Pending[object]] = []
    armed = [False]
    polls = [0]

    class Trap:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

        def __del__(self) -> None:
            # Polls only on the submitting thread: a collection may also run this on an emulated stream worker
            # that holds the emulated device's lock, while the submitter holds the runtime's lock and
            # waits for the device's: polling there would invert the two locks. That is the emulation's
            # own thread (the CUDA backend has none), not the submission path this test is about.
            if armed[0]:
                if handles and threading.current_thread() is submitter:
                    polls[0] += 1
                    handles[-1].is_ready()
                Trap()  # the next collection finds another

    submitter = threading.current_thread()
    n = 300
    devs = [emu.empty(8, np.uint8) for _ in range(n)]
    bufs = [emu.pinned(8) for _ in range(n)]
    for i, b in enumerate(bufs):
        b.as_array()[:] = i % 251
    threshold = gc.get_threshold()
    try:
        with emu.batch():
            armed[0] = True
            Trap()
            gc.set_threshold(1)
            for b, d in zip(bufs, devs, strict=True):
                handles.append(emu.upload_pending(b, d))
            armed[0] = False
    finally:
        armed[0] = False
        gc.set_threshold(*threshold)
        gc.collect()
    assert polls[0] > 0  # the finalizer did run inside the submissions
    results = [h.wait(timeout=30) for h in handles]
    assert all(np.all(emu.to_host(d) == i % 251) for i, (_, d) in enumerate(results))
    stats = emu.stats()
    assert stats.submitted == stats.completed and stats.in_flight == 0
