"""The ``files`` group: checkpoint loading and saving, against the peers and the machine's own ceiling.

It writes a safetensors checkpoint shaped like a 1.5B-parameter decoder
(fp16, hidden 1536, 28 layers, a 151936-token vocabulary: about 3.1 GB in
340 tensors; 8 layers in ``--quick``, a toy on the emulated device), then in
one run:

* ``ceiling``: parallel ``preadv`` of the whole file into pinned 16 MiB
  buffers on 12 threads, no GPU (warm; cold through the page cache and with
  ``O_DIRECT``, the faster being the cold ceiling); parallel ``pwritev`` of as
  many bytes from pinned buffers (saving's ceiling);
* ``ferry``: :func:`ferry.load_safetensors` (warm, cold) and
  :func:`ferry.save_safetensors` of the loaded tensors;
* ``torch``: ``safetensors.torch.load_file(device="cuda")`` and ``save_file``
  of the same tensors on the GPU;
* ``fastsafetensors`` (``nogds=True``) where it is installed;
* ``raw``: the raw driver's pageable copies from the ``mmap``'ed file.

Cold means the page cache dropped before each run (``/proc/sys/vm/drop_caches``
where it is writable, after ``os.sync()``), else the file's own pages evicted
(``posix_fadvise(POSIX_FADV_DONTNEED)``) where that works; where neither does,
cold runs read with ``O_DIRECT`` (ferry's ``direct=True``, the ceiling's
``O_DIRECT`` reads) and the note says so. Before each cold run the fraction
of the file still resident is measured (``mincore``): the note quotes it, and
a run that started with more than 5 % resident is marked invalid (not cold).
Nothing keeps the file mapped meanwhile: the verification reads it with
``pread`` (a mapping's touched pages survive a drop of the cache). Every
contender's result is compared, tensor by tensor, with the file's bytes (a
saved file's tensors with the original's), outside the timed region. The
host memory a ferry load adds beyond the runtime's
pinned pool is measured too (peak resident set, ``VmHWM``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._files._safetensors import read_safetensors_header
from .._routes._file import ALIGN, resident_fraction
from ._protocol import Result

__all__: list[str] = []

GROUP = "files"
MiB, GiB = 1 << 20, 1 << 30
CEILING_THREADS = 12
CEILING_BUFFER = 16 * MiB


# -- the checkpoint -----------------------------------------------------------------------------------
def decoder_shapes(layers: int, hidden: int, intermediate: int, vocab: int, kv: int) -> dict[str, tuple[int, ...]]:
    """A decoder's tensors (Qwen2-style names and shapes)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def checkpoint_shapes(emulated: bool, quick: bool) -> dict[str, tuple[int, ...]]:
    """The bench's checkpoint: the 1.5B decoder (28 layers), 8 layers in quick runs, a toy on the emulated
    device."""
    if emulated:
        return decoder_shapes(2, 64, 128, 1000, 16)
    return decoder_shapes(8 if quick else 28, 1536, 8960, 151936, 256)


