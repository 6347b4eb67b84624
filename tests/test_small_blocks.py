"""Small device blocks are kept for the next fresh small array instead of freed (no driver call either way)."""

from __future__ import annotations

import gc

import numpy as np

import ferry
from ferry import testing
from ferry._memory._device import SMALL_CACHE_BLOCKS, small_class
from ferry._runtime import parts_of


def test_a_fresh_small_array_reuses_the_block_of_one_that_died(rt: ferry.Runtime) -> None:
    a = np.arange(4, dtype=np.float32)
    first = rt.upload(a).wait()[1]
    ptr = first._ptr  # (not .ptr: a raw pointer handed out marks the memory as used beyond ferry)
    used = rt.stats().device_pool_used_bytes
    del first
    gc.collect()
    again = rt.upload(a).wait()[1]  # the next fresh array of its class: the same block, no allocation
    assert again._ptr == ptr
    assert np.array_equal(rt.to_host(again), a)
    assert rt.stats().device_bytes == 16 and rt.stats().device_pool_used_bytes == used
    other = rt.empty((300,), np.float32)  # 1200 bytes: another class, another block
    assert other._ptr != ptr and small_class(1200) == 2048
    again.close()
    other.close()
    stats = rt.stats()
    assert stats.device_bytes == 0 and stats.device_pool_used_bytes == 0  # kept blocks are not in use
    rt.trim()  # gives them back to the device
    assert rt.stats().device_pool_reserved_bytes == 0


def test_a_block_with_users_beyond_ferry_is_not_kept(emu: ferry.Runtime) -> None:
    stream = testing.side_stream(emu)
    array = emu.empty((4,), np.float32)
    ptr = array._ptr
    array.record_stream(stream)  # another library's work may use it: its free waits for that work
    array.close()
    fresh = emu.empty((4,), np.float32)
    assert fresh._ptr != ptr  # not reused at once
    fresh.close()


def test_the_kept_blocks_are_bounded_and_freed_at_close() -> None:
    rt = ferry.Runtime("emulated")
    arrays = [rt.empty((8,), np.uint8) for _ in range(SMALL_CACHE_BLOCKS + 10)]
    for array in arrays:
        array.close()
    memory = parts_of(rt).memory
    assert memory._small_blocks == SMALL_CACHE_BLOCKS  # the rest were freed
    rt.close()
    assert testing.violations(rt) == []
