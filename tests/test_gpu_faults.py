"""On a GPU: a producer kernel that faults makes the next transfer fail cleanly.

Run in a subprocess: an illegal-address fault is a sticky error that ends the
CUDA context of the process. CuPy launches the faulting kernel on its stream
and ferry's download of the kernel's array is ordered after it on the device
(CUDA Array Interface v3), so the fault reaches the transfer's event. The test
is skipped only where no GPU is usable or CuPy (the kernel launcher) is
missing.

History: a first version held ferry's stream with a ``cuStreamWaitValue32``
gate while the producer faulted; on the H200 (2026-11-29) that child hung. This
version (no gate; ordered through the producer's stream) passes on H200s
(2026-11-29); a hang would show the child's output so far in the failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = r"""
import numpy as np, cupy, ferry

rt = ferry.Runtime("cuda")
buf = rt.pinned(1 << 20)
buf.as_array()[:] = 0xA5
spare = rt.pinned(64)
dev = rt.to_device(np.arange(1 << 20, dtype=np.uint8))
kernel = cupy.RawKernel(r'''
extern "C" __global__ void spin_then_fault(int* p, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    p[threadIdx.x] = 1;                       // address 8: illegal
}
''', "spin_then_fault")
producer = cupy.cuda.Stream(non_blocking=True)
with producer:
    source = cupy.empty(1 << 20, cupy.uint8)
    kernel((1,), (32,), (cupy.uint64(8), cupy.int64(100_000_000)))   # ~50 ms, then the fault
    pending = rt.download_pending(source, buf)   # ordered after the producer: CAI v3 names its stream
print("submitted", flush=True)
try:
    pending.wait()
    print("wait returned", flush=True)
except ferry.TransferFailedError as exc:
    print("wait raised TransferFailedError", flush=True)
print("buffer state:", buf.state, flush=True)
for name, call in (
    ("submit", lambda: rt.download_pending(dev, spare)),
    ("empty", lambda: rt.empty(16)),
    ("pinned", lambda: rt.pinned(16)),
):
    try:
        call()
        print(name, "succeeded", flush=True)
    except ferry.FerryError as exc:
        print(name, "raised", type(exc).__name__, "sticky" in str(exc), flush=True)
rt.close()
print("closed", flush=True)
"""


@pytest.mark.cuda
def test_a_faulting_producer_fails_the_next_transfer_and_every_call_after() -> None:
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
    assert lines[0] == "submitted"
    assert "wait raised TransferFailedError" in lines  # nothing published
    assert "buffer state: abandoned" in lines
    assert "submit raised RuntimeClosedError True" in lines  # a clear error (a TransferSubmitError too), not a hang
    assert "empty raised RuntimeClosedError True" in lines
    assert lines[-1] == "closed"
