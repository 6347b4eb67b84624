"""ferry.DataLoader without PyTorch: order, structure, seeds, the ring, failures and clean-up.

Datasets are defined at module level so that spawn and forkserver workers can
import them. Every test that starts workers checks that they are gone and that
the ring is released afterwards (``_no_leaks``).
"""

from __future__ import annotations

import array
import collections
import contextlib
import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import eventually
from ferry import testing
from ferry._loader._worker import numpy_state
from test_loader_datasets import Modules, as_array

# Python 3.12+ warns when a process with threads forks: the fork tests fork from one with ferry's threads,
# as a training script does (docs/loader.md, "Start methods"); the workers touch none of their state.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")

CONTEXTS = ["fork", "spawn", "forkserver"]
ROOT = Path(__file__).resolve().parents[1]


# -- datasets (module level: spawn workers import them) ----------------------------------------------------
class Squares:
    """Sample i: a 3 x 4 float32 array of i, the int i, the float i / 2, its name."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": np.full((3, 4), i, dtype=np.float32), "y": i, "half": i / 2, "name": f"s{i}"}


Pair = collections.namedtuple("Pair", ["image", "label"])


class Nested:
    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> Any:
        return (np.arange(5, dtype=np.int16) + i, [Pair(np.float64(i), np.array([i, -i], np.int32)), True])


class Seeds:
    """Each sample: who loaded it and what its random generators said."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = ferry.get_worker_info()
        wid = -1 if info is None else info.id
        seed = -1 if info is None else info.seed
        return np.array([i, wid, seed, os.getpid()], np.int64), np.array([np.random.random(), random.random()])


class Failing:
    def __init__(self, bad: int, how: str = "raise") -> None:
        self.bad, self.how = bad, how

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"sample {i} is broken")
        return np.full(4, i, np.float32)


class Slow:
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.02)
        return np.full(256, i, np.float32)


class Stalls:
    """Sample 4 takes a minute: the batch holding it is never delivered in a test's time."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if i == 4:
            time.sleep(60)
        return np.full(4, i, np.float32)


class Growing:
    """Batches of rows whose width grows past the first batch's at index 4."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return np.full(100 if i < 4 else 5000, i, np.float64)


class Stream:
    """Iterable-style: each worker yields its own share (PyTorch's sharding idiom)."""

    def __init__(self, n: int = 11) -> None:
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        info = ferry.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield np.array([i], np.int64)

    def __len__(self) -> int:
        return self.n


class DLPackOnly:
    """A CPU tensor of some other library: only the DLPack protocol."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


class Tensors:
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return DLPackOnly(np.full((2, 2), i, np.float32))


def init_marker(worker_id: int) -> None:
    np.random.seed(1000 + worker_id)  # overrides the worker's seeding, as with PyTorch


def init_fails(worker_id: int) -> None:
    raise RuntimeError(f"init of worker {worker_id} failed")


def sum_collate(samples: list[Any]) -> Any:
    return {"sum": np.stack([s["x"] for s in samples]).sum(axis=0), "n": len(samples)}


# -- helpers ------------------------------------------------------------------------------------------------
def buffer_collate(samples: list[Any]) -> Any:
    """A batch whose leaves export only the buffer protocol, as ``ferry.prefetch`` takes them."""
    return {"y": array.array("q", [s["y"] for s in samples]), "raw": bytearray(b"ab"), "name": "kept"}


def _host(rt: ferry.Runtime, batch: Any) -> Any:
    if isinstance(batch, ferry.DeviceArray):
        return rt.to_host(batch)
    if isinstance(batch, dict):
        return {k: _host(rt, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_host(rt, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_host(rt, v) for v in batch)
    return batch


def _run(loader: ferry.DataLoader, rt: ferry.Runtime) -> list[Any]:
    return [_host(rt, b) for b in loader]


def _ring_files() -> list[str]:
    """The ring files this process still holds open or mapped."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    held += [line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
             if len(line.split(None, 5)) == 6]
    return [h for h in held if "ferry-loader-ring" in h or "ferry-ring-" in h]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class _Baseline:
    def __init__(self, rt: ferry.Runtime) -> None:
        gc.collect()
        self.rt = rt
        self.stats = rt.stats()
        self.shm = _shm()
        # a ring that a failed copy read stays mapped for good (the device may still read it): an earlier
        # test's failure injection is not this test's leak
        self.rings = sorted(_ring_files())

    def check(self) -> None:
        """No worker alive, nothing registered, nothing in flight, no /dev/shm entry, no new descriptor."""
        gc.collect()
        deadline = time.monotonic() + 10
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [p.name for p in multiprocessing.active_children() if p.name.startswith("ferry")] == []

        def settled() -> bool:
            gc.collect()
            self.rt.poll()
            now = self.rt.stats()
            return now.retiring == 0 and now.device_bytes == self.stats.device_bytes

        assert eventually(settled)
        after = self.rt.stats()
        assert after.registered_bytes == self.stats.registered_bytes == 0
        assert after.in_flight == self.stats.in_flight
        assert after.abandoned == self.stats.abandoned
        assert _shm() == self.shm
        assert sorted(_ring_files()) == self.rings
        assert testing.violations(self.rt) == []


