"""Interop on a GPU with CuPy, PyTorch and JAX: stream-ordered hand-off in both directions, no host wait.

Skipped where no GPU is usable or the library is not installed (narrow probes).
"""

from __future__ import annotations

import numpy as np
import pytest

import ferry
import ferry._native
from ferry import testing

pytestmark = pytest.mark.cuda  # skipped without a usable GPU (conftest.py)


@pytest.fixture
def gpu() -> ferry.Runtime:
    return ferry.Runtime("cuda")


def test_a_cupy_producer_then_an_immediate_download_returns_the_right_bytes(gpu, cupy) -> None:  # type: ignore[no-untyped-def]
    n = 64 << 20
    stream = cupy.cuda.Stream(non_blocking=True)
    spin = cupy.RawKernel(
        r'''
        extern "C" __global__ void slow_fill(unsigned char* p, size_t n, unsigned char v, long long cycles) {
            long long start = clock64();
            while (clock64() - start < cycles) {}
            for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
        }''',
        "slow_fill",
    )
    buf = gpu.pinned(n)
    try:
        for value in range(1, 21):
            with stream:
                source = cupy.empty(n, cupy.uint8)
                spin((264,), (256,), (source, cupy.uint64(n), cupy.uint8(value), cupy.int64(2_000_000)))
                waits = testing.host_waits(gpu)
                pending = gpu.download_pending(source, buf)  # CAI v3 names the producer stream
                assert testing.host_waits(gpu) == waits
            _, buf = pending.wait()
            view = buf.as_array()
            assert view[0] == value and view[-1] == value and np.all(view[:: 1 << 16] == value)
            del view
    finally:
        gpu.close()


def test_an_upload_handed_off_to_a_cupy_stream_is_read_there(gpu, cupy) -> None:  # type: ignore[no-untyped-def]
    n = 16 << 20
    data = (np.arange(n) % 251).astype(np.uint8)
    consumer = cupy.cuda.Stream(non_blocking=True)
    try:
        for _ in range(10):
            buf = gpu.pinned(n)
            buf.as_array()[:] = data
            dev = gpu.empty(n, np.uint8)
            pending = gpu.upload_pending(buf, dev)
            waits = testing.host_waits(gpu)
            handed = pending.hand_off(consumer)
            assert testing.host_waits(gpu) == waits
            with consumer:
                total = int(cupy.asarray(handed).astype(cupy.int64).sum())  # a kernel on the consumer stream
            assert total == int(data.astype(np.int64).sum())
            pending.wait()
            buf.close()
    finally:
        gpu.close()


def test_a_torch_producer_on_a_side_stream_then_a_download_through_dlpack(gpu) -> None:  # type: ignore[no-untyped-def]
    try:
        import torch
    except ImportError:
        pytest.skip("PyTorch is not installed")
    n = 32 << 20
    side = torch.cuda.Stream()
    buf = gpu.pinned(n)
    try:
        for value in range(1, 11):
            with torch.cuda.stream(side):
                source = torch.empty(n, dtype=torch.uint8, device="cuda")
                torch.cuda._sleep(2_000_000)  # a long producer kernel on the side stream
                source.fill_(value)
                pending = gpu.download_pending(source, buf)  # DLPack: torch orders ferry's stream
            _, buf = pending.wait()
            view = buf.as_array()
            assert view[0] == value and view[-1] == value and np.all(view[:: 1 << 16] == value)
            del view
    finally:
        gpu.close()


def test_an_upload_handed_off_to_a_torch_stream_is_read_there(gpu, torch) -> None:  # type: ignore[no-untyped-def]
    n = 16 << 20
    data = (np.arange(n) % 253).astype(np.uint8)
    consumer = torch.cuda.Stream()

    def consume(array):  # type: ignore[no-untyped-def]
        with torch.cuda.stream(consumer):
            return torch.from_dlpack(array).to(torch.int64).sum()  # queued on the consumer stream

    try:
        # warm up: PyTorch's first launches load modules and fill its allocator, which may wait
        # on the whole device, so they must not happen while ferry's stream is held
        int(consume(gpu.empty(n, np.uint8)))
        torch.cuda.synchronize()
        for _ in range(10):
            buf = gpu.pinned(n)
            buf.as_array()[:] = data
            dev = gpu.empty(n, np.uint8)
            with testing.hold(gpu, "upload"):  # the copy cannot have finished when the hand-off happens
                pending = gpu.upload_pending(buf, dev)
                waits = testing.host_waits(gpu)
                handed = pending.hand_off(consumer)
                assert testing.host_waits(gpu) == waits
                total = consume(handed)  # queued behind the held copy
            consumer.synchronize()  # PyTorch's own rule: read a result on (or after) its stream
            assert int(total) == int(data.astype(np.int64).sum())
            pending.wait()
            buf.close()
    finally:
        gpu.close()


def test_a_staged_upload_handed_off_to_a_torch_stream_is_read_there(gpu, torch) -> None:  # type: ignore[no-untyped-def]
    # a pageable array above direct_bytes goes through the native staging lanes; the consumer's
    # stream waits on the device for the events the lanes recorded after their last DMAs
    if ferry._native.load() is None:  # the pure-Python engine refuses the hand-off (tests/test_interop.py)
        gpu.close()
        pytest.skip(f"the native engine does not run here: {ferry._native.status()}")
    n = 64 << 20
    consumer = torch.cuda.Stream()
    try:
        for i in range(8):
            data = ((np.arange(n) + i) % 251).astype(np.uint8)
            pending = gpu.upload(data)
            handed = pending.hand_off(consumer)
            with torch.cuda.stream(consumer):
                total = torch.from_dlpack(handed).to(torch.int64).sum()  # queued on the consumer stream
            consumer.synchronize()
            assert int(total) == int(data.astype(np.int64).sum())
            pending.wait()
    finally:
        gpu.close()


def test_foreign_arrays_as_upload_destinations(gpu, cupy, torch) -> None:  # type: ignore[no-untyped-def]
    n = 8 << 20
    data = (np.arange(n) % 241).astype(np.uint8)
    try:
        for make in (lambda: cupy.zeros(n, cupy.uint8), lambda: torch.zeros(n, dtype=torch.uint8, device="cuda")):
            target = make()
            buf = gpu.pinned(n)
            buf.as_array()[:] = data
            back, got = gpu.upload_pending(buf, target).wait()
            assert got is target and back is buf
            host = got.get() if hasattr(got, "get") else got.cpu().numpy()
            assert np.array_equal(host, data)
            buf.close()
    finally:
        gpu.close()


def test_a_jax_array_is_a_download_source(gpu) -> None:  # type: ignore[no-untyped-def]
    import os

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        pytest.skip("JAX is not installed")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")
    n = 16 << 20
    buf = gpu.pinned(n)
    try:
        for value in range(1, 6):
            source = jax.device_put(jnp.arange(n, dtype=jnp.uint32), device)
            source = (source * 7 + value) % 251  # dispatched asynchronously; ferry must order after it
            _, buf = gpu.download_pending(source.astype(jnp.uint8), buf).wait()
            expected = ((np.arange(n, dtype=np.uint64) * 7 + value) % 251).astype(np.uint8)
            view = buf.as_array()
            assert np.array_equal(view, expected)
            del view
    finally:
        gpu.close()
