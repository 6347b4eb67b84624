"""One condition, one error type; refusals change nothing."""

from __future__ import annotations

import numpy as np
import pytest

import ferry


def test_every_call_on_a_closed_runtime_raises_runtime_closed_error(rt: ferry.Runtime) -> None:
    buf = rt.pinned(64)
    dev = rt.empty(16, np.float32)
    host = np.zeros(16, np.float32)
    rt.close()
    calls = [
        lambda: rt.pinned(8),
        lambda: rt.empty(8),
        lambda: rt.upload(host),
        lambda: rt.upload(host, dev),
        lambda: rt.download(dev),
        lambda: rt.upload_pending(buf, dev),
        lambda: rt.download_pending(dev, buf),
        lambda: rt.to_device(host),
        lambda: rt.register(host),
        rt.poll,
        rt.info,
    ]
    for call in calls:
        with pytest.raises(ferry.RuntimeClosedError, match="closed"):
            call()
    assert host.flags.writeable  # a refused submission changed nothing


def test_runtime_closed_error_is_also_a_submit_error() -> None:
    assert issubclass(ferry.RuntimeClosedError, ferry.TransferSubmitError)
    assert issubclass(ferry.RuntimeClosedError, ferry.FerryError)


def test_entering_a_closed_runtime_raises() -> None:
    rt = ferry.Runtime("emulated")
    rt.close()
    with pytest.raises(ferry.RuntimeClosedError), rt:
        pass


def test_to_device_and_upload_take_numpy_arrays_only(rt: ferry.Runtime) -> None:
    for call in (rt.to_device, rt.upload):
        with pytest.raises(ferry.TransferSubmitError, match="NumPy array"):
            call([1.0, 2.0])  # type: ignore[arg-type]
    assert rt.stats().device_bytes == 0  # nothing was allocated for the refused calls
    out = rt.to_host(rt.to_device(np.asarray([1.0, 2.0])))
    assert out.tolist() == [1.0, 2.0]
