"""MegaTrain's executor in the simulator (megatrain.py), hybrid linear-attention layers, calibration band."""
import re

import pytest

from lazytrain.planner import megatrain
from lazytrain.planner.hardware import CATALOG
from lazytrain.planner.models import ModelShape, ModelShapeError, catalog_model
from lazytrain.planner.plan import every_k_plan
from lazytrain.planner.policies import (calibrate, calibration_band, megatrain_errors, megatrain_plan,
                                        prediction_band, simulate_megatrain)
from lazytrain.planner.simulate import SimulationError, simulate

from test_planner_toys import SLOW_HW, toy_problem


def test_megatrain_reruns_every_layer_of_a_block_and_ends_with_its_serial_host_phase():
    p = toy_problem(6, 3.0, hw=SLOW_HW)
    plan = megatrain_plan(p, k=2)
    mt = simulate(p, plan, strict=False, executor="megatrain")
    lt = simulate(p, plan, strict=False)
    reruns = [e.label for e in mt.timeline if e.lane == "compute" and e.label.startswith("recompute")]
    assert reruns == ["recompute L4", "recompute L5", "recompute L2", "recompute L3", "recompute L0", "recompute L1"]
    assert mt.recomputed_layers == 6 and lt.recomputed_layers == 3
    window_of_l5 = [e.label for e in mt.timeline if e.lane == "compute" and e.window == 2 * 6 - 1 - 5]
    assert window_of_l5 == ["recompute L4", "recompute L5", "diff L5"]
    # the serial host phase: bytes moved at 28 bytes per LazyTrain update, in this order, back to back
    bps = 0.002e9 * 28
    n, nl = p.model.total_params, p.model.layer_params
    host = [(e.label, e.start, e.end) for e in mt.timeline if e.lane == "optimizer"]
    assert [h[0] for h in host] == ["clip_grad_norm_", "optimizer step", "refresh pinned bf16 copies"]
    for (_, s, e), nbytes in zip(host, (n * 6, n * 22, nl * 4)):
        assert e - s == pytest.approx(nbytes / bps, rel=1e-12)
    assert host[1][1] == pytest.approx(host[0][2]) and host[2][1] == pytest.approx(host[1][2])
    tail_end = max(e.end for e in mt.timeline if e.lane == "d2h")
    assert host[0][1] == pytest.approx(tail_end)
    assert mt.step_time_s == pytest.approx(host[2][2] + p.load_nl + p.load_l[0], rel=1e-12)
    assert mt.step_time_s > lt.step_time_s


def test_megatrain_device_memory_holds_checkpoints_block_reruns_and_all_logits():
    p = toy_problem(6, 3.0, hw=SLOW_HW)
    A = p.A[0]
    last_of_block = megatrain.gpu_bytes(p, 2, 2 * 6 - 1 - 5)      # layer 5 closes block [4, 6)
    first_of_block = megatrain.gpu_bytes(p, 2, 2 * 6 - 1 - 4)
    assert last_of_block["checkpoints"] == 4 * A                  # boundaries 0, 2, 4 and 6
    assert last_of_block["re-run outputs of the block"] == 2 * A
    assert first_of_block["re-run outputs of the block"] == 1 * A
    assert last_of_block["layer gradients"] == p.Gl[5]
    head = megatrain.gpu_bytes(p, 2, 5)
    assert megatrain.logits_bytes(p) == 4 * 15 * p.model.vocab_size * 2
    assert head["checkpoints so far"] == 4 * A
    # two flat buffers of the largest layer and two templates per distinct layer structure
    sizes = {l.params for l in p.model.layers}
    assert megatrain.buffer_bytes(p) == 2 * max(p.Wl) + 2 * sum(2 * s for s in sizes)
    r = simulate(p, megatrain_plan(p, 2), strict=False, executor="megatrain")
    per_window = [sum(megatrain.gpu_bytes(p, 2, w).values()) for w in range(12)]
    assert r.peak_bytes["hbm"] == max(per_window) + p.budgets.gpu_reserved_bytes


