"""Structures of arrays: take a nested batch or state dict apart into its leaves, build it again.

A *structure* is nested tuples, lists and mappings (named tuples and dict
subclasses included) whose leaves are arrays, as a PyTorch ``DataLoader``
yields batches and ``model.state_dict()`` returns tensors. :func:`take_apart`
walks it once, appends the leaves it keeps to a list and returns a *builder*:
a function that makes the same structure again (same container types, same
keys, same order) from a list of replacement leaves. Leaves it does not keep
(strings, numbers, ``None``, or whatever the leaf function declines) come
back unchanged, as the very objects that were there.

Both :func:`ferry.prefetch` and the whole-structure transfers
(:meth:`ferry.Runtime.upload_tree`, :meth:`ferry.Runtime.download_tree`) use
this one walk; each passes its own leaf function.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from ._errors import TransferSubmitError
from ._interop._host import host_view

__all__: list[str] = []

PASS = (str, bytes, int, float, complex, bool, np.generic, type(None))
"""Leaves that stay where they are (never arrays to move)."""

KEEP = object()
"""What a leaf function returns for a leaf that passes through unchanged."""

_KDL_CPU, _KDL_CUDA_HOST = 1, 3
_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13

Builder = Callable[[list[Any]], Any]
Path = tuple[Any, ...]


def torch_cpu_view(leaf: Any) -> np.ndarray[Any, Any] | None:
    """A CPU PyTorch tensor's NumPy view (no copy), or ``None`` for anything else.

    Asked without ``__dlpack_device__``: PyTorch's asks whether the tensor is
    pinned, which initializes CUDA, and in a worker forked from a process that
    used CUDA that raises. Dtypes NumPy lacks (bfloat16) give ``None`` too.
    """
    if type(leaf).__module__.partition(".")[0] != "torch":
        return None
    if getattr(getattr(leaf, "device", None), "type", None) != "cpu":
        return None
    try:
        return leaf.detach().numpy()  # type: ignore[no-any-return]
    except (TypeError, RuntimeError):
        return None


def host_array(leaf: Any) -> np.ndarray[Any, Any]:
    """The NumPy array of a host leaf (no copy); TypeError for anything else."""
    if isinstance(leaf, np.ndarray):
        return leaf
    view = torch_cpu_view(leaf)
    if view is not None:
        return view
    device = getattr(leaf, "__dlpack_device__", None)
    if device is not None:
        where = tuple(device())
        if where[0] not in (_KDL_CPU, _KDL_CUDA_HOST):
            raise TypeError(f"a {type(leaf).__name__} on DLPack device {where} is not in host memory")
        try:
            return np.from_dlpack(leaf)
        except (BufferError, RuntimeError, TypeError) as exc:
            detach = getattr(leaf, "detach", None)  # a torch tensor that requires grad
            if detach is None:
                raise TypeError(f"NumPy cannot take the {type(leaf).__name__} through DLPack: {exc}") from exc
            return np.from_dlpack(detach())
    if hasattr(leaf, "__array__"):
        return np.asarray(leaf)
    with contextlib.suppress(TransferSubmitError):  # the buffer protocol (bytearray, array.array, memoryview)
        return host_view(leaf, "prefetch", "a batch leaf")
    raise TypeError(
        f"a leaf of type {type(leaf).__name__} is not a host array (NumPy arrays, CPU tensors, "
        "and tuples, lists and dicts of them are moved; str, numbers and None pass through)"
    )


def is_device_array(leaf: Any) -> bool:
    """Whether ``leaf`` lives in device memory: a ferry ``DeviceArray``, an object with the CUDA Array
    Interface, or a DLPack tensor on a CUDA device. Never raises."""
    try:  # a property that may raise more than AttributeError (PyTorch's, for a dtype it cannot describe)
        if hasattr(leaf, "__cuda_array_interface__"):
            return True
    except Exception:  # the interface exists; DLPack may still describe the array
        pass
    device = getattr(leaf, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        where = tuple(device())
    except Exception:  # a foreign object's protocol method: anything may come out
        return False
    return bool(where) and where[0] in (_KDL_CUDA, _KDL_CUDA_MANAGED)


def take_apart(
    tree: Any,
    leaves: list[Any],
    leaf: Callable[[Any], Any] = host_array,
    paths: list[Path] | None = None,
    _path: Path = (),
) -> Builder:
    """Append the structure's kept leaves (``leaf(x)`` for each leaf ``x``; :data:`KEEP` passes
    ``x`` through) to ``leaves`` and, with ``paths``, each one's path of keys and indices; return
    what builds the structure again from replacement leaves (same structure, same container types).

    Raises whatever ``leaf`` raises (TypeError, ValueError, BufferError for host leaves).
    """
    if isinstance(tree, PASS):
        return lambda new: tree
    if isinstance(tree, (tuple, list)):
        parts = [take_apart(item, leaves, leaf, paths, (*_path, i)) for i, item in enumerate(tree)]
        sequence: type = type(tree)
        return lambda new: _sequence(sequence, [part(new) for part in parts])
    if isinstance(tree, Mapping):
        entries = [(key, take_apart(value, leaves, leaf, paths, (*_path, key))) for key, value in tree.items()]
        mapping: type = type(tree)
        return lambda new: _mapping(mapping, {key: part(new) for key, part in entries})
    value = leaf(tree)
    if value is KEEP:
        return lambda new: tree
    leaves.append(value)
    if paths is not None:
        paths.append(_path)
    position = len(leaves) - 1
    return lambda new: new[position]


def take_flat(tree: Any, kind: type, leaves: list[Any], paths: list[Path]) -> Builder | None:
    """:func:`take_apart` for the common state dict: a plain ``dict`` whose values are all exactly of
    type ``kind`` (each a kept leaf, as the leaf function would keep it). Appends the values and their
    paths and returns the builder; ``None`` (nothing appended) for any other structure. A walk of
    thousands of leaves then costs tens of nanoseconds each."""
    found = flat_keys(tree, kind, leaves)
    if found is None:
        return None
    build, keys = found
    paths.extend(keys)  # each key's path: the 1-tuple (key,)
    return build


def flat_keys(tree: Any, kind: type, leaves: list[Any],
              dtypes: set[Any] | None = None) -> tuple[Builder, KeyPaths] | None:
    """:func:`take_flat` without a tuple per leaf: appends the values, and returns the builder and the
    leaves' paths as a :class:`KeyPaths` (``None``, nothing appended, for any other structure). ``dtypes``
    (NumPy leaves): gets the leaves' distinct dtypes. One compiled pass where the extension runs."""
    if type(tree) is not dict or not tree:
        return None
    split = _flat_leaves()
    if split is not None:
        found = split(tree, kind)
        if found is None:
            return None
        keys, values, met = found
        if dtypes is not None:
            dtypes.update(met if met is not None else map(_DTYPE, values))
    else:
        values = list(tree.values())
        if type(values[0]) is not kind or len(set(map(type, values))) != 1:  # the types compared in C
            return None
        keys = list(tree)
        if dtypes is not None:
            dtypes.update(map(_DTYPE, values))
    start = len(leaves)
    leaves.extend(values)
    if start:
        return (lambda new: dict(zip(keys, new[start:], strict=True))), KeyPaths(keys)
    return (lambda new: dict(zip(keys, new, strict=True))), KeyPaths(keys)


