"""A model parameter's full fp32 gradient, weight and optimizer state, wherever the engine keeps them.

LazyTrain keeps a parameter's training state away from the parameter a script holds: the embedding's and
head's gradients accumulate in fp32 masters (on the host by default, so ``p.grad`` of the copy that computes
is ``None``), 8-bit moments are codes. DeepSpeed's answer to the same problem is ``deepspeed.utils``'
``safe_get_full_grad`` / ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``; ``lazytrain.utils``
offers them with DeepSpeed's signatures, answered here by the engine that owns the parameter.

Live engines are found through a weak set (an engine registers when set up, leaves when destroyed), so the
functions take the parameter alone, as DeepSpeed's do.

Over several ranks with the state shared out (``zero_optimization.stage`` >= 1), a weight's fp32 master and
its optimizer state live on one rank: reading them is a broadcast from it, and a set is checked to carry the
same value on every rank, so every rank calls them, as DeepSpeed's (a call on some ranks only fails at once,
naming itself: distributed.py's ``CallOrder``). The gradient is the one ``step()`` applies, averaged over the
ranks: each rank's share summed."""
from __future__ import annotations

import threading
import weakref

import torch

from .distributed import RankFailure

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


def _refuse_other_threads(engine, what: str) -> None:
    """The accessors wait for the gradient sinks and the update thread, which only the thread that trains may."""
    if threading.get_ident() != engine._setup_thread:
        raise RuntimeError(f"lazytrain.utils.{what} was called from a thread other than the one that set up the "
                           f"engine: it waits for the gradient copies and the overlapped update, which only the "
                           f"training thread may do; call it from the training loop")


def _held_by(engine, param: torch.Tensor) -> int | None:
    """The rank that holds ``param``'s fp32 master and optimizer state where the ranks share the state out
    (``zero_optimization.stage`` >= 1 over several ranks: sharding.py), so that reading them is a broadcast
    from it that every rank makes; None where every rank holds them (one rank, stage 0, a tensor added to
    the optimizer after the ranks shared it out)."""
    if engine.shards is None:
        return None
    return engine.shards.param_owner.get(id(_master(engine, param)))


def _shape(engine, param: torch.Tensor) -> tuple[int, ...]:
    """``param``'s shape on every rank (at stage 3 a parameter another rank owns is a placeholder here)."""
    with engine._shapes_only():
        return tuple(param.shape)


def _call(engine, function: str, param: torch.Tensor, *more: str) -> str:
    """``function``'s call as the ranks compare it before its collectives (CallOrder.together): naming the
    parameter (and the state key), so that ranks passing different ones fail at once, naming both, instead of
    pairing their broadcasts up wrongly. A parameter or its fp32 master goes by the model's name for it; a
    tensor the script added to the optimizer by its place among them (the same list on every rank)."""
    name = engine._param_names.get(id(param))
    if name is not None:
        what = repr(name)
    else:
        index = next((i for i, t in enumerate(engine._extra_params()) if t is param), None)
        what = f"the optimizer's tensor {index} outside the model, of shape {_shape(engine, param)}"
    return f"lazytrain.utils.{function}({', '.join([what, *more])})"


class _Failed(tuple):
    """What another rank hears of this rank's failed attempt: (exception type name, message, whether it was a
    ValueError, which the accessors raise as the value's refusal)."""


def _told_by_every_rank(engine, attempt, summary, what: str) -> tuple[object, list]:
    """``attempt()`` here, and by rank what every rank's gave: ``summary(result)``, or a :class:`_Failed`.
    A rank whose attempt failed raises its exception here as it was, after the others heard of it (else they
    would wait for it in the collective that follows until the timeout)."""
    result, failure = None, None
    try:
        result = attempt()
    except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here as it is
        failure = e
    told = summary(result) if failure is None else \
        _Failed((type(failure).__name__, str(failure), isinstance(failure, ValueError)))
    told = engine.dist.all_gather_object(told, what)
    if failure is not None:
        raise failure
    return result, told


