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
from ._protocol import Result

__all__: list[str] = []

MiB = 1 << 20


@dataclass
class Check:
    """One target: what was measured against what it must reach."""

    name: str
    measured: str
    target: str
    passed: bool | None  # None: not measured in this run


def _find(results: Iterable[Result], **want: Any) -> Result | None:
    for r in results:
        if all(getattr(r, k) == v for k, v in want.items()) and r.samples and r.valid:
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
        if f is None or raw is None:
            checks.append(Check(f"16 B {d} round trip vs raw driver", "not measured", "<= 1.3x", None))
        else:
            value = f.median / raw.median
            checks.append(
                Check(
                    f"16 B {d} round trip vs raw driver",
                    f"{f.median * 1e6:.2f} / {raw.median * 1e6:.2f} us = {value:.2f}x",
                    "<= 1.3x",
                    value <= 1.3,
                )
            )
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
            f"pageable d2h {n // MiB} MiB into a fresh output", _find(large, impl="ferry", route="fresh"), 20
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
    return checks


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
        lines += [f"## {group}", "", "| impl | route | dir | size | median | min | max | GB/s | valid |"]
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in (r for r in results if r.group == group):
            lo = min(r.samples) if r.samples else float("nan")
            hi = max(r.samples) if r.samples else float("nan")
            no_rate = math.isnan(r.gbps) or r.direction in ("host", "-") or r.group == "handoff"
            gbps = "-" if no_rate else f"{r.gbps:.2f}"
            valid = {True: "yes", False: f"NO {r.note}", None: "-"}[r.valid]
            lines.append(
                f"| {r.impl} | {r.route} | {r.direction} | {_fmt_size(r.nbytes)} | {_fmt_time(r.median)} "
                f"| {_fmt_time(lo)} | {_fmt_time(hi)} | {gbps} | {valid} |"
            )
        lines.append("")
    lines += ["## checks", "", "| check | measured | target | result |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.measured} | {c.target} | {verdict(c, meta['backend'])} |")
    return "\n".join(lines) + "\n"


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
