"""The Backend protocol: the only seam between ferry and a device.

A backend knows memory, streams, events and copies. It knows nothing about
ownership: it never decides whether a buffer may be freed, it only does what
the runtime asks, in stream order. All handles are opaque objects owned by the
backend; pointers are plain ``int``.

Error discipline: a backend raises :class:`DeviceError` for anything the
device reports. ``event_query`` is the only call that treats "not ready" as a
value (it returns ``False``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__: list[str] = []


class DeviceError(Exception):
    """A failure reported by the device or its driver (internal to ferry).

    ``sticky`` is true when the device context is unusable from now on (a CUDA
    sticky error); the runtime then refuses every later call.
    """

    def __init__(self, message: str, *, code: int = -1, sticky: bool = False, enqueued: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.sticky = sticky
        self.enqueued = enqueued  # raised after a copy was queued (its event could not be recorded)

    def fresh(self) -> DeviceError:
        """A new exception with the same facts: a stored failure is raised as a copy, so that the
        frames of each raise never pile up on one traceback (and keep what they reference alive)."""
        return DeviceError(str(self), code=self.code, sticky=self.sticky, enqueued=self.enqueued)


@runtime_checkable
class Backend(Protocol):
    """What a device must offer to ferry.

    Every method may raise :class:`DeviceError`. Methods that enqueue work
    return as soon as the work is queued; nothing here waits for a copy except
    ``event_synchronize`` and ``stream_synchronize``.
    """

    name: str
    device: int

    # -- identity -------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Backend, device name, driver, link and anything else worth printing."""
        ...

    # -- memory ---------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (> 0) of device memory; return its address."""
        ...

    def mem_free(self, ptr: int) -> None:
        """Free device memory from :meth:`mem_alloc`."""
        ...

    # -- stream-ordered memory pools (cuMemPoolCreate, cuMemAllocFromPoolAsync, cuMemFreeAsync) --
    def mem_pool_create(self, release_threshold: int | None) -> Any:
        """A memory pool of the device, or ``None`` where the device has none (then
        :meth:`mem_alloc`/:meth:`mem_free` serve).

        ``release_threshold``: reserved bytes the pool keeps at synchronization
        points (``None``: everything). The pool never makes an allocation wait
        for another stream's work (no internal dependencies): it reuses a block
        whose free is complete, or one freed on the allocating stream, or grows.
        """
        ...

    def mem_pool_destroy(self, pool: Any) -> None:
        """Destroy a pool; blocks still allocated, or whose free is pending, are released by the
        device once those complete."""
        ...

    def mem_pool_alloc(self, pool: Any, nbytes: int, stream: Any) -> int:
        """Allocate ``nbytes`` (> 0) from ``pool`` in the order of ``stream`` and return once the
        allocation is usable on every stream.

        ``stream`` must be a stream that never waits for other work (ferry's
        allocation stream), so that reaching the allocation on it is
        immediate; the backend synchronizes it, which is not counted as a host
        wait.
        """
        ...

    def mem_free_async(self, ptr: int, stream: Any) -> None:
        """Free pool memory in the order of ``stream``: after everything queued there before."""
        ...

    def mem_pool_trim(self, pool: Any, keep_bytes: int) -> None:
        """Give the pool's unused memory back to the device until at most ``keep_bytes`` stay reserved."""
        ...

    def mem_pool_usage(self, pool: Any) -> tuple[int, int]:
        """``(reserved, used)`` bytes of the pool now."""
        ...

    def device_synchronize(self) -> None:
        """Block until every stream of the device (any library's, in this process's context) is idle.

        Only a background thread of ferry calls it (never the transfer path);
        not counted as a host wait.
        """
        ...

    def host_alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (> 0) of pinned host memory; return its address."""
        ...

    def host_free(self, ptr: int) -> None:
        """Free pinned host memory from :meth:`host_alloc`."""
        ...

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin an existing host range in place."""
        ...

    def host_unregister(self, ptr: int) -> None:
        """Undo :meth:`host_register`."""
        ...

    # -- streams and events ----------------------------------------------
    def stream_create(self) -> Any:
        """Create a stream that does not synchronize with the legacy default stream."""
        ...

    def stream_destroy(self, stream: Any) -> None:
        """Destroy a stream (its queued work still completes)."""
        ...

    def stream_handle(self, stream: Any) -> int:
        """The integer handle other libraries use for ``stream`` (CUDA: the ``CUstream`` value)."""
        ...

    def stream_from_handle(self, handle: int) -> Any:
        """A stream object for a foreign integer handle (1: legacy default, 2: per-thread default)."""
        ...

    def stream_synchronize(self, stream: Any) -> None:
        """Block until everything queued on ``stream`` has run."""
        ...

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event`` (no host wait)."""
        ...

    def event_create(self, blocking: bool = False) -> Any:
        """Create an event (no timing).

        ``blocking``: a thread synchronizing on it sleeps instead of spinning
        (for worker threads, so that many of them do not burn the cores the
        host copies need).
        """
        ...

    def event_destroy(self, event: Any) -> None:
        """Destroy an event."""
        ...

    def event_record(self, event: Any, stream: Any) -> None:
        """Record ``event`` at the current end of ``stream``."""
        ...

    def event_query(self, event: Any) -> bool:
        """``True`` when complete, ``False`` when not yet; raise on a device error. Never blocks."""
        ...

    def event_synchronize(self, event: Any) -> None:
        """Block until ``event`` completed; raise on a device error."""
        ...

    def event_wait(self, event: Any, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds (>= 0) for ``event``; return whether it completed.

        Raises on a device error, like :meth:`event_query` (``timeout=0`` is one
        query). Meant for short waits that a signal can interrupt: the calling
        thread returns to Python often enough that a ``KeyboardInterrupt``
        raised by a signal handler propagates at once. CUDA polls
        ``cuEventQuery`` (busy, as ``cuEventSynchronize``'s default spin is);
        the emulated device sleeps on the event.
        """
        ...

    # -- copies -----------------------------------------------------------
    def memcpy_htod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Enqueue a host-to-device copy of ``nbytes`` on ``stream``."""
        ...

    def memcpy_dtoh(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Enqueue a device-to-host copy of ``nbytes`` on ``stream``."""
        ...

    def htod_record(self, dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        """Enqueue a host-to-device copy (skipped when ``nbytes`` is 0), then record ``event``
        (unless it is ``None``: a batch records one event for many copies).

        One call for the hot path. A failure of the record raises a
        :class:`DeviceError` with ``enqueued=True``: the copy is queued.
        """
        ...

    def dtoh_record(self, dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        """The device-to-host twin of :meth:`htod_record`."""
        ...

    def copy_batch(
        self, upload: bool, dsts: list[int], srcs: list[int], sizes: list[int], stream: Any, event: Any
    ) -> None:
        """Enqueue many copies of one direction on ``stream``, then record ``event`` (unless ``None``).

        The copies run after everything queued on the stream before, and the
        event completes after all of them; among themselves they may run in
        any order (the caller never batches two copies where one writes bytes
        the other touches). CUDA submits them in one ``cuMemcpyBatchAsync``
        where the driver has it (12.8+), else one copy call each. A failure
        raises :class:`DeviceError` with ``enqueued=True`` when some of the
        copies may have been queued.
        """
        ...

    # -- several devices -------------------------------------------------------
    def device_count(self) -> int:
        """How many devices of this kind the machine has."""
        ...

    def peer_access(self, other: Any) -> tuple[bool, str, dict[str, Any]]:
        """Whether this device can read/write ``other``'s memory directly, why, and the
        attributes the driver reports for the pair."""
        ...

    def enable_peer(self, other: Any) -> None:
        """Let this device's copies reach ``other``'s memory (idempotent)."""
        ...

    def memcpy_peer(self, dst: int, src: int, src_backend: Any, nbytes: int, stream: Any) -> None:
        """Enqueue a copy from ``src`` on ``src_backend``'s device to ``dst`` on this device."""
        ...

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Enqueue a copy between two allocations of this device."""
        ...

    # -- test gates --------------------------------------------------------
    def gate_create(self) -> Any:
        """Create a closed gate: a host-controlled flag a stream can wait on."""
        ...

    def stream_wait_gate(self, stream: Any, gate: Any) -> None:
        """Hold ``stream`` until ``gate`` opens."""
        ...

    def gate_open(self, gate: Any) -> None:
        """Open ``gate``; idempotent. Gates are freed by :meth:`close`."""
        ...

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        """Release the backend's own resources (streams must already be idle)."""
        ...
