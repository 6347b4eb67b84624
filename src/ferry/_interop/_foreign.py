"""The device side of a submission: a ferry array, or a foreign one wrapped for one transfer.

Also the ordering rule for publication: ferry's copy runs after the work the
device side's bytes depend on (a producer's kernels, an earlier upload handed
off), through a stream-side wait, never a host wait.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from .._backends._base import Backend
from .._device_array import DeviceArray
from .._errors import FerryError, TransferSubmitError
from ._cai import Foreign, foreign_from, foreign_from_dlpack, interface_of

if TYPE_CHECKING:
    from .._completion import Completion

__all__: list[str] = []

_KDL_CUDA = 2
PINNED = "a PinnedHostBuffer (rt.pinned(n))"
DEVICE = "a DeviceArray (rt.empty(shape, dtype))"


def expect(obj: Any, kind: type, call: str, name: str, what: str) -> None:
    """Refuse ``obj`` unless it is a ``kind``, saying what was expected."""
    if not isinstance(obj, kind):
        hint = ""
        if isinstance(obj, np.ndarray):
            hint = "; NumPy arrays go through rt.upload()/rt.download()"
        raise TransferSubmitError(f"{call}: {name} must be {what}, got {type(obj).__name__}{hint}")


def dlpack_device(obj: Any) -> tuple[int, int] | None:
    """``obj.__dlpack_device__()`` as ``(type, index)`` (type 2: CUDA), or None if it speaks no DLPack."""
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        return None
    try:
        kind, index = obj.__dlpack_device__()
        return int(kind), int(index)
    except Exception:
        return None


# Types whose CUDA Array Interface names no stream (version < 3, as PyTorch's): one of their arrays
# that also speaks DLPack goes through DLPack without its interface being read (PyTorch computes it
# in Python). A library's interface version is a property of its type, learned at the first read;
# a wrapper type that forwards interfaces of several versions then always takes DLPack, which orders
# the copy after the producer as well. A later array the interface would have refused (PyTorch's
# with requires_grad) is refused by its __dlpack__ instead, as clearly.
_NO_STREAM_CAI: set[type] = set()


_RAW_STREAM: list[Any] = []  # PyTorch's current-stream getter, once found: (device index) -> raw handle


def torch_stream(obj: Any, index: int) -> int | None:
    """PyTorch's current stream on device ``index`` (a raw handle) when ``obj`` is a PyTorch tensor,
    else None.

    For a PyTorch tensor ferry asks ``__dlpack__(stream=-1)`` (no synchronization) and orders its copy
    stream after this stream itself, with an event: the same order as ``__dlpack__(stream=<ferry's
    stream>)`` gives (PyTorch records an event on its current stream and makes the consumer's stream
    wait for it), at a few microseconds instead of PyTorch's ~50 us of Python for it. PyTorch's
    default stream (handle 0) is the legacy default stream: ``1`` names it, as in DLPack.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, getattr(torch, "Tensor", ())):
        return None
    try:
        return torch_current_stream(torch, index)
    except Exception:  # PyTorch could not say: its own __dlpack__ orders the copy
        return None


def check_torch_has_cuda(torch: Any) -> None:
    """Raise :class:`~ferry.FerryError` if ``torch`` is a CPU-only build of PyTorch: it cannot take
    device arrays (its CUDA calls fail with "Torch not compiled with CUDA enabled")."""
    version = getattr(torch, "version", None)
    if version is not None and getattr(version, "cuda", "") is None and getattr(version, "hip", None) is None:
        raise FerryError(
            f"to='torch' needs PyTorch built with CUDA, and this PyTorch ({getattr(version, '__version__', '?')}) "
            "is a CPU-only build (torch.version.cuda is None): install a CUDA build of PyTorch, or take "
            "ferry.DeviceArray batches with to=None"
        )


