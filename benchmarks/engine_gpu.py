"""On one CUDA GPU, side by side: plain PyTorch (whole model and AdamW on the GPU, bf16 autocast) vs
LazyTrain streaming the same model's layers from host memory under several Plans (MegaTrain's every-4, every-4
overlapped and with its last segment's graph kept, keep-all on the GPU, the MILP's plan from the H200 profile,
and policy auto's plan from what it measured here after its calibration steps, with its predicted and measured
step). Median step time, tokens/s, TFLOPS (6 * N * tokens / time),
peak GPU memory and, for LazyTrain, the host optimizer's exposed time per step: the update on the
training thread plus the time the forward waited for overlapped layer updates. MegaTrain's row runs the
optimizer after backward (``overlap_optimizer: false``); the others overlap it with the next forward.

GPU peak is each system's allocated peak over a training step: plain PyTorch's over its run, LazyTrain's over
its last step (the engine resets the counter at every step; ``engine.last_step_peak_bytes``). Beside it, for
a plan the planner made (the MILP's, policy auto's), the device peak its cost model predicted
(``plan.prediction["peak_bytes"]["hbm"]``): how far the planner's memory model is from what the engine
allocates on a real GPU. With
``--trace DIR`` the last timed step of each LazyTrain row is traced (``engine.trace_next_step``): its
Chrome/Perfetto JSON goes to DIR, and its summary (per lane: compute, copies, waits by what they waited for,
the host's gradient adds, the layer updates) is printed under the table, with the update thread's busy time
and the host's threads and CPU quota, which the host-side work depends on.

    python benchmarks/engine_gpu.py [--layers 16] [--hidden 2048] [--batch 8] [--seq 1024] [--steps 5]
                                    [--trace DIR]
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=args.hidden // 128, max_position_embeddings=args.seq,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg)


def loss_of(logits, ids):
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


DEVICE = torch.device("cuda")


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(step, batches, warmup):
    times = []
    for i, ids in enumerate(batches):
        _sync()
        t0 = time.perf_counter()
        step(ids)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain(model, batches, warmup):
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)   # as the configs' AdamW

    def step(ids):
        ids = ids.to(DEVICE)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1]).logits
        loss_of(logits, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed(step, batches, warmup), {}


def engine_config(micro_batch: int, section: dict) -> dict:
    """The DeepSpeed-style config every LazyTrain row uses (bf16, AdamW, clipping), with its own
    ``lazytrain`` section."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            "lazytrain": {"device": str(DEVICE), **section}}


TRACE_DIR: str | None = None   # --trace: where each LazyTrain row's traced last step goes
TRACES: list[tuple[str, str]] = []   # (row, summary) of the traced steps, printed after the table


def train_timed(engine, batches, skip, row: str = ""):
    """Median step time after the first ``skip`` steps, and the host optimizer's median exposed time per step:
    the update on the training thread plus the time the forward waited for overlapped layer updates. With
    --trace the last step is traced (a traced step records events: it is left out of the median)."""
    opt_times = []
    traced = TRACE_DIR is not None and len(batches) - skip >= 2

    def step(ids):
        if traced and len(opt_times) == len(batches) - 1:
            engine.trace_next_step(os.path.join(TRACE_DIR, _file_name(row) + ".json"))
        ids = ids.to(engine.device)
        engine.backward(loss_of(engine(ids[:, :-1]).logits, ids))
        waited = engine.layer_updates.waited_seconds if engine.layer_updates is not None else 0.0
        engine.step()
        opt_times.append(engine.last_optimizer_seconds + waited)
    t = timed(step, batches[:-1] if traced else batches, skip)
    if traced:
        step(batches[-1].clone())
        _sync()
        engine.wait_for_update()
        busy = engine.layer_updates.busy_seconds if engine.layer_updates is not None else None
        TRACES.append((row, engine.last_trace.summary() + (f"\nupdate thread busy {busy * 1e3:.1f} ms (last step)"
                                                           if busy is not None else "")))
    return t, statistics.median(opt_times[skip:len(opt_times) - 1 if traced else None])   # the traced step left out


def _file_name(row: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in row.lower()).strip("-") or "row"


