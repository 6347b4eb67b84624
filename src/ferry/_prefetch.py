"""``ferry.prefetch``: host batches in, device batches out, uploads kept in flight ahead of the consumer.

What one batch goes through
---------------------------
A batch is a NumPy array, or tuples, lists and dicts of them (nested as a
PyTorch ``DataLoader`` yields them; CPU tensors of any DLPack library come in
through ``numpy.from_dlpack``; strings, numbers and ``None`` pass through).
Each array leaf is uploaded with :meth:`Runtime.upload` into a fresh device
array from the runtime's stream-ordered pool. ``depth`` batches are kept
uploading while the consumer works on the current one.

Ordering without host waits
---------------------------
When a batch is yielded, its uploads are handed off
(:meth:`PendingUpload.hand_off`) to the consumer's stream: ``stream=`` if
given, else the current stream of the library named by ``to``
(``torch.cuda.current_stream()``, ``cupy.cuda.get_current_stream()``), read
at each step. The stream waits for the copy on the device; the host does
not (for a staged upload on CUDA, only until its lanes have enqueued their
last chunks, which has usually happened by then: it ran while earlier batches
were consumed).
With no stream known (``to=None`` or ``"jax"`` and no ``stream=``) the
arrays are handed off unattached: a consumer taking them through DLPack
is ordered by ``__dlpack__(stream=...)``, one reading the CUDA Array
Interface by its ``stream`` field, ferry's own transfers by ferry.

A staged upload (larger than ``StagingConfig.direct_bytes``) is handed off
on the native engine. On the pure-Python engine ``hand_off`` raises and prefetch
orders the consumer after the upload by waiting for it on a background
thread (the runtime's watcher, through :meth:`PendingUpload.future`, started
as soon as such an upload is submitted): the consumer's thread waits only
if that upload is still running when its batch is due.

Memory
------
The consumer's stream is recorded on every array of the batch, so when the
consumer drops the batch its memory returns to the pool after the work the
consumer queued on it (an event on that stream, a stream-ordered free):
nothing is freed early, and the pool's reserved memory stays bounded by the
batches alive plus those whose consumer work still runs. ferry keeps each
yielded batch's upload handles until their copies are proven complete (an
event query at each later step), so an upload that fails on the device after
it was handed off still raises :class:`~ferry.PrefetchError` with its index.

Stopping
--------
Exhaustion, ``break``, an exception in the loop body, :meth:`Prefetcher.close`
and closing the runtime all stop it the same way: the uploads not yet yielded
are dropped (they retire: their memory is freed once their copies are
proven complete, never early, never blocking), the source is closed if it is a
generator, and a runtime that prefetch created itself is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import numpy as np

from . import _lifecycle
from ._backends._base import DeviceError
from ._device_array import DeviceArray
from ._errors import FerryError, PrefetchError, RuntimeClosedError, TransferFailedError
from ._interop._cai import stream_handle_of
from ._interop._foreign import check_torch_has_cuda, torch_current_stream
from ._runtime import Runtime, parts_of
from ._structure import Builder, take_apart

__all__ = ["prefetch", "Prefetcher"]

_TOKEN = object()
_LIBRARIES = ("torch", "cupy", "jax")


class _Flight:
    """One batch: its uploads, or why it has none."""

    __slots__ = ("build", "error", "handles", "index", "waits")

    def __init__(self, index: int) -> None:
        self.index = index
        self.build: Builder = list
        self.handles: list[Any] = []  # the batch's PendingUploads
        self.waits: set[int] = set()  # leaves ordered by a host-side wait instead of a hand-off
        self.error: BaseException | None = None  # raised when the consumer reaches this batch


class Prefetcher:
    """The iterator :func:`ferry.prefetch` returns: ``for``, ``async for``, ``with``, ``close()``.

    Create it with :func:`ferry.prefetch`.
    """

    def __init__(
        self,
        batches: Iterable[Any] | AsyncIterable[Any],
        depth: int,
        runtime: Runtime | None,
        to: str | Callable[[DeviceArray], Any] | None,
        stream: Any,
        *,
        _token: object = None,
    ) -> None:
        if _token is not _TOKEN:
            raise TypeError("a Prefetcher is made by ferry.prefetch(batches, ...)")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"runtime must be a ferry.Runtime, got {type(runtime).__name__}")
        if stream is not None:
            stream_handle_of(stream)  # TypeError now, not at the first batch
        self._library: Any = None
        if isinstance(to, str):
            if to not in _LIBRARIES:
                raise ValueError(f"to must be None, one of {_LIBRARIES} or a callable, got {to!r}")
            self._library = _import(to)
            if to == "torch":
                check_torch_has_cuda(self._library)
        elif to is not None and not callable(to):
            raise TypeError(f"to must be None, one of {_LIBRARIES} or a callable, got {type(to).__name__}")
        self._sync_source: Iterator[Any] | None = None
        self._async_source: AsyncIterator[Any] | None = None
        if isinstance(batches, Iterable):
            self._sync_source = iter(batches)
        elif isinstance(batches, AsyncIterable):
            self._async_source = aiter(batches)
        else:
            raise TypeError(f"batches must be iterable, got {type(batches).__name__}")
        self._source_object = batches
        self._owns = runtime is None
        self._rt = Runtime() if runtime is None else runtime
        self._depth = depth
        self._to = to
        self._stream = stream
        self._queue: deque[_Flight] = deque()  # submitted, not yet yielded
        self._unconfirmed: deque[_Flight] = deque()  # yielded, copies not yet proven complete
        self._next_index = 0
        self._exhausted = False
        self._closed = False
        self._wait_staged = False  # hand_off of a staged upload raised: wait for those instead
        parts = parts_of(self._rt)
        self._direct_bytes = parts.staging.direct_bytes
        self._backend = parts.backend
        self._limit = depth + 1  # batches the host may be ahead of the uploads, and of the consumer
        self._marks: deque[Any] = deque()  # events on the consumer's stream, oldest first
        self._yielded = 0
        self._spare: list[Any] = []

    # -- the iterator protocols ------------------------------------------------------------------
    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        flight: Any = self._take()
        devices: Any = None
        try:
            stream = self._consumer_stream()
            self._pace(stream)
            if type(flight) is self._whole_flight:
                return self._hand_over(flight, stream)
            devices, wait = self._hand_off(flight, stream)
            for i in wait:  # the watcher has been waiting for these in the background
                devices[i] = flight.handles[i].wait()[1]
            return self._finish(flight, devices, stream)
        except BaseException as exc:
            error = self._stopped_by(flight, exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            flight = devices = None  # a traceback may keep this frame: it must not keep the batch

    def __aiter__(self) -> Prefetcher:
        return self

    async def __anext__(self) -> Any:
        try:
            with contextlib.suppress(RuntimeClosedError):  # then _take stops
                await self._afill()
            flight: Any = self._take(fill=False)
        except StopIteration:
            raise StopAsyncIteration from None
        devices: Any = None
        try:
            stream = self._consumer_stream()
            await self._apace(stream)
            devices, wait = self._hand_off(flight, stream)
            for i in wait:  # asyncio: the loop runs while the watcher waits
                devices[i] = (await flight.handles[i])[1]
            return self._finish(flight, devices, stream)
        except BaseException as exc:
            error = self._stopped_by(flight, exc)
            if isinstance(error, StopIteration):
                raise StopAsyncIteration from None
            if error is exc:
                raise
            raise error from exc
        finally:
            flight = devices = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Prefetcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        """The number of batches, when the iterable given has a length."""
        return len(self._source_object)  # type: ignore[arg-type]

    @property
    def runtime(self) -> Runtime:
        """The runtime the uploads go through (the one prefetch created, with ``runtime=None``)."""
        return self._rt

    @property
    def closed(self) -> bool:
        """Whether it stopped (exhausted, closed, failed, or its runtime closed)."""
        return self._closed

    def close(self) -> None:
        """Stop: drop the uploads not yet yielded (they retire; nothing blocks, nothing is freed
        early), close the source if it is a generator, and close the runtime prefetch created.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.clear()  # the handles retire
        self._unconfirmed.clear()
        self._release_marks()
        source = self._sync_source or self._async_source
        self._sync_source = self._async_source = None
        closer = getattr(source, "close", None)
        if closer is not None:
            try:
                closer()
            except Exception as exc:  # the source's own error: said, and the runtime still closed
                _lifecycle.report(f"closing the batches' source failed: {exc!r}")
        if self._owns:
            self._rt.close()

    def __del__(self) -> None:
        # never blocks: a runtime prefetch created is closed on a background thread
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        try:
            self._queue.clear()
            self._unconfirmed.clear()
            self._release_marks()
            self._closed = True
            if self._owns and not _lifecycle.exiting():  # exiting: the exit hook closes the runtime
                thread = threading.Thread(target=_close_quietly, args=(self._rt,), name="ferry-prefetch-close",
                                          daemon=True)
                with contextlib.suppress(RuntimeError):  # "can't create new thread at interpreter shutdown"
                    thread.start()
        except Exception as exc:  # a finalizer never raises: say it
            _lifecycle.report(f"dropping a prefetcher failed: {exc!r}")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._queue)} in flight"
        return f"<ferry.Prefetcher depth {self._depth} next batch {self._next_index - len(self._queue)} {state}>"

    # -- one step ------------------------------------------------------------------------------------
    def _take(self, fill: bool = True) -> _Flight:
        """The next batch to yield, its uploads submitted, after confirming the earlier ones.

        At the end (exhausted, closed, the runtime closed) it closes and raises StopIteration; a
        batch that failed raises its error, and closes.
        """
        if self._closed:
            raise StopIteration
        try:
            if self._rt.closed:
                raise _EndError
            if fill:
                self._fill()
            if not self._queue:
                raise _EndError
            error = self._queue[0].error
            if error is not None:
                raise error
            return self._queue.popleft()  # (no local keeps it: see __next__)
        except BaseException as exc:
            self.close()
            if isinstance(exc, _EndError | RuntimeClosedError):
                raise StopIteration from None
            raise

    def _stopped_by(self, flight: _Flight, exc: BaseException) -> BaseException:
        """An exception while handing a batch over: stop, and say what the consumer should see."""
        self.close()
        if isinstance(exc, RuntimeClosedError):
            return StopIteration()
        if isinstance(exc, TransferFailedError):
            return PrefetchError(f"batch {flight.index} failed on the device: {exc}", flight.index)
        return exc

    def _fill(self) -> None:
        source = self._sync_source
        if source is None and self._async_source is not None:
            raise TypeError("this prefetch reads an async iterable: iterate it with `async for`")
        # depth + 1: the batch about to be yielded, and depth uploading while it is consumed (filled
        # before the head is taken, so no frame holds a yielded batch while the source runs)
        while not self._exhausted and len(self._queue) <= self._depth and source is not None:
            index = self._next_index
            try:
                batch = next(source)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as exc:  # the source's own error: raised, as it is, at its position
                self._exhausted = True
                self._queue.append(self._failed(index, exc, wrap=False))
                return
            self._queue.append(self._submit(index, batch))

    async def _afill(self) -> None:
        if self._closed or self._rt.closed:
            return
        if self._async_source is None:
            self._fill()
            return
        while not self._exhausted and len(self._queue) <= self._depth:
            index = self._next_index
            try:
                batch = await self._async_source.__anext__()
            except StopAsyncIteration:
                self._exhausted = True
                return
            except Exception as exc:
                self._exhausted = True
                self._queue.append(self._failed(index, exc, wrap=False))
                return
            self._queue.append(self._submit(index, batch))

    def _failed(self, index: int, exc: BaseException, *, wrap: bool) -> _Flight:
        """A batch that failed, kept for the consumer at its position.

        The error outlives the frames it passed through, and CPython keeps a finished frame's
        locals and its callers (``f_back``): a traceback kept here would keep earlier batches. So
        ferry's own error keeps its message and no traceback, and the source's error keeps only
        its own frames.
        """
        self._next_index = index + 1
        flight = _Flight(index)
        if wrap:
            chained: BaseException | None = exc
            while chained is not None:
                chained.__traceback__ = None
                chained = chained.__cause__ or chained.__context__
            error = PrefetchError(f"batch {index} could not be uploaded: {exc}", index)
            error.__cause__ = exc
            flight.error = error
        else:
            if exc.__traceback__ is not None:
                exc.__traceback__ = exc.__traceback__.tb_next  # from the source's frame down
            flight.error = exc
        return flight

    def _submit(self, index: int, batch: Any) -> _Flight:
        """Upload every array of one batch (a failure is kept for the consumer, at its index)."""
        arrays: list[np.ndarray[Any, Any]] = []
        try:
            build = take_apart(batch, arrays)
        except (TypeError, ValueError, BufferError) as exc:
            return self._failed(index, exc, wrap=True)
        self._next_index = index + 1
        flight = _Flight(index)
        flight.build = build
        rt = self._rt
        try:
            for array in arrays:
                handle = rt.upload(array)
                if self._wait_staged and array.nbytes > self._direct_bytes:
                    handle.future()  # the watcher waits for it in the background from now on
                    flight.waits.add(len(flight.handles))
                flight.handles.append(handle)
        except RuntimeClosedError:
            raise
        except (FerryError, MemoryError, TypeError, ValueError) as exc:
            flight.handles.clear()  # the uploads already submitted retire (the error's frames keep flight)
            return self._failed(index, exc, wrap=True)
        return flight

    def _hand_off(self, flight: _Flight, stream: Any) -> tuple[list[Any], list[int]]:
        """Hand the batch's uploads to the consumer's stream: the device arrays (None where a
        leaf must be waited for instead) and those leaves."""
        devices: list[Any] = []
        wait = []
        for i, handle in enumerate(flight.handles):
            device = None
            if i not in flight.waits:
                try:
                    device = handle.hand_off(stream)
                except (TransferFailedError, RuntimeClosedError):
                    raise
                except FerryError:  # a staged upload the engine cannot hand off: wait for those from now on
                    self._wait_staged = True
                    flight.waits.add(i)
            if device is None:
                wait.append(i)
            devices.append(device)
        return devices, wait

    def _finish(self, flight: _Flight, devices: list[DeviceArray], stream: Any) -> Any:
        """The batch on the device, the consumer's stream recorded, converted as ``to`` asks."""
        leaves = []
        for i, device in enumerate(devices):
            if i in flight.waits and stream is not None:
                device.record_stream(stream)  # the consumer's work on it precedes its free
            leaves.append(self._convert(device, stream))
        self._yielded += 1
        handed = [h for i, h in enumerate(flight.handles) if i not in flight.waits]
        if handed:  # proven complete (or failed) at a later step
            confirm = _Flight(flight.index)
            confirm.handles = handed
            self._unconfirmed.append(confirm)
        return flight.build(leaves)

    def _settle(self) -> deque[_Flight]:
        """Settle the yielded batches whose copies completed, oldest first (never blocks); the rest.

        Raises PrefetchError for a yielded batch whose copy failed.
        """
        queue = self._unconfirmed
        while queue:
            flight = queue[0]
            handles = flight.handles
            while handles:
                handle = handles[0]
                try:  # (what _failure_of says, without a context manager per handle and step)
                    if not handle.is_ready():
                        break
                    handle.wait()  # returns at once: the copy is complete
                except TransferFailedError as exc:
                    raise _failed_after_yield(flight, exc) from exc
                handles.pop(0)
            if handles:
                break
            queue.popleft()
        return queue

    def _overdue(self, stream: Any) -> tuple[Any, Any] | None:
        """Settle what completed (never blocks); return what the host must wait for first, if the
        host is more than ``depth + 1`` batches ahead: ``("upload", flight)`` or ``("mark", event)``.

        Raises PrefetchError for a yielded batch whose copy failed.
        """
        queue = self._settle()
        if len(queue) > self._limit:
            return "upload", queue[0]
        marks = self._marks
        try:
            while marks and self._backend.event_query(marks[0]):
                self._spare.append(marks.popleft())
        except DeviceError as exc:
            raise FerryError(f"the consumer's stream reported an error: {exc}") from exc
        if len(marks) > self._limit:
            return "mark", marks[0]
        return None

    def _mark(self, stream: Any) -> None:
        """An event on the consumer's stream: its work on every batch yielded so far is queued."""
        if stream is None or not self._yielded:
            return
        backend = self._backend
        try:
            event = self._spare.pop() if self._spare else backend.event_create(blocking=self._blocking_marks)
            backend.event_record(event, backend.stream_from_handle(stream_handle_of(stream)))
        except DeviceError as exc:
            raise FerryError(f"could not mark the consumer's stream: {exc}") from exc
        self._marks.append(event)

    def _pace(self, stream: Any) -> None:
        """Backpressure: wait on the host while it is too far ahead of the uploads or the consumer."""
        self._mark(stream)
        while (overdue := self._overdue(stream)) is not None:
            kind, what = overdue
            if kind == "upload":
                with _failure_of(what):
                    self._wait_upload(what.handles[0])
                what.handles.pop(0)
            else:
                self._synchronize(what)

    _blocking_marks = False
    """Whether the consumer's stream is marked with blocking-sync events (a host wait on one sleeps
    instead of spinning)."""

    def _wait_upload(self, handle: Any) -> None:
        """Backpressure: the host waits for a yielded batch's upload (``wait()``: it spins about as long
        as the copy should take, then sleeps)."""
        handle.wait()

    async def _apace(self, stream: Any) -> None:
        self._mark(stream)
        while (overdue := self._overdue(stream)) is not None:
            kind, what = overdue
            if kind == "upload":
                with _failure_of(what):
                    await what.handles[0]
                what.handles.pop(0)
            else:
                await asyncio.to_thread(self._synchronize, what)

    def _synchronize(self, event: Any) -> None:
        try:
            self._backend.event_synchronize(event)
        except DeviceError as exc:
            raise FerryError(f"the consumer's stream reported an error: {exc}") from exc
        self._spare.append(self._marks.popleft())

    def _release_marks(self) -> None:
        """The events back to the runtime's event pool (no device call: safe in a finalizer)."""
        events = list(self._marks) + self._spare
        self._marks.clear()
        self._spare.clear()
        if events and not self._rt.closed:
            parts_of(self._rt).completion.events.extend(events)

    _whole_flight: type | None = None
    """A subclass's kind of flight that :meth:`_hand_over` hands over whole, in one call (None: none)."""

    def _hand_over(self, flight: Any, stream: Any) -> Any:
        """A flight of :attr:`_whole_flight`'s kind handed to ``stream`` and converted: the batch."""
        raise NotImplementedError

    def _consumer_stream(self) -> Any:
        if self._stream is not None:
            return self._stream
        if self._to == "torch":
            return torch_current_stream(self._library, self._rt.device)
        if self._to == "cupy":
            return self._library.cuda.get_current_stream()
        return None

    def _convert(self, array: DeviceArray, stream: Any) -> Any:
        to = self._to
        if to is None:
            return array
        if to == "torch" and stream is not None:
            # the capsule made for the consumer's stream, as torch.from_dlpack(array) would make it for
            # PyTorch's current one (the same stream unless stream= named another), without its lookup
            return self._library.from_dlpack(array.__dlpack__(stream=stream_handle_of(stream)))
        if to in ("torch", "cupy"):
            return self._library.from_dlpack(array)
        if to == "jax":
            return self._library.dlpack.from_dlpack(array)
        assert callable(to)
        return to(array)

