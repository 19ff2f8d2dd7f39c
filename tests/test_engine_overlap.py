"""lazytrain.overlap_optimizer: engine.step() updates the streamed layers on a worker thread, and the next
forward waits for each layer's update only when it needs that layer. Results are bit-identical to the
serial step, and everything that reads weights, gradients or optimizer state waits first."""
import copy
import os
import re
import threading
import time

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine.layer_updates import OverlappedUpdateError
from lazytrain.optim.hybrid_adamw import HybridAdamW
from torch.optim.optimizer import register_optimizer_step_post_hook
from engine_models import AUTO_DEVICE, batches, lm_loss, make_model, max_rel_diff, reference_train
from test_engine_parity import RTOL, ds_config


def overlap_config(overlap, optimizer="AdamW8bit", **section):
    cfg = ds_config(overlap_optimizer=overlap, hybrid_threshold=64, **section)
    cfg["optimizer"]["type"] = optimizer
    return cfg


def slow_layer_updates(engine, seconds=0.005):
    """Make every layer update on the update thread take a little longer, so the next forward really
    runs while later layers are still updating (the orderings a GPU produces)."""
    update = engine.optimizer.update

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return update(*args, **kwargs)
    engine.optimizer.update = slow


def train(model, data, config, before_training=None):
    engine, _, _, _ = lazytrain.initialize(model=model, config=config)
    if engine.layer_updates is not None:
        slow_layer_updates(engine)
    if before_training is not None:
        before_training(engine)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    return engine


def assert_same_training(a, b):
    """Bit-identical parameters and optimizer states."""
    pa, pb = dict(a.module.named_parameters()), dict(b.module.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name].detach().cpu(), pb[name].detach().cpu()), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, v in sa[k].items():
            w = sb[k][key]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, key)


def zero_copy_off(engine):
    engine.weights.zero_copy = False   # the GPU's path: every layer copied into the streaming slots


