"""Host optimizer step time and state memory on a 50M-parameter fp32 model's tensors.

Compares, side by side in one process on the same parameters and gradients:
  * torch.optim.AdamW(fused=True)                       (the baseline; ratios are relative to it)
  * HybridAdamW (8-bit states, default block size)      with and without writing a bf16 compute copy,
                                                        and with clipping (norm pass + fused coefficient)
  * HybridAdamW(optimizer_states="fp32")
  * bitsandbytes AdamW8bit on CPU                       (when bitsandbytes is installed)
  * DeepSpeedCPUAdam                                    (when `import deepspeed` works)
Each round runs one step of every optimizer in turn; the table reports the median (and minimum) wall
time over rounds, so background load affects all optimizers alike, and the minimum process CPU time.

    python benchmarks/optim_cpu.py                      # 50M parameters, 9 rounds
    python benchmarks/optim_cpu.py --params 10e6 --rounds 5 --block-sizes 256,2048
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lazytrain.optim import kernels  # noqa: E402
from lazytrain.optim.hybrid_adamw import DEFAULT_BLOCK_SIZE, HybridAdamW  # noqa: E402


def model_shapes(n_params: float):
    """A stack of transformer layers (hidden 1024, FFN 4096) with norms and biases, ~n_params in total."""
    h, f = 1024, 4096
    layer = [("attn.qkv.weight", (3 * h, h)), ("attn.qkv.bias", (3 * h,)), ("attn.out.weight", (h, h)),
             ("attn.out.bias", (h,)), ("ln1.weight", (h,)), ("ln1.bias", (h,)), ("mlp.fc1.weight", (f, h)),
             ("mlp.fc1.bias", (f,)), ("mlp.fc2.weight", (h, f)), ("mlp.fc2.bias", (h,)), ("ln2.weight", (h,)),
             ("ln2.bias", (h,))]
    per_layer = sum(torch.Size(s).numel() for _, s in layer)
    n_layers = max(1, round(n_params / per_layer))
    return [(f"layers.{i}.{name}", shape) for i in range(n_layers) for name, shape in layer]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:  # step counters excluded
                total += v.numel() * v.element_size()
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--block-sizes", default=str(DEFAULT_BLOCK_SIZE),
                    help="comma-separated HybridAdamW block sizes to time")
    ap.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes (slow on CPU)")
    ap.add_argument("--bnb-rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    named = [(name, torch.nn.Parameter(torch.randn(shape) * 0.02)) for name, shape in model_shapes(args.params)]
    params = [p for _, p in named]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    copies = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in params}
    k = kernels.cpu_kernels()

    # weight decay 0.0 for all, DeepSpeedCPUAdam's default (torch's AdamW and HybridAdamW default to 0.01)
    opts = {"torch AdamW fused": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)}
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        tag = f"HybridAdamW 8-bit bs={bs}"
        opts[tag] = HybridAdamW(named, lr=1e-4, weight_decay=0.0, block_size=bs, check_finite=False)
        if bs == DEFAULT_BLOCK_SIZE:
            opts[tag + " +bf16 copy"] = HybridAdamW(named, lr=1e-4, weight_decay=0.0, block_size=bs,
                                                    check_finite=False, compute_copies=copies)
            opts[tag + " +clip 1.0"] = HybridAdamW(named, lr=1e-4, weight_decay=0.0, block_size=bs,
                                                   max_grad_norm=1.0)
    opts["HybridAdamW fp32 states"] = HybridAdamW(named, lr=1e-4, weight_decay=0.0, optimizer_states="fp32",
                                                  check_finite=False)
    slow = {}
    if not args.no_bnb:
        try:
            import bitsandbytes as bnb
            slow["bitsandbytes AdamW8bit (CPU)"] = bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.0)
        except Exception as e:  # noqa: BLE001
            print(f"bitsandbytes skipped: {e}")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opts["DeepSpeedCPUAdam"] = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.0)
    except Exception as e:  # noqa: BLE001
        print(f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e)[:120]}")

    times = {name: [] for name in list(opts) + list(slow)}
    cpu_times = {name: [] for name in times}
    for o in list(opts.values()) + list(slow.values()):
        o.step()  # allocate states

    def timed(name, o):
        c, t = time.process_time(), time.perf_counter()
        o.step()
        times[name].append(time.perf_counter() - t)
        cpu_times[name].append(time.process_time() - c)

    for r in range(args.rounds):
        for name, o in opts.items():
            timed(name, o)
        if r < args.bnb_rounds:
            for name, o in slow.items():
                timed(name, o)

    base = statistics.median(times["torch AdamW fused"])
    base_cpu = min(cpu_times["torch AdamW fused"])
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"# optimizer step, {n / 1e6:.1f}M fp32 parameters in {len(params)} tensors")
    print(f"date {datetime.date.today()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, C++ kernels: "
          f"{'AVX2' if k is not None and k.has_avx2 else ('scalar' if k is not None else 'unavailable')}")
    print(f"command: python {' '.join(sys.argv)}")
    print()
    print("| optimizer | step ms (median) | min ms | x fused (median) | CPU ms (min) | x fused (CPU) | "
          "state bytes/param | runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        o = opts.get(name) or slow[name]
        med, cpu = statistics.median(ts), min(cpu_times[name])
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {med / base:.2f} | {cpu * 1e3:.1f} | "
              f"{cpu / base_cpu:.2f} | {state_bytes(o) / n:.3f} | {len(ts)} |")
    print()
    print("CPU ms: process CPU time of the step (all threads), the least disturbed by other load on the host.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
