"""Device memory: allocation, frees that never run in a finalizer, and the accounting.

A :class:`~ferry.DeviceArray` that dies owned cannot free its memory from
``__del__`` (finalizers never call into the device: they may run during
interpreter shutdown, in a forked child, or inside another ferry call), so it
appends its address to :attr:`DeviceMemory.deferred`, a plain list append
that is atomic under the GIL; the runtime's next ordinary call frees it.
Every other free happens from an ordinary call, under the runtime's lock.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._backends._base import Backend, DeviceError

if TYPE_CHECKING:
    from .._device_array import DeviceArray
    from .._lifecycle import Health

__all__: list[str] = []


class DeviceMemory:
    """One device's allocations made through one runtime."""

    def __init__(self, backend: Backend, health: Health, lock: threading.RLock) -> None:
        self.backend = backend
        self.health = health
        self.lock = lock
        self.device = int(backend.device)
        self.bytes = 0  # allocated through this runtime and not freed
        self.deferred: list[tuple[int, int]] = []  # (address, nbytes) of collected arrays
        self.arrays: weakref.WeakSet[DeviceArray] = weakref.WeakSet()

    def alloc(self, nbytes: int) -> int:
        """``nbytes`` of device memory (0 for an empty array). Lock held; raises DeviceError."""
        ptr = self.backend.mem_alloc(nbytes) if nbytes else 0
        self.bytes += nbytes
        return ptr

    def release(self, ptr: int, nbytes: int) -> None:
        """Free memory no transfer uses any more (an ordinary call). Lock held."""
        self.bytes -= nbytes
        if ptr and self.health.device_usable:  # forked or poisoned: never touch the device
            self._free_now(ptr)

    def free(self, ptr: int, nbytes: int) -> None:
        """A closed array's memory, freed now (takes the lock)."""
        with self.lock:
            self.release(ptr, nbytes)

    def defer(self, ptr: int, nbytes: int) -> None:
        """From a finalizer: free at the next ordinary call. Never blocks, never calls the device."""
        self.deferred.append((ptr, nbytes))

    def free_deferred(self) -> None:
        """Free what finalizers deferred. Lock held."""
        if self.deferred:
            deferred, self.deferred = self.deferred, []
            for ptr, nbytes in deferred:
                self.release(ptr, nbytes)

    def order_export(self, event: Any, stream_handle: int) -> None:
        """Make a consumer's stream (an integer handle) wait on the device for ``event``."""
        backend = self.backend
        backend.stream_wait_event(backend.stream_from_handle(stream_handle), event)

    def _free_now(self, ptr: int) -> None:
        try:
            self.backend.mem_free(ptr)
        except DeviceError as exc:
            self.health.note(exc)

    def close(self) -> None:
        """Free every owned array and deferred address (the device is idle). Lock held.

        Abandoned arrays stay allocated: the device may still touch them.
        """
        from .._state import OWNED

        usable = self.health.device_usable
        for ptr, nbytes in self.deferred:
            self.bytes -= nbytes
            if usable and ptr:
                self._free_now(ptr)
        self.deferred.clear()
        for array in list(self.arrays):
            if array._state is OWNED:
                array._release_for_close()
                self.bytes -= array._nbytes
                if array._ptr and usable:
                    self._free_now(array._ptr)
