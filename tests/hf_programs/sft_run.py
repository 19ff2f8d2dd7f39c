"""A TRL SFTTrainer script, run through LazyTrain by the one line marked below.

    python sft_run.py OUT --config zero2|zero3|plain

``plain`` is the same script without DeepSpeed, with torch's AdamW and DeepSpeed's WarmupLR as a LambdaLR.
Writes OUT/result.pt (trained weights, logged losses) and OUT/final (``save_model``)."""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (VOCAB, WARMUP, plain_optimizers, script_args, tiny_gpt2, trained_weights,  # noqa: E402
                    word_tokenizer, write_config)

a = script_args()

if a.config != "plain":
    import lazytrain
    lazytrain.replace_deepspeed()      # the one line

from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

rng = random.Random(5)
texts = [" ".join(f"w{rng.randrange(1, VOCAB)}" for _ in range(rng.randrange(6, 14))) for _ in range(32)]
args = SFTConfig(output_dir=a.out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                 learning_rate=3e-3, weight_decay=0.01, warmup_steps=WARMUP, max_grad_norm=0.5, logging_steps=1,
                 save_strategy="no", report_to=[], seed=7, max_length=16, use_cpu=True, bf16=False,
                 deepspeed=None if a.config == "plain" else write_config(a.config, a.out))
model = tiny_gpt2()
optimizers = plain_optimizers(model, args) if a.config == "plain" else (None, None)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                     processing_class=word_tokenizer(), optimizers=optimizers)
trainer.train()
trainer.save_model(os.path.join(a.out, "final"))
weights = trained_weights(trainer, model, a.config)
torch.save({"weights": weights, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]},
           os.path.join(a.out, "result.pt"))
