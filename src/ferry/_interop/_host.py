"""Host arrays: NumPy arrays, and the CPU arrays of other libraries, taken without a copy.

Wherever ferry takes a NumPy array (``upload``, ``download(out=)``,
``to_device``, ``register``, ``ferry.prefetch``), it also takes a CPU array of
another library: one that exports DLPack on the CPU (a CPU PyTorch tensor, a
JAX or CuPy host array) or the buffer protocol (``bytearray``, ``array.array``,
``memoryview``). ferry copies from (or into) a NumPy view of its memory,
``numpy.from_dlpack`` or ``numpy.asarray(memoryview(obj))``, never a copy of
it, and ``wait()`` hands back the object that was handed in.

The guard is the one NumPy arrays have: while the transfer is pending the
view ferry holds is flagged read-only and restored by ``wait()``; like any
other view of the same memory, the object itself is not guarded (ferry cannot
flag another library's array read-only): do not write to it until ``wait()``
returns. A read-only export (``bytes``, a DLPack tensor marked read-only) is
refused as a download's output, as a read-only NumPy array is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import TransferSubmitError
from .._native.objects import ArrayFields, BufferFields

__all__: list[str] = []

_KDL_CPU, _KDL_CUDA_HOST = 1, 3  # DLPack device types in host memory: CPU, CUDA pinned host memory


def _hint(obj: Any) -> str:
    # ferry's PinnedHostBuffer and DeviceArray are the only classes built on these compiled field types
    if isinstance(obj, BufferFields):
        return "; pinned buffers go through upload_pending()/download_pending()"
    if isinstance(obj, ArrayFields):
        return "; device arrays go through copy_pending() (or download them first)"
    return ""


def host_view(obj: Any, call: str, name: str) -> np.ndarray[Any, Any]:
    """``obj`` itself if it is a NumPy array, else a NumPy view of the host memory it exports.

    Raises :class:`~ferry.TransferSubmitError` (nothing done) for anything
    else, saying what is taken: device memory, objects that export nothing,
    exports NumPy cannot view without a copy.
    """
    if isinstance(obj, np.ndarray):
        return obj
    what = (f"{call}: {name} must be a NumPy array or a CPU array that exports DLPack or the buffer protocol, "
            f"got {type(obj).__name__}")
    if isinstance(obj, (BufferFields, ArrayFields)):  # a PinnedHostBuffer or a DeviceArray
        raise TransferSubmitError(what + _hint(obj))
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None and hasattr(obj, "__dlpack__"):
        try:
            kind, index = (int(v) for v in dlpack_device())
        except (TypeError, ValueError) as exc:
            raise TransferSubmitError(f"{what}: its __dlpack_device__() gave no (type, index): {exc}") from None
        if kind not in (_KDL_CPU, _KDL_CUDA_HOST):
            raise TransferSubmitError(
                f"{call}: {name} is on DLPack device ({kind}, {index}), not in host memory; "
                "device arrays go through copy_pending() (or to the host first)"
            )
        try:
            view = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise TransferSubmitError(
                f"{call}: NumPy cannot view the {type(obj).__name__} {name} through DLPack without a copy: {exc}"
            ) from None
        return view
    try:
        exported = memoryview(obj)
    except TypeError:
        raise TransferSubmitError(what + _hint(obj)) from None
    try:
        return np.asarray(exported)
    except (TypeError, ValueError) as exc:  # a buffer format NumPy does not know
        raise TransferSubmitError(f"{call}: NumPy cannot view the {type(obj).__name__} {name}: {exc}") from None


def host_out(obj: Any, call: str) -> np.ndarray[Any, Any]:
    """:func:`host_view` for a download's output, which must be writable."""
    view = host_view(obj, call, "out")
    if view is not obj and not view.flags.writeable:
        raise TransferSubmitError(f"{call}: out is read-only (the {type(obj).__name__} exports its memory read-only)")
    return view


def host_arg(obj: Any, call: str) -> np.ndarray[Any, Any]:
    """:func:`host_view` for an argument that is not a transfer's (``register``): ``TypeError`` for anything else."""
    try:
        return host_view(obj, call, "array")
    except TransferSubmitError as exc:
        raise TypeError(str(exc)) from None
