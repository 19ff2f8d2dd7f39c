"""DeepSpeed 0.19's PyTorch-compatible backward: ``loss.backward()`` and ``output.backward(grad)`` on the
engine's outputs give what ``engine.backward(loss)`` gives, gradient accumulation included."""
import copy
import warnings

import pytest
import torch

import lazytrain
from lazytrain.models.decoder import logits_of
from engine_models import batches, lm_loss, make_hf_model, make_model, max_rel_diff, reference_train

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain. no CUDA device")


def engine_for(model, gas=2, **top):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "lazytrain": {"checkpoint_interval": 2, "device": "cpu"}, **top}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=cfg)
    return engine


def train(engine, data, backward):
    for x, y in data:
        backward(engine, x, y)
        engine.step()
    return engine.module


def via_engine(engine, x, y):
    engine.backward(lm_loss(engine(x), y))


def direct(engine, x, y):
    lm_loss(engine(x), y).backward()


def output_backward(engine, x, y):
    logits = logits_of(engine(x))
    leaf = logits.detach().requires_grad_()
    g, = torch.autograd.grad(lm_loss(leaf, y), [leaf])   # the loss's gradient, computed apart
    logits.backward(g)


@pytest.mark.parametrize("backward", [direct, output_backward], ids=["loss.backward", "output.backward(grad)"])
def test_a_direct_backward_gives_what_engine_backward_gives(backward):
    model, data = make_model("llama"), batches(4)
    ref = reference_train(model, data, gas=2)
    a = train(engine_for(model), data, via_engine)
    b = train(engine_for(model), data, backward)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert max_rel_diff(b, ref) < 1e-5


def test_a_hugging_face_loss_from_labels_backpropagates_directly():
    model, data = make_hf_model("llama"), batches(4)
    a = train(engine_for(model), data, lambda e, x, y: e.backward(e(x, labels=y).loss))
    b = train(engine_for(model), data, lambda e, x, y: e(x, labels=y).loss.backward())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_loss_mixing_the_engines_output_and_a_direct_forward_follows_deepspeeds_rule():
    """Only the gradient through the engine's output is divided by the accumulation steps; a forward of the
    wrapped module called directly is not (as in DeepSpeed, whose hooks sit on the engine's outputs).
    Compared as the accumulated gradients at the boundary (AdamW's first step would turn their float
    rounding, 1e-7, into 2e-4 on a weight whose gradient is near zero)."""
    model = make_model("llama")
    data, extra = batches(2), batches(2, seed=7)
    ref = copy.deepcopy(model)
    engine = engine_for(model)
    for (x, y), (x2, y2) in zip(data, extra):
        (lm_loss(ref(x), y) / 2 + lm_loss(ref(x2), y2)).backward()
        (lm_loss(engine(x), y) + lm_loss(engine.module(x2), y2)).backward()
    engine.weights.flush_grads()
    engine.weights.attach_grads()
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name


def test_without_accumulation_nothing_is_divided():
    model, data = make_model("llama"), batches(2)
    ref = reference_train(model, data, gas=1)
    assert max_rel_diff(train(engine_for(model, gas=1), data, direct), ref) < 1e-5


def test_fp16_refuses_a_direct_backward_as_deepspeed_does():
    engine = engine_for(make_model("llama"), gas=1, fp16={"enabled": True})
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"fp16 training needs its loss scaled before backward, but backward\(\) "
                                           r"was called directly on the engine's output: call engine.backward\(loss\)"):
        lm_loss(engine(x), y).backward()
    engine.backward(lm_loss(engine(x), y))          # the engine's own backward goes through
    engine.step()
    assert engine.global_steps == 1


def test_a_direct_backward_through_a_plain_dataclass_output_is_divided_as_engine_backward_is():
    """pytree takes an unregistered dataclass for one leaf: no output got the hook, and with accumulation the
    gradients were summed, not averaged."""
    import dataclasses
    from engine_models import ModuleListLM

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor

    class DataclassLM(ModuleListLM):
        def forward(self, ids):
            return Out(super().forward(ids))

    torch.manual_seed(0)
    model, data = DataclassLM(), batches(4)
    a = train(engine_for(model), data, lambda e, x, y: e.backward(lm_loss(e(x).logits, y)))
    b = train(engine_for(model), data, lambda e, x, y: lm_loss(e(x).logits, y).backward())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_engine_backward_takes_a_one_element_loss_as_deepspeed_does():
    model, data = make_model("llama"), batches(2)
    a = train(engine_for(model), data, via_engine)
    b = train(engine_for(model), data, lambda e, x, y: e.backward(lm_loss(e(x), y).reshape(1)))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="engine.backward\\(loss\\) needs a scalar loss tensor"):
        engine_for(model).backward(torch.ones(2, requires_grad=True))


def test_a_model_returning_its_hidden_states_beside_the_logits_divides_every_path_once():
    """The model also returns the hidden state its logits come from: a direct backward of a loss on the
    logits divides the head's gradient too (a hook on the hidden state alone would miss it) and nothing
    twice, so the gradients are engine.backward's."""
    from engine_models import ModuleListLM

    class TwoOutputs(ModuleListLM):
        def forward(self, ids):
            h = self.emb(ids)
            for block in self.stack:
                h = block(h)
            return self.head(self.extra[0](h)), h

    torch.manual_seed(0)
    model, data = TwoOutputs(), batches(4)
    a = train(engine_for(model), data, lambda e, x, y: e.backward(lm_loss(e(x)[0], y)))
    b = train(engine_for(model), data, lambda e, x, y: lm_loss(e(x)[0], y).backward())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("extra", [{"output_hidden_states": True}, {"output_attentions": True,
                                                                     "output_hidden_states": True}])
def test_a_hugging_face_loss_with_hidden_states_or_attentions_returned_backpropagates_directly(extra):
    model = make_hf_model("llama")
    if "output_attentions" in extra:
        model.config._attn_implementation = "eager"   # the attention weights are returned by the eager path only
    data = batches(4)
    a = train(engine_for(model), data, lambda e, x, y: e.backward(e(x, labels=y, **extra).loss))
    b = train(engine_for(model), data, lambda e, x, y: e(x, labels=y, **extra).loss.backward())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
