"""Build the host optimizer and the LR schedule from a DeepSpeed-style config or the user's objects.

DeepSpeed semantics: optimizer "Adam" is AdamW (decoupled weight decay) unless
``params.adam_w_mode`` is false; "AdamW" is always AdamW; an optimizer or scheduler passed to
``initialize`` may be an object or a callable (the callable receives the parameters, or the optimizer).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch

from ..config import ConfigError, EngineConfig, _flag
from ..optim.hybrid_adamw import HybridAdamW, refuse_unordered
from ..optim.lr_schedules import build_schedule, torch_class_by_name

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam", "bias_correction",
              "fused", "foreach", "set_grad_none", "fp32_optimizer_states"}
_HYBRID_TYPES = {"adamw8bit", "hybridadamw"}
KNOWN_TYPES = ("Adam", "AdamW", "AdamW8bit", "HybridAdamW", "SGD", "Adagrad")
# DeepSpeed's own optimizers (its compiled kernels, its communication schemes): refused by name
_DEEPSPEED_OWN = {"lamb": "FusedLamb", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam",
                  "onebitlamb": "1-bit LAMB", "lion": "Lion (FusedLion / CPU Lion)", "muon": "Muon",
                  "muadam": "MuAdam (mup)", "muadamw": "MuAdamW (mup)", "musgd": "MuSGD (mup)"}


def deepspeed_optimizer_name(typ: str) -> str:
    """A config's optimizer type as DeepSpeed's optimizer_name() gives it: lower-cased where DeepSpeed implements
    the type itself (its ADAM_OPTIMIZER etc. are), as written otherwise (a torch.optim class name). "sgd", which
    DeepSpeed refuses and LazyTrain builds as torch's SGD, is named "SGD" (get_mom reads its momentum by it)."""
    if typ.lower() == "sgd":
        return "SGD"
    return typ.lower() if typ.lower() in {"adam", "adamw", "adagrad", *_DEEPSPEED_OWN} else typ


def listed_groups(model_parameters: list | tuple | None) -> list | tuple | None:
    """``model_parameters`` with each group's ``params`` listed once: a group's generator, read by the first
    of the engine's two readings, left the optimizer's groups empty (nothing trained, without a word)."""
    if not model_parameters or not isinstance(model_parameters[0], dict):
        return model_parameters
    out = []
    for i, g in enumerate(model_parameters):
        if not isinstance(g, dict) or "params" not in g:
            raise ConfigError(f"model_parameters[{i}]: a parameter group is a dict with 'params' (as torch's "
                              f"optimizers take them), got {g if not isinstance(g, dict) else sorted(g)!r}")
        params = g["params"]
        if not isinstance(params, (torch.Tensor, list, tuple)):
            refuse_unordered(params, group=True)
            params = list(params)
        out.append({**g, "params": params})
    return out


def param_groups(model_parameters: Iterable | None, model: torch.nn.Module, remap: Callable) -> list[dict]:
    """The user's parameters (a list, a generator or param groups) with each parameter replaced by the
    tensor the optimizer must update (its fp32 master where one exists)."""
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)   # a set or a bare tensor was refused where the engine listed them
    if not items:
        raise ConfigError("model_parameters is empty: pass model.parameters() or parameter groups")
    if not isinstance(items[0], (dict, tuple, torch.Tensor)):   # a dict's keys, numbers: a raw AttributeError
        raise ConfigError(f"model_parameters holds {type(items[0]).__name__} values: pass the parameters "
                          f"(model.parameters()), (name, parameter) pairs or parameter groups")
    if isinstance(items[0], dict):
        groups = []
        for g in items:
            g = dict(g)
            params = g["params"]   # as torch reads a group: one tensor, or (name, parameter) pairs
            refuse_unordered(params, group=True)
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            g["params"] = [remap(p[1] if isinstance(p, tuple) else p) for p in params]
            groups.append(g)
        return groups
    if isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": [remap(p) for p in items]}]


