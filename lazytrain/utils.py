"""DeepSpeed's ``deepspeed.utils`` accessors for what the engine keeps of a parameter away from it, and its
``RepeatingLoader``.

    from lazytrain.utils import safe_get_full_grad
    engine.backward(loss)
    norms = {n: safe_get_full_grad(p).norm() for n, p in model.named_parameters() if p.requires_grad}

Between ``backward`` and ``step`` a parameter's ``.grad`` may be ``None`` where the engine accumulates it
elsewhere (the embedding's and head's fp32 masters on the host, the default on a GPU), as under DeepSpeed's
ZeRO; these read it (and set it, with the weight and the optimizer state) wherever it is. Each returns a copy
in fp32 on the host, waiting first for what is in flight (gradient copies, an overlapped update): call them
from the training thread. With
:func:`lazytrain.replace_deepspeed` DeepSpeed's own names answer for LazyTrain's parameters too (a name
imported from ``deepspeed.utils`` before that call is DeepSpeed's own). Over several ranks every rank calls
them, as under DeepSpeed's ZeRO: the gradient is the one ``step()`` applies, averaged over the ranks; the weight
and optimizer state come from the rank that holds them; a set checks that every rank passes the same value."""
from __future__ import annotations

__all__ = ["safe_get_full_grad", "safe_set_full_grad", "safe_get_full_fp32_param", "safe_set_full_fp32_param",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "RepeatingLoader"]

from .data.loader import RepeatingLoader  # noqa: E402  (deepspeed.utils.RepeatingLoader)


def _owner(param, name: str):
    from .engine import param_access
    engine = param_access.owner_of(param)
    if engine is None:
        raise ValueError(f"lazytrain.utils.{name}: the parameter (shape {tuple(param.shape)}) belongs to no live "
                         f"LazyTrain engine: pass a parameter of the model given to lazytrain.initialize, before "
                         f"engine.destroy()")
    return param_access, engine


def safe_get_full_grad(param):
    """``param``'s fp32 gradient accumulated for the coming ``step()`` (in fp16, multiplied by the loss scale,
    as DeepSpeed's), or None where none is (a frozen parameter; an embedding or head before a backward and
    after ``step()``). A streamed block's gradient lives in a buffer that ``step()`` zeroes: zeros then. A
    trainable parameter the backwards since the last step did not reach has a zero gradient, as in DeepSpeed
    (and the step applies it as such)."""
    access, engine = _owner(param, "safe_get_full_grad")
    return access.full_grad(engine, param)


def safe_set_full_grad(param, value):
    """Set the gradient the coming ``step()`` applies to ``param`` to ``value`` (a tensor of ``param``'s shape;
    in fp16 multiplied by the loss scale, as :func:`safe_get_full_grad` reads it), as DeepSpeed's does. Over
    several ranks every rank passes the same value, and the step applies it (averaged over equal values)."""
    access, engine = _owner(param, "safe_set_full_grad")
    access.set_full_grad(engine, param, value)


def safe_get_full_fp32_param(param):
    """The fp32 weight the optimizer updates for ``param`` (its master), once an overlapped update landed;
    None for a frozen parameter (nothing updates it), as DeepSpeed's."""
    access, engine = _owner(param, "safe_get_full_fp32_param")
    return access.full_fp32_param(engine, param)


def safe_set_full_fp32_param(param, value):
    """Set ``param``'s fp32 weight (its master) and every copy of it that computes to ``value`` (a tensor of
    ``param``'s shape), as DeepSpeed's does: the way to change a weight after ``initialize`` (a write to a
    parameter outside the blocks itself reaches only the copy that computes, in bf16/fp16 or on a GPU, and the
    next step undoes it; a block parameter's reaches the next forward). Every streamed layer's compute copy is
    rewritten, as by a checkpoint load."""
    access, engine = _owner(param, "safe_set_full_fp32_param")
    access.set_full_fp32_param(engine, param, value)


def safe_get_full_optimizer_state(param, optim_state_key: str):
    """The optimizer's ``optim_state_key`` ("exp_avg", "exp_avg_sq") for ``param`` in fp32 and its shape
    (HybridAdamW's 8-bit moments dequantized), or None before the first step; a key the optimizer does not
    keep raises ValueError, as DeepSpeed's."""
    access, engine = _owner(param, "safe_get_full_optimizer_state")
    return access.full_optimizer_state(engine, param, optim_state_key)


def safe_set_full_optimizer_state(param, value, optim_state_key: str):
    """Set the optimizer's ``optim_state_key`` ("exp_avg", "exp_avg_sq") for ``param`` to ``value`` (a tensor
    of ``param``'s shape; HybridAdamW's 8-bit moments quantized as a step requantizes them), as DeepSpeed's
    does; refused before the first step, when there is no state to set."""
    access, engine = _owner(param, "safe_set_full_optimizer_state")
    access.set_full_optimizer_state(engine, param, value, optim_state_key)