@pytest.fixture
def leaks(rt: ferry.Runtime) -> Iterator[_Baseline]:
    baseline = _Baseline(rt)
    yield baseline
    baseline.check()


# -- order and structure ----------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_in_order_with_their_structure(rt: ferry.Runtime, leaks: _Baseline, workers: int) -> None:
    loader = ferry.DataLoader(Squares(10), batch_size=4, num_workers=workers, runtime=rt,
                              multiprocessing_context="fork")
    with loader:
        for _ in range(2):
            batches = _run(loader, rt)
            assert len(batches) == len(loader) == 3
            for b, first in zip(batches, [0, 4, 8], strict=True):
                ids = list(range(first, min(first + 4, 10)))
                assert b["x"].dtype == np.float32 and b["x"].shape == (len(ids), 3, 4)
                np.testing.assert_array_equal(b["x"][:, 1, 2], ids)
                assert b["y"].dtype == np.int64 and b["y"].tolist() == ids
                assert b["half"].dtype == np.float64 and b["half"].tolist() == [i / 2 for i in ids]
                assert b["name"] == [f"s{i}" for i in ids]


def test_nested_tuples_lists_and_named_tuples_collate_as_pytorch_does(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Nested(), batch_size=3, num_workers=1, runtime=rt, drop_last=True,
                          multiprocessing_context="fork") as loader:
        batches = _run(loader, rt)
    assert len(batches) == 2  # 7 samples, drop_last
    first = batches[0]
    assert isinstance(first, list) and len(first) == 2  # a tuple sample collates into a list
    np.testing.assert_array_equal(first[0], np.arange(5, dtype=np.int16) + np.arange(3)[:, None])
    assert first[0].dtype == np.int16
    pair, flags = first[1]
    assert isinstance(pair, Pair)
    assert pair.image.dtype == np.float64 and pair.image.tolist() == [0, 1, 2]
    assert pair.label.dtype == np.int32 and pair.label.tolist() == [[0, 0], [1, -1], [2, -2]]
    assert flags.dtype == np.bool_ and flags.tolist() == [True] * 3


