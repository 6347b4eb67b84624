"""Packaging: ``python -m build`` makes an sdist and a wheel named cuda-ferry, with
the Apache-2.0 licence and metadata, without a warning; the sdist can run the tests."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "site", "bench-out", "__pycache__", "*.egg-info", ".*_cache", ".hypothesis",
    "*.so",
)


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """Build from a copy of the tree (the build writes egg-info beside the sources)."""
    pytest.importorskip("build", reason="build is part of the test extra")
    base = tmp_path_factory.mktemp("packaging")
    tree = base / "tree"
    shutil.copytree(ROOT, tree, ignore=_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(base / "dist"), str(tree)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    (sdist,) = (base / "dist").glob("*.tar.gz")
    (wheel,) = (base / "dist").glob("*.whl")
    return sdist, wheel, log


def test_build_prints_no_warning(dists: tuple[Path, Path, str]) -> None:
    log = dists[2]
    warnings = [line for line in log.splitlines() if "warn" in line.lower()]
    assert warnings == [], "\n".join(warnings)


def test_the_distribution_is_cuda_ferry_under_apache_2(dists: tuple[Path, Path, str]) -> None:
    sdist, wheel, _ = dists
    assert sdist.name.startswith("cuda_ferry-") and wheel.name.startswith("cuda_ferry-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        license_text = zf.read(license_name).decode()
    assert meta["Name"] == "cuda-ferry"
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert meta["Author"]
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert license_text == (ROOT / "LICENSE").read_text()
    urls = dict(value.split(", ", 1) for value in meta.get_all("Project-URL") or [])
    assert {"Documentation", "Source", "Issues"} <= set(urls)
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # SPDX expression instead
    assert "ferry/__init__.py" in names and "ferry/py.typed" in names
    assert not [n for n in names if n.endswith(".c")]  # the extension's source is in the sdist only
    assert not [n for n in names if n.startswith("tests/")]


def test_the_sdist_carries_what_the_tests_need(dists: tuple[Path, Path, str]) -> None:
    sdist = dists[0]
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    needed = {"LICENSE", "README.md", "pyproject.toml", "tests/conftest.py", "src/ferry/py.typed"}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    if (ROOT / "mkdocs.yml").exists():
        needed.add("mkdocs.yml")
    assert needed - names == set()
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_pytest_runs_from_the_unpacked_sdist(dists: tuple[Path, Path, str], tmp_path: Path) -> None:
    with tarfile.open(dists[0]) as tf:
        if hasattr(tarfile, "data_filter"):  # 3.11.4+: refuse links and paths out of the folder
            tf.extractall(tmp_path, filter="data")
        else:
            tf.extractall(tmp_path)  # our own sdist, just built
    (unpacked,) = tmp_path.iterdir()
    env = {**os.environ, "PYTHONPATH": str(unpacked / "src"), "FERRY_BACKEND": "emulated"}
    where = subprocess.run([sys.executable, "-c", "import ferry; print(ferry.__file__)"], cwd=unpacked,
                           capture_output=True, text=True, env=env)
    assert where.stdout.strip().startswith(str(unpacked)), where.stdout + where.stderr
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider"],
                               cwd=unpacked, capture_output=True, text=True, env=env, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "error" not in collected.stdout.lower().splitlines()[-1]
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not lint",
         "tests/test_batch.py", "tests/test_readme.py"],
        cwd=unpacked, capture_output=True, text=True, env=env, timeout=300,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert " passed" in ran.stdout.splitlines()[-1]


def test_pyproject_declares_setuptools_that_reads_spdx_licenses() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "setuptools>=77" in config["build-system"]["requires"]
    assert config["project"]["license"] == "Apache-2.0"
    assert "build>=1.2" in config["project"]["optional-dependencies"]["test"]
