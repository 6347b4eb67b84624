"""On a GPU: a producer kernel that faults makes the next transfer fail cleanly.

Run in a subprocess: an illegal-address fault is a sticky error that ends the
CUDA context of the process. CuPy launches the faulting kernel; the test is
skipped only where no GPU is usable or CuPy (the kernel launcher) is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import cuda_unavailable_reason

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = r"""
import numpy as np, cupy, ferry
from ferry import testing

rt = ferry.Runtime("cuda")
data = np.arange(1 << 20, dtype=np.uint8)
dev = rt.to_device(data)
buf = rt.pinned(data.nbytes)
buf.as_array()[:] = 0xA5
spare = rt.pinned(64)
kernel = cupy.RawKernel(r'''
extern "C" __global__ void fault(int* p) { p[threadIdx.x] = 1; }
''', "fault")
producer = cupy.cuda.Stream(non_blocking=True)
with testing.hold(rt, "download"):
    pending = rt.download_pending(dev, buf)       # queued behind the gate
    kernel((1,), (32,), (cupy.uint64(8),), stream=producer)   # writes to address 8: illegal
    try:
        producer.synchronize()                    # that stream only: ferry's is held by the gate
        print("kernel did not fault")
    except Exception as exc:
        print("producer fault:", type(exc).__name__)
try:
    pending.wait()
    print("wait returned")
except ferry.TransferFailedError as exc:
    print("wait raised TransferFailedError")
print("buffer state:", buf.state)
for name, call in (
    ("submit", lambda: rt.download_pending(dev, spare)),
    ("empty", lambda: rt.empty(16)),
    ("pinned", lambda: rt.pinned(16)),
):
    try:
        call()
        print(name, "succeeded")
    except ferry.FerryError as exc:
        print(name, "raised", type(exc).__name__, "sticky" in str(exc))
rt.close()
print("closed")
"""


@pytest.mark.xfail(
    strict=True,
    reason="on the H200 (2026-11-29) the child hung after the fault and was killed at the timeout; "
    "where it hangs is not yet known (the output so far is in the failure message)",
)
def test_a_faulting_producer_fails_the_next_transfer_and_every_call_after() -> None:
    reason = cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no usable GPU: {reason}")
    try:
        import cupy  # noqa: F401 - only to launch the faulting kernel
    except ImportError:
        pytest.skip("CuPy (the kernel launcher of this test) is not installed")
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1")
    try:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CHILD)], capture_output=True, text=True, timeout=30, env=env
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung after the fault; its output so far: {exc.stdout!r} {exc.stderr!r}")
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines[0].startswith("producer fault:")
    assert "wait raised TransferFailedError" in lines  # nothing published
    assert "buffer state: abandoned" in lines
    assert "submit raised TransferSubmitError True" in lines  # a clear error, not a hang
    assert "empty raised RuntimeClosedError True" in lines
    assert lines[-1] == "closed"
