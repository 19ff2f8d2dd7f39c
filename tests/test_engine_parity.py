"""The streaming engine trains exactly like plain PyTorch (fp32: within 1e-5 relative)."""
import contextlib
import copy
import inspect
import json
import math
import os
import re
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine.executor import ExecutorError
from lazytrain.utils import safe_get_full_grad, safe_get_full_optimizer_state
from engine_models import (AUTO_DEVICE, OVERLAP_FORCED, VOCAB, MLPBlock, ModuleListLM, batches, lm_loss, logits_of,
                           make_hf_model, make_model, max_rel_diff)
from engine_models import plan_engine, reference_train as plain_reference_train
from lazytrain.planner.plan import RECOMPUTE, Plan, every_k_plan, keep_all_plan, offload_all_plan

# the AdamW arithmetic of the engine's update under ds_config: HybridAdamW's where the layers' update overlaps
# the next forward (a GPU's default, or LAZYTRAIN_TEST_OVERLAP=1), torch's fused AdamW otherwise
ENGINE_ADAMW = "hybrid" if OVERLAP_FORCED or AUTO_DEVICE.type == "cuda" else "torch"

# max|engine - plain| / max|plain| over each parameter after training. Adam turns a gradient that is rounding
# noise into a step of up to lr, so the bound is the matmuls' rounding, amplified: with HybridAdamW's arithmetic
# on an AVX-512 Xeon, gradient accumulation measured 1.04e-5 (one element 9.0e-7 off in a weight of 0.086, the
# others below 1e-6) where an AVX2 EPYC stayed below 1e-5; a wrong update is off by the order of lr (1e-2)
RTOL = 1e-5 if ENGINE_ADAMW == "torch" else 3e-5


def reference_train(*args, optimizer=None, **kwargs):
    """Plain PyTorch training (engine_models.reference_train) stepped with the engine's AdamW arithmetic."""
    return plain_reference_train(*args, optimizer=optimizer or ENGINE_ADAMW, **kwargs)


def ds_config(**lazytrain_section):
    extra = lazytrain_section.pop("_top", {})
    if OVERLAP_FORCED:   # the GPU's default, on any machine: the layers' update overlaps the next forward
        lazytrain_section.setdefault("overlap_optimizer", True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": float("inf"),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": lazytrain_section}
    cfg.update(extra)
    return cfg


def assert_trains_like_plain(model, data, config):
    """Trains ``model`` on ``data`` through LazyTrain and checks the parameters equal plain PyTorch
    training's (``reference_train``) within RTOL; returns the engine for further checks."""
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine = train_engine(model, data, config)
    assert max_rel_diff(engine.module, ref) < RTOL
    return engine


def copy_path_engine(model, **lazytrain_section):
    """An engine that copies every layer's weights into device slots (the path a GPU takes), also on the
    CPU, where it would otherwise compute on the weights in place."""
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(**lazytrain_section))
    engine.weights.zero_copy = False
    return engine


def pass_keys(engine):
    """What training passes still hold on the device tier (kept boundaries, graph layers' weight copies)."""
    return [key for key in engine.tiers["hbm"].keys() if key.startswith("pass")]


def train_engine(model, data, config, plain_backward=False):
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in data:
        loss = lm_loss(engine(x), y)
        if plain_backward:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
    engine.wait_for_update()   # a GPU overlaps the last update (lazytrain.overlap_optimizer "auto")
    return engine


@pytest.mark.parametrize("kind", ["llama", "modulelist"])
@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("home", ["hbm", "host", "nvme"])
@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_every_k_matches_pytorch(kind, k, home, graph, tmp_path):
    model = make_model(kind)
    data = batches(5)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    extra = {"nvme_path": str(tmp_path)} if home == "nvme" else {}
    engine = train_engine(model, data, ds_config(checkpoint_interval=k, boundary_home=home,
                                                 last_segment_graph=graph, **extra))
    assert engine.plan.kept == tuple(range(0, 6, k)) + (6,)
    assert engine.plan.last_segment_graph is graph
    assert engine.executor.recomputed_layer_forwards == 5 * engine.plan.recomputed_layers()
    assert max_rel_diff(engine.module, ref) < RTOL


@pytest.mark.parametrize("copies", [False, True], ids=["in-place", "copied"])
@pytest.mark.parametrize("k, graph, runs, copied_runs", [
    (6, False, 6 + 6, 6 + 5 + 6),   # forward, then the one segment recorded again in backward; with copied
                                    # weights (a GPU's slots are reused) layers 0-4 re-run without grad, then
                                    # each layer again when it is differentiated
    (6, True, 6, 6),                # the whole stack is the last segment: no block runs twice
    (2, True, 6 + 4, 6 + 2 * 3),    # segments (0,2), (2,4) re-run; (4,6) keeps its graph
    (1, True, 6 + 5, 6 + 5)])       # every layer re-run for its backward except the last
def test_block_forward_runs_per_step(k, graph, runs, copied_runs, copies, monkeypatch):
    """Block forwards per step: on the CPU the weights are used in place and a re-run segment is recorded
    once; where they are copied into device slots (a GPU, or copy threads here) each layer of a re-run
    segment runs again when it is differentiated."""
    from engine_models import MLPBlock
    calls = []
    original = MLPBlock.forward
    monkeypatch.setattr(MLPBlock, "forward", lambda self, x: calls.append(1) or original(self, x))
    model = make_model("modulelist")
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    calls.clear()
    section = dict(checkpoint_interval=k, last_segment_graph=graph)
    if copies and AUTO_DEVICE.type == "cpu":
        section["testing"] = {"copy_threads": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the testing section's warning
        engine = train_engine(model, data, ds_config(**section))
    assert engine.executor.stream.zero_copy == (AUTO_DEVICE.type == "cpu" and not copies)
    assert len(calls) == 2 * (runs if engine.executor.stream.zero_copy else copied_runs)
    assert max_rel_diff(engine.module, ref) < RTOL


def test_last_segment_graph_auto_and_errors():
    engine = train_engine(make_model("modulelist"), batches(1), ds_config())
    # auto: on where the CPU computes on the weights in place; on CUDA the graph layers would copy their weights
    assert engine.plan.last_segment_graph is (engine.device.type == "cpu")
    with pytest.raises(ConfigError, match="^config key 'lazytrain.last_segment_graph' must be "
                                                    "\"auto\", true or false, got 'yes'$"):
        train_engine(make_model("modulelist"), batches(1), ds_config(last_segment_graph="yes"))


def test_forward_without_backward_frees_its_graph_tail_with_its_output():
    """A forward under grad that is never differentiated (a validation loss, say) holds its graph
    layers' internals and weight copies only as long as its output lives."""
    import gc
    # the GPU path: graph layers copy their weights
    engine = copy_path_engine(make_model("llama"), checkpoint_interval=6, last_segment_graph=True)
    x, y = batches(1)[0]
    loss = lm_loss(engine(x), y)
    held = pass_keys(engine)
    assert len(held) == 6                      # one weight copy per graph layer
    del loss
    gc.collect()
    assert not pass_keys(engine)


@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_blocks_returning_a_one_tuple_get_a_tuple_back(graph):
    """A block that returns ``(hidden,)`` (transformers' decoder layers before 5.0) gets a tuple back from
    the streamed call, so the model's ``blk(x)[0]`` still takes the hidden state, not its first row."""
    model = make_model("tuple-blocks")
    data = batches(4)
    assert_trains_like_plain(model, data, ds_config(checkpoint_interval=2, last_segment_graph=graph))


class _LinearOutBlock(torch.nn.Module):
    """Ends in nn.Linear, whose output on a 3-D input is a view (of addmm's)."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class _ScalesInPlaceLM(ModuleListLM):
    """Scales each block's output in place, as some models do between blocks."""

    def _blocks(self, d, n_layers):
        return [_LinearOutBlock(d) for _ in range(n_layers)]

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack:
            x = blk(x)
            x.mul_(0.5)
        return self.head(self.extra[0](x))


@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_a_block_output_that_is_a_view_may_be_changed_in_place_as_in_plain_pytorch(graph):
    """Autograd refuses in-place changes to a view a custom Function returns; the streamed call hands back
    the block's output detached, so the model trains as plain PyTorch does."""
    torch.manual_seed(0)
    assert_trains_like_plain(_ScalesInPlaceLM(n_layers=4), batches(3),
                             ds_config(checkpoint_interval=2, last_segment_graph=graph))


class _SkippedOrMLP(torch.nn.Module):
    """A layer the model skips returns its input as it is."""

    def __init__(self, d: int, skip: bool):
        super().__init__()
        self.inner, self.skip = MLPBlock(d), skip

    def forward(self, x):
        return x if self.skip else self.inner(x)


class _SkipsAndScalesInPlaceLM(_ScalesInPlaceLM):
    def _blocks(self, d, n_layers):
        return [_SkippedOrMLP(d, skip=i == 2) for i in range(n_layers)]


def test_a_block_that_returns_its_input_hands_the_model_a_copy_of_its_kept_boundary():
    """The input of a skipped layer is a boundary on its way to the host: the model scaling the output in
    place must not change it before its copy has run (a TierError on copy threads, a race on CUDA)."""
    torch.manual_seed(0)
    model, data = _SkipsAndScalesInPlaceLM(n_layers=6), batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine = train_engine(model, data, ds_config(checkpoint_interval=1, boundary_home="host", last_segment_graph=False,
                                                 testing={"copy_threads": True, "chaos_seed": 1}))
    trained, plain = dict(engine.module.named_parameters()), dict(ref.named_parameters())
    engine.module.state_dict()   # the overlapped update landed
    for k, v in plain.items():
        if not k.startswith("stack.2."):   # the skipped layer's weights have no gradient in plain PyTorch
            assert ((trained[k].detach().cpu() - v.detach().cpu()).abs().max() / v.abs().max()).item() < RTOL, k


def test_modulelist_blocks_found_automatically():
    engine = train_engine(make_model("modulelist"), batches(1), ds_config())
    assert engine.blocks_path == "stack"


def test_blocks_named_in_config():
    engine = train_engine(make_model("decoder"), batches(1), ds_config(blocks="layers"))
    assert engine.blocks_path == "layers"


def test_a_blocks_path_that_a_wrapper_moved_is_refused_naming_the_wrapped_path():
    """PEFT's PeftModel puts the model under base_model.model: 'model.layers' is then
    'base_model.model.model.layers', which the refusal did not say."""
    from lazytrain.engine.blocks import BlockDiscoveryError

    class Wrapper(torch.nn.Module):   # as PeftModel wraps a causal LM
        def __init__(self, model):
            super().__init__()
            self.base_model = torch.nn.Module()
            self.base_model.model = model
    with pytest.raises(BlockDiscoveryError) as e:
        lazytrain.initialize(model=Wrapper(make_model("llama")), config=ds_config(blocks="model.layers"))
    assert str(e.value) == ("config 'lazytrain.blocks' is 'model.layers', but the model has no attribute 'model' "
                            "along that path; the model wraps them: did you mean 'base_model.model.model.layers'?")
    with pytest.raises(BlockDiscoveryError, match=r"no attribute 'nowhere' along that path$"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(blocks="model.nowhere"))


def _halved(block, x):
    """A forward a script sets on a block itself, around its class's (as a patch or a wrapper library does)."""
    return type(block).forward(block, x) * 0.5


@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_a_forward_set_on_a_block_before_initialize_is_the_one_trained_copied_and_handed_back(graph):
    """The executor called the block's class forward: an instance forward set before initialize was silently
    skipped (the loss differed from PyTorch's), and destroy() then deleted it."""
    model = make_model("modulelist", n_layers=4)
    for block in model.stack:
        block.forward = types.MethodType(_halved, block)
    data = batches(3)
    engine = assert_trains_like_plain(model, data, ds_config(last_segment_graph=graph))
    twin = copy.deepcopy(model)   # the copy's blocks keep their own forward, bound to the copy's block
    assert all(b.forward.__func__ is _halved and b.forward.__self__ is b for b in twin.stack)
    x, y = data[0]
    with torch.no_grad():
        assert torch.equal(lm_loss(twin(x), y), lm_loss(engine(x), y))
    engine.destroy()
    assert all(b.__dict__["forward"].__func__ is _halved and b.forward.__self__ is b for b in model.stack)


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_a_blocks_forward_changed_after_initialize_is_refused_at_the_next_pass(change):
    """A block whose forward a script replaced after initialize ran outside the executor, on weights it does not
    stream (a CPU ran it with the host copies; the step never saw its gradient)."""
    model = make_model("modulelist", n_layers=4)
    model.stack[1].forward = types.MethodType(_halved, model.stack[1])
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config())
    if change == "replaced":
        model.stack[2].forward = types.MethodType(_halved, model.stack[2])
    else:
        del model.stack[2].forward
    x, y = batches(1)[0]
    message = (f"block 2's forward was {change} after lazytrain.initialize: LazyTrain routes each block's forward "
               f"through its layer streaming, and calls a forward set on the block before initialize in its place. "
               f"Set it before lazytrain.initialize, or after engine.destroy(), which hands the model back")
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ExecutorError) as e:
            engine(x)
        assert str(e.value) == message
    with pytest.raises(ExecutorError) as e:   # the model called itself: its first block's call checks
        model(x)
    assert str(e.value) == message
    engine.destroy()   # the script's change stands; block 1's own forward is back
    assert ("forward" in model.stack[2].__dict__) == (change == "replaced")
    assert model.stack[1].forward.__func__ is _halved


@pytest.mark.parametrize("home", ["host", "hbm"])
def test_keep_all_policy_matches_pytorch(home):
    model = make_model("llama")
    data = batches(5)
    engine = assert_trains_like_plain(model, data, ds_config(policy="keep_all", boundary_home=home))
    assert engine.executor.recomputed_layer_forwards == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="on the CPU the host is the device: a boundary's host "
                    "buffer is the tensor autograd keeps, and leaves the pool whatever the executor does")
def test_on_a_gpu_host_boundaries_reuse_the_host_pools_buffers_every_step():
    """The boundaries kept on the host take their pinned buffers from the host tier's pool again in every
    step after the first: a freed boundary's buffer goes back to the pool. A prefetch's handle keeps a view
    of the buffer it read; were it dropped after the key, the buffer would leave the pool, be unregistered
    (a device-wide synchronize in the backward) and be registered again by the next forward."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"),
                                           config=ds_config(policy="keep_all", boundary_home="host"))
    pool = engine.tiers["host"].pool
    misses = []
    for x, y in batches(4):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        misses.append(pool.misses)
    engine.wait_for_update()
    assert misses[0] > 0
    assert misses[1:] == [misses[0]] * 3, misses


def test_plan_file_with_transfer_windows(tmp_path):
    from lazytrain.planner.plan import Plan
    plan = Plan(num_layers=6, homes=("hbm", "recompute", "host", "recompute", "host", "recompute", "hbm"),
                offload_window={2: 3, 4: 4}, prefetch_window={2: 8, 4: 6}, policy="test")
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    model = make_model("llama")
    data = batches(5)
    engine = assert_trains_like_plain(model, data, ds_config(policy="plan", plan=str(path)))
    assert engine.plan == plan
    assert engine.executor.recomputed_layer_forwards == 5 * 3
    for tier in engine.tiers.values():   # every boundary freed after its last use
        assert not [k for k in tier.keys() if k.startswith("pass")]


def test_plan_file_for_another_micro_batch_warns(tmp_path):
    from lazytrain.planner.plan import every_k_plan
    path = tmp_path / "plan.json"
    every_k_plan(6, 2, micro_batch_size=8).to_json(str(path))
    with pytest.warns(UserWarning, match=r"was planned for micro-batch 8, but this run trains micro-batch 2: it runs, "
                                         r"but its memory and time predictions do not hold"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path)))


def test_plan_file_for_another_model_or_precision_warns(tmp_path):
    """A plan for another model of as many layers was taken without a word: it runs (its homes and re-runs are
    layer by layer), but its memory and time were counted for that model's layers."""
    import dataclasses
    from lazytrain.planner.plan import every_k_plan
    here = [sum(p.numel() for p in block.parameters()) for block in make_model("llama").model.layers]
    path = tmp_path / "plan.json"
    plan = every_k_plan(6, 2, micro_batch_size=2)
    dataclasses.replace(plan, prediction={"layer_params": here, "dtype_bytes": 4, "model": "tiny"}).to_json(str(path))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path)))
    assert not [w for w in seen if "lazytrain.plan" in str(w.message)]   # this model's plan: nothing to say
    wider = [n * 4 for n in here]
    dataclasses.replace(plan, prediction={"layer_params": wider, "dtype_bytes": 2, "model": "wide"}).to_json(str(path))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path)))
    said = [str(w.message) for w in seen if "lazytrain.plan" in str(w.message)]
    assert said == [
        f"lazytrain: config 'lazytrain.plan' ({path}) was planned for a model (wide) whose block 0 holds "
        f"{wider[0]:,} parameters, and this model's holds {here[0]:,}: it runs, but its memory and time predictions "
        f"do not hold (plan again for this model: lazytrain plan --model its config.json)",
        f"lazytrain: config 'lazytrain.plan' ({path}) counted 2-byte weights, and this run computes in float32 (4 "
        f"bytes): it runs, but its memory and time predictions do not hold (plan again with the model config's "
        f"torch_dtype float32)"]


@pytest.mark.parametrize("model", ["gpt2", "llama with LoRA adapters"])
def test_a_plan_made_from_the_models_own_config_is_not_another_models(tmp_path, model):
    """`lazytrain plan --model config.json` costs GPT-2 by analogy (its blocks +33% of the real ones) and counts
    no LoRA adapter: the plan is this model's all the same, and was warned of as another's, with advice (plan
    again from its config.json) that could not silence it."""
    from engine_models import add_lora, make_hf_model
    from lazytrain.planner import plan_for
    built = make_hf_model("gpt2") if model == "gpt2" else make_hf_model("llama")
    config = built.config.to_dict()   # as config.json holds it: GPT-2's width is n_embd
    if model != "gpt2":
        add_lora(built, ("q_proj", "v_proj"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # GPT-2 costed as a Llama-style decoder: said where it is planned
        plan_for(config, "h200", {"gpu": "2GB", "trainable_share": 0.05}, micro_batch=2, seq_len=12,
                 time_limit_s=5).to_json(str(tmp_path / "plan.json"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lazytrain.initialize(model=built, config=ds_config(policy="plan", plan=str(tmp_path / "plan.json"),
                                                           _top={"bf16": {"enabled": True}}))
    assert not [str(w.message) for w in seen if "was planned for a model" in str(w.message)]


def test_plan_file_for_another_sequence_length_warns_at_start_and_at_a_longer_batch(tmp_path):
    """Only the micro-batch was compared: a plan made for short sequences ran on long ones without a word until
    a device budget overran mid-step."""
    from lazytrain.planner.plan import every_k_plan
    path = tmp_path / "plan.json"
    every_k_plan(6, 2, micro_batch_size=2, seq_len=8).to_json(str(path))
    with pytest.warns(UserWarning, match=r"was planned for sequence length 8, but 'lazytrain.seq_len' is 96: it runs, "
                                         r"but its memory and time predictions do not hold \(plan again with "
                                         r"--seq 96\)"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path), seq_len=96))
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(batches(1, seq=8)[0][0])   # the plan's length: nothing to say
    with pytest.warns(UserWarning, match=r"the plan \(every-2-hbm\) was made for sequence length 8, and this batch's "
                                         r"is 12: it runs, but the plan's memory and time predictions do not hold"):
        engine(batches(1, seq=12)[0][0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(batches(1, seq=12)[0][0])   # said once


def test_a_plan_file_that_counted_the_heads_logits_in_smaller_pieces_than_the_run_warns(tmp_path):
    """`lazytrain plan` counts the LM head's logits in 2048-token pieces unless told; the engine computes them
    whole unless 'lazytrain.loss_chunk_tokens' is set: a plan file counted so predicts too little memory."""
    import dataclasses
    from lazytrain.planner.plan import every_k_plan
    path = tmp_path / "plan.json"
    dataclasses.replace(every_k_plan(6, 2, micro_batch_size=2, seq_len=8),
                        prediction={"loss_chunk_tokens": 4}).to_json(str(path))
    with pytest.warns(UserWarning, match=r"counted the LM head's logits in pieces of 4 tokens, but this run computes "
                                         r"them whole \(16 tokens a micro-batch\): its device memory prediction is "
                                         r"too low. Set 'lazytrain.loss_chunk_tokens' to 4, or plan again with "
                                         r"--loss-chunk-tokens 0"):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path)))
    engine.destroy()
    with pytest.warns(UserWarning, match=r"but this run computes them in pieces of 8 tokens"):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"),
                                               config=ds_config(policy="plan", plan=str(path), loss_chunk_tokens=8))
    engine.destroy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*pageable memory")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"),
                                               config=ds_config(policy="plan", plan=str(path), loss_chunk_tokens=4))
    engine.destroy()


def test_a_plan_file_predicting_more_device_memory_than_the_budget_warns(tmp_path):
    """A plan written for a 20 GB budget ran under 'lazytrain.gpu_memory' 1 MB without a word, until a device
    write overran the budget mid-step."""
    import dataclasses
    from lazytrain.planner.plan import every_k_plan
    path = tmp_path / "plan.json"
    plan = every_k_plan(6, 2, micro_batch_size=2)
    dataclasses.replace(plan, prediction={"peak_bytes": {"hbm": 20e9, "host": 1e9}}).to_json(str(path))
    with pytest.warns(UserWarning, match=r"predicts 18.6 GiB on the device, more than its budget here \(1.0 MiB: "
                                         r"'lazytrain.gpu_memory' or 'lazytrain.capacities.hbm'\): it runs until a "
                                         r"write would overrun that budget \(plan again with --gpu-mem 1048576\)"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path),
                                                                          gpu_memory="1MiB"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*pageable memory")
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path),
                                                                          gpu_memory="32GB"))


def test_a_plan_file_is_read_for_a_model_with_no_blocks_and_unstored_boundaries_need_no_tier(tmp_path):
    """With no repeated blocks the plan file was never read: a missing one, or one for 36 layers, ran as
    "nothing-streams" without a word. A boundary the plan never stores (the graph tail's) on 'nvme' made the
    plan refused for want of an NVMe tier it does not use."""
    from lazytrain.planner.plan import Plan, every_k_plan
    path = tmp_path / "plan.json"
    every_k_plan(36, 2).to_json(str(path))
    with pytest.raises(ConfigError, match=r"is for 36 layers, but the model has 0 blocks \(no repeated blocks to "
                                          r"stream\)"):
        lazytrain.initialize(model=torch.nn.Linear(4, 4), config=ds_config(policy="plan", plan=str(path)))
    with pytest.raises(ConfigError, match=r"config 'lazytrain.plan' \(.*missing.json\): .*No such file"):
        lazytrain.initialize(model=torch.nn.Linear(4, 4), config=ds_config(policy="plan",
                                                                           plan=str(tmp_path / "missing.json")))
    tail = Plan(num_layers=6, homes=("hbm", "recompute", "host", "recompute", "nvme", "recompute", "hbm"),
                last_segment_graph=True, policy="tail-on-nvme")   # boundary 4 starts the graph tail
    tail.to_json(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"),
                                               config=ds_config(policy="plan", plan=str(path)))
    assert engine.plan.graph_start() == 4 and "nvme" not in engine.tiers
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(ConfigError, match=r"puts boundary 4 on tier 'nvme', which is not configured"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path),
                                                                          last_segment_graph=False))


def test_a_micro_batch_changed_from_the_plans_warns_and_one_set_to_it_does_not(tmp_path):
    from lazytrain.planner.plan import every_k_plan
    path = tmp_path / "plan.json"
    every_k_plan(6, 2, micro_batch_size=2).to_json(str(path))
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(policy="plan", plan=str(path)))
    with pytest.warns(UserWarning, match=r"the plan \(every-2-hbm\) was made for micro-batch 2; at 3 it runs, but its memory "
                                         r"and time predictions do not hold"):
        engine.set_train_micro_batch_size(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.set_train_micro_batch_size(2)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1


def test_gradient_accumulation_equals_big_batch():
    model = make_model("llama")
    data = batches(8)
    ref = reference_train(model, data, gas=4, device=AUTO_DEVICE)
    cfg = ds_config(checkpoint_interval=2)
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)
    engine = train_engine(model, data, cfg)
    assert engine.global_steps == 2 and engine.micro_steps == 8
    assert max_rel_diff(engine.module, ref) < RTOL


