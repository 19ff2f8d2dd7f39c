"""The parameters outside the streamed blocks partitioned across the ranks (stage 3), or their fp32 masters
alone (stages 1 and 2).

At ``zero_optimization.stage`` 3 each trainable parameter outside the blocks (embeddings, final norm, head)
is held between uses by the one rank that owns its optimizer state (sharding.py assigns it whole) and by no
other: the owner keeps its compute copy, its fp32 master, gradient and moments; the other ranks keep an
empty tensor in its place, as DeepSpeed's partitioned parameters are. (The streamed layers need none of
this: a node's ranks compute them from one shared host copy, engine.py.)

At stages 1 and 2 (``masters_only``) every rank keeps the compute copies whole, as DeepSpeed's do, and
only the owner keeps the fp32 master, as DeepSpeed's partitioned fp32 groups are; the others keep a
placeholder of its shape without memory, so that the gradients they accumulate in fp32 until the step
(which reduces them to the owner) can hang from it. The owner sends the updated compute copy to every
rank (engine.py ``_share_updated``). Nothing is fetched for a forward; what needs the fp32 values whole
(loads, ``module_state_dict()``, ``destroy()``) fetches the masters through ``materialized()``, and a save
takes them from their owners, as at stage 3. The rest of this docstring is about stage 3.

When a copy is fetched and when it is dropped:

* Fetched when a forward begins: the outermost call (the model's, or a submodule's called directly) has
  every rank receive the partitioned parameters under that module from their owners (one broadcast each,
  in a fixed order), so any code of that forward may read them, wherever it reads them (a head tied by
  hand, a ParameterList). Fetching them module by module would not lower the peak: a forward with autograd
  keeps its copies for the backward, so the embedding's is still held when the head's is fetched.
* A forward without autograd drops what it fetched when that outermost call returns. A forward with
  autograd keeps its copies until autograd has produced their gradient, when each micro-batch's gradient
  is reduced to the owner (added into its fp32 master gradient there) and the copy dropped; one that is
  never differentiated keeps them until the next step. A backward that finds a copy gone (two forwards,
  then their two backwards) fetches them again first, from a hook on the forward's outputs.
* ``materialized()`` (loads, ``module_state_dict()``, ``destroy()``) and ``gathered()``
  (``deepspeed.zero.GatheredParameters``) pin what they fetch and drop only what they fetched, so scopes
  nest and leave a pending backward's copies alone. A checkpoint save fetches nothing: in ``shaped()``
  every rank sees the others' parameters' shapes (placeholders without memory), and takes the values of
  its part of the files from their owners.
* After an optimizer step the copies held are out of date: dropped, or fetched again where pinned.

Every rank must run the same forwards through the same modules (Hugging Face ``generate`` is made to keep
every rank stepping until all are done, as ``synced_gpus`` does under DeepSpeed's ZeRO-3); a rank that
skips one leaves the others waiting in its broadcast until ``lazytrain.collective_timeout_s``.
``state_dict()`` of the model outside those scopes gives empty tensors for what this rank does not hold, as
DeepSpeed's ZeRO-3 does, with a warning; ``load_state_dict()`` outside them is refused by name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .precision import Masters

_LIVE: list = []   # weak references to the partitioned engines, in the order made: live()
# what a broadcast of a partitioned parameter is for, named in the error of a rank whose peers never joined it
FOR_FORWARD = ("broadcast of a partitioned parameter for its module (zero_optimization.stage 3: every rank must run "
               "the same forwards through the same modules outside the streamed blocks)")
FOR_GATHER = ("gather of the partitioned parameters (module_state_dict(), a load, a save's 16-bit weights or "
              "destroy(): every rank must call it)")
FOR_GATHERED = "gather of the parameters a GatheredParameters scope names (every rank must enter it)"


@dataclass(eq=False)
class _Entry:
    param: nn.Parameter    # what the model computes with (compute dtype)
    master: nn.Parameter   # what the optimizer updates (fp32; the same storage as param in fp32 training)
    owner: int
    shape: torch.Size
    stride: tuple[int, ...]          # the layout every rank's copy has (a broadcast sends memory order)
    master_stride: tuple[int, ...]
    shares: bool           # master and param are one storage (fp32 training): one broadcast serves both
    held: bool = True      # the same on every rank: whether the param is whole here now
    pins: int = 0          # scopes (materialized, gathered) that keep it whole until they end


class PartitionedParams:
    """The non-block parameters of one engine partitioned by ``owner_of(master)`` (None: not partitioned,
    replicated on every rank); with ``masters_only``, their fp32 masters alone. Built before :meth:`partition`,
    which is the last step of the engine's set-up, so that a set-up that fails leaves every parameter whole."""

    def __init__(self, masters: Masters, owner_of, rank: int, dist, model: nn.Module, block_modules: set[int],
                 masters_only: bool = False):
        self.masters, self.rank, self.dist, self.model = masters, rank, dist, model
        self.masters_only = masters_only
        self.entries: list[_Entry] = []
        for p, m in masters.pairs:
            owner = owner_of(m)
            # masters only: a master that is its parameter (fp32 beside it) is needed whole for the forwards
            if owner is not None and p.requires_grad and p.numel() > 0 and not (masters_only and _same_storage(p, m)):
                self.entries.append(_Entry(p, m, owner, p.shape, p.stride(), m.stride(), _same_storage(p, m)))
        self._by_param = {id(e.param): e for e in self.entries}
        self._by_master = {id(e.master): e for e in self.entries}
        # module -> the entries under it, for the modules a forward may begin at (outside the blocks)
        self._modules = {}
        for module in model.modules():
            if id(module) in block_modules:
                continue
            under = {id(p) for p in module.parameters()}
            mine = [e for e in self.entries if id(e.param) in under]
            if mine:
                self._modules[module] = mine
        self.active = False
        self._whole_for = 0          # depth of materialized()
        self._shaped = 0             # depth of shaped()
        self._calls: list[nn.Module] = []   # hooked forwards under way, outermost first
        self._held_at_start: set[int] = set()
        self._hooks = []
        self._generate_wrapped: list[nn.Module] = []   # the modules whose generate is made synced
        self._warned_state_dict = False
        # bytes of other ranks' parameters this holds now, and at most since partition() (a graph autograd
        # keeps may hold a dropped copy a while longer: F.linear saves a view of its weight)
        self.held_bytes = 0
        self.peak_held_bytes = 0

    # ---- set-up and hand-back --------------------------------------------------------------------
    def partition(self) -> None:
        """Each rank keeps what it owns; hooks fetch the rest for each use (masters only: nothing to fetch for
        a forward, and the gradients accumulate on every rank until the step, as at stages 1 and 2)."""
        if self.masters_only:
            self.active = True
            for e in self.entries:
                self._drop_master(e)
            return
        for e in self.entries:
            self.masters.remove_grad_hook(e.param)
            self._hooks.append(e.param.register_post_accumulate_grad_hook(self._gradient_hook(e)))
        for module, entries in self._modules.items():
            self._hooks += [module.register_forward_pre_hook(self._before_forward(entries)),
                            module.register_forward_hook(self._after_forward(entries), always_call=True),
                            module.register_state_dict_pre_hook(self._warn_partial_state_dict)]
        # every Hugging Face generate in the model whose forwards fetch partitioned parameters, not only the
        # model's own: one held inside another (PEFT's model, a value-head model) is called by the outer one's
        # generate(*args, **kwargs), which takes no synced_gpus. (A frozen reference model inside fetches
        # nothing: its generate may run on one rank alone.)
        hooked = set(map(id, self._modules))
        for module in self.model.modules():
            generate = getattr(module, "generate", None)
            if callable(getattr(type(module), "generate", None)) and "generate" not in module.__dict__ \
                    and _takes(generate, "synced_gpus") and any(id(m) in hooked for m in module.modules()):
                module.generate = _synced_generate(generate)
                self._generate_wrapped.append(module)
        self.active = True
        _LIVE[:] = [r for r in _LIVE if r() is not None] + [weakref.ref(self)]
        for e in self.entries:
            self._drop(e)
            self._drop_master(e)
        self.held_bytes = self.peak_held_bytes = 0   # what this rank owns is not counted

    def unpartition(self) -> None:
        """Every parameter whole on every rank again, no hooks of ours (``destroy()``: a collective)."""
        if not self.active:
            return
        self._fetch(self.entries, FOR_GATHER)
        self._fetch_masters()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for module in self._generate_wrapped:
            del module.generate
        self._generate_wrapped.clear()
        self.active = False
        _LIVE[:] = [r for r in _LIVE if r() is not None and r() is not self]

    # ---- what the engine asks ----------------------------------------------------------------------
    def hook_ids(self) -> frozenset:
        """The ids of the module hooks this registered (a module's ``_forward_hooks`` keys)."""
        return frozenset(h.id for h in self._hooks)

    def partitioned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a master the optimizer holds, or a model parameter) is partitioned here."""
        return self._entry_of(t) is not None

    def whole_shape(self, t: torch.Tensor) -> torch.Size:
        """The shape of ``t`` as the model has it (a parameter another rank holds: its whole shape)."""
        entry = self._entry_of(t)
        return entry.shape if entry is not None else t.shape

    def _entry_of(self, t: torch.Tensor) -> _Entry | None:
        """The entry of ``t`` (a partitioned parameter or its master) while partitioned, else None."""
        if not self.active:
            return None
        return self._by_param.get(id(t)) or self._by_master.get(id(t))

    @contextlib.contextmanager
    def materialized(self):
        """Meanwhile every partitioned parameter and its fp32 master are whole on every rank (received from
        their owners), so that loads and ``module_state_dict()`` see the model as one process has it;
        afterwards what this fetched is dropped again (what a load wrote into the owners' stays). A
        collective."""
        if not self.active:
            yield
            return
        with self._pinned(self.entries, FOR_GATHER):
            if self._whole_for == 0:
                self._fetch_masters()
            self._whole_for += 1
            try:
                yield
            finally:
                self._whole_for -= 1
                if self._whole_for == 0:
                    for e in self.entries:
                        self._drop_master(e)

    @contextlib.contextmanager
    def shaped(self):
        """Meanwhile each partitioned parameter not whole here, and each fp32 master not here (even where its
        parameter is held for a pending backward), has its whole shape but no values (a zero-stride view of
        one zero: no memory), so that a writer that takes the shapes from every rank's model and the values
        from their owners (a sharded save: engine.py ``_holder_of_pieces``) does not fetch them. Not a
        collective; nothing may read their values."""
        if not self.active:
            yield
            return
        # an owner's are whole. A parameter held here (a forward under grad whose backward is pending, a
        # gathered() scope) keeps its values, but its fp32 master still lives on its owner alone: the
        # master gets a placeholder all the same (the writer takes the flat groups' layout from the masters)
        params = [e for e in self.entries if e.owner != self.rank and not e.held]
        masters = [e for e in self.entries if e.owner != self.rank and e.master is not e.param
                   and id(e.param) in self.masters.elsewhere]
        self._shaped += 1
        try:
            for e in params:
                e.param.data = _no_values(e.param.dtype, e.param.device, e.shape)
            for e in masters:
                e.master.data = _no_values(torch.float32, e.master.device, e.shape)
            yield
        finally:
            self._shaped -= 1
            for e in params:
                if not e.held:   # nothing fetched it meanwhile
                    e.param.data = _empty_like(e.param)
            for e in masters:
                if id(e.param) in self.masters.elsewhere:   # nothing fetched it meanwhile
                    e.master.data = self._master_placeholder(e)

    def owner(self, t: torch.Tensor) -> int | None:
        """The rank that holds ``t`` (a partitioned parameter or its master) whole between uses; None when
        ``t`` is not partitioned."""
        e = self._entry_of(t)
        return e.owner if e is not None else None

    def write(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """This rank's part of writing ``value`` as the weight of ``t`` (a partitioned parameter or its master),
        every rank calling it with the same value (lazytrain.utils.safe_set_full_fp32_param): each copy that
        holds values here is written (the owner's parameter and master; another rank's copy held now, for a
        pending backward or a gathered scope), and each copy counts as written for autograd on every rank. No
        collective, nothing fetched."""
        e = self._entry_of(t)
        with torch.no_grad():
            for copy in (e.master, e.param):
                if not self.values_elsewhere(copy):
                    copy.copy_(value)
                else:   # counted as written on every rank alike: a pending backward that saved it is refused on
                    torch.autograd.graph.increment_version(copy)   # all of them, not on the owner alone

    def values_elsewhere(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a partitioned parameter or its master) holds no values here now: another rank owns
        it and it is not fetched (in :meth:`shaped`, a placeholder of its shape). A master is fetched only by
        :meth:`materialized`: a parameter held for a pending backward has its values, its master none."""
        e = self._entry_of(t)
        if e is None or e.owner == self.rank:
            return False
        if t is e.master and t is not e.param:
            return id(e.param) in self.masters.elsewhere
        return not e.held

    def gathered(self, params) -> contextlib.AbstractContextManager:
        """``deepspeed.zero.GatheredParameters(params)``: those of ``params`` partitioned here, whole for the
        duration (read only: a write by one rank would reach no other); then what this fetched is dropped."""
        return self._pinned([self._by_param[id(p)] for p in params if id(p) in self._by_param] if self.active else [],
                            FOR_GATHERED)

    @contextlib.contextmanager
    def _pinned(self, entries, what: str):
        """A scope: ``entries`` fetched and kept whole until it ends, then what it fetched dropped (what was
        held before it, for a pending backward or an outer scope, stays)."""
        before = {id(e) for e in entries if e.held}
        for e in entries:
            e.pins += 1
        try:
            self._fetch(entries, what)
            yield
        finally:
            for e in entries:
                e.pins -= 1
                if id(e) not in before:
                    self._drop(e)

    def keep_for_backward(self, tensors, params) -> None:
        """A backward from ``tensors`` uses ``params`` outside a hooked module (the chunked loss's head):
        fetch them again first if they were dropped since."""
        entries = [self._by_param[id(p)] for p in params if p is not None and id(p) in self._by_param]
        if self.active and entries:
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(lambda grad, entries=entries: self._fetch(entries))

    def after_step(self) -> None:
        """The owners' weights changed: held copies are dropped, or, where a scope pins them, fetched again
        (every rank pins the same ones: the same collectives). Masters only: the engine sends the owners'
        compute copies to every rank."""
        if not self.active or self.masters_only:
            return
        for e in self.entries:
            if e.pins and e.held:
                if e.owner != self.rank:
                    self.held_bytes -= e.param.numel() * e.param.element_size()
                e.held = False
                self._fetch([e], FOR_GATHER)
            else:
                self._drop(e)

    # ---- fetch and drop ------------------------------------------------------------------------------
    def _fetch(self, entries, what: str = FOR_FORWARD) -> None:
        if not self.active:   # after unpartition(): every parameter is whole, and a graph's hooks may remain
            return
        published = False
        for e in entries:
            if e.held:
                continue
            if not published:   # a collective on every rank: a rank waiting in a save the others skipped sees it
                self.dist.calls.entering("a gather of partitioned parameters", None)
                published = True
            mine = e.owner == self.rank
            buf = e.param.data if mine else torch.empty_strided(e.shape, e.stride, dtype=e.param.dtype,
                                                                 device=e.param.device)
            self.dist.broadcast_from([buf], e.owner, what=what)
            if not mine:
                e.param.data = buf
                self.held_bytes += buf.numel() * buf.element_size()
                self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            e.held = True

    def _fetch_masters(self) -> None:
        """fp32 masters whole, from their owners (in bf16/fp16 they hold more bits than the compute copies)."""
        for e in self.entries:
            mine = e.owner == self.rank
            self.masters.elsewhere.discard(id(e.param))
            if e.shares:
                if not mine:
                    e.master.data = e.param.data
                continue
            buf = e.master.data if mine else torch.empty_strided(e.shape, e.master_stride, dtype=torch.float32,
                                                                  device=e.master.device)
            self.dist.broadcast_from([buf], e.owner, what="gather of the fp32 weights of the parameters outside the "
                                     "streamed blocks from their owners (module_state_dict(), a load or destroy(): "
                                     "every rank must call it)")
            e.master.data = buf

    def _drop(self, e: _Entry) -> None:
        """The copy of another rank's parameter goes (unless a scope pins it); the owner keeps its own."""
        if e.pins or not self.active or self.masters_only:
            return
        if e.owner != self.rank:
            if e.held:
                self.held_bytes -= e.param.numel() * e.param.element_size()
            e.param.data = _empty_like(e.param)
        e.held = False

    def _drop_master(self, e: _Entry) -> None:
        if e.owner != self.rank and self.active:   # the master lives on its owner alone: Masters leaves this pair alone
            e.master.data = self._master_placeholder(e)
            self.masters.elsewhere.add(id(e.param))

    def _master_placeholder(self, e: _Entry) -> torch.Tensor:
        """What stands for another rank's master here: nothing (stage 3: no gradient reaches it); with masters
        only, its shape without memory, for the gradient accumulated here until the step."""
        return _no_values(torch.float32, e.master.device, e.shape) if self.masters_only else _empty_like(e.master)

    # ---- hooks ---------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """The engine's forward begins: no hooked call is under way (one that a BaseException cut short left
        its mark on the stack)."""
        self._calls.clear()

    def _before_forward(self, entries):
        def hook(module, args):
            if not self._calls:   # the outermost call: everything it may read, fetched now
                self._held_at_start = {id(e) for e in self.entries if e.held}
                self._fetch(entries)
            self._calls.append(module)
        return hook

    def _after_forward(self, entries):
        def hook(module, args, output):
            if not self._calls or self._calls[-1] is not module:
                return   # its pre-hook did not run (another pre-hook raised first): nothing to close
            self._calls.pop()
            if self._calls:
                return
            if torch.is_grad_enabled():   # a backward that finds them gone fetches them first
                for t in _tensors(output):
                    if t.requires_grad and t.grad_fn is not None:
                        t.register_hook(lambda grad: self._fetch(entries))
                return
            for e in entries:   # the outermost forward without autograd: what it fetched goes
                if e.held and id(e) not in self._held_at_start:
                    self._drop(e)
        return hook

    def _gradient_hook(self, e: _Entry):
        def hook(p: torch.Tensor) -> None:
            # this micro-batch's alone (p.grad is never kept), in one memory order on every rank; zeros where torch
            # runs the hook with none (a tensor made from p handed to blocks that did not use it): every rank that
            # runs it makes the reduce
            grad = p.grad.detach().contiguous() if p.grad is not None else torch.zeros_like(p)
            p.grad = None
            mean = self.dist.reduce_mean_to(grad, e.owner, what="gradient reduce of a partitioned parameter in the "
                                            "backward (zero_optimization.stage 3: every rank must use the same "
                                            "parameters outside the streamed blocks in each backward; a model that "
                                            "skips some on some ranks needs stage 2)")
            if e.owner == self.rank:   # the sum is ours: p.grad was dropped above
                mean = mean.to(e.master.device, torch.float32).view(e.shape)
                if e.master.grad is None:   # in the master's own layout, as optimizers read them side by side
                    e.master.grad = mean if mean.stride() == e.master_stride else \
                        torch.empty_strided(e.shape, e.master_stride, dtype=torch.float32,
                                            device=e.master.device).copy_(mean)
                else:
                    e.master.grad.add_(mean)
            self._drop(e)
        return hook

    def _warn_partial_state_dict(self, module, prefix, keep_vars) -> None:
        if self._whole_for or self._shaped or self._warned_state_dict or all(e.owner == self.rank for e in self.entries):
            return
        self._warned_state_dict = True
        warnings.warn("lazytrain: zero_optimization.stage 3 partitions the parameters outside the streamed blocks: "
                      "the model's state_dict() holds empty tensors for those other ranks own, as DeepSpeed's ZeRO-3 "
                      "does. engine.module_state_dict(), engine.save_checkpoint() and engine.save_16bit_model() "
                      "(on every rank) see them whole", UserWarning, stacklevel=4)

    def refuse_partial_load(self, module: nn.Module, state_dict: dict) -> None:
        """Before a ``load_state_dict`` into ``module`` writes anything (the engine's first load pre-hook): a
        load that names a partitioned parameter (by any of its names) is refused; others go ahead."""
        if not self.active or self._whole_for or self.masters_only:   # masters only: every rank loads its copies,
            return                                                           # the owners their masters (engine.py)
        partitioned = {id(e.param) for e in self.entries}
        if any(id(p) in partitioned and name in state_dict
               for name, p in module.named_parameters(remove_duplicate=False)):
            raise RuntimeError("load_state_dict() at zero_optimization.stage 3: the parameters outside the streamed "
                               "blocks are partitioned across the ranks (each whole on its owner only), so a load "
                               "into the module would reach one rank's part; load with engine.load_checkpoint(), "
                               "or load the weights before lazytrain.initialize()")


def live() -> list[PartitionedParams]:
    """The partitioned engines of this process, in the order they were made (the same on every rank)."""
    return [p for p in (r() for r in _LIVE) if p is not None and p.active]


def _synced_generate(generate):
    """Hugging Face ``generate`` with ``synced_gpus``: a rank whose sequences are done keeps running forwards
    until every rank's are, since each forward broadcasts the partitioned parameters (DeepSpeed's ZeRO-3 asks
    the same of its users, and transformers sets it when it knows ZeRO-3 is on)."""
    @functools.wraps(generate)
    def synced(*args, **kwargs):
        kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)
    return synced


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


def _no_values(dtype: torch.dtype, device: torch.device, shape: torch.Size) -> torch.Tensor:
    """A tensor of ``shape`` holding one element (zero) seen everywhere: a shape without memory."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _tensors(output):
    """The tensors in a module's output: a tensor, or tuples, lists, dicts (Hugging Face's ModelOutput) and
    dataclasses of them."""
    if torch.is_tensor(output):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            yield from _tensors(getattr(output, f.name, None))
