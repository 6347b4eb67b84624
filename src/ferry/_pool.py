"""The pinned pool: size classes, reuse gated by fences.

``cuMemHostAlloc`` costs milliseconds (2.3 ms for 8 MiB, 99 ms for 256 MiB on
the reference machine), twenty times the DMA it enables, so pinned blocks are
allocated once and reused. Sizes are rounded up to a class with four classes
per power of two (at most 25 % slack; 4 KiB minimum), and a free block is
handed out again only for its own class.

Reuse is gated: a block comes back with an optional *fence* (anything with a
non-blocking ``done() -> bool``), the last device work that may touch it. A
block whose fence is not done is skipped, never handed out. With ferry's
ownership discipline blocks normally come back after their transfer was proven
complete, so the gate is a second line of defence (and the contract for
staging slots that recycle blocks themselves).

Releasing is safe from finalizers and any thread: it appends to a list under a
plain lock and never calls the backend. Memory is freed only from
:meth:`PinnedPool.collect`, :meth:`PinnedPool.trim` and :meth:`PinnedPool.close`,
which the runtime calls from ordinary calls.
"""

from __future__ import annotations

import threading
from typing import Protocol

from ._backends._base import Backend

__all__: list[str] = []

_MIN_CLASS = 4096


class Fence(Protocol):
    """The last device work that may touch a block."""

    def done(self) -> bool:
        """True once that work is complete; never blocks, never raises."""
        ...


def size_class(nbytes: int) -> int:
    """The pool class serving ``nbytes``: four classes per power of two."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class Block:
    """One pinned allocation of ``capacity`` bytes at ``ptr``."""

    __slots__ = ("capacity", "fence", "ptr")

    def __init__(self, ptr: int, capacity: int) -> None:
        self.ptr = ptr
        self.capacity = capacity
        self.fence: Fence | None = None


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
        self.reuses = 0
        self.leaked_bytes = 0  # blocks released after close() (never freed)

    # -- acquire / release --------------------------------------------------------
    def acquire(self, nbytes: int) -> Block:
        """A block of at least ``nbytes``, reused when one is free and fenced off."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                for i in range(len(free) - 1, -1, -1):
                    block = free[i]
                    if block.fence is None or block.fence.done():
                        del free[i]
                        block.fence = None
                        self._free_bytes -= block.capacity
                        self.reuses += 1
                        return block
        ptr = self._backend.host_alloc(cls)
        with self._lock:
            self.allocations += 1
            self._held_bytes += cls
        return Block(ptr, cls)

    def release(self, block: Block, fence: Fence | None = None) -> None:
        """Give ``block`` back. Safe from finalizers: never calls the backend."""
        block.fence = fence
        with self._lock:
            if self._closed:
                self.leaked_bytes += block.capacity
                return
            self._free.setdefault(block.capacity, []).append(block)
            self._free_bytes += block.capacity
            while self._free_bytes > self._cache_limit and self._evict_one():
                pass

    def _evict_one(self) -> bool:
        # caller holds the lock: move the largest fenced-off free block to _doomed
        for cls in sorted(self._free, reverse=True):
            blocks = self._free[cls]
            for i, block in enumerate(blocks):
                if block.fence is None or block.fence.done():
                    del blocks[i]
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
        """Free every free block whose fence is done; return the bytes freed."""
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
