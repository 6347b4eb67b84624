"""A runtime's lifetime: dropped unclosed, closed at exit, parts torn down in order."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import ferry
from ferry._runtime import parts_of


def _wait_until(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_runtime_dropped_unclosed_warns_and_its_parts_are_closed() -> None:
    rt = ferry.Runtime("emulated")
    data = np.arange(1 << 16, dtype=np.uint8)
    assert np.array_equal(rt.to_host(rt.to_device(data)), data)
    parts = parts_of(rt)
    with pytest.warns(ResourceWarning, match="never closed"):
        del rt
        gc.collect()
    assert _wait_until(lambda: parts.health.closed)
    assert parts.completion.live == set()


def test_five_dropped_runtimes_leave_no_threads_running() -> None:
    gc.collect()
    before = threading.active_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(5):
            rt = ferry.Runtime("emulated")
            rt.to_host(rt.to_device(np.arange(1 << 16, dtype=np.uint8)))
            del rt
            gc.collect()
    assert _wait_until(lambda: threading.active_count() <= before), threading.enumerate()


def test_a_closed_runtime_gives_no_warning_when_collected() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with ferry.Runtime("emulated") as rt:
            rt.to_device(np.arange(8))
        del rt
        gc.collect()


def test_an_unclosed_runtime_alive_at_exit_is_closed_quietly() -> None:
    code = (
        "import numpy as np, ferry\n"
        "rt = ferry.Runtime('emulated')\n"
        "p = rt.upload(np.arange(1 << 20, dtype=np.uint8))\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-W", "error::ResourceWarning", "-c", code],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert result.stderr == ""
