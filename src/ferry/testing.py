"""Public test helpers: gates, fault injection and leak counters.

These let a test observe what is otherwise a race: :func:`hold` keeps a copy
stream from running (on CUDA with ``cuStreamWaitValue32`` on mapped pinned
memory, on the emulated device with a blocked worker), so "not ready" is
deterministic; :func:`fail_next_copy` makes the emulated device fail a copy the
way CUDA reports an asynchronous error; :func:`live_objects` counts what is
alive so a test can prove nothing leaked.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._errors import FerryError
from ._pending import _Pending
from ._runtime import Runtime, parts_of

__all__ = [
    "hold",
    "fail_next_copy",
    "violations",
    "host_waits",
    "live_objects",
    "side_stream",
    "produce",
    "consume",
    "Read",
    "ForeignArray",
    "backend_of",
    "abandoned_objects",
    "fast_path_counts",
]

_DIRECTIONS = ("upload", "download", "both")


@contextmanager
def hold(runtime: Runtime, direction: str = "both") -> Iterator[None]:
    """Hold the runtime's copy stream(s) until the ``with`` block exits.

    Work submitted inside the block is queued behind the gate and cannot
    complete until the block exits, so ``is_ready()`` is observably ``False``.
    The staging lanes of that direction (pageable routes) are held too.
    Do not ``wait()`` inside the block: the wait would never return. On CUDA
    the same holds for handing off, exporting through DLPack with a stream, or
    downloading a *staged* upload of that direction (a pageable array larger
    than ``StagingConfig.direct_bytes`` on the native engine): each waits on
    the host for the upload.

    Parameters
    ----------
    direction
        ``"upload"``, ``"download"`` or ``"both"``.
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")
    parts = parts_of(runtime)
    parts.health.check_open()
    backend = parts.backend
    streams = []
    held: list[Any] = []  # native staging engines, held and released as a whole
    with parts.lock:
        for upload, name in ((True, "upload"), (False, "download")):
            if direction not in (name, "both"):
                continue
            streams.append(parts.h2d if upload else parts.d2h)
            engine = parts.staged.engine(upload)
            if hasattr(engine, "hold"):
                engine.hold()
                held.append(engine)
            else:
                streams.extend(engine.streams())
    gate = backend.gate_create()
    try:
        for stream in streams:
            backend.stream_wait_gate(stream, gate)
        yield
    finally:
        backend.gate_open(gate)
        for engine in held:
            engine.release()


def fail_next_copy(runtime: Runtime, *, sticky: bool = False, after: int = 0) -> None:
    """Make the next device copy fail when it completes (emulated device only).

    ``after`` copies are let through first, so a chunked transfer can be made
    to fail in the middle. With ``sticky=True`` the failure also poisons the
    device context, as a CUDA sticky error does: every later call fails.
    """
    backend = parts_of(runtime).backend
    if not hasattr(backend, "fail_next_copy"):
        raise FerryError(f"fault injection needs the emulated device, not {runtime.backend}")
    backend.fail_next_copy(sticky=sticky, after=after)


def backend_of(runtime: Runtime) -> Any:
    """The runtime's device backend (the ``Backend`` protocol object), for tests and probes."""
    return parts_of(runtime).backend


def fast_path_counts(runtime: Runtime) -> dict[str, int]:
    """How often the small-transfer fast paths ran, for tests and probes.

    ``small_uploads``/``small_downloads``: transfers the small pageable route
    carried; ``small_upload_slots``/``small_download_slots``: its pinned slots
    now. ``batches``/``batched_copies``: device batch submissions of
    ``rt.batch()`` segments and the copies they carried (the emulated device
    counts every ``copy_batch``; CUDA counts ``cuMemcpyBatchAsync`` calls).
    With CUDA's compiled path also ``copies`` (copies enqueued one call each)
    and ``waits`` (event waits).
    """
    parts = parts_of(runtime)
    counts = dict(parts.host.small.counts())
    backend = parts.backend
    native = getattr(backend, "fast_path_counts", None)
    extra = native() if native is not None else {}
    counts["batches"] = int(extra.get("batches", getattr(backend, "batches", 0)))
    counts["batched_copies"] = int(extra.get("batched_copies", getattr(backend, "batched_copies", 0)))
    for key in ("copies", "waits"):
        if key in extra:
            counts[key] = int(extra[key])
    return counts


