"""What one host-side call of the pipeline costs the calling thread, each measured alone.

    PYTHONPATH=src python3 benchmarks/probe_pipeline_host_costs.py [--mib 8] [--reps 200]

Needs a GPU and PyTorch. Each row: median wall time and median thread CPU time of the call,
over ``--reps`` calls, with the device idle and every earlier transfer complete (so a wait row is
the cost of settling a finished transfer, not of waiting). Wall well above CPU means the thread
slept or waited (a lock, the GIL, a driver call that blocks).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ferry

PROFILE = 0


def timed(label: str, setup: Callable[[], Any], call: Callable[[Any], Any], after: Callable[[Any], None],
          reps: int) -> None:
    if PROFILE and label.startswith("ferry"):
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        for _ in range(reps):
            arg = setup()
            out = profiler.runcall(call, arg)
            after(out)
        print(f"## cProfile of {label}, {reps} calls: per call, own time and with callees (us)")
        rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
        for (path, line, name), (_cc, calls, own, cum, _callers) in rows[:PROFILE]:
            where = f"{path.rsplit('/', 1)[-1]}:{line}({name})"
            print(f"  {own / reps * 1e6:8.1f} {cum / reps * 1e6:8.1f}  x{calls / reps:<4g} {where}")
        return
    walls, cpus = [], []
    for _ in range(reps):
        arg = setup()
        w0, c0 = time.perf_counter(), time.thread_time()
        out = call(arg)
        c1, w1 = time.thread_time(), time.perf_counter()
        after(out)
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
    print(f"{label:58} wall {statistics.median(walls) * 1e6:8.1f} us   cpu {statistics.median(cpus) * 1e6:8.1f} us"
          f"   (min wall {min(walls) * 1e6:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile each ferry call (cProfile, the N costliest functions by own time)")
    args = parser.parse_args()
    global PROFILE
    try:
        import torch
    except ImportError:
        torch = None
    rt = ferry.Runtime("cuda")
    print(f"# {args.mib} MiB, {args.reps} reps; {rt.info().get('staging_engine')} engine, fast path "
          f"{rt.info().get('fast_path')}")
    for PROFILE in [0, args.profile] if args.profile else [0]:  # noqa: B007
        measure(rt, torch, args.mib << 20, args.reps)
    rt.close()


def measure(rt: Any, torch: Any, n: int, reps: int) -> None:
    """Every row once (or under cProfile, with PROFILE set)."""
    host = np.ones(n // 4, np.float32)
    out = np.empty(n // 4, np.float32)
    mib = n >> 20

    def nothing(_x: Any) -> None:
        return None

    with contextlib.ExitStack() as stack:
        stack.enter_context(rt.register(out))
        if torch is not None:
            t = torch.ones(n // 4, device="cuda")
            side = torch.cuda.Stream()
            timed("torch: t.__cuda_array_interface__", lambda: t, lambda x: x.__cuda_array_interface__, nothing, reps)
            timed("torch: t.__dlpack__(stream=side)", lambda: t, lambda x: x.__dlpack__(stream=side.cuda_stream),
                  nothing, reps)
            timed("torch: t.__dlpack__()", lambda: t, lambda x: x.__dlpack__(), nothing, reps)
            torch.cuda.synchronize()
            timed("ferry: rt.download(torch tensor, registered out) submit", lambda: t,
                  lambda x: rt.download(x, out), lambda h: h.wait(), reps)
        dev = rt.to_device(host)
        timed("ferry: rt.download(ferry array, registered out) submit", lambda: dev,
              lambda x: rt.download(x, out), lambda h: h.wait(), reps)
        loose = np.empty(n // 4, np.float32)
        timed("ferry: rt.download(ferry array, pageable out) submit + wait", lambda: dev,
              lambda x: rt.download(x, loose).wait(), nothing, reps // 2)
        timed("ferry: wait of a finished download (registered)",
              lambda: _finished(rt.download(dev, out)), lambda h: h.wait(), nothing, reps)
        dev.close()
        timed(f"ferry: rt.upload({mib} MiB pageable) submit, fresh output", lambda: host,
              rt.upload, lambda h: h.wait()[1].close(), reps)
        ring = [rt.empty(n // 4, np.float32)]

        def into_ring(handle: Any) -> None:
            ring[0] = handle.wait()[1]

        timed(f"ferry: rt.upload({mib} MiB pageable, ring output) submit", lambda: ring[0],
              lambda d: rt.upload(host, d), into_ring, reps // 2)
        timed(f"ferry: rt.upload({mib} MiB pageable, ring output) submit + wait", lambda: ring[0],
              lambda d: into_ring(rt.upload(host, d)), nothing, reps // 2)
        pinned = rt.pinned(n)
        target = pinned.as_array()
        timed(f"host: memmove {mib} MiB pageable -> pinned", lambda: None,
              lambda _x: ctypes.memmove(target.ctypes.data, host.ctypes.data, n), nothing, reps // 2)
        pinned.close()
        timed("ferry: rt.empty (pool)", lambda: None, lambda _x: rt.empty(n // 4, np.float32),
              lambda d: d.close(), reps)
        if torch is not None:
            consumer = torch.cuda.current_stream()
            timed("ferry: hand_off(torch stream) of a finished staged upload",
                  lambda: _finished(rt.upload(host)), lambda h: h.hand_off(consumer),
                  lambda d: (torch.cuda.synchronize(), d.close()), reps)
            timed("ferry: torch.from_dlpack(ferry array)", lambda: rt.empty(n // 4, np.float32),
                  torch.from_dlpack, nothing, reps)
        timed("ferry: wait of a finished staged upload", lambda: _finished(rt.upload(host)),
              lambda h: h.wait(), lambda r: r[1].close(), reps)


def _finished(handle: Any) -> Any:
    """``handle`` once its copy completed, without asking the handle (``is_ready()`` would mark its
    record done, and a hand-off of a done record skips what a pipeline's hand-off does): a staged
    job is waited for through the engine, anything else by sleeping past its completion."""
    extra = handle._record.extra
    job = getattr(extra, "job", None)
    if job is not None:
        job.wait_done()
    else:
        time.sleep(0.002)
    return handle


if __name__ == "__main__":
    main()
