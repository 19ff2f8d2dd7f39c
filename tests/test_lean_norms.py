"""Lean RMSNorms (engine/lean_norms.py, on by default): a block's norms keep only their inputs for the
backward. Training is bit for bit what it is with the norms as transformers wrote them, in every way the
executor runs a block with autograd (re-runs, a graph tail, selective layers, offloaded internals, copy
threads with links); what a layer saves shrinks to what the planner counts; ``destroy`` hands the norms
back as they were."""
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine.executor import _SavedBytes
from lazytrain.engine.lean_norms import is_rms_norm, make_norms_lean, restore_norms
from lazytrain.planner.plan import RECOMPUTE, Plan, every_k_plan, keep_all_plan, offload_all_plan

transformers = pytest.importorskip("transformers")
from engine_models import (VOCAB, around_each_forward, batches, lm_loss, make_hf_model,   # noqa: E402
                           train_and_destroy)

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")


def fused_attention():
    """The planner counts what a fused attention kernel saves (its output and log-sum-exp), which the CPU and a
    GPU pick by default; the test run for a GPU turns them off for determinism (engine_models), leaving the
    math kernel, which saves the attention's probabilities. Saved bytes are measured under this."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
LINKS = {"copy_threads": True, "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}}}
PLANS = {
    "re-run every layer": every_k_plan(6, 2, home="host"),
    "graph tail": keep_all_plan(6, home="hbm", last_segment_graph=True),
    "selective": Plan(num_layers=6, homes=("hbm", RECOMPUTE, RECOMPUTE, "host", RECOMPUTE, RECOMPUTE, "hbm"),
                      selective_layers=(0, 1, 3), policy="selective"),
    "offloaded": offload_all_plan(6),
}


def _engine(tmp_path, family, plan, lean, testing=None, bf16=False):
    path = tmp_path / f"plan-{lean}.json"
    plan.to_json(str(path))
    lt = {"policy": "plan", "plan": str(path), "device": "cpu", "lean_norms": lean}
    if testing:
        lt["testing"] = testing
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "lazytrain": lt}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=make_hf_model(family), config=cfg)[0]


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_training_is_bit_for_bit_that_of_the_norms_as_written(tmp_path, family, plan):
    data = batches(3)
    engines = {lean: _engine(tmp_path, family, PLANS[plan], lean) for lean in (True, False)}
    norms = [m for m in engines[True].module.modules() if is_rms_norm(m)]
    assert norms and all("forward" in m.__dict__ for m in norms if m not in
                         list(engines[True].module.model.norm.modules()))   # the blocks' norms, not the final one
    lean, plain = (train_and_destroy(engines[k], data) for k in (True, False))
    assert lean.keys() == plain.keys()
    assert all(torch.equal(lean[k], plain[k]) for k in lean)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_bit_for_bit_with_copy_threads_links_and_bf16(tmp_path, bf16):
    data = batches(2)
    lean, plain = (train_and_destroy(_engine(tmp_path, "qwen3", PLANS["selective"], k, LINKS, bf16), data)
                   for k in (True, False))
    assert all(torch.equal(lean[k], plain[k]) for k in lean)


def test_a_layer_saves_its_norms_inputs_only():
    """A Qwen3 layer (q/k norms) in bf16: the lean norms save what LayerShape counts with lean_norms."""
    from lazytrain.planner.models import ModelShape
    model = make_hf_model("qwen3", n_layers=2).to(torch.bfloat16)
    layer = model.model.layers[0]
    shape = ModelShape.from_hf_config(model.config.to_dict()).layers[0]
    counted = around_each_forward(layer, _SavedBytes)
    x = torch.randint(0, VOCAB, (2, 12))
    results = {}
    for lean in (False, True):
        norms = make_norms_lean(model.model.layers) if lean else []
        model.zero_grad()
        with fused_attention():
            lm_loss(model(input_ids=x), x).backward()
        results[lean] = (counted[-1].nbytes, {n: p.grad.clone() for n, p in model.named_parameters()})
        restore_norms(norms)
    tokens, heads, kv_heads = 2 * 12, 4, 2
    # the estimate leaves out the attention's log-sum-exp (4 bytes a head); the norms' reciprocal RMS (4 bytes a
    # norm and, for q and k, a head) is recomputed by the lean norms, saved by the others
    lse, rsqrt = 4 * heads, 4 * 2 + 4 * (heads + kv_heads)
    assert results[False][0] == (shape.saved_bytes_per_token(2) + lse + rsqrt) * tokens
    assert results[True][0] == (shape.saved_bytes_per_token(2, lean_norms=True) + lse) * tokens
    assert results[True][0] < 0.8 * results[False][0]
    assert all(torch.equal(results[True][1][n], results[False][1][n]) for n in results[True][1])


def test_destroy_hands_the_norms_back_and_the_setting_is_checked():
    engine = _engine_default()
    norms = [m for m in engine.module.modules() if is_rms_norm(m) and "forward" in m.__dict__]
    assert len(norms) == 6 * 2                # two per Llama block; the final norm is no block's
    engine.destroy()
    assert not any("forward" in m.__dict__ for m in norms)
    with pytest.raises(ConfigError, match="config key 'lazytrain.lean_norms' must be true or false, got 'yes'"):
        lazytrain.initialize(model=make_hf_model("llama"), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "lazytrain": {"device": "cpu", "lean_norms": "yes"}})
    off = lazytrain.initialize(model=make_hf_model("llama"), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "lazytrain": {"device": "cpu", "lean_norms": False}})[0]
    assert not any("forward" in m.__dict__ for m in off.module.modules() if is_rms_norm(m))
    off.destroy()


def _engine_default():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=make_hf_model("llama"), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "lazytrain": {"device": "cpu"}})[0]


def test_the_engine_measures_what_the_planner_counts_for_lean_and_written_norms(tmp_path):
    """The traced re-runs of a keep-every-boundary plan (a Llama in fp32): each layer's measured saved bytes
    are LayerShape's count with and without lean norms (plus the log-sum-exp, 4 bytes a head, and without
    lean norms the two norms' reciprocal RMS), the setting the engine hands the planner."""
    from lazytrain.planner.models import ModelShape
    shape = ModelShape.from_hf_config(make_hf_model("llama").config.to_dict()).layers[0]
    tokens, heads = 2 * 12, 4
    for lean in (True, False):
        engine = _engine(tmp_path, "llama", keep_all_plan(6, home="hbm"), lean)
        (x, y), = batches(1)
        engine.trace_next_step()
        with fused_attention():
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        saved = [s.args["saved_bytes"] for s in engine.last_trace.spans if s.name.startswith("diff")]
        per_token = shape.saved_bytes_per_token(4, lean_norms=lean) + 4 * heads + (0 if lean else 4 * 2)
        assert saved == [per_token * tokens] * 6
        engine.destroy()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plan", ["selective", "offloaded", "graph tail"])
