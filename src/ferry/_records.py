"""Records: what one submitted transfer holds until its completion is proven, and what waits on it.

A :class:`Record` carries the event recorded after its copy (or a staged
job, or a batch's shared event), the stream, and the objects the copy
touches; the routes beyond the pinned one add :class:`Extras`; a record
submitted inside ``rt.batch()`` waits in a :class:`Segment` of its
:class:`Batch` until the segment is flushed. Every record that someone
sleeps on has one :class:`Signal`. These are the data; the rules that move a
record from submission to its outcome (settle, fail, retire) are
``_completion.py``'s, and the thread that sets the signals is
``_watcher.py``'s.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

from . import _native
from ._backends._base import DeviceError
from ._errors import TransferFailedError

__all__: list[str] = []


class Record:
    """What one submitted transfer holds until its completion is proven.

    ``moved`` objects are in flight; ``leased`` device arrays are read-leased;
    ``result`` is what ``wait()`` returns. The pinned routes need nothing
    else; everything the other routes add lives in ``extra``. A record
    submitted inside ``rt.batch()`` has ``batch`` (its open :class:`Segment`)
    until the segment is flushed, then ``shared`` (the segment's
    :class:`SharedEvent`, also its ``event``).
    """

    __slots__ = (
        "batch", "claimed", "done", "error", "event", "extra", "leased", "moved", "napped", "nbytes", "result",
        "seq", "settled", "shared", "signal", "spun", "stream", "waiters",
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
        self.done = False  # the copy is proven complete
        self.error: DeviceError | None = None
        self.extra: Extras | None = None
        self.settled = False  # published, objects owned again (by a wait() or the watcher for a future)
        self.claimed = False  # a wait() returned the result: at most once
        self.waiters = 0  # wait() calls and unresolved futures attending the record
        self.spun = False  # a wait spun its full budget on it: later waits sleep at once
        self.napped: float = 0  # s: how long waits napped on it (at most NAP_WINDOW over all of them)
        self.signal: Signal | None = None  # created by the first wait that sleeps, or a future
        self.batch: Segment | None = None  # the open batch segment it waits in (no copy enqueued yet)
        self.shared: SharedEvent | None = None  # its flushed segment's event

    def __repr__(self) -> str:
        status = "failed" if self.error else "done" if self.done else "pending"
        return f"<transfer record #{self.seq} {self.nbytes} bytes {status}>"


_engine = _native.load()
new_record: Callable[[int, Any, Any, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], int], Record] = (
    cast(Any, _engine).new_record if _engine is not None else Record
)
"""Make a :class:`Record`: the compiled twin where the extension runs (an allocation instead of a Python
``__init__`` per transfer: same fields, same defaults), else the class above."""


class Signal:
    """Set once a record's copy is proven complete or failed; listeners run once, after that."""

    __slots__ = ("_listeners", "_lock", "fired", "flag")

    def __init__(self) -> None:
        self.flag = threading.Event()  # the copy is resolved: waiters may settle or claim
        self.fired = False  # the listeners ran (on the watcher's thread)
        self._listeners: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def listen(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once fired: later on the watcher's thread, or now if it already fired."""
        with self._lock:
            if not self.fired:
                self._listeners.append(fn)
                return
        fn()

    def unlisten(self, fn: Callable[[], object]) -> None:
        """Forget ``fn`` if it has not been called."""
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    def fire(self) -> None:
        """The record is resolved: set the flag, run every listener once (never raises)."""
        self.flag.set()
        with self._lock:
            self.fired = True
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            with contextlib.suppress(Exception):
                fn()


class Job(Protocol):
    """A transfer whose completion worker threads prove (staged routes): no event of its own."""

    error: DeviceError | None

    def is_done(self) -> bool:
        """Whether every part of the job finished (its DMAs complete). Never blocks."""
        ...

    def wait_done(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Block until done or ``timeout`` seconds passed; return whether it is done.

        ``poll=False``: sleep at once (a background waiter); a job that may poll before it
        sleeps (the compiled engine's, on a roomy machine) does not."""
        ...


class Extras:
    """What the routes beyond the pinned one add to a record.

    ``finish`` publishes on success (a download's copy-out from pinned
    memory); ``progress`` (a segmented download's) copies out the parts
    whose DMA completed while a waiter waits, without the runtime's lock.
    ``cleanups`` run once when the record leaves flight, with ``failed``
    telling how: a route gives pool blocks back (or abandons them),
    restores the caller's array flags, ends registration uses, releases
    consumed DLPack capsules. ``job`` is a staged job whose workers prove
    completion (the record then has no event). ``handed`` is the destination
    an upload handed off before completing.
    """

    __slots__ = ("cleanups", "export_stream", "finish", "handed", "job", "order_after", "progress", "ready_to_order")

    own_event = False  # True in a subclass whose records are proven by their own event alone (wait() inline)

    def release(self, failed: bool) -> None:
        """What an ``own_event`` subclass does when its record leaves flight (its ``cleanups`` in one call)."""
        raise NotImplementedError

    def __init__(self) -> None:
        self.finish: Callable[[], None] | None = None
        # a segmented download's: publish the parts that landed, waiting for each until a deadline
        self.progress: Callable[[float | None], None] | None = None
        self.cleanups: list[Callable[[bool], None]] = []
        self.job: Job | None = None
        self.handed: Any = None
        self.order_after: Callable[[Any], None] | None = None  # a job's: make a stream wait for all of it
        self.export_stream: Any = None  # a job's: the stream an export names once it waited for the job
        # a job's: sleep, without the runtime's lock, until order_after would not wait on the host
        self.ready_to_order: Callable[[], None] | None = None


class SharedEvent:
    """One event recorded for several records; back to the pool after the last one."""

    __slots__ = ("done", "event", "users")

    def __init__(self, event: Any, users: int) -> None:
        self.event = event
        self.users = users
        self.done = False  # proven complete once: the other records need not ask again


class Run:
    """Consecutive copies of one kind in a segment, no destination twice: one device batch at the flush."""

    __slots__ = ("copy", "dsts", "seen", "sizes", "srcs")

    def __init__(self, copy: Callable[[int, int, int, Any, Any], None]) -> None:
        self.copy = copy
        self.dsts: list[int] = []
        self.srcs: list[int] = []
        self.sizes: list[int] = []
        self.seen: set[int] = set()


class Segment:
    """One copy stream's open part of a batch: its records and their copies (in runs), not yet enqueued."""

    __slots__ = ("batch", "key", "last", "records", "runs", "stream")

    def __init__(self, batch: Batch, stream: Any) -> None:
        self.batch = batch
        self.key = id(stream)
        self.stream = stream
        self.records: list[Record] = []
        self.runs: list[Run] = []
        self.last: Run | None = None

    def new_run(self, copy: Callable[[int, int, int, Any, Any], None]) -> Run:
        """Start a run (another kind of copy, or a destination this run already writes)."""
        run = self.last = Run(copy)
        self.runs.append(run)
        return run


class Batch:
    """Transfers submitted inside ``with rt.batch():`` on one thread.

    A submission inside the block does its checks and moves ownership at
    once, but its copy is not enqueued yet: each copy stream's records and
    copies wait in a *segment*. A segment is *flushed* when the block exits,
    or earlier when one of its records is polled, waited or handed off, or
    when a submission finds it holding :data:`SEGMENT_COPIES` copies (so the
    device works on the first copies while the caller submits the rest): its
    copies are enqueued together (``Backend.copy_batch``: one
    ``cuMemcpyBatchAsync`` per run of same-direction copies on CUDA) and one
    event is recorded behind them, shared by the segment's records; later
    submissions start a new segment. The copies start then, not at submission.
    A shared event proves completion of every copy enqueued before it on that
    stream, which is all its records. Copies of one segment may run in any
    order among themselves: ferry's ownership rules keep two pending copies
    from touching the same bytes where one writes (a destination is in flight
    until waited), and a destination address that repeats in a segment (two
    views of foreign memory) starts a new device batch, which is ordered
    after the previous one.
    """

    __slots__ = ("depth", "segments")

    def __init__(self) -> None:
        self.segments: dict[int, Segment] = {}
        self.depth = 0


def failed_error(record: Record) -> TransferFailedError:
    """The error ``is_ready``/``wait`` raise for a failed record."""
    return TransferFailedError(
        f"the transfer of {record.nbytes} bytes failed on the device ({record.error}); "
        "nothing was published and its buffers are abandoned"
    )
