"""Completion: records, events, batches, and the one place that decides a transfer's outcome.

Every submitted transfer has a :class:`Record`: the event recorded after its
copy (or a staged job, or a batch's shared event), the stream, and the objects
the copy touches: ``moved`` ones (in flight) and ``leased`` ones (read-leased
sources). The record lives in exactly one place: the *live* set (its handle
is alive and unwaited), the retirement queue (its handle was dropped), the
abandoned ledger (it failed: kept forever), or nowhere (settled).

Outcome rules, all enforced here and nowhere else:

* **settle** (the copy is proven complete and the handle is waited): the
  route's ``finish`` publishes (a download's host copy-out), the cleanups
  run, every moved object is owned again, every lease ends; exactly once.
* **fail** (the device reported an error): nothing is published; every moved
  and leased object becomes abandoned forever and is counted in
  ``abandoned_bytes``; the record goes to the ledger; exactly once.
* **retire** (a dropped handle's copy is proven complete): like settle, but
  what the handle would have returned is freed instead.

Handles and the watcher reach completion only through
:class:`CompletionPort`; nothing here imports the runtime facade.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ._backends._base import Backend, DeviceError
from ._errors import FerryError, RuntimeClosedError, TransferFailedError, TransferSubmitError
from ._retire import RetirementQueue
from ._state import ABANDONED, CLOSED, IN_FLIGHT, OWNED

if TYPE_CHECKING:
    from ._lifecycle import Health
    from ._memory._device import DeviceMemory
    from ._memory._pinned import PinnedPool
    from ._pending import _Pending
    from ._waiting import TransferFuture, Watcher

__all__: list[str] = []


class Record:
    """What one submitted transfer holds until its completion is proven.

    ``moved`` objects are in flight; ``leased`` device arrays are read-leased;
    ``result`` is what ``wait()`` returns. The pinned routes need nothing
    else; everything the other routes add lives in ``extra``.
    """

    __slots__ = ("done", "error", "event", "extra", "leased", "moved", "nbytes", "result", "seq", "stream")

    def __init__(
        self,
        seq: int,
        event: Any,
        stream: Any,
        moved: tuple[Any, ...],
        leased: tuple[Any, ...],
        result: tuple[Any, ...],
        nbytes: int,
    ) -> None:
        self.seq = seq
        self.event = event
        self.stream = stream
        self.moved = moved
        self.leased = leased
        self.result = result
        self.nbytes = nbytes
        self.done = False
        self.error: DeviceError | None = None
        self.extra: Extras | None = None

    def __repr__(self) -> str:
        status = "failed" if self.error else "done" if self.done else "pending"
        return f"<transfer record #{self.seq} {self.nbytes} bytes {status}>"


class Job(Protocol):
    """A transfer whose completion worker threads prove (staged routes): no event of its own."""

    error: DeviceError | None

    def is_done(self) -> bool:
        """Whether every part of the job finished (its DMAs complete). Never blocks."""
        ...

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds passed; return whether it is done."""
        ...


class Extras:
    """What the routes beyond the pinned one add to a record.

    ``finish`` publishes on success (a download's copy-out from pinned
    memory). ``cleanups`` run once when the record leaves flight, with
    ``failed`` telling how: a route gives pool blocks back (or abandons them),
    restores the caller's array flags, ends registration uses, releases
    consumed DLPack capsules. ``job`` is a staged job whose workers prove
    completion (the record then has no event). ``batch``/``shared``: see
    :class:`Batch`. ``handed`` is the destination an upload handed off before
    completing.
    """

    __slots__ = ("batch", "cleanups", "finish", "handed", "job", "shared", "stream_events")

    def __init__(self) -> None:
        self.finish: Callable[[], None] | None = None
        self.cleanups: list[Callable[[bool], None]] = []
        self.job: Job | None = None
        self.batch: Batch | None = None
        self.shared: SharedEvent | None = None
        self.handed: Any = None
        self.stream_events: Callable[[], list[tuple[Any, Any]]] | None = None  # a job's (stream, event) ends


