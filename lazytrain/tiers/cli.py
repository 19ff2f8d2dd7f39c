"""`lazytrain bench tiers [--path DIR] [--json OUT]`: measure the tiers and write a hardware profile."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from ..cli import positive
from .base import format_bytes, parse_bytes

DEFAULT_JSON = os.path.join("lazytrain-out", "hardware.json")


def _size(text: str) -> int:
    try:
        value = parse_bytes(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if value < 4096:   # smaller transfers measure call overhead, not bandwidth (and may move no bytes)
        raise argparse.ArgumentTypeError(f"size must be at least 4KiB, got {text!r}")
    return value


def _cannot_create_in(directory: str) -> str | None:
    """Why no file can be created in ``directory`` (None: one can), found by creating and removing one:
    permission bits say little for root or on a pseudo file system."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".lazytrain-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written as a file (None: it can); a file already there is not touched. Judged of
    the file the write replaces: a symlink's target (files.py)."""
    if os.path.isdir(path):
        return "it is a directory"
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        return "it is not a regular file"
    directory = os.path.dirname(target)
    above = directory
    while not os.path.exists(above):   # makedirs says "File exists" of a file where a folder belongs
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"{above} is not a directory"
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return _cannot_create_in(directory)


# sizes below which a measurement is mostly each call's fixed cost (a system call, a thread hand-off, a kernel
# launch: tens of microseconds, beside a millisecond's worth of bytes at a few GB/s)
STEADY_SIZES = {"nvme_bytes": 64 << 20, "tensor_bytes": 1 << 20, "copy_bytes": 16 << 20, "optimizer_params": 1 << 20}


def _below_steady_sizes(args) -> list[str]:
    """The size flags given below :data:`STEADY_SIZES`, as ``--flag VALUE (below MIN)``."""
    found = []
    for key, least in STEADY_SIZES.items():
        value = getattr(args, key)
        if value < least:
            flag = "--" + key.replace("_", "-")
            shown = str if key == "optimizer_params" else format_bytes
            found.append(f"{flag} {shown(value)} (below {shown(least)})")
    return found


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure this machine (tiers, copies, optimizer, compute) for the planner",
        description="Measure each tier's read and write bandwidth, host<->device copies, host memory, the host "
                    "optimizer and matrix throughput, and write the hardware profile JSON that "
                    "`lazytrain plan --hardware FILE` reads (GB/s = 1e9 B/s; null where not measurable here).")
    parser.add_argument("target", choices=["tiers"], help="what to measure")
    parser.add_argument("--path", default=None,
                        help="directory on the disk to measure as the NVMe tier (default: the temp directory)")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="OUT",
                        help=f"where to write the hardware profile (default: {DEFAULT_JSON}; '-' for stdout only)")
    parser.add_argument("--nvme-bytes", type=_size, default=1 << 30, metavar="SIZE",
                        help="bytes written to and read from the NVMe tier (default: 1GiB)")
    parser.add_argument("--tensor-bytes", type=_size, default=64 << 20, metavar="SIZE",
                        help="size of each tensor moved (default: 64MiB)")
    parser.add_argument("--copy-bytes", type=_size, default=256 << 20, metavar="SIZE",
                        help="size of each host<->device and host memory copy (default: 256MiB)")
    parser.add_argument("--seconds", type=positive(float), default=1.0,
                        help="time per timed measurement: each repeats until this long has passed, or 1000 "
                             "repeats (200 for the optimizer) if sooner (default: 1.0)")
    parser.add_argument("--optimizer-params", type=positive(int), default=16 << 20, metavar="N",
                        help="parameters updated in the host optimizer measurement (default: 16777216)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from .bench import format_rows, run_bench, tier_bytes_held
    from .nvme import NVMeIOError
    if args.path is not None and not os.path.isdir(args.path):
        print(f"lazytrain bench tiers: --path {args.path} is not a directory", file=sys.stderr)
        return 2
    problem = _cannot_create_in(args.path) if args.path is not None else None
    if problem:   # fail before the other measurements, not after them
        print(f"lazytrain bench tiers: cannot create files under --path {args.path} ({problem}); give a "
              f"directory on the disk to measure", file=sys.stderr)
        return 2
    directory = args.path if args.path is not None else tempfile.gettempdir()
    free, need = shutil.disk_usage(directory).free, tier_bytes_held(args.nvme_bytes, args.tensor_bytes)
    if free < need:   # found before the other measurements, not as ENOSPC after them
        print(f"lazytrain bench tiers: {directory} has {format_bytes(free)} free, and the NVMe measurement writes "
              f"{format_bytes(need)} there (--nvme-bytes {format_bytes(args.nvme_bytes)} in whole --tensor-bytes "
              f"{format_bytes(args.tensor_bytes)} tensors): give a smaller --nvme-bytes or --tensor-bytes, or a "
              f"--path on a disk with room", file=sys.stderr)
        return 2
    if args.json != "-":   # where the profile goes, checked before the measurements (minutes), not after
        problem = _unwritable(args.json)
        if problem:
            print(f"lazytrain bench tiers: cannot write the profile to --json {args.json} ({problem})", file=sys.stderr)
            return 2
    small = _below_steady_sizes(args)
    if small:   # a profile the planner reads: figures of a few calls' overhead would plan for a slower machine
        print(f"lazytrain bench tiers: note: {', '.join(small)} measure per-call overhead more than throughput; "
              f"the profile's figures will understate this machine (the defaults measure it steadily)",
              file=sys.stderr)
    try:
        profile, rows = run_bench(path=args.path, nvme_bytes=args.nvme_bytes, tensor_bytes=args.tensor_bytes,
                                  copy_bytes=args.copy_bytes, seconds=args.seconds,
                                  optimizer_params=args.optimizer_params,
                                  log=lambda line: print(line, file=sys.stderr))
    except NVMeIOError as e:   # the disk filled meanwhile, or failed: named in one line
        print(f"lazytrain bench tiers: the NVMe measurement under {directory} failed: {e}", file=sys.stderr)
        return 2
    # with --json -, stdout holds the profile alone (a file lazytrain plan --hardware reads); the table goes to stderr
    print(format_rows(rows), file=sys.stderr if args.json == "-" else sys.stdout)
    text = json.dumps(profile, indent=2)
    if args.json == "-":
        print(text)
    else:
        from ..files import write_text_atomic
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            write_text_atomic(args.json, text + "\n")
        except OSError as e:   # after minutes of measuring: the profile goes to stdout rather than nowhere
            print(text)
            print(f"lazytrain bench tiers: cannot write --json {args.json}: {e.strerror or e}; the profile is "
                  f"printed above", file=sys.stderr)
            return 2
        print(f"hardware profile written to {args.json}")
    return 0
