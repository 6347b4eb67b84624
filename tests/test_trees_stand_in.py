"""Trees on the CUDA backend with the stand-in driver (``benchmarks/fake_cuda.c``): the calls a tree makes.

As in ``test_stand_in_driver.py``, each case runs in a subprocess whose ``libcuda.so.1`` is the stand-in,
so ferry's CUDA backend runs here without a GPU. What it shows is the driver calls a tree transfer makes
and the resources it takes and gives back, not timing.
"""

from __future__ import annotations

from pathlib import Path

from test_stand_in_driver import pytestmark, run  # noqa: F401  (its skips)


def test_an_offload_of_many_leaves_is_one_dma_into_a_reused_block(stand_in: Path) -> None:
    # a fresh tree (one device allocation) downloaded into pinned leaves (one pooled block): the leaves
    # follow each other on both sides, so the whole tree is one DMA; the next rounds reuse the block
    out = run(stand_in, """
        import gc
        import numpy as np
        import ferry
        from ferry import testing
        from ferry._runtime import parts_of

        rt = ferry.Runtime("cuda")
        backend = testing.backend_of(rt)
        seen = {"d2h": 0, "h2d": 0, "batch": 0}
        dtoh, htod, batch = backend.dtoh_record, backend.htod_record, backend.copy_batch

        def counted(key, fn):
            def wrapper(*args):
                seen[key] += 1
                return fn(*args)
            return wrapper

        backend.dtoh_record = counted("d2h", dtoh)
        backend.htod_record = counted("h2d", htod)
        backend.copy_batch = counted("batch", batch)
        rng = np.random.default_rng(5)
        tree = {f"layer{i}": rng.integers(0, 255, 1 << 20, dtype=np.uint8) for i in range(64)}
        _, dev = rt.upload_tree(tree).wait()
        pool = parts_of(rt).host.pinned_leaves.pool
        allocations = []
        for _ in range(4):
            before = dict(seen)
            _, host = rt.download_tree(dev, pinned=True).wait()
            assert all(np.array_equal(host[k], v) for k, v in tree.items())
            print("round", seen["d2h"] - before["d2h"], seen["batch"] - before["batch"])
            _, back = rt.upload_tree(host, dev).wait()  # the reload: one DMA too
            print("reload", seen["h2d"] - before["h2d"])
            del host, back
            gc.collect()
            allocations.append(pool.allocations)
        print("allocations", *allocations)
        rt.close()
    """)
    lines = out.splitlines()
    rounds = [line.split() for line in lines if line.startswith("round")]
    assert rounds == [["round", "1", "0"]] * 4  # one DMA for 64 leaves, no batched copy
    assert [line for line in lines if line.startswith("reload")] == ["reload 1"] * 4
    allocations = [int(n) for n in lines[-1].split()[1:]]
    assert len(set(allocations)) == 1  # the first round's block is reused by every later round
