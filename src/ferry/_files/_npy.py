"""``.npy`` files: ``ferry.load_npy`` and ``ferry.save_npy``.

NumPy's format: a magic string, a version, a header (a Python dict literal
with ``descr``, ``fortran_order`` and ``shape``) padded to 64 bytes, then the
array's bytes. The header is read and written with ``numpy.lib.format``; the
bytes go through the file route like one tensor of a checkpoint.
"""

from __future__ import annotations

import io
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ._common import CheckpointError, Entry, convert, device_source, load_entries, runtime_arg, to_arg, write_pieces
from ._dtypes import Kind, kind_of_dtype, numpy_dtype

if TYPE_CHECKING:
    from .._runtime import Runtime

__all__ = ["load_npy", "save_npy"]


def _read_header(name: str) -> tuple[tuple[int, ...], np.dtype[Any], int, int]:
    fmt = np.lib.format
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                version = fmt.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = fmt.read_array_header_1_0(f)
                elif version in ((2, 0), (3, 0)):
                    shape, fortran, dtype = fmt.read_array_header_2_0(f)
                else:
                    raise ValueError(f"unknown .npy version {version}")
            except ValueError as exc:
                raise CheckpointError(f"{name!r} is not a valid .npy file: {exc}") from None
            start = f.tell()
    except OSError as exc:
        raise CheckpointError(f"cannot read {name!r}: {exc.strerror or exc}") from None
    if fortran:
        raise CheckpointError(f"{name!r} holds a Fortran-ordered array; ferry loads C-ordered arrays only")
    if dtype.hasobject:
        raise CheckpointError(f"{name!r} holds Python objects (dtype {dtype}); ferry copies bytes only")
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not dtype.isnative):
        raise CheckpointError(f"{name!r} is big-endian ({dtype}); ferry does not swap bytes on the device")
    return tuple(int(d) for d in shape), dtype, start, size


def load_npy(
    path: str | os.PathLike[str], *, runtime: Runtime | None = None, to: str | None = None,
    direct: bool | None = None,
) -> Any:
    """Load a ``.npy`` file onto the device: a :class:`~ferry.DeviceArray`, or with ``to="torch" |
    "cupy" | "jax"`` that library's array (no copy on the device).

    The bytes are read once into pinned slots and DMA'd to the array (see
    :func:`ferry.load_safetensors` for ``runtime``, ``direct`` and the guarantees).

    Raises
    ------
    CheckpointError
        Not a ``.npy`` file, a Fortran-ordered or big-endian or object array, a file shorter than its
        header says, a failed read; nothing stays allocated.
    """
    to = to_arg(to)
    rt = runtime_arg(runtime)
    name = os.fsdecode(path)
    shape, dtype, start, size = _read_header(name)
    kind: Kind | None
    try:
        kind = kind_of_dtype(dtype)
    except TypeError:
        kind = None
    if to is not None and kind is None:
        raise CheckpointError(f"{name!r}: dtype {dtype} has no equivalent in {to}")
    carrier = np.dtype(kind.carrier) if (to is not None and kind is not None) else dtype
    nbytes = math.prod(shape) * dtype.itemsize  # Python's ints: NumPy's int64 product wraps for a huge shape
    entry = Entry("array", start, nbytes, shape, kind or Kind(str(dtype), dtype.itemsize * 8, dtype.str, dtype.str,
                                                               None, None, None), carrier)
    arrays = load_entries(rt, name, [entry], expect_size=size, direct=direct, progress=None)
    return convert(arrays, {"array": entry}, to)["array"]


def save_npy(array: Any, path: str | os.PathLike[str], *, runtime: Runtime | None = None) -> None:
    """Write a device array (a :class:`~ferry.DeviceArray`, or a CUDA array of PyTorch, CuPy or JAX)
    into a ``.npy`` file that ``numpy.load`` reads.

    Written from pinned slots with ``pwrite``, under a temporary name renamed into place once complete.
    Raises :class:`~ferry.CheckpointError` when the file cannot be written.
    """
    from .._device_array import DeviceArray

    rt = runtime_arg(runtime)
    source, sync = device_source(rt, "array", array)
    dtype = array.dtype if isinstance(array, DeviceArray) else numpy_dtype(source.kind, "the array")
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(source.shape)}
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    head = buffer.getvalue()  # the magic, the version and the padded header
    if sync is not None:
        sync()
    write_pieces(rt, path, head, [source], [len(head)], len(head) + source.nbytes)
