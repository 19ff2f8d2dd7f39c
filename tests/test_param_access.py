"""lazytrain.utils' safe_get_full_* (DeepSpeed's deepspeed.utils accessors): a parameter's fp32 gradient,
weight and optimizer state read wherever the engine keeps them. In bf16 the embedding's and head's
gradients accumulate in fp32 masters apart from the parameters (on a GPU in fp32 too), so their ``.grad`` is
None: these tests are the CPU's view of that path."""
import copy
import threading
import time

import pytest
import torch

import lazytrain
from lazytrain.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state)
from engine_models import AUTO_DEVICE, batches, lm_loss, make_model


def engine_for(model, dtype: str = "fp32", gas: int = 1, optimizer: str = "AdamW", **lazytrain_section):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
           "gradient_clipping": 0, "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"checkpoint_interval": 2, **lazytrain_section}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return lazytrain.initialize(model=model, config=cfg)[0]


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_grad_is_plain_pytorchs_gradient_for_every_parameter(dtype, gas):
    """After the step's backwards, every parameter's full gradient is plain PyTorch's (the loss averaged over
    the micro-batches, as engine.backward does), the non-block ones included where ``.grad`` is None. In bf16
    the reference is the same model in bf16, whose kernels round otherwise: within 2% in norm (a wrong
    tensor, scale or missing micro-batch is off by far more)."""
    model = make_model("llama")
    ref = copy.deepcopy(model).to(AUTO_DEVICE, torch.bfloat16 if dtype == "bf16" else torch.float32)
    data = batches(gas)
    ref_grads = {}
    for x, y in data:
        ref.zero_grad()
        (lm_loss(ref(x.to(AUTO_DEVICE)), y) / gas).backward()
        for n, q in ref.named_parameters():
            ref_grads[n] = ref_grads.get(n, 0) + q.grad.float().cpu()
    engine = engine_for(model, dtype, gas)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
    if dtype == "bf16":
        assert model.lm_head.weight.grad is None and model.model.embed_tokens.weight.grad is None
    for n, p in model.named_parameters():
        g = safe_get_full_grad(p)
        assert g.dtype == torch.float32 and g.device.type == "cpu" and g.shape == p.shape, n
        if dtype == "fp32":
            assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-7), n
        else:
            assert float((g - ref_grads[n]).norm() / ref_grads[n].norm()) < 2e-2, n
    engine.destroy()


def slow_layer_updates(engine) -> None:
    """Each layer's update sleeps first: the update thread is still at work when step() returns."""
    update = engine.optimizer.update

    def slow_update(*args, **kwargs):
        time.sleep(0.01)
        return update(*args, **kwargs)
    engine.optimizer.update = slow_update


@pytest.mark.parametrize("overlap", [False, True])
def test_full_grad_is_a_copy_and_follows_the_step(overlap):
    """A copy (writing it changes nothing the optimizer reads); after step() the non-block masters' gradients
    are gone (None) and the blocks' buffers zeroed, as before the first backward. With the update overlapping
    (a GPU's default) it waits for the update, which reads the layers' gradients and then zeroes them: right
    after step() the read gave the step's gradient, on every one of 10 runs."""
    model = make_model("llama")
    engine = engine_for(model, "bf16", overlap_optimizer=overlap)
    if overlap:
        slow_layer_updates(engine)
    head, block = model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight
    assert safe_get_full_grad(head) is None and torch.count_nonzero(safe_get_full_grad(block)) == 0
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    g = safe_get_full_grad(head)
    g.zero_()
    assert torch.count_nonzero(safe_get_full_grad(head)) > 0
    engine.step()
    assert safe_get_full_grad(head) is None and torch.count_nonzero(safe_get_full_grad(block)) == 0
    engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_unreached_parameter_has_a_zero_full_grad_once_a_backward_ran(dtype):
    """``unused`` no forward reaches: before a backward its full gradient is None, after one (through
    engine.backward, or a plain loss.backward()) zeros, as DeepSpeed's flat buffers give it and as the step
    applies it (_zero_grads_of_unreached_params); after step() and zero_grad() None again. It was None between
    backward and step."""
    model = make_model("branch")
    engine = engine_for(model, dtype)
    unused = model.unused.weight
    x, y = batches(1)[0]
    assert safe_get_full_grad(unused) is None
    engine.backward(lm_loss(engine(x), y))
    g = safe_get_full_grad(unused)
    assert g.dtype == torch.float32 and g.shape == unused.shape and torch.count_nonzero(g) == 0
    engine.step()
    assert safe_get_full_grad(unused) is None
    lm_loss(engine(x), y).backward()   # no engine.backward: the streamed blocks' backward tells it
    assert torch.count_nonzero(safe_get_full_grad(unused)) == 0 and safe_get_full_grad(unused).shape == unused.shape
    engine.zero_grad()
    assert safe_get_full_grad(unused) is None
    engine.destroy()


