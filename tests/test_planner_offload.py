"""Offloaded layers in the planner (a Plan's ``offloaded_layers``): the cost model, the simulator's exact
replay of their copies, waits and memory, the MILP against brute force, when it chooses them, and the
step floor below it."""
import dataclasses
import json

import pytest

from lazytrain.planner.ceiling import step_floor
from lazytrain.planner.hardware import HardwareProfile
from lazytrain.planner.measured import MeasuredCosts
from lazytrain.planner.megatrain import MegaTrainPlanError
from lazytrain.planner.milp import MilpOptions, _start_values, build_and_solve
from lazytrain.planner.plan import RECOMPUTE, Plan, every_k_plan, keep_all_plan, offload_all_plan
from lazytrain.planner.problem import Budgets, Problem
from lazytrain.planner.simulate import simulate

from test_planner_milp import check_equal
from test_planner_toys import A_BYTES, SLOW_HW, TOY_HW, brute_force, toy_model, toy_problem

# links far faster than compute: an offloaded layer's copies cost next to nothing (the optimizer as in the
# other toys: its times stay well above the solver's tolerances)
FAST_LINKS = HardwareProfile(name="toy-fast-links", achievable_tflops=1e-4, h2d_gbps=10.0, d2h_gbps=10.0,
                             nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=0.002)
# links whose copies take round times: a boundary (8192 bytes) 2 ms H2D and 1 ms D2H
ROUND_LINKS = HardwareProfile(name="toy-round-links", achievable_tflops=1e-4, h2d_gbps=0.004096,
                              d2h_gbps=0.008192, host_optimizer_gparams_per_s=0.002)
ROUND_COSTS = MeasuredCosts(fwd_s=(0.004, 0.006), diff_s=(0.012, 0.018), nonlayer_s=0.002, step_s=0.001,
                            update_s=(0.001, 0.001))
MS = 1e-3


def round_problem() -> Problem:
    """Two toy layers with measured compute times (ms: forward 4 and 6, forward with autograd and backward
    12 and 18, head 2) and round link times; memory is no constraint."""
    return Problem(model=toy_model(2), hardware=ROUND_LINKS, micro_batch=4, seq_len=16, measured=ROUND_COSTS,
                   budgets=Budgets(gpu_bytes=10 ** 9, host_bytes=10 ** 9, gpu_reserved_bytes=0, loss_chunk_tokens=16))


def test_an_offloaded_layer_moves_its_internals_and_its_input():
    p = toy_problem(3, 1.0)
    # the toy layer saves 5 boundaries' worth per token (toy_model); its input: 1
    assert p.saved == [5 * A_BYTES] * 3 and p.offl_bytes == [6 * A_BYTES] * 3
    # its backward alone, measured or not: the forward with autograd and backward, less the forward
    q = round_problem()
    assert q.bwd_s(0) == pytest.approx(8 * MS, rel=1e-12) and q.bwd_s(1) == pytest.approx(12 * MS, rel=1e-12)
    assert p.bwd_s(2) == p.diff_s[2] - p.fwd_s[2]


