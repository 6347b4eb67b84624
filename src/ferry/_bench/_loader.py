"""The ``loader`` group: real worker processes feeding real training, five ways.

Workloads (on a GPU, with PyTorch; the image one with torchvision too):

``image``    ResNet-18 (bf16 autocast, SGD with momentum) on batches of 256 x 3 x 128 x 128
             float32 (48 MiB); a sample is one image.
``tabular``  an MLP (1024 -> 4096 -> 4096 -> 4096 -> 10, bf16 autocast, AdamW) on 32 MiB
             batches of 8192 rows of 1024 float32; a sample is a block of 64 rows.

Contenders, in one run, every one over the same batches in the same order:

``floor/resident``            the batches already on the GPU (uploaded before, untimed)
``torch/cuda``                ``torch.utils.data.DataLoader`` + ``.cuda()``
``torch/pinned_non_blocking`` ``DataLoader(pin_memory=True)`` + ``.cuda(non_blocking=True)``
``ferry/prefetch``            ``ferry.prefetch(DataLoader(...), to="torch")``
``ferry/dataloader``          ``ferry.DataLoader(..., to="torch")``

Every loader has the same workers (fork, ``persistent_workers``, ``prefetch_factor=4``) and
the same dataset: samples drawn from a pool of random arrays (a prime number of them, so every
batch differs), the label being the sample's index. Each contender runs one untimed epoch (workers
start, the ring is sized), then timed epochs round by round with the other contenders. An
epoch's time per step is measured from its ``warmup``-th step to its end, between two device
synchronizations. Inside each step a device-side checksum of the batch (the float64 sum of the
images, the index-weighted sum of the labels) is computed; after the epoch every checksum is
compared with the resident run's: a batch that was wrong, late or out of order fails the row.

The main thread's CPU time inside the loader (``time.thread_time`` around taking the next batch
and, for PyTorch's loaders, its ``.cuda()`` calls; waiting excluded, as the clock excludes it)
is reported per batch as a second row per contender (the median batch; its note gives each epoch's
mean, where a rare long batch shows). ferry's loader waits by sleeping (poll on the workers' pipes,
blocking-sync events), so none of its waiting is counted as CPU. The ring's pinned size is reported
after each epoch and must not grow after the first.

On the emulated device (no PyTorch needed) the sizes are tiny, the step is the checksum
alone (computed after a download: the emulated device cannot compute), and only the resident
and ``ferry.DataLoader`` contenders run, so that CI exercises the group.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import importlib
import importlib.util
import os
import pstats
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._protocol import Result

__all__: list[str] = []

MiB = 1 << 20
POOL = 61  # distinct samples in a dataset (prime: every batch differs from the others)
CONTENDERS: list[tuple[str, str]] = [
    ("floor", "resident"),
    ("torch", "cuda"),
    ("torch", "pinned_non_blocking"),
    ("ferry", "prefetch"),
    ("ferry", "dataloader"),
]


@dataclass(frozen=True)
class Workload:
    name: str
    sample: tuple[int, ...]  # one sample's shape (float32)
    batch: int  # samples per batch

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.sample)) * 4 * self.batch


@dataclass(frozen=True)
class Plan:
    workloads: list[Workload]
    warmup: int
    steps: int  # timed steps per epoch
    rounds: int  # timed epochs per contender
    workers: int


def plan(emulated: bool, quick: bool) -> Plan:
    if emulated:
        return Plan([Workload("tabular", (4, 64), 8)], warmup=2, steps=6, rounds=1, workers=2)
    workers = max(1, min(6, (os.cpu_count() or 2) - 2))
    work = [Workload("image", (3, 128, 128), 256), Workload("tabular", (64, 1024), 128)]
    return Plan(work, warmup=5, steps=20 if quick else 40, rounds=2 if quick else 3, workers=workers)


def case_count(emulated: bool, quick: bool) -> int:
    return len(plan(emulated, quick).workloads) * len(CONTENDERS)


class PoolDataset:
    """Map-style: sample ``i`` is ``(pool[i % POOL], i)``, the pool being random float32 arrays."""

    def __init__(self, shape: tuple[int, ...], length: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.pool = [rng.standard_normal(shape, dtype=np.float32) for _ in range(POOL)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        return self.pool[i % POOL], i


def group_loader(ctx: Any) -> None:
    """Every workload's contenders, interleaved round by round; two rows per contender (step time,
    main-thread CPU per batch)."""
    emulated = ctx.rt.backend == "emulated"
    p = plan(emulated, ctx.quick)
    torch = ctx.peers["torch"].torch if "torch" in ctx.peers else None
    for workload in p.workloads:
        if emulated:
            _emulated(ctx, p, workload)
            continue
        why = None if torch is not None else "PyTorch is not installed: no training to feed"
        if why is None and workload.name == "image" and importlib.util.find_spec("torchvision") is None:
            why = "torchvision is not installed (MLP only)"
        if why is not None:
            for impl, route in CONTENDERS:
                ctx.results.append(Result("loader", impl, f"{workload.name}: {route}", "h2d", workload.nbytes,
                                          note=f"skipped: {why}"))
            continue
        _on_gpu(ctx, p, workload, torch)
        gc.collect()


# -- one contender's epochs ---------------------------------------------------------------------------------
class _Row:
    def __init__(self, ctx: Any, impl: str, route: str, workload: Workload) -> None:
        self.step = Result("loader", impl, f"{workload.name}: {route}", "h2d", workload.nbytes)
        self.cpu = Result("loader", impl, f"{workload.name}: {route}, main-thread CPU per batch in the loader",
                          "host", workload.nbytes)
        ctx.results.append(self.step)
        if impl != "floor":
            ctx.results.append(self.cpu)
        self.checksums_ok = True
        self.ring: list[int] = []
        self.cpu_means: list[float] = []  # per timed epoch: the mean main-thread CPU per batch
        self.profile = ""  # where that CPU goes, from one more (profiled) epoch

    def describe_cpu(self) -> None:
        """The CPU row's note: the mean per batch too (the row's figure is the median: a rare long batch,
        such as a garbage collection, shows here)."""
        if self.cpu_means:
            self.cpu.note = "mean per batch " + ", ".join(f"{m * 1e3:.3f}" for m in self.cpu_means) + " ms"
        if self.profile:
            self.cpu.note += ("; " if self.cpu.note else "") + self.profile


def _epoch(batches: Iterator[Any], step: Callable[[Any, Any, int], None], total: int, warmup: int,
           sync: Callable[[], None], row: _Row | None) -> None:
    """One epoch: ``total`` steps; the time per step from ``warmup`` on, and the CPU per batch."""
    cpu: list[float] = []
    start = 0.0
    for k in range(total):
        if k == warmup:
            sync()
            start = time.perf_counter()
        before = time.thread_time()
        x, y = next(batches)
        taken = time.thread_time() - before
        if k >= warmup:
            cpu.append(taken)
        step(x, y, k)
    sync()
    elapsed = time.perf_counter() - start
    with contextlib.suppress(StopIteration):
        next(batches)  # the end of the epoch (a persistent loader's workers go idle)
    if row is not None:
        row.step.samples.append(elapsed / (total - warmup))
        row.cpu.samples.append(statistics.median(cpu))
        row.cpu_means.append(statistics.fmean(cpu))


def _where(filename: str, function: str) -> str:
    """The module a profiled function belongs to: ferry's by file, the others by package."""
    if filename == "~":
        return "builtins (system calls, C functions)"
    parts = filename.replace("\\", "/").split("/")
    if "ferry" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("ferry"):])
    for package in ("torch", "numpy", "multiprocessing", "threading", "cuda"):
        if package in parts or parts[-1] == f"{package}.py":
            return package
    return parts[-1]