def test_on_a_gpu_lean_norms_train_bit_for_bit_and_save_less(tmp_path, plan):
    """On the CUDA path (side-stream copies, the backward on autograd's device thread): bf16 training bit for
    bit with and without lean norms (under the test run's deterministic attention kernel), and, under the fused
    attention a bf16 run picks, the traced re-runs' saved bytes within 10% of the planner's count plus what
    the CUDA kernel keeps beside its output (its log-sum-exp, in a layout of its own: measured on a bare call)."""
    from lazytrain.planner.models import ModelShape
    torch.use_deterministic_algorithms(True, warn_only=True)
    data = batches(2)
    config = make_hf_model("qwen3").config
    shape = ModelShape.from_hf_config(config.to_dict()).layers[0]

    def run(lean, steps):
        path = tmp_path / f"{lean}.json"
        PLANS[plan].to_json(str(path))
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
               "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "lazytrain": {"policy": "plan", "plan": str(path), "device": "cuda", "lean_norms": lean}}
        engine = lazytrain.initialize(model=make_hf_model("qwen3"), config=cfg)[0]
        engine.trace_next_step()
        trained = train_and_destroy(engine, steps)
        return trained, [s.args["saved_bytes"] for s in engine.last_trace.spans if "saved_bytes" in s.args]

    trained = {lean: run(lean, data)[0] for lean in (True, False)}
    assert all(torch.equal(trained[True][k], trained[False][k]) for k in trained[True])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = torch.randn(2, heads, 12, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(2, kv_heads, 12, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
          for _ in range(2)]
    bare = _SavedBytes([q, *kv])   # (a saved-tensors hook's __enter__ returns None)
    with fused_attention(), bare:
        out = torch.nn.functional.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)
    beside_output = bare.nbytes - out.numel() * out.element_size()
    for lean in (True, False):
        with fused_attention():
            measured = run(lean, data[:1])[1]
        estimate = shape.saved_bytes_per_token(2, lean_norms=lean) * 2 * 12 + beside_output
        print(f"lean_norms {lean}: measured {measured}, estimate {estimate} ({beside_output} beside the output)")
        assert measured or plan == "offloaded"      # an offloaded layer is never re-run
        assert all(abs(m - estimate) <= 0.1 * estimate for m in measured)


