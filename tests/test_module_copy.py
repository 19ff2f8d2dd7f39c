"""copy.deepcopy(engine.module) after initialize: an EMA, a frozen reference model or a teacher, as DeepSpeed's
ZeRO-1/2 modules allow. It failed ("cannot pickle '_thread.RLock' object": the engine's hooks on the model)."""
import copy

import pytest
import torch

import lazytrain
from engine_models import batches, lm_loss, logits_of, make_hf_model, make_model


def _config(bf16: bool, overlap: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf"), "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "lazytrain": {"overlap_optimizer": overlap}}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_deep_copy_of_the_model_is_a_plain_model_of_the_trained_fp32_weights(bf16, overlap):
    model = make_model("modulelist")
    calls = []
    model.head.register_forward_hook(lambda *_: calls.append("head"))   # the model's own: copied with it
    engine, _, _, _ = lazytrain.initialize(model=model, config=_config(bf16, overlap))
    data = batches(3)
    for x, y in data[:2]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    copied = copy.deepcopy(engine.module)
    trained = engine.module_state_dict()
    # the weights the engine trained, in fp32, in memory of the copy's own
    assert set(copied.state_dict()) == set(trained)
    for name, value in copied.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, trained[name]), name
    ptrs = {t.untyped_storage().data_ptr() for t in list(engine.module.parameters()) + list(trained.values())}
    assert not ptrs & {p.untyped_storage().data_ptr() for p in copied.parameters()}
    # a plain model: no engine hooks or proxies; it computes what the same model given those weights computes
    assert all("forward" not in vars(block) for block in copied.stack)
    assert "__deepcopy__" not in vars(copied)
    plain = make_model("modulelist")
    plain.load_state_dict(trained)
    x, y = data[2]
    calls.clear()
    with torch.no_grad():
        assert torch.equal(logits_of(copied(x)), logits_of(plain(x)))
    assert calls == ["head"]
    # independent both ways: the engine trains on, the copy stays; a write to the copy reaches no engine
    steps = engine.global_steps
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.wait_for_update()
    assert engine.global_steps == steps + 1
    assert all(torch.equal(v, trained[n]) for n, v in copied.state_dict().items())
    with torch.no_grad():
        for p in copied.parameters():
            p.zero_()
    assert not all(torch.equal(v, torch.zeros_like(v)) for v in engine.module_state_dict().values())
    # a copy of something that holds the model copies it the same way
    holder = copy.deepcopy({"ema": engine.module})
    assert all("forward" not in vars(block) for block in holder["ema"].stack)
    engine.destroy()
    assert "__deepcopy__" not in vars(engine.module)
    assert copy.deepcopy(engine.module) is not engine.module   # handed back: an ordinary module again


def test_a_deep_copy_of_a_hugging_face_model_generates_as_the_engines_and_keeps_its_checkpointing():
    """Its layers' gradient checkpointing, turned off while the engine streams them, is on in the copy, as
    destroy() hands it back."""
    model = make_hf_model("llama", n_layers=2)
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning):
        engine, _, _, _ = lazytrain.initialize(model=model, config=_config(False, False))
    x, y = batches(1)[0]
    engine.backward(engine(input_ids=x, labels=y).loss)
    engine.step()
    copied = copy.deepcopy(engine.module)
    assert copied.model.gradient_checkpointing and not engine.module.model.gradient_checkpointing
    copied.eval()
    engine.module.eval()
    with torch.no_grad():
        ours = copied.generate(x[:, :4], max_new_tokens=4, do_sample=False)
        theirs = engine.module.generate(x[:, :4], max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, theirs)
    engine.destroy()