def _profiled(batches: Iterator[Any], step: Callable[[Any, Any, int], None], total: int, warmup: int,
              sync: Callable[[], None]) -> str:
    """One more epoch with ``cProfile`` (on the thread's CPU clock) around taking each batch from
    ``warmup`` on: the shares of that CPU time by module, largest first (the profiler adds its own
    cost per call, so the shares are what it shows, not the timed figure)."""
    profile = cProfile.Profile(time.thread_time)
    for k in range(total):
        if k >= warmup:
            profile.enable()
        x, y = next(batches)
        if k >= warmup:
            profile.disable()
        step(x, y, k)
    sync()
    with contextlib.suppress(StopIteration):
        next(batches)
    shares: dict[str, float] = {}
    calls = 0
    for (filename, _, function), (_, primitive, own, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        where = _where(filename, function)
        shares[where] = shares.get(where, 0.0) + own
        calls += primitive
    spent = sum(shares.values())
    if spent <= 0:
        return ""
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:8]
    per_batch = f" ({calls / (total - warmup):.0f} function calls per batch)" if total > warmup else ""
    return f"profiled epoch{per_batch}, main-thread CPU in the loader by module: " + ", ".join(
        f"{where} {100 * own / spent:.0f}%" for where, own in top)


# -- the GPU, with PyTorch ----------------------------------------------------------------------------------
def _model(torch: Any, workload: Workload) -> tuple[Any, Any, Callable[[Any], Any]]:
    nn = torch.nn
    if workload.name == "image":
        torchvision = importlib.import_module("torchvision")
        model = torchvision.models.resnet18(num_classes=1000).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, optimizer, lambda x: x
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, lambda x: x.reshape(-1, 1024)


