"""The planner's MILP: recompute path, boundary homes, transfer windows and weight residency chosen
to minimise the step time itself.

It starts from the LazyTrain paper's model (a recompute path over candidate edges (s, e), one home per
materialised boundary, per-window transfer bytes, an NVMe tier) and removes its weaknesses:

- memory is time-indexed: each window has its own device / host / NVMe budget row, and a boundary
  occupies a tier only while it lives there (device: from production to its offload, and from its
  prefetch to its last use; host/NVMe: from its offload to its prefetch); weight buffers of the current
  and next window, gradient buffers, saved activations and transient workspaces count per window;
- transfers may run in any forward or backward window (within ``offload_slack`` windows after the
  boundary exists and ``prefetch_lead`` windows before its earliest possible use);
- layers may keep their weights resident on the GPU (saving their backward copies, and with gradient
  accumulation their forward copies after a step's first micro-batch);
- the last segment may keep its autograd graph from forward (``Plan.last_segment_graph``): its layers
  are not re-run in backward and stream no weights there, at the price of their saved internals, inputs
  and weights held on the GPU from their forward to their backward (binary ``graph_s``: the tail starts at s);
- a layer below the graph tail may be selective (``Plan.selective_layers``, binary ``sel_i``): its forward
  keeps its matmul and attention outputs (``sel_bytes``) on the GPU until its backward, and its re-runs
  (the forward part of its diff task, and its recompute when it is interior to a segment) take
  ``sel_rerun_s`` instead of ``fwd_s``; ``selrec[j,e]`` linearises "selective and recomputed in the
  window of the segment ending at e";
- a layer below the graph tail may be offloaded (``Plan.offloaded_layers``, binary ``offl_j``): a segment
  [j, j+1) of its own on the recompute path (boundary j not stored), its internals and input
  (``offl_bytes``) on the D2H link, on the host from window j to its backward, back on the H2D link in
  the backward windows ``offl_pre[j,w]`` (the share in its backward window exposed) and on the GPU from
  then on; its backward runs without a re-run. With ``split_internals`` (the default) the copies are
  shares: ``offl_out[j,w]`` of them leave in forward window w >= j (window j's when its forward ends,
  later ones as their window starts; what has not left holds the device), and ``offl_pre[j,w]`` come
  back in window w (each share on the device from then on): a slow link spreads a layer's copies over
  as many windows as it needs. Without, all leave in window j and come back in one window (binaries);
- a frozen bottom (``Problem.first_reached`` f > 0) is one path edge [0, f) of any length: boundaries 1..f-1
  are not stored, boundary 0 is never read back (no prefetch), layers below f keep no graph, outputs or
  internals, and their backward windows cost nothing (the brute force over every plan, those that keep frozen
  boundaries among them, finds no faster one; a segment across f, which holds one boundary less, may be the
  only plan that fits, and search.solve then returns the fastest baseline that fits);
- the objective is the step time: per window ``t_w >= compute + exposed prefetch wait`` and
  ``t_w >= bytes / bandwidth`` for each link, plus the delay the host optimizer imposes on the next
  forward (it overlaps the forward layer by layer), plus the last micro-batch's final gradient copy. The
  head's gradients, and an earlier micro-batch's final ones, share the link with the next
  ``GRAD_SHARE_WINDOWS`` windows (the first backward ones; the later micro-batch's first forward ones).

A window's memory row sums what each tier holds in it (_Held: terms held over a range of windows). Up to
``DENSE_ROWS_UP_TO`` layers the rows are written out, a boundary kept all step appearing in every row (the
model grows with the square of the layers; HiGHS solves these fastest); beyond, as running levels, each
term in two rows (linear in the layers; HiGHS's cut rounds on the written-out rows then ran far past the
time limit). ``MilpOptions.memory_rows`` chooses; both have the same plans and optimum.

The model is exactly the simulator's cost model (problem.py), so for a plan it returns, its objective
equals the simulated step time up to the tie-breakers (1e-6 relative) and the solver's feasibility
tolerance (HiGHS may leave a row short by 1e-6 s: on toy steps of 0.1 s, up to about 1e-5 relative); the
simulator re-checks every plan. Solved with HiGHS through PuLP (threads=1, fixed seed: deterministic), CBC as the fallback.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Sequence

import pulp

from .plan import DEVICE_HOME, RECOMPUTE, Plan
from .problem import GRAD_SHARE_WINDOWS, InfeasibleBudgetError, Problem, fmt_bytes



MEMORY_ROWS = ("auto", "dense", "running")   # how memory rows and prefix sums are written (MilpOptions.memory_rows)
# auto writes the rows out up to this many layers: HiGHS solved those models faster than the running levels
# (BENCHMARKS.md), whose size stays linear in the layers and whose cut rounds stay within the time limit
DENSE_ROWS_UP_TO = 128


@dataclass(frozen=True)
class MilpOptions:
    time_limit_s: float = 10.0      # the whole build_and_solve call, building included
    max_segment: int = 8            # longest recompute segment (edge e - s)
    offload_slack: int = 4          # an offload is issued within this many windows after the boundary exists
    prefetch_lead: int = 4          # a prefetch is issued at most this many windows before its earliest use
    allow_resident: bool = True
    allow_graph_tail: bool = True   # the last segment may keep its forward graph (no re-run in backward)
    require_graph_tail: bool = False   # ... and must (the engine's 'last_segment_graph' true)
    allow_selective: bool = True    # layers may keep their matmul/attention outputs (Plan.selective_layers)
    allow_offload: bool = True      # layers may send their internals to the host and back (Plan.offloaded_layers)
    split_internals: bool = True    # ... in shares over several windows (Plan.internals_offload_shares)
    internals_out_windows: int = 16   # an offloaded layer's internals leave within this many windows after its own
    gap_rel: float = 1e-4
    solver: str = "auto"            # auto | highs | cbc
    threads: int = 1
    warm_start: bool = True         # start from the fastest baseline plan that fits (an incumbent at once)
    memory_rows: str = "auto"       # running: sums over windows as running levels (model size linear in
                                    # layers); dense: each window's row lists every term (size quadratic)
    isolate: bool = False           # solve in a child process stopped at isolated_deadline_s(): a solver
                                    # overrunning its own limit (HiGHS 1.16 did, by minutes) is solved
                                    # again without the heuristic below, then yields the start plan
                                    # instead of hanging (the command line and the engine)
    root_reduced_cost_heuristic: bool = True   # HiGHS's: its incumbents help within short limits (1.2% on
                                    # the H800 27B at 24 x 3), but on some models with offloaded layers it
                                    # ran minutes past the limit without calling back
    budget_share: float = 1.0       # of each memory budget the memory rows may fill: search.solve asks for
                                    # 1 - 1e-6 again where the solver's tolerances carried its plan over a budget

    def __post_init__(self):
        t = self.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"time_limit_s must be a finite number of seconds > 0, got {t!r}")
        if not isinstance(self.internals_out_windows, int) or self.internals_out_windows < 0:
            raise ValueError(f"internals_out_windows must be an integer >= 0 (windows after an offloaded layer's own), "
                             f"got {self.internals_out_windows!r}")
        if self.require_graph_tail and not self.allow_graph_tail:
            raise ValueError("require_graph_tail needs allow_graph_tail")
        if self.memory_rows not in MEMORY_ROWS:
            raise ValueError(f"memory_rows must be one of {', '.join(MEMORY_ROWS)}, got {self.memory_rows!r}")


# an isolated solve is stopped this long after its time limit: past the child's start (an interpreter
# importing PuLP and HiGHS: about 0.3 s) and a solver that does not stop at its deadline (BENCHMARKS.md)
ISOLATED_GRACE_S = 10.0


# what the solver leaves of the time limit to stopping and to reading its plan back: a share of the limit
# for HiGHS's late stops (a sub-MIP heuristic ran 0.5 s past the deadline at 256 layers on a 10 s limit, a
# root cut round up to 1 s at 96 layers) and seconds for reading back (PuLP, then the Plan and its
# simulation: 0.03-0.1 s at 128 and 256 layers), BENCHMARKS.md
FINISH_RESERVE = 0.05
FINISH_RESERVE_S = 0.2
# HiGHS is not started with less than this left of its time
MIN_SOLVE_S = 0.1


def isolated_deadline_s(opts: MilpOptions) -> float:
    """Seconds after which an isolated solve (``opts.isolate``) is stopped."""
    return 1.25 * opts.time_limit_s + ISOLATED_GRACE_S


@dataclass
class SolveInfo:
    status: str                     # optimal | feasible (time limit, gap given) | infeasible | no solution
    solver: str
    objective_s: float | None
    bound_s: float | None
    gap: float | None
    solve_time_s: float
    build_time_s: float
    num_vars: int = 0
    num_constraints: int = 0
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _prefix_sums(terms: list, name: str, m: pulp.LpProblem, rows: str) -> list:
    """``out[i] = terms[0] + ... + terms[i]``: written out (dense) or as a chain of continuous variables,
    ``out[i] = out[i-1] + terms[i]`` (running), which keeps every use of a sum to one column."""
    out, total = [], 0
    for i, term in enumerate(terms):
        total = total + term
        if rows == "running" and i > 0 and not isinstance(total, (int, float)):
            level = pulp.LpVariable(f"{name}_{i}")
            m += level == out[-1] + term, f"{name}_{i}"
            total = level
        out.append(total)
    return out


class _Held:
    """What one tier holds over the windows: terms ``coef x var`` each held from window ``a`` to ``b``.

    A window's memory is the sum of the terms alive in it. Written out (``dense``), each window's row lists
    them all: a boundary kept for the whole step is in every row, and the model grows with the square of
    the layers. As a running level (``running``), a continuous ``level_w = level_{w-1} + (terms starting
    at w) - (terms ended at w-1)`` holds the long-lived terms, each in two rows; terms of one or two
    windows stay in their rows. Both give the same feasible plans and the same optimum."""

    SHORT = 2   # terms held this many windows or fewer are written into their rows

    def __init__(self, W: int, name: str):
        self.W, self.name = W, name
        self.terms: list[tuple[Any, float, int, int]] = []
        self.const_delta = [0.0] * (W + 1)
        self.prefix_terms: list[tuple[list, int, float, int, int]] = []

    def add(self, var, coef: float, a: int, b: int) -> None:
        a, b = max(a, 0), min(b, self.W - 1)
        if a > b or not coef or isinstance(var, (int, float)) and not var:
            return
        if isinstance(var, (int, float)):
            self.add_constant(coef * var, a, b)
            return
        if isinstance(var, pulp.LpAffineExpression) and var.constant:
            self.add_constant(coef * var.constant, a, b)
        self.terms.append((var, coef, a, b))

    def add_prefix(self, vs: list, sums: list, j: int, coef: float, a: int, b: int) -> None:
        """``coef x sums[j]`` from window a to b, where ``sums[j] = vs[0] + ... + vs[j]`` (_prefix_sums): a
        column of its own when running; written out, per window, as one coefficient per ``vs[s]`` (a
        suffix sum over the prefix terms alive in it), not as every term's ``j + 1`` columns."""
        if isinstance(sums[j], pulp.LpVariable):
            self.add(sums[j], coef, a, b)
        elif coef and max(a, 0) <= min(b, self.W - 1):
            self.prefix_terms.append((vs, j, coef, max(a, 0), min(b, self.W - 1)))

    def add_constant(self, value: float, a: int, b: int) -> None:
        a, b = max(a, 0), min(b, self.W - 1)
        if a <= b and value:
            self.const_delta[a] += value
            self.const_delta[b + 1] -= value

    def rows(self, m: pulp.LpProblem, how: str) -> list[pulp.LpAffineExpression]:
        """Per window, an expression of what the tier holds (adding the running level's rows to ``m``)."""
        W = self.W
        direct = [defaultdict(float) for _ in range(W)]
        delta = [defaultdict(float) for _ in range(W + 1)]   # the running level's change at each window
        for var, coef, a, b in self.terms:
            for v, c in (var.items() if isinstance(var, pulp.LpAffineExpression) else ((var, 1.0),)):
                if how == "dense" or b - a + 1 <= self.SHORT:
                    for w in range(a, b + 1):
                        direct[w][v] += coef * c
                else:
                    delta[a][v] += coef * c
                    delta[b + 1][v] -= coef * c
        by_vs: dict[int, tuple[list, list[tuple[int, float, int, int]]]] = {}
        for vs, j, coef, a, b in self.prefix_terms:
            by_vs.setdefault(id(vs), (vs, []))[1].append((j, coef, a, b))
        for vs, prefix in by_vs.values():
            n = len(vs)
            for w in range(W):
                per_j = [0.0] * n
                for j, coef, a, b in prefix:
                    if a <= w <= b:
                        per_j[j] += coef
                suffix = 0.0
                for s in reversed(range(n)):
                    suffix += per_j[s]
                    if suffix and not isinstance(vs[s], (int, float)):
                        direct[w][vs[s]] += suffix
        out, constant, level = [], 0.0, None
        for w in range(W):
            constant += self.const_delta[w]
            change = pulp.LpAffineExpression([(v, c) for v, c in delta[w].items() if c])
            if len(change):
                new = pulp.LpVariable(f"{self.name}_held_{w}")
                m += new == (level if level is not None else 0) + change, f"{self.name}_held_{w}"
                level = new
            row = pulp.LpAffineExpression([(v, c) for v, c in direct[w].items() if c], constant=constant)
            out.append(row + level if level is not None else row)
        return out


