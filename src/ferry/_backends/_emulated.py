"""A software device: real code, not a mock.

Device memory is host memory addressed through fake device pointers (a
separate address range, so a host pointer passed where a device pointer is
expected is caught). Each stream is a worker thread that runs its operations
in order; an event marks a position in a stream; a copy moves the bytes with
``memmove`` (which releases the GIL) and then takes the time that the
configured bandwidth and per-operation latency imply, so "not ready" is a real,
observable state.

The device checks ferry's own invariants the way a sanitizer would: every
queued operation counts as a user of the allocations it touches, and freeing an
allocation (device or pinned host) that a queued operation still touches is
recorded in :attr:`EmulatedBackend.violations`. A copy outside any live
allocation is refused like an illegal address.

Faults for tests: :meth:`EmulatedBackend.fail_next_copy` makes the next
enqueued copy fail when it runs (the failure is reported by the next event
recorded on that stream, as CUDA reports an asynchronous error); with
``sticky=True`` the failure also poisons the device, so every later call raises,
as a CUDA sticky error does.
"""

from __future__ import annotations

import bisect
import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._base import DeviceError

__all__: list[str] = []

_DEVICE_BASE = 0x7E00_0000_0000  # fake device addresses live here, 2**40 apart per device
_SYSTEM_LOCK = threading.Lock()  # one lock for every emulated device: peer copies touch two


def emulated_device_count() -> int:
    """Devices the emulated machine has: ``FERRY_EMULATED_DEVICES`` (default 2)."""
    import os

    try:
        return max(1, int(os.environ.get("FERRY_EMULATED_DEVICES", "2")))
    except ValueError:
        return 2
_DEVICE_ALIGN = 512
_DEVICE_GAP = 1 << 20  # never adjacent: an overrun hits unmapped space
_HANDLE_BASE = 0x5EED_0000  # integer handles of emulated streams (what CUDA's CUstream values are)
_SLEEP_FLOOR = 20e-6  # below this, modelled time is not slept (timer granularity)


