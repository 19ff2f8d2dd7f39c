"""A model parameter's full fp32 gradient, weight and optimizer state, wherever the engine keeps them.

LazyTrain keeps a parameter's training state away from the parameter a script holds: the embedding's and
head's gradients accumulate in fp32 masters (on the host by default, so ``p.grad`` of the copy that computes
is ``None``), 8-bit moments are codes. DeepSpeed's answer to the same problem is ``deepspeed.utils``'
``safe_get_full_grad`` / ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``; ``lazytrain.utils``
offers them with DeepSpeed's signatures, answered here by the engine that owns the parameter.

Live engines are found through a weak set (an engine registers when set up, leaves when destroyed), so the
functions take the parameter alone, as DeepSpeed's do."""
from __future__ import annotations

import threading
import weakref

import torch

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def register(engine) -> None:
    _ENGINES.add(engine)


def unregister(engine) -> None:
    _ENGINES.discard(engine)


def owner_of(param: torch.Tensor):
    """The live engine training ``param`` (a parameter of its model, an fp32 master it gave one, or a tensor
    the script added to its optimizer, such as a loss's learnable temperature), or None."""
    engines = list(_ENGINES)
    for engine in engines:
        if id(param) in engine._model_param_ids:   # registered once set up: it has them
            return engine
    for engine in engines:
        if any(t is param for t in engine._extra_params()):
            return engine
    return None


def _refuse(engine, what: str) -> None:
    """What the accessors cannot answer: another thread's call (the gradient sinks and the update thread are
    waited on by the thread that trains), and state that may be on another rank."""
    if threading.get_ident() != engine._setup_thread:
        raise RuntimeError(f"lazytrain.utils.{what} was called from a thread other than the one that set up the "
                           f"engine: it waits for the gradient copies and the overlapped update, which only the "
                           f"training thread may do; call it from the training loop")
    if engine.world_size > 1:
        raise NotImplementedError(
            f"lazytrain.utils.{what} over {engine.world_size} ranks is not implemented: the parameter's state may "
            f"live on another rank (ZeRO stages 1-3) and assembling it is a collective LazyTrain does not offer "
            f"yet; read it in one process, or from engine.module_state_dict() / a saved checkpoint")


def _master(engine, param: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor the optimizer updates for ``param``: its master outside the blocks in mixed precision
    (or in fp32 beside a GPU), else the parameter itself (a block parameter is its host master)."""
    return engine.masters.master_of(param) if engine.masters is not None else param


def full_grad(engine, param: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``param``'s gradient as accumulated for the coming ``step()`` (fp32, on the host where the
    engine keeps it; in fp16 multiplied by the loss scale, as DeepSpeed's); None before any backward reached
    it, for a frozen parameter, and after ``step()``/``zero_grad()``. Waits for gradients still in flight."""
    _refuse(engine, "safe_get_full_grad")
    engine.wait_for_update()              # the overlapped update reads and then zeroes the layers' gradients
    engine.weights.flush_grads()          # a copy that failed raises here, as at step()
    if engine.masters is not None:
        engine.masters.flush_grads()
    layer_grad = engine._block_grad_view(param)
    if layer_grad is not None:
        return layer_grad.detach().clone()
    grad = _master(engine, param).grad
    return None if grad is None else grad.detach().to("cpu", torch.float32, copy=True)


def full_fp32_param(engine, param: torch.Tensor) -> torch.Tensor | None:
    """A copy of the fp32 weight the optimizer updates for ``param`` (its master), on the host, once an
    overlapped update has landed; None for a frozen parameter, which nothing updates (as DeepSpeed's)."""
    _refuse(engine, "safe_get_full_fp32_param")
    if not param.requires_grad:
        return None
    engine.wait_for_update()
    return _master(engine, param).detach().to("cpu", torch.float32, copy=True)


def set_full_fp32_param(engine, param: torch.Tensor, value) -> None:
    """Write ``value`` (``param``'s shape) as ``param``'s fp32 weight and into every copy of it that computes,
    as a checkpoint load writes them: a write to the parameter itself would reach only one of them in bf16/fp16
    (a block parameter is a view of its master, whose compute copy the next forward does not read; an embedding
    or head is its compute copy, whose master the next step writes back over it)."""
    _refuse(engine, "safe_set_full_fp32_param")
    value = torch.as_tensor(value)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"lazytrain.utils.safe_set_full_fp32_param: the value's shape {tuple(value.shape)} is not "
                         f"the parameter's {tuple(param.shape)}")
    if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
        raise ValueError("lazytrain.utils.safe_set_full_fp32_param: the value must be floating point and finite")
    name = engine._module_param_name(param)
    if name is not None:   # the module's own: as a load_state_dict of that one name (hooks write masters and copies)
        engine._load_module_state({name: value.detach().to("cpu", torch.float32)}, strict=False)
        return
    engine.wait_for_update()   # a tensor the script added to the optimizer: it is its own copy, or beside a master
    master = _master(engine, param)
    with torch.no_grad():
        master.copy_(value)
        if master is not param:
            param.copy_(value)


def full_optimizer_state(engine, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """A copy of the optimizer's state ``key`` ("exp_avg", "exp_avg_sq", ...) for ``param``, in fp32 and in
    the parameter's shape (8-bit moments dequantized), on the host; None before the first step and for a
    frozen parameter. A key the optimizer does not keep is refused, naming those it keeps (as DeepSpeed's)."""
    _refuse(engine, "safe_get_full_optimizer_state")
    engine.wait_for_update()
    opt = engine.optimizer
    if opt is None:
        return None
    master = _master(engine, param)
    state = opt.state.get(master)
    if not state:
        return None
    if type(opt).__name__ == "HybridAdamW":
        if key in ("exp_avg", "exp_avg_sq"):
            return torch.cat(list(opt.fp32_moment_chunks(master, key))).reshape(master.shape)
        keys = ["exp_avg", "exp_avg_sq"]
    else:
        keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape]
    if key not in keys:
        raise ValueError(f"lazytrain.utils.safe_get_full_optimizer_state: {type(opt).__name__} keeps no state "
                         f"{key!r} of this parameter's shape; it keeps {', '.join(map(repr, keys)) or 'none'}")
    return state[key].detach().to("cpu", torch.float32, copy=True)
