"""Interop: the CUDA Array Interface both ways, foreign arrays ordered after their producer
without a host wait, and the upload hand-off. Emulated analogues of the GPU tests."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import ferry
import ferry._native
from ferry import testing


def test_the_cuda_array_interface_follows_the_array_state(rt: ferry.Runtime) -> None:
    dev = rt.to_device(np.arange(12, dtype=np.float32).reshape(3, 4))
    cai = dev.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (3, 4) and cai["typestr"] == "<f4"
    assert cai["data"] == (dev.ptr, False) and cai["strides"] is None and cai["stream"] is None
    with testing.hold(rt, "both"):
        pending = rt.download_pending(dev, rt.pinned(48))
        assert dev.__cuda_array_interface__["data"][1] is True  # read-leased: read-only
        target = rt.empty(4, np.uint8)
        upload = rt.upload_pending(rt.pinned(4), target)
        with pytest.raises(ferry.BufferMovedError):
            target.__cuda_array_interface__  # in flight
    pending.wait()
    upload.wait()


def test_a_foreign_source_is_copied_after_its_producer_without_a_host_wait(emu: ferry.Runtime) -> None:
    backing = emu.empty(1 << 20, np.uint8)
    producer = testing.side_stream(emu)
    foreign = testing.ForeignArray(backing, stream=producer)
    testing.produce(emu, producer, backing.ptr, 1 << 20, 0x5A, delay=0.05)  # a slow "kernel"
    waits = testing.host_waits(emu)
    pending = emu.download_pending(foreign, emu.pinned(1 << 20))
    assert testing.host_waits(emu) == waits  # submission did not wait on the host
    source, buf = pending.wait()
    assert source is foreign
    assert np.all(buf.as_array() == 0x5A)  # the copy ran after the producer


def test_a_foreign_destination_receives_the_bytes(emu: ferry.Runtime) -> None:
    backing = emu.empty(4096, np.uint8)
    foreign = testing.ForeignArray(backing, stream=testing.side_stream(emu))
    buf = emu.pinned(4096)
    buf.as_array()[:] = np.arange(4096) % 251
    got_buf, got = emu.upload_pending(buf, foreign).wait()
    assert got is foreign and got_buf is buf
    assert np.array_equal(emu.to_host(backing), np.arange(4096) % 251)
    readonly = testing.ForeignArray(backing, stream=None, readonly=True)
    with pytest.raises(ferry.TransferSubmitError, match="read-only"):
        emu.upload_pending(buf, readonly)
    strided = testing.ForeignArray(backing, stream=None, strides=(2,))
    with pytest.raises(ferry.TransferSubmitError, match="not C-contiguous"):
        emu.download_pending(strided, buf)
    assert buf.state == "owned"


def test_a_producer_failure_surfaces_as_the_transfers_error(emu: ferry.Runtime) -> None:
    backing = emu.empty(4096, np.uint8)
    producer = testing.side_stream(emu)
    testing.produce(emu, producer, backing.ptr, 4096, 1, delay=0.01, fail=True)
    pending = emu.download_pending(testing.ForeignArray(backing, stream=producer), emu.pinned(4096))
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()


def test_hand_off_orders_consumers_after_the_copy_without_a_host_wait(emu: ferry.Runtime) -> None:
    data = (np.arange(1 << 16) % 253).astype(np.uint8)
    buf = emu.pinned(data.nbytes)
    buf.as_array()[:] = data
    dev = emu.empty(data.nbytes, np.uint8)
    consumer = testing.side_stream(emu)
    out = emu.pinned(data.nbytes)
    with testing.hold(emu, "upload"):
        pending = emu.upload_pending(buf, dev)
        waits = testing.host_waits(emu)
        handed = pending.hand_off(consumer)
        assert handed is dev and dev.state == "owned" and buf.state == "in_flight"
        assert dev.__cuda_array_interface__["stream"] is not None  # names ferry's copy stream
        seen = testing.consume(emu, consumer, dev.ptr, data.nbytes)  # a "kernel" on the consumer stream
        later = emu.download_pending(dev, out)  # ferry orders its own work after the copy
        assert testing.host_waits(emu) == waits
        time.sleep(0.05)  # room for the consumer to run, if nothing held it back
        assert not seen.ran()  # held back on the device until the copy completes
        assert later.is_ready() is False
    assert np.array_equal(seen.result(), data)  # and then it saw the bytes
    _, out = later.wait()
    assert np.array_equal(out.as_array(), data)
    got_buf, got_dev = pending.wait()
    assert got_buf is buf and got_dev is dev and dev.__cuda_array_interface__["stream"] is None


def test_staged_uploads_cannot_be_handed_off_on_the_python_engine() -> None:
    with ferry.Runtime("emulated", staging=ferry.StagingConfig(engine="python")) as rt:
        pending = rt.upload(np.zeros(8 << 20, np.uint8))
        with pytest.raises(ferry.FerryError, match="staged"):
            pending.hand_off()
        pending.wait()


def test_staged_uploads_hand_off_on_the_native_engine() -> None:
    if ferry._native.load() is None:
        pytest.skip(f"the native engine does not run here: {ferry._native.status()}")
    data = (np.arange(8 << 20) % 251).astype(np.uint8)
    with ferry.Runtime("emulated", staging=ferry.StagingConfig(engine="native")) as rt:
        consumer = testing.side_stream(rt)
        out = np.empty_like(data)
        with testing.hold(rt, "upload"):
            pending = rt.upload(data)
            waits = testing.host_waits(rt)
            dev = pending.hand_off(consumer)
            assert dev.state == "owned"
            assert dev.__cuda_array_interface__["stream"] is not None  # names a stream that waits for every chunk
            seen = testing.consume(rt, consumer, dev.ptr, data.nbytes)
            later = rt.download(dev, out)  # ferry orders its own download after every chunk
            assert testing.host_waits(rt) == waits
            time.sleep(0.05)
            assert not seen.ran()
            assert later.is_ready() is False
        assert np.array_equal(seen.result(), data)
        _, got = later.wait()
        assert np.array_equal(got, data)
        source, handed = pending.wait()
        assert source is data and handed is dev


class DLPackOnly:
    """A device array of "another library" that speaks DLPack only (no CUDA Array Interface)."""

    def __init__(self, owner: ferry.DeviceArray) -> None:
        self.__dlpack__ = owner.__dlpack__
        self.__dlpack_device__ = owner.__dlpack_device__


def test_dlpack_round_trip_and_release(rt: ferry.Runtime) -> None:
    import gc
    import weakref

    data = np.arange(3000, dtype=np.int16).reshape(30, 100)
    dev = rt.to_device(data)
    assert dev.__dlpack_device__() == (2, rt.device)
    alive = weakref.ref(dev)
    foreign = DLPackOnly(dev)
    del dev
    pending = rt.download_pending(foreign, rt.pinned(data.nbytes))
    del foreign
    gc.collect()
    assert alive() is not None  # the exported array lives while the capsule is in use
    source, buf = pending.wait()
    assert isinstance(source, DLPackOnly)
    assert np.array_equal(buf.as_array(np.int16, data.shape), data)
    del pending, source
    gc.collect()
    assert alive() is None  # the deleter ran once the transfer was settled


class _TorchLike:
    """Stands in for a PyTorch tensor (an instance of the fake ``torch.Tensor``): DLPack over a ferry array."""

    asked: list[object]

    def __init__(self, owner: ferry.DeviceArray) -> None:
        self.owner = owner

    def __dlpack__(self, stream: object = None) -> object:
        self.asked.append(stream)
        return self.owner.__dlpack__(stream=stream)  # type: ignore[arg-type]

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.owner.__dlpack_device__()


def _fake_torch(monkeypatch: pytest.MonkeyPatch, current: Any) -> list[object]:
    """A ``torch`` module whose tensors are :class:`_TorchLike` and whose current raw stream is
    ``current(index)``; the DLPack streams the tensors were asked for."""
    import sys
    import types

    from ferry._interop import _foreign

    asked: list[object] = []
    module = types.ModuleType("torch")
    module.Tensor = _TorchLike  # type: ignore[attr-defined]
    module._C = types.SimpleNamespace(_cuda_getCurrentRawStream=current)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(_foreign, "_RAW_STREAM", [])
    monkeypatch.setattr(_TorchLike, "asked", asked, raising=False)
    return asked


def test_a_pytorch_tensor_s_copy_is_ordered_after_pytorch_s_current_stream_by_ferry(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = testing.side_stream(emu)
    indexes: list[int] = []
    asked = _fake_torch(monkeypatch, lambda index: indexes.append(index) or producer)
    dev = emu.empty(1 << 16, np.uint8)
    testing.produce(emu, producer, dev.ptr, dev.nbytes, 7, delay=0.05)  # PyTorch's queued kernel
    _, out = emu.download(_TorchLike(dev)).wait()
    assert (out == 7).all()  # the copy ran after the producer: ferry's event on PyTorch's stream
    assert asked == [-1] and indexes == [emu.device]  # no synchronization asked of PyTorch: ferry's own
    target = emu.empty(1 << 16, np.uint8)
    testing.produce(emu, producer, target.ptr, target.nbytes, 3, delay=0.05)  # PyTorch's queued kernel
    seen = testing.consume(emu, producer, target.ptr, target.nbytes)  # then its read of what it wrote
    emu.upload(np.full(1 << 16, 9, np.uint8), _TorchLike(target)).wait()
    assert (seen.result() == 3).all()  # the upload waited for PyTorch's queued work before writing
    assert (emu.to_host(target) == 9).all()  # and was not overwritten by it
    assert asked == [-1, -1]


def test_pytorch_s_default_stream_is_the_legacy_stream_and_a_failing_getter_falls_back(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry._interop import _foreign

    asked = _fake_torch(monkeypatch, lambda index: 0)
    dev = emu.empty(4096, np.uint8)
    assert _foreign.torch_stream(_TorchLike(dev), emu.device) == 1  # handle 0 is the legacy default stream
    assert _foreign.torch_stream(dev, emu.device) is None  # not a PyTorch tensor
    testing.produce(emu, 1, dev.ptr, dev.nbytes, 5, delay=0.05)  # on the legacy default stream
    _, out = emu.download(_TorchLike(dev)).wait()
    assert (out == 5).all() and asked == [-1]

    def broken(index: int) -> int:
        raise RuntimeError("no CUDA here")

    asked = _fake_torch(monkeypatch, broken)
    _, out = emu.download(_TorchLike(dev)).wait()
    assert (out == 5).all()
    assert len(asked) == 1 and isinstance(asked[0], int) and asked[0] not in (-1, None)  # ferry's stream


def test_a_pytorch_tensor_on_another_device_is_refused_before_anything_is_asked(
    emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Elsewhere(_TorchLike):
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, self.owner.__dlpack_device__()[1] + 1)

    indexes: list[int] = []
    asked = _fake_torch(monkeypatch, lambda index: indexes.append(index) or 1)
    dev = emu.empty(4096, np.uint8)
    out = np.zeros(4096, np.uint8)
    with pytest.raises(ferry.TransferSubmitError, match="DLPack device"):
        emu.download(Elsewhere(dev), out)
    assert asked == [] and indexes == []  # neither the capsule nor PyTorch's stream of that device was asked
    assert dev.state == "owned" and out.flags.writeable  # nothing taken, nothing changed
    assert emu.stats().in_flight == 0


class Capsuled:
    """A DLPack producer handing out a prepared capsule (the tensor's dtype and layout are the test's)."""

    def __init__(self, capsule: object, device: tuple[int, int]) -> None:
        self.capsule, self.device = capsule, device

    def __dlpack__(self, stream: object = None) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def _compiled_export() -> Any:
    module = ferry._native._import()[0]  # even under FERRY_NATIVE=0: only the capsule is made with it
    if module is None or not hasattr(module, "dlpack_export"):
        pytest.skip("the compiled extension is not built here")
    return module.dlpack_export


def test_a_refused_dlpack_dtype_releases_the_producers_tensor(emu: ferry.Runtime) -> None:
    import gc
    import weakref

    from ferry._interop import _dlpack

    export = _compiled_export()
    dev = emu.empty(8, np.uint16)
    owner = emu.empty(8, np.uint16)  # the producer's tensor: alive while its capsule is unreleased
    alive = weakref.ref(owner)
    before = _dlpack.live_exports()
    bfloat16 = Capsuled(export(owner, owner.ptr, (8,), 4, 16, 2, emu.device), (2, emu.device))  # kDLBfloat
    del owner
    with pytest.raises(ferry.TransferSubmitError, match="DLPack dtype"):
        emu.upload(np.zeros(8, np.uint16), bfloat16)
    del bfloat16
    gc.collect()
    assert alive() is None and _dlpack.live_exports() == before  # consumed, refused, released
    assert dev.state == "owned"


def test_a_dlpack_import_reads_strides_and_the_byte_offset() -> None:
    # a producer's tensor made by hand (ctypes): strided, with a byte offset; read by the compiled
    # import (or by ctypes under FERRY_NATIVE=0), renamed once, its deleter called once
    import ctypes

    from ferry._interop import _dlpack

    deleted: list[int] = []
    deleter = _dlpack._DELETER(lambda managed: deleted.append(1))
    managed = _dlpack.DLManagedTensor()
    shape = (ctypes.c_int64 * 2)(3, 5)
    strides = (ctypes.c_int64 * 2)(1, 3)  # Fortran order, in elements
    managed.dl_tensor.data = 1 << 20
    managed.dl_tensor.device = _dlpack.DLDevice(2, 0)
    managed.dl_tensor.ndim = 2
    managed.dl_tensor.dtype = _dlpack.DLDataType(2, 32, 1)  # float32
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 256
    managed.deleter = deleter
    capsule = _dlpack._api.PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)
    imported = _dlpack.Imported(capsule)
    assert imported.ptr == (1 << 20) + 256
    assert (imported.shape, imported.strides, imported.dtype, imported.device) == (
        (3, 5), (1, 3), np.dtype(np.float32), (2, 0))
    with pytest.raises(ferry.TransferSubmitError, match="unused"):
        _dlpack.Imported(capsule)  # renamed: a capsule is consumed once
    assert deleted == []
    imported.release()
    imported.release()
    assert deleted == [1]


def test_a_dlpack_export_refuses_a_dtype_dlpack_cannot_describe() -> None:
    export = _compiled_export()
    with pytest.raises(ValueError, match="bits"):
        export(object(), 4096, (3,), 2, 256, 2, 0)  # 256 bits do not fit DLPack's 8-bit field


def test_an_unconsumed_capsule_releases_its_array(rt: ferry.Runtime) -> None:
    import gc
    import weakref

    dev = rt.empty(16, np.float32)
    alive = weakref.ref(dev)
    capsule = dev.__dlpack__()
    del dev
    gc.collect()
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None


def test_dlpack_refusals(rt: ferry.Runtime) -> None:
    dev = rt.empty(4, np.float32)
    with pytest.raises(BufferError):
        dev.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        dev.__dlpack__(dl_device=(1, 0))
    structured = rt.empty(2, np.dtype([("a", "<i4"), ("b", "<f4")]))
    with pytest.raises(BufferError):
        structured.__dlpack__()
    with testing.hold(rt, "upload"):
        pending = rt.upload_pending(rt.pinned(16), dev)
        with pytest.raises(ferry.BufferMovedError):
            dev.__dlpack__()
    pending.wait()


@pytest.mark.parametrize("nbytes", [4096, 12 << 20])  # the direct route, and the staging lanes
def test_pageable_routes_take_foreign_arrays_in_producer_order(emu: ferry.Runtime, nbytes: int) -> None:
    backing = emu.empty(nbytes, np.uint8)
    producer = testing.side_stream(emu)
    testing.produce(emu, producer, backing.ptr, nbytes, 0x33, delay=0.05)
    source, out = emu.download(testing.ForeignArray(backing, stream=producer)).wait()
    assert isinstance(source, testing.ForeignArray)
    assert np.all(out == 0x33)  # every lane ran after the producer
    data = (np.arange(nbytes) % 241).astype(np.uint8)
    target = testing.ForeignArray(backing, stream=producer)
    got_source, got = emu.upload(data, target).wait()
    assert got is target and got_source is data
    assert np.array_equal(emu.to_host(backing), data)
    with pytest.raises(ferry.TransferSubmitError, match="mismatch"):
        emu.upload(data[:-1], target)


def test_pageable_download_through_dlpack(rt: ferry.Runtime) -> None:
    data = (np.arange(5 << 20) % 239).astype(np.uint8)
    dev = rt.to_device(data)
    source, out = rt.download(DLPackOnly(dev)).wait()
    assert isinstance(source, DLPackOnly)
    assert np.array_equal(out, data)
    from ferry._interop import _dlpack

    exported = _dlpack.live_exports()
    with pytest.raises(ferry.TransferSubmitError, match="mismatch"):
        rt.download(DLPackOnly(dev), np.empty(10, np.uint8))
    assert _dlpack.live_exports() == exported  # refused: the consumed capsule was given back


def test_numpy_refusing_a_device_array_gets_a_clean_error_and_nothing_is_printed() -> None:
    import importlib.util
    import subprocess
    import sys

    code = (
        "import gc, numpy as np, ferry\n"
        "from ferry._interop import _dlpack\n"
        "with ferry.Runtime('emulated') as rt:\n"
        "    dev = rt.to_device(np.arange(4.0))\n"
        "    try:\n"
        "        np.from_dlpack(dev)\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__)\n"
        "    gc.collect()\n"
        "    print(_dlpack.live_exports())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    if "SystemError" in result.stdout and importlib.util.find_spec("ferry._native._engine") is None:
        pytest.skip("without the compiled extension the capsule destructor cannot keep NumPy's error")
    kind, exports = result.stdout.split()
    assert kind in ("BufferError", "RuntimeError", "TypeError", "ValueError")  # NumPy's own refusal
    assert exports == "0"  # the unconsumed capsule released the array
    assert result.stderr == ""  # no "Exception ignored in ctypes callback"


_LATE_CONSUMER = r"""
#include <stdlib.h>
typedef struct { char dl_tensor[48]; void *manager_ctx; void (*deleter)(void *); } managed_t;
static managed_t *tensor;
static void (*deleter)(void *);
static void free_late(void) { deleter(tensor); }
/* a consumer that frees the tensor only once the process exits, after the interpreter is gone */
void keep_until_exit(managed_t *m) { tensor = m; deleter = m->deleter; atexit(free_late); }
"""


def test_a_consumer_freeing_a_tensor_after_the_interpreter_is_gone_does_not_crash_the_exit(tmp_path) -> None:
    import importlib.util
    import shutil
    import subprocess
    import sys

    if importlib.util.find_spec("ferry._native._engine") is None:
        pytest.skip("needs the compiled extension (its deleter outlives the interpreter; a ctypes one cannot)")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the late consumer")
    (tmp_path / "late.c").write_text(_LATE_CONSUMER)
    lib = tmp_path / "late.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "late.c")], check=True)
    code = (
        "import ctypes, sys, numpy as np, ferry\n"
        "api = ctypes.pythonapi  # prototypes of our own (ferry sets its own on the shared functions)\n"
        "get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(('PyCapsule_GetPointer', api))\n"
        "rename = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(('PyCapsule_SetName', api))\n"
        "late = ctypes.CDLL(sys.argv[1])\n"
        "rt = ferry.Runtime('emulated')\n"
        "dev = rt.to_device(np.arange(4.0))\n"
        "capsule = dev.__dlpack__()\n"
        "late.keep_until_exit(ctypes.c_void_p(get(capsule, b'dltensor')))\n"
        "rename(capsule, b'used_dltensor')  # consumed: the consumer owns the deleter call\n"
        "print('consumed')\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["consumed"]
    assert "Fatal" not in result.stderr
