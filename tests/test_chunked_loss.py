"""A causal LM's head and loss in chunks (lazytrain.loss_chunk_tokens): the same loss and training as the
model's own forward, with no chunk of logits larger than asked and no full logits tensor."""
import copy
import warnings

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine import chunked_loss
from engine_models import VOCAB, make_hf_model, max_rel_diff

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")


def config(chunk, gas=1):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "lazytrain": {"loss_chunk_tokens": chunk, "checkpoint_interval": 2}}


def data(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        labels = ids.clone()
        labels[0, :4] = -100                          # a prompt the loss ignores
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3", "qwen2", "mistral", "gemma", "phi3", "mixtral",
                                    "qwen2moe"])
@pytest.mark.parametrize("with_num_items", [False, True])
def test_chunked_loss_trains_as_the_models_own_loss(family, with_num_items, monkeypatch):
    """Against the same engine computing the model's own loss (whole logits), step by step: the loss, and
    the weights after three steps; the first step's loss also against the plain model's."""
    model = make_hf_model(family, n_layers=4)
    plain = copy.deepcopy(model)
    whole, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=config(chunk=0))
    engine, _, _, _ = lazytrain.initialize(model=model, config=config(chunk=5))
    rows = []
    real = chunked_loss._chunk_loss_sum
    monkeypatch.setattr(chunked_loss, "_chunk_loss_sum", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
    for step, (ids, labels) in enumerate(data(3)):
        extra = {"num_items_in_batch": torch.tensor(17)} if with_num_items else {}
        out = engine(input_ids=ids, labels=labels, **extra)
        expected = whole(input_ids=ids, labels=labels, **extra)
        assert out.logits is None and expected.logits.shape == (2, 12, VOCAB)
        assert out.loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)
        if step == 0:
            assert out.loss.item() == pytest.approx(plain(input_ids=ids, labels=labels, **extra).loss.item(), rel=1e-6)
        for e, loss in ((engine, out.loss), (whole, expected.loss)):
            e.backward(loss)
            e.step()
        # the first step's gradients differ by a summation order; after it the weights differ as below, and
        # the norms with them (by up to 1.4e-5 on an AVX-512 CPU)
        assert engine.get_global_grad_norm() == pytest.approx(whole.get_global_grad_norm(), rel=1e-6 if step == 0 else 1e-4)
    assert rows and max(rows) <= 5                    # no chunk of logits over 5 positions
    # AdamW turns the last-bit differences of a summation order into a full step on elements whose
    # gradient is near zero (m / sqrt(v) flips sign): such an element moves by at most 2 x lr a step, and
    # every other element agrees to rounding (at most 9.7e-5 seen, on an AVX-512 CPU)
    a = torch.cat([t.detach().flatten() for t in engine.module.parameters()])
    b = torch.cat([t.detach().flatten() for t in whole.module.parameters()])
    diff = (a - b).abs()
    assert diff.max() <= 2 * 1e-2 * 3
    assert (diff > 1e-4).float().mean() < 0.01


def test_chunks_are_not_used_where_the_logits_are_wanted():
    model = make_hf_model("llama", n_layers=4)
    engine, _, _, _ = lazytrain.initialize(model=model, config=config(chunk=5))
    ids, labels = data(1)[0]
    with torch.no_grad():
        assert engine(input_ids=ids, labels=labels).logits.shape == (2, 12, VOCAB)   # evaluation
    assert engine(input_ids=ids).logits.shape == (2, 12, VOCAB)                      # no labels
    assert not chunked_loss.applies(make_hf_model("gemma2", n_layers=2).train(), {"labels": labels})  # soft-capped


def test_chunked_loss_accumulates_like_the_models_own_loss():
    model = make_hf_model("llama", n_layers=4)
    whole, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=config(chunk=0, gas=2))
    engine, _, _, _ = lazytrain.initialize(model=model, config=config(chunk=7, gas=2))
    for ids, labels in data(4):
        for e in (engine, whole):
            e.backward(e(input_ids=ids, labels=labels).loss)
            e.step()
    assert engine.global_steps == whole.global_steps == 2
    assert engine.get_global_grad_norm() == pytest.approx(whole.get_global_grad_norm(), rel=1e-6)
    assert max_rel_diff(engine.module, whole.module) < 1e-3


@pytest.mark.parametrize("bad", [-1, 2.5, True, "2048"])
def test_loss_chunk_tokens_must_be_a_whole_number(bad):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"'lazytrain.loss_chunk_tokens' must be a whole number of tokens "
                                              r">= 0 \(0: the model computes its logits whole\), got "):
            lazytrain.initialize(model=make_hf_model("llama", n_layers=2), config=config(chunk=bad))


