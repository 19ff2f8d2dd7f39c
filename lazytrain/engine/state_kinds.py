"""Whether a checkpoint's optimizer and learning-rate schedule states are of the kinds this engine runs.

torch's ``load_state_dict`` takes any optimizer state whose groups have the right sizes, and a torch scheduler's
takes any keys into its ``__dict__``. A state of another kind then failed half-way through the load (SGD's into
AdamW: a KeyError on ``'step'``, the engine fenced until another load), failed at the next step (AdamW's into SGD:
a KeyError on ``'momentum'`` in the middle of the update), or trained on silently wrong (AdamW's 8-bit moments
into SGD, which ignored them; StepLR's state into a CosineAnnealingLR, whose learning rate then followed neither).
These checks run before anything of a checkpoint is loaded. They read no checkpoint's class: they ask what this
engine's optimizer or schedule keeps and what the saved state holds."""
from __future__ import annotations

import torch

from ..optim.hybrid_adamw import HybridAdamW, holds_adam_moments
from ..optim.lr_schedules import _Schedule


# how torch runs an optimizer's update, not what it computes: not named as what sets a saved state apart, and not
# taken from a checkpoint's groups (the engine's load by name keeps this optimizer's own)
HOW_IT_RUNS = ("foreach", "fused", "capturable", "differentiable")
# what torch's schedules add to an optimizer's groups (OneCycleLR, CyclicLR, any: initial_lr): not the optimizer's
_SCHEDULE_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})


def missing_settings(optimizer, saved_groups: list[dict]) -> list[str]:
    """The settings this optimizer's class keeps (its ``defaults``: not a key a schedule adds to the groups, as
    torch's ``initial_lr``, or the script's own) that a saved state's groups lack once this optimizer's load
    filled in what it fills in. torch's optimizers fill in, in ``__setstate__``, the settings torch added over its
    versions (``foreach``, ``fused``, ``decoupled_weight_decay``, ...), so a checkpoint of an older torch or of
    DeepSpeed's Adam fits an AdamW; HybridAdamW fills in its own (block size, state precision) from its defaults.
    Empty where nothing is missing, or where this optimizer's load cannot be asked (it decides alone)."""
    here = set(getattr(optimizer, "defaults", None) or ()) - {"params"}
    filled = [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in saved_groups]
    if isinstance(optimizer, HybridAdamW):
        for g in filled:
            for key, value in optimizer.defaults.items():
                if key != "betas":   # every Adam's state holds its betas: a state without them is not an Adam's
                    g.setdefault(key, value)
    elif getattr(type(optimizer), "__setstate__", None) is not None:
        # a stand-in of this optimizer's class, given the saved groups (no parameters, no state) through its own
        # __setstate__, as torch's load gives them: what it fills in, it fills into these copies
        stand_in = object.__new__(type(optimizer))
        stand_in.__dict__["defaults"] = dict(getattr(optimizer, "defaults", {}))
        try:
            type(optimizer).__setstate__(stand_in, {"state": {}, "param_groups": filled})
        except Exception:   # an optimizer of the script's whose __setstate__ needs more: its own load decides
            return []
    return sorted(here - set().union(*(g.keys() for g in filled))) if filled else []


def optimizer_state_of_another_kind(optimizer, saved: dict) -> str | None:
    """Why ``saved`` (a ``state_dict()`` of an optimizer, or DeepSpeed's groups' settings with Adam moments) is
    not a state this optimizer can take, or None. HybridAdamW also needs Adam moments (fp32 or 8-bit) for every
    parameter the state holds anything for."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None
    name = type(optimizer).__name__
    # another kind both lacks settings this one keeps and has settings this one does not; an older version of
    # this one lacks only the settings added since (bitsandbytes' AdEMAMix keys, read with a default), and loads
    missing = missing_settings(optimizer, groups)
    foreign = sorted(set().union(*(g.keys() for g in groups)) - {"params"} - _SCHEDULE_KEYS - set(HOW_IT_RUNS) -
                     set().union(*(g.keys() for g in optimizer.param_groups)))
    if missing and foreign:
        listed = f"{', '.join(map(repr, foreign[:4]))}{' ...' if len(foreign) > 4 else ''}"
        return (f"holds the state of another kind of optimizer: its parameter groups have no "
                f"{', '.join(map(repr, missing))}, which this engine's {name} keeps; it has {listed}")
    if isinstance(optimizer, HybridAdamW):
        for index, entry in (saved.get("state") or {}).items():
            if entry and not holds_adam_moments(entry):
                return (f"holds the state of another kind of optimizer: parameter {index}'s state has "
                        f"{', '.join(map(repr, sorted(entry)))} and no Adam moments, which this engine's {name} "
                        f"keeps")
    return None


def _torch_schedule_base_keys() -> frozenset:
    """The keys every torch scheduler's state holds (its step counter, base and last rates, flags of torch's
    version), as this torch writes them: a LambdaLR's, less its own ``lr_lambdas``."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    keys = set(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict()) - {"lr_lambdas"}
    return frozenset(keys | {"verbose", "_is_initial", "_get_lr_called_within_step"})   # of other torch versions


_TORCH_SCHEDULE_BASE_KEYS = _torch_schedule_base_keys()


def schedule_state_of_another_kind(scheduler, saved: dict) -> str | None:
    """Why ``saved`` (a learning-rate schedule's ``state_dict()``) is not this schedule's kind, or None.
    DeepSpeed's schedules (LazyTrain's) keep their iteration alone, which any of them takes, as DeepSpeed's own
    load does: one of them switched for another goes on at the same iteration. A torch scheduler keeps its
    settings (StepLR's ``step_size`` and ``gamma``, cosine's ``T_max``): the saved ones must be its own."""
    name = type(scheduler).__name__
    if isinstance(scheduler, _Schedule):
        needed, foreign = set(scheduler.state_dict()), set()
    elif isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        # its own settings, and its step counter where it keeps one (ChainedScheduler keeps its schedules' alone)
        own = set(scheduler.state_dict())
        needed = own - _TORCH_SCHEDULE_BASE_KEYS | own & {"last_epoch"}
        foreign = set(saved) - _TORCH_SCHEDULE_BASE_KEYS - own
    else:   # a script's own schedule decides what it takes
        return None
    missing = sorted(needed - set(saved))
    if not missing and not foreign:
        return None
    what = f"without {', '.join(map(repr, missing))}, which this engine's {name} keeps" if missing else ""
    extra = f"with {', '.join(map(repr, sorted(foreign)))}, which this engine's {name} does not keep" \
        if foreign else ""
    return f"holds a learning-rate schedule's state {' and '.join(filter(None, (what, extra)))} (a schedule of " \
           f"another kind)"