CASES = {
    "8bit": dict(),
    "bf16": dict(_top={"bf16": {"enabled": True}}),
    "fp16": dict(_top={"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "fp16-overflow": dict(_top={"fp16": {"enabled": True, "initial_scale_power": 20}}),
    "warmup-lr": dict(_top={"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}}),
    "gas2": dict(_top={"gradient_accumulation_steps": 2}),
    "copy-path": dict(checkpoint_interval=2),
    "resident": dict(weights_home="hbm"),
    "nvme": dict(weights_home="nvme"),
    "graph-tail": dict(checkpoint_interval=3, last_segment_graph=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_update_equals_serial_bit_for_bit(case, tmp_path):
    section = dict(CASES[case])
    if case == "nvme":
        section["nvme_path"] = str(tmp_path)
    hook = zero_copy_off if case == "copy-path" else None
    model = make_model("llama")
    data = batches(6)
    serial = train(copy.deepcopy(model), data, overlap_config(False, **section), hook)
    overlapped = train(copy.deepcopy(model), data, overlap_config(True, **section), hook)
    assert serial.layer_updates is None and overlapped.layer_updates is not None
    assert overlapped.global_steps == serial.global_steps and overlapped.skipped_steps == serial.skipped_steps
    if case == "fp16-overflow":
        assert 0 < serial.skipped_steps < serial.global_steps
    assert overlapped.get_lr() == serial.get_lr()
    assert_same_training(overlapped, serial)


def test_frozen_layer_stays_frozen_with_overlap():
    model = make_model("modulelist")
    model.stack[2].requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = batches(4)
    serial = train(copy.deepcopy(model), data, overlap_config(False))
    overlapped = train(model, data, overlap_config(True))
    assert_same_training(overlapped, serial)
    params = dict(overlapped.module.named_parameters())
    assert all(torch.equal(params[n].detach(), v) for n, v in frozen.items())


@pytest.mark.parametrize("kind", ["llama", "modulelist"])
def test_adamw_config_with_overlap_matches_pytorch(kind):
    """Adam/AdamW from the config become HybridAdamW with fp32 states (it can step one layer with a
    snapshot of the hyperparameters) and still train like torch's fused AdamW within 1e-5."""
    model = make_model(kind)
    data = batches(5)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    engine = train(model, data, ds_config(checkpoint_interval=2, overlap_optimizer=True))
    assert isinstance(engine.optimizer, HybridAdamW)
    assert {r["states"] for r in engine.optimizer.state_report()} == {"fp32"}
    assert max_rel_diff(engine.module, ref) < RTOL


@pytest.mark.parametrize("kind", ["batchnorm", "qwen2", "gpt2"])
def test_overlap_changes_only_the_optimizers_rounding_on_a_gradient_that_is_rounding_noise(kind):
    """A bias right before a BatchNorm, and Qwen2's and GPT-2's key biases, have a gradient of zero up to
    rounding: Adam turns that noise into lr-sized steps, so the last bits by which HybridAdamW (the overlapped
    update's optimizer) differs from torch's AdamW show as 1e-4..3e-2 of such a weight (the H200 run's parity
    misses under its default overlap: 1.1e-5..2.0e-3, BatchNorm 1.1e-2). Against plain PyTorch's forward and
    backward stepped by HybridAdamW itself the overlapped engine is bit for bit, so nothing else differs."""
    from engine_models import make_hf_model
    from test_engine_parity import _BatchNormBlock, _user_lm
    make = (lambda: _user_lm(_BatchNormBlock)) if kind == "batchnorm" else (lambda: make_hf_model(kind))
    data = batches(3)
    ref = make().to(AUTO_DEVICE)
    opt = HybridAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, optimizer_states="fp32")
    for x, y in data:
        lm_loss(ref(x.to(AUTO_DEVICE)), y).backward()
        opt.step()
        opt.zero_grad()
    torch_ref = reference_train(make(), data, clip=0.0, device=AUTO_DEVICE)
    cfg = ds_config(checkpoint_interval=3, overlap_optimizer=True, **({"blocks": "transformer.h"} if kind == "gpt2" else {}))
    cfg["gradient_clipping"] = 0.0
    engine = train(make(), data, cfg)
    assert isinstance(engine.optimizer, HybridAdamW)
    assert max_rel_diff(engine.module, torch_ref) < 5e-2
    if AUTO_DEVICE.type == "cpu":   # on a GPU the reference's HybridAdamW steps on the device, with torch's kernel
        assert max_rel_diff(engine.module, ref) == 0.0
        assert max_rel_diff(engine.module, torch_ref) > 1e-5   # the optimizers' last bits, amplified
    engine.destroy()


def hold_update_until_taken(engine, held: int, taken: int) -> tuple[threading.Event, list]:
    """Layer ``held``'s update (on the update thread) waits until the next forward has taken layer
    ``taken``'s weights; returns the event (set it after the last step) and, per held update, whether
    the wait ended by that forward rather than by a 20 s timeout."""
    held_params = {id(p) for p in engine.weights.params[held]}
    layer_taken = threading.Event()
    waited = []
    update, acquire = engine.optimizer.update, engine.executor._acquire

    def held_update(params, **kwargs):
        if {id(p) for p in params} <= held_params:
            waited.append(layer_taken.wait(timeout=20))
            layer_taken.clear()
        return update(params, **kwargs)

    def noting_acquire(layer):
        out = acquire(layer)
        # a later step's forward (not the first step's, nor a backward)
        if layer == taken and engine.global_steps > 0 and engine.executor._current is not None:
            layer_taken.set()
        return out
    engine.optimizer.update, engine.executor._acquire = held_update, noting_acquire
    return layer_taken, waited


def train_holding(engine, data, layer_taken):
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    layer_taken.set()   # the last step's update has no next forward
    engine.wait_for_update()


def test_next_forward_starts_while_the_last_layer_is_still_updating():
    """The update of the last layer waits (on the update thread) until the next forward has taken
    layer 0's weights: only an overlapped update lets that happen."""
    model = make_model("llama")
    data = batches(3)
    serial = train(copy.deepcopy(model), data, overlap_config(False))
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    layer_taken, waited = hold_update_until_taken(engine, held=engine.weights.num_layers - 1, taken=0)
    train_holding(engine, data, layer_taken)
    assert waited == [True, True, True]   # the last one by train_holding, after the loop
    assert_same_training(engine, serial)


def test_a_layer_is_never_fetched_while_its_update_runs():
    """Copy path: the prefetch skips a layer whose update is pending, and the update thread issues it as
    soon as the update lands (here layer 3's update is held until the forward has taken layer 2), so the
    forward finds layer 3 prefetched rather than fetching it on the critical path."""
    model = make_model("llama")
    data = batches(3)
    serial = train(copy.deepcopy(model), data, overlap_config(False), zero_copy_off)
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    zero_copy_off(engine)
    layer_taken, waited = hold_update_until_taken(engine, held=3, taken=2)
    # the update thread sets layer 3's flag, then issues its held-back prefetch: a forward reaching layer 3 in
    # between (the update thread pre-empted there on a busy core) would fetch it itself. The forward's take of
    # layer 3 waits until the prefetch has been issued.
    issued, on_done, acquire = threading.Event(), engine.layer_updates._on_done, engine.executor._acquire

    def noting_done(i):
        on_done(i)
        if i == 3:
            issued.set()

    def acquire_once_issued(layer):
        if layer == 3 and engine.global_steps > 0 and engine.executor._current is not None:
            assert issued.wait(timeout=20)
            issued.clear()
        return acquire(layer)
    engine.layer_updates._on_done, engine.executor._acquire = noting_done, acquire_once_issued
    pending_at_fetch = []
    fetch = engine.weights.fetch_into

    layer3_fetched_by = []

    def record_fetch(i, buf):
        pending_at_fetch.append(engine.layer_updates.pending(i))
        if i == 3:   # backward runs on the main thread on the CPU, on autograd's device thread on CUDA
            by_update = threading.current_thread().name.startswith("lazytrain-update")
            layer3_fetched_by.append("update thread" if by_update else "training")
        return fetch(i, buf)
    engine.weights.fetch_into = record_fetch
    train_holding(engine, data, layer_taken)
    assert waited == [True, True, True]
    assert pending_at_fetch and not any(pending_at_fetch)
    # forward, backward; then in each forward that follows an update, by the update thread as it lands
    assert layer3_fetched_by == ["training"] * 2 + ["update thread", "training"] * 2
    assert_same_training(engine, serial)


READERS = {
    "optimizer.state_dict": lambda e: e.optimizer.state_dict(),
    "optimizer.load_state_dict": lambda e: e.optimizer.load_state_dict(e.optimizer.state_dict()),
    "optimizer.zero_grad": lambda e: e.optimizer.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda e: e.optimizer.zero_grad(set_to_none=False),
    "module.zero_grad": lambda e: e.module.zero_grad(),
    "module.state_dict": lambda e: e.module.state_dict(),
    "submodule.state_dict": lambda e: e.module.model.layers[3].state_dict(),
    "module.load_state_dict": lambda e: e.module.load_state_dict(e.module.state_dict()),
    "engine.zero_grad": lambda e: e.zero_grad(),
    "engine.module_state_dict": lambda e: e.module_state_dict(),
    "engine.save_checkpoint": lambda e: e.save_checkpoint(e._test_dir),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_readers_during_the_overlapped_update_see_it_whole(reader, tmp_path):
    """Called right after engine.step() while slow layer updates are still running: readers wait, and
    zero_grad (optimizer, module or engine) neither drops nor zeroes a pending layer's update. The
    training then matches the serial one bit for bit."""
    model = make_model("llama")
    data = batches(2)
    serial = train(copy.deepcopy(model), data, overlap_config(False))
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    engine._test_dir = str(tmp_path)
    slow_layer_updates(engine, 0.02)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        READERS[reader](engine)
    engine.wait_for_update()
    block_params = [p for params in engine.weights.params for p in params]
    assert all(engine.optimizer.state[p]["step"] == 2 for p in block_params)
    assert_same_training(engine, serial)


def test_readers_that_must_wait_do(tmp_path):
    """state_dict-style readers return only once every layer is updated."""
    for reader in ("optimizer.state_dict", "module.state_dict", "submodule.state_dict", "engine.module_state_dict"):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=overlap_config(True))
        slow_layer_updates(engine, 0.02)
        x, y = batches(1)[0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        READERS[reader](engine)
        assert not any(engine.layer_updates.pending(i) for i in range(engine.weights.num_layers)), reader


def test_step_hooks_run_once_per_step_and_extra_parameters_are_updated():
    """The optimizer's step hooks run once per engine.step() on the training thread, and a parameter
    the optimizer holds outside the model (a loss temperature) is updated (and clipped) as serially. A pre-hook
    that sets the learning rate (a warm-up helper) reaches the streamed layers too: they were updated with the
    groups as they were before the hooks ran."""
    def run(overlap):
        model = make_model("llama")
        temperature = torch.nn.Parameter(torch.ones(()))
        cfg = overlap_config(overlap)
        del cfg["optimizer"]
        engine, opt, _, _ = lazytrain.initialize(
            model=model, config=cfg,
            optimizer=lambda params: HybridAdamW([{"params": list(params)}, {"params": [temperature]}], lr=1e-2,
                                                 weight_decay=0.1,
                                                 min_8bit_size=64))
        threads = []
        opt.register_step_post_hook(lambda *a: threads.append(threading.current_thread().name))

        def warm_up(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * group["lr"]
        opt.register_step_pre_hook(warm_up)
        for x, y in batches(3):
            engine.backward(lm_loss(engine(x), y) * temperature)
            engine.step()
        engine.wait_for_update()
        return engine, temperature, threads
    serial, t_serial, hooks_serial = run(False)
    overlapped, t_overlapped, hooks_overlapped = run(True)
    assert hooks_serial == hooks_overlapped == [threading.main_thread().name] * 3
    assert t_overlapped.item() != 1.0 and torch.equal(t_overlapped, t_serial)
    assert_same_training(overlapped, serial)


def test_a_step_post_hook_sees_the_streamed_layers_updated_as_under_serial_steps():
    """With the layers' update overlapped, the post-hooks ran inside the optimizer step of the parameters outside
    them: an EMA or a logger registered with register_step_post_hook read the layers' weights of the step before.
    The optimizer's own now run once every layer is updated (that step waits for them), once each, in order, with
    what torch's wrapper hands them; one a pre-hook removes does not run, one it registers runs after the update.
    torch's global post-hooks run inside the step, before the layers' update (README)."""
    seen = {}
    for overlap in (False, True):
        model = make_model("llama")
        engine, opt, _, _ = lazytrain.initialize(model=model, config=overlap_config(overlap))
        weight = dict(model.named_parameters())["model.layers.3.self_attn.q_proj.weight"]
        got, late = [], []
        opt.register_step_post_hook(lambda o, a, k: got.append((o is opt, a[0] is opt, weight.detach().clone())))
        doomed = opt.register_step_post_hook(lambda o, a, k: got.append("removed"))
        global_calls = []
        handle = register_optimizer_step_post_hook(lambda o, a, k: global_calls.append(o) if o is opt else None)

        def pre(o, a, k):   # a hook removed and one registered while the step runs
            doomed.remove()
            if not late:
                late.append(o.register_step_post_hook(lambda o, a, k: got.append(("late", weight.detach().clone()))))
        opt.register_step_pre_hook(pre)
        try:
            for x, y in batches(2):
                engine.backward(lm_loss(engine(x), y))
                engine.step()
                engine.wait_for_update()
                mine = got[-2:]
                assert mine[0][:2] == (True, True) and torch.equal(mine[0][2], weight)   # the step's update, done
                assert mine[1][0] == "late" and torch.equal(mine[1][1], weight)
        finally:
            handle.remove()
        assert "removed" not in got and len(got) == 4 and len(global_calls) == 2
        seen[overlap] = [g[-1] for g in got]
        engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True]))


def test_deepspeeds_gathered_parameters_scope_reads_the_step_done():
    """A Trainer callback reading a block's weight at on_step_end through deepspeed.zero.GatheredParameters (it
    cannot call engine.wait_for_update()) read the weight of the step before while the layers still updated."""
    from lazytrain.integrations.deepspeed_entry import _GatheredParameters
    model = make_model("llama")
    engine, opt, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    update = opt.update

    def slow(*args, **kwargs):   # each layer's update late: the scope is entered while they run
        time.sleep(0.05)
        return update(*args, **kwargs)
    opt.update = slow
    weight = dict(model.named_parameters())["model.layers.3.self_attn.q_proj.weight"]
    for x, y in batches(2):
        before = weight.detach().clone()
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        with _GatheredParameters([weight]):
            seen = weight.detach().clone()
        engine.wait_for_update()
        assert torch.equal(seen, weight) and not torch.equal(seen, before)
    engine.destroy()


def test_a_group_added_in_bf16_as_named_parameters_trains_as_one_of_plain_parameters():
    """In bf16 a group added later is re-pointed at the fp32 masters, where the gradients land: (name, parameter)
    pairs went through as they were, so the added bf16 head never trained; a set escaped the refusal (listed
    first)."""
    results = []
    for named in (False, True):
        model = make_model("modulelist")
        cfg = overlap_config(True)
        cfg["bf16"] = {"enabled": True}
        engine, opt, _, _ = lazytrain.initialize(
            model=model, model_parameters=[p for n, p in model.named_parameters() if not n.startswith("head.")],
            config=cfg)
        with pytest.raises(TypeError, match="optimizer parameters need to be organized in ordered collections"):
            opt.add_param_group({"params": set(model.head.parameters())})
        opt.add_param_group({"params": list(model.head.named_parameters() if named else model.head.parameters())})
        assert all(p.dtype == torch.float32 for p in opt.param_groups[-1]["params"])
        head = model.head.weight.detach().float().clone()
        for x, y in batches(3):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        results.append(engine.module_state_dict())
        assert not torch.equal(results[-1]["head.weight"].float(), head)
        engine.destroy()
    for name, w in results[0].items():
        assert torch.equal(results[1][name], w), name


def test_param_group_added_while_layers_update():
    """A group added right after engine.step() (progressive unfreezing) is not part of the running
    update, and the next step updates it."""
    model = make_model("llama")
    extra = torch.nn.Parameter(torch.ones(3))
    engine, opt, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    slow_layer_updates(engine, 0.02)
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    opt.add_param_group({"params": [extra]})
    engine.backward(lm_loss(engine(x2), y2) + extra.sum())
    engine.step()
    engine.wait_for_update()
    assert opt.state[extra]["step"] == 1 and not torch.equal(extra.detach(), torch.ones(3))


@pytest.mark.parametrize("partial", [None, {"load_module_only": True}, {"load_optimizer_states": False}])
def test_a_failed_update_is_raised_until_a_checkpoint_is_loaded(tmp_path, partial):
    """A full load is the way out; one without the optimizer states keeps the engine refusing, as after a failed
    serial update (the moments are still the failed step's mix: it cleared the failure, and training went on
    with some layers' moments stepped twice)."""
    model = make_model("llama")
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="good")
    layer3 = {id(p) for p in engine.weights.params[3]}
    update = engine.optimizer.update

    def fail_layer3(params, **kwargs):
        if {id(p) for p in params} <= layer3:
            raise RuntimeError("host out of memory")
        return update(params, **kwargs)
    engine.optimizer.update = fail_layer3
    engine.backward(lm_loss(engine(x2), y2))
    engine.step()
    with pytest.raises(OverlappedUpdateError, match="failed on the update thread") as info:
        engine(x2)
    assert "host out of memory" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(OverlappedUpdateError):   # and stays failed
        engine.module.state_dict()
    engine.optimizer.update = update
    if partial is not None:
        engine.load_checkpoint(str(tmp_path), tag="good", **partial)
        with pytest.raises(lazytrain.StepFailedError, match=r"the overlapped optimizer update of step 2 failed on the "
                                                            r"update thread \(RuntimeError\('host out of memory'\)\).*"
                                                            r"kept that optimizer state"):
            engine(x2)
    engine.load_checkpoint(str(tmp_path), tag="good")   # the way out
    assert all(float(g.abs().max()) == 0.0 for g in engine.weights.grad)   # no gradient of the failed step
    engine.backward(lm_loss(engine(x2), y2))
    engine.step()
    engine.wait_for_update()
    assert engine.global_steps == 2   # the checkpoint's 1, then this step
    engine.destroy()
    model.state_dict()   # no hook of the engine left behind
    assert not any(h for m in model.modules() for h in m._state_dict_pre_hooks.values())


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_destroy_after_a_failed_update_hands_the_model_back_and_frees_the_tiers(home, tmp_path):
    """A failed overlapped update is raised by every wait, but destroy() (the script's way out, or its
    clean-up) still hands the model back and closes the tiers: the NVMe run directory goes."""
    section = {"weights_home": home}
    if home == "nvme":
        section["nvme_path"] = str(tmp_path)
    model = make_model("llama")
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True, **section))
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.wait_for_update()
    update = engine.optimizer.update

    def fail(params, **kwargs):
        raise RuntimeError("host out of memory")
    engine.optimizer.update = fail
    engine.backward(lm_loss(engine(x2), y2))
    engine.step()
    with pytest.raises(OverlappedUpdateError):
        engine(x2)
    engine.optimizer.update = update
    engine.destroy()
    assert not any(name.startswith("lazytrain-run-") for name in os.listdir(tmp_path))
    model(x2)   # the model's own forward: no engine in the way any more
    assert not any(h for m in model.modules() for h in m._forward_pre_hooks.values())


def test_checkpoint_of_a_serial_run_loads_into_an_overlapped_one(tmp_path):
    """A checkpoint written with torch's AdamW (the CPU default) continues under overlap (HybridAdamW with
    fp32 states) like the serial run continues, within 1e-5."""
    model = make_model("llama")
    data = batches(4)
    # serial (overlap "auto" is on with CUDA, where the optimizer would be HybridAdamW)
    first = train(copy.deepcopy(model), data[:2], ds_config(checkpoint_interval=2, overlap_optimizer=False))
    assert type(first.optimizer) is torch.optim.AdamW
    first.save_checkpoint(str(tmp_path))
    for x, y in data[2:]:
        first.backward(lm_loss(first(x), y))
        first.step()
    resumed, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model),
                                            config=ds_config(checkpoint_interval=2, overlap_optimizer=True))
    resumed.load_checkpoint(str(tmp_path))
    for x, y in data[2:]:
        resumed.backward(lm_loss(resumed(x), y))
        resumed.step()
    resumed.wait_for_update()
    assert isinstance(resumed.optimizer, HybridAdamW)
    assert max_rel_diff(resumed.module, first.module) < RTOL


