"""Pinned leaves: NumPy arrays backed by pooled pinned blocks, for offloaded structures.

``Runtime.download_tree(tree, pinned=True)`` lands every leaf in a block of
the runtime's pinned pool and hands it out as an ordinary ``numpy.ndarray``.
The host routes know these arrays: an upload from one, or a download into
one, is a single DMA with no staging copy (:meth:`PinnedLeaves.covering`
finds the block holding an address range, as for registered memory).

Lifetime
--------
Each leaf derives from one private base array built over its block through a
ctypes object, so every slice, reshape and
``view()`` of the leaf keeps that base alive. The block goes back to the pool
when the base dies, that is, when the leaf and every view of it were
collected; never while a view lives, and never while a transfer uses it (the
transfer's record holds the array until its copy is proven complete; a failed
transfer keeps it forever, so a block the device may still touch is never
reused). Returned blocks are reused by the next leaves of their size class,
so repeated offload and reload rounds stop growing the pool once its free
blocks cover one round.

The memory is the runtime's: keep the runtime open while the leaves are used
(copy a leaf, ``numpy.array(leaf)``, to keep its bytes beyond ``close()``).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ._slab import ALIGN, aligned_offsets

if TYPE_CHECKING:
    from ._pinned import PinnedPool

__all__: list[str] = []

FEW_RANGES = 16
""":meth:`PinnedLeaves.covering_many` searches up to this many ranges one by one."""

FEW_SIZES = 64
""":func:`layout` places up to this many arrays in a loop, more with NumPy."""


class Leaf:
    """One pinned leaf's block, as the host routes see it (the registered route counts ``_uses``)."""

    __slots__ = ("_uses", "alive", "nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.alive = True  # False once the base died: the block is back in the pool
        self._uses = 0

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside this live leaf's block."""
        return self.alive and self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes


class Held(NamedTuple):
    """A block :meth:`PinnedLeaves.block` took: its base array (every array made over it keeps it alive), the
    arrays' offsets in it, its leaf entry, and ``give_back()``, which returns the block to the pool now (only
    while nothing uses it: no array was made over it, no copy into it is queued)."""

    base: np.ndarray[Any, Any]
    offsets: list[int]
    leaf: Leaf
    give_back: Callable[[], Any]


def _start(leaf: Leaf) -> int:
    return leaf.ptr


class PinnedLeaves:
    """A runtime's pinned leaves: make one, find the one covering an address range."""

    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._leaves: list[Leaf] = []  # sorted by address (blocks never overlap)
        self._starts: list[int] = []
        self.live_bytes = 0  # bytes of the blocks held by leaves alive now
        self.made = 0  # leaves made so far
        self._dead = 0  # entries of leaves that died since the last purge

    @property
    def active(self) -> bool:
        """Whether any leaf may be alive (a cheap test before :meth:`covering`)."""
        return bool(self._leaves)

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """A new uninitialized C-contiguous array of ``shape`` and ``dtype`` on a pooled pinned block.

        Raises MemoryError, ValueError or the pool's DeviceError when no block can be had.
        """
        return self.arrays([(shape, dtype)])[0]

    def arrays(self, specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[np.ndarray[Any, Any]]:
        """:meth:`array` for every ``(shape, dtype)`` pair, all or none: when a block cannot be had the
        blocks taken so far go back to the pool and the error is raised. Each array has a block of its
        own (see :meth:`shared` for one block for all)."""
        blocks: list[Any] = []
        sizes: list[int] = []
        try:
            for shape, dtype in specs:
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                sizes.append(nbytes)
                blocks.append(self.pool.acquire(max(nbytes, 1)))
        except BaseException:
            for block in blocks:
                self.pool.release(block)
            raise
        out: list[np.ndarray[Any, Any]] = []
        made: list[Leaf] = []
        held = 0
        for (shape, dtype), nbytes, block in zip(specs, sizes, blocks, strict=True):
            raw = (ctypes.c_ubyte * block.capacity).from_address(block.ptr)
            base = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
            leaf = Leaf(block.ptr, block.capacity)
            weakref.finalize(base, self._died, leaf, block)
            made.append(leaf)
            held += block.capacity
            out.append(base[:nbytes].view(dtype).reshape(shape))
        with self._lock:
            self._purge()
            if len(made) == 1:
                at = bisect.bisect_left(self._starts, made[0].ptr)
                self._leaves.insert(at, made[0])
                self._starts.insert(at, made[0].ptr)
            else:  # one sort of the merged list (runs already sorted: linear)
                self._leaves.extend(sorted(made, key=_start))
                self._leaves.sort(key=_start)
                self._starts = [leaf.ptr for leaf in self._leaves]
            self.live_bytes += held
            self.made += len(made)
        return out

    def shared(self, specs: list[tuple[tuple[int, ...], np.dtype[Any]]],
               sizes: list[int] | None = None) -> list[np.ndarray[Any, Any]]:
        """:meth:`array` for every ``(shape, dtype)`` pair, all on one pooled block, each at an offset
        aligned to :data:`ALIGN` bytes, back to back (a tree's leaves then move as few large DMAs). The
        block goes back to the pool once every one of the arrays, and every view of them, was collected.
        ``sizes``: each pair's bytes, when the caller knows them. Raises as :meth:`array` (nothing taken)."""
        if sizes is None:
            sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
        held = self.block(sizes)
        try:
            return _views(held.base, specs, held.offsets, sizes)
        except BaseException:
            held.give_back()
            raise

    def block(self, sizes: list[int]) -> Held:
        """One pooled block for arrays of ``sizes`` bytes back to back, each at a multiple of :data:`ALIGN`
        (what :meth:`shared` makes its arrays over; a download can queue its copies into the block first and
        make the arrays with :func:`views` while they run). The block is a live leaf from here on, and goes
        back to the pool once the base and every view of it were collected, or at ``give_back()``. Raises as
        :meth:`array` (nothing taken)."""
        offsets, total = layout(sizes)
        block = self.pool.acquire(max(total, 1))
        try:
            raw = (ctypes.c_ubyte * block.capacity).from_address(block.ptr)
            base = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
            leaf = Leaf(block.ptr, block.capacity)
            finalizer = weakref.finalize(base, self._died, leaf, block)
        except BaseException:
            self.pool.release(block)
            raise
        with self._lock:
            self._purge()
            at = bisect.bisect_left(self._starts, leaf.ptr)
            self._leaves.insert(at, leaf)
            self._starts.insert(at, leaf.ptr)
            self.live_bytes += block.capacity
            self.made += len(sizes)
        return Held(base, offsets, leaf, finalizer)

    def _died(self, leaf: Leaf, block: Any) -> None:
        # a finalizer (any thread, maybe inside another call of this object): flag, then give back
        leaf.alive = False
        self._dead += 1
        self.live_bytes -= leaf.nbytes
        self.pool.release(block)

    def _purge(self) -> None:
        """Drop the entries of dead leaves (when any died since the last purge). Lock held."""
        if not self._dead:
            return
        self._dead = 0
        kept = [leaf for leaf in self._leaves if leaf.alive]
        self._leaves = kept
        self._starts = [leaf.ptr for leaf in kept]

    def covering_many(self, ptrs: list[int], sizes: list[int]) -> list[Leaf | None]:
        """:meth:`covering` for many ranges at once (one vectorised search for all of them; a few are
        searched one by one, which costs less than the arrays)."""
        with self._lock:
            leaves = self._leaves
            if not leaves or not ptrs:
                return [None] * len(ptrs)
            if len(ptrs) <= FEW_RANGES:
                return [self._covering_locked(p, n) for p, n in zip(ptrs, sizes, strict=True)]
            starts = np.array(self._starts, np.uint64)
            ends = np.array([leaf.ptr + leaf.nbytes if leaf.alive else 0 for leaf in leaves], np.uint64)
        p = np.array(ptrs, np.uint64)
        at = np.searchsorted(starts, p, side="right").astype(np.int64) - 1
        inside = (at >= 0) & (p + np.array(sizes, np.uint64) <= ends[np.maximum(at, 0)])
        if not inside.any():
            return [None] * len(ptrs)
        return [leaves[i] if hit else None for i, hit in zip(at.tolist(), inside.tolist(), strict=True)]

    def covering(self, ptr: int, nbytes: int) -> Leaf | None:
        """The live leaf whose block holds ``[ptr, ptr + nbytes)``, if any."""
        with self._lock:
            return self._covering_locked(ptr, nbytes)

    def _covering_locked(self, ptr: int, nbytes: int) -> Leaf | None:
        at = bisect.bisect_right(self._starts, ptr) - 1
        if at >= 0:
            leaf = self._leaves[at]
            if leaf.covers(ptr, nbytes):
                return leaf
        return None


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of arrays of ``sizes`` bytes placed back to back, each at a multiple of :data:`ALIGN` (an
    empty one takes :data:`ALIGN` bytes too: no two share an address), and the bytes they span."""
    if not sizes:
        return [], 0
    if len(sizes) <= FEW_SIZES:  # a few: a loop costs less than the arrays
        return aligned_offsets(sizes)
    spans = (np.maximum(np.array(sizes, np.int64), 1) + (ALIGN - 1)) // ALIGN * ALIGN
    ends = np.cumsum(spans)
    return (ends - spans).tolist(), int(ends[-1])


def views(base: np.ndarray[Any, Any], specs: list[tuple[tuple[int, ...], np.dtype[Any]]], offsets: list[int],
          sizes: list[int]) -> list[np.ndarray[Any, Any]]:
    """The arrays of ``specs`` over ``base`` at ``offsets`` (see :func:`_views`)."""
    return _views(base, specs, offsets, sizes)


def _views(base: np.ndarray[Any, Any], specs: list[tuple[tuple[int, ...], np.dtype[Any]]], offsets: list[int],
           sizes: list[int]) -> list[np.ndarray[Any, Any]]:
    """The arrays of ``specs`` over ``base`` at ``offsets``: each run of leaves of one shape and dtype (a
    state dict's blocks, a model's layers) is one strided array of the run, and its leaves are that array's
    rows (views made by NumPy's iteration, not one Python slicing per leaf). Each is C-contiguous, writable
    and keeps ``base`` alive."""
    out: list[np.ndarray[Any, Any]] = []
    i = 0
    for (shape, dtype), run_specs in itertools.groupby(specs):  # runs of equal (shape, dtype), compared in C
        j = i + len(list(run_specs))
        nbytes = sizes[i]
        if j - i < 8 or not shape or not nbytes or dtype.fields is not None or dtype.subdtype is not None:
            # (a structured dtype's rows would carry copies of the dtype, not the leaf's own object)
            for k in range(i, j):
                if sizes[k]:
                    out.append(base[offsets[k]:offsets[k] + sizes[k]].view(specs[k][1]).reshape(specs[k][0]))
                else:  # (an empty slice of base would start at base's own address, not at its offset)
                    out.append(np.ndarray(specs[k][0], specs[k][1], buffer=base, offset=offsets[k]))
        else:
            strides = [dtype.itemsize]
            for dim in reversed(shape[1:]):
                strides.insert(0, strides[0] * dim)
            run = np.ndarray((j - i, *shape), dtype, buffer=base, offset=offsets[i],
                             strides=(offsets[i + 1] - offsets[i], *strides))
            out.extend(run)
        i = j
    return out
