"""Where a checkpoint load's host time goes: the per-load fixed cost and the per-chunk cost.

Two safetensors files shaped like the ``files`` bench's decoder (8 layers, 99 tensors): ``small`` (tiny
tensors: what is timed is the load's fixed cost: allocations, the plan, readers, slots, the final
synchronization) and ``big`` (``--gib`` GiB, sparse; its reads are skipped, so what is timed beyond the
small file's cost is ferry's own per-chunk work: the claim, the DMAs' and events' calls, the bookkeeping).
Per chunk = (big - small) / chunks, best of ``--rounds``. Run it on the emulated device (latency 0) or on
the stand-in driver with copies skipped::

    PYTHONPATH=src python3 benchmarks/probe_file_load.py
    LD_LIBRARY_PATH=/tmp/fake FERRY_BACKEND=cuda FAKECUDA_NOCOPY=1 PYTHONPATH=src python3 benchmarks/probe_file_load.py
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from typing import Any

import ferry
from ferry._bench._files import decoder_shapes, write_checkpoint
from ferry._routes import _file


def best(fn: Any, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t0)
        del r
    return min(out)


def sparse_checkpoint(path: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """A safetensors header for ``shapes`` (fp16) and a sparse data section; return the payload bytes."""
    header: dict[str, Any] = {}
    at = 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)
    return at


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    kw = {} if os.environ.get("FERRY_BACKEND", "") == "cuda" else {"backend": "emulated"}
    rt = ferry.Runtime(**kw)
    if rt.backend == "emulated":
        rt._parts.backend.latency = 0.0  # type: ignore[attr-defined]  # ferry's own host cost only
    folder = tempfile.mkdtemp()
    small = os.path.join(folder, "small.safetensors")
    big = os.path.join(folder, "big.safetensors")
    write_checkpoint(small, decoder_shapes(8, 16, 32, 64, 8))
    scale = max(1, int((args.gib * (1 << 30) / 1.6e9) ** 0.5 * 1536) // 64 * 64)
    shapes = decoder_shapes(8, scale, scale * 6, 151936 * scale // 1536 // 64 * 64, max(64, scale // 6))
    nbytes = sparse_checkpoint(big, shapes)
    real_fill = _file.fill_slot
    try:
        ferry.load_safetensors(small, runtime=rt)
        fixed = best(lambda: ferry.load_safetensors(small, runtime=rt), args.rounds)
        _file.fill_slot = lambda opened, direct, chunk, ptr: None  # type: ignore[assignment]  # reads skipped
        ferry.load_safetensors(big, runtime=rt)
        load = best(lambda: ferry.load_safetensors(big, runtime=rt), args.rounds)
        from ferry._files._common import Entry  # noqa: F401  (the plan's chunk count, as the load cuts it)

        pieces = [_file.Piece(0, nbytes, 0)]
        chunks = len(_file.plan_pieces(pieces).chunks)
        print(f"backend {rt.backend}; {len(shapes)} tensors; big: {nbytes / (1 << 30):.2f} GiB, {chunks} chunks "
              "(reads skipped)")
        print(f"per-load fixed cost (small file): {fixed * 1e3:8.3f} ms")
        print(f"big load, reads skipped:          {load * 1e3:8.3f} ms")
        print(f"per chunk:                        {(load - fixed) / chunks * 1e6:8.1f} us")
    finally:
        _file.fill_slot = real_fill  # type: ignore[assignment]
        rt.close()
        for p in (small, big):
            os.unlink(p)
        os.rmdir(folder)


if __name__ == "__main__":
    main()
