"""The pinned route: one DMA between an owned pinned buffer and a device array.

The common case never comes here: :meth:`ferry.Runtime.upload_pending` and
:meth:`~ferry.Runtime.download_pending` admit it with one expression and
enqueue inline (the 16 B round trip is dominated by Python overhead). This
module is everything else on that route: each refusal, named, and the
submissions the fast test does not admit (a foreign device array, or a ferry
array an earlier upload handed off, which must be ordered first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._backends._base import DeviceError
from .._buffer import PinnedHostBuffer
from .._errors import RuntimeClosedError, TransferSubmitError
from .._interop._foreign import PINNED, device_side, expect, give_back, order_before, release_import
from .._state import IN_FLIGHT

if TYPE_CHECKING:
    from .._completion import Completion, Record

__all__: list[str] = []


def submit_pinned(
    completion: Completion, owner: object, stream: Any, upload: bool, buffer: Any, device_obj: Any
) -> Record:
    """The checked submission of a pinned transfer in either direction. Lock held.

    Raises :class:`~ferry.TransferSubmitError` with every argument unchanged.
    """
    call = "upload_pending" if upload else "download_pending"
    refusal = completion.health.refusal
    if refusal is not None:
        raise RuntimeClosedError(refusal)
    expect(buffer, PinnedHostBuffer, call, "buffer", PINNED)
    problem = buffer._submission_problem(owner)
    if problem:
        raise TransferSubmitError(problem)
    role = "destination" if upload else "source"
    backend = completion.backend
    device = device_side(device_obj, owner, backend, call, role, write=upload, stream=stream)
    try:
        if buffer._nbytes < device._nbytes:
            raise TransferSubmitError(
                f"the pinned buffer holds {buffer._nbytes} bytes; the {role} has {device._nbytes}"
            )
        try:
            order_before(completion, [stream], device, ordered=stream)
        except DeviceError as exc:
            completion.health.note(exc)
            raise TransferSubmitError(f"could not order the copy after the {role}'s producer: {exc}") from exc
        if completion.maintenance_due():
            completion.maintain()
        if upload:
            record = completion.submit(
                stream, backend.htod_record, device._ptr, buffer._block.ptr, device._nbytes,
                (buffer, device), (), (buffer, device_obj),
            )
        else:
            record = completion.submit(
                stream, backend.dtoh_record, buffer._block.ptr, device._ptr, device._nbytes,
                (buffer,), (device,), (device_obj, buffer),
            )
    except BaseException:
        give_back(device)  # refused after the producer's capsule was taken
        raise
    cleanup = release_import(device)
    if cleanup is not None:
        completion.extras(record).cleanups.append(cleanup)
    buffer._state = IN_FLIGHT
    if upload:
        device._state = IN_FLIGHT
    else:
        device._leases += 1
    return record
