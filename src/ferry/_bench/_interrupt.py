"""Ctrl-C during ``python -m ferry bench``: stopped within a second, exit status 130, one line.

A ``KeyboardInterrupt`` raised wherever the signal lands (the default) is
easily lost in a benchmark: it lands inside a case's clean-up, the clean-up
fails on a buffer still in flight, and that error, recorded as a failed group,
replaces the interrupt while the run goes on. So while the bench runs, Ctrl-C
raises nothing where it lands. Its handler only notes the interrupt, and
the bench stops at its next safe point (:func:`check`: before each case and
between the repeats of one), where nothing is in flight. It unwinds through
every clean-up, closes the runtime and ends with status 130 and one line on
stderr.

A safe point is always near, but not bounded: a wait for a slow copy, a
thread's clean-up, an import or a plot may hold the run past it. So the
first Ctrl-C also starts a watchdog: if the process is still alive
:data:`GRACE` seconds later (or at a second Ctrl-C), the watchdog removes the
report files still being written, prints the same line and ends the process
at once with status 130, leaving what is in flight to the operating system,
as exiting with copies in flight does. A report is never half written: its
files are written under temporary names and renamed into place in one step
(:func:`publishing`) that the watchdog does not cut short.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__: list[str] = []

GRACE = 0.8  # s from the first Ctrl-C to a forced stop, the orderly unwinding's time included
STATUS = 130  # 128 + SIGINT, what shells report for a program stopped by Ctrl-C


class _State:
    def __init__(self) -> None:
        self.prog = "python -m ferry"
        self.active = False  # the bench's handler is installed
        self.at: float | None = None  # when the first Ctrl-C came
        self.said = False
        self.lock = threading.Lock()  # the line is said once
        self.publishing = threading.Lock()  # held while the report's files are renamed into place
        self.temporary: set[Path] = set()  # report files being written, removed by a forced stop


_state = _State()


def interrupted() -> bool:
    """Whether Ctrl-C came while the bench ran."""
    return _state.at is not None


def check() -> None:
    """A safe point: raise ``KeyboardInterrupt`` if Ctrl-C came."""
    if _state.at is not None:
        raise KeyboardInterrupt


def say(prog: str) -> None:
    """Print ``prog: interrupted`` on stderr, once per process, whoever asks first."""
    with _state.lock:
        if _state.said:
            return
        _state.said = True
    with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr closed or gone: nothing to say it on
        sys.stderr.write(f"{prog}: interrupted\n")
        sys.stderr.flush()


def _stop_now() -> None:
    """End the process at once with status 130 (the watchdog, or a second Ctrl-C)."""
    with _state.publishing:  # a report being renamed into place is finished first (microseconds)
        for path in list(_state.temporary):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if sys.stderr.isatty():  # a progress bar hid the cursor: show it again
                sys.stderr.write("\x1b[?25h")
        say(_state.prog)
        os._exit(STATUS)


def _watchdog() -> None:
    time.sleep(GRACE)
    _stop_now()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _state.at is not None:  # the second Ctrl-C: stop now
        _stop_now()
    _state.at = time.monotonic()
    threading.Thread(target=_watchdog, name="ferry-bench-interrupt", daemon=True).start()


@contextlib.contextmanager
def guarded(prog: str) -> Iterator[None]:
    """While the bench runs: Ctrl-C is noted (see the module docstring), not raised where it lands.

    On leaving, the previous handler is back, and an interrupt noted inside
    is raised as ``KeyboardInterrupt``, whatever replaced it meanwhile.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread: nothing to guard
        return
    _state.prog = prog
    _state.at = None
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _state.active = True
    try:
        yield
    except BaseException as exc:
        if interrupted() and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from exc  # a clean-up's error after Ctrl-C: still an interrupt
        raise
    finally:
        _state.active = False
        signal.signal(signal.SIGINT, previous)
    check()


def temporary(path: Path) -> Path:
    """``path``'s temporary name while it is written; removed by a forced stop."""
    tmp = path.with_name(f".partial-{path.name}")  # the suffix stays: the plot's format is chosen by it
    _state.temporary.add(tmp)
    return tmp


@contextlib.contextmanager
def publishing() -> Iterator[None]:
    """Rename the report's files into place in one step: a forced stop waits for it to end."""
    check()
    with _state.publishing:
        yield
        _state.temporary.clear()


def discard_temporary() -> None:
    """Remove the temporary files left by an interrupted write."""
    for path in list(_state.temporary):
        with contextlib.suppress(OSError):
            path.unlink()
    _state.temporary.clear()
