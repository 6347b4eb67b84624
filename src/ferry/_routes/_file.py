"""The file route: bytes between a file and device memory through pinned slots, no mmap.

The problem
-----------
A checkpoint load read through ``mmap`` pays a page fault per page on the
copy's path, and a load through ``read()`` into pageable memory pays a host
copy into pinned memory before the DMA. The kernel can instead write a
``pread`` straight into pinned memory: one copy (page cache -> slot, or the
disk's DMA with ``O_DIRECT``), then the slot's DMA to the device.

The shape
---------
A transfer is a :class:`FilePlan`: pieces ``(file offset, bytes, device
address)`` sorted by file offset. Pieces close together in the file are read
as one *run*, and each run is cut into *chunks* of at most one slot at
aligned file offsets, so a file of many tensors is read in one pass of large
sequential reads and each chunk's DMAs scatter its bytes to the tensors they
belong to (the file is never read twice and nothing is copied again on the
device).

A :class:`FileJob` runs on ``readers`` of the runtime's :class:`ReaderPool`
(threads made on first use, each with its own copy stream and one event per
slot, kept until the runtime closes) with ``SLOTS_PER_READER`` pinned slots
per reader from the runtime's pinned pool (read-ahead is bounded by
``readers * SLOTS_PER_READER`` slots). A reader claims the next chunk from
one counter (reads stay nearly sequential), waits until the slot's previous
DMA completed (its event), fills the slot from the file (:func:`fill_slot`:
``os.preadv``, which releases the GIL), enqueues the slot's DMAs and records
the slot's event at once. Saving runs the mirror: claim, DMA device -> slot,
wait for the event, :func:`drain_slot` (``os.pwritev``). Many reads are in
flight at once; a job is complete when every reader synchronized its slots.

``fill_slot`` and ``drain_slot`` are the one seam between the file and the
slots of the reader threads, the pure-Python engine's path.

The compiled engine
-------------------
Where the runtime's staging engine is the compiled one, a transfer is a
:class:`NativeFileJob` instead: the same plan, cut into chunks of one of the
lanes' slots (``StagingConfig.slot_bytes``), handed to the direction's engine
as a file job (``_native/core/file.c``). Its lanes claim chunks from one
counter, ``pread`` each straight into their next slot and enqueue its DMAs
(downloads: DMAs into the slot, wait, ``pwrite``), with no Python thread and
no GIL on the data path; read-ahead is bounded by the lanes' slots. The
descriptors stay open until the job is done; errors are reported as
:class:`FileReadError` (the file's side, with the errno) or a
:class:`~ferry._backends._base.DeviceError`, as here; a lane that meets
either gives its slots up for fresh ones, as after a failed staged DMA.

``O_DIRECT``
------------
With ``direct=True`` reads bypass the page cache: the file is opened again
with ``O_DIRECT``, chunks start at 4096-aligned offsets, their lengths are
rounded up to 4096 and each slot's data starts at a 4096-aligned address.
``direct=None`` (the default) reads through the page cache unless the file's
pages in the plan's range are mostly not resident (``mincore`` over a
mapping that is never touched: no page faults) or the environment variable
``FERRY_FILE_DIRECT`` is ``1``; ``FERRY_FILE_DIRECT=0`` forces buffered
reads. A filesystem that refuses ``O_DIRECT`` (``EINVAL`` at open or at a
read, as tmpfs does) gets buffered reads instead, silently. Writes are
buffered unless ``direct=True``; then aligned chunks go through ``O_DIRECT``
and an unaligned tail through the page cache.

Failures
--------
A read that fails, or that ends before the bytes it needs (the file was
truncated), fails the job with an error naming the file, the byte offset and
the piece's label (a tensor's name); the remaining chunks are skipped. A DMA
or event failure fails it too; slots a failed DMA may still touch are
abandoned (never given back to the pool, counted), slots whose DMAs were all
proven complete go back to the pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .._backends._base import DeviceError
from .._errors import TransferSubmitError
from .._interop._foreign import device_side, give_back, order_before, release_import
from .._pending import PendingDownload, PendingUpload
from .._state import IN_FLIGHT
from ._base import RuntimeParts

if TYPE_CHECKING:
    from .._backends._base import Backend
    from .._device_array import DeviceArray
    from .._memory._pinned import PinnedPool
    from ._staged import StagedRoute, StagingConfig

__all__: list[str] = []


class Parts(RuntimeParts, Protocol):
    """One runtime's parts as the file route sees them (``_parts.Parts``, which sits above)."""

    @property
    def pool(self) -> PinnedPool:
        """The runtime's pinned pool (the readers' slots)."""
        ...

    @property
    def h2d(self) -> Any:
        """The runtime's upload stream (a foreign array's DLPack producer is ordered before it)."""
        ...

    @property
    def readers(self) -> ReaderPool:
        """The runtime's file readers (threads, streams, events; made on first use)."""
        ...

    @property
    def staging(self) -> StagingConfig:
        """The runtime's staging config (which engine runs, its lanes' slots)."""
        ...

    @property
    def staged(self) -> StagedRoute:
        """The runtime's staged route: its engines run file jobs where they are the compiled ones."""
        ...

ALIGN = 4096
"""File offsets, lengths and slot addresses of ``O_DIRECT`` reads are multiples of this."""

SLOT_BYTES = 16 << 20
"""The pinned slot a reader fills per read (16 MiB: 12 threads reading into such buffers moved
43.5 GB/s from a warm page cache on an H200 machine)."""

SLOTS_PER_READER = 2
"""Slots per reader thread: one being filled while the other's DMA runs."""

