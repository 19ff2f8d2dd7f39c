"""Discrete-event simulator of one training step of a Plan.

Independent of the MILP: it replays the Plan window by window on five resources (the compute stream,
the H2D and D2H PCIe links, NVMe reads and NVMe writes, see problem.py for the execution model) plus
the host optimizer, tracks where every boundary's copies are and when each becomes readable, and
accounts device, host and NVMe bytes over time; an offloaded layer's internals (Plan.offloaded_layers)
are copied to the host after its forward (or in the shares Plan.internals_offload_split gives, each at
the start of its window) and back in the shares of Plan.internals_prefetch_split, and its backward waits
for them. It outputs the step time, TFLOPS under the paper's convention (6 * N * batch * seq / step time, N
the parameters a token multiplies: ModelShape.throughput_params; a frozen bottom's layers count 2 per parameter,
their forward alone), tokens/s, exposed time per link, peak bytes
per tier and a timeline; it checks the invariants (every boundary on the device before a task reads it, no
tier over budget) and reports each violation (raising :class:`SimulationError` when ``strict``).

With gradient accumulation a step is its micro-batches, then the optimizer. The first micro-batch's forward
refreshes the resident layers' device copies (their weights were just updated); the later ones find them
current and stream only the other layers, as the engine's weight stream does, each starting when layer
0's weights are copied (unless it is resident). The timeline and the memory over time hold every micro-batch
(each event names its own: ``Event.micro_batch``), and the compute and exposed times are the whole step's, as
the step time is: a plot or trace of the step shows the step it times.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..trace import Timeline
from . import megatrain
from .plan import DEVICE_HOME, RECOMPUTE, Plan
from .problem import GRAD_SHARE_WINDOWS, Problem, fmt_bytes

LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")
EXECUTORS = ("lazytrain", "megatrain")   # whose executor runs the plan (megatrain.py: MegaTrain's code)
OFFLOAD_HOMES = ("host", "nvme")
BUDGET_ROUNDING = 1e-9   # relative: a peak this far over its budget is float rounding (see the budget check)


class SimulationError(ValueError):
    """A Plan that breaks an invariant when replayed (a boundary read before it arrives, a tier over budget)."""


@dataclass
class Event:
    lane: str           # compute | h2d | d2h | nvme_read | nvme_write | optimizer | wait
    label: str
    start: float
    end: float
    window: int
    micro_batch: int | None = 0   # which micro-batch of the step; None: the step's end (last gradients, update)
    nbytes: float = 0.0           # what a transfer (an event on a link) moves


@dataclass
class _MicroBatch:
    """One micro-batch as replayed, on a clock of its own from 0: the step repeats it and shifts its events."""
    events: list[Event]
    memory: list[dict[str, Any]]
    window_s: list[float]
    exposed: dict[str, float]
    compute_s: float
    peak: dict[str, int]
    violations: list[str]
    duration: float       # its windows (on MegaTrain's executor, and its last gradients' copy)


@dataclass
class SimResult:
    step_time_s: float
    tflops: float
    tokens_per_s: float
    exposed_s: dict[str, float]
    peak_bytes: dict[str, int]
    compute_s: float             # the step's: every micro-batch's (so are exposed_s, timeline and memory)
    window_s: list[float]        # the first micro-batch's windows
    recomputed_layers: int
    boundaries_per_home: dict[str, int]
    selective_layers: int = 0    # layers whose forward keeps its matmul/attention outputs (Plan.selective_layers)
    offloaded_layers: int = 0    # layers whose internals go to the host and back (Plan.offloaded_layers)
    timeline: list[Event] = field(default_factory=list)
    # per window of each micro-batch: window, micro_batch, start, end, hbm, host, nvme
    memory: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    micro_step_s: float = 0.0    # the first micro-batch's windows (MegaTrain's: and its last gradients' copy)

    def trace(self, source: str = "predicted") -> Timeline:
        """The simulated step as a :class:`~lazytrain.trace.Timeline`, the format measured steps use: its
        transfers with their bytes, whole as measured ones count them, so that the two compare link by link;
        its duration the step time (the overlapped update runs on into the next step)."""
        t = Timeline(source, step_s=self.step_time_s)
        for e in self.timeline:
            t.add_relative(e.lane, e.label, e.start, e.end, window=e.window, micro_batch=e.micro_batch,
                           **({"bytes": round(e.nbytes)} if e.lane in LINKS else {}))
        return t.finish()

    def summary(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "tflops": self.tflops, "tokens_per_s": self.tokens_per_s,
                "exposed_s": dict(self.exposed_s), "peak_bytes": dict(self.peak_bytes),
                "compute_s": self.compute_s, "recomputed_layers": self.recomputed_layers,
                "boundaries_per_home": dict(self.boundaries_per_home), "selective_layers": self.selective_layers,
                "offloaded_layers": self.offloaded_layers}


def _needs_layer(kind: str, j: int, graph_start: int) -> bool:
    """Whether a task has its layer's weights streamed in and reads its input boundary ``j`` from the
    device: every layer task but a graph layer's backward (its graph holds both). An offloaded layer's
    backward has its weights streamed again and reads the input its internals bring back."""
    return kind != "head" and not (kind == "bwd" and j >= graph_start)


def _share_label(label: str, split: dict[int, float], w: int) -> str:
    """An internals copy's label: the share issued in window ``w``, where the copy is split."""
    return label if len(split) == 1 else f"{label} share {split[w]:.4g}"


