"""Find tier classes by name: built-ins, ``lazytrain.register_tier()``, "package.module:Class"
strings in a config, or installed entry points in the group ``lazytrain.tiers``."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .base import Tier

ENTRY_POINT_GROUP = "lazytrain.tiers"
_REGISTRY: dict[str, type[Tier]] = {}


def register_tier(name: str, cls: type[Tier]) -> type[Tier]:
    """Make ``cls`` available under ``name`` as a tier ``kind`` in the config's ``lazytrain.tiers`` list;
    a tier configured there (under its own name) can then be a boundary home (``boundary_home``, a plan's
    homes); the streamed weights live in host memory, on NVMe or on the device only."""
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"register_tier({name!r}, ...) needs a subclass of lazytrain.tiers.Tier, got {cls!r}")
    _REGISTRY[name] = cls
    return cls


def resolve_tier_class(spec: str) -> type[Tier]:
    """A registered name, an entry point name, or "package.module:Class"."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception as e:   # the module's own errors too (a SyntaxError, what its import raised)
            raise ValueError(f"tier class {spec!r} cannot be imported: {type(e).__name__}: {e}") from e
    else:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not eps:
            known = sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
            raise ValueError(f"unknown tier {spec!r}: not registered, not an entry point in group "
                             f"{ENTRY_POINT_GROUP!r}, and not 'package.module:Class' (known: {', '.join(known)})")
        try:
            obj = eps[0].load()
        except Exception as e:
            raise ValueError(f"tier {spec!r} (entry point {eps[0].value!r}) cannot be loaded: "
                             f"{type(e).__name__}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, Tier)):
        raise TypeError(f"tier {spec!r} resolves to {obj!r}, which is not a subclass of lazytrain.tiers.Tier")
    return obj
