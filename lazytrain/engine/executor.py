"""The layer-streaming executor: runs the model's blocks one at a time with streamed weights, keeps,
offloads or drops each block boundary as a :class:`~lazytrain.planner.plan.Plan` says, and in backward
recomputes each segment from its last kept boundary (one autograd Function per block). When the Plan
says so, the last segment records its graph in forward instead, and backward differentiates it directly;
offloaded layers record theirs too, with what it saves copied to the host (internals_offload.py).

The user's model code is untouched: each block's ``forward`` is routed to the executor, which runs the
block's own class ``forward`` with streamed device weights swapped in. Hugging Face models (which call
each layer with their own keyword arguments) and plain ModuleList models both work, and the model's
parameters and state_dict keys stay as they were.
"""
from __future__ import annotations

import itertools
import threading
import traceback
import warnings
from collections.abc import MutableMapping
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from ..planner.plan import DEVICE_HOME, RECOMPUTE, Plan
from ..tiers import Tier, TransferHandle, streams
from ..tiers.base import completion_reached, wait_completions
from .block_buffers import WrittenBuffers, restored_for_rerun
from .blocks import in_modes, train_modes
from .distributed import CollectiveError
from .internals_offload import OffloadedInternals
from .selective import SelectiveForward
from .tensor_storages import storages
from .weight_stream import WeightStream
from .weights import LayerWeights


class ExecutorError(RuntimeError):
    pass


_streaming = threading.local()   # blocks computing on their streamed weights in this thread (nested: a forward
                                 # run from inside a block's hook)


def inside_a_block() -> bool:
    """Whether this thread is inside a block's call on its streamed weights (its parameters swapped out)."""
    return getattr(_streaming, "depth", 0) > 0


@contextmanager
def _streamed_weights(block: nn.Module, params: dict[str, torch.Tensor], layer: int):
    """Block ``layer`` computes on ``params`` (its weights as streamed, by the names recorded at set-up). A block
    whose modules were replaced since (PEFT's ``merge_and_unload()`` on the live model) no longer has those
    names: refused with the way out, not torch's attribute error from deep inside."""
    stack = ExitStack()
    try:
        stack.enter_context(_reparametrize_module(block, params))
    except AttributeError as e:
        raise ExecutorError(f"block {layer}'s modules changed after initialize() ({e}): LazyTrain streams the "
                            f"parameters it found then. A model rebuilt in place (PEFT's merge_and_unload()) runs "
                            f"after engine.destroy(), which hands the model back") from e
    _streaming.depth = getattr(_streaming, "depth", 0) + 1
    try:
        with stack:
            yield
    finally:
        _streaming.depth -= 1


@dataclass
class _LayerCall:
    """Everything besides the hidden state that one block call received (kept for recompute)."""
    spec: Any                       # pytree spec of (args[1:], kwargs)
    leaves: list                    # non-tensor leaves as given; tensor leaves as given
    tensor_idx: list[int]           # which leaves are tensors
    rng: tuple | None = None        # (CPU, CUDA) generator states before the block's forward (training)
    autocast: tuple = ()            # (device type, dtype, enabled) of torch.autocast at the call
    modes: tuple = ()               # each of the block's modules' ``training`` flag at the call
    held: dict = field(default_factory=dict)   # leaf index -> what a list/dict/mapping argument held at the call
    pass_id: int | None = None      # the training pass it belongs to (its spans say so: a profile counts the
                                    # forwards that were differentiated, not an evaluation's under grad)
    versions: dict = field(default_factory=dict)   # tensor leaf index -> its version at the call (parameters aside)
    held_versions: dict = field(default_factory=dict)   # (container leaf index, path in it) -> (tensor, version)
    buffers_found: list = field(default_factory=list)   # (module, name, value) of each buffer slot the forward
                                                        # wrote, as it found it: what its re-runs start from


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous byte tensor over ``t``'s whole storage: what a tier counts and keeps without a copy."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _is_kv_cache(v) -> bool:
    return hasattr(v, "get_seq_length") and hasattr(v, "update")


def _without_kv_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A re-run block gets no KV cache: its forward already appended its keys and values, and appending
    them again would make it attend over every position twice."""
    return (tuple(None if _is_kv_cache(v) else v for v in args),
            {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()})


def _autocast_state(device: torch.device) -> tuple:
    return tuple((dt, torch.get_autocast_dtype(dt), torch.is_autocast_enabled(dt))
                 for dt in dict.fromkeys(("cpu", device.type)))


@contextmanager
def _replayed_autocast(call: _LayerCall):
    """Re-run (or differentiate) a block under the torch.autocast state of its forward call, as
    torch.utils.checkpoint does: backward runs outside the user's autocast context. Every run goes without
    autocast's cache of casts: it keeps the cast of each fp32 leaf that requires grad until the outermost
    autocast context exits, and the streamed weights are such leaves in every run, so a forward under the
    user's autocast would keep a lower-precision copy of every layer it streamed."""
    with ExitStack() as stack:
        for device_type, dtype, enabled in call.autocast:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled,
                                               cache_enabled=False))
        yield


