"""``ferry.DataLoader``: PyTorch's DataLoader arguments, worker processes writing into a pinned ring.

How a batch travels
-------------------
The main process owns a ring of slots in one shared file, mapped and
registered once with the runtime (``_memory/_ring.py``). It hands each worker
a batch to load and a free slot (``_slots.py`` says who may touch a slot
when); the worker fetches the samples and collates them straight into the
slot, then sends back a descriptor of a few hundred bytes, or only "as
before" when the batch's layout repeats (``_worker.py``). The main process
decodes each worker's layout once and keeps the NumPy views of each slot it
used (no copy, no page fault: the memory is resident and pinned); it feeds
them to a :class:`~ferry.Prefetcher`, which uploads the batch as one group
(one DMA per leaf, one event; ``_upload.py``: into device memory a dropped
batch of the same size left, when there is some), hands it to the consumer's
stream (or, when its copies already completed, settles them and hands it over
as it is) and converts it as ``to=`` asks. A slot is given back to the workers once its copies are
complete. Every wait of the main process sleeps (the workers' pipes, the
blocking-sync events of its backpressure): it also launches the consumer's
kernels.

The ring is sized from the first batch: the first batch of the loader's
first epoch comes back as arrays (and is uploaded as any pageable batch is);
every later batch that fits goes through a slot, and one that does not fit
travels the same way as the first.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import math
import multiprocessing
import numbers
import os
import pickle
import select
import signal
import struct
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .._device_array import DeviceArray
from .._errors import FerryError, RuntimeClosedError, TransferFailedError
from .._interop._dlpack import export_capsule
from .._memory._ring import PAGE, Ring, round_up
from .._prefetch import _TOKEN, Prefetcher, _Flight
from .._routes._base import array_ptr
from .._runtime import Runtime, parts_of
from ._collate import build, collate_into, convert
from ._sampler import BatchSampler, RandomSampler, SequentialSampler, base_seed, check_generator
from ._slots import SlotTable
from ._upload import DeviceRing, SlotLayout, hand_off_slot, take_if_done, upload_views
from ._worker import SAME, SAME_TAG, LoaderWorkerError, encode_task, same_plan, worker_loop

__all__ = ["DataLoader"]

_END = object()
_JOIN_SECONDS = 2.0
_live: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def _is_iterable_style(dataset: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if isinstance(dataset, torch.utils.data.IterableDataset):
                return True
        except AttributeError:
            pass
    return not hasattr(dataset, "__getitem__") and hasattr(dataset, "__iter__")


def _positive_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _timeout(value: Any, workers: int) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout option should be non-negative, got {value!r}")
    if seconds and not workers:
        raise ValueError("timeout needs num_workers > 0: batches loaded in the main process are not timed")
    return seconds


class DataLoader:
    """Batches of a dataset on the device, loaded by worker processes straight into pinned memory.

    The arguments up to ``in_order`` are ``torch.utils.data.DataLoader``'s
    and mean what they mean there (so switching is a one-line change);
    PyTorch is not needed. The rest are :func:`ferry.prefetch`'s.

    Parameters
    ----------
    dataset
        Map-style (``__len__`` and ``__getitem__``) or iterable-style
        (``__iter__``; a ``torch.utils.data.IterableDataset`` too). Samples
        are NumPy arrays, CPU tensors of any DLPack library, numbers,
        strings, or dicts, lists and tuples of them.
    batch_size
        Samples per batch; ``None`` disables batching (each sample is a
        batch, and ``collate_fn``, if given, is applied to it alone).
    shuffle
        A new random order every epoch (map-style only).
    sampler
        An iterable of indices (PyTorch's samplers work as they are);
        excludes ``shuffle``.
    batch_sampler
        An iterable of lists of indices, one list per batch (PyTorch's
        work as they are); excludes ``batch_size``, ``shuffle``, ``sampler``
        and ``drop_last``.
    num_workers
        Worker processes; 0 loads in the main process (still into the ring).
    collate_fn
        ``None``: the default collate, which stacks each field straight into
        a ring slot (``numpy.stack(..., out=slot)``), as PyTorch's
        ``default_collate`` stacks into tensors (NumPy arrays here; numbers
        become ``int64``/``float64``/``bool`` arrays; tuples come back as
        lists, as PyTorch's do). A function of a list of samples returns a
        batch of fresh arrays: the worker copies them into its slot (one host
        copy, in the worker).
    drop_last
        Drop the last batch if it is short.
    worker_init_fn
        Called with the worker's id in each worker, after seeding.
    multiprocessing_context
        ``"fork"``, ``"spawn"``, ``"forkserver"``, a context object, or
        ``None`` (the platform's default). With ``spawn`` and ``forkserver``
        the dataset, ``collate_fn`` and ``worker_init_fn`` must pickle.
    persistent_workers
        Keep the workers (and the ring) between epochs.
    prefetch_factor
        Batches each worker may be loading ahead.
    generator
        A ``numpy.random.Generator`` or a ``torch.Generator``: the shuffle
        order and the workers' base seed. ``None``: PyTorch's default
        generator when PyTorch is loaded (its exact order), else NumPy's
        global one.
    pin_memory
        Accepted and ignored: every batch is already collated into pinned
        memory, so there is nothing to pin.
    pin_memory_device
        Accepted and ignored, as ``pin_memory``.
    timeout
        Seconds to wait for each batch from the workers (0: no bound). A
        batch not delivered in time raises :class:`~ferry.LoaderWorkerError`
        and ends the epoch, as PyTorch's loader raises. Needs
        ``num_workers > 0``.
    in_order
        Must be ``True`` (the default): batches always come in the sampler's
        order; ``False`` is refused with ValueError.
    runtime
        The runtime to upload through; ``None`` creates one on the first
        iteration and closes it with :meth:`close`.
    to
        As for :func:`ferry.prefetch`: the leaves' type (``None``:
        :class:`~ferry.DeviceArray`, or ``"torch"``, ``"cupy"``, ``"jax"``,
        a callable).
    depth
        As for :func:`ferry.prefetch`: the batches uploading ahead of the
        consumer.
    stream
        As for :func:`ferry.prefetch`: the consumer's stream (default: the
        current stream of ``to``'s library).

    Guarantees
    ----------
    Batches come in the sampler's order, each with its sample's structure.
    Each worker is seeded as PyTorch seeds it (``random`` and PyTorch with the
    base seed plus its id, NumPy's global generator with a state derived from
    both); :func:`ferry.get_worker_info` describes it. Worker processes make no
    device call. Per batch the main process creates no shared memory, faults
    no page in and copies no byte on the host: it issues one DMA per array
    from the slot, hands the batch to the consumer's stream (which waits for
    the copies on the device) and gives the slot back once the copies are
    complete. The device memory of a batch whose arrays the consumer all
    dropped is reused for a later batch of the same size, copied into only
    after the work of every stream those arrays were handed to (memory whose
    address was exported with no stream known is freed instead); what is kept
    counts as the runtime's device memory and is freed when the workers stop.
    The ring's pinned memory (:attr:`ring_bytes`) is sized once,
    from the first batch, and never grows; a batch too large for a slot is
    uploaded from the worker's own arrays instead (slower, never a failure;
    counted in :attr:`fallback_batches`).

    Exhaustion ends the epoch (the workers stop unless ``persistent_workers``;
    their ring is unpinned with them). ``break``, an exception in the loop,
    :meth:`close`, Ctrl-C and interpreter exit stop the workers and release the
    ring: the shared file is anonymous (never a ``/dev/shm`` name), and the
    registration is undone once no copy reads it.

    Raises
    ------
    LoaderWorkerError
        When iterating: a worker raised while loading a batch (the batch's
        index, the worker's id and its traceback text are attached; the
        worker's exception is the cause, when it pickles), or a worker died
        (noticed at once, through its process sentinel), or a batch was not
        delivered within ``timeout``. The iteration ends.
    ValueError, TypeError
        At construction, for arguments ``torch.utils.data.DataLoader`` refuses.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        shuffle: bool = False,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[Any] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: Any = None,
        persistent_workers: bool = False,
        prefetch_factor: int = 2,
        generator: Any = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        runtime: Runtime | None = None,
        to: str | Callable[[DeviceArray], Any] | None = None,
        depth: int = 2,
        stream: Any = None,
    ) -> None:
        _positive_int(num_workers, "num_workers", 0)
        _positive_int(prefetch_factor, "prefetch_factor", 1)
        _positive_int(depth, "depth", 1)
        timeout = _timeout(timeout, num_workers)
        if in_order is not True:
            raise ValueError("in_order must be True: ferry.DataLoader always yields batches in the sampler's order")
        if batch_size is not None:
            _positive_int(batch_size, "batch_size", 1)
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"runtime must be a ferry.Runtime, got {type(runtime).__name__}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError("collate_fn must be callable")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError("worker_init_fn must be callable")
        check_generator(generator)
        self._context = _context(multiprocessing_context)
        iterable = _is_iterable_style(dataset)
        if iterable:
            if shuffle:
                raise ValueError("DataLoader with an iterable-style dataset: shuffle must be False")
            if sampler is not None or batch_sampler is not None:
                raise ValueError("DataLoader with an iterable-style dataset: no sampler or batch_sampler")
        elif not hasattr(dataset, "__getitem__"):
            raise TypeError(f"dataset must have __len__ and __getitem__, or __iter__; got {type(dataset).__name__}")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
            batch_size = None
            auto_batch = True
        else:
            auto_batch = batch_size is not None
            if batch_size is None and drop_last:
                raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with "
                                 "drop_last")
        if not iterable:
            if sampler is None:
                sampler = RandomSampler(dataset, generator) if shuffle else SequentialSampler(len(dataset))
            if batch_sampler is None and batch_size is not None:
                batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.generator = generator
        self.timeout = timeout
        self.pin_memory = bool(pin_memory)
        self.pin_memory_device = pin_memory_device
        self.in_order = True
        self._iterable = iterable
        self._auto_batch = auto_batch
        self._runtime = runtime
        self._owns_runtime = runtime is None
        self._prefetch_args = (depth, to, stream)
        _check(to, stream)
        self._engine: _Engine | None = None
        self._active: weakref.ref[_Epoch] | None = None
        self._slot_bytes = 0  # remembered from the first batch
        self._epoch = 0
        self._closed = False
        self.fallback_batches = 0
        """Batches that did not fit a ring slot (or came before it existed) and were uploaded from the
        worker's own arrays."""
        _live.add(self)

    # -- the iteration -----------------------------------------------------------------------------
    def __iter__(self) -> _Epoch:
        """A new epoch (an earlier one still running is closed first)."""
        if self._closed:
            raise FerryError("this DataLoader is closed")
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()
        if self._runtime is None:
            self._runtime = Runtime()
        engine = self._engine
        if engine is None or engine.broken:
            if engine is not None:
                engine.shutdown()
            engine = self._engine = _Engine(self, self._runtime)
        self._epoch += 1
        epoch = _Epoch(self, engine, self._epoch)
        self._active = weakref.ref(epoch)
        return epoch

    def __len__(self) -> int:
        """Batches per epoch, as ``torch.utils.data.DataLoader`` counts them (TypeError when unknown)."""
        if self._iterable:
            n = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        return len(self.sampler)  # type: ignore[arg-type]

    @property
    def runtime(self) -> Runtime | None:
        """The runtime batches are uploaded through (``None`` before the first iteration, if none was given)."""
        return self._runtime

    @property
    def ring_bytes(self) -> int:
        """Pinned bytes of the ring now mapped (0 while none is)."""
        engine = self._engine
        return engine.ring.nbytes if engine is not None and engine.ring is not None else 0

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Stop the workers, release the ring and close a runtime the loader created. Idempotent.

        The batches it yielded stay valid only while their runtime is open:
        pass ``runtime=`` to keep them beyond ``close()``."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._owns_runtime and self._runtime is not None:
            self._runtime.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            if self._engine is not None:
                self._engine.shutdown()
                self._engine = None
            if self._owns_runtime and self._runtime is not None:
                self._runtime.close()
            self._closed = True

    def __repr__(self) -> str:
        return (f"<ferry.DataLoader {self.num_workers} workers, batch_size {self.batch_size}, ring "
                f"{self.ring_bytes} bytes{' closed' if self._closed else ''}>")


