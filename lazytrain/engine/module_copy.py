"""``copy.deepcopy(engine.module)``: a plain copy of the model, as ``destroy()`` would hand it back.

Why: scripts copy the model after ``initialize`` for an EMA, a frozen reference (DPO, PPO) or a teacher, as
DeepSpeed's ZeRO-1/2 modules allow. The engine's hooks and forward proxies on the model reference the engine
(its threads, locks and buffers), so a plain deepcopy fails, and a copy that kept them would route its
forward into the original's engine. The copy is built without them: the model's own hooks and attributes as
they were before ``initialize``, every trained parameter in fp32 from its master (the compute copies and the
block parameters' views are the engine's), a frozen one as the engine keeps it, each on the device it was
given on. Nothing is shared with the engine.

:class:`EngineAttachments` records what set-up added to each module (hook entries and instance attributes,
told apart from the model's own by a snapshot taken before set-up); :func:`install` makes ``deepcopy`` of the
root module build the copy through :meth:`EngineAttachments.copy_module`.
"""
from __future__ import annotations

import copy
import weakref
from typing import Callable

import torch
import torch.nn as nn

_STRIPPED = object()   # stands for an engine's attachment while the module is copied; removed from the copy


def _hook_dicts(module: nn.Module) -> dict[str, dict]:
    """A module's hook tables (``_forward_pre_hooks``, ``_load_state_dict_post_hooks``, ...)."""
    return {name: value for name, value in vars(module).items()
            if name.startswith("_") and name.endswith("hooks") and isinstance(value, dict)}


def _own_attributes(module: nn.Module) -> set[str]:
    return {name for name in vars(module) if not (name.startswith("_") and name.endswith("hooks"))}


class EngineAttachments:
    """What set-up added to the model: taken as a snapshot of each module before it, compared after it."""

    def __init__(self, model: nn.Module):
        self._before = {id(m): ({name: set(d) for name, d in _hook_dicts(m).items()}, _own_attributes(m))
                        for m in model.modules()}
        self._added: dict[int, tuple[dict[str, set], set[str]]] = {}

    def set_up_done(self, model: nn.Module) -> None:
        """Compare each module with its snapshot: what is new is the engine's."""
        for m in model.modules():
            hooks_before, attrs_before = self._before.get(id(m), ({}, set()))
            hooks = {name: set(d) - hooks_before.get(name, set()) for name, d in _hook_dicts(m).items()}
            self._added[id(m)] = ({k: v for k, v in hooks.items() if v}, _own_attributes(m) - attrs_before)
        self._before = {}

    def copy_module(self, model: nn.Module, memo: dict, weights: dict[str, torch.Tensor],
                    devices: dict[tuple[int, str], torch.device]) -> nn.Module:
        """A deep copy of ``model`` without what the engine added, its parameters from ``weights`` (by
        name: the fp32 masters, frozen ones as kept) on ``devices`` ((id of module, name) -> device)."""
        for m in model.modules():   # the engine's attachments copy as a placeholder, removed below
            hooks, attrs = self._added.get(id(m), ({}, set()))
            for name, keys in hooks.items():
                table = getattr(m, name)
                for key in keys & set(table):
                    memo[id(table[key])] = _STRIPPED
            for name in attrs & set(vars(m)):
                memo[id(vars(m)[name])] = _STRIPPED
        for module_name, m in model.named_modules():   # parameters: new ones, from the engine's weights
            for name, p in m._parameters.items():
                if p is None or id(p) in memo:
                    continue
                full = f"{module_name}.{name}" if module_name else name
                value = weights[full].to(devices.get((id(m), name), p.device), copy=True)
                memo[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            for name, b in m._buffers.items():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = b.detach().to(devices.get((id(m), name), b.device), copy=True)
        own = vars(model).pop("__deepcopy__", None)   # the copy itself is made the ordinary way
        try:
            out = copy.deepcopy(model, memo)
        finally:
            if own is not None:
                vars(model)["__deepcopy__"] = own
        for m in out.modules():
            for table in _hook_dicts(m).values():
                for key in [k for k, v in table.items() if v is _STRIPPED]:
                    del table[key]
            for name in [k for k, v in vars(m).items() if v is _STRIPPED]:
                delattr(m, name)
        return out


class _DeepcopyThroughEngine:
    """``model.__deepcopy__``: deepcopy of the root module asks the engine (held weakly: a model outlives an
    engine that was not destroyed)."""

    def __init__(self, copy_fn: Callable[[dict], nn.Module]):
        self._copy = weakref.WeakMethod(copy_fn)

    def __call__(self, memo: dict) -> nn.Module:
        copy_fn = self._copy()
        if copy_fn is None:
            raise RuntimeError("this model's LazyTrain engine is gone without destroy(); copy the model from its "
                               "state_dict instead")
        return copy_fn(memo)


def install(model: nn.Module, copy_fn: Callable[[dict], nn.Module]) -> None:
    """``copy.deepcopy(model)`` calls ``copy_fn(memo)`` (``copy.deepcopy`` looks ``__deepcopy__`` up on the
    instance first)."""
    object.__setattr__(model, "__deepcopy__", _DeepcopyThroughEngine(copy_fn))


def uninstall(model: nn.Module) -> None:
    vars(model).pop("__deepcopy__", None)
