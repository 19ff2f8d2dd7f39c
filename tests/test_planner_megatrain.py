"""MegaTrain's executor in the simulator (megatrain.py), hybrid linear-attention layers, calibration band."""
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
