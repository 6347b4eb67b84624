"""The staged route on the compiled engine: the same plan as ``_staged.py``, on native threads.

``ferry._native._engine`` runs the staging lanes in C: each chunk's host copy,
DMA enqueue, event record and slot recycling happen on native threads that
never take the GIL (see the essay at the top of ``_native/core/lanes.c``). This module
adapts it to the route interface: Python hands over addresses, sizes and
strides, keeps the host array and the device memory alive until the job is
done, and learns the outcome from the job (one atomic load on the
``is_ready`` fast path).

Ordering. On CUDA the lanes' streams are real streams: a transfer whose
device side must wait for a producer makes those streams wait on the device
(``cuStreamWaitEvent``) before the job is submitted. A consumer (a hand-off,
a DLPack export with a stream, a later transfer of the same array) is
ordered after the whole job on the device too: a job is submitted with
``hand_off=True``, so each lane *posts* an event it records right after its
share's last DMA (one of the lane's own hand-off events, which no later chunk
records). :meth:`NativeEngine.order_after` joins them once: a private stream
waits for every posted event and records the job's one ``joined`` event,
which each consumer's stream then waits for. The host waits only until every
lane has *enqueued* its last DMA (the host copies are done; the DMAs may
still run), because an event stands for nothing before it is recorded, and
it waits without the runtime's lock (:meth:`NativeJob.wait_posted`); a
``ferry.prefetch`` batch uploaded a step ahead is long past that. Stream
memory operations (a ``cuStreamWaitValue32`` on words the lanes wrote) did
this until 2026-11-30; CUDA documents that the order they set is invisible
to its scheduler and may deadlock, and an H200 run hung where they were
used. On the emulated device the engine's streams are its own threads: a
job that must wait for a producer is submitted from the producer's
(emulated) stream once the producer's work ran, and a consumer's emulated
stream waits for the job on its worker thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._backends._base import DeviceError
from ._base import array_ptr

if TYPE_CHECKING:
    from types import ModuleType

    from .._backends._base import Backend

__all__: list[str] = []

_GIVE_BACK = threading.Lock()

# Spare CPUs a busy engine needs beside its lanes to run its driver thread and let waits poll: the
# caller's thread, the driver thread, one more for the rest of the process. Below that (CI's 2-CPU
# machines) spinning threads would take turns with the lanes, and a thread wake-up is cheaper.
_SPARE_CPUS = 3
WAIT_SPIN_US = 200.0  # a wait polls a job this long past its expected end (_native/engine.c: Job_wait), then sleeps
DRIVER_THREAD_ENV = "FERRY_DRIVER_THREAD"  # "0": never, "1": always, else by the CPU count


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_threads(lanes: int) -> tuple[bool, float]:
    """``(driver_thread, wait_spin_us)`` for an engine of ``lanes`` lanes on this machine.

    With at least ``lanes + 3`` usable CPUs (the process's affinity) one driver thread makes every
    enqueue of the lanes (their own calls, right after a chunk's host copy, cost 4 - 8x as much on the
    H200 VM: see ``_native/core/driver.c``) and a ``wait()`` polls its job until its expected end and
    ``WAIT_SPIN_US`` more before sleeping (a thread wake-up there costs 30 - 60 us). With fewer CPUs
    the lanes call the driver themselves and waits sleep at once.
    ``FERRY_DRIVER_THREAD=0`` or ``1`` decides instead of the CPU count.
    """
    forced = os.environ.get(DRIVER_THREAD_ENV, "").strip()
    roomy = forced == "1" if forced in ("0", "1") else usable_cpus() >= lanes + _SPARE_CPUS
    return roomy, WAIT_SPIN_US if roomy else 0.0


class NativeJob:
    """One staged transfer on the compiled engine, seen through the completion ``Job`` protocol.

    On the emulated device the engine job may start later (after a producer
    ran on its stream): until then the job is not done.
    """

    __slots__ = ("_done_with", "_error", "_inner", "_release", "_started", "array", "device_ptr", "joined", "nbytes")

    def __init__(self, array: np.ndarray[Any, Any], device_ptr: int, nbytes: int) -> None:
        self.array: Any = array  # kept alive until the record settles
        self.device_ptr = device_ptr
        self.nbytes = nbytes
        self._inner: Any = None
        self._error: DeviceError | None = None
        self._started: threading.Event | None = None  # set up when the job starts later (emulated)
        self._release: Any = None  # the emulated device's use count, given back once done
        self.joined: Any = None  # CUDA: one event standing for all the job's DMAs (NativeEngine.order_after)
        self._done_with: Any = None  # gives `joined` back (set with it)

    def _start(self, inner: Any) -> None:
        self._inner = inner
        if self._started is not None:
            self._started.set()

    def _fail_to_start(self, error: DeviceError) -> None:
        self._error = error
        if self._started is not None:
            self._started.set()

    def wait_posted(self) -> None:
        """Sleep (no lock held, interruptibly) until every lane of a CUDA job has enqueued its last
        DMA, so that :meth:`NativeEngine.order_after` then does not wait under the runtime's lock.
        At once for a job that posts nothing (the emulated device), finished, or never started."""
        inner = self._inner
        if inner is None or self.array is None:
            return
        with contextlib.suppress(RuntimeError):  # the engine closed meanwhile: the caller sees the runtime closed
            inner.hand_off()

    def dmas_complete(self) -> bool:
        """Whether the job is done: every DMA completed, or it failed (its record reports that).
        Either way nothing on the device is left to order a stream after. Never blocks."""
        inner = self._inner
        return inner is not None and bool(inner.done())

    def is_done(self) -> bool:
        """Whether the job finished (its DMAs complete, or it failed). Never blocks."""
        inner = self._inner
        if inner is None:
            return self._error is not None
        if inner.done():
            self._give_back()
            return True
        return False

    def wait_done(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Sleep (GIL released, signals checked) until done or ``timeout`` seconds passed; with
        ``poll`` the compiled job may poll first (``Job.wait``), without it it sleeps at once."""
        if self._inner is None:
            started = self._started
            if started is not None and not started.wait(timeout):
                return False
            if self._inner is None:
                return True  # failed to start
        if self._inner.wait(timeout, poll=poll):
            self._give_back()
            return True
        return False

    def _give_back(self) -> None:
        """The DMAs are complete: the emulated device's use count goes back at once (the memory
        may be freed from now on, before the record is settled). A failed job keeps it: the
        device may still touch its memory."""
        if self._release is not None and self.error is None:
            # once, inside the lock: neither caller may report "done" before the use is given back
            with _GIVE_BACK:
                if self._release is not None:
                    self._release()
                    self._release = None

    @property
    def error(self) -> DeviceError | None:
        """The first device error, or ``None`` (only meaningful once done)."""
        if self._error is None and self._inner is not None:
            failure = self._inner.error
            if failure is not None:
                code, text, sticky = failure
                self._error = DeviceError(f"staging failed: {text}", code=int(code), sticky=bool(sticky))
        return self._error

    @property
    def host_bytes(self) -> int:
        """Bytes the host copied for this job."""
        return int(self._inner.host_bytes) if self._inner is not None else 0

    def finished(self) -> None:
        """The record left flight: drop the array, give the emulated use back, destroy the join
        event (waits already made on it keep what they captured)."""
        self.array = None
        with _GIVE_BACK:
            if self._release is not None:
                self._release()
                self._release = None
            joined, done_with = self.joined, self._done_with
            self.joined = self._done_with = None
        if joined is not None:
            with contextlib.suppress(DeviceError):  # a dead context: nothing left to give back
                done_with(joined)


class LaneConfig(Protocol):
    """What the compiled lanes read of a :class:`~ferry.StagingConfig` (``_staged.py``, which picks the engine)."""

    @property
    def lanes(self) -> int:
        """Lanes per direction."""
        ...

    @property
    def slots_per_lane(self) -> int:
        """Pinned slots per lane."""
        ...

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot."""
        ...

    @property
    def min_chunk_bytes(self) -> int:
        """The smallest chunk."""
        ...

    @property
    def cooperative_max_bytes(self) -> int:
        """The largest cooperative upload."""
        ...

    def lane_helper_count(self) -> int:
        """The idle lanes that help a cooperative job's lead copy."""
        ...


class NativeEngine:
    """The compiled lanes of one direction behind the staging-engine interface of ``_staged.py``."""

    def __init__(self, module: ModuleType, backend: Backend, config: LaneConfig, direction: str) -> None:
        self.backend = backend
        self.direction = direction
        self.cuda = backend.name == "cuda"
        driver_thread, wait_spin_us = engine_threads(config.lanes)
        options: dict[str, Any] = {
            "lanes": config.lanes, "slots_per_lane": config.slots_per_lane, "slot_bytes": config.slot_bytes,
            "min_chunk_bytes": min(config.min_chunk_bytes, config.slot_bytes),
            "driver_thread": driver_thread, "wait_spin_us": wait_spin_us,
            # uploads only: see StagingConfig.lane_helpers
            "helpers": config.lane_helper_count() if direction == "upload" else 0,
            "cooperative_max_bytes": config.cooperative_max_bytes,
        }
        if self.cuda:
            from cuda.bindings import driver

            from .._native import cuda_entry_points

            context = backend.native_context()  # type: ignore[attr-defined]
            self.engine = module.Engine(direction, mode="cuda", context=context,
                                        entry_points=cuda_entry_points(driver), **options)
        else:
            self.engine = module.Engine(direction, mode="emulated", bandwidth=backend.bandwidth,  # type: ignore[attr-defined]
                                        latency=backend.latency, **options)  # type: ignore[attr-defined]
        self._streams: list[Any] | None = None
        self._join: Any = None  # CUDA: the stream on which a job's posted events become one event

    # -- the staging-engine interface ---------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Pinned bytes the lanes' slots hold."""
        return int(self.engine.held_bytes)

    @property
    def abandoned_bytes(self) -> int:
        """Slots a failed DMA may still touch: never reused."""
        return int(self.engine.abandoned_bytes)

    def streams(self) -> list[Any]:
        """The lanes' streams as backend streams (CUDA); none on the emulated device (see the module essay)."""
        if self._streams is None:
            backend = self.backend
            self._streams = [backend.stream_from_handle(h) for h in self.engine.streams()] if self.cuda else []
        return self._streams

    def hold(self) -> None:
        """Start no new DMA until :meth:`release` (for ``ferry.testing.hold``)."""
        self.engine.hold()

    def release(self) -> None:
        """Lift :meth:`hold`."""
        self.engine.release()

    def submit(self, array: np.ndarray[Any, Any], device_ptr: int, after: Any = None) -> NativeJob:
        """Queue ``array`` <-> ``[device_ptr, ...)``; returns at once.

        ``after``: on the emulated device, the producer stream the job must
        follow (the job is submitted from that stream's worker once its queued
        work ran); ``None`` submits now.
        """
        nbytes = int(array.nbytes)
        job = NativeJob(array, device_ptr, nbytes)
        backend = self.backend
        target = device_ptr
        if not self.cuda:
            self._arm_fault()
            target = backend.native_target(device_ptr, nbytes)  # type: ignore[attr-defined]
            job._release = lambda: backend.native_release(device_ptr, nbytes)  # type: ignore[attr-defined]
        host = array_ptr(array)
        shape, strides, itemsize = tuple(array.shape), tuple(array.strides), int(array.itemsize)
        engine = self.engine
        hand_off = self.cuda

        def start() -> None:
            try:
                job._start(engine.submit(host, target, nbytes, shape, strides, itemsize, hand_off=hand_off))
            except Exception as exc:  # a closed or poisoned engine: the job fails, nothing runs
                job._fail_to_start(DeviceError(f"staging could not start: {exc}"))

        if after is None:
            start()
        else:
            job._started = threading.Event()
            backend.stream_wait_host(after, start)  # type: ignore[attr-defined]
        return job

    def _arm_fault(self) -> None:
        take = getattr(self.backend, "take_armed_fault", None)
        armed = take() if take is not None else None
        if armed is not None:
            after, sticky = armed
            self.engine.fail_next_copy(after, sticky=sticky)

    def order_after(self, job: NativeJob, stream: Any) -> None:
        """Order ``stream`` (a backend stream) after the whole job, on the device.

        On CUDA, a job already done needs no ordering (its DMAs completed, or
        it failed and its record says so): nothing is enqueued, which is the
        common case of a batch uploaded ahead. Otherwise, the first time, a
        private *join* stream waits for the event each lane posted after its
        last DMA (the host waits, interruptibly, only until the lanes have
        enqueued those DMAs) and records one event, the job's ``joined``
        event; every stream ordered after the job then
        waits for that one event (a consumer's stream is ordered once per
        hand-off and again per DLPack export: one wait each, not one per
        lane). A job that failed before its last DMAs is waited for on the
        host (its record reports the failure). On the emulated device the
        stream's worker waits for the job. Lock held by the caller (the
        engine stays open meanwhile).
        """
        backend = self.backend
        if not self.cuda:
            backend.stream_wait_host(stream, partial(job.wait_done, poll=False))  # type: ignore[attr-defined]
            return
        inner = job._inner
        if inner is None or job.array is None:  # it failed to start, or finished: nothing runs
            return
        if job.joined is None and job.dmas_complete():
            return  # done already (a prefetched batch, usually): no device wait, no join
        if job.joined is None:
            events = inner.hand_off()
            if len(events) < inner.lanes:  # a share never enqueued its last DMA: the job failed
                job.wait_done()
                return
            if self._join is None:
                self._join = backend.stream_create()
            event = backend.event_create()
            try:
                backend.stream_wait_events(self._join, events)  # type: ignore[attr-defined]
                backend.event_record(event, self._join)
            except BaseException:
                backend.event_destroy(event)
                raise
            with _GIVE_BACK:
                if job.array is None or job.joined is not None:  # finished meanwhile, or joined by another thread
                    backend.event_destroy(event)
                else:
                    job.joined, job._done_with = event, backend.event_destroy
        with _GIVE_BACK:  # finished() cannot destroy the event under this wait
            if job.joined is not None:
                backend.stream_wait_event(stream, job.joined)
            # else: the record left flight, so the job's DMAs are complete

    def abandon(self) -> None:
        """The interpreter exits with copies in flight: the lanes are never joined and nothing is freed
        (a lane's free of its slots would wait for the device, which a held copy keeps busy)."""
        self.engine.abandon()

    def close(self) -> None:
        """Wait for queued jobs, stop the lanes, free the slots (and the join stream)."""
        self.engine.close()
        join, self._join = self._join, None
        if join is not None:
            with contextlib.suppress(DeviceError):  # a dead context: the stream went with it
                self.backend.stream_destroy(join)
