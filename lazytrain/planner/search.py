"""Planning entry points: :func:`plan_for` (one micro-batch, or the best one) and the outer search
over micro-batch sizes (the largest throughput that fits the budgets)."""
from __future__ import annotations

import inspect
import math
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any

from .hardware import MAX_GBPS, HardwareProfile, load_profile
from .isolate import DeadlineExceededError, call_with_deadline
from .milp import MilpOptions, NoPlanInTimeError, PlanningError, build_and_solve, isolated_deadline_s
from .models import ModelShape, ModelShapeError, load_model
from .plan import Plan, PlanError
from .problem import Budgets, InfeasibleBudgetError, Problem
from .simulate import BUDGET_ROUNDING, simulate


def as_model_shape(model_shape: Any) -> ModelShape:
    """A ModelShape from: a ModelShape; a Hugging Face config dict (``model.config.to_dict()``); a dict of
    explicit per-layer numbers ``{"name", "layer_params": [...], "hidden", "vocab_size", ...}`` (see
    :meth:`ModelShape.from_layers`); a catalog name; or a path to a config.json."""
    if isinstance(model_shape, dict) and "layer_params" in model_shape and not _is_hf_config(model_shape):
        d = dict(model_shape)
        known = set(inspect.signature(ModelShape.from_layers).parameters) - {"cls"}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise ModelShapeError(f"a model of explicit layers takes {', '.join(sorted(known))}; "
                                  f"unknown: {', '.join(map(repr, unknown))}")
        if "hidden" not in d:
            raise ModelShapeError("a model of explicit layers needs 'hidden' (the hidden size) beside 'layer_params'")
        return ModelShape.from_layers(d.pop("name", "model"), d.pop("layer_params"), **d)
    return load_model(model_shape)


def _is_hf_config(d: dict) -> bool:
    """A Hugging Face config (which the engine gives measured ``layer_params`` too), not explicit layers."""
    return any(k in d for k in ("model_type", "hidden_size", "text_config"))


def as_budgets(budgets: Any) -> Budgets:
    if budgets is None:
        return Budgets()
    if isinstance(budgets, Budgets):
        return budgets
    if isinstance(budgets, dict):
        d = dict(budgets)
        return Budgets.of(gpu=d.pop("gpu", None), host=d.pop("host", None), nvme=d.pop("nvme", None), **d)
    raise TypeError(f"budgets must be a Budgets or a dict like {{'gpu': '70GB'}}, got {type(budgets).__name__}")


def solve(p: Problem, opts: MilpOptions) -> Plan:
    """Solve the MILP for ``p``, replay the plan in the simulator (strict: a violated invariant raises)
    and record the simulator's prediction in the Plan. With ``opts.isolate`` the solve runs in a child
    process, stopped when it overruns its time limit and solved again without HiGHS's root reduced-cost
    heuristic (:func:`_isolated_solve`); when that overruns too, as when the solver found no plan in its
    time, the plan it started from (else the fastest baseline) is returned, with a warning; so is the fastest
    baseline that fits where the MILP finds no plan in its space (:func:`_outside_the_milps_space`)."""
    t0 = time.perf_counter()
    start = _start_plans(p, opts) if opts.warm_start else []
    # the limit bounds the whole call: finding the start plan (simulations) counts against it
    opts = replace(opts, time_limit_s=max(opts.time_limit_s - (time.perf_counter() - t0), 0.01))
    try:
        plan, info = (_isolated_solve(p, opts, start) if opts.isolate else build_and_solve(p, opts, start_plan=start))
        if _over_a_budget_by_a_tolerance(p, plan):
            # the solver's tolerances (a binary 1e-6 off its value, times gigabytes) let its solution sit a few
            # hundred bytes over a budget, which the plan, its binaries rounded, overran: solved again with a
            # millionth of each budget kept aside, in the time left
            opts = replace(opts, budget_share=1.0 - 1e-6,
                           time_limit_s=max(opts.time_limit_s - (time.perf_counter() - t0), 0.01))
            plan, info = (_isolated_solve(p, opts, start) if opts.isolate else
                          build_and_solve(p, opts, start_plan=start))
    except (NoPlanInTimeError, DeadlineExceededError) as e:
        return _fallback(p, e, time.perf_counter() - t0, start[0] if start else None, opts)
    except InfeasibleBudgetError as e:
        return _outside_the_milps_space(p, e, time.perf_counter() - t0, opts)
    r = simulate(p, plan, strict=True, timeline=False)
    return _predicted(p, plan, r, info.to_dict(), time.perf_counter() - t0, milp_step_time_s=info.objective_s,
                      milp_vs_simulator=(info.objective_s / r.step_time_s - 1) if info.objective_s else None)


