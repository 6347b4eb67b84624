"""Waiting the Python way: signals, futures, callbacks, ``await``, ``wait_all`` and ``as_completed``.

Every record that someone sleeps on has one :class:`Signal`: a flag set once
the copy is proven complete or failed, and listeners run once after that.
Waiters never share anything else. ``wait()``, ``wait_all`` and
``as_completed`` sleep on the flag (a lock wait: timeouts are honoured and
``KeyboardInterrupt`` reaches the main thread at once); each future is a
listener of its own. So a waiter that gives up (a timeout, an interrupt, a
cancelled future or asyncio task) takes nothing from the others: the signal
still fires, and every other waiter sees it.

One watcher per runtime sets the signals. It never polls: it has one thread
per copy stream it watches (transfers on one stream complete in submission
order, so each thread waits for the oldest watched transfer of its stream)
and each thread *sleeps* until the device says the transfer is complete: it
makes a private stream wait for the transfer's event and synchronizes on a
blocking-sync event recorded after that wait (on CUDA the driver puts the
thread to sleep until the copy engine signals); for staged pageable transfers
it sleeps on the job's completion. So 100 pending transfers cost no CPU while
they run. Then it proves the outcome, sets the flag and runs the listeners on
its thread: a future's listener performs the settlement a ``wait()`` would
(publish, hand the objects back owned) and resolves the future with the
result (or its ``TransferFailedError``); ``asyncio`` receives it through
``asyncio.wrap_future``.

Cancelling never touches the copy. A future cancelled before the transfer
completed (including the private future behind an ``await`` in a cancelled
asyncio task, or one ``asyncio.wait_for`` gave up on) lets go of its handle;
the handle can still be waited in every other way, and once every reference
to it is gone it goes to the retirement queue like any dropped handle, and
the buffers are released only when the copy is proven complete.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ._args import timeout_arg
from ._backends._base import DeviceError

if TYPE_CHECKING:
    from ._completion import Completion, Record
    from ._pending import Pending, _Pending

__all__ = ["wait_all", "as_completed"]

Result = TypeVar("Result")
Handle = TypeVar("Handle", bound="Pending[Any]")

_SLICE = 0.05  # s: sleeping waits wake this often, so a signal delivered to another thread is seen
_local = threading.local()


def on_watcher_thread() -> bool:
    """Whether the calling thread is a watcher's (a done-callback runs there: it must not sleep on a signal)."""
    return bool(getattr(_local, "watcher", False))


