"""Waiting the Python way: ``wait_all`` and ``as_completed`` (futures, callbacks and ``await`` are the
handles', in ``_pending.py``; the watcher that resolves them is in ``_watcher.py``).

Every record that someone sleeps on has one :class:`~ferry._records.Signal`: a flag set once
the copy is proven complete or failed, and listeners run once after that.
Waiters never share anything else. ``wait()``, ``wait_all`` and
``as_completed`` sleep on the flag (a lock wait: timeouts are honoured and
``KeyboardInterrupt`` reaches the main thread at once); each future is a
listener of its own. So a waiter that gives up (a timeout, an interrupt, a
cancelled future or asyncio task) takes nothing from the others: the signal
still fires, and every other waiter sees it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ._args import timeout_arg

if TYPE_CHECKING:
    from ._pending import Pending

__all__ = ["wait_all", "as_completed"]

Result = TypeVar("Result")
Handle = TypeVar("Handle", bound="Pending[Any]")

_SLICE = 0.05  # s: sleeping waits wake this often, so a signal delivered to another thread is seen


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(timeout, 0.0)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait_all(handles: Iterable[Pending[Result]], timeout: float | None = None) -> list[Result]:
    """Wait for every handle; return their ``wait()`` results in the order given.

    Each handle is waited as by ``wait()`` (it is then waited: a second
    ``wait()`` raises). The wait is bounded by ``timeout`` and interruptible
    (Ctrl-C); futures of the handles, cancelled or not, play no part.

    Raises
    ------
    TimeoutError
        Some transfers were not complete after ``timeout`` seconds; every
        handle is left as it was (pending handles can be waited later).
    ValueError
        ``timeout`` is negative or NaN; nothing changed.
    TransferFailedError
        The first failed transfer, in the order given; the handles after it
        are left unwaited.
    KeyboardInterrupt
        Raised by Ctrl-C while waiting; every handle is left as it was.
    """
    timeout = timeout_arg(timeout)
    handles = list(handles)
    deadline = _deadline(timeout)
    attended = []
    try:
        for handle in handles:
            handle._port.attend(handle._record, 1)
            attended.append(handle)
        spin = True
        for i, handle in enumerate(handles):
            if handle._waited:
                continue
            if not handle._port.ready(handle._record, _left(deadline), spin=spin):
                late = 1 + sum(not h._port.ready(h._record, 0, spin=False) for h in handles[i + 1:])
                raise TimeoutError(f"{late} of {len(handles)} transfers were not complete after {timeout} s")
            spin = False
        return [h.wait() for h in handles]
    finally:
        for handle in attended:
            handle._port.attend(handle._record, -1)


def as_completed(handles: Iterable[Handle], timeout: float | None = None) -> Iterator[Handle]:
    """Yield the handles as their transfers complete or fail (``wait()`` on each then returns at once).

    Each handle is yielded once, whatever became of its futures. Raises the
    builtin ``TimeoutError`` if ``timeout`` seconds pass (from the first
    ``next()``) before every transfer completed; the handles not yet yielded
    are left as they were. Interruptible (Ctrl-C). A negative or NaN ``timeout`` raises
    ``ValueError`` at the call.
    """
    return _as_completed(handles, timeout_arg(timeout))


def _as_completed(handles: Iterable[Handle], timeout: float | None) -> Iterator[Handle]:
    unique = list({id(h): h for h in handles}.values())
    deadline = _deadline(timeout)
    arrived: deque[Handle] = deque()
    cond = threading.Condition()
    listeners: list[tuple[Handle, Callable[[], object]]] = []

    def listener(handle: Handle) -> Callable[[], object]:
        def fire() -> None:
            with cond:
                arrived.append(handle)
                cond.notify()

        return fire

    try:
        for handle in unique:
            fn = listener(handle)
            listeners.append((handle, fn))
            if handle._waited:
                fn()
            else:
                handle._port.listen(handle._record, fn)
        for done in range(len(unique)):
            with cond:
                while not arrived:
                    left = _left(deadline)
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"{len(unique) - done} of {len(unique)} transfers were not complete after {timeout} s"
                        )
                    cond.wait(_SLICE if left is None else min(left, _SLICE))
                handle = arrived.popleft()
            yield handle
    finally:
        for handle, fn in listeners:
            handle._port.unlisten(handle._record, fn)
