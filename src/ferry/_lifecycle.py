"""Lifecycle: a runtime's health, the registry of live runtimes, interpreter exit and fork.

A runtime is usable until one of three things happens, and :class:`Health`
records which: it was closed; it was inherited by a forked child (device state
does not survive ``fork``: the child must never touch the parent's streams,
memory or threads); or the device reported a sticky error (the context is
unusable). Every part of a runtime reads the same :class:`Health`, so one
refusal message answers every later call.

The registry keeps every runtime's *parts* (not the :class:`~ferry.Runtime`
facade) alive until they are closed. A runtime that is dropped without
``close()`` is therefore never left half-alive with its threads running: when
the facade is collected, a :class:`ResourceWarning` names it and its parts are
closed on a background thread (closing waits for copies in flight, and a
finalizer must never block); at interpreter exit every runtime still open is
closed. In a forked child every inherited runtime is marked forked, so its
calls refuse with a clear error and nothing touches the device.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import warnings
from typing import TYPE_CHECKING, Protocol

from ._errors import DeviceUnavailableError, RuntimeClosedError

if TYPE_CHECKING:
    from ._backends._base import Backend, DeviceError

__all__: list[str] = []


class Health:
    """Why a runtime refuses calls, if it does; shared by all of its parts."""

    __slots__ = ("closed", "forked", "poisoned", "refusal")

    def __init__(self) -> None:
        self.closed = False
        self.forked = False
        self.poisoned: DeviceError | None = None
        self.refusal: str | None = None  # why every call is refused; None while usable

    def _update(self) -> None:
        if self.forked:
            self.refusal = (
                "this runtime was inherited by a forked child process; device state does not "
                "survive fork: create a new ferry.Runtime in the child"
            )
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

    @property
    def device_usable(self) -> bool:
        """Whether device calls may still be made (not forked, not poisoned)."""
        return not self.forked and self.poisoned is None

    def check_open(self) -> None:
        """Raise :class:`~ferry.RuntimeClosedError` unless the runtime is usable."""
        if self.refusal is not None:
            raise RuntimeClosedError(self.refusal)


class Closable(Protocol):
    """What the registry keeps alive: a runtime's parts, closed once."""

    health: Health

    def close(self) -> None:
        """Wait for what is in flight, then free everything; idempotent."""
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

    Runs from a finalizer: it never blocks and never raises.
    """
    if parts.health.closed or parts.health.forked:
        return
    with contextlib.suppress(Exception):
        warnings.warn(f"{name} was never closed; closing it now (use `with ferry.Runtime() as rt:`)",
                      ResourceWarning, stacklevel=2)
    thread = threading.Thread(target=_close_quietly, args=(parts,), name="ferry-close-unclosed", daemon=True)
    thread.start()


def _close_quietly(parts: Closable) -> None:
    with contextlib.suppress(Exception):
        parts.close()


def _after_fork_in_child() -> None:
    for parts in list(_open.values()):
        parts.health.mark_forked()
    _open.clear()


def _close_all_at_exit() -> None:
    with _lock:
        open_now = list(_open.values())
    for parts in open_now:
        with contextlib.suppress(Exception):  # interpreter exit must not fail
            parts.close()


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
