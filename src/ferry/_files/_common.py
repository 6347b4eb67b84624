"""What the checkpoint formats share: loading a file's tensors in one pass, saving them, the errors.

A load is all or nothing. Every tensor of a file is checked against the
file's size before anything is allocated; the device arrays are allocated,
then one file job (the compiled lanes', or the reader threads') reads the file once, in large
sequential reads, each chunk's bytes DMA'd to the tensors they belong to. The
arrays stay private to the load until it succeeded: when a read fails, the
file is cut short or changes size meanwhile, or the load is interrupted, every
array made for it goes back to the runtime's pool (only a failed DMA, which
the device may still be running, leaves them abandoned, as for every
transfer) and :class:`CheckpointError` names the file and the tensor.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import FerryError, TransferSubmitError
from .._routes._file import FileReadError, OpenFile, Piece, choose_direct, make_job, plan_for, span_of
from .._state import ABANDONED, IN_FLIGHT, OWNED
from ._dtypes import Kind, kind_of_dtype, kind_of_name

if TYPE_CHECKING:
    from .._device_array import DeviceArray
    from .._routes._file import FileJob, NativeFileJob
    from .._runtime import Runtime

    Job = FileJob | NativeFileJob

__all__ = ["CheckpointError"]

Progress = Callable[[int, int], Any]
LIBRARIES = ("torch", "cupy", "jax")
PROGRESS_PERIOD = 0.05


class CheckpointError(FerryError, ValueError):
    """A checkpoint file could not be read or written: a malformed header, a tensor past the end of the
    file, an unsupported dtype, a missing shard, a file that changed size during the load, a failed read.

    The message names the file and, where one is concerned, the tensor. Guarantee: nothing a failed load
    allocated stays allocated (unless the device itself failed a copy: then the arrays it may still touch
    are abandoned, as for every failed transfer).
    """


_DEFAULT: list[Any] = []
_DEFAULT_LOCK = threading.Lock()


def runtime_arg(runtime: Runtime | None) -> Runtime:
    """``runtime``, or the runtime ferry's file functions share (made on first use, closed at exit)."""
    from .._runtime import Runtime

    if runtime is not None:
        if not isinstance(runtime, Runtime):
            raise TypeError(f"runtime must be a ferry.Runtime, got {type(runtime).__name__}")
        return runtime
    with _DEFAULT_LOCK:
        if not _DEFAULT or _DEFAULT[0].closed:
            _DEFAULT[:] = [Runtime()]
            atexit.register(_DEFAULT[0].close)
        return _DEFAULT[0]  # type: ignore[no-any-return]


def to_arg(to: Any) -> str | None:
    """Check ``to=`` (None or a library name)."""
    if to is not None and to not in LIBRARIES:
        raise ValueError(f"to must be None or one of {LIBRARIES}, got {to!r}")
    return to  # type: ignore[no-any-return]


@dataclass(slots=True)
class Entry:
    """One tensor of a file: where its bytes are and what it becomes."""

    name: str
    offset: int  # absolute, in the file
    nbytes: int
    shape: tuple[int, ...]  # the shape the array gets (packed kinds: the bytes' shape)
    kind: Kind
    dtype: np.dtype[Any]  # what the device array carries


def _wait(job: Job, total: int, progress: Progress | None) -> None:
    """Wait for the job, reporting progress; Ctrl-C cancels it, waits for its readers, re-raises.

    The wait after a cancel outlasts a second Ctrl-C: until the job is done its readers (or lanes) may still
    read into the arrays and use the file, which the caller frees and closes once this returns or raises.
    """
    try:
        while not job.wait_done(PROGRESS_PERIOD):
            if progress is not None:
                progress(job.moved_bytes, total)
    except BaseException:
        job.cancel()
        while True:  # bounded: a cancelled job only finishes the chunks it has in flight
            try:
                if job.wait_done(PROGRESS_PERIOD):
                    break
            except KeyboardInterrupt:
                continue
        raise


