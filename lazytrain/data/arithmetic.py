"""The embedded default dataset: generated addition problems ("37+48=085") with exact-match evaluation.

Nothing is downloaded: problems are generated from a seed, train and held-out sets are disjoint by
construction (held-out operand pairs are never drawn for training), and the tokenizer is a fixed
character vocabulary.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+="
VOCAB_SIZE = 3 + len(_CHARS)


def encode(text: str) -> list[int]:
    return [3 + _CHARS.index(c) for c in text]


def decode(ids) -> str:
    return "".join(_CHARS[i - 3] for i in ids if i >= 3)


@dataclass(frozen=True)
class ArithmeticTask:
    """a+b with a, b in [0, max_operand]; operands padded to the width of max_operand, answers one wider."""
    max_operand: int = 99
    held_out_fraction: float = 0.1
    seed: int = 0

    @property
    def width(self) -> int:
        return len(str(self.max_operand))

    def prompt(self, a: int, b: int) -> str:
        return f"{a:0{self.width}d}+{b:0{self.width}d}="

    def answer(self, a: int, b: int) -> str:
        return f"{a + b:0{self.width + 1}d}"

    @property
    def prompt_len(self) -> int:
        return 1 + 2 * self.width + 2          # BOS + operands + '+' + '='

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.width + 1 + 1   # + answer + EOS

    def _split(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        random.Random(self.seed).shuffle(pairs)
        n_eval = max(1, int(len(pairs) * self.held_out_fraction))
        return pairs[n_eval:], pairs[:n_eval]

    def example(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and labels (-100 except on the answer and EOS: the loss is on the answer)."""
        ids = [BOS] + encode(self.prompt(a, b)) + encode(self.answer(a, b)) + [EOS]
        x = torch.tensor(ids[:-1])
        y = torch.tensor(ids[1:])
        y[: self.prompt_len - 1] = -100
        return x, y

    def train_batches(self, batch_size: int, steps: int, seed: int = 1):
        """``steps`` batches of (input_ids, labels) drawn with replacement from the training pairs. The pairs are
        split here, not at the first batch: a throughput timed from the first batch leaves the split out (it
        takes seconds at max_operand 999)."""
        return self._drawn(self._split()[0], batch_size, steps, seed)

    def _drawn(self, train: list[tuple[int, int]], batch_size: int, steps: int, seed: int):
        rng = random.Random(seed)
        for _ in range(steps):
            xs, ys = zip(*(self.example(*rng.choice(train)) for _ in range(batch_size)))
            yield torch.stack(xs), torch.stack(ys)

    def eval_set(self, limit: int | None = None) -> list[tuple[int, int]]:
        return self._split()[1][:limit]


@torch.no_grad()
def exact_match(model_fn, task: ArithmeticTask, pairs: list[tuple[int, int]], device, batch_size: int = 256) -> float:
    """Greedy-decode each answer from its prompt; the fraction answered exactly right.

    ``model_fn(input_ids) -> logits``. Prompts have one fixed length, so decoding needs no padding.
    """
    correct = 0
    n_answer = task.width + 1
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        ids = torch.tensor([[BOS] + encode(task.prompt(a, b)) for a, b in chunk], device=device)
        for _ in range(n_answer):
            logits = model_fn(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for (a, b), row in zip(chunk, ids[:, task.prompt_len:].tolist()):
            correct += decode(row) == task.answer(a, b) and all(t >= 3 for t in row)
    return correct / max(1, len(pairs))
