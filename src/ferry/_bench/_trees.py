"""The ``trees`` group: whole state-dict-shaped structures in both directions, with the peers.

Shapes (leaf sizes are kept in ``--quick``; only the leaf counts shrink):

* ``256 x 16 MiB``, ``2048 x 1 MiB``, ``16384 x 64 KiB``: flat dicts of ``uint8`` leaves;
* ``1.5B mixed``: a 1.5B-parameter decoder's state dict in float16 (a 151,936 x 1,536
  embedding, 28 layers of attention, MLP and norm weights; fewer layers with ``--quick``).

Each shape runs host to device (``upload_tree`` into a reused device tree) from pageable
leaves and from pinned-pooled leaves (``download_tree(pinned=True)``'s), and device to host
into fresh pageable leaves, into a reused ``out=`` tree and into pinned-pooled leaves. In the
same run: PyTorch per-tensor ``.cuda()`` / ``.cpu()`` (and pinned ``non_blocking`` copies), the
raw driver (one ``cuMemcpy*Async`` per leaf, pinned and pageable, one event for all), TensorDict
when installed (``to("cuda")``, ``to("cuda", non_blocking_pin=True, num_threads=16)``,
``to("cpu")``), and the machine's ceiling for first-touching and filling that much fresh
pageable memory with 16 threads. Every result is verified byte for byte outside the timing.

Also the single transfers the targets name (one 256 MiB pageable array each way; a fresh 16 B
upload against ``torch.from_numpy(a).cuda()``), the submission time of a 2,048-leaf tree, and the
pinned pool's bytes over repeated offload and reload rounds.
"""

from __future__ import annotations

import concurrent.futures
import gc
import importlib
import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._peers import Case
from ._protocol import Budget, Result, payload, poison

Context = Any  # the bench's ``_groups.Context`` (not imported: the groups import this module)

__all__: list[str] = []

KiB, MiB = 1 << 10, 1 << 20
FILL_THREADS = 16
ROUNDS = 5  # offload + reload rounds for the pool's bound

Tree = dict[str, np.ndarray[Any, Any]]


# -- the shapes --------------------------------------------------------------------------------------
def _uniform(count: int, nbytes: int) -> list[tuple[str, tuple[int, ...], Any]]:
    return [(f"t{i:05d}", (nbytes,), np.uint8) for i in range(count)]


def _model(layers: int, vocab: int = 151936, hidden: int = 1536, mlp: int = 8960, kv: int = 256) -> list[Any]:
    f16 = np.float16
    spec: list[Any] = [("embed_tokens_weight", (vocab, hidden), f16)]
    for i in range(layers):
        p = f"layers_{i}_"
        spec += [
            (p + "q_proj_weight", (hidden, hidden), f16), (p + "q_proj_bias", (hidden,), f16),
            (p + "k_proj_weight", (kv, hidden), f16), (p + "k_proj_bias", (kv,), f16),
            (p + "v_proj_weight", (kv, hidden), f16), (p + "v_proj_bias", (kv,), f16),
            (p + "o_proj_weight", (hidden, hidden), f16),
            (p + "gate_proj_weight", (mlp, hidden), f16), (p + "up_proj_weight", (mlp, hidden), f16),
            (p + "down_proj_weight", (hidden, mlp), f16),
            (p + "input_layernorm_weight", (hidden,), f16), (p + "post_attention_layernorm_weight", (hidden,), f16),
        ]
    spec.append(("norm_weight", (hidden,), f16))
    return spec


def shapes(emulated: bool, quick: bool) -> list[tuple[str, list[Any]]]:
    """The group's shapes: (name, [(key, shape, dtype), ...])."""
    if emulated:  # CI: the leaf sizes, a few leaves each
        return [
            ("256 x 16 MiB", _uniform(2, 16 * MiB)), ("2048 x 1 MiB", _uniform(8, MiB)),
            ("16384 x 64 KiB", _uniform(64, 64 * KiB)), ("1.5B mixed", _model(1, vocab=2048, hidden=256, mlp=512)),
        ]
    if quick:
        return [
            ("256 x 16 MiB", _uniform(32, 16 * MiB)), ("2048 x 1 MiB", _uniform(512, MiB)),
            ("16384 x 64 KiB", _uniform(4096, 64 * KiB)), ("1.5B mixed", _model(2)),
        ]
    return [
        ("256 x 16 MiB", _uniform(256, 16 * MiB)), ("2048 x 1 MiB", _uniform(2048, MiB)),
        ("16384 x 64 KiB", _uniform(16384, 64 * KiB)), ("1.5B mixed", _model(28)),
    ]


