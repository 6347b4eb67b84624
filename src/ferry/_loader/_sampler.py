"""The index order of a loader, as ``torch.utils.data.DataLoader`` makes it, with or without PyTorch.

``generator`` is a NumPy ``Generator``, a ``torch.Generator`` or ``None``.
With a ``torch.Generator`` (or ``None`` while PyTorch is loaded) the order and
the workers' base seed are PyTorch's own (``RandomSampler``, one ``int64``
draw per epoch), so a switch keeps the exact batches; otherwise NumPy draws
them: from the ``Generator`` given, else from NumPy's global generator (so
``numpy.random.seed`` makes them repeat).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sized
from itertools import islice
from typing import Any

import numpy as np

__all__: list[str] = []


def is_torch_generator(generator: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(generator, torch.Generator)


def check_generator(generator: Any) -> None:
    if generator is None or isinstance(generator, np.random.Generator) or is_torch_generator(generator):
        return
    raise TypeError(
        f"generator must be a numpy.random.Generator, a torch.Generator or None, got {type(generator).__name__}"
    )


def _torch_rules(generator: Any) -> bool:
    return is_torch_generator(generator) or (generator is None and "torch" in sys.modules)


def base_seed(generator: Any) -> int:
    """The workers' base seed of one epoch (drawn before the epoch's shuffle, as PyTorch draws it)."""
    if _torch_rules(generator):
        torch = sys.modules["torch"]
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if generator is None:
        return int(np.random.randint(0, 2**62, dtype=np.int64))
    return int(generator.integers(0, 2**62))


class SequentialSampler:
    """``0, 1, ..., n - 1``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class RandomSampler:
    """A fresh permutation of ``range(len(dataset))`` each epoch."""

    def __init__(self, dataset: Sized, generator: Any) -> None:
        self.dataset = dataset
        self.generator = generator
        self._torch: Any = None
        if _torch_rules(generator):
            from torch.utils.data import RandomSampler as TorchRandomSampler

            self._torch = TorchRandomSampler(dataset, generator=generator)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        if self._torch is not None:
            return iter(self._torch)
        n = len(self.dataset)
        rng = self.generator
        if rng is None:
            rng = np.random.default_rng(int(np.random.randint(0, 2**62, dtype=np.int64)))
        return iter(rng.permutation(n).tolist())

    def order(self) -> np.ndarray[Any, Any] | None:
        """This epoch's permutation as one int64 array, drawn as :meth:`__iter__` draws it (``None``
        under PyTorch's rules: its sampler draws the order)."""
        if self._torch is not None:
            return None
        rng = self.generator
        if rng is None:
            rng = np.random.default_rng(int(np.random.randint(0, 2**62, dtype=np.int64)))
        order: np.ndarray[Any, Any] = rng.permutation(len(self.dataset)).astype(np.int64, copy=False)
        return order

    def __len__(self) -> int:
        return len(self.dataset)


class BatchSampler:
    """Lists of ``batch_size`` indices from ``sampler``; the last one shorter unless ``drop_last``."""

    def __init__(self, sampler: Iterable[Any], batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[list[Any]]:
        indices = iter(self.sampler)
        size = self.batch_size
        while True:
            batch = list(islice(indices, size))
            if not batch or (len(batch) < size and self.drop_last):
                return
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def packed(self) -> Iterator[tuple[Any, bool]] | None:
        """The batches :meth:`__iter__` yields, in a form that costs the main process little: a ``range``
        per batch over a :class:`SequentialSampler`, the int64 bytes of each batch's slice of the
        permutation over a :class:`RandomSampler` (``True``: decode with ``numpy.frombuffer``); ``None``
        for any other sampler."""
        sampler, size = self.sampler, self.batch_size
        if type(sampler) is SequentialSampler:
            n = sampler.n
            end = n - n % size if self.drop_last else n
            return ((range(start, min(start + size, end)), False) for start in range(0, end, size))
        if type(sampler) is RandomSampler:
            order = sampler.order()
            if order is None:
                return None
            n = len(order)
            end = n - n % size if self.drop_last else n
            return ((order[start:min(start + size, end)].tobytes(), True) for start in range(0, end, size))
        return None
