"""Non-block gradients reach their host fp32 masters beside the backward (precision.MasterGradSink): the
autograd hook returns before the copy lands, pieces land in order and add up exactly, readers wait, and a
failed copy leaves the gradient missing, not half written."""
import threading

import pytest
import torch
import torch.nn as nn

from lazytrain.engine import precision
from lazytrain.engine.precision import Masters, MasterGradSink
from lazytrain.tiers import streams


@pytest.fixture
def copy_threads():
    """The CPU standing in for a device: gradients cross an emulated device-to-host link on a copy thread."""
    streams.configure(copy_threads=True)
    yield
    streams.configure()


@pytest.fixture
def gated(monkeypatch):
    """Every gradient copy waits until the test opens the gate."""
    gate = threading.Event()
    real = precision.async_copy

    def held(*args, **kwargs):
        assert gate.wait(30), "the gate was never opened"
        return real(*args, **kwargs)
    monkeypatch.setattr(precision, "async_copy", held)
    return gate


def _bf16_grads(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_the_hook_returns_before_the_copy_lands_and_readers_wait(copy_threads, gated, monkeypatch):
    monkeypatch.setattr(MasterGradSink, "CHUNK", 7)   # several pieces a gradient, the last one short
    head = nn.Linear(5, 9, bias=False)
    masters = Masters([head.weight], torch.bfloat16)
    assert masters.sink is not None
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    head(x).float().sum().backward()
    master = masters.master_of(head.weight)
    assert head.weight.grad is None and master.grad is None   # handed over, not landed: backward went on
    gated.set()
    grads = masters.master_grads()                           # waits for it
    expected = torch.ones(3, 9, dtype=torch.bfloat16).T @ x
    assert grads[0].dtype == torch.float32 and torch.equal(grads[0], expected.float())


def test_micro_batches_accumulate_in_fp32_in_order(copy_threads, monkeypatch):
    monkeypatch.setattr(MasterGradSink, "CHUNK", 5)
    streams.configure(copy_threads=True, chaos=streams.Chaos(seed=3, max_delay_s=0.002))
    master = nn.Parameter(torch.zeros(4, 6))
    sink = MasterGradSink(torch.bfloat16, max_bytes=4 * 6 * 2)
    parts = [_bf16_grads(seed, (4, 6)) for seed in range(6)]
    for g in parts:
        sink.submit(master, g)
    sink.flush()
    expected = parts[0].float()
    for g in parts[1:]:
        expected = expected + g.float()
    assert torch.equal(master.grad, expected)
    sink.close()


def _failing_on(monkeypatch, bad_calls: set) -> list:
    """Copies that fail on the given calls (counted from 1), the others done at once."""
    calls = []

    def copy(dst, src, **kwargs):
        calls.append(src.numel())
        if len(calls) in bad_calls:
            raise RuntimeError(f"link down #{len(calls)}")
        dst.copy_(src)
        return _Done()
    monkeypatch.setattr(precision, "async_copy", copy)
    return calls


def test_a_failed_first_copy_leaves_the_gradient_missing(copy_threads, monkeypatch):
    monkeypatch.setattr(MasterGradSink, "CHUNK", 4)
    calls = _failing_on(monkeypatch, {2})
    master = nn.Parameter(torch.zeros(10))
    sink = MasterGradSink(torch.bfloat16, max_bytes=20)
    sink.submit(master, torch.ones(10, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="missing or partly added: call zero_grad"):
        sink.flush()
    assert master.grad is None and calls == [4, 4]
    sink.close()


def test_a_gradient_partly_added_keeps_every_flush_failing_until_zero_grad(copy_threads, monkeypatch):
    """The second micro-batch's copy fails on its third piece: its first pieces were added. No step may read
    that sum: each flush raises, until zero_grad drops the gradients."""
    monkeypatch.setattr(MasterGradSink, "CHUNK", 4)
    calls = _failing_on(monkeypatch, {6})
    p = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    masters = Masters([p], torch.bfloat16)
    for _ in range(2):
        p.float().sum().backward()   # the hook does not raise the failure: the backward goes on
    for _ in range(2):
        with pytest.raises(RuntimeError, match="link down #6"):
            masters.flush_grads()
    with pytest.raises(RuntimeError, match="link down #6"):
        masters.master_grads()
    masters.zero_grad()
    assert masters.master_of(p).grad is None
    masters.flush_grads()            # nothing failed since
    p.float().sum().backward()
    assert torch.equal(masters.master_grads()[0], torch.ones(10)) and len(calls) == 9


def test_zero_grad_clears_after_several_failed_copies(copy_threads, monkeypatch):
    _failing_on(monkeypatch, {1, 2})   # the link is down for both parameters' copies
    a, b = (nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2))
    masters = Masters([a, b], torch.bfloat16)
    (a.float().sum() + b.float().sum()).backward()
    with pytest.raises(RuntimeError, match="link down #1"):
        masters.flush_grads()
    masters.zero_grad()               # the recovery the error advises
    assert all(m.grad is None for m in masters.master_params()) and not masters.sink.pending


def test_at_most_one_micro_batch_of_gradients_waits(copy_threads, gated):
    """Device gradients waiting for the link are memory: a backward past one micro-batch's worth waits."""
    p = nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    masters = Masters([p], torch.bfloat16)
    assert masters.sink.max_bytes == 2000
    (p.float() * 2).sum().backward()
    assert len(masters.sink.pending) == 1
    second = threading.Thread(target=lambda: (p.float() * 3).sum().backward())
    second.start()
    second.join(0.2)
    assert second.is_alive()          # held until the first one lands
    gated.set()
    second.join(30)
    assert not second.is_alive()
    assert torch.equal(masters.master_grads()[0], torch.full((1000,), 5.0))


def _bf16_engine(gas: int, seed: int | None = None, stage: int = 0):
    import warnings

    import lazytrain
    from engine_models import make_model
    testing = {"copy_threads": True}
    if seed is not None:
        testing.update(chaos_seed=seed, chaos_max_delay_ms=10)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 9,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage}, "lazytrain": {"testing": testing}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=make_model("llama"), config=cfg)[:2]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_grad_after_a_step_that_failed_before_its_update_drops_the_gradients_at_every_stage(stage):
    """A step that fails before the update (here landing the gradients) says to call zero_grad() and redo the
    micro-batches: the redone step applies the redone gradients alone, at ZeRO stage 2 and 3 too, where
    zero_grad() otherwise keeps what was accumulated."""
    import warnings

    import lazytrain
    from engine_models import batches, lm_loss, make_model, max_rel_diff
    models = []
    for fail in (False, True):
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = lazytrain.initialize(model=make_model("modulelist"), config=cfg)[0]
        flush, calls = engine.weights.flush_grads, []

        def failing_once(discard=False):   # the step's landing of the gradients (not zero_grad's discard)
            calls.extend([] if discard else [1])
            if fail and not discard and len(calls) == 1:
                raise OSError("attaching failed")
            return flush(discard)
        engine.weights.flush_grads = failing_once
        failures = 0
        for x, y in batches(2):
            for _ in range(2):
                engine.backward(lm_loss(engine(x), y))
                try:
                    engine.step()
                    break
                except lazytrain.StepFailedError as e:
                    assert "call zero_grad() and redo the step's micro-batches" in str(e)
                    failures += 1
                    engine.zero_grad()
        engine.wait_for_update()
        assert failures == fail
        models.append(engine.module)
    assert max_rel_diff(models[1], models[0]) == 0


