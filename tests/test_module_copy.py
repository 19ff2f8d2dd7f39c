"""copy.deepcopy(engine.module) after initialize: an EMA, a frozen reference model or a teacher, as DeepSpeed's
ZeRO-1/2 modules allow. It failed ("cannot pickle '_thread.RLock' object": the engine's hooks on the model).
torch.save(engine.module) likewise ("cannot pickle 'WeakMethod' object")."""
import copy
import io
import pickle

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from engine_models import add_lora, batches, lm_loss, logits_of, make_hf_model, make_model


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


def test_a_copy_of_a_lora_run_in_bf16_is_in_fp32_throughout_as_destroy_hands_it_back():
    """The frozen base weights are kept in bf16 by the engine; a copy that kept them so beside fp32 adapters
    could not run its forward (a DPO reference model of a LoRA run)."""
    model = add_lora(make_model("modulelist"), ("fc1", "fc2"))
    engine, _, _, _ = lazytrain.initialize(model=model, config=_config(True, False))
    data = batches(2)
    x, y = data[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    copied = copy.deepcopy(engine.module)
    assert {p.dtype for p in copied.parameters()} == {torch.float32}
    assert [p.requires_grad for p in copied.parameters()] == [p.requires_grad for p in engine.module.parameters()]
    with torch.no_grad():
        ours = logits_of(copied(data[1][0]))
    engine.destroy()   # what destroy hands back is what the copy held
    assert all(torch.equal(a, b) for a, b in zip(copied.state_dict().values(), engine.module.state_dict().values()))
    with torch.no_grad():
        assert torch.equal(ours, logits_of(engine.module(data[1][0])))


def test_a_copy_of_one_module_is_that_module_plain():
    """A block, the head or the block list alone: each was copied with the engine's hooks, which reached the
    engine and failed ("'Linear' object has no attribute '_modules'")."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=_config(False, False))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    trained = engine.module_state_dict()
    head, block, stack = (copy.deepcopy(m) for m in (engine.module.head, engine.module.stack[2], engine.module.stack))
    assert torch.equal(head.weight, trained["head.weight"]) and torch.equal(block.fc1.weight, trained["stack.2.fc1.weight"])
    assert "forward" not in vars(block) and all("forward" not in vars(b) for b in stack)
    h = torch.randn(2, 3, 32)
    with torch.no_grad():
        assert torch.equal(block(h), stack[2](h))
    engine.destroy()


def test_a_copy_does_not_depend_on_the_models_state_dict_names_or_parameter_class():
    """The weights are matched to parameters by identity (a state_dict hook of the model renamed the keys a copy
    looked them up by), and each parameter keeps its class, as a plain deepcopy keeps it."""
    class TaggedParameter(torch.nn.Parameter):
        pass

    model = make_model("modulelist")
    model.head.weight = TaggedParameter(model.head.weight.detach().clone())
    def rename_head(module, state, prefix, local):
        for k in [k for k in state if k.startswith(prefix + "head.")]:
            state["renamed." + k] = state.pop(k)

    model.register_state_dict_post_hook(rename_head)
    engine, _, _, _ = lazytrain.initialize(model=model, config=_config(False, False))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    copied = copy.deepcopy(engine.module)
    assert type(copied.head.weight) is TaggedParameter
    assert torch.equal(copied.head.weight, engine.module_state_dict()["renamed.head.weight"])
    engine.destroy()


def test_a_second_engine_on_a_model_another_engine_trains_is_refused_and_the_first_can_be_found():
    """A notebook cell that failed after initialize leaves the script no handle on the engine it built:
    lazytrain.engine_of(model) finds it, to destroy it."""
    model = make_model("modulelist")
    assert lazytrain.engine_of(model) is None
    engine, _, _, _ = lazytrain.initialize(model=model, config=_config(False, False))
    with pytest.raises(ConfigError, match=r"^this model is trained by a LazyTrain engine already: call "
                                          r"that engine's destroy\(\) \(lazytrain.engine_of\(model\) returns it\) "
                                          r"before initialize builds another"):
        lazytrain.initialize(model=model, config=_config(False, False))
    x, y = batches(1)[0]   # the first engine is untouched
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert lazytrain.engine_of(model) is engine and lazytrain.engine_of(model.stack[2]) is engine
    lazytrain.engine_of(model).destroy()
    assert lazytrain.engine_of(model) is None
    again, _, _, _ = lazytrain.initialize(model=model, config=_config(False, False))
    again.destroy()


@pytest.mark.parametrize("bf16", [False, True])
def test_an_engine_without_an_optimizer_hands_the_model_to_a_second_engine(bf16):
    """TRL's DPO and KTO precompute reference log-probabilities through an engine without an optimizer on the
    policy model, then the Trainer builds the training engine on it (DeepSpeed lets a second engine take a
    model). The first is destroyed, saying so, and its forwards run through the second (TRL reuses it for later
    precomputes); the second trains the model as one built on it alone does."""
    cfg = _config(bf16, False)
    evaluation = {k: v for k, v in cfg.items() if k != "optimizer"}
    model = make_model("modulelist")
    first, _, _, _ = lazytrain.initialize(model=model, config=evaluation)
    x, y = batches(1)[0]
    with torch.no_grad():
        before = logits_of(first(x)).float()
    with pytest.warns(UserWarning, match=r"^lazytrain: the model's engine without an optimizer \(an evaluation's\) "
                                         r"is destroyed: the engine initialize builds now takes the model over, and "
                                         r"the old one's forwards run through it$"):
        second, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    with torch.no_grad():
        assert torch.equal(logits_of(first(x)).float(), before)   # run by the second
    assert lazytrain.engine_of(model) is second
    with pytest.raises(RuntimeError, match=r"^engine.backward\(\) refused: this engine had no optimizer and was "
                                           r"handed back when another engine was to be built on its model; another "
                                           r"engine took it over: use that one \(lazytrain.engine_of\(model\) "
                                           r"returns it\)$"):
        first.backward(lm_loss(second(x), y))
    for x, y in batches(2):
        second.backward(lm_loss(second(x), y))
        second.step()
    trained = second.module_state_dict()
    second.destroy()
    alone, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    x, y = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(logits_of(alone(x)).float(), before)   # the evaluation's forward: the model's own
    for x, y in batches(2):
        alone.backward(lm_loss(alone(x), y))
        alone.step()
    for name, value in alone.module_state_dict().items():
        assert torch.equal(value, trained[name]), name
    alone.destroy()


def test_engines_on_parts_of_a_container_are_all_seen_and_a_failed_takeover_says_no_engine_holds_the_model():
    """An engine with an optimizer anywhere in the model refuses a new one over it, whatever engine is found
    first; a set-up that fails after handing an evaluation's engine back leaves none, and its forward says so."""
    cfg = _config(False, False)
    evaluation = {k: v for k, v in cfg.items() if k != "optimizer"}
    pair = torch.nn.ModuleDict({"ref": make_model("modulelist"), "policy": make_model("modulelist")})
    ref, _, _, _ = lazytrain.initialize(model=pair["ref"], config=evaluation)
    policy, _, _, _ = lazytrain.initialize(model=pair["policy"], config=cfg)
    with pytest.raises(ConfigError, match=r"^this model is trained by a LazyTrain engine already"):
        lazytrain.initialize(model=pair, config=cfg)
    x, y = batches(1)[0]
    with torch.no_grad():
        ref(x)   # untouched
    policy.backward(lm_loss(policy(x), y))
    policy.step()
    policy.destroy()
    with pytest.warns(UserWarning, match="^lazytrain: the model's engine without an optimizer"), \
            pytest.raises(Exception, match="no.such.blocks"):
        lazytrain.initialize(model=pair["ref"], config={**cfg, "lazytrain": {"blocks": "no.such.blocks"}})
    with pytest.raises(RuntimeError, match=r"^a forward refused: this engine had no optimizer and was handed back "
                                           r"when another engine was to be built on its model; no engine holds that "
                                           r"model now: build one with lazytrain.initialize$"):
        ref(x)
    # several engines without an optimizer, on a container's parts, all handed to one over the container
    left, _, _, _ = lazytrain.initialize(model=pair["ref"], config=evaluation)
    right, _, _, _ = lazytrain.initialize(model=pair["policy"], config=evaluation)
    with pytest.warns(UserWarning, match="^lazytrain: the model's engine without an optimizer"):
        whole, _, _, _ = lazytrain.initialize(model=pair, config={**evaluation, "lazytrain": {"blocks": "ref.stack"}})
    for part in (left, right):
        with pytest.raises(RuntimeError, match=r"; another engine holds a model that shares modules with it: use "
                                               r"that one \(lazytrain.engine_of\(model\) returns it\)$"):
            part(x)
    whole.destroy()


def test_a_parameter_the_copy_reaches_before_its_model_is_the_models_weight_all_the_same():
    """A holder of the head's weight and the model, copied together in bf16: the weight was copied first, as the
    parameter holds it (the bf16 compute copy), and the copied model's forward mixed dtypes."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=_config(True, False))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    weight, copied = copy.deepcopy([engine.module.head.weight, engine.module])
    assert weight is copied.head.weight and weight.dtype == torch.float32
    assert torch.equal(weight, engine.module_state_dict()["head.weight"])
    with torch.no_grad():
        copied(x)
    engine.destroy()


def test_a_copy_of_a_block_whose_hook_is_the_models_own_method():
    """The block's copy reaches the model through the hook; the model is copied on the way, the ordinary way."""
    class Capturing(type(make_model("modulelist"))):
        def capture(self, module, args, output):
            self.captured = output

    torch.manual_seed(0)
    model = Capturing()
    model.stack[2].register_forward_hook(model.capture)
    engine, _, _, _ = lazytrain.initialize(model=model, config=_config(False, False))
    block = copy.deepcopy(engine.module.stack[2])
    owner = next(iter(block._forward_hooks.values())).__self__
    assert owner is not engine.module and owner.stack[2] is block
    assert all("forward" not in vars(b) and "__deepcopy__" not in vars(b) for b in owner.stack)
    engine.destroy()


def test_copies_from_two_threads_at_once_are_each_plain():
    """A copy changed nothing shared (it removed each module's __deepcopy__ while it ran): 38 of 200 copies
    from two threads failed with the engine's hooks."""
    import sys
    import threading
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=_config(False, False))
    errors, interval = [], sys.getswitchinterval()

    def copy_often(module):
        for _ in range(40):
            try:
                copied = copy.deepcopy(module)
                assert all("forward" not in vars(m) for m in copied.modules())
            except Exception as e:   # noqa: BLE001 - the test's subject
                errors.append(repr(e))
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=copy_often, args=(m,)) for m in (engine.module, engine.module.head)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    engine.destroy()


