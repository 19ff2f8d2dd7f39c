"""Selective checkpointing of one streamed block: the outputs of its matrix multiplies and attention kept
from its forward, so that its re-runs in backward recompute only the rest.

Why: re-running a block in backward costs a whole forward, nearly all of it in matrix multiplies and
attention; keeping a whole block's autograd internals instead costs their memory until its backward.
Between the two, torch.utils.checkpoint's selective policy keeps the outputs of the expensive ops (about
half the internals) and recomputes the cheap ones (norms, activations, elementwise). A Plan's
``selective_layers`` name the blocks that do this. LazyTrain runs a block's forward without autograd and
re-runs it once or twice in backward (the no-grad recompute of a segment's interior, then the forward with
autograd before its backward), so each re-run needs a cache of its own (a re-run consumes its entries). The
forward records into one, and the others are copies of its entries (the same tensors, held once): two
recording modes would run every op of the forward through two Python dispatch modes.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _ops(*names):
    return tuple(getattr(getattr(_aten, name), "default") for name in names if hasattr(_aten, name))


# what a selective block keeps: the outputs of matrix multiplies, and of the attention kernels that return
# their log-sum-exp whether or not autograd records (flash; the efficient and cuDNN kernels compute it only
# for a forward that records autograd, which a streamed block's is not, so they are recomputed)
MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
ATTENTION_OPS = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu")
KEPT_OPS = MATMUL_OPS + ATTENTION_OPS


def _policy(ctx, op, *args, **kwargs):
    """Keep matmul outputs, and attention's unless it drops out: a kept attention would not draw its
    dropout's random numbers again in a re-run, and the ops after it would draw different ones."""
    if op in MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    if op in ATTENTION_OPS and float(kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0)) == 0.0:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveForward:
    """The kept outputs of one block's forward, for ``reruns`` re-runs (each consumes its own cache)."""

    def __init__(self, reruns: int):
        if reruns < 1:
            raise ValueError(f"a selective block is re-run at least once, got {reruns}")
        self._pairs = [create_selective_checkpoint_contexts(_policy) for _ in range(reruns)]
        self._used = 0

    @contextmanager
    def recording(self):
        """Run the block's forward inside this: the first cache records the kept ops' outputs, and every
        other re-run's cache gets its entries (each a cache of its own: a re-run consumes its entries)."""
        caching, _ = self._pairs[0]
        with caching:
            yield
        for other, _ in self._pairs[1:]:
            other.storage.clear()
            other.storage.update({key: dict(entries) for key, entries in caching.storage.items()})

    def tensors(self) -> list[torch.Tensor]:
        """The kept outputs, each storage once (the caches share them)."""
        out, seen = [], set()
        for caching, _ in self._pairs:
            for leaf in _cache_entries(caching.storage):
                t = getattr(leaf, "val", None)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    out.append(t)
        return out

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def next_rerun(self):
        """The context of the next re-run: the kept ops return their forward's outputs in it; or, where the
        model changed one of those outputs in place since (``relu(fc(x), inplace=True)``, say), none: the
        re-run computes everything again, as a block that is not selective does."""
        if self._used == len(self._pairs):
            raise RuntimeError(f"a selective block was re-run more than the {len(self._pairs)} time(s) its "
                               f"forward kept outputs for")
        caching, cached = self._pairs[self._used]
        self._used += 1
        if _changed_in_place(caching.storage):
            warnings.warn("lazytrain: a selective layer's kept matmul output was changed in place by the model; "
                          "that layer re-runs its whole forward in backward instead", UserWarning)
            return nullcontext()
        return cached


def _cache_entries(storage: dict):
    """The entries of a selective checkpoint cache (each wraps a kept output: ``val``, ``version``)."""
    for entries in storage.values():
        yield from tree_leaves(list(entries.values()))


def _changed_in_place(storage: dict) -> bool:
    """Whether a kept output changed since the forward kept it (the cache's entries record its version)."""
    return any(getattr(leaf, "version", None) is not None and leaf.val._version != leaf.version
               for leaf in _cache_entries(storage))
