"""Pieces the Hugging Face programs share: the stock DeepSpeed configs Hugging Face documents, a tiny GPT-2
built from a config, deterministic token data and a word-level tokenizer (nothing is downloaded)."""
import json
import math
import os

import torch

VOCAB = 64
# transformers' documented ZeRO-2 and ZeRO-3 configs, "auto" values and all
ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
ZERO3 = dict(ZERO2, zero_optimization={
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True})
CONFIGS = {"zero2": ZERO2, "zero3": ZERO3}
WARMUP = 3   # TrainingArguments.warmup_steps: DeepSpeed's WarmupLR gets it through "auto"


def script_args(*flags: str):
    """``OUT --config zero2|zero3|plain [FLAG ...]``: the output folder (made), the DeepSpeed config the script
    runs, and the script's own on/off ``flags``."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="zero2")
    for flag in flags:
        ap.add_argument(flag, action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    return a


def trained_weights(trainer, model, config: str) -> dict:
    """A Trainer's trained weights: through its LazyTrain engine's ``module_state_dict`` (checked to be one),
    or, in the plain run, the model's own."""
    if config == "plain":
        return {k: v.clone() for k, v in model.state_dict().items()}
    engine = trainer.model_wrapped
    assert type(engine).__name__ == "LazyTrainEngine", type(engine)
    return engine.module_state_dict()


def write_config(name: str, directory: str) -> str:
    path = os.path.join(directory, f"ds_{name}.json")
    with open(path, "w") as f:
        json.dump(CONFIGS[name], f)
    return path


def tiny_gpt2():
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                       n_positions=32, bos_token_id=0, eos_token_id=0))


class Tokens(torch.utils.data.Dataset):
    """Causal-LM samples of 16 tokens; sample i is the same in every process."""

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        x = torch.randint(1, VOCAB, (16,), generator=g)
        return {"input_ids": x, "labels": x.clone()}


def warmup_lr_factor(step: int) -> float:
    """DeepSpeed 0.19's WarmupLR as a LambdaLR factor, for the plain runs: the minimum (0) for the first two
    updates (it sets the minimum at construction and its first step computes log(1) = 0), then log warmup
    over WARMUP steps, then constant."""
    it = step - 1
    if it < 0:
        return 0.0
    return math.log(it + 1) / math.log(WARMUP) if it < WARMUP else 1.0


def word_tokenizer():
    """A word-level tokenizer over "w1" ... "w63" (id 0 pads and ends), built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


def plain_optimizers(model, args):
    """What the plain runs hand the Trainer: torch's AdamW with the arguments' hyper-parameters over every
    parameter (as DeepSpeed's config optimizer gets them) and DeepSpeed's WarmupLR as a LambdaLR."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                            eps=args.adam_epsilon, weight_decay=args.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_lr_factor)
