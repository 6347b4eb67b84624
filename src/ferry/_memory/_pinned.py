"""The pinned pool: size classes, reuse only of blocks given back.

``cuMemHostAlloc`` costs milliseconds (2.3 ms for 8 MiB, 99 ms for 256 MiB on
the reference machine), twenty times the DMA it enables, so pinned blocks are
allocated once and reused. Sizes are rounded up to a class with four classes
per power of two (at most 25 % slack; 4 KiB minimum), and a free block is
handed out again only for its own class.

A block comes back only once no device work can touch it: a buffer's block
when its transfer was proven complete and every view of it died, a staging
block when its DMA's event completed. A block that a failed copy may still
touch never comes back (it is abandoned, and counted by whoever held it).

Releasing is safe from finalizers and any thread: it appends to a list under a
plain lock and never calls the backend. Memory is freed only from
:meth:`PinnedPool.collect`, :meth:`PinnedPool.trim` and :meth:`PinnedPool.close`,
which the runtime calls from ordinary calls.
"""

from __future__ import annotations

import threading

from .._backends._base import Backend
from .._native.objects import BlockFields

__all__: list[str] = []

_MIN_CLASS = 4096


def size_class(nbytes: int) -> int:
    """The pool class serving ``nbytes``: four classes per power of two."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class Block(BlockFields):
    """One pinned allocation of ``capacity`` bytes at ``ptr``."""

    __slots__ = ()  # the fields are BlockFields' (capacity, ptr)

    def __init__(self, ptr: int, capacity: int) -> None:
        self.ptr = ptr
        self.capacity = capacity


class PinnedPool:
    """Pinned blocks by size class; see the module docstring for the contract."""

    def __init__(self, backend: Backend, cache_limit: int) -> None:
        self._backend = backend
        self._cache_limit = cache_limit
        self._lock = threading.Lock()
        self._free: dict[int, list[Block]] = {}
        self._free_bytes = 0
        self._held_bytes = 0  # every live block, free or in use
        self._doomed: list[Block] = []  # to be freed at the next collect()
        self._closed = False
        self.allocations = 0  # backend host_alloc calls

    # -- acquire / release --------------------------------------------------------
    def acquire(self, nbytes: int) -> Block:
        """A block of at least ``nbytes``, reused when one of its class is free."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                block = free.pop()
                self._free_bytes -= block.capacity
                return block
        ptr = self._backend.host_alloc(cls)
        with self._lock:
            self.allocations += 1
            self._held_bytes += cls
        return Block(ptr, cls)

    def release(self, block: Block) -> None:
        """Give ``block`` back (no device work touches it any more).

        Safe from finalizers and any thread: never calls the backend.
        """
        with self._lock:
            if self._closed:  # released after close(): the process reclaims it
                return
            self._free.setdefault(block.capacity, []).append(block)
            self._free_bytes += block.capacity
            while self._free_bytes > self._cache_limit and self._evict_one():
                pass

    def _evict_one(self) -> bool:
        # caller holds the lock: move the largest free block to _doomed
        for cls in sorted(self._free, reverse=True):
            blocks = self._free[cls]
            if blocks:
                block = blocks.pop()
                self._free_bytes -= block.capacity
                self._doomed.append(block)
                return True
        return False

    # -- freeing (ordinary calls only) ---------------------------------------------------
    def collect(self) -> None:
        """Free the blocks evicted by the cache limit."""
        if not self._doomed:
            return
        with self._lock:
            doomed, self._doomed = self._doomed, []
        for block in doomed:
            self._backend.host_free(block.ptr)
            with self._lock:
                self._held_bytes -= block.capacity

    def trim(self) -> int:
        """Free every free block; return the bytes freed."""
        with self._lock:
            while self._evict_one():
                pass
        before = self._held_bytes
        self.collect()
        return before - self._held_bytes

    def close(self) -> None:
        """Free every free block; blocks still in use are leaked when released later."""
        self.trim()
        with self._lock:
            self._closed = True

    # -- stats ----------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Pinned bytes the pool holds: in use and free."""
        return self._held_bytes

    @property
    def free_bytes(self) -> int:
        """Pinned bytes held and free for reuse."""
        return self._free_bytes
