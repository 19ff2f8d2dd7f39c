"""Side-by-side comparison of the planner's plan and the baseline policies, in the same simulator."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .ceiling import step_floor
from . import megatrain
from .megatrain import MegaTrainPlanError
from .milp import MilpOptions
from .plan import Plan
from .policies import BASELINES, megatrain_plan
from .problem import Problem, fmt_bytes
from .search import solve
from .simulate import SimResult, simulate


@dataclass
class Row:
    policy: str
    plan: Plan | None
    sim: SimResult | None
    solve_s: float | None = None
    status: str = ""

    def as_dict(self, p: Problem, reference: "Row | None" = None) -> dict[str, Any]:
        if self.sim is None:
            return {"policy": self.policy, "status": self.status or "does not fit"}
        r = self.sim
        d = {"policy": self.policy, "step_s": r.step_time_s, "tflops": r.tflops, "tokens_per_s": r.tokens_per_s,
             "gpu_gb": r.peak_bytes["hbm"] / 1e9, "host_gb": r.peak_bytes["host"] / 1e9,
             "nvme_gb": r.peak_bytes["nvme"] / 1e9,
             "homes": "{hbm}/{host}/{nvme}/{recompute}/{graph}".format(**r.boundaries_per_home),
             "recomputed": r.recomputed_layers, "selective": r.selective_layers, "offloaded": r.offloaded_layers,
             "exposed_s": sum(v for k, v in r.exposed_s.items() if k != "optimizer"),
             "optimizer_s": r.exposed_s["optimizer"],
             # MegaTrain's row against the bound of what it runs: the full fine-tuning (megatrain.as_it_trains)
             "vs_lower_bound": r.step_time_s / (megatrain.as_it_trains(p) if self.policy.startswith("megatrain")
                                                else p).lower_bound_s()["bound"],
             "solve_s": self.solve_s, "status": self.status}
        if reference is not None and reference.sim is not None:
            d["speedup"] = reference.sim.step_time_s / r.step_time_s
        return d


def compare(p: Problem, opts: MilpOptions = MilpOptions(), baselines=("megatrain", "best-interval", "keep-all", "greedy"),
            plan: Plan | None = None) -> list[Row]:
    """Our MILP plan (``plan`` if already solved for ``p``) followed by each baseline. MegaTrain's
    policy is always shown (flagged when it exceeds a budget in our memory model); another baseline
    that does not fit gets an empty row."""
    rows = []
    t0 = time.perf_counter()
    if plan is None:
        plan = solve(p, opts)
    wall = time.perf_counter() - t0 if "solve_wall_s" not in plan.prediction else plan.prediction["solve_wall_s"]
    info = plan.prediction["solver"]
    status = info["status"] + (f" gap {info['gap']:.1e}" if info["status"] == "feasible" and info["gap"] is not None else "")
    rows.append(Row("lazytrain (milp)", plan, simulate(p, plan), wall, status))
    for name in baselines:
        if name == "megatrain":
            pl = megatrain_plan(p)
            try:
                r = simulate(p, pl, strict=False, executor="megatrain")
            except MegaTrainPlanError as e:   # not to be timed here: said in its row, the rest compared
                rows.append(Row("megatrain (k=4, serial opt)", pl, None, 0.0, f"not timed: {e}"))
                continue
            over = sorted({v.split()[0] for v in r.violations if " peak " in v})
            rows.append(Row("megatrain (k=4, serial opt)", pl, r, 0.0,
                            "policy" if not r.violations else f"over budget: {', '.join(over)}"))
            continue
        t0 = time.perf_counter()
        res = BASELINES[name](p)
        dt = time.perf_counter() - t0
        if res is None:
            rows.append(Row(name, None, None, dt, "does not fit"))
        else:
            pl, _ = res
            rows.append(Row(f"{name} ({pl.policy})", pl, simulate(p, pl), dt, "policy"))
    return rows


def _seconds(value: float) -> str:
    """Milliseconds shown where a small model's step is below them (0.000 said nothing)."""
    return f"{value:.3f}" if value >= 0.1 or value == 0 else f"{value:.3g}"


