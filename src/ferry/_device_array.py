"""DeviceArray: device memory owned by a runtime, with its ownership state.

A device array has no host-side data access; what ferry guards is which
transfers may use it at the same time:

* ``owned``: any transfer may use it, ``close()`` frees it.
* ``read_leased``: it is the source of one or more pending downloads. It may be
  the source of further downloads; it may not be an upload destination or be
  freed, and dropping every user reference to it does not free it (the
  transfers hold it).
* ``in_flight``: it is the destination of a pending upload: every use raises.
* ``abandoned``: a transfer on it failed: every use raises, its memory is never freed.
* ``closed``: freed.

Freeing never happens inside a finalizer: a collected array's address goes to
the runtime's deferred-free list, drained by the next ordinary call. The free
is stream-ordered after every stream that may still use the array: the
streams it was handed off to, the ``stream`` a DLPack consumer named, and those
given to :meth:`DeviceArray.record_stream`; an array exported where no stream
is known (the CUDA Array Interface, ``ptr``) is freed only after the device
has been idle once (see ``_memory/_device.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._backends._base import DeviceError
from ._errors import BufferMovedError
from ._interop._cai import CAI_VERSION
from ._interop._dlpack import export_capsule
from ._native.objects import ArrayFields
from ._state import ABANDONED, CLOSED, IN_FLIGHT, OWNED, READ_LEASED, State

if TYPE_CHECKING:
    from ._memory._device import DeviceMemory

__all__ = ["DeviceArray"]

_FACTORY = object()


class DeviceArray(ArrayFields):
    """A C-contiguous array in device memory, owned by one runtime.

    Create one with :meth:`ferry.Runtime.empty` or :meth:`ferry.Runtime.to_device`.
    """

    __slots__ = ("__weakref__",)  # the fields are ArrayFields' (_dtype, _leases, _memory, _nbytes, _ptr, ...)

    def __init__(
        self,
        owner: object,
        memory: DeviceMemory,
        ptr: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        nbytes: int,
        *,
        _token: object = None,
    ) -> None:
        if _token is not _FACTORY:
            raise TypeError("DeviceArray is created by Runtime.empty(shape, dtype)")
        self._runtime = owner  # identity only: the runtime that may submit it
        self._memory = memory
        self._ptr = ptr
        self._shape = shape
        self._dtype = dtype
        self._nbytes = nbytes
        self._state: State = OWNED
        self._leases = 0
        self._ready: Any = None  # the pending upload this array was handed off by (see hand_off)

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """The array's NumPy dtype."""
        return self._dtype

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self._nbytes

    @property
    def size(self) -> int:
        """Number of elements."""
        return self._nbytes // self._dtype.itemsize if self._dtype.itemsize else 0

    @property
    def device(self) -> int:
        """The device index."""
        return self._memory.device

    @property
    def state(self) -> State:
        """``"owned"``, ``"read_leased"``, ``"in_flight"``, ``"abandoned"`` or ``"closed"``."""
        if self._state is OWNED and self._leases:
            return READ_LEASED
        return self._state

    @property
    def ptr(self) -> int:
        """The raw device address: an escape hatch, valid while owned or read-leased.

        Work you enqueue on it yourself is not ordered with ferry's transfers.
        Since ferry cannot know on which stream that work runs, an array whose
        address was taken is freed only after the whole device has been idle
        once (a background thread synchronizes it), unless
        :meth:`record_stream` names the streams afterwards.
        """
        if self._state is not OWNED:
            raise BufferMovedError(f"cannot take the address of a device array that is {self._state}")
        self._memory.note_unknown(self._ptr)
        return self._ptr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface, version 3, for CuPy, Numba, PyTorch and others.

        Available while the array is owned (writable) or read-leased (marked
        read-only). If an upload handed the array off before it completed,
        ``stream`` names ferry's copy stream so that the consumer orders its
        work after the copy; otherwise it is ``None`` (nothing to wait for).
        Raises :class:`~ferry.BufferMovedError` while in flight, abandoned or
        closed. Like ``ptr``, what the consumer then does with the memory is
        outside ferry's checks: do not hand the array to a transfer while a
        consumer still uses it.

        The interface names no consumer stream, so the consumer may use any:
        once exported this way, the array's memory is freed only after the
        whole device has been idle once (a background thread synchronizes
        it; the caller never waits). :meth:`record_stream` after the export
        names the streams instead.
        """
        return export_cai(self)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """Refused: NumPy cannot read device memory. Raises ``TypeError`` naming the calls that copy to the host."""
        raise TypeError("a DeviceArray is in device memory, which NumPy cannot read: copy it to the host with "
                        "rt.to_host(array) or rt.download(array)")

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, device)``."""
        return (2, self.device)

    def __dlpack__(
        self, *, stream: int | None = None, max_version: Any = None, dl_device: Any = None, copy: bool | None = None
    ) -> Any:
        """A DLPack capsule over the array (no copy), for ``torch.from_dlpack``, ``cupy.from_dlpack``,
        ``jax.dlpack.from_dlpack``.

        Producer obligation: if an upload into the array may still be running
        (a hand-off), ``stream`` (the consumer's stream; ``None`` means the
        legacy default stream, ``-1`` no synchronization) is made to wait for
        it on the device, without waiting for the copy on the host (a staged
        upload on CUDA: only until its lanes have enqueued their last chunks). Same conditions as
        ``__cuda_array_interface__``; ``copy=True`` and other devices are
        refused with ``BufferError``.

        The consumer's stream is remembered: the array's memory is freed only
        after the work queued there when the array died (an event recorded
        then). With ``stream=-1`` or the per-thread default stream (``2``)
        no stream is known, and the rule of ``__cuda_array_interface__``
        applies.
        """
        if copy:
            raise BufferError("ferry exports its memory without copies")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the array lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        state = self.state
        if state not in (OWNED, READ_LEASED):
            raise BufferMovedError(f"cannot export a device array that is {state}")
        consumer = 1 if stream is None else int(stream)
        ready = self._ready
        if ready is not None and not ready.done and consumer != -1:
            try:
                self._memory.order_export(ready, consumer)
            except DeviceError as exc:  # internal: the consumer sees what DLPack consumers expect
                raise BufferError(f"could not order the consumer's stream after the pending upload: {exc}") from exc
        self._memory.note_stream(self._ptr, consumer)
        return export_capsule(self, self._ptr, self._shape, self._dtype, self.__dlpack_device__())

    def record_stream(self, stream: Any) -> None:
        """Declare that work on ``stream`` uses this array: its memory is freed only after that work.

        ``stream`` is an int handle, a ``torch.cuda.Stream``, a
        ``cupy.cuda.Stream`` or anything with ``__cuda_stream__``; a stream
        object is kept alive until the array is freed, an int handle must
        stay valid until then. When the array dies, an event is recorded on
        each recorded stream and the free waits for it on the device (no host
        wait), as ``torch.Tensor.record_stream`` does for PyTorch's allocator.
        Streams given to :meth:`~ferry.PendingUpload.hand_off` and to
        ``__dlpack__`` are recorded without this call.

        It is also a declaration: every use so far (through
        ``__cuda_array_interface__`` or ``ptr``, which name no stream) is on
        the streams recorded, so the array no longer waits for the whole
        device to be idle before its memory is freed. Call it after such an
        export, naming every stream that used it.

        Raises
        ------
        BufferMovedError
            The array is closed or abandoned.
        TypeError
            ``stream`` is not a stream.
        """
        if self._state is CLOSED or self._state is ABANDONED:
            raise BufferMovedError(f"cannot record a stream on a device array that is {self._state}")
        self._memory.declare(self._ptr, stream)

    def close(self) -> None:
        """Free the device memory now.

        Idempotent once closed; a no-op when abandoned (never freed). Raises
        :class:`~ferry.BufferMovedError` while in flight or read-leased, and
        while an upload that handed it off has not been waited (the copy may
        still write it; dropping the array instead frees it once the upload
        completes). The memory goes back to the pool after every stream that
        may still use it (see :meth:`record_stream`).
        """
        state = self._state
        if state is CLOSED or state is ABANDONED:  # (an abandoned read source keeps its lease count)
            return
        if state is IN_FLIGHT or self._leases:
            raise BufferMovedError(f"cannot close a device array that is {self.state}; wait() for it first")
        ready = self._ready
        if ready is not None and not ready.done:
            raise BufferMovedError(
                "cannot close a device array while the upload that handed it off may still write it; "
                "wait() for that upload first (or drop the array: it is freed once the upload completes)"
            )
        self._state = CLOSED
        self._memory.free(self._ptr, self._nbytes)

    def __del__(self) -> None:
        # never calls the backend: the address is freed by the runtime's next call
        if getattr(self, "_state", None) == OWNED:
            self._state = CLOSED
            self._memory.defer(self._ptr, self._nbytes)

    def __repr__(self) -> str:
        return f"<DeviceArray shape={self._shape} dtype={self._dtype} device={self.device} {self.state}>"

    # -- for the runtime ----------------------------------------------------------------
    def _submission_problem(self, owner: object, *, write: bool) -> str | None:
        if self._runtime is not owner:
            return "the device array belongs to another runtime"
        if self._state is not OWNED:
            return f"the device array is {self._state}"
        if write and self._leases:
            return (
                f"the device array is read-leased by {self._leases} pending download(s); "
                "it cannot be an upload destination until they are waited"
            )
        return None

    def _release_for_close(self) -> None:
        if self._state is OWNED:
            self._state = CLOSED
            self._leases = 0


