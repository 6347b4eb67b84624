"""The compiled staging engine and the rules for choosing it.

``ferry._native._engine`` is a C extension (C11 + pthreads, Python's limited
API, so one abi3 binary serves CPython 3.11-3.13) that runs the pageable
staging lanes on native threads, without the GIL; its threading model and
invariants are the essay at the top of ``_engine.c``. It is optional: a
machine that could not build it runs the pure-Python engine in
``ferry._staging``, and ``FERRY_NATIVE=0`` forces that one.

:func:`load` gives the extension module or ``None``; :func:`status` says which
engine runs and why, in one line for ``python -m ferry info``;
:func:`cuda_entry_points` resolves the driver entry points that a
``mode="cuda"`` engine is built with (the extension links against no CUDA
library: it receives function addresses from ``cuda.bindings``).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

__all__ = ["ENV_VAR", "cuda_entry_points", "load", "status"]

ENV_VAR = "FERRY_NATIVE"
"""Environment variable: ``0`` forces the pure-Python engine."""

# cuGetProcAddress resolves each name to the ABI of this CUDA version: 12.0 gives the _v2
# entry points (cuMemcpyHtoDAsync_v2, cuStreamDestroy_v2, cuStreamWriteValue32_v2, ...).
_ABI_VERSION = 12000


def _forced_off() -> bool:
    return os.environ.get(ENV_VAR, "").strip() == "0"


@functools.cache
def _import() -> tuple[ModuleType | None, str]:
    """Import the extension once; remember the module or why it is missing."""
    try:
        from . import _engine
    except ImportError as exc:
        return None, f"python: the extension is not built (ImportError: {exc})"
    except Exception as exc:  # a broken binary: serve with the Python engine, say why
        return None, f"python: the extension failed to load ({type(exc).__name__}: {exc})"
    return _engine, "native"


def load() -> ModuleType | None:
    """The extension module, or ``None`` when the Python engine must run.

    Returns
    -------
    ModuleType or None
        ``ferry._native._engine`` (its API is typed in ``_engine.pyi``), or
        ``None`` when ``FERRY_NATIVE=0`` is set or the extension cannot be
        imported; :func:`status` then says why. The environment is read on
        every call, the import is tried once per process.
    """
    if _forced_off():
        return None
    module, _ = _import()
    return module


def status() -> str:
    """Which staging engine runs and why, in one line.

    Returns
    -------
    str
        ``"native"``, ``"python: FERRY_NATIVE=0"``, or ``"python: the
        extension is not built (ImportError: ...)"`` (or ``"... failed to
        load (...)"`` for a binary that is present but broken).
    """
    if _forced_off():
        return f"python: {ENV_VAR}=0"
    return _import()[1]


def cuda_entry_points(driver: Any, version: int = _ABI_VERSION) -> dict[str, int]:
    """Resolve the driver entry points a ``mode="cuda"`` engine needs.

    Parameters
    ----------
    driver
        The ``cuda.bindings.driver`` module, already initialized (``cuInit``).
    version
        The CUDA ABI version to resolve against (12000: the ``_v2`` entry
        points, which every CUDA 12 and 13 driver has).

    Returns
    -------
    dict of str to int
        Entry point name -> function address, for ``Engine(entry_points=...)``.
        Optional entry points the driver lacks are left out.

    Raises
    ------
    RuntimeError
        The extension is not available, ``cuGetProcAddress`` failed, or a
        required entry point is missing.
    """
    module, why = _import()
    if module is None:
        raise RuntimeError(f"the native engine is not available: {why}")
    names: tuple[str, ...] = module.entry_point_names()
    required = names[: len(names) - 2]  # the last two (error texts) are optional
    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    found: dict[str, int] = {}
    for name in names:
        result = driver.cuGetProcAddress(name.encode(), version, flags)
        err, pfn = result[0], result[1]  # (err, pfn) or (err, pfn, symbolStatus), by bindings version
        if int(err):
            raise RuntimeError(f"cuGetProcAddress({name!r}, {version}) failed with CUresult {int(err)}")
        address = int(pfn) if pfn is not None else 0
        if address:
            found[name] = address
        elif name in required:
            raise RuntimeError(f"the CUDA driver has no entry point {name!r} for ABI version {version}")
    return found