def test_at_zero_stage_2_a_failed_copy_is_not_swallowed_by_zero_grad(monkeypatch):
    """DeepSpeed's stage-2 loop (backward; step; zero_grad every micro-batch, accumulation 2) with a layer's
    gradient copy failing in the first micro-batch: zero_grad() keeps the accumulation and its failure, so the
    boundary step refuses it, nothing updated (it went through on the second micro-batch alone before); the
    next zero_grad() drops it and training goes on."""
    import warnings

    import lazytrain
    from engine_models import batches, fail_gradient_copy, lm_loss, make_model
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2},
           "lazytrain": {"testing": {"copy_threads": True}}}
    model = make_model("modulelist")
    before = make_model("modulelist")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = lazytrain.initialize(model=model, config=cfg)[0]
    fail_gradient_copy(monkeypatch, 1)
    (x0, y0), (x1, y1) = batches(2)
    engine.backward(lm_loss(engine(x0), y0))
    engine.step()
    engine.zero_grad()
    engine.backward(lm_loss(engine(x1), y1))
    with pytest.raises(lazytrain.StepFailedError, match=r"OSError: a gradient copy failed"):
        engine.step()
    assert engine.global_steps == 0
    got, want = engine.module_state_dict(), before.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)   # nothing updated
    engine.zero_grad()   # the error's advice: now the accumulation goes, and the step's micro-batches again
    for x, y in ((x0, y0), (x1, y1)):
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 1
    engine.destroy()


