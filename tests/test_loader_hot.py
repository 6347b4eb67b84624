"""ferry.DataLoader's per-batch path in the main process: one group upload per slot, layouts decoded once,
waits that sleep, and refusals that keep every slot's protocol.

Datasets are defined at module level so that spawn workers can import them.
"""

from __future__ import annotations

import contextlib
import gc
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import eventually
from ferry import testing
from ferry._errors import TransferSubmitError
from ferry._loader import _dataloader
from ferry._loader._upload import upload_views
from ferry._runtime import parts_of
from ferry._state import OWNED
from test_loader import _Baseline, _host

pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")


@pytest.fixture
def leaks(rt: ferry.Runtime) -> Any:
    baseline = _Baseline(rt)
    yield baseline
    baseline.check()


class Growing:
    """Sample i: an array whose length grows every 4 samples (so each batch of 4 has its own layout), the
    int i, and a name: string leaves differ in every batch."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int) -> Any:
        return np.arange(1 + i // 4, dtype=np.float32) + i, i, f"n{i}"


class Pairs:
    """Sample i: 1 KiB of float32 holding i, and the int i."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        return np.full(256, i, np.float32), i


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_whose_layout_changes_are_each_right(rt: ferry.Runtime, leaks: _Baseline, workers: int) -> None:
    """Every layout a worker sends is decoded (the slot's views kept per layout); the batches after a
    change, and the short last one, hold their own shapes and values."""
    with ferry.DataLoader(Growing(), batch_size=4, num_workers=workers, runtime=rt,
                          persistent_workers=workers > 0) as loader:
        for _ in range(2):
            seen = 0
            for k, (x, index, names) in enumerate(loader):
                start = 4 * k
                count = min(4, 22 - start)
                host = _host(rt, x)
                assert host.shape == (count, 1 + k), (k, host.shape)  # samples of one batch share i // 4 == k
                expected = np.arange(1 + k, dtype=np.float32)[None, :] + np.arange(start, start + count)[:, None]
                np.testing.assert_array_equal(host, expected)
                np.testing.assert_array_equal(_host(rt, index), np.arange(start, start + count))
                assert names == tuple(f"n{i}" for i in range(start, start + count))  # as PyTorch collates them
                seen += count
            assert seen == 22
        # the ring was sized from the first batch; the larger later ones took the fallback
        assert loader.fallback_batches >= 1


def test_each_slot_batch_is_one_submission(rt: ferry.Runtime, leaks: _Baseline) -> None:
    """A batch in a slot is one record (every leaf one DMA behind one event), not one per leaf."""
    before = rt.stats().submitted
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=2, runtime=rt) as loader:
        for k, (x, y) in enumerate(loader):
            assert _host(rt, x)[:, 0].tolist() == list(range(4 * k, 4 * k + 4))
            assert _host(rt, y).tolist() == list(range(4 * k, 4 * k + 4))
        assert loader.fallback_batches == 1
    batches = len(Pairs()) // 4
    # the first batch (it sized the ring) leaf by leaf: two; each later one: one; the checks' downloads: two each
    assert rt.stats().submitted - before == 2 + (batches - 1) + 2 * batches