def test_the_simulator_replays_an_offloaded_layer_exactly():
    p = round_problem()
    # layer 0's internals: 6 boundaries, 6 ms D2H and 12 ms H2D; weights 4000 and 6000 bytes
    assert (p.offl_bytes[0] / p.bw_d2h, p.offl_bytes[0] / p.bw_h2d) == (6 * MS, 12 * MS)
    plan = Plan(num_layers=2, homes=("hbm", "hbm", "hbm"), offloaded_layers=(0,))
    assert plan.internals_prefetch_at(0) == 2 and plan.recomputed_layers() == 0
    r = simulate(p, plan)
    # window 0: forward of layer 0 (4 ms), then its internals leave (6 ms): 10 ms
    # window 1: forward of layer 1 (6) and the head (2): 8 ms
    # window 2: diff of layer 1 (18 ms) while layer 0's internals (12 ms) and weights (0.98 ms) come back
    # window 3: backward of layer 0 alone (12 - 4 = 8 ms), no re-run; layer 1's gradients leave (0.73 ms)
    assert r.window_s == pytest.approx([10 * MS, 8 * MS, 18 * MS, 8 * MS], rel=1e-12)
    events = {(e.lane, e.label): (e.start, e.end, e.window) for e in r.timeline}
    assert events["d2h", "offload internals L0"] == pytest.approx((4 * MS, 10 * MS, 0), rel=1e-12)
    assert events["h2d", "prefetch internals L0"] == pytest.approx((18 * MS, 30 * MS, 2), rel=1e-12)
    assert events["compute", "bwd L0"] == pytest.approx((36 * MS, 44 * MS, 3), rel=1e-12)
    assert ("h2d", "weights L0") in events and not any(e.label.startswith("recompute") for e in r.timeline)
    # the last gradients (layer 0's: 4000 bytes, 0.49 ms), then the optimizer: the embedding/head step (1 ms),
    # layer 0's update (1 ms) and copy (0.98 ms) delay the next forward by 2.98 ms
    assert r.step_time_s == pytest.approx(44 * MS + 0.48828125 * MS + 2.9765625 * MS, rel=1e-12)
    assert r.exposed_s["d2h"] == pytest.approx(6 * MS + 0.48828125 * MS, rel=1e-12)   # the internals' copy
    assert r.offloaded_layers == 1 and r.summary()["offloaded_layers"] == 1
    # memory against the same plan without the offload: window 0 holds the internals until they are copied,
    # window 1 no longer boundary 0 (it left with them), window 2 the internals back beside boundary 0 (which
    # the plain plan keeps), window 3 the same; the host holds 6 boundaries from window 0 to the backward
    plain = simulate(p, keep_all_plan(2, home="hbm"))
    gpu = [m["hbm"] - n["hbm"] for m, n in zip(r.memory, plain.memory)]
    host = [m["host"] - n["host"] for m, n in zip(r.memory, plain.memory)]
    assert gpu == [5 * A_BYTES, -A_BYTES, 5 * A_BYTES, 0] and host == [6 * A_BYTES] * 4


def test_internals_brought_back_in_the_backward_window_are_waited_for():
    p = round_problem()
    late = Plan(num_layers=2, homes=("hbm", "hbm", "hbm"), offloaded_layers=(0,), internals_prefetch_window={0: 3})
    r = simulate(p, late)
    # window 3 waits 12 ms for them, then runs the 8 ms backward
    assert r.window_s == pytest.approx([10 * MS, 8 * MS, 18 * MS, 20 * MS], rel=1e-12)
    assert r.exposed_s["h2d"] == pytest.approx(12 * MS, rel=1e-12)
    assert [m["hbm"] for m in r.memory][2] == simulate(p, keep_all_plan(2, home="hbm")).memory[2]["hbm"] - A_BYTES
    # a copy back the Plan contract forbids (after the backward), replayed anyway: the read is caught
    object.__setattr__(late, "internals_prefetch_window", {0: 4})
    r = simulate(p, late, strict=False)
    assert any("bwd of layer 0 reads boundary 0, which has no device copy" in v for v in r.violations)


def test_internals_copied_out_in_a_later_window_overlap_its_compute():
    p = round_problem()
    # layer 0's internals leave in window 1, beside layer 1's forward and the head (8 ms): window 0 is its
    # forward alone; they hold the device in window 1 until then
    plan = Plan(num_layers=2, homes=("hbm", "hbm", "hbm"), offloaded_layers=(0,), internals_offload_shares={0: {1: 1.0}})
    r = simulate(p, plan)
    assert r.window_s == pytest.approx([4 * MS, 8 * MS, 18 * MS, 8 * MS], rel=1e-12)
    events = {(e.lane, e.label): (e.start, e.end, e.window) for e in r.timeline}
    assert events["d2h", "offload internals L0"] == pytest.approx((4 * MS, 10 * MS, 1), rel=1e-12)
    unsplit = simulate(p, Plan(num_layers=2, homes=("hbm", "hbm", "hbm"), offloaded_layers=(0,)))
    gpu = [m["hbm"] - n["hbm"] for m, n in zip(r.memory, unsplit.memory)]
    assert gpu == [0, p.offl_bytes[0], 0, 0]
    # split in halves over windows 0 and 1, and back in halves in windows 2 and 3 (the second exposed)
    half = Plan(num_layers=2, homes=("hbm", "hbm", "hbm"), offloaded_layers=(0,),
                internals_offload_shares={0: {0: 0.5, 1: 0.5}}, internals_prefetch_shares={0: {2: 0.5, 3: 0.5}})
    r = simulate(p, half)
    assert r.window_s == pytest.approx([7 * MS, 8 * MS, 18 * MS, 14 * MS], rel=1e-12)
    assert r.exposed_s["h2d"] == pytest.approx(6 * MS, rel=1e-12)
    gpu = [m["hbm"] - n["hbm"] for m, n in zip(r.memory, unsplit.memory)]
    assert gpu == pytest.approx([0, p.offl_bytes[0] / 2, -p.offl_bytes[0] / 2, 0], rel=1e-12)


