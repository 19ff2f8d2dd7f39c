"""What watching a block's buffers costs a training step (engine/block_buffers.py), on the CPU.

A block with a large read-only buffer (a 64 MiB causal mask, read in its forward) against the same block
without it, both re-run in backward by an every-2 plan: the buffers are copied at a block's first training
forward and then only those its forwards write, so the mask costs its read alone after the first step.
Prints seconds per step (steps 4-8 of 8) for each and their ratio.

    OMP_NUM_THREADS=1 python3 benchmarks/block_buffers_cost.py
"""
import pathlib
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import lazytrain
from lazytrain.planner.plan import every_k_plan

V, D, N, LAYERS = 32, 64, 4096, 4


class Block(nn.Module):
    def __init__(self, mask: bool):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("mask", torch.tril(torch.ones(N, N)) if mask else torch.ones(8, 8), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        return x + torch.tanh(self.fc(x)) * self.mask[:t, :t].sum(-1, keepdim=True) / t


class LM(nn.Module):
    def __init__(self, mask: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.stack = nn.ModuleList([Block(mask) for _ in range(LAYERS)])
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.stack:
            x = b(x)
        return self.head(x)


def seconds_per_step(mask: bool) -> float:
    torch.manual_seed(0)
    plan = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    every_k_plan(LAYERS, 2, home="host").to_json(str(plan))
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"policy": "plan", "plan": str(plan), "device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=LM(mask), config=cfg)[0]
    ids, y = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    for i in range(8):
        if i == 3:
            t0 = time.perf_counter()
        engine.backward(F.cross_entropy(engine(ids).flatten(0, 1), y.flatten()))
        engine.step()
    spent = (time.perf_counter() - t0) / 5
    engine.destroy()
    return spent


if __name__ == "__main__":
    plain, masked = seconds_per_step(False), seconds_per_step(True)
    print(f"without the mask: {plain:.4f} s/step; with a 64 MiB read-only mask per block: {masked:.4f} s/step; "
          f"ratio {masked / plain:.2f}x")
