"""A model changed in place after initialize (lazytrain/engine/layout_guard.py): resize_token_embeddings is
refused before it starts, and a forward once a parameter outside the blocks was replaced. The engine's masters,
gradients and optimizer state are laid out for the parameters it was given: before, a resized or replaced head
trained on and was never updated."""
import copy
import re
import warnings

import pytest
import torch
from torch import nn

import lazytrain
from lazytrain.engine.layout_guard import ModelChangedError
from engine_models import VOCAB, batches, lm_loss, make_hf_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _engine(family: str = "llama"):
    model = make_hf_model(family, n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=model, config=CONFIG)[0]
    return model, engine


def _train(engine, steps: int = 2) -> None:
    for x, y in batches(steps):
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def _shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_resize_token_embeddings_after_initialize_is_refused_before_it_changes_anything():
    model, engine = _engine()
    shapes, vocab = _shapes(model), model.config.vocab_size
    with pytest.raises(ModelChangedError, match=re.escape(
            "resize_token_embeddings after lazytrain.initialize: the engine laid its fp32 masters, gradients and "
            "optimizer state out for the embedding and head it was given, and resized ones would train outside "
            "them (a resized head would never be updated). Resize before lazytrain.initialize (with a Trainer: "
            "before building it), or call engine.destroy() and initialize again") + "$"):
        model.resize_token_embeddings(VOCAB + 16)
    assert _shapes(model) == shapes and model.config.vocab_size == vocab
    head = model.lm_head.weight.detach().clone()
    _train(engine)
    assert not torch.equal(model.lm_head.weight, head)   # trains on, the head too
    engine.destroy()
    model.resize_token_embeddings(VOCAB + 16)   # the model handed back resizes
    assert model.get_input_embeddings().weight.shape[0] == model.lm_head.weight.shape[0] == VOCAB + 16


def _changed(path: str, what: str) -> str:
    return re.escape(f"'{path}' is not {what} initialize() found: the model was changed in place since (a new "
                     f"head, PEFT's merge_and_unload()). LazyTrain trains the parameters it found then, and a new one "
                     f"would not be updated: change the model before lazytrain.initialize, or after "
                     f"engine.destroy(), which hands it back")


@pytest.mark.parametrize("change", ["head module", "head weight", "norm weight", "tied anew"])
def test_a_forward_after_a_parameter_outside_the_blocks_was_replaced_is_refused_until_destroy(change):
    """Before, a new head trained on in place of the old one, never updated (its gradients went nowhere)."""
    model, engine = _engine()
    _train(engine, 1)
    x, y = batches(1)[0]
    if change == "head module":
        model.lm_head = nn.Linear(32, VOCAB, bias=False)
        path, what = "lm_head", "a module"
    elif change == "head weight":
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        path, what = "lm_head.weight", "a parameter"
    elif change == "norm weight":
        model.model.norm.weight = nn.Parameter(torch.ones(32))
        path, what = "model.norm.weight", "a parameter"
    else:
        model.lm_head.weight = model.model.embed_tokens.weight
        path, what = "lm_head.weight", "a parameter"
    for grad in (True, False):   # training and evaluation alike
        with torch.set_grad_enabled(grad), pytest.raises(ModelChangedError, match="^" + _changed(path, what) + "$"):
            engine(x)
    engine.destroy()
    assert lm_loss(model(x), y).isfinite()   # handed back: the changed model runs as plain PyTorch


def test_a_change_that_puts_back_what_was_there_and_a_module_without_parameters_train_on():
    """``tie_weights()`` assigns a tied head the parameter it already is; an activation swapped for another holds
    no parameter the engine trains. Modules made anywhere else are not watched."""
    model, engine = _engine()
    model.lm_head.weight = model.lm_head.weight
    model.model.layers[0].mlp.act_fn = nn.GELU()
    other = nn.Linear(2, 2)
    other.weight = nn.Parameter(torch.zeros(2, 2))
    _train(engine)
    engine.destroy()


def test_a_copy_of_the_model_is_its_own_to_resize():
    """``copy.deepcopy(model)`` while the engine trains is the model as destroy() would hand it back (module_copy.py):
    without the engine's refusal of resize_token_embeddings."""
    model, engine = _engine()
    copied = copy.deepcopy(model)
    copied.resize_token_embeddings(VOCAB + 16)
    assert copied.lm_head.weight.shape[0] == VOCAB + 16 and model.lm_head.weight.shape[0] == VOCAB
    _train(engine)
    engine.destroy()


def test_a_tied_models_resize_is_refused_too():
    model, engine = _engine("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ModelChangedError, match="^resize_token_embeddings after lazytrain.initialize"):
        model.resize_token_embeddings(VOCAB + 8)
    assert model.transformer.wte.weight.shape[0] == VOCAB
    engine.destroy()
