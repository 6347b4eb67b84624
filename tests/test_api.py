"""The public surface: names exported once, from one private module each; style gates."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ferry

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_is_defined_in_exactly_one_private_module() -> None:
    owners: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src" / "ferry").glob("_*.py")):
        if path.name in {"__init__.py", "__main__.py"}:
            continue
        module = importlib.import_module(f"ferry.{path.stem}")
        for name in getattr(module, "__all__", []):
            owners.setdefault(name, []).append(path.stem)
    duplicated = {name: mods for name, mods in owners.items() if len(mods) > 1}
    assert duplicated == {}
    assert sorted(ferry.__all__) == sorted(owners)
    assert len(ferry.__all__) == len(set(ferry.__all__))
    for name in ferry.__all__:
        assert getattr(ferry, name).__module__.startswith("ferry._")


def test_the_contract_names_exist() -> None:
    for name in ("Runtime", "PinnedHostBuffer", "DeviceArray", "PendingUpload", "PendingDownload",
                 "RuntimeStats", "FerryError", "TransferSubmitError", "TransferFailedError",
                 "BufferMovedError", "DeviceUnavailableError"):
        assert name in ferry.__all__
    for error in (ferry.TransferSubmitError, ferry.TransferFailedError, ferry.BufferMovedError,
                  ferry.DeviceUnavailableError):
        assert issubclass(error, ferry.FerryError)


def test_public_types_cannot_be_constructed_directly() -> None:
    with pytest.raises(TypeError):
        ferry.PinnedHostBuffer(None, None, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ferry.DeviceArray(None, 0, (1,), None, 1)  # type: ignore[arg-type]


@pytest.mark.lint
def test_ruff_is_clean() -> None:
    pytest.importorskip("ruff", reason="ruff is part of the test extra")
    ruff = shutil.which("ruff") or f"{sys.executable} -m ruff"
    result = subprocess.run(f"{ruff} check src tests benchmarks examples", shell=True, cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.lint
@pytest.mark.slow  # ~9 s without a mypy cache
def test_mypy_is_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is part of the test extra")
    result = subprocess.run([sys.executable, "-m", "mypy", "src"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