def test_plain_loss_backward_equals_engine_backward():
    model = make_model("modulelist")
    data = batches(5)
    a = train_engine(copy.deepcopy(model), data, ds_config(checkpoint_interval=2))
    b = train_engine(copy.deepcopy(model), data, ds_config(checkpoint_interval=2), plain_backward=True)
    assert max_rel_diff(a.module, b.module) == 0.0


def test_bf16_trains_close_to_fp32():
    """bf16 compute with fp32 masters tracks fp32 PyTorch: over 20 steps (lr 1e-3) every loss is within
    1% and the master weights within 0.1 relative (max|diff| / max|w| per tensor)."""
    model = make_model("llama")
    data = batches(1) * 20
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    cfg = ds_config(checkpoint_interval=2, _top={"bf16": {"enabled": True}})
    cfg["optimizer"]["params"]["lr"] = 1e-3
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    assert engine.stream.slots[0].buf.dtype == torch.bfloat16
    assert engine.module.model.embed_tokens.weight.dtype == torch.bfloat16
    for x, y in data:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item()
    masters = engine.module_state_dict()
    for name, w in ref.state_dict().items():
        assert ((masters[name] - w).abs().max() / w.abs().max()).item() < 0.1, name
    for p in engine.module.model.layers.parameters():
        assert p.dtype == torch.float32   # block masters stay fp32


def test_a_group_added_after_initialize_in_bf16_updates_the_fp32_masters():
    """The head left out of initialize and added as a group later: in bf16 its gradients land on fp32
    masters, so the group must hold those (a group of the bf16 parameters would never see a gradient);
    it trains as when the head was given to initialize."""
    cfg = ds_config(_top={"bf16": {"enabled": True}})
    results = []
    for later in (False, True):
        model = make_model("modulelist")
        given = [p for n, p in model.named_parameters() if not (later and n.startswith("head."))]
        engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=given, config=cfg)
        if later:
            engine.optimizer.add_param_group({"params": list(model.head.parameters())})
            assert all(p.dtype == torch.float32 for p in engine.optimizer.param_groups[-1]["params"])
        for x, y in batches(3):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        results.append(engine.module_state_dict())
        engine.destroy()
    for name, w in results[0].items():
        assert torch.equal(results[1][name], w), name


def test_a_bf16_models_state_dict_is_in_bf16_as_under_deepspeed():
    """What save_pretrained and accelerate save: one dtype, the masters rounded as the compute copies are;
    the parameters themselves (keep_vars) and module_state_dict() (the fp32 masters) are unchanged."""
    model = make_model("llama")
    engine = train_engine(model, batches(1) * 2, ds_config(_top={"bf16": {"enabled": True}}))
    masters = engine.module_state_dict()
    for module, prefix in ((model, ""), (model.model.layers[1], "model.layers.1.")):
        state = module.state_dict()
        assert {v.dtype for v in state.values()} == {torch.bfloat16}
        for name, v in state.items():
            assert torch.equal(v.cpu(), masters[prefix + name].bfloat16()), name
    kept = model.state_dict(keep_vars=True)
    assert kept["model.layers.0.mlp.up_proj.weight"] is model.model.layers[0].mlp.up_proj.weight
    assert kept["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    engine.destroy()
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}   # handed back: all fp32 again


def test_fp16_overflow_skips_step_and_halves_scale():
    model = make_model("modulelist")
    cfg = ds_config(_top={"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    x, y = batches(1)[0]
    loss = lm_loss(engine(x), y)
    assert engine.optimizer.overflow is False
    engine.backward(loss * float("inf"))
    engine.step()
    assert not engine.was_step_applied()
    assert engine.skipped_steps == 1 and engine.loss_scaler.scale == 128.0
    # as DeepSpeed's optimizers say it: accelerate's optimizer_step_was_skipped reads it (an attribute there from
    # the start), and Trainer holds its own schedule back on such a step
    assert engine.optimizer.overflow is True
    after = engine.module_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.was_step_applied() and engine.optimizer.overflow is False


@pytest.mark.parametrize("stage", [0, 1])
def test_fp16_overflows_move_the_scale_as_deepspeeds_optimizer_of_that_stage(stage):
    """DeepSpeed 0.19: without ZeRO its FP16_Optimizer halves the scale on every overflow (no hysteresis)
    and at the minimum goes on skipping; its ZeRO optimizers wait out the hysteresis and stop the run at
    the minimum. Either way an overflowing step reports an infinite norm (the sum here is nan) and the
    optimizer's loss_scale and cur_scale say the scale, as DeepSpeed's optimizers' do."""
    from lazytrain.engine.precision import LossScaleAtMinimumError
    cfg = ds_config(_top={"fp16": {"enabled": True, "initial_scale_power": 2, "hysteresis": 2, "min_loss_scale": 1},
                          "zero_optimization": {"stage": stage}})
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    x, y = batches(1)[0]
    assert engine.optimizer.loss_scale == engine.optimizer.cur_scale == 4.0
    scales = []
    for _ in range(4):
        engine.backward(lm_loss(engine(x), y) * float("nan"))
        try:
            engine.step()
        except LossScaleAtMinimumError:
            scales.append("stopped")
            break
        norm = engine.get_global_grad_norm()   # a float at every stage, as DeepSpeed's
        assert type(norm) is float and norm == math.inf and not engine.was_step_applied()
        assert engine.optimizer.loss_scale == engine.optimizer.cur_scale == engine.loss_scaler.scale
        scales.append(engine.loss_scaler.scale)
    assert scales == ([2.0, 1.0, 1.0, 1.0] if stage == 0 else [4.0, 2.0, 1.0, "stopped"])
    engine.destroy()


def test_a_loss_scale_set_on_the_optimizer_holds_from_the_next_step_as_deepspeeds_setter():
    cfg = ds_config(_top={"fp16": {"enabled": True, "initial_scale_power": 4}})
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    x, y = batches(1)[0]
    engine.optimizer.cur_scale = 64.0
    engine.backward(lm_loss(engine(x), y))
    assert engine.loss_scaler.scale == engine.optimizer.loss_scale == 64.0
    engine.step()
    assert engine.was_step_applied() and engine.optimizer.cur_scale == 64.0
    engine.optimizer.loss_scale = float("nan")
    with pytest.raises(ValueError, match=r"^optimizer.loss_scale was set to nan: a loss scale is a finite number > 0$"):
        engine.backward(lm_loss(engine(x), y))
    engine.destroy()


@pytest.mark.parametrize("policy", ["every_k", "keep_all"])
def test_a_loss_on_a_tensor_kept_inside_a_recorded_block_is_refused_by_name(policy):
    """A forward hook inside a block whose graph the forward records kept a tensor with gradient: a loss term
    on it differentiated the block's graph before the block's own backward, which then failed with torch's
    "backward through the graph a second time"."""
    from lazytrain.engine.executor import ExecutorError
    model = make_model("llama", n_layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(policy=policy, checkpoint_interval=2))
    kept = []
    model.model.layers[3].mlp.register_forward_hook(lambda m, a, o: kept.append(o))
    x, y = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine(x)
    assert kept[0].requires_grad
    with pytest.raises(ExecutorError, match=r"^block 3's forward graph was differentiated before its own backward: "
                                            r"the loss uses a tensor computed inside the block other than its "
                                            r"outputs \(attention weights"):
        engine.backward(lm_loss(logits_of(out), y) + kept[0].square().mean())
    engine.destroy()


@pytest.mark.parametrize("gas", [1, 2])
def test_a_loss_scale_set_after_a_steps_first_backward_is_taken_at_its_step(gas):
    """The set was read at a step's first backward alone, and the step's end wrote the old scale back over it:
    the script's scale was dropped in silence. The step's gradients are unscaled by the scale its backwards took
    (the update is the unset run's); the scaler goes on from the set one."""
    cfg = ds_config(_top={"fp16": {"enabled": True, "initial_scale_power": 8}, "gradient_accumulation_steps": gas,
                          "zero_optimization": {"stage": 1}})
    runs = []
    for set_scale in (False, True):
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
        data = batches(gas)
        for i, (x, y) in enumerate(data):
            engine.backward(lm_loss(engine(x), y))
            if set_scale and i == 0:
                engine.optimizer.loss_scale = 64.0
            engine.step()
        assert engine.was_step_applied()
        assert engine.loss_scaler.scale == engine.optimizer.cur_scale == (64.0 if set_scale else 256.0)
        runs.append([p.detach().clone() for p in engine.module.parameters()])
        engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, False), (2, True), (3, True)])
def test_in_bf16_and_fp32_zero_optimizers_say_a_static_loss_scale_of_1_as_deepspeeds(stage, bf16):
    """DeepSpeed's ZeRO optimizers (stage >= 1) have loss_scale and cur_scale in every precision: 1.0 outside
    fp16. Stage 0 in fp32 hands back the torch optimizer, which has neither. destroy takes them away."""
    top = {"zero_optimization": {"stage": stage}, **({"bf16": {"enabled": True}} if bf16 else {})}
    engine, optimizer, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config(_top=top))
    if stage:
        x, y = batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        assert optimizer.loss_scale == optimizer.cur_scale == 1.0 and engine.was_step_applied()
        optimizer.cur_scale = 4.0   # one value under two names, as DeepSpeed's property: both say it from then on
        engine.backward(lm_loss(engine(x), y))
        assert optimizer.loss_scale == optimizer.cur_scale == 4.0
        engine.step()
    else:
        assert not hasattr(optimizer, "loss_scale") and not hasattr(optimizer, "cur_scale")
    engine.destroy()
    assert not hasattr(optimizer, "loss_scale") and not hasattr(optimizer, "cur_scale")


def test_eval_no_grad_streams_and_matches_module():
    model = make_model("llama")
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config())
    engine.eval()
    x, _ = batches(1)[0]
    with torch.no_grad():
        out = engine(x).logits
        expect = ref(x.to(AUTO_DEVICE)).logits
    assert torch.allclose(out, expect, rtol=1e-5, atol=1e-6)
    assert not engine.module.training


def test_counters_lr_and_grad_norm():
    model = make_model("modulelist")
    cfg = ds_config(_top={"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                       "warmup_num_steps": 10,
                                                                       "warmup_type": "linear"}}})
    engine, opt, _, sched = lazytrain.initialize(model=model, config=cfg)
    assert sched.get_last_lr() == [0.0] == engine.get_lr()   # DeepSpeed's: where the schedule starts
    for x, y in batches(3):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 3 and engine.global_samples == 6
    assert engine.get_lr() == pytest.approx([0.002])   # DeepSpeed: step n uses iteration n-1
    assert engine.get_global_grad_norm() > 0 and engine.was_step_applied()
    assert engine.train_batch_size() == 2 and engine.gradient_accumulation_steps() == 1
    assert engine.stack is engine.module.stack   # attribute passthrough


def test_checkpoint_round_trip(tmp_path):
    model = make_model("llama")
    data = batches(4)
    engine = train_engine(model, data[:2], ds_config(checkpoint_interval=2))
    engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    assert (tmp_path / "latest").read_text() == "global_step2"
    for x, y in data[2:]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    expect = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine2 = train_engine(make_model("llama"), [], ds_config(checkpoint_interval=2))
    path, client = engine2.load_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt")   # as DeepSpeed returns it
    assert client == {"epoch": 3} and engine2.global_steps == 2
    for x, y in data[2:]:
        engine2.backward(lm_loss(engine2(x), y))
        engine2.step()
    got = engine2.module_state_dict()
    assert all(torch.equal(expect[k], got[k]) for k in expect)
    assert engine2.load_checkpoint(str(tmp_path / "empty")) == (None, None)



def grouped_engine(model, order, groups_of=None, **section):
    """An engine whose optimizer has two groups (decay for matrices, none for vectors), each listing the
    model's parameters in ``order`` ("model" or "reversed", as a script building them from a set may), or
    grouped by ``groups_of(name) -> 0 or 1``."""
    named = list(model.named_parameters())
    if order == "reversed":
        named = named[::-1]
    groups_of = groups_of or (lambda n: 0 if dict(model.named_parameters())[n].dim() >= 2 else 1)
    groups = [{"params": [p for n, p in named if groups_of(n) == k], "weight_decay": wd}
              for k, wd in ((0, 0.1), (1, 0.0))]
    return lazytrain.initialize(model=model, model_parameters=groups, config=ds_config(**section))[0]


@pytest.mark.parametrize("optimizer", ["AdamW", "AdamW8bit"])
def test_a_resume_with_the_parameters_listed_in_another_order_takes_each_ones_state_by_name(tmp_path, optimizer):
    """The checkpoint names the parameter at each position of the optimizer's groups: a script listing the
    same groups' parameters in another order resumes bit for bit as the uninterrupted run (by position,
    every parameter would get another's moments)."""
    section = {"checkpoint_interval": 2, **({"hybrid_threshold": 64} if optimizer == "AdamW8bit" else {})}
    data = batches(4)

    def run(order, steps, load=False):
        engine = grouped_engine(make_model("llama"), order, **section)
        if optimizer == "AdamW8bit":
            assert type(engine.optimizer).__name__ == "HybridAdamW"
        if load:
            engine.load_checkpoint(str(tmp_path))
        for x, y in steps:
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        engine.wait_for_update()
        return engine
    if optimizer == "AdamW8bit":
        section["_top"] = {"optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    run("model", data[:2]).save_checkpoint(str(tmp_path))
    whole = run("model", data).module_state_dict()
    resumed = run("reversed", data[2:], load=True).module_state_dict()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_resume_whose_groups_hold_other_parameters_is_refused_by_name(tmp_path):
    """A matrix and a norm's weight swapped between the groups (the groups' sizes unchanged): their states
    cannot move without their groups' settings (weight decay), so the load is refused, naming them, before
    anything is written."""
    saved = grouped_engine(make_model("llama"), "model", checkpoint_interval=2)
    x, y = batches(1)[0]
    saved.backward(lm_loss(saved(x), y))
    saved.step()
    saved.save_checkpoint(str(tmp_path))
    matrix, vector = "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"
    model = make_model("llama")
    dims = {n: p.dim() for n, p in model.named_parameters()}
    engine = grouped_engine(model, "model", checkpoint_interval=2,
                            groups_of=lambda n: 1 if n == matrix else 0 if n == vector else int(dims[n] < 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(lazytrain.CheckpointMismatchError,
                       match=rf"holds optimizer state for a group 0 of other parameters than this engine's group 0 "
                             rf"\('{vector}', '{matrix}' in one of them only\): load it with "
                             rf"load_optimizer_states=False"):
        engine.load_checkpoint(str(tmp_path))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert engine.global_steps == 0


class _Counter(torch.nn.Module):
    """A module whose extra state is a dict, not a tensor (torch allows any picklable object)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def forward(self, x):
        self.count += 1
        return x

    def get_extra_state(self):
        return {"count": self.count}

    def set_extra_state(self, state):
        self.count = state["count"]


@pytest.mark.parametrize("top", [{}, {"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 3}}],
                         ids=["fp32", "bf16", "stage3"])
def test_a_module_extra_state_that_is_not_a_tensor_is_saved_and_loaded(tmp_path, top):
    class CountingLM(ModuleListLM):
        def __init__(self):
            super().__init__()
            self.counter = _Counter()

        def forward(self, ids):
            return super().forward(self.counter(ids))

    def engine_of():
        torch.manual_seed(0)
        return lazytrain.initialize(model=CountingLM(), config=ds_config(checkpoint_interval=2, _top=top))[0]
    engine = engine_of()
    for x, y in batches(3):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.module_state_dict()["counter._extra_state"] == {"count": 3}
    engine.save_16bit_model(str(tmp_path / "hf"), "model.bin")
    assert torch.load(tmp_path / "hf" / "model.bin", weights_only=False)["counter._extra_state"] == {"count": 3}
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = engine_of()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.module.counter.count == 3


@pytest.mark.parametrize("saved_mid_accumulation", [False, True], ids=["at-a-step", "mid-accumulation"])
def test_a_resumed_run_accumulates_a_whole_batch_at_its_own_accumulation(tmp_path, saved_mid_accumulation):
    """Saved by a run accumulating 1 (or 2, after half a batch: those gradients are not in the checkpoint),
    resumed by one accumulating 2 over the same global batch (half the ranks, say): its next step comes after
    two micro-batches, as after DeepSpeed's load, not where the saving run's count would put it."""
    data = batches(3)
    gas = 2 if saved_mid_accumulation else 1
    engine = train_engine(make_model("modulelist"), [], ds_config(_top={"gradient_accumulation_steps": gas}))
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert (engine.global_steps, engine.micro_steps) == ((1, 3) if saved_mid_accumulation else (3, 3))
    engine.save_checkpoint(str(tmp_path))
    resumed = train_engine(make_model("modulelist"), [], ds_config(_top={"gradient_accumulation_steps": 2}))
    resumed.load_checkpoint(str(tmp_path))
    steps = engine.global_steps
    for n, (x, y) in enumerate(batches(2, seed=9)):
        assert resumed.is_gradient_accumulation_boundary() == (n == 1)
        resumed.backward(lm_loss(resumed(x), y))
        resumed.step()
        assert resumed.global_steps == steps + n
    engine.destroy()
    resumed.destroy()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_layer_gradient_copy_that_failed_fails_every_step_until_zero_grad(monkeypatch, stage):
    """The copy of one layer's gradient off the device fails (the gradient sink: the copy threads' on the
    CPU, the device-to-host stream's on CUDA):
    the backward goes on, every step() then refuses buffers that miss it, and zero_grad() drops them (at ZeRO
    stage 2 too, where it keeps gradients that landed); the redone micro-batches train as plain PyTorch."""
    from engine_models import fail_gradient_copy
    engine = train_engine(make_model("modulelist"), [], ds_config(testing={"copy_threads": True},
                                                                  _top={"zero_optimization": {"stage": stage}}))
    fail_gradient_copy(monkeypatch, 2)
    data = batches(2)
    x, y = data[0]
    engine.backward(lm_loss(engine(x), y))
    for _ in range(2):
        with pytest.raises(lazytrain.StepFailedError, match=r"step 1 failed before the optimizer changed anything "
                                                            r"\(OSError: a gradient copy failed\)"):
            engine.step()
    engine.zero_grad()
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert engine.global_steps == 2
    assert max_rel_diff(engine.module, reference_train(make_model("modulelist"), data, device=AUTO_DEVICE)) < RTOL
    engine.destroy()

@pytest.mark.parametrize("stage", [0, 2])
def test_a_failed_step_redone_with_gradient_accumulation_counts_its_micro_batches_from_the_first(monkeypatch, stage):
    """Two micro-batches a step; the step fails at its boundary (a gradient copy), and the script recovers as the
    error says: zero_grad() and the step's micro-batches again. The failed boundary left the micro-batch count
    where it was: the redo's first micro-batch was taken as a boundary (a step on half the batch), and every
    later step was one micro-batch off, without a word. It starts again at the step's first."""
    from engine_models import fail_gradient_copy
    cfg = ds_config(testing={"copy_threads": True},
                    _top={"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2,
                          "train_batch_size": 4})
    engine = train_engine(make_model("modulelist"), [], cfg)
    data = batches(4)
    fail_gradient_copy(monkeypatch, 8)   # in the step's second micro-batch
    for x, y in data[:2]:
        engine.backward(lm_loss(engine(x), y))
        if engine.is_gradient_accumulation_boundary():
            with pytest.raises(lazytrain.StepFailedError, match="a gradient copy failed"):
                engine.step()
        else:
            engine.step()
    engine.zero_grad()
    boundaries = []
    for x, y in data:
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert boundaries == [False, True, False, True] and engine.global_steps == 2 and engine.global_samples == 8
    assert max_rel_diff(engine.module, reference_train(make_model("modulelist"), data, gas=2, device=AUTO_DEVICE)) < RTOL
    engine.destroy()


def test_a_failed_step_redone_without_managed_accumulation_counts_its_samples_once(monkeypatch):
    """managed_gradient_accumulation false (the script's step() is the boundary): the samples of a step counted
    the failed attempt's backwards and the redone ones alike (8 for a step of 4)."""
    from engine_models import fail_gradient_copy
    cfg = ds_config(testing={"copy_threads": True},
                    _top={"gradient_accumulation_steps": 2, "train_batch_size": 4,
                          "managed_gradient_accumulation": False})
    engine = train_engine(make_model("modulelist"), [], cfg)
    data = batches(2)
    fail_gradient_copy(monkeypatch, 8)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
    with pytest.raises(lazytrain.StepFailedError, match="a gradient copy failed"):
        engine.step()
    engine.zero_grad()
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert (engine.global_steps, engine.global_samples) == (1, 4)
    engine.destroy()


@pytest.mark.parametrize("overlap", [False, True])
def test_betas_a_schedule_takes_past_one_fail_hybrid_adamws_step_before_it_changes_anything(overlap):
    """DeepSpeed's OneCycle with decay_mom_rate > 0 takes beta1 past 1 after its cycle (torch's AdamW runs on
    with it, HybridAdamW cannot): the step is refused before the update, naming the group and the betas, with
    every weight, counter and the schedule as they were; with the betas set back, the redone step trains."""
    schedule = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 2,
                                               "decay_step_size": 1, "decay_mom_rate": 0.1, "cycle_min_mom": 0.85,
                                               "cycle_max_mom": 0.95}}
    config = ds_config(optimizer_states="8bit", overlap_optimizer=overlap, _top={"scheduler": schedule})
    engine, opt, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=config)
    assert type(opt).__name__ == "HybridAdamW"
    data = batches(6)
    for x, y in data[:5]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    betas = opt.param_groups[0]["betas"]
    assert betas[0] > 1
    before = {n: p.detach().clone() for n, p in engine.module_state_dict().items()}
    x, y = data[5]
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(lazytrain.StepFailedError) as failed:
        engine.step()
    assert str(failed.value).startswith(
        f"step 6 failed before the optimizer changed anything (ValueError: HybridAdamW parameter group 0, as the "
        f"learning-rate schedule or the script left it: betas must be two numbers in [0, 1), got {betas}): ")
    assert engine.global_steps == 5 and opt.param_groups[0]["betas"] == betas
    assert all(torch.equal(before[n], p) for n, p in engine.module_state_dict().items())
    for group in opt.param_groups:
        group["betas"] = (0.9, 0.99)
    engine.zero_grad()
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.wait_for_update()
    assert engine.global_steps == 6
    assert not all(torch.equal(before[n], p) for n, p in engine.module_state_dict().items())
    engine.destroy()


def test_client_optimizer_and_callable_scheduler():
    model = make_model("modulelist")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"train_batch_size": 2, "steps_per_print": float("inf")}
    engine, got_opt, _, sched = lazytrain.initialize(
        model=model, optimizer=opt, config=cfg,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert got_opt is opt
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.get_lr() == [0.05]


def test_a_scheduler_class_is_built_with_the_optimizer_and_wins_over_the_config_one_with_a_warning():
    class Halve(torch.optim.lr_scheduler.StepLR):
        def __init__(self, optimizer):
            super().__init__(optimizer, step_size=1, gamma=0.5)

    cfg = ds_config(_top={"scheduler": {"type": "WarmupLR"}})
    with pytest.warns(UserWarning, match=r"an lr_scheduler was passed to initialize, so the config's 'scheduler' "
                                         r"\(WarmupLR\) is not used, as in DeepSpeed"):
        engine, _, _, sched = lazytrain.initialize(model=make_model("modulelist"), config=cfg, lr_scheduler=Halve)
    assert type(sched) is Halve and sched is engine.lr_scheduler
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.get_lr() == [0.005]


@pytest.mark.parametrize("schedule, params, first", [
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4}, 0.0055),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2}, 0.001 * (1 + 6 / 2)),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear"}, 0.005),
])
def test_lr_kwargs_take_deepspeeds_step_argument_and_bad_ones_are_refused_before_the_update(schedule, params, first):
    name = "last_batch_iteration" if schedule == "WarmupLR" else "batch_iteration"
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config(
        _top={"scheduler": {"type": schedule, "params": params}}))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    with pytest.raises(TypeError, match=rf"engine.step\(lr_kwargs=\{{'iteration': 5\}}\): {schedule}.step.* does "
                                        rf"not take them .*nothing was updated"):
        engine.step(lr_kwargs={"iteration": 5})
    assert all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    engine.step(lr_kwargs={name: 5})
    assert engine.was_step_applied() and engine.global_steps == 1
    assert engine.get_lr() == pytest.approx([first])


