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

Stream-ordered memory (``mem_pool_alloc``/``mem_free_async``) is checked by
happens-before, not by timing, so a free that *could* race a queued use is
reported even when the use happened to run first. Every stream keeps a vector
clock (which positions of which streams its next operation is ordered after);
an event carries the clock of the position it was recorded at, a stream wait
merges it, and the host merges what it observes complete (an event
synchronize, a query that answers ready, a stream or device synchronize)
into one host clock that every later operation starts from. A pool
allocation remembers the position it was made at and every stream position
that used it: a use not ordered after the allocation, or a free not ordered
after every use, is a violation. A freed block returns to its pool when the
free runs on its stream; the pool reuses it for a later allocation of a fitting
size, keeps at most its release threshold at synchronization points, and gives
the rest back when trimmed.

Faults for tests: :meth:`EmulatedBackend.fail_next_copy` makes the next
enqueued copy fail when it runs (the failure is reported by the next event
recorded on that stream, as CUDA reports an asynchronous error); with
``sticky=True`` the failure also poisons the device, so every later call raises,
as a CUDA sticky error does.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ._base import DeviceError

__all__: list[str] = []

_DEVICE_BASE = 0x7E00_0000_0000  # fake device addresses live here, 2**40 apart per device
# One lock for every emulated device (peer copies touch two). Reentrant: a garbage collection may run
# on a stream worker while it holds the lock, and a finalizer there may call back into the device
# (poll a handle, which flushes a batch): with a plain lock that thread waited for itself forever.
_SYSTEM_LOCK = threading.RLock()


def _fresh(error: DeviceError) -> DeviceError:
    """A new exception for a stored failure: raising the stored one again and again would chain
    every raise's frames onto its traceback, and keep whatever those frames reference alive."""
    return DeviceError(str(error), code=error.code, sticky=error.sticky, enqueued=error.enqueued)


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
_POOL_GRANULE = 2 << 20  # pool blocks of a MiB or more are reserved in these units, as CUDA's are
_LEGACY_HANDLES = (0, 1)  # CU_STREAM_LEGACY (0 is the NULL stream, the same one here)
_UIDS = itertools.count(1)  # stream identities, unique across devices: clocks span peer copies


class _HostClock:
    """What the host has observed complete: stream uid -> position. Under ``_SYSTEM_LOCK``."""

    clock: ClassVar[dict[int, int]] = {}
    version: ClassVar[int] = 0


def _host_join(snapshot: dict[int, int]) -> None:
    """The host observed everything ``snapshot`` is ordered after (``_SYSTEM_LOCK`` held)."""
    clock = _HostClock.clock
    changed = False
    for uid, pos in snapshot.items():
        if clock.get(uid, 0) < pos:
            clock[uid] = pos
            changed = True
    if changed:
        _HostClock.version += 1


def _memory_bytes() -> int:
    """The emulated device's memory: ``FERRY_EMULATED_MEMORY`` bytes (default 1 TiB)."""
    try:
        return max(1, int(os.environ.get("FERRY_EMULATED_MEMORY", str(1 << 40))))
    except ValueError:
        return 1 << 40


