"""Report: a Markdown table, JSON with every sample, a PNG plot, and the checks.

The checks are the figures ferry must reach (DESIGN.md section 4), computed as
ratios against peers measured in the same run so that they hold on a noisy
machine. A check whose inputs were not measured (a peer is missing, the group
was not selected) is reported as not run, never as passed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._runtime import parts_of
from . import _files
from ._protocol import Result

__all__: list[str] = []

MiB = 1 << 20
PEER_TARGET = "<= 1.0x, or both on the device floor"


@dataclass
class Check:
    """One target: what was measured against what it must reach."""

    name: str
    measured: str
    target: str
    passed: bool | None  # None: not measured in this run


def _find(results: Iterable[Result], **want: Any) -> Result | None:
    """The first measured, validated result matching ``want`` (``valid=None`` counts for host-only
    rows such as the ``gil`` group's idle loop, which have nothing to validate)."""
    for r in results:
        checked = r.valid or (r.valid is None and r.direction == "host")
        if checked and r.samples and all(getattr(r, k) == v for k, v in want.items()):
            return r
    return None


def compute_checks(results: list[Result]) -> list[Check]:
    checks: list[Check] = []

    def ratio_check(name: str, a: Result | None, b: Result | None, minimum: float, what: str) -> None:
        if a is None or b is None:
            checks.append(Check(name, "not measured", what, None))
            return
        value = a.gbps / b.gbps
        checks.append(Check(name, f"{a.gbps:.2f} / {b.gbps:.2f} GB/s = {value:.3f}", what, value >= minimum))

    def bandwidth_check(name: str, r: Result | None, minimum: float) -> None:
        measured = "not measured" if r is None else f"{r.gbps:.1f} GB/s"
        checks.append(Check(name, measured, f">= {minimum:g} GB/s", None if r is None else r.gbps >= minimum))

    sizes = sorted({r.nbytes for r in results if r.group == "transfer" and r.nbytes >= MiB})
    for n in sizes:
        for d in ("h2d", "d2h"):
            ratio_check(
                f"pinned {d} {n // MiB} MiB vs raw driver",
                _find(results, group="transfer", impl="ferry", route="pinned", direction=d, nbytes=n),
                _find(results, group="transfer", impl="raw", route="pinned", direction=d, nbytes=n),
                0.97,
                ">= 0.97",
            )
    for d in ("h2d", "d2h"):
        f = _find(results, group="latency", impl="ferry", route="pinned", direction=d, nbytes=16)
        raw = _find(results, group="latency", impl="raw", route="pinned", direction=d, nbytes=16)
        time_ratio_check(checks, f"16 B {d} round trip vs raw driver", f, raw, 1.05, "us")
        for peer, route in (("torch", "pinned_non_blocking"), ("cupy", "pinned")):
            p = _find(results, group="latency", impl=peer, route=route, direction=d, nbytes=16)
            if f is None or p is None:
                checks.append(Check(f"16 B {d} round trip faster than {peer}", "not measured", "faster", None))
            else:
                checks.append(
                    Check(
                        f"16 B {d} round trip faster than {peer}",
                        f"{f.median * 1e6:.2f} vs {p.median * 1e6:.2f} us",
                        "faster",
                        f.median < p.median,
                    )
                )
    for n in sorted({r.nbytes for r in results if r.group == "overlap"}):
        copy = _find(results, group="overlap", route="copy_only", nbytes=n)
        host = _find(results, group="overlap", route="host_only", nbytes=n)
        over = _find(results, group="overlap", route="overlapped", nbytes=n)
        if copy is None or host is None or over is None:
            checks.append(Check(f"overlap {n // MiB} MiB", "not measured", "<= 1.03x max", None))
            continue
        value = over.median / max(copy.median, host.median)
        checks.append(
            Check(
                f"overlap {n // MiB} MiB",
                f"{over.median * 1e3:.3f} ms vs max({copy.median * 1e3:.3f}, {host.median * 1e3:.3f}) = {value:.3f}x",
                "<= 1.03x max(copy, host)",
                value <= 1.03,
            )
        )
    ratio_check(
        "both directions at once vs raw two streams",
        _find(results, group="both", impl="ferry", route="pinned"),
        _find(results, group="both", impl="raw", route="pinned"),
        0.95,
        ">= 0.95",
    )
    large = [r for r in results if r.group == "large"]
    if large:
        n = large[0].nbytes
        for d in ("h2d", "d2h"):
            f = _find(large, impl="ferry", route="pageable", direction=d)
            bandwidth_check(f"pageable {d} {n // MiB} MiB (reused output)", f, 35)
            ratio_check(
                f"pageable {d} vs PyTorch pageable copy_",
                f,
                _find(large, impl="torch", route="pageable", direction=d),
                1.8,
                ">= 1.8x",
            )
            ratio_check(
                f"pageable {d} vs raw driver pageable",
                f,
                _find(large, impl="raw", route="pageable", direction=d),
                4.0,
                ">= 4x",
            )
        bandwidth_check(
            f"pageable d2h {n // MiB} MiB into a fresh output", _find(large, impl="ferry", route="fresh"), 25
        )
    handoff = [r for r in results if r.group == "handoff"]
    if handoff:
        h = handoff[0]
        right = "right" if h.valid else "WRONG"
        running = h.note.rsplit(" ", 1)[-1] if "still running" in h.note else "?"
        measured = (
            f"submit {h.median * 1e6:.1f} us, producer still running at return {running}, bytes {right}"
            if h.samples else "not measured"
        )
        every = running != "?" and running.split("/")[0] == running.split("/")[1]
        checks.append(
            Check(
                "download submitted after a ~10 ms producer (no host wait)",
                measured,
                "returns while the producer runs, every time; < 1 ms; right bytes",
                None if not h.samples else (every and h.median < 1e-3 and bool(h.valid)),
            )
        )
    for d in ("h2d", "d2h"):
        f = _find(results, group="transfer", impl="ferry", route="pageable", direction=d, nbytes=8 * MiB)
        bandwidth_check(f"pageable {d} 8 MiB", f, 25)
    for d in ("h2d", "d2h"):
        ratio_check(
            f"pageable {d} 1 MiB vs raw driver pageable",
            _find(results, group="transfer", impl="ferry", route="pageable", direction=d, nbytes=MiB),
            _find(results, group="transfer", impl="raw", route="pageable", direction=d, nbytes=MiB),
            1.0,
            ">= 1.0 (at least the driver's own pageable copy)",
        )
    checks += _small_checks(results)
    checks += _ceiling_checks(results)
    checks += _pipeline_checks(results)
    checks += _gil_checks(results)
    checks += _files.checks(results, Check, _find)
    return checks


def time_ratio_check(
    checks: list[Check], name: str, a: Result | None, b: Result | None, limit: float, unit: str, strict: bool = False
) -> None:
    """``a``'s median time within ``limit`` times ``b``'s (``strict``: below it)."""
    target = f"< {limit:g}x" if strict else f"<= {limit:g}x"
    if a is None or b is None:
        checks.append(Check(name, "not measured", target, None))
        return
    scale = 1e3 if unit == "ms" else 1e6
    value = a.median / b.median
    measured = f"{a.median * scale:.3f} / {b.median * scale:.3f} {unit} = {value:.3f}x"
    checks.append(Check(name, measured, target, value < limit if strict else value <= limit))


def _small_checks(results: list[Result]) -> list[Check]:
    """Many small uploads against the raw driver's loop with one event per copy (ferry's
    own loop within 1.5x, inside ``rt.batch()`` faster), and the pageable route from 16 B to 64 KiB
    within 1.1x of the driver's own pageable copy at every size measured, each way."""
    checks: list[Check] = []
    raw_each = _find(results, group="many_small", impl="raw", route="event_each")
    time_ratio_check(checks, "1000 x 4 KiB uploads, one event each, vs raw driver loop (event each)",
                     _find(results, group="many_small", impl="ferry", route="event_each"), raw_each, 1.5, "ms")
    time_ratio_check(checks, "1000 x 4 KiB uploads in rt.batch() vs raw driver loop (event each)",
                     _find(results, group="many_small", impl="ferry", route="batch"), raw_each, 1.0, "ms",
                     strict=True)
    sizes = sorted({r.nbytes for r in results if r.group == "transfer" and r.nbytes <= 64 * 1024})
    for n in sizes:
        for d in ("h2d", "d2h"):
            time_ratio_check(
                checks, f"pageable {d} {_fmt_size(n)} vs raw driver pageable",
                _find(results, group="transfer", impl="ferry", route="pageable", direction=d, nbytes=n),
                _find(results, group="transfer", impl="raw", route="pageable", direction=d, nbytes=n), 1.1, "us",
            )
    return checks


CEILING_OF = {"h2d": "pageable_to_pinned", "d2h": "pinned_to_pageable"}  # the host copy each direction stages


def _pageable_at(results: list[Result], n: int, d: str) -> Result | None:
    """ferry's pageable route at ``n`` bytes (reused output): measured beside the ceiling in
    ``host_copies`` if it was, else in ``large`` or ``transfer`` of the same run."""
    for group in ("host_copies", "large", "transfer"):
        r = _find(results, group=group, impl="ferry", route="pageable", direction=d, nbytes=n)
        if r is not None:
            return r
    return None


def _ceiling_checks(results: list[Result]) -> list[Check]:
    """Pageable 64/256 MiB each way: >= 0.9x the multi-threaded memcpy ceiling (the host copy
    that direction stages, at the engine's lane count), and >= 35 GB/s where the ceiling itself
    reaches 35 GB/s."""
    checks = []
    for n in (64 * MiB, 256 * MiB):
        for d in ("h2d", "d2h"):
            name = f"pageable {d} {n // MiB} MiB vs multi-threaded memcpy ceiling"
            target = ">= 0.9x ceiling; >= 35 GB/s if the ceiling is >= 35"
            f = _pageable_at(results, n, d)
            c = _find(results, group="host_copies", impl="memcpy_mt", route=CEILING_OF[d], nbytes=n)
            if f is None or c is None:
                checks.append(Check(name, "not measured", target, None))
                continue
            ratio = f.gbps / c.gbps
            floor_ok = f.gbps >= 35 or c.gbps < 35
            measured = f"{f.gbps:.1f} / {c.gbps:.1f} GB/s ({CEILING_OF[d]}) = {ratio:.3f}x"
            checks.append(Check(name, measured, target, ratio >= 0.9 and floor_ok))
    return checks


def _ms(r: Result) -> str:
    return f"{r.median * 1e3:.3f} ms"


FLOOR_RESOLUTION = 1e-3  # the least relative resolution granted to a tie on the device-work floor


def floor_tie(a: Result, b: Result, work: Result | None) -> tuple[bool, float, float]:
    """Whether ``a`` and ``b`` tie on the device-work floor, ``a``'s relative position there, and the
    resolution used.

    No pipeline runs faster than its device work alone (``work``): where both
    contenders sit on that floor, which one measures lower is noise. The run's
    resolution r is the floor's own relative spread over its runs in this run
    ((max - min) / median), at least ``FLOOR_RESOLUTION`` (0.1%). They tie when
    ``b`` lies at or above the floor less r, ``a`` at most r above the floor,
    and ``a`` at most r above ``b``. A ``b`` further under the floor than r is
    no tie: the floor did not hold in this run, and the strict ratio stands.
    The floor of transfers alone is not one: a peer may move bytes faster
    than ferry does.
    """
    if work is None or not work.samples or math.isnan(work.median):
        return False, math.nan, math.nan
    floor = work.median
    resolution = max(FLOOR_RESOLUTION, (max(work.samples) - min(work.samples)) / floor)
    tie = (b.median >= floor * (1 - resolution) and a.median <= floor * (1 + resolution)
           and a.median <= b.median * (1 + resolution))
    return tie, a.median / floor, resolution


def _peer_check(name: str, a: Result | None, best: Result | None, work: Result | None) -> Check:
    """``a`` <= PyTorch's best practice, or both on the device floor (:func:`floor_tie`)."""
    if a is None or best is None:
        return Check(name, "not measured", PEER_TARGET, None)
    value = a.median / best.median
    measured = f"{_ms(a)} / {_ms(best)} = {value:.3f}x"
    passed = value <= 1.0
    if not passed:
        tie, position, resolution = floor_tie(a, best, work)
        if tie:
            passed = True
            measured += (f"; a tie on the device floor: {position:.4f}x of the work alone, "
                         f"within its resolution ({resolution:.2%})")
    return Check(name, measured, PEER_TARGET, passed)


def _pipeline_checks(results: list[Result]) -> list[Check]:
    """Per configuration: ferry (fresh arrays, the hand-written pipeline) <= PyTorch's best
    practice and within 1.05x of max(work alone, transfers alone); fresh within 1.05x of the
    ring; ferry.prefetch <= PyTorch's best practice. "<= PyTorch's best practice" also passes
    where both sit on the device-work floor (:func:`floor_tie`): there neither can be faster."""
    rows = [r for r in results if r.group == "pipeline"]
    checks: list[Check] = []
    for config in dict.fromkeys(r.config for r in rows):

        def get(impl: str, route: str, config: str = config) -> Result | None:
            return _find(rows, impl=impl, route=route, config=config)

        ferry, ring, pre = get("ferry", "fresh"), get("ferry", "ring"), get("ferry", "prefetch")
        best, work, moves = get("torch", "best"), get("floor", "work_only"), get("floor", "transfers_only")

        def time_check(name: str, a: Result | None, b: Result | None, limit: float, target: str,
                       b_value: float | None = None, b_text: str = "") -> None:
            if a is None or (b is None and b_value is None):
                checks.append(Check(name, "not measured", target, None))
                return
            denominator = b_value if b_value is not None else b.median if b is not None else math.nan
            value = a.median / denominator
            shown = b_text or f"{denominator * 1e3:.3f} ms"
            checks.append(Check(name, f"{_ms(a)} / {shown} = {value:.3f}x", target, value <= limit))

        prefix = f"pipeline {config}:"
        checks.append(_peer_check(f"{prefix} ferry <= PyTorch best practice", ferry, best, work))
        floor = None if work is None or moves is None else max(work.median, moves.median)
        time_check(
            f"{prefix} ferry within 1.05x of max(work alone, transfers alone)", ferry, None, 1.05, "<= 1.05x",
            b_value=floor,
            b_text="" if work is None or moves is None else f"max({_ms(work)}, {_ms(moves)})",
        )
        time_check(f"{prefix} ferry fresh arrays within 1.05x of a ring", ferry, ring, 1.05, "<= 1.05x")
        checks.append(_peer_check(f"{prefix} ferry.prefetch <= PyTorch best practice", pre, best, work))
    return checks


def _gil_checks(results: list[Result]) -> list[Check]:
    idle = _find(results, group="gil", route="idle")
    up = _find(results, group="gil", route="beside_ferry_upload")
    name = "python loop beside pageable uploads in a background thread"
    if idle is None or up is None:
        return [Check(name, "not measured", ">= 0.9x idle speed", None)]
    speed = idle.median / up.median
    moved = up.note.split(" (")[0]
    return [Check(name, f"{speed:.3f}x idle speed ({moved})", ">= 0.9x idle speed", speed >= 0.9)]


def _fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _fmt_time(s: float) -> str:
    if math.isnan(s):
        return "-"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} us"


