"""lazytrain.overlap_optimizer: engine.step() updates the streamed layers on a worker thread, and the next
forward waits for each layer's update only when it needs that layer. Results are bit-identical to the
serial step, and everything that reads weights, gradients or optimizer state waits first."""
import copy
import threading
import time

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine.layer_updates import OverlappedUpdateError
from lazytrain.optim.hybrid_adamw import HybridAdamW
from engine_models import batches, lm_loss, make_model, max_rel_diff, reference_train
from test_engine_parity import RTOL, ds_config


def overlap_config(overlap, optimizer="AdamW8bit", **section):
    cfg = ds_config(overlap_optimizer=overlap, hybrid_threshold=64, **section)
    cfg["optimizer"]["type"] = optimizer
    return cfg


def train(model, data, config, before_training=None):
    engine, _, _, _ = lazytrain.initialize(model=model, config=config)
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
    ref = reference_train(model, data)
    engine = train(model, data, ds_config(checkpoint_interval=2, overlap_optimizer=True))
    assert isinstance(engine.optimizer, HybridAdamW)
    assert {r["states"] for r in engine.optimizer.state_report()} == {"fp32"}
    assert max_rel_diff(engine.module, ref) < RTOL


def hold_update_until_taken(engine, held: int, taken: int) -> tuple[threading.Event, list]:
    """Layer ``held``'s update (on the update thread) waits until the next forward has taken layer
    ``taken``'s weights; returns the event (set it after the last step) and, per held update, whether
    the wait ended by the forward rather than by a 20 s timeout."""
    held_params = {id(p) for p in engine.weights.params[held]}
    layer_taken = threading.Event()
    waited = []
    step, acquire = engine.optimizer.step, engine.executor._acquire

    def held_step(*args, params=None, **kwargs):
        if params is not None and params and {id(p) for p in params} <= held_params:
            waited.append(layer_taken.wait(timeout=20))
            layer_taken.clear()
        return step(*args, params=params, **kwargs)

    def noting_acquire(layer):
        out = acquire(layer)
        if layer == taken and engine.global_steps > 0:
            layer_taken.set()
        return out
    engine.optimizer.step, engine.executor._acquire = held_step, noting_acquire
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
    assert waited == [True, True, True]
    assert_same_training(engine, serial)


def test_a_layer_is_never_fetched_while_its_update_runs():
    """Copy path: the prefetch skips a layer whose update is pending and the forward fetches it once the
    update is done (here layer 3's update is held until the forward has taken layer 2)."""
    model = make_model("llama")
    data = batches(3)
    serial = train(copy.deepcopy(model), data, overlap_config(False), zero_copy_off)
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    zero_copy_off(engine)
    layer_taken, waited = hold_update_until_taken(engine, held=3, taken=2)
    pending_at_fetch = []
    fetch = engine.weights.fetch

    def record_fetch(i, slot):
        pending_at_fetch.append(engine.layer_updates.pending(i))
        return fetch(i, slot)
    engine.weights.fetch = record_fetch
    train_holding(engine, data, layer_taken)
    assert waited == [True, True, True]
    assert pending_at_fetch and not any(pending_at_fetch)
    assert_same_training(engine, serial)


READERS = {
    "optimizer.state_dict": lambda e: e.optimizer.state_dict(),
    "optimizer.zero_grad": lambda e: e.optimizer.zero_grad(),
    "module.state_dict": lambda e: e.module.state_dict(),
    "engine.zero_grad": lambda e: e.zero_grad(),
    "engine.module_state_dict": lambda e: e.module_state_dict(),
    "engine.save_checkpoint": lambda e: e.save_checkpoint(e._test_dir),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_readers_wait_for_the_overlapped_update(reader, tmp_path):
    model = make_model("llama")
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    engine._test_dir = str(tmp_path)
    step = engine.optimizer.step

    def slow(*args, params=None, **kwargs):
        if params is not None:
            time.sleep(0.02)
        return step(*args, params=params, **kwargs)
    engine.optimizer.step = slow
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    READERS[reader](engine)
    assert not any(engine.layer_updates.pending(i) for i in range(engine.weights.num_layers))
    steps = {int(s["step"]) for s in engine.optimizer.state.values()}
    assert steps == {1}


def test_a_failed_update_is_raised_in_the_training_thread():
    model = make_model("llama")
    engine, _, _, _ = lazytrain.initialize(model=model, config=overlap_config(True))
    layer3 = {id(p) for p in engine.weights.params[3]}
    step = engine.optimizer.step

    def fail_layer3(*args, params=None, **kwargs):
        if params is not None and params and {id(p) for p in params} <= layer3:
            raise RuntimeError("host out of memory")
        return step(*args, params=params, **kwargs)
    engine.optimizer.step = fail_layer3
    (x, y), (x2, y2) = batches(2)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(OverlappedUpdateError, match="failed on the update thread") as info:
        engine(x2)
    assert "host out of memory" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(OverlappedUpdateError):   # and stays failed
        engine.save_checkpoint("unused")


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
    with pytest.raises(ConfigError, match="'lazytrain.overlap_optimizer' must be \"auto\", true or false, got 'yes'"):
        lazytrain.initialize(model=copy.deepcopy(model), config=ds_config(overlap_optimizer="yes"))
