"""``python -m ferry``, run as a user runs it: in a subprocess, reading exit status,
stdout and stderr. A user's mistake gets one line on stderr and exit status 2,
never a traceback; a closed pipe ends the command quietly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferry import DeviceUnavailableError
from ferry.__main__ import OVERLAP_RUNS, _available_host_bytes, _hidden

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# groups that run in about a second on the emulated device; handoff yields a GPU target
QUICK_GROUPS = "host_copies,latency,pinned_alloc,handoff,many_small"


def _env(**extra: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FERRY_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def ferry(*args: str, cwd: Path | None = None, **env: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ferry", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=_env(**env), timeout=300)


def _gpu_usable() -> bool:
    from ferry._backends._cuda import probe

    try:
        probe(0)
    except DeviceUnavailableError:
        return False
    return True


def _assert_usage_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m ferry") and ": error: " in lines[0]
    for needle in needles:
        assert needle in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["info"], {"FERRY_BACKEND": "bogus"}, ["FERRY_BACKEND", "'bogus'"]),
        (["info"], {"FERRY_BACKEND": ""}, ["FERRY_BACKEND"]),
        (["--device", "-1", "info"], {}, ["--device", "-1"]),
        (["--device", "x", "info"], {}, ["--device", "'x'"]),
        (["--device", "99", "info"], {"FERRY_BACKEND": "emulated"}, ["device 99"]),
        (["--backend", "bogus", "info"], {}, ["--backend", "bogus"]),
        (["demo", "--mib", "0"], {}, ["--mib", "at least 1"]),
        (["demo", "--mib", "-5"], {}, ["--mib", "-5"]),
        (["demo", "--mib", "1.5"], {}, ["--mib", "'1.5'"]),
        (["bench", "--seconds", "-1"], {}, ["--seconds", "-1"]),
        (["bench", "--seconds", "0"], {}, ["--seconds"]),
        (["bench", "--seconds", "nan"], {}, ["--seconds"]),
        (["bench", "--groups", "transfer,bogus"], {}, ["bogus", "choose from"]),
        (["bench", "--out", "x", "--no-files"], {}, ["not allowed with"]),
        ([], {}, ["required"]),
        (["frobnicate"], {}, ["frobnicate"]),
    ],
)
def test_a_usage_mistake_is_one_line_and_status_2(args: list[str], env: dict[str, str], needles: list[str],
                                                  tmp_path: Path) -> None:
    result = ferry(*args, cwd=tmp_path, **env)
    _assert_usage_error(result, *needles)
    assert list(tmp_path.iterdir()) == []  # a refused bench wrote nothing


def test_a_demo_that_cannot_fit_in_memory_is_refused_before_allocating(tmp_path: Path) -> None:
    available = _available_host_bytes()
    if available is not None and available > 6 * (100_000 << 20):
        pytest.skip("this machine could hold a 97.7 GiB demo")
    result = ferry("demo", "--mib", "100000", FERRY_BACKEND="emulated")
    _assert_usage_error(result, "--mib 100000", "available")


def test_bench_refuses_an_out_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "report"
    target.write_text("keep me")
    result = ferry("bench", "--quick", "--out", str(target), FERRY_BACKEND="emulated")
    _assert_usage_error(result, "--out", "not a folder")
    assert target.read_text() == "keep me"


def test_cuda_without_a_gpu_is_a_usage_error() -> None:
    if _gpu_usable():
        pytest.skip("a GPU is usable here")
    _assert_usage_error(ferry("--backend", "cuda", "info"), "driver")


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_closed_pipe_ends_quietly(unbuffered: bool) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ferry", "info"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(FERRY_BACKEND="emulated", PYTHONUNBUFFERED="1" if unbuffered else None))
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before ferry prints its first line
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert stderr == ""


def test_a_closed_pipe_after_the_first_line_ends_quietly() -> None:
    result = subprocess.run(f"'{sys.executable}' -m ferry info | head -1; echo \"status ${{PIPESTATUS[0]}}\"",
                            shell=True, executable="/bin/bash", capture_output=True, text=True, cwd=ROOT,
                            env=_env(FERRY_BACKEND="emulated"), timeout=120)
    assert result.stdout.splitlines() == [result.stdout.splitlines()[0], "status 0"]
    assert result.stdout.startswith("ferry on the emulated backend")
    assert result.stderr == ""


def test_info_says_why_it_runs_on_the_emulated_device() -> None:
    chosen = ferry("--backend", "emulated", "info")
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.splitlines()[0] == "ferry on the emulated backend (chosen with --backend emulated)"
    by_env = ferry("info", FERRY_BACKEND="emulated")
    assert by_env.stdout.splitlines()[0] == "ferry on the emulated backend (chosen with FERRY_BACKEND=emulated)"
    auto = ferry("info")
    assert auto.returncode == 0, auto.stderr
    if _gpu_usable():
        assert auto.stdout.startswith("ferry on the cuda backend\n")
        return
    from ferry._backends._cuda import probe

    with pytest.raises(DeviceUnavailableError) as reason:
        probe(0)
    assert auto.stdout.splitlines()[0] == f"ferry on the emulated backend (no usable GPU: {reason.value})"


def test_info_prints_each_route_once_without_repeated_words() -> None:
    result = ferry("info", FERRY_BACKEND="emulated", FERRY_EMULATED_DEVICES="2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    routes = lines[lines.index("device-to-device routes:") + 1:]
    assert len(routes) == 4
    for line in routes:
        match = re.fullmatch(r"  (\d) -> (\d): (same device|peer|staged)( \((.+)\))?", line)
        assert match is not None, line
        assert match.group(5) != match.group(3)
    assert "  0 -> 0: same device" in routes


def test_demo_stats_add_up_and_the_dropped_handle_retires() -> None:
    result = ferry("demo", "--mib", "4", FERRY_BACKEND="emulated")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    stats = re.search(r"stats: submitted (\d+), completed (\d+), failed (\d+), in flight (\d+), retiring (\d+)",
                      result.stdout)
    assert stats is not None, result.stdout
    submitted, completed, failed, in_flight, retiring = (int(g) for g in stats.groups())
    assert submitted == completed + failed + in_flight + retiring
    runs = 4 + 2 * OVERLAP_RUNS  # the upload, the guarded download, the timed first copy, the dropped one
    assert (submitted, completed, in_flight, retiring) == (runs, runs, 0, 0)
    assert "record freed, nobody waited" in result.stdout
    assert "BufferMovedError" in result.stdout and "MISMATCH" not in result.stdout


def test_demo_says_what_its_overlap_figure_means() -> None:
    result = ferry("demo", "--mib", "4", FERRY_BACKEND="emulated")
    assert result.returncode == 0, result.stdout + result.stderr
    hidden = re.search(r"overlapped \(submit, work, wait\) .* (\d+)% of the shorter step hidden", result.stdout)
    assert hidden is not None, result.stdout
    assert 0 <= int(hidden.group(1)) <= 100
    assert "x of max(copy, work)" not in result.stdout  # a ratio that read like a failure on this device
    assert "as a share of the shorter of copy and work" in result.stdout
    assert "emulated device: its copies are made by this machine's CPU" in result.stdout


@pytest.mark.parametrize(("copy", "work", "overlapped", "hidden"), [
    (1.0, 2.0, 2.0, 1.0),  # the copy ran entirely behind the work
    (1.0, 2.0, 3.0, 0.0),  # nothing hidden: serial
    (1.0, 2.0, 2.5, 0.5),
    (2.0, 1.0, 3.5, 0.0),  # slower than serial: shown as nothing hidden
    (2.0, 1.0, 1.5, 1.0),  # faster than the longer step (noise): shown as all hidden
])
def test_the_demo_s_hidden_share(copy: float, work: float, overlapped: float, hidden: float) -> None:
    assert _hidden(copy, work, overlapped) == pytest.approx(hidden)


@pytest.mark.parametrize("command", [[], ["info"], ["demo"], ["bench"]])
def test_help_is_plain_text(command: list[str]) -> None:
    result = ferry(*command, "--help")
    assert result.returncode == 0
    assert result.stderr == ""
    assert result.stdout.startswith("usage: python -m ferry")
    for markup in ("``", ":class:", ":func:", ":meth:", "`"):
        assert markup not in result.stdout


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A short bench on the emulated device, in an empty folder, with the default --out."""
    cwd = tmp_path_factory.mktemp("bench")
    result = ferry("bench", "--quick", "--seconds", "0.001", "--groups", QUICK_GROUPS, cwd=cwd,
                   FERRY_BACKEND="emulated")
    return result, cwd


