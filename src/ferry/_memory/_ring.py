"""A process-shared ring of pinned slots: one anonymous shared file, mapped by the main process and its workers.

The main process creates the file (``memfd_create``; elsewhere an unlinked
temporary file) before it starts any worker, so it never has a name under
``/dev/shm`` and nothing is left behind whatever happens to the processes.
Workers receive its descriptor when they start (fork inherits it; spawn and
forkserver get a duplicate through :class:`SharedFile`'s pickling) and map it
once its geometry is known. The main process sizes the file from the first
batch, maps it and registers the whole mapping once with its runtime
(:meth:`ferry.Runtime.register`: page-locked in place), so that every copy from a
slot is one DMA with no host copy. Only the main process touches the device.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._errors import BufferMovedError, FerryError

if TYPE_CHECKING:
    from ._register import Registration

__all__: list[str] = []


class Runtime(Protocol):
    """What the ring asks of the runtime that owns it (``ferry.Runtime``, which sits above)."""

    @property
    def closed(self) -> bool:
        """Whether the runtime was closed."""
        ...

    def register(self, array: np.ndarray[Any, Any]) -> Registration:
        """Pin ``array`` in place for the runtime's device."""
        ...

    def poll(self) -> None:
        """Retire what completed."""
        ...

PAGE = mmap.PAGESIZE
ALIGN = 256  # each leaf of a slot starts on this boundary
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _new_file() -> int:
    create = getattr(os, "memfd_create", None)
    if create is not None:
        try:
            return int(create("ferry-loader-ring", os.MFD_CLOEXEC))
        except OSError:
            pass
    fd, path = tempfile.mkstemp(prefix="ferry-ring-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)  # anonymous from the start: nothing to clean up by name
    return fd


def _rebuild(fd: Any) -> SharedFile:
    return SharedFile(fd.detach() if hasattr(fd, "detach") else int(fd))


class SharedFile:
    """A file descriptor that travels to a worker process: inherited under fork, duplicated
    into the child under spawn and forkserver (as :mod:`multiprocessing.heap` passes its arenas)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (reduction.DupFd(self.fd),)


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Ring:
    """The main process's side: the shared file, its mapping and its registration."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.fd = _new_file()
        self.slot_bytes = 0
        self.slots = 0
        self._map: mmap.mmap | None = None
        self._array: np.ndarray[Any, Any] | None = None
        self._registration: Registration | None = None

    @property
    def sized(self) -> bool:
        return self._map is not None

    @property
    def nbytes(self) -> int:
        """Bytes mapped and pinned (0 until sized)."""
        return self.slot_bytes * self.slots if self._map is not None else 0

    @property
    def buffer(self) -> mmap.mmap:
        assert self._map is not None
        return self._map

    def shared(self) -> SharedFile:
        return SharedFile(self.fd)

    def size(self, slot_bytes: int, slots: int) -> None:
        """Grow the file to ``slots`` slots of ``slot_bytes`` (a multiple of the page), map it, pin it."""
        assert self._map is None and slot_bytes % PAGE == 0 and slots >= 1
        total = slot_bytes * slots
        os.ftruncate(self.fd, total)
        mapping = mmap.mmap(self.fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        array = np.frombuffer(mapping, dtype=np.uint8)
        try:
            registration = self.runtime.register(array)
        except BaseException:
            del array
            mapping.close()
            raise
        self._map, self._array, self._registration = mapping, array, registration
        self.slot_bytes, self.slots = slot_bytes, slots

    def span(self, slot: int) -> tuple[int, int]:
        """The address and size of ``slot`` in the mapping."""
        assert self._array is not None
        return int(self._array.ctypes.data) + slot * self.slot_bytes, self.slot_bytes

    def view(self, slot: int, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
        """The array a worker wrote at ``offset`` of ``slot`` (no copy)."""
        return np.ndarray(shape, dtype=np.dtype(dtype), buffer=self._map, offset=slot * self.slot_bytes + offset)

    def release(self, timeout: float = 10.0) -> None:
        """Unpin (once no copy uses the memory), unmap (once no view is left) and close the file. Idempotent.

        A registration that a failed copy keeps in use forever is left to the runtime's close."""
        registration, self._registration = self._registration, None
        if registration is not None and registration.active and not self.runtime.closed:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    registration.release()
                    break
                except BufferMovedError:
                    if time.monotonic() > deadline:
                        break
                    with contextlib.suppress(FerryError):
                        self.runtime.poll()  # dropped handles still reading the ring retire
                    time.sleep(0.001)
                except FerryError:
                    break
        del registration
        self._array = None
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped when the last one goes
                mapping.close()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class WorkerRing:
    """A worker's side: the same file, mapped once its geometry arrives. No device call."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.slot_bytes = 0
        self._map: mmap.mmap | None = None

    def slot(self, slot: int, slot_bytes: int, slots: int) -> memoryview:
        """The writable bytes of ``slot``."""
        if self._map is None:  # page tables filled at once: no page fault while collating, ever
            self._map = mmap.mmap(self.fd, slot_bytes * slots, flags=mmap.MAP_SHARED | _POPULATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.slot_bytes = slot_bytes
        start = slot * self.slot_bytes
        return memoryview(self._map)[start:start + self.slot_bytes]

    def close(self) -> None:
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