def make_tree(spec: list[Any], seed: int) -> Tree:
    """Distinct bytes in every leaf (a leaf copied into another's place is caught)."""
    largest = max(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in spec)
    base = payload(largest, seed)
    tree: Tree = {}
    for i, (key, shape, dtype) in enumerate(spec):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        leaf = np.empty(n, np.uint8)
        np.bitwise_xor(base[:n], np.uint8((i * 37 + 11) % 251), out=leaf)
        tree[key] = leaf.view(dtype).reshape(shape)
    return tree


def _bytes(x: Any) -> np.ndarray[Any, Any]:
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        x = x.detach().cpu().numpy() if getattr(x, "device", None) is not None and x.device.type != "cpu" else x.numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def same(got: dict[str, Any], want: Tree) -> bool:
    """Every leaf of ``got`` (NumPy or torch) holds ``want``'s bytes."""
    if len(got) != len(want):
        return False
    return all(k in got and np.array_equal(_bytes(got[k]), _bytes(v)) for k, v in want.items())


def _nbytes(tree: Tree) -> int:
    return sum(int(a.nbytes) for a in tree.values())


# -- ferry's cases --------------------------------------------------------------------------------------
def ferry_up(rt: Any, tree: Tree, host: Tree, route: str) -> Case:
    """upload_tree of ``host`` (``tree``'s bytes, pageable or pinned leaves) into a reused device tree."""
    box: dict[str, Any] = {"dev": rt.upload_tree(tree).wait()[1]}

    def op() -> None:
        _, box["dev"] = rt.upload_tree(host, box["dev"]).wait()

    def check() -> bool:
        for d in box["dev"].values():
            rt.upload(np.full(d.shape, 0, d.dtype), d).wait()  # poisoned first
        op()
        return same(rt.download_tree(box["dev"]).wait()[1], tree)

    return Case("ferry", route, "h2d", _nbytes(tree), op, check, close=box.clear)


def ferry_down(rt: Any, tree: Tree, dev: Any, route: str) -> Case:
    """download_tree into fresh pageable leaves, a reused ``out=`` tree, or pinned-pooled leaves."""
    box: dict[str, Any] = {}
    if route == "out":
        box["out"] = {k: np.empty_like(v) for k, v in tree.items()}

        def op() -> None:
            rt.download_tree(dev, box["out"]).wait()

        def check() -> bool:
            for a in box["out"].values():
                poison(a)
            op()
            return same(box["out"], tree)
    else:
        pinned = route == "pinned"

        def op() -> None:
            box["host"] = rt.download_tree(dev, pinned=pinned).wait()[1]

        def check() -> bool:
            op()
            return same(box["host"], tree)

    # the previous round's leaves are dropped untimed, before each round (pinned ones go back to the pool)
    return Case("ferry", route, "d2h", _nbytes(tree), op, check, setup=_release(box), close=box.clear)


# -- the peers' cases ------------------------------------------------------------------------------------
def torch_cases(torch: Any, tree: Tree) -> list[Case]:
    """Per-tensor ``.cuda()`` from pageable tensors, pinned ``non_blocking`` copies, ``.cpu()``."""
    n = _nbytes(tree)
    cpu = {k: torch.from_numpy(v) for k, v in tree.items()}
    pinned = {k: t.pin_memory() for k, t in cpu.items()}
    dev = {k: t.cuda() for k, t in cpu.items()}
    box: dict[str, Any] = {}

    def up() -> None:
        box["d"] = {k: t.cuda() for k, t in cpu.items()}

    def up_pinned() -> None:
        box["d"] = {k: t.cuda(non_blocking=True) for k, t in pinned.items()}
        torch.cuda.synchronize()

    def down() -> None:
        box["h"] = {k: t.cpu() for k, t in dev.items()}

    def check(op: Callable[[], None], key: str) -> Callable[[], bool]:
        def checked() -> bool:
            op()
            return same(box[key], tree)

        return checked

    def close() -> None:
        box.clear()

    release = _release(box)
    return [
        Case("torch", "pageable .cuda()", "h2d", n, up, check(up, "d"), setup=release, close=close),
        Case("torch", "pinned .cuda(non_blocking)", "h2d", n, up_pinned, check(up_pinned, "d"), setup=release,
             close=close),
        Case("torch", ".cpu()", "d2h", n, down, check(down, "h"), setup=release, close=close),
    ]


