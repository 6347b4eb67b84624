"""What every route shares: the copy request, the interface, and the caller's read-only flags.

A *host route* moves bytes between a NumPy array and a device array. The
facade checks the arguments, builds a :class:`HostCopy`, picks the route
(registered, direct or staged) and calls its :meth:`HostRoute.submit`, which
enqueues the copy and returns the record; the facade then moves the states.
Each route attaches to the record's :class:`~ferry._completion.Extras` the
cleanups it needs when the record leaves flight, so completion never knows
which route ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._native import data_reader, lease_table, writeable_flags

if TYPE_CHECKING:
    from .._backends._base import Backend
    from .._completion import Completion, Extras, Record
    from .._lifecycle import Health

__all__: list[str] = []


@dataclass(slots=True)
class HostCopy:
    """One NumPy array <-> device array copy, checked and ready to enqueue.

    ``device`` is a ferry array or a foreign wrapper; ``copy`` is the
    backend's ``htod_record``/``dtoh_record``; ``moved``, ``leased`` and
    ``result`` are the record's.
    """

    upload: bool
    host: np.ndarray[Any, Any]
    device: Any
    stream: Any
    copy: Callable[[int, int, int, Any, Any], None]
    moved: tuple[Any, ...]
    leased: tuple[Any, ...]
    result: tuple[Any, ...]
    extra: Extras

    @property
    def nbytes(self) -> int:
        """The payload's size."""
        return int(self.host.nbytes)


class HostRoute(Protocol):
    """A way to move a NumPy array's bytes to or from the device."""

    name: str

    def streams(self, request: HostCopy) -> list[Any]:
        """The streams the copy will run on (ordered after the device side's producer first)."""
        ...

    def submit(self, request: HostCopy) -> Record:
        """Enqueue the copy; lock held. Raises TransferSubmitError with nothing enqueued."""
        ...


class HostLeases:
    """The caller's NumPy arrays flagged read-only while a transfer uses them (counted, restored).

    An exact ``numpy.ndarray`` has its flag flipped by the compiled helpers
    where they run (:func:`ferry._native.writeable_flags`: tens of
    nanoseconds, where NumPy's ``setflags`` costs hundreds); a restore that
    NumPy might refuse (an array that does not own its data) goes through
    ``setflags``. Where the extension runs, :meth:`take` and :meth:`give` are
    its ``Leases`` table's (:func:`ferry._native.lease_table`): the same steps,
    one C call each instead of about 0.2 us of Python each.
    """

    def __init__(self) -> None:
        self._leases: dict[int, list[Any]] = {}
        flags = writeable_flags()
        self._clear: Callable[[Any], bool] | None = flags[0] if flags is not None else None
        self._restore: Callable[[Any], None] | None = flags[1] if flags is not None else None
        self._compiled = compiled = lease_table()
        if compiled is not None:
            self.take = compiled.take  # type: ignore[method-assign]
            self.give = self._unlease = compiled.give  # type: ignore[method-assign]
            self.take_many = compiled.take_many  # type: ignore[method-assign]
            self.give_many = compiled.give_many  # type: ignore[method-assign]

    def leased(self) -> dict[int, list[Any]]:
        """The arrays leased now: ``id(array) -> [array, count, writeable]`` (a snapshot)."""
        compiled = self._compiled
        return dict(compiled.table) if compiled is not None else {k: list(v) for k, v in self._leases.items()}

    def take_many(self, arrays: list[Any]) -> None:
        """:meth:`take` for each array, all or none: a refusal gives back the leases this call took."""
        items = tuple(arrays)  # a take may run Python code that changes the caller's list
        done = 0
        try:
            for array in items:
                self.take(array)
                done += 1
        except BaseException:
            for array in items[:done]:
                self.give(array)
            raise

    def give_many(self, arrays: list[Any]) -> None:
        """:meth:`give` for each array."""
        for array in arrays:
            self.give(array)

    def lease(self, array: np.ndarray[Any, Any]) -> Callable[[bool], None]:
        """Flag ``array`` read-only for one flight; return the cleanup that restores it."""
        self.take(array)

        def cleanup(failed: bool) -> None:
            self._unlease(array)

        return cleanup

    def take(self, array: np.ndarray[Any, Any], writeable: bool | None = None) -> None:
        """Flag ``array`` read-only for one flight (``writeable``: its flag, when the caller knows it);
        :meth:`give` ends it. No closure: the small route's."""
        key = id(array)
        entry = self._leases.get(key)
        if entry is None:
            clear = self._clear
            if clear is not None and type(array) is np.ndarray:
                writeable = clear(array)
            else:
                if writeable is None:
                    writeable = bool(array.flags.writeable)
                if writeable:
                    array.setflags(write=False)
            self._leases[key] = [array, 1, writeable]
        else:
            entry[1] += 1

    def give(self, array: np.ndarray[Any, Any]) -> None:
        """End one flight's lease of ``array``; the last one restores its flag."""
        key = id(array)
        entry = self._leases.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._leases[key]
            if entry[2]:
                restore = self._restore
                if restore is not None and type(array) is np.ndarray and array.base is None:
                    restore(array)  # it owns its data: NumPy would allow it
                    return
                try:
                    array.setflags(write=True)
                except ValueError:  # its base became read-only meanwhile: it stays so
                    return  # (try/except, not contextlib.suppress: that one builds an object per call)

    _unlease = give


_data_of = data_reader()


def array_ptr(array: np.ndarray[Any, Any]) -> int:
    """The address of an array's first byte (compiled for an exact ``numpy.ndarray``)."""
    if _data_of is not None and type(array) is np.ndarray:
        return _data_of(array)
    return int(array.ctypes.data)


class RuntimeParts(Protocol):
    """A runtime's parts as a route sees them (``_parts.Parts``, which sits above the routes); a route
    that needs more states it in a protocol built on this one."""

    @property
    def lock(self) -> Any:
        """The runtime's lock."""
        ...

    @property
    def health(self) -> Health:
        """Whether the runtime is open."""
        ...

    @property
    def backend(self) -> Backend:
        """The runtime's device."""
        ...

    @property
    def completion(self) -> Completion:
        """The runtime's completion part."""
        ...
