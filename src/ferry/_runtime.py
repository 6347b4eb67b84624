"""Runtime: the backend, copy streams, event pool, pinned pool, retirement queue and stats.

Data flows one way: a public call checks its arguments and moves ownership
here, under one lock; the backend enqueues (copy, event record); a handle comes
back. Blocking waits (``event_synchronize``) happen outside the lock, so one
thread waiting never stops another from submitting.

Every refusal happens before anything is enqueued and raises
:class:`~ferry.TransferSubmitError` with every argument left as it was.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from sys import getrefcount
from typing import Any

import numpy as np

from . import _buffer, _device_array
from ._backends._base import Backend, DeviceError
from ._buffer import _BASE_REFS, PinnedHostBuffer, check_dtype, new_buffer
from ._device_array import DeviceArray, new_device_array
from ._errors import (
    DeviceUnavailableError,
    FerryError,
    RuntimeClosedError,
    TransferFailedError,
    TransferSubmitError,
)
from ._hostcache import HostCache
from ._interop import Foreign, foreign_from, foreign_from_dlpack, interface_of, stream_handle_of
from ._peer import StagedPeerJob
from ._pending import Batch, Extras, PendingCopy, PendingDownload, PendingUpload, Record, SharedEvent, failed_error
from ._pool import PinnedPool
from ._register import Registration, check_releasable, new_registration
from ._retire import RetirementQueue
from ._staging import StagingConfig, StagingEngine, copy_in, copy_out, plan_chunks
from ._waiting import TransferFuture, Watcher

__all__ = ["Runtime", "RuntimeStats"]

_MAX_BYTES = 1 << 48  # larger requests are refused up front (no device has this much)
_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
_OWNED = _buffer.OWNED  # the same string as _device_array.OWNED
_PINNED = "a PinnedHostBuffer (rt.pinned(n))"
_DEVICE = "a DeviceArray (rt.empty(shape, dtype))"


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """A snapshot of a runtime's bookkeeping (see :meth:`Runtime.stats`).

    Attributes
    ----------
    in_flight
        Transfers submitted whose handle is alive and not yet waited.
    retiring
        Records of dropped handles not yet proven complete.
    abandoned
        Objects abandoned by failed transfers (never freed).
    abandoned_bytes
        Their memory, pinned and device.
    pinned_pool_bytes
        Pinned memory the pool holds, in use and free.
    pinned_free_bytes
        The part of it free for reuse.
    pinned_allocations
        Pinned allocations made so far (the pool's misses).
    device_bytes
        Device memory allocated through this runtime and not freed.
    submitted, completed, failed
        Transfers submitted; proven complete (waited or retired); failed.
    events
        Events created (the event pool reuses them).
    host_copied_bytes
        Bytes the pageable routes copied on the host (one per payload byte).
    staging_pinned_bytes
        Pinned memory held for staging: the lanes' slots plus the blocks of
        direct pageable copies in flight.
    registered_bytes
        Host memory pinned in place by :meth:`Runtime.register`.
    host_cache_bytes
        Resident host memory cached for fresh download outputs.
    """

    in_flight: int
    retiring: int
    abandoned: int
    abandoned_bytes: int
    pinned_pool_bytes: int
    pinned_free_bytes: int
    pinned_allocations: int
    device_bytes: int
    submitted: int
    completed: int
    failed: int
    events: int
    host_copied_bytes: int
    staging_pinned_bytes: int
    registered_bytes: int
    host_cache_bytes: int


_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for runtime in list(_runtimes):
        runtime._forked = True
        runtime._update_refusal()


def _close_all_at_exit() -> None:
    for runtime in list(_runtimes):
        with contextlib.suppress(Exception):  # interpreter exit must not fail
            runtime.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


def _make_backend(backend: str, device: int, bandwidth: float, latency: float, peer: bool = True) -> Backend:
    if backend == "auto":
        backend = os.environ.get("FERRY_BACKEND", "auto")
    if backend not in ("auto", "cuda", "emulated"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'emulated', not {backend!r}")
    if backend in ("auto", "cuda"):
        from ._backends._cuda import CudaBackend

        try:
            return CudaBackend(device)
        except DeviceUnavailableError:
            if backend == "cuda":
                raise
    from ._backends._emulated import EmulatedBackend

    return EmulatedBackend(device, bandwidth=bandwidth, latency=latency, peer=peer)


class Runtime:
    """One device, its copy streams and everything ferry owns on it.

    Parameters
    ----------
    backend
        ``"auto"`` (CUDA when a GPU is usable, else the emulated device; the
        ``FERRY_BACKEND`` environment variable can force either), ``"cuda"``
        (raises :class:`~ferry.DeviceUnavailableError` with the reason when no
        GPU is usable) or ``"emulated"``.
    device
        Device index.
    retirement_capacity
        Bound of the retirement queue of dropped handles; when it is full the
        next submission waits for the oldest record.
    pinned_cache_bytes
        Free pinned memory the pool keeps for reuse; beyond it blocks are freed.
    emulated_bandwidth, emulated_latency
        The emulated device's modelled copy bandwidth (bytes/s, per copy
        stream) and per-operation latency (s). Ignored on CUDA.
    peer_access
        Whether :meth:`copy_pending` may use peer access where the pair
        supports it; ``False`` forces the staged route (to compare them). On
        the emulated machine it also withdraws the device's peer capability.
    staging
        How pageable NumPy arrays are staged (:class:`~ferry.StagingConfig`);
        the default's lane count is capped at the machine's CPU count.
    host_cache_bytes
        Resident host memory kept for the fresh outputs of :meth:`download`
        (first-touch page faults cost more than the copy); 0 disables it.

    Guarantees
    ----------
    Uploads and downloads use separate copy streams, so both directions run at
    once. ``close()`` (also run at interpreter exit) waits for everything in
    flight, then frees what the runtime owns; afterwards every call raises. A
    runtime inherited by a forked child refuses every call with a clear error
    and never touches the device.
    """

    def __init__(
        self,
        backend: str = "auto",
        device: int = 0,
        *,
        retirement_capacity: int = 1024,
        pinned_cache_bytes: int = 4 << 30,
        emulated_bandwidth: float = 25e9,
        emulated_latency: float = 5e-6,
        peer_access: bool = True,
        staging: StagingConfig | None = None,
        host_cache_bytes: int = 2 << 30,
    ) -> None:
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or device < 0:
            raise ValueError(f"device must be a non-negative int, got {device!r}")
        self._backend: Any = _make_backend(backend, int(device), emulated_bandwidth, emulated_latency, peer_access)
        self._peer_access = peer_access
        self._lock = threading.RLock()
        self._closed = False
        self._forked = False
        self._poisoned: DeviceError | None = None
        self._refusal: str | None = None  # why every call is refused; None while usable
        self._pool = PinnedPool(self._backend, pinned_cache_bytes)
        self._retiring = RetirementQueue(retirement_capacity)
        self._h2d = self._backend.stream_create()
        self._d2h = self._backend.stream_create()
        self._events: list[Any] = []
        self._event_count = 0
        self._live: set[Record] = set()
        self._abandoned: list[Record] = []
        self._abandoned_objects = 0
        self._abandoned_bytes = 0
        self._deferred: list[tuple[int, int]] = []  # (address, nbytes) of collected arrays
        self._arrays: weakref.WeakSet[DeviceArray] = weakref.WeakSet()
        self._buffers: weakref.WeakSet[PinnedHostBuffer] = weakref.WeakSet()
        self._device_bytes = 0
        self._seq = 0
        self._staging = staging or _default_staging()
        self._engines: dict[str, StagingEngine] = {}
        self._host_leases: dict[int, list[Any]] = {}
        self._host_cache = HostCache(host_cache_bytes)
        self._batches: dict[int, Batch] = {}  # thread ident -> open batch
        self._watcher: Watcher | None = None
        self._side_streams: list[Any] = []  # made by ferry.testing.side_stream
        self._d2d: Any = None  # the device-to-device copy stream, created on first use
        self._peers_enabled: set[int] = set()
        self._cross_returns: list[tuple[Runtime, DeviceArray]] = []  # leases to end in other runtimes
        self._registrations: list[Registration] = []
        self._host_copied = 0
        self._direct_bytes = 0  # pool blocks held by direct pageable copies in flight
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        _runtimes.add(self)

    # -- identity -------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"emulated"``."""
        return str(self._backend.name)

    @property
    def device(self) -> int:
        """The device index."""
        return int(self._backend.device)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def info(self) -> dict[str, Any]:
        """Backend, device name, driver, link and pool state, as a dict."""
        self._check_open()
        info = dict(self._backend.info())
        info["pinned_pool_bytes"] = self._pool.held_bytes
        info["pinned_free_bytes"] = self._pool.free_bytes
        return info

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ferry.Runtime {self.backend} device {self.device} {state}>"

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- usability checks ---------------------------------------------------------------------
    def _update_refusal(self) -> None:
        if self._forked:
            self._refusal = (
                "this runtime was inherited by a forked child process; device state does not "
                "survive fork: create a new ferry.Runtime in the child"
            )
        elif self._closed:
            self._refusal = "the runtime is closed"
        elif self._poisoned is not None:
            self._refusal = f"the device context is unusable after a sticky error ({self._poisoned})"
        else:
            self._refusal = None

    def _unusable(self) -> str | None:
        return self._refusal

    def _check_open(self) -> None:
        problem = self._unusable()
        if problem is not None:
            raise RuntimeClosedError(problem)

    def _note(self, exc: DeviceError) -> None:
        if exc.sticky and self._poisoned is None:
            self._poisoned = exc
            self._update_refusal()

    # -- allocation -----------------------------------------------------------------------------
    def pinned(self, nbytes: int) -> PinnedHostBuffer:
        """An owned pinned host buffer of ``nbytes`` bytes, served from the pool.

        A size served before is reused (microseconds) once its last transfer
        completed; a new size costs one pinned allocation (milliseconds).

        Raises
        ------
        ValueError
            ``nbytes < 1`` (or absurdly large).
        TypeError
            ``nbytes`` is not an int.
        MemoryError
            The device could not pin that much memory.
        """
        nbytes = _size_arg(nbytes, "nbytes")
        if nbytes < 1:
            raise ValueError(f"a pinned buffer needs nbytes >= 1, got {nbytes}")
        self._check_open()
        with self._lock:
            self._maintain()
        try:
            block = self._pool.acquire(nbytes)
        except DeviceError as exc:
            self._note(exc)
            raise _alloc_error("pinned host", nbytes, exc) from exc
        except (MemoryError, ValueError) as exc:
            raise MemoryError(f"pinned host allocation of {nbytes} bytes failed: {exc}") from exc
        buffer = new_buffer(self, block, nbytes)
        self._buffers.add(buffer)
        return buffer

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> DeviceArray:
        """An uninitialized C-contiguous device array, owned by the caller.

        Any fixed-size NumPy dtype is accepted. The memory is freed by
        ``close()`` or when the array is collected (at the runtime's next call).
        """
        self._check_open()
        dt = check_dtype(dtype)
        dims = _shape_arg(shape)
        count = 1
        for s in dims:
            count *= s
        nbytes = count * dt.itemsize
        if nbytes > _MAX_BYTES:
            raise ValueError(f"{nbytes} bytes is larger than any device")
        with self._lock:
            self._maintain()
            ptr = 0
            if nbytes:
                try:
                    ptr = self._backend.mem_alloc(nbytes)
                except DeviceError as exc:
                    self._note(exc)
                    raise _alloc_error("device", nbytes, exc) from exc
                except (MemoryError, ValueError) as exc:
                    raise MemoryError(f"device allocation of {nbytes} bytes failed: {exc}") from exc
            self._device_bytes += nbytes
        array = new_device_array(self, ptr, dims, dt, nbytes)
        self._arrays.add(array)
        return array

    def _free_device(self, ptr: int, nbytes: int) -> None:
        """Free a closed array's memory now (an ordinary call, not a finalizer)."""
        with self._lock:
            self._device_bytes -= nbytes
            if ptr and self._unusable() is None:
                self._free_now(ptr)
            # closed: close() already freed what it owned; forked/poisoned: never touch the device

    def _free_now(self, ptr: int) -> None:
        if not ptr:
            return
        try:
            self._backend.mem_free(ptr)
        except DeviceError as exc:
            self._note(exc)

    # -- submissions -------------------------------------------------------------------------------
    def upload_pending(self, buffer: PinnedHostBuffer, destination: DeviceArray) -> PendingUpload:
        """Copy ``destination.nbytes`` bytes from the start of ``buffer`` into ``destination``.

        Both objects move into the transfer: until ``wait()`` hands them back
        as ``(buffer, destination)`` every data access raises
        :class:`~ferry.BufferMovedError`. Returns without waiting for the copy.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued and both objects are unchanged: wrong types,
            a buffer smaller than the destination, a buffer with live views, an
            object in flight, abandoned, closed or of another runtime, a
            read-leased destination, a closed runtime.
        """
        with self._lock:
            # One expression for the common case; the slow path names the problem.
            if not (
                self._refusal is None
                and type(buffer) is PinnedHostBuffer
                and type(destination) is DeviceArray
                and buffer._runtime is self
                and destination._runtime is self
                and buffer._state == _OWNED
                and destination._state == _OWNED
                and not destination._leases
                and destination._ready is None
                and getrefcount(buffer._base) == _BASE_REFS
                and buffer._nbytes >= destination._nbytes
            ):
                return self._upload_slow(buffer, destination)
            self._maintain_if_needed()
            nbytes = destination._nbytes
            pair = (buffer, destination)
            record = self._enqueue(
                self._h2d, self._backend.htod_record, destination._ptr, buffer._block.ptr, nbytes, pair, (), pair
            )
            buffer._state = _buffer.IN_FLIGHT
            destination._state = _device_array.IN_FLIGHT
        return PendingUpload(self, record)

    def download_pending(self, source: DeviceArray, buffer: PinnedHostBuffer) -> PendingDownload:
        """Copy ``source.nbytes`` bytes from ``source`` into the start of ``buffer``.

        The buffer moves into the transfer; the source is read-leased: it may
        be the source of further downloads meanwhile, but not an upload
        destination, and it is not freed before the copy completes even if
        every user reference to it is dropped. ``wait()`` returns
        ``(source, buffer)``.

        Raises
        ------
        TransferSubmitError
            As for :meth:`upload_pending`; nothing was enqueued.
        """
        with self._lock:
            if not (
                self._refusal is None
                and type(source) is DeviceArray
                and type(buffer) is PinnedHostBuffer
                and buffer._runtime is self
                and source._runtime is self
                and buffer._state == _OWNED
                and source._state == _OWNED
                and source._ready is None
                and getrefcount(buffer._base) == _BASE_REFS
                and buffer._nbytes >= source._nbytes
            ):
                return self._download_slow(source, buffer)
            self._maintain_if_needed()
            nbytes = source._nbytes
            record = self._enqueue(
                self._d2h, self._backend.dtoh_record, buffer._block.ptr, source._ptr, nbytes,
                (buffer,), (source,), (source, buffer),
            )
            buffer._state = _buffer.IN_FLIGHT
            source._leases += 1
        return PendingDownload(self, record)

    def _device_side(self, obj: Any, call: str, name: str, *, write: bool, stream: Any) -> Any:
        """A ferry array (checked) or a foreign one (wrapped); anything else is refused.

        A foreign array comes through its CUDA Array Interface or, failing that,
        DLPack (asked for a capsule ordered on ``stream``, ferry's copy stream).
        """
        if isinstance(obj, DeviceArray):
            problem = obj._submission_problem(self, write=write)
            if problem:
                raise TransferSubmitError(problem)
            return obj
        cai = interface_of(obj)
        if _dlpack_device_type(obj) == _KDL_CUDA and (cai is None or int(cai.get("version", 0)) < 3):
            # DLPack orders ferry's stream after the producer (a CUDA Array Interface
            # before version 3 names no stream, so it cannot)
            return foreign_from_dlpack(obj, self, self._backend.stream_handle(stream))
        if cai is not None:
            return foreign_from(obj, cai, write=write)
        _expect(obj, DeviceArray, call, name, _DEVICE)
        return obj  # unreachable: _expect raised

    def _attach_imports(self, record: Record, device: Any) -> None:
        imported = getattr(device, "imported", None)
        if imported is not None:
            if record.extra is None:
                record.extra = Extras()
            record.extra.imports.append(imported)

    def _order_before(self, streams: list[Any], device: Any, ordered: Any = None) -> None:
        """Make ``streams`` wait, on the device, for the work ``device``'s bytes depend on.

        A ferry array handed off by a pending upload waits for that upload's
        event; a foreign array waits for its producer stream (an event recorded
        there), or, when it came through DLPack, for ``ordered`` (the copy
        stream its producer already made wait). No host wait. Lock held.
        """
        backend = self._backend
        ready = getattr(device, "_ready", None)
        if ready is not None and not ready.done and ready.event is not None:
            for stream in streams:
                backend.stream_wait_event(stream, ready.event)
        if not isinstance(device, Foreign):
            return
        if device.stream is not None:
            source = backend.stream_from_handle(device.stream)
        elif device.imported is not None and ordered is not None and any(s is not ordered for s in streams):
            source = ordered
        else:
            return
        event = self._events.pop() if self._events else self._new_event()
        try:
            backend.event_record(event, source)
            for stream in streams:
                if stream is not source:
                    backend.stream_wait_event(stream, event)
        finally:
            self._events.append(event)  # a wait captured the record: the event is reusable

    def _upload_slow(self, buffer: Any, destination: Any) -> PendingUpload:
        """Every upload the one-expression test did not admit: refuse it clearly, or submit it
        (a foreign destination, or a ferry array an earlier upload handed off)."""
        return PendingUpload(self, self._submit_slow(True, buffer, destination))

    def _download_slow(self, source: Any, buffer: Any) -> PendingDownload:
        """Every download the one-expression test did not admit (see :meth:`_upload_slow`)."""
        return PendingDownload(self, self._submit_slow(False, buffer, source))

    def _submit_slow(self, upload: bool, buffer: Any, device_obj: Any) -> Record:
        """The checked submission of a pinned transfer in either direction. Lock held."""
        call = "upload_pending" if upload else "download_pending"
        if self._refusal is not None:
            raise TransferSubmitError(self._refusal)
        _expect(buffer, PinnedHostBuffer, call, "buffer", _PINNED)
        problem = buffer._submission_problem(self)
        if problem:
            raise TransferSubmitError(problem)
        stream = self._h2d if upload else self._d2h
        role = "destination" if upload else "source"
        device = self._device_side(device_obj, call, role, write=upload, stream=stream)
        try:
            if buffer._nbytes < device._nbytes:
                raise TransferSubmitError(
                    f"the pinned buffer holds {buffer._nbytes} bytes; the {role} has {device._nbytes}"
                )
            try:
                self._order_before([stream], device, ordered=stream)
            except DeviceError as exc:
                self._note(exc)
                raise TransferSubmitError(f"could not order the copy after the {role}'s producer: {exc}") from exc
            self._maintain_if_needed()
            if upload:
                record = self._enqueue(
                    stream, self._backend.htod_record, device._ptr, buffer._block.ptr, device._nbytes,
                    moved=(buffer, device), leased=(), result=(buffer, device_obj),
                )
            else:
                record = self._enqueue(
                    stream, self._backend.dtoh_record, buffer._block.ptr, device._ptr, device._nbytes,
                    moved=(buffer,), leased=(device,), result=(device_obj, buffer),
                )
        except BaseException:
            _give_back(device)  # refused after the producer's capsule was taken
            raise
        self._attach_imports(record, device)
        buffer._state = _buffer.IN_FLIGHT
        if upload:
            device._state = _device_array.IN_FLIGHT
        else:
            device._leases += 1
        return record

    def _enqueue(
        self,
        stream: Any,
        copy: Callable[[int, int, int, Any, Any], None],
        dst: int,
        src: int,
        nbytes: int,
        moved: tuple[Any, ...],
        leased: tuple[Any, ...],
        result: tuple[Any, ...],
    ) -> Record:
        """Enqueue one copy and its event; the caller holds the lock and moves states after.

        ``copy`` is the backend's ``htod_record`` or ``dtoh_record``.
        """
        if self._batches:
            batch = self._batches.get(threading.get_ident())
            if batch is not None:
                return self._enqueue_batched(batch, stream, copy, dst, src, nbytes, moved, leased, result)
        events = self._events
        event = events.pop() if events else self._new_event_for_submit()
        self._seq += 1
        record = Record(self._seq, event, stream, moved, leased, result, nbytes)
        try:
            copy(dst, src, nbytes, stream, event)
        except DeviceError as exc:
            self._note(exc)
            if not exc.enqueued:
                events.append(event)
                raise TransferSubmitError(f"the device refused the copy: {exc}") from exc
            # The copy is queued but cannot be tracked: prove it finished, or abandon.
            try:
                self._backend.stream_synchronize(stream)
            except DeviceError as sync_exc:
                self._note(sync_exc)
                self._fail(record, sync_exc)
                raise TransferFailedError(
                    f"the copy was queued but could not be tracked ({exc}); its objects are abandoned"
                ) from sync_exc
            raise TransferSubmitError(f"could not record the copy's event: {exc}") from exc
        self._submitted += 1
        self._live.add(record)
        return record

    def _job_record(
        self, job: Any, key: Any, moved: tuple[Any, ...], leased: tuple[Any, ...], result: tuple[Any, ...],
        nbytes: int, extra: Extras | None,
    ) -> Record:
        """A record whose completion a worker job proves (no event). ``key`` groups its retirement lane."""
        self._seq += 1
        record = Record(self._seq, None, key, moved, leased, result, nbytes)
        record.extra = extra if extra is not None else Extras()
        record.extra.job = job
        self._submitted += 1
        self._live.add(record)
        return record

    def _new_event_for_submit(self) -> Any:
        try:
            return self._new_event()
        except DeviceError as exc:
            self._note(exc)
            raise TransferSubmitError(f"could not create an event: {exc}") from exc

    def _enqueue_batched(
        self,
        batch: Batch,
        stream: Any,
        copy: Callable[[int, int, int, Any, Any], None],
        dst: int,
        src: int,
        nbytes: int,
        moved: tuple[Any, ...],
        leased: tuple[Any, ...],
        result: tuple[Any, ...],
    ) -> Record:
        try:
            copy(dst, src, nbytes, stream, None)  # no event of its own: the batch records one
        except DeviceError as exc:
            self._note(exc)
            raise TransferSubmitError(f"the device refused the copy: {exc}") from exc
        self._seq += 1
        record = Record(self._seq, None, stream, moved, leased, result, nbytes)
        record.extra = Extras()
        record.extra.batch = batch
        batch.segments.setdefault(id(stream), (stream, []))[1].append(record)
        self._submitted += 1
        self._live.add(record)
        return record

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Share one completion event among the transfers submitted inside the block.

        Inside ``with rt.batch():`` (on this thread) each copy is enqueued at
        once but records no event of its own; one event per copy stream is
        recorded when the block exits, or earlier when one of the batch's
        handles is polled or waited. Use it for many small transfers that are
        waited together: it saves an event record per transfer. Handles keep
        their full contract (each is waited, dropped or fails on its own).
        Nested blocks join the outer one.
        """
        self._check_open()
        ident = threading.get_ident()
        with self._lock:
            batch = self._batches.get(ident)
            if batch is None:
                batch = self._batches[ident] = Batch()
            batch.depth += 1
        try:
            yield
        finally:
            with self._lock:
                batch.depth -= 1
                if batch.depth == 0:
                    del self._batches[ident]
                    for key in list(batch.segments):
                        self._flush_segment(batch, key)

    def _flush_segment(self, batch: Batch, key: int) -> None:
        """Record the shared event of one stream's open segment. Lock held."""
        entry = batch.segments.pop(key, None)
        if entry is None:
            return
        stream, records = entry
        records = [r for r in records if r.error is None]
        if not records:
            return
        try:
            event = self._events.pop() if self._events else self._new_event()
            self._backend.event_record(event, stream)
        except DeviceError as exc:
            self._note(exc)
            for record in records:
                self._fail(record, exc)
            return
        shared = SharedEvent(event, len(records))
        for record in records:
            record.event = event
            assert record.extra is not None
            record.extra.batch = None
            record.extra.shared = shared

    def _new_event(self) -> Any:
        event = self._backend.event_create()
        self._event_count += 1
        return event

    def _flush_for(self, record: Record) -> None:
        """Make sure a batched record has its shared event recorded."""
        with self._lock:
            extra = record.extra
            if extra is not None and extra.batch is not None:
                self._flush_segment(extra.batch, id(record.stream))

    # -- completion (called by the handles) ---------------------------------------------------
    def _poll_record(self, record: Record) -> bool:
        with self._lock:
            if record.error is not None:
                raise failed_error(record)
            if record.done:
                return True
            self._check_open()
            try:
                ready = self._query(record)
            except DeviceError as exc:
                self._note(exc)
                self._fail(record, exc)
                raise failed_error(record) from exc
            if ready:
                record.done = True
            return ready

    def _wait_record(self, record: Record) -> tuple[Any, ...]:
        if record.error is None and self._refusal is None:  # the common case
            if not record.done:
                try:
                    if record.extra is None:
                        self._backend.event_synchronize(record.event)
                    else:
                        self._block(record)
                except DeviceError as exc:
                    with self._lock:
                        self._note(exc)
                        self._fail(record, exc)
                    raise failed_error(record) from exc
            with self._lock:
                if record.error is None and record in self._live:
                    self._live.remove(record)
                    record.done = True
                    self._settle(record)
                    result = record.result
                else:
                    result = None
            if result is not None:
                if self._cross_returns:
                    self._flush_cross()
                return result
        return self._wait_record_slow(record)

    def _wait_record_slow(self, record: Record) -> tuple[Any, ...]:
        if record.error is not None:
            raise failed_error(record)
        self._check_open()
        if not record.done:
            try:
                self._block(record)
            except DeviceError as exc:
                with self._lock:
                    self._note(exc)
                    self._fail(record, exc)
                raise failed_error(record) from exc
        with self._lock:
            if record.error is not None:
                raise failed_error(record)
            if record not in self._live:
                if self._closed:
                    raise RuntimeClosedError("the runtime was closed while this transfer was pending")
                raise FerryError("this transfer was already waited; a handle is waited at most once")
            record.done = True
            self._live.discard(record)
            self._settle(record)
        return record.result

    def _query(self, record: Record) -> bool:
        """Whether the record's copy completed. Never blocks; raises DeviceError."""
        extra = record.extra
        if extra is not None:
            if extra.job is not None:
                job = extra.job
                if not job.done.is_set():
                    return False
                if job.error is not None:
                    raise job.error
                return True
            if extra.batch is not None:
                self._flush_for(record)
            shared = extra.shared
            if shared is not None:
                if not shared.done:
                    shared.done = bool(self._backend.event_query(record.event))
                return shared.done
        return bool(self._backend.event_query(record.event))

    def _block(self, record: Record) -> None:
        """Block until the record's copy completed; raises DeviceError."""
        extra = record.extra
        if extra is not None:
            if extra.job is not None:
                extra.job.done.wait()
                if extra.job.error is not None:
                    raise extra.job.error
                return
            if extra.batch is not None:
                self._flush_for(record)
            shared = extra.shared
            if shared is not None:
                if not shared.done:
                    self._backend.event_synchronize(record.event)
                    shared.done = True
                return
        self._backend.event_synchronize(record.event)

    def _settle(self, record: Record) -> None:
        """A waited record: run its finisher, hand every object back owned."""
        extra = record.extra
        if extra is None:
            self._events.append(record.event)
            record.event = None
        else:
            if extra.finish is not None:
                extra.finish()
            self._release_extras(record, failed=False)
            self._recycle_event(record)
        for obj in record.moved:
            obj._state = _buffer.OWNED  # same value for both kinds
        for array in record.leased:
            array._leases -= 1
        self._completed += 1

    def _recycle_event(self, record: Record) -> None:
        """The record's event back to the pool (a shared one after its last user)."""
        extra = record.extra
        if extra is not None and (extra.shared is not None or extra.batch is not None):
            shared = extra.shared
            extra.shared = None
            if shared is not None:
                shared.users -= 1
                if shared.users == 0:
                    self._events.append(shared.event)
        elif record.event is not None:
            self._events.append(record.event)
        record.event = None

    def _fail(self, record: Record, exc: DeviceError) -> None:
        """The device reported a failure: abandon every object, keep the record forever."""
        if record.error is not None:
            return
        record.error = exc
        self._live.discard(record)
        self._failed += 1
        self._abandoned.append(record)
        if record.extra is not None:
            self._release_extras(record, failed=True)
        for obj in record.moved + record.leased:
            if obj._state != _buffer.ABANDONED:
                obj._state = _buffer.ABANDONED
                self._abandoned_objects += 1
                self._abandoned_bytes += _held_bytes(obj)

    def _release_extras(self, record: Record, *, failed: bool) -> None:
        """Pool blocks back (or abandoned), host arrays writable again, registrations free."""
        extra = record.extra
        assert extra is not None
        for block in extra.blocks:
            self._direct_bytes -= block.capacity
            if failed:
                self._abandoned_bytes += block.capacity  # the device may still touch it
            else:
                self._pool.release(block)
        extra.blocks = []
        if not (failed and extra.device_touches_host):
            for array in extra.host:
                self._unlease_host(array)
            for registration in extra.regs:
                registration._uses -= 1
        extra.host = []
        extra.regs = []
        if not failed:  # a failed copy may still touch the producer's memory: never hand it back
            for imported in extra.imports:
                imported.release()
            self._cross_returns.extend(extra.cross)
        else:
            for _, array in extra.cross:  # the failed copy may still read it
                if array._state != _buffer.ABANDONED:
                    array._state = _buffer.ABANDONED
                    self._abandoned_objects += 1
                    self._abandoned_bytes += array._nbytes
        extra.imports = []
        extra.cross = []
        handed = extra.handed
        if handed is not None:
            extra.handed = None
            if handed._ready is record:
                handed._ready = None
            if failed and handed._state != _buffer.ABANDONED:  # its bytes never arrived, or partly
                handed._state = _buffer.ABANDONED
                self._abandoned_objects += 1
                self._abandoned_bytes += handed._nbytes
        if extra.job is not None:
            self._host_copied += extra.job.host_bytes
            extra.job.array = None

    def _lease_host(self, array: np.ndarray[Any, Any], extra: Extras) -> None:
        """Flag the caller's array read-only for the flight (counted, restored at the end)."""
        entry = self._host_leases.get(id(array))
        if entry is None:
            self._host_leases[id(array)] = [array, 1, bool(array.flags.writeable)]
            if array.flags.writeable:
                array.flags.writeable = False
        else:
            entry[1] += 1
        extra.host.append(array)

    def _unlease_host(self, array: np.ndarray[Any, Any]) -> None:
        entry = self._host_leases.get(id(array))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._host_leases[id(array)]
            if entry[2]:
                with contextlib.suppress(ValueError):
                    array.flags.writeable = True

    def _hand_off(self, handle: Any, stream: Any) -> Any:
        with self._lock:
            self._check_open()
            record = handle._record
            if handle._claimed or handle._waited:
                raise FerryError("this upload was already waited: its destination is yours")
            if record.error is not None:
                raise failed_error(record)
            if record not in self._live:
                raise FerryError("this upload is no longer pending")
            extra = record.extra
            if extra is not None and extra.job is not None:
                raise FerryError(
                    "a staged pageable upload cannot be handed off (its bytes arrive over several "
                    "streams); wait() for it, or upload through a pinned buffer or a registered array"
                )
            if extra is not None and extra.batch is not None:
                self._flush_segment(extra.batch, id(record.stream))
            destination = record.result[1]
            if stream is not None and not record.done:
                try:
                    self._backend.stream_wait_event(
                        self._backend.stream_from_handle(stream_handle_of(stream)), record.event
                    )
                except DeviceError as exc:
                    self._note(exc)
                    raise FerryError(f"could not make the stream wait for the upload: {exc}") from exc
            if isinstance(destination, DeviceArray) and destination._state == _device_array.IN_FLIGHT:
                destination._state = _device_array.OWNED
                destination._ready = record
                record.moved = tuple(o for o in record.moved if o is not destination)
                if record.extra is None:
                    record.extra = Extras()
                record.extra.handed = destination
            return destination

    def _watch(self, handle: Any) -> TransferFuture:
        """A future for ``handle``, resolved by the watcher (created on first use)."""
        self._check_open()
        with self._lock:
            if self._watcher is None:
                self._watcher = Watcher(self)
            watcher = self._watcher
        future = TransferFuture(handle)
        record = handle._record
        if record.error is not None or record.done:
            future._resolve()
        else:
            watcher.watch(record, future)
        return future

    # -- retirement --------------------------------------------------------------------------------
    def _detach(self, record: Record) -> None:
        """A handle was dropped unwaited: its record goes to the retirement queue.

        Called from ``__del__``: appends and returns, never blocks, never calls
        the device.
        """
        if self._forked or self._closed or record.error is not None:
            return
        self._live.discard(record)
        self._retiring.push(record)

    def _retired_done(self, record: Record) -> bool:
        if record.done or record.error is not None:
            return True
        try:
            ready = self._query(record)
        except DeviceError as exc:
            self._note(exc)
            self._fail(record, exc)
            return True
        record.done = ready
        return ready

    def _release_retired(self, record: Record) -> None:
        """A dropped handle's copy is complete: free what it owned, end its leases."""
        if record.error is not None:
            return  # abandoned: kept forever in self._abandoned
        if record.extra is not None:
            self._release_extras(record, failed=False)
        for obj in record.moved:
            self._close_owned(obj)
        for array in record.leased:
            array._leases -= 1
        self._recycle_event(record)
        self._completed += 1

    def _close_owned(self, obj: Any) -> None:
        if isinstance(obj, DeviceArray):
            if obj._state != _device_array.CLOSED:
                obj._state = _device_array.CLOSED
                self._device_bytes -= obj._nbytes
                if obj._ptr and self._poisoned is None and not self._forked:
                    self._free_now(obj._ptr)
        else:
            obj._state = _buffer.OWNED
            obj._release_for_close()

    def _maintain_if_needed(self) -> None:
        """The cheap test every submission makes before :meth:`_maintain`. Lock held."""
        if self._retiring._count or self._retiring._incoming or self._deferred or self._pool._doomed:
            self._maintain()

    def _maintain(self) -> None:
        """Deferred frees, retirement drain and backpressure. Caller holds the lock."""
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for ptr, nbytes in deferred:
                self._device_bytes -= nbytes
                self._free_now(ptr)
        queue = self._retiring
        if len(queue):
            queue.drain(self._retired_done, self._release_retired)
            while queue.full():
                oldest = queue.oldest()
                if oldest is None:
                    break
                try:
                    self._backend.event_synchronize(oldest.event)
                    oldest.done = True
                except DeviceError as exc:
                    self._note(exc)
                    self._fail(oldest, exc)
                queue.drain(self._retired_done, self._release_retired)
        self._pool.collect()

    def poll(self) -> None:
        """Release what dropped handles held once their copies completed. Never blocks
        (unless the retirement queue is over its bound)."""
        self._check_open()
        with self._lock:
            self._maintain()
        if self._cross_returns:
            self._flush_cross()

    def _flush_cross(self) -> None:
        """End read leases this runtime's settled copies hold in other runtimes, under their locks."""
        while self._cross_returns:
            try:
                runtime, array = self._cross_returns.pop()
            except IndexError:
                return
            with runtime._lock:
                array._leases -= 1

    # -- several devices ----------------------------------------------------------------------
    def copy_pending(self, source: DeviceArray, destination: DeviceArray) -> PendingCopy:
        """Copy ``source.nbytes`` bytes from ``source`` into ``destination``, which belongs to this runtime.

        ``source`` may belong to this runtime (same device) or to the runtime
        of another device of the same backend. The route (:func:`ferry.routes`):
        one ``cuMemcpyPeerAsync`` when the pair has peer access (enabled on
        first use), else chunks staged through pinned host memory, else (same
        device) ``cuMemcpyDtoDAsync``. Ownership as everywhere: the destination
        moves into the transfer, the source is read-leased (in its own
        runtime); ``wait()`` returns ``(source, destination)``; a failure
        publishes nothing and abandons both. Close the destination's runtime,
        or wait, before closing the source's.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued; both arrays are unchanged.
        """
        _expect(source, DeviceArray, "copy_pending", "source", _DEVICE)
        _expect(destination, DeviceArray, "copy_pending", "destination", _DEVICE)
        if destination._runtime is not self:
            raise TransferSubmitError(
                "copy_pending is submitted to the destination's runtime: call it on that runtime"
            )
        other = source._runtime
        if other.backend != self.backend:
            raise TransferSubmitError(f"cannot copy from a {other.backend} device to a {self.backend} device")
        locks = [self._lock] if other is self else sorted([self._lock, other._lock], key=id)
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            for runtime in (self, other):
                if runtime._refusal is not None:
                    raise TransferSubmitError(runtime._refusal)
            if source is destination:
                raise TransferSubmitError("copy_pending needs two different arrays")
            problem = destination._submission_problem(self, write=True) or source._submission_problem(
                other, write=False
            )
            if problem:
                raise TransferSubmitError(problem)
            nbytes = source._nbytes
            if destination._nbytes < nbytes:
                raise TransferSubmitError(
                    f"the destination holds {destination._nbytes} bytes; the source has {nbytes}"
                )
            self._maintain_if_needed()
            record = self._enqueue_device_copy(other, source, destination, nbytes)
            destination._state = _device_array.IN_FLIGHT
            source._leases += 1  # under the source runtime's lock
        return PendingCopy(self, record)

    def _d2d_stream(self) -> Any:
        if self._d2d is None:
            self._d2d = self._backend.stream_create()
        return self._d2d

    def _enqueue_device_copy(
        self, other: Runtime, source: DeviceArray, destination: DeviceArray, nbytes: int
    ) -> Record:
        """The route of :meth:`copy_pending`. Both locks held."""
        backend = self._backend
        stream = self._d2d_stream()
        same = other is self
        leased: tuple[Any, ...] = (source,) if same else ()
        try:
            if same or other.device == self.device:
                copy = _then_record(backend, backend.memcpy_dtod)
            else:
                ok = self._peer_access and backend.peer_access(other._backend)[0]
                if ok and other.device not in self._peers_enabled:
                    backend.enable_peer(other._backend)
                    self._peers_enabled.add(other.device)
                if ok:
                    def peer(dst: int, src: int, n: int, s: Any) -> None:
                        backend.memcpy_peer(dst, src, other._backend, n, s)

                    copy = _then_record(backend, peer)
                else:
                    job = StagedPeerJob(
                        other._backend, other._d2h, backend, stream, self._pool,
                        destination._ptr, source._ptr, nbytes, self._staging.slot_bytes,
                    )
                    extra = Extras()
                    extra.cross = [(other, source)]
                    return self._job_record(
                        job, ("peer-staged", other.device), (destination,), leased, (source, destination), nbytes,
                        extra,
                    )
        except DeviceError as exc:
            self._note(exc)
            raise TransferSubmitError(f"the device refused the copy route: {exc}") from exc
        record = self._enqueue(
            stream, copy, destination._ptr, source._ptr, nbytes,
            moved=(destination,), leased=leased, result=(source, destination),
        )
        if not same:
            if record.extra is None:
                record.extra = Extras()
            record.extra.cross.append((other, source))
        return record

    # -- pageable routes ----------------------------------------------------------------------------
    def upload(self, source: np.ndarray[Any, Any], destination: DeviceArray | None = None) -> PendingUpload:
        """Copy a NumPy array (pageable or registered) to the device without blocking.

        ``destination`` must have the source's shape and dtype; when ``None`` a
        new device array is allocated. ``wait()`` returns ``(source,
        destination)``. Non-contiguous sources are accepted and copied once.

        Routes: a registered source (:meth:`register`) is copied by one DMA
        with no host copy; a payload up to ``StagingConfig.direct_bytes`` goes
        through one pooled pinned block; anything larger is staged in chunks
        through the lanes' pinned slots, host copies and DMAs overlapped.

        While pending, ``source`` is flagged read-only (restored by ``wait()``).
        That guards this array object only: other views of the same memory,
        and raw pointers, are not guarded.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued; the arguments are unchanged (and a
            destination ferry allocated for this call is freed again).
        """
        if not isinstance(source, np.ndarray):
            raise TransferSubmitError(
                f"upload: source must be a NumPy array, got {type(source).__name__}; "
                "pinned buffers go through upload_pending"
            )
        _check_copyable(source, "upload")
        created = destination is None
        if created:
            if self._refusal is not None:
                raise TransferSubmitError(self._refusal)
            destination = self.empty(source.shape, source.dtype)
        try:
            with self._lock:
                if self._refusal is not None:
                    raise TransferSubmitError(self._refusal)
                device = self._device_side(destination, "upload", "destination", write=True, stream=self._h2d)
                try:
                    _check_match(source, device, "destination")
                    self._maintain_if_needed()
                    record = self._submit_host_route("upload", source, device, destination)
                except BaseException:
                    _give_back(device)
                    raise
                device._state = _device_array.IN_FLIGHT
        except BaseException:
            if created and destination is not None and destination._state == _device_array.OWNED:
                destination.close()
            raise
        return PendingUpload(self, record)

    def download(self, source: DeviceArray, out: np.ndarray[Any, Any] | None = None) -> PendingDownload:
        """Copy a device array into a NumPy array without blocking.

        ``out`` must be a writable array of the source's shape and dtype
        (any layout); when ``None`` a new one is allocated, large ones on
        resident memory recycled from earlier outputs that were dropped (see
        ``host_cache_bytes``), so first-touch page faults stay out of the copy.
        ``wait()`` returns ``(source, out)``. The source is read-leased, as
        for :meth:`download_pending`; ``out`` is flagged read-only while
        pending and holds the bytes once ``wait()`` returns. A failed download
        publishes nothing: ``wait()`` raises and ``out`` is not returned.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued; the arguments are unchanged.
        """
        with self._lock:
            if self._refusal is not None:
                raise TransferSubmitError(self._refusal)
            if out is not None and not isinstance(out, np.ndarray):
                raise TransferSubmitError(f"download: out must be a NumPy array, got {type(out).__name__}")
            device = self._device_side(source, "download", "source", write=False, stream=self._d2h)
            try:
                record = self._download_host(device, source, out)
            except BaseException:
                _give_back(device)
                raise
            device._leases += 1
        return PendingDownload(self, record)

    def _download_host(self, device: Any, source: Any, out: np.ndarray[Any, Any] | None) -> Record:
        """The checks and the route of :meth:`download`. Lock held."""
        if out is None:
            out = self._host_cache.array(device.shape, device.dtype)
        else:
            _check_copyable(out, "download")
            _check_match(out, device, "source")
            if not out.flags.writeable:
                raise TransferSubmitError(
                    "download: out is read-only (or the output of another pending download)"
                )
        self._maintain_if_needed()
        return self._submit_host_route("download", out, device, source)

    def _submit_host_route(
        self, direction: str, host: np.ndarray[Any, Any], device: Any, original: Any
    ) -> Record:
        """Pick the route for a NumPy array <-> device array copy and enqueue it. Lock held.

        ``device`` is a ferry array or a :class:`Foreign` wrapper; ``original``
        is what the caller passed (and gets back from ``wait()``).
        """
        upload = direction == "upload"
        extra = Extras()
        nbytes = host.nbytes
        stream = self._h2d if upload else self._d2h
        copy = self._backend.htod_record if upload else self._backend.dtoh_record
        moved: tuple[Any, ...] = (device,) if upload else ()
        leased: tuple[Any, ...] = () if upload else (device,)
        result = (host, original) if upload else (original, host)
        alias = host if upload else host.view()  # lanes write through a view taken before read-only
        contiguous = host.flags.c_contiguous
        ptr = _ptr(host)
        registration = self._registered(ptr, nbytes) if contiguous and nbytes else None
        config = self._staging
        staged = registration is None and not (nbytes <= config.direct_bytes or host.itemsize > config.slot_bytes)
        streams = [lane.stream for lane in self._engine(direction).lanes()] if staged else [stream]
        try:
            self._order_before(streams, device, ordered=stream)
        except DeviceError as exc:
            self._note(exc)
            raise TransferSubmitError(f"could not order the copy after the array's producer: {exc}") from exc
        if registration is not None:
            # one DMA straight from/to the caller's memory, pinned in place. (The driver's own
            # pageable copy is never used: it blocks the caller until the stream drains.)
            src, dst = (ptr, device._ptr) if upload else (device._ptr, ptr)
            record = self._enqueue(stream, copy, dst, src, nbytes, moved=moved, leased=leased, result=result)
            registration._uses += 1
            extra.regs.append(registration)
            extra.device_touches_host = True
        elif nbytes <= config.direct_bytes or host.itemsize > config.slot_bytes:
            block = self._pool.acquire(max(nbytes, 1))
            self._direct_bytes += block.capacity
            extra.blocks.append(block)
            try:
                chunks = plan_chunks(host, max(nbytes, 1))
                base = ptr
                if upload:
                    for part in chunks:
                        copy_in(block.ptr + part.offset, host, part, base)
                    self._host_copied += nbytes
                    record = self._enqueue(
                        stream, copy, device._ptr, block.ptr, nbytes, moved=moved, leased=leased, result=result
                    )
                else:
                    record = self._enqueue(
                        stream, copy, block.ptr, device._ptr, nbytes, moved=moved, leased=leased, result=result
                    )

                    def publish() -> None:
                        for part in chunks:
                            copy_out(alias, part, block.ptr + part.offset, base)
                        self._host_copied += nbytes

                    extra.finish = publish
            except BaseException:
                self._direct_bytes -= block.capacity
                self._pool.release(block)
                raise
        else:
            engine = self._engine(direction)
            record = self._job_record(engine.submit(alias, device._ptr), engine, moved, leased, result, nbytes, extra)
        if record.extra is not None:  # enqueued inside rt.batch(): keep its batch
            extra.batch = record.extra.batch
        record.extra = extra
        imported = getattr(device, "imported", None)
        if imported is not None:
            extra.imports.append(imported)
        self._lease_host(host, extra)
        return record

    def _lane_streams(self, direction: str) -> list[Any]:
        """The copy streams of a direction's staging lanes (created if needed)."""
        with self._lock:
            engine = self._engine(direction)
            return [lane.stream for lane in engine.lanes()]

    def _engine(self, direction: str) -> StagingEngine:
        engine = self._engines.get(direction)
        if engine is None:
            engine = self._engines[direction] = StagingEngine(self._backend, self._pool, self._staging, direction)
        return engine

    def register(self, array: np.ndarray[Any, Any]) -> Registration:
        """Pin a C-contiguous NumPy array in place for repeated transfers.

        Afterwards :meth:`upload` from it and :meth:`download` into it take the
        pinned route: one DMA, no host copy. Undone by
        :meth:`Registration.release` or :meth:`close`, never while a transfer
        uses it. Pinning costs milliseconds per hundred MiB: register arrays
        that are transferred many times.
        """
        self._check_open()
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            raise TypeError("register needs a non-empty C-contiguous NumPy array")
        _check_copyable(array, "register")
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        with self._lock:
            for other in self._registrations:
                if ptr < other._ptr + other._nbytes and other._ptr < ptr + nbytes:
                    raise FerryError("this memory overlaps an active registration")
            try:
                self._backend.host_register(ptr, nbytes)
            except DeviceError as exc:
                self._note(exc)
                raise FerryError(f"could not pin the array in place: {exc}") from exc
            registration = new_registration(self, array)
            self._registrations.append(registration)
        return registration

    def _registered(self, ptr: int, nbytes: int) -> Registration | None:
        if not self._registrations:
            return None
        for registration in self._registrations:
            if registration.covers(ptr, nbytes):
                return registration
        return None

    def _unregister(self, registration: Registration) -> None:
        with self._lock:
            if registration._released:
                return
            check_releasable(registration)
            registration._released = True
            self._registrations.remove(registration)
            if self._refusal is None:
                try:
                    self._backend.host_unregister(registration._ptr)
                except DeviceError as exc:
                    self._note(exc)
                    raise FerryError(f"could not unpin the array: {exc}") from exc

    # -- blocking conveniences --------------------------------------------------------------------
    def to_device(self, array: Any) -> DeviceArray:
        """Copy a host array to a new device array and wait: ``upload(array).wait()[1]``."""
        _, destination = self.upload(np.asarray(array)).wait()
        return destination

    def to_host(self, array: DeviceArray) -> np.ndarray[Any, Any]:
        """Copy a device array into a new NumPy array and wait: ``download(array).wait()[1]``."""
        _, out = self.download(array).wait()
        result: np.ndarray[Any, Any] = out
        return result

    # -- stats and lifetime ---------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        """A consistent snapshot of the runtime's counters (works after close too)."""
        with self._lock:
            return RuntimeStats(
                in_flight=len(self._live),
                retiring=len(self._retiring),
                abandoned=self._abandoned_objects,
                abandoned_bytes=self._abandoned_bytes,
                pinned_pool_bytes=self._pool.held_bytes,
                pinned_free_bytes=self._pool.free_bytes,
                pinned_allocations=self._pool.allocations,
                device_bytes=self._device_bytes,
                submitted=self._submitted,
                completed=self._completed,
                failed=self._failed,
                events=self._event_count,
                host_copied_bytes=self._host_copied,
                staging_pinned_bytes=self._direct_bytes
                + sum(e.held_bytes for e in self._engines.values()),
                registered_bytes=sum(r._nbytes for r in self._registrations),
                host_cache_bytes=self._host_cache.free_bytes,
            )

    def close(self) -> None:
        """Wait for everything in flight, release the retirement queue, free what the runtime owns.

        Idempotent. Afterwards every call on the runtime, its buffers and its
        handles raises. Abandoned memory stays allocated (the device may still
        touch it). In a forked child it only marks the runtime closed.
        """
        with self._lock:
            if self._closed:
                return
            if self._forked:
                self._closed = True
                self._update_refusal()
                return
            pending = [r for r in list(self._live) + self._retiring.records() if not r.done]
        for record in pending:  # outside the lock: a waiter must not stop submitters elsewhere
            if record.error is not None:
                continue
            try:
                self._block(record)
                record.done = True
            except DeviceError as exc:
                with self._lock:
                    self._note(exc)
                    self._fail(record, exc)
        if self._watcher is not None:  # resolves the futures of what was watched, then stops
            self._watcher.close()
        with self._lock:
            self._closed = True
            self._update_refusal()
            for record in list(self._live):
                if record.error is None:
                    self._release_retired(record)
            self._live.clear()
            for record in self._retiring.records():
                self._release_retired(record)
            self._retiring.clear()
            usable = self._poisoned is None
            for engine in self._engines.values():
                engine.close()
            self._engines.clear()
            for registration in list(self._registrations):
                if registration._uses == 0 and usable:
                    _quietly(self._backend.host_unregister, registration._ptr)
                registration._released = True
            self._registrations.clear()
            for ptr, nbytes in self._deferred:
                self._device_bytes -= nbytes
                if usable:
                    self._free_now(ptr)
            self._deferred.clear()
            for array in list(self._arrays):
                if array._state == _device_array.OWNED:
                    array._release_for_close()
                    self._device_bytes -= array._nbytes
                    if array._ptr and usable:
                        self._free_now(array._ptr)
            for buffer in list(self._buffers):
                buffer._release_for_close()
            _quietly(self._pool.close)
            self._host_cache.clear()
            if usable:
                for event in self._events:
                    _quietly(self._backend.event_destroy, event)
                _quietly(self._backend.stream_destroy, self._h2d)
                _quietly(self._backend.stream_destroy, self._d2h)
                for stream in self._side_streams:
                    _quietly(self._backend.stream_destroy, stream)
                if self._d2d is not None:
                    _quietly(self._backend.stream_destroy, self._d2d)
            self._events.clear()
            _quietly(self._backend.close)
        _runtimes.discard(self)