def test_a_client_optimizer_that_clips_by_itself_is_refused():
    """The engine clips over every gradient and hands the optimizer the coefficient, which would replace
    HybridAdamW's own max_grad_norm without a word: refused, pointing at gradient_clipping."""
    from lazytrain.optim.hybrid_adamw import HybridAdamW
    cfg = {"train_batch_size": 2, "steps_per_print": float("inf")}
    message = (r"the optimizer passed to lazytrain.initialize clips gradients itself \(max_grad_norm=0.001\), which "
               r"the engine would override: build it without max_grad_norm and set the config's "
               r"'gradient_clipping' to 0.001")
    model = make_model("modulelist")
    with pytest.raises(ConfigError, match=message):
        lazytrain.initialize(model=model, optimizer=HybridAdamW(model.parameters(), max_grad_norm=1e-3), config=cfg)
    with pytest.raises(ConfigError, match=message):
        lazytrain.initialize(model=make_model("modulelist"), config=cfg,
                             optimizer=lambda params: HybridAdamW(params, max_grad_norm=1e-3))


def test_config_as_json_path_and_base64(tmp_path):
    import base64
    cfg = ds_config()
    cfg["steps_per_print"] = 100
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    e1, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=str(path))
    e2, _, _, _ = lazytrain.initialize(model=make_model("modulelist"),
                                       config=base64.b64encode(json.dumps(cfg).encode()).decode())
    assert e1.engine_config == e2.engine_config


def test_device_budget_enforced():
    from lazytrain.tiers import TierBudgetError
    model = make_model("llama")
    with pytest.raises(TierBudgetError, match="tier 'hbm' is over its budget") as e:
        train_engine(model, batches(1), ds_config(gpu_memory=1000))
    # the key that gave the budget, named (the message said "the tier's capacity in the config")
    assert str(e.value).endswith("Raise config key 'lazytrain.gpu_memory' or place fewer tensors on it.")
    with pytest.raises(TierBudgetError) as e:
        train_engine(make_model("llama"), batches(1), ds_config(capacities={"hbm": 1000}))
    assert str(e.value).endswith("Raise config key 'lazytrain.capacities.hbm' or place fewer tensors on it.")


@pytest.mark.parametrize("graph, one_step", [
    # forward 0..5, then per segment (4,6),(2,4),(0,2): recompute s, differentiate e-1..s
    (False, [0, 1, 2, 3, 4, 5, 4, 5, 4, 2, 3, 2, 0, 1, 0]),
    # the last segment (4,6) is differentiated from its forward graph: no fetch in backward
    (True, [0, 1, 2, 3, 4, 5, 2, 3, 2, 0, 1, 0])])
def test_copy_path_through_device_slots_matches_pytorch(graph, one_step):
    """With zero-copy off, every layer's weights are copied into streaming slots (the path a GPU takes):
    results are unchanged and prefetching fills a slot other than the one the layer before used. Graph
    layers copy their weights out of the slot, so a later fetch into it cannot change their saved graph."""
    model = make_model("llama")
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine = copy_path_engine(model, checkpoint_interval=2, last_segment_graph=graph)
    fetched = []
    original_fetch = engine.weights.fetch_into
    slot_of = {}   # a window of two re-run layers takes a third buffer while it is prefetched
    engine.weights.fetch_into = lambda i, buf: fetched.append(
        (i, slot_of.setdefault(buf.data_ptr(), len(slot_of)))) or original_fetch(i, buf)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert max_rel_diff(engine.module, ref) < RTOL
    assert [i for i, _ in fetched] == one_step * 3
    assert not pass_keys(engine)  # graph weight copies freed
    slots = [s for _, s in fetched]
    assert all(a != b for a, b in zip(slots, slots[1:]))   # never into the buffer just filled


def test_a_window_of_re_run_layers_is_prefetched_whole_while_the_window_before_computes():
    """Segments of three layers: backward's first window re-runs layers 3 and 4 and differentiates 5. As in
    the Plan's cost model, entering a window issues the copies of the whole next window (all three while
    the forward's last layer and the head compute), and the extra buffers this takes are released as soon
    as compute leaves them: four at most (the layer computing and the next window's three, what the Plan
    charges), two after the step. The update is not overlapped (a GPU's default), whose layers' readiness
    would move the next step's fetches by when each update lands."""
    model = make_model("llama")
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE, optimizer="torch")   # its update is not overlapped
    engine = copy_path_engine(model, checkpoint_interval=3, last_segment_graph=False, overlap_optimizer=False)
    log = []
    fetch, acquire = engine.weights.fetch_into, engine.stream.acquire
    engine.weights.fetch_into = lambda i, buf: log.append(f"F{i}") or fetch(i, buf)
    engine.stream.acquire = lambda i: log.append(f"A{i}") or acquire(i)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        assert len(engine.stream.slots) == 2
    engine.wait_for_update()
    assert max_rel_diff(engine.module, ref) < RTOL
    forward = "F0 A0 F1 A1 F2 A2 F3 A3 F4 A4 F5 A5".split()
    backward = ("F3 F4 F5 A3 F4 A4 A5 A4 F3 A3 F0 F1 F2 A0 F1 A1 A2 A1 F0 A0").split()
    assert log == (forward + backward) * 2
    assert engine.stream.peak_slots == 4
    engine.destroy()


@pytest.mark.parametrize("extra_layers, slots", [(0.7, 2), (1.5, 3)])
def test_a_window_prefetch_without_room_for_its_buffers_stops_and_fetches_on_demand(extra_layers, slots):
    """A fixed policy on a device budget no plan was checked against: beside the two kept buffers there is
    room for less than one more layer, or for one. The window prefetch takes what fits and fetches the
    rest when compute comes to it, into a kept buffer: training is unchanged, never refused."""
    model = make_model("llama")
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    layer_bytes = 37120   # the test model's layer: 9280 fp32 parameters
    engine = copy_path_engine(model, checkpoint_interval=3, last_segment_graph=False)
    assert engine.weights.layer_numels == [layer_bytes // 4] * 6
    hbm = engine.weights.device_tier   # what it holds now (the kept buffers; on a GPU the embedding too), and room
    assert "weights.slot0" in hbm and "weights.slot1" in hbm
    hbm.capacity = hbm.used_bytes + int(extra_layers * layer_bytes)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert max_rel_diff(engine.module, ref) < RTOL
    assert engine.stream.peak_slots == slots
    engine.destroy()


def test_an_optimizer_passed_beside_a_config_optimizer_is_the_one_used_as_deepspeed_does():
    """A copied config keeps its 'optimizer' section while the script passes its own: DeepSpeed uses the one
    passed and ignores the section; so does LazyTrain, saying so."""
    model = make_model("modulelist")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with pytest.warns(UserWarning, match=r"an optimizer was passed to initialize and the config has an 'optimizer' "
                                         r"section \(AdamW\) too: the optimizer passed is used and the section "
                                         r"ignored, as DeepSpeed does"):
        engine, got, _, _ = lazytrain.initialize(model=model, optimizer=opt, config=ds_config(overlap_optimizer="auto"))
    assert got is opt and [g["lr"] for g in got.param_groups] == [3e-4] == engine.get_lr()
    ref = make_model("modulelist")
    data = batches(2)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-4)
    for x, y in data:
        lm_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()


def test_deepspeeds_configuration_getters():
    """The getters DeepSpeed's engine has that scripts read (values as DeepSpeed 0.19.8 gives them)."""
    cfg = ds_config(_top={"fp16": {"enabled": True, "loss_scale": 0}, "gradient_accumulation_steps": 3,
                          "communication_data_type": "bf16",
                          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    assert engine.get_batch_info() == (6, 2, 3)
    assert engine.loss_scale() == 0 and engine.dynamic_loss_scale()
    assert engine.zero_cpu_offload() and engine.zero_offload_optimizer().device == "cpu"
    assert engine.get_data_types() == (torch.float16, torch.float32)
    assert engine.communication_data_type == torch.bfloat16
    engine.destroy()
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    assert not engine.zero_cpu_offload() and engine.zero_offload_optimizer() is None
    assert engine.get_data_types() == (torch.float32, torch.float32) and engine.communication_data_type == torch.float32
    engine.destroy()
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config(_top={"bf16": {"enabled": True}}))
    assert engine.communication_data_type == torch.bfloat16   # unset: the model's dtype, as DeepSpeed's
    engine.destroy()


class _ProjectedBlock(MLPBlock):
    """A block multiplying its activations by a frozen projection kept as a buffer (PEFT's VeRA does)."""

    def __init__(self, d: int):
        super().__init__(d)
        self.register_buffer("projection", torch.eye(d))

    def forward(self, x):
        return super().forward(x @ self.projection)


class _ProjectedLM(ModuleListLM):
    block = _ProjectedBlock


def test_a_dtype_error_on_a_blocks_fp32_buffer_in_bf16_names_the_buffers_and_the_way_out():
    """LazyTrain keeps fp32 buffers in fp32 where DeepSpeed's bf16 cast makes them bf16: PEFT's VeRA in a bf16
    run failed with torch's bare dtype error from deep inside the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=_ProjectedLM(), config=ds_config(_top={"bf16": {"enabled": True}}))
    x, _ = batches(1)[0]
    with pytest.raises(RuntimeError, match="dtype") as e:
        engine(x)
    assert e.value.__notes__ == ["lazytrain: block 0 computes in bfloat16 and keeps fp32 buffers (projection), which "
                                 "LazyTrain leaves in fp32 where DeepSpeed's bf16/fp16 cast makes them 16-bit; a "
                                 "block that computes with them as its activations' dtype needs the model cast "
                                 "before lazytrain.initialize (model.to(torch.bfloat16))"]
    engine.destroy()
    model = _ProjectedLM().to(torch.bfloat16)   # the way out: trains
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(_top={"bf16": {"enabled": True}}))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.destroy()


def test_more_of_deepspeeds_getters_and_its_old_save_name(tmp_path):
    """Framework save paths and RLHF code read these (they were AttributeErrors)."""
    cfg = ds_config(_top={"zero_optimization": {"stage": 2}, "dataloader_drop_last": True,
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    assert engine.zero_optimization() and engine.zero_optimization_partition_gradients()
    assert not engine.zero_optimization_partition_weights() and engine.zero_offload_param() is None
    assert engine.dataloader_drop_last() and engine.get_data_parallel_rank() == 0
    assert engine.optimizer_params() == cfg["optimizer"]["params"] and engine.scheduler_name() == "WarmupLR"
    assert engine.scheduler_params() == {"warmup_num_steps": 2}
    assert engine.empty_partition_cache() is None and engine.is_compiled is False
    assert engine.save_fp16_model(str(tmp_path))
    saved = torch.load(tmp_path / "pytorch_model.bin")   # DeepSpeed's default name for it
    assert saved.keys() == engine.module.state_dict().keys()
    engine.destroy()


def test_a_move_or_cast_of_the_engine_is_refused_unless_it_changes_nothing():
    """nn.Module.to() replaced each parameter's .data, cutting the streamed blocks' parameters off the engine's
    buffers: the optimizer updated tensors the forward never read (a float64 round trip moved the evaluation
    loss from 2.59 to 2.69). A move to where the engine computes (engine.to(local_rank)) changes nothing."""
    data = batches(2)
    ref = reference_train(make_model("llama"), data, device=AUTO_DEVICE)
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config())
    assert engine.to(engine.device) is engine and engine.to() is engine and engine.float() is engine
    casts = [lambda: engine.to(torch.float64), lambda: engine.half(), lambda: engine.to("cpu", torch.bfloat16)]
    if engine.device.type == "cpu":
        assert engine.cpu() is engine
    else:   # the embedding lives on the GPU: moved to the host, the forward would no longer find it
        casts.append(engine.cpu)
    for cast in casts:
        with pytest.raises(RuntimeError, match=r"^lazytrain: moving or casting the engine's model after initialize "
                                               r"is not supported \(model.embed_tokens.weight: torch.float32 on "):
            cast()
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, ref) < 1e-5
    with pytest.raises(RuntimeError, match=r"^lazytrain: engine.compile\(\) is not supported"):
        engine.compile(backend="inductor", compile_kwargs={})   # accelerate's call for torch_compile=True
    engine.destroy()


def test_deepspeeds_throughput_timer_and_monitor_are_there_for_the_scripts_that_read_them():
    """The DeepSpeed-Chat template calls engine.tput_timer.update_epoch_count() each epoch and reads
    engine.monitor.enabled: AttributeErrors after the first epoch had trained. The timer counts as DeepSpeed's:
    micro-steps, optimizer steps, the first two steps left out of the average."""
    cfg = ds_config(_top={"gradient_accumulation_steps": 2})
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    timer = engine.tput_timer
    assert timer.avg_samples_per_sec() == float("-inf") and engine.monitor.enabled is False
    for x, y in batches(8):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    timer.update_epoch_count()
    assert (timer.global_step_count, timer.micro_step_count, timer.epoch_count) == (4, 0, 1)
    assert timer.batch_size == 4 and timer.total_elapsed_time > 0 and timer.avg_samples_per_sec() > 0
    engine.monitor.write_events([("Train/loss", 1.0, 1)])   # nothing written, as with no monitor configured
    engine.destroy()


def test_at_stage_3_trls_generation_takes_off_and_puts_back_module_hooks_that_are_not_there():
    """TRL's unwrap_model_for_generation takes DeepSpeed's ZeRO-3 module hooks off the model around a generation
    (remove_hooks) and puts them back (add_hooks; older TRL by DeepSpeed's older name), through
    optimizer.parameter_offload: at stage 3 it is there and holds nothing (AttributeError: 'AdamW' object has no
    attribute 'module' before); destroy takes it away."""
    trl_utils = pytest.importorskip("trl.models.utils")
    for stage in (2, 3):
        engine, optimizer, _, _ = lazytrain.initialize(
            model=make_model("modulelist"), config=ds_config(_top={"zero_optimization": {"stage": stage}}))
        assert hasattr(optimizer, "parameter_offload") == (stage == 3)
        if stage == 3:
            trl_utils.remove_hooks(engine)
            out = engine.module(batches(1)[0][0])   # a generation's forward through the model itself
            trl_utils.add_hooks(engine)
            engine.optimizer.parameter_offload._register_hooks_recursively(engine.optimizer.parameter_offload.module)
            assert out.shape[0] == batches(1)[0][0].shape[0] and not engine.module._forward_hooks
        engine.destroy()
        assert not hasattr(optimizer, "parameter_offload")


def test_at_stage_3_an_engine_without_an_optimizer_shows_zero3s_empty_module_hooks_as_its_optimizer():
    """DeepSpeed's stage 3 without an optimizer makes engine.optimizer its DeepSpeedZeRoOffload, whose module hooks
    TRL takes off around a generation (a Trainer's evaluate() before its first step): there it is an object with
    the (empty) hooks, returned by initialize as DeepSpeed returns it; below stage 3 it stays None. Anything an
    optimizer does is refused by name, and the engine's step refuses as without it."""
    trl_utils = pytest.importorskip("trl.models.utils")
    for stage in (2, 3):
        cfg = {**ds_config(_top={"zero_optimization": {"stage": stage}}), "optimizer": None}
        engine, optimizer, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
        assert engine.basic_optimizer is None and optimizer is engine.optimizer
        if stage < 3:
            assert optimizer is None
        else:
            assert type(optimizer).__name__ == "NoParameterOffloadHooks"
            with torch.no_grad():
                trl_utils.remove_hooks(engine)
                out = engine.module(batches(1)[0][0])
                trl_utils.add_hooks(engine)
            assert out.shape[0] == batches(1)[0][0].shape[0] and not engine.module._forward_hooks
            assert not hasattr(optimizer, "param_groups")
            refused = ("'step': this is no optimizer but the (empty) module hooks of ZeRO stage 3, which "
                       "engine.optimizer is when the engine has no optimizer, as in DeepSpeed; to train, add an "
                       "'optimizer' section to the config or pass one to initialize")
            with pytest.raises(AttributeError, match=f"^{re.escape(refused)}$"):
                optimizer.step()
            with pytest.raises(ConfigError, match=r"^engine.step\(\) needs an optimizer"):
                engine.step()
        # a module or parameter too: nn.Module's __setattr__ would register it under that name, past the property
        for other in (torch.optim.SGD(engine.module.parameters(), lr=0.1), torch.nn.Linear(2, 2),
                      torch.nn.Parameter(torch.zeros(2))):
            with pytest.raises(AttributeError, match="^engine.optimizer is the optimizer initialize\\(\\) set up"):
                engine.optimizer = other
        assert "optimizer" not in engine._modules and "optimizer" not in engine._parameters
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_non_finite_gradient_norm_is_reported_as_deepspeeds_zero_optimizers_report_it(stage):
    """From stage 1, DeepSpeed's optimizers report inf for a nan gradient norm (Trainer logs it); stage 0's
    norm is as computed. The step is skipped either way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"),
                                               config=ds_config(_top={"zero_optimization": {"stage": stage}}))
        x, y = batches(1)[0]
        engine.backward(lm_loss(engine(x), y) * float("nan"))
        engine.step()
    norm = engine.get_global_grad_norm()
    assert math.isinf(norm) if stage else math.isnan(norm)
    assert engine.skipped_steps == 1
    engine.destroy()


def test_communication_data_type_is_set_as_deepspeeds_between_steps():
    """DeepSpeed's engine has a setter scripts use after initialize: a torch dtype (LazyTrain also takes the
    config's names; None: the model's dtype again). A value neither names is refused, and so is a change in
    the middle of a step, whose gradients are being summed in the old dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"),
                                               config=ds_config(_top={"bf16": {"enabled": True},
                                                                      "gradient_accumulation_steps": 2}))
    engine.communication_data_type = torch.float32
    assert engine.communication_data_type == torch.float32 and engine.dist.comm_dtype == torch.float32
    engine.communication_data_type = "fp16"
    assert engine.communication_data_type == torch.float16
    engine.communication_data_type = None
    assert engine.communication_data_type == torch.bfloat16
    with pytest.raises(ValueError, match=r"communication_data_type must be torch.float32, torch.bfloat16 or "
                                         r"torch.float16 \(or 'fp32', 'bf16', 'fp16'; None for the model's dtype\), "
                                         r"got torch.float64"):
        engine.communication_data_type = torch.float64
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(RuntimeError, match="communication_data_type cannot change in the middle of a step"):
        engine.communication_data_type = torch.float32
    engine.step()   # the first micro-batch of two: still mid-step
    with pytest.raises(RuntimeError, match="communication_data_type cannot change in the middle of a step"):
        engine.communication_data_type = torch.float32
    engine.communication_data_type = torch.bfloat16   # no change: nothing refused
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.communication_data_type = torch.float32
    assert engine.communication_data_type == torch.float32
    engine.destroy()


def test_the_global_grad_norm_is_a_tensor_from_zero_stage_1_as_deepspeeds():
    """DeepSpeed's ZeRO optimizers give the norm as a 0-dim tensor (scripts log ``.item()``); stage 0 a float.
    The same value either way."""
    norms = {}
    for stage in (0, 1, 2):
        cfg = ds_config(_top={"zero_optimization": {"stage": stage}})
        engine = train_engine(make_model("modulelist"), batches(2), cfg)
        norms[stage] = engine.get_global_grad_norm()
        engine.destroy()
    assert isinstance(norms[0], float) and norms[0] > 0
    for stage in (1, 2):
        assert torch.is_tensor(norms[stage]) and norms[stage].dim() == 0
        assert norms[stage].item() == torch.tensor(norms[0], dtype=torch.float32).item()


def test_planner_gets_the_shares_of_the_parameters_that_train(monkeypatch):
    """A LoRA run: the planner budgets the frozen block weights as their streamed copy alone (weights.py) and a
    frozen embedding and head as their device copy alone (precision.FrozenParams), so it is told which share of
    the blocks' parameters trains and which of the others, counted on the model."""
    import lazytrain.engine.engine as engine_module
    from lazytrain.engine.placement import planning_budgets
    from engine_models import add_lora
    seen = []
    build_plan = engine_module.build_plan
    monkeypatch.setattr(engine_module, "build_plan",
                        lambda *args, **kw: seen.append(args[-1]) or build_plan(*args, **kw))
    model = add_lora(make_model("llama"), ("q_proj", "v_proj"))
    model.lm_head.weight.requires_grad_(True)   # trained beside the adapters (PEFT's modules_to_save)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(_top={"bf16": {"enabled": True}}))
    blocks = list(model.model.layers.parameters())
    share = sum(p.numel() for p in blocks if p.requires_grad) / sum(p.numel() for p in blocks)
    in_blocks = {id(p) for p in blocks}
    others = [p for p in model.parameters() if id(p) not in in_blocks]
    head_share = model.lm_head.weight.numel() / sum(p.numel() for p in others)
    assert seen == [{"trainable_share": share, "non_block_trainable_share": head_share,
                     "hybrid_8bit_fraction": 0.0,     # fp32 Adam states
                     "frozen_bottom_layers": 0}]      # adapters in every block: the backward reaches block 0
    assert 0 < share < 0.05 and 0.4 < head_share < 0.5   # the head of the embedding, head and final norm
    budgets = planning_budgets(engine._config, engine.tiers, 2, 12, seen[0])
    assert (budgets["trainable_share"], budgets["non_block_trainable_share"]) == (share, head_share)
    engine.destroy()


def test_planner_gets_each_streamed_layers_measured_size(monkeypatch):
    """A mixture-of-experts layer holds far more parameters than the dense estimate from its config: the
    planner is given each streamed block's parameter count, measured on the model."""
    import lazytrain.engine.engine as engine_module
    seen = {}

    def spy(cfg, num_layers, tiers, model_config, micro_batch, trainable, **kw):
        seen["model_config"] = model_config
        return build_plan(cfg, num_layers, tiers, model_config, micro_batch, trainable, **kw)
    build_plan = engine_module.build_plan
    monkeypatch.setattr(engine_module, "build_plan", spy)
    model = make_hf_model("mixtral")
    lazytrain.initialize(model=model, config=ds_config())
    measured = seen["model_config"]["layer_params"]
    assert measured == [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    from lazytrain.planner.models import ModelShape
    estimate = ModelShape.from_hf_config({k: v for k, v in seen["model_config"].items() if k != "layer_params"})
    planned = ModelShape.from_hf_config(seen["model_config"])
    assert [l.params for l in planned.layers] == measured == [l.params for l in estimate.layers]
    assert planned.layers[0].active_params < measured[0] / 1.5      # a token passes through 2 of 4 experts
    assert planned.dtype_bytes == 4         # this engine computes in fp32, whatever the model was saved in


def test_milp_policy_in_a_script_without_a_main_guard(tmp_path):
    """The planner runs in a child interpreter that does not re-import the user's script, so a plain
    top-level training script (no ``if __name__ == "__main__":``) plans once and trains."""
    import subprocess
    import sys
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, lazytrain\n"
        "import sys; sys.path.insert(0, %r)\n"
        "from engine_models import make_model\n"
        "model = make_model('llama')\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},\n"
        "       'lazytrain': {'policy': 'milp', 'hardware': 'h200', 'seq_len': 12, 'milp_time_limit': 5}}\n"
        "engine, *_ = lazytrain.initialize(model=model, config=cfg)\n"
        "print('PLANNED', engine.plan.policy)\n" % str(__import__("pathlib").Path(__file__).parent))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "PLANNED milp"
    assert "bootstrapping phase" not in done.stderr


def test_milp_policy_plans_and_trains(tmp_path):
    """policy "milp": the planner's Plan for this model (h200 profile, tight GPU budget) runs and
    matches plain PyTorch."""
    model = make_model("llama")
    data = batches(3)
    engine = assert_trains_like_plain(model, data, ds_config(policy="milp", hardware="h200", seq_len=12,
                                                             gpu_memory="2GB", milp_time_limit=10))
    # solved to optimality (the model with unsplit internals copies at least: this toy's windows last
    # microseconds, and HiGHS's feasibility tolerance of 1e-7 s can leave the split model's proof open)
    assert engine.plan.policy.startswith("milp") and engine.plan.prediction["solver"]["detail"].startswith("Optimal")


def test_milp_policy_on_the_cpu_takes_a_profile_without_links_as_bench_tiers_writes_it_there(tmp_path):
    """``lazytrain bench tiers`` on a machine without a GPU measures no host-to-device link: the CPU's
    "device" is host memory, and the engine takes a memory copy's rate for the missing links."""
    import json
    from lazytrain.planner.hardware import CATALOG
    profile = {**CATALOG["h200"].to_dict(), "name": "cpu-only", "h2d_gbps": None, "d2h_gbps": None}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile))
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(
        policy="milp", hardware=str(path), seq_len=12, gpu_memory="2GB", milp_time_limit=10, device="cpu"))
    assert engine.plan.policy.startswith("milp")
    # bench writes no GPU memory there either: without 'lazytrain.gpu_memory' the setting to give is named (the
    # profile's own error advised `lazytrain plan --base`, a command-line flag)
    path.write_text(json.dumps({**profile, "gpu_mem_bytes": None}))
    with pytest.raises(ConfigError, match="^" + re.escape(
            "config 'lazytrain.policy' \"milp\" needs the device's memory budget, which hardware profile "
            "'cpu-only' does not give (a profile `lazytrain bench tiers` measured without a GPU) and this cpu device "
            "has no card to read it from: set 'lazytrain.gpu_memory' (for the CPU, the memory the plan may hold as "
            "the device's)") + "$"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(
            policy="milp", hardware=str(path), seq_len=12, milp_time_limit=10, device="cpu"))