def test_a_tensor_added_to_the_optimizer_is_answered_for_and_another_thread_is_refused():
    """A loss's learnable temperature added with add_param_group is trained by the engine: its gradient and
    moments are read like a parameter's. A logger thread calling in while the training thread trains would
    wait on the gradient sinks beside it (two threads popping one queue crashed the training thread)."""
    model = make_model("llama")
    engine = engine_for(model)
    temperature = torch.nn.Parameter(torch.ones(()))
    engine.optimizer.add_param_group({"params": [temperature], "weight_decay": 0.0})
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y) * temperature)
    assert safe_get_full_grad(temperature).shape == () and float(safe_get_full_grad(temperature)) != 0.0
    engine.step()
    engine.backward(lm_loss(engine(x), y))   # not reached: no gradient, as the step has it (plain PyTorch's rule)
    assert safe_get_full_grad(temperature) is None
    engine.step()
    assert safe_get_full_optimizer_state(temperature, "exp_avg").shape == ()
    errors = []

    def logger():
        try:
            safe_get_full_grad(model.lm_head.weight)
        except RuntimeError as e:
            errors.append(str(e))
    t = threading.Thread(target=logger)
    t.start()
    t.join()
    assert errors == ["lazytrain.utils.safe_get_full_grad was called from a thread other than the one that set up "
                      "the engine: it waits for the gradient copies and the overlapped update, which only the "
                      "training thread may do; call it from the training loop"]
    engine.destroy()


def test_a_frozen_parameter_has_no_full_grad_weight_or_state():
    model = make_model("llama")
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    engine = engine_for(model, "bf16")
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    assert safe_get_full_grad(model.model.layers[1].mlp.up_proj.weight) is None
    assert safe_get_full_grad(model.model.embed_tokens.weight) is None
    assert safe_get_full_fp32_param(model.model.embed_tokens.weight) is None   # nothing updates it (DeepSpeed's)
    engine.step()
    assert safe_get_full_optimizer_state(model.model.layers[1].mlp.up_proj.weight, "exp_avg") is None
    engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_fp32_param_and_optimizer_state_are_the_masters_and_torch_adamw_s(dtype):
    """After two steps: the fp32 weights are the module's fp32 state (its masters), and the Adam moments equal
    those of plain torch AdamW stepped on the same fp32 gradients (8-bit moments are tested below)."""
    model = make_model("llama")
    engine = engine_for(model, dtype, optimizer="AdamW", lean_norms=False)
    names = dict(model.named_parameters())
    masters, moments = {}, {}
    for x, y in batches(2):
        engine.backward(lm_loss(engine(x), y))
        grads = {n: safe_get_full_grad(p) for n, p in names.items()}
        before = {n: safe_get_full_fp32_param(p) for n, p in names.items()}
        engine.step()
        for n, g in grads.items():
            if n not in masters:
                masters[n] = torch.nn.Parameter(before[n])
                moments[n] = torch.optim.AdamW([masters[n]], lr=1e-2, weight_decay=0.1)
            masters[n].grad = g
            moments[n].step()
    state = engine.module_state_dict()
    for n, p in names.items():
        assert torch.equal(safe_get_full_fp32_param(p), state[n]), n
        for key in ("exp_avg", "exp_avg_sq"):
            mine = safe_get_full_optimizer_state(p, key)
            theirs = moments[n].state[masters[n]][key]
            assert mine.shape == p.shape and torch.allclose(mine, theirs, rtol=1e-5, atol=1e-9), (n, key)
        assert torch.allclose(safe_get_full_fp32_param(p), masters[n].detach(), rtol=1e-5, atol=1e-6), n
    with pytest.raises(ValueError, match=r"^lazytrain\.utils\.safe_get_full_optimizer_state: \w+ keeps no state "
                                         r"'no_such_key' of this parameter's shape; it keeps 'exp_avg', 'exp_avg_sq'"):
        safe_get_full_optimizer_state(names["lm_head.weight"], "no_such_key")
    engine.destroy()


