"""The watcher: one sleeping thread per copy stream sets the records' signals; futures listen.

Every record that someone sleeps on has one :class:`~ferry._records.Signal`:
a flag set once the copy is proven complete or failed, and listeners run once
after that. One watcher per runtime sets the signals. It never polls: it has
one thread per copy stream it watches (transfers on one stream complete in
submission order, so each thread waits for the oldest watched transfer of its
stream) and each thread *sleeps* until the device says the transfer is
complete: it makes a private stream wait for the transfer's event and
synchronizes on a blocking-sync event recorded after that wait (on CUDA the
driver puts the thread to sleep until the copy engine signals); for staged
pageable transfers it sleeps on the job's completion. So 100 pending
transfers cost no CPU while they run. Then it proves the outcome, sets the
flag and runs the listeners on its thread: a future's listener performs the
settlement a ``wait()`` would (publish, hand the objects back owned) and
resolves the future with the result (or its ``TransferFailedError``);
``asyncio`` receives it through ``asyncio.wrap_future``.

Cancelling never touches the copy. A future cancelled before the transfer
completed (including the private future behind an ``await`` in a cancelled
asyncio task, or one ``asyncio.wait_for`` gave up on) lets go of its handle;
the handle can still be waited in every other way, and once every reference
to it is gone it goes to the retirement queue like any dropped handle, and
the buffers are released only when the copy is proven complete.

The watcher and the futures reach completion through the two protocols
below (:class:`Watched`, :class:`Handle`): this module sits under
``_completion.py``, which builds the watcher and makes the futures.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Protocol

from ._args import timeout_arg
from ._backends._base import Backend, DeviceError
from ._records import Record

__all__: list[str] = []

_local = threading.local()


def on_watcher_thread() -> bool:
    """Whether the calling thread is a watcher's (a done-callback runs there: it must not sleep on a signal)."""
    return bool(getattr(_local, "watcher", False))


class Watched(Protocol):
    """What the watcher asks of a runtime's completion part."""

    backend: Backend
    lock: Any  # the runtime's lock

    def prove(self, record: Record) -> bool:
        """Whether the record is resolved (complete or failed), recording a failure. Never blocks."""
        ...

    def flush_for(self, record: Record) -> None:
        """Enqueue the open batch segment the record waits in. Lock held."""
        ...


class FuturePort(Protocol):
    """What a future asks of the completion part about its handle's record."""

    def settled_result(self, record: Record) -> tuple[Any, ...]:
        """Settle a completed record (if no one did) and return its result, without claiming it."""
        ...

    def attend(self, record: Record, delta: int) -> None:
        """A waiter starts (``+1``) or stops (``-1``) attending the record."""
        ...


class Handle(Protocol):
    """What a future, and the completion part, see of a transfer handle (``_pending.py``)."""

    _waited: bool  # the record was settled (by wait() or by the watcher)

    @property
    def _port(self) -> FuturePort:
        """The completion part the handle asks."""
        ...

    @property
    def _record(self) -> Record:
        """The handle's record."""
        ...

    @property
    def _claimed(self) -> bool:
        """Whether ``wait()`` returned (or raised) to the caller."""
        ...


class TransferFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A future resolved by the runtime's watcher with what ``wait()`` returns."""

    def __init__(self, handle: Handle) -> None:
        super().__init__()
        self._handle: Handle | None = handle  # kept alive until resolved or cancelled

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

    def __init__(self, completion: Watched) -> None:
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
