"""Plans run against their predictions on this CPU: does the planner's cost model say what the engine does?

One process, one small Llama (transformers, fp32), the CPU standing in for a GPU whose links are slow:

1. Calibration: the engine trains a few steps keeping every boundary, with copy threads and unlimited
   links; its traced steps give each layer's forward and backward, the rest of the model, the step's
   serial host phase and each layer's update (``MeasuredCosts.from_traces``); the same with every layer
   selective gives a selective layer's forward and re-run (``measured.with_selective``). With the emulated links'
   bandwidths that is this machine's hardware profile.
2. Six plans for that profile: MegaTrain's policy (every 4th boundary kept on the device, all else
   re-run, the update after the step), the same with every layer selective (its re-runs take the
   forward's matmul and attention outputs; its forward and re-run measured in calibration too), keep-all
   (every boundary offloaded to the host and fetched back), every layer but the last offloaded (the
   tensors its autograd saves go to the host in its forward and come back for its backward), the same with
   those copies split over several windows each (Plan.internals_offload_shares) and the MILP's
   plan within a device budget halfway between the peaks of MegaTrain's policy and of keeping every
   boundary on the device; then two with gradient accumulation (``--accumulation`` micro-batches a step,
   one optimizer step after them): keep-all with half the layers resident (the first micro-batch
   refreshes their device copies after the update, the later ones find them current) and the MILP's plan
   for that step.
3. Each runs in the engine with the same emulated links (copy threads limited to ``--gbps`` per
   direction, ``--latency-ms`` per transfer), and its measured step (median of ``--steps`` after
   ``--warmup``) is printed beside the simulator's prediction for it. The shared cores of a VM change speed
   over minutes, and a calibration taken once, minutes before a plan runs, carries that drift into the
   comparison; so each plan's prediction is also made from calibration steps run right before and right
   after its own (``--bracket-steps`` traced steps of each calibration plan on each side, medians over
   both sides), and both are printed: "predicted" (bracketed) and "first calibration".

With ``--frozen-bottom N`` the embedding and blocks 0..N-1 are frozen (training the top blocks): the backward
stops at block N, the calibration measures no backward below it, and the plans are made and predicted for
that (``Budgets.frozen_bottom_layers``); the plans that offload or make layers selective do so from block N on.

The compute runs on one thread and the layer updates on another (``torch.set_num_threads(1)``), so the
two cores stand for the GPU and the host as the cost model has them; copies on the emulated links mostly
sleep. The last line is ``worst |measured/predicted - 1|: X%``.

    python benchmarks/fidelity_cpu.py [--gbps 0.05] [--latency-ms 0.05] [--nvme-gbps 0.05] [--steps 6]
                                      [--warmup 2] [--layers 8] [--traces DIR] [--frozen-bottom N]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")

BATCH, SEQ, VOCAB, HIDDEN, FFN, HEADS = 4, 512, 4096, 128, 344, 4


def build_model(layers: int, frozen_bottom: int = 0):
    """The Llama, with its embedding and its first ``frozen_bottom`` blocks frozen when that is > 0."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(cfg)
    if frozen_bottom:
        for p in [*model.model.embed_tokens.parameters(), *model.model.layers[:frozen_bottom].parameters()]:
            p.requires_grad_(False)
    return model


def batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def engine_for(model, lazytrain_section: dict, accumulation: int = 1):
    import lazytrain
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": accumulation,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "lazytrain": {"device": "cpu", **lazytrain_section}}
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=cfg)
    return engine


def train_step(engine, ids):
    logits = engine(ids[:, :-1]).logits
    engine.backward(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))
    engine.step()


def calibrate(base, data, warmup: int, traced: int):
    """MeasuredCosts of this model on this machine, from traced steps that keep every boundary; then the
    selective layers' forward and re-run from traced steps of the same plan with every layer selective."""
    return costs_of(base, *calibration_traces(base, data, warmup, traced))


def costs_of(base, plain_traces: list, selective_traces: list):
    from lazytrain.planner.measured import MeasuredCosts, with_selective
    costs = MeasuredCosts.from_traces(plain_traces, len(base.model.layers), source="this CPU, 1 compute thread")
    return with_selective(costs, selective_traces)


def calibration_traces(base, data, warmup: int, traced: int) -> tuple[list, list]:
    """Traced steps of the two calibration plans: every boundary kept; the same with every layer selective."""
    from lazytrain.planner.plan import keep_all_plan
    L = len(base.model.layers)

    def traced_steps(section):
        engine = engine_for(copy.deepcopy(base), section)
        traces = []
        for i, ids in enumerate(data[:warmup + traced]):
            if i >= warmup:
                engine.trace_next_step()
            train_step(engine, ids)
            if i >= warmup:
                traces.append(engine.last_trace)
        engine.wait_for_update()
        engine.destroy()
        return traces
    common = {"overlap_optimizer": True, "testing": {"copy_threads": True}}
    plain = traced_steps({"policy": "keep_all", "boundary_home": "hbm", "last_segment_graph": False, **common})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "selective.json")
        dataclasses.replace(keep_all_plan(L, home="hbm"), selective_layers=tuple(range(L))).to_json(path)
        return plain, traced_steps({"policy": "plan", "plan": path, **common})