@pytest.mark.parametrize("overlap", [False, True])
def test_eight_bit_moments_come_back_dequantized_in_the_parameters_shape(overlap):
    """HybridAdamW keeps 8-bit moments for large tensors: the full state is their fp32 dequantization,
    within the blockwise code's resolution of torch AdamW's moment. With the update overlapping (a GPU's
    default) the streamed layers' state is written on the update thread after step() returns: the script
    waits (engine.wait_for_update()) before it reads engine.optimizer.state directly."""
    model = make_model("llama")
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "gradient_clipping": 0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"checkpoint_interval": 2, "optimizer_states": "8bit", "hybrid_threshold": 0,
                         "overlap_optimizer": overlap}}
    engine = lazytrain.initialize(model=model, config=cfg)[0]
    if overlap:
        slow_layer_updates(engine)
    p = model.model.layers[0].mlp.up_proj.weight
    assert safe_get_full_optimizer_state(p, "exp_avg") is None   # before the first step
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    g = safe_get_full_grad(p)
    engine.step()
    engine.wait_for_update()   # the optimizer's state is a plain dict: reading it does not wait
    st = engine.optimizer.state[p]
    assert "state1" in st   # the 8-bit layout, not fp32 moments
    m = safe_get_full_optimizer_state(p, "exp_avg")
    assert m.shape == p.shape and m.dtype == torch.float32
    exact = 0.1 * g   # Adam's first moment after one step, (1 - beta1) * g
    assert float((m - exact).abs().max()) <= 0.02 * float(exact.abs().max())
    engine.destroy()