@pytest.mark.parametrize("context", CONTEXTS)
def test_every_start_method_delivers_through_the_ring(rt: ferry.Runtime, leaks: _Baseline, context: str) -> None:
    before = rt.stats()
    with ferry.DataLoader(Squares(24), batch_size=4, num_workers=2, runtime=rt, multiprocessing_context=context,
                          persistent_workers=True) as loader:
        for epoch in range(2):
            if epoch:
                time.sleep(1.2)  # idle persistent workers stay (a forkserver worker's parent is not this process)
            seen = []
            for batch in loader:
                assert rt.stats().registered_bytes == loader.ring_bytes > 0
                seen.extend(_host(rt, batch["y"]).tolist())
            assert seen == list(range(24))
            engine = loader._engine  # persistent: the ring stays, every slot free again between epochs
            assert engine is not None and engine.table.free == len(engine.table) == engine.slots
        # only the loader's very first batch came as arrays (it sized the ring); the rest came through the
        # registered slots: one DMA each and no host copy in this process
        assert loader.fallback_batches == 1
        first_bytes = 4 * (3 * 4 * 4 + 8 + 8)
        downloads = 2 * 6 * 4 * 8  # the labels this test read back
        assert rt.stats().host_copied_bytes - before.host_copied_bytes == first_bytes + downloads


def test_dlpack_cpu_tensors_and_unbatched_samples(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Tensors(), batch_size=4, runtime=rt) as loader:
        batches = _run(loader, rt)
    assert [b.shape for b in batches] == [(4, 2, 2), (2, 2, 2)]
    np.testing.assert_array_equal(batches[1][:, 0, 0], [4, 5])
    with ferry.DataLoader(Squares(3), batch_size=None, num_workers=1, runtime=rt,
                          multiprocessing_context="fork") as loader:
        unbatched = _run(loader, rt)
    assert len(loader) == 3
    assert [b["y"] for b in unbatched] == [0, 1, 2]  # numbers of an unbatched sample stay numbers
    np.testing.assert_array_equal(unbatched[2]["x"], np.full((3, 4), 2, np.float32))


class _CpuDevice:
    type = "cpu"


class TorchLikeTensor:
    """Stands for a CPU PyTorch tensor in a worker forked from a process that used CUDA: its
    ``__dlpack_device__`` asks whether it is pinned, which initializes CUDA there, and raises."""

    __module__ = "torch"
    device = _CpuDevice()

    def __init__(self, value: int) -> None:
        self.array = np.full((2, 3), value, np.float32)

    def __dlpack_device__(self) -> tuple[int, int]:
        raise RuntimeError("CUDA error: initialization error")

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: initialization error")

    def detach(self) -> TorchLikeTensor:
        return self

    def numpy(self) -> np.ndarray[Any, Any]:
        return self.array


class TorchLikeSamples:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": TorchLikeTensor(index)}


