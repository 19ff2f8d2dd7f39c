"""``deepspeed.comm`` as a script reaches it through ``import lazytrain as deepspeed``: torch.distributed under
DeepSpeed's names. DeepSpeed's own keyword arguments for its communication logger (``prof``, ``log_name``,
``debug``) are accepted and dropped; ``get_local_rank`` reads the launcher's ``LOCAL_RANK``;
``init_distributed`` is LazyTrain's (DeepSpeed's signature)."""
import functools
import os

import torch.distributed as _dist
from torch.distributed import ReduceOp

from .engine.distributed import init_distributed

__all__ = ["ReduceOp", "init_distributed", "get_local_rank", "log_summary"]   # and torch.distributed's names

_LOGGER_KEYWORDS = ("prof", "log_name", "debug")


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def log_summary(*args, **kwargs) -> None:
    """DeepSpeed prints its communication log here when its comms_logger is on; LazyTrain keeps none, as
    DeepSpeed keeps none by default: nothing to print."""


def __getattr__(name: str):
    value = getattr(_dist, name, None)
    if value is None or name.startswith("_"):
        raise AttributeError(f"lazytrain.comm (deepspeed.comm for `import lazytrain as deepspeed`) has no {name!r}: "
                             f"it answers torch.distributed's names; for DeepSpeed's others keep `import deepspeed` "
                             f"and call lazytrain.replace_deepspeed()")
    if not callable(value) or isinstance(value, type):
        return value

    @functools.wraps(value)
    def call(*args, **kwargs):
        for key in _LOGGER_KEYWORDS:
            kwargs.pop(key, None)
        return value(*args, **kwargs)
    return call
