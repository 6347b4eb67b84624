"""Whole structures in one submission: ``Runtime.upload_tree`` and ``Runtime.download_tree``.

A model's state dict, an optimizer's state, a set of cache blocks: hundreds
to thousands of arrays moved together, and often moved back later. One call
takes the whole structure (nested dicts, lists and tuples, named tuples
included, as :mod:`ferry._structure` walks them), checks all of it, submits
one transfer per leaf and returns one handle.

How a tree is a handle
----------------------
The common tree (pageable NumPy leaves and ferry device arrays, or leaves in
pinned memory) is one record: one compiled call reads and checks every leaf,
and the leaves become the pieces of one staging job, or DMAs behind one event
(:func:`ferry._routes._groups.submit_pieces`), so that submission costs no
per-leaf Python and the caller's thread copies nothing. Any other tree goes
leaf by leaf: each leaf an ordinary transfer (its route picked as for
:meth:`Runtime.upload` / :meth:`Runtime.download`), the small ones in groups
or inside one ``rt.batch()`` so that they go to the device as batched copies.
The returned :class:`~ferry.PendingUpload` / :class:`~ferry.PendingDownload`
holds a :class:`TreeRecord` (the leaves' handles and how to build the result)
and talks to :class:`TreePort`, which answers the handle protocol for the
whole tree: it is ready once every leaf is, ``wait()`` waits for every leaf,
a future or ``await`` resolves once every leaf resolved, and a dropped handle
drops every leaf's handle (each retires on its own, never blocking).

Outcomes
--------
Every check (structure, shapes, dtypes, states, duplicates) runs before the
first leaf is submitted, so a refused tree changes nothing (the compiled call
answers "not the common case" for anything odd, and the Python checks then
name the problem). Should a leaf's
submission still be refused (the device refused an allocation), the leaves
already submitted are waited for, so that every leaf is owned again, and the
refusal is raised. When a leaf fails on the device the tree fails: ``wait()``
raises :class:`~ferry.TransferFailedError` naming that leaf and publishes
nothing; the failed leaf's objects are abandoned as for any failed transfer,
and every other leaf is released as a dropped handle's would be (what it
would have returned is freed once its copy is proven complete; the caller's
own arrays are writable again).
"""

from __future__ import annotations

import contextlib
import math
import operator
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native
from ._backends._base import DeviceError
from ._device_array import DeviceArray
from ._errors import FerryError, RuntimeClosedError, TransferFailedError, TransferSubmitError
from ._memory._leaves import layout, views
from ._pending import PendingDownload, PendingUpload
from ._routes._groups import (
    empty_like_many,
    empty_many,
    gc_paused,
    pieces_ready,
    submit_into_block,
    submit_pieces,
    submit_pinned,
    submit_small,
)
from ._routes._groups import hand_off as hand_group
from ._routes._groups import plan as plan_groups
from ._state import OWNED
from ._structure import KEEP, Builder, Path, describe, flat_keys, host_array, is_device_array, take_apart

if TYPE_CHECKING:
    from ._pending import _Pending
    from ._watcher import TransferFuture

__all__: list[str] = []

LIBRARIES = ("torch", "cupy", "jax")
BATCH_BYTES = 256 << 10
"""Leaves smaller than this go to the device as batched copies (``rt.batch()``); larger ones back to back."""