def _over_a_budget_by_a_tolerance(p: Problem, plan: Plan) -> bool:
    """Whether ``plan`` overruns a memory budget by more than float rounding (which the strict simulation takes,
    ``BUDGET_ROUNDING``) and no more than a millionth of it (a solver's tolerance, not a plan that does not fit:
    that one the strict simulation refuses as it did)."""
    peaks = simulate(p, plan, strict=False, timeline=False).peak_bytes
    over = [(peaks[t] - b) / max(b, 1) for t, b in (("hbm", p.gpu_budget), ("host", p.host_budget),
                                                     ("nvme", p.nvme_budget)) if peaks.get(t, 0) > b]
    return bool(over) and BUDGET_ROUNDING < max(over) <= 1e-6


def _isolated_solve(p: Problem, opts: MilpOptions, start: list[Plan]):
    """build_and_solve in a child process stopped at its deadline; one that overran is solved again without
    HiGHS's root reduced-cost heuristic, which is what overran where it was seen."""
    def attempt(o: MilpOptions):
        return call_with_deadline(build_and_solve, p, replace(o, isolate=False), start_plan=start,
                                  deadline_s=isolated_deadline_s(o), what="the MILP solver", advice="")
    try:
        return attempt(opts)
    except DeadlineExceededError:
        if not opts.root_reduced_cost_heuristic:
            raise
    plan, info = attempt(replace(opts, root_reduced_cost_heuristic=False))
    info.detail += ("; solved again without the root reduced-cost heuristic after a first solve overran its "
                    "time limit")
    return plan, info


# of the time limit, what the start plans' simulations beyond keep-all's few may take, each estimated at
# SIMULATION_S_PER_LAYER a layer (7-10 ms at 48 layers on a slow shared core): the same plans for the same
# problem and limit on any machine
START_PLANS_SHARE = 0.1
SIMULATION_S_PER_LAYER = 2e-4


def _start_plans(p: Problem, opts: MilpOptions) -> list[Plan]:
    """The baseline plans that fit and that the options allow, fastest first: the solver starts from the first
    that lies in its space, so it holds a plan from its first moment and returns none slower than that one.
    Keep-all (at most three simulations) always; greedy and the best interval (about one and two simulations
    a layer) where they fit in ``START_PLANS_SHARE`` of the time limit. Where the options require a graph
    tail, each is taken with its last segment keeping its graph, where that fits."""
    from .policies import best_interval_plan, greedy_plan, keep_all
    found, estimate = [_allowed(p, opts, keep_all(p))], 0.0
    for baseline, simulations in ((greedy_plan, p.L + 1), (best_interval_plan, 2 * p.L)):
        estimate += simulations * p.L * SIMULATION_S_PER_LAYER
        if estimate <= START_PLANS_SHARE * opts.time_limit_s:
            found.append(_allowed(p, opts, baseline(p)))
    return [plan for plan, _ in sorted((f for f in found if f is not None), key=lambda f: f[1].step_time_s)]


