"""A tree's host leases in one call, and the compiled lease table they go through.

A tree upload flags every host leaf read-only while it is in flight (``Leases.take_many``, one compiled
call for every leaf), and its completion restores them (``give_many``). The compiled table keeps its
leases in a hash table of the arrays' addresses; what it answers must be what the Python table of
``HostLeases`` would: counted leases, the flag restored by the last one, a read-only array left so, all
or none for a call that fails halfway. Flat dicts' paths (``KeyPaths``) are made on demand and must
compare and index as the list of 1-tuples they stand for.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _native
from ferry._routes import _base
from ferry._routes._groups import give_all, take_all
from ferry._structure import KeyPaths, flat_keys, take_flat


@pytest.fixture()
def table() -> Any:
    if _base.lease_table() is None:
        pytest.skip("the compiled extension (or a verified array layout) is not here")
    return _base.HostLeases().take.__self__  # the compiled Leases object behind HostLeases


def counts(table: Any) -> dict[int, int]:
    return {key: entry[1] for key, entry in table.table.items()}


def test_take_many_and_give_many_count_each_array_as_take_and_give_do(table: Any) -> None:
    a, b = np.arange(8), np.arange(4.0)
    ro = np.arange(3)
    ro.setflags(write=False)
    table.take_many([a, b, a, ro])  # a twice: two flights
    assert not a.flags.writeable and not b.flags.writeable and not ro.flags.writeable
    assert counts(table) == {id(a): 2, id(b): 1, id(ro): 1}
    assert table.table[id(ro)][2] is False and table.table[id(a)][2] is True
    table.give_many((a, b))  # a tuple too
    assert not a.flags.writeable and b.flags.writeable
    table.give_many([a, ro])
    assert a.flags.writeable and not ro.flags.writeable  # a read-only array stays so
    assert table.table == {}
    table.give_many([a])  # a give without a lease changes nothing
    assert a.flags.writeable and table.table == {}


def test_take_many_takes_all_or_none(table: Any) -> None:
    a, b = np.arange(8), np.arange(8)
    table.take(b)  # an earlier flight of b: it stays
    with pytest.raises(AttributeError):
        table.take_many([a, b, object()])  # the third has no flags: nothing of this call is kept
    assert a.flags.writeable and not b.flags.writeable
    assert counts(table) == {id(b): 1}
    with pytest.raises(TypeError):
        table.take_many(a)  # not a list or a tuple
    table.give(b)
    assert b.flags.writeable and table.table == {}


class Stubborn(np.ndarray):
    """An array whose restore fails with an error other than NumPy's refusal."""

    def setflags(self, write: Any = None, align: Any = None, uic: Any = None) -> None:
        if write:
            raise RuntimeError("no")
        super().setflags(write=write)


def test_give_many_gives_every_array_back_then_raises_the_first_error(table: Any) -> None:
    a, b = np.arange(8), np.arange(8)
    odd = np.arange(8).view(Stubborn)
    table.take_many([a, odd, b])
    with pytest.raises(RuntimeError, match="no"):
        table.give_many([a, odd, b])
    assert a.flags.writeable and b.flags.writeable  # the one after the failure too
    assert table.table == {}


def test_the_table_matches_a_model_over_many_arrays_and_rounds(table: Any) -> None:
    # thousands of entries: the table grows, and removed entries are reused or dropped as it is rebuilt
    rng = random.Random(7)
    arrays = [np.arange(4) for _ in range(3000)]
    model: dict[int, int] = {}
    for _ in range(6):
        batch = rng.sample(arrays, 2000)
        table.take_many(batch)
        for array in batch:
            model[id(array)] = model.get(id(array), 0) + 1
        back = [array for array in arrays if id(array) in model and rng.random() < 0.7]
        table.give_many(back)
        for array in back:
            model[id(array)] -= 1
            if not model[id(array)]:
                del model[id(array)]
        assert counts(table) == model
        for array in arrays:
            assert array.flags.writeable is (id(array) not in model)
    table.give_many([array for array in arrays for _ in range(model.get(id(array), 0))])
    assert table.table == {} and all(array.flags.writeable for array in arrays)


def test_a_lease_taken_while_python_runs_inside_take_is_kept(table: Any) -> None:
    # the generic path calls the array's setflags (Python): a lease taken there (here of many other arrays,
    # which rebuilds the table) must not be lost, and the array's own lease must land in the rebuilt table
    others = [np.arange(2) for _ in range(500)]

    class Busy(np.ndarray):
        def setflags(self, write: Any = None, align: Any = None, uic: Any = None) -> None:
            if not write:
                table.take_many(others)
            super().setflags(write=write)

    busy = np.arange(8).view(Busy)
    table.take(busy)
    assert not busy.flags.writeable and counts(table)[id(busy)] == 1
    assert all(counts(table)[id(o)] == 1 for o in others)
    table.give(busy)
    table.give_many(others)
    assert busy.flags.writeable and table.table == {}


def test_a_lease_keeps_its_array_alive(table: Any) -> None:
    import gc
    import weakref

    a = np.arange(8)
    ref = weakref.ref(a)
    key = id(a)
    table.take(a)
    del a
    gc.collect()
    survivor = ref()
    assert survivor is not None and key in table.table
    table.give(survivor)
    assert survivor.flags.writeable