def _check(to: Any, stream: Any) -> None:
    """The prefetch arguments, checked now rather than at the first batch (no runtime made for it)."""
    from .._interop._cai import stream_handle_of
    from .._prefetch import _LIBRARIES

    if isinstance(to, str) and to not in _LIBRARIES:
        raise ValueError(f"to must be None, one of {_LIBRARIES} or a callable, got {to!r}")
    if to is not None and not isinstance(to, str) and not callable(to):
        raise TypeError(f"to must be None, one of {_LIBRARIES} or a callable, got {type(to).__name__}")
    if stream is not None:
        stream_handle_of(stream)


def _context(value: Any) -> Any:
    if value is None:
        return multiprocessing.get_context()
    if isinstance(value, str):
        if value not in multiprocessing.get_all_start_methods():
            raise ValueError(f"multiprocessing_context: {value!r} is not a start method of this platform "
                             f"({', '.join(multiprocessing.get_all_start_methods())})")
        return multiprocessing.get_context(value)
    if not hasattr(value, "Process") or not hasattr(value, "Pipe"):
        raise TypeError(f"multiprocessing_context must be a start method or a context, got {type(value).__name__}")
    return value


class _LoaderPrefetcher(Prefetcher):
    """The prefetcher over the ring: tells the engine which uploads read each slot.

    A batch in a slot is uploaded as one group (every leaf one DMA straight from the registered slot,
    all behind one event: one record, one hand-off and one completion to ask about per batch); a batch
    that came back as arrays goes prefetch's own way, leaf by leaf.
    """

    def __init__(self, engine: _Engine, source: Iterator[Any], depth: int, runtime: Runtime, to: Any,
                 stream: Any) -> None:
        super().__init__(source, depth, runtime, to, stream, _token=_TOKEN)
        self._engine = engine
        self._completion = parts_of(runtime).completion
        self._whole_flight = _SlotFlight  # a slot batch: handed over in one call (_hand_over)

    def _take(self, fill: bool = True) -> _Flight:
        # the yielded batches whose copies completed are settled before the next batch is taken: the
        # engine then gives their slots back to the workers without asking the device about them again
        self._settled = False
        if fill and self._unconfirmed and not self._closed:
            try:
                Prefetcher._settle(self)
            except BaseException:
                self.close()
                raise
            self._settled = True
        return super()._take(fill)

    _settled = False  # the step's settle ran: its backpressure check need not ask the device again

    def _settle(self) -> deque[_Flight]:
        if self._settled or not self._unconfirmed:  # once per step (a wait for backpressure settles again)
            self._settled = False
            return self._unconfirmed
        return super()._settle()

    def _submit(self, index: int, batch: Any) -> Any:
        if type(batch) is not _SlotViews:  # a batch that came back as arrays: prefetch's own way
            flight = super()._submit(index, batch)
            self._engine.submitted(list(flight.handles))
            return flight
        try:
            handle = upload_views(self._rt, batch, self._engine.device_ring)
        except BaseException as exc:  # nothing of it enqueued, its arrays closed
            self._engine.submitted([])  # nothing reads the slot
            if isinstance(exc, RuntimeClosedError) or not isinstance(
                    exc, (FerryError, MemoryError, TypeError, ValueError)):
                raise
            return self._failed(index, exc, wrap=True)
        self._engine.submitted([handle])
        self._next_index = index + 1
        flight = _SlotFlight(index)
        flight.build = batch.build
        flight.handles = [handle]
        return flight

    # The loader's waits sleep: its main thread also launches the consumer's kernels, and a wait that
    # spins would take that thread's CPU from them.
    _blocking_marks = True

    def _wait_upload(self, handle: Any) -> None:
        """Backpressure on a yielded batch's upload: sleep until the runtime's watcher (asleep on the
        device, never polling) settles it."""
        handle.future().result()

    def _hand_off(self, flight: _Flight, stream: Any) -> tuple[list[Any], list[int]]:
        if type(flight) is not _SlotFlight:
            return super()._hand_off(flight, stream)
        return [self._hand_over(flight, stream)], []  # the batch itself: _finish returns it

    def _finish(self, flight: _Flight, devices: list[Any], stream: Any) -> Any:
        if type(flight) is not _SlotFlight:
            return super()._finish(flight, devices, stream)
        return devices[0]  # (handed over by _hand_off)

    def _hand_over(self, flight: _Flight, stream: Any) -> Any:
        """A slot batch, handed off to ``stream`` and converted (what ``_hand_off`` and ``_finish`` do for a
        flight of leaf handles, for the one group handle of a slot batch): the batch to yield."""
        handle = flight.handles[0]
        try:
            devices = take_if_done(self._completion, handle)
            if devices is not None:  # the copies are done (the consumer is the slower side): settled now,
                # with no stream wait to queue and nothing left to confirm at a later step
                flight.waits.add(0)
                if stream is not None and devices:  # the slab's: every view's free waits for the consumer's work
                    devices[0]._memory.note_stream(devices[0]._ptr, stream)
            else:
                devices = hand_off_slot(self._completion, handle, stream)
        except (TransferFailedError, RuntimeClosedError):
            raise
        except FerryError:  # the engine cannot hand this copy off: the host waits for it instead
            devices = handle.wait()[1]
            flight.waits.add(0)
            if stream is not None:
                for device in devices:
                    device.record_stream(stream)  # the consumer's work on it precedes its free
        to = self._to
        if to is None:
            leaves = list(devices)  # (what _convert makes of each)
        elif to == "torch" and stream is not None and devices:
            # the hand-off ordered this stream after the copies and noted it on every array: the capsule
            # needs neither again (what __dlpack__(stream=...) would add: a second stream wait per leaf)
            from_dlpack = self._library.from_dlpack
            where = devices[0].__dlpack_device__()  # (the views of one slab: one device)
            leaves = []
            for device in devices:
                leaves.append(from_dlpack(export_capsule(device, device._ptr, device._shape, device._dtype, where)))
        else:
            convert = self._convert
            leaves = [convert(device, stream) for device in devices]
        self._yielded += 1
        if not flight.waits:  # proven complete (or failed) at a later step (the flight is done with)
            self._unconfirmed.append(flight)
        return flight.build(leaves)