def _allowed(p: Problem, opts: MilpOptions, found):
    """A baseline's (plan, simulation) as the options allow it: with the graph tail its last segment keeps
    its graph where they require one (None where that does not fit), none where they rule one out."""
    if found is None:
        return None
    plan, r = found
    if opts.require_graph_tail and not plan.last_segment_graph:
        try:
            plan = replace(plan, last_segment_graph=True)
        except PlanError:   # e.g. an offloaded layer in what would be the tail
            return None
        r = simulate(p, plan, strict=False, timeline=False)
        return None if r.violations else (plan, r)
    if plan.last_segment_graph and not opts.allow_graph_tail:
        return None
    return plan, r


def _predicted(p: Problem, plan: Plan, r, solver: dict, wall: float, **extra) -> Plan:
    """``plan`` with the simulator's result ``r`` and how it was found recorded as its prediction."""
    pred = {"step_time_s": r.step_time_s, "tflops": r.tflops, "tokens_per_s": r.tokens_per_s,
            "exposed_s": r.exposed_s, "peak_bytes": r.peak_bytes, "recomputed_layers": r.recomputed_layers,
            "boundaries_per_home": r.boundaries_per_home, "selective_layers": r.selective_layers,
            "offloaded_layers": r.offloaded_layers,
            **extra, "solver": solver,
            "lower_bound_s": p.lower_bound_s()["bound"], "model": p.model.name, "hardware": p.hardware.name,
            # the model's shape as counted: the engine warns where a plan file meets another model's blocks
            "layer_params": [layer.params for layer in p.model.layers], "dtype_bytes": p.model.dtype_bytes,
            "grad_accum": p.grad_accum,
            # the lowest block the backward was counted to reach (Budgets.frozen_bottom_layers): the engine checks it
            "frozen_bottom_layers": p.first_reached,
            # tokens per piece of the LM head's logits the plan counted: the engine warns where it computes more
            "loss_chunk_tokens": min(p.budgets.loss_chunk_tokens, p.micro_batch * p.seq_len),
            "solve_wall_s": wall}
    return replace(plan, prediction=pred)


def _fallback(p: Problem, error: PlanningError, wall: float, start: Plan | None = None,
              opts: MilpOptions = MilpOptions()) -> Plan:
    """When the solver found no plan in its time (a large model on a short limit) or overran it: the plan it
    was to start from, else the fastest baseline policy that fits (as the options allow it); a plan that runs,
    said to be one, rather than none."""
    from .policies import BASELINES
    if start is not None:
        found = [(start, simulate(p, start, strict=True, timeline=False))]
    else:
        found = [r for r in (_allowed(p, opts, f(p)) for f in BASELINES.values()) if r is not None]
    if not found:
        raise error
    plan, r = min(found, key=lambda pr: pr[1].step_time_s)
    what = "the plan it started from" if start is not None else "the fastest baseline policy that fits"
    warnings.warn(f"lazytrain planner: {error}; using {what} instead, "
                  f"{plan.policy!r} (predicted step {r.step_time_s:.3f}s). Raise the time limit for the MILP's plan",
                  UserWarning, stacklevel=3)
    return _predicted(p, plan, r, {"status": f"no plan in time, fell back to {plan.policy}", "detail": str(error)},
                      wall, fallback=plan.policy)


