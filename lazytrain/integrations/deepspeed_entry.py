"""DeepSpeed's entry points answered by LazyTrain, for code built on DeepSpeed that a user does not edit.

Hugging Face ``Trainer`` (``TrainingArguments(deepspeed=...)``), ``accelerate`` with a DeepSpeed plugin and
what builds on them (TRL's ``SFTTrainer`` and ``GRPOTrainer`` are tested; under ZeRO-3 a generating trainer
takes the module hooks off that LazyTrain does not have, through the engine optimizer's ``parameter_offload``)
call ``deepspeed.initialize`` themselves. :func:`replace_deepspeed` makes
that call return a :class:`~lazytrain.engine.engine.LazyTrainEngine`, and adjusts the few other places where
that code reaches into DeepSpeed:

- ``deepspeed.DeepSpeedEngine``: what accelerate's ``unwrap_model`` peels off before a save; it answers
  ``isinstance`` for LazyTrain's engines too, so saved weights carry the model's own names (no ``module.``).
- ``deepspeed.zero.Init``: the model is built whole (LazyTrain partitions at ``initialize``, and only at
  stage 3 the parameters outside the streamed blocks). ``deepspeed.zero.GatheredParameters``: gathers those.
- transformers' ZeRO-3 switch (``is_deepspeed_zero3_enabled``): off, so that a model is built whole; otherwise
  ``from_pretrained`` would build the model through DeepSpeed's partitioning.
- ``deepspeed.comm``'s collectives and ``get_rank``: over torch.distributed's group where DeepSpeed's own
  backend was never set up (LazyTrain's ``initialize`` does not set it up; TRL's reference-model sync calls it).

- accelerate's swap of a script's torch optimizer for DeepSpeed's CPU Adam (ZeRO offloading the optimizer, the
  config naming none): the script's optimizer stays.

DeepSpeed itself must be installed (transformers and accelerate check for it before they take this path), but
none of its optimizers or kernels is used (on a CPU, DeepSpeed's process-group set-up, which accelerate calls,
builds its shared-memory communication op once, as it does without LazyTrain). :func:`restore_deepspeed`
undoes all of it.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import threading
import warnings

import torch

_lock = threading.Lock()
_saved: dict | None = None   # what replace_deepspeed changed: (object, attribute) -> original value

INSTALL_HINT = ("LazyTrain takes over DeepSpeed's entry points, so DeepSpeed must be installed (transformers and "
                "accelerate check for it before they use them; none of its optimizers or kernels is used): "
                "pip install 'lazytrain[hf]'")


def replace_deepspeed() -> None:
    """Route ``deepspeed.initialize`` (and what Hugging Face and accelerate reach through it) to LazyTrain,
    for this process. Call it first: before ``TrainingArguments`` or the ``Accelerator``, and before the model
    is built or loaded (under a ZeRO-3 config Hugging Face would otherwise partition it with DeepSpeed's
    ``zero.Init``, which :func:`lazytrain.initialize` then refuses)."""
    global _saved
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    from ..engine.engine import LazyTrainEngine
    from ..engine.initialize import initialize

    with _lock:
        if _saved is not None:
            return
        saved = {}

        def put(obj, name, value):
            saved[(obj, name)] = getattr(obj, name)
            setattr(obj, name, value)

        put(deepspeed, "initialize", _initialize_as_deepspeed_does(initialize))
        put(deepspeed, "DeepSpeedEngine", _engine_type(deepspeed.DeepSpeedEngine, LazyTrainEngine))
        put(deepspeed.zero, "Init", _WholeParameters)
        put(deepspeed.zero, "GatheredParameters", _GatheredParameters)
        _replace_transformers_zero3_switch(put)
        _deepspeed_comm_on_the_process_group(put)
        _keep_the_scripts_optimizer(put)
        _leave_a_plateau_schedule_to_the_trainer(put)
        _keep_accelerate_out_of_our_section(put)
        for name in ("safe_get_full_grad", "safe_set_full_grad", "safe_get_full_fp32_param",
                     "safe_set_full_fp32_param", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state"):
            if hasattr(deepspeed.utils, name):
                put(deepspeed.utils, name, _lazytrain_first(name, getattr(deepspeed.utils, name)))
        _saved = saved


def restore_deepspeed() -> None:
    """Undo :func:`replace_deepspeed`: DeepSpeed's own entry points again."""
    global _saved
    with _lock:
        if _saved is None:
            return
        for (obj, name), value in _saved.items():
            setattr(obj, name, value)
        _saved = None