def test_adam_with_l2_keeps_torch_adams_defaults_under_overlap():
    """optimizer.type Adam with adam_w_mode false (L2, torch Adam's weight decay default 0) built as
    HybridAdamW for the overlap keeps those semantics and trains like torch.optim.Adam."""
    model = make_model("llama")
    data = batches(4)
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, y in data:
        lm_loss(ref(x.to(AUTO_DEVICE)), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    cfg = ds_config(checkpoint_interval=2, overlap_optimizer=True)
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False}}
    engine = train(model, data, cfg)
    assert engine.optimizer.defaults["weight_decay"] == 0.0 and not engine.optimizer.defaults["adamw_mode"]
    assert max_rel_diff(engine.module, ref) < RTOL



@pytest.mark.parametrize("typ,extra,decay", [("AdamW", {"torch_adam": True}, 0.01), ("AdamW", {}, 0.0),
                                             ("Adam", {"torch_adam": True}, 0.01),
                                             ("Adam", {"torch_adam": True, "adam_w_mode": False}, 0.0)])
def test_adams_weight_decay_defaults_to_what_deepspeed_builds(typ, extra, decay):
    """DeepSpeed builds torch's AdamW (weight decay 0.01) for "torch_adam", torch's Adam (0) with adam_w_mode
    false, and else its FusedAdam or CPUAdam (0)."""
    cfg = ds_config(device="cpu")
    cfg["optimizer"] = {"type": typ, "params": {"lr": 1e-2, **extra}}
    engine, opt, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [decay] * len(opt.param_groups)
    engine.destroy()


