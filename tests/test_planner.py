"""Planner: model/hardware inputs, budgets, simulator invariants, policies, MILP vs simulator, CLI."""
import dataclasses
import json
import math
import re
import os
import subprocess
import sys

import warnings

import pytest

from lazytrain.planner.hardware import CATALOG, HardwareError, HardwareProfile, load_profile
from lazytrain.planner.milp import MilpOptions, build_and_solve
from lazytrain.planner.models import ModelShape, ModelShapeError, catalog_model
from lazytrain.planner.plan import Plan, PlanError, every_k_plan
from lazytrain.planner.policies import (best_interval_plan, greedy_plan, keep_all, megatrain_errors,
                                        megatrain_plan)
from lazytrain.planner.problem import Budgets, InfeasibleBudgetError, Problem, make_problem, parse_size
from lazytrain.planner.search import plan_for, search_micro_batch, solve
from lazytrain.planner.simulate import SimulationError, simulate

from test_planner_toys import A_BYTES, SLOW_HW, TOY_HW, toy_model, toy_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- inputs ---------------------------------------------------------------------------------------
def test_catalog_parameter_counts_match_the_published_models():
    assert catalog_model("qwen2.5-3b").total_params == 3_085_938_688
    assert catalog_model("qwen2.5-7b").total_params == 7_615_616_512
    assert catalog_model("qwen2.5-14b").total_params == 14_770_033_664
    m27 = catalog_model("paper-27b")
    assert (m27.num_layers, m27.hidden, m27.throughput_params) == (64, 5120, 26_895_998_464)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2"])
def test_attention_biases_are_counted_as_transformers_builds_them(model_type):
    """attention_bias puts a bias on Llama's and Qwen3's output projection too, not on Qwen2's (whose q/k/v
    biases it names): a layer the size transformers builds."""
    transformers = pytest.importorskip("transformers")
    import torch
    cfg = dict(model_type=model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128, attention_bias=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    built = sum(p.numel() for p in model.model.layers[0].parameters())
    assert ModelShape.from_hf_config(cfg).layers[0].params == built


BIASED = {   # configs whose MLP (and, for Ernie 4.5, every projection and the LM head) carry biases
    "llama-mlp_bias": dict(model_type="llama", mlp_bias=True),
    "llama-both": dict(model_type="llama", mlp_bias=True, attention_bias=True),
    "ernie4_5": dict(model_type="ernie4_5", use_bias=True),
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", use_bias=True, moe_num_experts=4, moe_k=2,
                         moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_interval=2,
                         moe_layer_start_index=1),
    "ernie4_5_moe-tied": dict(model_type="ernie4_5_moe", use_bias=True, tie_word_embeddings=True, moe_num_experts=4,
                              moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=0),
}


@pytest.mark.filterwarnings("ignore:lazytrain planner. model type 'ernie4_5")
@pytest.mark.parametrize("name", sorted(BIASED))
def test_mlp_and_head_biases_are_counted_as_transformers_builds_them(name):
    """Llama's mlp_bias and Ernie 4.5's use_bias were not read: a layer of a tiny Ernie 4.5 config was counted
    448 of 31,296 parameters short, its LM head's bias left out."""
    transformers = pytest.importorskip("transformers")
    import torch
    cfg = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, vocab_size=128, **BIASED[name])
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf_config(config.to_dict())
    assert [layer.params for layer in shape.layers] == [sum(p.numel() for p in layer.parameters())
                                                        for layer in model.model.layers]
    assert shape.total_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "mistral3", "llava", "llama4"])
def test_a_multimodal_models_head_is_tied_as_transformers_builds_it(model_type):
    """The text config's tie_word_embeddings was read first: Qwen3-VL-MoE's text config says tied where its
    outer config and the model it builds are untied (the LM head, vocab x hidden, left out of every budget),
    Mistral 3's the other way round."""
    transformers = pytest.importorskip("transformers")
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    import torch
    config = transformers.CONFIG_MAPPING[model_type]()
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    built = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the vision tower's and the model type's warnings
        assert ModelShape.from_hf_config(config.to_dict()).tied_embeddings is built
    if model_type == "qwen3_vl_moe":
        assert (config.to_dict()["text_config"]["tie_word_embeddings"], built) == (True, False)
    if model_type not in ("llava", "llama4"):
        return
    # a config.json saved before transformers 5 keeps the key in its text config alone: Llava's class takes it
    # from there, Llama 4's text model ties its own head (the outer config's default, read instead, said untied)
    saved = config.to_diff_dict()
    saved.pop("tie_word_embeddings", None)
    saved["text_config"]["tie_word_embeddings"] = not built
    config = transformers.CONFIG_MAPPING[model_type].from_dict(saved)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    built = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ModelShape.from_hf_config(saved).tied_embeddings is built


def test_a_mixture_of_experts_config_with_no_dense_mlp_is_counted_as_transformers_builds_it():
    """Qwen3.5-MoE's config names no intermediate_size (every layer's MLP is of experts): it could not be
    planned at all, by the CLI or by policies milp and auto."""
    transformers = pytest.importorskip("transformers")
    if "qwen3_5_moe_text" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no Qwen3.5-MoE")
    import torch
    config = transformers.CONFIG_MAPPING["qwen3_5_moe_text"](
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16)
    cfg = config.to_dict()
    assert cfg.get("intermediate_size") is None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf_config(cfg)
    assert [layer.params for layer in shape.layers] == [sum(p.numel() for p in layer.parameters())
                                                        for layer in model.model.layers]
    assert shape.total_params == sum(p.numel() for p in model.parameters())


def test_hf_config_dict_and_explicit_layers():
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": False}
    m = ModelShape.from_hf_config(cfg)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert m.num_layers == 3 and m.layers[0].params == per_layer
    assert m.total_params == 3 * per_layer + 2 * 100 * 64 + 64
    with pytest.raises(ModelShapeError, match="'intermediate_size'"):
        ModelShape.from_hf_config({k: v for k, v in cfg.items() if k != "intermediate_size"})
    # the precision: "dtype" (transformers >= 4.56) or "torch_dtype" (older); bf16 when neither is given
    assert [ModelShape.from_hf_config({**cfg, **d}).dtype_bytes for d in
            ({}, {"dtype": "float32"}, {"torch_dtype": "float32"}, {"dtype": "bfloat16"})] == [2, 4, 4, 2]
    explicit = ModelShape.from_layers("x", [10, 20, 30], hidden=8)
    assert [l.params for l in explicit.layers] == [10, 20, 30]


def test_measured_layer_params_replace_the_dense_estimate():
    """The engine adds each streamed block's parameter count (mixture-of-experts layers, or layers that
    differ, are far from the dense estimate); a multimodal config keeps it beside its text_config."""
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "layer_params": [1000, 250000, 250000]}
    assert [l.params for l in ModelShape.from_hf_config(cfg).layers] == [1000, 250000, 250000]
    nested = {"layer_params": [5, 6, 7], "text_config": {k: v for k, v in cfg.items() if k != "layer_params"}}
    assert [l.params for l in ModelShape.from_hf_config(nested).layers] == [5, 6, 7]
    with pytest.raises(ModelShapeError, match=r"'layer_params' must hold 3 non-negative counts \(one per layer\)"):
        ModelShape.from_hf_config({**cfg, "layer_params": [1, 2]})
    # a config whose names the planner cannot read says so, measured sizes or not
    from lazytrain.planner.search import as_model_shape
    with pytest.raises(ModelShapeError, match="lacks 'hidden_size'"):
        as_model_shape({"model_type": "no-such-model", "n_embd": 64, "layer_params": [1, 2, 3]})


def test_a_gpt2_config_json_is_read_through_its_classs_names():
    """GPT-2's config.json names its width n_embd (hidden_size only through its class's attribute_map): the
    engine read it through the model's config object, `lazytrain plan --model config.json` could not."""
    pytest.importorskip("transformers")
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_inner": None, "vocab_size": 100}
    shape = ModelShape.from_hf_config(gpt2)
    assert (shape.num_layers, shape.hidden, shape.layers[0].ffn) == (3, 64, 256)
    # an older config.json leaves n_inner out: its class's default, None (4 x the width)
    older = ModelShape.from_hf_config({k: v for k, v in gpt2.items() if k != "n_inner"})
    assert older.layers[0].ffn == 256


def test_a_config_naming_its_mlp_width_its_own_way_is_read_as_its_model_builds_it():
    """Falcon (ffn_hidden_size, None: 4 x hidden), OPT (ffn_dim), BLOOM (no key: 4 x hidden) and GPT-Neo
    (intermediate_size None: 4 x hidden) were refused by policies milp and auto: "model config lacks
    'intermediate_size'"."""
    T = pytest.importorskip("transformers")
    small = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    for config, model_class, ffn in [
            (T.FalconConfig(**small), T.FalconForCausalLM, 128),
            (T.FalconConfig(**small, ffn_hidden_size=80), T.FalconForCausalLM, 80),
            (T.OPTConfig(**small, ffn_dim=72, word_embed_proj_dim=32), T.OPTForCausalLM, 72),
            (T.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4), T.BloomForCausalLM, 128),
            (T.GPTNeoConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                            attention_types=[[["global"], 2]]), T.GPTNeoForCausalLM, 128)]:
        # the standard names a model's config object gives (as the engine reads it), and the heads' shape: no
        # child interpreter asks transformers for its class's defaults
        shape = ModelShape.from_hf_config({**config.to_dict(), "num_hidden_layers": 2, "num_attention_heads": 4,
                                           "num_key_value_heads": 4, "head_dim": 8})
        assert (shape.num_layers, shape.hidden, shape.layers[0].ffn) == (2, 32, ffn), config.model_type
        widths = {p.shape[0] for name, p in model_class(config).named_parameters()
                  if p.dim() == 2 and ("mlp" in name or "fc1" in name) and p.shape[0] != 32}
        assert widths == {ffn}, config.model_type   # what the model builds


def test_a_mixture_of_experts_config_without_an_mlp_width_says_so():
    """Reading the expert width first indexed cfg["intermediate_size"]: a KeyError's traceback where the clear
    error was before."""
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ModelShapeError, match="^model config lacks 'intermediate_size', which the planner needs$"):
        ModelShape.from_hf_config(mixtral)
    with pytest.raises(ModelShapeError, match="lacks 'intermediate_size'"):
        ModelShape.from_hf_config({**mixtral, "model_type": "llama4_text", "moe_intermediate_size": 32})


MOE_BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                intermediate_size=96, head_dim=16)
MOE_FAMILIES = {   # (config class, model class, expert keys) of families whose parameters the planner counts exactly
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3])),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128, interleave_moe_layer_step=2)),
    # its own list of MoE layers wins over the step (a pruned or edited config): the planner read the step alone
    "llama4-listed": ("Llama4TextConfig", "Llama4ForCausalLM",
                      dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                           interleave_moe_layer_step=1, moe_layers=[0, 3])),
    # its expert keys were not read: a 21.8B model counted as 3.35B dense
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                          moe_layer_interval=2, moe_layer_start_index=1)),
}


@pytest.mark.filterwarnings("ignore:lazytrain planner. model type 'ernie4_5_moe' is costed")
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_mixture_of_experts_configs_count_every_expert_and_compute_with_the_routed_ones(family):
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls, experts = MOE_FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**MOE_BASE, **experts)
    torch_model = getattr(transformers, model_cls)(cfg)
    actual = [sum(p.numel() for p in layer.parameters()) for layer in torch_model.model.layers]
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert [l.params for l in shape.layers] == actual
    measured = ModelShape.from_hf_config({**cfg.to_dict(), "layer_params": actual})
    assert measured.layers == shape.layers
    for layer, torch_layer in zip(shape.layers, torch_model.model.layers):
        mlp = getattr(torch_layer, "mlp", None) or getattr(torch_layer, "feed_forward", None) \
            or torch_layer.block_sparse_moe
        experts_module = getattr(mlp, "experts", None)
        if experts_module is None:                                    # a dense layer
            assert layer.active_params is None
            continue
        n_experts = cfg.num_local_experts if hasattr(cfg, "num_local_experts") else cfg.num_experts
        unused = (n_experts - cfg.num_experts_per_tok) * sum(p.numel() for p in experts_module.parameters()) // n_experts
        assert layer.active_params == layer.params - unused


def test_jambas_expert_layers_follow_its_period_and_offset():
    """Every layer was counted as a mixture of experts: Jamba planned as 92.1B where it has 51.6B."""
    from lazytrain.planner.models import MoeShape
    jamba = {"model_type": "jamba", "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8,
             "expert_layer_period": 2, "expert_layer_offset": 0}
    assert MoeShape.from_hf_config(jamba, 5).moe_layers == (True, False, True, False, True)
    del jamba["expert_layer_offset"]   # JambaConfig's default, 1
    assert MoeShape.from_hf_config(jamba, 5).moe_layers == (False, True, False, True, False)
    # Ernie 4.5 VL's text config gives its text and vision experts' widths: the text model's is costed
    ernie_vl = {"model_type": "ernie4_5_vl_moe", "moe_num_experts": 4, "moe_top_k": 2, "intermediate_size": 8,
                "moe_intermediate_size": [16, 4], "moe_layer_interval": 1}
    assert MoeShape.from_hf_config(ernie_vl, 3).expert_ffn == 16
    assert MoeShape.from_hf_config(ernie_vl, 3).moe_layers == (False, True, True)   # from index 1, its default


def test_an_encoder_decoder_config_is_refused_as_such_and_a_vision_tower_is_said_to_be_left_out():
    """T5 and BART failed on "lacks 'intermediate_size'", and with it given planned the encoder alone; a
    vision-language model's tower was left out of every budget without a word."""
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ModelShapeError) as e:
        ModelShape.from_hf_config(transformers.BartConfig().to_dict())
    assert str(e.value) == ("model config of type 'bart' is an encoder-decoder; the planner costs one decoder-only "
                            "stack of blocks. Train it with a simple policy (\"every_k\", \"keep_all\"), naming the "
                            "stack to stream in 'lazytrain.blocks'")
    vl = transformers.Qwen3VLConfig(text_config=dict(MOE_BASE)).to_dict()
    with pytest.warns(UserWarning, match="model type 'qwen3_vl' has a vision tower beside its text model; the plan "
                                         "costs the text model alone"):
        ModelShape.from_hf_config(vl)


def test_moe_flops_are_those_of_the_routed_width():
    """Mixtral-style: 4 experts of width 96, 2 per token, cost what a dense MLP of width 192 costs, plus the
    router; the stored parameters are the four experts'."""
    dense = ModelShape.from_hf_config({**MOE_BASE, "intermediate_size": 192})
    moe = ModelShape.from_hf_config({**MOE_BASE, "num_local_experts": 4, "num_experts_per_tok": 2})
    h = MOE_BASE["hidden_size"]
    assert moe.layers[0].fwd_flops_per_token(1024) == dense.layers[0].fwd_flops_per_token(1024) + 2 * h * 4
    assert moe.layers[0].params == dense.layers[0].params + 2 * 3 * h * 96 + h * 4
    # beside the routed width's MLP tensors, each routed copy of a token's input and its expert's output
    assert moe.layers[0].saved_bytes_per_token(2) == dense.layers[0].saved_bytes_per_token(2) + 2 * 2 * 64 * 2

def test_moe_tflops_count_the_active_parameters():
    """The TFLOPS convention's N is what a token multiplies: a mixture-of-experts model's routed top-k and shared
    experts, not all it stores. Counted with all 8 experts (3x the 2 a token visits), a compute-bound step came
    out at 1.8x the hardware's peak."""
    moe = ModelShape.from_hf_config({**MOE_BASE, "num_local_experts": 8, "num_experts_per_tok": 2})
    h, attn = 64, 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64          # q, k, v, o projections and the two norms
    active = 4 * (attn + 2 * 3 * h * 96 + h * 8) + 2 * 128 * h + h   # 2 experts and the router; embedding, head, norm
    assert (moe.active_params, moe.total_params) == (active, active + 4 * 6 * 3 * h * 96) == (215_616, 657_984)
    assert moe.throughput_params == active and moe.to_dict()["active_params"] == active
    dense = ModelShape.from_hf_config(MOE_BASE)
    assert dense.active_params == dense.total_params == dense.throughput_params
    fast = HardwareProfile("fast-links", achievable_tflops=1e-4, h2d_gbps=1e5, d2h_gbps=1e5,
                           host_optimizer_gparams_per_s=1e6)
    p = Problem(model=moe, hardware=fast, micro_batch=1, seq_len=256,
                budgets=Budgets(gpu_bytes=10 ** 9, host_bytes=10 ** 9, gpu_reserved_bytes=0))
    r = simulate(p, keep_all(p)[0])
    assert r.step_time_s == pytest.approx(r.compute_s, rel=1e-6)     # compute-bound: the links take no time
    assert r.tflops == pytest.approx(6 * active * 256 / r.step_time_s / 1e12, rel=1e-12)
    assert 0.5 * fast.achievable_tflops < r.tflops < fast.achievable_tflops