class TreeRecord:
    """A submitted tree: its leaves' handles, and what builds the result once they are all done."""

    __slots__ = (
        "children", "claimed", "error", "finish", "grouped", "listeners", "lock", "nbytes", "paths", "result",
        "settled", "spans", "upload", "waiters",
    )

    def __init__(self, upload: bool, children: list[Any], paths: Sequence[Path], nbytes: int,
                 finish: Callable[[list[Any]], tuple[Any, Any]], spans: list[list[int]] | None = None,
                 grouped: list[bool] | None = None) -> None:
        self.upload = upload
        self.children = children  # the handles (emptied once settled or failed)
        # the leaves each handle copies (a group's handle many: its result holds them in this order)
        self.spans = spans if spans is not None else [[i] for i in range(len(children))]
        self.grouped = grouped if grouped is not None else [False] * len(children)
        self.paths = paths
        self.nbytes = nbytes
        self.finish = finish  # each leaf's new object (an upload's device array, a download's host array) -> trees
        self.result: tuple[Any, ...] = ()
        self.settled = False
        self.claimed = False
        self.error: TransferFailedError | None = None
        self.waiters = 0
        self.listeners: dict[int, tuple[Callable[[], object], list[Any]]] = {}
        self.lock = threading.RLock()

    def __repr__(self) -> str:
        status = "failed" if self.error else "done" if self.settled else "pending"
        return f"<tree record of {len(self.paths)} leaves, {self.nbytes} bytes {status}>"


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class TreePort:
    """The handle protocol (``CompletionPort``) for a whole tree, answered from its leaves' handles."""

    def _fail(self, record: TreeRecord, index: int, exc: BaseException) -> TransferFailedError:
        """Leaf ``index`` failed: the tree fails, every other leaf's handle is dropped (it retires); the
        error to raise."""
        span = record.spans[index]
        together = f" (copied together with {len(span) - 1} other leaves)" if len(span) > 1 else ""
        error = TransferFailedError(
            f"leaf {describe(record.paths[span[0]])}{together} of the tree ({len(record.paths)} leaves, "
            f"{record.nbytes} bytes) failed on the device ({exc}); nothing was published: that leaf's objects "
            "are abandoned, the other leaves are released"
        )
        record.error = error  # kept unraised: a traceback's frames would keep the leaves' handles alive
        record.children.clear()  # in place: every frame that holds the list lets go of the handles too
        return TransferFailedError(str(error))

    def _raise_failed(self, record: TreeRecord) -> None:
        error = record.error
        assert error is not None
        raise TransferFailedError(str(error))

    def _settle(self, record: TreeRecord) -> None:
        """Every leaf is resolved: claim each leaf's result and build the tree's, or fail. Lock held."""
        if record.settled:
            return
        if record.error is not None:
            self._raise_failed(record)
        children = record.children
        for i, child in enumerate(children):  # every leaf's outcome first: a failure publishes no leaf
            try:
                child.is_ready()
            except TransferFailedError as exc:
                error = self._fail(record, i, exc)
                del child  # neither this frame nor the leaf's error (its traceback) keeps a handle
                raise error from exc.with_traceback(None)
        results: list[Any] = [None] * len(record.paths)
        for i, child in enumerate(children):
            try:
                got = child.wait()
                span = record.spans[i]
                # each leaf's new object: the second of what its handle returns (device arrays for an upload,
                # host arrays for a download)
                if record.grouped[i] and len(children) == 1:  # one record for the whole tree, in order
                    results = list(got[1])
                elif record.grouped[i]:
                    for leaf, made in zip(span, got[1], strict=True):
                        results[leaf] = made
                else:
                    results[span[0]] = got[1]
            except TransferFailedError as exc:
                results.clear()
                error = self._fail(record, i, exc)
                del child  # neither this frame nor the leaf's error (its traceback) keeps a handle
                raise error from exc.with_traceback(None)
        record.result = record.finish(results)
        record.children = []
        record.settled = True

    def poll(self, record: TreeRecord) -> bool:
        """Whether every leaf completed; raises ``TransferFailedError`` for a failed leaf. Never blocks."""
        with record.lock:
            if record.error is not None:
                self._raise_failed(record)
            if record.settled:
                return True
            for i, child in enumerate(record.children):
                try:
                    if not child.is_ready():
                        return False
                except TransferFailedError as exc:
                    error = self._fail(record, i, exc)
                    del child  # neither this frame nor the leaf's error (its traceback) keeps a handle
                    raise error from exc.with_traceback(None)
            return True

    def ready(self, record: TreeRecord, timeout: float | None = None, spin: bool = True) -> bool:
        """Block until every leaf completed or one failed, or ``timeout`` passed; settle nothing."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        for child in list(record.children):
            if record.error is not None or record.settled:
                return True
            if child._waited:
                continue
            port = child._port
            if not port.ready(child._record, _left(deadline), spin=spin):
                return False
            if child._record.error is not None:
                return True  # the tree failed: resolved
            spin = False
        return True

    def wait(self, record: TreeRecord, timeout: float | None = None) -> tuple[Any, ...]:
        """Block until every leaf completed, build the trees, return them (once)."""
        with record.lock:
            record.waiters += 1
        try:
            if not self.ready(record, timeout):
                raise TimeoutError(
                    f"the tree of {len(record.paths)} leaves ({record.nbytes} bytes) did not complete within "
                    f"{timeout} s; it is still pending: wait() again, poll is_ready(), or drop the handle"
                )
            with record.lock:
                if record.claimed:
                    raise FerryError("this transfer was already waited; a handle is waited at most once")
                self._settle(record)
                record.claimed = True
                return record.result
        finally:
            with record.lock:
                record.waiters -= 1

    def attend(self, record: TreeRecord, delta: int) -> None:
        """A waiter starts or stops attending the tree: so it does each leaf."""
        with record.lock:
            record.waiters += delta
            children = list(record.children)
        for child in children:
            child._port.attend(child._record, delta)

    def listen(self, record: TreeRecord, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once every leaf resolved (or one failed)."""
        with record.lock:
            children = [c for c in record.children if not c._waited]
            if record.settled or record.error is not None or not children:
                pending = False
            else:
                pending = True
                left = [len(children)]
                fired = [False]

                def one() -> None:
                    with record.lock:
                        left[0] -= 1
                        if fired[0] or left[0] > 0:
                            return
                        fired[0] = True
                        record.listeners.pop(id(fn), None)
                    fn()

                record.listeners[id(fn)] = (one, children)
        if not pending:
            fn()
            return
        for child in children:
            child._port.listen(child._record, one)

    def unlisten(self, record: TreeRecord, fn: Callable[[], object]) -> None:
        """Forget a listener not called yet."""
        with record.lock:
            entry = record.listeners.pop(id(fn), None)
        if entry is not None:
            one, children = entry
            for child in children:
                child._port.unlisten(child._record, one)

    def settled_result(self, record: TreeRecord) -> tuple[Any, ...]:
        """Settle a resolved tree (if no one did) and return its result without claiming it."""
        with record.lock:
            self._settle(record)
            return record.result

    def detach(self, record: TreeRecord) -> None:
        """The tree's handle was dropped unwaited: each leaf's handle is dropped too (each retires)."""
        record.children = []

    def watch(self, handle: _Pending[Any]) -> TransferFuture:
        """A future resolved once every leaf resolved, with what ``wait()`` returns."""
        from ._watcher import TransferFuture

        record: TreeRecord = handle._record  # type: ignore[assignment]
        with record.lock:
            if record.claimed:
                raise FerryError("this transfer was already waited; there is nothing left to wait for")
        future = TransferFuture(handle)
        self.attend(record, 1)
        self.listen(record, future._resolve)
        return future

    def hand_off(self, handle: _Pending[Any], stream: Any) -> Any:
        """Hand every leaf's destination to GPU work; the device tree, as ``wait()`` will return it."""
        record: TreeRecord = handle._record  # type: ignore[assignment]
        with record.lock:
            if not record.upload:
                raise FerryError("only an upload's destinations can be handed off")
            if handle._claimed or handle._waited or record.settled:
                raise FerryError("this upload was already waited: its destinations are yours")
            if record.error is not None:
                self._raise_failed(record)
            devices: list[Any] = [None] * len(record.paths)
            for i, child in enumerate(record.children):
                try:
                    span = record.spans[i]
                    if record.grouped[i]:
                        for leaf, device in zip(span, hand_group(child._port, child, stream),
                                                strict=True):
                            devices[leaf] = device
                    else:
                        devices[span[0]] = child.hand_off(stream)
                except TransferFailedError as exc:
                    error = self._fail(record, i, exc)
                    del child  # neither this frame nor the leaf's error (its traceback) keeps a handle
                    raise error from exc.with_traceback(None)
            return record.finish(devices)[1]

    def owns(self, record: TreeRecord) -> bool:
        """Whether any leaf of the tree is still pending."""
        return any(child._port.owns(child._record) for child in record.children)


