"""The CUDA backend's bookkeeping on a stand-in driver, on any machine with a C compiler.

``benchmarks/fake_cuda.c`` is a ``libcuda.so.1`` whose calls return at once (copies are a memcpy
inside the call, events are always complete, streams are tokens). ``cuda.bindings`` and the compiled
extension load it like the real driver, so ferry's CUDA backend, its compiled calls and the native
engine in CUDA mode run here without a GPU. It cannot show anything about ordering on a device (the
GPU tests do); what it shows is the calls ferry makes and the resources it takes and gives back.
Each case runs in a subprocess with ``LD_LIBRARY_PATH`` pointing at the stand-in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ferry import _native

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "fake_cuda.c"

pytestmark = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the stand-in driver"),
    pytest.mark.skipif(not SOURCE.exists(), reason="benchmarks/fake_cuda.c is not here"),
    pytest.mark.skipif(_native.load() is None, reason="the compiled extension is not built here"),
]


def run(stand_in: Path, code: str) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(stand_in), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("FERRY_NATIVE", None)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("helpers", [0, 3])
def test_a_staged_hand_off_joins_the_lanes_events_once_and_gives_everything_back(
    stand_in: Path, helpers: int
) -> None:
    # helpers=0: each job's chunks are dealt to the lanes, and each lane posts an event; helpers=3: each
    # job is one lead lane's (a cooperative upload), which posts one
    out = run(stand_in, """
        import numpy as np
        import ferry
        from ferry import testing

        from ferry._routes._native import NativeJob

        NativeJob.dmas_complete = lambda self: False  # as on a GPU, where the DMAs are still running
        rt = ferry.Runtime("cuda", staging=ferry.StagingConfig(lane_helpers=HELPERS))
        info = rt.info()
        assert info["backend"] == "cuda" and info["staging_engine"].startswith("native"), info
        backend = testing.backend_of(rt)
        seen = {"wait": 0, "lists": [], "created": 0, "destroyed": 0, "streams": [], "streams_gone": []}
        wait, waits = backend.stream_wait_event, backend.stream_wait_events
        create, destroy = backend.event_create, backend.event_destroy
        stream_create, stream_destroy = backend.stream_create, backend.stream_destroy

        def count(key, fn):
            def wrapper(*args):
                seen[key] += 1
                return fn(*args)
            return wrapper

        def listed(stream, events):
            seen["lists"].append(list(events))
            return waits(stream, events)

        backend.stream_wait_event = count("wait", wait)
        backend.stream_wait_events = listed
        backend.event_create = count("created", create)
        backend.event_destroy = count("destroyed", destroy)
        def made():
            stream = stream_create()
            seen["streams"].append(int(stream))
            return stream

        def gone(stream):
            seen["streams_gone"].append(int(stream))
            return stream_destroy(stream)

        backend.stream_create, backend.stream_destroy = made, gone
        jobs = 4
        for i in range(jobs):
            data = (np.arange(16 << 20) % (251 - i)).astype(np.uint8)
            pending = rt.upload(data)  # above direct_bytes: the native lanes
            handed = pending.hand_off(7)  # a consumer stream (a token here)
            capsule = handed.__dlpack__(stream=9)  # a second consumer: ordered again
            del capsule
            _, dev = pending.wait()
            assert np.array_equal(rt.to_host(dev), data)
        rt.close()
        made_here = len(seen["streams"])
        all_gone = all(s in seen["streams_gone"] for s in seen["streams"])
        print(seen["wait"], seen["created"], seen["destroyed"], made_here, int(all_gone))
        print(*(len(events) for events in seen["lists"]))
        print(*(len(set(events)) == len(events) and all(events) for events in seen["lists"]))
    """.replace("HELPERS", str(helpers)))
    singles, created, destroyed, streams, all_gone = (int(v) for v in out.splitlines()[0].split())
    lists = out.splitlines()[1].split()
    assert len(lists) == 4  # one list per job, one event per lane that took a share
    assert all(int(n) >= 2 for n in lists) if helpers == 0 else all(int(n) == 1 for n in lists)
    assert all(flag == "True" for flag in out.splitlines()[2].split())  # distinct, non-null events
    assert created == destroyed == 4  # one joined event per job, destroyed once the job settled
    assert singles == 3 * 4  # the export stream, the hand-off's stream, the DLPack consumer: one wait each
    assert streams == 1 and all_gone  # the join stream is made once, for every job, and destroyed at close


def test_a_hand_off_of_a_finished_staged_upload_orders_nothing_on_the_device(stand_in: Path) -> None:
    # a batch uploaded ahead is usually complete when it is handed off: its DMAs are done, so the
    # consumer's stream needs no wait and the lanes' events no join
    out = run(stand_in, """
        import numpy as np
        import ferry
        from ferry import testing

        rt = ferry.Runtime("cuda")
        backend = testing.backend_of(rt)
        calls = []
        for name in ("stream_wait_event", "stream_wait_events", "event_record", "event_create"):
            def spy(*args, _name=name, _fn=getattr(backend, name)):
                calls.append(_name)
                return _fn(*args)
            setattr(backend, name, spy)
        data = (np.arange(16 << 20) % 239).astype(np.uint8)
        pending = rt.upload(data)  # above direct_bytes: the native lanes
        assert pending._record.extra.job.wait_done(30)  # the engine finished; nobody asked the handle
        assert not pending._record.done
        handed = pending.hand_off(7)
        capsule = handed.__dlpack__(stream=9)
        del capsule
        _, dev = pending.wait()
        assert dev is handed and np.array_equal(rt.to_host(dev), data)
        rt.close()
        print(len(calls), *calls)
    """)
    assert out.split() == ["0"]


def test_the_compiled_calls_and_the_native_engine_run_on_the_cuda_backend(stand_in: Path) -> None:
    out = run(stand_in, """
        import numpy as np
        import ferry

        rt = ferry.Runtime("cuda")
        info = rt.info()
        print(info["fast_path"].split()[0], info["staging_engine"].split()[0])
        small = np.arange(4, dtype=np.float32)
        big = np.arange(12 << 20, dtype=np.float32).reshape(4096, 3072)[:, ::3]  # strided, staged (16 MiB)
        for host in (small, big):
            _, dev = rt.upload(host).wait()
            assert np.array_equal(rt.to_host(dev), host)
        buf = rt.pinned(small.nbytes)
        buf.as_array()[:] = small.view(np.uint8)
        dev = rt.empty(4, np.float32)
        buf, dev = rt.upload_pending(buf, dev).wait()
        assert np.array_equal(rt.to_host(dev), small)
        buf.close()
        rt.close()
    """)
    assert out.split() == ["native", "native"]


def test_a_dead_context_at_settle_or_close_never_escapes(stand_in: Path) -> None:
    # a sticky error kills the context: destroying the joined event or the join stream then fails;
    # a wait() must still hand the objects back, and close() must still release everything
    out = run(stand_in, """
        import numpy as np
        import ferry
        from ferry import testing
        from ferry._backends._base import DeviceError

        rt = ferry.Runtime("cuda")
        backend = testing.backend_of(rt)
        destroy_event, destroy_stream = backend.event_destroy, backend.stream_destroy

        def dead(*args):
            raise DeviceError("CUDA_ERROR_ILLEGAL_ADDRESS (stand-in)", code=700, sticky=True)

        data = (np.arange(16 << 20) % 253).astype(np.uint8)
        kept = np.zeros(4096, np.uint8)
        registration = rt.register(kept)
        pending = rt.upload(data)
        pending.hand_off(7)
        backend.event_destroy = dead  # the joined event cannot be destroyed
        source, dev = pending.wait()
        assert source is data and dev.state == "owned"
        backend.event_destroy = destroy_event
        pending = rt.upload(data)
        pending.hand_off(7)
        pending.wait()
        backend.stream_destroy = dead  # the join stream cannot be destroyed
        rt.close()
        backend.stream_destroy = destroy_stream
        print(rt.closed, registration.active)
    """)
    assert out.split() == ["True", "False"]


def test_a_staged_hand_off_waits_for_the_host_copies_without_the_runtimes_lock(stand_in: Path) -> None:
    # the lanes are held before their first chunk (the engine's own hold, which the stand-in keeps):
    # a hand-off then waits for them, and meanwhile other threads keep using the runtime
    out = run(stand_in, """
        import threading
        import numpy as np
        import ferry
        from ferry import testing

        rt = ferry.Runtime("cuda")
        data = (np.arange(16 << 20) % 241).astype(np.uint8)
        handed = []
        with testing.hold(rt, "upload"):
            pending = rt.upload(data)
            waiter = threading.Thread(target=lambda: handed.append(pending.hand_off(7)))
            waiter.start()
            waiter.join(0.3)
            blocked = waiter.is_alive()  # waiting for the lanes' host copies
            other = threading.Thread(target=lambda: rt.empty(1 << 20, np.uint8))
            other.start()
            other.join(10)
            free = not other.is_alive()  # the runtime's lock was not held meanwhile
        waiter.join(30)
        _, dev = pending.wait()
        assert handed and handed[0] is dev and np.array_equal(rt.to_host(dev), data)
        rt.close()
        print(blocked, free)
    """)
    assert out.split() == ["True", "True"]


@pytest.mark.parametrize("driver_thread", ["0", "1"])
def test_the_cuda_engine_with_and_without_its_driver_thread(stand_in: Path, driver_thread: str) -> None:
    """The runtime's CUDA engine either way (lanes' own enqueues, or the driver thread's), and an engine
    whose DMAs all go on the driver thread's one stream: the bytes arrive and Engine.streams() names
    the streams a producer must be ordered before."""
    out = run(stand_in, f"""
        import os
        os.environ["FERRY_DRIVER_THREAD"] = "{driver_thread}"
        import numpy as np
        from cuda.bindings import driver
        import ferry
        from ferry import _native
        from ferry._native._engine import Engine
        from ferry._runtime import parts_of

        with ferry.Runtime("cuda") as rt:
            a = np.random.default_rng(3).integers(0, 255, (16 << 20) + 13, dtype=np.uint8)
            a, dev = rt.upload(a).wait()
            assert (rt.download(dev).wait()[1] == a).all()
            engine = parts_of(rt).staged.engine(True).engine
            assert engine.driver_thread is ({driver_thread} == 1)
            assert len(engine.streams()) == engine.lanes
        driver.cuInit(0)
        err, ctx = driver.cuDevicePrimaryCtxRetain(0)
        points = _native.cuda_entry_points(driver)
        for one_stream in (False, True):
            kw = dict(mode="cuda", context=int(ctx), entry_points=points, lanes=3, slots_per_lane=2,
                      slot_bytes=1 << 20, min_chunk_bytes=256 << 10, one_stream=one_stream)
            up, down = Engine("upload", **kw), Engine("download", **kw)
            try:
                assert len(up.streams()) == (1 if one_stream else 3)
                src = np.arange(3 << 20, dtype=np.uint8)
                mid = np.zeros_like(src)
                back = np.zeros_like(src)
                job = up.submit(src.ctypes.data, mid.ctypes.data, src.nbytes, src.shape, src.strides, 1,
                                hand_off=True)
                assert job.wait(10) and job.error is None
                job = down.submit(back.ctypes.data, mid.ctypes.data, src.nbytes, src.shape, src.strides, 1)
                assert job.wait(10) and job.error is None
                assert (back == src).all()
            finally:
                up.close()
                down.close()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_pinned_copy_the_driver_refuses_leaves_everything_usable(stand_in: Path) -> None:
    """The compiled pinned submission enqueues the copy before it makes the transfer's record. A copy
    the driver refuses, or one whose event record it refuses after queueing the copy, raises
    TransferSubmitError and changes nothing: the buffer and the array stay owned and usable, the next
    round trips move the bytes, and nothing is counted as failed or left in flight. Then many round
    trips with dropped handles and garbage collection after every allocation (the record is made
    after the copy, with collection off until it is tracked) end with every copy accounted for."""
    out = run(stand_in, """
        import ctypes, gc
        import numpy as np
        import ferry

        lib = ctypes.CDLL("libcuda.so.1")  # the stand-in the bindings loaded: its failure switch
        rt = ferry.Runtime("cuda")
        data = (np.arange(4096) % 251).astype(np.uint8)
        buf, dev = rt.pinned(4096), rt.empty(4096, np.uint8)
        buf.as_array()[:] = data
        buf, dev = rt.upload_pending(buf, dev).wait()
        counts = (ctypes.c_ulonglong * 2)()

        def alive():  # events the driver made and nobody destroyed
            lib.fake_event_counts(counts)
            return counts[0] - counts[1]

        from ferry._runtime import parts_of

        events, before = rt.stats().events, alive()
        for copy_code, record_code in ((1, 0), (0, 1)):
            for direction in ("up", "down"):
                lib.fake_fail_next(copy_code, record_code)
                try:
                    if direction == "up":
                        rt.upload_pending(buf, dev)
                    else:
                        rt.download_pending(dev, buf)
                except ferry.TransferSubmitError as exc:
                    print("refused", direction, copy_code, record_code, type(exc).__name__)
                else:
                    raise SystemExit("the refused copy was accepted")
                assert buf.as_array()[7] == data[7]  # owned: readable
        lib.fake_fail_next(0, 0)
        # a refused copy's event went back to the pool; an event whose record was refused was destroyed:
        # with nothing in flight, every event the driver holds is in the pool
        pooled = len(parts_of(rt).completion.events)
        print("events alive", alive(), "pooled", pooled, "made", rt.stats().events - events + before)
        buf, dev = rt.upload_pending(buf, dev).wait()
        buf.as_array()[:] = 0
        dev, buf = rt.download_pending(dev, buf).wait()
        assert np.array_equal(buf.as_array(), data)
        gc.set_threshold(1)
        for k in range(300):
            handle = rt.upload_pending(buf, dev)
            if k % 3:
                buf, dev = handle.wait()
            else:  # dropped: it retires; a later submission's maintenance collects it
                del handle
                buf, dev = rt.pinned(4096), rt.empty(4096, np.uint8)
                buf.as_array()[:] = data
        gc.set_threshold(700)
        buf, dev = rt.upload_pending(buf, dev).wait()
        stats = rt.stats()
        print("failed", stats.failed, "in_flight", stats.in_flight, "submitted", stats.submitted,
              "completed + retiring", stats.completed + stats.retiring)
        rt.close()
    """)
    assert out.count("refused") == 4, out
    alive, pooled = out.split("events alive ")[1].split()[0], out.split(" pooled ")[1].split()[0]
    assert alive == pooled, out  # no event leaked, none destroyed twice
    counts = out.split("failed ")[1].split()
    assert counts[0] == "0" and counts[2] == "0", out  # nothing failed, nothing in flight
    assert counts[4] == counts[8], out  # every submitted copy completed or retires


