"""The handles: PendingUpload, PendingDownload and PendingCopy.

A handle is thin: it holds one *record* (see ``_completion.py``) and asks the
runtime's completion part about it, through the narrow
:class:`~ferry._completion.CompletionPort`. The handle is the only way back
to the objects a transfer took: ``wait()`` returns them once completion is
proven. A handle dropped without ``wait()`` hands its record to the
retirement queue (see ``_retire.py``) and nothing else: no blocking, no
device call, nothing freed early.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _native
from ._errors import FerryError

if TYPE_CHECKING:
    from ._completion import CompletionPort
    from ._device_array import DeviceArray  # noqa: F401
    from ._records import Record

__all__ = ["Pending", "PendingUpload", "PendingDownload", "PendingCopy"]


Result = TypeVar("Result")
Host = TypeVar("Host")
Device = TypeVar("Device")
Source = TypeVar("Source")
# The host array a pageable upload hands back: a NumPy array, or a CPU array of another library (a PyTorch
# tensor, anything exporting DLPack or the buffer protocol), so it is not bound; the facade checks it at run time.
HostArray = TypeVar("HostArray")


class _PyHandle:
    """The pure-Python twin of the compiled ``Handle`` (``_native/records.c``): a handle's fields, ``wait()``
    and its finalizer. :class:`Pending` derives from the compiled one where the extension runs."""

    __slots__ = ("_claimed", "_future", "_port", "_record", "_waited")

    def __init__(self, port: CompletionPort, record: Record) -> None:
        self._port = port
        self._record = record
        self._waited = False  # the record was settled (by wait() or by the watcher)
        self._claimed = False  # wait() returned (or raised) to the caller: at most once
        self._future: Any = None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the copy completed, then hand back what was handed in (at most once; the whole
        contract is in :meth:`Pending.wait`'s documentation)."""
        if self._claimed:
            raise FerryError("this transfer was already waited; a handle is waited at most once")
        result = self._port.wait(self._record, timeout)
        self._waited = self._claimed = True
        return result

    def __del__(self) -> None:
        # Never blocks, never calls the device: detach the record, nothing more.
        if self._waited or sys.is_finalizing():
            return
        with contextlib.suppress(Exception):  # a finalizer never raises
            self._port.detach(self._record)


_engine = _native.load()
if TYPE_CHECKING or _engine is None:
    _Handle = _PyHandle
else:  # the same fields and calls, made in C: no Python __init__, wait() or __del__ per transfer
    _Handle = _engine.Handle
    _engine.set_handle_errors(FerryError)