@contextmanager
def _replayed_rng(call: _LayerCall, device: torch.device):
    """Re-run a block with the random state its forward had, so dropout draws the same masks (as
    torch.utils.checkpoint does), without moving the caller's random stream."""
    if call.rng is None:
        yield
        return
    cpu, cuda = call.rng
    with torch.random.fork_rng(devices=[device] if cuda is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


@dataclass
class _Pass:
    """One forward pass in training mode and the backward that follows it."""
    pass_id: int
    calls: dict[int, _LayerCall] = field(default_factory=dict)
    next_layer: int = 0
    pending_offload: dict[int, list[int]] = field(default_factory=dict)   # window -> boundaries
    held: dict[int, torch.Tensor] = field(default_factory=dict)          # boundary -> device tensor awaiting offload
    copies_out: list = field(default_factory=list)                       # completions of the boundaries' copies off
                                                                         # the device, waited for as the next window begins
    prefetched: dict[int, TransferHandle] = field(default_factory=dict)  # boundary -> read handle
    cache: dict[int, torch.Tensor] = field(default_factory=dict)         # recomputed boundaries (device)
    windows_entered: set = field(default_factory=set)
    owned: set = field(default_factory=set)                              # (tier, key) still allocated
    graphs: dict = field(default_factory=dict)                           # layer -> recorded segment graph
    output_specs: dict = field(default_factory=dict)                     # layer -> pytree spec of what its block
                                                                         # returned, where not a tensor alone
    last_out: Any = None                                                 # (weakref, version): the hidden state the last
                                                                         # block returned (a strong reference would keep
                                                                         # the pass alive through its autograd graph)
    unchained: dict[int, torch.Tensor] = field(default_factory=dict)     # layer -> its input, when that is not
                                                                         # the previous block's output
    input_versions: dict = field(default_factory=dict)                   # layer -> (its input as kept, the version
                                                                         # it had at the call): checked as read back
    inputs_changed: dict = field(default_factory=dict)                   # layer -> the shape of its input, changed
                                                                         # in place before its copy off the device
                                                                         # was over
    shared_writers: dict = field(default_factory=dict)                   # id(mapping) -> (mapping, {key: layer})
    kept_outputs: dict = field(default_factory=dict)                     # selective layer -> (SelectiveForward, tier keys)
    offloaded: dict = field(default_factory=dict)                        # offloaded layer -> OffloadedInternals
    refused_backward: str | None = None                                  # why a backward through it is refused
    released: bool = False                                               # its backward has run to the lowest
                                                                         # layer it reaches
    differentiable: set = field(default_factory=set)                     # layers whose output requires grad: the
                                                                         # ones a backward can reach
    differentiated: set = field(default_factory=set)                     # layers whose backward has run
    end_queued: bool = False                                             # its backward's end is queued (end_backward)
    failed: bool = False                                                 # its backward raised in a block and goes on
                                                                         # with zeros (stages 2 and 3: _BlockFunction)
    weights_epoch: int = 0                                               # the executor's, at its forward
    backward_windows: list | None = None                                 # fetched from layer graph_start's backward
                                                                         # window on (a graph tail's fetch nothing)


class LayerStreamingExecutor:
    """Owns the block weights' streaming and the boundary placement of every training pass."""

    def __init__(self, blocks: nn.ModuleList, plan: Plan, weights: LayerWeights, stream: WeightStream,
                 tiers: dict[str, Tier], device: torch.device, prefetch: bool = True, pass_ids=None,
                 weights_epoch: int = 0, backward_ends_step=None, before_pass=None, outside_params=None):
        if plan.num_layers != len(blocks):
            raise ExecutorError(f"the plan is for {plan.num_layers} layers but the model has {len(blocks)} blocks")
        unstored = plan.unstored_boundaries()
        for i, home in enumerate(plan.homes):
            if home != RECOMPUTE and home not in tiers and i not in unstored:
                raise ExecutorError(f"the plan puts boundary {i} on tier {home!r}, which is not configured "
                                    f"(configured: {', '.join(tiers)})")
        self.blocks = blocks
        self.plan = plan
        self.weights = weights
        self.weights_epoch = weights_epoch   # bumped by every write of the block weights (weights_changed)
        # whether the backward running now ends a step's micro-batches (the engine's accumulation boundary):
        # then it waits for its gradients to land (the step would), so .grad read after it is whole; the
        # others' land while the next micro-batch runs
        self.backward_ends_step = backward_ends_step or (lambda: True)
        # called as block 0 starts a pass, with whether it trains (the engine's check that the model still holds
        # what it streams)
        self.before_pass = before_pass or (lambda training: None)
        # the model's trainable parameters outside the blocks, by name: one a block's forward uses (an adapter kept
        # in another module, applied by a hook or a wrapped forward) would get no gradient from the block's
        # backward, which differentiates the block's own weights alone; looked for at each layer's first backward
        self.outside_params = outside_params or (lambda: [])
        self._checked_for_outside: set[int] = set()
        self._grads_sent: set[int] = set()   # the layers whose gradients the backward under way sent (reduced)
        self._grads_sent_for: int | None = None   # ... of this pass (its number: the pass itself is not held)
        # a backward through the blocks that raised since the step's gradients were last dropped (the error, as
        # text): the layers after the failing one had sent theirs, so the accumulation holds part of it
        self.backward_failure: str | None = None
        # a backward went through a streamed block since the engine last zeroed the gradients (a plain
        # loss.backward() too): the engine then tells an unreached parameter's zero gradient from none
        self.backward_ran = False
        self.stream = stream      # the weights' trip to the device: slots, copies, prefetch order
        self.tiers = tiers
        self.device = device
        self.prefetch = prefetch
        self.L = len(blocks)
        self.pass_ids = pass_ids if pass_ids is not None else itertools.count()   # one numbering per engine
        self._current: _Pass | None = None
        self._streaming_inference = False   # an inference forward's sequence is running
        self.recomputed_layer_forwards = 0
        # the lowest block the last training forward's backward reaches (its blocks' outputs that require grad; L
        # for none), set as that forward ends: the engine checks it against its plan's count (a frozen bottom)
        self.backward_reaches: int | None = None
        self._warned_unchained = False
        self._warned_container_tensor = False
        # per block: the buffers its training forwards write, kept as found for its re-runs (block_buffers.py)
        self._written_buffers = [WrittenBuffers(f"block {i}") for i in range(self.L)]
        self._block_added = _TensorsSeen()      # tensors blocks put into lists/dicts they were handed
        self.graph_start = plan.graph_start()   # layers from here on keep their forward graph
        self.selective = frozenset(plan.selective_layers)   # layers whose forward keeps matmul outputs
        self.offloaded = frozenset(plan.offloaded_layers)   # layers whose graph's saved tensors go to the host
        if self.offloaded and "host" not in tiers:
            raise ExecutorError(f"the plan offloads the internals of layers {sorted(self.offloaded)} to the host, "
                                f"but no 'host' tier is configured (configured: {', '.join(tiers)})")
        self._segment_of = {j: (s, e) for s, e in plan.segments() for j in range(s, e)}
        self._anchor = torch.empty(0, requires_grad=weights.any_trainable)
        # the anchor's gradient accumulator runs exactly when a backward accumulates into leaves' .grad
        # (loss.backward()), not for torch.autograd.grad(...) or backward(inputs=[...])
        self._anchor_node = torch.autograd.graph.get_gradient_edge(self._anchor).node \
            if self._anchor.requires_grad else None
        self._no_anchor = torch.empty(0)   # a frozen block's: its output needs grad only if its inputs do
        self._first_trainable = next((i for i, t in enumerate(weights.trainable) if any(t)), len(blocks))
        self._prefetch_in_window: dict[int, list[int]] = {}   # window -> boundaries whose prefetch it issues
        for i, home in enumerate(plan.homes[:self.graph_start]):
            if home not in (RECOMPUTE, DEVICE_HOME) and i not in self.offloaded:
                self._prefetch_in_window.setdefault(plan.prefetch_at(i), []).append(i)
        self._internals_in_window: dict[int, list[int]] = {}   # window -> offloaded layers whose internals it fetches
        self._internals_out_in_window: dict[int, list[int]] = {}   # window -> ... whose internals' share it sends
        for j in sorted(self.offloaded):
            for w in plan.internals_prefetch_split(j):
                self._internals_in_window.setdefault(w, []).append(j)
            for w in plan.internals_offload_split(j):
                if w > j:
                    self._internals_out_in_window.setdefault(w, []).append(j)
        self._install_proxies()

    # ---- wiring into the user's model ----------------------------------------------------------
    def _install_proxies(self) -> None:
        """Route each block's ``forward`` through the executor. The blocks stay where they are, so the
        model's parameters, ``state_dict()`` keys and hooks are unchanged. A ``forward`` a script set on a
        block itself (a wrapper around the class's) is what the executor calls, with the block's streamed
        weights, as PyTorch would; it is put back by :meth:`uninstall`."""
        self._routed = list(self.blocks)   # the blocks routed here, wherever the model's list holds them later
        self._own_forwards = [block.__dict__.get("forward") for block in self._routed]   # None: the class's
        self._proxies = [_Proxy(self, i) for i in range(len(self._routed))]
        for block, proxy in zip(self._routed, self._proxies):
            block.forward = proxy

    def check_routing(self) -> None:
        """Refuses a block whose ``forward`` was replaced or deleted since set-up: it would run outside the
        executor, with weights it does not stream (a CPU ran it with its host copies and the step never saw its
        gradient; a GPU fails on devices)."""
        for i, (block, proxy) in enumerate(zip(self._routed, self._proxies)):
            if block.__dict__.get("forward") is not proxy:
                raise ExecutorError(
                    f"block {i}'s forward was {'replaced' if 'forward' in block.__dict__ else 'deleted'} after "
                    f"lazytrain.initialize: LazyTrain routes each block's forward through its layer streaming, "
                    f"and calls a forward set on the block before initialize in its place. Set it before "
                    f"lazytrain.initialize, or after engine.destroy(), which hands the model back")

    def uninstall(self) -> None:
        """Each block's ``forward`` as set-up found it (the class's, or the one set on the block)."""
        routed = self.__dict__.get("_routed", self.blocks)
        for block, own in zip(routed, self.__dict__.get("_own_forwards", [None] * len(routed))):
            if isinstance(block.__dict__.get("forward"), _Proxy):
                if own is None:
                    del block.forward
                else:
                    block.forward = own

    # ---- weight streaming ----------------------------------------------------------------------
    def _start_sequence(self, windows: list[list[int]]) -> None:
        """Expect these layers next, window by window (the Plan's windows: each window's layers are
        prefetched while the one before it computes)."""
        with torch.inference_mode(False):   # it prefetches: see _acquire
            self.stream.start(windows)

    def _acquire(self, layer: int) -> torch.Tensor:
        """Layer's compute weights on the device; then start prefetching the next layer in the sequence.
        Outside inference mode even within ``torch.inference_mode()``: the streaming buffers outlive the
        call, and a view of one made in inference mode could not be written later, nor by a tier's
        worker thread (inference mode is per thread)."""
        with torch.inference_mode(False):
            return self.stream.acquire(layer)

    def _backward_windows(self, p: _Pass) -> list[list[int]]:
        """The layers backward fetches, by window: the window differentiating the last layer of a
        re-run segment re-runs the ones before it first. A window of layers no backward reaches (frozen
        blocks below the first trainable one) is left out: their weights are not fetched again."""
        return [w for w in self._all_backward_windows(p) if any(j in p.differentiable for j in w)]

    def _all_backward_windows(self, p: _Pass) -> list[list[int]]:
        windows = []
        for s, e in reversed(self.plan.segments()):
            if s >= self.graph_start:                   # differentiated from the forward's graph
                continue
            if s in self.offloaded:                     # differentiated from its graph, with its weights again
                if p.graphs.get(s) is not None:
                    windows.append([s])
                continue
            if self._keeps_segment_graph(s, e):
                windows.append(list(range(s, e)))       # recompute s..e-1 with grad, once
            else:
                windows.append(list(range(s, e)))       # recompute s..e-2, differentiate e-1
                windows.extend([j] for j in range(e - 2, s - 1, -1))   # differentiate e-2..s
        return windows

    def _keeps_segment_graph(self, s: int, e: int) -> bool:
        """With the CPU as compute device the weights are used in place, so a segment can be recomputed
        once with autograd recording and then differentiated layer by layer from the recorded graph
        (on a GPU the streaming slots are reused, so each layer is re-run when it is differentiated)."""
        return e - s > 1 and self.stream.zero_copy

    # ---- running a block ---------------------------------------------------------------------
    def _compute(self, layer: int, flat: torch.Tensor, hidden: torch.Tensor, call: _LayerCall,
                 tensors: list | None = None, requires_grad: bool = False, replay: bool = False,
                 kept=nullcontext(), inference: bool = False):
        """Run block ``layer`` on ``flat`` weights; ``replay``: a re-run, with its forward's random state;
        ``kept``: a context deciding what the block's autograd keeps (the selective cache that records or
        serves its kept outputs; the host offload of what its graph saves); ``inference``: a forward without
        autograd, traced as "infer" (no step's forward: policy auto leaves a step with one out)."""
        # every run sees the trainable weights as leaves that require grad, as a plain PyTorch model's
        # parameters always are: some ops choose how to compute by it (matmul of a transposed input rounds
        # otherwise), so a forward, its re-runs and plain PyTorch compute alike. Runs without autograd
        # (the forward, the no-grad recompute, inference) record nothing for it.
        if layer in self.selective and hidden.is_floating_point() and not hidden.requires_grad:
            # a selective block's re-run with autograd takes the outputs its forward kept: every run sees
            # its hidden state as that re-run does, too
            hidden = hidden.detach().requires_grad_()
        if replay:
            _check_arguments_unchanged(call, layer)
        params = self.weights.views(flat, layer, requires_grad=True)
        leaves = list(call.leaves)
        if tensors is not None:
            for k, t in zip(call.tensor_idx, tensors):
                leaves[k] = t
        if replay:   # a re-run sees its containers as the forward call did, and its additions go nowhere
            for k, held in call.held.items():
                leaves[k] = _fresh_copy(leaves[k], held)
        rest_args, kwargs = tree_unflatten(leaves, call.spec)
        if replay:
            rest_args, kwargs = _without_kv_cache(rest_args, kwargs)
        block = self.blocks[layer]
        # the simulator's task names: a re-run with grad is the first half of its "diff" (the second: "bwd")
        kind = ("infer" if inference else "fwd") if not replay else ("diff" if requires_grad else "recompute")
        # a traced plain re-run with autograd also measures what the block's graph saves (the planner's
        # internals of a layer), beside the weights, its input and the tensors the call passes in
        saved = (_SavedBytes([flat, hidden, *(t for t in leaves if isinstance(t, torch.Tensor))])
                 if kind == "diff" and isinstance(kept, nullcontext) and streams.recording() is not None else None)
        pass_arg = {} if call.pass_id is None else {"pass": call.pass_id}
        # a layer its backward re-runs (not one differentiated from the graph its forward recorded)
        rerun_later = not inference and not replay and layer < self.graph_start and layer not in self.offloaded
        rerun_buffers = (restored_for_rerun(block, call.buffers_found, self._written_buffers[layer]) if replay
                         else nullcontext())
        with streams.compute_span(f"{kind} L{layer}", self.device, **pass_arg) as span, \
                _replayed_rng(call, self.device) if replay else nullcontext(), _replayed_autocast(call), \
                rerun_buffers, \
                self._written_buffers[layer].watching(block, call.buffers_found) if rerun_later else nullcontext(), \
                in_modes(block, call.modes) if replay else nullcontext(), \
                _streamed_weights(block, params, layer), kept, saved if saved is not None else nullcontext():
            hidden_version = None if inference or hidden.is_inference() else hidden._version
            try:
                own = self._own_forwards[layer]   # a forward set on the block before set-up, else its class's
                out = (own(hidden, *rest_args, **kwargs) if own is not None else
                       type(block).forward(block, hidden, *rest_args, **kwargs))
            except RuntimeError as e:
                _note_fp32_buffers(e, block, layer, self.weights.compute_dtype)
                if "leaf Variable that requires grad is being used in an in-place operation" in str(e):
                    raise ExecutorError(_CHANGED_INPUT.format(
                        layer=layer, what="a tensor it was given (its hidden state or an argument)")) from e
                raise
            if rerun_later and hidden_version is not None and hidden._version != hidden_version:
                raise ExecutorError(_CHANGED_INPUT.format(layer=layer, what="its hidden state"))
            if rerun_later:
                _check_arguments_unchanged(call, layer, by_the_block=True)
            if saved is not None:
                span.args["saved_bytes"] = saved.nbytes
        return out, params

    @staticmethod
    def _hidden_of(out) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out[0]

    @staticmethod
    def _outputs(out) -> tuple:
        """A block's outputs as a flat tuple: the hidden state, then every leaf of whatever else it returned
        (an auxiliary loss, in nested tuples, lists or dicts too), in the order the streamed call returns them,
        so that backward can differentiate every output the loss used."""
        return (out,) if isinstance(out, torch.Tensor) else tuple(tree_flatten(out)[0])

    def run(self, layer: int, args: tuple, kwargs: dict):
        """Called by the proxy of block ``layer`` with the arguments the model gave it."""
        if not args:
            if "hidden_states" not in kwargs:
                raise ExecutorError(f"block {layer} was called without a hidden-state tensor")
            kwargs = dict(kwargs)
            args = (kwargs.pop("hidden_states"),)
        hidden = args[0]
        rest = args[1:]
        if torch.is_grad_enabled():
            self._check_kv_cache(layer, rest, kwargs)
        # lists and dicts go to the block as they are (it may append to or fill them for the model or for
        # later blocks); tuples and tensors are taken apart so that tensors become inputs of the block
        leaves, spec = tree_flatten((rest, kwargs), is_leaf=lambda v: v is not kwargs and isinstance(v, (list, dict)))
        call = _LayerCall(spec, leaves, [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)],
                          autocast=_autocast_state(self.device),
                          modes=train_modes(self.blocks[layer]))
        if not torch.is_grad_enabled():
            return self._run_inference(layer, hidden, call)
        return self._run_training(layer, hidden, call)

    @staticmethod
    def _check_kv_cache(layer: int, args: tuple, kwargs: dict) -> None:
        """A training forward may hand its blocks an empty KV cache (transformers does whenever
        ``use_cache`` is on, by keyword or, as GPT-2, by position): the forward extends it once, as plain
        PyTorch does, and re-runs go without it (:func:`_without_kv_cache`). A cache that already holds
        positions cannot work: the re-run would attend over fewer positions than the forward did."""
        for v in (*args, *kwargs.values()):
            if _is_kv_cache(v) and v.get_seq_length(layer) > 0:
                raise ExecutorError(f"block {layer} got a KV cache already holding {v.get_seq_length(layer)} "
                                    f"positions in a forward with gradients: training through streamed blocks "
                                    f"cannot extend a cache (blocks are re-run in backward); run it under "
                                    f"torch.no_grad() or pass use_cache=False")

    def _run_inference(self, layer: int, hidden: torch.Tensor, call: _LayerCall):
        if layer == 0 or not self._streaming_inference:   # a pass begins (an evaluation may begin at any block)
            self.before_pass(False)
            self._start_sequence([[j] for j in range(layer, self.L)])
            self._streaming_inference = True
        flat = self._acquire(layer)
        out, _ = self._compute(layer, flat, hidden, call, inference=True)
        return out

    def _run_training(self, layer: int, hidden: torch.Tensor, call: _LayerCall):
        if layer == 0:
            refused = self.before_pass(True)   # (a message: the pass runs, a backward through it is refused)
            self._begin_pass()
            self._current.refused_backward = refused
        p = self._current
        if p is None or layer != p.next_layer:
            self.before_pass(True)   # a changed model says what changed (its blocks reordered, say)
            if p is None and layer > 0 and self._streaming_inference:
                raise ExecutorError(f"block {layer} was called with gradients enabled after the blocks below it ran "
                                    f"without (under torch.no_grad()): a training forward runs every streamed "
                                    f"block with gradients, from block 0. To leave the bottom blocks out of "
                                    f"training, freeze them (requires_grad_(False)) before lazytrain.initialize(): "
                                    f"a backward then stops above them")
            expected = p.next_layer if p else 0
            skipped = (": a model that skips blocks in training (LayerDrop: a config's 'layerdrop' > 0; stochastic "
                       "depth that leaves a block's call out) cannot stream them; set its layerdrop to 0, or skip "
                       "inside the block (return its input)" if layer > expected else "")
            raise ExecutorError(f"streamed blocks must run in order 0..{self.L - 1} once per forward pass; block "
                                f"{layer} was called when block {expected} was expected{skipped}")
        p.next_layer += 1
        if layer > 0 and (p.last_out is None or not _alias_of(hidden, p.last_out[0]())
                          or hidden._version != p.last_out[1]):   # replaced, or changed in place
            self._keep_unchained_input(p, layer, hidden)
        call.rng = _rng_state(self.device)
        call.pass_id = p.pass_id
        # what its re-runs check they are given again (_check_arguments_unchanged); a parameter is the engine's
        # to write (a stage-3 gather), and a step between a forward and its backward is refused on its own
        call.versions = {k: v._version for k, v in enumerate(call.leaves) if isinstance(v, torch.Tensor)
                         and not isinstance(v, nn.Parameter) and not v.is_inference()}
        p.calls[layer] = call
        tensors = [call.leaves[k] for k in call.tensor_idx]
        _watch_shared_state(p, layer, call)
        call.held = {k: _contents(v) for k, v in enumerate(call.leaves)   # what re-runs in backward will see
                     if isinstance(v, (list, dict, _SharedStateWatch))}
        call.held_versions = {(k, path): (t, t._version) for k, held in call.held.items()
                              if not isinstance(call.leaves[k], _SharedStateWatch)   # (its reads are refused)
                              for path, t in tree_flatten_with_path(held)[0]
                              if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
                              and not t.is_inference()}
        containers = _container_snapshot(layer, call, self._block_added)
        # the anchor makes the block's output require grad even when nothing flowing in does (frozen
        # embeddings): the block's own weights still need their backward. The frozen blocks below the first
        # trainable one get none: nothing there needs a backward unless their input does (no re-run, no weights
        # streamed back, as in PyTorch). A frozen block above it keeps the anchor: a re-run segment is
        # recomputed by its last layer's backward, whatever trains below it in the segment
        anchor = self._anchor if layer >= self._first_trainable else self._no_anchor
        result = _BlockFunction.apply(self, p, layer, anchor, hidden, *tensors)
        out_hidden, extras = result[0], result[1:]
        if out_hidden.requires_grad:
            p.differentiable.add(layer)
        p.last_out = (weakref.ref(out_hidden), out_hidden._version)
        # what the block was handed, by what it got: the tensors themselves in a re-run layer; in a layer that
        # recorded its graph, the fresh leaves it computed from, each standing for the tensor it was made of
        handed = {id(t): t for t in (hidden, *tensors) if isinstance(t, torch.Tensor)}
        if p.graphs.get(layer) is not None:
            x_in, _, _, t_in = p.graphs[layer]
            handed.update({id(leaf): t for leaf, t in zip((x_in, *t_in), (hidden, *tensors))
                           if isinstance(leaf, torch.Tensor)})
        if _added_tensors(containers, self._block_added, handed) and not self._warned_container_tensor:
            self._warned_container_tensor = True
            warnings.warn(f"lazytrain: block {layer} added a tensor to a list or dict it was handed, in a training "
                          f"forward: a tensor the block makes carries no gradient (streamed blocks run without "
                          f"autograd in the forward). If the loss uses it (an auxiliary loss), return it from the "
                          f"block instead: a block's extra outputs are differentiated")
        if p.next_layer == self.L:   # forward done: start fetching the first weights backward needs
            if all(completion_reached(done) for done in p.copies_out):   # (waits for none)
                self._settle_copied_inputs(p)
            self.backward_reaches = min(p.differentiable, default=self.L)
            windows = self._backward_windows(p)
            if self.graph_start < self.L and windows:
                # the graph tail's backward windows fetch nothing: as in the Plan, the first window that
                # does is fetched while the window before it (layer graph_start's) computes, not all
                # through the tail's backward, whose windows the Plan charges no streamed weights
                p.backward_windows = windows
            else:
                self._start_sequence(windows)
            # the pass now lives only as long as its autograd graph: a forward never differentiated
            # frees its kept boundaries and graphs with that graph, not at the next forward
            self._current = None
        spec = p.output_specs.get(layer)
        return out_hidden if spec is None else tree_unflatten([out_hidden, *extras], spec)

    # ---- forward bookkeeping -------------------------------------------------------------------
    def _begin_pass(self) -> None:
        self._streaming_inference = False
        p = _Pass(next(self.pass_ids), weights_epoch=self.weights_epoch)
        # a pass whose graph is dropped without backward (e.g. a forward under grad for evaluation)
        # frees what it still holds when it is garbage-collected
        weakref.finalize(p, _free_owned, self.tiers, p.owned)
        self._current = p
        self._start_sequence([[j] for j in range(self.L)])

    def weights_changed(self) -> None:
        """The block weights were written (a step, a load): a pass taken before cannot be differentiated."""
        self.weights_epoch += 1

    def _key(self, p: _Pass, boundary: int) -> str:
        return f"pass{p.pass_id}.boundary{boundary}"

    def _keep_boundary(self, p: _Pass, i: int, x: torch.Tensor) -> None:
        home = self.plan.homes[i]
        if home == RECOMPUTE or i >= self.graph_start or i in self.offloaded:   # graphs hold their own inputs
            return
        x = x.detach()   # (its version counter is the model's tensor's)
        if home == DEVICE_HOME and not x.is_contiguous():
            x = x.contiguous()   # the tier's copy, made here: the model cannot change it, nothing to watch
        else:
            p.input_versions[i] = (x, x._version)   # until read back, or until its copy off the device is over
        if home == DEVICE_HOME:
            self._put(p, DEVICE_HOME, self._key(p, i), x, owned=True)
            return
        w = self.plan.offload_at(i)
        if w <= i:
            p.copies_out.append(self._put(p, home, self._key(p, i), x).completion())
        else:  # held on the device until its offload window
            self._put(p, DEVICE_HOME, self._key(p, i) + ".held", x, owned=True)
            p.held[i] = x
            p.pending_offload.setdefault(w, []).append(i)

    def _keep_unchained_input(self, p: _Pass, i: int, x: torch.Tensor) -> None:
        """Block i's input is not what block i-1 returned (the model changed the hidden state between
        blocks, or feeds every block the same input): a re-run segment cannot derive it from block i-1's
        output, so it is kept as given, on the device, whatever the plan's home for boundary i."""
        if self.plan.homes[i] != RECOMPUTE or i >= self.graph_start or i in self.offloaded:
            return   # kept, or recorded as given anyway
        if not self._warned_unchained:
            self._warned_unchained = True
            warnings.warn(f"lazytrain: block {i}'s input is not block {i - 1}'s output (the model changes the "
                          f"hidden state between blocks); such inputs are kept on the compute device for "
                          f"backward, outside the plan's memory budget")
        x = x.detach()
        self._put(p, DEVICE_HOME, self._key(p, i) + ".input", x, owned=True)
        p.unchained[i] = x
        p.input_versions[i] = (x, x._version)

    def _put(self, p: _Pass, tier: str, key: str, x: torch.Tensor, owned: bool = False) -> TransferHandle:
        handle = self.tiers[tier].write(key, x, owned=owned)
        p.owned.add((tier, key))
        return handle

    def _drop(self, p: _Pass, tier: str, key: str) -> None:
        failure = _failed_to_free(self.tiers[tier], key)
        p.owned.discard((tier, key))
        _warn_failed_free(self.tiers[tier], failure)

    def _enter_window(self, p: _Pass, w: int) -> None:
        if w in p.windows_entered:
            return
        p.windows_entered.add(w)
        self._end_copies_out(p)
        for i in p.pending_offload.pop(w, []):
            x = p.held.pop(i)
            p.copies_out.append(self._put(p, self.plan.homes[i], self._key(p, i), x).completion())
            self._drop(p, DEVICE_HOME, self._key(p, i) + ".held")
        for j in self._internals_out_in_window.get(w, ()):   # a copy out is no prefetch: it always runs
            if j in p.offloaded:
                p.offloaded[j].send_through(w)
        if not self.prefetch:
            return
        for i in self._prefetch_in_window.get(w, ()):
            if i not in p.prefetched and i not in p.inputs_changed and self._reached_by_backward(p, i):
                self._issue_prefetch(p, i)   # (a changed input is refused as backward reads it)
        for j in self._internals_in_window.get(w, ()):
            if j in p.offloaded:
                p.offloaded[j].prefetch(w)

    def _reached_by_backward(self, p: _Pass, i: int) -> bool:
        """Whether a backward re-runs from boundary ``i`` (stored: layer ``i`` has run): a layer of its segment
        from the first trainable one on, or one whose output required grad (below it, only where the input
        did). One that has not run yet counts as not: a read it then needs is issued on demand."""
        s, e = self._segment_of[i]
        return e - 1 >= self._first_trainable or any(j in p.differentiable for j in range(s, min(e, p.next_layer)))

    def _end_copies_out(self, p: _Pass) -> None:
        """Wait for the copies off the device that the windows before issued (boundaries, offloaded layers'
        internals), as the Plan's windows end with them: the planner counts that device memory free once
        they are over. A failed copy is raised where backward reads what it held, not here."""
        copies, p.copies_out = p.copies_out, []
        wait_completions(copies, "boundaries out", self.device)
        self._settle_copied_inputs(p)
        for internals in p.offloaded.values():
            internals.wait_sent()

    def _settle_copied_inputs(self, p: _Pass) -> None:
        for i, (x, version) in list(p.input_versions.items()):   # copied off: its copy is what backward reads
            if i not in p.held and i not in p.unchained and self.plan.homes[i] not in (DEVICE_HOME, RECOMPUTE):
                del p.input_versions[i]
                if x._version != version:
                    p.inputs_changed[i] = tuple(x.shape)

    def _issue_prefetch(self, p: _Pass, i: int) -> TransferHandle:
        if i in p.held:      # still on the device: nothing to fetch
            return TransferHandle(value=p.held[i])
        handle = self.tiers[self.plan.homes[i]].read(self._key(p, i), device=self.device)
        p.prefetched[i] = handle
        return handle

    # ---- backward ------------------------------------------------------------------------------
    def _boundary(self, p: _Pass, i: int) -> torch.Tensor:
        """Boundary i on the device during backward: from its tier, or from the recompute cache."""
        home = self.plan.homes[i]
        if home == RECOMPUTE:
            if i not in p.cache:
                raise ExecutorError(f"boundary {i} was neither kept nor recomputed (internal error)")
            return p.cache[i]
        self._check_input_unchanged(p, i)
        if home == DEVICE_HOME:
            return self.tiers[DEVICE_HOME].read(self._key(p, i)).wait()
        if i in p.held:
            return p.held[i]
        handle = p.prefetched.get(i) or self._issue_prefetch(p, i)
        with streams.wait_span(f"boundary {i}", self.device):
            x = handle.wait()   # a failed read: _BlockFunction.backward drops the pass's reads
        if x.device != self.device:
            x = x.to(self.device)
        return x

    @staticmethod
    def _check_input_unchanged(p: _Pass, i: int) -> None:
        """Block i's input, kept as the model's own tensor (not copied) until backward or until its copy off the
        device was over, must not have been changed in place since the block was called (``x += block(x)``):
        the re-run would start from the changed values, and train wrong without a word."""
        x, version = p.input_versions.get(i, (None, None))
        if i in p.inputs_changed or (x is not None and x._version != version):
            shape = f" (a tensor of shape {p.inputs_changed.get(i) or tuple(x.shape)})"
            raise ExecutorError(f"block {i}'s hidden-state input{shape} was changed in place after the forward "
                                f"called the block: the backward re-runs the block from the input its forward was "
                                f"given, and would see other values. Change a copy instead (x = x + y, not "
                                f"x += y), or change it after the backward")

    def _selective_forward(self, p: _Pass, layer: int):
        """The cache a selective layer's forward records into (its kept outputs counted on the device tier
        until its backward); no cache for other layers."""
        if layer not in self.selective:
            return nullcontext()
        s, e = self._segment_of[layer]
        reruns = 1 if layer == e - 1 or self._keeps_segment_graph(s, e) else 2   # + the no-grad recompute
        return self._counted(p, layer, SelectiveForward(reruns))

    @contextmanager
    def _counted(self, p: _Pass, layer: int, kept: SelectiveForward):
        with kept.recording():
            yield
        # counted where they are: a kept op's host-side results beside a device's compute (CUDA flash
        # attention's random seed and offset, 0-dim CPU tensors) take no device memory and stay as they are
        tensors = [t for t in kept.tensors() if t.device.type == self.device.type]
        keys = [f"{self._key(p, layer)}.kept{k}" for k in range(len(tensors))]
        for key, t in zip(keys, tensors):   # counted as the storage it is, never copied
            self._put(p, DEVICE_HOME, key, _whole_storage(t), owned=True)
        p.kept_outputs[layer] = (kept, keys)

    def _rerun(self, p: _Pass, layer: int, flat, hidden, call: _LayerCall, tensors=None, requires_grad=False):
        """A re-run of ``layer`` (replaying its forward), taking a selective layer's kept outputs. A re-run
        whose kept ops did not line up one for one with its forward's after it took some may have served an
        op another's output: it runs again without them (as a layer that is not selective), with a warning."""
        kept = p.kept_outputs.get(layer)
        context = kept[0].next_rerun() if kept is not None else nullcontext()
        out, params = self._compute(layer, flat, hidden, call, tensors, requires_grad=requires_grad, replay=True,
                                    kept=context)
        if hasattr(context, "whole") and not context.whole():
            warnings.warn(f"lazytrain: selective layer {layer}'s re-run ran other kept ops than its forward after "
                          f"taking kept outputs; it runs again without them", UserWarning)
            del out, params   # the first run's graph goes before the second builds its own
            out, params = self._compute(layer, flat, hidden, call, tensors, requires_grad=requires_grad, replay=True)
        return out, params

    def _drop_kept_outputs(self, p: _Pass, layer: int) -> None:
        _, keys = p.kept_outputs.pop(layer, (None, ()))
        for key in keys:
            self._drop(p, DEVICE_HOME, key)

    def _recompute_segment(self, p: _Pass, s: int, e: int) -> None:
        x = self._boundary(p, s)
        with torch.no_grad():
            for j in range(s, e - 1):
                flat = self._acquire(j)
                out, _ = self._rerun(p, j, flat, x, p.calls[j])
                if j + 1 in p.unchained:
                    self._check_input_unchanged(p, j + 1)
                    x = p.unchained[j + 1]
                else:
                    x = self._hidden_of(out).detach()
                    self._put(p, DEVICE_HOME, self._key(p, j + 1) + ".recomputed", x, owned=True)
                p.cache[j + 1] = x
                self.recomputed_layer_forwards += 1

    def _record_segment(self, p: _Pass, s: int, e: int) -> None:
        """Recompute layers s..e-1 once with autograd recording; each layer's input is its own leaf so
        that every layer is still differentiated (and its gradients sent) separately."""
        x = self._boundary(p, s)
        for j in range(s, e):
            tensors = [p.calls[j].leaves[k] for k in p.calls[j].tensor_idx]
            x_in, out, params, t_in = self._forward_with_grad(p, j, x, True, [t.requires_grad for t in tensors])
            p.graphs[j] = (x_in, self._outputs(out), params, t_in)
            if j + 1 in p.unchained:
                self._check_input_unchanged(p, j + 1)
            x = p.unchained.get(j + 1, p.graphs[j][1][0].detach())
        self.recomputed_layer_forwards += e - s - 1

    def _forward_with_grad(self, p: _Pass, layer: int, x: torch.Tensor, x_needs_grad: bool, side_needs,
                           keep: bool = False):
        """Run one block with autograd recording, its input and side tensors as fresh leaves, so the
        block can be differentiated on its own. Returns (input leaf, output, params, side inputs).
        ``keep``: the graph outlives the next weight fetch (a graph layer, recorded in its forward), so
        weights held in a streaming slot are copied to a buffer of the layer's own first; any other call
        is a re-run, with the random state of the layer's forward."""
        call = p.calls[layer]
        tensors = [call.leaves[k] for k in call.tensor_idx]
        x_in = x.detach().requires_grad_(x_needs_grad)
        t_in = [t.detach().requires_grad_(True) if (t.is_floating_point() and need) else t
                for t, need in zip(tensors, side_needs)]
        flat = self._acquire(layer)
        kept = nullcontext()
        if keep and layer in self.offloaded:   # its weights are streamed again for its backward
            internals = p.offloaded[layer] = OffloadedInternals(
                self.tiers["host"], f"pass{p.pass_id}.layer{layer}", self.device, flat, p.owned, window=layer,
                out_split=self.plan.internals_offload_shares.get(layer),
                back_split=self.plan.internals_prefetch_shares.get(layer))
            kept = internals.recording()
        elif keep and not self.stream.zero_copy and layer not in self.stream.resident:
            flat = flat.clone()
            self._put(p, DEVICE_HOME, self._key(p, layer) + ".weights", flat, owned=True)
        with torch.enable_grad():
            if keep:
                out, params = self._compute(layer, flat, x_in, call, t_in, requires_grad=True, kept=kept)
            else:
                out, params = self._rerun(p, layer, flat, x_in, call, t_in, requires_grad=True)
        if keep and layer in self.offloaded and not self.stream.zero_copy and layer not in self.stream.resident:
            held = p.offloaded[layer].weights_kept_outside_saved_tensors(self._outputs(out))
            if held:   # their backward would read whatever layer the streaming buffer holds by then
                raise ExecutorError(f"block {layer} is an offloaded layer, and autograd Function(s) {', '.join(held)} "
                                    f"in it keep a view of its weights as an attribute of ctx rather than through "
                                    f"ctx.save_for_backward: its weights are streamed again for its backward into a "
                                    f"buffer other layers use in between, so that backward would read other "
                                    f"weights. Save them with ctx.save_for_backward, or leave layer {layer} out of "
                                    f"the plan's offloaded_layers")
        return x_in, out, params, t_in

    def _free_boundary(self, p: _Pass, i: int) -> None:
        self._drop_kept_outputs(p, i)   # layer i is differentiated: its selective cache is spent
        p.input_versions.pop(i, None)
        home = self.plan.homes[i]
        key = self._key(p, i)
        if i >= self.graph_start:          # a graph layer: only its own weight copy, if it made one
            self._drop(p, DEVICE_HOME, key + ".weights")
            return
        if i in self.offloaded:            # its saved tensors on the host (boundary i was not stored)
            internals = p.offloaded.pop(i, None)
            if internals is not None:
                internals.release()
            return
        if home == RECOMPUTE:
            p.cache.pop(i, None)
            self._drop(p, DEVICE_HOME, key + ".recomputed")
            if p.unchained.pop(i, None) is not None:
                self._drop(p, DEVICE_HOME, key + ".input")
            return
        # the prefetch's handle first: on CUDA it keeps a view of the host buffer it read, and a buffer still
        # viewed when its key is freed leaves the host pool (unpinned, and pinned again by the next forward)
        p.prefetched.pop(i, None)
        self._drop(p, home, key)
        if p.held.pop(i, None) is not None:
            self._drop(p, DEVICE_HOME, key + ".held")

    def accumulates_weight_grads(self) -> bool:
        """Whether the running backward accumulates into the weights' gradients: ``loss.backward()``
        does; ``torch.autograd.grad(loss, inputs)`` and ``backward(inputs=[...])`` do not, and must leave
        the blocks' gradient buffers as they were."""
        return self._anchor_node is not None and torch._C._will_engine_execute_node(self._anchor_node)

    def backward_layer(self, p: _Pass, layer: int, grad_outs: tuple, needs_input_grad: tuple,
                       accumulate: bool = True):
        """``grad_outs``: the gradient of each of the block's outputs (None where the loss did not use it);
        ``accumulate``: add the block's weight gradients into its host buffers."""
        if p.released or layer in p.differentiated:
            raise ExecutorError("this forward's streamed blocks were already differentiated and their kept "
                                "boundaries freed: a second backward through the same forward "
                                "(backward(retain_graph=True), then backward again) is not supported; run the "
                                "forward again")
        if p.refused_backward is not None and accumulate:
            raise ExecutorError(p.refused_backward)
        p.differentiated.add(layer)
        self._sent_in(p)
        if accumulate and not p.end_queued:
            # at the backward's end (its final callback) the block parameters' .grad show their buffers again
            # (a zero_grad(set_to_none=True) since cleared them), as PyTorch's show a backward's gradients; at
            # the step's last micro-batch, once the gradients landing on a worker thread have (a failed copy
            # is kept for the step to raise), so .grad read after it is the whole backward's
            p.end_queued = True
            settle = self.weights.grads_in_flight and self.backward_ends_step()
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.weights.end_backward(settle=settle))
        if p.weights_epoch != self.weights_epoch:   # PyTorch refuses it too (a variable modified in place)
            raise ExecutorError(f"block {layer}'s weights changed (an optimizer step or a load) between this forward "
                                f"and its backward: the backward would re-run the blocks with the new weights "
                                f"against boundaries the old ones made. Differentiate a forward before step(), or "
                                f"run it again after")
        if self.weights.written_since_copied(layer):   # a script's in-place write since this forward's copy
            raise ExecutorError(f"block {layer}'s parameters were written in place between this forward and its "
                                f"backward: the backward would re-run the block with weights the forward did not "
                                f"use (PyTorch refuses it too). Write them before the forward, or after its backward")
        self._enter_window(p, 2 * self.L - 1 - layer)
        if layer == self.graph_start and p.backward_windows is not None:
            windows, p.backward_windows = p.backward_windows, None
            self._start_sequence(windows)
        s, e = self._segment_of[layer]
        if layer == e - 1 and e - s > 1 and layer < self.graph_start:
            if self._keeps_segment_graph(s, e):
                self._record_segment(p, s, e)
            else:
                self._recompute_segment(p, s, e)
        weights_now = None   # the block's weights where backward reads them, when not where the forward did
        if layer in p.graphs:
            graph = p.graphs.pop(layer)     # None: a frozen graph layer with no gradient to pass on
            if graph is not None and layer in p.offloaded:
                flat = self._acquire(layer)
                p.offloaded[layer].use_weights(flat)
                weights_now = self.weights.views(flat, layer, requires_grad=True)
        else:
            x_in, out, params, t_in = self._forward_with_grad(p, layer, self._boundary(p, layer),
                                                              needs_input_grad[0], needs_input_grad[1:])
            graph = (x_in, self._outputs(out), params, t_in)
        if graph is None:
            g_x, t_grads = None, [None] * len(p.calls[layer].tensor_idx)
        else:
            g_x, t_grads = self._differentiate(layer, graph, grad_outs, needs_input_grad[0], accumulate,
                                               weights_now)
        self._free_boundary(p, layer)
        if layer == min(p.differentiable):   # the lowest a backward reaches: block 0, or the first trainable one
            self.release_pass(p)
        return g_x, t_grads

    def _differentiate(self, layer: int, graph: tuple, grad_outs: tuple, x_needs_grad: bool,
                       accumulate: bool = True, weights_now: dict | None = None):
        """Backward through one block's recorded graph, from each output the loss used: its weight
        gradients go to the host buffers; returns the gradients of its input and side tensors.
        ``weights_now``: views of the block's weights where they are now, when the forward's slot was
        given up (an offloaded layer's); a checkpoint inside the block re-runs from them."""
        x_in, outs, params, t_in = graph
        used = [(o, g) for o, g in zip(outs, grad_outs)
                if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        with torch.enable_grad():
            trainable = [(n, t) for n, t in params.items() if t.requires_grad] if accumulate else []
            want_x = x_needs_grad and x_in.requires_grad
            inputs = ([x_in] if want_x else []) + [t for _, t in trainable] + \
                [t for t in t_in if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs and used:
                # a checkpoint the block runs itself re-runs its function here, from the block's attributes:
                # they must be the weights the graph was built with, not the module's own
                with streams.compute_span(f"bwd L{layer}", self.device), \
                        _streamed_weights(self.blocks[layer], params if weights_now is None else weights_now, layer):
                    if layer not in self._checked_for_outside:
                        self._refuse_outside_params(layer, [o for o, _ in used])
                    try:
                        grads = torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used],
                                                    allow_unused=True)
                    except RuntimeError as e:
                        if not str(e).startswith("Trying to backward through the graph a second time"):
                            raise
                        raise ExecutorError(_DIFFERENTIATED_INSIDE.format(layer=layer)) from None
            else:
                grads = (None,) * len(inputs)
        n, first = len(trainable), int(want_x)
        weight_grads = {name: g for (name, _), g in zip(trainable, grads[first:first + n]) if g is not None}
        # nothing to send for a frozen layer, or a backward that accumulates none; but when the gradients go
        # to their owners as they land, every rank lands every trainable layer its backward reaches (zeros
        # where this rank's batch gave the layer no gradient, as an expert no token reached)
        if weight_grads or (trainable and self.weights.grads_to_owners):
            to_owners = self.weights.reduced_as_landed
            made = to_owners.sequence if to_owners is not None else None
            try:
                self.weights.accumulate_grads(layer, weight_grads)
            except BaseException:
                if to_owners is not None and to_owners.sequence != made:   # its reduce was made: what failed
                    self._grads_sent.add(layer)                            # came after it (the owner's add)
                raise
            self._grads_sent.add(layer)
        side = iter(grads[first + n:])
        t_grads = [next(side) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in t_in]
        return grads[0] if want_x else None, t_grads

    def _sent_in(self, p: "_Pass") -> set[int]:
        """The layers whose gradients ``p``'s backward sent: a new set as its backward begins (a pass is
        differentiated once)."""
        if self._grads_sent_for != p.pass_id:
            self._grads_sent_for, self._grads_sent = p.pass_id, set()
        return self._grads_sent

    def send_zeros_after_failure(self, p: "_Pass", layer: int) -> None:
        """A block of a backward that raised in it or above it, where each layer's gradient is reduced to its
        owner as it lands (stages 2 and 3): its gradient is sent as zeros, as a backward that reached it with no
        gradient would (once: not where its reduce was made before what failed)."""
        sent = self._sent_in(p)
        if layer in p.differentiable and layer not in sent and any(self.weights.trainable[layer]):
            sent.add(layer)
            self.weights.accumulate_grads(layer, {})

    def _refuse_outside_params(self, layer: int, outputs: list[torch.Tensor]) -> None:
        """Refused by name: a trainable parameter registered outside the blocks that block ``layer``'s graph
        reaches (plain PyTorch would train it; here it got no gradient, in silence). Once per layer: the graph's
        shape is the block's code."""
        self._checked_for_outside.add(layer)
        outside = [(name, p) for name, p in self.outside_params() if p.requires_grad]
        if not outside:
            return
        reached = torch.autograd.grad(outputs, [p for _, p in outside], [torch.ones_like(o) for o in outputs],
                                      retain_graph=True, allow_unused=True)
        used = [name for (name, _), g in zip(outside, reached) if g is not None]
        if used:
            raise ExecutorError(f"block {layer} computes with {used[0]!r}" + (f" and {len(used) - 1} more" if
                                len(used) > 1 else "") + ", a trainable parameter registered outside the "
                                "streamed blocks: LazyTrain differentiates a block's own weights, so it would get "
                                "no gradient from the block. Register it inside the block (as a submodule of the "
                                "module that uses it), or freeze it before lazytrain.initialize()")

    def release_pass(self, p: _Pass) -> None:
        """Free everything a pass still holds."""
        p.released = True
        offloaded, p.offloaded = p.offloaded, {}
        try:
            for internals in offloaded.values():   # their reads in flight end before their keys go
                internals.release()
        finally:
            p.prefetched.clear()   # before the keys go, as in _free_boundary
            _free_owned(self.tiers, p.owned)
            p.held.clear()
            p.cache.clear()
            p.graphs.clear()
            p.calls.clear()
            p.unchained.clear()
            p.input_versions.clear()
            p.shared_writers.clear()
            p.kept_outputs.clear()
            if self._current is p:
                self._current = None

    def forward_window(self, p: _Pass, layer: int, x: torch.Tensor) -> None:
        self._enter_window(p, layer)
        self._keep_boundary(p, layer, x)


