"""PinnedHostBuffer: owned pinned memory, its state and the accounting of its views.

Why views can be counted
------------------------
A transfer must never start while Python code can still read or write the
buffer, and NumPy views are the way Python reads and writes it. Every view
ferry hands out derives from one private base array, ``_base``, built over the
pinned block through a ctypes object (not through another ndarray). NumPy
collapses a chain of views to the first base that is not an ndarray of the same
type or that owns its data; ``_base`` owns nothing and its own base is the
ctypes object, so every slice, reshape and ``view()`` of a view references
``_base`` directly, and a memoryview or an array built from one keeps its view
(and so ``_base``) alive. On CPython the reference count of ``_base`` therefore
counts the live views: the buffer holds one reference, the count call holds
another, every other one is a view. The count is exact for the objects ferry
can see; ``buf.ptr`` is the documented escape hatch around it.

Lifetime of the memory
----------------------
The pinned block goes back to the pool when ``_base`` dies (a
``weakref.finalize`` on it), never earlier: closing a buffer, or dropping it,
while a view is alive keeps the block out of the pool until that view is gone,
so no view can alias memory a later transfer uses. An abandoned buffer keeps
``_base`` forever: its block is never reused or freed.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import BufferMovedError
from ._native.objects import BufferFields
from ._state import CLOSED, IN_FLIGHT, OWNED, State

if TYPE_CHECKING:
    from ._memory._pinned import Block, PinnedPool

__all__ = ["PinnedHostBuffer"]

BASE_REFS = 2  # the buffer's own reference + getrefcount's argument


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
        raw = (ctypes.c_ubyte * nbytes).from_address(block.ptr)
        base = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
        # the block returns to the pool only when the base (so every view) is gone
        weakref.finalize(base, pool.release, block)
        self._base: np.ndarray[Any, np.dtype[np.uint8]] | None = base
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
        """How many NumPy views (and things derived from them) are alive."""
        base = self._base
        if base is None:
            return 0
        return sys.getrefcount(base) - BASE_REFS - 1  # minus the local name

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
        return base[:need].view(dt).reshape(shape)

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
        views = sys.getrefcount(base) - BASE_REFS - 1
        if views:
            return (
                f"the pinned buffer has {views} live view(s) (as_array results or arrays, "
                "slices or memoryviews made from them); drop them before handing it to a transfer"
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
