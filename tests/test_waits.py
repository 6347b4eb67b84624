"""Waits a user can bound and interrupt (issue 15), on every backend.

``wait(timeout=)``, Ctrl-C in ``wait()``/``to_host()``/``wait_all()``/``close()``,
``close(timeout=)``, the bounded wait at interpreter exit, waiters that give up
(cancelled futures, ``asyncio.wait_for``) without stranding the others, and a
``wait()`` racing ``close()``. A held copy stream (:func:`ferry.testing.hold`)
makes "not complete yet" deterministic; it is released from a timer thread
where the main thread must be blocked meanwhile. Ctrl-C is sent once the main
thread is seen asleep inside the wait, never on a timer that could fire first.
No upper bound on a wall-clock time is tight: a call that must not wait for a held copy
runs under :class:`conftest.HeldAtMost`, whose gate opens only after 30 s, so such a
call that did wait returns only then, and the test fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import HeldAtMost
from ferry import _completion, testing
from ferry._routes._native import NativeJob

SRC = str(Path(__file__).resolve().parents[1] / "src")
# s: the latency is printed (docs/waiting.md: milliseconds); the bound only tells an interrupted wait from one
# that returned at its 30 s timeout or once its held copy was let go (HeldAtMost, after 30 s): a scheduler's
# delay is never that long, where a bound under a second could flip on a loaded machine
INTERRUPT_BOUND = 10.0


def _held(rt: ferry.Runtime, direction: str = "both") -> Callable[[], None]:
    """Hold the runtime's copy streams until the returned function is called (from any thread)."""
    stack = contextlib.ExitStack()
    stack.enter_context(testing.hold(rt, direction))
    return stack.close


def _later(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()
    return timer


def _sleeping_lines() -> dict[CodeType, set[int]]:
    """Where a wait of ferry's sleeps: a lock's wait in ``threading.Condition.wait`` (ferry's
    waits sleep on a ``threading.Event``), or the staging engine job's compiled wait."""
    lines: dict[CodeType, set[int]] = {}
    for fn, call in ((threading.Condition.wait, "waiter.acquire("), (NativeJob.wait_done, "self._inner.wait(")):
        source, first = inspect.getsourcelines(fn)
        lines[fn.__code__] = {first + i for i, text in enumerate(source) if call in text}
        assert lines[fn.__code__], f"no {call} in {fn.__qualname__}"
    return lines


_SLEEPING = _sleeping_lines()


class _Interrupt:
    """Send SIGINT to the main thread once it sleeps inside a wait; remember when.

    The main thread sleeps there when its innermost frame is on one of the calls of
    :func:`_sleeping_lines` while this thread runs (holding the GIL): it is inside that call,
    which released the GIL, or just back from it; either way inside the wait, so the signal
    cannot arrive before the call under test began (a timer could, on a loaded machine).
    Not seen there within 30 s (a wait that sleeps elsewhere), it is sent anyway and
    :meth:`latency` fails."""

    def __init__(self) -> None:
        self.sent: float | None = None
        self.asleep = False
        self._main = threading.main_thread().ident or 0
        self._armed = threading.Event()  # not while start() waits for the thread
        self.timer = threading.Thread(target=self._send, daemon=True)
        self.timer.start()
        self._armed.set()

    def _send(self) -> None:
        self._armed.wait()
        deadline = time.monotonic() + 30
        while True:
            frame = sys._current_frames().get(self._main)
            self.asleep = frame is not None and frame.f_lineno in _SLEEPING.get(frame.f_code, ())
            del frame
            if self.asleep or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        self.sent = time.perf_counter()
        signal.pthread_kill(self._main, signal.SIGINT)

    def latency(self) -> float:
        caught = time.perf_counter()
        self.timer.join()
        assert self.sent is not None
        assert self.asleep, "the main thread was not seen asleep in the wait within 30 s"
        return caught - self.sent


@pytest.fixture(autouse=True)
def _python_sigint_handler() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in these tests, whatever the runner installed."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _download(rt: ferry.Runtime, data: np.ndarray[Any, Any]) -> ferry.PendingDownload:
    dev = rt.to_device(data)
    return rt.download_pending(dev, rt.pinned(data.nbytes))


def _check(result: tuple[Any, Any], data: np.ndarray[Any, Any]) -> None:
    _, buf = result
    assert np.array_equal(buf.as_array(data.dtype), data)


def _retired(rt: ferry.Runtime) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        gc.collect()
        rt.poll()
        stats = rt.stats()
        if stats.in_flight == 0 and stats.retiring == 0:
            return stats.failed == 0 and stats.completed == stats.submitted
        time.sleep(0.002)
    return False


# -- wait(timeout=) -------------------------------------------------------------------------------------


def test_a_wait_times_out_then_waits_again(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 16, dtype=np.int32)
    dropped_data = np.arange(100, dtype=np.uint8)
    with HeldAtMost(rt, "download") as held:
        pending = _download(rt, data)
        dropped = _download(rt, dropped_data)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="still pending"):
            pending.wait(timeout=0.1)
        elapsed = time.monotonic() - start
        assert elapsed >= 0.1, f"timed out after {elapsed:.3f} s"  # the timeout's whole length, not less
        assert not held.expired, "the wait ignored its timeout: it returned once the held copy was let go"
        assert not pending.is_ready()
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0.05)  # and again
        with pytest.raises(TimeoutError):
            dropped.wait(timeout=0.01)
        del dropped  # a handle that timed out retires as usual
    _check(pending.wait(), data)
    with pytest.raises(ferry.FerryError, match="already waited"):
        pending.wait(timeout=1)
    assert _retired(rt)


