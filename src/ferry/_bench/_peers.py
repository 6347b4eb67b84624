"""The peers ferry is compared with, each on the code path its documentation recommends.

* raw driver (``cuda.bindings.driver``): ``cuMemcpy*Async`` + ``cuEventRecord`` +
  ``cuEventSynchronize`` on a pinned (``cuMemHostAlloc``) or pageable buffer:
  the physical ceiling. Its streams and events are ``cuda.bindings`` objects and
  every address is computed before timing, so a timed repeat is the three
  driver calls (and their error checks) and nothing else.
* PyTorch: ``Tensor.copy_`` with and without ``non_blocking``, from pinned
  (``pin_memory=True``) and pageable (``torch.from_numpy``) host tensors,
  followed by a stream synchronize where the copy is non-blocking.
* CuPy: ``ndarray.set`` / ``ndarray.get`` with a stream, from pinned
  (``cupyx.empty_pinned``) and pageable NumPy arrays.

A peer that is not installed (or has no GPU) is skipped and said so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import testing
from ._protocol import poison

__all__: list[str] = []


@dataclass
class Case:
    """An operation to time, with its untimed setup and its validation."""

    impl: str
    route: str
    direction: str
    nbytes: int
    op: Callable[[], Any]
    check: Callable[[], bool]  # poison the destination, run once, compare: outside timing
    setup: Callable[[], Any] | None = None
    close: Callable[[], Any] | None = None


def _host_view(ptr: int, nbytes: int) -> np.ndarray[Any, Any]:
    raw = (ctypes.c_ubyte * nbytes).from_address(ptr)
    view: np.ndarray[Any, Any] = np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]
    return view


class RawDriver:
    """Direct cuda.bindings calls on ferry's context (same device, same primary context)."""

    def __init__(self, rt: Any) -> None:
        from cuda.bindings import driver

        self.d = driver
        self.backend = testing.backend_of(rt)
        # made by ferry's backend (on ferry's context), used as the bindings' own objects
        self.streams = [driver.CUstream(self.backend.stream_handle(self.backend.stream_create())) for _ in range(2)]
        self.events = self.new_events(2)
        self._pinned: list[int] = []
        self._device: list[int] = []

    def new_events(self, count: int) -> list[Any]:
        """``count`` events (no timing), as ``cuda.bindings`` objects."""
        return [self.d.CUevent(int(self.backend.event_create())) for _ in range(count)]

    def pinned(self, nbytes: int) -> np.ndarray[Any, Any]:
        err, ptr = self.d.cuMemHostAlloc(nbytes, 0)
        if err:
            raise RuntimeError(f"cuMemHostAlloc: {err}")
        self._pinned.append(int(ptr))
        return _host_view(int(ptr), nbytes)

    def device(self, nbytes: int) -> int:
        err, ptr = self.d.cuMemAlloc(nbytes)
        if err:
            raise RuntimeError(f"cuMemAlloc: {err}")
        self._device.append(int(ptr))
        return int(ptr)

    def copy(self, direction: str, host: np.ndarray[Any, Any], dev: int, nbytes: int, lane: int = 0) -> None:
        """Enqueue one copy and record the lane's event (no wait)."""
        d, stream = self.d, self.streams[lane]
        hptr = int(host.ctypes.data)
        if direction == "h2d":
            (err,) = d.cuMemcpyHtoDAsync(dev, hptr, nbytes, stream)
        else:
            (err,) = d.cuMemcpyDtoHAsync(hptr, dev, nbytes, stream)
        if err:
            raise RuntimeError(f"copy: {err}")
        (err,) = d.cuEventRecord(self.events[lane], stream)
        if err:
            raise RuntimeError(f"cuEventRecord: {err}")

    def sync(self, lane: int = 0) -> None:
        (err,) = self.d.cuEventSynchronize(self.events[lane])
        if err:
            raise RuntimeError(f"cuEventSynchronize: {err}")

    def release(self) -> None:
        for ptr in self._pinned:
            self.d.cuMemFreeHost(ptr)
        for ptr in self._device:
            self.d.cuMemFree(self.d.CUdeviceptr(ptr))
        self._pinned.clear()
        self._device.clear()

    def case(self, direction: str, route: str, data: np.ndarray[Any, Any]) -> Case:
        nbytes = data.nbytes
        host = self.pinned(nbytes) if route == "pinned" else np.empty(nbytes, np.uint8)
        dev = self.device(nbytes)
        back = np.empty(nbytes, np.uint8)
        d, stream, event, hptr = self.d, self.streams[0], self.events[0], int(host.ctypes.data)
        copy, dst, src = (d.cuMemcpyHtoDAsync, dev, hptr) if direction == "h2d" else (d.cuMemcpyDtoHAsync, hptr, dev)
        record, synchronize = d.cuEventRecord, d.cuEventSynchronize

        def op(_keep: Any = host) -> None:  # the default keeps the host array (its address is src/dst) alive
            (err,) = copy(dst, src, nbytes, stream)
            if err:
                raise RuntimeError(f"copy: {err}")
            (err,) = record(event, stream)
            if err:
                raise RuntimeError(f"cuEventRecord: {err}")
            (err,) = synchronize(event)
            if err:
                raise RuntimeError(f"cuEventSynchronize: {err}")

        if direction == "h2d":
            host[:] = data

            def check() -> bool:
                op()
                poison(back)
                self.copy("d2h", back, dev, nbytes)
                self.sync()
                return bool(np.array_equal(back, data))
        else:
            back[:] = data
            self.copy("h2d", back, dev, nbytes)
            self.sync()

            def check() -> bool:
                poison(host)
                op()
                return bool(np.array_equal(host, data))

        return Case("raw", route, direction, nbytes, op, check)