def test_measured_sizes_decide_which_layers_are_sparse():
    """DeepSeek-style: a config whose attention the planner does not model exactly (MLA), with the first
    layer dense; the measured sizes pick the dense and the sparse layers, and the routed experts'
    parameters come off the active count."""
    cfg = {**MOE_BASE, "model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1}
    estimate = ModelShape.from_hf_config(cfg)
    assert [l.active_params is not None for l in estimate.layers] == [False, True, True, True]
    measured = ModelShape.from_hf_config({**cfg, "layer_params": [29840, 42384, 42384, 42384]})
    assert [l.params for l in measured.layers] == [29840, 42384, 42384, 42384]
    assert [l.active_params for l in measured.layers] == [None] + [42384 - 2 * 3 * 64 * 32] * 3
    with pytest.raises(ModelShapeError, match=r"needs 'num_experts_per_tok' between 1 and 4, got 5"):
        ModelShape.from_hf_config({**cfg, "num_experts_per_tok": 5})
    with pytest.raises(ModelShapeError, match=r"needs 'num_experts_per_tok' between 1 and 4, got 0$"):
        ModelShape.from_hf_config({**cfg, "num_experts_per_tok": 0})   # was read as missing: "got None"


def test_layers_of_different_sizes_reserve_the_streaming_buffers_slack():
    """The engine's two streaming buffers are sized for the largest layer; a plan for layers that differ
    counts what they hold beyond the two layers a window streams, and nothing when layers are equal."""
    from lazytrain.planner.problem import Budgets, Problem
    from lazytrain.planner.hardware import catalog_profile
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    hw = catalog_profile("h200")

    def problem(layer_params=None):
        cfg = dict(base, **({"layer_params": layer_params} if layer_params else {}))
        return Problem(model=ModelShape.from_hf_config(cfg), hardware=hw, budgets=Budgets.of(gpu="10GB"),
                       micro_batch=1, seq_len=16)
    assert problem().slot_slack == 0
    uneven = problem([1000, 250000, 250000])
    assert uneven.slot_slack == 2 * (250000 - 1000) * 2          # bf16 weights
    assert uneven.gpu_static == problem([250000] * 3).gpu_static + uneven.slot_slack


def test_model_from_a_local_config_json(tmp_path):
    from lazytrain.planner.models import CATALOG_CONFIGS, load_model
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CATALOG_CONFIGS["qwen2.5-7b"]))
    for spec in (str(d), str(d / "config.json")):
        m = load_model(spec)
        assert m.name == "my-model" and m.total_params == 7_615_616_512
    # a file of another name names itself, not its folder
    (d / "qwen-small.json").write_text(json.dumps(CATALOG_CONFIGS["qwen2.5-7b"]))
    assert load_model(str(d / "qwen-small.json")).name == "qwen-small"

# 32 heads: the default key/value heads of the model types below (Gemma 16, Qwen2 32) must divide them
TIE_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=32, intermediate_size=96, vocab_size=128)


@pytest.mark.parametrize("model_type, tied", [("gemma", True), ("gemma2", True), ("gemma3_text", True),
                                              ("llama", False), ("qwen2", False), (None, False)])
def test_a_config_without_tie_word_embeddings_takes_its_model_types_default(model_type, tied, monkeypatch):
    """save_pretrained leaves tie_word_embeddings out where it is the default: a Gemma config then ties its head
    (GemmaConfig's default), which the planner read as untied (one more vocabulary x hidden of parameters). The
    model types the planner knows need no transformers."""
    from lazytrain.planner import models
    monkeypatch.setattr(models, "transformers_class_defaults",
                        lambda *a: pytest.fail(f"asked transformers for {a}"))
    cfg = dict(TIE_BASE, **({"model_type": model_type} if model_type else {}))
    m = ModelShape.from_hf_config(cfg)
    assert m.tied_embeddings is tied
    assert m.nonlayer_params == 128 * 64 * (1 if tied else 2) + 64
    assert ModelShape.from_hf_config({**cfg, "tie_word_embeddings": not tied}).tied_embeddings is (not tied)
    # a multimodal config: the text config's key, else the outer one's, else the text model type's default
    nested = {"text_config": cfg}
    assert ModelShape.from_hf_config(nested).tied_embeddings is tied
    assert ModelShape.from_hf_config({**nested, "tie_word_embeddings": not tied}).tied_embeddings is (not tied)


def test_the_planners_tied_defaults_are_transformers_and_other_model_types_ask_it(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from lazytrain.planner import isolate, models
    from lazytrain.planner.models import TIED_BY_DEFAULT
    checked = 0
    for model_type, tied in TIED_BY_DEFAULT.items():
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except ValueError:      # a model type newer than this transformers
            continue
        assert config.tie_word_embeddings is tied, model_type
        checked += 1
    assert checked >= 10
    # a model type the table does not hold: its config class's default, read in a child interpreter (FalconConfig
    # ties); one transformers does not know: untied
    assert "falcon" not in TIED_BY_DEFAULT and transformers.AutoConfig.for_model("falcon").tie_word_embeddings
    # one child per model type answers both what the shape and what the head leave out (TIE_BASE says neither
    # its key/value heads nor whether it ties)
    asked, ask = [], isolate.call_with_deadline
    monkeypatch.setattr(isolate, "call_with_deadline", lambda fn, *a, **kw: asked.append(a) or ask(fn, *a, **kw))
    models.transformers_class_defaults.cache_clear()
    for _ in range(2):
        assert ModelShape.from_hf_config({**TIE_BASE, "model_type": "falcon"}).tied_embeddings is True
        assert ModelShape.from_hf_config({**TIE_BASE, "model_type": "no-such-model"}).tied_embeddings is False
    assert asked == [("falcon",), ("no-such-model",)]


def test_the_device_memory_of_a_backward_window_counts_the_gradients_the_engines_sink_may_hold():
    """The planner counted one layer's gradients in flight; the engine's sink holds up to four, flattened on the
    device, while the next layer's backward runs: where a layer's copy to the host outlasts its backward, the
    queue fills. Where it does not, one layer's are in flight, as before."""
    import inspect
    from lazytrain.engine.weights import _GradientSink
    from lazytrain.planner.problem import GRAD_SINK_IN_FLIGHT
    assert inspect.signature(_GradientSink).parameters["max_in_flight"].default == GRAD_SINK_IN_FLIGHT == 4
    slow = dataclasses.replace(TOY_HW, name="toy-slow-d2h", d2h_gbps=0.0001)
    for hw, in_flight in ((TOY_HW, [1, 1, 1, 1, 1, 0]), (slow, [4, 4, 3, 2, 1, 0])):
        p = toy_problem(6, 1.5, hw=hw)
        L = p.L
        link_bound = [p.Gl[i] / p.bw_d2h > 2 * p.fwd_s[i] for i in range(L)]
        assert all(link_bound) if hw is slow else not any(link_bound)
        assert [p.grads_in_flight(i) for i in range(L)] == in_flight
        for i in range(L):
            assert p.grad_bytes_on_device(i) == sum(p.Gl[i:i + 1 + in_flight[i]])
            w = 2 * L - 1 - i   # layer i's backward window
            assert p.layer_of(w) == i
            assert p.fixed_gpu_bytes(w) == p.gpu_static + p.ws_bwd[i] + 2 * p.A[i] + p.grad_bytes_on_device(i)
            assert p.min_gpu_bytes(w)[1]["gradient buffers"] == p.grad_bytes_on_device(i)


def test_a_model_type_whose_layers_are_not_llama_style_is_costed_as_one_with_a_warning():
    import warnings
    from lazytrain.planner.models import LLAMA_STYLE_MODEL_TYPES
    for model_type in ("llama", "qwen2", "qwen3_5_text", "gemma2", "mixtral"):
        assert model_type in LLAMA_STYLE_MODEL_TYPES
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ModelShape.from_hf_config({**TIE_BASE, "model_type": model_type, "tie_word_embeddings": False})
    for measured, more in ((None, ""), ([10, 20], " (its layers' sizes are the measured ones)")):
        with pytest.warns(UserWarning) as caught:
            ModelShape.from_hf_config({**TIE_BASE, "model_type": "gpt_neox", "tie_word_embeddings": False,
                                       **({"layer_params": measured} if measured else {})})
        assert [str(w.message) for w in caught] == [
            "lazytrain planner: model type 'gpt_neox' is costed as a Llama-style decoder (q/k/v/o projections, a gated "
            "MLP of three matrices, RMSNorms); its layers differ in part, so the plan's predicted times and activation "
            "memory are estimates" + more]


def _warn_and_answer():
    import warnings
    warnings.warn("from the child", UserWarning)
    warnings.warn("from the child", UserWarning)
    return 7


def test_a_childs_warnings_are_raised_again_in_the_caller_once_each():
    """The engine plans in a child process: its warnings (a fallback plan, a model costed by analogy) went to
    a stderr nobody read."""
    from lazytrain.planner.isolate import call_with_deadline
    with pytest.warns(UserWarning) as caught:
        assert call_with_deadline(_warn_and_answer, deadline_s=60) == 7
    assert [str(w.message) for w in caught] == ["from the child"]


SPARSE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=32, intermediate_size=96, vocab_size=128)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "mistral", "qwen2", "llama", "glm"])
def test_a_config_without_kv_heads_or_head_dim_takes_what_transformers_loads(model_type):
    """save_pretrained leaves a key out where it is the config class's default: a Gemma config's head_dim 256, a
    Mistral one's 8 KV heads. The planner reads the attention's size as transformers loads it (GLM: a model
    type outside the planner's table, whose defaults are asked of transformers in a child interpreter)."""
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoConfig.for_model(model_type, **SPARSE)
    head_dim = getattr(loaded, "head_dim", None) or loaded.hidden_size // loaded.num_attention_heads
    layer = ModelShape.from_hf_config({**SPARSE, "model_type": model_type}).layers[0]
    assert (layer.q_dim, layer.kv_dim) == (32 * head_dim, loaded.num_key_value_heads * head_dim)
    # what a config says wins
    said = ModelShape.from_hf_config({**SPARSE, "model_type": model_type, "num_key_value_heads": 4,
                                      "head_dim": 16}).layers[0]
    assert (said.q_dim, said.kv_dim) == (32 * 16, 4 * 16)


@pytest.mark.parametrize("model_type, key, written, derived", [
    ("qwen2", "num_key_value_heads", None, 16),   # null: the attention heads, not Qwen2's default 32
    ("gemma", "head_dim", None, 256 // 16),       # null: hidden over heads, not Gemma's default 256
])
def test_a_key_written_as_null_is_derived_as_transformers_derives_it(model_type, key, written, derived):
    """A left-out key takes its config class's default; one written as null is what the classes make of None
    (transformers' Qwen2Config: the attention heads). The planner took the class default for both."""
    heads = derived if key == "num_key_value_heads" else 16
    m = ModelShape.from_hf_config({**SPARSE, "model_type": model_type, "num_attention_heads": heads, key: written})
    layer = m.layers[0]
    head_dim = 256 // heads
    assert (layer.q_dim, layer.kv_dim) == ((heads * head_dim, derived * head_dim) if key == "num_key_value_heads"
                                           else (heads * derived, layer.kv_dim))


def test_a_multimodal_configs_precision_is_read_where_save_pretrained_writes_it():
    """transformers writes dtype on the outer config of a multimodal model alone: read from the text config
    only, a float32 model was planned at 2 bytes per element."""
    text = {**SPARSE, "model_type": "llama", "num_key_value_heads": 8}
    assert ModelShape.from_hf_config({"model_type": "llava", "dtype": "float32", "text_config": text}).dtype_bytes == 4
    assert ModelShape.from_hf_config({"model_type": "llava", "text_config": {**text, "dtype": "float16"},
                                      "dtype": "float32"}).dtype_bytes == 2   # the text config's own wins
    assert ModelShape.from_hf_config({"model_type": "llava", "text_config": text}).dtype_bytes == 2   # bf16


def test_the_planners_shape_defaults_are_transformers():
    pytest.importorskip("transformers")
    from lazytrain.planner.models import (DEFAULTED_SHAPE_KEYS, SHAPE_DEFAULTS_BY_TYPE, TIED_BY_DEFAULT,
                                          _config_class_defaults)
    assert set(SHAPE_DEFAULTS_BY_TYPE) == set(TIED_BY_DEFAULT)
    checked = 0
    for model_type, known in SHAPE_DEFAULTS_BY_TYPE.items():
        try:
            theirs = _config_class_defaults(model_type)
        except LookupError:     # a model type newer than this transformers
            continue
        assert known == {k: v for k, v in theirs.items() if k in DEFAULTED_SHAPE_KEYS}, model_type
        assert theirs["tie_word_embeddings"] is TIED_BY_DEFAULT[model_type], model_type
        checked += 1
    assert checked >= 20
    # without a model type, or one transformers does not know: derived from the config's own sizes
    for extra in ({}, {"model_type": "no-such-model"}):
        layer = ModelShape.from_hf_config({**SPARSE, **extra}).layers[0]
        assert (layer.q_dim, layer.kv_dim) == (256, 256)


@pytest.mark.parametrize("change, message", [
    ({"layer_params": [-5_000_000, 1000]}, "model config 'layer_params' must be an integer >= 0, got -5000000"),
    ({"layer_params": [2.9, 1000]}, "model config 'layer_params' must be an integer >= 0, got 2.9"),
    ({"layer_params": []}, "model config 'layer_params' must list each layer's parameter count, got []"),
    ({"hidden": float("nan")}, "model config 'hidden' must be an integer >= 1, got nan"),
    ({"hidden": 0}, "model config 'hidden' must be an integer >= 1, got 0"),
    ({"vocab_size": -100}, "model config 'vocab_size' must be an integer >= 0, got -100"),
    ({"ffn": 0}, "model config 'ffn' must be an integer >= 1, got 0"),
    ({"dtype_bytes": 0}, "model config 'dtype_bytes' must be 2 or 4, got 0"),
    ({"tied_embeddings": "no"}, "model config 'tied_embeddings' must be true or false, got 'no'"),
    ({"hiden": 64}, "a model of explicit layers takes dtype_bytes, ffn, hidden, kv_dim, layer_params, name, q_dim, "
                    "saved_bytes_per_token, tied_embeddings, vocab_size; unknown: 'hiden'"),
])
def test_a_model_of_explicit_layers_is_refused_by_field(change, message):
    """A negative layer size planned a negative step (-1.29 ms, "optimal"), a fraction was cut to a whole
    number, NaN or 0 ended in a bare ValueError or ZeroDivisionError and a misspelt key in a TypeError."""
    from lazytrain.planner.search import as_model_shape
    with pytest.raises(ModelShapeError) as e:
        as_model_shape({"layer_params": [1000, 1000], "hidden": 64, "vocab_size": 100, **change})
    assert str(e.value) == message
    with pytest.raises(ModelShapeError, match=r"needs 'hidden' \(the hidden size\) beside 'layer_params'"):
        as_model_shape({"layer_params": [1000]})
    # JSON writes 2.5e8 as a float: a whole one is the count
    assert as_model_shape({"layer_params": [2.5e8, 1000], "hidden": 4096.0}).layers[0].params == 250_000_000


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "4096"}, "model config 'hidden_size' must be an integer >= 1, got '4096'"),
    ({"num_hidden_layers": [2]}, "model config 'num_hidden_layers' must be an integer >= 1, got [2]"),
    ({"num_attention_heads": -4}, "model config 'num_attention_heads' must be an integer >= 1, got -4"),
    ({"vocab_size": 0}, "model config 'vocab_size' must be an integer >= 1, got 0"),
    ({"intermediate_size": 96.0}, "model config 'intermediate_size' must be an integer >= 1, got 96.0"),
    ({"num_key_value_heads": True}, "model config 'num_key_value_heads' must be an integer >= 1, got True"),
    ({"head_dim": {"q": 16}}, "model config 'head_dim' must be an integer >= 1, got {'q': 16}"),
    ({"tie_word_embeddings": "false"}, "model config 'tie_word_embeddings' must be true or false, got 'false'"),
    ({"attention_bias": 1}, "model config 'attention_bias' must be true or false, got 1"),
    ({"num_local_experts": "8", "num_experts_per_tok": 2},
     "model config 'num_local_experts' must be an integer >= 0, got '8'"),
    ({"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": -32},
     "model config 'moe_intermediate_size' must be an integer >= 1, got -32"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": "0"},
     "model config 'mlp_only_layers' must list layer indices, got '0'"),
    ({"layer_params": ["1", 2]}, "model config 'layer_params' must hold 2 non-negative counts (one per layer), "
                                 "got ['1', 2]"),
    ({"reported_params": "7B"}, "model config 'reported_params' must be an integer >= 1, got '7B'"),
    ({"num_key_value_heads": 3}, "model config 'num_key_value_heads' (3) must divide 'num_attention_heads' (32)"),
    ({"num_attention_heads": 256}, "model config 'num_attention_heads' (256) must be at most 'hidden_size' (64) "
                                   "when the config gives no 'head_dim'"),
    ({"torch_dtype": "float64"}, "model config 'torch_dtype' must be one of bfloat16, float16, float32 (the "
                                 "precision the layers compute and stream in), got 'float64'"),
    ({"dtype": 5}, "model config 'dtype' must be one of bfloat16, float16, float32 (the precision the layers "
                   "compute and stream in), got 5"),
])
def test_a_model_config_value_of_the_wrong_type_is_refused_by_key_and_file(change, message, tmp_path, capsys):
    """int() read "4096" and 96.0 as sizes, a list or a dict ended in a TypeError traceback, bool() read "false" as
    true: each is refused naming the key, and with `lazytrain plan` the file, before any solving."""
    from lazytrain.cli import main
    cfg = dict(TIE_BASE, model_type="llama", **change)
    with pytest.raises(ModelShapeError) as e:
        ModelShape.from_hf_config(cfg)
    assert str(e.value) == message
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(path), "--hardware", "h800", "--micro-batch", "1"]) == 2
    assert capsys.readouterr() == ("", f"lazytrain plan: {path}: {message}\n")


