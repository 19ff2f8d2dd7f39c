"""The DeepSpeed-compatible engine: the public surface a training loop talks to.

It owns no mechanism of its own: block streaming is the executor's, storage the tiers', the memory
plan the planner's, the update the optimizer's. The engine wires them together and keeps DeepSpeed's
counters and accumulation-boundary semantics.
"""
from __future__ import annotations

import contextlib
import copy as _copy_module
import dataclasses
import functools
import importlib
import inspect
import itertools
import math
import numbers
import os
import platform
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config import ConfigError, EngineConfig, OptimizerConfig
from ..data.loader import EpochDataLoader, EpochTrackingSampler, is_dataset
from ..planner import measured
from ..planner.models import with_standard_names
from ..planner.plan import Plan
from ..planner.problem import Budgets
from ..tiers import format_bytes, streams
from ..tiers.base import TierError, close_tiers
from ..tiers.memory import release_cached_pinned_memory
from ..tiers.streams import Chaos, EmulatedLink
from .. import files
from ..trace import Timeline, check_writable, measured_source, write_chrome_trace
from . import checkpoint as ckpt
from . import chunked_loss
from . import safe_load
from . import deepspeed_checkpoint as ds_ckpt
from . import deepspeed_layout as ds_layout
from . import auto_plan, module_copy, node_memory, param_access, sharding, user_hooks
from .partitioned_params import PartitionedParams
from . import sharded_checkpoint as sharded_ckpt
from .blocks import (check_no_shared_weights, find_blocks, is_quantized, refuse_compiled_blocks,
                     refuse_quantized_block_weights, turn_off_layer_checkpointing)
from .host_accumulate import sum_of_squares
from .layout_guard import LayoutGuard
from .state_kinds import HOW_IT_RUNS, optimizer_state_of_another_kind, schedule_state_of_another_kind
from .lean_norms import make_norms_lean, restore_norms
from .deepspeed_extras import Monitor, NoParameterOffloadHooks, ThroughputTimer
from .distributed import CollectiveError, DistributedContext, RankFailure
from .executor import LayerStreamingExecutor, inside_a_block
from .layer_updates import LayerUpdates
from .weight_stream import WeightStream
from ..optim.hybrid_adamw import PostHookTable, refuse_unordered
from ..optim.lr_schedules import set_group_lrs
from .optimizer_setup import (build_optimizer, build_scheduler, client_optimizer, deepspeed_optimizer_name,
                              eight_bit_share, hand_back_to_params, listed_groups, param_groups,
                              refuse_unkept_8bit_states)
from .placement import (RankMemory, build_plan, build_tiers, card_memory, check_model_shape, configured_hardware,
                        least_known, memory_copy_gbps, non_block_masters_apart, non_block_state_home,
                        plan_from_measurements, resolve_device)
from .precision import FrozenParams, LossScaleAtMinimumError, LossScaler, Masters
from .weights import LayerWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GPU_RESERVED_BYTES = Budgets().gpu_reserved_bytes   # the planner's reserve for the CUDA context and allocator
SELECTIVE_MARGIN = 16   # policy auto counts a selective layer's kept outputs 1/16 over the planner's estimate


# what the other ranks wait for while rank 0 plans (a collective's failure names it): a solve may take up to
# 3 x 'lazytrain.milp_time_limit' + 60 s where it overruns its limit
_PLAN_ON_RANK_0 = ("agreement on the MILP's plan, which rank 0 solves while the others wait (within "
                   "'lazytrain.collective_timeout_s': raise it if 'lazytrain.milp_time_limit' is near it)")
_AUTO_PLAN_ON_RANK_0 = _PLAN_ON_RANK_0.replace("the MILP's plan", "the auto plan")


# the optimizer attributes the engine sets (DeepSpeed's optimizers' behaviour and flags), undone by destroy
_OPTIMIZER_ATTRIBUTES_SET = ("add_param_group", "zero_grad", "step", "overflow", "loss_scale", "cur_scale",
                             "parameter_offload")


def _as_loss_scaler_state(saved: dict | None) -> dict | None:
    """DeepSpeed's loss scaler record (its FP16_Optimizer's state at stage 0, ZeRO's scaler object from stage 1)
    in LossScaler's state dict terms; None where it keeps none."""
    if not saved or "cur_scale" not in saved:
        return None
    state = {"scale": float(saved["cur_scale"]), "cur_iter": saved.get("cur_iter", 0),
             "last_overflow_iter": saved.get("last_overflow_iter", -1),
             "hysteresis": saved.get("delayed_shift", 1)}   # FP16_Optimizer has none
    if "dynamic" in saved:   # LossScaler (static; a bf16 or fp32 run's 1.0) or DynamicLossScaler
        state["dynamic"] = bool(saved["dynamic"])
    if "cur_hysteresis" in saved:
        state["cur_hysteresis"] = saved["cur_hysteresis"]
    return state