MAX_READERS = 12
"""Reader threads per job at most (fewer for small plans, and for reads through the page cache on a
machine with fewer CPUs: those copy; ``O_DIRECT`` reads wait on the disk and always get this many)."""

RUN_GAP = 1 << 20
"""Pieces closer than this in the file are read as one run (the gap is read and dropped)."""

MAX_FILE_OFFSET = (1 << 63) - 1
"""The largest byte offset a file can have (``off_t``): a transfer that would run past it is refused."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def default_readers() -> int:
    """Reader threads a job runs: ``MAX_READERS`` capped at the machine's CPUs, at least 2."""
    return max(2, min(MAX_READERS, os.cpu_count() or 2))


class FileReadError(DeviceError):
    """A file transfer failed on the host side (read, write or short read); not a device error."""


# -- plans ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Piece:
    """``nbytes`` bytes at ``offset`` in the file <-> device address ``ptr``; ``label`` names it."""

    offset: int
    nbytes: int
    ptr: int
    label: str = ""


@dataclass(slots=True)
class Chunk:
    """One slot's worth: read (or write) ``length`` bytes at file offset ``start``; ``need`` of
    them must arrive; ``dmas`` are ``(slot offset, device address, bytes, label)``."""

    start: int
    length: int
    need: int
    dmas: list[tuple[int, int, int, str]] = field(default_factory=list)


@dataclass(slots=True)
class FilePlan:
    """The chunks of one file transfer, in file order, and what they cover."""

    chunks: list[Chunk]
    nbytes: int  # payload bytes (what the pieces cover)
    span: tuple[int, int]  # the file range read or written, [lo, hi)
    step: int  # the largest chunk: what one slot must hold (beyond aligning its address)


