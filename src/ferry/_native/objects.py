"""The fields of ferry's hot objects: compiled base types where the extension runs, Python twins else.

The compiled entries (a pinned submission's checks, a small transfer's upload and settle) read the
fields of a pinned buffer, a device array, a pool block, a runtime's health, a record's extras and a
small-route slot. Each of those classes derives from one base here. Where the extension runs the base
is its compiled type (``objects.c``): the fields live in a C struct and are read at their declared
offsets; a new object's fields are ``None`` until its ``__init__`` sets them. Elsewhere the base is
the Python twin below: the same names as ``__slots__``.

``HostMemory`` is the pinned memory a buffer's views are made from, counting its live exports: the
compiled one exports the memory through the buffer protocol and counts the buffers NumPy has not
released; the twin makes a fresh ctypes array for each view and counts those still alive (weak
references: one dies exactly when no array, slice or memoryview made from it is left).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

from . import load

__all__ = ["ArrayFields", "BlockFields", "BufferFields", "ExtrasFields", "HealthFields", "HostMemory", "SlotFields"]


class _BufferFields:
    __slots__ = ("_base", "_block", "_nbytes", "_runtime", "_state")


class _ArrayFields:
    __slots__ = ("_dtype", "_leases", "_memory", "_nbytes", "_ptr", "_ready", "_runtime", "_shape", "_state")


class _BlockFields:
    __slots__ = ("capacity", "ptr")


class _HealthFields:
    __slots__ = ("closed", "exited", "forked", "poisoned", "refusal")


class _ExtrasFields:
    __slots__ = ("cleanups", "export_stream", "finish", "handed", "job", "order_after", "progress", "ready_to_order")


class _SlotFields(_ExtrasFields):
    __slots__ = ("address", "block", "capacity", "host", "nbytes", "own", "ptr", "record", "ring")


class _HostMemory:
    """``nbytes`` bytes at ``ptr``, made into views through :meth:`export`, counting the exports alive.

    Each :meth:`export` is a new ctypes array over the memory that keeps this object alive; NumPy makes
    it the base of the array built from it, and every slice, reshape or memoryview derived from that
    array keeps it alive in turn. ``exports`` counts those not yet dead: each one's weak reference is
    cleared (and its entry dropped) when it dies, before its memory can be reused.
    """

    __slots__ = ("__weakref__", "_live", "_ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int) -> None:
        if ptr < 0 or nbytes < 0 or (not ptr and nbytes):
            raise ValueError("HostMemory needs an address and a size of at least 0 bytes")
        self._ptr = ptr
        self.nbytes = nbytes
        self._live: dict[int, weakref.ref[ctypes.Array[ctypes.c_ubyte]]] = {}

    @property
    def exports(self) -> int:
        """How many exports are alive."""
        return len(self._live)

    def export(self) -> ctypes.Array[ctypes.c_ubyte]:
        """A new object over the memory to make one view from; counted while it lives."""
        carrier = (ctypes.c_ubyte * self.nbytes).from_address(self._ptr)
        carrier._ferry_memory = self  # type: ignore[attr-defined]  # the memory outlives its exports
        key = id(carrier)
        live = self._live
        live[key] = weakref.ref(carrier, lambda _ref: live.pop(key, None))
        return carrier


if TYPE_CHECKING:
    BufferFields = _BufferFields
    ArrayFields = _ArrayFields
    BlockFields = _BlockFields
    HealthFields = _HealthFields
    ExtrasFields = _ExtrasFields
    SlotFields = _SlotFields
    HostMemory = _HostMemory
else:
    _engine = load()
    if _engine is None:
        BufferFields, ArrayFields, BlockFields = _BufferFields, _ArrayFields, _BlockFields
        HealthFields, ExtrasFields, SlotFields = _HealthFields, _ExtrasFields, _SlotFields
        HostMemory = _HostMemory
    else:
        BufferFields, ArrayFields, BlockFields = _engine.BufferFields, _engine.ArrayFields, _engine.BlockFields
        HealthFields, ExtrasFields, SlotFields = _engine.HealthFields, _engine.ExtrasFields, _engine.SlotFields
        HostMemory = _engine.HostMemory