def markdown(meta: dict[str, Any], results: list[Result], checks: list[Check]) -> str:
    lines = [f"# ferry bench ({meta['backend']})", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "peers_missing"]
    for peer, why in meta.get("peers_missing", {}).items():
        lines.append(f"- peer {peer} skipped: {why}")
    lines.append("")
    if meta["backend"] == "emulated":
        lines += ["**Emulated device: these figures model a device; they are not a GPU's.**", ""]
    for group in dict.fromkeys(r.group for r in results):
        if group in SPECIAL_TABLES:
            lines += SPECIAL_TABLES[group](results)
            continue
        rows = [r for r in results if r.group == group]
        noted = any(r.note and r.valid is not False for r in rows)  # notes of invalid rows go in "valid"
        header = "| impl | route | dir | size | median | min | max | GB/s | valid |" + (" note |" if noted else "")
        lines += [f"## {group}", "", header, "|---" * header.count(" | ") + "|---|"]
        for r in rows:
            lo = min(r.samples) if r.samples else float("nan")
            hi = max(r.samples) if r.samples else float("nan")
            host_rate = r.direction == "host" and r.group == "host_copies"  # host copies: bytes per second
            no_rate = math.isnan(r.gbps) or (r.direction in ("host", "-") and not host_rate) or r.group == "handoff"
            gbps = "-" if no_rate else f"{r.gbps:.2f}"
            valid = {True: "yes", False: f"NO {r.note}", None: "-"}[r.valid]
            lines.append(
                f"| {r.impl} | {r.route} | {r.direction} | {_fmt_size(r.nbytes)} | {_fmt_time(r.median)} "
                f"| {_fmt_time(lo)} | {_fmt_time(hi)} | {gbps} | {valid} |"
                + (f" {'' if r.valid is False else r.note} |" if noted else "")
            )
        lines.append("")
    lines += ["## checks", "", "| check | measured | target | result |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.measured} | {c.target} | {verdict(c, meta['backend'])} |")
    return "\n".join(lines) + "\n"


