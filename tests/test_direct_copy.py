"""The direct route's shared host copy (the extension's ``Copier``) and its segmented transfers.

A pageable array of up to ``StagingConfig.direct_bytes`` goes through one pinned block. With the
compiled extension its host copy is shared by the calling thread and the copy helpers, an upload
is enqueued in segments each right behind its part's copy, and a download of 4 MiB and more lands
in segments that a waiter copies out as each completes. These tests check the copier on its own
(every byte, any size and alignment, helpers that really copy, concurrent callers, close, fork,
refusals) and the route through a runtime on both engines (round trips, the default limit, events
pooled, failures in the middle that publish nothing, a bounded wait).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ferry
import ferry._native
from conftest import HeldAtMost
from ferry import testing
from ferry._routes._direct import DOWNLOAD_SEGMENT_BYTES, SEGMENT_BYTES
from ferry._runtime import parts_of

MiB = 1 << 20
SRC = str(Path(__file__).resolve().parents[1] / "src")
NATIVE = ferry._native.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"the extension does not run: {ferry._native.status()}")


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- the copier ---------------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("nontemporal", [False, True])
@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_a_copy_moves_every_byte_at_any_size_and_alignment(helpers: int, nontemporal: bool) -> None:
    assert NATIVE is not None
    copier = NATIVE.Copier(helpers, piece_bytes=16 << 10)
    try:
        for n in (0, 1, 4095, 16 << 10, (32 << 10) + 1, MiB + 17, 3 * MiB):
            source = pattern(n + 64, n)
            for src_off, dst_off in ((0, 0), (1, 7), (63, 3)):
                target = np.zeros(n + 128, np.uint8)
                copier.copy(target.ctypes.data + dst_off, source.ctypes.data + src_off, n, nontemporal)
                assert np.array_equal(target[dst_off:dst_off + n], source[src_off:src_off + n]), (n, src_off)
                assert not target[:dst_off].any() and not target[dst_off + n:].any()  # nothing outside
        assert copier.shared_copies == (9 if helpers else 0)  # 32 KiB + 1, 1 MiB + 17 and 3 MiB, x3 offsets
    finally:
        copier.close()


@needs_native
def test_helpers_copy_the_pieces_when_the_caller_leaves_them_all() -> None:
    assert NATIVE is not None
    copier = NATIVE.Copier(2, piece_bytes=16 << 10, caller_copies=False)
    try:
        source, target = pattern(MiB, 1), np.zeros(MiB, np.uint8)
        assert copier.started == 0  # the helpers start with the first shared copy
        copier.copy(target.ctypes.data, source.ctypes.data, MiB)
        assert np.array_equal(target, source)
        assert copier.started == 2 and copier.shared_copies == 1
        assert copier.pieces_helped == MiB // (16 << 10)  # every piece, by the helpers
    finally:
        copier.close()


@needs_native
def test_concurrent_callers_each_get_their_own_bytes() -> None:
    assert NATIVE is not None
    copier = NATIVE.Copier(2, piece_bytes=16 << 10)
    failures: list[int] = []

    def caller(seed: int) -> None:
        source = pattern(512 << 10, seed)
        for i in range(30):
            target = np.zeros_like(source)
            copier.copy(target.ctypes.data, source.ctypes.data, source.nbytes)
            if not np.array_equal(target, source):
                failures.append(seed * 100 + i)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    copier.close()
    assert not failures and not any(t.is_alive() for t in threads)


@needs_native
def test_close_joins_the_helpers_and_later_copies_run_on_the_caller() -> None:
    assert NATIVE is not None
    copier = NATIVE.Copier(2, piece_bytes=16 << 10, caller_copies=False)
    source, target = pattern(MiB, 2), np.zeros(MiB, np.uint8)
    copier.copy(target.ctypes.data, source.ctypes.data, MiB)
    helped = copier.pieces_helped
    assert copier.started == 2 and not copier.closed
    copier.close()
    assert copier.closed and copier.started == 0
    target[:] = 0
    copier.copy(target.ctypes.data, source.ctypes.data, MiB)  # no helper left: the caller copies it all
    assert np.array_equal(target, source) and copier.pieces_helped == helped
    copier.close()  # twice: nothing to do
    assert copier.closed


# The fork runs in a fresh interpreter whose only other threads are the copier's helpers (native
# threads that hold no Python lock): forking the test runner, with its many Python threads (emulated
# devices, watchers), could deadlock the child for real. Python 3.12+ still warns at any fork of a
# multi-threaded process; here the threads are the point of the test, so that one warning is expected.
_FORKED_COPIER = """
import os, sys, time, warnings
import numpy as np
import ferry._native