def test_cpu_torch_tensors_collate_without_asking_their_dlpack_device(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(TorchLikeSamples(), batch_size=2, num_workers=1, runtime=rt,
                          multiprocessing_context="fork") as loader:
        batches = _run(loader, rt)
    assert [b["x"].shape for b in batches] == [(2, 2, 3), (2, 2, 3)]
    np.testing.assert_array_equal(batches[1]["x"][:, 0, 0], [2, 3])


def test_a_collate_fn_returns_fresh_arrays_that_are_copied_into_the_slot(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Squares(10), batch_size=5, num_workers=2, runtime=rt, collate_fn=sum_collate,
                          multiprocessing_context="fork") as loader:
        batches = _run(loader, rt)
    assert [b["n"] for b in batches] == [5, 5]
    np.testing.assert_array_equal(batches[1]["sum"], np.full((3, 4), 5 + 6 + 7 + 8 + 9, np.float32))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_collate_fn_s_leaves_follow_prefetchs_rules(rt: ferry.Runtime, leaks: _Baseline, workers: int) -> None:
    # the loader takes a batch apart with ferry.prefetch's own leaf rules: buffer-protocol leaves are arrays
    loader = ferry.DataLoader(Squares(4), batch_size=2, num_workers=workers, collate_fn=buffer_collate,
                              runtime=rt, multiprocessing_context="fork")
    batches = _run(loader, rt)
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert [b["y"].dtype for b in batches] == [np.dtype(np.int64)] * 2
    assert batches[0]["raw"].tolist() == [97, 98] and batches[0]["name"] == "kept"
    loader.close()


def test_samplers_and_batch_samplers(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Squares(10), batch_size=3, sampler=[9, 0, 8, 1, 7], runtime=rt) as loader:
        assert [b["y"].tolist() for b in _run(loader, rt)] == [[9, 0, 8], [1, 7]]
        assert len(loader) == 2
    with ferry.DataLoader(Squares(10), batch_sampler=[[3, 1], [2], [9, 8, 7]], num_workers=2, runtime=rt,
                          multiprocessing_context="fork") as loader:
        assert [b["y"].tolist() for b in _run(loader, rt)] == [[3, 1], [2], [9, 8, 7]]
        assert len(loader) == 3


def test_shuffle_repeats_with_a_seeded_generator_and_changes_between_epochs(rt: ferry.Runtime,
                                                                             leaks: _Baseline) -> None:
    def orders(seed: int) -> list[list[int]]:
        with ferry.DataLoader(Squares(20), batch_size=5, shuffle=True, num_workers=2, runtime=rt,
                              generator=np.random.default_rng(seed), multiprocessing_context="fork") as loader:
            return [[i for b in loader for i in _host(rt, b["y"]).tolist()] for _ in range(2)]

    first = orders(7)
    assert first == orders(7)
    assert first != orders(8)
    assert first[0] != first[1]
    assert sorted(first[0]) == sorted(first[1]) == list(range(20))


def test_workers_are_seeded_per_worker_and_repeat(rt: ferry.Runtime, leaks: _Baseline) -> None:
    def draws(init: Any = None) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        with ferry.DataLoader(Seeds(), batch_size=2, num_workers=2, runtime=rt, worker_init_fn=init,
                              generator=np.random.default_rng(3), multiprocessing_context="fork") as loader:
            batches = [(_host(rt, a), _host(rt, b)) for a, b in loader]
        return np.concatenate([a for a, _ in batches]), np.concatenate([b for _, b in batches])

    ids, rows = draws()
    index, worker, seed = ids[:, 0], ids[:, 1], ids[:, 2]
    assert index.tolist() == list(range(8))
    assert worker.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]  # batch i to worker i % num_workers, as PyTorch
    base = int(seed[0])
    assert seed.tolist() == [base + int(w) for w in worker]
    # NumPy's and Python's generators were seeded from (base seed, worker id): they repeat, and differ per worker
    np.testing.assert_array_equal(rows, draws()[1])
    assert rows[0, 0] != rows[2, 0]
    assert rows[2, 0] == np.random.RandomState(numpy_state(base, 1)).random()  # worker 1's first draw
    assert rows[2, 1] == random.Random(base + 1).random()
    marked = draws(init_marker)[1]
    assert marked[0, 0] == np.random.RandomState(1000).random()  # worker_init_fn ran after the seeding


def test_iterable_datasets_are_sharded_by_worker_info(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Stream(11), batch_size=2, num_workers=2, runtime=rt,
                          multiprocessing_context="fork") as loader:
        got = [_host(rt, b)[:, 0].tolist() for b in loader]
        assert len(loader) == 6
    # worker 0 yields 0 2 4 6 8 10, worker 1 yields 1 3 5 7 9; batches alternate between them, as PyTorch's
    assert got == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9]]
    with ferry.DataLoader(Stream(5), batch_size=2, drop_last=True, runtime=rt) as loader:
        assert [_host(rt, b)[:, 0].tolist() for b in loader] == [[0, 1], [2, 3]]


def test_a_batch_larger_than_its_slot_takes_the_fallback(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Growing(), batch_size=2, num_workers=1, runtime=rt,
                          multiprocessing_context="fork") as loader:
        batches = _run(loader, rt)
        ring = rt.stats().registered_bytes
    assert [b.shape for b in batches] == [(2, 100), (2, 100), (2, 5000), (2, 5000)]
    for k, b in enumerate(batches):
        np.testing.assert_array_equal(b[:, 0], [2 * k, 2 * k + 1])
    assert loader.fallback_batches == 3  # the first (it sized the ring) and the two that did not fit
    assert ring == 0  # the epoch ended: its ring was released with its workers


