"""Frozen block weights (a LoRA run's base model): in bf16/fp16 they are kept in the compute dtype alone (2 host
bytes a parameter: no fp32 weights, no gradient buffer), with the weights in host memory in the streamed layers'
compute copies, with the weights on NVMe in a host buffer of each layer's frozen part; only the trainable
parameters' gradients leave the device. Training is bit for bit the same either way, and the model is handed
back as it was given."""
import copy
import os
import re
import warnings

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from engine_models import AUTO_DEVICE, add_lora, batches, lm_loss, make_model, max_rel_diff, reference_train

TARGETS = ("q_proj", "v_proj")


def lora_llama():
    return add_lora(make_model("llama"), TARGETS)


def config(tmp_path, home="host", testing=None, gas=1, **lazytrain_section):
    section = {"checkpoint_interval": 2, "weights_home": home, **lazytrain_section}
    if home == "nvme":
        os.makedirs(tmp_path / "nvme", exist_ok=True)
        section["nvme_path"] = str(tmp_path / "nvme")
    if testing:
        section["testing"] = testing
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "bf16": {"enabled": True}, "lazytrain": section}


def engine_of(model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=model, config=cfg)[0]


def train(engine, data):
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()


def frozen_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad and ".layers." in n]


def test_frozen_block_weights_are_kept_in_the_compute_copy_alone(tmp_path):
    """Per layer: fp32 weights and gradient buffer for the adapters only, each frozen weight a bf16 view of
    the layer's host compute copy; the gradient sink's staging is sized to the largest adapter set."""
    model = lora_llama()
    engine = engine_of(model, config(tmp_path, testing={"copy_threads": True}))
    w = engine.weights
    assert w.frozen_in_copy
    for i, block in enumerate(model.model.layers):
        trainable = sum(p.numel() for p in block.parameters() if p.requires_grad)
        assert w.trainable_numels[i] == trainable == 4 * (32 + 32) + 4 * (32 + 16)   # rank 4; q: 32->32, v: 32->16
        assert w.master[i].numel() == trainable and w.master[i].dtype == torch.float32
        assert w.grad[i].numel() == trainable
        copy_ = w.weights_tier.read(w._key(i)).wait()
        assert copy_.numel() == sum(p.numel() for p in block.parameters()) and copy_.dtype == torch.bfloat16
        start, end = copy_.data_ptr(), copy_.data_ptr() + copy_.numel() * 2
        for name, p in block.named_parameters():
            if p.requires_grad:
                assert p.dtype == torch.float32 and w.master[i].data_ptr() <= p.data_ptr(), name
            else:
                assert p.dtype == torch.bfloat16 and start <= p.data_ptr() < end, name
    staging = w._grad_sink._staging   # the sink's pinned buffer: a layer's trainable part
    assert list(staging) == [w.compute_dtype] and staging[w.compute_dtype].numel() == max(w.trainable_numels)
    engine.destroy()


def test_only_the_trainable_gradients_leave_the_device(tmp_path):
    """A traced step with copy threads (the GPU's path): each layer's gradient copy carries its adapters'
    bf16 gradients and nothing of the frozen weights."""
    engine = engine_of(lora_llama(), config(tmp_path, testing={"copy_threads": True}))
    engine.trace_next_step()
    train(engine, batches(1))
    grads = [s for s in engine.last_trace.spans if s.name.startswith("grads L")]
    assert sorted(s.name for s in grads) == sorted(f"grads L{i}" for i in range(6))
    assert {s.args["bytes"] for s in grads} == {engine.weights.trainable_numels[0] * 2}
    engine.destroy()