def test_the_loader_s_backpressure_sleeps_on_blocking_events(rt: ferry.Runtime, leaks: _Baseline,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer stream far behind holds the host back; the host's wait for it is a blocking-sync one
    (it sleeps: the main thread's CPU stays with the consumer's own work)."""
    if rt.backend != "emulated":
        pytest.skip("the consumer's work is the emulated device's")
    backend = testing.backend_of(rt)
    flags: dict[int, bool] = {}
    synchronized: list[int] = []
    create, synchronize = backend.event_create, backend.event_synchronize

    def spy_create(blocking: bool = False) -> Any:
        event = create(blocking)
        flags[id(event)] = blocking
        return event

    def spy_synchronize(event: Any) -> None:
        synchronized.append(id(event))
        synchronize(event)

    monkeypatch.setattr(backend, "event_create", spy_create)
    monkeypatch.setattr(backend, "event_synchronize", spy_synchronize)
    consumer = testing.side_stream(rt)
    scratch = rt.empty((1024,), np.uint8)
    with ferry.DataLoader(Pairs(), batch_size=2, num_workers=1, runtime=rt, stream=consumer, depth=1) as loader:
        for _ in loader:
            testing.produce(rt, consumer, scratch.ptr, scratch.nbytes, 1, delay=0.01)  # the consumer is slow
    backend.stream_synchronize(backend.stream_from_handle(consumer))
    scratch.close()
    assert synchronized, "the host was never held back"
    assert all(flags.get(event) for event in synchronized)


def test_a_refused_slot_upload_fails_its_batch_and_frees_its_slot(rt: ferry.Runtime, leaks: _Baseline,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot batch whose upload is refused is raised at its index (PrefetchError, the refusal its cause);
    nothing of it stays in flight and the loader still closes clean."""
    calls = []
    original = upload_views

    def refuse_third(*args: Any) -> Any:
        calls.append(threading.get_ident())
        if len(calls) == 3:
            raise TransferSubmitError("refused for the test")
        return original(*args)

    monkeypatch.setattr(_dataloader, "upload_views", refuse_third)
    got = []
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=2, runtime=rt) as loader, \
            pytest.raises(ferry.PrefetchError) as info:
        for x, _ in loader:
            got.append(int(_host(rt, x)[0, 0]))
    assert info.value.index == 3  # the first batch came back as arrays: the third slot batch is batch 3
    assert isinstance(info.value.__cause__, TransferSubmitError)
    assert got == [0, 4, 8]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_workers_load_the_batch_sampler_s_batches(rt: ferry.Runtime, leaks: _Baseline, shuffle: bool,
                                                  drop_last: bool) -> None:
    """The indices the workers are given (ranges, or slices of the permutation) are exactly the batches
    the loader's batch_sampler yields, epoch after epoch."""
    seeded = [np.random.default_rng(7), np.random.default_rng(7)]
    loader = ferry.DataLoader(Pairs(), batch_size=5, shuffle=shuffle, drop_last=drop_last, num_workers=2,
                              runtime=rt, generator=seeded[0], persistent_workers=True)
    twin = ferry.DataLoader(Pairs(), batch_size=5, shuffle=shuffle, drop_last=drop_last, generator=seeded[1])
    with loader:
        for _ in range(2):
            seeded[1].integers(0, 2**62)  # the base seed each epoch draws first
            expected = [list(batch) for batch in twin.batch_sampler]  # type: ignore[union-attr]
            got = [_host(rt, y).tolist() for _, y in loader]
            assert got == expected
            assert len(got) == (6 if drop_last else 7)
    twin.close()


class Blocks:
    """Sample i: 64 KiB of float32 holding i."""

    def __len__(self) -> int:
        return 160

    def __getitem__(self, i: int) -> Any:
        return np.full(16384, i, np.float32)


def test_device_memory_stays_with_the_batches_alive(rt: ferry.Runtime, leaks: _Baseline) -> None:
    """A batch's device memory is let go once the consumer drops it and its copies are proven complete:
    nothing of the loader (its slots' bookkeeping included) keeps the batches before it alive."""
    batch = 4 * 16384 * 4
    peak = 0
    with ferry.DataLoader(Blocks(), batch_size=4, num_workers=2, prefetch_factor=8, depth=2, runtime=rt) as loader:
        for k, x in enumerate(loader):
            if k >= 4:  # past the first batches (the ring is sized, the pool warm)
                peak = max(peak, rt.stats().device_bytes)
            del x
    # depth + 1 uploading ahead, the one just yielded, and those dropped whose frees wait for the device
    # (the copies of 8 x 2 slots in the ring are far more)
    assert peak <= 8 * batch, peak // batch


