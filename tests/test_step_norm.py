"""The step's gradient norm from the sums of squares the gradient path took as each layer's last gradient
landed: no pass over the host gradient buffers at the step, the same norm as reading them, and a buffer
written since (a script's in-place change of a ``.grad``) read again; with ``grad_norm_as_landed`` false,
every buffer read at the step (a script that writes gradients through ``.data``, which autograd's version
counter does not see)."""
import math

import pytest

import lazytrain
from lazytrain.engine import weights as weights_module
from lazytrain.optim import hybrid_adamw
from lazytrain.engine.host_accumulate import sum_of_squares
from engine_models import batches, lm_loss, make_model


def engine_of(copy_threads: bool, accumulation: int = 2, dtype: str = "fp32", **lazytrain_keys):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "lazytrain": {"testing": {"copy_threads": copy_threads}, **lazytrain_keys}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = lazytrain.initialize(model=make_model("modulelist"), config=cfg)
    return engine


@pytest.fixture
def counted(monkeypatch):
    """The layers whose gradient buffers the step read (their sums of squares taken there, not as they landed)."""
    read = []
    real = weights_module.sum_of_squares

    def counting(t, *args):
        read.append(t.numel())
        return real(t, *args)
    monkeypatch.setattr(weights_module, "sum_of_squares", counting)
    return read


def expected_norm(engine) -> float:
    """The norm over every gradient the optimizer reads, from the buffers as they are now."""
    layer_grads = {id(g) for g in engine.weights.grad if g is not None}
    squares = [float(g.double().square().sum()) for g in engine._all_grads() if id(g) not in layer_grads]
    return math.sqrt(sum(sum_of_squares(g) for g in engine.weights.grad if g is not None) + sum(squares))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("copy_threads", [True, False])
def test_the_step_takes_the_layers_square_sums_from_the_gradient_path(counted, copy_threads, dtype):
    """With the gradient sink (the GPU's path: copy threads here) every layer's sum of squares was taken as its
    last micro-batch's gradient was added; without it (the CPU adds each parameter's gradient on its own) the
    step reads the buffers. The norm is the buffers' either way."""
    engine = engine_of(copy_threads, dtype=dtype)
    for step, (x, y) in enumerate(batches(4)):
        engine.backward(lm_loss(engine(x), y))
        if step % 2 == 1:   # the accumulation boundary: every layer's gradient landed
            engine.weights.flush_grads()
            norm = expected_norm(engine)
            counted.clear()
            engine.step()
            assert counted == ([] if copy_threads else engine.weights.trainable_numels)
            assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-6)
        else:
            engine.step()
    engine.destroy()


def test_a_gradient_changed_in_place_after_it_landed_is_read_again(counted):
    engine = engine_of(copy_threads=True, accumulation=1)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    block_param = next(engine.module.stack[3].parameters())
    block_param.grad.mul_(100.0)   # a view of layer 3's buffer: its version moves
    norm = expected_norm(engine)
    counted.clear()
    engine.step()
    assert counted == [engine.weights.trainable_numels[3]]
    assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-6)
    engine.destroy()


def test_zeroed_buffers_have_no_square_sum_to_read(counted):
    """zero_grad leaves each layer's sum known (0): a step after a backward that reached no layer reads none."""
    engine = engine_of(copy_threads=True, accumulation=1)
    engine.zero_grad()
    counted.clear()
    assert all(engine.weights.grad_square_sum(i) == 0.0 for i in range(engine.weights.num_layers))
    assert counted == []
    engine.destroy()


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "torch"])
def test_the_overlapped_update_clears_each_layer_gradient_as_it_reads_it(counted, monkeypatch, kernels_on):
    """With the layer updates on the update thread (a GPU's default), HybridAdamW clears each layer's gradient
    buffer in its update (the compiled kernels block by block as they read it, torch's path after) and the
    engine makes no pass of its own over it. The buffers are zero after the step, their sums known (0)
    without a read, and the next step's norm is the buffers' again."""
    calls = []
    real = weights_module.LayerWeights.zero_layer_grads

    def spy(self, i, cleared=False):
        calls.append(cleared)
        return real(self, i, cleared=cleared)
    monkeypatch.setattr(weights_module.LayerWeights, "zero_layer_grads", spy)
    if not kernels_on:
        monkeypatch.setattr(hybrid_adamw, "cpu_kernels", lambda: None)
    engine = engine_of(copy_threads=True, accumulation=1, overlap_optimizer=True)
    layers = engine.weights.num_layers
    for x, y in batches(2):
        engine.backward(lm_loss(engine(x), y))
        engine.weights.flush_grads()
        norm = expected_norm(engine)
        calls.clear()
        engine.step()
        engine.wait_for_update()
        assert calls == [True] * layers
        assert all(not g.any() for g in engine.weights.grad if g is not None)
        assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-6)
        counted.clear()
        assert all(engine.weights.grad_square_sum(i) == 0.0 for i in range(layers))
        assert counted == []
    engine.destroy()