def profile_of(costs, model_cfg, links_gbps: float, nvme_gbps: float | None = None):
    """This machine as the planner sees it: links as emulated, compute and updates as measured (the
    FLOP rate and the optimizer rate below are informative: the measured times replace them)."""
    from lazytrain.planner.hardware import GiB, HardwareProfile
    from lazytrain.planner.search import as_model_shape
    shape = as_model_shape(model_cfg)
    T = BATCH * SEQ
    flops = sum(3 * layer.fwd_flops_per_token(SEQ) * T for layer in shape.layers)
    rate = flops / sum(costs.diff_s)
    params = sum(layer.params for layer in shape.layers)
    return shape, HardwareProfile(
        name=f"this CPU, links {links_gbps} GB/s", achievable_tflops=rate / 1e12,
        h2d_gbps=links_gbps, d2h_gbps=links_gbps, nvme_read_gbps=nvme_gbps, nvme_write_gbps=nvme_gbps,
        host_optimizer_gparams_per_s=params / sum(costs.update_s) / 1e9, gpu_mem_bytes=64 * GiB,
        host_mem_bytes=64 * GiB)


def spread_copies(plan, out: int, back: int):
    """``plan`` with each offloaded layer's internals copied out in equal shares over its forward window and
    the next ``out - 1`` (within the forward), and back in equal shares over the ``back`` windows before
    its backward."""
    L, outs, backs = plan.num_layers, {}, {}
    for j in plan.offloaded_layers:
        ws = range(j, min(j + out, L))
        outs[j] = {w: 1 / len(ws) for w in ws}
        ws = range(max(L, 2 * L - 1 - j - back), 2 * L - 1 - j)
        backs[j] = {w: 1 / len(ws) for w in ws}
    return dataclasses.replace(plan, policy=plan.policy + "-split", internals_offload_shares=outs,
                               internals_prefetch_shares=backs)


def accumulation_of(plan) -> int:
    """Micro-batches a step the plan was made for (1 unless its prediction says)."""
    return int(plan.prediction.get("grad_accum", 1))