class PlanningError(RuntimeError):
    """The MILP found no plan (infeasible budgets, or no solution within the time limit)."""


class NoPlanInTimeError(PlanningError):
    """The solver's time limit passed before it found any feasible plan."""


_BANNER_DONE = False


def _silence_highs_banner() -> None:
    """highspy prints a copyright banner on the first Highs() of a process, ignoring output_flag;
    create that first instance with stdout pointed at /dev/null."""
    global _BANNER_DONE
    if _BANNER_DONE:
        return
    _BANNER_DONE = True
    try:
        import os
        import sys
        import highspy
        sys.stdout.flush()
        saved = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(devnull)
            os.close(saved)
    except Exception:
        pass


def _solver(opts: MilpOptions, abs_gap: float = 1e-6, deadline: float | None = None,
            start: "dict[pulp.LpVariable, float] | None" = None):
    """The solver for ``opts``, stopped at ``deadline`` (perf_counter seconds) with or without a plan."""
    available = pulp.listSolvers(onlyAvailable=True)
    if "HiGHS" in available:
        _silence_highs_banner()
    want = opts.solver.lower()
    left = opts.time_limit_s if deadline is None else max(deadline - time.perf_counter(), 0.05)
    if want in ("auto", "highs") and "HiGHS" in available:
        # presolve and root restarts off: on some of these models HiGHS 1.16's presolve runs on far past
        # the time limit (seen on qwen2.5-14b / rtx3090 at micro-batch 5 and 9); without it they solve within it
        # HiGHS's own limit is the deadline too (set as it starts, _HighsFromStart.callSolver): its sub-MIP
        # heuristics (RINS, RENS) run without calling back, and take the limit that is left.
        # Given a start, no feasibility jump: that heuristic looks for a first plan, which the start is, and
        # it runs without calling back (1 s of a 1 s limit at 128 layers; BENCHMARKS.md)
        extra = {"mip_heuristic_run_feasibility_jump": False} if start else {}
        if not opts.root_reduced_cost_heuristic:   # see MilpOptions
            extra["mip_heuristic_run_root_reduced_cost"] = False
        return "highs", _HighsFromStart(start, deadline, msg=False, timeLimit=left,
                                        gapRel=opts.gap_rel, gapAbs=abs_gap, threads=opts.threads, random_seed=0,
                                        mip_allow_restart=False, presolve="off", **extra)
    for var, value in (start or {}).items():
        var.setInitialValue(value)
    if want in ("auto", "highs") and "HiGHS_CMD" in available:
        return "highs_cmd", pulp.HiGHS_CMD(msg=False, timeLimit=left, gapRel=opts.gap_rel,
                                           gapAbs=abs_gap, threads=opts.threads, warmStart=bool(start))
    if want in ("auto", "cbc", "highs") and "PULP_CBC_CMD" in available:
        return "cbc", pulp.PULP_CBC_CMD(msg=False, timeLimit=left, gapRel=opts.gap_rel, warmStart=bool(start),
                                        gapAbs=abs_gap, threads=opts.threads, options=["randomSeed 0", "randomCbcSeed 0"])
    raise PlanningError(f"no MILP solver available (asked {opts.solver!r}; PuLP sees {available}); "
                        f"install highspy")