def _last_grads_label(p: Problem, *others: str) -> str:
    """The gradients a backward copies last: the lowest layer's it reaches (none where it reaches none), and
    ``others``'."""
    parts = ([f"L{p.first_reached}"] if p.first_reached < p.L else []) + list(others)
    return "grads " + " + ".join(parts) if parts else "grads"


def _link_bw(p: Problem, link: str) -> float:
    return {"h2d": p.bw_h2d, "d2h": p.bw_d2h, "nvme_read": p.bw_nr, "nvme_write": p.bw_nw}[link]


def window_tasks(p: Problem, plan: Plan, executor: str = "lazytrain") -> list[list[tuple[str, int, float]]]:
    """Compute tasks per window: (kind, layer, seconds); kind in fwd | head | recompute | diff | bwd
    (``bwd``: a graph layer's or an offloaded layer's backward alone, from the graph its forward recorded).
    LazyTrain re-runs layers s..e-2 of a segment [s, e); MegaTrain re-runs s..e-1 (megatrain.rerun_range).
    A selective layer's re-runs (its recompute, and the forward part of its diff task) take ``sel_rerun_s``.
    The backward windows of the layers below ``Problem.first_reached`` (a frozen bottom) have no tasks."""
    L, f = p.L, p.first_reached
    g = plan.graph_start()
    sel = frozenset(plan.selective_layers)          # their re-runs recompute only the non-matmul ops
    offl = frozenset(plan.offloaded_layers)         # differentiated from their graph, brought back
    seg_by_end = {e: s for s, e in plan.segments() if s < g}
    out: list[list[tuple[str, int, float]]] = []
    for w in range(2 * L):
        if w < L:
            t = [("fwd", w, p.fwd_s[w] + (p.sel_fwd_extra[w] if w in sel else 0.0))]
            if w == L - 1:
                t.append(("head", -1, p.head_s))
        else:
            i = p.layer_of(w)
            t = []
            if i < f:                               # no backward reaches it
                out.append(t)
                continue
            if i + 1 in seg_by_end:
                s = seg_by_end[i + 1]
                reruns = megatrain.rerun_range(s, i + 1) if executor == "megatrain" else range(s, i)
                t += [("recompute", j, p.rerun_s(j, sel)) for j in reruns]
            t.append(("bwd", i, p.bwd_s(i)) if i >= g or i in offl else ("diff", i, p.diff_task_s(i, sel)))
        out.append(t)
    return out