CASES = {
    "serial": dict(overlap_optimizer=False),
    "overlap-gas2": dict(gas=2, overlap_optimizer=True),
    "copy-threads-chaos": dict(testing={"copy_threads": True, "chaos_seed": 5, "chaos_max_delay_ms": 1.0},
                               overlap_optimizer=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_in_bf16_trains_alike_with_the_weights_in_host_memory_and_on_nvme(case, tmp_path):
    """The adapters train bit for bit whether the frozen weights are kept in the host compute copies or apart
    from the copies on NVMe (the streamed values are the same bf16 ones); the frozen weights come back in
    fp32, rounded to bf16 (what training computed with)."""
    model = lora_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kwargs = dict(CASES[case])
    gas = kwargs.get("gas", 1)
    data = batches(3 * gas)
    results = {}
    for home in ("host", "nvme"):
        m = copy.deepcopy(model)
        engine = engine_of(m, config(tmp_path / home, home=home, **kwargs))
        assert (engine.weights.frozen_in_copy, engine.weights.frozen_apart) == (home == "host", home == "nvme")
        train(engine, data)
        engine.destroy()
        results[home] = dict(m.named_parameters())
    host, nvme = results["host"], results["nvme"]
    moved = 0
    for name, p in host.items():
        assert p.dtype == torch.float32, name
        if p.requires_grad:
            assert torch.equal(p, nvme[name]), name
            moved += not torch.equal(p, before[name])
        else:   # never moved: rounded to bf16 as kept
            rounded = before[name].bfloat16().float()
            assert torch.equal(nvme[name], rounded), name
            assert torch.equal(p, rounded), name
    assert moved == len([n for n in host if "lora_" in n])


def test_with_the_weights_on_nvme_frozen_block_weights_are_kept_in_bf16_apart(tmp_path):
    """The compute copies on NVMe: per layer, fp32 weights for the adapters only and one bf16 host buffer of
    the frozen part, each frozen weight a view of it (2 host bytes a parameter, where 4 were kept before);
    what streams is the adapters' bf16 values, then the frozen part, in the layer's layout."""
    model = lora_llama()
    engine = engine_of(model, config(tmp_path, home="nvme"))
    w = engine.weights
    assert w.frozen_apart and not w.frozen_in_copy
    for i, block in enumerate(model.model.layers):
        frozen = sum(p.numel() for p in block.parameters() if not p.requires_grad)
        assert w.master[i].numel() == w.trainable_numels[i] and w.grad[i].numel() == w.trainable_numels[i]
        part = w.frozen_part[i]
        assert part.numel() == frozen and part.dtype == torch.bfloat16
        start, end = part.data_ptr(), part.data_ptr() + part.numel() * 2
        for name, p in block.named_parameters():
            if not p.requires_grad:
                assert p.dtype == torch.bfloat16 and start <= p.data_ptr() < end, name
        stored = w.stored_copy(i)
        assert torch.equal(stored[:w.trainable_numels[i]], w.master[i].bfloat16())
        assert torch.equal(stored[w.trainable_numels[i]:], part)
    engine.destroy()


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_a_failed_set_up_hands_the_frozen_weights_back_in_their_own_storage(home, tmp_path):
    """A config error found after the layers' buffers were built: every frozen block weight is the very
    tensor storage it was given, unrounded."""
    model = lora_llama()
    given = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    cfg = config(tmp_path, home=home, overlap_optimizer=True)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2}}   # overlap_optimizer true needs the hybrid AdamW
    with pytest.raises(ConfigError, match="overlap_optimizer"):
        engine_of(model, cfg)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) > len(frozen_names(model))   # the embedding and head too
    for name in frozen:
        p = dict(model.named_parameters())[name]
        assert p.data_ptr() == given[name][0] and torch.equal(p, given[name][1]), name