def test_a_step_retried_after_a_failure_leaves_zero_grad_keeping_the_next_accumulation():
    """A step that failed before its update and then went through when called again (the error allows it): the
    next accumulation's zero_grad() at stage 2 keeps it, with the update overlapped as without."""
    import warnings

    import lazytrain
    from engine_models import batches, lm_loss, make_model, max_rel_diff
    for overlap in (False, True):
        models = []
        for fail in (False, True):
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2},
                   "lazytrain": {"overlap_optimizer": overlap}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = lazytrain.initialize(model=make_model("modulelist"), config=cfg)[0]
            flush, calls = engine.weights.flush_grads, []

            def failing_once(discard=False):   # the step's landing of the gradients (not zero_grad's discard)
                if not discard:
                    calls.append(1)
                    if fail and len(calls) == 1:
                        raise OSError("attaching failed once")
                return flush(discard)
            engine.weights.flush_grads = failing_once
            for n, (x, y) in enumerate(batches(4)):
                engine.backward(lm_loss(engine(x), y))
                if n == 2:
                    engine.zero_grad()   # mid-accumulation: kept at stage 2
                try:
                    engine.step()
                except lazytrain.StepFailedError:
                    engine.step()        # nothing was lost: called again
            engine.wait_for_update()
            models.append(engine.module)
        assert max_rel_diff(models[1], models[0]) == 0, overlap


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_zero_grad_each_micro_batch_keeps_the_accumulation_from_zero_stage_2_as_deepspeed(copy_threads,
                                                                                                 stage):
    """DeepSpeed's engine.zero_grad() clears the parameters' .grad: at stages 0 and 1 that is the accumulated
    gradient, at 2 and 3 it is not (the partitions keep it). A loop calling ``engine.step(); engine.zero_grad()``
    every micro-batch with accumulation 2 trains as one that does not from stage 2, and on the second
    micro-batch alone (its gradient divided by 2) below it, as under DeepSpeed."""
    from engine_models import batches, lm_loss
    weights = []
    for calls in (False, True):
        engine, _ = _bf16_engine(gas=2, seed=5, stage=stage)
        for x, y in batches(4):
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            if calls:
                engine.zero_grad()
        weights.append(engine.module_state_dict())
        engine.destroy()
    same = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert same == (stage >= 2)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_optimizers_zero_grad_keeps_the_steps_accumulation_as_zero_optimizers_do(copy_threads, set_to_none):
    """A loop that calls optimizer.zero_grad() before each micro-batch, with the accumulation in the config,
    trains as one that does not (as under DeepSpeed's ZeRO optimizers, whose zero_grad clears the
    parameters' .grad and not the partitions they accumulate): every layer's and the embedding's and head's
    gradients of both micro-batches reach the step, whatever copies are still landing."""
    from engine_models import batches, lm_loss
    weights = []
    for calls in (False, True):
        engine, optimizer = _bf16_engine(gas=2, seed=5)
        for x, y in batches(4):
            if calls:
                optimizer.zero_grad(set_to_none=set_to_none)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        weights.append(engine.module_state_dict())
        engine.destroy()
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