def _outside_the_milps_space(p: Problem, error: InfeasibleBudgetError, wall: float, opts: MilpOptions) -> Plan:
    """When the MILP finds no plan that fits: the fastest baseline that fits and that the options allow, if one
    does, with a warning, else ``error``. The MILP's space is narrower than the plans the engine runs: below a
    frozen bottom it keeps one segment [0, f) and boundary f, where a segment crossing f (re-running frozen
    layers) holds one boundary less, and at the tightest budgets only such a plan fits."""
    from .policies import BASELINES
    K = max(1, min(opts.max_segment, p.L))
    found = [r for r in (_allowed(p, opts, f(p)) for f in BASELINES.values()) if r is not None
             and all(e - s <= K or e <= p.first_reached for s, e in r[0].segments())]
    if not found:
        raise error
    plan, r = min(found, key=lambda pr: pr[1].step_time_s)
    warnings.warn("lazytrain planner: the MILP found no plan that fits within its plan space"
                  + (f" (below the frozen bottom, one segment [0, {p.first_reached}) kept apart)"
                     if p.first_reached else "")
                  + f"; using the fastest baseline policy that fits, {plan.policy!r} "
                  f"(predicted step {r.step_time_s:.3f}s)", UserWarning, stacklevel=3)
    return _predicted(p, plan, r, {"status": f"no plan in the MILP's space, fell back to {plan.policy}",
                                   "detail": str(error)}, wall, fallback=plan.policy)


@dataclass
class BatchTrial:
    micro_batch: int
    tokens_per_s: float | None
    status: str


