"""RuntimeStats: one consistent snapshot of a runtime's counters, summed over its parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._parts import Parts

__all__ = ["RuntimeStats"]


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
        Memory that failed transfers left to the device, never freed or
        reused: abandoned pinned buffers and device arrays, and the pinned
        staging blocks and slots a failed copy may still touch.
    pinned_pool_bytes
        Pinned memory the pool holds, in use and free.
    pinned_free_bytes
        The part of it free for reuse.
    pinned_allocations
        Pinned allocations made so far (the pool's misses).
    device_bytes
        Device memory allocated through this runtime for arrays alive (or
        dropped and not yet collected by a later call).
    device_pool_reserved_bytes
        Device memory the runtime's pool holds from the device: in use, freed
        and kept for reuse, or freed in stream order and not yet reusable (a
        consumer's work on it still runs). What ``Runtime(device_pool_limit=...)``
        bounds at synchronization points and :meth:`Runtime.trim` gives back.
        Where the device has no memory pools: what ``cuMemAlloc`` holds. 0
        after ``close()``.
    device_pool_used_bytes
        The part of it in use: live arrays, and memory whose free waits for a
        consumer's work (or, for arrays exported with no known stream, for
        the device to have been idle once).
    submitted, completed, failed
        Transfers submitted; proven complete (waited or retired); failed.
    events
        Events created (the event pool reuses them).
    host_copied_bytes
        Bytes the pageable routes copied on the host (one per payload byte).
    staging_pinned_bytes
        Pinned memory held for staging: the lanes' slots, the small route's
        slots (kept once made, 64 KiB each) and the blocks of direct pageable
        copies in flight.
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
    device_pool_reserved_bytes: int
    device_pool_used_bytes: int


def snapshot(parts: Parts) -> RuntimeStats:
    """The counters of a runtime's parts, summed (the runtime's lock held)."""
    completion, pool, memory = parts.completion, parts.pool, parts.memory
    reserved, used = memory.usage()
    return RuntimeStats(
        in_flight=len(completion.live),
        retiring=len(completion.retiring),
        abandoned=completion.abandoned_objects,
        abandoned_bytes=completion.abandoned_bytes + parts.staged.abandoned_bytes,
        pinned_pool_bytes=pool.held_bytes,
        pinned_free_bytes=pool.free_bytes,
        pinned_allocations=pool.allocations,
        device_bytes=memory.bytes,
        submitted=completion.counts.submitted,
        completed=completion.counts.completed,
        failed=completion.failed,
        events=completion.event_count,
        host_copied_bytes=parts.host.host_copied,
        staging_pinned_bytes=parts.host.staging_bytes,
        registered_bytes=parts.registrations.bytes,
        host_cache_bytes=parts.host_cache.free_bytes,
        device_pool_reserved_bytes=reserved,
        device_pool_used_bytes=used,
    )
