"""The compiled fast path (``_engine.Calls`` and the small route's host copies), on any machine.

The driver entry points are stand-ins made with ctypes: C function pointers
that record their arguments and answer what the test says. So the C code that
CUDA runs (argument passing, the event record after a copy, the batch call of
either ABI, the loop without one, error stages, the interruptible wait) is
exercised without a GPU; tests/test_small.py runs it on one.
"""

from __future__ import annotations

import ctypes
import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from conftest import SignalInside, call_inside
from ferry import _native

engine = _native.load()
pytestmark = pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")

NOT_READY = 600
CU = ctypes.c_int
PTR = ctypes.c_void_p
U64 = ctypes.c_uint64
SIZE = ctypes.c_size_t

COPY = ctypes.CFUNCTYPE(CU, U64, U64, SIZE, PTR)  # both directions: (dst, src, n, stream) as integers
RECORD = ctypes.CFUNCTYPE(CU, PTR, PTR)
ONE = ctypes.CFUNCTYPE(CU, PTR)
WAIT_EVENT = ctypes.CFUNCTYPE(CU, PTR, PTR, ctypes.c_uint)
POOL_ALLOC = ctypes.CFUNCTYPE(CU, ctypes.POINTER(U64), SIZE, PTR, PTR)  # (&ptr, nbytes, pool, stream)
FREE_ASYNC = ctypes.CFUNCTYPE(CU, U64, PTR)
BATCH_13000 = ctypes.CFUNCTYPE(
    CU, ctypes.POINTER(U64), ctypes.POINTER(U64), ctypes.POINTER(SIZE), SIZE, PTR, ctypes.POINTER(SIZE), SIZE, PTR
)
BATCH_12080 = ctypes.CFUNCTYPE(
    CU, ctypes.POINTER(U64), ctypes.POINTER(U64), ctypes.POINTER(SIZE), SIZE, PTR, ctypes.POINTER(SIZE), SIZE,
    ctypes.POINTER(SIZE), PTR,
)


