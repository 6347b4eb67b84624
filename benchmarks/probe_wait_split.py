"""Where a transfer's host time goes, submit against wait, on the CUDA backend (a GPU, or the stand-in
driver of ``benchmarks/fake_cuda.c`` on any machine).

    PYTHONPATH=src python3 benchmarks/probe_wait_split.py
    # the stand-in driver, copies skipped (host costs only):
    gcc -O2 -shared -fPIC -o /tmp/fake/libcuda.so.1 benchmarks/fake_cuda.c -ldl
    LD_LIBRARY_PATH=/tmp/fake FAKECUDA_NOCOPY=1 PYTHONPATH=src python3 benchmarks/probe_wait_split.py

Rows (medians):

- ``pinned 16 B`` / ``small pageable 16 B``: ``rt.upload_pending`` of a pinned buffer and ``rt.upload``
  of a 16 B NumPy array (the small route), split into the submitting call and ``wait()``;
- ``staged 8 MiB``: ``rt.upload`` of an 8 MiB array through the staging engine, split into the
  runtime's Python before the engine's submit, the engine's submit, the Python after it, and the
  time from the job's end (its timeline) to ``wait()`` returning.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

import ferry
from ferry._runtime import parts_of


def split_small(rt: ferry.Runtime, n: int = 20000) -> None:
    a = np.arange(16, dtype=np.uint8)
    box: dict[str, Any] = {"d": rt.empty(16, np.uint8), "b": rt.pinned(16)}
    for name, submit in (
        ("pinned 16 B", lambda: rt.upload_pending(box["b"], box["d"])),
        ("small pageable 16 B", lambda: rt.upload(a, box["d"])),
    ):
        subs, waits = [], []
        for i in range(n):
            t0 = time.perf_counter()
            p = submit()
            t1 = time.perf_counter()
            r = p.wait()
            t2 = time.perf_counter()
            if r[0] is a:
                box["d"] = r[1]
            else:
                box["b"], box["d"] = r
            if i >= n // 10:
                subs.append(t1 - t0)
                waits.append(t2 - t1)
        sub, wait = statistics.median(subs) * 1e6, statistics.median(waits) * 1e6
        print(f"{name:22s} submit {sub:7.2f} us   wait {wait:7.2f} us")


def split_staged(rt: ferry.Runtime, mib: int = 8, n: int = 300) -> None:
    size = mib << 20
    a = np.ones(size, np.uint8)
    box: dict[str, Any] = {"d": rt.empty(size, np.uint8)}
    box["d"] = rt.upload(a, box["d"]).wait()[1]
    stamps: dict[str, Any] = {}
    engine = parts_of(rt).staged.engines.get("upload")
    inner = getattr(engine, "engine", None)
    if inner is None:
        print(f"staged {mib} MiB: the compiled engine does not run here (FERRY_NATIVE=0?)")
        return

    class Timed:  # the engine, its submit stamped
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def submit(self, *args: Any, **kwargs: Any) -> Any:
            stamps["s0"] = time.perf_counter()
            job = inner.submit(*args, **kwargs)
            stamps["s1"], stamps["job"] = time.perf_counter(), job
            return job

    engine.engine = Timed()
    rows: dict[str, list[float]] = {"before submit": [], "engine submit": [], "after submit": [], "end to wait": []}
    try:
        for i in range(n):
            t0 = time.perf_counter()
            p = rt.upload(a, box["d"])
            t1 = time.perf_counter()
            box["d"] = p.wait()[1]
            t2 = time.perf_counter()
            if i < n // 10:
                continue
            done = stamps["job"].timeline()["done"]
            rows["before submit"].append(stamps["s0"] - t0)
            rows["engine submit"].append(stamps["s1"] - stamps["s0"])
            rows["after submit"].append(t1 - stamps["s1"])
            rows["end to wait"].append(t2 - (stamps["s0"] + done * 1e-6))  # timeline: us after the submit
    finally:
        engine.engine = inner
    print(f"staged {mib} MiB upload: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in rows.items()))


def main() -> int:
    with ferry.Runtime("cuda") as rt:
        print(f"# {rt.info().get('name')}; {rt.info()['staging_threads']}")
        split_small(rt)
        split_staged(rt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
