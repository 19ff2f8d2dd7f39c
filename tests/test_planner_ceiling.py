"""The step floor of a plan space (planner/ceiling.py): below every plan, exact on hand-computed toys."""
from __future__ import annotations

import pytest

from lazytrain.planner.ceiling import internals_fraction_for, step_floor
from lazytrain.planner.hardware import CATALOG, HardwareProfile
from lazytrain.planner.milp import MilpOptions
from lazytrain.planner.models import catalog_model
from lazytrain.planner.policies import megatrain_plan
from lazytrain.planner.problem import Budgets, Problem
from lazytrain.planner.search import solve
from lazytrain.planner.simulate import simulate
from test_planner_toys import SLOW_HW, TOY_HW, brute_force, toy_model, toy_problem

# links and optimizer far faster than compute: only compute and GPU memory bind
FAST_LINKS = HardwareProfile(name="toy-fast-links", achievable_tflops=1e-4, h2d_gbps=10.0, d2h_gbps=10.0,
                             nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)


def fast_problem(L: int, room: float, host_bytes_extra: int = 0, hw=FAST_LINKS) -> Problem:
    """A toy whose GPU budget leaves ``room`` bytes free beside the first backward window (``room`` < 100:
    that many of the first layer's internals)."""
    budgets = dict(gpu_reserved_bytes=0, loss_chunk_tokens=16)
    base = Problem(model=toy_model(L), hardware=hw, micro_batch=4, seq_len=16,
                   budgets=Budgets(gpu_bytes=10 ** 9, host_bytes=10 ** 9, **budgets))
    room = room * base.saved[0] if room < 100 else room
    gpu = int(base.fixed_gpu_bytes(L) + base.Wl[L - 1] + base.A[L - 1] + room)
    return Problem(model=toy_model(L), hardware=hw, micro_batch=4, seq_len=16, check=False,
                   budgets=Budgets(gpu_bytes=gpu, host_bytes=base.host_static + host_bytes_extra, **budgets))


@pytest.mark.parametrize("L,gpu_extra,hw", [(3, 2, TOY_HW), (4, 1, TOY_HW), (4, 40, TOY_HW), (5, 3, SLOW_HW)])
def test_floor_is_below_every_plan_of_the_space(L, gpu_extra, hw):
    p = toy_problem(L, gpu_extra, hw=hw)
    best, _, n = brute_force(p, free_windows=False, residency=False, selective=True)
    assert n > 0
    graph = step_floor(p)
    assert graph.step_s <= best * (1 + 1e-9)
    assert step_floor(p, offload=True).step_s <= graph.step_s * (1 + 1e-9)
    assert graph.step_s <= step_floor(p, selective=False).step_s * (1 + 1e-9)


def test_room_for_every_graph_gives_the_minimal_compute():
    p = fast_problem(4, room=10)
    f = step_floor(p, selective=False)
    assert f.step_s == pytest.approx(p.minimal_compute_s(), rel=1e-9)
    assert (f.kept_layers, f.rerun_layers) == (pytest.approx(4), pytest.approx(0, abs=1e-9))


def test_no_room_reruns_every_layer_but_the_last():
    p = fast_problem(4, room=0)
    f = step_floor(p, selective=False)
    # the last layer's internals are part of its own backward window, so it never re-runs
    assert f.step_s == pytest.approx(p.minimal_compute_s() + sum(p.fwd_s[:3]), rel=1e-9)
    assert f.rerun_layers == pytest.approx(3)


def test_fractional_room_keeps_the_most_expensive_layers_first():
    base = fast_problem(4, room=0)                # toy layers: 2000, 3000, 2500, 2200 parameters
    held = [s + w + a for s, w, a in zip(base.saved, base.Wl, base.A)]   # a kept graph: internals, weights, input
    p = fast_problem(4, room=held[1] + 0.5 * held[2])
    f = step_floor(p, selective=False)
    # all layers save the same internals; layer 1 (most FLOPs per byte held) is kept whole, layer 2 half,
    # layer 0 re-runs (the last layer never does)
    expected = p.minimal_compute_s() + p.fwd_s[0] + 0.5 * p.fwd_s[2]
    assert f.step_s == pytest.approx(expected, rel=1e-9)
    assert f.kept_layers == pytest.approx(2.5)