def load_entries(
    runtime: Runtime, path: Any, entries: Sequence[Entry], *, expect_size: int | None, direct: bool | None,
    progress: Progress | None, done_before: int = 0, total: int | None = None,
) -> dict[str, DeviceArray]:
    """Read ``entries`` of the file at ``path`` into new device arrays, in one pass; see the module docstring.

    ``expect_size``: the size the file had when its header was read (a change meanwhile fails the load).
    """
    from .._runtime import parts_of

    parts = parts_of(runtime)
    name = os.fsdecode(path)
    try:
        opened = OpenFile(path, write=False)
    except TransferSubmitError as exc:
        raise CheckpointError(str(exc)) from None
    arrays: dict[str, DeviceArray] = {}
    total = sum(e.nbytes for e in entries) if total is None else total
    try:
        size = opened.size
        if expect_size is not None and size != expect_size:
            raise CheckpointError(f"{name!r} changed size during the load ({expect_size} -> {size} bytes)")
        for e in entries:
            if e.offset + e.nbytes > size:
                raise CheckpointError(
                    f"{name!r}: tensor {e.name!r} runs past the end of the file (bytes {e.offset} - "
                    f"{e.offset + e.nbytes}, the file holds {size})"
                )
        _allocate(runtime, parts, entries, arrays)
        pieces = [Piece(e.offset, e.nbytes, arrays[e.name]._ptr, e.name) for e in entries]
        use_direct = choose_direct(opened, direct, span_of(pieces))
        plan = plan_for(parts, pieces, upload=True, direct=use_direct)
        if use_direct:
            opened.open_direct(write=False)
        with parts.lock:
            parts.health.check_open()
            for array in arrays.values():
                array._state = IN_FLIGHT
            job = None
            try:
                job = make_job(parts, opened, plan, upload=True, direct=use_direct, close_file=False)
                job.start()
            except BaseException:  # refused: nothing was handed over
                if job is not None:
                    job._release(abandon=False)
                for array in arrays.values():
                    array._state = OWNED
                raise
        _finish(parts, job, arrays, name, lambda done, _: progress(done_before + done, total) if progress else None)
        try:
            now = opened.refresh_size()
        except OSError:
            now = -1
        if now != size:
            _free(arrays)
            raise CheckpointError(f"{name!r} changed size during the load ({size} -> {now} bytes)")
    except BaseException:
        _free(arrays)
        raise
    finally:
        opened.close()
    if progress is not None:
        progress(done_before + plan.nbytes, total)
    return arrays


def _allocate(runtime: Runtime, parts: Any, entries: Sequence[Entry], arrays: dict[str, DeviceArray]) -> None:
    """One new device array per entry into ``arrays``, as ``runtime.empty`` makes them, under one hold of the
    lock (a load makes hundreds: the checks ``empty`` repeats per call are made once). An allocation that
    fails raises with the arrays made so far in ``arrays`` (the caller frees them)."""
    from .._device_array import new_device_array

    memory = parts.memory
    parts.health.check_open()
    with parts.lock:
        if parts.completion.maintenance_due():
            parts.completion.maintain()
        for e in entries:
            nbytes = math.prod(e.shape) * e.dtype.itemsize
            arrays[e.name] = new_device_array(runtime, memory, memory.alloc(nbytes), e.shape, e.dtype, nbytes)


def _finish(parts: Any, job: Job, arrays: dict[str, DeviceArray], name: str, progress: Progress) -> None:
    """Wait for a load's job; hand the arrays back owned, or raise with them freed (or abandoned).

    An exception while waiting (Ctrl-C, or one raised by ``progress``) cancels the job, waits for its
    readers and propagates once the arrays are settled."""
    try:
        _wait(job, job.plan.nbytes, progress)
    finally:
        with parts.lock:
            device_failed = job.error is not None and not isinstance(job.error, FileReadError)
            for array in arrays.values():
                if device_failed:
                    array._state = OWNED  # so that abandon() counts it
                    parts.completion.abandon(array)
                elif array._state is IN_FLIGHT:
                    array._state = OWNED
            if device_failed:
                parts.health.note(job.error)  # type: ignore[arg-type]
                arrays.clear()  # abandoned: never freed
    if job.error is not None:
        raise CheckpointError(f"loading {name!r} failed: {job.error}")


def _free(arrays: dict[str, DeviceArray]) -> None:
    for array in arrays.values():
        if array._state is OWNED:
            with contextlib.suppress(FerryError):
                array.close()
    arrays.clear()


def convert(arrays: dict[str, DeviceArray], entries: Mapping[str, Entry], to: str | None) -> dict[str, Any]:
    """The arrays as ``to``'s arrays with the library's own dtypes (no copy; see ``_dtypes``)."""
    if to is None:
        return dict(arrays)
    library = import_library(to)
    out: dict[str, Any] = {}
    for key, array in arrays.items():
        kind = entries[key].kind
        if to == "torch":
            tensor = library.from_dlpack(array)
            if kind.torch is not None and not kind.packed and kind.carrier != kind.numpy:
                tensor = tensor.view(getattr(library, kind.torch))
            out[key] = tensor
        elif to == "cupy":
            out[key] = library.from_dlpack(array)
        else:
            value = library.dlpack.from_dlpack(array)
            if kind.jax is not None and not kind.packed and kind.carrier != kind.numpy:
                value = library.lax.bitcast_convert_type(value, getattr(library.numpy, kind.jax))
            out[key] = value
    return out


def check_library_kinds(to: str | None, entries: Sequence[Entry], name: str) -> None:
    """Refuse, before anything is read, a dtype the target library cannot hold."""
    if to is None:
        return
    library = import_library(to)
    for e in entries:
        kind = e.kind
        if kind.packed or kind.carrier == kind.numpy:
            continue
        if to == "cupy":
            raise CheckpointError(f"{name!r}: tensor {e.name!r} has dtype {kind.name}, which CuPy lacks; "
                                  "load it with to=None (ml_dtypes) or to='torch'")
        holder = library if to == "torch" else library.numpy
        attr = kind.torch if to == "torch" else kind.jax
        if attr is None or not hasattr(holder, attr):
            raise CheckpointError(f"{name!r}: tensor {e.name!r} has dtype {kind.name}, which this {to} lacks")


