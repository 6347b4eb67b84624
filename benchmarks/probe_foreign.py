"""Host cost of ``rt.download`` from a PyTorch tensor (a foreign array, through DLPack) against a
ferry ``DeviceArray``, split into the submitting call and ``wait()``; then the costliest functions
of 2,000 small downloads from a tensor under cProfile. Needs a GPU and PyTorch.

    PYTHONPATH=src python3 benchmarks/probe_foreign.py [--profile 30]
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
            for label, source in (("torch", tensor), ("ferry", dev)):
                submit, wait = [], []
                for i in range(300):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    pending = rt.download(source, out)
                    t1 = time.perf_counter()
                    pending.wait()
                    t2 = time.perf_counter()
                    if i >= 20:
                        submit.append(t1 - t0)
                        wait.append(t2 - t1)
                if not np.array_equal(out, tensor.cpu().numpy()):
                    raise SystemExit(f"{label}: wrong bytes")
                print(f"{nbytes:>9} B from a {label} array: submit {statistics.median(submit) * 1e6:6.1f} us, "
                      f"wait {statistics.median(wait) * 1e6:6.1f} us (medians of 280)")
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