def test_a_batch_with_every_label_ignored_steps_as_the_models_own_loss_does():
    model = make_hf_model("llama", n_layers=4)
    model_before_step = copy.deepcopy(model)
    whole, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=config(chunk=0))
    engine, _, _, _ = lazytrain.initialize(model=model, config=config(chunk=5))
    ids = data(1)[0][0]
    ignored = torch.full_like(ids, -100)
    for e in (engine, whole):
        out = e(input_ids=ids, labels=ignored, num_items_in_batch=torch.tensor(8))
        assert out.loss.item() == 0.0 and out.loss.requires_grad
        e.backward(out.loss)
        e.step()
    assert engine.get_global_grad_norm() == whole.get_global_grad_norm() == 0.0
    # the head had a zero gradient, not none: AdamW's weight decay moved it as it moved the model's own
    moved = engine.module.lm_head.weight.detach()
    assert not torch.equal(moved, model_before_step.lm_head.weight)
    assert torch.equal(moved, whole.module.lm_head.weight.detach())


def test_the_output_keeps_the_loss_first():
    engine, _, _, _ = lazytrain.initialize(model=make_hf_model("llama", n_layers=4), config=config(chunk=5))
    ids, labels = data(1)[0]
    out = engine(input_ids=ids, labels=labels)
    assert out[0] is out.loss and list(out.keys())[0] == "loss"


def test_other_heads_and_arguments_keep_the_models_own_forward():
    llama = make_hf_model("llama", n_layers=2).train()
    labels = data(1)[0][1]
    assert chunked_loss.applies(llama, {"labels": labels})
    assert not chunked_loss.applies(llama, {"labels": labels, "fused_lm_head": True})      # TRL's fused head
    assert not chunked_loss.applies(llama, {"labels": labels, "logits_to_keep": 1})
    llama.config.model_type = "falcon_h1"                                                # scales its logits
    assert not chunked_loss.applies(llama, {"labels": labels})