def new_device_array(
    owner: object, memory: DeviceMemory, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any], nbytes: int
) -> DeviceArray:
    """Factory used by :meth:`ferry.Runtime.empty`."""
    array = DeviceArray(owner, memory, ptr, shape, dtype, nbytes, _token=_FACTORY)
    memory.arrays.add(array)
    return array


def new_view(
    owner: object, memory: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any], nbytes: int
) -> DeviceArray:
    """A device array over part of ``memory`` (a slab of several views), not registered with it: the caller
    registers the views together (``DeviceSlab.adopt``)."""
    return DeviceArray(owner, memory, ptr, shape, dtype, nbytes, _token=_FACTORY)


def export_cai(array: DeviceArray) -> dict[str, Any]:
    """The CUDA Array Interface (version 3) of a ferry array that is owned or read-leased."""
    state = array.state
    if state not in (OWNED, READ_LEASED):
        raise BufferMovedError(f"cannot export a device array that is {state}")
    stream = None
    ready = array._ready
    if ready is not None and not ready.done:
        extra = ready.extra
        named = extra.export_stream if extra is not None and extra.job is not None else ready.stream
        if named is not None:
            stream = array._memory.backend.stream_handle(named)
    array._memory.note_unknown(array._ptr)  # the consumer may use any stream: free after the device idled
    descr = array.dtype.descr if array.dtype.names else [("", array.dtype.str)]
    return {
        "shape": array.shape,
        "typestr": array.dtype.str,
        "descr": descr,
        "data": (array._ptr, state is READ_LEASED),
        "strides": None,
        "version": CAI_VERSION,
        "stream": stream,
    }