MiB = 1 << 20
copier = ferry._native.load().Copier(2, piece_bytes=16 << 10, caller_copies=False)
rng = np.random.default_rng(3)
source, target = rng.integers(0, 256, MiB, dtype=np.uint8), np.zeros(MiB, np.uint8)
copier.copy(target.ctypes.data, source.ctypes.data, MiB)  # the helpers run in the parent
helped = copier.pieces_helped
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r".*multi-threaded, use of fork\\(\\) may lead to deadlocks",
                            DeprecationWarning)
    pid = os.fork()
if pid == 0:  # the child: no helpers here; a shared copy would wait for them forever
    ok = True
    try:
        target[:] = 0
        copier.copy(target.ctypes.data, source.ctypes.data, MiB)
        ok = bool(np.array_equal(target, source)) and copier.pieces_helped == helped
        copier.close()  # touches nothing of the parent's
        del copier
    except BaseException:
        ok = False
    os._exit(0 if ok else 1)
deadline = time.monotonic() + 30
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        sys.exit("the forked child hung in its copy")
    time.sleep(0.01)
if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
    sys.exit(f"the forked child failed: status {status}")
target[:] = 0
copier.copy(target.ctypes.data, source.ctypes.data, MiB)  # the parent's helpers still serve
if not (np.array_equal(target, source) and copier.pieces_helped > helped):
    sys.exit("the parent's helpers no longer copy")