@pytest.mark.parametrize("copy_threads", [False, True], ids=["cpu-path", "gradients-in-flight"])
@pytest.mark.parametrize("zero", ["optimizer", "module"])
def test_after_a_zero_grad_the_next_backward_shows_every_block_gradient_in_grad(zero, copy_threads):
    """optimizer.zero_grad() / model.zero_grad() clear the block parameters' .grad (the engine keeps their
    buffers); .grad stayed None until the step, so a script's own clipping or scaling after the backward missed
    every block weight, silently. As in PyTorch, the backward's gradients are in .grad after it: a loop that
    zeroes, backpropagates, scales .grad and clips with torch trains as plain PyTorch."""
    torch.manual_seed(0)
    model = make_model("llama")
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"device": "cpu", **({"testing": {"copy_threads": True}} if copy_threads else {})}}
    engine, optimizer, _, _ = lazytrain.initialize(model=model, config=cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches(3):
        (optimizer if zero == "optimizer" else model).zero_grad()
        engine.backward(lm_loss(engine(x), y))
        ref_opt.zero_grad()
        lm_loss(ref(x), y).backward()
        for m in (model, ref):
            assert all(p.grad is not None for p in m.parameters())
            with torch.no_grad():
                for p in m.model.layers.parameters():
                    p.grad.mul_(0.5)
        norms = [float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)) for m in (model, ref)]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
        engine.step()
        ref_opt.step()
    a, b = engine.module_state_dict(), ref.state_dict()
    assert max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a) < 1e-5
    engine.destroy()


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
def test_unmanaged_every_backward_shows_its_whole_gradient_in_grad(managed):
    """With "managed_gradient_accumulation": false any backward may be its step's last: its gradients, which
    land on a copy thread here (delayed at random), are whole in .grad when it returns, as PyTorch's are. Managed,
    that holds at the step's last micro-batch (the others' landing overlaps the next forward)."""
    torch.manual_seed(0)
    model = make_model("llama")
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 10**9,
           "managed_gradient_accumulation": managed,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"device": "cpu", "testing": {"copy_threads": True, "chaos_seed": 3,
                                                      "chaos_max_delay_ms": 20.0}}}
    engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    blocks = list(model.model.layers.parameters())
    for i, (x, y) in enumerate(batches(6)):
        ends_step = i % 3 == 2
        engine.backward(lm_loss(engine(x), y))
        (lm_loss(ref(x), y) / 3).backward()
        if ends_step or not managed:
            for p, q in zip(blocks, ref.model.layers.parameters()):
                assert float((p.grad - q.grad).abs().max() / q.grad.abs().max()) < 1e-5
        if ends_step or managed:   # managed, step() is called after every micro-batch (it counts them)
            engine.step()
        if ends_step:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
    a, b = engine.module_state_dict(), ref.state_dict()
    assert max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a) < 1e-5
    engine.destroy()


