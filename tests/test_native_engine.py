"""The native staging engine (``ferry._native._engine``), driven directly.

Emulated mode: a NumPy byte buffer stands in for device memory (the engine
receives its real address as the device pointer), each lane's stream is a
native worker that takes modelled time, and faults are injected with
``fail_next_copy``. The CUDA-mode tests at the end run on a GPU machine only.
Tests assert behaviour, never timing.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import SignalInside, call_inside
from ferry import _native

_engine = pytest.importorskip(
    "ferry._native._engine", reason="the native engine is not built (pip install -e . builds it)"
)
Engine = _engine.Engine

LANES = 4
SLOTS = 2
SLOT = 256 << 10


def make(direction: str, **kw: Any) -> Any:
    opts: dict[str, Any] = {
        "mode": "emulated",
        "lanes": LANES,
        "slots_per_lane": SLOTS,
        "slot_bytes": SLOT,
        "min_chunk_bytes": 16 << 10,
        "bandwidth": 50e9,
        "latency": 2e-6,
    }
    opts.update(kw)
    return Engine(direction, **opts)


# The engine's two ways to reach the driver and copy: one driver thread and streaming copies (the
# default, what a roomy machine runs), and lanes that call the driver themselves with cached copies.
THREADS = [
    pytest.param({"driver_thread": True, "nontemporal": True}, id="driver-thread"),
    pytest.param({"driver_thread": False, "nontemporal": False}, id="lanes-call"),
    pytest.param({"driver_thread": True, "nontemporal": True, "helpers": LANES - 1}, id="cooperative"),
]


@pytest.fixture(params=THREADS)
def up(request: pytest.FixtureRequest) -> Iterator[Any]:
    engine = make("upload", **request.param)
    assert engine.driver_thread is request.param["driver_thread"]
    yield engine
    engine.close()


@pytest.fixture(params=THREADS[:2])
def dealt_up(request: pytest.FixtureRequest) -> Iterator[Any]:
    """An upload engine without helpers: every job's chunks are dealt round-robin to the lanes."""
    engine = make("upload", **request.param)
    assert engine.helpers == 0
    yield engine
    engine.close()


@pytest.fixture(params=THREADS)
def down(request: pytest.FixtureRequest) -> Iterator[Any]:
    engine = make("download", **request.param)
    yield engine
    engine.close()


def device_like(nbytes: int) -> np.ndarray[Any, Any]:
    """A stand-in for device memory (the emulated engine takes real addresses on the device side)."""
    return np.full(max(nbytes, 1), 0xEE, dtype=np.uint8)


_keepalive: list[object] = []


@pytest.fixture(autouse=True)
def _keep_arrays_alive() -> Iterator[None]:
    """The caller keeps a job's memory alive until it is done: here, until the test's engines are closed."""
    yield
    _keepalive.clear()


def submit(engine: Any, array: np.ndarray[Any, Any], dev: np.ndarray[Any, Any], **kw: Any) -> Any:
    _keepalive.append((array, dev))
    return engine.submit(
        array.ctypes.data, dev.ctypes.data, array.nbytes, array.shape, array.strides, array.itemsize, **kw
    )


def upload(engine: Any, array: np.ndarray[Any, Any], **kw: Any) -> np.ndarray[Any, Any]:
    dev = device_like(array.nbytes)
    job = submit(engine, array, dev, **kw)
    assert job.wait(30)
    assert job.error is None
    assert job.host_bytes == array.nbytes
    return dev[: array.nbytes]


def download(engine: Any, dev: np.ndarray[Any, Any], out: np.ndarray[Any, Any], **kw: Any) -> None:
    job = submit(engine, out, dev, **kw)
    assert job.wait(30)
    assert job.error is None
    assert job.host_bytes == out.nbytes


def c_bytes(array: np.ndarray[Any, Any]) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def pattern(nbytes: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


# -- round trips ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 7, 4096, 65537, 1 << 20, (3 << 20) + 5, 64 << 20])
def test_contiguous_round_trip(up: Any, down: Any, nbytes: int) -> None:
    data = pattern(nbytes, nbytes)
    dev = upload(up, data)
    assert dev.tobytes() == data.tobytes()
    out = np.zeros_like(data)
    download(down, dev, out)
    assert np.array_equal(out, data)


def _strided_cases() -> list[tuple[str, np.ndarray[Any, Any]]]:
    base = np.arange(4 * 300 * 257, dtype=np.float32).reshape(4, 300, 257)
    big = np.arange(1536 * 1024, dtype=np.float64).reshape(1536, 1024)  # 12 MiB
    return [
        ("transposed", base[1].T),
        ("transposed-3d", base.transpose(2, 0, 1)),
        ("sliced", base[:, 5:290:3, ::2]),
        ("reversed", base[::-1, :, ::-1]),
        ("column", base[:, :, 7]),
        ("big-transposed", big.T),
        ("big-rows", big[::2]),
        ("big-cols", big[:, 1:1000]),
        ("complex", (np.arange(600, dtype=np.complex128).reshape(20, 30) * 1j)[::-2, 3:]),
        ("0-d", np.array(3.5)),
        ("empty", base[:, :0]),
        ("broadcast", np.broadcast_to(np.arange(1000, dtype=np.int16), (300, 1000))),
    ]


@pytest.mark.parametrize(("name", "array"), _strided_cases(), ids=[n for n, _ in _strided_cases()])
def test_strided_round_trip(up: Any, down: Any, name: str, array: np.ndarray[Any, Any]) -> None:
    dev = upload(up, array)
    assert dev.tobytes() == c_bytes(array)
    out = np.zeros(array.shape, array.dtype)
    download(down, dev, out)
    assert np.array_equal(out, array)
    # into a strided destination: a transposed view of a fresh array
    out_t = np.zeros(array.shape[::-1], array.dtype).T
    download(down, dev, out_t)
    assert np.array_equal(out_t, array)


def test_small_chunks_cut_along_the_axes(up: Any, down: Any) -> None:
    array = np.arange(64 * 48 * 5, dtype=np.int32).reshape(64, 48, 5)[:, ::2, 1:]
    job = submit(up, array, dev := device_like(array.nbytes), chunk_bytes=100)
    assert job.wait(30) and job.error is None
    assert job.chunks > LANES and job.lanes == LANES
    assert dev.tobytes() == c_bytes(array)
    out = np.zeros(array.shape, array.dtype)[::1]
    download(down, dev, out, chunk_bytes=100)
    assert np.array_equal(out, array)


try:
    import hypothesis
    from hypothesis import strategies as st
except ImportError:  # the property test needs the test extra; the rest of the module does not
    hypothesis = None


if hypothesis is not None:

    @st.composite
    def strided_arrays(draw: Any) -> np.ndarray[Any, Any]:
        dtype = draw(st.sampled_from([np.uint8, np.int16, np.float32, np.float64, np.complex128]))
        shape = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
        base = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape)
        index = tuple(slice(draw(st.integers(0, n - 1)), None, draw(st.sampled_from([1, 2, 3, -1, -2]))) for n in shape)
        view = base[index]
        if draw(st.booleans()):
            view = view.transpose(draw(st.permutations(range(view.ndim))))
        return view

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(array=strided_arrays(), chunk=st.sampled_from([0, 16, 100, 4096, SLOT]))
    def test_property_round_trip(array: np.ndarray[Any, Any], chunk: int) -> None:
        with contextlib.closing(make("upload")) as up, contextlib.closing(make("download")) as down:
            dev = device_like(array.nbytes)
            job = submit(up, array, dev, chunk_bytes=chunk)
            assert job.wait(30) and job.error is None and job.host_bytes == array.nbytes
            assert dev[: array.nbytes].tobytes() == c_bytes(array)
            out = np.zeros(array.shape[::-1], array.dtype).T
            job = submit(down, out, dev, chunk_bytes=chunk)
            assert job.wait(30) and job.error is None
            assert np.array_equal(out, array)

