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