class SharedEvent:
    """One event recorded for several records; back to the pool after the last one."""

    __slots__ = ("done", "event", "users")

    def __init__(self, event: Any, users: int) -> None:
        self.event = event
        self.users = users
        self.done = False  # proven complete once: the other records need not ask again


class Batch:
    """Transfers submitted inside ``with rt.batch():`` on one thread.

    Their copies are enqueued at once, but no per-transfer event is recorded:
    each copy stream's records wait in a *segment*, and one event is recorded
    for the whole segment when the block exits, or earlier when one of its
    records is polled or waited (the segment is then closed and later
    submissions start a new one). A shared event proves completion of every
    copy enqueued before it on that stream, which is all its records.
    """

    __slots__ = ("depth", "segments")

    def __init__(self) -> None:
        self.segments: dict[int, tuple[Any, list[Record]]] = {}
        self.depth = 0


def failed_error(record: Record) -> TransferFailedError:
    """The error ``is_ready``/``wait`` raise for a failed record."""
    return TransferFailedError(
        f"the transfer of {record.nbytes} bytes failed on the device ({record.error}); "
        "nothing was published and its buffers are abandoned"
    )


class CompletionPort(Protocol):
    """The narrow interface handles talk to: poll, wait, detach, watch, hand off."""

    def poll(self, record: Record) -> bool:
        """Whether the record's copy completed; raises ``TransferFailedError``. Never blocks."""
        ...

    def wait(self, record: Record) -> tuple[Any, ...]:
        """Block until complete, settle, return the record's result (once)."""
        ...

    def detach(self, record: Record) -> None:
        """A handle was dropped unwaited: retire its record. Never blocks."""
        ...

    def watch(self, handle: _Pending[Any]) -> TransferFuture:
        """A future the watcher resolves with ``handle``'s result."""
        ...

    def hand_off(self, handle: _Pending[Any], stream: Any) -> Any:
        """Give an upload's destination to GPU work before the copy is known complete."""
        ...

    def owns(self, record: Record) -> bool:
        """Whether ``record`` belongs to this completion (for leak counters)."""
        ...


def _held_bytes(obj: Any) -> int:
    block = getattr(obj, "_block", None)
    if block is not None:
        return int(block.capacity)
    return int(obj._nbytes)


