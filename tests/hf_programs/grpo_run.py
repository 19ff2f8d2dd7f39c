"""A TRL GRPOTrainer script, which generates completions during training (``unwrap_model_for_generation``), run
through LazyTrain by the one line marked below.

    python grpo_run.py OUT --config zero2|zero3|plain [--evaluate-first]

``plain`` is the same script without DeepSpeed, with torch's AdamW and DeepSpeed's WarmupLR as a LambdaLR.
``--evaluate-first``: ``trainer.evaluate()`` (which generates) before any training step, and no training after
it: under ZeRO-3 the Trainer builds an engine without an optimizer for it, and its ``train()`` after that keeps
the evaluation's engine, which its own ``free_memory`` destroyed (a Trainer bug with DeepSpeed too).
Writes OUT/result.pt (trained weights, logged losses and rewards; with --evaluate-first the evaluation's
metrics)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (VOCAB, WARMUP, plain_optimizers, script_args, tiny_gpt2, trained_weights,  # noqa: E402
                    word_tokenizer, write_config)

a = script_args("--evaluate-first")

if a.config != "plain":
    import lazytrain
    lazytrain.replace_deepspeed()      # the one line

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def reward_low_words(completions, **kwargs):
    """Rewards completions of words with low numbers ("w3" beats "w40")."""
    return [-sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) / (VOCAB * max(len(c.split()), 1))
            for c in completions]


prompts = [" ".join(f"w{(7 * i + j) % (VOCAB - 1) + 1}" for j in range(4)) for i in range(8)]
args = GRPOConfig(output_dir=a.out, per_device_train_batch_size=4, per_device_eval_batch_size=4, num_generations=4,
                  max_completion_length=6, gradient_accumulation_steps=1, max_steps=3, learning_rate=3e-3, weight_decay=0.01,
                  warmup_steps=WARMUP, max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=7,
                  use_cpu=True, bf16=False, temperature=1.0,
                  deepspeed=None if a.config == "plain" else write_config(a.config, a.out))
model = tiny_gpt2()
initial = {k: v.clone() for k, v in model.state_dict().items()}
optimizers = plain_optimizers(model, args) if a.config == "plain" else (None, None)
trainer = GRPOTrainer(model=model, reward_funcs=reward_low_words, args=args,
                      train_dataset=Dataset.from_dict({"prompt": prompts}),
                      eval_dataset=Dataset.from_dict({"prompt": prompts[:4]}), processing_class=word_tokenizer(),
                      optimizers=optimizers)
if a.evaluate_first:
    metrics = trainer.evaluate()
    torch.save({"eval_reward": metrics["eval_reward"], "eval_loss": metrics["eval_loss"],
                "engine": type(trainer.model_wrapped).__name__}, os.path.join(a.out, "result.pt"))
    sys.exit(0)
trainer.train()
weights = trained_weights(trainer, model, a.config)
history = trainer.state.log_history
moved = max((weights[k].float() - initial[k].float()).abs().max().item() for k in initial)
torch.save({"weights": weights, "losses": [h["loss"] for h in history if "loss" in h],
            "rewards": [h["reward"] for h in history if "reward" in h], "moved": moved},
           os.path.join(a.out, "result.pt"))
