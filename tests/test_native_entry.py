"""The compiled entries: ``rt.upload_pending`` / ``rt.download_pending`` checked and submitted in one C call.

Where the extension runs, a runtime binds the two methods to ``_engine.Fast``'s
entries, which read the arguments' fields (their classes derive from the compiled
field types of ``ferry._native.objects``) and hand whatever is not the common case
to the Python methods. These tests check that the common case never enters
Python, and that every other case behaves exactly as the Python method does.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _native, testing
from ferry._runtime import Runtime, parts_of

engine = _native.load()
pytestmark = pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")


@pytest.fixture
def rt(emu: ferry.Runtime) -> ferry.Runtime:
    return emu


# the modules of the submission and completion paths (the emulated backend's own Python is not counted)
PATHS = ("_runtime.py", "_completion.py", "_small.py", "_pinned.py", "_pending.py", "_base.py")


def python_calls(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """fn()'s result (or exception) and the names of the Python functions of ferry's submission and
    completion paths it entered."""
    names: list[str] = []

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith(PATHS) and "_backends" not in frame.f_code.co_filename:
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result: Any = fn()
    except Exception as exc:
        result = exc
    finally:
        sys.setprofile(None)
    return result, names


def test_the_hot_classes_are_registered_and_the_entries_are_bound(rt: ferry.Runtime) -> None:
    assert _native.hot_types()
    assert type(rt.upload_pending).__name__ == "builtin_function_or_method"
    assert type(rt.download_pending).__name__ == "builtin_function_or_method"
    engine = _native.load()
    assert engine is not None

    class Plain:  # its fields live in a __dict__: not a class whose fields the entries may read
        pass

    classes = [ferry.PinnedHostBuffer, ferry.DeviceArray, Plain, Plain, Plain]
    with pytest.raises(TypeError):
        engine.set_hot_types(*classes)


@pytest.mark.parametrize("field", ["_state", "_base", "_block", "_nbytes", "_runtime",
                                   "dev._ptr", "dev._nbytes", "dev._state", "dev._leases", "block.ptr"])
def test_a_deleted_field_of_a_hot_object_goes_to_the_python_method(rt: ferry.Runtime, field: str) -> None:
    """The entries read the fields of the arguments' compiled base types; a deleted field (as a
    __slots__ field can be) is never the common case: the Python method runs, and raises as it does."""
    buf, dev = rt.pinned(64), rt.empty(64, np.uint8)
    owner, _, name = field.rpartition(".")
    target = {"": buf, "dev": dev, "block": buf._block}[owner]
    kept = getattr(target, name)
    delattr(target, name)
    with pytest.raises((AttributeError, ferry.TransferSubmitError)):
        rt.upload_pending(buf, dev)
    setattr(target, name, kept)  # whole again: the runtime closes it


def test_a_small_slot_with_a_deleted_field_goes_to_the_python_route(rt: ferry.Runtime) -> None:
    data = np.arange(16, dtype=np.uint8)
    dev = rt.empty(16, np.uint8)
    _, dev = rt.upload(data, dev).wait()  # the ring's first slot
    (slot,) = parts_of(rt).host.small.up.free
    kept = slot.capacity
    del slot.capacity
    with pytest.raises(AttributeError):
        rt.upload(data, dev)
    slot.capacity = kept


def test_the_common_case_never_enters_python(rt: ferry.Runtime) -> None:
    buf, dev = rt.pinned(64), rt.empty(64, np.uint8)
    buf.as_array()[:] = 5
    pending, names = python_calls(lambda: rt.upload_pending(buf, dev))
    assert "upload_pending" not in names and "submit_pinned" not in names
    buf, dev = pending.wait()
    assert (rt.to_host(dev) == 5).all()
    pending, names = python_calls(lambda: rt.download_pending(dev, buf))
    assert "download_pending" not in names
    dev, buf = pending.wait()
    assert (buf.as_array() == 5).all()
    buf.close()


def test_keywords_and_wrong_arity_go_through_the_python_method(rt: ferry.Runtime) -> None:
    buf, dev = rt.pinned(16), rt.empty(16, np.uint8)
    buf, dev = rt.upload_pending(buffer=buf, destination=dev).wait()
    dev, buf = rt.download_pending(dev, buffer=buf).wait()
    with pytest.raises(TypeError):
        rt.upload_pending(buf)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        rt.upload_pending(buf, dev, dev)  # type: ignore[call-arg]
    buf.close()


@pytest.fixture
def cases(rt: ferry.Runtime) -> Iterator[Callable[[str], tuple[Any, Any]]]:
    """Each refused submission, built fresh: (buffer, device array) in that state."""
    other = ferry.Runtime("emulated")
    keep: list[Any] = []

    def make(kind: str) -> tuple[Any, Any]:
        buf, dev = rt.pinned(64), rt.empty(64, np.uint8)
        if kind == "small buffer":
            buf = rt.pinned(8)
        elif kind == "numpy buffer":
            buf = np.zeros(64, np.uint8)
        elif kind == "other runtime's buffer":
            buf = other.pinned(64)
        elif kind == "other runtime's array":
            dev = other.empty(64, np.uint8)
        elif kind == "live view":
            keep.append(buf.as_array())
        elif kind == "buffer in flight":
            keep.append(rt.upload_pending(buf, rt.empty(64, np.uint8)))
        elif kind == "closed buffer":
            buf.close()
        elif kind == "read-leased array":
            keep.append(rt.download_pending(dev, rt.pinned(64)))
        return buf, dev

    yield make
    for item in keep:
        if isinstance(item, ferry.Pending):
            item.wait()
    keep.clear()
    other.close()


KINDS = ["small buffer", "numpy buffer", "other runtime's buffer", "other runtime's array", "live view",
         "buffer in flight", "closed buffer", "read-leased array"]


# a read-leased source may be downloaded again: not a refusal there
REFUSALS = [("upload", k) for k in KINDS] + [("download", k) for k in KINDS if k != "read-leased array"]


@pytest.mark.parametrize(("direction", "kind"), REFUSALS)
def test_every_refusal_is_the_python_methods(
    rt: ferry.Runtime, cases: Callable[[str], tuple[Any, Any]], kind: str, direction: str
) -> None:
    compiled = rt.upload_pending if direction == "upload" else rt.download_pending
    python = getattr(Runtime, f"{direction}_pending")
    outcomes = []
    for call in (compiled, lambda a, b: python(rt, a, b)):
        buf, dev = cases(kind)
        args = (buf, dev) if direction == "upload" else (dev, buf)
        states = [getattr(o, "_state", None) for o in args]
        with pytest.raises(ferry.TransferSubmitError) as info:
            call(*args)
        assert [getattr(o, "_state", None) for o in args] == states  # nothing changed
        outcomes.append((type(info.value), str(info.value)))
    assert outcomes[0] == outcomes[1]


def test_a_closed_runtimes_entry_refuses_as_the_python_method_does(rt: ferry.Runtime) -> None:
    other = ferry.Runtime("emulated")
    up = other.upload_pending
    buf, dev = other.pinned(8), other.empty(8, np.uint8)
    other.close()
    with pytest.raises(ferry.FerryError) as closed:
        up(buf, dev)
    with pytest.raises(ferry.FerryError) as python:
        Runtime.upload_pending(other, buf, dev)
    assert type(closed.value) is type(python.value)
    assert str(closed.value) == str(python.value)


def test_an_entry_keeps_its_runtime_alive_as_a_bound_method_does() -> None:
    upload = ferry.Runtime("emulated").upload  # the runtime itself is dropped at once
    gc.collect()
    data = np.arange(32, dtype=np.uint8)
    _, dev = upload(data).wait()  # still open: the entry holds it
    assert (dev._runtime.to_host(dev) == data).all()
    dev._runtime.close()


def test_a_dropped_runtime_with_its_entries_is_collected_and_closed() -> None:
    rt = ferry.Runtime("emulated")
    parts = parts_of(rt)
    up = rt.upload_pending
    del rt, up
    with pytest.warns(ResourceWarning, match="never closed"):
        gc.collect()
    assert parts.health.closed


def test_a_subclass_that_overrides_a_method_keeps_the_python_methods() -> None:
    seen: list[str] = []

    class Logged(ferry.Runtime):
        def upload_pending(self, buffer: Any, destination: Any) -> Any:
            seen.append("upload")
            return super().upload_pending(buffer, destination)

    with Logged("emulated") as rt:
        buf, dev = rt.pinned(8), rt.empty(8, np.uint8)
        buf, dev = rt.upload_pending(buf, dev).wait()
        assert seen == ["upload"]
        assert not isinstance(rt.download_pending, type(len))  # both stay methods
        buf.close()


def test_a_held_runtime_lock_is_reentered_by_the_entry(rt: ferry.Runtime) -> None:
    buf, dev = rt.pinned(8), rt.empty(8, np.uint8)
    with parts_of(rt).lock:
        pending = rt.upload_pending(buf, dev)
    pending.wait()


def test_a_small_pageable_wait_settles_its_slot_in_c(rt: ferry.Runtime) -> None:
    # wait() settles in C when the copy completes within its poll; past that poll it sleeps in
    # Completion.wait, which settles in Python (the next test). The device is drained first, through
    # the backend (which settles nothing), so that a loaded machine cannot push the copy past the poll:
    # this test failed once in a whole-suite run on the H200 for that reason (2026-11-30).
    backend = parts_of(rt).backend
    data = np.arange(256, dtype=np.uint8)
    dev = rt.empty(256, np.uint8)
    pending = rt.upload(data, dev)
    assert not data.flags.writeable
    backend.device_synchronize()
    result, names = python_calls(pending.wait)
    assert not {"settle", "release", "copy_out"} & set(names)
    source, dev = result
    assert source is data and data.flags.writeable
    out = np.zeros(256, np.uint8)
    pending = rt.download(dev, out)
    backend.device_synchronize()
    result, names = python_calls(pending.wait)
    assert not {"settle", "release", "copy_out"} & set(names)
    assert result[1] is out and (out == data).all() and out.flags.writeable
    counts = parts_of(rt).host.small.counts()
    assert counts["small_uploads"] == counts["small_downloads"] == 1
    assert parts_of(rt).host.small.host_copied == 512  # both directions' host copies counted
    # the slots are back in their rings: the next transfers reuse them
    assert (rt.to_host(rt.upload(data, rt.empty(256, np.uint8)).wait()[1]) == data).all()
    assert parts_of(rt).host.small.counts()["small_upload_slots"] == 1


def test_a_small_pageable_wait_past_its_poll_sleeps_and_settles_the_same(rt: ferry.Runtime) -> None:
    backend = parts_of(rt).backend
    backend.latency = 0.05  # the copy outlasts wait()'s poll: wait() sleeps in Completion.wait
    data = np.arange(256, dtype=np.uint8)
    dev = rt.empty(256, np.uint8)
    pending = rt.upload(data, dev)
    result, _ = python_calls(pending.wait)  # almost always the Python sleep path; either path must behave so
    source, dev = result
    assert source is data and data.flags.writeable
    out = np.zeros(256, np.uint8)
    result, _ = python_calls(rt.download(dev, out).wait)
    assert result[1] is out and (out == data).all() and out.flags.writeable
    counts = parts_of(rt).host.small.counts()
    assert counts["small_uploads"] == counts["small_downloads"] == 1
    assert parts_of(rt).host.small.host_copied == 512
    # the slot went back to its ring on that path too: the next upload reuses it
    assert (rt.to_host(rt.upload(data, rt.empty(256, np.uint8)).wait()[1]) == data).all()
    assert parts_of(rt).host.small.counts()["small_upload_slots"] == 1


def test_a_small_pageable_upload_is_submitted_in_c(rt: ferry.Runtime) -> None:
    assert _native.array_layout()
    assert type(rt.upload).__name__ == "builtin_function_or_method"
    data = np.arange(64, dtype=np.float32).reshape(4, 16)
    dev = rt.empty((4, 16), np.float32)
    _, dev = rt.upload(data, dev).wait()  # the ring's first slot is made by the Python route
    before = parts_of(rt).host.small.counts()["small_uploads"]
    pending, names = python_calls(lambda: rt.upload(data, dev))
    assert not {"upload", "take", "submit", "enqueue"} & set(names)
    assert not data.flags.writeable  # leased while in flight
    source, dev = pending.wait()
    assert source is data and data.flags.writeable
    assert (rt.to_host(dev) == data).all()
    assert parts_of(rt).host.small.counts()["small_uploads"] == before + 1


def test_every_other_upload_takes_the_python_route_and_behaves_the_same(rt: ferry.Runtime) -> None:
    base = np.arange(4096, dtype=np.uint8)
    dev = rt.empty(4096, np.uint8)
    rt.upload(base, dev).wait()
    strided = np.arange(8192, dtype=np.uint8)[::2]
    other_dtype = np.arange(1024, dtype=np.float32)  # same bytes, another dtype: refused
    big = np.arange(1 << 17, dtype=np.uint8)  # beyond a slot: the staged or direct route
    pair = np.zeros(512, dtype=[("a", "u1"), ("b", "u1")])  # equal dtypes that are two objects
    pair["a"] = 3
    cases = [(strided, rt.empty(4096, np.uint8)), (big, rt.empty(1 << 17, np.uint8)),
             (pair, rt.empty(512, np.dtype([("a", "u1"), ("b", "u1")])))]
    for source, destination in cases:
        pending, names = python_calls(lambda s=source, d=destination: rt.upload(s, d))
        assert "upload" in names  # Runtime.upload ran
        _, out = pending.wait()
        assert (rt.to_host(out) == source).all()
    for call in (rt.upload, lambda s, d: Runtime.upload(rt, s, d)):
        with pytest.raises(ferry.TransferSubmitError) as info:
            call(other_dtype, rt.empty(4096, np.uint8))
        assert "dtype" in str(info.value) or "shape" in str(info.value)
    leased = rt.empty(4096, np.uint8)
    down = rt.download(leased)
    with pytest.raises(ferry.TransferSubmitError):
        rt.upload(base, leased)  # a read-leased destination: refused by the Python route, nothing changed
    assert base.flags.writeable
    down.wait()
    with rt.batch():
        pending = rt.upload(base, rt.empty(4096, np.uint8))  # a batch is open: the Python route batches it
    assert (rt.to_host(pending.wait()[1]) == base).all()


def test_a_fresh_small_upload_is_one_compiled_call_and_behaves_the_same(rt: ferry.Runtime) -> None:
    base = np.arange(4096, dtype=np.uint8)
    rt.upload(base).wait()  # warm
    for call in (lambda: rt.upload(base), lambda: rt.upload(base, None)):
        before = rt.stats().submitted
        pending, names = python_calls(call)
        assert "upload" not in names and "_upload_new" not in names  # only the destination is made in Python
        assert "new_destination" in names
        assert not base.flags.writeable  # leased while pending
        source, device = pending.wait()
        assert rt.stats().submitted == before + 1
        assert source is base and base.flags.writeable
        assert device.state == "owned" and device.shape == base.shape and device.dtype == base.dtype
        assert (rt.to_host(device) == base).all()
    big = np.arange(1 << 17, dtype=np.uint8)  # beyond a slot: no destination made here, the full path's
    pending, names = python_calls(lambda: rt.upload(big))
    assert "upload" in names
    assert (rt.to_host(pending.wait()[1]) == big).all()
    strided = np.arange(8192, dtype=np.uint8)[::2]  # not C-contiguous: the full path's
    pending, names = python_calls(lambda: rt.upload(strided))
    assert "upload" in names
    assert (rt.to_host(pending.wait()[1]) == strided).all()


def test_a_fresh_small_upload_refused_frees_its_destination(rt: ferry.Runtime) -> None:
    from ferry._backends._base import DeviceError

    base = np.arange(4096, dtype=np.uint8)
    kept = rt.upload(base).wait()  # held: the device bytes counted before stay counted
    backend = testing.backend_of(rt)
    before = rt.stats().device_bytes

    def refusing(*args: Any) -> None:
        raise DeviceError("refused for the test", enqueued=False)

    backend.htod_record = refusing
    try:
        with pytest.raises(ferry.TransferSubmitError, match="refused"):
            rt.upload(base)
    finally:
        del backend.htod_record
    assert base.flags.writeable
    assert rt.stats().device_bytes == before  # the destination made for it was freed at once
    assert rt.stats().in_flight == 0
    assert (rt.to_host(rt.upload(base).wait()[1]) == base).all()
    del kept


def test_an_upload_while_a_registration_is_active_takes_the_registered_route(rt: ferry.Runtime) -> None:
    host = np.arange(1024, dtype=np.uint8)
    dev = rt.empty(1024, np.uint8)
    rt.upload(host, dev).wait()  # a slot in the ring
    registration = rt.register(host)
    small_before = parts_of(rt).host.small.counts()["small_uploads"]
    _, dev = rt.upload(host, dev).wait()
    assert parts_of(rt).host.small.counts()["small_uploads"] == small_before  # not the small route
    assert (rt.to_host(dev) == host).all()
    registration.release()