def test_a_slot_copy_the_device_refuses_fails_its_batch_and_closes_its_arrays(
        rt: ferry.Runtime, leaks: _Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device refusing a slot batch's copy (nothing enqueued) fails that batch at its index; the device
    arrays made for it are closed (the leak baseline: no device memory kept), the others are right."""
    from ferry._backends._base import DeviceError

    backend = testing.backend_of(rt)
    original = backend.copy_batch
    calls = []

    def refuse_third(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise DeviceError("refused for the test")
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, "copy_batch", refuse_third)
    got = []
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=2, runtime=rt) as loader, \
            pytest.raises(ferry.PrefetchError) as info:
        for x, y in loader:
            got.append((int(_host(rt, x)[0, 0]), _host(rt, y).tolist()))
    assert len(calls) >= 3
    assert info.value.index == 3
    assert isinstance(info.value.__cause__, TransferSubmitError)
    assert got == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9, 10, 11])]


def test_a_slot_batch_handed_to_a_stream_is_freed_after_that_stream_s_work(rt: ferry.Runtime,
                                                                            leaks: _Baseline) -> None:
    """Every leaf of a slot batch handed to the consumer's stream is owned at once, and the device memory
    they share notes that stream: its free waits for the consumer's work on any of the leaves."""
    consumer = testing.side_stream(rt)
    seen = 0
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=1, runtime=rt, stream=consumer) as loader:
        for k, (x, y) in enumerate(loader):
            assert x.state == "owned" and y.state == "owned"
            assert _host(rt, y).tolist() == list(range(4 * k, 4 * k + 4))
            if k == 0:
                continue  # the first batch came back as arrays (the ring is sized from it)
            slab = y._memory
            assert slab is x._memory  # one allocation for the batch
            users = slab.memory.users[slab._ptr]
            assert consumer in users.streams
            seen += 1
    backend = testing.backend_of(rt)
    backend.stream_synchronize(backend.stream_from_handle(consumer))
    assert seen == 7


