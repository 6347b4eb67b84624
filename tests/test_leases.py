"""The read-only leases of the caller's NumPy arrays (``HostLeases``), compiled and in Python.

A transfer that uses a NumPy array flags it read-only until it is waited; two transfers of the same
array keep it read-only until both are done; an array that was read-only stays so; a view is restored
through NumPy (which may refuse: then it stays read-only). The compiled table (``_engine.Leases``,
where the extension runs) and the Python one must behave alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ferry._routes import _base


@pytest.fixture(params=["compiled", "python"])
def leases(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    if request.param == "python":
        monkeypatch.setattr(_base, "lease_table", lambda: None)
    elif _base.lease_table() is None:
        pytest.skip("the compiled extension (or a verified array layout) is not here")
    table = _base.HostLeases()
    compiled = type(table.take).__name__ != "method"
    assert compiled is (request.param == "compiled")
    return table


def test_a_leased_array_is_read_only_until_its_last_lease_ends(leases: Any) -> None:
    a = np.arange(8)
    leases.take(a)
    leases.take(a)  # a second flight of the same array
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    leases.give(a)
    assert not a.flags.writeable  # one flight is still pending
    leases.give(a)
    assert a.flags.writeable and leases.leased() == {}
    a[0] = 5  # writable again
    leases.give(a)  # a give without a lease changes nothing
    assert a.flags.writeable


def test_a_read_only_array_stays_read_only(leases: Any) -> None:
    a = np.arange(4)
    a.setflags(write=False)
    leases.take(a)
    leases.give(a)
    assert not a.flags.writeable


def test_a_view_is_restored_unless_numpy_refuses(leases: Any) -> None:
    base = np.arange(16)
    view = base[2:10]
    leases.take(view)
    assert not view.flags.writeable and base.flags.writeable
    leases.give(view)
    assert view.flags.writeable
    leases.take(view)
    base.setflags(write=False)  # its base became read-only meanwhile: NumPy refuses the restore
    leases.give(view)
    assert not view.flags.writeable and leases.leased() == {}


def test_an_ndarray_subclass_and_a_known_flag_take_the_generic_path(leases: Any) -> None:
    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    s = np.arange(6).view(Sub)
    leases.take(s)
    assert not s.flags.writeable
    leases.give(s)
    assert s.flags.writeable
    b = np.arange(3)
    leases.take(b, True)  # the caller says it is writeable (the small route's download)
    assert not b.flags.writeable
    leases.give(b)
    assert b.flags.writeable


def test_the_lease_for_cleanup_restores_once(leases: Any) -> None:
    a = np.arange(5)
    cleanup = leases.lease(a)
    assert not a.flags.writeable
    cleanup(False)
    assert a.flags.writeable


def test_take_many_takes_all_or_none(leases: Any) -> None:
    a, b = np.arange(4), np.arange(4)

    class Refuses(np.ndarray):  # type: ignore[type-arg]
        def setflags(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("refused")

    bad = np.arange(4).view(Refuses)
    with pytest.raises(RuntimeError, match="refused"):
        leases.take_many([a, b, bad])
    assert a.flags.writeable and b.flags.writeable and leases.leased() == {}
    leases.take_many([a, b])
    assert not a.flags.writeable and not b.flags.writeable and len(leases.leased()) == 2
    leases.give_many([a, b])
    assert a.flags.writeable and b.flags.writeable and leases.leased() == {}


def test_take_many_survives_a_take_that_changes_the_list(leases: Any) -> None:
    a, b = np.arange(4), np.arange(4)
    arrays: list[Any] = []

    class Evil(np.ndarray):  # type: ignore[type-arg]
        @property
        def flags(self) -> Any:  # a take reads it (not an exact ndarray): it empties the caller's list
            arrays.clear()
            raise RuntimeError("refused")

    arrays.extend([a, b, np.arange(4).view(Evil)])
    with pytest.raises(RuntimeError, match="refused"):
        leases.take_many(arrays)
    assert a.flags.writeable and b.flags.writeable and leases.leased() == {}
