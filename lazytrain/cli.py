"""`lazytrain train | plan | bench`.

Each sub-command lives beside the code it drives and registers itself here through a
``register(subparsers)`` function, so this file stays a table of contents.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

# (module, what it adds): each module defines register(subparsers) -> None
SUBCOMMANDS = [
    ("lazytrain.train", "train"),
    ("lazytrain.planner.cli", "plan"),
    ("lazytrain.tiers.cli", "bench"),
]


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1], else the usual one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:   # nan compares false with everything
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse type: a whole number >= 0, else the usual one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def positive(kind=int):
    """An argparse type: a number of ``kind`` above zero, else the usual one-line usage error."""
    def read(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not math.isfinite(value) or value <= 0:   # nan compares false with everything
            raise argparse.ArgumentTypeError(f"must be a positive {'integer' if kind is int else 'number'}, "
                                             f"got {text!r}")
        return value
    return read


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazytrain", description=__doc__.splitlines()[0])
    # DeepSpeed's launcher (`deepspeed --module lazytrain.cli train ...`) passes each process its local rank as
    # an argument before the sub-command, as well as in the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name, _ in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("lazytrain"):
                continue  # sub-command not built in this version
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
