"""Reliability: bad input refused cleanly, and bounded resources under load."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import testing


class Fixture:
    """A runtime with one owned object of each kind, plus a closed and a foreign one."""

    def __init__(self, rt: ferry.Runtime, other: ferry.Runtime) -> None:
        self.rt = rt
        self.buf = rt.pinned(256)
        self.buf.as_array()[:] = 3
        self.dev = rt.empty(256, np.uint8)
        self.closed_buf = rt.pinned(256)
        self.closed_buf.close()
        self.closed_dev = rt.empty(256, np.uint8)
        self.closed_dev.close()
        self.foreign_buf = other.pinned(256)
        self.foreign_dev = other.empty(256, np.uint8)
        self.small_buf = rt.pinned(100)

    def owned(self) -> list[Any]:
        return [self.buf, self.dev, self.foreign_buf, self.foreign_dev, self.small_buf]


# (name, call, exception, message fragment)
CASES: list[tuple[str, Callable[[Fixture], Any], type[BaseException], str]] = [
    ("pinned(0)", lambda f: f.rt.pinned(0), ValueError, "nbytes >= 1"),
    ("pinned(-5)", lambda f: f.rt.pinned(-5), ValueError, "nbytes >= 1"),
    ("pinned(2**60)", lambda f: f.rt.pinned(2**60), ValueError, "larger than"),
    ("pinned(1.5)", lambda f: f.rt.pinned(1.5), TypeError, "int"),  # type: ignore[arg-type]
    ("pinned('8')", lambda f: f.rt.pinned("8"), TypeError, "int"),  # type: ignore[arg-type]
    ("empty negative shape", lambda f: f.rt.empty((4, -1)), ValueError, "negative"),
    ("empty huge", lambda f: f.rt.empty((2**40, 2**20)), ValueError, "larger than"),
    ("empty bad shape type", lambda f: f.rt.empty("big"), TypeError, "shape"),  # type: ignore[arg-type]
    ("empty object dtype", lambda f: f.rt.empty(4, object), TypeError, "objects"),
    ("empty void0 dtype", lambda f: f.rt.empty(4, "V0"), TypeError, "fixed size"),
    ("as_array too large", lambda f: f.buf.as_array(np.float64, 1000), ValueError, "needs"),
    ("as_array negative", lambda f: f.buf.as_array(np.uint8, (-1,)), ValueError, "negative"),
    ("upload: small buffer", lambda f: f.rt.upload_pending(f.small_buf, f.dev), ferry.TransferSubmitError, "holds 100"),
    ("download: small buffer", lambda f: f.rt.download_pending(f.dev, f.small_buf), ferry.TransferSubmitError,
     "holds 100"),
    ("upload: closed buffer", lambda f: f.rt.upload_pending(f.closed_buf, f.dev), ferry.TransferSubmitError,
     "closed"),
    ("upload: closed array", lambda f: f.rt.upload_pending(f.buf, f.closed_dev), ferry.TransferSubmitError,
     "closed"),
    ("download: closed array", lambda f: f.rt.download_pending(f.closed_dev, f.buf), ferry.TransferSubmitError,
     "closed"),
    ("upload: foreign buffer", lambda f: f.rt.upload_pending(f.foreign_buf, f.dev), ferry.TransferSubmitError,
     "another runtime"),
    ("download: foreign array", lambda f: f.rt.download_pending(f.foreign_dev, f.buf), ferry.TransferSubmitError,
     "another runtime"),
    ("upload: list", lambda f: f.rt.upload_pending([1, 2], f.dev), ferry.TransferSubmitError, "PinnedHostBuffer"),
    ("upload: None", lambda f: f.rt.upload_pending(f.buf, None), ferry.TransferSubmitError, "DeviceArray"),
    ("download: ndarray", lambda f: f.rt.download_pending(np.zeros(256, np.uint8), f.buf),
     ferry.TransferSubmitError, "DeviceArray"),
    ("upload(ndarray) wrong shape", lambda f: f.rt.upload(np.zeros(255, np.uint8), f.dev),
     ferry.TransferSubmitError, "mismatch"),
    ("upload(ndarray) wrong dtype", lambda f: f.rt.upload(np.zeros(256, np.int8), f.dev),
     ferry.TransferSubmitError, "mismatch"),
    ("upload(ndarray) objects", lambda f: f.rt.upload(np.array([None] * 4)), ferry.TransferSubmitError, "fixed-size"),
    ("download into wrong shape", lambda f: f.rt.download(f.dev, np.zeros((16, 15), np.uint8)),
     ferry.TransferSubmitError, "mismatch"),
    ("download into list", lambda f: f.rt.download(f.dev, [0] * 256), ferry.TransferSubmitError, "NumPy"),
    ("register non-contiguous", lambda f: f.rt.register(np.zeros(100)[::2]), TypeError, "C-contiguous"),
    ("register empty", lambda f: f.rt.register(np.zeros(0)), TypeError, "non-empty"),
    ("Runtime bad backend", lambda f: ferry.Runtime("metal"), ValueError, "backend"),
    ("Runtime negative device", lambda f: ferry.Runtime("emulated", -1), ValueError, "device"),
    ("StagingConfig tiny slots", lambda f: ferry.StagingConfig(slot_bytes=10), ValueError, "slot_bytes"),
    ("hold bad direction", lambda f: testing.hold(f.rt, "sideways").__enter__(), ValueError, "direction"),
]


@pytest.mark.parametrize("name, call, error, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_clearly_and_changes_nothing(
    rt: ferry.Runtime, name: str, call: Callable[[Fixture], Any], error: type[BaseException], fragment: str
) -> None:
    other = ferry.Runtime("emulated")
    try:
        f = Fixture(rt, other)
        before = [o.state for o in f.owned()]
        stats = rt.stats()
        with pytest.raises(error, match=fragment):
            call(f)
        assert [o.state for o in f.owned()] == before
        after = rt.stats()
        assert (after.submitted, after.in_flight, after.failed) == (stats.submitted, stats.in_flight, stats.failed)
        assert np.all(f.buf.as_array() == 3)  # bytes untouched
        f.rt.upload_pending(f.buf, f.dev).wait()  # and still usable
    finally:
        other.close()


@pytest.mark.slow
def test_a_hundred_thousand_dropped_handles_keep_memory_and_the_queue_bounded() -> None:
    capacity = 64
    rt = ferry.Runtime("emulated", retirement_capacity=capacity, emulated_bandwidth=1e12, emulated_latency=0.0)
    try:
        dev = rt.empty(64, np.uint8)
        high_queue = high_pool = 0
        for i in range(100_000):
            rt.download_pending(dev, rt.pinned(64))  # dropped at once
            if i % 1000 == 0:
                s = rt.stats()
                high_queue = max(high_queue, s.retiring)
                high_pool = max(high_pool, s.pinned_pool_bytes)
        s = rt.stats()
        assert max(high_queue, s.retiring) <= capacity
        assert high_pool <= (capacity + 2) * 4096  # blocks recycled: bounded by the queue, not the count
        assert s.submitted == 100_000
    finally:
        rt.close()
    s = rt.stats()
    assert s.completed == 100_000 and s.retiring == 0
    gc.collect()
    assert testing.violations(rt) == []


# -- the pure-Python staging lanes when the device refuses new slots midway -------------------------------


class _RefusingBackend:
    """The emulated backend, but ``event_create`` refuses once ``allowed`` more events were made."""

    def __init__(self, allowed: int) -> None:
        from ferry._backends._emulated import EmulatedBackend

        self.inner = EmulatedBackend()
        self.allowed = allowed
        self.live_events = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def event_create(self, blocking: bool = False) -> Any:
        from ferry._backends._base import DeviceError

        if self.allowed <= 0:
            raise DeviceError("refused for the test", code=2)
        self.allowed -= 1
        self.live_events += 1
        return self.inner.event_create(blocking=blocking)

    def event_destroy(self, event: Any) -> None:
        self.live_events -= 1
        self.inner.event_destroy(event)


@pytest.mark.parametrize("allowed", [0, 1, 2, 3, 4])  # from 3 on the first lane started: the second fails
def test_a_lane_refused_some_of_its_slots_gives_back_the_ones_it_took(allowed: int) -> None:
    from ferry._backends._base import DeviceError
    from ferry._memory._pinned import PinnedPool
    from ferry._routes._staged import StagingConfig, StagingEngine

    backend = _RefusingBackend(allowed)
    pool = PinnedPool(backend, cache_limit=1 << 30)  # type: ignore[arg-type]
    config = StagingConfig(lanes=2, slots_per_lane=3, slot_bytes=1 << 20, engine="python")
    engine = StagingEngine(backend, pool, config, "upload")
    with pytest.raises(DeviceError, match="refused for the test"):
        engine.streams()  # starts the lanes: the first cannot get its third slot
    # nothing is held: every block taken (one per slot made, and the one whose event was refused) is free
    # in the pool again, the slots' events are destroyed, no lane runs
    assert pool.free_bytes == pool.held_bytes == (allowed + 1) * (1 << 20)
    assert backend.live_events == 0 and engine.held_bytes == 0  # counted as taken, uncounted as given back


def test_a_lane_that_cannot_replace_abandoned_slots_keeps_none_of_the_new_ones() -> None:
    from ferry._memory._pinned import PinnedPool
    from ferry._routes._staged import StagingConfig, StagingEngine

    backend = _RefusingBackend(3)  # the lane's three slots, then one replacement
    pool = PinnedPool(backend, cache_limit=1 << 30)  # type: ignore[arg-type]
    config = StagingConfig(lanes=1, slots_per_lane=3, slot_bytes=1 << 20, engine="python")
    engine = StagingEngine(backend, pool, config, "upload")
    (lane,) = engine._ensure_lanes()
    backend.allowed = 1
    lane._abandon_slots()  # a DMA failed: the three slots are abandoned; one new slot, then a refusal
    assert lane.slots == [] and lane.gone is not None
    assert engine.abandoned_bytes == 3 << 20 and engine.held_bytes == 0
    # the replacement slot made, and the block whose event was refused, are free in the pool again
    assert pool.free_bytes == 2 << 20
    assert backend.live_events == 3  # the abandoned slots' events: never destroyed (the device may use them)
    engine.close()


def test_a_lane_whose_thread_cannot_start_gives_back_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ferry._memory._pinned import PinnedPool
    from ferry._routes._staged import StagingConfig, StagingEngine

    backend = _RefusingBackend(100)
    pool = PinnedPool(backend, cache_limit=1 << 30)  # type: ignore[arg-type]
    config = StagingConfig(lanes=2, slots_per_lane=3, slot_bytes=1 << 20, engine="python")
    engine = StagingEngine(backend, pool, config, "upload")

    start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:  # the lanes' threads only (the emulated streams start some)
        if self.name.startswith("ferry-upload-lane"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        engine.streams()
    monkeypatch.undo()
    assert pool.free_bytes == pool.held_bytes == 3 << 20  # the first lane's slots, free in the pool again
    assert backend.live_events == 0 and engine.held_bytes == 0
