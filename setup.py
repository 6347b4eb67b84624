"""Build the optional native staging engine, ``ferry._native._engine``.

Everything else about the package lives in pyproject.toml; setuptools reads
this file beside it. The extension is C11 + pthreads against Python's limited
API (abi3, so one wheel serves CPython 3.11-3.13) and needs no CUDA toolkit:
the driver's entry points are handed over at run time. ``optional=True``:
when no C compiler is available the install still succeeds and ferry runs
its pure-Python engine (``python -m ferry info`` says which one runs).

``FERRY_NATIVE_CFLAGS`` adds compiler flags, e.g. ``-fsanitize=thread -g``.
"""

from __future__ import annotations

import os
import shlex
import sys

from setuptools import Extension, setup

# One extension module from several sources (src/ferry/_native/README.md lists them): core/ is plain
# C11 + pthreads without Python.h, the rest are the Python-facing types.
NATIVE = "src/ferry/_native/"
SOURCES = [
    NATIVE + name
    for name in (
        "core/jobs.c",
        "core/copy.c",
        "core/driver.c",
        "core/lanes.c",
        "core/engine.c",
        "core/file.c",
        "core/pieces.c",
        "emulated.c",
        "engine.c",
        "calls.c",
        "records.c",
        "objects.c",
        "lock.c",
        "fast.c",
        "entries.c",
        "small.c",
        "tree.c",
        "host.c",
        "dlpack.c",
        "module.c",
    )
]
HEADERS = [NATIVE + "native.h", NATIVE + "core/core.h"]

ext_modules = []
if sys.platform != "win32":  # pthreads and POSIX clocks
    extra = shlex.split(os.environ.get("FERRY_NATIVE_CFLAGS", ""))
    ext_modules.append(
        Extension(
            "ferry._native._engine",
            sources=SOURCES,
            depends=HEADERS,
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            extra_compile_args=[
                "-std=c11",
                "-O2",
                "-pthread",
                "-fvisibility=hidden",
                "-Wall",
                "-Wextra",
                "-Wno-missing-field-initializers",
                *extra,
            ],
            extra_link_args=["-pthread", *extra],
            optional=True,
        )
    )

setup(ext_modules=ext_modules, options={"bdist_wheel": {"py_limited_api": "cp311"}})