def build_optimizer(cfg: EngineConfig, groups: list[dict], named: dict[int, str],
                    layerwise: bool = False) -> torch.optim.Optimizer:
    """The config's optimizer. ``layerwise``: the engine will update one layer at a time on another
    thread, so Adam/AdamW are built as HybridAdamW (with the configured state precision, fp32 by default),
    which can step a subset of parameters with a snapshot of the hyperparameters (as DeepSpeed swaps in
    its own CPU Adam when the optimizer is offloaded). AMSGrad keeps torch's optimizer."""
    typ = cfg.optimizer.type
    params = dict(cfg.optimizer.params)
    lower = typ.lower()
    if lower in ("adam", "adamw"):
        unknown = set(params) - _ADAM_KEYS
        if unknown:
            raise ConfigError(f"unknown key '{sorted(unknown)[0]}' in config section 'optimizer.params' for "
                              f"{typ} (allowed: {', '.join(sorted(_ADAM_KEYS))})")
        flags = _flags(params, ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "bias_correction", "amsgrad",
                                "set_grad_none", "fused", "foreach"))
        adam_w_mode = flags.get("adam_w_mode", True) if lower == "adam" else True
        params.pop("adam_w_mode", None)
        # DeepSpeed's default: torch's AdamW's (0.01) where "torch_adam" makes it build one, else its FusedAdam's
        # and CPUAdam's (0)
        torch_adamw = flags.get("torch_adam", False) and adam_w_mode
        params.pop("torch_adam", None)
        params.setdefault("weight_decay", 0.01 if torch_adamw else 0.0)
        params.pop("fused", None)
        params.pop("foreach", None)
        params.pop("set_grad_none", None)   # FusedAdam's zero_grad: the engine zeroes gradients its own way
        if params.pop("fp32_optimizer_states", True) is False:   # (a flag: 0 and "false" read as false)
            raise ConfigError("config 'optimizer.params.fp32_optimizer_states' = false keeps DeepSpeed's CPU Adam "
                              "states in the parameters' 16-bit type, which LazyTrain does not do: its host optimizer "
                              "keeps fp32 states. Remove the key; to shrink the host state use \"lazytrain\": "
                              "{\"optimizer_states\": \"8bit\"}")
        if params.pop("bias_correction", True) is False:
            raise ConfigError("config 'optimizer.params.bias_correction' = false is not supported by LazyTrain's "
                              "host optimizer")
        if "betas" in params:
            params["betas"] = _betas(params["betas"])
        _check_numbers(params, typ)
        amsgrad = params.get("amsgrad", False)
        if cfg.lazytrain.optimizer_states == "8bit" and amsgrad:
            raise ConfigError("config 'optimizer.params.amsgrad' = true is not supported with "
                              "'lazytrain.optimizer_states' = \"8bit\" (HybridAdamW has no AMSGrad)")
        if cfg.lazytrain.optimizer_states == "8bit" or (layerwise and not amsgrad):
            params.pop("amsgrad", None)
            return _hybrid(groups, params, adam_w_mode, cfg, named)
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        try:
            return cls(groups, fused=_fused_ok(groups), **params)
        except (TypeError, ValueError) as e:   # an unknown or bad parameter, named by where it is set
            raise ConfigError(f"config 'optimizer.params' for {typ}: {e}") from None
    if lower in _HYBRID_TYPES:
        # false: Adam with L2 decay, as DeepSpeed's key says
        adam_w_mode = _flag(params, "adam_w_mode", True, "optimizer.params")
        params.pop("adam_w_mode", None)
        if "betas" in params:
            params["betas"] = _betas(params["betas"])
        _check_numbers(params, typ)
        return _hybrid(groups, params, adam_w_mode, cfg, named)
    if lower in _DEEPSPEED_OWN:
        raise ConfigError(f"config 'optimizer.type' {typ!r} is DeepSpeed's {_DEEPSPEED_OWN[lower]}, which LazyTrain "
                          f"does not implement (supported: {', '.join(KNOWN_TYPES)}, or any torch.optim optimizer by "
                          f"its class name; or pass an optimizer object or callable to initialize)")
    if typ == "LBFGS":
        raise ConfigError("config 'optimizer.type' \"LBFGS\" needs a closure that re-evaluates the loss at every "
                          "step, which engine.step() does not take; use another optimizer")
    cls = _torch_optimizer("Adagrad" if lower == "adagrad" else "SGD" if lower == "sgd" else typ)
    if cls is None:
        raise ConfigError(f"config 'optimizer.type' {typ!r} is not supported by LazyTrain (supported: "
                          f"{', '.join(KNOWN_TYPES)}, or any torch.optim optimizer by its class name; or pass an "
                          f"optimizer object or callable to initialize)")
    try:
        return cls(groups, **params)
    except (TypeError, ValueError) as e:   # an unknown or bad parameter, named by where it is set
        raise ConfigError(f"config 'optimizer.params' for {typ}: {e}") from None


