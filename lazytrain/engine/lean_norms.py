"""Lean RMSNorms: a streamed block's RMSNorms keep only their input for the backward, which recomputes the
rest of the norm.

Why: transformers' RMSNorm computes in fp32 and saves an fp32 copy of its input and its normalised input
beside its output: in bf16, 8 to 10 bytes per hidden element and norm where the output alone is 2, a fifth
to a quarter of what a decoder layer saves (planner/models.py, LayerShape.saved_bytes_per_token). Keeping
the input instead (the layer input or the residual sum, which exist anyway, or a view of a projection's
output) and recomputing the few elementwise ops in backward costs next to nothing beside the layer's
matrix multiplies. The recomputation runs the norm's own forward with the weights the forward used, through
torch.utils.checkpoint: the gradients are those of plain autograd, bit for bit.

A norm is an ``nn.RMSNorm`` or a module whose class name ends in ``RMSNorm`` (transformers' convention),
called with one tensor by position. Its forward is replaced on the instance (the class and the state dict are
untouched); the replacement changes nothing where autograd does not record.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint

from .block_buffers import buffer_slots, buffers_set_to, copies_of
from .blocks import in_modes, train_modes


def is_rms_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def make_norms_lean(blocks: nn.ModuleList) -> list[nn.Module]:
    """Turns the RMSNorms of ``blocks`` lean; returns them (:func:`restore_norms` undoes it)."""
    changed = []
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            if not is_rms_norm(module) or "forward" in module.__dict__:
                continue
            names = tuple(name for name, _ in module.named_parameters(recurse=False))
            if len(names) == sum(1 for _ in module.parameters()):   # no parameters in children
                module.forward = partial(_lean_forward, module, names, f"block {index}'s {name or 'norm'}")
                changed.append(module)
    return changed


def restore_norms(norms: list[nn.Module]) -> None:
    for module in norms:
        if isinstance(module.__dict__.get("forward"), partial) and module.forward.func is _lean_forward:
            del module.forward


def _lean_forward(module: nn.Module, names: tuple, where: str, *args, **kwargs):
    own = type(module).forward
    # one tensor, by position: anything else (a keyword, more arguments) is the norm as written
    if len(args) != 1 or kwargs or not torch.is_grad_enabled() or not isinstance(args[0], torch.Tensor):
        return own(module, *args, **kwargs)
    if args[0].is_inference():   # made under inference_mode: autograd cannot keep it, the norm as written copies it
        return own(module, *args)
    hidden = args[0]
    # the weights go in as inputs: the streamed block's are views of a buffer that holds them only while
    # the executor runs the block, and the backward's recomputation must see the ones the forward used
    values = tuple(getattr(module, name) for name in names)
    if not hidden.requires_grad and not any(v.requires_grad for v in values):
        return own(module, hidden)
    # the generator state goes with it: an RMSNorm draws no random numbers, but a module named like one may
    # (dropout), and its recomputation must draw what its forward drew (saving the state costs next to nothing)
    out = checkpoint(_recompute, module, train_modes(module), names, _BuffersFound(module), hidden, *values,
                     use_reentrant=False, preserve_rng_state=True)
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        if not _saved_tensors_hooked():   # the checkpoint holds the input until the backward anyway
            out.grad_fn.register_prehook(partial(_input_unchanged, hidden, hidden._version, where))
        elif _READ_IN_OFFLOADED_FORWARD:   # the copy offloaded internals keep is immune to a change in place
            read = _ReadInput(hidden, where)   # after the forward only: one during it is checked as it ends
            _READ_IN_OFFLOADED_FORWARD[-1].append(read)
            out.grad_fn.register_prehook(read)
    return out


# the lean norms' inputs read in each offloaded block's forward under way (internals_offload.recording)
_READ_IN_OFFLOADED_FORWARD: list[list["_ReadInput"]] = []


@contextmanager
def inputs_checked_as_forward_ends():
    """An offloaded block's forward: a lean norm's input it changes in place after the norm read it (``h +=
    mlp(norm(h))``) is said by name in the backward, as outside offloaded blocks (the offload would refuse it,
    naming neither the norm nor the key)."""
    read: list[_ReadInput] = []
    _READ_IN_OFFLOADED_FORWARD.append(read)
    try:
        yield
    finally:
        _READ_IN_OFFLOADED_FORWARD.remove(read)
        for r in read:
            r.settle()


class _ReadInput:
    """A lean norm's input read in an offloaded forward: whether it changed in place by the forward's end."""

    def __init__(self, hidden: torch.Tensor, where: str):
        self.hidden, self.version, self.where, self.changed = hidden, hidden._version, where, False

    def settle(self) -> None:
        self.changed, self.hidden = self.hidden._version != self.version, None

    def __call__(self, grad_outputs):
        if self.changed:
            raise RuntimeError(_changed_input_message(self.where))


def _saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active here (torch keeps no public question for it; without the
    private one, assume they are, and leave the check to autograd)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _input_unchanged(hidden: torch.Tensor, version: int, where: str, grad_outputs):
    """Before the norm's backward, which recomputes it from its input: the input as the forward read it.
    A model that changes it in place afterwards (``h += mlp(norm(h))`` where the norm's upcast copied ``h``)
    trains under plain autograd, which saved the copy; a lean norm cannot, and says so by name."""
    if hidden._version != version:
        raise RuntimeError(_changed_input_message(where))


def _changed_input_message(where: str) -> str:
    return (f"lazytrain: the input of {where}, a lean RMSNorm, was changed in place after the norm read it; a "
            f"lean norm keeps its input to recompute itself in the backward. Where the norm copies its input "
            f"(its upcast in bf16 or fp16), \"lazytrain\": {{\"lean_norms\": false}} in the config lets this "
            f"model train")


class _BuffersFound:
    """The buffers of a norm as its forward found them. The forward runs on the norm's own buffers; each
    recomputation runs on fresh copies of these and writes nothing back (block_buffers.py): a module named like a
    norm whose training forward updates a buffer (a running statistic, a counter, one made on first use) moves it
    once per forward, as in plain PyTorch, and its recomputation reads what the forward read. A norm without
    buffers copies nothing."""

    def __init__(self, module: nn.Module):
        self.found = copies_of(buffer_slots(module))
        self.forward_ran = False

    def for_this_run(self):
        if not self.forward_ran:
            self.forward_ran = True
            return nullcontext()
        return buffers_set_to(self.found)


def _recompute(module: nn.Module, modes: tuple, names: tuple, buffers: _BuffersFound, hidden: torch.Tensor,
               *values: torch.Tensor) -> torch.Tensor:
    """The norm's forward with ``values`` as its weights, its modules in the train/eval modes of the forward
    (``modes``, in ``module.modules()`` order): a model put in eval() between its forward and its backward
    would else recompute a module named like a norm that drops out without its dropout, and the
    recomputation would not match."""
    with in_modes(module, modes), _reparametrize_module(module, dict(zip(names, values))), buffers.for_this_run():
        return type(module).forward(module, hidden)
