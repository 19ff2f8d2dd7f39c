"""The paper's eight (GPU, model, batch) scenarios through LazyTrain's planner and simulator.

For each scenario (seq 1024; 70 GB cap on h800, 24 GiB card on rtx3090; the paper's LazyTrain batch)
it plans with the MILP (selective and offloaded layers allowed) and prints, in the same simulator and at
the same batch: the step time of our plan on LazyTrain's executor, of MegaTrain as its code runs (every
4th boundary on the GPU, all 4 layers of a block re-run, serial clipping, optimizer and pinned-copy
refresh, planner/megatrain.py) and
of the best fixed interval on LazyTrain's executor; the predicted speed-up with its band: the smallest
and largest over every calibration whose largest tokens/s error is within 1 percentage point of the
best fit's (policies.calibration_band; our plan held fixed, so the band's low end is conservative); the MILP's solve time on this machine and its status; each plan's distance
from the step's physical lower bound; and the simulator's calibration against the paper (MegaTrain
column, residuals for step time and for MegaTrain's peak GPU memory) and its prediction of the paper's
LazyTrain column. On rtx3090 it also searches the largest
micro-batch our plan fits. Goals (printed, not asserted): our plan >= 1.35x MegaTrain,
solve <= 10 s, rtx3090 micro-batch >= the paper's LazyTrain batch. A second table gives each
scenario's step floor (planner/ceiling.py): the fastest step any plan could make if every layer either
keeps its autograd internals on the GPU, keeps its matmul and attention outputs (a selective layer, its
re-run taking the rest) or re-runs in backward, and if the internals may also be offloaded to the host
over PCIe (offloaded layers, the floor spreading their copies over each phase); the last
column is how small a layer's internals would have to be (fraction of what its autograd saves, i.e.
op-level selective checkpointing) for the offload floor to allow 1.35x over MegaTrain.

A third table keeps each scenario's batch per optimizer step (the paper's LazyTrain batch) and lets the
planner choose the micro-batch, gradient accumulation filling the batch (search_micro_batch with
global_batch, as a config's train_batch_size fixes it): the optimizer's step is the same, while smaller
micro-batches let more layers keep their internals. MegaTrain runs gradient accumulation too
(its configs' gradient_accumulation_steps), so it is given the same choice: its best micro-batch in its
executor's model, for its paper batch a step or for ours (on the RTX 3090 ours is larger, and the model
fits MegaTrain there), beside MegaTrain as the paper ran it. Speed-ups are in
tokens/s; the band (against MegaTrain's best) holds both choices fixed over the calibration band. The last line is the minimum of this
table's speed-ups over MegaTrain's best.

    python3 benchmarks/planner_paper.py [--calibrate] [--time-limit 10] [--only h800] [--skip-fixed]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lazytrain.planner.ceiling import internals_fraction_for, step_floor          # noqa: E402
from lazytrain.planner.hardware import CATALOG                                    # noqa: E402
from lazytrain.planner.milp import MilpOptions                                    # noqa: E402
from lazytrain.planner.policies import (PAPER, PAPER_GPU_CAP, PAPER_SEQ, best_interval_plan,  # noqa: E402
                                        calibrate, calibration_band, megatrain_errors, megatrain_host_memory_errors,
                                        megatrain_memory_errors,
                                        prediction_band, simulate_megatrain)
from lazytrain.planner.problem import Budgets, Problem                            # noqa: E402
from lazytrain.planner.search import search_micro_batch, solve                     # noqa: E402
from lazytrain.planner.simulate import simulate                                   # noqa: E402
from lazytrain.planner.models import catalog_model                               # noqa: E402

SHORT = {"qwen2.5-3b": "3B", "qwen2.5-7b": "7B", "qwen2.5-14b": "14B", "paper-27b": "27B"}


def fmt_table(header, rows):
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells[0])) + " |",
           "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += ["| " + " | ".join(c.rjust(w[i]) if i > 1 else c.ljust(w[i]) for i, c in enumerate(r)) + " |"
            for r in cells[1:]]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="re-run the h800 calibration (about 30 s)")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--only", default=None, help="h800 or rtx3090")
    ap.add_argument("--skip-fixed", action="store_true",
                    help="only the calibration and the table at the paper's batch per step, micro-batch chosen")
    args = ap.parse_args()
    opts = MilpOptions(time_limit_s=args.time_limit)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print("\n### Calibration (MegaTrain's executor vs the paper's measured MegaTrain tokens/s and peak GPU memory)")
    bands = {}
    for gpu in ("h800", "rtx3090"):
        hw = CATALOG[gpu]
        if args.calibrate and gpu == "h800":
            t0 = time.perf_counter()
            fitted, errs = calibrate(hw, gpu)
            print(f"re-fit {gpu}: achievable_tflops={fitted.achievable_tflops}, "
                  f"host_optimizer_gparams_per_s={fitted.host_optimizer_gparams_per_s} "
                  f"({time.perf_counter() - t0:.0f} s)")
        errs = megatrain_errors(hw, gpu)
        print(f"{gpu} (achievable {hw.achievable_tflops} TFLOPS, optimizer {hw.host_optimizer_gparams_per_s} "
              f"Gparams/s, PCIe {hw.h2d_gbps} GB/s): step-time residuals (tokens/s) " +
              ", ".join(f"{SHORT[m]} {e * 100:+.1f}%" for m, e in errs.items()) +
              f"; largest |error| {max(abs(e) for e in errs.values()) * 100:.1f}%")
        mem = megatrain_memory_errors(hw, gpu)
        print(f"{gpu} peak GPU memory residuals (MegaTrain's model vs the paper's GiB): " +
              ", ".join(f"{SHORT[m]} {e * 100:+.1f}%" for m, e in mem.items()))
        for moments, what in ((8, "CPUAdam's fp32 moments"), (4, "torch AdamW's bf16 moments")):
            host = megatrain_host_memory_errors(hw, gpu, moments)
            print(f"{gpu} host memory residuals with {what} (MegaTrain's model after the step, its gradients "
                  f"freed, vs the paper's CPU GiB, RSS): " + ", ".join(f"{SHORT[m]} {e * 100:+.1f}%"
                                                                      for m, e in host.items()))
        if args.only and gpu != args.only:
            continue
        t0 = time.perf_counter()
        bands[gpu] = calibration_band(hw, gpu, tolerance=0.01)
        rates = sorted({b.host_optimizer_gparams_per_s for b, _ in bands[gpu]})
        tfl = sorted({b.achievable_tflops for b, _ in bands[gpu]})
        print(f"{gpu} band (largest |error| within {bands[gpu][0][1] * 100:.1f}% + 1 point): {len(bands[gpu])} "
              f"calibrations, achievable {tfl[0]}-{tfl[-1]} TFLOPS, optimizer {rates[0]}-{rates[-1]} Gparams/s "
              f"({time.perf_counter() - t0:.0f} s)")

    header = ["GPU", "model", "batch", "MegaTrain s", "best interval s (k)", "ours s", "ours / MegaTrain",
              "band (low-high)", "ours / best interval", "ours / bound", "MegaTrain / bound", "solve s", "status",
              "ours tok/s", "paper LazyTrain tok/s", "pred. err", "paper speedup", "ours GPU GB", "homes hbm/host/nvme/rec/graph", "selective",
              "offloaded"]
    rows, speedups, solves, floors = [], [], [], []
    for (gpu, model), sysrows in PAPER.items():
        if args.only and gpu != args.only or args.skip_fixed:
            continue
        hw = CATALOG[gpu]
        batch = sysrows["lazytrain"][0]
        p = Problem(model=catalog_model(model), hardware=hw, budgets=Budgets.of(gpu=PAPER_GPU_CAP[gpu]),
                    micro_batch=batch, seq_len=PAPER_SEQ)
        mt = simulate_megatrain(p)
        bi = best_interval_plan(p)
        t0 = time.perf_counter()
        plan = solve(p, opts)
        wall = time.perf_counter() - t0
        ours = simulate(p, plan, timeline=False)
        info = plan.prediction["solver"]
        lb = p.lower_bound_s()["bound"]
        paper_lt = sysrows["lazytrain"][4]
        paper_speed = sysrows["lazytrain"][4] / sysrows["megatrain"][4]
        mt_note = "" if not mt.violations else " (over cap)"
        speedups.append((gpu, model, mt.step_time_s / ours.step_time_s))

        def speedup_at(h, model=model, batch=batch, gpu=gpu, plan=plan):
            q = Problem(model=catalog_model(model), hardware=h, budgets=Budgets.of(gpu=PAPER_GPU_CAP[gpu]),
                        micro_batch=batch, seq_len=PAPER_SEQ, check=False)
            return (simulate_megatrain(q).step_time_s
                    / simulate(q, plan, strict=False, timeline=False).step_time_s)
        _, low, high = prediction_band(bands[gpu], speedup_at)
        solves.append(wall)
        rows.append([gpu, SHORT[model], batch, f"{mt.step_time_s:.3f}{mt_note}",
                     f"{bi[1].step_time_s:.3f} ({bi[0].policy.split('-')[1]})" if bi else "does not fit",
                     f"{ours.step_time_s:.3f}", f"{mt.step_time_s / ours.step_time_s:.3f}x",
                     f"{low:.3f}-{high:.3f}x",
                     f"{bi[1].step_time_s / ours.step_time_s:.3f}x" if bi else "-",
                     f"{ours.step_time_s / lb:.3f}", f"{mt.step_time_s / lb:.3f}",
                     f"{wall:.2f}", info["status"], f"{ours.tokens_per_s:.0f}", f"{paper_lt:.0f}",
                     f"{ours.tokens_per_s / paper_lt - 1:+.1%}", f"{paper_speed:.3f}x",
                     f"{ours.peak_bytes['hbm'] / 1e9:.1f}",
                     "{hbm}/{host}/{nvme}/{recompute}/{graph}".format(**ours.boundaries_per_home),
                     ours.selective_layers, ours.offloaded_layers])
        floors.append((gpu, model, batch, p, mt.step_time_s, ours.step_time_s))
        print(f"  planned {gpu} {model}: {wall:.2f} s", file=sys.stderr)
    if rows:
        print("\n### Step time at the paper's LazyTrain batch as one micro-batch (seq 1024; h800 cap 70 GB, rtx3090 24 GiB)")
        print(fmt_table(header, rows))

    if floors:
        floor_table(floors)

    accum_speedups = global_batch_table(args, opts, bands)

    if (not args.only or args.only == "rtx3090") and not args.skip_fixed:
        print("\n### rtx3090: largest micro-batch our plan fits in 24 GiB (outer search)")
        srows = []
        for (gpu, model), sysrows in PAPER.items():
            if gpu != "rtx3090":
                continue
            t0 = time.perf_counter()
            best, trials = search_micro_batch(catalog_model(model), CATALOG[gpu], Budgets.of(gpu=PAPER_GPU_CAP[gpu]),
                                              PAPER_SEQ, opts, max_batch=512)
            feasible = max(t.micro_batch for t in trials if t.tokens_per_s)
            srows.append([gpu, SHORT[model], sysrows["lazytrain"][0], feasible, best.micro_batch_size,
                          f"{best.prediction['tokens_per_s']:.0f}", f"{sysrows['lazytrain'][4]:.0f}",
                          "yes" if feasible >= sysrows["lazytrain"][0] else "NO",
                          f"{time.perf_counter() - t0:.1f}"])
        print(fmt_table(["GPU", "model", "paper LazyTrain batch", "largest feasible batch", "best batch",
                         "ours tok/s at best", "paper LazyTrain tok/s", "goal met", "search s"], srows))

    if (not args.only or args.only == "h800") and not args.skip_fixed:
        print("\n### 27B on h800 with the paper's tier budgets (activations: host 15 GB or 8 GB free, NVMe 32 GB)")
        prow = []
        for cpu_gb, paper_homes in ((15, "30/21/1/13"), (8, "30/11/11/13")):
            base = Problem(model=catalog_model("paper-27b"), hardware=CATALOG["h800"],
                           budgets=Budgets.of(gpu="70GB"), micro_batch=72, seq_len=PAPER_SEQ)
            p = Problem(model=base.model, hardware=base.hardware, micro_batch=72, seq_len=PAPER_SEQ,
                        budgets=Budgets(gpu_bytes=70 * 10 ** 9, host_bytes=int(base.host_static + cpu_gb * 1e9),
                                        nvme_bytes=32 * 10 ** 9))
            t0 = time.perf_counter()
            plan = solve(p, opts)
            wall = time.perf_counter() - t0
            pr, info = plan.prediction, plan.prediction["solver"]
            mt = simulate_megatrain(p)
            prow.append([f"{cpu_gb} GB", "{hbm}/{host}/{nvme}/{recompute}/{graph}".format(**pr["boundaries_per_home"]),
                         pr["offloaded_layers"], paper_homes, f"{pr['step_time_s']:.3f}", f"{mt.step_time_s / pr['step_time_s']:.3f}x",
                         f"{pr['peak_bytes']['nvme'] / 1e9:.1f}", f"{wall:.2f}",
                         info["status"] + (f" (gap {info['gap']:.2%})" if info["status"] == "feasible" else "")])
        print(fmt_table(["host free", "ours hbm/host/nvme/rec/graph", "ours offloaded", "paper gpu/cpu/nvme/rec", "ours s",
                         "ours / MegaTrain", "NVMe GB", "solve s", "status"], prow))

    print("\n### Goals")
    if speedups:
        met = [s >= 1.35 for _, _, s in speedups]
        print(f"the paper's batch as one micro-batch: ours >= 1.35x MegaTrain: {sum(met)}/{len(met)} scenarios "
              f"(range {min(s for *_, s in speedups):.3f}x - {max(s for *_, s in speedups):.3f}x)")
        print(f"solve time <= 10 s: {sum(s <= 10 for s in solves)}/{len(solves)} (max {max(solves):.2f} s)")
    met = [s >= 1.35 for *_, s in accum_speedups]
    print(f"the paper's batch per step, micro-batch chosen: ours >= 1.35x MegaTrain's best micro-batch: "
          f"{sum(met)}/{len(met)} scenarios (range {min(s for *_, s in accum_speedups):.3f}x - "
          f"{max(s for *_, s in accum_speedups):.3f}x)")
    h800_27b = [s for gpu, model, s in accum_speedups if (gpu, model) == ("h800", "paper-27b")]
    if h800_27b:
        print(f"h800 27B >= 1.5x: {'yes' if h800_27b[0] >= 1.5 else 'NO'} ({h800_27b[0]:.3f}x)")
    print(f"min speed-up vs MegaTrain over the {len(accum_speedups)} scenarios: {min(x for *_, x in accum_speedups):.2f}x")
    return 0


def floor_table(floors: list) -> None:
    """The second table (module docstring): each scenario's step floors at the paper's batch."""
    print("\n### How fast could any plan be? Step floors (LP relaxation, planner/ceiling.py) at the same batch")
    frows = []
    for gpu, model, batch, p, mt_s, ours_s in floors:
        graph, off = step_floor(p), step_floor(p, offload=True)
        frac = internals_fraction_for(p, mt_s, 1.35)
        frows.append([gpu, SHORT[model], batch, f"{mt_s:.3f}", f"{ours_s:.3f}", f"{mt_s / ours_s:.3f}x",
                      f"{graph.step_s:.3f}", f"{graph.speedup_over(mt_s):.3f}x", f"{ours_s / graph.step_s:.3f}",
                      f"{graph.kept_layers:.1f}/{graph.selective_layers:.1f}", f"{off.step_s:.3f}",
                      f"{off.speedup_over(mt_s):.3f}x",
                      f"{off.kept_layers:.1f}/{off.offloaded_layers:.1f}/{off.selective_layers:.1f}",
                      "any" if frac == 1.0 else ("none" if frac is None else f"<= {frac:.2f}")])
    print(fmt_table(["GPU", "model", "batch", "MegaTrain s", "ours s", "ours / MegaTrain",
                     "floor: keep, selective or re-run s", "its ceiling vs MegaTrain", "ours / that floor",
                     "layers kept/selective", "floor: + offload s", "its ceiling vs MegaTrain",
                     "layers kept/offloaded/selective", "internals fraction for 1.35x"], frows))


def megatrain_best(model, hw, cap: str, paper_batch: int, our_batch: int) -> tuple[float, int, int]:
    """MegaTrain's tokens/s at its best micro-batch in its executor's model, and that micro-batch x its
    accumulation: for its paper batch a step, or for ours (the RTX 3090's differ: the paper ran MegaTrain
    at a batch it fits, which its model underestimates), gradient accumulation filling the batch. Its
    paper batch as one micro-batch counts even where the memory model puts it over the cap (the paper ran
    it); every other choice must fit."""
    best = (0.0, paper_batch, 1)
    for batch in sorted({paper_batch, our_batch}):
        for mb in (d for d in range(1, batch + 1) if batch % d == 0):
            p = Problem(model=model, hardware=hw, budgets=Budgets.of(gpu=cap), micro_batch=mb, seq_len=PAPER_SEQ,
                        grad_accum=batch // mb, check=False)
            r = simulate_megatrain(p)
            if r.violations and (mb, batch) != (paper_batch, paper_batch):
                continue
            best = max(best, (r.tokens_per_s, mb, batch // mb))
    return best


def global_batch_table(args, opts: MilpOptions, bands: dict) -> list[tuple[str, str, float]]:
    """The third table (module docstring): returns (gpu, model, ours / MegaTrain's best) per scenario."""
    print("\n### At the paper's batch per optimizer step, the micro-batch chosen (gradient accumulation fills the batch)")
    rows, out = [], []
    for (gpu, model), sysrows in PAPER.items():
        if args.only and gpu != args.only:
            continue
        hw, cap, shape = CATALOG[gpu], PAPER_GPU_CAP[gpu], catalog_model(model)
        batch, mt_batch = sysrows["lazytrain"][0], sysrows["megatrain"][0]
        t0 = time.perf_counter()
        plan, trials = search_micro_batch(shape, hw, Budgets.of(gpu=cap), PAPER_SEQ, opts, global_batch=batch)
        wall = time.perf_counter() - t0
        mb, accum = plan.micro_batch_size, batch // plan.micro_batch_size
        ours_tps = plan.prediction["tokens_per_s"]
        mt_p = Problem(model=shape, hardware=hw, budgets=Budgets.of(gpu=cap), micro_batch=mt_batch,
                       seq_len=PAPER_SEQ, check=False)
        mt_tps = simulate_megatrain(mt_p).tokens_per_s
        best_tps, mt_mb, mt_accum = megatrain_best(shape, hw, cap, mt_batch, batch)
        p = Problem(model=shape, hardware=hw, budgets=Budgets.of(gpu=cap), micro_batch=mb, seq_len=PAPER_SEQ,
                    grad_accum=accum)
        floor = step_floor(p, offload=True)
        toks = mb * accum * PAPER_SEQ

        def speedup_at(h, shape=shape, mb=mb, accum=accum, plan=plan, gpu=gpu, mt_mb=mt_mb, mt_accum=mt_accum):
            q = Problem(model=shape, hardware=h, budgets=Budgets.of(gpu=PAPER_GPU_CAP[gpu]), micro_batch=mb,
                        seq_len=PAPER_SEQ, grad_accum=accum, check=False)
            m = Problem(model=shape, hardware=h, budgets=Budgets.of(gpu=PAPER_GPU_CAP[gpu]), micro_batch=mt_mb,
                        seq_len=PAPER_SEQ, grad_accum=mt_accum, check=False)
            return simulate(q, plan, strict=False, timeline=False).tokens_per_s / simulate_megatrain(m).tokens_per_s
        _, low, high = prediction_band(bands[gpu], speedup_at)
        solved = [t for t in trials if t.tokens_per_s]
        skipped = [t for t in trials if t.status.startswith("skipped")]
        out.append((gpu, model, ours_tps / best_tps))
        rows.append([gpu, SHORT[model], batch, f"{mb} x {accum}", f"{mt_tps:.0f}", f"{best_tps:.0f} ({mt_mb} x {mt_accum})",
                     f"{ours_tps:.0f}", f"{ours_tps / mt_tps:.3f}x", f"{ours_tps / best_tps:.3f}x",
                     f"{low:.3f}-{high:.3f}x", f"{toks / floor.step_s / best_tps:.3f}x",
                     plan.prediction["solver"]["status"], len(solved), len(skipped), f"{wall:.0f}",
                     "{hbm}/{host}/{nvme}/{recompute}/{graph}".format(**plan.prediction["boundaries_per_home"]),
                     len(plan.resident_layers), plan.prediction["selective_layers"],
                     plan.prediction["offloaded_layers"]])
        print(f"  searched {gpu} {model}: {wall:.0f} s", file=sys.stderr)
    print(fmt_table(["GPU", "model", "batch/step", "ours micro x accum", "MegaTrain tok/s (paper batch)",
                     "MegaTrain best tok/s (micro x accum)", "ours tok/s", "ours / MegaTrain", "ours / MegaTrain best",
                     "band (low-high)", "floor at ours / MegaTrain best", "status", "MILPs", "skipped by floor",
                     "search s", "homes hbm/host/nvme/rec/graph", "resident", "selective", "offloaded"], rows))
    return out


if __name__ == "__main__":
    sys.exit(main())