_DIFFERENTIATED_INSIDE = (
    "block {layer}'s forward graph was differentiated before its own backward: the loss uses a tensor computed "
    "inside the block other than its outputs (attention weights from output_attentions, a tensor a forward hook "
    "inside the block kept). Such tensors carry no gradient into the streamed blocks (in the blocks the backward "
    "re-runs they have none): detach them, or compute the loss term from the block's outputs")
_CHANGED_INPUT = ("block {layer} changed {what} in place in a training forward: LazyTrain keeps what a block is "
                  "given and re-runs the block from it in backward, so the re-run would start from the changed "
                  "values. Change a copy (x = x * 0.5, not x.mul_(0.5))")


def _check_arguments_unchanged(call: _LayerCall, layer: int, by_the_block: bool = False) -> None:
    """A block is re-run from the tensors its forward was given: one changed in place since (by the model after
    the call, say) would give the re-run other values than the forward had, so the backward is refused, as
    PyTorch refuses a saved tensor changed in place. ``by_the_block``: checked as the block's training forward
    returns, so that one the block itself changed is refused there, naming it."""
    changed = [(_argument_name(call, k), call.leaves[k]) for k, version in call.versions.items()
               if call.leaves[k]._version != version]
    changed += [(_argument_name(call, k) + keystr(path), t) for (k, path), (t, version) in call.held_versions.items()
                if t._version != version]   # a tensor in a list or dict argument
    for name, t in changed[:1]:
        if by_the_block:
            raise ExecutorError(_CHANGED_INPUT.format(layer=layer, what=f"its {name}"))
        raise ExecutorError(f"block {layer}'s {name} (a tensor of shape {tuple(t.shape)}) was changed in place since "
                            f"the forward called the block: the backward re-runs the block from the tensors its "
                            f"forward was given, and would see other values. Change a copy instead (t = t + 1, not "
                            f"t.add_(1)), or change it after the backward")