def _resident(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Memory that is already mapped, as device memory and pinned memory are:
    touching every page here keeps first-touch page faults out of the copies."""
    storage = np.empty(nbytes, dtype=np.uint8)
    storage[::4096] = 0
    return storage


class _Alloc:
    __slots__ = ("base", "busy", "freed", "kind", "nbytes", "real", "storage")

    def __init__(self, base: int, nbytes: int, real: int, storage: Any, kind: str) -> None:
        self.base = base
        self.nbytes = nbytes
        self.real = real
        self.storage = storage
        self.busy = 0
        self.kind = kind
        self.freed = False


class _AddressMap:
    """Sorted, non-overlapping ranges ``[base, base + nbytes)`` -> allocation."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._allocs: list[_Alloc] = []

    def add(self, alloc: _Alloc) -> None:
        i = bisect.bisect_left(self._bases, alloc.base)
        self._bases.insert(i, alloc.base)
        self._allocs.insert(i, alloc)

    def pop(self, base: int) -> _Alloc | None:
        i = bisect.bisect_left(self._bases, base)
        if i < len(self._bases) and self._bases[i] == base:
            del self._bases[i]
            return self._allocs.pop(i)
        return None

    def find(self, ptr: int, nbytes: int) -> _Alloc | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        alloc = self._allocs[i]
        if ptr + nbytes <= alloc.base + alloc.nbytes:
            return alloc
        return None

    def __len__(self) -> int:
        return len(self._bases)


class _Stream:
    """An in-order queue of operations run by one worker thread."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pending_error: DeviceError | None = None
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"ferry-emulated-stream-{index}", daemon=True
        )
        self._thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        self._queue.put(op)

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            op()


class _Event:
    __slots__ = ("cond", "done", "error", "recorded")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.recorded = 0  # generation of the latest record
        self.done = 0  # latest generation that completed
        self.error: DeviceError | None = None  # failure of generation ``done``


class _Gate:
    __slots__ = ("flag",)

    def __init__(self) -> None:
        self.flag = threading.Event()


class EmulatedBackend:
    """The software device. See the module docstring for what it models."""

    name = "emulated"

    def __init__(
        self, device: int = 0, *, bandwidth: float = 25e9, latency: float = 5e-6, peer: bool = True
    ) -> None:
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        count = emulated_device_count()
        if device >= count:
            from .._errors import DeviceUnavailableError

            raise DeviceUnavailableError(
                f"the emulated machine has {count} device(s) (FERRY_EMULATED_DEVICES); there is no device {device}"
            )
        self.peer = peer
        if bandwidth <= 0 or latency < 0:
            raise ValueError("emulated bandwidth must be > 0 and latency >= 0")
        self.device = device
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.violations: list[str] = []
        self.sync_calls = 0  # host waits (event/stream synchronize), for tests
        self._lock = _SYSTEM_LOCK
        self._device_map = _AddressMap()
        self._host_map = _AddressMap()
        self._next_device = _DEVICE_BASE + (device << 40)
        self._peers: set[int] = set()
        self._streams: list[_Stream] = []
        self._stream_count = 0
        self._fail_next: bool | None = None  # None: no fault armed; else: sticky?
        self._fail_after = 0  # copies to let through before the armed fault
        self._poisoned: DeviceError | None = None

    # -- faults ---------------------------------------------------------------
    def fail_next_copy(self, *, sticky: bool = False, after: int = 0) -> None:
        """Make the copy enqueued after the next ``after`` ones fail when it runs."""
        with self._lock:
            self._fail_next = sticky
            self._fail_after = after

    def _check(self) -> None:
        if self._poisoned is not None:
            raise self._poisoned

    def _violation(self, message: str) -> None:
        self.violations.append(message)

    # -- identity ---------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": self.device,
            "name": f"ferry emulated device {self.device}",
            "driver": "software",
            "link": f"modelled: {self.bandwidth / 1e9:.1f} GB/s per copy stream, "
            f"{self.latency * 1e6:.1f} us per operation",
        }

    # -- memory ------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        self._check()
        storage = _resident(nbytes)
        with self._lock:
            base = self._next_device
            self._next_device += -(-nbytes // _DEVICE_ALIGN) * _DEVICE_ALIGN + _DEVICE_GAP
            self._device_map.add(_Alloc(base, nbytes, storage.ctypes.data, storage, "device"))
        return base

    def mem_free(self, ptr: int) -> None:
        self._check()
        self._free(self._device_map, ptr, "device memory")

    def host_alloc(self, nbytes: int) -> int:
        self._check()
        storage = _resident(nbytes)
        real = storage.ctypes.data
        with self._lock:
            self._host_map.add(_Alloc(real, nbytes, real, storage, "pinned"))
        return int(real)

    def host_free(self, ptr: int) -> None:
        self._check()
        self._free(self._host_map, ptr, "pinned host memory")

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._check()
        with self._lock:
            if self._host_map.find(ptr, 1) is not None:
                raise DeviceError("host memory is already registered", code=712)
            self._host_map.add(_Alloc(ptr, nbytes, ptr, None, "registered"))

    def host_unregister(self, ptr: int) -> None:
        self._check()
        self._free(self._host_map, ptr, "registered host memory")

    def _free(self, amap: _AddressMap, ptr: int, what: str) -> None:
        with self._lock:
            alloc = amap.pop(ptr)
            if alloc is None:
                raise DeviceError(f"invalid {what} address {ptr:#x}", code=1)
            alloc.freed = True
            if alloc.busy:
                self._violation(
                    f"{what} at {ptr:#x} ({alloc.nbytes} bytes) freed while "
                    f"{alloc.busy} queued operation(s) still touch it"
                )

    def live_allocations(self) -> tuple[int, int]:
        """(device allocations, host allocations) currently live."""
        with self._lock:
            return len(self._device_map), len(self._host_map)

    # -- streams and events ----------------------------------------------------------
    def stream_create(self) -> _Stream:
        self._check()
        with self._lock:
            self._stream_count += 1
            stream = _Stream(self._stream_count)
            self._streams.append(stream)
        return stream

    def stream_destroy(self, stream: _Stream) -> None:
        stream.stop()
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)

    def stream_handle(self, stream: _Stream) -> int:
        return _HANDLE_BASE + stream.index

    def stream_from_handle(self, handle: int) -> _Stream:
        with self._lock:
            for stream in self._streams:
                if _HANDLE_BASE + stream.index == handle:
                    return stream
        raise DeviceError(f"invalid stream handle {handle:#x} for the emulated device", code=400)

    def stream_synchronize(self, stream: _Stream) -> None:
        self._check()
        self.sync_calls += 1
        done = threading.Event()
        stream.submit(done.set)
        done.wait()
        self._check()

    def event_create(self, blocking: bool = False) -> _Event:
        self._check()
        return _Event()

    def event_destroy(self, event: _Event) -> None:
        del event

    def event_record(self, event: _Event, stream: _Stream) -> None:
        self._check()
        with event.cond:
            event.recorded += 1
            generation = event.recorded

        def complete() -> None:
            error, stream.pending_error = stream.pending_error, None
            with event.cond:
                event.done = generation
                event.error = error
                event.cond.notify_all()

        stream.submit(complete)

    def _event_state(self, event: _Event) -> bool:
        # caller holds event.cond
        if event.done < event.recorded:
            return False
        if event.error is not None:
            raise event.error
        return True

    def event_query(self, event: _Event) -> bool:
        self._check()
        with event.cond:
            return self._event_state(event)

    def event_synchronize(self, event: _Event) -> None:
        self._check()
        self.sync_calls += 1
        with event.cond:
            while not self._event_state(event):
                event.cond.wait()
        self._check()

    def stream_wait_event(self, stream: _Stream, event: _Event) -> None:
        self._check()
        with event.cond:
            generation = event.recorded

        def wait() -> None:
            with event.cond:
                while event.done < generation:
                    event.cond.wait()
                error = event.error if event.done == generation else None
            if error is not None and stream.pending_error is None:
                stream.pending_error = error

        if generation:
            stream.submit(wait)

    # -- copies -----------------------------------------------------------------
    def memcpy_htod(self, dst: int, src: int, nbytes: int, stream: _Stream) -> None:
        self._copy(dst, self._device_map, src, self._host_map, nbytes, stream)

    def memcpy_dtoh(self, dst: int, src: int, nbytes: int, stream: _Stream) -> None:
        self._copy(dst, self._host_map, src, self._device_map, nbytes, stream)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: _Stream) -> None:
        self._copy(dst, self._device_map, src, self._device_map, nbytes, stream)

    def memcpy_peer(self, dst: int, src: int, src_backend: EmulatedBackend, nbytes: int, stream: _Stream) -> None:
        if src_backend.device not in self._peers:
            raise DeviceError(f"peer access to device {src_backend.device} is not enabled", code=705)
        self._copy(dst, self._device_map, src, src_backend._device_map, nbytes, stream, src_is_device=True)

    def device_count(self) -> int:
        return emulated_device_count()

    def peer_access(self, other: EmulatedBackend) -> tuple[bool, str, dict[str, Any]]:
        if other.device == self.device:
            return True, "same device", {}
        if not (self.peer and other.peer):
            return False, "peer access withdrawn on the emulated device (peer_access=False)", {"access_supported": 0}
        return True, "emulated devices share one address space", {"access_supported": 1, "performance_rank": 0}

    def enable_peer(self, other: EmulatedBackend) -> None:
        ok, reason, _ = self.peer_access(other)
        if not ok:
            raise DeviceError(f"cannot enable peer access: {reason}", code=217)
        self._peers.add(other.device)

    def _copy(
        self,
        dst: int,
        dst_map: _AddressMap,
        src: int,
        src_map: _AddressMap,
        nbytes: int,
        stream: _Stream,
        *,
        src_is_device: bool = False,
    ) -> None:
        self._check()
        with self._lock:
            touched: list[_Alloc] = []
            addresses = []
            for ptr, amap, device_side in ((dst, dst_map, dst_map is self._device_map),
                                           (src, src_map, src_is_device or src_map is self._device_map)):
                alloc = amap.find(ptr, max(nbytes, 1))
                if alloc is None:
                    if device_side:
                        raise DeviceError(
                            f"illegal address: {nbytes} bytes at device address {ptr:#x} "
                            "are not inside one live allocation",
                            code=700,
                        )
                    addresses.append(ptr)  # pageable host memory: allowed, untracked
                    continue
                alloc.busy += 1
                touched.append(alloc)
                addresses.append(alloc.real + (ptr - alloc.base))
            fail = None
            if self._fail_next is not None:
                if self._fail_after:
                    self._fail_after -= 1
                else:
                    fail, self._fail_next = self._fail_next, None
        real_dst, real_src = addresses
        duration = self.latency + nbytes / self.bandwidth
        # keep the storages alive for the op even if freed (a violation is recorded instead)
        keep = [a.storage for a in touched]

        def run() -> None:
            start = time.perf_counter()
            try:
                if fail is None:
                    ctypes.memmove(real_dst, real_src, nbytes)
                else:
                    ctypes.memmove(real_dst, real_src, nbytes // 2)  # a torn copy
                    error = DeviceError(
                        "injected copy failure" + (" (sticky: device poisoned)" if fail else ""),
                        code=719 if fail else 999,
                        sticky=bool(fail),
                    )
                    if fail:
                        self._poisoned = error
                    stream.pending_error = error
                remaining = start + duration - time.perf_counter()
                if remaining > _SLEEP_FLOOR:
                    time.sleep(remaining)
            finally:
                with self._lock:
                    for alloc in touched:
                        alloc.busy -= 1
                del keep[:]

        stream.submit(run)

    def htod_record(self, dst: int, src: int, nbytes: int, stream: _Stream, event: _Event | None) -> None:
        if nbytes:
            self.memcpy_htod(dst, src, nbytes, stream)
        self._record_after_copy(event, stream)

    def dtoh_record(self, dst: int, src: int, nbytes: int, stream: _Stream, event: _Event | None) -> None:
        if nbytes:
            self.memcpy_dtoh(dst, src, nbytes, stream)
        self._record_after_copy(event, stream)

    def _record_after_copy(self, event: _Event | None, stream: _Stream) -> None:
        if event is None:
            return
        try:
            self.event_record(event, stream)
        except DeviceError as exc:
            exc.enqueued = True
            raise

    def enqueue_fill(
        self, stream: _Stream, ptr: int, nbytes: int, value: int, delay: float, *, fail: bool = False
    ) -> None:
        """A stand-in for a producer kernel: after ``delay`` seconds, fill device memory
        (or, with ``fail``, report a failure on the stream as a faulting kernel would)."""
        self._check()
        with self._lock:
            alloc = self._device_map.find(ptr, max(nbytes, 1))
            if alloc is None:
                raise DeviceError(f"illegal address {ptr:#x}", code=700)
            alloc.busy += 1
        real = alloc.real + (ptr - alloc.base)

        def run() -> None:
            try:
                time.sleep(delay)
                if fail:
                    stream.pending_error = DeviceError("producer kernel failed", code=719)
                else:
                    ctypes.memset(real, value, nbytes)
            finally:
                with self._lock:
                    alloc.busy -= 1

        stream.submit(run)

    # -- gates ------------------------------------------------------------------------
    def gate_create(self) -> _Gate:
        return _Gate()

    def stream_wait_gate(self, stream: _Stream, gate: _Gate) -> None:
        self._check()
        def wait() -> None:
            gate.flag.wait()

        stream.submit(wait)

    def gate_open(self, gate: _Gate) -> None:
        gate.flag.set()

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            stream.stop()
