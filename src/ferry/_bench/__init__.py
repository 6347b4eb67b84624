"""``python -m ferry bench``: every route, side by side with the peers, in one run.

Prints a Markdown report to stdout and writes, into ``--out`` (default
``bench-out`` in the current directory, said at the start), ``bench.md``,
``bench.json`` (machine, GPU, driver, versions, every sample) and
``bench.png`` (bandwidth against size per route and peer; needs matplotlib).
``--no-files`` writes nothing. Progress goes to stderr: a bar with the case
count and the time left (rich, from the ``bench`` extra), or one line per case.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import _interrupt
from ._groups import GROUPS, Context, case_count
from ._peers import load_peers
from ._protocol import Budget, Result, host_drift, host_speed
from ._report import compute_checks, markdown, metadata, plot, write_json

__all__: list[str] = []

DEFAULT_OUT = "bench-out"

DESCRIPTION = f"""\
Time every route (pinned, pageable, registered, fresh outputs, both directions,
small transfers, hand-off, device to device) and compare it, in the same run,
with the raw driver, PyTorch and CuPy where they are installed.

The report goes to stdout; bench.md, bench.json and bench.png go to --out
(default ./{DEFAULT_OUT}; --no-files writes nothing). Progress goes to stderr.
On the emulated device the figures model a device and the GPU targets read
"n/a (emulated)".