def tensordict_cases(module: Any, torch: Any, tree: Tree) -> list[Case]:
    """TensorDict's ``to("cuda")``, ``to("cuda", non_blocking_pin=True, num_threads=16)``, ``to("cpu")``."""
    n = _nbytes(tree)
    td = module.TensorDict({k: torch.from_numpy(v) for k, v in tree.items()}, batch_size=[])
    on_device = td.to("cuda")
    torch.cuda.synchronize()
    box: dict[str, Any] = {}

    def plain() -> None:
        box["d"] = td.to("cuda")
        torch.cuda.synchronize()

    def pin16() -> None:
        box["d"] = td.to("cuda", non_blocking_pin=True, num_threads=FILL_THREADS)
        torch.cuda.synchronize()

    def down() -> None:
        box["h"] = on_device.to("cpu")
        torch.cuda.synchronize()

    def check(op: Callable[[], None], key: str) -> Callable[[], bool]:
        def checked() -> bool:
            op()
            return same(dict(box[key].items()), tree)

        return checked

    release = _release(box)
    return [
        Case("tensordict", 'to("cuda")', "h2d", n, plain, check(plain, "d"), setup=release, close=box.clear),
        Case("tensordict", f"pin, {FILL_THREADS} threads", "h2d", n, pin16, check(pin16, "d"), setup=release,
             close=box.clear),
        Case("tensordict", 'to("cpu")', "d2h", n, down, check(down, "h"), setup=release, close=box.clear),
    ]


def raw_cases(raw: Any, tree: Tree) -> list[Case]:
    """The raw driver: one ``cuMemcpy*Async`` per leaf (pinned or pageable), one event for all."""
    d, stream, event = raw.d, raw.streams[0], raw.events[0]
    n = _nbytes(tree)
    keys = list(tree)
    sizes = [int(tree[k].nbytes) for k in keys]
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    pinned = raw.pinned(n)
    dev = raw.device(n)
    pageable = {k: v.copy() for k, v in tree.items()}
    hbase = int(pinned.ctypes.data)
    for k, off, size in zip(keys, offsets, sizes, strict=True):
        pinned[off:off + size] = tree[k].reshape(-1).view(np.uint8)
    back = np.empty(n, np.uint8)

    def sync() -> None:
        (err,) = d.cuEventRecord(event, stream)
        if not err:
            (err,) = d.cuEventSynchronize(event)
        if err:
            raise RuntimeError(f"raw driver: {err}")

    def up_pinned() -> None:
        copy = d.cuMemcpyHtoDAsync
        for off, size in zip(offsets, sizes, strict=True):
            copy(dev + off, hbase + off, size, stream)
        sync()

    def up_pageable() -> None:
        copy = d.cuMemcpyHtoDAsync
        for k, off, size in zip(keys, offsets, sizes, strict=True):
            copy(dev + off, int(pageable[k].ctypes.data), size, stream)
        sync()

    def down_pinned() -> None:
        copy = d.cuMemcpyDtoHAsync
        for off, size in zip(offsets, sizes, strict=True):
            copy(hbase + off, dev + off, size, stream)
        sync()

    def on_device() -> bool:
        raw.copy("d2h", back, dev, n)
        raw.sync()
        return all(np.array_equal(back[o:o + s], tree[k].reshape(-1).view(np.uint8))
                   for k, o, s in zip(keys, offsets, sizes, strict=True))

    def check_up(op: Callable[[], None]) -> Callable[[], bool]:
        def check() -> bool:
            poison(back)
            raw.copy("h2d", back, dev, n)  # the device poisoned first
            raw.sync()
            op()
            return on_device()
        return check

    def check_down() -> bool:
        up_pinned()
        saved = pinned.copy()
        poison(pinned)
        down_pinned()
        return bool(np.array_equal(pinned, saved)) and on_device()

    return [
        Case("raw", "pinned, one copy per leaf", "h2d", n, up_pinned, check_up(up_pinned)),
        Case("raw", "pageable, one copy per leaf", "h2d", n, up_pageable, check_up(up_pageable)),
        Case("raw", "pinned, one copy per leaf", "d2h", n, down_pinned, check_down),
    ]


