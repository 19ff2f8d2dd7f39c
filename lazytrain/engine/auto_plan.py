"""Policy "auto": plan from measurements of this model on this machine, and plan again when they drift.

Why: a cost model fitted to another machine's figures predicts this one's step only roughly, and the
engine can measure it. The run starts on a calibration plan that keeps every boundary on the host, so
that each layer has a plain forward, a re-run with its backward and an overlapped update of its own in a
traced step. After ``warmup_steps`` steps it traces ``profile_steps`` steps, then (``selective``) as many
of the same plan with every layer selective after one more warm-up step (as many layers as the device
has room for the outputs they keep, when not every one: the others take their kind's times), takes the
medians of each layer's times, a selective layer's, and each link's bandwidth from them
(planner/measured.py), plans with the MILP from those
(planner/search.py ``plan_from_profile``), and puts that plan in place at a step boundary. Every
``check_every`` steps it compares the median measured step with the plan's prediction; beyond
``drift_margin`` it measures and plans again, at most ``max_replans`` times. Each plan and each
comparison is in :attr:`AutoPlanner.history` and printed on rank 0.

The engine supplies what this needs as callables (:class:`AutoPlanHooks`), so that the timing of
measuring and planning lives here and the mechanisms stay in the engine: tracing a step, switching plans,
and deciding once for every rank (rank 0 measures and plans, every rank switches at the same step).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Callable

from ..config import AutoPlanConfig
from ..planner.measured import UNDIFFERENTIATED, MachineProfile, MeasurementError, ran_an_undifferentiated_forward
from ..planner.plan import Plan
from .distributed import CollectiveError


SELECTIVE_WARMUP_STEPS = 1   # after the switch to the selective calibration, one step before tracing
MIXED_STEPS_ALLOWED = 4      # traced steps with an undifferentiated forward left out before auto stops


@dataclass
class PlanRecord:
    """A plan put in place after ``step`` steps, its predicted step, and the median step measured on it at
    each check: ``checks`` holds every one, (after step, median s, steps), ``measured_*`` the latest."""
    step: int
    policy: str
    reason: str
    predicted_step_s: float | None
    measured_step_s: float | None = None
    measured_steps: int = 0
    checks: list = field(default_factory=list)

    def line(self) -> str:
        said = f"[lazytrain] auto plan after step {self.step} ({self.reason}): {self.policy}, predicted " + \
            (f"{self.predicted_step_s * 1e3:.1f} ms/step" if self.predicted_step_s else "no prediction")
        if self.measured_step_s is not None:
            said += f", measured {self.measured_step_s * 1e3:.1f} ms/step over {self.measured_steps} steps"
            if self.predicted_step_s:
                said += f" ({self.measured_step_s / self.predicted_step_s:.3f}x the prediction)"
        return said


@dataclass
class AutoPlanHooks:
    request_trace: Callable[[], None]              # trace the next step
    last_trace: Callable[[], object]               # the step just traced (a Timeline)
    switch: Callable[[Plan], None]                 # put a plan in place (between steps)
    # traced steps (plain; with the given layers selective, or None) -> profile
    profile_of: Callable[[list, list | None, tuple], MachineProfile]
    plan_from: Callable[[MachineProfile], Plan]    # plan from a profile (the MILP)
    on_rank0: Callable[[Callable[[], object]], object]   # computed on rank 0, the same answer on every rank
    say: Callable[[str], None]                     # report (rank 0 prints)
    warn: Callable[[str], None]                    # a warning (every rank)
    current_policy: Callable[[], str]              # the plan in place, by its policy's name
    save_profile: Callable[[MachineProfile], None] | None = None
    # the layers whose kept outputs the device can hold beside the plain calibration's peak, and why not every
    # one (None when every one; no layer when some kind of layer cannot have one): the same on every rank
    selective_layers_to_measure: Callable[[], tuple] = lambda: (None, None)
    micro_batches: Callable[[], int] = lambda: 1     # forwards and backwards in an optimizer step


@dataclass
class AutoPlanner:
    settings: AutoPlanConfig
    calibration: Plan                              # keeps every boundary on the host
    hooks: AutoPlanHooks
    history: list[PlanRecord] = field(default_factory=list)
    last_profile: MachineProfile | None = None     # what the plan in place was made from
    stopped: str | None = None                     # why policy auto stopped (it keeps the plan in place)
    measuring: bool = True
    _steps_in_phase: int = 0
    _selective_phase: bool = False                 # measuring the calibration plan with every layer selective
    _plain_traces: list = field(default_factory=list)   # the plain calibration's, meanwhile
    _selective_layers: tuple = ()                  # the layers the selective calibration makes selective
    _traces: list = field(default_factory=list)
    _times: list = field(default_factory=list)
    _replans: int = 0
    _mixed: int = 0                                # traced steps left out: a forward in them was never differentiated
    _last_plan: Plan | None = None                 # the last plan made (back to it when measuring again fails)
    _measuring_why: str | None = None              # why it measures again, when the script asked it to
    _pending_micro: tuple[int, str] | None = None   # a new step shape: measure again after the step under way

    def start(self, saved: MachineProfile | None = None) -> None:
        """Before the first step: plan from a saved profile, or measure first."""
        if saved is not None:
            self._plan(saved, step=0, reason=f"from the saved profile {self.settings.profile}")
        else:
            self._measure_next()

    def after_step(self, step: int, seconds: float) -> None:
        """After each optimizer step: ``step`` steps done, the last one took ``seconds`` (first forward to the
        end of step()). Measuring or planning that fails (an infeasible budget, a profile that cannot be
        written) warns and stops policy auto, leaving the run on the plan it has: the step itself
        completed, and training goes on."""
        if self.stopped:
            return
        try:
            if self._pending_micro is not None:
                (micro, why), self._pending_micro = self._pending_micro, None
                self._restart_at(micro, why)
                return
            self._after_step(step, seconds)
        except CollectiveError:   # a rank failed or hung: this rank cannot go on alone, as anywhere in a step
            raise
        except Exception as e:   # noqa: BLE001 - the step completed; the run keeps a plan
            self.stopped = f"{type(e).__name__}: {e}"
            self._traces, self._times = [], []
            # measuring again after drift: back to the plan it had; before any (or at a new micro-batch), the
            # plain calibration plan, not the one with every layer selective that measures them
            back = self._last_plan if self._last_plan is not None else self.calibration
            if self.hooks.current_policy() != back.policy:
                self.hooks.switch(back)
            self.hooks.warn(f"lazytrain: policy \"auto\" stopped after step {step} and keeps the plan "
                            f"{self.hooks.current_policy()}: {self.stopped}")

    def measure_again(self, micro_batch: int, why: str) -> None:
        """The step changed shape (``set_train_micro_batch_size``, or ``set_train_batch_size``: another number
        of micro-batches a step): what was measured and planned is another step's, so once the step under way
        (or, between steps, the next) is done, the calibration plan runs again at the new shape and a new plan
        follows (not counted against ``max_replans``: the script asked for it). That step itself is measured by
        nothing: it may hold micro-batches of both sizes, and its traces are divided by the new count."""
        self._pending_micro = (micro_batch, why)

    def _restart_at(self, micro_batch: int, why: str) -> None:
        self.calibration = dataclasses.replace(self.calibration, micro_batch_size=micro_batch)
        self._measuring_why = f"measured again {why}"
        self.measuring, self._steps_in_phase, self._traces, self._times = True, 0, [], []
        self._selective_phase, self._plain_traces, self._mixed = False, [], 0
        self._last_plan = None   # another micro-batch's: measuring that fails from here keeps the calibration plan
        self.hooks.switch(self.calibration)
        self._measure_next()

    def selective_calibration(self, layers: tuple) -> Plan:
        """The calibration plan with ``layers`` selective: its traces give a selective layer's costs."""
        return dataclasses.replace(self.calibration, selective_layers=tuple(layers),
                                   policy="auto-calibration-selective")

    def _warmup(self) -> int:
        return SELECTIVE_WARMUP_STEPS if self._selective_phase else self.settings.warmup_steps

    def _after_step(self, step: int, seconds: float) -> None:
        s = self.settings
        if self.measuring:
            if self._steps_in_phase >= self._warmup():
                trace = self.hooks.last_trace()   # None: this step was not traced, or was skipped
                # rank 0's verdict on its own trace, asked on every rank whether or not it traced this step (a
                # script's own trace_next_step() on one rank drops that rank's): the ranks count the same steps,
                # and rank 0's traces are the ones profiled
                verdict = self.hooks.on_rank0(lambda: _verdict(trace, self.hooks.micro_batches()))
                if verdict == "mixed":
                    self._mixed += 1              # an evaluation in it: measure another step
                    if self._mixed > MIXED_STEPS_ALLOWED:
                        raise MeasurementError(f"{self._mixed} traced steps each {UNDIFFERENTIATED}")
                elif verdict == "traced":
                    self._traces.append(trace)   # None on another rank that traced nothing: only counted
            self._steps_in_phase += 1
            if len(self._traces) < s.profile_steps:
                self._measure_next()
                return
            if s.selective and not self._selective_phase:   # now the same plan with (some) layers selective
                layers, why = self.hooks.selective_layers_to_measure()
                L = self.calibration.num_layers
                layers = tuple(range(L)) if layers is None else tuple(layers)
                if layers:
                    if why is not None:
                        self.hooks.say(f"[lazytrain] auto measures selective layers on {len(layers)} of {L} layers "
                                       f"({list(layers)}), the others taking their kind's times: {why}")
                    self._plain_traces, self._traces = self._traces, []
                    self._selective_phase, self._steps_in_phase = True, 0
                    self._selective_layers = layers
                    self.hooks.switch(self.selective_calibration(layers))
                    self._measure_next()
                    return
                if why is not None:   # none, with no why: no block is re-run in a backward (a frozen bottom)
                    self.hooks.warn(f"lazytrain: policy \"auto\" does not measure selective layers, so its plan has "
                                    f"none: {why}, not even one layer of each kind")
            plain, selective = (self._plain_traces, self._traces) if self._selective_phase else (self._traces, None)
            chosen = self._selective_layers
            profile = self.hooks.on_rank0(lambda: self._profile_saved(plain, selective, chosen))
            reason = self._measuring_why or ("measured" if not self.history else "measured again after drift")
            self._plan(profile, step, reason)
            self._measuring_why = None
            return
        self._times.append(seconds)
        if len(self._times) < s.check_every:
            return
        record = self.history[-1]
        measured = statistics.median(self._times)
        record.measured_step_s, record.measured_steps = measured, len(self._times)
        record.checks.append((step, measured, len(self._times)))
        self._times = []
        self.hooks.say(record.line())
        drifted = self.hooks.on_rank0(lambda: record.predicted_step_s is not None and
                                      abs(measured / record.predicted_step_s - 1) > s.drift_margin)
        if drifted and self._replans < s.max_replans:
            self._replans += 1
            self.measuring, self._steps_in_phase, self._traces = True, 0, []
            self._mixed = 0   # steps with an undifferentiated forward are counted per measurement
            self._selective_phase, self._plain_traces = False, []
            self.hooks.switch(self.calibration)
            self._measure_next()

    def _profile_saved(self, traces: list, selective: list | None, layers: tuple) -> MachineProfile:
        profile = self.hooks.profile_of(traces, selective, layers)
        if self.hooks.save_profile is not None:
            try:
                self.hooks.save_profile(profile)
            except OSError as e:   # the plan does not need the file: plan anyway, and say so
                self.hooks.warn(f"lazytrain: policy \"auto\" could not save its profile ({type(e).__name__}: {e}); "
                                f"it plans from it all the same")
        return profile

    def _measure_next(self) -> None:
        if self._steps_in_phase >= self._warmup():
            self.hooks.request_trace()

    def _plan(self, profile: MachineProfile, step: int, reason: str) -> None:
        plan = self.hooks.on_rank0(lambda: self.hooks.plan_from(profile))
        self.last_profile = profile
        self.hooks.switch(plan)
        self._last_plan = plan
        predicted = (plan.prediction or {}).get("step_time_s")
        self.history.append(PlanRecord(step=step, policy=plan.policy, reason=reason, predicted_step_s=predicted))
        self.hooks.say(self.history[-1].line())
        self.measuring, self._traces, self._times = False, [], []
        self._selective_phase, self._plain_traces = False, []


def _verdict(trace, micro_batches: int = 1) -> str | None:
    """What a traced step of ``micro_batches`` forwards and backwards counts as: not traced (None), ``"mixed"``
    (an evaluation in it) or ``"traced"``."""
    if trace is None:
        return None
    return "mixed" if ran_an_undifferentiated_forward(trace, micro_batches) else "traced"