def _resident(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Memory that is already mapped, as device memory and pinned memory are:
    touching every page here keeps first-touch page faults out of the copies."""
    storage = np.empty(nbytes, dtype=np.uint8)
    storage[::4096] = 0
    return storage


class _Alloc:
    __slots__ = ("base", "born", "busy", "freed", "kind", "nbytes", "pool", "real", "size", "storage", "uses")

    def __init__(self, base: int, nbytes: int, real: int, storage: Any, kind: str) -> None:
        self.base = base
        self.nbytes = nbytes
        self.real = real
        self.storage = storage
        self.busy = 0
        self.kind = kind
        self.freed = False
        self.pool: _Pool | None = None  # set for stream-ordered (pool) allocations
        self.size = 0  # the pool block's size
        self.born = (0, 0)  # (stream uid, position) of the allocation
        self.uses: dict[int, int] = {}  # stream uid -> latest position that touched it


class _Pool:
    """A stream-ordered memory pool: blocks in use, and freed blocks kept for reuse."""

    def __init__(self, threshold: int | None) -> None:
        self.threshold = threshold  # reserved bytes kept at synchronization points (None: all)
        self.reserved = 0
        self.used = 0
        # freed blocks: [size, storage, uid of the stream whose free has not run yet, or 0]
        self.free: list[list[Any]] = []
        self.destroyed = False

    def take(self, size: int, stream_uid: int) -> tuple[int, Any] | None:
        """The smallest freed block that fits ``size`` without wasting more than it, or None. A block
        whose free has not run is taken only by the stream it was freed on (stream order)."""
        best = -1
        for i, (have, _, pending) in enumerate(self.free):
            if pending and pending != stream_uid:
                continue
            if size <= have <= 2 * size + _POOL_GRANULE and (best < 0 or have < self.free[best][0]):
                best = i
        if best < 0:
            return None
        have, storage, _ = self.free.pop(best)
        return have, storage

    def shrink_to(self, keep: int) -> int:
        """Drop freed blocks whose free ran (largest first) until at most ``keep`` bytes stay
        reserved; the bytes dropped."""
        dropped = 0
        self.free.sort(key=lambda block: (not block[2], block[0]))
        while self.free and not self.free[-1][2] and self.reserved > keep:
            size, _, _ = self.free.pop()
            self.reserved -= size
            dropped += size
        return dropped


def _block_size(nbytes: int) -> int:
    if nbytes >= _POOL_GRANULE // 2:
        return -(-nbytes // _POOL_GRANULE) * _POOL_GRANULE
    return -(-nbytes // _DEVICE_ALIGN) * _DEVICE_ALIGN


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

    def __init__(self, index: int, handle: int | None = None) -> None:
        self.index = index
        self.handle = _HANDLE_BASE + index if handle is None else handle
        self.pending_error: DeviceError | None = None
        self.uid = next(_UIDS)
        self.pos = 0  # positions handed out (``advance``), under _SYSTEM_LOCK
        self.clock: dict[int, int] = {}  # what the next operation is ordered after
        self.seen = -1  # the host clock version last merged
        self.pending = 0  # operations queued or running
        self.stopped = False
        self._count = threading.Lock()
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"ferry-emulated-stream-{index}", daemon=True
        )
        self._thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        with self._count:
            self.pending += 1
        self._queue.put(op)

    def advance(self) -> int:
        """The next operation's position; it is ordered after what the host observed. _SYSTEM_LOCK held."""
        if self.seen != _HostClock.version:
            clock = self.clock
            for uid, pos in _HostClock.clock.items():
                if clock.get(uid, 0) < pos:
                    clock[uid] = pos
            self.seen = _HostClock.version
        self.pos += 1
        self.clock[self.uid] = self.pos
        return self.pos

    def stop(self) -> None:
        self.stopped = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                op()
            finally:
                with self._count:
                    self.pending -= 1


class _Event:
    """An event's records, each with its own outcome (CUDA's rule): a query or a synchronization is
    about the newest record; a stream's wait is about the record that was newest when it was made,
    whatever records come after it; records on different streams complete in any order."""

    __slots__ = ("clock", "cond", "finished", "low", "recorded")

    def __init__(self) -> None:
        self.clock: dict[int, int] = {}  # the clock of the latest record's position
        self.cond = threading.Condition()
        self.recorded = 0  # generation of the latest record
        self.low = 0  # every generation up to this one completed
        self.finished: dict[int, DeviceError | None] = {}  # later generations that completed; and failures

    def complete(self, generation: int, error: DeviceError | None) -> None:
        """Record ``generation``'s outcome (caller holds ``cond``)."""
        self.finished[generation] = error
        while self.low + 1 in self.finished:
            self.low += 1
            if self.finished[self.low] is None:
                del self.finished[self.low]  # a failure is kept: a wait made for it reports it

    def is_done(self, generation: int) -> bool:
        return generation <= self.low or generation in self.finished

    def error_of(self, generation: int) -> DeviceError | None:
        return self.finished.get(generation)


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
        self.batches = 0  # copy_batch calls and the copies they carried, for tests
        self.batched_copies = 0
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
        self._pools: list[_Pool] = []
        self._legacy: _Stream | None = None
        self.device_syncs = 0  # device-wide synchronizations (not host waits of the caller)
        self.pools = os.environ.get("FERRY_EMULATED_POOLS", "1").strip() != "0"
        self.memory_bytes = _memory_bytes()  # the device's memory; allocations beyond raise OOM
        self._held = 0  # device memory taken: allocations plus what pools reserve

    # -- faults ---------------------------------------------------------------
    def fail_next_copy(self, *, sticky: bool = False, after: int = 0) -> None:
        """Make the copy enqueued after the next ``after`` ones fail when it runs."""
        with self._lock:
            self._fail_next = sticky
            self._fail_after = after

    def _check(self) -> None:
        if self._poisoned is not None:
            raise _fresh(self._poisoned)

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
        self._reserve(nbytes)
        try:
            storage = _resident(nbytes)
        except MemoryError:
            self._unreserve(nbytes)
            raise
        with self._lock:
            base = self._next_device
            self._next_device += -(-nbytes // _DEVICE_ALIGN) * _DEVICE_ALIGN + _DEVICE_GAP
            self._device_map.add(_Alloc(base, nbytes, storage.ctypes.data, storage, "device"))
        return base

    def mem_free(self, ptr: int) -> None:
        self._check()
        alloc = self._free(self._device_map, ptr, "device memory")
        if alloc.pool is not None:
            self._violation(f"pool memory at {ptr:#x} freed with mem_free (it needs mem_free_async)")
        self._unreserve(alloc.nbytes)

    def _reserve(self, nbytes: int) -> None:
        with self._lock:
            if self._held + nbytes > self.memory_bytes:
                raise DeviceError(
                    f"out of memory: {nbytes} bytes asked, {self.memory_bytes - self._held} of "
                    f"{self.memory_bytes} free", code=2,
                )
            self._held += nbytes

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    # -- stream-ordered pools ----------------------------------------------------------
    def mem_pool_create(self, release_threshold: int | None) -> _Pool | None:
        self._check()
        if not self.pools:
            return None
        pool = _Pool(release_threshold)
        with self._lock:
            self._pools.append(pool)
        return pool

    def mem_pool_destroy(self, pool: _Pool) -> None:
        with self._lock:
            self._held -= pool.shrink_to(0)  # the blocks whose free has run; the others when it runs
            pool.destroyed = True
            if pool in self._pools:
                self._pools.remove(pool)

    def mem_pool_alloc(self, pool: _Pool, nbytes: int, stream: _Stream) -> int:
        self._check()
        size = _block_size(nbytes)
        with self._lock:
            if pool.destroyed:
                raise DeviceError("invalid memory pool (destroyed)", code=1)
            block = pool.take(size, stream.uid)
        if block is None:  # grow: outside the lock, the pages are touched here
            self._reserve(size)
            try:
                block = (size, _resident(size))
            except MemoryError:
                self._unreserve(size)
                raise
            with self._lock:
                pool.reserved += size
        have, storage = block
        with self._lock:
            base = self._next_device
            self._next_device += have + _DEVICE_GAP
            alloc = _Alloc(base, nbytes, storage.ctypes.data, storage, "device")
            alloc.pool = pool
            alloc.size = have
            alloc.born = (stream.uid, stream.advance())
            self._device_map.add(alloc)
            pool.used += have
            idle = stream.pending == 0
            if idle:  # nothing queued: the stream is at the allocation now
                _host_join(dict(stream.clock))
            else:
                reached = threading.Event()
                snapshot = dict(stream.clock)
                stream.submit(reached.set)
        if not idle:
            reached.wait()
            with self._lock:
                _host_join(snapshot)
        return base

    def mem_free_async(self, ptr: int, stream: _Stream) -> None:
        self._check()
        with self._lock:
            alloc = self._device_map.pop(ptr)
            if alloc is None:
                raise DeviceError(f"invalid device memory address {ptr:#x}", code=1)
            pool = alloc.pool
            if pool is None:
                self._device_map.add(alloc)
                raise DeviceError(f"device memory at {ptr:#x} is not from a pool: it needs mem_free", code=1)
            stream.advance()
            clock = stream.clock
            born_uid, born_pos = alloc.born
            if clock.get(born_uid, 0) < born_pos:
                self._violation(f"pool memory at {ptr:#x} freed on stream {stream.handle:#x} before its "
                                "allocation is ordered before the free")
            for uid, pos in alloc.uses.items():
                if clock.get(uid, 0) < pos:
                    self._violation(
                        f"pool memory at {ptr:#x} ({alloc.nbytes} bytes) freed on stream {stream.handle:#x} "
                        f"while a use queued on another stream (uid {uid}, position {pos}) is not ordered "
                        "before the free: it could race the free"
                    )
            alloc.freed = True
            size = alloc.size
            block = [size, alloc.storage, stream.uid]  # reusable on this stream at once, elsewhere once run
            if not pool.destroyed:
                pool.free.append(block)

            def run() -> None:
                with self._lock:
                    if alloc.busy:  # users the clocks do not see (the native engine's copies) still run
                        self._violation(
                            f"pool memory at {ptr:#x} ({alloc.nbytes} bytes) freed on stream {stream.handle:#x} "
                            f"while {alloc.busy} queued operation(s) still touch it"
                        )
                    pool.used -= size
                    block[2] = 0
                    if pool.destroyed:
                        self._held -= size
                        pool.reserved -= size

            stream.submit(run)

    def mem_pool_trim(self, pool: _Pool, keep_bytes: int) -> None:
        self._check()
        with self._lock:
            self._held -= pool.shrink_to(keep_bytes)

    def mem_pool_usage(self, pool: _Pool) -> tuple[int, int]:
        with self._lock:
            return pool.reserved, pool.used

    def _observed(self, snapshot: dict[int, int]) -> None:
        """The host observed ``snapshot`` complete: a synchronization point. _SYSTEM_LOCK held."""
        _host_join(snapshot)
        for pool in self._pools:
            if pool.threshold is not None and pool.reserved > pool.threshold:
                self._held -= pool.shrink_to(pool.threshold)

    def device_synchronize(self) -> None:
        self._check()
        with self._lock:
            marks = []
            for stream in self._streams:
                if not stream.stopped:
                    reached = threading.Event()
                    marks.append((stream, reached, dict(stream.clock)))
                    stream.submit(reached.set)
        for stream, reached, _ in marks:
            while not reached.wait(0.05):
                if stream.stopped and not stream._thread.is_alive():
                    break
        with self._lock:
            for _, _, snapshot in marks:
                self._observed(snapshot)
            self.device_syncs += 1
        self._check()

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

    def _free(self, amap: _AddressMap, ptr: int, what: str) -> _Alloc:
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
            return alloc

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
        return stream.handle

    def stream_from_handle(self, handle: int) -> _Stream:
        with self._lock:
            if handle in _LEGACY_HANDLES:  # the legacy default stream, made on first use
                if self._legacy is None:
                    self._legacy = _Stream(0, handle=1)
                    self._streams.append(self._legacy)
                return self._legacy
            for stream in self._streams:
                if stream.handle == handle:
                    return stream
        raise DeviceError(f"invalid stream handle {handle:#x} for the emulated device", code=400)

    def stream_synchronize(self, stream: _Stream) -> None:
        self._check()
        self.sync_calls += 1
        done = threading.Event()
        with self._lock:
            snapshot = dict(stream.clock)
            stream.submit(done.set)
        done.wait()
        with self._lock:
            self._observed(snapshot)
        self._check()

    def event_create(self, blocking: bool = False) -> _Event:
        self._check()
        return _Event()

    def event_destroy(self, event: _Event) -> None:
        del event

    def event_record(self, event: _Event, stream: _Stream) -> None:
        self._check()
        with self._lock:
            stream.advance()
            with event.cond:
                event.recorded += 1
                generation = event.recorded
                event.clock = dict(stream.clock)
            self._record_submit(event, stream, generation)

    def _record_submit(self, event: _Event, stream: _Stream, generation: int) -> None:

        def complete() -> None:
            error, stream.pending_error = stream.pending_error, None
            with event.cond:
                event.complete(generation, error)  # this record's outcome: not a later or an earlier one's
                event.cond.notify_all()

        stream.submit(complete)

    def _event_state(self, event: _Event) -> bool:
        # caller holds event.cond
        if not event.is_done(event.recorded):
            return False
        error = event.error_of(event.recorded)
        if error is not None:
            raise _fresh(error)
        return True

    def event_query(self, event: _Event) -> bool:
        self._check()
        with event.cond:
            ready = self._event_state(event)
            clock = event.clock
        if ready:
            with self._lock:
                self._observed(clock)
        return ready

    def event_synchronize(self, event: _Event) -> None:
        self._check()
        self.sync_calls += 1
        with event.cond:
            while not self._event_state(event):
                event.cond.wait()
            clock = event.clock
        with self._lock:
            self._observed(clock)
        self._check()

    def event_wait(self, event: _Event, timeout: float) -> bool:
        self._check()
        self.sync_calls += 1
        with event.cond:
            if not self._event_state(event):
                deadline = time.monotonic() + timeout
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    event.cond.wait(remaining)  # a lock wait: signals reach the main thread
                    if self._event_state(event):
                        break
            clock = event.clock
        with self._lock:
            self._observed(clock)
        self._check()
        return True

    def stream_wait_event(self, stream: _Stream, event: _Event) -> None:
        self._check()
        with self._lock:
            with event.cond:
                generation = event.recorded
                clock = event.clock
            if generation:  # later work on the stream is ordered after the event's position
                stream.advance()
                merged = stream.clock
                for uid, pos in clock.items():
                    if merged.get(uid, 0) < pos:
                        merged[uid] = pos
                self._wait_submit(event, stream, generation)

    def _wait_submit(self, event: _Event, stream: _Stream, generation: int) -> None:

        def wait() -> None:
            with event.cond:
                while not event.is_done(generation):
                    event.cond.wait()
                error = event.error_of(generation)
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

        with self._lock:
            self._enqueue_use(stream, touched, run)

    def _enqueue_use(self, stream: _Stream, touched: list[_Alloc], op: Callable[[], None]) -> None:
        """Queue ``op``, which touches ``touched``, and check it against their pools' order. Lock held."""
        pos = stream.advance()
        clock = stream.clock
        for alloc in touched:
            if alloc.pool is None:
                continue
            if alloc.freed:
                self._violation(f"pool memory at {alloc.base:#x} used on stream {stream.handle:#x} after its free")
            uid, born = alloc.born
            if clock.get(uid, 0) < born:
                self._violation(
                    f"pool memory at {alloc.base:#x} used on stream {stream.handle:#x} before its allocation "
                    "is ordered before the use"
                )
            alloc.uses[stream.uid] = pos
        stream.submit(op)

    def htod_record(self, dst: int, src: int, nbytes: int, stream: _Stream, event: _Event | None) -> None:
        if nbytes:
            self.memcpy_htod(dst, src, nbytes, stream)
        self._record_after_copy(event, stream)

    def dtoh_record(self, dst: int, src: int, nbytes: int, stream: _Stream, event: _Event | None) -> None:
        if nbytes:
            self.memcpy_dtoh(dst, src, nbytes, stream)
        self._record_after_copy(event, stream)

    def copy_batch(
        self, upload: bool, dsts: list[int], srcs: list[int], sizes: list[int], stream: _Stream, event: _Event | None
    ) -> None:
        """One stream operation per copy, in order (a device has no batch API to model), then the event."""
        copy = self.memcpy_htod if upload else self.memcpy_dtoh
        for i, (dst, src, nbytes) in enumerate(zip(dsts, srcs, sizes, strict=True)):
            if nbytes:
                try:
                    copy(dst, src, nbytes, stream)
                except DeviceError as exc:
                    exc.enqueued = i > 0
                    raise
        self.batches += 1
        self.batched_copies += len(dsts)
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

        with self._lock:
            self._enqueue_use(stream, [alloc], run)

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

    # -- hooks for the native staging engine's emulated mode ----------------------------------
    def native_target(self, ptr: int, nbytes: int) -> int:
        """The host address behind device memory ``[ptr, ptr + nbytes)``, for the native engine.

        The engine's emulated DMAs copy there directly; until
        :meth:`native_release` the allocation counts one more queued use, so
        freeing it meanwhile is recorded as a violation, as for any queued copy.
        """
        self._check()
        with self._lock:
            alloc = self._device_map.find(ptr, max(nbytes, 1))
            if alloc is None:
                raise DeviceError(f"illegal address: no device allocation covers {ptr:#x} (+{nbytes})", code=700,
                                  sticky=True)
            alloc.busy += 1
            return int(alloc.real) + (ptr - alloc.base)

    def native_release(self, ptr: int, nbytes: int) -> None:
        """The native engine is done with ``[ptr, ptr + nbytes)`` (see :meth:`native_target`)."""
        with self._lock:
            alloc = self._device_map.find(ptr, max(nbytes, 1))
            if alloc is not None and alloc.busy:
                alloc.busy -= 1

    def take_armed_fault(self) -> tuple[int, bool] | None:
        """Disarm and return ``(after, sticky)`` of a fault armed by :meth:`fail_next_copy`, if any
        (a staged transfer on the native engine takes it over)."""
        with self._lock:
            if self._fail_next is None:
                return None
            armed = (self._fail_after, self._fail_next)
            self._fail_next = None
            self._fail_after = 0
            return armed

    def stream_wait_host(self, stream: _Stream, wait: Callable[[], object]) -> None:
        """Hold ``stream`` until ``wait()`` returns (it runs on the stream's worker): how a
        consumer stream is ordered after work the emulated streams do not run themselves."""
        self._check()

        def run() -> None:
            wait()

        stream.submit(run)

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            stream.stop()
