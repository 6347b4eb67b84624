"""CPU arrays of other libraries are taken wherever a NumPy array is, without a copy.

An object exporting DLPack on the CPU (as a CPU PyTorch tensor does) and one exporting only the
buffer protocol stand in for the libraries, so these run without PyTorch; the PyTorch tests skip
without it. Also: a device array refuses NumPy's conversion, and ``to="torch"`` on a CPU-only
PyTorch says so. Each runs on the emulated device and, where one is usable, on a GPU (``rt``).
"""

from __future__ import annotations

import array
import sys
import types
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import testing

_KDL_CPU, _KDL_CUDA = 1, 2


class DLPackOnly:
    """A CPU array of some library: DLPack and nothing else (no ``__array__``, no buffer protocol)."""

    def __init__(self, data: np.ndarray[Any, Any], device: tuple[int, int] = (_KDL_CPU, 0)) -> None:
        self._data = data
        self._device = device
        self.exports = 0

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.exports += 1
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


class BufferOnly:
    """A host array exporting only the buffer protocol (PEP 688's ``__buffer__`` on 3.12+; a bytearray's
    memory through a memoryview on every version)."""

    def __init__(self, nbytes: int) -> None:
        self.memory = bytearray(nbytes)

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self.memory)


def _buffer_only(nbytes: int) -> Any:
    return BufferOnly(nbytes) if sys.version_info >= (3, 12) else bytearray(nbytes)


def _bytes_of(obj: Any) -> bytes:
    return bytes(obj.memory if isinstance(obj, BufferOnly) else obj)


SIZES = [64, 1 << 20]  # the small route's size, and a staged one


@pytest.mark.parametrize("n", SIZES)
def test_upload_and_to_device_take_a_dlpack_array_and_hand_it_back(rt: ferry.Runtime, n: int) -> None:
    data = np.arange(n, dtype=np.float32)
    source = DLPackOnly(data)
    handed, device = rt.upload(source).wait()
    assert handed is source  # wait() hands back what was handed in
    assert np.array_equal(rt.to_host(device), data)
    assert np.array_equal(rt.to_host(rt.to_device(DLPackOnly(data))), data)
    into = rt.empty(n, np.float32)
    handed, same = rt.upload(source, into).wait()
    assert handed is source and same is into


@pytest.mark.parametrize("n", SIZES)
def test_download_lands_in_the_dlpack_array_s_own_memory(rt: ferry.Runtime, n: int) -> None:
    data = np.arange(n, dtype=np.int32)
    memory = np.zeros(n, np.int32)
    out = DLPackOnly(memory)
    _, handed = rt.download(rt.to_device(data), out).wait()
    assert handed is out
    assert np.array_equal(memory, data)  # its memory, not a copy of it, received the bytes