def test_the_planner_charges_each_backward_its_norms_recompute():
    """Qwen2.5-7B's layers: with lean norms a backward also recomputes the two norms, their share of the
    layer's elementwise ops (8h of 10h + 5 ffn + 3 (q + kv) FLOPs a token) of a selective re-run (at its
    floor, 0.1 of a forward); a block given its saved bytes has no norms the planner knows of."""
    from lazytrain.planner.hardware import CATALOG
    from lazytrain.planner.models import ModelShape, catalog_model
    from lazytrain.planner.problem import SELECTIVE_RERUN_FLOOR, Budgets, Problem
    shape = catalog_model("qwen2.5-7b")
    lean, written = (Problem(model=shape, hardware=CATALOG["h800"], budgets=Budgets(lean_norms=flag), micro_batch=4,
                             seq_len=1024) for flag in (True, False))
    h, ffn, q, kv = 3584, 18944, 3584, 512
    share = 8 * h / (10 * h + 5 * ffn + 3 * (q + kv))
    assert lean.sel_rerun_s == written.sel_rerun_s
    assert lean.sel_rerun_s[0] == pytest.approx(SELECTIVE_RERUN_FLOOR * lean.fwd_s[0], rel=1e-12)
    assert [a - b for a, b in zip(lean.diff_s, written.diff_s)] == pytest.approx(
        [SELECTIVE_RERUN_FLOOR * f * share for f in lean.fwd_s], rel=1e-9)
    opaque = ModelShape.from_layers("m", [1000] * 2, hidden=8, saved_bytes_per_token=64)
    assert [l.norm_flops_per_token() for l in opaque.layers] == [0.0, 0.0]


def test_megatrain_is_simulated_with_the_norms_as_transformers_runs_them():
    """MegaTrain's executor model takes no lean-norm recompute in its backwards, whichever setting the
    Problem plans LazyTrain with: the same step time and memory either way."""
    from lazytrain.planner.hardware import CATALOG
    from lazytrain.planner.models import catalog_model
    from lazytrain.planner.policies import simulate_megatrain
    from lazytrain.planner.problem import Budgets, Problem
    runs = [simulate_megatrain(Problem(model=catalog_model("qwen2.5-7b"), hardware=CATALOG["h800"],
                                       budgets=Budgets.of(gpu="80GB", lean_norms=flag), micro_batch=8, seq_len=1024,
                                       check=False)) for flag in (True, False)]
    assert runs[0].step_time_s == runs[1].step_time_s and runs[0].peak_bytes == runs[1].peak_bytes


