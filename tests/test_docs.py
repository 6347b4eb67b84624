"""The documentation site: ``mkdocs build --strict`` passes (when the ``docs`` extra is
installed, as in CI), every page is in the nav, and the API
reference documents every public name, with no Sphinx role left showing."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import math
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferry

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["getting-started.md", "contract.md", "waiting.md", "routes.md", "interop.md", "memory.md", "prefetch.md",
         "checkpoints.md", "trees.md", "loader.md", "several-gpus.md", "cli.md", "testing.md", "reliability.md",
         "benchmarks.md", "reference/index.md"]


def test_the_nav_has_every_page_and_each_page_exists() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    for page in ["index.md", *PAGES]:
        assert re.search(rf":\s+{re.escape(page)}\s*$", config, re.M), page
        assert (ROOT / "docs" / page).is_file(), page


def test_the_reference_names_every_public_name_through_the_package() -> None:
    reference = (ROOT / "docs" / "reference" / "index.md").read_text()
    documented = re.findall(r"^::: ferry\.(\w+)\s*$", reference, re.M)
    assert sorted(documented) == sorted(ferry.__all__)
    assert "::: ferry._" not in reference  # private module paths move; the package's names stay


def test_the_readme_links_to_the_site_pages() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        assert f"(docs/{page})" in readme, page


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert not [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    return out


@pytest.mark.slow
def test_mkdocs_build_strict_passes(site: Path) -> None:
    assert (site / "index.html").is_file()
    for page in PAGES:
        assert (site / page.removesuffix(".md") / "index.html").is_file() or (
            site / page.replace(".md", ".html")).is_file(), page


@pytest.mark.slow
def test_the_api_reference_is_generated_from_the_docstrings(site: Path) -> None:
    html = (site / "reference" / "index.html").read_text()
    for anchor in ("ferry.Runtime.upload_pending", "ferry.PendingUpload.wait", "ferry.PendingUpload.hand_off",
                   "ferry.PinnedHostBuffer.as_array", "ferry.wait_all", "ferry.TransferFailedError"):
        assert f'id="{anchor}"' in html, anchor
    assert "Hand the destination to GPU work" in html  # a docstring's own words
    assert not re.search(r":(class|meth|func|attr):", html)


# -- the rendered reference's defaults are the code's ------------------------------------------------------


class _Reference(HTMLParser):
    """The objects of a rendered reference page: per heading id (``ferry.Runtime.upload``), its
    signature's text and the rows (name, ..., default) of its Parameters table."""

    def __init__(self) -> None:
        super().__init__()
        self.signatures: dict[str, str] = {}
        self.parameters: dict[str, list[list[str]]] = {}
        self._obj: str | None = None
        self._in_signature = 0
        self._signature: list[str] = []
        self._title: list[str] | None = None
        self._section: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag in ("h1", "h2", "h3", "h4", "h5") and "doc-heading" in classes:
            self._obj = dict(attrs).get("id")
        elif tag == "div" and "doc-signature" in classes:
            self._in_signature, self._signature = 1, []
        elif tag == "div" and self._in_signature:
            self._in_signature += 1
        elif tag == "span" and "doc-section-title" in classes:
            self._title = []
        elif tag == "tr" and "doc-section-item" in classes and self._section == "Parameters:":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._in_signature:
            self._in_signature -= 1
            if not self._in_signature and self._obj is not None:
                self.signatures[self._obj] = "".join(self._signature)
        elif tag == "span" and self._title is not None:
            self._section, self._title = "".join(self._title).strip(), None
        elif tag == "td" and self._row is not None and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            assert self._obj is not None
            self.parameters.setdefault(self._obj, []).append(self._row)
            self._row = None
        elif tag == "table":
            self._section = None

    def handle_data(self, data: str) -> None:
        if self._in_signature:
            self._signature.append(data)
        if self._title is not None:
            self._title.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _resolve(path: str) -> Any:
    obj: Any = importlib.import_module(path.split(".", maxsplit=1)[0])
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _code_defaults(obj: Any) -> dict[str, Any]:
    signature = inspect.signature(obj)
    defaults = {name: p.default for name, p in signature.parameters.items()}
    if dataclasses.is_dataclass(obj):  # a field(default_factory=...) shows as what the factory makes
        for field in dataclasses.fields(obj):
            if field.default_factory is not dataclasses.MISSING:
                defaults[field.name] = field.default_factory()
    return defaults


_NAMES = {**vars(np), "np": np, "numpy": np, **vars(ferry), "inf": math.inf}


def _value(text: str) -> Any:
    """A default as the page shows it, evaluated (``4 << 30``, ``'auto'``, ``uint8`` for np.uint8)."""
    return eval(text, {}, _NAMES)  # the page's own text, rendered from our code and docstrings


def _same(shown: Any, actual: Any) -> bool:
    if isinstance(actual, float) and math.isnan(actual):
        return isinstance(shown, float) and math.isnan(shown)
    return bool(shown is actual or shown == actual)


def _rendered_defaults(site: Path) -> list[tuple[str, str, str, Any]]:
    """(object, parameter, where, the default shown) for every default on the reference pages."""
    found: list[tuple[str, str, str, Any]] = []
    for page in ("index.html", "testing.html", "testing/index.html"):
        path = site / "reference" / page
        if not path.is_file():
            continue
        reference = _Reference()
        reference.feed(path.read_text())
        for obj, text in reference.signatures.items():
            code = text.strip()
            opening = code.find("(")
            if opening < 0:
                continue  # an attribute's signature: no parameters
            tree = ast.parse(f"def f{code[opening:]}: pass")
            function = tree.body[0]
            assert isinstance(function, ast.FunctionDef)
            arguments = function.args
            positional = arguments.posonlyargs + arguments.args
            for arg, default in zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults,
                                    strict=True):
                found.append((obj, arg.arg, "signature", _value(ast.unparse(default))))
            for arg, kw_default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
                if kw_default is not None:
                    found.append((obj, arg.arg, "signature", _value(ast.unparse(kw_default))))
        for obj, rows in reference.parameters.items():
            descriptions = [row[2] for row in rows if len(row) == 4]
            assert len(descriptions) == len(set(descriptions)), \
                f"{obj}: two parameters share one entry (its Parameters list names several at once)"
            for row in rows:
                if len(row) == 4 and row[3] != "required":
                    found.append((obj, row[0], "parameters table", _value(row[3])))
    return found


@pytest.mark.slow
def test_every_default_the_reference_shows_is_the_code_s(site: Path) -> None:
    found = _rendered_defaults(site)
    assert any(obj == "ferry.Runtime" and name == "emulated_latency" for obj, name, _, _ in found)
    wrong = []
    for obj, name, where, shown in found:
        actual = _code_defaults(_resolve(obj))
        assert name in actual, f"{obj}: the reference documents a parameter {name!r} the code does not have"
        if not _same(shown, actual[name]):
            wrong.append(f"{obj}({name}=...): the {where} shows {shown!r}, the code's default is {actual[name]!r}")
    assert not wrong, "\n".join(wrong)
