"""Waiting the Python way: futures, callbacks, await, wait_all, as_completed; on every backend."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import numpy as np
import pytest

import ferry
from ferry import testing


def test_a_future_resolves_with_what_wait_returns(rt: ferry.Runtime) -> None:
    data = np.arange(50_000, dtype=np.float64)
    dev = rt.to_device(data)
    buf = rt.pinned(data.nbytes)
    pending = rt.download_pending(dev, buf)
    future = pending.future()
    assert pending.future() is future
    source, got = future.result(timeout=30)
    assert source is dev and got is buf
    assert np.array_equal(buf.as_array(np.float64), data)
    assert pending.wait() == (source, got)  # the same result, once
    with pytest.raises(ferry.FerryError, match="already waited"):
        pending.wait()


def test_done_callbacks_receive_the_handle(rt: ferry.Runtime) -> None:
    seen: list[object] = []
    done = threading.Event()

    def callback(handle: object) -> None:
        seen.append(handle)
        done.set()

    pending = rt.upload_pending(rt.pinned(4096), rt.empty(4096, np.uint8))
    pending.add_done_callback(callback)
    assert done.wait(30)
    assert seen == [pending]
    buf, dev = pending.wait()
    assert buf.state == "owned" and dev.state == "owned"
    late: list[object] = []
    other = rt.upload_pending(rt.pinned(8), rt.empty(8, np.uint8))
    other.wait()
    with pytest.raises(ferry.FerryError, match="already waited"):
        other.add_done_callback(late.append)


def test_await_in_asyncio(rt: ferry.Runtime) -> None:
    data = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)

    async def main() -> np.ndarray:
        _, dev = await rt.upload(data)
        _, out = await rt.download(dev)
        return out

    assert np.array_equal(asyncio.run(main()), data)


def test_a_failed_transfer_raises_in_the_awaiting_task(emu: ferry.Runtime) -> None:
    testing.fail_next_copy(emu)
    pending = emu.upload_pending(emu.pinned(64), emu.empty(64, np.uint8))

    async def main() -> None:
        await pending

    with pytest.raises(ferry.TransferFailedError):
        asyncio.run(main())
    with pytest.raises(ferry.TransferFailedError):
        pending.wait()


def test_cancelling_an_awaiting_task_never_cancels_or_frees_the_copy(rt: ferry.Runtime) -> None:
    buf = rt.pinned(1 << 20)
    alive = weakref.ref(buf)

    async def main(buf: ferry.PinnedHostBuffer) -> None:
        with testing.hold(rt, "upload"):
            task = asyncio.ensure_future(_await(rt.upload_pending(buf, rt.empty(1 << 20, np.uint8))))
            del buf
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gc.collect()
            assert alive() is not None and alive().state == "in_flight"  # type: ignore[union-attr]

    async def _await(pending: ferry.PendingUpload) -> None:
        await pending

    asyncio.run(main(buf))
    del buf
    gc.collect()
    deadline = time.monotonic() + 20
    while (rt.stats().retiring or rt.stats().in_flight) and time.monotonic() < deadline:
        rt.poll()
        gc.collect()
        time.sleep(0.001)
    stats = rt.stats()
    assert stats.in_flight == 0 and stats.retiring == 0 and stats.failed == 0
    assert stats.completed == stats.submitted
    assert alive() is None  # released once proven complete


def test_wait_all_returns_results_in_order_and_times_out_without_harm(rt: ferry.Runtime) -> None:
    arrays = [np.full(1000, i, np.int32) for i in range(5)]
    devs = [rt.to_device(a) for a in arrays]
    with testing.hold(rt, "download"):
        handles = [rt.download_pending(d, rt.pinned(4000)) for d in devs]
        with pytest.raises(TimeoutError, match="5 of 5"):
            ferry.wait_all(handles, timeout=0.05)
    results = ferry.wait_all(handles, timeout=30)
    for (source, buf), d, a in zip(results, devs, arrays, strict=True):
        assert source is d and np.array_equal(buf.as_array(np.int32), a)


def test_wait_all_raises_the_first_failure(emu: ferry.Runtime) -> None:
    ok = emu.upload_pending(emu.pinned(8), emu.empty(8, np.uint8))
    ok.wait()
    testing.fail_next_copy(emu)
    bad = emu.upload_pending(emu.pinned(8), emu.empty(8, np.uint8))
    good = emu.upload_pending(emu.pinned(8), emu.empty(8, np.uint8))
    with pytest.raises(ferry.TransferFailedError):
        ferry.wait_all([bad, good])
    buf, _ = good.wait()  # left unwaited, usable
    assert buf.state == "owned"


def test_as_completed_yields_in_completion_order(rt: ferry.Runtime) -> None:
    dev = rt.to_device(np.arange(100, dtype=np.uint8))
    with testing.hold(rt, "upload"):
        blocked = rt.upload_pending(rt.pinned(100), rt.empty(100, np.uint8))
        free = rt.download_pending(dev, rt.pinned(100))
        order = []
        iterator = ferry.as_completed([blocked, free], timeout=30)
        order.append(next(iterator))  # the download is not behind the held upload stream
    order.extend(iterator)
    assert order == [free, blocked]
    for handle in order:
        handle.wait()


@pytest.mark.slow
def test_a_hundred_pending_transfers_cost_no_cpu_while_they_wait(rt: ferry.Runtime) -> None:
    dev = rt.empty(4096, np.uint8)
    with testing.hold(rt, "download"):
        handles = [rt.download_pending(dev, rt.pinned(4096)) for _ in range(100)]
        futures = [h.future() for h in handles]
        time.sleep(0.1)  # let the watcher settle into its wait
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(1.0)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        assert not any(f.done() for f in futures)
    assert cpu / wall < 0.25, f"{cpu / wall:.2f} of a core while waiting"
    results = ferry.wait_all(handles, timeout=30)
    assert len(results) == 100


def test_the_prefetch_loader_example_runs_and_verifies_its_bytes(backend_name: str) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "prefetch_loader.py"
    spec = importlib.util.spec_from_file_location("prefetch_loader", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = module.main(["--batches", "5", "--mib", "2", "--consume-ms", "1", "--backend", backend_name])
    assert set(figures) == {"transfer", "serial", "prefetched", "hidden"}
    assert figures["serial"] > 0 and figures["prefetched"] > 0
