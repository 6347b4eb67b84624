"""``python -m ferry info | demo | bench`` (or ``ferry ...``): what ferry sees, ferry at work, what routes cost.

Every command runs on the emulated device when no GPU is usable and says which
backend it uses and, when it fell back, why (``--backend`` or ``FERRY_BACKEND``
choose one explicitly). A usage mistake (a bad option, a bad ``FERRY_BACKEND``,
a device that does not exist, a payload that cannot fit in memory) gets one
line on stderr and exit status 2, as argparse does, never a traceback; a closed
pipe (``python -m ferry info | head -1``) ends the command quietly. The global
options (``--backend``, ``--device``) may come before or after the command;
``--version`` prints the version. Ctrl-C ends a command with exit status 130
and one line on stderr (``bench``: within a second, with no report written).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from . import BufferMovedError, DeviceUnavailableError, Runtime, __version__, routes

__all__: list[str] = []

PROG = "python -m ferry"  # the name in usage and error lines when run with ``python -m``; see _prog()
BACKENDS = ("auto", "cuda", "emulated")

_DESCRIPTION = """\
What ferry sees (info), ferry at work (demo), and what each route costs (bench).
Without a usable GPU every command runs on the emulated device and says why;
--backend, or the FERRY_BACKEND environment variable, picks a backend."""

_EPILOG = """\
exit status: 0 on success, 1 when a check fails (demo: bytes or guard; bench: a
case failed validation), 2 for a usage mistake (one line on stderr)."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``prog: error: message``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A user's mistake found after parsing: one line on stderr, exit status 2."""


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
    return value


def _device_index(text: str) -> int:
    return _whole_number(text, 0)


def _mebibytes(text: str) -> int:
    return _whole_number(text, 1)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- backend choice --------------------------------------------------------------------------------


def _requested_backend(flag: str) -> tuple[str, str]:
    """The backend asked for and who asked: ``--backend``, ``FERRY_BACKEND`` or nobody."""
    if flag != "auto":
        return flag, f"--backend {flag}"
    env = os.environ.get("FERRY_BACKEND")
    if env is None:
        return "auto", ""
    if env not in BACKENDS:
        raise UsageError(f"FERRY_BACKEND must be one of {', '.join(BACKENDS)}, not {env!r}")
    return env, f"FERRY_BACKEND={env}"


def _open_runtime(backend: str, device: int) -> Runtime:
    try:
        return Runtime(backend, device)
    except (DeviceUnavailableError, ValueError) as exc:  # no such device, no GPU with --backend cuda
        raise UsageError(str(exc)) from None


def _why_emulated(requested: str, asked_by: str, device: int) -> str:
    """Why the runtime runs on the emulated device, in a few words."""
    if requested == "emulated":
        return f"chosen with {asked_by}"
    from ._backends._cuda import probe

    try:
        probe(device)
    except DeviceUnavailableError as exc:
        return f"no usable GPU: {exc}"
    return "the CUDA backend could not start on this device"


# -- info ------------------------------------------------------------------------------------------


def cmd_info(rt: Runtime, why_emulated: str | None = None) -> int:
    """Print the backend (and why it was chosen), device, driver, link, pool state and routes."""
    header = f"ferry on the {rt.backend} backend"
    print(header if why_emulated is None else f"{header} ({why_emulated})")
    for key, value in rt.info().items():
        shown = f"{value} ({_fmt_bytes(int(value))})" if key.endswith("_bytes") else value
        print(f"  {key:20s} {shown}")
    print("device-to-device routes:")
    for route in routes(rt.backend):
        reason = "" if route.reason == route.route else f" ({route.reason})"
        print(f"  {route.source} -> {route.destination}: {route.route}{reason}")
    return 0


# -- demo ------------------------------------------------------------------------------------------


