"""The group route: leaves of a tree copied together, one record and one event for many leaves.

A tree transfer moves its ordinary leaves one by one (each a full
:meth:`ferry.Runtime.upload` or :meth:`ferry.Runtime.download`), but two kinds
of leaf need no per-leaf machinery at all:

- *pinned* leaves: the host array lies in registered memory or in a pooled
  pinned leaf (``download_tree(pinned=True)``). Every such leaf of a tree is
  one DMA straight from or into the array (the small ones as one batched
  copy), all on the direction's copy stream, behind one event.
- *small* pageable leaves (under :data:`SMALL_BYTES`): up to
  :data:`GROUP_BYTES` of them share one pooled pinned block; an upload copies
  them into it and enqueues one batched copy, a download enqueues the batched
  copy and copies each leaf out of the block when the tree is waited for.

- *pageable* leaves on the compiled engine (:func:`submit_pieces`): every
  leaf of the tree is one piece of one staging job. The caller's thread
  copies nothing: one compiled call reads every leaf's addresses and sizes
  and checks them, the job is queued in microseconds, and the staging lanes
  copy and enqueue its chunks in parallel, in both directions. Leaves that
  follow each other on the device (a tree uploaded into fresh arrays, then
  reused) share chunks, so many small leaves travel as few large DMAs.

All need C-contiguous host arrays and ferry device arrays of the runtime (a
missing upload destination is allocated here). A group is one record: its
``moved`` / ``leased`` objects are every leaf's, its result the leaves'
objects in order, and it completes, fails or is abandoned as one transfer
does (a failed group abandons every leaf it copies).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import _native
from .._backends._base import DeviceError
from .._completion import Extras
from .._device_array import DeviceArray, new_device_array, new_view
from .._errors import RuntimeClosedError, TransferSubmitError
from .._interop._foreign import order_before
from .._memory._slab import ALIGN, DeviceSlab, slab_layout
from .._pending import PendingDownload, PendingUpload
from .._state import IN_FLIGHT, OWNED
from ._base import HostLeases, array_ptr
from ._direct import _raise_queued
from ._native import NativeEngine, NativeJob

__all__: list[str] = []

SMALL_BYTES = 256 << 10
"""Leaves smaller than this go through a shared staging block (pageable) or one batched copy (pinned)."""

GROUP_BYTES = 4 << 20
"""The most bytes of small pageable leaves one staging block (one record) carries."""

_ALIGN = 256


class Plan:
    """Which leaves of a tree go in groups: pinned ones, small pageable ones, the rest one by one."""

    __slots__ = ("pinned", "rest", "small")

    def __init__(self) -> None:
        self.pinned: list[int] = []
        self.small: list[list[int]] = []
        self.rest: list[int] = []


def plan(rt: Any, hosts: list[Any], devices: list[Any], sizes: list[int], *, upload: bool) -> Plan:
    """Sort the leaves: ``hosts[i]`` a NumPy array (or None: a fresh output), ``devices[i]`` a device
    leaf (or None: a fresh destination)."""
    routes = rt._parts.host
    registrations, leaves = routes.registrations, routes.pinned_leaves
    pinned_active = registrations.active or leaves.active
    out = Plan()
    small: list[int] = []
    used = 0
    for i, (host, device, nbytes) in enumerate(zip(hosts, devices, sizes, strict=True)):
        if not nbytes or (device is not None and type(device) is not DeviceArray):
            out.rest.append(i)
            continue
        if host is not None and (type(host) is not np.ndarray or not host.flags.c_contiguous):
            out.rest.append(i)
            continue
        if host is not None and pinned_active:
            ptr = array_ptr(host)
            if (registrations.active and registrations.covering(ptr, nbytes) is not None) or (
                leaves.active and leaves.covering(ptr, nbytes) is not None
            ):
                out.pinned.append(i)
                continue
        if nbytes < SMALL_BYTES:  # a small leaf, into an array of yours or a fresh output: groups of GROUP_BYTES
            if used + nbytes > GROUP_BYTES and small:
                out.small.append(small)
                small, used = [], 0
            small.append(i)
            used += nbytes
        else:
            out.rest.append(i)
        if used >= GROUP_BYTES:
            out.small.append(small)
            small, used = [], 0
    if small:
        out.small.append(small)
    return out


_pause_lock = threading.Lock()
_pauses = 0  # open pauses, on every thread
_was_on = False  # whether the collector ran when the first open pause began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a tree is walked and submitted.

    A tree makes a few objects per leaf (paths, builders, records' tuples); with
    thousands of leaves in a large heap the collector's passes cost more than the
    walk itself. Nothing here makes cycles that must be collected meanwhile.
    Pauses nest, across threads too: the collector runs again when the last open
    pause ends, and only if it ran when the first one began.
    """
    global _pauses, _was_on
    with _pause_lock:
        if _pauses == 0:
            _was_on = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _was_on:
                gc.enable()