def test_to_converts_each_leaf(rt: ferry.Runtime, leaks: _Baseline) -> None:
    seen = []
    with ferry.DataLoader(Squares(4), batch_size=2, runtime=rt, to=lambda a: ("leaf", a.shape)) as loader:
        for batch in loader:
            seen.append(batch["x"])
    assert seen == [("leaf", (2, 3, 4))] * 2


def test_no_device_module_is_loaded_in_a_spawned_worker(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Modules(), batch_size=1, num_workers=1, runtime=rt, multiprocessing_context="spawn",
                          collate_fn=as_array) as loader:
        (loaded,) = [bytes(_host(rt, b)).decode() for b in loader]
    assert "ferry._loader._worker" in loaded.split(",")
    # no driver binding and no CUDA backend in the worker: it cannot make a device call
    assert [m for m in loaded.split(",") if m.startswith(("cuda", "ferry._backends._cuda"))] == []


# -- arguments ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "error"), [
    ({"shuffle": True, "sampler": [0, 1]}, ValueError),
    ({"batch_sampler": [[0]], "batch_size": 2}, ValueError),
    ({"batch_sampler": [[0]], "drop_last": True}, ValueError),
    ({"num_workers": -1}, ValueError),
    ({"persistent_workers": True}, ValueError),
    ({"batch_size": 0}, ValueError),
    ({"prefetch_factor": 0, "num_workers": 1}, ValueError),
    ({"depth": 0}, ValueError),
    ({"generator": 3}, TypeError),
    ({"multiprocessing_context": "teleport"}, ValueError),
    ({"to": "tensorflow"}, ValueError),
    ({"collate_fn": 3}, TypeError),
    ({"batch_size": None, "drop_last": True}, ValueError),
    ({"timeout": -1, "num_workers": 1}, ValueError),
    ({"timeout": float("nan"), "num_workers": 1}, ValueError),
    ({"timeout": "5", "num_workers": 1}, TypeError),
    ({"timeout": 5}, ValueError),  # num_workers=0: PyTorch refuses it too (an assertion when iterating)
    ({"in_order": False}, ValueError),
])
def test_arguments_pytorch_refuses_are_refused(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        ferry.DataLoader(Squares(4), **kwargs)


def test_pytorchs_remaining_arguments_are_accepted_as_pytorch_spells_them(rt: ferry.Runtime,
                                                                          leaks: _Baseline) -> None:
    # every argument torch.utils.data.DataLoader takes, with a value a torch script passes
    loader = ferry.DataLoader(Squares(6), batch_size=2, shuffle=False, sampler=None, batch_sampler=None,
                              num_workers=1, collate_fn=None, pin_memory=True, drop_last=False, timeout=30,
                              worker_init_fn=None, multiprocessing_context="fork", generator=None,
                              prefetch_factor=2, persistent_workers=False, pin_memory_device="cuda",
                              in_order=True, runtime=rt)
    assert loader.pin_memory and loader.timeout == 30.0 and loader.in_order
    assert [b["y"].tolist() for b in _run(loader, rt)] == [[0, 1], [2, 3], [4, 5]]
    loader.close()
    with pytest.raises(ValueError, match="in_order must be True"):
        ferry.DataLoader(Squares(6), in_order=False)


def test_every_argument_of_pytorchs_loader_is_taken_with_pytorchs_default() -> None:
    torch_data = pytest.importorskip("torch.utils.data", reason="compared with PyTorch's own signature")
    import inspect

    theirs = inspect.signature(torch_data.DataLoader).parameters
    ours = inspect.signature(ferry.DataLoader).parameters
    assert [name for name in theirs if name not in ours] == []
    same_default = {"shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory", "drop_last",
                    "timeout", "worker_init_fn", "multiprocessing_context", "generator", "persistent_workers",
                    "pin_memory_device", "in_order"} & set(theirs)
    # PyTorch spells "no shuffling" as None in some releases and False in others; ferry says False
    def meaning(name: str, default: Any) -> Any:
        return False if name == "shuffle" and default is None else default

    assert {n: meaning(n, ours[n].default) for n in same_default} == {
        n: meaning(n, theirs[n].default) for n in same_default}


def test_a_batch_not_delivered_within_timeout_raises_and_the_next_epoch_starts_fresh(
        rt: ferry.Runtime, leaks: _Baseline) -> None:
    loader = ferry.DataLoader(Stalls(), batch_size=2, num_workers=1, timeout=2, runtime=rt,
                              multiprocessing_context="fork", prefetch_factor=1)
    got = []
    start = time.monotonic()
    with pytest.raises(ferry.LoaderWorkerError, match="timed out after 2 seconds waiting for batch 2") as info:
        for batch in loader:
            got.append(_host(rt, batch)[:, 0].tolist())
    assert time.monotonic() - start < 45  # well before the stalled sample returns
    assert got == [[0, 1], [2, 3]]
    assert info.value.index == 2 and info.value.worker == 0
    gc.collect()
    assert [p for p in multiprocessing.active_children() if p.name.startswith("ferry")] == []
    assert _host(rt, next(iter(loader)))[:, 0].tolist() == [0, 1]  # a new epoch: new workers
    loader.close()


def test_iterable_datasets_refuse_shuffle_and_samplers() -> None:
    with pytest.raises(ValueError, match="shuffle"):
        ferry.DataLoader(Stream(), shuffle=True)
    with pytest.raises(ValueError, match="sampler"):
        ferry.DataLoader(Stream(), sampler=[0])
    with pytest.raises(TypeError):
        len(ferry.DataLoader(iter([np.zeros(2)])))


# -- failures ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_a_worker_exception_reaches_the_consumer_with_its_batch_and_traceback(
        rt: ferry.Runtime, leaks: _Baseline, workers: int) -> None:
    loader = ferry.DataLoader(Failing(bad=9), batch_size=2, num_workers=workers, runtime=rt,
                              multiprocessing_context="fork")
    got = []
    error: Any
    with pytest.raises((ferry.LoaderWorkerError, ValueError)) as info:
        for batch in loader:
            got.append(_host(rt, batch)[:, 0].tolist())
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]  # everything before batch 4 was delivered
    error = info.value
    if workers:
        assert isinstance(error, ferry.LoaderWorkerError)
        assert error.index == 4 and error.worker == 0
        assert "sample 9 is broken" in str(error) and "batch 4" in str(error)
        assert "Traceback" in error.traceback and "__getitem__" in error.traceback
        assert isinstance(error.__cause__, ValueError)
    else:
        assert isinstance(error, ValueError)  # in this process the exception is the dataset's own
    loader.close()