def write_checkpoint(path: str, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> int:
    """Write random fp16 bytes in safetensors layout (no dependency); return the payload's bytes."""
    header: dict[str, Any] = {}
    at = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        block = rng.integers(0, 1 << 16, size=8 * MiB // 2, dtype=np.uint16)
        left = at
        k = 0
        while left:
            n = min(left, block.nbytes)
            f.write((block + k).tobytes()[:n])  # a different pattern per block: misplaced bytes show
            left -= n
            k += 1
    return at


def _folder() -> str:
    """A scratch folder on a disk: ``FERRY_BENCH_DIR``, else the current directory (a tmpfs ``/tmp`` has no
    cold reads and refuses ``O_DIRECT``), else the temporary directory."""
    for base in [b for b in (os.environ.get("FERRY_BENCH_DIR"), os.getcwd()) if b]:
        try:
            return tempfile.mkdtemp(prefix="ferry-bench-files-", dir=base)
        except OSError:
            continue
    return tempfile.mkdtemp(prefix="ferry-bench-files-")


def filesystem_of(path: str) -> str:
    """The filesystem type and device holding ``path`` (from /proc/mounts), or "an unknown filesystem"."""
    best = ("", "an unknown filesystem")
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best[0]):
                best = (parts[1], f"{parts[2]} ({parts[0]})")
    return best[1]


# -- cold ------------------------------------------------------------------------------------------------
def can_drop_caches() -> bool:
    """Whether this process may drop the page cache."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def evict_file(path: str) -> float | None:
    """Write back the file's dirty pages and evict its clean ones (``posix_fadvise(POSIX_FADV_DONTNEED)``,
    no privilege needed); return the fraction of its pages still resident (``mincore``), or None where
    that cannot be asked."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        advise = getattr(os, "posix_fadvise", None)
        if advise is not None:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return resident_fraction(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


COLD_RESIDENT = 0.05
"""A cold run whose file has more of its pages resident than this at the start is not cold (the row says
so and is marked invalid)."""


class Cold:
    """How the cold runs of one file are made cold, and the proof that they were.

    ``drop`` (``/proc/sys/vm/drop_caches`` writable, a real device): the page cache is dropped before each
    run, and the file's own pages evicted too; else, where evicting the file's pages works (they are gone
    afterwards, by ``mincore``), that alone; else cold runs read with ``O_DIRECT``. Before each run of the
    first two the file's resident fraction is measured (``mincore``, sampled): :meth:`note` quotes the
    largest, and :meth:`honest` is False when it exceeds :data:`COLD_RESIDENT`.
    """

    def __init__(self, path: str, drop: bool) -> None:
        self.path = path
        self.drop = drop
        self.resident: list[float] = []
        if drop:
            self.evicts = True
            self.how = "page cache dropped before each run"
        else:
            left = evict_file(path)
            self.evicts = left is not None and left <= COLD_RESIDENT
            self.how = ("the file's pages evicted (posix_fadvise DONTNEED) before each run" if self.evicts
                        else "O_DIRECT (the page cache cannot be dropped here)")

    def before(self) -> None:
        """Make the next run cold (untimed)."""
        if not self.evicts:
            return
        if self.drop:
            drop_caches()
        left = evict_file(self.path)
        self.resident.append(1.0 if left is None else left)

    def honest(self) -> bool:
        """Whether every run measured since the last :meth:`note` started cold."""
        return all(r <= COLD_RESIDENT for r in self.resident)

    def note(self, prefix: str = "") -> str:
        """The rows' note: how, and how much of the file was resident at the start (then forgets it)."""
        text = prefix + self.how
        if self.resident:
            worst = max(self.resident)
            text += f"; {worst * 100:.1f} % of the file resident at the start"
            if worst > COLD_RESIDENT:
                text += " (NOT cold)"
        self.resident = []
        return text


# -- the machine's ceiling ---------------------------------------------------------------------------
class Ceiling:
    """Parallel ``preadv``/``pwritev`` between a file and pinned buffers, no GPU (the machine's own limit)."""

    def __init__(self, rt: Any, threads: int = CEILING_THREADS, buffer: int = CEILING_BUFFER) -> None:
        self.buffers = [rt.pinned(buffer + ALIGN) for _ in range(threads)]
        self.views = []
        for b in self.buffers:
            base = b.as_array(np.uint8)
            skip = -int(base.ctypes.data) % ALIGN
            self.views.append(memoryview(base[skip:skip + buffer]))
        self.buffer = buffer

    def run(self, path: str, start: int, end: int, *, write: bool = False, direct: bool = False) -> int:
        """Read (or write) ``[start, end)`` of ``path`` in buffer-sized pieces on the threads; return bytes."""
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o644)
        lock = threading.Lock()
        nxt = [start // ALIGN * ALIGN if direct else start]
        moved = [0]
        errors: list[BaseException] = []

        def worker(view: memoryview) -> None:
            try:
                while True:
                    with lock:
                        at = nxt[0]
                        if at >= end:
                            return
                        nxt[0] = at + self.buffer
                    n = min(self.buffer, end - at)
                    if direct:
                        n = -(-n // ALIGN) * ALIGN
                    done = (os.pwritev if write else os.preadv)(fd, [view[:n]], at)
                    with lock:
                        moved[0] += done
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(v,)) for v in self.views]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.close(fd)
        if errors:
            raise errors[0]
        return moved[0]

    def close(self) -> None:
        self.views.clear()
        for b in self.buffers:
            b.close()


