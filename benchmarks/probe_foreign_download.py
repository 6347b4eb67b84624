"""Host cost of ``rt.download`` from a PyTorch tensor (a foreign array, through DLPack) against a
ferry ``DeviceArray``, split into the submitting call and ``wait()``; then the costliest functions
of 2,000 small downloads from a tensor under cProfile. Needs a GPU and PyTorch.

    PYTHONPATH=src python3 benchmarks/probe_foreign_download.py [--profile 30]

A PyTorch tensor is submitted two ways, in turns: ferry's own ordering (``__dlpack__(stream=-1)``
and an event on PyTorch's current stream) and PyTorch's (``__dlpack__(stream=<ferry's stream>)``,
ferry's getter of PyTorch's stream switched off).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

import ferry
from ferry._interop import _foreign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=int, default=30, metavar="N")
    args = parser.parse_args()
    with ferry.Runtime("cuda") as rt:
        for nbytes in (4, 8 << 20):
            n = nbytes // 4
            tensor = torch.arange(n, device="cuda", dtype=torch.float32)
            dev = rt.to_device(tensor.cpu().numpy())
            out = np.empty(n, np.float32)
            registration = rt.register(out) if nbytes > 4 else None  # 8 MiB: the direct route
            fast = _foreign.torch_stream
            cases = (("torch, ferry orders", tensor, fast), ("torch, torch orders", tensor, lambda obj, index: None),
                     ("ferry", dev, fast))
            submit: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            wait: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            try:
                for i in range(300):  # the cases in turns: a host that changes speed affects all alike
                    for label, source, getter in cases:
                        _foreign.torch_stream = getter  # type: ignore[assignment]
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        pending = rt.download(source, out)
                        t1 = time.perf_counter()
                        pending.wait()
                        t2 = time.perf_counter()
                        if i >= 20:
                            submit[label].append(t1 - t0)
                            wait[label].append(t2 - t1)
                        if i == 299 and not np.array_equal(out, tensor.cpu().numpy()):
                            raise SystemExit(f"{label}: wrong bytes")
            finally:
                _foreign.torch_stream = fast
            for label, _, _ in cases:
                print(f"{nbytes:>9} B from a {label} array: submit {statistics.median(submit[label]) * 1e6:6.1f} us, "
                      f"wait {statistics.median(wait[label]) * 1e6:6.1f} us (medians of 280)")
            if registration is not None:
                registration.release()
        if args.profile:
            tensor = torch.zeros(1, device="cuda")
            out = np.empty(1, np.float32)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(2000):
                rt.download(tensor, out).wait()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
