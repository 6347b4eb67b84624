"""The element types of checkpoint files, and what each becomes in NumPy, PyTorch, CuPy and JAX.

A device array is bytes with a dtype attached. Every format dtype has a
*carrier*: a plain NumPy dtype of the same size (``int16`` for ``BF16``,
``int8`` for the 8-bit floats) that every DLPack consumer understands. The
bytes are loaded once, into an array of the dtype the caller asked for:
NumPy's own where it has one, ``ml_dtypes``' (``bfloat16``,
``float8_e4m3fn``, ...) where it does not, or the carrier when the array is
handed to a library, which then views it as its own dtype (no copy).

Sub-byte formats (``F4``, ``F6_E2M3``, ``F6_E3M2``) are bit-packed in the
file; they load as their packed bytes (``uint8``), the last axis counted in
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__: list[str] = []

EXTRA_HINT = "install the optional extra: pip install 'ferry[files]' (it installs ml_dtypes)"


@dataclass(frozen=True, slots=True)
class Kind:
    """One format dtype: its name, bits per element, NumPy carrier, and the names other libraries use."""

    name: str
    bits: int
    carrier: str  # a NumPy dtype of the same size (packed bytes for sub-byte kinds)
    numpy: str | None  # NumPy's own dtype, when it has one
    ml_dtypes: str | None  # the ml_dtypes attribute, when NumPy has none
    torch: str | None  # the torch attribute
    jax: str | None  # the jax.numpy attribute

    @property
    def packed(self) -> bool:
        """Whether elements are smaller than a byte (bit-packed in the file)."""
        return self.bits < 8


_KINDS = [
    Kind("BOOL", 8, "bool", "bool", None, "bool", "bool_"),
    Kind("U8", 8, "uint8", "uint8", None, "uint8", "uint8"),
    Kind("I8", 8, "int8", "int8", None, "int8", "int8"),
    Kind("U16", 16, "uint16", "uint16", None, "uint16", "uint16"),
    Kind("I16", 16, "int16", "int16", None, "int16", "int16"),
    Kind("F16", 16, "float16", "float16", None, "float16", "float16"),
    Kind("BF16", 16, "int16", None, "bfloat16", "bfloat16", "bfloat16"),
    Kind("U32", 32, "uint32", "uint32", None, "uint32", "uint32"),
    Kind("I32", 32, "int32", "int32", None, "int32", "int32"),
    Kind("F32", 32, "float32", "float32", None, "float32", "float32"),
    Kind("U64", 64, "uint64", "uint64", None, "uint64", "uint64"),
    Kind("I64", 64, "int64", "int64", None, "int64", "int64"),
    Kind("F64", 64, "float64", "float64", None, "float64", "float64"),
    Kind("C64", 64, "complex64", "complex64", None, "complex64", "complex64"),
    Kind("F8_E4M3", 8, "int8", None, "float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn"),
    Kind("F8_E5M2", 8, "int8", None, "float8_e5m2", "float8_e5m2", "float8_e5m2"),
    Kind("F8_E4M3FNUZ", 8, "int8", None, "float8_e4m3fnuz", "float8_e4m3fnuz", "float8_e4m3fnuz"),
    Kind("F8_E5M2FNUZ", 8, "int8", None, "float8_e5m2fnuz", "float8_e5m2fnuz", "float8_e5m2fnuz"),
    Kind("F8_E8M0", 8, "int8", None, "float8_e8m0fnu", "float8_e8m0fnu", "float8_e8m0fnu"),
    Kind("F6_E2M3", 6, "uint8", None, None, None, None),
    Kind("F6_E3M2", 6, "uint8", None, None, None, None),
    Kind("F4", 4, "uint8", None, None, None, None),
]
KINDS: dict[str, Kind] = {k.name: k for k in _KINDS}


def ml_dtypes_module() -> Any:
    """``ml_dtypes``, or None when it is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


def numpy_dtype(kind: Kind, what: str) -> np.dtype[Any]:
    """The NumPy dtype a :class:`~ferry.DeviceArray` of ``kind`` carries (``what`` names the tensor
    in the error when ``ml_dtypes`` is needed and missing)."""
    if kind.packed:
        return np.dtype(np.uint8)
    if kind.numpy is not None:
        return np.dtype(kind.numpy)
    module = ml_dtypes_module()
    if module is None:
        raise ImportError(f"{what} has dtype {kind.name}, which NumPy lacks; {EXTRA_HINT}")
    found: np.dtype[Any] = np.dtype(getattr(module, str(kind.ml_dtypes)))
    return found


def kind_of_dtype(dtype: Any) -> Kind:
    """The format kind of a NumPy (or ml_dtypes) dtype, or ``TypeError``."""
    dt = np.dtype(dtype)
    if dt.kind != "V" and dt.isnative is False:
        raise TypeError(f"dtype {dt} is not in native byte order")
    for kind in _KINDS:
        if kind.packed:
            continue
        if kind.numpy is not None and np.dtype(kind.numpy) == dt:
            return kind
    module = ml_dtypes_module()
    if module is not None:
        for kind in _KINDS:
            attr = kind.ml_dtypes
            if attr is not None and hasattr(module, attr) and np.dtype(getattr(module, attr)) == dt:
                return kind
    raise TypeError(f"dtype {dt} has no safetensors equivalent")


def kind_of_name(library: str, name: str) -> Kind:
    """The format kind of a library's dtype name (``torch.bfloat16`` -> ``"bfloat16"``), or ``TypeError``."""
    for kind in _KINDS:
        if (kind.torch if library == "torch" else kind.jax) == name:
            return kind
    raise TypeError(f"{library} dtype {name} has no safetensors equivalent")


def packed_shape(kind: Kind, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a packed kind's bytes load as: the last axis counted in bytes."""
    if not shape:
        return (-(-kind.bits // 8),)
    last = shape[-1] * kind.bits
    if last % 8:
        return (-(-int(np.prod(shape, dtype=np.int64)) * kind.bits // 8),)
    return (*shape[:-1], last // 8)