def test_dropped_batches_lend_their_device_memory_to_the_next_ones(rt: ferry.Runtime, leaks: _Baseline,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the consumer dropped a slot batch its device memory serves a later batch: over two epochs of
    8 batches each, the allocations stay bounded by the batches alive at once, and every batch is right."""
    memory = parts_of(rt).memory
    original = memory.alloc
    sizes: list[int] = []

    def counted(nbytes: int) -> int:
        sizes.append(nbytes)
        return original(nbytes)

    monkeypatch.setattr(memory, "alloc", counted)
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=2, runtime=rt, persistent_workers=True,
                          depth=2) as loader:
        for _ in range(2):
            for k, (x, y) in enumerate(loader):
                assert _host(rt, x)[:, 0].tolist() == list(range(4 * k, 4 * k + 4))
                assert _host(rt, y).tolist() == list(range(4 * k, 4 * k + 4))
                del x, y
    slab_allocations = [n for n in sizes if n >= 4 * 1024]  # the slot batches' slabs (4 KiB of float32 and more)
    assert 1 <= len(slab_allocations) <= 6, slab_allocations  # depth + 1 alive, a spare: not one per batch (15)


def test_reused_device_memory_is_copied_into_only_after_the_consumer_s_work_on_it(
        rt: ferry.Runtime, leaks: _Baseline) -> None:
    """The consumer's stream still writes into a batch it dropped (slowly): the later batch that reuses its
    memory is copied in after that work, on the device, so it holds its own values."""
    if rt.backend != "emulated":
        pytest.skip("testing.produce simulates the consumer's late writes on the emulated device only")
    consumer = testing.side_stream(rt)
    got = []
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=1, runtime=rt, stream=consumer, depth=1) as loader:
        for x, y in loader:
            got.append(_host(rt, y).tolist() + _host(rt, x)[:, 0].tolist())
            testing.produce(rt, consumer, x._ptr, x.nbytes, 0xFF, delay=0.02)  # the consumer's late write
            testing.produce(rt, consumer, y._ptr, y.nbytes, 0xFF, delay=0.0)
            del x, y
    backend = testing.backend_of(rt)
    backend.stream_synchronize(backend.stream_from_handle(consumer))
    assert got == [list(range(4 * k, 4 * k + 4)) * 2 for k in range(8)]


def test_a_runtime_closed_under_a_loader_frees_the_device_memory_it_kept() -> None:
    """Batches dropped (their memory kept for reuse), then the runtime closed before the loader: the
    runtime's close frees that memory, and closing the loader afterwards is clean."""
    rt = ferry.Runtime("emulated")
    loader = ferry.DataLoader(Pairs(), batch_size=4, num_workers=1, runtime=rt, persistent_workers=True)
    seen = [_host(rt, y).tolist() for _, y in loader]
    assert seen == [list(range(4 * k, 4 * k + 4)) for k in range(8)]
    engine = loader._engine
    assert engine is not None and engine.device_ring.nbytes > 0  # dropped batches' memory, kept
    rt.close()
    assert rt.stats().device_bytes == 0
    loader.close()
    assert engine.device_ring.nbytes == 0


def test_the_main_process_s_pipe_framing_is_multiprocessing_s() -> None:
    """What the main process writes to a worker reads back with ``Connection.recv_bytes``, and what a worker
    sends (small, or large enough to be written in several pieces) reads back whole, in order; a closed pipe
    is EOFError."""
    import multiprocessing

    reader, writer = multiprocessing.Pipe(duplex=False)
    payloads = [b"", b"task", bytes(range(256)) * 3]
    for payload in payloads:
        _dataloader._send(writer.fileno(), payload)
    assert [reader.recv_bytes() for _ in payloads] == payloads

    big = np.arange(300_000, dtype=np.uint8).tobytes()  # over a pipe's buffer: read while it is written
    frames = _dataloader._Frames()
    sender = threading.Thread(target=lambda: [writer.send_bytes(p) for p in (b"x", big, b"")])
    sender.start()
    got: list[bytes] = []
    while len(got) < 3:
        got += frames.read(reader.fileno())
    sender.join()
    assert got == [b"x", big, b""]
    writer.close()
    with pytest.raises(EOFError):
        frames.read(reader.fileno())
    reader.close()


def test_one_read_takes_every_message_waiting_and_keeps_a_partial_one() -> None:
    """Messages that arrived together come out of one read, in order; one cut anywhere (in its header, in
    a long message's 8-byte length, in its bytes) comes out whole once the rest arrived."""
    import os
    import struct

    messages = [b"a", b"", bytes(range(200)), b"q" * 5000]
    stream = b"".join(struct.pack("!i", len(m)) + m for m in messages)
    stream += struct.pack("!i", -1) + struct.pack("!Q", 7) + b"longlen"  # the 64-bit length form
    expected = [*messages, b"longlen"]
    for cut in (1, 3, 4, 6, 205, 5000, len(stream) - 9, len(stream) - 1):
        r, w = os.pipe()
        try:
            frames = _dataloader._Frames()
            os.write(w, stream[:cut])
            got = frames.read(r)
            os.write(w, stream[cut:])
            got += frames.read(r)
            assert got == expected, cut
            assert not frames.rest and frames.need == 0
        finally:
            os.close(r)
            os.close(w)
    r, w = os.pipe()
    try:
        os.write(w, stream)
        assert _dataloader._Frames().read(r) == expected  # all of it in one read
    finally:
        os.close(r)
        os.close(w)


class Images:
    """Sample i: a 3x8x8 float32 image holding i, and the int i."""

    def __len__(self) -> int:
        return 64 * 12

    def __getitem__(self, i: int) -> Any:
        return np.full((3, 8, 8), i, np.float32), i


def test_on_the_cuda_backend_a_slot_batch_makes_no_device_allocation_once_batches_were_dropped(
        stand_in: Any) -> None:
    """The CUDA backend (a stand-in libcuda that copies inside each call): after the first batches, a slot
    batch allocates and frees no device memory, and every batch holds its own values."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from ferry import _native

    if _native.load() is None:
        pytest.skip("needs the compiled extension")
    code = textwrap.dedent("""
        import collections
        import json
        import numpy as np
        import ferry
        from ferry import testing
        from test_loader_hot import Images

        rt = ferry.Runtime("cuda")
        assert rt.info()["backend"] == "cuda"
        backend = testing.backend_of(rt)
        calls = collections.Counter()
        for name in ("mem_alloc", "mem_free", "mem_pool_alloc", "mem_free_async"):
            original = getattr(backend, name)
            def counted(*args, _name=name, _original=original):
                calls[_name] += 1
                return _original(*args)
            setattr(backend, name, counted)
        consumer = testing.side_stream(rt)
        loader = ferry.DataLoader(Images(), batch_size=64, num_workers=2, runtime=rt, stream=consumer,
                                  persistent_workers=True)
        for epoch in range(2):
            if epoch == 1:
                calls.clear()
            for k, (x, y) in enumerate(loader):
                assert rt.to_host(y).tolist() == list(range(64 * k, 64 * k + 64))
                assert (rt.to_host(x)[:, 0, 0, 0] == np.arange(64 * k, 64 * k + 64)).all()
                del x, y
        print(json.dumps(dict(calls)))
        loader.close()
        rt.close()
    """)
    env = dict(os.environ, LD_LIBRARY_PATH=str(stand_in),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), *sys.path]))
    env.pop("FERRY_NATIVE", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = json.loads(result.stdout.strip().splitlines()[-1])
    assert sum(calls.values()) <= 2, calls  # the second epoch's 12 batches: no allocation or free per batch


def test_tasks_read_back_as_they_were_given() -> None:
    """A task (range indices, packed int64 bytes, a list, no indices at all; a slot or none) reads back
    in the worker as the main process gave it, and the end of the workers (None) too."""
    from ferry._loader._worker import decode_task, encode_task

    packed = np.array([5, 3, 2**40], np.int64).tobytes()
    cases = [
        (0, 7, range(8, 12), False, 3, 4096, 10),
        (2, 9, packed, True, None, 8192, 12),
        (1, 0, [4, 1, 9], False, 0, 4096, 10),
        (3, 5, None, False, 2, 4096, 10),
        (0, 1, range(0, 10, 2), False, 1, 4096, 10),  # a step: not the packed form, still read back
    ]
    for task in cases:
        assert decode_task(encode_task(*task)) == task
    assert encode_task(*cases[0])[:1] == b"T" and encode_task(*cases[1])[:1] == b"T"
    import pickle

    assert decode_task(pickle.dumps(None)) is None


class SlowFromFour:
    """Sample i: 64 float32 holding i, and i; the samples of batch 4 on take 0.05 s each to load."""

    def __len__(self) -> int:
        return 14

    def __getitem__(self, i: int) -> Any:
        if i >= 8:
            time.sleep(0.05)
        return np.full(64, i, np.float32), i


def test_a_wait_for_a_worker_sleeps_until_its_message_while_the_ring_s_copies_run(
        rt: ferry.Runtime, leaks: _Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots in use (copies held on the device), workers busy with their batches: the main process waits
    for the next batch in one sleep on the pipes. It wakes every millisecond only while a worker could
    start a batch but no slot is free (then a completing copy frees one), never merely because every
    slot is in use; every batch still comes, right and in order."""
    polls: list[tuple[int, bool]] = []  # (timeout, whether a worker was waiting for a slot)
    real = select.poll
    receive = _dataloader._Engine._receive
    starved: list[bool] = []

    class Poll:
        def __init__(self) -> None:
            self._poll = real()

        def register(self, *args: Any) -> None:
            self._poll.register(*args)

        def unregister(self, fd: int) -> None:
            self._poll.unregister(fd)

        def poll(self, timeout: int) -> Any:
            polls.append((timeout, starved[-1]))
            return self._poll.poll(timeout)

    def watched(self: Any, state: Any, deadline: float | None = None) -> None:
        starved.append(state.starved)
        receive(self, state, deadline)

    monkeypatch.setattr(_dataloader.select, "poll", Poll)
    monkeypatch.setattr(_dataloader._Engine, "_receive", watched)
    held = testing.hold(rt, "upload")
    with ferry.DataLoader(SlowFromFour(), batch_size=2, num_workers=1, prefetch_factor=2, depth=1, runtime=rt,
                          multiprocessing_context="fork") as loader:
        it = iter(loader)
        held.__enter__()  # no copy completes: the ring's slots stay in flight
        timer = threading.Timer(0.6, held.__exit__, (None, None, None))
        timer.start()
        try:
            batches = [x for x, _ in it]  # (read after: a download would wait for the held upload)
        finally:
            timer.join()
        got = [int(rt.to_host(x)[0, 0]) for x in batches]
        del batches
    assert got == list(range(0, 14, 2))
    assert polls and all(timeout == 1000 or waiting for timeout, waiting in polls), polls
    assert sum(1 for timeout, _ in polls if timeout == 1000) >= 2  # it did wait for the slow batches

def test_a_copy_that_fails_on_the_device_is_raised_at_its_batch_with_workers(rt: ferry.Runtime) -> None:
    """Slot batches from workers: a copy that fails on the device after its batch was handed over makes
    that batch's arrays unreadable (TransferFailedError) and the next step raise PrefetchError naming that
    batch; the batches before it were right, the epoch ends, and the loader closes."""
    if rt.backend != "emulated":
        pytest.skip("fault injection needs the emulated device")
    loader = ferry.DataLoader(Pairs(), batch_size=4, num_workers=2, runtime=rt, persistent_workers=True)
    got = []
    batches = iter(loader)
    for _ in range(3):
        x, _ = next(batches)
        got.append(int(_host(rt, x)[0, 0]))
        del x
    testing.fail_next_copy(rt)
    unreadable = []
    with pytest.raises(ferry.PrefetchError) as info:
        for k, (x, _) in enumerate(batches, start=3):
            try:
                got.append(int(_host(rt, x)[0, 0]))
            except ferry.TransferFailedError:
                unreadable.append(k)
            del x
    assert got == [4 * i for i in range(len(got))]
    assert info.value.index == len(got) and unreadable in ([], [len(got)])
    with pytest.raises(StopIteration):
        next(batches)
    loader.close()
    assert loader.ring_bytes == 0


def test_a_batch_whose_copies_completed_before_its_turn_is_handed_over_settled(rt: ferry.Runtime,
                                                                                 leaks: _Baseline) -> None:
    """A consumer slower than the copies: each slot batch reaches it with its copies already proven
    complete (its arrays owned, tied to no pending copy), still right; the consumer's stream is noted on
    the batch's memory, so a later batch copied into it waits for the consumer's work (the device ring
    keeps and reuses it), and nothing is left in flight."""
    stream = testing.side_stream(rt)
    settled = []
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=2, runtime=rt, stream=stream) as loader:
        for k, (x, y) in enumerate(loader):
            settled.append(x._ready is None and x._state is OWNED and y._ready is None)
            assert int(_host(rt, x)[0, 0]) == 4 * k and int(_host(rt, y)[0]) == 4 * k
            del x, y
            # the consumer's step, long enough for the copies already issued to complete
            assert eventually(lambda: all(h.is_ready() for _, handles in loader._engine.inflight  # type: ignore[union-attr]
                                          for h in handles))
    assert len(settled) == 8
    assert all(settled[2:]), settled  # (the first ones may still be copying when they are handed over)


