"""A Trainer whose schedule is ReduceLROnPlateau (``lr_scheduler_type``), with a DeepSpeed config that names an
optimizer and no scheduler, so that the Trainer builds the schedule and DeepSpeed's engine holds it; run
through LazyTrain by the one line marked below, or plain (``--config plain``).

    python plateau_run.py OUT --config zero2|plain

Evaluates every step (patience 0, and a relative threshold of 1: no loss above zero is an improvement, so each
evaluation halves the rate, whatever the loss). Writes OUT/result.pt: the learning rates the Trainer logged and the optimizer's rate at the end."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ZERO2, Tokens, script_args, tiny_gpt2  # noqa: E402

a = script_args()
if a.config != "plain":
    import lazytrain
    lazytrain.replace_deepspeed()      # the one line

from transformers import Trainer, TrainingArguments  # noqa: E402

config = None
if a.config != "plain":
    config = os.path.join(a.out, "ds.json")
    with open(config, "w") as f:
        json.dump({k: v for k, v in ZERO2.items() if k != "scheduler"}, f)   # the Trainer's schedule is used
args = TrainingArguments(
    output_dir=a.out, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3, logging_steps=1,
    eval_strategy="steps", eval_steps=1, lr_scheduler_type="reduce_lr_on_plateau",
    lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 1.0}, save_strategy="no", report_to=[],
    use_cpu=True, seed=7, deepspeed=config)
trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(16), eval_dataset=Tokens(4, offset=1000))
trainer.train()
torch.save({"logged": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
            "lr": trainer.optimizer.param_groups[0]["lr"]}, os.path.join(a.out, "result.pt"))
