"""Types of the compiled extension ``ferry._native._engine``, sectioned as its sources are (README.md in this
folder lists them; each source opens with the contract of what it defines)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, final

# -- module.c: the module's constants and small functions ------------------------------------------

MAX_LANES: int
MAX_SLOTS: int
INJECTED_FAILURE: int
"""Code of a non-sticky failure from ``fail_next_copy()`` (999, as the emulated backend's)."""
INJECTED_STICKY_FAILURE: int
"""Code of a sticky failure from ``fail_next_copy(sticky=True)`` (719, LAUNCH_FAILED)."""

class DriverError(RuntimeError):
    """An engine could not be built: ``args == (code, text)`` of the failing driver call."""

def is_sticky(code: int, /) -> bool:
    """Whether a CUDA error code leaves the context unusable (700, 701, 702, 714-719, 999)."""

def entry_point_names() -> tuple[str, ...]:
    """The entry points ``mode="cuda"`` needs; the last two (error texts) are optional."""

# -- engine.c: the staging engine (its work is done by core/) --------------------------------------

@final
class Job:
    """One staged transfer, from :meth:`Engine.submit`."""

    @property
    def error(self) -> tuple[int, str, bool] | None:
        """``(code, text, sticky)`` of the job's first failure, or ``None``."""
    @property
    def host_bytes(self) -> int:
        """Bytes the host has copied for this job (``== nbytes`` once done without error)."""
    @property
    def nbytes(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def lanes(self) -> int:
        """How many lanes took a share of the job."""
    @property
    def file_moved(self) -> int:
        """A file job's payload bytes read (or written) so far (TypeError for other jobs)."""
    @property
    def file_error(self) -> tuple[str, int, int, int] | None:
        """A file job's host-side failure, ``(kind, errno, chunk, file offset)`` with kind ``"read"``,
        ``"short"`` (the file ended early), ``"write"``, ``"no_progress"`` or ``"cancelled"``; ``None``
        when it did not fail on the host side."""
    @property
    def file_direct(self) -> bool:
        """Whether a file job still reads through its ``O_DIRECT`` descriptor."""
    def cancel(self) -> bool:
        """A file job: stop claiming chunks, fail the job (``False``: it had failed or finished already)."""
    def done(self) -> bool:
        """Whether the job is complete (one atomic load; never blocks, never raises)."""
    def wait(self, timeout: float | None = None, *, poll: bool = True) -> bool:
        """Sleep with the GIL released until done; ``False`` on timeout.

        On an engine with ``wait_spin_us`` > 0, and ``poll`` true, the job is first polled (GIL
        released) until its expected end (its bytes at 16 GB/s from submission, at most 5 ms
        ahead) plus the larger of ``wait_spin_us`` and ``spin_us``; with ``spin_us`` alone, that
        long. ``poll=False`` sleeps at once (a background waiter's choice). Python signals are
        checked after that poll and then at least every 5 ms: an exception raised by a signal
        handler (KeyboardInterrupt) propagates out of ``wait``.
        """
    def timeline(self) -> dict[str, float | None]:
        """Microseconds after submit (None: not yet) of ``start_first``/``start_last`` (the first and last
        lane to start on it), ``copy_last`` (last host copy), ``enqueue_last`` (last DMA enqueued), ``done``."""
    def chunk_sizes(self) -> list[int]:
        """The job's plan: the bytes of each chunk, in order (chunk ``k`` goes to share ``k % lanes``)."""
    def chunk_times(self) -> list[tuple[int, float, float, float, float]]:
        """Per chunk of a finished job (up to 1024 chunks, else ``[]``), its lane and four times in
        microseconds after submit: an upload's chunk taken up, its copy begun (after any wait for its
        slot) and ended, its enqueue answered; a download's DMA handed over and answered, its copy out
        begun and ended. RuntimeError before the job is done."""
    def hand_off(self, timeout: float | None = None) -> list[int] | None:
        """For a job submitted with ``hand_off=True``: sleep (GIL released, signals checked) until
        every lane enqueued its share's last DMA, then the events recorded right after them (raw
        ``CUevent`` handles on CUDA): a stream that waits for each is ordered after every DMA of the
        job. A share that never enqueued its last DMA (the job failed) posts none. ``None`` on
        timeout; ``[]`` at once for a job submitted without ``hand_off``."""

@final
class Engine:
    """The staging lanes of one direction (see ``engine.c`` and ``core/lanes.c``).

    The newer knobs: ``nontemporal`` (chunk copies from 64 KiB with streaming stores, x86-64),
    ``driver_thread`` (one thread makes the lanes' enqueues and polls the events they wait for;
    :attr:`driver_thread` says whether it runs: a thread that fails to start leaves the lanes
    calling the driver themselves), ``wait_spin_us`` (``Job.wait`` polls the job until its expected
    end and that long more first),
    ``one_stream`` (CUDA mode with the driver thread only, ignored otherwise: every DMA on the
    driver thread's one stream, which :meth:`streams` then names alone), ``lane_wait_us`` (a lane
    waits that long awake for the driver thread's answer, a DMA's end, before it sleeps; it spins
    20 us at least, and the knob does nothing without the driver thread), ``helpers`` (cooperative
    jobs: a contiguous job of at least two pieces is one lead lane's, in chunks of a quarter of it,
    and each chunk's host copy is cut into ``piece_bytes`` pieces that the lead and up to
    ``helpers`` idle lanes claim; 0 deals every job's chunks to the lanes; helpers poll, so they
    pay only where CPUs are to spare: the runtime turns them on only there), ``help_spin_us`` (a
    helper polls that long, at most 10 s, for the next posted copy, then sleeps until a lead
    wakes it) and
    ``lead_copies`` (a knob for one-job tests: ``False`` leaves every piece to the helpers, and a
    lead nobody helps copies alone after 2 s); jobs above
    ``cooperative_max_bytes`` are dealt.
    """

    def __init__(
        self,
        direction: Literal["upload", "download"],
        *,
        mode: Literal["cuda", "emulated"] = "emulated",
        lanes: int = 4,
        slots_per_lane: int = 2,
        slot_bytes: int = 1 << 20,
        min_chunk_bytes: int = 256 << 10,
        context: int = 0,
        entry_points: Mapping[str, int] | None = None,
        bandwidth: float = 25e9,
        latency: float = 5e-6,
        spin_us: float = 0.0,
        idle_spin_us: float = 0.0,
        min_chunks_per_lane: int = 1,
        serialize_driver: bool = True,
        nontemporal: bool = True,
        driver_thread: bool = True,
        wait_spin_us: float = 0.0,
        one_stream: bool = False,
        lane_wait_us: float = 100.0,
        helpers: int = 0,
        help_spin_us: float = 200.0,
        piece_bytes: int = 128 << 10,
        lead_copies: bool = True,
        cooperative_max_bytes: int = ...,
    ) -> None: ...
    @property
    def cooperative_max_bytes(self) -> int:
        """The largest cooperative job: larger ones are dealt to the lanes (no limit by default)."""
    @property
    def helpers(self) -> int:
        """The most idle lanes that help one cooperative job's lead copy (0: no cooperative jobs)."""
    @property
    def piece_bytes(self) -> int:
        """The pieces a cooperative job's chunk copy is cut into."""
    @property
    def helped_pieces(self) -> int:
        """Pieces of cooperative jobs that helpers copied (the lead copied the rest)."""
    @property
    def cooperative_jobs(self) -> int:
        """Jobs submitted as cooperative (contiguous, two pieces or more, on an engine with helpers)."""
    @property
    def held_bytes(self) -> int:
        """Staging memory the lanes hold now (``lanes * slots_per_lane * slot_bytes`` while open)."""
    @property
    def abandoned_bytes(self) -> int:
        """Staging memory given up after failures (never reused; never freed on CUDA)."""
    @property
    def closed(self) -> bool: ...
    @property
    def lanes(self) -> int: ...
    @property
    def slots_per_lane(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def direction(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def spin_us(self) -> float:
        """CUDA lanes poll a slot's event (``cuEventQuery``), and ``Job.wait`` polls the job, this long
        before sleeping on it (0: always sleep at once)."""
    @property
    def wait_spin_us(self) -> float:
        """``Job.wait`` polls the job until its expected end and this long more (the larger of this
        and :attr:`spin_us`) before sleeping."""
    @property
    def lane_wait_us(self) -> float:
        """How long a lane waits awake (spinning, then yielding) for the driver thread's answer
        before it sleeps until signalled."""
    @property
    def driver_thread(self) -> bool:
        """Whether one driver thread makes every enqueue of the lanes (see ``core/driver.c``)."""
    def submit(
        self,
        host_ptr: int,
        device_ptr: int,
        nbytes: int,
        shape: Sequence[int],
        strides: Sequence[int],
        itemsize: int,
        chunk_bytes: int = 0,
        *,
        hand_off: bool = False,
    ) -> Job:
        """Queue a transfer between the host array at ``host_ptr`` (its element ``[0, ..., 0]``,
        described by ``shape``/``strides`` in bytes) and the C-order bytes at ``device_ptr``.
        ``chunk_bytes=0`` picks the size (:meth:`chunk_bytes`). Returns at once; the caller keeps
        the host array and the device memory alive until the job is done."""
    def submit_file(
        self,
        fd: int,
        direct_fd: int,
        chunks: bytes | memoryview,
        dmas: bytes | memoryview,
        *,
        direct: bool = False,
        name: str = "",
        fail_chunk: int = -1,
        fail_errno: int = 0,
    ) -> Job:
        """Queue a file job (``core/file.c``): ``chunks`` packs ``(start, length, need, ndma)`` and ``dmas``
        ``(slot offset, device address, bytes)`` as unsigned 64-bit words. The lanes claim chunks in order,
        ``pread`` each into a slot and enqueue its DMAs (a download: DMAs, then ``pwrite``). The caller keeps
        ``fd``/``direct_fd`` open and the device memory alive until the job is done. ``fail_chunk`` and
        ``fail_errno`` (tests): that chunk's read or write fails with that errno."""
    def submit_pieces(self, pieces: Any, *, chunk_bytes: int = 0, hand_off: bool = False) -> Job:
        """Queue one transfer of many pieces: ``pieces`` is a buffer of native-endian uint64 triples
        (host address, device address, bytes). Pieces that follow each other on the device share
        chunks (one DMA each); a piece larger than a chunk is cut. Returns at once; the caller keeps
        every piece's memory alive until the job is done."""
    def chunk_bytes(self, nbytes: int, /) -> int:
        """The chunk size ``submit`` picks for a payload of ``nbytes``."""
    def streams(self) -> list[int]:
        """The lanes' stream handles (CUstream values; opaque in emulated mode)."""
    def hold(self) -> None:
        """Start no new DMA until :meth:`release` (CUDA: lanes pause at chunk boundaries)."""
    def release(self) -> None:
        """Lift a hold."""
    def fail_next_copy(self, after: int = 0, *, sticky: bool = False) -> None:
        """Emulated only: the copy enqueued after the next ``after`` ones fails."""
    def close(self) -> None:
        """Wait for every queued job, stop the lanes, free the slots. Idempotent."""
    def abandon(self) -> None:
        """Left at interpreter exit with copies in flight: refuse every call; dealloc neither joins the
        lanes nor frees anything."""

# -- calls.c: the small-transfer path's driver calls -----------------------------------------------

@final
class Calls:
    """The small-transfer path's driver calls, made from C (see ``calls.c``).

    Handles are raw ``CUstream``/``CUevent`` values; a non-zero ``CUresult`` goes to
    ``on_error(op, code, stage, args)``, whose result (or exception) becomes the call's.
    """

    def __init__(
        self,
        entry_points: Mapping[str, int],
        on_error: Callable[[str, int, int, tuple[Any, ...]], Any],
        batch_abi: int = 0,
    ) -> None: ...
    @property
    def batch_abi(self) -> int:
        """12080 or 13000: the ``cuMemcpyBatchAsync`` signature in use; 0: batches are loops."""
    @property
    def batch_refused(self) -> int:
        """The ``CUresult`` with which the driver refused a batch (INVALID_VALUE or NOT_SUPPORTED, checked
        before anything is queued): batches are loops since. 0: none."""
    @property
    def waits(self) -> int:
        """Host waits so far (``event_wait`` and ``event_synchronize`` calls)."""
    def htod_record(self, dst: int, src: int, nbytes: int, stream: int, event: int | None, /) -> None: ...
    def dtoh_record(self, dst: int, src: int, nbytes: int, stream: int, event: int | None, /) -> None: ...
    def event_record(self, event: int, stream: int, /) -> None: ...
    def event_query(self, event: int, /) -> bool: ...
    def event_wait(self, event: int, timeout: float, /) -> bool:
        """Poll until complete (GIL released, signals checked every 2 ms) or ``timeout`` seconds passed."""
    def event_synchronize(self, event: int, /) -> None: ...
    def stream_wait_events(self, stream: int, events: list[int], /) -> None:
        """``cuStreamWaitEvent(stream, event, 0)`` for each event of the list (a failure goes to
        ``on_error`` with stage 0: waiting again is harmless)."""
    def copy_batch(
        self, upload: bool, dsts: list[int], srcs: list[int], sizes: list[int], stream: int, event: int | None, /
    ) -> None:
        """The copies in one ``cuMemcpyBatchAsync`` (or a loop), then the event record."""
    def counts(self) -> dict[str, int]:
        """``waits``, ``copies`` (single copies), ``batches`` and ``batched_copies`` so far."""

# -- records.c: records and handles ----------------------------------------------------------------

@final
class Record:
    """A transfer's record: the compiled twin of ``ferry._records.Record`` (same fields, same defaults)."""

    seq: int
    event: Any
    stream: Any
    moved: tuple[Any, ...]
    leased: tuple[Any, ...]
    result: tuple[Any, ...]
    nbytes: int
    done: bool
    error: Any
    extra: Any
    settled: bool
    claimed: bool
    waiters: int
    spun: bool
    signal: Any
    batch: Any
    shared: Any
    def __init__(
        self, seq: int, event: Any, stream: Any, moved: tuple[Any, ...], leased: tuple[Any, ...],
        result: tuple[Any, ...], nbytes: int, /,
    ) -> None: ...

def new_record(
    seq: int, event: Any, stream: Any, moved: tuple[Any, ...], leased: tuple[Any, ...], result: tuple[Any, ...],
    nbytes: int, /,
) -> Record:
    """``Record(...)`` without the type call."""

class Handle:
    """The compiled base of ferry's transfer handles (``ferry._pending``); only subclasses are made."""

    _port: Any
    _record: Any
    _waited: bool
    _claimed: bool
    _future: Any
    def __init__(self, port: Any, record: Any, /) -> None: ...
    def wait(self, timeout: float | None = None) -> Any: ...

def set_handle_errors(waited_error: type[BaseException], /) -> None:
    """The exception class a handle's second ``wait()`` raises."""

# -- objects.c: the fields of ferry's hot objects, and the pinned memory views are made from -------

class BufferFields: ...
class ArrayFields: ...
class BlockFields: ...
class HealthFields: ...
class ExtrasFields: ...
class SlotFields(ExtrasFields): ...

def leaf_pieces(
    hosts: list[Any], devices: list[Any], runtime: Any, owned: Any, upload: bool, /
) -> tuple[bytes, int] | None:
    """A tree's leaves (host arrays and ferry device arrays, pairwise) as :meth:`Engine.submit_pieces`
    takes them, with their total bytes; ``None`` where a leaf is not the common case (``tree.c``)."""

def device_pieces(
    devices: list[Any], runtime: Any, owned: Any, base: int, offsets: list[int], /
) -> tuple[bytes, int] | None:
    """A download's pieces (as :func:`leaf_pieces` packs them) into host memory laid out for it, leaf ``i`` at
    ``base + offsets[i]``, with their total bytes; only the device arrays are checked; ``None`` where one is
    not the common case (``tree.c``)."""

def slab_views(
    hosts: list[Any], sizes: list[int], runtime: Any, slab: Any, base: int, owned: Any, zero: int, /
) -> list[Any] | None:
    """A fresh owned ``DeviceArray`` view of ``slab`` for each host array (its shape and dtype, ``sizes[i]``
    bytes), back to back from ``base`` at 256-byte aligned offsets; ``None`` where a host is not an exact
    ``numpy.ndarray`` (``tree.c``)."""

def host_sizes(hosts: list[Any], align: int, /) -> tuple[list[int], int] | None:
    """Each host array's bytes (as ``ndarray.nbytes``) and the bytes they span back to back, each at a multiple
    of ``align`` (an empty one takes ``align`` bytes); ``None`` where a host is not an exact ``numpy.ndarray``
    (``tree.c``)."""

def merge_runs(pieces: bytes, align: int, /) -> tuple[list[int], list[int], list[int]]:
    """``pieces`` (as :func:`leaf_pieces` packs them) merged into runs where they follow each other on both
    sides, empty ones dropped: ``(hosts, devices, sizes)``. With ``align > 0`` the host side was laid out at
    that alignment, and pieces also merge across the same gap of less than ``align`` bytes on both sides
    (``tree.c``)."""

def flat_leaves(tree: Any, kind: type, /) -> tuple[list[Any], list[Any], list[Any] | None] | None:
    """A plain non-empty ``dict`` whose values are all exactly of type ``kind``: its keys, its values and
    (for ``numpy.ndarray``) the distinct dtype objects met, consecutive repeats dropped; ``None`` for any
    other tree (``tree.c``)."""

def device_specs(devices: list[Any], /) -> tuple[list[tuple[Any, Any]], list[int], int] | None:
    """Each exact ``DeviceArray``'s ``(shape, dtype)`` (consecutive equal ones one shared pair) and size in
    bytes, and their sum; ``None`` where an item is not an exact ``DeviceArray`` (``tree.c``)."""

def mark_leaves(devices: list[Any] | tuple[Any, ...], state: Any, leases: int, /) -> None:
    """Each ``DeviceArray``'s ``_state`` set to ``state`` (unless ``None``) and ``leases`` added to its
    ``_leases``; ``TypeError`` (nothing changed) for any other item (``tree.c``)."""

def set_hot_types(buffer: type, array: type, block: type, health: type, slot: type, /) -> None:
    """The exact classes whose fields the compiled entries read (each derives from its fields type)."""

@final
class HostMemory:
    """``nbytes`` bytes at ``ptr`` exported as writable bytes (the buffer protocol), counting live exports."""

    nbytes: int
    def __init__(self, ptr: int, nbytes: int, /) -> None: ...
    @property
    def exports(self) -> int:
        """How many buffers it exported that are not released yet (0: no view of it is alive)."""
    def export(self) -> HostMemory:
        """The object to make a view from: this one."""

# -- lock.c: the runtime's lock --------------------------------------------------------------------

@final
class RLock:
    """``threading.RLock``'s semantics (reentrant, owned by one thread), takeable from C: the runtime's
    lock, which the compiled submit and wait take without a Python call."""

    def __init__(self) -> None: ...
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take it (again, when this thread holds it); ``False`` when not taken in time."""
    def release(self) -> None:
        """Give it back once; ``RuntimeError`` when this thread does not hold it."""
    def __enter__(self) -> bool: ...
    def __exit__(self, *exc: object) -> None: ...
    def _is_owned(self) -> bool: ...

# -- fast.c: Completion's hot paths ----------------------------------------------------------------

@final
class Fast:
    """A Completion's enqueue, wait and pinned submission in C (see ``fast.c``); also its counters."""

    seq: int
    submitted: int
    completed: int
    def __init__(
        self, completion: Any, device_error: type[BaseException], owned: Any, in_flight: Any, spin_base: float,
        spin_per_byte: float, spin_cap: float, /,
    ) -> None: ...
    def enqueue(
        self, stream: Any, copy: Callable[..., None], dst: int, src: int, nbytes: int, moved: tuple[Any, ...],
        leased: tuple[Any, ...], result: tuple[Any, ...], /,
    ) -> Record: ...
    def wait(self, record: Any, timeout: float | None = None, /) -> tuple[Any, ...]: ...
    def pinned(
        self, handle_type: type[Handle], stream: Any, copy: Callable[..., None], dst: int, src: int, nbytes: int,
        host: Any, device: Any, upload: bool, /,
    ) -> Handle: ...

# -- small.c: NumPy's array fields (the small route) -----------------------------------------------

def set_array_layout(data_offset: int, flags_offset: int, /) -> None:
    """NumPy's array struct offsets of the data pointer and the flags, verified by the caller (-1: off)."""

def clear_writeable(array: Any, /) -> bool:
    """Whether the ``numpy.ndarray`` was writeable; it is not now (needs :func:`set_array_layout`)."""

def set_writeable(array: Any, /) -> None:
    """The ``numpy.ndarray``'s writeable flag back (needs :func:`set_array_layout`)."""

# -- host.c: host copies ---------------------------------------------------------------------------

def copy_in(dst: int, capacity: int, array: Any, nbytes: int = -1, /) -> int:
    """Copy a C-contiguous buffer of at most ``capacity`` bytes to ``dst``; its size, or -1 (not taken).
    ``nbytes >= 0``: the caller vouches for an exact ``numpy.ndarray`` of that size (struct reads)."""

def data_of(array: Any, /) -> int:
    """An exact ``numpy.ndarray``'s data pointer, read from its struct (needs ``set_array_layout``)."""

def address_of(array: Any, capacity: int, nbytes: int = -1, /) -> int:
    """The address of a writable C-contiguous buffer of at most ``capacity`` bytes, or 0 (not taken)."""

def memcopy(dst: int, src: int, nbytes: int, nontemporal: bool = False, /) -> None:
    """``memcpy`` between two host addresses."""

class Leases:
    """HostLeases' table (``ferry/_routes/_base.py``) in C: NumPy arrays flagged read-only while
    transfers use them, counted per array; the last :meth:`give` restores the flag."""

    def __init__(self, ndarray_type: type, /) -> None: ...
    @property
    def table(self) -> dict[int, list[Any]]:
        """The array's address -> ``[array, count, writeable]`` of every array leased now."""
    def take(self, array: Any, writeable: bool | None = None, /) -> None:
        """Flag ``array`` read-only for one flight (``writeable``: its flag, when the caller knows it;
        an exact ndarray's is read)."""
    def give(self, array: Any, /) -> None:
        """End one flight's lease; the last one sets the flag back (through ``setflags`` for an array
        that does not own its data, which stays read-only if NumPy refuses)."""
    def take_many(self, arrays: list[Any] | tuple[Any, ...], /) -> None:
        """:meth:`take` for every array, in order, in one call: all or none (on an error the leases this
        call took are given back)."""
    def give_many(self, arrays: list[Any] | tuple[Any, ...], /) -> None:
        """:meth:`give` for every array, in one call; each is given back even when one fails (the first
        error is raised afterwards)."""

# -- dlpack.c: DLPack export and import ------------------------------------------------------------

def dlpack_capsule_destructor() -> int:
    """The address of a DLPack capsule destructor (C) that calls an unconsumed tensor's deleter
    and keeps an exception pending in the consumer intact."""

def dlpack_import(capsule: Any, /) -> tuple[int, int, int, int, tuple[int, ...], tuple[int, ...] | None, int, int, int]:
    """(managed, ptr, device_type, device_id, shape, strides or None, code, bits, lanes); renames the capsule."""

def dlpack_export(owner: Any, ptr: int, shape: tuple[int, ...], code: int, bits: int, device_type: int,
                  device_id: int, /) -> Any:
    """A 'dltensor' capsule (C order) whose tensor keeps ``owner`` alive until its deleter runs."""

def dlpack_exports_live() -> int:
    """Tensors ``dlpack_export`` made whose deleter has not run."""

def dlpack_release(managed: int, /) -> None:
    """Call an imported tensor's deleter."""

def dlpack_deleter(release: Callable[[int], None], /) -> int:
    """The address of a ``DLManagedTensor`` deleter (C) that calls ``release(address)`` while the
    interpreter runs and does nothing once it is finalized (``release`` is kept for good)."""