def abandoned_objects(runtime: Runtime) -> list[Any]:
    """Every object abandoned by a failed transfer of this runtime (kept forever)."""
    return [o for r in parts_of(runtime).completion.abandoned for o in r.moved + r.leased]


def violations(runtime: Runtime) -> list[str]:
    """Invariant violations the emulated device recorded (memory freed while a
    queued operation touched it, ...). Always empty on CUDA."""
    return list(getattr(parts_of(runtime).backend, "violations", []))


def host_waits(runtime: Runtime) -> int:
    """How many host-blocking synchronizations the backend performed so far."""
    return int(getattr(parts_of(runtime).backend, "sync_calls", 0))


def live_objects(runtime: Runtime) -> dict[str, Any]:
    """Counts of what is alive, after a full garbage collection.

    Keys: ``buffers`` and ``arrays`` (objects of this runtime not yet
    collected), ``handles`` (pending handles of this runtime), ``in_flight``,
    ``retiring`` and ``abandoned`` (records).
    """
    gc.collect()
    parts = parts_of(runtime)
    handles = sum(
        1 for obj in gc.get_objects() if isinstance(obj, _Pending) and obj._port is parts.completion
    )
    stats = runtime.stats()
    return {
        "buffers": len(parts.buffers),
        "arrays": len(parts.memory.arrays),
        "handles": handles,
        "in_flight": stats.in_flight,
        "retiring": stats.retiring,
        "abandoned": stats.abandoned,
    }


# -- a producer and a consumer on their own streams (emulated device) --------------------------------


def side_stream(runtime: Runtime) -> int:
    """A new stream of the runtime's device, as the integer handle other libraries use."""
    parts = parts_of(runtime)
    parts.health.check_open()
    backend = parts.backend
    stream = backend.stream_create()
    parts.side_streams.append(stream)
    return int(backend.stream_handle(stream))


def _emulated(runtime: Runtime) -> Any:
    backend = parts_of(runtime).backend
    if not hasattr(backend, "enqueue_fill"):
        raise FerryError(f"simulated producers and consumers need the emulated device, not {runtime.backend}")
    return backend


def produce(runtime: Runtime, stream: int, ptr: int, nbytes: int, value: int, *, delay: float = 0.05,
            fail: bool = False) -> None:
    """A stand-in for a producer kernel on ``stream``: after ``delay`` seconds it fills
    ``nbytes`` of device memory at ``ptr`` with ``value`` (emulated device). With
    ``fail=True`` the producer fails instead, as a faulting kernel would."""
    backend = _emulated(runtime)
    backend.enqueue_fill(backend.stream_from_handle(stream), ptr, nbytes, value, delay, fail=fail)


class Read:
    """A consumer's read enqueued on a stream (see :func:`consume`)."""

    def __init__(self, backend: Any, stream: Any, out: Any) -> None:
        self._backend = backend
        self._stream = stream
        self._out = out
        self._ran = threading.Event()
        stream.submit(self._ran.set)  # runs right after the read, in stream order

    def ran(self) -> bool:
        """Whether the read has run (never blocks)."""
        return self._ran.is_set()

    def result(self) -> Any:
        """Wait for the consumer's stream only; the bytes the read saw."""
        self._backend.stream_synchronize(self._stream)
        return self._out


def consume(runtime: Runtime, stream: int, ptr: int, nbytes: int) -> Read:
    """A stand-in for a consumer kernel on ``stream``: enqueue a read of ``nbytes`` of device
    memory at ``ptr`` in stream order (emulated device)."""
    import numpy as np

    backend = _emulated(runtime)
    target = backend.stream_from_handle(stream)
    out = np.full(nbytes, 0xEE, np.uint8)
    backend.memcpy_dtoh(int(out.ctypes.data), ptr, nbytes, target)
    return Read(backend, target, out)


class ForeignArray:
    """A device array "of another library": it exposes only the CUDA Array Interface
    (version 3, with the producer's stream), over memory that ``owner`` keeps alive."""

    def __init__(self, owner: Any, *, stream: int | None, readonly: bool = False,
                 strides: tuple[int, ...] | None = None) -> None:
        self.owner = owner
        interface = dict(owner.__cuda_array_interface__)
        interface["stream"] = stream
        interface["data"] = (interface["data"][0], readonly)
        interface["strides"] = strides
        self.__cuda_array_interface__ = interface
