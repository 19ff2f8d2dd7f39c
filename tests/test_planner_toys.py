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
    params = [2000, 3000, 2500, 2200, 2800, 2000][:L]
    return ModelShape.from_layers("toy", params, hidden=64, vocab_size=0, tied_embeddings=True,
                                  q_dim=16, kv_dim=16, ffn=16)


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
                    graph_tail: bool = True, selective: bool = False):
    """Every Plan: recompute path x homes x (transfer windows) x (resident layer sets) x (``selective``:
    selective layer sets below the graph tail), each with and (``graph_tail``) without the last segment
    keeping its forward graph."""
    L = p.L
    K = max_segment or L
    tiers = ["hbm", "host"] + (["nvme"] if p.nvme_budget > 0 else [])
    res_sets = [()] + ([c for n in range(1, L + 1) for c in itertools.combinations(range(L), n)] if residency else [])
    for mask, graph in itertools.product(itertools.product([False, True], repeat=L - 1),
                                         [False, True] if graph_tail else [False]):
        kept = [0] + [i + 1 for i, k in enumerate(mask) if k]
        ends = kept[1:] + [L]
        # a graph tail is no recompute segment: its length is not limited
        if any(e - s > K for s, e in list(zip(kept, ends))[:len(kept) - 1 if graph else None]):
            continue
        seg_end = dict(zip(kept, ends))
        # the tail's first boundary is never stored: its home does not matter
        home_choices = [tiers] * (len(kept) - 1) + [["hbm"] if graph else tiers]
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
            for wins in itertools.product(*choices):
                ow = {b: w[0] for b, w in zip(off, wins) if w}
                pw = {b: w[1] for b, w in zip(off, wins) if w}
                below = kept[-1] if graph else L      # selective layers lie below the graph tail
                sel_sets = ([c for n in range(below + 1) for c in itertools.combinations(range(below), n)]
                            if selective else [()])
                for res, sel in itertools.product(res_sets, sel_sets):
                    yield Plan(num_layers=L, homes=tuple(homes), offload_window=ow, prefetch_window=pw,
                               resident_layers=res, policy="brute", last_segment_graph=graph,
                               selective_layers=sel)


def brute_force(p: Problem, free_windows: bool, residency: bool, max_segment: int | None = None,
                graph_tail: bool = True, selective: bool = False):
    """(best simulated step time, best plan, number of feasible plans)."""
    best, best_plan, n = float("inf"), None, 0
    for plan in enumerate_plans(p, free_windows, residency, max_segment, graph_tail, selective):
        r = simulate(p, plan, strict=False, timeline=False)
        if r.violations:
            continue
        n += 1
        if r.step_time_s < best:
            best, best_plan = r.step_time_s, plan
    return best, best_plan, n