class _HighsFromStart(pulp.HiGHS):
    """PuLP's HiGHS, started from a plan's decisions and stopped at a wall-clock deadline.

    The integer columns of the start plan are handed to HiGHS as a partial solution (it completes the
    continuous ones), so the search has an incumbent before its first node. HiGHS checks its own time
    limit between phases, and on large models its root LP alone ran past it (3 s on a 1 s limit at 128
    layers): the interrupt callbacks stop it at the deadline, keeping the best plan found. A deadline that
    comes before HiGHS has taken the start in (an LP over the continuous columns) leaves no plan, and the
    search falls back to the start plan itself (search._fallback)."""

    def __init__(self, start, deadline, **kwargs):
        super().__init__(**kwargs)
        self.start, self.deadline = start, deadline
        self.num_variables: int | None = None
        self.started = True

    def actualSolve(self, lp):
        """PuLP's, less what costs time on a model built once and solved once: PuLP walks every row again at
        each ``lp.variables()`` (three calls, about 0.1 s each at 128 layers, two after the solver stops), and
        resets each variable's and row's modified flags (for re-solves, which the planner never does)."""
        variables = lp.variables()
        self.num_variables = len(variables)
        lp.variables = lambda: variables   # the instance's, for this solve: the model no longer changes
        try:
            self.createAndConfigureSolver(lp)
            self.buildSolverModel(lp)
            self.callSolver(lp)
            status, sol_status = self.findSolutionValues(lp)
        finally:
            del lp.variables
        lp.assignStatus(status, sol_status)
        return status

    def callSolver(self, lp):
        import highspy
        import numpy as np
        h = lp.solverModel
        if self.start:
            cols = np.array([v.index for v in self.start], dtype=np.int32)
            h.setSolution(len(cols), cols, np.array(list(self.start.values()), dtype=np.float64))
        if self.deadline is not None:
            left = self.deadline - time.perf_counter()
            if left < MIN_SOLVE_S:   # building took the time: not started (its LP taking the start in heeds
                self.started = False  # neither limit: 0.3-0.5 s at 128-256 layers)
                return
            h.setOptionValue("time_limit", left)   # HiGHS times it from run(), after PuLP built the model into it

            def stop_at_deadline(kind, message, data_out, data_in, user_data):
                if time.perf_counter() >= self.deadline:
                    data_in.user_interrupt = True
            h.setCallback(stop_at_deadline, None)
            for kind in (highspy.cb.HighsCallbackType.kCallbackSimplexInterrupt,
                         highspy.cb.HighsCallbackType.kCallbackIpmInterrupt,
                         highspy.cb.HighsCallbackType.kCallbackMipInterrupt):
                h.startCallback(kind)
        h.run()


def _start_values(plan: Plan, L: int, K: int, tiers: list[str], x, g, home, q, off, pre, y,
                  opts: MilpOptions, sel=None, offl=None, offl_pre=None,
                  frozen: int = 0) -> "dict[pulp.LpVariable, float] | None":
    """Every binary decision of ``plan`` in this model's variables, or None when the plan lies outside the
    model's space (a segment longer than ``max_segment``, a transfer outside its windows, a graph tail,
    resident, selective or offloaded layers the options rule out, no graph tail where they require one, an
    optimizer that does not overlap the next forward; with a ``frozen`` bottom, anything but one segment
    [0, frozen) below it)."""
    sel, offl, offl_pre = sel or {}, offl or {}, offl_pre or {}
    split = opts.split_internals
    if plan.num_layers != L or not plan.overlap_optimizer:
        return None
    if (plan.last_segment_graph and not opts.allow_graph_tail) or (plan.resident_layers and not opts.allow_resident):
        return None
    if opts.require_graph_tail and not plan.last_segment_graph and frozen < L:
        return None
    if (plan.selective_layers and not opts.allow_selective) or (plan.offloaded_layers and not opts.allow_offload):
        return None
    offloaded = set(plan.offloaded_layers)
    tier_of = {"host": "H", "nvme": "N"}
    chosen: set[str] = set()   # variable names (an LpVariable's == builds a constraint)
    segments = plan.segments()
    tail = segments[-1][0] if plan.last_segment_graph else None
    below = (0, frozen) not in segments if frozen < L else segments != [(0, L)]   # one segment [0, frozen)
    if frozen and (below or any(j < frozen for j in plan.selective_layers + plan.offloaded_layers) or
                   tail is not None and tail < frozen):
        return None
    for s_, e in segments:
        if e <= frozen:
            continue   # the frozen bottom's segment: no variable
        if s_ == tail:
            chosen.add(q[s_].name)
        elif s_ in offloaded:
            back, out = plan.internals_prefetch_split(s_), plan.internals_offload_split(s_)
            if any((s_, w) not in offl_pre for w in back) or (not split and (len(back) > 1 or set(out) != {s_})) \
                    or any(not s_ <= w <= s_ + opts.internals_out_windows for w in out):
                return None   # its internals move outside the model's windows
            chosen.add(offl[s_].name)
            if not split:
                chosen.add(offl_pre[s_, plan.internals_prefetch_at(s_)].name)
        elif (s_, e) in x:
            chosen.add(x[s_, e].name)
        else:
            return None   # longer than max_segment
    for i in range(L):
        h = plan.homes[i]
        if h == RECOMPUTE or i == tail:
            continue
        if h == DEVICE_HOME or i in offloaded:   # boundary 0 of an offloaded layer 0: its home goes unused
            chosen.add(g[i].name)
            continue
        k = tier_of.get(h)
        if k not in tiers:
            return None
        ow, pw = plan.offload_at(i), plan.prefetch_at(i)
        if (i, k, ow) not in off or i >= frozen and (i, k, pw) not in pre:
            return None
        chosen |= {home[i, k].name, off[i, k, ow].name}
        if i >= frozen:   # one below the frozen bottom is never read back
            chosen.add(pre[i, k, pw].name)
    chosen |= {y[j].name for j in plan.resident_layers}
    chosen |= {sel[j].name for j in plan.selective_layers}
    binaries = [v for table in (x, g, home, off, pre) for v in table.values()]
    binaries += [v for table in (q, y, sel, offl) + (() if split else (offl_pre,)) for v in table.values()
                 if isinstance(v, pulp.LpVariable)]   # shares are continuous: the solver completes them
    # (a variable fixed at 0, as those below a frozen bottom, may be in no row: the solver holds no column for it)
    return {v: 1.0 if v.name in chosen else 0.0 for v in binaries if v.upBound != 0}