def test_a_failing_worker_init_fn_is_reported(rt: ferry.Runtime, leaks: _Baseline) -> None:
    with ferry.DataLoader(Squares(4), batch_size=2, num_workers=1, runtime=rt, worker_init_fn=init_fails,
                          multiprocessing_context="fork") as loader, \
            pytest.raises(ferry.LoaderWorkerError, match="init of worker 0 failed"):
        list(loader)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_that_dies_is_reported_at_once_and_the_loader_closes(
        rt: ferry.Runtime, leaks: _Baseline, context: str) -> None:
    loader = ferry.DataLoader(Failing(bad=5, how="kill"), batch_size=2, num_workers=2, runtime=rt,
                              multiprocessing_context=context)
    got = []
    start = None
    with pytest.raises(ferry.LoaderWorkerError, match="exited unexpectedly with signal SIGKILL") as info:
        for batch in loader:
            got.append(_host(rt, batch)[:, 0].tolist())
            start = time.monotonic()
    assert got == [[0, 1], [2, 3]]
    assert info.value.index == 2 and info.value.worker == 0
    assert start is not None and time.monotonic() - start < 30  # (the design: the sentinel fires at once)
    loader.close()
    assert loader.closed


@pytest.mark.parametrize("how", ["break", "exception", "close", "ctrl-c", "dropped"])
def test_every_way_out_stops_the_workers_and_releases_the_ring(rt: ferry.Runtime, leaks: _Baseline,
                                                                how: str) -> None:
    loader = ferry.DataLoader(Slow(), batch_size=4, num_workers=2, runtime=rt, multiprocessing_context="fork",
                              persistent_workers=True)

    def body() -> None:
        it = iter(loader)
        for k, batch in enumerate(it):
            assert rt.stats().registered_bytes > 0 or k == 0
            if k < 3:
                continue
            if how == "break":
                break
            if how == "exception":
                raise LookupError("in the loop")
            if how == "close":
                loader.close()
            if how == "ctrl-c":
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
                time.sleep(5)
            if how == "dropped":
                del it, batch
                return

    if how == "exception":
        with pytest.raises(LookupError):
            body()
    elif how == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            body()
    else:
        body()
    if how != "close":
        gc.collect()
        assert rt.stats().registered_bytes == 0
        assert [p for p in multiprocessing.active_children() if p.name.startswith("ferry")] == []
        # the loader is still usable: a new epoch starts new workers
        assert _host(rt, next(iter(loader)))[:, 0].tolist() == [0, 1, 2, 3]
    loader.close()


