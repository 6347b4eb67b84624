"""The staging core in plain C: built without Python's headers and run, plainly and under the sanitizers.

``src/ferry/_native/core`` (jobs, host copies, the driver seam and thread, lanes, an engine's life) and
``emulated.c`` include no ``Python.h``. ``tests/test_native_core.c`` drives an emulated engine from C
(contiguous and strided round trips, a cooperative upload with a hand-off, an injected failure, a stop
with queued jobs, refused plans; file jobs: round trips, failed reads, writes and DMAs, a device error
after a file's, a cancel racing the lanes, jobs from several threads, empty and malformed plans); here it
is compiled with the system's C compiler alone and run, then
again with ThreadSanitizer and with AddressSanitizer + UBSan, where the compiler has them: zero reports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "src" / "ferry" / "_native"
TEST = ROOT / "tests" / "test_native_core.c"
CORE = [*sorted((NATIVE / "core").glob("*.c")), NATIVE / "emulated.c"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc"),
    pytest.mark.skipif(not (NATIVE / "core").is_dir(), reason="the compiled layer's sources are not here"),
]


def test_the_core_includes_no_python_header() -> None:
    for source in [*CORE, NATIVE / "core" / "core.h"]:
        includes = [line for line in source.read_text().splitlines() if line.startswith("#include")]
        assert includes and not [line for line in includes if "Python" in line or "native.h" in line], source


def build_and_run(
    tmp_path: Path, flags: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    exe = tmp_path / "core_test"
    warnings = ["-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers"]
    subprocess.run(["gcc", "-std=c11", "-pthread", "-g", *warnings, *flags, f"-I{NATIVE / 'core'}", str(TEST),
                    *map(str, CORE), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))


def test_the_core_runs_an_emulated_engine_in_plain_c(tmp_path: Path) -> None:
    result = build_and_run(tmp_path, ["-O2"])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


def _has_runtime(name: str) -> bool:
    found = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return os.path.isabs(found) and os.path.exists(found)


@pytest.mark.skipif(not _has_runtime("libtsan.so"), reason="gcc has no ThreadSanitizer runtime here")
def test_the_core_has_no_data_race_under_threadsanitizer(tmp_path: Path) -> None:
    result = build_and_run(tmp_path, ["-O1", "-fsanitize=thread"], {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert result.returncode == 0 and "ThreadSanitizer" not in result.stderr, result.stdout + result.stderr


@pytest.mark.skipif(not _has_runtime("libasan.so"), reason="gcc has no AddressSanitizer runtime here")
def test_the_core_has_no_memory_error_under_addresssanitizer(tmp_path: Path) -> None:
    result = build_and_run(tmp_path, ["-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                                      "-fno-omit-frame-pointer"], {"ASAN_OPTIONS": "detect_leaks=1"})
    assert result.returncode == 0 and "Sanitizer" not in result.stderr, result.stdout + result.stderr