def fill_ceiling(tree: Tree, threads: int = FILL_THREADS) -> Case:
    """The machine's ceiling for fresh pageable leaves: ``threads`` threads each map fresh anonymous
    memory for its share of the leaves (one mapping each) and fill it from resident memory,
    first-touch page faults included (the previous round's mappings are dropped untimed)."""
    sizes = [(k, int(v.nbytes)) for k, v in tree.items()]
    sources = {k: v.reshape(-1).view(np.uint8) for k, v in tree.items()}
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ferry-bench-fill")
    shares = [sizes[i::threads] for i in range(threads)]
    box: dict[str, Any] = {}

    def fill(share: list[tuple[str, int]]) -> dict[str, np.ndarray[Any, Any]]:
        made: dict[str, np.ndarray[Any, Any]] = {}
        total = sum(n for _, n in share)
        if not total:
            return made
        region: np.ndarray[Any, Any] = np.frombuffer(mmap.mmap(-1, total), np.uint8)  # fresh pages, one mapping
        at = 0
        for key, n in share:
            out = region[at:at + n]
            np.copyto(out, sources[key])
            made[key] = out
            at += n
        return made

    def op() -> None:
        made: dict[str, Any] = {}
        for part in pool.map(fill, shares):
            made.update(part)
        box["h"] = made

    def check() -> bool:
        op()
        return all(np.array_equal(box["h"][k], sources[k]) for k, _ in sizes)

    def close() -> None:
        box.clear()
        pool.shutdown()

    return Case("memcpy_mt", f"fresh first-touch + fill, {threads} threads", "d2h", _nbytes(tree), op, check,
                setup=_release(box), close=close)


def _release(box: dict[str, Any]) -> Callable[[], None]:
    """What drops the previous round's outputs (untimed, before each round)."""
    def release() -> None:
        box.pop("h", None)
        box.pop("d", None)
        box.pop("host", None)

    return release


# -- the group -------------------------------------------------------------------------------------------
def _budget(ctx: Context) -> Budget:
    b = ctx.budget
    return Budget(seconds=b.seconds, min_reps=b.min_reps, max_reps=b.max_reps, warmup=1)


def _run(ctx: Context, shape: str, case: Case) -> Result:
    result: Result = ctx.run("trees", case, _budget(ctx))
    result.config = shape
    return result


def _tensordict() -> tuple[Any, str]:
    """TensorDict, or None and why not."""
    try:
        return importlib.import_module("tensordict"), ""
    except ImportError as exc:
        return None, f"not installed ({exc.name or exc})"
    except Exception as exc:  # installed but unusable here (a version mismatch with PyTorch, ...)
        return None, f"unusable: {exc!r}"


def shape_case_count(ctx: Context) -> int:
    has = {name: int(name in ctx.peers) for name in ("raw", "torch")}
    td = int(has["torch"] and _tensordict()[0] is not None)
    return 5 + 1 + 3 * has["raw"] + 3 * has["torch"] + 3 * td


def case_count(ctx: Context) -> int:
    """The progress bar's total for this group."""
    # 256 MiB both ways, the fresh 16 B upload (ferry, and torch), the 2048-leaf submit (into a device tree,
    # fresh), the pool rounds
    extras = 2 + 1 + int("torch" in ctx.peers) + 2 + 1
    skipped = int("torch" in ctx.peers and _tensordict()[0] is None)  # a row that says why TensorDict is not run
    return skipped + len(shapes(ctx.rt.backend == "emulated", ctx.quick)) * shape_case_count(ctx) + extras