def _then_record(
    backend: Any, copy: Callable[[int, int, int, Any], None]
) -> Callable[[int, int, int, Any, Any], None]:
    """A backend copy followed by an event record, with the error discipline of ``htod_record``."""

    def run(dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        if nbytes:
            copy(dst, src, nbytes, stream)
        if event is None:
            return
        try:
            backend.event_record(event, stream)
        except DeviceError as exc:
            exc.enqueued = True
            raise

    return run


def _give_back(device: Any) -> None:
    """A submission was refused after a DLPack capsule was consumed: release it."""
    imported = getattr(device, "imported", None)
    if imported is not None:
        imported.release()


def _default_staging() -> StagingConfig:
    lanes = max(2, min(StagingConfig.lanes, (os.cpu_count() or 2)))
    return StagingConfig(lanes=lanes)


def _ptr(array: np.ndarray[Any, Any]) -> int:
    return int(array.ctypes.data)


def _check_copyable(array: np.ndarray[Any, Any], call: str) -> None:
    if array.dtype.hasobject or array.dtype.itemsize == 0:
        raise TransferSubmitError(f"{call}: dtype {array.dtype} is not a fixed-size byte layout ferry copies")


def _check_match(host: np.ndarray[Any, Any], device: DeviceArray, name: str) -> None:
    if host.shape != device.shape or host.dtype != device.dtype:
        raise TransferSubmitError(
            f"shape/dtype mismatch: the NumPy array is {host.shape} {host.dtype}, "
            f"the {name} is {device.shape} {device.dtype}"
        )


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(DeviceError):
        fn(*args)


def _held_bytes(obj: Any) -> int:
    if isinstance(obj, PinnedHostBuffer):
        return int(obj._block.capacity)
    return int(obj._nbytes)


_KDL_CUDA = 2


def _dlpack_device_type(obj: Any) -> int | None:
    """The DLPack device type of ``obj`` (2: CUDA), or None if it speaks no DLPack."""
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        return None
    try:
        return int(obj.__dlpack_device__()[0])
    except Exception:
        return None


def _expect(obj: Any, kind: type, call: str, name: str, what: str) -> None:
    if not isinstance(obj, kind):
        hint = ""
        if isinstance(obj, np.ndarray):
            hint = "; NumPy arrays go through rt.to_device()/rt.to_host()"
        raise TransferSubmitError(f"{call}: {name} must be {what}, got {type(obj).__name__}{hint}")


def _size_arg(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    result = int(value)
    if result > _MAX_BYTES:
        raise ValueError(f"{name}={result} is larger than any machine's memory")
    return result


def _shape_arg(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        dims: tuple[int, ...] = (int(shape),)
    else:
        try:
            dims = tuple(_size_arg(s, "a dimension") for s in shape)
        except TypeError as exc:
            raise TypeError(f"shape must be an int or a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    return dims


def _alloc_error(what: str, nbytes: int, exc: DeviceError) -> Exception:
    if exc.code == _OOM:
        return MemoryError(f"{what} allocation of {nbytes} bytes failed: out of memory ({exc})")
    return FerryError(f"{what} allocation of {nbytes} bytes failed: {exc}")