def _argument_name(call: _LayerCall, k: int) -> str:
    """Which argument of a block call the call's tensor leaf ``k`` is, as the model passed it: "keyword argument
    'bias'", "positional argument 2[0]" (the hidden state is the first)."""
    args, kwargs = tree_unflatten(call.leaves, call.spec)
    paths = tree_flatten_with_path((args, kwargs), is_leaf=lambda v: v is not kwargs and isinstance(v, (list, dict)))[0]
    (where, *inside), _ = paths[k]
    if where.idx == 1:   # a keyword
        return f"keyword argument {inside[0].key!r}{keystr(tuple(inside[1:]))}"
    return f"positional argument {inside[0].idx + 2}{keystr(tuple(inside[1:]))}"


def _checked_output(out, layer: int):
    """What a block returned, when the executor can chain and differentiate it: its hidden state, or a tuple
    or list that begins with it; else refused by name (a dict's keys would be taken for its outputs)."""
    if isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor)):
        return out
    if isinstance(out, (tuple, list)):
        got = f"a {type(out).__name__} whose first element is {type(out[0]).__name__ if out else 'missing'}"
    else:
        got = f"an object of type {type(out).__name__}"
    raise ExecutorError(f"block {layer} returned {got}: a streamed block returns its hidden state (a tensor), or a "
                        f"tuple or list that begins with it; what follows may nest tuples, lists and dicts of "
                        f"tensors, each differentiated. Return (hidden_state, ...) from the block")


