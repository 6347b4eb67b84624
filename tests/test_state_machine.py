"""A hypothesis state machine over the public API on the emulated device.

Steps: allocate, view, drop a view, upload, download, poll, wait, drop a
handle, inject a fault, close. After every step: nothing in flight is
readable, every completed round trip returned the bytes sent, the stats add
up, the retirement queue stays bounded. After close(): everything is freed
except what was abandoned, and the emulated device saw no invariant violation.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ferry
from ferry import testing

CAPACITY = 4
SIZES = st.sampled_from([1, 8, 64, 4096, 70_000])


@dataclass
class Buf:
    obj: ferry.PinnedHostBuffer
    data: bytes  # what the buffer holds (bytes ferry must not change while it is owned)


@dataclass
class Dev:
    obj: ferry.DeviceArray
    data: bytes | None  # what the device holds, when known


@dataclass
class Pending:
    handle: ferry.PendingUpload | ferry.PendingDownload
    kind: str
    buf: Buf
    dev: Dev
    fails: bool


@dataclass
class Model:
    bufs: list[Buf] = field(default_factory=list)
    devs: list[Dev] = field(default_factory=list)
    views: list[tuple[Buf, np.ndarray]] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    fault_armed: bool = False


class FerryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rt = ferry.Runtime(
            "emulated", retirement_capacity=CAPACITY, emulated_bandwidth=1e12, emulated_latency=0.0
        )
        self.m = Model()
        self.closed = False
        self.seed = 0

    # -- allocation and views ----------------------------------------------------------------
    @precondition(lambda self: not self.closed and len(self.m.bufs) < 6)
    @rule(size=SIZES)
    def alloc_buffer(self, size: int) -> None:
        buf = self.rt.pinned(size)
        self.seed += 1
        data = np.random.default_rng(self.seed).integers(0, 256, size, dtype=np.uint8)
        buf.as_array()[:] = data
        self.m.bufs.append(Buf(buf, data.tobytes()))

    @precondition(lambda self: not self.closed and len(self.m.devs) < 6)
    @rule(size=SIZES)
    def alloc_device(self, size: int) -> None:
        self.m.devs.append(Dev(self.rt.empty(size, np.uint8), None))

    @precondition(lambda self: not self.closed and any(b.obj.state == "owned" for b in self.m.bufs))
    @rule(data=st.data())
    def make_view(self, data: st.DataObject) -> None:
        owned = [b for b in self.m.bufs if b.obj.state == "owned"]
        buf = data.draw(st.sampled_from(owned))
        view = buf.obj.as_array()[: max(1, buf.obj.nbytes // 2)]
        assert view.tobytes() == buf.data[: view.nbytes]
        self.m.views.append((buf, view))

    @precondition(lambda self: bool(self.m.views))
    @rule(data=st.data())
    def drop_view(self, data: st.DataObject) -> None:
        self.m.views.pop(data.draw(st.integers(0, len(self.m.views) - 1)))

    # -- submissions ---------------------------------------------------------------------------
    def _views_of(self, buf: Buf) -> int:
        return sum(1 for b, _ in self.m.views if b is buf)

    @precondition(lambda self: not self.closed and self.m.bufs and self.m.devs)
    @rule(data=st.data())
    def upload(self, data: st.DataObject) -> None:
        buf = data.draw(st.sampled_from(self.m.bufs))
        dev = data.draw(st.sampled_from(self.m.devs))
        ok = (
            buf.obj.state == "owned"
            and self._views_of(buf) == 0
            and dev.obj.state == "owned"
            and buf.obj.nbytes >= dev.obj.nbytes
        )
        states = (buf.obj.state, dev.obj.state)
        if not ok:
            with pytest.raises(ferry.TransferSubmitError):
                self.rt.upload_pending(buf.obj, dev.obj)
            assert (buf.obj.state, dev.obj.state) == states  # a refusal changes nothing
            return
        handle = self.rt.upload_pending(buf.obj, dev.obj)
        self.m.pending.append(Pending(handle, "upload", buf, dev, self.m.fault_armed))
        self.m.fault_armed = False

    @precondition(lambda self: not self.closed and self.m.bufs and self.m.devs)
    @rule(data=st.data())
    def download(self, data: st.DataObject) -> None:
        buf = data.draw(st.sampled_from(self.m.bufs))
        dev = data.draw(st.sampled_from(self.m.devs))
        ok = (
            buf.obj.state == "owned"
            and self._views_of(buf) == 0
            and dev.obj.state in ("owned", "read_leased")
            and dev.data is not None  # only download what has known contents
            and buf.obj.nbytes >= dev.obj.nbytes
        )
        if dev.data is None and buf.obj.state == "owned" and self._views_of(buf) == 0 and dev.obj.state in (
            "owned",
            "read_leased",
        ):
            return  # legal but its bytes are undefined: skip rather than refuse
        states = (buf.obj.state, dev.obj.state)
        if not ok:
            with pytest.raises(ferry.TransferSubmitError):
                self.rt.download_pending(dev.obj, buf.obj)
            assert (buf.obj.state, dev.obj.state) == states
            return
        handle = self.rt.download_pending(dev.obj, buf.obj)
        self.m.pending.append(Pending(handle, "download", buf, dev, self.m.fault_armed))
        self.m.fault_armed = False

    # -- completion ------------------------------------------------------------------------------
    @precondition(lambda self: not self.closed and bool(self.m.pending))
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        p = self.m.pending.pop(data.draw(st.integers(0, len(self.m.pending) - 1)))
        if p.fails:
            with pytest.raises(ferry.TransferFailedError):
                p.handle.wait()
            self._forget(p.buf, p.dev)
            return
        result = p.handle.wait()
        n = p.dev.obj.nbytes
        if p.kind == "upload":
            assert result == (p.buf.obj, p.dev.obj)
            p.dev.data = p.buf.data[:n]
        else:
            assert result == (p.dev.obj, p.buf.obj)
            assert p.dev.data is not None
            assert p.buf.obj.as_array()[:n].tobytes() == p.dev.data  # the round trip returned the bytes
            p.buf.data = p.dev.data + p.buf.data[n:]

    @precondition(lambda self: not self.closed and bool(self.m.pending))
    @rule(data=st.data())
    def drop_handle(self, data: st.DataObject) -> None:
        p = self.m.pending.pop(data.draw(st.integers(0, len(self.m.pending) - 1)))
        # a dropped handle drops what it moved: the buffer, and an upload's destination
        self._forget(p.buf, p.dev if p.kind == "upload" or p.fails else None)
        del p

    def _forget(self, buf: Buf, dev: Dev | None) -> None:
        self.m.bufs = [b for b in self.m.bufs if b is not buf]
        self.m.views = [(b, v) for b, v in self.m.views if b is not buf]
        if dev is not None:
            self.m.devs = [d for d in self.m.devs if d is not dev]

    @precondition(lambda self: not self.closed)
    @rule()
    def poll(self) -> None:
        self.rt.poll()

    @precondition(lambda self: not self.closed and not self.m.fault_armed)
    @rule()
    def inject_fault(self) -> None:
        testing.fail_next_copy(self.rt)
        self.m.fault_armed = True

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        self.m.views.clear()
        self.rt.close()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule()
    def every_call_raises_after_close(self) -> None:
        with pytest.raises(ferry.RuntimeClosedError):
            self.rt.pinned(8)
        with pytest.raises(ferry.RuntimeClosedError):
            self.rt.empty(8)
        for p in self.m.pending:
            with pytest.raises(ferry.FerryError):
                p.handle.wait()
        self.m.pending.clear()

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def nothing_in_flight_is_readable(self) -> None:
        for b in self.m.bufs:
            if b.obj.state != "owned":
                with pytest.raises(ferry.BufferMovedError):
                    b.obj.as_array()
            elif self._views_of(b) == 0:
                assert b.obj.as_array().tobytes() == b.data  # owned bytes never change under us

    @invariant()
    def stats_add_up(self) -> None:
        s = self.rt.stats()
        assert s.retiring <= CAPACITY
        assert s.submitted == s.completed + s.failed + s.in_flight + s.retiring

    def teardown(self) -> None:
        self.m.views.clear()
        self.m.pending.clear()
        self.m.bufs.clear()
        self.m.devs.clear()
        gc.collect()
        self.rt.close()
        s = self.rt.stats()
        abandoned = [
            o for o in testing.abandoned_objects(self.rt) if isinstance(o, ferry.DeviceArray)
        ]
        assert s.in_flight == 0 and s.retiring == 0
        assert s.device_bytes == sum(o.nbytes for o in abandoned)  # abandoned memory stays allocated
        assert testing.violations(self.rt) == []
        device_allocs, _ = testing.backend_of(self.rt).live_allocations()
        assert device_allocs == sum(1 for o in abandoned if o.nbytes)  # everything else was freed


TestFerryStateMachine = FerryMachine.TestCase
TestFerryStateMachine.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
