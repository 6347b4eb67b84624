"""Registration: an existing NumPy array pinned in place for repeated transfers.

``cuMemHostRegister`` page-locks memory the caller already owns (about 5 ms per
256 MiB, and the same again to unpin). Once registered, uploads from and
downloads into that array take the pinned route: one DMA, no host copy, no
staging. A registration keeps its array alive; it is undone by
:meth:`Registration.release` or by the runtime's ``close()``, never while a
transfer uses it (a transfer that failed keeps it in use forever: the device
may still touch the memory).
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .._backends._base import Backend, DeviceError
from .._errors import BufferMovedError, FerryError, TransferSubmitError

if TYPE_CHECKING:
    from .._lifecycle import Health

__all__ = ["Registration"]

_FACTORY = object()


class Registration:
    """A page-locked NumPy array; create one with :meth:`ferry.Runtime.register`.

    Usable as a context manager: leaving the block releases it.
    """

    __slots__ = ("__weakref__", "_array", "_nbytes", "_ptr", "_released", "_table", "_uses")

    def __init__(self, table: Registrations, array: np.ndarray[Any, Any], *, _token: object = None) -> None:
        if _token is not _FACTORY:
            raise TypeError("Registration is created by Runtime.register(array)")
        self._table = table
        self._array = array
        self._ptr = int(array.ctypes.data)
        self._nbytes = int(array.nbytes)
        self._uses = 0
        self._released = False

    @property
    def array(self) -> np.ndarray[Any, Any]:
        """The registered array."""
        return self._array

    @property
    def nbytes(self) -> int:
        """Bytes pinned."""
        return self._nbytes

    @property
    def active(self) -> bool:
        """True until released (or the runtime closed)."""
        return not self._released

    @property
    def in_use(self) -> int:
        """Transfers currently using the registered memory."""
        return self._uses

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside the registered range."""
        return not self._released and self._ptr <= ptr and ptr + nbytes <= self._ptr + self._nbytes

    def release(self) -> None:
        """Unpin the memory. Idempotent.

        Raises :class:`~ferry.BufferMovedError` while a transfer uses it.
        """
        self._table.unregister(self)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"active, {self._uses} transfer(s)"
        return f"<Registration {self._nbytes} bytes {state}>"


def check_releasable(registration: Registration) -> None:
    """Raise unless no transfer uses the registration."""
    if registration._uses:
        raise BufferMovedError(
            f"cannot release a registration that {registration._uses} transfer(s) still use; wait() for them"
        )


class Registrations:
    """A runtime's arrays pinned in place: pin, find the one covering a range, unpin."""

    def __init__(self, backend: Backend, health: Health, lock: threading.RLock) -> None:
        self.backend = backend
        self.health = health
        self.lock = lock
        self.active: list[Registration] = []  # sorted by address (they never overlap)
        self._starts: list[int] = []  # their addresses, for bisect: a lookup per transfer is O(log n)

    @property
    def bytes(self) -> int:
        """Bytes pinned in place."""
        return sum(r._nbytes for r in self.active)

    def register(self, array: np.ndarray[Any, Any]) -> Registration:
        """Pin ``array`` in place; refuses anything but a non-empty C-contiguous array of bytes."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            raise TypeError("register needs a non-empty C-contiguous NumPy array")
        if array.dtype.hasobject or array.dtype.itemsize == 0:
            raise TransferSubmitError(f"register: dtype {array.dtype} is not a fixed-size byte layout ferry copies")
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        with self.lock:
            at = bisect.bisect_left(self._starts, ptr)
            for other in self.active[max(at - 1, 0):at + 1]:  # only neighbours can overlap
                if ptr < other._ptr + other._nbytes and other._ptr < ptr + nbytes:
                    raise FerryError("this memory overlaps an active registration")
            try:
                self.backend.host_register(ptr, nbytes)
            except DeviceError as exc:
                self.health.note(exc)
                raise FerryError(f"could not pin the array in place: {exc}") from exc
            registration = Registration(self, array, _token=_FACTORY)
            self.active.insert(at, registration)
            self._starts.insert(at, ptr)
        return registration

    def covering(self, ptr: int, nbytes: int) -> Registration | None:
        """The active registration covering ``[ptr, ptr + nbytes)``, if any."""
        at = bisect.bisect_right(self._starts, ptr) - 1  # the last one starting at or before ptr
        if at >= 0 and self.active[at].covers(ptr, nbytes):
            return self.active[at]
        return None

    def unregister(self, registration: Registration) -> None:
        """Unpin (see :meth:`Registration.release`)."""
        with self.lock:
            if registration._released:
                return
            check_releasable(registration)
            registration._released = True
            at = self.active.index(registration, bisect.bisect_left(self._starts, registration._ptr))
            del self.active[at], self._starts[at]
            if self.health.refusal is None:
                try:
                    self.backend.host_unregister(registration._ptr)
                except DeviceError as exc:
                    self.health.note(exc)
                    raise FerryError(f"could not unpin the array: {exc}") from exc

    def close(self) -> None:
        """Unpin every registration no failed transfer still uses. Lock held."""
        usable = self.health.device_usable
        for registration in list(self.active):
            if registration._uses == 0 and usable:
                try:
                    self.backend.host_unregister(registration._ptr)
                except DeviceError as exc:
                    self.health.note(exc)
            registration._released = True
        self.active.clear()
        self._starts.clear()