class Pending(_Handle, Generic[Result]):
    """The base of every transfer handle: ``wait()`` returns a ``Result``.

    Use it in annotations (``list[ferry.Pending[Any]]``); handles come from
    the runtime's submissions, never from this constructor.
    """

    __slots__ = ("__weakref__",)

    @property
    def nbytes(self) -> int:
        """Bytes this transfer copies."""
        return self._record.nbytes

    def is_ready(self) -> bool:
        """Whether the copy has completed. Never blocks.

        Returns ``False`` while the copy runs and ``True`` once it completed
        (also after ``wait()``). A device error is never reported as "not
        ready": it raises, and the transfer's objects are abandoned.

        Raises
        ------
        TransferFailedError
            The device reported a failure for this transfer.
        RuntimeClosedError
            The runtime was closed before the transfer was waited, or is
            unusable (a forked child, a sticky device error).
        """
        if self._waited:
            return True
        return self._port.poll(self._record)

    if TYPE_CHECKING:  # at run time the base class's wait() runs (compiled where the extension is)
        def wait(self, timeout: float | None = None) -> Result:
            """Block until the copy completed, then hand back what was handed in.

            Guarantee: when it returns, the copy is complete (the destination holds
            the bytes) and every returned object is owned again and may be reused.

            The wait is bounded by ``timeout`` seconds (``None``: no bound; ``0``:
            a poll) and can be interrupted: Ctrl-C raises ``KeyboardInterrupt`` in
            the main thread within milliseconds. A wait that times out or is
            interrupted changes nothing: the handle stays pending (wait again,
            poll :meth:`is_ready`, or drop it: it retires as usual). A copy that
            completes on time is noticed as fast as ``cuEventSynchronize`` would:
            the wait spins on its event about as long as the copy should take,
            then sleeps until the device signals.

            Racing :meth:`Runtime.close() <ferry.Runtime.close>` from another
            thread: a ``wait()`` that began before ``close()`` committed returns
            the result (``close()`` first waits for the copy; the runtime's
            pinned buffers and device arrays in it are then closed with the
            runtime, while host arrays you own keep the bytes). A ``wait()``
            begun after raises :class:`~ferry.RuntimeClosedError`.

            Raises
            ------
            TimeoutError
                ``timeout`` seconds passed first (the builtin exception).
            ValueError
                ``timeout`` is negative or NaN; nothing changed.
            TransferFailedError
                The device reported a failure: nothing is published, the objects
                stay abandoned forever.
            FerryError
                The handle was already waited (a handle is waited at most once), or
                the runtime was closed (:class:`~ferry.RuntimeClosedError`).
            """
            return super().wait(timeout)  # type: ignore[no-any-return]

    def future(self) -> concurrent.futures.Future[Result]:
        """A :class:`concurrent.futures.Future` resolved with what ``wait()`` returns.

        The runtime's watcher (one per runtime, sleeping until the device
        reports completion, never polling) settles the transfer and resolves
        the future, or sets its :class:`~ferry.TransferFailedError`. Calling
        ``wait()`` afterwards returns the same result. The same future is
        returned on every call until it is cancelled; after that a new one.
        Cancelling a future never cancels or frees the copy and never
        affects any other waiter (``wait()``, :func:`~ferry.wait_all`,
        :func:`~ferry.as_completed`, other futures, ``await``): the handle is
        released by that future, and retires like any dropped handle once
        nothing else holds it.
        """
        future = self._future
        if future is None or future.cancelled():
            future = self._future = self._port.watch(self)
        return future  # type: ignore[no-any-return]

    def add_done_callback(self, fn: Callable[[Pending[Result]], object]) -> None:
        """Call ``fn(handle)`` once the transfer completed or failed.

        The callback runs on the watcher's thread (or at once, if the transfer
        is already resolved); inside it, ``handle.wait()`` returns (or raises)
        without blocking. It has a future of its own: cancelling
        :meth:`future` does not stop it.
        """
        self._port.watch(self).add_done_callback(lambda _future: fn(self))

    def __await__(self) -> Generator[Any, None, Result]:
        """``await handle`` in asyncio: the result of ``wait()``, without blocking the loop.

        Each ``await`` has a future of its own, so a cancelled task (or an
        ``asyncio.wait_for`` that timed out) gives up only its own wait.
        """
        import asyncio

        return asyncio.wrap_future(self._port.watch(self)).__await__()

    def __repr__(self) -> str:
        status = "waited" if self._waited else repr(self._record)
        return f"<{type(self).__name__} {status}>"


_Pending = Pending  # the name the rest of ferry uses


class PendingUpload(Pending[tuple[Host, Device]], Generic[Host, Device]):
    """A host-to-device copy in flight.

    ``wait()`` returns ``(buffer, destination)``: the host side (the pinned
    buffer of :meth:`~ferry.Runtime.upload_pending`, or the NumPy array of
    :meth:`~ferry.Runtime.upload`) and the device array it was copied into,
    both owned (and writable) again.
    """

    __slots__ = ()

    def hand_off(self, stream: Any = None) -> Device:
        """Hand the destination to GPU work before the copy is known complete (the host does not
        wait for the copy; a staged upload: only for its host copies).

        With ``stream`` (an int handle, a ``torch.cuda.Stream``, a
        ``cupy.cuda.Stream``, or anything with ``__cuda_stream__``), that
        stream waits for the copy on the device (``cuStreamWaitEvent``), so
        kernels launched there afterwards see the bytes; like PyTorch's
        ``Stream.wait_event``. In every case the returned destination is
        usable at once: ferry's own later transfers involving it are ordered
        after the copy on the device, and its CUDA Array Interface names
        ferry's copy stream until the copy is waited, so protocol-honouring
        consumers order themselves too. The pinned buffer stays in flight
        until ``wait()``, which still returns ``(buffer, destination)``.

        A staged pageable upload (``rt.upload`` of more than
        ``StagingConfig.direct_bytes``) is handed off when the native engine
        runs it: the stream waits for the event each staging lane recorded
        after its last DMA, and the host waits only until the lanes have
        enqueued those (its host copies are done). With the pure-Python
        engine it raises
        :class:`~ferry.FerryError`: wait for it.
        """
        destination: Device = self._port.hand_off(self, stream)
        return destination


class PendingDownload(Pending[tuple[Source, Host]], Generic[Source, Host]):
    """A device-to-host copy in flight.

    ``wait()`` returns ``(source, buffer)``: the device array that was read
    (read-leased until then) and the host side that now holds its bytes (the
    pinned buffer of :meth:`~ferry.Runtime.download_pending`, or the NumPy
    array of :meth:`~ferry.Runtime.download`).
    """

    __slots__ = ()


class PendingCopy(Pending["tuple[DeviceArray, DeviceArray]"]):
    """A device-to-device copy in flight (see :meth:`~ferry.Runtime.copy_pending`).

    ``wait()`` returns ``(source, destination)``: the source was read-leased,
    the destination in flight; both are owned again.
    """

    __slots__ = ()