def test_the_python_table_takes_and_gives_trees_as_well(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_base, "lease_table", lambda: None)
    leases = _base.HostLeases()
    a, b = np.arange(8), np.arange(8)
    take_all(leases, [a, b, a])
    assert not a.flags.writeable and leases._leases[id(a)][1] == 2
    give_all(leases, [a, b])
    assert not a.flags.writeable and b.flags.writeable
    give_all(leases, [a])
    assert a.flags.writeable and leases._leases == {}


def test_an_upload_tree_leases_its_host_leaves_until_it_is_waited(emu: ferry.Runtime) -> None:
    tree = {f"w{i}": np.full(4096, i, np.uint8) for i in range(64)}
    dev = emu.upload_tree(tree).wait()[1]
    engine = emu._parts.host.staged.engine(True)
    held = getattr(engine.engine, "hold", None) if _native.load() is not None else None
    if held is None:
        pytest.skip("the compiled staging engine is not here")
    engine.engine.hold()
    try:
        pending = emu.upload_tree(tree, dev)
        assert not any(leaf.flags.writeable for leaf in tree.values())
    finally:
        engine.engine.release()
    _, got = pending.wait()
    assert all(leaf.flags.writeable for leaf in tree.values())
    back = emu.download_tree(got).wait()[1]
    assert all(np.array_equal(back[k], tree[k]) for k in tree)


def test_key_paths_stand_for_the_list_of_one_tuples() -> None:
    keys = ["a", "b", 3]
    paths = KeyPaths(keys)
    listed = [("a",), ("b",), (3,)]
    assert len(paths) == 3 and list(paths) == listed and paths[1] == ("b",) and paths[-1] == (3,)
    assert paths[1:] == listed[1:]
    assert paths == listed and paths == tuple(listed) and paths == KeyPaths(list(keys))
    assert paths != listed[:2] and paths != KeyPaths(["a", "b", 4]) and paths != [("a",), ("b",), ("c",)]
    assert (paths == "abc") is False
    with pytest.raises(TypeError):
        hash(paths)


def test_flat_keys_and_take_flat_walk_a_state_dict_alike() -> None:
    tree = {"x": np.zeros(2), "y": np.ones(3)}
    leaves: list[Any] = []
    found = flat_keys(tree, np.ndarray, leaves)
    assert found is not None
    build, paths = found
    assert paths == [("x",), ("y",)] and leaves == list(tree.values())
    assert build(["p", "q"]) == {"x": "p", "y": "q"}
    leaves2: list[Any] = [None]  # leaves already there: the builder reads its own from the end
    paths2: list[Any] = []
    build2 = take_flat(tree, np.ndarray, leaves2, paths2)
    assert build2 is not None and paths2 == [("x",), ("y",)] and leaves2[1:] == leaves
    assert build2([None, 1, 2]) == {"x": 1, "y": 2}
    assert flat_keys({"x": np.zeros(2), "y": 3}, np.ndarray, []) is None  # not every value a leaf
    assert flat_keys({}, np.ndarray, []) is None and flat_keys([np.zeros(2)], np.ndarray, []) is None


@pytest.mark.parametrize("compiled", [True, False])
def test_flat_keys_takes_a_state_dict_apart_with_or_without_the_extension(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry import _structure

    if compiled and _native.load() is None:
        pytest.skip("the compiled extension is not here")
    if not compiled:
        monkeypatch.setattr(_structure, "_flat_leaves", lambda: None)
    f32, u8 = np.dtype(np.float32), np.dtype(np.uint8)
    tree = {"a": np.zeros(2, f32), 7: np.zeros(3, u8), "c": np.ones(1, f32), ("t",): np.ones(4, f32)}
    leaves: list[Any] = []
    dtypes: set[Any] = set()
    found = flat_keys(tree, np.ndarray, leaves, dtypes)
    assert found is not None
    build, paths = found
    assert list(paths) == [("a",), (7,), ("c",), (("t",),)]
    assert all(x is y for x, y in zip(leaves, tree.values(), strict=True))
    assert dtypes == {f32, u8}
    assert build(list("wxyz")) == {"a": "w", 7: "x", "c": "y", ("t",): "z"}
    # anything but a plain non-empty dict of exactly that type: None, nothing appended
    for other in ({"a": np.zeros(2), "b": np.zeros(2).view(Stubborn)}, {"a": np.zeros(2), "b": [1]},
                  {}, [np.zeros(2)], {"a": 1}):
        before = list(leaves)
        assert flat_keys(other, np.ndarray, leaves, dtypes) is None and leaves == before
    from collections import OrderedDict

    assert flat_keys(OrderedDict(a=np.zeros(2)), np.ndarray, []) is None  # a dict subclass keeps its type
    devices = {"x": object(), "y": object()}
    assert flat_keys(devices, object, []) is not None  # any kind: no dtypes asked for, none read


def test_the_compiled_flat_leaves_answers_the_dtypes_met(table: Any) -> None:
    module = _native.load()
    assert module is not None
    f16 = np.dtype(np.float16)
    tree = {"a": np.zeros(2, f16), "b": np.zeros(2, f16), "c": np.zeros(2, np.int8), "d": np.zeros(2, f16)}
    keys, values, met = module.flat_leaves(tree, np.ndarray)
    assert keys == list(tree) and all(x is y for x, y in zip(values, tree.values(), strict=True))
    assert met == [f16, np.dtype(np.int8), f16]  # consecutive repeats dropped
    assert module.flat_leaves({"a": 1, "b": 2}, int)[2] is None
    assert module.flat_leaves({"a": 1, "b": 2.0}, int) is None
    with pytest.raises(TypeError):
        module.flat_leaves(tree)