class Driver:
    """Stand-in entry points: every call is logged; ``answers[name]`` gives the codes to return
    (then ``otherwise[name]``, default 0)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.answers: dict[str, list[int]] = {}
        self.otherwise: dict[str, int] = {}
        self.batch_seen: list[dict[str, Any]] = []
        self.next_ptr = 0x7F0000000000

        def answer(name: str) -> int:
            queue = self.answers.get(name)
            return queue.pop(0) if queue else self.otherwise.get(name, 0)

        def copy(name: str) -> Any:
            def fn(dst: int, src: int, n: int, stream: int) -> int:
                self.log.append((name, dst, src, n, stream))
                return answer(name)

            return COPY(fn)

        def record(event: int, stream: int) -> int:
            self.log.append(("record", event, stream))
            return answer("record")

        def wait_event(stream: int, event: int, flags: int) -> int:
            self.log.append(("wait_event", stream, event, flags))
            return answer("wait_event")

        def one(name: str) -> Any:
            def fn(event: int) -> int:
                self.log.append((name, event))
                return answer(name)

            return ONE(fn)

        def batch_seen(dsts: Any, srcs: Any, sizes: Any, count: int, attrs: int, idxs: Any, nattrs: int,
                       stream: int, fail: Any = None) -> int:
            first = ctypes.c_int.from_address(attrs).value
            tail = bytes((ctypes.c_ubyte * 24).from_address(attrs + 4))
            self.batch_seen.append({
                "dsts": [dsts[i] for i in range(count)], "srcs": [srcs[i] for i in range(count)],
                "sizes": [sizes[i] for i in range(count)], "order": first, "rest_zero": not any(tail),
                "idxs": [idxs[i] for i in range(nattrs)], "stream": stream, "fail_ptr": fail is not None,
            })
            self.log.append(("batch", count, stream))
            return answer("batch")

        def pool_alloc(out: Any, nbytes: int, pool: int, stream: int) -> int:
            self.log.append(("pool_alloc", nbytes, pool, stream))
            code = answer("pool_alloc")
            if not code:
                out[0] = self.next_ptr
                self.next_ptr += max(nbytes, 1 << 20)
            return code

        def free_async(ptr: int, stream: int) -> int:
            self.log.append(("free_async", ptr, stream))
            return answer("free_async")

        self.keep = {
            "cuMemAllocFromPoolAsync": POOL_ALLOC(pool_alloc),
            "cuMemFreeAsync": FREE_ASYNC(free_async),
            "cuStreamSynchronize": one("stream_sync"),
            "cuMemcpyHtoDAsync": copy("htod"),
            "cuMemcpyDtoHAsync": copy("dtoh"),
            "cuEventRecord": RECORD(record),
            "cuEventQuery": one("query"),
            "cuEventSynchronize": one("sync"),
            "cuStreamWaitEvent": WAIT_EVENT(wait_event),
            "b13000": BATCH_13000(batch_seen),
            "b12080": BATCH_12080(lambda d, s, z, c, a, i, n, f, st: batch_seen(d, s, z, c, a, i, n, st, f)),
        }

    def points(self, abi: int = 0) -> dict[str, int]:
        points = {name: ctypes.cast(fn, PTR).value or 0 for name, fn in self.keep.items() if name.startswith("cu")}
        if abi:
            points["cuMemcpyBatchAsync"] = ctypes.cast(self.keep[f"b{abi}"], PTR).value or 0
        return points


class Failures:
    """``on_error``: logs each call and answers with ``result`` (or raises ``error``)."""

    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self.calls: list[tuple[str, int, int, tuple[Any, ...]]] = []
        self.result = result
        self.error = error

    def __call__(self, op: str, code: int, stage: int, args: tuple[Any, ...]) -> Any:
        self.calls.append((op, code, stage, args))
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def driver() -> Iterator[Driver]:
    yield Driver()


def make(driver: Driver, on_error: Callable[..., Any] | None = None, abi: int = 0) -> Any:
    assert engine is not None
    return engine.Calls(driver.points(abi), on_error or Failures(), batch_abi=abi)


def test_a_copy_and_its_event_record_are_onecall_inside(driver: Driver) -> None:
    calls = make(driver)
    calls.htod_record(0x1000, 0x2000, 16, 0x30, 0x40)
    calls.dtoh_record(0x2000, 0x1000, 8, 0x31, None)  # no event: a batch records one later
    calls.htod_record(0x1000, 0x2000, 0, 0x30, 0x41)  # nothing to copy: the record only
    assert driver.log == [
        ("htod", 0x1000, 0x2000, 16, 0x30), ("record", 0x40, 0x30),
        ("dtoh", 0x2000, 0x1000, 8, 0x31),
        ("record", 0x41, 0x30),
    ]
    assert calls.counts()["copies"] == 2


def test_a_failure_goes_to_on_error_with_its_stage(driver: Driver) -> None:
    failures = Failures(result="answered")
    calls = make(driver, failures)
    driver.answers["htod"] = [201]
    assert calls.htod_record(1, 2, 3, 4, 5) == "answered"  # on_error's result is the call's
    assert failures.calls[-1] == ("htod_record", 201, 0, (1, 2, 3, 4, 5))
    assert driver.log[-1][0] == "htod"  # nothing recorded after a refused copy
    driver.answers["record"] = [700]
    calls.dtoh_record(1, 2, 3, 4, 5)
    assert failures.calls[-1] == ("dtoh_record", 700, 1, (1, 2, 3, 4, 5))  # the copy is queued
    driver.answers["query"] = [999]
    calls.event_query(9)
    assert failures.calls[-1][:3] == ("event_query", 999, 0)
    boom = make(driver, Failures(error=ValueError("raised by on_error")))
    driver.answers["record"] = [1]
    with pytest.raises(ValueError, match="raised by on_error"):
        boom.event_record(1, 2)


class PoolHandle:
    """A pool handle as cuda.bindings gives it: an object ``int()`` takes."""

    def __int__(self) -> int:
        return 0x70


def test_a_pool_allocation_is_synchronized_once_and_a_free_is_one_call(driver: Driver) -> None:
    calls = make(driver)
    assert calls.pool_calls is True
    first = calls.mem_pool_alloc(0x70, 1 << 20, 0x30)
    second = calls.mem_pool_alloc(PoolHandle(), 8 << 20, 0x30)
    assert isinstance(first, int) and first == 0x7F0000000000 and second == first + (1 << 20)
    assert calls.mem_free_async(first, 0x30) is None
    assert driver.log == [
        ("pool_alloc", 1 << 20, 0x70, 0x30), ("stream_sync", 0x30),  # usable on every stream from here
        ("pool_alloc", 8 << 20, 0x70, 0x30), ("stream_sync", 0x30),
        ("free_async", first, 0x30),
    ]
    with pytest.raises(TypeError):
        calls.mem_pool_alloc(0x70, 16)
    with pytest.raises(TypeError):
        calls.mem_pool_alloc(object(), 16, 0x30)
    for not_a_handle in ("112", 112.0, b"p", np.float32(112.0), Fraction(112)):  # int() takes most: not a handle
        with pytest.raises(TypeError, match="handle"):
            calls.mem_pool_alloc(not_a_handle, 16, 0x30)
    assert calls.mem_pool_alloc(np.uint64(0x70), 16, 0x30) == second + (8 << 20)  # an index is an int
    assert len(driver.log) == 7  # the refused calls reached no driver entry point


def test_a_failed_pool_call_leaves_nothing_allocated_and_goes_to_on_error(driver: Driver) -> None:
    failures = Failures(result="answered")
    calls = make(driver, failures)
    driver.answers["pool_alloc"] = [2]  # out of memory: nothing allocated, no synchronization
    assert calls.mem_pool_alloc(0x70, 1 << 30, 0x30) == "answered"
    assert failures.calls[-1] == ("mem_pool_alloc", 2, 0, (0x70, 1 << 30, 0x30))
    assert driver.log == [("pool_alloc", 1 << 30, 0x70, 0x30)]
    driver.log.clear()
    driver.answers["stream_sync"] = [700]  # allocated, then the synchronization failed: freed again
    assert calls.mem_pool_alloc(0x70, 16, 0x31) == "answered"
    (_, _, _, _), (_, _), (free, ptr, stream) = driver.log
    assert (free, stream) == ("free_async", 0x31) and ptr == driver.next_ptr - (1 << 20)
    assert failures.calls[-1] == ("mem_pool_alloc", 700, 0, (0x70, 16, 0x31))
    driver.answers["free_async"] = [201]
    assert calls.mem_free_async(ptr, 0x31) == "answered"
    assert failures.calls[-1] == ("mem_free_async", 201, 0, (ptr, 0x31))
    driver.answers["stream_sync"] = [700]  # the synchronization and the free again both fail
    driver.answers["free_async"] = [700]
    assert calls.mem_pool_alloc(0x70, 16, 0x31) == "answered"
    assert failures.calls[-1] == ("mem_pool_alloc", 700, 2, (0x70, 16, 0x31))  # stage 2: no retry allocates again


@pytest.mark.parametrize("missing", ["cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuStreamSynchronize"])
def test_the_pool_calls_need_all_three_entry_points(driver: Driver, missing: str) -> None:
    assert engine is not None
    points = driver.points()
    del points[missing]
    calls = engine.Calls(points, Failures())
    assert calls.pool_calls is False
    with pytest.raises(RuntimeError, match="stream-ordered allocator"):
        calls.mem_pool_alloc(0x70, 16, 0x30)
    with pytest.raises(RuntimeError, match="stream-ordered allocator"):
        calls.mem_free_async(0x7F0000000000, 0x30)
    assert driver.log == []


def test_a_stream_waits_for_a_list_of_events_in_onecall_inside(driver: Driver) -> None:
    failures = Failures(result="retried")
    calls = make(driver, failures)
    assert calls.stream_wait_events(5, [11, 12, 13]) is None
    assert driver.log == [("wait_event", 5, e, 0) for e in (11, 12, 13)]
    assert calls.stream_wait_events(5, []) is None and len(driver.log) == 3
    driver.answers["wait_event"] = [0, 400]  # the second wait fails: on_error decides, stage 0 (a retry is harmless)
    assert calls.stream_wait_events(6, [21, 22, 23]) == "retried"
    assert failures.calls == [("stream_wait_events", 400, 0, (6, [21, 22, 23]))]
    assert driver.log[-1] == ("wait_event", 6, 22, 0)  # the third was not attempted
    with pytest.raises(TypeError):
        calls.stream_wait_events(5, (1, 2))


def test_event_query_and_a_bounded_wait(driver: Driver) -> None:
    calls = make(driver)
    driver.answers["query"] = [NOT_READY]
    assert calls.event_query(7) is False
    assert calls.event_query(7) is True
    driver.answers["query"] = [NOT_READY] * 5
    assert calls.event_wait(7, 1.0) is True  # polled until complete
    assert sum(1 for entry in driver.log if entry[0] == "query") == 2 + 6
    driver.otherwise["query"] = NOT_READY
    start = time.perf_counter()
    assert calls.event_wait(7, 0.02) is False
    # about its timeout at least, and bounded: the query answers NOT_READY forever, so a wait that ignored
    # its timeout would never return, and one that scaled it by a thousand would take 20 s
    assert 0.015 < time.perf_counter() - start < 10
    assert calls.event_wait(7, 0) is False  # timeout 0: one query
    assert calls.waits == 3
    calls.event_synchronize(7)
    assert driver.log[-1] == ("sync", 7) and calls.waits == 4


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_wait_is_interrupted_by_ctrl_c_within_milliseconds(driver: Driver) -> None:
    # cuEventQuery is libc's abs() here: no Python runs inside the poll, as with the driver; the
    # "event" 600 answers 600 (CUDA_ERROR_NOT_READY) forever, the "event" 0 is complete
    points = driver.points()
    points["cuEventQuery"] = ctypes.cast(ctypes.CDLL(None).abs, PTR).value or 0
    assert engine is not None
    calls = engine.Calls(points, Failures())
    assert calls.event_wait(0, 1.0) is True and calls.event_query(600) is False

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        sender = SignalInside(signal.SIGALRM)
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            call_inside(functools.partial(calls.event_wait, 600, 30.0))
        elapsed = time.perf_counter() - start
        sender.join()
        print(f"interrupted after {elapsed * 1e3:.2f} ms")
        assert elapsed < 10, f"interrupted after {elapsed:.1f} s"  # within a slice (2 ms), not after its 30 s
    finally:
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("abi", [13000, 12080])
def test_a_batch_is_one_driver_call_of_either_abi(driver: Driver, abi: int) -> None:
    calls = make(driver, abi=abi)
    assert calls.batch_abi == abi
    dsts, srcs, sizes = [0x100, 0x300, 0x200], [0x10, 0x20, 0x30], [16, 4096, 1]
    calls.copy_batch(True, dsts, srcs, sizes, 0x77, 0x88)
    (seen,) = driver.batch_seen
    assert (seen["dsts"], seen["srcs"], seen["sizes"]) == (dsts, srcs, sizes)  # in submission order
    assert seen["order"] == 1 and seen["rest_zero"]  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no hints, no flags
    assert seen["idxs"] == [0] and seen["stream"] == 0x77 and seen["fail_ptr"] == (abi == 12080)
    assert driver.log == [("batch", 3, 0x77), ("record", 0x88, 0x77)]
    assert calls.counts()["batches"] == 1 and calls.counts()["batched_copies"] == 3
    calls.copy_batch(True, [5], [6], [7], 0x77, None)  # one copy: a plain copy call
    assert driver.log[-1] == ("htod", 5, 6, 7, 0x77)


def test_a_batch_the_driver_refuses_to_parse_becomes_a_loop_for_good(driver: Driver) -> None:
    calls = make(driver, abi=13000)
    driver.answers["batch"] = [1]  # CUDA_ERROR_INVALID_VALUE: checked before anything is queued
    calls.copy_batch(True, [1, 2], [3, 4], [5, 6], 0x9, 0xA)
    assert calls.batch_refused == 1 and calls.batch_abi == 0
    assert driver.log == [("batch", 2, 0x9), ("htod", 1, 3, 5, 0x9), ("htod", 2, 4, 6, 0x9), ("record", 0xA, 0x9)]
    calls.copy_batch(True, [7, 8], [9, 10], [11, 12], 0x9, None)
    assert len(driver.batch_seen) == 1  # not asked again
    failures = Failures()
    other = make(driver, failures, abi=13000)
    driver.answers["batch"] = [700]  # any other failure is the batch's own: reported, not retried as a loop
    other.copy_batch(True, [1, 2], [3, 4], [5, 6], 0x9, 0xA)
    assert failures.calls[-1][:3] == ("copy_batch", 700, 0) and other.batch_abi == 13000


def test_without_a_batch_entry_point_a_batch_is_a_loop(driver: Driver) -> None:
    failures = Failures()
    calls = make(driver, failures)
    assert calls.batch_abi == 0
    calls.copy_batch(False, [1, 2, 3], [10, 20, 30], [4, 0, 6], 0x5, 0x6)
    assert driver.log == [("dtoh", 1, 10, 4, 0x5), ("dtoh", 3, 30, 6, 0x5), ("record", 0x6, 0x5)]
    driver.answers["dtoh"] = [0, 2]  # the second copy fails: the first is queued
    calls.copy_batch(False, [1, 2, 3], [10, 20, 30], [4, 5, 6], 0x5, 0x6)
    assert failures.calls[-1][:3] == ("copy_batch", 2, 2)
    driver.answers["dtoh"] = [2]
    calls.copy_batch(False, [1], [10], [4], 0x5, 0x6)
    assert failures.calls[-1][:3] == ("copy_batch", 2, 0)
    with pytest.raises(TypeError):
        calls.copy_batch(True, [1, 2], [3], [4, 5], 0x5, None)


def test_host_copies_take_only_small_contiguous_arrays() -> None:
    assert engine is not None
    copy_in, address_of, memcopy = _native.host_copies()
    slot = np.zeros(64, np.uint8)
    ptr = int(slot.ctypes.data)
    data = np.arange(16, dtype=np.float32)
    assert copy_in(ptr, 64, data) == 64 and np.array_equal(slot.view(np.float32), data)
    assert copy_in(ptr, 63, data) == -1  # larger than the slot
    assert copy_in(ptr, 64, data[::2]) == -1  # strided
    out = np.zeros(16, np.float32)
    assert address_of(out, 64) == int(out.ctypes.data)
    out.flags.writeable = False
    assert address_of(out, 64) == 0  # read-only (or the output of a pending download)
    assert address_of(np.zeros((4, 4), np.float32).T, 64) == 0
    target = np.zeros(16, np.float32)
    memcopy(int(target.ctypes.data), ptr, 64)
    assert np.array_equal(target, data)


def test_the_python_fallbacks_behave_like_the_compiled_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.ENV_VAR, "0")
    copy_in, address_of, memcopy = _native.host_copies()
    assert copy_in is not getattr(engine, "copy_in", None)
    slot = np.zeros(64, np.uint8)
    data = np.arange(16, dtype=np.float32)
    assert copy_in(int(slot.ctypes.data), 64, data) == 64 and np.array_equal(slot.view(np.float32), data)
    assert copy_in(int(slot.ctypes.data), 64, data[::2]) == -1
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    assert address_of(ro, 64) == 0 and address_of(np.zeros(32, np.float32), 64) == 0
    out = np.zeros(16, np.float32)
    memcopy(int(out.ctypes.data), int(slot.ctypes.data), 64)
    assert np.array_equal(out, data)


def test_the_compiled_record_is_the_python_records_twin() -> None:
    from ferry._completion import Record

    assert engine is not None
    args = (3, "event", "stream", ("moved",), ("leased",), ("result",), 16)
    python, compiled = Record(*args), engine.new_record(*args)
    names = set(Record.__slots__)
    assert names == {n for n in dir(compiled) if not n.startswith("_")}
    assert all(getattr(python, n) == getattr(compiled, n) for n in names)
    assert type(engine.Record(*args)) is type(compiled)
    for record in (python, compiled):
        record.waiters += 1
        record.done = True
        with pytest.raises(AttributeError):
            record.other = 1  # type: ignore[union-attr]
    assert repr(python) == repr(compiled) == "<transfer record #3 16 bytes done>"
    with pytest.raises(TypeError):
        engine.new_record(1, 2)


def test_a_compiled_record_in_a_cycle_is_collected() -> None:
    import gc
    import weakref

    assert engine is not None

    class Holder:  # stands for a handle or a future that refers back to its record
        record: Any = None

    holder = Holder()
    record = engine.new_record(1, None, None, (holder,), (), (holder,), 8)
    holder.record = record
    record.signal = holder
    gone = weakref.ref(holder)
    del holder, record
    gc.collect()
    assert gone() is None
