"""PinnedHostBuffer: owned pinned memory, its state and the accounting of its views.

Why views can be counted
------------------------
A transfer must never start while Python code can still read or write the
buffer, and NumPy views are the way Python reads and writes it. Every view
ferry hands out is made from one private object, ``_base``: a ``HostMemory``
over the pinned block (``ferry._native.objects``), which counts its live
exports. The compiled one exports the memory through the buffer protocol:
``np.frombuffer`` keeps the export in a memoryview that is the new array's
base, every slice, reshape and ``view()`` of that array keeps the array (so the
export) alive, and so does a memoryview or an array built from one; the export
is released when the last of them dies. Its Python twin makes a fresh ctypes
array for each view and counts those alive by weak references, with the same
result. So ``_base.exports`` counts the views :meth:`PinnedHostBuffer.as_array`
made that are still alive (each counted once, however much is derived from it),
and no view is alive exactly when it is 0. The count is kept by the exports
themselves, not by reference counts. It is exact for the objects ferry can see;
``buf.ptr`` is the documented escape hatch around it.

Lifetime of the memory
----------------------
The pinned block goes back to the pool when ``_base`` dies (a
``weakref.finalize`` on it; every export keeps it alive), never earlier:
closing a buffer, or dropping it,
while a view is alive keeps the block out of the pool until that view is gone,
so no view can alias memory a later transfer uses. An abandoned buffer keeps
``_base`` forever: its block is never reused or freed.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import BufferMovedError
from ._native.objects import BufferFields, HostMemory
from ._state import CLOSED, IN_FLIGHT, OWNED, State

if TYPE_CHECKING:
    from ._memory._pinned import Block, PinnedPool

__all__ = ["PinnedHostBuffer"]

def check_dtype(dtype: Any) -> np.dtype[Any]:
    """A NumPy dtype ferry can copy as bytes, or ``TypeError``."""
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects; ferry copies bytes only")
    if dt.itemsize == 0:
        raise TypeError(f"dtype {dt} has no fixed size; give it a length (e.g. 'S16')")
    return dt


class PinnedHostBuffer(BufferFields):
    """Owned, page-locked host memory, moved into transfers and returned by ``wait()``.

    Obtain one from :meth:`ferry.Runtime.pinned`. States (``buf.state``):

    ``"owned"``
        The caller holds it: :meth:`as_array` works, and it can be handed to a
        transfer if no view of it is alive.
    ``"in_flight"``
        Handed to a transfer that has not been waited: every data access raises
        :class:`~ferry.BufferMovedError`; ``wait()`` returns it owned.
    ``"abandoned"``
        Its transfer failed and the device may still touch it: raises forever,
        and its memory is never freed or reused.
    ``"closed"``
        Returned to the pool (or its runtime closed): raises.
    """

    __slots__ = ("__weakref__",)  # the fields are BufferFields' (_base, _block, _nbytes, _runtime, _state)

    def __init__(self, owner: object, pool: PinnedPool, block: Block, nbytes: int, *, _token: object = None) -> None:
        if _token is not _FACTORY:
            raise TypeError("PinnedHostBuffer is created by Runtime.pinned(nbytes)")
        self._runtime = owner  # identity only: the runtime that may submit it
        self._block = block
        self._nbytes = nbytes
        base = HostMemory(block.ptr, nbytes)
        # the block returns to the pool only when the base (so every view) is gone
        weakref.finalize(base, pool.release, block)
        self._base: HostMemory | None = base
        self._state: State = OWNED

    # -- public surface ---------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """The usable size in bytes (the size asked for)."""
        return self._nbytes

    @property
    def state(self) -> State:
        """``"owned"``, ``"in_flight"``, ``"abandoned"`` or ``"closed"`` (a :class:`str` enum)."""
        return self._state

    @property
    def ptr(self) -> int:
        """The raw address. An escape hatch: ferry cannot see what is done with it.

        Raises :class:`~ferry.BufferMovedError` unless the buffer is owned. Memory
        reached through this address while the buffer is in flight is exactly
        the hazard ferry exists to prevent; nothing checks it.
        """
        self._require_owned("take the address of")
        return self._block.ptr

    @property
    def live_views(self) -> int:
        """How many views :meth:`as_array` made are still alive.

        A view counts once while it, or anything derived from it (a slice, a
        reshape, a memoryview, an array made from one) is alive; ``0`` means
        no view is left and the buffer can be handed to a transfer.
        """
        base = self._base
        return 0 if base is None else base.exports

    def as_array(
        self, dtype: Any = np.uint8, shape: int | tuple[int, ...] | None = None
    ) -> np.ndarray[Any, Any]:
        """A NumPy view of the buffer's memory.

        Parameters
        ----------
        dtype
            Any fixed-size NumPy dtype.
        shape
            The view's shape; default: as many whole elements as fit.

        Raises
        ------
        BufferMovedError
            Unless the buffer is owned.
        ValueError
            If ``shape`` needs more bytes than the buffer has.

        Notes
        -----
        While the returned array (or anything derived from it) is alive, the
        buffer cannot be handed to a transfer.
        """
        self._require_owned("read or write")
        dt = check_dtype(dtype)
        if shape is None:
            shape = (self._nbytes // dt.itemsize,)
        elif isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        else:
            shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        count = 1
        for s in shape:
            count *= s
        need = count * dt.itemsize
        if need > self._nbytes:
            raise ValueError(
                f"shape {shape} of {dt} needs {need} bytes; the buffer has {self._nbytes}"
            )
        base = self._base
        assert base is not None
        flat: np.ndarray[Any, Any] = np.frombuffer(base.export(), dtype=dt, count=count)  # type: ignore[call-overload]
        return flat.reshape(shape)

    def close(self) -> None:
        """Give the memory back to the pool.

        Idempotent for a closed buffer; a no-op for an abandoned one (its memory
        is never freed). Raises :class:`~ferry.BufferMovedError` while in flight.
        Views still alive keep the memory out of the pool until they die.
        """
        if self._state is IN_FLIGHT:
            raise BufferMovedError("cannot close a buffer that is in flight; wait() for it first")
        if self._state is OWNED:
            self._state = CLOSED
            self._base = None

    def __repr__(self) -> str:
        return f"<PinnedHostBuffer {self._nbytes} bytes, {self._state}>"

    # -- for the runtime ------------------------------------------------------------------
    def _require_owned(self, verb: str) -> None:
        if self._state is not OWNED:
            raise BufferMovedError(f"cannot {verb} a pinned buffer that is {self._state}")

    def _submission_problem(self, owner: object) -> str | None:
        """Why this buffer cannot be handed to a transfer now, or ``None``."""
        if self._runtime is not owner:
            return "the pinned buffer belongs to another runtime"
        if self._state is not OWNED:
            return f"the pinned buffer is {self._state}"
        base = self._base
        views = 0 if base is None else base.exports
        if views:
            return (
                f"the pinned buffer has {views} live view(s) (as_array results, counting with each the arrays, "
                "slices and memoryviews made from it); drop them before handing it to a transfer"
            )
        return None

    def _release_for_close(self) -> None:
        """Runtime closing: owned buffers become closed (memory goes back with the base)."""
        if self._state is OWNED:
            self._state = CLOSED
            self._base = None


_FACTORY = object()


def new_buffer(owner: object, pool: PinnedPool, block: Block, nbytes: int) -> PinnedHostBuffer:
    """Factory used by :meth:`ferry.Runtime.pinned`."""
    return PinnedHostBuffer(owner, pool, block, nbytes, _token=_FACTORY)
