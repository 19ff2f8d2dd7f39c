"""LazyTrain: train models larger than GPU memory by streaming their layers, planned by a MILP.

    engine, optimizer, _, scheduler = lazytrain.initialize(model=model, model_parameters=model.parameters(),
                                                          config="configs/tiny-cpu.json")
"""
__version__ = "0.1.0"

from .engine.initialize import initialize  # noqa: E402
from .tiers.registry import register_tier  # noqa: E402

__all__ = ["initialize", "register_tier", "__version__"]