def test_a_layer_whose_overlapped_update_is_pending_shows_no_grad_after_a_backward_that_skipped_it():
    """The backward's end shows every block's buffer in .grad again, but not a layer the forward skipped while
    its overlapped update still reads the buffer: a script's zero_grad(set_to_none=False) there would zero
    what the update reads. Its .grad comes back once the update is done and has cleared the buffer."""
    from engine_models import MLPBlock, VOCAB

    class Skipping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 16)
            self.stack = torch.nn.ModuleList(MLPBlock(16) for _ in range(4))
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, x, skip_last=False):
            h = self.emb(x)
            for block in self.stack[:3] if skip_last else self.stack:
                h = block(h)
            return self.head(h)

    torch.manual_seed(0)
    model = Skipping()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"device": "cpu", "overlap_optimizer": True, "checkpoint_interval": 1}}
    engine = lazytrain.initialize(model=model, config=cfg)[0]
    release = threading.Event()
    update = engine.optimizer.update

    def held_update(params, *args, **kwargs):   # the last layer's update waits until released
        if any(p is model.stack[3].fc1.weight for p in params):
            release.wait(30)
        return update(params, *args, **kwargs)
    engine.optimizer.update = held_update
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.backward(lm_loss(engine(x2, skip_last=True), y2))
    assert engine.weights.update_pending(3)
    assert all(p.grad is None for p in model.stack[3].parameters())
    assert all(p.grad is not None for p in model.stack[0].parameters())
    release.set()
    engine.wait_for_update()
    assert all(p.grad is not None and not p.grad.any() for p in model.stack[3].parameters())
    engine.destroy()


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_an_empty_parameters_hybrid_adamw_state_is_empty(states):
    """HybridAdamW keeps no moment chunks for a parameter of no elements: reading its state ended in torch.cat's
    "expected a non-empty list of Tensors", where torch AdamW's answer is an empty tensor."""
    model = make_model("llama")
    model.extra = torch.nn.Parameter(torch.zeros(0, 3))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"optimizer_states": states, "hybrid_threshold": 0, "overlap_optimizer": True}}
    engine = lazytrain.initialize(model=model, config=cfg)[0]
    assert type(engine.basic_optimizer).__name__ == "HybridAdamW"
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y) + model.extra.sum())
    engine.step()
    engine.wait_for_update()
    for key in ("exp_avg", "exp_avg_sq"):
        state = safe_get_full_optimizer_state(model.extra, key)
        assert state.shape == (0, 3) and state.dtype == torch.float32
    engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_weight_set_after_initialize_trains_as_one_set_before_it(dtype):
    """safe_set_full_fp32_param writes the master and every compute copy: the engine then computes, steps and
    saves as an engine set up on a model that had the value all along (a block weight, the embedding, the
    head), to the last bit."""
    new = {"model.embed_tokens.weight": lambda p: torch.linspace(-1, 1, p.numel()).reshape(p.shape),
           "model.layers.0.self_attn.q_proj.weight": lambda p: torch.full(p.shape, 0.03),
           "lm_head.weight": lambda p: -p.detach().float()}
    torch.manual_seed(0)
    set_after = make_model("llama")
    set_before = copy.deepcopy(set_after)
    values = {n: f(dict(set_after.named_parameters())[n]) for n, f in new.items()}
    with torch.no_grad():
        for n, v in values.items():
            dict(set_before.named_parameters())[n].copy_(v)
    before = engine_for(set_before, dtype)
    after = engine_for(set_after, dtype)
    params = dict(set_after.named_parameters())
    rewritten, refresh = [], after.weights.refresh_compute_copy
    after.weights.refresh_compute_copy = lambda i, *a, **k: (rewritten.append(i), refresh(i, *a, **k))
    for n, v in values.items():
        safe_set_full_fp32_param(params[n], v)
        assert torch.equal(safe_get_full_fp32_param(params[n]), v), n
    assert rewritten == [0]   # the compute copy of the one streamed layer written (not every layer's)
    after.weights.refresh_compute_copy = refresh
    for x, y in batches(2):
        losses = []
        for engine in (before, after):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    a, b = before.module_state_dict(), after.module_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"^lazytrain\.utils\.safe_set_full_fp32_param: the value's shape \(3,\) is "
                                         r"not the parameter's \(32, 32\)$"):
        safe_set_full_fp32_param(params["lm_head.weight"], torch.zeros(3))
    with pytest.raises(ValueError, match="the value must be floating point and finite"):
        safe_set_full_fp32_param(params["lm_head.weight"], torch.full((32, 32), float("nan")))
    before.destroy()
    after.destroy()


