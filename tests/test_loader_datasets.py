"""Datasets for the loader's tests that spawn workers must import without the test suite's own imports.

(No test here: a spawned worker imports this module alone, so what it loads is what the loader loads.)
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class Modules:
    """One sample: the names of the modules loaded in the process that loads it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> Any:
        return ",".join(sorted(sys.modules))


def as_array(samples: list[str]) -> np.ndarray[Any, Any]:
    return np.frombuffer(samples[0].encode(), np.uint8).copy()
