"""CUDA through ``cuda.bindings.driver``, NVIDIA's official driver bindings.

Only this module imports ``cuda.bindings``. One helper, :func:`_check`, turns a
driver result tuple into a value or a :class:`DeviceError`; only
:meth:`CudaBackend.event_query` treats ``CUDA_ERROR_NOT_READY`` as a value.

Context: the device's primary context is retained once and made current on
every thread that calls in (the driver's current context is per thread).
Allocation and setup calls bind first (a thread-local flag keeps that to one
``cuCtxSetCurrent`` per thread). The hot calls (copies, event record, query,
synchronize) skip that check: they call the driver at once and, only if it
answers that no usable context is current, bind and call again, so the
common case costs exactly one driver call.

The compiled fast path. Where the extension is built, ``FERRY_NATIVE`` is not
``0`` and ``FERRY_CUDA_FAST_PATH`` is not ``0`` (the default since these calls
passed the whole suite and compute-sanitizer on an H200, 2026-11-30), the hot calls
are not the methods below but the bound methods of a compiled ``Calls``
object (``ferry._native``), set on the instance at construction:
``htod_record``/``dtoh_record`` (copy and event record in one C call),
``event_record``, ``event_query``, ``event_wait`` (polls with the GIL
released, back in Python every 2 ms for signals), ``event_synchronize`` and
``copy_batch`` (one ``cuMemcpyBatchAsync`` where the driver has it). They call
the driver entry points directly, with no ``cuda.bindings`` wrapper; streams
and events are then plain ``int`` handles (the raw ``CUstream``/``CUevent``
values, which ``cuda.bindings`` accepts too). A failed compiled call comes
back through :meth:`CudaBackend._native_failed`, which binds the context and
retries once or raises :class:`DeviceError`, as the Python path does. Without
the extension the methods below run: the same contract through
``cuda.bindings``.

Probe: :func:`probe` is the narrow "is a GPU usable" test. Importing the
bindings works without a driver; the first call (``cuInit``) raises
``cuda.pathfinder.DynamicLibNotFoundError`` when ``libcuda`` is missing, and
returns an error code when there is a driver but no usable device. Both become
:class:`DeviceUnavailableError` with the reason; nothing else is swallowed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
import weakref
from typing import Any

from .._errors import DeviceUnavailableError
from ._base import DeviceError

__all__: list[str] = []

# Answers that mean "this thread has no (or the wrong) current context": bind and retry.
_REBIND = {201, 400, 709}  # INVALID_CONTEXT, INVALID_HANDLE, CONTEXT_IS_DESTROYED

# Errors after which the context is unusable (CUDA "sticky" errors).
_STICKY = {
    700,  # ILLEGAL_ADDRESS
    701,  # LAUNCH_OUT_OF_RESOURCES (not sticky in itself, but treated as fatal here)
    702,  # LAUNCH_TIMEOUT
    714,  # HARDWARE_STACK_ERROR
    715,  # ILLEGAL_INSTRUCTION
    716,  # MISALIGNED_ADDRESS
    717,  # INVALID_ADDRESS_SPACE
    718,  # INVALID_PC
    719,  # LAUNCH_FAILED
    999,  # UNKNOWN
}


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # the package is not installed at all
        raise DeviceUnavailableError(
            "the CUDA backend needs the 'cuda-bindings' package "
            "(pip install 'ferry[cuda13]' or 'ferry[cuda12]')"
        ) from exc
    return driver


def _code_text(driver: Any, code: int) -> str:
    """The driver's name and text for a CUresult given as an int."""
    try:
        err = driver.CUresult(code)
    except ValueError:
        return f"CUresult {code}"
    return _error_text(driver, err)


