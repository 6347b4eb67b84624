"""The public surface: names exported once, from one private module each; style gates."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Collection
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


def _ferry_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__.py``)."""
    base = ROOT / "src"
    found = {}
    for path in sorted((base / "ferry").rglob("*.py")):
        parts = path.relative_to(base).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module_name: str, path: Path, modules: Collection[str]) -> dict[str, int]:
    """The ferry modules ``module_name`` imports (each with the line of one such import): at module
    level, under ``TYPE_CHECKING`` and inside functions alike. A name imported from a module is an
    edge to that module (to the submodule, when the name is one); imports of other packages (the
    optional peers: torch, cupy, jax) are not ferry's edges."""
    import ast

    package = module_name if path.name == "__init__.py" else module_name.rsplit(".", 1)[0]

    def owner(dotted: str) -> str | None:  # the ferry module that ``dotted`` names, or lies in
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            module = owner(target)
            if module is not None and module != module_name:
                found.setdefault(module, node.lineno)
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    modules = _ferry_modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_the_import_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    path = tmp_path / "_x.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from .. import _native\n"  # a package's module, by name
        "from ._base import helper\n"  # a name from a module
        "import ferry._errors\n"  # absolute
        "if TYPE_CHECKING:\n"
        "    from .._parts import Parts\n"
        "def late():\n"
        "    import torch\n"  # an optional peer: not ferry's
        "    from .._lifecycle import make_backend\n"
        "    from ._x import late\n"  # itself
    )
    modules = {"ferry", "ferry._native", "ferry._routes", "ferry._routes._base", "ferry._routes._x", "ferry._errors",
               "ferry._parts", "ferry._lifecycle"}
    assert _imports("ferry._routes._x", path, modules) == {
        "ferry._native": 3, "ferry._routes._base": 4, "ferry._errors": 5, "ferry._parts": 7, "ferry._lifecycle": 10,
    }


def test_the_circle_finder_finds_circles() -> None:
    graph: dict[str, dict[str, int]] = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"d": 1}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b": 1}, "b": {}}) == []


def test_the_module_graph_has_no_circle() -> None:
    graph = _import_graph()
    circles = _circles(graph)
    detail = [
        " <-> ".join(c) + ": " + ", ".join(f"{m}:{graph[m][t]} -> {t}" for m in c for t in sorted(graph[m]) if t in c)
        for c in circles
    ]
    assert circles == [], "import circles (TYPE_CHECKING and function-local imports count):\n" + "\n".join(detail)


# The rooms, lowest first. A module imports only from its own room or the rooms below (at run time,
# under TYPE_CHECKING and inside functions alike); inside a room the graph has no circle (above).
# Where two rooms need each other, the lower one states what it needs as a protocol.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ferry._errors", "ferry._state"),
    ("ferry._native", "ferry._backends"),  # the compiled layer and the device seam
    # ``_interop._host``: a host array's NumPy view; ``_structure``: nested containers of such arrays
    ("ferry._lifecycle", "ferry._args", "ferry._retire", "ferry._interop._host", "ferry._structure"),
    ("ferry._interop._dlpack", "ferry._interop._cai", "ferry._memory"),  # memory, and how it is exported
    ("ferry._buffer", "ferry._device_array"),  # the owned objects
    ("ferry._records", "ferry._watcher", "ferry._completion"),  # records, their signals, completion
    ("ferry._pending", "ferry._waiting", "ferry._interop"),  # handles and waits; foreign arrays in transfers
    ("ferry._routes",),
    ("ferry._parts", "ferry._stats"),
    ("ferry._runtime", "ferry._prefetch", "ferry._trees", "ferry._files", "ferry._loader"),  # the facade, and
    # what drives a runtime through it (whole structures, checkpoint files, the data loader)
    ("ferry", "ferry.testing", "ferry.__main__", "ferry._bench"),  # above it: the public surface and tools
)


def _layer(module_name: str) -> int:
    """The room of ``module_name``: the layer of its longest listed prefix."""
    best, rank = "", -1
    for i, names in enumerate(LAYERS):
        for name in names:
            inside = module_name.startswith(name + ".") and name != "ferry"  # the package itself: by name
            if (module_name == name or inside) and len(name) > len(best):
                best, rank = name, i
    assert rank >= 0, f"{module_name} is in no room: place it in LAYERS (tests/test_api.py)"
    return rank


def test_every_import_runs_down_the_layers() -> None:
    graph = _import_graph()
    for module_name in graph:
        _layer(module_name)  # every module is in a room
    with pytest.raises(AssertionError, match="in no room"):
        _layer("ferry._nowhere")
    upward = [
        f"{m}:{line} -> {t}" for m, targets in sorted(graph.items()) for t, line in sorted(targets.items())
        if _layer(t) > _layer(m)
    ]
    assert upward == [], "imports that run up the layers:\n" + "\n".join(upward)


def test_nothing_below_the_facade_imports_it() -> None:
    facade = _layer("ferry._runtime")
    graph = _import_graph()
    for module_name, targets in graph.items():
        if _layer(module_name) < facade:
            assert not {t for t in targets if _layer(t) >= facade}, module_name


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