def test_a_fresh_adagrad_object_is_taken_and_one_that_stepped_is_refused():
    """torch's Adagrad builds its state (step 0) with the optimizer: that is no step taken."""
    model = make_model("modulelist")
    engine, opt, _, _ = lazytrain.initialize(model=model, config={"train_batch_size": 2, "steps_per_print": 10**9},
                                             optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and {float(s["step"]) for s in opt.state.values()} == {1.0}
    engine.destroy()
    # in bf16 the embedding and head get fp32 masters (on a GPU also in fp32): the state Adagrad built with
    # them moves to the masters (they found none: KeyError 'sum'), its sums at the initial value in fp32
    model = make_model("modulelist")
    engine, opt, _, _ = lazytrain.initialize(
        model=model, config={"train_batch_size": 2, "steps_per_print": 10**9, "bf16": {"enabled": True}},
        optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5))
    head = engine.masters.master_of(model.head.weight)
    assert head is not model.head.weight and model.head.weight not in opt.state
    assert opt.state[head]["sum"].dtype == torch.float32 and torch.equal(opt.state[head]["sum"],
                                                                         torch.full_like(head, 0.5))
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    grouped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in grouped for p in opt.state) and {float(s["step"]) for s in opt.state.values()} == {1.0}
    engine.destroy()
    stepped = make_model("modulelist")
    adagrad = torch.optim.Adagrad(stepped.parameters(), lr=0.1)
    lm_loss(stepped(x), y).backward()
    adagrad.step()
    with pytest.raises(ConfigError, match="the optimizer passed to lazytrain.initialize has already stepped"):
        lazytrain.initialize(model=stepped, config={"train_batch_size": 2}, optimizer=adagrad)


