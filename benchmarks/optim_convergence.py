"""Convergence check: HybridAdamW (8-bit states) against fp32 torch AdamW on the default arithmetic task
(or a tiny LM on a generated bigram chain, ``--task markov``).

The same TinyDecoder initialisation, the same batches and the same hyper-parameters (lr, betas, weight
decay, clipping to 1.0) for every optimizer and seed; reports the final training loss (mean of the last
20 steps), the held-out loss and the held-out exact-match accuracy, and the relative gap to fp32 AdamW.

    python benchmarks/optim_convergence.py                 # 400 steps, seeds 0,1,2
    python benchmarks/optim_convergence.py --optimizers "torch AdamW fp32,HybridAdamW 8-bit,HybridAdamW fp32"
    python benchmarks/optim_convergence.py --task markov --batch 16 --steps 400
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lazytrain.data.arithmetic import ArithmeticTask, exact_match  # noqa: E402
from lazytrain.models.decoder import DecoderConfig, TinyDecoder  # noqa: E402
from lazytrain.optim.hybrid_adamw import HybridAdamW  # noqa: E402


def make_optimizer(kind: str, model: torch.nn.Module, lr: float, wd: float):
    if kind == "torch AdamW fp32":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=False)
    if kind == "HybridAdamW 8-bit":
        return HybridAdamW(model.named_parameters(), lr=lr, weight_decay=wd, max_grad_norm=1.0)
    if kind == "HybridAdamW fp32":
        return HybridAdamW(model.named_parameters(), lr=lr, weight_decay=wd, max_grad_norm=1.0,
                           optimizer_states="fp32")
    raise ValueError(kind)


def heldout_loss(model, task: ArithmeticTask) -> float:
    pairs = task.eval_set()
    xs, ys = zip(*(task.example(a, b) for a, b in pairs))
    with torch.no_grad():
        logits = model(torch.stack(xs))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.stack(ys).reshape(-1),
                               ignore_index=-100).item()


class MarkovText:
    """A tiny LM task with a smooth loss curve: sequences from a fixed random bigram chain (vocab 32,
    Dirichlet(0.2) transitions, so next-token entropy is well below log 32); loss floor = entropy rate."""

    vocab = 32
    seq_len = 33

    def __init__(self):
        with torch.random.fork_rng():  # the same chain in every run, whatever the global RNG state
            torch.manual_seed(1234)
            self.trans = torch.distributions.Dirichlet(torch.full((self.vocab,), 0.2)).sample((self.vocab,))
        p = self.trans.clamp_min(1e-12)
        stat = torch.full((self.vocab,), 1.0 / self.vocab)
        for _ in range(200):
            stat = stat @ self.trans
        self.entropy = float(-(stat[:, None] * p * p.log()).sum())

    def sample(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        x = torch.empty(batch, self.seq_len, dtype=torch.long)
        x[:, 0] = torch.randint(self.vocab, (batch,), generator=gen)
        for t in range(1, self.seq_len):
            x[:, t] = torch.multinomial(self.trans[x[:, t - 1]], 1, generator=gen).squeeze(1)
        return x

    def train_batches(self, batch: int, steps: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = self.sample(batch, gen)
            yield x[:, :-1], x[:, 1:]

    def heldout(self):
        x = self.sample(256, torch.Generator().manual_seed(99))
        return x[:, :-1], x[:, 1:]


def train(kind: str, seed: int, steps: int, batch: int, lr: float, wd: float, task_name: str = "arithmetic"):
    task = ArithmeticTask() if task_name == "arithmetic" else MarkovText()
    vocab = 16 if task_name == "arithmetic" else MarkovText.vocab
    torch.manual_seed(seed)
    model = TinyDecoder(DecoderConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4))
    opt = make_optimizer(kind, model, lr, wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))  # 30-step warm-up
    losses = []
    for x, y in task.train_batches(batch, steps, seed=100 + seed):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if isinstance(opt, torch.optim.AdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    report = opt.format_state_report().splitlines()[0] if isinstance(opt, HybridAdamW) else ""
    if task_name == "arithmetic":
        em = exact_match(lambda ids: model(ids), task, task.eval_set(), "cpu")
        return statistics.fmean(losses[-20:]), heldout_loss(model, task), em, report
    x, y = task.heldout()
    with torch.no_grad():
        held = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).item()
    return statistics.fmean(losses[-20:]), held, float("nan"), report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--optimizers", default="torch AdamW fp32,HybridAdamW 8-bit")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: least sensitive to host load)")
    ap.add_argument("--task", choices=("arithmetic", "markov"), default="arithmetic",
                    help="arithmetic: the default dataset; markov: a tiny LM on a random bigram chain")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = args.optimizers.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    what = "ArithmeticTask(max_operand=99)" if args.task == "arithmetic" else \
        f"a bigram-chain tiny LM (vocab 32, entropy rate {MarkovText().entropy:.4f} nats)"
    print(f"# convergence: TinyDecoder (4 layers, hidden 128) on {what}, "
          f"{args.steps} steps, batch {args.batch}, lr {args.lr} (30-step warm-up), wd {args.wd}, clip 1.0")
    print(f"date {datetime.date.today()}, {os.cpu_count()}-CPU host, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"command: python {' '.join(sys.argv)}")
    print()
    print("| seed | optimizer | final train loss (last 20) | held-out loss | held-out exact match | "
          f"train loss vs {kinds[0]} | s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    summary = {k: [] for k in kinds}
    notes = set()
    for seed in seeds:
        ref = None
        for kind in kinds:
            t = time.perf_counter()
            final, held, em, report = train(kind, seed, args.steps, args.batch, args.lr, args.wd, args.task)
            if report:
                notes.add(f"{kind}: {report}")
            if ref is None:
                ref = final
            summary[kind].append((final, held, em))
            print(f"| {seed} | {kind} | {final:.4f} | {held:.4f} | {em:.3f} | {100 * (final / ref - 1):+.1f}% | "
                  f"{time.perf_counter() - t:.0f} |", flush=True)
    print()
    base = statistics.fmean(f for f, _, _ in summary[kinds[0]])
    for kind in kinds:
        f = statistics.fmean(x[0] for x in summary[kind])
        h = statistics.fmean(x[1] for x in summary[kind])
        e = statistics.fmean(x[2] for x in summary[kind])
        print(f"mean over seeds: {kind}: train {f:.4f} ({100 * (f / base - 1):+.1f}% vs {kinds[0]}), "
              f"held-out {h:.4f}, exact match {e:.3f}")
    for n in sorted(notes):
        print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
