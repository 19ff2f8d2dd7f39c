"""LazyTrain: train models larger than GPU memory by streaming their layers, planned by a MILP.

    engine, optimizer, _, scheduler = lazytrain.initialize(model=model, model_parameters=model.parameters(),
                                                          config="configs/tiny-cpu.json")

Importing ``lazytrain`` loads nothing heavy; torch is imported with the engine, on first use.
"""
__version__ = "0.1.0"
__all__ = ["initialize", "add_config_arguments", "zero", "comm", "utils", "replace_deepspeed", "restore_deepspeed", "init_distributed", "CollectiveError", "register_tier", "CheckpointError", "IncompleteCheckpointError", "CheckpointSpaceError",
           "CheckpointMismatchError", "StepFailedError", "LossScaleAtMinimumError", "engine_of", "__version__"]
_CHECKPOINT_ERRORS = ("CheckpointError", "IncompleteCheckpointError", "CheckpointSpaceError", "CheckpointMismatchError")


def __getattr__(name):
    if name == "initialize":
        from .engine.initialize import initialize
        return initialize
    if name in ("zero", "comm", "utils"):   # deepspeed.zero's, .comm's and .utils' names, for `import lazytrain as deepspeed`
        import importlib
        return importlib.import_module(f".{name}", __name__)
    if name in ("replace_deepspeed", "restore_deepspeed", "add_config_arguments"):
        from .integrations import deepspeed_entry
        return getattr(deepspeed_entry, name)
    if name == "register_tier":
        from .tiers.registry import register_tier
        return register_tier
    if name in ("init_distributed", "CollectiveError"):
        from .engine import distributed
        return getattr(distributed, name)
    if name in _CHECKPOINT_ERRORS:
        from .engine import checkpoint
        return getattr(checkpoint, name)
    if name == "engine_of":
        from .engine.module_copy import engine_of
        return engine_of
    if name == "StepFailedError":
        from .engine.engine import StepFailedError
        return StepFailedError
    if name == "LossScaleAtMinimumError":
        from .engine.precision import LossScaleAtMinimumError
        return LossScaleAtMinimumError
    raise AttributeError(f"module 'lazytrain' has no attribute {name!r}")
