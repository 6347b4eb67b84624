"""A pinned buffer's views, counted by the exports of its memory (not by reference counts).

Every view :meth:`ferry.PinnedHostBuffer.as_array` makes is made from the buffer's
``HostMemory``: the compiled one counts the buffer-protocol exports NumPy has not released,
its Python twin the ctypes arrays it handed out that are still alive. Both must count the
same, for the compiled entries (which read the count at its field) and for the Python path.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ferry
from ferry import _native
from ferry._native.objects import _HostMemory

engine = _native.load()

KINDS: list[Any] = [_HostMemory]
if engine is not None:
    KINDS.insert(0, engine.HostMemory)


@pytest.fixture(params=KINDS, ids=lambda k: "compiled" if k is not _HostMemory else "twin")
def memory(request: pytest.FixtureRequest) -> Callable[[int], Any]:
    keep: list[np.ndarray[Any, Any]] = []

    def make(nbytes: int) -> Any:
        backing = np.zeros(max(nbytes, 1), np.uint8)
        keep.append(backing)
        return request.param(backing.ctypes.data, nbytes)

    return make


def view(mem: Any, dtype: Any = np.uint8, count: int = -1) -> np.ndarray[Any, Any]:
    return np.frombuffer(mem.export(), dtype=dtype, count=count)  # type: ignore[no-any-return]


def test_each_view_counts_once_with_everything_derived_from_it(memory: Callable[[int], Any]) -> None:
    mem = memory(64)
    assert mem.exports == 0
    a = view(mem, np.float32).reshape(4, 4)
    b = view(mem)
    assert mem.exports == 2
    part = a[1:3]
    mv = memoryview(part)
    derived = np.asarray(mv)
    again = derived.view(np.uint8)[::2]
    del a, part, mv, derived
    assert mem.exports == 2  # `again` still reaches a's export
    del b
    assert mem.exports == 1
    again[0] = 7  # the memory is still there and writable
    del again
    assert mem.exports == 0


def test_views_write_the_memory_they_count(memory: Callable[[int], Any]) -> None:
    mem = memory(16)
    a, b = view(mem), view(mem, np.uint32)
    a[:4] = 1
    assert b[0] == 0x01010101 and a.flags.writeable
    del a, b
    assert mem.exports == 0


def test_an_empty_memory_makes_empty_views(memory: Callable[[int], Any]) -> None:
    mem = memory(0)
    a = view(mem, count=0)
    assert a.size == 0 and mem.exports == 1
    del a
    assert mem.exports == 0


def test_bad_arguments_are_refused(memory: Callable[[int], Any]) -> None:
    kind = type(memory(1))
    with pytest.raises(ValueError):
        kind(0, 8)
    with pytest.raises((ValueError, OverflowError)):
        kind(4096, -1)
    with pytest.raises((ValueError, OverflowError)):
        kind(-4096, 8)


def test_the_memory_outlives_its_views(memory: Callable[[int], Any]) -> None:
    mem = memory(8)
    gone: list[bool] = []
    weakref.finalize(mem, gone.append, True)
    a = view(mem)
    del mem
    gc.collect()
    assert not gone  # the view keeps it (and so the pinned block) alive
    del a
    gc.collect()
    assert gone == [True]


@pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")
def test_a_direct_export_of_the_compiled_memory_counts_until_released() -> None:
    assert engine is not None
    backing = np.zeros(8, np.uint8)
    mem = engine.HostMemory(backing.ctypes.data, 8)
    mv = memoryview(mem)
    assert mem.exports == 1 and mv.nbytes == 8 and not mv.readonly
    mv.release()
    assert mem.exports == 0
    with pytest.raises(TypeError):
        type("Sub", (engine.HostMemory,), {})  # exact type: what the entries check


def test_threads_making_and_dropping_views_leave_an_exact_count(memory: Callable[[int], Any]) -> None:
    mem = memory(4096)
    held = threading.Barrier(9)  # the eight threads and this one
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                v = view(mem)[::3]
                v[0] = 1
                del v
            v = view(mem)
            held.wait(timeout=60)  # all eight hold one view here
            held.wait(timeout=60)
            del v
        except BaseException as exc:  # reported below
            errors.append(exc)
            held.abort()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        held.wait(timeout=60)
        assert mem.exports == 8
        held.wait(timeout=60)
    finally:
        for t in threads:
            t.join(timeout=60)
    assert not errors
    assert mem.exports == 0


# -- through a buffer: the refusal, on both engines ---------------------------------------------


def test_a_reference_to_the_memory_that_is_no_view_does_not_refuse(emu: ferry.Runtime) -> None:
    buf, dev = emu.pinned(64), emu.empty(64, np.uint8)
    keep = buf._base  # a reference, not an export: it reads and writes nothing
    assert buf.live_views == 0
    buf, dev = emu.upload_pending(buf, dev).wait()
    assert keep is not None and buf.state == "owned"
    dev, buf = emu.download_pending(dev, buf).wait()
    buf.close()


def test_a_live_export_refuses_every_submission_until_it_is_released(emu: ferry.Runtime) -> None:
    buf, dev = emu.pinned(64), emu.empty(64, np.uint8)
    arr = buf.as_array()
    mv = memoryview(arr[8:])
    del arr
    for submit in (lambda: emu.upload_pending(buf, dev), lambda: emu.download_pending(dev, buf)):
        with pytest.raises(ferry.TransferSubmitError, match="1 live view"):
            submit()
        assert buf.state == "owned" and dev.state == "owned"
    mv.release()  # its array (and so the export) goes with it
    assert buf.live_views == 0
    buf, dev = emu.upload_pending(buf, dev).wait()
    buf.close()


def test_a_closed_buffers_view_keeps_the_block_out_of_the_pool(emu: ferry.Runtime) -> None:
    buf = emu.pinned(4096)
    arr = buf.as_array()
    address = arr.ctypes.data
    buf.close()
    assert buf.live_views == 0  # closed: it has no views to count
    other = emu.pinned(4096)
    assert other.as_array().ctypes.data != address  # the view's block was not handed out again
    arr[:] = 3  # and it is still the view's
    other.close()


@pytest.mark.parametrize("native", ["1", "0"])
def test_both_engines_count_and_refuse_the_same(native: str) -> None:
    code = textwrap.dedent("""
        import json
        import numpy as np, ferry
        rt = ferry.Runtime("emulated")
        buf, dev = rt.pinned(4096), rt.empty(4096, np.uint8)
        v = buf.as_array(np.float32); p = v[10:20]; mv = memoryview(p); d = np.asarray(mv); o = buf.as_array()
        counts = [buf.live_views]
        try:
            rt.upload_pending(buf, dev)
        except ferry.TransferSubmitError as e:
            counts.append(str(e).split(" has ")[1].split(" live")[0])
        del v, o, p, mv
        counts.append(buf.live_views)
        del d
        counts.append(buf.live_views)
        buf, dev = rt.upload_pending(buf, dev).wait()
        print(json.dumps([type(buf._base).__module__, counts, buf.state]))
        rt.close()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), FERRY_NATIVE=native)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    module, counts, state = json.loads(out.stdout)
    assert counts == [2, "2", 1, 0] and state == "owned"
    built = _native._import()[0] is not None  # (whatever FERRY_NATIVE says in this process)
    assert module == ("ferry._native.objects" if native == "0" or not built else "ferry._native._engine")


# -- the module's state outlives every object of it -------------------------------------------------


@pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")
def test_objects_outliving_the_modules_removal_and_living_to_shutdown_stay_sound() -> None:
    code = textwrap.dedent("""
        import gc, importlib, sys
        import numpy as np, ferry
        from ferry._native import _engine as first
        rt = ferry.Runtime("emulated")
        buf = rt.pinned(64)
        view = buf.as_array()
        record = first.new_record(1, None, None, (), (), (), 8)
        del sys.modules["ferry._native._engine"]
        again = importlib.import_module("ferry._native._engine")
        assert again.HostMemory is not first.HostMemory and again.Record is not first.Record  # its own state
        del first, again
        gc.collect()
        view[:] = 1  # still the buffer's, still counted
        assert buf.live_views == 1 and record.nbytes == 8
        keep = [view, record, buf]  # finalized at shutdown, after the module's dict is cleared
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("FERRY_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
