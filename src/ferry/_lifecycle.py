"""Lifecycle: a runtime's health, the registry of live runtimes, interpreter exit and fork.

A runtime is usable until one of four things happens, and :class:`Health`
records which: it was closed; it was inherited by a forked child (device state
does not survive ``fork``: the child must never touch the parent's streams,
memory or threads); the device reported a sticky error (the context is
unusable); or the interpreter exited while its copies were still in flight.
Every part of a runtime reads the same :class:`Health`, so one refusal message
answers every later call.

The registry keeps every runtime's *parts* (not the :class:`~ferry.Runtime`
facade) alive until they are closed. A runtime that is dropped without
``close()`` is therefore never left half-alive with its threads running: when
the facade is collected (by the cyclic garbage collector where the extension
runs: its compiled methods, bound like methods to it, make a cycle through its
``__dict__``), a :class:`ResourceWarning` names it and its parts are
closed on a background thread (closing waits for copies in flight, and a
finalizer must never block); at interpreter exit every runtime still open is
closed. In a forked child every inherited runtime is marked forked, so its
calls refuse with a clear error and nothing touches the device.

Interpreter exit is bounded. The runtimes still open are closed within
``FERRY_EXIT_TIMEOUT`` seconds in all (default 30; ``0`` waits for nothing
that is not already complete; ``inf`` waits as long as it takes; an invalid
value is reported on stderr and the default used). A copy that a hung
producer holds back must not hang the program's exit: when the time passes (or
Ctrl-C interrupts the wait), ferry prints one warning on stderr naming, per
runtime, how many transfers and bytes are still in flight, marks those runtimes
*exited* (nothing touches the device again, nothing is freed: a copy may still
touch that memory) and lets the process exit; the operating system reclaims
the memory.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Protocol

from ._errors import DeviceUnavailableError, RuntimeClosedError
from ._native.objects import HealthFields

if TYPE_CHECKING:
    from ._backends._base import Backend, DeviceError

__all__: list[str] = []


class Health(HealthFields):
    """Why a runtime refuses calls, if it does; shared by all of its parts."""

    __slots__ = ()  # the fields are HealthFields' (closed, exited, forked, poisoned, refusal)

    def __init__(self) -> None:
        self.closed = False
        self.exited = False
        self.forked = False
        self.poisoned: DeviceError | None = None
        self.refusal: str | None = None  # why every call is refused; None while usable

    def _update(self) -> None:
        if self.forked:
            self.refusal = (
                "this runtime was inherited by a forked child process; device state does not "
                "survive fork: create a new ferry.Runtime in the child"
            )
        elif self.exited:
            self.refusal = "the interpreter is exiting and left this runtime's transfers in flight"
        elif self.closed:
            self.refusal = "the runtime is closed"
        elif self.poisoned is not None:
            self.refusal = f"the device context is unusable after a sticky error ({self.poisoned})"
        else:
            self.refusal = None

    def note(self, exc: DeviceError) -> None:
        """Record a device error: a sticky one makes every later call refuse."""
        if exc.sticky and self.poisoned is None:
            self.poisoned = exc
            self._update()

    def mark_closed(self) -> None:
        """The runtime is closed: every later call refuses."""
        self.closed = True
        self._update()

    def mark_forked(self) -> None:
        """This process is a forked child of the one that made the runtime."""
        self.forked = True
        self._update()

    def mark_exited(self) -> None:
        """The interpreter exits with copies in flight: never touch the device or free anything again."""
        self.exited = True
        self._update()

    @property
    def device_usable(self) -> bool:
        """Whether device calls may still be made (not forked, not poisoned, not left at exit)."""
        return not self.forked and not self.exited and self.poisoned is None

    def check_open(self) -> None:
        """Raise :class:`~ferry.RuntimeClosedError` unless the runtime is usable."""
        if self.refusal is not None:
            raise RuntimeClosedError(self.refusal)


class Closable(Protocol):
    """What the registry keeps alive: a runtime's parts, closed once."""

    health: Health

    def close(self, timeout: float | None = None) -> None:
        """Wait for what is in flight (or raise ``TimeoutError``), then free everything; idempotent."""
        ...

    def describe_in_flight(self) -> str:
        """One line: which runtime, how many transfers and bytes are still in flight."""
        ...

    def leave_at_exit(self) -> None:
        """The interpreter exits with copies in flight: mark the runtime exited, and leave what a copy may
        still touch, and the threads that would free it, as they are (never closed, never freed)."""
        ...


_lock = threading.Lock()
_open: dict[int, Closable] = {}


def register(parts: Closable) -> None:
    """Keep ``parts`` alive until :func:`unregister` (called by its close)."""
    with _lock:
        _open[id(parts)] = parts


def unregister(parts: Closable) -> None:
    """``parts`` are closed: forget them."""
    with _lock:
        _open.pop(id(parts), None)