def plans_for(problem, milp_seconds: float, nvme: bool = False, accumulation: int = 1):
    """The plans compared; below a frozen bottom (``problem.first_reached``) no layer is selective or
    offloaded: none has a backward to keep anything for."""
    from lazytrain.planner.milp import MilpOptions
    from lazytrain.planner.plan import keep_all_plan, offload_all_plan
    from lazytrain.planner.policies import megatrain_plan
    from lazytrain.planner.search import solve
    L, f = problem.L, problem.first_reached
    keep_all = keep_all_plan(L, home="host", micro_batch_size=BATCH, seq_len=SEQ)
    mega = megatrain_plan(problem, 4)
    offload_all = offload_all_plan(L, micro_batch_size=BATCH, seq_len=SEQ)
    if f:
        offload_all = dataclasses.replace(offload_all, offloaded_layers=tuple(j for j in offload_all.offloaded_layers
                                                                              if j >= f))
    plans = {"MegaTrain (k=4, update after the step)": mega, "keep-all (host)": keep_all,
             # its policy with every layer selective: re-runs take the forward's matmul and attention outputs
             "MegaTrain's policy, all layers selective": dataclasses.replace(
                 mega, policy="megatrain-k4-selective", selective_layers=tuple(range(f, L))),
             # every layer but the last sends its autograd internals to the host and back, none re-run
             "every layer offloaded (offload_all)": offload_all,
             # the same with each layer's copies split: out over its forward window and the next three, back
             # over the two windows before its backward
             "every layer offloaded, copies split over windows": spread_copies(offload_all, out=4, back=2)}
    if nvme:
        plans["keep-all (NVMe)"] = keep_all_plan(L, home="nvme", micro_batch_size=BATCH, seq_len=SEQ)
    plans["MILP"] = solve(problem, MilpOptions(time_limit_s=milp_seconds))
    if accumulation > 1:
        k = accumulation
        plans[f"keep-all (host), layers 0-{L // 2 - 1} resident, {k} micro-batches a step"] = dataclasses.replace(
            keep_all, policy="keep-all-host-resident", resident_layers=tuple(range(L // 2)),
            prediction={"grad_accum": k})
        plans[f"MILP, {k} micro-batches a step"] = solve(dataclasses.replace(problem, grad_accum=k),
                                                         MilpOptions(time_limit_s=milp_seconds))
    return plans


def measure(base, plan, data, warmup: int, links: dict, trace_path: str | None, nvme_path: str | None = None):
    """Median seconds of an optimizer step (its micro-batches, accumulation_of(plan) of them) after
    ``warmup`` steps; ``data`` holds one batch per step (a step's micro-batches reuse it)."""
    k = accumulation_of(plan)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan.json")
        plan.to_json(path)
        section = {"policy": "plan", "plan": path, "overlap_optimizer": plan.overlap_optimizer,
                   "testing": {"copy_threads": True, "links": links}}
        if nvme_path:
            section["nvme_path"] = nvme_path
        engine = engine_for(copy.deepcopy(base), section, accumulation=k)
    times = []
    for i, ids in enumerate(data):
        if trace_path and i == len(data) - 1:
            engine.trace_next_step(trace_path)
        t0 = time.perf_counter()
        for _ in range(k):
            train_step(engine, ids)
        if i >= warmup and not (trace_path and i == len(data) - 1):
            times.append(time.perf_counter() - t0)
    engine.wait_for_update()
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=0.05, help="emulated h2d and d2h bandwidth, GB/s")
    ap.add_argument("--latency-ms", type=float, default=0.05, help="emulated latency per transfer")
    ap.add_argument("--nvme-gbps", type=float, default=None,
                    help="also an NVMe tier (a temporary directory) whose reads and writes run at this emulated "
                         "bandwidth, a keep-all plan on it, and NVMe in the MILP's choices")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibration-steps", type=int, default=5)
    ap.add_argument("--bracket-steps", type=int, default=3,
                    help="traced steps of each calibration plan right before and right after each plan's run, "
                         "for its bracketed prediction (0: none)")
    ap.add_argument("--milp-seconds", type=float, default=20.0)
    ap.add_argument("--accumulation", type=int, default=2,
                    help="micro-batches a step of the two accumulating plans (1: leave them out)")
    ap.add_argument("--traces", help="write each plan's predicted and measured step as Chrome traces here")
    ap.add_argument("--frozen-bottom", type=int, default=0,
                    help="freeze the embedding and this many bottom blocks (train the top ones)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from lazytrain.planner.plan import keep_all_plan
    from lazytrain.planner.policies import megatrain_plan
    from lazytrain.planner.problem import Budgets, Problem
    from lazytrain.planner.simulate import simulate
    from lazytrain.trace import write_chrome_trace

    base = build_model(args.layers, args.frozen_bottom)
    n = sum(p.numel() for p in base.parameters())
    data = batches(max(args.warmup + args.steps + 1, args.warmup + args.calibration_steps))
    print(f"model: LlamaForCausalLM {n / 1e6:.1f}M params, {args.layers} layers, hidden {HIDDEN}, batch {BATCH} x "
          f"seq {SEQ}, fp32, torch {torch.__version__}, 1 compute thread; links {args.gbps} GB/s each way, "
          f"{args.latency_ms} ms per transfer" + (f"; embedding and blocks 0-{args.frozen_bottom - 1} frozen"
                                                   if args.frozen_bottom else ""))
    costs = calibrate(base, data, args.warmup, args.calibration_steps)
    f0 = costs.first_differentiated   # the layers the backward reaches: f0.. (the others ran no backward)
    reached = f" (blocks {f0}-{args.layers - 1}, which the backward reaches)" if f0 else ""
    print(f"measured: forward {statistics.mean(costs.fwd_s) * 1e3:.1f} ms/layer, forward+backward "
          f"{statistics.mean(costs.diff_s[f0:]) * 1e3:.1f} ms/layer{reached}, rest of the model "
          f"{costs.nonlayer_s * 1e3:.1f} ms, step's host phase {costs.step_s * 1e3:.1f} ms, update "
          f"{statistics.mean(costs.update_s) * 1e3:.1f} ms/layer")
    print(f"selective layers: forward {statistics.mean(costs.selective_fwd_s[f0:]) * 1e3:.1f} ms/layer, re-run "
          f"{statistics.mean(costs.selective_rerun_s[f0:]) * 1e3:.1f} ms/layer (the plain re-run is the forward's)")
    model_cfg = base.config.to_dict()
    model_cfg["layer_params"] = [sum(p.numel() for p in b.parameters()) for b in base.model.layers]
    model_cfg["dtype"] = model_cfg["torch_dtype"] = "float32"   # what the engine computes and streams in
    shape, hw = profile_of(costs, model_cfg, args.gbps, args.nvme_gbps)
    if costs.saved_bytes is not None:
        estimate = Problem(shape, hw, Budgets(gpu_reserved_bytes=0), BATCH, SEQ).saved[f0:]
        print(f"saved by a layer's graph: measured {statistics.mean(costs.saved_bytes[f0:]):,.0f} bytes, the analytic "
              f"estimate {statistics.mean(estimate):,.0f} "
              f"({statistics.mean(costs.saved_bytes[f0:]) / statistics.mean(estimate):.3f}x)")
    nvme_bytes = 10**10 if args.nvme_gbps else 0
    # a device budget halfway between what MegaTrain's policy and keeping every boundary on the device
    # take at their peak: the MILP must choose what to re-run, offload or keep
    probe = Problem(shape, hw, Budgets(gpu_reserved_bytes=0, frozen_bottom_layers=args.frozen_bottom), BATCH, SEQ, measured=costs)
    peak_all = simulate(probe, keep_all_plan(probe.L, home="hbm")).peak_bytes["hbm"]
    peak_mega = simulate(probe, megatrain_plan(probe)).peak_bytes["hbm"]
    budget = Budgets(gpu_bytes=(peak_all + peak_mega) // 2, gpu_reserved_bytes=0, nvme_bytes=nvme_bytes,
                     frozen_bottom_layers=args.frozen_bottom)
    print(f"device budget {budget.gpu_bytes / 1e6:.1f} MB (MegaTrain's policy peaks at {peak_mega / 1e6:.1f} MB, "
          f"every boundary on the device at {peak_all / 1e6:.1f} MB)")
    problem = Problem(shape, hw, budget, BATCH, SEQ, measured=costs)
    links = {"h2d": {"gbps": args.gbps, "latency_ms": args.latency_ms},
             "d2h": {"gbps": args.gbps, "latency_ms": args.latency_ms}}
    if args.nvme_gbps:
        links.update({k: {"gbps": args.nvme_gbps, "latency_ms": args.latency_ms} for k in ("nvme_read", "nvme_write")})
    nvme_dir = tempfile.mkdtemp(prefix="lazytrain-fidelity-nvme-") if args.nvme_gbps else None

    rows = []
    for name, plan in plans_for(problem, args.milp_seconds, nvme=bool(args.nvme_gbps),
                                accumulation=args.accumulation).items():
        k = accumulation_of(plan)
        first = simulate(dataclasses.replace(problem, grad_accum=k), plan, strict=False).step_time_s
        before = calibration_traces(base, data, 1, args.bracket_steps) if args.bracket_steps else None
        trace = None
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")   # one file per plan, whatever its name
            trace = os.path.join(args.traces, f"{slug}-measured.json")
        measured = measure(base, plan, data[:args.warmup + args.steps + (1 if trace else 0)], args.warmup, links,
                           trace, nvme_dir)
        predicted = first
        if before is not None:   # the same problem, with this plan's own calibration from both sides
            after = calibration_traces(base, data, 1, args.bracket_steps)
            around = costs_of(base, before[0] + after[0], before[1] + after[1])
            bracketed = simulate(Problem(shape, hw, budget, BATCH, SEQ, measured=around, grad_accum=k), plan,
                                 strict=False)
            predicted = bracketed.step_time_s
        if args.traces:
            write_chrome_trace(os.path.join(args.traces, f"{slug}-predicted.json"),
                               (bracketed if before is not None else simulate(
                                   dataclasses.replace(problem, grad_accum=k), plan, strict=False)).trace())
        rows.append((name, plan, measured, predicted, first))

    width = max(len(name) for name, *_ in rows) + 2
    print(f"\n{'plan':<{width}}{'measured (ms)':>15}{'predicted (ms)':>16}{'measured/predicted':>20}"
          f"{'first calibration (ms)':>24}{'measured/first':>16}")
    for name, plan, m, p, f in rows:
        print(f"{name:<{width}}{m * 1e3:>15.0f}{p * 1e3:>16.0f}{m / p:>19.3f}x{f * 1e3:>24.0f}{m / f:>15.3f}x")
    for name, plan, _, _, _ in rows:
        print(f"{name}: boundaries {' '.join(plan.homes)}, resident layers {list(plan.resident_layers)}, "
              f"selective layers {list(plan.selective_layers)}, offloaded layers {list(plan.offloaded_layers)}, "
              f"last segment graph {plan.last_segment_graph}, "
              f"update overlapped {plan.overlap_optimizer}")
    mega = rows[0]
    milp = next(r for r in rows if r[0] == "MILP")
    print(f"\nMILP speed-up over MegaTrain's policy: measured {mega[2] / milp[2]:.3f}x, "
          f"predicted {mega[3] / milp[3]:.3f}x (first calibration {mega[4] / milp[4]:.3f}x)")
    if nvme_dir:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    print(f"worst |measured/first calibration - 1|: {max(abs(m / f - 1) for *_, m, p, f in rows) * 100:.1f}%")
    print(f"worst |measured/predicted - 1|: {max(abs(m / p - 1) for *_, m, p, f in rows) * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
