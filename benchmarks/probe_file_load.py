"""Where a checkpoint load's host time goes: the per-load fixed cost and the per-chunk cost.

Writes two safetensors files shaped like the ``files`` bench's decoder: ``small`` (the same tensor
count, tiny tensors: what is timed is the load's fixed cost, thread start-up, streams, slots, allocations,
the final synchronization) and ``big`` (``--mib`` MiB: the per-chunk cost, the load's time less the same
file read by the bench's own ``preadv`` ceiling, divided by the chunk count). Best of ``--rounds``.

Run it on the emulated device at latency 0, or on the stand-in driver with copies skipped::

    PYTHONPATH=src python3 benchmarks/probe_file_load.py
    LD_LIBRARY_PATH=/tmp/fake FERRY_BACKEND=cuda FAKECUDA_NOCOPY=1 PYTHONPATH=src python3 benchmarks/probe_file_load.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ferry
from ferry._bench._files import Ceiling, decoder_shapes, write_checkpoint


def best(fn, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t0)
        del r
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    backend = os.environ.get("FERRY_BACKEND", "")
    kw = {} if backend == "cuda" else {"backend": "emulated"}
    rt = ferry.Runtime(**kw)
    if rt.backend == "emulated":
        rt._parts.backend.latency = 0.0  # what is timed is ferry's own host cost
        rt._parts.backend.bandwidth = 1e15
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    small = os.path.join(folder, "small.safetensors")
    big = os.path.join(folder, "big.safetensors")
    shapes = decoder_shapes(8, 16, 32, 64, 8)  # the quick bench's 8 layers: 98 tensors
    write_checkpoint(small, shapes)
    hidden = 1024
    layers = max(1, (args.mib << 20) // (2 * hidden * hidden * 6))
    nbytes = write_checkpoint(big, decoder_shapes(layers, hidden, 2 * hidden, 1024, 256))
    try:
        ferry.load_safetensors(small, runtime=rt)
        fixed = best(lambda: ferry.load_safetensors(small, runtime=rt), args.rounds)
        ferry.load_safetensors(big, runtime=rt)
        load = best(lambda: ferry.load_safetensors(big, runtime=rt), args.rounds)
        ceiling = Ceiling(rt)
        size = os.path.getsize(big)
        ceil = best(lambda: ceiling.run(big, 0, size), args.rounds)
        ceiling.close()
        chunks = -(-size // (16 << 20))
        print(f"backend {rt.backend}; small: {len(shapes)} tensors; big: {nbytes >> 20} MiB, ~{chunks} chunks")
        print(f"per-load fixed cost (small file):      {fixed * 1e3:8.3f} ms")
        print(f"big load:                              {load * 1e3:8.3f} ms")
        print(f"big, the preadv ceiling:               {ceil * 1e3:8.3f} ms")
        print(f"per chunk beyond the ceiling (less the fixed cost): "
              f"{(load - ceil - fixed) / chunks * 1e6:8.1f} us")
    finally:
        rt.close()
        for p in (small, big):
            os.unlink(p)
        os.rmdir(folder)


if __name__ == "__main__":
    main()
