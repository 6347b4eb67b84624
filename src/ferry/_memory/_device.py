"""Device memory: a stream-ordered pool, frees ordered after every user, and the accounting.

Allocation
----------
A runtime owns one CUDA memory pool (``cuMemPoolCreate``) whose release
threshold keeps freed memory reserved between batches, so a fresh array costs
a pool lookup, not a ``cuMemAlloc``. Stream-ordered memory belongs to the
position of the stream it was allocated on; other streams may use it only
once they are ordered after that position. ferry allocates on its own
*allocation stream*, which never waits for anything: it holds only
allocations and frees of memory nothing uses any more, and the pool is told
never to make an allocation wait for another stream (no internal
dependencies: it reuses a block whose free has completed, or one freed on the
allocation stream, or grows). So the allocation stream is always at its end,
synchronizing it returns at once, and the backend does so after every
allocation: from then on the host has observed the allocation and *every*
stream's first use is ordered after it, with no event and no wait on the
device. Where the device has no memory pools
(``CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`` is 0) ``cuMemAlloc`` and
``cuMemFree`` serve instead.

Frees
-----
A free must come after every use on the device. ferry's own transfers hold
their arrays until their completion is proven (a record keeps what it
touches, even after a hand-off), so when an array dies its ferry uses are
complete. What ferry cannot see is other libraries' work, and the array
remembers what may still be running there:

* the streams it was handed to (``PendingUpload.hand_off(stream)``), the
  ``stream`` a consumer passed to ``__dlpack__``, and the streams named by
  :meth:`~ferry.DeviceArray.record_stream`: the free waits for each of them
  on the device. At the first ordinary call after the array died (a finalizer
  never calls the device) an event is recorded on each of those streams and
  the memory waits in :attr:`DeviceMemory.awaiting`; each allocation (and
  ``stats()``, ``trim()``) first queries those events, never waiting, and
  frees on the allocation stream the memory whose events have all completed
  (``cuMemFreeAsync``), so the next allocation reuses it at once. Recording
  later than the death only waits for more work, never less, and nothing on
  ferry's streams waits for another library's work. This is what PyTorch's
  caching allocator does with ``record_stream``. (A free on a private stream
  made to wait for the events on the device was tried first: the pool never
  learns that such a free completed, reuses nothing and grows until the
  device runs out: 116 GiB after 5,000 batches of 32 MiB on an H200, out of
  memory at batch 5,823.) An allocation that finds the device out of memory
  waits, interruptibly and for at most ``OOM_WAIT`` seconds, for the memory
  whose consumers are still running, frees it and tries once more.
  ``close()`` waits for no consumer on the host: it queues each remaining
  free on the allocation stream behind its consumers' events, on the device,
  and destroys the pool, which gives the memory back once those frees ran.
* Exports that name no stream (``__cuda_array_interface__``, ``ptr``,
  ``__dlpack__(stream=-1)`` or the per-thread default stream): the consumer
  may use any stream, so the only rule that can never free early is to wait
  until the whole device has been idle once. Such an array's memory goes to a
  background thread that synchronizes the device (``cuCtxSynchronize``;
  never on the caller's thread, never on the transfer path) and frees
  everything that died before the synchronization began. A later
  ``record_stream`` declares the streams and lifts the rule.

Small blocks
------------
A fresh small array (``rt.upload(a)`` of a few bytes, ``rt.empty((4,))``)
would cost an allocation and a stream synchronization, and its free one more
driver call: more than the copy itself. Blocks of up to
:data:`SMALL_CACHE_BYTES` are therefore allocated in size classes (512 B to
4 KiB) and, when freed with no user beyond ferry's own (completed) copies, kept
for the next array of their class instead of freed, up to
:data:`SMALL_CACHE_BLOCKS` of them: that is what PyTorch's caching allocator
does for every size. A kept block is reused only once it is freed exactly as
:meth:`DeviceMemory._free_now` would have freed it, so reuse is never early. Kept
blocks count neither in ``device_bytes`` nor in the pool's used bytes;
``trim()`` and ``close()`` free them.

Nothing is ever freed from a finalizer: a collected array appends its address
to :attr:`DeviceMemory.deferred` (a list append, atomic under the GIL), and
the runtime's next ordinary call frees it as above. ``close()`` may block:
after the runtime's copies are waited it synchronizes the device once if any
memory with unknown users is left, frees everything in order, then destroys
the pool (frees still pending on the device complete first). At interpreter
exit it waits for no other library's work: memory with unknown users is left
to the driver, which reclaims it with the process.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from .._args import alloc_error
from .._backends._base import Backend, DeviceError
from .._interop._cai import stream_handle_of
from .._state import OWNED, State

if TYPE_CHECKING:
    from .._lifecycle import Health

__all__: list[str] = []

_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
_LEGACY = 1  # CU_STREAM_LEGACY; the NULL stream (0) is the same one
REAP_LOOKAHEAD = 4  # awaiting frees still running an allocation looks at before it stops
OOM_WAIT = 5.0  # s: what an allocation that found the device full waits for other libraries' consumers
_UNKNOWN_HANDLES = (2, -1)  # the per-thread default stream is another stream on every thread; -1 names none
SMALL_CACHE_BYTES = 4096
"""Pool blocks of up to this many bytes are kept for reuse when freed (see "Small blocks")."""
SMALL_CACHE_BLOCKS = 256
"""The most small blocks a runtime keeps."""


def small_class(nbytes: int) -> int:
    """The block a small allocation of ``nbytes`` (at most :data:`SMALL_CACHE_BYTES`) gets: 512 B to 4 KiB."""
    return 512 if nbytes <= 512 else 1 << (nbytes - 1).bit_length()


class Allocation(Protocol):
    """What device memory sees of an array it allocated (a ``DeviceArray``, which sits above it)."""

    @property
    def _ptr(self) -> int:
        """The device address."""
        ...

    @property
    def _nbytes(self) -> int:
        """The bytes allocated."""
        ...

    @property
    def _state(self) -> State:
        """The array's ownership state."""
        ...

    def _release_for_close(self) -> None:
        """Mark an owned array closed: its memory is freed with the runtime's."""
        ...


