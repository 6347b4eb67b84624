"""``python -m ferry load FILE``: load a checkpoint onto the device with a progress bar, and say how fast."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import FerryError

__all__: list[str] = []

HELP = "load a checkpoint (.safetensors, an index .json, .npy) onto the device, with a progress bar"
DESCRIPTION = ("Load a safetensors file, a sharded checkpoint's *.safetensors.index.json, or a .npy file onto "
               "the device with ferry's file route, showing progress, then print the tensors, bytes, time and "
               "GB/s. Nothing is kept: the tensors are freed at the end.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The load subcommand's options."""
    parser.add_argument("files", nargs="+", metavar="FILE", help="a .safetensors file (or several shards), "
                        "a *.safetensors.index.json, or a .npy file")
    parser.add_argument("--direct", choices=("auto", "on", "off"), default="auto",
                        help="O_DIRECT reads: auto (the default: when the file is not cached), on, off")


@contextmanager
def _bar(total_hint: str) -> Iterator[Callable[[int, int], None]]:
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
    except ImportError:
        yield lambda done, total: None
        return
    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda done, total: None
        return
    with Progress(BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(total_hint, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def cmd_load(rt: Any, args: argparse.Namespace) -> int:
    """Load, report, free; a file ferry cannot load is one line on stderr and exit status 2."""
    from ._npy import load_npy
    from ._safetensors import load_safetensors

    direct = {"auto": None, "on": True, "off": False}[args.direct]
    files = [str(f) for f in args.files]
    start = time.perf_counter()
    try:
        with _bar(os.path.basename(files[0])) as progress:
            if len(files) == 1 and files[0].endswith(".npy"):
                arrays = {"array": load_npy(files[0], runtime=rt, direct=direct)}
            else:
                arrays = load_safetensors(files if len(files) > 1 else files[0], runtime=rt, progress=progress,
                                          direct=direct)
    except (FerryError, ImportError, MemoryError, TypeError, ValueError) as exc:  # a checkpoint too big for the
        # device is a MemoryError, a device's refusal a FerryError: one line each, as a malformed file's
        print(f"{getattr(args, 'load_prog', 'python -m ferry load')}: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    nbytes = sum(a.nbytes for a in arrays.values())
    rate = nbytes / seconds / 1e9 if seconds > 0 else float("nan")
    print(f"backend: {rt.backend} device {rt.device}")
    print(f"loaded {len(arrays)} tensor(s), {nbytes / (1 << 20):.1f} MiB in {seconds * 1e3:.1f} ms ({rate:.2f} GB/s)")
    for array in arrays.values():
        array.close()
    return 0