# with split internals copies, the split model runs only after the unsplit one is solved to optimality with
# at least this share of the time limit left, and starts from its plan. The split model alone ran to its
# 10 s limit on the paper's scenarios and stopped below the unsplit optimum that HiGHS finds in 1-2 s; an
# unsplit model cut to part of a short limit returned worse plans than before (128 layers on 2 s: 3% slower)
SPLIT_NEEDS_SHARE_LEFT = 0.25


def build_and_solve(p: Problem, opts: MilpOptions = MilpOptions(),
                    start_plan: Plan | Sequence[Plan] | None = None) -> tuple[Plan, SolveInfo]:
    """Build the MILP for ``p``, solve it, and return the Plan with the solver's honest status.

    ``start_plan``: a feasible plan the solver starts from (its decisions are the first incumbent), so a
    plan exists however soon the time limit stops the search; or several, fastest first, of which the first
    that lies in the model's space is taken. ``opts.time_limit_s`` bounds the whole
    call, building included. With ``split_internals``, the model without split copies is solved first;
    when it is solved to optimality with ``SPLIT_NEEDS_SHARE_LEFT`` of the time left, the split model
    runs in that time from its plan (so never returns a slower plan), else its plan is the answer.
    Raises :class:`InfeasibleBudgetError` when the budgets admit no plan, :class:`PlanningError` when the
    solver stops without a feasible plan."""
    if not (opts.allow_offload and opts.split_internals):
        return _build_and_solve(p, opts, start_plan)
    t0 = time.perf_counter()
    plan, info = _build_and_solve(p, replace(opts, split_internals=False), start_plan)
    left = opts.time_limit_s - (time.perf_counter() - t0)
    if info.status != "optimal" or left < SPLIT_NEEDS_SHARE_LEFT * opts.time_limit_s:
        info.detail += "; internals copies unsplit (the split model had no time after the unsplit one)"
        return plan, info
    t_split = time.perf_counter()
    try:   # the unsplit plan is in hand: the deadline stops the split model whether or not it took it in
        split_plan, split_info = _build_and_solve(p, replace(opts, time_limit_s=left), plan)
    except NoPlanInTimeError:
        split_info = None
    if split_info is None or split_info.objective_s is None or split_info.objective_s >= info.objective_s:
        info.solve_time_s += time.perf_counter() - t_split   # the time is spent all the same
        if split_info is None or split_info.status != "optimal":   # optimal for the unsplit model only
            info.status, info.gap = "feasible", None if split_info is None else split_info.gap
            info.bound_s = None if split_info is None else split_info.bound_s
        found = "no plan" if split_info is None else "no faster plan"
        split_gap = "" if split_info is None or split_info.gap is None else f", its gap {split_info.gap:.2%}"
        info.detail += (f"; internals copies unsplit, the plan optimal among those (the split model found {found} "
                        f"in the {left:.2f} s left{split_gap})")
        return plan, info
    split_info.build_time_s += info.build_time_s
    split_info.solve_time_s += info.solve_time_s
    split_info.detail += f"; started from the unsplit model's optimal plan ({opts.time_limit_s - left:.2f} s)"
    return split_plan, split_info


