"""Policy "auto" on this CPU: the plan it makes from its own measurements, beside fixed plans.

The model, data and emulated links of ``benchmarks/fidelity_cpu.py`` (a 2.6M-parameter Llama, batch 4 x
seq 512, fp32, one compute thread; h2d and d2h copies on links of ``--gbps`` each way). Three engines train
the same steps in turn: policy "auto" (keep-all calibration for its warm-up and measured steps, then the
MILP's plan from what it measured, selective layers included unless ``--no-selective``), MegaTrain's policy (every 4th boundary on the device, the rest re-run)
and keep-all on the host. The device budget is halfway between the peaks of MegaTrain's policy and of
every boundary on the device (memory does not depend on timings: it comes from the model's shape), so the
MILP must choose. Printed: auto's plan and its prediction beside its measured step, and each engine's
median step over the steps after auto's plan took over. The last line is
``auto vs MegaTrain's policy: X.XXXx measured, Y.YYYx predicted``.

    python benchmarks/auto_plan_cpu.py [--gbps 0.05] [--latency-ms 0.05] [--layers 8] [--steps 6] [--no-selective]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fidelity_cpu import BATCH, SEQ, batches, build_model, engine_for, train_step  # noqa: E402

warnings.filterwarnings("ignore")
WARMUP, PROFILE = 3, 2


def halfway_budget(model) -> int:
    """Device bytes halfway between MegaTrain's policy's peak and every boundary's on the device."""
    from lazytrain.planner.hardware import GiB, HardwareProfile
    from lazytrain.planner.plan import keep_all_plan
    from lazytrain.planner.policies import megatrain_plan
    from lazytrain.planner.problem import Budgets, Problem
    from lazytrain.planner.search import as_model_shape
    from lazytrain.planner.simulate import simulate
    cfg = model.config.to_dict()
    cfg["layer_params"] = [sum(p.numel() for p in b.parameters()) for b in model.model.layers]
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    hw = HardwareProfile("any", achievable_tflops=1.0, h2d_gbps=1.0, d2h_gbps=1.0, host_optimizer_gparams_per_s=1.0,
                         gpu_mem_bytes=64 * GiB, host_mem_bytes=64 * GiB)
    p = Problem(as_model_shape(cfg), hw, Budgets(gpu_reserved_bytes=0), BATCH, SEQ)
    return (simulate(p, keep_all_plan(p.L, home="hbm")).peak_bytes["hbm"] +
            simulate(p, megatrain_plan(p)).peak_bytes["hbm"]) // 2


def run(base, section: dict, data) -> tuple[list[float], object]:
    engine = engine_for(copy.deepcopy(base), section)
    times = []
    for ids in data:
        t0 = time.perf_counter()
        train_step(engine, ids)
        times.append(time.perf_counter() - t0)
    engine.wait_for_update()
    return times, engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=0.05, help="emulated h2d and d2h bandwidth, GB/s")
    ap.add_argument("--latency-ms", type=float, default=0.05, help="emulated latency per transfer")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="steps measured after auto's plan took over")
    ap.add_argument("--milp-seconds", type=float, default=20.0)
    ap.add_argument("--no-selective", dest="selective", action="store_false",
                    help="auto measures no selective layers (and plans none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = build_model(args.layers)
    # the plain calibration's steps, then (selective) one warm-up and as many traced with every layer selective
    measuring = WARMUP + PROFILE + (1 + PROFILE if args.selective else 0)
    data = batches(measuring + args.steps)
    budget = halfway_budget(base)
    links = {k: {"gbps": args.gbps, "latency_ms": args.latency_ms} for k in ("h2d", "d2h")}
    common = {"gpu_memory": budget, "testing": {"copy_threads": True, "links": links}}
    print(f"model: LlamaForCausalLM {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params, {args.layers} "
          f"layers, batch {BATCH} x seq {SEQ}, fp32, torch {torch.__version__}, 1 compute thread; links {args.gbps} "
          f"GB/s each way, {args.latency_ms} ms per transfer; device budget {budget / 1e6:.1f} MB")
    engines = {
        "auto": {"policy": "auto", "milp_time_limit": args.milp_seconds,
                 "auto": {"warmup_steps": WARMUP, "profile_steps": PROFILE, "check_every": args.steps,
                          "max_replans": 0, "selective": args.selective}},
        "MegaTrain's policy (k=4, device)": {"policy": "every_k", "checkpoint_interval": 4, "boundary_home": "hbm",
                                             "last_segment_graph": False},
        "keep-all (host)": {"policy": "keep_all", "boundary_home": "host", "last_segment_graph": False},
    }
    medians, auto_engine = {}, None
    for name, section in engines.items():
        times, engine = run(base, {**common, **section}, data)
        medians[name] = statistics.median(times[measuring:])
        if name == "auto":
            auto_engine = engine
        else:
            engine.destroy()
    record = auto_engine.auto.history[0]
    plan, profile = auto_engine.plan, auto_engine.auto.last_profile
    print(f"\nauto's plan: boundaries {' '.join(plan.homes)}, last segment graph {plan.last_segment_graph}, "
          f"selective layers {list(plan.selective_layers)}, offloaded layers {list(plan.offloaded_layers)}; "
          f"measured links {', '.join(f'{k} {v:.4f} GB/s' for k, v in profile.links_gbps.items())}")
    print(f"auto: predicted {record.predicted_step_s * 1e3:.0f} ms/step, measured {record.measured_step_s * 1e3:.0f} "
          f"ms/step over {record.measured_steps} steps ({record.measured_step_s / record.predicted_step_s:.3f}x)")
    predicted_mega = _predicted_megatrain(profile, budget)
    auto_engine.destroy()
    print(f"\n{'engine':<36}{'median step (ms)':>18}")
    for name, m in medians.items():
        print(f"{name:<36}{m * 1e3:>18.0f}")
    mega = medians["MegaTrain's policy (k=4, device)"]
    print(f"MegaTrain's policy predicted on auto's profile: {predicted_mega * 1e3:.0f} ms/step")
    print(f"auto vs MegaTrain's policy: {mega / medians['auto']:.3f}x measured, "
          f"{predicted_mega / record.predicted_step_s:.3f}x predicted")
    return 0


def _predicted_megatrain(profile, budget: int) -> float:
    """MegaTrain's policy (as LazyTrain's engine runs it) on the problem auto planned, as predicted."""
    from lazytrain.planner.policies import megatrain_plan
    from lazytrain.planner.search import profile_problem
    from lazytrain.planner.simulate import simulate
    p = profile_problem(profile, {"gpu": budget, "gpu_reserved_bytes": 0, "loss_chunk_tokens": BATCH * SEQ})
    return simulate(p, megatrain_plan(p), strict=False).step_time_s


if __name__ == "__main__":
    sys.exit(main())
