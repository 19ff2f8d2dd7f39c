"""What selective checkpointing costs a streamed block, side by side in one process on one Llama layer:

  * plain         the forward without autograd, the re-run with autograd, its backward (no ops kept)
  * lazytrain     the same with LazyTrain's record/replay dispatch modes (engine/selective.py): the forward
                  records its matmul and attention outputs, the re-run takes them
  * torch-sac     the same with torch.utils.checkpoint's selective contexts (every op numbered), the
                  cache LazyTrain used before; for a block whose ops do not depend on grad mode

Each round runs each variant once in turn; the table reports the median (and minimum) milliseconds of the
forward and of the re-run plus backward over the rounds, so background load touches all alike.

    python benchmarks/selective_cpu.py                         # hidden 512, sequence 256, 15 rounds
    python benchmarks/selective_cpu.py --hidden 1024 --seq 512 --rounds 9
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lazytrain.engine.selective import SelectiveForward, keeps  # noqa: E402


def llama_layer(hidden: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 128, num_hidden_layers=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)


class TorchSac:
    """torch's selective contexts with LazyTrain's choice of kept ops, one pair per re-run."""

    def __init__(self):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
        policy = lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if keeps(op, a, k)  # noqa: E731
                                           else CheckpointPolicy.PREFER_RECOMPUTE)
        self.caching, self.cached = create_selective_checkpoint_contexts(policy)

    def recording(self):
        return self.caching

    def next_rerun(self):
        return self.cached


def one_round(layer, rope, x, variant: str) -> tuple[float, float]:
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    with torch.no_grad():
        emb = rope(x, pos)
    kept = SelectiveForward(1) if variant == "lazytrain" else TorchSac() if variant == "torch-sac" else None
    t0 = time.perf_counter()
    with torch.no_grad(), kept.recording() if kept else nullcontext():
        layer(x, position_embeddings=emb)
    t1 = time.perf_counter()
    h = x.detach().requires_grad_()
    with kept.next_rerun() if kept else nullcontext():
        out = layer(h, position_embeddings=emb)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    t2 = time.perf_counter()
    layer.zero_grad(set_to_none=True)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    layer, rope = llama_layer(args.hidden)
    x = torch.randn(args.batch, args.seq, args.hidden)
    variants = ["plain", "lazytrain", "torch-sac"]
    times = {v: ([], []) for v in variants}
    for r in range(args.rounds + 1):
        for v in variants:
            fwd, rerun = one_round(layer, rope, x, v)
            if r:   # the first round warms up
                times[v][0].append(fwd)
                times[v][1].append(rerun)
    print(f"# selective_cpu.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; Llama layer hidden {args.hidden}, batch {args.batch} x seq {args.seq}, {args.rounds} rounds")
    print(f"{'variant':<10} {'forward ms (min)':>18} {'re-run+bwd ms (min)':>21} {'fwd / plain':>12} "
          f"{'re-run+bwd / plain':>19}")
    base_f, base_r = (statistics.median(t) for t in times["plain"])
    for v in variants:
        f, rr = times[v]
        mf, mr = statistics.median(f), statistics.median(rr)
        print(f"{v:<10} {mf:>10.2f} ({min(f):6.2f}) {mr:>12.2f} ({min(rr):6.2f}) {mf / base_f:>12.3f} "
              f"{mr / base_r:>19.3f}")


if __name__ == "__main__":
    main()
