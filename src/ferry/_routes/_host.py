"""The host routes together: check a NumPy array <-> device array copy, pick its route, submit it.

The choice, in order: a small C-contiguous array of the device array's shape
and dtype (up to 64 KiB) takes the small route (``_small.py``), tried by the
facade before anything here, with its own one-expression test; a registered
array (pinned in place), or a pooled pinned leaf (``download_tree(pinned=True)``),
takes the registered route, one DMA and no host copy;
a payload up to ``StagingConfig.direct_bytes`` (``direct_download_bytes`` for a
download; or with elements larger than
a slot) takes the direct route, one pooled pinned block on the calling
thread; anything larger is staged in chunks by the staging engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._backends._base import DeviceError
from .._completion import Extras
from .._errors import RuntimeClosedError, TransferSubmitError
from .._interop._foreign import device_side, give_back, order_before, release_import
from .._interop._host import host_out, host_view
from .._memory._leaves import PinnedLeaves
from .._state import IN_FLIGHT, OWNED
from ._base import HostCopy, HostLeases, array_ptr
from ._direct import DirectRoute
from ._registered import RegisteredRoute
from ._small import SmallRoute
from ._staged import StagedRoute, StagingConfig

if TYPE_CHECKING:
    from .._completion import Completion, Record
    from .._memory._hostcache import HostCache
    from .._memory._pinned import PinnedPool
    from .._memory._register import Registrations

__all__: list[str] = []


def check_copyable(array: np.ndarray[Any, Any], call: str) -> None:
    """Refuse dtypes that are not plain bytes."""
    if array.dtype.hasobject or array.dtype.itemsize == 0:
        raise TransferSubmitError(f"{call}: dtype {array.dtype} is not a fixed-size byte layout ferry copies")


def check_match(host: np.ndarray[Any, Any], device: Any, name: str) -> None:
    """Refuse a shape or dtype mismatch between the host and device sides."""
    if host.shape != device.shape or host.dtype != device.dtype:
        raise TransferSubmitError(
            f"shape/dtype mismatch: the NumPy array is {host.shape} {host.dtype}, "
            f"the {name} is {device.shape} {device.dtype}"
        )


class HostRoutes:
    """A runtime's host routes and the choice between them."""

    def __init__(
        self, completion: Completion, pool: PinnedPool, registrations: Registrations, host_cache: HostCache,
        config: StagingConfig, streams: tuple[Any, Any],
    ) -> None:
        self.completion = completion
        self.lock: threading.RLock = completion.lock
        self.registrations = registrations
        self.host_cache = host_cache
        self.config = config
        self.h2d, self.d2h = streams
        leases = HostLeases()
        self.direct = DirectRoute(completion, pool, leases, config)
        self.registered = RegisteredRoute(completion, leases)
        self.staged = StagedRoute(completion, pool, config, leases)
        self.direct.staged = self.staged  # a burst of direct transfers goes to the staging lanes
        self.small = SmallRoute(completion, pool, leases, registrations, streams, config.direct_bytes)
        self.pinned_leaves = PinnedLeaves(pool)  # pooled pinned arrays (download_tree(pinned=True)): one DMA

    def upload(
        self, owner: object, source: Any, destination: Any, empty: Callable[[tuple[int, ...], Any], Any]
    ) -> Record:
        """See :meth:`ferry.Runtime.upload`; ``empty`` allocates a missing destination."""
        health = self.completion.health
        handed, source = source, host_view(source, "upload", "source")  # a CPU array of another library: a view
        check_copyable(source, "upload")
        created = destination is None
        if created:
            if health.refusal is not None:
                raise RuntimeClosedError(health.refusal)
            destination = empty(source.shape, source.dtype)
        try:
            with self.lock:
                if health.refusal is not None:
                    raise RuntimeClosedError(health.refusal)
                device = device_side(destination, owner, self.completion.backend, "upload", "destination",
                                     write=True, stream=self.h2d)
                try:
                    check_match(source, device, "destination")
                    record = self.submit(True, source, device, destination, handed)
                except BaseException:
                    give_back(device)
                    raise
                device._state = IN_FLIGHT
        except BaseException:
            if created and destination is not None and destination._state is OWNED:
                destination.close()
            raise
        return record

    def download(self, owner: object, source: Any, out: np.ndarray[Any, Any] | None) -> Record:
        """See :meth:`ferry.Runtime.download`."""
        health = self.completion.health
        with self.lock:
            if health.refusal is not None:
                raise RuntimeClosedError(health.refusal)
            handed = out
            if out is not None:
                out = host_out(out, "download")  # a CPU array of another library: a view
            device = device_side(source, owner, self.completion.backend, "download", "source", write=False,
                                 stream=self.d2h)
            try:
                if out is None:
                    out = self.host_cache.array(device.shape, device.dtype)
                else:
                    check_copyable(out, "download")
                    check_match(out, device, "source")
                    if not out.flags.writeable:
                        raise TransferSubmitError(
                            "download: out is read-only (or the output of another pending download)"
                        )
                record = self.submit(False, out, device, source, out if handed is None else handed)
            except BaseException:
                give_back(device)
                raise
            device._leases += 1
        return record

    def submit(self, upload: bool, host: np.ndarray[Any, Any], device: Any, original: Any, handed: Any) -> Record:
        """Pick the route for a checked copy and enqueue it; ``wait()`` hands back ``handed`` (the host
        array as it was handed in: ``host`` or the object ``host`` views). Lock held."""
        completion = self.completion
        backend = completion.backend
        if completion.maintenance_due():
            completion.maintain()
        request = HostCopy(
            upload=upload, host=host, device=device,
            stream=self.h2d if upload else self.d2h,
            copy=backend.htod_record if upload else backend.dtoh_record,
            moved=(device,) if upload else (), leased=() if upload else (device,),
            result=(handed, original) if upload else (original, handed), extra=Extras(),
        )
        nbytes, config = host.nbytes, self.config
        registration: Any = None  # a Registration, or a pinned leaf's block: the registered route's one DMA
        if nbytes and host.flags.c_contiguous and (self.registrations.active or self.pinned_leaves.active):
            ptr = array_ptr(host)
            if self.registrations.active:
                registration = self.registrations.covering(ptr, nbytes)
            if registration is None and self.pinned_leaves.active:
                registration = self.pinned_leaves.covering(ptr, nbytes)
        route: Any
        if registration is not None:
            route = self.registered
        elif nbytes <= (config.direct_bytes if upload else config.direct_download_bytes) or (
            host.itemsize > config.slot_bytes
        ):
            route = self.direct
        else:
            route = self.staged
        try:
            order_before(completion, route.streams(request), device, ordered=request.stream)
        except DeviceError as exc:
            completion.health.note(exc)
            raise TransferSubmitError(f"could not order the copy after the array's producer: {exc}") from exc
        record: Record = route.submit(request, registration) if registration is not None else route.submit(request)
        extra = record.extra = request.extra
        cleanup = release_import(device)
        if cleanup is not None:
            extra.cleanups.append(cleanup)
        return record

    @property
    def host_copied(self) -> int:
        """Bytes the host copied for the pageable routes."""
        return self.direct.host_copied + self.staged.host_copied + self.small.host_copied

    @property
    def staging_bytes(self) -> int:
        """Pinned bytes held for staging (the small route's rings included)."""
        return self.direct.held_bytes + self.staged.held_bytes + self.small.held_bytes

    def close(self) -> None:
        """Stop the staging workers and the copy helpers; the small route's slots back to the pool."""
        self.staged.close()
        self.direct.close()
        self.small.close()
