"""Hugging Face Trainer with transformers' stock ZeRO-2 config, run by DeepSpeed itself and by LazyTrain
(``lazytrain.replace_deepspeed()``), beside the same Trainer without DeepSpeed (torch's AdamW, WarmupLR as a
LambdaLR): the learning rate and loss Trainer logs at each step, side by side.

DeepSpeed runs its CPU Adam op for the config's ``offload_optimizer: cpu`` (built on first use: minutes).
Each run is its own process (one rank, gloo), 6 optimizer steps of a tiny GPT-2 with gradient accumulation 2.

    python benchmarks/trainer_vs_deepspeed_cpu.py
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = r'''
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[3], "tests", "hf_programs"))
which, out = sys.argv[1], sys.argv[2]
from common import Tokens, plain_optimizers, tiny_gpt2, write_config
if which == "lazytrain":
    import lazytrain
    lazytrain.replace_deepspeed()
from transformers import Trainer, TrainingArguments
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                         learning_rate=3e-3, weight_decay=0.01, warmup_steps=3, max_grad_norm=0.5, save_steps=100,
                         logging_steps=1, report_to=[], use_cpu=True, seed=7,
                         deepspeed=None if which == "plain" else write_config("zero2", out))
model = tiny_gpt2()
trainer = Trainer(model=model, args=args, train_dataset=Tokens(64),
                  optimizers=plain_optimizers(model, args) if which == "plain" else (None, None))
trainer.train()
print("RESULT " + json.dumps([(h["step"], h["learning_rate"], h["loss"]) for h in trainer.state.log_history
                              if "loss" in h]))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(which: str) -> list:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        proc = subprocess.run([sys.executable, "-c", PROGRAM, which, out, os.path.dirname(HERE)], env=env,
                              capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the {which} run failed:\n{proc.stderr[-3000:]}")


def main() -> int:
    runs = {which: run(which) for which in ("deepspeed", "lazytrain", "plain")}
    print(f"{'step':>4} {'lr deepspeed':>14} {'lr lazytrain':>14} {'lr plain':>10} {'loss deepspeed':>15} "
          f"{'loss lazytrain':>15} {'loss plain':>11}")
    for (step, lr_d, loss_d), (_, lr_l, loss_l), (_, lr_p, loss_p) in zip(*runs.values()):
        print(f"{step:>4} {lr_d:>14.9g} {lr_l:>14.9g} {lr_p:>10.6g} {loss_d:>15.9g} {loss_l:>15.9g} {loss_p:>11.7g}")
    lr = max(abs(a[1] - b[1]) for a, b in zip(runs["deepspeed"], runs["lazytrain"]))
    loss = max(abs(a[2] - b[2]) for a, b in zip(runs["deepspeed"], runs["lazytrain"]))
    print(f"LazyTrain vs DeepSpeed: largest difference of a logged learning rate {lr:.3g}, of a logged loss {loss:.3g}")
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
