"""``copy.deepcopy(engine.module)``: a plain copy of the model, as ``destroy()`` would hand it back.

Why: scripts copy the model after ``initialize`` for an EMA, a frozen reference (DPO, PPO) or a teacher, as
DeepSpeed's ZeRO-1/2 modules allow. The engine's hooks and forward proxies on the model reference the engine
(its threads, locks and buffers), so a plain deepcopy fails, and a copy that kept them would route its
forward into the original's engine. The copy is built without them: the model's own hooks and attributes as
they were before ``initialize``, every floating-point parameter in fp32 (a trained one from its master: the
compute copies and the block parameters' views are the engine's; a frozen one from the copy the engine keeps),
each on the device it was given on. Nothing is shared with the engine.

:class:`EngineAttachments` records what set-up added to each module (hook entries and instance attributes,
told apart from the model's own by a snapshot taken before set-up); :func:`install` makes ``deepcopy`` of the
model or of any of its modules build the copy through :meth:`EngineAttachments.copy_module`, and pickling one
(``torch.save(engine.module)``) pickle that copy.
"""
from __future__ import annotations

import copy
import multiprocessing.context
import sys
import weakref
from typing import Callable

import torch
import torch.nn as nn

_STRIPPED = object()   # stands for an engine's attachment while the module is copied; removed from the copy
_COPYING = "lazytrain.module_copy.copying"   # memo keys of a copy in progress (deepcopy's own keys are ints)
_MADE = "lazytrain.module_copy.made"


def _hook_dicts(module: nn.Module) -> dict[str, dict]:
    """A module's hook tables (``_forward_pre_hooks``, ``_load_state_dict_post_hooks``, ...)."""
    return {name: value for name, value in vars(module).items()
            if name.startswith("_") and name.endswith("hooks") and isinstance(value, dict)}


def _own_attributes(module: nn.Module) -> dict:
    return {name: value for name, value in vars(module).items() if not (name.startswith("_") and name.endswith("hooks"))}