@pytest.mark.parametrize("write", ["safe_set-head", "safe_set-layer0", "load_state_dict-norm"])
@pytest.mark.parametrize("weights_home", ["hbm", "host"])
def test_a_write_of_some_weights_after_a_step_leaves_the_others_as_the_step_made_them(weights_home, write):
    """With resident layers, a write of some weights after a step (before the next forward) dropped the
    refresh every other resident layer's device copy was due from the step: they computed on their
    pre-step weights, silently. A write of the value a weight already holds changes nothing."""
    torch.manual_seed(0)
    model = make_model("llama")
    plain = copy.deepcopy(model)
    engines = [engine_for(m, weights_home=weights_home) for m in (model, plain)]
    (x, y), (x2, y2) = batches(2)
    for engine in engines:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    params = dict(model.named_parameters())
    name = {"safe_set-head": "lm_head.weight", "safe_set-layer0": "model.layers.0.mlp.up_proj.weight",
            "load_state_dict-norm": "model.norm.weight"}[write]
    value = safe_get_full_fp32_param(params[name])
    if write.startswith("safe_set"):
        safe_set_full_fp32_param(params[name], value)
    else:
        model.load_state_dict({name: value}, strict=False)
    losses = []
    for engine in engines:
        loss = lm_loss(engine(x2), y2)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    a, b = (e.module_state_dict() for e in engines)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for engine in engines:
        engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_write_under_gathered_parameters_that_reaches_one_copy_is_said(dtype):
    """GatheredParameters(modifier_rank=0) in one process: a write in bf16 to the embedding reaches one copy of
    it (the next step would undo it), which is said, naming the way that writes them all; a block's, a read, or
    fp32 on the CPU (one copy), says nothing."""
    import warnings
    from lazytrain.integrations.deepspeed_entry import _GatheredParameters
    model = make_model("llama")
    engine = engine_for(model, dtype)
    embedding, block = model.model.embed_tokens.weight, model.model.layers[0].mlp.up_proj.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _GatheredParameters([embedding, block], modifier_rank=0):
            embedding.sum()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _GatheredParameters([embedding, block], modifier_rank=0):
            with torch.no_grad():
                embedding.mul_(0.5)
                block.mul_(0.5)
    said = [str(w.message) for w in seen if "GatheredParameters" in str(w.message)]
    if dtype == "fp32":
        assert said == []
    else:
        # the block's write reaches the next forward (tests/test_inplace_writes.py); the embedding's master does
        # not see it, and the next step writes it back
        assert said == ["lazytrain: 1 parameter(s) written under deepspeed.zero.GatheredParameters(modifier_rank=...) "
                        "(shapes (32, 32)) keep an fp32 master the write did not reach: the next step writes it back "
                        "over the write. Write them with lazytrain.utils.safe_set_full_fp32_param(p, value) "
                        "(deepspeed.utils' after lazytrain.replace_deepspeed()), which writes every copy"]
    engine.destroy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_gradient_set_is_the_one_the_step_applies(dtype):
    """safe_set_full_grad on every parameter (a block's in its layer buffer, the embedding's and head's in
    their fp32 masters in bf16, where ``.grad`` is None), then SGD with weight decay: each fp32 weight moves
    by exactly lr * (value + wd * weight)."""
    model = make_model("llama")
    engine = engine_for(model, dtype, optimizer="SGD")
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    params = dict(model.named_parameters())
    before = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    values = {n: torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (k + 1) for k, (n, p) in enumerate(params.items())}
    for n, p in params.items():
        safe_set_full_grad(p, values[n])
        assert torch.equal(safe_get_full_grad(p), values[n]), n
    engine.step()
    for n, p in params.items():
        expected = before[n] - 1e-2 * (values[n] + 0.1 * before[n])
        assert torch.allclose(safe_get_full_fp32_param(p), expected, rtol=1e-6, atol=1e-7), n
    with pytest.raises(ValueError, match=r"^lazytrain\.utils\.safe_set_full_grad: the value's shape \(3,\) is not "
                                         r"the parameter's \(32, 32\)$"):
        safe_set_full_grad(params["lm_head.weight"], torch.zeros(3))
    engine.destroy()


