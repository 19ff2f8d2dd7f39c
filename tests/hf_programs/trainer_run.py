"""A Hugging Face Trainer script as people write them, run through LazyTrain by the one line marked below.

    python trainer_run.py OUT --config zero2|zero3|plain [--steps N] [--save-steps K] [--resume CKPT] [--bf16]

``plain`` is the same script without DeepSpeed: the same Trainer with torch's AdamW and DeepSpeed's WarmupLR
written as a LambdaLR, the reference the LazyTrain runs are compared with. Writes OUT/result.pt: the trained
weights by name, the evaluation loss, the predictions' logits and the logged losses."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Tokens, WARMUP, plain_optimizers, tiny_gpt2, trained_weights, write_config  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--config", default="zero2")
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--save-steps", type=int, default=2)
ap.add_argument("--resume", default=None)
ap.add_argument("--bf16", action="store_true")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)

if a.config != "plain":
    import lazytrain
    lazytrain.replace_deepspeed()      # the one line: DeepSpeed's entry points now build LazyTrain engines

from transformers import Trainer, TrainingArguments  # noqa: E402

args = TrainingArguments(   # built before the model, as scripts do: under ZeRO-3 DeepSpeed would partition it
    output_dir=a.out, per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
    max_steps=a.steps, learning_rate=3e-3, weight_decay=0.01, warmup_steps=WARMUP, max_grad_norm=0.5,
    save_steps=a.save_steps, logging_steps=1, report_to=[], use_cpu=True, seed=7, bf16=a.bf16,
    deepspeed=None if a.config == "plain" else write_config(a.config, a.out))
model = tiny_gpt2()
optimizers = plain_optimizers(model, args) if a.config == "plain" else (None, None)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(64), eval_dataset=Tokens(8, offset=1000),
                  optimizers=optimizers)
trainer.train(resume_from_checkpoint=a.resume)
eval_loss = trainer.evaluate()["eval_loss"]
logits = torch.as_tensor(trainer.predict(Tokens(4, offset=2000)).predictions[0])
trainer.save_model(os.path.join(a.out, "final"))
engine = trainer.model_wrapped
weights = trained_weights(trainer, model, a.config)
masters = getattr(engine, "masters", None)   # the non-block fp32 masters: their owners' alone when sharded
masters_here = sum(id(p) not in masters.elsewhere for p, _ in masters.pairs) if masters is not None else None
if torch.distributed.is_initialized():   # how many each rank holds
    held = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, masters_here)
    masters_here = held
torch.save({"weights": weights, "eval_loss": eval_loss, "logits": logits, "step": trainer.state.global_step,
            "sharded": getattr(engine, "shards", None) is not None,
            "masters": len(masters.pairs) if masters is not None else None,
            "masters_here": masters_here,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]},
           os.path.join(a.out, "result.pt"))
if torch.distributed.is_initialized():   # under torchrun: every rank done, then the process group torn down
    torch.distributed.barrier()           # before the interpreter is (left to exit, or torn down with no
    torch.distributed.destroy_process_group()   # barrier, a rank once aborted after its work was done)