def test_out_of_memory_in_a_pinned_submission_never_leaves_a_copy_untracked(stand_in: Path) -> None:
    """The compiled pinned submission makes its record after the copy. Memory running out at each of
    its allocations in turn (CPython's allocation-failure hook), with the driver accepting the copy,
    refusing it, refusing its event record, or asking for a retry first: either the transfer is
    tracked, or it raised and the copy (if the driver queued one) was waited for before it did;
    garbage collection is on again afterwards, and where no MemoryError was raised no event is lost."""
    pytest.importorskip("_testcapi")
    out = run(stand_in, """
        import ctypes, gc
        import _testcapi
        import numpy as np
        import ferry
        from ferry._pending import PendingDownload, PendingUpload
        from ferry._runtime import parts_of
        from ferry import testing

        lib = ctypes.CDLL("libcuda.so.1")
        copies, syncs, events = (ctypes.c_ulonglong * 5)(), (ctypes.c_ulonglong * 2)(), (ctypes.c_ulonglong * 2)()

        def counts():
            lib.fake_counts(copies)
            lib.fake_syncs(syncs)
            lib.fake_event_counts(events)
            return copies[0], syncs[0] + syncs[1], events[0] - events[1]

        checked = 0
        for copy_code, record_code in ((0, 0), (1, 0), (0, 1), (201, 0)):
            for upload in (True, False):
                for k in range(60):  # a fresh runtime each time: a failure after the states moved may strand them
                    before = counts()[2]  # events alive before this runtime (an earlier MemoryError may leak one)
                    rt = ferry.Runtime("cuda")
                    completion, backend = parts_of(rt).completion, testing.backend_of(rt)
                    buf, dev = rt.pinned(4096), rt.empty(4096, np.uint8)
                    buf, dev = rt.upload_pending(buf, dev).wait()
                    gc.collect()
                    copied0, synced0, alive0 = counts()
                    if upload:
                        args = (PendingUpload, parts_of(rt).h2d, backend.htod_record, dev._ptr, buf._block.ptr, 4096,
                                buf, dev, True)
                    else:
                        args = (PendingDownload, parts_of(rt).d2h, backend.dtoh_record, buf._block.ptr, dev._ptr,
                                4096, buf, dev, False)
                    lib.fake_fail_next(copy_code, record_code)
                    handle, out_of_memory = None, False
                    with parts_of(rt).lock:
                        try:
                            _testcapi.set_nomemory(k, k + 1)
                            try:
                                handle = completion.submit_pinned(*args)
                            finally:
                                _testcapi.remove_mem_hooks()
                        except ferry.TransferSubmitError:
                            pass
                        except (MemoryError, SystemError):
                            out_of_memory = True
                    lib.fake_fail_next(0, 0)
                    assert gc.isenabled(), (copy_code, record_code, upload, k)
                    copied, synced, alive = counts()
                    tracked = handle is not None or len(completion.live) > 0
                    if copied > copied0 and not tracked:
                        assert synced > synced0, f"an untracked copy was not waited for {(copy_code, record_code, k)}"
                    if handle is not None:
                        handle.wait()
                        del handle
                    if not out_of_memory:  # a MemoryError may lose an event (never a copy): count only the rest
                        live_events = sum(1 for r in completion.live if r.event is not None)
                        assert alive - before == len(completion.events) + live_events, (copy_code, record_code,
                                                                                         upload, k)
                    checked += 1
                    rt.close()
        print("checked", checked)
    """)
    assert "checked 480" in out, out