def test_milp_policy_plans_the_configs_whole_step_with_its_accumulation():
    cfg = ds_config(policy="milp", hardware="h200", seq_len=12, gpu_memory="2GB", milp_time_limit=10,
                    _top={"gradient_accumulation_steps": 3})
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    assert engine.plan.prediction["grad_accum"] == 3 and engine.plan.micro_batch_size == 2


@pytest.mark.parametrize("selection", [{"type": "AdamW8bit"}, {"type": "AdamW", "states": "8bit"}])
def test_hybrid_8bit_optimizer_selected_by_config(selection):
    """optimizer.type AdamW8bit (or lazytrain.optimizer_states 8bit) trains through HybridAdamW: large
    block matrices keep 8-bit moments, norms keep fp32, clipping happens inside its update, and the
    losses follow fp32 AdamW's within 2% over 10 steps."""
    from lazytrain.optim.hybrid_adamw import HybridAdamW
    model = make_model("llama")
    data = batches(1) * 10
    fp32 = train_engine(copy.deepcopy(model), [], ds_config())
    section = {"optimizer_states": "8bit", "hybrid_threshold": 1024} if "states" in selection \
        else {"hybrid_threshold": 1024}
    cfg = ds_config(**section)
    cfg["optimizer"]["type"] = selection["type"]
    cfg["optimizer"]["params"]["lr"] = 1e-3
    engine, opt, _, _ = lazytrain.initialize(model=model, config=cfg)
    assert isinstance(opt, HybridAdamW) and engine._fused_clip
    fp32.optimizer.param_groups[0]["lr"] = 1e-3
    for x, y in data:
        a, b = lm_loss(engine(x), y), lm_loss(fp32(x), y)
        assert abs(a.item() - b.item()) <= 0.02 * b.item()
        engine.backward(a)
        engine.step()
        fp32.backward(b)
        fp32.step()
        assert engine.get_global_grad_norm() == pytest.approx(fp32.get_global_grad_norm(), rel=0.05)
    report = opt.state_report()
    text = str(report)
    assert "q_proj" in text and "norm" in text
    state = opt.state_dict()["state"]
    assert any(v.dtype == torch.uint8 for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))


def test_generate_with_kv_cache_through_streamed_layers():
    """Hugging Face generate() (KV cache, one token at a time) runs through the streamed blocks and
    produces the same tokens as the unwrapped model."""
    model = make_model("llama")
    model.config.use_cache = True
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    engine.eval()
    ids = torch.tensor([[1, 2, 3, 4]], device=engine.device)   # generate() is the module's: no engine moves them
    with torch.no_grad():
        got = engine.module.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        expect = ref.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("family, graph, entry", [
    (f, g, e) for f in ("llama", "qwen2", "mistral", "gpt2") for g in (True, False) for e in ("engine", "module")] + [
    (f, False, "engine") for f in ("qwen3", "gemma", "gemma2", "phi3", "mixtral", "qwen2moe")])
def test_transformers_families_with_their_kv_cache_default_match_pytorch(family, graph, entry):
    """Models as users build them, with use_cache on (the config default). Through engine(x) a training
    forward asks for no KV cache (as gradient checkpointing does); calling the module directly, the model
    hands its blocks a cache (GPT-2 by position), which the forward fills once, as plain PyTorch does,
    and the blocks re-run in backward do without. GPT-2's blocks are named in the config. Clipping is
    off here: these models' key biases have a zero gradient up to rounding noise, which Adam turns into
    updates that any change in the clip factor's last bit changes."""
    try:
        model = make_hf_model(family)
    except AttributeError as e:   # a family newer than the installed transformers
        pytest.skip(str(e))
    assert model.config.use_cache
    data = batches(5)
    ref = reference_train(model, data, clip=0.0, device=AUTO_DEVICE)
    section = {"checkpoint_interval": 2, "last_segment_graph": graph}
    if family == "gpt2":
        section["blocks"] = "transformer.h"
    cfg = ds_config(**section)
    cfg["gradient_clipping"] = 0.0
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    call = engine if entry == "engine" else engine.module
    for x, y in data:
        engine.backward(lm_loss(call(x.to(engine.device)), y))   # the module called directly moves no input
        engine.step()
    assert engine.blocks_path == ("transformer.h" if family == "gpt2" else "model.layers")
    assert max_rel_diff(engine.module, ref) < RTOL


def test_a_model_wrapping_a_transformers_model_as_peft_does_gets_no_kv_cache_in_a_training_forward():
    """PEFT's models take use_cache through **kwargs into the model they wrap (get_base_model()): a training
    forward asks that model for no KV cache too, or every layer's keys and values stay on the device."""
    class PeftLike(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_model, self.config = base, base.config

        def get_base_model(self):
            return self.base_model

        def forward(self, *args, **kwargs):
            return self.base_model(*args, **kwargs)
    model = PeftLike(make_hf_model("llama"))
    assert model.config.use_cache
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    out = engine(x.to(engine.device))
    assert out.past_key_values is None
    engine.backward(lm_loss(out, y))
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("k, graph", [(2, True), (2, False), (1, False)])
def test_dropout_masks_are_replayed_in_recompute(family, k, graph):
    """With dropout on (GPT-2: embeddings, attention, residual; Llama: attention), a block re-run in
    backward draws the masks its forward drew, and the re-runs leave the random stream where plain
    PyTorch leaves it, so training matches plain PyTorch from the same seed within 1e-5."""
    model = make_hf_model(family, dropout=0.1)
    model.config.use_cache = False
    data = batches(4)
    torch.manual_seed(123)
    ref = reference_train(model, data, clip=0.0, device=AUTO_DEVICE)
    after_ref = (torch.rand(1), torch.rand(1, device=AUTO_DEVICE))   # CUDA dropout draws from CUDA's generator
    section = {"checkpoint_interval": k, "last_segment_graph": graph}
    if family == "gpt2":
        section["blocks"] = "transformer.h"
    cfg = ds_config(**section)
    cfg["gradient_clipping"] = 0.0
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    torch.manual_seed(123)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert torch.equal(torch.rand(1), after_ref[0]) and torch.equal(torch.rand(1, device=AUTO_DEVICE), after_ref[1])
    engine.wait_for_update()
    assert max_rel_diff(engine.module, ref) < RTOL


@pytest.mark.parametrize("first, then", [("train", "eval"), ("eval", "train")])
def test_a_re_run_block_keeps_the_mode_of_its_forward_when_the_model_switches_before_backward(first, then):
    """A forward in one mode, then model.train()/eval(), then its backward: the blocks re-run in backward run
    dropout as their forward did (autograd's recorded graph would), so the gradients are plain PyTorch's
    (within 1e-5), and the model is left in the mode it was switched to."""
    from lazytrain.utils import safe_get_full_grad
    model = make_hf_model("gpt2", dropout=0.2)
    model.config.use_cache = False
    x, y = batches(1)[0]
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    getattr(ref, first)()
    torch.manual_seed(5)
    loss = lm_loss(ref(x.to(AUTO_DEVICE)), y.to(AUTO_DEVICE))
    getattr(ref, then)()
    loss.backward()
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2,
                                                                         blocks="transformer.h"))
    getattr(engine, first)()
    torch.manual_seed(5)
    out = engine(x)
    getattr(engine, then)()
    engine.backward(lm_loss(out, y))
    worst = max(((safe_get_full_grad(p).cpu() - q.grad.cpu()).norm() / q.grad.norm()).item()
                for p, q in zip(engine.module.parameters(), ref.parameters()) if q.grad is not None)
    assert worst < 1e-5
    assert all(m.training == (then == "train") for m in engine.module.modules())


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_module_load_state_dict_reaches_masters_and_compute_copies(bf16):
    """model.load_state_dict(...) called by the user after initialize: the next forward computes with
    the loaded weights (bf16: the streamed layers' compute copies and the non-block fp32 masters)."""
    fresh = make_model("llama")
    model = make_model("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    cfg = ds_config(checkpoint_interval=2, _top={"bf16": {"enabled": True}} if bf16 else {})
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.module.load_state_dict(fresh.state_dict())
    loaded = engine.module_state_dict()   # the fp32 masters
    assert all(torch.equal(loaded[n], t) for n, t in fresh.state_dict().items())
    w = engine.weights
    for i in range(w.num_layers):
        stored = w.weights_tier.read(w._key(i)).wait()
        assert torch.equal(stored, w.master[i].to(stored.dtype))
    with torch.no_grad():
        got = engine(x).logits.float()
        expect = (fresh.to(torch.bfloat16) if bf16 else fresh).to(AUTO_DEVICE)(x.to(AUTO_DEVICE)).logits.float()
    torch.testing.assert_close(got, expect, rtol=0, atol=0 if not bf16 else 2e-2)


@pytest.mark.parametrize("device", ["mps", "xpu:0", "tpu"])
def test_unsupported_device_is_a_clear_error(device):
    with pytest.raises(ConfigError, match=f"config 'lazytrain.device' must be \"auto\", \"cpu\", \"cuda\" or "
                                          f"\"cuda:N\", got '{device}'"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(device=device))


def test_half_precision_model_with_a_float32_config_is_a_clear_error():
    model = make_hf_model("llama").to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"the model's parameters are bfloat16 but the config trains in float32 "
                                          r"\(no 'bf16' or 'fp16' section enabled\): add \"bf16\""):
        lazytrain.initialize(model=model, config=ds_config())
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(_top={"bf16": {"enabled": True}}))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.was_step_applied()


@pytest.mark.parametrize("target", ["submodule", "engine", "tied-name-only"])
def test_load_state_dict_on_a_submodule_or_the_engine_reaches_masters_and_copies(target):
    """bf16: loading into model.model (prefix-free keys of a submodule), into the engine ("module."
    keys), or a partial state dict naming a tied weight by its second name, updates the fp32 masters and
    the streamed compute copies; assign=True is a clear error; destroy() leaves no hook behind."""
    fresh = make_hf_model("gpt2")
    model = make_hf_model("gpt2")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(
        checkpoint_interval=2, blocks="transformer.h", _top={"bf16": {"enabled": True}}))
    full = fresh.state_dict()
    if target == "submodule":
        engine.module.transformer.load_state_dict({k[len("transformer."):]: v for k, v in full.items()
                                                   if k.startswith("transformer.")})
        expect = {k: v for k, v in full.items() if k.startswith("transformer.")}
    elif target == "engine":
        engine.load_state_dict({"module." + k: v for k, v in full.items()})
        expect = full
    else:
        engine.module.load_state_dict({"lm_head.weight": full["lm_head.weight"]}, strict=False)
        expect = {"transformer.wte.weight": full["lm_head.weight"]}
    masters = engine.module_state_dict()
    assert all(torch.equal(masters[k], v) for k, v in expect.items())
    w = engine.weights
    for i in range(w.num_layers):
        assert torch.equal(w.weights_tier.read(w._key(i)).wait(), w.master[i].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"assign=True\) cannot replace the parameters"):
        engine.module.load_state_dict(full, assign=True)
    engine.destroy()
    assert not any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules())


def test_training_forward_with_a_filled_kv_cache_is_a_clear_error():
    from transformers import DynamicCache
    model = make_hf_model("llama")
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    ids = torch.tensor([[1, 2, 3, 4]], device=engine.device)   # the module called directly moves no input
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x / 4.x
    with torch.no_grad():
        out = engine.module(ids, use_cache=True, **{name: DynamicCache()})
    cache = getattr(out, name)
    assert cache.get_seq_length() == 4
    with pytest.raises(ExecutorError, match="block 0 got a KV cache already holding 4 positions in a forward with "
                                            "gradients"):
        engine(torch.tensor([[5]]), use_cache=True, **{name: cache})


@pytest.mark.parametrize("k", [2, 6], ids=["k2", "whole-stack-graph"])
@pytest.mark.parametrize("frozen", ["embedding", "layer0", "layer3", "layer3.fc1.weight", "embedding+layer0"])
def test_frozen_parameters_match_pytorch(frozen, k):
    """Frozen embeddings (nothing flowing into block 0 requires grad), a frozen first or middle
    block, or one frozen tensor: trainable parameters match plain PyTorch and frozen ones never move.
    With k = 6 every block keeps its forward graph, except a frozen block 0 with nothing flowing in."""
    model = make_model("modulelist")
    for part in frozen.split("+"):
        if part == "embedding":
            model.emb.weight.requires_grad_(False)
        elif part.startswith("layer") and "." not in part:
            model.stack[int(part[5:])].requires_grad_(False)
        else:
            model.stack[3].fc1.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = batches(4)
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, fused=True)
    for x, y in data:
        lm_loss(ref(x.to(AUTO_DEVICE)), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
    engine = train_engine(model, data, ds_config(checkpoint_interval=k, last_segment_graph=True))
    assert max_rel_diff(engine.module, ref) < RTOL
    assert not pass_keys(engine)
    params = dict(engine.module.named_parameters())
    assert before and all(torch.equal(params[n].detach().cpu(), v) for n, v in before.items())


def test_bf16_accumulates_non_block_grads_in_fp32():
    """GAS 4 in bf16: the head and embedding gradients reach their fp32 masters after every micro-batch
    (the compute-dtype .grad is consumed), so accumulation is in fp32."""
    model = make_model("llama")
    cfg = ds_config(_top={"bf16": {"enabled": True}})
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    head = engine.module.lm_head.weight
    assert head.grad is None and engine.masters.master_of(head).grad.dtype == torch.float32


@pytest.mark.parametrize("accumulation", [1, 2])
def test_non_block_optimizer_state_on_the_host_or_the_device_trains_alike(accumulation):
    """'lazytrain.non_block_state': the embedding's and head's fp32 masters, gradients and moments on the
    host by default (a GPU keeps only their bf16 copies, as the planner counts), or on the device. The
    training is the same either way. On the CPU both homes are the same memory and the same kernel: equal,
    bit for bit, after several steps. On a GPU the device's masters are updated by torch's fused AdamW and
    the host's by HybridAdamW's kernel (and the norm summed there), which round apart by an fp32 ulp or so;
    in bf16 such an ulp moves a compute copy by a whole bf16 ulp wherever it straddles a rounding boundary,
    and every forward after it trains apart (on the CPU, one such flip after the first step leaves every
    tensor 1e-4 to 0.3 apart): so there one step, whose gradients both homes get alike."""
    model = make_model("llama")
    on_cpu = AUTO_DEVICE.type == "cpu"
    data = batches(4 if on_cpu else accumulation)
    trained = {}
    for where in ("auto", "host", "device"):
        cfg = ds_config(checkpoint_interval=2, _top={"bf16": {"enabled": True}}, non_block_state=where)
        cfg["gradient_accumulation_steps"] = accumulation
        engine = train_engine(copy.deepcopy(model), data, cfg)
        head = engine.masters.master_of(engine.module.lm_head.weight)
        want = engine.device if where == "device" else torch.device("cpu")
        assert head.device.type == want.type and head.dtype == torch.float32, where
        assert engine.module.lm_head.weight.device.type == engine.device.type   # the bf16 copy computes there
        trained[where] = engine.module_state_dict()
        engine.destroy()
    for name, w in trained["host"].items():
        assert torch.equal(trained["auto"][name], w), name
        if on_cpu:
            assert torch.equal(trained["device"][name], w), name
        else:
            assert ((trained["device"][name] - w).abs().max() / w.abs().max()).item() < 1e-5, name


@pytest.mark.parametrize("frozen_below", [0, 2])
def test_retain_graph_trains_and_a_second_backward_through_the_forward_is_a_clear_error(frozen_below):
    """accelerate's backward(loss, retain_graph=True) goes to engine.backward: one backward with it trains as
    without it (it was refused up front); a second through the same forward is refused by the executor, also
    where the backward stops above block 0 (frozen blocks below: the pass is never released)."""
    model = make_model("llama")
    for block in model.model.layers[:frozen_below]:
        block.requires_grad_(False)
    if frozen_below:
        model.get_input_embeddings().requires_grad_(False)
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config())
    for x, y in data:
        loss = lm_loss(engine(x), y)
        engine.backward(loss, retain_graph=True)
        engine.step()
    assert max_rel_diff(engine.module, ref) < 1e-5
    x, y = data[0]
    loss = lm_loss(engine(x), y)
    engine.backward(loss, retain_graph=True)
    with pytest.raises(ExecutorError, match=r"a second backward through the same forward \(backward\("
                                            r"retain_graph=True\), then backward again\) is not supported"):
        engine.backward(loss)
    engine.destroy()


def test_weights_streamed_from_nvme_match_pytorch(tmp_path):
    """zero_optimization.offload_param.device "nvme": the compute copies of the block weights live on the
    NVMe tier and every use reads them into the streaming slots."""
    model = make_model("llama")
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    cfg = ds_config(checkpoint_interval=2,
                    _top={"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                              "nvme_path": str(tmp_path)}}})
    engine = train_engine(model, data, cfg)
    assert engine.weights.weights_tier.kind == "nvme" and not engine.weights.zero_copy
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()


# The "parallel" model (every block fed the embedding, the outputs summed) trains with a sensitivity to the clip
# coefficient that RTOL cannot hold: plain PyTorch with its own coefficient moved by one fp32 ulp at each of the
# three steps ends 1.3e-5 (torch's AdamW) and 2.6e-5 (HybridAdamW's arithmetic, the overlap reference) from
# itself, measured on the CPU. The engine's norm is summed in another order than torch's (per layer buffer, in
# fp64, not per parameter in fp32), so its coefficient may sit an ulp apart from the reference's: a bound
# above that sensitivity, not RTOL.
PARALLEL_RTOL = 1e-4


@pytest.mark.parametrize("kind", ["parallel", "between", "in-place"])
@pytest.mark.parametrize("k, graph", [(2, False), (3, True), (6, False)])
@pytest.mark.parametrize("weights", ["host", "nvme"], ids=["recorded-segment", "re-run-segment"])
def test_blocks_whose_input_is_not_the_previous_output_match_pytorch(kind, k, graph, weights, tmp_path):
    """A re-run segment cannot derive a block's input from the previous block's output when the model
    feeds every block the same input, or changes the hidden state between blocks: such an input is kept
    as given (with one warning), and training matches plain PyTorch. On the CPU a host-resident segment is
    recorded once with autograd; NVMe-resident weights take the GPU's path, re-running layer by layer.
    A hidden state changed in place between blocks is the same object with a new version."""
    model = make_model(kind)
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    top = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}} \
        if weights == "nvme" else {}
    cfg = ds_config(checkpoint_interval=k, last_segment_graph=graph, _top=top)
    with pytest.warns(UserWarning, match="block 1's input is not block 0's output") as seen:
        engine = train_engine(model, data, cfg)
    assert sum("is not block" in str(w.message) for w in seen) == 1
    assert max_rel_diff(engine.module, ref) < (PARALLEL_RTOL if kind == "parallel" else RTOL)
    assert pass_keys(engine) == []      # the kept inputs are freed with their pass
    engine.destroy()


def test_a_full_backward_hook_on_each_block_keeps_no_inputs_and_trains_like_plain(recwarn):
    """A full backward hook hands the next block an alias of the block's output (its identity autograd
    function), which was taken for another hidden state: every boundary was kept on the device, outside the
    plan, with a warning that the model changes the hidden state. The alias now counts as the output, and
    the hook, which here halves each block's input gradient, still runs in the backward."""
    model = make_model("llama")
    calls = []

    def halve(module, grad_in, grad_out):
        calls.append(1)
        return tuple(None if g is None else g * 0.5 for g in grad_in)
    for block in model.model.layers:
        block.register_full_backward_hook(halve)
    data = batches(3)
    engine = assert_trains_like_plain(model, data, ds_config(checkpoint_interval=3, last_segment_graph=False))
    assert len(calls) == 2 * 6 * 3   # plain PyTorch's six a step, and as many here
    assert not [w for w in recwarn if "is not block" in str(w.message)]
    x, y = data[0]
    out = engine(x)
    assert not [k for k in pass_keys(engine) if k.endswith(".input")]
    engine.backward(lm_loss(logits_of(out), y))
    engine.destroy()


class _AliasBetweenBlocksLM(ModuleListLM):
    """Block 0's output handed on as an alias that is not an autograd view (``.data``, numpy), then changed
    in place: the alias shows the new values, but keeps a version counter of its own."""

    def __init__(self, alias: str):
        torch.manual_seed(0)
        super().__init__(n_layers=6)
        self.alias = alias

    def forward(self, ids):
        x = self.emb(ids)
        for k, block in enumerate(self.stack):
            out = block(x)
            if k == 0:
                x = out.data if self.alias == "data" else torch.from_numpy(out.detach().numpy())
                out.mul_(0.5)
            else:
                x = out
        return self.head(self.extra[0](x))


@pytest.mark.parametrize("alias", ["data", "numpy"])
def test_an_alias_of_a_blocks_output_that_is_no_view_counts_as_another_input(alias):
    """Only an autograd view shares the output's version counter: an alias made otherwise, whose values the
    model then changed in place, was taken for the output itself, and the re-run fed block 1 the unchanged
    output (0.82 off plain PyTorch). It is kept as given, as any other input."""
    model = _AliasBetweenBlocksLM(alias)
    with pytest.warns(UserWarning, match="block 1's input is not block 0's output"):
        assert_trains_like_plain(model, batches(3), ds_config(checkpoint_interval=3, last_segment_graph=False)).destroy()


def test_hooks_inside_blocks_and_on_their_parameters_are_warned_of_once_each():
    """A forward hook on a module inside a streamed block runs on tensors without gradient, twice a training
    forward; a gradient hook on a block's parameter never runs. Both were silent (a penalty built in such a
    hook trained nothing). Each is said once, naming the module or parameter; a hook on the block itself
    runs once on outputs with gradient, and is not warned of."""
    model = make_model("llama")
    outputs = []
    model.model.layers[0].register_forward_hook(lambda m, a, o: outputs.append(o))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=3))
    x, y = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*pageable memory")
        engine.backward(lm_loss(logits_of(engine(x)), y))
        with torch.no_grad():   # transformers installs its own (inactive) hooks inside the blocks for these
            engine(x, output_attentions=True, output_hidden_states=True)
        assert any(layer.self_attn._forward_hooks for layer in model.model.layers)
        engine.backward(lm_loss(logits_of(engine(x)), y))   # ... which are not the user's
    assert len(outputs) == 3 and outputs[0].requires_grad
    model.model.layers[2].mlp.register_forward_hook(lambda m, a, o: None)
    model.model.layers[4].self_attn.register_forward_pre_hook(lambda m, a: None)
    model.model.layers[1].mlp.down_proj.weight.register_hook(lambda g: g * 0)
    with pytest.warns(UserWarning) as seen:
        engine(x)
    said = [str(w.message) for w in seen if "hook" in str(w.message)]
    assert said == [
        "lazytrain: forward hook(s) on model.layers.2.mlp and 1 more, inside a streamed block: the training forward "
        "of a block the backward re-runs runs without autograd, so a tensor such a hook keeps carries no gradient (a "
        "loss term built from it trains nothing, and tensor.register_hook on it fails), and the backward runs the "
        "block again, calling the hook a second time; in a block whose graph the forward records, a loss term built "
        "from it is refused at the backward (under retain_graph=True it trains nothing). A hook on the block itself "
        "runs once, on outputs that carry gradient",
        "lazytrain: gradient hook(s) on model.layers.1.mlp.down_proj.weight, a parameter of a streamed block, do not "
        "run: the block computes from streamed copies of its weights, and its gradients go to host buffers, not "
        "through the parameter. Read or change a gradient between engine.backward() and engine.step() with "
        "lazytrain.utils.safe_get_full_grad / safe_set_full_grad"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine(x)   # said once
        with torch.no_grad():
            engine(x)   # an evaluation forward: nothing to say
    engine.destroy()


def test_chained_blocks_keep_no_inputs(recwarn):
    """Models that pass each block's output straight to the next (Hugging Face decoders) keep nothing
    extra and get no warning."""
    engine = train_engine(make_model("llama"), batches(2), ds_config(checkpoint_interval=3, last_segment_graph=False))
    assert not [w for w in recwarn if "is not block" in str(w.message)]
    engine.destroy()


@pytest.mark.parametrize("weights", ["host", "nvme"], ids=["recorded-segment", "re-run-segment"])
@pytest.mark.parametrize("k, graph", [(2, False), (4, True)])
def test_blocks_that_differ_from_one_another_match_pytorch(weights, k, graph, tmp_path):
    """Blocks of different sizes and structures, named in config: each layer streams with its own layout
    through slots sized for the largest, and training matches plain PyTorch."""
    model = make_model("mixed-blocks")
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.stack]
    assert len(set(sizes)) == 4
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    top = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}} \
        if weights == "nvme" else {}
    engine = train_engine(model, data, ds_config(blocks="stack", checkpoint_interval=k, last_segment_graph=graph,
                                                 _top=top))
    assert engine.weights.layer_numels == sizes
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4"])
def test_transformers_models_whose_layers_differ_match_pytorch(family):
    """DeepSeek-V3 (a dense first layer, then mixture-of-experts layers) and Gemma 4 (sliding and global
    attention layers) are found at model.layers although their layers differ."""
    try:
        model = make_hf_model(family)
    except AttributeError as e:   # a family newer than the installed transformers
        pytest.skip(str(e))
    data = batches(3)
    ref = reference_train(model, data, clip=0.0, device=AUTO_DEVICE)
    cfg = ds_config(checkpoint_interval=2, last_segment_graph=False)
    cfg["gradient_clipping"] = 0.0
    engine = train_engine(model, data, cfg)
    assert engine.blocks_path == "model.layers" and len(set(engine.weights.layer_numels)) > 1
    assert max_rel_diff(engine.module, ref) < RTOL


