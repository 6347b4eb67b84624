"""A pytest plugin for ``gpu_memcheck.sh``: past ``MEMCHECK_DEADLINE`` (seconds since the epoch) every test
not yet started is skipped, so each process under the sanitizer still ends normally and writes its report.

A run cut by the deadline covers the tests that ran: the script prints how many were skipped for it.
"""

from __future__ import annotations

import os
import time

import pytest

REASON = "memcheck time budget spent (MEMCHECK_LIMIT)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = os.environ.get("MEMCHECK_DEADLINE")
    if deadline is not None and time.time() > float(deadline):
        pytest.skip(REASON)
