"""How late a ferry wait returns after a download queued behind device work, against PyTorch's
spinning ``event.synchronize()``, on a GPU with PyTorch.

    PYTHONPATH=src python3 benchmarks/probe_wake_latency.py [--ms 0,0.5,1,2,5,20] [--trials 30]
        [--cases small,direct,staged] [--nap-off]

Each trial queues ``D`` ms of device work on PyTorch's current stream (``torch.cuda._sleep``,
calibrated), produces ``y`` after it, then

- ferry: ``rt.download(y, out).wait()`` (``small``: 4 bytes; ``direct``: 8 MiB into a registered
  array; ``staged``: 8 MiB into a pageable one, the staging engine's job);
- torch: ``out.copy_(y, non_blocking=True)`` into pinned memory, an event, ``event.synchronize()``
  (spins: PyTorch's default on a machine with more CPUs than GPUs).

The time from the launch of the device work to the wait's return is taken for both, trials
interleaved; the row gives ferry's median (and p90) excess over torch's, in microseconds. With
``--nap-off`` a second ferry row per case waits as before the nap (spin, then the watcher's wake).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

import ferry
from ferry import _completion


def calibrate() -> float:
    """GPU cycles of ``torch.cuda._sleep`` per millisecond."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / start.elapsed_time(end)


def launch(cycles: int, y: torch.Tensor) -> float:
    """Queue ``cycles`` of device sleep, then produce ``y`` after it; when the launch began."""
    t = time.perf_counter()
    if cycles:
        torch.cuda._sleep(cycles)
    y.add_(1.0)
    return t


def ferry_wait(rt: ferry.Runtime, cycles: int, y: torch.Tensor, out: np.ndarray[Any, Any]) -> float:
    t = launch(cycles, y)
    rt.download(y, out).wait()
    return time.perf_counter() - t


def torch_wait(cycles: int, y: torch.Tensor, pinned: torch.Tensor) -> float:
    t = launch(cycles, y)
    pinned.copy_(y, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="0,0.5,1,2,5,20")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--cases", default="small,direct,staged")
    parser.add_argument("--nap-off", action="store_true")
    args = parser.parse_args()
    per_ms = calibrate()
    sizes = {"small": 4, "direct": 8 << 20, "staged": 8 << 20}
    window = _completion.NAP_WINDOW
    print(f"# {torch.cuda.get_device_name()}: {per_ms:.0f} cycles/ms; {args.trials} trials; "
          f"ferry minus torch (spinning event.synchronize), us")
    print(f"{'case':16} {'D ms':>6} {'median':>8} {'p90':>8} {'max':>8}  (torch median us)")
    with ferry.Runtime("cuda") as rt:
        for case in [c for c in args.cases.split(",") if c]:
            n = sizes[case] // 4
            y = torch.zeros(n, device="cuda")
            pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
            out = np.empty(n, np.float32)
            registration = rt.register(out) if case == "direct" else None
            variants: list[tuple[str, float]] = [(case, window)]
            if args.nap_off:
                variants.append((f"{case} nap off", 0.0))
            for ms in [float(x) for x in args.ms.split(",") if x]:
                cycles = int(per_ms * ms)
                runs: dict[str, list[float]] = {label: [] for label, _ in variants}
                reference: list[float] = []
                for trial in range(args.trials + 2):
                    for label, nap_window in variants:
                        _completion.NAP_WINDOW = nap_window
                        torch.cuda.synchronize()
                        took = ferry_wait(rt, cycles, y, out)
                        if trial >= 2:
                            runs[label].append(took)
                    _completion.NAP_WINDOW = window
                    torch.cuda.synchronize()
                    took = torch_wait(cycles, y, pinned)
                    if trial >= 2:
                        reference.append(took)
                base = statistics.median(reference)
                for label, values in runs.items():
                    excess = sorted((v - base) * 1e6 for v in values)
                    print(f"{label:16} {ms:6g} {statistics.median(excess):8.1f} "
                          f"{excess[int(len(excess) * 0.9)]:8.1f} {excess[-1]:8.1f}  ({base * 1e6:.0f})")
            rt.download(y, out).wait()
            if not np.array_equal(out, y.cpu().numpy()):
                raise SystemExit(f"{case}: ferry's download does not hold y")
            if registration is not None:
                registration.release()


if __name__ == "__main__":
    main()