def test_state_one_block_stores_and_another_reads_is_refused():
    """A block reading a tensor another block left in a shared mapping would get no gradient through it
    (Gemma 3n/4's shared KV states): a clear error, not silently wrong training."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("shared-read"), config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    with pytest.raises(ExecutorError, match=r"^block 3 read 'block1' from its SharedState argument, which block 1 "
                                             r"stored there: streamed blocks must pass everything through their "
                                             r"hidden state"):
        engine(x)


def test_block_reading_a_tensor_the_model_put_in_a_shared_mapping_is_refused():
    """A tensor that needs a gradient, handed to a block inside a mapping rather than as an argument, is
    not an input of the block's autograd Function: its gradient would be lost."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("shared-model-write"),
                                           config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    with pytest.raises(ExecutorError, match=r"^block 2 read 'blockmodel' from its SharedState argument, a tensor "
                                             r"that needs a gradient"):
        engine(x)


@pytest.mark.parametrize("how", ["config", "keyword"])
def test_router_aux_loss_is_refused_in_training(how):
    """The load-balancing loss is computed from router logits captured inside the streamed layers: it
    would get no gradient (or fail in backward), so a training forward that asks for it is refused;
    inference and output_router_logits=False run."""
    model = make_hf_model("mixtral")
    kwargs = {}
    if how == "config":
        model.config.output_router_logits = True
    else:
        kwargs["output_router_logits"] = True
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    with pytest.raises(ConfigError, match=r"^the model adds a router load-balancing loss computed from router "
                                          r"logits captured inside its layers \(output_router_logits=True\)"):
        engine(x, **kwargs)
    with torch.no_grad():
        engine(x, **kwargs)
    engine.backward(lm_loss(engine(x, output_router_logits=False), y))
    engine.step()
    # the model called itself: what transformers records for the forward is read as the first block begins
    with pytest.raises(ConfigError, match=r"^the model adds a router load-balancing loss computed from router "
                                          r"logits captured inside its layers \(output_router_logits=True\)"):
        model(x, **kwargs)
    with torch.no_grad():
        model(x, **kwargs)
    lm_loss(model(x, output_router_logits=False), y).backward()


@pytest.mark.parametrize("asked_by", ["config", "keyword"])
def test_router_aux_loss_asked_for_inside_a_wrapper_is_refused_in_training(asked_by):
    """Through engine(...) a wrapper without a config (or a composite model, whose text_config holds the
    flag) hid the request from the engine's check of its keywords and config: the backward failed ("backward
    through the graph a second time"), or with every layer re-run the router trained 9.6% away from PyTorch,
    silently. What transformers records for the forward is read as the first block begins, whoever asked."""
    model = make_hf_model("mixtral")
    if asked_by == "config":
        model.config.output_router_logits = True

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, **kwargs):
            if asked_by == "keyword":
                kwargs.setdefault("output_router_logits", True)
            return self.inner(x, **kwargs)

    for lt in ({"checkpoint_interval": 2}, {"checkpoint_interval": 1, "last_segment_graph": False}):
        engine, _, _, _ = lazytrain.initialize(model=Wrapper(model), config=ds_config(**lt))
        x, y = batches(1)[0]
        with pytest.raises(ConfigError, match=r"^the model adds a router load-balancing loss computed from router "
                                              r"logits captured inside its layers \(output_router_logits=True\); "
                                              r".*or its text_config in a composite model"):
            engine(x)
        engine.backward(lm_loss(engine(x, output_router_logits=False), y))
        engine.step()
        engine.destroy()


def test_attention_weights_in_a_training_forward_warn_once():
    model = make_hf_model("llama")
    model.config._attn_implementation = "eager"
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match="attention weights returned by a training forward"):
        out = engine(x, output_attentions=True)
    assert len(out.attentions) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(x, output_attentions=True)     # once only
        with torch.no_grad():
            engine(x, output_attentions=True)


@pytest.mark.parametrize("kind", ["aux-loss", "nested-aux-loss"])
@pytest.mark.parametrize("k, graph", [(2, False), (3, True), (1, False)])
@pytest.mark.parametrize("weights", ["host", "nvme"], ids=["recorded-segment", "re-run-segment"])
def test_auxiliary_loss_returned_by_blocks_gets_its_gradient(kind, k, graph, weights, tmp_path):
    """A block that returns (hidden, aux loss), the aux losses added into the training loss: backward
    differentiates each block from every output the loss used, so training matches plain PyTorch. So with
    the losses nested in the block's output ([hidden, {"aux": (loss, [loss])}]): their gradients were dropped
    in re-run layers and crashed the backward in recorded ones."""
    model = make_model(kind)
    data = batches(3)
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for x, y in data:
        (lm_loss(ref(x.to(AUTO_DEVICE)), y) + 0.1 * ref.aux).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    top = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}} \
        if weights == "nvme" else {}
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=k, last_segment_graph=graph,
                                                                         _top=top))
    for x, y in data:
        engine.backward(lm_loss(engine(x), y) + 0.1 * model.aux)
        engine.step()
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()


class _MisusingBlock(MLPBlock):
    """A block as a model may write it wrongly for streaming (``how``)."""

    def forward(self, x, shift):
        if self.how == "changes-its-input":
            x.mul_(0.5)
        if self.how == "changes-its-argument":
            shift.clamp_(0, 1)   # no value changes here; one that did would give the re-run other values
        if isinstance(shift, dict):
            shift = shift["shift"]
        h = x + self.fc2(F.gelu(self.fc1(self.norm(x)) + shift))
        return {"hidden": h} if self.how == "returns-a-dict" else h


class _MisusingLM(ModuleListLM):
    block = _MisusingBlock

    def __init__(self, how: str):
        super().__init__(n_layers=4)
        for blk in self.stack:
            blk.how = how
        self.how = how

    def forward(self, ids):
        x, shift = self.emb(ids), torch.zeros(64)
        for i, blk in enumerate(self.stack):
            with torch.no_grad() if self.how == "bottom-without-grad" and i < 2 else contextlib.nullcontext():
                out = blk(x, {"shift": shift} if self.how == "changes-a-dict-entry-after" else shift)
            if self.how == "changes-its-input-after":
                x.add_(0.3)   # x += blk(x); a re-run from the kept input would start from x + 0.3
            x = out["hidden"] if isinstance(out, dict) else out
            if self.how in ("changes-an-argument-after", "changes-a-dict-entry-after"):
                shift.add_(0.3)   # plain PyTorch allows it (x + shift saves no shift); a re-run would see it
        return self.head(self.extra[0](x))


def test_a_block_that_changes_its_argument_trains_where_no_backward_re_runs_it():
    """Differentiated from the graph its forward recorded (policy offload_all), a block is never re-run: its
    own in-place change of an argument is plain PyTorch's business, not refused."""
    engine, _, _, _ = lazytrain.initialize(model=_MisusingLM("changes-its-argument"),
                                           config=ds_config(policy="offload_all"))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.was_step_applied()


@pytest.mark.parametrize("how, message", [
    ("returns-a-dict", "block 0 returned an object of type dict: a streamed block returns its hidden state (a tensor), "
                       "or a tuple or list that begins with it"),
    ("changes-its-input", "block 0 changed its hidden state in place in a training forward"),
    ("changes-its-argument", "block 0 changed its positional argument 2 in place in a training forward"),
    ("changes-an-argument-after", "block 2's positional argument 2 (a tensor of shape (64,)) was changed in place "
                                  "since the forward called the block"),
    # these two trained wrong in silence too: a tensor in a dict argument, and the hidden state itself
    ("changes-a-dict-entry-after", "block 2's positional argument 2['shift'] (a tensor of shape (64,)) was changed "
                                   "in place since the forward called the block"),
    ("changes-its-input-after", "block 2's hidden-state input (a tensor of shape (2, 12, 32)) was changed in place "
                                "after the forward called the block: the backward re-runs the block from the input "
                                "its forward was given"),
    ("bottom-without-grad", "block 2 was called with gradients enabled after the blocks below it ran without (under "
                            "torch.no_grad())"),
    ("changes-its-input-in-a-recorded-layer", "block 0 changed a tensor it was given (its hidden state or an "
                                              "argument) in place in a training forward"),
])
def test_block_calls_a_rerun_cannot_repeat_are_refused_by_name(how, message):
    """Each trained wrongly in silence (an argument changed after the call: the re-run saw the new values) or
    failed with an error naming nothing of the cause (a dict's first key taken for the hidden state, torch's
    "a leaf Variable that requires grad", blocks "called out of order")."""
    recorded = how.endswith("-in-a-recorded-layer")   # its input a leaf of the graph the forward records
    config = ds_config(policy="offload_all") if recorded else ds_config(checkpoint_interval=2, last_segment_graph=False)
    engine, _, _, _ = lazytrain.initialize(model=_MisusingLM(how.removesuffix("-in-a-recorded-layer")), config=config)
    x, y = batches(1)[0]
    with pytest.raises(ExecutorError) as e:
        engine.backward(lm_loss(engine(x), y))
    assert str(e.value).startswith(message)


def test_list_handed_to_blocks_is_the_models_own():
    """Lists and dicts reach the block as they are: what a block appends, the model sees (in inference
    and in training). In training such a tensor carries no gradient, which one warning says."""
    model = make_model("sink")
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    engine.eval()
    with torch.no_grad():
        engine(x)
        ref.eval()(x.to(AUTO_DEVICE))
    assert len(model.sink) == 6 and all(torch.equal(a, b) for a, b in zip(model.sink, ref.sink))
    engine.train()
    with pytest.warns(UserWarning, match=r"block 0 added a tensor to a list or dict it was handed, in a training "
                                         r"forward: a tensor the block makes carries no gradient"):
        engine(x)
    assert len(model.sink) == 6


class _NestedShiftBlock(MLPBlock):
    def forward(self, x, ctx):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)) + ctx["inner"]["shift"]))


class _NestedShiftLM(ModuleListLM):
    """Hands each block a dict nested in a dict, then replaces the tensor in the inner one after the call."""
    block = _NestedShiftBlock

    def forward(self, ids):
        x = self.emb(ids)
        for i, blk in enumerate(self.stack):
            ctx = {"inner": {"shift": torch.linspace(-1, 1, 64) * (i + 1)}}
            x = blk(x, ctx)
            ctx["inner"]["shift"] = torch.zeros(64)   # replaced, not changed in place: no version moves
        return self.head(self.extra[0](x))


class _CopyingBlock(MLPBlock):
    def forward(self, x):
        x = x.clone()   # (so plain autograd saves no block input)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _SequenceFirstLM(ModuleListLM):
    """Sequence-first: every block input is a transposed view, and the model changes it after the call."""
    block = _CopyingBlock

    def forward(self, ids):
        x = self.emb(ids).transpose(0, 1)
        for blk in self.stack:
            out = blk(x)
            x.add_(0.5)   # the loss no longer uses it; the device tier kept a contiguous copy of the input
            x = out
        return self.head(self.extra[0](x)).transpose(0, 1)


def test_a_tensor_replaced_in_a_nested_container_after_the_call_is_not_seen_by_the_re_run():
    """The snapshot of a container was one level deep: the re-run read the inner dict's new tensor (weights
    1.74 away from plain PyTorch's), without a word."""
    torch.manual_seed(0)
    assert_trains_like_plain(_NestedShiftLM(n_layers=4), batches(2),
                             ds_config(checkpoint_interval=2, last_segment_graph=False))


def test_a_non_contiguous_input_the_device_tier_copied_trains_though_the_model_changes_it_after_the_call():
    """Kept on the device, a non-contiguous input is the tier's own copy: the model cannot change it, and it was
    neither watched (a refusal of a model that trains) nor held beside the copy (twice its bytes)."""
    torch.manual_seed(0)
    engine = assert_trains_like_plain(_SequenceFirstLM(n_layers=6), batches(2),
                                      ds_config(checkpoint_interval=2, last_segment_graph=False, boundary_home="hbm"))
    engine.destroy()


@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_blocks_re_run_see_their_containers_as_at_their_call(graph):
    """A dict the model reuses, changing an entry before each block: a block re-run in backward sees it
    as its forward call did (not as it is by then), and matches plain PyTorch."""
    model = make_model("reused-dict")
    data = batches(2)
    assert_trains_like_plain(model, data, ds_config(checkpoint_interval=2, last_segment_graph=graph))


@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_list_kept_across_steps_collects_once_per_forward(graph):
    """Re-runs in backward append to throwaway copies, not to the model's list; tensors blocks appended
    in an earlier step are not taken for the model's own in the next. What a block appends carries no
    gradient in every layer, as the warning says: a layer that records its graph (the last segment's) made it
    with one, and a loss that used it failed with autograd's "backward through the graph a second time"."""
    model = make_model("kept-sink")
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2,
                                                                         last_segment_graph=graph))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the warning that appended tensors carry no gradient
        for x, y in batches(2):
            out = engine(x)
            assert not any(t.requires_grad for t in model.sink)
            engine.backward(lm_loss(out, y) + 0.1 * sum(t.sum() for t in model.sink[-6:]))
            assert len(model.sink) in (6, 12)
            engine.step()
    assert len(model.sink) == 12


class _InputSinkBlock(torch.nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x, sink):
        sink.append(x)   # its input: the caller's tensor, whose graph reaches outside the block
        return x + torch.tanh(self.fc(x))


def test_a_blocks_input_it_appends_to_a_list_keeps_its_gradient():
    """What a block makes and appends is detached (the warning's rule), but its own input is the caller's
    tensor: a loss that uses it gets plain PyTorch's gradient, in the re-run layers (0, 1) and in the graph
    tail (2, 3), whose blocks compute from a fresh leaf made of it (the detaching took it, 0.76 off; then the
    graph tail's, 0.3 off)."""
    from lazytrain.utils import safe_get_full_grad
    model = _SinkLM(_InputSinkBlock)
    ref = copy.deepcopy(model)
    x, y = batches(1)[0]
    (lm_loss(ref(x), y) + sum(t.pow(2).mean() for t in ref.sink)).backward()
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    assert engine.plan.graph_start() == 2
    with pytest.warns(UserWarning, match="added a tensor to a list or dict it was handed"):
        out = engine(x)
    assert all(t.requires_grad for t in model.sink)
    engine.backward(lm_loss(out, y) + sum(t.pow(2).mean() for t in model.sink))
    for name, p in ref.named_parameters():
        got = safe_get_full_grad(dict(model.named_parameters())[name])
        assert torch.allclose(got, p.grad, rtol=1e-5, atol=1e-7), name
    engine.destroy()


@pytest.mark.parametrize("container", ["list", "dict"])
def test_tensor_needing_a_gradient_inside_a_list_or_dict_argument_is_refused(container):
    """Only tensors passed directly or in tuples are inputs of a block's autograd Function."""
    model = make_model("shared-store")      # blocks take (x, shared); block 1 stores into it
    scale = torch.nn.Parameter(torch.ones(32))
    arg = [scale] if container == "list" else {"scale": scale}
    lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, _ = batches(1)[0]
    with pytest.raises(ExecutorError, match=rf"^block 0 was handed a {container} holding a tensor that needs a "
                                            rf"gradient"):
        model.stack[0](model.emb(x.to(model.emb.weight.device)), arg)


def test_state_stored_but_read_by_no_other_block_trains():
    model = make_model("shared-store")
    data = batches(3)
    assert_trains_like_plain(model, data, ds_config(checkpoint_interval=2, last_segment_graph=False))


def test_gemma4_kv_sharing_is_refused():
    try:
        model = make_hf_model("gemma4-kv-shared")
    except AttributeError as e:
        pytest.skip(str(e))
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    with pytest.raises(ExecutorError, match=r"num_kv_shared_layers=0"):
        engine(x)


@pytest.mark.parametrize("kind", ["llama", "checkpointing"], ids=["transformers-5-layers", "4.x-style-decoder"])
@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_model_gradient_checkpointing_is_turned_off_for_streamed_blocks(kind, graph):
    """Reentrant gradient checkpointing cannot be differentiated as the executor differentiates a block,
    and any checkpointing re-runs each block a second time: it is turned off (with a warning) while the
    engine trains the blocks, and back on after destroy()."""
    model = make_model(kind)
    if kind == "llama":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert flagged
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    with pytest.warns(UserWarning, match="gradient checkpointing is off for the streamed blocks"):
        engine = train_engine(model, data, ds_config(checkpoint_interval=2, last_segment_graph=graph))
    assert not any(m.gradient_checkpointing for m in flagged)
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()
    assert all(m.gradient_checkpointing for m in flagged)


@pytest.mark.parametrize("entry", ["engine", "module"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_turned_on_after_initialize_is_turned_off_again(reentrant, entry):
    """A script's gradient_checkpointing_enable() after initialize() sets the blocks' flags again: the next
    training forward turns them off (with the warning), so the blocks are not re-run twice (or, reentrant,
    differentiated the wrong way), training matches plain PyTorch, and destroy() turns them back on. The model
    called itself too: its first layer was checkpointed, reentrant, before the engine saw the pass (torch's
    "incompatible with .grad()" at the backward)."""
    model = make_model("llama")
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert flagged
    call = engine if entry == "engine" else engine.module
    with pytest.warns(UserWarning, match="gradient checkpointing is off for the streamed blocks"):
        for x, y in data:
            engine.backward(lm_loss(call(x.to(engine.device)), y))
            engine.step()
    engine.wait_for_update()
    assert not any(m.gradient_checkpointing for m in flagged)
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()
    assert all(m.gradient_checkpointing for m in flagged)


def test_a_forward_with_gradients_in_eval_mode_says_it_returns_no_kv_cache():
    """Through engine(x) a forward with gradients on asks for no cache in eval mode too: a decoding loop run
    with gradients on went on from past_key_values None, in silence (tokens other than plain PyTorch's)."""
    model = make_hf_model("llama")
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    x, _ = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine(x)                         # training mode: as documented, nothing to say
        engine.eval()
        with torch.no_grad():
            assert engine(x).past_key_values is not None   # decoding as generate() does: the cache
        assert engine(x, use_cache=False).past_key_values is None   # asked for no cache: nothing to say
    with pytest.warns(UserWarning) as seen:
        assert engine(x).past_key_values is None
        engine(x)
    said = [str(w.message) for w in seen if "KV cache" in str(w.message)]
    assert said == [
        "lazytrain: a forward with gradients on asks the model for no KV cache (use_cache=False), in eval mode too: "
        "its output's past_key_values is None, and a decoding loop fed it would go on without its context. Decode "
        "under torch.no_grad() (as generate() does), or pass use_cache explicitly (True: the cache is filled once, "
        "as in plain PyTorch, and is held in memory no plan budgets)"]
    assert engine(x, use_cache=True).past_key_values is not None
    engine.destroy()


def test_a_model_whose_use_cache_is_turned_on_after_initialize_gets_no_kv_cache_in_a_training_forward():
    """use_cache off at initialize, on again later (for an evaluation callback): a training forward still
    asks the model for no KV cache."""
    model = make_hf_model("llama")
    model.config.use_cache = False
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2))
    engine.module.config.use_cache = True
    x, y = batches(1)[0]
    out = engine(x.to(engine.device))
    assert out.past_key_values is None
    engine.backward(lm_loss(out, y))
    engine.step()


def test_weight_shared_by_two_blocks_is_refused():
    """Each block streams from its own buffers; a weight in two blocks would train one stale copy."""
    from lazytrain.engine.blocks import BlockDiscoveryError
    model = make_model("modulelist")
    model.stack[3].fc1.weight = model.stack[1].fc1.weight
    with pytest.raises(BlockDiscoveryError, match=r"^block 3's parameter 'fc1.weight' is also block 1's "
                                                  r"'fc1.weight': LazyTrain streams each block's weights"):
        lazytrain.initialize(model=model, config=ds_config())


def test_frozen_weight_shared_by_two_blocks_and_a_second_handle_to_the_blocks_train():
    """A frozen weight cannot go stale, so two blocks may share it; a second attribute naming the same
    block list shares nothing."""
    model = make_model("modulelist")
    model.stack[3].fc1.weight = model.stack[1].fc1.weight
    model.stack[1].fc1.weight.requires_grad_(False)
    model.handle = model.stack
    data = batches(3)
    assert_trains_like_plain(model, data, ds_config(blocks="stack", checkpoint_interval=2))


def test_weight_shared_by_a_block_and_a_module_outside_is_refused():
    from lazytrain.engine.blocks import BlockDiscoveryError
    model = make_model("modulelist")
    model.extra[0].bias = model.stack[2].fc2.bias
    with pytest.raises(BlockDiscoveryError, match=r"^the model's parameter 'extra.0.bias' is block 2's 'fc2.bias'"):
        lazytrain.initialize(model=model, config=ds_config())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_failed_initialize_leaves_the_model_as_it_was(bf16):
    """A config error found late in set-up (overlap_optimizer true with SGD) leaves no forward routing,
    hooks, bf16 weights or weights moved to the GPU behind: the model then trains in plain PyTorch exactly
    as an untouched copy."""
    model = make_model("llama")
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    cfg = ds_config(checkpoint_interval=2, overlap_optimizer=True)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    with pytest.raises(ConfigError, match="overlap_optimizer"):
        lazytrain.initialize(model=model, config=cfg)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("cpu")}   # as given
    trained = reference_train(model, data, device=AUTO_DEVICE)
    assert max_rel_diff(trained, ref) == 0.0


def test_destroy_gives_non_block_gradients_back_to_the_model():
    """bf16: during training the non-block weights run in bf16 with fp32 masters taking their gradients;
    destroy() hands back the fp32 model, on the device it was given on (on a GPU the embedding and head
    come back from it), whose plain backward leaves gradients on its own parameters."""
    model = make_model("llama")
    cfg = ds_config(checkpoint_interval=2)
    cfg["bf16"] = {"enabled": True}
    engine = train_engine(model, batches(1), cfg)
    master = engine.masters.master_of(model.lm_head.weight).detach().cpu()
    engine.destroy()
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("cpu")}
    assert model.lm_head.weight.dtype == torch.float32 and torch.equal(model.lm_head.weight.detach(), master)
    x, y = batches(1)[0]
    lm_loss(model(x), y).backward()
    assert model.lm_head.weight.grad is not None and model.model.embed_tokens.weight.grad is not None


@pytest.mark.parametrize("weights", ["host", "nvme"], ids=["in-place-weights", "streamed-weights"])
def test_inference_mode_evaluation_between_training_steps(weights, tmp_path):
    """An evaluation forward under torch.inference_mode() between steps: weights streamed into buffers
    that outlive it (the GPU's and NVMe's path) are fetched outside inference mode, so the tiers' worker
    threads can write them and training goes on, matching plain PyTorch."""
    model = make_model("llama")
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    top = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}} \
        if weights == "nvme" else {}
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2, _top=top))
    for x, y in data:
        engine.eval()
        with torch.inference_mode():
            expect = engine(x).logits
        engine.train()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert expect.shape == (2, 12, 32)
    assert max_rel_diff(engine.module, ref) < RTOL
    engine.destroy()