def group_trees(ctx: Context) -> None:
    rt = ctx.rt
    emulated = rt.backend == "emulated"
    torch = ctx.peers["torch"].torch if "torch" in ctx.peers else None
    td, why = _tensordict() if torch is not None else (None, "")
    if torch is not None and td is None:
        ctx.record(Result("trees", "tensordict", "skipped", "-", 0, note=why, config="peers"))
    for i, (shape, spec) in enumerate(shapes(emulated, ctx.quick)):
        tree = make_tree(spec, 100 + i)
        dev = rt.upload_tree(tree).wait()[1]
        pinned = rt.download_tree(dev, pinned=True).wait()[1]
        for case in (ferry_up(rt, tree, tree, "pageable"), ferry_up(rt, tree, pinned, "pinned")):
            _run(ctx, shape, case)
        for route in ("fresh", "out", "pinned"):
            _run(ctx, shape, ferry_down(rt, tree, dev, route))
        _run(ctx, shape, fill_ceiling(tree))
        if "raw" in ctx.peers:
            for case in raw_cases(ctx.peers["raw"], tree):
                _run(ctx, shape, case)
            ctx.peers["raw"].release()
        if torch is not None:
            for case in torch_cases(torch, tree):
                _run(ctx, shape, case)
            if td is not None:
                for case in tensordict_cases(td, torch, tree):
                    _run(ctx, shape, case)
            torch.cuda.empty_cache()
        del tree, dev, pinned
        gc.collect()
        rt.poll()
    _singles(ctx, torch)
    _submit_time(ctx)
    _pool_rounds(ctx)


def _singles(ctx: Context, torch: Any) -> None:
    """One 256 MiB pageable array each way (reused destination / output; 16 MiB on the emulated device, whose
    figures check nothing); a fresh 16 B upload."""
    rt = ctx.rt
    n = 16 * MiB if rt.backend == "emulated" else 256 * MiB
    data = payload(n, 77)
    box: dict[str, Any] = {"dev": rt.to_device(data)}
    out = np.empty(n, np.uint8)

    def up() -> None:
        _, box["dev"] = rt.upload(data, box["dev"]).wait()

    def down() -> None:
        rt.download(box["dev"], out).wait()

    def check_up() -> bool:
        up()
        return bool(np.array_equal(rt.to_host(box["dev"]), data))

    def check_down() -> bool:
        poison(out)
        down()
        return bool(np.array_equal(out, data))

    for direction, op, check in (("h2d", up, check_up), ("d2h", down, check_down)):
        _run(ctx, "one 256 MiB array", Case("ferry", "pageable", direction, n, op, check))
    box.clear()
    small = payload(16, 5)
    keep: dict[str, Any] = {}

    def ferry_fresh() -> None:
        keep["d"] = rt.upload(small).wait()[1]

    def ferry_check() -> bool:
        ferry_fresh()
        return bool(np.array_equal(rt.to_host(keep["d"]), small))

    _run(ctx, "16 B fresh upload", Case("ferry", "fresh 16 B upload", "h2d", 16, ferry_fresh, ferry_check))
    if torch is not None:
        def torch_fresh() -> None:
            keep["t"] = torch.from_numpy(small).cuda()

        def torch_check() -> bool:
            torch_fresh()
            return bool(np.array_equal(keep["t"].cpu().numpy(), small))

        _run(ctx, "16 B fresh upload", Case("torch", "from_numpy(a).cuda()", "h2d", 16, torch_fresh, torch_check))
    keep.clear()


