"""RuntimeStats: one consistent snapshot of a runtime's counters, summed over its parts."""

from __future__ import annotations

from dataclasses import dataclass

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
