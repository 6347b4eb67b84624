"""The compiled module's state belongs to each module object, and outlives none of its objects' needs.

``ferry._native._engine`` keeps its types, its interned names and what Python hands it after the
import (the hot classes, ``numpy.ndarray``, the handles' waited error) in per-module state: a second
module object made by the import machinery gets its own, and every object keeps the state it reads
alive, whether or not its module is still importable.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import textwrap
import weakref
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from ferry import _native

engine = _native.load()

pytestmark = pytest.mark.skipif(engine is None, reason="the compiled extension is not built here")


def fresh_module() -> ModuleType:
    """A second module object of the extension, made by the import machinery (not via sys.modules)."""
    spec = importlib.util.find_spec("ferry._native._engine")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_module_object_has_its_own_types() -> None:
    assert engine is not None
    second = fresh_module()
    assert second is not engine
    for name in ("Record", "Handle", "Fast", "RLock", "HostMemory", "BufferFields", "Engine", "Calls", "DriverError"):
        assert getattr(second, name) is not getattr(engine, name), name
    record = second.new_record(1, None, None, (), (), (), 8)
    assert type(record) is second.Record and type(record) is not engine.Record
    assert type(engine.new_record(1, None, None, (), (), (), 8)) is engine.Record


def test_what_python_hands_one_module_stays_with_it() -> None:
    assert engine is not None
    array = np.zeros(16, dtype=np.uint8)
    # ferry configured its own module at import: it reads NumPy's fields of an exact ndarray
    assert engine.data_of(array) == array.ctypes.data
    second, third = fresh_module(), fresh_module()
    with pytest.raises(TypeError, match=r"needs a numpy\.ndarray"):
        second.data_of(array)  # a fresh module knows no ndarray type yet
    second.set_array_type(np.ndarray)
    assert second.data_of(array) == array.ctypes.data
    with pytest.raises(TypeError, match=r"needs a numpy\.ndarray"):
        third.data_of(array)  # not set through another module object
    second.set_array_type(None)
    assert engine.data_of(array) == array.ctypes.data  # ferry's own module is untouched


def test_hot_classes_are_per_module() -> None:
    assert engine is not None
    second = fresh_module()
    classes = [type(f"Hot{i}", (base,), {}) for i, base in enumerate(
        (second.BufferFields, second.ArrayFields, second.BlockFields, second.HealthFields, second.SlotFields))]
    second.set_hot_types(*classes)  # each derives from this module's field types
    with pytest.raises(TypeError, match="must derive from"):
        engine.set_hot_types(*classes)  # not from the other module's


def test_objects_outlive_their_module_object() -> None:
    second = fresh_module()
    gone = weakref.ref(second)
    lock = second.RLock()
    record = second.new_record(7, None, None, (), (), (), 16)

    class Pending(second.Handle):  # type: ignore[misc, name-defined]
        pass

    class Port:
        def __init__(self) -> None:
            self.detached: list[Any] = []

        def wait(self, record: Any, timeout: Any) -> str:
            return "waited"

        def detach(self, record: Any) -> None:
            self.detached.append(record)

    port = Port()
    handle, dropped = Pending(port, record), Pending(port, record)
    second.set_handle_errors(KeyError)
    del second
    gc.collect()
    assert gone() is not None  # its objects keep it (through their types)
    assert lock.acquire() and lock.acquire(blocking=False)
    lock.release()
    lock.release()
    assert record.seq == 7 and record.nbytes == 16
    assert handle.wait() == "waited"  # the method finds its module's interned names
    with pytest.raises(KeyError):
        handle.wait()  # the waited error handed to that module
    del dropped  # its finalizer finds the module through its base: the record goes to detach
    gc.collect()
    assert port.detached == [record]
    port.detached.clear()
    del lock, record, handle, Pending
    gc.collect()
    assert gone() is None  # and nothing else does: the state is released with it


def test_modules_torn_down_at_shutdown_with_objects_alive() -> None:
    code = textwrap.dedent("""
        import gc, importlib.util, sys
        import numpy as np, ferry
        spec = importlib.util.find_spec("ferry._native._engine")
        keep = []
        for _ in range(3):
            m = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(m)
            class H(m.Handle):
                pass
            class Port:
                def detach(self, record):
                    pass
            keep += [m.RLock(), m.new_record(1, None, None, (), (), (), 8), H(Port(), None), H]
            keep.append(keep)  # a cycle, collected (or not) at shutdown
        rt = ferry.Runtime("emulated")
        buf = rt.pinned(64)
        view = buf.as_array()
        del m
        gc.collect()
        view[:] = 1
        keep += [rt, buf, view]
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("FERRY_NATIVE", None)
    out = subprocess.run([sys.executable, "-X", "dev", "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Py_mod_multiple_interpreters exists from 3.12")
def test_an_isolated_subinterpreter_refuses_the_module() -> None:
    assert engine is not None
    code = textwrap.dedent(f"""
        try:
            import _interpreters as subinterpreters
        except ImportError:
            import _xxsubinterpreters as subinterpreters
        interp = subinterpreters.create()
        subinterpreters.run_string(interp, '''
        import importlib.machinery, importlib.util
        path = {engine.__file__!r}
        loader = importlib.machinery.ExtensionFileLoader("ferry._native._engine", path)
        spec = importlib.util.spec_from_file_location("ferry._native._engine", path, loader=loader)
        try:
            importlib.util.module_from_spec(spec)
            print("imported")
        except ImportError as exc:
            print("refused" if "subinterpreters" in str(exc) else exc)
        ''')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stdout + out.stderr