def test_parse_size():
    assert parse_size("70GB") == 70 * 10 ** 9
    assert parse_size("24GiB") == 24 * 2 ** 30
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="70XB"):
        parse_size("70XB")
    # the planner's CLI and the engine's config and tiers read a size the same way
    from lazytrain.tiers import parse_bytes
    for text, n in (("70GB", 70 * 10 ** 9), ("70G", 70 * 2 ** 30), ("512M", 512 * 2 ** 20), ("24Gi", 24 * 2 ** 30),
                    ("1e9", 10 ** 9)):
        assert parse_size(text) == parse_bytes(text) == n
    for bad in ("1e400", "-5GB", True):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_a_size_is_read_exactly_in_whole_bytes():
    """Through a float, "4.1GB" was 4099999999 bytes and an integer above 2**53 lost its last digit; "0.5" and
    "1e-9" were budgets of 0 bytes; "1PiB" and "1P" were refused while "1PB" was read."""
    assert [parse_size(v) for v in ("4.1GB", "2.01KB", 9007199254740993, "1.3GiB", "1PiB", "1P", 1e9)] == \
        [4_100_000_000, 2010, 9007199254740993, 1395864371, 2**50, 2**50, 10**9]
    assert parse_size("0e999999999") == 0   # a Fraction of it built 10**999999999 (a hang)
    for small in ("0.5", "1e-9", 0.25, "1e-999999999"):
        with pytest.raises(ValueError, match=f"^size: {re.escape(repr(small))} is less than one byte$"):
            parse_size(small)
    assert parse_size("0") == 0


def test_a_budget_above_the_cards_memory_is_refused():
    with pytest.raises(InfeasibleBudgetError, match=r"GPU budget 70.00 GB is more than the GPU memory of hardware "
                                                    r"profile 'rtx3090' \(25.77 GB\); lower --gpu-mem"):
        make_problem("qwen2.5-3b", "rtx3090", 16, 1024, Budgets.of(gpu="70GB"))
    with pytest.raises(InfeasibleBudgetError, match=r"host budget 4000.00 GB is more than the host memory"):
        make_problem("qwen2.5-3b", "rtx3090", 16, 1024, Budgets.of(host="4TB"))


def test_hardware_json_missing_field_is_named_and_base_fills_it(tmp_path):
    d = CATALOG["h800"].to_dict()
    d["name"], d["achievable_tflops"] = "measured", None
    del d["host_optimizer_gparams_per_s"], d["host_mem_gbps"]
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    prof = load_profile(str(path))
    with pytest.raises(HardwareError, match="'achievable_tflops'"):
        make_problem("qwen2.5-3b", prof, 8, 1024, Budgets.of(gpu="70GB"))
    prof2 = load_profile(str(path), base="h800")
    assert prof2.achievable_tflops == CATALOG["h800"].achievable_tflops and prof2.h2d_gbps == d["h2d_gbps"]
    with pytest.raises(HardwareError, match="unknown hardware profile field"):
        HardwareProfile.from_dict({"name": "x", "pcie": 3})
    assert HardwareProfile.from_dict(json.loads(CATALOG["rtx3090"].to_json())) == CATALOG["rtx3090"]


def test_a_hardware_file_named_without_json_is_read_as_a_file(tmp_path, monkeypatch):
    """A profile saved as ``myhw`` (no ``.json``, given without a directory) is read, as a model's config
    file is; it was looked up in the catalog ("unknown hardware 'myhw'"). A catalog name still wins."""
    d = CATALOG["h800"].to_dict()
    d["name"] = "measured"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myhw").write_text(json.dumps(d))
    assert load_profile("myhw").name == "measured"
    (tmp_path / "h200").write_text(json.dumps(d))
    assert load_profile("h200") == CATALOG["h200"]
    with pytest.raises(HardwareError, match="unknown hardware 'otherhw'"):
        load_profile("otherhw")


def test_a_rate_of_0_is_unknown_as_the_profile_says():
    """The checks call 0 "unknown": a base fills it, and an optimizer rate of 0 falls back to the memory
    bandwidth, as a missing one does (they raised "must be > 0" at planning)."""
    filled = load_profile({"name": "x", "h2d_gbps": 0, "nvme_read_gbps": 0.0}, base="h800")
    assert (filled.name, filled.h2d_gbps, filled.nvme_read_gbps) == \
        ("x+h800", CATALOG["h800"].h2d_gbps, CATALOG["h800"].nvme_read_gbps)
    assert HardwareProfile(name="y", host_optimizer_gparams_per_s=0, host_mem_gbps=28).optimizer_params_per_s() == 1e9
    with pytest.raises(HardwareError, match=r"'host_optimizer_gparams_per_s' must be > 0, got 0.0"):
        HardwareProfile(name="y", host_optimizer_gparams_per_s=0).optimizer_params_per_s()
    with pytest.raises(HardwareError, match=r"^hardware profile field 'achievable_tflops' \(500\) must be at most "
                                            r"'peak_tflops' \(100\)$"):
        HardwareProfile(name="z", achievable_tflops=500, peak_tflops=100)
    # a measured profile filled from a smaller card's entry: that card's peak is not this one's
    measured = load_profile({"name": "bench", "achievable_tflops": 700, "peak_tflops": None}, base="rtx3090")
    assert (measured.achievable_tflops, measured.peak_tflops, measured.h2d_gbps) == \
        (700, None, CATALOG["rtx3090"].h2d_gbps)


# ---- budgets --------------------------------------------------------------------------------------
def test_infeasible_host_budget_names_the_gap():
    with pytest.raises(InfeasibleBudgetError, match=r"host memory budget 100\.00 GB cannot hold the optimizer "
                                                    r"state.*short by"):
        make_problem("qwen2.5-7b", "h800", 8, 1024, Budgets.of(gpu="70GB", host="100GB"))


def test_infeasible_gpu_budget_names_the_gap():
    with pytest.raises(InfeasibleBudgetError) as e:
        make_problem("paper-27b", "rtx3090", 64, 1024, Budgets.of(gpu="24GiB"))
    msg = str(e.value)
    assert "GPU budget 25.77 GB is too small at micro-batch 64" in msg
    assert "saved activations of one layer" in msg and "short by" in msg and "Lower --micro-batch" in msg
    with pytest.raises(InfeasibleBudgetError) as e:   # at micro-batch 1 there is no lower one to take
        make_problem("paper-27b", "rtx3090", 1, 65536, Budgets.of(gpu="24GiB"))
    assert "GPU budget 25.77 GB is too small at micro-batch 1 x seq 65536" in str(e.value)
    assert str(e.value).endswith("At micro-batch 1, shorten the sequence (--seq, the batches' length), or raise "
                                 "--gpu-mem or lazytrain.gpu_memory.")


def test_infeasible_plan_space_is_reported_by_the_milp():
    p = toy_problem(4, 0.0, host_slots=0)
    with pytest.raises(InfeasibleBudgetError, match=r"no plan fits the budgets .* the leanest simple plan "
                                                    r"\(boundary every 2 layers on hbm\) exceeds GPU by 14\.18 kB"):
        build_and_solve(p, MilpOptions(max_segment=2))


