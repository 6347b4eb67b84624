"""Files to the device and back: rt.upload_file / rt.download_file, and their contract."""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _native, testing
from ferry._routes import _file

PYTHON_ENGINE = ferry.StagingConfig(engine="python")
"""The pure-Python engine: the reader threads and their ``fill_slot``/``drain_slot`` seam (the compiled
engine's file jobs are tested in test_files_native.py)."""


@pytest.fixture
def py_emu() -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime("emulated", staging=PYTHON_ENGINE)
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


@pytest.fixture
def py_rt(backend_name: str) -> Iterator[ferry.Runtime]:
    runtime = ferry.Runtime(backend_name, staging=PYTHON_ENGINE)  # type: ignore[arg-type]
    try:
        yield runtime
        assert testing.violations(runtime) == []
    finally:
        runtime.close()



def _payload(nbytes: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, np.ndarray[Any, Any]]:
    data = _payload(3 * (1 << 20) + 4321)
    path = tmp_path / "data.bin"
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("direct", [None, False, True])
def test_upload_file_reads_the_bytes_at_the_offset(
    py_rt: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]], direct: bool | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, data = data_file
    monkeypatch.setattr(_file, "SLOT_BYTES", 256 << 10)  # several chunks, several readers
    used: list[bool] = []
    real = _file.fill_slot

    def watching(opened: Any, flag: list[bool], chunk: Any, ptr: int) -> None:
        used.append(flag[0] and opened.direct_fd >= 0)
        real(opened, flag, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", watching)
    offset = 4097  # not aligned: O_DIRECT reads the aligned span around it
    dest = py_rt.empty(data.size - offset - 11, np.uint8)
    handle = py_rt.upload_file(path, dest, offset=offset, direct=direct)
    assert dest.state == "in_flight"
    file, back = handle.wait()
    assert file == path and back is dest and dest.state == "owned"
    assert np.array_equal(py_rt.to_host(dest), data[offset:offset + dest.nbytes])
    assert len(used) > 5
    probe = _file.OpenFile(path, write=False)
    takes_direct = probe.open_direct(write=False)
    probe.close()
    if direct is True and takes_direct:
        assert any(used)  # this filesystem takes O_DIRECT: the reads used it
    if not direct:
        assert not any(used)


def test_upload_file_takes_an_open_file_and_survives_its_closing(
    rt: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]]
) -> None:
    path, data = data_file
    dest = rt.empty((data.size // 4,), np.float32)
    with open(path, "rb") as f:
        handle = rt.upload_file(f, dest)
    handle.wait()  # the transfer reads through its own descriptor
    assert np.array_equal(rt.to_host(dest).view(np.uint8), data[: dest.nbytes])


def test_many_chunks_and_readers_cover_the_file_once(
    py_emu: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    monkeypatch.setattr(_file, "SLOT_BYTES", 64 << 10)
    reads: list[tuple[int, int]] = []
    threads: set[str] = set()
    real = _file.fill_slot

    def counting(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        reads.append((chunk.start, chunk.need))
        threads.add(threading.current_thread().name)
        time.sleep(0.002)  # a slow disk: the other readers claim chunks meanwhile
        real(opened, direct, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", counting)
    dest = py_emu.empty(data.size, np.uint8)
    handle = py_emu.upload_file(str(path), dest)
    handle.wait()
    assert np.array_equal(py_emu.to_host(dest), data)
    assert len(reads) > 40 and len(threads) >= 2
    starts = sorted(reads)
    covered = sum(n for _, n in starts)
    assert covered == data.size  # every byte read once
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(starts))


def test_plan_coalesces_neighbours_and_aligns_chunks() -> None:
    pieces = [_file.Piece(100, 10, 1000, "a"), _file.Piece(110, 5000, 2000, "b"), _file.Piece(10 << 20, 8, 3000, "c")]
    plan = _file.plan_pieces(pieces, 1 << 20)
    assert plan.nbytes == 5018
    first, second = plan.chunks
    assert first.start == 0 and first.length % _file.ALIGN == 0 and first.need == 5110
    assert first.dmas == [(100, 1000, 10, "a"), (110, 2000, 5000, "b")]
    assert second.start == (10 << 20) and second.dmas == [(0, 3000, 8, "c")]
    with pytest.raises(ValueError, match="overlap"):
        _file.plan_pieces([_file.Piece(0, 10, 0, "x"), _file.Piece(5, 10, 0, "y")])


def test_download_file_writes_at_the_offset_and_keeps_the_rest(rt: ferry.Runtime, tmp_path: Path) -> None:
    data = _payload(2 * (1 << 20) + 77, seed=1)
    source = rt.to_device(data)
    path = tmp_path / "out.bin"
    path.write_bytes(b"x" * 10)
    handle = rt.download_file(source, path, offset=5)
    assert source.state == "read_leased"
    back, file = handle.wait()
    assert back is source and file == path and source.state == "owned"
    raw = path.read_bytes()
    assert raw[:5] == b"xxxxx" and len(raw) == 5 + data.size
    assert np.array_equal(np.frombuffer(raw[5:], np.uint8), data)


def test_download_file_direct_round_trips(emu: ferry.Runtime, tmp_path: Path) -> None:
    data = _payload((1 << 20) + 4096 * 3 + 5, seed=2)
    source = emu.to_device(data)
    path = tmp_path / "direct.bin"
    emu.download_file(source, path, direct=True).wait()
    assert np.array_equal(np.fromfile(path, np.uint8), data)


def test_refused_submissions_change_nothing(emu: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]],
                                            tmp_path: Path) -> None:
    path, data = data_file
    dest = emu.empty(data.size + 1, np.uint8)
    before = emu.stats()
    with pytest.raises(ferry.TransferSubmitError, match=r"holds \d+ bytes"):
        emu.upload_file(path, dest)
    with pytest.raises(ferry.TransferSubmitError, match="cannot open"):
        emu.upload_file(tmp_path / "missing.bin", dest)
    with pytest.raises(ferry.TransferSubmitError, match="offset"):
        emu.upload_file(path, dest, offset=-1)
    with pytest.raises(ferry.TransferSubmitError, match="direct"):
        emu.upload_file(path, dest, direct="yes")  # type: ignore[arg-type]
    with pytest.raises(ferry.TransferSubmitError, match="DeviceArray"):
        emu.upload_file(path, np.zeros(4, np.uint8))  # type: ignore[arg-type]
    with pytest.raises(ferry.TransferSubmitError, match="not a regular file"):
        emu.upload_file(tmp_path, dest)
    with open(path, "ab") as f, pytest.raises(ferry.TransferSubmitError, match="not open for reading"):
        emu.upload_file(f, dest)
    assert dest.state == "owned"
    small = emu.empty(16, np.uint8)
    pending = emu.upload_file(path, small)
    with pytest.raises(ferry.TransferSubmitError, match="in_flight"):
        emu.upload_file(path, small)
    pending.wait()
    after = emu.stats()
    assert after.failed == before.failed and after.abandoned == 0
    assert np.array_equal(emu.to_host(small), data[:16])


def test_a_file_truncated_during_the_transfer_fails_it_naming_file_and_offset(
    py_emu: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    real = _file.fill_slot
    calls = []

    def truncating(opened: Any, direct: list[bool], chunk: Any, ptr: int) -> None:
        calls.append(chunk.start)
        if len(calls) == 1:
            os.truncate(path, 1 << 20)
        real(opened, direct, chunk, ptr)

    monkeypatch.setattr(_file, "fill_slot", truncating)
    monkeypatch.setattr(_file, "SLOT_BYTES", 256 << 10)
    dest = py_emu.empty(data.size, np.uint8)
    handle = py_emu.upload_file(path, dest)
    with pytest.raises(ferry.TransferFailedError, match=r"data\.bin.* at byte \d+.*ended"):
        handle.wait()
    assert dest.state == "abandoned"
    stats = py_emu.stats()
    assert stats.failed == 1
    assert stats.abandoned_bytes == dest.nbytes  # the slots were proven idle: back to the pool
    assert stats.pinned_free_bytes == stats.pinned_pool_bytes - stats.staging_pinned_bytes


def test_a_failed_dma_abandons_the_readers_slots(emu: ferry.Runtime,
                                                 data_file: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, data = data_file
    dest = emu.empty(data.size, np.uint8)
    testing.fail_next_copy(emu)
    handle = emu.upload_file(path, dest)
    with pytest.raises(ferry.TransferFailedError):
        handle.wait()
    assert dest.state == "abandoned"
    assert emu.stats().abandoned_bytes > dest.nbytes  # the destination and at least one slot
    # the runtime stays usable
    again = emu.empty(100, np.uint8)
    emu.upload_file(path, again).wait()
    assert np.array_equal(emu.to_host(again), data[:100])


def test_a_dropped_handle_retires_and_nothing_leaks(emu: ferry.Runtime,
                                                    data_file: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, data = data_file
    for _ in range(3):
        emu.upload_file(path, emu.empty(data.size, np.uint8))
    gc.collect()
    emu.close()
    stats = emu.stats()
    assert stats.in_flight == 0 and stats.retiring == 0 and stats.failed == 0


def test_direct_none_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                             data_file: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, _ = data_file
    opened = _file.OpenFile(path, write=False)
    try:
        monkeypatch.setenv("FERRY_FILE_DIRECT", "1")
        assert _file.choose_direct(opened, None, (0, 10)) is True
        monkeypatch.setenv("FERRY_FILE_DIRECT", "0")
        assert _file.choose_direct(opened, None, (0, 1 << 40)) is False
        assert _file.choose_direct(opened, True, (0, 10)) is True
        monkeypatch.delenv("FERRY_FILE_DIRECT")
        assert _file.choose_direct(opened, None, (0, 10)) is False  # small: the page cache
        fraction = _file.resident_fraction(opened.fd, 0, opened.size)
        assert fraction is None or 0.0 <= fraction <= 1.0
    finally:
        opened.close()


def test_a_refused_o_direct_falls_back_to_buffered_reads(
    emu: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    monkeypatch.setattr(_file.OpenFile, "open_direct", lambda self, *, write: False)
    dest = emu.empty(data.size, np.uint8)
    emu.upload_file(path, dest, direct=True).wait()
    assert np.array_equal(emu.to_host(dest), data)


def test_a_refused_download_creates_no_file(py_emu: ferry.Runtime, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    source = py_emu.empty(16, np.uint8)
    pending = py_emu.upload(np.zeros(16, np.uint8), source)
    target = tmp_path / "new.bin"
    with pytest.raises(ferry.TransferSubmitError, match="in_flight"):
        py_emu.download_file(source, target)
    pending.wait()
    assert not target.exists()

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise MemoryError("no pinned memory left")

    monkeypatch.setattr(_file.FileJob, "__init__", refuse)
    with pytest.raises(ferry.TransferSubmitError, match="no pinned memory"):
        py_emu.download_file(source, target)
    assert not target.exists() and source.state == "owned"


def test_resident_fraction_samples_a_bounded_number_of_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The residency check asks ``mincore`` about at most RESIDENT_WINDOWS windows, whatever the file's size
    (a whole-file ``mincore`` cost a fifth of a warm load), and its answer is the sampled pages' fraction."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB, 262,144 pages
    real = _file._libc()
    if real is None:
        pytest.skip("no libc to ask mincore")
    asked: list[int] = []
    half = [0]

    class Counting:
        mmap = real.mmap
        munmap = real.munmap

        @staticmethod
        def mincore(addr: int, length: int, vec: Any) -> int:
            asked.append(length)
            pages = length // 4096
            every = 2 if half[0] else pages + 1
            ctypes.memmove(vec, bytes(1 if i % every == 0 else 0 for i in range(pages)), pages)
            return 0

    monkeypatch.setattr(_file, "_LIBC", Counting)
    fd = os.open(path, os.O_RDONLY)
    try:
        fraction = _file.resident_fraction(fd, 0, 1 << 30)
        assert len(asked) == _file.RESIDENT_WINDOWS
        assert sum(asked) <= _file.RESIDENT_WINDOWS * _file.RESIDENT_WINDOW_BYTES
        assert fraction is not None and 0.0 < fraction < 0.02  # one page of each window
        half[0] = 1
        assert _file.resident_fraction(fd, 0, 1 << 30) == pytest.approx(0.5, abs=0.01)
        asked.clear()
        assert _file.resident_fraction(fd, 4096, 3 * 4096) is not None and len(asked) == 1  # small: all of it
        assert asked == [2 * 4096]
    finally:
        os.close(fd)


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ferry-file-")]


def test_readers_are_made_once_per_runtime_and_stop_with_it(data_file: tuple[Path, np.ndarray[Any, Any]]) -> None:
    """The reader threads, their streams and events are the runtime's: made by the first file transfer,
    reused by every later one, stopped (and destroyed) by close()."""
    from ferry._runtime import parts_of

    path, data = data_file
    before = set(_reader_threads())
    runtime = ferry.Runtime("emulated", staging=PYTHON_ENGINE)
    try:
        readers = parts_of(runtime).readers
        assert readers.made == 0  # nothing until a file is read
        dest = runtime.empty(data.size, np.uint8)
        runtime.upload_file(path, dest).wait()
        made = readers.made
        assert made >= 1 and len(set(_reader_threads()) - before) == made
        for _ in range(3):
            runtime.upload_file(path, dest).wait()
            assert np.array_equal(runtime.to_host(dest), data)
        out = runtime.empty(data.size, np.uint8)
        runtime.download_file(dest, path.with_suffix(".out")).wait()
        runtime.upload_file(path.with_suffix(".out"), out).wait()
        assert np.array_equal(runtime.to_host(out), data)
        assert readers.made == made
    finally:
        runtime.close()
    assert set(_reader_threads()) - before == set()
    with pytest.raises(ferry.FerryError):
        runtime.upload_file(path, dest)


def test_a_reader_whose_dma_failed_is_never_reused(py_emu: ferry.Runtime,
                                                   data_file: tuple[Path, np.ndarray[Any, Any]]) -> None:
    from ferry._runtime import parts_of

    path, data = data_file
    readers = parts_of(py_emu).readers
    py_emu.upload_file(path, py_emu.empty(data.size, np.uint8)).wait()
    testing.fail_next_copy(py_emu)
    with pytest.raises(ferry.TransferFailedError):
        py_emu.upload_file(path, py_emu.empty(data.size, np.uint8)).wait()
    broken = [r for r in readers._readers if r.broken]
    assert len(broken) == 1
    again = py_emu.empty(data.size, np.uint8)
    py_emu.upload_file(path, again).wait()
    assert np.array_equal(py_emu.to_host(again), data)
    now = readers.take(readers.made)
    assert all(not r.broken for r in now) and broken[0] not in now  # its stream is never used again


def test_loads_from_many_threads_at_once_share_the_readers(emu: ferry.Runtime, tmp_path: Path) -> None:
    files = []
    for i in range(4):
        data = _payload((1 << 20) + 977 * i, seed=i)
        p = tmp_path / f"d{i}.bin"
        data.tofile(p)
        files.append((p, data))
    results: dict[int, bool] = {}

    def load(i: int) -> None:
        p, data = files[i]
        for _ in range(3):
            dest = emu.empty(data.size, np.uint8)
            emu.upload_file(p, dest).wait()
            results[i] = results.get(i, True) and bool(np.array_equal(emu.to_host(dest), data))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: True, 1: True, 2: True, 3: True}


def test_upload_file_fills_a_foreign_cuda_array_and_download_file_reads_one(
    emu: ferry.Runtime, data_file: tuple[Path, np.ndarray[Any, Any]], tmp_path: Path
) -> None:
    """A destination (or source) of another library, through its CUDA Array Interface: ordered after its
    producer stream, handed back as the same object."""
    path, data = data_file
    backing = emu.empty(data.size, np.uint8)
    stream = testing.side_stream(emu)
    foreign = testing.ForeignArray(backing, stream=stream)
    got_file, got = emu.upload_file(path, foreign).wait()
    assert got is foreign and got_file == path
    assert np.array_equal(emu.to_host(backing), data)
    out = tmp_path / "out.bin"
    view = testing.ForeignArray(backing, stream=stream)
    source, written = emu.download_file(view, out).wait()
    assert source is view and written == out and np.array_equal(np.fromfile(out, np.uint8), data)
    short = testing.ForeignArray(emu.empty(data.size + 1, np.uint8), stream=stream)
    with pytest.raises(ferry.TransferSubmitError, match="holds"):
        emu.upload_file(path, short)  # refused: the file is one byte too short
    with pytest.raises(ferry.TransferSubmitError):
        emu.upload_file(path, np.zeros(4, np.uint8))  # host memory is not a device destination


@pytest.mark.cuda
def test_upload_file_into_a_torch_tensor(torch: Any, data_file: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, data = data_file
    with ferry.Runtime("cuda") as rt:
        tensor = torch.zeros(data.size, dtype=torch.uint8, device="cuda")
        torch.cuda.current_stream().synchronize()
        tensor.fill_(7)  # pending on PyTorch's stream: the file's bytes must land after it
        _, got = rt.upload_file(path, tensor).wait()
        assert got is tensor
        assert np.array_equal(tensor.cpu().numpy(), data)
        back = torch.empty(data.size, dtype=torch.uint8, device="cuda")
        out = path.with_suffix(".out")
        rt.download_file(tensor, out).wait()
        rt.upload_file(out, back).wait()
        assert torch.equal(back, tensor)


def test_zero_byte_file_transfers_close_their_files(emu: ferry.Runtime, tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    np.arange(16, dtype=np.float32).tofile(path)
    empty = emu.empty((0,), np.float32)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        emu.upload_file(path, empty).wait()
        emu.download_file(empty, tmp_path / "out.bin").wait()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


def test_readers_broken_by_failed_copies_stop_their_threads(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    np.arange(1 << 18, dtype=np.float32).tofile(path)
    before = {t.ident for t in threading.enumerate()}
    rt = ferry.Runtime(backend="emulated", staging=PYTHON_ENGINE)
    for _ in range(3):
        device = rt.empty((1 << 18,), np.float32)
        testing.fail_next_copy(rt)
        with pytest.raises(ferry.TransferFailedError):
            rt.upload_file(path, device).wait()
    rt.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            t.ident not in before and t.name.startswith("ferry-file") for t in threading.enumerate()):
        time.sleep(0.01)
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("ferry-file")] == []


@pytest.mark.parametrize("engine", ["python", "native"])
def test_an_offset_past_the_largest_file_offset_is_refused_and_changes_nothing(tmp_path: Path, engine: str) -> None:
    if engine == "native" and _native.load() is None:
        pytest.skip("the compiled engine does not run here")
    runtime = ferry.Runtime("emulated", staging=ferry.StagingConfig(engine=engine))  # type: ignore[arg-type]
    try:
        source = runtime.to_device(np.arange(100, dtype=np.uint8))
        before = runtime.stats()
        for offset in (2**63 - 50, 2**63, 2**64 + 5):
            with pytest.raises(ferry.TransferSubmitError, match="largest file offset"):
                runtime.download_file(source, tmp_path / "x.bin", offset=offset)
            with pytest.raises(ferry.TransferSubmitError):
                runtime.upload_file(tmp_path / "x.bin", source, offset=offset)
        assert os.listdir(tmp_path) == [] and source.state == "owned"
        after = runtime.stats()
        assert after.failed == before.failed and after.abandoned_bytes == 0
        runtime.download_file(source, tmp_path / "x.bin", offset=(1 << 33) + 1).wait()  # far, but a file offset
        assert source.state == "owned" and (tmp_path / "x.bin").stat().st_size == (1 << 33) + 101
    finally:
        runtime.close()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_file_open_for_appending_is_refused_for_a_download(tmp_path: Path, engine: str) -> None:
    # pwrite on an O_APPEND descriptor appends on Linux, whatever the offset: the bytes would land elsewhere.
    if engine == "native" and _native.load() is None:
        pytest.skip("the compiled engine does not run here")
    runtime = ferry.Runtime("emulated", staging=ferry.StagingConfig(engine=engine))  # type: ignore[arg-type]
    try:
        path = tmp_path / "f.bin"
        path.write_bytes(b"x" * 100)
        source = runtime.to_device(np.full(10, 7, np.uint8))
        with open(path, "ab") as f, pytest.raises(ferry.TransferSubmitError, match="appending"):
            runtime.download_file(source, f, offset=0)
        assert path.read_bytes() == b"x" * 100 and source.state == "owned"
        with open(path, "r+b") as f:
            runtime.download_file(source, f, offset=3).wait()
        assert path.read_bytes() == b"xxx" + bytes([7] * 10) + b"x" * 87
        with open(path, "a+b") as f:  # reading from it is fine
            dest = runtime.empty(13, np.uint8)
            runtime.upload_file(f, dest).wait()
        assert runtime.to_host(dest).tobytes() == b"xxx" + bytes([7] * 10)
    finally:
        runtime.close()