groups: {textwrap.fill(", ".join(GROUPS), 72, subsequent_indent="  ")}"""


def _groups(text: str) -> str:
    selected = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in selected if g not in GROUPS]
    if not selected or unknown:
        shown = ", ".join(unknown) if unknown else "none"
        raise argparse.ArgumentTypeError(f"unknown group(s): {shown}; choose from {', '.join(GROUPS)}")
    return ",".join(selected)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 3600 seconds, not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench subcommand's options."""
    parser.add_argument("--quick", action="store_true", help="a short run (minutes): fewer sizes, steps and repeats")
    parser.add_argument("--groups", type=_groups, default=",".join(GROUPS), metavar="G1,G2",
                        help="comma-separated groups to run (default: all)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                       help=f"folder for bench.md, bench.json, bench.png (default: ./{DEFAULT_OUT}, created)")
    where.add_argument("--no-files", action="store_true", help="print the report only; write no file")
    parser.add_argument("--seconds", type=_seconds, default=None, metavar="S",
                        help="timing budget per case in seconds, more than 0 (default 0.4, 0.05 with --quick)")


def prepare_output(args: argparse.Namespace) -> str | None:
    """Say where the report goes and make sure it can go there, before anything is
    measured; returns what is wrong with ``--out`` (a usage mistake), if anything."""
    if args.no_files:
        print("bench: report to stdout only (--no-files)", file=sys.stderr)
        return None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {args.out}: exists and is not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {args.out}: cannot create it ({exc.strerror})"
    print(f"bench: writing bench.md, bench.json, bench.png to {out.resolve()}", file=sys.stderr)
    return None


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class _Lines:
    """Progress without rich, or when stderr is not a terminal: one line per case."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()

    def __call__(self, label: str) -> None:
        elapsed = time.perf_counter() - self.start
        left = f"about {_clock(elapsed / self.done * (self.total - self.done))} left" if self.done else "estimating"
        width = len(str(self.total))
        print(f"[{self.done + 1:{width}d}/{self.total}] {label}  ({_clock(elapsed)} elapsed, {left})",
              file=sys.stderr, flush=True)
        self.done += 1

    def settle(self, done: int) -> None:
        self.done = done


class _Bar:
    """A rich progress bar: cases done out of the total, elapsed, time left."""

    def __init__(self, bar: Any, task: Any) -> None:
        self.bar, self.task, self.started = bar, task, 0

    def __call__(self, label: str) -> None:
        self.bar.update(self.task, completed=self.started, description=label)
        self.started += 1

    def settle(self, done: int) -> None:
        self.started = done
        self.bar.update(self.task, completed=done)


@contextmanager
def _progress(total: int) -> Iterator[_Lines | _Bar]:
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        yield _Lines(total)
        return
    console = Console(stderr=True)
    if not console.is_terminal:
        yield _Lines(total)
        return
    with Progress(
        BarColumn(), MofNCompleteColumn(), TextColumn("cases"), TimeElapsedColumn(), TextColumn("elapsed,"),
        TimeRemainingColumn(), TextColumn("left"), TextColumn("{task.description}"),
        console=console, transient=False,
    ) as bar:
        yield _Bar(bar, bar.add_task("starting", total=total))


def run(rt: Any, args: argparse.Namespace, prog: str = "python -m ferry") -> int:
    """Run the selected groups on ``rt`` and write the report.

    Ctrl-C stops the run within a second (see ``_interrupt``): ``KeyboardInterrupt`` is raised and
    no report is printed or written, not even in part."""
    with _interrupt.guarded(prog):
        return _run(rt, args)


def _run(rt: Any, args: argparse.Namespace) -> int:
    selected = _groups(args.groups).split(",")
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 0.4)
    peers, missing = load_peers(rt)
    _interrupt.check()
    budget = Budget(seconds=seconds, min_reps=3 if args.quick else 5)
    meta = metadata(rt, peers, missing, args)
    ctx = Context(rt, peers, budget, args.quick, lambda label: None)
    counts = [case_count(name, ctx) for name in selected]
    speed_before = host_speed()
    with _progress(sum(counts)) as progress:

        def step(label: str) -> None:  # a safe point before each case
            _interrupt.check()
            progress(label)

        ctx.progress = step
        done = 0
        for name, count in zip(selected, counts, strict=True):
            try:
                GROUPS[name](ctx)
            except Exception as exc:
                if _interrupt.interrupted():
                    raise KeyboardInterrupt from exc  # a clean-up failed after Ctrl-C: stop, record nothing
                ctx.results.append(Result(name, "ferry", "-", "-", 0, valid=False, note=f"group failed: {exc!r}"))
            _interrupt.check()
            done += count
            progress.settle(done)
    speed_after = host_speed()
    meta["host_speed"] = (
        f"a Python loop ran at {speed_before:.1f} M iterations/s before the groups, {speed_after:.1f} after"
    )
    drift = host_drift(speed_before, speed_after)
    if drift is not None:
        meta["host_warning"] = drift
    checks = compute_checks(ctx.results)
    report = markdown(meta, ctx.results, checks)
    _interrupt.check()
    if args.no_files:
        with _interrupt.publishing():
            _say_drift(drift)
            sys.stdout.write(report + "\n")
            sys.stdout.flush()
    else:
        _publish(Path(args.out), report, meta, ctx.results, checks, drift)
    invalid = [r for r in ctx.results if r.valid is False]
    if invalid:
        print(f"{len(invalid)} case(s) failed validation", file=sys.stderr)
        return 1
    return 0


def _say_drift(drift: str | None) -> None:
    if drift is not None:
        print(f"warning: {drift}", file=sys.stderr)


def _publish(out: Path, report: str, meta: dict[str, Any], results: list[Result], checks: Any,
             drift: str | None) -> None:
    """Write the files under temporary names, then print the report and rename them into place in one
    step: an interrupt leaves either the whole report or none of it (and no temporary file)."""
    out.mkdir(parents=True, exist_ok=True)
    names = [out / "bench.md", out / "bench.json", out / "bench.png"]
    md, js, png = (_interrupt.temporary(p) for p in names)
    try:
        md.write_text(report)
        write_json(js, meta, results, checks)
        why_not = plot(png, meta, results)
        with _interrupt.publishing():
            _say_drift(drift)
            sys.stdout.write(report + "\n")
            sys.stdout.flush()
            written = names if why_not is None else names[:2]
            for final in written:
                os.replace(_interrupt.temporary(final), final)
            if why_not is not None:
                with contextlib.suppress(FileNotFoundError):  # an old plot would not match this report
                    names[2].unlink()
    finally:
        _interrupt.discard_temporary()
    print(f"written: {', '.join(str(p) for p in written)}", file=sys.stderr)
    if why_not is not None:
        print(f"no plot: {why_not}", file=sys.stderr)