COLUMNS = [("policy", "policy", "{}"), ("step_s", "step s", _seconds), ("tflops", "TFLOPS", "{:.1f}"),
           ("tokens_per_s", "tokens/s", "{:.0f}"), ("speedup", "vs MegaTrain", "{:.3f}x"),
           ("gpu_gb", "GPU GB", "{:.1f}"), ("host_gb", "host GB", "{:.1f}"), ("nvme_gb", "NVMe GB", "{:.1f}"),
           ("homes", "hbm/host/nvme/rec/graph", "{}"), ("recomputed", "recomputed", "{}"),
           ("selective", "selective", "{}"), ("offloaded", "offloaded", "{}"),
           ("exposed_s", "exposed xfer s", _seconds), ("optimizer_s", "opt delay s", _seconds),
           ("vs_lower_bound", "/ lower bound", "{:.3f}"), ("solve_s", "solve s", "{:.2f}"), ("status", "status", "{}")]


def table(p: Problem, rows: list[Row]) -> str:
    ref = next((r for r in rows if r.policy.startswith("megatrain") and r.sim), None)
    dicts = [r.as_dict(p, ref) for r in rows]
    cells = [[h for _, h, _ in COLUMNS]]
    for d in dicts:
        cells.append([("-" if d.get(k) is None else f(d[k]) if callable(f) else f.format(d[k]))
                      for k, _, f in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(x.ljust(widths[i]) if i == 0 else x.rjust(widths[i]) for i, x in enumerate(c)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lb = p.lower_bound_s()
    accum = f" x {p.grad_accum} accumulated" if p.grad_accum > 1 else ""
    head = (f"{p.model.name} on {p.hardware.name}: micro-batch {p.micro_batch}{accum} x seq {p.seq_len}, "
            f"budgets GPU {fmt_bytes(p.gpu_budget)}, host {fmt_bytes(p.host_budget)}, "
            f"NVMe {fmt_bytes(p.nvme_budget) if p.nvme_budget else 'none'}; "
            f"step lower bound {_seconds(lb['bound'])} s (compute {_seconds(lb['compute'])}, H2D "
            f"{_seconds(lb['h2d'])}, D2H {_seconds(lb['d2h'])}, "
            + (f"NVMe read {_seconds(lb['nvme_read'])}, " if "nvme_read" in lb else "")
            + f"optimizer {_seconds(lb['optimizer'])})")
    shown = any(r.policy.startswith("megatrain") for r in rows)
    trained = trained_line(p, "timed" if ref is not None else "not timed" if shown else None)
    return head + "\n" + (trained + "\n" if trained else "") + floors_line(p, ref) + "\n" + "\n".join(lines)


def trained_line(p: Problem, megatrain: str | None = "timed") -> str:
    """What the problem trains where it trains less than the whole model ("" for full fine-tuning), where the
    layers above a frozen bottom hold less than the share asked for, and, where the table has a MegaTrain row
    (``megatrain``: "timed", "not timed" or None for none), that it trains it all."""
    b, m, f = p.budgets, p.model, p.first_reached
    layers = p.layer_trainable_share
    others = p.nonlayer_trained / m.nonlayer_params if m.nonlayer_params else 0.0
    if f == 0 and layers == 1 and (others == 1 or not m.nonlayer_params):
        return ""
    where = "" if f == 0 else (f"; layers 0-{f - 1} frozen, the backward stops at layer {f}" if f < p.L
                               else "; every layer frozen, no backward through them")
    line = f"trains {layers:.1%} of the layers' parameters and {others:.1%} of the others{where}"
    notes = []
    if layers < b.trainable_share:
        notes.append(f"a trainable share of {b.trainable_share:.1%} is more than the layers above the frozen bottom "
                     f"hold: all of theirs train")
    if f and others < b.non_block_trainable_share:
        notes.append("the embedding counts as frozen")
    if notes:
        line += " (" + "; ".join(notes) + ")"
    if megatrain == "timed":
        line += (". MegaTrain has no frozen or partial training: its row trains every parameter, as its code "
                 "would for this model")
    elif megatrain is not None:
        line += ". MegaTrain has no frozen or partial training, and its row is not timed (its status says why)"
    return line


def floors_line(p: Problem, megatrain: "Row | None") -> str:
    """The step floors of planner/ceiling.py, and what they allow over MegaTrain's policy."""
    graph, off = step_floor(p), step_floor(p, offload=True)

    def over(f):
        return f" ({f.speedup_over(megatrain.sim.step_time_s):.3f}x MegaTrain)" if megatrain else ""
    return (f"step floor, any plan that keeps each layer's autograd internals on the GPU, keeps its matmul "
            f"and attention outputs (selective) or re-runs it: "
            f"{_seconds(graph.step_s)} s{over(graph)}; also offloading internals over PCIe (offloaded layers): "
            f"{_seconds(off.step_s)} s{over(off)}")