def test_ctrl_c_while_waiting_for_workers(rt: ferry.Runtime, leaks: _Baseline) -> None:
    loader = ferry.DataLoader(Slow(), batch_size=64, num_workers=1, runtime=rt, multiprocessing_context="fork")
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    timer.join()
    loader.close()


def test_closing_the_loader_closes_the_runtime_it_made() -> None:
    loader = ferry.DataLoader(Squares(4), batch_size=2, num_workers=1, multiprocessing_context="fork")
    batches = list(loader)
    rt = loader.runtime
    assert rt is not None and not rt.closed and len(batches) == 2
    loader.close()
    assert rt.closed
    with pytest.raises(ferry.FerryError):
        iter(loader)


def test_ten_spawn_epochs_leave_nothing_behind(rt: ferry.Runtime, leaks: _Baseline) -> None:
    loader = ferry.DataLoader(Squares(16), batch_size=4, num_workers=2, runtime=rt, multiprocessing_context="spawn")
    rss = []
    for _ in range(10):
        assert sum(int(_host(rt, b["y"]).sum()) for b in loader) == sum(range(16))
        assert rt.stats().registered_bytes == 0 and loader.ring_bytes == 0
        assert _shm() == leaks.shm  # no /dev/shm entry after any epoch
        assert [p for p in multiprocessing.active_children() if p.name.startswith("ferry")] == []
        gc.collect()
        rss.append(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    assert rss[-1] - rss[2] < 16 << 20
    assert loader.fallback_batches == 1  # later epochs' rings were sized before their workers started
    loader.close()


@pytest.mark.parametrize("ending", ["exit", "exit_in_loop", "exception"])
def test_interpreter_exit_stops_the_workers(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import ferry
        from test_loader import Slow
        if __name__ == "__main__":
            loader = ferry.DataLoader(Slow(), batch_size=2, num_workers=2, multiprocessing_context="spawn",
                                      runtime=ferry.Runtime("emulated"))
            for k, batch in enumerate(loader):
                if k == 2:
                    import multiprocessing
                    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
                    if {ending!r} == "exit_in_loop":
                        sys.exit(0)
                    if {ending!r} == "exception":
                        raise SystemExit(3)
                    break
            it = iter(loader); next(it)  # an epoch left running at exit
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    before = _shm()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode in (0, 3), done.stderr
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) >= 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    assert _shm() == before


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


class Numbers:
    def __len__(self) -> int:
        return 5 * 20000

    def __getitem__(self, i: int) -> int:
        return i


def growing_collate(samples: list[int]) -> np.ndarray[Any, Any]:
    """Every batch larger than the one before: none fits the ring, each comes back as arrays."""
    k = samples[0] // len(samples)
    return np.full(len(samples) * (2 + k), samples[0], np.int64)


def test_large_tasks_and_large_fallback_batches_do_not_deadlock(rt: ferry.Runtime, leaks: _Baseline) -> None:
    # tasks of 20000 indices (more than a pipe holds, prefetch_factor of them) while the worker sends
    # batches back that are larger than a pipe too: neither side may block the other
    def expire(*_: Any) -> None:
        raise TimeoutError("the loader deadlocked")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    try:
        with ferry.DataLoader(Numbers(), batch_size=20000, num_workers=1, prefetch_factor=4, runtime=rt,
                              collate_fn=growing_collate, multiprocessing_context="fork") as loader:
            sizes = [(b.shape[0], int(rt.to_host(b)[0])) for b in loader]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert sizes == [(20000 * (2 + k), 20000 * k) for k in range(5)]
    assert loader.fallback_batches == 5


class Odd:
    """Samples with an empty array and a string, and one with nothing to upload at all."""

    def __init__(self, strings_only: bool) -> None:
        self.strings_only = strings_only

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> Any:
        if self.strings_only:
            return f"s{i}"
        return np.zeros((0, 3), np.float32), np.array(i, np.uint8), f"s{i}"


@pytest.mark.parametrize("strings_only", [False, True])
def test_empty_arrays_scalars_and_string_only_batches(rt: ferry.Runtime, leaks: _Baseline,
                                                       strings_only: bool) -> None:
    with ferry.DataLoader(Odd(strings_only), batch_size=2, num_workers=1, runtime=rt,
                          multiprocessing_context="fork") as loader:
        batches = _run(loader, rt)
    if strings_only:
        assert batches == [["s0", "s1"], ["s2", "s3"], ["s4"]]
        return
    assert [b[0].shape for b in batches] == [(2, 0, 3), (2, 0, 3), (1, 0, 3)]
    assert [b[1].tolist() for b in batches] == [[0, 1], [2, 3], [4]] and batches[0][1].dtype == np.uint8
    assert [b[2] for b in batches] == [("s0", "s1"), ("s2", "s3"), ("s4",)]  # in a sequence: a tuple, as PyTorch


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_workers_exit_when_the_main_process_is_killed(tmp_path: Path, context: str) -> None:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import multiprocessing
        import ferry
        from test_loader import Slow
        if __name__ == "__main__":
            loader = ferry.DataLoader(Slow(), batch_size=2, num_workers=2, multiprocessing_context={context!r},
                                      runtime=ferry.Runtime("emulated"))
            it = iter(loader)
            next(it)
            print(" ".join(str(p.pid) for p in multiprocessing.active_children() if p.name.startswith("ferry")),
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


class Ones:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        return np.full(1024, index, np.float32)


def test_a_failed_copy_ends_the_epoch_without_a_stall() -> None:
    rt = ferry.Runtime(backend="emulated")
    try:
        loader = ferry.DataLoader(Ones(), batch_size=4, num_workers=0, runtime=rt)
        batches = iter(loader)
        next(batches)
        next(batches)
        testing.fail_next_copy(rt)
        start = time.monotonic()
        with pytest.raises(ferry.FerryError):
            for _ in range(10):
                next(batches)
        assert time.monotonic() - start < 5  # the failure surfaces; the ring is not waited for in vain
        loader.close()
    finally:
        rt.close()
