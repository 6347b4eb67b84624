"""The ``pipeline`` group: a training-style input pipeline with real device work.

Each step uploads a pageable NumPy batch (float32), runs device work on it
(matrix products calibrated to a target time, then ``result = 2 * batch +
shift``) and downloads the result, which is as large as the batch, into a
NumPy array. Uploads run ``DEPTH`` (2) steps ahead of the work: the upload of
step k + 2 is submitted as step k begins, before it is handed the batch of
step k (so two uploads run while step k computes, as in ``ferry.prefetch``
and PyTorch's pinning thread). The result of step k is waited for during step
k + 1. Four configurations: batches of 8 MiB and 32 MiB, each
with ~8 ms of device work per step (compute-bound) and ~1 ms
(transfer-bound).

Contenders (one ``Result`` each per configuration, ``impl``/``route``):

``floor/work_only``       the device work alone, on inputs already on the device
``floor/transfers_only``  ferry's uploads and downloads alone, pipelined the same way
``ferry/fresh``           the hand-written pipeline on ``rt.upload(batch)`` (a fresh
                          device array per batch), ``hand_off`` to the consumer's stream,
                          consumed through DLPack, results by ``rt.download`` into
                          reused outputs registered once (``rt.register``, untimed): the
                          analog of PyTorch's pinned result tensors below
``ferry/ring``            the same, uploading into a ring of reused device arrays
``ferry/prefetch``        ``ferry.prefetch(batches, depth=2, ...)`` (when ferry has it)
``torch/cuda``            ``torch.from_numpy(batch).cuda()``, result copied back with ``copy_``
``torch/best``            PyTorch's best practice: a pinning thread (``pin_memory()``)
                          feeding a queue, ``non_blocking`` copies on a side stream
                          ordered by events and ``record_stream``, results downloaded
                          ``non_blocking`` on a second side stream into pinned tensors

Timing: a run is ``warmup + steps`` steps; the host stamps each result's
arrival, and the run's sample is the time per step of its steady state
(:func:`run_sample`: results ``warmup - 1`` to the last but one; the ramp-up
and the drain excluded): the least-squares slope of those stamps against the
step number (:func:`steady_step`). The drain is the last result: it is waited
for right after the one before it arrived, so it waits behind a whole step of
device work with nothing queued after it, which no steady-state step does (a
ferry wait that outlasted its spin slept, and woke 130 - 600 us after the copy
on the H200, until waits napped; PyTorch's ``event.synchronize()`` spins). A stamp taken
late at either end of the window moves the slope ~``steps / 6`` times less
than the two-ended difference ``(last - first) / steps``; a stall inside it
counts by where it falls (see :func:`steady_step`). Each contender of
a configuration runs once untimed, then the timed runs go round by round,
every contender once per round, so that a drift of the machine (clocks, other
tenants) lands on all of them alike; the median is reported.

Verification, outside the timed region: batch k holds ``4096 * (k + 1) +
(i % 4096)`` at element i, so the expected result of every step is known in
closed form; every run uses its own ``shift``, and before every run one
element per KiB of every output is poisoned, so a result that was not
downloaded (or came from another step or run) fails. Every output of every
run is checked in full.

On the emulated device the device work is a stand-in on a side stream (a
delayed fill of a scratch array, then a device-to-device copy of the batch:
``result = batch``), so the ferry contenders, the floors and the checks'
plumbing run in CI; the PyTorch contenders need a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import math
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import testing
from .._errors import FerryError
from ._protocol import Result

__all__: list[str] = []

MiB = 1 << 20
DEPTH = 2
# A ring slot is reused once the step that used it has been waited for: the upload of step k + DEPTH
# is submitted as step k starts, when steps k - 1 (not yet waited) and k may still read their slots.
RING = DEPTH + 2
ROW = 4096  # the batch pattern's period, in elements
POISON_STRIDE = 256  # one poisoned float per KiB of every output

CONTENDERS: list[tuple[str, str]] = [
    ("floor", "work_only"),
    ("floor", "transfers_only"),
    ("ferry", "fresh"),
    ("ferry", "ring"),
    ("ferry", "prefetch"),
    ("torch", "cuda"),
    ("torch", "best"),
]


@dataclass(frozen=True)
class Config:
    """One configuration: batch size and the device work per step."""

    nbytes: int
    work_s: float

    @property
    def label(self) -> str:
        return f"{self.nbytes // MiB} MiB, {self.work_s * 1e3:g} ms"


@dataclass(frozen=True)
class Plan:
    configs: list[Config]
    steps: int
    warmup: int
    repeats: int


def plan(emulated: bool, quick: bool) -> Plan:
    """What the group runs: four configurations on a GPU, two small ones on the emulated device."""
    if emulated:
        return Plan([Config(8 * MiB, 8e-3), Config(8 * MiB, 1e-3)], steps=6, warmup=3, repeats=2)
    configs = [Config(n * MiB, w) for n in (8, 32) for w in (8e-3, 1e-3)]
    # 40 timed steps and five runs in either mode: a late stamp or a stall moves a 20-step run's sample
    # twice as much, and the machine's noise comes in bursts over consecutive rounds (on the
    # H200 VMs), which a median of three runs does not outvote
    return Plan(configs, steps=40, warmup=3 if quick else 4, repeats=5)


def case_count(emulated: bool, quick: bool) -> int:
    return len(plan(emulated, quick).configs) * len(CONTENDERS)


# -- batches and their verification ------------------------------------------------------------------


class Batches:
    """``count`` pageable float32 batches of ``nbytes`` each, with a pattern known in closed form."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.n = nbytes // 4
        ramp = np.tile(np.arange(ROW, dtype=np.float32), self.n // ROW)
        self.arrays = []
        for k in range(count):
            array = np.empty(self.n, np.float32)
            np.add(ramp, self.base(k), out=array)
            self.arrays.append(array)
        self.ramp = np.arange(ROW, dtype=np.float32)

    @staticmethod
    def base(k: int) -> float:
        return float(ROW * (k + 1))

    def expected_row(self, k: int, scale: float, shift: float) -> np.ndarray[Any, Any]:
        """Row of the expected result of step k (every value exact in float32)."""
        row: np.ndarray[Any, Any] = (self.ramp + np.float32(self.base(k))) * np.float32(scale) + np.float32(shift)
        return row

    def check(self, out: np.ndarray[Any, Any], k: int, scale: float, shift: float) -> bool:
        rows = out.reshape(-1, ROW)
        return bool((rows == self.expected_row(k, scale, shift)).all())


def poison(outs: list[np.ndarray[Any, Any]]) -> None:
    for out in outs:
        out[::POISON_STRIDE] = np.nan


# -- device work --------------------------------------------------------------------------------------


class Work:
    """Device work for one target time: ``step(x, shift)`` enqueues it and returns the result array."""

    kind = "?"
    scale = 2.0  # result = scale * batch + shift
    detail = ""
    step_s = 0.0  # device time of one step, as calibrated

    def consumer(self) -> Any:
        """The stream the work runs on (for ``hand_off`` and ``ferry.prefetch``)."""
        raise NotImplementedError

    def wrap(self, dev: Any) -> Any:
        """A ferry device array as this library's array (DLPack)."""
        raise NotImplementedError

    def step(self, x: Any, shift: float) -> Any:
        raise NotImplementedError

    def resident(self, host: np.ndarray[Any, Any]) -> Any:
        """A copy of ``host`` on the device, in this library's arrays (untimed setup)."""
        raise NotImplementedError

    def mark(self) -> Any:
        """An event recorded on the consumer's stream now."""
        raise NotImplementedError

    def wait_mark(self, mark: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


def _median_time(run: Callable[[], float], reps: int = 3) -> float:
    return statistics.median(run() for _ in range(reps))


class _MatmulWork(Work):
    """Matrix products (float32, m x m, ``count`` of them) calibrated with CUDA events."""

    SIZES = (4096, 2048, 1024, 512)

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s
        self._warm_clocks()
        m = self.SIZES[-1]
        one = 0.0
        for m in self.SIZES:
            one = self._events_time(m, 8) / 8
            if target_s / one >= 6:
                break
        count = max(1, round(target_s / one))
        for _ in range(4):  # correct the count until a whole step is within 5% of the target
            measured = self._events_time(m, count)
            if abs(measured - target_s) <= 0.05 * target_s:
                break
            count = max(1, round(count * target_s / measured))
        else:
            measured = self._events_time(m, count)
        self.m, self.count = m, count
        self.step_s = measured
        self.detail = (f"{self.kind} matmul {m}x{m} float32 x {count}: {self.step_s * 1e3:.2f} ms per step "
                       f"(CUDA events; target {target_s * 1e3:g} ms)")

    def _warm_clocks(self) -> None:
        """~0.3 s of matrix products so that the clocks are up before calibrating."""
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            self._events_time(self.SIZES[0], 4)

    def _operands(self, m: int) -> None:
        raise NotImplementedError

    def _events_time(self, m: int, count: int) -> float:
        raise NotImplementedError


class TorchWork(_MatmulWork):
    kind = "torch"

    def __init__(self, torch: Any, target_s: float) -> None:
        self.torch = torch
        self._ops: dict[int, tuple[Any, Any, Any]] = {}
        super().__init__(target_s)
        self.a, self.b, self.c = self._ops[self.m]
        self._ops.clear()

    def _events_time(self, m: int, count: int) -> float:
        torch = self.torch
        if m not in self._ops:
            gen = torch.Generator(device="cuda").manual_seed(m)
            a = torch.randn(m, m, device="cuda", generator=gen) / math.sqrt(m)
            self._ops[m] = (a, a.clone(), torch.empty(m, m, device="cuda"))
        a, b, c = self._ops[m]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def once() -> float:
            start.record()
            for _ in range(count):
                torch.matmul(a, b, out=c)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        once()  # a new size's first products pay the library's set-up
        return _median_time(once)

    def consumer(self) -> Any:
        return self.torch.cuda.current_stream()

    def wrap(self, dev: Any) -> Any:
        return self.torch.from_dlpack(dev)

    def step(self, x: Any, shift: float) -> Any:
        matmul, a, b, c = self.torch.matmul, self.a, self.b, self.c
        for _ in range(self.count):
            matmul(a, b, out=c)
        return x.mul(self.scale).add_(shift)

    def resident(self, host: np.ndarray[Any, Any]) -> Any:
        return self.torch.from_numpy(host).cuda()

    def mark(self) -> Any:
        event = self.torch.cuda.Event()
        event.record()
        return event

    def wait_mark(self, mark: Any) -> None:
        mark.synchronize()


class CupyWork(_MatmulWork):
    kind = "cupy"

    def __init__(self, cupy: Any, target_s: float) -> None:
        self.cupy = cupy
        self._ops: dict[int, tuple[Any, Any, Any]] = {}
        super().__init__(target_s)
        self.a, self.b, self.c = self._ops[self.m]
        self._ops.clear()

    def _events_time(self, m: int, count: int) -> float:
        cupy = self.cupy
        if m not in self._ops:
            a = (cupy.random.default_rng(m).standard_normal((m, m), dtype=cupy.float32) / math.sqrt(m)).astype(
                cupy.float32)
            self._ops[m] = (a, a.copy(), cupy.empty((m, m), cupy.float32))
        a, b, c = self._ops[m]
        start, end = cupy.cuda.Event(), cupy.cuda.Event()

        def once() -> float:
            start.record()
            for _ in range(count):
                cupy.matmul(a, b, out=c)
            end.record()
            end.synchronize()
            return float(cupy.cuda.get_elapsed_time(start, end)) / 1e3

        once()  # a new size's first products pay the library's set-up
        return _median_time(once)

    def consumer(self) -> Any:
        return self.cupy.cuda.get_current_stream()

    def wrap(self, dev: Any) -> Any:
        return self.cupy.from_dlpack(dev)

    def step(self, x: Any, shift: float) -> Any:
        matmul, a, b, c = self.cupy.matmul, self.a, self.b, self.c
        for _ in range(self.count):
            matmul(a, b, out=c)
        y = x * self.cupy.float32(self.scale)
        y += self.cupy.float32(shift)
        return y

    def resident(self, host: np.ndarray[Any, Any]) -> Any:
        return self.cupy.asarray(host)

    def mark(self) -> Any:
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record()
        return event

    def wait_mark(self, mark: Any) -> None:
        mark.synchronize()


class EmulatedWork(Work):
    """The stand-in on the emulated device: on a side stream, a fill of a scratch array after
    ``target_s`` (the "kernel"), then a device-to-device copy of the batch into a result array
    from a ring: ``result = batch``. The result is exported with the side stream named, so
    ferry's download orders itself after the stand-in."""

    kind = "emulated"
    scale = 1.0

    def __init__(self, rt: Any, target_s: float, nbytes: int) -> None:
        self.rt = rt
        self.target_s = self.step_s = target_s
        self.backend = testing.backend_of(rt)
        self.handle = testing.side_stream(rt)
        self.stream = self.backend.stream_from_handle(self.handle)
        self.scratch = rt.empty(4096, np.uint8)
        self.results = [rt.empty(nbytes // 4, np.float32) for _ in range(RING + 1)]
        self.turn = 0
        self.events: list[Any] = []
        self.detail = f"emulated stand-in: {target_s * 1e3:g} ms on a side stream, then result = batch"

    def consumer(self) -> Any:
        return self.handle

    def wrap(self, dev: Any) -> Any:
        return dev

    def step(self, x: Any, shift: float) -> Any:
        testing.produce(self.rt, self.handle, self.scratch.ptr, 4096, self.turn & 0xFF, delay=self.target_s)
        result = self.results[self.turn % len(self.results)]
        self.turn += 1
        self.backend.memcpy_dtod(result.ptr, x.ptr, x.nbytes, self.stream)
        return testing.ForeignArray(result, stream=self.handle)

    def resident(self, host: np.ndarray[Any, Any]) -> Any:
        return self.rt.to_device(host)

    def mark(self) -> Any:
        event = self.backend.event_create()
        self.backend.event_record(event, self.stream)
        self.events.append(event)
        return event

    def wait_mark(self, mark: Any) -> None:
        self.backend.event_synchronize(mark)

    def close(self) -> None:
        self.backend.stream_synchronize(self.stream)
        for event in self.events:
            self.backend.event_destroy(event)
        self.events.clear()
        for array in [self.scratch, *self.results]:
            array.close()


def make_work(ctx: Any, target_s: float, nbytes: int) -> Work:
    if ctx.rt.backend == "emulated":
        return EmulatedWork(ctx.rt, target_s, nbytes)
    if "torch" in ctx.peers:
        return TorchWork(ctx.peers["torch"].torch, target_s)
    if "cupy" in ctx.peers:
        return CupyWork(ctx.peers["cupy"].cupy, target_s)
    raise LookupError("no device work: neither PyTorch nor CuPy is usable here")


# -- one run of a contender ---------------------------------------------------------------------------


@dataclass
class Run:
    """What every contender's run needs."""

    rt: Any
    work: Work
    batches: Batches
    outs: list[Any]  # per step: where the result lands (NumPy arrays)
    total: int
    shift: float
    stamps: list[float]
    last: Any = None  # work_only: the last step's result, checked after the run
    handles: list[Any] = field(default_factory=list)  # every ferry transfer submitted, for drain()

    def done(self) -> None:
        self.stamps.append(time.perf_counter())

    def pending(self, handle: Any) -> Any:
        self.handles.append(handle)
        return handle

    def drain(self) -> None:
        """After a failure: wait for whatever is still in flight (buffers back, flags restored)."""
        for handle in self.handles:
            with contextlib.suppress(Exception):
                handle.wait()
        self.handles.clear()


def steady_step(stamps: list[float]) -> float:
    """Seconds per step of a steady state: the least-squares slope of the arrival ``stamps``
    against the step number (``stamps[i]`` is step ``i``'s; at least two).

    An error of ``d`` in an end stamp moves it by ``6 d / (n (n + 1))`` (n stamps), where it moves
    ``(stamps[-1] - stamps[0]) / (n - 1)`` by ``d / (n - 1)``. A stall inside the window moves both,
    the slope by ~0.15x (next to an end) to 1.5x (in the middle) of the two-ended figure's amount:
    the same only on average over where the stall falls.
    """
    if len(stamps) < 2:
        raise ValueError("a steady state needs at least two stamps")
    t = np.asarray(stamps, dtype=np.float64) - stamps[0]
    k = np.arange(len(t), dtype=np.float64)
    k -= k.mean()
    return float(np.dot(k, t - t.mean()) / np.dot(k, k))


def run_sample(stamps: list[float], warmup: int) -> float:
    """A run's sample from its result arrivals: the slope of its steady state, ``stamps[warmup - 1]``
    (the last ramp-up result) to ``stamps[-2]`` (the last but one: the drain is left out)."""
    return steady_step(stamps[warmup - 1:-1])


def _finish(downs: deque[tuple[Any, Any, Any]], run: Run) -> None:
    upload, download, _keep = downs.popleft()
    download.wait()
    if upload is not None:
        upload.wait()
    run.done()


def _take(upload: Any, stream: Any, fallbacks: list[int]) -> tuple[Any, Any]:
    """The destination of ``upload`` handed to ``stream`` (a staged upload on CUDA: after a host
    wait for it); one that cannot be handed off (the pure-Python engine) is waited for instead."""
    try:
        return upload, upload.hand_off(stream)
    except FerryError:
        fallbacks[0] += 1
        return None, upload.wait()[1]


def run_ferry(run: Run, *, ring: bool) -> str:
    """The hand-written ferry pipeline: ``rt.upload`` DEPTH steps ahead, ``hand_off``, DLPack,
    ``rt.download`` of the result, each result waited for one step later."""
    rt, work, batches = run.rt, run.work, run.batches.arrays
    slots = [rt.empty(run.batches.n, np.float32) for _ in range(RING)] if ring else []
    ups: deque[Any] = deque()
    downs: deque[tuple[Any, Any, Any]] = deque()
    fallbacks = [0]
    consumer = work.consumer()

    def submit(j: int) -> None:
        ups.append(run.pending(rt.upload(batches[j], slots[j % RING] if ring else None)))

    for j in range(min(DEPTH, run.total)):
        submit(j)
    for k in range(run.total):
        if k + DEPTH < run.total:
            submit(k + DEPTH)  # DEPTH uploads run while step k computes; its ring slot's step k - 2 was waited
        upload, dev = _take(ups.popleft(), consumer, fallbacks)
        x = work.wrap(dev)
        y = work.step(x, run.shift)
        downs.append((upload, run.pending(rt.download(y, run.outs[k])), (x, dev, y)))
        if len(downs) > 1:
            _finish(downs, run)
    while downs:
        _finish(downs, run)
    return _fallback_note(fallbacks[0], run.total)


def _fallback_note(fallbacks: int, total: int) -> str:
    return f"hand_off refused (staged upload, Python engine): waited {fallbacks}/{total}" if fallbacks else ""


def run_transfers_only(run: Run) -> str:
    """ferry's uploads and downloads alone (ring of device arrays, same depth): the batch itself
    is downloaded, ordered after its upload on the device."""
    rt, batches = run.rt, run.batches.arrays
    slots = [rt.empty(run.batches.n, np.float32) for _ in range(RING)]
    ups: deque[Any] = deque()
    downs: deque[tuple[Any, Any, Any]] = deque()
    fallbacks = [0]
    for j in range(min(DEPTH, run.total)):
        ups.append(run.pending(rt.upload(batches[j], slots[j % RING])))
    for k in range(run.total):
        if k + DEPTH < run.total:  # the same order as run_ferry
            ups.append(run.pending(rt.upload(batches[k + DEPTH], slots[(k + DEPTH) % RING])))
        upload, dev = _take(ups.popleft(), None, fallbacks)
        downs.append((upload, run.pending(rt.download(dev, run.outs[k])), dev))
        if len(downs) > 1:
            _finish(downs, run)
    while downs:
        _finish(downs, run)
    return _fallback_note(fallbacks[0], run.total)


def run_work_only(run: Run, resident: list[Any]) -> str:
    """The device work alone on inputs already on the device; each step's end is an event."""
    work = run.work
    marks: deque[tuple[Any, Any]] = deque()
    for k in range(run.total):
        y = work.step(resident[k % len(resident)], run.shift)
        run.last = y
        marks.append((work.mark(), y))
        if len(marks) > 1:
            work.wait_mark(marks.popleft()[0])
            run.done()
    while marks:
        work.wait_mark(marks.popleft()[0])
        run.done()
    return ""


def run_prefetch(run: Run, prefetch: Callable[..., Any]) -> str:
    """``ferry.prefetch`` feeding the same work; results by ``rt.download``."""
    rt, work = run.rt, run.work
    if work.kind in ("torch", "cupy"):
        source = prefetch(run.batches.arrays[: run.total], depth=DEPTH, runtime=rt, to=work.kind)
    else:
        source = prefetch(run.batches.arrays[: run.total], depth=DEPTH, runtime=rt, stream=work.consumer())
    downs: deque[tuple[Any, Any, Any]] = deque()
    count = 0
    try:
        for k, x in enumerate(source):
            y = work.step(x, run.shift)
            downs.append((None, run.pending(rt.download(y, run.outs[k])), (x, y)))
            count += 1
            if len(downs) > 1:
                _finish(downs, run)
        while downs:
            _finish(downs, run)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    if count != run.total:
        raise RuntimeError(f"ferry.prefetch yielded {count} batches, not {run.total}")
    return ""


def run_torch_cuda(run: Run, torch: Any) -> str:
    """The naive PyTorch loop: ``.cuda()`` of the pageable batch, a blocking ``copy_`` back."""
    work, batches = run.work, run.batches.arrays
    outs = [torch.from_numpy(o) for o in run.outs]
    for k in range(run.total):
        x = torch.from_numpy(batches[k]).cuda()
        y = work.step(x, run.shift)
        outs[k].copy_(y)
        run.done()
    return ""


def run_torch_best(run: Run, torch: Any, pinned_outs: list[Any]) -> str:
    """PyTorch's best practice, as a DataLoader with ``pin_memory=True`` and NVIDIA's
    data_prefetcher recipe: a pinning thread, ``non_blocking`` copies on a side stream, the
    compute stream ordered after each batch's copy (its event; ``wait_stream`` in the recipe,
    which at depth 2 would also wait for the next batch) and ``record_stream`` for the
    allocator; results copied ``non_blocking`` on a second side stream into pinned tensors."""
    work, batches = run.work, run.batches.arrays
    pinned: queue.Queue[Any] = queue.Queue(maxsize=DEPTH)
    stop = threading.Event()

    def offer(item: Any) -> None:
        while not stop.is_set():
            try:
                pinned.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def pin() -> None:
        try:
            for j in range(run.total):
                offer(torch.from_numpy(batches[j]).pin_memory())
        except BaseException as exc:
            offer(exc)

    thread = threading.Thread(target=pin, name="ferry-bench-pin-memory", daemon=True)
    thread.start()
    copy_stream, down_stream = torch.cuda.Stream(), torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    inflight: deque[tuple[Any, Any]] = deque()
    downs: deque[Any] = deque()

    def prefetch() -> None:
        host = pinned.get(timeout=120)
        if isinstance(host, BaseException):
            raise host
        with torch.cuda.stream(copy_stream):
            dev = host.to("cuda", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copy_stream)
        inflight.append((dev, ready))

    def finish() -> None:
        downs.popleft().synchronize()
        run.done()

    try:
        for _ in range(min(DEPTH, run.total)):
            prefetch()
        for k in range(run.total):
            x, ready = inflight.popleft()
            compute.wait_event(ready)
            x.record_stream(compute)
            y = work.step(x, run.shift)
            down_stream.wait_stream(compute)
            with torch.cuda.stream(down_stream):
                pinned_outs[k].copy_(y, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(down_stream)
            y.record_stream(down_stream)
            downs.append(landed)
            if len(downs) > 1:
                finish()
            if k + DEPTH < run.total:
                prefetch()
        while downs:
            finish()
    finally:
        stop.set()
        thread.join(timeout=30)
    return ""


# -- the group ----------------------------------------------------------------------------------------


def group_pipeline(ctx: Any) -> None:
    """Run every configuration's contenders, interleaved round by round; one ``Result`` per contender
    and configuration."""
    import ferry

    emulated = ctx.rt.backend == "emulated"
    p = plan(emulated, ctx.quick)
    total = p.warmup + p.steps
    works: dict[tuple[float, int], Work] = {}  # calibrated once per target (the stand-in: per size too)
    why_no_work: dict[tuple[float, int], str] = {}
    shifts = iter(range(1, 1 << 20))
    torch = ctx.peers["torch"].torch if "torch" in ctx.peers else None
    prefetch = getattr(ferry, "prefetch", None)
    try:
        for config in p.configs:
            batches = Batches(config.nbytes, total)
            outs = [np.full(batches.n, np.nan, np.float32) for _ in range(total)]
            pinned_outs: list[Any] = []
            key = (config.work_s, config.nbytes if emulated else 0)
            if key not in works and key not in why_no_work:
                try:
                    works[key] = make_work(ctx, config.work_s, config.nbytes)
                except Exception as exc:
                    why_no_work[key] = f"no device work: {exc!r}"
            work = works.get(key)
            contenders: list[Contender] = []
            for impl, route in CONTENDERS:
                ctx.progress(f"pipeline: {impl} {route} [{config.label}]")
                result = Result("pipeline", impl, route, "both", config.nbytes, config=config.label)
                ctx.results.append(result)
                if work is None:
                    result.note = why_no_work.get(key, "no device work")
                    continue
                skip = _why_skip(impl, route, ctx, torch, prefetch)
                if skip:
                    result.note = f"skipped: {skip}"
                    continue
                if impl == "torch" and route == "best" and not pinned_outs and torch is not None:
                    pinned_outs = [torch.empty(batches.n, dtype=torch.float32, pin_memory=True)
                                   for _ in range(total)]
                contenders.append(Contender(result, p, work, batches, outs, pinned_outs, ctx, torch, prefetch))
            with contextlib.ExitStack() as registered:
                if any(c.registers for c in contenders):
                    # ferry's analog of PyTorch's pinned result tensors: the reused outputs are
                    # registered once, untimed, so each result is one DMA with no host copy
                    for out in outs:
                        registered.enter_context(ctx.rt.register(out))
                try:
                    for attempt in range(1 + p.repeats):  # the first round is untimed
                        for contender in contenders:
                            contender.run(float(next(shifts)), timed=attempt > 0)
                finally:
                    for contender in contenders:
                        contender.finish()
            del batches, outs, pinned_outs, contenders
            gc.collect()
    finally:
        for work in works.values():
            work.close()
        ctx.rt.poll()


def _why_skip(impl: str, route: str, ctx: Any, torch: Any, prefetch: Any) -> str:
    if impl == "torch":
        if ctx.rt.backend == "emulated":
            return "PyTorch needs a GPU (emulated device)"
        if torch is None:
            return "PyTorch is not usable here"
    if route == "prefetch" and prefetch is None:
        return "this ferry has no ferry.prefetch"
    return ""


class Contender:
    """One contender of one configuration: its runs, each verified in full, and its result.

    ``registers``: it downloads into the shared outputs, which the caller
    registers once (``rt.register``) for every such contender. A run that
    raises or verifies wrong makes the contender invalid: its later runs are
    skipped, what it left in flight is waited for.
    """

    def __init__(self, result: Result, p: Plan, work: Work, batches: Batches, outs: list[Any],
                 pinned_outs: list[Any], ctx: Any, torch: Any, prefetch: Any) -> None:
        self.result, self.p, self.work, self.batches = result, p, work, batches
        self.outs, self.pinned_outs, self.ctx, self.torch, self.prefetch = outs, pinned_outs, ctx, torch, prefetch
        route = result.route
        self.registers = result.impl in ("ferry", "floor") and route != "work_only"
        self.resident: list[Any] = []
        if route == "work_only":
            self.resident = [work.resident(batches.arrays[j]) for j in range(RING)]
        self.landing = pinned_outs if route == "best" else outs
        self.notes: list[str] = []
        self.valid = True

    def run(self, shift: float, *, timed: bool) -> None:
        """One run (skipped once invalid); a timed one adds its per-step sample."""
        if not self.valid:
            return
        result, p, work, batches = self.result, self.p, self.work, self.batches
        impl, route = result.impl, result.route
        rt = self.ctx.rt
        total = p.warmup + p.steps
        run: Run | None = None
        try:
            if route != "work_only":
                poison([o.numpy() for o in self.landing] if route == "best" else self.landing)
            run = Run(rt, work, batches, self.outs, total, shift, [])
            if route == "work_only":
                note = run_work_only(run, self.resident)
            elif route == "transfers_only":
                note = run_transfers_only(run)
            elif impl == "ferry" and route in ("fresh", "ring"):
                note = run_ferry(run, ring=route == "ring")
            elif route == "prefetch":
                note = run_prefetch(run, self.prefetch)
            elif route == "cuda":
                note = run_torch_cuda(run, self.torch)
            else:
                note = run_torch_best(run, self.torch, self.pinned_outs)
            if note and note not in self.notes:
                self.notes.append(note)
            if len(run.stamps) != total:
                raise RuntimeError(f"{len(run.stamps)} results arrived, not {total}")
            identity = route == "transfers_only" or work.kind == "emulated"
            scale, offset = (1.0, 0.0) if identity else (work.scale, shift)
            if route == "work_only":  # the last step's result, fetched untimed
                j = (total - 1) % len(self.resident)
                last = rt.download(run.last).wait()[1]
                wrong = [] if batches.check(last, j, scale, offset) else [total - 1]
            else:
                hosts = [o.numpy() for o in self.landing] if route == "best" else self.landing
                wrong = [k for k in range(total) if not batches.check(hosts[k], k, scale, offset)]
            if wrong:
                self.valid = False
                self.notes.append(f"run with shift {shift:g}: wrong results at steps {wrong[:8]}")
                return
            if timed:
                result.samples.append(run_sample(run.stamps, p.warmup))
            run.handles.clear()
        except Exception as exc:
            self.valid = False
            self.notes.append(f"error: {exc!r}")
            if run is not None:
                run.drain()

    def finish(self) -> None:
        """Give the resident inputs back; the result's validity and notes."""
        self.resident = []
        self.ctx.rt.poll()
        result = self.result
        result.valid = self.valid
        notes = list(self.notes)
        if result.route == "work_only":
            notes.insert(0, self.work.detail)
        result.note = "; ".join(notes)


def _contend(
    result: Result, p: Plan, work: Work, batches: Batches, outs: list[Any], pinned_outs: list[Any],
    shifts: Any, ctx: Any, torch: Any, prefetch: Any,
) -> None:
    """One contender alone: one untimed run, then ``p.repeats`` timed runs, each verified in full
    (``benchmarks/probe_pipeline.py`` interleaves contenders itself)."""
    contender = Contender(result, p, work, batches, outs, pinned_outs, ctx, torch, prefetch)
    with contextlib.ExitStack() as registered:
        if contender.registers:
            for out in outs:
                registered.enter_context(ctx.rt.register(out))
        try:
            for attempt in range(1 + p.repeats):
                contender.run(float(next(shifts)), timed=attempt > 0)
        finally:
            contender.finish()