def _available_host_bytes() -> int | None:
    """Host memory this process can still take: the least of MemAvailable and a cgroup limit."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            return None
    return max(0, min(found))


def _check_demo_fits(rt: Runtime, mib: int) -> None:
    """Refuse a payload the machine cannot hold, before allocating any of it."""
    nbytes = mib << 20
    # the payload, three pinned buffers (pool size classes round up by < 25 %), and on
    # the emulated device the device array too: host memory.
    copies = 6 if rt.backend == "emulated" else 5
    available = _available_host_bytes()
    if available is not None and copies * nbytes > available:
        raise UsageError(
            f"demo --mib {mib} needs about {_fmt_bytes(copies * nbytes)} of host memory "
            f"({copies} times the payload) and {_fmt_bytes(available)} is available; pick a smaller --mib"
        )
    device_bytes = rt.info().get("memory_bytes")
    if isinstance(device_bytes, int) and nbytes > device_bytes:
        raise UsageError(f"demo --mib {mib} does not fit in the device's {_fmt_bytes(device_bytes)}")


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


OVERLAP_RUNS = 5  # repeats of each overlap step (copy alone, work alone, overlapped): medians are shown


def _hidden(t_copy: float, t_work: float, t_overlapped: float) -> float:
    """How much of the shorter step the overlap hid: the time saved against running both in turn,
    over the shorter step's time, within [0, 1] (1: the overlapped run took only the longer step's time)."""
    saved = t_copy + t_work - t_overlapped
    return min(1.0, max(0.0, saved / max(min(t_copy, t_work), 1e-12)))


def cmd_demo(rt: Runtime, mib: int) -> int:
    """Upload, overlap host work with a pending download, wait, verify, report."""
    _check_demo_fits(rt, mib)
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
    device, dst = pending.wait()
    del pending
    rows.append(_row("read while in flight", 0, None, guarded))
    rows.append(_row("is_ready() right after submit", 0, None, str(ready)))

    # 3. overlap: host work between submit and wait is hidden behind the copy.
    def copy_alone() -> Any:
        return rt.download_pending(device, dst).wait()

    t_copy, (device, dst) = _timed(copy_alone)
    iterations = 100_000
    t_probe, _ = _timed(lambda: _host_work(iterations))
    iterations = max(1, int(iterations * (0.8 * t_copy) / max(t_probe, 1e-9)))

    def overlapped() -> Any:
        handle = rt.download_pending(device, dst)
        _host_work(iterations)
        return handle.wait()

    copies, works, overs = [], [], []
    for _ in range(OVERLAP_RUNS):  # interleaved, medians: one run of each is at the mercy of the host
        t, (device, dst) = _timed(copy_alone)
        copies.append(t)
        works.append(_timed(lambda: _host_work(iterations))[0])
        t, (device, dst) = _timed(overlapped)
        overs.append(t)
    t_copy, t_host, t_over = (float(np.median(x)) for x in (copies, works, overs))
    t_serial = t_copy + t_host
    rows.append(_row("download: copy alone", nbytes, t_copy, f"median of {OVERLAP_RUNS}", rate=True))
    rows.append(_row("host work alone", 0, t_host, "compute-bound"))
    rows.append(_row("serial (copy, then work)", 0, t_serial, "sum"))
    hidden = _hidden(t_copy, t_host, t_over)
    rows.append(_row("overlapped (submit, work, wait)", nbytes, t_over, f"{hidden:.0%} of the shorter step hidden"))

    # 4. verify the round trip, then drop a handle unwaited: it retires, never blocks.
    ok = bool(np.array_equal(dst.as_array(np.uint32), data))
    rows.append(_row("round trip bytes equal", nbytes, None, "ok" if ok else "MISMATCH"))
    spare = [rt.pinned(nbytes)]

    def submit_and_drop() -> None:
        # neither the handle nor the buffer stays bound: the handle is dropped at once and
        # its record (which now owns the buffer) goes to the retirement queue
        rt.download_pending(device, spare.pop())

    t_drop, _ = _timed(submit_and_drop)
    dropped_at = time.perf_counter()
    rows.append(_row("submit + drop a pending handle", 0, t_drop, "to the retirement queue"))
    src.close()  # its upload was waited: the block is free for reuse
    stats_before = rt.stats().pinned_allocations
    t_reuse, buf = _timed(lambda: rt.pinned(nbytes))
    buf.close()
    hit = "pool hit" if stats_before == rt.stats().pinned_allocations else "pool miss"
    rows.append(_row("pinned(n) again", nbytes, t_reuse, hit))
    while rt.stats().retiring and time.perf_counter() - dropped_at < 10.0:
        rt.poll()  # frees the dropped handle's record once its copy is complete; never blocks
        time.sleep(0.0005)
    retired = "record freed, nobody waited" if rt.stats().retiring == 0 else "still retiring"
    rows.append(_row("rt.poll() until it retired", 0, time.perf_counter() - dropped_at, retired))
    print(_table(["step", "bytes", "time", "GB/s", "result"], rows))
    print(
        "\noverlapped: the time saved against serial, as a share of the shorter of copy and work\n"
        "(100%: the copy ran entirely behind the host work)"
    )
    if rt.backend == "emulated":
        print(
            "emulated device: its copies are made by this machine's CPU, which the host work\n"
            "competes with (Python's GIL, cores, memory bandwidth), so less is hidden than on a GPU,\n"
            "where the DMA engine copies while every CPU core is free for the work"
        )
    stats = rt.stats()
    print(
        f"\nstats: submitted {stats.submitted}, completed {stats.completed}, failed {stats.failed}, "
        f"in flight {stats.in_flight}, retiring {stats.retiring}, "
        f"pinned pool {_fmt_bytes(stats.pinned_pool_bytes)} ({stats.pinned_allocations} allocations)"
    )
    return 0 if ok and guarded == "BufferMovedError" else 1


# -- entry point -----------------------------------------------------------------------------------


def _prog(argv0: str | None = None) -> str:
    """How the user ran the command: ``python -m ferry``, or the script's own name (``ferry``)."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return PROG if name in ("__main__.py", "-m", "-c", "") else name