def _build_and_solve(p: Problem, opts: MilpOptions,
                     start_plan: Plan | Sequence[Plan] | None) -> tuple[Plan, SolveInfo]:
    t_build = time.perf_counter()
    deadline = t_build + opts.time_limit_s
    L, W = p.L, 2 * p.L
    K = max(1, min(opts.max_segment, L))
    shared = min(GRAD_SHARE_WINDOWS, L)   # windows that carry the gradients copied beside them
    rows = opts.memory_rows if opts.memory_rows != "auto" else ("dense" if L <= DENSE_ROWS_UP_TO else "running")
    use_nvme = p.nvme_act_budget > 0
    tiers = ["H", "N"] if use_nvme else ["H"]
    eps = 1e-6 * p.no_recompute_compute_s() / W          # tie-breaker unit (seconds)
    GBF = p.gpu_budget / 1000.0                          # byte unit of the model: rows stay well scaled
    HELD = opts.budget_share                             # of each memory budget the rows may fill
    m = pulp.LpProblem("lazytrain_plan", pulp.LpMinimize)
    B = lambda name: pulp.LpVariable(name, cat="Binary")
    C = lambda name, ub=None: pulp.LpVariable(name, lowBound=0, upBound=ub)
    lsum = pulp.lpSum

    # ---- decision variables ------------------------------------------------------------------
    edges = [(s, e) for s in range(L) for e in range(s + 1, min(L, s + K) + 1)]
    x = {(s, e): B(f"x_{s}_{e}") for s, e in edges}                       # segment [s, e) chosen
    g = {i: B(f"g_{i}") for i in range(L)}                                # boundary home: GPU
    home = {(i, k): B(f"{k.lower()}_{i}") for i in range(L) for k in tiers}   # host (H) / NVMe (N)
    q = {s: (B(f"graph_{s}") if opts.allow_graph_tail else 0) for s in range(L)}  # graph tail [s, L)
    q_list = [q[s] for s in range(L)]
    G = _prefix_sums(q_list, "graph_kept", m, rows)                    # layer i keeps its graph
    z = {i: g[i] + lsum(home[i, k] for k in tiers) + q[i] for i in range(L)}   # boundary materialised
    off_windows = {i: range(i, min(i + opts.offload_slack, W - 2 - i) + 1) for i in range(L)}
    # a boundary below the lowest layer the backward reaches (Problem.first_reached: a frozen bottom) is never
    # read back: no prefetch
    f = p.first_reached
    pre_windows = {i: range(max(i + 1, W - i - K - opts.prefetch_lead), W - i) if i >= f else range(0)
                   for i in range(L)}
    off = {(i, k, w): B(f"off{k}_{i}_{w}") for i in range(L) for k in tiers for w in off_windows[i]}
    pre = {(i, k, w): B(f"pre{k}_{i}_{w}") for i in range(L) for k in tiers for w in pre_windows[i]}
    # exposed prefetch: issued in the window of its first use (needs edge (i, 2L-w))
    ex = {(i, k, w): C(f"ex{k}_{i}_{w}", 1) for (i, k, w) in pre if (i, W - w) in x}
    y = {j: (B(f"res_{j}") if opts.allow_resident else 0) for j in range(L)}   # weights resident
    streams_any = C("streams_any", 1) if opts.allow_resident else 1           # some layer is not resident
    sel = {j: (B(f"sel_{j}") if opts.allow_selective else 0) for j in range(L)}  # selective layer
    # selective layer j re-run without autograd in the window of the segment [s, e) covering it (s <= j <= e-2):
    # selrec[j, e] <= sel_j and <= sum_s x[s, e]; minimising time raises it to their product
    selrec = ({(j, e): C(f"selrec_{j}_{e}", 1) for e in range(2, L + 1) for j in range(max(0, e - K), e - 1)}
              if opts.allow_selective else {})
    sel_gain = [p.fwd_s[j] - p.sel_rerun_s[j] for j in range(L)]             # seconds a selective re-run saves
    offl = {j: (B(f"offl_{j}") if opts.allow_offload else 0) for j in range(L)}   # offloaded layer
    # its internals' copy back, in a backward window up to its own (then exposed): never in the forward,
    # where they would hold the device across the turn, which offloading is to spare
    offl_windows = {j: range(max(L, W - 1 - j - opts.prefetch_lead), W - j) for j in range(L)}
    split = opts.allow_offload and opts.split_internals
    offl_pre = ({(j, w): (C(f"offl_pre_{j}_{w}", 1) if split else B(f"offl_pre_{j}_{w}"))
                 for j in range(L) for w in offl_windows[j]} if opts.allow_offload else {})
    # ... and their copy out: shares in forward windows j.. (without split: all in window j)
    out_windows = {j: range(j, min(j + opts.internals_out_windows, L - 1) + 1) if split else range(j, j + 1)
                   for j in range(L)}
    if split:
        offl_out = {(j, w): C(f"offl_out_{j}_{w}", 1) for j in range(L) for w in out_windows[j]}
    else:
        offl_out = {(j, j): offl[j] for j in range(L)} if opts.allow_offload else {}
    rec_w = {(s, e): sum(p.Wl[s:e - 1]) for s, e in edges if e - s >= 2}     # recompute weight bytes
    u = {(s, e): C(f"u_{s}_{e}") for (s, e) in rec_w}                      # ... of those not resident
    if opts.allow_graph_tail:   # backward weight streams (none for graph or resident layers), held graph weights
        bwd_w = {j: C(f"bwd_weights_{j}", 1) for j in range(L)}
        held_w = {j: C(f"held_weights_{j}", 1) for j in range(L)}
    else:
        bwd_w = {j: 1 - y[j] if j >= f else 0 for j in range(L)}
        held_w = {j: 0 for j in range(L)}
    if f:   # a frozen bottom: one segment [0, f) the backward never re-runs, its boundaries 1..f-1 not stored, and
        # none of its layers keeps a graph, outputs or internals for a backward
        for v in ([x[e] for e in edges if e[0] < f] + [g[i] for i in range(1, f)] +
                  [home[i, k] for i in range(1, f) for k in tiers] +
                  [table[j] for table in (q, offl, sel, bwd_w) for j in range(f)]):
            if isinstance(v, pulp.LpVariable):
                v.upBound = 0
    t = {w: C(f"t_{w}") for w in range(W)}                                  # window time
    # with accumulation, the forward windows of the micro-batches after the first: resident copies are current,
    # and the micro-batch before is still copying its last gradients
    later = p.grad_accum > 1
    t_later = {w: C(f"t_later_{w}") for w in range(L)} if later else {w: t[w] for w in range(L)}
    wait = {w: C(f"wait_{w}") for w in range(W)}                            # exposed prefetch wait
    X = C("opt_delay")                                                      # optimizer delay of next step

    # ---- recompute path 0 -> L (paper) ----------------------------------------------------------
    # (a graph tail [s, L) ends the path at s instead of an edge (s, L); it has no length limit)
    # an offloaded layer j is an edge (j, j+1) of the path whose start j is not stored: into j flow z_j + offl_j
    # a frozen bottom's segment [0, f) is the path's first edge, of any length
    if not f:
        m += lsum(x[0, e] for e in range(1, min(L, K) + 1)) + q[0] + offl[0] == 1, "path_leaves_0"
    if f < L:
        m += lsum(x[s, L] for s in range(max(0, L - K), L)) + lsum(q.values()) + offl[L - 1] == 1, "path_reaches_L"
    for i in range(1, L):
        into = 1 if i == f else lsum(x[s, i] for s in range(max(0, i - K), i)) + offl[i - 1]
        m += into == z[i] + offl[i], f"path_in_{i}"
        m += lsum(x[i, e] for e in range(i + 1, min(L, i + K) + 1)) + q[i] == z[i], f"path_out_{i}"
    m += z[0] == 1, "boundary_0_kept"
    if opts.allow_resident:
        for j in range(L):
            m += streams_any >= 1 - y[j], f"streams_layer_{j}"
    if opts.require_graph_tail and f < L:   # (all frozen: no backward, no tail)
        m += lsum(q.values()) == 1, "graph_tail_required"
    if opts.allow_graph_tail:
        for j in range(f, L):
            m += bwd_w[j] >= 1 - y[j] - G[j], f"backward_weights_{j}"
            m += held_w[j] >= G[j] - y[j], f"graph_holds_weights_{j}"
    if opts.allow_offload:
        for j in range(L):
            m += offl[j] + G[j] <= 1, f"offloaded_below_graph_{j}"
            if opts.allow_selective:
                m += offl[j] + sel[j] <= 1, f"offloaded_not_selective_{j}"
            if j > 0:          # its graph keeps its input: boundary j is not stored
                m += z[j] + offl[j] <= 1, f"offloaded_input_not_stored_{j}"
            m += lsum(offl_pre[j, w] for w in offl_windows[j]) == offl[j], f"one_internals_prefetch_{j}"
            if split:
                m += lsum(offl_out[j, w] for w in out_windows[j]) == offl[j], f"internals_offload_shares_{j}"
        for k in tiers:        # boundary 0's home goes unused: the device, never copied
            m += home[0, k] + offl[0] <= 1, f"offloaded_input_0_unused_{k}"
    if opts.allow_selective:
        for j in range(L):     # a graph layer keeps everything already: selective layers lie below the tail
            m += sel[j] + G[j] <= 1, f"selective_below_graph_{j}"
        for (j, e), v in selrec.items():
            m += v <= sel[j], f"selective_recompute_{j}_{e}"
            m += v <= lsum(x[s_, e] for s_ in range(max(0, e - K), j + 1)), f"selective_recompute_in_segment_{j}_{e}"

    # ---- transfer windows of offloaded boundaries -----------------------------------------------
    def edges_from(i, cond):
        return lsum(x[i, e] for e in range(i + 1, min(L, i + K) + 1) if cond(W - e))

    for i in range(L):
        for k in tiers:
            m += lsum(off[i, k, w] for w in off_windows[i]) == home[i, k], f"one_offload_{k}_{i}"
            if i >= f:
                m += lsum(pre[i, k, w] for w in pre_windows[i]) == home[i, k], f"one_prefetch_{k}_{i}"
            for w in pre_windows[i]:   # the copy back starts after the offload window
                m += (lsum(pre[i, k, v] for v in pre_windows[i] if v <= w)
                      <= lsum(off[i, k, v] for v in off_windows[i] if v < w)), f"prefetch_after_offload_{k}_{i}_{w}"
        for w in off_windows[i]:       # offload before first use (need window 2L - e)
            m += (lsum(off[i, k, w] for k in tiers) + edges_from(i, lambda need: need <= w) <= 1,
                  f"offload_before_use_{i}_{w}")
        for w in pre_windows[i]:       # prefetch no later than first use
            m += (lsum(pre[i, k, w] for k in tiers) + edges_from(i, lambda need: need < w) <= 1,
                  f"prefetch_by_use_{i}_{w}")
    for (i, k, w), v in ex.items():
        m += v >= pre[i, k, w] + x[i, W - w] - 1, f"exposed_{k}_{i}_{w}"
    for (s, e), wb in rec_w.items():
        m += u[s, e] >= wb / GBF * x[s, e] - lsum(p.Wl[j] / GBF * y[j] for j in range(s, e - 1)), f"rec_weights_{s}_{e}"

    # ---- per-window expressions -----------------------------------------------------------------
    def streamed(w):   # weight GB streamed into buffers for window w's tasks (resident layers excluded)
        i = p.layer_of(w)
        if w < L:
            return p.Wl[i] / GBF * (1 - y[i])
        if i < f:      # no backward reaches it
            return 0
        return p.Wl[i] / GBF * bwd_w[i] + lsum(u[s, i + 1] for s in range(max(0, i + 1 - K), i) if (s, i + 1) in u)

    def loaded(w, refresh=True):   # weight GB copied host->device in window w (for window w+1)
        if w + 1 >= W:
            return 0
        if w + 1 < L and refresh:
            return p.Wl[w + 1] / GBF           # the step's first forward: every layer, resident copies refreshed
        return streamed(w + 1)

    def compute(w):
        if w < L:   # a selective layer's forward also keeps its outputs (measured costs only)
            return p.compute_s(w) + (p.sel_fwd_extra[w] * sel[w] if p.sel_fwd_extra[w] else 0)
        i = p.layer_of(w)
        if i < f:      # no backward reaches it
            return 0
        return (p.diff_s[i] - p.fwd_s[i] * G[i] - p.fwd_s[i] * offl[i] - sel_gain[i] * sel[i]
                + lsum(p.recompute_s(s, i + 1) * x[s, i + 1] for s in range(max(0, i + 1 - K), i) if (s, i + 1) in x)
                - lsum(sel_gain[j] * selrec[j, i + 1] for j in range(max(0, i + 1 - K), i) if (j, i + 1) in selrec))

    # ---- what each tier holds, as terms held over a range of windows -------------------------------
    # Each holding is one term ``coef x var`` from window a to window b (_Held); a window's memory row is
    # the sum of the terms alive in it, written out or as a running level (``rows``, from opts.memory_rows).
    dev = _Held(W, "device")
    hosts = {k: _Held(W, {"H": "host", "N": "nvme"}[k]) for k in tiers}
    covering = defaultdict(list)                     # boundary i -> the re-run edges that regenerate it
    for s_, e in edges:
        for i in range(s_ + 1, e):
            covering[i].append((s_, e))
    for i in range(L):
        a = p.A[i] / GBF
        dev.add_constant(a, max(i - 1, 0), i)        # produced (or read) in windows i-1 and i
        last = p.last_use_window(i)                   # differentiated then (below a frozen bottom: never read back,
        dev.add(g[i], a, i + 1, last)                 # held until the pass is released)
        for k in tiers:
            for v in off_windows[i]:                  # on the device until its offload window
                dev.add(off[i, k, v], a, i + 1, v)
                hosts[k].add(off[i, k, v], a, v, W - 1 if i >= f else last)
            for v in pre_windows[i]:                  # and again from its prefetch
                dev.add(pre[i, k, v], a, v, last)
                hosts[k].add(pre[i, k, v], -a, v + 1, W - 1)
        for s_, e in covering[i]:                     # regenerated by recompute
            dev.add(x[s_, e], a, max(W - e, i + 1), last)
    if opts.allow_resident:
        for j in range(L):
            dev.add(y[j], p.Wl[j] / GBF, 0, W - 1)
    if opts.allow_graph_tail:   # a graph layer holds its weights, internals (not in its backward window) and input
        for j in range(L):
            dev.add(held_w[j], p.Wl[j] / GBF, j, W - 1 - j)
            dev.add_prefix(q_list, G, j, p.saved[j] / GBF, j, W - 2 - j)
            dev.add_prefix(q_list, G, j, p.A[j] / GBF, j + 1, W - 1 - j)
    if opts.allow_offload:
        # its internals in its forward window (until copied out) and from their prefetch on; in its backward
        # window the workspace counts the internals and its input counts here; on the host in between.
        # Boundary 0 of an offloaded layer 0 leaves with it (kept with home 'hbm' in the path, not held)
        for j in range(L):
            bwd = W - 1 - j
            dev.add(offl[j], p.saved[j] / GBF, j, j)
            for v in out_windows[j][1:]:              # what leaves in window v holds the device until then
                dev.add(offl_out[j, v], p.offl_bytes[j] / GBF, j + 1, v)
            dev.add(offl[j], p.A[j] / GBF, bwd, bwd)
            for v in offl_windows[j]:
                dev.add(offl_pre[j, v], p.offl_bytes[j] / GBF, v, bwd - 1)
            hosts["H"].add(offl[j], p.offl_bytes[j] / GBF, j, bwd)
        dev.add(offl[0], -p.A[0] / GBF, 1, W - 1)
    if opts.allow_selective:    # kept matmul/attention outputs, until the window before its backward
        for j in range(L):
            dev.add(sel[j], p.sel_bytes[j] / GBF, j, W - 2 - j)
    for w in range(W):
        dev.add_constant(p.fixed_gpu_bytes(w) / GBF, w, w)
    dev_held = dev.rows(m, rows)
    host_held = {k: hosts[k].rows(m, rows) for k in tiers}

    pre_at, off_at, ex_at = {}, {}, {}
    for table, at in ((pre, pre_at), (off, off_at), (ex, ex_at)):
        for (i, k, w) in table:
            at.setdefault(w, []).append((i, k))
    offl_pre_at, offl_out_at = {}, {}
    for (j, w) in offl_pre:
        offl_pre_at.setdefault(w, []).append(j)
    for (j, w) in offl_out:
        offl_out_at.setdefault(w, []).append(j)
    for w in range(W):
        h2d = loaded(w) + lsum(p.A[i] / GBF * pre[i, k, w] for i, k in pre_at.get(w, ())) + \
            lsum(p.offl_bytes[j] / GBF * offl_pre[j, w] for j in offl_pre_at.get(w, ()))
        d2h = (p.Gl[p.layer_of(w - 1)] / GBF if w >= L + 1 and p.layer_of(w - 1) > f else 0) + \
            (p.head_grad_bytes / shared / GBF if L <= w < L + shared else 0) + \
            lsum(p.A[i] / GBF * off[i, k, w] for i, k in off_at.get(w, ())) + \
            lsum(p.offl_bytes[j] / GBF * offl_out[j, w] for j in offl_out_at.get(w, ()))
        carried = p.carry_bytes / shared / GBF if w < shared else 0   # a later micro-batch's, beside
        exp_h2d = lsum(p.A[i] / GBF * ex[i, k, w] for i, k in ex_at.get(w, ()))
        if w >= L and (W - 1 - w, w) in offl_pre:        # internals brought back in their backward window
            exp_h2d += p.offl_bytes[W - 1 - w] / GBF * offl_pre[W - 1 - w, w]
        m += wait[w] >= exp_h2d * (GBF / p.bw_h2d), f"wait_h2d_{w}"
        nr = nw = 0
        if use_nvme:
            nr = lsum(p.A[i] / GBF * pre[i, k, w] for i, k in pre_at.get(w, ()) if k == "N")
            nw = lsum(p.A[i] / GBF * off[i, k, w] for i, k in off_at.get(w, ()) if k == "N")
            exp_nr = lsum(p.A[i] / GBF * ex[i, k, w] for i, k in ex_at.get(w, ()) if k == "N")
            m += wait[w] >= exp_nr * (GBF / p.bw_nr), f"wait_nvme_read_{w}"
        # the window's time: the step's first micro-batch, and (forward windows, with accumulation) the later
        # ones, which stream no resident layer's weights
        for tw, name, h2d_w, d2h_w in ((t[w], "", h2d, d2h),) + (
                ((t_later[w], "later_", h2d - loaded(w) + loaded(w, refresh=False), d2h + carried),)
                if later and w < L else ()):
            m += tw >= compute(w) + wait[w], f"time_{name}compute_{w}"
            if w < L and opts.allow_offload:   # its internals leave when its forward has saved them
                m += tw >= p.fwd_s[w] + p.offl_bytes[w] / p.bw_d2h * offl_out[w, w], \
                    f"time_{name}offload_internals_{w}"
            m += tw >= h2d_w * (GBF / p.bw_h2d), f"time_{name}h2d_{w}"
            m += tw >= d2h_w * (GBF / p.bw_d2h), f"time_{name}d2h_{w}"
            if use_nvme or p.nvme_weights:   # with the compute copies on NVMe, each weight copy is read there too
                weights_w = loaded(w, refresh=not name) if p.nvme_weights else 0   # this variant's weight copies
                m += tw >= (nr + weights_w) * (GBF / p.bw_nr), f"time_{name}nvme_read_{w}"
            if use_nvme:
                m += tw >= nw * (GBF / p.bw_nw), f"time_{name}nvme_write_{w}"
        # time-indexed memory per tier: streamed weight buffers of this window and the next (at least the two
        # buffers the engine keeps while any layer streams), and what is held
        m += streamed(w) + (streamed(w + 1) if w + 1 < W else 0) + dev_held[w] <= p.gpu_budget * HELD / GBF, \
            f"gpu_memory_{w}"
        m += p.kept_buffers / GBF * streams_any + dev_held[w] <= p.gpu_budget * HELD / GBF, \
            f"gpu_memory_kept_buffers_{w}"
        for k, budget, name in (("H", max(p.host_act_budget, 0), "host_memory"), ("N", p.nvme_act_budget,
                                                                                   "nvme_memory")):
            if k in tiers:
                m += host_held[k][w] <= budget * HELD / GBF, f"{name}_{w}"

    # ---- host optimizer overlapping the next forward --------------------------------------------
    O = [p.opt_nl]
    for o in p.opt_l:
        O.append(O[-1] + o)
    before = _prefix_sums([t[w] for w in range(L - 1)], "forward_time_before", m, rows)
    for w in range(L):   # the time of windows 0..w-1 of the next forward
        start = O[w + 1] + p.load_l[w] + (p.load_nl if w == 0 else 0)
        m += X >= start - (before[w - 1] if w else 0), f"optimizer_gates_forward_{w}"

    # ---- objective: the step time (+ tiny tie-breakers: fewer copies, fewer resident layers) -----
    tie = lsum(home[i, k] * (1 if k == "H" else 2) for i in range(L) for k in tiers)
    tie += lsum(y[j] for j in range(L)) if opts.allow_resident else 0
    tie += lsum(sel[j] for j in range(L)) if opts.allow_selective else 0
    tie += lsum(offl[j] for j in range(L)) if opts.allow_offload else 0
    if split:   # shares away from the unsplit copies (out when the forward ends, back a window before the
        # backward) only where they gain time: otherwise a tie between splits would be broken at random
        tie += lsum(offl_out[j, w] * (w - j) / len(out_windows[j]) for j, w in offl_out)
        tie += lsum(offl_pre[j, w] * abs(W - 2 - j - w) / len(offl_windows[j]) for j, w in offl_pre)
    micro = p.grad_accum   # micro-batches: the first, then the others, whose forwards stream no resident weights
    # ... each of those starts with layer 0's weights copied (the first one's copy is in the delay X); the
    # step waits for the last one's last gradients (tail_s)
    first_copy = p.load_l[0] * (1 - y[0]) if L else 0
    m += (micro * lsum(t[w] for w in range(L, W)) + p.tail_s + lsum(t[w] for w in range(L))
          + (micro - 1) * (lsum(t_later.values()) + first_copy) + X + eps * tie), "step_time"

    build_s = time.perf_counter() - t_build
    values = None
    for start in ((start_plan,) if isinstance(start_plan, Plan) else start_plan or ()):   # the first in the space
        values = _start_values(start, L, K, tiers, x, g, home, q, off, pre, y, opts, sel, offl, offl_pre, f)
        if values is not None:
            break
    name, solver = _solver(opts, abs_gap=opts.gap_rel * 1e-2 * p.lower_bound_s()["bound"],
                           deadline=deadline - FINISH_RESERVE * opts.time_limit_s - FINISH_RESERVE_S,
                           start=values)
    t0 = time.perf_counter()
    m.solve(solver)
    solve_s = time.perf_counter() - t0
    info = _status(m, name, solve_s, build_s)
    if info.status == "infeasible":
        raise InfeasibleBudgetError(
            f"no plan fits the budgets (GPU {fmt_bytes(p.gpu_budget)}, host {fmt_bytes(p.host_budget)} of which "
            f"{fmt_bytes(max(p.host_act_budget, 0))} free for activations, NVMe {fmt_bytes(p.nvme_budget)}"
            + (f" of which {fmt_bytes(max(p.nvme_act_budget, 0))} free for activations" if p.nvme_static else "")
            + f") at micro-batch {p.micro_batch} x seq {p.seq_len}, even recomputing segments of up to {K} layers"
            + (" with the last segment keeping its forward graph, as required (the engine's "
               "'lazytrain.last_segment_graph' true)" if opts.require_graph_tail else "")
            + f"; {_shortfall(p, K, opts.require_graph_tail)}. {p.smaller_step_advice()}, raise a "
            f"budget, or allow longer segments (max_segment)")
    if info.status == "no solution" and getattr(solver, "started", True) is False:
        raise NoPlanInTimeError(f"building the model ({build_s:.2f}s, then {solve_s:.2f}s handing it to the "
                                f"solver) used the {opts.time_limit_s:.2f}s the MILP had, less what it leaves to "
                                f"read a plan back: the solver ({name}) had no time to start; raise the time limit")
    if info.status == "no solution":
        raise NoPlanInTimeError(f"the solver ({name}) stopped after {solve_s:.1f}s without a feasible plan "
                            f"({info.detail}); raise the time limit")

    # ---- read the decision back into a Plan ---------------------------------------------------
    val = lambda v: (v.varValue or 0.0) if isinstance(v, pulp.LpVariable) else float(v)
    homes = []
    graph_start = next((s for s in range(L) if val(q[s]) > 0.5), None)
    for i in range(L):
        if i == graph_start:
            homes.append(DEVICE_HOME)          # the tail's first boundary: a segment start, never stored
        elif val(g[i]) > 0.5:
            homes.append(DEVICE_HOME)
        elif use_nvme and val(home[i, "N"]) > 0.5:
            homes.append("nvme")
        elif val(home[i, "H"]) > 0.5:
            homes.append("host")
        else:
            homes.append(RECOMPUTE)
    homes.append(DEVICE_HOME)
    kt = {"host": "H", "nvme": "N"}
    offw = {i: next(w for w in off_windows[i] if val(off[i, kt[h], w]) > 0.5)
            for i, h in enumerate(homes[:L]) if h in kt}
    prew = {i: next(w for w in pre_windows[i] if val(pre[i, kt[h], w]) > 0.5)
            for i, h in enumerate(homes[:L]) if h in kt and i >= f}
    resident = tuple(j for j in range(L) if opts.allow_resident and val(y[j]) > 0.5)
    selective = tuple(j for j in range(L) if opts.allow_selective and val(sel[j]) > 0.5)
    offloaded = tuple(j for j in range(L) if opts.allow_offload and val(offl[j]) > 0.5)
    backs = {j: _shares({w: val(offl_pre[j, w]) for w in offl_windows[j]}) for j in offloaded}
    outs = {j: _shares({w: val(offl_out[j, w]) for w in out_windows[j]}) for j in offloaded}
    internals_prew = {j: next(iter(b)) for j, b in backs.items() if len(b) == 1}
    info.num_vars = getattr(solver, "num_variables", None) or len(m.variables())
    info.num_constraints = len(m.constraints)
    plan = Plan(num_layers=L, homes=tuple(homes), offload_window=offw, prefetch_window=prew,
                resident_layers=resident, micro_batch_size=p.micro_batch, seq_len=p.seq_len, policy="milp",
                last_segment_graph=graph_start is not None, selective_layers=selective,
                offloaded_layers=offloaded, internals_prefetch_window=internals_prew,
                internals_prefetch_shares={j: b for j, b in backs.items() if len(b) > 1},
                internals_offload_shares={j: o for j, o in outs.items() if o != {j: 1.0}},
                prediction={"milp_step_time_s": info.objective_s, "solver": info.to_dict()})
    return plan, info


