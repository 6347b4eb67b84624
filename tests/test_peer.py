"""Several devices: routes, device-to-device copies, ownership across runtimes.

Every test runs on the emulated machine (two devices); those that need no fault
injection also run on CUDA when the machine has two usable GPUs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import ferry
from ferry import testing

MiB = 1 << 20
SMALL_SLOTS = ferry.StagingConfig(slot_bytes=256 << 10, slots_per_lane=2, lanes=2, direct_bytes=64 << 10)

# the machine, pair and emulated_pair fixtures (two runtimes on devices 0 and 1) live in conftest.py


def test_routes_report_every_pair_and_why(machine: str) -> None:
    found = {(r.source, r.destination): r for r in ferry.routes(machine)}
    count = max(d for d, _ in found) + 1
    assert count >= 2 and set(found) == {(i, j) for i in range(count) for j in range(count)}
    assert all(found[(i, i)].route == "same device" for i in range(count))
    across = found[(0, 1)]
    assert across.route in ("peer", "staged") and across.reason
    assert (across.route == "peer") == (across.attributes["access_supported"] == 1)
    if machine == "emulated":
        assert across.route == "peer"


def test_a_single_device_machine_reports_one_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_EMULATED_DEVICES", "1")
    assert [(r.source, r.destination, r.route) for r in ferry.routes("emulated")] == [(0, 0, "same device")]
    with pytest.raises(ferry.DeviceUnavailableError, match="no device 1"):
        ferry.Runtime("emulated", 1)


@pytest.mark.parametrize("peer", [True, False])
def test_a_copy_between_devices_moves_the_destination_and_leases_the_source(machine: str, peer: bool) -> None:
    a = ferry.Runtime(machine, 0)  # type: ignore[arg-type]
    b = ferry.Runtime(machine, 1, peer_access=peer, staging=SMALL_SLOTS)  # type: ignore[arg-type]
    try:
        data = (np.arange(3 * MiB + 777) % 249).astype(np.uint8)
        src = a.to_device(data)
        dst = b.empty(data.shape, np.uint8)
        with testing.hold(b, "both"):
            pending = b.copy_pending(src, dst)
            assert src.state == "read_leased" and dst.state == "in_flight"
            with pytest.raises(ferry.TransferSubmitError):
                a.upload_pending(a.pinned(data.nbytes), src)  # a leased source is no destination
            also = a.download_pending(src, a.pinned(data.nbytes))  # but it feeds more downloads
        got_src, got_dst = pending.wait()
        assert got_src is src and got_dst is dst
        assert src.state == "read_leased"  # the other download still holds it
        also.wait()
        assert src.state == "owned" and dst.state == "owned"
        assert np.array_equal(b.to_host(dst), data)
        assert b.stats().pinned_pool_bytes <= 4 * MiB + 4 * SMALL_SLOTS.slot_bytes  # no payload-sized staging
    finally:
        b.close()
        a.close()
    assert testing.violations(a) == [] and testing.violations(b) == []


def test_same_device_copies(pair: tuple[ferry.Runtime, ferry.Runtime]) -> None:
    a, _ = pair
    data = np.arange(100_000, dtype=np.float32)
    src, dst = a.to_device(data), a.empty(data.shape, np.float32)
    got_src, got_dst = a.copy_pending(src, dst).wait()
    assert np.array_equal(a.to_host(got_dst), data) and got_src.state == "owned"


def test_both_directions_at_once(pair: tuple[ferry.Runtime, ferry.Runtime]) -> None:
    a, b = pair
    x = np.random.default_rng(1).integers(0, 255, MiB, dtype=np.uint8)
    y = np.random.default_rng(2).integers(0, 255, MiB, dtype=np.uint8)
    xa, yb = a.to_device(x), b.to_device(y)
    xb, ya = b.empty(MiB, np.uint8), a.empty(MiB, np.uint8)
    first, second = b.copy_pending(xa, xb), a.copy_pending(yb, ya)
    second.wait()
    first.wait()
    assert np.array_equal(b.to_host(xb), x) and np.array_equal(a.to_host(ya), y)


def test_device_copy_refusals_change_nothing(pair: tuple[ferry.Runtime, ferry.Runtime]) -> None:
    a, b = pair
    src, dst = a.empty(1024, np.uint8), b.empty(512, np.uint8)
    with pytest.raises(ferry.TransferSubmitError, match="destination's runtime"):
        a.copy_pending(src, dst)
    with pytest.raises(ferry.TransferSubmitError, match="holds 512"):
        b.copy_pending(src, dst)
    with pytest.raises(ferry.TransferSubmitError, match="two different"):
        a.copy_pending(src, src)
    with pytest.raises(ferry.TransferSubmitError, match="DeviceArray"):
        b.copy_pending(np.zeros(4), dst)  # type: ignore[arg-type]
    assert src.state == "owned" and dst.state == "owned"


def test_a_copy_between_backends_is_refused_and_changes_nothing(
    pair: tuple[ferry.Runtime, ferry.Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry._runtime import parts_of

    a, b = pair
    src, dst = a.empty(64, np.uint8), b.empty(64, np.uint8)
    monkeypatch.setattr(parts_of(a).backend, "name", "other")  # as if the source were on another backend
    with pytest.raises(ferry.TransferSubmitError, match=f"from a other device to a {b.backend} device"):
        b.copy_pending(src, dst)
    assert src.state == "owned" and dst.state == "owned"


@pytest.mark.cuda
def test_a_copy_from_the_emulated_device_to_a_gpu_is_refused() -> None:
    gpu, emulated = ferry.Runtime("cuda"), ferry.Runtime("emulated")
    try:
        src, dst = emulated.empty(64, np.uint8), gpu.empty(64, np.uint8)
        with pytest.raises(ferry.TransferSubmitError, match="from a emulated device to a cuda device"):
            gpu.copy_pending(src, dst)
        assert src.state == "owned" and dst.state == "owned"
    finally:
        gpu.close()
        emulated.close()


def test_a_failed_device_copy_abandons_both_sides(emulated_pair: tuple[ferry.Runtime, ferry.Runtime]) -> None:
    a, b = emulated_pair
    src, dst = a.to_device(np.arange(1000)), b.empty(1000, np.int64)
    testing.fail_next_copy(b)
    with pytest.raises(ferry.TransferFailedError):
        b.copy_pending(src, dst).wait()
    assert dst.state == "abandoned" and src.state == "abandoned"
    assert b.stats().failed == 1


def test_a_dropped_device_copy_retires_and_returns_the_lease(pair: tuple[ferry.Runtime, ferry.Runtime]) -> None:
    a, b = pair
    src = a.to_device(np.arange(10_000))
    dst = b.empty(10_000, np.int64)
    b.copy_pending(src, dst)  # dropped
    deadline = time.monotonic() + 10
    while (b.stats().retiring or src.state != "owned") and time.monotonic() < deadline:
        b.poll()
        time.sleep(0.001)
    assert src.state == "owned" and dst.state == "closed"


def test_device_copies_inside_a_batch(pair: tuple[ferry.Runtime, ferry.Runtime]) -> None:
    a, b = pair
    data = np.arange(50_000, dtype=np.int32)
    same_src, same_dst = a.to_device(data), a.empty(data.shape, np.int32)
    peer_src, peer_dst = a.to_device(data[::-1].copy()), b.empty(data.shape, np.int32)
    with a.batch():
        local = a.copy_pending(same_src, same_dst)
    with b.batch():
        remote = b.copy_pending(peer_src, peer_dst)
    local.wait()
    remote.wait()
    assert np.array_equal(a.to_host(same_dst), data)
    assert np.array_equal(b.to_host(peer_dst), data[::-1])


@pytest.mark.cuda
def test_cuda_routes_cover_every_device_the_driver_counts() -> None:
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    err, count = driver.cuDeviceGetCount()
    assert not err
    found = ferry.routes("cuda")
    assert sorted((r.source, r.destination) for r in found) == [(i, j) for i in range(count) for j in range(count)]
    assert all((r.route == "same device") == (r.source == r.destination) for r in found)


@pytest.mark.cuda(devices=2)
def test_ferry_gives_the_thread_its_current_context_back() -> None:
    """A user's current device (another library's, here device 1's primary context) stays theirs."""
    from cuda.bindings import driver

    err, before = driver.cuCtxGetCurrent()
    err, dev1 = driver.cuDeviceGet(1)
    err, ctx1 = driver.cuDevicePrimaryCtxRetain(dev1)
    assert not err
    try:
        (err,) = driver.cuCtxSetCurrent(ctx1)
        assert not err
        with ferry.Runtime("cuda", 0) as rt:
            data = np.arange(1 << 20, dtype=np.uint8)
            dev = rt.to_device(data)
            assert np.array_equal(rt.to_host(dev), data)
            err, current = driver.cuCtxGetCurrent()
            assert int(current) == int(ctx1)
            dev.close()
        err, current = driver.cuCtxGetCurrent()
        assert int(current) == int(ctx1)
    finally:
        driver.cuCtxSetCurrent(before)  # leave the thread as the test found it
        driver.cuDevicePrimaryCtxRelease(dev1)
