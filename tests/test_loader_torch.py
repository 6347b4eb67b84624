"""ferry.DataLoader beside torch.utils.data.DataLoader: the same batches, order, seeds and lengths.

Skipped where PyTorch is not installed (the loader itself never needs it).
"""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import pytest

import ferry

torch = pytest.importorskip("torch")
from torch.utils import data as tud  # noqa: E402

Pair = collections.namedtuple("Pair", ["a", "b"])


class Indexed(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> Any:
        return {"t": torch.full((2, 3), float(i)), "i": i, "f": i * 0.5,
                "p": Pair(np.int32(i), (torch.tensor([i, 2 * i]), "x"))}


class Draws(tud.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = tud.get_worker_info()
        return torch.tensor([i, -1 if info is None else info.id]), torch.tensor(
            [np.random.random(), random.random(), float(torch.rand(()))], dtype=torch.float64)


class Shards(tud.IterableDataset):  # type: ignore[misc]
    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(torch.tensor([i]) for i in range(start, 9, step))

    def __len__(self) -> int:
        return 9


def _numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, ferry.DeviceArray):
        return x
    if isinstance(x, dict):
        return {k: _numpy(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_numpy(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_numpy(v) for v in x)
    return x


def _host(rt: ferry.Runtime, x: Any) -> Any:
    if isinstance(x, ferry.DeviceArray):
        return rt.to_host(x)
    if isinstance(x, dict):
        return {k: _host(rt, v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_host(rt, v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_host(rt, v) for v in x)
    return x


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_as_pytorchs_loader_shuffled_by_a_torch_generator(rt: ferry.Runtime, workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 5, "shuffle": True, "num_workers": workers, "drop_last": False}
    if workers:
        kwargs["multiprocessing_context"] = "fork"
    theirs = tud.DataLoader(Indexed(), generator=torch.Generator().manual_seed(11), **kwargs)
    with ferry.DataLoader(Indexed(), generator=torch.Generator().manual_seed(11), runtime=rt, **kwargs) as ours:
        assert len(ours) == len(theirs) == 5
        for _ in range(2):  # a second epoch: the generator moved on the same way
            expected = [_numpy(b) for b in theirs]
            got = [_host(rt, b) for b in ours]
            assert len(got) == len(expected)
            for g, e in zip(got, expected, strict=True):
                _same(g, e)


def test_workers_draw_what_pytorchs_workers_draw(rt: ferry.Runtime) -> None:
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "multiprocessing_context": "fork"}
    theirs = [b for _, b in tud.DataLoader(Draws(), generator=torch.Generator().manual_seed(5), **kwargs)]
    with ferry.DataLoader(Draws(), generator=torch.Generator().manual_seed(5), runtime=rt, **kwargs) as loader:
        ours = [(rt.to_host(a), rt.to_host(b)) for a, b in loader]
    assert [a[:, 1].tolist() for a, _ in ours] == [[0, 0], [1, 1], [0, 0], [1, 1]]  # PyTorch's worker info
    for (_, b), expected in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(b, expected.numpy())  # NumPy, random and torch seeded alike


def test_pytorch_samplers_and_sharded_iterable_datasets(rt: ferry.Runtime) -> None:
    sampler = tud.BatchSampler(tud.SequentialSampler(range(10)), batch_size=4, drop_last=True)
    with ferry.DataLoader(Indexed(), batch_sampler=sampler, runtime=rt) as loader:
        assert [rt.to_host(b["i"]).tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert len(loader) == len(sampler) == 2
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "multiprocessing_context": "fork"}
    expected = [b.numpy().ravel().tolist() for b in tud.DataLoader(Shards(), **kwargs)]
    with ferry.DataLoader(Shards(), runtime=rt, **kwargs) as loader:
        assert [rt.to_host(b).ravel().tolist() for b in loader] == expected
        assert len(loader) == len(tud.DataLoader(Shards(), **kwargs)) == 5


@pytest.mark.parametrize("kwargs", [
    {"batch_size": 4}, {"batch_size": 4, "drop_last": True}, {"batch_size": None}, {"batch_size": 7, "shuffle": True},
])
def test_length_as_pytorch_counts_it(kwargs: dict[str, Any]) -> None:
    assert len(ferry.DataLoader(Indexed(), **kwargs)) == len(tud.DataLoader(Indexed(), **kwargs))
    if not kwargs.get("shuffle"):
        assert len(ferry.DataLoader(Shards(), **kwargs)) == len(tud.DataLoader(Shards(), **kwargs))


def test_the_default_collate_matches_pytorchs() -> None:
    from ferry._loader._collate import default_collate

    samples = [Indexed()[i] for i in range(3)]
    _same(default_collate(samples), _numpy(tud.default_collate(samples)))


def test_torch_is_not_needed_for_numpy_generators_and_samplers(rt: ferry.Runtime) -> None:
    rng = np.random.default_rng(1)
    with ferry.DataLoader(Indexed(), batch_size=23, shuffle=True, generator=rng, runtime=rt) as loader:
        (batch,) = list(loader)
    order = rt.to_host(batch["i"]).tolist()
    rng = np.random.default_rng(1)
    rng.integers(0, 2**62)  # the epoch's base seed is drawn first
    assert order == rng.permutation(23).tolist()
