"""Sweep the staging parameters on a GPU: lanes x slot size x slots per lane, and the
direct/staged crossover. Prints one line per configuration; the defaults in
ferry.StagingConfig were chosen from these figures on an H200.

    PYTHONPATH=src python3 benchmarks/tune_staging.py [--quick | --mid | --slots | --chunks]

``--chunks`` sweeps the smallest chunk at 1 - 8 MiB with the default lanes,
against the direct route (the question: does a smaller chunk let a download's
copies out start before its last DMA, and does 1 MiB gain from the lanes?).
``--mid`` sweeps how mid-size payloads (2-32 MiB) are cut (smallest chunk, so
how many lanes wake) against the direct route. ``--slots`` sweeps small slots
(which may keep a DMA'd chunk in the last-level cache until it is copied out)
at 256 MiB.
"""

from __future__ import annotations

import itertools
import statistics
import sys

import numpy as np

import ferry
from ferry._bench._protocol import Budget
from ferry._bench._protocol import measure as timed

MiB = 1 << 20


def gbps(fn, nbytes: int, reps: int) -> float:  # type: ignore[no-untyped-def]
    samples = timed(fn, Budget(seconds=0.0, min_reps=reps, max_reps=reps, warmup=1))
    return nbytes / statistics.median(samples) / 1e9


def measure(config: ferry.StagingConfig, sizes: list[int], reps: int) -> list[str]:
    with ferry.Runtime(staging=config) as rt:
        return [one_size(rt, n, reps) for n in sizes]


def one_size(rt: ferry.Runtime, n: int, reps: int) -> str:
    data = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
    out = np.empty_like(data)
    dev = rt.empty(n, np.uint8)
    up = gbps(lambda: rt.upload(data, dev).wait(), n, reps)
    down = gbps(lambda: rt.download(dev, out).wait(), n, reps)
    assert np.array_equal(out, data)
    return f"{n / MiB:>6.2f} MiB up {up:5.1f} down {down:5.1f}"


def mid() -> None:
    sizes = [2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB]
    print("min_chunk lanes | " + " | ".join(f"{s // MiB} MiB" for s in sizes))
    for min_chunk, n_lanes in itertools.product([256 << 10, 1 * MiB, 2 * MiB, 4 * MiB], [4, 8, 12]):
        config = ferry.StagingConfig(min_chunk_bytes=min_chunk, lanes=n_lanes, direct_bytes=0)
        print(f"{min_chunk >> 10:6d}K {n_lanes:5d} | " + " | ".join(measure(config, sizes, 15)), flush=True)
    direct = ferry.StagingConfig(direct_bytes=1 << 40)
    print("direct        | " + " | ".join(measure(direct, sizes, 15)), flush=True)


def chunks() -> None:
    sizes = [1 * MiB, 2 * MiB, 8 * MiB]
    configs = {"defaults": ferry.StagingConfig(), "direct": ferry.StagingConfig(direct_bytes=1 << 40)}
    for kib in (1024, 512, 256, 128):
        configs[f"staged, min chunk {kib} KiB"] = ferry.StagingConfig(min_chunk_bytes=kib << 10, direct_bytes=0)
    for _round in range(2):  # twice: a drift of the machine shows as a disagreement between rounds
        for name, config in configs.items():
            print(f"{name:26s} | " + " | ".join(measure(config, sizes, 25)), flush=True)
    # "defaults": the direct route up to StagingConfig.direct_bytes (4 MiB), staged in 1 MiB chunks above


def small_slots() -> None:
    print("lanes slot   depth | 256 MiB")
    for n_lanes, slot, d in itertools.product([8, 12, 16], [256 << 10, 512 << 10, 1 * MiB, 2 * MiB, 4 * MiB], [3, 6]):
        config = ferry.StagingConfig(
            slot_bytes=slot, slots_per_lane=d, lanes=n_lanes, direct_bytes=0, min_chunk_bytes=min(slot, 1 * MiB)
        )
        print(f"{n_lanes:5d} {slot >> 10:5d}K {d:5d} | " + " | ".join(measure(config, [256 * MiB], 7)), flush=True)


def main() -> None:
    if "--slots" in sys.argv:
        small_slots()
        return
    if "--chunks" in sys.argv:
        chunks()
        return
    if "--mid" in sys.argv:
        mid()
        return
    quick = "--quick" in sys.argv
    lanes = [8, 12, 16] if not quick else [12, 16]
    slots = [2 * MiB, 4 * MiB, 8 * MiB] if not quick else [4 * MiB]
    depth = [2, 3]
    sizes = [8 * MiB, 256 * MiB]
    print("lanes slot  depth | " + " | ".join(f"{s // MiB} MiB" for s in sizes))
    for n_lanes, slot, d in itertools.product(lanes, slots, depth):
        config = ferry.StagingConfig(
            slot_bytes=slot, slots_per_lane=d, lanes=n_lanes, direct_bytes=0
        )
        print(f"{n_lanes:5d} {slot // MiB:3d}M {d:5d} | " + " | ".join(measure(config, sizes, 5)), flush=True)
    if quick:
        return
    print("crossover: direct (one pooled block) vs staged (lanes)")
    routes = {
        "direct": ferry.StagingConfig(direct_bytes=1 << 40),
        "staged": ferry.StagingConfig(direct_bytes=0),
    }
    for n in [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]:
        cells = [f"{name}: {measure(config, [n], 50)[0]}" for name, config in routes.items()]
        print(f"{n >> 10:6d} KiB  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