copier.close()
print("ok")
"""


@needs_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_copies_alone_and_never_touches_the_parents_helpers() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _FORKED_COPIER],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n" and result.stderr == "", result.stderr  # no warning either (one is printed)


@needs_native
def test_bad_arguments_are_refused() -> None:
    assert NATIVE is not None
    for kwargs in ({"helpers": -1}, {"helpers": 9}, {"helpers": 1, "piece_bytes": 1024},
                   {"helpers": 0, "caller_copies": False}, {"helpers": 1, "spin_us": -1}):
        with pytest.raises(ValueError):
            NATIVE.Copier(**kwargs)
    copier = NATIVE.Copier(1)
    target = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="NULL"):
        copier.copy(0, target.ctypes.data, 8)
    with pytest.raises(TypeError):
        copier.copy(target.ctypes.data, target.ctypes.data)
    with pytest.raises((TypeError, ValueError, OverflowError)):
        copier.copy(-1, target.ctypes.data, 8)
    copier.close()


# -- the direct route ---------------------------------------------------------------------------------


@pytest.fixture(params=["native", "python"])
def rt(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ferry.Runtime]:
    if request.param == "native" and NATIVE is None:
        pytest.skip(f"the extension does not run: {ferry._native.status()}")
    if request.param == "python":
        monkeypatch.setenv(ferry._native.ENV_VAR, "0")
    runtime = ferry.Runtime("emulated")
    try:
        yield runtime
    finally:
        runtime.close()


def shared(runtime: ferry.Runtime) -> bool:
    return parts_of(runtime).host.direct.copier is not None


def test_the_default_direct_limits_follow_the_engine(rt: ferry.Runtime) -> None:
    staging = parts_of(rt).staging
    assert staging.direct_bytes == 4 * MiB  # uploads: the copy runs in the submission
    assert staging.direct_download_bytes == (8 * MiB if shared(rt) else 4 * MiB)  # downloads: in wait()
    limits = f"direct route up to {staging.direct_bytes >> 10} KiB up, {staging.direct_download_bytes >> 10} KiB down"
    assert limits in rt.info()["staging_threads"]
    config = ferry.StagingConfig(direct_bytes=MiB)
    with ferry.Runtime("emulated", staging=config) as small:
        assert parts_of(small).staging.direct_download_bytes == (2 * MiB if shared(small) else MiB)
    with ferry.Runtime("emulated", staging=ferry.StagingConfig(direct_download_bytes=MiB)) as explicit:
        assert parts_of(explicit).staging.direct_download_bytes == MiB  # a value given is kept
    for bad in ({"direct_bytes": -1}, {"direct_download_bytes": -2}, {"copy_helpers": 9}, {"copy_helpers": -2}):
        with pytest.raises(ValueError):
            ferry.StagingConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("nbytes", [MiB, 3 * MiB + 12345, 4 * MiB, 8 * MiB])
def test_direct_transfers_round_trip_at_every_size(rt: ferry.Runtime, nbytes: int) -> None:
    staging = parts_of(rt).staging
    if nbytes > staging.direct_download_bytes:
        pytest.skip("above this engine's direct route")
    direct = parts_of(rt).host.direct
    data = pattern(nbytes, nbytes)
    copied = direct.host_copied
    _, dev = rt.upload(data).wait()
    uploaded = direct.host_copied - copied
    out = np.zeros_like(data)
    _, got = rt.download(dev, out).wait()
    assert got is out and np.array_equal(out, data)
    assert uploaded == (nbytes if nbytes <= staging.direct_bytes else 0)  # 8 MiB uploads are staged
    assert direct.host_copied - copied - uploaded == nbytes
    if shared(rt):
        assert direct.copier.shared_copies >= 1


def test_a_strided_array_takes_the_chunk_copies(rt: ferry.Runtime) -> None:
    data = pattern(4 * MiB, 7).reshape(1024, 4096)[:, ::2]  # 2 MiB, not C-contiguous
    _, dev = rt.upload(data).wait()
    out = np.zeros(data.shape, np.uint8)[:, :]
    back = rt.to_host(dev)
    assert np.array_equal(back, data)
    _, got = rt.download(dev, out).wait()
    assert np.array_equal(got, data)


def test_a_segmented_download_pools_its_events(rt: ferry.Runtime) -> None:
    nbytes = 2 * DOWNLOAD_SEGMENT_BYTES + 5
    if nbytes > parts_of(rt).staging.direct_download_bytes:
        pytest.skip("above this engine's direct route")
    completion = parts_of(rt).completion
    data = pattern(nbytes, 8)
    dev = rt.to_device(data)
    out = np.zeros_like(data)
    rt.download(dev, out).wait()
    made = completion.event_count
    for _ in range(5):
        out[:] = 0
        rt.download(dev, out).wait()
        assert np.array_equal(out, data)
    assert completion.event_count == made  # the segments' events come back to the pool


def four_segments(rt: ferry.Runtime, seed: int) -> tuple[np.ndarray, ferry.DeviceArray, np.ndarray]:
    """Data of four download segments on the device and a zeroed output (skips above the limit)."""
    nbytes = 4 * DOWNLOAD_SEGMENT_BYTES
    if nbytes > parts_of(rt).staging.direct_download_bytes:
        pytest.skip("above this engine's direct route")
    data = pattern(nbytes, seed)
    return data, rt.to_device(data), np.zeros_like(data)


def test_a_held_segmented_download_times_out_and_completes_later(rt: ferry.Runtime) -> None:
    data, dev, out = four_segments(rt, 9)
    with HeldAtMost(rt, "download") as held:
        pending = rt.download(dev, out)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0.1)
        assert time.monotonic() - start >= 0.1  # the timeout's whole length
        assert not held.expired, "the wait ignored its timeout: it returned once the held copy was let go"
        assert not pending.is_ready()
    _, got = pending.wait()
    assert got is out and np.array_equal(out, data)


def test_a_failure_in_the_middle_of_a_direct_upload_publishes_nothing(rt: ferry.Runtime) -> None:
    nbytes = 4 * SEGMENT_BYTES
    data = pattern(nbytes, 10)
    testing.fail_next_copy(rt, after=1 if shared(rt) else 0)  # the second segment (or the one DMA)
    pending = rt.upload(data)
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()
    assert data.flags.writeable and rt.stats().failed == 1
    assert rt.stats().abandoned_bytes >= nbytes  # the block may have been read: never reused
    fresh = pattern(nbytes, 11)
    assert np.array_equal(rt.to_host(rt.to_device(fresh)), fresh)  # the runtime goes on


def test_a_failure_in_the_middle_of_a_segmented_download_publishes_nothing(rt: ferry.Runtime) -> None:
    data, dev, out = four_segments(rt, 12)
    nbytes = data.nbytes
    testing.fail_next_copy(rt, after=2)  # the third segment
    pending = rt.download(dev, out)
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()
    assert out.flags.writeable and not np.array_equal(out, data)  # never completed
    assert dev.state == "abandoned"
    fresh = pattern(nbytes, 13)
    back = np.zeros_like(fresh)
    _, got = rt.download(rt.to_device(fresh), back).wait()
    assert np.array_equal(got, fresh)


def test_a_segment_refused_after_the_first_was_queued_leaves_everything_owned(
    rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry._backends._base import DeviceError

    if not shared(rt):
        pytest.skip("one DMA on the pure-Python engine: no segments")
    backend = testing.backend_of(rt)
    real, calls = backend.htod_record, []

    def second_refused(*args: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise DeviceError("the device refused the copy (test)", code=1)
        real(*args)

    monkeypatch.setattr(backend, "htod_record", second_refused)
    data = pattern(4 * SEGMENT_BYTES, 14)
    dev = rt.empty(data.shape, data.dtype)
    with pytest.raises(ferry.TransferSubmitError):
        rt.upload(data, dev)  # the first segment was queued: proven done (the stream waited), then refused
    assert len(calls) == 2 and data.flags.writeable and dev.state == "owned"
    monkeypatch.setattr(backend, "htod_record", real)
    _, dev = rt.upload(data, dev).wait()  # both still usable
    assert np.array_equal(rt.to_host(dev), data)