def _on_gpu(ctx: Any, p: Plan, workload: Workload, torch: Any) -> None:
    import ferry

    total = p.warmup + p.steps
    dataset = PoolDataset(workload.sample, total * workload.batch)
    model, optimizer, shape = _model(torch, workload)
    classes = 1000 if workload.name == "image" else 10
    weights = torch.arange(1, workload.batch + 1, device="cuda", dtype=torch.float64)
    sums = torch.zeros((total, 2), device="cuda", dtype=torch.float64)

    def step(x: Any, y: Any, k: int) -> None:
        sums[k, 0] = x.double().sum()
        sums[k, 1] = (y.double() * weights[: y.shape[0]]).sum()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(shape(x))
            target = y % classes  # a tabular sample is a block of rows: each row takes its sample's label
            loss = torch.nn.functional.cross_entropy(out, target.repeat_interleave(out.shape[0] // y.shape[0]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize
    common: dict[str, Any] = {"batch_size": workload.batch, "num_workers": p.workers, "persistent_workers": True,
              "prefetch_factor": 4, "multiprocessing_context": "fork"}
    tud = torch.utils.data
    resident = []
    for k in range(total):
        indices = range(k * workload.batch, (k + 1) * workload.batch)
        x = np.stack([dataset[i][0] for i in indices])
        resident.append((torch.from_numpy(x).cuda(), torch.arange(indices.start, indices.stop, device="cuda")))
    sync()
    loaders: dict[str, Any] = {
        "cuda": tud.DataLoader(dataset, **common),
        "pinned_non_blocking": tud.DataLoader(dataset, pin_memory=True, **common),
        "prefetch": tud.DataLoader(dataset, **common),
    }
    ours = ferry.DataLoader(dataset, runtime=ctx.rt, to="torch", **common)

    def source(route: str) -> Iterator[Any]:
        if route == "resident":
            return iter(resident)
        if route == "cuda":
            return ((x.cuda(), y.cuda()) for x, y in loaders["cuda"])
        if route == "pinned_non_blocking":
            return ((x.cuda(non_blocking=True), y.cuda(non_blocking=True)) for x, y in loaders[route])
        if route == "prefetch":
            return iter(ferry.prefetch(loaders["prefetch"], runtime=ctx.rt, to="torch"))
        return iter(ours)

    rows = {route: _Row(ctx, impl, route, workload) for impl, route in CONTENDERS}
    expected = None
    try:
        ctx.progress(f"loader: {workload.name}: resident (reference)")
        _epoch(source("resident"), step, total, p.warmup, sync, None)
        expected = sums.clone()
        for _, route in CONTENDERS:  # the untimed epoch: workers start, the ring is sized
            ctx.progress(f"loader: {workload.name}: {route} (untimed epoch)")
            _run(rows[route], source(route), step, total, p.warmup, sync, sums, expected, timed=False)
            if route == "dataloader":
                rows[route].ring.append(ours.ring_bytes)
        for _ in range(p.rounds):
            for _, route in CONTENDERS:
                ctx.progress(f"loader: {workload.name}: {route}")
                _run(rows[route], source(route), step, total, p.warmup, sync, sums, expected, timed=True)
                if route == "dataloader":
                    rows[route].ring.append(ours.ring_bytes)
        ctx.progress(f"loader: {workload.name}: dataloader (profiled epoch)")
        with contextlib.suppress(Exception):  # a report, not a contender: it never fails the row
            rows["dataloader"].profile = _profiled(source("dataloader"), step, total, p.warmup, sync)
    finally:
        ours.close()
        loaders.clear()
        resident.clear()
        gc.collect()
        torch.cuda.empty_cache()
    for route, row in rows.items():
        row.step.valid = row.checksums_ok and bool(row.step.samples)
        if not row.checksums_ok:
            row.step.note = "a batch's checksum differs from the resident run's"
        row.cpu.valid = None
        row.describe_cpu()
        if route == "dataloader":
            row.step.note = (row.step.note + "; " if row.step.note else "") + (
                f"ring {max(row.ring) / MiB:.1f} MiB pinned, after each epoch: "
                f"{', '.join(f'{r / MiB:.1f}' for r in row.ring)} MiB; "
                f"{ours.fallback_batches} batch(es) not through the ring")


def _run(row: _Row, batches: Iterator[Any], step: Callable[[Any, Any, int], None], total: int, warmup: int,
         sync: Callable[[], None], sums: Any, expected: Any, *, timed: bool) -> None:
    sums.zero_()
    try:
        _epoch(batches, step, total, warmup, sync, row if timed else None)
    except Exception as exc:  # a contender that fails is reported, not fatal
        row.checksums_ok = False
        row.step.note = f"error: {exc!r}"
        return
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    if not bool((sums == expected).all()):
        row.checksums_ok = False


# -- the emulated device, NumPy only -------------------------------------------------------------------------
def _emulated(ctx: Any, p: Plan, workload: Workload) -> None:
    import ferry

    rt = ctx.rt
    total = p.warmup + p.steps
    dataset = PoolDataset(workload.sample, total * workload.batch)
    weights = np.arange(1, workload.batch + 1, dtype=np.float64)
    sums = np.zeros((total, 2))

    def step(x: Any, y: Any, k: int) -> None:  # the checksum, after a download: the stand-in's step
        sums[k, 0] = rt.to_host(x).astype(np.float64).sum()
        labels = rt.to_host(y)
        sums[k, 1] = (labels * weights[: labels.shape[0]]).sum()

    resident = []
    for k in range(total):
        indices = range(k * workload.batch, (k + 1) * workload.batch)
        resident.append((rt.to_device(np.stack([dataset[i][0] for i in indices])),
                         rt.to_device(np.arange(indices.start, indices.stop, dtype=np.int64))))
    rows = {route: _Row(ctx, impl, route, workload) for impl, route in CONTENDERS}
    ours = ferry.DataLoader(dataset, batch_size=workload.batch, num_workers=p.workers, persistent_workers=True,
                            prefetch_factor=4, multiprocessing_context="fork", runtime=rt)

    def sync() -> None:
        rt.poll()

    try:
        _epoch(iter(resident), step, total, p.warmup, sync, None)
        expected = sums.copy()
        ctx.progress(f"loader: {workload.name}: resident")
        for timed in (False,) + (True,) * p.rounds:
            sums[:] = 0
            _epoch(iter(resident), step, total, p.warmup, sync, rows["resident"] if timed else None)
            ctx.progress(f"loader: {workload.name}: dataloader")
            row = rows["dataloader"]
            sums[:] = 0
            _epoch(iter(ours), step, total, p.warmup, sync, row if timed else None)
            row.ring.append(ours.ring_bytes)
            row.checksums_ok &= bool((sums == expected).all())
        rows["dataloader"].profile = _profiled(iter(ours), step, total, p.warmup, sync)
    finally:
        fallback = ours.fallback_batches
        ours.close()
        resident.clear()
    for route, row in rows.items():
        if route not in ("resident", "dataloader"):
            row.step.note = row.cpu.note = "skipped: needs PyTorch and a GPU"
            continue
        row.step.valid = row.checksums_ok and bool(row.step.samples)
        row.cpu.valid = None
        row.describe_cpu()
        if route == "dataloader":
            row.step.note = (f"ring {max(row.ring) / MiB:.2f} MiB pinned, after each epoch: "
                             f"{', '.join(str(r) for r in row.ring)} bytes; {fallback} batch(es) not through the ring")


# -- the checks ----------------------------------------------------------------------------------------------
def loader_checks(results: Iterable[Result], Check: Any, _find: Any) -> list[Any]:  # noqa: N803
    """The targets: image <= 1.15x resident and >= 2x faster than DataLoader(pin_memory=True) +
    non_blocking; tabular <= 1.05x resident; the main thread's CPU in ferry's loader <= 0.3 ms per
    48 MiB image batch (and per 32 MiB tabular one); the ring's size constant after the first epoch.
    ``Check`` and ``_find`` are the report's (handed in: the report imports this module)."""

    rows = [r for r in results if r.group == "loader"]
    checks: list[Any] = []

    def get(impl: str, route: str) -> Result | None:
        found: Result | None = _find(rows, impl=impl, route=route)
        return found

    def ratio(name: str, a: Result | None, b: Result | None, limit: float, target: str, *,
              inverse: bool = False) -> None:
        if a is None or b is None:
            checks.append(Check(name, "not measured", target, None))
            return
        value = b.median / a.median if inverse else a.median / b.median
        measured = f"{a.median * 1e3:.2f} / {b.median * 1e3:.2f} ms = {value:.3f}x" if not inverse else (
            f"{b.median * 1e3:.2f} / {a.median * 1e3:.2f} ms = {value:.2f}x")
        checks.append(Check(name, measured, target, value >= limit if inverse else value <= limit))

    ours_image = get("ferry", "image: dataloader")
    ratio("loader image: ferry.DataLoader vs resident data", ours_image, get("floor", "image: resident"), 1.15,
          "<= 1.15x")
    ratio("loader image: ferry.DataLoader faster than DataLoader(pin_memory=True) + non_blocking", ours_image,
          get("torch", "image: pinned_non_blocking"), 2.0, ">= 2x", inverse=True)
    ratio("loader tabular: ferry.DataLoader vs resident data", get("ferry", "tabular: dataloader"),
          get("floor", "tabular: resident"), 1.05, "<= 1.05x")
    for workload, size in (("image", "48 MiB"), ("tabular", "32 MiB")):
        name = f"loader {workload}: main-thread CPU per {size} batch in ferry.DataLoader"
        cpu = next((r for r in rows if r.impl == "ferry" and r.route.startswith(f"{workload}: dataloader,")
                    and r.samples), None)
        if cpu is None:
            checks.append(Check(name, "not measured", "<= 0.3 ms", None))
        else:
            checks.append(Check(name, f"{cpu.median * 1e3:.3f} ms", "<= 0.3 ms", cpu.median <= 0.3e-3))
    for r in rows:
        if r.impl == "ferry" and r.route.endswith(": dataloader") and "after each epoch:" in r.note:
            sizes = r.note.split("after each epoch: ")[1].split(";")[0]
            values = [s.strip() for s in sizes.replace(" MiB", "").replace(" bytes", "").split(",")]
            checks.append(Check(f"loader {r.route.split(':')[0]}: ring size constant after the first epoch",
                                sizes, "constant", len(set(values)) == 1))
    return checks
