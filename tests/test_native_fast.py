"""The compiled submit and wait (``_engine.Fast``) and handle base (``_engine.Handle``), on the emulated device.

The emulated backend's hot methods are Python callables, so ``Fast`` calls
them as such; the error paths are driven by replacing them with callables
that raise :class:`DeviceError` the way a failed driver call does (stage 0:
nothing enqueued; stage 1: the copy queued, its event record failed).
tests/test_native_calls.py covers the compiled driver calls themselves.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _native, testing
from ferry._backends._base import DeviceError
from ferry._runtime import parts_of

engine = _native.load()
pytestmark = pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")


@pytest.fixture
def rt(emu: ferry.Runtime) -> ferry.Runtime:
    """conftest's emulated runtime (closed after the test, and checked for stream-order violations)."""
    return emu


def test_the_pinned_paths_run_in_the_compiled_calls(rt: ferry.Runtime) -> None:
    completion = parts_of(rt).completion
    assert type(completion.counts).__name__ == "Fast"
    first = rt.upload_pending(rt.pinned(8), rt.empty(8, np.uint8))
    assert isinstance(first, engine.Handle)  # type: ignore[union-attr]
    first.wait()
    buf, dev = rt.pinned(8), rt.empty(8, np.uint8)
    buf.as_array()[:] = np.arange(8, dtype=np.uint8)
    before = rt.stats()
    buf, dev = rt.upload_pending(buf, dev).wait()
    dev, out = rt.download_pending(dev, rt.pinned(8)).wait()
    assert bytes(out.as_array()) == bytes(range(8))
    after = rt.stats()
    assert after.submitted - before.submitted == 2 and after.completed - before.completed == 2
    assert buf.state == dev.state == out.state == "owned" and after.in_flight == 0


def test_a_copy_refused_before_anything_is_enqueued_changes_nothing(
    rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    rt.upload_pending(buf, dev).wait()  # an event in the pool
    completion = parts_of(rt).completion
    events = len(completion.events)

    def refuse(*args: Any) -> None:
        raise DeviceError("refused", code=1, enqueued=False)

    monkeypatch.setattr(testing.backend_of(rt), "htod_record", refuse)
    with pytest.raises(ferry.TransferSubmitError, match="refused"):
        rt.upload_pending(buf, dev)
    assert buf.state == dev.state == "owned" and len(completion.events) == events
    assert rt.stats().in_flight == 0


def test_a_copy_queued_whose_record_failed_is_synchronized_then_refused(
    rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    backend = testing.backend_of(rt)
    real = backend.dtoh_record

    def record_fails(dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        real(dst, src, nbytes, stream, None)
        raise DeviceError("record failed", code=1, enqueued=True)

    monkeypatch.setattr(backend, "dtoh_record", record_fails)
    with pytest.raises(ferry.TransferSubmitError, match="could not record"):
        rt.download_pending(dev, buf)
    assert buf.state == dev.state == "owned" and dev._leases == 0


def test_a_failure_found_by_the_compiled_wait_abandons_and_raises(rt: ferry.Runtime) -> None:
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    testing.fail_next_copy(rt)
    handle = rt.upload_pending(buf, dev)
    with pytest.raises(ferry.TransferFailedError):
        handle.wait()
    assert buf.state == dev.state == "abandoned"
    with pytest.raises(ferry.TransferFailedError):
        handle.wait()  # a failed handle keeps raising the failure


def test_the_compiled_handle_waits_once_takes_a_timeout_and_retires_when_dropped(rt: ferry.Runtime) -> None:
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    handle = rt.upload_pending(buf, dev)
    assert handle.wait(timeout=5.0) == (buf, dev)
    with pytest.raises(ferry.FerryError, match="at most once"):
        handle.wait()
    with pytest.raises(TypeError):
        handle.wait(1.0, 2.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        handle.wait(deadline=1.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        engine.Handle(None, None)  # type: ignore[union-attr]  # only subclasses are made
    rt.upload_pending(buf, dev)  # dropped unwaited: its record retires, nothing blocks
    gc.collect()
    assert buf.state == "in flight" or rt.stats().retiring <= 1
    rt.poll()
    assert eventually_settled(rt)


def eventually_settled(rt: ferry.Runtime) -> bool:
    import time

    for _ in range(200):
        rt.poll()
        stats = rt.stats()
        if stats.retiring == 0 and stats.in_flight == 0:
            return True
        time.sleep(0.005)
    return False


def test_a_handle_whose_fields_were_deleted_raises_instead_of_crashing(rt: ferry.Runtime) -> None:
    handle = rt.upload_pending(rt.pinned(16), rt.empty(16, np.uint8))
    with pytest.raises(AttributeError):
        handle._record = None  # type: ignore[misc]  # never rebound: the wait holds it across GIL releases
    del handle._claimed
    with pytest.raises(AttributeError):
        handle._claimed  # deleted reads as a __slots__ field does
    with pytest.raises(AttributeError):
        handle.wait()  # the pure-Python handle raises the same
    handle._claimed = False
    buf, dev = handle.wait()
    assert buf.state == dev.state == "owned"


def test_handle_subclasses_may_chain_init_and_the_base_cannot_be_a_handle_type(rt: ferry.Runtime) -> None:
    class Mine(ferry.PendingUpload):  # type: ignore[type-arg]
        def __init__(self, port: Any, record: Any) -> None:
            super().__init__(port, record)
            self.extra = 1

    assert issubclass(Mine, engine.Handle)
    mine = Mine(parts_of(rt).completion, None)  # chaining __init__ works as with the pure-Python base
    assert mine.extra == 1 and mine._port is parts_of(rt).completion
    mine._waited = True  # nothing to detach when it is dropped
    del mine
    completion = parts_of(rt).completion
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    with pytest.raises(TypeError, match="subclass of Handle"):  # its dealloc would never detach the record
        completion.submit_pinned(engine.Handle, parts_of(rt).h2d, testing.backend_of(rt).htod_record,
                                 dev.ptr, buf.ptr, 16, buf, dev, True)
    assert buf.state == dev.state == "owned"  # refused: nothing moved