def test_offload_needs_host_room_and_link_time():
    no_host = fast_problem(4, room=0, host_bytes_extra=0)
    assert step_floor(no_host, offload=True).step_s == pytest.approx(step_floor(no_host).step_s, rel=1e-9)
    assert step_floor(no_host).step_s == pytest.approx(step_floor(no_host, selective=False).step_s, rel=1e-9)
    # what an offloaded layer parks: its internals and its input (6 boundaries: 5 + 1)
    assert no_host.offl_bytes[0] == no_host.saved[0] + no_host.A[0] == 6 * no_host.A[0]
    one_layer = fast_problem(4, room=0, host_bytes_extra=no_host.offl_bytes[0])
    f = step_floor(one_layer, offload=True, selective=False)
    # fast links: the host's room for one layer's internals saves the re-run of the most expensive layer
    assert f.offloaded_layers == pytest.approx(1)
    assert f.step_s == pytest.approx(no_host.minimal_compute_s() + no_host.fwd_s[0] + no_host.fwd_s[2], rel=1e-9)


def test_offload_is_limited_by_the_forward_phase_on_a_slow_link():
    slow = HardwareProfile(name="toy-slow-d2h", achievable_tflops=1e-4, h2d_gbps=10.0, d2h_gbps=0.0015,
                           nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    p = fast_problem(4, room=0, host_bytes_extra=10 ** 8, hw=slow)
    f = step_floor(p, offload=True, selective=False)
    t_fwd = sum(p.fwd_s) + p.head_s
    # the forward moves 0.42 of a layer's internals and input; stretching it to move more costs more than a
    # re-run, so the floor parks exactly that, from the most expensive layer (1)
    parked = t_fwd * p.bw_d2h / p.offl_bytes[1]
    assert parked == pytest.approx(0.42, abs=0.01)
    assert f.offloaded_layers == pytest.approx(parked, rel=1e-6)
    assert f.forward_s == pytest.approx(t_fwd, rel=1e-9)
    assert f.step_s == pytest.approx(step_floor(p, selective=False).step_s - parked * p.fwd_s[1], rel=1e-9)



def test_parking_matmul_outputs_moves_more_layers_through_the_same_link():
    """The hypothetical selective offload parks a layer's matmul/attention outputs and input (3.5 + 1
    boundaries) where an offloaded layer parks its internals and input (5 + 1): the same forward's link
    carries 6/4.5 as many layers, each re-run from its outputs."""
    slow = HardwareProfile(name="toy-slow-d2h", achievable_tflops=1e-4, h2d_gbps=10.0, d2h_gbps=0.0015,
                           nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    p = fast_problem(4, room=0, host_bytes_extra=10 ** 8, hw=slow)
    t_fwd = sum(p.fwd_s) + p.head_s
    f = step_floor(p, selective=False, selective_offload=True)
    parked = t_fwd * p.bw_d2h / (p.sel_bytes[1] + p.A[1])
    assert parked == pytest.approx(0.42 * 6 / 4.5, abs=0.01)
    assert (f.selective_offloaded_layers, f.offloaded_layers) == (pytest.approx(parked, rel=1e-6), 0)
    assert f.step_s == pytest.approx(step_floor(p, selective=False).step_s
                                     - parked * (p.fwd_s[1] - p.sel_rerun_s[1]), rel=1e-9)
    # here it beats offloading the internals, so the floor with both kinds parks outputs only
    both = step_floor(p, offload=True, selective=False, selective_offload=True)
    assert both.step_s == pytest.approx(f.step_s, rel=1e-9)
    assert both.offloaded_layers == pytest.approx(0, abs=1e-9)
    assert f.step_s < step_floor(p, offload=True, selective=False).step_s

def test_each_phase_waits_for_its_weights_on_a_slow_link():
    """No room for residency (but the last layer's, whose weights are on the device at the turn anyway) and a
    slow host-to-device link: each forward streams every other layer's weights but the two the weight
    stream's slots may hold before it starts, and each backward the same again."""
    slow = HardwareProfile(name="toy-slow-h2d", achievable_tflops=1e-4, h2d_gbps=0.0001, d2h_gbps=10.0,
                           nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    p = fast_problem(4, room=0, hw=slow)
    f = step_floor(p, selective=False)
    streamed = (sum(p.Wl[:-1]) - 2 * max(p.Wl)) / p.bw_h2d
    assert streamed > sum(p.fwd_s) + p.head_s                     # the link binds the forward
    assert f.forward_s == pytest.approx(streamed, rel=1e-9)
    assert f.backward_s >= streamed * (1 - 1e-9)


def test_smaller_internals_lower_the_floor_and_the_fraction_search_inverts_it():
    p = fast_problem(4, room=1, host_bytes_extra=0)
    full = step_floor(p, offload=True, selective=False)
    half = step_floor(p, offload=True, internals_fraction=0.5, selective=False)
    assert half.step_s < full.step_s
    reference = 1.1 * half.step_s
    frac = internals_fraction_for(p, reference, 1.1, selective=False)
    assert frac == pytest.approx(0.5, abs=2e-3)
    assert internals_fraction_for(p, 10 * full.step_s, 2.0, selective=False) == 1.0
    assert internals_fraction_for(p, p.minimal_compute_s(), 1.5, selective=False) is None


def test_room_for_one_layers_matmul_outputs_makes_the_most_expensive_layer_selective():
    base = fast_problem(4, room=0)
    p = fast_problem(4, room=base.sel_bytes[1])
    f = step_floor(p)
    # a selective layer holds 3.5 boundaries (its matmul/attention outputs), a kept graph its internals (6
    # boundaries), weights and input: per byte, selective saves more; layer 1 (most FLOPs, the same
    # non-matmul FLOPs) saves the most. Layers 0 and 2 re-run whole, the last never does.
    assert p.sel_bytes[1] < sum(x[1] for x in (base.saved, base.Wl, base.A)) * (1 - p.sel_rerun_frac[1])
    assert f.step_s == pytest.approx(p.minimal_compute_s() + p.fwd_s[0] + p.sel_rerun_s[1] + p.fwd_s[2], rel=1e-9)
    assert (f.selective_layers, f.kept_layers) == (pytest.approx(1), pytest.approx(1, abs=1e-9))
    assert step_floor(p, selective=False).step_s > f.step_s


def test_internals_fraction_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"internals_fraction must be in \(0, 1\], got 0"):
        step_floor(fast_problem(3, room=1), internals_fraction=0)


def test_paper_h800_7b_our_plan_sits_between_the_floor_and_megatrain():
    p = Problem(model=catalog_model("qwen2.5-7b"), hardware=CATALOG["h800"], budgets=Budgets.of(gpu="70GB"),
                micro_batch=144, seq_len=1024)
    ours = simulate(p, solve(p, MilpOptions(time_limit_s=10)), timeline=False).step_time_s
    megatrain = simulate(p, megatrain_plan(p), strict=False, timeline=False).step_time_s
    graph, offload = step_floor(p), step_floor(p, offload=True)
    assert offload.step_s <= graph.step_s <= ours < megatrain
    # one layer's internals are ~28 GB here: at most a few layers avoid their re-run in either space
    assert graph.kept_layers < 3 and offload.kept_layers + offload.offloaded_layers < 7
    assert graph.speedup_over(megatrain) < 1.35 and offload.speedup_over(megatrain) < 1.35


def test_weights_stream_twice_a_micro_batch_unless_kept_or_resident():
    import dataclasses
    slow_h2d = HardwareProfile(name="toy-slow-h2d", achievable_tflops=1e-4, h2d_gbps=1e-5, d2h_gbps=10.0,
                               nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    p = dataclasses.replace(fast_problem(4, room=0, hw=slow_h2d), grad_accum=3)
    f = step_floor(p, offload=True)
    # no room: every micro-batch streams each layer for its forward and all but the last again for its
    # backward, but the last layer (its weights on the device at the turn anyway) may be resident: its
    # forward copy once a step; the embedding and head once a step
    streamed = 3 * (sum(p.Wl) + sum(p.Wl[:3])) + p.nonlayer_w - 2 * p.Wl[3]
    assert streamed / p.bw_h2d > 3 * p.minimal_compute_s()
    assert f.step_s == pytest.approx(streamed / p.bw_h2d, rel=1e-9)
    # room for layer 1's weights: resident, streamed once a step (its forward refresh) instead of six times
    q = dataclasses.replace(fast_problem(4, room=p.Wl[1], hw=slow_h2d), grad_accum=3)
    assert step_floor(q, offload=True).step_s == pytest.approx((streamed - 5 * p.Wl[1]) / p.bw_h2d, rel=1e-9)


def test_floor_is_below_every_plan_with_accumulation_and_resident_layers():
    # a slow link: with 3 micro-batches a step the best plan keeps every layer resident, the last one too,
    # and copies each layer's weights once a step
    import dataclasses
    slow_h2d = HardwareProfile(name="toy-slow-h2d", achievable_tflops=1e-4, h2d_gbps=1e-5, d2h_gbps=10.0,
                               nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    p = dataclasses.replace(toy_problem(3, 2, hw=slow_h2d), grad_accum=3)
    best, _, n = brute_force(p, free_windows=False, residency=True, selective=False)
    assert n > 0
    for offload in (False, True):
        assert step_floor(p, offload=offload).step_s <= best * (1 + 1e-9)
    assert p.lower_bound_s()["bound"] <= best * (1 + 1e-9)


def test_floor_lets_a_layer_keep_its_graph_and_be_resident():
    # every layer keeping its graph and resident: no re-run, and with 32 micro-batches a step each layer's
    # weights copied once. The floor without selective layers must stay below this plan (a layer's choice
    # between its graph and residency would cost either a re-run or a copy each micro-batch)
    import dataclasses
    from lazytrain.planner.plan import Plan
    base = toy_problem(3, 50)
    gbps = sum(base.Wl) / (8 * sum(base.fwd_s)) / 1e9   # all weights take 8 forwards' time to copy
    hw = HardwareProfile(name="toy-h2d", achievable_tflops=1e-4, h2d_gbps=gbps, d2h_gbps=100.0,
                         nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=100.0)
    p = dataclasses.replace(toy_problem(3, 50, hw=hw), grad_accum=32)
    plan = Plan(num_layers=3, homes=("hbm", "recompute", "recompute", "hbm"), last_segment_graph=True,
                resident_layers=(0, 1, 2), micro_batch_size=p.micro_batch, seq_len=p.seq_len)
    assert plan.graph_start() == 0
    step = simulate(p, plan).step_time_s
    for offload in (False, True):
        assert step_floor(p, offload=offload, selective=False).step_s <= step * (1 + 1e-9)


def nvme_weights_problem(p: Problem, hw: HardwareProfile, nvme_extra: int = 0, grad_accum: int = 1) -> Problem:
    """``p`` with its streamed compute copies on NVMe (weights_home "nvme"), ``nvme_extra`` bytes free beside."""
    import dataclasses
    weights = sum(-(-layer.params * 2 // 4096) * 4096 for layer in p.model.layers)
    budgets = dataclasses.replace(p.budgets, weights_in_host=False, nvme_bytes=weights + nvme_extra)
    return Problem(model=p.model, hardware=hw, micro_batch=p.micro_batch, seq_len=p.seq_len, budgets=budgets,
                   grad_accum=grad_accum, check=False)


def test_weights_read_from_nvme_bound_the_floor_on_a_slow_drive():
    """With the compute copies on NVMe every weight copy is read there first: the floor charged the host link
    alone, so on a drive slower than the link it sat below what any plan could reach."""
    slow_nvme = HardwareProfile(name="toy-slow-nvme", achievable_tflops=1e-4, h2d_gbps=10.0, d2h_gbps=10.0,
                                nvme_read_gbps=1e-5, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    p = nvme_weights_problem(fast_problem(4, room=0, hw=slow_nvme), slow_nvme, grad_accum=3)
    f = step_floor(p, offload=True)
    # as on a slow host link (test above), but the embedding and head, on the device, are not read from NVMe
    read = 3 * (sum(p.Wl) + sum(p.Wl[:3])) - 2 * p.Wl[3]
    assert read / p.bw_nr > 3 * p.minimal_compute_s() + p.nonlayer_w / p.bw_h2d
    assert f.step_s == pytest.approx(read / p.bw_nr, rel=1e-9)
    assert p.lower_bound_s()["nvme_read"] == sum(p.Wl) / p.bw_nr
    from lazytrain.planner.report import table
    assert f", NVMe read {sum(p.Wl) / p.bw_nr:.3f}, optimizer " in table(p, []).splitlines()[0]


@pytest.mark.parametrize("hw", [TOY_HW, SLOW_HW], ids=["toy", "slow-link"])
def test_floor_with_weights_on_nvme_is_below_every_plan(hw):
    import dataclasses
    slow_read = dataclasses.replace(hw, name="toy-slower-nvme", nvme_read_gbps=hw.h2d_gbps / 4)
    p = nvme_weights_problem(toy_problem(3, 2, hw=slow_read), slow_read)
    best, _, n = brute_force(p, free_windows=False, residency=True, selective=True)
    assert n > 0
    floor = step_floor(p).step_s
    assert floor <= best * (1 + 1e-9)
    assert step_floor(p, offload=True).step_s <= floor * (1 + 1e-9)
    assert p.lower_bound_s()["bound"] <= floor * (1 + 1e-9)