class _SlotFlight(_Flight):
    """The flight of a batch uploaded from its slot: one group handle for all its leaves."""

    __slots__ = ()


class _SlotViews:
    """A batch in a ring slot, as the engine hands it to its prefetcher: the slot's views for one layout
    (in the order of the batch's structure), their upload sources (the layout's small leaves' addresses,
    the large ones'), the slot's span, the layout's upload plan and what puts the structure together
    around device leaves. Made once per slot and layout, and handed out for every batch of that layout in
    that slot (no object is made per batch)."""

    __slots__ = ("big_src", "build", "copies", "hosts", "layout", "leaves", "ptrs", "reg", "small_src", "span",
                 "spare", "uploadable")

    def __init__(self, ring: Ring, slot: int, plan: _Plan) -> None:
        self.leaves = [ring.view(slot, offset, dtype, shape) for dtype, shape, offset in plan.specs]  # type: ignore[arg-type]
        self.ptrs = [array_ptr(leaf) for leaf in self.leaves]
        self.span = ring.span(slot)
        self.build = plan.build
        layout = self.layout = plan.layout
        self.small_src = [self.ptrs[i] for i in layout.small]
        self.big_src = [self.ptrs[i] for i in layout.big]
        self.uploadable = bool(self.leaves) and all(layout.sizes)  # else: leaf by leaf, prefetch's way
        self.reg: Any = None  # the ring's registration, once an upload found it (kept while it is active)
        self.hosts = tuple(self.leaves)  # the group's host objects (its result's first item)
        self.copies: dict[int, Any] = {}  # device slab address -> the upload's copy into it (_upload.upload_views)
        self.spare: list[Any] = []  # the extras of this slot's settled batches, for its next ones


