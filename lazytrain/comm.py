"""``deepspeed.comm`` as a script reaches it through ``import lazytrain as deepspeed``: torch.distributed's
collectives under DeepSpeed's names and keywords. As after DeepSpeed's ``initialize``, a single process (no
launcher, or a launcher's world of one) has a process group of one when a function here first needs it.
DeepSpeed's communication-logger keywords (``prof``, ``log_name``, ``debug``) are accepted and dropped."""

import torch.distributed as _dist
from torch.distributed import ReduceOp

from .engine.distributed import init_distributed as _init_distributed
from .launcher_env import launcher_int

# DeepSpeed's keyword for an argument torch names otherwise
_KEYWORDS = {"all_gather_into_tensor": {"tensor": "input_tensor"},
             "reduce_scatter_tensor": {"output_tensor": "output", "tensor": "input"},
             "all_to_all_single": {"tensor": "input"}}
_LOGGER_KEYWORDS = ("prof", "log_name", "debug")
_COLLECTIVES = ("get_rank", "get_world_size", "get_backend", "barrier", "monitored_barrier",
                "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "all_gather_object",
                "broadcast_object_list", "new_group", "destroy_process_group")

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_local_rank", "get_global_rank",
           "log_summary", *_COLLECTIVES]


def init_distributed(*args, **kwargs) -> None:
    """DeepSpeed's ``init_distributed`` (its parameters, in its order): the launcher's group, or one of this
    process alone."""
    _init_distributed(*args, **kwargs)
    _with_a_group()


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """DeepSpeed's signature (torch's needs both arguments): the global rank of ``group``'s rank
    ``group_rank``, of the default group's without one."""
    _with_a_group()
    return _dist.get_global_rank(group if group is not None else _dist.group.WORLD, group_rank)


def get_local_rank() -> int:
    return launcher_int("LOCAL_RANK", 0)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed prints its communication log here when its comms_logger is on; LazyTrain keeps none, as
    DeepSpeed keeps none by default: nothing to print (an empty summary when one is asked for)."""
    return {} if return_dict else None


def _with_a_group() -> None:
    if not is_initialized():
        from .integrations.deepspeed_entry import _single_process_group
        _single_process_group()


def _wrapped(name: str):
    target, renames = getattr(_dist, name), _KEYWORDS.get(name, {})

    def call(*args, **kwargs):
        for key in _LOGGER_KEYWORDS:
            kwargs.pop(key, None)
        for ours, theirs in renames.items():
            if ours in kwargs:
                kwargs[theirs] = kwargs.pop(ours)
        _with_a_group()
        return target(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__module__ = __name__
    call.__doc__ = f"torch.distributed.{name} under DeepSpeed's name and keywords."
    return call


for _name in _COLLECTIVES:
    globals()[_name] = _wrapped(_name)
del _name


def __getattr__(name: str):
    raise AttributeError(f"lazytrain.comm (deepspeed.comm for `import lazytrain as deepspeed`) has no {name!r}: for "
                         f"DeepSpeed's other names keep `import deepspeed` and call lazytrain.replace_deepspeed()")