_BAD_TIMEOUTS = [-1, -0.001, float("-inf"), float("nan")]

# every call that takes a timeout, as (name, call(handle, timeout)) on a pending download handle
_TIMEOUT_TAKERS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("wait", lambda handle, t: handle.wait(timeout=t)),
    ("wait, positional", lambda handle, t: handle.wait(t)),
    ("wait_all", lambda handle, t: ferry.wait_all([handle], timeout=t)),
    ("as_completed", lambda handle, t: ferry.as_completed([handle], timeout=t)),  # at the call, not at next()
    ("future().result", lambda handle, t: handle.future().result(timeout=t)),
    ("future().exception", lambda handle, t: handle.future().exception(timeout=t)),
]


@pytest.mark.parametrize("timeout", _BAD_TIMEOUTS, ids=repr)
@pytest.mark.parametrize(("name", "call"), _TIMEOUT_TAKERS, ids=[name for name, _ in _TIMEOUT_TAKERS])
@pytest.mark.parametrize("complete", [False, True], ids=["pending", "complete"])
def test_a_negative_or_nan_timeout_is_refused_and_changes_nothing(
        rt: ferry.Runtime, name: str, call: Callable[[Any, Any], Any], timeout: float, complete: bool) -> None:
    data = np.arange(4096, dtype=np.uint8)
    release = _held(rt, "download")
    pending = _download(rt, data)
    if complete:
        release()
    try:
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            call(pending, timeout)
    finally:
        release()
    _check(pending.wait(timeout=10), data)  # the handle is as it was


@pytest.mark.parametrize("timeout", _BAD_TIMEOUTS, ids=repr)
def test_close_refuses_a_negative_or_nan_timeout_and_stays_open(rt: ferry.Runtime, timeout: float) -> None:
    data = np.arange(4096, dtype=np.uint8)
    pending = _download(rt, data)
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        rt.close(timeout=timeout)
    assert not rt.closed
    _check(pending.wait(), data)


@pytest.mark.parametrize("timeout", ["1", True, [1]], ids=repr)
def test_a_timeout_that_is_not_a_number_is_a_type_error(rt: ferry.Runtime, timeout: Any) -> None:
    data = np.arange(64, dtype=np.uint8)
    pending = _download(rt, data)
    for call in (lambda: pending.wait(timeout=timeout), lambda: ferry.wait_all([pending], timeout=timeout),
                 lambda: rt.close(timeout=timeout)):
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            call()
    _check(pending.wait(), data)


def test_timeout_zero_is_a_poll(rt: ferry.Runtime) -> None:
    data = np.arange(4096, dtype=np.uint8)
    with HeldAtMost(rt, "download") as held:
        pending = _download(rt, data)
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0)
        assert not held.expired, "wait(timeout=0) waited for the held copy"
    deadline = time.monotonic() + 20
    while not pending.is_ready() and time.monotonic() < deadline:
        time.sleep(0.001)
    _check(pending.wait(timeout=0), data)


