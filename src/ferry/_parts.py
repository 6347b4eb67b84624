"""A runtime's parts: built together, closed in one order.

The order of ``close()`` matters: first every copy in flight is waited for
(outside the lock, so submitters elsewhere are refused cleanly rather than
blocked), then the records are released, the staging workers stopped,
registrations undone, device memory freed, pinned memory returned, events and
streams destroyed, and the backend closed last. A part is never touched by
the device after it is freed, and nothing abandoned is ever freed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

from . import _lifecycle
from ._backends._base import Backend, DeviceError
from ._buffer import PinnedHostBuffer
from ._completion import Completion
from ._lifecycle import Health
from ._memory._device import DeviceMemory
from ._memory._hostcache import HostCache
from ._memory._pinned import PinnedPool
from ._memory._register import Registrations
from ._routes._host import HostRoutes
from ._routes._peer import PeerRoute, Side
from ._routes._staged import StagingConfig

__all__: list[str] = []


class Parts:
    """Everything a runtime owns, closed in order; the lifecycle registry keeps it until then."""

    def __init__(self, backend: Backend, health: Health, options: dict[str, Any]) -> None:
        self.backend = backend
        self.health = health
        self.lock = threading.RLock()
        self.pool = PinnedPool(backend, options["pinned_cache_bytes"])
        self.memory = DeviceMemory(backend, health, self.lock)
        self.completion = Completion(backend, health, self.lock, self.memory, self.pool,
                                     options["retirement_capacity"])
        self.registrations = Registrations(backend, health, self.lock)
        self.host_cache = HostCache(options["host_cache_bytes"])
        self.buffers: weakref.WeakSet[PinnedHostBuffer] = weakref.WeakSet()
        self.staging: StagingConfig = options["staging"]
        self.h2d = backend.stream_create()
        self.d2h = backend.stream_create()
        self.host = HostRoutes(self.completion, self.pool, self.registrations, self.host_cache, self.staging,
                               (self.h2d, self.d2h))
        self.staged = self.host.staged
        self.peer = PeerRoute(self.completion, self.pool, self.staging.slot_bytes, options["peer_access"])
        self.side_streams: list[Any] = []  # made by ferry.testing.side_stream
        self.side = Side(backend, self.d2h, self.lock)

    def close(self) -> None:
        """Wait for everything in flight, then free everything, in order. Idempotent."""
        health = self.health
        with self.lock:
            if health.closed:
                return
            if health.forked:
                health.mark_closed()
                return
        self.completion.wait_everything()
        with self.lock:
            health.mark_closed()
            self.completion.close()
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
        _lifecycle.unregister(self)
