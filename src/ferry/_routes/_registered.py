"""The registered route: one DMA straight from or into the caller's array, pinned in place.

The driver's own pageable copy is never used: it blocks the caller until the
stream drains. A registered array needs no staging at all. A failed copy
keeps the array read-only and its registration in use forever: the device
may still touch that memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._base import HostCopy, HostLeases, array_ptr

if TYPE_CHECKING:
    from .._completion import Completion, Record
    from .._memory._register import Registration

__all__: list[str] = []


class RegisteredRoute:
    """One DMA between a registered array and the device."""

    name = "registered"

    def __init__(self, completion: Completion, leases: HostLeases) -> None:
        self.completion = completion
        self.leases = leases

    def streams(self, request: HostCopy) -> list[Any]:
        """The direction's copy stream."""
        return [request.stream]

    def submit(self, request: HostCopy, registration: Registration | None = None) -> Record:
        """Enqueue the DMA (``registration`` covers the array). Lock held."""
        assert registration is not None
        host, device = request.host, request.device
        ptr = array_ptr(host)
        src, dst = (ptr, device._ptr) if request.upload else (device._ptr, ptr)
        record = self.completion.enqueue(
            request.stream, request.copy, dst, src, request.nbytes, request.moved, request.leased, request.result
        )
        registration._uses += 1
        restore = self.leases.lease(host)

        def cleanup(failed: bool) -> None:
            if not failed:  # the device may still touch the memory: keep it read-only and in use
                restore(failed)
                registration._uses -= 1

        request.extra.cleanups.append(cleanup)
        return record
