"""Stage 3: the parameters outside the streamed blocks partitioned across the ranks.

At ``zero_optimization.stage`` 3 each trainable parameter outside the blocks (embeddings, final norm, head)
is held between uses by the one rank that owns its optimizer state (sharding.py assigns it whole, as at
stages 1-2) and by no other: the owner keeps its compute copy, its fp32 master, gradient and moments; the
other ranks keep an empty tensor in its place, as DeepSpeed's partitioned parameters are. (The streamed
layers need none of this: a node's ranks compute them from one shared host copy, engine.py.)

* Before a module's forward every rank receives the parameters of that module it does not hold from their
  owners (one broadcast each, in the order the forward reaches the modules: the same on every rank). A
  forward without autograd drops them again at its end; else they are dropped once autograd has produced
  their gradient. A backward that finds them dropped (a forward without grad in between) gets them again
  first, from a hook on the module's outputs.
* Each micro-batch's gradient goes to the owner by a reduce as autograd produces it, is added into the fp32
  master gradient there, and is dropped everywhere (every rank must use the same parameters in each
  backward, as at stage 2 for the streamed layers).
* After an optimizer step every copy held for a forward is dropped: the owners' weights have changed.
* A checkpoint, a 16-bit save, ``module_state_dict()``, a load and ``destroy()`` see every parameter whole
  (:meth:`PartitionedParams.materialized`, a collective: every rank calls them, as under DeepSpeed).
* ``state_dict()`` of the model outside those gives empty tensors for what this rank does not hold, as
  DeepSpeed's ZeRO-3 does, with a warning; ``load_state_dict()`` outside them is refused by name.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .precision import Masters

LIVE: "weakref.WeakSet[PartitionedParams]" = weakref.WeakSet()   # for deepspeed.zero.GatheredParameters


@dataclass(eq=False)
class _Entry:
    param: nn.Parameter    # what the model computes with (compute dtype)
    master: nn.Parameter   # what the optimizer updates (fp32; the same storage as param in fp32 training)
    owner: int
    shape: torch.Size
    shares: bool           # master and param are one storage (fp32 training): one broadcast serves both
    held: bool = True      # the same on every rank: whether the param is whole here now


class PartitionedParams:
    """The non-block parameters of one engine partitioned by ``owner_of(master)`` (None: not partitioned,
    replicated on every rank). Built before :meth:`partition`, which is the last step of the engine's
    set-up, so that a set-up that fails leaves every parameter whole."""

    def __init__(self, masters: Masters, owner_of, rank: int, dist, model: nn.Module, block_modules: set[int]):
        self.masters, self.rank, self.dist = masters, rank, dist
        self.entries: list[_Entry] = []
        for p, m in masters.pairs:
            owner = owner_of(m)
            if owner is not None and p.requires_grad and p.numel() > 0:
                self.entries.append(_Entry(p, m, owner, p.shape, _same_storage(p, m)))
        self._by_param = {id(e.param): e for e in self.entries}
        self._by_master = {id(e.master): e for e in self.entries}
        self._modules = []   # (module, its entries): the modules that own partitioned parameters directly
        for module in model.modules():
            if id(module) in block_modules:
                continue
            mine = [self._by_param[id(p)] for _, p in module.named_parameters(recurse=False) if id(p) in self._by_param]
            if mine:
                self._modules.append((module, mine))
        self.active = False
        self._whole_for = 0   # depth of materialized(): every parameter whole on every rank meanwhile
        self._hooks = []
        self._warned_state_dict = False
        self.held_bytes = 0        # bytes of other ranks' parameters held here now, and at most since reset
        self.peak_held_bytes = 0

    # ---- set-up and hand-back --------------------------------------------------------------------
    def partition(self) -> None:
        """Each rank keeps what it owns; hooks gather the rest for each use."""
        for e in self.entries:
            self.masters.remove_grad_hook(e.param)
            self._hooks.append(e.param.register_post_accumulate_grad_hook(self._gradient_hook(e)))
        for module, entries in self._modules:
            self._hooks += [module.register_forward_pre_hook(lambda mod, args, entries=entries: self._gather(entries)),
                            module.register_forward_hook(self._after_forward(entries)),
                            module.register_state_dict_pre_hook(self._warn_partial_state_dict),
                            module.register_load_state_dict_pre_hook(self._refuse_partial_load)]
        self.active = True
        LIVE.add(self)
        self._release(self.entries, masters_too=True)
        self.held_bytes = self.peak_held_bytes = 0   # what this rank owns is not counted

    def unpartition(self) -> None:
        """Every parameter whole on every rank again, no hooks of ours (``destroy()``: a collective)."""
        if not self.active:
            return
        self._gather_masters()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.active = False
        LIVE.discard(self)

    # ---- what the engine asks ----------------------------------------------------------------------
    def partitioned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a master the optimizer holds, or a model parameter) is partitioned here."""
        return self.active and (id(t) in self._by_master or id(t) in self._by_param)

    def owner_of(self, t: torch.Tensor) -> int:
        return (self._by_master.get(id(t)) or self._by_param[id(t)]).owner

    @contextlib.contextmanager
    def materialized(self):
        """Meanwhile every partitioned parameter and its fp32 master are whole on every rank (received from
        their owners), so that saves and loads see the model as one process has it; afterwards the other
        ranks' are dropped again (what a load wrote into the owners' stays). A collective."""
        if not self.active:
            yield
            return
        if self._whole_for == 0:
            self._gather_masters()
        self._whole_for += 1
        try:
            yield
        finally:
            self._whole_for -= 1
            if self._whole_for == 0:
                self._release(self.entries, masters_too=True)

    def gathered(self, params) -> contextlib.AbstractContextManager:
        """``deepspeed.zero.GatheredParameters(params)``: those of ``params`` partitioned here, whole for the
        duration (read only: a write by one rank would reach no other), then dropped."""
        entries = [self._by_param[id(p)] for p in params if id(p) in self._by_param]

        @contextlib.contextmanager
        def scope():
            self._gather(entries)
            try:
                yield
            finally:
                if self._whole_for == 0:
                    self._release(entries)
        return scope()

    def release_all(self) -> None:
        """After an optimizer step: the copies held for a forward are out of date."""
        if self.active and self._whole_for == 0:
            self._release(self.entries)

    # ---- gather and release ------------------------------------------------------------------------
    def _gather(self, entries) -> None:
        for e in entries:
            if e.held:
                continue
            mine = e.owner == self.rank
            buf = e.param.data if mine else torch.empty(e.shape, dtype=e.param.dtype, device=e.param.device)
            self.dist.broadcast_from([buf], e.owner, what="broadcast of a partitioned parameter before its module's "
                                     "forward or backward (zero_optimization.stage 3: every rank must run the same "
                                     "modules outside the streamed blocks in each forward)")
            if not mine:
                e.param.data = buf
                self.held_bytes += buf.numel() * buf.element_size()
                self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            e.held = True

    def _gather_masters(self) -> None:
        """Parameters and fp32 masters whole (the masters from their owners: in bf16/fp16 they hold more bits
        than the compute copies)."""
        self._gather(self.entries)
        for e in self.entries:
            mine = e.owner == self.rank
            self.masters.elsewhere.discard(id(e.param))
            if e.shares:
                if not mine:
                    e.master.data = e.param.data
                continue
            buf = e.master.data if mine else torch.empty(e.shape, dtype=torch.float32, device=e.master.device)
            self.dist.broadcast_from([buf], e.owner, what="gather of the partitioned parameters' fp32 weights (a save, "
                                     "a load or destroy(): every rank must call it)")
            e.master.data = buf

    def _release(self, entries, masters_too: bool = False) -> None:
        for e in entries:
            if e.owner != self.rank:
                if e.held:
                    self.held_bytes -= e.param.numel() * e.param.element_size()
                e.param.data = _empty_like(e.param)
                if masters_too:   # the master is on its owner alone: Masters leaves this pair alone
                    e.master.data = _empty_like(e.master)
                    self.masters.elsewhere.add(id(e.param))
            e.held = False

    # ---- hooks ---------------------------------------------------------------------------------------
    def _after_forward(self, entries):
        def hook(module, args, output):
            if self._whole_for:
                return
            outputs = [t for t in _tensors(output) if t.requires_grad]
            if not (torch.is_grad_enabled() and outputs):
                self._release(entries)   # no backward will need them
                return
            for t in outputs:   # a backward after a forward without grad in between finds them dropped
                t.register_hook(lambda grad: self._gather(entries))
        return hook

    def _gradient_hook(self, e: _Entry):
        def hook(p: torch.Tensor) -> None:
            grad, p.grad = p.grad.detach(), None   # this micro-batch's alone: p.grad is never kept
            mean = self.dist.reduce_mean_to(grad, e.owner, what="gradient reduce of a partitioned parameter in the "
                                            "backward (zero_optimization.stage 3: every rank must use the same "
                                            "parameters outside the streamed blocks in each backward; a model that "
                                            "skips some on some ranks needs stage 2)")
            if e.owner == self.rank:   # the sum is ours: p.grad was dropped above
                mean = mean.to(e.master.device, torch.float32).view(e.shape)
                if e.master.grad is None:
                    e.master.grad = mean
                else:
                    e.master.grad.add_(mean)
            if self._whole_for == 0:
                self._release([e])
        return hook

    def _warn_partial_state_dict(self, module, prefix, keep_vars) -> None:
        if self._whole_for or self._warned_state_dict or all(e.owner == self.rank for e in self.entries):
            return
        self._warned_state_dict = True
        warnings.warn("lazytrain: zero_optimization.stage 3 partitions the parameters outside the streamed blocks: "
                      "the model's state_dict() holds empty tensors for those other ranks own, as DeepSpeed's ZeRO-3 "
                      "does. engine.module_state_dict(), engine.save_checkpoint() and engine.save_16bit_model() "
                      "(on every rank) see them whole", UserWarning, stacklevel=4)

    def _refuse_partial_load(self, module, state_dict, prefix, local_metadata, *args) -> None:
        if self._whole_for == 0:
            raise RuntimeError("load_state_dict() at zero_optimization.stage 3: the parameters outside the streamed "
                               "blocks are partitioned across the ranks (each whole on its owner only), so a load "
                               "into the module would reach one rank's part; load with engine.load_checkpoint(), "
                               "or load the weights before lazytrain.initialize()")


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def _tensors(output):
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them, as Hugging Face's
    ModelOutput is)."""
    if torch.is_tensor(output):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)