def _global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """``--backend`` and ``--device``: on the main parser with their defaults, and on each command with
    ``argparse.SUPPRESS`` (given there, they override; not given, the main parser's value stands)."""
    parser.add_argument("--backend", default="auto" if default is None else default, choices=BACKENDS,
                        help="auto (the default): CUDA when a GPU is usable, else the emulated device")
    parser.add_argument("--device", type=_device_index, default=0 if default is None else default, metavar="N",
                        help="device index (default 0)")


def _parser(prog: str = PROG) -> _Parser:
    from ._bench import DESCRIPTION as BENCH_DESCRIPTION
    from ._bench import add_arguments

    parser = _Parser(prog=prog, description=_DESCRIPTION, epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    _global_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench,load}")
    info = sub.add_parser("info", help="backend, device, driver, PCIe link, pool state, routes",
                          description="Print the backend (and why it was chosen), the device, driver, PCIe link, "
                                      "pinned pool state and the device-to-device routes.")
    demo = sub.add_parser("demo", help="uploads, an overlapped download, verification, a table",
                          description="Upload a random payload, download it while host work runs, verify the "
                                      "bytes, drop a handle unwaited, and print what each step cost.")
    demo.add_argument("--mib", type=_mebibytes, default=64, metavar="N",
                      help="payload size in MiB, at least 1 (default 64)")
    bench = sub.add_parser("bench", help="every route against the peers: table, JSON, plot",
                           description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(bench)
    from ._files import _cli as files_cli

    load = sub.add_parser("load", help=files_cli.HELP, description=files_cli.DESCRIPTION)
    files_cli.add_arguments(load)
    load.set_defaults(load_prog=load.prog)  # errors name the command as run: "ferry load", "python -m ferry load"
    for command in (info, demo, bench, load):
        _global_options(command, argparse.SUPPRESS)
    return parser


def _run(argv: Sequence[str] | None, prog: str = PROG) -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        requested, asked_by = _requested_backend(args.backend)
        if args.command == "bench":
            from ._bench import prepare_output

            problem = prepare_output(args)
            if problem is not None:
                raise UsageError(problem)
        rt = _open_runtime(requested, args.device)
        with rt:
            if args.command == "info":
                why = _why_emulated(requested, asked_by, args.device) if rt.backend == "emulated" else None
                return cmd_info(rt, why)
            if args.command == "bench":
                from ._bench import run

                return run(rt, args, prog)
            if args.command == "load":
                from ._files._cli import cmd_load

                return cmd_load(rt, args)
            return cmd_demo(rt, args.mib)
    except UsageError as exc:
        parser.exit(2, f"{prog}{'' if args.command is None else ' ' + args.command}: error: {exc}\n")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ferry`` and of the ``ferry`` script; returns the exit status."""
    from ._bench import _interrupt

    prog = _prog()
    try:
        status = _run(argv, prog)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's final flush
        return status
    except BrokenPipeError:  # the reader went away (| head): stop quietly, like other Unix tools
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        _interrupt.say(prog)
        return _interrupt.STATUS


if __name__ == "__main__":
    sys.exit(main())
