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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._backends._base import Backend, DeviceError
from .._completion import Extras
from .._device_array import DeviceArray
from .._errors import RuntimeClosedError, TransferSubmitError
from .._interop._foreign import DEVICE, expect, order_before
from .._state import IN_FLIGHT
from ._base import RuntimeParts

if TYPE_CHECKING:
    from .._completion import Completion, Record
    from .._memory._pinned import PinnedPool

__all__ = ["Route", "routes"]

_R = TypeVar("_R")  # the facade's type (the runtime, which sits above)


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
    from .._lifecycle import make_backend

    first = make_backend(backend, 0, 25e9, 5e-6)
    backends = [first]
    try:
        count = first.device_count()
        backends += [make_backend(first.name, d, 25e9, 5e-6) for d in range(1, count)]
        found = []
        for a in backends:
            for b in backends:
                ok, reason, attributes = b.peer_access(a)
                kind = "same device" if a is b else ("peer" if ok else "staged")
                found.append(Route(a.device, b.device, kind, reason, attributes))
        return found
    finally:
        for b in backends:
            with contextlib.suppress(DeviceError):
                b.close()


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

    def is_done(self) -> bool:
        """Whether the last upload completed (or the job failed). Never blocks."""
        return self.done.is_set()

    def wait_done(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Block until done (or ``timeout`` seconds passed); return whether done. Never polls
        (``poll`` is for the protocol)."""
        return self.done.wait(timeout)

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


class Side:
    """One runtime's end of a device-to-device copy: what the route needs of it."""

    __slots__ = ("backend", "completion", "device", "download_stream", "lock")

    def __init__(self, backend: Backend, download_stream: Any, lock: Any, completion: Completion) -> None:
        self.backend = backend
        self.device = int(backend.device)
        self.download_stream = download_stream
        self.lock = lock
        self.completion = completion  # orders copies after the arrays' handed-off uploads


class PeerRoute:
    """Device-to-device copies into this runtime's device: peer, staged or same device."""

    name = "peer"

    def __init__(self, completion: Completion, pool: PinnedPool, chunk_bytes: int, peer_access: bool) -> None:
        self.completion = completion
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.peer_access = peer_access
        self._stream: Any = None  # the device-to-device copy stream, created on first use
        self._enabled: set[int] = set()

    def _d2d(self) -> Any:
        if self._stream is None:
            self._stream = self.completion.backend.stream_create()
        return self._stream

    def submit(self, source_side: Side, source: Any, destination: Any, nbytes: int, same: bool) -> Record:
        """Enqueue the copy on the route the pair allows. Both runtimes' locks held."""
        completion = self.completion
        backend = completion.backend
        other = source_side.backend
        leased: tuple[Any, ...] = (source,) if same else ()
        moved, result = (destination,), (source, destination)
        try:
            stream = self._d2d()
            # a handed-off array's upload may still run: order the copy after it on the device, as
            # every other route does (the source's in its own runtime, the destination's here)
            staged = not same and source_side.device != backend.device and not (
                self.peer_access and backend.peer_access(other)[0]
            )
            order_before(completion, [stream], destination)
            order_before(source_side.completion, [source_side.download_stream if staged else stream], source)
            if same or source_side.device == backend.device:
                copy = _then_record(backend, backend.memcpy_dtod)
            else:
                ok = self.peer_access and backend.peer_access(other)[0]
                if ok and source_side.device not in self._enabled:
                    backend.enable_peer(other)
                    self._enabled.add(source_side.device)
                if ok:
                    def peer(dst: int, src: int, n: int, s: Any) -> None:
                        backend.memcpy_peer(dst, src, other, n, s)

                    copy = _then_record(backend, peer)
                else:
                    job = StagedPeerJob(
                        other, source_side.download_stream, backend, stream, self.pool,
                        destination._ptr, source._ptr, nbytes, self.chunk_bytes,
                    )
                    extra = Extras()
                    extra.cleanups.append(self._cross_lease(source_side, source))
                    return completion.job_record(
                        job, ("peer-staged", source_side.device), moved, leased, result, nbytes, extra
                    )
        except DeviceError as exc:
            completion.health.note(exc)
            raise TransferSubmitError(f"the device refused the copy route: {exc}") from exc
        record = completion.enqueue(stream, copy, destination._ptr, source._ptr, nbytes, moved, leased, result)
        if not same:
            completion.extras(record).cleanups.append(self._cross_lease(source_side, source))
        return record

    def _cross_lease(self, side: Side, source: Any) -> Any:
        """The cleanup of a read lease held in another runtime: ended under its lock, after ours."""
        completion = self.completion

        def cleanup(failed: bool) -> None:
            if failed:  # the failed copy may still read it
                completion.abandon(source)
            else:
                completion.cross_returns.append((side.lock, source))

        return cleanup

    def close(self) -> None:
        """Destroy the copy stream (the device is idle)."""
        if self._stream is not None and self.completion.health.device_usable:
            with contextlib.suppress(DeviceError):
                self.completion.backend.stream_destroy(self._stream)
        self._stream = None


def _then_record(backend: Backend, copy: Any) -> Any:
    """A backend copy followed by an event record, with the error discipline of ``htod_record``."""

    def run(dst: int, src: int, nbytes: int, stream: Any, event: Any) -> None:
        if nbytes:
            copy(dst, src, nbytes, stream)
        if event is None:
            return
        try:
            backend.event_record(event, stream)
        except DeviceError as exc:
            exc.enqueued = True
            raise

    return run


class Party(RuntimeParts, Protocol):
    """One runtime's parts as a device-to-device copy sees them (``_parts.Parts``, which sits above)."""

    @property
    def peer(self) -> PeerRoute:
        """The route of copies into the runtime's device."""
        ...

    @property
    def side(self) -> Side:
        """The runtime as the source of a copy."""
        ...


def check_copy(owner: object, source: Any, destination: Any, facade: type[_R]) -> _R:
    """The source's runtime (a ``facade``), once ``destination <- source`` is a copy that ``owner`` takes
    (see ``copy_pending``); raises ``TransferSubmitError`` otherwise."""
    expect(source, DeviceArray, "copy_pending", "source", DEVICE)
    expect(destination, DeviceArray, "copy_pending", "destination", DEVICE)
    if destination._runtime is not owner:
        raise TransferSubmitError("copy_pending is submitted to the destination's runtime: call it on that runtime")
    other = source._runtime
    if not isinstance(other, facade):
        raise TransferSubmitError("the source does not belong to a ferry runtime")
    return other


def copy_between(
    owner: object, parts: Party, source_owner: object, source_parts: Party, source: Any, destination: Any
) -> Record:
    """Check and submit ``destination <- source`` under both runtimes' locks (see ``copy_pending``)."""
    theirs, ours = source_parts.backend.name, parts.backend.name
    if theirs != ours:
        raise TransferSubmitError(f"cannot copy from a {theirs} device to a {ours} device")
    same = source_parts is parts
    locks = [parts.lock] if same else sorted([parts.lock, source_parts.lock], key=id)
    with contextlib.ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        for side in (parts, source_parts):
            if side.health.refusal is not None:
                raise RuntimeClosedError(side.health.refusal)
        if source is destination:
            raise TransferSubmitError("copy_pending needs two different arrays")
        problem = destination._submission_problem(owner, write=True) or source._submission_problem(
            source_owner, write=False
        )
        if problem:
            raise TransferSubmitError(problem)
        nbytes = source._nbytes
        if destination._nbytes < nbytes:
            raise TransferSubmitError(f"the destination holds {destination._nbytes} bytes; the source has {nbytes}")
        completion = parts.completion
        if completion.maintenance_due():
            completion.maintain()
        record = parts.peer.submit(source_parts.side, source, destination, nbytes, same)
        destination._state = IN_FLIGHT
        source._leases += 1  # under the source runtime's lock
    return record