class _Users:
    """Who besides ferry may still use one allocation."""

    __slots__ = ("streams", "unknown")

    def __init__(self) -> None:
        self.streams: dict[int, Any] = {}  # stream handle -> the stream object named (kept alive), or None
        self.unknown = False  # exported where no stream is known: free after the device was idle


class DeviceMemory:
    """One device's allocations made through one runtime, from its pool."""

    def __init__(self, backend: Backend, health: Health, lock: threading.RLock, pool_limit: int | None = None) -> None:
        self.backend = backend
        self.health = health
        self.lock = lock
        self.device = int(backend.device)
        self.bytes = 0  # allocated through this runtime for arrays alive (or dying) and not freed
        self.deferred: list[tuple[int, int]] = []  # (address, nbytes) of collected arrays
        self.arrays: weakref.WeakSet[Allocation] = weakref.WeakSet()
        self.users: dict[int, _Users] = {}  # address -> streams that may use it beyond ferry
        self.pool_limit = pool_limit
        self.pool: Any = None
        self.alloc_stream: Any = None
        self.awaiting: list[tuple[int, int, list[Any]]] = []  # (address, nbytes, consumer events)
        self.events: list[Any] = []
        self.reaper: _Reaper | None = None
        self.legacy_bytes = 0  # allocated by cuMemAlloc where there is no pool, not yet freed
        self._count = threading.Lock()  # legacy_bytes is also updated by the reaper's thread
        self._closed = False
        self._small: dict[int, list[int]] = {}  # class -> kept small blocks (see "Small blocks")
        self._small_blocks = 0
        self._small_bytes = 0
        why = "the device has no memory pools (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0)"
        try:
            self.pool = backend.mem_pool_create(pool_limit)
        except DeviceError as exc:
            why = f"cuMemPoolCreate failed: {exc}"
        if self.pool is not None:
            try:
                self.alloc_stream = backend.stream_create()
            except DeviceError:
                with contextlib.suppress(DeviceError):
                    backend.mem_pool_destroy(self.pool)
                raise
            kept = "everything it reserved" if pool_limit is None else f"up to {pool_limit} bytes"
            self.kind = f"stream-ordered pool (cuMemAllocFromPoolAsync), keeps {kept}"
        else:
            self.kind = f"cuMemAlloc/cuMemFree ({why})"

    # -- allocation --------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """``nbytes`` of device memory (0 for an empty array), usable on every stream. Lock held.

        Raises MemoryError (out of memory), or FerryError (another refusal).
        """
        if not nbytes:
            return 0
        try:
            return self._alloc(nbytes)
        except DeviceError as exc:
            self.health.note(exc)
            raise alloc_error("device", nbytes, exc) from exc
        except (MemoryError, ValueError) as exc:
            raise MemoryError(f"device allocation of {nbytes} bytes failed: {exc}") from exc

    def _alloc(self, nbytes: int) -> int:
        if self.pool is None:
            ptr = self.backend.mem_alloc(nbytes)
            with self._count:
                self.legacy_bytes += nbytes
        else:
            size = nbytes
            if nbytes <= SMALL_CACHE_BYTES:  # a small block: a kept one of its class, or a new one
                size = small_class(nbytes)
                kept = self._small.get(size)
                if kept:
                    self._small_blocks -= 1
                    self._small_bytes -= size
                    self.bytes += nbytes
                    return kept.pop()
            if self.awaiting:
                self.reap()
            try:
                ptr = self.backend.mem_pool_alloc(self.pool, size, self.alloc_stream)
            except DeviceError as exc:
                if exc.code != _OOM:
                    raise
                # out of memory: free what is due (waiting a bounded time for other libraries'
                # consumers), give the pool's unused memory back, try once more
                self.free_deferred()
                self.reap(wait=OOM_WAIT)
                # the allocation stream holds only frees: this returns at once, and the pool then
                # counts them complete (a trim gives back only frees the host has observed)
                self.backend.stream_synchronize(self.alloc_stream)
                self.backend.mem_pool_trim(self.pool, 0)
                ptr = self.backend.mem_pool_alloc(self.pool, size, self.alloc_stream)
        self.bytes += nbytes
        return ptr

    def trim(self, keep_bytes: int) -> None:
        """Give unused pool memory back to the device, keeping at most ``keep_bytes`` reserved. Lock held.

        The allocation stream is synchronized first (it holds only frees of memory nothing
        uses, so this returns at once) so that those frees count as complete; memory whose
        free waits for a consumer's work stays reserved until that work is done.
        """
        if self.pool is not None and self.health.device_usable:
            self.reap()
            self.free_kept()
            self.backend.stream_synchronize(self.alloc_stream)
            self.backend.mem_pool_trim(self.pool, keep_bytes)

    def usage(self) -> tuple[int, int]:
        """``(reserved, used)`` bytes: the pool's, or what ``cuMemAlloc`` holds. Lock held."""
        if self._closed or not self.health.device_usable:
            return 0, 0
        if self.pool is None:
            return self.legacy_bytes, self.legacy_bytes
        try:
            self.reap()
            reserved, used = self.backend.mem_pool_usage(self.pool)
            return reserved, max(0, used - self._small_bytes)  # kept small blocks are not in use
        except DeviceError as exc:
            self.health.note(exc)
            return 0, 0

    # -- who else may use an allocation --------------------------------------------------------
    def note_stream(self, ptr: int, stream: Any) -> None:
        """Work on ``stream`` (an int handle or a stream object) may use the allocation at ``ptr``:
        its free waits for that work on the device."""
        if not ptr:
            return
        handle = stream_handle_of(stream)
        with self.lock:
            users = self.users.get(ptr)
            if users is None:
                users = self.users[ptr] = _Users()
            if handle in _UNKNOWN_HANDLES:
                users.unknown = True
                return
            users.streams[_LEGACY if handle == 0 else handle] = None if isinstance(stream, int) else stream

    def note_unknown(self, ptr: int) -> None:
        """The allocation at ``ptr`` was exported where no consumer stream is known."""
        if not ptr:
            return
        with self.lock:
            users = self.users.get(ptr)
            if users is None:
                users = self.users[ptr] = _Users()
            users.unknown = True

    def declare(self, ptr: int, stream: Any) -> None:
        """``record_stream``: ``stream`` may use the allocation, and every use so far is on the
        streams recorded (the unknown-consumer rule is lifted)."""
        if not ptr:
            return
        handle = stream_handle_of(stream)
        with self.lock:
            self.note_stream(ptr, stream)
            if handle not in _UNKNOWN_HANDLES:
                self.users[ptr].unknown = False

    # -- frees ------------------------------------------------------------------------------------
    def release(self, ptr: int, nbytes: int) -> None:
        """Free memory no ferry transfer uses any more (an ordinary call), after its other users. Lock held."""
        self.bytes -= nbytes
        if ptr:
            self._free(ptr, nbytes)

    def free(self, ptr: int, nbytes: int) -> None:
        """A closed array's memory, freed now in stream order (takes the lock)."""
        with self.lock:
            self.release(ptr, nbytes)

    def defer(self, ptr: int, nbytes: int) -> None:
        """From a finalizer: free at the next ordinary call. Never blocks, never calls the device."""
        self.deferred.append((ptr, nbytes))

    def free_deferred(self) -> None:
        """Free what finalizers deferred. Lock held."""
        if self.deferred:
            deferred, self.deferred = self.deferred, []
            for ptr, nbytes in deferred:
                self.bytes -= nbytes
                if ptr:
                    self._free(ptr, nbytes)

    def order_export(self, ready: Any, stream_handle: int) -> None:
        """Order a consumer's stream (an integer handle) after the pending upload record ``ready``:
        on the device, for its event (a staged job's: the event its lanes' posted events were joined
        into). Takes the runtime's lock: the record cannot settle, nor the runtime close, meanwhile
        (a record that settled, or a closed runtime, has nothing left to wait for)."""
        backend = self.backend
        extra = ready.extra
        if extra is not None and extra.ready_to_order is not None and not ready.done:
            extra.ready_to_order()  # a staged upload's host copies: waited for outside the lock
        with self.lock:
            if ready.done or not self.health.device_usable or self.health.closed:
                return
            stream = backend.stream_from_handle(stream_handle)
            extra = ready.extra
            if extra is not None and extra.job is not None:
                if extra.order_after is not None:
                    extra.order_after(stream)
            elif ready.event is not None:
                backend.stream_wait_event(stream, ready.event)

    def _free(self, ptr: int, nbytes: int) -> None:
        users = self.users.pop(ptr, None)
        if not self.health.device_usable:  # forked, poisoned or left at exit: never touch the device
            return
        if users is None or not (users.unknown or users.streams):
            if not self._keep(ptr, nbytes):
                self._free_now(ptr, nbytes)
        elif users.unknown or self.pool is None:
            self._after_idle(ptr, nbytes)
        else:
            self._free_after(ptr, nbytes, users)

    def free_kept(self) -> None:
        """Free the kept small blocks (see "Small blocks"). Lock held."""
        kept, self._small = self._small, {}
        self._small_blocks = self._small_bytes = 0
        for ptrs in kept.values():
            for ptr in ptrs:
                self._free_now(ptr, 0)

    def _keep(self, ptr: int, nbytes: int) -> bool:
        """Keep a freed small pool block for reuse (lock held): whether it was kept."""
        if self.pool is None or nbytes > SMALL_CACHE_BYTES or self._small_blocks >= SMALL_CACHE_BLOCKS or self._closed:
            return False
        size = small_class(nbytes)
        self._small.setdefault(size, []).append(ptr)
        self._small_blocks += 1
        self._small_bytes += size
        return True

    def _free_now(self, ptr: int, nbytes: int) -> None:
        """Free memory nothing uses any more: on the allocation stream (or ``cuMemFree``). Any thread."""
        try:
            if self.pool is None:
                self.backend.mem_free(ptr)
                with self._count:
                    self.legacy_bytes -= nbytes
            else:
                self.backend.mem_free_async(ptr, self.alloc_stream)
        except DeviceError as exc:
            self.health.note(exc)

    def _free_after(self, ptr: int, nbytes: int, users: _Users) -> None:
        """Record an event on each stream in ``users``; the memory is freed once all completed (:meth:`reap`)."""
        backend = self.backend
        events: list[Any] = []
        try:
            for handle in users.streams:
                target = backend.stream_from_handle(handle)
                event = self.events.pop() if self.events else backend.event_create()
                events.append(event)
                backend.event_record(event, target)
        except DeviceError as exc:
            # the free could not be ordered (a consumer stream destroyed?): never early, free after idle
            self.health.note(exc)
            self.events.extend(events)
            if self.health.device_usable:
                self._after_idle(ptr, nbytes)
            return
        self.awaiting.append((ptr, nbytes, events))

    def reap(self, wait: float = 0.0) -> None:
        """Free the awaiting memory whose consumers' events completed. Lock held.

        Entries are looked at oldest first, and without ``wait`` the scan stops
        after :data:`REAP_LOOKAHEAD` entries still running: an allocation
        costs a few event queries however many frees wait (consumers mostly
        finish in order; one that does not only delays later frees).
        ``wait`` > 0 (out of memory): every entry, waiting up to that many
        seconds in all, interruptibly; what is still running then stays.
        """
        if not self.awaiting or not self.health.device_usable:
            return
        backend = self.backend
        deadline = time.monotonic() + wait
        entries = self.awaiting
        still: list[tuple[int, int, list[Any]]] = []
        running = 0
        i = 0
        try:
            while i < len(entries) and (wait > 0 or running < REAP_LOOKAHEAD):
                ptr, nbytes, events = entries[i]
                try:
                    if wait > 0:
                        done = all(backend.event_wait(e, max(0.0, deadline - time.monotonic())) for e in events)
                    else:
                        done = all(backend.event_query(e) for e in events)
                except DeviceError as exc:
                    self.health.note(exc)
                    i += 1
                    self.events.extend(events)
                    if self.health.device_usable:
                        self._after_idle(ptr, nbytes)  # the events cannot tell: never early
                    continue
                i += 1
                if done:
                    self.events.extend(events)
                    self._free_now(ptr, nbytes)
                else:
                    still.append(entries[i - 1])
                    running += 1
        finally:  # an interrupt in a wait leaves every entry in exactly one place
            self.awaiting = still + entries[i:]

    def _after_idle(self, ptr: int, nbytes: int) -> None:
        if self._closed:
            return
        if self.reaper is None:
            self.reaper = _Reaper(self)
        self.reaper.add(ptr, nbytes)

    def _idle_then_free(self, batch: list[tuple[int, int]]) -> None:
        """The reaper's thread: synchronize the device, then free what died before. No runtime lock."""
        if not self.health.device_usable:
            return
        try:
            self.backend.device_synchronize()
        except DeviceError as exc:
            self.health.note(exc)
            return  # never freed: the device is gone, or reported an error nobody can attribute
        for ptr, nbytes in batch:
            self._free_now(ptr, nbytes)

    @property
    def idle_pending_bytes(self) -> int:
        """Bytes waiting for the device to have been idle (exports with unknown consumers)."""
        reaper = self.reaper
        return reaper.pending_bytes if reaper is not None else 0

    def close(self) -> None:
        """Free every owned array and deferred address in order, then the pool. Lock held; ferry's
        copies are complete, and this blocks until the device was idle once if any memory has
        unknown users.

        Abandoned arrays stay allocated: the device may still touch them.
        """
        usable = self.health.device_usable
        # At interpreter exit (atexit runs after the main thread stopped) nothing waits for another
        # library's kernels: memory with unknown users is left to the driver, which reclaims it with
        # the process, and a reaper stuck in a device synchronization (a daemon) is not joined.
        exiting = not threading.main_thread().is_alive()
        leftover = self.reaper.stop(join=usable and not exiting) if self.reaper is not None else []
        if usable:
            self.free_kept()
        self._small.clear()
        self._closed = True
        dying = list(self.deferred)
        self.deferred.clear()
        for array in list(self.arrays):
            if array._state is OWNED:
                array._release_for_close()
                dying.append((array._ptr, array._nbytes))
        idle = list(leftover)
        for ptr, nbytes in dying:
            self.bytes -= nbytes
            if not ptr:
                continue
            users = self.users.pop(ptr, None)
            if not usable:
                continue
            if users is not None and (users.unknown or (users.streams and self.pool is None)):
                idle.append((ptr, nbytes))
            elif users is not None and users.streams:
                if not exiting:  # at exit another library's work is not waited for: left to the driver
                    self._free_after(ptr, nbytes, users)
            else:
                self._free_now(ptr, nbytes)
        if usable and not exiting:
            self._queue_awaiting_frees()
        self.awaiting.clear()  # at exit, or on an unusable device: left to the driver
        if idle and usable and not exiting:
            try:
                self.backend.device_synchronize()
            except DeviceError as exc:
                self.health.note(exc)
            else:
                for ptr, nbytes in idle:
                    self._free_now(ptr, nbytes)
        if self.health.device_usable:
            if self.pool is not None:
                with contextlib.suppress(DeviceError):
                    self.backend.mem_pool_destroy(self.pool)  # pending frees complete first
            if self.alloc_stream is not None:
                with contextlib.suppress(DeviceError):
                    self.backend.stream_destroy(self.alloc_stream)
            for event in self.events:
                with contextlib.suppress(DeviceError):
                    self.backend.event_destroy(event)
        self.events.clear()
        self.pool = self.alloc_stream = None


    def _queue_awaiting_frees(self) -> None:
        """close(): each awaiting free queued on the allocation stream behind its consumers'
        events, on the device. close() never waits on the host for another library's work here:
        the pool is destroyed next, and what it holds goes back once those frees have run."""
        backend = self.backend
        for ptr, _nbytes, events in self.awaiting:
            try:
                for event in events:
                    backend.stream_wait_event(self.alloc_stream, event)
                backend.mem_free_async(ptr, self.alloc_stream)
            except DeviceError as exc:
                self.health.note(exc)  # never freed early: left to the driver
            self.events.extend(events)
        self.awaiting.clear()


class _Reaper:
    """A background thread: frees memory with unknown users once the device has been idle."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.cond = threading.Condition()
        self.queue: list[tuple[int, int]] = []
        self.pending_bytes = 0
        self.stopping = False
        self.thread: threading.Thread | None = None

    def add(self, ptr: int, nbytes: int) -> None:
        with self.cond:
            self.queue.append((ptr, nbytes))
            self.pending_bytes += nbytes
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="ferry-device-reaper", daemon=True)
                self.thread.start()
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return  # close() takes what is left
                batch, self.queue = self.queue, []
            try:
                self.memory._idle_then_free(batch)
            finally:
                with self.cond:
                    self.pending_bytes -= sum(n for _, n in batch)

    def stop(self, *, join: bool = True) -> list[tuple[int, int]]:
        """Stop the thread (after the batch it is freeing); return what it had not started."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if join and self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        with self.cond:
            left, self.queue = self.queue, []
            self.pending_bytes = 0
        return left