def test_infeasible_message_names_the_nvme_left_for_activations_beside_weights_there():
    """With the compute copies on NVMe the message printed the tier's whole capacity as if free for boundaries."""
    import dataclasses
    from lazytrain.planner.problem import fmt_bytes
    p = toy_problem(4, 0.0, host_slots=0)
    weights = sum(-(-layer.params * 2 // 4096) * 4096 for layer in toy_model(4).layers)
    on_nvme = Problem(model=p.model, hardware=TOY_HW, micro_batch=4, seq_len=16,
                      budgets=dataclasses.replace(p.budgets, weights_in_host=False, nvme_bytes=weights + 4096))
    with pytest.raises(InfeasibleBudgetError) as e:
        build_and_solve(on_nvme, MilpOptions(max_segment=2))
    assert f", NVMe {fmt_bytes(weights + 4096)} of which 4.10 kB free for activations) at micro-batch 4" \
        in str(e.value)
    with pytest.raises(InfeasibleBudgetError) as e:   # weights in host memory: the whole tier is free
        build_and_solve(p, MilpOptions(max_segment=2))
    assert ", NVMe 0 B) at micro-batch 4" in str(e.value)


# ---- simulator ------------------------------------------------------------------------------------
def test_simulator_invariants_on_a_milp_plan():
    p = toy_problem(6, 1.5, host_slots=2, nvme_slots=1, hw=SLOW_HW)
    plan, _ = build_and_solve(p, MilpOptions(max_segment=6, offload_slack=12, prefetch_lead=12, gap_rel=1e-9))
    r = simulate(p, plan)
    assert not r.violations
    for tier, budget in (("hbm", p.gpu_budget), ("host", p.host_budget), ("nvme", p.nvme_budget)):
        assert r.peak_bytes[tier] == max(m[tier] for m in r.memory) <= budget
    # windows are contiguous, the compute stream never overlaps itself, links run inside their window
    for a, b in zip(r.memory, r.memory[1:]):
        assert a["end"] == b["start"]
    comp = sorted((e for e in r.timeline if e.lane == "compute"), key=lambda e: e.start)
    assert all(x.end <= y.start + 1e-15 for x, y in zip(comp, comp[1:]))
    for e in r.timeline:
        if e.window < 2 * p.L:
            m = r.memory[e.window]
            assert m["start"] - 1e-15 <= e.start <= e.end <= m["end"] + 1e-15
    assert sum(e.end - e.start for e in comp) == pytest.approx(r.compute_s)


def test_simulator_reports_budget_violations_by_tier():
    p = toy_problem(4, 0.5, host_slots=0)
    with pytest.raises(SimulationError, match=r"hbm peak .* exceeds its budget"):
        simulate(p, every_k_plan(4, 1))
    nv = Plan(num_layers=4, homes=("hbm", "nvme", "recompute", "hbm", "hbm"))
    r = simulate(toy_problem(4, 4.0, host_slots=1), nv, strict=False)
    assert any(v.startswith("nvme peak") for v in r.violations)


def test_simulator_flags_a_boundary_that_never_reaches_the_device():
    p = toy_problem(3, 4.0, host_slots=2)
    ok = Plan(num_layers=3, homes=("hbm", "host", "hbm", "hbm"), offload_window={1: 1}, prefetch_window={1: 3})
    assert not simulate(p, ok, strict=False).violations
    r = simulate(p, ok, strict=False)
    # replay with a prefetch window the Plan contract forbids (bypassing validation): the read is caught
    broken = Plan(num_layers=3, homes=("hbm", "host", "hbm", "hbm"), offload_window={1: 1}, prefetch_window={1: 3})
    object.__setattr__(broken, "prefetch_window", {1: 5})
    r = simulate(p, broken, strict=False)
    assert any("reads boundary 1, which has no device copy" in v for v in r.violations)


def test_exposed_prefetch_waits_exactly_one_copy():
    p = toy_problem(3, 4.0, host_slots=2)
    early = Plan(num_layers=3, homes=("hbm", "host", "hbm", "hbm"), offload_window={1: 1}, prefetch_window={1: 3})
    late = Plan(num_layers=3, homes=("hbm", "host", "hbm", "hbm"), offload_window={1: 1}, prefetch_window={1: 4})
    r1, r2 = simulate(p, early), simulate(p, late)
    w = 4   # boundary 1's need window: layer 1 is differentiated in window 2L-1-1 = 4
    start = lambda r: min(e.start for e in r.timeline if e.lane == "compute" and e.window == w)
    assert start(r2) - r2.memory[w]["start"] == pytest.approx(A_BYTES / p.bw_h2d, rel=1e-12)
    assert start(r1) == r1.memory[w]["start"]
    assert r2.exposed_s["h2d"] >= A_BYTES / p.bw_h2d * (1 - 1e-12)


_TIED_LEGS = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from lazytrain.planner.plan import Plan
from lazytrain.planner.simulate import simulate
from test_planner_toys import A_BYTES, TOY_HW, toy_problem
p = toy_problem(3, 4.0, nvme_slots=2, hw=dataclasses.replace(TOY_HW, nvme_read_gbps=TOY_HW.h2d_gbps))
plan = Plan(num_layers=3, homes=("nvme", "hbm", "hbm", "hbm"), offload_window={0: 0}, prefetch_window={0: 5})
r = simulate(p, plan)
print(json.dumps([r.exposed_s["h2d"], r.exposed_s["nvme_read"], p.bw_h2d == p.bw_nr, A_BYTES / p.bw_h2d]))
"""


def test_a_wait_on_two_legs_that_end_together_is_the_host_to_device_links_in_every_process():
    """Boundary 0 read from NVMe in the last window, where nothing else uses the links: its NVMe read and its
    host->device copy, at one rate, end together. The wait counts on the first of LINKS, h2d; it went to
    whichever a set of link names listed first, which string hashing orders anew in each process (for one
    hash seed of 0-3, nvme_read)."""
    tests = os.path.dirname(__file__)
    for seed in range(4):
        run = subprocess.run([sys.executable, "-c", _TIED_LEGS, tests], capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONHASHSEED=str(seed)))
        h2d, nvme_read, tied, copy_s = json.loads(run.stdout)
        assert tied and (h2d, nvme_read) == (pytest.approx(copy_s, rel=1e-12), 0.0), seed


def test_tflops_follow_the_paper_convention():
    p = toy_problem(3, 4.0)
    r = simulate(p, every_k_plan(3, 1))
    toks = p.micro_batch * p.seq_len
    assert r.tflops == pytest.approx(6 * p.model.throughput_params * toks / r.step_time_s / 1e12)
    assert r.tokens_per_s == pytest.approx(toks / r.step_time_s)


def test_optimizer_overlap_never_slower_than_serial():
    p = toy_problem(4, 4.0)
    serial = Plan(num_layers=4, homes=("hbm",) * 5, overlap_optimizer=False)
    overlap = Plan(num_layers=4, homes=("hbm",) * 5)
    rs, ro = simulate(p, serial), simulate(p, overlap)
    assert ro.step_time_s < rs.step_time_s
    assert rs.exposed_s["optimizer"] == pytest.approx(p.opt_nl + sum(p.opt_l) + p.load_nl + p.load_l[0])


def test_last_segment_graph_skips_its_reruns_and_holds_its_internals():
    p = toy_problem(6, 50.0, hw=SLOW_HW)
    base = every_k_plan(6, 2, overlap_optimizer=False)
    graph = dataclasses.replace(base, last_segment_graph=True)
    assert graph.graph_start() == 4 and graph.recomputed_layers() == 2 and base.recomputed_layers() == 3
    rb, rg = simulate(p, base), simulate(p, graph)
    # layers 4 and 5 are not re-run for their backward, and segment (4, 6) is not recomputed
    assert rb.compute_s - rg.compute_s == pytest.approx(p.fwd_s[4] + p.fwd_s[5] + p.fwd_s[4])
    # window 5 (forward of layer 5): both graphs' internals are held, and both layers' own weight copies
    # beside the two streaming buffers the engine keeps (layer 5 streams into one; window 6 streams none),
    # where the base plan streams layer 5 and, for window 6's recompute and re-run, layers 4 and 5; boundary
    # 4 is held by layer 4's graph where the base plan keeps it on the GPU
    at = {m["window"]: m["hbm"] for m in rg.memory}
    base_at = {m["window"]: m["hbm"] for m in rb.memory}
    assert p.kept_buffers == 2 * p.Wl[5]
    assert at[5] - base_at[5] == (p.saved[4] + p.saved[5] + p.Wl[4] + p.Wl[5] + p.kept_buffers
                                  - (p.Wl[5] + p.Wl[4] + p.Wl[5]))
    # every layer keeping its graph: at the first backward window each graph holds its internals (the last
    # layer's are its window's working set), its weights and its input (RMSNorm's backward reads it); the
    # engine's two streaming buffers are kept, though no window streams any more
    whole = dataclasses.replace(every_k_plan(6, 6), last_segment_graph=True)
    assert whole.graph_start() == 0
    turn = {m["window"]: m["hbm"] for m in simulate(p, whole, strict=False).memory}[6]
    assert turn - p.fixed_gpu_bytes(6) == sum(p.A[:6]) + sum(p.saved[:5]) + sum(p.Wl) + p.kept_buffers
    assert at[4] - base_at[4] == p.saved[4] + p.Wl[4]
    assert Plan.from_json(graph.to_json()) == graph


def test_the_engines_two_kept_streaming_buffers_are_charged_while_any_layer_streams():
    """Keep-all with every layer's weights but layer 2's resident: the windows around layer 2 stream it
    (one layer), the others stream nothing, yet the engine keeps its two buffers (each of the largest
    layer: the slack in gpu_static), charged as two of the smallest layers beside that slack. With every
    layer resident the engine keeps none, and none is charged; with none resident, windows streaming two
    layers are charged those two."""
    p = toy_problem(6, 50.0, hw=SLOW_HW)
    assert p.kept_buffers == 2 * min(p.Wl) == 8000 and p.Wl[1:3] == [6000, 5000]
    keep = Plan(num_layers=6, homes=("hbm",) * 7)
    plans = {"none": keep, "all but 2": dataclasses.replace(keep, resident_layers=(0, 1, 3, 4, 5)),
             "every": dataclasses.replace(keep, resident_layers=tuple(range(6)))}
    at = {name: [m["hbm"] for m in simulate(p, plan).memory] for name, plan in plans.items()}
    # resident weights are held all step: layer 2's 5000 B leave them, the kept buffers' 8000 B come in
    assert [a - e for a, e in zip(at["all but 2"], at["every"])] == [p.kept_buffers - p.Wl[2]] * 12
    # window 1 (forward of layer 1) streams layer 1 and copies layer 2 for window 2: 11000 B in the buffers
    assert at["none"][1] - at["every"][1] == p.Wl[1] + p.Wl[2] - sum(p.Wl)


def test_selective_layers_rerun_only_their_non_matmul_ops_and_hold_their_outputs():
    p = toy_problem(6, 50.0, hw=SLOW_HW)
    # the toy layer (hidden 64, q/k/v 16, ffn 16): kept per token q, k, v (48), attention output (16), o_proj
    # (64), gate and up (32), down (64) = 224 elements of 2 bytes for 64 tokens: 3.5 boundaries
    assert p.sel_bytes == [3.5 * A_BYTES] * 6
    # its re-runs take the non-matmul FLOPs' share of a forward: norms, residuals 10 x 64, SiLU and product
    # 5 x 16, rotary 3 x 32 = 816 of 2 x 3000 + 2 x 16 x 16 (layer 1): above the 0.1 floor
    assert p.sel_rerun_s[1] == pytest.approx(p.fwd_s[1] * 816 / 6512, rel=1e-12)
    base = every_k_plan(6, 3)                                       # segments [0, 3) and [3, 6)
    sel = dataclasses.replace(base, selective_layers=(5, 1, 3))
    assert sel.selective_layers == (1, 3, 5)
    rb, rs = simulate(p, base), simulate(p, sel)
    gain = [f - r for f, r in zip(p.fwd_s, p.sel_rerun_s)]
    # layers 1 and 3 are recomputed (windows 9 and 6) and re-run before their backward; layer 5 only re-run
    assert rb.compute_s - rs.compute_s == pytest.approx(2 * gain[1] + 2 * gain[3] + gain[5], rel=1e-12)
    w9 = [e for e in rs.timeline if e.lane == "compute" and e.window == 9]
    assert [e.label for e in w9] == ["recompute L0", "recompute L1", "diff L2"]
    assert [e.end - e.start for e in w9] == pytest.approx([p.fwd_s[0], p.sel_rerun_s[1], p.diff_s[2]], rel=1e-12)
    w7 = [e.end - e.start for e in rs.timeline if e.lane == "compute" and e.window == 7]   # diff of layer 4
    w8 = [e.end - e.start for e in rs.timeline if e.lane == "compute" and e.window == 8]   # diff of layer 3
    assert w7 == pytest.approx([p.diff_s[4]]) and w8 == pytest.approx([p.diff_s[3] - gain[3]])
    # layer j's outputs are held from its forward window j until its backward window 11 - j, where the diff
    # task's autograd saves the same tensors (the window's workspace counts them)
    extra = {m["window"]: m["hbm"] for m in rs.memory}
    extra = {w: extra[w] - m["hbm"] for w, m in enumerate(rb.memory)}
    S = 3.5 * A_BYTES
    assert extra == {0: 0, 1: S, 2: S, 3: 2 * S, 4: 2 * S, 5: 3 * S, 6: 2 * S, 7: 2 * S, 8: S, 9: S, 10: 0, 11: 0}
    assert rs.selective_layers == 3 and rs.summary()["selective_layers"] == 3 and rb.selective_layers == 0
    assert Plan.from_json(sel.to_json()) == sel and json.loads(sel.to_json())["selective_layers"] == [1, 3, 5]
    # MegaTrain's executor has no selective layers
    from lazytrain.planner.megatrain import MegaTrainPlanError
    mega = every_k_plan(6, 4, overlap_optimizer=False)
    simulate(p, mega, executor="megatrain", strict=False)
    with pytest.raises(MegaTrainPlanError, match="no selective layers"):
        simulate(p, dataclasses.replace(mega, selective_layers=(1,)), executor="megatrain", strict=False)


def test_a_selective_rerun_takes_at_least_the_floor_share_of_the_forward_measured_or_not():
    from lazytrain.planner.measured import MeasuredCosts
    from lazytrain.planner.problem import SELECTIVE_RERUN_FLOOR
    p = make_problem("qwen2.5-7b", "h800", 8, 1024, Budgets.of(gpu="70GB"))
    layer = p.model.layers[0]
    assert layer.elementwise_flops_per_token() / layer.fwd_flops_per_token(1024) < SELECTIVE_RERUN_FLOOR == 0.1
    assert p.sel_rerun_s == pytest.approx([0.1 * f for f in p.fwd_s], rel=1e-12)
    # q 3584, k and v 2 x 512, attention output 3584, o_proj 3584, gate and up 2 x 18944, down 3584 per token
    assert layer.selective_elems_per_token() == 4 * 3584 + 2 * 512 + 2 * 18944
    assert p.sel_bytes[0] == (4 * 3584 + 2 * 512 + 2 * 18944) * 8 * 1024 * 2
    # hybrid stack: a gated attention layer keeps its gate's projection, a Gated DeltaNet layer its
    # projections (qkv 10240, z 6144, b and a 2 x 48), its delta rule's output (6144) and out_proj (5120)
    m = catalog_model("paper-27b")
    full = next(l for l in m.layers if l.linear is None)
    lin = next(l for l in m.layers if l.linear is not None)
    mlp = 2 * 17408 + 5120
    assert full.selective_elems_per_token() == mlp + 3 * 6144 + 2 * 1024 + 5120
    assert lin.selective_elems_per_token() == mlp + 10240 + 2 * 6144 + 2 * 48 + 5120
    # measured costs: the same share of the measured forward
    c = MeasuredCosts(fwd_s=(1.0,) * p.L, diff_s=(3.0,) * p.L, nonlayer_s=0.5, step_s=0.1, update_s=(0.1,) * p.L)
    pm = make_problem("qwen2.5-7b", "h800", 8, 1024, Budgets.of(gpu="70GB"), measured=c)
    assert pm.sel_rerun_s == pytest.approx([0.1] * p.L)
    assert pm.diff_task_s(3, {3}) == pytest.approx(2.1) and pm.diff_task_s(3) == 3.0


# ---- plans, policies, MILP -------------------------------------------------------------------------
def test_plan_json_round_trip(tmp_path):
    p = toy_problem(5, 1.5, host_slots=2, nvme_slots=1, hw=SLOW_HW)
    plan, _ = build_and_solve(p, MilpOptions(max_segment=5, offload_slack=10, prefetch_lead=10))
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    back = Plan.from_json(str(path))
    assert back == plan and Plan.from_json(plan.to_json()) == plan
    assert simulate(p, back).step_time_s == simulate(p, plan).step_time_s
    # a plan with selective layers
    p = toy_problem(5, 6.0, host_slots=0)
    plan, _ = build_and_solve(p, MilpOptions(allow_graph_tail=False))
    assert plan.selective_layers == (0, 4)
    plan.to_json(str(path))
    back = Plan.from_json(str(path))
    assert back == plan and back.selective_layers == (0, 4)
    assert simulate(p, back).step_time_s == simulate(p, plan).step_time_s


_GOOD_PLAN = {"num_layers": 4, "homes": ["host", "recompute", "hbm", "recompute", "hbm"]}


@pytest.mark.parametrize("change,message", [
    ({"offload_window": {"x": 1}}, "Plan field 'offload_window' must map boundary numbers to window numbers, got 'x': 1"),
    ({"offload_window": {"0": None}}, "Plan field 'offload_window' must map boundary numbers to window numbers, got '0': None"),
    ({"prefetch_window": {"0": 5.7}}, "Plan field 'prefetch_window' must map boundary numbers to window numbers, got '0': 5.7"),
    ({"resident_layers": ["1"]}, "Plan field 'resident_layers' must be a list of layer numbers, got ['1']"),
    ({"micro_batch_size": "8"}, "Plan field 'micro_batch_size' must be an integer or null, got '8'"),
    ({"num_layers": 4.5}, "Plan field 'num_layers' must be an integer, got 4.5"),
    ({"resident_layers": [True]}, "Plan field 'resident_layers' must be a list of layer numbers, got [True]"),
    ({"homes": "hbm"}, "Plan field 'homes' must be a list of tier names, got 'hbm'"),
    ({"overlap_optimizer": "no"}, "Plan field 'overlap_optimizer' must be true or false, got 'no'"),
    # what the engine checks against its device's budget (a number here was an AttributeError at start-up)
    ({"prediction": {"peak_bytes": 123456}}, "Plan field 'prediction.peak_bytes' must be an object of bytes by "
                                             "tier, got 123456"),
    ({"prediction": {"peak_bytes": {"hbm": "1GB"}}}, "Plan field 'prediction.peak_bytes' must be an object of "
                                                     "bytes by tier, got {'hbm': '1GB'}"),
])
def test_a_malformed_plan_file_names_the_field(change, message):
    with pytest.raises(PlanError) as e:
        Plan.from_json(json.dumps({**_GOOD_PLAN, **change}))
    assert str(e.value) == message
    with pytest.raises(PlanError, match="a Plan JSON must be an object, got list"):
        Plan.from_json("[1, 2]")
    assert Plan.from_json(json.dumps({**_GOOD_PLAN, "offload_window": {"0": 1}})).offload_window == {0: 1}
    # whole numbers written as floats, or numpy integers handed to from_dict, are integers
    import numpy as np
    whole = Plan.from_json(json.dumps({**_GOOD_PLAN, "num_layers": 4.0, "offload_window": {"0": 1.0},
                                       "micro_batch_size": 2.0}))
    assert (whole.num_layers, whole.offload_window, whole.micro_batch_size) == (4, {0: 1}, 2)
    assert type(whole.micro_batch_size) is int
    assert Plan.from_dict({**_GOOD_PLAN, "num_layers": np.int64(4), "resident_layers": [np.int32(1)]}).resident_layers == (1,)


def test_a_plan_file_whose_relative_path_begins_like_json_text_is_read_as_the_file(tmp_path, monkeypatch):
    """"[run-1]/plan.json" was read as JSON text ("Plan JSON does not parse"); JSON text is still read as such."""
    (tmp_path / "[run-1]").mkdir()
    (tmp_path / "[run-1]" / "plan.json").write_text(json.dumps(_GOOD_PLAN))
    (tmp_path / "{x}.json").write_text(json.dumps({**_GOOD_PLAN, "policy": "braced"}))
    monkeypatch.chdir(tmp_path)
    assert Plan.from_json("[run-1]/plan.json").homes == tuple(_GOOD_PLAN["homes"])
    assert Plan.from_json("{x}.json").policy == "braced"
    assert Plan.from_json(json.dumps(_GOOD_PLAN)).num_layers == 4
    with pytest.raises(PlanError, match="Plan JSON does not parse"):
        Plan.from_json("[run-2]/plan.json")   # no such file: read as text, as before


def test_megatrain_executor_reproduces_the_paper_within_the_documented_residuals():
    errs = megatrain_errors(CATALOG["h800"], "h800")
    assert set(errs) == {"qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "paper-27b"}
    assert max(abs(e) for e in errs.values()) < 0.10, errs
    errs3090 = megatrain_errors(CATALOG["rtx3090"], "rtx3090")   # every fitted value at its cap (hardware.py)
    assert max(abs(e) for e in errs3090.values()) < 0.26, errs3090
    p = make_problem("paper-27b", "h800", 72, 1024, Budgets.of(gpu="70GB"))
    mt = megatrain_plan(p)
    assert mt.kept == tuple(range(0, 65, 4)) and not mt.overlap_optimizer and mt.recomputed_layers() == 48


def test_baselines_are_feasible_plans():
    p = toy_problem(6, 2.0, host_slots=6, hw=SLOW_HW)
    for res in (best_interval_plan(p), keep_all(p), greedy_plan(p)):
        assert res is not None
        plan, r = res
        assert not simulate(p, plan, strict=False).violations
    plan, _ = build_and_solve(p, MilpOptions(max_segment=6, offload_slack=12, prefetch_lead=12, gap_rel=1e-9))
    ours = simulate(p, plan).step_time_s
    assert all(ours <= res[1].step_time_s * (1 + 1e-9) for res in (best_interval_plan(p), keep_all(p), greedy_plan(p)))


def test_milp_prediction_agrees_with_the_simulator_within_2_percent():
    p = make_problem("qwen2.5-3b", "rtx3090", 8, 1024, Budgets.of(gpu="24GiB"))
    plan, info = build_and_solve(p, MilpOptions(time_limit_s=30))
    assert info.status in ("optimal", "feasible")
    r = simulate(p, plan)
    assert abs(info.objective_s / r.step_time_s - 1) < 0.02
    assert r.step_time_s < simulate(p, megatrain_plan(p)).step_time_s


def test_milp_is_deterministic():
    p = toy_problem(6, 1.5, host_slots=2, nvme_slots=1, hw=SLOW_HW)
    opts = MilpOptions(max_segment=6, offload_slack=12, prefetch_lead=12)
    a, b = build_and_solve(p, opts)[0].to_dict(), build_and_solve(p, opts)[0].to_dict()
    a.pop("prediction"), b.pop("prediction")     # holds solve times
    assert a == b


def test_plan_for_from_a_hugging_face_config():
    cfg = {"model_type": "qwen2", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
           "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000, "tie_word_embeddings": True}
    plan = plan_for(cfg, "h800", {"gpu": "8GB", "host": "64GB"}, micro_batch=16, seq_len=512, time_limit_s=20)
    assert plan.num_layers == 8 and plan.micro_batch_size == 16 and plan.seq_len == 512
    pred = plan.prediction
    assert pred["solver"]["status"] == "optimal" and pred["peak_bytes"]["hbm"] <= 8e9
    assert pred["step_time_s"] >= pred["lower_bound_s"]
    assert abs(pred["milp_vs_simulator"]) < 0.02
    assert Plan.from_json(plan.to_json()) == plan
    explicit = plan_for({"layer_params": [4_000_000] * 4, "hidden": 256, "vocab_size": 1000}, "h800",
                        {"gpu": "2GB", "host": "8GB"}, micro_batch=2, seq_len=128)
    assert explicit.num_layers == 4
    # the model's shape as counted, which the engine compares a plan file's with
    assert explicit.prediction["layer_params"] == [4_000_000] * 4 and explicit.prediction["dtype_bytes"] == 2
    q_o, k_v, mlp, norms, qkv_biases = 2 * 1024 * 1024, 2 * 1024 * 256, 3 * 1024 * 2816, 2 * 1024, 1024 + 2 * 256
    assert pred["layer_params"] == [q_o + k_v + mlp + norms + qkv_biases] * 8


def test_micro_batch_search_returns_the_best_feasible_throughput():
    model = toy_model(4)
    budgets = Budgets(gpu_bytes=400_000, host_bytes=400_000, gpu_reserved_bytes=0, loss_chunk_tokens=16)
    best, trials = search_micro_batch(model, TOY_HW, budgets, 16, MilpOptions(max_segment=4))
    feasible = [t for t in trials if t.tokens_per_s]
    assert best.micro_batch_size == max(feasible, key=lambda t: t.tokens_per_s).micro_batch
    largest = max(t.micro_batch for t in feasible)
    with pytest.raises(InfeasibleBudgetError):   # one more sample does not fit
        p = Problem(model=model, hardware=TOY_HW, budgets=budgets, micro_batch=largest + 1, seq_len=16)
        build_and_solve(p, MilpOptions(max_segment=4))
    # every batch planned: the optimum lies far below the largest batch (smaller batches keep more
    # layers' graphs), and the search finds it
    every = {b: solve(Problem(model=model, hardware=TOY_HW, budgets=budgets, micro_batch=b, seq_len=16),
                      MilpOptions(max_segment=4)).prediction["tokens_per_s"] for b in range(1, largest + 1)}
    assert best.micro_batch_size == max(every, key=every.get) < largest // 2


def test_a_fixed_global_batch_tries_only_its_divisors_and_counts_the_whole_step():
    model = toy_model(4)
    budgets = Budgets(gpu_bytes=400_000, host_bytes=400_000, gpu_reserved_bytes=0, loss_chunk_tokens=16)
    opts = MilpOptions(max_segment=4)
    best, trials = search_micro_batch(model, TOY_HW, budgets, 16, opts, global_batch=12)
    tried = {t.micro_batch for t in trials}
    assert tried and all(12 % b == 0 for b in tried)
    assert best.prediction["grad_accum"] == 12 // best.micro_batch_size
    every = {b: solve(Problem(model=model, hardware=TOY_HW, budgets=budgets, micro_batch=b, seq_len=16,
                              grad_accum=12 // b), opts).prediction["tokens_per_s"] for b in tried}
    assert best.micro_batch_size == max(every, key=every.get)
    assert plan_for(model, TOY_HW, budgets, micro_batch=3, seq_len=16, global_batch=12,
                    options=opts).prediction["grad_accum"] == 4
    with pytest.raises(ValueError, match="micro_batch 5 does not divide global_batch 12"):
        plan_for(model, TOY_HW, budgets, micro_batch=5, seq_len=16, global_batch=12, options=opts)


def test_the_global_batch_search_skips_a_micro_batch_whose_floor_cannot_beat_the_best_plan():
    from lazytrain.planner.ceiling import step_floor
    model = toy_model(4)
    budgets = Budgets(gpu_bytes=400_000, host_bytes=400_000, gpu_reserved_bytes=0, loss_chunk_tokens=16)
    opts = MilpOptions(max_segment=4)
    best, trials = search_micro_batch(model, SLOW_HW, budgets, 16, opts, global_batch=12)
    # on a slow link, micro-batch 1 streams every weight twelve times: its floor is above the best plan (6)
    skipped = [t for t in trials if t.status.startswith("skipped")]
    assert [t.micro_batch for t in skipped] == [1] and skipped[0].tokens_per_s is None
    assert best.micro_batch_size == 6
    one = Problem(model=model, hardware=SLOW_HW, budgets=budgets, micro_batch=1, seq_len=16, grad_accum=12)
    floor = step_floor(one, offload=True).step_s
    assert skipped[0].status == (f"skipped: its step floor {floor:.4g} s is no faster than the best plan's "
                                 f"{best.prediction['step_time_s']:.4g} s")
    assert solve(one, opts).prediction["step_time_s"] >= floor > best.prediction["step_time_s"]


def test_a_divisor_skipped_by_its_floor_does_not_count_against_max_plans(monkeypatch):
    import lazytrain.planner.search as search
    model = toy_model(4)
    budgets = Budgets(gpu_bytes=400_000, host_bytes=400_000, gpu_reserved_bytes=0, loss_chunk_tokens=16)
    opts = MilpOptions(max_segment=4)
    # every divisor after the first has a floor no plan can beat except 3: it is still solved with max_plans 2
    monkeypatch.setattr(search, "_floor_s", lambda model, hw, budgets, b, *rest: 0.0 if b == 3 else float("inf"))
    _, trials = search_micro_batch(model, TOY_HW, budgets, 16, opts, global_batch=12, max_plans=2)
    solved = [t.micro_batch for t in trials if not t.status.startswith("skipped")]
    skipped = [t.micro_batch for t in trials if t.status.startswith("skipped")]
    assert len(solved) == 2 and 3 in solved and skipped and max(skipped) > 3 and min(skipped) > 3


def test_the_global_batch_search_skips_no_micro_batch_whose_plans_beat_the_best():
    # a slow link and a large last layer: at micro-batch 2 (2 micro-batches a step) every layer, the last one
    # too, is resident and its weights are copied once a step. The step floor must count the last layer's
    # residency, or it sits above that plan and the search skips it for micro-batch 4's slower one
    from lazytrain.planner.ceiling import step_floor
    hw = HardwareProfile(name="toy-slow-h2d", achievable_tflops=1e-4, h2d_gbps=1e-5, d2h_gbps=10.0,
                         nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=10.0)
    model = ModelShape.from_layers("toy", [2000, 2000, 12000], hidden=64, vocab_size=0, tied_embeddings=True,
                                   q_dim=16, kv_dim=16, ffn=16, saved_bytes_per_token=5 * 64 * 2)
    budgets = Budgets(gpu_bytes=175_000, host_bytes=10 ** 7, gpu_reserved_bytes=0, loss_chunk_tokens=16)
    opts = MilpOptions(max_segment=3)
    steps = {}
    for b in (4, 2, 1):
        p = Problem(model=model, hardware=hw, budgets=budgets, micro_batch=b, seq_len=16, grad_accum=4 // b)
        steps[b] = solve(p, opts).prediction["step_time_s"]
        assert step_floor(p, offload=True).step_s <= steps[b] * (1 + 1e-9)
    assert steps[2] < steps[4] * 0.95
    best, trials = search_micro_batch(model, hw, budgets, 16, opts, global_batch=4)
    assert best.prediction["step_time_s"] == pytest.approx(min(steps.values()), rel=1e-6)


def test_the_floor_counts_the_host_optimizer_for_the_parameters_it_updates():
    # with the embedding's and head's state on the device the host optimizer updates the layers only: the
    # step floor (and Problem.lower_bound_s) must not charge it the embedding's update
    from lazytrain.planner.ceiling import step_floor
    hw = HardwareProfile(name="toy-slow-opt", achievable_tflops=1e-4, h2d_gbps=10.0, d2h_gbps=10.0,
                         nvme_read_gbps=10.0, nvme_write_gbps=10.0, host_optimizer_gparams_per_s=1e-6)
    model = ModelShape.from_layers("toy", [2000, 3000, 2500], hidden=64, vocab_size=4000, tied_embeddings=True,
                                   q_dim=16, kv_dim=16, ffn=16, saved_bytes_per_token=5 * 64 * 2)
    for where in ("host", "device"):
        p = Problem(model=model, hardware=hw, micro_batch=4, seq_len=16,
                    budgets=Budgets(gpu_bytes=10 ** 8, host_bytes=10 ** 8, gpu_reserved_bytes=0, loss_chunk_tokens=16,
                                    non_block_state=where))
        step = simulate(p, keep_all(p)[0]).step_time_s
        assert p.lower_bound_s()["bound"] <= step and step_floor(p, offload=True).step_s <= step, where
        assert p.lower_bound_s()["optimizer"] == pytest.approx(p.opt_nl + sum(p.opt_l), rel=1e-12)


def test_accumulated_micro_batches_repeat_the_windows_and_share_one_optimizer_delay():
    p1 = toy_problem(4, 5.0, host_slots=4)
    plan = keep_all(p1)[0]
    steps = {k: simulate(dataclasses.replace(p1, grad_accum=k), plan) for k in (1, 2, 5)}
    micro = steps[2].step_time_s - steps[1].step_time_s          # one more micro-batch
    # its windows and last gradients, after layer 0's weights are copied (the first one's: in the delay)
    assert 0 not in plan.resident_layers
    assert micro == pytest.approx(steps[1].micro_step_s + p1.load_l[0], rel=1e-12)
    assert steps[5].step_time_s == pytest.approx(steps[1].step_time_s + 4 * micro, rel=1e-12)
    assert steps[5].tokens_per_s == pytest.approx(5 * p1.micro_batch * p1.seq_len / steps[5].step_time_s)
    lb1, lb5 = p1.lower_bound_s(), dataclasses.replace(p1, grad_accum=5).lower_bound_s()
    assert lb5["compute"] == pytest.approx(5 * lb1["compute"]) and lb5["optimizer"] == lb1["optimizer"]
    with pytest.raises(ValueError, match="grad_accum must be an integer >= 1, got 0"):
        dataclasses.replace(p1, grad_accum=0)

def test_a_simulated_step_with_accumulation_traces_every_micro_batch():
    """The step time covers every micro-batch, then the last gradients and the update; so do the timeline (a
    trace or plot of the step), the memory over time and the compute and exposed times. The trace held the
    first micro-batch alone, with the update drawn right after it."""
    p1 = toy_problem(4, 5.0, host_slots=4)
    plan = keep_all(p1)[0]
    one, later = simulate(p1, plan), simulate(p1, plan, refresh_resident=False)
    r = simulate(dataclasses.replace(p1, grad_accum=3), plan)
    spans = lambda res, k: [(e.lane, e.label, e.window, e.end - e.start) for e in res.timeline if e.micro_batch == k]
    assert {e.micro_batch for e in r.timeline} == {0, 1, 2, None}
    assert spans(r, 0) == spans(one, 0)
    # each later micro-batch: layer 0's weights copied (the first one's came with the step before), then its windows
    load = ("h2d", "weights L0", 0, pytest.approx(p1.load_l[0], rel=1e-12))
    for k in (1, 2):
        assert spans(r, k) == [load] + [pytest.approx(s, rel=1e-9) for s in spans(later, 0)]
    start = lambda k: min(e.start for e in r.timeline if e.micro_batch == k)
    end = lambda k: max(e.end for e in r.timeline if e.micro_batch == k)
    assert (start(1), start(2)) == (pytest.approx(end(0), rel=1e-12), pytest.approx(end(1), rel=1e-12))
    assert end(0) == pytest.approx(one.micro_step_s, rel=1e-12)
    assert end(1) - start(1) == pytest.approx(p1.load_l[0] + later.micro_step_s, rel=1e-12)
    # then the last micro-batch's last gradients, the update, and the step ends where the timeline's wait does
    step_end = [(e.lane, e.label) for e in r.timeline if e.micro_batch is None]
    assert step_end == [("d2h", "grads L0 + embedding"), ("optimizer", "embedding/head")] + \
        [("optimizer", f"update L{j}") for j in range(4)] + [("wait", "optimizer exposed in the next forward")]
    tail = next(e for e in r.timeline if e.label == "grads L0 + embedding")
    assert tail.start == pytest.approx(end(2), rel=1e-12) and tail.end - tail.start == pytest.approx(p1.tail_s)
    assert max(e.end for e in r.timeline if e.lane != "optimizer") == pytest.approx(r.step_time_s, rel=1e-12)
    assert r.trace().duration == r.step_time_s       # though the overlapped update runs on into the next step
    # the memory over time, the compute and the exposed times are the whole step's too
    assert [(m["micro_batch"], m["window"]) for m in r.memory] == [(k, w) for k in range(3) for w in range(8)]
    assert r.compute_s == pytest.approx(3 * one.compute_s, rel=1e-12)
    assert sum(e.end - e.start for e in r.timeline if e.lane == "compute") == pytest.approx(r.compute_s, rel=1e-12)
    assert r.compute_s + sum(r.exposed_s.values()) == pytest.approx(r.step_time_s, rel=1e-12)
    # MegaTrain's executor: each micro-batch ends with its last gradients' copy
    mt = simulate(dataclasses.replace(p1, grad_accum=3), megatrain_plan(p1), strict=False, executor="megatrain")
    assert [e.micro_batch for e in mt.timeline if e.label == "grads L0 + embedding"] == [0, 1, 2]
    assert mt.compute_s + sum(mt.exposed_s.values()) == pytest.approx(mt.step_time_s, rel=1e-12)


class _TwoArgError(ValueError):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def _raise_unrebuildable():
    raise _TwoArgError("boom", 3)


def test_call_with_deadline_returns_raises_and_stops_an_overrun():
    import time
    from lazytrain.planner.isolate import call_with_deadline
    from lazytrain.planner.milp import PlanningError
    assert call_with_deadline(sum, [1, 2, 3], deadline_s=60) == 6
    # a function from a module this process imports through sys.path alone (the tests' folder)
    assert call_with_deadline(toy_model, 2, deadline_s=60).num_layers == 2
    with pytest.raises(ValueError, match="invalid literal"):     # the child's exception, re-raised here
        call_with_deadline(int, "x", deadline_s=60)
    with pytest.raises(PlanningError, match=r"^_TwoArgError: boom$"):   # pickles, but cannot be rebuilt
        call_with_deadline(_raise_unrebuildable, deadline_s=60)
    t0 = time.perf_counter()
    with pytest.raises(PlanningError, match=r"^the solver did not finish within 2 s \(the solver overran its time "
                                            r"limit\); stopped it\."):
        call_with_deadline(time.sleep, 120, deadline_s=2, what="the solver")
    assert time.perf_counter() - t0 < 30



def _overrun(*args, **kwargs):
    """A solver that never returns (HiGHS 1.16's root reduced-cost heuristic did so for minutes)."""
    import time
    time.sleep(600)


def test_an_isolated_solve_returns_the_plan_an_in_process_solve_returns():
    p = toy_problem(6, 1.5, host_slots=2, nvme_slots=1, hw=SLOW_HW)
    opts = MilpOptions(max_segment=6, offload_slack=12, prefetch_lead=12)
    here, there = solve(p, opts).to_dict(), solve(p, dataclasses.replace(opts, isolate=True)).to_dict()
    assert here["prediction"]["solver"]["status"] == there["prediction"]["solver"]["status"] == "optimal"
    here.pop("prediction"), there.pop("prediction")     # holds solve times
    assert here == there


def _overrun_with_the_heuristic(p, opts, **kwargs):
    """build_and_solve, except that it never returns with HiGHS's root reduced-cost heuristic on."""
    if opts.root_reduced_cost_heuristic:
        _overrun()
    return build_and_solve(p, opts, **kwargs)


def test_an_isolated_solve_that_overruns_is_solved_again_without_the_root_reduced_cost_heuristic(monkeypatch):
    from lazytrain.planner import search
    monkeypatch.setattr(search, "build_and_solve", _overrun_with_the_heuristic)
    # the overrun costs 3 s; the retry, a fresh process that imports the planner and solves a toy (0.5-1.6 s on
    # shared cores), has room to spare
    monkeypatch.setattr(search, "isolated_deadline_s", lambda opts: 3.0 if opts.root_reduced_cost_heuristic else 20.0)
    p = toy_problem(6, 1.5, host_slots=2, nvme_slots=1, hw=SLOW_HW)
    opts = MilpOptions(max_segment=6, offload_slack=12, prefetch_lead=12, time_limit_s=2, isolate=True)
    plan = solve(p, opts)
    solver = plan.prediction["solver"]
    assert solver["status"] == "optimal" and "fallback" not in plan.prediction
    assert solver["detail"].endswith("; solved again without the root reduced-cost heuristic after a first solve "
                                     "overran its time limit")
    want = build_and_solve(p, dataclasses.replace(opts, isolate=False))[0].to_dict()
    got = plan.to_dict()
    got.pop("prediction"), want.pop("prediction")
    assert got == want


def test_an_isolated_solve_that_overruns_its_limit_is_stopped_and_its_start_plan_returned(monkeypatch):
    import time
    from lazytrain.planner import search
    from lazytrain.planner.milp import isolated_deadline_s
    monkeypatch.setattr(search, "build_and_solve", _overrun)   # pickled by name: the child runs it too
    p = toy_problem(6, 8.0, host_slots=6, hw=SLOW_HW)       # every boundary fits on the GPU: keep-all fits
    opts = MilpOptions(time_limit_s=0.1, isolate=True)
    assert isolated_deadline_s(opts) == 10.125
    monkeypatch.setattr(search, "isolated_deadline_s", lambda opts: 2.0)   # the suite's time: two attempts of 2 s
    start = keep_all(p)[0]
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match=r"^lazytrain planner: the MILP solver did not finish within 2 s \(the "
                                         r"solver overran its time limit\); stopped it; using the plan it started "
                                         r"from instead, 'keep-all-hbm' \(predicted step"):
        plan = solve(p, opts)
    assert time.perf_counter() - t0 < 60
    assert plan.prediction["solver"]["status"] == "no plan in time, fell back to keep-all-hbm"
    assert plan.prediction["fallback"] == "keep-all-hbm"
    got, want = plan.to_dict(), start.to_dict()
    got.pop("prediction"), want.pop("prediction")
    assert got == want


def test_the_root_reduced_cost_heuristic_runs_unless_the_options_turn_it_off():
    from lazytrain.planner.milp import _solver
    name, solver = _solver(MilpOptions(), start={})
    if name != "highs":
        pytest.skip("HiGHS is not installed")
    assert "mip_heuristic_run_root_reduced_cost" not in solver.optionsDict   # HiGHS's default: on
    _, solver = _solver(MilpOptions(root_reduced_cost_heuristic=False), start={})
    assert solver.optionsDict["mip_heuristic_run_root_reduced_cost"] is False


# ---- CLI, plot, purity ------------------------------------------------------------------------------
def test_cli_plan_prints_the_comparison_and_writes_the_plan(tmp_path, capsys):
    from lazytrain.cli import main
    out_json = tmp_path / "plan.json"
    rc = main(["plan", "--model", "qwen2.5-3b", "--hardware", "rtx3090", "--micro-batch", "8", "--seq", "1024",
               "--gpu-mem", "24GiB", "--host-mem", "60.4GB", "--nvme", "400MB", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    # the budgets as given (whole gigabytes showed a 400 MB NVMe budget as "NVMe 0 GB")
    assert out.startswith("qwen2.5-3b on rtx3090: micro-batch 8 x seq 1024, budgets GPU 25.77 GB, host 60.40 GB, "
                          "NVMe 400.00 MB; step lower bound ")
    for row in ("lazytrain (milp)", "megatrain (k=4, serial opt)", "best-interval", "keep-all", "greedy"):
        assert row in out
    import re
    cells = lambda start: re.split(r"\s{2,}", next(ln for ln in out.splitlines() if ln.startswith(start)).strip())
    header = cells("policy")
    assert header[header.index("recomputed") + 1: header.index("recomputed") + 3] == ["selective", "offloaded"]
    plan = Plan.from_json(str(out_json))
    assert cells("lazytrain (milp)")[header.index("selective")] == str(len(plan.selective_layers))
    assert cells("lazytrain (milp)")[header.index("offloaded")] == str(len(plan.offloaded_layers))
    assert Plan.from_json(str(out_json)).num_layers == 36


def test_cli_reports_an_infeasible_budget(capsys):
    from lazytrain.cli import main
    rc = main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "8", "--gpu-mem", "70GB",
               "--host-mem", "50GB"])
    assert rc == 2 and "host memory budget 50.00 GB" in capsys.readouterr().err


def test_cli_plans_a_lora_run_that_full_fine_tuning_could_not_fit(capsys, tmp_path):
    """--trainable-share: the host that cannot hold a 7B model's full optimizer state holds a LoRA run's."""
    from lazytrain.cli import main
    args = ["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "8", "--gpu-mem", "70GB",
            "--host-mem", "50GB"]
    assert main(args + ["--trainable-share", "0.01", "--json", str(tmp_path / "lora.json")]) == 0
    assert Plan.from_json(str(tmp_path / "lora.json")).num_layers == 28
    capsys.readouterr()
    with pytest.raises(SystemExit):   # named by its flag (it was "Budgets field 'trainable_share'")
        main(args + ["--trainable-share", "1.5"])
    assert "argument --trainable-share: must be a fraction in [0, 1], got '1.5'" in capsys.readouterr().err


def test_cli_checks_its_arguments_and_output_paths_before_solving(tmp_path, capsys):
    from lazytrain.cli import main
    missing = tmp_path / "no" / "p.json"
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "8",
                 "--json", str(missing)]) == 2
    assert capsys.readouterr().err == f"lazytrain plan: --json {missing}: {missing.parent} does not exist\n"
    (tmp_path / "file").write_text("")
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "8",
                 "--json", str(tmp_path / "file" / "p.json")]) == 2
    assert capsys.readouterr().err == f"lazytrain plan: --json {tmp_path / 'file' / 'p.json'}: {tmp_path / 'file'} is not a directory\n"
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "8",
                 "--json", str(tmp_path)]) == 2   # a directory: refused before solving too, not after
    assert capsys.readouterr().err == f"lazytrain plan: --json {tmp_path} is a directory; give a file name\n"
    # judged of the file the write replaces (files.py): a FIFO, and a symlink's target in a folder that is missing
    # (each was found only after the solve, the FIFO's reason printed as "None")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "latest.json"
    dangling.symlink_to(tmp_path / "runs" / "p.json")
    for path, says in ((fifo, f"--json {fifo} is not a regular file; give the name of a file to write"),
                       (dangling, f"--json {dangling}: {tmp_path / 'runs'} does not exist")):
        assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "8",
                     "--json", str(path)]) == 2
        assert capsys.readouterr().err == f"lazytrain plan: {says}\n"
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", "--micro-batch", "abc"]) == 2
    assert "--micro-batch must be a whole number or 'auto', got 'abc'" in capsys.readouterr().err
    for flag, kind in (("--time-limit", "number"), ("--seq", "integer"), ("--max-segment", "integer")):
        with pytest.raises(SystemExit):
            main(["plan", "--model", "qwen2.5-7b", "--hardware", "h800", flag, "-1"])
        assert f"argument {flag}: must be a positive {kind}, got '-1'" in capsys.readouterr().err

