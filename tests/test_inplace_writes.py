"""A script's in-place write to a streamed block's parameter after initialize (``p.mul_`` for a pruning mask,
``nn.init``, ``p.copy_`` from another model) reaches the next forward, as in plain PyTorch. The parameter shows the
block's fp32 weights (or, for a frozen one, its copy in host memory), and the forward streams a compute copy
written from them (bf16/fp16, on NVMe, or a device's resident copy): before, that copy was written again only by
the next step, so the forwards until then computed with the old weights. The engine's own writes into its flat
buffers move no parameter's version counter, so no forward refreshes a layer nobody wrote."""
import copy
import warnings

import pytest
import torch

import lazytrain
from engine_models import add_lora, batches, lm_loss, make_model

CASES = {
    "bf16-host": dict(_bf16=True),
    "bf16-nvme": dict(_bf16=True, weights_home="nvme"),
    "bf16-overlap-threads": dict(_bf16=True, overlap_optimizer=True, _threads=True),
    "fp32-resident-threads": dict(weights_home="hbm", overlap_optimizer=True, _threads=True),
    "lora-bf16-frozen-base": dict(_bf16=True, _lora=True),
    "lora-bf16-nvme-frozen-base": dict(_bf16=True, _lora=True, weights_home="nvme"),
}


def _config(case: dict, tmp_path) -> dict:
    section = {k: v for k, v in case.items() if not k.startswith("_")}
    section["checkpoint_interval"] = 2
    if section.get("weights_home") == "nvme":
        tmp_path.mkdir(parents=True, exist_ok=True)
        section["nvme_path"] = str(tmp_path)
    if case.get("_threads"):   # the CPU takes a GPU's path: every layer copied into device slots
        section["testing"] = {"copy_threads": True}
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "lazytrain": section,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if case.get("_bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def _initialize(model, case: dict, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=model, config=_config(case, tmp_path))[0]


def _model(case: dict):
    torch.manual_seed(0)
    model = make_model("llama", n_layers=4)
    return add_lora(model, ("q_proj", "v_proj")) if case.get("_lora") else model


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_in_place_write_to_a_block_parameter_reaches_the_next_forward(case, tmp_path):
    """Against an engine built afresh on the model as written (a copy of it now is what destroy() would hand
    back): the same outputs, bit for bit, in evaluation and in training, and the same step."""
    spec = CASES[case]
    model = _model(spec)
    engine = _initialize(model, spec, tmp_path / "a")
    data = batches(3)
    for x, y in data[:2]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()   # an overlapped update may still be writing the layers (README)
    attn = model.model.layers[2].self_attn
    with torch.no_grad():
        if spec.get("_lora"):   # a frozen base weight, kept in the compute copy (or its frozen part) alone
            target = attn.q_proj.base.weight
            assert not target.requires_grad
            target.mul_(0.5)
        else:
            target = attn.q_proj.weight
            target.mul_(0.5)                                    # a pruning mask's way
            torch.nn.init.zeros_(model.model.layers[1].mlp.up_proj.weight)   # nn.init's
    fresh = _initialize(copy.deepcopy(model), spec, tmp_path / "b")
    x, y = data[2]
    with torch.no_grad():
        assert torch.equal(engine(x).logits, fresh(x).logits)
    losses = []
    for e in (engine, fresh):
        loss = lm_loss(e(x), y)
        e.backward(loss)
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    engine.destroy()
    fresh.destroy()


def test_no_forward_refreshes_a_layer_nobody_wrote_and_a_write_between_a_forward_and_its_backward_refuses_it(
        tmp_path, monkeypatch):
    """Steps (overlapped), evaluations between a forward and its backward, gradient accumulation: no refresh, so
    a forward's backward is never refused for a write the engine made itself. A write after a forward is seen at
    the next pass, which makes that forward's backward refused, as PyTorch refuses a backward through weights
    changed in place."""
    spec = dict(_bf16=True, overlap_optimizer=True, _threads=True)
    model = _model(spec)
    engine = _initialize(model, spec, tmp_path)
    refreshed = []
    refresh = type(engine)._refresh_streamed_layers
    monkeypatch.setattr(type(engine), "_refresh_streamed_layers",
                        lambda self, layers=None: refreshed.append(layers) or refresh(self, layers))
    data = batches(4)
    for x, y in data[:3]:
        loss = lm_loss(engine(x), y)
        with torch.no_grad():
            engine(x)              # an evaluation between the forward and its backward
        engine.backward(loss)
        engine.step()
    assert refreshed == []
    engine.wait_for_update()
    x, y = data[3]
    loss = lm_loss(engine(x), y)
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.add_(0.01)
        engine(x)                  # sees the write: layer 3's copy written anew
    assert refreshed == [[3]]
    with pytest.raises(Exception, match="weights changed .* between this forward and its backward"):
        engine.backward(loss)
    engine.destroy()


def test_a_write_between_a_backward_and_the_step_reaches_the_forward_after_it(tmp_path):
    """The hybrid optimizer writes the compute copies of what it updates in its update pass (overlap_optimizer):
    a trainable block weight no optimizer group holds, written before the step, has its copy written as the step
    begins. (Compared as above, against a fresh engine on the model as it then is.)"""
    spec = dict(_bf16=True, overlap_optimizer=True, _threads=True)
    model = _model(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=model, config=_config(spec, tmp_path / "a"),
                                      model_parameters=[p for n, p in model.named_parameters() if "up_proj" not in n])[0]
    assert engine._fused_copies
    (x0, y0), (x, y) = batches(2)
    engine.backward(lm_loss(engine(x0), y0))
    engine.step()
    engine.backward(lm_loss(engine(x), y))
    engine.wait_for_update()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    engine.step()
    engine.wait_for_update()
    fresh = _initialize(copy.deepcopy(model), spec, tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(engine(x).logits, fresh(x).logits)
    engine.destroy()
    fresh.destroy()


def test_a_write_between_a_forward_and_its_backward_is_refused():
    """As PyTorch refuses a backward through weights changed in place since its forward: the block would be re-run
    with weights the forward did not use (fp32 on the CPU, where the copy is the parameter itself)."""
    model = _model({})
    engine = _initialize(model, {}, None)
    x, y = batches(1)[0]
    loss = lm_loss(engine(x), y)
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(0.5)
    with pytest.raises(Exception, match=r"^block 2's parameters were written in place between this forward and its "
                                        r"backward: the backward would re-run the block with weights the forward did "
                                        r"not use \(PyTorch refuses it too\)\. Write them before the forward, or after "
                                        r"its backward$"):
        engine.backward(loss)
    engine.destroy()