def test_the_milp_splits_the_internals_copies_where_that_gains_time():
    """Two layers, memory plentiful, no graph tail: unsplit, offloading layer 0 costs its 6 ms copy in
    window 0 and saves its 4 ms re-run, so the optimum re-runs it (42 ms of windows); split, its copy runs
    beside window 1's 8 ms of compute and offloading it gains 4 ms (38 ms)."""
    p = round_problem()
    opts = MilpOptions(allow_graph_tail=False, allow_selective=False)
    split, info = build_and_solve(p, opts)
    r = simulate(p, split)
    assert split.offloaded_layers == (0,) and split.internals_offload_shares == {0: {1: 1.0}}
    assert sum(r.window_s) == pytest.approx(38 * MS, rel=1e-9)
    assert info.objective_s == pytest.approx(r.step_time_s, rel=1e-6)
    unsplit, info = build_and_solve(p, dataclasses.replace(opts, split_internals=False))
    r = simulate(p, unsplit)
    assert unsplit.offloaded_layers == () and sum(r.window_s) == pytest.approx(42 * MS, rel=1e-9)
    assert info.objective_s == pytest.approx(r.step_time_s, rel=1e-6)
    # the copy out spread over no later window than the options allow
    none_later, _ = build_and_solve(p, dataclasses.replace(opts, internals_out_windows=0))
    assert none_later.offloaded_layers == ()


def test_the_split_model_runs_only_after_the_unsplit_one_is_solved_with_time_left(monkeypatch):
    import lazytrain.planner.milp as milp
    p = round_problem()
    opts = MilpOptions(allow_graph_tail=False, allow_selective=False)
    calls, original = [], milp._build_and_solve

    def recorded(p, o, start, status=None, **kw):
        plan, info = original(p, o, start, **kw)
        calls.append((o.split_internals, start))
        if status:
            info.status = status
        return plan, info
    monkeypatch.setattr(milp, "_build_and_solve", recorded)
    plan, info = build_and_solve(p, opts)
    unsplit_plan = calls[0][0] is False and calls[1][1]
    assert [c[0] for c in calls] == [False, True] and unsplit_plan.internals_offload_shares == {}
    assert plan.internals_offload_shares == {0: {1: 1.0}}
    assert "started from the unsplit model's optimal plan" in info.detail
    # the unsplit model stopped at its time limit (feasible, not optimal): its plan is the answer
    calls.clear()
    monkeypatch.setattr(milp, "_build_and_solve", lambda p, o, s, **kw: recorded(p, o, s, "feasible", **kw))
    plan, info = build_and_solve(p, opts)
    assert [c[0] for c in calls] == [False] and plan.offloaded_layers == () and info.status == "feasible"
    assert "internals copies unsplit (the split model had no time after the unsplit one)" in info.detail
    # the split model stopped without a plan, or with none faster: the unsplit plan is the answer
    for raised, message in ((milp.NoPlanInTimeError("stopped"), "found no plan in the "),
                            (None, "found no faster plan in the ")):
        def second_fails(p, o, s, **kw):
            if o.split_internals and raised:
                raise raised
            plan, info = original(p, o, s, **kw)
            if o.split_internals:
                info.objective_s = float("inf")
            return plan, info
        monkeypatch.setattr(milp, "_build_and_solve", second_fails)
        plan, info = build_and_solve(p, opts)
        assert plan.offloaded_layers == () and f"internals copies unsplit, the plan optimal among those (the split model {message}" in info.detail
        # optimal only where the split model proved it (its own solve ended optimal, not faster)
        assert info.status == ("feasible" if raised else "optimal")


def test_boundary_0_of_an_offloaded_layer_0_goes_unused_whatever_its_home():
    p = toy_problem(3, 10.0, host_slots=20, hw=FAST_LINKS)
    on_device, on_host = offload_all_plan(3), offload_all_plan(3, input_home="host")
    a, b = simulate(p, on_device), simulate(p, on_host)
    assert a.step_time_s == b.step_time_s and a.memory == b.memory
    assert not any("b0" in e.label for e in b.timeline)


