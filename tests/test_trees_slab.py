"""A tree's fresh device leaves: views of one device allocation, made and adopted in one compiled call.

``upload_tree`` into fresh destinations makes every leaf a view of one device slab. The compiled
``slab_views`` makes the views and adopts them (the slab's weak references, which it needs to close them
with the runtime); the shape tuples and weak references it makes are not tracked by the collector. The slab
is freed once its last view went, whichever way the views go.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferry
from ferry import _native
from ferry._memory import _leaves
from ferry._memory._slab import ALIGN, slab_layout
from ferry._runtime import parts_of


@pytest.fixture
def native(emu: ferry.Runtime) -> ferry.Runtime:
    if _native.load() is None:
        pytest.skip("the compiled extension is not here")
    return emu


def _tree(n: int) -> dict[str, np.ndarray[Any, Any]]:
    return {f"w{i}": np.full((i % 3 + 1, 7), i, np.float32) for i in range(n)}


def test_fresh_leaves_are_adopted_views_of_one_allocation(native: ferry.Runtime) -> None:
    rt = native
    tree = _tree(50)
    _, dev = rt.upload_tree(tree).wait()
    views = list(dev.values())
    slab = views[0]._memory
    assert all(v._memory is slab for v in views)
    assert slab.arrays == views  # adopted, in order (one weak reference each)
    assert len(slab._views) == len(views)
    assert not any(gc.is_tracked(ref) for ref in slab._views)
    assert not any(gc.is_tracked(v._shape) for v in views)
    assert not any(gc.is_tracked(v) for v in views)
    assert all(v.shape == tree[k].shape and v.dtype == tree[k].dtype for k, v in dev.items())
    memory = parts_of(rt).memory
    assert slab in memory.arrays
    _, back = rt.download_tree(dev).wait()
    assert all(np.array_equal(back[k], v) for k, v in tree.items())


def test_a_slab_is_freed_once_its_last_view_went(native: ferry.Runtime) -> None:
    rt = native
    memory = parts_of(rt).memory
    before = memory.bytes
    _, dev = rt.upload_tree(_tree(40)).wait()
    assert memory.bytes > before
    views = list(dev.values())
    del dev
    for view in views[:20]:
        view.close()  # some closed
    del views[:20]
    gc.collect()
    rt.poll()
    assert memory.bytes > before  # the others still hold it
    del views  # the rest collected
    gc.collect()
    rt.poll()
    assert memory.bytes == before


def test_the_runtime_closes_the_live_views_of_a_slab(native: ferry.Runtime) -> None:
    rt = native
    _, dev = rt.upload_tree(_tree(10)).wait()
    rt.close()
    assert {v.state for v in dev.values()} == {"closed"}


def test_views_of_one_shape_share_it_and_every_view_has_its_own(native: ferry.Runtime) -> None:
    rt = native
    shapes = [(2, 3), (2, 3), (2, 3), (4,), (4,), (2, 3), (), (), (0,), (0,), (3, 0, 2), (2, 3)]
    tree = {f"w{i}": np.full(shape, i, np.int16) for i, shape in enumerate(shapes)}
    _, dev = rt.upload_tree(tree).wait()
    assert [dev[k].shape for k in tree] == shapes
    leaves = list(dev.values())
    assert leaves[0]._shape is leaves[1]._shape is leaves[2]._shape  # a run of one shape: one tuple
    assert leaves[3]._shape is leaves[4]._shape and leaves[5]._shape is not leaves[2]._shape
    _, back = rt.download_tree(dev).wait()
    assert all(back[k].shape == v.shape and np.array_equal(back[k], v) for k, v in tree.items())


def test_device_specs_reads_every_leaf_or_none(native: ferry.Runtime) -> None:
    rt = native
    module = _native.load()
    assert module is not None
    tree = {"a": np.zeros((2, 3), np.float32), "b": np.zeros((2, 3), np.float32), "c": np.zeros(5, np.int8)}
    _, dev = rt.upload_tree(tree).wait()
    leaves = list(dev.values())
    specs, sizes, total = module.device_specs(leaves)
    assert specs == [((2, 3), np.dtype(np.float32))] * 2 + [((5,), np.dtype(np.int8))]
    assert specs[0] is specs[1]  # the same shape and dtype objects: one pair
    assert sizes == [24, 24, 5] and total == 53
    assert module.device_specs([]) == ([], [], 0)
    assert module.device_specs([*leaves, np.zeros(3)]) is None  # not every item a DeviceArray
    with pytest.raises(TypeError):
        module.device_specs(tuple(leaves))
    # the fresh host leaves of a download are made from them, pageable and pinned
    for pinned in (False, True):
        _, back = rt.download_tree(dev, pinned=pinned).wait()
        assert all(back[k].shape == v.shape and back[k].dtype == v.dtype for k, v in tree.items())


_DTYPES = [np.dtype(t) for t in ("int8", "float16", "float32", "int64", "complex128", "bool")]
_SHAPES = st.lists(st.integers(0, 9), max_size=4).map(tuple)


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(st.tuples(_SHAPES, st.sampled_from(_DTYPES)), max_size=20))
def test_host_sizes_counts_as_nbytes_and_the_slab_layout(specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
    """The compiled count of a tree's host arrays: each one's nbytes, and the span slab_layout gives them."""
    module = _native.load()
    if module is None:
        pytest.skip("the compiled extension is not here")
    ferry.Runtime("emulated").close()  # (the extension knows numpy.ndarray once a runtime started)
    hosts = [np.empty(shape, dtype) for shape, dtype in specs]
    assert module.host_sizes(hosts, ALIGN) == ([h.nbytes for h in hosts], slab_layout(specs)[2])


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=150))
def test_pinned_leaf_layout_is_the_slab_layout_for_few_and_many(sizes: list[int]) -> None:
    """A pinned block's leaves are placed as a device slab's views (the loop for a few, NumPy for many):
    each at the next multiple of ALIGN, an empty one taking ALIGN bytes too."""
    offsets, total = _leaves.layout(sizes)
    specs = [((n,), np.dtype(np.uint8)) for n in sizes]
    slab_offsets, _, slab_total = slab_layout(specs)
    assert (offsets, total) == (slab_offsets, slab_total)


def test_host_sizes_answers_none_for_anything_but_exact_arrays(native: ferry.Runtime) -> None:
    module = _native.load()
    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    plain = np.zeros(4)
    for odd in (np.zeros(4).view(Sub), [1, 2], memoryview(b"ab")):
        assert module.host_sizes([plain, odd], ALIGN) is None
    with pytest.raises(TypeError):
        module.host_sizes((plain,), ALIGN)
    with pytest.raises(ValueError):
        module.host_sizes([plain], 0)
    huge = np.broadcast_to(np.zeros(1, np.uint8), (1 << 62,))  # (a view: no memory behind it)
    with pytest.raises(OverflowError):
        module.host_sizes([huge] * 4 + [plain], ALIGN)


def _fail_at(fn: Any, call: int) -> Any:
    """``fn``, raising MemoryError at its ``call``-th call (1-based)."""
    seen = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] == call:
            raise MemoryError("out of memory (injected)")
        return fn(*args, **kwargs)

    return failing


@pytest.mark.parametrize("where", ["compiled call refused", "python views", "empty_many"])
def test_a_fresh_slab_whose_views_fail_partway_is_freed(native: ferry.Runtime, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:
    """No memory for the third view of a fresh tree's slab: the call raises MemoryError, the slab's allocation
    is given back (the device bytes are as before), the host leaves stay owned and writable, and the same tree
    then uploads."""
    from ferry._routes import _groups

    rt = native
    tree = _tree(6)
    gc.collect()
    before = rt.stats().device_bytes
    module = _native.load()
    if where == "compiled call refused":  # the compiled call refuses (MemoryError), before any view
        monkeypatch.setattr(module, "slab_views", _fail_at(module.slab_views, 1))
    else:  # the Python views: the compiled call declines, the third view fails
        monkeypatch.setattr(module, "slab_views", lambda *args: None)
        monkeypatch.setattr(_groups, "new_view", _fail_at(_groups.new_view, 3))
    with pytest.raises(MemoryError):
        if where == "empty_many":
            _groups.empty_many(rt, [(a.shape, a.dtype) for a in tree.values()])
        else:
            rt.upload_tree(tree)
    gc.collect()
    rt.stats()  # (an ordinary call: deferred frees are done)
    assert rt.stats().device_bytes == before
    for leaf in tree.values():
        assert leaf.flags.writeable
        leaf[...] = 1
    monkeypatch.undo()
    _, dev = rt.upload_tree(tree).wait()
    assert all(np.array_equal(rt.to_host(dev[k]), tree[k]) for k in tree)


def test_handed_off_fresh_trees_dropped_before_they_settle_free_their_slabs(native: ferry.Runtime) -> None:
    # the views are untracked by the collector: a hand-off's record holding them must still let go of them
    from ferry import testing

    rt = native
    tree = _tree(300)
    before = rt.stats().device_bytes
    stream = testing.side_stream(rt)
    for _ in range(3):
        pending = rt.upload_tree(tree)
        dev = pending.hand_off(stream)
        del pending, dev
        gc.collect()
    for _ in range(100):  # the dropped records retire once their copies are proven complete
        rt.upload(np.ones(16, np.uint8)).wait()
        gc.collect()
        time.sleep(0.02)
        stats = rt.stats()
        if stats.retiring == 0 and stats.device_bytes <= before + 16:
            break
    assert stats.in_flight == 0 and stats.retiring == 0
    assert stats.device_bytes <= before + 16  # every slab freed (at most the last small upload's 16 B alive)
