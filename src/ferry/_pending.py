"""PendingUpload and PendingDownload: is_ready, wait, and drop -> retirement.

A handle owns a *record*: the event recorded after its copy, the stream, and
the objects the copy touches (moved ones, which are in flight, and leased
ones, the read-leased sources of downloads). The handle is the only way back
to those objects: ``wait()`` returns them once the event proves the copy
complete. A handle dropped without ``wait()`` hands its record to the runtime's
retirement queue (see ``_retire.py``) and nothing else: no blocking, no device
call, nothing freed early.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._errors import FerryError, TransferFailedError

if TYPE_CHECKING:
    from ._backends._base import DeviceError
    from ._device_array import DeviceArray  # noqa: F401
    from ._runtime import Runtime

__all__ = ["PendingUpload", "PendingDownload", "PendingCopy"]


class Record:
    """What one submitted transfer holds until its completion is proven.

    ``moved`` objects are in flight; ``leased`` device arrays are read-leased;
    ``result`` is what ``wait()`` returns. The pinned routes need nothing
    else; everything the other routes add lives in ``extra``.
    """

    __slots__ = (
        "done",
        "error",
        "event",
        "extra",
        "leased",
        "moved",
        "nbytes",
        "result",
        "seq",
        "stream",
    )

    def __init__(
        self,
        seq: int,
        event: Any,
        stream: Any,
        moved: tuple[Any, ...],
        leased: tuple[Any, ...],
        result: tuple[Any, ...],
        nbytes: int,
    ) -> None:
        self.seq = seq
        self.event = event
        self.stream = stream
        self.moved = moved
        self.leased = leased
        self.result = result
        self.nbytes = nbytes
        self.done = False
        self.error: DeviceError | None = None
        self.extra: Extras | None = None

    def __repr__(self) -> str:
        status = "failed" if self.error else "done" if self.done else "pending"
        return f"<transfer record #{self.seq} {self.nbytes} bytes {status}>"


class Extras:
    """What the pageable and registered routes add to a record.

    ``job`` is a staged job whose lanes prove completion (the record then has
    no event); ``blocks`` are pool blocks the copy uses (back to the pool on
    completion, abandoned on failure); ``host`` are the caller's arrays flagged
    read-only for the flight; ``regs`` are registrations the copy uses.
    ``device_touches_host`` is true when the DMA reads or writes the caller's
    array itself (registered route): a failure then keeps the array read-only
    and its registration in use forever. ``batch``/``shared``: see :class:`Batch`
    (a record of a batch shares its event instead of owning one).
    """

    __slots__ = (
        "batch", "blocks", "cross", "device_touches_host", "finish", "handed", "host", "imports", "job", "regs",
        "shared",
    )

    def __init__(self) -> None:
        self.finish: Callable[[], None] | None = None  # runs once on success, before publication
        self.handed: Any = None  # the destination an upload handed off before completing
        self.imports: list[Any] = []  # consumed DLPack capsules: deleters run once settled
        self.cross: list[Any] = []  # (runtime, array): read leases held in another runtime
        self.job: Any = None
        self.batch: Batch | None = None  # open batch whose shared event is not recorded yet
        self.shared: SharedEvent | None = None  # the event this record shares with its batch
        self.blocks: list[Any] = []
        self.host: list[Any] = []
        self.regs: list[Any] = []
        self.device_touches_host = False


class SharedEvent:
    """One event recorded for several records; back to the pool after the last one."""

    __slots__ = ("done", "event", "users")

    def __init__(self, event: Any, users: int) -> None:
        self.event = event
        self.users = users
        self.done = False  # proven complete once: the other records need not ask again


class Batch:
    """Transfers submitted inside ``with rt.batch():`` on one thread.

    Their copies are enqueued at once, but no per-transfer event is recorded:
    each copy stream's records wait in a *segment*, and one event is recorded
    for the whole segment when the block exits, or earlier when one of its
    records is polled or waited (the segment is then closed and later
    submissions start a new one). A shared event proves completion of every
    copy enqueued before it on that stream, which is all its records.
    """

    __slots__ = ("depth", "segments")

    def __init__(self) -> None:
        self.segments: dict[int, tuple[Any, list[Record]]] = {}
        self.depth = 0


_Result = TypeVar("_Result")


class _Pending(Generic[_Result]):
    __slots__ = ("__weakref__", "_claimed", "_future", "_record", "_runtime", "_waited")

    def __init__(self, runtime: Runtime, record: Record) -> None:
        self._runtime = runtime
        self._record = record
        self._waited = False  # the record was settled (by wait() or by the watcher)
        self._claimed = False  # wait() returned (or raised) to the caller: at most once
        self._future: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes this transfer copies."""
        return self._record.nbytes

    def is_ready(self) -> bool:
        """Whether the copy has completed. Never blocks.

        Returns ``False`` while the copy runs and ``True`` once it completed
        (also after ``wait()``). A device error is never reported as "not
        ready": it raises :class:`~ferry.TransferFailedError`, and the
        transfer's objects are abandoned.
        """
        if self._waited:
            return True
        return self._runtime._poll_record(self._record)

    def wait(self) -> _Result:
        """Block until the copy completed, then hand back what was handed in.

        Guarantee: when it returns, the copy is complete (the destination holds
        the bytes) and every returned object is owned again and may be reused.

        Raises
        ------
        TransferFailedError
            The device reported a failure: nothing is published, the objects
            stay abandoned forever.
        FerryError
            The handle was already waited (a handle is waited at most once), or
            the runtime was closed.
        """
        if self._claimed:
            raise FerryError("this transfer was already waited; a handle is waited at most once")
        future = self._future
        if future is not None and not future.cancelled():
            result = future.result()  # the watcher performs the one wait
        else:
            result = self._runtime._wait_record(self._record)
        self._waited = self._claimed = True
        return result  # type: ignore[no-any-return]

    def future(self) -> concurrent.futures.Future[_Result]:
        """A :class:`concurrent.futures.Future` resolved with what ``wait()`` returns.

        The runtime's watcher (one per runtime, sleeping until the device
        reports completion, never polling) performs the wait and resolves the
        future, or sets its :class:`~ferry.TransferFailedError`. Calling
        ``wait()`` afterwards returns the same result. The same future is
        returned on every call. Cancelling the future never cancels or frees
        the copy: the handle is released, and retires like any dropped handle.
        """
        if self._future is None:
            if self._claimed:
                raise FerryError("this transfer was already waited; there is nothing left to wait for")
            self._future = self._runtime._watch(self)
        return self._future  # type: ignore[no-any-return]

    def add_done_callback(self, fn: Callable[[_Pending[_Result]], object]) -> None:
        """Call ``fn(handle)`` once the transfer completed or failed.

        The callback runs on the watcher's thread (or at once, if the transfer
        is already resolved); inside it, ``handle.wait()`` returns (or raises)
        without blocking.
        """
        self.future().add_done_callback(lambda _future: fn(self))

    def __await__(self) -> Generator[Any, None, _Result]:
        """``await handle`` in asyncio: the result of ``wait()``, without blocking the loop."""
        import asyncio

        return asyncio.wrap_future(self.future()).__await__()

    def __del__(self) -> None:
        # Never blocks, never calls the device: detach the record, nothing more.
        if self._waited or sys.is_finalizing():
            return
        with contextlib.suppress(Exception):  # a finalizer never raises
            self._runtime._detach(self._record)

    def __repr__(self) -> str:
        status = "waited" if self._waited else repr(self._record)
        return f"<{type(self).__name__} {status}>"


