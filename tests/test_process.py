"""Process-level guarantees: interpreter exit, fork, and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses or whole bench groups: the full run has them

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_python(code: str, backend: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["FERRY_BACKEND"] = backend
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_interpreter_exit_with_transfers_in_flight_is_clean(backend_name: str) -> None:
    result = run_python(
        """
        import numpy as np, ferry
        rt = ferry.Runtime()
        dev = rt.empty(32 << 20, np.uint8)
        keep = [rt.download_pending(dev, rt.pinned(32 << 20)) for _ in range(3)]
        rt.download_pending(dev, rt.pinned(32 << 20))          # dropped unwaited
        up = rt.upload_pending(rt.pinned(32 << 20), rt.empty(32 << 20, np.uint8))
        other = ferry.Runtime()                                   # a second runtime, also left open
        other.upload_pending(other.pinned(1 << 20), other.empty(1 << 20, np.uint8))
        print("submitted", rt.backend)
        """,
        backend_name,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"submitted {backend_name}"
    assert result.stderr == ""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_runtime_used_in_a_forked_child_raises_a_clear_error(backend_name: str) -> None:
    result = run_python(
        """
        import os, sys, numpy as np, ferry
        rt = ferry.Runtime()
        dev = rt.to_device(np.arange(1000))
        buf = rt.pinned(8000)
        pending = rt.download_pending(dev, buf)
        pid = os.fork()
        if pid == 0:
            codes = []
            for call in (lambda: rt.pinned(8), lambda: rt.empty(8), lambda: pending.wait(),
                         lambda: rt.download_pending(dev, rt.pinned(8))):
                try:
                    call()
                    codes.append("no error")
                except ferry.FerryError as exc:
                    codes.append("fork" in str(exc))
            del pending
            rt.close()  # only marks it closed: never touches the device
            os._exit(0 if codes == [True, True, True, True] else 3)
        _, status = os.waitpid(pid, 0)
        dev, buf = pending.wait()
        ok = (buf.as_array(np.int64) == np.arange(1000)).all()
        print(os.waitstatus_to_exitcode(status), ok)
        """,
        backend_name,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"]


def test_cli_info_names_the_backend(backend_name: str) -> None:
    env = dict(os.environ, PYTHONPATH=SRC, FERRY_BACKEND=backend_name)
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "info"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert f"ferry on the {backend_name} backend" in result.stdout
    assert "pinned_pool_bytes" in result.stdout


def test_cli_demo_runs_and_verifies(backend_name: str) -> None:
    env = dict(os.environ, PYTHONPATH=SRC, FERRY_BACKEND=backend_name)
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "demo", "--mib", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"on the {backend_name} backend" in result.stdout
    assert "BufferMovedError" in result.stdout
    assert "round trip bytes equal" in result.stdout and "MISMATCH" not in result.stdout


def test_cuda_backend_without_a_gpu_says_why(cuda_reason: str | None) -> None:
    if cuda_reason is None:
        pytest.skip("a GPU is usable here: the refusal cannot be observed")
    import ferry

    with pytest.raises(ferry.DeviceUnavailableError) as info:
        ferry.Runtime("cuda")
    assert str(info.value)
    assert ferry.Runtime("auto").backend == "emulated"


@pytest.mark.slow
def test_cli_bench_quick_writes_the_report(tmp_path: Path) -> None:
    import json

    env = dict(os.environ, PYTHONPATH=SRC, FERRY_BACKEND="emulated")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "bench", "--quick", "--seconds", "0.01",
         "--groups", "transfer,latency,handoff", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# ferry bench (emulated)" in result.stdout
    assert "Emulated device" in result.stdout and "## checks" in result.stdout
    doc = json.loads((out / "bench.json").read_text())
    assert doc["meta"]["backend"] == "emulated"
    groups = {r["group"] for r in doc["results"]}
    assert groups == {"transfer", "latency", "handoff"}
    assert all(r["valid"] for r in doc["results"] if r["group"] != "handoff" or r["samples"])
    assert all(len(r["samples"]) >= 3 for r in doc["results"] if r["group"] == "transfer")
    assert (out / "bench.md").read_text().startswith("# ferry bench")


def test_cli_bench_refuses_unknown_groups() -> None:
    env = dict(os.environ, PYTHONPATH=SRC, FERRY_BACKEND="emulated")
    result = subprocess.run(
        [sys.executable, "-m", "ferry", "bench", "--groups", "nonsense"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 2 and "unknown group" in result.stderr
