"""Selective checkpointing of one streamed block: the outputs of its matrix multiplies and attention kept
from its forward, so that its re-runs in backward recompute only the rest.

Why: re-running a block in backward costs a whole forward, nearly all of it in matrix multiplies and
attention; keeping a whole block's autograd internals instead costs their memory until its backward.
Between the two, selective checkpointing keeps the outputs of the expensive ops (about half the
internals) and recomputes the cheap ones (norms, activations, elementwise). A Plan's ``selective_layers``
name the blocks that do this. LazyTrain runs a block's forward without autograd and re-runs it once or
twice in backward (the no-grad recompute of a segment's interior, then the forward with autograd before its
backward).

The caches are LazyTrain's own dispatch modes, not torch.utils.checkpoint's selective contexts: those
number every op of the region and refuse a re-run that runs an op the forward did not, and model code runs
other ops when autograd records (Mixtral's router divides a top-k output in place, which adds a clone
under autograd only). Here only the kept ops are numbered, in one sequence whatever their kind, each
with its op and its arguments' shapes and dtypes; a re-run's n-th kept op takes the n-th kept output when
its op and signature match, every other op runs as it is, and from the first kept op that does not match
(torch.matmul runs bmm or mm by whether its inputs require grad, say) the re-run computes them all again,
with a warning. A shape check cannot tell a kept op run only under autograd from the next one of the same
op and shapes, which would take its output and shift every later one: so a re-run that took any kept output
and did not run the forward's sequence one for one is not to be used (``_Replaying.whole``): the executor
runs that block again without kept outputs. What this cannot see: a block that runs one kept op only under
autograd and another, of the same op and shapes, only without it (the counts then agree); no model is known
to. One recording serves every re-run: a re-run reads the entries, it does not consume them.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .tensor_storages import storages

_aten = torch.ops.aten


def _ops(*names):
    return tuple(getattr(getattr(_aten, name), "default") for name in names if hasattr(_aten, name))


# what a selective block keeps: the outputs of matrix multiplies, and of the attention kernels that return
# their log-sum-exp whether or not autograd records (flash; the efficient and cuDNN kernels compute it only
# for a forward that records autograd, which a streamed block's is not, so they are recomputed)
MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
ATTENTION_OPS = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu")
KEPT_OPS = MATMUL_OPS + ATTENTION_OPS


def keeps(op, args: tuple, kwargs: dict) -> bool:
    """Keep matmul outputs, and attention's unless it drops out: a kept attention would not draw its
    dropout's random numbers again in a re-run, and the ops after it would draw different ones."""
    if op in MATMUL_OPS:
        return True
    return op in ATTENTION_OPS and float(kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0)) == 0.0


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What must match for a re-run's op to take a kept output: each tensor argument's shape and dtype,
    each other argument's value."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.dtype)
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else type(a).__name__
    return tuple(one(a) for a in tree_leaves((args, kwargs)))


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _versions(out) -> tuple:
    return tuple(t._version for t in _tensors(out))


_WRITTEN_ARGUMENTS: dict = {}   # op -> ((position, name), ...) of the arguments its schema says it writes


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes (an in-place op's self, an ``out=``), by its schema."""
    where = _WRITTEN_ARGUMENTS.get(func)
    if where is None:
        schema = getattr(func, "_schema", None)
        where = _WRITTEN_ARGUMENTS[func] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments if schema is not None else ())
            if a.alias_info is not None and a.alias_info.is_write)
    if not where:
        return []
    return [t for i, name in where for t in tree_leaves(args[i] if i < len(args) else kwargs.get(name))
            if isinstance(t, torch.Tensor)]


class _KeptStorages:
    """The storages of a selective forward's kept outputs, and whether an op wrote into one since it was kept.
    Why not their version counters alone: a view that does not share its base's (``aten._unsafe_view``, which a
    bias-free Linear's matmul on a 3-D input returns through) changes the kept output unseen: Falcon's
    ``mlp_output += attention_output`` did, and its re-runs took the sum for the matmul's output."""

    def __init__(self):
        self._storages: set[tuple] = set()
        self.written = False

    def keep(self, out) -> None:
        # (a storage of no bytes, or with no address (meta), is no kept data: every such one would look alike)
        self._storages.update(key for t in _tensors(out) for key, nbytes in storages(t) if nbytes and key[1])

    def note(self, func, args: tuple, kwargs: dict) -> None:
        """Before ``func`` runs: whether it writes into a kept output's storage."""
        if not self.written and self._storages:
            self.written = any(key in self._storages for t in _written(func, args, kwargs) for key, _ in storages(t))