else:

    @pytest.mark.skip(reason="hypothesis is part of the test extra")
    def test_property_round_trip() -> None:
        pass


def test_many_concurrent_jobs(up: Any, down: Any) -> None:
    rng = np.random.default_rng(7)
    arrays = [pattern(int(n), i) for i, n in enumerate(rng.integers(1, 3 << 20, size=40))]
    devs = [device_like(a.nbytes) for a in arrays]
    jobs = [submit(up, a, d) for a, d in zip(arrays, devs, strict=True)]
    for job in jobs:
        assert job.wait(30) and job.error is None
    outs = [np.zeros_like(a) for a in arrays]
    jobs = [submit(down, o, d) for o, d in zip(outs, devs, strict=True)]
    for job, out, array in zip(jobs, outs, arrays, strict=True):
        assert job.wait(30) and job.error is None
        assert np.array_equal(out, array)


def test_jobs_from_many_threads(up: Any) -> None:
    arrays = [pattern(300_000 + i, i) for i in range(16)]
    devs = [device_like(a.nbytes) for a in arrays]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                job = submit(up, arrays[i], devs[i])
                assert job.wait(30) and job.error is None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(arrays))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for a, d in zip(arrays, devs, strict=True):
        assert d[: a.nbytes].tobytes() == a.tobytes()


# -- completion -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_not_done_while_held(direction: str) -> None:
    with contextlib.closing(make(direction)) as engine:
        data = pattern(2 << 20)
        dev = device_like(data.nbytes)
        host = data if direction == "upload" else np.zeros_like(data)
        if direction == "download":
            dev[:] = data
        engine.hold()
        job = submit(engine, host, dev)
        assert not job.done()
        assert job.wait(0.05) is False
        assert job.wait(0) is False
        assert not job.done()
        engine.release()
        assert job.wait(30) is True
        assert job.done() and job.error is None
        assert (dev if direction == "upload" else host).tobytes() == data.tobytes()


def test_wait_releases_the_gil(up: Any) -> None:
    up.hold()
    job = submit(up, pattern(1 << 20), device_like(1 << 20))
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert job.wait(0.2) is False
    finally:
        stop.set()
        thread.join()
        up.release()
    assert counter[0] > 0
    assert job.wait(30)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
