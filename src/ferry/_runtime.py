"""Runtime, the facade: it builds its parts, checks arguments, picks a route and returns a handle.

Data flows one way: a public call checks its arguments and moves ownership
here, under the runtime's one lock; a route enqueues through the backend
(copy, event record, stream wait); a handle comes back, and it asks the
completion part (``_completion.py``) about its record. Blocking waits happen
outside the lock, so one thread waiting never stops another from submitting.

The pinned fast path stays inline here: :meth:`Runtime.upload_pending` and
:meth:`Runtime.download_pending` admit the common case with one expression
and enqueue at once; everything else goes to its route's module. Where the
extension runs, a runtime replaces both, and :meth:`Runtime.upload`, by
compiled entries that do the same common case in one C call and call these
methods for everything else (``Parts.compiled_entries``).

Every refusal happens before anything is enqueued and raises
:class:`~ferry.TransferSubmitError` with every argument left as it was.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _lifecycle, _trees
from ._args import check_runtime_args
from ._backends._base import Backend
from ._buffer import PinnedHostBuffer
from ._device_array import DeviceArray
from ._interop._host import host_arg
from ._lifecycle import Health
from ._memory._register import Registration
from ._parts import Parts
from ._pending import HostArray, PendingCopy, PendingDownload, PendingUpload
from ._routes import _file
from ._routes._peer import check_copy, copy_between
from ._routes._pinned import submit_pinned
from ._routes._staged import StagingConfig
from ._state import OWNED
from ._stats import RuntimeStats, snapshot

__all__ = ["Runtime"]


def parts_of(runtime: Runtime) -> Parts:
    """A runtime's parts, for :mod:`ferry.testing` and the benchmarks (test-facing)."""
    return runtime._parts


