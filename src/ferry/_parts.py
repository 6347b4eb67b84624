"""A runtime's parts: built together, closed in one order.

The order of ``close()`` matters. First every copy in flight is waited for,
outside the lock: meanwhile the runtime is fully open (submissions are
accepted, and waited for too; waits, polls and futures work), and the wait is
bounded and interruptible, so a ``TimeoutError`` or ``KeyboardInterrupt``
leaves the runtime exactly as it was. Then, in one step under the lock, the
close *commits*: once every live and retiring record is proven complete (or
failed), the runtime is marked closed, the records attended by a ``wait()``
or a future are settled for them and the others released. Then the watcher is
stopped (the futures resolved), the staging workers stopped, registrations
undone, device memory freed, pinned memory returned, events and streams
destroyed, and the backend closed last. A part is never touched by the device
after it is freed, and nothing abandoned is ever freed.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _lifecycle, _native
from ._args import MAX_BYTES, alloc_error, shape_arg, size_arg, timeout_arg
from ._backends._base import Backend, DeviceError
from ._buffer import PinnedHostBuffer, check_dtype, new_buffer
from ._completion import Completion
from ._device_array import DeviceArray, new_device_array
from ._lifecycle import Health
from ._memory._device import DeviceMemory
from ._memory._hostcache import HostCache
from ._memory._pinned import PinnedPool
from ._memory._register import Registrations
from ._pending import PendingDownload, PendingUpload
from ._routes._file import ReaderPool
from ._routes._host import HostRoutes
from ._routes._peer import PeerRoute, Side
from ._routes._staged import StagingConfig, default_staging, engine_status, engine_threads_status

__all__: list[str] = []


class Parts:
    """Everything a runtime owns, closed in order; the lifecycle registry keeps it until then."""

    def __init__(self, backend: Backend, health: Health, options: dict[str, Any]) -> None:
        self.backend = backend
        self.health = health
        self.lock = _native.runtime_lock()
        self.pool = PinnedPool(backend, options["pinned_cache_bytes"])
        self.memory = DeviceMemory(backend, health, self.lock, options.get("device_pool_limit"))
        self.completion = Completion(backend, health, self.lock, self.memory, self.pool,
                                     options["retirement_capacity"])
        self.registrations = Registrations(backend, health, self.lock)
        self.host_cache = HostCache(options["host_cache_bytes"])
        self.buffers: weakref.WeakSet[PinnedHostBuffer] = weakref.WeakSet()
        self.staging: StagingConfig = (options["staging"] or default_staging()).resolved()
        self.h2d = backend.stream_create()
        self.d2h = backend.stream_create()
        self.host = HostRoutes(self.completion, self.pool, self.registrations, self.host_cache, self.staging,
                               (self.h2d, self.d2h))
        self.staged = self.host.staged
        self.peer = PeerRoute(self.completion, self.pool, self.staging.slot_bytes, options["peer_access"])
        self.side_streams: list[Any] = []  # made by ferry.testing.side_stream
        self.side = Side(backend, self.d2h, self.lock, self.completion)
        self.readers = ReaderPool(backend)  # the file routes' threads and streams, made on first use

    def compiled_entries(self, runtime: Any, facade: Any) -> dict[str, Any]:
        """The methods of ``runtime`` (a ``facade``) to replace by compiled entries, by name.

        Where the extension runs (its lock, its Fast, the verified slot layout), ``upload_pending``
        and ``download_pending`` become compiled entries: the same checks and submission in one C
        call, which hands whatever is not the common case to ``facade``'s methods (a subclass that
        overrides either keeps both as Python methods). Where NumPy's shape fields are verified too,
        ``upload`` does the same for the small pageable route's common case. Elsewhere: none.
        """
        fast = self.completion.fast
        cls = type(runtime)
        if (
            fast is None
            or type(self.lock) is not getattr(_native.load(), "RLock", None)
            or cls.upload_pending is not facade.upload_pending
            or cls.download_pending is not facade.download_pending
            or not _native.hot_types()
        ):
            return {}
        fast.bind_entries(facade.upload_pending, facade.download_pending, PendingUpload, PendingDownload,
                          self.h2d, self.d2h, self.backend)
        small = cls.upload is facade.upload and _native.array_layout()  # the small pageable upload too
        if small:
            fast.bind_small(self.host.small, np.ndarray, facade.upload)
        # bound to the runtime as a method is (kept alone, they keep it alive: a cycle through its
        # __dict__, so a dropped runtime is closed by the cyclic garbage collector)
        up, down, upload = fast.entries(runtime)
        entries = {"upload_pending": up, "download_pending": down}
        if upload is not None:
            entries["upload"] = upload
        return entries

    # -- what the facade's calls do beyond a check (see Runtime for each contract) ------------------
    def info(self) -> dict[str, Any]:
        """``Runtime.info()``: the backend's description and the pools' and engines' state."""
        self.health.check_open()
        info = dict(self.backend.info())
        info["pinned_pool_bytes"] = self.pool.held_bytes
        info["pinned_free_bytes"] = self.pool.free_bytes
        info["staging_engine"] = status = engine_status(self.staging)
        info["staging_threads"] = engine_threads_status(self.staging, status)
        info["device_pool"] = self.memory.kind
        return info

    def pinned(self, owner: object, nbytes: int) -> PinnedHostBuffer:
        """``Runtime.pinned(nbytes)``: an owned pinned buffer of ``owner`` from the pool."""
        nbytes = size_arg(nbytes, "nbytes")
        if nbytes < 1:
            raise ValueError(f"a pinned buffer needs nbytes >= 1, got {nbytes}")
        self.health.check_open()
        with self.lock:
            self.completion.maintain()
        try:
            block = self.pool.acquire(nbytes)
        except DeviceError as exc:
            self.health.note(exc)
            raise alloc_error("pinned host", nbytes, exc) from exc
        except (MemoryError, ValueError) as exc:
            raise MemoryError(f"pinned host allocation of {nbytes} bytes failed: {exc}") from exc
        buffer = new_buffer(owner, self.pool, block, nbytes)
        self.buffers.add(buffer)
        return buffer

    def empty(self, owner: object, shape: Any, dtype: Any) -> DeviceArray:
        """``Runtime.empty(shape, dtype)``: an owned device array of ``owner`` from the device pool."""
        self.health.check_open()
        dt = check_dtype(dtype)
        dims = shape_arg(shape)
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes > MAX_BYTES:
            raise ValueError(f"{nbytes} bytes is larger than any device")
        with self.lock:
            if self.completion.maintenance_due():
                self.completion.maintain()
            ptr = self.memory.alloc(nbytes)  # MemoryError, or FerryError
        return new_device_array(owner, self.memory, ptr, dims, dt, nbytes)

    def poll(self) -> None:
        """``Runtime.poll()``: release what dropped handles held once their copies completed."""
        self.health.check_open()
        completion = self.completion
        with self.lock:
            completion.maintain()
        if completion.cross_returns:
            completion.flush_cross()

    def trim(self, keep_bytes: int) -> None:
        """``Runtime.trim(keep_bytes)``: give the device pool's unused memory back."""
        self.health.check_open()
        with self.lock:
            self.completion.maintain()
            self.memory.trim(size_arg(keep_bytes, "keep_bytes"))

    # -- closing --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, deadline: float | None) -> Iterator[None]:
        """The lock, taken by ``deadline`` (at least 0.1 s of patience) or ``TimeoutError``."""
        wait = -1.0 if deadline is None else max(0.1, deadline - time.monotonic())
        if not self.lock.acquire(timeout=wait):
            raise TimeoutError("another thread holds the runtime's lock")
        try:
            yield
        finally:
            self.lock.release()

    def close(self, timeout: float | None = None) -> None:
        """Wait for everything in flight, then free everything, in order. Idempotent.

        ``TimeoutError`` after ``timeout`` seconds leaves the runtime open and
        unchanged (see the module docstring).
        """
        health = self.health
        completion = self.completion
        timeout = timeout_arg(timeout)  # ValueError for a negative or NaN one
        if timeout is not None and math.isinf(timeout):
            timeout = None
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._locked(deadline):
            if health.closed or health.exited:
                return
            if health.forked:
                health.mark_closed()
                return
        while True:
            try:
                completion.wait_everything(deadline, lambda: self._locked(deadline))
            except TimeoutError as exc:
                raise TimeoutError(
                    f"close() gave up after {timeout} s: {exc}; the runtime is still open and nothing was "
                    "released: wait for the transfers, or call close() again"
                ) from None
            with self._locked(deadline):
                if health.closed:
                    return  # another thread's close() committed
                if not completion.all_resolved():
                    continue  # submitted meanwhile: wait for those too
                health.mark_closed()
                completion.close()
                break
        try:
            completion.stop_watcher()  # the futures are resolved before close() returns
        finally:  # committed: tear down even if Ctrl-C lands here
            self._tear_down()
        _lifecycle.unregister(self)

    def _tear_down(self) -> None:
        health = self.health
        with self.lock:
            self.readers.close(destroy=health.device_usable)
            self.host.close()
            self.registrations.close()
            self.memory.close()
            for buffer in list(self.buffers):
                buffer._release_for_close()
            with contextlib.suppress(DeviceError):
                self.pool.close()
            self.host_cache.clear()
            self.completion.destroy_events()
            self.peer.close()
            if health.device_usable:
                for stream in (self.h2d, self.d2h, *self.side_streams):
                    with contextlib.suppress(DeviceError):
                        self.backend.stream_destroy(stream)
            with contextlib.suppress(DeviceError):
                self.backend.close()

    def leave_at_exit(self) -> None:
        """See :class:`~ferry._lifecycle.Closable`: marked exited, its compiled engines abandoned."""
        self.health.mark_exited()
        self.staged.abandon()

    def describe_in_flight(self) -> str:
        """Which runtime, and how many transfers and bytes it still has in flight (for the exit warning)."""
        completion = self.completion
        got = self.lock.acquire(timeout=0.1)  # at exit a stuck thread may hold it: read anyway
        try:
            live = [r for r in list(completion.live) if not r.done and r.error is None]
            dropped = [r for r in completion.retiring.records() if not r.done and r.error is None]
        finally:
            if got:
                self.lock.release()
        nbytes = sum(r.nbytes for r in live + dropped)
        return (
            f"{self.backend.name} device {self.backend.device}: {len(live) + len(dropped)} transfer(s), "
            f"{nbytes} bytes ({nbytes / (1 << 20):.1f} MiB) in flight "
            f"({len(live)} with a pending handle, {len(dropped)} dropped)"
        )
