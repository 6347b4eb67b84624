"""The measurement protocol: warm-up, repeats, median with min and max, validation.

Every case is timed with the host's wall clock (``time.perf_counter``) around
the whole operation, submit and wait included, as a user sees it. Before the
timed repeats each case runs once against a poisoned destination and its
result is compared with the random payload, outside the timed region; a case
that fails validation is reported as invalid, never as fast. Payloads are
random bytes, never zeros.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import _interrupt

__all__: list[str] = []

POISON = 0xA5


@dataclass
class Result:
    """One case: what was timed, every sample, and whether its bytes were right."""

    group: str
    impl: str  # ferry | raw | torch | cupy
    route: str  # pinned, pinned_wait, pageable, registered, fresh, ...
    direction: str  # h2d | d2h | both | host | -
    nbytes: int
    samples: list[float] = field(default_factory=list)
    valid: bool | None = None  # None: nothing to validate (host-only work)
    note: str = ""
    config: str = ""  # the group's configuration, where one group runs several (pipeline: "32 MiB, 8 ms")

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def gbps(self) -> float:
        """Median bandwidth in GB/s (10^9 bytes per second)."""
        m = self.median
        return self.nbytes / m / 1e9 if self.samples and m > 0 and self.nbytes else float("nan")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["median_s"] = self.median
        out["min_s"] = min(self.samples) if self.samples else None
        out["max_s"] = max(self.samples) if self.samples else None
        out["gbps"] = self.gbps
        return out


@dataclass
class Budget:
    """How long each case is timed, and the repeat bounds."""

    seconds: float = 0.4
    min_reps: int = 5
    max_reps: int = 3000
    warmup: int = 3


def measure(
    op: Callable[[], Any],
    budget: Budget,
    *,
    setup: Callable[[], Any] | None = None,
) -> list[float]:
    """Time ``op`` repeatedly; ``setup`` (untimed) runs before each repeat."""
    for _ in range(budget.warmup):
        _interrupt.check()
        if setup is not None:
            setup()
        op()
    samples: list[float] = []
    deadline = time.perf_counter() + budget.seconds
    clock = time.perf_counter
    while len(samples) < budget.max_reps and (len(samples) < budget.min_reps or clock() < deadline):
        _interrupt.check()  # a safe point: nothing of this case is in flight between repeats
        if setup is not None:
            setup()
        start = clock()
        op()
        samples.append(clock() - start)
    return samples


def measure_interleaved(
    ops: list[tuple[Callable[[], Any], Callable[[], Any] | None]], budget: Budget, rounds: int = 10
) -> list[list[float]]:
    """Time several ``(op, setup)`` pairs in turn: ``rounds`` rounds, each timing a block of every op
    with a ``rounds``-th of the budget, so that a host whose speed drifts during the measurement
    drifts under all of them alike (their ratio is what a check compares). One list of samples per op."""
    share = Budget(
        budget.seconds / rounds, max(1, budget.min_reps // rounds), max(1, budget.max_reps // rounds), budget.warmup
    )
    samples: list[list[float]] = [[] for _ in ops]
    for _ in range(rounds):
        for i, (op, setup) in enumerate(ops):
            samples[i].extend(measure(op, share, setup=setup))
    return samples


def spin(iterations: int) -> float:
    """The pure-Python loop: arithmetic on a float, no allocation to speak of (the ``gil`` group's
    workload, and the host's speed reference)."""
    x = 1.0
    for i in range(iterations):
        x = (x * 1.000001 + i) % 1000.0
    return x


HOST_DRIFT = 0.8
"""A run whose host reference loop ran slower than this fraction of its other measurement (or faster
than its inverse) says that the host's speed changed during the run."""


def host_speed(iterations: int = 100_000, rounds: int = 5) -> float:
    """Millions of :func:`spin` iterations per second on this thread, the best of ``rounds``.

    The bench measures it before its groups and after them: VM hosts change speed within minutes (on
    the H200 VMs a second heavy run in one lease measured ferry's Python-heavy rows 2 - 4x slower),
    and a ratio between rows timed minutes apart holds only if the host did not. Its figure also
    compares hosts across runs."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        spin(iterations)
        best = min(best, time.perf_counter() - start)
    return iterations / best / 1e6


def host_drift(before: float, after: float) -> str | None:
    """A warning when the host's reference loop changed speed by more than :data:`HOST_DRIFT` between
    the two measurements, else ``None``."""
    ratio = after / before
    if HOST_DRIFT <= ratio <= 1 / HOST_DRIFT:
        return None
    return (
        f"the host's speed changed during the run (a Python loop at {before:.1f} M iterations/s before the "
        f"groups, {after:.1f} after: {ratio:.2f}x); ratios between rows timed apart may not hold"
    )


def payload(nbytes: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Random bytes (not zeros), quickly."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**63, size=(nbytes + 7) // 8, dtype=np.int64)
    return words.view(np.uint8)[:nbytes].copy()


def poison(array: np.ndarray[Any, Any]) -> None:
    """Fill a host destination with a pattern no payload byte run matches by chance."""
    array.view(np.uint8).reshape(-1)[:] = POISON
