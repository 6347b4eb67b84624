"""Whole structures in one submission: Runtime.upload_tree / download_tree, pinned leaves."""

from __future__ import annotations

import asyncio
import collections
import gc
from typing import Any

import numpy as np
import pytest

import ferry
from conftest import eventually
from ferry import _trees, testing
from ferry._routes import _groups as _leafgroups

KiB, MiB = 1 << 10, 1 << 20
Pair = collections.namedtuple("Pair", "first second")


def make_tree(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((64, 32)).astype(np.float32),
        "layers": [
            {"w": rng.standard_normal((128, 128)).astype(np.float16), "b": np.arange(7, dtype=np.int64)},
            {"w": rng.integers(0, 255, 3 * MiB, dtype=np.uint8), "b": np.arange(3, dtype=np.int8)},
        ],
        "pair": Pair(np.full(5, 3.5), None),
        "step": 12,
        "name": "model",
        "scale": (np.float32(2.0), np.ones((2, 2), dtype=np.float32)),
    }


def leaves(tree: Any) -> list[np.ndarray]:
    found: list[np.ndarray] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, np.ndarray):
            found.append(x)

    walk(tree)
    return found


def host_copy_of(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: host_copy_of(v) for k, v in tree.items()}
    if isinstance(tree, Pair):
        return Pair(*(host_copy_of(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(host_copy_of(v) for v in tree)
    return tree.copy() if isinstance(tree, np.ndarray) else tree


def assert_same_tree(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_tree(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_tree(g, w)
    elif isinstance(want, np.ndarray):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got, want)
    else:
        assert got is want or got == want


def test_a_tree_goes_up_and_comes_back_with_its_structure_and_leaf_types(rt: ferry.Runtime) -> None:
    tree = make_tree()
    expected = host_copy_of(tree)
    pending = rt.upload_tree(tree)
    assert isinstance(pending, ferry.PendingUpload)
    assert pending.nbytes == sum(a.nbytes for a in leaves(tree))
    same, device = pending.wait()
    assert same is tree
    assert isinstance(device["layers"][0]["w"], ferry.DeviceArray)
    assert type(device["pair"]) is Pair and device["pair"].second is None
    assert device["step"] == 12 and device["name"] == "model"
    assert device["scale"][0] is tree["scale"][0]  # a NumPy scalar passes through
    assert all(a.flags.writeable for a in leaves(tree))
    down = rt.download_tree(device)
    assert isinstance(down, ferry.PendingDownload)
    source, host = down.wait()
    assert source is device
    assert_same_tree(host, expected)
    with pytest.raises(ferry.FerryError):
        down.wait()  # at most once


def test_destination_and_out_are_filled_and_returned(rt: ferry.Runtime) -> None:
    tree = make_tree(1)
    _, device = rt.upload_tree(tree).wait()
    fresh = make_tree(2)
    _, filled = rt.upload_tree(fresh, device).wait()
    assert filled is device
    out = host_copy_of(make_tree(3))
    _, host = rt.download_tree(device, out).wait()
    assert host is out
    assert_same_tree(out, host_copy_of(fresh))


def test_a_mismatched_destination_is_refused_before_anything_moves(emu: ferry.Runtime) -> None:
    tree = make_tree(4)
    _, device = emu.upload_tree(tree).wait()
    before = emu.stats().submitted
    wrong = dict(device, layers=[device["layers"][0], dict(device["layers"][1], b=emu.empty(4, np.int8))])
    with pytest.raises(ferry.TransferSubmitError, match=r"\['layers'\]\[1\]\['b'\].*shape"):
        emu.upload_tree(tree, wrong)
    missing = {k: v for k, v in device.items() if k != "embed"}
    with pytest.raises(ferry.TransferSubmitError, match="structure"):
        emu.upload_tree(tree, missing)
    twice = dict(device, embed=device["pair"].first)
    twice["pair"] = Pair(device["pair"].first, None)
    with pytest.raises(ferry.TransferSubmitError):
        emu.upload_tree(tree, twice)
    with pytest.raises(ferry.TransferSubmitError, match="not a host array"):
        emu.upload_tree({"a": np.ones(3), "b": object()})
    with pytest.raises(ferry.TransferSubmitError, match="pinned"):
        emu.download_tree(device, host_copy_of(tree), pinned=True)
    bad_out = host_copy_of(tree)
    bad_out["embed"] = np.empty((64, 32), np.float64)
    with pytest.raises(ferry.TransferSubmitError, match="embed"):
        emu.download_tree(device, bad_out)
    with pytest.raises(ValueError):
        emu.upload_tree(tree, to="numpy")
    assert emu.stats().submitted == before
    assert all(a.flags.writeable for a in leaves(tree))
    assert all(d.state == "owned" for d in (device["embed"], device["layers"][1]["w"]))
    _, again = emu.upload_tree(tree, device).wait()  # everything is still usable
    assert again is device


def test_a_destination_in_flight_is_refused_and_nothing_moves(emu: ferry.Runtime) -> None:
    tree = make_tree(5)
    _, device = emu.upload_tree(tree).wait()
    pending = emu.upload(tree["embed"], device["embed"])
    before = emu.stats().submitted
    with pytest.raises(ferry.TransferSubmitError, match="embed"):
        emu.upload_tree(tree, device)
    assert emu.stats().submitted == before
    pending.wait()
    assert device["layers"][0]["w"].state == "owned"


def test_a_leaf_refused_midway_leaves_every_leaf_owned(emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = make_tree(6)
    _, device = emu.upload_tree(tree).wait()
    real = emu.upload
    calls = [0]

    def refusing(source: Any, destination: Any = None) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise ferry.TransferSubmitError("refused for the test")
        return real(source, destination)

    emu.upload = refusing  # type: ignore[method-assign]
    monkeypatch.setattr(_leafgroups, "SMALL_BYTES", 0)  # every leaf one by one, through rt.upload
    monkeypatch.setattr(_trees, "pieces_ready", lambda rt, upload: False)  # not one job for the tree
    try:
        with pytest.raises(ferry.TransferSubmitError, match="every leaf is owned"):
            emu.upload_tree(tree, device)
    finally:
        del emu.upload
    states = [device["embed"].state, device["layers"][0]["w"].state, device["layers"][0]["b"].state]
    assert states == ["owned", "owned", "owned"]
    assert all(a.flags.writeable for a in leaves(tree))
    assert emu.stats().in_flight == 0


def test_a_group_refused_midway_leaves_every_leaf_owned(emu: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = make_tree(6)
    _, device = emu.upload_tree(tree).wait()
    real = _trees.submit_small
    calls = [0]

    def refusing(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise ferry.TransferSubmitError("refused for the test")
        return real(*args)

    monkeypatch.setattr(_leafgroups, "GROUP_BYTES", 1)  # one leaf a group: the third group is refused
    monkeypatch.setattr(_trees, "submit_small", refusing)
    monkeypatch.setattr(_trees, "pieces_ready", lambda rt, upload: False)  # not one job for the tree
    with pytest.raises(ferry.TransferSubmitError, match="every leaf is owned"):
        emu.upload_tree(tree, device)
    assert calls[0] == 3
    states = [device["embed"].state, device["layers"][0]["w"].state, device["layers"][0]["b"].state]
    assert states == ["owned", "owned", "owned"]
    assert all(a.flags.writeable for a in leaves(tree))
    assert emu.stats().in_flight == 0
    # a fresh tree refused midway: the destinations made for it are freed, the tree's arrays are writable
    calls[0] = 0
    with pytest.raises(ferry.TransferSubmitError, match="every leaf is owned"):
        emu.upload_tree(tree)
    assert all(a.flags.writeable for a in leaves(tree))
    assert emu.stats().in_flight == 0


def test_one_failed_leaf_fails_the_tree_and_publishes_nothing(emu: ferry.Runtime) -> None:
    tree = make_tree(7)
    _, device = emu.upload_tree(tree).wait()
    out = host_copy_of(make_tree(8))
    kept = host_copy_of(out)
    testing.fail_next_copy(emu, after=1)
    pending = emu.download_tree(device, out)
    with pytest.raises(ferry.TransferFailedError, match="leaf"):
        pending.wait()
    with pytest.raises(ferry.TransferFailedError):
        pending.is_ready()
    assert emu.stats().failed >= 1
    assert len(testing.abandoned_objects(emu)) >= 1
    # the runtime goes on working
    fresh = make_tree(9)
    _, dev2 = emu.upload_tree(fresh).wait()
    _, back = emu.download_tree(dev2).wait()
    assert_same_tree(back, host_copy_of(fresh))
    del kept


def test_a_failed_upload_tree_releases_the_other_leaves(emu: ferry.Runtime) -> None:
    tree = make_tree(10)
    start = testing.live_objects(emu)
    testing.fail_next_copy(emu, after=2)
    pending = emu.upload_tree(tree)
    with pytest.raises(ferry.TransferFailedError) as caught:
        pending.wait()
    # the handle and the error it raised are still alive: the other leaves retire all the same, once
    # their copies (queued behind the failed one) are proven complete
    assert caught.value is not None and pending is not None
    assert eventually(lambda: (emu.poll(), all(a.flags.writeable for a in leaves(tree)))[1])
    now = testing.live_objects(emu)
    assert now["handles"] == start["handles"]
    assert now["in_flight"] == 0
    assert emu.stats().abandoned >= 1


def test_a_tree_handle_waits_like_any_other(emu: ferry.Runtime) -> None:
    tree = make_tree(11)
    with testing.hold(emu):
        pending = emu.upload_tree(tree)
        assert not pending.is_ready()
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0.01)
    assert pending.wait(timeout=30)[0] is tree
    future = emu.upload_tree(tree).future()
    assert future.result(timeout=30)[0] is tree
    done = ferry.wait_all([emu.upload_tree(tree), emu.upload_tree(tree)])
    assert len(done) == 2 and done[0][0] is tree
    handles = [emu.upload_tree(tree) for _ in range(3)]
    seen = list(ferry.as_completed(handles, timeout=30))
    assert sorted(map(id, seen)) == sorted(map(id, handles))
    assert all(h.wait()[0] is tree for h in handles)

    async def main() -> Any:
        return await emu.upload_tree(tree)

    assert asyncio.run(main())[0] is tree
    called: list[Any] = []
    emu.upload_tree(tree).add_done_callback(lambda h: called.append(h.wait()))
    assert eventually(lambda: bool(called))


def test_a_dropped_tree_handle_retires_every_leaf(emu: ferry.Runtime) -> None:
    tree = make_tree(12)
    start = testing.live_objects(emu)
    with testing.hold(emu):
        emu.upload_tree(tree)  # dropped at once
    gc.collect()
    emu.close(timeout=30)
    assert all(a.flags.writeable for a in leaves(tree))
    assert testing.live_objects(emu)["handles"] == start["handles"]


def test_hand_off_gives_the_device_tree_before_the_copies_are_waited(rt: ferry.Runtime) -> None:
    tree = make_tree(13)
    pending = rt.upload_tree(tree)
    handed = pending.hand_off()
    assert isinstance(handed["embed"], ferry.DeviceArray)
    _, back = rt.download_tree(handed).wait()
    assert_same_tree(back, host_copy_of(tree))
    assert pending.wait()[0] is tree


def test_many_small_leaves_go_to_the_device_as_batches(rt: ferry.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_trees, "pieces_ready", lambda rt, upload: False)  # the pure-Python engine's way
    blocks = {f"block{i}": np.full(16 * KiB, i % 251, dtype=np.uint8) for i in range(300)}
    before = testing.fast_path_counts(rt)
    _, device = rt.upload_tree(blocks).wait()
    after = testing.fast_path_counts(rt)
    assert after["batched_copies"] - before["batched_copies"] == 300
    assert after["batches"] - before["batches"] < 10
    _, back = rt.download_tree(device).wait()
    assert all(np.array_equal(back[k], v) for k, v in blocks.items())


def test_pinned_leaves_come_from_the_pool_and_go_back_up_in_one_dma_each(rt: ferry.Runtime) -> None:
    tree = make_tree(14)
    _, device = rt.upload_tree(tree).wait()
    _, host = rt.download_tree(device, pinned=True).wait()
    assert_same_tree(host, host_copy_of(tree))
    assert all(type(a) is np.ndarray and a.flags.writeable for a in leaves(host))
    copied = rt.stats().host_copied_bytes
    _, again = rt.upload_tree(host, device).wait()
    assert rt.stats().host_copied_bytes == copied  # no staging copy: one DMA per leaf
    one = rt.download(device["layers"][1]["w"], host["layers"][1]["w"])  # a single download into a leaf too
    one.wait()
    assert rt.stats().host_copied_bytes == copied
    assert again is device


def test_pinned_leaves_stay_bounded_over_offload_and_reload_rounds(rt: ferry.Runtime) -> None:
    tree = make_tree(15)
    _, device = rt.upload_tree(tree).wait()
    pool = []
    for _ in range(6):
        _, host = rt.download_tree(device, pinned=True).wait()
        rt.upload_tree(host, device).wait()
        del host
        gc.collect()
        pool.append(rt.stats().pinned_pool_bytes)
    assert pool[2:] == [pool[2]] * 4, pool


def test_a_view_of_a_pinned_leaf_keeps_its_block_out_of_the_pool(rt: ferry.Runtime) -> None:
    _, device = rt.upload_tree({"a": np.arange(MiB, dtype=np.uint8)}).wait()
    _, host = rt.download_tree(device, pinned=True).wait()
    view = host["a"][10:20]
    free = rt.stats().pinned_free_bytes
    del host
    gc.collect()
    assert rt.stats().pinned_free_bytes == free  # the view lives: the block is not back
    assert np.array_equal(view, np.arange(10, 20, dtype=np.uint8))
    _, other = rt.download_tree({"b": rt.to_device(np.zeros(MiB, dtype=np.uint8))}, pinned=True).wait()
    assert np.array_equal(view, np.arange(10, 20, dtype=np.uint8))  # not overwritten by a reuse
    del view, other
    gc.collect()
    assert rt.stats().pinned_free_bytes > free


def test_prefetch_still_takes_structures_apart() -> None:
    batches = [{"x": np.arange(4, dtype=np.float32), "meta": ("id", 3)} for _ in range(3)]
    with ferry.Runtime("emulated") as rt:
        got = [rt.to_host(b["x"]) for b in ferry.prefetch(batches, runtime=rt)]
    assert all(np.array_equal(g, np.arange(4, dtype=np.float32)) for g in got)


@pytest.mark.parametrize("to", ["torch", "cupy", "jax"])
def test_to_gives_that_library_s_device_leaves(to: str, backend_name: str) -> None:
    if backend_name != "cuda":
        pytest.skip("foreign libraries import device arrays of a real GPU")
    module = pytest.importorskip(to)
    with ferry.Runtime("cuda") as rt:
        tree = make_tree(16)
        _, device = rt.upload_tree(tree, to=to).wait()
        leaf = device["layers"][0]["w"]
        assert type(leaf).__module__.split(".")[0] in (to, "jaxlib")
        del module
        _, back = rt.download_tree(device).wait()
        got = back["layers"][0]["w"]
        if to == "torch":
            got = got.numpy()
        assert np.array_equal(np.asarray(got), tree["layers"][0]["w"])


def test_torch_cuda_state_dict_down_and_up(backend_name: str) -> None:
    if backend_name != "cuda":
        pytest.skip("needs a GPU")
    torch = pytest.importorskip("torch")
    with ferry.Runtime("cuda") as rt:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda()
        state = model.state_dict()
        _, host = rt.download_tree(state, pinned=True).wait()
        assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in host.values())
        for key, tensor in state.items():
            assert torch.equal(host[key], tensor.cpu())
        _, again = rt.upload_tree(host, to="torch").wait()
        for key, tensor in state.items():
            assert torch.equal(again[key], tensor)


def test_a_failed_leaf_keeps_the_other_leaves_from_publishing_into_out() -> None:
    # one DMA per leaf, copied out at settle (the direct route): a tree that fails copies none of them out
    with ferry.Runtime("emulated", staging=ferry.StagingConfig(engine="python")) as rt:
        tree = {f"leaf{i}": np.full(MiB, i + 1, np.uint8) for i in range(3)}
        _, device = rt.upload_tree(tree).wait()
        out = {k: np.zeros(MiB, np.uint8) for k in tree}
        testing.fail_next_copy(rt, after=2)  # the third leaf's copy fails
        pending = rt.download_tree(device, out)
        with pytest.raises(ferry.TransferFailedError, match="leaf2"):
            pending.wait()
        assert not out["leaf0"].any() and not out["leaf1"].any()  # nothing was published
        rt.poll()  # the released leaves retire once their copies are proven complete
        assert all(a.flags.writeable for a in out.values())
        assert device["leaf0"].state == "owned"  # its lease ended: the leaf is usable again
        assert np.array_equal(rt.to_host(device["leaf0"]), tree["leaf0"])


def test_foreign_device_leaves_download_and_fill(emu: ferry.Runtime) -> None:
    data = {"a": np.arange(1000, dtype=np.float32), "b": [np.full((8, 8), 7, np.int16)]}
    _, backing = emu.upload_tree(data).wait()
    stream = testing.side_stream(emu)
    foreign = {"a": testing.ForeignArray(backing["a"], stream=stream),
               "b": [testing.ForeignArray(backing["b"][0], stream=stream)]}
    source, host = emu.download_tree(foreign).wait()
    assert source is foreign
    assert np.array_equal(host["a"], data["a"]) and np.array_equal(host["b"][0], data["b"][0])
    _, pinned = emu.download_tree(foreign, pinned=True).wait()
    assert np.array_equal(pinned["b"][0], data["b"][0])
    fresh = {"a": np.ones(1000, np.float32), "b": [np.zeros((8, 8), np.int16)]}
    _, filled = emu.upload_tree(fresh, foreign).wait()  # a foreign destination structure is filled in place
    assert filled is foreign
    assert np.array_equal(emu.to_host(backing["a"]), fresh["a"])
    wrong = {"a": testing.ForeignArray(backing["a"], stream=stream),
             "b": [testing.ForeignArray(backing["a"], stream=stream)]}
    with pytest.raises(ferry.TransferSubmitError, match=r"\['b'\]\[0\]"):
        emu.upload_tree(fresh, wrong)  # shape/dtype read from the interface, before anything moves


def test_a_device_leaf_whose_interface_raises_is_still_a_device_leaf() -> None:
    from ferry._structure import is_device_array

    class Odd:  # PyTorch's bfloat16 tensors raise TypeError from the CUDA Array Interface
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            raise TypeError("dtype not supported")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    assert is_device_array(Odd())
    assert not is_device_array(np.ones(3)) and not is_device_array("x")
