"""One run, side by side on this CPU: a plain PyTorch training step vs LazyTrain (interval 4) vs DeepSpeed
ZeRO-3 with CPU offload of parameters and optimizer (when DeepSpeed is installed).

LazyTrain runs twice: as configured by default (the last segment keeps its forward graph, which
``last_segment_graph: "auto"`` turns on for the CPU) and with every segment recomputed in backward
(MegaTrain's policy exactly, ``last_segment_graph: false``). ``--overlap`` adds a run with
``overlap_optimizer: true`` (the streamed layers' update on a thread, overlapping the next forward; off
by default on the CPU, where the update and the forward share the same cores).

Same ~20M-parameter Llama config for all three (transformers' LlamaForCausalLM built from a config;
``--shape llama-vocab32k``: Llama's 32000-token vocabulary, hidden 256, 4 layers, FFN 688, so most
compute is in the LM head; ``--shape block-heavy``: vocab 8192, hidden 384, 8 layers, FFN 1024, most
compute in the streamed blocks), batch 4, seq 256, fp32, AdamW, clipping 1.0. Prints the median step
time of each and the ratios.

    python benchmarks/engine_cpu.py [--shape llama-vocab32k|block-heavy] [--steps 8] [--warmup 2] [--no-deepspeed]
                                    [--overlap]
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
import torch.nn.functional as F

warnings.filterwarnings("ignore")

BATCH, SEQ = 4, 256
VOCAB = 32000
SHAPES = {   # two ~20M-parameter Llama shapes: most compute in the LM head, or most in the blocks
    "llama-vocab32k": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=8),
    "block-heavy": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                        num_attention_heads=6),
}


def build_model(shape: str = "llama-vocab32k"):
    from transformers import LlamaConfig, LlamaForCausalLM
    global VOCAB
    torch.manual_seed(0)
    s = SHAPES[shape]
    VOCAB = s["vocab_size"]
    cfg = LlamaConfig(num_key_value_heads=s["num_attention_heads"], max_position_embeddings=SEQ,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False, **s)
    return LlamaForCausalLM(cfg)


def data(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def loss_of(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def time_steps(step_fn, batches, warmup):
    times = []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        step_fn(ids)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def plain_pytorch(model, batches, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)   # as the configs' AdamW

    def step(ids):
        loss = loss_of(model(ids[:, :-1]).logits, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time_steps(step, batches, warmup)


def lazytrain_engine(model, batches, warmup, last_segment_graph="auto", overlap_optimizer="auto"):
    import lazytrain
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "lazytrain": {"policy": "every_k", "checkpoint_interval": 4, "boundary_home": "hbm", "device": "cpu",
                         "last_segment_graph": last_segment_graph, "overlap_optimizer": overlap_optimizer}}
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(ids):
        engine.backward(loss_of(engine(ids[:, :-1]).logits, ids))
        engine.step()
    result = time_steps(step, batches, warmup)
    engine.wait_for_update()
    return result


def deepspeed_zero3_offload(model, batches, warmup):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(ids):
        engine.backward(loss_of(engine(ids[:, :-1]).logits, ids))
        engine.step()
    return time_steps(step, batches, warmup)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-vocab32k")
    ap.add_argument("--overlap", action="store_true", help="also run LazyTrain with overlap_optimizer: true")
    args = ap.parse_args(argv)
    base = build_model(args.shape)
    n = sum(p.numel() for p in base.parameters())
    batches = data(args.steps + args.warmup)
    print(f"model: {args.shape} LlamaForCausalLM {n / 1e6:.1f}M params (blocks "
          f"{sum(p.numel() for p in base.model.layers.parameters()) / 1e6:.1f}M), batch {BATCH}, seq {SEQ}, fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    lt_name = "LazyTrain (interval 4)"
    results = {"plain PyTorch": plain_pytorch(copy.deepcopy(base), batches, args.warmup)[0],
               lt_name: lazytrain_engine(copy.deepcopy(base), batches, args.warmup)[0],
               "LazyTrain, all recomputed": lazytrain_engine(copy.deepcopy(base), batches, args.warmup, False)[0]}
    if args.overlap:
        results["LazyTrain, overlapped update"] = lazytrain_engine(copy.deepcopy(base), batches, args.warmup,
                                                                   overlap_optimizer=True)[0]
    if not args.no_deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("DeepSpeed not installed: skipping ZeRO-3 offload (pip install 'lazytrain[deepspeed]')")
        else:
            results["DeepSpeed ZeRO-3 offload"] = deepspeed_zero3_offload(copy.deepcopy(base), batches,
                                                                           args.warmup)[0]
    plain = results["plain PyTorch"]
    lt = results[lt_name]
    print(f"\n{'system':<28}{'median step (ms)':>18}{'vs plain':>10}{'LazyTrain speed-up':>20}")
    for name, t in results.items():
        print(f"{name:<28}{t * 1000:>18.0f}{t / plain:>9.2f}x{t / lt:>19.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
