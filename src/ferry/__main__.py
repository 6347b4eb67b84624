"""``python -m ferry info | demo | bench``: what ferry sees, ferry at work, and what each route costs.

Both run on the emulated device when no GPU is usable and say which backend
they use (``--backend`` or ``FERRY_BACKEND`` choose one explicitly).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._errors import BufferMovedError, DeviceUnavailableError
from ._runtime import Runtime

__all__: list[str] = []


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_info(rt: Runtime) -> int:
    """Print backend, device, driver, link and pool state."""
    info = rt.info()
    print(f"ferry on the {rt.backend} backend")
    for key, value in info.items():
        shown = f"{value} ({_fmt_bytes(int(value))})" if key.endswith("_bytes") else value
        print(f"  {key:20s} {shown}")
    from ._routes._peer import routes

    print("device-to-device routes:")
    for route in routes(rt.backend):
        print(f"  {route.source} -> {route.destination}: {route.route:11s} {route.reason}")
    return 0


def _host_work(iterations: int) -> float:
    """Compute-bound host work with a tiny working set (does not compete for memory bandwidth)."""
    x = 1.0
    for i in range(iterations):
        x = (x * 1.000001 + i) % 1000.0
    return x


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _row(step: str, nbytes: int, seconds: float | None, result: str, rate: bool = False) -> list[str]:
    shown = "" if seconds is None else (
        f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"
    )
    gbps = f"{nbytes / seconds / 1e9:.1f}" if rate and seconds else ""
    return [step, _fmt_bytes(nbytes) if nbytes else "", shown, gbps, result]


def cmd_demo(rt: Runtime, mib: int) -> int:
    """Upload, overlap host work with a pending download, wait, verify, report."""
    nbytes = mib << 20
    print(f"ferry demo on the {rt.backend} backend ({rt.info()['name']}), payload {mib} MiB")
    rows: list[list[str]] = []
    rng = np.random.default_rng(1945)
    data = rng.integers(0, 2**32, size=nbytes // 4, dtype=np.uint32)

    # 1. pinned buffer from the pool; fill it; upload; wait.
    t_alloc, src = _timed(lambda: rt.pinned(nbytes))
    rows.append(_row("pinned(n), first time", nbytes, t_alloc, "pool"))
    view = src.as_array(np.uint32)
    view[:] = data
    del view
    device = rt.empty(data.shape, data.dtype)
    t_up, (src, device) = _timed(lambda: rt.upload_pending(src, device).wait())
    rows.append(_row("upload_pending + wait", nbytes, t_up, "ok", rate=True))

    # 2. the buffer is moved while in flight: reading it raises.
    dst = rt.pinned(nbytes)
    pending = rt.download_pending(device, dst)
    try:
        dst.as_array()
        guarded = "NOT GUARDED"
    except BufferMovedError:
        guarded = "BufferMovedError"
    ready = pending.is_ready()
    pending.wait()
    rows.append(_row("read while in flight", 0, None, guarded))
    rows.append(_row("is_ready() right after submit", 0, None, str(ready)))

    # 3. overlap: host work between submit and wait is hidden behind the copy.
    t_copy, _ = _timed(lambda: rt.download_pending(device, dst).wait())
    iterations = 100_000
    t_probe, _ = _timed(lambda: _host_work(iterations))
    iterations = max(1, int(iterations * (0.8 * t_copy) / max(t_probe, 1e-9)))
    t_host, _ = _timed(lambda: _host_work(iterations))

    def overlapped() -> Any:
        handle = rt.download_pending(device, dst)
        _host_work(iterations)
        return handle.wait()

    t_serial = t_copy + t_host
    t_over, (device, dst) = _timed(overlapped)
    rows.append(_row("download: copy alone", nbytes, t_copy, "", rate=True))
    rows.append(_row("host work alone", 0, t_host, "compute-bound"))
    rows.append(_row("serial (copy, then work)", 0, t_serial, "sum"))
    ratio = t_over / max(t_copy, t_host)
    rows.append(_row("overlapped (submit, work, wait)", nbytes, t_over, f"{ratio:.2f}x of max(copy, work)"))

    # 4. verify the round trip, then drop a handle unwaited: it retires, never blocks.
    ok = bool(np.array_equal(dst.as_array(np.uint32), data))
    rows.append(_row("round trip bytes equal", nbytes, None, "ok" if ok else "MISMATCH"))
    spare = rt.pinned(nbytes)
    t_drop, _ = _timed(lambda: rt.download_pending(device, spare))  # the handle is dropped at once
    rows.append(_row("submit + drop a pending handle", 0, t_drop, "to the retirement queue"))
    src.close()  # its upload was waited: the block is free for reuse
    stats_before = rt.stats().pinned_allocations
    t_reuse, buf = _timed(lambda: rt.pinned(nbytes))
    buf.close()
    hit = "pool hit" if stats_before == rt.stats().pinned_allocations else "pool miss"
    rows.append(_row("pinned(n) again", nbytes, t_reuse, hit))
    print(_table(["step", "bytes", "time", "GB/s", "result"], rows))
    if rt.backend == "emulated":
        print(
            "\n(emulated device: its copy engines are Python threads, so pure-Python host work\n"
            " competes with them for the GIL; on CUDA the DMA needs no Python thread at all)"
        )
    rt.poll()
    stats = rt.stats()
    print(
        f"\nstats: submitted {stats.submitted}, completed {stats.completed}, failed {stats.failed}, "
        f"retiring {stats.retiring}, pinned pool {_fmt_bytes(stats.pinned_pool_bytes)} "
        f"({stats.pinned_allocations} allocations)"
    )
    return 0 if ok and guarded == "BufferMovedError" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ferry``."""
    parser = argparse.ArgumentParser(prog="python -m ferry", description=__doc__)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "emulated"])
    parser.add_argument("--device", type=int, default=0)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, driver, PCIe link, pool state")
    demo = sub.add_parser("demo", help="uploads, overlapped download, verification, a table")
    demo.add_argument("--mib", type=int, default=64, help="payload size in MiB (default 64)")
    from ._bench import add_arguments, run

    add_arguments(sub.add_parser("bench", help="every route against the peers: table, JSON, plot"))
    args = parser.parse_args(argv)
    try:
        rt = Runtime(args.backend, args.device)
    except DeviceUnavailableError as exc:
        print(f"ferry: {exc}", file=sys.stderr)
        return 2
    with rt:
        if args.command == "info":
            return cmd_info(rt)
        if args.command == "bench":
            return run(rt, args)
        return cmd_demo(rt, args.mib)


if __name__ == "__main__":
    sys.exit(main())