def test_bench_says_where_it_writes_and_writes_only_there(
        bench_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, cwd = bench_run
    assert result.returncode == 0, result.stderr[-3000:]
    out = cwd / "bench-out"
    assert result.stderr.splitlines()[0] == f"bench: writing bench.md, bench.json, bench.png to {out.resolve()}"
    assert [p.name for p in cwd.iterdir()] == ["bench-out"]
    written = sorted(p.name for p in out.iterdir())
    assert written in (["bench.json", "bench.md"], ["bench.json", "bench.md", "bench.png"])
    assert (out / "bench.md").read_text() in result.stdout


def test_bench_progress_shows_the_total_and_the_time_left(
        bench_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, cwd = bench_run
    results = json.loads((cwd / "bench-out" / "bench.json").read_text())["results"]
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    total = len(results)
    assert len(progress) == total
    for i, line in enumerate(progress, 1):
        assert re.match(rf"\[ *{i}/{total}\] ", line), line
    assert all(re.search(r"about \d+:\d\d left\)$", line) for line in progress[1:])


def test_bench_marks_gpu_targets_not_applicable_on_the_emulated_device(
        bench_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, cwd = bench_run
    checks = result.stdout.split("## checks", 1)[1]
    assert "MISS" not in checks and "| pass |" not in checks
    assert "| n/a (emulated) |" in checks
    verdicts = {c["verdict"] for c in json.loads((cwd / "bench-out" / "bench.json").read_text())["checks"]}
    assert verdicts <= {"n/a (emulated)", "not run"} and "n/a (emulated)" in verdicts


def test_bench_no_files_writes_nothing(tmp_path: Path) -> None:
    result = ferry("bench", "--quick", "--seconds", "0.001", "--groups", "latency", "--no-files", cwd=tmp_path,
                   FERRY_BACKEND="emulated")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "write no file" in ferry("bench", "--help").stdout
    assert result.stderr.splitlines()[0] == "bench: report to stdout only (--no-files)"
    assert "## latency" in result.stdout
    assert list(tmp_path.iterdir()) == []


# -- the command's name, its version, global options after the command --------------------------------------


def test_version_prints_the_version() -> None:
    import ferry as ferry_module

    result = ferry("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ferry {ferry_module.__version__}\n"


def test_usage_names_the_command_as_it_was_run(tmp_path: Path) -> None:
    assert ferry().stderr.startswith("python -m ferry: error: ")
    script = tmp_path / "ferry"  # what the installed `ferry` script does
    script.write_text("import sys\nfrom ferry.__main__ import main\nsys.exit(main())\n")
    result = subprocess.run([sys.executable, str(script), "info", "--device", "x"], capture_output=True, text=True,
                            env=_env(), timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("ferry info: error: argument --device"), result.stderr
    usage = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=_env(),
                           timeout=300)
    assert usage.stdout.startswith("usage: ferry "), usage.stdout
    assert "python -m ferry" not in usage.stdout


@pytest.mark.parametrize("args", [["info", "--backend", "emulated"], ["--backend", "emulated", "info"],
                                  ["info", "--backend", "emulated", "--device", "0"]])
def test_global_options_go_before_or_after_the_command(args: list[str]) -> None:
    result = ferry(*args, FERRY_BACKEND=None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ferry on the emulated backend (chosen with --backend emulated)")


def test_an_option_after_the_command_overrides_the_one_before() -> None:
    result = ferry("--device", "0", "info", "--device", "99", FERRY_BACKEND="emulated")
    _assert_usage_error(result, "device 99")


# -- Ctrl-C during bench ----------------------------------------------------------------------------------

# s: the bench stops within about a second (a forced stop after _interrupt.GRACE); the bound here only tells a
# stopped run from one that went on (the bug: 10 s and more, to the end) on a loaded machine
STOPPED_WITHIN = 10.0

# runs the bench in-process, sending itself SIGINT at one chosen point; prints when it was sent
_INTERRUPTED_BENCH = """
import os, signal, sys, time
import ferry
from ferry import _bench, _buffer
from ferry.__main__ import main

_groups = sys.modules["ferry._bench._groups"]  # (ferry._bench._groups is also a function's name there)

point, out = sys.argv[1], sys.argv[2]

def ctrl_c():
    print(time.monotonic(), file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGINT)

calls = [0]
if point in ("clean-up", "clean-up fails", "clean-up hangs"):
    close = _buffer.PinnedHostBuffer.close
    def close_then(self):  # a group's clean-up: a case's pinned buffer is closed
        calls[0] += 1
        if calls[0] == 3:
            ctrl_c()
            if point == "clean-up fails":  # the clean-up fails after Ctrl-C (the error the bug recorded)
                raise ferry.BufferMovedError("cannot close a buffer that is in flight; wait() for it first")
            if point == "clean-up hangs":
                time.sleep(60)
        return close(self)
    _buffer.PinnedHostBuffer.close = close_then
elif point == "in flight":
    measure = _groups.measure
    def measure_then(op, budget, *, setup=None):
        if setup is None:
            return measure(op, budget)
        def setup_then():
            setup()  # a pinned_wait case's submission: its buffer is in flight until op() waits
            calls[0] += 1
            if calls[0] == 5:
                ctrl_c()
        return measure(op, budget, setup=setup_then)
    _groups.measure = measure_then
elif point == "peers":
    load_peers = _bench.load_peers
    def slow_peers(rt):
        ctrl_c()
        time.sleep(60)  # an import that takes long
        return load_peers(rt)
    _bench.load_peers = slow_peers
elif point == "report":
    plot = _bench.plot
    def slow_plot(path, meta, results):
        ctrl_c()
        time.sleep(60)  # matplotlib at work
        return plot(path, meta, results)
    _bench.plot = slow_plot
elif point == "twice":
    measure = _groups.measure
    def measure_then(op, budget, *, setup=None):
        def op_then():
            calls[0] += 1
            if calls[0] == 40:
                ctrl_c()
                os.kill(os.getpid(), signal.SIGINT)  # impatient: a second Ctrl-C
                time.sleep(60)
            return op()
        return measure(op_then, budget, setup=setup)
    _groups.measure = measure_then
sys.exit(main(["bench", "--quick", "--seconds", "0.001", "--groups", "transfer,latency", "--out", out]))
"""


def _check_interrupted(result: subprocess.CompletedProcess[str], ended: float, sent: float, out: Path) -> None:
    assert result.returncode == 130, result.stderr[-2000:]
    assert ended - sent < STOPPED_WITHIN, f"the bench went on for {ended - sent:.1f} s after Ctrl-C"
    assert "Traceback" not in result.stderr and "group failed" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == "python -m ferry: interrupted", result.stderr[-2000:]
    assert result.stderr.count("interrupted") == 1
    assert result.stdout == ""  # no report, not even a part of one
    assert list(out.iterdir()) == []  # no file, no temporary file


@pytest.mark.parametrize("point", ["in flight", "clean-up", "clean-up fails", "clean-up hangs", "peers", "report",
                                   "twice"])
def test_ctrl_c_stops_the_bench_wherever_it_lands(point: str, tmp_path: Path) -> None:
    import time

    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, "-c", _INTERRUPTED_BENCH, point, str(out)], capture_output=True,
                            text=True, env=_env(FERRY_BACKEND="emulated"), timeout=300)
    ended = time.monotonic()
    sent = [float(line) for line in result.stderr.splitlines() if re.fullmatch(r"[0-9.]+", line)]
    assert sent, f"Ctrl-C was never sent: {result.stderr[-2000:]}"
    _check_interrupted(result, ended, sent[0], out)


@pytest.mark.parametrize("after", [0.5, 1.5, 3.0])
def test_ctrl_c_from_outside_stops_the_bench(after: float, tmp_path: Path) -> None:
    import signal
    import time

    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-m", "ferry", "bench", "--quick", "--out", str(out)], cwd=ROOT,
                             env=_env(FERRY_BACKEND="emulated"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:  # the bench has begun
            time.sleep(0.01)
        time.sleep(after)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        child.kill()
    result = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    _check_interrupted(result, time.monotonic(), sent, out)
