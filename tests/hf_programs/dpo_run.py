"""A TRL DPOTrainer script with ``precompute_ref_log_probs`` and no reference model, run through LazyTrain by
the one line marked below. Under DeepSpeed, TRL computes the reference log-probabilities through an inference
engine of its own on the policy model (``prepare_deepspeed``), before the Trainer builds the training engine on
the same model.

    python dpo_run.py OUT --config zero2|zero3|plain

The DeepSpeed runs set a one-process launcher's environment where none is given.

``plain`` is the same script without DeepSpeed, with torch's AdamW and DeepSpeed's WarmupLR as a LambdaLR.
Writes OUT/result.pt (trained weights, logged losses, and the reference log-probabilities computed)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (VOCAB, WARMUP, plain_optimizers, script_args, tiny_gpt2, trained_weights,  # noqa: E402
                    word_tokenizer, write_config)

a = script_args()

if a.config != "plain":
    # as a launcher starts it (one process): accelerate sets DeepSpeed's process group up from this, and TRL's
    # precompute broadcasts over it before any engine exists
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    import lazytrain
    lazytrain.replace_deepspeed()      # the one line

from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402


def words(i: int, n: int) -> str:
    return " ".join(f"w{(5 * i + 3 * j) % (VOCAB - 1) + 1}" for j in range(n))


pairs = Dataset.from_dict({"prompt": [words(i, 4) for i in range(8)],
                           "chosen": [words(i + 1, 3) for i in range(8)],
                           "rejected": [words(i + 7, 3) for i in range(8)]})
args = DPOConfig(output_dir=a.out, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=5,
                 learning_rate=3e-3, weight_decay=0.01, warmup_steps=WARMUP, max_grad_norm=0.5, logging_steps=1,
                 save_strategy="no", report_to=[], seed=7, use_cpu=True, bf16=False, precompute_ref_log_probs=True,
                 deepspeed=None if a.config == "plain" else write_config(a.config, a.out))
model = tiny_gpt2()
initial = {k: v.clone() for k, v in model.state_dict().items()}
optimizers = plain_optimizers(model, args) if a.config == "plain" else (None, None)
trainer = DPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=word_tokenizer(),
                     optimizers=optimizers)
reference = [trainer.train_dataset[i]["ref_chosen_logps"] for i in range(len(pairs))]
trainer.train()
weights = trained_weights(trainer, model, a.config)
history = trainer.state.log_history
moved = max((weights[k].float() - initial[k].float()).abs().max().item() for k in initial)
torch.save({"weights": weights, "losses": [h["loss"] for h in history if "loss" in h], "reference": reference,
            "moved": moved}, os.path.join(a.out, "result.pt"))
