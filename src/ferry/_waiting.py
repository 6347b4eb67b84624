"""Waiting the Python way: futures, callbacks, ``await``, ``wait_all`` and ``as_completed``.

One watcher per runtime turns completions into futures. It never polls: it
has one thread per copy stream it watches (transfers on one stream complete in
submission order, so each thread waits for the oldest watched transfer of its
stream) and each thread *sleeps* until the device says the transfer is
complete: it makes a private stream wait for the transfer's event and
synchronizes on a blocking-sync event recorded after that wait (on CUDA the
driver puts the thread to sleep until the copy engine signals); for staged
pageable transfers it sleeps on the job's completion flag, which the staging
lanes set. So 100 pending transfers cost no CPU while they run.

When a transfer completes, the watcher performs the handle's one ``wait()``
and resolves the future with its result (or its ``TransferFailedError``); the
future's callbacks run on the watcher thread, and ``asyncio`` receives the
result through ``asyncio.wrap_future``.

Cancelling never touches the copy. A future cancelled before the transfer
completed (including the future behind an ``await`` in a cancelled asyncio
task) lets go of its handle; once every reference to the handle is gone, the
handle goes to the retirement queue like any dropped handle, and the buffers
are released only when the copy is proven complete.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ._backends._base import DeviceError

if TYPE_CHECKING:
    from ._completion import Completion, Record
    from ._pending import _Pending

__all__ = ["wait_all", "as_completed"]


class TransferFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A future resolved by the runtime's watcher with what ``wait()`` returns."""

    def __init__(self, handle: _Pending[Any]) -> None:
        super().__init__()
        self._handle: _Pending[Any] | None = handle  # kept alive until resolved or cancelled

    def cancel(self) -> bool:
        """Stop waiting for the result. The copy itself is never cancelled."""
        cancelled = super().cancel()
        if cancelled:
            self._handle = None  # once nothing else holds the handle, it retires
        return cancelled

    def _resolve(self) -> None:
        handle = self._handle
        if handle is None or self.cancelled():
            return
        try:
            result = handle._port.wait(handle._record)
        except BaseException as exc:  # delivered to whoever awaits
            handle._waited = True
            self._handle = None
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self.set_exception(exc)
            return
        handle._waited = True  # settled: dropping the handle now must not retire it
        self._handle = None
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.set_result(result)


class _StreamWatch:
    """Watches the transfers of one copy stream, oldest first, on one sleeping thread."""

    def __init__(self, watcher: Watcher, key: int) -> None:
        self.watcher = watcher
        self.items: list[tuple[int, Record, TransferFuture]] = []
        self.cond = threading.Condition()
        self.closing = False
        self.notify_stream: Any = None
        self.notify_event: Any = None
        self.thread = threading.Thread(target=self._run, name=f"ferry-watcher-{key}", daemon=True)
        self.thread.start()

    def add(self, record: Record, future: TransferFuture) -> None:
        with self.cond:
            bisect.insort(self.items, (record.seq, record, future), key=lambda item: item[0])
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.closing:
                    self.cond.wait()
                if not self.items:
                    return
                _, record, future = self.items.pop(0)
            self._sleep_until_done(record)
            future._resolve()
            del record, future  # hold nothing while idle: the objects belong to their owners

    def _sleep_until_done(self, record: Record) -> None:
        """Block, without spinning, until the record's copy is complete (or failed)."""
        completion = self.watcher.completion
        extra = record.extra
        if record.done or record.error is not None:
            return
        if extra is not None and extra.job is not None:
            extra.job.wait_done()
            return
        if extra is not None and extra.batch is not None:
            completion.flush_for(record)
        event = record.event
        if event is None:  # settled meanwhile (the event went back to the pool)
            return
        backend = completion.backend
        try:
            if self.notify_stream is None:
                self.notify_stream = backend.stream_create()
                self.notify_event = backend.event_create(blocking=True)
            backend.stream_wait_event(self.notify_stream, event)
            backend.event_record(self.notify_event, self.notify_stream)
            backend.event_synchronize(self.notify_event)
        except DeviceError:
            pass  # the failure is reported by the handle's wait in _resolve

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
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
        self._watches: dict[int, _StreamWatch] = {}
        self._lock = threading.Lock()

    def watch(self, record: Record, future: TransferFuture) -> None:
        key = id(record.stream)
        with self._lock:
            watch = self._watches.get(key)
            if watch is None:
                watch = self._watches[key] = _StreamWatch(self, len(self._watches))
        watch.add(record, future)

    def close(self) -> None:
        """Resolve what is watched (the runtime has waited for it), then stop."""
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.close()


def wait_all(handles: Iterable[_Pending[Any]], timeout: float | None = None) -> list[Any]:
    """Wait for every handle; return their ``wait()`` results in the order given.

    Raises
    ------
    TimeoutError
        Some transfers were not complete after ``timeout`` seconds; every
        handle is left as it was (pending handles can be waited later).
    TransferFailedError
        The first failed transfer, in the order given; the handles after it
        are left unwaited.
    """
    handles = list(handles)
    futures = [h.future() for h in handles]
    _, pending = concurrent.futures.wait(futures, timeout=timeout)
    if pending:
        raise TimeoutError(f"{len(pending)} of {len(futures)} transfers were not complete after {timeout} s")
    return [h.wait() for h in handles]


def as_completed(handles: Iterable[_Pending[Any]], timeout: float | None = None) -> Iterator[_Pending[Any]]:
    """Yield the handles as their transfers complete (``wait()`` on each then returns at once).

    Raises ``TimeoutError`` (from :func:`concurrent.futures.as_completed`) if
    ``timeout`` seconds pass before every transfer completed.
    """
    by_future = {h.future(): h for h in handles}
    for future in concurrent.futures.as_completed(by_future, timeout=timeout):
        yield by_future[future]