class _Plan:
    """A worker's batch layout, decoded once: the skeleton's builder, each leaf's dtype, shape and
    offset, the upload's layout on the device, and the views of each slot it was used with (kept: the
    same views serve every batch of this layout in that slot)."""

    __slots__ = ("build", "layout", "specs", "views")

    def __init__(self, plan: tuple[Any, Any]) -> None:
        skeleton, layout = plan
        self.specs = [(np.dtype(dtype), tuple(shape), int(offset)) for dtype, shape, offset in layout]
        self.layout = SlotLayout([(shape, dtype) for dtype, shape, _ in self.specs])  # the device arrays
        self.build: Callable[[list[Any]], Any] = _builder(skeleton)
        self.views: dict[int, _SlotViews] = {}

    def slot(self, ring: Ring, slot: int) -> _SlotViews:
        views = self.views.get(slot)
        if views is None:
            views = self.views[slot] = _SlotViews(ring, slot, self)
        return views


def build_plan(plan: _Plan, leaves: list[np.ndarray[Any, Any]]) -> Any:
    """The host batch a plan describes, around its slot's views."""
    return plan.build(list(leaves))


def _builder(skeleton: Any) -> Callable[[list[Any]], Any]:
    if skeleton[0] == "l" and all(child[0] == "a" for child in skeleton[1]):  # (x, y) and the like
        positions = [child[1] for child in skeleton[1]]
        if positions == list(range(len(positions))):
            return list
    return lambda leaves: build(skeleton, leaves)


