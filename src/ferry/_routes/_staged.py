"""The staged route: chunked, pipelined staging through a bounded ring of pinned slots.

This module is the pure-Python engine (worker threads); the compiled engine
in ``ferry._native`` runs the same plan on native threads when it is built.

The problem
-----------
DMA reads and writes only page-locked memory. Handed pageable memory, the
driver stages it itself, one bounded copy at a time, and pays first-touch page
faults on the way: 8 GB/s host-to-device and 2.6 GB/s into a fresh output on
an H200 whose pinned ceiling is 55 GB/s. Pinning the whole array costs more
than the copy (``cuMemHostAlloc`` is ~0.4 ms per MiB).

The shape
---------
A staging engine has a fixed set of *lanes* per direction. A lane is one
worker thread with its own copy stream and ``slots_per_lane`` pinned slots of
``slot_bytes`` each, taken once from the runtime's pinned pool. A transfer is
cut into chunks of ``StagingConfig.chunk_bytes(nbytes)`` (its share of every
lane, at least ``min_chunk_bytes``, at most one slot) dealt round-robin to the
lanes; each lane runs its chunks in order:

* upload: wait until the slot's previous DMA completed (its event), copy the
  chunk from the array into the slot (``memmove`` / ``numpy.copyto``, GIL
  released), enqueue the slot -> device DMA, record the slot's event;
* download: enqueue the device -> slot DMA for the next chunk while the
  previous slot is copied out, wait for a slot's event, copy it into the
  output.

So several host copies and several DMAs run at once, each payload byte is
copied by the host exactly once, no tensor-sized pinned memory is ever
allocated, and nothing is zero-filled. Whole chunks stay on one lane (a
dispatcher that split every chunk across threads and waited for all parts
reached only 20 GB/s in a probe: the per-chunk barrier cost the overlap).
Staging memory is bounded by ``lanes * slots_per_lane * slot_bytes`` per
direction; when every slot is busy a lane waits for its oldest DMA, which is
the backpressure.

A lane finishes its share of a transfer only once its DMAs are complete (it
synchronizes its slot events), so a staged transfer is complete exactly when
every lane has reported; that is what ``is_ready``/``wait`` look at. A device
error on any chunk marks the transfer failed; the remaining chunks are
skipped; ``wait()`` raises and publishes nothing. The slots a failed DMA may
still touch are abandoned (never reused) and the lane takes fresh ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._backends._base import DeviceError
from ._native import NativeEngine, engine_threads

if TYPE_CHECKING:
    from types import ModuleType

    from .._completion import Completion, Record
    from .._memory._pinned import Block, PinnedPool
    from ._base import HostCopy, HostLeases

__all__ = ["StagingConfig"]

_memmove = ctypes.memmove

MAX_COPY_HELPERS = 8
"""The most copy helpers a runtime runs (the extension's ``Copier`` limit)."""

DEFAULT_LANE_HELPERS = 7
"""Idle lanes that help a cooperative job's lead copy, where CPUs are to spare (``lane_helpers=-1``)."""


@dataclass(frozen=True)
class StagingConfig:
    """How a runtime stages pageable NumPy arrays.

    Attributes
    ----------
    slot_bytes
        Size of one pinned slot (one chunk).
    slots_per_lane
        Pinned slots per lane (2 = double buffering).
    lanes
        Worker threads per direction, each with its own copy stream.
    direct_bytes
        Transfers up to this size skip the lanes: one pinned block from the
        pool, the host copy on the calling thread (shared with the copy
        helpers), the DMA behind it (cheaper up to a few MiB than cutting the
        payload into chunks for the lanes). A direct transfer holds one
        pinned block of its size class while it is in flight. An upload's
        host copy runs in the submission, a download's in ``wait()``.
    direct_download_bytes
        Downloads up to this size take the direct route. ``-1`` (the
        default) picks twice ``direct_bytes`` where the compiled extension
        shares the host copy (a download's copy runs when it is waited for,
        so the submitting thread never pays it, and one DMA then a shared
        copy out beats the lanes there) and ``direct_bytes`` on the
        pure-Python engine; ``info()["staging_threads"]`` shows both limits.
    min_chunk_bytes
        The smallest chunk a transfer is cut into. A transfer is cut into
        ``ceil(nbytes / lanes)`` chunks (so that every lane works on it),
        at least ``min_chunk_bytes`` (fewer lanes wake for mid-size payloads)
        and at most ``slot_bytes``.
    copy_helpers
        Threads that share the direct route's host copy with the calling
        thread (compiled engine only). ``-1`` (the default): ``min(4, CPUs - 1)``.
    lane_helpers
        Compiled engine only: idle lanes that help copy a contiguous staged
        transfer. With helpers, such a transfer is one *cooperative* job: one
        lead lane takes its chunks (a quarter of it each, at most
        ``slot_bytes``) in order, and each chunk's host copy is cut into
        pieces that the lead and the helpers claim, so that chunk ``k`` is on
        the link while chunk ``k + 1`` is copied. ``0``: chunks are dealt to
        the lanes, one host copy each. ``-1`` (the default): up to
        ``DEFAULT_LANE_HELPERS`` where the machine has CPUs to spare (as for
        the driver thread), else 0. Uploads only: a cooperative download's
        copy out into fresh pages ran at 5 - 7 GB/s on the H200 (the threads
        fault the same pages in), against 15 - 20 GB/s dealt.
    cooperative_max_bytes
        The largest cooperative upload; larger ones are dealt to the lanes,
        whose slots together keep the link busy where one lead's cannot.
    engine
        ``"auto"`` (the compiled engine when it is built and ``FERRY_NATIVE``
        is not ``0``, else the pure-Python one), ``"native"`` (the compiled
        engine, or :class:`~ferry.DeviceUnavailableError` at the first staged
        transfer when it cannot run) or ``"python"``. ``python -m ferry info``
        says which one runs and why.
    """

    slot_bytes: int = 4 << 20
    slots_per_lane: int = 3
    lanes: int = 12
    direct_bytes: int = 4 << 20
    min_chunk_bytes: int = 1 << 20
    engine: str = "auto"
    copy_helpers: int = -1
    direct_download_bytes: int = -1
    lane_helpers: int = -1
    cooperative_max_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if (
            self.slot_bytes < 4096
            or self.slots_per_lane < 1
            or self.lanes < 1
            or self.direct_bytes < 0
            or self.direct_download_bytes < -1
            or self.min_chunk_bytes < 4096
            or self.cooperative_max_bytes < 0
        ):
            raise ValueError(
                "StagingConfig needs slot_bytes >= 4096, slots_per_lane >= 1, lanes >= 1, direct_bytes >= 0, "
                "direct_download_bytes >= 0 (or -1), min_chunk_bytes >= 4096 "
                "and cooperative_max_bytes >= 0"
            )
        if self.engine not in ("auto", "native", "python"):
            raise ValueError(f"StagingConfig.engine must be 'auto', 'native' or 'python', not {self.engine!r}")
        if self.lanes > 64 or self.slots_per_lane > 64:
            raise ValueError("StagingConfig allows at most 64 lanes and 64 slots per lane")
        if not -1 <= self.copy_helpers <= MAX_COPY_HELPERS:
            raise ValueError(f"StagingConfig.copy_helpers must be -1 (auto) or 0 - {MAX_COPY_HELPERS}")
        if not -1 <= self.lane_helpers < self.lanes:
            raise ValueError("StagingConfig.lane_helpers must be -1 (auto) or 0 - lanes - 1")

    def resolved(self) -> StagingConfig:
        """This config with ``direct_download_bytes=-1`` resolved: twice ``direct_bytes`` where the
        compiled extension shares the direct route's host copy (``engine`` is not ``"python"`` and it
        loads), else ``direct_bytes``."""
        if self.direct_download_bytes >= 0:
            return self
        from .. import _native

        shared = self.engine != "python" and _native.load() is not None
        return replace(self, direct_download_bytes=2 * self.direct_bytes if shared else self.direct_bytes)

    def helper_count(self) -> int:
        """The copy helpers a runtime with this config runs (``copy_helpers``, ``-1`` resolved)."""
        if self.copy_helpers >= 0:
            return self.copy_helpers
        return max(0, min(4, (os.cpu_count() or 1) - 1))

    def lane_helper_count(self) -> int:
        """The idle lanes that help a cooperative job's lead copy (``lane_helpers``, ``-1`` resolved)."""
        if self.lane_helpers >= 0:
            return self.lane_helpers
        roomy, _ = engine_threads(self.lanes)
        return min(self.lanes - 1, DEFAULT_LANE_HELPERS) if roomy else 0

    def chunk_bytes(self, nbytes: int) -> int:
        """The chunk size for a transfer of ``nbytes``: spread over every lane, within the bounds."""
        share = -(-nbytes // self.lanes)
        share = -(-share // 65536) * 65536
        return min(self.slot_bytes, max(self.min_chunk_bytes, share))

    @property
    def pinned_bytes(self) -> int:
        """Pinned memory one direction's lanes hold."""
        return self.slot_bytes * self.slots_per_lane * self.lanes


def default_staging() -> StagingConfig:
    """A runtime's config when none is given: the defaults, with no more lanes than this machine's CPUs
    (at least 2)."""
    lanes = max(2, min(StagingConfig.lanes, (os.cpu_count() or 2)))
    return StagingConfig(lanes=lanes)


# -- chunk plans ------------------------------------------------------------------------------------


class Chunk(NamedTuple):
    """``nbytes`` at ``offset`` of the C-order byte image; ``select`` picks them from the array.

    A named tuple: a 256 MiB transfer plans 64 of them on the submitting
    thread, and a tuple is built several times faster than a dataclass.
    """

    offset: int
    nbytes: int
    select: tuple[Any, ...] | None  # None: the array is C-contiguous, copy raw bytes


def plan_chunks(array: np.ndarray[Any, Any], chunk_bytes: int) -> list[Chunk]:
    """Cut ``array``'s C-order byte image into pieces of at most ``chunk_bytes``.

    A C-contiguous array is cut into raw byte ranges. Any other array is cut
    along its axes so that each piece is a sub-array whose C-order bytes are
    one contiguous range of the image: the piece is copied straight between
    the strided array and a slot, once.
    """
    nbytes = array.nbytes
    if array.flags.c_contiguous:
        return [Chunk(off, min(chunk_bytes, nbytes - off), None) for off in range(0, nbytes, chunk_bytes)]
    shape = array.shape
    step = [0] * len(shape)  # bytes of one index step along each axis, in C order
    size = array.itemsize
    for axis in range(len(shape) - 1, -1, -1):
        step[axis] = size
        size *= shape[axis]
    axis = next((a for a in range(len(shape)) if step[a] <= chunk_bytes), len(shape) - 1)
    per = max(1, chunk_bytes // step[axis])
    chunks = []
    for prefix in np.ndindex(*shape[:axis]):
        base = sum(i * s for i, s in zip(prefix, step, strict=False))
        for start in range(0, shape[axis], per):
            stop = min(start + per, shape[axis])
            chunks.append(Chunk(base + start * step[axis], (stop - start) * step[axis], (*prefix, slice(start, stop))))
    return chunks


def copy_in(slot_ptr: int, array: np.ndarray[Any, Any], chunk: Chunk, base_ptr: int) -> None:
    """Copy one chunk of ``array`` into the slot at ``slot_ptr`` (GIL released)."""
    if chunk.select is None:
        _memmove(slot_ptr, base_ptr + chunk.offset, chunk.nbytes)
        return
    part = array[chunk.select]
    np.copyto(_slot_view(slot_ptr, part), part, casting="no")


def copy_out(array: np.ndarray[Any, Any], chunk: Chunk, slot_ptr: int, base_ptr: int) -> None:
    """Copy one chunk from the slot at ``slot_ptr`` into ``array`` (GIL released)."""
    if chunk.select is None:
        _memmove(base_ptr + chunk.offset, slot_ptr, chunk.nbytes)
        return
    part = array[chunk.select]
    np.copyto(part, _slot_view(slot_ptr, part), casting="no")


def _slot_view(ptr: int, like: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    raw = (ctypes.c_ubyte * like.nbytes).from_address(ptr)
    flat: np.ndarray[Any, Any] = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
    view: np.ndarray[Any, Any] = flat.view(like.dtype).reshape(like.shape)
    return view


# -- jobs -------------------------------------------------------------------------------------------


class StagedJob:
    """One staged transfer: its chunks, its lanes' progress, its outcome.

    ``done`` is set once every lane finished its share (all of its DMAs
    complete, all of its host copies done); ``error`` is then the first device
    error any lane met, or ``None``.
    """

    def __init__(
        self,
        direction: str,
        array: np.ndarray[Any, Any],
        device_ptr: int,
        chunks: list[Chunk],
        lanes: int,
    ) -> None:
        self.direction = direction
        self.array: Any = array  # dropped once the record settles
        self.array_ptr = int(array.ctypes.data) if array.flags.c_contiguous else 0
        self.device_ptr = device_ptr
        self.chunks = chunks
        self.error: DeviceError | None = None
        self.done = threading.Event()
        self.host_bytes = 0
        self._lock = threading.Lock()
        self._remaining = min(lanes, len(chunks))
        if self._remaining == 0:
            self.done.set()

    def is_done(self) -> bool:
        """Whether every lane finished its share. Never blocks."""
        return self.done.is_set()

    def wait_done(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Block until every lane finished (or ``timeout`` seconds passed); return whether done.
        Never polls (``poll`` is for the protocol)."""
        return self.done.wait(timeout)

    def lane_finished(self, copied: int, error: DeviceError | None) -> None:
        with self._lock:
            self.host_bytes += copied
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self.done.set()


class _Slot:
    __slots__ = ("block", "busy", "event")

    def __init__(self, block: Block, event: Any) -> None:
        self.block = block
        self.event = event
        self.busy = False  # a DMA was recorded on it and not yet proven complete


class Lane:
    """One worker thread, one copy stream, ``slots_per_lane`` pinned slots."""

    def __init__(self, engine: StagingEngine, index: int) -> None:
        self.engine = engine
        self.index = index
        backend = engine.backend
        self.stream = backend.stream_create()
        try:
            self.slots = self._new_slots()
        except BaseException:
            with contextlib.suppress(DeviceError):
                backend.stream_destroy(self.stream)
            raise
        self.gone: DeviceError | None = None  # why the lane could not replace abandoned slots
        self.jobs: queue.SimpleQueue[tuple[StagedJob, list[Chunk]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, name=f"ferry-{engine.direction}-lane-{index}", daemon=True
        )
        try:
            self.thread.start()
        except BaseException:  # no thread (none may start now): the slots and the stream go back
            self._give_back()
            raise

    def _new_slots(self) -> list[_Slot]:
        """``slots_per_lane`` fresh slots, or none: a refusal midway gives back what it took (no DMA has
        touched those) and raises."""
        engine = self.engine
        slots: list[_Slot] = []
        try:
            for _ in range(engine.config.slots_per_lane):
                block = engine.pool.acquire(engine.config.slot_bytes)
                try:
                    # blocking-sync events: a lane waiting for its DMA sleeps instead of spinning a core
                    event = engine.backend.event_create(blocking=True)
                except BaseException:
                    engine.pool.release(block)
                    raise
                slots.append(_Slot(block, event))
        except BaseException:
            for slot in slots:
                engine.pool.release(slot.block)
                with contextlib.suppress(DeviceError):
                    engine.backend.event_destroy(slot.event)
            raise
        return slots

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, chunks = item
            copied, error = 0, None
            try:
                if not self.slots:  # the device refused new slots after a failure: every later job fails
                    gone = self.gone
                    raise gone.fresh() if gone is not None else DeviceError("the staging lane has no slots")
                copied = self._upload(job, chunks) if self.engine.direction == "upload" else self._download(job, chunks)
            except DeviceError as exc:
                error = exc
                self._abandon_slots()
            except BaseException as exc:
                error = DeviceError(f"staging lane failed: {exc!r}")
                self._abandon_slots()
            job.lane_finished(copied, error)

    def _free(self, slot: _Slot) -> None:
        if slot.busy:
            self.engine.backend.event_synchronize(slot.event)
            slot.busy = False

    def _upload(self, job: StagedJob, chunks: list[Chunk]) -> int:
        backend = self.engine.backend
        stream = self.stream
        slots = self.slots
        copied = 0
        for k, chunk in enumerate(chunks):
            if job.error is not None:
                break
            slot = slots[k % len(slots)]
            self._free(slot)
            copy_in(slot.block.ptr, job.array, chunk, job.array_ptr)
            copied += chunk.nbytes
            backend.memcpy_htod(job.device_ptr + chunk.offset, slot.block.ptr, chunk.nbytes, stream)
            backend.event_record(slot.event, stream)
            slot.busy = True
        for slot in slots:
            self._free(slot)
        return copied

    def _download(self, job: StagedJob, chunks: list[Chunk]) -> int:
        backend = self.engine.backend
        stream = self.stream
        slots = self.slots
        depth = len(slots)
        copied = 0
        pending: list[tuple[_Slot, Chunk]] = []

        def enqueue(k: int) -> None:
            slot = slots[k % depth]
            chunk = chunks[k]
            backend.memcpy_dtoh(slot.block.ptr, job.device_ptr + chunk.offset, chunk.nbytes, stream)
            backend.event_record(slot.event, stream)
            slot.busy = True
            pending.append((slot, chunk))

        for k in range(min(depth, len(chunks))):
            enqueue(k)
        k = 0
        while pending:
            slot, chunk = pending.pop(0)
            self._free(slot)
            if job.error is None:
                copy_out(job.array, chunk, slot.block.ptr, job.array_ptr)
                copied += chunk.nbytes
            k += 1
            nxt = k + depth - 1
            if nxt < len(chunks) and job.error is None:
                enqueue(nxt)
        return copied

    def _abandon_slots(self) -> None:
        """A DMA failed: the device may still touch these slots; never reuse them."""
        engine = self.engine
        lost = sum(slot.block.capacity for slot in self.slots)
        engine.count(held=-lost, abandoned=lost)
        self.slots = []
        try:
            self.slots = self._new_slots()
            engine.count(held=sum(s.block.capacity for s in self.slots))
        except DeviceError as exc:
            self.slots = []  # the device is gone; later jobs fail at once, with its error
            self.gone = exc

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def release(self) -> None:
        """Give the slots back (the lane is stopped and its DMAs are complete)."""
        engine = self.engine
        engine.count(held=-sum(slot.block.capacity for slot in self.slots))
        self._give_back()

    def _give_back(self) -> None:
        """The slots' blocks to the pool, their events and the stream destroyed (nothing counted)."""
        engine = self.engine
        for slot in self.slots:
            engine.pool.release(slot.block)
            with contextlib.suppress(DeviceError):
                engine.backend.event_destroy(slot.event)
        self.slots = []
        with contextlib.suppress(DeviceError):
            engine.backend.stream_destroy(self.stream)


class StagingEngine:
    """The lanes of one direction, created on first use (the pure-Python engine)."""

    def __init__(self, backend: Any, pool: PinnedPool, config: StagingConfig, direction: str) -> None:
        self.backend = backend
        self.pool = pool
        self.config = config
        self.direction = direction
        self._count_lock = threading.Lock()  # lanes update the counters from their threads
        self.held_bytes = 0  # pinned bytes the lanes' slots hold
        self.abandoned_bytes = 0  # slots a failed DMA may still touch: never reused
        self._lanes: list[Lane] = []
        self._next = 0

    def count(self, *, held: int = 0, abandoned: int = 0) -> None:
        """Adjust the staging counters (any thread)."""
        with self._count_lock:
            self.held_bytes += held
            self.abandoned_bytes += abandoned

    def streams(self) -> list[Any]:
        """The lanes' copy streams (lanes started if needed)."""
        return [lane.stream for lane in self._ensure_lanes()]

    def _ensure_lanes(self) -> list[Lane]:
        if not self._lanes:
            lanes: list[Lane] = []
            try:
                for i in range(self.config.lanes):
                    lane = Lane(self, i)
                    lanes.append(lane)
                    self.count(held=sum(s.block.capacity for s in lane.slots))  # release() uncounts them
            except BaseException:  # the lanes started so far stop and give their slots back
                for lane in lanes:
                    lane.stop()
                    lane.release()
                raise
            self._lanes = lanes
        return self._lanes

    def streams_for(self, array: np.ndarray[Any, Any]) -> list[Any]:
        """The streams of the lanes the next :meth:`submit` of ``array`` deals chunks to: a producer
        is ordered before those alone (an idle lane ordered after a failed producer would carry its
        error into an unrelated later transfer)."""
        lanes = self._ensure_lanes()
        count = len(plan_chunks(array, self.config.chunk_bytes(array.nbytes)))
        return [lanes[(self._next + i) % len(lanes)].stream for i in range(min(count, len(lanes)))]

    def submit(self, array: np.ndarray[Any, Any], device_ptr: int) -> StagedJob:
        """Deal ``array``'s chunks to the lanes; return the job at once."""
        lanes = self._ensure_lanes()
        chunks = plan_chunks(array, self.config.chunk_bytes(array.nbytes))
        job = StagedJob(self.direction, array, device_ptr, chunks, len(lanes))
        shares: list[list[Chunk]] = [[] for _ in lanes]
        for i, chunk in enumerate(chunks):
            shares[i % len(lanes)].append(chunk)
        # rotate the starting lane so that small jobs spread over all lanes
        start = self._next
        self._next = (self._next + len(chunks)) % len(lanes)
        for i, share in enumerate(shares):
            if share:
                lanes[(start + i) % len(lanes)].jobs.put((job, share))
        return job

    def close(self) -> None:
        """Stop the lanes after their queued work, then free their slots."""
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.release()


def native_module(config: StagingConfig) -> ModuleType | None:
    """The compiled engine's module when ``config`` lets it run here, else ``None``.

    Raises :class:`~ferry.DeviceUnavailableError` when ``config.engine`` is
    ``"native"`` and the extension cannot run (the reason is
    :func:`ferry._native.status`).
    """
    if config.engine == "python":
        return None
    from .. import _native

    module = _native.load()
    if module is None and config.engine == "native":
        from .._errors import DeviceUnavailableError

        raise DeviceUnavailableError(f"the native staging engine cannot run: {_native.status()}")
    return module


def engine_status(config: StagingConfig) -> str:
    """Which staging engine a runtime with ``config`` runs, and why, in one line."""
    if config.engine == "python":
        return "python: StagingConfig(engine='python')"
    from .. import _native

    return _native.status()


def engine_threads_status(config: StagingConfig, status: str) -> str:
    """The threads of a runtime's staging engine whose :func:`engine_status` is ``status``, in one line
    (``info()['staging_threads']``)."""
    config = config.resolved()
    direct = (
        f"direct route up to {config.direct_bytes >> 10} KiB up, {config.direct_download_bytes >> 10} KiB down"
    )
    if status != "native":
        return f"{config.lanes} Python lanes per direction; {direct}, copied by the calling thread"
    driver_thread, wait_spin_us = engine_threads(config.lanes)  # what an engine made now would run
    detail = "one driver thread makes their enqueues" if driver_thread else "each calls the driver"
    waits = (
        f"a wait polls until the job's expected end and {wait_spin_us:g} us more, then sleeps"
        if wait_spin_us > 0 else "a wait sleeps at once"
    )
    helpers = config.helper_count()
    lane_helpers = config.lane_helper_count()
    coop = (
        f"a contiguous upload of up to {config.cooperative_max_bytes >> 20} MiB is one lead lane's, its chunk "
        f"copies shared with up to {lane_helpers} idle lane{'s' if lane_helpers != 1 else ''}"
        if lane_helpers else "a transfer's chunks are dealt to the lanes"
    )
    return (
        f"{config.lanes} native lanes per direction, {detail}; {waits}; {coop}; {direct}, "
        f"its host copy shared by the calling thread and {helpers} copy helper{'s' if helpers != 1 else ''}"
    )


class StagedRoute:
    """Chunks through the lanes of one engine per direction (see the module docstring).

    The engine is the compiled one (``_native.py``) when it can run, else the
    pure-Python :class:`StagingEngine`; both keep the same contract.
    """

    name = "staged"

    def __init__(
        self, completion: Completion, pool: PinnedPool, config: StagingConfig, leases: HostLeases
    ) -> None:
        self.completion = completion
        self.pool = pool
        self.config = config
        self.leases = leases
        self.engines: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.host_copied = 0
        self.tree_jobs = 0  # jobs of many pieces (a tree's leaves: _groups.submit_pieces)
        self.tree_leaves = 0  # the leaves those jobs carried
        self._abandoned_before = 0  # abandoned by engines already closed
        self._order_stream: Any = None  # emulated device: where native jobs wait for their producers

    def engine(self, upload: bool) -> Any:
        """The direction's engine (native or Python), created on first use. Lock held."""
        direction = "upload" if upload else "download"
        engine = self.engines.get(direction)
        if engine is None:
            backend = self.completion.backend
            module = native_module(self.config)
            if module is not None:
                engine = NativeEngine(module, backend, self.config, direction)
            else:
                engine = StagingEngine(backend, self.pool, self.config, direction)
            self.engines[direction] = engine
        return engine

    def _ordering_stream(self) -> Any:
        if self._order_stream is None:
            self._order_stream = self.completion.backend.stream_create()
        return self._order_stream

    def streams(self, request: HostCopy) -> list[Any]:
        """The streams a producer must be ordered before: every lane's of the direction (on the
        emulated native engine, the one stream its jobs are submitted from)."""
        engine = self.engine(request.upload)
        if getattr(engine, "cuda", True) is False:
            return [self._ordering_stream()]
        if isinstance(engine, StagingEngine):
            return engine.streams_for(request.host)
        streams: list[Any] = engine.streams()
        return streams

    def submit(self, request: HostCopy) -> Record:
        """Deal the chunks to the lanes; the record's job proves completion. Lock held."""
        host = request.host
        engine = self.engine(request.upload)
        alias = host if request.upload else host.view()  # lanes write through a view taken before read-only
        native = not isinstance(engine, StagingEngine)
        if native:
            after = self._order_stream if not engine.cuda else None
            job = engine.submit(alias, request.device._ptr, after=after)
            request.extra.order_after = lambda stream: engine.order_after(job, stream)
            request.extra.ready_to_order = job.wait_posted
            request.extra.export_stream = request.stream
        else:
            job = engine.submit(alias, request.device._ptr)
        record = self.completion.job_record(
            job, engine, request.moved, request.leased, request.result, request.nbytes, request.extra
        )

        def cleanup(failed: bool) -> None:
            with self._lock:
                self.host_copied += job.host_bytes
            if native:
                job.finished()
            else:
                job.array = None

        request.extra.cleanups.append(cleanup)
        request.extra.cleanups.append(self.leases.lease(host))
        return record

    def abandon(self) -> None:
        """The interpreter exits with copies in flight: the compiled engines are left as they are (never
        closed, never freed; the pure-Python lanes are daemon threads and need nothing)."""
        for engine in self.engines.values():
            abandon = getattr(engine, "abandon", None)
            if abandon is not None:
                abandon()

    @property
    def held_bytes(self) -> int:
        """Pinned bytes the lanes hold."""
        return sum(int(e.held_bytes) for e in self.engines.values())

    @property
    def abandoned_bytes(self) -> int:
        """Slots abandoned by failed DMAs."""
        return self._abandoned_before + sum(int(e.abandoned_bytes) for e in self.engines.values())

    def close(self) -> None:
        """Stop the lanes after their queued work and free their slots."""
        for engine in self.engines.values():
            engine.close()
            self._abandoned_before += engine.abandoned_bytes
        self.engines.clear()
        backend = self.completion.backend
        if self._order_stream is not None and self.completion.health.device_usable:
            with contextlib.suppress(DeviceError):
                backend.stream_destroy(self._order_stream)
        self._order_stream = None
