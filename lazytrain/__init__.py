"""LazyTrain: train models larger than GPU memory by streaming their layers, planned by a MILP.

    engine, optimizer, _, scheduler = lazytrain.initialize(model=model, model_parameters=model.parameters(),
                                                          config="configs/tiny-cpu.json")

Importing ``lazytrain`` loads nothing heavy; torch is imported with the engine, on first use.
"""
__version__ = "0.1.0"
__all__ = ["initialize", "register_tier", "__version__"]


def __getattr__(name):
    if name == "initialize":
        from .engine.initialize import initialize
        return initialize
    if name == "register_tier":
        from .tiers.registry import register_tier
        return register_tier
    raise AttributeError(f"module 'lazytrain' has no attribute {name!r}")