@pytest.mark.parametrize("kind", ["llama", "modulelist"])
@pytest.mark.parametrize("k, graph", [(2, False), (3, True), (6, False)])
def test_user_autocast_is_replayed_when_blocks_are_re_run(kind, k, graph):
    """A forward under the user's torch.autocast: the blocks re-run in backward (outside that context)
    replay its autocast state, as torch.utils.checkpoint does, so the gradients equal plain PyTorch's
    bit for bit. (Several steps are not compared: bf16 autocast turns the optimizers' last-bit
    differences into visible ones.)"""
    model = make_model(kind)
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    x, y = batches(1)[0]
    with torch.autocast(AUTO_DEVICE.type, dtype=torch.bfloat16):   # the autocast of the device computing
        out = ref(x.to(AUTO_DEVICE))
    lm_loss(out, y).backward()
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=k,
                                                                         last_segment_graph=graph))
    with torch.autocast(AUTO_DEVICE.type, dtype=torch.bfloat16):
        out = engine(x)
    engine.backward(lm_loss(out, y))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(safe_get_full_grad(p), q.grad.cpu()), name   # wherever the engine keeps it


@pytest.mark.parametrize("k, graph", [(2, False), (3, True)])
def test_gradient_of_the_input_alone_leaves_weight_gradients_alone(k, graph):
    """Adversarial training takes torch.autograd.grad(loss, inputs_embeds), perturbs the input and trains
    on the second forward: the first backward must not add into the blocks' weight gradients (it added
    them, 2.67 relative off plain PyTorch). backward(inputs=[...]) likewise."""
    model = make_model("llama")
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    x, y = batches(1)[0]
    x = x.to(AUTO_DEVICE)   # the embeddings are called directly, on the device computing

    def step(fwd, embed):
        emb = embed(x).detach().requires_grad_(True)
        g, = torch.autograd.grad(lm_loss(fwd(inputs_embeds=emb), y), emb)
        loss = lm_loss(fwd(inputs_embeds=(emb + 0.01 * g.sign()).detach()), y)
        emb3 = embed(x).detach().requires_grad_(True)
        lm_loss(fwd(inputs_embeds=emb3), y).backward(inputs=[emb3])
        return loss, g, emb3.grad
    loss_ref, g_ref, g3_ref = step(ref, ref.model.embed_tokens)
    loss_ref.backward()
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=k, last_segment_graph=graph))
    loss, g, g3 = step(engine, model.model.embed_tokens)
    engine.backward(loss)
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-8) and torch.allclose(g3, g3_ref, rtol=1e-5, atol=1e-8)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert torch.allclose(safe_get_full_grad(p), q.grad.cpu(), rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("graph", [True, False], ids=["last-graph", "all-recompute"])
def test_second_backward_through_one_forward_is_a_clear_error(graph):
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"),
                                           config=ds_config(checkpoint_interval=2, last_segment_graph=graph))
    x, y = batches(1)[0]
    loss = lm_loss(engine(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(ExecutorError, match=r"^this forward's streamed blocks were already differentiated"):
        loss.backward()


def test_second_order_backward_is_refused():
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(checkpoint_interval=2))
    x, y = batches(1)[0]
    emb = engine.module.model.embed_tokens(x.to(engine.device)).detach().requires_grad_(True)
    with pytest.raises(ExecutorError, match=r"^a backward with create_graph=True"):
        torch.autograd.grad(lm_loss(engine(inputs_embeds=emb), y), emb, create_graph=True)


def test_training_data_builds_a_dataloader_with_the_micro_batch():
    xs, ys = zip(*batches(3, batch=4))
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    engine, _, loader, _ = lazytrain.initialize(model=make_model("modulelist"), training_data=dataset,
                                                config=ds_config())
    assert loader is engine.training_dataloader and len(loader) == 6
    x, y = next(iter(loader))
    assert x.shape == (2, 12)


def test_training_data_keeps_the_last_smaller_batch_unless_dataloader_drop_last():
    xs, ys = zip(*batches(5, batch=1))
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    _, _, loader, _ = lazytrain.initialize(model=make_model("modulelist"), training_data=dataset, config=ds_config())
    assert [x.shape[0] for x, _ in loader] == [2, 2, 1]              # DeepSpeed's default keeps it
    _, _, loader, _ = lazytrain.initialize(model=make_model("modulelist"), training_data=dataset,
                                           config=ds_config(_top={"dataloader_drop_last": True}))
    assert [x.shape[0] for x, _ in loader] == [2, 2]


@pytest.mark.parametrize("launcher", [True, False])
def test_the_training_data_comes_in_deepspeeds_order_with_or_without_a_launcher(monkeypatch, launcher):
    """DeepSpeed's loader draws from a DistributedSampler shuffled from seed 0, whatever torch's random state
    (its engine needs LOCAL_RANK, which its set-up gives a process started alone too): the same order here, so
    the same script trains on the same batches. Started alone, the loader drew from a RandomSampler, whose
    order followed torch's random state and whose data_sampler.set_epoch (the README's resume advice) raised."""
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    if launcher:
        monkeypatch.setenv("LOCAL_RANK", "0")
    else:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    want = list(torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))
    orders = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        _, _, loader, _ = lazytrain.initialize(model=make_model("modulelist"), training_data=dataset,
                                               config=ds_config())
        orders.append([int(i) for (x,) in loader for i in x])
    assert orders[0] == orders[1] == want
    loader.data_sampler.set_epoch(0)   # the first pass again, as a resumed run asks for it
    assert [int(i) for (x,) in loader for i in x] == want


def test_deepspeeds_repeating_loader_answers_through_import_lazytrain_as_deepspeed(monkeypatch):
    """deepspeed.utils.RepeatingLoader, which DeepSpeed's examples wrap the engine's loader in to draw a set number
    of batches: each pass ends into the next, whose order is the sampler's next epoch (DeepSpeed's order for
    epochs 0 and 1); an empty loader ends the iteration."""
    import lazytrain as deepspeed
    monkeypatch.setenv("LOCAL_RANK", "0")
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    _, _, loader, _ = deepspeed.initialize(model=make_model("modulelist"), training_data=dataset, config=ds_config())
    batches_drawn = deepspeed.utils.RepeatingLoader(loader)
    drawn = [int(i) for _ in range(2 * len(loader)) for i in next(batches_drawn)[0]]
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert drawn == first + list(sampler) and first != list(sampler)
    assert list(deepspeed.utils.RepeatingLoader([])) == []


def test_training_data_that_is_no_dataset_or_an_iterable_with_a_sampler_is_refused():
    """initialize's training_data was not checked as deepspeed_io's is (a raw "object of type 'int' has no
    len()"); a sampler given with an IterableDataset was dropped without a word, where torch refuses it."""
    with pytest.raises(ValueError, match="^Training data must be a torch Dataset$"):
        lazytrain.initialize(model=make_model("modulelist"), training_data=42, config=ds_config())

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    with pytest.raises(ValueError, match="^DataLoader with IterableDataset: expected unspecified sampler option"):
        engine.deepspeed_io(Stream(), data_sampler=[0, 1])
    import numpy as np
    assert [len(b) for b in engine.deepspeed_io(list(range(7)), batch_size=np.int64(5), route="eval")] == [5, 2]


def test_deepspeed_io_builds_an_evaluation_loader_in_order():
    """``engine.deepspeed_io`` (DeepSpeed scripts build their evaluation loaders with it): the micro-batch size,
    ``initialize``'s collate_fn, the dataset's order on the eval and predict routes, a shuffled one on train."""
    dataset = torch.utils.data.TensorDataset(torch.arange(7))

    def collate(items):
        return torch.stack([x for (x,) in items])
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), training_data=dataset,
                                           collate_fn=collate, config=ds_config())
    for route in ("eval", "predict"):
        loader = engine.deepspeed_io(dataset, route=route)
        assert [x.tolist() for x in loader] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [x.tolist() for x in engine.deepspeed_io(dataset, batch_size=4, route="eval")] == [[0, 1, 2, 3], [4, 5, 6]]
    assert sorted(i for x in engine.deepspeed_io(dataset) for i in x.tolist()) == list(range(7))
    assert engine.deepspeed_io(dataset).collate_fn is collate
    # DeepSpeed's "encode" route shuffles as "train" does
    assert [x.tolist() for x in engine.deepspeed_io(dataset, route="encode")] == \
        [x.tolist() for x in engine.deepspeed_io(dataset, route="train")]
    # anything indexable with a length, as DeepSpeed takes it (a list, a Hugging Face dataset)
    assert [x.tolist() for x in engine.deepspeed_io([{"x": i} for i in range(3)], route="eval",
                                                    collate_fn=lambda rows: torch.tensor([r["x"] for r in rows]))] \
        == [[0, 1], [2]]
    with pytest.raises(ValueError, match=r"^Training data must be a torch Dataset$"):
        engine.deepspeed_io(42)
    with pytest.raises(ValueError, match=r"^deepspeed_io batch_size must be a whole number >= 1 \(or None: the "
                                         r"micro-batch size\), got 0$"):
        engine.deepspeed_io(dataset, batch_size=0)
    with pytest.raises(ValueError, match=r'^deepspeed_io route must be "train", "eval", "predict" or "encode", got '
                                         r'\'test\'$'):
        engine.deepspeed_io(dataset, route="test")
    engine.destroy()


