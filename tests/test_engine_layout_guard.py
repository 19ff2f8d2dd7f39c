"""A model changed in place after initialize (lazytrain/engine/layout_guard.py): resize_token_embeddings is
refused before it starts, and a pass once a parameter set-up found has left the model. The engine's streamed
buffers, masters, gradients and optimizer state are laid out for the parameters it was given: before, a resized
or replaced head trained on and was never updated, and a block's replaced projection was never used."""
import copy
import re
import warnings

import pytest
import torch
from torch import nn

import lazytrain
from lazytrain.engine.layout_guard import ModelChangedError
from engine_models import AUTO_DEVICE, VOCAB, batches, lm_loss, make_hf_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
RESIZE = ("resize_token_embeddings after lazytrain.initialize: the engine laid its fp32 masters, gradients and "
          "optimizer state out for the embedding and head it was given, and resized ones would train outside them "
          "(a resized head would never be updated). Resize before lazytrain.initialize (with a Trainer: before "
          "building it), or call engine.destroy() and initialize again")


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


def _gone(path: str, more: int = 0) -> str:
    return "^" + re.escape(
        f"'{path}'{f' and {more} more parameters' if more else ''} found at initialize() no longer in the model: it "
        f"was changed in place since (a new head, a module replaced, PEFT's merge_and_unload()). LazyTrain trains "
        f"the parameters it found then, and a new one would not be updated: change the model before "
        f"lazytrain.initialize, or after engine.destroy(), which hands it back") + "$"


class _Keeps(nn.Module):
    """A wrapper that keeps the original module, as PEFT's modules_to_save does."""
    def __init__(self, original):
        super().__init__()
        self.original_module = original

    def forward(self, *args, **kwargs):
        return self.original_module(*args, **kwargs)


def test_resize_token_embeddings_after_initialize_is_refused_before_it_changes_anything():
    model, engine = _engine()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    vocab = model.config.vocab_size
    with pytest.raises(ModelChangedError, match="^" + re.escape(RESIZE) + "$"):
        model.resize_token_embeddings(VOCAB + 16)
    with pytest.raises(ModelChangedError, match="^resize_token_embeddings after"):
        model.resize_token_embeddings(VOCAB, pad_to_multiple_of=48)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes and model.config.vocab_size == vocab
    # a call that changes nothing goes through, as it does on a plain model
    assert model.resize_token_embeddings(None) is model.get_input_embeddings()
    assert model.resize_token_embeddings(VOCAB).weight.shape[0] == VOCAB
    head = model.lm_head.weight.detach().clone()
    _train(engine)
    assert not torch.equal(model.lm_head.weight, head)   # trains on, the head too
    engine.destroy()
    model.resize_token_embeddings(VOCAB + 16)   # the model handed back resizes
    assert model.get_input_embeddings().weight.shape[0] == model.lm_head.weight.shape[0] == VOCAB + 16


@pytest.mark.parametrize("change", ["head module", "head weight", "norm weight", "tied anew", "block projection",
                                    "block weight"])
@pytest.mark.parametrize("route", ["engine", "model"])
def test_a_pass_after_a_parameter_left_the_model_is_refused_until_destroy(change, route):
    """Through the engine, or through the model itself (the blocks routed to the engine): in training and in
    evaluation. Before, a new head trained on, never updated, and a block's new projection was never used."""
    model, engine = _engine()
    _train(engine, 1)
    x, y = batches(1)[0]
    mlp = model.model.layers[1].mlp
    if change == "head module":
        model.lm_head, path = nn.Linear(32, VOCAB, bias=False), "lm_head.weight"
    elif change == "head weight":
        model.lm_head.weight, path = nn.Parameter(model.lm_head.weight.detach().clone()), "lm_head.weight"
    elif change == "norm weight":
        model.model.norm.weight, path = nn.Parameter(torch.ones(32)), "model.norm.weight"
    elif change == "tied anew":
        model.lm_head.weight, path = model.model.embed_tokens.weight, "lm_head.weight"
    elif change == "block projection":
        mlp.up_proj, path = nn.Linear(32, 64, bias=False), "model.layers.1.mlp.up_proj.weight"
    else:
        mlp.down_proj.weight, path = nn.Parameter(torch.zeros(32, 64)), "model.layers.1.mlp.down_proj.weight"
    run = engine if route == "engine" else model
    for grad in (True, False):   # the model called itself takes its inputs where its embedding is
        with torch.set_grad_enabled(grad), pytest.raises(ModelChangedError, match=_gone(path)):
            run(x.to(AUTO_DEVICE))
    engine.destroy()
    assert lm_loss(model(x), y).isfinite()   # handed back: the changed model runs as plain PyTorch


