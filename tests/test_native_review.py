"""The compiled layer's guarantees under misuse, concurrency, fork and exit (any machine).

Each case is a way a caller (or a second thread, a forked child, the interpreter's exit) could
reach the extension with something it did not expect: a deleted record field, a non-array handed
to a helper that reads NumPy's fields, a batch refused by the driver while another thread's batch
runs, a lock held by a thread that does not exist in a forked child, a second close() while jobs
run, absurd engine sizes. Each must raise a clear error or behave, never crash or hang. Cases that
could crash or hang run in a subprocess with a timeout.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ferry import _native

engine = _native.load()
pytestmark = pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")

ROOT = Path(__file__).resolve().parent.parent


def run(code: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    full.pop("FERRY_NATIVE", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=timeout)


# -- records ---------------------------------------------------------------------------------------


def test_a_compiled_records_fields_cannot_be_deleted() -> None:
    from ferry._completion import Record

    assert engine is not None
    record = engine.new_record(1, None, None, (), (), (), 8)
    for name in Record.__slots__:
        with pytest.raises(AttributeError):
            delattr(record, name)
        getattr(record, name)  # still there
    record.event = 5  # a field can still be set
    assert record.event == 5


def test_deleting_a_pending_transfers_record_field_does_not_crash_its_wait() -> None:
    result = run("""
        import numpy as np
        import ferry

        rt = ferry.Runtime("emulated")
        buf, dev = rt.pinned(64), rt.empty(64, np.uint8)
        for field in ("event", "shared", "moved", "batch", "leased", "extra"):
            pending = rt.upload_pending(buf, dev)
            try:
                delattr(pending._record, field)
            except AttributeError:
                pass
            buf, dev = pending.wait()
        rt.close()
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


# -- the helpers that read NumPy's fields --------------------------------------------------------------


@pytest.mark.parametrize("thing", [object(), b"bytes", bytearray(64), 3, None])
def test_the_array_helpers_refuse_anything_but_an_ndarray(thing: Any) -> None:
    assert engine is not None
    assert _native.array_layout()  # the helpers are enabled
    for helper in (engine.clear_writeable, engine.set_writeable, engine.data_of):
        with pytest.raises(TypeError):
            helper(thing)
    slot = np.zeros(64, np.uint8)
    # "an ndarray of 8 bytes", says the caller: not one, so the buffer protocol decides
    expected = len(thing) if isinstance(thing, (bytes, bytearray)) else -1
    assert engine.copy_in(int(slot.ctypes.data), 64, thing, 8) == expected
    writable = isinstance(thing, bytearray)
    address = engine.address_of(thing, 64, 8)
    assert (address != 0) == writable


def test_the_array_helpers_refuse_an_ndarray_subclass_they_cannot_vouch_for() -> None:
    assert engine is not None
    assert _native.array_layout()

    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    sub = np.zeros(8, np.uint8).view(Sub)
    for helper in (engine.clear_writeable, engine.set_writeable, engine.data_of):
        with pytest.raises(TypeError):
            helper(sub)
    array = np.zeros(8, np.uint8)
    assert engine.data_of(array) == array.ctypes.data
    assert engine.clear_writeable(array) is True and not array.flags.writeable
    engine.set_writeable(array)
    assert array.flags.writeable


# -- Calls.copy_batch ----------------------------------------------------------------------------------

CU = ctypes.c_int
PTR = ctypes.c_void_p
U64 = ctypes.c_uint64
SIZE = ctypes.c_size_t
COPY = ctypes.CFUNCTYPE(CU, U64, U64, SIZE, PTR)
RECORD = ctypes.CFUNCTYPE(CU, PTR, PTR)
ONE = ctypes.CFUNCTYPE(CU, PTR)
WAIT_EVENT = ctypes.CFUNCTYPE(CU, PTR, PTR, ctypes.c_uint)
BATCH_13000 = ctypes.CFUNCTYPE(
    CU, ctypes.POINTER(U64), ctypes.POINTER(U64), ctypes.POINTER(SIZE), SIZE, PTR, ctypes.POINTER(SIZE), SIZE, PTR
)