def _planner_config(model: nn.Module) -> dict | None:
    """The model's Hugging Face config as a dict, with the standard shape names its ``attribute_map`` gives
    under its own (planner ``with_standard_names``: GPT-2's ``n_embd`` is its ``hidden_size``)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return None
    cfg = with_standard_names(config.to_dict(), getattr(config, "attribute_map", None))
    tied = _embeddings_tied(model)
    if tied is not None:   # what the model built, where its config's keys (a multimodal one's two) may disagree
        cfg["tie_word_embeddings"] = tied
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"]["tie_word_embeddings"] = tied
    return cfg


def _embeddings_tied(model: nn.Module) -> bool | None:
    """Whether ``model``'s LM head is its embedding's weight (a Hugging Face model's accessors); None where the
    model does not say."""
    try:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except Exception:   # noqa: BLE001 - a model's own accessors may raise anything: then it does not say
        return None
    head_weight, embedding_weight = getattr(head, "weight", None), getattr(embedding, "weight", None)
    if not isinstance(head_weight, torch.Tensor) or not isinstance(embedding_weight, torch.Tensor):
        return None
    return head_weight is embedding_weight


def _keep_checkpointing_off_hook(engine: "LazyTrainEngine"):
    """A forward pre-hook on the module that runs the streamed blocks' loop: a training pass finds the model's own
    gradient checkpointing off for them (:meth:`LazyTrainEngine._keep_layer_checkpointing_off`). It holds the
    engine weakly: the model does not keep a destroyed engine alive."""
    ref = weakref.ref(engine)

    def hook(module, args):
        live = ref()
        if live is not None and torch.is_grad_enabled():
            live._keep_layer_checkpointing_off()
    return hook


def _devices_of(model: nn.Module) -> list[tuple[nn.Module, str, str, torch.device]]:
    """Where each parameter and buffer of ``model`` is: (module, "param" or "buffer", name, device)."""
    out = []
    for mod in model.modules():
        out += [(mod, "param", n, p.device) for n, p in mod._parameters.items() if p is not None]
        out += [(mod, "buffer", n, b.device) for n, b in mod._buffers.items() if b is not None]
    return out


def _put_back(devices) -> None:
    """Each parameter (with its gradient) and buffer on the device it was given on (:func:`_devices_of`), so
    that the model handed back computes on one device as it came, not with its embedding on the GPU and its
    blocks in host memory."""
    for mod, kind, name, device in devices:
        table = mod._parameters if kind == "param" else mod._buffers
        t = table.get(name)
        if t is None or t.device == device:
            continue
        if kind == "buffer":
            table[name] = t.to(device)
            continue
        grad = t.grad
        t.data = t.data.to(device)
        if grad is not None:
            t.grad = grad.to(device)


def _drop_gradients_of_replaced_tensors(model: nn.Module) -> None:
    """A parameter given a tensor of another shape, dtype or device while an engine held it (its next pass was
    refused) keeps no gradient of the old tensor: torch's ``.data`` assignment leaves one, which the next
    backward or step would trip on."""
    for p in model.parameters():
        g = p.grad
        if g is not None and (g.shape, g.dtype, g.device) != (p.shape, p.dtype, p.device):
            p.grad = None


class StepFailedError(RuntimeError):
    """engine.step() failed; the message says whether anything had changed (and then, until a checkpoint
    is loaded, training and saving are refused)."""


class LazyTrainEngine(nn.Module):
    """Wraps the user's model; ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``."""

    def __init__(self, model: nn.Module, config: EngineConfig, optimizer=None, model_parameters=None,
                 lr_scheduler=None, training_data=None, collate_fn=None):
        super().__init__()
        try:
            self._set_up(model, config, optimizer, model_parameters, lr_scheduler, training_data, collate_fn)
        except BaseException:   # a config error found late leaves the model usable as it was
            self._hand_model_back()
            raise
        self.weights.set_up_done()
        self.frozen_non_block.set_up_done()
        self._setup_thread = threading.get_ident()   # the training thread, which alone waits on the engine's threads
        param_access.register(self)   # lazytrain.utils' safe_get_full_* find the engine of a parameter
        self._attachments.set_up_done(model)
        self._copy_patched = module_copy.install(model, self._copy_of_module)   # deepcopy: a plain model

    def _hand_model_back(self, raise_tier_failure: bool = False) -> None:
        """Undo what set-up did to the user's model, as far as it got: its blocks' forward no longer routed
        here, no hooks of ours, non-block weights back in fp32; then close the tiers. A tier that fails to close
        does not stop the rest; with ``raise_tier_failure`` (``destroy()``) its failure is raised last (a failed
        set-up raises its own error instead)."""
        d = self.__dict__
        if d.get("_layout_guard") is not None:
            self._layout_guard.remove()
        param_access.unregister(self)
        module_copy.uninstall(d.get("_copy_patched", []))
        if d.get("_trace_path") is not None:   # a traced step that never finished
            streams.stop_recording()
        if "executor" in d:
            self.executor.uninstall()
        # the model's own checkpointing flags and its blocks' norms as they were (set-up may fail after it
        # changed them: policy "auto" is checked later)
        if d.get("_checkpointing_guard") is not None:
            self._checkpointing_guard.remove()
        for m in d.get("_checkpointing_turned_off", []):
            m.gradient_checkpointing = True
        restore_norms(d.get("_lean_norms", []))
        if d.get("_model_zero_grad") is not None and self.module.__dict__.get("zero_grad") is self._model_zero_grad:
            del self.module.__dict__["zero_grad"]   # torch's again
        if d.get("_optimizer_own") is not None:   # a client optimizer reused by another engine starts clean
            for name in _OPTIMIZER_ATTRIBUTES_SET:
                self.basic_optimizer.__dict__.pop(name, None)
            self.basic_optimizer.__dict__.update(self._optimizer_own)
        for handle in list(d.get("_load_hooks", [])) + list(d.get("_settle_hooks", [])):
            handle.remove()
        if d.get("layer_updates") is not None:
            self.layer_updates.close()
        if d.get("weights") is not None:
            self.weights.close_grad_sink()
            # as plain PyTorch leaves them: None since the gradients were zeroed (a torch optimizer skips only a
            # None one: a zero one moved frozen blocks by their weight decay), else the accumulation as a copy
            executor = d.get("executor")
            self.weights.hand_back_grads(keep=bool(d.get("_grads_given") or
                                                   (executor is not None and executor.backward_ran)))
        if d.get("masters") is not None:
            self.masters.hand_back()
        if d.get("frozen_non_block") is not None:
            self.frozen_non_block.hand_back()
        if d.get("stream") is not None:
            self.stream.settle_all()   # no copy may still land in a buffer that is about to go
        if d.get("weights") is not None:   # frozen ones kept in the compute copy: out of the tier's memory
            self.weights.hand_back_frozen()
        tier_failure = close_tiers(d.get("tiers", {}).values())   # all closed; the first failure raised last
        _put_back(d.get("_devices_given", []))
        if self._modules.get("module") is not None:
            _drop_gradients_of_replaced_tensors(self._modules["module"])
        if d.get("_transfers_started"):   # its chaos and emulated links end with it
            streams.engine_ended(self)
        if d.get("basic_optimizer") is not None:   # a script may go on with it: on the parameters, where they are now
            if d.get("_fused_copies"):   # no more writes into (nor references to) the engine's compute copies
                self.basic_optimizer.compute_copies.clear()
            hand_back_to_params(self.basic_optimizer, self.masters.pairs if d.get("masters") is not None else [])
        if tier_failure is not None and raise_tier_failure:
            self._tier_close_failure = tier_failure
            raise tier_failure

    def _set_up(self, model: nn.Module, config: EngineConfig, optimizer, model_parameters, lr_scheduler,
                training_data, collate_fn) -> None:
        if optimizer is not None and config.optimizer.type is not None:   # DeepSpeed takes the script's, silently
            warnings.warn(f"lazytrain: an optimizer was passed to initialize and the config has an 'optimizer' "
                          f"section ({config.optimizer.type}) too: the optimizer passed is used and the section "
                          f"ignored, as DeepSpeed does", UserWarning)
            config = dataclasses.replace(config, optimizer=OptimizerConfig())
        existing = module_copy.engines_of(model)   # their blocks' forwards, hooks and weights are theirs
        if any(e.basic_optimizer is not None for e in existing):
            raise ConfigError("this model is trained by a LazyTrain engine already: call that engine's destroy() "
                              "(lazytrain.engine_of(model) returns it) before initialize builds another on it")
        if existing:
            # engines without an optimizer hold nothing the model does not (an evaluation's, built before the
            # training one, as TRL's DPO and KTO build one to precompute reference log-probabilities): handed back,
            # as DeepSpeed lets a second engine take the model; their forwards go to the engine that took it
            warnings.warn("lazytrain: the model's engine without an optimizer (an evaluation's) is destroyed: the "
                          "engine initialize builds now takes the model over, and the old one's forwards run "
                          "through it", UserWarning)
            for engine in existing:
                engine.destroy()
                engine._superseded = True   # once handed back: its forwards go to the engine now on its model
        self.module = model
        self._config = config
        self._devices_given = _devices_of(model)   # handed back on them (set-up moves some to the device)
        self._attachments = module_copy.EngineAttachments(model)   # told apart from the model's own
        self.dist = DistributedContext("cuda" if torch.cuda.is_available() else "cpu",
                                       timeout_s=config.lazytrain.collective_timeout_s,
                                       comm_dtype={"fp32": torch.float32, "bf16": torch.bfloat16,
                                                   "fp16": torch.float16}[config.communication_dtype_name])
        self.local_rank, self.global_rank, self.world_size = self.dist.local_rank, self.dist.rank, self.dist.world_size
        self.device = resolve_device(config, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.compute_dtype = _DTYPES[config.compute_dtype_name]
        _check_model_dtype(model, self.compute_dtype)
        testing = config.lazytrain.testing   # how transfers run in this process (tests and benchmarks)
        if testing.links and self.device.type != "cpu":
            raise ConfigError(f"config key 'lazytrain.testing.links' emulates links on the CPU's copy threads; the "
                              f"device {self.device} has real ones: remove the key, or set 'lazytrain.device': \"cpu\"")
        streams.engine_started(self, copy_threads=testing.copy_threads,
                               chaos=Chaos(testing.chaos_seed, testing.chaos_max_delay_ms / 1e3)
                               if testing.chaos_seed is not None else None,
                               links={name: EmulatedLink(name, gbps, latency_ms / 1e3)
                                      for name, (gbps, latency_ms) in testing.links.items()})
        self._transfers_started = True

        # what streams and what stays
        self.blocks_path, blocks = find_blocks(model, config.lazytrain.blocks)
        refuse_compiled_blocks(model, self.blocks_path, blocks)
        refuse_quantized_block_weights(self.blocks_path, blocks)
        check_no_shared_weights(model, self.blocks_path, blocks)
        self.dist.start_from_rank_0(model)   # before any weight is copied out of the model
        # the blocks' own parameters (a parameter registered on the block list itself is not in a block:
        # it stays with the non-block ones, clipped, averaged and updated as they are)
        block_param_ids = {id(p) for b in blocks for p in b.parameters()}
        self.tiers = build_tiers(config, self.device)
        layer_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
        model_cfg = _planner_config(model)
        if model_cfg is not None:   # the planner sizes each streamed layer as it is, not from the config,
            model_cfg["layer_params"] = layer_params
            # in the precision this engine computes and streams in (not what the model was saved in)
            model_cfg["dtype"] = model_cfg["torch_dtype"] = config.compute_dtype_name
        # what trains, as set up here (the engine's buffers keep this layout; unfreezing later is refused), and
        # the share of it whose moments the config's optimizer keeps in 8 bits (a script's own optimizer: none)
        if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
            refuse_unordered(model_parameters)           # a set: an order that changes between runs
            model_parameters = list(model_parameters)   # a generator: read here and again for the optimizer
        model_parameters = listed_groups(model_parameters)   # a group's generator too
        eight_bit = 0.0 if optimizer is not None or config.optimizer.type is None else \
            eight_bit_share(config, model, param_groups(model_parameters, model, lambda p: p))
        self._model_budgets = {**_trainable_shares(model, blocks), "hybrid_8bit_fraction": eight_bit}
        frozen = config.lazytrain.frozen_bottom_layers
        if frozen is None:
            frozen = _frozen_bottom_blocks(model, blocks)
        elif frozen > len(blocks):
            raise ConfigError(f"config key 'lazytrain.frozen_bottom_layers' is {frozen}, but the model has "
                              f"{len(blocks)} blocks")
        # the planners plan for the smallest card and host share of any rank: every rank runs rank 0's plan
        self._rank_memory = self._least_memory_over_ranks() if config.lazytrain.policy in ("milp", "auto") \
            else None
        make_plan = lambda: build_plan(config, len(blocks), self.tiers, model_cfg,   # noqa: E731
                                       config.train_micro_batch_size_per_gpu,
                                       {**self._model_budgets, "frozen_bottom_layers": frozen},
                                       memory=self._rank_memory,
                                       layer_params=layer_params)
        # the MILP's plan is solved once, on rank 0, and every rank runs it: ranks solving side by side would
        # share the host's cores, and a solve stopped at its time limit can return another plan on each
        self.plan = self._rank0_answer(make_plan, _PLAN_ON_RANK_0) \
            if config.lazytrain.policy == "milp" else make_plan()
        if config.lazytrain.policy == "plan" and self.dist.enabled:
            self._check_one_plan_file_over_ranks()
        self._model_cfg = model_cfg
        weights_tier = self.tiers["host"] if config.lazytrain.weights_home in ("host", "hbm") \
            else self.tiers[config.lazytrain.weights_home]
        self.weights = LayerWeights(blocks, self.compute_dtype, self.device, weights_tier, self.tiers["hbm"])
        self.stream = WeightStream(self.weights, self.plan.resident_layers, prefetch=config.lazytrain.prefetch)
        self.executor = LayerStreamingExecutor(blocks, self.plan, self.weights, self.stream, self.tiers, self.device,
                                               prefetch=config.lazytrain.prefetch,
                                               backward_ends_step=self._backward_may_end_step,
                                               before_pass=self._before_pass,
                                               outside_params=self._outside_params)
        self.non_block_params = [p for p in model.parameters() if id(p) not in block_param_ids]
        self.frozen_non_block = FrozenParams(self.non_block_params, self.compute_dtype, self.device)
        self._move_non_block(model, blocks)
        home = self._masters_home()
        # the optimizer state sharded (stage >= 1, several ranks, the config's optimizer): the non-block fp32
        # masters live on their owners alone; stage 3 partitions the parameters too: each then has a master
        sharded = self.dist.enabled and config.zero_stage >= 1 and optimizer is None and \
            config.optimizer.type is not None
        partition = sharded and config.zero_stage >= 3
        self.masters = Masters(self.non_block_params, self.compute_dtype, home) \
            if non_block_masters_apart(config, self.device) or partition else None
        remap = self.masters.master_of if self.masters is not None else (lambda p: p)

        # optimizer and schedule
        names = {id(p): n for n, p in model.named_parameters()}
        if self.masters is not None:
            names.update({id(m): names[id(p)] for p, m in self.masters.pairs})
        self._param_names = names   # what the optimizer updates, by the model's parameter names
        overlap = config.lazytrain.overlap_optimizer
        wants_overlap = overlap is True or (overlap == "auto" and (self.device.type == "cuda" or
                                                                   config.lazytrain.policy == "auto"))
        self.shards: sharding.Ownership | None = None   # zero_optimization.stage >= 1 over several ranks
        # the non-block parameters on their owners (stage 3), or their fp32 masters alone (stages 1-2)
        self.partitioned: PartitionedParams | None = None
        self.node_shared_weights = False   # the streamed layers' weights: one host copy per node
        self._one_shared_node = False      # ... and every rank on that one node: owners broadcast a signal
        self._optimizer_from_config = optimizer is None and config.optimizer.type is not None
        if optimizer is not None:   # an object keeps its own groups (model_parameters unused, as in DeepSpeed)
            groups = param_groups(model_parameters, model, remap) if not isinstance(optimizer, torch.optim.Optimizer) \
                else []
            self.basic_optimizer = client_optimizer(optimizer, groups, remap, gave_groups=bool(
                model_parameters) and isinstance(model_parameters[0], dict))
            if hasattr(self.basic_optimizer, "name_parameters"):   # a HybridAdamW: its patterns see the model's names
                self.basic_optimizer.name_parameters(names)
            if self.dist.enabled and config.zero_stage >= 1:
                warnings.warn(f"lazytrain: zero_optimization.stage {config.zero_stage} shards the optimizer state "
                              f"of an optimizer built from the config; the one passed to initialize updates "
                              f"every parameter on every rank, so its state is not sharded", UserWarning)
        elif config.optimizer.type is not None:
            groups = param_groups(model_parameters, model, remap)
            if self.dist.enabled and config.zero_stage >= 1:
                self.shards = self._assign_shards(groups)
                if config.zero_stage >= 2:   # as DeepSpeed's stage 2: gradients partitioned too
                    # where gradients leave a device (a GPU, or copy threads standing in for one); on the CPU
                    # without them they are made in host memory and reduced there
                    on_device = self.weights.grads_in_flight and \
                        self.dist.reduce_gradients_on_device(self.device, config.lazytrain.gradient_reduce)
                    self.weights.send_grads_to_owners(sharding.GradientsToOwners(
                        self.shards.layer_owner, self.global_rank, self.world_size, self.weights.max_trainable_numel,
                        self.dist.reduce_gradient, self.dist.comm_dtype,
                        start_on_device=self.dist.reduce_gradient_started if on_device else None))
                self._whole_groups = groups
                groups = sharding.owned_groups(groups, self.shards)
                if self.masters is not None:
                    self.partitioned = PartitionedParams(self.masters, lambda m: self.shards.param_owner.get(id(m)),
                                                         self.global_rank, self.dist, model,
                                                         {id(m) for m in blocks.modules()}, masters_only=not partition)
            self.basic_optimizer = build_optimizer(config, groups, names, layerwise=wants_overlap)
        else:
            self.basic_optimizer = None
        if self.basic_optimizer is not None:
            refuse_unkept_8bit_states(config, self.basic_optimizer, passed=optimizer is not None)
        # engine.optimizer at stage 3 without an optimizer, as DeepSpeed's DeepSpeedZeRoOffload is there
        self._no_parameter_offload = NoParameterOffloadHooks()
        # a backward whose collectives need every rank, published before them (CallOrder; a forward is not: at
        # stage 3 it gathers only what is not held already, so it is not a collective on every rank every time)
        self._backward_reduces = self.shards is not None and config.zero_stage >= 2
        # each layer's sum of squares taken as its gradients land, for the step's norm; not where every rank's
        # whole buffers are reduced at the step (stages 0-1 over several ranks): that rewrites them
        self.weights.landed_sums = config.lazytrain.grad_norm_as_landed and \
            (not self.dist.enabled or self.weights.grads_to_owners)
        if config.lazytrain.gradient_reduce == "device" and self.dist.enabled and not self.weights.grads_to_owners:
            raise ConfigError("config key 'lazytrain.gradient_reduce' is \"device\", which reduces layer gradients to "
                              "the ranks that own their optimizer state; this engine's state is not sharded (the "
                              "optimizer was passed to initialize, or there is none): build it from the config's "
                              "'optimizer' section, or leave the key \"auto\"")
        if self.basic_optimizer is not None:   # what of the optimizer's own the engine replaces: handed back by destroy
            self._optimizer_own = {name: self.basic_optimizer.__dict__[name] for name in _OPTIMIZER_ATTRIBUTES_SET
                                   if name in self.basic_optimizer.__dict__}
        if self.masters is not None and self.basic_optimizer is not None:   # a group added later reaches the masters
            self.basic_optimizer.add_param_group = _onto_masters(self.basic_optimizer.add_param_group,
                                                                 self.masters.master_of)
        # the model's own zero_grad() is the engine's: torch's cleared the embedding's and head's gradients and left
        # the streamed layers' buffers (in fp32; bf16's masters kept all), so a loop calling it each micro-batch
        # stepped on the layers' whole accumulation and the others' last micro-batch
        self._model_zero_grad = model.zero_grad = _the_engines_zero_grad(self, model)
        if self.basic_optimizer is not None:   # it keeps what the engine accumulates for the step, as ZeRO's does
            self.basic_optimizer.zero_grad = _zero_grad_as_zero_optimizers(self)
            self.basic_optimizer.step = _step_from_the_engine_only(self, self.basic_optimizer)
            # as DeepSpeed's optimizers: whether the last step was skipped (accelerate and Trainer read it to
            # hold their own schedule back); an optimizer with an overflow of its own keeps it
            self._sets_overflow = not hasattr(self.basic_optimizer, "overflow")
            if self._sets_overflow:
                self.basic_optimizer.overflow = False
            if config.zero_stage >= 3 and not hasattr(self.basic_optimizer, "parameter_offload"):
                # as DeepSpeed's stage-3 optimizer: what TRL takes ZeRO-3's module hooks off around a generation
                self.basic_optimizer.parameter_offload = NoParameterOffloadHooks()
        self._layer_of_param = {id(p): i for i, params in enumerate(self.weights.params) for p in params}
        self._model_param_ids = {id(p) for p in model.parameters()} | \
            {id(m) for _, m in (self.masters.pairs if self.masters else ())}
        self._fused_clip = type(self.basic_optimizer).__name__ == "HybridAdamW"
        # the hybrid optimizer also writes the streamed layers' compute copies in its update pass
        copies = self.weights.compute_copy_views() if self._fused_clip else None
        if copies:
            self.basic_optimizer.set_compute_copies(copies)
        self._fused_copies = bool(copies)
        self._reading_checkpoint = False   # load_checkpoint reading its files (the optimizer's hooks must not raise)
        self.layer_updates = self._overlapped_updates(wants_overlap, overlap is True)
        # load_state_dict(...) by the user, on the model or any submodule, also reaches the fp32 masters
        # and the compute copies
        self._load_top: tuple | None = None   # (module, prefix, state_dict) of the load in progress
        self._load_hooks = []
        for module in model.modules():
            self._load_hooks += [module.register_load_state_dict_pre_hook(self._before_module_load),
                                 module.register_load_state_dict_post_hook(self._after_module_load)]
        if self.compute_dtype != torch.float32:
            self._load_hooks += _state_dicts_in_training_precision(model, self.weights.params, self.compute_dtype)
        self.lr_scheduler = build_scheduler(config, self.basic_optimizer, lr_scheduler)
        self.loss_scaler = LossScaler(config.fp16.loss_scale, config.fp16.initial_scale_power,
                                      config.fp16.loss_scale_window, config.fp16.hysteresis,
                                      config.fp16.consecutive_hysteresis, config.fp16.min_loss_scale,
                                      zero=config.zero_stage > 0) \
            if config.fp16.enabled else None
        # as DeepSpeed's optimizers: loss_scale and cur_scale, one value under two names, which loggers read. In
        # fp16 the scaler's (kept current by _show_loss_scale); from stage 1 in bf16 and fp32 a static 1 (one set
        # there scales the loss and unscales the gradients by it, which leaves the update as it is). An optimizer
        # with either of its own keeps it; None: the engine shows none
        shows = self.basic_optimizer is not None and (self.loss_scaler is not None or config.zero_stage >= 1) and \
            not any(hasattr(self.basic_optimizer, name) for name in ("loss_scale", "cur_scale"))
        self._shown_scale: float | None = (self.loss_scaler.scale if self.loss_scaler is not None else 1.0) \
            if shows else None
        self._show_loss_scale()
        self._collate_fn = collate_fn
        self._warned_iterable = False
        # DeepSpeed's deepspeed_io(training_data): pinned where CUDA is (loaded in this process: _build_dataloader)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn, pin_memory=True)
        # a transformers model with use_cache on would hand every block a KV cache to fill in training; asked
        # for none whatever its config says now (a script sets use_cache back on for an evaluation callback)
        self._warned_attentions = False
        self._warned_eval_cache = False
        self._within_forward = 0   # the engine's forward is running the model (it checked the model and keywords)
        self._told_plateau = False
        self._warned_hooks = {"submodules": False, "parameters": False}
        self._drops_kv_cache = _takes_use_cache(model)

        # counters (DeepSpeed's names)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._step_starts_at = 0   # micro_steps when the step under way began: no step() of it called yet
        self._warned_beyond_plan = False   # a batch longer than the plan's sequence length was said
        self._selective_sized_for: int | None = None   # the length auto's selective calibration fitted its layers at
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._managed = config.managed_gradient_accumulation   # false: each step() is the boundary (the script's)
        self._running_step = False        # step() under way: unmanaged, that is the accumulation boundary
        self._unmanaged_backwards = 0     # unmanaged: engine.backward calls since the step (global_samples)
        self._inside_no_sync = False
        self._scaled_backward = False
        self._grads_given = False   # engine.backward or a gradient set since they were zeroed: backward_since_zeroed
        self._engine_backward_depth = 0   # engine.backward running (its loss already divided): see _scale_direct_backward
        self._backward_checked_for: Plan | None = None   # the plan whose backward's lowest block was checked
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self.tput_timer = ThroughputTimer(config.train_batch_size)   # DeepSpeed's (deepspeed_extras.py)
        self.monitor = Monitor()
        self._grads_unusable = False   # a step failed before its update: zero_grad() drops what was accumulated
        self._failed_step: str | None = None   # a step that failed half-way: the engine is inconsistent
        self._unstored_copies: tuple | None = None   # (first layer, error): a step whose copies were not stored
        # the progress line's window: (when its first step began, the steps before it); None until the next
        # training forward (the first, or the first after a load: not the set-up time before it)
        self._progress_window: tuple[float, int] | None = None
        self.last_step_peak_bytes: dict[str, int] = {}
        # host optimizer + compute-copy refresh on this thread, last applied step (with overlap_optimizer
        # only the non-block part: the layers' update time is layer_updates.busy_seconds)
        self.last_optimizer_seconds = 0.0
        self._trace_request: str | None = None   # trace_next_step: "" to keep it in memory only, or a path
        self._trace_path: str | None = None      # the step being traced ("" : not written)
        self.last_trace = None
        self._traced_step: int | None = None
        self.weights.zero_grads()
        if self.shards is not None:   # late: a set-up that fails before it leaves the weights where they were
            self._shard_host_weights()
            if self._fused_copies:    # the compute copies may have moved into node-shared memory
                self.basic_optimizer.set_compute_copies(self.weights.compute_copy_views())
            # the pinned buffers sharding let go of (others' gradients and fp32 weights, the copies now shared
            # by the node) go back to the system: torch would keep them cached, pinned, in every rank
            release_cached_pinned_memory()
        # a set-up that fails from here on hands the flags and the norms back (_hand_model_back)
        self._checkpointing_turned_off = turn_off_layer_checkpointing(model, self.blocks_path, blocks)
        # turned on after set-up, it is off again before the layers' loop runs, through the engine or the model
        # called itself (its first layer would be checkpointed before the executor sees the pass)
        parent = model.get_submodule(self.blocks_path.rpartition(".")[0]) if "." in self.blocks_path else model
        self._checkpointing_guard = parent.register_forward_pre_hook(_keep_checkpointing_off_hook(self))
        self._lean_norms = make_norms_lean(blocks) if config.lazytrain.lean_norms else []
        self._step_began: float | None = None   # the first training forward of the step under way
        self._seq_len: int | None = config.lazytrain.seq_len
        self._profile_seq_len: int | None = None   # a saved profile's: no batch may be longer
        self.auto = self._auto_planner() if config.lazytrain.policy == "auto" else None
        # from here to destroy, a pass through a model that a parameter found here has left (or whose tensor was
        # replaced) is refused, and so is resize_token_embeddings; stage 3 swaps its partitioned parameters' tensors
        self._layout_guard = LayoutGuard(model, blocks, swapped=[e.param for e in self.partitioned.entries]
                                         if self.partitioned is not None and not self.partitioned.masters_only
                                         else ())
        self.weights.note_copies_current()   # what a script writes into the block parameters from here on is seen
        if self.partitioned is not None:   # last: nothing after it can fail and leave a parameter partitioned
            self.partitioned.partition()

    # ---- set-up helpers ------------------------------------------------------------------------
    def _auto_planner(self) -> auto_plan.AutoPlanner:
        """Policy "auto" (auto_plan.py), wired to this engine's tracing, plan switching and ranks."""
        settings = self._config.lazytrain.auto
        if self._model_cfg is None:
            raise ConfigError("config 'lazytrain.policy' \"auto\" needs the model's shape: a model with a Hugging "
                              "Face `config`")
        check_model_shape(self._model_cfg, "auto")
        if self.layer_updates is None:
            raise ConfigError(f"config 'lazytrain.policy' \"auto\" measures each layer's update, which needs updates "
                              f"layer by layer (HybridAdamW: the config's Adam/AdamW without amsgrad); the optimizer "
                              f"is {type(self.basic_optimizer).__name__}")
        def check_rank0s_files():   # rank 0 writes the profile and plans: its files, checked now, not after
            if settings.profile_path:   # the measured steps (every rank raises rank 0's error)
                try:
                    files.check_writable(settings.profile_path, "profile path", "profile.json")
                except ValueError as e:
                    raise ConfigError(f"config 'lazytrain.auto.profile_path' cannot be written: {e}") from None
            configured_hardware(self._config)
        self._rank0_answer(check_rank0s_files, "agreement that rank 0 can write 'lazytrain.auto.profile_path' and "
                                               "read 'lazytrain.hardware'")
        try:
            saved = measured.MachineProfile.from_json(settings.profile) if settings.profile else None
        except measured.MeasurementError as e:   # a config problem, named by its key (lazytrain train: one line)
            raise ConfigError(f"config 'lazytrain.auto.profile': {e}") from None
        if saved is not None:
            self._check_profile(saved)
        hooks = auto_plan.AutoPlanHooks(
            # a trace the script asked for (with a path) serves as well as one of our own
            request_trace=lambda: self.trace_next_step() if self._trace_request is None else None,
            # a trace of the step just completed, and applied (a skipped step has no layer updates)
            last_trace=lambda: self.last_trace if self._traced_step == self.global_steps and
            self._step_applied else None,
            switch=self._use_plan, profile_of=self._profile_of, on_rank0=self._on_rank0,
            plan_from=lambda profile: plan_from_measurements(self._config, self.tiers, profile,
                                                             self._model_budgets, self._rank_memory),
            say=lambda line: print(line) if self.global_rank == 0 else None,
            warn=lambda message: warnings.warn(message, UserWarning),
            current_policy=lambda: self.plan.policy,
            save_profile=(lambda profile: profile.to_json(settings.profile_path)) if settings.profile_path else None,
            selective_layers_to_measure=self._selective_layers_to_measure,
            micro_batches=self.gradient_accumulation_steps)
        planner = auto_plan.AutoPlanner(settings, self.plan, hooks)
        try:
            planner.start(saved)
        except ValueError as e:   # a saved profile that checks out but cannot be planned from: named as the file
            if saved is None:
                raise
            raise ConfigError(f"config 'lazytrain.auto.profile' ({settings.profile}): planning from it failed: "
                              f"{e}") from None
        return planner

    def _least_memory_over_ranks(self) -> RankMemory:
        """The smallest card, node RAM and RAM share of any rank (this rank's alone without data parallel)."""
        mine = RankMemory.of_this_rank(self.device)
        if not self.dist.enabled:
            return mine
        return RankMemory.least(self.dist.all_gather_object(
            mine, "agreement on the ranks' card and host memory, which rank 0 plans with"))

    def _selective_layers_to_measure(self) -> tuple[tuple[int, ...] | None, str | None]:
        """The layers selective calibration steps measure, the same on every rank: chosen on rank 0 for the
        least room any rank's device has beside its plain calibration's peak (every rank runs them)."""
        room = self._device_room()
        if self.dist.enabled:   # None: no bound on that rank
            room = least_known(self.dist.all_gather_object(room, "agreement on the device room for the selective "
                                                                 "calibration"))
        chosen = self._on_rank0(lambda: self._selective_layers_fitting(room))
        self._selective_sized_for = self._seq_len if room is not None else None   # (the ranks' longest)
        return chosen

    def _device_room(self) -> int | None:
        """The bytes this rank's device tier has left beside the plain calibration's peak (None: no bound, the
        CPU without a device budget, whose kept outputs stay in host memory)."""
        hbm = self.tiers["hbm"]
        if hbm.capacity is not None:
            # the calibration step's own peak: the tiers' peaks were reset at the end of the step just done
            return hbm.capacity - max(hbm.peak_bytes, self.last_step_peak_bytes.get("hbm", 0))
        if self.device.type == "cuda":
            # no device budget configured: the GPU's memory, less what torch has had allocated at its peak
            # (the calibration steps' activations and workspaces with the tier's bytes) and the reserve the
            # planner keeps for the CUDA context and allocator; every layer's kept outputs could overrun it
            return card_memory(self.device) - GPU_RESERVED_BYTES - torch.cuda.max_memory_allocated(self.device)
        return None

    def _selective_layers_fitting(self, room: int | None) -> tuple[tuple[int, ...] | None, str | None]:
        """The layers whose kept outputs (every selective layer's matmul and attention outputs at the turn,
        as the planner's model of this model counts them) ``room`` bytes of the device tier can hold, and why
        not every layer (planner/measured.py ``layers_to_measure_selective``). Only blocks the calibration's
        backward reaches: one below a frozen bottom is never re-run (none, with no why, where no block is)."""
        L = self.weights.num_layers
        first = self.executor.backward_reaches or 0   # the calibration's last training forward's
        if first >= L:
            return (), None
        reached = tuple(range(first, L)) if first else None   # None: every layer
        if self._seq_len is None or room is None:
            return reached, None
        from ..planner.search import as_model_shape
        shape = as_model_shape(self._model_cfg)
        tokens = self.train_micro_batch_size_per_gpu() * self._seq_len
        # the planner counts the kept ops' outputs; the kernels keep a little beside them (attention's fp32
        # log-sum-exp) and the tier counts whole storages: chosen to the byte, the selective calibration would
        # run over the tier's budget in the middle of the training's forward (TierBudgetError), so a margin
        kept = [b + b // SELECTIVE_MARGIN for b in shape.selective_bytes(tokens)]
        chosen, why = measured.layers_to_measure_selective(kept[first:], list(shape.layers)[first:], max(0, room))
        return tuple(i + first for i in chosen), why

    def _profile_of(self, traces: list, selective: list | None = None,
                    selective_layers: tuple = ()) -> measured.MachineProfile:
        """This machine's profile from the traced steps: each layer's times, the links' bandwidths, and from
        the steps traced with ``selective_layers`` selective (when given), a selective layer's times (the
        other layers' from their kind's)."""
        if self._seq_len is None:
            raise ConfigError("config 'lazytrain.policy' \"auto\" needs 'lazytrain.seq_len' (no token ids were "
                              "seen in the traced forwards to read it from)")
        links = measured.link_bandwidths(traces)
        missing = [name for name in ("h2d_gbps", "d2h_gbps") if name not in links]
        if self.device.type == "cpu" and missing:   # copies that ran in place are memory copies: measured here
            gbps = memory_copy_gbps()              # once, for both directions
            links.update(dict.fromkeys(missing, gbps))
        k = self.gradient_accumulation_steps()
        costs = measured.MeasuredCosts.from_traces(traces, self.weights.num_layers, source=f"{self.device}",
                                                   micro_batches=k, lean_norms=self._config.lazytrain.lean_norms,
                                                   grads_beside_bytes=self._grads_beside_bytes())
        if selective:
            from ..planner.search import as_model_shape
            costs = measured.with_selective(costs, selective, micro_batches=k, layers=selective_layers or None,
                                            kinds=list(as_model_shape(self._model_cfg).layers))
        return measured.MachineProfile(
            costs=costs, links_gbps=links, model=self._model_cfg,
            micro_batch=self.train_micro_batch_size_per_gpu(), seq_len=self._seq_len, device=str(self.device),
            grad_accum=self.gradient_accumulation_steps(), device_name=self._device_name(),
            loss_chunk_tokens=self._config.lazytrain.head_tokens(
                self.train_micro_batch_size_per_gpu() * self._seq_len), world_size=self.world_size,
            zero_stage=self._config.zero_stage, weights_in_host=self._config.lazytrain.weights_home in ("host", "hbm"),
            non_block_state=non_block_state_home(self._config), **self._model_budgets)

    def _device_name(self) -> str:
        """The device's model, so that a profile is not reused on another kind of GPU."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return platform.processor() or platform.machine() or self.device.type

    def _grads_beside_bytes(self) -> tuple[int, int] | None:
        """What the masters' gradient sink copies each micro-batch: (head side, embeddings). An embedding's
        gradient (token or position; a tied head's too) is finished by the backward's last op."""
        if self.masters is None:
            return None
        last = {id(m.weight) for m in self.module.modules() if isinstance(m, nn.Embedding)}
        return self.masters.sink_bytes(last)

    def _check_profile(self, profile: measured.MachineProfile) -> None:
        where = f"config 'lazytrain.auto.profile' ({self._config.lazytrain.auto.profile})"
        if profile.costs.num_layers != self.weights.num_layers:
            raise ConfigError(f"{where} measured {profile.costs.num_layers} layers, this model streams "
                              f"{self.weights.num_layers}")
        if torch.device(profile.device).type != self.device.type:   # its times are another machine's
            raise ConfigError(f"{where} was measured on {profile.device}, this run trains on {self.device}: measure "
                              f"again (leave 'profile' out)")
        here = self._device_name()
        if profile.device_name is not None and profile.device_name != here:
            raise ConfigError(f"{where} was measured on {profile.device_name}, this run trains on {here}: its times "
                              f"are another machine's; measure again (leave 'profile' out)")
        if profile.micro_batch != self.train_micro_batch_size_per_gpu():
            raise ConfigError(f"{where} was measured at micro-batch {profile.micro_batch}, this run trains "
                              f"{self.train_micro_batch_size_per_gpu()}: measure again (leave 'profile' out)")
        if self._seq_len is not None and profile.seq_len != self._seq_len:
            raise ConfigError(f"{where} was measured at sequence length {profile.seq_len}, 'lazytrain.seq_len' is "
                              f"{self._seq_len}")
        # over other ranks or another stage a step holds other collectives and updates other layers
        ran, here = _ranks(profile.world_size, profile.zero_stage), _ranks(self.world_size, self._config.zero_stage)
        if profile.world_size is not None and ran != here:
            raise ConfigError(f"{where} was measured over {ran}, this run trains over {here}: its step times are "
                              f"another run's; measure again (leave 'profile' out)")
        # what trains, and in how many bits its moments are kept, set the backward's and the updates' times
        for key, mine in self._model_budgets.items():
            theirs = getattr(profile, key)
            if theirs is not None and mine is not None and abs(theirs - mine) > 1e-9:
                raise ConfigError(f"{where} was measured with {key} {theirs:.6g}, this run's is {mine:.6g}: its "
                                  f"backward and update times are another run's; measure "
                                  f"again (leave 'profile' out)")
        # the layers, and what lies outside them (the embedding's and head's size sets the non-block update and
        # the host memory the plan budgets)
        for key, default in (("layer_params", None), ("hidden_size", None), ("vocab_size", None), ("dtype", None),
                             ("tie_word_embeddings", False)):
            theirs, mine = profile.model.get(key, default), self._model_cfg.get(key, default)
            if theirs != mine:
                raise ConfigError(f"{where} was measured on another model: its {key} is {theirs!r}, this model's "
                                  f"{mine!r}")
        self._profile_seq_len = profile.seq_len   # checked against every training batch

    def _on_rank0(self, compute):
        """``compute()`` on rank 0, its answer on every rank (its error raised on every rank). Rank 0 plans for
        the longest sequence any rank has trained: every rank runs its plan."""
        if self.dist.enabled:
            seen = [n for n in self.dist.all_gather_object(self._seq_len, "agreement on the sequence length")
                    if n is not None]
            self._seq_len = max(seen) if seen else None
        return self._rank0_answer(compute, _AUTO_PLAN_ON_RANK_0)

    def _check_one_plan_file_over_ranks(self) -> None:
        """Every rank runs one plan (rank 0's, where a planner makes it): a Plan file that each rank reads for
        itself must say the same on every rank (its name and predictions aside), or each would run its own."""
        mine = {k: v for k, v in self.plan.to_dict().items() if k not in ("prediction", "policy")}
        plans = self.dist.all_gather_object((mine, self._config.lazytrain.plan_path), "agreement on the Plan file")
        other = next((r for r, (plan, _) in enumerate(plans) if plan != plans[0][0]), None)
        if other is not None:   # every rank sees the same list: every rank raises
            field = next(k for k in plans[0][0] if plans[0][0][k] != plans[other][0].get(k))
            raise ConfigError(f"config 'lazytrain.plan': rank {other}'s plan ({plans[other][1]}) differs from rank "
                              f"0's ({plans[0][1]}) in {field!r}: every rank runs one plan; give every rank the same "
                              f"file")

    def _rank0_answer(self, compute, what: str):
        """``compute()`` on rank 0 alone, its answer returned on every rank and its error raised on every rank."""
        answer, error = None, None
        if self.global_rank == 0:
            try:
                answer = compute()
            except Exception as e:   # noqa: BLE001 - every rank raises it
                error = e
        if self.dist.enabled:
            gathered = self.dist.all_gather_object((answer, error), what)[0]
            if self.global_rank:   # rank 0 keeps its own: a copy has lost its traceback
                answer, error = gathered
        if error is not None:
            raise error
        return answer

    def _use_plan(self, plan: Plan) -> None:
        """Run ``plan`` from the next forward on: between steps, once the last update is done (the streamed
        weights, the tiers and the device copies stay; only the executor's schedule changes)."""
        self.wait_for_update()
        plan.validate(custom_tiers=tuple(self.tiers))
        if tuple(sorted(plan.resident_layers)) != tuple(sorted(self.stream.resident)):
            raise ConfigError(f"plan {plan.policy!r} keeps layers {list(plan.resident_layers)} resident, and this "
                              f"engine started with {sorted(self.stream.resident)}: a running engine keeps its "
                              f"resident layers")
        blocks, failure = self.executor.blocks, self.executor.backward_failure
        self.stream.settle_all()
        self.executor.uninstall()
        # the pass numbers go on from the old executor's: a pass of it still alive (an evaluation output
        # under grad) keeps its boundaries under keys no new pass reuses
        self.executor = LayerStreamingExecutor(blocks, plan, self.weights, self.stream, self.tiers, self.device,
                                               prefetch=self._config.lazytrain.prefetch,
                                               pass_ids=self.executor.pass_ids,
                                               weights_epoch=self.executor.weights_epoch,
                                               backward_ends_step=self._backward_may_end_step,
                                               before_pass=self._before_pass,
                                               outside_params=self._outside_params)
        self.executor.backward_failure = failure
        self.plan = plan

    def _overlapped_updates(self, wanted: bool, required: bool) -> LayerUpdates | None:
        """Layer updates on a worker thread (``lazytrain.overlap_optimizer``), when the optimizer can update
        one layer with a snapshot of its groups (HybridAdamW). The engine's readers, every module's
        state_dict/load_state_dict and the optimizer's step/state_dict/load_state_dict wait for them."""
        if not wanted or self.basic_optimizer is None:
            return None
        if not self._fused_clip:
            if required:
                raise ConfigError(f"config 'lazytrain.overlap_optimizer' = true needs an optimizer that updates one "
                                  f"layer at a time (HybridAdamW, which the config's Adam/AdamW become unless "
                                  f"amsgrad is set); got {type(self.basic_optimizer).__name__}")
            return None
        updates = LayerUpdates(self.weights.num_layers, self.device, on_done=self.stream.on_update_done)
        self.weights.updates = updates
        def settle(*args, **kwargs):   # hook signatures differ
            # a checkpoint being read (the way out of a failed update) reads the optimizer's state: no raise
            updates.settle() if self._reading_checkpoint else updates.wait_all()
        self._settle_hooks = [self.basic_optimizer.register_step_pre_hook(settle),
                              self.basic_optimizer.register_state_dict_pre_hook(settle),
                              self.basic_optimizer.register_load_state_dict_pre_hook(settle)]
        for module in self.module.modules():   # a submodule's state_dict (save_pretrained of an inner model)
            self._settle_hooks += [module.register_state_dict_pre_hook(settle),
                                   module.register_load_state_dict_pre_hook(settle)]
        return updates

    def _assign_shards(self, groups: list[dict]) -> sharding.Ownership:
        """Whole streamed layers, then the optimizer's other tensors, to the ranks (see sharding.py)."""
        in_groups = {id(p) for g in groups for p in g["params"]}
        layers = [[p for p in params if id(p) in in_groups] for params in self.weights.params]
        in_layers = {id(p) for params in layers for p in params}
        others = [p for g in groups for p in g["params"] if id(p) not in in_layers]
        return sharding.assign(layers, others, self.global_rank, self.world_size)

    def _shard_host_weights(self) -> None:
        """Sharded data parallel with the streamed layers' weights in host memory:

        * the ranks of a node keep one copy of what the layers are computed from (node_memory.py): the fp32
          weights in fp32 training, the compute copies in bf16/fp16. Owners write their layers in place, after
          every rank has entered the step (the gradient norm's all-reduce comes first), then broadcast them
          (to other nodes' ranks; the same node's write the same values again) or, when every rank is on this
          one node, a one-byte signal: every rank's readiness is still what its own broadcast tells it. A node
          that cannot make the shared memory keeps a copy per rank, with a warning.
        * in bf16/fp16, a rank keeps fp32 weights only for the layers it owns; the owners broadcast the
          updated compute copies (half the bytes of fp32), and the fp32 weights of the others are gathered
          from their owners when a checkpoint or ``module_state_dict()`` needs them.
        Weights on NVMe stay whole on every rank (each rank's own files)."""
        w = self.weights
        if w.weights_tier.kind != "host":
            return
        dtype = torch.float32 if w.shares_master else self.compute_dtype
        homes = None
        try:
            homes, nodes = node_memory.node_shared_buffers([n * dtype.itemsize for n in w.layer_numels], self.dist,
                                                           self.device)
        except node_memory.SharedMemoryUnavailable as e:
            warnings.warn(f"lazytrain: the ranks on this node could not share one host copy of the streamed "
                          f"weights ({e}); each keeps its own", UserWarning)
        if homes is not None:   # one rank writes the values, so that ranks built differently cannot mix
            leader = self.global_rank == nodes.leader
            homes = [h.view(dtype) for h in homes]
            if w.shares_master:
                w.move_masters(homes, copy_values=leader)
            else:
                w.move_compute_copies(homes, copy_values=leader)
            self.node_shared_weights = True
            # a node shares or none of its ranks does: with a single node, every rank decides alike
            self._one_shared_node = len(nodes.members) == 1
        self.dist.barrier("barrier after the node-shared weights were written")
        if not w.shares_master:
            w.drop_foreign_masters(self.shards.owns_layer)

    def _foreign_masters(self) -> dict[int, torch.Tensor]:
        """With the masters sharded (bf16/fp16): the fp32 weights of the streamed layers this rank does not
        own, by ``id`` of their parameters, broadcast by their owners layer by layer (a collective: every
        rank calls it). Empty when every rank holds every layer's."""
        w, out = self.weights, {}
        if not w.masters_sharded:
            return out
        for i in range(w.num_layers):
            mine = w.master[i] is not None
            buf = w.master[i] if mine else torch.empty(w.master_numels[i], dtype=torch.float32)
            self.dist.broadcast_from([buf], self.shards.layer_owner[i], what="gather of the fp32 weights of "
                                     "the streamed layers from their owners (module_state_dict() or destroy(): "
                                     "every rank must call it)")
            if not mine:   # frozen parameters kept in the compute copy alone have no fp32 weights anywhere
                out.update({id(p): slot.of(buf) for slot, p, trains in zip(w.layer_slots[i], w.params[i],
                                                                            w.trainable[i])
                            if trains or not w.frozen_in_copy})
        return out

    def _masters_home(self) -> torch.device:
        """Where the non-block fp32 masters and their optimizer state live ('lazytrain.non_block_state',
        placement.py): on a GPU the host by default, as DeepSpeed's ZeRO-Offload keeps them
        (a model with nothing to stream too: every parameter resident on the GPU, its optimizer on the
        host); with "device", beside their compute copies."""
        if non_block_state_home(self._config) == "host":
            return torch.device("cpu")
        return self.device

    def _move_non_block(self, model: nn.Module, blocks: nn.ModuleList) -> None:
        """Embeddings, final norm, head and their buffers go to the compute device (the frozen ones are there
        already: FrozenParams)."""
        for p in self.non_block_params:
            p.data = p.data.to(self.device)
        block_modules = {id(m) for b in blocks for m in b.modules()}   # the block list's own buffers move too
        for mod in model.modules():
            if id(mod) in block_modules:
                continue
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = buf.to(self.device)

    def _build_dataloader(self, training_data, collate_fn, batch_size: int | None = None, shuffle: bool = True,
                          sampler=None, pin_memory: bool = False, num_workers: int | None = None):
        """DeepSpeed's loader over ``training_data``: a DistributedSampler of this rank's part, shuffled from seed
        0, so the order is DeepSpeed's own (its engine needs LOCAL_RANK, which its set-up gives a process started
        alone too), and ``loader.data_sampler.set_epoch`` works in every run. A process started alone drew from a
        RandomSampler, whose order followed torch's random state and which has no ``set_epoch``. The batches
        are loaded in this process unless ``num_workers`` says otherwise, where DeepSpeed's loader forks two
        workers: a forked worker shares this process's memory copy-on-write, and the first step of each epoch
        would copy every page of the host optimizer state it rewrites (LazyTrain always keeps that state on the
        host: 8 bytes a parameter of Adam moments more, for the epoch, beyond what the plan budgets). An
        iterable dataset is read in this process whatever ``num_workers`` says (torch would hand each worker
        the whole stream)."""
        if training_data is None:
            return None
        if not is_dataset(training_data):   # as deepspeed_io, for initialize's training_data too
            raise ValueError("Training data must be a torch Dataset")   # DeepSpeed's words
        iterable = isinstance(training_data, torch.utils.data.IterableDataset)
        num_workers = 0 if num_workers is None or iterable else num_workers
        common = dict(batch_size=batch_size or self.train_micro_batch_size_per_gpu(), collate_fn=collate_fn,
                      drop_last=self._config.dataloader_drop_last, num_workers=num_workers,
                      pin_memory=pin_memory and torch.cuda.is_available())
        if iterable:   # it orders (and splits) itself
            if sampler is not None:   # torch's refusal: dropped here, the script's sampler went unused
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified sampler option, but got "
                                 f"sampler={sampler}")
            if self.world_size > 1 and not self._warned_iterable:
                self._warned_iterable = True
                warnings.warn(f"lazytrain: an IterableDataset under {self.world_size} ranks: every rank reads it "
                              f"as it yields, so unless it yields each rank its own part (as Hugging Face's "
                              f"datasets.distributed.split_dataset_by_node makes it), every rank trains on the same "
                              f"samples", UserWarning, stacklevel=3)
            return EpochDataLoader(training_data, **common)
        if sampler is None:
            sampler = EpochTrackingSampler(training_data, num_replicas=self.world_size, rank=self.global_rank,
                                           shuffle=shuffle)
        return EpochDataLoader(training_data, sampler=sampler, shuffle=sampler is None, **common)

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None):
        """DeepSpeed's: a loader over ``dataset`` (an evaluation or prediction set, or another training set) at
        the micro-batch size unless ``batch_size`` says otherwise, with ``initialize``'s ``collate_fn`` unless
        given; ``route`` "eval" or "predict" keeps the dataset's order (this rank's part of it), "train" (and
        DeepSpeed's "encode") shuffles as the training loader does. Pinned memory only where CUDA is; loaded in
        this process unless ``num_local_io_workers`` asks for worker processes (:meth:`_build_dataloader`)."""
        if not is_dataset(dataset):   # a list or a Hugging Face dataset too, as DeepSpeed takes them
            raise ValueError("Training data must be a torch Dataset")   # DeepSpeed's words
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                                       or batch_size < 1):   # numpy's integers too, as DeepSpeed takes them
            raise ValueError(f"deepspeed_io batch_size must be a whole number >= 1 (or None: the micro-batch "
                             f"size), got {batch_size!r}")
        if route not in ("train", "eval", "predict", "encode"):
            raise ValueError(f"deepspeed_io route must be \"train\", \"eval\", \"predict\" or \"encode\", got "
                             f"{route!r}")
        return self._build_dataloader(dataset, collate_fn if collate_fn is not None else self._collate_fn,
                                      batch_size=None if batch_size is None else int(batch_size),
                                      shuffle=route in ("train", "encode"), sampler=data_sampler,
                                      pin_memory=pin_memory, num_workers=num_local_io_workers)

    # ---- the training loop's surface -----------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self.__dict__.get("_superseded"):   # its model taken over by another engine: that one runs it
            live = module_copy.engine_of(self.module)
            if live is not None and live is not self and live.module is self.module:
                return live(*inputs, **kwargs)
        self._refuse_if_destroyed("a forward")
        self._check_model_unchanged(torch.is_grad_enabled())
        if self._trace_request is not None and torch.is_grad_enabled() and streams.recording() is None \
                and self._at_step_start():   # a request made mid-step waits for the next step
            # the traced step begins with this forward
            streams.start_recording(Timeline(measured_source(self.global_rank, self.world_size),
                                             device=self.device.type), self.device)
            self._trace_path, self._trace_request = self._trace_request, None
        self._refuse_if_inconsistent("a forward" if not torch.is_grad_enabled() else "a training forward")
        if torch.is_grad_enabled():
            self._keep_layer_checkpointing_off()
            if self._step_began is None:
                self._step_began = time.perf_counter()
            if self._progress_window is None:   # (not _step_began: a forward before a load may have set it)
                self._progress_window = (time.perf_counter(), self.global_steps)
            if not self.tput_timer.started:   # a micro-step's first training forward, as DeepSpeed's timer starts
                self.tput_timer.start()
            if self.auto is not None or (self.plan.seq_len is not None and not self._warned_beyond_plan):
                ids = _token_ids(inputs, kwargs)
                if ids is not None and self.auto is not None:   # policy auto plans for the batches it sees
                    self._note_batch_for_auto(ids)
                elif ids is not None:
                    self._warn_beyond_plan(ids)
        inputs = tuple(self._to_device(x) for x in inputs)
        kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
        if self._config.fp16.enabled and self._config.fp16.auto_cast:
            inputs = _cast_half(inputs)   # DeepSpeed's fp16.auto_cast: the positional inputs, not the keywords
        if self._drops_kv_cache and torch.is_grad_enabled() and "use_cache" not in kwargs:
            kwargs["use_cache"] = False   # a training forward fills no KV cache, as under gradient checkpointing
            if not self.module.training and not self._warned_eval_cache and _config_uses_cache(self.module):
                self._warned_eval_cache = True   # a decode loop with gradients on would go on from no cache
                warnings.warn(_NO_CACHE_WITH_GRAD, stacklevel=4)
        if torch.is_grad_enabled():
            _refuse_router_aux_loss(self.module, kwargs)
            self._warn_of_user_hooks()
            if _wants(self.module, kwargs, "output_attentions") and not self._warned_attentions:
                self._warned_attentions = True
                warnings.warn("lazytrain: attention weights returned by a training forward (output_attentions) carry "
                              "no gradient from the streamed layers, which run without autograd in the forward (a "
                              "loss term built from those of a layer whose graph the forward records is refused at "
                              "the backward, or trains nothing under retain_graph=True): use them for inspection, "
                              "not in the loss")
        if self.partitioned is not None:
            self.partitioned.begin_forward()
        chunk = self._config.lazytrain.loss_chunk_tokens
        engine_hooks = self.partitioned.hook_ids() if self.partitioned is not None else frozenset()
        self.executor.backward_reaches = None
        with self._running_the_model():   # checked as this forward began: its first block's call checks nothing more
            if chunk and chunked_loss.applies(self.module, kwargs, engine_hooks):
                out = chunked_loss.forward(self.module, chunk, inputs, kwargs)
                if self.partitioned is not None:   # its backward recomputes the head's logits outside the head,
                    # and the model's own fetch-again hooks sit on outputs the loss does not use: every partitioned
                    # parameter the forward read is fetched again before this loss's backward, as they would be
                    self.partitioned.keep_for_backward([out.loss], list(self.module.parameters()))
            else:
                out = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            out = self._scale_direct_backward(out)
            # the caller, under nn.Module.__call__'s two frames
            self._check_where_the_backward_stops(stacklevel=4)
        return out

    def _warn_of_user_hooks(self) -> None:
        """Once each: hooks inside the streamed blocks that run twice on tensors without gradient, and hooks on
        their parameters that never run (user_hooks.py); looked for at each training forward until said."""
        for kind, find, say in (("submodules", user_hooks.hooked_submodules, user_hooks.submodule_hooks_warning),
                                ("parameters", user_hooks.hooked_parameters, user_hooks.parameter_hooks_warning)):
            names = [] if self._warned_hooks[kind] else find(self.executor.blocks, self.blocks_path)
            if names:
                self._warned_hooks[kind] = True
                warnings.warn(say(names), stacklevel=4)

    def _outside_params(self) -> list[tuple[str, nn.Parameter]]:
        """The model's parameters outside the streamed blocks, by name (the executor's check that no block
        computes with a trainable one)."""
        outside = {id(p) for p in self.non_block_params}
        return [(name, p) for name, p in self.module.named_parameters() if id(p) in outside]

    def _keep_layer_checkpointing_off(self) -> None:
        """The model's gradient checkpointing turned on after initialize() (a script's
        ``gradient_checkpointing_enable()``) is off again for the streamed blocks, as at set-up: the executor
        re-runs them itself, and the reentrant kind cannot be differentiated the executor's way."""
        changed = turn_off_layer_checkpointing(self.module, self.blocks_path, self.executor.blocks)
        self._checkpointing_turned_off += [m for m in changed if all(m is not k for k in self._checkpointing_turned_off)]

    def _scale_direct_backward(self, out):
        """DeepSpeed 0.19's PyTorch-compatible backward: ``loss.backward()`` or ``output.backward(grad)`` on
        what the engine returned gives what ``engine.backward(loss)`` gives. Each output tensor is returned as
        an alias of itself (a view) whose hook divides the gradient entering the model through it by the
        accumulation steps, unless ``engine.backward`` already divided the loss. The hook is on the alias, not
        on the model's own tensor, so a gradient is divided once where it enters: not again where the model
        used that tensor inside (its hidden states, which its logits come from), and every path from the loss
        is divided (the head's too, when the loss uses the logits). A forward of the wrapped module called
        directly gets no hook (DeepSpeed's rule). In fp16 a direct backward is refused, as DeepSpeed does: the
        loss must be scaled first."""
        gas = self.gradient_accumulation_steps()
        if gas == 1 and self.loss_scaler is None:
            return out

        def scaled(t: torch.Tensor) -> torch.Tensor:
            if not (t.requires_grad and t.grad_fn is not None):
                return t
            alias = t.view_as(t)
            alias.register_hook(self._direct_backward_hook)
            return alias
        return _map_output_tensors(out, scaled)

    def _direct_backward_hook(self, grad):
        if self._engine_backward_depth:
            return grad                      # engine.backward scaled the loss itself
        if self.loss_scaler is not None:
            raise RuntimeError("fp16 training needs its loss scaled before backward, but backward() was called "
                               "directly on the engine's output: call engine.backward(loss) (which scales it and "
                               "divides by the accumulation steps), as DeepSpeed requires")
        return grad / self.gradient_accumulation_steps()

    def _to_device(self, x):
        return x.to(self.device) if isinstance(x, torch.Tensor) and x.device != self.device else x

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """``loss.backward()`` with the loss divided by the accumulation steps (and fp16-scaled)."""
        self._refuse_if_destroyed("engine.backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:   # shape (1,) too, as DeepSpeed takes it
            raise ValueError("engine.backward(loss) needs a scalar loss tensor")
        loss = loss.reshape(())
        if not loss.requires_grad:   # torch's "element 0 of tensors does not require grad", with the likely cause
            raise RuntimeError("engine.backward(loss): the loss does not require grad: nothing it was computed from "
                               "trains (computed under torch.no_grad(), or from frozen parameters alone). A "
                               "trainable parameter registered outside the streamed blocks that a block computes "
                               "with (an adapter kept in another module, applied by a hook or a wrapped forward) is "
                               "not seen by LazyTrain: register it inside the block")
        if not self._managed:
            self._unmanaged_backwards += 1
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        scaled = loss
        if not self._scaled_backward:   # the step's first micro-batch (fp16): a scale set on the optimizer holds
            self._adopt_loss_scale_set()
        if self.loss_scaler is not None:
            scaled = loss.float() * self.loss_scaler.scale
            self._scaled_backward = True
        if self._backward_reduces:
            self.dist.calls.entering("engine.backward()", self.micro_steps)
        self._grads_given = True
        self._check_where_the_backward_stops(stacklevel=2)   # a forward through engine.module: not checked yet
        self._engine_backward_depth += 1
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._engine_backward_depth -= 1
        return loss

    def _check_where_the_backward_stops(self, stacklevel: int) -> None:
        """Once a plan, at its first training forward (before a backward that may not fit; at its backward for a
        forward through ``engine.module``): whether the backward goes down to the block its plan counted (a frozen
        bottom: the blocks below the first that trains, with nothing run before them training, have none). The
        engine's count for a first plan is an estimate from the parameters; a wrong one trains right, but the
        plan's time and memory are then not what it predicted."""
        planned = self.plan.prediction.get("frozen_bottom_layers")
        reached = self.executor.backward_reaches
        if isinstance(planned, bool) or not isinstance(planned, int) or reached is None \
                or self._backward_checked_for is self.plan:
            return
        self._backward_checked_for = self.plan
        if reached == planned:
            return
        if reached < planned:
            why = (f"this training forward's backward goes down to block {reached}: the plan re-runs blocks "
                   f"{reached}-{planned - 1} from the kept boundary below them, so its steps take longer and hold more "
                   f"device memory than it predicted")
        else:
            why = (f"this training forward's backward stops at block {reached} (the blocks below it are frozen and "
                   f"nothing run before them trains): the plan counted a backward for blocks {planned}-{reached - 1}, "
                   f"which runs none")
        lt = self._config.lazytrain
        if lt.policy == "plan":
            fix = f"Make the plan again with `lazytrain plan --frozen-bottom-layers {reached}`"
        elif lt.policy == "auto" and lt.auto.profile:
            fix = ("Measure again: the saved profile 'lazytrain.auto.profile' was measured on a run whose backward "
                   "stopped elsewhere")
        elif lt.policy == "auto":
            fix = "The run changed what trains since policy \"auto\" measured it"
        else:
            fix = (f"Set 'lazytrain.frozen_bottom_layers' to {reached}, or use policy \"auto\", which measures where "
                   f"the backward stops")
        warnings.warn(f"lazytrain: plan {self.plan.policy!r} was made for a backward that stops at block {planned}, "
                      f"but {why}. {fix}", UserWarning, stacklevel=stacklevel + 1)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-batch ends the step: every ``gradient_accumulation_steps``-th, or as the script set
        it; with ``managed_gradient_accumulation`` false, only while ``step()`` runs (as DeepSpeed's)."""
        if not self._managed:
            return self._running_step
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        if not self._managed:   # DeepSpeed's assertion and message
            raise AssertionError("set_gradient_accumulation_boundary() is not supported with "
                                 "managed_gradient_accumulation=False; the caller owns the boundary by calling step()")
        self._boundary_override = bool(is_boundary)

    def _at_step_start(self) -> bool:
        """No micro-batch of the step under way has run yet: no step() of it (managed), no backward since the last
        step (unmanaged, where micro_steps moves only in step())."""
        if self._managed:
            return self.micro_steps == self._step_starts_at
        return not self.backward_since_zeroed()

    def _backward_may_end_step(self) -> bool:
        """Whether the backward now running may be its step's last, so that its gradients must have landed when
        it returns (``.grad`` read after it is whole). Unmanaged, any backward may be: each one settles."""
        return not self._managed or self.is_gradient_accumulation_boundary()

    def step(self, lr_kwargs: dict | None = None) -> None:
        """On an accumulation boundary: clip, update, zero grads, advance the schedule."""
        if self._inside_no_sync:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")   # DeepSpeed's
        self._step_applied = False            # as DeepSpeed: true only after a step() that updated
        self._refuse_if_inconsistent("step()")
        self._running_step = True
        try:
            self._step_or_micro_step(lr_kwargs)
        finally:
            self._running_step = False

    def _step_or_micro_step(self, lr_kwargs: dict | None) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._check_lr_kwargs(lr_kwargs)
            self._refuse_unfrozen()
            self.dist.calls.entering("engine.step()", self.micro_steps)
            try:
                self._take_model_step(lr_kwargs)
            except StepFailedError:   # before the update: the accumulated gradients are not to be stepped on
                self._grads_unusable = True
                raise
            self._grads_unusable = False   # a retried step that went through
            began, self._step_began = self._step_began, None
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1
        if boundary:
            self._step_starts_at = self.micro_steps
        self.dist.calls.at_micro_step(self.micro_steps)
        if boundary and self.auto is not None:
            self.auto.after_step(self.global_steps, time.perf_counter() - (began or time.perf_counter()))
        self._raise_unstored_copies()

    def _refuse_unfrozen(self) -> None:
        """A parameter frozen when initialize() ran has no fp32 master, gradient buffer or optimizer state (and a
        block's gets no gradient): one that requires grad now would train wrongly or not at all, so the step is
        refused before it updates anything. So is a streamed block's parameter frozen after initialize(): the
        blocks' autograd views were made from what trained then, so it would go on getting gradients and
        updates."""
        w = self.weights
        block_params = [(p, t) for params, trains in zip(w.params, w.trainable) for p, t in zip(params, trains)]
        unfrozen = [p for p, t in block_params if not t and p.requires_grad] + self.frozen_non_block.unfrozen()
        newly_frozen = self._block_params_frozen_since_initialize()
        if not unfrozen and not newly_frozen:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}   # for the error alone
        if unfrozen:
            raise RuntimeError(f"lazytrain: parameter {names.get(id(unfrozen[0]), '?')!r} was frozen (requires_grad "
                               f"False) when initialize() ran and requires grad now: LazyTrain keeps a frozen "
                               f"parameter without fp32 weights, gradients or optimizer state, as DeepSpeed does, so "
                               f"it cannot start training after initialize(). Set requires_grad before initialize(), "
                               f"or freeze it again")
        raise RuntimeError(f"lazytrain: parameter {names.get(id(newly_frozen[0]), '?')!r} of a streamed block "
                           f"trained when initialize() ran and is frozen now (requires_grad False): the streamed "
                           f"blocks compute gradients for what trained at initialize(), so it would go on "
                           f"being updated. Freeze parameters before initialize(), or set requires_grad back")

    def _block_params_frozen_since_initialize(self) -> list:
        w = self.weights
        return [p for params, trains in zip(w.params, w.trainable) for p, t in zip(params, trains)
                if t and not p.requires_grad]

    def _backward_refused_for_frozen(self) -> str | None:
        """Why a backward through this forward is refused (None: it is not): a streamed block's trained parameter
        frozen now would get a gradient from the block's re-run (the blocks' autograd views follow what trained
        at initialize()), where PyTorch gives it none, and a script unfreezing it before the step trained it on
        that gradient without a word. The forward itself runs (PEFT's disable_adapter() freezes the adapters
        it leaves out, for a reference forward whose output is detached)."""
        newly_frozen = self._block_params_frozen_since_initialize()
        if not newly_frozen:
            return None
        name = next((n for n, p in self.module.named_parameters() if p is newly_frozen[0]), "?")
        return (f"lazytrain: parameter {name!r} of a streamed block trained when initialize() ran and was frozen "
                f"(requires_grad False) at the forward this backward goes through: the streamed blocks compute "
                f"gradients for what trained at initialize(), so it would get a gradient PyTorch would not give it. "
                f"For gradients with respect to the inputs alone, use torch.autograd.grad(loss, inputs); to freeze "
                f"it for good, freeze it before initialize()")

    def _check_lr_kwargs(self, lr_kwargs: dict | None) -> None:
        """Arguments the schedule's step() does not take are refused before the update, not after it (where
        the schedule would fail with the weights already updated)."""
        if self.lr_scheduler is None or self._leaves_plateau_to_the_script(lr_kwargs):
            return
        lr_kwargs = lr_kwargs or {}   # none at all: a schedule whose step needs an argument
        try:
            signature = inspect.signature(self.lr_scheduler.step)
        except (TypeError, ValueError):   # a builtin without a signature: it will say for itself
            return
        try:
            signature.bind(**lr_kwargs)
        except TypeError as e:
            if not lr_kwargs and self._steps_schedule_by_samples():
                return
            if not lr_kwargs:
                raise TypeError(f"{type(self.lr_scheduler).__name__}.step{signature} needs arguments that engine.step() "
                                f"does not give it ({e}): pass them as engine.step(lr_kwargs={{...}}); nothing was "
                                f"updated") from None
            raise TypeError(f"engine.step(lr_kwargs={lr_kwargs!r}): {type(self.lr_scheduler).__name__}.step"
                            f"{signature} does not take them ({e}); nothing was updated") from None

    def _steps_schedule_by_samples(self) -> bool:
        """Megatron's schedules step by the samples the step took (``step(increment)``), which DeepSpeed gives
        them (the global batch size) when engine.step() has no lr_kwargs: so does LazyTrain. A schedule needing
        any other argument is refused (DeepSpeed would pass it the batch size too, as a loss or a metric)."""
        try:
            required = [p for p in inspect.signature(self.lr_scheduler.step).parameters.values()
                        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):   # a builtin without a signature: stepped as it is
            return False
        return [p.name for p in required] == ["increment"]

    def _leaves_plateau_to_the_script(self, lr_kwargs: dict | None) -> bool:
        """ReduceLROnPlateau steps on a metric the engine does not have: ``engine.step()`` without
        ``lr_kwargs`` leaves it to the script, which steps it with its validation metric (HF Trainer does so
        at each evaluation, and calls ``engine.step()`` with no way to pass lr_kwargs). DeepSpeed steps it every
        step with the batch size as the metric, cutting the rate every patience + 1 steps whatever the loss."""
        if lr_kwargs or not isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return False
        if not self._told_plateau and self.global_rank == 0:
            self._told_plateau = True
            warnings.warn("lazytrain: engine.step() does not step ReduceLROnPlateau, which needs a metric: step it "
                          "with your validation metric (HF Trainer does at each evaluation), or pass "
                          "engine.step(lr_kwargs={'metrics': ...})", UserWarning, stacklevel=4)
        return True

    def _raise_unstored_copies(self) -> None:
        """After a step that completed but could not store some compute copies (every counter advanced)."""
        if self._unstored_copies is None:
            return
        first, e = self._unstored_copies
        self._unstored_copies = None
        raise StepFailedError(self._unstored_copies_message(self.global_steps, first, e)) from e

    def _inconsistent(self, reason: str, error: Exception, lost: str) -> StepFailedError:
        """From now until a checkpoint is loaded, training and saving are refused, naming ``reason``."""
        self._failed_step = f"{reason} ({type(error).__name__}: {error})"
        return StepFailedError(f"{self._failed_step}: {lost}. The engine refuses to train or save until a "
                               f"checkpoint is loaded (engine.load_checkpoint)")

    def _fail_inconsistent(self, reason: str, error: BaseException, lost: str):
        """Marks the engine inconsistent (see _inconsistent) and raises: an Exception as a StepFailedError, a
        KeyboardInterrupt or SystemExit as it is (Ctrl-C stops the script; the mark stays for a later call)."""
        failed = self._inconsistent(reason, error, lost)
        if isinstance(error, Exception):
            raise failed from error
        raise error

    def _refuse_if_inconsistent(self, what: str, error=None) -> None:
        self._refuse_if_destroyed(what)
        if self._failed_step is not None:
            raise (error or StepFailedError)(
                f"{what} refused: {self._failed_step}, and the engine holds a mix of updated and not-updated "
                f"state; load a checkpoint (engine.load_checkpoint) first")

    def _before_pass(self, training: bool) -> str | None:
        """The executor's, as a pass begins at the first block: the model checked (:meth:`_check_model_unchanged`),
        and the compute copies of layers a script wrote in place since made anew, so that the forward computes with
        what the parameters show, as PyTorch's would (a write to a block parameter reaches its fp32 weights, which
        the streamed compute copy in bf16/fp16, or a device's copy, is written from only by a step or a load).
        A training pass of the model called itself that records router logits is refused, as the engine's forward
        refuses one asked for them. Returns why a backward through a training pass will be refused, or None
        (:meth:`_backward_refused_for_frozen`)."""
        if inside_a_block():   # a forward run from inside a block: its parameters are its streamed weights now
            return None
        self._check_model_unchanged(training)
        if training and _router_logits_recorded():   # asked by whatever: the model's own call, a wrapper's keyword
            _refuse_router_aux_loss(self.module, {"output_router_logits": True})   # a composite model's text_config
        self._copy_layers_written_in_place()
        return self._backward_refused_for_frozen() if training else None

    @contextlib.contextmanager
    def _running_the_model(self):
        """The engine's forward running the model, which it checked as it began (:meth:`_check_model_unchanged`)."""
        self._within_forward += 1
        try:
            yield
        finally:
            self._within_forward -= 1

    def _copy_layers_written_in_place(self) -> None:
        """The compute copies of the layers whose parameters a script wrote in place since they were written:
        as a pass begins, and as a step begins (its update may write only the copies of what it updates)."""
        if self.weights.written_in_place():
            self.wait_for_update()   # no layer update writes a copy meanwhile (they share a staging buffer)
            written = self.weights.written_in_place()
            if written:
                self._refresh_streamed_layers(written)

    def _check_model_unchanged(self, training: bool) -> None:
        """Before a pass (the engine's forward, or the first block's call through the model itself): refused where
        the model no longer holds the parameters set-up found as they were (layout_guard.py). Not for a forward
        run from inside a block, whose parameters are swapped for its streamed weights meanwhile, nor within the
        engine's forward, which checked as it began (a training pass is verified once)."""
        guard = self.__dict__.get("_layout_guard")
        if guard is not None and not inside_a_block() and not self.__dict__.get("_within_forward"):
            guard.check(training)
            self.executor.check_routing()

    def _refuse_if_destroyed(self, what: str) -> None:
        """A destroyed engine's model is the script's again (a new engine may train it): a stale engine's step
        updated it, and with the overlapped update failed half-way."""
        if self.__dict__.get("_superseded"):
            live = module_copy.engine_of(self.module)
            now = ("no engine holds that model now: build one with lazytrain.initialize" if live is None else
                   "another engine took it over: use that one (lazytrain.engine_of(model) returns it)"
                   if live.module is self.module else
                   "another engine holds a model that shares modules with it: use that one (lazytrain.engine_of"
                   "(model) returns it)")
            raise RuntimeError(f"{what} refused: this engine had no optimizer and was handed back when another "
                               f"engine was to be built on its model; {now}")
        if self.__dict__.get("_destroyed"):
            where = self.__dict__.get("_destroyed_from")
            raise RuntimeError(f"{what} refused: this engine was destroyed (destroy() handed the model back"
                               f"{f', called from {where}' if where else ''}); build a new one with "
                               f"lazytrain.initialize")

    def _warn_beyond_plan(self, ids, stacklevel: int = 3) -> None:
        """A batch longer than the plan's sequence length runs, but the plan's memory (boundaries, kept outputs
        on the device) was counted for shorter ones: said once, before a device budget overruns mid-step."""
        if int(ids.shape[-1]) > self.plan.seq_len:
            self._warned_beyond_plan = True
            again = ("set 'lazytrain.seq_len' to the longest length trained: policy \"auto\" plans for the longest "
                     "batch seen while it measures" if self.auto is not None and self._config.lazytrain.seq_len is None
                     else "plan again at the longest length trained")
            warnings.warn(f"lazytrain: the plan ({self.plan.policy}) was made for sequence length "
                          f"{self.plan.seq_len}, and this batch's is {int(ids.shape[-1])}: it runs, but the plan's "
                          f"memory and time predictions do not hold ({again})", UserWarning, stacklevel=stacklevel)

    def _note_batch_for_auto(self, ids) -> None:
        """Policy auto measures and plans for micro-batch x sequence-length tokens: the longest sequence seen
        (batches padded to their own length), or 'lazytrain.seq_len'. A batch of more tokens was measured and
        run as if it held fewer without a word (the profile records the config's shape): it is said once,
        naming what to change (a batch of concatenated pairs, as TRL's DPO makes, comes in every step)."""
        n = int(ids.shape[-1])
        unset = self._config.lazytrain.seq_len is None
        if unset and self._profile_seq_len is not None and n > self._profile_seq_len:
            raise ConfigError(f"config 'lazytrain.auto.profile' was measured at sequence length "
                              f"{self._profile_seq_len}, and this batch's is {n}: measure again (leave "
                              f"'profile' out), or train at most at the profile's length")
        planned = None if self.auto.measuring else self.plan.seq_len   # the length the plan in place was made for
        fitted = self._selective_sized_for if self.auto.measuring and self.plan.selective_layers else None
        if fitted is not None and n > fitted:   # its layers' kept outputs were fitted to the device for shorter ones
            self._selective_sized_for = None     # said once per selective calibration
            warnings.warn(f"lazytrain: policy \"auto\" measures selective layers {list(self.plan.selective_layers)} "
                          f"with their outputs kept on the device, as many as it had room for at sequence length "
                          f"{fitted}, and this batch's is {n}: this step may overrun the device's memory; set "
                          f"'lazytrain.seq_len' to the longest length trained, so that auto measures for it",
                          UserWarning, stacklevel=4)
        if planned is not None and n > planned and not self._warned_beyond_plan:
            self._warn_beyond_plan(ids, stacklevel=4)   # its memory was counted for shorter batches: said once
        if unset:
            self._seq_len = max(self._seq_len or 0, n)
        micro = self.train_micro_batch_size_per_gpu()
        if ids.numel() > micro * self._seq_len and not self._warned_beyond_plan:
            self._warned_beyond_plan = True   # once: concatenated pairs (TRL's DPO) come in every step
            declared = "'lazytrain.seq_len'" if self._config.lazytrain.seq_len is not None else "the longest seen"
            warnings.warn(f"lazytrain: policy \"auto\" measures and plans for micro-batches of {micro} x "
                          f"{self._seq_len} tokens ('train_micro_batch_size_per_gpu' x {declared}), and this batch "
                          f"of shape {tuple(ids.shape)} holds {ids.numel()} (concatenated pairs, or more samples than "
                          f"the micro-batch?): it trains, but what is measured and planned is not this batch's time "
                          f"and memory; set the micro-batch size (and 'lazytrain.seq_len') to what a forward is "
                          f"passed", UserWarning, stacklevel=4)

    def trace_next_step(self, path: str | None = None) -> None:
        """Record the next training step, from its first forward to the end of the layer updates its
        ``step()`` starts: each layer's compute, each transfer (link, bytes, start and end), every wait of
        the compute side and what it waited for, and each layer's update. The result is
        ``engine.last_trace`` (a :class:`lazytrain.trace.Timeline`, with ``summary()``), written as a
        Chrome/Perfetto trace JSON at ``path`` when given (checked now, before any training time is spent).
        On CUDA, copies, the blocks' compute and the compute side's waits are timed by stream events."""
        if path is not None:
            check_writable(path)
        if self._trace_path is not None:   # a traced step began and has not reached its step()
            streams.stop_recording()
            warnings.warn(f"lazytrain: the step traced for {self._trace_path or 'engine.last_trace'} did not "
                          f"complete (it raised before step(), or trace_next_step() was called again during it); "
                          f"its partial trace is dropped, and the next step is traced whole", UserWarning,
                          stacklevel=2)
            self._trace_path = None
        self._trace_request = path if path is not None else ""

    def _finish_trace(self) -> None:
        self.wait_for_update()   # the step's layer updates belong to it
        timeline = streams.stop_recording()
        if timeline is None:
            return
        self.last_trace = timeline.finish()
        self._traced_step = self.global_steps + 1   # the step being completed (counted right after)
        path, self._trace_path = self._trace_path, None
        if path:
            try:   # the step itself is done: a trace that cannot be written must not undo its accounting
                write_chrome_trace(path, self.last_trace)
            except OSError as e:
                warnings.warn(f"lazytrain: the trace of step {self._traced_step} could not be written to {path} "
                              f"({e}); it is in engine.last_trace", UserWarning, stacklevel=3)

    def wait_for_update(self) -> None:
        """Block until the update that ``engine.step()`` started on the streamed layers is done. Only
        needed with ``lazytrain.overlap_optimizer`` on, and only before reading or writing block parameters
        directly (``model.layers[0].weight``): the engine, the module's ``state_dict()`` and the optimizer's
        methods wait by themselves, and the next forward waits layer by layer."""
        if self.layer_updates is not None:
            self.layer_updates.wait_all()

    def _all_grads(self) -> list[torch.Tensor]:
        """Every gradient the optimizer will read: one flat fp32 host buffer per layer, plus the
        non-block grads (their fp32 masters' in mixed precision)."""
        grads = [g for g in self.weights.grad if g is not None]
        if self.masters is not None:
            grads += self.masters.master_grads()
        else:
            grads += [p.grad for p in self.non_block_params if p.grad is not None]
        grads += [p.grad for p in self._extra_params() if p.grad is not None]
        return grads

    def _failed_before_update(self, e: BaseException) -> str:
        return (f"step {self.global_steps + 1} failed before the optimizer changed anything ({type(e).__name__}: "
                f"{e}): no weight, optimizer state, counter or schedule moved. The gradient buffers keep what "
                f"reached the host; a gradient whose copy failed is missing from them: call zero_grad() and redo "
                f"the step's micro-batches, or fix the cause and call step() again if none was lost")

    def _take_model_step(self, lr_kwargs) -> None:
        if self.basic_optimizer is None:
            raise ConfigError("engine.step() needs an optimizer: add an 'optimizer' section to the config or pass "
                              "optimizer= to lazytrain.initialize")
        self.wait_for_update()
        self._copy_layers_written_in_place()   # written since the backward: a fused update copies what it updates
        if self.shards is not None:
            self._refuse_added_block_params()
        local_failure = None
        scale_set = None
        try:   # this rank's own part: no collective yet
            # a scale set on the optimizer since the step's first backward: this step's gradients are unscaled by
            # the one its backwards took, the scaler goes on from the set one (as DeepSpeed's, set at once)
            scale_set = self._loss_scale_set()
            check_groups = getattr(self.basic_optimizer, "check_groups", None)
            if check_groups is not None:   # settings the update would refuse halfway through, refused here
                check_groups()
            if self.executor.backward_failure is not None:
                raise RuntimeError(f"a backward through the streamed layers failed ({self.executor.backward_failure}) "
                                   f"after some layers had sent their gradients: the accumulation holds part of it")
            with streams.wait_span("gradients to host", self.device):
                self.weights.flush_grads()
                if self.masters is not None:
                    self.masters.flush_grads()
            self.weights.attach_grads()
        except CollectiveError:
            raise   # a collective of the gradient path failed: the ranks' group is gone, no agreement can run
        except Exception as e:   # noqa: BLE001 - every rank hears of it before any rank enters a collective
            local_failure = e
        if local_failure is None and self.world_size == 1 and not self.backward_since_zeroed():
            # DeepSpeed fails here too (an IndexError). One process only: over several ranks a rank may hold no
            # gradient after a backward (at stage 3 the owner's alone), and telling that apart needs a collective
            raise RuntimeError("engine.step() at an accumulation boundary, with no backward since the gradients "
                               "were last zeroed: the optimizer would move every weight by its momentum and weight "
                               "decay alone, so nothing was stepped. Call engine.backward(loss) before engine.step()")
        # a rank that failed alone would leave the others waiting in the step's collectives until the timeout,
        # or pair its redone micro-batches' collectives with theirs: every rank fails the step together; and
        # gradients reduced as they landed were summed with the same layer's on every rank
        to_owners = self.weights.reduced_as_landed
        ok, alike = self.dist.all_succeeded_alike(
            local_failure is None, to_owners.sequence if to_owners is not None else 0,
            "agreement that every rank's gradients reached its host in engine.step()")
        if not ok:
            cause = local_failure if local_failure is not None else \
                RuntimeError("another rank's gradients did not all reach its host; its own error says why")
            raise StepFailedError(self._failed_before_update(cause)) from local_failure
        if not alike:   # step() keeps the accumulation unusable: zero_grad() drops it
            raise StepFailedError(self._failed_before_update(RuntimeError(
                "the ranks' backwards reduced different streamed layers (or in another order) since the gradients "
                "were zeroed: at zero_optimization.stage >= 2 each layer's gradient is summed on its owner as it "
                "lands, pairing the ranks' reduces by order, so some owners summed one layer's gradient into "
                "another's. Every rank must run the same trainable layers in each backward; a model that skips "
                "layers on some ranks needs stage 1")))
        try:
            self._zero_grads_of_unreached_params()
            # tensors the script added: a zero gradient only where another rank has one (the same reduces)
            self.dist.fill_missing_grads(self._extra_params())
            grads = self._all_grads()
            # fp16: the norm of the scaled grads, unscaled; the unscale is folded into the clip factor below
            # so that the gradients are rescaled in one pass (or inside the fused optimizer update)
            inv_scale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None and self._scaled_backward \
                else 1.0
            if self.shards is not None:
                norm = self._reduce_to_owners() * inv_scale
            else:
                self.dist.average([g for g in grads if g.device.type == "cpu"],
                                  [g for g in grads if g.device.type != "cpu"])
                with streams.span("optimizer", "gradient norm"):   # the step's serial host phase begins
                    norm = math.sqrt(self._square_sum(grads)) * inv_scale
        except CollectiveError:
            raise   # names the collective; the run cannot go on with a rank missing
        except Exception as e:
            raise StepFailedError(self._failed_before_update(e)) from e
        if scale_set is not None:
            self._take_loss_scale(scale_set)
        finite = math.isfinite(norm)
        # an fp16 overflow reports an infinite norm, as DeepSpeed's optimizers do (the sum may be nan)
        # (and, from stage 1, any non-finite norm: DeepSpeed's ZeRO optimizers report inf, not nan)
        self._global_grad_norm = norm if finite or (self.loss_scaler is None and self._config.zero_stage < 1) \
            else math.inf
        if not finite:
            self._step_applied = False
            self.skipped_steps += 1
            if self.loss_scaler is not None:
                old = self.loss_scaler.scale
                try:
                    self.loss_scaler.update(overflow=True)
                except LossScaleAtMinimumError:
                    self._drop_grads()   # the step is skipped, as every overflow's, before the run is stopped
                    self._scaled_backward = False
                    raise
                if self.global_rank == 0:
                    print(f"[lazytrain] fp16 overflow at step {self.global_steps}: skipped, loss scale "
                          f"{old:g} -> {self.loss_scaler.scale:g}")
            else:
                warnings.warn(f"lazytrain: non-finite gradient norm ({norm}) at step {self.global_steps}: the "
                              f"optimizer step was skipped")
        else:
            clip = self.gradient_clipping()
            factor = (min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0) * inv_scale
            t0 = time.perf_counter()
            self._unstored_copies = None
            if self.weights.any_trainable:   # a forward taken before this step can no longer be differentiated
                self.executor.weights_changed()
            try:
                if self.layer_updates is not None:
                    self._update_overlapped(factor)
                else:
                    self._update_serial(factor, grads)
                if self.masters is not None and not self._masters_on_owners():   # else written and sent already
                    with streams.device_span("optimizer", "embedding/head", self.device):   # CUDA: its kernels
                        self.masters.masters_to_params()
                self._count_non_block_writes()
            except BaseException as e:   # a KeyboardInterrupt too: it leaves the same half-updated state
                self._fail_inconsistent(
                    f"step {self.global_steps + 1} failed during the optimizer update", e,
                    "some weights and optimizer states hold the update and some do not, and the step counter, "
                    "the learning-rate schedule and the gradients did not advance")
            self.last_optimizer_seconds = time.perf_counter() - t0
            if self.loss_scaler is not None:
                self.loss_scaler.update(overflow=False)
            self._step_applied = True
            if self.lr_scheduler is not None and not self._leaves_plateau_to_the_script(lr_kwargs):
                try:
                    if not lr_kwargs and self._steps_schedule_by_samples():
                        self.lr_scheduler.step(self.train_batch_size())
                    else:
                        self.lr_scheduler.step(**(lr_kwargs or {}))
                except BaseException as e:
                    self._fail_inconsistent(
                        f"step {self.global_steps + 1} updated the weights, then advancing the learning-rate "
                        f"schedule failed", e, "the step counter and the gradients did not advance")
        if self.partitioned is not None:
            self.partitioned.after_step()   # the owners' weights changed: the copies held for forwards are old
        if self.layer_updates is not None and self._step_applied:
            self._zero_non_block_grads()   # the update thread zeroes each layer's gradients after its update
        else:
            self._drop_grads()
        self._scaled_backward = False
        if self.basic_optimizer is not None and self._sets_overflow:
            self.basic_optimizer.overflow = not self._step_applied
        self._show_loss_scale()
        if self._trace_path is not None:
            self._finish_trace()
        self.global_steps += 1
        if self._managed:
            self.global_samples += self.train_batch_size()
        else:   # the micro-batches this step took (DeepSpeed counts engine.backward calls)
            per_micro_batch = self.train_micro_batch_size_per_gpu() * self.world_size
            self.global_samples += per_micro_batch * self._unmanaged_backwards
            self._unmanaged_backwards = 0
        self._record_peaks()
        every = self.steps_per_print()
        if self.global_rank == 0 and every is not None and self.global_steps % every == 0:
            self._print_progress()

    def _show_loss_scale(self) -> None:
        if self._shown_scale is None:
            return
        if self.loss_scaler is not None:
            self._shown_scale = self.loss_scaler.scale
        self.basic_optimizer.loss_scale = self.basic_optimizer.cur_scale = self._shown_scale

    def _adopt_loss_scale_set(self) -> None:
        """A script's ``optimizer.loss_scale = x`` (or ``cur_scale``) sets the scale, as DeepSpeed's setters do;
        read at a step's first backward, so every micro-batch of a step has one scale (one set later in the step
        is taken at its ``step()``). Both names say it from then on, as DeepSpeed's one property; outside fp16
        the update is the same whatever it is (DeepSpeed scales the loss and unscales the gradients by it)."""
        value = self._loss_scale_set()
        if value is not None:
            self._take_loss_scale(value)
        self._show_loss_scale()

    def _loss_scale_set(self) -> float | None:
        """The scale a script set on the optimizer since the engine last showed it there (None: none); a value
        that is no loss scale is refused in fp16, where it would scale the loss."""
        if self._shown_scale is None:
            return None
        for name in ("cur_scale", "loss_scale"):
            value = getattr(self.basic_optimizer, name, self._shown_scale)
            if value != self._shown_scale:
                if self.loss_scaler is not None and \
                        not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"optimizer.{name} was set to {value!r}: a loss scale is a finite number > 0")
                return value
        return None

    def _take_loss_scale(self, value) -> None:
        if self.loss_scaler is None:
            self._shown_scale = value
        else:
            self.loss_scaler.scale = float(value)

    def _step_optimizer(self, **kwargs) -> None:
        """The optimizer's step, as the engine takes it (_step_from_the_engine_only lets it through)."""
        self._optimizer_stepping = True
        try:
            self.basic_optimizer.step(**kwargs)
        finally:
            self._optimizer_stepping = False

    def _update_serial(self, factor: float, grads: list[torch.Tensor]) -> None:
        """The whole update now, then every streamed layer's compute copy refreshed."""
        with self._host_writes(range(self.weights.num_layers)), streams.span("optimizer", "update all"):
            failure = RankFailure(self.dist)
            with failure.kept():
                if self._fused_clip:   # the hybrid optimizer applies the factor inside its update pass
                    self._step_optimizer(clip_coef=factor)
                else:
                    if factor != 1.0:
                        _scale_(grads, factor)
                    self._step_optimizer()
            w = self.weights
            if w.masters_sharded and not failure.failed:   # what the owners send is their compute copies
                with failure.kept():
                    for i in self._layers_with_grads():
                        if w.master[i] is not None:
                            w.refresh_compute_copy(i, host_copy_current=self._fused_copies)
            if not failure.failed:
                with failure.kept():
                    self._owners_write_non_block_copies()
            if self.shards is not None:   # every rank takes part in every broadcast, then all fail together
                self._share_updated(self._layers_with_grads(), non_block=True)
            # replicated ranks too: one that went on alone would train on other weights than the rest
            failure.agree("agreement that every rank's optimizer update succeeded, in engine.step()",
                          RuntimeError("the optimizer update failed on another rank: see its error"))
            # with the masters sharded the copies are written already (owners above, broadcasts for the rest)
            unstored: list = []
            for i in (range(w.num_layers) if not w.masters_sharded else ()):
                self._store_copy_after_update(i, self._fused_copies and self._updates_here(i), unstored)
            self._unstored_copies = unstored[0] if unstored else None

    def _store_copy_after_update(self, i: int, host_copy_current: bool, unstored: list) -> None:
        """Layer i's compute copy rewritten after its update. One that cannot be stored (a full disk under the
        NVMe weights) is left to be written again from the fp32 weights before its next use, and the first
        failure of the step is kept in ``unstored`` as (layer, error): the update itself is whole, so the step
        is not failed for it. After a failure the later layers' copies are not tried (each try of the NVMe
        tier frees the old file first): they are written again the same way."""
        if not unstored:
            try:
                self.weights.refresh_compute_copy(i, host_copy_current=host_copy_current)
                return
            except Exception as e:   # noqa: BLE001 - kept for the step's report
                unstored.append((i, e))
        self.weights.mark_unstored([i])

    def _unstored_copies_message(self, step: int, first: int, error: BaseException) -> str:
        return (f"step {step} completed (weights, optimizer states, counters, schedule and gradients all "
                f"advanced), but the compute copies of layers {first}..{self.weights.num_layers - 1} could not be "
                f"stored ({type(error).__name__}: {error}); each is written again from the fp32 weights before its "
                f"next use, and a forward that still cannot store it raises")

    @contextlib.contextmanager
    def _host_writes(self, layers, launch_event=None):
        """Around a write of the streamed layers' host weights: no copy still reads them when it starts
        (the weight stream's fence), and their device copies follow once it is done."""
        layers = list(layers)
        if launch_event is None:   # kernels queued so far may read resident copies
            launch_event = self._compute_stream_point()
        self.stream.before_host_write(layers)
        try:
            yield
        finally:   # a write cut short may have changed them too: their device copies are stale either way
            for i in layers:
                self.stream.after_host_write(i, launch_event)

    def _compute_stream_point(self):
        """A CUDA event after the work queued so far on the compute stream (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _refresh_streamed_layers(self, layers=None) -> None:
        """After the masters were written from outside an optimizer step (a checkpoint load): the compute
        copies of ``layers`` (default: every layer) rewritten from them."""
        layers = range(self.weights.num_layers) if layers is None else sorted(layers)
        self.executor.weights_changed()
        with self._host_writes(layers):
            self.weights.copy_shared_frozen()
            for i in layers:
                self.weights.refresh_compute_copy(i)

    def _count_non_block_writes(self) -> None:
        """The step wrote the trainable parameters outside the streamed layers in place, partly past autograd's
        version counter (the host optimizer's kernels, a broadcast from their owner, a master that is its own
        parameter): counted here, on every rank, as PyTorch's own in-place steps count them, so that a forward
        from before the step is refused at its backward everywhere, as a streamed block's is, instead of
        differentiating the new weights."""
        for p in [*self.non_block_params, *self._extra_params()]:
            if p.requires_grad:
                torch.autograd.graph.increment_version(p)

    def _update_overlapped(self, factor: float) -> None:
        """Everything but the streamed layers now (through ``optimizer.step``, so its hooks run once, here);
        the streamed layers on the update thread, in forward order, with this step's groups and
        hyperparameters (the scheduler advances before they are done) and their gradient buffers passed
        explicitly: block ``.grad`` stays unset until a layer is done, so a ``zero_grad`` meanwhile, on
        the optimizer or the module, cannot drop or zero a pending update."""
        w = self.weights
        groups = self.basic_optimizer.snapshot()
        block_ids = {id(p) for params in w.params for p in params}
        rest = [p for g in groups for p in g["params"] if id(p) not in block_ids]
        failure = RankFailure(self.dist)
        with streams.device_span("optimizer", "embedding/head", self.device):   # CUDA: its kernels
            # its own step post-hooks held back until the layers are updated too, as torch defines them: after the
            # update (an EMA or a logger read the layers' weights of the step before)
            post_hooks = getattr(self.basic_optimizer, "_optimizer_step_post_hooks", None)
            holding = isinstance(post_hooks, PostHookTable)
            with failure.kept():
                if holding:
                    post_hooks.held = True
                try:
                    self._step_optimizer(params=rest, clip_coef=factor)
                finally:
                    if holding:
                        post_hooks.held = False
                # with what its pre-hooks set, as serial steps take it (a subclass whose step() skips HybridAdamW's
                # leaves none: the groups as they were)
                groups = getattr(self.basic_optimizer, "groups_of_last_step", None) or groups
            if not failure.failed:
                with failure.kept():
                    self._owners_write_non_block_copies()
            if self.shards is not None:
                self._share_updated(non_block=True)
        failure.agree("agreement that every rank's update of the parameters outside the streamed layers succeeded, "
                      "in engine.step()",   # before any layer's update starts
                      RuntimeError("the optimizer update failed on another rank: see its error"))
        layer_grads = [w.grad_views(i) for i in range(w.num_layers)]
        for grads in layer_grads:
            for p in grads:
                p.grad = None

        launched = self._compute_stream_point()   # queued kernels may still read resident device copies

        unstored: list = []   # the step's first copy that could not be stored: (layer, error)
        if self.shards is not None:
            update_layer = self._sharded_layer_updates(layer_grads, groups, factor, launched, unstored)
        else:
            failure = RankFailure(self.dist, on_update_thread=True)

            def update_layer(i: int) -> None:
                cleared = False   # the update cleared the layer's whole gradient buffer as it read it
                with failure.kept():
                    if layer_grads[i]:
                        with self._host_writes([i], launched):
                            self.basic_optimizer.update(list(layer_grads[i]), clip_coef=factor, groups=groups,
                                                  grads=layer_grads[i], zero_grads=True)
                            cleared = True   # grad_views cover the buffer: every element is in one of them
                            self._store_copy_after_update(i, self._fused_copies, unstored)
                    w.zero_layer_grads(i, cleared=cleared)
                # replicated ranks: after the last layer they agree whether every update succeeded, so that all
                # fail together and none trains on alone with other weights than the rest
                if i == w.num_layers - 1:
                    failure.agree("agreement that every rank's layer updates succeeded",
                                  RuntimeError("a layer update failed on another rank: see its error"))
        step = self.global_steps + 1

        def update_and_report(i: int) -> None:
            update_layer(i)
            if i == w.num_layers - 1 and unstored:   # once the ranks agreed; step() has returned: a warning
                self.layer_updates.note("lazytrain: " + self._unstored_copies_message(step, *unstored[0]))
        self.layer_updates.launch(update_and_report, range(w.num_layers))
        if holding and len(post_hooks):   # (the ranks agreed the update began); a step with hooks waits for it
            self.wait_for_update()
            self.basic_optimizer.run_held_post_hooks()

    def _sharded_layer_updates(self, layer_grads: list[dict], groups: list[dict], factor: float, launched,
                               unstored: list):
        """The update thread's work when the optimizer state is sharded: ``update_layer(i)`` for i in order.

        Each call first runs ahead: for the next layers up to ``world_size`` past i it opens the host-write
        fence, updates the ones this rank owns and starts every layer's broadcast from its owner, in layer
        order on every rank. So a rank updates its next layer while it waits for another rank's, and the
        ranks' updates run side by side. Then it waits for layer i's broadcast, refreshes its compute copy
        and closes the fence; the layer counts as done when the call returns. A failure on this rank is kept
        while the broadcasts go on (every rank must make them all), and after the last layer the ranks agree
        whether every update succeeded: all fail together, or none does."""
        w, shards = self.weights, self.shards
        layers = self._layers_with_grads()   # the same on every rank (layer_grads holds the owned ones only)
        position = {layer: n for n, layer in enumerate(layers)}
        started: dict[int, object] = {}      # layer -> the wait for its broadcast
        issued = [0]                         # how many of ``layers`` were started
        failure = RankFailure(self.dist, on_update_thread=True)

        def start(k: int) -> None:
            self.stream.before_host_write([k])
            with failure.kept():   # the broadcasts go on; the ranks fail together after the last layer
                if shards.owns_layer(k) and not failure.failed:
                    self.basic_optimizer.update(list(layer_grads[k]), clip_coef=factor, groups=groups,
                                                grads=layer_grads[k])
                    if w.masters_sharded:   # what it sends is its compute copy
                        w.refresh_compute_copy(k, host_copy_current=self._fused_copies)
            started[k] = self.dist.broadcast_started(self._published(k), shards.layer_owner[k])

        def update_layer(i: int) -> None:
            if i in position:
                try:
                    last = min(position[i] + self.world_size, len(layers) - 1)
                    while issued[0] <= last:
                        start(layers[issued[0]])
                        issued[0] += 1
                    started.pop(i)()
                except BaseException:
                    # a broadcast failed (CollectiveError): the ones started ahead may still write into their
                    # layers' masters, which count as done once this raises; wait for them before that
                    for finish in started.values():
                        try:
                            finish()
                        except Exception:   # noqa: BLE001 - the first failure is the one raised
                            pass
                    started.clear()
                    raise
                with failure.kept():
                    if not w.masters_sharded:   # else the broadcast wrote the copy (or its owner did)
                        self._store_copy_after_update(i, self._fused_copies and shards.owns_layer(i), unstored)
                self.stream.after_host_write(i, launched)
            w.zero_layer_grads(i)
            if i == w.num_layers - 1:
                failure.agree("agreement that every rank's layer updates succeeded",
                              RuntimeError("a layer update failed on another rank: see its error"))
        return update_layer

    def _record_peaks(self) -> None:
        self.last_step_peak_bytes = {name: tier.peak_bytes for name, tier in self.tiers.items()}
        if self.device.type == "cuda":
            self.last_step_peak_bytes["cuda_allocated"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        for tier in self.tiers.values():
            tier.reset_peak()

    def _print_progress(self) -> None:
        now = time.perf_counter()
        began, steps_before = self._progress_window or (now, self.global_steps)
        dt = (now - began) / max(self.global_steps - steps_before, 1)
        self._progress_window = (now, self.global_steps)
        peaks = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.last_step_peak_bytes.items())
        print(f"[lazytrain] step {self.global_steps}: lr {self.get_lr()}, grad norm {self._global_grad_norm:.4g}, "
              f"{dt * 1000:.0f} ms/step, peak {peaks}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's ``engine.zero_grad()``: at ZeRO stages 0 and 1 the gradients accumulated for the step are
        dropped; at stage 2 and above they are kept, as DeepSpeed's partitioned gradients are (its call clears
        only the parameters' ``.grad``): a loop calling ``engine.step(); engine.zero_grad()`` every micro-batch
        accumulates every micro-batch there (a tensor the optimizer updates that the engine does not accumulate,
        a loss's learnable temperature, is cleared as torch clears it). After a step that failed before its
        update (a failed gradient copy, on this rank or another) the accumulated gradients are dropped at every
        stage: they are unusable, and the error asks for this call before the micro-batches are redone. At stage
        2 and above a copy that failed before the step is kept until the step reports it, so that no step goes
        through on part of the accumulation."""
        if self._config.zero_stage >= 2 and not self._grads_unusable:
            # kept, a failed copy too: the step refuses the accumulation (StepFailedError), and then this
            # call drops it, so no step goes through on part of it
            _zero_grad_as_zero_optimizers(self)(set_to_none)
            return
        failed_step = self._grads_unusable
        self._drop_grads()
        if failed_step and self._managed:
            # the step's micro-batches are redone from its first: its count starts again there (left at the
            # failed boundary, the redo's first micro-batch was a boundary, and every later step one behind)
            self.micro_steps = self._step_starts_at
            self.dist.calls.at_micro_step(self.micro_steps)
        elif failed_step:   # unmanaged: the redone backwards are the step's samples, not counted twice
            self._unmanaged_backwards = 0

    def _drop_grads(self) -> None:
        """The gradients accumulated for the step, dropped."""
        self._grads_unusable = False
        self.executor.backward_failure = None   # a backward that failed left nothing behind now
        self.weights.flush_grads(discard=True)   # adds in flight must not land after the zeroing
        updates = self.layer_updates
        for i in range(self.weights.num_layers):
            # a pending layer's update zeroes its gradients before its flag is set, so it needs no wait;
            # a done one is zeroed here, a backward that landed after its update included
            if updates is None or not updates.pending(i):
                self.weights.zero_layer_grads(i)
        self._zero_non_block_grads()

    def _reduce_to_owners(self) -> float:
        """Sharded state: each tensor's gradient summed (averaged) into its owner's buffer, the
        norm from the owners' squares summed over the ranks. A tensor no rank owns (a group added after
        initialize) is averaged on every rank, as without sharding, and counted once."""
        shards, w = self.shards, self.weights
        owned = []
        for i in self._layers_with_grads():
            if not w.grads_to_owners:   # stage 1: every rank holds every layer's gradients; at stage >= 2
                self.dist.reduce_to([w.grad[i]], shards.layer_owner[i])   # they reached the owners as they landed
            if shards.owns_layer(i):
                owned.append(w.grad[i])
        replicated = []
        for t in self._non_block_grad_holders():
            if t.grad is None:
                continue
            if self._partitioned(t):   # reduced to its owner in the backward: only the owner has a gradient
                owned.append(t.grad)
                continue
            owner = shards.param_owner.get(id(t))
            if owner is None:
                replicated.append(t.grad)
                continue
            self.dist.reduce_to([t.grad], owner)
            if owner == self.global_rank:
                owned.append(t.grad)
        self.dist.average([g for g in replicated if g.device.type == "cpu"],
                          [g for g in replicated if g.device.type != "cpu"])
        with streams.span("optimizer", "gradient norm"):
            local = self._square_sum(owned)
            mine = local + (_global_square_sum(replicated) if self.global_rank == 0 else 0.0)
            return math.sqrt(self.dist.sum_over_ranks(mine))

    def _square_sum(self, grads: list[torch.Tensor]) -> float:
        """The sum of the squares of ``grads``: a streamed layer's buffer's as taken when its last gradient
        landed (weights.py: no pass over the host gradients here), the others' read now."""
        layer_of = {id(g): i for i, g in enumerate(self.weights.grad) if g is not None}
        layers = [layer_of[id(g)] for g in grads if id(g) in layer_of]
        others = [g for g in grads if id(g) not in layer_of]
        return sum(self.weights.grad_square_sum(i) for i in layers) + _global_square_sum(others)

    def _share_updated(self, layers=(), non_block: bool = False) -> None:
        """Sharded state: the owners' updated weights to every rank (fp32, or the compute copies with the
        masters sharded; the update thread has its own, pipelined way: :meth:`_sharded_layer_updates`)."""
        shards = self.shards
        for i in layers:
            self.dist.broadcast_from([self._published(i)], shards.layer_owner[i])
        if non_block:
            # a master its owner alone holds: its compute copy (which the owner wrote from it) goes instead
            copy_of = {id(m): p for p, m in self.masters.pairs} if self._masters_on_owners() else {}
            for t in self._non_block_grad_holders():
                owner = shards.param_owner.get(id(t))
                if owner is not None and not self._partitioned(t):   # a partitioned one: fetched at its next use
                    self.dist.broadcast_from([copy_of.get(id(t), t).data], owner)

    def _owners_write_non_block_copies(self) -> None:
        """Stages 1-2 over several ranks: each owner writes the compute copies of the non-block masters it
        updated, which :meth:`_share_updated` then sends."""
        if self._masters_on_owners():   # (inside the update's own span)
            self.masters.masters_to_params()   # the masters this rank holds: those it owns, and any unowned

    def _partitioned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a non-block parameter or its master) is partitioned, values and all (stage 3): its
        gradient reaches its owner in the backward, and its copies are fetched for each use."""
        return self.partitioned is not None and not self.partitioned.masters_only and self.partitioned.partitioned(t)

    def _grad_kept_by_another_rank(self, t: torch.Tensor) -> bool:
        """Stage 3: a partitioned tensor's gradient is its owner's alone (partitioned_params.py)."""
        return self._partitioned(t) and self.partitioned.owner(t) != self.partitioned.rank

    def _masters_on_owners(self) -> bool:
        """Stages 1-2 over several ranks: the non-block fp32 masters live on their owners alone, which write
        their compute copies after the update and send them to every rank (:meth:`_share_updated`)."""
        return self.partitioned is not None and self.partitioned.masters_only

    def _whole(self):
        """Meanwhile every parameter and its fp32 master is whole on every rank (a collective where they are
        partitioned: stage 3, and stages 1-2 for the masters; else nothing to do)."""
        return self.partitioned.materialized() if self.partitioned is not None else contextlib.nullcontext()

    def _whole_copies(self):
        """Meanwhile every parameter's compute copy is whole on every rank (stage 3: a collective; below it
        they are whole already, the fp32 masters on their owners notwithstanding)."""
        return self._whole() if self._copies_gather() else contextlib.nullcontext()

    def _copies_gather(self) -> bool:
        """Whether :meth:`_whole_copies` is a collective every rank must make (stage 3 over several ranks)."""
        return self.partitioned is not None and not self._masters_on_owners()

    def _shapes_only(self):
        """Meanwhile every parameter has its shape on every rank, without the values of those other ranks
        own (stage 3: placeholders, no collective; else nothing to do)."""
        return self.partitioned.shaped() if self.partitioned is not None else contextlib.nullcontext()

    def _published(self, i: int) -> torch.Tensor:
        """What layer i's owner broadcasts after its update. When every rank is on one node and shares its
        copy of the weights, the owner has written them for all: a one-byte signal that they are written
        (the collective orders the owner's writes before the others' reads). Else the weights themselves."""
        if self._one_shared_node:
            return torch.zeros(1, dtype=torch.uint8)
        return self.weights.published(i)

    def _updates_here(self, i: int) -> bool:
        """This rank's optimizer updates streamed layer i (every layer, unless the state is sharded)."""
        return self.shards is None or self.shards.owns_layer(i)

    def _layers_with_grads(self) -> list[int]:
        return [i for i in range(self.weights.num_layers) if any(self.weights.trainable[i])]

    def _zero_grads_of_unreached_params(self) -> None:
        """A trainable model parameter outside the blocks that no rank's backward reached since the last step
        (a head or branch the loss did not use) gets a zero gradient, as DeepSpeed gives it (its flat gradient
        buffers, and at stage 0 its all-reduce, hold zeros for every parameter): the optimizer then applies its
        weight decay and momentum and counts the step, as it does for a block parameter the loss did not reach.
        Left without one, torch's optimizer skipped it, and its trajectory parted from DeepSpeed's. The same on
        every rank, so no collective decides it. Tensors the script added to the optimizer beside the model's keep
        plain PyTorch's rule, as at DeepSpeed's stage 0 (fill_missing_grads)."""
        # a parameter frozen since initialize() is left without one, as plain PyTorch leaves it (its fp32 master
        # still requires grad: a zero gradient moved it by its momentum)
        holders = [(p, p) for p in self.non_block_params] if self.masters is None else self.masters.pairs
        for p, t in holders:
            if not p.requires_grad or not t.requires_grad or t.grad is not None:
                continue
            if self._grad_kept_by_another_rank(t):
                continue
            t.grad = torch.zeros_like(t)

    def _non_block_grad_holders(self) -> list[torch.Tensor]:
        """The trainable tensors outside the blocks whose ``.grad`` the optimizer reads (fp32 masters in
        mixed precision), in the same order on every rank."""
        if self.masters is None:
            owners = self.non_block_params
        else:
            self.masters.flush_grads()   # their gradients all landed
            owners = self.masters.master_params()
        return [p for p in owners if p.requires_grad] + self._extra_params()

    def _block_grad_view(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s view in its layer's flat fp32 gradient buffer (what its ``.grad`` shows until an
        optimizer's ``zero_grad(set_to_none=True)`` detaches it), or None: not a trainable block parameter."""
        layer = self._layer_of_param.get(id(param))
        return None if layer is None else self.weights.grad_views(layer).get(param)

    def _module_param_name(self, param: torch.Tensor) -> str | None:
        """``param``'s name in the module (a tied weight's first), or None for a tensor that is not one of its
        parameters."""
        return next((name for name, p in self.module.named_parameters() if p is param), None)

    def _extra_params(self) -> list[torch.Tensor]:
        """Parameters the optimizer updates that the model does not own (a loss's learnable temperature),
        read from its groups as they are now (a group may be added during training)."""
        if self.basic_optimizer is None:
            return []
        groups = self.basic_optimizer.param_groups
        if self.shards is not None:   # the same list on every rank: the whole groups, then any added since
            groups = self._all_whole_groups()
        return [p for g in groups for p in g["params"] if id(p) not in self._model_param_ids]

    def note_grads_given(self) -> None:
        """A gradient was set outside a backward (``safe_set_full_grad``): the step may follow without one, and
        in fp16 the value is the scaled one, as a backward leaves it (the step divides by the scale)."""
        self._grads_given = True
        if self.loss_scaler is not None and not self._scaled_backward:
            self._adopt_loss_scale_set()   # the scale the step's backwards would take
            self._scaled_backward = True

    def backward_since_zeroed(self) -> bool:
        """Whether a backward ran since the step's gradients were last zeroed: ``engine.backward``, a plain
        ``loss.backward()`` through the streamed blocks, or one that reached a tensor outside them (or a gradient
        was set: ``safe_set_full_grad``). A trainable parameter it did not reach then has a zero gradient, as in
        DeepSpeed's flat buffers (the step gives it one: _zero_grads_of_unreached_params); before any, none, and
        ``step()`` is refused."""
        return self._grads_given or self.executor.backward_ran or \
            any(t.grad is not None for t in self._non_block_grad_holders())

    def _zero_non_block_grads(self) -> None:
        self._grads_given = self.executor.backward_ran = False   # every gradient is zeroed with these
        if self.weights.reduced_as_landed is not None:
            self.weights.reduced_as_landed.restart_sequence()
        if self.masters is not None:
            self.masters.zero_grad()
            self.frozen_non_block.zero_grad()
        else:
            for p in self.non_block_params:
                p.grad = None
        for p in self._extra_params():
            p.grad = None

    # ---- getters -------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.basic_optimizer.param_groups] if self.basic_optimizer is not None else []

    def get_global_grad_norm(self) -> float | torch.Tensor | None:
        """The last step's gradient norm (before clipping): a float, or, as DeepSpeed's ZeRO optimizers give it
        at stages 1 and above, a 0-dim tensor (scripts call ``.item()`` on it); after an fp16 overflow the
        float ``inf`` at every stage, as theirs give it."""
        norm = self._global_grad_norm
        if norm is None or self._config.zero_stage < 1 or math.isinf(norm):
            return norm
        return torch.tensor(norm, dtype=torch.float32)

    def was_step_applied(self) -> bool:
        return self._step_applied

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch by another number of micro-batches (the micro-batch stays)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1:
            raise ValueError(f"train_batch_size must be a whole number >= 1, got {train_batch_size!r}")
        if train_batch_size % per_step:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism")   # DeepSpeed's
        before = self.gradient_accumulation_steps()
        self._config = dataclasses.replace(self._config, train_batch_size=train_batch_size,
                                           gradient_accumulation_steps=train_batch_size // per_step)
        self.tput_timer.batch_size = train_batch_size
        if self.auto is not None and not self.auto.stopped and self.gradient_accumulation_steps() != before:
            # a step of another number of micro-batches: its times are not the ones measured and planned for
            self.auto.measure_again(self.train_micro_batch_size_per_gpu(),
                                    f"at {self.gradient_accumulation_steps()} micro-batches a step")

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: another micro-batch size with the same number of micro-batches a step (the global batch
        follows). A data loader already built keeps its batch size, as DeepSpeed's does. The layers' streaming
        runs at any size; policy auto measures and plans again at the new size; a plan made for another
        micro-batch (policy milp or a Plan file) runs, but its memory and time predictions do not hold: a
        warning says so."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a whole number >= 1, got {micro_batch_size!r}")
        accum, before = self.gradient_accumulation_steps(), self.train_micro_batch_size_per_gpu()
        self._config = dataclasses.replace(self._config, train_micro_batch_size_per_gpu=micro_batch_size,
                                           train_batch_size=micro_batch_size * accum * self.world_size)
        planned = self.plan.micro_batch_size
        if self.auto is not None and not self.auto.stopped:
            if micro_batch_size != before:
                self.auto.measure_again(micro_batch_size, f"at micro-batch {micro_batch_size}")
        elif planned is not None and planned != micro_batch_size:
            warnings.warn(f"lazytrain: the plan ({self.plan.policy}) was made for micro-batch {planned}; at "
                          f"{micro_batch_size} it runs, but its memory and time predictions do not hold", UserWarning)

    @property
    def optimizer(self):
        """What DeepSpeed's engine shows as its optimizer: the one that updates the parameters
        (``basic_optimizer``); at stage 3 without one, as DeepSpeed's ``DeepSpeedZeRoOffload`` stands there, an
        object with the (empty) module hooks of ZeRO-3: TRL takes them off around a generation, and before a
        Trainer's first training step (``evaluate()`` first) the engine has no optimizer."""
        if self.basic_optimizer is None and self._config.zero_stage >= 3:
            return self._no_parameter_offload
        return self.basic_optimizer

    @optimizer.setter
    def optimizer(self, value) -> None:
        raise AttributeError("engine.optimizer is the optimizer initialize() set up, with the engine's buffers and "
                             "shards laid out for it: pass another one to lazytrain.initialize")

    def __setattr__(self, name: str, value) -> None:
        if name == "optimizer":   # nn.Module's would register a module or parameter under that name, past the
            object.__setattr__(self, name, value)   # property, whose setter refuses
        super().__setattr__(name, value)

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        """DeepSpeed's model-parallel world size: LazyTrain runs no model parallelism."""
        return 1

    def optimizer_name(self) -> str | None:
        """The class name of the optimizer passed to initialize, or the config's optimizer type (DeepSpeed's
        order)."""
        if self._optimizer_from_config:
            return deepspeed_optimizer_name(self._config.optimizer.type)
        return type(self.basic_optimizer).__name__ if self.basic_optimizer is not None else None

    def get_mom(self) -> list:
        """DeepSpeed's: each group's momentum (SGD, RMSprop) or betas (the others); 0.0 where a group has none."""
        key = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        return [g.get(key, 0.0) for g in self.basic_optimizer.param_groups] if self.basic_optimizer is not None else []

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's: backward without reducing the gradients over the ranks. Here ranks reduce at the step
        (ZeRO stages 0 and 1), so nothing changes inside it but that step() is refused there, as DeepSpeed
        refuses it; stages 2 and 3 reduce as gradients land, which this cannot hold back (DeepSpeed's rule)."""
        if self.zero_optimization_stage() >= 2:
            raise AssertionError(f"no_sync context manager is incompatible with gradient partitioning logic of "
                                 f"ZeRO stage {self.zero_optimization_stage()}")
        if self._inside_no_sync:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def steps_per_print(self):
        return self._config.steps_per_print

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_stage

    def get_batch_info(self) -> tuple[int, int, int]:
        """DeepSpeed's: (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def loss_scale(self) -> float:
        """DeepSpeed's: the config's fp16 ``loss_scale`` (0: dynamic)."""
        return self._config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16.loss_scale == 0

    def zero_optimization(self) -> bool:
        return self._config.zero_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_stage >= 3

    def zero_offload_param(self):
        """DeepSpeed's: the config's ``offload_param`` section, or None."""
        return self._config.offload_param if self._config.offload_param.device != "none" else None

    def empty_partition_cache(self) -> None:
        """DeepSpeed's (ZeRO-3 frees its gathered parameters): LazyTrain's stage-3 copies are freed after each
        use already, and the streamed blocks' slots are the engine's to keep."""

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def optimizer_params(self) -> dict | None:
        """DeepSpeed's: the config's ``optimizer.params``."""
        return self._config.optimizer.params if self._config.optimizer.type is not None else None

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type

    def scheduler_params(self) -> dict | None:
        """DeepSpeed's: the config's ``scheduler.params``."""
        return self._config.scheduler.params if self._config.scheduler.type is not None else None

    def zero_offload_optimizer(self):
        """DeepSpeed's: the config's ``offload_optimizer`` section, or None (LazyTrain's host optimizer runs
        either way)."""
        return self._config.offload_optimizer if self._config.offload_optimizer.device != "none" else None

    def zero_cpu_offload(self) -> bool:
        return self._config.offload_optimizer.device == "cpu"

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """DeepSpeed's: (model dtype, gradient accumulation dtype); LazyTrain accumulates gradients in fp32."""
        return self.compute_dtype, torch.float32

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are summed in across data-parallel ranks (config 'communication_data_type')."""
        return self.dist.comm_dtype

    @communication_data_type.setter
    def communication_data_type(self, value) -> None:
        """As DeepSpeed's setter: a torch dtype (or "fp32", "bf16", "fp16"; None: the model's dtype), for the
        steps after this one; refused while a step's gradients are being summed."""
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        if value is None:
            name = dataclasses.replace(self._config, communication_data_type=None).communication_dtype_name
        elif value in names:
            name = names[value]
        elif isinstance(value, str) and value in names.values():
            name = value
        else:
            raise ValueError(f"communication_data_type must be torch.float32, torch.bfloat16 or torch.float16 (or "
                             f"'fp32', 'bf16', 'fp16'; None for the model's dtype), got {value!r}")
        dtype = {v: k for k, v in names.items()}[name]
        if dtype == self.dist.comm_dtype:
            return
        if self.backward_since_zeroed() or self.micro_steps != self._step_starts_at:
            raise RuntimeError("communication_data_type cannot change in the middle of a step: its gradients are "
                               "being summed in the old dtype; set it before a step's first backward")
        self.dist.comm_dtype = dtype
        self.weights.set_comm_dtype(dtype)
        self._config = dataclasses.replace(self._config, communication_data_type=name)

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    @property
    def config(self) -> dict:
        return self._config.raw

    @property
    def engine_config(self) -> EngineConfig:
        return self._config

    def memory_report(self) -> dict[str, dict[str, Any]]:
        return {name: tier.stats() for name, tier in self.tiers.items()}

    # ---- state ---------------------------------------------------------------------------------
    def module_state_dict(self, destination: dict | None = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The model's weights in fp32 (masters), each tensor its own storage, on the host; frozen weights as
        they are kept: in bf16/fp16 training in the training precision (with the weights in host memory or on
        NVMe alike). With the state sharded in bf16/fp16 (or in fp32 beside a GPU, the masters of the
        parameters outside the streamed blocks on the host), every rank gathers the fp32 weights other ranks
        own, so every rank must call it. ``destination`` and ``prefix`` as in ``nn.Module.state_dict``
        (DeepSpeed's signature)."""
        if keep_vars:
            raise ValueError("engine.module_state_dict(keep_vars=True) would hand out the model's parameters, but "
                             "LazyTrain trains fp32 copies of them (the parameters are the streamed compute "
                             "copies): the state dict holds copies of the trained weights. Call it without "
                             "keep_vars, or use engine.module.named_parameters() for the parameters themselves")
        self._refuse_if_inconsistent("module_state_dict()")
        if self._state_gathers():
            self.dist.calls.together("module_state_dict()", self.micro_steps)
        self.wait_for_update()
        with self._whole():
            state = self._module_state(exclude_frozen_parameters, copy=True, foreign=self._foreign_masters())
        out = {} if destination is None else destination
        out.update((prefix + name, value) for name, value in state.items())
        return out

    def _state_gathers(self) -> bool:
        """Whether reading the whole model's fp32 weights gathers from other ranks (stage 3, and sharded masters
        at stages 1-2): a collective every rank must make."""
        return self.partitioned is not None or self.weights.masters_sharded

    def _copy_of_module(self, root: nn.Module, memo: dict) -> nn.Module:
        """``copy.deepcopy`` of the model or one of its modules (module_copy.py): as ``destroy()`` would hand it
        back, without handing it back. It reads the weights as :meth:`module_state_dict` does, so where that is
        a collective (sharded bf16/fp16, stage 3) every rank makes its copy."""
        self._refuse_if_inconsistent("copy.deepcopy of the model")
        if self._state_gathers():
            self.dist.calls.together("a copy of the model (copy.deepcopy, or pickling it)", self.micro_steps)
        self.wait_for_update()
        devices = {(id(m), name): device for m, _, name, device in self._devices_given}
        with self._whole():
            weight_of = self._weight_sources(self._foreign_masters())
            copied = self._attachments.copy_module(self.module, root, memo, weight_of, devices)
        for m in self.__dict__.get("_checkpointing_turned_off", []):   # the model's own setting, as destroy gives
            if id(m) in memo:
                memo[id(m)].gradient_checkpointing = True
        return copied

    def _module_state(self, exclude_frozen_parameters: bool, copy: bool,
                      foreign: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """``copy=False`` (a checkpoint save, which writes them before anything changes them): host tensors
        as they are, so a save streams the weights to disk without a second copy in memory. ``foreign``:
        fp32 weights of other ranks' layers (:meth:`_foreign_masters`), in place of their compute copies. A
        non-block parameter whose fp32 master another rank holds (stages 1-2, outside :meth:`_whole`) gives its
        compute copy, which every rank holds whole (a save's module file and a 16-bit state want no more)."""
        self.wait_for_update()
        weight_of = self._weight_sources(foreign)
        out = {}
        # by identity, not by name: a frozen weight tied under two names is left out under both (named_parameters
        # names it once; its other name would be written at stage 3 as a placeholder no file fills)
        frozen = {id(p) for p in self.module.parameters() if not p.requires_grad} if exclude_frozen_parameters else set()
        for name, t in self.module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):   # a module's extra state may be any picklable object
                out[name] = _copy_module.deepcopy(t) if copy else t
                continue
            if id(t) in frozen:
                continue
            src, here = weight_of(t)
            if not here:
                out[name] = torch.empty(0, dtype=src.dtype)   # another rank's: a save takes it from there
                continue
            out[name] = src.detach().to("cpu", copy=copy)
        return out

    def _weight_sources(self, foreign: dict[int, torch.Tensor] | None):
        """``weight_of(t)``: the tensor that holds a parameter's (or buffer's) weight as trained, its fp32 master
        where it has one here (``foreign``: other ranks' layers, :meth:`_foreign_masters`), else itself; and
        whether its values are here (False: another rank holds them, partitioned, outside :meth:`_whole`)."""
        masters = {id(p): m for p, m in self.masters.pairs} if self.masters is not None else {}
        masters.update(foreign or {})

        def weight_of(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
            src = masters.get(id(t), t)
            if self._masters_on_owners() and self.partitioned.values_elsewhere(src):
                src = t
            elsewhere = self.partitioned is not None and (self.partitioned.values_elsewhere(t) or
                                                          self.partitioned.values_elsewhere(src))
            return src, not elsewhere
        return weight_of

    def _load_module_state(self, state: dict, strict: bool, custom_load_fn=None, gather: bool = True) -> None:
        """``gather=False``: ``state`` names no partitioned parameter (stage 3), so the load needs nothing
        gathered: each rank writes the copies it holds, a master's owner the master (stages 1-2)."""
        self.wait_for_update()
        with self._whole() if gather else contextlib.nullcontext():   # every rank loads every parameter and
            self._load_module_state_whole(state, strict, custom_load_fn)   # master; the owners keep what is partitioned

    def _load_module_state_whole(self, state: dict, strict: bool, custom_load_fn) -> None:
        if custom_load_fn is None:
            self.module.load_state_dict(state, strict=strict)   # the hooks below do the rest
            return
        # the user's loader writes into the module as DeepSpeed hands it over; in bf16/fp16 the non-block
        # parameters show their fp32 masters meanwhile, so what it writes keeps full precision
        self.stream.before_host_write(range(self.weights.num_layers))   # the loader writes the masters
        with self.masters.params_showing_masters() if self.masters is not None else contextlib.nullcontext():
            custom_load_fn(src=state, dst=self.module)           # DeepSpeed's keyword names
        self._refresh_streamed_layers()   # block parameters are views of their masters

    def _before_module_load(self, module, state_dict, prefix, local_metadata, *args) -> None:
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError("load_state_dict(..., assign=True) cannot replace the parameters of a model whose "
                               "blocks LazyTrain streams (their weights live in the engine's buffers): load "
                               "without assign=True, which copies the values in")
        # pre-hooks run from the top module down, and a load_state_dict call begins at prefix "" (one that
        # raised before its post-hooks ran leaves no mark on the next)
        if prefix == "" or self._load_top is None or not prefix.startswith(self._load_top[1]):
            if self.partitioned is not None:   # before anything is written
                self.partitioned.refuse_partial_load(module, state_dict)
            self._load_top = (module, prefix, state_dict)
            # the load writes the masters (the fp32 host copy): no copy may still read them
            self.stream.before_host_write(range(self.weights.num_layers))

    def _after_module_load(self, module, incompatible_keys) -> None:
        """Once the module the user loaded into is done (post-hooks run bottom-up), the values are in its
        parameters (block parameters are views of the fp32 masters): copy them into the non-block fp32
        masters (from the state dict, at full precision) and rewrite every streamed layer's compute copy,
        which the next forward reads."""
        if self._load_top is None or self._load_top[0] is not module:
            return
        _, prefix, state = self._load_top
        self._load_top = None
        # tied weights: either name
        loaded = [(p, state[prefix + name]) for name, p in module.named_parameters(remove_duplicate=False)
                  if prefix + name in state]
        if self.masters is not None:
            with torch.no_grad():
                for p, value in loaded:
                    m = self.masters.by_param.get(id(p))
                    # a master another rank holds (stages 1-2, a load outside the engine's): its owner takes it
                    if m is not None and id(p) not in self.masters.elsewhere:
                        # a one-element tensor for a 0-dim one, as torch takes it
                        m.copy_(value.reshape(()) if m.dim() == 0 and value.shape == (1,) else value)
        written = {id(p) for p, _ in loaded}
        # the layers a parameter of which the state wrote (a whole checkpoint: all; one weight set: its layer)
        self._refresh_streamed_layers(i for i, params in enumerate(self.weights.params)
                                      if any(id(p) in written for p in params))

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        tag = ckpt.check_tag(f"global_step{self.global_steps}" if tag is None else tag)
        self._refuse_if_inconsistent("save_checkpoint", ckpt.CheckpointError)
        self.dist.calls.together("save_checkpoint()", self.micro_steps)   # not on rank 0 alone, as DDP's scripts do
        self._refuse_tags_that_differ(tag)
        into_step = self.micro_steps % self.gradient_accumulation_steps()
        script_says = self._boundary_override is not None or not self._managed   # the script owns the boundary
        if into_step and not script_says and self.global_rank == 0:
            warnings.warn(f"lazytrain: save_checkpoint {tag!r} between the micro-batches of a step ({into_step} of "
                          f"{self.gradient_accumulation_steps()} done): their accumulated gradients are not saved "
                          f"(as in DeepSpeed), and a run resumed from it starts that step afresh; save after a "
                          f"step's last micro-batch", UserWarning)
        self.wait_for_update()
        if self.shards is not None:
            # stage 3: each rank sees every parameter's shape, and takes the values of its part of DeepSpeed's
            # layout from their owners (_holder_of_pieces), so no rank holds the others' parameters whole
            with self._shapes_only():
                self._save_sharded(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        else:
            error = None
            try:
                export = self._export(client_state, exclude_frozen_parameters)
            except Exception as e:   # noqa: BLE001 - the other ranks hear of it, then it is raised here
                error = e
            if self.global_rank == 0 and error is None:
                try:   # every rank holds the optimizer state whole: DeepSpeed's files of them all, from here
                    ckpt.save(save_dir, tag, ds_layout.files_for_ranks(export, self.world_size), save_latest)
                except Exception as e:   # noqa: BLE001 - the other ranks hear of it, then it is raised here
                    error = e
            # no rank returns (and may load) before the files exist; a failed save fails every rank at once
            self._agree_on_save(error, tag, save_dir, "rank 0 writes the files")
        if self.global_rank == 0:
            ds_layout.copy_recovery_scripts(save_dir, tag)
        return True

    def _refuse_tags_that_differ(self, tag: str) -> None:
        """Every rank saves under one tag: a tag made of a per-rank value (DeepSpeed warns) would have each rank
        write its part under its own, or rank 0's alone be written; refused on every rank, before anything is."""
        if not self.dist.enabled:
            return
        tags = self.dist.all_gather_object(tag, "agreement on the checkpoint tag to save (every rank must call "
                                                "save_checkpoint)")
        if len(set(tags)) > 1:
            first = {}
            for rank, t in enumerate(tags):
                first.setdefault(t, rank)
            shown = ", ".join(f"rank {r}: {t!r}" for t, r in list(first.items())[:4])
            more = f" and {len(first) - 4} more" if len(first) > 4 else ""
            raise ckpt.CheckpointError(f"save_checkpoint: the ranks gave different tags ({shown}{more}); every rank "
                                       f"must save under the same tag (one made of the step, not of the rank). "
                                       f"Nothing was saved")

    def _agree_on_save(self, error: BaseException | None, tag: str, save_dir: str, who: str) -> None:
        """Every rank learns whether every rank's part of a save succeeded; a failure is raised on every
        rank (its own error where it failed)."""
        if not self.dist.all_succeeded(error is None, f"agreement of save_checkpoint ({who}; every rank must call "
                                                      f"save_checkpoint)"):
            _raise_save_failure(error, tag, save_dir, who)

    def _fail_together(self, error: BaseException | None, succeeded: list[bool], tag: str, save_dir: str,
                       who: str) -> None:
        """After a gather that told every rank each rank's outcome: a failure anywhere is raised everywhere
        (its own error where it failed), before any rank enters a collective the failed one would miss."""
        if not all(succeeded):
            _raise_save_failure(error, tag, save_dir, who)

    def _save_sharded(self, save_dir: str, tag: str, client_state: dict | None, save_latest: bool,
                      exclude_frozen: bool) -> bool:
        """Each rank writes its part of DeepSpeed's layout for this many ranks (sharded_checkpoint.py) into
        one staging directory, which rank 0 puts in place once every part is written. Each phase ends with
        every rank learning whether every rank's part succeeded: a failure on one rank fails every rank at
        once with its own error, and no rank waits in a collective the failed one never reaches."""
        staging = ckpt.staging_dir(save_dir, tag)
        writer, summaries, error = None, {}, None
        try:
            writer = self._sharded_writer(client_state, exclude_frozen)
            summaries = writer.summaries()
        except Exception as e:   # noqa: BLE001 - every rank hears of it, then it is raised here
            error = e
        told = self.dist.all_gather_object((error is None, summaries),
                                           "exchange of optimizer state steps for save_checkpoint (every "
                                           "rank must call it)")
        self._fail_together(error, [ok for ok, _ in told], tag, save_dir, "every rank prepares its part")
        writer.x.summaries = {name: st for _, part in told for name, st in part.items()}
        pieces, error = sharded_ckpt.gather_pieces(writer, self._holder_of_pieces(), self.dist)
        files = {}
        if error is None:
            writer.x.pieces = pieces
            try:
                files = writer.files()
            except Exception as e:   # noqa: BLE001
                error = e
        told = self.dist.all_gather_object((error is None, ckpt.files_bytes(files)),
                                           "sizes of the ranks' checkpoint files")
        self._fail_together(error, [ok for ok, _ in told], tag, save_dir, "every rank gathers its part")
        if self.global_rank == 0:
            try:
                ckpt.begin(save_dir, tag, sum(n for _, n in told))
            except Exception as e:   # noqa: BLE001
                error = e
        self._agree_on_save(error, tag, save_dir, "rank 0 prepares the directory")
        sizes = {}
        try:
            ckpt.wait_to_see(staging, f"save_checkpoint: rank {self.global_rank}")
            sizes = ckpt.write_files(save_dir, tag, staging, files)
        except Exception as e:   # noqa: BLE001
            error = e
        try:
            self._agree_on_save(error, tag, save_dir, "every rank writes its part")
        except Exception:
            if self.global_rank == 0:
                ckpt.abort(staging)
            raise
        written = {}
        for part in self.dist.all_gather_object(sizes, "sizes of the ranks' checkpoint files"):
            written.update(part)
        if self.global_rank == 0:
            try:   # it checks that every rank's files are there, as written, before the tag changes
                ckpt.finish(save_dir, tag, staging, written, save_latest)
            except Exception as e:   # noqa: BLE001
                error = e
        self._agree_on_save(error, tag, save_dir, "rank 0 puts the tag in place")
        return True

    def _sharded_writer(self, client_state: dict | None, exclude_frozen: bool) -> ds_layout.Writer:
        """This rank's writer of a sharded checkpoint (its Export without the others' summaries and the
        gathered pieces yet, which :meth:`_save_sharded` adds)."""
        whole = self._all_whole_groups()
        export = dataclasses.replace(
            self._export(client_state, exclude_frozen), rank=self.global_rank, world=self.world_size,
            groups=[{**g, "params": w["params"]} for g, w in zip(self.basic_optimizer.param_groups, whole)],
            whole_index=sharding.whole_indices(whole, self.shards),
            whole_param_groups=sharding.whole_param_groups(self.basic_optimizer.state_dict(), whole))
        return ds_layout.Writer(export)

    def _holder_of_pieces(self):
        """need -> the rank that holds its fp32 values: a partitioned non-block parameter's owner (stage 3; at
        stages 1-2 the owner of its master); a moment's owner; fp32 weights here when this rank has them, else
        the owner of their layer."""
        masters = self.masters.by_param if self.masters is not None else {}
        layer_of = self._layer_of_param
        params = dict(self.module.named_parameters())
        params.update((self._param_names[id(p)], p) for g in self._all_whole_groups() for p in g["params"]
                      if id(p) in self._param_names)

        def holder(need: ds_layout.Need) -> int:
            p = params[need.name]
            owner = self.partitioned.owner(p) if self.partitioned is not None else None
            if owner is not None:   # everything of it on its owner alone (stages 1-2: but its compute copy)
                return owner
            if need.key != "master":
                return self.shards.param_owner.get(id(p), self.global_rank)   # the optimizer state's owner
            if masters.get(id(p), p).dtype == torch.float32:
                return self.global_rank                                         # fp32 weights held here
            if id(p) in layer_of:
                return self.shards.layer_owner[layer_of[id(p)]]                 # the owner of the layer's
            return self.shards.param_owner.get(id(p), self.global_rank)
        return holder

    def _export(self, client_state: dict | None, exclude_frozen: bool) -> ds_layout.Export:
        """This engine's state for a checkpoint in DeepSpeed's layout (deepspeed_layout.py); a sharded save
        adds the fields of this rank's part (:meth:`_sharded_writer`)."""
        masters = self.masters.by_param if self.masters is not None else {}
        return ds_layout.Export(
            model=self.module, config=self._config.raw, compute_dtype=self.compute_dtype,
            # a non-block master another rank holds (stages 1-2): the compute copy, which is its value in the
            # training precision, the precision of DeepSpeed's module file (the fp32 values go by their owners)
            module_state=self._module_state(exclude_frozen, copy=False),
            names=self._param_names,
            masters={n: masters.get(id(p), p) for n, p in self.module.named_parameters()},
            optimizer=self.basic_optimizer, optimizer_from_config=self._optimizer_from_config,
            lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            counters={"global_steps": self.global_steps, "global_samples": self.global_samples,
                      "skipped_steps": self.skipped_steps},
            client_state=dict(client_state or {}), loss_scaler=self.loss_scaler,
            overflow=self._global_grad_norm is not None and not math.isfinite(self._global_grad_norm),
            exclude_frozen=exclude_frozen,
            lazytrain_state={"plan": self.plan.to_dict(), "micro_steps": self.micro_steps,
                             "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None})

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None, trust_checkpoint: bool | None = None):
        """DeepSpeed's load_checkpoint. Files are unpickled with torch's restricted loader (tensors and plain
        values; DeepSpeed's own record types): a checkpoint naming anything else is refused, unless
        ``trust_checkpoint`` (default: the config's ``lazytrain.trust_checkpoints``) says it comes from a
        source trusted like the training script itself."""
        self._refuse_if_destroyed("load_checkpoint()")
        self.dist.calls.together("load_checkpoint()", self.micro_steps)
        tag = self._agreed_tag(load_dir, tag)
        if tag is None:
            return None, None
        want_optim = load_optimizer_states and not load_module_only and self.basic_optimizer is not None
        failed_before = self._failed_step
        trust = self._config.lazytrain.trust_checkpoints if trust_checkpoint is None else bool(trust_checkpoint)
        if self.layer_updates is not None:   # what is read is checked against the optimizer's state: let it be
            self.layer_updates.settle()
        failure = RankFailure(self.dist)
        self._reading_checkpoint = True
        try:
            with failure.kept(), safe_load.records_checked(self._config.lazytrain.check_checkpoint_crcs):
                apply = self._read_checkpoint(load_dir, tag, want_optim, trust, load_module_strict, load_module_only,
                                              load_lr_scheduler_states, custom_load_fn)
        finally:
            self._reading_checkpoint = False
        # a rank that could not read its files loads nothing, and neither may the others: a script that catches
        # the error and trains on would train the ranks from different states
        failure.agree(f"agreement that every rank read checkpoint {tag!r}, in load_checkpoint()",
                      ckpt.CheckpointError(f"load_checkpoint of tag {tag!r} from {load_dir}: reading it failed on "
                                           f"another rank (see its error); nothing was loaded on any rank"))
        if self.layer_updates is not None:   # a full reload is the way out of a failed overlapped update
            failed_update = self.layer_updates.failure
            if failed_update is not None and failed_before is None:   # as a failed serial update marks it
                failed_before = (f"the overlapped optimizer update of step {self.global_steps} failed on the update "
                                 f"thread ({failed_update!r}): some layers' weights and optimizer states hold the "
                                 f"update and some do not")
            self.layer_updates.forget_failure()
        # the files are read: gradients accumulated before the load belong to no state being loaded (a rollback
        # after a loss spike); a load that failed reading them changed nothing, these gradients included
        self._drop_grads()
        try:
            result = apply()
        except Exception as e:
            self._inconsistent(f"load_checkpoint of tag {tag!r} from {load_dir} failed half-way", e,
                               "some of its state was applied and some was not")
            raise   # the error itself, as the caller of load_checkpoint expects it
        self._failed_step = None   # every streamed layer and the non-block weights were rewritten from the file
        self._show_loss_scale()
        if failed_before is not None and self.basic_optimizer is not None and not want_optim:
            # the weights are the file's, the optimizer's state is still the failed step's mix
            kept = ("; a load_checkpoint without the optimizer states (load_optimizer_states=False or "
                    "load_module_only=True) kept that optimizer state")
            self._failed_step = failed_before if failed_before.endswith(kept) else failed_before + kept
        return result

    def _agreed_tag(self, load_dir: str, tag: str | None) -> str | None:
        """The tag to load (``latest`` when none is given; None: no checkpoint there), the same on every rank:
        ranks that see different checkpoints (a save_dir on disks of their own, a ``latest`` not yet synced)
        are refused, every one of them, rather than each loading its own."""
        error, resolved = None, None
        try:
            resolved = ckpt.resolve_tag(load_dir, tag)
        except Exception as e:   # noqa: BLE001 - several ranks: the others must hear of it first
            if not self.dist.enabled:
                raise
            error = e
        if not self.dist.enabled:
            return resolved
        seen = self.dist.all_gather_object((error is None, resolved), "agreement on the checkpoint tag to load, "
                                                                       "in load_checkpoint() (every rank must call "
                                                                       "it)")
        if error is not None:
            raise error
        failed = [rank for rank, (ok, _) in enumerate(seen) if not ok]
        if failed:
            raise ckpt.CheckpointError(f"load_checkpoint from {load_dir}: rank(s) {failed} could not read which tag "
                                       f"to load (see their errors); nothing was loaded on any rank")
        tags = [t for _, t in seen]
        if len(set(tags)) > 1:
            raise ckpt.CheckpointError(
                f"load_checkpoint from {load_dir}: the ranks see different checkpoints (tag per rank: "
                f"{', '.join(f'{r}: {t!r}' for r, t in enumerate(tags))}); every rank must load the same one: put "
                f"the checkpoints on a file system every rank sees, or pass the same tag on every rank")
        return resolved

    def _read_checkpoint(self, load_dir: str, tag: str, want_optim: bool, trust: bool, load_module_strict: bool,
                         load_module_only: bool, load_lr_scheduler_states: bool, custom_load_fn):
        """Reads checkpoint ``tag`` whole (a file that fails changes nothing) and returns what applies it."""
        directory, saved_over = ckpt.find_tag(load_dir, tag)   # saved_over: DeepSpeed saved over LazyTrain's tag
        lazytrain_file = os.path.join(directory, ds_layout.LAZYTRAIN_FILE)
        if os.path.isfile(lazytrain_file) and not saved_over:
            # LazyTrain's, in DeepSpeed's layout; read everything first
            own = self._with_optimizer_shards(safe_load.load(lazytrain_file, trust), directory, trust, want_optim,
                                              whole=self.shards is None)
            state = ds_ckpt.read(directory, want_optim, trust, stage0_names=own.get("stage0_names"),
                                 wanted=self._owned_names())
            path = os.path.join(load_dir, tag, ds_layout.model_file(state.stage))   # as DeepSpeed returns it
            module = {**state.module, **own.get("module_extra", {})}
            _masters_under_every_name(module, self.module)
            if not load_module_only:
                self._check_extra_params(own, directory)
            # the optimizer's state, prepared (and refused where it does not fit) before anything is written
            optimizer, by_name = None, None
            if want_optim and state.moments is not None and own.get("optimizer") is not None:
                if _holds_8bit_moments(own["optimizer"]) and type(self.basic_optimizer).__name__ != "HybridAdamW":
                    # saved by an 8-bit HybridAdamW: its codes mean nothing to this optimizer, which takes the fp32
                    # moments the DeepSpeed files hold (dequantized), by parameter name, each checked as prepared
                    by_name = lambda: self._optimizer_state_from(state.moments, directory,  # noqa: E731
                                                                 state.group_settings)
                else:
                    optimizer = self._in_this_optimizers_order(
                        self._own_optimizer_state(own, state.moments, path, self._owned_names()),
                        own["optimizer_names"], f"checkpoint tag {tag!r} in {load_dir}")
            schedule, scale = state.lr_scheduler, own.get("loss_scaler")
            apply = lambda by_name_state: self._load_own(  # noqa: E731
                path, own, state, module, optimizer, by_name_state, load_module_strict, load_module_only,
                load_lr_scheduler_states, custom_load_fn)
        elif saved_over or ds_ckpt.is_deepspeed(directory, trust):
            # read everything first: a file that fails changes nothing.
            # a stage-0 checkpoint keeps the optimizer's state by position: DeepSpeed's groups are the ones the
            # script passed to initialize, as this engine's are, so its positions name the same parameters
            groups = self._all_whole_groups() if self.shards is not None else \
                (self.basic_optimizer.param_groups if self.basic_optimizer is not None else [])
            names = [[self._param_names.get(id(p), "") for p in g["params"]] for g in groups]
            frozen = {self._param_names.get(id(p), "") for g in groups for p in g["params"]
                      if not ds_layout.trainable(p)}
            state = ds_ckpt.read(directory, want_optim, trust, stage0_names=names if want_optim else None,
                                 wanted=self._owned_names(), stage0_frozen=frozen)
            module, optimizer = state.module, state.optimizer_state_dict
            _masters_under_every_name(module, self.module)   # stage 0 writes no shared_params
            # DeepSpeed's moments by parameter name, each checked as prepared, before anything is written
            by_name = (lambda: self._optimizer_state_from(state.moments, directory, state.group_settings)) \
                if optimizer is None and state.moments is not None and not load_module_only else None
            schedule, scale = state.lr_scheduler, _as_loss_scaler_state(state.loss_scale)
            apply = lambda by_name_state: self._load_deepspeed(  # noqa: E731
                directory, state, by_name_state, load_module_strict, load_module_only, load_lr_scheduler_states,
                custom_load_fn)
        else:
            loaded = ckpt.load(load_dir, tag, want_optim, trust=trust)
            module, optimizer, by_name = loaded[1]["module"], (loaded[2] or {}).get("optimizer"), None
            schedule, scale = loaded[1].get("lr_scheduler"), loaded[1].get("loss_scaler")
            apply = lambda _: self._load_lazytrain(*loaded, load_module_strict, load_module_only,  # noqa: E731
                                                   load_lr_scheduler_states, custom_load_fn)
        where = f"checkpoint tag {tag!r} in {load_dir}"
        if custom_load_fn is None:   # the user's own loader decides what fits
            self._check_module_state_fits(module, load_module_strict, where)
        if not load_module_only:
            self._check_optimizer_state_fits(optimizer, where)
            if load_lr_scheduler_states:
                self._check_scheduler_state_fits(schedule, where)
        prepared = by_name() if by_name is not None else None   # the moments by name: each checked here
        # the loss scale where DeepSpeed 0.19 restores it: with the optimizer states only (FP16_Optimizer's state
        # at stage 0; from stage 1 ZeRO's files, which its load_checkpoint reads only for those states); of the
        # config's mode only (DeepSpeed adopts the file's mode: LossScaler.load_state_dict)
        restore_scale = self.loss_scaler is not None and bool(scale) and want_optim

        def apply_all():
            result = apply(prepared)
            if restore_scale:
                kept = self.loss_scaler.load_state_dict(scale)
                if kept is not None and self.global_rank == 0:
                    warnings.warn(f"load_checkpoint({where}): {kept}", stacklevel=3)
            return result
        return apply_all

    def _state_shapes(self) -> dict[str, tuple | None]:
        """The names the module's ``state_dict()`` holds, each with its shape (a parameter another rank holds
        at stage 3: its whole shape; None: a module's extra state, which has none), read without gathering."""
        whole = self.partitioned.whole_shape if self.partitioned is not None else (lambda t: t.shape)
        shapes: dict[str, tuple | None] = {}
        for name, module in self.module.named_modules(remove_duplicate=False):
            prefix = f"{name}." if name else ""
            for n, p in module._parameters.items():
                if p is not None:
                    shapes[prefix + n] = tuple(whole(p))
            for n, b in module._buffers.items():
                if b is not None and n not in module._non_persistent_buffers_set:
                    shapes[prefix + n] = tuple(b.shape)
            if type(module).get_extra_state is not nn.Module.get_extra_state:
                shapes[prefix + "_extra_state"] = None
        return shapes

    def _self_loading_modules(self) -> tuple[tuple[str, ...], set[str], bool]:
        """What the module lets torch decide as it loads: the prefixes of the modules that load their own way
        (their own ``_load_from_state_dict``, or a load pre-hook of the user's, such as a legacy key rename:
        their names are not checked); the names a module may do without (BatchNorm's
        ``num_batches_tracked``, absent from old checkpoints); and whether a load post-hook of the user's may
        forgive missing or unexpected keys (torch hands each one the whole lists: then only shapes are checked)."""
        from torch.nn.modules.batchnorm import _NormBase
        ours = {h.id for h in self._load_hooks + getattr(self, "_settle_hooks", []) if hasattr(h, "id")}
        prefixes, optional, forgiving = [], set(), False
        for name, module in self.module.named_modules(remove_duplicate=False):
            prefix = f"{name}." if name else ""
            loads = type(module)._load_from_state_dict
            forgiving = forgiving or any(k not in ours for k in module._load_state_dict_post_hooks)
            if any(k not in ours for k in module._load_state_dict_pre_hooks) or \
                    loads not in (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict):
                prefixes.append(prefix)
            elif loads is _NormBase._load_from_state_dict:
                optional.add(prefix + "num_batches_tracked")
        return tuple(prefixes), optional, forgiving

    def _check_module_state_fits(self, state: dict, strict: bool, where: str) -> None:
        """A checkpoint of another model is refused before anything is written (torch's load_state_dict
        copies every tensor that fits before it reports the rest, which would leave the engine half-loaded):
        a tensor of another shape always, a missing or unexpected name when ``strict``."""
        own_way, optional, forgiving = self._self_loading_modules()   # what torch lets such modules decide
        strict = strict and not forgiving

        def checked(name: str) -> bool:
            return not name.startswith(own_way)
        shapes = self._state_shapes()
        # torch takes a one-element tensor for a 0-dim parameter (checkpoints of old torch versions)
        wrong = [f"{k} {tuple(v.shape)} there, {shapes[k]} here" for k, v in state.items()
                 if checked(k) and shapes.get(k) is not None and torch.is_tensor(v) and tuple(v.shape) != shapes[k]
                 and not (shapes[k] == () and tuple(v.shape) == (1,))]
        missing = [k for k in shapes if k not in state and k not in optional and checked(k)] if strict else []
        unexpected = [k for k in state if k not in shapes and checked(k)] if strict else []
        if not (wrong or missing or unexpected):
            return

        def listed(what: str, names: list[str]) -> str:
            return f"{len(names)} {what} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        parts = [listed(what, names) for what, names in (("of another shape", wrong), ("missing", missing),
                                                         ("not in this model", unexpected)) if names]
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        hint = " (saved with exclude_frozen_parameters=True: load with load_module_strict=False)" \
            if missing and not wrong and not unexpected and set(missing) <= frozen else ""
        raise ckpt.CheckpointMismatchError(f"{where} is of another model: tensors {'; '.join(parts)}{hint}; nothing "
                                           f"was loaded")

    def _check_scheduler_state_fits(self, sd: dict | None, where: str) -> None:
        """A schedule's state of another kind (state_kinds.py) is refused before anything is written, not
        half-way through the load or silently merged into this one's."""
        if not sd or self.lr_scheduler is None:
            return
        why = schedule_state_of_another_kind(self.lr_scheduler, sd)
        if why:
            raise ckpt.CheckpointMismatchError(f"{where} {why}: load it with load_lr_scheduler_states=False to keep "
                                               f"this one; nothing was loaded")

    def _refuse_settings_hybrid_cannot_run(self, groups, where: str) -> None:
        """Saved group settings (a state dict's groups, or DeepSpeed's by parameter) of an AMSGrad or maximizing
        optimizer, refused by a HybridAdamW, whose groups have no such key to carry them."""
        if type(self.basic_optimizer).__name__ != "HybridAdamW":
            return
        for flag in ("amsgrad", "maximize"):
            if any(g.get(flag) for g in groups):
                raise ckpt.CheckpointMismatchError(
                    f"{where} holds the state of an optimizer with {flag}=True, which this engine's HybridAdamW "
                    f"does not run: load it with load_optimizer_states=False to take the weights alone; nothing "
                    f"was loaded")

    def _check_optimizer_state_fits(self, sd: dict | None, where: str) -> None:
        """An optimizer state of other parameter groups (another model's, or a head tied here and not there)
        is refused before anything is written, naming the groups' sizes; so is one HybridAdamW cannot run
        (an AMSGrad or maximizing optimizer's), and a moment whose size is not its parameter's (torch's
        optimizers, fused ones on a device above all, would run on it)."""
        if sd is None or self.basic_optimizer is None or not isinstance(sd.get("param_groups"), list):
            return
        self._refuse_settings_hybrid_cannot_run(sd["param_groups"], where)
        groups = self._comparable_groups()
        if groups is None:
            return
        here = [len(g["params"]) for g in groups]
        there = [len(g.get("params", ())) for g in sd["param_groups"]]
        if here != there:
            raise ckpt.CheckpointMismatchError(
                f"{where} holds optimizer state for parameter groups of {there} tensors; this engine's optimizer "
                f"has groups of {here} (another model's, other trainable parameters, or an embedding and head tied "
                f"in one and not the other): load it with load_optimizer_states=False to take the weights alone; "
                f"nothing was loaded")
        self._refuse_optimizer_state_of_another_kind(sd, where)
        saved_state = sd.get("state") or {}
        ids = [i for g in sd["param_groups"] for i in g.get("params", ())]
        for p, i in zip((p for g in groups for p in g["params"]), ids):
            for key, v in (saved_state.get(i) or {}).items():
                if key in _PARAM_SHAPED_STATE and isinstance(v, torch.Tensor) and v.numel() != p.numel():
                    raise ckpt.CheckpointMismatchError(
                        f"{where} holds a {key!r} of {v.numel()} elements for the optimizer's parameter "
                        f"{self._param_names.get(id(p), '?')!r}, which has {p.numel()} (the parameters listed in "
                        f"another order, or another model's): load it with load_optimizer_states=False to take the "
                        f"weights alone; nothing was loaded")

    def _refuse_optimizer_state_of_another_kind(self, sd: dict, where: str) -> None:
        """Another optimizer's settings and moments (state_kinds.py), refused before anything is written: torch's
        load took them, and the load or the next step failed half-way, or the moments were silently unused."""
        why = optimizer_state_of_another_kind(self.basic_optimizer, sd)
        if why:
            raise ckpt.CheckpointMismatchError(f"{where} {why}: load it with load_optimizer_states=False to take the "
                                               f"weights alone; nothing was loaded")

    def _in_this_optimizers_order(self, sd: dict, saved_names: list, where: str) -> dict:
        """LazyTrain's checkpoint names the parameter at each position of its optimizer's groups: a script that
        lists the same parameters in another order (groups built from a set of names, whose order changes from
        run to run) gets each one's state by name. A group that holds other parameters than the checkpoint's
        group at its position is refused: its settings (weight decay, say) would go to other parameters."""
        groups = self._comparable_groups()
        if groups is None or not isinstance(sd.get("param_groups"), list):
            return sd
        here = [[self._param_names.get(id(p)) for p in g["params"]] for g in groups]
        if [len(g) for g in here] != [len(g.get("params", ())) for g in sd["param_groups"]] or \
                len(saved_names) != sum(len(g) for g in here):
            return sd   # refused by _check_optimizer_state_fits, naming the sizes
        names = iter(saved_names)
        reordered = []
        for k, (group, names_here) in enumerate(zip(sd["param_groups"], here)):
            ids = list(group["params"])
            names_there = [next(names) for _ in ids]
            if names_there == names_here:
                reordered.append(group)
                continue
            unnamed = None in names_here or None in names_there
            if unnamed or sorted(names_here) != sorted(names_there) or len(set(names_here)) != len(names_here):
                differ = sorted(set(names_here) ^ set(names_there), key=str)
                raise ckpt.CheckpointMismatchError(
                    f"{where} holds optimizer state for a group {k} of other parameters than this engine's group "
                    f"{k}" + (f" ({', '.join(map(repr, differ[:3]))} in one of them only)" if differ else "") +
                    ": load it with load_optimizer_states=False to take the weights alone; nothing was loaded")
            saved_id = dict(zip(names_there, ids))
            reordered.append({**group, "params": [saved_id[n] for n in names_here]})
        return {**sd, "param_groups": reordered}

    def _load_lazytrain(self, path: str, model_state: dict, optim_state: dict | None, strict: bool,
                        module_only: bool, load_scheduler: bool, custom_load_fn):
        self._load_module_state(model_state["module"], strict, custom_load_fn)
        if module_only:
            return path, model_state.get("client_state", {})
        if optim_state is not None:
            self._load_whole_optimizer_state(optim_state["optimizer"])
        if load_scheduler and self.lr_scheduler is not None and model_state.get("lr_scheduler"):
            self._load_schedule_state(model_state["lr_scheduler"])
        for k in ("global_steps", "global_samples", "skipped_steps"):
            setattr(self, k, model_state.get(k, 0))
        self._counts_after_load()
        return path, model_state.get("client_state", {})

    def _check_extra_params(self, own: dict, directory: str) -> None:
        """The optimizer's tensors outside the model (a loss's learnable temperature) as saved, shape by shape."""
        extras, saved_extras = self._extra_params(), own.get("extra_params", [])
        if [tuple(t.shape) for t in extras] != [tuple(t.shape) for t in saved_extras]:
            raise ckpt.CheckpointMismatchError(
                f"checkpoint {directory} holds {len(saved_extras)} optimizer tensor(s) outside the model "
                f"({[tuple(t.shape) for t in saved_extras]}); this engine's optimizer has "
                f"{[tuple(t.shape) for t in extras]}: add the same parameter groups before loading; nothing was "
                f"loaded")

    def _load_own(self, path: str, own: dict, state, module: dict, optimizer: dict | None, by_name: dict | None,
                  strict: bool, module_only: bool, load_scheduler: bool, custom_load_fn):
        """A checkpoint this LazyTrain wrote: the DeepSpeed files (the fp32 masters, the moments they hold
        exactly, the schedule, counters and client state) with the LazyTrain file (the optimizer's own
        state around those moments, the loss scaler): bit-identical to what was saved. ``module``: the
        module's state as read (its tied weights' every name); the optimizer's state as read: ``optimizer``, a
        whole state dict, or ``by_name``, this optimizer's own with the moments put in by name (None: none)."""
        self._load_module_state(module, strict, custom_load_fn)
        if module_only:
            return path, state.client_state
        with torch.no_grad():
            for t, saved in zip(self._extra_params(), own.get("extra_params", [])):
                t.copy_(saved)
        if by_name is not None:
            self._apply_optimizer_state(by_name)
        elif optimizer is not None:
            self._load_whole_optimizer_state(optimizer)
        if load_scheduler and self.lr_scheduler is not None and state.lr_scheduler:
            self._load_schedule_state(state.lr_scheduler)
        for k, v in state.counters.items():
            setattr(self, k, v)
        self._counts_after_load()
        return path, state.client_state

    def _load_schedule_state(self, saved: dict) -> None:
        """The schedule's state, and the learning rate it had set: a torch schedule (StepLR, ExponentialLR, ...)
        scales the rate the optimizer holds, which after a load without the optimizer's state is the config's,
        so every later step would be off; LazyTrain's own schedules set it in their load."""
        self.lr_scheduler.load_state_dict(saved)
        last = getattr(self.lr_scheduler, "_last_lr", None)
        groups = getattr(getattr(self.lr_scheduler, "optimizer", None), "param_groups", None)
        if isinstance(last, list) and groups is not None and len(last) == len(groups):
            set_group_lrs(groups, last)

    def _counts_after_load(self) -> None:
        """The micro-step count a load leaves (see below), and no progress window open: the next line's begins
        at the next training forward, not before the load."""
        self.micro_steps = self._step_starts_at = self._micro_steps_after_load()
        self._progress_window = None

    def _micro_steps_after_load(self) -> int:
        """No gradient a checkpoint's run had accumulated is in it, and this run may accumulate over another
        number of micro-batches (another number of ranks on the same global batch): the next step takes a
        whole batch at this run's accumulation, as after DeepSpeed's load."""
        return self.global_steps * (self.gradient_accumulation_steps() if self._managed else 1)

    def _owned_names(self) -> set[str] | None:
        """Sharded: the names of the tensors whose optimizer state this rank keeps (a load reads those
        alone); None: every one."""
        if self.shards is None:
            return None
        return {self._param_names[id(p)] for g in self.basic_optimizer.param_groups for p in g["params"]
                if id(p) in self._param_names}

    @staticmethod
    def _with_optimizer_shards(own: dict, directory: str, trust: bool, want_optimizer: bool, whole: bool) -> dict:
        """The LazyTrain file with the optimizer states of a sharded save (one file per rank that saved it)
        put in (memory-mapped: what this rank does not keep is never read). ``whole``: this engine keeps every
        state (no sharding here), so each file is read whole and its records' CRC-32 checked first."""
        shards = int(own.get("optimizer_shards") or 0)
        if not shards or not want_optimizer or own.get("optimizer") is None:
            return own
        state = {}
        for rank in range(shards):
            path = os.path.join(directory, ds_layout.optimizer_shard_file(rank))
            if not os.path.isfile(path):
                raise ckpt.CheckpointError(f"checkpoint {directory} was saved by {shards} ranks, and "
                                           f"{ds_layout.optimizer_shard_file(rank)} is missing")
            state.update(safe_load.load(path, trust, whole=whole)["state"])   # a share of it read: not checked
        return {**own, "optimizer": {**own["optimizer"], "state": state}}

    @staticmethod
    def _own_optimizer_state(own: dict, moments: dict, path: str, wanted: set[str] | None = None) -> dict:
        """The optimizer's state dict as saved, each moment the DeepSpeed files hold put back in (of the
        ``wanted`` names, or all)."""
        sd, names = own["optimizer"], own["optimizer_names"]
        index = [i for g in sd["param_groups"] for i in g["params"]]
        state = {}
        for i, name in zip(index, names):
            if i not in sd["state"] or (wanted is not None and name is not None and name not in wanted):
                continue
            state[i] = {}
            for k, v in sd["state"][i].items():
                if isinstance(v, str) and v == ds_layout.FROM_DEEPSPEED:
                    if k not in moments.get(name, {}):
                        raise ds_ckpt.DeepSpeedCheckpointError(
                            f"checkpoint {os.path.dirname(path)}: the DeepSpeed files hold no {k!r} for parameter "
                            f"{name!r}, which {ds_layout.LAZYTRAIN_FILE} refers to them for")
                    v = moments[name][k]
                state[i][k] = v
        return {"state": state, "param_groups": sd["param_groups"]}

    def _load_deepspeed(self, directory: str, state, by_name: dict | None, strict: bool, module_only: bool,
                        load_scheduler: bool, custom_load_fn):
        """A checkpoint DeepSpeed wrote (any ZeRO stage, any number of ranks, merged by name): the fp32
        weights, the Adam moments mapped onto this engine's optimizer by parameter name, the schedule, the
        counters, the loss scale, and the client state DeepSpeed kept as top-level keys."""
        self._load_module_state(state.module, strict, custom_load_fn)
        path = os.path.join(directory, os.path.basename(ds_ckpt._model_files(directory)[0]))
        if module_only:
            return path, state.client_state
        if state.optimizer_state_dict is not None:   # stage 0: the optimizer's own state, by position as in DeepSpeed
            self._load_whole_optimizer_state(state.optimizer_state_dict)
        elif by_name is not None:   # the moments by parameter name, prepared as the files were read
            self._apply_optimizer_state(by_name)
        if load_scheduler and self.lr_scheduler is not None and state.lr_scheduler:
            self._load_schedule_state(state.lr_scheduler)
        for k, v in state.counters.items():
            setattr(self, k, v)
        self._counts_after_load()
        return path, state.client_state

    def _refuse_added_block_params(self) -> None:
        """A group added after initialize is updated by every rank; streamed block parameters in it would be
        updated once per rank in the node-shared copy (or, in bf16/fp16, have no fp32 weights here)."""
        added = [p for g in self.basic_optimizer.param_groups[len(self._whole_groups):] for p in g["params"]]
        if not added:
            return
        blocks = {id(p) for params in self.weights.params for p in params}
        named = [self._param_names.get(id(p), "?") for p in added if id(p) in blocks]
        if named:
            raise ConfigError(f"a parameter group added to the optimizer after initialize holds streamed block "
                              f"parameters ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''}); with the "
                              f"optimizer state sharded (zero_optimization.stage >= 1) only tensors outside the "
                              f"blocks may be added later: pass the block parameters to initialize, or use stage 0")

    def _comparable_groups(self) -> list[dict] | None:
        """The optimizer's groups as a checkpoint's are laid out (sharded: whole); None for an optimizer
        without groups."""
        if self.shards is not None:
            return self._all_whole_groups()
        return getattr(self.basic_optimizer, "param_groups", None)

    def _all_whole_groups(self) -> list[dict]:
        """Sharded: the groups the optimizer was built with, whole, then any the script added since."""
        return self._whole_groups + self.basic_optimizer.param_groups[len(self._whole_groups):]

    def _load_whole_optimizer_state(self, whole: dict) -> None:
        """A whole optimizer state_dict (one process's order, any number of ranks saved it): sharded, this
        rank keeps its own parameters' states."""
        if self.shards is None:
            self._apply_optimizer_state(whole)
        else:
            self._apply_optimizer_state(sharding.local_state(whole, self._all_whole_groups(), self.shards))

    def _apply_optimizer_state(self, sd: dict) -> None:
        """The optimizer takes ``sd`` with tensors of its own: a loaded file's are memory-mapped, and torch's
        load_state_dict keeps a tensor of the right dtype as it is, which kept the checkpoint's file mapped
        (its disk space not freed when it is deleted, a SIGBUS when it is rewritten in place). A state tensor
        of its parameter's shape takes the parameter's memory layout, as the optimizer builds its state
        (``zeros_like``): a checkpoint's moments come back contiguous (DeepSpeed's flat partitions), and
        torch's fused AdamW pairs a parameter with its moments in memory order, so a transposed or
        channels_last weight's moments would have been applied to other elements, without a word."""
        # the weight-decay rule (AdamW's decoupled decay, or Adam's L2) stays the config's, as DeepSpeed's Adam keeps
        # its adam_w_mode on the optimizer, not in a checkpoint; torch's Adam took the saved group's, HybridAdamW too
        rules = [_decay_rule(g) for g in self.basic_optimizer.param_groups]
        saved_rules = [_decay_rule(g) for g in sd["param_groups"]]
        if type(self.basic_optimizer).__name__ == "HybridAdamW":   # it copies every tensor it takes in: no clone first
            self.basic_optimizer.load_state_dict(sd)
        else:
            params = {k: p for saved, mine in zip(sd["param_groups"], self.basic_optimizer.param_groups)
                      for k, p in zip(saved["params"], mine["params"])}
            state = {k: {n: _in_layout_of(v, params.get(k)) if isinstance(v, torch.Tensor) else v
                         for n, v in st.items()} for k, st in sd["state"].items()}
            self.basic_optimizer.load_state_dict({**sd, "state": state})
        for group, rule in zip(self.basic_optimizer.param_groups, rules):
            for key in _DECAY_RULE_KEYS:
                if rule is not None and key in group:
                    group[key] = rule
        differs = [r for r, saved, group in zip(rules, saved_rules, self.basic_optimizer.param_groups)
                   if r is not None and saved is not None and r != saved and group.get("weight_decay")]
        if differs:
            mine = "AdamW's decoupled decay" if differs[0] else "Adam's L2 decay (adam_w_mode false)"
            theirs = "AdamW's decoupled decay" if not differs[0] else "Adam's L2 decay"
            warnings.warn(f"lazytrain: the checkpoint's optimizer decayed the weights with {theirs}, and this engine's "
                          f"config asks for {mine}: the config's rule is kept from here on", UserWarning, stacklevel=3)
        self._warn_of_fresh_moments()

    def _warn_of_fresh_moments(self) -> None:
        """A parameter that trains now and has no state in the checkpoint beside others that have (frozen when it
        was saved: a fine-tune's next phase) starts with fresh moments, as torch's load_state_dict leaves it;
        said, as a DeepSpeed-written checkpoint missing them is refused."""
        params = [p for g in self.basic_optimizer.param_groups for p in g["params"] if p.requires_grad]
        fresh = [p for p in params if not self.basic_optimizer.state.get(p)]
        if fresh and len(fresh) < len(params):
            names = [self._param_names.get(id(p), "?") for p in fresh]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            warnings.warn(f"lazytrain: the checkpoint loaded holds no optimizer state for {len(fresh)} parameter(s) "
                          f"that train now ({shown}): they start with fresh Adam moments (frozen when it was saved?)",
                          UserWarning, stacklevel=4)

    def _optimizer_state_from(self, moments: dict, directory: str, settings: dict[str, dict] | None = None) -> dict:
        """This optimizer's state_dict with DeepSpeed's moments put in by parameter name, and each group's
        settings (lr, betas, eps, weight_decay, ...) from ``settings`` (by name: the checkpoint's group of
        the group's parameters), as DeepSpeed restores its optimizer's groups. A parameter DeepSpeed keeps no
        moments for starts fresh where DeepSpeed's would: a frozen one, or every one in a checkpoint saved
        before the first step; a trainable one missing beside others' moments is another model's."""
        # the state is this optimizer's kind's (its groups' settings say which: an SGD's momentum buffers, an
        # Adagrad's sums); without the groups' settings, an Adam's
        self._refuse_optimizer_state_of_another_kind(
            {"param_groups": list(settings.values()) if settings else [dict.fromkeys(_ADAM_SETTINGS)]},
            f"checkpoint {directory}")
        sd = self.basic_optimizer.state_dict()
        if settings:
            # sharded: this rank's groups are the whole groups' owned parts (some maybe empty): named by the whole
            whole = self._all_whole_groups() if self.shards is not None else self.basic_optimizer.param_groups
            for group, mine in zip(whole, sd["param_groups"]):
                saved = next((settings[n] for n in (self._param_names.get(id(p)) for p in group["params"])
                              if n in settings), None)
                if saved is not None:
                    self._refuse_settings_hybrid_cannot_run([saved], f"checkpoint {directory}")
                    # how the optimizer runs (foreach, fused, ...) stays this engine's
                    mine.update({k: v for k, v in saved.items()
                                 if k in mine and k not in HOW_IT_RUNS})
        # each parameter with the state its group steps with (what its optimizer cannot step without), seen once
        # per group and number of dimensions
        hybrid = type(self.basic_optimizer).__name__ == "HybridAdamW"   # (loads fp32 moments into its codes)
        seen: dict[tuple[int, int], dict | None] = {}

        def needed_by(g: int, group: dict, p: torch.Tensor) -> dict | None:
            if hybrid:
                return {"exp_avg": True, "exp_avg_sq": True}
            if (g, p.dim()) not in seen:
                seen[g, p.dim()] = _state_after_a_step(self.basic_optimizer, group, p.dim())
            return seen[g, p.dim()]
        params = [(i, p, needed_by(index, g, p))
                  for index, (group, g) in enumerate(zip(self.basic_optimizer.param_groups, sd["param_groups"]))
                  for i, p in zip(g["params"], group["params"])]
        state = {}
        for i, p, needed in params:
            name = self._param_names.get(id(p))
            if name not in moments and (not moments or not ds_layout.trainable(p)):
                continue
            if name is None:   # a tensor outside the model: no name matches it to the checkpoint's moments
                raise ds_ckpt.DeepSpeedCheckpointError(
                    f"the moments of checkpoint {directory} are loaded here by parameter name, and this optimizer "
                    f"holds a tensor of shape {tuple(p.shape)} outside the model, which no name matches: load it "
                    f"into the optimizer that saved it, or with load_optimizer_states=False to take the weights "
                    f"alone")
            if name not in moments:
                raise ds_ckpt.DeepSpeedCheckpointError(
                    f"the DeepSpeed checkpoint {directory} has no optimizer state for parameter {name!r} (it has "
                    f"{len(moments)} parameters); load it with load_optimizer_states=False to take the weights alone")
            state[i] = _optimizer_state_of(name, p, moments[name], needed, directory)
        sd["state"] = state
        return sd

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`, with its default file name."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The weights in the precision the model trains in, as DeepSpeed saves them (16-bit in bf16/fp16
        training, fp32 in fp32 training, never rounded down behind the user's back), as safetensors (a
        file that holds only tensors, which any loader reads without running code); a ``save_filename``
        not ending in ``.safetensors`` (DeepSpeed's default ``pytorch_model.bin``) is written by
        ``torch.save`` as asked."""
        self._refuse_if_inconsistent("save_16bit_model()")
        if self._copies_gather():
            self.dist.calls.together("save_16bit_model()", self.micro_steps)
        # safetensors refuses tensors that share memory: tied names each get their own copy, as in DeepSpeed
        with self._whole_copies():
            state = self._state_in_compute_dtype(exclude_frozen_parameters, share_tied=False)
        if self.global_rank == 0:
            ckpt.refuse_a_file_for_a_directory(save_dir, f"save_16bit_model({save_dir!r})")
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                ckpt.save_safetensors_atomic(path, state)
            else:
                ckpt.save_file_atomic(path, state)
        return True

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's question before a 16-bit save (accelerate and Hugging Face Trainer ask it): the config's
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save``, as DeepSpeed answers it."""
        return self._config.gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's whole-model state for a ZeRO-3 save: the weights in the training precision on rank 0,
        ``None`` on the others. It answers at every stage; at stage 3 every rank must call it (the non-block
        parameters are gathered from their owners)."""
        self._refuse_if_inconsistent("_zero3_consolidated_16bit_state_dict()")
        if self._copies_gather():
            self.dist.calls.together("_zero3_consolidated_16bit_state_dict()", self.micro_steps)
        with self._whole_copies():   # every rank takes part in a gather; rank 0 alone builds the state
            return self._state_in_compute_dtype(exclude_frozen_parameters) if self.global_rank == 0 else None

    def _state_in_compute_dtype(self, exclude_frozen_parameters: bool, share_tied: bool = True) -> dict[str, torch.Tensor]:
        """The masters cast to the training precision (fp32 training: the masters as they are); buffers as the
        engine computes with them (an fp32 buffer of a bf16 run stays fp32, so that the file reproduces the
        model as it trained). ``share_tied``: tied names share one tensor, as in the model, so a saver that
        drops tied keys can (Hugging Face's ``save_pretrained``); else each name has its own."""
        dtype = self.compute_dtype
        state = self._module_state(exclude_frozen_parameters, copy=False)
        tensor_of = {name: id(t) for name, t in self.module.state_dict(keep_vars=True).items()}
        params = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        cast: dict[int, torch.Tensor] = {}
        out = {}
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):   # a module's extra state that is not a tensor: as it is
                out[k] = v
                continue
            key = tensor_of[k] if share_tied else k
            if key not in cast:
                cast[key] = v.to(dtype, copy=True) if v.is_floating_point() and k in params else v.clone()
            out[k] = cast[key]
        return out

    def destroy(self) -> None:
        """Release streaming buffers and tiers (NVMe run directories are removed) and hand the model back:
        its blocks called directly again, every parameter in fp32 (the trained masters: the blocks' and, in
        mixed precision, the non-block weights', whatever dtype the model was loaded in), every parameter,
        gradient and buffer on the device it was given on, no hooks of ours. A second call does nothing
        (accelerate's ``free_memory`` calls it too)."""
        if self.__dict__.get("_destroyed"):
            return
        if "dist" in self.__dict__:   # a rank waiting in a save the others skipped learns it at once
            self.dist.calls.entering("destroy()", self.micro_steps)
        self._own_weights_again()
        try:
            self._hand_model_back(raise_tier_failure=True)
        except TierError as e:   # raised last: the rest was handed back, and the tiers closed as far as they go
            if e is not self.__dict__.get("_tier_close_failure"):
                raise   # (anything else: not handed back, and a second destroy() tries again)
            self._destroyed, self._destroyed_from = True, _caller_outside_lazytrain()
            raise
        self._destroyed = True
        self._destroyed_from = _caller_outside_lazytrain()   # named by a later call's refusal

    def _own_weights_again(self) -> None:
        """Before the model is handed back: block parameters in memory of this rank's own, in fp32 (the
        node-shared memory is the other ranks' too, and in sharded bf16/fp16 the layers other ranks own have
        no fp32 weights here: they are gathered, so every rank must call ``destroy``). After a failed overlapped
        update the model is handed back all the same, as the layers hold it (partly updated, as the error said)."""
        if self.layer_updates is not None:
            self.layer_updates.settle()   # finished, whatever its outcome: destroy hands the model back anyway
        if self.partitioned is not None:
            self.partitioned.unpartition()   # every non-block parameter and master whole here again
        w = self.weights
        foreign = self._foreign_masters()
        if not foreign and not self.node_shared_weights:
            return
        for i in range(w.num_layers):
            flat = w.master[i].clone() if w.master[i] is not None else None
            for slot, p, trains in zip(w.layer_slots[i], w.params[i], w.trainable[i]):
                if not trains and w.frozen_in_copy:   # views of the compute copy: hand_back_frozen's
                    continue
                p.data = slot.of(flat) if flat is not None else foreign[id(p)]

    is_compiled = False

    def compile(self, backend=None, compile_kwargs=None, schedule=None, **kwargs):
        """DeepSpeed's ``engine.compile()`` (accelerate calls it for ``torch_compile=True``): refused, as a
        ``torch.compile``d model is: the streamed blocks' forwards hand their weights to the engine's executor,
        which a compiled graph would trace through or break at every block."""
        raise RuntimeError("lazytrain: engine.compile() is not supported: the streamed blocks run through the "
                           "engine's executor, which torch.compile cannot trace; train without torch_compile")

    # ---- moves and casts of the whole model -----------------------------------------------------
    def to(self, *args, **kwargs):
        """``engine.to(local_rank)`` (or the engine's device): nothing to do, each tensor is already where the
        engine computes with it (the blocks' weights stream from host buffers). Any other move or cast is
        refused (:meth:`_apply`)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and (device is None or _same_device(device, self.device)):
            return self
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        return self.to(torch.device("cuda", device) if isinstance(device, int) else device or "cuda")

    def cpu(self):
        return self.to("cpu")

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.float()``, ``.cuda()`` ... of the engine: nn.Module's would replace each
        parameter's ``.data``, cutting the streamed blocks' parameters off the engine's buffers (the optimizer
        would then update tensors the forward never reads: silently wrong training). Refused unless it changes
        nothing."""
        for name, t in itertools.chain(self.module.named_parameters(), self.module.named_buffers()):
            out = fn(t)
            if out is not t:
                raise RuntimeError(f"lazytrain: moving or casting the engine's model after initialize is not "
                                   f"supported ({name}: {t.dtype} on {t.device} would become {out.dtype} on "
                                   f"{out.device}): the engine keeps each tensor where it streams and trains it, "
                                   f"and a new tensor would be cut off from it. Move or cast the model before "
                                   f"lazytrain.initialize (the bf16/fp16 config casts it), or after "
                                   f"engine.destroy()")
        return self

    # ---- attribute passthrough to the wrapped module --------------------------------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise AttributeError(f"'{type(self).__name__}' object and its module have no attribute '{name}'")


def _ranks(world_size: int | None, zero_stage: int | None) -> str:
    """How a run is spread over ranks, as far as its step times go (one rank has no stage to speak of)."""
    return "1 rank" if world_size == 1 else f"{world_size} ranks at ZeRO stage {zero_stage}"


def _same_device(asked: torch.device, engine_device: torch.device) -> bool:
    """``asked`` names the engine's device (a CUDA device without an index: the current one)."""
    if asked.type != engine_device.type:
        return False
    if asked.type != "cuda":
        return True

    def index(d: torch.device) -> int:
        return d.index if d.index is not None else torch.cuda.current_device()
    return index(asked) == index(engine_device)


def _trainable_shares(model: nn.Module, blocks: nn.ModuleList) -> dict[str, float]:
    """The shares of the streamed blocks' parameters and of the others (embedding, final norm, head) that train,
    as the planner's ``Budgets`` fields: it budgets a frozen block weight as its streamed copy alone (weights.py
    keeps it so in bf16/fp16) and a frozen parameter outside the blocks as its device copy alone
    (precision.FrozenParams)."""
    def share(params) -> float:
        total = sum(p.numel() for p in params)
        return sum(p.numel() for p in params if p.requires_grad) / total if total else 1.0
    in_blocks = {id(p) for p in blocks.parameters()}
    return {"trainable_share": share(list(blocks.parameters())),
            "non_block_trainable_share": share([p for p in model.parameters() if id(p) not in in_blocks])}


def _frozen_bottom_blocks(model: nn.Module, blocks: nn.ModuleList) -> int:
    """The blocks below the first one that trains, where nothing the model runs before them trains: the backward
    reaches none of them (the executor differentiates none), so the planner charges them no backward (planner
    ``Budgets.frozen_bottom_layers``). An estimate for the first plan (policy "auto" measures where the backward
    stops; the first training forward checks it), kept on the safe side: a trainable parameter outside the
    blocks counts as run after them only in a module registered after the blocks beside them (a final norm) or
    in the output embeddings that are not the input ones (an untied head); any other (an embedding, learned
    positions, a prompt encoder), or a forward hook on the input embeddings (transformers'
    ``enable_input_require_grads``), counts none. Counted too high, the plan still trains right (its one
    segment below is re-run from boundary 0), only slower and with more memory than planned."""
    first = next((i for i, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())), len(blocks))
    if first == 0:
        return 0
    embeddings = {}
    for name in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, name)()
        except Exception:   # noqa: BLE001 - a model without them, or one whose method raises: none counted
            module = None
        embeddings[name] = module if isinstance(module, nn.Module) else None
    inputs, outputs = embeddings["get_input_embeddings"], embeddings["get_output_embeddings"]
    if inputs is not None and inputs._forward_hooks:   # may make its output require grad
        return 0
    after: set[int] = set()
    parent = next((m for m in model.modules() if any(c is blocks for c in m.children())), None)
    if parent is not None:
        siblings = list(parent.children())
        for c in siblings[siblings.index(next(c for c in siblings if c is blocks)) + 1:]:
            after.update(id(p) for p in c.parameters())
    if outputs is not None:
        after.update(id(p) for p in outputs.parameters())
    if inputs is not None:
        after.difference_update(id(p) for p in inputs.parameters())
    in_blocks = {id(p) for p in blocks.parameters()}
    if any(p.requires_grad and id(p) not in in_blocks and id(p) not in after for p in model.parameters()):
        return 0
    return first


def _optimizer_state_of(name: str, param: torch.Tensor, saved: dict, needed: dict | None, directory: str) -> dict:
    """One parameter's optimizer state from a DeepSpeed checkpoint's, whatever its optimizer keeps (an Adam's
    moments, an SGD's momentum buffer, NAdam's running product), its tensors of the parameter's elements in
    fp32 and its step a tensor, as torch keeps them. ``needed``: the keys this optimizer steps with, each
    True where it holds one value per element of the parameter (None: not known). A state without one of
    them, or with an element-wise one of another shape (a state kept over DeepSpeed's flat partitions, as
    its Adafactor keeps one), is refused naming it."""
    elementwise = {k for k, v in needed.items() if v} if needed is not None else \
        {k for k, v in saved.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0}
    for key in sorted(elementwise & set(saved)):
        value = saved[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ds_ckpt.DeepSpeedCheckpointError(
                f"the DeepSpeed checkpoint {directory} holds {key!r} of shape {shape} for {name!r}, whose shape "
                f"here is {tuple(param.shape)}")
    missing = sorted(set(needed or ()) - set(saved))
    if missing:
        raise ds_ckpt.DeepSpeedCheckpointError(
            f"the DeepSpeed checkpoint {directory} holds {sorted(saved)} as {name!r}'s optimizer state, without "
            f"{missing}, which this optimizer steps with (another optimizer's state?); load it with "
            f"load_optimizer_states=False to take the weights alone")
    state = {k: v.float() if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in saved.items()}
    if "step" in saved:
        state["step"] = torch.tensor(float(saved["step"]))
    return state


_DECAY_RULE_KEYS = ("adamw_mode", "decoupled_weight_decay")   # HybridAdamW's, torch's


def _decay_rule(group: dict) -> bool | None:
    """Whether an Adam group's weight decay is AdamW's decoupled one (HybridAdamW's ``adamw_mode``, torch's
    ``decoupled_weight_decay``); None for a group of another optimizer."""
    for key in _DECAY_RULE_KEYS:
        if key in group:
            return bool(group[key])
    return None


def _state_after_a_step(optimizer, group: dict, ndim: int) -> dict | None:
    """The per-parameter state an optimizer of ``optimizer``'s kind keeps with ``group``'s settings for a
    parameter of ``ndim`` dimensions, as {key: whether it holds one value per element}: an SGD's momentum buffer
    where its momentum is set, a centered RMSprop's three averages, Adafactor's row and column variances of a
    matrix. Seen by stepping a fresh one on a tensor of two elements a dimension; None where that cannot be seen
    (a constructor or a step of its own)."""
    kind = type(optimizer)
    try:
        accepted = inspect.signature(kind.__init__).parameters
        probe_param = torch.zeros((2,) * ndim, requires_grad=True)
        probe_param.grad = torch.ones_like(probe_param)
        probe = kind([probe_param], **{k: v for k, v in group.items() if k in accepted and k != "params"})
        with torch.random.fork_rng(devices=[]), _no_global_optimizer_hooks():   # seen by nothing outside
            probe.step()
        return {k: isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == probe_param.shape
                for k, v in probe.state[probe_param].items()}
    except Exception:   # noqa: BLE001 - nothing seen, nothing required: its own load_state_dict decides
        return None


@contextlib.contextmanager
def _no_global_optimizer_hooks():
    """torch's global optimizer step hooks (a logger's, a profiler's) left out while a probe steps: it is no
    step of the run's."""
    module = importlib.import_module("torch.optim.optimizer")   # (not an attribute of torch.optim)
    names = [n for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks") if hasattr(module, n)]
    kept = {n: getattr(module, n).copy() for n in names}
    for n in names:
        getattr(module, n).clear()
    try:
        yield
    finally:
        for n in names:
            getattr(module, n).update(kept[n])


def _holds_8bit_moments(optimizer_state: dict) -> bool:
    """A saved HybridAdamW state with 8-bit blockwise moments (codes and absmax, not exp_avg)."""
    return any("state1" in st for st in optimizer_state.get("state", {}).values())


def _in_layout_of(value: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """A copy of an optimizer state tensor for ``param``: in ``param``'s memory layout where it has its shape
    (what ``zeros_like(param)`` gives the optimizer when it builds the state), else as it is."""
    if param is None or value.dim() == 0 or value.shape != param.shape:
        return value.clone()
    return torch.empty_like(param, dtype=value.dtype).copy_(value)


def _masters_under_every_name(module_state: dict, model: nn.Module) -> None:
    """A tied weight's every name in ``module_state`` takes its first name's value, the fp32 master: a stage-0
    checkpoint (DeepSpeed's or LazyTrain's) keeps the master under the first name only, the other names at
    the training precision, and loaded after it, the 16-bit copy would have replaced the shared weight."""
    for alias, source in ds_layout.shared_params(model).items():
        if source in module_state:
            module_state[alias] = module_state[source]


def _onto_masters(add_param_group, master_of):
    """The optimizer's ``add_param_group`` with the model's non-block parameters re-pointed at their fp32
    masters, as the groups given to initialize are (their gradients land on the masters: a group of the
    parameters themselves would never see one)."""
    @functools.wraps(add_param_group)
    def add(param_group: dict) -> None:
        params = param_group["params"]
        refuse_unordered(params, group=True)   # as the optimizer would, before listing it hides the set
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        return add_param_group({**param_group, "params": [
            (p[0], master_of(p[1])) if isinstance(p, tuple) and len(p) == 2 else master_of(p)   # (name, parameter)
            for p in params]})
    return add


def _step_from_the_engine_only(engine, optimizer):
    """The returned optimizer's ``step``, refused when a script calls it: the streamed layers' gradients reach
    the optimizer only through ``engine.step()`` (attached, clipped, reduced over ranks), so a direct step
    after the first updated the blocks with no gradient and trained silently wrong. The engine's own call
    (and any wrapper a scheduler put around it since) goes through."""
    step = optimizer.step

    def guarded(_optimizer, *args, **kwargs):
        if not engine.__dict__.get("_optimizer_stepping", False):
            raise RuntimeError("optimizer.step() was called directly: with LazyTrain the streamed layers' gradients "
                               "reach the optimizer only through engine.step() (which also clips, counts the step "
                               "and advances the schedule); call engine.step() after engine.backward(loss). "
                               "Nothing was updated")
        return step(*args, **kwargs)
    guarded.__doc__ = getattr(step, "__doc__", None)
    # a bound method, as torch's schedulers expect to find (they wrap its __func__ to count the calls)
    return types.MethodType(guarded, optimizer)


def _the_engines_zero_grad(engine, model: nn.Module):
    """``model.zero_grad()`` while an engine trains the model: the engine's :meth:`LazyTrainEngine.zero_grad`, the
    one rule for every parameter (dropped at ZeRO stages 0 and 1, kept from stage 2, as DeepSpeed's). The engine
    is held weakly: a model outlives an engine dropped without destroy()."""
    held = weakref.ref(engine)

    def zero_grad(set_to_none: bool = True) -> None:
        live = held()
        if live is None:
            return nn.Module.zero_grad(model, set_to_none)
        live.zero_grad(set_to_none)
    zero_grad.__doc__ = _the_engines_zero_grad.__doc__
    return zero_grad


def _zero_grad_as_zero_optimizers(engine):
    """The optimizer's ``zero_grad`` as DeepSpeed's stage-2/3 ZeRO optimizers have it, at every stage: it never
    drops the gradients the engine accumulates for the step (the streamed layers' buffers, which their
    parameters' ``.grad`` only show, and the embedding's and head's in their masters or themselves); the step
    does, and ``engine.zero_grad()`` at stages 0 and 1 (DeepSpeed's optimizers there drop them too). torch's own would clear the masters' and leave the layers' buffers, so a script calling it each
    micro-batch would step on the layers' whole accumulation and the embedding's last micro-batch. Tensors
    the optimizer updates that the engine does not accumulate (a loss's learnable temperature) are cleared
    as torch clears them."""
    def zero_grad(set_to_none: bool = True) -> None:
        for layer in engine.weights.params:
            for p in layer:
                p.grad = None   # a view of its buffer: reattached at the step, the buffer kept
        for p in engine._extra_params():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
    zero_grad.__doc__ = _zero_grad_as_zero_optimizers.__doc__
    return zero_grad


def _state_dicts_in_training_precision(model: nn.Module, block_params: list[list[nn.Parameter]],
                                       dtype: torch.dtype) -> list:
    """In bf16/fp16 training the model's other weights are in the training precision, as under DeepSpeed, but
    its block parameters are views of their fp32 masters. A ``state_dict()`` of the model or any submodule
    (what Hugging Face's ``save_pretrained`` and accelerate save) gives them in the training precision too,
    so a saved model has one dtype, as DeepSpeed's has. ``state_dict(keep_vars=True)`` (the parameters
    themselves) and ``engine.module_state_dict()`` (the fp32 masters) are unchanged."""
    ids = {id(p) for layer in block_params for p in layer}
    handles = []
    for module in model.modules():   # on the modules owning them: any module's state_dict calls theirs
        names = [n for n, p in module.named_parameters(recurse=False) if id(p) in ids]
        if not names:
            continue

        def cast(mod, state, prefix, local_metadata, names=names):
            for name in names:
                v = state.get(prefix + name)
                if v is not None and not isinstance(v, nn.Parameter):
                    # a copy either way: a layer another rank owns is a view of the (node-shared) compute copy,
                    # which a write into the state dict must not change behind its owner's back
                    state[prefix + name] = v.to(dtype, copy=True)
        handles.append(module.register_state_dict_post_hook(cast))
    return handles


# the settings every Adam's groups hold (torch's, DeepSpeed's, HybridAdamW): a state of Adam moments without them
_ADAM_SETTINGS = ("lr", "betas", "eps", "weight_decay")

# the per-parameter states of torch's optimizers that have their parameter's size (Adam's, SGD's, RMSprop's,
# Adagrad's): a saved one of another size is refused before torch's load takes it
_PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                 "acc_delta", "sum"})


def _cast_half(x):
    """Every floating-point tensor in ``x`` (tuples, lists, dicts) in fp16, as DeepSpeed's fp16.auto_cast casts
    a forward's inputs."""
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_half(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(_cast_half(v) for v in x))
    if isinstance(x, dict):
        return {k: _cast_half(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.half()
    return x



def _token_ids(inputs: tuple, kwargs: dict) -> torch.Tensor | None:
    """A forward's token ids (``input_ids``, or the first tensor passed), where they are integer ids of at
    least (batch, sequence) shape: what a plan's micro-batch and sequence length count; else None."""
    ids = kwargs.get("input_ids", next((x for x in inputs if torch.is_tensor(x)), None))
    return ids if torch.is_tensor(ids) and not ids.is_floating_point() and ids.dim() >= 2 else None

def _map_output_tensors(out, fn):
    """``out`` with each tensor ``t`` in it replaced by ``fn(t)``: in tuples, lists, dicts and Hugging Face
    outputs (pytree, rebuilt), and in the fields of a plain dataclass (set in place; pytree takes it for one
    leaf)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type) and not isinstance(out, (dict, tuple, list)):
        for f in dataclasses.fields(out):
            value = getattr(out, f.name)
            mapped = _map_output_tensors(value, fn)
            if mapped is not value:
                object.__setattr__(out, f.name, mapped)   # a frozen dataclass's too: the object is the model's new output
        return out
    leaves, spec = tree_flatten(out)
    if len(leaves) == 1 and leaves[0] is out:
        return out   # not a container pytree knows
    mapped = [_map_output_tensors(leaf, fn) for leaf in leaves]
    if all(m is leaf for m, leaf in zip(mapped, leaves)):
        return out
    return tree_unflatten(mapped, spec)


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether the model's forward takes ``use_cache``: by name, or through ``**kwargs`` into the model it
    wraps (a PEFT model's ``get_base_model()``, whose forward names it)."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        return True
    base = getattr(model, "get_base_model", None)
    if not callable(base) or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    inner = base()
    return inner is not model and isinstance(inner, nn.Module) and \
        "use_cache" in inspect.signature(inner.forward).parameters


_NO_CACHE_WITH_GRAD = (
    "lazytrain: a forward with gradients on asks the model for no KV cache (use_cache=False), in eval mode too: "
    "its output's past_key_values is None, and a decoding loop fed it would go on without its context. Decode "
    "under torch.no_grad() (as generate() does), or pass use_cache explicitly (True: the cache is filled once, as "
    "in plain PyTorch, and is held in memory no plan budgets)")


def _config_uses_cache(model: nn.Module) -> bool:
    """Whether the model's config asks for a KV cache: its own ``use_cache``, else its text config's (a
    multimodal model's outer config names none)."""
    config = getattr(model, "config", None)
    said = getattr(config, "use_cache", None)
    if said is None and callable(getattr(config, "get_text_config", None)):
        try:
            said = getattr(config.get_text_config(), "use_cache", None)
        except Exception:   # noqa: BLE001 - a config's own accessor: then it does not say
            said = None
    return said is True


def _wants(model: nn.Module, kwargs: dict, flag: str) -> bool:
    """A transformers output flag as the forward will see it: the keyword, else the model's config."""
    wanted = kwargs.get(flag)
    if wanted is None:
        wanted = getattr(getattr(model, "config", None), flag, False)
    return wanted is True


def _caller_outside_lazytrain() -> str | None:
    """Where the code that called into LazyTrain stands ("accelerate/accelerator.py:3912 in free_memory"): an
    engine destroyed by a library the script called (accelerate's ``free_memory``, which a Trainer calls when a
    second ``train()`` begins) is otherwise refused later without a word of who ended it."""
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "lazytrain":
        frame = frame.f_back
    if frame is None:
        return None
    path = frame.f_code.co_filename.replace(os.sep, "/").split("/")
    return f"{'/'.join(path[-2:])}:{frame.f_lineno} in {frame.f_code.co_name}"


def _router_logits_recorded() -> bool:
    """Whether the forward now running records router logits: transformers 5 collects a model's requested
    outputs (its keyword, else its config) with hooks, into a collector it makes current for the forward. The
    engine's own forward reads the keyword and config itself; this is for the model called itself, whose
    keywords the blocks do not see. False where transformers keeps no such collector."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    try:
        active = collector.get() if collector is not None else None
    except Exception:   # another transformers' collector
        return False
    return isinstance(active, dict) and "router_logits" in active


def _refuse_router_aux_loss(model: nn.Module, kwargs: dict) -> None:
    """A mixture-of-experts model asked for its router load-balancing loss computes it from router logits
    that hooks capture inside its layers. The streamed layers run without autograd in the forward and are
    re-run in backward, so that loss would get no gradient (all layers re-run) or fail in backward (layers
    that keep their graph): refused with the setting to change."""
    if _wants(model, kwargs, "output_router_logits"):
        raise ConfigError("the model adds a router load-balancing loss computed from router logits captured inside "
                          "its layers (output_router_logits=True); LazyTrain streams and re-runs those layers, so "
                          "that loss would get no gradient. Set output_router_logits = False in the model's config "
                          "(model.config, or its text_config in a composite model) or pass "
                          "output_router_logits=False, to train without the auxiliary loss")


def _check_model_dtype(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """A bf16/fp16 model with a float32 config would stream fp32 blocks between half-precision
    embeddings and head: say what to change instead of failing inside the first matmul."""
    if compute_dtype != torch.float32:
        return   # mixed precision: the engine keeps fp32 masters and casts the model to the compute dtype
    low = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                  if not is_quantized(p) and p.dtype != torch.float32})
    if low:
        raise ConfigError(f"the model's parameters are {', '.join(low)} but the config trains in float32 (no "
                          f"'bf16' or 'fp16' section enabled): add \"bf16\": {{\"enabled\": true}} (or fp16) to "
                          f"the config, or convert the model with model.float()")


def _by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Host gradient buffers and device gradients side by side: one list per device for foreach ops."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def _scale_(grads: list[torch.Tensor], factor: float) -> None:
    for gs in _by_device(grads):
        torch._foreach_mul_(gs, factor)


def _dense_values(g: torch.Tensor) -> torch.Tensor:
    """What a gradient's squares sum over: a sparse one's stored values (coalesced: no index twice)."""
    return g.detach().coalesce().values() if g.is_sparse else g.detach()


def _global_square_sum(grads: list[torch.Tensor]) -> float:
    """The squared L2 norm over all gradients: a host gradient's as host_accumulate.py sums a layer's buffer
    (fp32 rows, fp64 across them), the others' from per-tensor norms on each device. Not torch's CPU norm:
    it accumulates a large tensor in fp32 and comes out low (1.3e-3 at 16M elements, 7.5e-2 at 268M: an
    embedding or head whose gradient is on the host would be clipped by another norm than a GPU's)."""
    total = 0.0
    for gs in _by_device(grads):
        if gs[0].device.type == "cpu":
            total += sum(sum_of_squares(_dense_values(g).reshape(-1).float().contiguous()) for g in gs)
            continue
        norms = torch._foreach_norm(gs, 2.0)
        total += float(torch.stack([n.float() for n in norms]).pow(2).sum())
    return total


def _raise_save_failure(error: BaseException | None, tag: str, save_dir: str, who: str) -> None:
    """A save that failed on some rank, raised on this one: its own error where it failed, else an error
    that names the phase (``who``) another rank failed in."""
    if error is not None:
        raise error
    raise ckpt.CheckpointError(f"save_checkpoint of tag {tag!r} to {save_dir} failed on another rank ({who}): see "
                               f"its error")