def test_cli_refuses_a_plot_file_of_no_known_format_before_solving(tmp_path, capsys):
    """matplotlib refused the extension only once the plan was solved, with a ValueError traceback."""
    from lazytrain.cli import main
    from lazytrain.planner.plot import plot_step
    known = ".png, .svg, .svgz, .pdf, .eps, .ps, .jpg, .jpeg, .tif, .tiff"
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "8"]
    for name, why in (("g.xyz", f"'.xyz' is not a plot format (use {known})"),
                      ("g", f"no extension to tell the plot format (use {known})")):
        assert main(args + ["--plot", str(tmp_path / name)]) == 2
        assert capsys.readouterr() == ("", f"lazytrain plan: --plot {tmp_path / name}: {why}\n")
    with pytest.raises(ValueError) as e:
        plot_step(simulate(toy_problem(2, 4.0), every_k_plan(2, 1)), str(tmp_path / "g.xyz"))
    assert str(e.value) == f"{tmp_path / 'g.xyz'}: '.xyz' is not a plot format (use {known})"
    assert not os.listdir(tmp_path)
    # one file for both: the plot replaced the plan, and both were said written
    os.symlink(tmp_path / "plan.png", tmp_path / "link.png")
    assert main(args + ["--json", str(tmp_path / "plan.png"), "--plot", str(tmp_path / "link.png")]) == 2
    assert capsys.readouterr().err == (f"lazytrain plan: --json {tmp_path / 'plan.png'} and --plot "
                                       f"{tmp_path / 'link.png'} are one file: the plot would replace the plan; "
                                       f"give two names\n")