class _WhereLoaded(torch.utils.data.Dataset):
    """Each sample says which process loaded it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid()])


def test_batches_are_loaded_in_the_training_process_unless_workers_are_asked_for():
    """DeepSpeed's loader forks two workers a rank; a forked worker shares the process's memory copy-on-write,
    and the first step of each epoch copied the host optimizer state it rewrote (a review measured +478 MiB for
    a 26M-parameter model's epoch): LazyTrain's loaders load in the training process unless
    ``num_local_io_workers`` asks for workers. An iterable dataset is read in this process (each worker would
    read the whole stream). Where CUDA is, initialize's loader is pinned, as DeepSpeed's."""
    engine, _, loader, _ = lazytrain.initialize(model=make_model("modulelist"), training_data=_WhereLoaded(),
                                                config=ds_config())
    assert loader.num_workers == 0 and {int(pid) for batch in loader for pid in batch[:, 1]} == {os.getpid()}
    assert loader.pin_memory == torch.cuda.is_available()
    assert engine.deepspeed_io(_WhereLoaded(), route="eval").num_workers == 0
    workers = engine.deepspeed_io(_WhereLoaded(), route="eval", num_local_io_workers=2)
    assert [b[:, 0].tolist() for b in workers] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    pids = {int(pid) for b in workers for pid in b[:, 1]}
    assert len(pids) == 2 and os.getpid() not in pids

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))
    assert engine.deepspeed_io(Stream(), num_local_io_workers=2).num_workers == 0
    engine.destroy()


def test_a_sampler_given_to_deepspeed_io_is_the_scripts_own_and_left_alone():
    """A sampler the script passes keeps the epoch the script sets (DeepSpeed's loader after 0.19 moves only a
    sampler it built itself): every pass is that epoch's order until the script sets another."""
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(5)
    loader = engine.deepspeed_io(dataset, data_sampler=sampler)

    def order(epoch):
        s = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        s.set_epoch(epoch)
        return list(s)
    assert [int(i) for (x,) in loader for i in x] == order(5)
    assert [int(i) for (x,) in loader for i in x] == order(5) and sampler.epoch == 5
    loader.data_sampler.set_epoch(6)
    assert [int(i) for (x,) in loader for i in x] == order(6)
    engine.destroy()


def test_the_planners_8bit_share_follows_the_groups_the_optimizer_holds():
    """HybridAdamW's per-group optimizer_states and min_8bit_size, and only the parameters given to it: the
    share of 8-bit moments the planner is told is the optimizer's own."""
    def share(groups_of):
        model = make_model("modulelist")
        cfg = ds_config(optimizer_states="8bit", hybrid_threshold=16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, opt, _, _ = lazytrain.initialize(model=model, model_parameters=groups_of(model), config=cfg)
        told = engine._model_budgets["hybrid_8bit_fraction"]
        held = [(p.numel(), opt._choose(p, g)[0]) for g in opt.param_groups for p in g["params"]]
        engine.destroy()
        return told, sum(n for n, k in held if k == "8bit") / sum(n for n, _ in held)
    told, held = share(lambda m: [{"params": list(m.parameters()), "optimizer_states": "fp32"}])
    assert told == held == 0.0
    told, held = share(lambda m: [{"params": list(m.stack.parameters())},
                                  {"params": list(m.head.parameters()), "min_8bit_size": 10 ** 9}])
    assert told == pytest.approx(held) and 0 < told < 1
    told, held = share(lambda m: (p for p in m.parameters()))   # a generator, read twice
    assert told == pytest.approx(held) and 0 < told < 1


def test_was_step_applied_is_false_after_a_micro_step_that_did_not_update():
    cfg = ds_config(_top={"gradient_accumulation_steps": 2, "train_batch_size": 4})
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    seen = []
    for x, y in batches(4):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        seen.append(engine.was_step_applied())
    assert seen == [False, True, False, True]


@pytest.mark.parametrize("precision,dtype", [(None, torch.float32), ("bf16", torch.bfloat16)])
def test_save_16bit_model_keeps_the_training_precision(tmp_path, precision, dtype):
    """As DeepSpeed: an fp32 run saves fp32 weights (not rounded to bf16), a bf16 run bf16 ones."""
    top = {"bf16": {"enabled": True}} if precision else {}
    engine = train_engine(make_model("llama"), batches(1), ds_config(_top=top))
    from safetensors.torch import load_file
    engine.save_16bit_model(str(tmp_path))                       # safetensors by default
    engine.save_16bit_model(str(tmp_path), "pytorch_model.bin")  # DeepSpeed's default name: torch.save, as asked
    trained = engine.module_state_dict()
    for saved in (load_file(str(tmp_path / "model.safetensors")),
                  torch.load(tmp_path / "pytorch_model.bin", weights_only=True)):
        assert {v.dtype for v in saved.values() if v.is_floating_point()} == {dtype}
        assert all(torch.equal(saved[k], v.to(dtype)) for k, v in trained.items())


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_keeps_a_buffer_in_the_dtype_the_engine_computes_with(tmp_path, stage):
    """A bf16 run computes with an fp32 buffer in fp32 (the engine casts parameters only): its 16-bit save
    and the consolidated state (HF Trainer's ZeRO-3 save) rounded it to bf16, so the file loaded back gave
    other logits."""
    from safetensors.torch import load_file
    model = make_model("llama")
    model.register_buffer("logit_bias", torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 3)
    engine = train_engine(model, batches(1), ds_config(_top={"bf16": {"enabled": True},
                                                             "zero_optimization": {"stage": stage}}))
    assert engine.module.logit_bias.dtype == torch.float32
    engine.save_16bit_model(str(tmp_path))
    for saved in (load_file(str(tmp_path / "model.safetensors")), engine._zero3_consolidated_16bit_state_dict()):
        assert saved["logit_bias"].dtype == torch.float32 and torch.equal(saved["logit_bias"], engine.module.logit_bias)
        assert {v.dtype for k, v in saved.items() if k != "logit_bias" and v.is_floating_point()} == {torch.bfloat16}
    engine.destroy()


def test_save_16bit_model_refuses_by_name_what_safetensors_cannot_store_and_torch_save_writes_it(tmp_path):
    """A module's non-tensor extra state and a sparse buffer reached safetensors' writer, which failed with
    "'dict' object has no attribute 'contiguous'" (and a memory-format error); DeepSpeed's default file name
    (torch.save) writes them."""
    class WithMeta(torch.nn.Linear):
        def get_extra_state(self):
            return {"version": 2}

        def set_extra_state(self, state):
            pass

    model = make_model("modulelist")
    model.head = WithMeta(32, VOCAB)
    model.register_buffer("adjacency", torch.eye(4).to_sparse())
    engine = lazytrain.initialize(model=model, config=ds_config())[0]
    with pytest.raises(ValueError, match=re.escape(
            "safetensors holds dense tensors only; the state dict has 'adjacency' (a sparse tensor), "
            "'head._extra_state' (a dict, a module's extra state): give a file name not ending in .safetensors (DeepSpeed's "
            "'pytorch_model.bin', written by torch.save) for this model")):
        engine.save_16bit_model(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    engine.save_16bit_model(str(tmp_path), "pytorch_model.bin")
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=False)
    assert saved["head._extra_state"] == {"version": 2} and torch.equal(saved["adjacency"].to_dense(), torch.eye(4))
    engine.destroy()


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_load_checkpoint_calls_custom_load_fn_and_trains_on_what_it_wrote(tmp_path, precision):
    """DeepSpeed calls custom_load_fn(src=state, dst=module) instead of load_state_dict. A loader that
    writes parameters in place (here: every weight of the checkpoint halved) must reach the streamed
    layers and the fp32 masters."""
    top = {"bf16": {"enabled": True}} if precision else {}
    engine = train_engine(make_model("llama"), batches(1), ds_config(_top=top))
    engine.save_checkpoint(str(tmp_path))
    calls = []

    def halve_into(src, dst):
        calls.append(sorted(src) == sorted(dst.state_dict()))
        with torch.no_grad():
            for name, p in dst.named_parameters():
                p.copy_(src[name] * 0.5)
    engine2 = train_engine(make_model("llama"), [], ds_config(_top=top))
    engine2.load_checkpoint(str(tmp_path), custom_load_fn=halve_into)
    assert calls == [True]
    saved = engine.module_state_dict()
    got = engine2.module_state_dict()
    for k, v in saved.items():        # exactly, in bf16 too: the fp32 masters took what the loader wrote
        torch.testing.assert_close(got[k], v * 0.5, rtol=0, atol=0)
    # what the next forward streams is what the loader wrote
    reference = make_model("llama")
    reference.load_state_dict({k: v * 0.5 for k, v in saved.items()})
    engine2.eval()
    x, _ = batches(1)[0]
    with torch.no_grad():
        out = logits_of(engine2(x)).float()
        ref = logits_of((reference.to(torch.bfloat16) if precision else reference).to(AUTO_DEVICE)(
            x.to(AUTO_DEVICE))).float()
    torch.testing.assert_close(out, ref, **(dict(rtol=0, atol=0) if precision is None else dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_a_non_block_parameter_without_a_gradient_this_step_gets_a_zero_one_as_under_deepspeed(precision):
    """The side layer gets a gradient in step 1 only. In later steps it gets a zero gradient, as DeepSpeed's
    flat buffers and its stage-0 all-reduce give it, so AdamW's momentum and weight decay still move it, as
    they move a block parameter the loss did not reach. Plain PyTorch's optimizer skips it, and so did this
    engine's: its trajectory parted from DeepSpeed's (measured against DeepSpeed 0.19.8 on the CPU)."""
    top = {"bf16": {"enabled": True}} if precision == "bf16" else \
        {"fp16": {"enabled": True, "initial_scale_power": 4}} if precision == "fp16" else {}
    engine, _, _, _ = lazytrain.initialize(model=make_model("branch"), config=ds_config(_top=top))
    data = batches(3)
    for i, (x, _) in enumerate(data):
        x[:, 0] = 2 * (x[:, 0] // 2) + (0 if i == 0 else 1)      # even first token: the side layer is used
    seen = []
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.wait_for_update()
        seen.append(engine.module_state_dict()["side.weight"].clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    if precision is None:
        assert max_rel_diff(engine.module, reference_train(make_model("branch"), data)) < RTOL


def test_a_step_without_a_backward_is_refused_and_changes_nothing():
    """With no backward since the last step, the optimizer stepped on zero gradients: AdamW's momentum and
    weight decay moved every weight (DeepSpeed fails there with an IndexError). A gradient set through
    safe_set_full_grad is a step's gradient too."""
    from lazytrain.utils import safe_set_full_grad
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    data = batches(2)
    engine.backward(lm_loss(engine(data[0][0]), data[0][1]))
    engine.step()
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    with pytest.raises(RuntimeError) as e:
        engine.step()
    assert str(e.value) == ("engine.step() at an accumulation boundary, with no backward since the gradients were "
                            "last zeroed: the optimizer would move every weight by its momentum and weight decay "
                            "alone, so nothing was stepped. Call engine.backward(loss) before engine.step()")
    assert not isinstance(e.value, lazytrain.StepFailedError)   # nothing failed: no zero_grad() asked for
    assert engine.global_steps == 1 and all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    head = engine.module.head.weight
    safe_set_full_grad(head, torch.ones(head.shape))
    engine.step()
    assert engine.global_steps == 2 and not torch.equal(engine.module_state_dict()["head.weight"], before["head.weight"])


def test_set_gradient_accumulation_boundary_controls_the_step():
    """HF Trainer sets the boundary itself: with it False, step() only counts the micro-step."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    x, y = batches(1)[0]
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 0 and engine.micro_steps == 1 and not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 2 and engine.was_step_applied()


def test_unmanaged_accumulation_makes_every_step_call_the_boundary():
    """"managed_gradient_accumulation": false (DeepSpeed 0.19): the script owns the boundary. Each step()
    updates on the micro-batches since the last one, each loss still divided by gradient_accumulation_steps,
    and global_samples counts the engine.backward calls. The key used to be dropped in silence, and steps
    came every gradient_accumulation_steps micro-batches."""
    model = make_model("modulelist")
    data = batches(6)
    ref = reference_train(model, data, gas=2, step_every=3, device=AUTO_DEVICE)
    config = ds_config(_top={"gradient_accumulation_steps": 2, "managed_gradient_accumulation": False})
    engine, _, _, _ = lazytrain.initialize(model=model, config=config)
    counters = []
    for i, (x, y) in enumerate(data):
        engine.backward(lm_loss(engine(x), y))
        assert not engine.is_gradient_accumulation_boundary()   # only while step() runs
        if i % 3 == 2:
            engine.step()
        counters.append((engine.global_steps, engine.micro_steps, engine.global_samples, engine.was_step_applied()))
    engine.wait_for_update()
    # DeepSpeed 0.19.8's counters for the same script
    assert counters == [(0, 0, 0, False), (0, 0, 0, False), (1, 1, 6, True), (1, 1, 6, True), (1, 1, 6, True),
                        (2, 2, 12, True)]
    assert max_rel_diff(engine.module, ref) < RTOL
    with pytest.raises(AssertionError) as e:
        engine.set_gradient_accumulation_boundary(True)
    assert str(e.value) == ("set_gradient_accumulation_boundary() is not supported with "
                            "managed_gradient_accumulation=False; the caller owns the boundary by calling step()")


def test_a_megatron_schedule_is_stepped_by_the_global_batch_size():
    """A schedule whose step() takes the samples stepped (Megatron's ``step(increment)``) is given the global
    batch size, as DeepSpeed gives it; it was refused for the argument engine.step() does not pass."""
    class Increments:
        def __init__(self, optimizer):
            self.optimizer, self.samples = optimizer, 0

        def step(self, increment):
            self.samples += increment
            for g in self.optimizer.param_groups:
                g["lr"] = 0.01 / (1 + self.samples)
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"),
                                           config=ds_config(_top={"gradient_accumulation_steps": 2}),
                                           lr_scheduler=Increments)
    for x, y in batches(4):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 2 and engine.lr_scheduler.samples == 8
    assert engine.get_lr() == [0.01 / 9]


def test_module_state_dict_takes_deepspeeds_arguments():
    """DeepSpeed's ``module_state_dict(destination, prefix, keep_vars, exclude_frozen_parameters)``: the first
    three were a TypeError. keep_vars=True would hand out parameters that are not the trained weights: refused."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    plain = engine.module_state_dict()
    mine = {"step": 3}
    out = engine.module_state_dict(mine, "model.")
    assert out is mine and out["step"] == 3 and len(out) == len(plain) + 1
    assert all(torch.equal(out["model." + k], v) for k, v in plain.items())
    with pytest.raises(ValueError) as e:
        engine.module_state_dict(keep_vars=True)
    assert str(e.value).startswith("engine.module_state_dict(keep_vars=True) would hand out the model's parameters")


def test_hybrid_optimizer_writes_bf16_compute_copies_in_its_update():
    """bf16 + HybridAdamW: the optimizer's update pass writes each streamed layer's compute copy, which
    then equals the fp32 master rounded to bf16 (no separate refresh pass)."""
    model = make_model("llama")
    cfg = ds_config(checkpoint_interval=2, hybrid_threshold=1024, _top={"bf16": {"enabled": True}})
    cfg["optimizer"]["type"] = "AdamW8bit"
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    assert engine._fused_copies
    for x, y in batches(3):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert engine.was_step_applied()
    w = engine.weights
    for i in range(w.num_layers):
        stored = w.weights_tier.read(w._key(i)).wait()
        assert torch.equal(stored, w.master[i].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_save_16bit_model_writes_a_model_with_tied_weights(tmp_path, dtype):
    """safetensors refuses tensors that share memory: GPT-2's tied head and embedding are each written."""
    from safetensors.torch import load_file
    cfg = ds_config(_top={"bf16": {"enabled": True}} if dtype else {})
    engine, _, _, _ = lazytrain.initialize(model=make_hf_model("gpt2", n_layers=2), config=cfg)
    engine.save_16bit_model(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])
    assert saved["lm_head.weight"].dtype == (torch.bfloat16 if dtype else torch.float32)


def test_a_model_partitioned_by_deepspeeds_zero_init_is_refused_by_name():
    model = make_model("llama")
    model.model.embed_tokens.weight.ds_id = 0          # what DeepSpeed's zero.Init leaves on a parameter
    with pytest.raises(ConfigError, match=r"partitioned by DeepSpeed's zero.Init \(ZeRO-3\): LazyTrain needs them "
                                          r"whole. Call lazytrain.replace_deepspeed\(\) before TrainingArguments"):
        lazytrain.initialize(model=model, config=ds_config())


def test_a_model_with_lazy_modules_not_yet_run_is_refused_by_name():
    """nn.LazyLinear's parameters have no shape until its first forward (torch's own error from deep inside
    set-up before); after one forward the model trains."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LazyLinear(3))
    with pytest.raises(ConfigError, match="^" + re.escape(
            "lazytrain.initialize: '1.weight' is not initialized yet (a lazy module's, such as nn.LazyLinear): run "
            "one forward of the model on a sample batch before lazytrain.initialize, which lays the engine's "
            "buffers out for the parameters' shapes") + "$"):
        lazytrain.initialize(model=model, config=ds_config())
    model(torch.zeros(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # no blocks: nothing streams
        engine = lazytrain.initialize(model=model, config=ds_config())[0]
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    engine.destroy()


class _TokenSinkBlock(torch.nn.Module):
    """Appends one statistic per token (a tensor of many values) to a list the model hands every block."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x, sink):
        h = self.fc(x)
        sink.append(h.pow(2).mean(-1))
        return x + torch.tanh(h)


class _SinkLM(torch.nn.Module):
    """Hands each of its blocks (of class ``block``) a list to append to, a new one per forward."""

    def __init__(self, block, d: int = 16, n_layers: int = 4):
        torch.manual_seed(0)
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.layers = torch.nn.ModuleList([block(d) for _ in range(n_layers)])
        self.head = torch.nn.Linear(d, VOCAB)
        self.sink = []

    def forward(self, ids):
        x, self.sink = self.emb(ids), []
        for blk in self.layers:
            x = blk(x, self.sink)
        return self.head(x)


def test_a_list_holding_what_graph_layers_appended_reaches_the_next_block():
    """Graph layers record autograd in their forward, so what they append to a list was made with a graph;
    it is detached where it lies, as the warning says (no gradient, in every layer alike), and the next block
    is handed that list. A tensor of many values among them is told apart by identity, not compared by value."""
    model = _SinkLM(_TokenSinkBlock)
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2, last_segment_graph=True))
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match=r"added a tensor to a list or dict it was handed"):
        out = engine(x)
    assert len(model.sink) == 4 and all(t.shape == x.shape for t in model.sink)
    assert [t.requires_grad for t in model.sink] == [False] * 4   # layers 2 and 3's detached
    engine.backward(lm_loss(out, y))
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("grad", [True, False], ids=["training-forward", "inference"])
def test_user_autocast_keeps_no_cast_of_the_streamed_weights(grad):
    """Under the user's torch.autocast, a cast of an fp32 leaf that requires grad is cached until that context
    exits: the streamed weights, leaves that require grad in every run of a block, must not be, or the forward
    would keep a lower-precision copy of every layer's weights it streamed."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):   # the weight casts autocast makes, by weak reference
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in ((64, 32), (32, 64)):
                self.made.append(weakref.ref(out))
            return out

    model = make_model("modulelist")
    # no graph layer: a graph recorded in the forward keeps its layer's casts for backward, as it should
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config(checkpoint_interval=2,
                                                                         last_segment_graph=False))
    x, _ = batches(1)[0]
    casts = Casts()
    with torch.autocast(AUTO_DEVICE.type, dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        with casts:
            out = engine(x)
        assert len(casts.made) == 2 * 6   # each streamed layer's two weight matrices, cast once
        assert [r for r in casts.made if r() is not None] == []
    del out
    engine.destroy()


def test_non_block_state_is_given_to_the_planner_and_a_bad_value_is_refused():
    from lazytrain.engine.placement import planning_budgets
    for where, want in (("auto", "host"), ("host", "host"), ("device", "device")):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(non_block_state=where))
        assert planning_budgets(engine._config, engine.tiers, 2, 12)["non_block_state"] == want
        engine.destroy()
    with pytest.raises(ConfigError, match="config key 'lazytrain.non_block_state' must be \"auto\", \"host\" or "
                                          "\"device\", got 'gpu'"):
        lazytrain.initialize(model=make_model("llama"), config=ds_config(non_block_state="gpu"))


def test_a_graph_tails_backward_holds_no_window_it_does_not_fetch():
    """Segments of three layers, the last one a graph tail: backward's windows for layers 5, 4 and 3 fetch
    no weights (their graphs hold them) and the Plan charges them none, so the copies of the first window
    that does (re-run 0 and 1, differentiate 2) are issued while layer 3's window computes, as the Plan has
    it, not all through the tail's backward in extra buffers."""
    model = make_model("llama")
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine = copy_path_engine(model, checkpoint_interval=3, last_segment_graph=True)
    assert engine.executor.graph_start == 3
    held = {}
    backward_layer = engine.executor.backward_layer
    def spy(p, layer, *args, **kwargs):
        held.setdefault(layer, len(engine.stream.slots))
        return backward_layer(p, layer, *args, **kwargs)
    engine.executor.backward_layer = spy
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert max_rel_diff(engine.module, ref) < RTOL
    assert [held[i] for i in (5, 4, 3)] == [2, 2, 2]   # the two kept buffers, nothing prefetched
    # entering layer 2's window: layers 0, 1 and 2 in the two kept buffers and an extra one (the forward's
    # last layer computed on its own copy); then layer 1's copy for the next window in another
    assert held[2] == 3 and engine.stream.peak_slots == 4
    engine.destroy()


def test_extra_buffers_of_an_abandoned_prefetch_go_once_their_copies_land():
    """An evaluation forward under grad, never differentiated, issues the copies of backward's first window
    (re-run 3 and 4, differentiate 5: one of them into an extra buffer). The next forward abandons them while
    they are still in flight, so those buffers cannot go at once; but they go as soon as their copies have
    landed, not after the whole forward, which the Plan charges two streamed layers at a time."""
    from concurrent.futures import Future
    from lazytrain.tiers import TransferHandle
    model = make_model("llama")
    data = batches(2)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine = copy_path_engine(model, checkpoint_interval=3, last_segment_graph=False)
    stream = engine.stream
    holding, held = [False], []
    fetch, start, acquire = engine.weights.fetch_into, stream.start, stream.acquire

    def slow_fetch(i, buf):   # a copy into an extra buffer that has not landed yet (until released below)
        handle = fetch(i, buf)
        if not (holding[0] and any(s.extra and s.buf.data_ptr() == buf.data_ptr() for s in stream.slots)):
            return handle
        held.append((Future(), handle.wait()))
        return TransferHandle(future=held[-1][0])

    def first_backward_start(windows):
        holding[0] = max((len(w) for w in windows), default=0) > 1 and not held
        try:
            start(windows)
        finally:
            holding[0] = False

    counts = []

    def counting_acquire(i):
        if i == 1:
            for future, value in held:
                if not future.done():
                    future.set_result(value)
        flat = acquire(i)
        counts.append(len(stream.slots))
        return flat

    engine.weights.fetch_into, stream.start, stream.acquire = slow_fetch, first_backward_start, counting_acquire
    x, y = data[0]
    engine(x)   # evaluation under grad, never differentiated: its backward's first window is abandoned
    assert len(held) == 1 and len(stream.slots) == 3
    counts.clear()
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert max_rel_diff(engine.module, ref) < RTOL
    assert counts[0] == 3          # layer 0: the abandoned copy is still in flight
    assert counts[1:6] == [2] * 5  # layers 1..5: it landed before layer 1, and its buffer went
    engine.destroy()


# ---- models a user builds: buffers a forward updates, a weight on the block list, ties within a block ----
class _BatchNormBlock(torch.nn.Module):
    def __init__(self, d: int, bias: bool = True):
        super().__init__()
        self.fc = torch.nn.Linear(d, d, bias=bias)
        self.bn = torch.nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2))


class _GatedLM(ModuleListLM):
    """A weight registered on the block list itself, used between the blocks."""

    def __init__(self):
        super().__init__()
        self.stack.register_parameter("gate", torch.nn.Parameter(torch.full((32,), 0.9)))

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack:
            x = blk(x) * self.stack.gate
        return self.head(self.extra[0](x))


def _user_lm(block=None, gate=False):
    torch.manual_seed(0)
    model = _GatedLM() if gate else ModuleListLM()
    if block is not None:
        model.stack = torch.nn.ModuleList([block(32) for _ in range(6)])
    return model


def _BiasFreeBatchNormBlock(d: int) -> _BatchNormBlock:
    """A Linear's bias right before BatchNorm has a gradient of exactly zero in exact arithmetic: what is
    computed is rounding noise (~5e-9, under AdamW's eps), which AdamW turns into steps, so one ulp anywhere
    (a GPU's reduction order) moves that bias by ~1% within 3 steps. A parity test at RTOL leaves it out."""
    return _BatchNormBlock(d, bias=False)


def test_the_batchnorm_parity_model_does_not_amplify_one_ulp_beyond_rtol():
    """Parity at RTOL on a GPU needs a model whose training does not blow last bits up: scaling every
    gradient by one ulp (as a clip factor computed in another order may) stays far under RTOL."""
    def run(ulp):
        model = _user_lm(_BiasFreeBatchNormBlock)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for x, y in batches(3):
            lm_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            for p in model.parameters():
                p.grad.mul_(1 + ulp)
            opt.step()
            opt.zero_grad()
        return model
    assert max_rel_diff(run(2.0 ** -23), run(0.0)) < RTOL / 4


def test_a_re_run_block_updates_its_batchnorm_statistics_once_per_forward_as_pytorch_does():
    """Each re-run of a block in backward ran its training forward again: BatchNorm's running statistics
    moved twice per step in re-run blocks (num_batches_tracked 6 for 3 steps), and evaluation differed."""
    data = batches(3)
    ref = reference_train(_user_lm(_BiasFreeBatchNormBlock), data, device=AUTO_DEVICE)
    engine = train_engine(_user_lm(_BiasFreeBatchNormBlock), data, ds_config(checkpoint_interval=3))
    assert max_rel_diff(engine.module, ref) < RTOL
    for mine, theirs in zip(engine.module.stack, ref.stack):
        assert int(mine.bn.num_batches_tracked) == int(theirs.bn.num_batches_tracked) == 3
        torch.testing.assert_close(mine.bn.running_mean.cpu(), theirs.bn.running_mean.cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine.bn.running_var.cpu(), theirs.bn.running_var.cpu(), rtol=1e-5, atol=1e-6)


class _CountingRMSNorm(torch.nn.Module):
    """A module named like a norm (so made lean) that reads a counter its training forward updates in place."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight * (1 + 0.1 * self.calls)


class _BufferReadingBlock(torch.nn.Module):
    """Buffers the training forward updates and then reads: spectral_norm's power iteration (u, v in place), a
    scale replaced by assignment, and a lean norm's counter."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = _CountingRMSNorm(d)
        self.fc = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(d, d))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        if self.training:
            self.scale = 0.9 * self.scale + 0.1 * x.detach().abs().mean()
        return x + torch.tanh(self.fc(self.norm(x))) * self.scale


_BUFFER_PLANS = {
    "re-run every layer": lambda: every_k_plan(6, 3, home="host"),
    "selective": lambda: Plan(num_layers=6, homes=("hbm", RECOMPUTE, RECOMPUTE, "host", RECOMPUTE, RECOMPUTE, "hbm"),
                              selective_layers=(0, 1, 3), policy="selective"),
    "offloaded": lambda: offload_all_plan(6),
    "graph tail": lambda: keep_all_plan(6, home="hbm", last_segment_graph=True),
}


@pytest.mark.parametrize("links", [False, True], ids=["one-re-run", "copy-threads"])
@pytest.mark.parametrize("plan", list(_BUFFER_PLANS))
def test_a_block_reading_buffers_its_forward_updates_trains_as_pytorch_does(tmp_path, plan, links):
    """A re-run started from the buffers as the forward left them: spectral_norm's re-run did one more power
    iteration (gradients 0.17 off plain PyTorch's), a moving scale read its next value. A lean norm's
    recomputation ran on the norm's own buffers, moving a counter twice per step in every plan."""
    data = batches(3)
    ref = plain_reference_train(_user_lm(_BufferReadingBlock), data, optimizer="torch")
    testing = {"copy_threads": True, "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}}} if links else None
    engine = plan_engine(tmp_path, _user_lm(_BufferReadingBlock), _BUFFER_PLANS[plan](), testing)
    assert [type(m).forward is not m.forward for m in engine.module.modules()
            if isinstance(m, _CountingRMSNorm)] == [True] * 6   # made lean
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, ref) < RTOL
    mine, theirs = dict(engine.module.named_buffers()), dict(ref.named_buffers())
    assert mine.keys() == theirs.keys() and all(int(mine[k]) == 3 for k in mine if k.endswith("calls"))
    for k in mine:
        torch.testing.assert_close(mine[k].cpu(), theirs[k].cpu(), rtol=1e-5, atol=1e-7)
    engine.destroy()


class _SharedScaleBlock(torch.nn.Module):
    """One buffer tensor in two submodules: one moves it in place, the other reads it."""

    class Observer(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.register_buffer("scale", scale)

        def forward(self, x):
            if self.training:
                self.scale.mul_(0.9).add_(0.1 * x.detach().abs().mean())
            return x

    class Scaler(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.register_buffer("scale", scale)

        def forward(self, x):
            return x * self.scale

    def __init__(self, d: int):
        super().__init__()
        scale = torch.full((), 3.0)
        self.obs, self.fc, self.sc = self.Observer(scale), torch.nn.Linear(d, d), self.Scaler(scale)

    def forward(self, x):
        return x + torch.tanh(self.sc(self.fc(self.obs(x))))


class _DataWriteBlock(torch.nn.Module):
    """A buffer moved through ``.data`` (autograd's version counter does not see it)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        if self.training:
            self.scale.data.mul_(0.5)
        return x + torch.tanh(self.fc(x)) * self.scale


class _LazyBufferBlock(torch.nn.Module):
    """A buffer made on first use (its slot holds None until then), and a lean norm's counter likewise."""

    class Norm(torch.nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(d))
            self.register_buffer("calls", None)

        def forward(self, x):
            if self.calls is None:
                self.calls = torch.zeros(())
            if self.training:
                self.calls += 1
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight * (1 + 0.1 * self.calls)

    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.norm = type("LazyRMSNorm", (self.Norm,), {})(d)   # named like a norm: made lean
        self.register_buffer("scale", None)

    def forward(self, x):
        if self.scale is None:
            self.scale = torch.ones(())
        if self.training:
            self.scale.mul_(0.5)
        return x + torch.tanh(self.fc(self.norm(x))) * self.scale


class _RegisteredInForwardBlock(torch.nn.Module):
    """A buffer its forward registers (no slot before it) and then moves."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        if "n" not in self._buffers:
            self.register_buffer("n", torch.zeros(()))
        if self.training:
            self.n += 1
        return x + torch.tanh(self.fc(x)) * self.n


class _SparseBufferBlock(torch.nn.Module):
    """A sparse buffer it only reads (torch.equal cannot compare one)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.register_buffer("adj", (torch.eye(d) * 0.5).to_sparse())

    def forward(self, x):
        return x + torch.tanh(torch.sparse.mm(self.adj, self.fc(x).flatten(0, 1).T).T.reshape(x.shape))


@pytest.mark.parametrize("plan", ["re-run every layer", "graph tail"])
@pytest.mark.parametrize("block", [_SharedScaleBlock, _DataWriteBlock, _LazyBufferBlock, _RegisteredInForwardBlock,
                                   _SparseBufferBlock])
def test_buffers_shared_written_through_data_or_made_on_first_use_re_run_as_found(tmp_path, block, plan):
    """Each slot was copied apart (two submodules' one tensor read different values: 0.20 off), a write through
    .data went unseen (0.60 off), and a slot holding None before the forward was re-run holding its result; a
    lean norm's recomputation wrote its own counter made on first use."""
    x, y = batches(1)[0]
    ref = _user_lm(block)
    lm_loss(ref(x), y).backward()
    engine = plan_engine(tmp_path, _user_lm(block), _BUFFER_PLANS[plan]())
    engine.backward(lm_loss(engine(x), y))
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    dense = {k: b.to_dense() if b.is_sparse else b for k, b in engine.module.named_buffers()}
    theirs = {k: b.to_dense() if b.is_sparse else b for k, b in ref.named_buffers()}
    assert dense.keys() == theirs.keys() and all(torch.equal(dense[k], theirs[k]) for k in dense)
    engine.destroy()


def test_a_buffer_made_under_inference_mode_trains_and_read_only_buffers_are_copied_once(tmp_path):
    """A cache regrown in an evaluation under torch.inference_mode() is an inference tensor, which keeps no version
    counter: reading it failed the next training forward. A large read-only buffer is copied at its block's first
    training forward only (each forward copied every buffer of the block: twice the step time with a big mask)."""
    class CacheBlock(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = torch.nn.Linear(d, d)
            self.register_buffer("pos", torch.zeros(4, d), persistent=False)
            self.register_buffer("mask", torch.ones(64, 64), persistent=False)

        def forward(self, x):
            t = x.shape[1]
            if self.pos.shape[0] < t:
                self.pos = torch.sin(torch.arange(t, dtype=torch.float32)[:, None] *
                                     torch.arange(x.shape[-1])[None] / x.shape[-1])
            return x + torch.tanh(self.fc(x + self.pos[:t])) * self.mask[:t, :t].mean()

    data = batches(3)
    ref = _user_lm(CacheBlock)
    with torch.inference_mode():
        ref.eval()
        ref(torch.randint(0, VOCAB, (2, 16)))
        ref.train()
    ref = plain_reference_train(ref, data, optimizer="torch")
    engine = plan_engine(tmp_path, _user_lm(CacheBlock), every_k_plan(6, 3, home="host"))
    with torch.inference_mode():
        engine.eval()
        engine(torch.randint(0, VOCAB, (2, 16)))
        engine.train()
    assert engine.module.stack[0].pos.is_inference()
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, ref) < RTOL
    watched = engine.executor._written_buffers
    assert all(w.seen and not w.written for w in watched[:3])   # blocks 0-2 re-run (3-5: the graph tail's)
    engine.destroy()


def test_an_evaluation_under_grad_before_the_first_training_forward_is_not_that_forward(tmp_path):
    """The first forward a re-run layer's buffers were watched in was an evaluation (eval mode, under grad):
    spectral_norm writes nothing there, so the first training forward's writes were taken for late ones."""
    class SpectralBlock(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(d, d))

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    (xv, yv), (x, y) = batches(2)
    ref = _user_lm(SpectralBlock)
    engine = plan_engine(tmp_path, _user_lm(SpectralBlock), every_k_plan(6, 3, home="host"))
    ref.eval()
    engine.module.eval()
    ref(xv), engine(xv)   # under grad, never differentiated
    ref.train()
    engine.module.train()
    lm_loss(ref(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no warning of late writes
        warnings.filterwarnings("ignore", "lazytrain: no CUDA device")
        engine.backward(lm_loss(engine(x), y))
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    engine.destroy()


def test_a_buffer_first_written_after_its_blocks_first_forward_is_re_run_from_what_it_read_from_then_on(tmp_path):
    class LateWriter(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = torch.nn.Linear(d, d)
            self.register_buffer("scale", torch.ones(()))
            self.writes = False

        def forward(self, x):
            if self.training and self.writes:
                self.scale.mul_(0.5)
            return x + torch.tanh(self.fc(x)) * self.scale

    engine = plan_engine(tmp_path, _user_lm(LateWriter), every_k_plan(6, 3, home="host"))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    for block in engine.module.stack:
        block.writes = True
    with pytest.warns(UserWarning, match=re.escape(
            "lazytrain: block 0's training forward wrote the buffer(s) scale, which its earlier forwards left alone: "
            "this forward's re-run in backward starts from the value the forward left, not the one it read; from "
            "its next forward on, from the one read")):
        engine.backward(lm_loss(engine(x), y))
    engine.step()
    ref = copy.deepcopy(engine.module)   # (a plain copy, with the engine's weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once per block
        engine.backward(lm_loss(engine(x), y))
    lm_loss(ref(x), y).backward()
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    engine.destroy()


def test_a_re_run_writing_a_buffer_its_forwards_never_wrote_is_said_and_a_large_read_only_one_is_not_copied(
        tmp_path):
    """A re-run copies only the buffers its block's forwards write: a read-only one stays as it is (every re-run
    copied each buffer of the block: a 64 MiB mask cost 27x the step, benchmarks/block_buffers_cost.py). One the
    re-run alone writes (a branch on torch.is_grad_enabled(): the engine's forward of a re-run layer records no
    graph) cannot be undone, and is said."""
    class GradOnlyWriter(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = torch.nn.Linear(d, d)
            self.register_buffer("scale", torch.ones(()))
            self.register_buffer("mask", torch.ones(12, 12))
            self.masks_read = []

        def forward(self, x):
            self.masks_read.append(self.mask.data_ptr())
            if torch.is_grad_enabled():
                self.scale.mul_(0.5)
            return x + torch.tanh(self.fc(x)) * self.scale * self.mask[: x.shape[1], : x.shape[1]].mean()

    engine = plan_engine(tmp_path, _user_lm(GradOnlyWriter), every_k_plan(6, 3, home="host"))
    masks = [block.mask for block in engine.module.stack]
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match=re.escape(
            "lazytrain: a re-run of block 0 in backward wrote the buffer(s) scale in place, which its training "
            "forwards never wrote: they moved once more than in plain PyTorch")):
        engine.backward(lm_loss(engine(x), y))
    # blocks 0-2 ran a forward and a re-run (3-5: the graph tail's), each on the mask itself
    assert [b.masks_read for b in engine.module.stack[:3]] == [[m.data_ptr()] * 2 for m in masks[:3]]
    engine.destroy()


def test_two_forwards_before_one_backward_re_run_each_from_the_buffers_it_found(tmp_path):
    """The first pass's re-run started from the buffers the second forward left."""
    (x1, y1), (x2, y2) = batches(2)
    ref = _user_lm(_BufferReadingBlock)
    (lm_loss(ref(x1), y1) + lm_loss(ref(x2), y2)).backward()
    engine = plan_engine(tmp_path, _user_lm(_BufferReadingBlock), every_k_plan(6, 3, home="host"))
    engine.backward(lm_loss(engine(x1), y1) + lm_loss(engine(x2), y2))
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    engine.destroy()


class _SkippingLM(ModuleListLM):
    """Calls its blocks in ``order`` (LayerDrop leaves block 1 out; a repeat calls block 1 twice)."""

    def __init__(self, order):
        super().__init__()
        self.order = order

    def forward(self, ids):
        x = self.emb(ids)
        for i in self.order:
            x = self.stack[i](x)
        return self.head(self.extra[0](x))


@pytest.mark.parametrize("order,message", [
    ((0, 2, 3, 4, 5), "block 2 was called when block 1 was expected: a model that skips blocks in training "
                      "(LayerDrop: a config's 'layerdrop' > 0; stochastic depth that leaves a block's call out) "
                      "cannot stream them; set its layerdrop to 0, or skip inside the block (return its input)"),
    ((0, 1, 1, 2, 3, 4, 5), "block 1 was called when block 2 was expected"),
])
def test_a_block_left_out_of_a_training_forward_is_refused_naming_layerdrop(order, message):
    engine = lazytrain.initialize(model=_SkippingLM(order), config=ds_config())[0]
    x, y = batches(1)[0]
    with pytest.raises(ExecutorError, match=re.escape("streamed blocks must run in order 0..5 once per forward "
                                                      "pass; " + message) + "$"):
        engine(x)
    engine.destroy()


def test_a_weight_registered_on_the_block_list_itself_trains_as_a_non_block_weight():
    """It was counted as a block weight but streamed with none: never zeroed, clipped or moved."""
    data = batches(4)
    ref = reference_train(_user_lm(gate=True), data, device=AUTO_DEVICE)
    engine = train_engine(_user_lm(gate=True), data, ds_config(checkpoint_interval=2))
    assert max_rel_diff(engine.module, ref) < RTOL
    torch.testing.assert_close(engine.module.stack.gate.detach().cpu(), ref.stack.gate.detach().cpu(),
                               rtol=1e-5, atol=1e-7)


def test_a_weight_tied_within_a_block_is_refused_by_name():
    class TiedBlock(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return x + self.b(torch.tanh(self.a(x)))

    with pytest.raises(Exception, match=r"block 0's parameters 'a.weight' and 'b.weight' are one tied weight"):
        lazytrain.initialize(model=_user_lm(TiedBlock), config=ds_config())


def test_deepspeed_engine_methods_scripts_call():
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config())
    # DeepSpeed lower-cases the types it implements (its ADAM_OPTIMIZER etc.)
    assert (engine.dp_world_size, engine.optimizer_name(), engine.get_mom()) == (1, "adamw", [(0.9, 0.999)])
    engine.set_train_batch_size(6)   # DeepSpeed's: more micro-batches of the same size
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (6, 3)
    with pytest.raises(ValueError, match="Train batch size must be divisible by micro-batch data parallelism"):
        engine.set_train_batch_size(5)
    for wrong in (0, 4.0, "4"):   # not a batch at all: said so, not that it does not divide
        with pytest.raises(ValueError, match=re.escape(f"train_batch_size must be a whole number >= 1, got {wrong!r}")):
            engine.set_train_batch_size(wrong)
    engine.set_train_micro_batch_size(4)   # DeepSpeed's: the same accumulation, the global batch follows
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.train_batch_size(), engine.mp_world_size) == (4, 3, 12, 1)
    with pytest.raises(ValueError, match=r"micro_batch_size must be a whole number >= 1, got 0"):
        engine.set_train_micro_batch_size(0)
    engine.set_train_micro_batch_size(2)
    x, y = batches(1)[0]
    with engine.no_sync():
        engine.backward(lm_loss(engine(x), y))
        with pytest.raises(AssertionError, match="It is illegal to call Engine.step\\(\\) inside no_sync"):
            engine.step()
    engine.step()   # the first of the 3 micro-batches
    for _ in range(2):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 3
    stage2, _, _, _ = lazytrain.initialize(model=make_model("modulelist"),
                                           config=ds_config(_top={"zero_optimization": {"stage": 2}}))
    with pytest.raises(AssertionError, match="incompatible with gradient partitioning logic of ZeRO stage 2"):
        with stage2.no_sync():
            pass
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), optimizer=lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.5), config={"train_batch_size": 2})
    assert (engine.optimizer_name(), engine.get_mom()) == ("SGD", [0.5])
    # "sgd" in lower case (DeepSpeed refuses it; LazyTrain builds torch's SGD) is named as the class it builds:
    # its momentum was read as betas, get_mom() gave [0.0]
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config={
        "train_batch_size": 2, "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert (engine.optimizer_name(), engine.get_mom()) == ("SGD", [0.9])


def test_lazytrains_own_decoder_ties_its_embeddings_when_the_config_says_so():
    from lazytrain.models.decoder import DecoderConfig, build_causal_lm
    model = build_causal_lm(DecoderConfig(tie_word_embeddings=True), prefer_transformers=False)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_an_optimizer_with_an_overflow_of_its_own_keeps_it():
    class Flagged(torch.optim.SGD):
        @property
        def overflow(self):
            return "mine"

    model = make_model("modulelist")
    engine, optimizer, _, _ = lazytrain.initialize(model=model, optimizer=Flagged(model.parameters(), lr=0.1),
                                                   config={"train_batch_size": 2})
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert optimizer.overflow == "mine"


def _refused_and_nothing_moved(engine, call, error, match):
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    with pytest.raises(error, match=match):
        call()
    assert all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())


def test_a_schedule_whose_step_needs_an_argument_is_refused_before_the_update():
    """A schedule whose step() needs an argument: step() without it failed after the weights were updated,
    which left the engine refusing to train until a checkpoint was loaded."""
    class NeedsLoss:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, loss):
            pass

        def get_last_lr(self):
            return [g["lr"] for g in self.optimizer.param_groups]
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config(), lr_scheduler=NeedsLoss)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    _refused_and_nothing_moved(engine, engine.step, TypeError,
                               r"NeedsLoss.step\(loss\) needs arguments that engine.step\(\) does not give it .*pass "
                               r"them as engine.step\(lr_kwargs=\{...\}\); nothing was updated")
    engine.step(lr_kwargs={"loss": 1.0})
    assert engine.was_step_applied()