class _Epoch:
    """The iterator of one epoch of a :class:`DataLoader` (``for``, ``with``, ``close()``)."""

    def __init__(self, loader: DataLoader, engine: _Engine, number: int) -> None:
        self._loader = weakref.ref(loader)
        self._engine = engine
        self._persistent = loader.persistent_workers
        depth, to, stream = loader._prefetch_args
        assert loader._runtime is not None
        self._length: int | None
        try:
            self._length = len(loader)
        except TypeError:
            self._length = None
        source = engine.epoch(number)
        self._prefetcher: _LoaderPrefetcher | None = _LoaderPrefetcher(
            engine, source, depth, loader._runtime, to, stream)
        self._done = False

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        prefetcher = self._prefetcher
        if prefetcher is None:
            raise StopIteration
        try:
            return next(prefetcher)
        except StopIteration:
            self._finish(completed=True)
            raise
        except BaseException:
            self._finish(completed=False)
            raise

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this loader's dataset has no length")
        return self._length

    def __enter__(self) -> _Epoch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop this epoch: its workers and its ring are released (``break`` does the same). Idempotent."""
        self._finish(completed=False)

    def _finish(self, completed: bool) -> None:
        if self._done:
            return
        self._done = True
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()
        del prefetcher
        engine = self._engine
        loader = self._loader()
        if completed and self._persistent and not engine.broken:
            engine.settle()
            return
        engine.shutdown()
        if loader is not None and loader._engine is engine:
            loader._engine = None

    def __del__(self) -> None:
        if getattr(self, "_done", True):
            return
        with contextlib.suppress(Exception):
            self._finish(completed=False)


class _Engine:
    """The workers, the ring and the slot table of a loader (one epoch, or many with persistent workers)."""

    def __init__(self, loader: DataLoader, runtime: Runtime) -> None:
        self.loader_ref = weakref.ref(loader)
        self.rt = runtime
        self.dataset = loader.dataset
        self.iterable = loader._iterable
        self.batch_size = loader.batch_size if loader._auto_batch and loader.batch_sampler is None else None
        self.auto_batch = loader._auto_batch
        self.drop_last = loader.drop_last
        self.collate_fn = loader.collate_fn
        self.workers = loader.num_workers
        self.prefetch_factor = loader.prefetch_factor
        self.timeout = loader.timeout
        depth = loader._prefetch_args[0]
        self.slots = max(1, self.workers) * loader.prefetch_factor + depth + 2
        self.ring: Ring | None = Ring(runtime)
        self.device_ring = DeviceRing()  # the device memory of dropped slot batches, lent to the next ones
        self.table = SlotTable(self.slots)
        self.inflight: deque[tuple[int, list[Any]]] = deque()  # (slot, handles), oldest first
        self.lost: set[int] = set()  # slots whose copy failed: the device may still read them
        self.awaiting: deque[int | None] = deque()  # slots yielded to the prefetcher, not yet submitted
        self.broken = False
        self.closed = False
        self.procs: list[Any] = []
        self.tasks: list[Any] = []
        self.task_fds: list[int] = []  # the tasks' pipes, by worker
        self.results: list[Any] = []
        self.seed_generator = loader.generator
        self.base_seed = 0
        if loader._slot_bytes:
            self.ring.size(loader._slot_bytes, self.slots)
        self.local_stream: Any = None
        self.local_epoch = -1
        self._poller: Any = None
        self._watched: dict[int, tuple[bool, int]] = {}  # fd -> (is the process's sentinel, worker)
        self._frames: dict[int, _Frames] = {}  # a worker's result pipe -> what it delivered, not yet filed
        self._plans: dict[int, _Plan] = {}  # each worker's last batch layout, decoded (0: this process's)
        self._local_plan: Any = None  # this process's last (skeleton, layout) (num_workers=0)

    # -- workers -------------------------------------------------------------------------------------
    def start(self, loader: DataLoader) -> None:
        """Start the worker processes (the ring's file exists: they receive it)."""
        ctx = loader._context
        assert self.ring is not None
        parent = os.getpid()
        collate = self.collate_fn
        batch_size = self.batch_size if self.iterable else (1 if self.auto_batch else None)
        try:
            for worker in range(self.workers):
                task_reader, task_writer = ctx.Pipe(duplex=False)
                result_reader, result_writer = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=worker_loop,
                    args=(worker, self.workers, self.dataset, self.iterable, batch_size, self.drop_last, collate,
                          loader.worker_init_fn, self.base_seed, self.ring.shared(), task_reader, result_writer,
                          parent),
                    name=f"ferry-loader-worker-{worker}", daemon=True,
                )
                self.procs.append(process)
                self.tasks.append(task_writer)
                self.task_fds.append(task_writer.fileno())
                self.results.append(result_reader)
                process.start()
                task_reader.close()
                result_writer.close()
        except BaseException:
            self.broken = True
            raise

    # -- one epoch -------------------------------------------------------------------------------------
    def epoch(self, number: int) -> Iterator[Any]:
        """The host batches of one epoch, in order (a generator; the prefetcher uploads them)."""
        loader = self.loader_ref()
        assert loader is not None
        seed = base_seed(self.seed_generator)  # drawn every epoch, before the shuffle, as PyTorch draws it
        if not self.procs:
            self.base_seed = seed  # workers started this epoch take it; persistent ones keep theirs
        if self.iterable:
            indices: Iterator[Any] | None = None
        else:
            order = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
            packed = order.packed() if type(order) is BatchSampler and self.workers else None
            # (index list, packed) per batch: packed ones are int64 bytes, decoded by the worker
            indices = packed if packed is not None else ((batch, False) for batch in order)  # type: ignore[union-attr]
        return self._batches(loader, number, indices)

    def _batches(self, loader: DataLoader, number: int, indices: Iterator[Any] | None) -> Iterator[Any]:
        if self.workers and not self.procs:
            self.start(loader)
        del loader
        state = _EpochState(number, indices, self.workers)
        while True:
            message = self._next_message(state)
            if message is _END:
                return
            yield self._host_batch(message)
            message = None

    def _next_message(self, state: _EpochState) -> Any:
        deadline = time.monotonic() + self.timeout if self.timeout else None
        ask = False  # the first pass gives out the slots the prefetcher proved free; later ones ask the device
        while True:
            # the handles the prefetcher waited are let go at once: each keeps its batch's device arrays
            # alive (they return to the pool when the consumer drops them only if nothing else holds them)
            self._reclaim(ask=False)
            if self.workers:
                self._dispatch(state, ask)
            ready = state.ready.pop(state.next_out, None)
            if ready is not None:
                state.next_out += 1
                if ready[0] == "end":
                    continue
                if ready[0] == "died":
                    self.broken = True
                    raise LoaderWorkerError(ready[4], ready[1], ready[2])
                return ready
            if state.death is not None and not state.outstanding:
                self.broken = True
                raise LoaderWorkerError(state.death[1], None, state.death[0])
            if not state.outstanding:
                if state.exhausted and not state.pending:
                    return _END
                if not self.workers:
                    if self._load_here(state):
                        continue
                    if state.exhausted:
                        return _END
                self._wait_for_slot()
                ask = True
                continue
            if state.starved and not ask:  # before sleeping: the device may have freed a slot a worker can take
                ask = True
                continue
            if deadline is not None and time.monotonic() >= deadline:
                self._timed_out(state)
            self._receive(state, deadline)
            ask = True

    def _timed_out(self, state: _EpochState) -> None:
        """The next batch was not delivered within ``timeout`` seconds: the epoch ends, as PyTorch's does."""
        self.broken = True
        batch = state.next_out
        worker = state.pending.get(batch)
        raise LoaderWorkerError(
            f"DataLoader timed out after {self.timeout:g} seconds waiting for batch {batch}"
            + (f" from worker {worker}" if worker is not None else ""), batch, worker)

    # -- the main process's side of the protocol ---------------------------------------------------------------
    def _reclaim(self, ask: bool = True) -> None:
        """Slots whose copies completed go back to the workers (oldest first; never blocks). With
        ``ask=False`` only those the prefetcher has already proven complete (waited): no device query."""
        inflight = self.inflight
        while inflight:
            slot, handles = inflight[0]
            try:
                while handles:
                    handle = handles[0]
                    if not (handle._waited or (ask and handle.is_ready())):
                        return
                    handles.pop(0)
            except (TransferFailedError, FerryError):
                self.lost.add(slot)  # the device may still read it: never written again
                inflight.popleft()
                continue
            inflight.popleft()
            self.table.completed(slot)

    def _take_slot(self, worker: int, batch: int, ask: bool = True) -> int | None:
        """A free slot for ``batch``; the device is asked about the slots whose copies may have completed
        only when none is free (and ``ask``)."""
        slot = self.table.take(worker, batch)
        if slot is None and ask and self.inflight:
            self._reclaim()
            slot = self.table.take(worker, batch)
        return slot

    def _wait_for_slot(self) -> None:
        """No slot is free and no batch is being loaded: wait for the oldest copies to complete."""
        if not self.inflight:
            raise FerryError("the loader's ring has no free slot and no copy in flight")  # a protocol bug
        handles = self.inflight[0][1]
        if handles and not handles[0]._waited and not handles[0].is_ready():
            try:  # asleep until the runtime's watcher (asleep on the device) settles it: no polling
                handles[0].future().result(timeout=60.0)
            except concurrent.futures.TimeoutError:
                raise FerryError("the ring's copies did not complete within 60 s") from None

    def submitted(self, handles: list[Any]) -> None:
        """The prefetcher submitted the uploads of the batch yielded last."""
        slot = self.awaiting.popleft()
        if slot is None:
            return
        if handles:
            self.inflight.append((slot, handles))
        else:  # nothing was submitted (the batch failed): nothing reads the slot
            self.table.completed(slot)

    def _host_batch(self, message: tuple[Any, ...]) -> Any:
        kind, batch = message[0], message[1]
        if kind == "ok":
            slot, plan = message[3], message[4]
            ring = self.ring
            assert ring is not None
            views = plan.views.get(slot) or plan.slot(ring, slot)
            self.table.issued(slot, batch)
            self.awaiting.append(slot)
            if not views.uploadable:  # nothing to copy for some: leaf by leaf
                return build_plan(plan, views.leaves)
            return views
        if kind == "fresh":
            loader = self.loader_ref()
            if loader is not None:
                loader.fallback_batches += 1
            self.awaiting.append(None)
            return message[4]
        assert kind == "error"
        _, _, worker, _, text, original = message
        where = f"batch {batch}" if batch >= 0 else "worker_init_fn"
        error = LoaderWorkerError(f"DataLoader worker {worker} failed loading {where}:\n{text}",
                                  batch if batch >= 0 else None, worker, text)
        error.__cause__ = original
        self.broken = True
        raise error

    def _dispatch(self, state: _EpochState, ask: bool = True) -> None:
        """Give batches to the workers while a slot is free (round robin, ``prefetch_factor`` each); with
        ``ask``, when none is, the device is asked whether the oldest copies completed."""
        ring = self.ring
        assert ring is not None
        sized = ring.sized
        limit = self.workers * self.prefetch_factor if sized else 1
        factor, per_worker, pending, fds = self.prefetch_factor, state.per_worker, state.pending, self.task_fds
        state.starved = False
        while not state.exhausted and state.outstanding < limit and state.death is None:
            active = state.active
            if not active:
                state.exhausted = True
                return
            worker = active[state._turn]
            if per_worker[worker] >= factor:
                return
            slot = None
            if sized:
                slot = self._take_slot(worker, state.next_task, ask)
                if slot is None:
                    state.starved = True  # a worker could start a batch: waits wake up to free a slot
                    return
            if self.iterable:
                indices, packed = None, False
            else:
                assert state.indices is not None
                try:
                    indices, packed = next(state.indices)
                except StopIteration:
                    state.exhausted = True
                    if slot is not None:
                        self.table.discard(slot)
                    return
            batch = state.next_task
            try:
                _send(fds[worker], encode_task(state.number, batch, indices, packed, slot, ring.slot_bytes, ring.slots))
            except (BrokenPipeError, ConnectionResetError):  # it died: its sentinel reports it next
                if slot is not None:
                    self.table.discard(slot)
                state.death = (worker, self._death_text(worker, None))
                return
            state.next_task = batch + 1
            state._turn = (state._turn + 1) % len(active)
            pending[batch] = worker
            per_worker[worker] += 1
            state.outstanding += 1

    def _receive(self, state: _EpochState, deadline: float | None = None) -> None:
        """Wait for messages from the workers (or a worker's death) and file them; at most until ``deadline``.

        One system call waits on every worker's pipe and process sentinel, and one read per pipe that woke
        takes every message waiting in it. The wait sleeps until a message or a death: it wakes every
        millisecond only while no slot is free for a task the workers could start (then a copy completing
        frees one)."""
        timeout = 1 if state.starved and self.inflight else 1000  # ms
        if deadline is not None:
            timeout = max(0, min(timeout, math.ceil((deadline - time.monotonic()) * 1000)))
        poller = self._poller
        if poller is None:  # one poll object for the workers' lifetime: a wait costs one system call
            poller = self._poller = select.poll()
            for worker, (conn, process) in enumerate(zip(self.results, self.procs, strict=True)):
                poller.register(conn.fileno(), select.POLLIN)
                poller.register(process.sentinel, select.POLLIN)
                self._watched[conn.fileno()] = (False, worker)
                self._watched[process.sentinel] = (True, worker)
                self._frames[conn.fileno()] = _Frames()
        dead = []
        watched, frames = self._watched, self._frames
        for fd, _ in poller.poll(timeout):
            ended, worker = watched[fd]
            if ended:
                dead.append(worker)
                poller.unregister(fd)
                continue
            try:
                messages = frames[fd].read(fd)
            except (EOFError, OSError):
                poller.unregister(fd)  # its sentinel says why
                continue
            for message in messages:
                self._file_bytes(state, message)
        for worker in dead:
            conn = self.results[worker]
            reader = frames[conn.fileno()]
            with contextlib.suppress(EOFError, OSError):
                while conn.poll():  # what it sent before it died (poll reads nothing)
                    for message in reader.read(conn.fileno()):
                        self._file_bytes(state, message)
            self._died(state, worker)

    def _file_bytes(self, state: _EpochState, message: bytes) -> None:
        """File one message as it came from a worker's pipe."""
        if message[:1] == SAME_TAG:  # the common case: written in the slot, laid out as its previous batch
            _, batch, worker, slot = SAME.unpack(message)
            state.pending.pop(batch, None)
            state.per_worker[worker] -= 1
            state.outstanding -= 1
            self.table.filled(slot, worker, batch)
            state.ready[batch] = ("ok", batch, worker, slot, self._plans[worker])
            return
        self._file(state, pickle.loads(message))

    def _file(self, state: _EpochState, message: tuple[Any, ...]) -> None:
        kind, batch, worker, slot = message[:4]
        state.pending.pop(batch, None)
        state.per_worker[worker] -= 1
        state.outstanding -= 1
        if slot is not None:
            self.table.filled(slot, worker, batch)
            if kind != "ok":
                self.table.discard(slot)
        if kind == "fresh" and self.ring is not None and not self.ring.sized:
            self._size_ring(int(message[5]))
        if kind == "end":
            state.retire(worker)
        elif kind == "ok":  # decoded here, in the order the worker sent it (None: as its previous batch)
            plan = message[4]
            decoded = self._plans[worker] = _Plan(plan) if plan is not None else self._plans[worker]
            message = ("ok", batch, worker, slot, decoded)
        state.ready[batch] = message

    def _size_ring(self, nbytes: int) -> None:
        slot_bytes = round_up(max(nbytes, 1), PAGE)
        assert self.ring is not None
        self.ring.size(slot_bytes, self.slots)
        loader = self.loader_ref()
        if loader is not None:
            loader._slot_bytes = slot_bytes

    def _died(self, state: _EpochState, worker: int) -> None:
        """A worker exited while it should not have: the batches it owed fail at their positions (the
        batches before them are still handed out), and nothing more is given out."""
        self.broken = True
        state.gone.add(worker)
        owed = sorted(b for b, w in state.pending.items() if w == worker)
        for batch in owed:
            del state.pending[batch]
            state.outstanding -= 1
            state.per_worker[worker] -= 1
            state.ready[batch] = ("died", batch, worker, None, self._death_text(worker, batch))
        if state.death is None:
            state.death = (worker, self._death_text(worker, owed[0] if owed else None))
        # its slots being written are never written again, and never reused: the ring goes with this epoch

    def _death_text(self, worker: int, batch: int | None) -> str:
        process = self.procs[worker]
        process.join(0.1)
        code = process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how = f"signal {signal.Signals(-code).name}"
        where = f" while loading batch {batch}" if batch is not None else ""
        return f"DataLoader worker {worker} (pid {process.pid}) exited unexpectedly with {how}{where}"

    # -- loading in the main process (num_workers=0) ------------------------------------------------------
    def _load_here(self, state: _EpochState) -> bool:
        """Load the next batch in this process, into a slot if one is free; False if none is (or the end)."""
        if state.exhausted:
            return False
        ring = self.ring
        assert ring is not None
        slot = None
        if ring.sized:
            slot = self._take_slot(0, state.next_task)
            if slot is None:
                return False
        batch = state.next_task
        try:
            if self.iterable:
                if self.local_stream is None or self.local_epoch != state.number:
                    self.local_stream, self.local_epoch = iter(self.dataset), state.number
                if self.batch_size is None:
                    samples: Any = next(self.local_stream)
                else:
                    samples = list(_take(self.local_stream, self.batch_size))
                    if not samples or (self.drop_last and len(samples) < self.batch_size):
                        raise StopIteration
            else:
                assert state.indices is not None
                indices = next(state.indices)[0]
                samples = [self.dataset[i] for i in indices] if self.auto_batch else self.dataset[indices]
        except StopIteration:
            state.exhausted = True
            if slot is not None:
                self.table.discard(slot)
            return False
        except BaseException:
            if slot is not None:
                self.table.discard(slot)
            raise
        try:
            buffer = None
            if slot is not None:
                start = slot * ring.slot_bytes
                buffer = memoryview(ring.buffer)[start:start + ring.slot_bytes]
            fn = self.collate_fn if self.auto_batch else (self.collate_fn or convert)
            skeleton, layout, nbytes, fresh = collate_into(samples, fn, buffer)
            del buffer
        except BaseException:
            if slot is not None:
                self.table.discard(slot)
            raise
        state.next_task += 1
        if fresh is None:
            self.table.filled(slot, 0, batch)  # type: ignore[arg-type]
            plan = (skeleton, layout)
            if not same_plan(plan, self._local_plan) or 0 not in self._plans:
                self._local_plan = plan
                self._plans[0] = _Plan(plan)
            state.ready[batch] = ("ok", batch, 0, slot, self._plans[0])
        else:
            if slot is not None:
                self.table.filled(slot, 0, batch)
                self.table.discard(slot)
            elif not ring.sized:
                self._size_ring(nbytes)
            state.ready[batch] = ("fresh", batch, 0, None, fresh, nbytes)
        return True

    # -- the end ---------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """The epoch ended with persistent workers: wait for the copies still reading the ring."""
        self._drain(10.0)
        self.awaiting.clear()

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            self._reclaim()
            if self.inflight:
                time.sleep(0.0005)

    def shutdown(self) -> None:
        """Stop the workers, wait for the copies from the ring, release it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.broken = True
        for conn in self.tasks:  # never blocks: a worker that stopped reading is terminated below
            with contextlib.suppress(Exception):
                os.set_blocking(conn.fileno(), False)
                conn.send(None)
            with contextlib.suppress(Exception):
                conn.close()  # the worker's reader sees the end of the pipe
        deadline = time.monotonic() + _JOIN_SECONDS
        for process in self.procs:
            with contextlib.suppress(Exception):
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.procs:
            with contextlib.suppress(Exception):
                if process.is_alive():
                    process.terminate()
                    process.join(0.5)
                if process.is_alive():
                    process.kill()
                    process.join(0.5)
        for conn in self.tasks + self.results:
            with contextlib.suppress(Exception):
                conn.close()
        for process in self.procs:
            with contextlib.suppress(Exception):
                process.close()
        self.procs, self.tasks, self.results, self.task_fds = [], [], [], []
        if not self.rt.closed:
            with contextlib.suppress(Exception):
                self._drain(10.0)
        self.inflight.clear()
        self.awaiting.clear()
        self._plans.clear()  # their views of the ring: the mapping is closed below
        if not self.rt.closed:  # (a closed runtime freed what the device ring kept)
            parts = parts_of(self.rt)
            with contextlib.suppress(Exception):
                self.device_ring.close(parts.memory, parts.lock)
        self.device_ring.closed = True
        ring, self.ring = self.ring, None
        if ring is not None:
            # a failed copy keeps the ring's registration in use for good (the device may still read its
            # slot): no point waiting for it; the runtime's close unpins it
            ring.release(timeout=0.0 if self.lost else 10.0)


_HEADER = struct.Struct("!i")  # multiprocessing.Connection's framing: the length, then the bytes
_LONG = struct.Struct("!Q")  # after a length of -1: a 64-bit length


def _send(fd: int, payload: bytes) -> None:
    """One message to a worker's ``Connection.recv_bytes``, in one write (a task is small)."""
    data = _HEADER.pack(len(payload)) + payload
    written = os.write(fd, data)
    if written < len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view):]