class Torch:
    """PyTorch's recommended copies."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("PyTorch sees no GPU")
        self.torch = torch
        self.version = torch.__version__

    def case(self, direction: str, route: str, data: np.ndarray[Any, Any]) -> Case:
        torch = self.torch
        pinned = route.startswith("pinned")
        non_blocking = route.endswith("non_blocking")
        nbytes = data.nbytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host_np = host.numpy()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream()

        def op() -> None:
            if direction == "h2d":
                dev.copy_(host, non_blocking=non_blocking)
            else:
                host.copy_(dev, non_blocking=non_blocking)
            if non_blocking:
                stream.synchronize()

        if direction == "h2d":
            host_np[:] = data

            def check() -> bool:
                op()
                return bool(np.array_equal(dev.cpu().numpy(), data))
        else:
            dev.copy_(torch.from_numpy(data))
            torch.cuda.synchronize()

            def check() -> bool:
                poison(host_np)
                op()
                return bool(np.array_equal(host_np, data))

        return Case("torch", route, direction, nbytes, op, check)

    def fresh_download(self, data: np.ndarray[Any, Any]) -> Case:
        torch = self.torch
        dev = torch.from_numpy(data).cuda()
        box: dict[str, Any] = {}

        def op() -> None:
            box["out"] = dev.cpu()

        def check() -> bool:
            op()
            return bool(np.array_equal(box["out"].numpy(), data))

        return Case("torch", "fresh", "d2h", data.nbytes, op, check)


class CuPy:
    """CuPy's recommended copies."""

    def __init__(self) -> None:
        import cupy
        import cupyx

        cupy.cuda.runtime.getDeviceCount()
        self.cupy = cupy
        self.cupyx = cupyx
        self.version = cupy.__version__
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def case(self, direction: str, route: str, data: np.ndarray[Any, Any]) -> Case:
        cupy = self.cupy
        nbytes = data.nbytes
        host = self.cupyx.empty_pinned((nbytes,), np.uint8) if route == "pinned" else np.empty(nbytes, np.uint8)
        dev = cupy.empty(nbytes, np.uint8)
        stream = self.stream

        def op() -> None:
            if direction == "h2d":
                dev.set(host, stream=stream)
            else:
                dev.get(stream=stream, out=host)
            stream.synchronize()

        if direction == "h2d":
            host[:] = data

            def check() -> bool:
                op()
                return bool(np.array_equal(dev.get(), data))
        else:
            dev.set(data)

            def check() -> bool:
                poison(host)
                op()
                return bool(np.array_equal(host, data))

        return Case("cupy", route, direction, nbytes, op, check)

    def fresh_download(self, data: np.ndarray[Any, Any]) -> Case:
        dev = self.cupy.asarray(data)
        box: dict[str, Any] = {}

        def op() -> None:
            box["out"] = dev.get()

        def check() -> bool:
            op()
            return bool(np.array_equal(box["out"], data))

        return Case("cupy", "fresh", "d2h", data.nbytes, op, check)


def load_peers(rt: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The peers usable here, and why the others are not."""
    peers: dict[str, Any] = {}
    missing: dict[str, str] = {}
    if rt.backend != "cuda":
        reason = "the emulated device has no peers to compare with"
        return peers, {"raw": reason, "torch": reason, "cupy": reason}
    for name, make in (("raw", lambda: RawDriver(rt)), ("torch", Torch), ("cupy", CuPy)):
        try:
            peers[name] = make()
        except ImportError as exc:
            missing[name] = f"not installed ({exc.name})"
        except Exception as exc:
            missing[name] = f"unusable: {exc}"
    return peers, missing
