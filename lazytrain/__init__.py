"""LazyTrain: train models larger than GPU memory by streaming their layers, planned by a MILP.

    engine, optimizer, _, scheduler = lazytrain.initialize(model=model, model_parameters=model.parameters(),
                                                          config="configs/tiny-cpu.json")
"""
__version__ = "0.1.0"

from .tiers.registry import register_tier  # noqa: E402


def initialize(*args, **kwargs):
    """DeepSpeed-compatible entry point; see :func:`lazytrain.engine.initialize.initialize`."""
    from .engine.initialize import initialize as _initialize
    return _initialize(*args, **kwargs)


__all__ = ["initialize", "register_tier", "__version__"]