def test_a_set_up_failing_while_the_layers_are_built_hands_every_frozen_weight_back(tmp_path):
    """A host tier too small for the layers' compute copies (the third on the CPU): the frozen weights of those built
    before it are the very tensors given again, and the model trains in plain PyTorch."""
    model = lora_llama()
    given = {n: (p.data_ptr(), p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    layer_bytes = sum(p.numel() for p in model.model.layers[0].parameters()) * 2
    from lazytrain.tiers import TierBudgetError
    with pytest.raises(TierBudgetError, match="writing 'weights.layer"):   # the third (pinned pools may round)
        engine_of(model, config(tmp_path, host_memory=int(layer_bytes * 2.5)))
    for name, p in model.named_parameters():   # the trainable ones in fp32 weights of their own, as given
        assert p.dtype == given[name][1] and torch.equal(p, given[name][2]), name
        assert p.requires_grad or p.data_ptr() == given[name][0], name
    x, y = batches(1)[0]
    lm_loss(model(x), y).backward()


def test_a_load_reaches_every_block_sharing_a_frozen_weight(tmp_path):
    """A frozen weight shared by all blocks is stored in each layer's copy: a ``load_state_dict`` writes
    every one of them (the parameter is a view of one), as plain PyTorch's shared weight changes for all."""
    def shared():
        m = lora_llama()
        for layer in m.model.layers[1:]:
            layer.mlp.down_proj.weight = m.model.layers[0].mlp.down_proj.weight
        return m
    model = shared()
    torch.manual_seed(3)
    new = {k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
    for k in new:
        if "mlp.down_proj.weight" in k:
            new[k] = new["model.layers.0.mlp.down_proj.weight"]
    x, _ = batches(1)[0]
    logits = {}
    for home in ("host", "nvme"):
        engine = engine_of(copy.deepcopy(model), config(tmp_path / home, home=home))
        engine.module.load_state_dict(new)
        w = engine.weights
        want = new["model.layers.0.mlp.down_proj.weight"].bfloat16()
        for i in range(w.num_layers):   # where it is kept and what streams
            slot = next(s for s in w.layer_slots[i] if s.name == "mlp.down_proj.weight")
            kept = w.frozen_home(i, slot)
            assert torch.equal(kept, want) and torch.equal(slot.of(w.stored_copy(i)), want), (home, i)
        with torch.no_grad():
            logits[home] = engine(x).logits
        engine.destroy()
    assert torch.equal(logits["host"], logits["nvme"])


def test_destroy_gives_frozen_weights_storage_of_their_own(tmp_path):
    """After ``destroy()`` no frozen weight is a view of memory the engine's tiers held."""
    model = lora_llama()
    engine = engine_of(model, config(tmp_path))
    w = engine.weights
    copies = [w.weights_tier.read(w._key(i)).wait() for i in range(w.num_layers)]
    spans = [(c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies]
    train(engine, batches(1))
    engine.destroy()
    for name in frozen_names(model):   # in fp32, as every parameter destroy() hands back
        p = dict(model.named_parameters())[name]
        assert p.dtype == torch.float32 and p.untyped_storage().nbytes() == p.numel() * 4, name
        assert not any(a <= p.data_ptr() < b for a, b in spans), name


def test_a_checkpoint_of_a_lora_run_resumes_bit_identically(tmp_path):
    """Saved after one step (the frozen weights as they are kept: bf16), loaded into a fresh engine of the
    same model, two more steps: the same as three steps without the break. Saved without the frozen
    weights, the fresh engine takes them from the model itself."""
    model = lora_llama()
    data = batches(3)
    straight = engine_of(copy.deepcopy(model), config(tmp_path / "a"))
    train(straight, data)
    want = {n: p.detach().float().clone() for n, p in straight.module.named_parameters()}
    straight.destroy()
    for exclude in (False, True):
        first = engine_of(copy.deepcopy(model), config(tmp_path / f"b{exclude}"))
        train(first, data[:1])
        first.save_checkpoint(str(tmp_path / f"ckpt{exclude}"), tag="t", exclude_frozen_parameters=exclude)
        first.destroy()
        second = engine_of(copy.deepcopy(model), config(tmp_path / f"c{exclude}"))
        second.load_checkpoint(str(tmp_path / f"ckpt{exclude}"), tag="t", load_module_strict=not exclude)
        train(second, data[1:])
        for n, p in second.module.named_parameters():
            assert torch.equal(p.detach().float(), want[n]), (exclude, n)
        second.destroy()


def test_a_parameter_that_trains_now_and_had_no_state_when_saved_starts_fresh_and_is_said(tmp_path):
    """A fine-tune's next phase: the head unfrozen, the first phase's checkpoint loaded. Its moments start fresh,
    as torch's load_state_dict leaves them (a DeepSpeed-written checkpoint missing them is refused); it was
    not said. A resume of the same set-up says nothing."""
    first = engine_of(lora_llama(), config(tmp_path / "a"))
    train(first, batches(1))
    first.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    first.destroy()
    same = engine_of(lora_llama(), config(tmp_path / "b"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    same.destroy()
    model = lora_llama()
    model.lm_head.weight.requires_grad_(True)
    second = engine_of(model, config(tmp_path / "c"))
    with pytest.warns(UserWarning, match=r"^lazytrain: the checkpoint loaded holds no optimizer state for 1 "
                                         r"parameter\(s\) that train now \(lm_head.weight\): they start with fresh "
                                         r"Adam moments \(frozen when it was saved\?\)$"):
        second.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    second.destroy()


def test_module_state_dict_holds_the_frozen_weights_as_kept(tmp_path):
    """``module_state_dict()``: the adapters' fp32 weights, the frozen block weights in bf16 (as DeepSpeed's
    bf16 module holds every weight), each its own storage."""
    model = lora_llama()
    engine = engine_of(model, config(tmp_path))
    state = engine.module_state_dict()
    for name, p in model.named_parameters():
        if ".layers." not in name:
            continue
        assert state[name].dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
        assert state[name].untyped_storage().nbytes() == state[name].numel() * state[name].element_size(), name
    engine.destroy()


def test_frozen_embedding_and_head_have_no_fp32_master(tmp_path):
    """Outside the blocks too: a frozen parameter is kept in bf16 alone (nothing updates it), the trainable
    ones get their fp32 masters; destroy() hands the frozen ones back in fp32, as trained with."""
    model = lora_llama()
    model.model.norm.weight.requires_grad_(True)   # one trainable parameter outside the blocks
    engine = engine_of(model, config(tmp_path))
    assert [engine._param_names[id(p)] for p, _ in engine.masters.pairs] == ["model.norm.weight"]
    for p in (model.model.embed_tokens.weight, model.lm_head.weight):
        assert p.dtype == torch.bfloat16 and engine.masters.master_of(p) is p
    given = model.lm_head.weight.detach().float()
    train(engine, batches(2))
    state = engine.module_state_dict()
    assert state["lm_head.weight"].dtype == torch.bfloat16 and state["model.norm.weight"].dtype == torch.float32
    engine.destroy()
    # handed back where the model computed (a GPU's memory), in fp32
    assert model.lm_head.weight.dtype == torch.float32 and torch.equal(model.lm_head.weight.cpu(), given.cpu())


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("which", ["model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight"])
def test_a_parameter_frozen_at_initialize_that_requires_grad_later_is_refused_by_name(tmp_path, which, bf16):
    """Unfreezing after initialize() (in bf16 an embedding would train on raw, unclipped bf16 gradients; a
    block weight would get none) makes the step raise before it updates anything, in any precision; frozen
    again, training goes on."""
    model = lora_llama()
    cfg = config(tmp_path)
    if not bf16:
        del cfg["bf16"]
    engine = engine_of(model, cfg)
    train(engine, batches(1))
    param = dict(model.named_parameters())[which]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    param.requires_grad_(True)
    x, y = batches(1, seed=3)[0]
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(RuntimeError, match=rf"^lazytrain: parameter '{which}' was frozen \(requires_grad False\) when "
                                           r"initialize\(\) ran and requires grad now"):
        engine.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    param.requires_grad_(False)
    engine.zero_grad()
    assert param.grad is None
    train(engine, batches(1, seed=4))
    assert torch.equal(param, before[which])
    engine.destroy()


def test_a_block_parameter_frozen_after_initialize_is_refused_by_name(tmp_path):
    """Freezing a streamed block's trained parameter after initialize() (it would go on getting gradients and
    updates) makes a backward through a forward that ran with it frozen raise, and the step raise before it
    updates anything; trainable again, training goes on. Such a forward whose backward came after the parameter
    was unfrozen gave it the gradient of that forward, where PyTorch gives none (an adversarial loss on the input
    embeddings computed with the model frozen doubled the blocks' gradients). The forward itself runs (PEFT's
    disable_adapter() freezes the adapters for a reference forward), and so does torch.autograd.grad to the
    inputs through it."""
    model = make_model("llama")
    engine = engine_of(model, config(tmp_path))
    train(engine, batches(1))
    which = "model.layers.2.mlp.up_proj.weight"
    param = dict(model.named_parameters())[which]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batches(1, seed=3)[0]
    refused = re.escape(
        f"lazytrain: parameter '{which}' of a streamed block trained when initialize() ran and was frozen "
        f"(requires_grad False) at the forward this backward goes through: the streamed blocks compute gradients "
        f"for what trained at initialize(), so it would get a gradient PyTorch would not give it. For gradients "
        f"with respect to the inputs alone, use torch.autograd.grad(loss, inputs); to freeze it for good, freeze "
        f"it before initialize()")
    param.requires_grad_(False)
    embeddings = model.get_input_embeddings()(x).detach().requires_grad_()
    loss = lm_loss(engine(inputs_embeds=embeddings), y)
    (to_inputs,) = torch.autograd.grad(loss, embeddings)   # no weight gradient: runs
    assert to_inputs.abs().sum() > 0
    loss = lm_loss(engine(x), y)
    param.requires_grad_(True)   # unfrozen before the backward: the forward ran frozen
    with pytest.raises(RuntimeError, match=refused):
        loss.backward()
    with pytest.raises(RuntimeError, match="a backward through the streamed layers failed"):
        engine.step()
    engine.zero_grad()
    param.requires_grad_(False)   # frozen at the step: refused before the update
    with pytest.raises(RuntimeError, match=rf"^lazytrain: parameter '{which}' of a streamed block trained when "
                                           r"initialize\(\) ran and is frozen now \(requires_grad False\)"):
        engine.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    param.requires_grad_(True)
    engine.zero_grad()
    train(engine, batches(1, seed=4))
    assert not torch.equal(param, before[which])
    engine.destroy()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a model given in a GPU's memory")
def test_a_model_given_on_a_gpu_gets_its_frozen_weights_back_there_after_a_failed_set_up(tmp_path):
    """Frozen weights given in a GPU's memory are not held there through set-up (the engine's copies replace
    them): a set-up that fails hands them back on the GPU, in their dtype, with the values of the training
    precision; the trainable ones exactly as given."""
    model = lora_llama().cuda()
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = config(tmp_path, overlap_optimizer=True)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2}}
    with pytest.raises(ConfigError, match="overlap_optimizer"):
        engine_of(model, cfg)
    for name, p in model.named_parameters():
        assert p.is_cuda and p.dtype == torch.float32, name
        assert torch.equal(p, given[name] if p.requires_grad else given[name].bfloat16().float()), name


def test_a_model_rebuilt_in_place_after_initialize_is_refused_until_destroy(tmp_path):
    """PEFT's ``merge_and_unload()`` on the live model swaps each adapter module for a plain linear layer with
    the merged weight: the engine refuses a forward through it, naming the way out (layout_guard.py: the
    adapters' parameters have left the model); after ``destroy()`` the merged model runs as plain PyTorch."""
    from lazytrain.engine.layout_guard import ModelChangedError
    from engine_models import LoRALinear
    model = lora_llama()
    engine = engine_of(model, config(tmp_path))
    train(engine, batches(1))

    def merge(module):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                merged = child.base
                with torch.no_grad():
                    merged.weight += (child.lora_B.weight.float() @ child.lora_A.weight.float()).to(merged.weight.dtype)
                setattr(module, name, merged)
            else:
                merge(child)
    merge(model)
    x, _ = batches(1)[0]
    with pytest.raises(ModelChangedError, match=r"^'model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' and 23 more "
                                                r"parameters found at initialize\(\) no longer in the model: .* "
                                                r"PEFT's merge_and_unload\(\)\)\. .* or after engine\.destroy\(\), "
                                                r"which hands it back$"):
        with torch.no_grad():
            engine(x)
    engine.destroy()
    with torch.no_grad():
        assert torch.isfinite(model(x).logits).all()


def test_a_quantized_frozen_parameter_outside_the_blocks_keeps_its_dtype(tmp_path):
    """A frozen integer or 8-bit float parameter (quantized weights, a lookup table) is not a weight to cast: it
    keeps its dtype through training and after ``destroy()``."""
    model = lora_llama()
    codes = torch.arange(-4, 4, dtype=torch.int8)
    scales = torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn)
    model.codes = torch.nn.Parameter(codes.clone(), requires_grad=False)
    model.scales = torch.nn.Parameter(scales.clone(), requires_grad=False)
    engine = engine_of(model, config(tmp_path))
    assert (model.codes.dtype, model.scales.dtype) == (torch.int8, torch.float8_e4m3fn)
    train(engine, batches(1))
    engine.destroy()
    assert model.codes.dtype == torch.int8 and torch.equal(model.codes, codes)
    assert model.scales.dtype == torch.float8_e4m3fn and torch.equal(model.scales.view(torch.uint8),
                                                                     scales.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float8_e4m3fn])
def test_a_quantized_block_weight_is_refused_before_anything_moves(dtype, tmp_path):
    """The blocks stream in flat buffers of the training precision, which would cast a quantized weight (an int32
    of packed 4-bit values would lose them): refused at initialize, naming it, the model untouched."""
    model = lora_llama()
    packed = torch.zeros(4, 8).to(dtype)
    model.model.layers[1].mlp.packed = torch.nn.Parameter(packed, requires_grad=False)
    given = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ConfigError, match=rf"^block parameter model\.layers\.1\.mlp\.packed is quantized \({name}\): "
                                          r"LazyTrain streams the blocks' weights in the training precision and cannot "
                                          r"stream quantized weights \(bitsandbytes 4-bit/8-bit layers, GPTQ/AWQ, FP8\)"):
        engine_of(model, config(tmp_path))
    assert {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()} == given


def test_a_complex_block_weight_is_refused_as_complex(tmp_path):
    model = lora_llama()
    model.model.layers[0].mlp.phase = torch.nn.Parameter(torch.ones(4, dtype=torch.complex64), requires_grad=False)
    with pytest.raises(ConfigError, match=r"^block parameter model\.layers\.0\.mlp\.phase is complex64: LazyTrain "
                                          r"streams the blocks' weights in the training precision, which has no "
                                          r"imaginary part"):
        engine_of(model, config(tmp_path))


def test_a_qlora_model_of_bitsandbytes_4bit_layers_is_refused_by_name(tmp_path):
    """PEFT adapters over bitsandbytes 4-bit layers (QLoRA): the packed uint8 weights and their quant_state
    cannot stream; refused with the way out, where it used to crash inside bitsandbytes' kernel."""
    bnb = pytest.importorskip("bitsandbytes")
    model = make_model("llama")
    layer = model.model.layers[0].self_attn
    q = bnb.nn.Linear4bit(layer.q_proj.in_features, layer.q_proj.out_features, bias=False,
                          compute_dtype=torch.bfloat16, quant_type="nf4")
    q.load_state_dict(layer.q_proj.state_dict())
    layer.q_proj = q.to("cpu")   # quantized as it moves
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"^block parameter model\.layers\.0\.self_attn\.q_proj\.weight is quantized "
                                          r"\(uint8, Params4bit\).*Load the model unquantized in bf16"):
        engine_of(model, config(tmp_path))