@pytest.mark.parametrize("n", SIZES)
def test_buffer_protocol_arrays_go_both_ways_without_a_copy(rt: ferry.Runtime, n: int) -> None:
    data = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    source = _buffer_only(n)
    (source.memory if isinstance(source, BufferOnly) else source)[:] = data.tobytes()
    handed, device = rt.upload(source).wait()
    assert handed is source
    assert np.array_equal(rt.to_host(device), data)
    out = _buffer_only(n)
    _, got = rt.download(device, out).wait()
    assert got is out and _bytes_of(out) == data.tobytes()
    values = array.array("d", range(n // 8))
    assert np.array_equal(rt.to_host(rt.to_device(values)), np.arange(n // 8, dtype=np.float64))


def test_a_pending_upload_guards_its_buffer_protocol_source(rt: ferry.Runtime) -> None:
    source = bytearray(range(256)) * 16
    with testing.hold(rt, "upload"):
        pending = rt.upload(source)
        assert not pending.is_ready()
        with pytest.raises(BufferError):  # the memory ferry copies from cannot move while it is pending
            source.extend(b"more")
    handed, device = pending.wait()
    source.extend(b"more")  # after wait() the guard is gone
    assert handed is source and rt.to_host(device).tobytes() == bytes(range(256)) * 16


def test_register_takes_a_cpu_array(rt: ferry.Runtime) -> None:
    memory = np.arange(1 << 16, dtype=np.float64)
    with rt.register(DLPackOnly(memory)) as registration:
        assert np.shares_memory(registration.array, memory)  # pinned in place, not a copy
        device = rt.to_device(memory)
        assert np.array_equal(rt.to_host(device), memory)
    with rt.register(bytearray(4096)) as registration:
        assert registration.array.nbytes == 4096


def test_prefetch_takes_dlpack_and_buffer_protocol_leaves(rt: ferry.Runtime) -> None:
    data = np.arange(4096, dtype=np.float32)
    batches = [(DLPackOnly(data), bytearray(data.tobytes()))]
    ((first, second),) = list(ferry.prefetch(batches, runtime=rt))
    assert np.array_equal(rt.to_host(first), data)
    assert rt.to_host(second).tobytes() == data.tobytes()


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (DLPackOnly(np.zeros(4), (_KDL_CUDA, 0)), "not in host memory"),
        ([1, 2, 3], "got list"),
        (object(), "got object"),
    ],
    ids=["a device array of another library", "a list", "an object that exports nothing"],
)
def test_what_is_not_a_host_array_is_refused_and_nothing_changes(rt: ferry.Runtime, source: Any,
                                                                 needle: str) -> None:
    before = rt.stats().submitted
    with pytest.raises(ferry.TransferSubmitError, match=needle) as info:
        rt.upload(source)
    assert "pinned buffers go through" not in str(info.value)  # the old advice, wrong for these
    with pytest.raises(ferry.TransferSubmitError, match=needle):
        rt.download(rt.empty(4), source)
    assert rt.stats().submitted == before + 0  # rt.empty submits nothing either


def test_a_pinned_buffer_given_to_upload_is_pointed_to_upload_pending(rt: ferry.Runtime) -> None:
    buf = rt.pinned(64)
    with pytest.raises(ferry.TransferSubmitError, match="upload_pending"):
        rt.upload(buf)
    buf.as_array()[:] = 1  # still owned and usable


def test_a_read_only_export_is_refused_as_a_download_s_output(rt: ferry.Runtime) -> None:
    device = rt.to_device(np.arange(16, dtype=np.uint8))
    with pytest.raises(ferry.TransferSubmitError, match="read-only"):
        rt.download(device, b"\0" * 16)
    assert np.array_equal(rt.to_host(device), np.arange(16, dtype=np.uint8))  # the source is usable


def test_register_refuses_what_is_not_a_host_array(rt: ferry.Runtime) -> None:
    with pytest.raises(TypeError, match="got list"):
        rt.register([1.0, 2.0])


def test_numpy_cannot_convert_a_device_array(rt: ferry.Runtime) -> None:
    device = rt.to_device(np.arange(4.0))
    for convert in (np.asarray, np.array, lambda a: np.add(a, 1)):
        with pytest.raises(TypeError, match=r"rt\.to_host\(\) or rt\.download\(\)|rt\.to_host\(array\)"):
            convert(device)
    assert np.array_equal(rt.to_host(device), np.arange(4.0))  # still owned and usable


def test_to_torch_on_a_cpu_only_pytorch_says_so(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("torch")
    module.version = types.SimpleNamespace(cuda=None, hip=None, __version__="2.13.0+cpu")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", module)
    with pytest.raises(ferry.FerryError, match="CPU-only build"):
        ferry.prefetch([np.zeros(4)], runtime=rt, to="torch")


# -- PyTorch itself, where it is installed ----------------------------------------------------------------


def test_cpu_torch_tensors_are_taken_like_numpy_arrays(rt: ferry.Runtime) -> None:
    torch = pytest.importorskip("torch")
    source = torch.arange(4096, dtype=torch.float32)
    handed, device = rt.upload(source).wait()
    assert handed is source
    assert np.array_equal(rt.to_host(device), source.numpy())
    assert np.array_equal(rt.to_host(rt.to_device(torch.ones(4))), np.ones(4, np.float32))
    out = torch.zeros(4096, dtype=torch.float32)
    _, got = rt.download(device, out).wait()
    assert got is out and torch.equal(out, source)  # the tensor's own memory received the bytes
    with rt.register(torch.zeros(1 << 14)):
        pass


def test_to_torch_on_this_pytorch_without_cuda_is_a_ferry_error(rt: ferry.Runtime) -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("this PyTorch is built with CUDA")
    with pytest.raises(ferry.FerryError, match="CPU-only build"):
        ferry.prefetch([np.zeros(4)], runtime=rt, to="torch")
