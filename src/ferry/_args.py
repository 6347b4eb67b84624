"""Argument checks shared by the facade: a runtime's options, sizes, shapes, timeouts, and allocation errors."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from ._backends._base import DeviceError
from ._errors import FerryError

__all__: list[str] = []

MAX_BYTES = 1 << 48  # larger requests are refused up front (no device has this much)
_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def check_runtime_args(device: Any, retirement_capacity: int, device_pool_limit: int | None) -> None:
    """Refuse a ``Runtime``'s bad options with ``ValueError`` (or ``TypeError``) before anything is made."""
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or device < 0:
        raise ValueError(f"device must be a non-negative int, got {device!r}")
    if retirement_capacity < 1:
        raise ValueError("retirement capacity must be >= 1")
    if device_pool_limit is not None and size_arg(device_pool_limit, "device_pool_limit") < 0:
        raise ValueError("device_pool_limit must be >= 0 (or None: keep everything)")


def size_arg(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    result = int(value)
    if result > MAX_BYTES:
        raise ValueError(f"{name}={result} is larger than any machine's memory")
    return result


def shape_arg(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        dims: tuple[int, ...] = (int(shape),)
    else:
        try:
            dims = tuple(size_arg(s, "a dimension") for s in shape)
        except TypeError as exc:
            raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    return dims


def timeout_arg(timeout: Any) -> float | None:
    """A wait's bound: ``None`` (no bound) or a number of seconds >= 0 (``inf``: no bound either).

    Every call that takes a ``timeout`` checks it here before it waits or changes anything:
    ``ValueError`` for a negative or NaN one, ``TypeError`` for what is not a number.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds (or None: no bound), got {type(timeout).__name__}")
    value = float(timeout)
    if math.isnan(value) or value < 0:
        shown = "NaN" if math.isnan(value) else repr(timeout)
        raise ValueError(f"timeout must be a number of seconds >= 0 (or None: no bound), not {shown}")
    return value


def alloc_error(what: str, nbytes: int, exc: DeviceError) -> Exception:
    if exc.code == _OOM:
        return MemoryError(f"{what} allocation of {nbytes} bytes failed: out of memory ({exc})")
    return FerryError(f"{what} allocation of {nbytes} bytes failed: {exc}")