def test_destroy_hands_back_gradients_as_plain_pytorch_leaves_them_and_a_destroyed_engine_refuses_to_run():
    """destroy() left every block parameter a zero .grad (a view of the engine's buffer) even after a step or
    with no training: a torch optimizer skips only a None gradient, so a script that froze the blocks after
    destroy() moved them by the weight decay. They are now None since the last zeroing, and a copy of the
    accumulation before a step. A destroyed engine's forward, backward and step updated the handed-back model
    (with the overlapped update, half of it): each is refused now."""
    x, y = batches(1)[0]
    model = make_model("modulelist")
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config())
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.destroy()
    assert all(p.grad is None for p in model.stack.parameters())
    model = make_model("modulelist")
    engine, _, _, _ = lazytrain.initialize(model=model, config=ds_config())
    engine.backward(lm_loss(engine(x), y))   # a step's accumulation, not stepped
    accumulated = {n: safe_get_full_grad(p).clone() for n, p in model.stack.named_parameters()}
    engine.destroy()
    line = sys._getframe().f_lineno - 1
    for n, p in model.stack.named_parameters():
        assert torch.equal(p.grad, accumulated[n]), n
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for call, what in ((lambda: engine(x), "a forward"), (lambda: engine.backward(lm_loss(model(x), y)), "engine.backward()"),
                       (engine.step, "step()")):
        # the refusal names where destroy() was called from (accelerate's free_memory, for a Trainer's engine)
        with pytest.raises(RuntimeError, match="^" + re.escape(
                f"{what} refused: this engine was destroyed (destroy() handed the model back, called from "
                f"tests/test_engine_parity.py:{line} in {sys._getframe().f_code.co_name}); build a new one with "
                f"lazytrain.initialize") + "$"):
            call()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_mpu_that_splits_the_model_is_refused_and_one_of_size_one_is_warned_of():
    """DeepSpeed averages gradients over the data-parallel ranks an mpu names and sizes the batch by them;
    LazyTrain treats every rank as data parallel, so an mpu with model parallelism of 2 trained as if it
    were 2 data-parallel ranks, with a warning that it was ignored."""
    class Mpu:
        def __init__(self, size):
            self.size = size

        def get_model_parallel_world_size(self):
            return self.size
    with pytest.raises(ConfigError, match=r"^lazytrain.initialize: mpu/mesh_param split the model over ranks "
                                          r"\(get_model_parallel_world_size: 2\); LazyTrain trains data parallel only"):
        lazytrain.initialize(model=make_model("modulelist"), config=ds_config(), mpu=Mpu(2))
    with pytest.raises(ConfigError, match=r"\(mesh_param's sequence-parallel size: 2\)"):
        lazytrain.initialize(model=make_model("modulelist"), config=ds_config(), mesh_param=(1, 2))
    with pytest.warns(UserWarning, match=r"model/tensor parallelism \(mpu, mesh_param\) is not supported; they are "
                                         r"ignored"):
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config(), mpu=Mpu(1))
    engine.destroy()


def test_model_parameters_of_another_kind_and_a_scheduler_callable_without_an_optimizer():
    """A dict (its keys) or numbers as model_parameters gave a raw AttributeError; an lr_scheduler callable
    with no optimizer was called on None (DeepSpeed leaves the schedule None there)."""
    for bad, kind in (({"a": 1}, "str"), ([1, 2], "int")):
        with pytest.raises(ConfigError, match=f"^model_parameters holds {kind} values: pass the parameters"):
            lazytrain.initialize(model=make_model("modulelist"), config=ds_config(), model_parameters=bad)
    cfg = {**ds_config(), "optimizer": None}
    with pytest.warns(UserWarning, match="an lr_scheduler callable was passed to initialize without an optimizer"):
        engine, opt, _, schedule = lazytrain.initialize(model=make_model("modulelist"), config=cfg,
                                                        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    assert opt is None and schedule is None
    engine.destroy()


def test_parameter_groups_given_as_generators_all_train():
    """``{"params": module.parameters()}``: the engine read model_parameters twice (the 8-bit share, then the
    optimizer), and the second reading found each group's generator spent: the optimizer's groups were empty
    and nothing trained, without a word. A group without 'params' is named."""
    model = make_model("modulelist")
    blocks = {id(p) for p in model.stack.parameters()}
    groups = [{"params": model.stack.parameters(), "lr": 0.05},
              {"params": (p for p in model.parameters() if id(p) not in blocks), "weight_decay": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, _ = lazytrain.initialize(model=model, model_parameters=groups, config=ds_config())
    assert [len(g["params"]) for g in opt.param_groups] == [len(blocks), len(list(model.parameters())) - len(blocks)]
    before = {k: v.clone() for k, v in engine.module_state_dict().items()}
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert all(not torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
    engine.destroy()
    with pytest.raises(ConfigError, match=r"^model_parameters\[1\]: a parameter group is a dict with 'params' "
                                          r"\(as torch's optimizers take them\), got \['lr'\]$"):
        lazytrain.initialize(model=make_model("modulelist"), config=ds_config(),
                             model_parameters=[{"params": []}, {"lr": 1.0}])


def test_an_optimizer_callable_is_called_as_deepspeed_calls_it_and_the_returned_optimizer_steps_only_through_the_engine():
    """DeepSpeed calls a callable optimizer with model_parameters as given: a list of tensors stayed a list
    of one group's dict here, and a callable splitting decay by p.ndim failed. Stepping the returned
    optimizer directly updated the streamed blocks from no gradient after the first step (their gradients
    reach it only through engine.step()), training silently wrong: it is refused, and after destroy() the
    optimizer steps the model's parameters as plain PyTorch's."""
    seen = []

    def build(params):
        params = list(params)
        seen.append([type(p).__name__ for p in params[:1]])
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1]},
                                  {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=1e-2)
    model = make_model("modulelist")
    engine, opt, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), optimizer=build,
                                             config={**ds_config(), "optimizer": None})
    assert seen == [["Parameter"]] and len(opt.param_groups) == 2
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    _refused_and_nothing_moved(engine, opt.step, RuntimeError,
                               r"^optimizer.step\(\) was called directly: with LazyTrain the streamed layers' "
                               r"gradients reach the optimizer only through engine.step\(\)")
    engine.step()
    assert engine.global_steps == 1
    engine.destroy()
    lm_loss(model(x), y).backward()
    opt.step()   # the model's own parameters again, as plain PyTorch steps them
    assert "step" not in opt.__dict__


def test_reduce_lr_on_plateau_is_left_to_the_script_unless_step_is_given_its_metric():
    """ReduceLROnPlateau was refused at every engine.step() without lr_kwargs, and HF Trainer (whose
    lr_scheduler_type "reduce_lr_on_plateau" hands it to initialize) calls engine.step() with no way to pass
    them: training failed where DeepSpeed's runs. The step now leaves the schedule to the script (Trainer
    steps it with the validation metric at each evaluation), saying so once; given its metric, it steps."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=ds_config(
        _top={"scheduler": {"type": "ReduceLROnPlateau", "params": {"patience": 0, "factor": 0.5}}}))
    plateau = engine.lr_scheduler
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match=r"engine.step\(\) does not step ReduceLROnPlateau, which needs a metric"):
        for _ in range(3):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
    assert engine.was_step_applied() and engine.global_steps == 3
    assert plateau.last_epoch == 0 and engine.get_lr() == [1e-2]   # not stepped
    for metric in (1.0, 1.0):   # no improvement after the first: the rate halves (patience 0)
        engine.backward(lm_loss(engine(x), y))
        engine.step(lr_kwargs={"metrics": metric})
    assert engine.get_lr() == [5e-3]


def test_an_argparse_style_deepspeed_script_runs_with_import_lazytrain_as_deepspeed(tmp_path):
    """DeepSpeedExamples' style: ``deepspeed.add_config_arguments(parser)``, the config from
    ``args.deepspeed_config`` (or the deprecated ``deepscale_config``), the model built under ``deepspeed.zero.Init()``."""
    import argparse
    import lazytrain as deepspeed
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config()))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert vars(args) == {"deepspeed": True, "deepspeed_config": str(path), "deepscale": False,
                          "deepscale_config": None}
    with deepspeed.zero.Init():
        model = make_model("modulelist")
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        assert all(p.numel() > 0 for p in engine.module.parameters())
    engine.destroy()
    old = parser.parse_args(["--deepscale", "--deepscale_config", str(path)])
    with pytest.warns(DeprecationWarning, match="args.deepscale_config is deprecated, as in DeepSpeed"):
        engine, _, _, _ = deepspeed.initialize(args=old, model=make_model("modulelist"))
    assert engine.train_micro_batch_size_per_gpu() == 2
    engine.destroy()
    both = parser.parse_args(["--deepspeed_config", str(path), "--deepscale_config", str(path)])
    with pytest.raises(ConfigError, match=r"^args holds both deepscale_config and deepspeed_config; give one"):
        deepspeed.initialize(args=both, model=make_model("modulelist"))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_load_without_optimizer_states_takes_the_loss_scale_where_deepspeed_does(tmp_path, stage):
    """DeepSpeed 0.19 restores the loss scale with the optimizer states only: at stage 0 from FP16_Optimizer's
    state, from stage 1 from ZeRO's files, which its load_checkpoint reads only for those states."""
    cfg = ds_config(_top={"fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
                          "zero_optimization": {"stage": stage}})
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y) * float("inf"))
    engine.step()
    assert engine.loss_scaler.scale == 8.0
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    for with_states, expected in ((True, 8.0), (False, 16.0)):
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
        engine.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=with_states)
        assert engine.loss_scaler.scale == engine.optimizer.loss_scale == expected, with_states
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 1])
def test_the_configured_loss_scale_mode_holds_over_a_resume_from_the_other_mode(tmp_path, stage):
    """The config says static or dynamic: a static ``fp16.loss_scale`` resumed from a dynamic run keeps its
    value (and stays static), and a dynamic run resumed from a static one (a bf16 or fp32 run saves 1.0)
    starts its scale afresh rather than climb back from the saved one; each is said once."""
    dynamic = ds_config(_top={"fp16": {"enabled": True, "initial_scale_power": 11}, "zero_optimization": {"stage": stage}})
    static = ds_config(_top={"fp16": {"enabled": True, "loss_scale": 512}, "zero_optimization": {"stage": stage}})
    x, y = batches(1)[0]
    for saved_cfg, resumed_cfg, message, scale in (
            (dynamic, static, r"the configured static fp16.loss_scale 512 is kept; the checkpoint's dynamic loss "
                              r"scale 2048 is not restored", 512.0),
            (static, dynamic, r"the checkpoint's static loss scale 512 is not restored: this run's fp16 scale is "
                              r"dynamic \(fp16.loss_scale 0\) and starts at 2048", 2048.0)):
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=saved_cfg)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(str(tmp_path), tag="t")
        engine.destroy()
        engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=resumed_cfg)
        with pytest.warns(UserWarning, match=message):
            engine.load_checkpoint(str(tmp_path), tag="t")
        assert engine.loss_scaler.scale == engine.optimizer.cur_scale == scale
        assert engine.loss_scaler.dynamic == (resumed_cfg is dynamic)
        engine.backward(lm_loss(engine(x), y) * float("inf"))
        engine.step()
        assert engine.loss_scaler.scale == (512.0 if resumed_cfg is static else 1024.0 if stage == 0 else 2048.0)
        engine.destroy()


def test_deepspeed_comm_names_answer_through_import_lazytrain_as_deepspeed(monkeypatch):
    """``deepspeed.comm`` as DeepSpeedExamples call it in one process: a group of one once a function needs it
    (DeepSpeed's initialize makes one), DeepSpeed's keywords (``tensor``, ``output_tensor``, the logger's), the
    launcher's LOCAL_RANK, functions that pickle by reference; a name it lacks is refused by name."""
    import pickle
    import lazytrain as deepspeed
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not torch.distributed.is_initialized()
    try:
        assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), deepspeed.comm.get_local_rank()) == (0, 1, 0)
        assert deepspeed.comm.is_initialized()
        # on the device computing: with a GPU the group is NCCL's, as DeepSpeed's is, and refuses host tensors
        t, gathered, exchanged = (torch.arange(4.0, device=AUTO_DEVICE), torch.empty(4, device=AUTO_DEVICE),
                                  torch.empty(4, device=AUTO_DEVICE))
        deepspeed.comm.all_reduce(t, op=deepspeed.comm.ReduceOp.SUM, log_name="grads", prof=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # torch's renaming of the function, not ours
            deepspeed.comm.all_gather_into_tensor(output_tensor=gathered, tensor=t)
        deepspeed.comm.all_to_all_single(exchanged, tensor=t)
        deepspeed.comm.barrier()
        assert gathered.tolist() == exchanged.tolist() == t.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert pickle.loads(pickle.dumps(deepspeed.comm.get_rank)) is deepspeed.comm.get_rank
        # DeepSpeed's get_global_rank(group=None, group_rank=0); torch's needs both
        assert deepspeed.comm.get_global_rank() == deepspeed.comm.get_global_rank(torch.distributed.group.WORLD) == 0
        assert deepspeed.comm.log_summary(return_dict=True) == {}   # no communication log kept, as DeepSpeed's default
        with pytest.raises(AttributeError, match=r"lazytrain.comm \(deepspeed.comm for `import lazytrain as deepspeed`\) "
                                                 r"has no 'configure'"):
            deepspeed.comm.configure()
    finally:
        torch.distributed.destroy_process_group()


def test_destroy_hands_a_client_optimizer_back_on_the_models_parameters():
    """In bf16 the optimizer updates fp32 masters of the embedding and head while the engine runs; after
    destroy its groups and state are under the model's parameters again (they were left on the masters, so a
    script going on with plain PyTorch stepped tensors no model read, and the head never moved)."""
    model = make_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = ds_config(checkpoint_interval=2, overlap_optimizer="auto", _top={"bf16": {"enabled": True}})   # client AdamW
    del cfg["optimizer"]
    engine, _, _, _ = lazytrain.initialize(model=model, optimizer=optimizer, config=cfg)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    moments = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in model.named_parameters()}
    engine.destroy()
    params = list(model.parameters())
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in params]
    assert set(map(id, optimizer.state)) == set(map(id, params))
    for n, p in model.named_parameters():
        state = optimizer.state[p]
        assert float(state["step"]) == 1 and torch.equal(state["exp_avg"].cpu(), moments[n]), n
        assert state["exp_avg"].device == p.device == torch.device("cpu"), n   # where the model was given
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lm_loss(model(x), y).backward()
    optimizer.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "a weight did not move"


@pytest.mark.parametrize("fused", [False, True])
def test_the_optimizer_state_handed_back_lies_on_each_parameters_device(fused):
    """destroy() puts the parameters back where they were given (a GPU's: its host masters' state was on the
    host): every state tensor follows its parameter, a scalar step too where the group is fused or capturable
    (torch keeps it on the device there, and on the host otherwise). The meta device stands in for a GPU."""
    from lazytrain.engine.optimizer_setup import hand_back_to_params
    master = torch.nn.Parameter(torch.zeros(3, 2))
    param, block = (torch.nn.Parameter(torch.zeros(3, 2, device="meta")) for _ in range(2))
    opt = torch.optim.AdamW([master, block], lr=1e-3)
    opt.param_groups[0]["fused"] = fused
    for t in (master, block):
        opt.state[t] = {"step": torch.tensor(2.0), "exp_avg": torch.ones(3, 2), "exp_avg_sq": torch.ones(3, 2)}
    hand_back_to_params(opt, [(param, master)])
    assert opt.param_groups[0]["params"] == [param, block] and set(opt.state) == {param, block}
    for t in (param, block):
        assert opt.state[t]["exp_avg"].device.type == opt.state[t]["exp_avg_sq"].device.type == "meta"
        assert opt.state[t]["step"].device.type == ("meta" if fused else "cpu")


def test_destroy_leaves_hybrid_adamw_no_view_of_the_engines_compute_copies():
    """HybridAdamW writes the streamed layers' bf16 compute copies in its update pass; after destroy() it kept
    views of them (the whole streamed model in bf16, held as long as the script kept the optimizer), and a plain
    step went on writing into them."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=ds_config(
        checkpoint_interval=2, overlap_optimizer=True, _top={"bf16": {"enabled": True}}))
    optimizer = engine.optimizer
    assert type(optimizer).__name__ == "HybridAdamW" and len(optimizer.compute_copies) > 0
    engine.destroy()
    assert optimizer.compute_copies == {}


def test_destroy_hands_a_client_optimizer_back_without_the_engines_attributes():
    """zero_grad, add_param_group and DeepSpeed's overflow / loss_scale / cur_scale are the engine's while it
    runs; after destroy the optimizer's own are back (another engine given it would find the first's)."""
    model = make_model("modulelist")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own_zero_grad = optimizer.zero_grad
    cfg = ds_config(overlap_optimizer="auto", _top={"fp16": {"enabled": True}})   # a client AdamW: no overlap
    del cfg["optimizer"]
    engine, _, _, _ = lazytrain.initialize(model=model, optimizer=optimizer, config=cfg)
    assert {"zero_grad", "add_param_group", "overflow", "loss_scale", "cur_scale"} <= set(vars(optimizer))
    engine.destroy()
    assert not {"zero_grad", "add_param_group", "overflow", "loss_scale", "cur_scale"} & set(vars(optimizer))
    assert optimizer.zero_grad == own_zero_grad


@pytest.mark.parametrize("auto_cast", [True, False])
def test_fp16_auto_cast_casts_the_forwards_floating_point_inputs_as_deepspeed_does(auto_cast):
    """fp16.auto_cast: the positional floating-point inputs reach the model in fp16 (integer ones as they are,
    keywords as they are, as DeepSpeed casts them); off, as given."""
    seen = {}

    class EmbedsLM(ModuleListLM):
        def forward(self, embeds, ids, scale=None):
            seen.update(embeds=embeds.dtype, ids=ids.dtype, scale=scale.dtype)
            return super().forward(ids) + embeds.sum() * 0

    torch.manual_seed(0)
    engine = lazytrain.initialize(model=EmbedsLM(), config=ds_config(
        _top={"fp16": {"enabled": True, "auto_cast": auto_cast, "initial_scale_power": 8}}))[0]
    x, y = batches(1)[0]
    out = engine(torch.randn(2, 3), x, scale=torch.ones(1))
    engine.backward(lm_loss(out, y))
    engine.step()
    assert seen == {"embeds": torch.float16 if auto_cast else torch.float32, "ids": x.dtype, "scale": torch.float32}


def test_the_progress_lines_time_per_step_counts_the_steps_of_its_window_alone(monkeypatch, tmp_path, capsys):
    """The first "[lazytrain] step N" line divided the time since initialize() by steps_per_print (set-up, an
    evaluation before training counted as steps), and the first after a load divided the time of whatever steps
    ran by steps_per_print too. Each window now begins at its first step's first training forward (the first,
    or the first after a load) or at the last line, and is divided by the steps it holds. A clock that moves
    only where the test moves it."""
    import time
    clock = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    cfg = ds_config(device="cpu")
    cfg["steps_per_print"] = 2
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist", n_layers=2), config=cfg)

    def steps(n):
        for x, y in batches(n):
            engine.backward(lm_loss(engine(x), y))
            clock[0] += 0.25   # each step takes 250 ms from its forward
            engine.step()

    clock[0] += 60.0   # set-up and an evaluation before training
    steps(2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    clock[0] += 30.0   # a save between the lines counts (the window runs from the last line)
    steps(2)
    x, y = batches(1)[0]   # a micro-batch begun and dropped before the load: its forward does not start the window
    engine.backward(lm_loss(engine(x), y))
    engine.zero_grad()
    clock[0] += 600.0
    engine.load_checkpoint(str(tmp_path), tag="t")
    clock[0] += 5.0    # the load
    steps(2)
    lines = [line.split(", ")[2] for line in capsys.readouterr().out.splitlines() if line.startswith("[lazytrain] step")]
    assert lines == ["250 ms/step", "15250 ms/step", "250 ms/step"]
