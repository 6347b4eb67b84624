"""A user's script, type-checked by tests/test_typing.py with ``mypy --strict``.

Every ``assert_type`` is exact: a result typed ``Any`` fails it, so nothing of ferry's leaks ``Any``.
"""

from __future__ import annotations

import asyncio
from typing import assert_type

import numpy as np
import numpy.typing as npt

import ferry


def pinned_round_trip(rt: ferry.Runtime) -> None:
    buf = rt.pinned(64)
    dev = rt.empty(16, np.float32)
    up = rt.upload_pending(buf, dev)
    assert_type(up, ferry.PendingUpload[ferry.PinnedHostBuffer, ferry.DeviceArray])
    buf2, dev2 = up.wait()
    assert_type(buf2, ferry.PinnedHostBuffer)
    assert_type(dev2, ferry.DeviceArray)
    down = rt.download_pending(dev2, buf2)
    source, out = down.wait(timeout=5.0)
    assert_type(source, ferry.DeviceArray)
    assert_type(out, ferry.PinnedHostBuffer)


def pageable(rt: ferry.Runtime, array: npt.NDArray[np.float32]) -> None:
    host, dev = rt.upload(array).wait()
    assert_type(host, npt.NDArray[np.float32])
    assert_type(dev, ferry.DeviceArray)
    handed = rt.upload(array).hand_off()
    assert_type(handed, ferry.DeviceArray)
    src, out = rt.download(dev).wait()
    assert_type(src, ferry.DeviceArray)
    assert isinstance(out, np.ndarray)
    assert_type(rt.to_device(array), ferry.DeviceArray)
    copy = rt.copy_pending(dev, rt.empty(dev.shape, dev.dtype))
    a, b = copy.wait()
    assert_type(a, ferry.DeviceArray)
    assert_type(b, ferry.DeviceArray)
    stats = rt.stats()
    assert_type(stats.in_flight, int)


class CpuTensor:
    """A CPU tensor of another library, as a type checker sees it: DLPack, no NumPy base class."""

    def __dlpack__(self, *, stream: int | None = None) -> object:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[int, int]:
        raise NotImplementedError


def other_libraries(rt: ferry.Runtime, tensor: CpuTensor, data: bytearray) -> None:
    # CPU arrays of any library are taken where NumPy arrays are, and come back as themselves
    up = rt.upload(tensor)
    assert_type(up, ferry.PendingUpload[CpuTensor, ferry.DeviceArray])
    back, dev = up.wait()
    assert_type(back, CpuTensor)
    assert_type(rt.to_device(tensor), ferry.DeviceArray)
    raw, dev = rt.upload(data, dev).wait()
    assert_type(raw, bytearray)


def waiting(rt: ferry.Runtime, array: npt.NDArray[np.float32]) -> None:
    handles = [rt.upload(array), rt.upload(array)]
    results = ferry.wait_all(handles, timeout=10.0)
    for host, dev in results:
        assert_type(host, npt.NDArray[np.float32])
        assert_type(dev, ferry.DeviceArray)
    for handle in ferry.as_completed(handles):
        assert_type(handle, ferry.PendingUpload[npt.NDArray[np.float32], ferry.DeviceArray])

    async def main() -> None:
        host, dev = await rt.upload(array)
        assert_type(host, npt.NDArray[np.float32])
        assert_type(dev, ferry.DeviceArray)

    asyncio.run(main())
