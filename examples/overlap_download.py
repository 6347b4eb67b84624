"""Overlap a download with host work: submit it, work on the host, then wait.

    python examples/overlap_download.py [--mib 64] [--backend auto]

``rt.download`` returns at once with a pending handle; the copy runs while the host computes
(here: statistics of the previous result, in NumPy), and ``wait()`` hands back the filled array.
It times the copy alone, the work alone and both overlapped, and prints how much of the shorter of
the two the overlap hid. On a GPU the DMA engine copies while the CPU is free for the work; on the
emulated device the copy is made by the same CPU, so less is hidden there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ferry


def host_work(previous: np.ndarray, rounds: int) -> float:
    """Something a program does on the host meanwhile: statistics of the previous result."""
    total = 0.0
    for _ in range(rounds):
        total += float(np.std(previous[: previous.size // 4]))
    return total


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "emulated"])
    args = parser.parse_args(argv)
    data = np.random.default_rng(0).standard_normal((args.mib << 20) // 4, dtype=np.float32)
    with ferry.Runtime(args.backend) as rt:
        device = rt.to_device(data)  # say, a model's output on the GPU
        out = np.empty_like(data)  # reused for every download: no fresh pages to fault in
        previous = data.copy()

        def download() -> np.ndarray:
            _, host = rt.download(device, out).wait()
            return host

        download()  # warm: the pinned staging slots, the lanes
        t_copy, _ = timed(download)
        t_one, _ = timed(lambda: host_work(previous, 1))
        rounds = max(1, round(t_copy / max(t_one, 1e-9)))  # about as long as the copy
        t_work, _ = timed(lambda: host_work(previous, rounds))

        def overlapped() -> np.ndarray:
            pending = rt.download(device, out)  # returns at once; the copy runs meanwhile
            host_work(previous, rounds)
            _, host = pending.wait()  # the bytes are there once wait() returns
            return host

        t_both, host = timed(overlapped)
        assert np.array_equal(host, data), "the download did not arrive intact"
        saved = t_copy + t_work - t_both
        hidden = min(1.0, max(0.0, saved / min(t_copy, t_work)))
        print(f"download of {args.mib} MiB on the {rt.backend} device: copy alone {t_copy * 1e3:.1f} ms, "
              f"host work alone {t_work * 1e3:.1f} ms, overlapped {t_both * 1e3:.1f} ms "
              f"(serial would be {(t_copy + t_work) * 1e3:.1f} ms): {hidden:.0%} of the shorter one hidden")
    return {"copy": t_copy, "work": t_work, "overlapped": t_both, "hidden": hidden}


if __name__ == "__main__":
    main()