def _flags(params: dict, keys: tuple[str, ...]) -> dict[str, bool]:
    """The true/false settings among ``keys`` in ``params``, read as DeepSpeed's config reads them (0 and
    "false" are false) and written back as booleans: ``bool("false")`` is True, and torch's fused kernel
    refuses a string. Returns those present."""
    found = {k: _flag(params, k, False, "optimizer.params") for k in keys if params.get(k) is not None}
    params.update(found)
    return found


def _check_numbers(params: dict, typ: str) -> None:
    """Adam's numeric settings, refused by key when they are not numbers (a string "3e-4" reached torch's
    comparison as "'<=' not supported between instances of 'float' and 'str'")."""
    for key in ("lr", "eps", "weight_decay"):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor))):
            raise ConfigError(f"config 'optimizer.params.{key}' for {typ} must be a number, got {value!r}")


def _betas(value) -> tuple:
    """Adam's two betas, refused by name when they are not two numbers (torch would index past them)."""
    try:
        betas = tuple(value)
    except TypeError:
        betas = ()
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
        raise ConfigError(f"config 'optimizer.params.betas' must be two numbers, got {value!r}")
    return betas


def _torch_optimizer(name: str):
    """A torch.optim optimizer class by its name, as DeepSpeed builds any type it does not implement itself."""
    return torch_class_by_name(torch.optim, name, torch.optim.Optimizer)


