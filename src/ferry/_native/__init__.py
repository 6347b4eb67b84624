"""The compiled extension and the rules for choosing it.

``ferry._native._engine`` is a C extension (C11 + pthreads, Python's limited
API, so one abi3 binary serves CPython 3.11-3.13), built from the sources in
this folder (its README lists them; each opens with its contract). It holds
two things:

* the staging engine, which runs the pageable staging lanes on native
  threads, without the GIL;
* the small-transfer fast path: ``Calls``, the driver calls of the pinned
  routes (a copy and its event record, a query, a wait, a batch of copies
  through ``cuMemcpyBatchAsync``) made straight from C, and the host copies of
  the small pageable route (:func:`host_copies`).

It is optional: a machine that could not build it runs the pure-Python
staging engine and makes its driver calls through ``cuda.bindings``;
``FERRY_NATIVE=0`` forces both fallbacks. ``FERRY_MEMCPY_BATCH=0`` keeps
the fast path but submits a batch as a loop of single copies instead of one
``cuMemcpyBatchAsync`` (to compare them).

:func:`load` gives the extension module or ``None``; :func:`status` says which
engine runs and why, in one line for ``python -m ferry info``;
:func:`cuda_entry_points` resolves the driver entry points that a
``mode="cuda"`` engine is built with and :func:`cuda_calls` builds the fast
path (the extension links against no CUDA library: it receives function
addresses from ``cuda.bindings``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

__all__ = [
    "BATCH_ENV_VAR", "ENV_VAR", "array_layout", "cuda_calls", "cuda_entry_points", "host_copies", "hot_types",
    "lease_table", "load", "runtime_lock", "status", "writeable_flags",
]

ENV_VAR = "FERRY_NATIVE"
"""Environment variable: ``0`` forces the pure-Python engine and the ``cuda.bindings`` calls."""

BATCH_ENV_VAR = "FERRY_MEMCPY_BATCH"
"""Environment variable: ``0`` makes the fast path submit a batch as a loop of single copies."""

# cuGetProcAddress resolves each name to the ABI of this CUDA version: 12.0 gives the _v2
# entry points (cuMemcpyHtoDAsync_v2, cuStreamDestroy_v2, ...).
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
    found: dict[str, int] = {}
    for name in names:
        err, address = _proc_address(driver, name, version)
        if err:
            raise RuntimeError(f"cuGetProcAddress({name!r}, {version}) failed with CUresult {err}")
        if address:
            found[name] = address
        elif name in required:
            raise RuntimeError(f"the CUDA driver has no entry point {name!r} for ABI version {version}")
    return found


POOL_ENTRY_POINTS = ("cuMemAllocFromPoolAsync", "cuMemFreeAsync", "cuStreamSynchronize")


def pool_entry_points(driver: Any, version: int = _ABI_VERSION) -> dict[str, int]:
    """The stream-ordered allocator's entry points for ``Calls.mem_pool_alloc``/``mem_free_async``:
    name -> address, those the driver has (``Calls`` takes them only if all three are there)."""
    found: dict[str, int] = {}
    for name in POOL_ENTRY_POINTS:
        err, address = _proc_address(driver, name, version)
        if not err and address:
            found[name] = address
    return found


def _proc_address(driver: Any, name: str, version: int) -> tuple[int, int]:
    """``cuGetProcAddress(name, version)``: ``(CUresult, address)``, the address 0 where there is none."""
    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    result = driver.cuGetProcAddress(name.encode(), version, flags)
    err, pfn = result[0], result[1]  # (err, pfn) or (err, pfn, symbolStatus), by bindings version
    return int(err), int(pfn) if pfn is not None else 0


def batch_entry_point(driver: Any) -> tuple[int, int]:
    """``cuMemcpyBatchAsync`` of this driver: ``(address, abi)``, or ``(0, 0)`` where it has none.

    The ABI follows the driver: CUDA 12.8 and 12.9 drivers have the 12.8
    signature (with ``failIdx``), CUDA 13 drivers also the 13.0 one (without),
    which is taken there. ``FERRY_MEMCPY_BATCH=0`` gives ``(0, 0)``.
    """
    if os.environ.get(BATCH_ENV_VAR, "").strip() == "0":
        return 0, 0
    err, version = driver.cuDriverGetVersion()
    if int(err) or version < 12080:
        return 0, 0
    abi = 13000 if version >= 13000 else 12080
    err, address = _proc_address(driver, "cuMemcpyBatchAsync", abi)
    if err or not address:
        return 0, 0
    return address, abi


def cuda_calls(driver: Any, on_error: Callable[[str, int, int, tuple[Any, ...]], Any]) -> Any:
    """The compiled fast path (``_engine.Calls``) for this driver.

    ``on_error(op, code, stage, args)`` is called with a failed call's CUresult
    (see ``calls.c``); what it returns or raises is the call's outcome.

    Raises
    ------
    RuntimeError
        The extension is not available or the driver lacks an entry point.
    """
    module, why = _import()
    if module is None:
        raise RuntimeError(f"the native engine is not available: {why}")
    points = cuda_entry_points(driver)
    points.update(pool_entry_points(driver))
    address, abi = batch_entry_point(driver)
    if address:
        points["cuMemcpyBatchAsync"] = address
    return module.Calls(points, on_error, batch_abi=abi)


def _copy_in(dst: int, capacity: int, array: Any, nbytes: int = -1) -> int:
    if not array.flags.c_contiguous or array.nbytes > capacity:
        return -1
    nbytes = int(array.nbytes)
    ctypes.memmove(dst, array.ctypes.data, nbytes)
    return nbytes


def _address_of(array: Any, capacity: int, nbytes: int = -1) -> int:
    flags = array.flags
    if not (flags.c_contiguous and flags.writeable) or array.nbytes > capacity:
        return 0
    return int(array.ctypes.data)


def _memcopy(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def host_copies() -> tuple[
    Callable[[int, int, Any, int], int], Callable[[Any, int, int], int], Callable[[int, int, int], None]
]:
    """``(copy_in, address_of, memcopy)`` for the small pageable route: the compiled ones, or Python's.

    ``copy_in(dst, capacity, array, nbytes)`` copies a C-contiguous NumPy
    array of at most ``capacity`` bytes to ``dst`` and returns its size
    (``-1``: not taken); ``address_of(array, capacity, nbytes)`` is the
    address of a writable C-contiguous array of at most ``capacity`` bytes
    (``0``: not taken); ``memcopy(dst, src, nbytes)`` is ``memcpy``. With
    ``nbytes >= 0`` the caller vouches that ``array`` is an exact
    ``numpy.ndarray`` of that size: the compiled copies then read NumPy's
    array struct directly where :func:`array_layout` verified it.
    """
    module = load()
    if module is None:
        return _copy_in, _address_of, _memcopy
    array_layout()
    return module.copy_in, module.address_of, module.memcopy


def data_reader() -> Callable[[Any], int] | None:
    """The compiled read of an exact ``numpy.ndarray``'s data pointer (``ndarray.ctypes.data`` costs
    about a microsecond), or ``None`` where the extension or a verified array layout is missing."""
    module = load()
    if module is None or not array_layout():
        return None
    read: Callable[[Any], int] = module.data_of
    return read


def writeable_flags() -> tuple[Callable[[Any], bool], Callable[[Any], None]] | None:
    """``(clear, restore)`` of an exact ``numpy.ndarray``'s writeable flag, compiled: ``clear(array)``
    says whether it was writeable and clears it, ``restore(array)`` sets it (for an array that owns
    its data); ``None`` where the extension or a verified array layout is missing."""
    module = load()
    if module is None or not array_layout():
        return None
    return module.clear_writeable, module.set_writeable


def runtime_lock() -> threading.RLock:
    """A runtime's lock: the extension's ``RLock`` (``threading.RLock``'s semantics; the compiled
    submit and wait take it with a C call, and its plain ``acquire()`` parses no arguments), or a
    ``threading.RLock`` where the extension is missing.

    Either way a lock held by a thread of the parent process counts as free in a forked child (that
    thread does not exist there): the child takes it at once, so a runtime inherited by the child
    raises its error instead of hanging.
    """
    module = load()
    if module is None:
        lock = threading.RLock()
        _FALLBACK_LOCKS.add(lock)
        return lock
    return cast("threading.RLock", module.RLock())


# threading.RLock does not know about fork: each fallback lock is made free again in a forked child,
# unless the thread that forked (the child's only thread) holds it
_FALLBACK_LOCKS: weakref.WeakSet[Any] = weakref.WeakSet()


def _free_fallback_locks_in_child() -> None:
    for lock in list(_FALLBACK_LOCKS):
        if not lock._is_owned():
            lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_fallback_locks_in_child)


def lease_table() -> Any:
    """A compiled table of read-only leases (``_engine.Leases``: ``take(array, writeable=None)``,
    ``give(array)``, ``table``), or ``None`` where the extension or a verified array layout is
    missing (then :class:`ferry._routes._base.HostLeases` does the same in Python)."""
    module = load()
    if module is None or not array_layout():
        return None
    import numpy as np

    return module.Leases(np.ndarray)


# The classes whose fields the compiled entries read (each derives from its type in ferry._native.objects)
_HOT_TYPES: tuple[tuple[str, str], ...] = (
    ("ferry._buffer", "PinnedHostBuffer"),
    ("ferry._device_array", "DeviceArray"),
    ("ferry._memory._pinned", "Block"),
    ("ferry._lifecycle", "Health"),
    ("ferry._routes._small", "Slot"),
)


@functools.cache
def hot_types() -> bool:
    """Enable the compiled entries' reads of ferry's hot objects (a pinned buffer, a device array, a pool
    block, a runtime's health, a small-route slot).

    Their classes derive from the compiled field types of :mod:`ferry._native.objects`, so the fields
    are read at the offsets the C structs declare; the extension checks each class's base when it is
    registered. ``False`` where the extension does not run.
    """
    module = _import()[0]
    if module is None:
        return False
    import importlib

    try:
        classes = [getattr(importlib.import_module(module_name), name) for module_name, name in _HOT_TYPES]
        module.set_hot_types(*classes)
    except (ImportError, AttributeError, TypeError):
        return False
    return True


@functools.cache
def array_layout() -> bool:
    """Enable the compiled reads of NumPy's array fields (data pointer, flags, shape, dtype) once checked.

    The extension declares NumPy's ``PyArrayObject_fields`` (NumPy's ABI, which every compiled
    extension reads directly) and names the offsets it reads (``array_fields()``). They are used only
    after NumPy's own answers for a few arrays (owned, viewed, strided, read-only, empty, 0-d) match
    what is read there, and toggling the writeable flag through NumPy shows in the flags; otherwise
    the buffer protocol and NumPy's API serve. Only exact ``numpy.ndarray`` instances are read.
    """
    module = _import()[0]
    if module is None or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    import numpy as np

    fields = module.array_fields()
    if not (_layout_matches(fields["data"], fields["flags"])
            and _shape_layout_matches(fields["nd"], fields["dimensions"], fields["descr"])):
        return False
    module.set_array_type(np.ndarray)
    probe = np.zeros(3)
    cleared = module.clear_writeable(probe) and not probe.flags.writeable
    module.set_writeable(probe)
    if not (cleared and probe.flags.writeable):  # the compiled flips must agree with NumPy as well
        module.set_array_type(None)
        return False
    return True


def _shape_layout_matches(nd_at: int, dimensions_at: int, descr_at: int) -> bool:
    import numpy as np

    try:
        samples: list[Any] = [np.zeros(7, np.float32), np.zeros((3, 4))[:, 1], np.zeros((2, 3, 5), np.int16),
                              np.zeros(0), np.zeros(()), np.arange(10)[2:]]
        for array in samples:
            nd = ctypes.c_int.from_address(id(array) + nd_at).value
            dims_at = ctypes.c_void_p.from_address(id(array) + dimensions_at).value or 0
            dims = [ctypes.c_ssize_t.from_address(dims_at + 8 * i).value for i in range(nd)]
            descr = ctypes.c_void_p.from_address(id(array) + descr_at).value
            if nd != array.ndim or tuple(dims) != array.shape or descr != id(array.dtype):
                return False
    except Exception:
        return False
    return True


def _layout_matches(data_at: int, flags_at: int) -> bool:
    """Whether NumPy's answers for a few arrays match what is read at those offsets."""
    import numpy as np

    try:
        samples: list[Any] = [np.zeros(7, np.float32), np.zeros((3, 4))[:, 1], np.frombuffer(b"abcd", np.uint8),
                              np.zeros(0), np.arange(10)[2:]]
        for array in samples:
            data = ctypes.c_void_p.from_address(id(array) + data_at).value
            flags = ctypes.c_int.from_address(id(array) + flags_at).value
            if data != array.ctypes.data or flags != array.flags.num:
                return False
        probe = np.zeros(3)
        before = ctypes.c_int.from_address(id(probe) + flags_at).value
        probe.setflags(write=False)
        after = ctypes.c_int.from_address(id(probe) + flags_at).value
    except Exception:
        return False
    return bool(before & 0x0400) and not after & 0x0400 and probe.flags.num == after
