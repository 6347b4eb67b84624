"""The fields of ferry's hot objects: compiled base types where the extension runs, Python twins else.

The compiled entries (a pinned submission's checks, a small transfer's upload and settle) read the
fields of a pinned buffer, a device array, a pool block, a runtime's health, a record's extras and a
small-route slot. Each of those classes derives from one base here. Where the extension runs the base
is its compiled type (``objects.c``): the fields live in a C struct and are read at their declared
offsets; a field cannot be deleted, and a new object's fields are ``None`` until its ``__init__`` sets
them. Elsewhere the base is the Python twin below: the same names as ``__slots__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import load

__all__ = ["ArrayFields", "BlockFields", "BufferFields", "ExtrasFields", "HealthFields", "SlotFields"]


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


if TYPE_CHECKING:
    BufferFields = _BufferFields
    ArrayFields = _ArrayFields
    BlockFields = _BlockFields
    HealthFields = _HealthFields
    ExtrasFields = _ExtrasFields
    SlotFields = _SlotFields
else:
    _engine = load()
    if _engine is None:
        BufferFields, ArrayFields, BlockFields = _BufferFields, _ArrayFields, _BlockFields
        HealthFields, ExtrasFields, SlotFields = _HealthFields, _ExtrasFields, _SlotFields
    else:
        BufferFields, ArrayFields, BlockFields = _engine.BufferFields, _engine.ArrayFields, _engine.BlockFields
        HealthFields, ExtrasFields, SlotFields = _engine.HealthFields, _engine.ExtrasFields, _engine.SlotFields
