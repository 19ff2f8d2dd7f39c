"""``engine.tput_timer``, ``engine.monitor`` and, at ZeRO stage 3, ``optimizer.parameter_offload``: DeepSpeed
attributes that scripts read.

Why: the DeepSpeed-Chat template (and its many forks) calls ``engine.tput_timer.update_epoch_count()`` at the
end of every epoch and reads ``engine.monitor.enabled``; without them such a script failed after its first
epoch had trained, before its save. The timer counts as DeepSpeed's does (from each micro-step's training
forward to its ``step()``, the first ``start_step`` optimizer steps left out of the average); the monitor writes
nothing, as LazyTrain ignores the config's tensorboard, wandb and csv sections (with a warning), so it is
never enabled.
"""
from __future__ import annotations

import time


class ThroughputTimer:
    """DeepSpeed's ``ThroughputTimer``: samples a second over the optimizer steps after the first
    ``start_step``. The engine calls :meth:`start` at a micro-step's first training forward and :meth:`stop`
    in its ``step()``."""

    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size = batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.started = False
        self.start_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step started; ``global_step``: it ended an optimizer step. Nothing is printed
        (``report_speed`` is taken for DeepSpeed's signature: the engine's own log reports the rate)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            duration = time.time() - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples a second over the steps timed; ``-inf`` before any step, as DeepSpeed's."""
        timed = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")


class Monitor:
    """DeepSpeed's ``MonitorMaster`` with no monitor enabled: scripts check ``enabled`` before they write."""

    enabled = False
    tb_monitor = wandb_monitor = csv_monitor = comet_monitor = None

    def write_events(self, event_list) -> None:
        """Nothing is written: LazyTrain has no monitors (log from the training loop)."""


class NoParameterOffloadHooks:
    """``optimizer.parameter_offload`` at stage 3, for code that takes DeepSpeed's ZeRO-3 module hooks off the
    model around a generation and puts them back (TRL's ``unwrap_model_for_generation``: GRPO, RLOO, online DPO,
    GKD). Why: LazyTrain registers no such hooks (its blocks stream whatever the stage, and a
    ``GatheredParameters`` scope gathers what stage 3 partitions), so there is nothing to take off; ``module``
    holds no parameter, the hook lists are empty, and registering them again does nothing. At stage 3 without an
    optimizer it is ``engine.optimizer`` itself, as DeepSpeed's ``DeepSpeedZeRoOffload`` is there (a Trainer's
    ``evaluate()`` before its first training step generates through it); anything else asked of it is refused
    by name."""

    class _NoParameters:
        def named_parameters(self, prefix: str = "", recurse: bool = True):
            return iter(())

        def ds_external_parameters(self):
            return []

    def __init__(self):
        self.module = self._NoParameters()
        self.forward_hooks: list = []
        self.backward_hooks: list = []

    def _register_deepspeed_module(self, module, count=None) -> None:
        """DeepSpeed's re-registration of the hooks: LazyTrain has none to register."""

    _register_hooks_recursively = _register_deepspeed_module   # its name before DeepSpeed renamed it (older TRL)

    def __getattr__(self, name: str):
        raise AttributeError(f"'{name}': this is no optimizer but the (empty) module hooks of ZeRO stage 3, which "
                             f"engine.optimizer is when the engine has no optimizer, as in DeepSpeed; to train, add "
                             f"an 'optimizer' section to the config or pass one to initialize")
