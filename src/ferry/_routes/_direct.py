"""The direct route: a small pageable payload through one pooled pinned block, on the calling thread.

Up to ``StagingConfig.direct_bytes`` waking the staging workers costs more
than the copy, so the calling thread copies the array into a pinned block
from the pool (upload) and enqueues one DMA; a download enqueues the DMA and
copies the block out when ``wait()`` settles the record (``finish``), before
anything is published. The block goes back to the pool once the record left
flight, or is abandoned (never reused, counted) if the copy failed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ._base import HostCopy, HostLeases, array_ptr
from ._staged import copy_in, copy_out, plan_chunks

if TYPE_CHECKING:
    from .._completion import Completion, Record
    from .._memory._pinned import PinnedPool

__all__: list[str] = []


class DirectRoute:
    """One pooled pinned block and one DMA per transfer."""

    name = "direct"

    def __init__(self, completion: Completion, pool: PinnedPool, leases: HostLeases) -> None:
        self.completion = completion
        self.pool = pool
        self.leases = leases
        self._lock = threading.Lock()
        self.held_bytes = 0  # pool blocks held by copies in flight
        self.host_copied = 0

    def streams(self, request: HostCopy) -> list[Any]:
        """The direction's copy stream."""
        return [request.stream]

    def _count(self, held: int, copied: int = 0) -> None:
        with self._lock:
            self.held_bytes += held
            self.host_copied += copied

    def submit(self, request: HostCopy) -> Record:
        """Copy through one pool block. Lock held."""
        completion, pool = self.completion, self.pool
        host, device = request.host, request.device
        nbytes = request.nbytes
        block = pool.acquire(max(nbytes, 1))
        self._count(block.capacity)
        try:
            chunks = plan_chunks(host, max(nbytes, 1))
            base = array_ptr(host)
            if request.upload:
                for part in chunks:
                    copy_in(block.ptr + part.offset, host, part, base)
                record = completion.enqueue(
                    request.stream, request.copy, device._ptr, block.ptr, nbytes,
                    request.moved, request.leased, request.result,
                )
                self._count(0, nbytes)
            else:
                record = completion.enqueue(
                    request.stream, request.copy, block.ptr, device._ptr, nbytes,
                    request.moved, request.leased, request.result,
                )
                alias = host.view()  # written through a view taken before the array goes read-only

                def publish() -> None:
                    for part in chunks:
                        copy_out(alias, part, block.ptr + part.offset, base)
                    self._count(0, nbytes)

                request.extra.finish = publish
        except BaseException:
            self._count(-block.capacity)
            pool.release(block)
            raise

        def cleanup(failed: bool) -> None:
            self._count(-block.capacity)
            if failed:
                completion.abandoned_bytes += block.capacity  # the device may still touch it
            else:
                pool.release(block)

        request.extra.cleanups.append(cleanup)
        request.extra.cleanups.append(self.leases.lease(host))
        return record