def freeze_below(model, n: int):
    """A fine-tuning set-up that trains the top blocks alone: the embedding and blocks 0..n-1 frozen."""
    model.get_input_embeddings().requires_grad_(False)
    for block in model.model.layers[:n]:
        block.requires_grad_(False)
    return model


@pytest.mark.parametrize("lt", [dict(checkpoint_interval=1, boundary_home="host", testing={"copy_threads": True}),
                                dict(checkpoint_interval=2, last_segment_graph=True)],
                         ids=["re-run-host-boundaries", "graph-tail"])
def test_frozen_blocks_below_the_first_trainable_one_are_not_differentiated(lt):
    """Their input gradients reach nothing that trains: plain PyTorch never differentiates them. Every block
    was handed the engine's anchor, so each one's output required grad: the frozen blocks had their weights
    and kept inputs fetched again, were re-run and differentiated, and most of the backward's compute was
    theirs. Training is unchanged (against plain PyTorch, fp32, within 1e-5)."""
    model = freeze_below(make_model("llama"), 4)
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "lazytrain": lt}
    engine = engine_of(model, cfg)
    for n, (x, y) in enumerate(data):
        if n == len(data) - 1:
            engine.trace_next_step()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, ref) < 1e-5
    spans = engine.last_trace.spans
    forward_end = max(s.end for s in spans if s.name.startswith("fwd L"))
    assert sorted(int(s.name[len("bwd L"):]) for s in spans if s.name.startswith("bwd L")) == [4, 5]
    assert not [s.name for s in spans if s.name.startswith("diff L") and int(s.name[len("diff L"):]) < 4]
    read_back = sorted(s.name.split(".", 1)[1] for s in spans if s.lane == "h2d" and s.start >= forward_end)
    # the trainable layers re-run (those before the graph of the last segment, if any), and none below them
    assert read_back == sorted(f"{what}{j}" for j in range(4, engine.executor.graph_start)
                               for what in ("boundary", "layer"))
    assert read_back == ([] if lt.get("last_segment_graph") else ["boundary4", "layer4"]) or \
        engine.device.type != "cpu"
    engine.destroy()


