"""The documentation's code runs as it stands: every ```python block of README.md and of
the pages under docs/ is a complete program, run on its own on the emulated device.

A block that cannot run here (it needs a GPU or another library) is fenced ```py and
opens with a comment that says what it needs; it is shown, not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(m for m in FENCE.finditer(page.read_text()) if m.group(1) == language):
            found.append((f"{page.relative_to(ROOT)}#{index + 1}", match.group(2)))
    return found


PYTHON = blocks("python")


def test_the_readme_has_runnable_blocks() -> None:
    assert len([name for name, _ in PYTHON if name.startswith("README.md")]) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("code", [code for _, code in PYTHON], ids=[name for name, _ in PYTHON])
def test_a_python_block_runs_as_it_stands(code: str, tmp_path: Path) -> None:
    env = {**os.environ, "FERRY_BACKEND": "emulated"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    assert "Exception ignored" not in result.stderr


@pytest.mark.parametrize("code", [code for _, code in blocks("py")], ids=[name for name, _ in blocks("py")])
def test_a_block_shown_but_not_run_says_why(code: str) -> None:
    assert code.startswith("# needs "), code.splitlines()[0]
    compile(code, "<doc>", "exec")  # still valid Python