def collected_unclosed(parts: Closable, name: str) -> None:
    """The facade of ``parts`` was collected while open: warn, then close them off-thread.

    Runs from a finalizer: it never blocks and never raises. While the
    interpreter exits no thread is started: the parts are still registered, and
    the exit hook closes them (or says why it could not).
    """
    if parts.health.closed or parts.health.forked:
        return
    try:
        warnings.warn(f"{name} was never closed; closing it now (use `with ferry.Runtime() as rt:`)",
                      ResourceWarning, stacklevel=2)
    except Warning as exc:  # the warning filter made it an error: a finalizer cannot raise it, so print it
        _stderr(f"ferry: {type(exc).__name__}: {exc}\n")
    if _exiting:
        return
    thread = threading.Thread(target=close_reporting, args=(parts, "a runtime that was never closed"),
                              name="ferry-close-unclosed", daemon=True)
    with contextlib.suppress(RuntimeError):  # "can't create new thread at interpreter shutdown": the exit hook
        thread.start()  # closes them


def close_reporting(parts: Closable, what: str) -> None:
    """Close ``parts`` where nobody can catch an error (a background thread): an error is printed on stderr."""
    try:
        parts.close()
    except Exception as exc:
        report(f"closing {what} failed: {exc!r}")


def report(message: str) -> None:
    """One warning line on stderr, where raising cannot reach anyone (a finalizer, a thread, exit)."""
    _stderr(f"ferry: warning: {message}\n")


def exiting() -> bool:
    """Whether the interpreter is exiting (the exit hook runs): no thread may be started any more."""
    return _exiting


def _after_fork_in_child() -> None:
    for parts in list(_open.values()):
        parts.health.mark_forked()
    _open.clear()


EXIT_TIMEOUT = 30.0  # s: the default of FERRY_EXIT_TIMEOUT
_exiting = False  # set by the exit hook: from then on nothing may start a thread (Python 3.12+ refuses)
_left_at_exit: list[Closable] = []  # kept alive to the end: nothing in them is ever freed


def exit_timeout() -> float | None:
    """``FERRY_EXIT_TIMEOUT`` in seconds (``None``: no bound); an invalid value is reported, the default used."""
    raw = os.environ.get("FERRY_EXIT_TIMEOUT", "").strip()
    if not raw:
        return EXIT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        _stderr(f"ferry: FERRY_EXIT_TIMEOUT={raw!r} is not a number of seconds >= 0 (or 'inf'); "
                f"waiting at most {EXIT_TIMEOUT:g} s\n")
        return EXIT_TIMEOUT
    return None if math.isinf(value) else value


def _stderr(text: str) -> None:
    stream = sys.stderr
    if stream is None:  # no stderr (pythonw, or closed by the program): nowhere to say it
        return
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr: nowhere to say it
        stream.write(text)
        stream.flush()


def _close_all_at_exit() -> None:
    global _exiting
    _exiting = True  # the waits below nap instead of starting a watcher thread
    with _lock:
        open_now = list(_open.values())
    if not open_now:
        return
    timeout = exit_timeout()
    deadline = None if timeout is None else time.monotonic() + timeout
    left: list[Closable] = []
    waited = "without a bound" if timeout is None else f"{timeout:g} s"
    for i, parts in enumerate(open_now):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            parts.close(timeout=remaining)
        except TimeoutError:
            left.append(parts)
        except KeyboardInterrupt:  # Ctrl-C while exiting: stop waiting
            left.extend(open_now[i:])
            waited = "until Ctrl-C"
            break
        except Exception as exc:  # a device or internal failure: say so, and leave what is open to the OS
            report(f"closing a runtime at interpreter exit failed: {exc!r}")
            if not parts.health.closed:
                left.append(parts)
    if left:
        give_up(left, waited)


def give_up(left: list[Closable], waited: str) -> None:
    """Leave ``left`` as they are for the OS to reclaim, and say so on stderr."""
    lines = []
    for parts in left:
        try:
            lines.append(f"  {parts.describe_in_flight()}\n")
        except Exception as exc:  # the warning is still given, without this runtime's figures
            lines.append(f"  a runtime whose transfers could not be counted ({exc!r})\n")
        try:
            parts.leave_at_exit()
        except Exception as exc:  # still marked exited: nothing touches the device again
            parts.health.mark_exited()
            report(f"leaving a runtime at interpreter exit failed: {exc!r}")
        _left_at_exit.append(parts)
        unregister(parts)
    _stderr(
        f"ferry: warning: the interpreter is exiting with transfers still in flight after waiting {waited} "
        "(FERRY_EXIT_TIMEOUT); nothing they may touch was freed, the operating system reclaims it:\n"
        + "".join(lines)
    )


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


def make_backend(backend: str, device: int, bandwidth: float, latency: float, peer: bool = True) -> Backend:
    """The backend a runtime runs on: ``"auto"`` (``FERRY_BACKEND`` may force one), ``"cuda"``
    or ``"emulated"``. ``"cuda"`` raises :class:`~ferry.DeviceUnavailableError` with the reason."""
    if backend == "auto":
        backend = os.environ.get("FERRY_BACKEND", "auto")
    if backend not in ("auto", "cuda", "emulated"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'emulated', not {backend!r}")
    if backend in ("auto", "cuda"):
        from ._backends._cuda import CudaBackend

        try:
            return CudaBackend(device)
        except DeviceUnavailableError:
            if backend == "cuda":
                raise
    from ._backends._emulated import EmulatedBackend

    return EmulatedBackend(device, bandwidth=bandwidth, latency=latency, peer=peer)
