"""The planner's estimate of what a layer's autograd saves (LayerShape.saved_bytes_per_token) against what
transformers' own decoder layers save, counted by the engine's measurement (executor._SavedBytes) on the
CPU, in fp32 and bf16: equal to the byte, once the few bytes per token and head the estimate leaves out are
added back."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lazytrain.engine.executor import _SavedBytes
from lazytrain.planner.models import ModelShape
from engine_models import around_each_forward

BATCH, SEQ = 2, 64
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 704, 8, 2, 32
HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
# model type, extra config keys, which layer is measured
FAMILIES = [("llama", {}, 0), ("qwen2", {}, 0), ("qwen3", {}, 0), ("qwen3_5_text", HYBRID, 3)]


def _config(model_type: str, extra: dict):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} models")
    cfg = transformers.AutoConfig.for_model(
        model_type, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=4, vocab_size=128,
        max_position_embeddings=SEQ, **extra)
    cfg._attn_implementation = "sdpa"
    return cfg


def _measure(cfg, dtype: torch.dtype, index: int) -> int:
    """Bytes layer ``index`` saves in a forward with autograd, its input, weights and the rotary tables (what
    the call passes in) left out, as the engine counts them."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    layer = model.model.layers[index]
    counted = around_each_forward(layer, _SavedBytes)
    logits = model(input_ids=torch.randint(0, 128, (BATCH, SEQ))).logits
    logits.float().sum().backward()          # the counted graph is a usable one
    assert layer.mlp.down_proj.weight.grad is not None
    return counted[-1].nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type,extra,index", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_the_estimate_is_what_the_layer_saves(model_type, extra, index, dtype):
    cfg = _config(model_type, extra)
    shape = ModelShape.from_hf_config(cfg.to_dict()).layers[index]
    e = torch.finfo(dtype).bits // 8
    assert shape.qk_norm == (model_type != "llama" and model_type != "qwen2")
    assert shape.norm_fp32_weight == (model_type == "qwen3_5_text") == shape.attn_gate
    # what the estimate leaves out, per token: the reciprocal RMS of the two norms (4 bytes each) and of each
    # q and k head where they are normed, the attention's log-sum-exp (4 bytes a head)
    small = 4 * 2 + 4 * HEADS + (4 * (HEADS + KV_HEADS) if shape.qk_norm else 0)
    # per layer: the (1 + weight) factors in fp32 of norms that scale by them (hidden twice, head_dim twice)
    fixed = 4 * (2 * HIDDEN + 2 * HEAD_DIM) if shape.norm_fp32_weight else 0
    # on the CPU, SDPA returns its output in the query's layout; the gated layer's query is laid out by head, so
    # the output's reshape to the token layout is a copy (on CUDA the attention kernels write the token layout)
    cpu_copy = HEADS * HEAD_DIM * e if shape.attn_gate else 0
    tokens = BATCH * SEQ
    expected = (shape.saved_bytes_per_token(e) + small + cpu_copy) * tokens + fixed
    assert _measure(cfg, dtype, index) == expected


def test_the_estimate_by_hand_for_a_qwen2_layer():
    """Qwen2.5-7B's layer in bf16: two norms save 8 hidden-sized bytes per element each (an fp32 copy of the
    input, the normalised input and the output in bf16), attention q, k, v and output, the MLP four
    ffn-wide tensors: 19% more than the norm outputs, residual sum and attention/MLP tensors counted before."""
    layer = ModelShape.from_hf_config({"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                                       "num_attention_heads": 28, "num_key_value_heads": 4,
                                       "intermediate_size": 18944, "vocab_size": 152064}).layers[0]
    assert layer.saved_bytes_per_token(2) == 16 * 3584 + 2 * (2 * 3584 + 2 * 512) + 8 * 18944 == 225_280
    assert layer.saved_bytes_per_token(4) == 20 * 3584 + 4 * (2 * 3584 + 2 * 512) + 16 * 18944 == 407_552
    given = ModelShape.from_layers("m", [100], hidden=8, saved_bytes_per_token=96).layers[0]
    assert given.saved_bytes_per_token(2) == given.saved_bytes_per_token(4) == 96


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type,extra,index", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_selective_layer_keeps_what_the_planner_counts(model_type, extra, index, dtype):
    """What the engine's selective policy keeps from a forward without autograd (engine/selective.py: the
    matmul and attention outputs) against LayerShape.selective_elems_per_token, plus the attention's
    log-sum-exp (4 bytes a head), which the estimate leaves out."""
    from lazytrain.engine.selective import SelectiveForward
    cfg = _config(model_type, extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    kept = SelectiveForward(1)
    around_each_forward(model.model.layers[index], lambda outside: kept.recording())
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (BATCH, SEQ)))
    shape = ModelShape.from_hf_config(cfg.to_dict()).layers[index]
    e = torch.finfo(dtype).bits // 8
    assert kept.nbytes() == (shape.selective_elems_per_token() * e + 4 * HEADS) * BATCH * SEQ
