"""Pageable staging through the native engine, on a GPU, against the machine's memcpy ceilings.

    PYTHONPATH=src python3 benchmarks/probe_staging_engine.py                 # the default shape
    PYTHONPATH=src python3 benchmarks/probe_staging_engine.py --sweep         # several engine shapes
    PYTHONPATH=src python3 benchmarks/probe_staging_engine.py --lanes 16 --slot-mib 4 --spin-us 50 --json out.json

Builds nothing: the extension must already be built in place (``pip install -e .``
or ``python setup.py build_ext --inplace``). Drives ``ferry._native._engine`` in
CUDA mode directly (no Runtime): ``cuMemAlloc``'d device memory, pageable NumPy
arrays, warm (pre-touched) host buffers unless stated, median of ``--repeat``
timed runs after ``--warmup`` runs. A run is submit + ``job.wait()``, host wall
clock. Rows:

- ``h2d`` / ``d2h``: engine upload / download into a warm output;
- ``d2h fresh``: download into a freshly allocated output each run (first-touch
  page faults; above glibc's 32 MiB mmap threshold every run gets new pages);
- ``driver h2d`` / ``driver d2h``: the driver's own pageable copy
  (``cuMemcpyHtoD`` / ``cuMemcpyDtoH``, synchronous), the figure to beat at 1 MiB;
- ``memcpy 1T`` / ``memcpy NT``: host memcpy on one thread and on ``--threads``
  threads (``ctypes.memmove`` releases the GIL), the ceiling of any staged route.

Every size is verified: a download must equal the uploaded bytes, a strided
(transposed) upload must land in C order; a mismatch exits with status 1.
Exit status 2: no usable GPU or the extension is missing.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

MiB = 1 << 20


def fail(message: str, status: int) -> None:
    print(f"probe_staging_engine: {message}", file=sys.stderr)
    sys.exit(status)


def check(err: Any, what: str) -> None:
    if int(err):
        fail(f"{what} failed: CUresult {int(err)}", 2)


def median_seconds(run: Callable[[], None], warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


_sources: dict[tuple[int, int], np.ndarray[Any, Any]] = {}


def touched(nbytes: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Random bytes (so a misplaced chunk shows), made once per size: every page is touched."""
    key = (nbytes, seed)
    if key not in _sources:
        _sources[key] = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return _sources[key]


def memcpy_threads(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], threads: int) -> Callable[[], None]:
    """A callable that copies src to dst split over ``threads`` long-lived threads (barrier-started)."""
    n = src.nbytes
    parts = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
    d0, s0 = dst.ctypes.data, src.ctypes.data
    start = threading.Barrier(threads + 1)
    done = threading.Barrier(threads + 1)
    stop = [False]

    def worker(lo: int, hi: int) -> None:
        while True:
            start.wait()
            if stop[0]:
                return
            ctypes.memmove(d0 + lo, s0 + lo, hi - lo)
            done.wait()

    pool = [threading.Thread(target=worker, args=p, daemon=True) for p in parts]
    for t in pool:
        t.start()

    def run() -> None:
        start.wait()
        done.wait()

    def close() -> None:
        stop[0] = True
        start.wait()
        for t in pool:
            t.join()

    run.close = close  # type: ignore[attr-defined]
    return run