@contextlib.contextmanager
def _failure_of(flight: _Flight) -> Iterator[None]:
    """A yielded batch's upload failed: say which batch."""
    try:
        yield
    except TransferFailedError as exc:
        raise _failed_after_yield(flight, exc) from exc


def _failed_after_yield(flight: _Flight, exc: TransferFailedError) -> PrefetchError:
    return PrefetchError(
        f"batch {flight.index} failed on the device after it was yielded: its arrays are abandoned ({exc})",
        flight.index)


class _EndError(Exception):
    """The iteration ended: the source is exhausted, or the runtime was closed."""


def _close_quietly(runtime: Runtime) -> None:
    try:
        runtime.close()
    except Exception as exc:  # on a background thread: nobody to raise to
        _lifecycle.report(f"closing the runtime of a dropped prefetcher failed: {exc!r}")


def _import(name: str) -> Any:
    if name == "jax":
        import jax.dlpack

        return jax
    module = __import__(name)
    return module


def prefetch(
    batches: Iterable[Any] | AsyncIterable[Any],
    depth: int = 2,
    *,
    runtime: Runtime | None = None,
    to: str | Callable[[DeviceArray], Any] | None = None,
    stream: Any = None,
) -> Prefetcher:
    """Iterate host batches as device batches, with ``depth`` uploads kept in flight ahead of the consumer.

    Parameters
    ----------
    batches
        Any iterable of host batches (with ``async for``, an async iterable
        too): NumPy arrays, or tuples, lists and dicts of them, nested as a
        PyTorch ``DataLoader`` yields them. CPU tensors of PyTorch, JAX or
        any DLPack library are taken through ``numpy.from_dlpack`` (no
        copy); strings, numbers and ``None`` pass through unchanged.
    depth
        Batches uploading while the consumer works on the current one.
    runtime
        The runtime to upload through. ``None`` creates one and closes it
        when the iteration ends (exhausted, ``break``, an exception, or
        :meth:`Prefetcher.close`): the batches it yielded are then freed
        (after the consumer's queued work), so they are for use inside the
        loop only. Creating a runtime costs milliseconds and its pools start
        cold: pass one to keep batches beyond the loop or to prefetch many
        epochs.
    to
        ``None``: :class:`~ferry.DeviceArray` leaves. ``"torch"``,
        ``"cupy"`` or ``"jax"``: that library's arrays, through DLPack (no
        copy). A callable: applied to each device array.
    stream
        The consumer's stream (an int handle, a ``torch.cuda.Stream``, a
        ``cupy.cuda.Stream`` or anything with ``__cuda_stream__``). ``None``:
        the current stream of the library ``to`` names, read at each step
        (for ``to=None`` and ``"jax"`` none: see below).

    Returns
    -------
    Prefetcher
        An iterator (``for``) and async iterator (``async for``), also a
        context manager; yields each batch with the same structure, in order.

    Guarantees
    ----------
    The consumer's stream waits for each batch's copies on the device
    (:meth:`PendingUpload.hand_off`); the host never waits, except where a
    staged upload cannot be handed off (the pure-Python staging engine): a
    background thread waits for those and the consumer waits only if one is
    still running when its batch is due. With no stream known, the arrays
    are handed off unattached and DLPack or CUDA Array Interface consumers
    order themselves. Each batch's memory returns to the runtime's pool once
    the consumer drops it and the work it queued on the consumer's stream is
    done. Exhaustion, ``break``, an exception in the loop, ``close()`` and
    closing the runtime all end the iteration: what was not yielded is
    released once its copies complete; nothing leaks, nothing is freed early.

    Raises
    ------
    PrefetchError
        At the position of a batch that could not be uploaded (a leaf that
        is not a host array, a dtype ferry does not copy, out of memory), or
        whose copy failed on the device; ``index`` says which batch. The
        iteration is closed.
    Exception
        An exception raised by ``batches`` itself, unchanged, at its position.
    """
    return Prefetcher(batches, depth, runtime, to, stream, _token=_TOKEN)