def plan_pieces(pieces: Sequence[Piece], slot_bytes: int | None = None, *, aligned: bool = True) -> FilePlan:
    """Cut ``pieces`` (any order, non-overlapping in the file) into chunks of at most one slot.

    Runs of pieces closer than :data:`RUN_GAP` are read in one pass; chunks start at
    :data:`ALIGN`-aligned offsets when ``aligned`` (reads), so ``O_DIRECT`` can serve them.
    Writes (``aligned=False``) cover exactly the pieces' bytes. ``slot_bytes``: :data:`SLOT_BYTES`.
    """
    slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
    step = max(ALIGN, (slot_bytes - ALIGN) // ALIGN * ALIGN)  # room for aligning the slot's address
    live = sorted((p for p in pieces if p.nbytes > 0), key=lambda p: p.offset)
    chunks: list[Chunk] = []
    runs: list[list[Piece]] = []
    for piece in live:
        if runs:
            last = runs[-1][-1]
            if piece.offset < last.offset + last.nbytes:
                raise ValueError(f"pieces overlap in the file at byte {piece.offset} ({last.label!r}, {piece.label!r})")
            if piece.offset - (last.offset + last.nbytes) <= (RUN_GAP if aligned else 0):
                runs[-1].append(piece)
                continue
        runs.append([piece])
    for run in runs:
        lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
        start = lo // ALIGN * ALIGN if aligned else lo
        index = 0
        while start < hi:
            end = min(start + step, hi)
            length = (-(-end // ALIGN) * ALIGN - start) if aligned else end - start
            chunk = Chunk(start, length, end - start)
            while index < len(run) and run[index].offset + run[index].nbytes <= start:
                index += 1
            k = index
            while k < len(run) and run[k].offset < end:
                p = run[k]
                a, b = max(start, p.offset), min(end, p.offset + p.nbytes)
                if b > a:
                    chunk.dmas.append((a - start, p.ptr + (a - p.offset), b - a, p.label))
                k += 1
            chunks.append(chunk)
            start = end
    total = sum(p.nbytes for p in live)
    span = (live[0].offset, live[-1].offset + live[-1].nbytes) if live else (0, 0)
    return FilePlan(chunks, total, span, max((c.length for c in chunks), default=0))


# -- files ------------------------------------------------------------------------------------------
def file_name(file: Any) -> str:
    """How an error names ``file``."""
    if isinstance(file, (str, bytes, os.PathLike)):
        return os.fsdecode(file)
    name = getattr(file, "name", None)
    return str(name) if isinstance(name, (str, bytes)) and not isinstance(name, int) else repr(file)


class OpenFile:
    """The descriptors a job uses: its own (a file object's is duplicated, so closing the file
    object meanwhile never disturbs the transfer), and an ``O_DIRECT`` one where asked and allowed."""

    def __init__(self, file: Any, *, write: bool, create: bool = False) -> None:
        self.name = file_name(file)
        self.direct_fd = -1
        self.created = False  # a path this call created (removed again if the submission is refused)
        if isinstance(file, (str, bytes, os.PathLike)):
            self.created = write and create and not os.path.lexists(file)
            flags = (os.O_RDWR | (os.O_CREAT if create else 0)) if write else os.O_RDONLY
            flags |= getattr(os, "O_NONBLOCK", 0)  # a FIFO must not block the open (it is refused below)
            try:
                self.fd = os.open(file, flags | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as exc:
                raise TransferSubmitError(f"cannot open {self.name!r}: {exc.strerror or exc}") from exc
            self.path: str | None = os.fsdecode(file)
        else:
            fileno = getattr(file, "fileno", None)
            if fileno is None:
                raise TransferSubmitError(
                    f"file must be a path or an open binary file with fileno(), got {type(file).__name__}"
                )
            try:
                fd = int(fileno())
                flags = __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
            except (OSError, ValueError) as exc:
                raise TransferSubmitError(f"the file {self.name!r} is not open: {exc}") from exc
            mode = os.O_ACCMODE & flags
            if (write and mode == os.O_RDONLY) or (not write and mode == os.O_WRONLY):
                need = "writing" if write else "reading"
                raise TransferSubmitError(f"the file {self.name!r} is not open for {need}")
            if write and flags & getattr(os, "O_APPEND", 0):  # Linux's pwrite appends there, whatever the offset
                raise TransferSubmitError(
                    f"the file {self.name!r} is open for appending, where a write ignores its offset: "
                    "open it with 'r+b' or 'wb', or pass its path"
                )
            flush = getattr(file, "flush", None)
            if write and flush is not None:
                with contextlib.suppress(Exception):
                    flush()  # its own buffered writes land before ours
            self.fd = os.dup(fd)
            self.path = None
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            self.close()
            raise TransferSubmitError(f"cannot stat {self.name!r}: {exc}") from exc
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise TransferSubmitError(f"{self.name!r} is not a regular file")
        self.size = int(st.st_size)

    def open_direct(self, *, write: bool) -> bool:
        """Open the ``O_DIRECT`` descriptor; False where the filesystem refuses it."""
        if not _O_DIRECT:
            return False
        source = self.path if self.path is not None else f"/proc/self/fd/{self.fd}"
        flags = (os.O_WRONLY if write else os.O_RDONLY) | _O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        try:
            self.direct_fd = os.open(source, flags)
        except OSError:
            return False
        return True

    def refresh_size(self) -> int:
        """The file's size now."""
        self.size = int(os.fstat(self.fd).st_size)
        return self.size

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        for name in ("direct_fd", "fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                setattr(self, name, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC: Any = None


RESIDENT_WINDOWS = 64
"""Windows :func:`resident_fraction` asks ``mincore`` about (spread evenly over the range)."""

RESIDENT_WINDOW_BYTES = 256 << 10
"""Bytes per window: 64 windows of 256 KiB ask about 4,096 pages whatever the range's size (a
``mincore`` over a whole 1.6 GB file walked 410,000 pages and cost 10 ms, a fifth of its load)."""


def resident_fraction(fd: int, lo: int, hi: int) -> float | None:
    """The fraction of the file's pages in ``[lo, hi)`` resident in the page cache, or None where that
    cannot be asked.

    ``mincore`` is asked about :data:`RESIDENT_WINDOWS` windows of :data:`RESIDENT_WINDOW_BYTES` spread
    evenly over the range (all of it when it is smaller), over a mapping that is never touched: no page
    faults, and a cost that does not grow with the file.
    """
    global _LIBC
    if hi <= lo:
        return 1.0
    if _LIBC is None:
        _LIBC = _libc() or False
    libc = _LIBC
    if not libc:
        return None
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    window = max(page, RESIDENT_WINDOW_BYTES // page * page)
    first = lo // page * page
    last = -(-hi // page) * page
    if last - first <= RESIDENT_WINDOWS * window:
        starts = [first]
        window = last - first
    else:
        stride = (last - first - window) // (RESIDENT_WINDOWS - 1)
        starts = [first + (i * stride) // page * page for i in range(RESIDENT_WINDOWS)]
    import numpy as np

    resident = total = 0
    pages = window // page
    vec = (ctypes.c_ubyte * pages)()
    bits = np.frombuffer(memoryview(vec).cast("B"), dtype=np.uint8)
    length = starts[-1] + window - first
    addr = libc.mmap(None, length, 1, 1, fd, first)  # PROT_READ, MAP_SHARED; never touched
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        for start in starts:
            if libc.mincore(addr + (start - first), window, vec) != 0:
                return None
            resident += int(np.count_nonzero(bits & 1))  # bit 0: resident
            total += pages
    finally:
        libc.munmap(addr, length)
    return resident / total


def choose_direct(opened: OpenFile, direct: bool | None, span: tuple[int, int]) -> bool:
    """Whether a read of ``span`` uses ``O_DIRECT`` (see the module docstring)."""
    if direct is not None:
        return bool(direct)
    forced = os.environ.get("FERRY_FILE_DIRECT", "")
    if forced in ("0", "1"):
        return forced == "1"
    if span[1] - span[0] < 64 * SLOT_BYTES:  # small reads: the page cache's read-ahead is as good
        return False
    fraction = resident_fraction(opened.fd, *span)
    return fraction is not None and fraction < 0.5


# -- the seam ---------------------------------------------------------------------------------------
def _view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def fill_slot(opened: OpenFile, direct: list[bool], chunk: Chunk, ptr: int) -> None:
    """Read the chunk's bytes from the file into the slot at ``ptr`` (GIL released while reading).

    ``direct[0]`` says whether the ``O_DIRECT`` descriptor is used; a refusal (``EINVAL``) turns it off
    for the rest of the job. Raises :class:`FileReadError` when the read fails or ends early.
    """
    got = 0
    while got < chunk.need:
        use_direct = direct[0] and opened.direct_fd >= 0
        fd = opened.direct_fd if use_direct else opened.fd
        want = chunk.length - got if use_direct else chunk.need - got
        try:
            n = os.preadv(fd, [_view(ptr + got, want)], chunk.start + got)
        except OSError as exc:
            if use_direct and exc.errno == errno.EINVAL:
                direct[0] = False  # the filesystem refuses O_DIRECT here: read through the page cache
                continue
            raise FileReadError(_where(opened, chunk, got, f"the read failed: {exc.strerror or exc}")) from None
        if n == 0:
            raise FileReadError(_where(opened, chunk, got, "the file ended there (was it truncated?)"))
        got += n
        if use_direct and n % ALIGN and got < chunk.need:
            direct[0] = False  # a short direct read mid-file: continue through the page cache


def drain_slot(opened: OpenFile, direct: list[bool], chunk: Chunk, ptr: int) -> None:
    """Write the chunk's bytes from the slot at ``ptr`` into the file. Raises :class:`FileReadError`."""
    done = 0
    aligned = chunk.start % ALIGN == 0 and chunk.length % ALIGN == 0 and ptr % ALIGN == 0
    while done < chunk.length:
        use_direct = direct[0] and aligned and opened.direct_fd >= 0 and done % ALIGN == 0
        fd = opened.direct_fd if use_direct else opened.fd
        try:
            n = os.pwritev(fd, [_view(ptr + done, chunk.length - done)], chunk.start + done)
        except OSError as exc:
            if use_direct and exc.errno == errno.EINVAL:
                direct[0] = False
                continue
            raise FileReadError(_where(opened, chunk, done, f"the write failed: {exc.strerror or exc}")) from None
        if n <= 0:
            raise FileReadError(_where(opened, chunk, done, "the write made no progress"))
        done += n


def _where(opened: OpenFile, chunk: Chunk, got: int, what: str) -> str:
    at = chunk.start + got
    label = ""
    for slot_offset, _, n, name in chunk.dmas:
        if name and chunk.start + slot_offset <= at < chunk.start + slot_offset + max(n, 1):
            label = f" (tensor {name!r})"
            break
    else:
        names = [name for _, _, _, name in chunk.dmas if name]
        if names:
            label = f" (tensor {names[0]!r})"
    return f"{opened.name!r} at byte {at}{label}: {what}"


# -- jobs -------------------------------------------------------------------------------------------
class _Slot:
    __slots__ = ("block", "busy", "event", "ptr")

    def __init__(self, block: Any, event: Any) -> None:
        self.block = block
        self.event = event
        self.ptr = -(-int(block.ptr) // ALIGN) * ALIGN  # aligned data start (room kept by the plan's step)
        self.busy = False


class _Reader:
    """One reader thread with its copy stream and one event per slot it may fill; ``queue`` feeds it work."""

    __slots__ = ("broken", "events", "queue", "stream", "thread")

    def __init__(self, stream: Any, events: list[Any]) -> None:
        self.stream = stream
        self.events = events
        self.queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.broken = False  # a DMA of it failed: the device may still use its stream; never reused


def _serve(work: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A reader thread's loop: run each piece of work until the ``None`` that stops it."""
    while True:
        task = work.get()
        if task is None:
            return
        task()
        del task


class ReaderPool:
    """A runtime's file readers, made on first use and kept until the runtime closes.

    A load of a checkpoint is a few tens of milliseconds at the page cache's speed, so what a job
    would make for itself (a thread per reader, its copy stream, its slots' events) is made once
    here instead; each job still takes its pinned slots from the runtime's pinned pool and gives
    them back when it ends (a warm pool hands them out in microseconds). Jobs running at once
    share the readers: each reader works for one job at a time, in submission order. A reader
    whose DMA failed is never used again (the device may still use its stream), and a new one
    replaces it. :meth:`close` stops the threads and destroys the streams and events.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._readers: list[_Reader] = []
        self._lock = threading.Lock()
        self._closed = False
        self.made = 0  # readers made (for tests and the probe: it stops growing once warm)
        self._ordering: Any = None  # emulated: the stream native file jobs are submitted from

    def ordering_stream(self) -> Any:
        """The stream the emulated device's native file jobs are submitted from (made on first use): a job
        whose device side waits for a producer starts once that stream ran what was ordered before it."""
        with self._lock:
            if self._ordering is None:
                self._ordering = self.backend.stream_create()
            return self._ordering

    def take(self, count: int) -> list[_Reader]:
        """``count`` readers (made where missing; DeviceError when the device refuses a stream or an event)."""
        with self._lock:
            if self._closed:
                raise DeviceError("the runtime's file readers are closed")
            if any(r.broken for r in self._readers):
                for r in self._readers:
                    if r.broken:  # its thread stops; its stream and events stay (the device may still touch them)
                        r.queue.put(None)
                self._readers = [r for r in self._readers if not r.broken]
            while len(self._readers) < count:
                self._readers.append(self._new())
            return self._readers[:count]

    def _new(self) -> _Reader:
        backend = self.backend
        stream = backend.stream_create()
        events: list[Any] = []
        try:
            for _ in range(SLOTS_PER_READER):
                events.append(backend.event_create(blocking=True))
        except BaseException:
            for event in events:
                with contextlib.suppress(DeviceError):
                    backend.event_destroy(event)
            with contextlib.suppress(DeviceError):
                backend.stream_destroy(stream)
            raise
        reader = _Reader(stream, events)
        reader.thread = threading.Thread(target=_serve, args=(reader.queue,), name=f"ferry-file-{self.made}",
                                         daemon=True)
        reader.thread.start()
        self.made += 1
        return reader

    def close(self, *, destroy: bool, timeout: float = 5.0) -> None:
        """Stop the threads (each finishes the work it holds first, for at most ``timeout`` seconds in all),
        then destroy the streams and events when ``destroy`` (the device is usable). Idempotent."""
        with self._lock:
            self._closed = True
            readers, self._readers = self._readers, []
        for r in readers:
            r.queue.put(None)
        deadline = time.monotonic() + timeout
        for r in readers:
            if r.thread is not None and r.thread is not threading.current_thread():
                r.thread.join(max(0.0, deadline - time.monotonic()))
        if not destroy:
            return
        ordering, self._ordering = self._ordering, None
        if ordering is not None:
            with contextlib.suppress(DeviceError):
                self.backend.stream_destroy(ordering)
        for r in readers:
            if r.broken or (r.thread is not None and r.thread.is_alive()):
                continue  # the device, or a thread still running, may use them
            for event in r.events:
                with contextlib.suppress(DeviceError):
                    self.backend.event_destroy(event)
            with contextlib.suppress(DeviceError):
                self.backend.stream_destroy(r.stream)


class FileJob:
    """One file transfer on ``readers`` threads (see the module docstring); the :class:`Job` protocol.

    Built under the runtime's lock (streams, events and slots made there, so a refusal happens
    before any thread starts); :meth:`start` launches the readers.
    """

    def __init__(
        self, parts: Parts, opened: OpenFile, plan: FilePlan, *, upload: bool, direct: bool,
        readers: int | None = None, close_file: bool = True,
    ) -> None:
        self.backend = parts.backend
        self.pool = parts.pool
        self.completion = parts.completion
        self.opened = opened
        self.plan = plan
        self.upload = upload
        self.close_file = close_file
        self.error: DeviceError | None = None
        self.done = threading.Event()
        self.host_bytes = 0
        self.moved_bytes = 0  # payload bytes whose read (or write) finished: the progress
        self.abandoned_bytes = 0
        self.cancelled = False
        self.direct = [direct]
        self._lock = threading.Lock()
        self._next = 0
        if readers is None:  # an O_DIRECT read waits on the disk, not a CPU: as many reads in flight as allowed
            readers = MAX_READERS if direct else default_readers()
        count = max(1, min(readers, len(plan.chunks)))
        self._readers: list[_Reader] = []
        self._slots: list[list[_Slot]] = []
        self._remaining = count if plan.chunks else 0
        slot_bytes = -(-plan.step // ALIGN) * ALIGN + ALIGN  # a full plan's: exactly SLOT_BYTES, one pool class
        if plan.chunks:
            self._readers = parts.readers.take(count)  # DeviceError: nothing taken
            try:
                for reader in self._readers:
                    slots: list[_Slot] = []
                    self._slots.append(slots)
                    for event in reader.events[: SLOTS_PER_READER if upload else 1]:
                        slots.append(_Slot(self.pool.acquire(slot_bytes), event))
            except BaseException:
                self._release(abandon=False)
                raise
        else:  # nothing to read or write: done at once, and the file closed now (no reader will)
            self._release(abandon=False)
            self.done.set()

    @property
    def streams(self) -> list[Any]:
        """The readers' copy streams (ordered after the device side's producer before :meth:`start`)."""
        return [r.stream for r in self._readers]

    @property
    def slot_bytes(self) -> int:
        """Pinned bytes the job's slots hold."""
        return sum(s.block.capacity for slots in self._slots for s in slots)

    def start(self) -> None:
        """Hand the job to its readers."""
        for i, reader in enumerate(self._readers):
            reader.queue.put(functools.partial(self._run, i))

    def is_done(self) -> bool:
        """Whether every reader finished (its DMAs proven complete). Never blocks."""
        return self.done.is_set()

    def wait_done(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Block until done or ``timeout`` seconds passed; return whether done (``poll``: for the protocol)."""
        return self.done.wait(timeout)

    def cancel(self) -> None:
        """Stop claiming chunks (the job then fails: its destinations are incomplete)."""
        self.cancelled = True

    def _claim(self) -> Chunk | None:
        with self._lock:
            if self.error is not None or self.cancelled or self._next >= len(self.plan.chunks):
                return None
            chunk = self.plan.chunks[self._next]
            self._next += 1
            return chunk

    def _fail(self, error: DeviceError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def _run(self, index: int) -> None:
        backend = self.backend
        stream = self._readers[index].stream
        slots = self._slots[index]
        device_failed = False
        k = 0
        try:
            while True:
                chunk = self._claim()
                if chunk is None:
                    break
                slot = slots[k % len(slots)]
                k += 1
                if slot.busy:
                    backend.event_synchronize(slot.event)
                    slot.busy = False
                if self.upload:
                    fill_slot(self.opened, self.direct, chunk, slot.ptr)
                    for offset, ptr, n, _ in chunk.dmas:
                        backend.memcpy_htod(ptr, slot.ptr + offset, n, stream)
                    slot.busy = True
                    backend.event_record(slot.event, stream)
                else:
                    for offset, ptr, n, _ in chunk.dmas:
                        backend.memcpy_dtoh(slot.ptr + offset, ptr, n, stream)
                    slot.busy = True
                    backend.event_record(slot.event, stream)
                    backend.event_synchronize(slot.event)
                    slot.busy = False
                    drain_slot(self.opened, self.direct, chunk, slot.ptr)
                with self._lock:
                    self.moved_bytes += sum(n for _, _, n, _ in chunk.dmas)
            for slot in slots:
                if slot.busy:
                    backend.event_synchronize(slot.event)
                    slot.busy = False
        except FileReadError as exc:
            self._fail(exc)
            try:
                for slot in slots:
                    if slot.busy:
                        backend.event_synchronize(slot.event)
                        slot.busy = False
            except DeviceError:
                device_failed = True
        except DeviceError as exc:
            self._fail(exc)
            device_failed = True
        except BaseException as exc:
            self._fail(DeviceError(f"file transfer of {self.opened.name!r} failed: {exc!r}"))
            device_failed = True
        if device_failed:
            self._abandon(index)
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            if self.error is None and self.cancelled:
                self.error = FileReadError(f"the transfer of {self.opened.name!r} was cancelled")
            self._release(abandon=False)
            self.done.set()

    def _abandon(self, index: int) -> None:
        """A DMA or event failed: the device may still touch this reader's slots and stream; never reuse them."""
        slots, self._slots[index] = self._slots[index], []
        self._readers[index].broken = True
        lost = sum(s.block.capacity for s in slots)
        with self._lock:
            self.abandoned_bytes += lost
        with self.completion.lock:
            self.completion.abandoned_bytes += lost

    def _release(self, *, abandon: bool) -> None:
        """Give the slots back and close the file (every reader finished; the readers stay the runtime's)."""
        for slots in self._slots:
            for slot in slots:
                self.pool.release(slot.block)
        self._slots = [[] for _ in self._slots]
        self._readers = []
        if self.close_file:
            self.opened.close()


# -- the compiled engine's file jobs ----------------------------------------------------------------
_FAIL_NATIVE_CHUNK: tuple[int, int] | None = None
"""Tests: ``(chunk, errno)``: that chunk's read (or write) in the next native file job fails with that errno."""

_FILE_WHAT = {
    "read": "the read failed", "short": "the file ended there (was it truncated?)", "write": "the write failed",
    "no_progress": "the write made no progress",
}


def native_engine(parts: Parts, upload: bool) -> Any:
    """The compiled engine of the direction (a ``NativeEngine``) when the runtime runs it, else ``None``.

    Lock held: the engine is made on first use, as a staged transfer makes it."""
    from ._native import NativeEngine
    from ._staged import native_module

    if native_module(parts.staging) is None:
        return None
    engine = parts.staged.engine(upload)
    return engine if isinstance(engine, NativeEngine) else None


FILE_CHUNK_BYTES = 4 << 20
"""The compiled lanes' chunk for reads through the page cache (at most a slot; ``O_DIRECT`` reads and writes
take whole slots). On an H200 machine (16 CPUs) a warm 1.7 GB checkpoint loaded at 40.6 - 42.7 GB/s with 4 MiB
chunks against 30.3 - 35.4 GB/s with 1 MiB ones (12 and 16 lanes): fewer, larger reads cost less per byte than
keeping the slots in the CPU's cache saves. ``benchmarks/probe_file_lanes.py`` sweeps it."""


def span_of(pieces: Sequence[Piece]) -> tuple[int, int]:
    """The file range ``[lo, hi)`` the non-empty pieces cover."""
    live = [p for p in pieces if p.nbytes > 0]
    return (min(p.offset for p in live), max(p.offset + p.nbytes for p in live)) if live else (0, 0)


def plan_for(parts: Parts, pieces: Sequence[Piece], *, upload: bool, direct: bool = False) -> FilePlan:
    """The plan of a transfer of ``pieces``. Where the compiled engine runs: chunks of :data:`FILE_CHUNK_BYTES`
    for reads through the page cache, of one of the lanes' slots for ``O_DIRECT`` reads and for writes (the
    slots are aligned already: a chunk may fill a whole slot); else chunks of :data:`SLOT_BYTES`."""
    from ._staged import native_module

    if native_module(parts.staging) is None:
        return plan_pieces(pieces, aligned=upload)
    chunk = parts.staging.slot_bytes
    if upload and not direct:
        chunk = min(chunk, max(ALIGN, FILE_CHUNK_BYTES))
    return plan_pieces(pieces, chunk + ALIGN, aligned=upload)


def make_job(
    parts: Parts, opened: OpenFile, plan: FilePlan, *, upload: bool, direct: bool, close_file: bool = True,
) -> FileJob | NativeFileJob:
    """The job of a file transfer: on the compiled engine's lanes where it runs, else on the reader threads.

    Lock held. Raises DeviceError or MemoryError with nothing taken."""
    engine = native_engine(parts, upload)
    if engine is not None and plan.step <= int(engine.engine.slot_bytes):
        return NativeFileJob(parts, opened, plan, upload=upload, direct=direct, engine=engine, close_file=close_file)
    return FileJob(parts, opened, plan, upload=upload, direct=direct, close_file=close_file)


class NativeFileJob:
    """One file transfer on the compiled engine's lanes (``_native/core/file.c``): :class:`FileJob`'s interface.

    The lanes of the direction's engine claim the plan's chunks in file order, ``pread`` each straight into
    a pinned slot of theirs and enqueue its DMAs (a download: DMAs into the slot, then ``pwrite``); no Python
    thread is on the data path. On CUDA the job is submitted at :meth:`start`, after the lanes' streams were
    ordered after the device side's producer; on the emulated device it is submitted from the file route's
    ordering stream once the work queued there ran. A read or write that fails, or a file cut short, fails
    the job with :class:`FileReadError` naming the file, the byte and the tensor; the lane that met it gives
    up its slots as after a failed DMA (counted in the engine's abandoned bytes). The descriptors stay open
    until the job is done (closed then when ``close_file``).
    """

    def __init__(
        self, parts: Parts, opened: OpenFile, plan: FilePlan, *, upload: bool, direct: bool, engine: Any,
        close_file: bool = True,
    ) -> None:
        import numpy as np

        self.backend = parts.backend
        self.opened = opened
        self.plan = plan
        self.upload = upload
        self.close_file = close_file
        self.direct = [direct]
        self.host_bytes = 0  # the kernel reads into the slots: no host copy of ferry's
        self.abandoned_bytes = 0
        self.cancelled = False
        self.engine = engine
        self._readers = parts.readers
        self._inner: Any = None
        self._error: DeviceError | None = None
        self._started: threading.Event | None = None
        self._lock = threading.Lock()
        self._ended = False
        self._index = [i for i, c in enumerate(plan.chunks) if c.dmas]  # engine chunk -> plan chunk
        self._targets: list[tuple[int, int]] = []  # emulated: (device address, bytes) in use by the lanes
        backend = self.backend
        chunks = np.empty((len(self._index), 4), np.uint64)
        rows: list[tuple[int, int, int]] = []
        try:
            for k, i in enumerate(self._index):
                chunk = plan.chunks[i]
                chunks[k] = (chunk.start, chunk.length, chunk.need, len(chunk.dmas))
                for offset, ptr, n, _ in chunk.dmas:
                    target = ptr
                    if not engine.cuda:  # the memory behind the emulated device's address, in use meanwhile
                        target = backend.native_target(ptr, n)  # type: ignore[attr-defined]
                        self._targets.append((ptr, n))
                    rows.append((offset, target, n))
        except BaseException:
            self._give_back()
            raise
        self._chunks = chunks.tobytes()
        self._dmas = np.array(rows, np.uint64).reshape(-1, 3).tobytes()
        if not self._index:
            self._end()

    @property
    def streams(self) -> list[Any]:
        """The streams to order after the device side's producer before :meth:`start`: the lanes' (CUDA),
        or the route's ordering stream the job is submitted from (emulated)."""
        if not self._index:
            return []
        if self.engine.cuda:
            return list(self.engine.streams())
        return [self._readers.ordering_stream()]

    @property
    def slot_bytes(self) -> int:
        """Pinned bytes the job holds of its own: none (the lanes' slots are the engine's)."""
        return 0

    def start(self) -> None:
        """Submit the job to the lanes (emulated: from the ordering stream, once its queued work ran).

        On CUDA the lanes take the job now: a refusal (a closed engine, no memory for the plan) raises
        :class:`~ferry.TransferSubmitError` and nothing was handed over (the caller still owns everything)."""
        if not self._index:
            return
        engine = self.engine.engine
        fail = _FAIL_NATIVE_CHUNK
        fail_chunk, fail_errno = fail if fail is not None else (-1, 0)
        opened = self.opened

        # the lanes' own text of the name (errors say it from Python's): any path, UTF-8 or not, goes through
        label = opened.name.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\0")

        def hand_over() -> None:
            inner = engine.submit_file(
                opened.fd, opened.direct_fd, self._chunks, self._dmas, direct=self.direct[0],
                name=label, fail_chunk=fail_chunk, fail_errno=fail_errno,
            )
            self._inner = inner
            if self.cancelled:  # cancel() ran meanwhile and found no job to stop: stop it here
                inner.cancel()

        def submit() -> None:
            try:
                if self.cancelled:
                    self._error = FileReadError(f"the transfer of {opened.name!r} was cancelled")
                else:
                    hand_over()
            except Exception as exc:  # a closed engine: the job fails, nothing runs
                self._error = DeviceError(f"the file transfer of {opened.name!r} could not start: {exc}")
            finally:
                if self._started is not None:
                    self._started.set()

        if self.engine.cuda:
            try:
                hand_over()
            except (RuntimeError, ValueError, OverflowError, MemoryError) as exc:
                raise TransferSubmitError(f"the compiled lanes refused the transfer of {opened.name!r}: {exc}") from exc
            return
        self._started = threading.Event()
        take = getattr(self.backend, "take_armed_fault", None)
        armed = take() if take is not None else None
        if armed is not None:
            engine.fail_next_copy(armed[0], sticky=armed[1])
        self.backend.stream_wait_host(self._readers.ordering_stream(), submit)  # type: ignore[attr-defined]

    def is_done(self) -> bool:
        """Whether the lanes finished the job (its DMAs complete, or it failed). Never blocks."""
        inner = self._inner
        done = (self._error is not None or not self._index) if inner is None else bool(inner.done())
        if done:
            self._end()
        return done

    def wait_done(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Sleep (GIL released, signals checked) until done or ``timeout`` seconds passed."""
        started = self._started
        if self._inner is None and started is not None and not started.is_set():
            t0 = time.monotonic()
            if not started.wait(timeout):
                return False
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - t0))
        inner = self._inner
        if inner is not None and not inner.wait(timeout, poll=poll):
            return False
        return self.is_done()

    def cancel(self) -> None:
        """Stop claiming chunks: the job fails (its destinations are incomplete)."""
        self.cancelled = True  # before the look at the job: a submission that hands it over later stops it
        inner = self._inner
        if inner is not None:
            inner.cancel()

    @property
    def moved_bytes(self) -> int:
        """Payload bytes whose read (or write) finished: the progress."""
        inner = self._inner
        return int(inner.file_moved) if inner is not None else 0

    @property
    def error(self) -> DeviceError | None:
        """The job's failure (:class:`FileReadError` for the file's side), or ``None``; meaningful once done."""
        inner = self._inner
        if self._error is None and inner is not None and inner.done():  # final only once done: a device
            failure = inner.error  # error met after the file's replaces it until then
            if failure is not None:
                self._error = self._error_of(failure)
        return self._error

    @error.setter
    def error(self, value: DeviceError | None) -> None:
        self._error = value

    def _error_of(self, failure: tuple[int, str, bool]) -> DeviceError:
        side = self._inner.file_error
        if side is None:
            code, text, sticky = failure
            return DeviceError(f"file transfer of {self.opened.name!r} failed: {text}", code=int(code),
                               sticky=bool(sticky))
        kind, errnum, k, offset = side
        if kind == "cancelled":
            return FileReadError(f"the transfer of {self.opened.name!r} was cancelled")
        chunk = self.plan.chunks[self._index[k]] if 0 <= k < len(self._index) else Chunk(offset, 0, 0)
        what = _FILE_WHAT.get(kind, "failed")
        if errnum:
            what = f"{what}: {os.strerror(errnum)} (errno {errnum})"
        return FileReadError(_where(self.opened, chunk, offset - chunk.start, what))

    def _give_back(self) -> None:
        targets, self._targets = self._targets, []
        for ptr, n in targets:
            self.backend.native_release(ptr, n)  # type: ignore[attr-defined]

    def _end(self) -> None:
        """Done: the lanes reaped every DMA of the job (a failed lane waited for its slots before giving them
        up), so the device memory's uses go back and the file closes. Once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._give_back()
        if self.close_file:
            self.opened.close()

    def _release(self, *, abandon: bool) -> None:
        """Refused before :meth:`start`: give the uses back, close the file (when it is the job's)."""
        self._end()


# -- the runtime's calls ----------------------------------------------------------------------------
def _offset_arg(offset: Any) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int):
        try:
            import numpy as np

            if isinstance(offset, np.integer):
                return int(offset)
        except ImportError:  # pragma: no cover
            pass
        raise TransferSubmitError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise TransferSubmitError(f"offset must be >= 0, got {offset}")
    return int(offset)


def _direct_arg(direct: Any) -> bool | None:
    if direct is not None and not isinstance(direct, bool):
        raise TransferSubmitError(f"direct must be True, False or None, got {direct!r}")
    return direct


def submit_file(
    owner: object, parts: Parts, file: Any, array: DeviceArray, *, upload: bool, offset: Any, direct: Any,
    result: Callable[[Any, Any], tuple[Any, ...]],
) -> Any:
    """Check and submit ``array <- file`` (``upload``) or ``file <- array``; return the record.

    Everything is checked, opened and allocated before ownership moves; any refusal raises
    :class:`~ferry.TransferSubmitError` with the array unchanged and the file untouched.
    """
    from .._device_array import DeviceArray
    from .._errors import RuntimeClosedError

    call = "upload_file" if upload else "download_file"
    role = "destination" if upload else "source"
    offset = _offset_arg(offset)
    direct = _direct_arg(direct)
    if parts.health.refusal is not None:
        raise RuntimeClosedError(parts.health.refusal)
    ours = isinstance(array, DeviceArray)
    with parts.lock:
        if ours:
            problem = array._submission_problem(owner, write=upload)
            if problem:
                raise TransferSubmitError(f"{call}: {problem}")
            device: Any = array
        else:  # a CUDA array of another library (CUDA Array Interface or DLPack), checked and wrapped
            device = device_side(array, owner, parts.backend, call, role, write=upload, stream=parts.h2d)
    opened: OpenFile | None = None
    try:
        nbytes = device._nbytes
        if offset + nbytes > MAX_FILE_OFFSET:
            raise TransferSubmitError(
                f"{call}: {nbytes} bytes at offset {offset} run past the largest file offset ({MAX_FILE_OFFSET})"
            )
        opened = OpenFile(file, write=not upload, create=not upload)
        if upload and opened.size < offset + nbytes:
            raise TransferSubmitError(
                f"{opened.name!r} holds {opened.size} bytes; reading {nbytes} bytes at offset {offset} "
                f"needs {offset + nbytes}"
            )
        pieces = [Piece(offset, nbytes, device._ptr)]
        use_direct = choose_direct(opened, direct, span_of(pieces)) if upload else bool(direct)
        plan = plan_for(parts, pieces, upload=upload, direct=use_direct)
        if use_direct:
            opened.open_direct(write=not upload)
        with parts.lock:
            if parts.health.refusal is not None:
                raise RuntimeClosedError(parts.health.refusal)
            if ours:
                problem = array._submission_problem(owner, write=upload)
                if problem:
                    raise TransferSubmitError(f"{call}: {problem}")
            completion = parts.completion
            if completion.maintenance_due():
                completion.maintain()
            try:
                job = make_job(parts, opened, plan, upload=upload, direct=use_direct)
            except DeviceError as exc:
                parts.health.note(exc)
                raise TransferSubmitError(f"{call}: the device refused the transfer's streams or slots: {exc}") from exc
            except MemoryError as exc:
                raise TransferSubmitError(f"{call}: no pinned memory for the transfer's slots: {exc}") from exc
            try:
                order_before(completion, job.streams, device, ordered=parts.h2d)
            except DeviceError as exc:
                job._release(abandon=False)
                parts.health.note(exc)
                raise TransferSubmitError(f"{call}: could not order the transfer: {exc}") from exc
            moved, leased = ((device,), ()) if upload else ((), (device,))
            try:
                job.start()  # under the lock: no one sees the device side before its state moves below
            except BaseException:  # refused by the lanes: nothing was handed over
                job._release(abandon=False)
                raise
            record = completion.job_record(job, ("file", id(job)), moved, leased, result(file, array), nbytes, None)
            cleanup = release_import(device)
            if cleanup is not None:
                completion.extras(record).cleanups.append(cleanup)
            if isinstance(job, NativeFileJob):
                completion.extras(record).cleanups.append(lambda failed: job._end())
            if upload:
                device._state = IN_FLIGHT
            else:
                device._leases += 1
            return record
    except BaseException:
        if device is not array:
            give_back(device)  # refused after the producer's capsule was taken
        if opened is not None:
            opened.close()
            if opened.created:
                with contextlib.suppress(OSError):
                    os.unlink(file)
        raise


def upload_file(
    owner: object, parts: Parts, file: Any, destination: Any, offset: Any, direct: Any
) -> PendingUpload[Any, Any]:
    """See :meth:`ferry.Runtime.upload_file`; returns the handle."""
    record = submit_file(owner, parts, file, destination, upload=True, offset=offset, direct=direct,
                         result=lambda f, a: (f, a))
    return PendingUpload(parts.completion, record)


def download_file(
    owner: object, parts: Parts, source: Any, file: Any, offset: Any, direct: Any
) -> PendingDownload[Any, Any]:
    """See :meth:`ferry.Runtime.download_file`; returns the handle."""
    record = submit_file(owner, parts, file, source, upload=False, offset=offset, direct=direct,
                         result=lambda f, a: (a, f))
    return PendingDownload(parts.completion, record)