PORT = TreePort()


# -- checks ----------------------------------------------------------------------------------------
def _dtype_of(leaf: Any) -> tuple[tuple[int, ...], np.dtype[Any] | None]:
    """A device leaf's shape and dtype (dtype None where only DLPack describes it)."""
    if isinstance(leaf, DeviceArray):
        return leaf.shape, leaf.dtype
    try:  # PyTorch raises TypeError for a dtype the interface cannot describe (bfloat16)
        cai = getattr(leaf, "__cuda_array_interface__", None)
    except Exception:
        cai = None
    if isinstance(cai, dict):
        try:
            return tuple(int(n) for n in cai["shape"]), np.dtype(cai["typestr"])
        except (KeyError, TypeError, ValueError):
            pass
    return tuple(int(n) for n in getattr(leaf, "shape", ())), None


def _nbytes_of(leaf: Any) -> int:
    """A device leaf's size in bytes (0 where only DLPack describes it)."""
    if isinstance(leaf, DeviceArray):
        return int(leaf.nbytes)
    shape, dtype = _dtype_of(leaf)
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if dtype is not None else 0


def _refuse(call: str, path: Path, problem: str) -> TransferSubmitError:
    return TransferSubmitError(f"{call}: leaf {describe(path)}: {problem}; nothing was submitted")