def test_cli_refuses_an_output_path_its_folder_takes_no_file_at_before_solving(tmp_path, capsys):
    """The check looked at the folder alone: a path whose file cannot be created there (/proc/x.json; here a
    directory holds the temporary name the write renames) printed the table after the solve, then failed."""
    from lazytrain.cli import main
    from lazytrain.files import partial_name
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "8", "--time-limit", "2"]
    for flag, name in (("--json", "p.json"), ("--plot", "p.png")):
        path = tmp_path / name
        os.mkdir(partial_name(str(path)))
        assert main(args + [flag, str(path)]) == 2
        assert capsys.readouterr() == ("", f"lazytrain plan: {flag} {path} cannot be written: its temporary file "
                                           f"{partial_name(str(path))} cannot be created (Is a directory); the "
                                           f"file is written there, then renamed over the path\n")


def test_cli_asks_for_matplotlib_before_solving(tmp_path, capsys, monkeypatch):
    """A missing matplotlib was found once the plan was solved (and its JSON written)."""
    from lazytrain.cli import main
    from lazytrain.planner import plot

    def missing():
        raise ImportError("plotting needs matplotlib: pip install lazytrain[plot]")
    monkeypatch.setattr(plot, "pyplot", missing)
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "8",
                 "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]) == 3
    assert capsys.readouterr() == ("", "lazytrain plan: --plot: plotting needs matplotlib: pip install "
                                       "lazytrain[plot]\n")
    assert not os.listdir(tmp_path)


def test_a_plot_that_cannot_be_written_leaves_the_old_one(tmp_path):
    """savefig wrote the path itself: a failed write left a part of the new image over the old one."""
    pytest.importorskip("matplotlib")
    from lazytrain.files import partial_name
    from lazytrain.planner.plot import plot_step
    path = tmp_path / "g.png"
    path.write_bytes(b"old plot")
    os.mkdir(partial_name(str(path)))
    with pytest.raises(OSError):
        plot_step(simulate(toy_problem(2, 4.0), every_k_plan(2, 1)), str(path))
    assert path.read_bytes() == b"old plot"
    os.rmdir(partial_name(str(path)))
    plot_step(simulate(toy_problem(2, 4.0), every_k_plan(2, 1)), str(path))
    assert path.read_bytes().startswith(b"\x89PNG") and sorted(os.listdir(tmp_path)) == ["g.png"]


def test_cli_plot_title_names_the_accumulated_micro_batches(tmp_path, monkeypatch):
    from lazytrain.cli import main
    from lazytrain.planner import plot
    titles = []
    monkeypatch.setattr(plot, "plot_step", lambda sim, path, title="": titles.append(title))
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "4", "--global-batch",
                 "8", "--time-limit", "2", "--plot", str(tmp_path / "p.png")]) == 0
    assert titles == ["qwen2.5-3b on h800, micro-batch 4 x 2 accumulated"]


def test_cli_refuses_an_output_file_that_is_one_of_its_inputs(tmp_path, capsys):
    """--json naming the --model config.json replaced the model's config with the plan (rc 0)."""
    from lazytrain.cli import main
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    hardware = tmp_path / "machine.json"
    hardware.write_text("{}")
    before = {p: p.read_text() for p in (model, hardware)}
    for flag, path, source in (("--json", model, "--model"), ("--plot", tmp_path / "m.png", "--hardware"),
                               ("--json", hardware, "--hardware")):
        if path.suffix == ".png":
            os.symlink(hardware, path)
        assert main(["plan", "--model", str(model), "--hardware", str(hardware), flag, str(path)]) == 2
        assert capsys.readouterr().err == (f"lazytrain plan: {flag} {path} is the {source} file this command "
                                           f"reads: the output would replace it; give another file name\n")
    assert {p: p.read_text() for p in (model, hardware)} == before


def test_plot_formats_are_those_matplotlib_writes():
    pytest.importorskip("matplotlib")
    from matplotlib.backend_bases import FigureCanvasBase
    from lazytrain.planner.plot import FORMATS, unsupported_format
    assert set(FORMATS) <= set(FigureCanvasBase.get_supported_filetypes())
    assert unsupported_format("out/Step.PNG") is None and unsupported_format("a.b/step.svg") is None


@pytest.mark.parametrize("flags, message", [
    (["--gpu-mem", "lots"], "--gpu-mem: cannot read 'lots' as a size (examples: 1073741824, '64GB', '512MiB')"),
    (["--host-mem=-5GB"], "--host-mem must be >= 0, got '-5GB'"),
    (["--nvme", "2EB"], "--nvme: cannot read '2EB' as a size (examples: 1073741824, '64GB', '512MiB')"),
    (["--nvme", "2e18"], "NVMe budget 2000000000000000000 bytes is not a memory size (0 to 2**60, 1 EiB): check "
                         "--nvme or lazytrain.nvme_memory"),
])
def test_cli_size_errors_name_their_flag(flags, message, capsys):
    """A size that is none said "size: cannot read ...", naming no flag."""
    from lazytrain.cli import main
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--micro-batch", "8"] + flags) == 2
    assert capsys.readouterr() == ("", f"lazytrain plan: {message}\n")


def test_plan_for_size_errors_name_the_budgets_key():
    with pytest.raises(ValueError) as e:
        plan_for(toy_model(2), TOY_HW, {"gpu": "1GB", "host": "many"}, micro_batch=1)
    assert str(e.value) == "budgets['host']: cannot read 'many' as a size (examples: 1073741824, '64GB', '512MiB')"
    with pytest.raises(InfeasibleBudgetError) as e:
        plan_for(toy_model(2), TOY_HW, {"gpu": "1GB", "host": "1GB", "nvme": 2 ** 61}, micro_batch=1)
    assert str(e.value) == (f"NVMe budget {2 ** 61} bytes is not a memory size (0 to 2**60, 1 EiB): check --nvme or "
                            f"lazytrain.nvme_memory")


def test_cli_hardware_file_with_gaps_and_base(tmp_path, capsys):
    from lazytrain.cli import main
    d = {k: None for k in CATALOG["rtx3090"].to_dict()}
    d.update(name="measured-3090", h2d_gbps=20.0, d2h_gbps=21.0, gpu_mem_bytes=24 * 2 ** 30)
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(d))
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", str(hw), "--micro-batch", "4", "--gpu-mem", "24GiB"]
    assert main(args) == 2
    assert "'achievable_tflops'" in capsys.readouterr().err
    assert main(args + ["--base", "rtx3090"]) == 0
    assert "measured-3090+rtx3090" in capsys.readouterr().out


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    from lazytrain.planner.plot import plot_step
    p = toy_problem(4, 1.5, host_slots=1)
    plan, _ = build_and_solve(p, MilpOptions(max_segment=4))
    path = plot_step(simulate(p, plan), str(tmp_path / "g.png"))
    assert os.path.getsize(path) > 1000


def test_every_kind_of_span_the_simulator_draws_has_a_colour_and_a_legend_entry():
    """Graph layers' backward ("bwd") and the MegaTrain host phase fell back to the weights' grey, with no
    legend entry; the legend now lists the kinds drawn, each with its own colour."""
    from lazytrain.planner.plot import COLORS
    from lazytrain.planner.policies import megatrain_plan
    p = make_problem("qwen2.5-3b", "h800", micro_batch=8, seq_len=512)
    kinds = set()
    for plan, executor in ((every_k_plan(p.L, 4, last_segment_graph=True), "lazytrain"),
                           (megatrain_plan(p, 4), "megatrain")):
        kinds |= {ev.label.split()[0] for ev in simulate(p, plan, strict=False, executor=executor).timeline}
    assert {"bwd", "fwd", "recompute", "optimizer", "clip_grad_norm_", "refresh"} <= kinds
    assert kinds <= set(COLORS)
    assert len(set(COLORS.values())) == len(COLORS)


def test_planner_never_imports_torch():
    code = ("import sys, types; pkg = types.ModuleType('lazytrain'); pkg.__path__ = [%r]; "
            "sys.modules['lazytrain'] = pkg; import lazytrain.planner.search, lazytrain.planner.cli, "
            "lazytrain.planner.report, lazytrain.planner.policies; assert 'torch' not in sys.modules, 'torch'"
            % os.path.join(ROOT, "lazytrain"))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("text,message", [
    ('{"name": "x", "achievable_tflops": NaN}', "field 'achievable_tflops' must be a finite number >= 0, got nan"),
    ('{"name": "x", "h2d_gbps": Infinity}', "field 'h2d_gbps' must be a finite number >= 0, got inf"),
    ('{"name": "x", "gpu_mem_bytes": 1e30}', r"field 'gpu_mem_bytes' must be a whole byte count between 0 and "
                                             r"2\*\*60 \(1 EiB\), got 1e\+30"),
    ('{"name": "x", "gpu_mem_bytes": 0.5}', r"field 'gpu_mem_bytes' must be a whole byte count between 0 and "
                                            r"2\*\*60 \(1 EiB\), got 0.5$"),
])
def test_a_hardware_profile_with_numbers_no_machine_has_is_named(tmp_path, text, message):
    """JSON allows NaN and Infinity; a profile carrying them (or an absurd size) is refused before the
    solver sees it (it raised inside PuLP, or an IndexError reading HiGHS' solution)."""
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(HardwareError, match=message):
        load_profile(str(path))


def test_a_budget_that_is_no_memory_size_is_named():
    from lazytrain.planner.problem import Budgets, InfeasibleBudgetError, make_problem
    hw = HardwareProfile("x", achievable_tflops=100, h2d_gbps=12, d2h_gbps=12, host_optimizer_gparams_per_s=10,
                         host_mem_bytes=10**12)
    with pytest.raises(InfeasibleBudgetError, match=r"GPU budget 1e\+30 bytes is not a memory size"):
        make_problem("qwen2.5-7b", hw, 4, 1024, Budgets(gpu_bytes=1e30))


