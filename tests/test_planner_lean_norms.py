"""The planner's lean-norm count and charge at their edges: MegaTrain's replay, measured costs of the other setting,
Qwen3-VL's q/k norms, what a mixture-of-experts layer saves."""
import pytest

from lazytrain.planner.measured import MeasuredCosts
from lazytrain.planner.models import ModelShape
from lazytrain.planner.policies import simulate_megatrain
from lazytrain.planner.problem import Budgets, make_problem


def _need(lean: bool) -> int:
    p = make_problem("qwen2.5-7b", "h800", 8, 4096, Budgets.of(gpu="70GB", lean_norms=lean), check=False)
    return max(p.min_gpu_bytes(w)[0] for w in range(p.num_windows))


def test_megatrain_replay_reports_over_budget_instead_of_raising():
    """A budget that the lean norms fit and the written ones do not: MegaTrain's replay (strict=False) reports
    the overflow as a violation; re-deriving the Problem must not re-run its static-fit check."""
    budget = (_need(True) + _need(False)) // 2
    p = make_problem("qwen2.5-7b", "h800", 8, 4096, Budgets(gpu_bytes=budget))   # fits: check=True passes
    r = simulate_megatrain(p)
    assert any("hbm peak" in v for v in r.violations)


def _costs(L: int, lean):
    return MeasuredCosts(fwd_s=(0.01,) * L, diff_s=(0.03,) * L, nonlayer_s=0.01, step_s=0.01,
                         update_s=(0.001,) * L, lean_norms=lean)


@pytest.mark.parametrize("measured_lean", [False, True])
def test_measured_times_are_shifted_to_the_planned_norms_like_the_saved_bytes(measured_lean):
    """Costs measured with one lean_norms setting, planned with the other: the saved bytes are shifted by the
    estimate's difference, and so must the backward's recompute of the norms (what diff_s measured)."""
    L = 4
    model = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": L, "num_attention_heads": 8,
             "num_key_value_heads": 8, "intermediate_size": 704, "vocab_size": 128}
    c = _costs(L, measured_lean)
    same = make_problem(model, "h800", 1, 64, Budgets(lean_norms=measured_lean), measured=c)
    other = make_problem(model, "h800", 1, 64, Budgets(lean_norms=not measured_lean), measured=c)
    assert same.diff_s == list(c.diff_s)                  # measured as it runs: unchanged
    layer = other.model.layers[0]
    charge = other.sel_rerun_s[0] * layer.norm_flops_per_token() / layer.elementwise_flops_per_token()
    sign = 1 if not measured_lean else -1                 # planned lean: the recompute added; else taken out
    assert other.diff_s[0] == pytest.approx(c.diff_s[0] + sign * charge)


def test_qwen3_vl_text_layers_have_qk_norms():
    """Qwen3-VL's text model (a nested text_config) norms q and k per head as Qwen3 does."""
    text = {"model_type": "qwen3_vl_text", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 704, "vocab_size": 128}
    for cfg in (text, {"model_type": "qwen3_vl", "text_config": text},
                {"model_type": "qwen3_vl_moe", "text_config": dict(text, model_type="qwen3_vl_moe_text")}):
        assert ModelShape.from_hf_config(cfg).layers[0].qk_norm


def test_a_qwen3_moe_layer_saves_what_the_estimate_counts():
    """transformers' Qwen3-MoE layer saves, beside the experts' gate/up/act/product (what ``ffn`` counts), each
    routed token's gathered input and its expert's output (for the routing weight's product): 2 x top_k x
    hidden per token, which the estimate counts too (it had left them out: 23% of the layer in bf16 at this size)."""
    import torch
    transformers = pytest.importorskip("transformers")
    from lazytrain.engine.executor import _SavedBytes
    from engine_models import around_each_forward
    if "qwen3_moe" not in transformers.CONFIG_MAPPING:
        pytest.skip("no qwen3_moe")
    H, HEADS, KV, HD, B, S, TOPK = 256, 8, 2, 32, 2, 64, 2
    cfg = transformers.AutoConfig.for_model("qwen3_moe", hidden_size=H, intermediate_size=704, num_attention_heads=HEADS,
                                            num_key_value_heads=KV, head_dim=HD, num_hidden_layers=2, vocab_size=128,
                                            max_position_embeddings=S, num_experts=8, num_experts_per_tok=TOPK,
                                            moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    counted = around_each_forward(model.model.layers[0], _SavedBytes)
    model(input_ids=torch.randint(0, 128, (B, S))).logits.float().sum().backward()
    shape = ModelShape.from_hf_config(cfg.to_dict()).layers[0]
    small = 4 * 2 + 4 * HEADS + 4 * (HEADS + KV)        # reciprocal RMS, log-sum-exp (as test_saved_bytes_model)
    estimate = (shape.saved_bytes_per_token(2) + small) * B * S
    # within the router's few fp32 values per token (logits, softmax, top-k weights and indices)
    assert abs(counted[-1].nbytes - estimate) <= 128 * B * S