def _host_facts() -> str:
    """What the host-side work (gradient adds, the optimizer) runs on."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota = f.read().strip()
    except OSError:
        quota = "unknown"
    return (f"host: {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable, torch threads "
            f"{torch.get_num_threads()}, cgroup cpu.max {quota}")


def streamed(model, batches, warmup, section, row=""):
    import lazytrain
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(),
                                           config=engine_config(batches[0].shape[0], section))
    t, optimizer_s = train_timed(engine, batches, warmup, row)
    info = {"optimizer_s": optimizer_s, "cuda_peak": engine.last_step_peak_bytes.get("cuda_allocated"),
            "plan": engine.plan.policy + (" +overlap" if engine.layer_updates is not None else ""),
            "kept": len(engine.plan.kept), "resident": len(engine.plan.resident_layers),
            "planned_peak": planned_peak(engine.plan)}
    engine.destroy()
    return t, info


def auto_streamed(model, batches, warmup, steps, seq, row=""):
    """Policy auto: its calibration steps (plain, then with layers selective), its plan, then ``steps``
    steps on that plan, timed; its own comparison of predicted and measured step is in the plan info."""
    import lazytrain
    calibration = AUTO["warmup_steps"] + AUTO["profile_steps"] + 1 + AUTO["profile_steps"]
    section = {"policy": "auto", "seq_len": seq, "gpu_memory": "40GB", "milp_time_limit": 10,
               "auto": {**AUTO, "check_every": steps}}
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(),
                                           config=engine_config(batches[0].shape[0], section))
    data = (batches * (1 + (calibration + warmup + steps) // len(batches)))[:calibration + warmup + steps]
    t, optimizer_s = train_timed(engine, data, calibration + warmup, row)
    record = engine.auto.history[-1] if engine.auto.history else None
    info = {"plan": engine.plan.policy + (" +overlap" if engine.layer_updates is not None else "")
            + (f" predicted {record.predicted_step_s:.3f}s, measured {record.measured_step_s:.3f}s by auto"
               if record and record.measured_step_s and record.predicted_step_s else ""),
            "kept": len(engine.plan.kept), "resident": len(engine.plan.resident_layers),
            "optimizer_s": optimizer_s, "cuda_peak": engine.last_step_peak_bytes.get("cuda_allocated"),
            "planned_peak": planned_peak(engine.plan)}
    engine.destroy()
    return t, info


def planned_peak(plan) -> float | None:
    """The device bytes the planner's cost model predicted for ``plan`` at its peak, when it predicted any."""
    peak = (plan.prediction or {}).get("peak_bytes") or {}
    return peak.get("hbm")


AUTO = {"warmup_steps": 2, "profile_steps": 2, "selective": True, "max_replans": 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-milp", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu for a quick smoke run")
    ap.add_argument("--trace", metavar="DIR", help="trace each LazyTrain row's last step into DIR (see above)")
    args = ap.parse_args(argv)
    global DEVICE, TRACE_DIR
    DEVICE = torch.device(args.device)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        TRACE_DIR = args.trace
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("engine_gpu.py needs a CUDA GPU (or --device cpu for a smoke run)")
        return 1
    base = build(args)
    n = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32000, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps + args.warmup)]
    tokens = args.batch * args.seq
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none (CPU smoke run)"
    print(f"GPU {gpu}, torch {torch.__version__}; Llama {n / 1e9:.2f}B params, "
          f"{args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, bf16")
    runs = [("plain PyTorch (all on GPU)", lambda m, row: plain(m, batches, args.warmup)),
            ("LazyTrain every-4 (MegaTrain)", lambda m, row: streamed(m, batches, args.warmup,
                                                                {"policy": "every_k", "checkpoint_interval": 4,
                                                                 "last_segment_graph": False,
                                                                 "overlap_optimizer": False}, row)),
            ("LazyTrain every-4, overlapped", lambda m, row: streamed(m, batches, args.warmup, {
                "policy": "every_k", "checkpoint_interval": 4, "last_segment_graph": False}, row)),
            ("LazyTrain every-4, last graph", lambda m, row: streamed(m, batches, args.warmup, {
                "policy": "every_k", "checkpoint_interval": 4, "last_segment_graph": True}, row)),
            ("LazyTrain keep-all on GPU", lambda m, row: streamed(m, batches, args.warmup,
                                                             {"policy": "keep_all", "boundary_home": "hbm"}, row))]
    if not args.skip_milp:
        runs.append(("LazyTrain MILP plan", lambda m, row: streamed(m, batches, args.warmup, {
            "policy": "milp", "hardware": "h200", "seq_len": args.seq, "gpu_memory": "40GB", "milp_time_limit": 10}, row)))
        runs.append(("LazyTrain auto (measured here)", lambda m, row: auto_streamed(m, batches, args.warmup, args.steps,
                                                                              args.seq, row)))
    rows = []
    for name, fn in runs:
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            t, info = fn(copy.deepcopy(base), name)   # the row's name names its trace
        except Exception as e:  # report and go on: one failing variant must not hide the others
            print(f"{name}: FAILED: {type(e).__name__}: {e}")
            continue
        peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else float("nan")
        if info.get("cuda_peak") is not None:   # the engine's last step (it resets the counter every step)
            peak = info["cuda_peak"]
        peak /= 2**30
        rows.append((name, t, peak, info))
        gc.collect()
    plain_t = rows[0][1] if rows and rows[0][0].startswith("plain") else None
    print(f"\n{'system':<32}{'step s':>8}{'tokens/s':>10}{'TFLOPS':>8}{'GPU peak GiB':>13}{'planned GiB':>12}"
          f"{'opt s':>7}{'vs plain':>9}  plan")
    for name, t, peak, info in rows:
        ratio = f"{t / plain_t:.2f}x" if plain_t else "-"
        planned = f"{info['planned_peak'] / 2**30:.1f}" if info.get("planned_peak") is not None else "-"
        print(f"{name:<32}{t:>8.3f}{tokens / t:>10.0f}{6 * n * tokens / t / 1e12:>8.1f}{peak:>13.1f}{planned:>12}"
              f"{info.get('optimizer_s', 0):>7.2f}{ratio:>9}  {info.get('plan', '')} "
              f"{'kept ' + str(info['kept']) + ' resident ' + str(info['resident']) if info else ''}")
    if TRACES:
        print("\n" + _host_facts())
    for row, summary in TRACES:
        print(f"\n{row}, last step traced ({TRACE_DIR}/{_file_name(row)}.json):\n{summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