def import_library(to: str) -> Any:
    """The library ``to`` names (``jax`` with ``jax.dlpack``)."""
    if to == "jax":
        import jax
        import jax.dlpack
        import jax.numpy

        return jax
    return __import__(to)


# -- saving -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Source:
    """One tensor to save: its device bytes and what the file says of it."""

    name: str
    ptr: int
    nbytes: int
    shape: tuple[int, ...]
    kind: Kind
    owner: Any  # what keeps the memory alive (a DeviceArray is read-leased meanwhile)


def device_source(runtime: Runtime, name: str, value: Any) -> tuple[Source, Callable[[], None] | None]:
    """A tensor to save, read from device memory; the second item synchronizes its producer first."""
    from .._device_array import DeviceArray

    if isinstance(value, DeviceArray):
        problem = value._submission_problem(runtime, write=False)
        if problem:
            raise TransferSubmitError(f"tensor {name!r}: {problem}")
        return Source(name, value._ptr, value._nbytes, value.shape, kind_of_dtype(value.dtype), value), None
    module = type(value).__module__.split(".")[0]
    if module == "torch":
        if not value.is_cuda or value.device.index != runtime.device:
            raise TransferSubmitError(f"tensor {name!r} is not on cuda:{runtime.device}")
        if not value.is_contiguous():
            raise TransferSubmitError(f"tensor {name!r} is not contiguous")
        kind = kind_of_name("torch", str(value.dtype).removeprefix("torch."))
        torch = __import__("torch")
        return (Source(name, int(value.data_ptr()), int(value.nbytes), tuple(value.shape), kind, value),
                lambda: torch.cuda.current_stream(value.device).synchronize())
    if module == "cupy":
        if not value.flags.c_contiguous:
            raise TransferSubmitError(f"tensor {name!r} is not C-contiguous")
        cupy = __import__("cupy")
        return (Source(name, int(value.data.ptr), int(value.nbytes), tuple(value.shape), kind_of_dtype(value.dtype),
                       value), lambda: cupy.cuda.get_current_stream().synchronize())
    if module in ("jax", "jaxlib"):
        value.block_until_ready()
        kind = kind_of_name("jax", str(value.dtype)) if value.dtype.kind == "V" else kind_of_dtype(value.dtype)
        return (Source(name, int(value.unsafe_buffer_pointer()), int(value.nbytes), tuple(value.shape), kind, value),
                None)
    raise TransferSubmitError(
        f"tensor {name!r}: expected a ferry DeviceArray or a CUDA tensor of PyTorch, CuPy or JAX, "
        f"got {type(value).__name__}"
    )


def write_pieces(runtime: Runtime, path: Any, head: bytes, sources: Sequence[Source], offsets: Sequence[int],
                 end: int, *, progress: Progress | None = None) -> None:
    """Write ``head`` at byte 0 and each source's bytes at its offset; the file ends at ``end``.

    The file is written to a temporary name beside ``path`` and renamed over it once complete, so a
    failed save never leaves a truncated file under the name.
    """
    from .._device_array import DeviceArray
    from .._runtime import parts_of

    parts = parts_of(runtime)
    target = os.fsdecode(path)
    temp = f"{target}.ferry-{os.getpid()}-{threading.get_ident()}.tmp"
    leased: list[DeviceArray] = []
    try:
        opened = OpenFile(temp, write=True, create=True)
    except TransferSubmitError as exc:
        raise CheckpointError(str(exc).replace(temp, target)) from None
    try:
        os.ftruncate(opened.fd, end)
        os.pwrite(opened.fd, head, 0)
        pieces = [Piece(off, s.nbytes, s.ptr, s.name) for s, off in zip(sources, offsets, strict=True)]
        plan = plan_for(parts, pieces, upload=False)
        with parts.lock:
            parts.health.check_open()
            for s in sources:
                if isinstance(s.owner, DeviceArray):
                    problem = s.owner._submission_problem(runtime, write=False)
                    if problem:
                        raise TransferSubmitError(f"tensor {s.name!r}: {problem}")
            job = make_job(parts, opened, plan, upload=False, direct=False, close_file=False)
            try:
                job.start()  # under the lock: the leases below are taken before anyone looks
            except BaseException:  # refused: nothing was handed over
                job._release(abandon=False)
                raise
            for s in sources:
                if isinstance(s.owner, DeviceArray):
                    s.owner._leases += 1
                    leased.append(s.owner)
        try:
            _wait(job, plan.nbytes, progress)
        finally:
            with parts.lock:
                device_failed = job.error is not None and not isinstance(job.error, FileReadError)
                for array in leased:
                    array._leases -= 1
                    if device_failed and array._state is not ABANDONED:
                        parts.completion.abandon(array)
        if job.error is not None:
            raise CheckpointError(f"saving {target!r} failed: {job.error}".replace(temp, target))
        opened.close()
        os.replace(temp, target)
    except BaseException:
        opened.close()
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if progress is not None:
        progress(plan.nbytes, plan.nbytes)
