"""Collating samples into NumPy batches, straight into a ring slot when they fit.

A batch travels between processes as a *skeleton* (its structure, with leaf
positions and the values that stay on the host: strings, ``None``, numbers a
custom ``collate_fn`` returned) and a *layout* (per array leaf: dtype, shape
and byte offset in the slot). Both are small tuples; the arrays stay in the
slot. :func:`build` puts the structure together again around any leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._memory._ring import ALIGN, round_up
from .._structure import PASS, _mapping, _sequence, host_array

__all__: list[str] = []

Skeleton = tuple[Any, ...]  # a batch's structure, its host leaves (strings, numbers, None) in place
Layout = list[tuple[str, tuple[int, ...], int]]  # dtype, shape, offset


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or hasattr(x, "__dlpack_device__") or (
        hasattr(x, "__array__") and not isinstance(x, (str, bytes))
    )


# -- the default collate: samples to a plan (structure + leaves to stack) -------------------------------
class _Leaf:
    """One array of the collated batch: its dtype and shape, and how to fill it."""

    __slots__ = ("arrays", "dtype", "shape", "values")

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...], arrays: list[Any] | None,
                 values: list[Any] | None) -> None:
        self.dtype, self.shape, self.arrays, self.values = dtype, shape, arrays, values

    def fill(self, out: np.ndarray[Any, Any]) -> None:
        if self.arrays is not None:
            np.stack(self.arrays, out=out)
        else:
            out[...] = self.values

    def fresh(self) -> np.ndarray[Any, Any]:
        if self.arrays is not None:
            return np.stack(self.arrays)
        return np.array(self.values, dtype=self.dtype)


def _plan(samples: Sequence[Any], leaves: list[_Leaf]) -> Skeleton:  # noqa: PLR0911 - one return per kind
    """The skeleton of ``default_collate(samples)``, its leaves appended to ``leaves``."""
    elem = samples[0]
    if isinstance(elem, (str, bytes)):
        return ("v", samples)
    if isinstance(elem, bool):
        leaves.append(_Leaf(np.dtype(np.bool_), (len(samples),), None, list(samples)))
        return ("a", len(leaves) - 1)
    if isinstance(elem, int):
        leaves.append(_Leaf(np.dtype(np.int64), (len(samples),), None, list(samples)))
        return ("a", len(leaves) - 1)
    if isinstance(elem, float):
        leaves.append(_Leaf(np.dtype(np.float64), (len(samples),), None, list(samples)))
        return ("a", len(leaves) - 1)
    if isinstance(elem, np.generic) and not isinstance(elem, (np.str_, np.bytes_, np.object_)):
        leaves.append(_Leaf(elem.dtype, (len(samples),), None, list(samples)))
        return ("a", len(leaves) - 1)
    if isinstance(elem, Mapping):
        keys = list(elem.keys())
        children = [_plan([s[k] for s in samples], leaves) for k in keys]
        return ("d", keys, children) if type(elem) is dict else ("m", type(elem), keys, children)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        columns = _columns(samples)
        return ("n", type(elem), [_plan(c, leaves) for c in columns])
    if isinstance(elem, Sequence):
        columns = _columns(samples)
        return ("l", [_plan(c, leaves) for c in columns])  # tuples too, as PyTorch's default_collate
    if _is_array(elem):
        arrays = [host_array(s) for s in samples]
        first = arrays[0]
        if first.dtype.hasobject or first.dtype.kind in "USV":
            raise TypeError(f"default_collate: cannot stack arrays of dtype {first.dtype}")
        for a in arrays[1:]:
            if a.shape != first.shape:
                raise RuntimeError(
                    f"default_collate: stack expects each array to be equal size, but got {first.shape} "
                    f"and {a.shape}"
                )
        dtype = np.result_type(*arrays) if any(a.dtype != first.dtype for a in arrays) else first.dtype
        leaves.append(_Leaf(dtype, (len(arrays), *first.shape), arrays, None))
        return ("a", len(leaves) - 1)
    raise TypeError(
        "default_collate: batch must contain arrays, numbers, dicts or lists; found "
        f"{type(elem).__name__}"
    )


def _columns(samples: Sequence[Any]) -> list[tuple[Any, ...]]:
    size = len(samples[0])
    if any(len(s) != size for s in samples):
        raise RuntimeError("default_collate: each element in list of batch should be of equal size")
    return list(zip(*samples, strict=True))  # tuples: strings in a sequence come back as a tuple, as PyTorch's


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack a list of samples into a batch of NumPy arrays, as PyTorch's ``default_collate`` does.

    Arrays (NumPy, or CPU tensors of any DLPack library) are stacked along a
    new first axis; Python ``int``, ``float`` and ``bool`` become ``int64``,
    ``float64`` and ``bool`` arrays, NumPy scalars keep their dtype; dicts,
    named tuples and sequences are collated per field (tuples and lists come
    back as lists, as PyTorch's do); strings stay a list.

    Raises
    ------
    TypeError
        A sample of a type that cannot be collated.
    RuntimeError
        Arrays of different shapes, or sequences of different lengths.
    """
    if not len(samples):
        raise ValueError("default_collate: no samples")
    leaves: list[_Leaf] = []
    skeleton = _plan(samples, leaves)
    return build(skeleton, [leaf.fresh() for leaf in leaves])


