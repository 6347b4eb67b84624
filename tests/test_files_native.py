"""The file route on the compiled engine: file jobs on the staging lanes (``_native/core/file.c``).

The lanes ``pread`` each chunk straight into a pinned slot of theirs and enqueue its DMAs (a download:
DMAs, then ``pwrite``). These tests run on the emulated device, whose native stand-in runs the same
lanes, and on a GPU where there is one. The pure-Python engine's reader threads are tested in
test_files.py and test_files_formats.py.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import eventually
from ferry import _native, testing
from ferry._routes import _file
from ferry._runtime import parts_of

pytestmark = pytest.mark.skipif(_native.load() is None, reason="the compiled engine does not run here")

LANES, SLOTS, SLOT = 3, 2, 64 << 10
SMALL = ferry.StagingConfig(engine="native", lanes=LANES, slots_per_lane=SLOTS, slot_bytes=SLOT)
"""Small slots: a file of a few hundred KiB is many chunks over every lane."""


def _open(backend: str, **options: Any) -> ferry.Runtime:
    return ferry.Runtime(backend, staging=SMALL, **options)  # type: ignore[arg-type]


@pytest.fixture
def nrt(backend_name: str) -> Iterator[ferry.Runtime]:
    runtime = _open(backend_name)
    try:
        yield runtime
        assert testing.violations(runtime) == []
    finally:
        runtime.close()


@pytest.fixture
def nemu() -> Iterator[ferry.Runtime]:
    runtime = _open("emulated")
    try:
        yield runtime
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[_file.NativeFileJob]:
    """Every native file job started (the Python reader threads must not be)."""
    started: list[_file.NativeFileJob] = []
    real = _file.NativeFileJob.start

    def spy(self: _file.NativeFileJob) -> None:
        started.append(self)
        real(self)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the reader threads ran a transfer the compiled lanes should have")

    monkeypatch.setattr(_file.NativeFileJob, "start", spy)
    monkeypatch.setattr(_file.FileJob, "start", refuse)
    return started


def _payload(nbytes: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _file_of(tmp_path: Path, nbytes: int, name: str = "data.bin") -> tuple[Path, np.ndarray[Any, Any]]:
    data = _payload(nbytes)
    path = tmp_path / name
    data.tofile(path)
    return path, data


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _takes_o_direct(path: Path) -> bool:
    probe = _file.OpenFile(path, write=False)
    try:
        return probe.open_direct(write=False)
    finally:
        probe.close()


def _staging(runtime: ferry.Runtime) -> Any:
    return parts_of(runtime).staged.engines["upload"].engine


@pytest.mark.parametrize("direct", [None, False, True])
@pytest.mark.parametrize(("offset", "size"), [(0, 1), (1, 4095), (4095, 65537), (4097, 300_001), (65539, 400_000)])
def test_upload_file_round_trips_at_odd_sizes_and_offsets(
    nrt: ferry.Runtime, tmp_path: Path, jobs: list[Any], direct: bool | None, offset: int, size: int
) -> None:
    path, data = _file_of(tmp_path, 470_001)
    before = _open_fds()
    dest = nrt.empty(size, np.uint8)
    handle = nrt.upload_file(path, dest, offset=offset, direct=direct)
    file, back = handle.wait()
    assert file == path and back is dest and dest.state == "owned"
    assert np.array_equal(nrt.to_host(dest), data[offset:offset + size])
    assert len(jobs) == 1 and jobs[0].moved_bytes == size
    assert len(jobs[0].plan.chunks) == -(-(offset % 4096 + size) // SLOT)  # whole slots from an aligned start
    assert parts_of(nrt).readers.made == 0  # no reader thread: the lanes read
    assert _open_fds() == before


@pytest.mark.parametrize("direct", [False, True])
def test_download_file_round_trips_at_odd_offsets_and_keeps_the_rest(
    nrt: ferry.Runtime, tmp_path: Path, jobs: list[Any], direct: bool
) -> None:
    path, old = _file_of(tmp_path, 700_000)
    data = _payload(333_333, seed=4)
    source = nrt.to_device(data)
    for offset in (0, 5, 4096, 123_457):
        back, file = nrt.download_file(source, path, offset=offset, direct=direct).wait()
        assert back is source and file == path and source.state == "owned"
        got = np.fromfile(path, np.uint8)
        old[offset:offset + data.size] = data
        assert np.array_equal(got, old)
    assert len(jobs) == 4 and all(j.moved_bytes == data.size for j in jobs)
    fresh = tmp_path / "new.bin"
    nrt.download_file(source, fresh, offset=3).wait()
    assert np.array_equal(np.fromfile(fresh, np.uint8)[3:], data)


@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_a_refused_o_direct_falls_back_to_buffered_reads(
    nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any], monkeypatch: pytest.MonkeyPatch, refused_at: str
) -> None:
    path, data = _file_of(tmp_path, 600_000)
    if refused_at == "open":
        monkeypatch.setattr(_file.OpenFile, "open_direct", lambda self, *, write: False)
    else:
        if not _takes_o_direct(path):
            pytest.skip("this filesystem refuses O_DIRECT at open: no direct read to refuse")
        monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", (2, errno.EINVAL))  # what a refusing filesystem says
    dest = nemu.empty(data.size - 4097, np.uint8)
    nemu.upload_file(path, dest, offset=4097, direct=True).wait()
    assert np.array_equal(nemu.to_host(dest), data[4097:])
    assert not jobs[0]._inner.file_direct  # the rest of the job read through the page cache
    assert nemu.stats().abandoned_bytes == 0


def test_o_direct_reads_where_the_filesystem_allows_them(nemu: ferry.Runtime, tmp_path: Path,
                                                         jobs: list[Any]) -> None:
    path, data = _file_of(tmp_path, 1_000_003)
    if not _takes_o_direct(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    dest = nemu.empty(data.size - 10, np.uint8)
    nemu.upload_file(path, dest, offset=10, direct=True).wait()
    assert np.array_equal(nemu.to_host(dest), data[10:])
    assert jobs[0]._inner.file_direct  # every read went through O_DIRECT, the tail's short one included


def test_a_file_truncated_during_a_load_fails_it_and_publishes_nothing(
    nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any]
) -> None:
    path, data = _file_of(tmp_path, 16 * SLOT)
    dest = nemu.empty(data.size, np.uint8)
    engine_before = None
    with testing.hold(nemu, "upload"):  # the lanes read into their slots, then wait for their DMAs
        handle = nemu.upload_file(path, dest)
        assert eventually(lambda: len(jobs) == 1 and jobs[0].moved_bytes > 0)
        engine_before = _staging(nemu).held_bytes
        os.truncate(path, 8 * SLOT)  # past every chunk the held lanes could have read
    with pytest.raises(ferry.TransferFailedError, match=r"data\.bin' at byte \d+: the file ended there"):
        handle.wait()
    assert isinstance(jobs[0].error, _file.FileReadError)
    assert dest.state == "abandoned"
    stats = nemu.stats()
    assert stats.failed == 1
    # the destination, and the failing lane's slots (abandoned as after a failed DMA; fresh ones taken)
    assert stats.abandoned_bytes >= dest.nbytes + SLOTS * SLOT
    assert _staging(nemu).held_bytes == engine_before == LANES * SLOTS * SLOT
    again = nemu.empty(1000, np.uint8)
    nemu.upload_file(path, again).wait()
    assert np.array_equal(nemu.to_host(again), data[:1000])


def test_a_read_error_mid_way_fails_the_transfer_and_abandons_the_lanes_slots(
    nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = _file_of(tmp_path, 12 * SLOT)
    monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", (5, errno.EIO))
    dest = nemu.empty(data.size, np.uint8)
    handle = nemu.upload_file(path, dest)
    with pytest.raises(ferry.TransferFailedError,
                       match=rf"data\.bin' at byte {5 * SLOT}: the read failed: .*\(errno {errno.EIO}\)"):
        handle.wait()
    assert isinstance(jobs[0].error, _file.FileReadError)
    assert dest.state == "abandoned"
    assert nemu.stats().abandoned_bytes == dest.nbytes + SLOTS * SLOT
    assert _staging(nemu).abandoned_bytes == SLOTS * SLOT
    assert _staging(nemu).held_bytes == LANES * SLOTS * SLOT  # the lane took fresh slots
    monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", None)
    again = nemu.empty(data.size, np.uint8)
    nemu.upload_file(path, again).wait()
    assert np.array_equal(nemu.to_host(again), data)


def test_a_failed_dma_fails_the_transfer_as_a_device_error(nemu: ferry.Runtime, tmp_path: Path,
                                                           jobs: list[Any]) -> None:
    path, data = _file_of(tmp_path, 10 * SLOT)
    dest = nemu.empty(data.size, np.uint8)
    testing.fail_next_copy(nemu, after=3)
    with pytest.raises(ferry.TransferFailedError, match="injected"):
        nemu.upload_file(path, dest).wait()
    assert not isinstance(jobs[0].error, _file.FileReadError)
    assert dest.state == "abandoned" and nemu.stats().abandoned_bytes >= dest.nbytes + SLOTS * SLOT


def test_a_write_error_fails_a_save_and_removes_its_file(nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    source = nemu.to_device(np.arange(100_000, dtype=np.float32))
    monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", (1, errno.ENOSPC))
    path = tmp_path / "w.safetensors"
    with pytest.raises(ferry.CheckpointError, match=r"w\.safetensors.*write failed: No space left.*errno 28"):
        ferry.save_safetensors({"w": source}, path, runtime=nemu)
    assert os.listdir(tmp_path) == [] and source.state == "owned"
    monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", None)
    ferry.save_safetensors({"w": source}, path, runtime=nemu)
    loaded = ferry.load_safetensors(path, runtime=nemu)
    assert np.array_equal(nemu.to_host(loaded["w"]), np.arange(100_000, dtype=np.float32))


def test_refused_submissions_change_nothing(nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any]) -> None:
    path, data = _file_of(tmp_path, 300_000)
    dest = nemu.empty(data.size + 1, np.uint8)
    before, fds = nemu.stats(), _open_fds()
    with pytest.raises(ferry.TransferSubmitError, match=r"holds \d+ bytes"):
        nemu.upload_file(path, dest)
    with pytest.raises(ferry.TransferSubmitError, match="cannot open"):
        nemu.upload_file(tmp_path / "missing.bin", dest)
    with pytest.raises(ferry.TransferSubmitError, match="offset"):
        nemu.upload_file(path, dest, offset=-1)
    busy = nemu.empty(1000, np.uint8)
    pending = nemu.upload_file(path, busy)
    with pytest.raises(ferry.TransferSubmitError, match="in_flight"):
        nemu.upload_file(path, busy)
    with pytest.raises(ferry.TransferSubmitError, match="in_flight"):
        nemu.download_file(busy, tmp_path / "out.bin")
    pending.wait()
    assert not (tmp_path / "out.bin").exists()
    after = nemu.stats()
    assert dest.state == "owned" and after.failed == before.failed and after.abandoned_bytes == 0
    assert _open_fds() == fds and len(jobs) == 1
    assert np.array_equal(nemu.to_host(busy), data[:1000])


def test_close_while_reads_are_in_flight_waits_for_them(tmp_path: Path, jobs: list[Any]) -> None:
    path, data = _file_of(tmp_path, 64 * SLOT)
    fds = _open_fds()
    runtime = _open("emulated", emulated_bandwidth=2e7)  # 4 MiB: ~200 ms on the emulated link
    dests = [runtime.empty(data.size, np.uint8) for _ in range(3)]
    kept = runtime.upload_file(path, dests[0])
    runtime.upload_file(path, dests[1])  # dropped: retired
    runtime.download_file(runtime.to_device(data[:100_000]), tmp_path / "out.bin")
    assert not all(j.is_done() for j in jobs)  # still reading
    runtime.close()
    assert all(j.is_done() and j.error is None for j in jobs)
    assert testing.violations(runtime) == []
    assert _open_fds() == fds  # every descriptor closed
    assert np.array_equal(np.fromfile(tmp_path / "out.bin", np.uint8), data[:100_000])
    with pytest.raises(ferry.FerryError):
        kept.wait()


def _safetensors(path: Path, tensors: dict[str, np.ndarray[Any, Any]]) -> None:
    import json
    import struct

    names = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8", np.dtype(np.int64): "I64"}
    header: dict[str, Any] = {}
    at = 0
    for name, value in tensors.items():
        header[name] = {"dtype": names[value.dtype], "shape": list(value.shape),
                        "data_offsets": [at, at + value.nbytes]}
        at += value.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(v.tobytes() for v in tensors.values()))


def _tensors(count: int = 40) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(3)
    out: dict[str, np.ndarray[Any, Any]] = {}
    for i in range(count):
        n = [1, 3, 1000, 17_000, 70_001][i % 5]
        dtype = [np.float32, np.uint8, np.int64][i % 3]
        out[f"layer.{i}"] = rng.integers(0, 100, size=n).astype(dtype)
    return out


def test_load_safetensors_reads_the_file_once_in_large_sequential_reads(
    nrt: ferry.Runtime, tmp_path: Path, jobs: list[Any]
) -> None:
    tensors = _tensors()
    path = tmp_path / "m.safetensors"
    _safetensors(path, tensors)
    seen: list[tuple[int, int]] = []
    loaded = ferry.load_safetensors(path, runtime=nrt, progress=lambda done, total: seen.append((done, total)))
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert np.array_equal(nrt.to_host(loaded[name]), value), name
    assert len(jobs) == 1  # one job for the file
    plan = jobs[0].plan
    payload = sum(v.nbytes for v in tensors.values())
    assert jobs[0].moved_bytes == plan.nbytes == payload
    starts = [c.start for c in plan.chunks]
    assert starts == sorted(starts)
    for a, b in itertools.pairwise(plan.chunks):
        assert a.start + a.need <= b.start  # never a byte read twice
    assert len(plan.chunks) == -(-(plan.span[1] - plan.span[0] // 4096 * 4096) // SLOT)  # whole slots
    assert max(len(c.dmas) for c in plan.chunks) > 1  # small tensors share one read
    assert seen[-1] == (payload, payload)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))  # progress only grows


def test_a_load_whose_read_fails_frees_every_tensor(nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    _safetensors(path, _tensors())
    warm = nemu.to_device(np.zeros(3, np.float32))
    nemu.to_host(warm)
    before = nemu.stats()
    monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", (2, errno.EIO))
    with pytest.raises(ferry.CheckpointError, match=r"m\.safetensors' at byte \d+ \(tensor 'layer\.\d+'\)"):
        ferry.load_safetensors(path, runtime=nemu)
    after = nemu.stats()
    assert after.device_bytes == before.device_bytes and after.abandoned == 0
    assert after.abandoned_bytes == SLOTS * SLOT  # only the failing lane's slots


def test_a_load_cut_short_during_the_read_is_refused_and_frees_everything(
    nemu: ferry.Runtime, tmp_path: Path, jobs: list[Any]
) -> None:
    path = tmp_path / "m.safetensors"
    _safetensors(path, {f"w{i}": np.full(100_000, i, np.float32) for i in range(8)})
    before = nemu.stats()
    failure: list[BaseException] = []

    def load() -> None:
        try:
            ferry.load_safetensors(path, runtime=nemu)
        except BaseException as exc:
            failure.append(exc)

    with testing.hold(nemu, "upload"):
        thread = threading.Thread(target=load)
        thread.start()
        assert eventually(lambda: len(jobs) == 1 and jobs[0].moved_bytes > 0)
        os.truncate(path, path.stat().st_size // 2)
    thread.join(30)
    assert len(failure) == 1 and isinstance(failure[0], ferry.CheckpointError)
    assert "m.safetensors" in str(failure[0]) and ("ended" in str(failure[0]) or "changed size" in str(failure[0]))
    assert nemu.stats().device_bytes == before.device_bytes


def test_an_interrupted_load_cancels_its_job_and_frees_everything(tmp_path: Path, jobs: list[Any]) -> None:
    path = tmp_path / "i.safetensors"
    _safetensors(path, {f"w{i}": np.full(300_000, i, np.float32) for i in range(4)})
    runtime = _open("emulated", emulated_bandwidth=2e7)  # 4.8 MB: ~240 ms on the emulated link
    try:
        before = runtime.stats()

        def interrupt(done: int, total: int) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            ferry.load_safetensors(path, runtime=runtime, progress=interrupt)
        assert isinstance(jobs[0].error, _file.FileReadError) and "cancelled" in str(jobs[0].error)
        after = runtime.stats()
        assert after.device_bytes == before.device_bytes and after.abandoned == 0 and after.abandoned_bytes == 0
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


def test_the_engine_refuses_a_file_plan_that_does_not_add_up(tmp_path: Path) -> None:
    path, _ = _file_of(tmp_path, 10_000)
    engine = _native.load().Engine("upload", lanes=2, slots_per_lane=2, slot_bytes=SLOT)  # type: ignore[union-attr]
    dest = np.zeros(10_000, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        def submit(chunks: list[tuple[int, ...]], dmas: list[tuple[int, ...]]) -> Any:
            return engine.submit_file(fd, -1, np.array(chunks, np.uint64).tobytes(),
                                      np.array(dmas, np.uint64).reshape(-1, 3).tobytes())

        ptr = dest.ctypes.data
        with pytest.raises(ValueError, match="slot_bytes"):
            submit([(0, SLOT + 4096, 100, 1)], [(0, ptr, 100)])  # larger than a slot
        with pytest.raises(ValueError, match="DMA"):
            submit([(0, 4096, 100, 1)], [(50, ptr, 100)])  # past the bytes the read brings
        with pytest.raises(ValueError, match="more DMAs"):
            submit([(0, 4096, 100, 2)], [(0, ptr, 100)])
        with pytest.raises(ValueError, match="packed"):
            engine.submit_file(fd, -1, b"\0" * 31, b"")
        job = submit([(0, 12288, 10_000, 1)], [(0, ptr, 10_000)])
        assert job.wait(10) and job.error is None and job.file_moved == 10_000
        assert np.array_equal(dest, np.fromfile(path, np.uint8))
        with pytest.raises(TypeError, match="not a file job"):
            _ = engine.submit(ptr, ptr, 8, (8,), (1,), 1).file_moved
    finally:
        os.close(fd)
        engine.close()


def test_the_engine_refuses_a_download_plan_that_would_write_stale_slot_bytes(tmp_path: Path) -> None:
    path, _ = _file_of(tmp_path, 10_000)
    engine = _native.load().Engine("download", lanes=2, slots_per_lane=2, slot_bytes=SLOT)  # type: ignore[union-attr]
    src = _payload(8192, seed=9)
    fd = os.open(path, os.O_RDWR)
    try:
        def submit(chunks: list[tuple[int, ...]], dmas: list[tuple[int, ...]]) -> Any:
            return engine.submit_file(fd, -1, np.array(chunks, np.uint64).tobytes(),
                                      np.array(dmas, np.uint64).reshape(-1, 3).tobytes())

        ptr = src.ctypes.data
        with pytest.raises(ValueError, match="fill its chunk"):
            submit([(0, 4096, 4096, 1)], [(0, ptr, 100)])  # 3996 bytes of the slot would be written as they are
        with pytest.raises(ValueError, match="fill its chunk"):
            submit([(0, 8192, 8192, 2)], [(0, ptr, 4096), (4100, ptr + 4100, 4092)])  # a hole at 4096
        job = submit([(0, 8192, 8192, 2)], [(0, ptr, 4096), (4096, ptr + 4096, 4096)])
        assert job.wait(10) and job.error is None and job.file_moved == 8192
        assert np.array_equal(np.fromfile(path, np.uint8)[:8192], src)
    finally:
        os.close(fd)
        engine.close()


def test_a_cancel_after_the_end_leaves_a_job_succeeded(nemu: ferry.Runtime, tmp_path: Path,
                                                       jobs: list[Any]) -> None:
    path, data = _file_of(tmp_path, 5 * SLOT)
    dest = nemu.empty(data.size, np.uint8)
    handle = nemu.upload_file(path, dest)
    assert jobs[0].wait_done(30)
    assert jobs[0]._inner.cancel() is False  # too late: nothing to stop
    jobs[0].cancel()
    assert jobs[0].error is None
    handle.wait()
    assert np.array_equal(nemu.to_host(dest), data)


# -- review: the contract's corners ---------------------------------------------------------------------
ONE_LANE = ferry.StagingConfig(engine="native", lanes=1, slots_per_lane=SLOTS, slot_bytes=SLOT)


def test_a_failed_dma_after_a_failed_read_still_abandons_what_it_touched(tmp_path: Path, jobs: list[Any],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # One lane: chunk 0's DMA fails on the device, then chunk 1's read fails; the read's error came first, but
    # the device's outranks it (the arrays a failed DMA touched are abandoned, never handed back to the pool).
    path = tmp_path / "m.safetensors"
    _safetensors(path, {f"w{i}": np.full(40_000, i, np.float32) for i in range(4)})
    runtime = ferry.Runtime("emulated", staging=ONE_LANE)
    try:
        before = runtime.stats()
        monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", (1, errno.EIO))
        testing.fail_next_copy(runtime, after=0)
        with pytest.raises(ferry.CheckpointError, match="injected"):
            ferry.load_safetensors(path, runtime=runtime)
        assert not isinstance(jobs[0].error, _file.FileReadError)
        after = runtime.stats()
        assert after.abandoned == 4 and after.abandoned_bytes >= 4 * 160_000 + SLOTS * SLOT
        assert after.device_bytes == before.device_bytes + 4 * 160_000  # abandoned: never freed
    finally:
        runtime.close()


def test_a_second_interrupt_while_a_cancelled_load_drains_waits_for_its_lanes(
    tmp_path: Path, jobs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C cancels the load; a second Ctrl-C during the wait for the lanes' in-flight chunks must not let the
    # load free its arrays and close its file while the lanes still read into them.
    path = tmp_path / "i.safetensors"
    _safetensors(path, {f"w{i}": np.full(300_000, i, np.float32) for i in range(4)})
    runtime = _open("emulated", emulated_bandwidth=2e7)  # 4.8 MB: ~240 ms on the emulated link
    real_wait = _file.NativeFileJob.wait_done
    seen: list[bool] = []

    def wait_done(self: _file.NativeFileJob, timeout: float | None = None, *, poll: bool = True) -> bool:
        if self.cancelled and not seen:
            seen.append(self.is_done())
            raise KeyboardInterrupt  # the second Ctrl-C, while the cancelled job drains
        return real_wait(self, timeout, poll=poll)

    monkeypatch.setattr(_file.NativeFileJob, "wait_done", wait_done)
    fds = _open_fds()
    try:
        before = runtime.stats()

        def interrupt(done: int, total: int) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            ferry.load_safetensors(path, runtime=runtime, progress=interrupt)
        assert seen == [False]  # the second interrupt came while the lanes were busy
        assert jobs[0].is_done()  # ... and the load still waited for them before it gave anything up
        assert _open_fds() == fds
        after = runtime.stats()
        assert after.device_bytes == before.device_bytes and after.abandoned_bytes == 0
    finally:
        runtime.close()
    assert testing.violations(runtime) == []


def test_a_cancel_that_lands_while_the_job_is_submitted_is_not_lost(
    nemu: ferry.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the emulated device the job is submitted from the ordering stream's thread; a cancel() from the
    # waiting thread between its look at `cancelled` and the job's hand-over to the lanes must still stop it.
    path, data = _file_of(tmp_path, 8 * SLOT)
    real_start = _file.NativeFileJob.start

    class Lanes:
        def __init__(self, job: _file.NativeFileJob, real: Any) -> None:
            self.job, self.real = job, real

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def submit_file(self, *args: Any, **kwargs: Any) -> Any:
            self.job.cancel()  # the waiting thread's cancel, just before the lanes have the job
            return self.real.submit_file(*args, **kwargs)

    class Engine:
        def __init__(self, job: _file.NativeFileJob, real: Any) -> None:
            self.cuda, self.engine = real.cuda, Lanes(job, real.engine)

    def start(self: _file.NativeFileJob) -> None:
        self.engine = Engine(self, self.engine)
        real_start(self)

    monkeypatch.setattr(_file.NativeFileJob, "start", start)
    dest = nemu.empty(data.size, np.uint8)
    with pytest.raises(ferry.TransferFailedError, match="cancelled"):
        nemu.upload_file(path, dest).wait()


@pytest.mark.parametrize("direct", [False, True])
def test_offsets_past_4_gib_round_trip(nrt: ferry.Runtime, tmp_path: Path, jobs: list[Any], direct: bool) -> None:
    # A sparse file of 5 GiB: offsets past 2**32 (and 2**31) go through the packed plan, pread and pwrite whole.
    path = tmp_path / "big.bin"
    at = (5 << 30) + 4097
    data = _payload(3 * SLOT + 11, seed=7)
    with open(path, "wb") as f:
        f.truncate(at + data.size + 5)
    source = nrt.to_device(data)
    nrt.download_file(source, path, offset=at, direct=direct).wait()
    with open(path, "rb") as f:
        f.seek(at - 1)
        raw = np.frombuffer(f.read(data.size + 2), np.uint8)
    assert raw[0] == 0 and raw[-1] == 0 and np.array_equal(raw[1:-1], data)
    dest = nrt.empty(data.size + 1, np.uint8)
    nrt.upload_file(path, dest, offset=at - 1, direct=direct).wait()
    back = nrt.to_host(dest)
    assert back[0] == 0 and np.array_equal(back[1:], data)
    assert [j.moved_bytes for j in jobs] == [data.size, data.size + 1]
    assert min(c.start for c in jobs[1].plan.chunks) >= 1 << 32


def test_a_submission_the_lanes_refuse_changes_nothing(
    nemu: ferry.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CUDA the job goes to the lanes inside the call (emulated here: the same branch, the lanes refusing it):
    # a refusal is the caller's TransferSubmitError, with the array owned, the file closed, nothing leaked.
    path, data = _file_of(tmp_path, 4 * SLOT)
    real_start = _file.NativeFileJob.start

    class Refusing:
        def submit_file(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the staging engine is closed")

    class Engine:
        cuda = True
        engine = Refusing()

    def start(self: _file.NativeFileJob) -> None:
        self.engine = Engine()
        real_start(self)

    warm = nemu.to_device(np.zeros(3, np.float32))
    nemu.to_host(warm)
    monkeypatch.setattr(_file.NativeFileJob, "start", start)
    dest, source = nemu.empty(data.size, np.uint8), nemu.to_device(data)
    before, fds = nemu.stats(), _open_fds()
    with pytest.raises(ferry.TransferSubmitError, match="staging engine is closed"):
        nemu.upload_file(path, dest)
    with pytest.raises(ferry.TransferSubmitError, match="staging engine is closed"):
        nemu.download_file(source, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    st = tmp_path / "m.safetensors"
    _safetensors(st, {"a": np.ones(1000, np.float32), "b": np.zeros(5, np.uint8)})
    with pytest.raises(ferry.FerryError, match="staging engine is closed"):
        ferry.load_safetensors(st, runtime=nemu)
    with pytest.raises(ferry.FerryError, match="staging engine is closed"):
        ferry.save_safetensors({"s": source}, tmp_path / "s.safetensors", runtime=nemu)
    assert sorted(os.listdir(tmp_path)) == ["data.bin", "m.safetensors"]
    after = nemu.stats()
    assert after.failed == before.failed and after.abandoned_bytes == 0
    assert after.device_bytes == before.device_bytes and _open_fds() == fds
    assert dest.state == "owned" and source.state == "owned"
    monkeypatch.setattr(_file.NativeFileJob, "start", real_start)
    nemu.upload_file(path, dest).wait()  # usable as before
    source.close()  # no lease left behind
    assert np.array_equal(nemu.to_host(dest), data)


def test_a_file_whose_name_is_not_utf8_is_read_and_written(nrt: ferry.Runtime, tmp_path: Path, jobs: list[Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    name = os.path.join(os.fsencode(tmp_path), b"\xff\xfe-data.bin")  # a valid Linux name, not UTF-8
    data = _payload(3 * SLOT + 5)
    source = nrt.to_device(data)
    nrt.download_file(source, name).wait()
    dest = nrt.empty(data.size, np.uint8)
    nrt.upload_file(name, dest).wait()
    assert np.array_equal(nrt.to_host(dest), data) and len(jobs) == 2
    if nrt.backend == "emulated":
        monkeypatch.setattr(_file, "_FAIL_NATIVE_CHUNK", (1, errno.EIO))
        with pytest.raises(ferry.TransferFailedError, match=r"-data\.bin' at byte \d+: the read failed"):
            nrt.upload_file(name, nrt.empty(data.size, np.uint8)).wait()