def _check_device(owner: object, call: str, path: Path, leaf: Any, *, write: bool) -> None:
    if isinstance(leaf, DeviceArray):
        problem = leaf._submission_problem(owner, write=write)
        if problem:
            raise _refuse(call, path, problem)


def _flatten_host(call: str, tree: Any) -> tuple[Builder, list[np.ndarray[Any, Any]], Sequence[Path]]:
    leaves: list[np.ndarray[Any, Any]] = []
    paths: list[Path] = []
    dtypes: set[np.dtype[Any]] = set()
    flat = flat_keys(tree, np.ndarray, leaves, dtypes)
    if flat is not None:
        if any(dtype.hasobject or not dtype.itemsize for dtype in dtypes):  # named below
            leaves.clear()
        else:
            return flat[0], leaves, flat[1]
    try:
        build = take_apart(tree, leaves, host_array, paths)
    except (TypeError, ValueError, BufferError) as exc:
        raise TransferSubmitError(f"{call}: {exc}; nothing was submitted") from exc
    for path, array in zip(paths, leaves, strict=True):
        if array.dtype.hasobject or array.dtype.itemsize == 0:
            raise _refuse(call, path, f"dtype {array.dtype} is not a fixed-size byte layout ferry copies")
    return build, leaves, paths


def _device_leaf(leaf: Any) -> Any:
    return leaf if isinstance(leaf, DeviceArray) or is_device_array(leaf) else KEEP


def _flatten_device(call: str, tree: Any, *, require: bool) -> tuple[Builder, list[Any], Sequence[Path]]:
    leaves: list[Any] = []
    paths: list[Path] = []
    flat = flat_keys(tree, DeviceArray, leaves)
    if flat is not None:
        return flat[0], leaves, flat[1]

    def leaf(x: Any) -> Any:
        found = _device_leaf(x)
        if found is KEEP and require:
            raise TypeError(f"a leaf of type {type(x).__name__} is not a device array")
        return found

    try:
        build = take_apart(tree, leaves, leaf, paths)
    except (TypeError, ValueError) as exc:
        raise TransferSubmitError(f"{call}: {exc}; nothing was submitted") from exc
    return build, leaves, paths


def _same_paths(call: str, mine: Sequence[Path], theirs: Sequence[Path], name: str) -> None:
    if mine == theirs:
        return
    missing = [p for p in mine if p not in set(theirs)]
    extra = [p for p in theirs if p not in set(mine)]
    detail = (
        f"{len(mine)} array leaves against {len(theirs)}"
        + (f"; missing in {name}: {', '.join(describe(p) for p in missing[:3])}" if missing else "")
        + (f"; only in {name}: {', '.join(describe(p) for p in extra[:3])}" if extra else "")
    )
    raise TransferSubmitError(f"{call}: {name} does not have the tree's structure ({detail}); nothing was submitted")


def _check_match(call: str, path: Path, host: np.ndarray[Any, Any], device: Any, name: str) -> None:
    shape, dtype = _dtype_of(device)
    if shape != host.shape or (dtype is not None and dtype != host.dtype):
        raise _refuse(call, path, f"shape/dtype mismatch: the host array is {host.shape} {host.dtype}, "
                                  f"the {name} is {shape} {dtype if dtype is not None else ''}".rstrip())