def test_a_poll_does_not_wake_the_watcher(rt: ferry.Runtime) -> None:
    from ferry._runtime import parts_of

    with ferry.Runtime(rt.backend) as fresh:
        completion = parts_of(fresh).completion
        with HeldAtMost(fresh, "download") as held:  # nothing waited before: no watcher yet
            pending = fresh.download_pending(fresh.empty(4096, np.uint8), fresh.pinned(4096))
            assert completion.watcher is None
            for _ in range(3):
                with pytest.raises(TimeoutError):
                    pending.wait(timeout=0)
            assert completion.watcher is None  # no thread was started to sleep on what was only polled
            assert not held.expired
        dev, buf = pending.wait()
        assert dev.nbytes == buf.nbytes == 4096


# -- past the spin: the nap, then the watcher ------------------------------------------------------------


def _waiter(pending: ferry.PendingDownload) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(pending.wait()), daemon=True)
    thread.start()
    return thread, results


def test_a_wait_past_its_spin_notices_the_copy_itself(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry._runtime import parts_of

    monkeypatch.setattr(_completion, "NAP_WINDOW", 60.0)  # the whole test inside the nap
    napping = threading.Event()
    nap = _completion.Completion._nap

    def seen(self: Any, record: Any, deadline: float | None) -> bool | None:
        napping.set()
        return nap(self, record, deadline)

    data = np.arange(4096, dtype=np.uint8)
    with ferry.Runtime(rt.backend) as fresh:
        completion = parts_of(fresh).completion
        with HeldAtMost(fresh, "download") as held:
            pending = _download(fresh, data)
            monkeypatch.setattr(_completion.Completion, "_nap", seen)  # the wait under test's nap only
            thread, results = _waiter(pending)
            assert napping.wait(30)  # past its spin, asking the event between naps
            assert not held.expired
        thread.join(30)
        assert not thread.is_alive()
        _check(results[0], data)
        assert completion.watcher is None  # the wait saw the copy complete: no thread was woken for it


def test_a_wait_past_its_nap_sleeps_until_the_watcher_wakes_it(
    rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry._runtime import parts_of

    monkeypatch.setattr(_completion, "NAP_WINDOW", 2e-3)
    data = np.arange(4096, dtype=np.uint8)
    with ferry.Runtime(rt.backend) as fresh:
        completion = parts_of(fresh).completion
        with HeldAtMost(fresh, "download") as held:
            pending = _download(fresh, data)
            thread, results = _waiter(pending)
            deadline = time.monotonic() + 30
            while completion.watcher is None and time.monotonic() < deadline:  # the nap gave way to it
                time.sleep(0.001)
            assert completion.watcher is not None and thread.is_alive() and not results
            assert not held.expired
        thread.join(30)
        assert not thread.is_alive()
        _check(results[0], data)


def test_a_nap_asks_ever_less_often(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(_completion, "NAP_WINDOW", 60.0)
    monkeypatch.setattr(_completion, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    data = np.arange(4096, dtype=np.uint8)
    timeout = 0.2
    with HeldAtMost(rt, "download") as held:
        pending = _download(rt, data)
        pauses.clear()  # the upload's wait in _download is not the one under test
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            pending.wait(timeout=timeout)
        assert time.monotonic() - start >= timeout
        assert not held.expired
        timed = pauses[:]
    _check(pending.wait(), data)
    assert timed[0] == _completion.NAP_FIRST
    assert all(p <= _completion.NAP_MAX for p in timed)
    assert timed[:-1] == sorted(timed[:-1])  # the last one ends at the deadline
    assert _completion.NAP_MAX in timed  # reached after 16 x NAP_MAX napped
    # at most 16 pauses of NAP_FIRST, ~42 growing ones to NAP_MAX, then one per NAP_MAX: ~842 in 0.2 s
    # (fewer where a sleep overshoots); pauses that did not grow would be 10,000 (2,800 with 50 us of slack)
    assert len(timed) <= 900, len(timed)


def test_short_waits_in_a_loop_nap_once_over_all_of_them(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry._runtime import parts_of

    window = 0.02
    monkeypatch.setattr(_completion, "NAP_WINDOW", window)
    data = np.arange(4096, dtype=np.uint8)
    with ferry.Runtime(rt.backend) as fresh:
        completion = parts_of(fresh).completion
        with HeldAtMost(fresh, "download") as held:
            pending = _download(fresh, data)
            for _ in range(12):  # 60 ms of 5 ms waits: the first four spend the record's nap
                with pytest.raises(TimeoutError):
                    pending.wait(timeout=0.005)
            assert pending._record.napped >= window
            assert completion.watcher is not None  # the later waits slept on the record's signal
            assert not held.expired
        _check(pending.wait(), data)


def test_a_nap_keeps_its_timeout_while_another_thread_holds_the_runtime_lock(rt: ferry.Runtime) -> None:
    from ferry._runtime import parts_of

    lock = parts_of(rt).completion.lock
    data = np.arange(4096, dtype=np.uint8)
    holding, done = threading.Event(), threading.Event()
    released = []

    def hold_the_lock() -> None:  # as a submission held back until the oldest copy completes does
        with lock:
            holding.set()
            done.wait(30)
            released.append(time.monotonic())

    with HeldAtMost(rt, "download") as held:
        pending = _download(rt, data)
        holder = threading.Thread(target=hold_the_lock, daemon=True)
        holder.start()
        assert holding.wait(30)
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0.05)
        assert not released  # the wait timed out while the lock was still held: its asks did not wait for it
        done.set()
        holder.join(30)
        assert not held.expired
    _check(pending.wait(), data)


def test_a_staged_transfer_times_out_then_waits_again(rt: ferry.Runtime) -> None:
    data = np.random.default_rng(3).integers(0, 255, 24 << 20, dtype=np.uint8)  # beyond direct_bytes: staged
    with testing.hold(rt, "upload"):
        pending = rt.upload(data)
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0.1)
        assert not pending.is_ready()
    source, dev = pending.wait()
    assert source is data
    assert np.array_equal(rt.to_host(dev), data)


@pytest.mark.slow
def test_a_long_wait_sleeps(rt: ferry.Runtime) -> None:
    data = np.arange(4096, dtype=np.uint8)
    release = _held(rt, "download")
    pending = _download(rt, data)
    _later(1.0, release)
    cpu, wall = time.process_time(), time.perf_counter()
    result = pending.wait()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    _check(result, data)
    print(f"a {wall:.2f} s wait used {cpu * 1e3:.1f} ms of CPU ({100 * cpu / wall:.2f} % of a core)")
    assert wall >= 0.9
    assert cpu / wall < 0.1, f"{100 * cpu / wall:.1f} % of a core while waiting"


# -- Ctrl-C -------------------------------------------------------------------------------------------------


def test_ctrl_c_interrupts_wait_and_the_handle_can_be_waited_again(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 16, dtype=np.float32)
    with HeldAtMost(rt, "download"):
        pending = _download(rt, data)
        interrupt = _Interrupt()
        with pytest.raises(KeyboardInterrupt):
            pending.wait()
        latency = interrupt.latency()
        print(f"KeyboardInterrupt {latency * 1e3:.2f} ms after SIGINT (wait)")
        assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT"
        assert not pending.is_ready()
        stats = rt.stats()
        assert stats.in_flight >= 1 and stats.failed == 0 and stats.abandoned == 0
    _check(pending.wait(), data)


def test_ctrl_c_interrupts_a_wait_with_a_timeout(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 10, dtype=np.float32)
    with HeldAtMost(rt, "download"):
        pending = _download(rt, data)
        interrupt = _Interrupt()
        with pytest.raises(KeyboardInterrupt):
            pending.wait(timeout=30)
        latency = interrupt.latency()
        print(f"KeyboardInterrupt {latency * 1e3:.2f} ms after SIGINT (wait with a timeout)")
        assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT"
    _check(pending.wait(timeout=30), data)


def test_ctrl_c_interrupts_to_host_and_leaves_everything_valid(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 16, dtype=np.int64)
    dev = rt.to_device(data)
    with HeldAtMost(rt, "download"):
        interrupt = _Interrupt()
        with pytest.raises(KeyboardInterrupt):
            rt.to_host(dev)
        latency = interrupt.latency()
        print(f"KeyboardInterrupt {latency * 1e3:.2f} ms after SIGINT (to_host)")
        assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT"
        assert dev.state == "read_leased"  # still the source of the copy: not freed, not abandoned
    assert _retired(rt)  # the interrupted download's handle retired like a dropped one
    assert dev.state == "owned"
    assert np.array_equal(rt.to_host(dev), data)


def test_ctrl_c_interrupts_the_wait_of_a_staged_upload() -> None:
    """A pageable upload staged in chunks (the staging engine's job, held) is waited in the job's
    slices: Ctrl-C reaches it, the handle stays pending, and it completes once released."""
    config = ferry.StagingConfig(lanes=2, slot_bytes=256 << 10, direct_bytes=64 << 10, min_chunk_bytes=64 << 10)
    with ferry.Runtime("emulated", staging=config) as rt:
        data = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: four chunks on two lanes
        dev = rt.empty(data.shape, data.dtype)
        with HeldAtMost(rt, "upload"):
            pending = rt.upload(data, dev)
            interrupt = _Interrupt()
            with pytest.raises(KeyboardInterrupt):
                pending.wait()
            latency = interrupt.latency()
            print(f"KeyboardInterrupt {latency * 1e3:.2f} ms after SIGINT (staged upload)")
            assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT"
            assert not pending.is_ready()
        source, dev = pending.wait(timeout=30)
        assert source is data and np.array_equal(rt.to_host(dev), data)


def test_ctrl_c_interrupts_wait_all(rt: ferry.Runtime) -> None:
    arrays = [np.full(1000, i, np.int32) for i in range(3)]
    with HeldAtMost(rt, "download"):
        handles = [_download(rt, a) for a in arrays]
        interrupt = _Interrupt()
        with pytest.raises(KeyboardInterrupt):
            ferry.wait_all(handles)
        latency = interrupt.latency()
        print(f"KeyboardInterrupt {latency * 1e3:.2f} ms after SIGINT (wait_all)")
        assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT"
        assert not any(h.is_ready() for h in handles)
    for result, a in zip(ferry.wait_all(handles, timeout=30), arrays, strict=True):
        _check(result, a)


def test_ctrl_c_interrupts_close_and_the_runtime_stays_open(backend_name: str) -> None:
    rt = ferry.Runtime(backend_name)
    try:
        data = np.arange(1 << 12, dtype=np.uint16)
        with HeldAtMost(rt, "download"):
            pending = _download(rt, data)
            interrupt = _Interrupt()
            with pytest.raises(KeyboardInterrupt):
                rt.close()
            latency = interrupt.latency()
            print(f"KeyboardInterrupt {latency * 1e3:.2f} ms after SIGINT (close)")
            assert latency < INTERRUPT_BOUND, f"KeyboardInterrupt {latency * 1e3:.1f} ms after SIGINT"
            assert not rt.closed
        _check(pending.wait(), data)
        assert np.array_equal(rt.to_host(rt.to_device(data)), data)
    finally:
        rt.close()
    assert rt.closed and testing.violations(rt) == []


# -- close(timeout=) and a wait() racing close() -------------------------------------------------------------


def test_close_with_a_timeout_leaves_the_runtime_open(backend_name: str) -> None:
    rt = ferry.Runtime(backend_name)
    try:
        data = np.arange(1 << 12, dtype=np.int16)
        with HeldAtMost(rt, "download") as held:
            pending = _download(rt, data)
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="still open"):
                rt.close(timeout=0.1)
            assert time.monotonic() - start >= 0.1  # it waited its whole timeout for the held copy
            assert not held.expired, "close() ignored its timeout: it returned once the held copy was let go"
            assert not rt.closed
            dev = rt.to_device(data)  # submissions are accepted (the upload stream is not held)
            later = rt.download_pending(dev, rt.pinned(data.nbytes))  # and waited for by the next close
            assert not pending.is_ready()
        _check(pending.wait(), data)
        rt.close()
        assert rt.closed
        with pytest.raises(ferry.RuntimeClosedError):
            later.wait()  # begun after close(): its objects were released
    finally:
        rt.close()
    stats = rt.stats()
    assert stats.in_flight == 0 and stats.retiring == 0 and stats.device_bytes == 0
    assert testing.violations(rt) == []


def _blocked_in_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside a handle's wait(), asleep or about to sleep. The compiled wait
    (a C call, no frame) hands a copy it could not spin out to ``Completion.wait``; the pure-Python
    handle's ``wait`` is a frame of its own."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        code = frame.f_code
        if (code.co_name == "wait" and code.co_filename.endswith("_pending.py")) or (
            code.co_name in ("wait", "ready", "_sleep") and code.co_filename.endswith("_completion.py")
        ):
            return True
        frame = frame.f_back
    return False


@pytest.mark.slow
def test_a_wait_racing_close_always_gets_its_result(backend_name: str) -> None:
    """The rule: a wait() begun before close() commits returns the result (20 times out of 20)."""
    data = np.random.default_rng(5).integers(0, 255, 4096, dtype=np.uint8)
    outcomes = []
    for i in range(20):
        rt = ferry.Runtime(backend_name)
        try:
            dev = rt.to_device(data)
            release = _held(rt, "download")
            pending = rt.download(dev)  # into a NumPy array: it keeps the bytes after close()
            got: list[Any] = []

            def waiter(pending: ferry.PendingDownload = pending, got: list[Any] = got) -> None:
                try:
                    got.append(pending.wait())
                except Exception as exc:
                    got.append(exc)

            thread = threading.Thread(target=waiter)
            thread.start()
            deadline = time.monotonic() + 10
            while not _blocked_in_wait(thread) and time.monotonic() < deadline:
                time.sleep(0.001)
            _later(0.02 * (i % 3), release)  # the copy completes before, at, or after close() begins
            rt.close()
            thread.join(10)
            del pending
        finally:
            rt.close()
        outcomes.append(got[0])
        assert testing.violations(rt) == []
    failures = [o for o in outcomes if not isinstance(o, tuple)]
    assert not failures, f"{len(failures)} of 20 waits did not get their result: {failures[:3]}"
    for _, out in outcomes:
        assert np.array_equal(out, data)


def test_a_wait_blocked_while_close_times_out_still_gets_its_result(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 10, dtype=np.float64)
    release = _held(rt, "download")
    pending = _download(rt, data)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(pending.wait()))
    thread.start()
    with pytest.raises(TimeoutError):
        rt.close(timeout=0.1)
    assert thread.is_alive() and not got
    release()
    thread.join(10)
    _check(got[0], data)


# -- interpreter exit ------------------------------------------------------------------------------------------


def _run(code: str, backend: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    environ = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    environ["FERRY_BACKEND"] = backend
    environ.update(env)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120, env=environ)
    return result, time.monotonic()


_HELD_AT_EXIT = """
    import contextlib, time, numpy as np, ferry
    from ferry import testing
    rt = ferry.Runtime()
    hold = contextlib.ExitStack()
    hold.enter_context(testing.hold(rt))  # a producer that never finishes
    dev = rt.empty(1 << 20, np.uint8)
    kept = rt.download_pending(dev, rt.pinned(1 << 20))
    rt.upload_pending(rt.pinned(4096), rt.empty(4096, np.uint8))  # dropped
    print(time.monotonic(), flush=True)
"""


# Python 3.12+ refuses to start a thread once the interpreter exits (its atexit hooks run then): this
# prelude, registered after ferry's own hook (hooks run last in, first out), makes every Python do so
_NO_THREADS_AT_EXIT = """
    import atexit, threading

    def _refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    def _no_threads_from_now_on():
        threading.Thread.start = _refuse

    atexit.register(_no_threads_from_now_on)
"""

_RELEASED_AT_EXIT = """
    import atexit

    def _after_ferry():  # registered before ferry is imported, so it runs after ferry's exit hook
        stats = rt.stats()
        print("completed", stats.completed, "of", stats.submitted, "failed", stats.failed, flush=True)

    atexit.register(_after_ferry)
    import contextlib, threading, time, numpy as np, ferry
    from ferry import testing
    rt = ferry.Runtime()
    hold = contextlib.ExitStack()
    hold.enter_context(testing.hold(rt))
    kept = rt.download_pending(rt.empty(1 << 20, np.uint8), rt.pinned(1 << 20))
    rt.upload_pending(rt.pinned(4096), rt.empty(4096, np.uint8))  # dropped
    release = threading.Timer(1.0, hold.close)  # the producer finishes a second into the exit
    release.daemon = True
    release.start()
    print(time.monotonic(), flush=True)
""" + _NO_THREADS_AT_EXIT


@pytest.mark.slow
def test_exit_waits_for_transfers_in_flight_without_starting_a_thread(backend_name: str) -> None:
    result, ended = _run(_RELEASED_AT_EXIT, backend_name, FERRY_EXIT_TIMEOUT="60")
    assert result.returncode == 0, result.stderr
    started, summary = result.stdout.strip().splitlines()
    exiting = ended - float(started)
    assert exiting >= 0.9, f"exit took {exiting:.2f} s: it did not wait for the held copies (let go after 1 s)"
    assert summary == "completed 2 of 2 failed 0", summary  # the download and the dropped upload
    assert result.stderr == "", result.stderr  # nothing was left, nothing went wrong, nothing to say


@pytest.mark.slow
def test_exit_with_a_held_stream_is_bounded_and_warns(backend_name: str) -> None:
    result, ended = _run(_HELD_AT_EXIT + _NO_THREADS_AT_EXIT, backend_name, FERRY_EXIT_TIMEOUT="0.5")
    assert result.returncode == 0, result.stderr
    exiting = ended - float(result.stdout.strip())
    print(f"exit took {exiting:.2f} s with FERRY_EXIT_TIMEOUT=0.5")
    # at least the timeout (the producer never finishes); well below the default 30 s that an exit ignoring
    # FERRY_EXIT_TIMEOUT would wait (a tighter bound timed the child's shutdown on a loaded machine)
    assert 0.5 <= exiting < 20.0, f"exit took {exiting:.2f} s"
    assert "ferry: warning" in result.stderr and "FERRY_EXIT_TIMEOUT" in result.stderr
    assert f"{backend_name} device 0: 2 transfer(s), {(1 << 20) + 4096} bytes" in result.stderr
    assert "1 with a pending handle, 1 dropped" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_exit_timeout_zero_gives_up_at_once(backend_name: str) -> None:
    result, ended = _run(_HELD_AT_EXIT, backend_name, FERRY_EXIT_TIMEOUT="0")
    assert result.returncode == 0, result.stderr
    assert ended - float(result.stdout.strip()) < 20.0  # not the default 30 s (the producer never finishes)
    assert "2 transfer(s)" in result.stderr


def test_a_failure_closing_at_exit_is_reported_not_swallowed(backend_name: str) -> None:
    code = """
        import ferry
        rt = ferry.Runtime()

        def broken(timeout=None):
            raise OSError("the device went away")

        rt._parts.close = broken  # what a device failure inside close() looks like
        print("ok")
    """
    result, _ = _run(code, backend_name)
    assert result.returncode == 0, result.stderr
    assert "ferry: warning: closing a runtime at interpreter exit failed: OSError('the device went away')" \
        in result.stderr
    assert "Traceback" not in result.stderr


def test_an_invalid_exit_timeout_is_reported_and_the_default_used(backend_name: str) -> None:
    code = """
        import numpy as np, ferry
        rt = ferry.Runtime()
        rt.download_pending(rt.to_device(np.arange(1000)), rt.pinned(8000))  # completes within the default
        print("ok")
    """
    result, _ = _run(code, backend_name, FERRY_EXIT_TIMEOUT="soon")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert result.stderr == "ferry: FERRY_EXIT_TIMEOUT='soon' is not a number of seconds >= 0 (or 'inf'); " \
        "waiting at most 30 s\n"


# -- waiters that give up never strand the others ------------------------------------------------------------------


def test_a_cancelled_future_does_not_strand_wait_all_or_as_completed(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 12, dtype=np.uint8)
    with testing.hold(rt, "download"):
        first, second, third = (_download(rt, data) for _ in range(3))
        for handle in (first, second, third):
            assert handle.future().cancel()
        fresh = third.future()
        assert not fresh.cancelled() and not fresh.done()  # a new future after a cancelled one
    (result,) = ferry.wait_all([first], timeout=10)
    _check(result, data)
    assert list(ferry.as_completed([second], timeout=10)) == [second]
    _check(second.wait(timeout=0), data)
    _check(fresh.result(timeout=10), data)
    _check(third.wait(), data)


def test_asyncio_wait_for_that_times_out_does_not_strand_the_handle(rt: ferry.Runtime) -> None:
    data = np.arange(1 << 12, dtype=np.uint8)

    async def give_up(handle: ferry.PendingDownload) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(handle, 0.05)

    with testing.hold(rt, "download"):
        one, two = _download(rt, data), _download(rt, data)
        watched = one.future()  # another waiter, already there
        asyncio.run(give_up(one))
        asyncio.run(give_up(two))
        assert not watched.cancelled() and not watched.done()
    (result,) = ferry.wait_all([one], timeout=10)
    _check(result, data)
    assert watched.result(timeout=10) == result
    assert list(ferry.as_completed([two], timeout=10)) == [two]
    _check(two.wait(), data)


def test_a_done_callback_survives_a_cancelled_future(rt: ferry.Runtime) -> None:
    data = np.arange(100, dtype=np.uint8)
    called = threading.Event()
    with testing.hold(rt, "download"):
        pending = _download(rt, data)
        pending.add_done_callback(lambda handle: called.set())
        assert pending.future().cancel()
    assert called.wait(10)
    _check(pending.wait(timeout=0), data)


def test_as_completed_times_out_and_leaves_the_handles(rt: ferry.Runtime) -> None:
    data = np.arange(100, dtype=np.uint8)
    with testing.hold(rt, "download"):
        handles = [_download(rt, data) for _ in range(2)]
        with pytest.raises(TimeoutError, match="2 of 2"):
            list(ferry.as_completed(handles, timeout=0.05))
    assert set(map(id, ferry.as_completed(handles, timeout=10))) == set(map(id, handles))
    for handle in handles:
        _check(handle.wait(timeout=0), data)


def test_a_done_callback_may_wait_for_another_transfer_and_close_the_runtime(backend_name: str) -> None:
    rt = ferry.Runtime(backend_name)
    data = np.arange(1 << 10, dtype=np.int32)
    got: list[Any] = []
    finished = threading.Event()

    def callback(handle: ferry.PendingDownload) -> None:  # runs on the watcher's thread
        try:
            for pending in (handle, later):  # the second is behind a second gate: no sleeping on itself
                _, buf = pending.wait(timeout=30)
                got.append(np.array_equal(buf.as_array(data.dtype), data))
            rt.close()
        except BaseException as exc:
            got.append(exc)
        finally:
            finished.set()

    try:
        release_first = _held(rt, "download")
        first = _download(rt, data)
        release_second = _held(rt, "download")
        later = _download(rt, data)
        first.add_done_callback(callback)
        release_first()
        _later(0.3, release_second)
        assert finished.wait(30)
        assert got == [True, True]
        assert rt.closed
    finally:
        rt.close()


def test_timeouts_are_numbers_of_seconds(backend_name: str) -> None:
    rt = ferry.Runtime(backend_name)
    try:
        data = np.arange(64, dtype=np.uint8)
        with testing.hold(rt, "download"):
            pending = _download(rt, data)
            with pytest.raises(ValueError, match="NaN"):
                pending.wait(timeout=float("nan"))
            with pytest.raises(ValueError, match="NaN"):
                rt.close(timeout=float("nan"))
            with pytest.raises(ValueError, match="-1"):
                pending.wait(timeout=-1)  # not a poll: refused (timeout=0 is the poll)
        _check(pending.wait(timeout=float("inf")), data)
        rt.close(timeout=float("inf"))  # no bound
        assert rt.closed
    finally:
        rt.close()


def test_a_prefetch_source_whose_close_fails_is_reported_and_the_runtime_still_closed(
        capsys: pytest.CaptureFixture[str]) -> None:
    def source() -> Iterator[np.ndarray[Any, Any]]:
        try:
            while True:
                yield np.arange(16, dtype=np.float32)
        finally:
            raise OSError("the file went away")  # a source whose clean-up fails

    prefetcher = ferry.prefetch(source())
    batches = iter(prefetcher)
    next(batches)
    prefetcher.close()
    assert "ferry: warning: closing the batches' source failed: OSError('the file went away')" \
        in capsys.readouterr().err
    assert prefetcher._rt.closed