def test_garbage_collection_stays_off_while_any_pinned_submission_is_in_its_window(stand_in: Path) -> None:
    """The compiled pinned submission turns garbage collection off from its copy until its record is
    tracked. Two threads' windows overlap (the driver's refusal runs Python, which lets another thread
    in): collection comes back on only when the last window closes, never inside another's."""
    out = run(stand_in, """
        import ctypes, gc, threading
        import numpy as np
        import ferry
        from ferry._backends._cuda import CudaBackend

        lib = ctypes.CDLL("libcuda.so.1")
        original = CudaBackend._native_failed
        inside_b, a_done = threading.Event(), threading.Event()
        seen = []
        rt_a, rt_b = ferry.Runtime("cuda"), ferry.Runtime("cuda")
        bufs = {rt: (rt.pinned(64), rt.empty(64, np.uint8)) for rt in (rt_a, rt_b)}
        for rt, (buf, dev) in bufs.items():
            rt.upload_pending(buf, dev).wait()

        def submit_b():
            try:
                rt_b.upload_pending(*bufs[rt_b])
            except ferry.TransferSubmitError:
                seen.append("b refused")

        def failed(self, op, code, stage, args):
            if threading.current_thread() is threading.main_thread():  # A's window: B opens one meanwhile
                seen.append(("a", gc.isenabled()))
                lib.fake_fail_next(1, 0)
                threading.Thread(target=submit_b).start()
                inside_b.wait(10)
            else:  # B's window, until A's closed
                inside_b.set()
                a_done.wait(10)
                seen.append(("b", gc.isenabled()))
            return original(self, op, code, stage, args)

        CudaBackend._native_failed = failed
        assert gc.isenabled()
        lib.fake_fail_next(1, 0)
        try:
            rt_a.upload_pending(*bufs[rt_a])
        except ferry.TransferSubmitError:
            seen.append("a refused")
        a_done.set()
        for t in threading.enumerate():
            if t is not threading.main_thread():
                t.join(10)
        seen.append(("after", gc.isenabled()))
        CudaBackend._native_failed = original
        rt_a.close()
        rt_b.close()
        print(seen)
    """)
    assert out.strip() == "[('a', False), 'a refused', ('b', False), 'b refused', ('after', True)]", out
