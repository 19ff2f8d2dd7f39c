"""How fast could any plan make one paper scenario's step, at each micro-batch that divides its batch?

For one (GPU, model) of the paper (default: the H800 27B, batch 72, seq 1024, 70 GB cap), at every divisor
of the batch (gradient accumulation filling it), prints MegaTrain's best step (its best micro-batch in its
executor's model, as benchmarks/planner_paper.py picks it) and two step floors (planner/ceiling.py):

- the floor of LazyTrain's plan space: each layer kept, selective, offloaded, re-run, resident or not;
- the same space plus a kind the executor does not run (``selective_offload``): a selective layer whose
  matmul and attention outputs are parked on the host like offloaded internals. It asks whether that kind
  would lift the ceiling enough to be worth building.

With ``--plan`` it also solves the MILP at each micro-batch (``--time-limit`` seconds each) and prints the
plan's speed-up beside its floor: how far today's window-by-window plans are from the relaxation. It prints
the solver's proven bound too: no plan of the MILP's space (the executor's cost model window by window, with
the MILP's limits on segment length and transfer windows) is faster than that bound, so the speed-up it allows
is a tighter ceiling for those plans than the floor's. The floor lets each phase's transfers and memory
spread freely.

With ``--link-gbps X`` the catalog profile's host<->device links run at X GB/s per direction instead (the
H800's catalog figure is the paper's conservative 12 GB/s; a PCIe Gen5 x16 link moves 55 GB/s from pinned
memory on an H200, BENCHMARKS.md), and the profile's two calibrated values (achievable TFLOPS, host optimizer
rate) are fitted again against the paper's MegaTrain column at that link rate (policies.calibrate), so both
systems are modelled on the same hardware. It prints the refit and its residuals first. This asks how much of
a goal depends on the link figure, not what the paper's machine did.

    python3 benchmarks/floor_by_micro_batch.py [--gpu h800] [--model paper-27b] [--plan] [--time-limit 10]
                                               [--link-gbps 25]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import replace                                                   # noqa: E402

from planner_paper import megatrain_best, fmt_table                               # noqa: E402
from lazytrain.planner.ceiling import step_floor                                  # noqa: E402
from lazytrain.planner.hardware import CATALOG                                    # noqa: E402
from lazytrain.planner.milp import MilpOptions                                    # noqa: E402
from lazytrain.planner.models import catalog_model                               # noqa: E402
from lazytrain.planner.policies import (PAPER, PAPER_GPU_CAP, PAPER_SEQ, calibrate,  # noqa: E402
                                        megatrain_errors)
from lazytrain.planner.problem import Budgets, Problem                            # noqa: E402
from lazytrain.planner.search import solve                                        # noqa: E402
from lazytrain.planner.simulate import simulate                                   # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="h800", choices=sorted(PAPER_GPU_CAP))
    ap.add_argument("--model", default="paper-27b")
    ap.add_argument("--plan", action="store_true", help="also solve the MILP at each micro-batch")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="host<->device GB/s per direction instead of the catalog's; refits the calibration")
    args = ap.parse_args()
    if args.link_gbps is not None and not 0 < args.link_gbps < 1e4:
        ap.error(f"--link-gbps must be a positive rate in GB/s below 1e4, got {args.link_gbps}")
    if (args.gpu, args.model) not in PAPER:
        ap.error(f"no paper scenario {args.gpu} {args.model}; known: "
                 + ", ".join(f"{g} {m}" for g, m in PAPER))
    rows = PAPER[(args.gpu, args.model)]
    batch, mt_batch = rows["lazytrain"][0], rows["megatrain"][0]
    hw, cap, shape = CATALOG[args.gpu], PAPER_GPU_CAP[args.gpu], catalog_model(args.model)
    print(f"# {args.gpu} {args.model}, batch {batch} x seq {PAPER_SEQ}, cap {cap}; {platform.node()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.link_gbps is not None:
        before = megatrain_errors(hw, args.gpu)
        hw, _ = calibrate(replace(hw, h2d_gbps=args.link_gbps, d2h_gbps=args.link_gbps), args.gpu)
        after = megatrain_errors(hw, args.gpu)
        fmt = lambda errs: " ".join(f"{m} {e * 100:+.1f}%" for m, e in errs.items())
        print(f"links {args.link_gbps:g} GB/s per direction (catalog: {CATALOG[args.gpu].h2d_gbps:g}); refit: "
              f"achievable {hw.achievable_tflops:.1f} TFLOPS (catalog {CATALOG[args.gpu].achievable_tflops:.1f}), "
              f"optimizer {hw.host_optimizer_gparams_per_s:.2f} Gparams/s "
              f"(catalog {CATALOG[args.gpu].host_optimizer_gparams_per_s:.2f})")
        print(f"MegaTrain step-time residuals (tokens/s): catalog {fmt(before)}; refit {fmt(after)}")
    best_tps, mt_mb, mt_accum = megatrain_best(shape, hw, cap, mt_batch, batch)
    print(f"MegaTrain's best: {best_tps:.0f} tokens/s ({mt_mb} x {mt_accum})")
    out, best = [], {"space": (0.0, 0), "hypothetical": (0.0, 0), "plan": (0.0, 0), "bound": (0.0, 0)}
    for mb in (d for d in range(1, batch + 1) if batch % d == 0):
        p = Problem(model=shape, hardware=hw, budgets=Budgets.of(gpu=cap), micro_batch=mb, seq_len=PAPER_SEQ,
                    grad_accum=batch // mb, check=False)
        tokens = batch * PAPER_SEQ
        space, wider = step_floor(p, offload=True), step_floor(p, offload=True, selective_offload=True)
        x_space, x_wider = tokens / space.step_s / best_tps, tokens / wider.step_s / best_tps
        best["space"] = max(best["space"], (x_space, mb))
        best["hypothetical"] = max(best["hypothetical"], (x_wider, mb))
        row = [mb, batch // mb, f"{space.step_s:.2f}", f"{x_space:.3f}x",
               f"{space.kept_layers:.1f}/{space.offloaded_layers:.1f}/{space.selective_layers:.1f}",
               f"{wider.step_s:.2f}", f"{x_wider:.3f}x",
               f"{wider.kept_layers:.1f}/{wider.offloaded_layers:.1f}/{wider.selective_layers:.1f}/"
               f"{wider.selective_offloaded_layers:.1f}"]
        if args.plan:
            t0 = time.perf_counter()
            plan = solve(p, MilpOptions(time_limit_s=args.time_limit))
            r = simulate(p, plan, strict=False, timeline=False)
            x_plan = r.tokens_per_s / best_tps if not r.violations else 0.0
            best["plan"] = max(best["plan"], (x_plan, mb))
            bound_s = plan.prediction["solver"].get("bound_s")
            x_bound = tokens / bound_s / best_tps if bound_s else float("inf")
            best["bound"] = max(best["bound"], (x_bound, mb))
            row += [f"{x_plan:.3f}x" if x_plan else "over budget", f"{x_bound:.3f}x" if bound_s else "none",
                    f"{x_plan / x_space:.3f}" if x_plan else "-",
                    plan.prediction["solver"]["status"], f"{time.perf_counter() - t0:.1f}"]
        out.append(row)
        print(f"  micro-batch {mb} done", file=sys.stderr)
    header = ["micro", "accum", "floor s", "floor / MegaTrain best", "kept/offloaded/selective",
              "+ selective offload s", "its ceiling / MegaTrain best", "kept/offl/sel/sel-offl"]
    if args.plan:
        header += ["MILP plan / MegaTrain best", "MILP bound / MegaTrain best", "plan / floor speed", "status",
                   "solve s"]
    print(fmt_table(header, out))
    print(f"highest floor: {best['space'][0]:.3f}x at micro-batch {best['space'][1]}; with selective offload "
          f"(not in the executor): {best['hypothetical'][0]:.3f}x at {best['hypothetical'][1]}")
    if args.plan:
        print(f"fastest MILP plan: {best['plan'][0]:.3f}x at micro-batch {best['plan'][1]}; no plan of the MILP's "
              f"space beats {best['bound'][0]:.3f}x (its proven bound, micro-batch {best['bound'][1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