@dataclass
class _Kept:
    op: Any
    signature: tuple
    output: Any            # the op's output itself (the forward runs without autograd): the model's views of
    versions: tuple        # it share its version counter, so an in-place change by the model shows here


class _Recording(TorchDispatchMode):
    """Runs every op; keeps the kept ops' outputs in the order they ran, and sees a write into one."""

    def __init__(self, sequence: list, storages: _KeptStorages):
        super().__init__()
        self.sequence = sequence
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.storages.note(func, args, kwargs)
        out = func(*args, **kwargs)
        if keeps(func, args, kwargs):
            self.sequence.append(_Kept(func, _signature(args, kwargs), out, _versions(out)))
            self.storages.keep(out)
        return out


class _Replaying(TorchDispatchMode):
    """Returns the n-th kept output to the n-th kept op while op and signature match; runs the rest. What
    it returns are aliases (autograd records its history on them, not on the kept tensors); ``served``
    keeps them with their versions, so that a re-run that changes one in place shows."""

    def __init__(self, sequence: list, storages: _KeptStorages):
        super().__init__()
        self.sequence = sequence
        self.storages = storages   # a write into what it served changes the kept output for the next re-run
        self.next = 0
        self.lined_up = True
        self.served: list[tuple[list[torch.Tensor], tuple]] = []

    def __exit__(self, *exc):
        # keep what it served without the history autograd recorded on it (the re-run's graph, which a
        # re-run that is run again without kept outputs must let go): a detached alias shares the version
        # counter autograd gave the served one, so a later change in place still shows
        self.served = [([t.detach() for t in tensors], versions) for tensors, versions in self.served]
        return super().__exit__(*exc)

    def whole(self) -> bool:
        """After the re-run: whether what it computed can be trusted: it took no kept output, or its kept ops
        matched the forward's one for one by op and signature (see the module's note for what that cannot
        see). Else an op of its own may have taken another's output."""
        return not self.served or (self.lined_up and self.next == len(self.sequence))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.storages.note(func, args, kwargs)
        if self.lined_up and keeps(func, args, kwargs):
            n = self.next
            self.next += 1
            kept = self.sequence[n] if n < len(self.sequence) else None
            if kept is not None and kept.op == func and kept.signature == _signature(args, kwargs):
                out = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, kept.output)
                self.served.append((_tensors(out), _versions(out)))
                return out
            self.lined_up = False
            forward = f"{kept.op}" if kept is not None else "none"
            warnings.warn(f"lazytrain: a selective layer's re-run did not repeat its forward's kept ops (its kept op "
                          f"{n} is {func}, the forward's {forward}, or of another signature); it computes them "
                          f"again from there", UserWarning)
        return func(*args, **kwargs)


class SelectiveForward:
    """The kept outputs of one block's forward, for ``reruns`` re-runs."""

    def __init__(self, reruns: int):
        if reruns < 1:
            raise ValueError(f"a selective block is re-run at least once, got {reruns}")
        self._reruns = reruns
        self._sequence: list[_Kept] = []   # the kept ops' outputs, in the forward's order
        self._storages = _KeptStorages()
        self._replays: list[_Replaying] = []
        self._used = 0

    @contextmanager
    def recording(self):
        """Run the block's forward inside this: the kept ops' outputs are kept for every re-run."""
        with _Recording(self._sequence, self._storages):
            yield

    def tensors(self) -> list[torch.Tensor]:
        """The kept outputs, each storage once."""
        out, seen = [], set()
        for t in self._kept_tensors():
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                out.append(t)
        return out

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def next_rerun(self):
        """The context of the next re-run: the kept ops return their forward's outputs in it; or, where the
        model changed one of those outputs in place since (``relu(fc(x), inplace=True)``, say), none: the
        re-run computes everything again, as a block that is not selective does."""
        if self._used == self._reruns:
            raise RuntimeError(f"a selective block was re-run more than the {self._reruns} time(s) its "
                               f"forward kept outputs for")
        self._used += 1
        if self._changed_in_place():
            warnings.warn("lazytrain: a selective layer's kept matmul output was changed in place by the model; "
                          "that layer re-runs its whole forward in backward instead", UserWarning)
            return nullcontext()
        replay = _Replaying(self._sequence, self._storages)
        self._replays.append(replay)
        return replay

    def _kept_tensors(self):
        for kept in self._sequence:
            yield from _tensors(kept.output)

    def _changed_in_place(self) -> bool:
        """Whether a kept output changed since the forward kept it (by the forward, or by an earlier re-run
        through what it was served): an op wrote into its storage, or its version moved."""
        if self._storages.written:
            return True
        if any(_versions(kept.output) != kept.versions for kept in self._sequence):
            return True
        return any(_versions(tensors) != versions for replay in self._replays for tensors, versions in replay.served)
