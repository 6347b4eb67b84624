"""Device slabs: one device allocation that several arrays are views of (a tree's fresh leaves).

``upload_tree`` into fresh destinations makes every leaf's device array at
once. One allocation for all of them, each leaf a view at an aligned offset,
costs one pool call instead of one per leaf, and puts the leaves back to back
on the device, so that the staging lanes move many small leaves as one DMA
(and a later download of the tree does the same).

A :class:`DeviceSlab` is what each view's ``_memory`` is: it answers the calls
a :class:`~ferry.DeviceArray` makes of its memory, in terms of the one
allocation. Streams that may use a view are noted against the whole
allocation (its free waits for every one of them). Freeing a view (``close()``,
or its collection) only counts it; the allocation is freed, or deferred from a
finalizer, once the last view went. The count is a list popped atomically, so
two threads (or a finalizer on the same thread) never both free it. A view
whose transfer failed is abandoned: it is never freed, so the allocation is
never freed either (leaked on purpose, as every abandoned array is). The slab
is registered with the runtime's device memory as one allocation: ``close()``
closes its live views and frees it once, unless a view was abandoned.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .._state import ABANDONED, CLOSED, OWNED, State

if TYPE_CHECKING:
    from ._device import DeviceMemory

__all__: list[str] = []

ALIGN = 256
"""Where each view of a slab starts (a multiple of this many bytes, as the driver's own allocations)."""


class DeviceSlab:
    """One device allocation shared by several device arrays (see the module docstring)."""

    __slots__ = ("__weakref__", "_live", "_nbytes", "_ptr", "_views", "backend", "device", "lock", "memory")

    def __init__(self, memory: DeviceMemory, ptr: int, nbytes: int, views: int) -> None:
        self.memory = memory
        self.backend = memory.backend
        self.device = memory.device
        self.lock = memory.lock
        self._ptr = ptr
        self._nbytes = nbytes
        self._live = list(range(views))  # one token per live view: the one that pops 0 was the last
        self._views: list[weakref.ref[Any]] = []  # the views (adopt() adds them), dead ones included

    def adopt(self, views: list[Any]) -> None:
        """Remember the device arrays that are this slab's views (weak references: they die as they like)."""
        self._views.extend(map(weakref.ref, views))

    @property
    def arrays(self) -> list[Any]:
        """The views alive now."""
        return [view for view in (ref() for ref in self._views) if view is not None]

    # -- the allocation, as the runtime's device memory sees it ------------------------------------
    @property
    def _state(self) -> State:
        if not self._live:
            return CLOSED
        if any(view._state is ABANDONED for view in self.arrays):
            return ABANDONED  # the device may still touch a view: never freed
        return OWNED

    def _release_for_close(self) -> None:
        """The runtime closes: every live view is closed, the allocation is freed once (by the caller)."""
        for view in self.arrays:
            view._release_for_close()
        self._live = []

    # -- what a view asks of its memory ----------------------------------------------------------
    def _last(self) -> bool:
        try:
            return self._live.pop() == 0
        except IndexError:  # closed with the runtime meanwhile
            return False

    def note_stream(self, ptr: int, stream: Any) -> None:
        """A view's consumer stream: the allocation's free waits for its work."""
        self.memory.note_stream(self._ptr, stream)

    def note_unknown(self, ptr: int) -> None:
        """A view was exported with no consumer stream: the allocation is freed after the device idled."""
        self.memory.note_unknown(self._ptr)

    def declare(self, ptr: int, stream: Any) -> None:
        """``record_stream`` on a view: declared for the whole allocation."""
        self.memory.declare(self._ptr, stream)

    def order_export(self, ready: Any, stream_handle: int) -> None:
        """As :meth:`DeviceMemory.order_export`."""
        self.memory.order_export(ready, stream_handle)

    def release(self, ptr: int, nbytes: int) -> None:
        """A view's memory is no longer used (lock held): the allocation is freed with the last one."""
        try:  # (_last inlined: a tree's thousands of views each make this call)
            if self._live.pop():
                return
        except IndexError:  # closed with the runtime meanwhile
            return
        self.memory.release(self._ptr, self._nbytes)

    def free(self, ptr: int, nbytes: int) -> None:
        """A closed view (takes the lock)."""
        with self.lock:
            self.release(ptr, nbytes)

    def defer(self, ptr: int, nbytes: int) -> None:
        """A collected view (a finalizer: never blocks, never calls the device)."""
        try:  # (_last inlined: a tree's thousands of views each make this call)
            if self._live.pop():
                return
        except IndexError:  # closed with the runtime meanwhile
            return
        self.memory.defer(self._ptr, self._nbytes)


def slab_layout(specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> tuple[list[int], list[int], int]:
    """Each array's offset and size in a slab for ``(shape, dtype)`` pairs, and the slab's size."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = aligned_offsets(sizes)
    return offsets, sizes, total


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of arrays of ``sizes`` bytes placed back to back, each at a multiple of :data:`ALIGN` (an empty
    one takes ALIGN bytes too: no two views share an address), and the bytes they span."""
    offsets: list[int] = []
    total = 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-max(nbytes, 1) // ALIGN) * ALIGN
    return offsets, total