def test_a_batch_refused_while_another_batch_runs_never_enqueues_that_batch_twice() -> None:
    """The driver runs one batch (the GIL released for it) while another batch is refused and
    turns the Calls object to loops: the running batch, which succeeded, is not queued again copy by
    copy, and the refused one is queued once as single copies."""
    assert engine is not None
    log: list[tuple[Any, ...]] = []
    calls: Any = None
    nested = {"done": False}

    def copy(dst: int, src: int, n: int, stream: int) -> int:
        log.append(("htod", dst))
        return 0

    def batch(dsts: Any, srcs: Any, sizes: Any, count: int, attrs: int, idxs: Any, nattrs: int, stream: int) -> int:
        log.append(("batch", count))
        if count == 2:
            return 1  # INVALID_VALUE: the driver refuses this batch's description
        if not nested["done"]:  # meanwhile (the GIL is free): another batch, which the driver refuses
            nested["done"] = True
            calls.copy_batch(True, [1, 2], [3, 4], [5, 6], 0x9, None)
        return 0

    keep = {
        "cuMemcpyHtoDAsync": COPY(copy), "cuMemcpyDtoHAsync": COPY(copy),
        "cuEventRecord": RECORD(lambda e, s: 0), "cuEventQuery": ONE(lambda e: 0),
        "cuEventSynchronize": ONE(lambda e: 0), "cuStreamWaitEvent": WAIT_EVENT(lambda s, e, f: 0),
        "cuMemcpyBatchAsync": BATCH_13000(batch),
    }
    points = {name: ctypes.cast(fn, PTR).value or 0 for name, fn in keep.items()}
    calls = engine.Calls(points, lambda *a: None, batch_abi=13000)
    n = 40  # a batch this long releases the GIL in the driver
    calls.copy_batch(True, list(range(100, 100 + n)), list(range(n)), [1] * n, 0x9, None)
    singles = [entry[1] for entry in log if entry[0] == "htod"]
    assert singles == [1, 2]  # the refused batch as a loop; the long one never copy by copy
    assert calls.batch_refused == 1 and calls.batch_abi == 0
    assert calls.counts()["batches"] == 1 and calls.counts()["batched_copies"] == n


# -- fork ------------------------------------------------------------------------------------------