# -- verification -------------------------------------------------------------------------------------
class Reference:
    """The checkpoint file's tensors, read with ``pread`` when compared (never mapped: a mapping's touched
    pages stay resident through a drop of the page cache, and the next "cold" run would read them warm)."""

    def __init__(self, path: str) -> None:
        header, start, _ = read_safetensors_header(path)
        self.path = path
        self.spans = {k: (start + v["data_offsets"][0], start + v["data_offsets"][1])
                      for k, v in header.items() if k != "__metadata__"}
        self.start = start

    def bytes_of(self, name: str) -> np.ndarray[Any, Any]:
        a, b = self.spans[name]
        out = np.empty(b - a, np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = 0
            while got < out.size:
                n = os.preadv(fd, [out.data[got:]], a + got)
                if n <= 0:
                    break
                got += n
        finally:
            os.close(fd)
        return out[:got]

    def same(self, name: str, host: np.ndarray[Any, Any]) -> bool:
        return bool(np.array_equal(np.ascontiguousarray(host).view(np.uint8).reshape(-1), self.bytes_of(name)))


def verify_device_arrays(rt: Any, ref: Reference, loaded: dict[str, Any]) -> bool:
    return sorted(loaded) == sorted(ref.spans) and all(ref.same(k, rt.to_host(v)) for k, v in loaded.items())


def verify_torch(torch: Any, ref: Reference, loaded: dict[str, Any]) -> bool:
    if sorted(loaded) != sorted(ref.spans):
        return False
    return all(v.is_cuda and ref.same(k, v.contiguous().view(torch.uint8).cpu().numpy()) for k, v in loaded.items())


def verify_file(ref: Reference, path: str) -> bool:
    other = Reference(path)
    return sorted(other.spans) == sorted(ref.spans) and all(
        np.array_equal(other.bytes_of(k), ref.bytes_of(k)) for k in ref.spans)


# -- timing ----------------------------------------------------------------------------------------------
def timed(op: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None,
          after: Callable[[Any], Any] | None = None) -> list[float]:
    """``reps`` wall-clock samples of ``op`` (``before`` untimed ahead of each, ``after`` on its result)."""
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = op()
        samples.append(time.perf_counter() - t0)
        if after is not None:
            after(out)
        del out
    return samples


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes, or (0, 0) where /proc does not say."""
    found = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found.get("VmRSS", 0), found.get("VmHWM", 0)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
    except OSError:
        return False
    return True


# -- the group -----------------------------------------------------------------------------------------
def case_count(ctx: Any) -> int:
    """How many rows the group records (the progress bar's total)."""
    has = {name: int(name in ctx.peers) for name in ("raw", "torch")}
    fast = int(has["torch"] and _fastsafetensors() is not None)
    return 8 + 2 * has["raw"] + 3 * has["torch"] + fast


def _fastsafetensors() -> Any:
    try:
        return importlib.import_module("fastsafetensors")
    except ImportError:
        return None


def route_note(rt: Any) -> str:
    """Who carries a file load on ``rt``: the compiled lanes (their count and slots) or the reader threads."""
    from .._routes._file import MAX_READERS, SLOT_BYTES, SLOTS_PER_READER
    from .._routes._staged import native_module
    from .._runtime import parts_of

    config = parts_of(rt).staging
    if native_module(config) is not None:
        return (f"compiled lanes: {config.lanes} lanes x {config.slots_per_lane} slots x "
                f"{config.slot_bytes >> 20} MiB")
    return f"reader threads: up to {MAX_READERS} x {SLOTS_PER_READER} slots x {SLOT_BYTES >> 20} MiB"


def group_files(ctx: Any) -> None:
    """Run the group (see the module docstring)."""
    import ferry

    rt = ctx.rt
    emulated = rt.backend == "emulated"
    shapes = checkpoint_shapes(emulated, ctx.quick)
    reps = 2 if ctx.quick or emulated else 3
    cold_reps = 1 if ctx.quick or emulated else 2
    folder = _folder()
    path = os.path.join(folder, "model.safetensors")
    saved = os.path.join(folder, "saved.safetensors")
    nbytes = write_checkpoint(path, shapes)
    size = os.path.getsize(path)
    config = f"{len(shapes)} tensors, {nbytes / GiB:.2f} GiB fp16, on {filesystem_of(folder)}"
    cold = Cold(path, can_drop_caches() and not emulated)  # (a toy run leaves the machine's cache alone)
    ref = Reference(path)
    ceiling = Ceiling(rt)

    def record(impl: str, route: str, direction: str, samples: list[float], valid: bool | None,
               note: str = "", n: int = nbytes) -> None:
        ctx.results.append(Result(GROUP, impl, route, direction, n, samples=samples, valid=valid, note=note,
                                  config=config))

    def run(impl: str, route: str, direction: str, fn: Callable[[], None]) -> None:
        ctx.progress(f"{GROUP}: {impl} {route} {direction}")
        try:
            fn()
        except Exception as exc:
            record(impl, route, direction, [], False, f"error: {exc!r}")

    def warm_up() -> None:
        with open(path, "rb") as f:
            while f.read(64 * MiB):
                pass

    try:
        # the machine's ceiling, warm then cold
        def ceiling_warm() -> None:
            warm_up()
            got = ceiling.run(path, 0, size)
            record("ceiling", "pread", "warm", timed(lambda: ceiling.run(path, 0, size), reps), got >= size,
                   f"{CEILING_THREADS} threads, preadv into pinned {CEILING_BUFFER >> 20} MiB buffers", size)

        def ceiling_cold() -> None:
            moved: list[int] = []
            samples = timed(lambda: ceiling.run(path, 0, size, direct=not cold.evicts), cold_reps, cold.before,
                            after=moved.append)
            honest = cold.honest()
            record("ceiling", "pread", "cold", samples, all(n >= size for n in moved) and honest, cold.note(), size)

        def ceiling_cold_direct() -> None:
            moved: list[int] = []
            samples = timed(lambda: ceiling.run(path, 0, size, direct=True), cold_reps, cold.before,
                            after=moved.append)
            honest = cold.honest()
            record("ceiling", "pread_direct", "cold", samples, all(n >= size for n in moved) and honest,
                   cold.note("O_DIRECT; "), size)

        run("ceiling", "pread", "warm", ceiling_warm)
        run("ceiling", "pread", "cold", ceiling_cold)
        run("ceiling", "pread_direct", "cold", ceiling_cold_direct)

        # ferry, warm then cold
        def ferry_warm() -> None:
            warm_up()
            loaded = ferry.load_safetensors(path, runtime=rt)
            valid = verify_device_arrays(rt, ref, loaded)
            del loaded
            record("ferry", "load_safetensors", "warm",
                   timed(lambda: ferry.load_safetensors(path, runtime=rt), reps, after=lambda out: out.clear()),
                   valid, route_note(rt))

        def ferry_cold() -> None:
            direct = None if cold.evicts else True
            checked: list[bool] = []

            def check(out: dict[str, Any]) -> None:
                checked.append(verify_device_arrays(rt, ref, out))
                out.clear()

            samples = timed(lambda: ferry.load_safetensors(path, runtime=rt, direct=direct), cold_reps, cold.before,
                            after=check)
            honest = cold.honest()
            record("ferry", "load_safetensors", "cold", samples, all(checked) and honest,
                   f"{cold.note()}; {route_note(rt)}")

        def ferry_memory() -> None:
            warm_up()
            pool = rt.stats().pinned_pool_bytes
            rss, _ = _rss()
            if not _reset_peak():
                record("ferry", "host_memory", "host", [], None, "no /proc/self/clear_refs: not measured")
                return
            loaded = ferry.load_safetensors(path, runtime=rt)
            _, peak = _rss()
            grown = max(0, rt.stats().pinned_pool_bytes - pool)
            extra = peak - rss - grown - (nbytes if emulated else 0)  # the emulated device's memory is the host's
            del loaded
            ctx.results.append(Result(GROUP, "ferry", "host_memory", "host", max(0, extra), samples=[0.0],
                                      valid=None, note=f"peak RSS above the start, less the pinned pool's growth "
                                      f"({grown >> 20} MiB): {max(0, extra) / MiB:.0f} MiB", config=config))

        run("ferry", "load_safetensors", "warm", ferry_warm)
        run("ferry", "load_safetensors", "cold", ferry_cold)
        run("ferry", "host_memory", "host", ferry_memory)

        # saving: the pwrite ceiling, then ferry
        def ceiling_write() -> None:
            target = os.path.join(folder, "ceiling.bin")

            def once() -> None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target)
                ceiling.run(target, 0, size, write=True)

            once()
            valid = os.path.getsize(target) >= size
            record("ceiling", "pwrite", "save", timed(once, reps), valid,
                   f"{CEILING_THREADS} threads, pwritev from pinned buffers", size)
            os.unlink(target)

        def ferry_save() -> None:
            loaded = ferry.load_safetensors(path, runtime=rt)

            def once() -> None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(saved)
                ferry.save_safetensors(loaded, saved, runtime=rt)

            once()
            valid = verify_file(ref, saved)
            record("ferry", "save_safetensors", "save", timed(once, reps), valid, route_note(rt))
            loaded.clear()
            os.unlink(saved)

        run("ceiling", "pwrite", "save", ceiling_write)
        run("ferry", "save_safetensors", "save", ferry_save)

        if "torch" in ctx.peers:
            _torch_rows(ctx, path, saved, ref, reps, cold_reps, cold, warm_up, record, run)
        if "raw" in ctx.peers:
            run("raw", "pageable_mmap", "warm", lambda: _raw_row(ctx, path, ref, reps, warm_up, record))
            run("raw", "pread_dma", "warm", lambda: _raw_pread_dma_row(ctx, path, ref, reps, warm_up, record))
    finally:
        ceiling.close()
        shutil.rmtree(folder, ignore_errors=True)


def _torch_rows(ctx: Any, path: str, saved: str, ref: Reference, reps: int, cold_reps: int, cold: Cold,
                warm_up: Callable[[], None], record: Callable[..., None],
                run: Callable[[str, str, str, Callable[[], None]], None]) -> None:
    import torch

    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        return

    def warm() -> None:
        warm_up()
        loaded = load_file(path, device="cuda")
        valid = verify_torch(torch, ref, loaded)
        del loaded

        def once() -> Any:
            out = load_file(path, device="cuda")
            torch.cuda.synchronize()
            return out

        record("torch", "safetensors.load_file", "warm", timed(once, reps), valid)

    def cold_load() -> None:
        if not cold.evicts:
            record("torch", "safetensors.load_file", "cold", [], None, "the page cache cannot be dropped here")
            return

        def once() -> Any:
            out = load_file(path, device="cuda")
            torch.cuda.synchronize()
            return out

        checked: list[bool] = []
        samples = timed(once, cold_reps, cold.before,
                        after=lambda out: checked.append(verify_torch(torch, ref, out)))
        honest = cold.honest()
        record("torch", "safetensors.load_file", "cold", samples, all(checked) and honest, cold.note())

    def save() -> None:
        tensors = load_file(path, device="cuda")

        def once() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(saved)
            save_file(tensors, saved)

        once()
        valid = verify_file(ref, saved)
        record("torch", "safetensors.save_file", "save", timed(once, reps), valid)
        tensors.clear()
        os.unlink(saved)

    run("torch", "safetensors.load_file", "warm", warm)
    run("torch", "safetensors.load_file", "cold", cold_load)
    run("torch", "safetensors.save_file", "save", save)
    fast = _fastsafetensors()
    if fast is not None:
        run("fastsafetensors", "nogds", "warm", lambda: _fast_row(fast, torch, path, ref, reps, warm_up, record))


def _fast_row(fast: Any, torch: Any, path: str, ref: Reference, reps: int, warm_up: Callable[[], None],
              record: Callable[..., None]) -> None:
    def once() -> dict[str, Any]:
        opener = getattr(fast, "fastsafe_open", None)
        if opener is not None:
            with opener(filenames=[path], nogds=True, device="cuda:0") as f:
                out = {k: f.get_tensor(k).clone() for k in ref.spans}  # its buffer is freed on exit
        else:
            loader = fast.SafeTensorsFileLoader(fast.SingleGroup(), "cuda:0", nogds=True)
            loader.add_filenames({0: [path]})
            buffers = loader.copy_files_to_device()
            out = {k: buffers.get_tensor(k).clone() for k in ref.spans}
            buffers.close()
            loader.close()
        torch.cuda.synchronize()
        return out

    warm_up()
    loaded = once()
    valid = verify_torch(torch, ref, loaded)
    del loaded
    record("fastsafetensors", "nogds", "warm", timed(once, reps), valid,
           "nogds=True, tensors cloned out of its buffer (one device copy more)")


def _raw_row(ctx: Any, path: str, ref: Reference, reps: int, warm_up: Callable[[], None],
             record: Callable[..., None]) -> None:
    raw = ctx.peers["raw"]
    d = raw.d
    spans = sorted(ref.spans.values())
    total = spans[-1][1] - spans[0][0]
    dev = raw.device(total)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")  # this row's own mapping (the cold rows ran before)
    base = int(mapped.ctypes.data)

    def once() -> None:
        stream = raw.streams[0]
        for a, b in spans:
            (err,) = d.cuMemcpyHtoDAsync(dev + (a - spans[0][0]), base + a, b - a, stream)
            if err:
                raise RuntimeError(f"cuMemcpyHtoDAsync: {err}")
        (err,) = d.cuStreamSynchronize(stream)
        if err:
            raise RuntimeError(f"cuStreamSynchronize: {err}")

    warm_up()
    once()
    back = np.empty(total, np.uint8)
    err = _copy_back(d, raw.streams[0], back, dev)
    valid = not err and bool(np.array_equal(back, mapped[spans[0][0]:spans[-1][1]]))
    del back
    record("raw", "pageable_mmap", "warm", timed(once, reps), valid, "cuMemcpyHtoDAsync per tensor from np.memmap")
    del mapped


def _copy_back(d: Any, stream: Any, back: np.ndarray[Any, Any], dev: int) -> Any:
    """Copy ``back.nbytes`` device bytes at ``dev`` into ``back`` (pageable); the first error, or 0."""
    (err,) = d.cuMemcpyDtoHAsync(int(back.ctypes.data), dev, back.nbytes, stream)
    if not err:
        (err,) = d.cuStreamSynchronize(stream)
    return err


def _raw_pread_dma_row(ctx: Any, path: str, ref: Reference, reps: int, warm_up: Callable[[], None],
                       record: Callable[..., None]) -> None:
    """The ceiling with the GPU in the loop: the ceiling's 12 threads each ``preadv`` into one of two
    pinned 16 MiB buffers and DMA it (``cuMemcpyHtoDAsync``, its own stream) into one device buffer laid
    out like the file, waiting for a buffer's previous DMA before refilling it. Raw ``cuda.bindings``, no
    tensors: what the page cache, the host's memory and the link allow a load read this way."""
    raw = ctx.peers["raw"]
    d = raw.d
    size = os.path.getsize(path)
    backend = raw.backend
    made: list[tuple[Any, list[Any]]] = []  # ferry's backend's objects, destroyed at the end
    pinned: list[Any] = []
    lanes: list[tuple[Any, list[tuple[int, memoryview]], list[Any]]] = []
    (err, dev) = d.cuMemAlloc(size)
    if err:
        raise RuntimeError(f"cuMemAlloc: {err}")
    dev = int(dev)

    def once() -> None:
        lock = threading.Lock()
        nxt = [0]
        errors: list[BaseException] = []

        def worker(stream: Any, buffers: list[tuple[int, memoryview]], events: list[Any]) -> None:
            busy = [False, False]
            k = 0
            try:
                while True:
                    with lock:
                        at = nxt[0]
                        if at >= size:
                            break
                        nxt[0] = at + CEILING_BUFFER
                    i = k & 1
                    k += 1
                    if busy[i]:
                        (err,) = d.cuEventSynchronize(events[i])
                        if err:
                            raise RuntimeError(f"cuEventSynchronize: {err}")
                    n = min(CEILING_BUFFER, size - at)
                    got = 0
                    hptr, view = buffers[i]
                    while got < n:
                        r = os.preadv(fd, [view[got:n]], at + got)
                        if r <= 0:
                            raise RuntimeError(f"short read at {at + got}")
                        got += r
                    (err,) = d.cuMemcpyHtoDAsync(dev + at, hptr, n, stream)
                    if err:
                        raise RuntimeError(f"cuMemcpyHtoDAsync: {err}")
                    (err,) = d.cuEventRecord(events[i], stream)
                    if err:
                        raise RuntimeError(f"cuEventRecord: {err}")
                    busy[i] = True
                for i in (0, 1):
                    if busy[i]:
                        d.cuEventSynchronize(events[i])
            except BaseException as exc:
                errors.append(exc)

        fd = os.open(path, os.O_RDONLY)
        try:
            threads = [threading.Thread(target=worker, args=lane) for lane in lanes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            os.close(fd)
        if errors:
            raise errors[0]

    try:
        for _ in range(CEILING_THREADS):
            stream, events = backend.stream_create(), [backend.event_create(blocking=True) for _ in range(2)]
            made.append((stream, events))
            buffers = []
            for _ in range(2):
                err, ptr = d.cuMemHostAlloc(CEILING_BUFFER, 0)
                if err:
                    raise RuntimeError(f"cuMemHostAlloc: {err}")
                pinned.append(ptr)
                area = (ctypes.c_ubyte * CEILING_BUFFER).from_address(int(ptr))
                buffers.append((int(ptr), memoryview(area).cast("B")))
            lanes.append((d.CUstream(backend.stream_handle(stream)), buffers, [d.CUevent(int(e)) for e in events]))
        warm_up()
        once()
        spans = sorted(ref.spans.values())
        lo, hi = spans[0][0], spans[-1][1]
        back = np.empty(hi - lo, np.uint8)
        err = _copy_back(d, raw.streams[0], back, dev + lo)
        valid = not err and all(np.array_equal(back[a - lo:b - lo], ref.bytes_of(k)) for k, (a, b) in ref.spans.items())
        del back
        record("raw", "pread_dma", "warm", timed(once, reps), valid,
               f"{CEILING_THREADS} threads, preadv into 2 pinned {CEILING_BUFFER >> 20} MiB buffers each, "
               "then cuMemcpyHtoDAsync on the thread's stream", size)
    finally:
        lanes.clear()
        for stream, events in made:
            for event in events:
                with contextlib.suppress(Exception):
                    backend.event_destroy(event)
            with contextlib.suppress(Exception):
                backend.stream_destroy(stream)
        for ptr in pinned:
            d.cuMemFreeHost(ptr)
        d.cuMemFree(d.CUdeviceptr(dev))


# -- checks ------------------------------------------------------------------------------------------------
def checks(results: list[Result], check: Callable[..., Any], find: Callable[..., Result | None]) -> list[Any]:
    """The targets of checkpoint loading and saving, as ``check(name, measured, target, passed)`` rows."""
    out: list[Any] = []
    rows = [r for r in results if r.group == GROUP]
    if not rows:
        return out

    def ratio(name: str, a: Result | None, b: Result | None, minimum: float) -> None:
        if a is None or b is None:
            out.append(check(name, "not measured", f">= {minimum:g}x", None))
            return
        value = a.gbps / b.gbps
        out.append(check(name, f"{a.gbps:.2f} / {b.gbps:.2f} GB/s = {value:.3f}", f">= {minimum:g}x",
                         value >= minimum))

    def at_least(name: str, r: Result | None, minimum: float) -> None:
        measured = "not measured" if r is None else f"{r.gbps:.1f} GB/s"
        out.append(check(name, measured, f">= {minimum:g} GB/s", None if r is None else r.gbps >= minimum))

    def row(impl: str, route: str, direction: str) -> Result | None:
        return find(rows, impl=impl, route=route, direction=direction)

    warm = row("ferry", "load_safetensors", "warm")
    ratio("checkpoint load, warm, vs the parallel pread ceiling", warm, row("ceiling", "pread", "warm"), 0.9)
    at_least("checkpoint load, warm", warm, 40)
    ratio("checkpoint load, warm, vs safetensors load_file(device='cuda')", warm,
          row("torch", "safetensors.load_file", "warm"), 6)
    colds = [r for r in (row("ceiling", "pread", "cold"), row("ceiling", "pread_direct", "cold")) if r is not None]
    ratio("checkpoint load, cold, vs the parallel pread ceiling (cold, the faster of buffered and O_DIRECT)",
          row("ferry", "load_safetensors", "cold"), max(colds, key=lambda r: r.gbps) if colds else None, 0.9)
    save = row("ferry", "save_safetensors", "save")
    ratio("checkpoint save vs the parallel pwrite ceiling", save, row("ceiling", "pwrite", "save"), 0.9)
    ratio("checkpoint save vs safetensors save_file (tensors on the GPU)", save,
          row("torch", "safetensors.save_file", "save"), 4)
    memory = next((r for r in rows if r.route == "host_memory" and r.samples), None)
    out.append(check("host memory during a load, above the pools",
                     "not measured" if memory is None else f"{memory.nbytes / MiB:.0f} MiB", "< 1024 MiB",
                     None if memory is None else memory.nbytes < GiB))
    return out
