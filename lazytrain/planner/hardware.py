"""Hardware profiles: the speeds and sizes the planner's cost model needs.

A profile is a flat JSON object shared with ``lazytrain bench tiers`` (which measures and writes it)::

    {"name": str, "peak_tflops": float|null, "achievable_tflops": float|null,
     "h2d_gbps": float|null, "d2h_gbps": float|null, "nvme_read_gbps": float|null,
     "nvme_write_gbps": float|null, "host_mem_gbps": float|null,
     "host_optimizer_gparams_per_s": float|null, "gpu_mem_bytes": int|null, "host_mem_bytes": int|null}

GB/s are 1e9 bytes per second. A field that the plan needs but that is null or missing raises
:class:`HardwareError` naming it; :func:`load_profile` can fill gaps from a catalog entry (``base``).

Catalog entries (``h800``, ``rtx3090``, ``h200``): bandwidths are the LazyTrain paper's measured figures
where it gives them (PCIe 12 GB/s per direction, NVMe 2.83 GB/s read / 3.35 GB/s write on the H800
machine). ``achievable_tflops`` and ``host_optimizer_gparams_per_s`` of ``h800`` are *calibrated*: they
are the values for which the simulator reproduces the paper's measured MegaTrain column
(``lazytrain.planner.policies.calibrate``; see BENCHMARKS.md, planner). Other entries state
where their numbers come from next to them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .models import read_json

GB = 1e9
GiB = 2 ** 30
MAX_BYTES = 2 ** 60   # a memory size beyond this is a typo, and would break the solver's numerics
MIN_RATE, MAX_RATE = 1e-6, 1e9   # GB/s, TFLOPS, Gparams/s: outside, a unit slip (and times HiGHS cannot hold)
# a bandwidth enters the step floor's LP in bytes/s, and HiGHS drops coefficients from 1e15 up: 100 TB/s is far
# beyond any link or memory (HBM3e: about 5 TB/s)
MAX_GBPS = 1e5


class HardwareError(ValueError):
    """A hardware profile that cannot be used; the message names the field."""


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_tflops: float | None = None
    achievable_tflops: float | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    nvme_read_gbps: float | None = None
    nvme_write_gbps: float | None = None
    host_mem_gbps: float | None = None
    host_optimizer_gparams_per_s: float | None = None
    gpu_mem_bytes: int | None = None
    host_mem_bytes: int | None = None

    def __post_init__(self):
        """Every field checked however the profile is made (a JSON file, the constructor, ``replace``): a NaN,
        a negative or an absurdly small rate would otherwise reach the solver and fail deep inside it."""
        if not isinstance(self.name, str):
            raise HardwareError(f"hardware profile field 'name' must be a string, got {self.name!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "name" or v is None:
                continue
            if f.name.endswith("_bytes"):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_BYTES \
                        or v != int(v):   # 0.5 was truncated to 0 and reported as "got 0"
                    raise HardwareError(f"hardware profile field {f.name!r} must be a whole byte count between 0 "
                                        f"and 2**60 (1 EiB), got {v!r}")
                object.__setattr__(self, f.name, int(v))
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                    raise HardwareError(f"hardware profile field {f.name!r} must be a finite number >= 0, got {v!r}")
                high, unit = (MAX_GBPS, "GB/s") if f.name.endswith("_gbps") else \
                    (MAX_RATE, "TFLOPS" if f.name.endswith("_tflops") else "Gparams/s")
                if 0 < v < MIN_RATE or v > high:   # a unit slip: step times the solver cannot hold
                    raise HardwareError(f"hardware profile field {f.name!r} must be 0 (unknown) or between "
                                        f"{MIN_RATE:g} and {high:g} {unit}, got {v!r}")
                object.__setattr__(self, f.name, float(v))
        if self.peak_tflops and self.achievable_tflops and self.achievable_tflops > self.peak_tflops:
            raise HardwareError(f"hardware profile field 'achievable_tflops' ({self.achievable_tflops:g}) must be at "
                                f"most 'peak_tflops' ({self.peak_tflops:g})")

    # ---- accessors that insist on a value -----------------------------------------------
    def need(self, field_name: str) -> float:
        value = getattr(self, field_name)
        if value is None:
            raise HardwareError(
                f"hardware profile {self.name!r} has no value for {field_name!r}, which the plan needs; "
                f"measure it with `lazytrain bench tiers` or fill it from a catalog entry "
                f"(`lazytrain plan --hardware FILE.json --base h800`)")
        if not value > 0:
            raise HardwareError(f"hardware profile {self.name!r}: {field_name!r} must be > 0, got {value!r}")
        return value

    @property
    def flops_per_s(self) -> float:
        """Achievable bf16 FLOP/s of the compute stream."""
        return self.need("achievable_tflops") * 1e12

    @property
    def h2d_bps(self) -> float:
        return self.need("h2d_gbps") * GB

    @property
    def d2h_bps(self) -> float:
        return self.need("d2h_gbps") * GB

    @property
    def nvme_read_bps(self) -> float:
        return self.need("nvme_read_gbps") * GB

    @property
    def nvme_write_bps(self) -> float:
        return self.need("nvme_write_gbps") * GB

    def optimizer_params_per_s(self, bytes_per_param: float = 28.0) -> float:
        """Host optimizer throughput (parameters updated per second).

        ``host_optimizer_gparams_per_s`` when given; otherwise derived from ``host_mem_gbps``
        assuming the update is memory-bound and touches ``bytes_per_param`` bytes per parameter
        (AdamW on fp32 master weights and moments, bf16 gradient in and bf16 weight out: 28 bytes).
        """
        if self.host_optimizer_gparams_per_s or (self.host_optimizer_gparams_per_s is not None
                                                 and not self.host_mem_gbps):
            return self.need("host_optimizer_gparams_per_s") * 1e9   # 0 with no memory rate: said unknown
        if self.host_mem_gbps is not None:
            return self.need("host_mem_gbps") * GB / bytes_per_param
        raise HardwareError(
            f"hardware profile {self.name!r} has neither 'host_optimizer_gparams_per_s' nor 'host_mem_gbps'; "
            f"the plan needs one of them to time the host optimizer (or pass --base NAME)")

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HardwareProfile":
        if not isinstance(d, dict):
            raise HardwareError(f"a hardware profile must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise HardwareError(f"unknown hardware profile field(s): {', '.join(unknown)} "
                                f"(known: {', '.join(sorted(known))})")
        kw = {name: v for name, v in d.items() if v is not None}   # checked by __post_init__
        kw.setdefault("name", "unnamed")
        return cls(**kw)

    def filled_from(self, base: "HardwareProfile") -> "HardwareProfile":
        """This profile with every null field, and every rate given as 0 (unknown), taken from ``base``."""
        kw = {f.name: getattr(base, f.name) for f in fields(self)
              if f.name != "name" and (getattr(self, f.name) is None or
                                       (getattr(self, f.name) == 0 and not f.name.endswith("_bytes")))}
        if self.achievable_tflops and (kw.get("peak_tflops") or math.inf) < self.achievable_tflops:
            del kw["peak_tflops"]   # another card's datasheet peak, below what this one measured: left unknown
        return replace(self, name=f"{self.name}+{base.name}" if kw else self.name, **kw)


# ---- catalog --------------------------------------------------------------------------------
CATALOG: dict[str, HardwareProfile] = {
    # H800 80 GB (the paper's machine: PCIe Gen5 x16, 2 TiB DDR5, 2x 7 TB NVMe).
    # peak: H800 SXM dense bf16. h2d/d2h: the paper's measured, conservative 12 GB/s per direction.
    # NVMe: the paper's measured 2.83 GB/s read / 3.35 GB/s write (GPUDirect Storage).
    # achievable_tflops and host_optimizer_gparams_per_s: calibrated to the paper's MegaTrain column
    # by lazytrain.planner.policies.calibrate() (minimax relative error over 3B/7B/14B/27B, MegaTrain's
    # executor: residuals +9.4/-2.5/-9.5/-6.6%; the optimizer rate sits at its memory-bound cap).
    # host_mem_gbps: 8-channel DDR5-4800 per socket, nominal (used only when the optimizer rate is absent).
    "h800": HardwareProfile(
        name="h800", peak_tflops=989.0, achievable_tflops=269.0,
        h2d_gbps=12.0, d2h_gbps=12.0, nvme_read_gbps=2.83, nvme_write_gbps=3.35,
        host_mem_gbps=307.0, host_optimizer_gparams_per_s=10.96,
        gpu_mem_bytes=80 * GiB, host_mem_bytes=2048 * GiB),
    # RTX 3090 24 GB on PCIe Gen4 x16. peak: dense bf16 with fp32 accumulate. The paper reports neither
    # the bandwidths nor the host of its RTX 3090 machine. Assumed: a host like the H800 machine's
    # (host_mem_gbps 307, so the optimizer is capped at its memory-bound 10.96 Gparams/s, 512 GiB) and the
    # same NVMe drives. Calibrated with lazytrain.planner.policies.calibrate(fit_pcie=True,
    # pcie_max_gbps=26) against the paper's MegaTrain RTX 3090 column: every fitted value sits at its
    # cap (achievable_tflops at the peak 71.0, h2d/d2h 26 GB/s: PCIe Gen4 x16 moves about 26 GB/s from
    # pinned memory; the optimizer at 10.96), and the fit is poor (residuals +16/+11/+10/-25%): MegaTrain
    # streams the 27B's 48.7 GB of layer weights three times a step, 5.6 s at 26 GB/s of a 7.3 s step.
    "rtx3090": HardwareProfile(
        name="rtx3090", peak_tflops=71.0, achievable_tflops=71.0,
        h2d_gbps=26.0, d2h_gbps=26.0, nvme_read_gbps=2.83, nvme_write_gbps=3.35,
        host_mem_gbps=307.0, host_optimizer_gparams_per_s=10.96,
        gpu_mem_bytes=24 * GiB, host_mem_bytes=512 * GiB),
    # H200 141 GB (Hopper, same tensor cores as H800): achievable_tflops and the optimizer rate are
    # taken over from the h800 calibration; PCIe Gen5 x16 at a nominal 25 GB/s per direction (not
    # measured: run `lazytrain bench tiers` on the machine and pass the JSON with --hardware).
    "h200": HardwareProfile(
        name="h200", peak_tflops=989.0, achievable_tflops=269.0,
        h2d_gbps=25.0, d2h_gbps=25.0, nvme_read_gbps=2.83, nvme_write_gbps=3.35,
        host_mem_gbps=307.0, host_optimizer_gparams_per_s=10.96,
        gpu_mem_bytes=141 * GB, host_mem_bytes=2048 * GiB),
}


def catalog_profile(name: str) -> HardwareProfile:
    key = name.lower()
    if key not in CATALOG:
        raise HardwareError(f"unknown hardware {name!r}; catalog entries: {', '.join(sorted(CATALOG))}, "
                            f"or give a JSON file written by `lazytrain bench tiers`")
    return CATALOG[key]


def load_profile(name_or_path: str | dict | HardwareProfile, base: str | None = None) -> HardwareProfile:
    """A catalog name, a JSON file path, a dict or a profile; ``base`` (a catalog name) fills null fields."""
    if isinstance(name_or_path, HardwareProfile):
        prof = name_or_path
    elif isinstance(name_or_path, dict):
        prof = HardwareProfile.from_dict(name_or_path)
    elif not isinstance(name_or_path, str):
        raise HardwareError(f"hardware must be a catalog name, a JSON file path, a dict or a HardwareProfile, "
                            f"got {type(name_or_path).__name__}")
    elif name_or_path.lower() in CATALOG:
        prof = CATALOG[name_or_path.lower()]
    elif name_or_path.lower().endswith(".json") or os.sep in name_or_path or "/" in name_or_path \
            or os.path.isfile(name_or_path):   # a file saved under another name is read, as a model's config is
        prof = HardwareProfile.from_dict(read_json(name_or_path, HardwareError, "hardware profile"))
    else:
        prof = catalog_profile(name_or_path)
    if base is not None:
        prof = prof.filled_from(catalog_profile(base))
    return prof
