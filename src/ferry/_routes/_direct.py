"""The direct route: a pageable payload of up to a few MiB through one pooled pinned block.

Up to ``StagingConfig.direct_bytes`` cutting the payload into chunks for the
staging lanes costs more than it saves, so the calling thread copies the
array into a pinned block from the pool (upload) and enqueues the DMA; a
download enqueues the DMA and copies the block out when ``wait()`` settles the
record (``finish``), before anything is published. The block goes back to the
pool once the record left flight, or is abandoned (never reused, counted) if
the copy failed.

One thread copies host memory at about 13 GB/s on a cloud VM: a 1 MiB copy
alone took longer than the driver's whole pageable copy. With the compiled
extension the host copy of a C-contiguous array is shared: a
``Copier`` cuts it into pieces that the calling thread and the copy helpers
(``StagingConfig.copy_helpers``) claim from one counter, so the caller never
waits for a helper to wake. An upload of at least ``2 * SEGMENT_BYTES`` is
also enqueued in up to ``SEGMENTS`` segments, each DMA right behind its
part's copy (streaming stores: the DMA, not the CPU, reads the block next),
so the copy engine works while the rest is copied. Only the last segment
records the transfer's event; every DMA is on one stream, so that event
proves them all. A failure after a segment was queued is reported as
queued (the block may still be read: it is abandoned). Inside
``rt.batch()`` the copy runs first and the batch enqueues one DMA, as before.

Bursts
------
One transfer copied on the calling thread is as fast as any up to a few MiB,
but a burst of them (a state dict's thousand 1 MiB tensors submitted back to
back) would run at that one thread's speed while the staging lanes sleep. So
a transfer of at least :data:`BURST_MIN_BYTES` submitted while an earlier one
of its direction is still in flight on this route or was handed over (not
yet waited, or dropped and not yet retired) goes to the compiled staging
engine instead: one job, queued in microseconds, whose chunks the lanes copy
and enqueue while the caller submits the next one (the engine rotates the
lane each job starts on, so back-to-back jobs spread over every lane). Its
record is a staged one (proven by the job, handed off as a staged upload);
ordering, events and ownership are those of every transfer. Inside
``rt.batch()``, with the pure-Python engine, or with elements larger than a
slot, the route stays direct.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from .. import _native
from .._backends._base import DeviceError
from .._errors import TransferSubmitError
from ._base import HostCopy, HostLeases, array_ptr
from ._staged import StagingConfig, copy_in, copy_out, plan_chunks

if TYPE_CHECKING:
    from .._completion import Completion, Record
    from .._memory._pinned import PinnedPool

__all__: list[str] = []

SEGMENT_BYTES = 512 << 10
"""The smallest segment of a segmented direct upload."""

SEGMENTS = 4
"""The most segments a direct transfer is enqueued in."""

DOWNLOAD_SEGMENT_BYTES = 2 << 20
"""The smallest segment of a segmented direct download (below two of them one DMA, then the copy out)."""

BURST_MIN_BYTES = 256 << 10
"""The smallest transfer a burst hands to the staging engine (below it the caller's copy costs microseconds)."""

_Copy = Callable[[int, int, int, Any, Any], None]

_SLICE = 0.05  # s: a waiter copying out a segmented download asks for Ctrl-C this often


def _raise_queued(exc: DeviceError, *, after_first: bool) -> NoReturn:
    """Re-raise a segment's refused enqueue: once an earlier segment is queued, the copy counts as queued."""
    if after_first and not exc.enqueued:
        raise DeviceError(str(exc), code=exc.code, sticky=exc.sticky, enqueued=True) from exc
    raise exc


class DirectRoute:
    """One pooled pinned block and one DMA per transfer."""

    name = "direct"

    def __init__(self, completion: Completion, pool: PinnedPool, leases: HostLeases, config: StagingConfig) -> None:
        self.completion = completion
        self.pool = pool
        self.leases = leases
        self._lock = threading.Lock()
        self.held_bytes = 0  # pool blocks held by copies in flight
        self.host_copied = 0
        module = _native.load() if config.engine != "python" else None
        # the shared host copy; its helper threads start at its first shared copy
        self.copier: Any = module.Copier(config.helper_count()) if module is not None else None
        self.slot_bytes = config.slot_bytes
        self.staged: Any = None  # the staged route (set by the host routes): where bursts go
        self.busy = [0, 0]  # transfers of each direction (download, upload) in flight from this route
        self.bursts = 0  # transfers handed to the staging engine as part of a burst
        self._choice: tuple[int, bool] = (0, False)  # (id(request), to the engine), from streams() to submit()
        self._native: dict[bool, bool] = {}  # per direction: whether its staging engine is the compiled one

    def close(self) -> None:
        """Join the copy helpers (a later copy runs on the calling thread alone)."""
        if self.copier is not None:
            self.copier.close()

    def _segmented(self, copy: _Copy, host_ptr: int, nbytes: int) -> _Copy:
        """``copy`` for the whole payload, as segments each enqueued right behind its part's host copy."""
        copier = self.copier
        seg = max(SEGMENT_BYTES, -(-nbytes // SEGMENTS))

        def segmented(dst: int, src: int, n: int, stream: Any, event: Any) -> None:
            off = 0
            while True:
                m = min(seg, n - off)
                copier.copy(src + off, host_ptr + off, m, True)
                last = off + m >= n
                try:
                    copy(dst + off, src + off, m, stream, event if last else None)
                except DeviceError as exc:
                    _raise_queued(exc, after_first=off > 0)
                if last:
                    return
                off += m

        return segmented

    def streams(self, request: HostCopy) -> list[Any]:
        """The direction's copy stream, or the staging engine's streams for a transfer of a burst."""
        engine = self._burst(request)
        self._choice = (id(request), engine)
        if engine:
            streams: list[Any] = self.staged.streams(request)
            return streams
        return [request.stream]

    def _burst(self, request: HostCopy) -> bool:
        """Whether this transfer joins a burst: the staging engine takes it (see the module docstring)."""
        staged = self.staged
        if (
            staged is None or self.copier is None or not self.busy[request.upload]
            or request.nbytes < BURST_MIN_BYTES or request.host.itemsize > self.slot_bytes
            or self.completion.batches.get(threading.get_ident()) is not None
        ):
            return False
        native = self._native.get(request.upload)
        if native is None:  # the compiled lanes only (asked once per direction: it creates the engine)
            from ._staged import StagingEngine

            native = self._native[request.upload] = not isinstance(staged.engine(request.upload), StagingEngine)
        return native

    def _track(self, request: HostCopy) -> None:
        """Count the transfer as in flight from this route until its record leaves flight."""
        busy, direction = self.busy, int(request.upload)
        with self._lock:
            busy[direction] += 1

        def cleanup(failed: bool) -> None:
            with self._lock:
                busy[direction] -= 1

        request.extra.cleanups.append(cleanup)

    def _count(self, held: int, copied: int = 0) -> None:
        with self._lock:
            self.held_bytes += held
            self.host_copied += copied

    def submit(self, request: HostCopy) -> Record:
        """Copy through one pool block, or hand a transfer of a burst to the staging engine. Lock held."""
        choice, self._choice = self._choice, (0, False)
        engine = choice[1] if choice[0] == id(request) else self._burst(request)
        if engine:
            record: Record = self.staged.submit(request)
            self.bursts += 1
        else:
            record = self._submit_direct(request)
        self._track(request)
        return record

    def _submit_direct(self, request: HostCopy) -> Record:
        completion, pool = self.completion, self.pool
        host, device = request.host, request.device
        nbytes = request.nbytes
        block = pool.acquire(max(nbytes, 1))
        self._count(block.capacity)
        try:
            chunks = plan_chunks(host, max(nbytes, 1))
            base = array_ptr(host)
            copier = self.copier if host.flags.c_contiguous else None  # shared: C-contiguous only
            if request.upload:
                copy = request.copy
                if copier is None:
                    for part in chunks:
                        copy_in(block.ptr + part.offset, host, part, base)
                elif nbytes < 2 * SEGMENT_BYTES or completion.batches.get(threading.get_ident()) is not None:
                    copier.copy(block.ptr, base, nbytes, True)
                else:
                    copy = self._segmented(copy, base, nbytes)  # the host copy runs in the enqueue
                record = completion.enqueue(
                    request.stream, copy, device._ptr, block.ptr, nbytes,
                    request.moved, request.leased, request.result,
                )
                self._count(0, nbytes)
            else:
                parts: _Parts | None = None
                copy = request.copy
                if (
                    copier is not None and nbytes >= 2 * DOWNLOAD_SEGMENT_BYTES
                    and completion.batches.get(threading.get_ident()) is None
                ):
                    parts = _Parts(completion, copier, block.ptr, base, nbytes)
                try:
                    if parts is not None:
                        copy = parts.segmented(copy)
                    record = completion.enqueue(
                        request.stream, copy, block.ptr, device._ptr, nbytes,
                        request.moved, request.leased, request.result,
                    )
                except BaseException:
                    if parts is not None:
                        parts.release(failed=True)
                    raise
                alias = host.view()  # written through a view taken before the array goes read-only

                def publish() -> None:
                    if parts is not None:
                        parts.finish()
                    elif copier is not None:
                        copier.copy(base, block.ptr, nbytes)
                    else:
                        for part in chunks:
                            copy_out(alias, part, block.ptr + part.offset, base)
                    self._count(0, nbytes)

                request.extra.finish = publish
                if parts is not None:
                    request.extra.progress = parts.advance
                    request.extra.cleanups.append(parts.release)
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


class _Parts:
    """A segmented direct download: its segments, their events, and how far the copy out got.

    Every segment but the last records an event of its own (the last records
    the transfer's). ``advance`` (a waiter, without the runtime's lock) copies
    out each segment once its event completed, in order; ``finish`` (the
    record's settle) copies out what is left. One lock orders them, and the
    events go back (or, after a failure, are destroyed) only under it, once
    no waiter can be waiting on one.
    """

    __slots__ = ("base", "block", "bounds", "completion", "copier", "error", "events", "lock", "next")

    def __init__(self, completion: Completion, copier: Any, block: int, base: int, nbytes: int) -> None:
        seg = max(DOWNLOAD_SEGMENT_BYTES, -(-nbytes // SEGMENTS))
        self.completion = completion
        self.copier = copier
        self.block = block
        self.base = base
        self.bounds = [(off, min(seg, nbytes - off)) for off in range(0, nbytes, seg)]
        self.events: list[Any] = []
        self.lock = threading.Lock()
        self.next = 0  # the first segment not copied out
        self.error: DeviceError | None = None  # what a segment's event reported

    def segmented(self, copy: _Copy) -> _Copy:
        """``copy`` for the whole payload as segments, each but the last with its own event. Lock held."""
        completion, bounds = self.completion, self.bounds
        try:
            while len(self.events) < len(bounds) - 1:
                self.events.append(completion.take_event())
        except DeviceError as exc:
            completion.health.note(exc)
            raise TransferSubmitError(f"could not create an event: {exc}") from exc

        def segmented(dst: int, src: int, n: int, stream: Any, event: Any) -> None:
            last = len(bounds) - 1
            for i, (off, m) in enumerate(bounds):
                try:
                    copy(dst + off, src + off, m, stream, event if i == last else self.events[i])
                except DeviceError as exc:
                    _raise_queued(exc, after_first=i > 0)

        return segmented

    def advance(self, deadline: float | None) -> None:
        """Copy out the segments that landed, in order, waiting for each until ``deadline`` (a past one:
        poll); never the last one. Raises the DeviceError a segment's event reported (again on every
        later call: the event reports it once), so that the record fails and nothing is published."""
        if not self.lock.acquire(blocking=False):  # another waiter is at it
            return
        try:
            if self.error is not None:
                raise self.error.fresh()
            backend, events, bounds = self.completion.backend, self.events, self.bounds
            while self.next < len(events):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                seconds = _SLICE if remaining is None else min(remaining, _SLICE)
                try:
                    landed = backend.event_wait(events[self.next], seconds)
                except DeviceError as exc:
                    self.error = exc
                    raise
                if not landed:
                    if remaining is not None and remaining <= _SLICE:
                        return
                    continue
                off, m = bounds[self.next]
                self.copier.copy(self.base + off, self.block + off, m)
                self.next += 1
        finally:
            self.lock.release()

    def finish(self) -> None:
        """Copy out every segment not copied yet (the transfer completed)."""
        with self.lock:
            for off, m in self.bounds[self.next:]:
                self.copier.copy(self.base + off, self.block + off, m)
            self.next = len(self.bounds)

    def release(self, failed: bool) -> None:
        """The segments' events back to the pool, or destroyed after a failure. Lock held."""
        with self.lock:
            events, self.events = self.events, []
        if not failed:
            self.completion.events.extend(events)
            return
        for event in events:
            with contextlib.suppress(DeviceError):
                self.completion.backend.event_destroy(event)
