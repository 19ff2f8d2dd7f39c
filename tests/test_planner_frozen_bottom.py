"""A frozen bottom: the layers below the first one that trains, with nothing before them training (Budgets.
frozen_bottom_layers). The engine differentiates none of them, so the planner charges them no backward, no
gradients and no update, keeps none of their boundaries but boundary 0, and policy "auto" measures and plans
such a run."""
from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

import lazytrain
from lazytrain.planner.measured import MeasuredCosts, MeasurementError, with_selective
from lazytrain.planner.milp import build_and_solve
from lazytrain.planner.plan import Plan
from lazytrain.planner.policies import greedy_plan, keep_all
from lazytrain.planner.problem import Budgets, Problem
from lazytrain.planner.simulate import simulate
from lazytrain.tiers import streams
from engine_models import batches, lm_loss, make_model, max_rel_diff, plan_engine, reference_train
from test_planner_milp import check_equal, full_space
from test_planner_toys import SLOW_HW, TOY_HW, toy_problem


def frozen(p: Problem, f: int) -> Problem:
    return dataclasses.replace(p, budgets=dataclasses.replace(p.budgets, frozen_bottom_layers=f))


@pytest.mark.parametrize("L,f,gpu_extra,host_slots,hw,free_windows,offload", [
    (3, 1, 2.0, 1, TOY_HW, True, False),     # every window free: boundary 0 never read back
    (4, 2, 1.5, 1, SLOW_HW, False, True),    # offloaded layers allowed above the frozen bottom
    (5, 3, 2.5, 1, TOY_HW, False, False),
    (4, 4, 1.0, 1, TOY_HW, False, False),    # no layer trains: no backward through the layers at all
])
def test_the_milps_frozen_bottom_plan_is_the_best_of_every_plan(L, f, gpu_extra, host_slots, hw, free_windows,
                                                               offload):
    """The brute force runs over every plan, those that keep frozen boundaries or re-run frozen layers among
    them; the MILP's space holds one segment [0, f) and nothing below f: it loses nothing."""
    p = frozen(toy_problem(L, gpu_extra, host_slots=host_slots, hw=hw), f)
    plan = check_equal(p, free_windows=free_windows, resident=False, selective=True, offload=offload)
    assert plan.homes[1:f] == ("recompute",) * (f - 1)
    assert not set(plan.selective_layers + plan.offloaded_layers) & set(range(f))


def test_a_frozen_bottom_has_no_backward_tasks_gradients_or_updates_and_the_step_is_shorter():
    p0 = toy_problem(4, 3.0, host_slots=4)
    p = frozen(p0, 2)
    plan = Plan(num_layers=4, homes=("host", "recompute", "host", "host", "hbm"), policy="t")
    r, r0 = simulate(p, plan), simulate(p0, plan)
    events = [(e.label, e.window) for e in r.timeline if e.lane != "optimizer"]
    labels = [label for label, _ in events]
    assert not [x for x in labels if x in ("diff L0", "diff L1", "grads L0", "grads L1") or x.startswith("prefetch b0")]
    assert "diff L2" in labels and "prefetch b2" in labels
    # layers 0 and 1 stream their weights for their forwards alone; windows 6 and 7 (their backwards') do nothing
    assert [w for label, w in events if label in ("weights L0", "weights L1")] == [0]
    assert [label for label, w in events if w in (6, 7)] == ["grads embedding/head"] * 2   # the head's, beside
    assert labels.count("grads L2") == 1                       # after the windows, as the last ones
    assert (p.Gl[:2], p.opt_l[:2]) == ([0.0, 0.0], [0.0, 0.0])
    # the layers' trainable share is all above the frozen bottom: their gradients are whole
    assert p.Gl[2:] == [l.params * 2 for l in p.model.layers[2:]]
    assert p.tail_s == p.Gl[2] / p.bw_d2h                      # the lowest layer the backward reaches: 2
    assert ("grads L2", 8) in events
    # boundary 0 on the host: copied out once, never back, and held there until layer 2's backward window (5),
    # when the engine releases the pass; boundaries 2 and 3 until their prefetch in window 4
    a = p.A[0]
    assert [m["host"] - p.host_static for m in r.memory] == [a, a, 2 * a, 3 * a, 3 * a, a, 0, 0]
    assert r.step_time_s < r0.step_time_s
    assert r.compute_s == pytest.approx(sum(p.fwd_s) + p.head_s + sum(p.diff_s[2:]))


@pytest.mark.parametrize("L", [4, 6])
def test_the_milp_starts_from_keep_all_at_every_frozen_bottom(L):
    """keep_all's plan is the solver's first incumbent (search.solve's warm start) whatever the frozen bottom; at
    f = 1 the edge [0, 1) is in no row, and a start naming it failed inside the solver."""
    from lazytrain.planner.milp import MilpOptions
    for f in range(L + 1):
        p = frozen(toy_problem(L, 3.0, host_slots=L), f)
        plan, info = build_and_solve(p, MilpOptions(), start_plan=keep_all(p)[0])
        assert info.status == "optimal", f
        assert info.objective_s == pytest.approx(simulate(p, plan).step_time_s, rel=1e-6, abs=1e-6 * 2 * L), f


def test_the_baselines_keep_no_boundary_below_the_frozen_bottom_but_the_first():
    p = frozen(toy_problem(5, 3.0, host_slots=5), 3)
    assert keep_all(p)[0].homes[:4] == ("hbm", "recompute", "recompute", "hbm")
    homes = greedy_plan(p)[0].homes
    assert homes[1:3] == ("recompute", "recompute") and homes[0] != "recompute"
    plan, info = build_and_solve(p, full_space(5, False), start_plan=keep_all(p)[0])
    assert info.status == "optimal" and plan.homes[1:3] == ("recompute", "recompute")


@pytest.mark.parametrize("field,value,message", [
    ("frozen_bottom_layers", -1, "'frozen_bottom_layers' must be a whole number of layers >= 0, got -1"),
    ("frozen_bottom_layers", 1.5, "'frozen_bottom_layers' must be a whole number of layers >= 0, got 1.5"),
    ("frozen_bottom_layers", True, "'frozen_bottom_layers' must be a whole number of layers >= 0, got True"),
])
def test_bad_frozen_bottoms_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        Budgets(**{field: value})


def test_a_frozen_bottom_above_the_model_and_costs_measured_without_a_backward_it_needs_are_refused():
    with pytest.raises(ValueError, match="'frozen_bottom_layers' is 5, but the model 'toy' has 4 layers"):
        frozen(toy_problem(4, 3.0), 5)
    c = MeasuredCosts(fwd_s=(1.0,) * 4, diff_s=(1.0, 1.0, 3.0, 3.0), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.0, 0.0, 0.1, 0.1), first_differentiated=2)
    p = toy_problem(4, 3.0)
    with pytest.raises(ValueError, match=r"the measured costs have no backward for layers 0..1 .* but this plan's "
                                         r"backward reaches layer 0: measure a run that trains as this one does"):
        dataclasses.replace(p, measured=c)
    assert dataclasses.replace(frozen(p, 3), measured=c).first_reached == 3   # measured lower than needed: fine
    with pytest.raises(MeasurementError, match=r"first_differentiated must be a layer in 0..4, got 5"):
        dataclasses.replace(c, first_differentiated=5)


def _timeline(spans):
    from lazytrain.trace import Timeline
    t = Timeline("measured")
    for lane, name, start, end in spans:
        t.add_relative(lane, name, start, end)
    return t


def _step(first: int, L: int = 3):
    """A traced step whose backward differentiates layers ``first``..L-1 (each layer 1 s forward, 3 s diff)."""
    spans, t = [], 0.0
    for i in range(L):
        spans.append(("compute", f"fwd L{i}", t, t + 1.0))
        t += 1.0
    t += 0.5
    for i in reversed(range(first, L)):
        spans += [("compute", f"diff L{i}", t, t + 2.0), ("compute", f"bwd L{i}", t + 2.0, t + 3.0)]
        t += 3.0
    spans.append(("optimizer", "gradient norm", t, t + 0.25))
    spans += [("optimizer", f"update L{i}", t + 0.25 + i, t + 0.5 + i) for i in range(L)]
    return _timeline(spans)


def test_costs_are_measured_from_steps_whose_backward_stops_above_layer_0():
    c = MeasuredCosts.from_traces([_step(2), _step(2)], 3)
    assert (c.first_differentiated, c.fwd_s, c.diff_s) == (2, (1.0, 1.0, 1.0), (1.0, 1.0, 3.0))
    assert MeasuredCosts.from_dict(c.to_dict()) == c
    assert MeasuredCosts.from_traces([_step(0)], 3).first_differentiated == 0
    assert MeasuredCosts.from_traces([_step(3)], 3).first_differentiated == 3   # the head alone trains
    with pytest.raises(MeasurementError, match=r"reached down to different layers \(\[1, 2\]\)"):
        MeasuredCosts.from_traces([_step(1), _step(2)], 3)
    gap = _step(0)
    gap.spans = [s for s in gap.spans if s.name not in ("diff L1", "bwd L1")]   # a hole in the backward
    with pytest.raises(MeasurementError, match=r"no 'diff' span for layer\(s\) \[1\]"):
        MeasuredCosts.from_traces([gap], 3)
    # selective times: measured on the layers the backward re-runs; a frozen one's are its forward's
    sel = with_selective(c, [_step(2)], kinds=["a"] * 3)
    assert (sel.selective_fwd_s, sel.selective_rerun_s) == ((1.0, 1.0, 1.0), (1.0, 1.0, 2.0))


def test_a_profile_plans_as_measured_and_lazytrain_plan_refuses_another_frozen_bottom(tmp_path, capsys):
    from lazytrain.cli import main
    from lazytrain.planner.measured import MachineProfile
    from lazytrain.planner.search import profile_problem
    c = MeasuredCosts.from_traces([_step(2)], 3)
    micro = lambda v: tuple(x * 1e-6 for x in v) if isinstance(v, tuple) else v * 1e-6   # noqa: E731 (a tiny model's)
    c = dataclasses.replace(c, **{k: micro(getattr(c, k)) for k in ("fwd_s", "diff_s", "nonlayer_s", "step_s",
                                                                     "update_s")})
    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    profile = MachineProfile(costs=c, links_gbps={"h2d_gbps": 1.0, "d2h_gbps": 1.0}, model=cfg, micro_batch=2,
                             seq_len=16, trainable_share=1 / 3, non_block_trainable_share=0.5)
    assert profile_problem(profile, Budgets.of(gpu="4GB", host="4GB")).first_reached == 2
    path = tmp_path / "profile.json"
    profile.to_json(str(path))
    assert main(["plan", "--profile", str(path), "--gpu-mem", "4GB", "--host-mem", "4GB", "--time-limit", "5"]) == 0
    assert main(["plan", "--profile", str(path), "--gpu-mem", "4GB", "--host-mem", "4GB",
                 "--frozen-bottom-layers", "1"]) == 2
    assert ("--frozen-bottom-layers 1: the profile's backwards differentiated from layer 2, and a profile is planned "
            "as it was measured") in capsys.readouterr().err
    # another share trained was planned on the measured update times of this one, without a word
    assert main(["plan", "--profile", str(path), "--gpu-mem", "4GB", "--host-mem", "4GB",
                 "--trainable-share", "0.01"]) == 2
    assert ("--trainable-share 0.01: the profile was measured with trainable_share 0.333333, and its backward and "
            "update times are that run's") in capsys.readouterr().err
    assert main(["plan", "--profile", str(path), "--gpu-mem", "4GB", "--host-mem", "4GB", "--time-limit", "5",
                 "--trainable-share", str(1 / 3), "--non-block-trainable-share", "0.5"]) == 0   # the same shares


# ---- the engine ----------------------------------------------------------------------------------------------
LINKS = {"h2d": {"gbps": 0.05}, "d2h": {"gbps": 0.05}}


def _frozen_llama(below: int, embedding: bool = False):
    model = make_model("llama")
    for name, p in model.named_parameters():
        if ("embed" in name and not embedding) or any(f"layers.{i}." in name for i in range(below)):
            p.requires_grad_(False)
    return model


def _train(lt: dict, model, steps: int = 12):
    """``lt`` over the CPU with emulated links (``"device": "cuda"``: the GPU's own links)."""
    testing = {} if lt.get("device") == "cuda" else {"testing": {"copy_threads": True, "links": LINKS}}
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"device": "cpu", "milp_time_limit": 5, **lt, **testing}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                              if p.requires_grad], config=cfg)
        plans = []
        for x, y in batches(steps):
            plans.append(engine.plan.policy)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    return engine, plans, [str(w.message) for w in caught]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"), id="on_a_gpu")])
def test_policy_auto_measures_a_frozen_bottom_run_and_trains_it_as_a_fixed_plan(device):
    """Blocks 0-2 and the embedding frozen: the backward reaches block 3 down. Auto used to find no 'diff' span
    for blocks 0-2 and keep its calibration plan; it now plans, keeping no boundary of the frozen bottom but
    boundary 0, and trains bit for bit as a fixed plan. On CUDA from stream-event traces, with the selective
    calibration (every layer selective; blocks 0-2 are never re-run)."""
    selective = device == "cuda"
    auto = {"warmup_steps": 3, "profile_steps": 2, "check_every": 4, "selective": selective, "max_replans": 0}
    try:
        engine, plans, said = _train({"policy": "auto", "auto": auto, "device": device}, _frozen_llama(3))
        calibration = ["auto-calibration"] * 5 + (["auto-calibration-selective"] * 3 if selective else [])
        assert plans == calibration + ["auto-milp"] * (12 - len(calibration)), said
        assert engine.auto.last_profile.costs.first_differentiated == 3
        assert not [m for m in said if "span" in m or "auto" in m], said
        assert engine.plan.homes[1:3] == ("recompute", "recompute") and engine.plan.homes[3] != "recompute"
        record = engine.auto.history[0]
        assert record.predicted_step_s == engine.plan.prediction["step_time_s"] > 0 and record.measured_step_s > 0
        weights = engine.module_state_dict()
        engine.destroy()
        streams.configure()
        engine, _, _ = _train({"policy": "keep_all", "boundary_home": "host", "overlap_optimizer": True,
                               "device": device}, _frozen_llama(3))
        for k, v in engine.module_state_dict().items():
            assert torch.equal(weights[k], v), k
        engine.destroy()
    finally:
        streams.configure()


def test_the_first_plan_counts_the_frozen_bottom_from_what_trains_before_the_blocks():
    from lazytrain.engine.engine import _frozen_bottom_blocks
    model = _frozen_llama(3)
    assert _frozen_bottom_blocks(model, model.model.layers) == 3
    model = _frozen_llama(3, embedding=True)   # the embedding trains: its gradient flows through every block
    assert _frozen_bottom_blocks(model, model.model.layers) == 0
    model = _frozen_llama(3)
    model.enable_input_require_grads()         # PEFT's way to checkpoint a frozen model: the same
    assert _frozen_bottom_blocks(model, model.model.layers) == 0
    model.disable_input_require_grads()        # the hook removed (the attribute stays)
    assert _frozen_bottom_blocks(model, model.model.layers) == 3
    model.model.norm.weight.requires_grad_(True)   # a final norm and an untied head train after the blocks
    assert model.lm_head.weight.requires_grad and _frozen_bottom_blocks(model, model.model.layers) == 3
    model.prompt = torch.nn.Embedding(4, 32)   # a trainable module beside the model (a prompt encoder): may run first
    assert _frozen_bottom_blocks(model, model.model.layers) == 0
    model = _frozen_llama(3)                   # any forward hook on the input embeddings (one left registered twice
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: o)   # by transformers, NEFTune's): none
    assert _frozen_bottom_blocks(model, model.model.layers) == 0
    model = _frozen_llama(0)
    assert _frozen_bottom_blocks(model, model.model.layers) == 0


def test_a_frozen_bottom_plan_trains_right_where_the_blocks_input_needs_its_gradient_after_all(tmp_path):
    """The first plan's count is an estimate: where the embedding trains after all, the plan's one segment
    [0, 3) is re-run from boundary 0 for blocks 2..0, and the training matches plain PyTorch (the parity
    tests' tolerance on the CPU)."""
    plan = Plan(num_layers=6, homes=("hbm", "recompute", "recompute", "host", "hbm", "hbm", "hbm"), policy="frozen-3")
    data = batches(3)
    reference = reference_train(_frozen_llama(3, embedding=True), data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = plan_engine(tmp_path, _frozen_llama(3, embedding=True), plan)
        module = engine.module
        recomputed = []
        for x, y in data:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            recomputed.append(engine.executor.recomputed_layer_forwards)
    try:
        assert recomputed[0] == 2                  # blocks 0 and 1 re-run before block 2's backward
        assert max_rel_diff(module, reference) < 1e-5     # measured 3.5e-6
    finally:
        engine.destroy()


@pytest.mark.parametrize("f", [0, 2, 5])
def test_the_step_floor_counts_no_backward_below_the_frozen_bottom_and_stays_below_the_milps_plan(f):
    from lazytrain.planner.ceiling import step_floor
    p = frozen(toy_problem(5, 3.0, host_slots=3), f)
    floor = step_floor(p, offload=True)
    plan, _ = build_and_solve(p, full_space(5, False, offload=True))
    assert floor.step_s <= simulate(p, plan).step_time_s
    assert floor.backward_s >= sum(p.bwd_s(i) for i in range(f, 5)) - 1e-12
    if f:   # below the unfrozen floor: nothing of the frozen layers' backward is in it
        assert floor.step_s < step_floor(frozen(p, 0), offload=True).step_s


def test_lazytrain_plan_plans_a_frozen_bottom_and_refuses_one_beyond_the_model(tmp_path, capsys):
    from lazytrain.cli import main
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "8", "--seq", "1024",
            "--time-limit", "5", "--json", str(out)]
    assert main(args + ["--frozen-bottom-layers", "30"]) == 0
    plan = Plan.from_json(str(out))
    assert plan.homes[1:30] == ("recompute",) * 29 and plan.homes[0] != "recompute"
    capsys.readouterr()
    assert main(args + ["--frozen-bottom-layers", "37"]) == 2
    assert "'frozen_bottom_layers' is 37, but the model 'qwen2.5-3b' has 36 layers" in capsys.readouterr().err


@pytest.mark.parametrize("count,embedding,said", [
    (1, False, "lazytrain: plan 'milp' was made for a backward that stops at block 1, but this training forward's "
               "backward stops at block 3 (the blocks below it are frozen and nothing run before them trains): the plan counted a "
               "backward for blocks 1-2, which runs none. Set 'lazytrain.frozen_bottom_layers' to 3, or use policy "
               "\"auto\", which measures where the backward stops"),
    (3, True, "lazytrain: plan 'milp' was made for a backward that stops at block 3, but this training forward's "
              "backward goes down to block 0: the plan re-runs blocks 0-2 from the kept boundary below them, so its steps take longer and "
              "hold more device memory than it predicted. Set 'lazytrain.frozen_bottom_layers' to 0, or use policy "
              "\"auto\", which measures where the backward stops"),
    ("auto", False, None),    # counted right: blocks 0-2 frozen with the embedding
    ("auto", True, None),     # the embedding trains: none counted, and the backward reaches block 0
])
def test_a_plan_that_counted_the_frozen_bottom_otherwise_than_the_backward_ran_says_so_once(count, embedding, said):
    lt = {"policy": "milp", "hardware": "h200", "seq_len": 12, "capacities": {"hbm": "2GB"},
          "frozen_bottom_layers": count}
    engine, _, messages = _train(lt, _frozen_llama(3, embedding=embedding), steps=3)
    try:
        planned = [m for m in messages if "was made for a backward" in m]
        assert planned == ([said] if said else [])
        assert engine.plan.prediction["frozen_bottom_layers"] == (count if isinstance(count, int) else
                                                                  0 if embedding else 3)
    finally:
        engine.destroy()


@pytest.mark.parametrize("value,message", [
    (-1, "config key 'lazytrain.frozen_bottom_layers' must be \"auto\" or a whole number of blocks >= 0 (the blocks "
         "below the first that trains, with nothing run before them training), got -1"),
    ("3", "config key 'lazytrain.frozen_bottom_layers' must be \"auto\" or a whole number of blocks >= 0"),
    (7, "config key 'lazytrain.frozen_bottom_layers' is 7, but the model has 6 blocks"),
    ({"policy": "auto", "frozen_bottom_layers": 3}, "config key 'lazytrain.frozen_bottom_layers' is for policy "
     "\"milp\", which plans at start-up; policy \"auto\" measures where the backward stops, and a Plan file is made "
     "for it with `lazytrain plan --frozen-bottom-layers` (policy is 'auto')"),
])
def test_bad_frozen_bottom_counts_in_the_config_are_named(value, message):
    from lazytrain.config import ConfigError
    lt = value if isinstance(value, dict) else {"policy": "milp", "hardware": "h200", "seq_len": 12,
                                                "frozen_bottom_layers": value}
    with pytest.raises(ConfigError, match=re.escape(message)):
        _train(lt, _frozen_llama(3), steps=0)


def test_a_plan_counting_too_many_frozen_blocks_is_said_at_the_first_training_forward_before_its_backward():
    """The backward of a plan that counted blocks 0-2 as never reached re-runs them from boundary 0 with more
    device memory than planned: said when the forward ends, before a backward that may not fit."""
    lt = {"policy": "milp", "hardware": "h200", "seq_len": 12, "capacities": {"hbm": "2GB"}, "frozen_bottom_layers": 3}
    engine, _, _ = _train(lt, _frozen_llama(3, embedding=True), steps=0)
    try:
        (x, y), second = batches(2)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:   # an evaluation: nothing said
            warnings.simplefilter("always")
            engine(x)
        assert not [w for w in caught if "was made for a backward" in str(w.message)]
        with pytest.warns(UserWarning, match="this training forward's backward goes down to block 0") as said:
            loss = lm_loss(engine(x), y)
        assert said[0].filename == __file__   # said where the script called the engine
        engine.backward(loss)
        engine.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # once a plan
            engine.backward(lm_loss(engine(second[0]), second[1]))
    finally:
        engine.destroy()


@pytest.mark.parametrize("below", [3, 6])
def test_auto_measures_selective_layers_only_where_the_backward_reaches(below, monkeypatch, capsys):
    """Blocks below the first differentiated one are never re-run: the selective calibration chooses among the
    others (it used to spread its picks over all six and, with room for one, pick a frozen block and stop auto).
    With every block frozen there is nothing to measure, and nothing is said."""
    from lazytrain.planner import measured
    offered = []

    def room_for_one(kept, kinds, room):
        offered.append(len(kept))
        return (len(kept) // 2,), "room for one"
    monkeypatch.setattr(measured, "layers_to_measure_selective", room_for_one)
    auto = {"warmup_steps": 3, "profile_steps": 2, "check_every": 4, "selective": True, "max_replans": 0}
    engine, plans, said = _train({"policy": "auto", "auto": auto, "capacities": {"hbm": 10**9}},
                                 _frozen_llama(below))
    try:
        assert not [m for m in said if "auto" in m], said
        if below == 3:
            assert offered == [3]
            assert "auto measures selective layers on 1 of 6 layers ([4])" in capsys.readouterr().out
            assert plans == ["auto-calibration"] * 5 + ["auto-calibration-selective"] * 3 + ["auto-milp"] * 4
            assert engine.auto.last_profile.costs.selective_rerun_s[4] > 0
        else:
            assert offered == [] and plans == ["auto-calibration"] * 5 + ["auto-milp"] * 7
            assert engine.auto.last_profile.costs.selective_rerun_s is None
    finally:
        engine.destroy()
        streams.configure()


def test_with_no_block_differentiated_a_forward_beyond_the_steps_micro_batches_is_told_apart():
    """Every block frozen (the head alone trains): no pass has a backward span, so an evaluation's forward under
    grad cannot be told by a pass without one; it is one forward more than the step's micro-batches."""
    from lazytrain.planner.measured import ran_an_undifferentiated_forward
    from lazytrain.trace import Timeline

    def step(passes: int) -> Timeline:
        t, at = Timeline("measured"), 0.0
        for k in range(passes):
            for i in range(3):
                t.add_relative("compute", f"fwd L{i}", at, at + 1.0, **{"pass": k})
                at += 1.0
        t.add_relative("optimizer", "gradient norm", at, at + 0.25)
        for i in range(3):
            t.add_relative("optimizer", f"update L{i}", at + 0.25, at + 0.5)
        return t
    assert not ran_an_undifferentiated_forward(step(2), micro_batches=2)
    assert ran_an_undifferentiated_forward(step(3), micro_batches=2)
    assert MeasuredCosts.from_traces([step(2)], 3, micro_batches=2).first_differentiated == 3
    with pytest.raises(MeasurementError, match="ran a forward that was never differentiated"):
        MeasuredCosts.from_traces([step(3)], 3, micro_batches=2)


def test_megatrains_replay_trains_every_layer_below_a_frozen_bottom_and_a_frozen_bottom_freezes_the_embedding():
    from lazytrain.planner.models import ModelShape
    from lazytrain.planner import megatrain
    from lazytrain.planner.policies import simulate_megatrain
    p = toy_problem(6, 3.0, host_slots=6)
    # MegaTrain has no frozen training: it differentiates layers 0 and 1 too, and copies layer 0's gradients last
    mt = simulate_megatrain(frozen(p, 2), timeline=True)
    assert [e.nbytes for e in mt.timeline if e.label == "grads L0 + embedding"] == [megatrain.tail_bytes(p)]
    assert {e.label for e in mt.timeline if e.lane == "compute" and e.window >= 6} >= {"diff L0", "diff L1"}
    # an untied embedding and head: with a frozen bottom only the head (and final norm) can train
    shape = ModelShape.from_layers("m", [1000] * 4, hidden=8, vocab_size=100, tied_embeddings=False)
    q = Problem(shape, TOY_HW, Budgets(gpu_bytes=10**9, host_bytes=10**9, gpu_reserved_bytes=0, frozen_bottom_layers=2), 1, 4)
    assert shape.nonlayer_params - 100 * 8 == 808 and q.nonlayer_trained == pytest.approx(808)
    assert q.embed_grad_bytes == 0 and q.head_grad_bytes == pytest.approx(808 * 2)


def test_a_plan_file_counted_otherwise_is_told_to_be_made_again_and_a_module_forward_is_checked_at_its_backward(
        tmp_path):
    """A Plan file records the count it was made for: the advice is to make it again (the config key is policy
    milp's). A forward through engine.module (not the engine) is checked as its backward starts. A count that is
    no number in a hand-edited file is not checked."""
    plan = Plan(num_layers=6, homes=("hbm",) * 7, policy="from-file", prediction={"frozen_bottom_layers": 0})
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    engine, _, _ = _train({"policy": "plan", "plan": str(path)}, _frozen_llama(3), steps=0)
    try:
        (x, y), = batches(1)
        loss = lm_loss(engine.module(x), y)
        with pytest.warns(UserWarning, match=re.escape(
                "backward stops at block 3 (the blocks below it are frozen and nothing run before them trains): the "
                "plan counted a backward for blocks 0-2, which runs none. Make the plan again with `lazytrain plan "
                "--frozen-bottom-layers 3`")):
            engine.backward(loss)
    finally:
        engine.destroy()
    plan.to_json(str(path))
    with open(path) as f:
        text = f.read().replace('"frozen_bottom_layers": 0', '"frozen_bottom_layers": "three"')
    with open(path, "w") as f:
        f.write(text)
    engine, _, said = _train({"policy": "plan", "plan": str(path)}, _frozen_llama(3), steps=1)
    engine.destroy()
    assert not [m for m in said if "was made for a backward" in m]


def test_a_start_plan_keeping_boundaries_where_every_block_is_frozen_is_not_used():
    from lazytrain.planner.milp import MilpOptions, _start_values
    import lazytrain.planner.milp as milp
    p = frozen(toy_problem(4, 3.0, host_slots=4), 4)
    captured = []
    original = milp._start_values
    milp._start_values = lambda plan, *args: captured.append(original(plan, *args)) or captured[-1]
    try:
        build_and_solve(p, MilpOptions(split_internals=False), start_plan=Plan(num_layers=4, homes=("hbm",) + ("host",) * 3
                                                                               + ("hbm",), policy="keeps"))
        build_and_solve(p, MilpOptions(split_internals=False), start_plan=keep_all(p)[0])
    finally:
        milp._start_values = original
    assert captured[0] is None and captured[1] is not None
    assert _start_values is original


def test_a_frozen_bottom_trains_none_of_its_parameters_and_its_forward_alone_counts_in_the_tflops():
    """Budgets say every layer trains (lazytrain plan's default), but a frozen bottom's cannot: the host holds
    no fp32 master, gradient or moments for them. The convention's 6 FLOPs per parameter and token count 2 for
    them, their forward alone."""
    p0, p = toy_problem(4, 3.0, host_slots=4), frozen(toy_problem(4, 3.0, host_slots=4), 2)
    params = [l.params for l in p.model.layers]
    assert p.layer_trainable_share == pytest.approx(sum(params[2:]) / sum(params))
    db = p.model.dtype_bytes
    assert p0.host_static - p.host_static == pytest.approx(sum(params[:2]) * (p0.host_bytes_per_param - db), abs=1)
    plan = keep_all(p)[0]
    r = simulate(p, plan)
    tokens = p.micro_batch * p.seq_len
    assert r.tflops == pytest.approx((6 * p.model.throughput_params - 4 * sum(params[:2])) * tokens / r.step_time_s / 1e12)


def test_where_only_a_segment_across_the_frozen_bottom_fits_the_planner_returns_it():
    """The MILP keeps boundary f apart from a segment [0, f); a plan re-running the frozen layer 0 in a segment
    [0, 3) holds one boundary less. At a budget between the two, planning said no plan fits."""
    from lazytrain.planner.hardware import load_profile
    from lazytrain.planner.milp import MilpOptions
    from lazytrain.planner.models import load_model
    from lazytrain.planner.problem import InfeasibleBudgetError
    from lazytrain.planner.search import solve
    cfg = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 1376, "vocab_size": 32000, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    p = Problem(model=load_model(cfg), hardware=load_profile("h800"), micro_batch=2, seq_len=256,
                budgets=Budgets(gpu_bytes=1321575255, host_bytes=436461252, frozen_bottom_layers=1))
    opts = MilpOptions(time_limit_s=10, isolate=False)
    with pytest.raises(InfeasibleBudgetError, match="no plan fits the budgets"):
        build_and_solve(p, opts)
    with pytest.warns(UserWarning, match=re.escape(
            "the MILP found no plan that fits within its plan space (below the frozen bottom, one segment [0, 1) "
            "kept apart); using the fastest baseline policy that fits, 'interval-k3-hbm'")):
        plan = solve(p, opts)
    assert plan.segments() == [(0, 3), (3, 4)] and plan.prediction["fallback"] == "interval-k3-hbm"
    r = simulate(p, plan, strict=True, timeline=False)
    assert not r.violations and r.peak_bytes["hbm"] <= p.gpu_budget
    assert plan.prediction["step_time_s"] == r.step_time_s