def test_the_optimizers_zero_grad_clears_a_tensor_the_engine_does_not_accumulate(copy_threads):
    from engine_models import batches, lm_loss
    engine, optimizer = _bf16_engine(gas=1)
    temperature = nn.Parameter(torch.ones(()))
    optimizer.add_param_group({"params": [temperature]})
    (x, y), = batches(1)
    engine.backward(lm_loss(engine(x), y) * temperature)
    assert temperature.grad is not None
    optimizer.zero_grad()
    assert temperature.grad is None
    engine.destroy()


def test_an_embedding_is_counted_as_sent_last_in_a_model_of_ones_own(copy_threads):
    """The profile's split for a model with no get_input_embeddings: its nn.Embedding's gradient (32 x 32 in
    bf16) is the one the backward finishes last; the head's weight and bias and the rest go beside."""
    import warnings

    import lazytrain
    from engine_models import VOCAB, make_model
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "lazytrain": {"testing": {"copy_threads": True}}}
    model = make_model("modulelist")
    assert not hasattr(model, "get_input_embeddings")
    others = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("stack.", "emb.")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    assert engine._grads_beside_bytes() == (others * 2, VOCAB * 32 * 2)
    engine.destroy()


class _Done:
    def synchronize(self) -> None:
        pass


def test_zero_grad_waits_for_copies_in_flight(copy_threads, gated):
    """A copy that landed after the zeroing would leak one step's gradient into the next."""
    emb = nn.Embedding(6, 4)
    emb.weight.data = emb.weight.data.to(torch.bfloat16)
    masters = Masters([emb.weight], torch.bfloat16)
    emb(torch.tensor([1, 2, 2])).float().sum().backward()
    threading.Timer(0.05, gated.set).start()
    masters.zero_grad()
    masters.sink.pool.submit(lambda: None).result()          # whatever the worker still had, it has done
    assert all(m.grad is None for m in masters.master_params())
    assert not masters.sink.pending