def _shares(values: dict[int, float], least: float = 1e-6) -> dict[int, float]:
    """A split read back from the solver: {window: share} without the shares below ``least`` (solver
    noise), summing to 1."""
    kept = {w: x for w, x in values.items() if x > least}
    total = sum(kept.values())
    return {w: x / total for w, x in kept.items()} if len(kept) > 1 else {next(iter(kept)): 1.0}


def _shortfall(p: Problem, K: int, graph_tail: bool = False) -> str:
    """How far the leanest simple plans are from the budgets (an upper bound on what is missing); with
    ``graph_tail``, their last segment keeping its graph."""
    from .plan import every_k_plan
    from .simulate import simulate
    best = None
    for home in (DEVICE_HOME, "host"):
        for k in sorted({1, K}):
            plan = every_k_plan(p.L, k, home=home, last_segment_graph=graph_tail)
            r = simulate(p, plan, strict=False, timeline=False)
            over = {t: r.peak_bytes[t] - b for t, b in (("hbm", p.gpu_budget), ("host", p.host_budget),
                                                       ("nvme", p.nvme_budget)) if r.peak_bytes[t] > b}
            if best is None or sum(over.values()) < sum(best[1].values()):
                best = (f"every {k} on {home}", over)
    name, over = best
    parts = ", ".join(f"{'GPU' if t == 'hbm' else t} by {fmt_bytes(v)}" for t, v in over.items())
    tail = ", its last segment keeping its graph" if graph_tail else ""
    return (f"the leanest simple plan (boundary every {name.split()[1]} layers on {name.split()[-1]}{tail}) "
            f"exceeds {parts}")


