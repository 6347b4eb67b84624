"""The multi-threaded host copy: the ceiling of any staged route on this machine.

``threads`` threads (the staging engine's lane count) each copy their
1/threads share of a buffer with ``numpy.copyto`` (which releases the GIL),
``passes`` times in a row per round, so that the threads' staggered starts (a
GIL hand-over each) are spread over many copies. A round's time is from the
first thread's start to the last thread's end, divided by ``passes``; the
buffers are warm (every page touched before the first round).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any

import numpy as np

__all__: list[str] = []

PAGE = 4096


class CopyTeam:
    """Threads copying ``src`` into ``dst`` (both uint8, same size), each its own share."""

    def __init__(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], threads: int, passes: int) -> None:
        n = src.nbytes
        share = math.ceil(n / threads / PAGE) * PAGE
        self.parts = [(dst[i:i + share], src[i:i + share]) for i in range(0, n, share)]
        self.passes = passes
        self.stamps = [(0.0, 0.0)] * len(self.parts)
        self.go = threading.Barrier(len(self.parts) + 1, timeout=120)
        self.done = threading.Barrier(len(self.parts) + 1, timeout=120)
        self.stopping = False
        self.threads = [
            threading.Thread(target=self._work, args=(i,), name=f"ferry-bench-memcpy-{i}", daemon=True)
            for i in range(len(self.parts))
        ]
        for t in self.threads:
            t.start()

    @property
    def count(self) -> int:
        return len(self.parts)

    def _work(self, i: int) -> None:
        d, s = self.parts[i]
        clock = time.perf_counter
        while True:
            self.go.wait()
            if self.stopping:
                return
            start = clock()
            for _ in range(self.passes):
                np.copyto(d, s)
            self.stamps[i] = (start, clock())
            self.done.wait()

    def round(self) -> float:
        """One round; seconds per pass over the whole buffer."""
        self.go.wait()
        self.done.wait()
        return (max(e for _, e in self.stamps) - min(s for s, _ in self.stamps)) / self.passes

    def close(self) -> None:
        self.stopping = True
        with contextlib.suppress(threading.BrokenBarrierError):
            self.go.wait()
        for t in self.threads:
            t.join(timeout=10)


def passes_for(nbytes: int, seconds: float = 20e-3, guess_bps: float = 30e9) -> int:
    """Passes per round so that a round lasts about ``seconds`` at ``guess_bps``."""
    return max(1, round(seconds * guess_bps / nbytes))