def _pass_keys(engine) -> dict[str, int]:
    return {name: sum(k.startswith("pass") for k in tier.keys()) for name, tier in engine.tiers.items()}


@pytest.mark.parametrize("lt", [dict(checkpoint_interval=1), dict(checkpoint_interval=2, boundary_home="host")],
                         ids=["every-1-device", "every-2-host"])
def test_a_backward_that_stops_above_block_0_frees_its_pass_while_the_script_holds_the_loss(lt):
    """A pass was freed when its backward reached block 0; below the first trainable block none does, and the
    loss a script holds keeps the pass alive: its frozen blocks' kept boundaries stayed on their tiers, two
    passes' worth at the next forward (a list of losses kept every one)."""
    model = freeze_below(make_model("llama"), 4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": lt}
    engine = engine_of(model, cfg)
    losses = []
    for x, y in batches(3):
        losses.append(lm_loss(engine(x), y))
        engine.backward(losses[-1])
        engine.step()
        assert not any(_pass_keys(engine).values()), _pass_keys(engine)
    engine.destroy()


@pytest.mark.parametrize("interval, frozen", [(3, (2, 5)), (2, (1, 3, 5))])
def test_a_frozen_block_ending_a_re_run_segment_above_a_trainable_one_trains_as_pytorch(interval, frozen):
    """Blocks that each take the embedding's output (not the previous block's), the embedding frozen: a frozen
    block ending a re-run segment got no backward, and the trainable block below it in the segment found its
    input neither kept nor recomputed (an internal error)."""
    model = make_model("parallel")
    model.emb.requires_grad_(False)
    for i in frozen:
        model.stack[i].requires_grad_(False)
    data = batches(3)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"checkpoint_interval": interval, "testing": {"copy_threads": True}}}
    engine = engine_of(model, cfg)
    train(engine, data)
    assert max_rel_diff(engine.module, ref) < 1e-5
    engine.destroy()


