"""Host memory of a LoRA run: what the engine holds for a Llama model with PEFT adapters, trained in bf16 with the
streamed weights in host memory (or on NVMe: --home nvme), by category and per block parameter (frozen and
trainable apart).

Counted exactly, each storage once: the host tier's compute copies (none with the weights on NVMe), the blocks'
fp32 weights, frozen weights kept apart from the copies and gradient buffers, the optimizer's state, and the
embedding's and head's fp32 masters and gradients. The process's
resident memory before set-up and after two steps is printed beside them (it includes the user's own model as
built, allocator caches and the libraries).

    python benchmarks/lora_host_memory.py                       # hidden 1024, 8 layers, LoRA r 16 on q/k/v/o
    python benchmarks/lora_host_memory.py --hidden 2048 --layers 4 --rank 8
    python benchmarks/lora_host_memory.py --home nvme --nvme-path /tmp/lora-nvme

Needs PEFT (``pip install peft``) and transformers.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import subprocess
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lazytrain  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def lora_llama(hidden: int, layers: int, vocab: int, rank: int):
    try:
        import peft
    except ImportError:
        sys.exit("this benchmark needs PEFT: pip install peft")
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           lora_dropout=0.0)
    return peft.get_peft_model(model, lora), peft.__version__


def storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if torch.is_tensor(t) and t.numel() > 0:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--home", choices=("host", "nvme"), default="host", help="lazytrain.weights_home")
    ap.add_argument("--nvme-path", default=None, help="the NVMe tier's directory (--home nvme)")
    args = ap.parse_args()
    if args.home == "nvme" and not args.nvme_path:
        ap.error("--home nvme needs --nvme-path")

    model, peft_version = lora_llama(args.hidden, args.layers, args.vocab, args.rank)
    blocks = model.base_model.model.model.layers
    frozen = sum(p.numel() for p in blocks.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in blocks.parameters() if p.requires_grad)
    gc.collect()
    rss_before = rss_bytes()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "lazytrain": {"checkpoint_interval": 2, "weights_home": args.home,
                         **({"nvme_path": args.nvme_path} if args.home == "nvme" else {})}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    engine.wait_for_update()
    gc.collect()
    rss_after = rss_bytes()

    w, seen = engine.weights, set()
    copies = w.weights_tier.stats()["used_bytes"] if w.weights_tier.kind == "host" else 0
    masters = storage_bytes(w.master, seen)
    frozen_apart = storage_bytes(getattr(w, "frozen_part", ()), seen)   # weights on NVMe
    grads = storage_bytes(w.grad, seen)
    block_ids = {id(p) for params in w.params for p in params}
    block_state = storage_bytes([t for p, st in engine.optimizer.state.items() if id(p) in block_ids
                                 for t in st.values()], seen)
    other_state = storage_bytes([t for p, st in engine.optimizer.state.items() if id(p) not in block_ids
                                 for t in st.values()], seen)
    non_block = storage_bytes([t for _, m in (engine.masters.pairs if engine.masters else ()) for t in (m, m.grad)],
                              seen)
    block_total = copies + masters + frozen_apart + grads + block_state
    rows = [("compute copies (host tier)", copies), ("block fp32 weights", masters),
            ("block frozen weights apart from the copies", frozen_apart),
            ("block gradient buffers", grads), ("block optimizer state", block_state),
            ("embedding/head fp32 masters + gradients", non_block), ("embedding/head optimizer state", other_state)]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here).stdout.strip()
        if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                          cwd=here).stdout.strip():
            commit += " with uncommitted changes"
    except OSError:
        commit = "?"
    print(f"# LoRA host memory, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()}, torch {torch.__version__}, peft {peft_version}, library at {commit}")
    print(f"# Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; LoRA r {args.rank} on q/k/v/o; "
          f"bf16, weights_home {args.home}")
    print(f"# block parameters: {frozen / 1e6:.2f}M frozen, {trainable / 1e6:.3f}M trainable")
    print(f"{'what the engine holds on the host':<42}{'MiB':>10}")
    for name, nbytes in rows:
        print(f"{name:<42}{nbytes / 2**20:>10.1f}")
    print(f"{'blocks, all of the above for them':<42}{block_total / 2**20:>10.1f}")
    print(f"bytes per block parameter: {block_total / (frozen + trainable):.2f}")
    print(f"process resident memory: {rss_before / 2**20:.0f} MiB with the model built, "
          f"{rss_after / 2**20:.0f} MiB after set-up and 2 steps")
    engine.destroy()


if __name__ == "__main__":
    main()