def largest_static_batch(model: ModelShape, hw: HardwareProfile, budgets: Budgets, seq_len: int,
                         max_batch: int = 4096) -> int:
    """The largest micro-batch whose per-window minimum (one layer's activations, buffers, static
    bytes) fits the budgets; 0 when even 1 does not."""
    def ok(b: int) -> bool:
        try:
            Problem(model=model, hardware=hw, budgets=budgets, micro_batch=b, seq_len=seq_len)
            return True
        except InfeasibleBudgetError:
            return False
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_batch and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def search_micro_batch(model: ModelShape, hw: HardwareProfile, budgets: Budgets, seq_len: int,
                       opts: MilpOptions = MilpOptions(), max_batch: int = 4096,
                       max_plans: int = 14, global_batch: int | None = None) -> tuple[Plan, list[BatchTrial]]:
    """Outer search: the micro-batch with the largest planned throughput that fits the budgets.

    ``global_batch`` (samples per optimizer step on this GPU, as a config's ``train_batch_size`` over the
    ranks fixes it): only its divisors are tried, largest first, each with the gradient accumulation that
    completes the batch (the optimizer's step is then the same whatever the micro-batch), and throughput
    counts the whole step. A divisor whose step floor (ceiling.step_floor, an LP solved in milliseconds: no
    plan of the space is faster) is no faster than the best plan found is skipped without a MILP. Without
    it, one micro-batch per step and the search below.

    1. the largest micro-batch passing the static check (bisection, no MILP);
    2. the largest one the MILP can plan (bisection below it when that one has no plan);
    3. a scan of powers of two below it, then a ternary search between the best one's neighbours.
       Throughput need not rise with the batch: larger batches amortise weight copies and the
       optimizer, but small ones let more layers keep their forward graph (no re-run in backward), and
       close to the memory limit boundaries wait for their copies, so the curve can have two peaks.
       At most ``max_plans`` MILP solves in all; every trial is returned so callers can show the curve."""
    _check_global_batch(global_batch)
    trials: list[BatchTrial] = []
    plans: dict[int, Plan] = {}
    failed: set[int] = set()

    def attempt(b: int) -> Plan | None:
        if b in plans or b in failed:
            return plans.get(b)
        try:
            p = Problem(model=model, hardware=hw, budgets=budgets, micro_batch=b, seq_len=seq_len,
                        grad_accum=global_batch // b if global_batch else 1)
            plan = solve(p, opts)
        except (InfeasibleBudgetError, PlanningError) as e:
            trials.append(BatchTrial(b, None, f"infeasible: {str(e).split(':')[0]}"))
            failed.add(b)
            return None
        trials.append(BatchTrial(b, plan.prediction["tokens_per_s"], plan.prediction["solver"]["status"]))
        plans[b] = plan
        return plan

    def solves() -> int:   # MILP solves (and refused Problems) so far; a floor-skipped divisor is not one
        return len(plans) + len(failed)

    def tps(b: int) -> float:
        plan = attempt(b)
        return plan.prediction["tokens_per_s"] if plan else -1.0

    hi = largest_static_batch(model, hw, budgets, seq_len, max_batch if global_batch is None else global_batch)
    if hi == 0:
        Problem(model=model, hardware=hw, budgets=budgets, micro_batch=1, seq_len=seq_len)  # raises, named
    if global_batch is not None:   # the divisors that fit, largest first (fewest copies of each weight)
        for b in sorted((d for d in range(1, hi + 1) if global_batch % d == 0), reverse=True):
            if solves() >= max_plans:
                break
            floor = _floor_s(model, hw, budgets, b, seq_len, global_batch // b) if plans else None
            best_s = min((pl.prediction["step_time_s"] for pl in plans.values()), default=None)
            if floor is not None and best_s is not None and floor >= best_s:
                trials.append(BatchTrial(b, None, f"skipped: its step floor {floor:.4g} s is no faster than the "
                                                  f"best plan's {best_s:.4g} s"))
                continue
            attempt(b)
        if not plans:
            raise InfeasibleBudgetError(f"no micro-batch dividing the global batch {global_batch} fits the "
                                        f"budgets ({trials[-1].status if trials else 'none passed the static check'})")
        best = max(plans.values(), key=lambda pl: (pl.prediction["tokens_per_s"], pl.micro_batch_size))
        return best, sorted(trials, key=lambda t: t.micro_batch)
    if attempt(hi) is None:
        lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(mid) is not None:
                lo = mid
            else:
                hi = mid
        if lo == 0:
            raise InfeasibleBudgetError(f"no micro-batch fits the budgets ({trials[-1].status})")
        hi = lo
    grid = sorted({hi} | {1 << k for k in range(hi.bit_length()) if 1 << k < hi})
    for b in reversed(grid):                    # largest first: they are the likeliest optimum
        if solves() >= max_plans - 2:
            break
        attempt(b)
    scanned = [b for b in grid if b in plans]
    top = max(scanned, key=lambda b: (tps(b), b))
    k = grid.index(top)
    lo, hi = grid[max(0, k - 1)], grid[min(len(grid) - 1, k + 1)]
    while hi - lo > 2 and solves() + 2 <= max_plans:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if tps(m1) < tps(m2):
            lo = m1
        else:
            hi = m2
    for b in range(lo, hi + 1):
        if solves() >= max_plans:
            break
        attempt(b)
    best = max(plans.values(), key=lambda pl: (pl.prediction["tokens_per_s"], pl.micro_batch_size))
    return best, sorted(trials, key=lambda t: t.micro_batch)


def _floor_s(model: ModelShape, hw: HardwareProfile, budgets: Budgets, micro_batch: int, seq_len: int,
             grad_accum: int) -> float | None:
    """The step floor at ``micro_batch`` (None where it does not fit: the MILP attempt says why)."""
    from .ceiling import step_floor
    try:
        p = Problem(model=model, hardware=hw, budgets=budgets, micro_batch=micro_batch, seq_len=seq_len,
                    grad_accum=grad_accum)
    except InfeasibleBudgetError:
        return None
    return step_floor(p, offload=True).step_s


def _check_global_batch(global_batch) -> None:
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")


def plan_for(model_shape: Any, hardware: Any, budgets: Any = None, micro_batch: "int | None" = None,
             seq_len: int = 1024, time_limit_s: float = 10.0, base: str | None = None,
             options: MilpOptions | None = None, global_batch: int | None = None) -> Plan:
    """Plan one training step: the function the engine calls.

    - ``model_shape``: a Hugging Face config dict (e.g. ``model.config.to_dict()``), a dict of explicit
      per-layer numbers (``{"layer_params": [...], "hidden": ..., "vocab_size": ...}``), a
      :class:`ModelShape`, a catalog name (``qwen2.5-7b``) or a config.json path;
    - ``hardware``: a :class:`HardwareProfile`, a catalog name (``h800``), a profile dict or a JSON path
      written by ``lazytrain bench tiers`` (``base`` fills its null fields from a catalog entry);
    - ``budgets``: a :class:`Budgets` or a dict ``{"gpu": "70GB", "host": "512GB", "nvme": "0"}`` (other
      :class:`Budgets` fields may be given too, e.g. ``"loss_chunk_tokens"`` when the model's LM head
      materialises more logits at once than the default 2048 tokens);
    - ``micro_batch``: an int, or None to search for the throughput-best micro-batch that fits;
    - ``global_batch``: samples per optimizer step to keep fixed (gradient accumulation fills it): with a
      given ``micro_batch`` it must divide it; in a search only its divisors are tried;
    - ``time_limit_s``: the MILP's time limit (per solve).

    Returns the Plan with ``prediction`` filled by the simulator (step time, TFLOPS, tokens/s, exposed
    time per link, peak bytes per tier) and the solver's status. Raises InfeasibleBudgetError (naming
    what does not fit) or PlanningError."""
    model = as_model_shape(model_shape)
    hw = load_profile(hardware, base=base)
    b = as_budgets(budgets)
    opts = replace(options or MilpOptions(), time_limit_s=time_limit_s)
    if micro_batch is None:
        return search_micro_batch(model, hw, b, seq_len, opts, global_batch=global_batch)[0]
    mb = micro_batch
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ValueError(f"micro_batch must be a positive integer or None (search), got {mb!r}")
    _check_global_batch(global_batch)
    if global_batch is not None and global_batch % mb:
        raise ValueError(f"micro_batch {mb} does not divide global_batch {global_batch}")
    return solve(Problem(model=model, hardware=hw, budgets=b, micro_batch=mb, seq_len=seq_len,
                         grad_accum=global_batch // mb if global_batch is not None else 1), opts)


def plan_from_profile(profile, budgets: Any = None, hardware: Any = None, time_limit_s: float = 10.0,
                      global_batch: int | None = None, options: MilpOptions | None = None,
                      memory: dict | None = None, as_measured: bool = True) -> Plan:
    """Plan from a :class:`~lazytrain.planner.measured.MachineProfile` (what policy "auto" measured): the
    MILP's plan for :func:`profile_problem`. ``as_measured``: planned as the run measured ran
    (:func:`as_the_run_measured`; selective layers only where their re-runs were measured); the engine, which
    passes its own config's budgets and options, plans with those."""
    opts = replace(options or MilpOptions(), time_limit_s=time_limit_s)
    if as_measured and profile.costs.selective_rerun_s is None:
        opts = replace(opts, allow_selective=False)
    if as_measured:
        budgets = as_the_run_measured(profile, as_budgets(budgets))
    return solve(profile_problem(profile, budgets, hardware, global_batch, memory), opts)


def as_the_run_measured(profile, budgets: Budgets) -> Budgets:
    """``budgets`` with what ``profile`` recorded of the run it measured: where its weights streamed from and its
    non-block optimizer state lived (the engine's weights_home and non_block_state), and, measured on the CPU,
    no CUDA context, workspace or allocator to hold back."""
    budgets = replace(budgets, **{k: getattr(profile, k) for k in ("weights_in_host", "non_block_state")
                                  if getattr(profile, k) is not None})
    return replace(budgets, gpu_reserved_bytes=0) if profile.device == "cpu" else budgets


def profile_problem(profile, budgets: Any = None, hardware: Any = None, global_batch: int | None = None,
                    memory: dict | None = None) -> Problem:
    """The planning problem of a measured profile: its measured compute and update times replace the FLOP
    model, its measured links replace the hardware profile's. ``hardware`` (optional) supplies what was not
    measured (links no traced copy used, memory sizes); without it, a profile named after the measurement
    is built from the measured values, its memory sizes the budgets' (else 64 GiB). ``memory``
    (``gpu_mem_bytes``, ``host_mem_bytes``): the sizes of the machine planned for, over either (the engine
    passes the card's own: a catalog entry, or the 64 GiB default, may be smaller than the card)."""
    from .hardware import GiB
    # the layers the measured backwards did not reach (a frozen bottom) are the run's own, whatever was guessed
    budgets = replace(as_budgets(budgets), frozen_bottom_layers=profile.costs.first_differentiated)
    memory = {k: int(v) for k, v in (memory or {}).items() if v}
    unknown = set(memory) - {"gpu_mem_bytes", "host_mem_bytes"}
    if unknown:
        raise ValueError(f"memory takes gpu_mem_bytes and host_mem_bytes, got {sorted(unknown)}")
    model = as_model_shape(profile.model)
    if len(model.layers) != profile.costs.num_layers:
        raise ValueError(f"the profile's costs are for {profile.costs.num_layers} layers, its model has "
                         f"{len(model.layers)}")
    # the measured rates, for what reads a rate rather than the measured times (the MegaTrain comparison's
    # host phase): the run's own, whichever profile supplies the rest
    T = profile.micro_batch * profile.seq_len
    c, f = profile.costs, profile.costs.first_differentiated   # layers below f ran no backward: their forward
    flops = sum((3 if i >= f else 1) * layer.fwd_flops_per_token(profile.seq_len) * T
                for i, layer in enumerate(model.layers))
    # the host optimizer's rate from the layers whose updates were timed whole: those above a frozen bottom where
    # all of theirs trained. A LoRA share's updates are mostly each call's fixed cost, not a rate per parameter:
    # then it is not measured, and a hardware profile's is used if given (only MegaTrain's host phase reads it)
    above = sum(layer.params for layer in model.layers[f:])
    timed = sum(c.diff_s[f:]) + sum(c.fwd_s[:f])
    if not timed > 0:
        raise ValueError(f"the profile's measured compute times (costs.diff_s from layer {f}, costs.fwd_s below it) "
                         f"are all zero: no compute rate can be read from them")
    rates = {"achievable_tflops": flops / timed / 1e12}
    # (nor from a sharded run's: each rank's update spans hold its own layers' updates and its waits for the
    # others', so their sum is no one process's rate)
    sharded = (profile.world_size or 1) > 1 and (profile.zero_stage or 0) >= 1
    if above and not sharded and profile.trainable_share * model.layer_params >= above * (1 - 1e-6):
        rates["host_optimizer_gparams_per_s"] = above / max(sum(c.update_s[f:]), 1e-9) / 1e9
    # a profile saved before links were bounded may hold a faster one (copies in place): counted at the bound
    links = {k: min(v, MAX_GBPS) for k, v in profile.links_gbps.items()}
    if hardware is not None:
        base = load_profile(hardware)
        # another card's datasheet peak below the rate this one measured: left unknown (as filled_from leaves it)
        peak = base.peak_tflops if (base.peak_tflops or math.inf) >= rates["achievable_tflops"] else None
        hw = replace(base, peak_tflops=peak, **rates, **links, **memory)
    else:
        hw = HardwareProfile(name=f"{profile.device} (measured)", **rates,
                             gpu_mem_bytes=memory.get("gpu_mem_bytes", budgets.gpu_bytes or 64 * GiB),
                             host_mem_bytes=memory.get("host_mem_bytes", budgets.host_bytes or 64 * GiB),
                             **links)
    gb = global_batch if global_batch is not None else profile.micro_batch
    if gb % profile.micro_batch:
        raise ValueError(f"the profile's micro-batch {profile.micro_batch} does not divide global_batch {gb}")
    return Problem(model=model, hardware=hw, budgets=budgets, micro_batch=profile.micro_batch,
                   seq_len=profile.seq_len, measured=profile.costs, grad_accum=gb // profile.micro_batch)