def test_overlap_config():
    model = make_model("llama")
    engine, opt, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=ds_config(device="cpu"))
    assert engine.layer_updates is None and type(opt) is torch.optim.AdamW   # auto: off on the CPU
    with pytest.raises(ConfigError, match="'lazytrain.overlap_optimizer' = true needs an optimizer that updates "
                                          "one layer at a time .*got SGD"):
        cfg = ds_config(overlap_optimizer=True)
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        lazytrain.initialize(model=copy.deepcopy(model), config=cfg)
    cfg = ds_config(overlap_optimizer=True)
    cfg["optimizer"]["params"]["amsgrad"] = True
    with pytest.raises(ConfigError, match="got AdamW"):
        lazytrain.initialize(model=copy.deepcopy(model), config=cfg)
    cfg = ds_config(optimizer_states="8bit")
    cfg["optimizer"]["params"]["amsgrad"] = True
    with pytest.raises(ConfigError, match="amsgrad' = true is not supported with 'lazytrain.optimizer_states'"):
        lazytrain.initialize(model=copy.deepcopy(model), config=cfg)
    for overlap in (False, True):   # DeepSpeed's Adam/AdamW default to no weight decay (torch AdamW: 0.01)
        cfg = ds_config(overlap_optimizer=overlap)
        del cfg["optimizer"]["params"]["weight_decay"]
        _, opt, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=cfg)
        assert opt.defaults["weight_decay"] == 0.0
    with pytest.raises(ConfigError, match="'lazytrain.overlap_optimizer' must be \"auto\", true or false, got 'yes'"):
        lazytrain.initialize(model=copy.deepcopy(model), config=ds_config(overlap_optimizer="yes"))


