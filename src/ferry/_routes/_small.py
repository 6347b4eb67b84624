"""The small route: a small C-contiguous NumPy array through a ring of pinned slots, with little Python.

For a payload of a few bytes to 64 KiB the copy itself costs next to
nothing; what a pageable transfer costs is bookkeeping. The direct route
(``_direct.py``) builds a request, takes a pool block, plans chunks, makes
closures; this route skips all of that for the common case and costs about
what the pinned route does:

* Each direction keeps a *ring* of pinned slots of :data:`SLOT_BYTES`, taken
  from the pinned pool on first use (one more whenever every slot is busy, up
  to :data:`MAX_SLOTS`) and kept until the runtime closes.
* Upload: one host copy of the array into a free slot (``copy_in``, compiled
  where the extension is built), then the pinned path's own enqueue (copy and
  event record: one compiled call on CUDA). Download: the enqueue into the
  slot; ``wait()`` copies the slot out into the array before anything is
  published (``memcopy``).
* While a transfer uses it, the slot *is* its record's extras (a subclass of
  :class:`~ferry._completion.Extras` with everything set once): no object is
  made per transfer but the record, and ``wait()`` takes the inline path of a
  pinned copy (the record is proven by its own event). Leaving flight, the
  slot goes back to its ring, or, if the copy failed, is abandoned (never
  reused, counted in ``abandoned_bytes``).

The contract is the pageable one, unchanged: while pending, the caller's array
is flagged read-only (the same lease table as the other host routes, so an
array in flight on two routes is restored once both are done); a failed
download publishes nothing.

The route is taken only when all of this holds, checked in one expression:
no batch is open, the array is a ``numpy.ndarray`` of the device array's
shape and dtype, C-contiguous (writable for a download), at most one slot
(and ``StagingConfig.direct_bytes``), the device array is this runtime's,
owned and not handed off, no registration is active, and a slot is free or
the ring may grow. A missing destination is allocated once all of that is
known, in the same lock acquisition as the copy (the array's own shape and
dtype need none of ``Runtime.empty``'s argument checks), a missing output
made with ``numpy.empty``. Everything else (foreign arrays, strided arrays,
batches, registered memory, larger payloads) takes the full path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._backends._base import DeviceError
from .._completion import Extras
from .._device_array import DeviceArray, new_device_array
from .._errors import TransferSubmitError
from .._native import host_copies
from .._native.objects import SlotFields
from .._state import IN_FLIGHT, OWNED

if TYPE_CHECKING:
    from .._completion import Completion, Record
    from .._memory._pinned import Block, PinnedPool
    from .._memory._register import Registrations
    from ._base import HostLeases

__all__: list[str] = []

SLOT_BYTES = 64 << 10
"""The largest payload the small route carries (and its slots' size)."""
MAX_SLOTS = 64
"""Slots per direction at most (4 MiB of pinned memory); past it transfers take the full path."""


class Slot(Extras, SlotFields):
    """One pinned slot of a ring; while a transfer uses it, that record's extras.

    ``finish`` (a download's copy-out) and ``cleanups`` are set once; the
    fields of one use are ``record``, ``host`` (the caller's array),
    ``address`` (a download's output) and ``nbytes``.
    """

    __slots__ = ()  # the fields are SlotFields' (address, block, capacity, host, nbytes, own, ptr, record, ring)

    own_event = True

    def __init__(self, ring: Ring, block: Block) -> None:
        super().__init__()
        self.ring = ring
        self.block = block
        self.ptr = block.ptr
        self.capacity = min(block.capacity, ring.limit)
        self.record: Record | None = None
        self.host: Any = None
        self.address = 0
        self.nbytes = 0
        self.own: list[Callable[[bool], None]] = [self.release]  # every use's cleanups (completion swaps them out)
        if not ring.upload:
            self.finish = self.copy_out

    def copy_out(self) -> None:
        """Publish a completed download: the slot's bytes into the caller's array."""
        ring = self.ring
        ring.memcopy(self.address, self.ptr, self.nbytes)
        ring.host_copied += self.nbytes

    def release(self, failed: bool) -> None:
        """The transfer left flight: restore the array's flag; back to the ring, or abandoned."""
        ring = self.ring
        ring.give(self.host)
        self.host = None
        record = self.record
        if record is not None:
            record.extra = None  # the slot is not that record's any more
            self.record = None
        if failed:  # the device may still touch it: never reused, never freed
            ring.count -= 1
            ring.completion.abandoned_bytes += self.block.capacity
        else:
            ring.free.append(self)


class Ring:
    """One direction's slots."""

    def __init__(self, route: SmallRoute, upload: bool, limit: int) -> None:
        self.upload = upload
        self.limit = limit
        self.completion = route.completion
        self.give = route.leases.give
        self.memcopy = route.memcopy
        self.pool = route.pool
        self.free: list[Slot] = []
        self.count = 0  # slots made and not abandoned
        self.transfers = 0  # transfers this ring carried
        self.host_copied = 0

    def take(self) -> Slot | None:
        """A free slot, or a new one while the ring may grow, else ``None``. Lock held."""
        free = self.free
        return free.pop() if free else self.grow()

    def grow(self) -> Slot | None:
        """A new slot while the ring may grow, else ``None`` (the caller found none free). Lock held."""
        if self.count >= MAX_SLOTS or self.limit <= 0:
            return None
        try:
            block = self.pool.acquire(SLOT_BYTES)
        except (DeviceError, MemoryError, ValueError):
            return None  # the full path asks again and names the problem
        slot = Slot(self, block)
        self.count += 1
        return slot

    def lost(self, slot: Slot, exc: BaseException) -> None:
        """The enqueue of a transfer through ``slot`` raised ``exc``: the slot back, or abandoned
        where the copy may have been queued (its objects are abandoned too)."""
        if isinstance(exc, TransferSubmitError):
            self.free.append(slot)  # nothing was enqueued
        else:
            self.count -= 1
            self.completion.abandoned_bytes += slot.block.capacity

    @property
    def held_bytes(self) -> int:
        """Pinned bytes the ring's slots hold (abandoned ones excluded)."""
        return self.count * SLOT_BYTES


class SmallRoute:
    """The rings of both directions and the two submissions."""

    def __init__(
        self, completion: Completion, pool: PinnedPool, leases: HostLeases, registrations: Registrations,
        streams: tuple[Any, Any], direct_bytes: int,
    ) -> None:
        self.completion = completion
        self.lock: threading.RLock = completion.lock
        self.pool = pool
        self.leases = leases
        self.registrations = registrations
        self.h2d, self.d2h = streams
        self.copy_in, self.address_of, self.memcopy = host_copies()
        backend = completion.backend
        self.htod, self.dtoh = backend.htod_record, backend.dtoh_record
        limit = min(SLOT_BYTES, direct_bytes)
        self.up = Ring(self, True, limit)
        self.down = Ring(self, False, limit)

    def upload(self, owner: Any, source: Any, destination: Any) -> Record | None:
        """Submit ``source`` -> ``destination`` on this route, or ``None`` (nothing done): take the full path.

        ``destination=None`` allocates one from the device pool, under the
        same lock acquisition as the copy (closed again if the route is not
        taken after all). Raises
        :class:`~ferry.TransferSubmitError` (nothing enqueued, nothing
        changed) when the device refuses the copy.
        """
        if destination is None:
            return self._upload_new(owner, source)
        completion = self.completion
        lock = self.lock
        lock.acquire()  # not ``with``: on the hot path the statement costs twice the two calls
        try:
            if not (
                type(source) is np.ndarray
                and type(destination) is DeviceArray
                and completion.health.refusal is None
                and not completion.batches
                and destination._runtime is owner
                and destination._state is OWNED
                and not destination._leases
                and destination._ready is None
                and not self.registrations.active
                and source.shape == destination._shape
                and (source.dtype is destination._dtype or source.dtype == destination._dtype)
            ):
                return None
            slot = self.up.take()
            if slot is None:
                return None
            return self._enqueue_up(source, destination, slot)
        finally:
            lock.release()

    def _enqueue_up(self, source: Any, destination: DeviceArray, slot: Slot) -> Record | None:
        """The checked upload through ``slot``: host copy, enqueue, states (``None``: the slot is back,
        nothing changed). Lock held."""
        ring = self.up
        nbytes = self.copy_in(slot.ptr, slot.capacity, source, destination._nbytes)  # same shape and dtype
        if nbytes < 0:  # not C-contiguous, or larger than a slot
            ring.free.append(slot)
            return None
        try:  # the pinned path's own enqueue (it runs the maintenance a submission owes first)
            record = self.completion.submit(
                self.h2d, self.htod, destination._ptr, slot.ptr, nbytes, (destination,), (), (source, destination)
            )
        except BaseException as exc:
            ring.lost(slot, exc)
            raise
        record.extra = slot
        slot.record = record
        slot.nbytes = nbytes
        slot.cleanups = slot.own
        slot.host = source
        self.leases.take(source)
        destination._state = IN_FLIGHT
        ring.transfers += 1
        ring.host_copied += nbytes
        return record

    def _upload_new(self, owner: Any, source: Any) -> Record | None:
        """An upload into a new device array, allocated here once the array qualifies: one lock, no
        argument checks a NumPy array's own shape and dtype already passed (``Runtime.empty``'s)."""
        dtype = getattr(source, "dtype", None)
        if not (
            type(source) is np.ndarray and dtype is not None and not dtype.hasobject and dtype.itemsize
            and source.nbytes <= self.up.limit and source.flags.c_contiguous
        ):
            return None
        completion = self.completion
        if completion.batches or self.registrations.active:
            return None  # the full path takes it (and allocates the destination itself)
        lock = self.lock
        lock.acquire()
        try:
            if completion.health.refusal is not None:
                return None  # the full path raises the refusal
            slot = self.up.take()
            if slot is None:
                return None
            memory = completion.memory
            nbytes = int(source.nbytes)
            try:
                if completion.maintenance_due():
                    completion.maintain()
                ptr = memory.alloc(nbytes)  # MemoryError, or FerryError, as Runtime.empty raises them
            except BaseException:
                self.up.free.append(slot)
                raise
            created = new_device_array(owner, memory, ptr, source.shape, dtype, nbytes)
            try:
                record = self._enqueue_up(source, created, slot)
            except BaseException:
                created.close()
                raise
            if record is None:
                created.close()
            return record
        finally:
            lock.release()

    def new_destination(self, owner: Any, source: Any) -> DeviceArray | None:
        """A fresh destination for a small upload of ``source`` from the device pool, or ``None`` when
        the array does not qualify for this route (the full path then allocates). The compiled upload's."""
        dtype = getattr(source, "dtype", None)
        if not (
            type(source) is np.ndarray and dtype is not None and not dtype.hasobject and dtype.itemsize
            and source.nbytes <= self.up.limit and source.flags.c_contiguous
        ):
            return None
        completion = self.completion
        if completion.batches or self.registrations.active or not self.up.free:
            return None
        lock = self.lock
        lock.acquire()
        try:
            if completion.health.refusal is not None:
                return None  # the full path raises the refusal
            memory = completion.memory
            nbytes = int(source.nbytes)
            if completion.maintenance_due():
                completion.maintain()
            ptr = memory.alloc(nbytes)  # MemoryError, or FerryError, as Runtime.empty raises them
            return new_device_array(owner, memory, ptr, source.shape, dtype, nbytes)
        finally:
            lock.release()

    def download(self, owner: Any, source: Any, out: Any) -> Record | None:
        """Submit ``source`` -> ``out`` on this route, or ``None`` (nothing done): take the full path.

        ``out=None`` makes a new array (``numpy.empty``, as the full path does at these sizes).
        """
        if out is None:
            if type(source) is not DeviceArray or source._nbytes > self.down.limit:
                return None
            out = np.empty(source._shape, source._dtype)
        completion = self.completion
        lock = self.lock
        lock.acquire()
        try:
            if not (
                type(out) is np.ndarray
                and type(source) is DeviceArray
                and completion.health.refusal is None
                and not completion.batches
                and source._runtime is owner
                and source._state is OWNED
                and source._ready is None
                and not self.registrations.active
                and out.shape == source._shape
                and (out.dtype is source._dtype or out.dtype == source._dtype)
            ):
                return None
            ring = self.down
            slot = ring.take()
            if slot is None:
                return None
            address = self.address_of(out, slot.capacity, source._nbytes)  # same shape and dtype
            if not address:  # not C-contiguous, read-only (or pending), or larger than a slot
                ring.free.append(slot)
                return None
            nbytes = source._nbytes
            try:
                record = completion.submit(
                    self.d2h, self.dtoh, slot.ptr, source._ptr, nbytes, (), (source,), (source, out)
                )
            except BaseException as exc:
                ring.lost(slot, exc)
                raise
            record.extra = slot
            slot.record = record
            slot.nbytes = nbytes
            slot.cleanups = slot.own
            slot.host = out
            slot.address = address
            self.leases.take(out, True)
            source._leases += 1
            ring.transfers += 1
            return record
        finally:
            lock.release()

    # -- stats and lifetime ---------------------------------------------------------------------------
    @property
    def host_copied(self) -> int:
        """Bytes this route copied on the host (both directions)."""
        return self.up.host_copied + self.down.host_copied

    @property
    def held_bytes(self) -> int:
        """Pinned bytes both rings hold."""
        return self.up.held_bytes + self.down.held_bytes

    def counts(self) -> dict[str, int]:
        """Transfers each direction carried, and the slots each holds."""
        return {
            "small_uploads": self.up.transfers, "small_downloads": self.down.transfers,
            "small_upload_slots": self.up.count, "small_download_slots": self.down.count,
        }

    def close(self) -> None:
        """Give the free slots' blocks back to the pool (every transfer is resolved by now). Lock held."""
        for ring in (self.up, self.down):
            for slot in ring.free:
                self.pool.release(slot.block)
            ring.free.clear()
            ring.count = 0
