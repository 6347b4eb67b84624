"""Sweep the compiled lanes' file jobs: lanes x slot size x slots per lane x read chunk, for a checkpoint load.

    PYTHONPATH=src python3 benchmarks/probe_file_lanes.py [--quick] [--reps 5] [--cold]

Writes the ``files`` bench's decoder checkpoint (8 layers, ~1.6 GB with ``--quick``, else 28 layers), reads
it once to warm the page cache, then for each configuration opens a runtime with that ``StagingConfig``
(and ``_file.FILE_CHUNK_BYTES``, the read chunk) and times ``ferry.load_safetensors`` (median of ``--reps``,
after one warm-up load, every load verified against the file's bytes once), beside the machine's warm
parallel ``pread`` ceiling (the bench's 12 threads into pinned 16 MiB buffers, no GPU) and the pure-Python
engine's reader threads, in the same run. ``--cold`` adds one cold load per configuration (the page cache
dropped first; needs root).
Prints one table; the default configuration (``StagingConfig()``, ``FILE_CHUNK_BYTES``) is marked ``*``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import ferry
from ferry._bench._files import Ceiling, Reference, can_drop_caches, checkpoint_shapes, drop_caches, write_checkpoint
from ferry._routes import _file

MiB = 1 << 20


def _median_gbps(fn: Any, nbytes: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--emulated", action="store_true", help="a toy checkpoint on the emulated device (a smoke test)")
    ap.add_argument("--lanes", type=int, nargs="*", default=[8, 12, 16])
    ap.add_argument("--slot-mib", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--slots", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--chunk-kib", type=int, nargs="*", default=[512, 1024, 2048, 4096, 16384])
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="ferry-probe-", dir=os.environ.get("FERRY_BENCH_DIR") or None)
    path = os.path.join(folder, "model.safetensors")
    payload = write_checkpoint(path, checkpoint_shapes(args.emulated, args.quick))
    size = os.path.getsize(path)
    ref = Reference(path)
    print(f"checkpoint: {payload / 1e9:.2f} GB payload, {size / 1e9:.2f} GB file, {os.cpu_count()} CPUs")
    default = ferry.StagingConfig()
    backend = "emulated" if args.emulated else "auto"
    try:
        with ferry.Runtime(backend) as rt:
            ceiling = Ceiling(rt)
            ceiling.run(path, 0, size)  # warm the page cache
            warm = _median_gbps(lambda: ceiling.run(path, 0, size), size, args.reps)
            ceiling.close()
        print(f"warm pread ceiling (12 threads x 16 MiB, no GPU): {warm:.1f} GB/s")
        chunk_default = _file.FILE_CHUNK_BYTES
        configs: list[tuple[str, ferry.StagingConfig, int]] = [
            ("python", ferry.StagingConfig(engine="python"), _file.SLOT_BYTES)]
        for lanes in args.lanes:
            for slot in args.slot_mib:
                for slots in args.slots:
                    for chunk in args.chunk_kib:
                        if chunk << 10 > slot * MiB:
                            continue
                        configs.append(("native", ferry.StagingConfig(engine="native", lanes=lanes,
                                                                      slot_bytes=slot * MiB, slots_per_lane=slots),
                                        chunk << 10))
        print(f"{'engine':8} {'lanes':>5} {'slot MiB':>8} {'slots':>5} {'chunk KiB':>9} {'warm GB/s':>9} "
              f"{'x ceiling':>9} {'cold GB/s':>9} ok")
        for engine, config, chunk in configs:
            _file.FILE_CHUNK_BYTES = chunk
            with ferry.Runtime(backend, staging=config) as rt:
                loaded = ferry.load_safetensors(path, runtime=rt)
                ok = all(ref.same(name, rt.to_host(value)) for name, value in loaded.items())
                del loaded
                gbps = _median_gbps(lambda: ferry.load_safetensors(path, runtime=rt), payload, args.reps)
                cold = ""
                if args.cold and can_drop_caches():
                    drop_caches()
                    cold = f"{_median_gbps(lambda: ferry.load_safetensors(path, runtime=rt), payload, 1):9.2f}"
                    ceiling_fill = Ceiling(rt)
                    ceiling_fill.run(path, 0, size)  # warm again for the next row
                    ceiling_fill.close()
            mark = "*" if engine == "native" and (config.lanes, config.slot_bytes, config.slots_per_lane, chunk) == (
                min(default.lanes, os.cpu_count() or 1), default.slot_bytes, default.slots_per_lane,
                chunk_default) else " "
            lanes = config.lanes if engine == "native" else "-"
            slot = config.slot_bytes // MiB if engine == "native" else _file.SLOT_BYTES // MiB
            slots = config.slots_per_lane if engine == "native" else _file.SLOTS_PER_READER
            print(f"{engine:8} {lanes!s:>5} {slot:>8} {slots:>5} {chunk >> 10:>9} {gbps:9.1f} {gbps / warm:9.2f} "
                  f"{cold:>9} {'yes' if ok else 'NO'}{mark}")
        _file.FILE_CHUNK_BYTES = chunk_default
    finally:
        os.unlink(path)
        os.rmdir(folder)


if __name__ == "__main__":
    main()
