"""ferry.DataLoader on a real GPU: registered ring, hand-off to PyTorch's stream, every batch's bytes right.

Skipped without a usable GPU (and, for the PyTorch tests, without PyTorch with CUDA).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ferry

pytestmark = pytest.mark.cuda


class Rows:
    """Sample i: 256 KiB of float32 holding i + column / 1e6 (so every byte of a batch is checked)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> Any:
        return np.arange(65536, dtype=np.float32) / 1e6 + i, np.int64(i)


def _expected_sum(indices: list[int]) -> float:
    row = np.arange(65536, dtype=np.float64) / 1e6
    return float(sum(row.sum() + 65536 * i for i in indices))


@pytest.fixture
def gpu() -> Any:
    runtime = ferry.Runtime("cuda")
    yield runtime
    runtime.close()


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_batches_reach_pytorchs_stream_intact_with_a_slow_consumer(gpu: ferry.Runtime, torch: Any,
                                                                     context: str) -> None:
    stream = torch.cuda.Stream()
    before = gpu.stats()
    with ferry.DataLoader(Rows(), batch_size=8, num_workers=2, prefetch_factor=1, depth=1, runtime=gpu, to="torch",
                          multiprocessing_context=context, shuffle=True,
                          generator=np.random.default_rng(0)) as loader, torch.cuda.stream(stream):
        sums, labels = [], []
        for x, y in loader:
            assert x.device.type == "cuda" and x.shape == (8, 65536) and x.dtype == torch.float32
            torch.cuda._sleep(2_000_000)  # the consumer is slow: slots are reused while it works
            sums.append(x.double().sum())
            labels.append(y.cpu().tolist())
        stream.synchronize()
        assert sorted(i for batch in labels for i in batch) == list(range(96))
        for total, indices in zip(sums, labels, strict=True):
            assert abs(float(total) - _expected_sum(indices)) < 1e-3 * abs(_expected_sum(indices))
        assert loader.fallback_batches == 1
    after = gpu.stats()
    assert after.registered_bytes == 0
    # only the first batch was copied on the host (it sized the ring); the rest were one DMA per array
    assert after.host_copied_bytes - before.host_copied_bytes <= 8 * (65536 * 4 + 8) + 96 * 8


def test_device_arrays_without_a_library(gpu: ferry.Runtime) -> None:
    with ferry.DataLoader(Rows(), batch_size=32, num_workers=2, runtime=gpu, persistent_workers=True,
                          multiprocessing_context="fork") as loader:
        for _ in range(2):
            for k, (x, y) in enumerate(loader):
                assert isinstance(x, ferry.DeviceArray)
                np.testing.assert_array_equal(gpu.to_host(y), np.arange(32) + 32 * k)
                host = gpu.to_host(x)
                np.testing.assert_array_equal(host[:, 0], np.arange(32, dtype=np.float32) + 32 * k)
            assert gpu.stats().registered_bytes == loader.ring_bytes > 0
    assert gpu.stats().registered_bytes == 0