def _submit_time(ctx: Context) -> None:
    """How long ``upload_tree`` of 2,048 leaves (1 MiB each on a GPU) takes to return, into an existing device
    tree and into fresh device leaves: submission only (the previous round is waited for untimed)."""
    rt = ctx.rt
    leaf = 64 * KiB if rt.backend == "emulated" else MiB
    tree = make_tree(_uniform(2048, leaf), 9)
    box: dict[str, Any] = {"dev": rt.upload_tree(tree).wait()[1]}

    def settle() -> None:
        pending = box.pop("p", None)
        if pending is not None:
            _, box["dev"] = pending.wait()

    def op() -> None:
        box["p"] = rt.upload_tree(tree, box["dev"])

    def check() -> bool:
        op()
        settle()
        return same(rt.download_tree(box["dev"]).wait()[1], tree)

    def settle_fresh() -> None:
        pending = box.pop("f", None)
        if pending is not None:
            pending.wait()  # (its fresh device tree is dropped: freed once its copy completed)

    def op_fresh() -> None:
        box["f"] = rt.upload_tree(tree)

    def check_fresh() -> bool:
        op_fresh()
        _, made = box.pop("f").wait()
        return same(rt.download_tree(made).wait()[1], tree)

    try:
        _run(ctx, "2048-leaf submit", Case("ferry", "upload_tree submit", "h2d", _nbytes(tree), op, check,
                                           setup=settle))
        settle()
        _run(ctx, "2048-leaf submit", Case("ferry", "upload_tree submit, fresh", "h2d", _nbytes(tree), op_fresh,
                                           check_fresh, setup=settle_fresh))
    finally:
        settle()
        settle_fresh()
        box.clear()


def _pool_rounds(ctx: Context) -> None:
    """Offload (``download_tree(pinned=True)``) and reload (``upload_tree``) rounds: the pinned pool's bytes."""
    rt = ctx.rt
    spec = _uniform(64, MiB) if rt.backend == "emulated" else _uniform(256, 4 * MiB)
    tree = make_tree(spec, 13)
    dev = rt.upload_tree(tree).wait()[1]
    ctx.progress("trees: pinned pool over offload and reload rounds")
    result = Result("trees", "ferry", "pinned pool rounds", "both", _nbytes(tree), config="pool")
    ctx.results.append(result)
    pool: list[int] = []
    try:
        ok = True
        for _ in range(ROUNDS):
            start = time.perf_counter()
            host = rt.download_tree(dev, pinned=True).wait()[1]
            ok = ok and same(host, tree)
            _, dev = rt.upload_tree(host, dev).wait()
            result.samples.append(time.perf_counter() - start)
            del host
            gc.collect()
            pool.append(int(rt.stats().pinned_pool_bytes))
        result.valid = ok and same(rt.download_tree(dev).wait()[1], tree)
        result.note = "pool bytes per round: " + ", ".join(str(p) for p in pool)
    except Exception as exc:
        result.valid = False
        result.note = f"error: {exc!r}"


# -- checks and table ------------------------------------------------------------------------------------
def _get(results: list[Result], shape: str, impl: str, route: str, direction: str) -> Result | None:
    for r in results:
        if (r.group == "trees" and r.config == shape and r.impl == impl and r.route == route
                and r.direction == direction and r.valid and r.samples):
            return r
    return None


