"""Build the tiers one engine uses: ``hbm`` and ``host`` always, ``nvme`` when a path is given, plus the
user's own tiers from config (``"lazytrain": {"tiers": [{"name": ..., "class": ..., "capacity": ...}]}``)."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from .base import Tier, close_tiers, parse_bytes
from .memory import DeviceTier, HostTier
from .registry import resolve_tier_class

class TierSpecError(ValueError, TypeError):
    """A tier spec, capacity or ``aio`` setting in the config that cannot be built as given (a ValueError, and
    a TypeError where the spec's type is wrong, as raised before)."""


BUILTIN_TIERS = ("hbm", "host", "nvme")
RESERVED_NAMES = BUILTIN_TIERS + ("recompute",)  # "recompute" is a boundary home in a Plan, not a tier


def _accepted_kwargs(cls: type) -> tuple[set[str], bool]:
    """Keyword names ``cls(...)`` accepts, and whether it takes ``**kwargs``."""
    params = inspect.signature(cls).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def _user_tier(index: int, spec: Any, capacities: dict[str, Any], taken: set[str]) -> Tier:
    where = f"lazytrain.tiers[{index}]"
    if not isinstance(spec, dict):
        raise TierSpecError(f"{where}: a tier spec is an object like "
                        f"{{'name': 'ramdisk', 'class': 'my_pkg.tiers:RamDiskTier', 'capacity': '64GB'}}, "
                        f"got {type(spec).__name__}")
    spec = dict(spec)
    for required in ("name", "class"):
        if required not in spec:
            raise TierSpecError(f"{where}: missing key {required!r} (a tier spec needs 'name' and 'class')")
    name, class_spec = spec.pop("name"), spec.pop("class")
    if not isinstance(name, str) or not name:
        raise TierSpecError(f"{where}.name: a tier name is a non-empty string, got {name!r}")
    where = f"{where} ({name!r})"
    if name in RESERVED_NAMES:
        raise TierSpecError(f"{where}.name: {name!r} is built in; give your tier another name "
                         f"(reserved: {', '.join(RESERVED_NAMES)})")
    if name in taken:
        raise TierSpecError(f"{where}.name: a tier named {name!r} is already defined")
    if not isinstance(class_spec, str) or not class_spec:
        raise TierSpecError(f"{where}.class: expected 'package.module:Class', a registered tier name or an entry "
                         f"point name, got {class_spec!r}")
    try:
        cls = resolve_tier_class(class_spec)
    except (ValueError, TypeError) as e:
        raise TierSpecError(f"{where}.class: {e}") from e

    capacity = spec.pop("capacity", None)
    try:
        capacity = parse_bytes(capacity, f"{where}.capacity")
        override = parse_bytes(capacities.get(name), f"capacities[{name!r}]")
    except (TypeError, ValueError) as e:
        raise TierSpecError(str(e)) from e
    if override is not None:
        if capacity is not None and capacity != override:
            raise TierSpecError(f"{where}.capacity is {capacity} bytes but capacities[{name!r}] is {override} bytes; "
                             f"give the budget in one place")
        capacity = override

    accepted, var_kw = _accepted_kwargs(cls)
    for required in ("name", "capacity"):
        if required not in accepted and not var_kw:
            raise TierSpecError(f"{where}.class: {cls.__module__}.{cls.__qualname__}.__init__ must accept "
                            f"{required!r} (the Tier contract: __init__(self, name, capacity=None, ...))")
    if not var_kw:
        for key in spec:
            if key not in accepted:
                options = sorted(accepted - {"self", "name", "capacity"})
                raise TierSpecError(f"{where}: unknown key {key!r} for tier class {cls.__qualname__} "
                                 f"(it accepts: {', '.join(['name', 'class', 'capacity'] + options)})")
    try:
        tier = cls(name=name, capacity=capacity, **spec)
    except Exception as e:
        raise _with_context(e, f"{where}: {cls.__qualname__}(...) failed: {e}") from e
    if not isinstance(tier, Tier):
        raise TierSpecError(f"{where}.class: {class_spec!r} built {tier!r}, which is not a lazytrain.tiers.Tier")
    if not hasattr(tier, "name"):   # it failed on tier.name, naming no cause
        raise TierSpecError(f"{where}: {cls.__qualname__}.__init__ did not call Tier.__init__(self, name, capacity) "
                        f"(the Tier contract), so the tier has no name, capacity or accounting")
    if tier.name != name:
        tier.close()
        raise TierSpecError(f"{where}: {cls.__qualname__} named itself {tier.name!r}; pass the 'name' argument "
                         f"on to Tier.__init__")
    return tier


def _with_context(error: Exception, message: str) -> Exception:
    """``error``'s type with ``message`` (a RuntimeError where that type cannot take a message)."""
    try:
        return type(error)(message)
    except Exception:
        return RuntimeError(message)


def create_tiers(specs: list[dict] | None, device: torch.device | str,
                 nvme_path: str | None = None, aio: dict | None = None,
                 capacities: dict[str, int | str | None] | None = None) -> dict[str, Tier]:
    """The tiers of one engine, by name.

    Always ``"hbm"`` (a :class:`DeviceTier` on ``device``) and ``"host"`` (a :class:`HostTier`);
    ``"nvme"`` (an :class:`~lazytrain.tiers.nvme.NVMeTier` with its run directory under ``nvme_path``,
    tuned by DeepSpeed's ``aio`` keys) when ``nvme_path`` is given; and one tier per user spec
    ``{"name": ..., "class": "pkg.mod:Class" | registered name | entry point, "capacity": "64GB",
    other keys -> constructor keyword arguments}``. ``capacities`` maps a tier name to its budget
    (bytes, "64GB", or None for unbounded). Errors name the offending key; on an error, tiers already
    built are closed again.
    """
    capacities = dict(capacities or {})
    specs = list(specs or [])
    names = set(BUILTIN_TIERS[:2]) | ({"nvme"} if nvme_path is not None else set())
    for i, spec in enumerate(specs):
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            names.add(spec["name"])
    for name in capacities:
        if name not in names:
            hint = " (nvme exists only when an nvme_path is given)" if name == "nvme" else ""
            raise TierSpecError(f"capacities: no tier named {name!r}{hint}; tiers: {', '.join(sorted(names))}")
    if aio is not None and nvme_path is None:
        raise TierSpecError("aio: these settings tune the NVMe tier, but no nvme_path was given")

    device = torch.device(device)
    tiers: dict[str, Tier] = {}
    try:
        tiers["hbm"] = DeviceTier("hbm", capacity=parse_bytes(capacities.get("hbm"), "capacities['hbm']"),
                                  device=device)
        tiers["host"] = HostTier("host", capacity=parse_bytes(capacities.get("host"), "capacities['host']"))
        if nvme_path is not None:
            from .nvme import NVMeTier
            tiers["nvme"] = NVMeTier("nvme", path=nvme_path, aio=aio,
                                     capacity=parse_bytes(capacities.get("nvme"), "capacities['nvme']"))
        for i, spec in enumerate(specs):
            tier = _user_tier(i, spec, capacities, set(tiers))
            tiers[tier.name] = tier
    except BaseException:
        close_tiers(tiers.values())   # (a failure to close is not the error being raised)
        raise
    return tiers