def _fused_ok(groups: list[dict]) -> bool:
    """torch's fused Adam(W) needs floating-point parameters on CPU or CUDA."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])


def _hybrid(groups, params, adam_w_mode: bool, cfg: EngineConfig, named: dict[int, str]):
    try:
        from ..optim.hybrid_adamw import HybridAdamW
    except ImportError as e:  # pragma: no cover - present once the hybrid optimizer ships
        raise ConfigError(f"8-bit optimizer states need lazytrain.optim.hybrid_adamw: {e}") from e
    lt = cfg.lazytrain
    set_elsewhere = {"optimizer_states": "lazytrain.optimizer_states", "min_8bit_size": "lazytrain.hybrid_threshold",
                     "block_size": "lazytrain.quant_block_size", "fp32_name_patterns": "lazytrain.fp32_state_patterns",
                     "named_parameters": None, "check_finite": None, "adamw_mode": "optimizer.type"}
    for key in sorted(set(params) & set(set_elsewhere)):
        where = set_elsewhere[key]
        raise ConfigError(f"config 'optimizer.params.{key}' is not an optimizer parameter here: "
                          + (f"set '{where}' instead" if where else "the engine sets it"))
    try:
        return HybridAdamW(groups, adamw_mode=adam_w_mode, optimizer_states=lt.optimizer_states,   # 8-bit types: "8bit"
                           min_8bit_size=lt.hybrid_threshold, block_size=lt.quant_block_size,
                           fp32_name_patterns=lt.fp32_state_patterns,
                           named_parameters=named, check_finite=False, **params)   # the engine checks finiteness
    except (TypeError, ValueError) as e:   # an unknown or bad parameter, named by where it is set
        raise ConfigError(f"config 'optimizer.params' for {cfg.optimizer.type} (or a parameter group passed to "
                          f"initialize): {e}") from None


def eight_bit_share(cfg: EngineConfig, model: torch.nn.Module, groups: list[dict]) -> float:
    """The share of the parameters the optimizer will update (``groups``, as :func:`param_groups` gives them,
    by elements) whose Adam moments it keeps in 8 bits (the planner's ``Budgets.hybrid_8bit_fraction``):
    HybridAdamW's choice, a group's own ``optimizer_states`` and ``min_8bit_size`` included, with 8-bit states
    asked for ('lazytrain.optimizer_states' "8bit", or an 8-bit optimizer type); else none."""
    typ = (cfg.optimizer.type or "").lower()
    if typ not in _HYBRID_TYPES | {"adam", "adamw"} or cfg.lazytrain.optimizer_states != "8bit":
        return 0.0
    import re
    from ..optim.hybrid_adamw import DEFAULT_FP32_PATTERNS, choose_states
    lt = cfg.lazytrain
    patterns = DEFAULT_FP32_PATTERNS if lt.fp32_state_patterns is None else lt.fp32_state_patterns
    fp32_res = [re.compile(pat, re.IGNORECASE) for pat in patterns]
    names = {id(p): n for n, p in model.named_parameters()}
    total = eight = 0
    for g in groups:
        states, min_size = g.get("optimizer_states", "8bit"), g.get("min_8bit_size", lt.hybrid_threshold)
        for p in g["params"]:
            if p.requires_grad:
                total += p.numel()
                if choose_states(p, names.get(id(p)), states, min_size, fp32_res)[0] == "8bit":
                    eight += p.numel()
    return eight / total if total else 0.0


def client_optimizer(optimizer: Any, groups: list[dict], remap: Callable, gave_groups: bool = True
                     ) -> torch.optim.Optimizer:
    """A user's optimizer object (its parameters re-pointed at the masters) or a callable, called as DeepSpeed
    calls it: with the groups where the script gave groups, else with the parameters as a list."""
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        built = optimizer(groups if gave_groups else [p for g in groups for p in g["params"]])
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer callable passed to lazytrain.initialize returned "
                              f"{type(built).__name__}, not a torch.optim.Optimizer")
        return _no_own_clipping(built)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
    if any(_has_stepped(state) for state in optimizer.state.values()):
        raise ConfigError("the optimizer passed to lazytrain.initialize has already stepped; pass a fresh one")
    _no_own_clipping(optimizer)
    for g in optimizer.param_groups:
        g["params"] = [remap(p) for p in g["params"]]
    _move_initial_state(optimizer, remap)
    return optimizer


def refuse_unkept_8bit_states(cfg: EngineConfig, optimizer: torch.optim.Optimizer, passed: bool) -> None:
    """``lazytrain.optimizer_states: "8bit"`` is a request for 8-bit Adam moments, which HybridAdamW keeps (as its
    groups say); an optimizer that keeps none (SGD from the config, a torch AdamW passed to initialize) went on
    with its own fp32 state without a word, 4x the host memory asked for. ``passed``: it came to initialize."""
    name = type(optimizer).__name__
    if cfg.lazytrain.optimizer_states != "8bit":
        return
    if isinstance(optimizer, HybridAdamW):   # its groups choose (a group of the config's may keep fp32 states);
        if passed and all(g.get("optimizer_states") == "fp32" for g in optimizer.param_groups):   # none 8-bit
            raise ConfigError(f"config 'lazytrain.optimizer_states' = \"8bit\", and the {name} passed to "
                              f"lazytrain.initialize keeps fp32 states in every group (optimizer_states=\"fp32\"): "
                              f"an optimizer passed in keeps its own settings; build it with "
                              f"optimizer_states=\"8bit\", or remove the key")
        return
    where = "passed to lazytrain.initialize" if passed else f"from the config's 'optimizer.type' {cfg.optimizer.type!r}"
    raise ConfigError(f"config 'lazytrain.optimizer_states' = \"8bit\" keeps Adam's moments in 8 bits (HybridAdamW, "
                      f"built for 'optimizer.type' Adam, AdamW, AdamW8bit or HybridAdamW); this engine's optimizer "
                      f"({name}, {where}) keeps its own state: remove the key, or use one of those types"
                      + (" in the config (or pass a lazytrain.optim.HybridAdamW)" if passed else ""))


def _move_initial_state(optimizer: torch.optim.Optimizer, remap: Callable) -> None:
    """A fresh optimizer's state built with it (Adagrad's step 0 and its sums at initial_accumulator_value)
    moves to the master each parameter now has, in the master's dtype and device: left under the model's
    parameter, the optimizer found none for the master (KeyError: 'sum' on a GPU) and kept an orphan."""
    for p in list(optimizer.state):
        m = remap(p)
        if m is p:
            continue
        optimizer.state[m] = {k: v.to(device=m.device, dtype=m.dtype) if torch.is_tensor(v) and v.shape == m.shape
                              else v for k, v in optimizer.state.pop(p).items()}


def hand_back_to_params(optimizer: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """After ``destroy()`` put the parameters back where they were given: the optimizer's groups and state under
    the model's parameters again, in place of the masters the engine gave it, and every state tensor on its
    parameter's device (a scalar step stays on the host unless the group is fused or capturable, as torch keeps
    it). Left on the masters, an optimizer the script goes on using steps tensors no model reads, without a
    word; left on the host beside a parameter on a GPU, its next step raises."""
    param_of = {id(m): p for p, m in pairs}
    for g in optimizer.param_groups:
        g["params"] = [param_of.get(id(t), t) for t in g["params"]]
    for m in [m for m in optimizer.state if id(m) in param_of]:
        optimizer.state[param_of[id(m)]] = optimizer.state.pop(m)
    for g in optimizer.param_groups:
        step_on_device = bool(g.get("fused") or g.get("capturable"))
        for p in g["params"]:
            state = optimizer.state.get(p)
            if state:
                optimizer.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and (v.dim() > 0 or step_on_device)
                                      else v for k, v in state.items()}


def _has_stepped(state: dict) -> bool:
    """A parameter's optimizer state after a step: Adagrad builds its state (step 0, zero sums) with the
    optimizer, so a state alone does not say so; a step count above 0, or a state without one, does."""
    step = state.get("step")
    if step is None:
        return bool(state)
    return float(step) > 0


def _no_own_clipping(optimizer):
    """The engine clips (config ``gradient_clipping``) over every gradient before any layer's update and
    hands the optimizer the coefficient, which replaces an optimizer's own clipping: refuse one that
    clips by itself rather than drop its setting."""
    norm = getattr(optimizer, "max_grad_norm", 0) or 0
    if norm > 0:
        raise ConfigError(f"the optimizer passed to lazytrain.initialize clips gradients itself "
                          f"(max_grad_norm={norm}), which the engine would override: build it without "
                          f"max_grad_norm and set the config's 'gradient_clipping' to {norm}")
    return optimizer


def build_scheduler(cfg: EngineConfig, optimizer, lr_scheduler: Any):
    """The schedule passed to ``initialize`` (an object, or a callable or class given the optimizer) wins over
    the config's, as in DeepSpeed, which uses it without a word; here a warning says the section is unused."""
    if lr_scheduler is not None:
        if cfg.scheduler.type is not None:
            warnings.warn(f"lazytrain: an lr_scheduler was passed to initialize, so the config's 'scheduler' "
                          f"({cfg.scheduler.type}) is not used, as in DeepSpeed", UserWarning, stacklevel=4)
        if isinstance(lr_scheduler, type) or (callable(lr_scheduler) and not hasattr(lr_scheduler, "step")):
            if optimizer is None:   # as DeepSpeed: no optimizer, no schedule (it was an AttributeError here)
                warnings.warn("lazytrain: an lr_scheduler callable was passed to initialize without an optimizer: "
                              "it is not called, and the engine has no schedule", UserWarning, stacklevel=4)
                return None
            return lr_scheduler(optimizer)
        return lr_scheduler
    if cfg.scheduler.type is None or optimizer is None:   # DeepSpeed: no optimizer, no schedule (an evaluation
        return None                                       # run under a training config)
    try:
        return build_schedule(cfg.scheduler.type, optimizer, cfg.scheduler.params)
    except ValueError as e:
        raise ConfigError(str(e)) from None
