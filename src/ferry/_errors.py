"""The exceptions ferry raises.

Every error ferry raises on purpose is a :class:`FerryError`. The split between
the subclasses is part of the contract:

* :class:`TransferSubmitError` is raised *before* anything was enqueued. Every
  object handed to the refused call is still owned by the caller and usable.
* :class:`TransferFailedError` is raised by ``is_ready()``/``wait()`` when the
  device reported a failure. Nothing is published: the objects of that transfer
  are abandoned (never readable again, never freed).
* :class:`BufferMovedError` is raised by any data access to an object that is in
  flight, read-leased against the requested use, abandoned or closed.
"""

from __future__ import annotations

__all__ = [
    "FerryError",
    "TransferSubmitError",
    "TransferFailedError",
    "BufferMovedError",
    "DeviceUnavailableError",
    "RuntimeClosedError",
    "PrefetchError",
]


class FerryError(Exception):
    """Base class of every error ferry raises on purpose."""


class TransferSubmitError(FerryError):
    """A submission was refused before anything was enqueued.

    Guarantee: every object handed to the refused call is left exactly as it
    was (owned, usable, with its bytes unchanged).
    """


class TransferFailedError(FerryError):
    """The device reported a failure for a transfer.

    Raised by ``is_ready()`` and ``wait()``. The transfer publishes nothing:
    its buffers and arrays are abandoned, which means they raise
    :class:`BufferMovedError` forever and their memory is never freed (the
    device may still touch it).
    """


class BufferMovedError(FerryError):
    """Access to an object that is in flight, abandoned or closed."""


class DeviceUnavailableError(FerryError):
    """The requested backend cannot be used on this machine; the message says why."""


class RuntimeClosedError(TransferSubmitError):
    """The runtime cannot be used any more: it was closed, it was inherited by a
    forked child process, or the device reported a sticky error that makes its
    context unusable. The message says which.

    One condition, one type: every call on such a runtime raises this, from
    ``rt.pinned()`` to ``rt.upload()``. It is a :class:`TransferSubmitError`
    too, so a refused submission is caught by either name, and, like every
    refused submission, it changed nothing.
    """


class PrefetchError(FerryError):
    """A batch given to :func:`ferry.prefetch` could not be uploaded, or its upload failed.

    ``index`` is the batch's position in the iterable (0 for the first);
    ``__cause__`` is the error itself (a :class:`TransferSubmitError` for a
    leaf ferry cannot copy, a :class:`TransferFailedError` for a copy the
    device failed, a ``TypeError`` for a leaf that is not a host array, a
    ``MemoryError``). The batches before it were yielded; the prefetch is
    closed.
    """

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index
