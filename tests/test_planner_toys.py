"""Tiny planning problems (L <= 6) and a brute-force enumerator of Plans, shared by the planner tests
(this module holds no tests itself)."""
from __future__ import annotations

import itertools

from lazytrain.planner.hardware import HardwareProfile
from lazytrain.planner.models import ModelShape
from lazytrain.planner.plan import Plan
from lazytrain.planner.problem import Budgets, Problem
from lazytrain.planner.simulate import simulate

A_BYTES = 64 * 64 * 2          # boundary bytes of the toy: 64 tokens x hidden 64 x bf16

TOY_HW = HardwareProfile(name="toy", achievable_tflops=1e-4, h2d_gbps=0.002, d2h_gbps=0.0025,
                         nvme_read_gbps=0.001, nvme_write_gbps=0.0015, host_optimizer_gparams_per_s=0.002)
SLOW_HW = HardwareProfile(name="toy-slow-link", achievable_tflops=1e-4, h2d_gbps=0.0012, d2h_gbps=0.0014,
                          nvme_read_gbps=0.0008, nvme_write_gbps=0.001, host_optimizer_gparams_per_s=0.002)


def toy_model(L: int) -> ModelShape:
    """Layers that save five boundaries' worth per token (the toys' hand computations count in boundaries)."""
    params = [2000, 3000, 2500, 2200, 2800, 2000][:L]
    return ModelShape.from_layers("toy", params, hidden=64, vocab_size=0, tied_embeddings=True,
                                  q_dim=16, kv_dim=16, ffn=16, saved_bytes_per_token=5 * 64 * 2)


def toy_problem(L: int, gpu_extra: float, host_slots: int = 2, nvme_slots: int = 0, hw=TOY_HW) -> Problem:
    """A toy whose GPU budget is the smallest per-window need plus ``gpu_extra`` boundaries."""
    budgets = dict(gpu_reserved_bytes=0, loss_chunk_tokens=16)
    base = Problem(model=toy_model(L), hardware=hw, micro_batch=4, seq_len=16,
                   budgets=Budgets(gpu_bytes=10 ** 9, host_bytes=10 ** 9, **budgets))
    need = max(base.min_gpu_bytes(w)[0] for w in range(2 * L))
    return Problem(model=toy_model(L), hardware=hw, micro_batch=4, seq_len=16,
                   budgets=Budgets(gpu_bytes=int(need + gpu_extra * A_BYTES),
                                   host_bytes=base.host_static + host_slots * A_BYTES,
                                   nvme_bytes=nvme_slots * A_BYTES, **budgets))


def enumerate_plans(p: Problem, free_windows: bool, residency: bool, max_segment: int | None = None,
                    graph_tail: bool = True, selective: bool = False, offload: bool = False):
    """Every Plan: recompute path x homes x (transfer windows) x (resident layer sets) x (``selective``:
    selective layer sets below the graph tail) x (``offload``: offloaded layer sets below the graph tail,
    each a segment of its own, with every backward window for their internals' copy back), each with and
    (``graph_tail``) without the last segment keeping its forward graph."""
    L = p.L
    K = max_segment or L
    tiers = ["hbm", "host"] + (["nvme"] if p.nvme_budget > 0 else [])
    res_sets = [()] + ([c for n in range(1, L + 1) for c in itertools.combinations(range(L), n)] if residency else [])
    offl_sets = [c for n in range(L + 1) for c in itertools.combinations(range(L), n)] if offload else [()]
    for mask, graph, offl in itertools.product(itertools.product([False, True], repeat=L - 1),
                                               [False, True] if graph_tail else [False], offl_sets):
        kept = [0] + [i + 1 for i, k in enumerate(mask) if k]
        if any(j in kept[1:] for j in offl):         # an offloaded layer's input is not stored
            continue
        starts = sorted(set(kept) | set(offl))
        ends = starts[1:] + [L]
        if any(j + 1 not in starts and j + 1 != L for j in offl):   # a segment of its own
            continue
        below = kept[-1] if graph else L             # selective and offloaded layers lie below the graph tail
        if any(j >= below for j in offl):
            continue
        # a graph tail is no recompute segment: its length is not limited
        segments = list(zip(starts, ends))
        if any(e - s > K for s, e in segments[:len(segments) - 1 if graph else None]):
            continue
        seg_end = dict(segments)
        # the tail's first boundary is never stored, nor is boundary 0 of an offloaded layer 0: their homes
        # do not matter
        home_choices = [["hbm"] if (graph and b == kept[-1]) or (b == 0 and 0 in offl) else tiers for b in kept]
        for hs in itertools.product(*home_choices):
            homes = ["recompute"] * L + ["hbm"]
            for b, h in zip(kept, hs):
                homes[b] = h
            off = [b for b in kept if homes[b] != "hbm"]
            choices = []
            for b in off:
                need = 2 * L - seg_end[b]
                if free_windows:
                    choices.append([(o, q) for o in range(b, need) for q in range(o + 1, need + 1)])
                else:
                    choices.append([None])
            internals = [range(L, 2 * L - j) for j in offl]   # backward windows up to its own
            for wins, iwins in itertools.product(itertools.product(*choices), itertools.product(*internals)):
                ow = {b: w[0] for b, w in zip(off, wins) if w}
                pw = {b: w[1] for b, w in zip(off, wins) if w}
                sel_sets = ([c for n in range(below + 1) for c in itertools.combinations(
                    [j for j in range(below) if j not in offl], n)] if selective else [()])
                for res, sel in itertools.product(res_sets, sel_sets):
                    yield Plan(num_layers=L, homes=tuple(homes), offload_window=ow, prefetch_window=pw,
                               resident_layers=res, policy="brute", last_segment_graph=graph,
                               selective_layers=sel, offloaded_layers=offl,
                               internals_prefetch_window=dict(zip(offl, iwins)))


def brute_force(p: Problem, free_windows: bool, residency: bool, max_segment: int | None = None,
                graph_tail: bool = True, selective: bool = False, offload: bool = False):
    """(best simulated step time, best plan, number of feasible plans)."""
    best, best_plan, n = float("inf"), None, 0
    for plan in enumerate_plans(p, free_windows, residency, max_segment, graph_tail, selective, offload):
        r = simulate(p, plan, strict=False, timeline=False)
        if r.violations:
            continue
        n += 1
        if r.step_time_s < best:
            best, best_plan = r.step_time_s, plan
    return best, best_plan, n