class Signal:
    """Set once a record's copy is proven complete or failed; listeners run once, after that."""

    __slots__ = ("_listeners", "_lock", "fired", "flag")

    def __init__(self) -> None:
        self.flag = threading.Event()  # the copy is resolved: waiters may settle or claim
        self.fired = False  # the listeners ran (on the watcher's thread)
        self._listeners: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def listen(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once fired: later on the watcher's thread, or now if it already fired."""
        with self._lock:
            if not self.fired:
                self._listeners.append(fn)
                return
        fn()

    def unlisten(self, fn: Callable[[], object]) -> None:
        """Forget ``fn`` if it has not been called."""
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    def fire(self) -> None:
        """The record is resolved: set the flag, run every listener once (never raises)."""
        self.flag.set()
        with self._lock:
            self.fired = True
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            with contextlib.suppress(Exception):
                fn()


class TransferFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A future resolved by the runtime's watcher with what ``wait()`` returns."""

    def __init__(self, handle: _Pending[Any]) -> None:
        super().__init__()
        self._handle: _Pending[Any] | None = handle  # kept alive until resolved or cancelled

    def result(self, timeout: float | None = None) -> Any:
        """What ``wait()`` returns, once the transfer completed; a negative or NaN ``timeout`` raises ``ValueError``."""
        return super().result(timeout_arg(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The transfer's exception, if it failed; a negative or NaN ``timeout`` raises ``ValueError``."""
        return super().exception(timeout_arg(timeout))

    def cancel(self) -> bool:
        """Stop waiting for the result. The copy itself is never cancelled, and no other waiter is."""
        handle = self._handle
        cancelled = super().cancel()
        if cancelled and handle is not None:
            self._handle = None  # once nothing else holds the handle, it retires
            handle._port.attend(handle._record, -1)
        return cancelled

    def _resolve(self) -> None:
        """The record's signal fired: settle (if no one did) and resolve, unless cancelled first."""
        handle = self._handle
        if handle is None or not self.set_running_or_notify_cancel():
            return  # cancelled: cancel() stopped attending
        self._handle = None
        port, record = handle._port, handle._record
        try:
            result = port.settled_result(record)
        except BaseException as exc:  # delivered to whoever waits on the future
            self.set_exception(exc)
        else:
            handle._waited = True  # settled: dropping the handle now must not retire it
            self.set_result(result)
        finally:
            port.attend(record, -1)


class _StreamWatch:
    """Watches the transfers of one copy stream, oldest first, on one sleeping thread."""

    def __init__(self, watcher: Watcher, key: int) -> None:
        self.watcher = watcher
        self.items: list[tuple[int, Record]] = []
        self.cond = threading.Condition()
        self.closing = False
        self.notify_stream: Any = None
        self.notify_event: Any = None
        self.thread = threading.Thread(target=self._run, name=f"ferry-watcher-{key}", daemon=True)
        self.thread.start()

    def add(self, record: Record) -> None:
        with self.cond:
            bisect.insort(self.items, (record.seq, record), key=lambda item: item[0])
            self.cond.notify()

    def _run(self) -> None:
        _local.watcher = True
        completion = self.watcher.completion
        while True:
            with self.cond:
                while not self.items and not self.closing:
                    self.cond.wait()
                if not self.items:
                    return
                _, record = self.items.pop(0)
            try:
                while not completion.prove(record):
                    if not self._sleep_until_done(record):
                        time.sleep(0.001)  # the device would not say: ask again soon
            except Exception:  # never leave a waiter asleep: fire, and let it ask
                pass
            signal = record.signal
            if signal is not None:
                signal.fire()
            del record, signal  # hold nothing while idle: the objects belong to their owners

    def _sleep_until_done(self, record: Record) -> bool:
        """Block, without spinning, until the record's copy is complete (or failed); False if it could not."""
        completion = self.watcher.completion
        extra = record.extra
        if extra is not None and extra.job is not None:
            extra.job.wait_done(poll=False)  # the watcher sleeps; it never takes a CPU from the lanes
            return True
        backend = completion.backend
        try:
            with completion.lock:  # the event cannot go back to the pool (and be reused) meanwhile
                if record.done or record.error is not None:
                    return True
                if record.batch is not None:
                    completion.flush_for(record)
                event = record.event
                if event is None:
                    return True
                if self.notify_stream is None:
                    self.notify_stream = backend.stream_create()
                    self.notify_event = backend.event_create(blocking=True)
                backend.stream_wait_event(self.notify_stream, event)
                backend.event_record(self.notify_event, self.notify_stream)
            backend.event_synchronize(self.notify_event)  # asleep until the copy engine signals
        except DeviceError:
            return False  # prove() asks the record's own event, and records a failure
        return True

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not threading.current_thread():  # close() from a done-callback
            self.thread.join()
        backend = self.watcher.completion.backend
        with contextlib.suppress(DeviceError):
            if self.notify_stream is not None:
                backend.event_destroy(self.notify_event)
                backend.stream_destroy(self.notify_stream)


class Watcher:
    """The runtime's completion watcher: one sleeping thread per watched copy stream."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self._watches: dict[Any, _StreamWatch] = {}
        self._lock = threading.Lock()

    def watch(self, record: Record) -> None:
        """Fire ``record.signal`` once the record is resolved."""
        stream = record.stream
        key = stream if isinstance(stream, tuple) else id(stream)
        with self._lock:
            watch = self._watches.get(key)
            if watch is None:
                watch = self._watches[key] = _StreamWatch(self, len(self._watches))
        watch.add(record)

    def close(self) -> None:
        """Fire what is watched (every record is resolved by now), then stop."""
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(timeout, 0.0)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait_all(handles: Iterable[Pending[Result]], timeout: float | None = None) -> list[Result]:
    """Wait for every handle; return their ``wait()`` results in the order given.

    Each handle is waited as by ``wait()`` (it is then waited: a second
    ``wait()`` raises). The wait is bounded by ``timeout`` and interruptible
    (Ctrl-C); futures of the handles, cancelled or not, play no part.

    Raises
    ------
    TimeoutError
        Some transfers were not complete after ``timeout`` seconds; every
        handle is left as it was (pending handles can be waited later).
    ValueError
        ``timeout`` is negative or NaN; nothing changed.
    TransferFailedError
        The first failed transfer, in the order given; the handles after it
        are left unwaited.
    KeyboardInterrupt
        Raised by Ctrl-C while waiting; every handle is left as it was.
    """
    timeout = timeout_arg(timeout)
    handles = list(handles)
    deadline = _deadline(timeout)
    attended = []
    try:
        for handle in handles:
            handle._port.attend(handle._record, 1)
            attended.append(handle)
        spin = True
        for i, handle in enumerate(handles):
            if handle._waited:
                continue
            if not handle._port.ready(handle._record, _left(deadline), spin=spin):
                late = 1 + sum(not h._port.ready(h._record, 0, spin=False) for h in handles[i + 1:])
                raise TimeoutError(f"{late} of {len(handles)} transfers were not complete after {timeout} s")
            spin = False
        return [h.wait() for h in handles]
    finally:
        for handle in attended:
            handle._port.attend(handle._record, -1)


def as_completed(handles: Iterable[Handle], timeout: float | None = None) -> Iterator[Handle]:
    """Yield the handles as their transfers complete or fail (``wait()`` on each then returns at once).

    Each handle is yielded once, whatever became of its futures. Raises the
    builtin ``TimeoutError`` if ``timeout`` seconds pass (from the first
    ``next()``) before every transfer completed; the handles not yet yielded
    are left as they were. Interruptible (Ctrl-C). A negative or NaN ``timeout`` raises
    ``ValueError`` at the call.
    """
    return _as_completed(handles, timeout_arg(timeout))


def _as_completed(handles: Iterable[Handle], timeout: float | None) -> Iterator[Handle]:
    unique = list({id(h): h for h in handles}.values())
    deadline = _deadline(timeout)
    arrived: deque[Handle] = deque()
    cond = threading.Condition()
    listeners: list[tuple[Handle, Callable[[], object]]] = []

    def listener(handle: Handle) -> Callable[[], object]:
        def fire() -> None:
            with cond:
                arrived.append(handle)
                cond.notify()

        return fire

    try:
        for handle in unique:
            fn = listener(handle)
            listeners.append((handle, fn))
            if handle._waited:
                fn()
            else:
                handle._port.listen(handle._record, fn)
        for done in range(len(unique)):
            with cond:
                while not arrived:
                    left = _left(deadline)
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"{len(unique) - done} of {len(unique)} transfers were not complete after {timeout} s"
                        )
                    cond.wait(_SLICE if left is None else min(left, _SLICE))
                handle = arrived.popleft()
            yield handle
    finally:
        for handle, fn in listeners:
            handle._port.unlisten(handle._record, fn)