@pytest.mark.parametrize("sleep", ["wait", "hand_off"])
def test_a_sleeping_job_call_is_interruptible(up: Any, sleep: str) -> None:
    # held with more chunks per lane than slots: the job neither completes nor posts until release
    class SignalledError(Exception):
        pass

    def handler(signum: int, frame: Any) -> None:
        raise SignalledError

    up.hold()
    job = submit(up, pattern(16 * SLOT), device_like(16 * SLOT), chunk_bytes=SLOT // 2, hand_off=True)
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        sender = SignalInside(signal.SIGALRM)  # once the call sleeps: it never ends by itself
        with pytest.raises(SignalledError):
            call_inside(getattr(job, sleep))
        sender.join()
    finally:
        signal.signal(signal.SIGALRM, previous)
        up.release()
    assert job.hand_off(timeout=30) is not None and job.wait(30) and job.error is None


@pytest.mark.parametrize("driver_thread", [True, False])
def test_timeline_and_the_spinning_knobs(driver_thread: bool) -> None:
    engine = make("upload", spin_us=50, idle_spin_us=50, min_chunks_per_lane=3, wait_spin_us=300,
                  driver_thread=driver_thread)
    with contextlib.closing(engine) as up:
        assert up.spin_us == 50 and up.wait_spin_us == 300 and up.driver_thread is driver_thread
        data = pattern(2 << 20)
        dev = device_like(data.nbytes)
        job = submit(up, data, dev)
        assert job.chunks > 2 * LANES  # several chunks per lane
        assert job.wait(30) and job.error is None
        t = job.timeline()
        assert set(t) == {"start_first", "start_last", "copy_last", "enqueue_last", "done", "enqueues", "enqueue_us",
                          "lock_wait_us"}
        assert all(v is not None for v in t.values())
        assert t["enqueues"] == job.chunks and t["enqueue_us"] > 0 and t["lock_wait_us"] >= 0
        assert 0 <= t["start_first"] <= t["start_last"] <= t["done"]
        assert t["copy_last"] <= t["enqueue_last"] <= t["done"]
        assert dev.tobytes() == data.tobytes()


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_chunk_times_trace_each_chunk_through_its_lane(direction: str) -> None:
    with contextlib.closing(make(direction, min_chunks_per_lane=2)) as engine:
        data = pattern(1 << 20)
        host, dev = (data, device_like(data.nbytes)) if direction == "upload" else (np.zeros_like(data), data.copy())
        engine.hold()
        try:
            job = submit(engine, host, dev)
            with pytest.raises(RuntimeError, match="finished job"):
                job.chunk_times()  # held: it cannot be done
        finally:
            engine.release()
        assert job.wait(30) and job.error is None
        times = job.chunk_times()
        assert len(times) == job.chunks >= 2 * LANES
        for lane, *t in times:
            assert 0 <= lane < LANES
            assert 0 <= t[0] <= t[1] <= t[2] <= t[3]  # taken / handed, copy begun / answered, ..., ended
        assert len({lane for lane, *_ in times}) == job.lanes  # every lane's share is in it
        assert (dev if direction == "upload" else host).tobytes() == data.tobytes()


def test_chunk_sizes_give_the_plan(up: Any, down: Any) -> None:
    data = pattern((3 << 20) + 5)
    job = submit(up, data, device_like(data.nbytes))
    strided = pattern(1 << 20).reshape(512, 2048)[:, ::2]
    across = submit(up, strided, device_like(strided.nbytes))
    back = submit(down, np.zeros_like(data), data.copy(), chunk_bytes=100000)
    for j in (job, across, back):
        assert j.wait(30) and j.error is None
        sizes = j.chunk_sizes()
        assert len(sizes) == j.chunks and sum(sizes) == j.nbytes
        assert all(0 < size <= j.chunk_bytes for size in sizes)
    assert set(job.chunk_sizes()[:-1]) == {job.chunk_bytes}  # a contiguous payload: even chunks, the last shorter
    assert set(back.chunk_sizes()[:-1]) == {100000}


def test_empty_job_is_done_at_once(up: Any) -> None:
    array = np.zeros((0, 5), np.float32)
    job = submit(up, array, device_like(1))
    assert job.done() and job.wait() and job.chunks == 0 and job.host_bytes == 0


def test_hand_off_posts_one_event_per_lane_once_its_last_dma_is_enqueued(dealt_up: Any) -> None:
    # held: the (emulated) streams run nothing, but each lane can enqueue as many chunks as it has slots
    data = pattern(8 * SLOT // 2)
    dev = device_like(data.nbytes)
    dealt_up.hold()
    try:
        job = submit(dealt_up, data, dev, chunk_bytes=SLOT // 2, hand_off=True)  # 2 chunks per lane = its slots
        events = job.hand_off(timeout=30)
        assert events is not None and len(events) == job.lanes == LANES
        assert len(set(events)) == LANES and all(events)  # one per lane's stream
        assert not job.done()  # posted when enqueued, before the DMAs ran
        assert dev.tobytes() != data.tobytes()
        assert submit(dealt_up, data, device_like(data.nbytes)).hand_off(timeout=0) == []  # without hand_off
    finally:
        dealt_up.release()
    assert job.wait(30) and job.error is None
    assert job.hand_off() == events  # posted once; asking again changes nothing
    assert dev.tobytes() == data.tobytes()


def test_a_posted_event_is_not_recorded_again_by_the_next_jobs(dealt_up: Any) -> None:
    # a late hand-off must not wait for later jobs: each post takes a fresh event of its lane (the
    # slots' own events come back every SLOTS chunks, and a later job's chunk would record them)
    data = pattern(LANES * SLOT // 2)
    seen: list[int] = []
    for _ in range(12):  # fewer than the lane's hand-off events
        job = submit(dealt_up, data, device_like(data.nbytes), chunk_bytes=SLOT // 2, hand_off=True)  # a chunk per lane
        assert job.wait(30) and job.error is None
        events = job.hand_off(timeout=30)
        assert events is not None and len(events) == LANES
        seen.extend(events)
    assert len(set(seen)) == len(seen)


def test_hand_off_waits_until_every_lane_enqueued_its_last_dma(dealt_up: Any) -> None:
    data = pattern(32 * SLOT // 2)
    dev = device_like(data.nbytes)
    dealt_up.hold()
    try:
        job = submit(dealt_up, data, dev, chunk_bytes=SLOT // 2, hand_off=True)  # 8 chunks per lane, 2 slots
        assert job.hand_off(timeout=0.1) is None  # the lanes wait for their slots: nothing posted yet
        assert job.hand_off(timeout=0) is None
    finally:
        dealt_up.release()
    events = job.hand_off()
    assert events is not None and len(events) == LANES
    assert job.wait(30) and job.error is None and dev.tobytes() == data.tobytes()


def test_downloads_hand_off_too(down: Any) -> None:
    data = pattern(1 << 20)
    out = np.zeros_like(data)
    job = submit(down, out, data.copy(), hand_off=True)
    events = job.hand_off(timeout=30)
    assert events is not None and len(events) == job.lanes
    assert job.wait(30) and job.error is None and np.array_equal(out, data)


# -- cooperative jobs -----------------------------------------------------------------------------------


def coop(direction: str, **kw: Any) -> Any:
    """An engine whose contiguous jobs are cooperative: one lead lane, its copies shared with idle lanes."""
    opts: dict[str, Any] = {"helpers": LANES - 1, "piece_bytes": 16 << 10}
    opts.update(kw)
    return make(direction, **opts)


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_a_contiguous_job_is_one_lead_share_in_chunks_of_a_quarter(direction: str) -> None:
    with contextlib.closing(coop(direction)) as engine:
        assert engine.helpers == LANES - 1 and engine.piece_bytes == 16 << 10
        data = pattern(SLOT * 3 + 5)
        host, dev = (data, device_like(data.nbytes)) if direction == "upload" else (np.zeros_like(data), data.copy())
        job = submit(engine, host, dev)
        assert job.wait(30) and job.error is None
        assert job.lanes == 1 and engine.cooperative_jobs == 1
        assert job.chunk_bytes == engine.chunk_bytes(data.nbytes) == SLOT  # a quarter, at most a slot
        assert job.chunk_sizes() == [SLOT, SLOT, SLOT, 5]
        assert len({lane for lane, *_ in job.chunk_times()}) == 1  # the lead took every chunk, in order
        assert job.host_bytes == data.nbytes
        assert (dev if direction == "upload" else host).tobytes() == data.tobytes()
        strided = pattern(1 << 20).reshape(512, 2048)[:, ::2]  # not contiguous: dealt to the lanes
        out = device_like(strided.nbytes)
        if direction == "upload":
            dealt = submit(engine, strided, out)
            assert dealt.wait(30) and dealt.error is None and dealt.lanes == LANES
            assert out[: strided.nbytes].tobytes() == np.ascontiguousarray(strided).tobytes()
        tiny = submit(engine, *(pattern(16 << 10), device_like(16 << 10))[:: 1 if direction == "upload" else -1])
        assert tiny.wait(30) and tiny.error is None
        assert engine.cooperative_jobs == 1  # one piece: nothing to share


def test_a_job_above_the_cooperative_limit_is_dealt() -> None:
    with contextlib.closing(coop("upload", cooperative_max_bytes=SLOT * 2)) as engine:
        assert engine.cooperative_max_bytes == SLOT * 2
        at, above = pattern(SLOT * 2), pattern(SLOT * 2 + 1)
        jobs = [submit(engine, a, device_like(a.nbytes)) for a in (at, above)]
        assert all(j.wait(30) and j.error is None for j in jobs)
        assert jobs[0].lanes == 1 and engine.cooperative_jobs == 1
        assert jobs[1].lanes == min(jobs[1].chunks, LANES) > 1  # its chunks dealt


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_helpers_copy_the_pieces_a_lead_leaves(direction: str) -> None:
    # lead_copies=False (a test knob): the lead copies nothing, so every piece is a helper's
    with contextlib.closing(coop(direction, lead_copies=False)) as engine:
        data = pattern((2 << 20) + 3)
        host, dev = (data, device_like(data.nbytes)) if direction == "upload" else (np.zeros_like(data), data.copy())
        job = submit(engine, host, dev)
        assert job.wait(30) and job.error is None
        pieces = sum(-(-size // engine.piece_bytes) for size in job.chunk_sizes())
        assert engine.helped_pieces == pieces
        assert (dev if direction == "upload" else host).tobytes() == data.tobytes()


def test_a_helper_leaves_a_lead_as_soon_as_a_share_of_its_own_is_queued() -> None:
    # two lanes: lane A leads a cooperative job that waits for its slots (held), lane B helps it and,
    # with a 10 s help spin, would stay in help() for 10 s after the lead's last post if only a timeout
    # sent it back. A dealt job queued for lane B must run at once: its share enqueues its DMA (posts)

    # lead_copies=False: the helper copies every piece, so its count shows when it is inside help()
    with contextlib.closing(coop("upload", lanes=2, helpers=1, help_spin_us=1e7, lead_copies=False)) as engine:
        data = pattern(SLOT * 2)
        strided = pattern(1 << 16).reshape(256, 256)[:, ::2]  # not contiguous: dealt, one chunk
        dev, sdev = device_like(data.nbytes), device_like(strided.nbytes)
        engine.hold()
        try:
            lead = submit(engine, data, dev, chunk_bytes=SLOT // 2)  # 4 chunks, 2 slots: the lead waits
            two_chunks = 2 * (SLOT // 2) // engine.piece_bytes
            deadline = time.monotonic() + 30
            while engine.helped_pieces < two_chunks and time.monotonic() < deadline:
                time.sleep(0.001)
            assert engine.helped_pieces == two_chunks  # copied by the helper; the lead waits for a slot
            dealt = submit(engine, strided, sdev, hand_off=True)  # the next lane's: the helper's
            assert dealt.lanes == 1 and engine.cooperative_jobs == 1
            events = dealt.hand_off(timeout=5)
            assert events is not None and len(events) == 1  # enqueued while the lead still runs
            assert not lead.done()
        finally:
            engine.release()
        assert lead.wait(30) and lead.error is None and dev.tobytes() == data.tobytes()
        assert dealt.wait(30) and dealt.error is None
        assert sdev[: strided.nbytes].tobytes() == np.ascontiguousarray(strided).tobytes()


def test_cooperative_jobs_from_many_threads_on_two_lanes() -> None:
    # each lane the lead of some jobs and a helper of the others', mixed with dealt jobs
    with contextlib.closing(coop("upload", lanes=2, helpers=1, slots_per_lane=1)) as engine:
        arrays = [pattern(SLOT * 2 + i, i) for i in range(16)]
        arrays += [pattern(1 << 16, i).reshape(256, 256)[:, ::2] for i in range(4)]  # dealt
        devs = [device_like(a.nbytes) for a in arrays]
        jobs: list[Any] = [None] * len(arrays)

        def feed(i: int) -> None:
            jobs[i] = submit(engine, arrays[i], devs[i])

        threads = [threading.Thread(target=feed, args=(i,)) for i in range(len(arrays))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for job, a, d in zip(jobs, arrays, devs, strict=True):
            assert job.wait(30) and job.error is None
            assert d[: a.nbytes].tobytes() == np.ascontiguousarray(a).tobytes()
        assert engine.cooperative_jobs == 16


def test_a_cooperative_job_hands_off_once_its_lead_enqueued_its_last_dma() -> None:
    with contextlib.closing(coop("upload")) as engine:
        data = pattern(SLOT * 2)
        dev = device_like(data.nbytes)
        engine.hold()
        try:
            job = submit(engine, data, dev, chunk_bytes=SLOT // 2, hand_off=True)  # 4 chunks, 2 slots: it waits
            assert job.hand_off(timeout=0.1) is None
        finally:
            engine.release()
        events = job.hand_off(timeout=30)
        assert events is not None and len(events) == job.lanes == 1
        assert job.wait(30) and job.error is None and dev.tobytes() == data.tobytes()


def test_a_failed_cooperative_chunk_fails_its_job_and_abandons_the_leads_slots() -> None:
    with contextlib.closing(coop("upload")) as engine:
        data = pattern(SLOT * 4)
        dev = device_like(data.nbytes)
        engine.fail_next_copy(after=1)
        job = submit(engine, data, dev, hand_off=True)
        assert job.wait(30)
        assert job.error is not None and job.error[0] == _engine.INJECTED_FAILURE
        assert job.host_bytes < data.nbytes  # the chunks after the failed one were never copied
        assert engine.abandoned_bytes == SLOTS * SLOT  # the lead's slots, given up
        assert engine.held_bytes == LANES * SLOTS * SLOT  # and replaced
        assert job.hand_off(timeout=30) == []
        assert upload(engine, data).tobytes() == data.tobytes()


# -- failures -------------------------------------------------------------------------------------------


def test_failure_in_the_middle_of_a_job() -> None:
    # one lane, so that "the remaining chunks are skipped" is deterministic
    with contextlib.closing(make("upload", lanes=1)) as up:
        data = pattern(64 * 4096)
        dev = device_like(data.nbytes)
        held = up.held_bytes
        assert held == SLOTS * SLOT
        up.fail_next_copy(after=3)
        job = submit(up, data, dev, chunk_bytes=4096, hand_off=True)
        assert job.wait(30)
        code, text, sticky = job.error
        assert code == _engine.INJECTED_FAILURE and not sticky and "injected" in text
        assert job.host_bytes < data.nbytes  # the rest was skipped
        assert up.abandoned_bytes == SLOTS * SLOT  # the lane's slots, given up
        assert up.held_bytes == held  # and replaced by fresh ones
        assert job.hand_off(timeout=30) == []  # the failed share posts nothing, and never hangs a consumer
        again = upload(up, data)  # later jobs succeed
        assert again.tobytes() == data.tobytes()


def test_failure_on_one_of_many_lanes(up: Any) -> None:
    data = pattern(4 << 20)
    dev = device_like(data.nbytes)
    up.fail_next_copy(after=5)
    job = submit(up, data, dev, chunk_bytes=64 << 10)
    assert job.wait(30)
    assert job.error is not None and job.error[0] == _engine.INJECTED_FAILURE
    assert up.abandoned_bytes == SLOTS * SLOT
    assert up.held_bytes == LANES * SLOTS * SLOT
    assert upload(up, data).tobytes() == data.tobytes()


def test_download_failure(down: Any) -> None:
    data = pattern(2 << 20)
    dev = data.copy()
    down.fail_next_copy(after=2)
    out = np.zeros_like(data)
    job = submit(down, out, dev, chunk_bytes=64 << 10)
    assert job.wait(30)
    assert job.error is not None and job.error[0] == _engine.INJECTED_FAILURE
    assert down.abandoned_bytes == SLOTS * SLOT
    download(down, dev, out)
    assert np.array_equal(out, data)


def test_sticky_failure_poisons_the_engine(up: Any) -> None:
    data = pattern(1 << 20)
    up.fail_next_copy(sticky=True)
    job = submit(up, data, device_like(data.nbytes))
    assert job.wait(30)
    code, _, sticky = job.error
    assert code == _engine.INJECTED_STICKY_FAILURE == 719 and sticky
    later = submit(up, data, device_like(data.nbytes))
    assert later.wait(30)
    assert later.error is not None and later.error[0] == 719 and later.error[2]
    assert up.held_bytes + up.abandoned_bytes <= LANES * SLOTS * SLOT * 2  # bounded, even while failing


def test_failures_under_load(up: Any) -> None:
    """Faults while many jobs are queued: every job ends, each either correct or failed."""
    arrays = [pattern(500_000 + i, i) for i in range(24)]
    devs = [device_like(a.nbytes) for a in arrays]
    up.fail_next_copy(after=17)
    jobs = [submit(up, a, d, chunk_bytes=64 << 10) for a, d in zip(arrays, devs, strict=True)]
    failed = 0
    for job, a, d in zip(jobs, arrays, devs, strict=True):
        assert job.wait(30)
        if job.error is None:
            assert d[: a.nbytes].tobytes() == a.tobytes()
        else:
            failed += 1
    assert failed >= 1
    assert up.abandoned_bytes % (SLOTS * SLOT) == 0 and up.abandoned_bytes > 0
    assert up.held_bytes == LANES * SLOTS * SLOT


# -- memory and lifetime --------------------------------------------------------------------------------


def test_staging_memory_is_bounded(up: Any) -> None:
    bound = LANES * SLOTS * SLOT
    assert up.held_bytes == bound
    up.hold()
    jobs = [submit(up, pattern(5 << 20, i), device_like(5 << 20)) for i in range(4)]
    assert up.held_bytes == bound
    up.release()
    for job in jobs:
        assert job.wait(30)
    assert up.held_bytes == bound
    up.close()
    assert up.held_bytes == 0


def test_close_waits_for_queued_jobs() -> None:
    engine = make("upload")
    data = [pattern(1 << 20, i) for i in range(8)]
    devs = [device_like(d.nbytes) for d in data]
    engine.hold()
    jobs = [submit(engine, d, dev) for d, dev in zip(data, devs, strict=True)]
    assert not any(job.done() for job in jobs)
    engine.close()  # lifts the hold, runs everything queued
    assert all(job.done() and job.error is None for job in jobs)
    assert all(dev.tobytes() == d.tobytes() for d, dev in zip(data, devs, strict=True))
    engine.close()  # twice is fine
    assert engine.closed
    with pytest.raises(RuntimeError, match="closed"):
        submit(engine, data[0], devs[0])
    with pytest.raises(RuntimeError, match="closed"):
        engine.hold()
    assert jobs[0].wait() is True  # a job outlives its engine's close


def test_jobs_outlive_a_dropped_engine() -> None:
    engine = make("upload")
    data = pattern(1 << 20)
    dev = device_like(data.nbytes)
    job = submit(engine, data, dev)
    del engine
    gc.collect()
    assert job.wait(30) and job.error is None
    assert dev.tobytes() == data.tobytes()
    del job
    gc.collect()


def test_dropping_an_engine_closes_it() -> None:
    engine = make("download")
    dev = pattern(1 << 20)
    out = np.zeros_like(dev)
    submit(engine, out, dev)
    del engine  # waits for the job, joins the lanes
    gc.collect()
    assert np.array_equal(out, dev)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_refuses_the_engine(up: Any) -> None:
    data = pattern(1 << 20)
    dev = device_like(data.nbytes)
    job = submit(up, data, dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            try:
                submit(up, data, dev)
            except RuntimeError as exc:
                if "another process" in str(exc):
                    status = 0
            job.done()  # an atomic load: harmless
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert job.wait(30) and job.error is None


@pytest.mark.slow
def test_a_forked_child_drops_the_engine_without_touching_it() -> None:
    code = (
        "import os, gc, numpy as np\n"
        "from ferry._native._engine import Engine\n"
        "e = Engine('upload', lanes=2, slots_per_lane=1, slot_bytes=65536)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    del e; gc.collect(); os._exit(0)\n"
        "_, st = os.waitpid(pid, 0); e.close(); print(os.waitstatus_to_exitcode(st))\n"
    )
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


# -- arguments ------------------------------------------------------------------------------------------


def test_engine_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="direction"):
        Engine("sideways")
    with pytest.raises(ValueError, match="lanes"):
        Engine("upload", lanes=0)
    with pytest.raises(ValueError, match="mode"):
        Engine("upload", mode="tpu")
    with pytest.raises(ValueError, match="entry_points"):
        Engine("upload", mode="cuda")
    with pytest.raises(ValueError, match="lacks"):
        Engine("upload", mode="cuda", context=1, entry_points={})
    with pytest.raises(ValueError, match="spin"):
        Engine("upload", spin_us=-1)
    with pytest.raises(ValueError, match="wait_spin_us"):
        Engine("upload", wait_spin_us=2e6)
    for bad in (-1.0, 2e6, float("nan")):
        with pytest.raises(ValueError, match="lane_wait_us"):
            Engine("upload", lane_wait_us=bad)
    with contextlib.closing(Engine("upload")) as plain, contextlib.closing(Engine("upload", lane_wait_us=250)) as set_:
        assert plain.lane_wait_us == 100.0 and set_.lane_wait_us == 250.0
    with pytest.raises(ValueError, match="min_chunks_per_lane"):
        Engine("upload", min_chunks_per_lane=0)
    for bad in ({"helpers": 4, "lanes": 4}, {"helpers": -1}, {"help_spin_us": -1.0}, {"piece_bytes": 4096},
                {"lead_copies": False}, {"cooperative_max_bytes": -1}):
        with pytest.raises(ValueError, match="helpers"):
            Engine("upload", **bad)
    with pytest.raises(TypeError):
        _engine.Job()


def test_submit_arguments_are_checked(up: Any) -> None:
    dev = device_like(64)
    with pytest.raises(ValueError, match="nbytes"):
        up.submit(dev.ctypes.data, dev.ctypes.data, 63, (64,), (1,), 1)
    with pytest.raises(ValueError, match="differ"):
        up.submit(dev.ctypes.data, dev.ctypes.data, 64, (64,), (), 1)
    with pytest.raises(ValueError, match="NULL"):
        up.submit(0, dev.ctypes.data, 64, (64,), (1,), 1)
    with pytest.raises(ValueError, match="itemsize"):
        up.submit(dev.ctypes.data, dev.ctypes.data, 64, (64,), (1,), 0)
    with pytest.raises(OverflowError):
        up.submit(-1, dev.ctypes.data, 64, (64,), (1,), 1)
    with pytest.raises(ValueError, match="after"):
        up.fail_next_copy(after=-1)


def test_chunk_sizing_spreads_mid_size_payloads() -> None:
    with contextlib.closing(
        make("upload", lanes=12, slots_per_lane=2, slot_bytes=4 << 20, min_chunk_bytes=256 << 10)
    ) as e:
        assert e.chunk_bytes(8 << 20) < (1 << 20)  # sub-MiB, so every lane starts at once
        assert -(-(8 << 20) // e.chunk_bytes(8 << 20)) == 12
        for size in (64 << 20, 256 << 20):
            chunks = -(-size // e.chunk_bytes(size))
            assert chunks % 12 == 0  # whole rounds: no lane gets a lone extra chunk
            assert e.chunk_bytes(size) <= 4 << 20
        assert e.chunk_bytes(4096) == 256 << 10


# -- the loader -----------------------------------------------------------------------------------------


def test_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_native.ENV_VAR, raising=False)
    assert _native.load() is _engine
    assert _native.status() == "native"
    monkeypatch.setenv(_native.ENV_VAR, "0")
    assert _native.load() is None
    assert _native.status() == "python: FERRY_NATIVE=0"


@pytest.mark.slow
def test_status_says_why_the_extension_is_missing() -> None:
    code = (
        "import sys\n"
        "sys.modules['ferry._native._engine'] = None  # as if it were not built\n"
        "from ferry import _native\n"
        "print(_native.load(), _native.status())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FERRY_NATIVE"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("None python: the extension is not built (ImportError: ")


class _FakeDriver:
    """Just enough of cuda.bindings.driver for cuda_entry_points."""

    class CUdriverProcAddress_flags:  # noqa: N801 - mirrors the bindings' name
        CU_GET_PROC_ADDRESS_DEFAULT = 0

    def __init__(self, missing: str = "", status: bool = True) -> None:
        self.missing = missing
        self.status = status
        self.asked: list[tuple[bytes, int]] = []

    def cuGetProcAddress(self, name: bytes, version: int, flags: int) -> tuple[int, ...]:  # noqa: N802
        self.asked.append((name, version))
        address = 0 if name.decode() == self.missing else 0x1000 + len(self.asked)
        return (0, address, 0) if self.status else (0, address)


def test_cuda_entry_points_with_a_fake_driver() -> None:
    driver = _FakeDriver()
    points = _native.cuda_entry_points(driver)
    assert set(points) == set(_engine.entry_point_names())
    assert all(version >= 12000 for _, version in driver.asked)  # the _v2 ABIs
    assert set(_native.cuda_entry_points(_FakeDriver(status=False))) == set(points)
    assert "cuGetErrorString" not in _native.cuda_entry_points(_FakeDriver(missing="cuGetErrorString"))
    with pytest.raises(RuntimeError, match="cuMemcpyHtoDAsync"):
        _native.cuda_entry_points(_FakeDriver(missing="cuMemcpyHtoDAsync"))


def test_sticky_codes() -> None:
    assert all(_engine.is_sticky(c) for c in (700, 701, 702, 714, 719, 999))
    assert not any(_engine.is_sticky(c) for c in (0, 1, 2, 600, 801))


# -- CUDA mode (a GPU machine) --------------------------------------------------------------------------


@pytest.fixture
def cuda_env() -> Iterator[tuple[Any, Any, dict[str, int]]]:
    from cuda.bindings import driver

    from ferry._backends._cuda import CudaBackend

    backend = CudaBackend(0)
    try:
        yield backend, driver, _native.cuda_entry_points(driver)
    finally:
        backend.close()


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", [1, 1 << 20, (8 << 20) + 3])
def test_cuda_round_trip(cuda_env: tuple[Any, Any, dict[str, int]], nbytes: int) -> None:
    backend, _, entry_points = cuda_env
    kw = {"mode": "cuda", "context": backend._ctx_id, "entry_points": entry_points, "lanes": 4}
    with contextlib.closing(Engine("upload", **kw)) as up, contextlib.closing(Engine("download", **kw)) as down:
        assert len(up.streams()) == 4 and all(up.streams())
        data = pattern(nbytes)
        ptr = backend.mem_alloc(max(nbytes, 512 * 384 * 4))  # room for the strided case below
        try:
            job = up.submit(data.ctypes.data, ptr, nbytes, data.shape, data.strides, 1, hand_off=True)
            assert job.wait(30) and job.error is None, job.error
            out = np.zeros_like(data)
            job = down.submit(out.ctypes.data, ptr, nbytes, out.shape, out.strides, 1)
            assert job.wait(30) and job.error is None, job.error
            assert np.array_equal(out, data)
            strided = np.arange(512 * 384, dtype=np.float32).reshape(512, 384)[::2, 1:].T
            job = up.submit(strided.ctypes.data, ptr, strided.nbytes, strided.shape, strided.strides, 4)
            assert job.wait(30) and job.error is None
            back = np.zeros(strided.shape, strided.dtype)
            job = down.submit(back.ctypes.data, ptr, back.nbytes, back.shape, back.strides, 4)
            assert job.wait(30) and job.error is None
            assert np.array_equal(back, strided)
        finally:
            backend.mem_free(ptr)


@pytest.mark.cuda
def test_cuda_hand_off_by_posted_events(cuda_env: tuple[Any, Any, dict[str, int]]) -> None:
    backend, _, entry_points = cuda_env
    kw = {"mode": "cuda", "context": backend._ctx_id, "entry_points": entry_points, "lanes": 4}
    with contextlib.closing(Engine("upload", **kw)) as up:
        nbytes = 16 << 20
        data = pattern(nbytes)
        ptr = backend.mem_alloc(nbytes)
        copy = backend.mem_alloc(nbytes)
        consumer = backend.stream_create()
        try:
            job = up.submit(data.ctypes.data, ptr, nbytes, data.shape, data.strides, 1, hand_off=True)
            events = job.hand_off(timeout=30)
            assert events is not None and len(events) == job.lanes
            backend.stream_wait_events(consumer, events)
            backend.memcpy_dtod(copy, ptr, nbytes, consumer)  # ordered after the upload on the device
            backend.stream_synchronize(consumer)
            out = np.zeros_like(data)
            backend.memcpy_dtoh(out.ctypes.data, copy, nbytes, consumer)
            backend.stream_synchronize(consumer)
            assert np.array_equal(out, data)
            assert job.wait(30) and job.error is None
        finally:
            backend.stream_destroy(consumer)
            backend.mem_free(copy)
            backend.mem_free(ptr)


def test_the_runtime_runs_a_driver_thread_where_cpus_are_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferry._routes import _native as native_route

    monkeypatch.delenv("FERRY_DRIVER_THREAD", raising=False)
    monkeypatch.setattr(native_route, "usable_cpus", lambda: 16)
    assert native_route.engine_threads(12) == (True, native_route.WAIT_SPIN_US)
    assert native_route.engine_threads(14) == (False, 0.0)  # 14 lanes + 3 > 16 CPUs
    monkeypatch.setattr(native_route, "usable_cpus", lambda: 2)
    assert native_route.engine_threads(2) == (False, 0.0)
    monkeypatch.setenv("FERRY_DRIVER_THREAD", "1")
    assert native_route.engine_threads(2) == (True, native_route.WAIT_SPIN_US)
    monkeypatch.setenv("FERRY_DRIVER_THREAD", "0")
    monkeypatch.setattr(native_route, "usable_cpus", lambda: 64)
    assert native_route.engine_threads(12) == (False, 0.0)


def test_lane_helpers_resolve_where_cpus_are_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    import ferry
    from ferry._routes import _native as native_route
    from ferry._routes._staged import DEFAULT_LANE_HELPERS

    monkeypatch.delenv("FERRY_DRIVER_THREAD", raising=False)
    monkeypatch.setattr(native_route, "usable_cpus", lambda: 16)
    assert ferry.StagingConfig().lane_helper_count() == min(11, DEFAULT_LANE_HELPERS)
    assert ferry.StagingConfig(lanes=3).lane_helper_count() == 2  # at most every lane but the lead
    assert ferry.StagingConfig(lane_helpers=0).lane_helper_count() == 0
    monkeypatch.setattr(native_route, "usable_cpus", lambda: 2)
    assert ferry.StagingConfig().lane_helper_count() == 0  # helpers would take the CPUs the lanes need
    assert ferry.StagingConfig(lanes=3, lane_helpers=2).lane_helper_count() == 2
    for bad in (-2, 12):
        with pytest.raises(ValueError, match="lane_helpers"):
            ferry.StagingConfig(lane_helpers=bad)


@pytest.mark.parametrize("helpers", [0, 2])
@pytest.mark.parametrize("forced", ["0", "1"])
def test_a_runtime_with_either_thread_shape_moves_the_bytes(
    monkeypatch: pytest.MonkeyPatch, forced: str, helpers: int
) -> None:
    import ferry

    monkeypatch.setenv("FERRY_DRIVER_THREAD", forced)
    config = ferry.StagingConfig(
        lanes=3, slot_bytes=256 << 10, direct_bytes=64 << 10, min_chunk_bytes=64 << 10, lane_helpers=helpers
    )
    with ferry.Runtime("emulated", staging=config) as rt:
        info = rt.info()
        if info["staging_engine"] != "native":
            pytest.skip("the runtime does not run the compiled engine here")
        assert ("one driver thread" in info["staging_threads"]) is (forced == "1")
        assert ("shared with up to 2 idle lanes" in info["staging_threads"]) is (helpers == 2)
        data = pattern((3 << 20) + 77)
        data, dev = rt.upload(data).wait()
        back = rt.download(dev).wait()[1]
        assert back.tobytes() == data.tobytes()
        from ferry._runtime import parts_of

        engines = parts_of(rt).staged.engines
        assert engines["upload"].engine.cooperative_jobs == (1 if helpers else 0)
        assert engines["download"].engine.helpers == 0  # downloads are dealt (StagingConfig.lane_helpers)
        strided = data[: (3 << 20)].reshape(3, -1)[:, ::3]  # non-contiguous, chunked along the axes
        strided, sdev = rt.upload(strided).wait()
        assert rt.download(sdev).wait()[1].tobytes() == np.ascontiguousarray(strided).tobytes()


@pytest.mark.parametrize("helpers", [0, LANES - 1])
def test_lanes_sleep_through_long_dmas_and_the_driver_thread_idles_while_held(helpers: int) -> None:
    """DMAs much longer than a lane's awake wait (the emulated copy of a 256 KiB slot at 0.25 GB/s takes
    1 ms): the lanes sleep for the driver thread's answers and every byte arrives. Then, with the engine
    held, neither the lanes nor the driver thread (nor, for a cooperative job, the helpers waiting for its
    lead's next copy) keep a CPU busy: the process's CPU time over a third of a second stays far below it."""
    with contextlib.closing(
        make("upload", bandwidth=0.25e9, latency=0.0, driver_thread=True, helpers=helpers, piece_bytes=16 << 10)
    ) as up:
        data = pattern(4 << 20, 5)
        dev = device_like(data.nbytes)
        job = submit(up, data, dev)
        assert job.wait(60) and job.error is None
        assert dev.tobytes() == data.tobytes()
        up.hold()
        try:
            held = submit(up, pattern(8 << 20, 6), device_like(8 << 20))  # more chunks than the lanes' slots
            import time

            time.sleep(0.05)  # the lanes fill their slots and block; the driver thread polls, then rests
            start = time.process_time()
            time.sleep(0.3)
            busy = time.process_time() - start
            assert not held.done()
        finally:
            up.release()
        assert held.wait(60) and held.error is None
        assert busy < 0.15, f"{busy:.3f} s of CPU in 0.3 s while held: a thread spins"


def test_a_polling_wait_polls_about_its_jobs_expected_time_then_sleeps() -> None:
    """``wait_spin_us`` polls a job until its expected end (its bytes at 16 GB/s after submission,
    at most 5 ms) plus the spin, then sleeps; ``wait(poll=False)`` sleeps at once.

    Observed as the time the waiting thread slept: the wait's wall time less the thread's CPU
    time and the time it waited for a CPU (Linux's schedstat run delay). A loaded machine takes
    the CPU from a poll, which then waits for one, but the poll never sleeps. The engine is held,
    so no job completes while it is waited. A 128 MiB job's expected end is 8.4 ms after its
    submission: a polling wait with a 2 ms timeout polls until the timeout and sleeps not at all,
    while a wait with ``poll=False`` (or one that polled only ``wait_spin_us``, 0.2 ms) sleeps
    most of it. Five of each, and most must show it (a wait that starts over 6 ms after its
    job's submission polls less). A polling wait with a 100 ms timeout sleeps past the job's
    expected end, in the 5 ms slices its Ctrl-C checks take."""

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs the per-thread run delay of /proc/thread-self/schedstat (Linux)")

    def run_delay() -> float:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9

    with contextlib.closing(make("upload", bandwidth=50e9, latency=0.0, wait_spin_us=200)) as up:
        assert up.wait_spin_us == 200
        data = pattern(128 << 20, 9)
        dev = device_like(data.nbytes)
        jobs = []

        def one(timeout: float, poll: bool) -> tuple[float, float, float]:
            """Seconds the wait of a fresh (held) job slept, its wall time and its CPU time."""
            jobs.append(submit(up, data, dev))
            start, cpu, delay = time.perf_counter(), time.thread_time(), run_delay()
            assert jobs[-1].wait(timeout, poll=poll) is False  # held: not done
            wall, cpu, delay = time.perf_counter() - start, time.thread_time() - cpu, run_delay() - delay
            return wall - cpu - delay, wall, cpu

        up.hold()
        try:
            polled = [one(0.002, True)[0] for _ in range(5)]
            slept = [one(0.002, False)[0] for _ in range(5)]
            long_asleep, long_wall, long_cpu = one(0.1, True)
        finally:
            up.release()
        assert all(job.wait(60) and job.error is None for job in jobs)
        assert dev.tobytes() == data.tobytes()
    assert sum(s < 0.5e-3 for s in polled) >= 3, f"polling waits of 2 ms slept {polled} s: no poll to the expected end"
    assert sum(s > 1e-3 for s in slept) >= 3, f"waits of 2 ms with poll=False slept {slept} s: they polled"
    assert long_asleep > 0.01, f"a polling wait of 100 ms slept {long_asleep:.4f} s: it polled past the expected end"
    assert long_cpu < 0.3 * long_wall, f"{long_cpu:.4f} s of CPU in a {long_wall:.3f} s wait: the wait polled it all"


_ABANDON = """
import gc, os, sys
from ferry._native import _engine
def threads():
    return len(os.listdir("/proc/self/task"))
base = threads()
kept = _engine.Engine("upload", mode="emulated", lanes=3, slots_per_lane=2, slot_bytes=1 << 16)
closed = _engine.Engine("upload", mode="emulated", lanes=3, slots_per_lane=2, slot_bytes=1 << 16)
started = threads()
kept.abandon()
try:
    kept.streams()
except RuntimeError as exc:
    print("refused:", exc)
del closed  # its dealloc closes it: every lane (and its stream worker) joined
gc.collect()
after_close = threads()
del kept  # abandoned: its dealloc joins nothing and frees nothing
gc.collect()
print(started - base, started - after_close, threads() - after_close)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_an_engine_abandoned_at_exit_refuses_calls_and_its_dealloc_leaves_its_lanes() -> None:
    out = subprocess.run([sys.executable, "-c", _ABANDON], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    refused, counts = out.stdout.strip().splitlines()
    assert refused == "refused: this staging engine was left at interpreter exit; it cannot be used"
    started, closed, left = (int(x) for x in counts.split())
    assert started > 0 and closed == started // 2  # the closed engine's threads ended
    assert left == 0  # the abandoned engine's threads were not joined (a lane's slot free could wait forever)
