"""ferry.prefetch on the emulated device: structure, ordering on the device, backpressure,
memory that returns to the pool after the consumer, and clean stops."""

from __future__ import annotations

import asyncio
import collections
import gc
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest

import ferry
from conftest import eventually
from ferry import testing

MiB = 1 << 20


@pytest.fixture(params=["python", "native"])
def staged(request: pytest.FixtureRequest) -> Iterator[ferry.Runtime]:
    """A runtime whose staged uploads run on one engine (python: no hand-off, waited instead)."""
    if request.param == "native" and not ferry.Runtime("emulated").info().get("staging_engine", "").startswith(
        "native"
    ):
        pass  # 'auto' falls back to python where the extension is not built: still a valid run
    runtime = ferry.Runtime("emulated", staging=ferry.StagingConfig(engine=request.param if request.param == "python"
                                                                    else "auto"))
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []




def settled(rt: ferry.Runtime) -> bool:
    """Nothing in flight or retiring, no device memory held (after a collection and a poll)."""
    gc.collect()
    rt.poll()
    stats = rt.stats()
    return stats.in_flight == 0 and stats.retiring == 0 and stats.device_bytes == 0 and (
        stats.device_pool_used_bytes == 0)


def numbered(count: int, nbytes: int = 4096) -> list[np.ndarray[Any, Any]]:
    return [np.full(nbytes, i % 251, np.uint8) for i in range(count)]


class Pair(NamedTuple):
    x: Any
    y: Any


# -- what comes out ------------------------------------------------------------------------------------------


def test_batches_come_out_in_order_with_their_structure(emu: ferry.Runtime) -> None:
    def batches() -> Iterator[Any]:
        for i in range(5):
            x = np.full((4, 8), i, np.float32)
            yield (x, {"y": np.arange(i + 1), "meta": ["name", i, None, 2.5]},
                   Pair(x[1:3], [np.uint8(i), np.zeros(0)]), collections.OrderedDict(z=np.ones(3) * i))

    for i, (x, d, pair, ordered) in enumerate(ferry.prefetch(batches(), runtime=emu)):
        assert isinstance(x, ferry.DeviceArray) and x.shape == (4, 8) and x.dtype == np.float32
        assert np.all(emu.to_host(x) == i)
        assert np.array_equal(emu.to_host(d["y"]), np.arange(i + 1))
        assert d["meta"] == ["name", i, None, 2.5]  # host values pass through
        assert isinstance(pair, Pair) and np.all(emu.to_host(pair.x) == i)  # a non-contiguous slice
        assert pair.y[0] == i and pair.y[1].shape == (0,)
        assert type(ordered) is collections.OrderedDict and np.all(emu.to_host(ordered["z"]) == i)
    del x, d, pair, ordered
    assert eventually(lambda: settled(emu))


def test_cpu_tensors_of_other_libraries_come_in_through_dlpack(emu: ferry.Runtime) -> None:
    class CpuTensor:  # what a CPU torch tensor offers
        def __init__(self, array: np.ndarray[Any, Any]) -> None:
            self.array = array

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    got = [emu.to_host(dev) for dev in ferry.prefetch((CpuTensor(a) for a in numbered(4)), runtime=emu)]
    assert [int(g[0]) for g in got] == [0, 1, 2, 3]


def test_cpu_torch_tensors(emu: ferry.Runtime) -> None:
    torch = pytest.importorskip("torch")
    batches = [(torch.full((16,), i, dtype=torch.int32), torch.arange(4.0)) for i in range(4)]
    for i, (x, y) in enumerate(ferry.prefetch(batches, runtime=emu)):
        assert np.all(emu.to_host(x) == i) and np.array_equal(emu.to_host(y), np.arange(4.0, dtype=np.float32))


def test_to_converts_each_device_array(emu: ferry.Runtime) -> None:
    got = list(ferry.prefetch([numbered(2)], runtime=emu, to=lambda dev: ("on the device", dev.nbytes)))
    assert got == [[("on the device", 4096), ("on the device", 4096)]]


