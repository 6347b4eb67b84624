"""Typed results: a user's script passes ``mypy --strict`` with no Any leaking out of ferry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.lint
@pytest.mark.slow
def test_a_users_script_type_checks_strictly() -> None:
    pytest.importorskip("mypy", reason="mypy is part of the test extra")
    script = ROOT / "tests" / "typecheck" / "user_script.py"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental",
         "--config-file", "/dev/null", str(script)],
        cwd=ROOT, capture_output=True, text=True, env={"MYPYPATH": str(ROOT / "src"), "PATH": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_signatures_name_no_private_type() -> None:
    import inspect

    import ferry

    for name in ferry.__all__:
        obj = getattr(ferry, name)
        members = [obj] if not inspect.isclass(obj) else [
            v for k, v in vars(obj).items() if callable(v) and not k.startswith("_")
        ]
        for member in members:
            try:
                signature = str(inspect.signature(member))
            except (TypeError, ValueError):
                continue
            assert "'_" not in signature and " _" not in signature, f"{name}: {signature}"