# deepspeed.comm's functions that code built on DeepSpeed calls after initialize (TRL's reference-model sync and
# transformers' ZeRO-3 weight init call get_rank): its set-up (init_distributed, is_initialized) stays its own
_COMM_ANSWERED = ("get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_backend", "barrier",
                  "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                  "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list")


def _deepspeed_comm_on_the_process_group(put) -> None:
    """``deepspeed.comm``'s functions answer over torch.distributed's group (lazytrain.comm) where DeepSpeed's own
    communication backend was never set up: DeepSpeed's ``initialize`` sets it up, LazyTrain's does not (its
    process group is torch.distributed's), and DeepSpeed's functions then fail ("DeepSpeed backend not set").
    Where it was set up (accelerate's launch on a GPU), they are DeepSpeed's own."""
    import deepspeed.comm
    import deepspeed.comm.comm as backend

    from .. import comm as ours
    for name in _COMM_ANSWERED:
        if hasattr(deepspeed.comm, name):
            put(deepspeed.comm, name, _backend_else_ours(backend, getattr(deepspeed.comm, name), getattr(ours, name)))


def _backend_else_ours(backend, deepspeeds, ours):
    def either(*args, **kwargs):
        if backend.cdb is not None and backend.cdb.is_initialized():
            return deepspeeds(*args, **kwargs)
        return ours(*args, **kwargs)
    either.__name__ = either.__qualname__ = deepspeeds.__name__
    either.__doc__ = deepspeeds.__doc__
    return either


def _lazytrain_first(name: str, deepspeeds):
    """``deepspeed.utils.<name>``: LazyTrain's answer for a parameter a LazyTrain engine trains (whose state
    DeepSpeed's version cannot find: it would give ``.grad``, None for a non-block parameter on a GPU),
    DeepSpeed's for any other."""
    from .. import utils
    from ..engine import param_access
    ours = getattr(utils, name)

    def either(param, *args, **kwargs):
        if param_access.owner_of(param) is not None:
            return ours(param, *args, **kwargs)
        return deepspeeds(param, *args, **kwargs)
    either.__name__ = either.__qualname__ = name
    either.__doc__ = ours.__doc__
    return either


def _initialize_as_deepspeed_does(initialize):
    """``deepspeed.initialize`` sets up the default process group when there is none (a script started with
    ``python``, not a launcher), and the code calling it relies on one (the Trainer gathers its metrics
    through it): a single process gets a group of one; several come from the launcher's environment."""

    def initialize_with_a_process_group(*args, **kwargs):
        _single_process_group()
        return initialize(*args, **kwargs)
    initialize_with_a_process_group.__doc__ = initialize.__doc__
    return initialize_with_a_process_group


def _single_process_group() -> None:
    import torch.distributed as dist
    from ..engine.distributed import init_distributed
    from ..launcher_env import launcher_int
    if not dist.is_available() or dist.is_initialized() or launcher_int("WORLD_SIZE", 1) > 1:
        return
    init_method = None                     # the launcher's MASTER_ADDR and MASTER_PORT
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        with socket.socket() as s:         # no launcher: a port of this machine's own, as torchrun's standalone mode
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    init_distributed(init_method=init_method, rank=launcher_int("RANK", 0) if init_method is None else 0,
                     world_size=1)


def _engine_type(deepspeed_engine: type, lazytrain_engine: type) -> type:
    """A stand-in for ``deepspeed.DeepSpeedEngine`` that ``isinstance`` matches for either engine and that
    builds DeepSpeed's engine when called (nothing calls it so, but a stand-in must not change that)."""

    class _EitherEngineType(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, (deepspeed_engine, lazytrain_engine))

        def __subclasscheck__(cls, sub):
            return issubclass(sub, (deepspeed_engine, lazytrain_engine))

        def __call__(cls, *args, **kwargs):
            return deepspeed_engine(*args, **kwargs)

    return _EitherEngineType("DeepSpeedEngine", (), {"__doc__": deepspeed_engine.__doc__,
                                                     "__module__": deepspeed_engine.__module__})


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments, as ``deepspeed.add_config_arguments`` adds them: ``--deepspeed``
    and ``--deepspeed_config`` (and the deprecated ``--deepscale``, ``--deepscale_config``), which
    :func:`lazytrain.initialize` reads from ``args``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


class _WholeParameters(contextlib.nullcontext):
    """``deepspeed.zero.Init(...)`` under LazyTrain: the model is built whole (LazyTrain streams it)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


class _GatheredParameters:
    """``deepspeed.zero.GatheredParameters(...)`` under LazyTrain: the parameters LazyTrain partitions (at
    ``zero_optimization.stage`` 3, those outside the streamed blocks: partitioned_params.py) are gathered
    for the duration, read only, on every rank at once as under DeepSpeed; every other parameter is whole
    already. With ``modifier_rank`` set over several ranks, DeepSpeed broadcasts that rank's writes to the
    others on exit, and so does this for parameters no LazyTrain engine trains (a model not yet given to
    ``initialize``: its embeddings resized or initialised on one rank). An engine's parameters are refused
    there: it keeps several copies of each (fp32 masters on their owners, compute copies on every rank) that a
    write to one cannot reach; ``lazytrain.utils.safe_set_full_fp32_param`` on every rank writes them all.
    Every rank must enter and leave the scope (a rank that does not leaves the others waiting in the
    broadcast until the process group's timeout), with the same parameters in the same order (lists that
    differ in number, shape, dtype or device are refused on every rank on entry)."""

    def __init__(self, params=None, modifier_rank=None, fwd_module=None, enabled=True):
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        self._params = list(params) if enabled else []
        self._modifies = enabled and modifier_rank is not None
        self._broadcast_from = modifier_rank if self._modifies and _world_size() > 1 else None
        if self._broadcast_from is not None:
            _refuse_engine_params(self._params)
        self._versions: dict[int, int] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        from ..engine.partitioned_params import live
        if self._broadcast_from is not None:   # before any gather: refused on every rank alike
            _refuse_engine_params(self._params)   # again: an engine may have taken them since __init__
            _refuse_lists_that_differ(self._params, self._broadcast_from)
        _wait_for_updates_of(self._params)
        for partitioned in live():
            self._stack.enter_context(partitioned.gathered(self._params))
        if self._modifies:
            self._versions = {id(p): p._version for p in self._params}
        return self

    def __exit__(self, *exc):
        self._stack.close()
        if self._broadcast_from is not None:
            if exc[0] is None:   # a rank that raised inside leaves the others to fail in the broadcast's timeout
                _broadcast_params(self._params, self._broadcast_from)
        elif self._modifies:
            _warn_of_writes_to_one_copy([p for p in self._params if p._version != self._versions.get(id(p))])
        return False


def _wait_for_updates_of(params: list) -> None:
    """The overlapped layer updates (``lazytrain.overlap_optimizer``, a GPU's default) of the engines training
    ``params`` done: a Trainer callback reading weights at ``on_step_end`` through this scope, which cannot call
    ``engine.wait_for_update()``, read the weights of the step before. From the training thread, which alone may
    wait (another thread's scope reads what is there)."""
    from ..engine import param_access
    engines = {id(e): e for e in map(param_access.owner_of, params) if e is not None}
    for engine in engines.values():
        if threading.get_ident() == engine.__dict__.get("_setup_thread"):
            engine.wait_for_update()


def _refuse_engine_params(params: list) -> None:
    from ..engine import param_access
    trained = [p for p in params if param_access.owner_of(p) is not None]
    if trained:
        raise NotImplementedError(
            f"deepspeed.zero.GatheredParameters(..., modifier_rank=...) over {_world_size()} ranks with "
            f"{len(trained)} parameter(s) a LazyTrain engine trains: the engine keeps several copies of each (fp32 "
            f"masters on the ranks that own them, compute copies on every rank) that a write to the parameter on "
            f"one rank cannot reach. Write them with lazytrain.utils.safe_set_full_fp32_param(p, value) on every "
            f"rank (deepspeed.utils' after lazytrain.replace_deepspeed()), which writes every copy")


def _refuse_lists_that_differ(params: list, src: int) -> None:
    """Every rank's parameters must be rank ``src``'s in number, shape, dtype and device type, in order: else
    the broadcast on exit would write ``src``'s values into other parameters, or pair up tensors of other
    sizes. Refused on every rank on entry, before anything is written (two parameters of one shape and dtype
    swapped between the ranks' lists cannot be told apart)."""
    import torch.distributed as dist
    mine = [f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')} on {p.device.type}" for p in params]
    lists = [None] * dist.get_world_size()
    dist.all_gather_object(lists, mine, group=_host_group())
    for rank, theirs in enumerate(lists):
        if theirs == lists[src]:
            continue
        if len(theirs) != len(lists[src]):
            differ = f"rank {rank} passed {len(theirs)} parameter(s), rank {src} {len(lists[src])}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(theirs, lists[src])) if a != b)
            differ = f"parameter {i} is {theirs[i]} on rank {rank}, {lists[src][i]} on rank {src}"
        raise ValueError(f"deepspeed.zero.GatheredParameters(..., modifier_rank={src}) over {len(lists)} ranks: "
                         f"{differ}; every rank must pass the same parameters in the same order (rank {src}'s "
                         f"values are broadcast into each rank's list in its order on exit)")


def _broadcast_params(params: list, src: int) -> None:
    """Rank ``src``'s values of ``params`` into every rank's, in the list's order (every rank's list is the same,
    as under DeepSpeed). Host tensors go over a gloo group (the default group may be NCCL, which carries
    device tensors only), device tensors over the default group."""
    import torch.distributed as dist
    with torch.no_grad():
        for p in params:
            data = p.detach()
            if data.numel() == 0:
                continue
            group = _host_group() if data.device.type == "cpu" else None
            sent = data if data.is_contiguous() else data.contiguous()
            dist.broadcast(sent.reshape(-1).view(torch.uint8), src=src, group=group)   # bit for bit, any dtype
            if sent is not data:
                data.copy_(sent)


_HOST_GROUP: list = []   # [the default group it was made beside, the gloo group]


def _host_group():
    """A gloo group of every rank for host tensors: the default group where it is gloo, else one made once
    per default group (every rank makes it at the same call: the first broadcast of a host tensor; a default
    group made again after ``destroy_process_group()`` gets a new one)."""
    import torch.distributed as dist
    if "gloo" in str(dist.get_backend()):   # "gloo", or a backend per device type ("cpu:gloo,cuda:nccl")
        return None
    if not _HOST_GROUP or _HOST_GROUP[0] is not dist.group.WORLD:
        _HOST_GROUP[:] = [dist.group.WORLD, dist.new_group(backend="gloo")]
    return _HOST_GROUP[1]


def _warn_of_writes_to_one_copy(written: list) -> None:
    """Parameters outside the streamed blocks written in place under ``GatheredParameters(...,
    modifier_rank=...)`` whose fp32 master a LazyTrain engine keeps apart (mixed precision, or beside a GPU):
    the next step writes the master back over the write, as DeepSpeed's optimizer writes its fp32 partition
    back. Said, not left silent. (A block parameter shows its fp32 weights, and the next forward copies a write
    into them.)"""
    from ..engine import param_access
    stale = [p for p in written if (engine := param_access.owner_of(p)) is not None and
             engine.masters is not None and engine.masters.master_of(p) is not p]
    if stale:
        warnings.warn(f"lazytrain: {len(stale)} parameter(s) written under deepspeed.zero.GatheredParameters("
                      f"modifier_rank=...) (shapes {', '.join(str(tuple(p.shape)) for p in stale[:4])}"
                      f"{', ...' if len(stale) > 4 else ''}) keep an fp32 master the write did not reach: the next "
                      f"step writes it back over the write. Write them with lazytrain.utils.safe_set_full_fp32_param"
                      f"(p, value) (deepspeed.utils' after lazytrain.replace_deepspeed()), which writes every copy",
                      UserWarning, stacklevel=3)


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _keep_the_scripts_optimizer(put) -> None:
    """accelerate swaps a script's torch optimizer for DeepSpeed's CPU Adam (a compiled op) when ZeRO offloads
    the optimizer and the config names none (a ``Trainer``'s own AdamW, an ``accelerate`` loop's): LazyTrain
    updates on the host whatever optimizer it is given, so the script's own stays, as it would without
    DeepSpeed (the same update, resumed bit for bit: DeepSpeed's op computes its bias correction one way in a
    long run and another in a resumed one)."""
    try:
        import accelerate.accelerator as accelerator
    except ImportError:
        return
    if hasattr(accelerator, "map_pytorch_optim_to_deepspeed"):
        put(accelerator, "map_pytorch_optim_to_deepspeed", lambda optimizer: optimizer)


def _leave_a_plateau_schedule_to_the_trainer(put) -> None:
    """A ``Trainer`` steps ReduceLROnPlateau with its evaluation metric only where it holds the schedule itself
    (an isinstance check); accelerate hands it the engine's schedule in a wrapper whose ``step()`` does nothing
    (DeepSpeed steps its schedule with each step), and ``engine.step()`` cannot step one that needs a metric. So a
    plateau schedule the Trainer built (its ``lr_scheduler_type`` with a config that names an optimizer and no
    scheduler) was stepped by no one, and the rate never fell. accelerate's wrapper now hands such a schedule
    over as it is, as it does without DeepSpeed; every other schedule is wrapped as before."""
    try:
        import accelerate.accelerator as accelerator
    except ImportError:
        return
    wrapper = getattr(accelerator, "DeepSpeedSchedulerWrapper", None)
    if not isinstance(wrapper, type):
        return

    class _PlateauAsItIs(wrapper):   # a subclass: accelerate's isinstance checks against the name still hold
        def __new__(cls, scheduler, *args, **kwargs):
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                return scheduler   # not an instance of cls: __init__ is not run
            return super().__new__(cls)

    put(accelerator, "DeepSpeedSchedulerWrapper", _PlateauAsItIs)


def _keep_accelerate_out_of_our_section(put) -> None:
    """accelerate takes every "auto" in the DeepSpeed config for a placeholder of its own, to fill from the
    Trainer's arguments, and fails on one it has no value for: the "lazytrain" section's own "auto" values
    (``policy``, ``overlap_optimizer``, ``frozen_bottom_layers``, ``gradient_reduce``) stopped every Trainer
    and accelerate script before LazyTrain saw them. Its pass over the config now leaves that section out."""
    try:
        from accelerate.utils import DeepSpeedPlugin
    except ImportError:
        return
    fill = DeepSpeedPlugin.deepspeed_config_process

    @functools.wraps(fill)
    def fill_all_but_ours(self, *args, **kwargs):
        if kwargs.get("config") is None and not args and isinstance(self.deepspeed_config, dict):
            # the sections it walks; it writes what it fills through the config itself, as before
            kwargs["config"] = {k: v for k, v in self.deepspeed_config.items() if k != "lazytrain"}
        return fill(self, *args, **kwargs)

    put(DeepSpeedPlugin, "deepspeed_config_process", fill_all_but_ours)


def _replace_transformers_zero3_switch(put) -> None:
    """transformers decides ZeRO-3 from a module-level weak reference to the live DeepSpeed config, set when
    ``TrainingArguments`` (or accelerate's plugin) is built. Setting it is made a no-op, and one already set
    is cleared, so ``is_deepspeed_zero3_enabled()`` answers False everywhere it is imported. The config
    object itself still says stage 3: the Trainer fills its "auto" values and saves as at stage 3."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:
        return
    put(hf_ds, "set_hf_deepspeed_config", lambda config: None)
    put(hf_ds, "_hf_deepspeed_config_weak_ref", None)