class PendingUpload(_Pending["tuple[Any, DeviceArray]"]):
    """A host-to-device copy in flight.

    ``wait()`` returns ``(buffer, destination)``: the host side (the pinned
    buffer of :meth:`~ferry.Runtime.upload_pending`, or the NumPy array of
    :meth:`~ferry.Runtime.upload`) and the device array it was copied into,
    both owned (and writable) again.
    """

    __slots__ = ()

    def hand_off(self, stream: Any = None) -> Any:
        """Hand the destination to GPU work before the copy is known complete, with no host wait.

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

        Staged pageable uploads (``rt.upload`` of more than
        ``StagingConfig.direct_bytes``) cannot be handed off: their bytes
        arrive over several streams; wait for them instead.
        """
        return self._runtime._hand_off(self, stream)


class PendingDownload(_Pending["tuple[DeviceArray, Any]"]):
    """A device-to-host copy in flight.

    ``wait()`` returns ``(source, buffer)``: the device array that was read
    (read-leased until then) and the host side that now holds its bytes (the
    pinned buffer of :meth:`~ferry.Runtime.download_pending`, or the NumPy
    array of :meth:`~ferry.Runtime.download`).
    """

    __slots__ = ()


class PendingCopy(_Pending["tuple[DeviceArray, DeviceArray]"]):
    """A device-to-device copy in flight (see :meth:`~ferry.Runtime.copy_pending`).

    ``wait()`` returns ``(source, destination)``: the source was read-leased,
    the destination in flight; both are owned again.
    """

    __slots__ = ()


def failed_error(record: Record) -> TransferFailedError:
    """The error ``is_ready``/``wait`` raise for a failed record."""
    return TransferFailedError(
        f"the transfer of {record.nbytes} bytes failed on the device ({record.error}); "
        "nothing was published and its buffers are abandoned"
    )