def test_8bit_states_with_an_optimizer_that_keeps_its_own_state_are_refused_naming_it():
    """'lazytrain.optimizer_states': "8bit" applies to the Adam types the engine builds as HybridAdamW: with SGD
    from the config, or a torch AdamW passed to initialize, the request went unheard (4x the host memory asked
    for), without a word. A HybridAdamW passed in keeps what its groups say."""
    model = make_model("modulelist", n_layers=2)
    cfg = ds_config(optimizer_states="8bit")
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    with pytest.raises(ConfigError) as e:
        lazytrain.initialize(model=copy.deepcopy(model), config=cfg)
    assert str(e.value) == ("config 'lazytrain.optimizer_states' = \"8bit\" keeps Adam's moments in 8 bits (HybridAdamW, "
                            "built for 'optimizer.type' Adam, AdamW, AdamW8bit or HybridAdamW); this engine's optimizer "
                            "(SGD, from the config's 'optimizer.type' 'SGD') keeps its own state: remove the key, or "
                            "use one of those types")
    cfg = ds_config(optimizer_states="8bit")
    del cfg["optimizer"]
    passed = copy.deepcopy(model)
    with pytest.raises(ConfigError) as e:
        lazytrain.initialize(model=passed, config=cfg, optimizer=torch.optim.AdamW(passed.parameters(), lr=1e-3))
    assert str(e.value).endswith("this engine's optimizer (AdamW, passed to lazytrain.initialize) keeps its own "
                                 "state: remove the key, or use one of those types in the config (or pass a "
                                 "lazytrain.optim.HybridAdamW)")
    passed = copy.deepcopy(model)
    with pytest.raises(ConfigError, match=re.escape("the HybridAdamW passed to lazytrain.initialize keeps fp32 states "
                                                    "in every group (optimizer_states=\"fp32\")")):
        lazytrain.initialize(model=passed, config=cfg,
                             optimizer=HybridAdamW(passed.parameters(), lr=1e-3, optimizer_states="fp32"))

    class OwnHybrid(HybridAdamW):   # a subclass keeps 8-bit states as HybridAdamW does
        pass
    for kind in (HybridAdamW, OwnHybrid):
        passed = copy.deepcopy(model)
        engine, opt, _, _ = lazytrain.initialize(model=passed, config=cfg, optimizer=kind(passed.parameters(), lr=1e-3))
        assert type(opt) is kind
        engine.destroy()