def empty_many(rt: Any, specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[DeviceArray]:
    """Fresh device arrays from the device pool for ``(shape, dtype)`` pairs (checked NumPy ones), under
    one lock; all or none (a refusal frees those made and raises MemoryError or FerryError).

    Several arrays are views of one allocation (:mod:`ferry._memory._slab`), back to back on the device:
    one pool call for all of them, and a tree's leaves then move as few large DMAs. The allocation is
    freed once every one of them was freed.
    """
    parts = rt._parts
    parts.health.check_open()
    memory, completion = parts.memory, parts.completion
    made: list[DeviceArray] = []
    with parts.lock:
        if completion.maintenance_due():
            completion.maintain()
        if len(specs) > 1:
            offsets, sizes, total = slab_layout(specs)
            base = memory.alloc(total)
            slab = DeviceSlab(memory, base, total, len(specs))
            try:
                views = [new_view(rt, slab, base + off, shape, dtype, nbytes)
                         for (shape, dtype), off, nbytes in zip(specs, offsets, sizes, strict=True)]
                slab.adopt(views)
            except BaseException:
                _unmade(slab)
                raise
            memory.arrays.add(slab)
            return views
        try:
            for shape, dtype in specs:
                nbytes = math.prod(shape) * dtype.itemsize
                made.append(new_device_array(rt, memory, memory.alloc(nbytes), shape, dtype, nbytes))
        except BaseException:
            for array in made:
                array.close()
            raise
    return made


def empty_like_many(rt: Any, hosts: list[np.ndarray[Any, Any]]) -> list[DeviceArray]:
    """:func:`empty_many` for arrays of the shapes and dtypes of ``hosts`` (checked NumPy arrays, at least
    two): views of one allocation, made in one compiled call where the extension runs."""
    module = _native.load()
    if module is None or len(hosts) < 2:
        return empty_many(rt, [(h.shape, h.dtype) for h in hosts])
    parts = rt._parts
    parts.health.check_open()
    memory, completion = parts.memory, parts.completion
    found = module.host_sizes(hosts, ALIGN)  # as slab_layout counts them
    if found is None:
        sizes = list(map(_HOST_NBYTES, hosts))
        total = int(((np.maximum(np.array(sizes, np.int64), 1) + (ALIGN - 1)) // ALIGN * ALIGN).sum())
    else:
        sizes, total = found
    with parts.lock:
        if completion.maintenance_due():
            completion.maintain()
        base = memory.alloc(total)
        slab = DeviceSlab(memory, base, total, len(hosts))
        try:
            views = module.slab_views(hosts, sizes, rt, slab, base, OWNED, 0)  # adopted by the slab too
            if views is None:
                offsets, _, _ = slab_layout([(h.shape, h.dtype) for h in hosts])
                views = [new_view(rt, slab, base + off, h.shape, h.dtype, nbytes)
                         for h, off, nbytes in zip(hosts, offsets, sizes, strict=True)]
                slab.adopt(views)
        except BaseException:
            _unmade(slab)
            raise
        memory.arrays.add(slab)
    return views  # type: ignore[no-any-return]


_HOST_NBYTES = operator.attrgetter("nbytes")


def _unmade(slab: DeviceSlab) -> None:
    """A fresh slab whose views could not all be made (a refusal or no memory partway): the ones made died
    with the failure without being the last, so the allocation is freed here, once. Lock held."""
    if slab._live:  # (every view made and gone would have freed it already)
        slab._live.clear()  # closed: a view that outlived the failure frees nothing more
        slab.memory.release(slab._ptr, slab._nbytes)


def _check_open(rt: Any) -> None:
    refusal = rt._health.refusal
    if refusal is not None:
        raise RuntimeClosedError(refusal)


def _order(completion: Any, stream: Any, devices: list[DeviceArray]) -> None:
    try:
        for device in devices:
            if device._ready is not None:
                order_before(completion, [stream], device, ordered=stream)
    except DeviceError as exc:
        completion.health.note(exc)
        raise TransferSubmitError(f"could not order the copy after the array's producer: {exc}") from exc


def _covering(routes: Any, ptr: int, nbytes: int) -> Any:
    found = routes.registrations.covering(ptr, nbytes) if routes.registrations.active else None
    return found if found is not None else routes.pinned_leaves.covering(ptr, nbytes)


def _covering_runs(routes: Any, ptrs: list[int], sizes: list[int]) -> list[Any]:
    """:func:`_covering` for many host ranges: the pinned leaves searched once for all of them."""
    found: list[Any] = routes.pinned_leaves.covering_many(ptrs, sizes)
    if routes.registrations.active:
        found = [reg if reg is not None else routes.registrations.covering(p, n)
                 for reg, p, n in zip(found, ptrs, sizes, strict=True)]
    return found


def submit_pinned(rt: Any, upload: bool, hosts: list[np.ndarray[Any, Any]], devices: list[DeviceArray],
                  handed: list[Any]) -> Any:
    """One record for pinned leaves: each one DMA (the small ones one batched copy), one event."""
    routes = rt._parts.host
    completion = routes.completion
    backend = completion.backend
    stream = routes.h2d if upload else routes.d2h
    leases = routes.direct.leases
    with routes.lock:
        _check_open(rt)
        _recheck(rt, upload, hosts, devices)
        _order(completion, stream, devices)
        regs = []
        small_d: list[int] = []
        small_s: list[int] = []
        small_n: list[int] = []
        big: list[tuple[int, int, int]] = []
        total = 0
        for host, device in zip(hosts, devices, strict=True):
            ptr, nbytes = array_ptr(host), int(host.nbytes)
            reg = _covering(routes, ptr, nbytes)
            if reg is None:  # collected meanwhile cannot happen (the tree holds the array); refuse cleanly
                raise TransferSubmitError("a pinned leaf's block is no longer registered")
            regs.append(reg)
            dst, src = (device._ptr, ptr) if upload else (ptr, device._ptr)
            if nbytes < SMALL_BYTES:
                small_d.append(dst)
                small_s.append(src)
                small_n.append(nbytes)
            else:
                big.append((dst, src, nbytes))
            total += nbytes
        copy = batched_copy(backend, upload, small_d, small_s, small_n, big)
        return _enqueue(rt, completion, upload, stream, copy, total, hosts, devices, handed, leases, regs, None)


def batched_copy(backend: Any, upload: bool, small_d: list[int], small_s: list[int], small_n: list[int],
                 big: list[tuple[int, int, int]]) -> Callable[[int, int, int, Any, Any], None]:
    """The record's copy for many pinned runs: the small ones as one batched copy, then each large one as one
    DMA; the event is recorded behind the last (alone, where there is nothing to copy). A failure after the
    first enqueue is reported as queued."""
    one = backend.htod_record if upload else backend.dtoh_record
    if not small_d and not big:  # every leaf empty: an event alone
        def record(_dst: int, _src: int, _n: int, stream: Any, event: Any) -> None:
            backend.copy_batch(upload, [], [], [], stream, event)

        return record

    def copy(_dst: int, _src: int, _n: int, stream: Any, event: Any) -> None:
        queued = False
        if small_d:
            backend.copy_batch(upload, small_d, small_s, small_n, stream, None if big else event)
            queued = True
        last = len(big) - 1
        for j, (dst, src, nbytes) in enumerate(big):
            try:
                one(dst, src, nbytes, stream, event if j == last else None)
            except DeviceError as exc:
                _raise_queued(exc, after_first=queued)
            queued = True

    return copy


def submit_small(rt: Any, upload: bool, hosts: list[np.ndarray[Any, Any]], devices: list[DeviceArray],
                 handed: list[Any]) -> Any:
    """One record for small pageable leaves through one pooled pinned block, one batched copy."""
    routes = rt._parts.host
    completion = routes.completion
    backend = completion.backend
    direct = routes.direct
    stream = routes.h2d if upload else routes.d2h
    offsets = []
    total = 0
    for host in hosts:
        offsets.append(total)
        total += -(-int(host.nbytes) // _ALIGN) * _ALIGN
    with routes.lock:
        _check_open(rt)
        _recheck(rt, upload, hosts, devices)
        _order(completion, stream, devices)
        block = direct.pool.acquire(max(total, 1))
        direct._count(block.capacity)
        try:
            base = block.ptr
            copier = direct.copier
            ptrs = [array_ptr(h) for h in hosts]
            sizes = [int(h.nbytes) for h in hosts]
            stage = [base + off for off in offsets]
            dptrs = [d._ptr for d in devices]
            if upload:
                if copier is not None:
                    for at, ptr, nbytes in zip(stage, ptrs, sizes, strict=True):
                        copier.copy(at, ptr, nbytes, True)
                else:
                    for at, ptr, nbytes in zip(stage, ptrs, sizes, strict=True):
                        ctypes.memmove(at, ptr, nbytes)
                dsts, srcs = dptrs, stage
            else:
                dsts, srcs = stage, dptrs

            def copy(_dst: int, _src: int, _n: int, stream: Any, event: Any) -> None:
                backend.copy_batch(upload, dsts, srcs, sizes, stream, event)

            def publish() -> None:
                if copier is not None:
                    for ptr, at, nbytes in zip(ptrs, stage, sizes, strict=True):
                        copier.copy(ptr, at, nbytes)
                else:
                    for ptr, at, nbytes in zip(ptrs, stage, sizes, strict=True):
                        ctypes.memmove(ptr, at, nbytes)
                direct._count(0, sum(sizes))

            def release(failed: bool) -> None:
                direct._count(-block.capacity)
                if failed:
                    completion.abandoned_bytes += block.capacity  # the device may still touch it
                else:
                    direct.pool.release(block)

            handle = _enqueue(rt, completion, upload, stream, copy, sum(sizes), hosts, devices, handed,
                              direct.leases, None, (None if upload else publish, release))
        except BaseException:
            direct._count(-block.capacity)
            direct.pool.release(block)
            raise
        if upload:
            direct._count(0, sum(sizes))
        return handle


def _recheck(rt: Any, upload: bool, hosts: list[Any], devices: list[DeviceArray]) -> None:
    """The group's objects checked again under the lock (the tree's checks ran before it was taken: another
    thread may have submitted one of them since); TransferSubmitError, nothing of the group done."""
    for device in devices:
        problem = device._submission_problem(rt, write=upload)
        if problem:
            raise TransferSubmitError(f"a leaf's device array changed while its tree was submitted: {problem}")
    if not upload:
        for host in hosts:
            if not host.flags.writeable:
                raise TransferSubmitError("a leaf's output became read-only (or another pending download's output) "
                                          "while its tree was submitted")


def _enqueue(rt: Any, completion: Any, upload: bool, stream: Any, copy: Any, total: int,
             hosts: list[Any], devices: list[DeviceArray], handed: list[Any], leases: Any, regs: list[Any] | None,
             staged: tuple[Any, Any] | None, held: list[Any] | None = None) -> Any:
    """Enqueue a group's record, take its leases, move its states; the handle. Lock held.

    ``held``: a download's host side as the record's result holds it, the list itself (the caller fills it
    once the copies are queued); a tuple of ``handed`` otherwise."""
    devs: tuple[Any, ...] = tuple(devices)
    moved: tuple[Any, ...]
    leased: tuple[Any, ...]
    result: tuple[Any, Any]
    if upload:
        moved, leased, result = devs, (), (tuple(handed), devs)
    else:
        moved, leased, result = (), devs, (devs, tuple(handed) if held is None else held)
    record = completion.enqueue(stream, copy, 0, 0, total, moved, leased, result)
    # from here on nothing raises: the copies are queued
    extra = record.extra = Extras()
    take_all(leases, hosts)
    if regs is not None:
        for reg in regs:
            reg._uses += 1

    def cleanup(failed: bool) -> None:
        if failed and regs is not None:  # the device may still touch pinned leaves: read-only and in use
            return
        give_all(leases, hosts)
        if regs is not None:
            for reg in regs:
                reg._uses -= 1

    if staged is not None:
        extra.finish = staged[0]
        extra.cleanups.append(staged[1])
    extra.cleanups.append(cleanup)
    _mark(devices, upload)
    if upload:
        return PendingUpload(completion, record)
    return PendingDownload(completion, record)


def take_all(leases: HostLeases, hosts: list[Any]) -> None:
    """``leases.take`` for every host array, all or none (one compiled call where the lease table is the
    extension's)."""
    leases.take_many(hosts)


def give_all(leases: HostLeases, hosts: list[Any]) -> None:
    """``leases.give`` for every host array (one compiled call where the lease table is the extension's)."""
    leases.give_many(hosts)


_BOOKKEEPING = _native.load()  # mark_leaves, looked up once: FERRY_NATIVE chooses engines, not this


def _mark(devices: list[Any], upload: bool) -> None:
    """A queued group's device arrays: in flight (an upload's destinations) or read-leased once more (a
    download's sources). One compiled call where the extension is here (bookkeeping only: it runs whichever
    engine copies)."""
    module = _BOOKKEEPING
    if module is not None:
        try:  # it checks that every item is an exact DeviceArray first (TypeError, nothing changed)
            module.mark_leaves(devices, IN_FLIGHT if upload else None, 0 if upload else 1)
            return
        except TypeError:
            pass
    if upload:
        for device in devices:
            device._state = IN_FLIGHT
    else:
        for device in devices:
            device._leases += 1


def owned_again(record: Any, devices: tuple[Any, ...]) -> list[Any]:
    """A handed-off group's destinations still in flight become owned again, ordered after the group (their
    ``ready`` its record), and leave the record's moved objects: the list of them. Lock held."""
    moved = record.moved
    if moved is devices:  # the common case (the group's own tuple): every one of them
        handed = [d for d in devices if d._state is IN_FLIGHT]
    else:
        ids = {id(o) for o in moved}
        handed = [d for d in devices if d._state is IN_FLIGHT and id(d) in ids]
    if not handed:
        return handed
    for device in handed:
        device._state = OWNED
        device._ready = record
    if len(handed) == len(moved):
        record.moved = ()
    else:
        gone = {id(d) for d in handed}
        record.moved = tuple(o for o in moved if id(o) not in gone)
    return handed


def handed_back(completion: Any, record: Any, devices: tuple[Any, ...]) -> None:
    """:func:`owned_again`, and the record forgets them when it settles (their ``ready`` cleared; abandoned if
    its copy failed). Lock held."""
    handed = owned_again(record, devices)
    if not handed:
        return

    def forget(failed: bool) -> None:
        for device in handed:
            if device._ready is record:
                device._ready = None
            if failed:  # its bytes never arrived, or partly
                completion.abandon(device)

    completion.extras(record).cleanups.append(forget)


def hand_off(completion: Any, handle: Any, stream: Any) -> tuple[Any, ...]:
    """Hand off a group's destinations (as one upload's); each is owned again, ordered after the group."""
    devices: tuple[Any, ...] = handle.hand_off(stream)  # flushes, checks, orders ``stream`` after it
    with completion.lock:
        handed_back(completion, handle._record, devices)
        if stream is not None:
            slabs: set[int] = set()  # a slab's views note the stream once for the whole allocation
            for device in devices:
                memory = device._memory
                if type(memory) is DeviceSlab:
                    if id(memory) in slabs:
                        continue
                    slabs.add(id(memory))
                memory.note_stream(device._ptr, stream)
    return devices


def pieces_ready(rt: Any, upload: bool) -> bool:
    """Whether :func:`submit_pieces` may take a tree here: the compiled extension runs (and the staging
    engine is the compiled one) and no batch is open on this thread."""
    routes = rt._parts.host
    if _native.load() is None:
        return False
    if routes.completion.batches.get(threading.get_ident()) is not None:
        return False
    return bool(routes.config.engine != "python")


def _emulated_targets(backend: Any, pieces: bytes) -> tuple[bytes, Any]:
    """The emulated device: each piece's device address as the memory behind it (one queued use for
    each run of pieces that follow each other on the device, given back by the returned function)."""
    table = np.frombuffer(pieces, np.uint64).reshape(-1, 3).copy()
    dev, size = table[:, 1], table[:, 2]
    if len(table) > 1:
        starts = np.concatenate(([0], np.flatnonzero(dev[:-1] + size[:-1] != dev[1:]) + 1))
    else:
        starts = np.zeros(len(table), np.int64)
    ends = np.append(starts[1:], len(table))
    taken: list[tuple[int, int]] = []
    try:
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            ptr = int(dev[a])
            nbytes = int(dev[b - 1] + size[b - 1]) - ptr
            real = backend.native_target(ptr, nbytes)
            taken.append((ptr, nbytes))
            dev[a:b] += np.uint64((real - ptr) % (1 << 64))  # wraps: the difference, either sign
    except BaseException:
        for ptr, nbytes in taken:
            backend.native_release(ptr, nbytes)
        raise

    def release() -> None:
        for ptr, nbytes in taken:
            backend.native_release(ptr, nbytes)

    return table.tobytes(), release


def submit_pieces(rt: Any, upload: bool, hosts: list[Any], devices: list[Any], handed: list[Any], *,
                  fresh: bool = False) -> Any:
    """One record and one staging job for every leaf (pageable host arrays, ferry device arrays); the
    handle, or None where a leaf is not the common case or the compiled engine is not there (then
    nothing changed: the caller takes the leaves one by one, which names any problem).

    ``fresh``: the host arrays are a download's fresh outputs, made for it and seen by no one until
    ``wait()`` hands them out, so they are not flagged read-only meanwhile (no lease per leaf)."""
    routes = rt._parts.host
    completion = routes.completion
    module = _native.load()
    if module is None:
        return None
    with routes.lock:
        _check_open(rt)
        engine = routes.staged.engine(upload)
        found = module.leaf_pieces(hosts, devices, rt, OWNED, upload) if isinstance(engine, NativeEngine) else None
        if found is None:
            return None
        pieces, total = found
        completion.maintain_if_due()
        if routes.registrations.active or routes.pinned_leaves.active:
            runs = _runs(pieces, padded=fresh and not upload)  # fresh outputs: pinned ones made for it
            regs = _covering_runs(routes, runs[0], runs[2])
            if all(reg is not None for reg in regs):  # every leaf in pinned memory: DMAs, no staging
                return _pinned_pieces(rt, upload, runs, regs, total, hosts, devices, handed, fresh)
            if any(reg is not None for reg in regs):
                return None  # some pinned, some not: leaf by leaf
        return _staged_pieces(rt, engine, upload, pieces, total, hosts, devices, handed, fresh)


def _staged_pieces(rt: Any, engine: NativeEngine, upload: bool, pieces: bytes, total: int, hosts: list[Any],
                   devices: list[Any], handed: list[Any], fresh: bool) -> Any:
    """One staging job for pageable leaves (checked by ``leaf_pieces``): its record and handle. Lock held."""
    routes = rt._parts.host
    completion = routes.completion
    staged = routes.staged
    job = NativeJob(tuple(hosts), 0, total)  # type: ignore[arg-type]  # keeps every host array alive
    if not engine.cuda:
        try:
            pieces, job._release = _emulated_targets(completion.backend, pieces)
        except DeviceError as exc:
            completion.health.note(exc)
            raise TransferSubmitError(f"the device refused a leaf's memory: {exc}") from exc
        engine._arm_fault()
    try:
        inner = engine.engine.submit_pieces(pieces, hand_off=engine.cuda)
    except (RuntimeError, MemoryError, ValueError, OverflowError) as exc:
        if job._release is not None:
            job._release()
            job._release = None
        raise TransferSubmitError(f"the staging engine refused the tree: {exc}") from exc
    job._start(inner)
    # from here on nothing raises: the job is queued
    staged.tree_jobs += 1
    staged.tree_leaves += len(hosts)
    extra = Extras()
    extra.order_after = lambda stream: engine.order_after(job, stream)
    extra.ready_to_order = job.wait_posted
    extra.export_stream = routes.h2d if upload else routes.d2h
    devs: tuple[Any, ...] = tuple(devices)
    if upload:
        moved, leased, result = devs, (), (tuple(handed), devs)
    else:
        moved, leased, result = (), devs, (devs, tuple(handed))
    record = completion.job_record(job, engine, moved, leased, result, total, extra)
    leases = routes.direct.leases
    hosts_leased: list[Any] = [] if fresh else hosts
    take_all(leases, hosts_leased)

    def cleanup(failed: bool) -> None:
        with staged._lock:
            staged.host_copied += job.host_bytes
        job.finished()
        give_all(leases, hosts_leased)

    extra.cleanups.append(cleanup)
    _mark(devices, upload)
    if upload:
        return PendingUpload(completion, record)
    return PendingDownload(completion, record)


def _runs(pieces: bytes, padded: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The pieces (host, device, bytes) merged where they follow each other on both sides; empty ones
    dropped: (hosts, devices, sizes).

    ``padded``: the host side was laid out by this transfer (fresh pinned outputs, each leaf at a multiple of
    :data:`ALIGN` bytes), so the bytes between two of its leaves belong to no one. Two pieces then also merge
    where the same gap of less than :data:`ALIGN` bytes separates them on both sides (a device slab's views
    and a pinned block's leaves, whose sizes are not multiples of it): the run copies the padding too, which
    only reads the device."""
    module = _native.load()
    if module is not None:
        return module.merge_runs(pieces, ALIGN if padded else 0)  # type: ignore[no-any-return]
    return merged_runs(pieces, padded)


def merged_runs(pieces: bytes, padded: bool = False) -> tuple[list[int], list[int], list[int]]:
    """:func:`_runs` in NumPy: the compiled ``merge_runs``'s twin (the pure-Python engine's)."""
    table = np.frombuffer(pieces, np.uint64).reshape(-1, 3)
    table = table[table[:, 2] > 0]
    if len(table) < 2:
        return table[:, 0].tolist(), table[:, 1].tolist(), table[:, 2].tolist()
    h, d, n = table[:, 0], table[:, 1], table[:, 2]
    ends_h, ends_d = h[:-1] + n[:-1], d[:-1] + n[:-1]
    if padded:  # (uint64: a piece that starts before the last one ended wraps to a huge gap: never merged)
        gap = h[1:] - ends_h
        breaks = (gap != d[1:] - ends_d) | (gap >= np.uint64(ALIGN))
    else:
        breaks = (ends_h != h[1:]) | (ends_d != d[1:])
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    if not padded:
        return h[starts].tolist(), d[starts].tolist(), np.add.reduceat(n, starts).tolist()
    last = np.append(starts[1:], len(table)) - 1  # each run from its first piece's start to its last one's end
    return h[starts].tolist(), d[starts].tolist(), (h[last] + n[last] - h[starts]).tolist()


def _pinned_pieces(rt: Any, upload: bool, runs: tuple[list[int], list[int], list[int]], regs: list[Any],
                   total: int, hosts: list[Any], devices: list[Any], handed: list[Any], fresh: bool,
                   held: list[Any] | None = None) -> Any:
    """One record for leaves in pinned memory (checked by ``leaf_pieces``, merged into runs): each large
    run one DMA, the small ones one batched copy, one event. Lock held. ``held``: as for :func:`_enqueue`."""
    routes = rt._parts.host
    completion = routes.completion
    backend = completion.backend
    stream = routes.h2d if upload else routes.d2h
    run_h, run_d, run_n = runs
    small: tuple[list[int], list[int], list[int]] = ([], [], [])
    big: list[tuple[int, int, int]] = []
    for h, d, n in zip(run_h, run_d, run_n, strict=True):
        dst, src = (d, h) if upload else (h, d)
        if n < SMALL_BYTES:
            small[0].append(dst)
            small[1].append(src)
            small[2].append(n)
        else:
            big.append((dst, src, n))
    copy = batched_copy(backend, upload, small[0], small[1], small[2], big)
    return _enqueue(rt, completion, upload, stream, copy, total, [] if fresh else hosts, devices, handed,
                    routes.direct.leases, regs, None, held)


def submit_into_block(rt: Any, devices: list[Any], ptr: int, offsets: list[int], leaf: Any,
                      held: list[Any]) -> Any:
    """One record for a download of ferry device arrays into a pinned block laid out for it (leaf ``i`` at
    ``ptr + offsets[i]``, ``leaf`` the block's entry): the copies are queued before any host array exists.
    The record's result holds ``held`` itself as its host side: the caller puts what keeps the block alive
    in it first, and the host leaves once this returns. The handle, or None where a device array is not the
    common case or the compiled engine is not there (nothing changed)."""
    routes = rt._parts.host
    completion = routes.completion
    module = _native.load()
    if module is None:
        return None
    with routes.lock:
        _check_open(rt)
        found = module.device_pieces(devices, rt, OWNED, ptr, offsets)
        if found is None:
            return None
        pieces, total = found
        completion.maintain_if_due()
        return _pinned_pieces(rt, False, _runs(pieces, padded=True), [leaf], total, [], devices, [], True, held)
