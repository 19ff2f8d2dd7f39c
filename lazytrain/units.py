"""Sizes written by people ("70GB", "24GiB", "512M", 1e9) read one way everywhere: the planner's CLI,
the engine config's budgets and the tiers' capacities. Pure Python (the planner imports it).

Units with B are decimal, powers of 1000 (kB, MB, GB, TB, PB); units with i are binary, powers of 1024
(Ki, Mi, Gi, Ti, with or without B); a bare letter (k, M, G, T) is binary too, as dd, Docker and the
JVM read "1M" and as DeepSpeed-style block sizes expect. Case does not matter; a bare number, or a
numeric string such as "1e9", is bytes.
"""
from __future__ import annotations

import decimal
import math
from fractions import Fraction

_UNITS = {"": 1, "b": 1,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
          "pi": 2**50, "pib": 2**50}


def parse_size(value: "int | float | str | None", what: str = "size") -> int | None:
    """'64GB' -> 64e9, '512MiB' and '512M' -> 512 * 2**20, 1e9 -> 1e9; None -> None (no limit). Raises
    ValueError naming ``what``."""
    if value is None:
        return None
    if isinstance(value, bool):
        n, unit = math.nan, ""        # True is not a size
    elif isinstance(value, (int, float)):
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
    # exactly, in whole bytes (rounded down): through a float, "4.1GB" was 4099999999 and integers above 2**53
    # lost their last digits. Text as a Decimal, which keeps "1e-999999999" as an exponent (a Fraction would
    # build 10**999999999)
    if isinstance(value, (int, float)):
        scaled = Fraction(value) * _UNITS[unit]
    else:
        with decimal.localcontext() as context:
            context.prec, context.Emax, context.Emin = 80, decimal.MAX_EMAX, decimal.MIN_EMIN
            scaled = decimal.Decimal(num) * _UNITS[unit]
    if 0 < scaled < 1:   # "0.5" or "1e-9" read as a budget of 0 bytes
        raise ValueError(f"{what}: {value!r} is less than one byte")
    return math.floor(scaled)