def _unique(call: str, paths: Sequence[Path], objects: list[Any], what: str) -> None:
    seen: dict[int, Path] = {}
    for path, obj in zip(paths, objects, strict=True):
        first = seen.setdefault(id(obj), path)
        if first is not path:
            raise _refuse(call, path, f"the same {what} as leaf {describe(first)}")


def library(to: str | None) -> Any:
    """The module named by ``to`` (imported now), or None; ValueError for anything else."""
    if to is None:
        return None
    if to not in LIBRARIES:
        raise ValueError(f"to must be None or one of {LIBRARIES}, got {to!r}")
    if to == "jax":
        import jax.dlpack

        return jax
    return __import__(to)


def _converter(to: str | None) -> Callable[[Any], Any] | None:
    module = library(to)
    if module is None:
        return None
    if to == "jax":
        return module.dlpack.from_dlpack  # type: ignore[no-any-return]
    return module.from_dlpack  # type: ignore[no-any-return]


# -- submission ------------------------------------------------------------------------------------
def _submit_all(rt: Any, submit: Callable[[Any, Any], Any], pairs: list[tuple[Any, Any]], call: str,
                paths: Sequence[Path], sizes: list[int], *,
                upload: bool) -> tuple[list[Any], list[list[int]], list[bool]]:
    """Submit every leaf; the handles, the leaves each one copies, and which are groups.

    Pinned leaves and small pageable ones go in groups (:mod:`ferry._routes._groups`: one record each);
    the other leaves one by one, the large ones first (back to back, so the staging lanes share them),
    then the small ones inside one batch. A refusal waits for those already submitted, then raises.
    """
    hosts = [p[0] if upload else p[1] for p in pairs]
    devices = [p[1] if upload else p[0] for p in pairs]
    plan = plan_groups(rt, hosts, devices, sizes, upload=upload)
    handles: list[Any] = []
    spans: list[list[int]] = []
    grouped: list[bool] = []
    fresh: list[Any] = []  # destinations made here for groups (closed again on a refusal)
    small = [i for i in plan.rest if sizes[i] < BATCH_BYTES]
    large = [i for i in plan.rest if sizes[i] >= BATCH_BYTES]
    at = -1
    try:
        for at in large:
            handles.append(submit(*pairs[at]))
            spans.append([at])
            grouped.append(False)
        if len(small) > 1:
            with rt.batch():
                for at in small:
                    handles.append(submit(*pairs[at]))
                    spans.append([at])
                    grouped.append(False)
        else:
            for at in small:
                handles.append(submit(*pairs[at]))
                spans.append([at])
                grouped.append(False)
        groups = ([(submit_pinned, plan.pinned)] if plan.pinned else []) + [(submit_small, g) for g in plan.small]
        for how, span in groups:
            at = span[0]
            group_devices = [devices[i] for i in span]
            if upload and any(d is None for d in group_devices):  # fresh destinations, made together
                missing = [k for k, d in enumerate(group_devices) if d is None]
                made = empty_many(rt, [(hosts[span[k]].shape, hosts[span[k]].dtype) for k in missing])
                fresh.extend(made)
                for k, device in zip(missing, made, strict=True):
                    group_devices[k] = device
            group_hosts = [hosts[i] for i in span]
            if not upload:
                group_hosts = [np.empty(d.shape, d.dtype) if h is None else h  # a fresh output
                               for h, d in zip(group_hosts, group_devices, strict=True)]
            handed = [pairs[i][0] for i in span] if upload else group_hosts
            handles.append(how(rt, upload, group_hosts, group_devices, handed))
            spans.append(span)
            grouped.append(True)
            fresh.clear()
    except BaseException as exc:
        # every leaf owned again before the refusal is raised (the copies already queued complete)
        for handle in handles:
            with contextlib.suppress(FerryError):
                handle.wait()
        handles.clear()
        for device in fresh:
            if device._state is OWNED:
                device.close()
        if isinstance(exc, TransferSubmitError) and not isinstance(exc, RuntimeClosedError) and at >= 0:
            raise TransferSubmitError(
                f"{call}: leaf {describe(paths[at])} was refused ({exc}); the leaves submitted before it were "
                "waited for: every leaf is owned again"
            ) from exc
        raise
    return handles, spans, grouped


