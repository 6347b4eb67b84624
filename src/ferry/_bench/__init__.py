"""``python -m ferry bench``: every route, side by side with the peers, in one run.

Writes a Markdown table to stdout and, under ``--out``, ``bench.md``,
``bench.json`` (machine, GPU, driver, versions, every sample) and
``bench.png`` (bandwidth against size per route and peer).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._groups import GROUPS, Context
from ._peers import load_peers
from ._protocol import Budget, Result
from ._report import compute_checks, markdown, metadata, plot, write_json

__all__: list[str] = []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench subcommand's options."""
    parser.add_argument("--quick", action="store_true", help="a run under a minute: fewer sizes, shorter timing")
    parser.add_argument(
        "--groups",
        default=",".join(GROUPS),
        help=f"comma-separated groups (default: all): {', '.join(GROUPS)}",
    )
    parser.add_argument("--out", default="bench-out", help="folder for bench.md, bench.json, bench.png")
    parser.add_argument("--seconds", type=float, default=None, help="timing budget per case (seconds)")


@contextmanager
def _progress() -> Iterator[Callable[[str], None]]:
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        count = [0]

        def plain(label: str) -> None:
            count[0] += 1
            print(f"[{count[0]:4d}] {label}", file=sys.stderr, flush=True)

        yield plain
        return
    console = Console(stderr=True)
    with Progress(
        SpinnerColumn(), TextColumn("{task.completed:>4.0f} cases"), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as bar:
        task = bar.add_task("starting", total=None)

        def update(label: str) -> None:
            bar.update(task, advance=1, description=label)

        yield update


def run(rt: Any, args: argparse.Namespace) -> int:
    """Run the selected groups on ``rt`` and write the report."""
    selected = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in selected if g not in GROUPS]
    if unknown:
        print(f"unknown group(s): {', '.join(unknown)}; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 0.4)
    peers, missing = load_peers(rt)
    budget = Budget(seconds=seconds, min_reps=3 if args.quick else 5)
    meta = metadata(rt, peers, missing, args)
    with _progress() as progress:
        ctx = Context(rt, peers, budget, args.quick, progress)
        for name in selected:
            try:
                GROUPS[name](ctx)
            except Exception as exc:
                ctx.results.append(Result(name, "ferry", "-", "-", 0, valid=False, note=f"group failed: {exc!r}"))
    checks = compute_checks(ctx.results)
    report = markdown(meta, ctx.results, checks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(report)
    write_json(out / "bench.json", meta, ctx.results, checks)
    why_not = plot(out / "bench.png", meta, ctx.results)
    print(report)
    print(f"written: {out / 'bench.md'}, {out / 'bench.json'}" + (f", {out / 'bench.png'}" if why_not is None else ""))
    if why_not is not None:
        print(f"no plot: {why_not}")
    invalid = [r for r in ctx.results if r.valid is False]
    if invalid:
        print(f"{len(invalid)} case(s) failed validation", file=sys.stderr)
        return 1
    return 0