def _valid(r: Result) -> str:
    return {True: "yes", False: f"NO {r.note}", None: "-"}[r.valid]


def _pipeline_table(results: list[Result]) -> list[str]:
    rows = [r for r in results if r.group == "pipeline"]
    lines = [
        "## pipeline",
        "",
        "Wall time per step: each run's steady-state slope of the result arrivals (least squares), "
        "the median of the timed runs, min - max. Ratios: against the larger floor "
        "(device work alone, ferry's transfers alone) and against PyTorch's best practice.",
        "",
    ]
    for config in dict.fromkeys(r.config for r in rows):
        mine = [r for r in rows if r.config == config]
        work = _find(mine, impl="floor", route="work_only")
        moves = _find(mine, impl="floor", route="transfers_only")
        best = _find(mine, impl="torch", route="best")
        floor = max(work.median, moves.median) if work is not None and moves is not None else math.nan
        lines += [f"### {config} (batch, device work per step)", ""]
        lines += ["| contender | per step | min - max | / floor | / torch best | valid | note |"]
        lines.append("|---|---|---|---|---|---|---|")
        for r in mine:
            measured = bool(r.samples)
            lo = _fmt_time(min(r.samples)) if measured else "-"
            hi = _fmt_time(max(r.samples)) if measured else "-"
            over_floor = f"{r.median / floor:.3f}x" if measured and not math.isnan(floor) else "-"
            over_best = f"{r.median / best.median:.3f}x" if measured and best is not None else "-"
            note = "" if r.valid is False else r.note
            lines.append(
                f"| {r.impl} {r.route} | {_fmt_time(r.median)} | {lo} - {hi} | {over_floor} | {over_best} "
                f"| {_valid(r)} | {note} |"
            )
        lines.append("")
    return lines