class Completion:
    """A runtime's completion engine; see the module docstring.

    Every method that says "lock held" expects the runtime's lock, which is
    also :attr:`lock`.
    """

    def __init__(
        self,
        backend: Backend,
        health: Health,
        lock: threading.RLock,
        memory: DeviceMemory,
        pool: PinnedPool,
        retirement_capacity: int,
    ) -> None:
        self.backend = backend
        self.health = health
        self.lock = lock
        self.memory = memory
        self.pool = pool
        self.retiring = RetirementQueue(retirement_capacity)
        self.events: list[Any] = []
        self.event_count = 0
        self.live: set[Record] = set()
        self.abandoned: list[Record] = []
        self.abandoned_objects = 0
        self.abandoned_bytes = 0
        self.batches: dict[int, Batch] = {}  # thread ident -> open batch
        self.cross_returns: list[tuple[Any, Any]] = []  # (lock, array): leases to end in other runtimes
        self.watcher: Watcher | None = None
        self.seq = 0
        self.submitted = 0
        self.completed = 0
        self.failed = 0

    # -- events ------------------------------------------------------------------------------
    def new_event(self) -> Any:
        """A new event from the backend (counted)."""
        event = self.backend.event_create()
        self.event_count += 1
        return event

    def take_event(self) -> Any:
        """An event from the pool (or a new one). Lock held."""
        return self.events.pop() if self.events else self.new_event()

    def _new_event_for_submit(self) -> Any:
        try:
            return self.new_event()
        except DeviceError as exc:
            self.health.note(exc)
            raise TransferSubmitError(f"could not create an event: {exc}") from exc

    # -- enqueueing ----------------------------------------------------------------------------
    def enqueue(
        self,
        stream: Any,
        copy: Callable[[int, int, int, Any, Any], None],
        dst: int,
        src: int,
        nbytes: int,
        moved: tuple[Any, ...],
        leased: tuple[Any, ...],
        result: tuple[Any, ...],
    ) -> Record:
        """Enqueue one copy and its event; the caller holds the lock and moves states after.

        ``copy`` is the backend's ``htod_record`` or ``dtoh_record`` (or one of
        the same shape). Raises :class:`~ferry.TransferSubmitError` with nothing
        enqueued, or :class:`~ferry.TransferFailedError` when the copy was
        queued but can be neither tracked nor proven complete (its objects are
        then abandoned).
        """
        if self.batches:
            batch = self.batches.get(threading.get_ident())
            if batch is not None:
                return self._enqueue_batched(batch, stream, copy, dst, src, nbytes, moved, leased, result)
        events = self.events
        event = events.pop() if events else self._new_event_for_submit()
        self.seq += 1
        record = Record(self.seq, event, stream, moved, leased, result, nbytes)
        try:
            copy(dst, src, nbytes, stream, event)
        except DeviceError as exc:
            self.health.note(exc)
            if not exc.enqueued:
                events.append(event)
                raise TransferSubmitError(f"the device refused the copy: {exc}") from exc
            # The copy is queued but cannot be tracked: prove it finished, or abandon.
            try:
                self.backend.stream_synchronize(stream)
            except DeviceError as sync_exc:
                self.health.note(sync_exc)
                self.fail(record, sync_exc)
                raise TransferFailedError(
                    f"the copy was queued but could not be tracked ({exc}); its objects are abandoned"
                ) from sync_exc
            raise TransferSubmitError(f"could not record the copy's event: {exc}") from exc
        self.submitted += 1
        self.live.add(record)
        return record

    def _enqueue_batched(
        self,
        batch: Batch,
        stream: Any,
        copy: Callable[[int, int, int, Any, Any], None],
        dst: int,
        src: int,
        nbytes: int,
        moved: tuple[Any, ...],
        leased: tuple[Any, ...],
        result: tuple[Any, ...],
    ) -> Record:
        try:
            copy(dst, src, nbytes, stream, None)  # no event of its own: the batch records one
        except DeviceError as exc:
            self.health.note(exc)
            raise TransferSubmitError(f"the device refused the copy: {exc}") from exc
        self.seq += 1
        record = Record(self.seq, None, stream, moved, leased, result, nbytes)
        record.extra = Extras()
        record.extra.batch = batch
        batch.segments.setdefault(id(stream), (stream, []))[1].append(record)
        self.submitted += 1
        self.live.add(record)
        return record

    def job_record(
        self, job: Job, key: Any, moved: tuple[Any, ...], leased: tuple[Any, ...], result: tuple[Any, ...],
        nbytes: int, extra: Extras | None,
    ) -> Record:
        """A record whose completion a worker job proves (no event); ``key`` stands for its stream.

        Lock held.
        """
        self.seq += 1
        record = Record(self.seq, None, key, moved, leased, result, nbytes)
        record.extra = extra if extra is not None else Extras()
        record.extra.job = job
        self.submitted += 1
        self.live.add(record)
        return record

    def extras(self, record: Record) -> Extras:
        """The record's extras, created when missing."""
        if record.extra is None:
            record.extra = Extras()
        return record.extra

    # -- batches -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """See :meth:`ferry.Runtime.batch`."""
        ident = threading.get_ident()
        with self.lock:
            batch = self.batches.get(ident)
            if batch is None:
                batch = self.batches[ident] = Batch()
            batch.depth += 1
        try:
            yield
        finally:
            with self.lock:
                batch.depth -= 1
                if batch.depth == 0:
                    del self.batches[ident]
                    for key in list(batch.segments):
                        self._flush_segment(batch, key)

    def _flush_segment(self, batch: Batch, key: int) -> None:
        """Record the shared event of one stream's open segment. Lock held."""
        entry = batch.segments.pop(key, None)
        if entry is None:
            return
        stream, records = entry
        records = [r for r in records if r.error is None]
        if not records:
            return
        try:
            event = self.take_event()
            self.backend.event_record(event, stream)
        except DeviceError as exc:
            self.health.note(exc)
            for record in records:
                self.fail(record, exc)
            return
        shared = SharedEvent(event, len(records))
        for record in records:
            record.event = event
            assert record.extra is not None
            record.extra.batch = None
            record.extra.shared = shared

    def flush_for(self, record: Record) -> None:
        """Make sure a batched record has its shared event recorded."""
        with self.lock:
            extra = record.extra
            if extra is not None and extra.batch is not None:
                self._flush_segment(extra.batch, id(record.stream))

    # -- polling and waiting (CompletionPort) ------------------------------------------------------
    def owns(self, record: Record) -> bool:
        """Whether ``record`` is live here."""
        return record in self.live

    def poll(self, record: Record) -> bool:
        """Whether the record's copy completed. Never blocks; raises ``TransferFailedError``."""
        with self.lock:
            if record.error is not None:
                raise failed_error(record)
            if record.done:
                return True
            self.health.check_open()
            try:
                ready = self.query(record)
            except DeviceError as exc:
                self.health.note(exc)
                self.fail(record, exc)
                raise failed_error(record) from exc
            if ready:
                record.done = True
            return ready

    def wait(self, record: Record) -> tuple[Any, ...]:
        """Block until the copy completed, settle the record, return its result (once)."""
        if record.error is None and self.health.refusal is None:  # the common case
            if not record.done:
                try:
                    if record.extra is None:
                        self.backend.event_synchronize(record.event)
                    else:
                        self.block(record)
                except DeviceError as exc:
                    with self.lock:
                        self.health.note(exc)
                        self.fail(record, exc)
                    raise failed_error(record) from exc
            with self.lock:
                if record.error is None and record in self.live:
                    self.live.remove(record)
                    record.done = True
                    self.settle(record)
                    result = record.result
                else:
                    result = None
            if result is not None:
                if self.cross_returns:
                    self.flush_cross()
                return result
        return self._wait_slow(record)

    def _wait_slow(self, record: Record) -> tuple[Any, ...]:
        if record.error is not None:
            raise failed_error(record)
        self.health.check_open()
        if not record.done:
            try:
                self.block(record)
            except DeviceError as exc:
                with self.lock:
                    self.health.note(exc)
                    self.fail(record, exc)
                raise failed_error(record) from exc
        with self.lock:
            if record.error is not None:
                raise failed_error(record)
            if record not in self.live:
                if self.health.closed:
                    raise RuntimeClosedError("the runtime was closed while this transfer was pending")
                raise FerryError("this transfer was already waited; a handle is waited at most once")
            record.done = True
            self.live.discard(record)
            self.settle(record)
        if self.cross_returns:
            self.flush_cross()
        return record.result

    def query(self, record: Record) -> bool:
        """Whether the record's copy completed. Never blocks; raises DeviceError."""
        extra = record.extra
        if extra is not None:
            job = extra.job
            if job is not None:
                if not job.is_done():
                    return False
                if job.error is not None:
                    raise job.error
                return True
            if extra.batch is not None:
                self.flush_for(record)
            shared = extra.shared
            if shared is not None:
                if not shared.done:
                    shared.done = bool(self.backend.event_query(record.event))
                return shared.done
        return bool(self.backend.event_query(record.event))

    def block(self, record: Record) -> None:
        """Block until the record's copy completed; raises DeviceError."""
        extra = record.extra
        if extra is not None:
            job = extra.job
            if job is not None:
                job.wait_done()
                if job.error is not None:
                    raise job.error
                return
            if extra.batch is not None:
                self.flush_for(record)
            shared = extra.shared
            if shared is not None:
                if not shared.done:
                    self.backend.event_synchronize(record.event)
                    shared.done = True
                return
        self.backend.event_synchronize(record.event)

    # -- outcomes ----------------------------------------------------------------------------------
    def settle(self, record: Record) -> None:
        """A waited record: publish, run its cleanups, hand every object back owned. Lock held."""
        extra = record.extra
        if extra is None:
            self.events.append(record.event)
            record.event = None
        else:
            if extra.finish is not None:
                extra.finish()
            self._release_extras(record, failed=False)
            self._recycle_event(record)
        for obj in record.moved:
            obj._state = OWNED
        for array in record.leased:
            array._leases -= 1
        self.completed += 1

    def _recycle_event(self, record: Record) -> None:
        """The record's event back to the pool (a shared one after its last user)."""
        extra = record.extra
        if extra is not None and (extra.shared is not None or extra.batch is not None):
            shared = extra.shared
            extra.shared = None
            if shared is not None:
                shared.users -= 1
                if shared.users == 0:
                    self.events.append(shared.event)
        elif record.event is not None:
            self.events.append(record.event)
        record.event = None

    def fail(self, record: Record, exc: DeviceError) -> None:
        """The device reported a failure: abandon every object, keep the record forever. Lock held."""
        if record.error is not None:
            return
        record.error = exc
        self.live.discard(record)
        self.failed += 1
        self.abandoned.append(record)
        if record.extra is not None:
            self._release_extras(record, failed=True)
        for obj in record.moved + record.leased:
            self.abandon(obj)

    def abandon(self, obj: Any) -> None:
        """Mark one object abandoned forever (counted once). Lock held."""
        if obj._state is not ABANDONED:
            obj._state = ABANDONED
            self.abandoned_objects += 1
            self.abandoned_bytes += _held_bytes(obj)

    def _release_extras(self, record: Record, *, failed: bool) -> None:
        extra = record.extra
        assert extra is not None
        cleanups, extra.cleanups = extra.cleanups, []
        for cleanup in cleanups:
            cleanup(failed)
        handed = extra.handed
        if handed is not None:
            extra.handed = None
            if handed._ready is record:
                handed._ready = None
            if failed:  # its bytes never arrived, or partly
                self.abandon(handed)

    def flush_cross(self) -> None:
        """End read leases this runtime's settled copies hold in other runtimes, under their locks."""
        while self.cross_returns:
            try:
                lock, array = self.cross_returns.pop()
            except IndexError:
                return
            with lock:
                array._leases -= 1

    # -- hand-off and futures -----------------------------------------------------------------------
    def hand_off(self, handle: _Pending[Any], stream: Any) -> Any:
        """See :meth:`ferry.PendingUpload.hand_off`."""
        from ._device_array import DeviceArray
        from ._interop._cai import stream_handle_of

        with self.lock:
            self.health.check_open()
            record = handle._record
            if handle._claimed or handle._waited:
                raise FerryError("this upload was already waited: its destination is yours")
            if record.error is not None:
                raise failed_error(record)
            if record not in self.live:
                raise FerryError("this upload is no longer pending")
            extra = record.extra
            if extra is not None and extra.batch is not None:
                self._flush_segment(extra.batch, id(record.stream))
            ends = self.ends(record)
            destination = record.result[1]
            if stream is not None and not record.done:
                try:
                    target = self.backend.stream_from_handle(stream_handle_of(stream))
                    for _, event in ends:
                        self.backend.stream_wait_event(target, event)
                except DeviceError as exc:
                    self.health.note(exc)
                    raise FerryError(f"could not make the stream wait for the upload: {exc}") from exc
            if isinstance(destination, DeviceArray) and destination._state is IN_FLIGHT:
                destination._state = OWNED
                destination._ready = record
                record.moved = tuple(o for o in record.moved if o is not destination)
                self.extras(record).handed = destination
            return destination

    def ends(self, record: Record) -> list[tuple[Any, Any]]:
        """``(stream, event)`` pairs whose completion proves the record's copy complete. Lock held."""
        extra = record.extra
        if extra is not None and extra.job is not None:
            if extra.stream_events is None:
                raise FerryError(
                    "this staged upload cannot be handed off (its route has no device-side completion); "
                    "wait() for it"
                )
            return extra.stream_events()
        return [(record.stream, record.event)]

    def watch(self, handle: _Pending[Any]) -> TransferFuture:
        """A future for ``handle``, resolved by the watcher (created on first use)."""
        from ._waiting import TransferFuture, Watcher

        self.health.check_open()
        with self.lock:
            if self.watcher is None:
                self.watcher = Watcher(self)
            watcher = self.watcher
        future = TransferFuture(handle)
        record = handle._record
        if record.error is not None or record.done:
            future._resolve()
        else:
            watcher.watch(record, future)
        return future

    # -- retirement ------------------------------------------------------------------------------------
    def detach(self, record: Record) -> None:
        """A handle was dropped unwaited: its record goes to the retirement queue.

        Called from ``__del__``: appends and returns, never blocks, never calls
        the device.
        """
        health = self.health
        if health.forked or health.closed or record.error is not None:
            return
        self.live.discard(record)
        self.retiring.push(record)

    def _retired_done(self, record: Record) -> bool:
        if record.done or record.error is not None:
            return True
        try:
            ready = self.query(record)
        except DeviceError as exc:
            self.health.note(exc)
            self.fail(record, exc)
            return True
        record.done = ready
        return ready

    def release_retired(self, record: Record) -> None:
        """A dropped handle's copy is complete: free what it owned, end its leases. Lock held."""
        if record.error is not None:
            return  # abandoned: kept forever in the ledger
        if record.extra is not None:
            self._release_extras(record, failed=False)
        for obj in record.moved:
            self._close_owned(obj)
        for array in record.leased:
            array._leases -= 1
        self._recycle_event(record)
        self.completed += 1

    def _close_owned(self, obj: Any) -> None:
        if hasattr(obj, "_block"):  # a pinned buffer: back to the pool once its views die
            obj._state = OWNED
            obj._release_for_close()
        elif obj._state is not CLOSED:
            obj._state = CLOSED
            self.memory.release(obj._ptr, obj._nbytes)

    def maintenance_due(self) -> bool:
        """The cheap test every submission makes before :meth:`maintain`. Lock held."""
        retiring = self.retiring
        return bool(retiring._count or retiring._incoming or self.memory.deferred or self.pool._doomed)

    def maintain(self) -> None:
        """Deferred frees, retirement drain and backpressure, pool collection. Lock held."""
        self.memory.free_deferred()
        queue = self.retiring
        if len(queue):
            queue.drain(self._retired_done, self.release_retired)
            while queue.full():
                oldest = queue.oldest()
                if oldest is None:
                    break
                try:
                    self.block(oldest)
                    oldest.done = True
                except DeviceError as exc:
                    self.health.note(exc)
                    self.fail(oldest, exc)
                queue.drain(self._retired_done, self.release_retired)
        self.pool.collect()

    # -- closing -----------------------------------------------------------------------------------------
    def wait_everything(self) -> None:
        """Block until every live and retiring copy completed (or failed). Lock not held."""
        with self.lock:
            pending = [r for r in list(self.live) + self.retiring.records() if not r.done]
        for record in pending:  # outside the lock: a waiter must not stop submitters elsewhere
            if record.error is not None:
                continue
            try:
                self.block(record)
                record.done = True
            except DeviceError as exc:
                with self.lock:
                    self.health.note(exc)
                    self.fail(record, exc)
        if self.watcher is not None:  # resolves the futures of what was watched, then stops
            self.watcher.close()

    def close(self) -> None:
        """Release every live and retiring record (all complete by now). Lock held."""
        for record in list(self.live):
            if record.error is None:
                self.release_retired(record)
        self.live.clear()
        for record in self.retiring.records():
            self.release_retired(record)
        self.retiring.clear()

    def destroy_events(self) -> None:
        """Destroy the pooled events (the device is idle). Lock held."""
        if self.health.device_usable:
            for event in self.events:
                with contextlib.suppress(DeviceError):
                    self.backend.event_destroy(event)
        self.events.clear()