@pytest.mark.parametrize("policy", ["every_k", "keep_all"])
def test_a_forward_with_the_adapters_disabled_is_re_run_with_them_disabled(policy, tmp_path):
    """PEFT's disable_adapter() around a reference forward, then the adapted forward, one loss over both (a DPO
    step): the blocks re-run in the backward ran with the adapters as they were at the backward, not at the
    forward (parameters up to 0.3 relative off plain PyTorch's, in silence)."""
    data = batches(3)

    def train(model, forward, backward, step):
        lora = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
        for x, y in data:
            for m in lora:
                m._disable_adapters = True
            reference = lm_loss(forward(x), y)
            for m in lora:
                m._disable_adapters = False
            backward(lm_loss(forward(x), y) + 0.5 * reference)
            step()

    model = add_lora(make_model("llama"), ("q_proj", "v_proj"))
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    def ref_step():
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
    train(ref, lambda x: ref(x.to(AUTO_DEVICE)), lambda loss: loss.backward(), ref_step)
    cfg = config(tmp_path, policy=policy)
    del cfg["bf16"]   # fp32: parity with plain PyTorch's fp32
    engine = engine_of(model, cfg)
    train(model, engine, engine.backward, engine.step)
    assert max_rel_diff(engine.module, ref) < 1e-5
    engine.destroy()