def torch_current_stream(torch: Any, index: int) -> int:
    """PyTorch's current stream on CUDA device ``index``, as a raw handle (1 for its default stream,
    the legacy one). Through ``torch._C._cuda_getCurrentRawStream`` where PyTorch has it (well under a
    microsecond), else ``torch.cuda.current_stream(index).cuda_stream`` (~10 us)."""
    if not _RAW_STREAM:
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        _RAW_STREAM.append(raw if callable(raw) else (lambda i: torch.cuda.current_stream(i).cuda_stream))
    return int(_RAW_STREAM[0](index)) or 1


def device_side(
    obj: Any, owner: object, backend: Backend, call: str, name: str, *, write: bool, stream: Any
) -> Any:
    """A ferry array of ``owner`` (checked) or a foreign one (wrapped); anything else is refused.

    A foreign array comes through its CUDA Array Interface or, failing that,
    DLPack (asked for a capsule ordered on ``stream``, ferry's copy stream).
    Raises :class:`~ferry.TransferSubmitError`; a consumed capsule is given
    back by :func:`give_back` if the submission is refused later.
    """
    if isinstance(obj, DeviceArray):
        problem = obj._submission_problem(owner, write=write)
        if problem:
            raise TransferSubmitError(problem)
        return obj
    dl = dlpack_device(obj)
    kind = type(obj)
    cai = None if dl is not None and dl[0] == _KDL_CUDA and kind in _NO_STREAM_CAI else interface_of(obj)
    if dl is not None and dl[0] == _KDL_CUDA and (cai is None or int(cai.get("version", 0)) < 3):
        # DLPack orders ferry's stream after the producer (a CUDA Array Interface
        # before version 3 names no stream, so it cannot)
        if cai is not None:
            _NO_STREAM_CAI.add(kind)
        producer = torch_stream(obj, dl[1]) if dl[1] == int(backend.device) else None  # (else refused below)
        if producer is not None:  # ferry orders its copy after PyTorch's stream itself (see torch_stream)
            return foreign_from_dlpack(obj, int(backend.device), -1, dl, producer=producer)
        return foreign_from_dlpack(obj, int(backend.device), backend.stream_handle(stream), dl)
    if cai is not None:
        return foreign_from(obj, cai, write=write)
    expect(obj, DeviceArray, call, name, DEVICE)
    return obj  # unreachable: expect raised


def give_back(device: Any) -> None:
    """A submission was refused after a DLPack capsule was consumed: release it."""
    imported = getattr(device, "imported", None)
    if imported is not None:
        imported.release()


def release_import(device: Any) -> Any:
    """A cleanup for a record that consumed ``device``'s DLPack capsule (or None)."""
    imported = getattr(device, "imported", None)
    if imported is None:
        return None

    def cleanup(failed: bool) -> None:
        if not failed:  # a failed copy may still touch the producer's memory: never hand it back
            imported.release()

    return cleanup


def order_before(completion: Completion, streams: list[Any], device: Any, ordered: Any = None) -> None:
    """Make ``streams`` wait, on the device, for the work ``device``'s bytes depend on.

    A ferry array handed off by a pending upload waits for that upload's
    completion; a foreign array waits for its producer stream (an event
    recorded there), or, when it came through DLPack, for ``ordered`` (the
    copy stream its producer already made wait). No host wait (a staged upload
    on CUDA: only until its lanes have enqueued their last DMAs). Lock held; raises DeviceError.
    """
    backend = completion.backend
    ready = getattr(device, "_ready", None)
    if ready is not None and not ready.done:
        for stream in streams:
            completion.order_after(ready, stream)
    if not isinstance(device, Foreign):
        return
    if device.stream is not None:
        source = backend.stream_from_handle(device.stream)
    elif device.imported is not None and ordered is not None and any(s is not ordered for s in streams):
        source = ordered
    else:
        return
    event = completion.take_event()
    try:
        backend.event_record(event, source)
        for stream in streams:
            if stream is not source:
                backend.stream_wait_event(stream, event)
    finally:
        completion.events.append(event)  # a wait captured the record: the event is reusable