STREAMED_WHY = ("a streamed block's weights stream from the engine's buffers, which the step updates, so a new "
                "tensor would never be computed with")
OTHER_WHY = "its gradient, master and optimizer state keep the shape, dtype and device found then"


def _replaced(path: str, then: str, now: str, why: str) -> str:
    return "^" + re.escape(
        f"'{path}' holds another tensor than the one found at initialize() ({then} then, {now} now): its .data was "
        f"assigned, or the model moved or cast (model.to(), .half()), and {why}. Write values into the parameter "
        f"in place (under torch.no_grad()), or set them with lazytrain.utils.safe_set_full_fp32_param(p, values) "
        f"(DeepSpeed's name), or change the model before lazytrain.initialize, or after engine.destroy(), which "
        f"hands it back") + "$"


@pytest.mark.parametrize("path", ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight",
                                  "model.layers.1.mlp.up_proj.weight"])
@pytest.mark.parametrize("change", ["another shape", "another dtype", "a copy"])
def test_a_parameter_given_another_tensor_is_refused_where_the_engine_cannot_follow_it(path, change):
    """``p.data = ...`` keeps the parameter but may cut it off from the engine's buffers. Before, a head or
    embedding of another shape had the step write past the gradient's end (the process died: a segmentation
    fault, or "corrupted size vs. prev_size"), and a block's new tensor was silently never computed with: both
    refused, and, put back, the original trains on. Outside the blocks a tensor like the old one (transformers'
    tie_weights() pads a tied head's bias so) is what the engine computes with: the next step writes the
    parameter's master over it, as over a write into it (bf16: the master apart)."""
    streamed = path.startswith("model.layers.")
    config = dict(CONFIG, bf16={"enabled": True}) if change == "a copy" else CONFIG
    model = make_hf_model("llama", n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=model, config=config)[0]
    _train(engine, 1)
    p = dict(model.named_parameters())[path]
    original = p.data
    then = f"{p.dtype} {tuple(p.shape)} on {p.device}"   # a GPU keeps the embedding and head beside it
    if change == "another shape":
        p.data = torch.zeros(p.shape[0] + 3, *p.shape[1:], device=p.device)
    elif change == "another dtype":
        p.data = p.data.double()
    else:
        p.data = p.data.clone()
    x, y = batches(1)[0]
    if change == "a copy" and not streamed:
        computed = p.data_ptr()
        _train(engine, 1)
        assert p.data_ptr() == computed and not torch.equal(p.detach(), original)   # computed with, updated
        engine.destroy()
        return
    # an evaluation refuses a streamed block's too: it would compute with the old weights, silently
    for run, grad in [(run, grad) for run in (engine, model) for grad in ((True, False) if streamed else (True,))]:
        with torch.set_grad_enabled(grad), pytest.raises(ModelChangedError, match=_replaced(
                path, then, f"{p.dtype} {tuple(p.shape)} on {p.device}", STREAMED_WHY if streamed else OTHER_WHY)):
            run(x.to(AUTO_DEVICE))
    p.data = original
    before = p.detach().clone()
    _train(engine, 1)
    assert not torch.equal(p.detach(), before)   # trains on
    engine.destroy()
    assert lm_loss(model(x), y).isfinite()


