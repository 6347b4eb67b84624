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
enqueued. The record, its leases and its states are the group route's
(``_routes._groups._enqueue``), so a slot batch completes, fails, is handed
off and is abandoned exactly as a pinned group does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._backends._base import DeviceError
from .._device_array import DeviceArray, new_device_array
from .._errors import TransferSubmitError
from .._memory._slab import DeviceSlab, slab_layout
from .._routes._direct import _raise_queued
from .._routes._groups import SMALL_BYTES, _check_open, _enqueue
from .._state import IN_FLIGHT, OWNED

__all__: list[str] = []


class SlotLayout:
    """What every batch of one layout shares: the destinations' shapes and dtypes, their offsets in one
    device slab and its size, and which leaves travel as one batched copy (the small ones) or one DMA each."""

    __slots__ = ("big", "count", "dtypes", "nbytes", "offsets", "shapes", "sizes", "small", "total")

    def __init__(self, specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
        self.shapes = [shape for shape, _ in specs]
        self.dtypes = [dtype for _, dtype in specs]
        self.offsets, self.sizes, self.total = slab_layout(specs)
        self.count = len(specs)
        self.nbytes = sum(self.sizes)
        self.small = [i for i, n in enumerate(self.sizes) if n < SMALL_BYTES]
        self.big = [i for i, n in enumerate(self.sizes) if n >= SMALL_BYTES]


def upload_slot(rt: Any, layout: SlotLayout, leaves: list[np.ndarray[Any, Any]], ptrs: list[int],
                span: tuple[int, int]) -> tuple[Any, list[DeviceArray]]:
    """Upload a slot batch into fresh device arrays: the group's handle and the arrays.

    ``leaves`` are the slot's views (every one non-empty, C-contiguous, inside the registered ring),
    ``ptrs`` their addresses and ``span`` the slot's ``(address, size)``. All or nothing: a refusal
    (the runtime closed, out of device memory, the ring no longer registered, the copy refused) closes
    the arrays made for it and raises, with nothing enqueued and the leaves untouched.
    """
    parts = rt._parts
    routes = parts.host
    memory, completion = parts.memory, routes.completion
    backend = completion.backend
    stream = routes.h2d
    with routes.lock:
        _check_open(rt)
        if completion.maintenance_due():
            completion.maintain()
        total = layout.total
        base = memory.alloc(total)
        slab = DeviceSlab(memory, base, total, layout.count)
        memory.arrays.add(slab)
        devices = [new_device_array(rt, slab, base + offset, shape, dtype, nbytes)  # type: ignore[arg-type]
                   for shape, dtype, offset, nbytes in zip(layout.shapes, layout.dtypes, layout.offsets,
                                                           layout.sizes, strict=True)]
        try:
            registrations = routes.registrations
            reg = registrations.covering(span[0], span[1]) if registrations.active else None
            if reg is None:  # the ring was unpinned meanwhile: refused cleanly
                raise TransferSubmitError("the loader's ring is no longer registered")
            dptrs = [device._ptr for device in devices]
            small, big = layout.small, layout.big
            small_d = [dptrs[i] for i in small]
            small_s = [ptrs[i] for i in small]
            small_n = [layout.sizes[i] for i in small]
            large = [(dptrs[i], ptrs[i], layout.sizes[i]) for i in big]
            one = backend.htod_record

            def copy(_dst: int, _src: int, _n: int, stream: Any, event: Any) -> None:
                queued = False
                if small_d:
                    backend.copy_batch(True, small_d, small_s, small_n, stream, None if large else event)
                    queued = True
                last = len(large) - 1
                for j, (dst, src, nbytes) in enumerate(large):
                    try:
                        one(dst, src, nbytes, stream, event if j == last else None)
                    except DeviceError as exc:
                        _raise_queued(exc, after_first=queued)
                    queued = True

            handle = _enqueue(rt, completion, True, stream, copy, layout.nbytes, leaves, devices, leaves,
                              routes.direct.leases, [reg], None)
        except BaseException:
            for device in devices:  # made for this batch, never handed out (an abandoned one stays so)
                if device._state is OWNED:
                    device.close()
            raise
    return handle, devices


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
        moved = record.moved
        handed = [d for d in devices if d._state is IN_FLIGHT and any(o is d for o in moved)]
        if handed:
            for device in handed:
                device._state = OWNED
                device._ready = record
            record.moved = tuple(o for o in moved if all(o is not d for d in handed))

            def forget(failed: bool) -> None:
                for device in handed:
                    if device._ready is record:
                        device._ready = None
                    if failed:  # its bytes never arrived, or partly
                        completion.abandon(device)

            completion.extras(record).cleanups.append(forget)
        if stream is not None and devices:
            first = devices[0]
            first._memory.note_stream(first._ptr, stream)  # the slab's: every view's free waits for it
    return devices
