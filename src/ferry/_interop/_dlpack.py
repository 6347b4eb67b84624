"""DLPack: exporting ferry arrays and importing other libraries' device arrays.

A DLPack capsule carries a ``DLManagedTensor``: the tensor's description plus
a deleter the consumer calls when it is done with the memory. Exporting, ferry
makes the structure (in the extension, the tensor holding a reference to the
exported array; with ctypes, a registry holding it) and keeps the array alive
until the deleter runs (or until the capsule dies unconsumed), and
honours the producer obligation of ``__dlpack__(stream=...)``: if an upload
into the array may still be running (a hand-off), the consumer's stream is
made to wait for it on the device (a staged upload on CUDA is waited for on
the host). Importing, ferry asks the producer for a
capsule ordered on ferry's own copy stream (``__dlpack__(stream=<copy
stream>)``: the producer makes that stream wait for its pending work), reads
the description, marks the capsule used and calls its deleter once the
transfer is settled.

Only the legacy (unversioned) capsule is produced and consumed; every
producer that implements the versioned one also accepts a call without
``max_version``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from .._errors import TransferSubmitError

__all__: list[str] = []

KDL_CUDA = 2
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool
_KINDS = {v: k for k, v in _CODES.items()}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_NAME = b"dltensor"
_USED = b"used_dltensor"

# exported tensors alive until their deleter runs: address -> (struct, shape array, owner)
_exports: dict[int, tuple[Any, Any, Any]] = {}
_lock = threading.Lock()


def _release(managed: Any) -> None:
    _release_at(ctypes.cast(managed, ctypes.c_void_p).value or 0)


def _release_at(address: int) -> None:
    with _lock:
        _exports.pop(address, None)


def _make_deleter() -> Any:
    """The tensors' deleter: the compiled one when the extension is built (it does nothing once the
    interpreter is finalized, where a consumer such as PyTorch may free a tensor at exit), else a
    ctypes callback."""
    try:  # even with FERRY_NATIVE=0, which picks the engines: this is a matter of not crashing at exit
        from .._native import _engine
    except ImportError:
        return _DELETER(_release)
    make = getattr(_engine, "dlpack_deleter", None)  # an older binary has none
    return _DELETER(_release) if make is None else _DELETER(make(_release_at))


_deleter = _make_deleter()


def _destroy_capsule(capsule: int) -> None:
    # the capsule died: if nobody consumed it, the tensor is released here
    if _api.PyCapsule_IsValid(capsule, _NAME):
        address = _api.PyCapsule_GetPointer(capsule, _NAME)
        with _lock:
            _exports.pop(address or 0, None)


_capsule_destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_destroy_capsule)


def _destructor_address() -> int:
    """The capsule destructor: the compiled one when the extension is built (it keeps an
    exception that a consumer left pending, as NumPy does when it refuses a CUDA tensor), else a
    ctypes callback (which cannot, so such a consumer's error turns into a SystemError there)."""
    try:
        from .._native import _engine
    except ImportError:
        return int(ctypes.cast(_capsule_destructor, ctypes.c_void_p).value or 0)
    return int(_engine.dlpack_capsule_destructor())


_DESTRUCTOR = _destructor_address()


def _compiled() -> tuple[Any, Any, Any]:
    """``(dlpack_export, dlpack_import, dlpack_release)`` of the extension, or Nones where ctypes
    serves: no extension, or ``FERRY_NATIVE=0`` (which keeps the ctypes path tested)."""
    from .. import _native

    _engine = _native.load()
    if _engine is None:
        return None, None, None
    export = getattr(_engine, "dlpack_export", None)
    consume = getattr(_engine, "dlpack_import", None)
    release = getattr(_engine, "dlpack_release", None)
    if export is None or consume is None or release is None:  # an older binary: all three from ctypes
        return None, None, None
    return export, consume, release


_export, _import_capsule, _release_tensor = _compiled()


def live_exports() -> int:
    """Exported tensors whose consumer has not released them yet (both the compiled and the ctypes ones)."""
    compiled = 0
    if _export is not None:
        from .._native import _engine

        compiled = int(_engine.dlpack_exports_live())
    with _lock:
        return len(_exports) + compiled


def dtype_to_dl(dtype: np.dtype[Any]) -> DLDataType:
    code = _CODES.get(dtype.kind)
    if code is None or dtype.fields is not None:
        raise BufferError(f"dtype {dtype} has no DLPack equivalent")
    return DLDataType(code, dtype.itemsize * 8, 1)


def dl_to_dtype(dl: DLDataType) -> np.dtype[Any]:
    kind = _KINDS.get(int(dl.code))
    if kind is None or dl.lanes != 1:
        raise TransferSubmitError(f"DLPack dtype (code {dl.code}, {dl.bits} bits, {dl.lanes} lanes) is not copied")
    if kind == "b":
        return np.dtype(np.bool_)
    return np.dtype(f"{kind}{dl.bits // 8}")


def export_capsule(owner: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any], device: tuple[int, int]) -> Any:
    """A ``dltensor`` capsule over ``ptr``; ``owner`` stays alive until the consumer is done
    (compiled where the extension is built: the tensor holds the reference)."""
    if _export is not None:
        code = _CODES.get(dtype.kind)
        if code is None or dtype.fields is not None:
            raise BufferError(f"dtype {dtype} has no DLPack equivalent")
        return _export(owner, ptr, shape, code, dtype.itemsize * 8, device[0], device[1])
    managed = DLManagedTensor()
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = DLDevice(*device)
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = dtype_to_dl(dtype)
    managed.dl_tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _lock:
        _exports[address] = (managed, dims, owner)
    return _api.PyCapsule_New(address, _NAME, _DESTRUCTOR)