def test_to_torch_makes_each_capsule_for_the_consumer_s_stream(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``to="torch"`` each array's capsule is made for the consumer's stream (PyTorch's current
    one, through its raw getter, or ``stream=``) and handed to ``torch.from_dlpack``."""
    import sys
    import types

    from ferry._interop import _foreign

    current = [testing.side_stream(emu)]
    named = testing.side_stream(emu)
    module = types.ModuleType("torch")
    module.Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]
    module._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: current[0])  # type: ignore[attr-defined]
    module.from_dlpack = lambda capsule: ("a tensor of", capsule)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(_foreign, "_RAW_STREAM", [])
    made: list[object] = []
    export = ferry.DeviceArray.__dlpack__

    def spy(self: ferry.DeviceArray, *, stream: Any = None, **kwargs: Any) -> Any:
        made.append(stream)
        return export(self, stream=stream, **kwargs)

    monkeypatch.setattr(ferry.DeviceArray, "__dlpack__", spy)
    batches = numbered(3)
    got = list(ferry.prefetch(batches, runtime=emu, to="torch"))
    assert [kind for kind, _ in got] == ["a tensor of"] * 3
    assert all(type(capsule).__name__ == "PyCapsule" for _, capsule in got)
    assert made == [current[0]] * 3
    made.clear()
    current[0] = 0  # PyTorch's default stream: the legacy one, handle 1
    assert len(list(ferry.prefetch(batches, runtime=emu, to="torch"))) == 3
    assert made == [1] * 3
    made.clear()
    assert len(list(ferry.prefetch(batches, runtime=emu, to="torch", stream=named))) == 3
    assert made == [named] * 3


# -- ordering on the device, never the host ------------------------------------------------------------------


def test_the_consumer_stream_waits_for_each_batch_on_the_device(emu: ferry.Runtime) -> None:
    consumer = testing.side_stream(emu)
    batches = numbered(6, 64 * 1024)
    reads = []
    emu.to_device(batches[0])  # warm the pinned pool
    with ferry.prefetch(batches, runtime=emu, stream=consumer) as loader:
        with testing.hold(emu, "upload"):  # no copy can complete
            waits = testing.host_waits(emu)
            dev = next(loader)  # returns: the consumer's stream waits, not this thread
            assert testing.host_waits(emu) == waits
            reads.append(testing.consume(emu, consumer, dev._ptr, dev.nbytes))
            time.sleep(0.05)
            assert not reads[0].ran()  # held back on the device behind the upload
        for dev in loader:
            reads.append(testing.consume(emu, consumer, dev._ptr, dev.nbytes))
    assert [int(r.result()[0]) for r in reads] == list(range(6))
    assert all(np.array_equal(r.result(), b) for r, b in zip(reads, batches, strict=True))


def test_the_source_is_read_depth_batches_ahead_of_the_consumer(emu: ferry.Runtime) -> None:
    pulled = []

    def batches() -> Iterator[np.ndarray[Any, Any]]:
        for i, batch in enumerate(numbered(10)):
            pulled.append(i)
            yield batch

    loader = ferry.prefetch(batches(), depth=3, runtime=emu)
    first = next(loader)
    assert len(pulled) == 4  # the one yielded, and three uploading while it is consumed
    assert int(emu.to_host(first)[0]) == 0
    next(loader)
    assert len(pulled) == 5
    loader.close()
    assert loader.closed


def test_staged_batches_are_handed_off_or_waited_for_in_the_background(staged: ferry.Runtime) -> None:
    consumer = testing.side_stream(staged)
    batches = [np.full(12 * MiB, i, np.uint8) for i in range(5)]  # above direct_bytes: staged
    reads = [testing.consume(staged, consumer, dev._ptr, dev.nbytes)
             for dev in ferry.prefetch(batches, runtime=staged, stream=consumer)]
    assert [int(r.result()[0]) for r in reads] == [0, 1, 2, 3, 4]
    assert all(int(r.result()[-1]) == i for i, r in enumerate(reads))
    assert eventually(lambda: settled(staged))


def test_async_for_with_a_sync_and_an_async_source(staged: ferry.Runtime) -> None:
    consumer = testing.side_stream(staged)

    async def source() -> AsyncIterator[np.ndarray[Any, Any]]:
        for i in range(4):
            await asyncio.sleep(0)
            yield np.full(5 * MiB if i % 2 else 4096, i, np.uint8)

    async def run(batches: Any) -> list[int]:
        seen = []
        async for dev in ferry.prefetch(batches, runtime=staged, stream=consumer):
            read = testing.consume(staged, consumer, dev._ptr, dev.nbytes)
            seen.append(int(read.result()[-1]))
        return seen

    assert asyncio.run(run(source())) == [0, 1, 2, 3]
    assert asyncio.run(run(numbered(5))) == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="async for"):
        next(ferry.prefetch(source(), runtime=staged))


# -- memory ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ten_thousand_batches_keep_device_memory_bounded(emu: ferry.Runtime) -> None:
    """Each batch returns to the pool after the consumer's read, so the pool's reserved bytes stay
    under a bound that does not grow with the number of batches. (On the emulated device the
    stream that runs the frees is a Python thread the GIL may hold back for a few milliseconds,
    which is a few dozen of these batches: the bound allows for that; on a GPU the plateau is
    flat, see benchmarks/probe_device_pool.py.)"""
    consumer = testing.side_stream(emu)
    reserved = []
    reads: collections.deque[Any] = collections.deque()
    batches = (np.full(4096, i % 251, np.uint8) for i in range(10_000))
    for i, dev in enumerate(ferry.prefetch(batches, runtime=emu, stream=consumer)):
        reads.append((i, testing.consume(emu, consumer, dev._ptr, 4096)))
        if len(reads) > 8:
            j, read = reads.popleft()
            assert read.result()[0] == j % 251
        if i % 1000 == 999:
            reserved.append(emu.stats().device_pool_reserved_bytes)
    assert max(reserved) <= 160 * 4096  # 10,000 batches went through 160 batches' worth at most
    for _, read in reads:
        read.result()
    del dev
    assert eventually(lambda: settled(emu))


def test_a_consumer_that_never_synchronizes_is_held_back(emu: ferry.Runtime) -> None:
    """Backpressure: the host is never more than depth + 1 batches ahead of the consumer's stream,
    so the batches alive (uploading, in use, or whose consumer work is queued) stay few."""
    consumer = testing.side_stream(emu)
    peak = 0
    for dev in ferry.prefetch(numbered(30), runtime=emu, stream=consumer):
        testing.produce(emu, consumer, dev._ptr, dev.nbytes, 1, delay=0.002)  # 2 ms of "work" per batch
        peak = max(peak, emu.stats().device_bytes)
    assert peak <= (2 * 2 + 4) * 4096  # depth + 1 uploading, the current one, depth + 2 behind it
    del dev
    assert eventually(lambda: settled(emu))


# -- stopping ------------------------------------------------------------------------------------------------


def test_breaking_out_leaves_nothing_behind(emu: ferry.Runtime) -> None:
    for i, _dev in enumerate(ferry.prefetch(numbered(20), runtime=emu, stream=testing.side_stream(emu))):
        if i == 3:
            break
    del _dev
    assert eventually(lambda: settled(emu))
    assert testing.live_objects(emu)["handles"] == 0


def test_an_exception_in_the_loop_leaves_nothing_behind(emu: ferry.Runtime) -> None:
    with pytest.raises(KeyError):
        for i, _dev in enumerate(ferry.prefetch(numbered(20), runtime=emu)):
            if i == 2:
                raise KeyError("the model failed")
    del _dev
    assert eventually(lambda: settled(emu))
    assert testing.live_objects(emu)["handles"] == 0


def test_closing_the_runtime_ends_the_iteration() -> None:
    rt = ferry.Runtime("emulated")
    seen = []
    for i, dev in enumerate(ferry.prefetch(numbered(10), runtime=rt)):
        seen.append(int(rt.to_host(dev)[0]))
        if i == 2:
            rt.close()
    assert seen == [0, 1, 2]
    assert testing.violations(rt) == []


def test_a_runtime_prefetch_creates_is_closed_when_the_iteration_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_BACKEND", "emulated")
    loader = ferry.prefetch(numbered(4))
    assert len(loader) == 4
    got = [int(loader.runtime.to_host(dev)[0]) for dev in loader]
    assert got == [0, 1, 2, 3] and loader.runtime.closed
    loader = ferry.prefetch(numbered(10))
    runtime = loader.runtime
    for i, _ in enumerate(loader):
        if i == 1:
            break
    del loader, _  # the loop broke: the prefetch is collected and closes its runtime off-thread
    assert eventually(lambda: runtime.closed)
    assert testing.violations(runtime) == []


def test_a_batch_that_cannot_be_uploaded_raises_with_its_index(emu: ferry.Runtime) -> None:
    batches = [*numbered(2), np.array([object(), None]), *numbered(2)]
    seen = []
    with pytest.raises(ferry.PrefetchError, match="batch 2") as info:
        for dev in ferry.prefetch(batches, runtime=emu):
            seen.append(dev)
    assert len(seen) == 2 and info.value.index == 2
    assert isinstance(info.value.__cause__, ferry.TransferSubmitError)
    del dev
    with pytest.raises(ferry.PrefetchError) as info:
        list(ferry.prefetch([np.zeros(4), {"bad": {1, 2}}], runtime=emu))
    assert info.value.index == 1 and isinstance(info.value.__cause__, TypeError)
    del seen
    assert eventually(lambda: settled(emu))


def test_a_copy_that_fails_on_the_device_raises_with_its_index(emu: ferry.Runtime) -> None:
    emu.to_device(np.zeros(4096, np.uint8))  # warm up
    testing.fail_next_copy(emu, after=3)  # the fourth copy from now: the upload of batch 3
    seen = []
    with pytest.raises(ferry.PrefetchError) as info:
        for dev in ferry.prefetch(numbered(12), runtime=emu):  # depth 2
            seen.append(dev)
    assert info.value.index == 3 and isinstance(info.value.__cause__, ferry.TransferFailedError)
    # batch 3 is handed to the consumer without a host wait, so it may be yielded before its failure
    # is known; the failure is found within depth + 1 more steps (the host is never further ahead)
    assert 3 <= len(seen) <= 3 + 1 + 2 + 1
    assert [int(emu.to_host(dev)[0]) for dev in seen[:3]] == [0, 1, 2]
    assert len(seen) == 3 or seen[3].state == "abandoned"
    assert [int(emu.to_host(dev)[0]) for dev in seen[4:]] == list(range(4, len(seen)))  # intact


def test_a_failed_copy_found_while_the_host_waits_for_it_names_its_batch() -> None:
    """Slow copies: the host runs ahead until backpressure waits for an older batch's upload, and
    that is where batch 1's failure is found; whichever step finds it, the index is batch 1's."""
    for _ in range(5):
        rt = ferry.Runtime("emulated", emulated_bandwidth=2e6)  # 4 KiB takes 2 ms
        try:
            rt.to_device(np.zeros(16, np.uint8))
            testing.fail_next_copy(rt, after=1)
            with pytest.raises(ferry.PrefetchError) as info:
                for _dev in ferry.prefetch(numbered(12), depth=1, runtime=rt):
                    pass
            assert info.value.index == 1
        finally:
            rt.close()


def test_an_error_of_the_source_is_raised_unchanged_at_its_position(emu: ferry.Runtime) -> None:
    def batches() -> Iterator[np.ndarray[Any, Any]]:
        yield from numbered(2)
        raise ValueError("the loader failed")

    seen = []
    with pytest.raises(ValueError, match="the loader failed"):
        for dev in ferry.prefetch(batches(), depth=4, runtime=emu):
            seen.append(int(emu.to_host(dev)[0]))
    assert seen == [0, 1]


def test_arguments_are_checked_up_front(emu: ferry.Runtime) -> None:
    with pytest.raises(ValueError, match="depth"):
        ferry.prefetch([], depth=0, runtime=emu)
    with pytest.raises(ValueError, match="to must be"):
        ferry.prefetch([], runtime=emu, to="numpy")
    with pytest.raises(TypeError, match="to must be"):
        ferry.prefetch([], runtime=emu, to=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="runtime"):
        ferry.prefetch([], runtime="emulated")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a stream"):
        ferry.prefetch([], runtime=emu, stream="side")
    with pytest.raises(TypeError, match="iterable"):
        ferry.prefetch(3, runtime=emu)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ferry.Prefetcher([], 2, emu, None, None)
    assert list(ferry.prefetch([], runtime=emu)) == []
