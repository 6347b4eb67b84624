"""Every backend-neutral test runs on each available backend.

The emulated device always runs. CUDA runs when a GPU is usable; it is skipped
only on the narrow probe (no driver, no device), whose reason is shown.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import ferry
from ferry import testing
from ferry._backends._cuda import probe


def cuda_unavailable_reason() -> str | None:
    try:
        probe(0)
    except ferry.DeviceUnavailableError as exc:
        return str(exc)
    return None


_CUDA_REASON = cuda_unavailable_reason()


def make_runtime(backend: str, **options: object) -> ferry.Runtime:
    if backend == "cuda" and _CUDA_REASON is not None:
        pytest.skip(f"no usable GPU: {_CUDA_REASON}")
    return ferry.Runtime(backend, **options)  # type: ignore[arg-type]


@pytest.fixture(params=["emulated", "cuda"])
def backend_name(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and _CUDA_REASON is not None:
        pytest.skip(f"no usable GPU: {_CUDA_REASON}")
    return str(request.param)


@pytest.fixture
def rt(backend_name: str) -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime(backend_name)
    try:
        yield runtime
        assert testing.violations(runtime) == []
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


@pytest.fixture
def emu() -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime("emulated")
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []
