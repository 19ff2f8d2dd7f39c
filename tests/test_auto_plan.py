"""Policy "auto": the engine measures the model on this machine (emulated links on the CPU), plans from
the measurements, puts the plan in place between steps without changing a bit of the training, and plans
again when the measured step drifts from the prediction; the profile it saves plans the same again at
start-up and in `lazytrain plan --profile`."""
import dataclasses
import json
import os
import platform
import re
import statistics
import types
import warnings

import pytest
import torch

import lazytrain
from lazytrain.cli import main
from lazytrain.config import ConfigError
from lazytrain.planner.hardware import CATALOG
from lazytrain.planner.measured import MachineProfile, MeasurementError
from lazytrain.planner.plan import Plan
from lazytrain.planner.search import plan_from_profile
from lazytrain.tiers import streams
from lazytrain.tiers.base import TierBudgetError
from dist_helpers import free_port, join_as, leave_group, spawn
from engine_models import batches, lm_loss, make_model

LINKS = {"h2d": {"gbps": 0.05}, "d2h": {"gbps": 0.05}}
# a device-to-host link that copies a layer's gradients within its backward: the sink holds one layer's at a
# time, where LINKS' fills its queue and the planner counts four (planner Problem.grads_in_flight)
FAST_D2H = {"h2d": {"gbps": 0.05}, "d2h": {"gbps": 5.0}}
STEPS = 12                    # 3 warm-up, 2 measured, then 7 on the plan: one check of 4


def _d2h_measured_as_emulated(monkeypatch) -> None:
    """The device-to-host link reads as the emulated FAST_D2H, whatever the copy threads measured: on a busy
    machine a preempted copy thread measures the link slower than a layer's backward, and the planner then
    counts more layers' gradients in flight (the budget below fits one; seen under a loaded CI)."""
    from lazytrain.planner import measured
    original = measured.link_bandwidths
    monkeypatch.setattr(measured, "link_bandwidths",
                        lambda traces: {**original(traces), "d2h_gbps": FAST_D2H["d2h"]["gbps"]})
AUTO = {"warmup_steps": 3, "profile_steps": 2, "check_every": 4, "selective": False}


@pytest.fixture(autouse=True)
def _calm_transfers_after():
    yield
    streams.configure()


def _config(lt: dict, micro_batch: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 10**9, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "lazytrain": {"device": "cpu", "milp_time_limit": 5, **lt,
                          "testing": {"copy_threads": True, "links": LINKS}}}


def _train(lt: dict, steps: int = STEPS, accumulation: int = 1, links: "bool | dict" = True, spoil=None, evaluate=(),
           quiet: bool = True, evaluate_grad: bool = True):
    """``links``: False for none emulated, a dict for other emulated links than LINKS; ``spoil``: micro-batch
    whose loss is made NaN (its step is skipped); ``evaluate``: micro-batches before which an evaluation
    forward runs (under grad unless ``evaluate_grad`` is False), its output kept until the end."""
    cfg = _config(lt)
    cfg["train_batch_size"] = 2 * accumulation
    if not links:
        del cfg["lazytrain"]["testing"]
    elif isinstance(links, dict):
        cfg["lazytrain"]["testing"]["links"] = links
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if quiet else "default")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
        plans, kept = [], []   # the plan each micro-batch ran on
        data = batches(steps * accumulation)
        for i, (x, y) in enumerate(data):
            if i in evaluate:
                with torch.set_grad_enabled(evaluate_grad):
                    kept.append(engine(data[0][0]))   # never differentiated
            plans.append(engine.plan.policy)
            loss = lm_loss(engine(x), y)
            engine.backward(loss * float("nan") if i == spoil else loss)
            engine.step()
    return engine, plans


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One run of policy "auto" that saves its profile, and the same training on a fixed keep-all plan."""
    path = str(tmp_path_factory.mktemp("auto") / "profile.json")
    # no plan again on drift: this machine's timings are noisy, and the plans must be known here
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "max_replans": 0, "profile_path": path}})
    auto = {"weights": engine.module_state_dict(), "plans": plans, "history": engine.auto.history,
            "plan": engine.plan}
    engine.destroy()
    engine, _ = _train({"policy": "keep_all", "boundary_home": "host", "overlap_optimizer": True})
    fixed = engine.module_state_dict()
    engine.destroy()
    return auto, fixed, path


def test_auto_measures_then_runs_the_milps_plan_from_the_next_step(measured):
    auto, _, _ = measured
    assert auto["plans"] == ["auto-calibration"] * 5 + ["auto-milp"] * (STEPS - 5)
    first = auto["history"][0]
    assert (first.step, first.policy, first.reason) == (5, "auto-milp", "measured")
    assert first.predicted_step_s == auto["plan"].prediction["step_time_s"] > 0
    assert first.measured_steps == 4 and first.measured_step_s > 0   # the check after 4 steps on the plan


def test_switching_plans_changes_nothing_of_the_training(measured):
    auto, fixed, _ = measured
    for k, v in fixed.items():
        assert torch.equal(auto["weights"][k], v), k


def test_selective_layers_are_measured_on_the_calibration_plan_with_every_layer_selective():
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "selective": True, "max_replans": 0}}, steps=10)
    auto, profile, history = engine.module_state_dict(), engine.auto.last_profile, engine.auto.history
    engine.destroy()
    # 3 warm-up and 2 measured steps, then 1 warm-up and 2 measured with every layer selective
    assert plans == ["auto-calibration"] * 5 + ["auto-calibration-selective"] * 3 + ["auto-milp"] * 2
    assert history[0].step == 8
    assert len(profile.costs.selective_fwd_s) == len(profile.costs.selective_rerun_s) == 6
    assert all(t > 0 for t in profile.costs.selective_fwd_s + profile.costs.selective_rerun_s)
    engine, _ = _train({"policy": "keep_all", "boundary_home": "host", "overlap_optimizer": True}, steps=10)
    fixed = engine.module_state_dict()
    engine.destroy()
    for k, v in fixed.items():   # selective or not, one training
        assert torch.equal(auto[k], v), k


def test_where_not_every_layers_kept_outputs_fit_some_are_measured_and_the_others_take_their_kinds_times(
        capsys, monkeypatch):
    """The plain calibration peaks at 74,240 bytes on the device; every layer's kept outputs would add
    6 layers x 288 elements per token x 24 tokens x 4 bytes = 165,888 bytes: over a 238,000-byte budget (the
    planner needs 236,352 bytes for one layer's backward, what its graph saves measured), where 5 layers'
    (138,240 bytes) fit. The device-to-host link copies a layer's gradients faster than its backward, so the
    planner counts one layer's in flight beside it (FAST_D2H)."""
    lt = {"policy": "auto", "auto": {**AUTO, "selective": True, "max_replans": 0}, "capacities": {"hbm": 238_000}}
    _d2h_measured_as_emulated(monkeypatch)
    engine, plans = _train(lt, steps=10, links=FAST_D2H)
    assert plans == ["auto-calibration"] * 5 + ["auto-calibration-selective"] * 3 + ["auto-milp"] * 2
    assert "[lazytrain] auto measures selective layers on 5 of 6 layers ([0, 1, 2, 4, 5]), the others taking " \
           "their kind's times: every layer's kept matmul and attention outputs (about 0.2 MB) do not fit on the " \
           "device tier beside the calibration plan's peak (0.2 MB free)" in capsys.readouterr().out
    c = engine.auto.last_profile.costs
    engine.destroy()
    measured = (0, 1, 2, 4, 5)
    for times in (c.selective_fwd_s, c.selective_rerun_s):   # layer 3: its forward times its kind's ratio
        assert times[3] == c.fwd_s[3] * statistics.median(times[i] / c.fwd_s[i] for i in measured)
        assert all(t > 0 for t in times)


def test_the_selective_calibration_leaves_a_margin_for_what_the_planners_count_of_kept_outputs_leaves_out(
        capsys, monkeypatch):
    """Six layers' kept outputs as the planner counts them (165,888 bytes) fit beside the plain calibration's
    peak (74,240) in 241,000 bytes, but each layer really keeps 28,032 bytes (its attention's log-sum-exp
    beside the counted outputs): six would run over the budget in the selective calibration's forward
    (TierBudgetError in the training loop). With the margin five are measured and the run goes on."""
    lt = {"policy": "auto", "auto": {**AUTO, "selective": True, "max_replans": 0}, "capacities": {"hbm": 241_000}}
    _d2h_measured_as_emulated(monkeypatch)
    engine, plans = _train(lt, steps=10, links=FAST_D2H)
    assert plans == ["auto-calibration"] * 5 + ["auto-calibration-selective"] * 3 + ["auto-milp"] * 2
    assert "[lazytrain] auto measures selective layers on 5 of 6 layers ([0, 1, 2, 4, 5])" in capsys.readouterr().out
    assert engine.last_step_peak_bytes["hbm"] <= 241_000
    engine.destroy()


def test_a_batch_longer_than_the_selective_calibration_was_fitted_for_is_said_before_the_budget_overruns():
    """Without 'seq_len', the selective calibration fits its layers' kept outputs to the device at the longest
    length seen so far; a longer batch in it overran the device budget with a TierBudgetError naming only the
    capacity key. It is now said first, naming 'lazytrain.seq_len' as the fix."""
    lt = {"policy": "auto", "auto": {**AUTO, "warmup_steps": 1, "selective": True, "max_replans": 0},
          "capacities": {"hbm": 260_000}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=make_model("llama"), config=_config(lt))[0]
    for x, y in batches(3, seq=12):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert (engine.plan.policy, engine.plan.selective_layers) == ("auto-calibration-selective", (0, 1, 2, 3, 4, 5))
    (x, y), = batches(1, seq=16)
    with pytest.warns(UserWarning, match=re.escape(
            "lazytrain: policy \"auto\" measures selective layers [0, 1, 2, 3, 4, 5] with their outputs kept on "
            "the device, as many as it had room for at sequence length 12, and this batch's is 16: this step may "
            "overrun the device's memory; set 'lazytrain.seq_len' to the longest length trained, so that auto "
            "measures for it")), pytest.raises(TierBudgetError, match="'lazytrain.capacities.hbm'"):
        engine(x)
    engine.destroy()


def test_a_gpu_without_a_device_budget_gives_kept_outputs_the_room_it_had_left(monkeypatch):
    """Without 'capacities.hbm', the CPU measures every layer selective (the kept outputs stay in host
    memory); a GPU has the room its memory leaves beside torch's peak allocation and the planner's reserve
    for the CUDA context (CUDA stood in for here), and measures as many layers as fit in it."""
    import lazytrain.engine.engine as engine_module
    engine, _ = _train({"policy": "auto", "auto": {**AUTO, "max_replans": 0}}, steps=2)
    assert engine._selective_layers_to_measure() == (None, None)
    per_layer = 288 * 24 * 4 + (288 * 24 * 4) // engine_module.SELECTIVE_MARGIN   # as the test above counts them
    peak = 5_000_000

    class Properties:
        total_memory = engine_module.GPU_RESERVED_BYTES + peak + 3 * per_layer + 10
    class OnAGpu:   # the engine's state as it would be on a GPU
        tiers, _seq_len, _model_cfg = engine.tiers, engine._seq_len, engine._model_cfg
        weights, executor = engine.weights, engine.executor   # its blocks, and where its backward stops
        last_step_peak_bytes, train_micro_batch_size_per_gpu = engine.last_step_peak_bytes, engine.train_micro_batch_size_per_gpu
        device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak)
    Engine = engine_module.LazyTrainEngine
    layers, why = Engine._selective_layers_fitting(OnAGpu(), Engine._device_room(OnAGpu()))
    assert len(layers) == 3 and "do not fit" in why
    engine.destroy()


def test_where_no_layer_of_some_kind_can_be_measured_selective_auto_plans_without_selective_layers(monkeypatch):
    from lazytrain.engine.engine import LazyTrainEngine
    monkeypatch.setattr(LazyTrainEngine, "_selective_layers_to_measure", lambda self: ((), "no room"))
    lt = {"policy": "auto", "auto": {**AUTO, "selective": True, "max_replans": 0}}
    with pytest.warns(UserWarning, match=r"lazytrain: policy \"auto\" does not measure selective layers, so its plan "
                                         r"has none: no room, not even one layer of each kind"):
        engine, plans = _train(lt, steps=7, quiet=False)
    assert plans == ["auto-calibration"] * 5 + ["auto-milp"] * 2
    assert engine.auto.last_profile.costs.selective_rerun_s is None and not engine.plan.selective_layers
    engine.destroy()


def test_with_gradient_accumulation_the_plan_changes_on_an_optimizer_step_and_trains_as_a_fixed_one():
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "max_replans": 0}}, steps=7, accumulation=2)
    auto, history = engine.module_state_dict(), engine.auto.history
    engine.destroy()
    assert plans == ["auto-calibration"] * 10 + ["auto-milp"] * 4 and history[0].step == 5
    engine, _ = _train({"policy": "keep_all", "boundary_home": "host", "overlap_optimizer": True}, steps=7,
                       accumulation=2)
    fixed = engine.module_state_dict()
    engine.destroy()
    for k, v in fixed.items():
        assert torch.equal(auto[k], v), k


def test_the_saved_profile_holds_what_was_measured(measured):
    _, _, path = measured
    profile = MachineProfile.from_json(path)
    assert (profile.micro_batch, profile.seq_len, profile.costs.num_layers) == (2, 12, 6)
    assert profile.model["num_hidden_layers"] == 6 and len(profile.model["layer_params"]) == 6
    assert set(profile.links_gbps) == {"h2d_gbps", "d2h_gbps"}
    assert all(0 < v <= 0.05 for v in profile.links_gbps.values())   # the emulated links, at most
    assert all(t > 0 for t in profile.costs.fwd_s + profile.costs.diff_s + profile.costs.update_s)


def test_a_saved_profile_plans_at_start_up_as_lazytrain_plan_does(measured, tmp_path, capsys):
    _, _, path = measured
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "profile": path}}, steps=1)
    assert plans == ["auto-milp"] and engine.auto.history[0].step == 0   # planned before the first step
    started = engine.plan
    engine.destroy()
    offline = plan_from_profile(MachineProfile.from_json(path), {"loss_chunk_tokens": 24}, time_limit_s=5)
    assert (started.homes, started.last_segment_graph) == (offline.homes, offline.last_segment_graph)
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", path, "--time-limit", "5", "--json", str(out)]) == 2   # no memory sizes
    assert ("--profile holds the measured times, not the machine's memory sizes: give --gpu-mem and --host-mem"
            in capsys.readouterr().err)
    assert main(["plan", "--profile", path, "--gpu-mem", "64GiB", "--host-mem", "64GiB", "--time-limit", "5", "--json", str(out)]) == 0
    assert "lazytrain (milp)" in capsys.readouterr().out
    assert Plan.from_json(str(out)).homes == offline.homes
    measured_at = MachineProfile.from_json(path)
    assert measured_at.seq_len != 1024   # an explicit --seq 1024 (the default without a profile) is still checked
    assert main(["plan", "--profile", path, "--seq", "1024"]) == 2
    assert f"--profile was measured at sequence length {measured_at.seq_len}, not 1024" in capsys.readouterr().err
    assert main(["plan", "--profile", path, "--micro-batch", "abc"]) == 2
    assert "--micro-batch must be a whole number or 'auto', got 'abc'" in capsys.readouterr().err
    # --base without --hardware: the catalog entry supplies what was not measured (it was ignored)
    assert main(["plan", "--profile", path, "--gpu-mem", "64GiB", "--host-mem", "64GiB", "--time-limit", "5"]) == 0
    assert f" on {measured_at.device} (measured): micro-batch " in capsys.readouterr().out
    odd = str(2 * measured_at.micro_batch + 1)
    assert main(["plan", "--profile", path, "--base", "h200", "--global-batch", odd]) == 2
    assert capsys.readouterr().err == (f"lazytrain plan: --global-batch {2 * measured_at.micro_batch + 1}: the "
                                       f"profile's micro-batch {measured_at.micro_batch} does not divide it\n")
    assert main(["plan", "--profile", path, "--base", "h200", "--time-limit", "5"]) == 0
    assert " on h200: micro-batch " in capsys.readouterr().out
    assert main(["plan", "--profile", path, "--base", "no-such-card"]) == 2
    assert "unknown hardware 'no-such-card'" in capsys.readouterr().err



def test_a_profile_records_how_the_head_computed_its_logits_and_lazytrain_plan_counts_them_so(measured, tmp_path,
                                                                                                 capsys):
    """`lazytrain plan --profile` counted the head's logits in 2048-token pieces whatever the run measured did
    (the engine computes them whole unless 'lazytrain.loss_chunk_tokens' is set): the same profile planned
    differently offline than in the engine. The profile now says, and --loss-chunk-tokens overrides it."""
    _, _, path = measured
    d = json.loads(open(path).read())
    assert d["loss_chunk_tokens"] == 24   # micro-batch 2 x 12 tokens, whole
    assert MachineProfile.from_dict({k: v for k, v in d.items() if k != "loss_chunk_tokens"}).loss_chunk_tokens is None
    for bad in (0, 2.5, True, "24"):
        with pytest.raises(MeasurementError, match=re.escape(f"profile: loss_chunk_tokens must be an integer >= 1 or "
                                                             f"null, got {bad!r}")):
            MachineProfile.from_dict({**d, "loss_chunk_tokens": bad})
    counted = {}
    for flags in ([], ["--loss-chunk-tokens", "3"], ["--loss-chunk-tokens", "0"]):
        out = tmp_path / "plan.json"
        assert main(["plan", "--profile", path, "--gpu-mem", "64GiB", "--host-mem", "64GiB", "--time-limit", "5",
                     "--json", str(out), *flags]) == 0
        capsys.readouterr()
        prediction = Plan.from_json(str(out)).prediction
        counted[tuple(flags)] = prediction["loss_chunk_tokens"]   # what the planner counted (Budgets)
    assert counted == {(): 24, ("--loss-chunk-tokens", "3"): 3, ("--loss-chunk-tokens", "0"): 24}
    with pytest.raises(SystemExit):
        main(["plan", "--profile", path, "--loss-chunk-tokens", "-1"])
    assert "argument --loss-chunk-tokens: must be a whole number >= 0, got '-1'" in capsys.readouterr().err


def test_lazytrain_plan_plans_a_profile_of_nvme_weights_on_the_cpu_as_the_engine_did(measured, tmp_path, capsys):
    """`lazytrain plan --profile` planned another problem than the engine from the same profile: without the NVMe
    weight reads (weights_home was not recorded), with selective layers on an assumed re-run cost (the engine
    plans them on measured ones only), and holding back a CUDA reserve of 1 GiB for a profile measured on the CPU
    (the budget the engine planned with was refused)."""
    _, _, path = measured
    d = json.loads(open(path).read())
    assert (d["weights_in_host"], d["non_block_state"]) == (True, "host")
    for bad in ("yes", 1):
        with pytest.raises(MeasurementError, match=re.escape(f"profile: weights_in_host must be true or false or "
                                                             f"null, got {bad!r}")):
            MachineProfile.from_dict({**d, "weights_in_host": bad})
    # fixed times and links (this machine's are noisy), and the weights on NVMe
    d["costs"].update(fwd_s=[0.0026, 0.0024, 0.0042, 0.0034, 0.0039, 0.0018], nonlayer_s=0.043, step_s=0.001,
                      diff_s=[0.0081, 0.0085, 0.0087, 0.0081, 0.0086, 0.0083],
                      update_s=[0.0166, 0.0165, 0.017, 0.0175, 0.0165, 0.0165])
    d["links_gbps"] = {"h2d_gbps": 0.008, "d2h_gbps": 0.03, "nvme_read_gbps": 0.003, "nvme_write_gbps": 0.003}
    d["weights_in_host"] = False
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(d))
    (tmp_path / "nvme").mkdir()
    engine, plans = _train({"policy": "auto", "weights_home": "nvme", "nvme_path": str(tmp_path / "nvme"),
                            "gpu_memory": 400_000, "auto": {**AUTO, "profile": str(fixed)}}, steps=1)
    started = engine.plan
    engine.destroy()
    assert plans == ["auto-milp"] and started.prediction["exposed_s"]["nvme_read"] > 0
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(fixed), "--gpu-mem", "400000", "--host-mem", "64GiB", "--no-resident",
                 "--time-limit", "5", "--json", str(out)]) == 0
    capsys.readouterr()
    offline = Plan.from_json(str(out))
    assert (offline.homes, offline.offloaded_layers, offline.selective_layers) == \
        (started.homes, started.offloaded_layers, started.selective_layers)
    assert offline.prediction["step_time_s"] == pytest.approx(started.prediction["step_time_s"], rel=1e-9)
    from lazytrain.planner.milp import MilpOptions   # and the Python API, as the command line
    api = plan_from_profile(MachineProfile.from_json(str(fixed)), {"gpu": 400_000, "host": 64 << 30},
                            time_limit_s=5, options=MilpOptions(allow_resident=False))
    assert (api.homes, api.offloaded_layers, api.selective_layers) == \
        (started.homes, started.offloaded_layers, started.selective_layers)


def test_a_gpt2_plans_under_auto_and_a_config_the_planner_cannot_read_is_refused_at_start():
    """GPT-2's config names its width n_embd (hidden_size only through its attribute_map, which to_dict
    leaves out): policy auto calibrated, then kept its calibration plan for good with a warning, and policy
    milp raised a raw ModelShapeError. The standard names are now read through the attribute_map; a config
    the planner still cannot read is refused at initialize, naming the policy."""
    from engine_models import make_hf_model
    from lazytrain.engine.engine import _planner_config
    model = make_hf_model("gpt2", n_layers=4)
    cfg = _planner_config(model)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["intermediate_size"]) == \
        (model.config.n_embd, 4, model.config.n_head, 4 * model.config.n_embd)
    # only the shape names: others an attribute_map gives can mean something else (Zamba2's layer_types are
    # its Mamba/hybrid labels, which the planner would read as linear-attention layers)
    stub = types.SimpleNamespace(config=types.SimpleNamespace(
        to_dict=lambda: {"d_model": 64, "layers_block_type": ["mamba", "hybrid"]},
        attribute_map={"hidden_size": "d_model", "layer_types": "layers_block_type"}))
    assert _planner_config(stub) == {"d_model": 64, "layers_block_type": ["mamba", "hybrid"], "hidden_size": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=_config({"policy": "auto", "auto": {
            "warmup_steps": 1, "profile_steps": 1, "selective": False}}))
        for x, y in batches(4):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    assert engine.auto.stopped is None and engine.plan.policy == "auto-milp"
    engine.destroy()

    class Opaque(torch.nn.Module):   # a config without the planner's names, and no attribute_map giving them
        def __init__(self):
            super().__init__()
            self.inner = make_model("modulelist")
            self.config = types.SimpleNamespace(to_dict=lambda: {"model_type": "opaque", "width": 32})

        def forward(self, ids):
            return self.inner(ids)
    for policy in ("auto", "milp"):
        with pytest.raises(ConfigError, match=f"^config 'lazytrain.policy' \"{policy}\" plans from the model's "
                                              f"shape, which its config does not give: .*hidden_size"):
            lazytrain.initialize(model=Opaque(), config=_config({"policy": policy, "seq_len": 12}))


@pytest.mark.parametrize("key", ["saved_bytes", "selective_fwd_s"])
def test_a_profile_whose_per_layer_costs_are_no_list_is_refused_naming_the_file(measured, tmp_path, key):
    """A number where a list of one per layer belongs gave "object of type 'int' has no len()"."""
    _, _, path = measured
    d = json.loads(open(path).read())
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**d, "costs": {**d["costs"], key: 5}}))
    with pytest.raises(MeasurementError, match=re.escape(f"machine profile {damaged}: measured costs: {key} must "
                                                         f"hold ") + ".* for each of the .* layers, got 5$"):
        MachineProfile.from_json(str(damaged))


def test_a_profile_plans_for_a_card_larger_than_the_profiles_default_memory(measured):
    """An 80 GB card's budget, no hardware profile: the measured machine's memory is the budget's (it was a
    64 GiB default, which refused the budget, so policy auto never planned on such a card); a catalog entry
    smaller than the card takes the card's size the engine passes."""
    from lazytrain.planner.problem import InfeasibleBudgetError
    from lazytrain.planner.search import profile_problem
    _, _, path = measured
    profile = MachineProfile.from_json(path)
    big = {"gpu": "80GB", "loss_chunk_tokens": 24}
    p = profile_problem(profile, big)
    assert p.hardware.gpu_mem_bytes == 80 * 10 ** 9 and p.gpu_budget <= 80 * 10 ** 9
    card = {"gpu": 150_754_820_096, "loss_chunk_tokens": 24}
    with pytest.raises(InfeasibleBudgetError, match="GPU budget .* is more than the GPU memory of hardware profile"):
        profile_problem(profile, card, "h200")
    p = profile_problem(profile, card, "h200", memory={"gpu_mem_bytes": 150_754_820_096})
    assert p.hardware.gpu_mem_bytes == 150_754_820_096 and p.hardware.name == "h200"
    # the measured rates whichever profile supplies the rest (the MegaTrain comparison's host phase read the
    # catalog entry's optimizer rate, so --hardware changed it)
    alone = profile_problem(profile, big).hardware
    assert (p.hardware.host_optimizer_gparams_per_s, p.hardware.achievable_tflops) == \
        (alone.host_optimizer_gparams_per_s, alone.achievable_tflops)
    assert plan_from_profile(profile, big, time_limit_s=5).policy == "milp"
    # a card whose datasheet peak is below the rate measured here: the peak is left unknown, as --base leaves it
    # (it was refused: "'achievable_tflops' (...) must be at most 'peak_tflops'", a value the user never wrote)
    slow = dataclasses.replace(CATALOG["h200"], peak_tflops=alone.achievable_tflops / 2, achievable_tflops=None)
    p = profile_problem(profile, card, slow, memory={"gpu_mem_bytes": 150_754_820_096})
    assert p.hardware.peak_tflops is None and p.hardware.achievable_tflops == alone.achievable_tflops
    # a profile saved before links were bounded, with a link past the bound (copies in place): planned
    old = dataclasses.replace(profile, links_gbps={k: 2e5 for k in profile.links_gbps})
    assert profile_problem(old, big).hardware.h2d_gbps == 1e5
    zero = dataclasses.replace(profile, costs=dataclasses.replace(
        profile.costs, diff_s=[0.0] * len(profile.costs.diff_s), fwd_s=[0.0] * len(profile.costs.fwd_s)))
    with pytest.raises(ValueError) as e:
        profile_problem(zero, big)
    assert str(e.value) == ("the profile's measured compute times (costs.diff_s from layer 0, costs.fwd_s below it) "
                            "are all zero: no compute rate can be read from them")


def test_a_profile_records_its_runs_accumulation_and_lazytrain_plan_keeps_it(measured, tmp_path, capsys):
    """The engine plans with its config's accumulation; `lazytrain plan --profile` planned the same profile with
    one micro-batch a step unless told --global-batch. The profile now says, and a profile without the field
    (written before) reads as one."""
    _, _, path = measured
    d = json.loads(open(path).read())
    assert d["grad_accum"] == 1
    legacy = {k: v for k, v in d.items() if k != "grad_accum"}
    assert MachineProfile.from_dict(legacy).grad_accum == 1
    accumulated = tmp_path / "accum.json"
    accumulated.write_text(json.dumps({**d, "grad_accum": 3}))
    profile = MachineProfile.from_json(str(accumulated))
    assert profile.grad_accum == 3 and MachineProfile.from_dict(profile.to_dict()).grad_accum == 3
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(accumulated), "--gpu-mem", "64GiB", "--host-mem", "64GiB", "--time-limit", "5", "--json", str(out)]) == 0
    capsys.readouterr()
    offline = plan_from_profile(profile, {"loss_chunk_tokens": 24}, time_limit_s=5, global_batch=3 * profile.micro_batch)
    assert Plan.from_json(str(out)).prediction["step_time_s"] == pytest.approx(offline.prediction["step_time_s"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**d, "grad_accum": 0}))
    with pytest.raises(MeasurementError, match="grad_accum must be an integer >= 1, got 0"):
        MachineProfile.from_json(str(bad))

def test_drift_beyond_the_margin_measures_and_plans_again_at_most_max_replans_times(capsys):
    # a margin no measurement meets: every check after a plan is a drift
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "check_every": 2, "drift_margin": 1e-9,
                                                       "max_replans": 1}}, steps=18)
    history = engine.auto.history
    engine.destroy()
    # 3 + 2 measured, 2 on the plan, 3 + 2 measured again, the rest on the second plan (no third)
    assert plans == ["auto-calibration"] * 5 + ["auto-milp"] * 2 + ["auto-calibration"] * 5 + ["auto-milp"] * 6
    assert [(r.step, r.reason) for r in history] == [(5, "measured"), (12, "measured again after drift")]
    assert history[0].measured_steps == 2 and history[1].measured_steps == 2
    # every comparison is kept: one on the first plan, three on the second (no plan again after them)
    assert [c[0] for c in history[0].checks] == [7] and [c[0] for c in history[1].checks] == [14, 16, 18]
    assert all(c[2] == 2 and c[1] > 0 for r in history for c in r.checks)
    assert history[1].measured_step_s == history[1].checks[-1][1]
    out = capsys.readouterr().out
    assert "[lazytrain] auto plan after step 12 (measured again after drift): auto-milp, predicted" in out
    assert "x the prediction)" in out


def test_a_new_micro_batch_is_measured_and_planned_again(capsys):
    """set_train_micro_batch_size under policy auto: the plan and its measurements were another step's, so
    the calibration plan runs again at the new micro-batch, then a plan for it (outside max_replans)."""
    cfg = _config({"policy": "auto", "auto": {**AUTO, "max_replans": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
        plans = []
        for micro, steps in ((2, 6), (4, 7)):
            if micro != engine.train_micro_batch_size_per_gpu():
                engine.set_train_micro_batch_size(micro)
            for x, y in batches(steps, batch=micro):
                plans.append((engine.plan.policy, engine.plan.micro_batch_size))
                engine.backward(lm_loss(engine(x), y))
                engine.step()
    history = engine.auto.history
    engine.destroy()
    # the step the new size began in runs on the plan it had; calibration follows it
    assert plans == [("auto-calibration", 2)] * 5 + [("auto-milp", 2)] * 2 + [("auto-calibration", 4)] * 5 + \
        [("auto-milp", 4)]
    assert [(r.step, r.reason) for r in history] == [(5, "measured"), (12, "measured again at micro-batch 4")]
    assert "[lazytrain] auto plan after step 12 (measured again at micro-batch 4): auto-milp" in capsys.readouterr().out


def test_another_number_of_micro_batches_a_step_is_measured_and_planned_again(capsys):
    """set_train_batch_size under policy auto changes the micro-batches a step: the steps measured at one were
    divided by the other (a profile 2.5-3x too fast), and a plan made for one ran at the other unchecked."""
    cfg = _config({"policy": "auto", "auto": {**AUTO, "max_replans": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
        data = iter(batches(6 + 7 * 2))
        for accumulation, steps in ((1, 6), (2, 7)):
            engine.set_train_batch_size(2 * accumulation)
            for _ in range(steps * accumulation):
                x, y = next(data)
                engine.backward(lm_loss(engine(x), y))
                engine.step()
    history = engine.auto.history
    engine.destroy()
    assert [(r.step, r.reason) for r in history] == [(5, "measured"), (12, "measured again at 2 micro-batches a step")]
    assert "(measured again at 2 micro-batches a step): auto-milp" in capsys.readouterr().out


def test_a_trace_asked_for_between_micro_batches_records_the_next_whole_step():
    """Asked for after a step's first micro-batch, the trace began at the second and held half a step (and
    policy auto counted it as a whole one); a second request during a traced step says so, not that it raised."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"checkpoint_interval": 2}})
    data = iter(batches(6))

    def micro_batch():
        x, y = next(data)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    micro_batch()
    engine.trace_next_step()   # mid-step: the next step is traced, whole
    micro_batch()
    assert engine.last_trace is None
    micro_batch()
    micro_batch()
    forwards = [s.name for s in engine.last_trace.spans if s.name.startswith("fwd L0")]
    assert len(forwards) == 2   # both micro-batches' forwards of layer 0
    engine.trace_next_step()
    micro_batch()
    with pytest.warns(UserWarning, match=r"did not complete \(it raised before step\(\), or trace_next_step\(\) was "
                                         r"called again during it\); its partial trace is dropped, and the next step "
                                         r"is traced whole"):
        engine.trace_next_step()
    engine.destroy()


def test_unmanaged_a_trace_asked_for_between_micro_batches_records_the_next_whole_step():
    """With "managed_gradient_accumulation": false micro_steps moves only in step(), so every forward looked like
    a step's first: a trace asked for after a backward began at once and held half a step."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"checkpoint_interval": 2}})
    data = iter(batches(4))

    def micro_batch():
        x, y = next(data)
        engine.backward(lm_loss(engine(x), y))
    micro_batch()
    engine.trace_next_step()   # mid-step: the next step is traced, whole
    micro_batch()
    engine.step()
    assert engine.last_trace is None
    micro_batch()
    micro_batch()
    engine.step()
    assert len([s.name for s in engine.last_trace.spans if s.name.startswith("fwd L0")]) == 2
    engine.destroy()


def test_unmanaged_accumulation_refuses_policy_auto():
    with pytest.raises(ConfigError) as e:
        lazytrain.initialize(model=make_model("llama"), config={
            "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "managed_gradient_accumulation": False,
            "lazytrain": {"policy": "auto"}})
    assert str(e.value).startswith("config 'lazytrain.policy' \"auto\" measures steps of "
                                   "'gradient_accumulation_steps' micro-batches and plans for them, but with "
                                   "'managed_gradient_accumulation' false")


def test_batches_larger_than_policy_auto_plans_for_are_said_once():
    """The profile recorded the config's shape while its times were measured on the batches passed: 48-token
    batches under 'seq_len' 8 were measured and planned as 8, and 8 samples under a micro-batch of 2 as 2,
    without a word. Said once (a batch of concatenated pairs, as TRL's DPO makes, comes every step)."""
    for lt, shape, says in (({"seq_len": 8}, (2, 48), r"2 x 8 tokens \('train_micro_batch_size_per_gpu' x "
                                                      r"'lazytrain.seq_len'\), and this batch of shape \(2, 48\) "
                                                      r"holds 96"),
                            ({}, (4, 12), r"2 x 12 tokens \('train_micro_batch_size_per_gpu' x the longest seen\), "
                                          r"and this batch of shape \(4, 12\) holds 48")):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=_config(
            {"policy": "auto", "auto": {**AUTO, "max_replans": 0}, **lt}))
        x, y = batches(1, batch=2, seq=min(shape[1], 8 if lt else 12))[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            engine.backward(lm_loss(engine(x), y))   # within the shape: nothing to say
        engine.step()
        x, y = batches(1, batch=shape[0], seq=shape[1])[0]
        with pytest.warns(UserWarning, match=r"policy \"auto\" measures and plans for micro-batches of " + says):
            engine.backward(lm_loss(engine(x), y))
        engine.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            engine.backward(lm_loss(engine(x), y))   # said once
        engine.step()
        engine.destroy()


def _second_plan_fails(monkeypatch):
    """The engine's second call of the planner raises "the planner failed"."""
    import lazytrain.engine.engine as engine_module
    real, calls = engine_module.plan_from_measurements, []

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the planner failed")
        return real(*args)
    monkeypatch.setattr(engine_module, "plan_from_measurements", second_fails)


def test_a_plan_at_a_new_micro_batch_that_fails_keeps_the_calibration_plan_at_that_size(monkeypatch):
    """The plan before the new micro-batch was made for the old one (its memory model is another step's):
    a failure to plan at the new size goes back to the plain calibration plan, which ran at it (not the
    one with every layer selective that measures them)."""
    _second_plan_fails(monkeypatch)
    cfg = _config({"policy": "auto", "auto": {**AUTO, "max_replans": 0, "selective": True}})
    plans = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
        for micro, steps in ((2, 9), (4, 10)):
            if micro != engine.train_micro_batch_size_per_gpu():
                engine.set_train_micro_batch_size(micro)
            for x, y in batches(steps, batch=micro):
                engine.backward(lm_loss(engine(x), y))
                engine.step()
                plans.append((engine.plan.policy, engine.plan.micro_batch_size))
    engine.destroy()
    assert plans[-1] == ("auto-calibration", 4)
    stopped = [str(w.message) for w in caught if "stopped" in str(w.message)]
    assert stopped == ['lazytrain: policy "auto" stopped after step 18 and keeps the plan auto-calibration: '
                       'RuntimeError: the planner failed']


def test_a_plan_again_after_drift_that_fails_goes_back_to_the_plan_it_had(monkeypatch):
    """Measuring again runs the slow calibration plan; a re-plan that fails then must not leave the run on
    it for good."""
    _second_plan_fails(monkeypatch)
    with pytest.warns(UserWarning, match=r"policy \"auto\" stopped after step 12 and keeps the plan auto-milp: "
                                         r"RuntimeError: the planner failed"):
        engine, plans = _train({"policy": "auto", "auto": {**AUTO, "check_every": 2, "drift_margin": 1e-9,
                                                           "max_replans": 1}}, steps=16, quiet=False)
    engine.destroy()
    assert plans == ["auto-calibration"] * 5 + ["auto-milp"] * 2 + ["auto-calibration"] * 5 + ["auto-milp"] * 4


def test_a_skipped_step_is_not_measured_and_a_cpu_without_copy_threads_plans_with_its_memory_copy_speed():
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "max_replans": 0}}, steps=8, links=False, spoil=3)
    history, profile, stopped = engine.auto.history, engine.auto.last_profile, engine.auto.stopped
    engine.destroy()
    assert stopped is None
    # step 3 (the first traced one) is skipped: step 5 is traced in its place
    assert plans == ["auto-calibration"] * 6 + ["auto-milp"] * 2 and history[0].step == 6
    assert set(profile.links_gbps) == {"h2d_gbps", "d2h_gbps"} and min(profile.links_gbps.values()) > 0


def test_planning_that_fails_warns_and_keeps_the_plan_in_place_while_training_goes_on():
    # a device budget the calibration plan runs in and the planner finds too small for any plan
    with pytest.warns(UserWarning, match=r"policy \"auto\" stopped after step 5 and keeps the plan "
                                         r"auto-calibration: InfeasibleBudgetError"):
        engine, plans = _train({"policy": "auto", "gpu_memory": "220KB", "auto": AUTO}, steps=5, accumulation=2,
                               quiet=False)
    assert engine.global_steps == 5 and engine.micro_steps == 10   # every micro-batch counted
    for x, y in batches(4):   # the next steps train on, and nothing is measured or planned any more
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.plan.policy == "auto-calibration" and engine.global_steps == 7 and not engine.auto.history
    engine.destroy()


def test_an_evaluation_output_kept_across_the_plan_change_does_not_touch_the_new_plans_boundaries():
    # the MILP keeps a boundary on the host here (a device budget below keep-all's: one layer's backward
    # needs about 236 kB, what its graph saves measured, and 111 kB for the three more layers' gradients
    # the sink holds on the slow device-to-host link)
    lt = {"policy": "auto", "gpu_memory": "345KB", "auto": {**AUTO, "max_replans": 0}}
    engine, plans = _train(lt, steps=8, evaluate=(4,))
    auto = engine.module_state_dict()
    left_out = engine.auto._mixed
    engine.destroy()
    # the traced step with the evaluation in it is left out of the measurement: step 6 measures instead
    assert left_out == 1 and plans[5:] == ["auto-calibration"] + ["auto-milp"] * 2
    engine, _ = _train({"policy": "keep_all", "boundary_home": "host", "overlap_optimizer": True}, steps=8,
                       evaluate=(4,))
    fixed = engine.module_state_dict()
    engine.destroy()
    for k, v in fixed.items():
        assert torch.equal(auto[k], v), k


@pytest.mark.parametrize("grad", [True, False], ids=["under-grad", "no-grad"])
def test_steps_with_an_evaluation_are_not_measured_and_too_many_stop_auto(grad):
    """An evaluation forward in a traced step, under grad or not, would add its time to the layers' forwards
    (25x the measured forward in one case): such steps are left out, and when every step has one, auto
    stops. A step's trace starts at its first forward under grad: an evaluation without grad lands in it
    between the micro-batches (before the second of two here)."""
    accumulation = 1 if grad else 2
    with pytest.warns(UserWarning) as caught:
        engine, plans = _train({"policy": "auto", "auto": {**AUTO, "max_replans": 0}}, steps=10,
                               accumulation=accumulation, evaluate=tuple(range(accumulation - 1, 20, accumulation)),
                               quiet=False, evaluate_grad=grad)
    assert plans == ["auto-calibration"] * 10 * accumulation and engine.auto._mixed == 5
    assert engine.auto.stopped == ("MeasurementError: 5 traced steps each ran a forward that was never differentiated "
                                   "(an evaluation between its micro-batches, with gradients on or off?), whose time "
                                   "cannot be told apart from the step's: evaluate under torch.no_grad() between "
                                   "optimizer steps (after engine.step()) while policy \"auto\" measures. Where every "
                                   "block is frozen no forward is differentiated, and one forward more than the step's "
                                   "micro-batches counts as such: a loss that runs the model twice a micro-batch cannot "
                                   "be measured there (use a fixed policy)")
    assert any("policy \"auto\" stopped after step 8" in str(w.message) for w in caught)
    engine.destroy()


def test_steps_with_an_evaluation_are_counted_per_measurement(monkeypatch):
    """The count of traced steps left out for an evaluation in them was carried into the measurement after a
    drift, so 3 such steps in the first and 2 in the second stopped auto (5 > 4 allowed)."""
    import dataclasses
    from lazytrain.config import AutoPlanConfig
    from lazytrain.engine import auto_plan
    from lazytrain.planner.plan import keep_all_plan
    monkeypatch.setattr(auto_plan, "ran_an_undifferentiated_forward", lambda trace, micro_batches=None: trace["mixed"])
    state = {}
    planned = dataclasses.replace(keep_all_plan(2, home="hbm"), policy="milp", prediction={"step_time_s": 1.0})
    calibration = dataclasses.replace(keep_all_plan(2, home="host"), policy="auto-calibration")
    hooks = auto_plan.AutoPlanHooks(
        request_trace=lambda: None, last_trace=lambda: state["trace"], switch=lambda p: state.update(plan=p),
        profile_of=lambda *a: "profile", plan_from=lambda profile: planned, on_rank0=lambda f: f(),
        say=lambda line: None, warn=lambda m: state.setdefault("warned", []).append(m),
        current_policy=lambda: state["plan"].policy)
    auto = auto_plan.AutoPlanner(AutoPlanConfig(warmup_steps=0, profile_steps=2, check_every=1, drift_margin=0.1,
                                                max_replans=3, selective=False), calibration, hooks)
    state["plan"] = calibration
    auto.start()
    steps = [(True, 1.0)] * 3 + [(False, 1.0)] * 2 + [(False, 5.0)] + [(True, 1.0)] * 2   # drift at the 6th
    for step, (mixed, seconds) in enumerate(steps, 1):
        state["trace"] = {"mixed": mixed}
        auto.after_step(step, seconds)
        if step == 5:
            assert state["plan"].policy == "milp" and auto._mixed == 3
    assert auto.measuring and state["plan"].policy == "auto-calibration"
    assert auto._mixed == 2 and auto.stopped is None and "warned" not in state


@pytest.mark.parametrize("lt,message", [
    ({"policy": "auto", "overlap_optimizer": False}, "measures each layer's host update, which runs layer by layer"),
    ({"policy": "auto", "weights_home": "hbm"}, "keeps every layer resident: there is nothing for it to plan"),
    ({"policy": "keep_all", "auto": {}}, "sets up policy \"auto\", but 'lazytrain.policy' is 'keep_all'"),
    ({"policy": "auto", "auto": {"warmup_steps": -1}}, "'lazytrain.auto.warmup_steps' must be an integer >= 0"),
    ({"policy": "auto", "auto": {"profile_steps": 0}}, "'lazytrain.auto.profile_steps' must be an integer >= 1"),
    ({"policy": "auto", "auto": {"drift_margin": 0}}, "'lazytrain.auto.drift_margin' must be a fraction > 0"),
    ({"policy": "auto", "auto": {"profile": "/nonexistent.json"}}, "no file '/nonexistent.json'"),
    ({"policy": "auto", "auto": {"every": 3}}, "unknown key 'every' in config section 'lazytrain.auto' (allowed: "
                                               "check_every, drift_margin, max_replans, profile, profile_path, "
                                               "profile_steps, selective, warmup_steps)"),
    ({"policy": "auto", "auto": {"selective": "yes"}}, "'lazytrain.auto.selective' must be true or false, got 'yes'"),
    # read when the measured steps are planned, so checked at start-up (it stopped auto after the measured steps)
    ({"policy": "auto", "hardware": "h2OO"}, "config 'lazytrain.hardware': unknown hardware 'h2OO'; catalog entries: "),
    ({"policy": "auto", "hardware": "/nonexistent-hw.json"}, "config 'lazytrain.hardware': "),
    ({"policy": "milp", "hardware": "h2OO", "seq_len": 12}, "config 'lazytrain.hardware': unknown hardware 'h2OO'"),
    # the MILP's plan streamed every layer without a word
    ({"policy": "milp", "weights_home": "hbm", "seq_len": 12}, "\"hbm\" keeps every layer resident: set "
                                                              "'weights_home' to \"host\" or \"nvme\" for the MILP's "
                                                              "plan (it keeps layers resident where that is faster), "
                                                              "or use keep_all"),
])
@pytest.mark.filterwarnings("ignore:lazytrain")
def test_auto_settings_that_cannot_work_are_refused_by_name(lt, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lazytrain.initialize(model=make_model("llama"), config=_config(lt))


@pytest.mark.filterwarnings("ignore:lazytrain")
def test_a_model_without_a_config_and_a_profile_of_another_micro_batch_are_refused(measured):
    _, _, path = measured
    with pytest.raises(ConfigError, match="needs the model's shape: a model with a Hugging Face `config`"):
        lazytrain.initialize(model=make_model("modulelist"), config=_config({"policy": "auto"}))
    with pytest.raises(ConfigError, match="was measured at micro-batch 2, this run trains 4: measure again"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto", "auto": {"profile": path}},
                                                                         micro_batch=4))


@pytest.mark.filterwarnings("ignore:lazytrain")
def test_batches_of_several_lengths_are_planned_for_the_longest_and_a_saved_profile_bounds_them(tmp_path):
    path = str(tmp_path / "profile.json")
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=_config(
        {"policy": "auto", "auto": {"warmup_steps": 1, "profile_steps": 2, "selective": False, "max_replans": 0,
                                    "profile_path": path}}))
    for step in range(5):   # padded to each batch's own length: 6, 12, 6, 12, 6 tokens (traced: 12, 6)
        x, y = batches(1, seq=12 if step % 2 else 6, seed=step)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.plan.policy == "auto-milp" and engine._seq_len == 12 and engine.plan.seq_len == 12
    # a longer batch once the plan is in place ran on it without a word (its memory counted for 12 tokens)
    x, y = batches(1, seq=16)[0]
    with pytest.warns(UserWarning, match=r"^lazytrain: the plan \(auto-milp\) was made for sequence length 12, and "
                                         r"this batch's is 16: it runs, but the plan's memory and time predictions "
                                         r"do not hold \(set 'lazytrain.seq_len' to the longest length trained: "
                                         r"policy \"auto\" plans for the longest batch seen while it measures\)$"):
        engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.destroy()
    assert MachineProfile.from_json(path).seq_len == 12   # the last traced step's was 6
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=_config(
        {"policy": "auto", "auto": {"profile": path}}))
    for seq in (6, 12):   # shorter than the profile's, and its own
        x, y = batches(1, seq=seq)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    with pytest.raises(ConfigError, match="was measured at sequence length 12, and this batch's is 13: measure "
                                          "again"):
        engine(batches(1, seq=13)[0][0])
    engine.destroy()


def test_a_batch_longer_than_the_seq_len_set_is_warned_of_though_it_holds_no_more_tokens():
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=_config(
        {"policy": "auto", "seq_len": 12, "auto": {"warmup_steps": 1, "profile_steps": 2, "selective": False,
                                                   "max_replans": 0}}))
    for x, y in batches(3, seq=12):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.plan.policy == "auto-milp" and engine.plan.seq_len == 12
    x, y = batches(1, seq=24)[0]
    with pytest.warns(UserWarning, match=r"^lazytrain: the plan \(auto-milp\) was made for sequence length 12, and "
                                         r"this batch's is 24: .*\(plan again at the longest length trained\)$"):
        engine(x[:1])   # one sample of 24 tokens: no more than the micro-batch's 2 x 12
    engine.destroy()


def test_a_file_that_is_not_a_profile_is_named(tmp_path, measured):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(MeasurementError, match="is not a LazyTrain machine profile"):
        MachineProfile.from_json(str(bad))
    d = json.loads(open(measured[2]).read())
    for change, message in (({"version": 99}, "has version 99; this LazyTrain reads version 1"),
                            ({"costs": {**d["costs"], "step_s": True}}, "step_s must be a finite time >= 0 s, got True"),
                            ({"links_gbps": {"h2d_gbps": float("inf")}}, "links_gbps must map"),
                            ({"device": "banana"}, 'device must be a torch device such as "cuda:0" or "cpu", got '
                                                   "'banana'"),
                            ({"device_name": 3}, "device_name must be a string, got 3"),
                            ({"world_size": 0}, "world_size must be an integer >= 1 or null, got 0"),
                            ({"zero_stage": True}, "zero_stage must be an integer >= 0 or null, got True")):
        bad.write_text(json.dumps({**d, **change}))
        with pytest.raises(MeasurementError, match=message):
            MachineProfile.from_json(str(bad))
    # through the config: named by its key, a ConfigError (lazytrain train: one line, exit 2, not a traceback)
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"^config 'lazytrain.auto.profile': machine profile .*p.json"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                        "auto": {"profile": str(bad)}}))


@pytest.mark.parametrize("change,says", [
    (lambda d: d["costs"].update(fwd_s=[0.0] * len(d["costs"]["fwd_s"]), diff_s=[0.0] * len(d["costs"]["diff_s"])),
     "the profile's measured compute times (costs.diff_s from layer 0, costs.fwd_s below it) are all zero"),
    (lambda d: d.update(links_gbps={}), "hardware profile 'cpu (measured)' has no value for 'h2d_gbps'"),
    (lambda d: d["model"].pop("num_attention_heads"), "model config lacks 'num_attention_heads'")],
    ids=["zero-times", "no-links", "model-without-heads"])
def test_a_saved_profile_that_cannot_be_planned_from_is_a_config_error_naming_the_file(measured, tmp_path, change,
                                                                                        says):
    """These passed the file's checks and failed in the planner as a bare ValueError (lazytrain train: a
    traceback) or a HardwareError about a "hardware profile", neither naming the file."""
    d = json.loads(open(measured[2]).read())
    change(d)
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="^" + re.escape(f"config 'lazytrain.auto.profile' ({bad}): planning from "
                                                          f"it failed: {says}")):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                        "auto": {"profile": str(bad)}}))


@pytest.mark.filterwarnings("ignore:lazytrain")
def test_a_saved_profile_of_another_model_or_sequence_length_and_an_unwritable_profile_path_are_refused(
        measured, tmp_path):
    d = json.loads(open(measured[2]).read())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**d, "model": {**d["model"], "layer_params": [1] * 6}}))
    with pytest.raises(ConfigError, match=r"was measured on another model: its layer_params is \[1, 1, 1, 1, 1, 1\]"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                         "auto": {"profile": str(other)}}))
    # the same layers with another embedding and head: what the step does outside the layers differs
    for key, value, says in (("vocab_size", 200000, "its vocab_size is 200000, this model's 32"),
                             ("tie_word_embeddings", True, "its tie_word_embeddings is True, this model's False")):
        other.write_text(json.dumps({**d, "model": {**d["model"], key: value}}))
        with pytest.raises(ConfigError, match=f"was measured on another model: {says}"):
            lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                             "auto": {"profile": str(other)}}))
    other.write_text(json.dumps({**d, "device": "cuda:0"}))   # its times are a GPU's
    with pytest.raises(ConfigError, match=r"was measured on cuda:0, this run trains on cpu: measure again"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                         "auto": {"profile": str(other)}}))
    assert d["device_name"] == (platform.processor() or platform.machine() or "cpu")
    other.write_text(json.dumps({**d, "device_name": "Some Other CPU"}))   # the same kind, another model
    with pytest.raises(ConfigError, match=r"was measured on Some Other CPU, this run trains on .*: its times are "
                                          r"another machine's; measure again"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                         "auto": {"profile": str(other)}}))
    # measured over two ranks: its steps held their collectives (and, from stage 1, a share of the updates)
    assert (d["world_size"], d["zero_stage"]) == (1, 0)
    other.write_text(json.dumps({**d, "world_size": 2, "zero_stage": 2}))
    with pytest.raises(ConfigError, match=r"was measured over 2 ranks at ZeRO stage 2, this run trains over 1 rank: "
                                          r"its step times are another run's; measure again"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                         "auto": {"profile": str(other)}}))
    # what trained, and the moments' bits: the backward's and the updates' times are another run's
    for key, value, says in (("trainable_share", 0.5, "trainable_share 0.5, this run's is 1"),
                             ("hybrid_8bit_fraction", 1.0, "hybrid_8bit_fraction 1, this run's is 0")):
        other.write_text(json.dumps({**d, key: value}))
        with pytest.raises(ConfigError, match=f"was measured with {says}: its backward and update times are "
                                              f"another run's; measure again"):
            lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto",
                                                                             "auto": {"profile": str(other)}}))
    other.write_text(json.dumps({k: v for k, v in d.items() if k not in ("device_name", "world_size", "zero_stage",
                                                                         "hybrid_8bit_fraction")}))   # an older one
    lazytrain.initialize(model=make_model("llama"), config=_config(
        {"policy": "auto", "auto": {"profile": str(other)}}))[0].destroy()
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=_config(
        {"policy": "auto", "auto": {"profile": measured[2]}}))
    x, y = batches(1, seq=16)[0]
    with pytest.raises(ConfigError, match="was measured at sequence length 12, and this batch's is 16"):
        engine(x)
    engine.destroy()
    with pytest.raises(ConfigError, match="'lazytrain.auto.profile_path' cannot be written: profile path "
                                          "/nonexistent-dir/p.json: its directory /nonexistent-dir does not exist"):
        lazytrain.initialize(model=make_model("llama"), config=_config(
            {"policy": "auto", "auto": {"profile_path": "/nonexistent-dir/p.json"}}))