_READ = 1 << 16  # a pipe's buffer: one read takes every small message waiting


class _Frames:
    """What one worker's pipe delivered, cut into the messages it sent (``Connection.send_bytes``'s
    framing: a 4-byte length, or -1 and an 8-byte one, then the bytes). One read takes every message
    waiting; a message still being written stays here (its bytes so far) until a later read ends it."""

    __slots__ = ("need", "rest")

    def __init__(self) -> None:
        self.rest = bytearray()  # the start of a message not yet whole
        self.need = 0  # that message's length with its header (0: not known yet)

    def read(self, fd: int) -> list[bytes]:
        """The whole messages after one read of ``fd`` (which must be readable: it blocks otherwise);
        EOFError once the pipe is closed and empty."""
        rest = self.rest
        chunk = os.read(fd, max(_READ, self.need - len(rest)))
        if not chunk:
            raise EOFError("the worker's pipe closed")
        if rest:
            rest += chunk
            data: bytes | bytearray = rest
        else:
            data = chunk
        messages: list[bytes] = []
        pos, end = 0, len(data)
        while end - pos >= 4:
            (n,) = _HEADER.unpack_from(data, pos)
            head = 4
            if n == -1:
                if end - pos < 12:
                    self.need = 0
                    break
                (n,) = _LONG.unpack_from(data, pos + 4)
                head = 12
            if end - pos - head < n:
                self.need = head + n
                break
            message = data[pos + head:pos + head + n]
            messages.append(bytes(message) if data is rest else message)  # type: ignore[arg-type]
            pos += head + n
        else:
            self.need = 0
        if data is rest:
            del rest[:pos]
        elif pos < end:
            rest += data[pos:]
        if not rest:
            self.need = 0
        return messages


