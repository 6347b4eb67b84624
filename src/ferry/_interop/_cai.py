"""Interop with other GPU libraries: the CUDA Array Interface, foreign arrays, stream handles.

Stream-ordered, never host-waited
---------------------------------
A device array made by another library (PyTorch, CuPy, Numba, JAX, ...) may
still be written by kernels on that library's stream when it is handed to
ferry. ferry does not wait on the host for them: it records an event on the
producer's stream (the CUDA Array Interface v3 ``stream`` field) and makes its
copy stream wait for that event (``cuStreamWaitEvent``), so the copy runs
after the producer's work and the call returns at once. A producer failure is
a device error the copy's event reports: it surfaces as the transfer's
``TransferFailedError``. The foreign object is retained until the transfer is
settled; ferry cannot stop other code from using it meanwhile, so the rules
for a foreign array in flight are the caller's to keep.

In the other direction, a ferry array exported while an upload into it may
still be running (after :meth:`~ferry.PendingUpload.hand_off`) names ferry's
copy stream in its interface, so a consumer that honours the protocol orders
its work after the copy; :meth:`~ferry.PendingUpload.hand_off` with a stream
does the same with an event, without naming ferry's stream. The interface
names no *consumer* stream, so an exported array is freed only once the whole
device has been idle (see ``_memory/_device.py``), unless
:meth:`~ferry.DeviceArray.record_stream` names the consumer's streams.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import BufferMovedError, TransferSubmitError
from .._state import CLOSED, OWNED, State

__all__: list[str] = []

CAI_VERSION = 3


def stream_handle_of(stream: Any) -> int:
    """The integer handle of a stream given as an int, a PyTorch or CuPy stream, or
    anything with ``__cuda_stream__`` (the CUDA stream protocol)."""
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        return int(stream.ptr)
    raise TypeError(f"not a stream: {type(stream).__name__} (give an int handle, a PyTorch or a CuPy stream)")


class Foreign:
    """A foreign device array taking part in one transfer (retained until it is settled)."""

    __slots__ = ("_leases", "_nbytes", "_ptr", "_state", "dtype", "imported", "obj", "readonly", "shape", "stream")

    _state: State

    def __init__(
        self, obj: Any, ptr: int, nbytes: int, shape: tuple[int, ...], dtype: np.dtype[Any],
        stream: int | None, readonly: bool,
    ) -> None:
        self.obj = obj
        self._ptr = ptr
        self._nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self.stream = stream
        self.readonly = readonly
        self._state = OWNED
        self._leases = 0
        self.imported: Any = None  # the consumed DLPack capsule, when the array came that way

    def _release_for_close(self) -> None:
        self._state = CLOSED


def interface_of(obj: Any) -> dict[str, Any] | None:
    """The CUDA Array Interface of a foreign device array, read once; ``None`` when ``obj``
    has none. Callers handle ferry arrays first. Raises TransferSubmitError when reading it fails."""
    name = "__cuda_array_interface__"
    if not hasattr(type(obj), name) and not hasattr(obj, name):  # a property is found without computing it
        return None
    try:
        cai = obj.__cuda_array_interface__
    except BufferMovedError:
        raise
    except Exception as exc:
        raise TransferSubmitError(f"could not read the CUDA Array Interface of {type(obj).__name__}: {exc}") from exc
    if not isinstance(cai, dict):
        raise TransferSubmitError(f"the CUDA Array Interface of {type(obj).__name__} is not a dict")
    return cai


def foreign_from(obj: Any, cai: dict[str, Any], *, write: bool) -> Foreign:
    """A foreign array from its CUDA Array Interface ``cai`` (:func:`interface_of`);
    refuses what ferry cannot copy."""
    shape = tuple(int(s) for s in cai["shape"])
    dtype = np.dtype(cai.get("descr") if cai.get("descr") and len(cai["descr"]) > 1 else cai["typestr"])
    if dtype.hasobject:
        raise TransferSubmitError(f"{type(obj).__name__} holds objects, not bytes")
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
        raise TransferSubmitError(
            f"the {type(obj).__name__} is not C-contiguous (strides {tuple(strides)}); "
            "make it contiguous before handing it to ferry"
        )
    if cai.get("mask") is not None:
        raise TransferSubmitError("masked CUDA arrays are not copied")
    if write and readonly:
        raise TransferSubmitError(f"the {type(obj).__name__} is read-only; it cannot be an upload destination")
    count = 1
    for s in shape:
        count *= s
    stream = cai.get("stream") if int(cai.get("version", 0)) >= CAI_VERSION else None
    if stream == 0:
        raise TransferSubmitError("CUDA Array Interface stream 0 is ambiguous (use 1 or 2 for default streams)")
    return Foreign(obj, int(ptr or 0), count * dtype.itemsize, shape, dtype, stream, bool(readonly))


def foreign_from_dlpack(
    obj: Any, device_index: int, copy_stream: int, device: tuple[int, int] | None = None,
    *, producer: int | None = None,
) -> Foreign:
    """Consume ``obj.__dlpack__(stream=<ferry's copy stream>)``: the producer orders that
    stream after its pending work, so no event is needed here. ``device``: what
    ``obj.__dlpack_device__()`` said, when the caller asked already. ``producer``: the
    producer's stream, when ferry orders its copy after it itself (``copy_stream`` is then -1:
    the capsule comes without a synchronization); it becomes the foreign array's ``stream``."""
    from ._dlpack import KDL_CUDA, Imported

    if device is None:
        device = tuple(obj.__dlpack_device__())
    if device != (KDL_CUDA, device_index):
        raise TransferSubmitError(
            f"the {type(obj).__name__} lives on DLPack device {device}, not CUDA device {device_index}"
        )
    try:
        capsule = obj.__dlpack__(stream=copy_stream)
    except Exception as exc:
        raise TransferSubmitError(f"{type(obj).__name__}.__dlpack__ failed: {exc}") from exc
    imported = Imported(capsule)
    itemsize = imported.dtype.itemsize
    if imported.strides is not None and imported.strides != tuple(
        s // itemsize for s in _c_strides(imported.shape, itemsize)
    ):
        imported.release()
        raise TransferSubmitError(f"the {type(obj).__name__} is not C-contiguous; make it contiguous first")
    count = 1
    for s in imported.shape:
        count *= s
    foreign = Foreign(obj, imported.ptr, count * itemsize, imported.shape, imported.dtype, producer, False)
    foreign.imported = imported
    return foreign


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
