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

Waiting, bounded and interruptible. A wait never sits in a driver call that
Python cannot leave: it first asks the record's event (one query, ~1 us),
then *spins* on it for about as long as the copy should take (50 us plus
0.1 ms per MiB, at most 10 ms, once per record: the time
``cuEventSynchronize``'s default spin would burn anyway, so a copy that
completes on time is noticed as soon as it is today), and then *sleeps* on
the record's :class:`~ferry._records.Signal`, which the runtime's watcher sets
once the device says the copy is done (its thread sleeps on a blocking-sync
event: no CPU). The sleep is a lock wait in slices of 50 ms, so a timeout is
honoured and a ``KeyboardInterrupt`` reaches the main thread at once. A staged
job is waited through ``job.wait_done(timeout)`` in the same slices. A wait
that times out or is interrupted changes nothing: the record stays live, its
handle can be waited, polled or dropped.

Who settles. A record is *settled* once (``settled``): by the first
``wait()``, or by the watcher for a future. ``claimed`` marks the one
``wait()`` that returned it. ``waiters`` counts the ``wait()`` calls and
unresolved futures attending the record; :meth:`Completion.close` settles a
live record that has waiters (they return its result) and releases one that
has none (a later ``wait()`` raises ``RuntimeClosedError``).

Handles reach completion only through :class:`CompletionPort`, the watcher
through the protocol ``_watcher.py`` states; nothing here imports the handles
or the runtime facade. The records themselves are ``_records.py``'s.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from . import _lifecycle, _native
from ._args import timeout_arg
from ._backends._base import Backend, DeviceError
from ._device_array import DeviceArray
from ._errors import FerryError, RuntimeClosedError, TransferFailedError, TransferSubmitError
from ._interop._cai import stream_handle_of
from ._records import Batch, Job, Run, Segment, SharedEvent, Signal, failed_error, new_record
from ._records import Extras as Extras  # noqa: PLC0414  (re-exported: the routes import it from here)
from ._records import Record as Record  # noqa: PLC0414
from ._retire import RetirementQueue
from ._state import ABANDONED, CLOSED, IN_FLIGHT, OWNED
from ._watcher import Handle, TransferFuture, Watcher, on_watcher_thread

if TYPE_CHECKING:
    from ._lifecycle import Health
    from ._memory._device import DeviceMemory
    from ._memory._pinned import PinnedPool

__all__: list[str] = []

_engine = _native.load()
_H = TypeVar("_H")  # a handle type

SPIN_BASE = 50e-6  # s: what any copy may take on an idle link before a wait stops spinning
SPIN_PER_BYTE = 1e-10  # s/byte (10 GB/s): a fifth of PCIe Gen5, so a copy that runs on time ends in the spin
SPIN_CAP = 10e-3  # s: the most one record is ever spun on; past it a wait sleeps
SLICE = 0.05  # s: sleeping waits wake this often (a signal delivered to another thread is seen)
# Past its spin a wait naps: it asks whether the record is resolved again after a pause that grows
# with the time napped on the record (NAP_SHARE of it, NAP_FIRST to NAP_MAX), for NAP_WINDOW over
# all the waits on the record; then it sleeps on the record's signal, which the watcher sets (a
# blocking-sync wake-up and a thread hop: 0.1 - 0.6 ms after the copy on the H200 VM). So a copy
# queued behind device work is noticed within ~1/16 of the time waited for it (at least the OS's
# timer slack, ~50 us), for 60 - 80 asks of a few microseconds each.
NAP_FIRST = 20e-6  # s
NAP_SHARE = 1 / 16
NAP_MAX = 250e-6  # s
NAP_WINDOW = 10e-3  # s
SEGMENT_COPIES = 256  # a batch segment goes to the device once it holds this many copies (the GPU starts early)


MANY_LEAVES = 16  # from this many objects a record's bookkeeping is one compiled call (mark_leaves)


def _give_back(moved: tuple[Any, ...], leased: tuple[Any, ...]) -> None:
    """A settled record's objects: the moved ones owned again, the leased ones' leases ended. A tree's
    thousands of device arrays in one compiled call where the extension runs (it checks that every item is
    an exact DeviceArray first: TypeError, nothing changed, and the loop does it)."""
    if _engine is not None and len(moved) >= MANY_LEAVES:
        try:
            _engine.mark_leaves(moved, OWNED, 0)
            moved = ()
        except TypeError:
            pass
    if _engine is not None and len(leased) >= MANY_LEAVES:
        try:
            _engine.mark_leaves(leased, None, -1)
            leased = ()
        except TypeError:
            pass
    for obj in moved:
        obj._state = OWNED
    for array in leased:
        array._leases -= 1


