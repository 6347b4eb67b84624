"""The device pool, frees after foreign consumers, and ferry.prefetch on a GPU.

Each safe-free test has a long kernel on a side stream read a ferry array, drops
the array's last reference at once, then churns the pool (fresh arrays of the
same size filled with other bytes, which would land in the array's memory if it
had been freed early) and checks the bytes the kernel read. Run them under
``compute-sanitizer --tool memcheck --track-stream-ordered-races all`` too.

Skipped where no GPU is usable (conftest) or the library is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ferry

pytestmark = pytest.mark.cuda  # skipped without a usable GPU (conftest.py)

MiB = 1 << 20
SPIN = 200_000_000  # GPU cycles: ~0.1 s on an H200, far longer than the churn below


@pytest.fixture
def gpu() -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime("cuda")
    try:
        yield runtime
    finally:
        runtime.close()


def churn(rt: ferry.Runtime, nbytes: int) -> None:
    """Take the pool's free blocks of this size and write other bytes into them."""
    rt.poll()  # issues the frees of arrays dropped since the last call
    other = np.full(nbytes, 0xEE, np.uint8)
    kept = [rt.upload(other).wait()[1] for _ in range(6)]
    del kept


def test_the_pool_serves_fresh_arrays_and_gives_memory_back(gpu: ferry.Runtime) -> None:
    assert "stream-ordered pool" in gpu.info()["device_pool"]  # H200, driver 580: pools supported
    arrays = [gpu.empty(64 * MiB, np.uint8) for _ in range(4)]
    assert gpu.stats().device_pool_used_bytes >= 256 * MiB
    del arrays
    gpu.poll()
    gpu.to_host(gpu.to_device(np.zeros(16, np.uint8)))  # a synchronization: the frees have run
    stats = gpu.stats()
    assert stats.device_pool_reserved_bytes >= 256 * MiB  # kept for reuse (no limit)
    data = (np.arange(64 * MiB) % 253).astype(np.uint8)
    for _ in range(5):  # reuse: every array comes from the pool, and holds what was uploaded
        assert np.array_equal(gpu.to_host(gpu.to_device(data)), data)
    assert gpu.stats().device_pool_reserved_bytes == stats.device_pool_reserved_bytes
    gpu.poll()
    gpu.trim()
    assert gpu.stats().device_pool_reserved_bytes < 64 * MiB


def test_the_pool_calls_are_compiled_where_the_extension_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry import _native, testing

    monkeypatch.delenv("FERRY_CUDA_FAST_PATH", raising=False)  # the default
    with ferry.Runtime("cuda") as rt:
        fast_path = rt.info()["fast_path"]
        backend = testing.backend_of(rt)
        if _native.load() is None:
            assert fast_path.startswith("cuda.bindings")
            return
        assert "device pool calls native" in fast_path, fast_path  # driver 580 has the entry points
        assert backend.mem_pool_alloc.__self__ is backend.mem_free_async.__self__ is backend._calls
        used = rt.stats().device_pool_used_bytes
        data = np.arange(8 * MiB, dtype=np.uint8)
        fresh = [rt.empty(8 * MiB, np.uint8) for _ in range(3)]
        assert rt.stats().device_pool_used_bytes >= used + 24 * MiB
        while fresh:
            landed = rt.upload(data, fresh.pop()).wait()[1]
            assert np.array_equal(rt.download(landed).wait()[1], data)
            landed.close()
        with pytest.raises(MemoryError, match="out of memory"):  # the driver's refusal, through on_error
            rt.empty(1 << 44, np.uint8)
        again = rt.upload(data).wait()[1]  # the runtime is unharmed
        assert np.array_equal(rt.download(again).wait()[1], data)


def test_device_pool_limit_on_the_gpu() -> None:
    with ferry.Runtime("cuda", device_pool_limit=64 * MiB) as rt:
        arrays = [rt.empty(64 * MiB, np.uint8) for _ in range(4)]
        del arrays
        rt.poll()
        rt.to_host(rt.to_device(np.zeros(16, np.uint8)))  # synchronizes: the pool gives back the excess
        rt.to_host(rt.to_device(np.zeros(16, np.uint8)))
        assert rt.stats().device_pool_reserved_bytes <= 64 * MiB + 32 * MiB  # granularity aside


def test_a_fresh_array_is_written_by_torch_on_a_side_stream_at_once(gpu: ferry.Runtime, torch: Any) -> None:
    side = torch.cuda.Stream()
    for value in range(1, 6):
        dev = gpu.empty(32 * MiB, np.uint8)
        with torch.cuda.stream(side):
            torch.from_dlpack(dev).fill_(value)  # ordered after the allocation: no event needed
        side.synchronize()
        assert np.all(gpu.to_host(dev)[:: 1 << 16] == value)


