"""Baseline policies as Plans, and the calibration of a hardware profile against the paper.

- :func:`megatrain_plan`: MegaTrain's policy: boundary 0 and every 4th boundary kept on the GPU, each
  4-layer block recomputed in backward, clipping and the host optimizer serial after backward
  (``overlap_optimizer=False``). :func:`simulate_megatrain` replays it on MegaTrain's own executor
  (megatrain.py: all 4 layers re-run, its serial host phase, its device memory); the same plan on
  LazyTrain's executor is what LazyTrain's engine would make of MegaTrain's policy.
- :func:`best_interval_plan`: the best fixed interval k (boundaries on the GPU, else on the host) on
  LazyTrain's executor (optimizer overlapped with the next forward).
- :func:`keep_all`: every boundary kept, all on the GPU where that fits, else all on the host.
- :func:`greedy_plan`: boundaries in order, each on the first home (GPU, host, NVMe, recompute) that
  keeps the plan feasible without slowing it.

:func:`calibrate` fits the unknowns of a hardware profile (achievable TFLOPS, host optimizer
throughput, optionally the PCIe bandwidth) so that the simulator, running MegaTrain's executor,
reproduces measured MegaTrain tokens/s; the paper's columns are in :data:`PAPER`.
:func:`megatrain_memory_errors` compares the modelled device peaks with the measured ones, and
:func:`calibration_band` lists the fits nearly as good as the best, so that a prediction made with the
calibration can be given with the spread those fits allow.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

from .hardware import HardwareProfile
from .plan import DEVICE_HOME, RECOMPUTE, Plan, every_k_plan
from .problem import Budgets, Problem
from .simulate import SimResult, simulate

# The paper's reported results (single runs): (gpu, model) -> {system: (batch, TFLOPS, GPU GB, CPU GB, tokens/s)}
PAPER = {
    ("h800", "qwen2.5-3b"): {"megatrain": (192, 142.80, 35.72, 49.31, 7933), "lazytrain": (192, 176.42, 67.95, 52.68, 9801)},
    ("h800", "qwen2.5-7b"): {"megatrain": (144, 161.35, 43.26, 95.74, 3842), "lazytrain": (144, 199.84, 68.21, 99.58, 4758)},
    ("h800", "qwen2.5-14b"): {"megatrain": (96, 171.92, 52.83, 179.64, 2047), "lazytrain": (96, 212.34, 68.57, 185.12, 2528)},
    ("h800", "paper-27b"): {"megatrain": (72, 176.90, 60.40, 339.99, 1075.8), "lazytrain": (72, 219.95, 68.84, 361.58, 1361)},
    ("rtx3090", "qwen2.5-3b"): {"megatrain": (7, 33.18, 22.83, 25.0, 1792), "lazytrain": (8, 40.76, 23.16, 27.8, 2210)},
    ("rtx3090", "qwen2.5-7b"): {"megatrain": (5, 35.09, 22.63, 56.7, 768), "lazytrain": (6, 43.42, 23.06, 61.5, 951)},
    ("rtx3090", "qwen2.5-14b"): {"megatrain": (3, 30.19, 21.10, 103.7, 341), "lazytrain": (4, 37.36, 22.92, 111.8, 422)},
    ("rtx3090", "paper-27b"): {"megatrain": (1, 22.74, 22.48, 197.3, 140), "lazytrain": (2, 28.11, 23.08, 214.6, 174)},
}
PAPER_SEQ = 1024
PAPER_GPU_CAP = {"h800": "70GB", "rtx3090": "24GiB"}


def megatrain_plan(p: Problem, k: int = 4) -> Plan:
    return every_k_plan(p.L, k, home=DEVICE_HOME, policy=f"megatrain-k{k}", overlap_optimizer=False,
                        micro_batch_size=p.micro_batch, seq_len=p.seq_len)


def simulate_megatrain(p: Problem, k: int = 4, timeline: bool = False) -> SimResult:
    """MegaTrain's policy on MegaTrain's executor (budgets reported as violations, not raised)."""
    return simulate(p, megatrain_plan(p, k), strict=False, timeline=timeline, executor="megatrain")


def _fits(p: Problem, plan: Plan) -> SimResult | None:
    r = simulate(p, plan, strict=False, timeline=False)
    return None if r.violations else r


def best_interval_plan(p: Problem) -> tuple[Plan, SimResult] | None:
    """The fastest feasible checkpoint-every-k plan (k = 1..L; boundaries on the GPU, else the host)."""
    best = None
    for home in (DEVICE_HOME, "host"):
        for k in range(1, p.L + 1):
            plan = every_k_plan(p.L, k, home=home, policy=f"interval-k{k}-{home}",
                                micro_batch_size=p.micro_batch, seq_len=p.seq_len)
            r = _fits(p, plan)
            if r and (best is None or r.step_time_s < best[1].step_time_s - 1e-12):
                best = (plan, r)
    return best


def keep_all(p: Problem) -> tuple[Plan, SimResult] | None:
    """Keep every boundary the backward reads (no recompute): all on the GPU if that fits, else all on the host
    (boundary 0 on the GPU if that fits, else on the host too). Below a frozen bottom
    (``Problem.first_reached``) none but boundary 0 is kept: no backward reads them."""
    f = p.first_reached
    for home, first in ((DEVICE_HOME, DEVICE_HOME), ("host", DEVICE_HOME), ("host", "host")):
        homes = (first,) + tuple(RECOMPUTE if b < f else home for b in range(1, p.L)) + (DEVICE_HOME,)
        plan = Plan(num_layers=p.L, homes=homes, policy=f"keep-all-{home}",
                    micro_batch_size=p.micro_batch, seq_len=p.seq_len)
        r = _fits(p, plan)
        if r:
            return plan, r
    return None


def greedy_plan(p: Problem) -> tuple[Plan, SimResult] | None:
    """Boundaries 0..L-1 in order, each on the first home in (GPU, host, NVMe, recompute) that keeps the
    plan feasible, with the boundaries not yet placed on the host (the lightest home for the GPU), and
    that does not slow the simulated step. None when even keeping everything on the host does not fit."""
    f = p.first_reached   # below a frozen bottom no backward reads a boundary: none but boundary 0 is kept
    homes = ["host"] + [RECOMPUTE if b < f else "host" for b in range(1, p.L)] + [DEVICE_HOME]
    cur = _fits(p, Plan(num_layers=p.L, homes=tuple(homes), policy="greedy"))
    if cur is None:
        return None
    tiers = [DEVICE_HOME, "host"] + (["nvme"] if p.nvme_act_budget > 0 else []) + [RECOMPUTE]
    for b in [0] + list(range(max(f, 1), p.L)):
        for home in tiers:
            if b == 0 and home == RECOMPUTE:
                continue
            trial = homes.copy()
            trial[b] = home
            r = cur if home == "host" else _fits(p, Plan(num_layers=p.L, homes=tuple(trial), policy="greedy"))
            if r and r.step_time_s <= cur.step_time_s * (1 + 1e-9):
                homes, cur = trial, r
                break
    plan = Plan(num_layers=p.L, homes=tuple(homes), policy="greedy",
                micro_batch_size=p.micro_batch, seq_len=p.seq_len)
    return plan, cur


BASELINES: dict[str, Callable[[Problem], "tuple[Plan, SimResult] | None"]] = {
    "megatrain": lambda p: (lambda pl: (pl, r) if (r := _fits(p, pl)) else None)(megatrain_plan(p)),
    "best-interval": best_interval_plan,
    "keep-all": keep_all,
    "greedy": greedy_plan,
}


# ---- calibration ------------------------------------------------------------------------------
def paper_problem(gpu: str, model: str, hw: HardwareProfile, system: str = "megatrain", batch: int | None = None,
                  check: bool = True) -> Problem:
    from .models import catalog_model
    b = batch or PAPER[(gpu, model)][system][0]
    return Problem(model=catalog_model(model), hardware=hw, budgets=Budgets.of(gpu=PAPER_GPU_CAP[gpu]),
                   micro_batch=b, seq_len=PAPER_SEQ, check=check)


def megatrain_errors(hw: HardwareProfile, gpu: str) -> dict[str, float]:
    """Relative error of simulated MegaTrain tokens/s vs the paper, per model (memory not enforced:
    the paper's MegaTrain ran these batches, so only its speed is compared)."""
    out = {}
    for (g, model), rows in PAPER.items():
        if g != gpu:
            continue
        p = paper_problem(gpu, model, hw, check=False)
        out[model] = simulate_megatrain(p).tokens_per_s / rows["megatrain"][4] - 1
    return out


def megatrain_memory_errors(hw: HardwareProfile, gpu: str) -> dict[str, float]:
    """Relative error of MegaTrain's modelled device peak vs the paper's, per model. The paper's column
    is ``torch.cuda.max_memory_allocated`` in GiB (MegaTrain's train.py), so the CUDA context reserve
    that the budget check adds is left out."""
    out = {}
    for (g, model), rows in PAPER.items():
        if g != gpu:
            continue
        p = paper_problem(gpu, model, hw, check=False)
        allocated = simulate_megatrain(p).peak_bytes["hbm"] - p.budgets.gpu_reserved_bytes
        out[model] = allocated / 2 ** 30 / rows["megatrain"][2] - 1
    return out


def megatrain_host_memory_errors(hw: HardwareProfile, gpu: str, moment_bytes: int | None = None) -> dict[str, float]:
    """Relative error of MegaTrain's modelled host memory after a step vs the paper's CPU column, per model:
    its train.py reports ``psutil`` RSS in GiB after the step (megatrain.host_bytes_after_step), with its
    optimizer's moments of ``moment_bytes`` a parameter (default: CPUAdam's fp32)."""
    from . import megatrain
    mb = megatrain.MOMENT_BYTES if moment_bytes is None else moment_bytes
    return {model: megatrain.host_bytes_after_step(paper_problem(gpu, model, hw, check=False), mb) / 2 ** 30
            / rows["megatrain"][3] - 1 for (g, model), rows in PAPER.items() if g == gpu}


def calibrate(base: HardwareProfile, gpu: str, fit_pcie: bool = False,
              pcie_max_gbps: float = 48.0) -> tuple[HardwareProfile, dict]:
    """:func:`_calibrated`, fitted once per process for the same arguments (a fit costs seconds; the band and
    the reports fit the same calibration again)."""
    hw, errors = _calibrated(base, gpu, fit_pcie, pcie_max_gbps)
    return hw, dict(errors)


@functools.lru_cache(maxsize=16)
def _calibrated(base: HardwareProfile, gpu: str, fit_pcie: bool, pcie_max_gbps: float) -> tuple[HardwareProfile, tuple]:
    """Fit achievable_tflops and host_optimizer_gparams_per_s (and h2d = d2h GB/s when ``fit_pcie``) to
    the paper's MegaTrain column on ``gpu``, minimising the largest relative tokens/s error.

    Deterministic search on the simulator: a geometric grid over the optimizer rate (and PCIe
    bandwidth, up to ``pcie_max_gbps``); for each grid point a ternary search over achievable TFLOPS
    (the largest error is unimodal in it). The optimizer rate is capped at the memory-bound rate of the host
    (``host_mem_gbps`` / 28 bytes per parameter): the measured columns barely constrain it, and
    no AdamW update runs faster than its memory traffic allows."""
    def errors(f: float, r: float, bw: float | None) -> dict[str, float]:
        kw = dict(achievable_tflops=f, host_optimizer_gparams_per_s=r)
        if bw is not None:
            kw.update(h2d_gbps=bw, d2h_gbps=bw)
        return megatrain_errors(replace(base, **kw), gpu)

    def worst(f, r, bw):
        return max(abs(e) for e in errors(f, r, bw).values())

    geo = lambda lo, hi, n: [lo * (hi / lo) ** (k / (n - 1)) for k in range(n)]
    best = None
    for bw in (geo(6.0, pcie_max_gbps, 10) if fit_pcie else [None]):
        r_cap = base.host_mem_gbps / 28.0 if base.host_mem_gbps else 64.0
        for r in geo(0.5, r_cap, 16 if fit_pcie else 22):
            lo, hi = 0.02 * base.need("peak_tflops"), base.need("peak_tflops")
            for _ in range(22 if fit_pcie else 28):
                m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
                if worst(m1, r, bw) <= worst(m2, r, bw):
                    hi = m2
                else:
                    lo = m1
            f = round((lo + hi) / 2, 1)
            s = worst(f, round(r, 2), None if bw is None else round(bw, 1))
            if best is None or s < best[0] - 1e-9:
                best = (s, f, round(r, 2), None if bw is None else round(bw, 1))
    _, f, r, bw = best
    kw = dict(achievable_tflops=f, host_optimizer_gparams_per_s=r)
    if bw is not None:
        kw.update(h2d_gbps=bw, d2h_gbps=bw)
    hw = replace(base, **kw)
    return hw, tuple(megatrain_errors(hw, gpu).items())


def calibration_band(base: HardwareProfile, gpu: str, tolerance: float = 0.01,
                     rates: int = 12, probes: int = 20) -> list[tuple[HardwareProfile, float]]:
    """Calibrations that fit the paper's MegaTrain tokens/s nearly as well as the best: every
    (achievable_tflops, host_optimizer_gparams_per_s) whose largest relative error is within
    ``tolerance`` (absolute, 0.01 = one percentage point) of :func:`calibrate`'s, with that error.

    Why: two free parameters fitted to four points leave residuals neither explains, so a prediction
    made with the best fit alone claims more precision than the fit has. Deterministic: the best fit
    first, then, for each optimizer rate on a geometric grid up to the memory-bound cap, the fit's
    minimum over TFLOPS (ternary search) and, where it is within the tolerance, the two TFLOPS at which
    the error reaches best + tolerance (bisection, ``probes`` steps) and three points between them."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    best_hw, best_errs = calibrate(base, gpu)
    best = max(abs(e) for e in best_errs.values())
    limit = best + tolerance

    def worst(f: float, r: float) -> float:
        hw = replace(base, achievable_tflops=f, host_optimizer_gparams_per_s=r)
        return max(abs(e) for e in megatrain_errors(hw, gpu).values())

    out = [(best_hw, best)]
    r_cap = base.host_mem_gbps / 28.0 if base.host_mem_gbps else 64.0
    peak = base.need("peak_tflops")
    for n in range(rates):
        r = round(0.5 * (r_cap / 0.5) ** (n / (rates - 1)), 2)
        lo, hi = 0.02 * peak, peak
        for _ in range(28):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if worst(m1, r) <= worst(m2, r):
                hi = m2
            else:
                lo = m1
        f_min = (lo + hi) / 2
        if worst(f_min, r) > limit:
            continue
        ends = []
        for outside in (0.02 * peak, peak):                   # where the error crosses the limit
            a, b = f_min, outside
            for _ in range(probes):
                mid = (a + b) / 2
                a, b = (mid, b) if worst(mid, r) <= limit else (a, mid)
            ends.append(a)
        for f in (ends[0], (ends[0] + f_min) / 2, f_min, (f_min + ends[1]) / 2, ends[1]):
            f = round(f, 1)
            e = worst(f, r)
            if e <= limit + 1e-12:
                out.append((replace(base, achievable_tflops=f, host_optimizer_gparams_per_s=r), e))
    return out


def prediction_band(band: list[tuple[HardwareProfile, float]],
                    predict: Callable[[HardwareProfile], float]) -> tuple[float, float, float]:
    """``predict`` under the best calibration of ``band`` (its first entry) and its smallest and largest
    value over the whole band: (best, low, high), low <= best <= high."""
    if not band:
        raise ValueError("an empty calibration band has no prediction")
    values = [predict(hw) for hw, _ in band]
    return values[0], min(values), max(values)