def test_megatrain_executor_refuses_plans_it_cannot_run():
    p = toy_problem(6, 3.0, hw=SLOW_HW)
    with pytest.raises(megatrain.MegaTrainPlanError, match="checkpoint-every-k plans"):
        simulate(p, every_k_plan(6, 2, home="host", overlap_optimizer=False), executor="megatrain")
    with pytest.raises(megatrain.MegaTrainPlanError, match="serial optimizer"):
        simulate(p, every_k_plan(6, 2), executor="megatrain")
    with pytest.raises(SimulationError, match="executor 'deepspeed' is not one of lazytrain, megatrain"):
        simulate(p, megatrain_plan(p, 2), executor="deepspeed")


HYBRID = {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
          "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}


def test_hybrid_layers_against_a_hand_computation():
    m = ModelShape.from_hf_config(HYBRID)
    lin, full = m.layers[0], m.layers[1]
    assert [l.linear is not None for l in m.layers] == [True, False, True, False]
    # full attention: q + gate 64*128, k and v 2*64*32, o 64*64, two norms 2*64, q/k norms 2*16; MLP 3*64*128
    assert full.params == 8192 + 4096 + 4096 + 128 + 32 + 24576 == 41120
    # Gated DeltaNet: in_proj_qkv 64*64, in_proj_z 64*32, in_proj_b/a 2*64*4, conv 64*4, dt_bias and
    # A_log 2*4, gated norm 8, out_proj 32*64; two norms 2*64; MLP 3*64*128
    assert lin.params == 4096 + 2048 + 512 + 256 + 8 + 8 + 2048 + 128 + 24576 == 33680
    # FLOPs per token: 2 * params, plus attention 2*S*q_dim, or the chunked delta rule
    # 2 * value heads * (chunk * (2*dk + 2*dv) + 3*dk*dv) = 2 * 4 * (64 * 32 + 192)
    assert full.fwd_flops_per_token(32) == 2 * 41120 + 2 * 32 * 64
    assert lin.fwd_flops_per_token(32) == lin.fwd_flops_per_token(4096) == 2 * 33680 + 17920
    # saved bytes per token in bf16: two fp32-scaled norms (fp32 input copy 4h, fp32 normalised 4h, output 2h
    # each) and the MLP's four ffn-wide tensors (2 * 4 * 128); full attention: q, k, v, output 2 * (2q + 2kv),
    # q/k norms (fp32 input and normalised: 8 * (q + kv)), the gate's sigmoid and product 2 * 2q; Gated DeltaNet
    # 2 * (2*conv + 2*vh*dk + 4*vw + vh*chunk)
    assert full.saved_bytes_per_token(2) == 20 * 64 + 1024 + 2 * (128 + 64) + 8 * (64 + 32) + 2 * 128 == 3712
    assert lin.saved_bytes_per_token(2) == 20 * 64 + 1024 + 2 * (128 + 64 + 128 + 256) == 3456
    assert m.total_params == 2 * (41120 + 33680) + 2 * 100 * 64 + 64


def test_config_reader_on_hybrid_configs():
    explicit = ModelShape.from_hf_config({**HYBRID, "full_attention_interval": None,
                                          "layer_types": ["linear_attention", "full_attention", "full_attention",
                                                          "linear_attention"]})
    assert [l.linear is not None for l in explicit.layers] == [True, False, False, True]
    nested = ModelShape.from_hf_config({"model_type": "qwen3_5", "text_config": HYBRID})
    assert nested.layers == ModelShape.from_hf_config(HYBRID).layers
    sliding = ModelShape.from_hf_config({**HYBRID, "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert all(l.linear is None for l in sliding.layers)            # costed as full attention
    with pytest.raises(ModelShapeError, match="'layer_types' must list 4 layer type names"):
        ModelShape.from_hf_config({**HYBRID, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ModelShapeError, match="lacks 'linear_conv_kernel_dim'"):
        ModelShape.from_hf_config({k: v for k, v in HYBRID.items() if k != "linear_conv_kernel_dim"})
    with pytest.raises(ModelShapeError, match="'full_attention_interval' must be an integer >= 1, got 0"):
        ModelShape.from_hf_config({**HYBRID, "full_attention_interval": 0})
    with pytest.raises(ModelShapeError, match="multiple of 'linear_num_key_heads'"):
        ModelShape.from_hf_config({**HYBRID, "linear_num_value_heads": 3})
    # the paper's 27B is Qwen3.5-27B: 48 linear + 16 full layers, vocabulary 248,320
    m = catalog_model("paper-27b")
    assert sum(l.linear is not None for l in m.layers) == 48 and m.layers[3].linear is None
    assert (m.layer_params, m.total_params, m.vocab_size) == (24_353_196_544, 26_895_998_464, 248_320)


def test_calibration_band_contains_the_best_fit_and_orders_its_predictions():
    band = calibration_band(CATALOG["h800"], "h800", tolerance=0.01, rates=3)
    best_hw, errs = calibrate(CATALOG["h800"], "h800")
    best = max(abs(e) for e in errs.values())
    assert band[0] == (best_hw, best)
    assert len(band) > 1 and all(best - 1e-12 <= e <= best + 0.01 + 1e-12 for _, e in band)
    for hw, e in band:
        assert max(abs(x) for x in megatrain_errors(hw, "h800").values()) == pytest.approx(e, abs=1e-12)
    from lazytrain.planner.policies import paper_problem
    value, low, high = prediction_band(band, lambda hw: simulate_megatrain(
        paper_problem("h800", "qwen2.5-7b", hw, check=False)).step_time_s)
    assert low <= value <= high and low < high
    with pytest.raises(ValueError, match="empty calibration band"):
        prediction_band([], lambda hw: 0.0)


def test_megatrain_trains_every_parameter_whatever_the_problem_freezes_and_holds_its_own_host_state():
    """MegaTrain has no frozen or partial training (its code differentiates every layer and the embedding, and
    clips, updates and refreshes all parameters): a problem training less replays as the full fine-tuning."""
    import dataclasses
    p = toy_problem(6, 3.0, host_slots=6)
    full = simulate_megatrain(p, timeline=True)
    for less in (dict(frozen_bottom_layers=2), dict(trainable_share=0.1), dict(non_block_trainable_share=0.0),
                 dict(frozen_bottom_layers=6, trainable_share=0.0, non_block_trainable_share=0.0)):
        q = dataclasses.replace(p, budgets=dataclasses.replace(p.budgets, **less))
        r = simulate_megatrain(q, timeline=True)
        assert (r.step_time_s, r.peak_bytes, r.tflops) == (full.step_time_s, full.peak_bytes, full.tflops), less
        assert r.step_time_s > simulate(q, megatrain_plan(q), strict=False).step_time_s   # LazyTrain's executor: less
    # its host: bf16 parameters and gradients, fp32 moments, each layer's pinned bf16 flat copy, and its pinned
    # buffers: 12 gradient slabs and 2 staging buffers of the largest layer, the head slab (a tied head's weight
    # and the final norm) and the embedding slab (no boundary is kept there)
    from lazytrain.planner.policies import paper_problem
    m = p.model
    assert m.tied_embeddings and m.nonlayer_params == m.vocab_size * m.hidden + m.hidden
    slabs = 14 * max(l.params for l in m.layers) + m.nonlayer_params + m.vocab_size * m.hidden
    assert full.peak_bytes["host"] == megatrain.host_bytes(p) == m.total_params * 12 + (m.layer_params + slabs) * 2
    # gradients: the head slab beside the first backward windows, layer 0's and the embedding's after the backward
    d2h = {}
    for e in full.timeline:
        if e.lane == "d2h" and e.label in ("grads head/norm", "grads L0 + embedding"):
            d2h[e.label] = d2h.get(e.label, 0) + e.nbytes
    # (a tied head's gradient is added to the embedding's: beside the windows only the final norm's)
    assert d2h == {"grads head/norm": pytest.approx(m.hidden * 2), "grads L0 + embedding":
                   p.Wl[0] + m.vocab_size * m.hidden * 2}
    untied = paper_problem("h800", "qwen2.5-7b", CATALOG["h800"], check=False)   # head 544,997,376 + norm 3,584
    assert megatrain.head_grad_bytes(untied) == (544997376 + 3584) * 2
    # the step ends copying every non-layer weight to the device, with layer 0's
    last = [e for e in full.timeline if e.label == "next step's first weights (embedding/head + L0)"]
    assert [e.nbytes for e in last] == [p.nonlayer_w + p.Wl[0]]


def test_megatrain_differentiates_the_layers_below_a_measured_frozen_bottom_as_the_measured_ones_of_their_size():
    import dataclasses
    from lazytrain.planner.measured import MeasuredCosts
    p = toy_problem(4, 3.0, host_slots=4)
    c = MeasuredCosts(fwd_s=(1.0, 2.0, 2.0, 2.0), diff_s=(1.0, 2.0, 3.0, 3.4), nonlayer_s=0.5, step_s=0.25,
                      update_s=(0.0, 0.0, 0.1, 0.1), saved_bytes=(0, 0, 100, 120), first_differentiated=2)
    q = dataclasses.replace(p, budgets=dataclasses.replace(p.budgets, frozen_bottom_layers=2), measured=c)
    full = megatrain.as_it_trains(q)
    assert (full.budgets.frozen_bottom_layers, full.budgets.trainable_share, full.first_reached) == (0, 1.0, 0)
    # the median diff / forward of layers 2 and 3 (1.5, 1.7): 1.6; the most either saved
    assert full.measured.diff_s == pytest.approx((1.6, 3.2, 3.0, 3.4)) and full.measured.saved_bytes == (120, 120, 100, 120)
    assert full.measured.first_differentiated == 0 and full.measured.fwd_s == c.fwd_s
    # selective times below it (with_selective gives them the forward's): the measured layers' ratios too
    sel = dataclasses.replace(c, selective_fwd_s=(1.0, 2.0, 2.2, 2.4), selective_rerun_s=(1.0, 2.0, 1.0, 1.4))
    full = megatrain.as_it_trains(dataclasses.replace(q, measured=sel)).measured
    assert full.selective_fwd_s == pytest.approx((1.15, 2.3, 2.2, 2.4))
    assert full.selective_rerun_s == pytest.approx((0.6, 1.2, 1.0, 1.4))
    # none differentiated: the cost model's 3x forward, and the analytic saved bytes
    none = dataclasses.replace(c, diff_s=c.fwd_s, first_differentiated=4)
    q4 = dataclasses.replace(q, budgets=dataclasses.replace(p.budgets, frozen_bottom_layers=4), measured=none)
    assert megatrain.as_it_trains(q4).measured.diff_s == (3.0, 6.0, 6.0, 6.0)
    assert megatrain.as_it_trains(q4).measured.saved_bytes is None
    assert megatrain.as_it_trains(p) is p   # full fine-tuning: the problem itself
    full_ft = dataclasses.replace(c, diff_s=(3.0, 6.0, 6.0, 6.0), first_differentiated=0)
    assert megatrain.as_it_trains(dataclasses.replace(p, measured=full_ft)).measured == full_ft


def test_megatrain_makes_the_weight_gradients_a_measured_lora_backward_did_not():
    """A LoRA share's measured backward made no gradients for the frozen weights; MegaTrain's makes them: 2
    FLOPs per frozen weight and token, at the layer's measured forward rate."""
    import dataclasses
    from lazytrain.planner.measured import MeasuredCosts
    p = toy_problem(4, 3.0, host_slots=4)
    # the toy's layers: weights, and forward FLOPs a token at sequence 16
    assert [(l.token_params, l.fwd_flops_per_token(p.seq_len)) for l in p.model.layers] == [
        (2000, 4512.0), (3000, 6512.0), (2500, 5512.0), (2200, 4912.0)]
    c = MeasuredCosts(fwd_s=(1.0,) * 4, diff_s=(2.1,) * 4, nonlayer_s=0.5, step_s=0.25, update_s=(0.1,) * 4)
    lora = dataclasses.replace(p, budgets=dataclasses.replace(p.budgets, trainable_share=0.25), measured=c)
    assert megatrain.as_it_trains(lora).measured.diff_s == pytest.approx(
        (2.1 + 0.75 * 4000 / 4512, 2.1 + 0.75 * 6000 / 6512, 2.1 + 0.75 * 5000 / 5512, 2.1 + 0.75 * 4400 / 4912))
    # above a frozen bottom, the share is the layers above's (0.25 of 9700 weights, of their 4700); below it, the
    # median of theirs made whole (no layer above is of layer 0's or 1's size)
    below = dataclasses.replace(c, diff_s=(1.0, 1.0, 2.1, 2.1), first_differentiated=2)
    q = dataclasses.replace(lora, budgets=dataclasses.replace(lora.budgets, frozen_bottom_layers=2), measured=below)
    frozen = 1 - 0.25 * 9700 / 4700
    l2, l3 = 2.1 + frozen * 5000 / 5512, 2.1 + frozen * 4400 / 4912
    assert megatrain.as_it_trains(q).measured.diff_s == pytest.approx(((l2 + l3) / 2, (l2 + l3) / 2, l2, l3))


def test_a_profiles_host_optimizer_rate_counts_the_parameters_its_updates_trained(tmp_path, capsys):
    """The rate is read from the layers whose updates were timed whole: those above a frozen bottom (the frozen
    ones' updates left out). A LoRA share's updates are mostly each call's fixed cost: no rate is read from them,
    as where no layer trained, and MegaTrain's row says so (the rest still plans)."""
    import dataclasses
    from lazytrain.cli import main
    from lazytrain.planner.measured import MachineProfile, MeasuredCosts
    from lazytrain.planner.problem import Budgets
    from lazytrain.planner.search import as_model_shape, profile_problem
    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    layer = as_model_shape(cfg).layers[0].params
    c = MeasuredCosts(fwd_s=(1e-6,) * 3, diff_s=(1e-6, 3e-6, 3e-6), nonlayer_s=1e-6, step_s=1e-6,
                      update_s=(1e-9, 2e-6, 2e-6), first_differentiated=1)
    budgets = Budgets.of(gpu="4GB", host="4GB")
    whole = 2 * layer / 4e-6 / 1e9
    for share, run, rate in ((1.0, {}, whole), (2 / 3, {}, whole), (0.1, {}, None),
                             (1.0, {"world_size": 2, "zero_stage": 0}, whole),   # each rank updates every layer
                             (1.0, {"world_size": 2, "zero_stage": 1}, None)):   # each its own, waiting for others'
        profile = MachineProfile(costs=c, links_gbps={"h2d_gbps": 1.0, "d2h_gbps": 1.0}, model=cfg, micro_batch=2,
                                 seq_len=16, trainable_share=share, **run)
        assert profile_problem(profile, budgets).hardware.host_optimizer_gparams_per_s == (
            None if rate is None else pytest.approx(rate, rel=1e-12)), (share, run)
    head_only = MachineProfile(costs=dataclasses.replace(c, diff_s=c.fwd_s, first_differentiated=3),
                               links_gbps={"h2d_gbps": 1.0, "d2h_gbps": 1.0}, model=cfg, micro_batch=2, seq_len=16)
    p = profile_problem(head_only, budgets)
    assert p.hardware.host_optimizer_gparams_per_s is None and p.opt_rate is None
    path = tmp_path / "profile.json"
    head_only.to_json(str(path))
    assert main(["plan", "--profile", str(path), "--gpu-mem", "4GB", "--host-mem", "4GB", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("every layer frozen, no backward through them (a trainable share of 100.0% is more than "
                           "the layers above the frozen bottom hold: all of theirs train; the embedding counts as "
                           "frozen). MegaTrain has no frozen or partial training, and its row is not timed (its status "
                           "says why)")
    row = [line for line in out if line.startswith("megatrain")]
    assert len(row) == 1 and row[0].endswith(
        "not timed: MegaTrain's host phase needs the host optimizer's rate: the run measured did not update whole "
        "layers (a LoRA share, or every layer frozen), whose times would give it, and no hardware profile gives "
        "'host_optimizer_gparams_per_s' or 'host_mem_gbps'")
    # a hardware profile supplies it
    assert profile_problem(head_only, budgets, "h800").hardware.host_optimizer_gparams_per_s == 10.96


def test_lazytrain_plan_says_what_a_run_that_trains_less_trains_and_that_megatrains_row_trains_it_all(capsys):
    from lazytrain.cli import main
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "8", "--time-limit", "5"]
    said, megatrain_rows = {}, set()
    for extra in (["--frozen-bottom-layers", "30"], ["--frozen-bottom-layers", "30", "--trainable-share", "0.1"],
                  ["--trainable-share", "0.5", "--non-block-trainable-share", "0"], []):
        assert main(args + extra) == 0
        out = capsys.readouterr().out.splitlines()
        said[" ".join(extra)] = out[1]
        # its row but the time its simulation took ("solve s", 0.00 or 0.01 on a loaded machine)
        megatrain_rows |= {re.sub(r" +\d+\.\d\d +policy$", " policy", line) for line in out
                           if line.startswith("megatrain")}
    assert len(megatrain_rows) == 1   # the same full fine-tuning, its "/ lower bound" that of what it runs
    tail = ". MegaTrain has no frozen or partial training: its row trains every parameter, as its code would for this model"
    assert said == {
        "--frozen-bottom-layers 30": "trains 16.7% of the layers' parameters and 0.0% of the others; layers 0-29 "
        "frozen, the backward stops at layer 30 (a trainable share of 100.0% is more than the layers above the frozen "
        "bottom hold: all of theirs train; the embedding counts as frozen)" + tail,
        "--frozen-bottom-layers 30 --trainable-share 0.1": "trains 10.0% of the layers' parameters and 0.0% of the "
        "others; layers 0-29 frozen, the backward stops at layer 30 (the embedding counts as frozen)" + tail,
        "--trainable-share 0.5 --non-block-trainable-share 0": "trains 50.0% of the layers' parameters and 0.0% of "
        "the others" + tail,
        "": said[""]}
    assert said[""].startswith("step floor")   # full fine-tuning: no such line


def test_megatrains_host_memory_after_a_step_against_the_papers_cpu_column():
    """Its script reports RSS in GiB after the step, the gradients freed by optimizer.zero_grad(). Qwen2.5-7B by
    hand: 7,615,616,512 parameters in bf16 with 8 bytes of fp32 moments; bf16 pinned copies of the 6,525,618,176
    layer weights, 14 buffers of the largest layer (233,057,792), the untied head slab (544,997,376 + the final
    norm's 3,584) and the embedding slab (544,997,376). The H800 column fits fp32 moments (CPUAdam), the RTX
    3090 column bf16 ones (torch's AdamW)."""
    from lazytrain.planner.policies import megatrain_host_memory_errors, paper_problem
    p = paper_problem("h800", "qwen2.5-7b", CATALOG["h800"], check=False)
    by_hand = 7615616512 * 10 + (6525618176 + 14 * 233057792 + 544997376 + 3584 + 544997376) * 2
    assert megatrain.host_bytes_after_step(p) == by_hand
    assert megatrain.host_bytes(p) == by_hand + 7615616512 * 2
    residuals = {gpu: {m: round(e * 100, 1) for m, e in megatrain_host_memory_errors(CATALOG[gpu], gpu, mb).items()}
                 for gpu, mb in (("h800", 8), ("rtx3090", 4))}
    assert residuals == {"h800": {"qwen2.5-3b": -24.8, "qwen2.5-7b": -4.8, "qwen2.5-14b": -4.1, "paper-27b": -8.7},
                         "rtx3090": {"qwen2.5-3b": 2.3, "qwen2.5-7b": 10.8, "qwen2.5-14b": 13.0, "paper-27b": 6.6}}
