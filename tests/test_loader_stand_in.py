"""ferry.DataLoader on the CUDA backend, through the stand-in driver (``benchmarks/fake_cuda.c``).

The stand-in makes every CUDA call return at once (copies are a memcpy inside the call, events are
complete), so the loader's CUDA path (the ring registered with ``cuMemHostRegister``, each slot batch one
group of copies, the hand-off to a consumer stream, the device ring's reuse) runs here without a GPU. It
shows the calls and the resources, not the ordering on a device (the GPU tests do). Each case runs in a
subprocess with ``LD_LIBRARY_PATH`` pointing at the stand-in.
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
    pytest.mark.skipif(sys.platform != "linux", reason="fork workers and memfd rings: Linux"),
]


def run(stand_in: Path, code: str) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(stand_in), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("FERRY_NATIVE", None)
    env.pop("FAKECUDA_NOCOPY", None)
    result = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", textwrap.dedent(code)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("to_stream", [False, True])
def test_slot_batches_on_the_cuda_backend_are_right_and_give_everything_back(stand_in: Path,
                                                                             to_stream: bool) -> None:
    """Three epochs of image-shaped batches (a float32 array and int64 labels) from two fork workers: every
    batch holds its samples, in order; after the first batch every one goes through the ring, whose size
    never changes; one group record per batch; closing gives back every registration, every device byte
    and every event in flight, and leaves no worker."""
    out = run(stand_in, """
        import multiprocessing
        import numpy as np
        import ferry
        from ferry import testing

        class Images:
            def __len__(self):
                return 96

            def __getitem__(self, i):
                return np.full((3, 8, 8), i, np.float32), i

        rt = ferry.Runtime("cuda")
        assert rt.backend == "cuda", rt.backend
        before = rt.stats()
        stream = testing.side_stream(rt) if TO_STREAM else None
        loader = ferry.DataLoader(Images(), batch_size=8, num_workers=2, persistent_workers=True,
                                  multiprocessing_context="fork", runtime=rt, stream=stream)
        rings = []
        counts = []
        for epoch in range(3):
            counts.append(rt.stats().submitted)
            seen = []
            for x, y in loader:
                host, labels = rt.to_host(x), rt.to_host(y)
                assert host.shape == (8, 3, 8, 8) and host.dtype == np.float32
                assert labels.dtype == np.int64
                assert np.array_equal(host[:, 0, 0, 0], labels.astype(np.float32))
                seen.extend(labels.tolist())
                del x, y
            assert seen == list(range(96)), seen
            rings.append(loader.ring_bytes)
        fallback = loader.fallback_batches
        counts.append(rt.stats().submitted)
        loader.close()
        rt.poll()
        after = rt.stats()
        print(rings[0] > 0 and len(set(rings)) == 1, fallback, *(b - a for a, b in zip(counts, counts[1:])))
        print(after.registered_bytes, after.device_bytes == before.device_bytes, after.in_flight,
              after.abandoned, len(multiprocessing.active_children()))
        rt.close()
    """.replace("TO_STREAM", str(to_stream)))
    lines = out.splitlines()
    constant, fallback, *records = lines[0].split()
    assert constant == "True"
    # per later epoch, 12 batches: one group record each (both arrays), and the test's 2 downloads
    assert records[1:] == ["36", "36"], records
    assert fallback == "1"  # the loader's first batch sizes the ring; every later one fits
    registered, device_back, in_flight, abandoned, children = lines[1].split()
    assert (registered, device_back, in_flight, abandoned, children) == ("0", "True", "0", "0", "0")


def test_slot_batches_taken_inside_a_runtime_batch_on_the_cuda_backend(stand_in: Path) -> None:
    """A loader iterated inside ``rt.batch()`` on the CUDA backend (each slot batch's copies join the block's
    batch, behind one shared event): every batch right and in order, over two epochs; closing gives back
    every registration, every device byte and every record in flight."""
    out = run(stand_in, """
        import numpy as np
        import ferry

        class Images:
            def __len__(self):
                return 48

            def __getitem__(self, i):
                return np.full((3, 8, 8), i, np.float32), i

        rt = ferry.Runtime("cuda")
        assert rt.backend == "cuda", rt.backend
        before = rt.stats()
        loader = ferry.DataLoader(Images(), batch_size=8, num_workers=2, persistent_workers=True,
                                  multiprocessing_context="fork", runtime=rt)
        with rt.batch():
            for epoch in range(2):
                seen = []
                for x, y in loader:
                    host, labels = rt.to_host(x), rt.to_host(y)
                    assert np.array_equal(host[:, 0, 0, 0], labels.astype(np.float32))
                    seen.extend(labels.tolist())
                    del x, y
                assert seen == list(range(48)), seen
        loader.close()
        rt.poll()
        after = rt.stats()
        print(after.registered_bytes, after.device_bytes == before.device_bytes, after.in_flight, after.abandoned)
        rt.close()
    """)
    assert out.split() == ["0", "True", "0", "0"], out