def test_torch_reads_survive_dropping_the_array_at_once(gpu: ferry.Runtime, torch: Any) -> None:
    n = 4 * MiB  # the direct route: hand_off works on either staging engine
    data = (np.arange(n) % 251).astype(np.uint8)
    expected = int(data.astype(np.int64).sum())
    side = torch.cuda.Stream()
    for path in ("hand_off", "dlpack", "cai", "record_stream"):
        sums = []
        for _ in range(3):
            pending = gpu.upload(data)
            dev = pending.hand_off(side) if path == "hand_off" else pending.wait()[1]
            with torch.cuda.stream(side):
                torch.cuda._sleep(SPIN)  # a long kernel first: the read below runs ~0.1 s later
                if path == "cai":
                    x = torch.as_tensor(dev, device="cuda")  # the CUDA Array Interface: no stream known
                elif path == "record_stream":
                    x = torch.as_tensor(dev, device="cuda")
                    dev.record_stream(side)  # the consumer names its stream after the export
                else:
                    x = torch.from_dlpack(dev)  # __dlpack__(stream=side)
                sums.append(x.to(torch.int64).sum())
            del x, dev, pending  # the last references: the read is still queued behind the spin
            churn(gpu, n)
        side.synchronize()
        assert [int(s) for s in sums] == [expected] * 3, path


def test_cupy_reads_survive_dropping_the_array_at_once(gpu: ferry.Runtime, cupy: Any) -> None:
    n = 4 * MiB
    data = (np.arange(n) % 247).astype(np.uint8)
    expected = int(data.astype(np.int64).sum())
    spin = cupy.RawKernel(
        r'''extern "C" __global__ void spin(long long cycles) {
            long long start = clock64(); while (clock64() - start < cycles) {} }''', "spin")
    side = cupy.cuda.Stream(non_blocking=True)
    for path in ("hand_off", "dlpack", "cai"):
        sums = []
        for _ in range(3):
            pending = gpu.upload(data)
            dev = pending.hand_off(side) if path == "hand_off" else pending.wait()[1]
            with side:
                spin((1,), (1,), (cupy.int64(SPIN),))
                x = cupy.asarray(dev) if path == "cai" else cupy.from_dlpack(dev)
                sums.append(x.astype(cupy.int64).sum())
            del x, dev, pending
            churn(gpu, n)
        side.synchronize()
        assert [int(s) for s in sums] == [expected] * 3, path


def test_prefetch_to_torch(gpu: ferry.Runtime, torch: Any) -> None:
    sizes = [MiB, 8 * MiB]  # one direct, one staged upload per batch
    batches = [tuple(np.full(n // 4, k, np.float32) for n in sizes) for k in range(300)]
    side = torch.cuda.Stream()
    reserved = []
    with torch.cuda.stream(side):
        sums = []
        for k, (a, b) in enumerate(ferry.prefetch(batches, runtime=gpu, to="torch")):
            assert a.is_cuda and b.dtype == torch.float32
            torch.cuda._sleep(100_000)
            sums.append((a.sum() + b.sum()) / (len(a) + len(b)))
            if k % 50 == 49:
                reserved.append(gpu.stats().device_pool_reserved_bytes)
    side.synchronize()
    assert [int(s) for s in sums] == list(range(300))
    assert reserved[-1] <= 2 * reserved[0] + 64 * MiB  # bounded, not growing with the batches


def test_prefetch_to_cupy(gpu: ferry.Runtime, cupy: Any) -> None:
    batches = [{"x": np.full(1 << 18, k, np.int32), "k": k} for k in range(100)]
    got = []
    for batch in ferry.prefetch(batches, runtime=gpu, to="cupy"):
        got.append((int(batch["x"].sum()) // (1 << 18), batch["k"]))
    assert got == [(k, k) for k in range(100)]


def test_memory_a_torch_consumer_used_is_reused_by_the_pool(gpu: ferry.Runtime, torch: Any) -> None:
    # 3,000 batches of 32 MiB (96 GB in all) read by torch on its stream, which never synchronizes:
    # each batch's memory is freed after the consumer's work, and the pool must reuse it. (A free
    # queued on a private stream that waited for the consumer on the device was never seen complete
    # by the pool: it grew by up to a batch per batch, 16 GiB after 600 batches, and once ran out.)
    n = 32 * MiB
    pool = [np.full(n // 4, k, np.float32) for k in range(7)]
    weight = torch.ones(256, 256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        total = torch.zeros((), dtype=torch.float64, device="cuda")
        for x in ferry.prefetch((pool[k % 7] for k in range(3000)), runtime=gpu, to="torch"):
            total += (x.view(-1, 256)[:4096] @ weight).double().sum()  # reads each batch on its stream
    stream.synchronize()
    assert int(total.item()) == sum(k % 7 for k in range(3000)) * 4096 * 256 * 256
    assert gpu.stats().device_pool_reserved_bytes <= 32 * n  # a few batches in flight, not 3,000