class Gpu:
    """Device 0's primary context, current on this thread, and the engine's entry points."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError:
            fail("cuda.bindings is not installed", 2)
        self.d = driver
        try:
            (err,) = driver.cuInit(0)
        except Exception as exc:  # no libcuda at all
            fail(f"no CUDA driver: {exc}", 2)
        check(err, "cuInit")
        err, self.dev = driver.cuDeviceGet(0)
        check(err, "cuDeviceGet")
        err, self.ctx = driver.cuDevicePrimaryCtxRetain(self.dev)
        check(err, "cuDevicePrimaryCtxRetain")
        (err,) = driver.cuCtxSetCurrent(self.ctx)
        check(err, "cuCtxSetCurrent")
        err, raw = driver.cuDeviceGetName(256, self.dev)
        self.name = raw.split(b"\0", 1)[0].decode(errors="replace") if not int(err) else "?"
        from ferry import _native

        if _native.load() is None:
            fail(f"the native engine is not available: {_native.status()}", 2)
        self.entry_points = _native.cuda_entry_points(driver)

    def alloc(self, nbytes: int) -> int:
        err, ptr = self.d.cuMemAlloc(nbytes)
        check(err, "cuMemAlloc")
        return int(ptr)

    def free(self, ptr: int) -> None:
        self.d.cuMemFree(self.d.CUdeviceptr(ptr))

    def htod(self, ptr: int, host: np.ndarray[Any, Any]) -> None:
        (err,) = self.d.cuMemcpyHtoD(self.d.CUdeviceptr(ptr), host.ctypes.data, host.nbytes)
        check(err, "cuMemcpyHtoD")

    def dtoh(self, host: np.ndarray[Any, Any], ptr: int) -> None:
        (err,) = self.d.cuMemcpyDtoH(host.ctypes.data, self.d.CUdeviceptr(ptr), host.nbytes)
        check(err, "cuMemcpyDtoH")


class EmulatedGpu:
    """``--emulated``: the same probe against the engine's emulated mode (a dry run of this script on any
    machine; host buffers stand in for device memory, figures are meaningless)."""

    name = "emulated device (dry run: figures mean nothing)"
    ctx = 0
    entry_points: dict[str, int] = {}  # noqa: RUF012

    def __init__(self) -> None:
        from ferry import _native

        if _native.load() is None:
            fail(f"the native engine is not available: {_native.status()}", 2)
        self._memory: dict[int, np.ndarray[Any, Any]] = {}

    def alloc(self, nbytes: int) -> int:
        block = np.zeros(nbytes, np.uint8)
        self._memory[block.ctypes.data] = block
        return int(block.ctypes.data)

    def free(self, ptr: int) -> None:
        del self._memory[ptr]

    def htod(self, ptr: int, host: np.ndarray[Any, Any]) -> None:
        ctypes.memmove(ptr, np.ascontiguousarray(host).ctypes.data, host.nbytes)

    def dtoh(self, host: np.ndarray[Any, Any], ptr: int) -> None:
        ctypes.memmove(host.ctypes.data, ptr, host.nbytes)


@dataclass(frozen=True)
class Shape:
    """One engine configuration."""

    lanes: int
    slot_mib: float
    slots: int
    spin_us: float = 0.0
    idle_spin_us: float = 0.0
    min_chunks: int = 1
    serialize: bool = True
    nontemporal: bool = True
    driver_thread: bool = True
    one_stream: bool = False
    min_chunk_kib: int = 256
    lane_wait_us: float = 100.0
    helpers: int = 0
    piece_kib: int = 128

    def __str__(self) -> str:
        return (
            f"{self.lanes} lanes x {self.slots} slots x {self.slot_mib:g} MiB, >= {self.min_chunks} chunk(s)/lane, "
            f"spin {self.spin_us:g} us, idle spin {self.idle_spin_us:g} us, "
            f"{'serialized' if self.serialize else 'concurrent'} enqueues, "
            f"{'streaming' if self.nontemporal else 'cached'} chunk copies, "
            f"{'a driver thread' if self.driver_thread else 'lanes call the driver'}"
            f"{' (one DMA stream)' if self.driver_thread and self.one_stream else ''}, "
            f"min chunk {self.min_chunk_kib} KiB, lanes wait {self.lane_wait_us:g} us awake"
            + (f", cooperative: {self.helpers} helpers, pieces of {self.piece_kib} KiB" if self.helpers else "")
        )


def run_job(engine: Any, host: np.ndarray[Any, Any], ptr: int) -> Any:
    job = engine.submit(host.ctypes.data, ptr, host.nbytes, host.shape, host.strides, host.itemsize)
    if not job.wait(60):
        fail("a job did not finish within 60 s", 1)
    if job.error is not None:
        fail(f"a job failed: {job.error}", 1)
    return job


def time_jobs(
    engine: Any, make_host: Callable[[], np.ndarray[Any, Any]], ptr: int, warmup: int, repeat: int
) -> tuple[float, dict[str, Any]]:
    """Median seconds of submit + wait, and the median run's timeline (us after submit; ``wait`` = returned)."""
    for _ in range(warmup):
        run_job(engine, make_host(), ptr)
    runs = []
    for _ in range(repeat):
        host = make_host()
        start = time.perf_counter()
        job = run_job(engine, host, ptr)
        elapsed = time.perf_counter() - start
        timeline = job.timeline()
        timeline["wait"] = elapsed * 1e6
        timeline["chunks"] = job.chunk_times()
        runs.append((elapsed, timeline))
    runs.sort(key=lambda r: r[0])
    return runs[len(runs) // 2]


def time_queued(engine: Any, host: np.ndarray[Any, Any], ptr: int, jobs: int, warmup: int, repeat: int) -> float:
    """Median seconds for ``jobs`` back-to-back submissions of the same payload, then waiting for all."""

    def run() -> None:
        queued = [
            engine.submit(host.ctypes.data, ptr, host.nbytes, host.shape, host.strides, host.itemsize)
            for _ in range(jobs)
        ]
        for job in queued:
            if not job.wait(60) or job.error is not None:
                fail(f"a queued job failed: {job.error}", 1)

    return median_seconds(run, warmup, repeat)


def memmove(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def fmt_timeline(t: dict[str, Any]) -> str:
    keys = ("start_first", "start_last", "copy_last", "enqueue_last", "done", "wait", "enqueues", "enqueue_us",
            "lock_wait_us")
    return " ".join(f"{k}={t[k]:.0f}" if t.get(k) is not None else f"{k}=-" for k in keys)


def fmt_chunks(t: dict[str, Any], upload: bool) -> str:
    """Each chunk's path, ordered by chunk: upload ``L<lane> <taken>/<copy start>-<copy end>/<enqueued>``,
    download ``L<lane> <handed>/<enqueued>/<copy-out start>-<end>`` (us after submit)."""
    rows = []
    for k, (lane, a, b, c, d) in enumerate(t.get("chunks") or []):
        path = f"{a:.0f}/{b:.0f}-{c:.0f}/{d:.0f}" if upload else f"{a:.0f}/{b:.0f}/{c:.0f}-{d:.0f}"
        rows.append(f"#{k} L{lane} {path}")
    return "; ".join(rows)


def probe_shape(gpu: Gpu | EmulatedGpu, args: argparse.Namespace, shape: Shape) -> list[dict[str, Any]]:
    from ferry._native._engine import Engine

    kw: dict[str, Any] = {"mode": "emulated", "bandwidth": 1e12, "latency": 0.0}
    if isinstance(gpu, Gpu):
        kw = {"mode": "cuda", "context": int(gpu.ctx), "entry_points": gpu.entry_points}
    kw |= {
        "lanes": shape.lanes,
        "slots_per_lane": shape.slots,
        "slot_bytes": int(shape.slot_mib * MiB),
        "min_chunk_bytes": shape.min_chunk_kib << 10,
        "spin_us": shape.spin_us,
        "idle_spin_us": shape.idle_spin_us,
        "min_chunks_per_lane": shape.min_chunks,
        "serialize_driver": shape.serialize,
        "nontemporal": shape.nontemporal,
        "driver_thread": shape.driver_thread,
        "one_stream": shape.one_stream,
        "lane_wait_us": shape.lane_wait_us,
        "wait_spin_us": args.wait_spin_us,
        "helpers": shape.helpers,
        "piece_bytes": shape.piece_kib << 10,
    }
    up = Engine("upload", **kw)
    down = Engine("download", **kw)
    rows: list[dict[str, Any]] = []
    try:
        print(f"\n## {shape} (staging {up.held_bytes / MiB:.0f} MiB per direction)")
        print(
            f"{'MiB':>6} {'chunk KiB':>9} {'h2d':>7} {'d2h':>7} {'d2h fresh':>9} {'h2d x8q':>8} {'d2h x8q':>8}"
            f"   (GB/s, median of {args.repeat}; x8q: 8 jobs queued back to back)"
        )
        for size in args.sizes:
            n = int(size * MiB)
            src = touched(n, n)
            out = np.zeros(n, np.uint8)
            ptr = gpu.alloc(n)
            try:
                t_up, tl_up = time_jobs(up, lambda s=src: s, ptr, args.warmup, args.repeat)  # type: ignore[misc]
                t_down, tl_down = time_jobs(down, lambda o=out: o, ptr, args.warmup, args.repeat)  # type: ignore[misc]
                if not np.array_equal(out, src):
                    fail(f"{size} MiB: the download differs from the upload", 1)
                t_fresh, _ = time_jobs(down, partial(np.empty, n, np.uint8), ptr, 1, args.repeat)
                queued = n <= 64 * MiB
                t_up_q = time_queued(up, src, ptr, 8, 1, max(3, args.repeat // 2)) if queued else float("nan")
                t_down_q = time_queued(down, out, ptr, 8, 1, max(3, args.repeat // 2)) if queued else float("nan")
                # strided: a transposed view lands in C order
                side = int(np.sqrt(n // 4))
                if side >= 2:
                    a = src[: side * side * 4].view(np.uint32).reshape(side, side).T
                    run_job(up, a, ptr)
                    back = np.empty((side, side), np.uint32)
                    gpu.dtoh(back, ptr)
                    if not np.array_equal(back, a):
                        fail(f"{size} MiB: a transposed upload did not land in C order", 1)
            finally:
                gpu.free(ptr)
            row = {
                "shape": str(shape),
                **asdict(shape),
                "mib": size,
                "chunk_kib": up.chunk_bytes(n) >> 10,
                "h2d_gbps": n / t_up / 1e9,
                "d2h_gbps": n / t_down / 1e9,
                "d2h_fresh_gbps": n / t_fresh / 1e9,
                "h2d_queued_gbps": 8 * n / t_up_q / 1e9,
                "d2h_queued_gbps": 8 * n / t_down_q / 1e9,
                "h2d_timeline_us": tl_up,
                "d2h_timeline_us": tl_down,
            }
            rows.append(row)
            print(
                f"{size:>6g} {row['chunk_kib']:>9} {row['h2d_gbps']:>7.1f} {row['d2h_gbps']:>7.1f} "
                f"{row['d2h_fresh_gbps']:>9.1f} {row['h2d_queued_gbps']:>8.1f} {row['d2h_queued_gbps']:>8.1f}"
            )
            if args.timeline:
                print(f"{'':>6} h2d us: {fmt_timeline(tl_up)}")
                print(f"{'':>6} d2h us: {fmt_timeline(tl_down)}")
            if args.chunk_times:
                print(f"{'':>6} h2d chunks (lane taken/copy-copied/enqueued): {fmt_chunks(tl_up, True)}")
                print(f"{'':>6} d2h chunks (lane handed/enqueued/copy out-end): {fmt_chunks(tl_down, False)}")
    finally:
        up.close()
        down.close()
    return rows


def baselines(gpu: Gpu | EmulatedGpu, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print(f"\n## baselines (GB/s, median of {args.repeat}); memcpy NT = {args.threads} threads")
    print(f"{'MiB':>6} {'driver h2d':>10} {'driver d2h':>10} {'memcpy 1T':>9} {'memcpy NT':>9}")
    for size in args.sizes:
        n = int(size * MiB)
        src = touched(n, 1)
        dst = np.zeros(n, np.uint8)
        ptr = gpu.alloc(n)
        try:
            t_h2d = median_seconds(partial(gpu.htod, ptr, src), args.warmup, args.repeat)
            t_d2h = median_seconds(partial(gpu.dtoh, dst, ptr), args.warmup, args.repeat)
        finally:
            gpu.free(ptr)
        t_1 = median_seconds(partial(memmove, dst.ctypes.data, src.ctypes.data, n), args.warmup, args.repeat)
        many = memcpy_threads(dst, src, args.threads)
        try:
            t_n = median_seconds(many, args.warmup, args.repeat)
        finally:
            many.close()  # type: ignore[attr-defined]
        row = {
            "mib": size,
            "driver_h2d_gbps": n / t_h2d / 1e9,
            "driver_d2h_gbps": n / t_d2h / 1e9,
            "memcpy_1t_gbps": n / t_1 / 1e9,
            "memcpy_nt_gbps": n / t_n / 1e9,
            "threads": args.threads,
        }
        rows.append(row)
        print(
            f"{size:>6g} {row['driver_h2d_gbps']:>10.1f} {row['driver_d2h_gbps']:>10.1f} "
            f"{row['memcpy_1t_gbps']:>9.1f} {row['memcpy_nt_gbps']:>9.1f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[1, 8, 64, 256],
        help="payload sizes in MiB, comma-separated (default 1,8,64,256)",
    )
    parser.add_argument("--lanes", type=int, default=12)
    parser.add_argument("--slots", type=int, default=2, help="slots per lane")
    parser.add_argument("--slot-mib", type=float, default=4.0)
    parser.add_argument("--min-chunk-kib", type=int, default=256)
    parser.add_argument("--spin-us", type=float, default=0.0, help="poll events / jobs this long before sleeping")
    parser.add_argument("--idle-spin-us", type=float, default=0.0, help="idle lanes poll for work this long")
    parser.add_argument("--min-chunks", type=int, default=1, help="at least this many chunks per lane")
    parser.add_argument(
        "--concurrent-enqueues", action="store_true", help="let lanes call the driver concurrently (no spinlock)"
    )
    parser.add_argument("--timeline", action="store_true", help="print the median run's timeline per size")
    parser.add_argument(
        "--chunk-times", action="store_true", help="print each chunk's times in the median run (Job.chunk_times)"
    )
    parser.add_argument("--no-nt", action="store_true", help="chunk copies through the cache (memcpy), not streaming")
    parser.add_argument("--nt-ab", action="store_true", help="also run the shape with the other kind of chunk copy")
    parser.add_argument("--no-driver-thread", action="store_true", help="lanes call the driver themselves")
    parser.add_argument("--dt-ab", action="store_true", help="also run the shape with the driver thread toggled")
    parser.add_argument("--one-stream", action="store_true", help="every DMA on the driver thread's one stream")
    parser.add_argument("--stream-ab", action="store_true", help="also run the shape with the other stream choice")
    parser.add_argument("--wait-spin-us", type=float, default=0.0, help="Job.wait polls this long before sleeping")
    parser.add_argument(
        "--lane-wait-us", type=float, default=100.0, help="lanes wait this long awake for a DMA's end, then sleep"
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help="also run lanes' streams / one stream x 1, 2, 4 chunks per lane x lanes awake 100 / 500 us",
    )
    parser.add_argument(
        "--chunk-sweep",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[],
        help="also run the shape with each of these min chunk sizes (KiB, comma-separated)",
    )
    parser.add_argument(
        "--focus",
        action="store_true",
        help="sweep serialized/concurrent enqueues x 8/12 lanes x 1/2/4 chunks per lane x spin 0/30 us",
    )
    parser.add_argument(
        "--helpers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0],
        help="cooperative jobs: idle lanes that help a lead copy (comma-separated: one shape each; 0: dealt)",
    )
    parser.add_argument(
        "--piece-kib",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[128],
        help="pieces of a cooperative chunk copy, KiB (comma-separated: one shape each with helpers)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="run every shape this many times, in turn")
    parser.add_argument("--threads", type=int, default=0, help="memcpy ceiling threads (default: --lanes)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also try lanes 8/12/16 x slot 1/2/4 MiB x slots 2/3, and spin 20/100 us (a minute or two)",
    )
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--emulated", action="store_true", help="dry-run this script on the emulated engine (no GPU)")
    args = parser.parse_args(argv)
    args.threads = args.threads or args.lanes
    if min(args.sizes) <= 0:
        parser.error("sizes must be > 0")

    gpu: Gpu | EmulatedGpu = EmulatedGpu() if args.emulated else Gpu()
    print(f"# probe_staging_engine on {gpu.name}, pid {os.getpid()}, cpus {os.cpu_count()}")
    rows: dict[str, Any] = {"device": gpu.name, "baselines": baselines(gpu, args), "engine": []}
    first = Shape(
        args.lanes,
        args.slot_mib,
        args.slots,
        args.spin_us,
        args.idle_spin_us,
        args.min_chunks,
        not args.concurrent_enqueues,
        not args.no_nt,
        not args.no_driver_thread,
        args.one_stream,
        args.min_chunk_kib,
        args.lane_wait_us,
        args.helpers[0],
        args.piece_kib[0],
    )
    shapes = [first]
    shapes += [dataclasses.replace(first, helpers=h, piece_kib=p) for h in args.helpers for p in args.piece_kib]
    if args.nt_ab:  # the same shape with the other kind of chunk copy, right after
        shapes.append(dataclasses.replace(first, nontemporal=args.no_nt))
    if args.stream_ab:  # the same shape with the other stream choice, right after
        shapes.append(dataclasses.replace(first, one_stream=not args.one_stream))
    if args.dt_ab:  # the same shape with (or without) the driver thread, right after
        shapes.append(dataclasses.replace(first, driver_thread=args.no_driver_thread))
    shapes += [dataclasses.replace(first, min_chunk_kib=kib) for kib in args.chunk_sweep]
    if args.grid:
        shapes += [
            dataclasses.replace(first, one_stream=one, min_chunks=chunks, lane_wait_us=awake)
            for one in (False, True)
            for chunks in (1, 2, 4)
            for awake in (100.0, 500.0)
        ]
    if args.sweep:
        shapes += [
            dataclasses.replace(first, lanes=lanes, slot_mib=mib, slots=slots)
            for lanes in (8, 12, 16)
            for mib in (1.0, 2.0, 4.0)
            for slots in (2, 3)
        ]
    if args.focus:
        shapes += [
            dataclasses.replace(
                first, lanes=lanes, slot_mib=4.0, slots=3, spin_us=spin, idle_spin_us=0.0, min_chunks=chunks,
                serialize=serialize,
            )
            for serialize in (True, False)
            for lanes in (8, 12)
            for chunks in (1, 2, 4)
            for spin in (0.0, 30.0)
        ]
    unique = list(dict.fromkeys(shapes))
    for _ in range(args.rounds):  # rounds of every shape in turn: a drifting host shows as a spread, not a winner
        for shape in unique:
            rows["engine"] += probe_shape(gpu, args, shape)
    if len(shapes) > 1:
        print("\n## best shape per size")
        for size in args.sizes:
            mine = [r for r in rows["engine"] if r["mib"] == size]
            for key in ("h2d_gbps", "d2h_gbps", "d2h_fresh_gbps", "h2d_queued_gbps", "d2h_queued_gbps"):
                ranked = sorted((r for r in mine if r[key] == r[key]), key=lambda r, k=key: -r[k])  # type: ignore[misc]
                for best in ranked[:3]:
                    print(f"{size:>6g} MiB {key[:-5]:>9}: {best[key]:6.1f} GB/s  ({best['shape']})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
        print(f"\nwrote {args.json}")
    print("\nall transfers verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