def test_a_module_taken_out_of_the_model_during_training_is_plain_again_after_destroy():
    model = make_model("modulelist")
    engine, _, _, _ = lazytrain.initialize(model=model, config=_config(False, False))
    taken = model.extra[0]
    model.extra[0] = torch.nn.Linear(32, 32)
    engine.destroy()
    assert "__deepcopy__" not in vars(taken)
    other, _, _, _ = lazytrain.initialize(model=torch.nn.Sequential(taken, make_model("modulelist")),
                                          config=_config(False, False))   # not refused
    other.destroy()


@pytest.mark.parametrize("bf16", [False, True])
def test_torch_save_of_the_model_writes_its_plain_copy(bf16):
    """Pickling the model (torch.save(engine.module), as DeepSpeed's module allows) pickles the copy deepcopy
    gives; the engine trains on; after destroy the model pickles the ordinary way."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=_config(bf16, True))
    data = batches(3)
    for x, y in data[:2]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    buffer = io.BytesIO()
    torch.save(engine.module, buffer)
    trained = engine.module_state_dict()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert set(loaded.state_dict()) == set(trained)
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, trained[name]), name
    assert all(not {"forward", "__deepcopy__", "__reduce_ex__"} & set(vars(m)) for m in loaded.modules())
    block = pickle.loads(pickle.dumps(engine.module.stack[1]))
    assert torch.equal(block.fc2.weight, trained["stack.1.fc2.weight"]) and "forward" not in vars(block)
    x, y = data[2]
    with torch.no_grad():
        expected = logits_of(copy.deepcopy(engine.module)(x))
        assert torch.equal(logits_of(loaded(x)), expected)
    engine.backward(lm_loss(engine(x), y))   # trains on
    engine.step()
    engine.destroy()
    assert "__reduce_ex__" not in vars(engine.module)
    again = pickle.loads(pickle.dumps(engine.module))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), engine.module.state_dict().values()))


def _plain_in_child(module, path):
    torch.save({"plain": all("forward" not in vars(m) and "__deepcopy__" not in vars(m) for m in module.modules()),
                "weights": module.state_dict()}, path)


def test_a_new_process_given_the_model_gets_its_plain_copy_and_copy_copy_stays_shallow(tmp_path):
    """A spawned process given the model (mp.Process(args=...), a spawn DataLoader's dataset holding it) failed
    with "bad value(s) in fds_to_keep": the copy pickled was freed, closing its shared memory, before the child
    started. copy.copy, which looks __reduce_ex__ up on the instance too, gives a shallow copy as for any module."""
    import multiprocessing
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=_config(True, False))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    child = multiprocessing.get_context("spawn").Process(target=_plain_in_child,
                                                         args=(engine.module, str(tmp_path / "child.pt")))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    seen = torch.load(tmp_path / "child.pt")
    trained = engine.module_state_dict()
    assert seen["plain"] and all(torch.equal(v, trained[n]) for n, v in seen["weights"].items())
    shallow = copy.copy(engine.module)
    assert shallow.head is engine.module.head and shallow.stack is engine.module.stack
    engine.destroy()