def simulate(p: Problem, plan: Plan, strict: bool = True, timeline: bool = True,
             executor: str = "lazytrain", *, refresh_resident: bool = True) -> SimResult:
    """Replay ``plan`` on ``executor``: ``"lazytrain"`` (this engine) or ``"megatrain"`` (MegaTrain's code:
    all of a block re-run, its serial host phase and its device memory, see megatrain.py).
    ``refresh_resident=False`` replays a later micro-batch of the step (``micro_step_s``): its resident copies
    are current, and on LazyTrain's executor the micro-batch before it is still copying its last gradients
    (``Problem.carry_bytes``) in its first windows."""
    L = p.L
    if plan.num_layers != L:
        raise SimulationError(f"plan has {plan.num_layers} layers, the model {p.model.name!r} has {L}")
    if executor not in EXECUTORS:
        raise SimulationError(f"executor {executor!r} is not one of {', '.join(EXECUTORS)}")
    mega_k = megatrain.checkpoint_interval(plan) if executor == "megatrain" else None   # refuses what it cannot run
    if mega_k is not None:   # it trains every parameter, whatever the problem freezes
        p = megatrain.as_it_trains(p)
    if executor == "megatrain" and p.budgets.lean_norms and (p.measured is None or p.measured.lean_norms is not None):
        # MegaTrain runs transformers' norms as written: its backwards recompute none (LazyTrain's lean norms).
        # Not checked again: a budget MegaTrain's memory overruns is a violation here, not an error
        p = replace(p, budgets=replace(p.budgets, lean_norms=False), check=False)
    for i, h in enumerate(plan.homes):
        if h not in (DEVICE_HOME, RECOMPUTE) + OFFLOAD_HOMES:
            raise SimulationError(f"homes[{i}] = {h!r}: the simulator models the built-in tiers hbm, host, nvme")
    resident = set(plan.resident_layers)
    g = plan.graph_start()                                      # layers g.. keep their forward graph
    selective = plan.selective_layers                           # all below g (Plan.validate)
    offl = plan.offloaded_layers                                # all below g, none selective (Plan.validate)
    offl_out = {j: plan.internals_offload_split(j) for j in offl}    # {window: share} to the host
    offl_back = {j: plan.internals_prefetch_split(j) for j in offl}  # {window: share} back to the device
    tasks = window_tasks(p, plan, executor)
    seg_end = {s: e for s, e in plan.segments() if s < g}
    need = {b: 2 * L - seg_end[b] for b in seg_end}            # first backward read of kept boundary b < L
    last_use = {b: p.last_use_window(b) for b in range(L)}       # layer b is differentiated then (Problem)
    # kept boundaries whose segment lies below the lowest layer the backward reaches: stored, never read back
    unread = {b for b, e in seg_end.items() if e <= p.first_reached}
    # window -> the recomputed boundaries it regenerates
    regenerated: dict[int, list[int]] = {}
    for s, e in seg_end.items():
        regenerated.setdefault(2 * L - e, []).extend(range(s + 1, e))
    # boundaries stored off the device (an offloaded layer's input travels in its internals: boundary 0's home
    # then goes unused)
    offloaded = [b for b in range(g) if plan.homes[b] in OFFLOAD_HOMES and b not in offl_back]
    off_w = {b: plan.offload_at(b) for b in offloaded}
    # (an unread one is on its tier until the pass is released, and comes back never)
    pre_w = {b: last_use[b] if b in unread else plan.prefetch_at(b) for b in offloaded}

    # MegaTrain's executor copies each micro-batch's last gradients (layer 0's and the embedding's) after its
    # backward (its head slab beside its first backward windows); LazyTrain's engine sends an earlier
    # micro-batch's beside the next one's windows, and the step waits for the last one's alone (tail_once below)
    tail_bytes = megatrain.tail_bytes(p) if mega_k is not None else 0
    mega_buffers = megatrain.buffer_bytes(p) if mega_k is not None else None
    host_static = megatrain.host_bytes(p) if mega_k is not None else p.host_static
    nvme_static = 0 if mega_k is not None else p.nvme_static   # (MegaTrain keeps its layer copies in host memory)
    tail_each = tail_bytes / p.bw_d2h

    def micro_batch(refresh: bool) -> _MicroBatch:
        """One micro-batch's windows, on a clock of its own from 0. ``refresh``: its forward refreshes the
        resident layers' device copies (the step's first); a later one finds them current and, on LazyTrain's
        executor, copies the micro-batch before's last gradients in its first windows."""
        # gradients copied beside the windows (Problem.GRAD_SHARE_WINDOWS): the head's in the first backward
        # windows, an earlier micro-batch's last ones in a later micro-batch's first forward windows. MegaTrain's
        # executor copies its last ones at the end of each micro-batch's backward (tail_each above).
        shared = min(GRAD_SHARE_WINDOWS, L)
        beside: dict[int, tuple[str, float]] = {}
        if mega_k is not None:   # its head slab, on its gradient stream after the loss's backward
            for w in range(L, L + shared):
                beside[w] = ("grads head/norm", megatrain.head_grad_bytes(p) / shared)
        else:
            for w in range(L, L + shared):
                beside[w] = ("grads embedding/head", p.head_grad_bytes / shared)
            if not refresh:
                for w in range(shared):
                    beside[w] = ("grads L0 + embedding of the micro-batch before", p.carry_bytes / shared)
        violations: list[str] = []
        events: list[Event] = []
        memory: list[dict[str, Any]] = []
        exposed = {k: 0.0 for k in LINKS + ("optimizer",)}
        ready_at: dict[int, float] = {0: 0.0}   # boundary -> time its device copy becomes readable
        on_device: set[int] = {0}               # boundaries with a device copy (during the current window)
        window_s: list[float] = []
        peak = {"hbm": 0, "host": 0, "nvme": 0}
        t = 0.0
        compute_total = 0.0

        def weight_stream(ws: int) -> list[int]:
            """Layers whose weights window ``ws`` streams into a buffer (resident layers use theirs)."""
            return [j for kind, j, _ in tasks[ws] if _needs_layer(kind, j, g) and j not in resident]

        for w in range(2 * L):
            t0 = t
            fwd = w < L
            # --- transfers issued in this window -------------------------------------------------
            exposed_tr, other_tr = [], []           # (label, {link: bytes}, boundary or None)
            for b in offloaded:
                if pre_w[b] == w and b not in unread:
                    legs = {"h2d": p.A[b]}
                    if plan.homes[b] == "nvme":
                        legs["nvme_read"] = p.A[b]
                    (exposed_tr if w == need[b] else other_tr).append((f"prefetch b{b}", legs, b))
            for j in offl:                          # internals back, with the input they hold (boundary j)
                if w in offl_back[j]:
                    (exposed_tr if w == 2 * L - 1 - j else other_tr).append(
                        (_share_label(f"prefetch internals L{j}", offl_back[j], w),
                         {"h2d": p.offl_bytes[j] * offl_back[j][w]}, j))
            if w >= L + 1 and p.layer_of(w - 1) > p.first_reached:   # the lowest layer's: after the windows
                i_prev = p.layer_of(w - 1)
                other_tr.append((f"grads L{i_prev}", {"d2h": p.Gl[i_prev]}, None))
            if beside.get(w, ("", 0))[1] > 0:
                other_tr.append((beside[w][0], {"d2h": beside[w][1]}, None))
            for j in offl:                          # internals to the host, the shares after their forward window's
                if w in offl_out[j] and w > j:      # issued as the window starts
                    other_tr.append((_share_label(f"offload internals L{j}", offl_out[j], w),
                                     {"d2h": p.offl_bytes[j] * offl_out[j][w]}, None))
            for b in offloaded:
                if off_w[b] == w:
                    legs = {"d2h": p.A[b]}
                    if plan.homes[b] == "nvme":
                        legs["nvme_write"] = p.A[b]
                    other_tr.append((f"offload b{b}", legs, None))
            if w + 1 < 2 * L:
                for kind, j, _ in tasks[w + 1]:
                    if not _needs_layer(kind, j, g):       # the head; a graph layer holds its weights
                        continue
                    if (w + 1 < L and refresh) or j not in resident:   # forward refreshes resident copies
                        legs = {"h2d": p.Wl[j], "nvme_read": p.Wl[j]} if p.nvme_weights else {"h2d": p.Wl[j]}
                        other_tr.append((f"weights L{j}", legs, None))
            free = {k: t0 for k in LINKS}
            compute_start = t0
            for n_tr, (label, legs, b) in enumerate(exposed_tr + other_tr):
                done = t0
                for link, nbytes in legs.items():
                    start = free[link]
                    free[link] = start + nbytes / _link_bw(p, link)
                    done = max(done, free[link])
                    if timeline:
                        events.append(Event(link, label, start, free[link], w, nbytes=nbytes))
                if b is not None:
                    ready_at[b] = done
                if n_tr < len(exposed_tr):
                    compute_start = max(compute_start, done)
            if compute_start > t0:
                legs_used = {k for _, lg, _ in exposed_tr for k in lg}   # in LINKS' order: a tie goes to the first
                waited = max((k for k in LINKS if k in legs_used), key=lambda k: free[k] if k in ("h2d", "nvme_read")
                             else -1.0)
                exposed[waited] += compute_start - t0
            # --- boundaries with a device copy during this window --------------------------------
            if w < L:
                on_device.add(w + 1)                               # produced by this window
            for b in offloaded:
                if pre_w[b] == w and b not in unread:
                    on_device.add(b)
            for j in offl:                          # its input is back (in its internals) for its backward
                if w == 2 * L - 1 - j and max(offl_back[j]) <= w:
                    on_device.add(j)
            on_device.update(regenerated.get(w, ()))
            # --- compute -----------------------------------------------------------------------
            tc = compute_start
            fwd_done = None
            for kind, j, dur in tasks[w]:
                if _needs_layer(kind, j, g):                       # a layer task reads boundary j
                    if j not in on_device:
                        violations.append(f"window {w}: {kind} of layer {j} reads boundary {j}, "
                                          f"which has no device copy (home {plan.homes[j]!r})")
                    elif ready_at.get(j, float("inf")) > tc + 1e-12:
                        violations.append(f"window {w}: {kind} of layer {j} starts at {tc:.6f}s but boundary {j} "
                                          f"is readable only at {ready_at.get(j, float('inf')):.6f}s")
                if timeline:
                    events.append(Event("compute", f"{kind} L{j}" if j >= 0 else "head", tc, tc + dur, w))
                tc += dur
                if kind in ("fwd", "recompute"):
                    ready_at[j + 1] = tc                           # output boundary j+1 produced
                if kind == "fwd":
                    fwd_done = tc
            if fwd and w in offl_out and w in offl_out[w]:   # its internals and input to the host once its
                start = max(free["d2h"], fwd_done)               # forward has saved them
                nbytes = p.offl_bytes[w] * offl_out[w][w]
                free["d2h"] = start + nbytes / p.bw_d2h
                if timeline:
                    events.append(Event("d2h", _share_label(f"offload internals L{w}", offl_out[w], w), start,
                                        free["d2h"], w, nbytes=nbytes))
            compute_w = tc - compute_start
            compute_total += compute_w
            end = max([tc] + list(free.values()))
            if end > tc + 1e-15:
                worst = max(LINKS, key=lambda k: free[k])
                exposed[worst] += end - tc
            # --- memory during this window -------------------------------------------------------
            if mega_k is not None:                                 # MegaTrain's own allocations
                hbm = sum(megatrain.gpu_bytes(p, mega_k, w, mega_buffers).values()) + p.budgets.gpu_reserved_bytes
            else:
                streamed = sum(p.Wl[j] for j in weight_stream(w))
                if w + 1 < 2 * L:
                    streamed += sum(p.Wl[j] for j in weight_stream(w + 1))
                if len(resident) < L:                                  # the engine's two kept buffers
                    streamed = max(streamed, p.kept_buffers)
                weights = streamed + sum(p.Wl[j] for j in resident)
                graphs = 0                                             # graph layers: weights and internals held
                for j in range(g, L):
                    if j <= w <= 2 * L - 1 - j and j not in resident:   # its own copy, beside the slot in window j
                        weights += p.Wl[j]
                    if j <= w < 2 * L - 1 - j:                         # its own backward window counts them already
                        graphs += p.saved[j]
                for j in selective:   # kept matmul/attention outputs; in its backward window the diff task's autograd
                    if j <= w < 2 * L - 1 - j:   # saves these same tensors, which the window's workspace counts
                        graphs += p.sel_bytes[j]
                for j in offl:        # internals: in its forward window (its input counts as boundary j), then what is
                    if w == j:        # still to be copied out; from their prefetch what is back (its input with them);
                        graphs += p.saved[j]                           # its backward window's workspace counts them
                    elif j < w < 2 * L - 1 - j:
                        graphs += p.offl_bytes[j] * (sum(x for v, x in offl_out[j].items() if v >= w)
                                                     + sum(x for v, x in offl_back[j].items() if v <= w))
                bnd = sum(p.A[b] for b in on_device if b <= L)
                if w == L - 1:
                    bnd -= p.A[L]                                      # counted in the window's fixed bytes
                hbm = p.fixed_gpu_bytes(w) + weights + bnd + graphs
            host = sum(p.A[b] for b in offloaded if plan.homes[b] == "host" and off_w[b] <= w <= pre_w[b])
            host += sum(p.offl_bytes[j] for j in offl if j <= w <= 2 * L - 1 - j)   # until its backward frees them
            nvme = sum(p.A[b] for b in offloaded if plan.homes[b] == "nvme" and off_w[b] <= w <= pre_w[b])
            memory.append({"window": w, "micro_batch": 0, "start": t0, "end": end, "hbm": hbm,
                           "host": host_static + host, "nvme": nvme_static + nvme})
            peak["hbm"] = max(peak["hbm"], hbm)
            peak["host"] = max(peak["host"], host_static + host)
            peak["nvme"] = max(peak["nvme"], nvme_static + nvme)
            # --- copies released at the end of this window ---------------------------------------
            for b in list(on_device):
                if b == L and w >= L - 1:
                    on_device.discard(b)
                elif b < L and b in off_w and off_w[b] == w:
                    on_device.discard(b)                          # offload done: device copy freed
                elif b < L and w >= last_use[b]:
                    on_device.discard(b)                          # layer b differentiated
                elif fwd and w == b and (plan.homes[b] == RECOMPUTE or b in offl_back) and b < g:
                    on_device.discard(b)                          # dropped after the forward used it (an
                                                                  # offloaded layer's input: copied out with it)
                # a graph layer's input stays until its backward: its recorded graph holds it (RMSNorm's
                # backward reads it), so it counts as a boundary on the device until the layer is done
            window_s.append(end - t0)
            t = end
        end_of_windows = t
        t += tail_each
        exposed["d2h"] += tail_each
        if timeline and mega_k is not None:
            events.append(Event("d2h", _last_grads_label(p, "embedding"), end_of_windows, t, 2 * L,
                                nbytes=tail_bytes))
        return _MicroBatch(events, memory, window_s, exposed, compute_total, peak, violations, t)

    # --- the step: its micro-batches one after another, the last one's last gradients to the host (LazyTrain's
    # executor), then the host optimizer
    first = micro_batch(refresh_resident)
    micro_step = first.duration           # windows (and MegaTrain's gradient copy), once per micro-batch
    # the micro-batches after the first: resident copies are current, the last gradients still leaving; each
    # one's forward waits for layer 0's weights (the first one's copy is in the delay)
    later = micro_batch(False) if p.grad_accum > 1 else first
    load_first = 0.0 if 0 in resident else p.load_l[0]
    later_s = later.duration + load_first
    events, memory, window_s = list(first.events), list(first.memory), first.window_s
    exposed, compute_total, peak = dict(first.exposed), first.compute_s, dict(first.peak)
    violations = list(first.violations)
    for k in range(1, p.grad_accum):      # the timeline and the accounts hold every micro-batch of the step
        start = micro_step + (k - 1) * later_s + load_first
        if timeline and load_first:
            events.append(Event("h2d", "weights L0", start - load_first, start, 0, micro_batch=k, nbytes=p.Wl[0]))
        events += [replace(e, start=e.start + start, end=e.end + start, micro_batch=k) for e in later.events]
        memory += [dict(m, start=m["start"] + start, end=m["end"] + start, micro_batch=k) for m in later.memory]
        exposed["h2d"] += load_first
        for link, s in later.exposed.items():
            exposed[link] += s
        compute_total += later.compute_s
    if p.grad_accum > 1:
        peak = {tier: max(peak[tier], later.peak[tier]) for tier in peak}
        violations += [f"later micro-batches: {v}" for v in later.violations if v not in first.violations]
    tail_once = 0.0 if mega_k is not None else p.tail_s
    tail_start = micro_step + (p.grad_accum - 1) * later_s
    opt_start = tail_start + tail_once
    exposed["d2h"] += tail_once
    if timeline and mega_k is None:
        last = _last_grads_label(p, *(() if p.first_reached else ("embedding",)))   # a frozen bottom's: none
        events.append(Event("d2h", last, tail_start, opt_start, 2 * L, micro_batch=None, nbytes=p.carry_bytes))
    # the embedding's and head's weights, copied to the GPU after the update: MegaTrain copies all of them
    load_nl, load_nl_bytes = ((p.nonlayer_w / p.bw_h2d, p.nonlayer_w) if mega_k is not None
                              else (p.load_nl, p.nonlayer_link_bytes))
    O = [p.opt_nl]
    for o in p.opt_l:
        O.append(O[-1] + o)                                    # O[w+1] = layers 0..w updated
    if plan.overlap_optimizer:
        s_w = O[1] + p.load_nl + p.load_l[0]
        for w in range(1, L):
            s_w = max(s_w + window_s[w - 1], O[w + 1] + p.load_l[w])
        delay = s_w - sum(window_s[:L - 1])
    elif mega_k is not None:
        host = megatrain.host_phase_parts(p)
        delay = sum(host.values()) + load_nl + p.load_l[0]
    else:
        delay = O[-1] + p.load_nl + p.load_l[0]
    exposed["optimizer"] += delay
    if timeline and mega_k is not None:
        start = opt_start
        for label, dur in host.items():
            events.append(Event("optimizer", label, start, start + dur, 2 * L, micro_batch=None))
            start += dur
    elif timeline:
        events.append(Event("optimizer", "embedding/head", opt_start, opt_start + O[0], 2 * L, micro_batch=None))
        for j in range(L):
            events.append(Event("optimizer", f"update L{j}", opt_start + O[j], opt_start + O[j + 1], 2 * L,
                                micro_batch=None))
    step = micro_step + (p.grad_accum - 1) * later_s + tail_once + delay
    if timeline:   # the rest of the step, so that the timeline ends where the step does
        if plan.overlap_optimizer:
            events.append(Event("wait", "optimizer exposed in the next forward", step - delay, step, 2 * L,
                                micro_batch=None))
        else:
            events.append(Event("h2d", "next step's first weights (embedding/head + L0)",
                                step - load_nl - p.load_l[0], step, 2 * L, micro_batch=None,
                                nbytes=load_nl_bytes + p.Wl[0]))

    # --- budgets -----------------------------------------------------------------------------
    # a plan's internals shares are floats a solver chose at its feasibility tolerance: a share of a byte over
    # a budget (relative 1e-9: 70 bytes of 70 GB) is that rounding, not a plan that does not fit
    for tier, budget in (("hbm", p.gpu_budget), ("host", p.host_budget), ("nvme", p.nvme_budget)):
        if peak[tier] > budget * (1 + BUDGET_ROUNDING):
            w_at = max(memory, key=lambda m: m[tier])["window"]
            violations.append(f"{tier} peak {fmt_bytes(peak[tier])} in window {w_at} exceeds its budget "
                              f"{fmt_bytes(budget)} by {fmt_bytes(peak[tier] - budget)}")
    if strict and violations:
        raise SimulationError(f"plan {plan.policy!r} breaks {len(violations)} invariant(s): " + "; ".join(violations[:5]))

    counts = {h: 0 for h in (DEVICE_HOME, "host", "nvme", RECOMPUTE, "graph")}
    for i, h in enumerate(plan.homes[:L]):
        h = "graph" if i >= g else h                           # held inside a recorded forward graph
        counts[h] = counts.get(h, 0) + 1
    toks = p.micro_batch * p.seq_len * p.grad_accum
    # a frozen bottom's layers run their forward alone: 2 of the convention's 6 FLOPs per parameter and token
    forward_only = sum(l.token_params for l in p.model.layers[:p.first_reached])
    return SimResult(step_time_s=step, tflops=(6 * p.model.throughput_params - 4 * forward_only) * toks / step / 1e12,
                     tokens_per_s=toks / step, exposed_s=exposed, peak_bytes=peak, compute_s=compute_total,
                     window_s=window_s, boundaries_per_home=counts, selective_layers=len(selective),
                     offloaded_layers=len(offl),
                     recomputed_layers=sum(1 for ws in tasks for kind, *_ in ws if kind == "recompute"),
                     timeline=events, memory=memory, violations=violations, micro_step_s=micro_step)