def _handed_out(out, inputs, saved: frozenset = frozenset()):
    """A block's outputs as the model gets them. Detached: an output that is a view (nn.Linear's on a 3-D
    input) would be the streamed call's view output, which autograd refuses to let the model change in
    place, as plain PyTorch lets it. Copied where it is in the memory of one of the block's inputs (a block
    that returns its input, a skipped layer: a boundary the plan keeps) or of a tensor an offloaded layer's
    forward saved (``saved``, storages by data_ptr: tanh saves its output): either may still be on its way
    to the host, which a change the model makes in place must not reach."""
    given = saved | {t.untyped_storage().data_ptr() for t in inputs
                     if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel()}

    def hand(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        return t.clone() if t.layout == torch.strided and t.untyped_storage().data_ptr() in given else t
    return tree_map(hand, out)


def _alias_of(x: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether ``x`` is ``out``, or an autograd view of it holding the same values (the same memory, shape,
    strides, dtype and lazy conj/neg bits): what a full backward hook on a block (its identity autograd
    function) hands the next block. A re-run derives it from the block's output as it derives ``out``; the
    gradient goes through autograd between the blocks either way. Only a view of ``out`` shares its version
    counter, so a change in place of either is seen; an alias made otherwise (``.data``, numpy, dlpack) does
    not, and counts as another tensor."""
    if out is None:
        return False
    if x is out:
        return True
    return (x._base is not None and x._base is (out._base if out._base is not None else out)
            and x.data_ptr() == out.data_ptr() and x.shape == out.shape and x.stride() == out.stride()
            and x.dtype == out.dtype and x.device == out.device and x.is_conj() == out.is_conj()
            and x.is_neg() == out.is_neg())


def _note_fp32_buffers(error: RuntimeError, block: nn.Module, layer: int, compute_dtype: torch.dtype) -> None:
    """A dtype error in a 16-bit run of a block with fp32 buffers: LazyTrain keeps those fp32 where DeepSpeed's
    up-front cast makes them 16-bit, and a block that multiplies its activations by one (PEFT's VeRA
    projections) fails on it. The error gets a note naming them and the way out."""
    if compute_dtype == torch.float32 or "dtype" not in str(error):
        return
    fp32 = [name for name, b in block.named_buffers() if b.dtype == torch.float32]
    if fp32:
        shown = ", ".join(fp32[:4]) + (f" and {len(fp32) - 4} more" if len(fp32) > 4 else "")
        note = (f"lazytrain: block {layer} computes in {str(compute_dtype).removeprefix('torch.')} and keeps fp32 "
                f"buffers ({shown}), which LazyTrain leaves in fp32 where DeepSpeed's bf16/fp16 cast makes them "
                f"16-bit; a block that computes with them as its activations' dtype needs the model cast before "
                f"lazytrain.initialize (model.to(torch.bfloat16))")
        if hasattr(error, "add_note"):   # Python 3.11+
            error.add_note(note)
        else:
            warnings.warn(note, UserWarning, stacklevel=2)


class _BlockFunction(torch.autograd.Function):
    """One streamed block: forward without keeping internals (or, for the last segment when the Plan
    says so, recording its graph), backward recomputes and differentiates."""

    @staticmethod
    def forward(ctx, executor: LayerStreamingExecutor, p: _Pass, layer: int, anchor: torch.Tensor,
                hidden: torch.Tensor, *tensors):
        executor.forward_window(p, layer, hidden)
        ctx.executor, ctx.p, ctx.layer = executor, p, layer
        # what a backward that failed above hands on in their place (_zeros_for_inputs)
        ctx.inputs_like = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None
                           for t in (hidden, *tensors)]
        ctx.set_materialize_grads(False)   # an output the loss did not use gets None, not zeros
        needs = ctx.needs_input_grad[4:]
        graph_layer = layer >= executor.graph_start or layer in executor.offloaded
        record = graph_layer and (any(needs) or any(executor.weights.trainable[layer]))
        if graph_layer and not record:
            p.graphs[layer] = None          # nothing to differentiate here: no graph, no weight copy
        if record:                          # backward differentiates this graph without a re-run
            x_in, out, params, t_in = executor._forward_with_grad(p, layer, hidden, needs[0], needs[1:], keep=True)
            p.graphs[layer] = (x_in, executor._outputs(out), params, t_in)
            saved = p.offloaded[layer].saved_storages if layer in p.offloaded else frozenset()
        else:
            flat = executor._acquire(layer)
            out, _ = executor._compute(layer, flat, hidden, p.calls[layer], kept=executor._selective_forward(p, layer))
            saved = frozenset()
        out = _handed_out(_checked_output(out, layer), (hidden, *tensors), saved)
        if isinstance(out, torch.Tensor):
            return (out,)
        # the model gets what the block returned, rebuilt from the call's flat outputs (it indexes a tuple:
        # layer_outputs[0]); each tensor in it, however nested, is an output of the call
        leaves, p.output_specs[layer] = tree_flatten(out)
        for t in leaves[1:]:   # floating-point extras (an auxiliary loss) stay differentiable
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                ctx.mark_non_differentiable(t)
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grad_outs):
        ex: LayerStreamingExecutor = ctx.executor
        ex.backward_ran = True
        if torch.is_grad_enabled():
            raise ExecutorError("a backward with create_graph=True (a gradient penalty, second-order gradients) "
                                "cannot go through streamed blocks: their weight gradients are sent to host "
                                "buffers, not returned to autograd")
        needs = ctx.needs_input_grad[4:]
        if ctx.p.failed and ctx.layer not in ctx.p.differentiated:
            # a block above raised in this backward, which goes on with zeros (see below); a second backward
            # through this forward finds every block differentiated, and is refused as any is
            ctx.p.differentiated.add(ctx.layer)
            try:
                ex.send_zeros_after_failure(ctx.p, ctx.layer)
            except CollectiveError:   # the group is gone: nothing to keep in step with
                raise
            except Exception:   # noqa: BLE001 - the first error is raised at the end; the layers below still send
                pass            # theirs (a failure after this layer's reduce was made: the owner's add again)
            return _zeros_for_inputs(ctx)
        accumulate = ex.accumulates_weight_grads()
        try:
            g_hidden, t_grads = ex.backward_layer(ctx.p, ctx.layer, grad_outs, needs, accumulate)
        except BaseException as e:
            # the layers after this one sent their gradients already: the step's accumulation holds part of
            # this backward (what failed is kept as text: the error itself would hold the pass)
            ex.backward_failure = f"{type(e).__name__}: {e}"
            # where each layer's gradient is reduced to its owner as it lands (stages 2 and 3), the other ranks'
            # backwards wait in this rank's reduces of the layers below, and at stage 3 in those of the
            # partitioned parameters outside the blocks (the embedding's): this backward goes on to its end with
            # zeros, each block sending zeros as the backward reaches it, so that every collective is made in
            # the order the other ranks make it; it raises at its end. Every rank reaches the step, whose
            # agreement fails it on every rank (StepFailedError): zero_grad() and the micro-batches again.
            # (Not after a failed collective: the group is gone.)
            goes_on = accumulate and ex.weights.grads_to_owners and isinstance(e, Exception) \
                and not isinstance(e, CollectiveError)
            if goes_on:
                try:
                    ex.send_zeros_after_failure(ctx.p, ctx.layer)
                except Exception:   # noqa: BLE001 - the error raised is the one above; the collectives'
                    goes_on = False  # timeout tells the other ranks
            # no boundary of this pass is read again: its reads (ahead, and one that failed) end here and go,
            # none left to land later into a pass that is being dropped
            for handle in list(ctx.p.prefetched.values()):
                try:
                    handle.wait()
                except BaseException:   # noqa: BLE001 - the error raised is the one above
                    pass
            ctx.p.prefetched.clear()
            handle = None   # the traceback keeps this frame: no view of a host buffer with it
            if not goes_on:
                raise
            ctx.p.failed = True
            try:
                ex.release_pass(ctx.p)   # nothing of it is read again
            except Exception:   # noqa: BLE001 - its finalizer frees its keys still; the error raised is e
                pass
            # what the failed block's frames hold (its re-run's activations) goes now, not at the backward's end:
            # the error keeps its message and lines, not their locals. The first error's callback raises: the
            # callbacks queued after it (a second block's error) do not run
            _clear_frames_of(e)
            torch.autograd.Variable._execution_engine.queue_callback(_raiser(e))
            return _zeros_for_inputs(ctx)
        return (None, None, None, None, g_hidden, *t_grads)


def _zeros_for_inputs(ctx) -> tuple:
    """What a block hands on in a backward that failed at or above it: zeros for each input that needs a
    gradient (the graph below runs as on the other ranks, its collectives with it)."""
    return (None,) * 4 + tuple(torch.zeros(like[0], dtype=like[1], device=like[2]) if need and like else None
                               for need, like in zip(ctx.needs_input_grad[4:], ctx.inputs_like))


def _clear_frames_of(error: BaseException) -> None:
    """The local variables of the finished frames of ``error``'s traceback, and of the errors it was raised from
    or during, cleared (each error once: a chain may loop through ``__cause__``)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def _raiser(error: BaseException):
    """A backward's final callback raising ``error``: the backward that went on with zeros after it ends
    raising it, as it would have raised it at once."""
    def callback():
        raise error
    return callback


class _Proxy:
    """Installed as a block's ``forward``: hands the call to the executor."""

    def __init__(self, executor: LayerStreamingExecutor, index: int):
        self.executor, self.index = executor, index

    def __call__(self, *args, **kwargs):
        return self.executor.run(self.index, args, kwargs)


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the storages autograd saves inside the block, each once, leaving out those of
    ``outside`` (held anyway: the weights, the input, what the call passes in). It changes nothing saved,
    and refuses at backward what plain autograd refuses: a saved tensor changed in place after it was
    saved (autograd checks no version where saved-tensor hooks are set)."""

    def __init__(self, outside: list):
        self.nbytes = 0
        self._seen = {key for t in outside for key, _ in storages(t)}

        def pack(t):
            for key, nbytes in storages(t):
                if key not in self._seen:
                    self._seen.add(key)
                    self.nbytes += nbytes
            # detached: the tensor itself, when it is an output of the op saving it, would hold that op's node,
            # which holds what is saved: a cycle the garbage collector cannot see when no backward runs
            return t.detach(), t._version
        super().__init__(pack, _unpack_checked)


def _unpack_checked(packed) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                           f"{version} instead (seen by LazyTrain's measurement of what a traced block saves)")
    return t


def _contents(container):
    """What a list, dict or watched mapping holds now, as a list or dict of its own."""
    if isinstance(container, _SharedStateWatch):
        return dict(container._mapping)
    return _structure_copy(list(container) if isinstance(container, list) else dict(container))


def _structure_copy(v):
    """The lists and dicts nested in ``v`` copied (what they hold as it is now), their other contents shared."""
    if isinstance(v, list):
        return [_structure_copy(x) for x in v]
    if type(v) is dict:
        return {k: _structure_copy(x) for k, x in v.items()}
    return v


def _fresh_copy(container, held):
    """A throwaway container holding ``held``, for a re-run: a list, a dict, or the shared-state view of a
    mapping (over a plain dict, with the same record of which block stored what)."""
    if isinstance(container, _SharedStateWatch):
        return _SharedStateWatch(dict(held), container._layer, container._writers)
    return _structure_copy(held)


class _TensorsSeen:
    """A set of tensors by identity that does not keep them alive. (A ``weakref.WeakSet`` compares a
    tensor it holds with ``==``, elementwise, and fails on one of many values.)"""

    def __init__(self):
        self._by_id: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def add(self, t: torch.Tensor) -> None:
        self._by_id[id(t)] = t

    def __contains__(self, t) -> bool:
        return self._by_id.get(id(t)) is t


def _container_snapshot(layer: int, call: _LayerCall, block_added) -> list[tuple[Any, Any]]:
    """The lists and dicts a block call was handed, each with what it held (from ``call.held``). A tensor
    inside one that needs a gradient is refused: it is not an input of the block's autograd Function, so
    its gradient would be lost (tensors passed directly or in tuples are inputs). Tensors earlier blocks put
    there are not the model's (``block_added``): they are the subject of the warning on adding them."""
    snapshot = []
    for k, held in call.held.items():
        v = call.leaves[k]
        if isinstance(v, (list, dict)):
            inside = tree_flatten(held)[0]
            if any(isinstance(t, torch.Tensor) and t.requires_grad and t not in block_added for t in inside):
                raise ExecutorError(f"block {layer} was handed a {type(v).__name__} holding a tensor that needs a "
                                    f"gradient: a streamed block's gradients flow back through its tensor arguments "
                                    f"(directly or in tuples) only, so this one would get none. Pass the tensor as "
                                    f"an argument")
            snapshot.append((v, held))
    return snapshot


def _added_tensors(snapshot: list[tuple[Any, Any]], block_added, handed: dict) -> bool:
    """Whether a block call put a floating-point tensor into a list or dict it was handed (the tensors go
    into ``block_added``, a weak set: a later step may hand the same list back). One the block made is
    detached where it lies, so that it carries no gradient in every layer alike: a layer that records its
    graph (offloaded internals, the last segment's graph) made it with one, which its own backward frees, and
    a loss that used it failed with autograd's "backward through the graph a second time". One the block got
    (``handed``: by id, what it got -> the caller's tensor) is put back as the caller's own, whose graph
    reaches outside the block, so that it gets plain PyTorch's gradient in every layer (a graph layer got a
    fresh leaf made of it)."""
    added = False
    for container, before in snapshot:
        if isinstance(container, list):
            seen = {id(x) for x in before}
            places = [i for i, x in enumerate(container) if id(x) not in seen]
        else:
            places = [key for key, v in container.items() if key not in before or before[key] is not v]
        for place in places:
            leaves, spec = tree_flatten(container[place])

            def as_given(t):
                if not isinstance(t, torch.Tensor) or not t.requires_grad:
                    return t
                return handed[id(t)] if id(t) in handed else t.detach()
            given = [as_given(t) for t in leaves]
            if any(a is not b for a, b in zip(given, leaves)):
                leaves = given
                container[place] = tree_unflatten(leaves, spec)
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    block_added.add(t)
                    added = True
    return added


def _watch_shared_state(p: _Pass, layer: int, call: _LayerCall) -> None:
    """Hand the block, instead of each mapping it was given (other than a KV cache or a plain dict, which
    blocks may test with isinstance), a view that notes which block stored each tensor and refuses a read
    by another block."""
    for k, v in enumerate(call.leaves):
        if isinstance(v, MutableMapping) and not isinstance(v, dict) and not _is_kv_cache(v) \
                and not isinstance(v, _SharedStateWatch):
            writers = p.shared_writers.setdefault(id(v), (v, {}))[1]
            call.leaves[k] = _SharedStateWatch(v, layer, writers)


class _SharedStateWatch(MutableMapping):
    """A block that stores tensors in a mapping it was handed, for later blocks to read (Gemma 3n's and
    Gemma 4's ``shared_kv_states``), passes them on outside the hidden state. Their gradient cannot flow
    back: the storing block's forward kept no graph, and its re-run in backward cannot reach the reading
    block. The read is refused rather than trained wrong; a store nobody else reads is harmless."""

    def __init__(self, mapping: MutableMapping, layer: int, writers: dict):
        self._mapping, self._layer, self._writers = mapping, layer, writers

    def __getitem__(self, key):
        writer = self._writers.get(key)
        value = self._mapping[key]
        if writer is None and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(value)[0]):
            raise ExecutorError(
                f"block {self._layer} read {key!r} from its {type(self._mapping).__name__} argument, a tensor that "
                f"needs a gradient: a streamed block's gradients flow back through its hidden state and tensor "
                f"arguments only, so this one would get none. Pass the tensor to the block as an argument")
        if writer is not None and writer != self._layer:
            raise ExecutorError(
                f"block {self._layer} read {key!r} from its {type(self._mapping).__name__} argument, which block "
                f"{writer} stored there: streamed blocks must pass everything through their hidden state, since "
                f"their internals are recomputed in backward and gradients through such shared state would be "
                f"lost. Turn the sharing off (for Gemma 3n/4: num_kv_shared_layers=0) to train this model "
                f"with LazyTrain")
        return value

    def __setitem__(self, key, value):
        if any(isinstance(t, torch.Tensor) for t in tree_flatten(value)[0]):
            self._writers[key] = self._layer
        self._mapping[key] = value

    def __delitem__(self, key):
        self._writers.pop(key, None)
        del self._mapping[key]

    def __iter__(self):
        return iter(self._mapping)

    def __len__(self):
        return len(self._mapping)

    def __getattr__(self, name):   # the mapping's own methods (KVSharingDict.to)
        if name.startswith("__") or name in ("_mapping", "_layer", "_writers"):
            raise AttributeError(name)   # not set yet (a copy being built): no recursion
        return getattr(self._mapping, name)


def _free_owned(tiers: dict[str, Tier], owned: set) -> None:
    failures = [(tiers[tier], _failed_to_free(tiers[tier], key)) for tier, key in list(owned)]
    owned.clear()
    for tier, failure in failures:
        _warn_failed_free(tier, failure)


def _failed_to_free(tier: Tier, key: str) -> Exception | None:
    """``tier.free(key)``; what it raised (a user's tier's ``_free``), or None. The key is gone and its budget
    given back either way, and the pass's work is done: a backward does not fail on its clean-up."""
    try:
        tier.free(key)
    except Exception as e:   # noqa: BLE001 - warned of (_warn_failed_free): training goes on
        return e
    return None


_WARNED_FREE_FAILURES: "weakref.WeakSet[Tier]" = weakref.WeakSet()   # tiers whose failure to free was warned of


def _warn_failed_free(tier: Tier, failure: Exception | None) -> None:
    """A tier's first failure to free a key, warned of (as the NVMe tier warns of a file it cannot remove); later
    ones not: the keys are numbered by pass, and each would be a warning of its own."""
    if failure is None or tier in _WARNED_FREE_FAILURES:
        return
    _WARNED_FREE_FAILURES.add(tier)
    warnings.warn(f"lazytrain: {failure}; the key's budget is given back and training goes on (what it held may "
                  f"remain in the tier's storage; further failures of tier {tier.name!r} to free a key are not "
                  f"warned of)", UserWarning, stacklevel=3)