def spin_budget(nbytes: int) -> float:
    """How long a wait spins on a record of ``nbytes`` before it sleeps."""
    return min(SPIN_CAP, SPIN_BASE + nbytes * SPIN_PER_BYTE)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Counts:
    """A completion's counters (the compiled ``Fast`` has the same three, read and written in C)."""

    __slots__ = ("completed", "seq", "submitted")

    def __init__(self) -> None:
        self.seq = 0  # the last record's sequence number
        self.submitted = 0
        self.completed = 0  # settled or retired


class CompletionPort(Protocol):
    """The narrow interface handles and waiters talk to: poll, wait, detach, watch, hand off."""

    def poll(self, record: Record) -> bool:
        """Whether the record's copy completed; raises ``TransferFailedError``. Never blocks."""
        ...

    def wait(self, record: Record, timeout: float | None = None) -> tuple[Any, ...]:
        """Block until complete (or ``TimeoutError``), settle, return the record's result (once)."""
        ...

    def ready(self, record: Record, timeout: float | None = None, spin: bool = True) -> bool:
        """Block until the copy completed or failed, or ``timeout`` passed; settle nothing."""
        ...

    def attend(self, record: Record, delta: int) -> None:
        """A waiter starts (``+1``) or stops (``-1``) attending the record (see ``close``)."""
        ...

    def listen(self, record: Record, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the copy completed or failed (on the watcher's thread, or at once)."""
        ...

    def unlisten(self, record: Record, fn: Callable[[], object]) -> None:
        """Forget a listener that has not been called yet."""
        ...

    def settled_result(self, record: Record) -> tuple[Any, ...]:
        """Settle a completed record (if no one did) and return its result, without claiming it."""
        ...

    def detach(self, record: Record) -> None:
        """A handle was dropped unwaited: retire its record. Never blocks."""
        ...

    def watch(self, handle: Handle) -> TransferFuture:
        """A new future the watcher resolves with ``handle``'s result."""
        ...

    def hand_off(self, handle: Handle, stream: Any) -> Any:
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
        self.failed = 0
        self.counts: Counts = Counts()  # seq, submitted, completed: the compiled Fast's where it runs
        self.submit: Callable[..., Record] = self.enqueue  # the pinned routes' enqueue (positional)
        self.segment_copies = SEGMENT_COPIES  # a full batch segment: fixed here, read by Fast too
        self.fast: Any = None  # the compiled Fast, where the extension runs
        if _engine is not None:
            # enqueue's and wait's common cases in one C call each; the rest comes back to the methods
            fast = _engine.Fast(self, DeviceError, OWNED, IN_FLIGHT, SPIN_BASE, SPIN_PER_BYTE, SPIN_CAP)
            self.counts = self.fast = fast
            self.submit = fast.enqueue
            self.submit_pinned = fast.pinned  # type: ignore[method-assign]
            self.wait = fast.wait  # type: ignore[method-assign]  # handles call port.wait(record, timeout)

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
        the same shape). The maintenance a submission owes runs first. Raises
        :class:`~ferry.TransferSubmitError` with nothing enqueued, or
        :class:`~ferry.TransferFailedError` when the copy was queued but can be
        neither tracked nor proven complete (its objects are then abandoned).
        """
        retiring = self.retiring
        if retiring._count or retiring._incoming or self.memory.deferred or self.pool._doomed:
            self.maintain()  # maintenance_due(), inline: this is every pinned submission's path
        if self.batches:
            batch = self.batches.get(threading.get_ident())
            if batch is not None:
                return self._enqueue_batched(batch, stream, copy, dst, src, nbytes, moved, leased, result)
        events = self.events
        event = events.pop() if events else self._new_event_for_submit()
        counts = self.counts
        counts.seq += 1
        record = new_record(counts.seq, event, stream, moved, leased, result, nbytes)
        try:
            copy(dst, src, nbytes, stream, event)
        except DeviceError as exc:
            self.copy_failed(record, exc)
        counts.submitted += 1
        self.live.add(record)
        return record

    def submit_pinned(
        self, handle_type: Callable[[Completion, Record], _H], stream: Any,
        copy: Callable[[int, int, int, Any, Any], None], dst: int, src: int, nbytes: int, host: Any, device: Any,
        upload: bool,
    ) -> _H:
        """A checked pinned submission (lock held): enqueue, move the states, return ``handle_type(self, record)``.

        The host buffer goes in flight; the device array too for an upload,
        read-leased for a download. ``Fast.pinned`` where the extension runs.
        """
        moved: tuple[Any, ...]
        if upload:
            moved = result = (host, device)
            leased: tuple[Any, ...] = ()
        else:
            moved, leased, result = (host,), (device,), (device, host)
        record = self.submit(stream, copy, dst, src, nbytes, moved, leased, result)
        host._state = IN_FLIGHT
        if upload:
            device._state = IN_FLIGHT
        else:
            device._leases += 1
        return handle_type(self, record)

    def copy_failed(self, record: Record, exc: DeviceError) -> None:
        """The copy of a new record raised ``exc``; always raises. Lock held.

        Not enqueued: the event goes back, :class:`~ferry.TransferSubmitError`.
        Enqueued but not recorded: the stream is synchronized (then the event,
        which may be what the driver refused, is destroyed rather than pooled,
        and ``TransferSubmitError``), or, if that fails too, the record fails
        and :class:`~ferry.TransferFailedError` says its objects are abandoned.
        """
        self.health.note(exc)
        if not exc.enqueued:
            self.events.append(record.event)
            raise TransferSubmitError(f"the device refused the copy: {exc}") from exc
        # The copy is queued but cannot be tracked: prove it finished, or abandon.
        try:
            try:
                self.backend.stream_synchronize(record.stream)
            except MemoryError:  # the call itself found no memory (the copy may still run): once more
                self.backend.stream_synchronize(record.stream)
        except DeviceError as sync_exc:
            self.health.note(sync_exc)
            self.fail(record, sync_exc)
            raise TransferFailedError(
                f"the copy was queued but could not be tracked ({exc}); its objects are abandoned"
            ) from sync_exc
        event, record.event = record.event, None  # its record was refused: maybe a bad event; never reused
        with contextlib.suppress(DeviceError):
            self.backend.event_destroy(event)
        raise TransferSubmitError(f"could not record the copy's event: {exc}") from exc

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
        # nothing is enqueued yet: the segment's copies go to the device together when it is flushed
        counts = self.counts
        counts.seq += 1
        record = new_record(counts.seq, None, stream, moved, leased, result, nbytes)
        segment = batch.segments.get(id(stream))
        if segment is not None and len(segment.records) >= self.segment_copies:
            # a full segment goes to the device now; this record starts the next one (never flushed in
            # its own submission: its submitter has not moved its objects' states yet)
            self._flush_segment(batch, segment.key)
            segment = None
        if segment is None:
            segment = batch.segments[id(stream)] = Segment(batch, stream)
        record.batch = segment
        segment.records.append(record)
        if nbytes:  # nothing to copy: the shared event alone proves it
            run = segment.last
            if run is None or (run.copy is not copy and run.copy != copy) or dst in run.seen:
                run = segment.new_run(copy)
            run.seen.add(dst)
            run.dsts.append(dst)
            run.srcs.append(src)
            run.sizes.append(nbytes)
        counts.submitted += 1
        self.live.add(record)
        return record

    def job_record(
        self, job: Job, key: Any, moved: tuple[Any, ...], leased: tuple[Any, ...], result: tuple[Any, ...],
        nbytes: int, extra: Extras | None,
    ) -> Record:
        """A record whose completion a worker job proves (no event); ``key`` stands for its stream.

        Lock held.
        """
        counts = self.counts
        counts.seq += 1
        record = new_record(counts.seq, None, key, moved, leased, result, nbytes)
        record.extra = extra if extra is not None else Extras()
        record.extra.job = job
        counts.submitted += 1
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
        """Enqueue one stream's open segment and record its shared event. Lock held.

        A device error (or anything raised meanwhile, re-raised after) fails
        every record of the segment: its copies may have been queued in part,
        and nothing they touch is ever reused.
        """
        segment = batch.segments.pop(key, None)
        if segment is None:
            return
        for record in segment.records:
            record.batch = None
        records = [r for r in segment.records if r.error is None]
        if not records:
            return
        event = None
        try:
            event = self.take_event()
            self._enqueue_runs(segment.stream, segment.runs, event)
        except BaseException as exc:
            error = exc if isinstance(exc, DeviceError) else DeviceError(f"the batch was not submitted: {exc!r}")
            self.health.note(error)
            if event is not None:
                self.events.append(event)  # never recorded: reusable
            for record in records:
                self.fail(record, error)
            if error is not exc:
                raise
            return
        shared = SharedEvent(event, len(records))
        for record in records:
            record.event = event
            record.shared = shared

    def _enqueue_runs(self, stream: Any, runs: list[Run], event: Any) -> None:
        """A segment's copies in order: a run of host<->device copies as one device batch
        (``Backend.copy_batch``), another kind one call each; ``event`` recorded after the last."""
        backend = self.backend
        up, down = backend.htod_record, backend.dtoh_record
        last = len(runs) - 1
        for i, run in enumerate(runs):
            tail = event if i == last else None
            copy = run.copy
            upload = copy == up
            if upload or copy == down:
                backend.copy_batch(upload, run.dsts, run.srcs, run.sizes, stream, tail)
                continue
            final = len(run.dsts) - 1  # a peer or device-to-device copy: on its own
            for j, (dst, src, nbytes) in enumerate(zip(run.dsts, run.srcs, run.sizes, strict=True)):
                copy(dst, src, nbytes, stream, tail if j == final else None)
        if not runs:
            backend.event_record(event, stream)

    def flush_for(self, record: Record) -> None:
        """Make sure a batched record's segment is enqueued and its shared event recorded."""
        with self.lock:
            segment = record.batch
            if segment is not None:
                self._flush_segment(segment.batch, segment.key)

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
            health = self.health
            if health.poisoned is not None and not (health.forked or health.exited or health.closed):
                self._prove_or_fail(record)
                if record.error is not None:
                    raise failed_error(record)
                return True
            health.check_open()
            try:
                ready = self.query(record)
            except DeviceError as exc:
                self.health.note(exc)
                self.fail(record, exc)
                raise failed_error(record) from exc
            if ready:
                self.mark_done(record)
            return ready

    def wait(self, record: Record, timeout: float | None = None) -> tuple[Any, ...]:
        """Block until the copy completed, settle the record, return its result (once).

        ``TimeoutError`` after ``timeout`` seconds, and any exception a signal
        handler raises meanwhile, leave the record as it was (but for its time napped).
        """
        if timeout is not None:
            timeout_arg(timeout)  # ValueError for a negative or NaN one, before anything changes
        record.waiters += 1  # no eval-breaker check between the load and the store: atomic under the GIL
        try:
            shared = record.shared
            if shared is not None and shared.done:
                record.done = True  # a batch-mate proved the shared event (anyone asleep: the watcher wakes)
            if not record.done and record.error is None and self.health.refusal is not None:
                if not self.health.device_usable:
                    self.ready(record, 0)  # a poisoned device: proven now, or failed with its error
            elif not record.done and record.error is None:
                event = record.event
                extra = record.extra
                if (
                    timeout is None and (extra is None or extra.own_event) and event is not None
                    and not record.spun
                ):
                    # the common case, inline: a pinned copy's own event, no bound (see ready()); a
                    # small copy completes within SPIN_BASE, so the rest of its budget is reckoned later
                    try:
                        ready = self.backend.event_wait(event, SPIN_BASE) or self.backend.event_wait(
                            event, spin_budget(record.nbytes) - SPIN_BASE)
                    except DeviceError as exc:
                        self._failed(record, exc)
                        ready = True
                    if ready:
                        record.done = True  # anyone asleep on it is woken by the watcher
                        if shared is not None and record.error is None:
                            shared.done = True  # its batch-mates need not ask again
                    else:
                        record.spun = True
                        self._sleep(record, None)
                elif not self.ready(record, timeout):
                    raise TimeoutError(
                        f"the transfer of {record.nbytes} bytes did not complete within {timeout} s; it is "
                        "still pending: wait() again, poll is_ready(), or drop the handle (it retires once "
                        "complete)"
                    )
            lock = self.lock
            lock.acquire()  # not ``with``: this is every wait's path (the statement costs twice the calls)
            try:
                if record.done and not record.settled and record.error is None and record in self.live:
                    self.live.remove(record)  # the common case, inline
                    if record.extra is None and record.shared is None:  # settle(), inline: a pinned copy
                        record.settled = True
                        self.events.append(record.event)
                        record.event = None
                        for obj in record.moved:
                            obj._state = OWNED
                        for array in record.leased:
                            array._leases -= 1
                        self.counts.completed += 1
                    else:
                        self.settle(record)
                    record.claimed = True
                    result = record.result
                else:
                    result = self._claim(record)
            finally:
                lock.release()
        finally:
            record.waiters -= 1
        if self.cross_returns:
            self.flush_cross()
        return result

    def _claim(self, record: Record) -> tuple[Any, ...]:
        """What ``wait()`` returns or raises once the record is done (or cannot be waited). Lock held."""
        if record.error is not None:
            raise failed_error(record)
        if record.claimed:
            raise FerryError("this transfer was already waited; a handle is waited at most once")
        self._settle_done(record)
        record.claimed = True
        return record.result

    def _settle_done(self, record: Record) -> None:
        """Settle a done record that no one settled yet; raise if it cannot be. Lock held."""
        if record.settled:
            return
        if self.health.closed:
            raise RuntimeClosedError("the runtime was closed while this transfer was pending")
        self.health.check_open()
        if record not in self.live or not record.done:
            raise FerryError("this transfer is no longer pending")
        self.live.remove(record)
        self.settle(record)

    def settled_result(self, record: Record) -> tuple[Any, ...]:
        """Settle a completed record if no one did, return its result; ``claimed`` stays as it is."""
        with self.lock:
            if record.error is not None:
                raise failed_error(record)
            self._settle_done(record)
            result = record.result
        if self.cross_returns:
            self.flush_cross()
        return result

    def attend(self, record: Record, delta: int) -> None:
        """See :class:`CompletionPort`."""
        with self.lock:
            record.waiters += delta

    def ready(self, record: Record, timeout: float | None = None, spin: bool = True) -> bool:
        """Block until the copy completed or failed, or ``timeout`` seconds passed. Lock not held.

        Settles nothing: it proves the outcome (``done``, or the failure
        recorded). With ``spin``, a record not spun on before is first spun on
        for its :func:`spin_budget` (never longer than ``timeout``); then the
        wait naps and sleeps on the record's signal (:meth:`_sleep`).
        ``timeout=0`` is a poll.
        """
        if record.done or record.error is not None:
            return True
        health = self.health
        if health.refusal is not None and not health.device_usable:
            # a poisoned device answers at once; a forked child or an exited runtime is never asked
            if not (health.forked or health.exited):
                with self.lock:
                    self._prove_or_fail(record)
            return True
        if timeout is not None and math.isnan(timeout):
            raise ValueError("timeout must be a number of seconds (or None), not NaN")
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        extra = record.extra
        if extra is not None and (extra.job is not None or extra.progress is not None):
            resolved = self._ready_extra(record, extra, deadline)
            if resolved is not None:
                return resolved
        if spin and not record.spun:
            budget = spin_budget(record.nbytes)
            seconds = budget if timeout is None or timeout >= budget else max(timeout, 0.0)
            if self._spin(record, seconds):
                return True
            if seconds >= budget:
                record.spun = True
        elif timeout is not None and timeout <= 0:
            return self._spin(record, 0.0)
        return self._sleep(record, deadline)

    def _sleep(self, record: Record, deadline: float | None) -> bool:
        """Nap on the record while it has nap time left (``NAP_WINDOW``), then sleep on its signal (in
        slices), until it is resolved or ``deadline`` passed.

        A deadline already passed (a poll, or a timeout spent spinning) answers from the signal if the
        record has one, else False: the watcher is not asked to sleep on a record no one waits for.
        """
        if on_watcher_thread() or _lifecycle.exiting():
            # a done-callback waits (the watcher cannot wake itself), or the interpreter exits (no thread
            # may start, so no watcher): nap on
            return self._nap(record, deadline, math.inf) is True
        if deadline is not None and time.monotonic() >= deadline:
            signal = record.signal
            return signal is not None and signal.flag.is_set()
        napped = self._nap(record, deadline)
        return napped if napped is not None else self._sleep_on_signal(record, deadline)

    def _sleep_on_signal(self, record: Record, deadline: float | None) -> bool:
        """Sleep on the record's signal (in slices) until it is set or ``deadline`` passed. Making the
        signal takes the lock, which another thread may hold long (a submission held back until the
        oldest copy completes): with a deadline, not past it."""
        if deadline is None or record.signal is not None:
            flag = self.signal(record).flag
        else:
            lock = self.lock
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                flag = self.signal(record).flag
            finally:
                lock.release()
        while True:
            remaining = _remaining(deadline)
            if remaining is None:
                if flag.wait(SLICE):
                    return True
            elif flag.wait(min(remaining, SLICE)):
                return True
            elif remaining <= SLICE:
                return flag.is_set()

    def _nap(self, record: Record, deadline: float | None, window: float | None = None) -> bool | None:
        """Ask whether the record is resolved (as :meth:`prove`, under the lock) between pauses
        growing with its time napped (see ``NAP_SHARE``), until ``window`` (``NAP_WINDOW``, read at
        the call) is spent over all the waits on it: whether it is resolved (False: ``deadline``
        passed first), or ``None`` when its window is spent.

        An ask waits for the lock at most ``NAP_MAX`` (and never past ``deadline``): a thread that
        holds it longer (a submission held back until the oldest copy completes) skips the ask, so
        a wait's timeout holds."""
        if window is None:
            window = NAP_WINDOW
        clock = time.monotonic
        start = clock()
        before = record.napped  # earlier waits' naps on it count: a loop of short waits naps once
        lock = self.lock
        try:
            while True:
                now = clock()
                bound = NAP_MAX if deadline is None else max(0.0, min(NAP_MAX, deadline - now))
                if lock.acquire(timeout=bound):
                    try:
                        if self._prove_locked(record):
                            return True
                    finally:
                        lock.release()
                now = clock()
                napped = before + now - start
                if napped >= window:
                    return None
                pause = min(NAP_MAX, max(NAP_FIRST, napped * NAP_SHARE))
                if deadline is not None:
                    if now >= deadline:
                        return False
                    pause = min(pause, deadline - now)
                time.sleep(pause)
        finally:
            record.napped += clock() - start  # (another wait on it may have added its own meanwhile)

    def _spin(self, record: Record, seconds: float) -> bool:
        """Wait up to ``seconds`` on the record's event (backend ``event_wait``); whether it is resolved."""
        if record.batch is not None:
            self.flush_for(record)
        shared = record.shared
        if shared is not None and shared.done:
            self.mark_done(record)
            return True
        event = record.event
        if event is None:  # settled, released or failed meanwhile (its event went back to the pool)
            return record.done or record.error is not None
        try:
            ready = self.backend.event_wait(event, seconds)
        except DeviceError as exc:
            self._failed(record, exc)
            return True
        if ready:
            if shared is not None:
                shared.done = True
            self.mark_done(record)
        return ready

    def _ready_extra(self, record: Record, extra: Extras, deadline: float | None) -> bool | None:
        """A job's wait, or a segmented download's copy out of its landed parts (then ``None``: the
        record's own event is waited next)."""
        if extra.job is not None:
            return self._ready_job(record, extra.job, deadline)
        if extra.progress is not None:
            try:
                extra.progress(deadline)
            except DeviceError as exc:
                self._failed(record, exc)
                return True
        return None

    def _ready_job(self, record: Record, job: Job, deadline: float | None) -> bool:
        while True:
            remaining = _remaining(deadline)
            if job.wait_done(SLICE if remaining is None else min(remaining, SLICE)):
                break
            if remaining is not None and remaining <= SLICE:
                return False
        self._job_outcome(record, job)
        return True

    def _job_outcome(self, record: Record, job: Job) -> None:
        if job.error is not None:
            self._failed(record, job.error)
        else:
            self.mark_done(record)

    def _failed(self, record: Record, exc: DeviceError) -> None:
        with self.lock:
            self.health.note(exc)
            self.fail(record, exc)

    def mark_done(self, record: Record) -> None:
        """The record's copy is proven complete: wake whoever sleeps on it."""
        record.done = True
        signal = record.signal
        if signal is not None:
            signal.flag.set()

    def prove(self, record: Record) -> bool:
        """Ask, without blocking, whether the record is resolved (done or failed); record which."""
        with self.lock:
            return self._prove_locked(record)

    def _prove_or_fail(self, record: Record) -> None:
        """On a poisoned device, which completes nothing more: prove the record now, or fail it with the
        device's error (its buffers abandoned, so that a lane still touching them touches memory kept
        forever). Lock held."""
        poisoned = self.health.poisoned
        if not self._prove_locked(record) and poisoned is not None:
            self.fail(record, poisoned)

    def _prove_locked(self, record: Record) -> bool:
        if record.done or record.error is not None:
            return True
        try:
            ready = self.query(record)
        except DeviceError as exc:
            self.health.note(exc)
            self.fail(record, exc)
            return True
        if ready:
            self.mark_done(record)
        return ready

    def signal(self, record: Record) -> Signal:
        """The record's completion signal, handed to the watcher when it is created."""
        signal = record.signal
        if signal is not None:
            return signal
        with self.lock:
            signal = record.signal
            if signal is None:
                signal = Signal()
                if record.done or record.error is not None or not self.health.device_usable:
                    signal.fire()
                else:
                    if self.watcher is None:
                        self.watcher = Watcher(self)
                    self.watcher.watch(record)
                record.signal = signal
        return signal

    def listen(self, record: Record, fn: Callable[[], object]) -> None:
        """See :class:`CompletionPort`."""
        self.health.check_open()
        self.signal(record).listen(fn)

    def unlisten(self, record: Record, fn: Callable[[], object]) -> None:
        """See :class:`CompletionPort`."""
        signal = record.signal
        if signal is not None:
            signal.unlisten(fn)

    def query(self, record: Record) -> bool:
        """Whether the record's copy completed. Never blocks; raises DeviceError."""
        extra = record.extra
        if extra is not None:
            job = extra.job
            if job is not None:
                if not job.is_done():
                    return False
                if job.error is not None:
                    raise job.error.fresh()
                return True
            if extra.progress is not None:
                extra.progress(0.0)  # a poll: the parts that landed, and a part's failure
        if record.batch is not None:
            self.flush_for(record)
            if record.error is not None:  # the device refused the segment
                raise record.error.fresh()
        shared = record.shared
        if shared is not None:
            if not shared.done:
                shared.done = bool(self.backend.event_query(record.event))
            return shared.done
        if record.event is None:  # settled or released: proven before its event went back
            return record.done
        return bool(self.backend.event_query(record.event))

    def block_locked(self, record: Record) -> None:
        """Wait for a record with the lock held (backpressure): no watcher, which needs the lock.

        Spins for the record's budget, then polls with a back-off up to 1 ms;
        interruptible between polls.
        """
        extra = record.extra
        job = extra.job if extra is not None else None
        pause, seconds = 50e-6, spin_budget(record.nbytes)
        while not (record.done or record.error is not None):
            if job is not None:
                if job.wait_done(SLICE):
                    self._job_outcome(record, job)
            elif not self._spin(record, seconds):
                seconds = 0.0
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)

    # -- outcomes ----------------------------------------------------------------------------------
    def settle(self, record: Record) -> None:
        """A waited record: publish, run its cleanups, hand every object back owned. Lock held.

        The caller has taken it out of ``live``; runs once per record. A publication that raises (a download's
        copy-out) leaves it unsettled, as the compiled settle does.
        """
        extra = record.extra
        if extra is None:
            record.settled = True
            shared = record.shared
            if shared is None:
                self.events.append(record.event)
            else:  # a batched copy: the shared event goes back after its last user
                record.shared = None
                shared.users -= 1
                if shared.users == 0:
                    self.events.append(shared.event)
            record.event = None
        elif extra.own_event and extra.handed is None:  # a small-route slot: one call
            if extra.finish is not None:
                extra.finish()
            record.settled = True
            extra.release(False)
            self.events.append(record.event)
            record.event = None
        else:
            if extra.finish is not None:
                extra.finish()
            record.settled = True
            self._release_extras(record, failed=False)
            self._recycle_event(record)
        _give_back(record.moved, record.leased)
        self.counts.completed += 1

    def _recycle_event(self, record: Record) -> None:
        """The record's event back to the pool (a shared one after its last user)."""
        shared = record.shared
        if shared is not None:
            record.shared = None
            shared.users -= 1
            if shared.users == 0:
                self.events.append(shared.event)
        elif record.event is not None:
            self.events.append(record.event)
        record.event = None

    def fail(self, record: Record, exc: DeviceError) -> None:
        """The device reported a failure: abandon every object, keep the record forever. Lock held.

        A record proven complete never fails (an error seen through an event
        already recycled to a later transfer is not this record's).
        """
        if record.error is not None or record.done:
            return
        # kept forever in the ledger: a copy without the traceback, whose frames would keep the
        # failed handle (and whatever else they reference) alive
        record.error = DeviceError(str(exc), code=exc.code, sticky=exc.sticky, enqueued=exc.enqueued)
        signal = record.signal
        if signal is not None:
            signal.flag.set()
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
    def hand_off(self, handle: Handle, stream: Any) -> Any:
        """See :meth:`ferry.PendingUpload.hand_off`."""
        extra = handle._record.extra
        if extra is not None and extra.ready_to_order is not None and not handle._record.done:
            extra.ready_to_order()  # a staged upload's host copies: waited for outside the lock
        with self.lock:
            self.health.check_open()
            record = handle._record
            if handle._claimed or handle._waited:
                raise FerryError("this upload was already waited: its destination is yours")
            if record.error is not None:
                raise failed_error(record)
            if record not in self.live:
                raise FerryError("this upload is no longer pending")
            segment = record.batch
            if segment is not None:
                self._flush_segment(segment.batch, segment.key)
            extra = record.extra
            if extra is not None and extra.job is not None and extra.order_after is None:
                raise FerryError(
                    "this upload cannot be handed off before it completes (file transfers, and staged "
                    "uploads on the pure-Python staging engine, are not); wait() for it"
                )
            destination = record.result[1]
            if not record.done and extra is not None and extra.job is not None and extra.export_stream is not None:
                try:  # the stream an export names (CUDA Array Interface) must wait for every chunk
                    self.order_after(record, extra.export_stream)
                except DeviceError as exc:
                    self.health.note(exc)
                    raise FerryError(f"could not order the export stream after the upload: {exc}") from exc
            if stream is not None and not record.done:
                try:
                    self.order_after(record, self.backend.stream_from_handle(stream_handle_of(stream)))
                except DeviceError as exc:
                    self.health.note(exc)
                    raise FerryError(f"could not make the stream wait for the upload: {exc}") from exc
            if (
                isinstance(destination, DeviceArray) and destination._state is IN_FLIGHT
                and any(o is destination for o in record.moved)  # a second hand_off: already handed
            ):
                destination._state = OWNED
                destination._ready = record
                record.moved = tuple(o for o in record.moved if o is not destination)
                self.extras(record).handed = destination
            if stream is not None and isinstance(destination, DeviceArray):
                destination._memory.note_stream(destination._ptr, stream)  # its free waits for that stream's work
            return destination

    def order_after(self, record: Record, stream: Any) -> None:
        """Make ``stream`` (a backend stream) wait on the device for the record's copy; no host wait
        (a staged job on CUDA: only until the native engine's lanes enqueued their last DMAs).

        Lock held; raises DeviceError, or FerryError for a staged job of the
        pure-Python engine.
        """
        extra = record.extra
        if extra is not None and extra.job is not None:
            if extra.order_after is None:
                raise FerryError("this staged transfer (pure-Python engine) cannot order a stream; wait() for it")
            extra.order_after(stream)
        elif record.event is not None:
            self.backend.stream_wait_event(stream, record.event)

    def watch(self, handle: Handle) -> TransferFuture:
        """A new future for ``handle``, resolved by the watcher (created on first use).

        The future attends the record (``waiters``) until it is resolved or
        cancelled; its resolution settles the record and sets its result.
        """
        self.health.check_open()
        record = handle._record
        with self.lock:
            if record.claimed:
                raise FerryError("this transfer was already waited; there is nothing left to wait for")
            record.waiters += 1
        future = TransferFuture(handle)
        self.signal(record).listen(future._resolve)
        return future

    # -- retirement ------------------------------------------------------------------------------------
    def detach(self, record: Record) -> None:
        """A handle was dropped unwaited: its record goes to the retirement queue.

        Called from ``__del__``: appends and returns, never blocks, never calls
        the device.
        """
        health = self.health
        if health.forked or health.closed or health.exited or record.error is not None or record.settled:
            return
        self.live.discard(record)
        self.retiring.push(record)

    def _retired_done(self, record: Record) -> bool:
        if record.batch is not None and not (record.done or record.error is not None):
            return False  # not even enqueued: its batch flushes it (a full queue's wait does too)
        return self._prove_locked(record)

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
        self.counts.completed += 1

    def _close_owned(self, obj: Any) -> None:
        if hasattr(obj, "_block"):  # a pinned buffer: back to the pool once its views die
            obj._state = OWNED
            obj._release_for_close()
        elif obj._state is not CLOSED:
            obj._state = CLOSED
            obj._memory.release(obj._ptr, obj._nbytes)  # its own memory: the runtime's, or a slab's

    def maintenance_due(self) -> bool:
        """The cheap test every submission makes before :meth:`maintain`. Lock held."""
        retiring = self.retiring
        return bool(retiring._count or retiring._incoming or self.memory.deferred or self.pool._doomed)

    def maintain_if_due(self) -> None:
        """:meth:`maintain` where :meth:`maintenance_due` says so (the hottest paths test inline). Lock held."""
        if self.maintenance_due():
            self.maintain()

    def maintain(self) -> None:
        """Deferred frees, retirement drain and backpressure, pool collection. Lock held."""
        memory = self.memory
        if memory.deferred:
            memory.free_deferred()
        queue = self.retiring
        if queue._count or queue._incoming:
            queue.drain(self._retired_done, self.release_retired)
            while queue.full():
                oldest = queue.oldest()
                if oldest is None:
                    break
                self.block_locked(oldest)
                queue.drain(self._retired_done, self.release_retired)
        pool = self.pool
        if pool._doomed:
            pool.collect()

    # -- closing -----------------------------------------------------------------------------------------
    def unresolved(self) -> list[Record]:
        """Live and retiring records not yet proven complete or failed. Lock held."""
        return [r for r in (*self.live, *self.retiring.records()) if not r.done and r.error is None]

    def wait_everything(self, deadline: float | None, lock: Callable[[], Any]) -> None:
        """Block until every live and retiring copy is resolved, or raise ``TimeoutError``. Lock not held.

        ``lock()`` is a context manager taking the lock by the deadline. Only
        the first record waited is spun on; the rest sleep on their signals.
        """
        spin = True
        while True:
            with lock():
                pending = self.unresolved()
            if not pending:
                return
            for record in pending:
                if not self.ready(record, _remaining(deadline), spin=spin):
                    with lock():
                        left = self.unresolved()
                    raise TimeoutError(
                        f"{len(left)} transfer(s) of {sum(r.nbytes for r in left)} bytes still in flight"
                    )
                spin = False

    def all_resolved(self) -> bool:
        """Whether every live and retiring record is resolved, asking without blocking. Lock held."""
        return all(self._retired_done(r) for r in (*self.live, *self.retiring.records()))

    def close(self) -> None:
        """Commit a close (every record is resolved by now). Lock held.

        A live record that a ``wait()`` or a future attends is settled (its
        waiters return the result); every other live or retiring record is
        released. Every sleeping waiter is woken.
        """
        for record in list(self.live):
            if record.error is None:
                if record.waiters > 0 and not record.settled:
                    self.settle(record)
                else:
                    self.release_retired(record)
        self.live.clear()
        for record in self.retiring.records():
            self.release_retired(record)
        self.retiring.clear()

    def stop_watcher(self) -> None:
        """Resolve the futures of what was watched, then stop the watcher. Lock not held."""
        if self.watcher is not None:
            self.watcher.close()

    def destroy_events(self) -> None:
        """Destroy the pooled events (the device is idle). Lock held."""
        if self.health.device_usable:
            for event in self.events:
                with contextlib.suppress(DeviceError):
                    self.backend.event_destroy(event)
        self.events.clear()
