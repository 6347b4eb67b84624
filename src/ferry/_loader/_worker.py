"""A loader's worker process: fetch samples, collate them into a ring slot, send back a descriptor.

A worker makes no device call: it maps the ring's shared file and writes
bytes. Messages (pickled, over one pipe each way):

main -> worker
    ``(epoch, batch, indices, packed, slot, slot_bytes, slots)`` (:func:`encode_task`:
    packed without pickle when the indices are a range or int64 bytes): load ``batch``
    (``indices`` for a map-style dataset, int64 bytes when ``packed``;
    ``None`` for an iterable one: its next
    batch) into ``slot`` (``None``: no slot, send the batch itself). ``None``
    ends the worker.
worker -> main
    ``("ok", batch, worker, slot, plan, nbytes)``: written in the slot, where
    ``plan`` is ``(skeleton, layout)``; a batch laid out as this worker's
    previous ``"ok"`` batch (the common case: the main process keeps what it
    decoded from the last one) sends only :data:`SAME` instead (tag, batch,
    worker, slot; packed, no pickle); ``("fresh", batch, worker, slot,
    batch_object, nbytes)``: did not fit (or no slot), the batch itself;
    ``("end", batch, worker, slot)``: the iterable is exhausted; ``("error",
    batch, worker, slot, text, exception)``.

Tasks and ``"ok"`` descriptors are plain pickles sent as bytes
(:func:`encode`), or :data:`SAME`; the other messages go through
``Connection.send``. The main process reads every message waiting in a pipe
at once and cuts them apart (``Connection``'s framing).
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import signal
import struct
import sys
import threading
import traceback
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from .._errors import FerryError
from .._memory._ring import SharedFile, WorkerRing
from ._collate import collate_into, convert

__all__ = ["WorkerInfo", "get_worker_info", "LoaderWorkerError"]


class LoaderWorkerError(FerryError):
    """A :class:`ferry.DataLoader` worker failed: it raised loading a batch, it died, or it missed ``timeout``.

    Attributes
    ----------
    index
        The batch being loaded (``None`` when not known).
    worker
        The worker's id.
    traceback
        The worker's traceback text (empty for a worker that died).
    """

    def __init__(self, message: str, index: int | None = None, worker: int | None = None,
                 traceback: str = "") -> None:
        super().__init__(message)
        self.index = index
        self.worker = worker
        self.traceback = traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.index, self.worker, self.traceback)


@dataclass(frozen=True)
class WorkerInfo:
    """What :func:`get_worker_info` returns inside a :class:`ferry.DataLoader` worker.

    Attributes
    ----------
    id
        The worker's id, ``0 <= id < num_workers``.
    num_workers
        How many workers the loader runs.
    seed
        The worker's seed: the loader's base seed plus ``id`` (Python's
        ``random`` is seeded with it, PyTorch too when loaded; NumPy's global
        generator with a state derived from both, as PyTorch's workers do).
    dataset
        This worker's copy of the dataset.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any


_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current :class:`ferry.DataLoader` worker's :class:`WorkerInfo`; ``None`` outside a worker.

    An iterable-style dataset uses it to split its stream between workers,
    as with ``torch.utils.data.get_worker_info`` (which returns the same
    fields inside a ferry worker when PyTorch is loaded there).
    """
    return _info


def numpy_state(base_seed: int, worker_id: int) -> list[int]:
    """The NumPy seed of a worker, derived as PyTorch's workers derive it (a SeedSequence-style hash)."""
    init_a, mult_a, init_b, mult_b = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
    mix_l, mix_r, shift, mask = 0xCA01F9DD, 0x4973F715, 16, 0xFFFFFFFF
    entropy = [worker_id, base_seed & mask, base_seed >> 32, 0]
    const_a = init_a

    def hashed(value: int) -> int:
        nonlocal const_a
        value = (value ^ const_a) & mask
        const_a = (const_a * mult_a) & mask
        value = (value * const_a) & mask
        return (value ^ (value >> shift)) & mask

    def mix(x: int, y: int) -> int:
        result = (((mix_l * x) & mask) - ((mix_r * y) & mask)) & mask
        return (result ^ (result >> shift)) & mask

    pool = [hashed(e) for e in entropy]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashed(pool[src]))
    const_b = init_b
    state = []
    for entry in pool:
        value = (entry ^ const_b) & mask
        const_b = (const_b * mult_b) & mask
        value = (value * const_b) & mask
        state.append((value ^ (value >> shift)) & mask)
    return state


def seed_worker(base_seed: int, worker_id: int, num_workers: int, dataset: Any) -> None:
    """Seed Python, NumPy (and PyTorch when loaded) for one worker; set its WorkerInfo."""
    global _info
    seed = base_seed + worker_id
    random.seed(seed)
    np.random.seed(numpy_state(base_seed, worker_id))
    _info = WorkerInfo(worker_id, num_workers, seed, dataset)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
        try:  # so that datasets written for PyTorch's workers shard themselves here too
            from torch.utils.data._utils import worker as torch_worker

            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
        except Exception:
            pass


SAME_TAG = b"S"  # never a pickle's first byte (0x80)
SAME = struct.Struct("<cqqq")
"""The ``"ok"`` descriptor of a batch laid out as the worker's previous one: the tag, the batch, the
worker and the slot, packed (no pickle on either side)."""


TASK_TAG = b"T"
TASK = struct.Struct("<cqqqqqqqq")
"""A task whose indices are a ``range`` or packed int64 bytes (what the loader's own samplers give):
the tag, the epoch, the batch, the slot (-1: none), the slot's size, the slots, the indices' kind (1: a
range, 2: int64 bytes following the header), the range's start and stop (packed, no pickle)."""


