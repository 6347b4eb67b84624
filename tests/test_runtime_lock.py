"""The runtime's lock: the extension's RLock keeps threading.RLock's semantics.

Every test runs on both locks, so a difference between them fails here."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import SignalInside, call_inside
from ferry import _native
from ferry._runtime import parts_of

_engine = _native.load()
LOCKS: list[Any] = [pytest.param(threading.RLock, id="threading")]
if _engine is not None:
    LOCKS.append(pytest.param(_engine.RLock, id="compiled"))


@pytest.fixture(params=LOCKS)
def make(request: pytest.FixtureRequest) -> Callable[[], Any]:
    return request.param  # type: ignore[no-any-return]


def in_thread(fn: Callable[[], Any]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


@contextlib.contextmanager
def held_by_another_thread(lock: Any) -> Iterator[threading.Event]:
    """``lock`` held by a thread until the yielded event is set (at the latest when the block ends)."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        yield release
    finally:
        release.set()
        t.join(10)


def test_reentrant_and_counted(make: Callable[[], Any]) -> None:
    lock = make()
    assert lock.acquire() is True
    assert lock.acquire() is True
    assert lock.acquire(False) is True  # this thread holds it: taken again at once
    lock.release()
    lock.release()
    assert in_thread(lambda: lock.acquire(False)) is False  # still held once
    lock.release()
    assert in_thread(lambda: lock.acquire(False)) is True  # free (that thread then ends holding it)


def test_release_by_a_thread_that_does_not_hold_it_raises(make: Callable[[], Any]) -> None:
    lock = make()
    with pytest.raises(RuntimeError):
        lock.release()
    lock.acquire()
    with pytest.raises(RuntimeError):
        in_thread(lock.release)
    lock.release()  # still ours, once


def test_timeout_and_blocking_arguments(make: Callable[[], Any]) -> None:
    lock = make()
    with held_by_another_thread(lock):
        start = time.monotonic()
        assert lock.acquire(timeout=0.05) is False
        assert time.monotonic() - start >= 0.04
        assert lock.acquire(blocking=False) is False
        assert lock.acquire(True, 0) is False
        with pytest.raises(ValueError):
            lock.acquire(False, 1.0)
        with pytest.raises(ValueError):
            lock.acquire(timeout=-2)
        with pytest.raises(TypeError):
            lock.acquire(nonsense=1)
    assert lock.acquire(timeout=1.0) is True  # a bounded wait that is met returns True
    lock.release()


def test_a_blocked_acquire_waits_for_the_holder_then_takes_it(make: Callable[[], Any]) -> None:
    lock = make()
    lock.acquire()
    got: list[float] = []

    def waiter() -> None:
        with lock:
            got.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert not got  # blocked, and the GIL was free for this thread meanwhile
    released = time.monotonic()
    lock.release()
    t.join(10)
    assert got and got[0] >= released


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_ctrl_c_interrupts_a_blocked_acquire(make: Callable[[], Any]) -> None:
    """The compiled lock runs signal handlers between slices of its wait, so the one SIGINT reaches it
    wherever it lands. CPython's lock only wakes on EINTR: a SIGINT that lands after it released the
    GIL but before sem_clockwait began (which SignalInside cannot tell apart from sleeping) is missed
    until the timeout, so for threading.RLock the signal is repeated while the acquire still blocks,
    as a user presses Ctrl-C again (``test_a_signal_before_the_wait_still_interrupts_the_compiled_lock``
    shows the difference). A repeat that lands after the first interrupt is ignored, not raised later."""
    lock = make()
    in_thread(lock.acquire)  # held forever by a finished thread
    compiled = not isinstance(lock, type(threading.RLock()))
    raised: list[bool] = []

    def first_only(signum: int, frame: Any) -> None:
        if not raised:
            raised.append(True)
            signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as Ctrl-C

    previous = signal.signal(signal.SIGINT, first_only)
    try:
        # once the acquire blocks, not on a timer that could fire first
        sender = SignalInside(signal.SIGINT, resend=None if compiled else 1.0)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            call_inside(functools.partial(lock.acquire, timeout=20))
        elapsed = time.monotonic() - start
        sender.join()
    finally:
        signal.signal(signal.SIGINT, previous)  # runs first_only for a repeat still pending
    assert elapsed < 10, f"interrupted after {elapsed:.1f} s, {sender.sent} signal(s)"  # not at the timeout


