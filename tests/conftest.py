"""Every backend-neutral test runs on each available backend.

The emulated device always runs. CUDA runs when a GPU is usable; it is skipped
only on the narrow probe (no driver, no device). Every such skip carries one
short reason (:data:`NO_GPU`, or :data:`NO_PAIR` for two-GPU tests), so
``-ra`` folds them into one summary line; the driver's own message is printed
once, as the ``ferry cuda:`` line of the session header (and of the summary).

What needs a GPU is declared, never probed by hand in a test:

- the ``backend_name`` fixture's ``"cuda"`` parameter (and ``rt``, built on it);
- the ``machine`` fixture's ``"cuda"`` parameter (two GPUs; ``pair`` builds on it);
- ``@pytest.mark.cuda`` (one GPU) or ``@pytest.mark.cuda(devices=2)``.

Markers: ``slow`` (the quick loop is ``pytest -m "not slow"``) and ``lint``
(ruff, mypy), registered in ``pyproject.toml``; ``cuda``, registered here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ferry
from ferry import testing
from ferry._backends._cuda import probe

NO_GPU = "no usable GPU (see 'ferry cuda:' in the report header or summary)"
NO_PAIR = "no two usable GPUs (see 'ferry cuda:' in the report header or summary)"


def _probe(devices: int) -> str | None:
    """Why ``devices`` CUDA devices are not usable here (the driver's message), or ``None``."""
    try:
        for index in range(devices):
            probe(index)
    except ferry.DeviceUnavailableError as exc:
        return str(exc)
    return None


_CUDA_REASON = _probe(1)
_PAIR_REASON = _CUDA_REASON if _CUDA_REASON is not None else _probe(2)
_skipped_for_gpu = 0


def cuda_unavailable_reason() -> str | None:
    """The driver's message saying why no GPU is usable, or ``None`` when one is."""
    return _CUDA_REASON


def require_gpus(devices: int = 1) -> None:
    """Skip the running test unless ``devices`` GPUs are usable.

    The one place a CUDA skip is raised: one location and one reason, so pytest
    folds every such skip into one summary line.
    """
    global _skipped_for_gpu
    reason = _CUDA_REASON if devices <= 1 else _PAIR_REASON
    if reason is not None:
        _skipped_for_gpu += 1
        pytest.skip(NO_GPU if _CUDA_REASON is not None else NO_PAIR)


# -- hooks ------------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    # slow and lint are registered in pyproject.toml; cuda belongs to this file's setup hook
    config.addinivalue_line("markers", "cuda(devices=1): needs that many usable GPUs; skipped otherwise")


def _cuda_line() -> str:
    if _CUDA_REASON is not None:
        return f"ferry cuda: no usable GPU: {_CUDA_REASON}"
    if _PAIR_REASON is not None:
        return f"ferry cuda: one usable GPU (two-GPU tests skipped: {_PAIR_REASON})"
    return "ferry cuda: two or more usable GPUs"


def pytest_report_header(config: pytest.Config) -> str:
    return _cuda_line()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _skipped_for_gpu:  # the header is not shown with -q: say why once here as well
        terminalreporter.write_line(_cuda_line())


def _gpus_needed(item: pytest.Item) -> int:
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    needed = 0
    if params.get("backend_name") == "cuda":
        needed = 1
    if params.get("machine") == "cuda":
        needed = 2
    marker = item.get_closest_marker("cuda")
    if marker is not None:
        needed = max(needed, int(marker.kwargs.get("devices", marker.args[0] if marker.args else 1)))
    return needed


MEMCHECK_BUDGET = "memcheck time budget spent (MEMCHECK_LIMIT)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # raised here, not in a fixture: pytest reports a fixture's skip at each test's own
    # location, which would defeat the folding into one line
    deadline = os.environ.get("MEMCHECK_DEADLINE")  # set by benchmarks/gpu_memcheck.sh's MEMCHECK_LIMIT alone
    if deadline is not None and time.time() > float(deadline):
        pytest.skip(MEMCHECK_BUDGET)  # every process under the sanitizer still ends and writes its report
    needed = _gpus_needed(item)
    if needed:
        require_gpus(needed)


# -- fixtures ---------------------------------------------------------------------------------------------


STAND_IN_SOURCE = Path(__file__).resolve().parent.parent / "benchmarks" / "fake_cuda.c"


@pytest.fixture(scope="session")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the stand-in driver (``benchmarks/fake_cuda.c`` built as ``libcuda.so.1``), built once
    per session: put it on ``LD_LIBRARY_PATH`` of a subprocess to run the CUDA backend without a GPU."""
    if shutil.which("gcc") is None or not STAND_IN_SOURCE.exists():
        pytest.skip("needs gcc and benchmarks/fake_cuda.c to build the stand-in driver")
    folder = tmp_path_factory.mktemp("fake-cuda")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(STAND_IN_SOURCE),
                    "-ldl"], check=True)
    return folder


@pytest.fixture(params=["emulated", "cuda"])
def backend_name(request: pytest.FixtureRequest) -> str:
    """Each backend; the ``"cuda"`` one is skipped (by the setup hook) without a GPU."""
    return str(request.param)


@pytest.fixture(params=["emulated", "cuda"])
def machine(request: pytest.FixtureRequest) -> str:
    """Each backend with two devices: the emulated machine, or two GPUs."""
    return str(request.param)


@pytest.fixture
def cuda_reason() -> str | None:
    """The driver's message saying why no GPU is usable, or ``None``."""
    return _CUDA_REASON


@pytest.fixture
def rt(backend_name: str) -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime(backend_name)  # type: ignore[arg-type]
    try:
        yield runtime
        assert testing.violations(runtime) == []
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


@pytest.fixture
def emu() -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime("emulated")
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


def two_runtimes(backend: str) -> Iterator[tuple[ferry.Runtime, ferry.Runtime]]:
    """Runtimes on devices 0 and 1 of ``backend``, closed afterwards and checked for violations."""
    a = ferry.Runtime(backend, 0)  # type: ignore[arg-type]
    try:
        b = ferry.Runtime(backend, 1)  # type: ignore[arg-type]
    except BaseException:
        a.close()
        raise
    try:
        yield a, b
    finally:
        b.close()
        a.close()
    assert testing.violations(a) == [] and testing.violations(b) == []


@pytest.fixture
def pair(machine: str) -> Iterator[tuple[ferry.Runtime, ferry.Runtime]]:
    """Two runtimes on two devices of each machine (see ``machine``)."""
    yield from two_runtimes(machine)


@pytest.fixture
def emulated_pair() -> Iterator[tuple[ferry.Runtime, ferry.Runtime]]:
    """Two runtimes on the emulated machine's devices 0 and 1."""
    yield from two_runtimes("emulated")


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds passed (for work that runs on its own
    schedule, such as a background free); never a timing assert."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class HeldAtMost:
    """:func:`ferry.testing.hold` on ``rt``'s copy streams until :meth:`release` (or the ``with`` block's
    end), or until ``seconds`` passed, whichever comes first: a safety net instead of a timer on the call
    under test. While the gate is closed the held copies cannot complete, so a call that returned then did
    not wait for them, however long the scheduler kept it; one that did wait for them would never return.
    The net opens the gate after ``seconds`` so that such a call returns and the test fails instead of
    hanging: :attr:`expired` is then True (it is set before the gate opens). Assert ``not held.expired``
    right after the call under test."""

    def __init__(self, rt: ferry.Runtime, direction: str = "both", seconds: float = 30.0) -> None:
        self.expired = False
        self._lock = threading.Lock()
        self._stack: contextlib.ExitStack | None = contextlib.ExitStack()
        self._stack.enter_context(testing.hold(rt, direction))
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._stack is not None:
                self.expired = True
                self._open()

    def _open(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def release(self) -> None:
        """Open the gate now (from any thread); the held copies run."""
        self._timer.cancel()
        with self._lock:
            self._open()

    def __enter__(self) -> HeldAtMost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- optional GPU libraries, for the GPU tests -----------------------------------------------------------


@pytest.fixture
def torch() -> Any:
    """PyTorch with a CUDA device, or the test is skipped saying why."""
    try:
        import torch
    except ImportError:
        pytest.skip("PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return torch


@pytest.fixture
def cupy() -> Any:
    """CuPy, or the test is skipped saying why."""
    try:
        import cupy
    except ImportError:
        pytest.skip("CuPy is not installed")
    return cupy


# -- Ctrl-C tests: a signal sent once the main thread blocks in a call, not on a timer --------------


# Call ``fn`` (a blocking C call): a SignalInside sees the main thread on the next line while it blocks
# (no docstring: SignalInside looks for the line right after the def).
def call_inside(fn: Callable[[], Any]) -> Any:
    return fn()  # the main thread is inside fn (C, GIL released) while its innermost frame is here


class SignalInside:
    """Send ``signum`` to the main thread once it is inside ``call_inside(fn)``, ``fn`` a C function
    that releases the GIL: only then (or right after fn returned) does this thread, holding the
    GIL, see the main thread's innermost frame on ``call_inside``'s line. A timer could fire before the
    call began on a loaded machine. Not seen there within 30 s, it is sent anyway (``inside``
    stays False).

    Seen there means the GIL was released, not that ``fn`` already sleeps: a signal can land in
    between. A call that polls for signals (the compiled lock's slices) still sees it; one that only
    wakes on EINTR (CPython's lock: its sem_clockwait starts after the C handler ran, so nothing
    interrupts it) misses it and sleeps its full timeout. For such a call pass ``resend`` (seconds):
    the signal is sent again while the main thread is still seen inside, until it leaves (then
    :attr:`sent` counts them). Repeats of the signal can then land after the call ended: the caller
    must ignore all but the first (see ``test_runtime_lock``)."""

    def __init__(self, signum: int, resend: float | None = None) -> None:
        self.inside = False
        self.sent = 0
        self._signum = signum
        self._resend = resend
        self._main = threading.main_thread().ident or 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        line, deadline = call_inside.__code__.co_firstlineno + 1, time.monotonic() + 30
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(self._main)
            self.inside = frame is not None and frame.f_code is call_inside.__code__ and frame.f_lineno == line
            del frame
            if self.inside:
                break
            time.sleep(0.001)
        signal.pthread_kill(self._main, self._signum)
        self.sent = 1
        if self._resend is None or not self.inside:
            return
        while self._still_inside(time.monotonic() + self._resend) and time.monotonic() < deadline:
            signal.pthread_kill(self._main, self._signum)
            self.sent += 1

    def _still_inside(self, until: float) -> bool:
        """Whether the main thread is still seen inside ``call_inside`` at ``until`` (False once it left)."""
        line = call_inside.__code__.co_firstlineno + 1
        while True:
            frame = sys._current_frames().get(self._main)
            inside = frame is not None and frame.f_code is call_inside.__code__ and frame.f_lineno == line
            del frame
            if not inside:
                return False
            if time.monotonic() >= until:
                return True
            time.sleep(0.005)

    def join(self) -> None:
        self._thread.join()
        assert self.inside, "the main thread was not seen inside the call within 30 s"
