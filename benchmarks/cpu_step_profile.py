"""Where a plain PyTorch training step of the engine benchmark's model spends its time on this CPU, and
the matrix-product rate the CPU reaches: the context for reading ``engine_cpu.py``'s ratios.

Times each phase of a plain step (embedding, blocks and final norm forward, LM head forward, loss, backward, clipping + fused
AdamW) of the same ~20M-parameter Llama (``--shape`` as in engine_cpu.py), median over the timed
steps, then fp32 matrix products of the head's shape and of 2048^3.

    python benchmarks/cpu_step_profile.py [--shape llama-vocab32k|block-heavy] [--steps 6] [--warmup 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine_cpu import BATCH, SEQ, SHAPES, build_model, data, loss_of


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-vocab32k")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    model = build_model(args.shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    phases = {"embedding + blocks + norm forward": [], "LM head forward": [], "loss": [], "backward": [], "clip + AdamW": []}
    for i, ids in enumerate(data(args.steps + args.warmup)):
        hidden, t_blocks = timed(lambda: model.model(ids[:, :-1]).last_hidden_state)
        logits, t_head = timed(lambda: model.lm_head(hidden))
        loss, t_loss = timed(lambda: loss_of(logits, ids))
        _, t_bwd = timed(loss.backward)

        def update():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        _, t_opt = timed(update)
        if i >= args.warmup:
            for k, t in zip(phases, (t_blocks, t_head, t_loss, t_bwd, t_opt)):
                phases[k].append(t)
    print(f"{args.shape}, batch {BATCH}, seq {SEQ}, fp32, {torch.get_num_threads()} threads; median of {args.steps} steps")
    for k, ts in phases.items():
        print(f"{k:<18}{statistics.median(ts) * 1000:8.0f} ms")
    print(f"{'step':<18}{sum(statistics.median(ts) for ts in phases.values()) * 1000:8.0f} ms (sum of medians)")
    hidden_size, vocab = SHAPES[args.shape]["hidden_size"], SHAPES[args.shape]["vocab_size"]
    for m, k, n in ((BATCH * SEQ, hidden_size, vocab), (2048, 2048, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(2):
            a @ b
        runs = []
        for _ in range(5):
            _, t = timed(lambda: a @ b)
            runs.append(t)
        t = statistics.median(runs)
        print(f"fp32 matmul {m}x{k}x{n}: {t * 1000:.0f} ms, {2 * m * k * n / t / 1e9:.0f} GFLOPS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