def test_megatrains_executor_refuses_offloaded_layers():
    p = toy_problem(6, 3.0, hw=SLOW_HW)
    mega = every_k_plan(6, 4, overlap_optimizer=False)
    simulate(p, mega, executor="megatrain", strict=False)
    with pytest.raises(MegaTrainPlanError, match="no selective layers, no offloaded layers and a serial optimizer"):
        simulate(p, dataclasses.replace(mega, offloaded_layers=(3,)), executor="megatrain", strict=False)


@pytest.mark.parametrize("L,gpu_extra,host_slots,nvme_slots,hw,free_windows,selective,offloaded", [
    (3, 1.0, 12, 0, FAST_LINKS, True, False, (0, 1)),   # layer 0 too (boundary 0's home unused), beside a tail
    (3, 1.0, 6, 1, FAST_LINKS, True, False, (1,)),      # host room for one layer's internals
    (3, 1.0, 6, 0, TOY_HW, True, False, ()),            # slow links: the copies cost more than re-runs
    (4, 1.0, 14, 0, FAST_LINKS, False, True, (1, 2)),   # offloaded rather than selective
])
def test_offloaded_layers_the_milp_equals_brute_force(L, gpu_extra, host_slots, nvme_slots, hw, free_windows,
                                                      selective, offloaded):
    p = toy_problem(L, gpu_extra, host_slots=host_slots, nvme_slots=nvme_slots, hw=hw)
    plan = check_equal(p, free_windows=free_windows, resident=False, selective=selective, offload=True)
    assert plan.offloaded_layers == offloaded
    if offloaded:   # it pays: faster than the best plan without offloaded layers
        best, _, _ = brute_force(p, free_windows=free_windows, residency=False, selective=selective)
        assert simulate(p, plan).step_time_s < best * (1 - 1e-6)


def test_with_measured_costs_residency_and_accumulation_the_milp_equals_brute_force():
    costs = MeasuredCosts(fwd_s=(0.004, 0.006, 0.005), diff_s=(0.012, 0.018, 0.015), nonlayer_s=0.002,
                          step_s=0.001, update_s=(0.001,) * 3)
    p = dataclasses.replace(toy_problem(3, 1.0, host_slots=12, hw=FAST_LINKS), measured=costs, grad_accum=2)
    plan = check_equal(p, free_windows=False, resident=True, offload=True)
    assert plan.offloaded_layers
    r = simulate(p, plan)
    for j in plan.offloaded_layers:   # its backward window runs its measured backward alone, in both micro-batches
        assert [e.end - e.start for e in r.timeline if e.lane == "compute" and e.window == 5 - j] == \
            pytest.approx([costs.diff_s[j] - costs.fwd_s[j]] * 2, rel=1e-12)


def _short_memory(hw) -> Problem:
    """Six toy layers, room on the GPU for one boundary beyond a window's least need, the host for many."""
    return toy_problem(6, 1.0, host_slots=40, hw=hw)


def test_the_milp_offloads_when_links_are_fast_and_memory_short_not_when_links_are_slow():
    fast = _short_memory(FAST_LINKS)
    plan, info = build_and_solve(fast, MilpOptions())
    r = simulate(fast, plan)
    assert info.status == "optimal" and info.objective_s == pytest.approx(r.step_time_s, rel=1e-6)
    assert plan.offloaded_layers == (0, 1, 2, 3, 4) and plan.recomputed_layers() == 0
    without, _ = build_and_solve(fast, MilpOptions(allow_offload=False))
    assert without.offloaded_layers == () and simulate(fast, without).step_time_s > r.step_time_s * 1.1
    slow = _short_memory(SLOW_HW)
    plan, info = build_and_solve(slow, MilpOptions())
    assert plan.offloaded_layers == () and info.objective_s == pytest.approx(simulate(slow, plan).step_time_s,
                                                                             rel=1e-6)


