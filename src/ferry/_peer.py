"""Several devices: the route capability model and device-to-device copies.

ferry keeps **one runtime per device**: each runtime owns one device's
streams, pools and retirement queue, and every object belongs to exactly one
runtime, so the ownership contract stays local. A copy between devices is
submitted to the *destination's* runtime (``dst_rt.copy_pending(source,
destination)``): the destination moves into the transfer there, the source is
read-leased in its own runtime, and ``wait()`` returns both.

Routes, per ordered device pair, decided by the driver and reported by
:func:`routes`:

* ``peer``: the devices can address each other's memory (``cuDeviceCanAccessPeer``);
  ferry enables peer access once per pair and issues one ``cuMemcpyPeerAsync``.
* ``staged``: no peer path (or it was disabled); the bytes go through pinned
  host memory in chunks, the source device's download of chunk k+1 overlapping
  the destination's upload of chunk k (two pinned slots, each reused once the
  upload that read it completed). The destination's copy stream waits for each
  chunk's download on the device; a worker thread only waits to reuse a slot.
* ``same device``: ``cuMemcpyDtoDAsync`` on the runtime's device-to-device stream.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._backends._base import DeviceError
from ._errors import DeviceUnavailableError

if TYPE_CHECKING:
    from ._pool import PinnedPool

__all__ = ["Route", "routes"]


@dataclass(frozen=True)
class Route:
    """How bytes travel from device ``source`` to device ``destination``, and why."""

    source: int
    destination: int
    route: str  # "peer" | "staged" | "same device"
    reason: str
    attributes: dict[str, Any] = field(default_factory=dict)


def routes(backend: str = "auto") -> list[Route]:
    """Every ordered device pair of this machine with the route a copy will take.

    ``backend`` as for :class:`~ferry.Runtime`. One device reports the
    single ``same device`` route. Raises
    :class:`~ferry.DeviceUnavailableError` as the runtime would.
    """
    from ._runtime import Runtime

    first = Runtime(backend, 0)
    try:
        count = first._backend.device_count()
        runtimes = [first] + [Runtime(first.backend, d) for d in range(1, count)]
        try:
            found = []
            for a in runtimes:
                for b in runtimes:
                    ok, reason, attributes = b._backend.peer_access(a._backend)
                    kind = "same device" if a is b else ("peer" if ok else "staged")
                    found.append(Route(a.device, b.device, kind, reason, attributes))
            return found
        finally:
            for rt in runtimes[1:]:
                rt.close()
    finally:
        first.close()


class StagedPeerJob:
    """A device-to-device copy through two pinned slots, driven by one worker thread.

    ``done`` is set once the last upload completed; ``error`` is the first
    device error met (the transfer then publishes nothing).
    """

    def __init__(
        self,
        src_backend: Any,
        src_stream: Any,
        dst_backend: Any,
        dst_stream: Any,
        pool: PinnedPool,
        dst: int,
        src: int,
        nbytes: int,
        chunk: int,
    ) -> None:
        self.error: DeviceError | None = None
        self.done = threading.Event()
        self.host_bytes = 0  # nothing is copied by the host: the DMAs do it all
        self.array: Any = None
        self._args = (src_backend, src_stream, dst_backend, dst_stream, pool, dst, src, nbytes, chunk)
        self._thread = threading.Thread(target=self._run, name="ferry-peer-staging", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        src_backend, src_stream, dst_backend, dst_stream, pool, dst, src, nbytes, chunk = self._args
        slots: list[tuple[Any, Any, Any]] = []  # (block, downloaded event, uploaded event)
        abandon = False
        try:
            for _ in range(2):
                downloaded = src_backend.event_create(blocking=True)
                uploaded = dst_backend.event_create(blocking=True)
                slots.append((pool.acquire(chunk), downloaded, uploaded))
            busy = [False, False]
            for k, offset in enumerate(range(0, nbytes, chunk)):
                n = min(chunk, nbytes - offset)
                block, downloaded, uploaded = slots[k % 2]
                if busy[k % 2]:
                    dst_backend.event_synchronize(uploaded)  # the slot's previous upload read it
                src_backend.memcpy_dtoh(block.ptr, src + offset, n, src_stream)
                src_backend.event_record(downloaded, src_stream)
                dst_backend.stream_wait_event(dst_stream, downloaded)
                dst_backend.memcpy_htod(dst + offset, block.ptr, n, dst_stream)
                dst_backend.event_record(uploaded, dst_stream)
                busy[k % 2] = True
            for i, (_, _, uploaded) in enumerate(slots):
                if busy[i]:
                    dst_backend.event_synchronize(uploaded)
        except DeviceError as exc:
            self.error = exc
            abandon = True
        except BaseException as exc:
            self.error = DeviceError(f"peer staging failed: {exc!r}")
            abandon = True
        finally:
            for block, downloaded, uploaded in slots:
                if not abandon:  # a failed DMA may still touch a slot: never reuse it
                    pool.release(block)
                for backend, event in ((src_backend, downloaded), (dst_backend, uploaded)):
                    with contextlib.suppress(DeviceError):
                        backend.event_destroy(event)
            self.done.set()


def require_same_kind(a: Any, b: Any) -> None:
    """Both runtimes must drive the same kind of device."""
    if a.backend != b.backend:
        raise DeviceUnavailableError(f"cannot copy between a {a.backend} and a {b.backend} device")