def encode_task(epoch: int, batch: int, indices: Any, packed: bool, slot: int | None, slot_bytes: int,
                slots: int) -> bytes:
    """A task as bytes for ``Connection.recv_bytes`` (:func:`decode_task` reads it back)."""
    where = -1 if slot is None else slot
    if type(indices) is range and indices.step == 1:
        return TASK.pack(TASK_TAG, epoch, batch, where, slot_bytes, slots, 1, indices.start, indices.stop)
    if packed and type(indices) is bytes:
        return TASK.pack(TASK_TAG, epoch, batch, where, slot_bytes, slots, 2, 0, 0) + indices
    return encode((epoch, batch, indices, packed, slot, slot_bytes, slots))


def decode_task(data: bytes) -> Any:
    """What :func:`encode_task` (or a pickled message: ``None`` ends the worker) was given."""
    if data[:1] != TASK_TAG:
        return pickle.loads(data)
    _, epoch, batch, slot, slot_bytes, slots, kind, start, stop = TASK.unpack_from(data)
    indices: Any = range(start, stop) if kind == 1 else data[TASK.size:]
    return epoch, batch, indices, kind == 2, None if slot < 0 else slot, slot_bytes, slots


def encode(message: Any) -> bytes:
    """A small message (a task, a descriptor) as bytes for ``Connection.send_bytes``."""
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def same_plan(plan: Any, last: Any) -> bool:
    """Whether a batch's ``(skeleton, layout)`` equals the previous one's (never raises)."""
    if last is None:
        return False
    try:
        return bool(plan == last)
    except Exception:  # a host value that does not compare: send it again
        return False


def _error(batch: int, worker: int, slot: int | None) -> tuple[Any, ...]:
    exc = sys.exc_info()[1]
    text = traceback.format_exc()
    try:
        pickle.dumps(exc)
        original: Any = exc
    except Exception:
        original = None
    return ("error", batch, worker, slot, text, original)


def _alive(pid: int) -> bool:
    """Whether the main process still runs (under forkserver it is not this worker's parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_tasks(tasks: Any, inbox: queue.SimpleQueue[Any], parent: int) -> None:
    """Move tasks from the pipe to ``inbox`` as they come, so that the main process never blocks
    sending one while this worker blocks sending a large batch back. ``None`` at the end (asked for,
    the pipe closed, or the main process gone)."""
    first_parent = os.getppid()  # the main process, or under forkserver the server: either ends with it
    try:
        while True:
            if not tasks.poll(0.5):
                if os.getppid() != first_parent or not _alive(parent):
                    break
                continue
            task = decode_task(tasks.recv_bytes())
            if task is None:
                break
            inbox.put(task)
    except (EOFError, OSError):
        pass
    inbox.put(None)


def worker_loop(worker_id: int, num_workers: int, dataset: Any, iterable: bool, batch_size: int | None,
                drop_last: bool, collate_fn: Any, worker_init_fn: Any, base_seed: int, ring_file: SharedFile,
                tasks: Any, results: Any, parent: int) -> None:
    """The body of one worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    ring = WorkerRing(ring_file.fd)
    try:
        seed_worker(base_seed, worker_id, num_workers, dataset)
        init_failed = None
        if worker_init_fn is not None:
            try:
                worker_init_fn(worker_id)
            except Exception:
                init_failed = _error(-1, worker_id, None)
        stream: Any = None
        epoch = -1
        last_plan: Any = None  # the (skeleton, layout) of this worker's previous "ok" batch
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=_read_tasks, args=(tasks, inbox, parent), name="ferry-loader-tasks",
                         daemon=True).start()
        while True:
            task = inbox.get()
            if task is None:
                return
            task_epoch, batch, indices, packed, slot, slot_bytes, slots = task
            if packed:  # a slice of the loader's permutation, as int64 bytes
                indices = np.frombuffer(indices, np.int64).tolist()
            if init_failed is not None:
                results.send(("error", batch, worker_id, slot, *init_failed[4:]))
                continue
            try:
                if iterable and task_epoch != epoch:
                    stream, epoch = iter(dataset), task_epoch
                if iterable:
                    if batch_size is None:
                        samples: Any = next(stream)
                    else:
                        samples = list(islice(stream, batch_size))
                        if not samples or (drop_last and len(samples) < batch_size):
                            raise StopIteration
                elif batch_size is None:
                    samples = dataset[indices]
                else:
                    samples = [dataset[i] for i in indices]
                buffer = ring.slot(slot, slot_bytes, slots) if slot is not None else None
                fn = collate_fn if batch_size is not None else (collate_fn or convert)
                skeleton, layout, nbytes, fresh = collate_into(samples, fn, buffer)
                del buffer, samples
                if fresh is None:
                    plan: Any = (skeleton, layout)
                    if same_plan(plan, last_plan):  # the main process decoded it with the previous batch
                        results.send_bytes(SAME.pack(SAME_TAG, batch, worker_id, slot))
                    else:
                        last_plan = plan
                        results.send_bytes(encode(("ok", batch, worker_id, slot, plan, nbytes)))
                    del plan
                else:
                    results.send(("fresh", batch, worker_id, slot, fresh, nbytes))
                del fresh
            except StopIteration:
                results.send(("end", batch, worker_id, slot))
            except Exception:
                results.send(_error(batch, worker_id, slot))
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        return
    finally:
        ring.close()