def test_zero_grad_clears_a_gradient_landed_while_the_update_thread_finishes():
    """A backward that lands into layers whose updates are done, while the update thread is still on its
    way out (held here after the last layer's flag), is cleared by engine.zero_grad(): a layer whose
    update is done is zeroed on the calling thread, a pending one by its update."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=overlap_config(True))
    last = engine.weights.num_layers - 1
    landed, held = threading.Event(), []
    on_done = engine.layer_updates._on_done

    def hold_after_last(i):
        on_done(i)
        if i == last:
            held.append(landed.wait(timeout=30))
    engine.layer_updates._on_done = hold_after_last
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.backward(lm_loss(engine(x2), y2))   # every layer's update is done: its flag was set
    engine.weights.flush_grads()
    assert engine.layer_updates.running()
    assert any(g is not None and bool(g.any()) for g in engine.weights.grad)
    engine.zero_grad()
    landed.set()
    engine.wait_for_update()
    assert held == [True]
    for i, g in enumerate(engine.weights.grad):
        assert g is None or not bool(g.any()), i


def test_an_interrupt_while_an_update_is_launched_leaves_no_layer_pending_forever():
    """The layers' done flags were cleared before the update was handed to the worker: an interrupt (or a
    thread that cannot start) in between left every layer pending with nothing to finish it, and the next
    forward after a reload waited forever."""
    engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=overlap_config(True))
    x, y = batches(1)[0]
    submit, calls = engine.layer_updates._pool.submit, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return submit(*args, **kwargs)
    engine.layer_updates._pool.submit = interrupted
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert not any(engine.layer_updates.pending(i) for i in range(engine.weights.num_layers))
    engine.destroy()


def test_an_update_thread_that_cannot_start_leaves_nothing_queued_for_the_next_step(tmp_path, monkeypatch):
    """ThreadPoolExecutor.submit queues the work before it starts its thread: a thread that could not start
    left the update queued, to run first at the next launch on that step's gradients (every streamed layer
    stepped twice after a clean reload)."""
    def trained(fail_start: bool):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=overlap_config(True))
        engine.save_checkpoint(str(tmp_path / ("a" if fail_start else "b")), tag="start")
        (x, y), (x2, y2) = batches(2)
        if fail_start:
            start, failed = threading.Thread.start, []

            def refusing(thread):
                if thread.name.startswith("lazytrain-update") and not failed:
                    failed.append(thread.name)
                    raise RuntimeError("can't start new thread")
                return start(thread)
            monkeypatch.setattr(threading.Thread, "start", refusing)
            engine.backward(lm_loss(engine(x), y))
            with pytest.raises(lazytrain.StepFailedError, match="can't start new thread"):
                engine.step()
            monkeypatch.setattr(threading.Thread, "start", start)
            engine.load_checkpoint(str(tmp_path / "a"), tag="start")
        engine.backward(lm_loss(engine(x2), y2))
        engine.step()
        engine.wait_for_update()
        state = {k: v.clone() for k, v in engine.module_state_dict().items()}
        engine.destroy()
        return state
    clean, after_failure = trained(False), trained(True)
    assert all(torch.equal(after_failure[k], v) for k, v in clean.items())