def _submit_pieces(rt: Any, upload: bool, hosts: list[Any], devices: list[Any], missing: bool,
                   fresh_outputs: bool = False) -> Any:
    """Every leaf as one piece of one staging job (:func:`ferry._routes._groups.submit_pieces`): its
    handle, or None (nothing changed) where a leaf is not the common case. ``missing``: no leaf has its other
    side yet (an upload without a destination, a download without ``out=`` or pinned leaves); those are made
    first (and closed again when the leaves go another way). Otherwise every leaf has both sides."""
    fresh: list[Any] = []
    if upload:
        if missing:  # every destination fresh: made together
            devices = fresh = empty_like_many(rt, hosts)
    elif missing and fresh_outputs:  # no out= and no pinned leaves
        hosts = _fresh_outputs(devices)
    elif missing:
        hosts = [np.empty(d.shape, d.dtype) if isinstance(d, DeviceArray) else None for d in devices]
    try:
        handle = submit_pieces(rt, upload, hosts, devices, hosts, fresh=fresh_outputs)
    except BaseException:
        for device in fresh:
            if device._state is OWNED:
                device.close()
        raise
    if handle is None:
        for device in fresh:
            device.close()
    return handle


_NBYTES = operator.attrgetter("_nbytes")
_SPEC = operator.attrgetter("_shape", "_dtype")  # a device array's (shape, dtype)


def _device_specs(leaves: list[Any]) -> tuple[list[tuple[tuple[int, ...], np.dtype[Any]]], list[int], int] | None:
    """Every leaf's ``(shape, dtype)`` and size in bytes, and their sum, where every leaf is exactly a ferry
    device array (one compiled call where the extension runs); None otherwise."""
    module = _native.load()
    if module is not None:
        return module.device_specs(leaves)  # type: ignore[no-any-return]
    if not _all_device_arrays(leaves):
        return None
    sizes = list(map(_NBYTES, leaves))
    return list(map(_SPEC, leaves)), sizes, sum(sizes)


def _all_device_arrays(leaves: list[Any]) -> bool:
    """Whether every leaf is exactly a ferry device array (the types compared in C, not one by one)."""
    return not leaves or (type(leaves[0]) is DeviceArray and len(set(map(type, leaves))) == 1)


SHARED_BYTES = 1 << 20
"""Fresh pageable outputs of a download tree below this size share one host allocation."""


def _fresh_outputs(devices: list[Any]) -> list[Any]:
    """A download's fresh pageable outputs for device leaves (``None`` where a leaf is not a ferry device
    array: the checks then refuse the fast way). The leaves under :data:`SHARED_BYTES` are views of one
    NumPy allocation, back to back (one allocation instead of one per leaf, and views made in runs); the
    allocation lives while any of them does. Larger leaves get an array of their own."""
    found = _device_specs(devices)
    if found is None:
        return [np.empty(d.shape, d.dtype) if isinstance(d, DeviceArray) else None for d in devices]
    specs, sizes, _ = found
    if max(sizes) < SHARED_BYTES:  # the common tree of small leaves: all of them in one allocation
        offsets, total = layout(sizes)
        return views(np.empty(total, np.uint8), specs, offsets, sizes)
    small = [i for i, n in enumerate(sizes) if n < SHARED_BYTES]
    out: list[Any] = [None] * len(devices)
    if len(small) > 1:
        specs = [(devices[i]._shape, devices[i]._dtype) for i in small]
        small_sizes = [sizes[i] for i in small]
        offsets, total = layout(small_sizes)
        made = views(np.empty(total, np.uint8), specs, offsets, small_sizes)
        for i, array in zip(small, made, strict=True):
            out[i] = array
    for i, d in enumerate(devices):
        if out[i] is None:
            out[i] = np.empty(d._shape, d._dtype)
    return out


def upload_tree(rt: Any, tree: Any, destination: Any = None, to: str | None = None) -> PendingUpload[Any, Any]:
    """See :meth:`ferry.Runtime.upload_tree`."""
    with gc_paused():
        return _upload_tree(rt, tree, destination, to)