@pytest.mark.skipif(_engine is None, reason="the extension is not built")
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_a_signal_before_the_wait_still_interrupts_the_compiled_lock() -> None:
    """SIGINT sent from C right before the acquire starts, with no bytecode (so no handler) in between:
    the C handler has run when the acquire begins to wait. The compiled lock runs the Python handler
    after its first slice; CPython's lock would sleep its full timeout (the race in the test above)."""
    import ctypes
    import operator

    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    libc.pthread_kill.argtypes = [ctypes.c_ulong, ctypes.c_int]
    kill = functools.partial(libc.pthread_kill, libc.pthread_self(), signal.SIGINT)
    assert _engine is not None
    lock = _engine.RLock()
    in_thread(lock.acquire)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        list(map(operator.call, [kill, functools.partial(lock.acquire, timeout=20)]))
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"interrupted after {elapsed:.1f} s"


def test_weakref_and_context_manager(make: Callable[[], Any]) -> None:
    lock = make()
    ref = weakref.ref(lock)
    assert ref() is lock
    with lock:
        assert lock._is_owned()
    assert not lock._is_owned()


@pytest.mark.skipif(_engine is None, reason="the extension is not built")
def test_a_runtime_uses_the_compiled_lock_and_submits_under_it() -> None:
    with ferry.Runtime("emulated") as rt:
        lock = parts_of(rt).lock
        assert type(lock) is _engine.RLock
        buf, dev = rt.pinned(64), rt.empty(64, np.uint8)
        buf.as_array()[:] = 7
        with lock:  # the submitting thread may hold it already: it is reentrant
            pending = rt.upload_pending(buf, dev)
        buf, dev = pending.wait()
        assert (rt.to_host(dev) == 7).all()
        buf.close()


def test_the_pure_python_engine_keeps_threading_rlock() -> None:
    if os.environ.get(_native.ENV_VAR, "").strip() != "0":
        pytest.skip("runs where FERRY_NATIVE=0")
    with ferry.Runtime("emulated") as rt:
        assert type(parts_of(rt).lock) is type(threading.RLock())


def test_mutual_exclusion_under_contention(make: Callable[[], Any]) -> None:
    lock = make()
    box = [0]
    threads_n, rounds = 4, 1500

    def work() -> None:
        for i in range(rounds):
            with lock:
                value = box[0]
                if i % 7 == 0:
                    time.sleep(0)  # hand the GIL over inside the critical section
                box[0] = value + 1

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert box[0] == threads_n * rounds
    assert lock.acquire(False) is True  # left free
    lock.release()


def test_timeout_nan_is_refused_and_the_largest_timeout_waits(make: Callable[[], Any]) -> None:
    lock = make()
    with pytest.raises(ValueError):
        lock.acquire(timeout=float("nan"))
    with pytest.raises(OverflowError):
        lock.acquire(timeout=threading.TIMEOUT_MAX * 2)
    with held_by_another_thread(lock) as release:
        threading.Timer(0.1, release.set).start()
        start = time.monotonic()
        assert lock.acquire(timeout=threading.TIMEOUT_MAX) is True  # waited for the holder, did not give up
        assert time.monotonic() - start >= 0.05
        lock.release()


def test_a_condition_on_the_lock_releases_every_level_while_it_waits(make: Callable[[], Any]) -> None:
    lock = make()
    cond = threading.Condition(lock)
    taken: list[bool] = []
    with cond:
        with cond:  # held twice
            t = threading.Thread(target=lambda: taken.append(lock.acquire(timeout=5)) or lock.release())
            t.start()
            cond.wait(0.2)  # releases both levels, then takes them back
            assert lock._is_owned()
        t.join(10)
    assert taken == [True]
    assert lock.acquire(False) is True
    lock.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_use_a_lock_other_threads_were_waiting_on(make: Callable[[], Any]) -> None:
    lock = make()
    lock.acquire()
    stop = threading.Event()

    def waiter() -> None:
        while not stop.is_set():
            if lock.acquire(timeout=0.01):
                lock.release()

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # they sleep on the lock now
    statuses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        for _ in range(20):
            pid = os.fork()
            if pid == 0:  # the child: only this thread exists; it holds the lock
                code = 1
                try:
                    lock.release()
                    code = 0 if lock.acquire(timeout=2) else 2
                    lock.release()
                finally:
                    os._exit(code)
            statuses.append(_reap(pid))
    stop.set()
    lock.release()
    for t in threads:
        t.join(10)
    assert statuses == [0] * 20


def _reap(pid: int, patience: float = 10.0) -> int:
    """The child's wait status; a child still running after ``patience`` seconds is killed (-1)."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1