def test_a_gradient_set_without_a_backward_in_fp16_is_a_scaled_one_as_after_a_backward():
    """safe_set_full_grad takes the value as safe_get_full_grad gives it: in fp16 times the loss scale. Set with
    no backward in the step, it was applied unscaled (the step divides by the scale only after a backward): the
    weight moved loss-scale times too far."""
    moved = []
    for with_backward in (True, False):
        model = make_model("llama")
        engine = lazytrain.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 0,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "fp16": {"enabled": True, "initial_scale_power": 8},
            "lazytrain": {"checkpoint_interval": 2}})[0]
        head = model.lm_head.weight
        if with_backward:
            x, y = batches(1)[0]
            engine.backward(lm_loss(engine(x), y))
        before = safe_get_full_fp32_param(head)
        safe_set_full_grad(head, torch.full(head.shape, engine.loss_scaler.scale))   # 1.0, scaled
        engine.step()
        moved.append(float((before - safe_get_full_fp32_param(head)).abs().max()))
        engine.destroy()
    assert moved == [pytest.approx(1e-2, rel=1e-5)] * 2


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_an_optimizer_state_set_is_the_one_the_next_step_reads(states):
    """Two engines trained a step on different batches; the second is given the first's weights (fp32 set)
    and moments (this set): the next step on one batch gives both the same weights, bit for bit with fp32
    moments. 8-bit moments are quantized as a step requantizes them: read back within their codes' precision,
    the weights after the step within 2e-4 (given the weights alone they part by more than 2e-3)."""
    section = {"optimizer_states": states, "hybrid_threshold": 0} if states == "8bit" else {}
    engines = [engine_for(make_model("llama"), **section) for _ in range(3)]
    data = batches(3)
    for engine, (x, y) in zip(engines, (data[0], data[1], data[1])):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    params = [dict(e.module.named_parameters()) for e in engines]
    for n, p in params[0].items():
        for other in params[1:]:
            safe_set_full_fp32_param(other[n], safe_get_full_fp32_param(p))
        for key in ("exp_avg", "exp_avg_sq"):
            value = safe_get_full_optimizer_state(p, key)
            assert not torch.equal(safe_get_full_optimizer_state(params[1][n], key), value), (n, key)
            safe_set_full_optimizer_state(params[1][n], value, key)
            got = safe_get_full_optimizer_state(params[1][n], key)
            assert torch.equal(got, value) if states == "fp32" else \
                float((got - value).abs().max()) <= 0.02 * float(value.abs().max()), (n, key)
    for engine in engines:
        engine.backward(lm_loss(engine(data[2][0]), data[2][1]))
        engine.step()
    for n, p in params[0].items():
        moved = safe_get_full_fp32_param(p)
        given, weights_alone = (safe_get_full_fp32_param(other[n]) for other in params[1:])
        if states == "fp32":
            assert torch.equal(given, moved), n
        else:
            assert torch.allclose(given, moved, rtol=0, atol=2e-4), n
        assert not torch.allclose(weights_alone, moved, rtol=0, atol=2e-3), n
    for e in engines:
        e.destroy()


def test_an_optimizer_state_set_is_refused_where_there_is_none_to_set():
    model = make_model("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    engine = engine_for(model)
    head = model.lm_head.weight
    prefix = r"^lazytrain\.utils\.safe_set_full_optimizer_state: "
    with pytest.raises(ValueError, match=prefix + "the optimizer has no state of this parameter before its first "
                                                  "step$"):
        safe_set_full_optimizer_state(head, torch.zeros(32, 32), "exp_avg")
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(ValueError, match=prefix + "the parameter is frozen: the optimizer keeps no state of it$"):
        safe_set_full_optimizer_state(model.model.embed_tokens.weight, torch.zeros(model.model.embed_tokens.weight.shape),
                                      "exp_avg")
    with pytest.raises(ValueError, match=prefix + "AdamW keeps no state 'momentum_buffer' of this parameter's shape; "
                                                  "it keeps 'exp_avg', 'exp_avg_sq'$"):
        safe_set_full_optimizer_state(head, torch.zeros(32, 32), "momentum_buffer")
    with pytest.raises(ValueError, match=prefix + r"'exp_avg_sq' must be >= 0 \(Adam divides by its square root\)$"):
        safe_set_full_optimizer_state(head, torch.full((32, 32), -1.0), "exp_avg_sq")
    engine.destroy()


def test_a_parameter_of_no_engine_is_refused_by_name():
    """(Several ranks: test_engine_sharded.py.)"""
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"^lazytrain\.utils\.safe_get_full_grad: the parameter \(shape \(32, 32\)\) "
                                         r"belongs to no live LazyTrain engine"):
        safe_get_full_grad(model.lm_head.weight)
    engine = engine_for(model)
    engine.destroy()
    with pytest.raises(ValueError, match="before engine.destroy"):
        safe_get_full_optimizer_state(model.lm_head.weight, "exp_avg")