@pytest.mark.parametrize("name", ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"])
def test_a_parameter_outside_the_blocks_frozen_after_initialize_stays_put_in_bf16(name, tmp_path):
    """Its fp32 master still required grad: each step gave it a zero gradient, and Adam's momentum moved it
    (by about 2e-2 over 3 steps) where plain PyTorch leaves a frozen parameter alone (as fp32 runs here did)."""
    model = make_model("llama")
    engine = engine_of(model, config(tmp_path))
    data = batches(5)
    for i, (x, y) in enumerate(data):
        if i == 2:
            param = dict(model.named_parameters())[name]
            param.requires_grad_(False)
            master = engine.masters.by_param[id(param)].detach().clone()
            before = param.detach().clone()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    assert torch.equal(engine.masters.by_param[id(param)], master)
    assert torch.equal(param.detach(), before)
    engine.destroy()


@pytest.mark.parametrize("block_norms_train", [True, False])
def test_an_adapter_registered_outside_the_blocks_but_used_in_one_is_refused_by_name(block_norms_train, tmp_path):
    """Adapters kept in model.adapters, added to each block's MLP output by a forward hook: with the blocks' norms
    training they got no gradient, in silence (plain PyTorch trains them); with nothing else training the
    backward failed with torch's "element 0 of tensors does not require grad"."""
    from lazytrain.engine.executor import ExecutorError
    model = make_model("llama", n_layers=4)
    torch.manual_seed(2)
    model.adapters = torch.nn.ModuleList(torch.nn.Linear(32, 32, bias=False) for _ in model.model.layers)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("adapters.") or (block_norms_train and "input_layernorm" in name))
    for layer, adapter in zip(model.model.layers, model.adapters):
        layer.mlp.register_forward_hook(lambda m, args, out, adapter=adapter: out + adapter(args[0]))
    cfg = config(tmp_path)
    del cfg["bf16"]
    engine = engine_of(model, cfg)
    x, y = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the hooks inside the blocks are warned of
        out = engine(x)
    if block_norms_train:
        with pytest.raises(ExecutorError, match=r"^block 3 computes with 'adapters.3.weight', a trainable parameter "
                                                r"registered outside the streamed blocks: LazyTrain differentiates "
                                                r"a block's own weights, so it would get no gradient from the block. "
                                                r"Register it inside the block"):
            engine.backward(lm_loss(out, y))
    else:
        with pytest.raises(RuntimeError, match=r"^engine.backward\(loss\): the loss does not require grad: nothing "
                                               r"it was computed from trains .* A trainable parameter registered "
                                               r"outside the streamed blocks that a block computes with"):
            engine.backward(lm_loss(out, y))
    engine.destroy()