def _upload_tree(rt: Any, tree: Any, destination: Any, to: str | None) -> PendingUpload[Any, Any]:
    call = "upload_tree"
    convert = _converter(to)
    rt._health.check_open()
    build, sources, paths = _flatten_host(call, tree)
    targets: list[Any] = [None] * len(sources)
    if destination is not None:
        _, targets, theirs = _flatten_device(call, destination, require=False)
        _same_paths(call, paths, theirs, "destination")
    keep_destination = destination is not None and convert is None
    # every leaf checked in one compiled call: one job for all of them, or None (then the checks below)
    fast = (_submit_pieces(rt, True, sources, targets, destination is None)
            if len(sources) > 1 and pieces_ready(rt, True) else None)
    if fast is not None:
        handles: list[Any] = [fast]
        spans, grouped = [list(range(len(sources)))], [True]
    if destination is not None and fast is None:
        for path, host, device in zip(paths, sources, targets, strict=True):
            _check_device(rt, call, path, device, write=True)
            _check_match(call, path, host, device, "destination")
        _unique(call, paths, targets, "destination")
    nbytes = fast.nbytes if fast is not None else sum(int(a.nbytes) for a in sources)

    def finish(devices: list[Any]) -> tuple[Any, Any]:
        if keep_destination:
            return tree, destination
        if convert is not None:
            devices = [convert(d) for d in devices]
        return tree, build(devices)

    if fast is None:
        sizes = [int(a.nbytes) for a in sources]
        pairs = list(zip(sources, targets, strict=True))
        handles, spans, grouped = _submit_all(rt, rt.upload, pairs, call, paths, sizes, upload=True)
    record = TreeRecord(True, handles, paths, nbytes, finish, spans, grouped)
    return PendingUpload(PORT, record)  # type: ignore[arg-type]


def download_tree(rt: Any, tree: Any, out: Any = None, pinned: bool = False) -> PendingDownload[Any, Any]:
    """See :meth:`ferry.Runtime.download_tree`."""
    with gc_paused():
        return _download_tree(rt, tree, out, pinned)


def _download_tree(rt: Any, tree: Any, out: Any, pinned: bool) -> PendingDownload[Any, Any]:
    call = "download_tree"
    if not isinstance(pinned, bool):
        raise TypeError(f"pinned must be a bool, got {type(pinned).__name__}")
    if pinned and out is not None:
        raise TransferSubmitError(f"{call}: pinned=True makes fresh host leaves; it cannot fill out= (pass one)")
    rt._health.check_open()
    build, sources, paths = _flatten_device(call, tree, require=False)
    outs: list[Any] = [None] * len(sources)
    if out is not None:
        _, outs, theirs = _flatten_host(call, out)
        _same_paths(call, paths, theirs, "out")
    missing = out is None
    fast = None
    many = len(sources) > 1 and pieces_ready(rt, False)
    if pinned and many:  # pooled pinned, the common tree: the copies queued first, the leaves made meanwhile
        fast = _pinned_tree(rt, call, sources)
        missing = fast is None
    if fast is None and pinned and _all_device_arrays(sources):  # pooled pinned: leaves, then one record
        outs = _pinned_outputs(rt, call, paths, sources)
        missing = False
    # every leaf checked in one compiled call: one job for all of them, or None (then the checks below)
    if fast is None and many:
        fast = _submit_pieces(rt, False, outs, sources, missing, fresh_outputs=out is None)
    if fast is None:
        for path, device in zip(paths, sources, strict=True):
            _check_device(rt, call, path, device, write=False)
        if out is not None:
            for path, host, device in zip(paths, outs, sources, strict=True):
                _check_match(call, path, host, device, "source")
                if not host.flags.writeable:
                    raise _refuse(call, path, "out is read-only (or the output of another pending download)")
            _unique(call, paths, outs, "out array")
        elif pinned and missing:
            outs = _pinned_outputs(rt, call, paths, sources)
        sizes = [_nbytes_of(d) for d in sources]
        nbytes = sum(sizes)
    else:
        nbytes = fast.nbytes
    torch = sys.modules.get("torch")
    kinds = [isinstance(d, torch.Tensor) for d in sources] if torch is not None and fast is None else None
    keep_out = out is not None

    def finish(hosts: list[Any]) -> tuple[Any, Any]:
        if keep_out:
            return tree, out
        if torch is not None and kinds is not None:
            hosts = [torch.from_numpy(h) if k else h for h, k in zip(hosts, kinds, strict=True)]
        return tree, build(hosts)

    if fast is None:
        pairs = list(zip(sources, outs, strict=True))
        handles, spans, grouped = _submit_all(rt, rt.download, pairs, call, paths, sizes, upload=False)
    else:
        handles, spans, grouped = [fast], [list(range(len(sources)))], [True]
    record = TreeRecord(False, handles, paths, nbytes, finish, spans, grouped)
    return PendingDownload(PORT, record)  # type: ignore[arg-type]


