"""The ``gil`` group: how much a background transfer loop slows the caller's own Python.

A pure-Python loop runs on the main thread in windows of a fixed number of
iterations (about 10 ms each when idle); each window's wall time is a sample.
It runs idle, then beside a background thread that loops
``rt.upload(64 MiB pageable array, destination).wait()``, then beside one that
loops ``rt.download(source, 64 MiB array).wait()``, then (PyTorch with a GPU)
beside PyTorch's pinning thread: ``torch.from_numpy(array).pin_memory()``
and a ``non_blocking`` copy on a side stream, synchronized. Idle windows are
measured before and after the loaded phases, and the idle speed is the
median of both.

A background loop that cannot get the GIL moves few bytes and slows the loop
little, so each loaded row says how many GB/s the background moved while the
loop ran: compare the loop's speed only between rows that moved comparable
bytes. The background's last transfer is verified.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._protocol import Result, payload, spin

__all__: list[str] = []

MiB = 1 << 20
ROUTES = ("idle", "beside_ferry_upload", "beside_ferry_download", "beside_torch_pinning")


def _calibrate(seconds: float) -> int:
    iterations = 10_000
    while True:
        start = time.perf_counter()
        spin(iterations)
        elapsed = time.perf_counter() - start
        if elapsed > 5e-3:
            return max(1, int(iterations * seconds / elapsed))
        iterations *= 4


def _windows(iterations: int, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        spin(iterations)
        samples.append(time.perf_counter() - start)
    return samples


class Background:
    """A thread repeating ``step`` (which moves ``nbytes``) until stopped; counts what it moved."""

    def __init__(self, step: Callable[[], None], nbytes: int) -> None:
        self.step = step
        self.nbytes = nbytes
        self.stop = threading.Event()
        self.started = threading.Event()
        self.count = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ferry-bench-background", daemon=True)

    def _run(self) -> None:
        try:
            self.step()  # warm: routes, pools, lanes
            self.started.set()
            while not self.stop.is_set():
                self.step()
                self.count += 1
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()

    def __enter__(self) -> Background:
        self.thread.start()
        self.started.wait(timeout=60)
        self.began, self.first = time.perf_counter(), self.count
        return self

    def __exit__(self, *exc: object) -> None:
        self.ended, self.moved = time.perf_counter(), self.count - self.first
        self.stop.set()
        self.thread.join(timeout=60)
        if self.error is not None:
            raise self.error

    @property
    def gbps(self) -> float:
        return self.moved * self.nbytes / (self.ended - self.began) / 1e9


def group_gil(ctx: Any) -> None:
    rt = ctx.rt
    n = 64 * MiB
    count = 30 if ctx.quick else 100
    iterations = _calibrate(10e-3)
    data = payload(n, 41)
    results = {route: Result("gil", "python_loop", route, "host", 0 if route == "idle" else n) for route in ROUTES}
    idle = results["idle"]
    ctx.progress("gil: python loop idle")
    idle.samples = _windows(iterations, count)
    ctx.results.append(idle)

    def loaded(route: str, step: Callable[[], None], check: Callable[[], bool]) -> None:
        result = results[route]
        try:
            with Background(step, n) as background:
                result.samples = _windows(iterations, count)
            result.valid = bool(check())
            result.note = f"background moved {background.gbps:.1f} GB/s ({background.moved} transfers of 64 MiB)"
        except Exception as exc:
            result.valid = False
            result.note = f"error: {exc!r}"

    box: dict[str, Any] = {"dev": rt.empty(n, np.uint8), "out": np.empty(n, np.uint8)}

    def upload() -> None:
        _, box["dev"] = rt.upload(data, box["dev"]).wait()

    def download() -> None:
        box["src"], _ = rt.download(box["src"], box["out"]).wait()

    ctx.progress("gil: python loop beside ferry uploads")
    loaded("beside_ferry_upload", upload, lambda: bool(np.array_equal(rt.to_host(box["dev"]), data)))
    ctx.results.append(results["beside_ferry_upload"])
    box["src"] = rt.to_device(data)
    box["out"][:] = 0xA5
    ctx.progress("gil: python loop beside ferry downloads")
    loaded("beside_ferry_download", download, lambda: bool(np.array_equal(box["out"], data)))
    ctx.results.append(results["beside_ferry_download"])
    box.clear()
    ctx.progress("gil: python loop beside PyTorch's pinning thread")
    torch_row = results["beside_torch_pinning"]
    if "torch" not in ctx.peers:
        torch_row.note = "skipped: PyTorch with a GPU is not usable here"
    else:
        torch = ctx.peers["torch"].torch
        stream = torch.cuda.Stream()
        target = torch.empty(n, dtype=torch.uint8, device="cuda")
        source = torch.from_numpy(data)

        def pinned_copy() -> None:
            host = source.pin_memory()
            with torch.cuda.stream(stream):
                target.copy_(host, non_blocking=True)
            stream.synchronize()

        loaded("beside_torch_pinning", pinned_copy, lambda: bool(np.array_equal(target.cpu().numpy(), data)))
    ctx.results.append(torch_row)
    idle.samples += _windows(iterations, count)
    rt.poll()


def case_count(ctx: Any) -> int:
    return len(ROUTES)