class Imported:
    """A consumed capsule: the description, and the deleter to call once ferry is done.

    The capsule is read and renamed ``used_dltensor`` (the producer's
    destructor then leaves the tensor alone) in one compiled call where the
    extension is built, else through ctypes; either way :meth:`release`
    calls the tensor's deleter once, with the GIL released.
    """

    __slots__ = ("_done", "device", "dtype", "managed", "ptr", "shape", "strides")

    def __init__(self, capsule: Any) -> None:
        if _import_capsule is not None:
            try:
                managed, ptr, dev_type, dev_id, shape, strides, code, bits, lanes = _import_capsule(capsule)
            except ValueError:
                raise TransferSubmitError("__dlpack__ did not return an unused 'dltensor' capsule") from None
            try:  # the capsule is ours now: a tensor refused here is released here
                self.dtype = dl_to_dtype(DLDataType(code, bits, lanes))
            except BaseException:
                _release_tensor(managed)
                raise
            self.managed: Any = managed
            self.device = (dev_type, dev_id)
            self.shape: tuple[int, ...] = shape
            self.strides: tuple[int, ...] | None = strides
            self.ptr: int = ptr
            self._done = False
            return
        raw = ctypes.c_void_p(id(capsule))  # the capsule object's address (CPython)
        if not _api.PyCapsule_IsValid(raw, _NAME):
            raise TransferSubmitError("__dlpack__ did not return an unused 'dltensor' capsule")
        pointer = _api.PyCapsule_GetPointer(raw, _NAME)
        self.managed = ctypes.cast(pointer, ctypes.POINTER(DLManagedTensor))
        tensor = self.managed.contents.dl_tensor
        self.device = (int(tensor.device.device_type), int(tensor.device.device_id))
        ndim = int(tensor.ndim)
        self.shape = tuple(int(tensor.shape[i]) for i in range(ndim))
        self.dtype = dl_to_dtype(tensor.dtype)
        self.ptr = int(tensor.data or 0) + int(tensor.byte_offset)
        self.strides = None if not tensor.strides else tuple(int(tensor.strides[i]) for i in range(ndim))
        _api.PyCapsule_SetName(capsule, _USED)  # ours now: the producer's destructor leaves it alone
        self._done = False

    def release(self) -> None:
        """Call the producer's deleter, once."""
        if self._done:
            return
        self._done = True
        if isinstance(self.managed, int):
            _release_tensor(self.managed)
            return
        deleter = self.managed.contents.deleter
        if deleter:
            deleter(self.managed)
