"""The ownership states, one enum for every object a transfer can take.

Every :class:`~ferry.PinnedHostBuffer`, every ferry-owned
:class:`~ferry.DeviceArray` and every foreign array taking part in a transfer
is in exactly one state. The allowed transitions:

=============  ===============================================================
from           to
=============  ===============================================================
owned          in_flight (handed to a transfer), read_leased (device arrays:
               the source of pending downloads; a lease count, not a stored
               state), closed (freed or back to the pool)
in_flight      owned (``wait()`` proved the copy complete), abandoned (the
               copy failed), closed (a dropped handle's record was retired)
abandoned      nothing: forever (the device may still touch the memory)
closed         nothing
=============  ===============================================================

The values are strings (``State.OWNED == "owned"``), so the public ``state``
properties read as plain words.
"""

from __future__ import annotations

import enum

__all__: list[str] = []


class State(enum.StrEnum):
    """An object's ownership state (see the module docstring)."""

    OWNED = "owned"
    IN_FLIGHT = "in_flight"
    READ_LEASED = "read_leased"
    ABANDONED = "abandoned"
    CLOSED = "closed"


OWNED = State.OWNED
IN_FLIGHT = State.IN_FLIGHT
READ_LEASED = State.READ_LEASED
ABANDONED = State.ABANDONED
CLOSED = State.CLOSED