class Runtime:
    """One device, its copy streams and everything ferry owns on it.

    Parameters
    ----------
    backend
        ``"auto"`` (CUDA when a GPU is usable, else the emulated device; the
        ``FERRY_BACKEND`` environment variable can force either), ``"cuda"``
        (raises :class:`~ferry.DeviceUnavailableError` with the reason when no
        GPU is usable) or ``"emulated"``.
    device
        Device index.
    retirement_capacity
        Bound of the retirement queue of dropped handles; when it is full the
        next submission waits for the oldest record.
    pinned_cache_bytes
        Free pinned memory the pool keeps for reuse; beyond it blocks are freed.
    emulated_bandwidth
        The emulated device's modelled copy bandwidth (bytes/s, per copy stream). Ignored on CUDA.
    emulated_latency
        The emulated device's modelled latency of each operation (s). Ignored on CUDA.
    peer_access
        Whether :meth:`copy_pending` may use peer access where the pair
        supports it; ``False`` forces the staged route (to compare them). On
        the emulated machine it also withdraws the device's peer capability.
    staging
        How pageable NumPy arrays are staged (:class:`~ferry.StagingConfig`);
        the default's worker count is capped at the machine's CPU count.
    host_cache_bytes
        Resident host memory kept for the fresh outputs of :meth:`download`
        (first-touch page faults cost more than the copy); 0 disables it.
    device_pool_limit
        Device memory the stream-ordered pool keeps reserved at synchronization
        points (its release threshold); ``None`` keeps all of it until
        :meth:`trim`. Past it allocations still succeed and the excess is given
        back at the next synchronization (docs/memory.md).

    Guarantees
    ----------
    Uploads and downloads use separate copy streams, so both directions run at
    once. ``close()`` (also run at interpreter exit) waits for everything in
    flight, then frees what the runtime owns; afterwards every call raises. A
    runtime dropped without ``close()`` is closed for you, with a
    :class:`ResourceWarning`. A runtime inherited by a forked child refuses
    every call with a clear error and never touches the device.
    """

    def __init__(
        self,
        backend: str = "auto",
        device: int = 0,
        *,
        retirement_capacity: int = 1024,
        pinned_cache_bytes: int = 4 << 30,
        emulated_bandwidth: float = 25e9,
        emulated_latency: float = 5e-6,
        peer_access: bool = True,
        staging: StagingConfig | None = None,
        host_cache_bytes: int = 2 << 30,
        device_pool_limit: int | None = None,
    ) -> None:
        check_runtime_args(device, retirement_capacity, device_pool_limit)
        chosen = _lifecycle.make_backend(backend, int(device), emulated_bandwidth, emulated_latency, peer_access)
        parts = self._parts = Parts(chosen, Health(), {
            "retirement_capacity": retirement_capacity, "pinned_cache_bytes": pinned_cache_bytes, "staging": staging,
            "peer_access": peer_access, "host_cache_bytes": host_cache_bytes, "device_pool_limit": device_pool_limit,
        })
        # the hot path reads these directly
        self._backend: Backend = chosen
        self._health = parts.health
        self._lock = parts.lock
        self._completion = parts.completion
        self._h2d = parts.h2d
        self._d2h = parts.d2h
        self._small = parts.host.small  # small NumPy arrays: tried first by upload() and download()
        for name, entry in parts.compiled_entries(self, Runtime).items():
            setattr(self, name, entry)  # the common cases in one C call each, where the extension runs
        _lifecycle.register(parts)
        finalizer = weakref.finalize(self, _lifecycle.collected_unclosed, parts, repr(self))
        finalizer.atexit = False  # at exit the lifecycle closes every open runtime, quietly

    # -- identity -------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"emulated"``."""
        return str(self._backend.name)

    @property
    def device(self) -> int:
        """The device index."""
        return int(self._backend.device)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._health.closed

    def info(self) -> dict[str, Any]:
        """Backend, device name, driver, link and pool state, as a dict."""
        return self._parts.info()

    def __repr__(self) -> str:
        state = "closed" if self._health.closed else "open"
        return f"<ferry.Runtime {self.backend} device {self.device} {state}>"

    def __enter__(self) -> Runtime:
        """``with rt:`` closes the runtime on exit; entering a closed runtime raises
        :class:`~ferry.RuntimeClosedError`."""
        self._health.check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- allocation -----------------------------------------------------------------------------
    def pinned(self, nbytes: int) -> PinnedHostBuffer:
        """An owned pinned host buffer of ``nbytes`` bytes, served from the pool.

        A size served before is reused (microseconds) once its last transfer
        completed; a new size costs one pinned allocation (milliseconds).

        Raises
        ------
        ValueError
            ``nbytes < 1`` (or absurdly large).
        TypeError
            ``nbytes`` is not an int.
        RuntimeClosedError
            The runtime is closed (or unusable in this forked child).
        MemoryError
            The device could not pin that much memory.
        FerryError
            The device refused the allocation for another reason.
        """
        return self._parts.pinned(self, nbytes)

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> DeviceArray:
        """An uninitialized C-contiguous device array, owned by the caller.

        Any fixed-size NumPy dtype is accepted. The memory comes from the
        runtime's stream-ordered pool (microseconds once the pool is warm) and
        is usable on every stream at once. It goes back to the pool by
        ``close()`` or when the array is collected (at the runtime's next
        call), after every stream that may still use it (docs/memory.md).
        """
        return self._parts.empty(self, shape, dtype)

    # -- pinned submissions -------------------------------------------------------------------------
    def upload_pending(
        self, buffer: PinnedHostBuffer, destination: DeviceArray
    ) -> PendingUpload[PinnedHostBuffer, DeviceArray]:
        """Copy ``destination.nbytes`` bytes from the start of ``buffer`` into ``destination``.

        Both objects move into the transfer: until ``wait()`` hands them back
        as ``(buffer, destination)`` every data access raises
        :class:`~ferry.BufferMovedError`. Returns without waiting for the copy.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued and both objects are unchanged: wrong types,
            a buffer smaller than the destination, a buffer with live views, an
            object in flight, abandoned, closed or of another runtime, a
            read-leased destination, a closed runtime.
        """
        completion = self._completion
        self._lock.acquire()  # not ``with``: on the hot path the statement costs twice the two calls
        try:
            # One expression for the common case; the slow path names the problem.
            if not (
                self._health.refusal is None
                and type(buffer) is PinnedHostBuffer
                and type(destination) is DeviceArray
                and buffer._runtime is self
                and destination._runtime is self
                and buffer._state is OWNED
                and destination._state is OWNED
                and not destination._leases
                and destination._ready is None
                and not buffer._base.exports  # type: ignore[union-attr]  # owned: it has a base
                and buffer._nbytes >= destination._nbytes
            ):
                return PendingUpload(completion, submit_pinned(completion, self, self._h2d, True, buffer, destination))
            return completion.submit_pinned(  # runs the maintenance a submission owes first
                PendingUpload, self._h2d, self._backend.htod_record, destination._ptr, buffer._block.ptr,
                destination._nbytes, buffer, destination, True,
            )
        finally:
            self._lock.release()

    def download_pending(
        self, source: DeviceArray, buffer: PinnedHostBuffer
    ) -> PendingDownload[DeviceArray, PinnedHostBuffer]:
        """Copy ``source.nbytes`` bytes from ``source`` into the start of ``buffer``.

        The buffer moves into the transfer; the source is read-leased: it may
        be the source of further downloads meanwhile, but not an upload
        destination, and it is not freed before the copy completes even if
        every user reference to it is dropped. ``wait()`` returns
        ``(source, buffer)``.

        Raises
        ------
        TransferSubmitError
            As for :meth:`upload_pending`; nothing was enqueued.
        """
        completion = self._completion
        self._lock.acquire()
        try:
            if not (
                self._health.refusal is None
                and type(source) is DeviceArray
                and type(buffer) is PinnedHostBuffer
                and buffer._runtime is self
                and source._runtime is self
                and buffer._state is OWNED
                and source._state is OWNED
                and source._ready is None
                and not buffer._base.exports  # type: ignore[union-attr]  # owned: it has a base
                and buffer._nbytes >= source._nbytes
            ):
                return PendingDownload(completion, submit_pinned(completion, self, self._d2h, False, buffer, source))
            return completion.submit_pinned(
                PendingDownload, self._d2h, self._backend.dtoh_record, buffer._block.ptr, source._ptr,
                source._nbytes, buffer, source, False,
            )
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Submit the copies made inside the block together, behind one completion event per stream.

        Inside ``with rt.batch():`` (on this thread) each submission is checked
        and takes ownership at once, but its copy starts only when the block
        exits, or earlier when a handle of the block is polled, waited or handed
        off, or 256 copies wait on its stream: then those go to the device as
        one batch (``cuMemcpyBatchAsync`` on CUDA 12.8+) with one shared event;
        a batch the device refuses fails its transfers. The way to move many
        small pieces; handles keep their contract. Nested blocks join the outer.
        """
        self._health.check_open()
        with self._completion.batch():
            yield

    # -- pageable routes ----------------------------------------------------------------------------
    def upload(
        self, source: HostArray, destination: DeviceArray | None = None
    ) -> PendingUpload[HostArray, DeviceArray]:
        """Copy a NumPy array (pageable or registered) to the device without blocking.

        A CPU array exporting DLPack or the buffer protocol (a CPU PyTorch tensor) is viewed without a copy.

        ``destination`` must have the source's shape and dtype; when ``None`` a
        new device array is allocated. ``wait()`` returns ``(source,
        destination)``. Non-contiguous sources are accepted and copied once.

        Routes: a registered source (:meth:`register`) is copied by one DMA
        with no host copy; a C-contiguous one up to 64 KiB through a pinned
        slot of a ring, one up to ``StagingConfig.direct_bytes`` through one
        pooled pinned block; anything larger is staged in chunks through the
        staging workers' pinned slots, host copies and DMAs overlapped.

        While pending, ``source`` is flagged read-only (restored by ``wait()``).
        That guards this array object only: other views of the same memory,
        and raw pointers, are not guarded.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued; the arguments are unchanged (and a
            destination ferry allocated for this call is freed again).
        """
        record = self._small.upload(self, source, destination)  # None: not a small array
        return PendingUpload(self._completion, record or self._parts.host.upload(self, source, destination, self.empty))

    def download(
        self, source: DeviceArray, out: np.ndarray[Any, Any] | None = None
    ) -> PendingDownload[DeviceArray, np.ndarray[Any, Any]]:
        """Copy a device array into a NumPy array without blocking.

        ``out`` must be a writable array (or CPU array, as :meth:`upload` takes) of the source's shape
        and dtype (any layout); when ``None`` a new one is allocated, large ones on resident memory
        recycled from earlier outputs that were dropped (see ``host_cache_bytes``), so
        first-touch page faults stay out of the copy.
        ``wait()`` returns ``(source, out)``. The source is read-leased, as
        for :meth:`download_pending`; ``out`` is flagged read-only while
        pending and holds the bytes once ``wait()`` returns. A failed download
        publishes nothing: ``wait()`` raises and ``out`` is not returned.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued; the arguments are unchanged.
        """
        record = self._small.download(self, source, out)  # None: not a small array
        return PendingDownload(self._completion, record or self._parts.host.download(self, source, out))

    def upload_tree(self, tree: Any, destination: Any = None, *, to: str | None = None) -> PendingUpload[Any, Any]:
        """Upload every array of a structure (nested dicts, lists, tuples) in one submission.

        ``wait()`` returns ``(tree, device_tree)``; ``destination`` (same structure) is filled, else
        fresh arrays are made (``to="torch" | "cupy" | "jax"``: that library's). Everything is checked
        before anything moves: :class:`~ferry.TransferSubmitError` leaves every leaf as it was; one
        failed leaf fails the tree (``wait()`` raises, nothing is published). See docs/trees.md.
        """
        return _trees.upload_tree(self, tree, destination, to)

    def download_tree(self, tree: Any, out: Any = None, *, pinned: bool = False) -> PendingDownload[Any, Any]:
        """Download every device array of a structure in one submission; ``wait()`` returns ``(tree, host_tree)``.

        ``out`` (same structure) is filled, else fresh arrays are made: with ``pinned=True`` on pooled
        pinned blocks (back to the pool once collected; uploading them is one DMA each). Refusals and
        failures as for :meth:`upload_tree`. See docs/trees.md.
        """
        return _trees.download_tree(self, tree, out, pinned)

    def register(self, array: Any) -> Registration:
        """Pin a C-contiguous NumPy array (or CPU array, as :meth:`upload` takes) in place for repeated transfers.

        Afterwards :meth:`upload` from it and :meth:`download` into it take the
        pinned route: one DMA, no host copy. Undone by
        :meth:`Registration.release` or :meth:`close`, never while a transfer
        uses it. Pinning costs milliseconds per hundred MiB: register arrays
        that are transferred many times.
        """
        self._health.check_open()
        return self._parts.registrations.register(host_arg(array, "register"))

    # -- blocking conveniences --------------------------------------------------------------------
    def to_device(self, array: HostArray) -> DeviceArray:
        """Copy a NumPy array to a new device array and wait: ``upload(array).wait()[1]``.

        Like :meth:`upload` it takes a NumPy array or a CPU array (convert other
        sequences with ``numpy.asarray`` first) and refuses anything else with
        :class:`~ferry.TransferSubmitError`.
        """
        return self.upload(array).wait()[1]

    def to_host(self, array: DeviceArray) -> np.ndarray[Any, Any]:
        """Copy a device array into a new NumPy array and wait: ``download(array).wait()[1]``.

        Like :meth:`to_device`, it waits as ``wait()`` does: Ctrl-C interrupts it."""
        result = self.download(array).wait()[1]
        return result

    # -- files ------------------------------------------------------------------------------------
    def upload_file(
        self, file: Any, destination: Any, *, offset: int = 0, direct: bool | None = None
    ) -> PendingUpload[Any, Any]:
        """Read ``destination.nbytes`` bytes of ``file`` (a path or an open binary file) at ``offset``
        into ``destination`` (a :class:`DeviceArray`, or a CUDA array of another library, as for
        :meth:`upload_pending`) without blocking; ``wait()`` returns ``(file, destination)``.

        Reads go straight into pinned slots (``pread``, no mmap), several at once, each slot's DMA
        issued as its read completes; ``direct`` picks ``O_DIRECT`` (``None``: the page cache unless
        the range is not cached; docs/checkpoints.md). The destination moves into the transfer. A read
        that fails or ends early (a truncated file) fails the transfer with an error naming the file
        and the byte offset. Raises :class:`~ferry.TransferSubmitError`, nothing changed, for a file
        that cannot be opened or is too short, or an argument refused as for :meth:`upload_pending`.
        """
        return _file.upload_file(self, self._parts, file, destination, offset, direct)

    def download_file(
        self, source: Any, file: Any, *, offset: int = 0, direct: bool | None = None
    ) -> PendingDownload[Any, Any]:
        """Write ``source``'s bytes into ``file`` (a path, created if missing, or an open binary file) at
        ``offset`` without blocking; ``wait()`` returns ``(source, file)``. The source is read-leased
        as for :meth:`download_pending`; the file is never truncated. A failed write fails the transfer."""
        return _file.download_file(self, self._parts, source, file, offset, direct)

    # -- several devices ----------------------------------------------------------------------
    def copy_pending(self, source: DeviceArray, destination: DeviceArray) -> PendingCopy:
        """Copy ``source.nbytes`` bytes from ``source`` into ``destination``, which belongs to this runtime.

        ``source`` may belong to this runtime (same device) or to the runtime
        of another device of the same backend. The route (:func:`ferry.routes`):
        one ``cuMemcpyPeerAsync`` when the pair has peer access (enabled on
        first use), else chunks staged through pinned host memory, else (same
        device) ``cuMemcpyDtoDAsync``. Ownership as everywhere: the destination
        moves into the transfer, the source is read-leased (in its own
        runtime); ``wait()`` returns ``(source, destination)``; a failure
        publishes nothing and abandons both. Close the destination's runtime,
        or wait, before closing the source's.

        Raises
        ------
        TransferSubmitError
            Nothing was enqueued; both arrays are unchanged.
        """
        other = check_copy(self, source, destination, Runtime)
        return PendingCopy(self._completion, copy_between(self, self._parts, other, other._parts, source, destination))

    # -- stats and lifetime ---------------------------------------------------------------------------
    def poll(self) -> None:
        """Release what dropped handles held once their copies completed. Never blocks
        (unless the retirement queue is over its bound)."""
        self._parts.poll()

    def stats(self) -> RuntimeStats:
        """A consistent snapshot of the runtime's counters (works after close too)."""
        with self._lock:
            return snapshot(self._parts)

    def trim(self, keep_bytes: int = 0) -> None:
        """Give the device pool's unused memory back to the device (``cuMemPoolTrimTo``), keeping at
        most ``keep_bytes`` reserved. Memory in use, or whose free waits for work still running, stays."""
        self._parts.trim(keep_bytes)

    def close(self, timeout: float | None = None) -> None:
        """Wait for everything in flight, release the retirement queue, free what the runtime owns.

        Idempotent; a negative or NaN ``timeout`` raises ``ValueError``. While it waits the runtime
        stays open (submissions are accepted, and waited for too). ``TimeoutError`` after ``timeout``
        seconds, or Ctrl-C, leaves it open and unchanged: close() again later.
        Then it closes in one step: a ``wait()`` or future already waiting on a
        transfer gets its result; every other call on the runtime, its buffers
        and its handles raises. Abandoned memory stays allocated (the device
        may still touch it). In a forked child it only marks the runtime
        closed. See docs/waiting.md.
        """
        self._parts.close(timeout)

