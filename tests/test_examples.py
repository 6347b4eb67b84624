"""The examples in ``examples/`` run as a user runs them, on the emulated device, and do what they say.

Each short example does one common task with ferry's public API only (no ``ferry.testing`` hooks), so
the same script runs for real on a GPU. The PyTorch one skips here without PyTorch, and without it
says so in one line instead of failing.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHORT = ["train_with_prefetch.py", "state_dict_round_trip.py", "overlap_download.py"]
pytestmark = pytest.mark.slow
HAS_TORCH = importlib.util.find_spec("torch") is not None


def run(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    env.pop("FERRY_BACKEND", None)
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("name", SHORT)
def test_a_short_example_uses_only_the_public_api(name: str) -> None:
    tree = ast.parse((EXAMPLES / name).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {f"{node.module}.{alias.name}" if node.module else alias.name for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not [m for m in imported if m.startswith("ferry.") or m == "ferry._"], imported
    assert "testing" not in {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                             and isinstance(node.value, ast.Name) and node.value.id == "ferry"}


@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
def test_the_training_loop_learns() -> None:
    result = run(str(EXAMPLES / "train_with_prefetch.py"), "--backend", "emulated", "--steps", "120")
    assert result.returncode == 0, result.stderr
    found = re.search(r"120 steps on the emulated device, training on cpu: loss ([0-9.]+) .* -> ([0-9.]+)",
                      result.stdout)
    assert found is not None, result.stdout
    assert float(found.group(2)) < 0.5 * float(found.group(1)), result.stdout  # it learned from every batch


def test_the_training_loop_without_pytorch_says_so() -> None:
    code = ("import runpy, sys\nsys.modules['torch'] = None  # as if PyTorch were not installed\n"
            "sys.argv.pop(0)\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = run(str(EXAMPLES / "train_with_prefetch.py"), "--backend", "emulated", code=code)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "skipped: this example needs PyTorch (pip install torch)\n"
    assert result.stdout == ""


@pytest.mark.parametrize("torch_present", [
    pytest.param(False, id="numpy"),
    pytest.param(True, id="torch", marks=pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")),
])
def test_the_state_dict_goes_to_the_device_and_back(torch_present: bool) -> None:
    code = ("import runpy, sys\n" + ("" if torch_present else "sys.modules['torch'] = None\n")
            + "sys.argv.pop(0)\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = run(str(EXAMPLES / "state_dict_round_trip.py"), "--backend", "emulated", code=code)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\d+ tensors, [0-9.]+ MiB, on the emulated device: to it in [0-9.]+ ms, back in [0-9.]+ ms, "
                        r"every byte equal\n", result.stdout), result.stdout


def test_the_download_overlaps_host_work() -> None:
    result = run(str(EXAMPLES / "overlap_download.py"), "--backend", "emulated", "--mib", "8")
    assert result.returncode == 0, result.stderr
    found = re.fullmatch(r"download of 8 MiB on the emulated device: copy alone [0-9.]+ ms, "
                         r"host work alone [0-9.]+ ms, overlapped [0-9.]+ ms \(serial would be [0-9.]+ ms\): "
                         r"(\d+)% of the shorter one hidden\n",
                         result.stdout)
    assert found is not None, result.stdout
    assert 0 <= int(found.group(1)) <= 100