def test_the_overlapped_update_clears_frozen_partly_trained_and_ungrouped_layers_buffers(monkeypatch):
    """The engine skips its own clear only where the update covered the whole buffer: a frozen layer (no
    buffer), a layer half frozen, a trainable parameter in no optimizer group (update clears what it is
    given). Every buffer reads zero after each overlapped step, and the weights end bit for bit as with the
    optimizer's torch path, which clears by ``zero_()`` after its update (its kernels and torch's path update
    alike, bit for bit)."""
    import copy
    import torch
    calls = []
    real = weights_module.LayerWeights.zero_layer_grads

    def spy(self, i, cleared=False):
        calls.append((i, cleared))
        return real(self, i, cleared=cleared)
    monkeypatch.setattr(weights_module.LayerWeights, "zero_layer_grads", spy)
    torch.manual_seed(0)
    base = make_model("modulelist")
    for p in base.stack[2].parameters():
        p.requires_grad_(False)
    base.stack[3].fc1.weight.requires_grad_(False)
    ends = {}
    for kernels_on in (True, False):
        with monkeypatch.context() as m:
            if not kernels_on:
                m.setattr(hybrid_adamw, "cpu_kernels", lambda: None)
            model = copy.deepcopy(base)
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                   "lazytrain": {"testing": {"copy_threads": True}, "overlap_optimizer": True}}
            grouped = [p for n, p in model.named_parameters() if p.requires_grad and n != "stack.4.fc2.bias"]
            engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=grouped, config=cfg)
            for x, y in batches(3):
                engine.backward(lm_loss(engine(x), y))
                calls.clear()
                engine.step()
                engine.wait_for_update()
                assert all(not g.any() for g in engine.weights.grad if g is not None)
                assert calls == [(i, i != 2) for i in range(engine.weights.num_layers)]
            ends[kernels_on] = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine.destroy()
    assert all(torch.equal(ends[True][n], ends[False][n]) for n in ends[True])


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("as_landed", [True, False])
def test_the_first_gradient_after_a_clear_is_written_without_reading_the_buffer(monkeypatch, as_landed, overlap):
    """Each layer's first micro-batch after the step's clear (the engine's zero_, or the overlapped update's
    kernel) lands with ``dst_is_zero`` (0 + gradient, bit for bit the add, no read of the buffer); the next
    micro-batch adds. A script's in-place write into a ``.grad`` after the clear moves the version counter:
    that layer's gradient adds to it. With ``grad_norm_as_landed`` false (the counter not trusted) every
    gradient adds, so a write through ``.data``, which the counter does not see, is kept too."""
    import torch
    landed = []
    real = weights_module.add_into

    def spy(dst, src, scratch, square_sum=False, dst_is_zero=False):
        landed.append((dst, src.clone(), dst_is_zero))
        return real(dst, src, scratch, square_sum=square_sum, dst_is_zero=dst_is_zero)
    monkeypatch.setattr(weights_module, "add_into", spy)
    engine = engine_of(copy_threads=True, accumulation=2, grad_norm_as_landed=as_landed, overlap_optimizer=overlap)
    w = engine.weights
    layer_of = {id(g): i for i, g in enumerate(w.grad)}

    def micro_batch(x, y):
        landed.clear()
        engine.backward(lm_loss(engine(x), y))
        w.flush_grads()
        return {layer_of[id(dst)]: (src, flag) for dst, src, flag in landed if id(dst) in layer_of}

    (x0, y0), (x1, y1), (x2, y2), _ = batches(4)
    first = micro_batch(x0, y0)
    assert sorted(first) == list(range(w.num_layers)) and all(f == as_landed for _, f in first.values())
    assert all(torch.equal(w.grad[i], src.float()) for i, (src, _) in first.items())
    engine.step()
    assert not any(flag for _, flag in micro_batch(x1, y1).values())
    engine.step()   # the boundary: update, then every buffer cleared
    engine.wait_for_update()
    touched, hidden = next(engine.module.stack[3].parameters()), next(engine.module.stack[4].parameters())
    touched.grad.add_(1.0)
    if not as_landed:
        hidden.grad.data.add_(2.0)   # past the version counter: kept only because the counter is not trusted
    third = micro_batch(x2, y2)
    assert {i: f for i, (_, f) in third.items()} == {i: as_landed and i != 3 for i in range(w.num_layers)}
    for i, extra in ((3, 1.0), (4, 0.0 if as_landed else 2.0), (0, 0.0)):
        expected = third[i][0].float().clone()
        slot = w.layer_slots[i][0]
        expected[slot.offset:slot.offset + slot.numel] += extra
        assert torch.equal(w.grad[i], expected)
    engine.destroy()


def test_with_the_norm_not_as_landed_the_step_reads_every_buffer(counted):
    """A write through ``.data`` moves no version counter: only reading the buffers sees it."""
    engine = engine_of(copy_threads=True, accumulation=1, grad_norm_as_landed=False)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    for p in engine.module.stack[2].parameters():
        p.grad.data.mul_(0.0)
    norm = expected_norm(engine)
    counted.clear()
    engine.step()
    assert counted == engine.weights.trainable_numels
    assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-6)
    engine.destroy()


def test_the_key_is_a_flag():
    from lazytrain.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=r"^config key 'lazytrain.grad_norm_as_landed' must be true or false, "
                                          r"got 'no'$"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "lazytrain": {"grad_norm_as_landed": "no"}})


def test_a_host_gradient_outside_the_layers_is_summed_as_accurately_as_a_layers():
    """The embedding's or head's gradient on the host (a GPU's default) counts in the norm as a layer's buffer
    does: fp32 rows summed in fp64. torch's CPU norm accumulates a large tensor in fp32 and comes out low (at
    16M elements by 1.3e-3 with torch 2.13: BENCHMARKS.md), a norm a GPU would not have clipped by."""
    import torch
    from lazytrain.engine.engine import _global_square_sum
    g = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0))
    exact = float(g.double().square().sum())
    assert _global_square_sum([g.view(4096, -1)]) == pytest.approx(exact, rel=1e-7)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
    assert _global_square_sum([sparse]) == 18.0   # index 0 twice: (1 + 2)^2, then 3^2