def test_a_loss_function_the_user_set_keeps_the_models_own_forward():
    """transformers' ``model.loss_function = fn`` (label smoothing here): the chunks compute plain
    cross-entropy, so that model keeps its own forward and its own loss."""
    import torch.nn.functional as F

    def smoothed(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
        return F.cross_entropy(logits.float().view(-1, vocab_size), shifted, ignore_index=ignore_index,
                               label_smoothing=0.3)
    model = make_hf_model("llama", n_layers=2)
    model.loss_function = smoothed
    ids, labels = data(1)[0]
    expected = copy.deepcopy(model).train()(input_ids=ids, labels=labels).loss
    assert not chunked_loss.applies(model.train(), {"labels": labels})
    engine = lazytrain.initialize(model=model, config=config(chunk=5))[0]
    assert engine(input_ids=ids, labels=labels).loss.item() == pytest.approx(expected.item(), rel=1e-6)
    plain = make_hf_model("llama", n_layers=2)
    assert chunked_loss.applies(plain.train(), {"labels": labels})
    plain.config.loss_type = "ForMaskedLM"
    plain.loss_type = "ForMaskedLM"
    assert not chunked_loss.applies(plain, {"labels": labels})


def test_a_head_with_a_hook_or_its_own_forward_keeps_the_models_own_forward():
    """A forward hook on the head (one that scales the logits, say) or an instance ``forward`` (as
    accelerate's hooks set) would be bypassed by the chunks: the model keeps its own forward, and the
    instance ``forward`` is still there after it."""
    ids, labels = data(1)[0]
    hooked = make_hf_model("llama", n_layers=2).train()
    hooked.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    assert not chunked_loss.applies(hooked, {"labels": labels})
    wrapped = make_hf_model("llama", n_layers=2).train()
    calls = []
    original = wrapped.lm_head.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    wrapped.lm_head.forward = counted
    assert not chunked_loss.applies(wrapped, {"labels": labels})
    engine = lazytrain.initialize(model=wrapped, config=config(chunk=5))[0]
    engine(input_ids=ids, labels=labels)
    assert calls == [1] and wrapped.lm_head.forward is counted


def models_own_loss(hidden, weight, labels):
    """A causal LM's own loss as transformers computes it: whole logits, in fp32, shifted labels."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float().flatten(0, 1),
                                             shifted, ignore_index=-100)


def test_a_bf16_heads_gradient_is_summed_over_the_chunks_in_fp32():
    """Summed by autograd in bf16, the head's gradient took one rounding per chunk: here 64 chunks were
    2.75x the error of the model's own loss against fp32, 256 chunks 4.62x; now 1.11x at any count."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 256, 64, generator=g)
    weight = torch.randn(512, 64, generator=g) / 8
    labels = torch.randint(0, 512, (4, 256), generator=g)
    labels[:, :16] = -100

    def head_grad(dtype, chunk):
        w = weight.to(dtype).clone().requires_grad_(True)
        h = hidden.to(dtype)
        loss = chunked_loss.causal_lm_loss(h, w, None, labels, chunk) if chunk else models_own_loss(h, w, labels)
        loss.backward()
        return w.grad.float()

    exact = head_grad(torch.float32, 0)
    assert torch.allclose(head_grad(torch.float32, 16), exact, rtol=1e-5, atol=1e-7)

    def error(grad):
        return ((grad - exact).norm() / exact.norm()).item()
    own = error(head_grad(torch.bfloat16, 0))
    for chunk in (256, 16, 4):   # 4, 64 and 256 chunks
        assert error(head_grad(torch.bfloat16, chunk)) < 1.25 * own, chunk


def test_under_autocast_the_gradients_are_those_of_the_loss_it_returns():
    """The chunks' logits are recomputed in backward under the forward's autocast: computed in bf16 there and
    in fp32 again in backward (outside autocast), the loss was the bf16 one and the gradients the fp32 logits'
    (hidden-state gradient 3.5e-3 from the model's own under autocast, 0 from fp32). Now the hidden state's
    gradient is the model's own under autocast, and the head's differs from it by the chunks' fp32 sum alone."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 16, 32, generator=g), torch.randn(128, 32, generator=g) / 5
    labels = torch.randint(0, 128, (2, 16), generator=g)

    def grads(autocast: bool, chunk: int):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = chunked_loss.causal_lm_loss(h, w, None, labels, chunk) if chunk else \
                models_own_loss(h, w, labels)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    own_loss, own_h, own_w = grads(True, 0)
    _, fp32_h, fp32_w = grads(False, 0)
    loss, h_grad, w_grad = grads(True, 5)
    assert torch.allclose(loss, own_loss, rtol=1e-6)
    assert rel(h_grad, own_h) < 1e-6 and rel(h_grad, fp32_h) > 1e-3
    assert rel(w_grad, own_w) < rel(w_grad, fp32_w)
    assert not torch.is_autocast_enabled("cpu")   # the backward's autocast ended with it


def test_under_autocast_the_backward_casts_the_head_once_as_the_forward_does():
    """A new autocast context per chunk dropped autocast's cache of the head's low-precision copy: each chunk
    cast the whole head again (a vocabulary x hidden copy per chunk)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 16, 32, generator=g), torch.randn(128, 32, generator=g).requires_grad_(True)
    labels = torch.randint(0, 128, (2, 16), generator=g)

    class HeadCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == tuple(weight.shape) and \
                    args[0].dtype == torch.float32 and (kwargs or {}).get("dtype") == torch.bfloat16:
                HeadCasts.count += 1   # the fp32 head to bf16 (not the bf16 gradient back to fp32)
            return func(*args, **(kwargs or {}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_loss.causal_lm_loss(hidden.requires_grad_(True), weight, None, labels, 4)   # 8 chunks
    with HeadCasts():
        loss.backward()
    assert HeadCasts.count == 1


def test_a_peft_prompt_learning_model_keeps_its_own_forward():
    """PEFT's prompt tuning prepends virtual tokens, and -100 labels for them, in its forward: the chunked path
    took the labels away first and failed with 'labels hold 24 positions, the hidden states 32'."""
    llama = make_hf_model("llama", n_layers=2).train()
    labels = data(1)[0][1]

    class PromptLearning:   # what PEFT's PeftModel says of itself (its own attribute, not the base model's)
        is_prompt_learning = True
    llama.active_peft_config = PromptLearning()
    assert not chunked_loss.applies(llama, {"labels": labels})
    PromptLearning.is_prompt_learning = False   # LoRA and the other adapters leave the sequence as it is
    assert chunked_loss.applies(llama, {"labels": labels})


def test_a_peft_prompt_tuning_model_trains_with_loss_chunk_tokens_as_without():
    peft = pytest.importorskip("peft")

    def model():
        torch.manual_seed(0)
        return peft.get_peft_model(make_hf_model("llama", n_layers=2), peft.PromptTuningConfig(
            task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4)).train()
    ids, labels = data(1)[0]
    losses = []
    for chunk in (0, 5):
        m = model()
        engine = lazytrain.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad],
                                      config=config(chunk))[0]
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        engine.destroy()
    assert losses[0] == losses[1]