class EngineAttachments:
    """What set-up added to the model: taken as a snapshot of each module before it, compared after it. A
    callable the module held itself that set-up replaced (a ``forward`` the script set on a block, which the
    engine routes through its executor) is the copy's as it was."""

    def __init__(self, model: nn.Module):
        self._before = {id(m): ({name: set(d) for name, d in _hook_dicts(m).items()}, _own_attributes(m))
                        for m in model.modules()}
        self._added: dict[int, tuple[dict[str, set], set[str]]] = {}
        self._replaced: dict[int, dict[str, object]] = {}   # id(module) -> {name: the module's own callable}

    def set_up_done(self, model: nn.Module) -> None:
        """Compare each module with its snapshot: what is new is the engine's."""
        for m in model.modules():
            hooks_before, attrs_before = self._before.get(id(m), ({}, {}))
            hooks = {name: set(d) - hooks_before.get(name, set()) for name, d in _hook_dicts(m).items()}
            attrs = _own_attributes(m)
            self._added[id(m)] = ({k: v for k, v in hooks.items() if v}, set(attrs) - set(attrs_before))
            replaced = {name: own for name, own in attrs_before.items()
                        if callable(own) and name in attrs and attrs[name] is not own}
            if replaced:
                self._replaced[id(m)] = replaced
        self._before = {}

    def copy_module(self, model: nn.Module, root: nn.Module, memo: dict,
                    weight_of: Callable[[torch.Tensor], tuple[torch.Tensor, bool]],
                    devices: dict[tuple[int, str], torch.device]) -> nn.Module:
        """A deep copy of ``root`` (``model`` or one of its modules) without what the engine added: each
        parameter a new one of its class from ``weight_of(parameter)`` (its fp32 master, or itself, and whether
        its values are here), floating point ones in fp32, on ``devices`` ((id of module, name) -> the device it
        was given on). Nothing shared is changed meanwhile (another thread may copy too): the state of this copy
        lives in ``memo``."""

        def weight(m: nn.Module, name: str, p: torch.Tensor) -> torch.Tensor:
            return _copied(*weight_of(p), p, devices.get((id(m), name), p.device))

        everything = list(model.modules())   # root's copy may reach the rest of the model (a hook of its own)
        for m in everything:   # the engine's attachments copy as a placeholder, removed below
            hooks, attrs = self._added.get(id(m), ({}, set()))
            for name, keys in hooks.items():
                table = getattr(m, name)
                for key in keys & set(table):
                    memo.setdefault(id(table[key]), _STRIPPED)
            for name in (attrs | set(self._replaced.get(id(m), ())) | set(_INSTALLED)) & set(vars(m)):
                memo.setdefault(id(vars(m)[name]), _STRIPPED)
        made = memo.setdefault(_MADE, set())   # the parameters this copy made, over nested calls
        for m in root.modules():   # parameters and buffers: the engine's weights, copied once each
            for name, p in m._parameters.items():
                if p is None or id(p) in memo:
                    continue
                memo[id(p)] = _parameter_like(p, weight(m, name, p))
                made.add(id(memo[id(p)]))
            for name, b in m._buffers.items():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = b.detach().to(devices.get((id(m), name), b.device), copy=True)
        outermost = _COPYING not in memo
        memo[_COPYING] = True   # the modules reached from here copy the ordinary way (_DeepcopyThroughEngine)
        try:
            out = _plain_copy(root, memo)
        finally:
            if outermost:
                del memo[_COPYING]
        # a parameter the copy reached before its module (a list holding it first) was copied as it is: the
        # compute copy, in bf16 where that is the training precision; it takes the weight here, in place
        for m in everything:
            for name, p in m._parameters.items():
                twin = memo.get(id(p)) if p is not None else None
                if isinstance(twin, torch.Tensor) and id(twin) not in made:
                    with torch.no_grad():
                        twin.data = weight(m, name, p)
                    made.add(id(twin))
        for m in everything:
            twin = memo.get(id(m))
            if not isinstance(twin, nn.Module):
                continue
            for table in _hook_dicts(twin).values():
                for key in [k for k, v in table.items() if v is _STRIPPED]:
                    del table[key]
            for name in [k for k, v in vars(twin).items() if v is _STRIPPED]:
                delattr(twin, name)
            for name, own in self._replaced.get(id(m), {}).items():   # a method bound to m: to its twin
                setattr(twin, name, copy.deepcopy(own, memo))
        return out


def _plain_copy(x: nn.Module, memo: dict) -> nn.Module:
    """What ``copy.deepcopy`` does for an object without ``__deepcopy__`` (here: with one of ours, bypassed)."""
    return copy._reconstruct(x, memo, *type(x).__reduce_ex__(x, 4))   # the class's: not ours (_PickleThroughEngine)