def _pinned_tree(rt: Any, call: str, sources: list[Any]) -> Any:
    """A download of ferry device arrays into the leaves of one pooled pinned block, its copies queued before
    the leaves are made (their views cost about what queuing does, and now run behind the DMAs): the
    handle, whose result holds the leaves, or None where a leaf is not the common case (nothing changed,
    nothing kept)."""
    found = _device_specs(sources)
    if found is None:
        return None
    specs, sizes, total = found
    leaves = rt._parts.host.pinned_leaves
    _maintain(rt)
    try:
        held = leaves.block(sizes)
    except (MemoryError, ValueError, DeviceError) as exc:
        raise _no_pinned(rt, call, f"{len(specs)} leaves, {total} bytes", exc) from exc
    made: list[Any] = [held.base]  # the record's host side: the block stays the copy's until it is resolved
    try:
        handle = submit_into_block(rt, sources, held.leaf.ptr, held.offsets, held.leaf, made)
    except BaseException:
        held.give_back()
        raise
    if handle is None:
        held.give_back()
        return None
    try:
        made[:] = views(held.base, specs, held.offsets, sizes)
    except BaseException as exc:  # no host memory for the leaves: the copy is waited (it writes the block) and dropped
        with contextlib.suppress(TransferFailedError):  # (a failed copy keeps the block: never reused)
            handle.wait()
        raise TransferSubmitError(f"{call}: could not make the tree's {len(specs)} host leaves ({exc!r}); its copy "
                                  "was waited and dropped: nothing was published") from exc
    return handle


def _maintain(rt: Any) -> None:
    """Free or reuse the pinned blocks that collected leaves gave back, when any maintenance is due."""
    with rt._lock:
        rt._completion.maintain_if_due()


def _no_pinned(rt: Any, call: str, what: str, exc: BaseException) -> TransferSubmitError:
    """The refusal for a tree whose pinned leaves could not be had (``exc``: the pool's error)."""
    if isinstance(exc, DeviceError):
        rt._health.note(exc)
        return TransferSubmitError(f"{call}: the device refused pinned memory for the tree's {what}: {exc}; "
                                   "nothing was submitted")
    return TransferSubmitError(f"{call}: no pinned memory for the tree's {what}: {exc}; nothing was submitted")


def _pinned_outputs(rt: Any, call: str, paths: Sequence[Path], sources: list[Any]) -> list[np.ndarray[Any, Any]]:
    """A pooled pinned array for every leaf (all or none: on a refusal the ones made are dropped)."""
    specs: list[tuple[tuple[int, ...], np.dtype[Any]]]
    leaves = rt._parts.host.pinned_leaves
    _maintain(rt)  # blocks given back by collected leaves are freed or reused first
    sizes: list[int] | None = None
    found = _device_specs(sources)
    if found is not None:  # the common tree: no per-leaf call
        wanted = list(range(len(sources)))
        specs, sizes, total = found
    else:
        described = [_dtype_of(device) for device in sources]
        wanted = [i for i, (_, dtype) in enumerate(described) if dtype is not None]  # DLPack alone: plain NumPy
        specs = []
        total = 0
        for i in wanted:
            shape, dtype = described[i]
            assert dtype is not None
            specs.append((shape, dtype))
            total += math.prod(shape) * dtype.itemsize
    what = f"{len(specs)} leaves, {total} bytes"
    try:
        made = leaves.shared(specs, sizes) if len(specs) > 1 else leaves.arrays(specs)  # a tree: one block
    except (MemoryError, ValueError, DeviceError) as exc:
        raise _no_pinned(rt, call, what, exc) from exc
    if len(made) == len(sources):  # every leaf has one (the common tree)
        return list(made)
    outs: list[Any] = [None] * len(sources)
    for i, array in zip(wanted, made, strict=True):
        outs[i] = array
    return outs