def test_a_plan_with_offloaded_layers_round_trips_through_json(tmp_path):
    p = _short_memory(FAST_LINKS)
    plan, _ = build_and_solve(p, MilpOptions())
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    back = Plan.from_json(str(path))
    assert back == plan and back.offloaded_layers == plan.offloaded_layers
    # the copies of this plan are split over windows (the links are fast and the device short)
    assert back.internals_prefetch_shares == plan.internals_prefetch_shares != {}
    assert back.internals_offload_shares == plan.internals_offload_shares != {}
    written = json.loads(path.read_text())
    assert written["offloaded_layers"] == list(plan.offloaded_layers)
    assert written["internals_offload_shares"] == {str(j): {str(w): x for w, x in split.items()}
                                                   for j, split in plan.internals_offload_shares.items()}
    unsplit, _ = build_and_solve(p, MilpOptions(split_internals=False))
    assert unsplit.internals_prefetch_window != {} and unsplit.internals_prefetch_shares == {}
    assert Plan.from_json(unsplit.to_json()) == unsplit
    assert simulate(p, back).step_time_s == simulate(p, plan).step_time_s


def test_a_start_plan_with_offloaded_layers_is_taken_in_and_the_optimum_stays():
    p = _short_memory(FAST_LINKS)
    cold, _ = build_and_solve(p, MilpOptions())
    # every layer offloaded, each one's internals brought back in its own backward window (the least memory)
    start = Plan(num_layers=6, homes=("hbm",) + (RECOMPUTE,) * 5 + ("hbm",), offloaded_layers=tuple(range(6)),
                 internals_prefetch_window={j: 11 - j for j in range(6)})
    assert not simulate(p, start, strict=False).violations
    warm, info = build_and_solve(p, MilpOptions(), start_plan=start)
    assert info.status == "optimal"
    assert simulate(p, warm).step_time_s == pytest.approx(simulate(p, cold).step_time_s, rel=1e-7)
    # outside the space of a MILP that may not offload: not used as a start
    captured = {}
    import lazytrain.planner.milp as milp

    def capture(plan, *args):
        captured["values"] = _start_values(plan, *args)
        return captured["values"]
    original, milp._start_values = milp._start_values, capture
    try:
        milp._build_and_solve(p, MilpOptions(), start)   # the split model alone (not after the unsplit one)
        chosen = {v.name for v, x in captured["values"].items() if x == 1.0}
        assert {f"offl_{j}" for j in range(6)} | {"g_0"} <= chosen
        # its copies' shares are continuous: left for the solver to complete, not among the start's values
        assert not any(v.name.startswith(("offl_pre", "offl_out")) for v in captured["values"])
        build_and_solve(p, MilpOptions(split_internals=False), start_plan=start)
        chosen = {v.name for v, x in captured["values"].items() if x == 1.0}
        assert {f"offl_pre_{j}_{start.internals_prefetch_at(j)}" for j in range(6)} <= chosen
        build_and_solve(p, MilpOptions(allow_offload=False, allow_graph_tail=False), start_plan=start)
        assert captured["values"] is None
    finally:
        milp._start_values = original



@pytest.mark.parametrize("hw", [FAST_LINKS, TOY_HW], ids=["fast", "slow"])
def test_the_offload_floor_stays_below_the_milps_optimum(hw):
    p = _short_memory(hw)
    plan, info = build_and_solve(p, MilpOptions())
    assert info.status == "optimal"
    floor = step_floor(p, offload=True)
    assert floor.step_s <= simulate(p, plan).step_time_s * (1 + 1e-9)
    assert floor.step_s <= step_floor(p).step_s * (1 + 1e-9)



@pytest.mark.parametrize("flag,allowed,lean", [([], True, True), (["--no-offload"], False, True),
                                               (["--no-lean-norms"], True, False)])
def test_lazytrain_plan_offloads_and_counts_lean_norms_unless_told_not_to(monkeypatch, capsys, flag, allowed, lean):
    from lazytrain.cli import main
    from lazytrain.planner import report
    seen = {}

    def compare(p, opts, plan=None):
        seen["opts"], seen["problem"] = opts, p
        raise ValueError("stopped before solving")
    monkeypatch.setattr(report, "compare", compare)
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "rtx3090", "--micro-batch", "8",
                 "--gpu-mem", "24GiB"] + flag) == 2
    assert seen["opts"].allow_offload is allowed and "stopped before solving" in capsys.readouterr().err
    p = seen["problem"]   # the RMSNorms' internals as lazytrain.lean_norms runs them, or as transformers saves them
    assert p.budgets.lean_norms is lean
    assert p.saved[0] == p.model.layers[0].saved_bytes_per_token(2, lean_norms=lean) * 8 * p.seq_len