def _calls_failed(ref: Any, op: str, code: int, stage: int, args: tuple[Any, ...]) -> Any:
    """``on_error`` of the compiled calls: the backend's :meth:`CudaBackend._native_failed`."""
    backend = ref()
    if backend is None:
        raise DeviceError(f"CUresult {code}", code=code, sticky=code in _STICKY, enqueued=stage > 0)
    return backend._native_failed(op, code, stage, args)


def _error_text(driver: Any, err: Any) -> str:
    try:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        return f"{name.decode()}: {text.decode()}"
    except Exception:
        return f"CUresult {int(err)}"


def _init(driver: Any) -> None:
    """cuInit, with the narrow no-GPU translation."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError
    except ImportError:  # older bindings: no pathfinder
        DynamicLibNotFoundError = OSError  # noqa: N806
    try:
        (err,) = driver.cuInit(0)
    except DynamicLibNotFoundError as exc:
        raise DeviceUnavailableError(f"no CUDA driver on this machine ({exc})") from exc
    if err:
        raise DeviceUnavailableError(f"cuInit failed: {_error_text(driver, err)}")


def probe(device: int = 0) -> None:
    """Raise :class:`DeviceUnavailableError` unless ``device`` is a usable GPU."""
    driver = _driver()
    _init(driver)
    err, count = driver.cuDeviceGetCount()
    if err:
        raise DeviceUnavailableError(f"cuDeviceGetCount failed: {_error_text(driver, err)}")
    if count == 0:
        raise DeviceUnavailableError("the CUDA driver reports no device")
    if not 0 <= device < count:
        raise DeviceUnavailableError(f"device {device} does not exist ({count} device(s))")


class _Gate:
    __slots__ = ("dev", "host")

    def __init__(self, host: int, dev: int) -> None:
        self.host = host
        self.dev = dev


class _Current:
    """``with backend._current:`` makes the backend's primary context current inside.

    The thread's context before is put back afterwards when it was another one
    (a PyTorch or CuPy user's current device stays theirs); a thread that had
    none keeps ferry's, so its later hot calls need no binding.
    """

    __slots__ = ("_backend", "_saved")

    def __init__(self, backend: CudaBackend) -> None:
        self._backend = backend
        self._saved = threading.local()

    def __enter__(self) -> None:
        b = self._backend
        d = b._d
        err, current = d.cuCtxGetCurrent()
        b._check(err)
        before = int(current) if current is not None else 0
        stack = self._saved.__dict__.setdefault("stack", [])
        if before == b._ctx_id:
            stack.append(None)
            return
        (err,) = d.cuCtxSetCurrent(b._ctx)
        b._check(err)
        stack.append(current if before else None)

    def __exit__(self, *exc: object) -> None:
        before = self._saved.stack.pop()
        if before is not None:
            self._backend._d.cuCtxSetCurrent(before)


class CudaBackend:
    """The CUDA driver API behind the Backend protocol."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        probe(device)
        d = _driver()
        self._d = d
        self.device = device
        self._syncs = 0  # host waits through cuda.bindings (see sync_calls)
        self._pid = os.getpid()
        err, self._dev = d.cuDeviceGet(device)
        self._check(err)
        err, self._ctx = d.cuDevicePrimaryCtxRetain(self._dev)
        self._check(err)
        self._ctx_id = int(self._ctx)
        self._current = _Current(self)
        self._not_ready = d.CUresult.CUDA_ERROR_NOT_READY
        self._success = d.CUresult.CUDA_SUCCESS
        self._cuMemcpyHtoDAsync = d.cuMemcpyHtoDAsync
        self._cuMemcpyDtoHAsync = d.cuMemcpyDtoHAsync
        self._cuEventRecord = d.cuEventRecord
        self._cuEventQuery = d.cuEventQuery
        self._cuEventSynchronize = d.cuEventSynchronize
        self._CUdeviceptr = d.CUdeviceptr
        self._gates: list[_Gate] = []
        self._pools: list[Any] = []  # this backend's memory pools (peers are granted access to them)
        self._closed = False
        self._calls: Any = None  # the compiled fast path, when it runs
        self._retrying = threading.local()
        self._why_bindings = self._use_native(d)

    def _use_native(self, d: Any) -> str:
        """Put the compiled calls in place of the hot methods when the extension runs; else say why not."""
        from .. import _native

        if os.environ.get("FERRY_CUDA_FAST_PATH", "1").strip() == "0":
            return "FERRY_CUDA_FAST_PATH=0 turns the compiled calls off"
        if _native.load() is None:
            return _native.status()
        try:
            calls = _native.cuda_calls(d, functools.partial(_calls_failed, weakref.ref(self)))
        except RuntimeError as exc:
            return str(exc)
        self._calls = calls
        for name in _NATIVE_CALLS + (_NATIVE_POOL_CALLS if calls.pool_calls else ()):
            setattr(self, name, getattr(calls, name))
        return ""

    @property
    def fast_path(self) -> str:
        """Which path the hot calls take, in one line (``python -m ferry info``)."""
        calls = self._calls
        if calls is None:
            return f"cuda.bindings ({self._why_bindings})"
        abi = calls.batch_abi
        pool = "; device pool calls native" if calls.pool_calls else "; device pool calls through cuda.bindings"
        if abi:
            return f"native (batches: cuMemcpyBatchAsync, CUDA {abi // 1000}.{abi % 1000 // 10} ABI{pool})"
        if calls.batch_refused:
            return (f"native (batches: a loop of copies; the driver refused cuMemcpyBatchAsync: "
                    f"{calls.batch_refused}{pool})")
        return f"native (batches: a loop of copies; no cuMemcpyBatchAsync here{pool})"

    @property
    def sync_calls(self) -> int:
        """Host waits so far (event and stream synchronizations, event waits), for tests."""
        return self._syncs + (int(self._calls.waits) if self._calls is not None else 0)

    def fast_path_counts(self) -> dict[str, int]:
        """The compiled path's counters (waits, single copies, batches, batched copies); empty without it."""
        return dict(self._calls.counts()) if self._calls is not None else {}

    # -- plumbing -----------------------------------------------------------------
    def _check(self, err: Any) -> None:
        if err:
            code = int(err)
            raise DeviceError(_error_text(self._d, err), code=code, sticky=code in _STICKY)

    def _native_failed(self, op: str, code: int, stage: int, args: tuple[Any, ...]) -> Any:
        """A compiled call returned ``code`` (``stage``: see ``_native/calls.c``): retry once with the context
        bound when it was not current, else raise :class:`DeviceError` (``enqueued`` past stage 0)."""
        local = self._retrying
        if code in _REBIND and stage < 2 and not getattr(local, "active", False):
            local.active = True
            try:
                with self._current:
                    if stage == 0:
                        return getattr(self._calls, op)(*args)
                    self._calls.event_record(args[-1], args[-2])  # the copies are queued: record again
                    return None
            except DeviceError as exc:
                exc.enqueued = exc.enqueued or stage > 0
                raise
            finally:
                local.active = False
        raise DeviceError(_code_text(self._d, code), code=code, sticky=code in _STICKY, enqueued=stage > 0)

    def _retry(self, err: Any, fn: Any, *args: Any) -> None:
        """A hot call failed: if for want of this context being current, call once more inside it."""
        if int(err) in _REBIND:
            with self._current:
                (err,) = fn(*args)
        if err:
            self._check(err)

    # -- identity ---------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        d = self._d
        with self._current:
            err, raw = d.cuDeviceGetName(256, self._dev)
            self._check(err)
            name = raw.split(b"\0", 1)[0].decode(errors="replace")
            err, version = d.cuDriverGetVersion()
            self._check(err)
            err, total = d.cuDeviceTotalMem(self._dev)
            self._check(err)
            err, bus = d.cuDeviceGetPCIBusId(64, self._dev)
            self._check(err)
            bus_id = bus.split(b"\0", 1)[0].decode().lower()
            engines = self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)
            major = self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            minor = self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            try:
                from cuda.bindings import __version__ as bindings_version
            except ImportError:
                bindings_version = "unknown"
            return {
                "backend": self.name,
                "device": self.device,
                "name": name,
                "compute_capability": f"{major}.{minor}",
                "memory_bytes": int(total),
                "driver": f"CUDA {version // 1000}.{version % 1000 // 10}",
                "driver_version": _kernel_driver_version(),
                "cuda_bindings": bindings_version,
                "pci_bus_id": bus_id,
                "link": _pcie_link(bus_id),
                "copy_engines": engines,
                "fast_path": self.fast_path,
            }

    def _attribute(self, attribute: Any) -> int:
        err, value = self._d.cuDeviceGetAttribute(attribute, self._dev)
        self._check(err)
        return int(value)

    # -- memory ----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        with self._current:
            err, ptr = self._d.cuMemAlloc(nbytes)
            self._check(err)
            return int(ptr)

    def mem_free(self, ptr: int) -> None:
        with self._current:
            (err,) = self._d.cuMemFree(self._CUdeviceptr(ptr))
            self._check(err)

    # -- stream-ordered pools --------------------------------------------------------------
    def mem_pool_create(self, release_threshold: int | None) -> Any:
        d = self._d
        with self._current:
            if not self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED):
                return None
            props = d.CUmemPoolProps()
            props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
            props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            props.location.id = self.device
            err, pool = d.cuMemPoolCreate(props)
            self._check(err)
            try:
                attrs = d.CUmemPool_attribute
                keep = (1 << 64) - 1 if release_threshold is None else int(release_threshold)
                (err,) = d.cuMemPoolSetAttribute(pool, attrs.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(keep))
                self._check(err)
                # never make an allocation wait for another stream's work: reuse completed frees, or grow
                (err,) = d.cuMemPoolSetAttribute(pool, attrs.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 0)
                self._check(err)
            except DeviceError:
                d.cuMemPoolDestroy(pool)
                raise
            self._pools.append(pool)
            return pool

    def mem_pool_destroy(self, pool: Any) -> None:
        with self._current:
            if pool in self._pools:
                self._pools.remove(pool)
            (err,) = self._d.cuMemPoolDestroy(pool)
            self._check(err)

    def mem_pool_alloc(self, pool: Any, nbytes: int, stream: Any) -> int:
        d = self._d
        err, ptr = d.cuMemAllocFromPoolAsync(nbytes, pool, stream)
        if err and int(err) in _REBIND:
            with self._current:
                err, ptr = d.cuMemAllocFromPoolAsync(nbytes, pool, stream)
        self._check(err)
        # the stream holds only allocations and frees that wait for nothing: this returns at once,
        # and from here the allocation is usable on every stream (not a host wait for a copy)
        (err,) = d.cuStreamSynchronize(stream)
        if err:
            d.cuMemFreeAsync(ptr, stream)
            self._check(err)
        return int(ptr)

    def mem_free_async(self, ptr: int, stream: Any) -> None:
        d = self._d
        (err,) = d.cuMemFreeAsync(self._CUdeviceptr(ptr), stream)
        if err:
            self._retry(err, d.cuMemFreeAsync, self._CUdeviceptr(ptr), stream)

    def mem_pool_trim(self, pool: Any, keep_bytes: int) -> None:
        with self._current:
            (err,) = self._d.cuMemPoolTrimTo(pool, keep_bytes)
            self._check(err)

    def mem_pool_usage(self, pool: Any) -> tuple[int, int]:
        d = self._d
        attrs = d.CUmemPool_attribute
        with self._current:
            err, reserved = d.cuMemPoolGetAttribute(pool, attrs.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
            self._check(err)
            err, used = d.cuMemPoolGetAttribute(pool, attrs.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
            self._check(err)
            return int(reserved), int(used)

    def device_synchronize(self) -> None:
        with self._current:
            (err,) = self._d.cuCtxSynchronize()
            self._check(err)

    def host_alloc(self, nbytes: int) -> int:
        with self._current:
            err, ptr = self._d.cuMemHostAlloc(nbytes, self._d.CU_MEMHOSTALLOC_PORTABLE)
            self._check(err)
            return int(ptr)

    def host_free(self, ptr: int) -> None:
        with self._current:
            (err,) = self._d.cuMemFreeHost(ptr)
            self._check(err)

    def host_register(self, ptr: int, nbytes: int) -> None:
        with self._current:
            (err,) = self._d.cuMemHostRegister(ptr, nbytes, self._d.CU_MEMHOSTREGISTER_PORTABLE)
            self._check(err)

    def host_unregister(self, ptr: int) -> None:
        with self._current:
            (err,) = self._d.cuMemHostUnregister(ptr)
            self._check(err)

    # -- streams and events ------------------------------------------------------------------
    def stream_create(self) -> Any:
        with self._current:
            err, stream = self._d.cuStreamCreate(self._d.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._check(err)
            return int(stream) if self._calls is not None else stream

    def stream_destroy(self, stream: Any) -> None:
        with self._current:
            (err,) = self._d.cuStreamDestroy(stream)
            self._check(err)

    def stream_handle(self, stream: Any) -> int:
        return int(stream)

    def stream_from_handle(self, handle: int) -> Any:
        return int(handle) if self._calls is not None else self._d.CUstream(handle)

    def stream_wait_events(self, stream: Any, events: list[int]) -> None:
        """``stream`` waits on the device for each event of ``events``: raw ``CUevent`` values made
        elsewhere (a native staging job's posted events), alive while this runs. One C call where
        the compiled fast path runs."""
        calls = self._calls
        if calls is not None:
            calls.stream_wait_events(int(stream), events)
            return
        with self._current:
            for event in events:
                (err,) = self._d.cuStreamWaitEvent(stream, self._d.CUevent(event), 0)
                self._check(err)

    def stream_synchronize(self, stream: Any) -> None:
        with self._current:
            self._syncs += 1
            (err,) = self._d.cuStreamSynchronize(stream)
            self._check(err)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        with self._current:
            (err,) = self._d.cuStreamWaitEvent(stream, event, 0)
            self._check(err)

    def event_create(self, blocking: bool = False) -> Any:
        with self._current:
            flags = self._d.CUevent_flags
            mask = int(flags.CU_EVENT_DISABLE_TIMING) | (int(flags.CU_EVENT_BLOCKING_SYNC) if blocking else 0)
            err, event = self._d.cuEventCreate(mask)
            self._check(err)
            return int(event) if self._calls is not None else event

    def event_destroy(self, event: Any) -> None:
        with self._current:
            (err,) = self._d.cuEventDestroy(event)
            self._check(err)

    def event_record(self, event: Any, stream: Any) -> None:
        (err,) = self._cuEventRecord(event, stream)
        if err:
            self._retry(err, self._cuEventRecord, event, stream)

    def event_query(self, event: Any) -> bool:
        (err,) = self._cuEventQuery(event)
        if not err:
            return True
        if err == self._not_ready:
            return False
        if int(err) in _REBIND:
            with self._current:
                (err,) = self._cuEventQuery(event)
            if not err:
                return True
            if err == self._not_ready:
                return False
        self._check(err)
        return False  # unreachable: _check raised

    def event_synchronize(self, event: Any) -> None:
        self._syncs += 1
        (err,) = self._cuEventSynchronize(event)
        if err:
            self._retry(err, self._cuEventSynchronize, event)

    def event_wait(self, event: Any, timeout: float) -> bool:
        # cuEventSynchronize cannot be interrupted: poll instead. Python runs between the
        # queries (each releases the GIL), so a signal handler's exception propagates at once.
        self._syncs += 1
        query = self._cuEventQuery
        (err,) = query(event)
        if not err:
            return True
        not_ready = self._not_ready
        if err == not_ready and timeout > 0:
            clock = time.perf_counter
            deadline = clock() + timeout
            while True:
                (err,) = query(event)
                if not err:
                    return True
                if err != not_ready:
                    break
                if clock() >= deadline:
                    return False
        if err == not_ready:
            return False
        if int(err) in _REBIND:  # no usable context current on this thread: bind, ask again
            return self.event_query(event)
        self._check(err)  # never query again: a non-sticky error is reported once
        return False

    # -- copies -----------------------------------------------------------------------------------
    def memcpy_htod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        (err,) = self._cuMemcpyHtoDAsync(dst, src, nbytes, stream)
        if err:
            self._retry(err, self._cuMemcpyHtoDAsync, dst, src, nbytes, stream)

    def memcpy_dtoh(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        (err,) = self._cuMemcpyDtoHAsync(dst, src, nbytes, stream)
        if err:
            self._retry(err, self._cuMemcpyDtoHAsync, dst, src, nbytes, stream)

    def htod_record(self, dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        if nbytes:
            (err,) = self._cuMemcpyHtoDAsync(dst, src, nbytes, stream)
            if err:
                self._retry(err, self._cuMemcpyHtoDAsync, dst, src, nbytes, stream)
        if event is None:
            return
        (err,) = self._cuEventRecord(event, stream)
        if err:
            self._record_failed(err, event, stream)

    def dtoh_record(self, dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        if nbytes:
            (err,) = self._cuMemcpyDtoHAsync(dst, src, nbytes, stream)
            if err:
                self._retry(err, self._cuMemcpyDtoHAsync, dst, src, nbytes, stream)
        if event is None:
            return
        (err,) = self._cuEventRecord(event, stream)
        if err:
            self._record_failed(err, event, stream)

    def copy_batch(
        self, upload: bool, dsts: list[int], srcs: list[int], sizes: list[int], stream: Any, event: Any
    ) -> None:
        # the bindings path: a loop of single copies (the compiled path uses cuMemcpyBatchAsync)
        copy = self._cuMemcpyHtoDAsync if upload else self._cuMemcpyDtoHAsync
        for i, (dst, src, nbytes) in enumerate(zip(dsts, srcs, sizes, strict=True)):
            if not nbytes:
                continue
            (err,) = copy(dst, src, nbytes, stream)
            if err:
                try:
                    self._retry(err, copy, dst, src, nbytes, stream)
                except DeviceError as exc:
                    exc.enqueued = i > 0
                    raise
        if event is not None:
            (err,) = self._cuEventRecord(event, stream)
            if err:
                self._record_failed(err, event, stream)

    def _record_failed(self, err: Any, event: Any, stream: Any) -> None:
        try:
            self._retry(err, self._cuEventRecord, event, stream)
        except DeviceError as exc:
            exc.enqueued = True
            raise

    # -- several devices ------------------------------------------------------------------------
    def device_count(self) -> int:
        err, count = self._d.cuDeviceGetCount()
        self._check(err)
        return int(count)

    def peer_access(self, other: CudaBackend) -> tuple[bool, str, dict[str, Any]]:
        d = self._d
        if other.device == self.device:
            return True, "same device", {}
        err, can = d.cuDeviceCanAccessPeer(self._dev, other._dev)
        self._check(err)
        attributes: dict[str, Any] = {}
        kinds = d.CUdevice_P2PAttribute
        for name in ("ACCESS_SUPPORTED", "PERFORMANCE_RANK", "NATIVE_ATOMIC_SUPPORTED",
                     "CUDA_ARRAY_ACCESS_SUPPORTED"):
            attribute = getattr(kinds, f"CU_DEVICE_P2P_ATTRIBUTE_{name}", None)
            if attribute is None:
                continue
            err, value = d.cuDeviceGetP2PAttribute(attribute, other._dev, self._dev)
            if not err:
                attributes[name.lower()] = int(value)
        if can:
            return True, "cuDeviceCanAccessPeer: supported", attributes
        return False, "cuDeviceCanAccessPeer: not supported for this pair (no NVLink/PCIe P2P path)", attributes

    def enable_peer(self, other: CudaBackend) -> None:
        with self._current:
            (err,) = self._d.cuCtxEnablePeerAccess(other._ctx, 0)
            if err and int(err) != 704:  # PEER_ACCESS_ALREADY_ENABLED
                self._check(err)
        # pool memory does not follow peer access: each pool grants it to the devices that read it
        d = self._d
        for pool in other._pools:
            desc = d.CUmemAccessDesc()
            desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self.device
            desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            with other._current:
                (err,) = d.cuMemPoolSetAccess(pool, [desc], 1)
            self._check(err)

    def memcpy_peer(self, dst: int, src: int, src_backend: CudaBackend, nbytes: int, stream: Any) -> None:
        with self._current:
            d = self._d
            (err,) = d.cuMemcpyPeerAsync(
                d.CUdeviceptr(dst), self._ctx, d.CUdeviceptr(src), src_backend._ctx, nbytes, stream
            )
            self._check(err)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        with self._current:
            d = self._d
            (err,) = d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes, stream)
            self._check(err)

    # -- gates: cuStreamWaitValue32 on mapped pinned memory -------------------------------------
    def gate_create(self) -> _Gate:
        with self._current:
            d = self._d
            err, host = d.cuMemHostAlloc(
                4, d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE
            )
            self._check(err)
            ctypes.c_uint32.from_address(int(host)).value = 0
            err, dev = d.cuMemHostGetDevicePointer(host, 0)
            self._check(err)
            gate = _Gate(int(host), int(dev))
            self._gates.append(gate)
            return gate

    def stream_wait_gate(self, stream: Any, gate: _Gate) -> None:
        with self._current:
            d = self._d
            (err,) = d.cuStreamWaitValue32(
                stream,
                d.CUdeviceptr(gate.dev),
                1,
                d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
            )
            self._check(err)

    def gate_open(self, gate: _Gate) -> None:
        ctypes.c_uint32.from_address(gate.host).value = 1

    # -- lifetime ---------------------------------------------------------------------------------------
    # -- hooks for the native staging engine ---------------------------------------------------------
    def native_context(self) -> int:
        """The primary context handle, for the native engine's threads (``cuCtxSetCurrent``)."""
        return self._ctx_id

    def close(self) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        with self._current:
            for gate in self._gates:  # streams are idle by now: nothing waits on a gate
                self._d.cuMemFreeHost(gate.host)
            self._gates.clear()
            self._d.cuDevicePrimaryCtxRelease(self._dev)


_NATIVE_CALLS = (
    "htod_record", "dtoh_record", "event_record", "event_query", "event_wait", "event_synchronize", "copy_batch"
)
# rt.empty's and a dropped array's driver calls, where the driver has their entry points (Calls.pool_calls)
_NATIVE_POOL_CALLS = ("mem_pool_alloc", "mem_free_async")


def _kernel_driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return "unknown"
    for word in first.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return first.strip()


def _pcie_link(bus_id: str) -> str:
    base = f"/sys/bus/pci/devices/{bus_id}"
    try:
        with open(f"{base}/current_link_speed", encoding="utf-8") as f:
            speed = f.read().strip()
        with open(f"{base}/current_link_width", encoding="utf-8") as f:
            width = f.read().strip()
        with open(f"{base}/max_link_speed", encoding="utf-8") as f:
            max_speed = f.read().strip()
    except OSError:
        return "unknown (no sysfs entry for the device)"
    return f"PCIe {speed} x{width} (max {max_speed})"
