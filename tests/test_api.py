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
    for module_name in _private_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            owners.setdefault(name, []).append(module_name)
    duplicated = {name: mods for name, mods in owners.items() if len(mods) > 1}
    assert duplicated == {}
    assert sorted(ferry.__all__) == sorted(owners)
    assert len(ferry.__all__) == len(set(ferry.__all__))
    for name in ferry.__all__:
        assert getattr(ferry, name).__module__.startswith("ferry._")


def _private_modules() -> list[str]:
    base = ROOT / "src"
    names = []
    for path in sorted((base / "ferry").rglob("_*.py")):
        if path.name in {"__init__.py", "__main__.py"} or "_bench" in path.parts:
            continue
        names.append(".".join(path.relative_to(base).with_suffix("").parts))
    return names


def _runtime_imports(module_name: str) -> set[str]:
    """The ferry modules ``module_name`` imports at run time (not under TYPE_CHECKING)."""
    import ast

    path = ROOT / "src" / Path(*module_name.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    package = module_name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - child.level + 1])
                target = f"{base}.{child.module}" if child.module else base
                found.add(target)
                for alias in child.names:
                    found.add(f"{target}.{alias.name}")
            visit(child)

    visit(tree)
    return {name for name in found if name.startswith("ferry.")}


# Private modules that sit above the facade: they drive a Runtime through its public surface
# (as ferry.testing and the benchmarks do), and nothing imports them but ferry/__init__.py.
ABOVE_THE_FACADE = {"ferry._runtime", "ferry._prefetch", "ferry._loader._dataloader"}


def test_nothing_below_the_facade_imports_it_at_run_time() -> None:
    modules = _private_modules()
    for module_name in modules:
        if module_name in ABOVE_THE_FACADE:
            continue
        for above in ABOVE_THE_FACADE - {"ferry._runtime"}:
            assert above not in _runtime_imports(module_name), (module_name, above)
        assert "ferry._runtime" not in _runtime_imports(module_name), module_name


def test_the_module_graph_has_no_cycle() -> None:
    modules = set(_private_modules())
    graph = {m: {t for t in _runtime_imports(m) if t in modules and t != m} for m in modules}
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node):], node]))
        if node in done:
            return
        for nxt in graph[node]:
            walk(nxt, [*path, node])
        done.add(node)

    for module_name in sorted(modules):
        walk(module_name, [])


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