def _from_holder(engine, param: torch.Tensor, holder: int, call: str, answer):
    """Every rank's copy of what rank ``holder`` answers for ``param``: ``answer()`` there (a contiguous fp32
    host tensor of the parameter's shape, None, or a ValueError, raised on every rank); a collective every
    rank makes, once every rank has arrived at it (a call on some ranks only fails at once, naming it)."""
    engine.dist.calls.together(call, engine.micro_steps)
    engine.wait_for_update()
    mine, told = _told_by_every_rank(engine, answer if engine.global_rank == holder else lambda: None,
                                     lambda value: value is not None, f"{call}: what the rank that holds it answers")
    told = told[holder]
    if isinstance(told, _Failed):
        name, message, refused = told
        raise ValueError(message) if refused else RuntimeError(f"{call}: rank {holder}, which holds the parameter's "
                                                               f"state, failed: {name}: {message}")
    if not told:
        return None
    value = mine if mine is not None else torch.empty(_shape(engine, param), dtype=torch.float32)
    engine.dist.broadcast_from([value], holder, what=f"{call}: the broadcast from the rank that holds it (every "
                               f"rank must call it, as in DeepSpeed)")
    return value


def _master(engine, param: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor the optimizer updates for ``param``: its master outside the blocks in mixed precision
    (or in fp32 beside a GPU), else the parameter itself (a block parameter is its host master)."""
    return engine.masters.master_of(param) if engine.masters is not None else param


def full_grad(engine, param: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``param``'s gradient as accumulated for the coming ``step()`` (fp32, on the host where the
    engine keeps it; in fp16 multiplied by the loss scale, as DeepSpeed's); zeros where a backward ran and did
    not reach it; None before any backward, for a frozen parameter, and after ``step()``/``zero_grad()``. Waits
    for gradients still in flight. Over several ranks, the gradient averaged over them, as ``step()`` applies it: every rank must call it."""
    _refuse_other_threads(engine, "safe_get_full_grad")
    if engine.world_size > 1:
        return _grad_over_ranks(engine, param)
    engine.wait_for_update()              # the overlapped update reads and then zeroes the layers' gradients
    engine.weights.flush_grads()          # a copy that failed raises here, as at step()
    if engine.masters is not None:
        engine.masters.flush_grads()
    layer_grad = engine._block_grad_view(param)
    if layer_grad is not None:
        return layer_grad.detach().clone()
    grad = _unreached_as_zeros(engine, param, _master(engine, param))
    return None if grad is None else grad.detach().to("cpu", torch.float32, copy=True)


def _unreached_as_zeros(engine, param: torch.Tensor, holder: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``holder`` (``param``'s master, or itself) has; zeros where it is a trainable model
    parameter and has none although a backward ran since the gradients were zeroed (a head the loss did not
    use), as DeepSpeed's flat buffers give it and as the step applies it; None before any backward, and for a
    tensor the script added to the optimizer (plain PyTorch's rule, which the step keeps for it)."""
    if holder.grad is not None or not holder.requires_grad or not engine.backward_since_zeroed() or \
            id(param) not in engine._model_param_ids:   # a tensor the script added: none, as the step has it
        return holder.grad
    return torch.zeros(_shape(engine, param), dtype=torch.float32)


def _grad_over_ranks(engine, param: torch.Tensor) -> torch.Tensor | None:
    """The gradient averaged over the ranks as ``step()`` averages it (in the communication dtype, then fp32):
    a collective every rank makes, once every rank has arrived at it; None where no rank holds one."""
    if not param.requires_grad:
        return None
    call = _call(engine, "safe_get_full_grad", param)
    engine.dist.calls.together(call, engine.micro_steps)
    (grad, reduced), told = _told_by_every_rank(engine, lambda: _grad_here(engine, param),
                                                lambda here: here[0] is not None,
                                                f"{call}: which ranks hold a gradient of it")
    failed = next(((r, t) for r, t in enumerate(told) if isinstance(t, _Failed)), None)
    if failed is not None:
        rank, (name, message, _) = failed
        raise RuntimeError(f"{call}: rank {rank} could not read its gradient: {name}: {message}")
    if not any(told):
        return None
    total = grad if grad is not None else torch.zeros(_shape(engine, param), dtype=torch.float32)
    what = f"{call}: the gradient's sum over the ranks (every rank must call it, as in DeepSpeed)"
    if reduced:   # the owner holds the average, the others nothing
        engine.dist.sum_into(total, what)
    else:         # each holds its own micro-batches' sum: averaged as step() averages it
        engine.dist.average([total], [], what)
    return total


def _grad_here(engine, param: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """A copy of ``param``'s gradient on this rank (fp32, contiguous, on the host) or None where it holds
    none, and whether it was reduced to its owner already: each micro-batch's as it landed (stage >= 2: the
    streamed layers; stage 3: the partitioned parameters), the same for every rank; else each rank holds
    the sum of its own micro-batches' until ``step()`` reduces it. Waits for what is in flight first (a
    copy that failed raises, as at ``step()``)."""
    engine.wait_for_update()
    engine.weights.flush_grads()          # at stage >= 2 the layers' reduces to their owners complete here
    if engine.masters is not None:
        engine.masters.flush_grads()
    w = engine.weights
    layer = engine._layer_of_param.get(id(param))
    if layer is not None:
        reduced = w.grads_to_owners
        if w.grad[layer] is None:   # another rank's layer: its gradients went to the owner as they landed
            return None, reduced
        grad = _layer_grad(w, layer, param)
    else:
        holder = _master(engine, param)
        grad, reduced = _unreached_as_zeros(engine, param, holder), engine._partitioned(holder)
    return (None if grad is None else grad.detach().to("cpu", torch.float32, copy=True).contiguous()), reduced


def _layer_grad(w, layer: int, param: torch.Tensor) -> torch.Tensor:
    """``param``'s view in streamed layer ``layer``'s flat fp32 gradient buffer (held on this rank)."""
    return next(s for s, p in zip(w.layer_slots[layer], w.params[layer]) if p is param).of(w.grad[layer])


def full_fp32_param(engine, param: torch.Tensor) -> torch.Tensor | None:
    """A copy of the fp32 weight the optimizer updates for ``param`` (its master), on the host, once an
    overlapped update has landed; None for a frozen parameter, which nothing updates (as DeepSpeed's). Where
    the ranks share the state out, the rank that holds it sends it: every rank must call it, as in DeepSpeed."""
    _refuse_other_threads(engine, "safe_get_full_fp32_param")
    if not param.requires_grad:
        return None

    def answer() -> torch.Tensor:
        return _master(engine, param).detach().to("cpu", torch.float32, copy=True)
    holder = _held_by(engine, param)
    if holder is None:
        engine.wait_for_update()
        return answer()
    return _from_holder(engine, param, holder, _call(engine, "safe_get_full_fp32_param", param), answer)


def set_full_fp32_param(engine, param: torch.Tensor, value) -> None:
    """Write ``value`` (``param``'s shape) as ``param``'s fp32 weight and into every copy of it that computes,
    as a checkpoint load writes them: a write to the parameter itself would reach only one of them in bf16/fp16
    (a block parameter is a view of its master, whose compute copy the next forward does not read; an embedding
    or head is its compute copy, whose master the next step writes back over it). Over several ranks every rank
    calls it with the same value (checked: else the ranks' copies of the weight would differ); a value one
    rank refuses is refused on every rank, so that the ranks' calls stay paired."""
    _refuse_other_threads(engine, "safe_set_full_fp32_param")
    if engine.world_size > 1:
        engine.dist.calls.together(_call(engine, "safe_set_full_fp32_param", param), engine.micro_steps)
    value = _fit_on_every_rank(engine, "safe_set_full_fp32_param", lambda: _checked_value(engine, param, value))
    if engine._partitioned(param):   # stage 3 outside the blocks: each rank writes the copies it holds
        engine.wait_for_update()
        engine.partitioned.write(param, value)
        engine.executor.weights_changed()   # a pending backward is refused, as after a load at any stage
        return
    name = engine._param_names.get(id(param))   # a parameter, or its fp32 master (from the optimizer's groups)
    if name is not None:   # the module's own: as a load_state_dict of that one name (hooks write masters and copies),
        # where its copies are (a master by its owner), without gathering anything
        engine._load_module_state({name: value}, strict=False, gather=False)
        return
    engine.wait_for_update()   # a tensor the script added to the optimizer: it is its own copy, or beside a master
    master = _master(engine, param)
    with torch.no_grad():
        master.copy_(value)
        if master is not param:
            param.copy_(value)


def _checked_value(engine, param: torch.Tensor, value, function: str = "safe_set_full_fp32_param") -> torch.Tensor:
    """``value`` as the fp32 host tensor a set writes; a ValueError says why it is refused."""
    value = torch.as_tensor(value)
    shape = _shape(engine, param)
    if tuple(value.shape) != shape:
        raise ValueError(f"lazytrain.utils.{function}: the value's shape {tuple(value.shape)} is not the "
                         f"parameter's {shape}")
    if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
        raise ValueError(f"lazytrain.utils.{function}: the value must be floating point and finite")
    return value.detach().to("cpu", torch.float32).contiguous()


def _refuse_values_that_differ(engine, value: torch.Tensor, function: str = "safe_set_full_fp32_param") -> None:
    """Every rank has rank 0's value, bit for bit (-0.0 is not 0.0): a write of different values would leave
    the ranks' copies of one weight (or state, or gradient) different (at stage 0 each rank writes its own
    replica; above it the owner writes the master, every rank its compute copy), and training would go on
    silently diverged."""
    first = value.clone() if engine.global_rank == 0 else torch.empty(value.shape, dtype=torch.float32)
    call = f"lazytrain.utils.{function}()"
    engine.dist.broadcast_from([first], 0, what=f"{call}: rank 0's value, to compare (every rank must call it)")
    same = torch.equal(first.view(torch.int32), value.view(torch.int32))
    if not engine.dist.all_succeeded(same, f"{call}: agreement that every rank passed the same value"):
        what = {"safe_set_full_grad": "gradient", "safe_set_full_optimizer_state": "state"}.get(function, "weight")
        raise ValueError(f"lazytrain.utils.{function} over {engine.world_size} ranks: the ranks passed different "
                         f"values (rank 0's differs from another's); every rank must pass the same value, else the "
                         f"ranks' copies of the {what} would differ. Nothing was written")


def _fit_on_every_rank(engine, function: str, check) -> torch.Tensor:
    """``check()`` (the value a set writes, or a ValueError) on every rank; a value one rank refuses is refused
    on every rank, so that the ranks' calls stay paired, and one that differs between the ranks too."""
    unfit = RankFailure(engine.dist)
    value = None
    with unfit.kept():
        value = check()
    unfit.agree(f"lazytrain.utils.{function}(): agreement that every rank's value is fit",
                ValueError(f"lazytrain.utils.{function} over {engine.world_size} ranks: another rank's value was "
                           f"refused (its error says why). Nothing was written"))
    if engine.world_size > 1:
        _refuse_values_that_differ(engine, value, function)
    return value


def full_optimizer_state(engine, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """A copy of the optimizer's state ``key`` ("exp_avg", "exp_avg_sq", ...) for ``param``, in fp32 and in
    the parameter's shape (8-bit moments dequantized), on the host; None before the first step and for a
    frozen parameter. A key the optimizer does not keep is refused, naming those it keeps (as DeepSpeed's)."""
    _refuse_other_threads(engine, "safe_get_full_optimizer_state")
    if engine.basic_optimizer is None:
        return None
    holder = _held_by(engine, param)
    if holder is None:
        engine.wait_for_update()
        return _optimizer_state_here(engine, param, key)
    return _from_holder(engine, param, holder, _call(engine, "safe_get_full_optimizer_state", param, repr(key)),
                        lambda: _optimizer_state_here(engine, param, key))


def _optimizer_state_here(engine, param: torch.Tensor, key: str) -> torch.Tensor | None:
    opt = engine.basic_optimizer
    master = _master(engine, param)
    state = opt.state.get(master)
    if not state:
        return None
    _refuse_unkept_key(opt, state, master, key, "safe_get_full_optimizer_state")
    if type(opt).__name__ == "HybridAdamW":
        chunks = list(opt.fp32_moment_chunks(master, key))   # none for an empty parameter
        return (torch.cat(chunks) if chunks else torch.zeros(0)).reshape(master.shape)
    return state[key].detach().to("cpu", torch.float32, copy=True)


def _refuse_unkept_key(opt, state: dict, master: torch.Tensor, key: str, function: str) -> None:
    """A state the optimizer keeps for ``master`` in its shape (HybridAdamW's moments whatever their kind),
    or a ValueError naming those it keeps (as DeepSpeed's)."""
    keys = ["exp_avg", "exp_avg_sq"] if type(opt).__name__ == "HybridAdamW" else \
        [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape]
    if key not in keys:
        raise ValueError(f"lazytrain.utils.{function}: {type(opt).__name__} keeps no state {key!r} of this "
                         f"parameter's shape; it keeps {', '.join(map(repr, keys)) or 'none'}")


def set_full_optimizer_state(engine, param: torch.Tensor, value, key: str) -> None:
    """Write ``value`` (``param``'s shape) as the optimizer's state ``key`` for ``param`` (8-bit moments
    quantized as a step requantizes them), as DeepSpeed's ``safe_set_full_optimizer_state``. Refused before
    the first step (no state yet), for a frozen parameter, for a key the optimizer does not keep, and for a
    negative ``exp_avg_sq`` (its square root would make the update NaN). Over several ranks every rank calls
    it with the same value; the rank that holds the state writes it."""
    function = "safe_set_full_optimizer_state"
    _refuse_other_threads(engine, function)
    if engine.world_size > 1:
        engine.dist.calls.together(_call(engine, function, param, repr(key)), engine.micro_steps)
    engine.wait_for_update()
    holder = _held_by(engine, param)
    here = holder is None or holder == engine.global_rank
    opt, master = engine.basic_optimizer, _master(engine, param)

    def check() -> torch.Tensor:
        checked = _checked_value(engine, param, value, function)
        if opt is None or not param.requires_grad:
            raise ValueError(f"lazytrain.utils.{function}: "
                             + ("the engine has no optimizer" if opt is None else "the parameter is frozen: the "
                                "optimizer keeps no state of it"))
        if here:
            state = opt.state.get(master)
            if not state:
                raise ValueError(f"lazytrain.utils.{function}: the optimizer has no state of this parameter before "
                                 f"its first step")
            _refuse_unkept_key(opt, state, master, key, function)
        if key == "exp_avg_sq" and bool((checked < 0).any()):
            raise ValueError(f"lazytrain.utils.{function}: 'exp_avg_sq' must be >= 0 (Adam divides by its square "
                             f"root)")
        return checked
    checked = _fit_on_every_rank(engine, function, check)
    if not here:
        return
    with torch.no_grad():
        if type(opt).__name__ == "HybridAdamW":
            opt.set_fp32_moment(master, key, checked)
        else:
            opt.state[master][key].copy_(checked)


def set_full_grad(engine, param: torch.Tensor, value) -> None:
    """Write ``value`` (``param``'s shape) as the gradient the coming ``step()`` applies to ``param`` (what
    :func:`full_grad` reads: in fp16 multiplied by the loss scale), as DeepSpeed's ``safe_set_full_grad``.
    Over several ranks every rank calls it with the same value: where each rank holds its own micro-batches'
    sum (which the step averages) every rank writes it, where the gradient was reduced to its owner as it
    landed the owner does."""
    function = "safe_set_full_grad"
    _refuse_other_threads(engine, function)
    if engine.world_size > 1:
        engine.dist.calls.together(_call(engine, function, param), engine.micro_steps)
    engine.wait_for_update()               # the overlapped update reads and then zeroes the layers' gradients
    engine.weights.flush_grads()           # nothing lands after the write
    if engine.masters is not None:
        engine.masters.flush_grads()

    def check() -> torch.Tensor:
        checked = _checked_value(engine, param, value, function)
        if not param.requires_grad:
            raise ValueError(f"lazytrain.utils.{function}: the parameter is frozen: the step applies no gradient "
                             f"to it")
        return checked
    checked = _fit_on_every_rank(engine, function, check)
    engine.note_grads_given()   # a step may follow without a backward; in fp16 the value is a scaled one
    w = engine.weights
    layer = engine._layer_of_param.get(id(param))
    with torch.no_grad():
        if layer is not None:
            if w.grad[layer] is not None:   # else another rank's layer: its owner writes it
                _layer_grad(w, layer, param).copy_(checked)
                w.attach_grads(layer)
            return
        holder = _master(engine, param)
        if engine._grad_kept_by_another_rank(holder):
            return
        if holder.grad is None:
            holder.grad = checked.to(holder.device, holder.dtype)
        else:
            holder.grad.copy_(checked)