# -- any batch: split into skeleton and arrays; put together again -----------------------------------
def split(batch: Any, arrays: list[np.ndarray[Any, Any]]) -> Skeleton:
    """The skeleton of a collated batch, its host arrays appended to ``arrays`` (the rules of
    :func:`ferry.prefetch`: arrays and DLPack CPU tensors are leaves, strings, numbers and None stay)."""
    if isinstance(batch, PASS):
        return ("v", batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return ("n", type(batch), [split(x, arrays) for x in batch])
    if isinstance(batch, (tuple, list)):
        kind = type(batch)
        items = [split(x, arrays) for x in batch]
        return ("l", items) if kind is list else ("t", items) if kind is tuple else ("s", kind, items)
    if isinstance(batch, Mapping):
        keys = list(batch.keys())
        children = [split(batch[k], arrays) for k in keys]
        return ("d", keys, children) if type(batch) is dict else ("m", type(batch), keys, children)
    array = host_array(batch)
    if array.dtype.hasobject:
        raise TypeError(f"a batch leaf of dtype {array.dtype} cannot be copied to the device")
    arrays.append(array)
    return ("a", len(arrays) - 1)


def build(skeleton: Skeleton, leaves: Sequence[Any]) -> Any:  # noqa: PLR0911 - one return per kind
    """The batch the skeleton describes, with ``leaves`` in its array positions."""
    tag = skeleton[0]
    if tag == "a":
        return leaves[skeleton[1]]
    if tag == "v":
        return skeleton[1]
    if tag == "l":
        return [build(s, leaves) for s in skeleton[1]]
    if tag == "t":
        return tuple(build(s, leaves) for s in skeleton[1])
    if tag == "n":
        return skeleton[1](*(build(s, leaves) for s in skeleton[2]))
    if tag == "s":
        return _sequence(skeleton[1], [build(s, leaves) for s in skeleton[2]])
    if tag == "d":
        return {k: build(s, leaves) for k, s in zip(skeleton[1], skeleton[2], strict=True)}
    if tag == "m":
        return _mapping(skeleton[1], {k: build(s, leaves) for k, s in zip(skeleton[2], skeleton[3], strict=True)})
    raise ValueError(f"not a batch skeleton: {skeleton!r}")


def layout_of(dtypes: Sequence[np.dtype[Any]], shapes: Sequence[tuple[int, ...]]) -> tuple[Layout, int]:
    """Each leaf's place in a slot (aligned), and the bytes they need together."""
    layout: Layout = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        offset = round_up(offset, ALIGN)
        layout.append((dtype.str, tuple(shape), offset))
        offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return layout, offset


def _into(buffer: memoryview | None, layout: Layout, nbytes: int) -> list[np.ndarray[Any, Any]] | None:
    if buffer is None or nbytes > len(buffer):
        return None
    return [np.ndarray(shape, dtype=np.dtype(d), buffer=buffer, offset=off) for d, shape, off in layout]


Collated = tuple[Skeleton, Layout, int, Any]  # skeleton, layout, bytes needed, the fresh batch (did not fit) or None


def collate_into(samples: Sequence[Any], collate_fn: Callable[[Any], Any] | None,
                 buffer: memoryview | None) -> Collated:
    """Collate ``samples`` (or take one unbatched sample: ``collate_fn`` is then applied to it alone)
    into ``buffer``: the default collate stacks straight into the slot (``np.stack(..., out=)``); a
    user's ``collate_fn`` returns fresh arrays, copied into the slot. If the batch does not fit (or
    there is no buffer) the fresh batch comes back instead."""
    if collate_fn is None:
        leaves: list[_Leaf] = []
        skeleton = _plan(samples, leaves)
        layout, nbytes = layout_of([leaf.dtype for leaf in leaves], [leaf.shape for leaf in leaves])
        outs = _into(buffer, layout, nbytes)
        if outs is None:
            return skeleton, layout, nbytes, build(skeleton, [leaf.fresh() for leaf in leaves])
        for leaf, out in zip(leaves, outs, strict=True):
            leaf.fill(out)
        return skeleton, layout, nbytes, None
    batch = collate_fn(samples)
    arrays: list[np.ndarray[Any, Any]] = []
    skeleton = split(batch, arrays)
    layout, nbytes = layout_of([a.dtype for a in arrays], [a.shape for a in arrays])
    outs = _into(buffer, layout, nbytes)
    if outs is None:
        return skeleton, layout, nbytes, batch
    for array, out in zip(arrays, outs, strict=True):
        np.copyto(out, array, casting="no")
    return skeleton, layout, nbytes, None


def convert(sample: Any) -> Any:
    """An unbatched sample as it is (``batch_size=None`` without a ``collate_fn``)."""
    return sample