def _gil_table(results: list[Result]) -> list[str]:
    rows = [r for r in results if r.group == "gil"]
    idle = _find(rows, route="idle")
    lines = [
        "## gil",
        "",
        "A pure-Python loop on the main thread, in windows of a fixed iteration count: window time "
        "(median) and speed against idle, beside each background loop of 64 MiB transfers.",
        "",
        "| main thread | window | speed vs idle | background | valid |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        speed = f"{idle.median / r.median:.3f}x" if idle is not None and r.samples else "-"
        note = "" if r.valid is False else r.note
        lines.append(f"| {r.route} | {_fmt_time(r.median)} | {speed} | {note} | {_valid(r)} |")
    lines.append("")
    return lines


SPECIAL_TABLES = {"pipeline": _pipeline_table, "gil": _gil_table}


def verdict(check: Check, backend: str) -> str:
    """pass, MISS or not run; on the emulated device a measured GPU target reads "n/a (emulated)"."""
    if check.passed is None:
        return "not run"
    if backend == "emulated":  # every target is a GPU's: a modelled device neither meets nor misses it
        return "n/a (emulated)"
    return "pass" if check.passed else "MISS"


def metadata(rt: Any, peers: dict[str, Any], missing: dict[str, str], args: Any) -> dict[str, Any]:
    import numpy

    info = rt.info()
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "backend": rt.backend,
        "device": info.get("name"),
        "driver": f"{info.get('driver')} ({info.get('driver_version', '-')})",
        "link": info.get("link"),
        "cuda_bindings": info.get("cuda_bindings", "-"),
        "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "staging": str(parts_of(rt).staging),
        "mode": "quick" if args.quick else "full",
    }
    for name, peer in peers.items():
        if hasattr(peer, "version"):
            meta[name] = peer.version
    meta["peers_missing"] = missing
    return meta


def write_json(path: Path, meta: dict[str, Any], results: list[Result], checks: list[Check]) -> None:
    doc = {
        "meta": meta,
        "results": [r.to_json() for r in results],
        "checks": [{**c.__dict__, "verdict": verdict(c, meta["backend"])} for c in checks],
    }
    path.write_text(json.dumps(doc, indent=1, default=str))


def plot(path: Path, meta: dict[str, Any], results: list[Result]) -> str | None:
    """Bandwidth against size per route and peer; returns why not, if no plot was made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'cuda-ferry[bench]')"
    transfer = [r for r in results if r.group == "transfer" and r.samples and r.valid]
    if not transfer:
        return "the transfer group was not run"
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    for ax, direction in zip(axes, ("h2d", "d2h"), strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in transfer:
            if r.direction == direction:
                series.setdefault(f"{r.impl} {r.route}", []).append((r.nbytes, r.gbps))
        for label, points in sorted(series.items()):
            points.sort()
            style = "-" if label.startswith("ferry") else "--"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per transfer")
        ax.set_title(f"{'host to device' if direction == 'h2d' else 'device to host'}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (median, host wall clock)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"ferry bench: {meta['device']} ({meta['backend']}), {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