_DTYPE = operator.attrgetter("dtype")


def _flat_leaves() -> Callable[[Any, type], Any] | None:
    """The compiled ``flat_leaves`` where the extension runs, else None."""
    from . import _native

    module = _native.load()
    return None if module is None else module.flat_leaves  # type: ignore[no-any-return]


class KeyPaths(Sequence[Path]):
    """The paths of a flat dict's leaves, ``(key,)`` for each key in order, made when asked for (a state
    dict of thousands of leaves makes no tuple per leaf). Equal to another sequence of the same paths."""

    __slots__ = ("keys",)

    def __init__(self, keys: list[Any]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, index: int) -> Path: ...
    @overload
    def __getitem__(self, index: slice) -> list[Path]: ...
    def __getitem__(self, index: int | slice) -> Path | list[Path]:
        if isinstance(index, slice):
            return list(zip(self.keys[index]))
        return (self.keys[index],)

    def __iter__(self) -> Iterator[Path]:
        return zip(self.keys)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyPaths):
            return self.keys == other.keys  # the same key objects: compared by identity, in C
        if isinstance(other, (list, tuple)):
            return len(other) == len(self.keys) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KeyPaths({self.keys!r})"


def describe(path: Path) -> str:
    """A leaf's path as a user reads it: ``['layers'][0]['weight']`` (``<root>`` for the structure itself)."""
    return "".join(f"[{key!r}]" for key in path) or "<root>"


def _sequence(kind: type, values: list[Any]) -> Any:
    if kind is list:
        return values
    if kind is tuple:
        return tuple(values)
    if hasattr(kind, "_fields"):  # a named tuple
        return kind(*values)
    return kind(values)


def _mapping(kind: type, built: dict[Any, Any]) -> Any:
    if kind is dict:
        return built
    try:
        return kind(built)
    except TypeError:  # a mapping type that is not built from a dict (defaultdict, ...)
        return built