def test_a_master_on_the_same_cpu_without_copy_threads_is_added_at_once():
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    masters = Masters([p], torch.bfloat16)
    assert masters.sink is None
    (p.float() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(masters.master_of(p).grad, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_gradients_reach_host_masters_beside_the_backward(gated, monkeypatch):
    """On CUDA: the copy runs on the device-to-host stream after the event the hook recorded, through
    pinned staging, in pieces; the backward is not held up, and the master's gradient is the sum, in fp32,
    of the micro-batches' bf16 gradients."""
    monkeypatch.setattr(MasterGradSink, "CHUNK", 1000)
    head = nn.Linear(64, 300, bias=False).cuda().to(torch.bfloat16)
    ref = nn.Linear(64, 300, bias=False).cuda().to(torch.bfloat16)
    ref.load_state_dict(head.state_dict())
    masters = Masters([head.weight], torch.bfloat16, home=torch.device("cpu"))
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    head(x).float().square().sum().backward()
    assert masters.master_of(head.weight).grad is None   # held at the gate: the backward went on
    gated.set()
    head(x).float().square().sum().backward()
    g, = torch.autograd.grad(ref(x).float().square().sum(), [ref.weight])
    got = masters.master_grads()[0]
    assert got.device.type == "cpu" and got.dtype == torch.float32 and masters.sink._staging[0].is_pinned()
    torch.testing.assert_close(got, 2 * g.float().cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_weights_go_down_in_pieces_through_two_staging_buffers(copy_threads, seed):
    """The pieces' order with copies that finish late (the CPU's copy thread, random delays): a staging
    buffer is refilled only once the copy that read it is done."""
    from lazytrain.engine.precision import _to_device_through_staging
    streams.configure(copy_threads=True, chaos=streams.Chaos(seed=seed, max_delay_s=0.003))
    src = torch.randn(1003, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(1003, dtype=torch.bfloat16)
    _to_device_through_staging(dst, src, [torch.empty(100, dtype=torch.bfloat16) for _ in range(2)])
    assert torch.equal(dst, src.to(torch.bfloat16))


def test_a_piece_that_fails_leaves_no_copy_reading_the_staging(copy_threads, monkeypatch):
    from lazytrain.engine.precision import _to_device_through_staging
    streams.configure(copy_threads=True, chaos=streams.Chaos(seed=1, max_delay_s=0.05))
    real, calls = precision.async_copy, []

    def third_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("link down")
        return real(*args, **kwargs)
    monkeypatch.setattr(precision, "async_copy", third_fails)
    src, dst = torch.randn(500), torch.zeros(500, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="link down"):
        _to_device_through_staging(dst, src, [torch.empty(100, dtype=torch.bfloat16) for _ in range(2)])
    assert torch.equal(dst[:200], src[:200].to(torch.bfloat16)) and not dst[200:].any()   # both copies done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_weights_reach_the_device_through_pinned_staging_in_the_compute_dtype(monkeypatch):
    """After the update, each host fp32 master is converted on the host and its compute-dtype bytes copied,
    piece by piece through pinned staging: the device copy is the master rounded to bf16, exactly."""
    monkeypatch.setattr(MasterGradSink, "CHUNK", 1000)
    emb = nn.Embedding(300, 16).cuda()
    masters = Masters([emb.weight], torch.bfloat16, home=torch.device("cpu"))
    master = masters.master_of(emb.weight)
    with torch.no_grad():
        master.normal_()
    version = emb.weight._version
    masters.masters_to_params()
    assert emb.weight._version > version   # an in-place change for autograd, as copy_ is
    assert emb.weight.dtype == torch.bfloat16 and masters._staging[torch.bfloat16][0].is_pinned()
    assert torch.equal(emb.weight.cpu(), master.to(torch.bfloat16))


def test_the_next_steps_first_gradient_lands_in_the_last_ones_memory(copy_threads, monkeypatch):
    """zero_grad drops the masters' gradients (None: a parameter with no gradient in a step is skipped, as in
    plain PyTorch), and the next first landing reuses their memory instead of allocating and page-faulting a
    fresh embedding-sized tensor every step; the values are the new gradient's alone."""
    monkeypatch.setattr(MasterGradSink, "CHUNK", 7)
    head = nn.Linear(5, 9, bias=False)
    masters = Masters([head.weight], torch.bfloat16)
    master = masters.master_of(head.weight)
    x1, x2 = torch.randn(3, 5, dtype=torch.bfloat16), 2 * torch.randn(3, 5, dtype=torch.bfloat16)
    head(x1).float().sum().backward()
    first = masters.master_grads()[0]
    memory = first.data_ptr()
    masters.zero_grad()
    assert master.grad is None
    head(x2).float().sum().backward()
    second = masters.master_grads()[0]
    assert second.data_ptr() == memory
    assert torch.equal(second, (torch.ones(3, 9, dtype=torch.bfloat16).T @ x2).float())
    masters.hand_back()


def test_a_master_whose_gradient_goes_elsewhere_keeps_no_dropped_gradient(copy_threads):
    """Partitioned (stage 3) a master's gradient is reduced to its owner, not landed by the sink: zero_grad
    must not keep the dropped one alive for a landing that never comes (a second embedding-sized tensor held
    through every step)."""
    head = nn.Linear(5, 9, bias=False)
    masters = Masters([head.weight], torch.bfloat16)
    master = masters.master_of(head.weight)
    masters.remove_grad_hook(head.weight)
    master.grad = torch.ones(9, 5)
    masters.zero_grad()
    assert master.grad is None and masters.sink._spare == {}
    masters.hand_back()
