"""ferry's own cost per small transfer, without a GPU: the bench's cases against a stand-in driver.

    PYTHONPATH=src python3 benchmarks/probe_overhead.py [--native 0|1] [--rounds N]

Builds ``benchmarks/fake_cuda.c`` into a temporary folder (gcc) and runs itself again with
``LD_LIBRARY_PATH`` pointing there, so ``cuda.bindings`` and ferry's compiled path load the stand-in
``libcuda.so.1``: every driver call returns at once, copies are a memcpy inside the call. What is
left in each timing is Python and wrapper cost: ferry's against the raw ``cuda.bindings`` loop the
bench compares with. On a GPU the device's own time (the same for both) is added to each side.

Timings are per call, CPU time of this thread (``time.thread_time``), the minimum over rounds, so
other processes on a busy machine disturb them little. The cases are the bench's own (``latency``,
``transfer`` pageable 16 B - 64 KiB, ``many_small``). At 64 KiB the stand-in's copy is a memcpy of
the payload, which ferry's pageable route pays twice (into its slot, then the "DMA") and the raw
pageable copy once: read those rows for their Python part only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def build() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fake-cuda-"))
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"),
                    str(HERE / "fake_cuda.c"), "-ldl"], check=True)
    return folder


def per_call(op: Callable[[], Any], calls: int, rounds: int) -> float:
    for _ in range(max(1, calls // 10)):
        op()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            op()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--native", choices=["0", "1"], default="1", help="FERRY_NATIVE (0: the bindings path)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if os.environ.get("FAKE_CUDA_READY") != "1":
        folder = build()
        env = dict(os.environ, LD_LIBRARY_PATH=str(folder), FAKE_CUDA_READY="1", FERRY_NATIVE=args.native)
        sys.exit(subprocess.call([sys.executable, __file__, *sys.argv[1:]], env=env))

    import gc

    import numpy as np

    import ferry
    from ferry._bench._groups import ferry_many_small, ferry_pageable, ferry_pinned, raw_many_small
    from ferry._bench._peers import RawDriver
    from ferry._bench._protocol import payload

    gc.disable()
    rt = ferry.Runtime("cuda")
    print(f"# {rt.info()['name']}; ferry fast path: {rt.info()['fast_path']}")
    raw = RawDriver(rt)
    rows: list[tuple[str, float, float]] = []

    def compare(name: str, ferry_case: Any, raw_case: Any, calls: int, unit: float = 1e6) -> None:
        for case in (ferry_case, raw_case):
            assert case.check(), f"{name}: {case.impl} moved the wrong bytes"
        f = per_call(ferry_case.op, calls, args.rounds)
        r = per_call(raw_case.op, calls, args.rounds)
        rows.append((name, f * unit, r * unit))
        for case in (ferry_case, raw_case):
            if case.close is not None:
                case.close()

    for d in ("h2d", "d2h"):
        data = payload(16, 23)
        compare(f"latency 16 B {d} (us)", ferry_pinned(rt, d, data), raw.case(d, "pinned", data), 20000)
    for n in (16, 4096, 65536):
        for d in ("h2d", "d2h"):
            data = payload(n, n)
            compare(f"pageable {n} B {d} (us)", ferry_pageable(rt, d, data), raw.case(d, "pageable", data), 10000)
    data = payload(1000 * 4096, 29).reshape(1000, 4096)
    each, batch = ferry_many_small(rt, data)
    raw_each, raw_shared = raw_many_small(raw, data)
    compare("1000 x 4 KiB, event each (ms)", each, raw_each, 20, 1e3)
    compare("1000 x 4 KiB, rt.batch() vs raw event each (ms)", batch, raw_each, 20, 1e3)
    compare("1000 x 4 KiB, rt.batch() vs raw one event (ms)", ferry_many_small(rt, data)[1], raw_shared, 20, 1e3)
    print(f"{'case':50s} {'ferry':>9s} {'raw':>9s} {'ferry - raw':>12s} {'ratio':>7s}")
    for name, f, r in rows:
        print(f"{name:50s} {f:9.3f} {r:9.3f} {f - r:12.3f} {f / r:7.2f}")
    raw.release()
    rt.close()
    del np


if __name__ == "__main__":
    main()
