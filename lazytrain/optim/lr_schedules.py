"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), same
formulas.

Each schedule is stepped once per optimizer step. As in DeepSpeed, ``get_last_lr()`` before the first
``step()`` gives the learning rate the schedule starts from (OneCycle's raises an AssertionError whose text
contains "need to call step", which Hugging Face Trainer reads as lr 0), and ``step()`` takes the step
number under DeepSpeed's name for each schedule (``last_batch_iteration`` or ``batch_iteration``).
"""
from __future__ import annotations

import inspect
import math
import warnings

import torch

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def set_group_lrs(param_groups: list[dict], lrs: list) -> None:
    """Each group's learning rate set; a tensor rate filled in place, as DeepSpeed's: a captured step keeps
    reading it."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr


def _per_group(optimizer, value, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _warmup_type(warmup_type: str) -> str:
    """DeepSpeed's reading of an unknown warmup_type: a warning, then the log warmup."""
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        warnings.warn(f"lazytrain: unknown warmup_type {warmup_type!r} in the scheduler's params: the warmup is "
                      f"'log', as in DeepSpeed (known: 'log', 'linear')", UserWarning, stacklevel=4)
        return WARMUP_LOG_RATE
    return warmup_type


def _warmup_fraction(step: int, warmup_steps: int, warmup_type: str) -> float:
    """0 -> 1 over the warmup: log(step+1)/log(W) or step/W (DeepSpeed's arithmetic, to the last bit)."""
    if warmup_type == WARMUP_LOG_RATE:
        return (1.0 / math.log(warmup_steps)) * math.log(step + 1)
    return step / warmup_steps


class _Schedule:
    """Shared stepping, state and ``get_last_lr`` behaviour."""

    def __init__(self, optimizer, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self, lrs: list[float]) -> list[float]:
        set_group_lrs(self.optimizer.param_groups, lrs)
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self._advance(last_batch_iteration)

    def _advance(self, iteration: int | None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if iteration is None else iteration
        self._last_lr = self._apply(self.get_lr())

    def get_last_lr(self) -> list[float]:
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        if self.last_batch_iteration >= 0:
            self._last_lr = self._apply(self.get_lr())


class WarmupLR(_Schedule):
    """min_lr -> max_lr over warmup_num_steps (log or linear), then flat at max_lr."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        if warmup_max_lr is None:   # each group warms up to its own lr (a tensor's value now: it is filled)
            warmup_max_lr = [group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
                             for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._last_lr = self._apply(self.min_lrs)   # the optimizer starts at min_lr, as in DeepSpeed

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


def _warn_if_warmup_outlasts(total_num_steps, warmup_num_steps, schedule: str) -> None:
    """As DeepSpeed warns: a run that ends within its warmup never decays (its lr still rising at the end)."""
    if total_num_steps < warmup_num_steps:
        warnings.warn(f"lazytrain: {schedule}'s total_num_steps {total_num_steps} is less than warmup_num_steps "
                      f"{warmup_num_steps}: the run ends within its warmup, and the lr never decays", UserWarning,
                      stacklevel=3)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_if_warmup_outlasts(total_num_steps, self.warmup_num_steps, "WarmupDecayLR")   # at least 2, as run

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Ratio of the optimizer's lr: warmup_min_ratio -> 1 over the warmup, then cosine down to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        _warn_if_warmup_outlasts(total_num_steps, self.warmup_num_steps, "WarmupCosineLR")   # at least 2, as run
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.org_lrs = [group["lr"].clone() if torch.is_tensor(group["lr"]) else group["lr"]
                        for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = self._apply([0.0 for _ in self.org_lrs])

    def get_lr_ratio(self) -> float:
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            r = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """1Cycle: lr rises cycle_min_lr -> cycle_max_lr and falls back over one cycle (momentum inversely),
    then decays by 1 / (1 + decay_lr_rate * (steps after the cycle) / decay_step_size)."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                 decay_mom_rate=0.0, last_batch_iteration=-1):
        if cycle_first_step_size <= 0:   # DeepSpeed's checks and messages
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if cycle_second_step_size is not None and cycle_second_step_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        # one value for every parameter group, or one per group
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, mom in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = mom

    def _scale_factor(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                position = pos * stairs / self.first_step_size
            else:
                position = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self):
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * (1 + self.decay_mom_rate * interval), b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration=None):
        self._advance(batch_iteration)
        self._apply_mom()

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        if self.last_batch_iteration >= 0:
            self._apply_mom()   # the betas go with the lr: a resume without optimizer states keeps both

    def _apply_mom(self) -> None:
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = mom


class LRRangeTest(_Schedule):
    """The learning-rate range test: min_lr * (1 + step_rate * interval), the interval growing by one every
    step_size steps (continuously, or in stairs), to find the largest lr that trains without diverging."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:   # DeepSpeed's message
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = self._apply(self.min_lrs)

    def step(self, batch_iteration=None):
        self._advance(batch_iteration)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_schedule(name: str, optimizer, params: dict):
    """A schedule from config ``scheduler: {type, params}``; unknown names and params raise naming the key."""
    cls = SCHEDULES.get(name) or _torch_schedule(name)
    if cls is None:
        raise ValueError(f"config 'scheduler.type' {name!r} is unknown (known: {', '.join(SCHEDULES)}, or any "
                         f"torch.optim.lr_scheduler class by its name)")
    if name in SCHEDULES:
        params = _checked_settings(name, cls, params)
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as e:   # named by where it is set in the config
        raise ValueError(f"config 'scheduler.params' for {name}: {e}") from None


def _checked_settings(name: str, cls, params: dict) -> dict:
    """DeepSpeed's schedules' settings as they must be, refused at set-up naming the key: numbers, finite (a
    learning rate >= 0, one for every group or one per group), and true/false flags read as DeepSpeed reads
    them. Why: a string learning rate ("3e-5", as a YAML file converted to JSON gives) passed set-up and
    failed at the first step, after the weights had changed; a NaN or negative one trained without a word
    (every weight NaN, or training uphill). ``warmup_type`` is a word; an unknown key is named by the call."""
    from ..config import _flag
    declared = inspect.signature(cls.__init__).parameters
    checked = dict(params)
    for key, value in params.items():
        if key not in declared or key == "warmup_type" or value is None:   # None: the schedule's default
            continue
        if isinstance(declared[key].default, bool):
            checked[key] = _flag(params, key, declared[key].default, "scheduler.params")
            continue
        is_lr, is_mom = key.endswith("_lr"), key.endswith("_mom")   # DeepSpeed takes these per group
        values = value if (is_lr or is_mom) and isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (is_lr and v < 0):
                what = ("a learning rate >= 0 (or one per parameter group)" if is_lr else
                        "a number (or one per parameter group)" if is_mom else "a number")
                raise ValueError(f"config 'scheduler.params.{key}' for {name} must be {what}, got {value!r}")
    return checked


def _torch_schedule(name: str):
    """A torch.optim.lr_scheduler class by its name, as DeepSpeed builds a type it does not implement itself."""
    import torch

    return torch_class_by_name(torch.optim.lr_scheduler, name, torch.optim.lr_scheduler.LRScheduler)


def torch_class_by_name(namespace, name: str, base: type):
    """``namespace.name`` when it is a proper subclass of ``base`` (DeepSpeed's fallback for a config type it
    does not implement: a torch optimizer or schedule by its class name), else None."""
    cls = getattr(namespace, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, base) and cls is not base else None