def checks(results: list[Result], check: Callable[..., Any]) -> list[Any]:
    """The group's targets as ``check(name, measured, target, passed)`` rows (``passed`` None: not measured)."""
    Check = check  # noqa: N806 - the report's row type, handed in (the report imports this module)
    out: list[Any] = []

    def ratio(name: str, a: Result | None, b: Result | None, minimum: float) -> None:
        if a is None or b is None:
            out.append(Check(name, "not measured", f">= {minimum:g}x", None))
            return
        value = a.gbps / b.gbps
        out.append(Check(name, f"{a.gbps:.2f} / {b.gbps:.2f} GB/s = {value:.3f}", f">= {minimum:g}x",
                         value >= minimum))

    def floor(name: str, r: Result | None, minimum: float) -> None:
        out.append(Check(name, "not measured" if r is None else f"{r.gbps:.1f} GB/s", f">= {minimum:g} GB/s",
                         None if r is None else r.gbps >= minimum))

    names = list(dict.fromkeys(r.config for r in results if r.group == "trees"))
    big = [s for s in names if s in ("256 x 16 MiB", "2048 x 1 MiB", "1.5B mixed")]
    for s in big:
        up = _get(results, s, "ferry", "pageable", "h2d")
        floor(f"trees {s} h2d pageable", up, 40)
        ratio(f"trees {s} h2d pageable vs TensorDict pin, {FILL_THREADS} threads", up,
              _get(results, s, "tensordict", f"pin, {FILL_THREADS} threads", "h2d"), 1.3)
        pinned = _get(results, s, "ferry", "pinned", "d2h")
        ratio(f"trees {s} d2h pinned leaves vs raw driver pinned", pinned,
              _get(results, s, "raw", "pinned, one copy per leaf", "d2h"), 0.95)
        ratio(f"trees {s} d2h pinned leaves vs TensorDict to(cpu)", pinned,
              _get(results, s, "tensordict", 'to("cpu")', "d2h"), 1.0)
        floor(f"trees {s} d2h into a reused out= tree", _get(results, s, "ferry", "out", "d2h"), 40)
        fresh = _get(results, s, "ferry", "fresh", "d2h")
        ratio(f"trees {s} d2h fresh pageable vs first-touch + fill ceiling", fresh,
              _get(results, s, "memcpy_mt", f"fresh first-touch + fill, {FILL_THREADS} threads", "d2h"), 0.9)
        ratio(f"trees {s} d2h fresh pageable vs PyTorch .cpu()", fresh, _get(results, s, "torch", ".cpu()", "d2h"),
              10.0)
    s = "16384 x 64 KiB"
    if s in names:
        floor(f"trees {s} h2d pageable", _get(results, s, "ferry", "pageable", "h2d"), 25)
        floor(f"trees {s} d2h pinned leaves", _get(results, s, "ferry", "pinned", "d2h"), 25)
    for d in ("h2d", "d2h"):
        floor(f"one 256 MiB pageable array {d}", _get(results, "one 256 MiB array", "ferry", "pageable", d), 45)
    f16 = _get(results, "16 B fresh upload", "ferry", "fresh 16 B upload", "h2d")
    t16 = _get(results, "16 B fresh upload", "torch", "from_numpy(a).cuda()", "h2d")
    out.append(Check(
        "fresh 16 B rt.upload vs torch.from_numpy(a).cuda()",
        "not measured" if f16 is None or t16 is None else f"{f16.median * 1e6:.2f} vs {t16.median * 1e6:.2f} us",
        "<= 1.0x", None if f16 is None or t16 is None else f16.median <= t16.median,
    ))
    for how, what in (("upload_tree submit", "into a device tree"), ("upload_tree submit, fresh", "fresh")):
        sub = _get(results, "2048-leaf submit", "ferry", how, "h2d")
        out.append(Check(f"upload_tree of 2,048 leaves returns ({what})", "not measured" if sub is None else
                         f"{sub.median * 1e3:.3f} ms", "< 2 ms", None if sub is None else sub.median < 2e-3))
    pool = next((r for r in results if r.group == "trees" and r.config == "pool"), None)
    if pool is None or not pool.valid or "pool bytes per round: " not in pool.note:
        out.append(Check("pinned pool bounded over offload/reload rounds", "not measured", "stops growing", None))
    else:
        values = [int(v) for v in pool.note.split(": ", 1)[1].split(", ")]
        steady = len(values) >= 3 and values[-1] == values[-2] == values[-3]
        out.append(Check("pinned pool bounded over offload/reload rounds",
                         ", ".join(f"{v / MiB:.0f}" for v in values) + " MiB", "stops growing", steady))
    return out


def table(results: list[Result], fmt_size: Callable[[int], str], fmt_time: Callable[[float], str],
          valid: Callable[[Result], str]) -> list[str]:
    """The group's rows, by shape (the report's cell formats handed in)."""
    rows = [r for r in results if r.group == "trees"]
    lines = ["## trees", "", "| shape | impl | route | dir | bytes | median | min | GB/s | valid | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo = min(r.samples) if r.samples else float("nan")
        gbps = "-" if r.gbps != r.gbps or r.nbytes < 4096 else f"{r.gbps:.2f}"
        note = "" if r.valid is False else r.note
        lines.append(f"| {r.config} | {r.impl} | {r.route} | {r.direction} | {fmt_size(r.nbytes)} | "
                     f"{fmt_time(r.median)} | {fmt_time(lo)} | {gbps} | {valid(r)} | {note} |")
    return [*lines, ""]