def _rank(rank, port, out_dir, own_trace_on_rank_0=False):
    join_as(rank, 2, port)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cfg = _config({"policy": "auto", "auto": AUTO, "collective_timeout_s": 60})
    cfg["train_batch_size"] = 8 if own_trace_on_rank_0 else 4
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    plans = []
    steps = 9 + own_trace_on_rank_0   # one traced step more: rank 0's first is dropped
    for x, y in batches(steps * (2 if own_trace_on_rank_0 else 1), batch=4, seq=12 + 4 * rank):
        # rank 1's batches padded to a longer length
        if own_trace_on_rank_0 and rank == 0 and engine.global_steps == AUTO["warmup_steps"]:
            engine.trace_next_step()   # before each micro-batch of auto's first traced step: rank 0's is dropped
        part = slice(2 * rank, 2 * rank + 2)
        plans.append((engine.plan.policy, engine.plan.homes, engine.plan.last_segment_graph, engine.plan.seq_len))
        engine.backward(lm_loss(engine(x[part]), y[part]))
        engine.step()
    torch.save({"plans": plans, "weights": engine.module_state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_group()


def _rank_with_its_own_hardware(rank, port, out_dir):
    """'lazytrain.hardware' (a node-local file, say) is rank 0's to read: a name only rank 0 can read starts
    on every rank; one rank 0 cannot read is refused on every rank (on rank 0 alone, the others waited)."""
    join_as(rank, 2, port)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    told = []
    for rank0s, others in (("h200", "h2OO"), ("h2OO", "h200")):
        cfg = _config({"policy": "auto", "auto": AUTO, "collective_timeout_s": 60,
                       "hardware": rank0s if rank == 0 else others})
        cfg["train_batch_size"] = 4
        try:
            engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
        except ConfigError as e:
            told.append(str(e))
        else:
            told.append("started")
            engine.destroy()
    torch.save(told, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_group()


def test_the_hardware_profile_is_read_by_rank_0_alone_and_its_error_raised_on_every_rank(tmp_path):
    spawn(_rank_with_its_own_hardware, args=(free_port(), str(tmp_path)), nprocs=2)
    told = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [t[0] for t in told] == ["started", "started"]
    assert [t[1] for t in told] == [told[0][1]] * 2
    assert told[0][1].startswith("config 'lazytrain.hardware': unknown hardware 'h2OO'")


def test_ranks_measure_on_rank_0_and_switch_to_one_plan_at_the_same_step(tmp_path):
    """Rank 0 plans for every rank, for the longest sequence any of them trained."""
    spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["plans"] == r1["plans"]
    assert [p[0] for p in r0["plans"]] == ["auto-calibration"] * 5 + ["auto-milp"] * 4
    assert r0["plans"][-1][3] == 16
    for k, v in r0["weights"].items():
        assert torch.equal(r1["weights"][k], v), k


def test_a_step_rank_0_did_not_trace_is_not_counted_on_any_rank(tmp_path):
    """A script's own trace_next_step() on rank 0 alone, asked for before each micro-batch of the step auto
    traces, drops rank 0's trace of it: rank 1 went on to the collective on its trace, which rank 0 never
    joined, and both hung until the collective timeout."""
    spawn(_rank, args=(free_port(), str(tmp_path), True), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["plans"] == r1["plans"]
    # two micro-batches a step: warm-up 3, three traced steps (the first not counted), then the plan
    assert [p[0] for p in r0["plans"]] == ["auto-calibration"] * 12 + ["auto-milp"] * 8
    for k, v in r0["weights"].items():
        assert torch.equal(r1["weights"][k], v), k


def _rank_with_less_memory(rank, port, out_dir, rooms):
    """Rank 1's card and RAM share are smaller than rank 0's; ``rooms``: each rank's device room beside its
    calibration's peak (0: no room for a selective layer's kept outputs; None: no bound, the CPU without a
    device budget)."""
    import lazytrain.engine.engine as engine_module
    from lazytrain.engine import placement
    join_as(rank, 2, port)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    memory = [placement.RankMemory(80 * 10**9, 512 * 10**9, 256 * 10**9),
              placement.RankMemory(24 * 10**9, 1024 * 10**9, 128 * 10**9)][rank]
    placement.RankMemory.of_this_rank = classmethod(lambda cls, device: memory)
    engine_module.LazyTrainEngine._device_room = lambda self: rooms[rank]
    planned_with, real = [], engine_module.plan_from_measurements

    def recorded(cfg, tiers, profile, from_model=None, memory=None):
        planned_with.append(memory)
        return real(cfg, tiers, profile, from_model, memory)
    engine_module.plan_from_measurements = recorded
    cfg = _config({"policy": "auto", "auto": {**AUTO, "selective": True, "max_replans": 0},
                   "collective_timeout_s": 60})
    cfg["train_batch_size"] = 4
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    plans = []
    for x, y in batches(8, batch=4, seq=12):
        part = slice(2 * rank, 2 * rank + 2)
        plans.append(engine.plan.policy)
        engine.backward(lm_loss(engine(x[part]), y[part]))
        engine.step()
    torch.save({"plans": plans, "memory": engine._rank_memory, "planned_with": planned_with,
                "selective": engine.plan.selective_layers}, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_group()


@pytest.mark.parametrize("rooms", [(None, 0), (0, None)], ids=["rank-1-has-no-room", "rank-0-has-no-room"])
def test_rank_0_plans_for_the_least_memory_and_device_room_of_any_rank(tmp_path, rooms):
    """Every rank runs rank 0's plan: it plans for the smallest card and RAM share of any rank, and measures
    selective layers only where every rank's device has room for them (one has none: no selective phase; where
    it was rank 1, rank 0 alone measured every layer selective, and rank 1 would run over its device)."""
    from lazytrain.engine.placement import RankMemory
    spawn(_rank_with_less_memory, args=(free_port(), str(tmp_path), rooms), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    least = RankMemory(24 * 10**9, 512 * 10**9, 128 * 10**9)
    assert r0["memory"] == r1["memory"] == least
    assert r0["planned_with"] == [least] and r1["planned_with"] == []   # rank 0 plans, with the least
    assert r0["plans"] == r1["plans"] == ["auto-calibration"] * 5 + ["auto-milp"] * 3
    assert r0["selective"] == r1["selective"] == ()


def test_the_memory_a_plan_counts_on_is_the_cards_and_a_share_of_the_ram_not_a_catalog_machines():
    """A catalog entry describes another machine: the card's memory replaces its GPU's, and with no host budget
    configured this rank's share of its node's RAM caps its host memory. A configured host budget is checked
    as it was: against the profile's memory, or where there is no profile the node's RAM."""
    import dataclasses
    from lazytrain.engine.placement import RankMemory
    from lazytrain.planner.hardware import load_profile
    h200 = load_profile("h200")   # 2 TiB of host memory
    m = RankMemory(gpu_bytes=24 * 10**9, node_host_bytes=256 * 10**9, host_share_bytes=128 * 10**9)
    assert m.planned(h200, host_budget_given=False) == {"gpu_mem_bytes": 24 * 10**9, "host_mem_bytes": 128 * 10**9}
    small = dataclasses.replace(h200, host_mem_bytes=64 * 10**9)
    assert m.planned(small, host_budget_given=False)["host_mem_bytes"] == 64 * 10**9
    assert m.planned(None, host_budget_given=False)["host_mem_bytes"] == 128 * 10**9
    assert m.planned(h200, host_budget_given=True)["host_mem_bytes"] is None   # the profile's stands
    assert m.planned(dataclasses.replace(h200, host_mem_bytes=None), True)["host_mem_bytes"] is None
    assert m.planned(None, host_budget_given=True)["host_mem_bytes"] == 256 * 10**9
    unknown = RankMemory(None, None, None)
    assert unknown.planned(None, False) == {"gpu_mem_bytes": None, "host_mem_bytes": None}
    assert RankMemory.least([m, RankMemory(80 * 10**9, None, 200 * 10**9), unknown]) == \
        RankMemory(24 * 10**9, 256 * 10**9, 128 * 10**9)


def test_a_rank_counts_its_share_of_the_nodes_ram_under_either_launcher(monkeypatch):
    from lazytrain.engine import placement
    monkeypatch.setattr(placement, "_physical_memory", lambda: 64 * 2**30)
    for env, share in (({}, 64), ({"LOCAL_WORLD_SIZE": "4"}, 16), ({"LOCAL_SIZE": "2"}, 32),
                       ({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2"}, 16)):
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert placement.RankMemory.of_this_rank(torch.device("cpu")) == \
            placement.RankMemory(None, 64 * 2**30, share * 2**30), env


class _Planned(Exception):
    pass


def _what_reaches_the_planner(monkeypatch) -> dict:
    """The planner's call as policy milp or auto makes it (in a child process, with a deadline), caught."""
    from lazytrain.planner import isolate
    seen = {}

    def caught(fn, *args, **kwargs):
        seen.update(fn=fn.__name__, args=args, kwargs=kwargs)
        raise _Planned
    monkeypatch.setattr(isolate, "call_with_deadline", caught)
    return seen


@pytest.mark.parametrize("host", [None, "4GB"])
def test_policy_milp_plans_with_the_least_memory_it_is_given(monkeypatch, host):
    """What reaches the planner: the least card as the GPU budget and the hardware's GPU memory, and without a
    host budget the least RAM share as the hardware's host memory (with one, the catalog entry's 2 TiB stand)."""
    from lazytrain.engine import placement
    from lazytrain.planner.hardware import load_profile
    seen = _what_reaches_the_planner(monkeypatch)
    least = placement.RankMemory(24 * 10**9, 96 * 2**30, 48 * 2**30)
    monkeypatch.setattr(placement.RankMemory, "of_this_rank", classmethod(lambda cls, device: least))
    lt = {"policy": "milp", "hardware": "h200", "seq_len": 12, "device": "cpu",
          **({"capacities": {"host": host}} if host else {})}
    with pytest.raises(_Planned):
        lazytrain.initialize(model=make_model("llama"), config={
            "train_batch_size": 2, "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "lazytrain": lt})
    assert seen["fn"] == "plan_for"
    _, hardware, budgets = seen["args"]
    assert hardware.gpu_mem_bytes == budgets["gpu"] == 24 * 10**9
    assert hardware.host_mem_bytes == (48 * 2**30 if host is None else load_profile("h200").host_mem_bytes)
    assert budgets.get("host") == (None if host is None else 4 * 10**9)


def test_policy_auto_plans_with_the_least_memory_it_is_given(monkeypatch):
    from lazytrain.config import parse_config
    from lazytrain.engine import placement
    from lazytrain.planner.measured import MeasuredCosts
    seen = _what_reaches_the_planner(monkeypatch)
    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                        "lazytrain": {"policy": "auto", "device": "cpu"}})
    tiers = placement.build_tiers(cfg, torch.device("cpu"))
    model = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    profile = MachineProfile(costs=MeasuredCosts(fwd_s=(1e-3,) * 2, diff_s=(3e-3,) * 2, nonlayer_s=1e-3, step_s=1e-2,
                                                 update_s=(1e-3,) * 2),
                             links_gbps={"h2d_gbps": 1.0, "d2h_gbps": 1.0}, model=model, micro_batch=2, seq_len=12)
    least = placement.RankMemory(24 * 10**9, 96 * 2**30, 48 * 2**30)
    with pytest.raises(_Planned):
        placement.plan_from_measurements(cfg, tiers, profile, memory=least)
    assert seen["fn"] == "plan_from_profile"
    assert seen["kwargs"]["memory"] == {"gpu_mem_bytes": 24 * 10**9, "host_mem_bytes": 48 * 2**30}
    assert seen["args"][1]["gpu"] == 24 * 10**9   # the budgets
    for tier in tiers.values():
        tier.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_policy_auto_measures_plans_and_trains_bit_for_bit_as_a_fixed_plan():
    """On CUDA the blocks, the copies and the compute side's waits are timed by stream events: the rest of
    the model (embedding, head, loss) is what remains, and the MILP plans from real link bandwidths."""
    engine, plans = _train({"policy": "auto", "auto": {**AUTO, "selective": True, "max_replans": 0}, "device": "cuda"},
                           links=False)
    auto, profile, history = engine.module_state_dict(), engine.auto.last_profile, engine.auto.history
    engine.destroy()
    engine, _ = _train({"policy": "keep_all", "boundary_home": "host", "overlap_optimizer": True, "device": "cuda"},
                       links=False)
    fixed = engine.module_state_dict()
    engine.destroy()
    assert plans == ["auto-calibration"] * 5 + ["auto-calibration-selective"] * 3 + ["auto-milp"] * (STEPS - 8)
    assert profile.device.startswith("cuda")
    c = profile.costs
    assert all(t > 0 for t in c.fwd_s + c.diff_s + c.update_s + c.selective_fwd_s + c.selective_rerun_s)
    assert all(d > f for f, d in zip(c.fwd_s, c.diff_s))   # a re-run with autograd and a backward, over a forward
    assert c.nonlayer_s > 0 and c.step_s > 0
    assert profile.links_gbps["h2d_gbps"] > 0 and profile.links_gbps["d2h_gbps"] > 0
    assert history[0].predicted_step_s > 0 and history[0].measured_step_s > 0
    for k, v in fixed.items():
        assert torch.equal(auto[k], v), k


def test_a_lora_runs_profile_records_its_trainable_share_and_lazytrain_plan_budgets_it(measured, tmp_path,
                                                                                      monkeypatch):
    """A profile measured on a LoRA run records the share of the layers' parameters that trained, and
    ``lazytrain plan --profile`` budgets it (unless --trainable-share says otherwise); older profiles and full
    fine-tuning read as 1."""
    import json
    import lazytrain.planner.search as search
    from engine_models import add_lora
    _, _, full_path = measured
    assert MachineProfile.from_json(full_path).trainable_share == 1.0
    path = str(tmp_path / "lora.json")
    model = add_lora(make_model("llama"), ("q_proj", "v_proj"))
    cfg = _config({"policy": "auto", "auto": {**AUTO, "max_replans": 0, "profile_path": path}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
        for x, y in batches(6):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    blocks = list(model.model.layers.parameters())
    share = sum(p.numel() for p in blocks if p.requires_grad) / sum(p.numel() for p in blocks)
    engine.destroy()
    profile = MachineProfile.from_json(path)
    assert profile.trainable_share == pytest.approx(share) and share < 0.1
    assert profile.non_block_trainable_share == 0.0   # the embedding, final norm and head were frozen
    assert profile.hybrid_8bit_fraction == 0.0          # its AdamW kept fp32 moments
    assert MachineProfile.from_json(full_path).non_block_trainable_share == 1.0
    seen, real = [], search.profile_problem
    monkeypatch.setattr(search, "profile_problem", lambda profile, budgets, *a: seen.append(
        (budgets.trainable_share, budgets.non_block_trainable_share)) or real(profile, budgets, *a)
        if budgets.hybrid_8bit_fraction == 0.0 else pytest.fail("the profile's 8-bit share was not budgeted"))
    assert main(["plan", "--profile", path, "--gpu-mem", "64GiB", "--host-mem", "64GiB", "--time-limit", "5"]) == 0
    # another share is refused: the measured update times are the LoRA run's (lazytrain plan --profile's test)
    assert main(["plan", "--profile", path, "--gpu-mem", "64GiB", "--host-mem", "64GiB", "--time-limit", "5", "--trainable-share", "1",
                 "--non-block-trainable-share", "0.5"]) == 2
    assert seen == [(pytest.approx(share), 0.0)]
    with open(path) as f:
        older = json.load(f)
    del older["trainable_share"], older["non_block_trainable_share"], older["hybrid_8bit_fraction"]   # older ones
    old_profile = MachineProfile.from_dict(older)
    assert (old_profile.trainable_share, old_profile.non_block_trainable_share, old_profile.hybrid_8bit_fraction) \
        == (1.0, 1.0, None)
    with pytest.raises(MeasurementError, match=r"non_block_trainable_share must be a fraction in \[0, 1\], got 2"):
        MachineProfile.from_dict({**older, "non_block_trainable_share": 2})
    with pytest.raises(ConfigError, match=rf"was measured with trainable_share {profile.trainable_share:.6g}, this "
                                          rf"run's is 1: its backward and update times are another run's"):
        lazytrain.initialize(model=make_model("llama"), config=_config({"policy": "auto", "auto": {"profile": path}}))


@pytest.mark.parametrize("selective", [True, False])
def test_a_profile_with_selective_costs_plans_selective_layers_only_where_auto_selective_allows(selective,
                                                                                               monkeypatch):
    """A saved profile may hold selective layers' costs; 'auto.selective': false keeps them out of the plan."""
    import dataclasses
    import types
    import lazytrain.planner.isolate as isolate
    from lazytrain.engine.placement import plan_from_measurements
    seen = []
    monkeypatch.setattr(isolate, "call_with_deadline",
                        lambda *a, options, **kw: seen.append(options) or Plan(num_layers=1, homes=("hbm", "hbm")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=_config({}))
    cfg = engine._config
    cfg = dataclasses.replace(cfg, lazytrain=dataclasses.replace(
        cfg.lazytrain, auto=dataclasses.replace(cfg.lazytrain.auto, selective=selective)))
    profile = types.SimpleNamespace(micro_batch=2, seq_len=12, links_gbps={"h2d_gbps": 1.0, "d2h_gbps": 1.0},
                                    costs=types.SimpleNamespace(selective_rerun_s=[0.001] * 6))
    plan_from_measurements(cfg, engine.tiers, profile)
    engine.destroy()
    assert [o.allow_selective for o in seen] == [selective]


@pytest.mark.parametrize("selective", [True, False])
def test_last_segment_graph_true_calibrates_without_the_tail_and_plans_with_it(selective):
    """The key's true reached the calibration plan: its tail layer was never re-run, so the measurement missed its
    re-run (or a selective layer fell in the tail) and the run kept the calibration plan for good."""
    engine, plans = _train({"policy": "auto", "last_segment_graph": True,
                            "auto": {**AUTO, "max_replans": 0, "selective": selective}}, quiet=False)
    assert plans[0] == "auto-calibration" and plans[-1] == "auto-milp"
    assert engine.plan.last_segment_graph and engine.auto.history[0].reason == "measured"
    engine.destroy()