def _copied(value: torch.Tensor, here: bool, p: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not here:   # outside the engine's _whole(): cannot happen there
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has its values on another rank")
    dtype = torch.float32 if value.is_floating_point() else value.dtype   # as destroy() hands them back
    return value.detach().to(device=device, dtype=dtype, copy=True)


def _parameter_like(p: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A parameter of ``p``'s class (a subclass of the user's, where it builds from data and requires_grad)."""
    try:
        return type(p)(value, requires_grad=p.requires_grad)
    except TypeError:
        return nn.Parameter(value, requires_grad=p.requires_grad)


class _DeepcopyThroughEngine:
    """``module.__deepcopy__`` for each module of the model: deepcopy of it asks the engine (held weakly: a
    model outlives an engine that was not destroyed); inside the engine's copy, an ordinary copy."""

    def __init__(self, copy_fn: Callable[[nn.Module, dict], nn.Module], module: nn.Module):
        self._copy = weakref.WeakMethod(copy_fn)
        self._module = weakref.ref(module)

    def live_engine(self):
        """The engine, unless it is gone or destroyed."""
        copy_fn = self._copy()
        engine = copy_fn.__self__ if copy_fn is not None else None
        return engine if engine is not None and not vars(engine).get("_destroyed", False) else None

    def __call__(self, memo: dict) -> nn.Module:
        copy_fn, module = self._copy(), self._module()
        if module is not None and memo.get(_COPYING):
            return _plain_copy(module, memo)
        if copy_fn is None or module is None:
            raise RuntimeError("this model's LazyTrain engine is gone without destroy(); copy or save the model "
                               "from its state_dict instead")
        return copy_fn(module, memo)


class _PickleThroughEngine:
    """``module.__reduce_ex__`` for each module of the model (pickle, like deepcopy, looks it up on the instance):
    pickling the module pickles its plain copy (``torch.save(engine.module)``, as DeepSpeed's module allows).
    The copy is made whole first, so it costs the module's size in fp32 while it is written. A pickle holding a
    module and one of its modules beside it (``[model, model.head]``) loads two copies that share nothing.
    ``copy.copy`` looks ``__reduce_ex__`` up on the instance too: it gets the class's, a shallow copy as for
    any module."""

    def __init__(self, deepcopy: _DeepcopyThroughEngine):
        self._deepcopy = deepcopy

    def __call__(self, protocol: int):
        module = self._deepcopy._module()
        if module is not None and sys._getframe(1).f_code is copy.copy.__code__:
            return type(module).__reduce_ex__(module, protocol)
        plain = self._deepcopy({})
        popen = multiprocessing.context.get_spawning_popen()
        if popen is not None:   # a new process started with the model: its tensors' shared memory is passed by
            # file descriptors that must stay open until the child has them; the copy lives as long as the process
            vars(popen).setdefault("_lazytrain_model_copies", []).append(plain)
        return type(plain).__reduce_ex__(plain, protocol)


# the instance attributes install() sets on each module, and the class of each
_INSTALLED = {"__deepcopy__": _DeepcopyThroughEngine, "__reduce_ex__": _PickleThroughEngine}


def install(model: nn.Module, copy_fn: Callable[[nn.Module, dict], nn.Module]) -> list:
    """``copy.deepcopy`` of the model or any of its modules calls ``copy_fn(module, memo)`` (``copy.deepcopy``
    looks ``__deepcopy__`` up on the instance first), and pickling one pickles that copy. Returns the modules
    given them (weakly), for :func:`uninstall`: a module the script takes out of the model later is among them."""
    patched = []
    for m in model.modules():
        deepcopy = _DeepcopyThroughEngine(copy_fn, m)
        object.__setattr__(m, "__deepcopy__", deepcopy)
        object.__setattr__(m, "__reduce_ex__", _PickleThroughEngine(deepcopy))
        patched.append(weakref.ref(m))
    return patched


def engine_of(model: nn.Module):
    """The live engine (not destroyed) that trains this model or a module of it, or None: a notebook that lost
    its handle on one (a cell that failed after ``initialize``) reaches it here to ``destroy()`` it."""
    engines = engines_of(model)
    return engines[0] if engines else None


def engines_of(model: nn.Module) -> list:
    """Every live engine on this model or modules of it (several: engines on separate parts of a container)."""
    found = {}
    for m in model.modules():
        copier = vars(m).get("__deepcopy__")
        engine = copier.live_engine() if isinstance(copier, _DeepcopyThroughEngine) else None
        if engine is not None:
            found.setdefault(id(engine), engine)
    return list(found.values())


def uninstall(patched: list) -> None:
    """Removes what :func:`install` set, and only that (a script's own ``__deepcopy__`` stays)."""
    for ref in patched:
        m = ref()
        if m is None:
            continue
        for name, kind in _INSTALLED.items():
            if isinstance(vars(m).get(name), kind):
                del vars(m)[name]
