"""The upload of a batch that lies in a ring slot: its device arrays and its copies in one step.

A slot batch is the most regular upload there is: its leaves are views of one
registered mapping, at offsets that repeat for every batch of a layout, and
its destinations are fresh arrays no one else has seen. So what the general
group route works out per batch is worked out once per layout here
(:class:`SlotLayout`: the device slab's offsets and size, which leaves go as
one batched copy and which as one DMA each), and per slot (the leaves'
addresses); per batch, under the runtime's lock, one pool allocation makes
every destination (views of one slab, back to back), one registration lookup
covers the whole slot, and one record with one event covers every copy.

Nothing is skipped that could fail differently: the runtime is checked open,
the maintenance a submission owes runs first, a refused allocation or copy
frees the arrays made for the batch and raises, with nothing of the batch
enqueued. The record, its leases and its states are the group route's (as
``_routes._groups._enqueue`` makes them; its extras a :class:`SlotUse`, whose
one call ends them), so a slot batch completes, fails, is handed off and is
abandoned exactly as a pinned group does. The copy made for a device slab is
kept with the slot's views (the same slab gets the same calls), and so are
the extras of the slot's settled batches. A batch whose copies completed
before its turn is settled and claimed under one lock (:func:`take_if_done`).

Device memory is reused too (:class:`DeviceRing`): once the consumer dropped
every leaf of a batch, its slab is kept by the loader instead of being freed,
and a later batch of the same size is copied into it. The copy is ordered, on
the device, after the work of every stream the consumer used the leaves on
(an event recorded there, which the copy stream waits for): what a free would
have waited for, without the free, the allocation and the event the free
would have had the host ask about. Memory exported where no stream is known
is never reused (it is freed after the device idled, as always). The kept
slabs are counted as the runtime's device memory, are at most the batches
the consumer dropped since the last upload, and are freed when the loader's
workers stop or the runtime closes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._backends._base import DeviceError
from .._completion import Extras
from .._device_array import new_view
from .._errors import TransferSubmitError
from .._memory._slab import DeviceSlab, slab_layout
from .._pending import PendingUpload
from .._records import failed_error
from .._routes._groups import (
    SMALL_BYTES,
    _check_open,
    _mark,
    _unmade,
    batched_copy,
    handed_back,
    owned_again,
)
from .._state import OWNED

__all__: list[str] = []


class SlotLayout:
    """What every batch of one layout shares: the destinations' shapes and dtypes, their offsets in one
    device slab and its size, and which leaves travel as one batched copy (the small ones) or one DMA each."""

    __slots__ = ("big", "big_dst", "count", "dtypes", "nbytes", "offsets", "shapes", "sizes", "small", "small_dst",
                 "small_n", "total", "views")

    def __init__(self, specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
        self.shapes = [shape for shape, _ in specs]
        self.dtypes = [dtype for _, dtype in specs]
        self.offsets, self.sizes, self.total = slab_layout(specs)
        self.count = len(specs)
        self.nbytes = sum(self.sizes)
        self.small = [i for i, n in enumerate(self.sizes) if n < SMALL_BYTES]
        self.big = [i for i, n in enumerate(self.sizes) if n >= SMALL_BYTES]
        self.small_dst = [self.offsets[i] for i in self.small]  # offsets in the slab
        self.small_n = [self.sizes[i] for i in self.small]
        self.big_dst = [(self.offsets[i], self.sizes[i]) for i in self.big]
        self.views = list(zip(self.shapes, self.dtypes, self.offsets, self.sizes, strict=True))


_COPIES_KEPT = 16  # the copy plans a slot's views keep, one per device slab they were uploaded into


def upload_views(rt: Any, views: Any, ring: DeviceRing | None = None) -> Any:
    """Upload a slot batch into fresh device arrays; the group's handle.

    ``views`` are the slot's, made once per slot and layout (the loader's ``_SlotViews``): ``leaves``
    (every one non-empty, C-contiguous, inside the registered ring) and ``hosts`` (the same, a tuple),
    ``small_src`` and ``big_src`` (the addresses of ``layout.small``'s and ``layout.big``'s leaves),
    ``span`` (the slot's ``(address, size)``), ``layout``; it keeps the slot's registration between
    batches (``reg``: looked up again only once it was released), the copy made for each device slab it
    was uploaded into (``copies``: the same slab's copy is the same calls) and its spare extras
    (``spare``). ``ring``, when given, lends the device memory of a dropped batch and keeps this batch's
    once it is dropped. All or nothing: a refusal (the runtime closed, out of device memory, the ring no
    longer registered, the copy refused) closes the arrays made for it and raises, with nothing enqueued
    and the leaves untouched.

    The record is the group route's (``_routes._groups._enqueue``'s moved, leased and result objects,
    leases and registration use), with a :class:`SlotUse` as its extras: its copies are proven by its
    own event, and one call ends its leases and its registration use when it leaves flight.
    """
    parts = rt._parts
    routes = parts.host
    memory, completion = parts.memory, routes.completion
    stream = routes.h2d
    layout = views.layout
    with routes.lock:
        if rt._health.refusal is not None:
            _check_open(rt)  # raises
        retiring = completion.retiring  # (maintenance_due(), inline)
        if retiring._count or retiring._incoming or memory.deferred or completion.pool._doomed:
            completion.maintain()
        total = layout.total
        slab = ring.take(memory, total, stream) if ring is not None else None
        if slab is None:
            base = memory.alloc(total)
            slab = _KeptSlab(memory, base, total, layout.count, ring)
            try:
                devices = [new_view(rt, slab, base + offset, shape, dtype, nbytes)
                           for shape, dtype, offset, nbytes in layout.views]
            except BaseException:  # (no memory partway: the views made died, not the last)
                _unmade(slab)
                raise
            memory.arrays.add(slab)
            slab.adopt(devices)
        else:
            base = slab._ptr
            try:
                devices = [new_view(rt, slab, base + offset, shape, dtype, nbytes)
                           for shape, dtype, offset, nbytes in layout.views]
            except BaseException:  # back in its ring, lent to no one (the views made died unlent)
                slab.kept = True
                ring.kept.append(slab)  # type: ignore[union-attr]
                raise
            slab.lend(devices)
        try:
            reg = views.reg
            if reg is None or reg._released:
                registrations = routes.registrations
                span = views.span
                reg = registrations.covering(span[0], span[1]) if registrations.active else None
                if reg is None:  # the ring was unpinned meanwhile: refused cleanly
                    raise TransferSubmitError("the loader's ring is no longer registered")
                views.reg = reg
            copies = views.copies
            copy = copies.get(base)
            if copy is None:
                small_d = [base + offset for offset in layout.small_dst]
                large = [(base + offset, src, nbytes)
                         for (offset, nbytes), src in zip(layout.big_dst, views.big_src, strict=True)]
                copy = batched_copy(completion.backend, True, small_d, views.small_src, layout.small_n, large)
                if len(copies) >= _COPIES_KEPT:
                    copies.clear()
                copies[base] = copy
            devs = tuple(devices)
            hosts = views.hosts
            record = completion.submit(stream, copy, 0, 0, layout.nbytes, devs, (), (hosts, devs))
            # from here on nothing raises: the copies are queued (as _groups._enqueue)
            leases = routes.direct.leases
            spare = views.spare
            if record.batch is not None:  # inside rt.batch(): a shared event
                use: SlotUse = BatchedSlotUse(leases, hosts, reg, spare)
            elif spare:
                use = spare.pop()  # (released: every field as a new one's)
                use.hosts, use.reg = hosts, reg
                use.cleanups = use.own
            else:
                use = SlotUse(leases, hosts, reg, spare)
            use.record = record
            record.extra = use
            leases.take_many(hosts)
            reg._uses += 1
            _mark(devices, True)
            handle: Any = PendingUpload(completion, record)
        except BaseException:
            for device in devices:  # made for this batch, never handed out (an abandoned one stays so)
                if device._state is OWNED:
                    device.close()
            raise
    return handle


class SlotUse(Extras):
    """The extras of a slot batch's record: its leases and its registration use, ended in one call when it
    leaves flight, and the destinations a hand-off made owned again (ordered after the record: they forget it
    when it settles, and are abandoned if its copies failed).

    Its copies are proven by the record's own event (``own_event``: a wait spins on it inline and a settle
    is one :meth:`release`); a failure, a retirement and a close run :attr:`cleanups`, which is
    ``[self.release]``. Exactly what the group route's cleanups do (``_groups._enqueue``'s and
    ``handed_back``'s), without a closure per batch. Once released without a failure it is the record's no
    more and waits in its views' ``spare`` list for the slot's next batch (one that failed is not reused).
    """

    __slots__ = ("handed_views", "hosts", "leases", "own", "record", "reg", "spare")

    own_event = True

    def __init__(self, leases: Any, hosts: tuple[np.ndarray[Any, Any], ...], reg: Any, spare: list[SlotUse]) -> None:
        super().__init__()
        self.leases = leases
        self.hosts: tuple[np.ndarray[Any, Any], ...] | None = hosts
        self.reg = reg
        self.spare = spare
        self.record: Any = None
        self.handed_views: tuple[list[Any], Any, Any] | None = None  # (device arrays, the record, its completion)
        # every use's cleanups (a failure or a retirement swaps them out)
        self.own: list[Callable[[bool], None]] = [self.release]
        self.cleanups = self.own

    def release(self, failed: bool) -> None:
        """The record left flight (``failed``: its copies may have touched the leaves and the destinations
        only in part): the handed destinations forget it (abandoned if it failed); the leaves' leases and the
        registration use end, unless it failed (the device may still read them: read-only and in use). Once."""
        hosts = self.hosts
        if hosts is None:
            return
        self.hosts = None
        handed = self.handed_views
        if handed is not None:
            self.handed_views = None
            devices, record, completion = handed
            for device in devices:
                if device._ready is record:
                    device._ready = None
                if failed:  # its bytes never arrived, or partly
                    completion.abandon(device)
        if failed:
            return
        self.leases.give_many(hosts)
        self.reg._uses -= 1
        self.reg = None
        record, self.record = self.record, None
        if record is not None and record.extra is self:
            record.extra = None  # the use is not that record's any more
        if type(self) is SlotUse:
            self.spare.append(self)


class BatchedSlotUse(SlotUse):
    """A slot batch's extras for a record submitted inside ``rt.batch()`` (a shared event: settled the general
    way, which runs :attr:`cleanups`)."""

    __slots__ = ()

    own_event = False  # (never reused: made per record)


def hand_off_slot(completion: Any, handle: Any, stream: Any) -> tuple[Any, ...]:
    """Hand a slot batch's destinations to ``stream``: each is owned again, ordered after the copies.

    As the group route's hand-off, for destinations that are views of one slab: ``stream`` waits for the
    group's event on the device, every view still in flight becomes owned (its ``ready`` the group's
    record, forgotten when the record settles, abandoned if the copy failed), and the slab notes
    ``stream`` once (its free waits for the consumer's work on every view).
    """
    devices: tuple[Any, ...] = handle.hand_off(stream)  # flushes, checks, orders ``stream`` after it
    with completion.lock:
        record = handle._record
        use = record.extra
        if isinstance(use, SlotUse) and use.hosts is not None and record.moved is devices:
            handed = owned_again(record, devices)  # (handed_back, its forget done by the use's release)
            if handed:
                use.handed_views = (handed, record, completion)  # type: ignore[assignment]
        else:
            handed_back(completion, record, devices)
        if stream is not None and devices:
            first = devices[0]
            first._memory.note_stream(first._ptr, stream)  # the slab's: every view's free waits for it
    return devices


def take_if_done(completion: Any, handle: Any) -> tuple[Any, ...] | None:
    """A slot batch's destinations if its copies completed (never blocks), else None: ``handle.is_ready()``
    and then ``handle.wait()``, in one step under the lock where the record is a plain live one.

    As they do, it raises TransferFailedError if the device reported a failure (the group is abandoned),
    RuntimeClosedError if the runtime refuses calls, FerryError if the handle was already waited.
    """
    record = handle._record
    use = record.extra
    if not handle._claimed and type(use) is SlotUse and record.event is not None:
        with completion.lock:
            if (record.done or record.error is not None or record.settled or completion.health.refusal is not None
                    or record.extra is not use or use.handed_views is not None or record.leased
                    or record not in completion.live):
                result = None  # not the common case: the general way, below
            else:
                try:
                    ready = completion.backend.event_query(record.event)
                except DeviceError as exc:  # (as poll)
                    completion.health.note(exc)
                    completion.fail(record, exc)
                    raise failed_error(record) from exc
                if not ready:
                    return None
                record.done = True  # (mark_done: whoever sleeps on it is woken)
                signal = record.signal
                if signal is not None:
                    signal.flag.set()
                completion.live.remove(record)  # (as wait: settle and claim)
                record.settled = True  # (Completion.settle of an own_event record, inline)
                use.release(False)
                completion.events.append(record.event)
                record.event = None
                for device in record.moved:  # (_give_back: the destinations owned again; nothing is leased)
                    device._state = OWNED
                completion.counts.completed += 1
                record.claimed = True
                handle._waited = handle._claimed = True
                result = record.result
        if result is not None:
            if completion.cross_returns:
                completion.flush_cross()
            return result[1]  # type: ignore[no-any-return]
    if not handle.is_ready():
        return None
    return handle.wait()[1]  # type: ignore[no-any-return]


class DeviceRing:
    """Device slabs of dropped slot batches, kept for the next batches (see the module docstring)."""

    __slots__ = ("__weakref__", "closed", "kept")

    def __init__(self) -> None:
        self.kept: list[_KeptSlab] = []  # appended from finalizers too (a list append is atomic)
        self.closed = False

    @property
    def nbytes(self) -> int:
        """Device bytes kept for reuse now."""
        return sum(slab._nbytes for slab in list(self.kept) if slab.kept)

    def take(self, memory: Any, nbytes: int, stream: Any) -> _KeptSlab | None:
        """A kept slab of ``nbytes``, ``stream`` ordered after its consumers' work; None if there is none
        (a kept slab of another size, or one with unknown users, is freed as any dropped array is). Lock held."""
        kept = self.kept
        while kept:
            slab = kept.pop()
            if not slab.kept:  # the runtime closed it meanwhile
                continue
            users = memory.users.get(slab._ptr)
            slab.kept = False
            if slab._nbytes != nbytes or (users is not None and (users.unknown or (
                    users.streams and not _order_after(memory, users, stream)))):
                memory.release(slab._ptr, slab._nbytes)
                continue
            memory.users.pop(slab._ptr, None)
            return slab
        return None

    def close(self, memory: Any, lock: Any) -> None:
        """Free the kept slabs (after their consumers' work, as any free); later drops are freed. Idempotent."""
        self.closed = True
        with lock:
            while self.kept:
                slab = self.kept.pop()
                if slab.kept:
                    slab.kept = False
                    memory.release(slab._ptr, slab._nbytes)


def _order_after(memory: Any, users: Any, stream: Any) -> bool:
    """``stream`` waits, on the device, for the work of every stream in ``users``; False if the device
    refused (the slab is then freed instead, in order, and the batch takes fresh memory). Lock held."""
    if users is None or not users.streams:
        return True
    backend = memory.backend
    events = memory.events
    # CUDA with the compiled calls (its events are raw handles): the wait is one compiled call too
    wait_events = getattr(backend, "stream_wait_events", None)
    try:
        for handle in users.streams:
            event = events.pop() if events else backend.event_create()
            try:
                backend.event_record(event, backend.stream_from_handle(handle))
                if wait_events is not None and type(event) is int:
                    wait_events(stream, [event])
                else:
                    backend.stream_wait_event(stream, event)
            finally:
                events.append(event)  # the wait is queued: the event may be recorded again
    except DeviceError as exc:
        memory.health.note(exc)
        return False
    return True


class _KeptSlab(DeviceSlab):
    """A slot batch's slab: when its last view goes it returns to its :class:`DeviceRing`, if still open."""

    __slots__ = ("home", "kept")

    def __init__(self, memory: Any, ptr: int, nbytes: int, views: int, ring: DeviceRing | None) -> None:
        super().__init__(memory, ptr, nbytes, views)
        self.home = weakref.ref(ring) if ring is not None else None
        self.kept = False

    @property
    def _state(self) -> Any:
        if self.kept:
            return OWNED  # the runtime's close frees it
        return DeviceSlab._state.fget(self)  # type: ignore[attr-defined]

    def _release_for_close(self) -> None:
        self.kept = False
        super()._release_for_close()

    def lend(self, views: list[Any]) -> None:
        """Lent again, to ``views`` (every earlier one went): they are counted and remembered anew. Lock held."""
        self._live = list(range(len(views)))
        self._views = list(map(weakref.ref, views))

    def release(self, ptr: int, nbytes: int) -> None:
        self._gone(self.memory.release)

    def defer(self, ptr: int, nbytes: int) -> None:
        self._gone(self.memory.defer)  # (each view's finalizer makes this call)

    def _gone(self, free: Callable[[int, int], None]) -> None:
        """A view went: with the last one the slab is kept by its ring (no device call: a finalizer may get
        here), or given to ``free`` (the memory's release, or its defer from a finalizer)."""
        try:  # (_last inlined, as DeviceSlab's)
            if self._live.pop():
                return
        except IndexError:  # closed with the runtime meanwhile
            return
        home = self.home
        ring = home() if home is not None else None
        if ring is None or ring.closed:
            free(self._ptr, self._nbytes)
        else:
            self.kept = True
            ring.kept.append(self)