def test_a_slot_upload_after_the_ring_was_unpinned_is_refused_cleanly(rt: ferry.Runtime) -> None:
    """A slot's registration is kept between its batches; once the ring was unpinned, the next upload from
    that slot is refused (TransferSubmitError), nothing of it enqueued or left allocated, its views
    untouched; an upload before that one went through the kept registration as the first did."""
    with _one_slot(rt) as (views, device_ring):
        _fill(views)
        for _ in range(2):
            handle = upload_views(rt, views, device_ring)
            _, devices = handle.wait()
            assert views.reg is not None and views.reg.active
            assert np.array_equal(rt.to_host(devices[0]), views.leaves[0])
            assert rt.to_host(devices[1]).tolist() == [7, 8, 9, 10]
            del devices, handle
        before = rt.stats()
        registration = views.reg
        registration.release()  # the ring unpinned (as a stopping loader does)
        with pytest.raises(TransferSubmitError, match="no longer registered"):
            upload_views(rt, views, device_ring)
        after = rt.stats()
        assert after.in_flight == before.in_flight and after.submitted == before.submitted
        assert after.device_bytes == before.device_bytes
        assert views.reg is registration and not registration.active
        assert views.leaves[1].tolist() == [7, 8, 9, 10]


@pytest.mark.parametrize("reused", [False, True], ids=["fresh slab", "reused slab"])
def test_a_slot_upload_whose_views_fail_partway_leaks_no_device_memory(rt: ferry.Runtime, reused: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """No memory for a slot batch's second device view: the upload raises MemoryError; a fresh slab's
    allocation is given back, a slab lent by the device ring goes back to the ring (and is freed with it),
    and the next upload from the slot is right."""
    from ferry._loader import _upload

    with _one_slot(rt) as (views, device_ring):
        _fill(views)
        gc.collect()
        before = rt.stats().device_bytes
        if reused:  # a batch dropped: its slab kept by the device ring for the next one
            handle = upload_views(rt, views, device_ring)
            handle.wait()
            del handle
            gc.collect()
            assert [slab.kept for slab in device_ring.kept] == [True]
        real, calls = _upload.new_view, [0]

        def failing(*args: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError("out of memory (injected)")
            return real(*args)

        monkeypatch.setattr(_upload, "new_view", failing)
        with pytest.raises(MemoryError):
            upload_views(rt, views, device_ring)
        monkeypatch.undo()
        gc.collect()
        held = rt.stats().device_bytes - before
        if reused:
            assert [slab.kept for slab in device_ring.kept] == [True]  # back in the ring, lent to no one
            assert held == device_ring.kept[0]._nbytes
        else:
            assert held == 0 and not device_ring.kept
        _, devices = upload_views(rt, views, device_ring).wait()
        assert np.array_equal(rt.to_host(devices[0]), views.leaves[0])
        assert rt.to_host(devices[1]).tolist() == [7, 8, 9, 10]
        del devices, views
    gc.collect()
    assert rt.stats().device_bytes == before


def test_waiting_for_a_slot_sleeps_until_the_oldest_copy_completes(rt: ferry.Runtime, leaks: _Baseline,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No slot free and no batch loading: the main process sleeps until the oldest copy reading the ring
    completes (woken by the runtime's watcher, not by polling), then that slot goes back and the epoch
    goes on, every batch right."""
    with ferry.DataLoader(Pairs(), batch_size=4, num_workers=0, runtime=rt) as loader:
        batches = iter(loader)
        first = [int(_host(rt, next(batches)[0])[0, 0]) for _ in range(2)]
        engine = loader._engine
        assert engine is not None
        held = testing.hold(rt, "upload")
        held.__enter__()
        try:
            slot = engine.table.take(0, 999)  # a slot in flight behind a copy that cannot complete yet
            assert slot is not None
            engine.table.filled(slot, 0, 999)
            engine.table.issued(slot, 999)
            handle = rt.upload(np.ones(1 << 16, np.uint8))
            engine.inflight.appendleft((slot, [handle]))
            asked = []
            is_ready = type(handle).is_ready

            def counted(self: Any) -> bool:
                asked.append(threading.get_ident())
                return bool(is_ready(self))

            monkeypatch.setattr(type(handle), "is_ready", counted)
            waiter = threading.Thread(target=engine._wait_for_slot)
            waiter.start()
            waiter.join(0.3)
            assert waiter.is_alive()  # asleep: the copy cannot complete while held
            assert len([t for t in asked if t == waiter.ident]) <= 1  # asked once, not polled
        finally:
            held.__exit__(None, None, None)
        waiter.join(10)
        assert not waiter.is_alive()
        assert handle.is_ready()
        engine._reclaim()
        assert engine.table.state(slot)[0] == "free"
        del handle
        rest = [int(_host(rt, x)[0, 0]) for x, _ in batches]
    assert first + rest == list(range(0, 32, 4))


@contextlib.contextmanager
def _one_slot(rt: ferry.Runtime) -> Iterator[tuple[Any, Any]]:
    """A two-slot ring, the views of its slot 1 for a (4 x 8 float32, 4 int64) layout and a device ring:
    ``(views, device_ring)``; all released after."""
    from ferry._loader._dataloader import _Plan
    from ferry._loader._upload import DeviceRing
    from ferry._memory._ring import Ring

    ring = Ring(rt)
    ring.size(1 << 16, 2)
    plan = _Plan((("l", [("a", 0), ("a", 1)]), [("float32", (4, 8), 0), ("int64", (4,), 256)]))
    views = plan.slot(ring, 1)
    device_ring = DeviceRing()
    try:
        yield views, device_ring
    finally:
        device_ring.close(parts_of(rt).memory, parts_of(rt).lock)
        del views
        plan.views.clear()
        ring.release(timeout=1.0)


def _fill(views: Any) -> None:
    """The slot's leaves: arange(32) as 4 x 8, and 7 to 10."""
    views.leaves[0][...] = np.arange(32, dtype=np.float32).reshape(4, 8)
    views.leaves[1][...] = [7, 8, 9, 10]


def _nothing_held(rt: ferry.Runtime, views: Any) -> bool:
    """The slot's leaves leased by no transfer (writeable again) and its registration used by none."""
    leases = parts_of(rt).host.direct.leases
    return (not leases.leased() and views.reg._uses == 0
            and all(leaf.flags.writeable for leaf in views.leaves))


def _taken_when_done(completion: Any, handle: Any) -> Any:
    """What take_if_done returns once it returns something (asked until then)."""
    from ferry._loader._upload import take_if_done

    taken: list[Any] = []
    assert eventually(lambda: taken.append(take_if_done(completion, handle)) or taken[-1] is not None)
    return taken[-1]


def test_a_slot_batch_is_taken_settled_once_its_copies_completed_and_only_then(rt: ferry.Runtime) -> None:
    """take_if_done: None while the batch's copies run (nothing settled, the handle still pending); once they
    completed, the batch's device arrays (right, owned, tied to no copy), the handle waited (a wait() raises),
    the leaves' leases and the registration use ended; the next batch from the same slot does the same."""
    from ferry._errors import FerryError
    from ferry._loader._upload import take_if_done

    completion = parts_of(rt).completion
    with _one_slot(rt) as (views, device_ring):
        for k in range(3):
            views.leaves[0][...] = np.arange(32, dtype=np.float32).reshape(4, 8) + k
            views.leaves[1][...] = [k, k + 1, k + 2, k + 3]
            with testing.hold(rt, "upload"):
                handle = upload_views(rt, views, device_ring)
                assert take_if_done(completion, handle) is None
                assert not handle._waited and rt.stats().in_flight == 1
                assert not views.leaves[0].flags.writeable  # leased while the copy reads it
            x, y = _taken_when_done(completion, handle)
            assert x._state is OWNED and y._state is OWNED and x._ready is None and y._ready is None
            assert np.array_equal(rt.to_host(x), np.arange(32, dtype=np.float32).reshape(4, 8) + k)
            assert rt.to_host(y).tolist() == [k, k + 1, k + 2, k + 3]
            assert handle.is_ready() and rt.stats().in_flight == 0
            with pytest.raises(FerryError, match="already waited"):
                handle.wait()
            assert _nothing_held(rt, views)
            del x, y, handle


def test_a_slot_batch_handed_off_before_its_copies_completed_forgets_them_once_settled(rt: ferry.Runtime) -> None:
    """hand_off_slot while the copies run: every array is owned at once, tied to the batch's copies (a
    close() is refused until they completed); once the batch is waited they are tied to nothing, right,
    and the leases and the registration use ended."""
    from ferry._loader._upload import hand_off_slot

    completion = parts_of(rt).completion
    stream = testing.side_stream(rt)
    with _one_slot(rt) as (views, device_ring):
        views.leaves[0][...] = np.arange(32, dtype=np.float32).reshape(4, 8)
        views.leaves[1][...] = [7, 8, 9, 10]
        with testing.hold(rt, "upload"):
            handle = upload_views(rt, views, device_ring)
            x, y = hand_off_slot(completion, handle, stream)
            assert x._state is OWNED and y._state is OWNED
            assert x._ready is handle._record and y._ready is handle._record
            with pytest.raises(ferry.BufferMovedError):
                x.close()
        handle.wait()
        assert x._ready is None and y._ready is None
        assert np.array_equal(rt.to_host(x), views.leaves[0]) and rt.to_host(y).tolist() == [7, 8, 9, 10]
        assert _nothing_held(rt, views)
        backend = testing.backend_of(rt)
        backend.stream_synchronize(backend.stream_from_handle(stream))
        del x, y, handle


@pytest.mark.parametrize("workers", [0, 2])
def test_slot_batches_taken_inside_a_runtime_batch_are_right(rt: ferry.Runtime, leaks: _Baseline,
                                                             workers: int) -> None:
    """A loader iterated inside ``rt.batch()`` (its slot uploads join the block's batch, one shared event):
    every batch right and in order, nothing left leased or in flight."""
    got = []
    with rt.batch(), ferry.DataLoader(Pairs(), batch_size=4, num_workers=workers, runtime=rt) as loader:
        for x, y in loader:
            got.append((int(_host(rt, x)[0, 0]), _host(rt, y).tolist()))
            del x, y
    assert got == [(4 * k, [4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3]) for k in range(8)]
    assert not parts_of(rt).host.direct.leases.leased()
