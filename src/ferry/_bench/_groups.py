"""The benchmark groups (the design record's section 3, extended).

``transfer``     download and upload per size and route, with the peers
``host_copies``  the pieces of a staged 8 MiB upload; the multi-threaded memcpy ceiling at
                 the engine's lane count (64 and 256 MiB) beside ferry's pageable routes
``large``        256 MiB both ways: pageable fresh / reused output / pinned
``overlap``      copy alone, host work alone, serial, overlapped (8 and 256 MiB)
``both``         both directions at once
``latency``      small-transfer round trip (16 and 64 B), against the raw driver, PyTorch and CuPy
``many_small``   1000 uploads of 4 KiB: one event each, and in ``rt.batch()``; the raw driver's loop
                 with one event per copy and with one event for all
``pinned_alloc`` a pinned buffer fresh versus from the pool
``handoff``      submitting a download right after a ~10 ms producer kernel
``peer``         device to device, peer against staged (two devices or more)
``pipeline``     a training-style input pipeline with real device work (``_pipeline.py``)
``gil``          a pure-Python loop's speed beside background transfer loops (``_gil.py``)
``files``        checkpoint loading and saving against the peers and the pread/pwrite ceiling (``_files.py``)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import testing
from .._runtime import parts_of
from . import _files, _gil, _pipeline
from ._memcpy import CopyTeam, passes_for
from ._peers import Case
from ._protocol import Budget, Result, measure, measure_interleaved, payload, poison

__all__: list[str] = []

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FULL_SIZES = [16, 64, 4 * KiB, 32 * KiB, 64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB, 256 * MiB, 1 * GiB]
QUICK_SIZES = [16, 4 * KiB, 32 * KiB, 64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB]
SMALL_PAGEABLE = 64 * KiB  # up to here the pageable route is checked against the driver's own pageable copy


@dataclass
class Context:
    """Everything a group needs: the runtime, the peers, the protocol, the sink."""

    rt: Any
    peers: dict[str, Any]
    budget: Budget
    quick: bool
    progress: Callable[[str], None]
    results: list[Result] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return QUICK_SIZES if self.quick else FULL_SIZES

    def large(self) -> int:
        return 64 * MiB if self.quick else 256 * MiB

    def run(self, group: str, case: Case, budget: Budget | None = None) -> Result:
        """Validate outside the timed region, then time."""
        label = f"{group}: {case.impl} {case.route} {case.direction} {_size(case.nbytes)}"
        self.progress(label)
        result = Result(group, case.impl, case.route, case.direction, case.nbytes)
        try:
            result.valid = bool(case.check())
            if result.valid:
                result.samples = measure(case.op, budget or self.budget, setup=case.setup)
            else:
                result.note = "validation failed: not timed"
        except Exception as exc:
            result.valid = False
            result.note = f"error: {exc!r}"
        finally:
            if case.close is not None:
                case.close()
        self.results.append(result)
        return result

    def run_together(self, group: str, cases: list[Case], budget: Budget | None = None, rounds: int = 10) -> None:
        """Validate each case, then time the valid ones interleaved (:func:`measure_interleaved`): rows a
        check compares (ferry against a peer) then see the same host, however its speed drifts."""
        results, timed = [], []
        try:
            for case in cases:
                self.progress(f"{group}: {case.impl} {case.route} {case.direction} {_size(case.nbytes)}")
                result = Result(group, case.impl, case.route, case.direction, case.nbytes)
                try:
                    result.valid = bool(case.check())
                    if result.valid:
                        timed.append((result, case))
                    else:
                        result.note = "validation failed: not timed"
                except Exception as exc:
                    result.valid = False
                    result.note = f"error: {exc!r}"
                results.append(result)
            try:
                samples = measure_interleaved([(c.op, c.setup) for _, c in timed], budget or self.budget, rounds)
                for (result, _), s in zip(timed, samples, strict=True):
                    result.samples = s
            except Exception as exc:
                for result, _ in timed:
                    result.valid = False
                    result.note = f"error: {exc!r}"
        finally:
            for case in cases:
                if case.close is not None:
                    case.close()
        self.results.extend(results)

    def record(self, result: Result) -> None:
        self.progress(f"{result.group}: {result.impl} {result.route}")
        self.results.append(result)


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# -- ferry's cases ---------------------------------------------------------------------------------


def ferry_pinned(rt: Any, direction: str, data: np.ndarray[Any, Any], *, wait_only: bool = False) -> Case:
    """upload_pending/download_pending on a pooled pinned buffer, reused each repeat."""
    n = data.nbytes
    box: dict[str, Any] = {"buf": rt.pinned(n), "dev": rt.empty(n, np.uint8)}
    if direction == "h2d":
        box["buf"].as_array()[:] = data

        def submit() -> None:
            box["p"] = rt.upload_pending(box["buf"], box["dev"])

        def finish() -> None:
            box["buf"], box["dev"] = box.pop("p").wait()

        def check() -> bool:
            submit()
            finish()
            return bool(np.array_equal(rt.to_host(box["dev"]), data))
    else:
        box["dev"] = rt.to_device(data)

        def submit() -> None:
            box["p"] = rt.download_pending(box["dev"], box["buf"])

        def finish() -> None:
            box["dev"], box["buf"] = box.pop("p").wait()

        def check() -> bool:
            poison(box["buf"].as_array())
            submit()
            finish()
            return bool(np.array_equal(box["buf"].as_array(), data))

    def close() -> None:
        box["buf"].close()

    if wait_only:
        return Case("ferry", "pinned_wait", direction, n, finish, check, setup=submit, close=close)

    # the round trip as a user writes it (one line, no helper calls): the raw driver's case is as lean
    if direction == "h2d":
        up = rt.upload_pending

        def op() -> None:
            box["buf"], box["dev"] = up(box["buf"], box["dev"]).wait()
    else:
        down = rt.download_pending

        def op() -> None:
            box["dev"], box["buf"] = down(box["dev"], box["buf"]).wait()

    return Case("ferry", "pinned", direction, n, op, check, close=close)


def ferry_pageable(rt: Any, direction: str, data: np.ndarray[Any, Any], *, registered: bool = False) -> Case:
    """rt.upload / rt.download of a NumPy array (output reused), optionally registered."""
    n = data.nbytes
    host = np.empty(n, np.uint8)
    registration = rt.register(host) if registered else None
    route = "registered" if registered else "pageable"
    box: dict[str, Any] = {}
    if direction == "h2d":
        host[:] = data
        box["dev"] = rt.empty(n, np.uint8)

        def op() -> None:
            _, box["dev"] = rt.upload(host, box["dev"]).wait()

        def check() -> bool:
            op()
            return bool(np.array_equal(rt.to_host(box["dev"]), data))
    else:
        box["dev"] = rt.to_device(data)

        def op() -> None:
            box["dev"], _ = rt.download(box["dev"], host).wait()

        def check() -> bool:
            poison(host)
            op()
            return bool(np.array_equal(host, data))

    def close() -> None:
        if registration is not None:
            registration.release()

    return Case("ferry", route, direction, n, op, check, close=close)


def ferry_fresh_download(rt: Any, data: np.ndarray[Any, Any]) -> Case:
    """rt.download(source) into a new output each time (first-touch included)."""
    dev = rt.to_device(data)
    box: dict[str, Any] = {}

    def op() -> None:
        box["out"] = None
        box["out"] = rt.download(dev).wait()[1]

    def check() -> bool:
        op()
        return bool(np.array_equal(box["out"], data))

    return Case("ferry", "fresh", "d2h", data.nbytes, op, check)


def _peer_cases(ctx: Context, direction: str, data: np.ndarray[Any, Any]) -> Iterator[Case]:
    if "raw" in ctx.peers:
        yield ctx.peers["raw"].case(direction, "pinned", data)
        yield ctx.peers["raw"].case(direction, "pageable", data)
    if "torch" in ctx.peers:
        for route in ("pinned_non_blocking", "pinned", "pageable", "pageable_non_blocking"):
            yield ctx.peers["torch"].case(direction, route, data)
    if "cupy" in ctx.peers:
        yield ctx.peers["cupy"].case(direction, "pinned", data)
        yield ctx.peers["cupy"].case(direction, "pageable", data)


def _free_peers(ctx: Context) -> None:
    if "raw" in ctx.peers:
        ctx.peers["raw"].release()
    if "torch" in ctx.peers:
        ctx.peers["torch"].torch.cuda.empty_cache()
    if "cupy" in ctx.peers:
        ctx.peers["cupy"].cupy.get_default_memory_pool().free_all_blocks()
        ctx.peers["cupy"].cupy.get_default_pinned_memory_pool().free_all_blocks()
    gc.collect()


# -- groups ----------------------------------------------------------------------------------------------


def group_transfer(ctx: Context) -> None:
    rt = ctx.rt
    for n in ctx.sizes:
        data = payload(n, n)
        for direction in ("h2d", "d2h"):
            cases = [
                ferry_pinned(rt, direction, data), ferry_pinned(rt, direction, data, wait_only=True),
                ferry_pageable(rt, direction, data), *_peer_cases(ctx, direction, data),
            ]
            if n <= SMALL_PAGEABLE:  # checked against the driver's rows to within 10%: timed interleaved
                ctx.run_together("transfer", cases)
            else:
                for case in cases:
                    ctx.run("transfer", case)
            # alone: while a registration is active the small pageable route stands aside
            ctx.run("transfer", ferry_pageable(rt, direction, data, registered=True))
        _free_peers(ctx)
        rt.poll()


def group_host_copies(ctx: Context) -> None:
    rt = ctx.rt
    n = 8 * MiB
    data = payload(n, 7)
    pinned = rt.pinned(n)
    holder = {"view": pinned.as_array()}

    def clone() -> None:
        data.copy()

    def to_pinned() -> None:
        np.copyto(holder["view"], data)

    def to_pinned_check() -> bool:
        to_pinned()
        return bool(np.array_equal(holder["view"], data))

    ctx.run("host_copies", Case("ferry", "pageable_clone", "host", n, clone, lambda: True))
    ctx.run("host_copies", Case("ferry", "pageable_to_pinned", "host", n, to_pinned, to_pinned_check))
    holder.clear()
    pinned.close()
    ctx.run("host_copies", ferry_pinned(rt, "h2d", data))
    ctx.run("host_copies", ferry_pageable(rt, "h2d", data))
    for size in ceiling_sizes(ctx):
        _ceiling_at(ctx, size)


def ceiling_sizes(ctx: Context) -> list[int]:
    """Where the memcpy ceiling is measured (64 MiB only on the emulated device: CI's memory)."""
    return [64 * MiB] if ctx.rt.backend == "emulated" else [64 * MiB, 256 * MiB]


CEILING_ROUTES = ("pageable_to_pageable", "pageable_to_pinned", "pinned_to_pageable")


def _ceiling_at(ctx: Context, n: int) -> None:
    """The multi-threaded memcpy at the engine's lane count, each way a staged route copies,
    then ferry's pageable routes at the same size (reused output), for the checks' ratios."""
    rt = ctx.rt
    threads = parts_of(rt).staging.lanes
    data = payload(n, n + 3)
    pageable = np.empty(n, np.uint8)
    pinned = rt.pinned(n)
    holder = {"view": pinned.as_array()}
    passes = passes_for(n)
    try:
        for route in CEILING_ROUTES:
            ctx.progress(f"host_copies: memcpy x{threads} {route} {_size(n)}")
            dst, src = {
                "pageable_to_pageable": (pageable, data),
                "pageable_to_pinned": (holder["view"], data),
                "pinned_to_pageable": (pageable, holder["view"]),
            }[route]
            result = Result("host_copies", "memcpy_mt", route, "host", n,
                            note=f"{threads} threads, a 1/{threads} share each, {passes} passes per round")
            ctx.results.append(result)
            try:
                dst[:] = POISON_BYTE  # also touches every page
                team = CopyTeam(dst, src, threads, passes)
                try:
                    team.round()  # warm-up
                    result.valid = bool(np.array_equal(dst, src))
                    if result.valid:
                        result.samples = _rounds(team, ctx.budget)
                    else:
                        result.note += "; validation failed: not timed"
                finally:
                    team.close()
            except Exception as exc:
                result.valid = False
                result.note = f"error: {exc!r}"
    finally:
        holder.clear()
        pinned.close()
    del pageable
    for direction in ("h2d", "d2h"):
        ctx.run("host_copies", ferry_pageable(rt, direction, data))
    rt.poll()


POISON_BYTE = 0xA5


def _rounds(team: CopyTeam, budget: Budget) -> list[float]:
    samples: list[float] = []
    deadline = time.perf_counter() + budget.seconds
    most = min(budget.max_reps, 50)
    while len(samples) < most and (len(samples) < budget.min_reps or time.perf_counter() < deadline):
        samples.append(team.round())
    return samples


def group_large(ctx: Context) -> None:
    rt = ctx.rt
    n = ctx.large()
    data = payload(n, 11)
    ctx.run("large", ferry_fresh_download(rt, data))
    for direction in ("d2h", "h2d"):
        ctx.run("large", ferry_pageable(rt, direction, data))
        ctx.run("large", ferry_pinned(rt, direction, data))
        if "raw" in ctx.peers:
            ctx.run("large", ctx.peers["raw"].case(direction, "pageable", data))
        if "torch" in ctx.peers:
            ctx.run("large", ctx.peers["torch"].case(direction, "pageable", data))
        if "cupy" in ctx.peers:
            ctx.run("large", ctx.peers["cupy"].case(direction, "pageable", data))
    if "torch" in ctx.peers:
        ctx.run("large", ctx.peers["torch"].fresh_download(data))
    if "cupy" in ctx.peers:
        ctx.run("large", ctx.peers["cupy"].fresh_download(data))
    _free_peers(ctx)


def host_work(iterations: int) -> float:
    """Compute-bound host work: 64 bytes of state, no memory traffic to speak of."""
    x = 1.0
    for i in range(iterations):
        x = (x * 1.000001 + i) % 1000.0
    return x


def _calibrate(seconds: float) -> int:
    iterations = 20_000
    while True:
        start = time.perf_counter()
        host_work(iterations)
        elapsed = time.perf_counter() - start
        if elapsed > 0.01 or iterations > 1 << 26:
            return max(1, int(iterations * seconds / elapsed))
        iterations *= 4


def group_overlap(ctx: Context) -> None:
    for n in (8 * MiB, ctx.large()):
        _overlap_at(ctx, n)


def _overlap_at(ctx: Context, n: int) -> None:
    rt = ctx.rt
    data = payload(n, 13)
    copy_result = ctx.run("overlap", ferry_pinned(rt, "d2h", data))
    copy_result.route = "copy_only"
    iterations = _calibrate(copy_result.median * 0.9)
    box: dict[str, Any] = {"buf": rt.pinned(n), "dev": rt.to_device(data)}

    def host_only() -> None:
        host_work(iterations)

    def serial() -> None:
        box["dev"], box["buf"] = rt.download_pending(box["dev"], box["buf"]).wait()
        host_work(iterations)

    def overlapped() -> None:
        pending = rt.download_pending(box["dev"], box["buf"])
        host_work(iterations)
        box["dev"], box["buf"] = pending.wait()

    def check() -> bool:
        poison(box["buf"].as_array())
        overlapped()
        return bool(np.array_equal(box["buf"].as_array(), data))

    ctx.run("overlap", Case("ferry", "host_only", "host", n, host_only, lambda: True))
    ctx.run("overlap", Case("ferry", "serial", "d2h", n, serial, check))
    ctx.run("overlap", Case("ferry", "overlapped", "d2h", n, overlapped, check))
    box["buf"].close()


def group_both(ctx: Context) -> None:
    rt = ctx.rt
    n = ctx.large()
    up, down = payload(n, 17), payload(n, 19)
    box: dict[str, Any] = {
        "ubuf": rt.pinned(n),
        "udev": rt.empty(n, np.uint8),
        "dbuf": rt.pinned(n),
        "ddev": rt.to_device(down),
    }
    box["ubuf"].as_array()[:] = up

    def pinned_both() -> None:
        pu = rt.upload_pending(box["ubuf"], box["udev"])
        pd = rt.download_pending(box["ddev"], box["dbuf"])
        box["ubuf"], box["udev"] = pu.wait()
        box["ddev"], box["dbuf"] = pd.wait()

    def check_pinned() -> bool:
        poison(box["dbuf"].as_array())
        pinned_both()
        return bool(np.array_equal(box["dbuf"].as_array(), down)) and bool(
            np.array_equal(rt.to_host(box["udev"]), up)
        )

    ctx.run("both", Case("ferry", "pinned", "both", 2 * n, pinned_both, check_pinned))
    out = np.empty(n, np.uint8)

    def pageable_both() -> None:
        pu = rt.upload(up, box["udev"])
        pd = rt.download(box["ddev"], out)
        _, box["udev"] = pu.wait()
        box["ddev"], _ = pd.wait()

    def check_pageable() -> bool:
        poison(out)
        pageable_both()
        return bool(np.array_equal(out, down)) and bool(np.array_equal(rt.to_host(box["udev"]), up))

    ctx.run("both", Case("ferry", "pageable", "both", 2 * n, pageable_both, check_pageable))
    box["ubuf"].close()
    box["dbuf"].close()
    if "raw" in ctx.peers:
        raw = ctx.peers["raw"]
        hu, hd = raw.pinned(n), raw.pinned(n)
        du, dd = raw.device(n), raw.device(n)
        hu[:] = up
        hd[:] = down
        raw.copy("h2d", hd, dd, n)
        raw.sync()

        def raw_both() -> None:
            raw.copy("h2d", hu, du, n, lane=0)
            raw.copy("d2h", hd, dd, n, lane=1)
            raw.sync(0)
            raw.sync(1)

        def check_raw() -> bool:
            poison(hd)
            raw_both()
            return bool(np.array_equal(hd, down))

        ctx.run("both", Case("raw", "pinned", "both", 2 * n, raw_both, check_raw))
        _free_peers(ctx)


def group_latency(ctx: Context) -> None:
    rt = ctx.rt
    budget = Budget(ctx.budget.seconds * 2, 50, 20000, 100)
    for n in (16, 64):
        data = payload(n, 23)
        for direction in ("h2d", "d2h"):
            # interleaved: the checks compare these rows, and VM hosts drift within seconds
            cases = [ferry_pinned(rt, direction, data)]
            if "raw" in ctx.peers:
                cases.append(ctx.peers["raw"].case(direction, "pinned", data))
            if "torch" in ctx.peers:
                cases.append(ctx.peers["torch"].case(direction, "pinned_non_blocking", data))
            if "cupy" in ctx.peers:
                cases.append(ctx.peers["cupy"].case(direction, "pinned", data))
            ctx.run_together("latency", cases, budget)
    _free_peers(ctx)


def group_many_small(ctx: Context) -> None:
    rt = ctx.rt
    count, n = 1000, 4 * KiB
    data = payload(count * n, 29).reshape(count, n)
    for case in ferry_many_small(rt, data):
        ctx.run("many_small", case)
    if "raw" in ctx.peers:
        for case in raw_many_small(ctx.peers["raw"], data):
            ctx.run("many_small", case)
        _free_peers(ctx)
    if "torch" in ctx.peers:
        _torch_many_small(ctx, data)


def ferry_many_small(rt: Any, data: np.ndarray[Any, Any]) -> list[Case]:
    """ferry's uploads of ``data``'s rows from pooled pinned buffers, each with its own event and
    inside ``rt.batch()`` (the second case's close gives the buffers back)."""
    count, n = data.shape
    box: dict[str, Any] = {
        "bufs": [rt.pinned(n) for _ in range(count)],
        "devs": [rt.empty(n, np.uint8) for _ in range(count)],
    }
    for buf, row in zip(box["bufs"], data, strict=True):
        buf.as_array()[:] = row

    def each(batched: bool) -> Callable[[], None]:
        def op() -> None:
            if batched:
                with rt.batch():
                    handles = [rt.upload_pending(b, d) for b, d in zip(box["bufs"], box["devs"], strict=True)]
            else:
                handles = [rt.upload_pending(b, d) for b, d in zip(box["bufs"], box["devs"], strict=True)]
            pairs = [h.wait() for h in handles]
            box["bufs"] = [p[0] for p in pairs]
            box["devs"] = [p[1] for p in pairs]

        return op

    def checker(op: Callable[[], None]) -> Callable[[], bool]:
        def check() -> bool:
            op()
            return all(np.array_equal(rt.to_host(d), row) for d, row in zip(box["devs"], data, strict=True))

        return check

    def close() -> None:
        for b in box["bufs"]:
            b.close()

    each_op, batch_op = each(False), each(True)
    return [
        Case("ferry", "event_each", "h2d", count * n, each_op, checker(each_op)),
        Case("ferry", "batch", "h2d", count * n, batch_op, checker(batch_op), close=close),
    ]


def _torch_many_small(ctx: Context, data: np.ndarray[Any, Any]) -> None:
    count, n = data.shape
    torch = ctx.peers["torch"].torch
    hosts = [torch.from_numpy(row.copy()).pin_memory() for row in data]
    tdevs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(count)]

    def torch_op() -> None:
        for h, t in zip(hosts, tdevs, strict=True):
            t.copy_(h, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def torch_check() -> bool:
        torch_op()
        return all(np.array_equal(t.cpu().numpy(), row) for t, row in zip(tdevs, data, strict=True))

    ctx.run("many_small", Case("torch", "pinned_non_blocking", "h2d", count * n, torch_op, torch_check))
    hosts.clear()
    tdevs.clear()
    _free_peers(ctx)


def raw_many_small(raw: Any, data: np.ndarray[Any, Any]) -> list[Case]:
    """The raw driver's loops over ``data``'s rows (one pinned block, a device allocation per row):
    ``event_each`` records an event after every copy and synchronizes each, as a loop of ferry's
    handles waits each; ``shared_event`` records one event after the last copy."""
    count, n = data.shape
    host = raw.pinned(count * n)
    host[:] = data.reshape(-1)
    devs = [raw.device(n) for _ in range(count)]
    d, stream = raw.d, raw.streams[0]
    copy, record, synchronize = d.cuMemcpyHtoDAsync, d.cuEventRecord, d.cuEventSynchronize
    srcs = [int(host.ctypes.data) + i * n for i in range(count)]
    pairs = list(zip(devs, srcs, strict=True))
    events = raw.new_events(count)
    triples = list(zip(devs, srcs, events, strict=True))
    last = raw.events[0]

    def each_op() -> None:
        for dev, src, event in triples:
            (err,) = copy(dev, src, n, stream)
            if err:
                raise RuntimeError(f"copy: {err}")
            (err,) = record(event, stream)
            if err:
                raise RuntimeError(f"cuEventRecord: {err}")
        for event in events:
            (err,) = synchronize(event)
            if err:
                raise RuntimeError(f"cuEventSynchronize: {err}")

    def shared_op() -> None:
        for dev, src in pairs:
            (err,) = copy(dev, src, n, stream)
            if err:
                raise RuntimeError(f"copy: {err}")
        (err,) = record(last, stream)
        if not err:
            (err,) = synchronize(last)
        if err:
            raise RuntimeError(f"cuEventRecord/cuEventSynchronize: {err}")

    def checker(op: Callable[[], None]) -> Callable[[], bool]:
        def check() -> bool:
            op()
            back = np.empty(n, np.uint8)
            for i in (0, count // 2, count - 1):
                poison(back)
                raw.copy("d2h", back, devs[i], n)
                raw.sync()
                if not np.array_equal(back, data[i]):
                    return False
            return True

        return check

    return [
        Case("raw", "event_each", "h2d", count * n, each_op, checker(each_op)),
        Case("raw", "shared_event", "h2d", count * n, shared_op, checker(shared_op)),
    ]


def group_pinned_alloc(ctx: Context) -> None:
    for n in (8 * MiB, ctx.large()):
        _alloc_at(ctx, n)


def _alloc_at(ctx: Context, n: int) -> None:
    rt = ctx.rt
    box: dict[str, Any] = {}

    def fresh_setup() -> None:
        if "buf" in box:
            box.pop("buf").close()
        parts_of(rt).pool.trim()

    def pooled_setup() -> None:
        if "buf" in box:
            box.pop("buf").close()

    def op() -> None:
        box["buf"] = rt.pinned(n)

    def check() -> bool:
        op()
        return bool(box["buf"].nbytes == n)

    small = Budget(ctx.budget.seconds, 3, 50, 1)
    ctx.run("pinned_alloc", Case("ferry", "fresh", "-", n, op, check, setup=fresh_setup), small)
    ctx.run("pinned_alloc", Case("ferry", "pool", "-", n, op, check, setup=pooled_setup), small)
    pooled_setup()


_SLOW_FILL = r"""
extern "C" __global__ void slow_fill(unsigned char* p, size_t n, unsigned char v, long long cycles) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }
    __syncthreads();
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}
"""


def _producer(ctx: Context, n: int) -> tuple[Any, Callable[[int], None], str, int] | None:
    """A foreign array, a function that launches a ~10 ms producer kernel writing it, a
    description, and the producer's stream handle."""
    rt = ctx.rt
    if rt.backend == "emulated":
        backing = rt.empty(n, np.uint8)
        handle = testing.side_stream(rt)
        foreign = testing.ForeignArray(backing, stream=handle)
        return (
            foreign, lambda v: testing.produce(rt, handle, backing.ptr, n, v, delay=0.01), "emulated producer", handle
        )
    if "cupy" in ctx.peers:
        cupy = ctx.peers["cupy"].cupy
        kernel = cupy.RawKernel(_SLOW_FILL, "slow_fill")
        clock_khz = cupy.cuda.runtime.getDeviceProperties(rt.device)["clockRate"]
        cycles = int(clock_khz * 1e3 * 10e-3)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            array = cupy.empty(n, cupy.uint8)

        def launch(value: int) -> None:
            with stream:  # the interface names the current stream: the producer's
                kernel((132,), (256,), (array, cupy.uint64(n), cupy.uint8(value), cupy.int64(cycles)))

        class Produced:  # exports the array with the producer's stream current
            @property
            def __cuda_array_interface__(self) -> dict[str, Any]:
                with stream:
                    return dict(array.__cuda_array_interface__)

        return Produced(), launch, "CuPy kernel, CUDA Array Interface v3", int(stream.ptr)
    return None


def group_handoff(ctx: Context) -> None:
    """Submitting a download right after a ~10 ms producer kernel: no host wait, right bytes.

    Each repetition also records whether the producer was still running when
    the submission returned (an event recorded behind it, queried at once):
    a submission that waited on the host would always find it finished.
    """
    rt = ctx.rt
    n = 8 * MiB
    made = _producer(ctx, n)
    if made is None:
        ctx.record(Result("handoff", "ferry", "submit_after_producer", "d2h", n, note="no producer available"))
        return
    foreign, launch, how, handle = made
    backend = testing.backend_of(rt)
    producer_stream = backend.stream_from_handle(handle)
    marker = backend.event_create()
    buf = rt.pinned(n)
    samples: list[float] = []
    valid = True
    running = 0
    reps = 5 if ctx.quick else 20
    try:
        for i in range(reps + 2):
            value = 1 + i % 250
            launch(value)
            backend.event_record(marker, producer_stream)
            start = time.perf_counter()
            pending = rt.download_pending(foreign, buf)
            elapsed = time.perf_counter() - start
            still_running = not backend.event_query(marker)
            _, buf = pending.wait()
            view = buf.as_array()
            valid = valid and bool(view[0] == value and view[-1] == value and np.all(view[:: 1 << 12] == value))
            del view
            if i >= 2:
                samples.append(elapsed)
                running += still_running
    finally:
        buf.close()
        backend.event_destroy(marker)
    note = f"{how}; producer still running at return in {running}/{reps}"
    ctx.record(Result("handoff", "ferry", "submit_after_producer", "d2h", n, samples=samples, valid=valid, note=note))


def group_peer(ctx: Context) -> None:
    """Device to device: peer against staged, each direction and both at once."""
    from .._runtime import Runtime

    rt = ctx.rt
    count = testing.backend_of(rt).device_count()
    if count < 2:
        ctx.record(Result("peer", "ferry", "-", "-", 0, note=f"{count} device: no pair to measure"))
        return
    n = ctx.large()
    data0, data1 = payload(n, 31), payload(n, 37)
    for route, peer in (("peer", True), ("staged", False)):
        a = Runtime(rt.backend, 0, peer_access=peer, staging=parts_of(rt).staging)
        b = Runtime(rt.backend, 1, peer_access=peer, staging=parts_of(rt).staging)
        try:
            _device_pair_cases(ctx, route, a, b, data0, data1)
        finally:
            b.close()
            a.close()


def _device_pair_cases(ctx: Context, route: str, a: Any, b: Any, data0: Any, data1: Any) -> None:
    n = data0.nbytes
    box = {"s0": a.to_device(data0), "d0": a.empty(n, np.uint8), "s1": b.to_device(data1), "d1": b.empty(n, np.uint8)}

    def forward() -> None:
        box["s0"], box["d1"] = b.copy_pending(box["s0"], box["d1"]).wait()

    def backward() -> None:
        box["s1"], box["d0"] = a.copy_pending(box["s1"], box["d0"]).wait()

    def both() -> None:
        p1 = b.copy_pending(box["s0"], box["d1"])
        p0 = a.copy_pending(box["s1"], box["d0"])
        box["s0"], box["d1"] = p1.wait()
        box["s1"], box["d0"] = p0.wait()

    def check_forward() -> bool:
        forward()
        return bool(np.array_equal(b.to_host(box["d1"]), data0))

    def check_backward() -> bool:
        backward()
        return bool(np.array_equal(a.to_host(box["d0"]), data1))

    def check_both() -> bool:
        both()
        return bool(np.array_equal(b.to_host(box["d1"]), data0)) and bool(np.array_equal(a.to_host(box["d0"]), data1))

    ctx.run("peer", Case("ferry", route, "0->1", n, forward, check_forward))
    ctx.run("peer", Case("ferry", route, "1->0", n, backward, check_backward))
    ctx.run("peer", Case("ferry", route, "both", 2 * n, both, check_both))


def case_count(group: str, ctx: Context) -> int:
    """How many cases ``group`` runs (or records) in ``ctx``: the progress bar's total."""
    has = {name: int(name in ctx.peers) for name in ("raw", "torch", "cupy")}
    peer_cases = 2 * has["raw"] + 4 * has["torch"] + 2 * has["cupy"]  # per direction, see _peer_cases
    pageable_peers = has["raw"] + has["torch"] + has["cupy"]
    if group == "peer":
        return 6 if testing.backend_of(ctx.rt).device_count() >= 2 else 1
    counts = {
        "transfer": len(ctx.sizes) * 2 * (4 + peer_cases),
        "host_copies": 4 + len(ceiling_sizes(ctx)) * (len(CEILING_ROUTES) + 2),
        "large": 1 + 2 * (2 + pageable_peers) + has["torch"] + has["cupy"],
        "overlap": 2 * 4,
        "both": 2 + has["raw"],
        "latency": 2 * 2 * (1 + pageable_peers),
        "many_small": 2 + 2 * has["raw"] + has["torch"],
        "pinned_alloc": 2 * 2,
        "handoff": 1,
        "pipeline": _pipeline.case_count(ctx.rt.backend == "emulated", ctx.quick),
        "gil": _gil.case_count(ctx),
        "files": _files.case_count(ctx),
    }
    return counts[group]


GROUPS: dict[str, Callable[[Context], None]] = {
    "transfer": group_transfer,
    "host_copies": group_host_copies,
    "large": group_large,
    "overlap": group_overlap,
    "both": group_both,
    "latency": group_latency,
    "many_small": group_many_small,
    "pinned_alloc": group_pinned_alloc,
    "handoff": group_handoff,
    "peer": group_peer,
    "pipeline": _pipeline.group_pipeline,
    "gil": _gil.group_gil,
    "files": _files.group_files,
}