def test_a_rank_holding_a_share_of_the_optimizer_state_is_budgeted_for_that_share():
    whole = make_problem("qwen2.5-7b", "h800", 4, 1024, Budgets.of(gpu="70GB", host="400GB"))
    quarter = make_problem("qwen2.5-7b", "h800", 4, 1024, Budgets.of(gpu="70GB", host="400GB",
                                                                        optimizer_state_share=0.25))
    weights_and_grads = 4 + 2 + 4             # fp32 master, bf16 streamed copy, fp32 gradients: whole on every rank
    moments = whole.host_bytes_per_param - weights_and_grads
    assert quarter.host_bytes_per_param == pytest.approx(weights_and_grads + moments / 4)
    assert quarter.host_act_budget > whole.host_act_budget
    with pytest.raises(ValueError, match=r"Budgets field 'optimizer_state_share' must be a fraction in \(0, 1\], got 0"):
        make_problem("qwen2.5-7b", "h800", 4, 1024, Budgets.of(gpu="70GB", optimizer_state_share=0))


def test_a_rank_holding_shares_of_the_weights_and_gradients_is_budgeted_for_them():
    """Sharded bf16 at stage 2 on a node of 4 ranks: a quarter of the fp32 masters, gradients and moments,
    and a quarter of the node's one streamed copy."""
    whole = make_problem("qwen2.5-7b", "h800", 4, 1024, Budgets.of(gpu="70GB", host="400GB"))
    shared = make_problem("qwen2.5-7b", "h800", 4, 1024, Budgets.of(
        gpu="70GB", host="400GB", optimizer_state_share=0.25, master_share=0.25, gradient_share=0.25,
        weights_copy_share=0.25))
    assert shared.host_bytes_per_param == pytest.approx(whole.host_bytes_per_param / 4)
    with pytest.raises(ValueError, match=r"Budgets field 'weights_copy_share' must be a fraction in \(0, 1\], got 1.5"):
        make_problem("qwen2.5-7b", "h800", 4, 1024, Budgets.of(gpu="70GB", weights_copy_share=1.5))


def test_a_lora_run_is_budgeted_for_its_frozen_layer_weights_as_the_streamed_copy_alone():
    """Budgets.trainable_share: of a layer's parameters only the trainable share has an fp32 master, a
    gradient buffer, moments, an update and gradients on the link; the others hold their bf16 copy alone.
    The embedding and head keep the whole count."""
    model = catalog_model("qwen2.5-7b")
    whole, lora = (Problem(model=model, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024,
                           budgets=Budgets.of(gpu="70GB", host="400GB", trainable_share=share)) for share in (1.0, 0.01))
    per_trainable = whole.host_bytes_per_param - 2   # all but the bf16 streamed copy
    assert lora.host_bytes_per_layer_param == pytest.approx(2 + 0.01 * per_trainable)
    assert lora.host_static == int(model.layer_params * lora.host_bytes_per_layer_param
                                   + model.nonlayer_params * whole.host_bytes_per_nonlayer_param)
    assert whole.host_static == int(model.layer_params * whole.host_bytes_per_param
                                    + model.nonlayer_params * whole.host_bytes_per_nonlayer_param)
    # bf16: an fp32 master, a bf16 copy, an fp32 gradient buffer and moments (2% of them 8-bit); outside the
    # layers no copy (it is on the device)
    assert whole.host_bytes_per_param == pytest.approx(4 + 2 + 4 + 0.98 * 8 + 0.02 * (2 + 8 / 256))
    assert whole.host_bytes_per_nonlayer_param == pytest.approx(whole.host_bytes_per_param - 2)
    assert lora.Gl == pytest.approx([g * 0.01 for g in whole.Gl])
    assert lora.opt_l == pytest.approx([o * 0.01 for o in whole.opt_l])
    assert lora.Wl == whole.Wl   # every weight still streams
    # a host too small for full fine-tuning holds the LoRA run
    small = Budgets.of(gpu="70GB", host="40GB")
    with pytest.raises(InfeasibleBudgetError, match=r"cannot hold the optimizer state: 6\.53B layer parameters x "
                                                     r"17\.88 bytes \+ 1\.09B others trained x 15\.88 bytes"):
        Problem(model=model, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024, budgets=small)
    Problem(model=model, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024,
            budgets=dataclasses.replace(small, trainable_share=0.01))
    with pytest.raises(ValueError, match=r"Budgets field 'trainable_share' must be a fraction in \[0, 1\], got 2"):
        Budgets.of(gpu="70GB", trainable_share=2)


def test_a_frozen_embedding_and_head_are_budgeted_as_their_device_copy_alone():
    """Budgets.non_block_trainable_share: a frozen parameter outside the layers (a LoRA run's embedding and
    head) has no host master, gradient or moments, no update, no gradient or weight copy on the links, and on
    the device its compute copy alone (no gradient beside it)."""
    model = catalog_model("qwen2.5-7b")
    kw = dict(model=model, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024)
    whole, lora, half = (Problem(**kw, budgets=Budgets.of(gpu="70GB", host="400GB", trainable_share=0.01,
                                                          non_block_trainable_share=s)) for s in (1.0, 0.0, 0.5))
    nonlayer_w = model.nonlayer_params * 2
    assert lora.host_static == int(model.layer_params * lora.host_bytes_per_layer_param)
    assert whole.host_static == int(model.layer_params * lora.host_bytes_per_layer_param
                                    + model.nonlayer_params * whole.host_bytes_per_nonlayer_param)
    assert (lora.opt_nl, lora.nonlayer_link_bytes, lora.load_nl, lora.embed_grad_bytes, lora.head_grad_bytes) == \
        (0, 0, 0, 0, 0)
    assert lora.gpu_static == whole.gpu_static - nonlayer_w   # the gradients of the embedding and head go
    assert half.embed_grad_bytes == model.vocab_size * model.hidden * 2 * 0.5
    assert half.nonlayer_link_bytes == nonlayer_w * 0.5 and half.opt_nl == pytest.approx(whole.opt_nl / 2)
    lb_lora, lb_whole = lora.lower_bound_s(), whole.lower_bound_s()
    assert lb_lora["optimizer"] == pytest.approx(lb_whole["optimizer"] - whole.opt_nl)
    assert lb_lora["h2d"] == pytest.approx(lb_whole["h2d"] - nonlayer_w / whole.bw_h2d)
    # with their state on the device, a frozen one holds no fp32 state there either
    dev = [Problem(**kw, budgets=Budgets.of(gpu="70GB", host="400GB", non_block_state="device",
                                            non_block_trainable_share=s)) for s in (1.0, 0.0)]
    assert dev[1].gpu_static == dev[0].gpu_static - nonlayer_w - model.nonlayer_params * 16
    # a host that holds the LoRA run's layers only when the embedding and head are frozen
    need = lora.host_static
    tight = Budgets.of(gpu="70GB", host=str(need + 2 ** 30), trainable_share=0.01)
    with pytest.raises(InfeasibleBudgetError, match=r"6\.53B layer parameters x 2\.16 bytes \+ 1\.09B others trained "
                                                     r"x 15\.88 bytes"):
        Problem(**kw, budgets=tight)
    assert Problem(**kw, budgets=dataclasses.replace(tight, non_block_trainable_share=0.0)).host_static == need
    with pytest.raises(ValueError, match=r"Budgets field 'non_block_trainable_share' must be a fraction in \[0, 1\], "
                                         r"got -0\.5"):
        Budgets.of(gpu="70GB", non_block_trainable_share=-0.5)
    # solved and simulated alike with the frozen embedding and head
    plan = plan_for("qwen2.5-7b", "h800", Budgets.of(gpu="70GB", host="400GB", trainable_share=0.01,
                                                      non_block_trainable_share=0.0), micro_batch=8, seq_len=1024,
                    time_limit_s=20)
    assert simulate(lora, plan).step_time_s == pytest.approx(plan.prediction["step_time_s"], rel=1e-9)
    assert plan.prediction["step_time_s"] >= plan.prediction["lower_bound_s"]


def test_the_engine_budgets_what_a_sharded_rank_holds(monkeypatch):
    from lazytrain.config import parse_config
    import torch
    from lazytrain.engine.placement import _host_shares
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg = parse_config({**base, "train_batch_size": 8, "bf16": {"enabled": True},
                        "zero_optimization": {"stage": 2}}, world_size=8)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    # bf16: the non-block fp32 masters live on their owners; every rank accumulates their gradients until the step
    assert _host_shares(cfg, cpu) == {"optimizer_state_share": 0.125, "master_share": 0.125, "gradient_share": 0.125,
                                      "non_block_master_share": 0.125, "non_block_gradient_share": 1.0,
                                      "weights_copy_share": 0.25}
    cfg = parse_config({**base, "train_batch_size": 8, "zero_optimization": {"stage": 1}}, world_size=8)
    # fp32 on the CPU: a non-block parameter is its own master, which every rank computes with
    assert _host_shares(cfg, cpu) == {"optimizer_state_share": 0.125, "master_share": 1.0, "gradient_share": 1.0,
                                      "non_block_master_share": 1.0, "non_block_gradient_share": 1.0,
                                      "weights_copy_share": 0.25}
    # fp32 beside a GPU: the masters are on the host, apart from the device copies
    assert _host_shares(cfg, gpu)["non_block_master_share"] == 0.125
    # stage 3 partitions the parameters outside the layers: their fp32 masters and gradients too
    cfg = parse_config({**base, "train_batch_size": 8, "zero_optimization": {"stage": 3}}, world_size=8)
    assert _host_shares(cfg, cpu) == {"optimizer_state_share": 0.125, "master_share": 1.0, "gradient_share": 0.125,
                                      "non_block_master_share": 0.125, "non_block_gradient_share": 0.125,
                                      "weights_copy_share": 0.25}
    cfg = parse_config({**base, "train_batch_size": 8, "zero_optimization": {"stage": 0}}, world_size=8)
    assert _host_shares(cfg, cpu) == {}

@pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")
def test_a_plan_file_that_contradicts_weights_home_or_last_segment_graph_is_refused_naming_the_keys(tmp_path):
    """weights_home "hbm" was ignored under a streaming Plan file; last_segment_graph true over a plan with a
    selective layer in the would-be tail gave a bare PlanError naming no config key."""
    from lazytrain.config import ConfigError, parse_config
    import torch
    from lazytrain.engine.placement import build_plan, build_tiers
    path = str(tmp_path / "plan.json")
    every_k_plan(6, 2, home="host", resident_layers=(0, 1, 4)).to_json(path)
    base = {"train_micro_batch_size_per_gpu": 1, "lazytrain": {"device": "cpu", "policy": "plan", "plan": path}}

    def plan_of(**lt):
        cfg = parse_config({**base, "lazytrain": {**base["lazytrain"], **lt}})
        return build_plan(cfg, 6, build_tiers(cfg, torch.device("cpu")), None, 1)
    with pytest.raises(ConfigError) as e:
        plan_of(weights_home="hbm")
    assert str(e.value) == (f"config 'lazytrain.weights_home' \"hbm\" keeps every layer resident, but 'lazytrain.plan' "
                            f"({path}) streams layers 2-3, 5: set 'weights_home' to \"host\" or \"nvme\" to run the "
                            f"plan, or plan with every layer resident")
    every_k_plan(6, 2, home="host", resident_layers=tuple(range(6))).to_json(path)
    assert plan_of(weights_home="hbm").resident_layers == tuple(range(6))
    Plan(num_layers=6, homes=("host", "recompute", "host", "recompute", "host", "recompute", "hbm"),
         selective_layers=(4,), last_segment_graph=False).to_json(path)
    assert plan_of().selective_layers == (4,)
    with pytest.raises(ConfigError, match=r"^config 'lazytrain.last_segment_graph' true does not fit the 'custom' "
                                          r"plan: selective_layers holds 4: .*; leave the key \"auto\" to run the "
                                          r"plan as it is$"):
        plan_of(last_segment_graph=True)


@pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")
def test_policy_milp_plans_without_a_graph_tail_when_the_config_turns_it_off(monkeypatch):
    """The MILP planned a graph tail (its prediction counting no re-runs there) that the engine then turned off."""
    from lazytrain.config import parse_config
    import torch
    from lazytrain.engine import placement
    from engine_models import make_model
    solved = []
    policy_plan = placement._policy_plan
    monkeypatch.setattr(placement, "_policy_plan", lambda *a: solved.append(policy_plan(*a)) or solved[-1])
    model_config = make_model("llama").config.to_dict()
    for choice in (False, True):
        cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "lazytrain": {
            "device": "cpu", "policy": "milp", "hardware": "h200", "seq_len": 12, "milp_time_limit": 5,
            "last_segment_graph": choice, "capacities": {"hbm": "2MB"}}})
        plan = placement.build_plan(cfg, 6, placement.build_tiers(cfg, torch.device("cpu")), model_config, 2)
        assert solved[-1].last_segment_graph is plan.last_segment_graph is choice
        assert plan.recomputed_layers() == solved[-1].recomputed_layers()


def test_plan_window_keys_that_are_not_integers_and_a_file_that_is_not_utf8_are_plan_errors(tmp_path):
    d = every_k_plan(4, 2, home="host").to_dict()
    for key in ("--2", "\u00b2", "1\u2082"):
        with pytest.raises(PlanError, match=r"offload_window"):
            Plan.from_dict({**d, "offload_window": {key: 3}})
        with pytest.raises(PlanError, match=r"offload_window"):
            Plan.from_json(json.dumps({**d, "offload_window": {key: 3}}))
    path = tmp_path / "plan.json"
    path.write_bytes(b'{"num_layers": 2, "homes": ["hbm", "\xff", "hbm"]}')
    with pytest.raises(PlanError, match=rf"^Plan file {path} is not UTF-8 JSON: "):
        Plan.from_json(str(path))


@pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")
def test_a_plan_file_on_nvme_without_an_nvme_path_is_refused_naming_the_keys(tmp_path):
    """The executor refused it only once the engine had set up the weights, naming neither key."""
    from lazytrain.config import ConfigError, parse_config
    import torch
    from lazytrain.engine.placement import build_plan, build_tiers
    path = str(tmp_path / "plan.json")
    Plan(num_layers=4, homes=("hbm", "nvme", "recompute", "nvme", "hbm")).to_json(path)
    base = {"train_micro_batch_size_per_gpu": 1, "lazytrain": {"device": "cpu", "policy": "plan", "plan": path}}
    cfg = parse_config(base)
    tiers = build_tiers(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, 4, tiers, None, 1)
    assert str(e.value) == (f"config 'lazytrain.plan' ({path}) puts boundary 1 and 1 more on tier 'nvme', which is "
                            f"not configured (configured: hbm, host); the NVMe tier exists when 'lazytrain.nvme_path' "
                            f"names a directory on the drive; or plan again without NVMe (`lazytrain plan --nvme 0`)")
    cfg = parse_config({**base, "lazytrain": {"device": "cpu", "boundary_home": "nvme"}})
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, 4, build_tiers(cfg, torch.device("cpu")), None, 1)
    assert str(e.value) == ("config 'lazytrain.boundary_home' is 'nvme', which is not a configured tier (configured: "
                            "hbm, host); the NVMe tier exists when 'lazytrain.nvme_path' names a directory on the "
                            "drive")
    cfg = parse_config({**base, "lazytrain": {**base["lazytrain"], "nvme_path": str(tmp_path)}})
    assert build_plan(cfg, 4, build_tiers(cfg, torch.device("cpu")), None, 1).homes[1] == "nvme"


def test_embedding_and_head_gradients_leave_beside_the_windows_on_lazytrain_and_after_them_on_megatrain():
    """LazyTrain's engine copies the head's gradients during the first GRAD_SHARE_WINDOWS backward windows and
    an earlier micro-batch's last ones during the next one's first forward windows: the step waits only for
    the last micro-batch's layer-0 and embedding gradients. MegaTrain's executor copies its head slab (the
    untied head's and the final norm's) on its gradient stream after the loss's backward, beside its first
    backward windows, and layer 0's and the embedding's at the end of each micro-batch's backward."""
    from lazytrain.planner.policies import megatrain_plan
    from lazytrain.planner.problem import GRAD_SHARE_WINDOWS
    model = catalog_model("qwen2.5-7b")
    p1 = Problem(model=model, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024, budgets=Budgets.of(gpu="70GB"))
    L, n = p1.L, GRAD_SHARE_WINDOWS
    plan = every_k_plan(L, 4)
    r = simulate(p1, plan)
    shares = [e for e in r.timeline if e.label == "grads embedding/head"]
    assert [e.window for e in shares] == list(range(L, L + n))
    assert all(e.end - e.start == pytest.approx(p1.head_grad_bytes / n / p1.bw_d2h, rel=1e-9) for e in shares)
    tail = [e for e in r.timeline if e.label == "grads L0 + embedding"]
    assert len(tail) == 1 and tail[0].end - tail[0].start == pytest.approx(p1.tail_s, rel=1e-12)
    assert p1.tail_s == pytest.approx((p1.Gl[0] + p1.embed_grad_bytes) / p1.bw_d2h, rel=1e-12)
    # a later micro-batch: the micro-batch before's last gradients in its first forward windows
    later = simulate(p1, plan, refresh_resident=False)
    carried = [e for e in later.timeline if e.label == "grads L0 + embedding of the micro-batch before"]
    assert [e.window for e in carried] == list(range(n))
    assert sum(e.end - e.start for e in carried) == pytest.approx(p1.carry_bytes / p1.bw_d2h, rel=1e-9)
    p3 = dataclasses.replace(p1, grad_accum=3)
    step3 = simulate(p3, plan).step_time_s
    assert step3 - r.step_time_s == pytest.approx(2 * (later.micro_step_s + p1.load_l[0]), rel=1e-12)
    # MegaTrain's executor: its head slab beside its first backward windows, none of a micro-batch before
    mt = simulate(p1, megatrain_plan(p1), executor="megatrain")
    assert not [e for e in mt.timeline if e.label.startswith("grads embedding") or "micro-batch before" in e.label]
    head = [e for e in mt.timeline if e.label == "grads head/norm"]
    emb = model.vocab_size * model.hidden * 2
    assert [e.window for e in head] == list(range(L, L + n)) and sum(e.nbytes for e in head) == pytest.approx(
        (model.nonlayer_params * 2 - emb), rel=1e-12)
    ends = [e for e in mt.timeline if e.label == "grads L0 + embedding"]
    assert len(ends) == 1 and ends[0].end - ends[0].start == pytest.approx((p1.Gl[0] + emb) / p1.bw_d2h, rel=1e-12)
    assert mt.micro_step_s == pytest.approx(sum(mt.window_s) + ends[0].end - ends[0].start, rel=1e-12)