class _UpcastRMSNorm(torch.nn.Module):
    """transformers' RMSNorm as written: computes in fp32, so in bf16 autograd saves the upcast copy."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, h):
        dtype, h = h.dtype, h.to(torch.float32)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)


class _InPlaceResidual(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc1, self.post_norm, self.fc2 = torch.nn.Linear(d, d), _UpcastRMSNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        h = x + self.fc1(x)
        h += self.fc2(self.post_norm(h))   # the norm's input changed in place after the norm read it
        return h


def test_a_norm_input_changed_in_place_later_is_named_in_the_backward():
    """Plain autograd trains this bf16 block (the norm saved its upcast copy); a lean norm, which keeps its
    input to recompute itself, cannot, and says which norm and which setting instead of autograd's version
    error."""
    blocks = torch.nn.ModuleList([_InPlaceResidual(), _InPlaceResidual()]).to(torch.bfloat16)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    blocks[1](blocks[0](x)).float().sum().backward()          # as written: trains
    norms = make_norms_lean(blocks)
    assert len(norms) == 2
    with pytest.raises(RuntimeError) as failed:
        blocks[1](blocks[0](x)).float().sum().backward()
    assert str(failed.value) == (
        "lazytrain: the input of block 1's post_norm, a lean RMSNorm, was changed in place after the norm read it; "
        "a lean norm keeps its input to recompute itself in the backward. Where the norm copies its input (its "
        "upcast in bf16 or fp16), \"lazytrain\": {\"lean_norms\": false} in the config lets this model train")
    restore_norms(norms)


def test_under_saved_tensor_hooks_the_copies_they_keep_train_as_plain_autograd_does():
    """Offloaded internals save through saved-tensor hooks: the copy they keep is immune to a later change in
    place, plain autograd checks nothing there, and neither does a lean norm (nor does it hold the input)."""
    grads = {}
    for lean in (False, True):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList([_InPlaceResidual(), _InPlaceResidual()]).to(torch.bfloat16)
        norms = make_norms_lean(blocks) if lean else []
        x = torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            out = blocks[1](blocks[0](x))
        out.float().sum().backward()
        grads[lean] = [p.grad for p in blocks.parameters()] + [x.grad]
        restore_norms(norms)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_an_input_made_under_inference_mode_takes_the_norm_as_written():
    """Autograd cannot keep an inference tensor for the backward; the written norm's upcast copies it (bf16)."""
    norm = _UpcastRMSNorm(8).to(torch.bfloat16)
    with torch.inference_mode():
        h = torch.randn(2, 8, dtype=torch.bfloat16)
    norms = make_norms_lean(torch.nn.ModuleList([torch.nn.Sequential(norm)]))
    norm(h).float().sum().backward()
    lean_grad = norm.weight.grad.clone()
    restore_norms(norms)
    norm.weight.grad = None
    norm(h).float().sum().backward()
    assert torch.equal(norm.weight.grad, lean_grad)


def test_a_norm_input_changed_in_place_in_an_offloaded_blocks_forward_is_named_too(tmp_path):
    """In a layer whose internals the plan offloads the same block failed with the offload's generic 'modified
    by an inplace operation ... that offloaded block 1 saved', naming neither the norm nor the key to set."""
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)
            self.layers = torch.nn.ModuleList([_InPlaceResidual(), _InPlaceResidual()])

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.layers:
                x = block(x)
            return self.head(x)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "plan.json")
    Plan(num_layers=2, homes=("hbm", "recompute", "hbm"), offloaded_layers=(0, 1)).to_json(path)
    for lean in (False, True):
        engine = lazytrain.initialize(model=LM(), config={
            "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "lazytrain": {"device": "cpu", "policy": "plan", "plan": path, "lean_norms": lean}})[0]
        loss = torch.nn.functional.cross_entropy(engine(ids).float().flatten(0, 1), ids.flatten())
        if lean:
            with pytest.raises(RuntimeError, match=r"^lazytrain: the input of block 1's post_norm, a lean RMSNorm, "
                                                   r"was changed in place after the norm read it"):
                engine.backward(loss)
        else:
            engine.backward(loss)   # the norm as written saved its upcast copy: it trains
            engine.step()
        engine.destroy()
