"""Where an 8 MiB pageable transfer spends its time, lane by lane, on a GPU.

    PYTHONPATH=src python3 benchmarks/probe_lanes.py [MiB]

Wraps the staging engine's steps with timestamps (relative to the call of
``rt.upload`` / ``rt.download``) and prints, per direction, the median over
repeats of: when each step began and ended on the earliest and the latest lane,
and when ``wait()`` returned.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np

import ferry
from ferry import _staging

MiB = 1 << 20
marks: list[tuple[str, str, float]] = []  # (thread, step, time)


def mark(step: str) -> None:
    marks.append((threading.current_thread().name, step, time.perf_counter()))


def wrap_function(module: Any, name: str) -> None:
    inner = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{name}<")
        try:
            return inner(*args, **kwargs)
        finally:
            mark(f"{name}>")

    setattr(module, name, wrapper)


def main() -> None:
    n = int(sys.argv[1]) * MiB if len(sys.argv) > 1 else 8 * MiB
    for name in ("copy_in", "copy_out"):
        wrap_function(_staging, name)
    for name in ("_upload", "_download", "_free"):
        wrap_function(_staging.Lane, name)
    wrap_function(_staging.StagedJob, "lane_finished")
    rt = ferry.Runtime(sys.argv[2] if len(sys.argv) > 2 else "cuda")
    data = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    out = np.empty_like(data)
    dev = rt.empty(n, np.uint8)
    for direction in ("upload", "download"):
        summary: dict[str, list[float]] = defaultdict(list)
        for rep in range(25):
            marks.clear()
            start = time.perf_counter()
            mark("call")
            pending = rt.upload(data, dev) if direction == "upload" else rt.download(dev, out)
            mark("submitted")
            pending.wait()
            mark("waited")
            if rep < 5:
                continue
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            for _, step, t in marks:
                first.setdefault(step, t - start)
                last[step] = t - start
            for step, value in first.items():
                summary[f"{step} first"].append(value)
                summary[f"{step} last"].append(last[step])
            summary["lanes"].append(len({th for th, _, _ in marks if th.startswith("ferry-")}))
        print(f"{direction} {n // MiB} MiB: median over 20 repeats (us from the call)")
        for key, values in sorted(summary.items(), key=lambda kv: statistics.median(kv[1])):
            scale = 1 if key == "lanes" else 1e6
            print(f"  {key:<24} {statistics.median(values) * scale:9.1f}")
    np.testing.assert_array_equal(out, data)
    rt.close()


if __name__ == "__main__":
    main()
