"""Checkpoint formats on the file route: safetensors and .npy, loading, saving and their errors."""

from __future__ import annotations

import io
import itertools
import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import testing
from ferry._files import _dtypes
from ferry._routes import _file

NATIVE = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F16": np.float16,
    "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64, "I64": np.int64, "F64": np.float64,
    "C64": np.complex64,
}


@pytest.fixture
def py_emu() -> Iterator[ferry.Runtime]:
    """An emulated runtime on the pure-Python engine, whose reader threads' ``fill_slot``/``drain_slot``
    seam these tests intercept (the compiled engine's file jobs: test_files_native.py)."""
    runtime = ferry.Runtime("emulated", staging=ferry.StagingConfig(engine="python"))
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


def _write(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], *,
           metadata: dict[str, str] | None = None, pad: int = 0) -> None:
    """A safetensors file written by hand (no dependency): name -> (dtype, shape, bytes)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    at = 0
    blobs = []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8 + pad)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _sample(seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray[Any, Any]] = {}
    for i, (name, dt) in enumerate(NATIVE.items()):
        shape = (i % 3 + 1, 17 + i)
        if dt is np.bool_:
            out[f"t.{name}"] = rng.integers(0, 2, size=shape).astype(bool)
        elif np.dtype(dt).kind in "fc":
            out[f"t.{name}"] = rng.standard_normal(shape).astype(dt)
        else:
            out[f"t.{name}"] = rng.integers(0, 100, size=shape).astype(dt)
    out["empty"] = np.zeros((0, 4), np.float32)
    out["scalar"] = np.array(3.5, np.float32)
    out["big"] = rng.standard_normal((300, 1000)).astype(np.float32)
    return out


def _by_hand(path: Path, arrays: dict[str, np.ndarray[Any, Any]]) -> None:
    names = {np.dtype(v): k for k, v in NATIVE.items()}
    _write(path, {k: (names[v.dtype], v.shape, v.tobytes()) for k, v in arrays.items()})


def test_load_safetensors_every_numpy_dtype(rt: ferry.Runtime, tmp_path: Path) -> None:
    arrays = _sample()
    path = tmp_path / "m.safetensors"
    _by_hand(path, arrays)
    seen: list[tuple[int, int]] = []
    loaded = ferry.load_safetensors(path, runtime=rt, progress=lambda done, total: seen.append((done, total)))
    assert list(loaded) == list(arrays)
    for name, value in arrays.items():
        got = loaded[name]
        assert isinstance(got, ferry.DeviceArray) and got.dtype == value.dtype and got.shape == value.shape
        assert np.array_equal(rt.to_host(got), value), name
    total = sum(v.nbytes for v in arrays.values())
    assert seen[-1] == (total, total)
    assert all(a <= b for (a, _), (b, _) in itertools.pairwise(seen))


def test_one_pass_of_reads_for_many_tensors(
    emu: ferry.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    arrays = {f"layer.{i}": rng.standard_normal((i % 7 + 1, 3000)).astype(np.float32) for i in range(200)}
    path = tmp_path / "many.safetensors"
    _by_hand(path, arrays)
    monkeypatch.setattr(_file, "SLOT_BYTES", 1 << 20)
    reads: list[tuple[int, int]] = []
    real = _file.fill_slot

    def counting(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        reads.append((chunk.start, chunk.need))
        real(opened, direct, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", counting)
    loaded = ferry.load_safetensors(path, runtime=emu)
    for name, value in arrays.items():
        assert np.array_equal(emu.to_host(loaded[name]), value)
    reads.sort()
    assert len(reads) < len(arrays) // 4  # tensors coalesced into large reads
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(reads))  # each byte read once, in one pass
    assert sum(n for _, n in reads) <= os.path.getsize(path)


def test_safetensors_package_reads_what_ferry_saves_and_back(emu: ferry.Runtime, tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    arrays = _sample(1)
    path = tmp_path / "ours.safetensors"
    ferry.save_safetensors({k: emu.to_device(v) for k, v in arrays.items()}, path, runtime=emu,
                           metadata={"format": "np"})
    theirs = st.load_file(str(path))
    assert sorted(theirs) == sorted(arrays)
    for name, value in arrays.items():
        assert np.array_equal(theirs[name], value), name
    import safetensors

    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata() == {"format": "np"}
    other = tmp_path / "theirs.safetensors"
    st.save_file(arrays, str(other))
    loaded = ferry.load_safetensors(other, runtime=emu)
    for name, value in arrays.items():
        assert np.array_equal(emu.to_host(loaded[name]), value), name


def test_bf16_and_fp8_carry_ml_dtypes(emu: ferry.Runtime, tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    raw = {name: rng.integers(0, 255, size=(6, 5), dtype=np.uint8) for name in
           ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")}
    bf = rng.standard_normal((4, 9)).astype(ml_dtypes.bfloat16)
    tensors = {name.lower(): (name, value.shape, value.tobytes()) for name, value in raw.items()}
    tensors["bf"] = ("BF16", bf.shape, bf.tobytes())
    packed = rng.integers(0, 255, size=12, dtype=np.uint8)
    tensors["f4"] = ("F4", (4, 6), packed.tobytes())
    path = tmp_path / "low.safetensors"
    _write(path, tensors)
    loaded = ferry.load_safetensors(path, runtime=emu)
    assert loaded["bf"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert emu.to_host(loaded["bf"]).tobytes() == bf.tobytes()
    assert loaded["f8_e4m3"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert loaded["f8_e5m2"].dtype == np.dtype(ml_dtypes.float8_e5m2)
    for name, value in raw.items():
        assert emu.to_host(loaded[name.lower()]).tobytes() == value.tobytes()
    assert loaded["f4"].dtype == np.uint8 and loaded["f4"].shape == (4, 3)  # packed: the last axis in bytes
    assert emu.to_host(loaded["f4"]).tobytes() == packed.tobytes()
    out = tmp_path / "low-out.safetensors"
    ferry.save_safetensors({"bf": loaded["bf"], "e4": loaded["f8_e4m3"]}, out, runtime=emu)
    header, _, _ = ferry.read_safetensors_header(out)
    assert header["bf"]["dtype"] == "BF16" and header["e4"]["dtype"] == "F8_E4M3"


def test_without_ml_dtypes_the_error_names_the_extra(emu: ferry.Runtime, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bf.safetensors"
    _write(path, {"w": ("BF16", (2,), b"\x00\x01\x02\x03")})
    monkeypatch.setattr(_dtypes, "ml_dtypes_module", lambda: None)
    before = emu.stats().device_bytes
    with pytest.raises(ImportError, match=r"tensor 'w'.*BF16.*ferry\[files\].*ml_dtypes"):
        ferry.load_safetensors(path, runtime=emu)
    assert emu.stats().device_bytes == before


def test_names_shards_and_the_index(emu: ferry.Runtime, tmp_path: Path) -> None:
    a = {"a.0": np.arange(10, dtype=np.int32), "a.1": np.ones(5, np.float32)}
    b = {"b.0": np.arange(7, dtype=np.int64)}
    _by_hand(tmp_path / "model-00001-of-00002.safetensors", a)
    _by_hand(tmp_path / "model-00002-of-00002.safetensors", b)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        "a.0": "model-00001-of-00002.safetensors", "a.1": "model-00001-of-00002.safetensors",
        "b.0": "model-00002-of-00002.safetensors"}}))
    every = ferry.load_safetensors(index, runtime=emu)
    assert sorted(every) == ["a.0", "a.1", "b.0"]
    assert np.array_equal(emu.to_host(every["b.0"]), b["b.0"])
    some = ferry.load_safetensors([tmp_path / "model-00001-of-00002.safetensors",
                                   tmp_path / "model-00002-of-00002.safetensors"], runtime=emu, names=["a.1", "b.0"])
    assert sorted(some) == ["a.1", "b.0"]
    assert np.array_equal(emu.to_host(some["a.1"]), a["a.1"])
    with pytest.raises(ferry.CheckpointError, match="'nope' is not in"):
        ferry.load_safetensors(index, runtime=emu, names=["a.0", "nope"])
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    before = emu.stats().device_bytes
    with pytest.raises(ferry.CheckpointError, match=r"model-00002-of-00002.*'b\.0'.*missing"):
        ferry.load_safetensors(index, runtime=emu)
    assert emu.stats().device_bytes == before


BAD_HEADERS = [
    (b"\x05\x00\x00\x00\x00\x00\x00\x00{}", "claims 5 bytes"),
    (struct.pack("<Q", 4) + b"nope", "not JSON"),
    (struct.pack("<Q", 2) + b"[]", "not an object"),
    (b"\x01\x02", "no header length"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_HEADERS)
def test_malformed_headers_are_named(emu: ferry.Runtime, tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ferry.CheckpointError, match=rf"bad\.safetensors.*{message}"):
        ferry.load_safetensors(path, runtime=emu)


def _header(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}, "dtype 'Q7'"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "runs past the end"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8 bytes"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4]}, "data_offsets"),
])
def test_bad_tensors_are_named(emu: ferry.Runtime, tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    path = tmp_path / "t.safetensors"
    _header(path, {"ok": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "weight": entry}, b"\x00" * 8)
    before = emu.stats()
    with pytest.raises(ferry.CheckpointError, match=rf"t\.safetensors.*'weight'.*{message}|t\.safetensors.*{message}"):
        ferry.load_safetensors(path, runtime=emu)
    after = emu.stats()
    assert after.device_bytes == before.device_bytes and after.abandoned == 0


def test_overlapping_tensors_are_refused(emu: ferry.Runtime, tmp_path: Path) -> None:
    path = tmp_path / "o.safetensors"
    _header(path, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                   "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\x00" * 8)
    with pytest.raises(ferry.CheckpointError, match="'a' and 'b' overlap"):
        ferry.load_safetensors(path, runtime=emu)


def _grow_during_read(path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    real = _file.fill_slot
    done: list[int] = []

    def changing(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        if not done:
            done.append(1)
            if how == "grow":
                with open(path, "ab") as f:
                    f.write(b"\x00" * 100)
            else:
                os.truncate(path, 1000)
        real(opened, direct, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", changing)


@pytest.mark.parametrize("how", ["grow", "truncate"])
def test_a_file_changing_during_the_load_fails_it_and_frees_everything(
    py_emu: ferry.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    arrays = _sample(5)
    path = tmp_path / "c.safetensors"
    _by_hand(path, arrays)
    warm = py_emu.to_device(np.zeros(3, np.float32))  # the pools warm: stats compare like with like
    py_emu.to_host(warm)
    before = py_emu.stats()
    _grow_during_read(path, monkeypatch, how)
    expected = "changed size" if how == "grow" else r"at byte \d+ \(tensor '[^']+'\).*ended"
    with pytest.raises(ferry.CheckpointError, match=rf"c\.safetensors.*{expected}"):
        ferry.load_safetensors(path, runtime=py_emu)
    after = py_emu.stats()
    assert after.device_bytes == before.device_bytes
    assert after.abandoned == 0 and after.abandoned_bytes == 0
    assert after.pinned_free_bytes == after.pinned_pool_bytes - after.staging_pinned_bytes


def test_a_failed_shard_frees_the_shards_loaded_before(py_emu: ferry.Runtime, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _by_hand(tmp_path / "1.safetensors", {"x": np.arange(1000, dtype=np.float32)})
    _by_hand(tmp_path / "2.safetensors", {"y": np.arange(1000, dtype=np.float32)})
    before = py_emu.stats().device_bytes
    real = _file.fill_slot

    def failing(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        if opened.name.endswith("2.safetensors"):
            raise _file.FileReadError(f"{opened.name!r} at byte {chunk.start}: the read failed: injected")
        real(opened, direct, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", failing)
    with pytest.raises(ferry.CheckpointError, match=r"2\.safetensors.*injected"):
        ferry.load_safetensors([tmp_path / "1.safetensors", tmp_path / "2.safetensors"], runtime=py_emu)
    assert py_emu.stats().device_bytes == before


def test_save_refuses_what_it_cannot_write_and_leaves_no_file(emu: ferry.Runtime, tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    good = emu.to_device(np.ones(4, np.float32))
    with pytest.raises(ferry.TransferSubmitError, match="tensor 'h'"):
        ferry.save_safetensors({"g": good, "h": np.ones(3)}, path, runtime=emu)
    busy = emu.empty(4, np.float32)
    pending = emu.upload(np.ones(4, np.float32), busy)
    with pytest.raises(ferry.TransferSubmitError, match=r"tensor 'b'.*in_flight"):
        ferry.save_safetensors({"b": busy}, path, runtime=emu)
    pending.wait()
    with pytest.raises(ferry.CheckpointError, match="cannot open"):
        ferry.save_safetensors({"g": good}, tmp_path / "no" / "dir.safetensors", runtime=emu)
    assert not path.exists() and good.state == "owned"
    assert os.listdir(tmp_path) == []


def test_a_failed_save_removes_its_temporary_file(py_emu: ferry.Runtime, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        raise _file.FileReadError(f"{opened.name!r} at byte {chunk.start}: the write failed: disk full")

    monkeypatch.setattr(_file, "drain_slot", failing)
    source = py_emu.to_device(np.ones(1000, np.float32))
    path = tmp_path / "f.safetensors"
    with pytest.raises(ferry.CheckpointError, match=r"f\.safetensors.*disk full"):
        ferry.save_safetensors({"w": source}, path, runtime=py_emu)
    assert os.listdir(tmp_path) == [] and source.state == "owned"


def test_npy_round_trips(rt: ferry.Runtime, tmp_path: Path) -> None:
    value = np.random.default_rng(6).standard_normal((33, 17)).astype(np.float64)
    path = tmp_path / "a.npy"
    np.save(path, value)
    loaded = ferry.load_npy(path, runtime=rt)
    assert loaded.shape == value.shape and loaded.dtype == value.dtype
    assert np.array_equal(rt.to_host(loaded), value)
    out = tmp_path / "b.npy"
    ferry.save_npy(loaded, out, runtime=rt)
    assert np.array_equal(np.load(out), value)


def test_npy_refuses_what_it_cannot_load(emu: ferry.Runtime, tmp_path: Path) -> None:
    path = tmp_path / "f.npy"
    np.save(path, np.asfortranarray(np.ones((3, 4))))
    with pytest.raises(ferry.CheckpointError, match="Fortran"):
        ferry.load_npy(path, runtime=emu)
    np.save(path, np.ones(3, ">f4"))
    with pytest.raises(ferry.CheckpointError, match="big-endian"):
        ferry.load_npy(path, runtime=emu)
    path.write_bytes(b"not numpy")
    with pytest.raises(ferry.CheckpointError, match=r"not a valid \.npy"):
        ferry.load_npy(path, runtime=emu)
    np.save(path, np.ones(1000))
    os.truncate(path, 500)
    with pytest.raises(ferry.CheckpointError, match="runs past the end"):
        ferry.load_npy(path, runtime=emu)
    before = emu.stats()
    for shape in [(2**32, 2**32), (2**62, 4), (2**40, 2**24)]:  # element counts whose int64 product wraps
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
        path.write_bytes(header.getvalue() + bytes(64))
        with pytest.raises(ferry.CheckpointError, match="runs past the end"):  # before anything is allocated
            ferry.load_npy(path, runtime=emu)
    assert emu.stats().device_bytes == before.device_bytes


def test_arguments_are_checked(emu: ferry.Runtime, tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    _by_hand(path, {"x": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="to must be"):
        ferry.load_safetensors(path, runtime=emu, to="tensorflow")
    with pytest.raises(TypeError, match="runtime"):
        ferry.load_safetensors(path, runtime="emulated")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="names"):
        ferry.load_safetensors(path, runtime=emu, names="x")
    with pytest.raises(ferry.CheckpointError, match="cannot read"):
        ferry.load_safetensors(tmp_path / "missing.safetensors", runtime=emu)


@pytest.mark.cuda
def test_torch_tensors_carry_torch_dtypes(torch: Any, tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {
        "bf": torch.randn(64, 33, dtype=torch.bfloat16),
        "h": torch.randn(7, dtype=torch.float16),
        "i": torch.arange(10, dtype=torch.int64),
        "b": torch.tensor([True, False]),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["f8"] = torch.randn(16).to(torch.float8_e4m3fn)
    path = tmp_path / "t.safetensors"
    st.save_file(tensors, str(path))
    with ferry.Runtime("cuda") as rt:
        loaded = ferry.load_safetensors(path, runtime=rt, to="torch")
        for name, value in tensors.items():
            got = loaded[name]
            assert got.dtype == value.dtype and got.is_cuda and tuple(got.shape) == tuple(value.shape)
            assert torch.equal(got.cpu().view(torch.uint8), value.view(torch.uint8)), name
        out = tmp_path / "o.safetensors"
        ferry.save_safetensors({k: v.cuda() for k, v in tensors.items()}, out, runtime=rt)
        back = st.load_file(str(out))
        for name, value in tensors.items():
            assert torch.equal(back[name].view(torch.uint8), value.view(torch.uint8)), name
        del loaded


@pytest.mark.cuda
def test_cupy_arrays_and_a_refused_bf16(cupy: Any, tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    value = np.arange(100, dtype=np.float32)
    _by_hand(path, {"v": value})
    with ferry.Runtime("cuda") as rt:
        loaded = ferry.load_safetensors(path, runtime=rt, to="cupy")
        assert np.array_equal(cupy.asnumpy(loaded["v"]), value)
        _write(path, {"w": ("BF16", (2,), b"\x00\x01\x02\x03")})
        before = rt.stats().device_bytes
        with pytest.raises(ferry.CheckpointError, match=r"'w'.*BF16.*CuPy"):
            ferry.load_safetensors(path, runtime=rt, to="cupy")
        assert rt.stats().device_bytes == before
        del loaded


def test_the_load_command_reports_and_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ferry.__main__ import main

    path = tmp_path / "cli.safetensors"
    _by_hand(path, {"a": np.ones((64, 64), np.float32), "b": np.arange(10, dtype=np.int64)})
    assert main(["--backend", "emulated", "load", str(path)]) == 0
    out = capsys.readouterr().out
    assert "loaded 2 tensor(s)" in out and "GB/s" in out
    np.save(tmp_path / "x.npy", np.ones(7))
    assert main(["--backend", "emulated", "load", str(tmp_path / "x.npy")]) == 0
    assert "loaded 1 tensor(s)" in capsys.readouterr().out
    path.write_bytes(b"\x00" * 4)
    assert main(["--backend", "emulated", "load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cli.safetensors" in err and "Traceback" not in err


def test_the_load_command_reports_a_checkpoint_too_large_for_the_device_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry.__main__ import main
    from ferry._memory._device import DeviceMemory

    path = tmp_path / "big.safetensors"
    _by_hand(path, {"a": np.ones((256, 256), np.float32), "b": np.arange(10, dtype=np.int64)})
    real = DeviceMemory._alloc

    def alloc(self: DeviceMemory, nbytes: int) -> int:
        if nbytes == 256 * 256 * 4:
            raise MemoryError(f"out of memory: {nbytes} bytes asked, 1000 free")  # what a small device says
        return real(self, nbytes)

    monkeypatch.setattr(DeviceMemory, "_alloc", alloc)
    assert main(["--backend", "emulated", "load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "262144 bytes" in err and "Traceback" not in err


def test_the_load_command_names_itself_as_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry.__main__ import main

    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x00" * 4)
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/ferry"])
    assert main(["--backend", "emulated", "load", str(path)]) == 2
    assert capsys.readouterr().err.startswith("ferry load: error:")


def test_an_interrupted_load_propagates_and_frees_everything(py_emu: ferry.Runtime, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "i.safetensors"
    _by_hand(path, {f"w{i}": np.full(300_000, i, np.float32) for i in range(4)})
    monkeypatch.setattr(_file, "SLOT_BYTES", 256 << 10)
    real = _file.fill_slot

    def slow(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        __import__("time").sleep(0.03)
        real(opened, direct, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", slow)
    warm = py_emu.to_device(np.zeros(3, np.float32))
    before = py_emu.stats()

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ferry.load_safetensors(path, runtime=py_emu, progress=interrupt)
    after = py_emu.stats()
    assert after.device_bytes == before.device_bytes and after.abandoned == 0
    assert after.pinned_free_bytes == after.pinned_pool_bytes - after.staging_pinned_bytes
    del warm


def test_a_fifo_is_refused_without_blocking(emu: ferry.Runtime, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ferry.TransferSubmitError, match="not a regular file"):
        emu.upload_file(fifo, emu.empty(4, np.uint8))


def test_to_torch_views_each_carrier_as_torchs_dtype(emu: ferry.Runtime, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in torch module: what load_safetensors hands it and asks of it (the real one: GPU tests)."""
    import sys
    import types

    class Tensor:
        def __init__(self, array: Any, dtype: Any = None) -> None:
            self.array, self.dtype = array, dtype or f"carrier {array.dtype}"

        def view(self, dtype: Any) -> Tensor:
            return Tensor(self.array, dtype)

    fake = types.ModuleType("torch")
    fake.from_dlpack = Tensor  # type: ignore[attr-defined]
    for name in ("bfloat16", "float8_e4m3fn", "float16"):
        setattr(fake, name, f"torch.{name}")
    monkeypatch.setitem(sys.modules, "torch", fake)
    path = tmp_path / "t.safetensors"
    _write(path, {"bf": ("BF16", (3,), b"\x01\x02" * 3), "f8": ("F8_E4M3", (4,), b"\x07" * 4),
                  "h": ("F16", (2,), b"\x00\x3c" * 2), "f4": ("F4", (2, 2), b"\x12\x34")})
    loaded = ferry.load_safetensors(path, runtime=emu, to="torch")
    assert loaded["bf"].dtype == "torch.bfloat16" and loaded["bf"].array.dtype == np.int16
    assert loaded["f8"].dtype == "torch.float8_e4m3fn" and loaded["f8"].array.dtype == np.int8
    assert loaded["h"].dtype == "carrier float16"  # NumPy's own dtype: no view
    assert loaded["f4"].dtype == "carrier uint8" and loaded["f4"].array.shape == (2, 1)
    assert emu.to_host(loaded["bf"].array).tobytes() == b"\x01\x02" * 3
    delattr(fake, "float8_e4m3fn")
    with pytest.raises(ferry.CheckpointError, match=r"'f8'.*F8_E4M3.*torch lacks"):
        ferry.load_safetensors(path, runtime=emu, to="torch")