FORK_HELD = """
    import os, sys, threading
    LOCK_SETUP
    held, go = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            go.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        import signal
        signal.alarm(20)  # a hang ends the child
        try:
            CHILD
        except BaseException as exc:
            print("child raised", type(exc).__name__, flush=True)
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    go.set()
    thread.join()
    print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


def fork_case(setup: list[str], child: list[str], native: bool = True) -> str:
    code = textwrap.dedent(FORK_HELD).replace("LOCK_SETUP", "\n".join(setup))
    code = code.replace("CHILD", "\n        ".join(child))
    result = run(code, env={} if native else {"FERRY_NATIVE": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("native", [True, False])
def test_a_forked_child_takes_the_runtime_lock_a_parent_thread_held(native: bool) -> None:
    # the holder does not exist in the child: its lock counts as free there
    out = fork_case(
        ["from ferry import _native", "lock = _native.runtime_lock()"],
        ["got = lock.acquire(timeout=10)", "print('got', got, flush=True)", "lock.release()"],
        native=native,
    )
    assert "got True" in out and "child 0" in out, out


@pytest.mark.parametrize("native", [True, False])
def test_a_forked_child_gets_an_error_from_a_runtime_whose_lock_a_parent_thread_held(native: bool) -> None:
    out = fork_case(
        ["import numpy as np, ferry", "from ferry._runtime import parts_of", "rt = ferry.Runtime('emulated')",
         "buf, dev = rt.pinned(64), rt.empty(64, np.uint8)", "lock = parts_of(rt).lock"],
        ["rt.upload_pending(buf, dev)"],
        native=native,
    )
    assert "child raised RuntimeClosedError" in out and "child 3" in out, out


def test_a_staged_jobs_error_in_a_forked_child_is_refused_not_waited_for() -> None:
    result = run("""
        import os
        from ferry._native import _engine
        engine = _engine.Engine("upload", lanes=2, slot_bytes=1 << 20)
        import numpy as np
        src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
        job = engine.submit(src.ctypes.data, dst.ctypes.data, src.nbytes, src.shape, src.strides, 1)
        job.wait()
        pid = os.fork()
        if pid == 0:
            try:
                job.error
            except RuntimeError:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        engine.close()
    """)
    assert result.returncode == 0 and result.stdout.split() == ["0"], result.stdout + result.stderr


# -- Engine.close ------------------------------------------------------------------------------------


def test_a_second_close_returns_only_once_every_job_ran() -> None:
    assert engine is not None
    eng = engine.Engine("upload", lanes=2, slot_bytes=1 << 20, bandwidth=20e6, latency=0.0)  # 2 MiB: ~100 ms
    src, dst = np.ones(2 << 20, np.uint8), np.zeros(2 << 20, np.uint8)
    job = eng.submit(src.ctypes.data, dst.ctypes.data, src.nbytes, src.shape, src.strides, 1)
    first = threading.Thread(target=eng.close)
    first.start()
    deadline = time.monotonic() + 10
    while not eng.closed and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert eng.closed
    eng.close()  # a second close, while the first one waits for the job
    assert job.done()
    first.join(10)
    assert (dst == 1).all()


# -- engine sizes ---------------------------------------------------------------------------------


def test_an_engine_whose_staging_memory_overflows_is_refused() -> None:
    assert engine is not None
    with pytest.raises(ValueError):
        engine.Engine("upload", lanes=64, slots_per_lane=64, slot_bytes=1 << 60)
    with pytest.raises(ValueError):
        engine.Engine("upload", lanes=4, slot_bytes=sys.maxsize)


@pytest.mark.parametrize("bad", [{"latency": float("inf")}, {"bandwidth": float("inf")},
                                 {"latency": float("nan")}, {"latency": 1e12}])
def test_an_emulated_engine_refuses_a_latency_or_bandwidth_it_cannot_model(bad: dict[str, float]) -> None:
    assert engine is not None
    with pytest.raises(ValueError):
        engine.Engine("upload", **bad)


# -- native threads and signals ------------------------------------------------------------------


def _unblocked_threads() -> set[str]:
    """Threads of this process (their ids) that may receive a signal: their blocked set is not (nearly)
    full. A set, not a count: a thread of an earlier test that ends meanwhile must not look like a change."""
    found = set()
    for task in os.listdir("/proc/self/task"):
        try:
            status = Path(f"/proc/self/task/{task}/status").read_text()
        except OSError:
            continue
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        if bin(blocked).count("1") < 30:  # everything but what cannot be blocked (and glibc's own)
            found.add(task)
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("driver_thread", [True, False])
def test_native_threads_block_every_signal(driver_thread: bool) -> None:
    assert engine is not None
    before = _unblocked_threads()
    eng = engine.Engine("upload", lanes=3, slot_bytes=1 << 20, driver_thread=driver_thread)
    try:
        new = _unblocked_threads() - before
        assert new == set()  # lanes, stream workers, the driver thread: none takes a signal
    finally:
        eng.close()


# -- DLPack at exit -------------------------------------------------------------------------------


def test_a_dlpack_deleter_run_once_the_interpreter_exits_leaves_the_owner_alone() -> None:
    result = run("""
        import atexit, ctypes, threading
        from ferry._native import _engine

        class Owner:
            pass

        owner = Owner()
        capsule = _engine.dlpack_export(owner, 0, (4,), 1, 8, 1, 0)
        address = ctypes.pythonapi.PyCapsule_GetPointer
        address.restype, address.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        managed = address(capsule, b"dltensor")
        deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.c_void_p.from_address(managed + 56).value)
        import sys
        before = sys.getrefcount(owner)
        atexit._run_exitfuncs()  # the interpreter's exit began: from now on a deleter does nothing
        deleter(managed)
        print(sys.getrefcount(owner) == before, _engine.dlpack_exports_live())
    """)
    assert result.returncode == 0 and result.stdout.split() == ["True", "1"], result.stdout + result.stderr


# -- the stand-in driver's counters --------------------------------------------------------------------


@pytest.mark.skipif(not (ROOT / "benchmarks" / "fake_cuda.c").exists(), reason="needs benchmarks/fake_cuda.c")
def test_the_stand_in_drivers_counts_hold_under_parallel_calls(tmp_path: Path) -> None:
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    lib_path = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib_path), str(ROOT / "benchmarks" / "fake_cuda.c"),
                    "-ldl"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    per, threads = 20000, 4

    def work() -> None:
        event, stream = ctypes.c_void_p(), ctypes.c_void_p()
        for _ in range(per):
            lib.cuEventCreate(ctypes.byref(event), 0)
            lib.cuEventDestroy(event)
            lib.cuStreamCreate(ctypes.byref(stream), 0)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    counts = (ctypes.c_ulonglong * 2)()
    lib.fake_event_counts(counts)
    assert counts[0] == counts[1] == per * threads
    lib.fake_streams_made.restype = ctypes.c_ulonglong
    assert lib.fake_streams_made() == per * threads  # every stream token was handed out once


# -- the small route's settle --------------------------------------------------------------------------


@pytest.mark.parametrize("spun", [False, True], ids=["compiled wait", "sleeping wait"])
def test_a_small_slot_that_cannot_be_settled_leaves_its_record_unsettled(spun: bool) -> None:
    """A download's copy-out that raises leaves its record unsettled, whether the compiled wait settles it or
    the record outspun its budget and Completion.wait does (a slow machine takes that path)."""
    import ferry
    from ferry._runtime import parts_of

    with ferry.Runtime("emulated") as rt:
        assert parts_of(rt).completion.fast is not None
        dev = rt.to_device(np.arange(16, dtype=np.uint8))
        out = np.zeros(16, np.uint8)
        pending = rt.download(dev, out)
        record = pending._record
        slot = record.extra
        assert type(slot).__name__ == "Slot"
        good = slot.address
        slot.address = "not an address"
        if spun:
            record.spun = True
        with pytest.raises(TypeError):
            pending.wait()
        assert record.settled is False
        slot.address = good