def test_non_block_state_on_the_device_takes_gpu_memory_and_crosses_no_link():
    """Budgets.non_block_state: the embedding's and head's fp32 master, gradient and moments (16 bytes a
    parameter) on the GPU, updated there, or on the host (the default), updated first by the host optimizer,
    their gradients sent each micro-batch and their weights copied back once a step."""
    from lazytrain.planner.problem import NON_BLOCK_DEVICE_STATE_BYTES
    model = catalog_model("qwen2.5-7b")
    host, dev = (Problem(model=model, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024,
                         budgets=Budgets.of(gpu="70GB", non_block_state=where)) for where in ("host", "device"))
    n = model.nonlayer_params
    assert NON_BLOCK_DEVICE_STATE_BYTES == 16
    assert dev.gpu_static - host.gpu_static == 16 * n
    assert host.host_static - dev.host_static == pytest.approx(n * host.host_bytes_per_nonlayer_param, abs=1)
    # the embedding's gradient leaves after layer 0's, the head's and final norm's during the first backward windows
    embedding = model.vocab_size * model.hidden * model.dtype_bytes
    assert host.embed_grad_bytes == embedding and host.head_grad_bytes == host.nonlayer_w - embedding > embedding
    assert dev.embed_grad_bytes == dev.head_grad_bytes == 0
    assert host.tail_s - dev.tail_s == pytest.approx(embedding / host.bw_d2h, rel=1e-12)
    assert host.carry_bytes - dev.carry_bytes == embedding
    assert host.load_nl == pytest.approx(host.nonlayer_w / host.bw_h2d) and dev.load_nl == 0
    assert host.opt_nl == pytest.approx(n / host.opt_rate) and dev.opt_nl == 0
    assert host.lower_bound_s()["d2h"] > dev.lower_bound_s()["d2h"]
    fp32 = dataclasses.replace(model, dtype_bytes=4)
    host32, dev32 = (Problem(model=fp32, hardware=CATALOG["h800"], micro_batch=8, seq_len=1024,
                             budgets=Budgets.of(gpu="70GB", non_block_state=where)) for where in ("host", "device"))
    assert dev32.gpu_static - host32.gpu_static == 8 * n   # the parameter is its own master: its moments only


# ---- inputs refused by name before they reach the solver or a Plan --------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("h2d_gbps", 1e-16, "hardware profile field 'h2d_gbps' must be 0 (unknown) or between 1e-06 and 100000 "
                        "GB/s, got 1e-16"),
    # the step floor's LP failed with PuLP's IndexError (HiGHS drops a coefficient of 1e15 bytes/s or more)
    ("d2h_gbps", 1e6, "hardware profile field 'd2h_gbps' must be 0 (unknown) or between 1e-06 and 100000 "
                      "GB/s, got 1000000.0"),
    ("achievable_tflops", 2e9, "hardware profile field 'achievable_tflops' must be 0 (unknown) or between 1e-06 "
                               "and 1e+09 TFLOPS, got 2000000000.0"),
    ("achievable_tflops", float("nan"), "hardware profile field 'achievable_tflops' must be a finite number >= 0, "
                                        "got nan"),
    ("gpu_mem_bytes", float("nan"), "hardware profile field 'gpu_mem_bytes' must be a whole byte count between "
                                    "0 and 2**60 (1 EiB), got nan"),
    ("host_mem_bytes", 2.5e9 + 0.5, "hardware profile field 'host_mem_bytes' must be a whole byte count between "
                                    "0 and 2**60 (1 EiB), got 2500000000.5"),
    ("name", 3, "hardware profile field 'name' must be a string, got 3"),
])
def test_a_hardware_profile_built_in_python_is_checked_as_a_json_one(field, value, message):
    with pytest.raises(HardwareError) as e:
        dataclasses.replace(CATALOG["h800"], **{field: value})
    assert str(e.value) == message


def test_a_measured_link_is_counted_at_most_as_fast_as_a_profile_may_say():
    """Copies that moved no memory (in place) measure as links beyond any hardware profile's bound, which the
    plan would then refuse: they count as the fastest link a profile may hold."""
    import types
    from lazytrain.planner.hardware import MAX_GBPS
    from lazytrain.planner.measured import LINK_LANES, link_bandwidths

    class Trace:
        spans = [types.SimpleNamespace(lane=lane, args={"bytes": 10 ** 12}) for lane in LINK_LANES]

        def busy(self, lane):
            return 1e-6
    assert link_bandwidths([Trace()]) == dict.fromkeys(LINK_LANES.values(), MAX_GBPS)
    dataclasses.replace(CATALOG["h800"], **link_bandwidths([Trace()]))   # a profile takes them


def test_a_hardware_argument_that_is_no_name_or_file_is_named(tmp_path):
    with pytest.raises(HardwareError, match="hardware must be a catalog name, a JSON file path, a dict or a "
                                            "HardwareProfile, got int"):
        load_profile(3)
    with pytest.raises(HardwareError, match=r"hardware profile file '.*' cannot be read: \[Errno 21\] Is a directory"):
        load_profile(str(tmp_path) + "/")
    upper = tmp_path / "H800.JSON"
    upper.write_text(json.dumps({"name": "up", "h2d_gbps": 20.0}))
    assert load_profile(str(upper)).h2d_gbps == 20.0 and load_profile("H800.JSON".lower().replace(".json", "")).name


@pytest.mark.parametrize("field, value, message", [
    ("gpu_reserved_bytes", -1e10, "Budgets field 'gpu_reserved_bytes' must be a number of bytes >= 0, got -10000000000.0"),
    ("loss_chunk_tokens", 0, "Budgets field 'loss_chunk_tokens' must be a whole number of tokens >= 1, got 0"),
    ("hybrid_8bit_fraction", 2.0, "Budgets field 'hybrid_8bit_fraction' must be a fraction in [0, 1], got 2.0"),
    ("hybrid_8bit_fraction", float("nan"), "Budgets field 'hybrid_8bit_fraction' must be a fraction in [0, 1], got nan"),
    ("master_share", 0, "Budgets field 'master_share' must be a fraction in (0, 1], got 0"),
    ("non_block_master_share", 1.5, "Budgets field 'non_block_master_share' must be a fraction in (0, 1], got 1.5"),
    ("non_block_gradient_share", 0, "Budgets field 'non_block_gradient_share' must be a fraction in (0, 1], got 0"),
    ("lean_norms", "no", "Budgets field 'lean_norms' must be true or false, got 'no'"),
    ("non_block_state", "gpu", "Budgets field 'non_block_state' must be \"host\" or \"device\", got 'gpu'"),
])
def test_budgets_that_would_skew_the_memory_accounts_are_refused_by_field(field, value, message):
    with pytest.raises(ValueError) as e:
        Budgets(**{field: value})
    assert str(e.value) == message


@pytest.mark.parametrize("kw, message", [
    ({"micro_batch": 2.7}, "micro_batch must be a positive integer or None (search), got 2.7"),
    ({"micro_batch": 4, "global_batch": 0}, "global_batch must be a positive integer, got 0"),
    ({"micro_batch": 4, "global_batch": "8"}, "global_batch must be a positive integer, got '8'"),
    ({"micro_batch": 4, "seq_len": 512.5}, "seq_len must be an integer >= 1, got 512.5"),
    ({"micro_batch": 4, "time_limit_s": float("nan")}, "time_limit_s must be a finite number of seconds > 0, got nan"),
])
def test_plan_for_refuses_numbers_a_plan_cannot_hold(kw, message):
    with pytest.raises(ValueError) as e:
        plan_for(toy_model(4), TOY_HW, **kw)
    assert str(e.value) == message


def test_a_plan_holds_whole_numbers_only():
    with pytest.raises(PlanError, match=r"seq_len must be an integer >= 1 or None, got -3"):
        dataclasses.replace(every_k_plan(4, 2), seq_len=-3).validate()
    with pytest.raises(PlanError, match=r"micro_batch_size must be an integer >= 1 or None, got 2.5"):
        dataclasses.replace(every_k_plan(4, 2), micro_batch_size=2.5).validate()


def test_lazytrain_plan_names_a_hardware_path_that_is_a_directory(tmp_path, capsys):
    from lazytrain.cli import main
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", str(tmp_path) + "/"]) == 2
    assert f"hardware profile file '{tmp_path}/' cannot be read: [Errno 21] Is a directory" in capsys.readouterr().err


def test_a_model_or_measured_costs_of_the_wrong_kind_are_refused_by_name():
    from lazytrain.planner.measured import MeasuredCosts, MeasurementError
    from lazytrain.planner.models import load_model
    with pytest.raises(ModelShapeError, match=r"^a model is a catalog name, a config.json path, a config dict or a "
                                              r"ModelShape, got int 5$"):
        load_model(5)
    ok = dict(fwd_s=[1.0], diff_s=[1.0], update_s=[1.0], nonlayer_s=0.0, step_s=0.0)
    for key, value in (("fwd_s", 5), ("update_s", None)):
        with pytest.raises(MeasurementError, match=rf"^measured costs: {key} must list one time per layer, "
                                                   rf"got {value}$"):
            MeasuredCosts.from_dict({**ok, key: value})


def test_a_small_models_step_is_printed_in_significant_digits(tmp_path, capsys):
    """`lazytrain plan` printed every policy's step of a tiny model as 0.000 s."""
    from lazytrain.cli import main
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                                "vocab_size": 256}))
    assert main(["plan", "--model", str(path), "--hardware", "h200", "--micro-batch", "2", "--seq", "24"]) == 0
    out = capsys.readouterr().out
    step = float(re.search(r"^lazytrain \(milp\)\s+(\S+)", out, re.M).group(1))
    assert 0 < step < 1e-3
    assert "step lower bound 0.000 s" not in out


@pytest.mark.parametrize("text, says", [
    ('{"num_layers": 2, "homes": ["hbm", "host", "hbm"], "offload_window": {"1": 1, "1": 2}}',
     "Plan JSON gives the key '1' twice in one object"),
    ('{"num_layers": 2, "num_layers": 3, "homes": ["hbm", "host", "hbm"]}',
     "Plan JSON gives the key 'num_layers' twice in one object"),
    ('{"num_layers": 2, "homes": ["hbm", "host", "hbm"], "offload_window": {"1": 1, "01": 2}}',
     "Plan field 'offload_window' must map boundary numbers to window numbers, got '01': 2"),
    ('{"num_layers": 2, "homes": ["hbm", "host", "hbm"], "offload_window": {" 1 ": 1}}',
     "Plan field 'offload_window' must map boundary numbers to window numbers, got ' 1 ': 1"),
    ('{"num_layers": 2, "homes": ["hbm", "host", "hbm"], "offload_window": {"0_1": 1}}',
     "Plan field 'offload_window' must map boundary numbers to window numbers, got '0_1': 1"),
    ('{"num_layers": 2, "homes": ["hbm", "host", "hbm"], "offload_window": {"1": 1, "-0": 1}}',
     "Plan field 'offload_window' must map boundary numbers to window numbers, got '-0': 1"),
])
def test_a_plan_key_given_twice_or_spelled_otherwise_is_refused(text, says):
    """json.loads kept a repeated key's last value, and int() read "01", " 1 ", "0_1" (as 1) and "\u0661" as
    numbers: two spellings of one boundary merged, the last winning, without a word."""
    with pytest.raises(PlanError) as e:
        Plan.from_json(text)
    assert str(e.value) == says
    assert Plan.from_json('{"num_layers": 2, "homes": ["hbm", "host", "hbm"], "offload_window": {"1": 1}}') \
        .offload_window == {1: 1}


def test_a_deadline_of_weeks_waits_without_one():
    """A time limit of 1e8 s gave a deadline the OS's waits cannot take: OverflowError from inside subprocess
    ('timeout is too large'), for `lazytrain plan --time-limit 1e8` and 'lazytrain.milp_time_limit'."""
    from lazytrain.planner import isolate
    assert isolate.call_with_deadline(math.floor, 2.5, deadline_s=1e10) == 2
    assert isolate.call_with_deadline(math.floor, 2.5, deadline_s=1e8) == 2


def test_streamed_weights_on_nvme_take_their_bytes_of_its_budget():
    """With the compute copies on NVMe (weights_home "nvme") the planner was given the tier's whole capacity
    for boundaries: its plan fitted "its" budget, and the engine's first step overran the tier."""
    weights = sum(-(-layer.params * 2 // 4096) * 4096 for layer in toy_model(4).layers)   # whole 4 KiB blocks
    budgets = dict(gpu_reserved_bytes=0, loss_chunk_tokens=16, gpu_bytes=10**9, host_bytes=10**9)
    p = Problem(model=toy_model(4), hardware=TOY_HW, micro_batch=4, seq_len=16,
                budgets=Budgets(nvme_bytes=weights + 2 * A_BYTES, weights_in_host=False, **budgets))
    assert (p.nvme_static, p.nvme_act_budget) == (weights, 2 * A_BYTES)
    plan = Plan(num_layers=4, homes=("hbm", "nvme", "nvme", "nvme", "hbm"))
    r = simulate(p, plan, strict=False, timeline=False)
    assert r.peak_bytes["nvme"] == weights + 3 * A_BYTES and r.violations
    assert not simulate(p, Plan(num_layers=4, homes=("hbm", "nvme", "nvme", "hbm", "hbm")),
                        timeline=False).violations
    from lazytrain.planner.policies import simulate_megatrain
    assert simulate_megatrain(p, 2).peak_bytes["nvme"] == 0   # MegaTrain keeps its layer copies in host memory
    in_host = Problem(model=toy_model(4), hardware=TOY_HW, micro_batch=4, seq_len=16,
                      budgets=Budgets(nvme_bytes=weights + 2 * A_BYTES, **budgets))
    assert in_host.nvme_static == 0 and in_host.nvme_act_budget == weights + 2 * A_BYTES
    with pytest.raises(InfeasibleBudgetError, match=r"^NVMe budget .* cannot hold the streamed weights kept there "
                                                    r"\(.*\); short by .*\. Raise --nvme or lazytrain.nvme_memory\.$"):
        Problem(model=toy_model(4), hardware=TOY_HW, micro_batch=4, seq_len=16,
                budgets=Budgets(nvme_bytes=weights - 1, weights_in_host=False, **budgets))


@pytest.mark.filterwarnings("ignore:lazytrain")
def test_policy_milp_plans_boundaries_on_nvme_beside_the_weights_there(tmp_path):
    import lazytrain
    from engine_models import batches, lm_loss, make_model
    hardware = tmp_path / "hw.json"
    hardware.write_text(json.dumps({"name": "cpu-test", "achievable_tflops": 0.05, "h2d_gbps": 1.0, "d2h_gbps": 1.0,
                                    "nvme_read_gbps": 0.5, "nvme_write_gbps": 0.5,
                                    "host_optimizer_gparams_per_s": 0.1, "host_mem_bytes": 2**34}))
    (tmp_path / "nvme").mkdir()
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "lazytrain": {"device": "cpu", "policy": "milp", "seq_len": 256, "hardware": str(hardware),
                      "milp_time_limit": 5, "weights_home": "nvme", "nvme_path": str(tmp_path / "nvme"),
                      "capacities": {"hbm": 1_700_000, "host": 925_000, "nvme": 400_000}}})
    assert "nvme" in engine.plan.homes   # the plan keeps boundaries there, within what the weights leave
    for x, y in batches(2, batch=2, seq=256):   # the first step overran the tier
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert 0 < engine.last_step_peak_bytes["nvme"] <= 400_000
    engine.destroy()