def test_replace_deepspeed_routes_deepspeeds_accessors_for_lazytrain_parameters():
    deepspeed_utils = pytest.importorskip("deepspeed.utils")
    model = make_model("llama")
    engine = engine_for(model, "bf16")
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    lazytrain.replace_deepspeed()
    try:
        g = deepspeed_utils.safe_get_full_grad(model.lm_head.weight)
        other = torch.nn.Parameter(torch.ones(3))
        other.grad = torch.full((3,), 2.0)
        assert deepspeed_utils.safe_get_full_grad(other) is other.grad   # DeepSpeed's own answer for the rest
        deepspeed_utils.safe_set_full_fp32_param(model.lm_head.weight, torch.full((32, 32), 0.25))
        assert torch.equal(safe_get_full_fp32_param(model.lm_head.weight), torch.full((32, 32), 0.25))
        # the setters too: DeepSpeed's own wrote nothing for a LazyTrain parameter, without a word
        deepspeed_utils.safe_set_full_grad(model.lm_head.weight, torch.full((32, 32), 0.5))
        g = safe_get_full_grad(model.lm_head.weight)
        assert torch.equal(g, torch.full((32, 32), 0.5))
        engine.step()
        deepspeed_utils.safe_set_full_optimizer_state(model.lm_head.weight, torch.full((32, 32), 3.0), "exp_avg")
        assert torch.equal(safe_get_full_optimizer_state(model.lm_head.weight, "exp_avg"), torch.full((32, 32), 3.0))
    finally:
        lazytrain.restore_deepspeed()
    assert deepspeed_utils.safe_get_full_grad(model.lm_head.weight) is None   # DeepSpeed's own: .grad
    engine.destroy()


def test_a_call_over_several_ranks_names_its_tensor_as_every_rank_does():
    """What ranks compare before an accessor's collectives (param_access._call): a parameter and its fp32 master
    by the model's name, a tensor added to the optimizer by its place among those (the same on every rank)."""
    from lazytrain.engine import param_access
    model = make_model("llama")
    engine = engine_for(model, "bf16")
    temperature = torch.nn.Parameter(torch.ones(2, 3))
    engine.optimizer.add_param_group({"params": [temperature]})
    head = model.lm_head.weight
    assert param_access._call(engine, "f", head) == param_access._call(engine, "f", engine.masters.master_of(head)) \
        == "lazytrain.utils.f('lm_head.weight')"
    assert param_access._call(engine, "f", temperature, "'exp_avg'") == \
        "lazytrain.utils.f(the optimizer's tensor 0 outside the model, of shape (2, 3), 'exp_avg')"
    engine.destroy()


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (0, "bf16"), (2, "fp32")])
def test_the_models_own_zero_grad_during_accumulation_is_the_engines_for_every_parameter(stage, dtype):
    """model.zero_grad() before each micro-batch of an accumulated step: torch's own cleared the embedding's and
    head's gradients and left the streamed layers' buffers in fp32 (bf16's masters kept everything), so the step
    applied a mix of the whole accumulation and the last micro-batch that no reference computes. It is now the
    engine's zero_grad(): at stages 0 and 1 the accumulation is dropped, as PyTorch and DeepSpeed's stage 0 drop
    it (the step applies the last micro-batch's gradient); from stage 2 kept, as DeepSpeed's ZeRO keeps it."""
    torch.manual_seed(0)
    model = make_model("llama")
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
           "gradient_clipping": 0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"checkpoint_interval": 2}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = lazytrain.initialize(model=model, config=cfg)[0]
    data = batches(2)
    for x, y in data:
        model.zero_grad()
        engine.backward(lm_loss(engine(x), y))
    for x, y in (data if stage >= 2 else data[1:]):
        (lm_loss(ref(x), y) / 2).backward()
    tol = 1e-5 if dtype == "fp32" else 2e-2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = safe_get_full_grad(p)
        assert float((g - q.grad).norm() / q.grad.norm()) < tol, name
    engine.step()
    engine.destroy()
    assert "zero_grad" not in model.__dict__   # handed back: torch's again
