"""Sizes written by people ("70GB", "24GiB", "512M", 1e9) read one way everywhere: the planner's CLI,
the engine config's budgets and the tiers' capacities. Pure Python (the planner imports it).

Decimal units are powers of 1000 (k, M, G, T, P with or without B), binary units powers of 1024 (Ki,
Mi, Gi, Ti with or without B); case does not matter; a bare number, or a numeric string such as
"1e9", is bytes.
"""
from __future__ import annotations

import math

_UNITS = {"": 1, "b": 1,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "p": 10**15, "pb": 10**15,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(value: "int | float | str | None", what: str = "size") -> int | None:
    """'64GB', '512MiB', '70G', 1e9 -> bytes; None -> None (no limit). Raises ValueError naming ``what``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what}: cannot read {value!r} as a size (examples: 1073741824, '64GB', '512MiB')")
    if isinstance(value, (int, float)):
        n, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        try:
            n = float(num)
        except ValueError:
            n = math.nan
    if unit not in _UNITS or not math.isfinite(n) or not math.isfinite(n * _UNITS[unit]):
        raise ValueError(f"{what}: cannot read {value!r} as a size (examples: 1073741824, '64GB', '512MiB')")
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return int(n * _UNITS[unit])
