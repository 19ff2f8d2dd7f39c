"""The step-time floor of a whole plan space: how fast any plan could make a step, not just ours.

``Problem.lower_bound_s`` charges each layer's forward and backward once, which assumes every layer
can keep its autograd internals until its backward. At the paper's batches one layer's internals are
15-28 GB, so that bound is far below what any plan reaches. :func:`step_floor` is a linear relaxation
that counts memory and links:

- every layer either keeps its internals from its forward to its backward, or re-runs its forward in
  backward (``fwd_s`` more compute); the MILP's segment recompute only adds to the re-run;
- internals kept on the GPU are all there when the first backward window starts, beside what that
  window needs under any plan (``Problem.fixed_gpu_bytes``, the last layer's weights and input); in
  LazyTrain's executor a kept graph also holds its layer's weights and its input until its backward;
- with ``selective=True`` (the default), a layer may instead be selective (``Plan.selective_layers``): it
  holds its matmul and attention outputs (``Problem.sel_bytes``) on the GPU across the turn and its
  re-run takes ``sel_rerun_s`` instead of ``fwd_s``; the executor runs this, so both floors include it;
- with ``offload=True``, internals may also leave for the host (then NVMe): they cross device->host
  during the forward phase and come back during the backward phase, on the same PCIe links as the
  weights and gradients, with the layer's input (``Problem.offl_bytes``: what an offloaded layer of
  ``Plan.offloaded_layers`` moves, which the MILP copies back in backward windows only). The floor lets
  these copies spread over the whole phase, where the MILP spreads each over at most
  ``MilpOptions.internals_out_windows`` windows after its forward and ``prefetch_lead`` before its
  backward, and lets a kept graph hold only its internals there;
- every micro-batch streams each layer's weights to the device for its forward, and again for its
  backward unless the layer keeps its graph (which holds its weights), is resident (its weights on the
  device the whole step, in the room at the turn, refreshed once per step) or is the last layer; the
  embedding and head come once per step. At small micro-batches with gradient accumulation this traffic
  can bound the step, and each phase's share of it crosses while that phase runs (the weight stream copies
  at most a window ahead: two layers' weights may arrive before their phase starts); with the compute
  copies on NVMe (``Problem.nvme_weights``) each of those copies is read from NVMe too, and internals parked
  beyond the host's room cross NVMe both ways;
- a layer's choice may be fractional (a relaxation), so the floor is below every plan of the space.

``selective_offload=True`` adds a kind the executor does not run: a selective layer whose matmul and
attention outputs (``Problem.sel_bytes``, with its input) cross to the host in the forward phase and back in
the backward phase like offloaded internals, and whose re-run then takes ``sel_rerun_s``. Like
``internals_fraction`` below 1 it answers a question outside the executor's plan space: would that kind
lift the ceiling?

``internals_fraction`` scales the bytes a layer must keep to skip its re-run entirely (1.0: its internals
as the model's autograd saves them). A value below 1 is outside LazyTrain's executor and outside the
floor's guarantee: it answers "how lean would the internals have to be".

Pure Python: PuLP with HiGHS (CBC as fallback) solves the LP in milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pulp

from .problem import Problem


@dataclass(frozen=True)
class StepFloor:
    step_s: float            # no plan of the space makes a step faster than this
    forward_s: float
    backward_s: float
    kept_layers: float       # layer-equivalents of internals held on the GPU across the turn
    offloaded_layers: float  # ... sent to the host and back (offload=True only)
    rerun_layers: float      # ... re-run in backward (selective layers included)
    offload: bool
    internals_fraction: float
    selective_layers: float = 0.0   # ... re-run in backward from their kept matmul/attention outputs
    selective_offloaded_layers: float = 0.0   # ... from those outputs parked on the host (selective_offload)

    def speedup_over(self, step_s: float) -> float:
        """The largest speed-up any plan of the space can have over a step of ``step_s`` seconds."""
        return step_s / self.step_s


def step_floor(p: Problem, offload: bool = False, internals_fraction: float = 1.0,
               selective: bool = True, selective_offload: bool = False) -> StepFloor:
    """Lower bound on the step time of every plan that keeps, re-runs or (``selective``) re-runs from its
    kept matmul/attention outputs each layer (and, with ``offload``, may park its internals on the host;
    with ``selective_offload``, a hypothetical kind, its matmul/attention outputs); see the module
    docstring for the model."""
    if not 0 < internals_fraction <= 1:
        raise ValueError(f"internals_fraction must be in (0, 1], got {internals_fraction}")
    from .milp import MilpOptions, _solver   # one place picks and configures the solver

    L, f = p.L, p.first_reached   # layers below f (a frozen bottom) have no backward: nothing to keep or re-run
    S = [s * internals_fraction for s in p.saved]
    moved = [S[i] + p.A[i] for i in range(L)]   # an offloaded layer's internals travel with its input
    # ... or its matmul outputs, which internals_fraction leaves as they are (the GPU-held sel_bytes too)
    sel_moved = [p.sel_bytes[i] + p.A[i] for i in range(L)]
    m = pulp.LpProblem("lazytrain_step_floor", pulp.LpMinimize)
    keep = [pulp.LpVariable(f"keep_{i}", 0, 1) for i in range(L)]
    park = [pulp.LpVariable(f"offload_{i}", 0, 1 if offload else 0) for i in range(L)]
    sel = [pulp.LpVariable(f"selective_{i}", 0, 1 if selective else 0) for i in range(L)]
    sel_park = [pulp.LpVariable(f"selective_offload_{i}", 0, 1 if selective_offload else 0) for i in range(L)]
    # resident weights: on the device all step, streamed once a step (its first forward's refresh); the last
    # layer's are in the room at the turn whether resident or not
    res = [pulp.LpVariable(f"resident_{i}", 0, 1) for i in range(L)]
    t_fwd, t_bwd, t = (pulp.LpVariable(n, 0) for n in ("t_forward", "t_backward", "t_step"))
    parked = pulp.lpSum(park[i] * moved[i] + sel_park[i] * sel_moved[i] for i in range(L))
    for v in keep[:f] + park[:f] + sel[:f] + sel_park[:f]:
        v.upBound = 0
    m += t
    for i in range(L):
        m += keep[i] + park[i] + sel[i] + sel_park[i] <= 1, f"one_choice_{i}"
    # a layer may keep its graph and be resident (one copy of its weights on the device: ``dev_w``); with
    # accumulation residency then still saves its forward copies after the step's first micro-batch
    dev_w = [pulp.LpVariable(f"weights_on_device_{i}", 0, 1) for i in range(L - 1)]
    # weights streamed again for the backward: none for a layer that keeps its graph or is resident
    bwd_w = [pulp.LpVariable(f"backward_weights_{i}", 0, 1) for i in range(L - 1)]
    for i in range(L - 1):
        m += dev_w[i] >= res[i], f"resident_weights_on_device_{i}"
        if not offload:   # LazyTrain's executor: a kept graph holds its weights (see held below)
            m += dev_w[i] >= keep[i], f"graph_weights_on_device_{i}"
        if i >= f:
            m += bwd_w[i] >= 1 - dev_w[i], f"backward_weights_{i}"   # held since the forward, or streamed again
    k = p.grad_accum   # micro-batches per step: forward, backward and their copies k times, the optimizer once
    m += t >= k * (t_fwd + t_bwd), "step_is_forward_then_backward"
    m += t_fwd >= sum(p.fwd_s) + p.head_s, "forward_compute"
    m += t_fwd * p.bw_d2h >= parked, "offload_during_forward"
    m += t_bwd >= sum(p.bwd_s(i) for i in range(f, L)) + \
        pulp.lpSum((1 - keep[i] - park[i]) * p.fwd_s[i] - (sel[i] + sel_park[i]) * (p.fwd_s[i] - p.sel_rerun_s[i])
                   for i in range(f, L)), "backward_compute_with_reruns"
    m += t_bwd * p.bw_h2d >= parked, "fetch_during_backward"
    # the last layer's internals are part of its own backward window's fixed bytes, and its weights are
    # on the device then whatever the plan. In LazyTrain's executor a kept graph also holds its layer's
    # weights and input; a hypothetical offloading executor could stream them back instead, so with
    # offload they are not counted.
    held = [S[i] + (0 if offload else p.A[i]) for i in range(L)]   # + the input its graph holds (weights: dev_w)
    room = p.gpu_budget - p.fixed_gpu_bytes(L) - p.Wl[L - 1] - p.A[L - 1]   # its input: a boundary or in its graph
    # a selective layer holds its matmul/attention outputs, on the GPU in either floor (executor's choice)
    m += pulp.lpSum(keep[i] * held[i] + sel[i] * p.sel_bytes[i] + dev_w[i] * p.Wl[i] for i in range(L - 1)) \
        <= max(0, room), "gpu_holds_kept_internals_and_resident_weights_at_the_turn"
    m += parked <= max(0, p.host_act_budget) + p.nvme_act_budget, "host_holds_parked_internals"
    lb = p.lower_bound_s()
    m += t >= lb["optimizer"], "host_optimizer"
    # each micro-batch: every layer's weights for its forward, and again for its backward unless kept with
    # its graph or resident; a resident layer's (refreshed after the update) and the embedding's and head's
    # once per step
    restreamed = pulp.lpSum(bwd_w[i] * p.Wl[i] for i in range(L - 1))
    refreshed = pulp.lpSum(res[i] * p.Wl[i] for i in range(L))
    # each phase's weights cross while it runs: the weight stream copies a window's weights at most a window
    # ahead (two slots), so at most two layers' arrive before their phase starts (later micro-batches: resident
    # copies current)
    ahead = 2 * max(p.Wl)
    forward_weights = pulp.lpSum((1 - res[i]) * p.Wl[i] for i in range(L))   # a micro-batch's forward copies
    step_weights = k * (sum(p.Wl) - refreshed + restreamed) + refreshed      # the step's layer weight copies
    m += t_fwd * p.bw_h2d >= forward_weights - ahead, "forward_weights_during_forward"
    m += t_bwd * p.bw_h2d >= restreamed + parked - ahead, "backward_weights_and_internals_during_backward"
    m += t * p.bw_h2d >= step_weights + k * parked + p.nonlayer_link_bytes, "h2d_link_over_the_step"
    m += t * p.bw_d2h >= k * (sum(p.Gl) + p.nonlayer_link_bytes + parked), "d2h_link_over_the_step"
    # NVMe: internals parked beyond the host's room are written there in the forward phase and read back in
    # the backward; with the compute copies there (Problem.nvme_weights) each weight copy is read there first,
    # at most two of a phase's before it starts, as on the host link
    if math.isfinite(p.bw_nr):
        spill = pulp.LpVariable("parked_on_nvme", 0)
        m += spill >= parked - max(0, p.host_act_budget), "parked_beyond_the_host_on_nvme"
        m += t_fwd * p.bw_nw >= spill, "nvme_writes_during_forward"
        read = 1 if p.nvme_weights else 0   # the weight copies read from NVMe too
        m += t_fwd * p.bw_nr >= read * (forward_weights - ahead), "forward_weights_read_from_nvme"
        m += t_bwd * p.bw_nr >= spill + read * (restreamed - ahead), "backward_weights_and_internals_read_from_nvme"
        m += t * p.bw_nr >= k * spill + read * step_weights, "nvme_reads_over_the_step"
        m += t * p.bw_nw >= k * spill, "nvme_writes_over_the_step"
    _, solver = _solver(MilpOptions())
    m.solve(solver)
    if pulp.LpStatus[m.status] != "Optimal":
        raise RuntimeError(f"step floor LP ended {pulp.LpStatus[m.status]!r} for {p.model.name} at "
                           f"micro-batch {p.micro_batch}; it is always feasible, so this is a solver fault")
    kept = sum(v.value() for v in keep)
    gone = sum(v.value() for v in park)
    return StepFloor(step_s=t.value(), forward_s=t_fwd.value(), backward_s=t_bwd.value(), kept_layers=kept,
                     offloaded_layers=gone, rerun_layers=L - kept - gone, offload=offload,
                     internals_fraction=internals_fraction, selective_layers=sum(v.value() for v in sel),
                     selective_offloaded_layers=sum(v.value() for v in sel_park))


def internals_fraction_for(p: Problem, reference_s: float, speedup: float, tol: float = 1e-3,
                           selective: bool = True) -> float | None:
    """The largest ``internals_fraction`` at which the offload floor allows ``speedup`` over a step
    of ``reference_s`` seconds (None: not even with internals of size ~0). Bisection on a monotone LP."""
    def ok(frac: float) -> bool:
        return step_floor(p, offload=True, internals_fraction=frac,
                          selective=selective).speedup_over(reference_s) >= speedup
    if ok(1.0):
        return 1.0
    lo, hi = tol, 1.0
    if not ok(lo):
        return None
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
