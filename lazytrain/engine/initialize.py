"""``lazytrain.initialize()``: DeepSpeed's signature and 4-tuple return."""
from __future__ import annotations

import itertools
import warnings

from ..config import ConfigError, load_config_source, parse_config
from .blocks import compiled_error, is_compiled
from .distributed import init_distributed, launched, world_size
from .engine import LazyTrainEngine


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """Wrap ``model`` in a :class:`LazyTrainEngine`.

    Returns ``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)``.
    ``config`` (alias ``config_params``, or ``args.deepspeed_config``) is a dict, a JSON file path, or
    base64-encoded JSON.
    """
    if model is None:
        raise ConfigError("lazytrain.initialize requires a model")
    _refuse_compiled(model)
    _refuse_partitioned(model)
    _refuse_uninitialized(model)
    if config is None and config_params is not None:
        config = config_params
    elif config is not None and config_params is not None and not _same_config(config, config_params):
        # DeepSpeed takes 'config' and drops the alias unread; one of two differing configs would be lost
        raise ConfigError("'config' and 'config_params' (its alias) give different configs: pass one")
    args_config = getattr(args, "deepspeed_config", None) if args is not None else None
    if args_config is not None and getattr(args, "deepscale_config", None) is not None:
        raise ConfigError("args holds both deepscale_config and deepspeed_config; give one (deepspeed_config: "
                          "deepscale_config is its deprecated name), as DeepSpeed asks")
    if args_config is None and getattr(args, "deepscale_config", None) is not None:
        warnings.warn("lazytrain: args.deepscale_config is deprecated, as in DeepSpeed: use args.deepspeed_config",
                      DeprecationWarning, stacklevel=2)
        args_config = args.deepscale_config
    if args_config is not None and config is not None:
        raise ConfigError("Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and "
                          "lazytrain.initialize() function call")
    if config is None:
        config = args_config
    if config is None:
        raise ConfigError("lazytrain.initialize needs a config: config=dict, a JSON path or base64 JSON "
                          "(or args.deepspeed_config)")
    _refuse_model_parallelism(mpu, mesh_param)
    if mpu is not None or mesh_param is not None:
        warnings.warn("lazytrain: model/tensor parallelism (mpu, mesh_param) is not supported; they are ignored",
                      UserWarning, stacklevel=2)
    cfg = parse_config(config, world_size=world_size())   # the batch triple is checked against the real group
    if world_size() <= 1 and launched():   # a launcher's one process gets its group, as DeepSpeed makes it
        init_distributed()
    engine = LazyTrainEngine(model, cfg, optimizer=optimizer, model_parameters=model_parameters,
                             lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
    if args is not None and hasattr(args, "local_rank"):   # scripts written for DeepSpeed read it (set_device,
        args.local_rank = engine.local_rank                 # rank-0 gating), which DeepSpeed sets from LOCAL_RANK
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _same_config(a, b) -> bool:
    """Whether two config sources (dicts, JSON paths or base64 JSON) say the same settings."""
    return a is b or a == b or load_config_source(a) == load_config_source(b)


def _refuse_compiled(model) -> None:
    """torch.compile cannot trace the streaming executor that each block's call is routed to (threads,
    transfer handles, per-call bookkeeping): say so up front instead of failing inside dynamo. The blocks
    themselves are checked once they are found (:func:`~lazytrain.engine.blocks.refuse_compiled_blocks`)."""
    if is_compiled(model):
        raise compiled_error("the model")


def _refuse_partitioned(model) -> None:
    """A model built under DeepSpeed's own ``zero.Init`` holds empty placeholders for its parameters (each
    with a ``ds_id``): LazyTrain needs them whole. Hugging Face builds models that way under a ZeRO-3 config
    when ``lazytrain.replace_deepspeed()`` came after ``TrainingArguments`` or ``from_pretrained``."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ConfigError("the model's parameters were partitioned by DeepSpeed's zero.Init (ZeRO-3): LazyTrain "
                          "needs them whole. Call lazytrain.replace_deepspeed() before TrainingArguments and "
                          "before building or loading the model (from_pretrained, from_config)")


def _refuse_uninitialized(model) -> None:
    """A lazy module's (``nn.LazyLinear``) parameters have no shape until its first forward, and the engine lays
    its buffers, masters and plan out for the shapes it finds."""
    from torch.nn.parameter import is_lazy
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if is_lazy(t):
            raise ConfigError(f"lazytrain.initialize: '{name}' is not initialized yet (a lazy module's, such as "
                              f"nn.LazyLinear): run one forward of the model on a sample batch before "
                              f"lazytrain.initialize, which lays the engine's buffers out for the parameters' shapes")


def _refuse_model_parallelism(mpu, mesh_param) -> None:
    """An ``mpu`` or ``mesh_param`` that splits the model over ranks: DeepSpeed would average gradients over the
    data-parallel ranks alone and size the batch by them, where LazyTrain treats every rank as data parallel
    (averaging over the model-parallel ones too). Of size 1, they change nothing and are only warned of."""
    sizes = {}
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size",
                 "get_pipeline_model_parallel_world_size", "get_sequence_parallel_world_size"):
        get = getattr(mpu, name, None)
        if callable(get):
            sizes[name] = get()
    if isinstance(mesh_param, (tuple, list)) and len(mesh_param) > 1:
        sizes["mesh_param's sequence-parallel size"] = mesh_param[1]
    split = {k: v for k, v in sizes.items() if isinstance(v, int) and v > 1}
    if split:
        name, size = next(iter(split.items()))
        raise ConfigError(f"lazytrain.initialize: mpu/mesh_param split the model over ranks ({name}: {size}); "
                          f"LazyTrain trains data parallel only (every rank holds the whole model, streamed), and "
                          f"would average gradients over the model-parallel ranks too")

