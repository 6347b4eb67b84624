"""CPU used by the completion watcher while 100 transfers are pending for a second.

    PYTHONPATH=src python3 benchmarks/probe_watcher_cpu.py [--backend cuda|emulated]
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ferry
from ferry import testing


def main() -> None:
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "auto"
    with ferry.Runtime(backend) as rt:
        dev = rt.empty(1 << 20, np.uint8)
        with testing.hold(rt, "download"):
            handles = [rt.download_pending(dev, rt.pinned(1 << 20)) for _ in range(100)]
            futures = [h.future() for h in handles]
            time.sleep(0.2)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            time.sleep(1.0)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            pending = sum(not f.done() for f in futures)
        ferry.wait_all(handles)
        print(f"{rt.backend}: {pending} transfers pending for {wall:.2f} s used {cpu * 1e3:.1f} ms of CPU "
              f"({cpu / wall * 100:.2f} % of one core)")


if __name__ == "__main__":
    main()