@pytest.mark.parametrize("view", ["flattened frozen", "transposed", "rows", "reinterpreted frozen"])
def test_a_block_parameter_given_another_view_of_its_own_storage_is_refused(view):
    """The same address, another shape, strides or dtype: a frozen weight (no gradient to attach) trained on
    computing with the old layout (or, reinterpreted, destroy() handed back other values), and a trainable one
    failed only at the step, after which destroy() itself raised."""
    from engine_models import add_lora, make_model
    model = make_model("llama", n_layers=2)
    if view.endswith("frozen"):
        model = add_lora(model, ("q_proj", "v_proj"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=model, config=CONFIG)[0]
    _train(engine, 1)
    path = "model.layers.1.self_attn.q_proj.weight" if view == "transposed" else "model.layers.1.mlp.up_proj.weight"
    p = model.get_parameter(path)
    assert p.requires_grad == (not view.endswith("frozen"))
    original = p.data
    p.data = {"flattened frozen": original.view(-1), "transposed": original.t(), "rows": original[:32],
              "reinterpreted frozen": original.view(torch.int32)}[view]
    now = {"flattened frozen": "torch.float32 (2048,)", "transposed": "torch.float32 (32, 32) strides (1, 32)",
           "rows": "torch.float32 (32, 32)", "reinterpreted frozen": "torch.int32 (64, 32)"}[view]
    then = "(64, 32)" if view != "transposed" else "(32, 32)"
    x, y = batches(1)[0]
    with pytest.raises(ModelChangedError, match=_replaced(path, f"torch.float32 {then} on {p.device}",
                                                          f"{now} on {p.device}", STREAMED_WHY)):
        engine(x)
    p.data = original
    _train(engine, 1)
    engine.destroy()
    assert lm_loss(model(x), y).isfinite()


@pytest.mark.parametrize("path", ["model.layers.1.mlp.up_proj.weight", "lm_head.weight"])
def test_destroy_after_a_refusal_with_gradients_pending_hands_the_model_back(path):
    """A backward accumulated for the coming step, then the parameter given a tensor of another shape: the pass is
    refused, and destroy() hands the model back (it raised before, handing back a gradient of the old shape:
    the refusal's way out, destroy(), failed every time)."""
    model, engine = _engine()
    (x, y), (x2, _) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    p = model.get_parameter(path)
    p.data = torch.zeros(p.shape[0] + 3, *p.shape[1:], device=p.device)
    with pytest.raises(ModelChangedError):
        engine(x2)
    engine.destroy()
    assert model.get_parameter(path).grad is None   # none kept of the old tensor


def test_tie_weights_on_a_head_with_a_bias_trains_on():
    """transformers' tie_weights() (also at the end of a resize that changes nothing) pads a tied output layer's
    bias into a new tensor of the same shape: BERT's masked-LM head. Trains as it would without the call."""
    from transformers import BertConfig, BertForMaskedLM
    losses = []
    for tie in (False, True):
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = lazytrain.initialize(model=model, config=CONFIG)[0]
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        for step in range(3):
            if tie and step == 1:
                model.tie_weights()
                model.resize_token_embeddings(64)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
    assert losses[:3] == losses[3:]


def test_a_model_cast_after_initialize_is_refused_and_destroy_hands_it_back():
    """``model.to(dtype)`` (not the engine's, which refuses at once) assigns every parameter's ``.data``."""
    model, engine = _engine()
    _train(engine, 1)
    where = model.model.embed_tokens.weight.device
    model.to(torch.float64)
    x, y = batches(1)[0]
    with pytest.raises(ModelChangedError, match=_replaced("model.embed_tokens.weight", f"torch.float32 (32, 32) on "
                                                          f"{where}", f"torch.float64 (32, 32) on {where}", OTHER_WHY)):
        engine(x)
    engine.destroy()
    assert lm_loss(model(x), y).isfinite()


def test_a_wrapper_that_keeps_the_original_module_and_what_changes_nothing_train_on():
    """A wrapper holding the original head (PEFT's modules_to_save when another adapter is added) keeps the
    parameter in the model, on another path, where it is watched from then on. ``tie_weights()`` assigns a tied
    head the parameter it already is; an activation swapped for another holds no parameter. Modules made
    anywhere else are not watched."""
    model, engine = _engine("gpt2")
    model.tie_weights()
    model.transformer.h[0].mlp.act = nn.GELU()
    other = nn.Linear(2, 2)
    other.weight = nn.Parameter(torch.zeros(2, 2))
    _train(engine, 1)
    llama, llama_engine = _engine()
    llama.lm_head = _Keeps(llama.lm_head)
    head = llama.lm_head.original_module.weight.detach().clone()
    _train(llama_engine, 1)
    assert not torch.equal(llama.lm_head.original_module.weight, head)   # the wrapped head trains on
    x, _ = batches(1)[0]
    llama.lm_head.original_module.weight = nn.Parameter(torch.zeros(VOCAB, 32))   # on its new path: watched
    with pytest.raises(ModelChangedError, match=_gone("lm_head.original_module.weight")):
        llama_engine(x)
    llama_engine.destroy()
    engine.destroy()


@pytest.mark.parametrize("change", ["block wrapped", "block set aside", "blocks reordered", "list replaced"])
def test_a_change_to_the_blocks_list_is_refused_and_destroy_hands_every_block_back(change):
    """The engine runs entry i of the blocks' list found at set-up and streams its weights in under their names
    in it: a block wrapped in its list, taken out of it (kept elsewhere), the list reordered or replaced by a new
    one ran a different model from the one trained (a set-aside block was still updated). destroy() hands back
    every block it routed, wherever the list holds it now."""
    model, engine = _engine()
    _train(engine, 1)
    x, y = batches(1)[0]
    layers = model.model.layers
    first = "'model.layers.1.self_attn.q_proj.weight', a streamed block's weight, is now at "
    if change == "block wrapped":
        layers[1] = _Keeps(layers[1])
        expected = first + "'model.layers.1.original_module.self_attn.q_proj.weight'"
    elif change == "block set aside":
        model.spare = layers[1]
        del layers[1]
        expected = first + "'spare.self_attn.q_proj.weight'"
    elif change == "blocks reordered":
        layers[0], layers[1] = layers[1], layers[0]
        expected = "'model.layers.0.self_attn.q_proj.weight', a streamed block's weight, is now at " \
                   "'model.layers.1.self_attn.q_proj.weight'"
    else:
        model.model.layers = nn.ModuleList(list(layers))
        expected = "'model.layers', the list of streamed blocks found at initialize(), is no longer in the model"
    for run in (engine, model):
        with pytest.raises(ModelChangedError, match="^" + re.escape(expected)):
            run(x.to(AUTO_DEVICE))
    engine.destroy()
    assert lm_loss(model(x), y).isfinite()   # every block routed to the engine handed back
    if change == "block set aside":
        assert "forward" not in vars(model.spare)   # no longer routed to the engine


def test_a_blocks_weight_on_another_path_or_a_new_parameter_that_trains_is_refused():
    """A block's weights stream under the names found at set-up: wrapped since, the module under its new path
    would not be trained (its weight silently kept its value). A parameter added since that requires grad would
    never be updated; a frozen one may stay."""
    model, engine = _engine()
    x, _ = batches(1)[0]
    mlp = model.model.layers[1].mlp
    mlp.up_proj = _Keeps(mlp.up_proj)
    with pytest.raises(ModelChangedError, match="^" + re.escape(
            "'model.layers.1.mlp.up_proj.weight', a streamed block's weight, is now at "
            "'model.layers.1.mlp.up_proj.original_module.weight': the blocks' weights stream under the names found "
            "at initialize(), and a module wrapped since would not be trained. LazyTrain trains")):
        engine(x)
    mlp.up_proj = mlp.up_proj.original_module
    _train(engine, 1)   # put back: trains on
    model.model.norm.scale = nn.Parameter(torch.ones(32), requires_grad=False)   # frozen: no update missed
    _train(engine, 1)
    model.model.norm.scale.requires_grad_(True)   # no assignment: seen at the next training pass
    with pytest.raises(ModelChangedError, match="^" + re.escape(
            "'model.norm.scale' was added to the model after initialize() and requires grad: LazyTrain trains")):
        engine(x)
    engine.destroy()


def test_a_wrapped_model_whose_parameter_names_are_its_own_and_a_forward_from_inside_a_block():
    """torch's checkpoint wrapper names its module's parameters without its own prefix (the guard walks the
    module tree itself: a KeyError at initialize before). A forward of the model run from inside a block's
    hook sees the block's parameters swapped for its streamed weights: not a change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    wrapped = checkpoint_wrapper(make_hf_model("llama", n_layers=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=wrapped, config=CONFIG)[0]
    engine.destroy()
    model, engine = _engine()
    x, _ = batches(1)[0]
    inner, entered = [], []

    def evaluate_inside(module, args):
        if not entered:
            entered.append(True)
            model.model.norm.scale = nn.Parameter(torch.ones(1), requires_grad=False)   # marks the guard
            with torch.no_grad():
                inner.append(model(x.to(AUTO_DEVICE)).logits.shape)
    handle = model.model.layers[1].mlp.register_forward_pre_hook(evaluate_inside)
    with torch.no_grad():
        engine(x)
    handle.remove()
    assert inner == [torch.Size([2, 12, VOCAB])]
    _train(engine, 1)
    engine.destroy()


def test_an_evaluation_pass_verifies_only_after_an_assignment_into_the_model_and_an_alias_is_no_change(monkeypatch):
    """Llama's forward slices its layer list (a new ModuleList, built through add_module): not this model's, so
    an evaluation pass or a generated token does not walk the model. An assignment into the model marks it. A
    block's module also reachable under another name is no change: its weights keep the names they stream under."""
    from lazytrain.engine.layout_guard import LayoutGuard
    model, engine = _engine()
    verified = []
    unchanged = LayoutGuard._unchanged
    monkeypatch.setattr(LayoutGuard, "_unchanged", lambda self: verified.append(1) or unchanged(self))
    x, _ = batches(1)[0]
    with torch.no_grad():
        for _ in range(3):
            engine(x)
        model.generate(x[:1, :4].to(AUTO_DEVICE), max_new_tokens=3, do_sample=False)
    assert verified == []
    model.probe = model.model.layers[0].mlp.up_proj   # an alias of a block's module
    with torch.no_grad():
        engine(x)
    assert verified == [1]
    _train(engine, 1)
    assert len(verified) == 2   # a training pass verifies, once: the engine's forward (block 0's call then not)
    lm_loss(model(x.to(AUTO_DEVICE)), batches(1)[0][1]).backward()   # the model called itself: block 0 verifies
    assert len(verified) == 3
    engine.zero_grad()
    del model.probe   # and taken away again
    _train(engine, 1)
    engine.destroy()


def test_an_engine_never_destroyed_is_collected_with_its_guards_hooks():
    import gc
    import weakref
    from torch.nn.modules import module as torch_module
    gc.collect()   # engines other tests left behind
    hooks = (len(torch_module._global_parameter_registration_hooks),
             len(torch_module._global_module_registration_hooks))
    model, engine = _engine()
    _train(engine, 1)
    gone = weakref.ref(engine)
    del model, engine
    gc.collect()
    assert gone() is None
    assert (len(torch_module._global_parameter_registration_hooks),
            len(torch_module._global_module_registration_hooks)) == hooks


def test_the_refusal_of_a_resize_is_the_engines_alone():
    """A copy of the model while the engine trains is the model as destroy() would hand it back (module_copy.py):
    it resizes. An instance's own resize_token_embeddings is put back at destroy()."""
    model, engine = _engine()
    copied = copy.deepcopy(model)
    copied.resize_token_embeddings(VOCAB + 16)
    assert copied.lm_head.weight.shape[0] == VOCAB + 16 and model.lm_head.weight.shape[0] == VOCAB
    _train(engine)
    engine.destroy()
    own = lambda *args, **kwargs: "the script's own"   # noqa: E731
    model.resize_token_embeddings = own
    engine, _, _, _ = lazytrain.initialize(model=model, config=CONFIG)
    with pytest.raises(ModelChangedError, match="^resize_token_embeddings after"):
        model.resize_token_embeddings(VOCAB + 16)
    engine.destroy()
    assert model.resize_token_embeddings is own


def test_a_tied_models_resize_is_refused_too():
    model, engine = _engine("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ModelChangedError, match="^resize_token_embeddings after lazytrain.initialize"):
        model.resize_token_embeddings(VOCAB + 8)
    assert model.transformer.wte.weight.shape[0] == VOCAB
    engine.destroy()
