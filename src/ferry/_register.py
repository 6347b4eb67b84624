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

from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import BufferMovedError

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["Registration"]

_FACTORY = object()


class Registration:
    """A page-locked NumPy array; create one with :meth:`ferry.Runtime.register`.

    Usable as a context manager: leaving the block releases it.
    """

    __slots__ = ("__weakref__", "_array", "_nbytes", "_ptr", "_released", "_runtime", "_uses")

    def __init__(self, runtime: Runtime, array: np.ndarray[Any, Any], *, _token: object = None) -> None:
        if _token is not _FACTORY:
            raise TypeError("Registration is created by Runtime.register(array)")
        self._runtime = runtime
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
        self._runtime._unregister(self)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"active, {self._uses} transfer(s)"
        return f"<Registration {self._nbytes} bytes {state}>"


def new_registration(runtime: Runtime, array: np.ndarray[Any, Any]) -> Registration:
    """Factory used by :meth:`ferry.Runtime.register`."""
    return Registration(runtime, array, _token=_FACTORY)


def check_releasable(registration: Registration) -> None:
    """Raise unless no transfer uses the registration."""
    if registration._uses:
        raise BufferMovedError(
            f"cannot release a registration that {registration._uses} transfer(s) still use; wait() for them"
        )