def _status(m: pulp.LpProblem, name: str, solve_s: float, build_s: float) -> SolveInfo:
    """Honest status: PuLP reports 'Optimal' for runs stopped at a time limit; sol_status tells."""
    sol = m.sol_status
    obj = pulp.value(m.objective)
    bound = gap = None
    detail = pulp.LpStatus.get(m.status, str(m.status))
    if name == "highs" and getattr(m, "solverModel", None) is not None:
        hm = m.solverModel
        info = hm.getInfo()
        detail = hm.modelStatusToString(hm.getModelStatus())
        if sol == pulp.LpSolutionIntegerFeasible and info.primal_solution_status != 2:
            # PuLP reads an interrupted run (the deadline) as feasible whether or not HiGHS found a solution
            sol = pulp.LpSolutionNoSolutionFound
        try:
            bound = float(info.mip_dual_bound) + float(m.objective.constant)  # HiGHS sees no constant
        except Exception:
            bound = None
        # the gap of the whole step: HiGHS's own is relative to its objective without the constant terms,
        # which can be a small part of the step (it read 0.24% for a plan 4e-10 from its bound)
        if bound is not None and obj is not None and math.isfinite(bound) and obj > 0:
            gap = max(0.0, obj - bound) / obj
    if sol == pulp.LpSolutionOptimal:
        status = "optimal"
    elif sol == pulp.LpSolutionIntegerFeasible:
        status = "feasible"
    elif sol == pulp.LpSolutionInfeasible or m.status == pulp.LpStatusInfeasible:
        status = "infeasible"
    else:
        status = "no solution"
    if status == "optimal" and gap is not None and gap > 1e-3:
        status = "feasible"   # stopped with a gap above the requested tolerance
    return SolveInfo(status=status, solver=name, objective_s=obj if status in ("optimal", "feasible") else None,
                     bound_s=bound, gap=gap, solve_time_s=solve_s, build_time_s=build_s, detail=detail)