def _take(stream: Iterator[Any], n: int) -> Iterator[Any]:
    from itertools import islice

    return islice(stream, n)


class _EpochState:
    """The bookkeeping of one epoch in the main process."""

    def __init__(self, number: int, indices: Iterator[Any] | None, workers: int) -> None:
        self.number = number
        self.indices = indices
        self.workers = workers
        self.next_task = 0  # the batch index handed out next
        self.next_out = 0  # the batch index yielded next
        self.ready: dict[int, tuple[Any, ...]] = {}
        self.pending: dict[int, int] = {}  # batch -> worker, being loaded
        self.per_worker = [0] * max(workers, 1)
        self.outstanding = 0
        self.exhausted = False
        self.active = list(range(workers))  # workers whose iterable is not exhausted
        self.gone: set[int] = set()  # workers that died
        self.death: tuple[int, str] | None = None  # the first death: worker, what to say
        self.starved = False  # the last dispatch found no free slot for a worker that could take a task
        self._turn = 0  # the position in ``active`` of the worker given the next batch

    def retire(self, worker: int) -> None:
        """An iterable-style worker is exhausted: the turn goes on among the others."""
        if worker in self.active:
            position = self.active.index(worker)
            self.active.remove(worker)
            if position < self._turn:
                self._turn -= 1
            if self.active:
                self._turn %= len(self.active)
            else:
                self._turn = 0


def _close_all() -> None:
    for loader in list(_live):
        with contextlib.suppress(Exception):
            loader.close()


atexit.register(_close_all)
