"""safetensors files: ``ferry.load_safetensors`` and ``ferry.save_safetensors``.

The format: 8 bytes (little-endian ``u64``) giving the header's length, a
JSON header mapping each tensor's name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets from the end of the header) and an
optional ``"__metadata__"`` of strings, then the tensors' bytes, back to
back. A sharded checkpoint adds ``*.safetensors.index.json``, whose
``"weight_map"`` names each tensor's shard.

Every header (every shard's) is read and checked before any device memory is
allocated, so a malformed header, an unknown dtype, a tensor past the end of
its file or a missing shard fails the load before it starts. Each file's
tensors are then read in one pass (see ``_common``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._common import (
    CheckpointError,
    Entry,
    Progress,
    check_library_kinds,
    convert,
    device_source,
    load_entries,
    runtime_arg,
    to_arg,
    write_pieces,
)
from ._dtypes import KINDS, numpy_dtype, packed_shape

if TYPE_CHECKING:
    from .._device_array import DeviceArray
    from .._runtime import Runtime

__all__ = ["load_safetensors", "save_safetensors", "read_safetensors_header"]

MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors format allows."""


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int, int]:
    """A safetensors file's header: ``(header dict, data start, file size)``, checked.

    Raises
    ------
    CheckpointError
        The file cannot be read, its header is malformed, a tensor has an unknown dtype, a shape that
        does not match its byte range, a range that overlaps another, or runs past the end of the file.
    """
    name = os.fsdecode(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{name!r} is not a safetensors file: {size} bytes, no header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(
                    f"{name!r} has a malformed header: it claims {length} bytes of header in a file of {size}"
                )
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read {name!r}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{name!r} has a malformed header: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name!r} has a malformed header: a JSON {type(header).__name__}, not an object")
    start = 8 + length
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CheckpointError(f"{name!r} has a malformed header: __metadata__ must map strings to strings")
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"{name!r} has a malformed header: tensor {key!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise CheckpointError(f"{name!r} has a malformed header: tensor {key!r} has no dtype")
        kind = KINDS.get(dtype)
        if kind is None:
            raise CheckpointError(f"{name!r}: tensor {key!r} has dtype {dtype!r}, which ferry does not know")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise CheckpointError(f"{name!r} has a malformed header: tensor {key!r} has shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{name!r} has a malformed header: tensor {key!r} has data_offsets {offsets!r}")
        bits = math.prod(shape) * kind.bits
        if -(-bits // 8) != offsets[1] - offsets[0]:
            raise CheckpointError(
                f"{name!r}: tensor {key!r} ({dtype}, shape {shape}) needs {-(-bits // 8)} bytes, "
                f"its data_offsets span {offsets[1] - offsets[0]}"
            )
        if start + offsets[1] > size:
            raise CheckpointError(
                f"{name!r}: tensor {key!r} runs past the end of the file (bytes {start + offsets[0]} - "
                f"{start + offsets[1]}, the file holds {size})"
            )
        spans.append((offsets[0], offsets[1], key))
    spans.sort()
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            raise CheckpointError(f"{name!r} has a malformed header: tensors {a!r} and {b!r} overlap")
    return header, start, size


def _files_of(path: Any) -> list[str]:
    """The shard paths a ``path`` argument names (one file, a list of files, an index)."""
    if isinstance(path, (str, os.PathLike)):
        text = os.fsdecode(path)
        if text.endswith(".json"):
            return _index_shards(text)
        return [text]
    if isinstance(path, Iterable) and not isinstance(path, (bytes, Mapping)):
        files = [os.fsdecode(p) for p in path]
        if not files:
            raise ValueError("load_safetensors needs at least one file")
        return files
    raise TypeError(f"path must be a path, a list of paths or an index .json, got {type(path).__name__}")


def _index_shards(index: str) -> list[str]:
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise CheckpointError(f"cannot read the index {index!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"the index {index!r} is not JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"the index {index!r} has no weight_map of tensor names to shard files")
    base = os.path.dirname(index)
    shards: list[str] = []
    for tensor, shard in weight_map.items():
        full = os.path.join(base, shard)
        if not os.path.isfile(full):
            raise CheckpointError(f"the index {index!r} names shard {shard!r} (tensor {tensor!r}), which is missing")
        if full not in shards:
            shards.append(full)
    return shards


def load_safetensors(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    runtime: Runtime | None = None,
    to: str | None = None,
    names: Iterable[str] | None = None,
    progress: Progress | None = None,
    direct: bool | None = None,
) -> dict[str, Any]:
    """Load a safetensors checkpoint onto the device: one file, a list of shards, or an index.

    Parameters
    ----------
    path
        A ``.safetensors`` file, a list of them (shards), or a ``*.safetensors.index.json``.
    runtime
        The runtime whose device receives the tensors; ``None``: one runtime shared by ferry's file
        functions, made on first use and closed at exit.
    to
        ``None``: :class:`~ferry.DeviceArray` values, with NumPy's dtype or, for bf16 and the 8-bit
        floats, ``ml_dtypes``' (install ``ferry[files]``). ``"torch"``, ``"cupy"`` or ``"jax"``: that
        library's arrays with its own dtype (no copy on the device, except JAX's bitcast for dtypes
        NumPy lacks). CuPy has no bf16 or 8-bit floats: such tensors are refused before anything is read.
    names
        Only these tensors (each must exist); ``None``: all.
    progress
        Called as ``progress(bytes_done, bytes_total)`` from the calling thread, about every 50 ms and
        once at the end.
    direct
        ``O_DIRECT`` reads (see :meth:`ferry.Runtime.upload_file`).

    Returns
    -------
    dict
        Tensor name -> array, in the files' order.

    Guarantees
    ----------
    Every header is checked before device memory is allocated. Each file is read once, in large
    sequential reads straight into pinned slots, each tensor's bytes DMA'd to its own array (no host
    copy of the file, no second copy on the device); host memory stays bounded by the slots. On any
    error (:class:`~ferry.CheckpointError`, naming the file and the tensor), or Ctrl-C, nothing the
    load allocated stays allocated.

    Raises
    ------
    CheckpointError
        A malformed header, an unknown dtype, a tensor past the end of its file, a missing shard, a
        name not in the checkpoint, a tensor in two shards, a file that changed size during the load,
        a failed read.
    ImportError
        A tensor needs ``ml_dtypes`` (``to=None`` with bf16 or fp8) and it is not installed; or ``to``
        names a library that is not installed.
    """
    to = to_arg(to)
    rt = runtime_arg(runtime)
    files = _files_of(path)
    if isinstance(names, str):
        raise TypeError("names must be a list of tensor names, not a string")
    wanted = None if names is None else list(names)
    wanted_set = None if wanted is None else set(wanted)
    plans: list[tuple[str, int, list[Entry]]] = []
    seen: dict[str, str] = {}
    for file in files:
        header, start, size = read_safetensors_header(file)
        entries = []
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in seen:
                raise CheckpointError(f"tensor {key!r} is in two shards: {seen[key]!r} and {file!r}")
            seen[key] = file
            if wanted_set is not None and key not in wanted_set:
                continue
            kind = KINDS[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            dtype = numpy_dtype(kind, f"{file!r}: tensor {key!r}") if to is None else __import__("numpy").dtype(
                kind.carrier)
            entries.append(Entry(key, start + begin, end - begin,
                                 packed_shape(kind, shape) if kind.packed else shape, kind, dtype))
        check_library_kinds(to, entries, file)
        plans.append((file, size, entries))
    if wanted is not None:
        missing = [n for n in wanted if n not in seen]
        if missing:
            raise CheckpointError(f"tensor {missing[0]!r} is not in {files[0]!r}" + (
                f" or its {len(files) - 1} other shard(s)" if len(files) > 1 else ""))
    total = sum(e.nbytes for _, _, entries in plans for e in entries)
    loaded: dict[str, DeviceArray] = {}
    by_name: dict[str, Entry] = {}
    done = 0
    try:
        for file, size, entries in plans:
            arrays = load_entries(rt, file, entries, expect_size=size, direct=direct, progress=progress,
                                  done_before=done, total=total)
            loaded.update(arrays)
            by_name.update((e.name, e) for e in entries)
            done += sum(e.nbytes for e in entries)
        return convert(loaded, by_name, to)
    except BaseException:
        for array in loaded.values():
            if array.state == "owned":
                array.close()
        raise


def save_safetensors(
    tensors: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    runtime: Runtime | None = None,
    metadata: Mapping[str, str] | None = None,
    progress: Progress | None = None,
) -> None:
    """Write device tensors into a safetensors file that the ``safetensors`` package reads.

    ``tensors`` maps names to :class:`~ferry.DeviceArray` values of ``runtime``, or to contiguous CUDA
    arrays of PyTorch, CuPy or JAX on its device (their producer's stream is synchronized first).
    Tensors are laid out as the ``safetensors`` package lays them out (largest element first, then by
    name; the header padded to 8 bytes) and written from pinned slots with ``pwrite`` on several
    threads. The file is written under a temporary name and renamed into place once complete: a failed
    save leaves no partial file at ``path``. Device arrays are read-leased while they are written.

    Raises
    ------
    CheckpointError
        The file could not be written (the message names it and the tensor).
    TransferSubmitError
        A tensor is not a device array of this runtime's device, not contiguous, in flight or closed;
        nothing was written.
    TypeError
        A dtype safetensors cannot hold.
    """
    rt = runtime_arg(runtime)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to device arrays, got {type(tensors).__name__}")
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("metadata must map strings to strings")
    sources = []
    syncs = []
    for key, value in tensors.items():
        if not isinstance(key, str) or key == "__metadata__":
            raise TypeError(f"tensor names must be strings other than '__metadata__', got {key!r}")
        source, sync = device_source(rt, key, value)
        sources.append(source)
        if sync is not None:
            syncs.append(sync)
    sources.sort(key=lambda s: (-max(1, s.kind.bits // 8), s.name))
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    offsets = []
    at = 0
    for s in sources:
        header[s.name] = {"dtype": s.kind.name, "shape": list(s.shape), "data_offsets": [at, at + s.nbytes]}
        offsets.append(at)
        at += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    for sync in syncs:
        sync()
    write_pieces(rt, path, head, sources, [len(head) + o for o in offsets], len(head) + at, progress=progress)
