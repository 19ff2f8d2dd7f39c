"""Asynchrony exercised on the CPU: with ``lazytrain.testing.copy_threads`` every transfer between what
stands for device memory and host memory runs on a copy thread, as on a CUDA stream, and with a chaos
seed every transfer, NVMe request and layer update is delayed at random. Whatever the delays, training
must be bit-for-bit what it is without them: an ordering bug (a copy landing in a buffer still in use, an
update rewriting weights a copy still reads) shows up here as a difference."""
import copy
import re
import warnings

import pytest
import torch

import lazytrain
from lazytrain.tiers import streams
from lazytrain.tiers.base import completion_reached
from engine_models import AUTO_DEVICE, add_lora, batches, lm_loss, make_model, max_rel_diff, reference_train
from test_internals_offload import SPLIT

SEEDS = (1, 2, 3)
NVME_AIO = {"block_size": 4096, "queue_depth": 1, "intra_op_parallelism": 4}   # several requests per layer


def config(case: dict, tmp_path, testing: dict | None) -> dict:
    section = {k: v for k, v in case.items() if not k.startswith("_")}
    if "nvme" in (section.get("weights_home"), section.get("boundary_home")):
        tmp_path.mkdir(parents=True, exist_ok=True)
        section["nvme_path"] = str(tmp_path)
    if "_plan" in case:
        tmp_path.mkdir(parents=True, exist_ok=True)
        section.update(policy="plan", plan=str(tmp_path / "plan.json"))
        case["_plan"].to_json(section["plan"])
    if testing:
        section["testing"] = testing
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "aio": NVME_AIO, "lazytrain": section}
    if case.get("_bf16"):
        cfg["bf16"] = {"enabled": True}
    if case.get("_gas"):
        cfg["gradient_accumulation_steps"] = case["_gas"]
    return cfg


def run(model, case: dict, tmp_path, testing: dict | None):
    """A few steps with what scripts do between them: an evaluation forward under grad that is never
    differentiated, one under no_grad, and a backward through torch.autograd.grad that sends no weight
    gradient (on its own step, so the update follows a backward that sent none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=copy.deepcopy(model), config=config(case, tmp_path, testing))
    emb = engine.module.get_input_embeddings().weight
    data = batches(4 * case.get("_gas", 1))
    for n, (x, y) in enumerate(data):
        if case.get("_eval") == "grad":
            engine(x)
        elif case.get("_eval") == "no_grad":
            with torch.no_grad():
                engine(x)
        if case.get("_autograd_grad") and n == 1:
            g, = torch.autograd.grad(lm_loss(engine(x), y), [emb])
            assert torch.isfinite(g).all()
            engine.step()   # a step after a backward that sent no weight gradient
            continue
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.wait_for_update()
    params = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    engine.destroy()
    return params, engine


CASES = {
    "every-2-hbm": dict(checkpoint_interval=2),
    "every-3-host-boundaries": dict(checkpoint_interval=3, boundary_home="host", _eval="grad"),
    "every-2-nvme-boundaries": dict(checkpoint_interval=2, boundary_home="nvme", _eval="no_grad"),
    "keep-all-host": dict(policy="keep_all", boundary_home="host", _autograd_grad=True),
    "nvme-weights": dict(checkpoint_interval=2, weights_home="nvme", _eval="grad"),
    "nvme-weights-overlap": dict(checkpoint_interval=2, weights_home="nvme", overlap_optimizer=True,
                                 _eval="grad", _autograd_grad=True),
    "overlap-host-weights": dict(checkpoint_interval=2, overlap_optimizer=True, _eval="grad"),
    "overlap-graph-tail": dict(checkpoint_interval=3, last_segment_graph=True, overlap_optimizer=True,
                               _eval="no_grad", _autograd_grad=True),
    "resident-weights": dict(weights_home="hbm", overlap_optimizer=True, _eval="grad", _autograd_grad=True),
    "bf16-overlap": dict(checkpoint_interval=2, overlap_optimizer=True, _bf16=True, _eval="grad"),
    "bf16-nvme": dict(checkpoint_interval=2, weights_home="nvme", _bf16=True, _autograd_grad=True),
    "gas2-overlap": dict(checkpoint_interval=2, overlap_optimizer=True, _gas=2, _eval="grad"),
    "no-prefetch": dict(checkpoint_interval=2, prefetch=False, _eval="grad"),
    "offload-internals": dict(policy="offload_all", overlap_optimizer=True, _eval="grad", _autograd_grad=True),
    "offload-internals-bf16-gas2": dict(policy="offload_all", weights_home="nvme", _bf16=True, _gas=2,
                                        _eval="no_grad"),
    # internals' copies split over windows (tests/test_internals_offload.py: SPLIT), evaluations between steps
    "offload-internals-split": dict(_plan=SPLIT, overlap_optimizer=True, _eval="grad", _autograd_grad=True),
    # a LoRA run: frozen block weights kept in the bf16 compute copies alone, adapters' gradients alone sent
    "lora-bf16-overlap-gas2": dict(checkpoint_interval=2, overlap_optimizer=True, _bf16=True, _gas=2, _lora=True,
                                   _eval="grad"),
    "lora-bf16-resident": dict(weights_home="hbm", overlap_optimizer=True, _bf16=True, _lora=True, _eval="no_grad"),
    # ... with the weights on NVMe: the frozen part kept apart in bf16, each layer's file written from both
    "lora-bf16-nvme-overlap": dict(checkpoint_interval=2, weights_home="nvme", overlap_optimizer=True, _bf16=True,
                                   _lora=True, _eval="grad"),
    # a run that trains the top blocks alone: the frozen ones below are never differentiated
    "frozen-bottom-overlap": dict(checkpoint_interval=1, boundary_home="host", overlap_optimizer=True,
                                  _freeze_below=3, _eval="grad"),
    "user-tier-boundaries": dict(checkpoint_interval=2, boundary_home="dict", _eval="grad", _autograd_grad=True,
                                 tiers=[{"name": "dict", "class": "engine_models:DictTier"}]),
}


@pytest.fixture(autouse=True)
def _calm_transfers_after():
    yield
    streams.configure()   # later tests run with transfers as configured by default


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_transfer_delays_change_nothing(case, tmp_path):
    model = make_model("llama")
    if CASES[case].get("_lora"):
        model = add_lora(model, ("q_proj", "v_proj"))
    if CASES[case].get("_freeze_below"):
        model.get_input_embeddings().requires_grad_(False)
        for block in model.model.layers[:CASES[case]["_freeze_below"]]:
            block.requires_grad_(False)
    calm, calm_engine = run(model, CASES[case], tmp_path / "calm", None)
    threaded, engine = run(model, CASES[case], tmp_path / "threads", {"copy_threads": True})
    assert not engine.weights.zero_copy   # the CPU took the GPU's path: every layer copied into slots
    for seed in SEEDS:
        chaotic, _ = run(model, CASES[case], tmp_path / f"chaos{seed}",
                         {"copy_threads": True, "chaos_seed": seed, "chaos_max_delay_ms": 1.0})
        for name in calm:
            assert torch.equal(chaotic[name], calm[name]), (seed, name)
    for name in calm:
        assert torch.equal(threaded[name], calm[name]), name


def test_copy_threads_train_like_pytorch():
    """The threaded path itself against plain PyTorch (fp32, within 1e-5)."""
    model = make_model("llama")
    data = batches(4)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    cfg = config(dict(checkpoint_interval=2), None, {"copy_threads": True, "chaos_seed": 7})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=cfg)
    for x, y in data:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, ref) < 1e-5
    engine.destroy()


def test_testing_section_warns_that_it_is_for_tests():
    cfg = config(dict(), None, {"chaos_seed": 1})
    with pytest.warns(UserWarning, match=r"'lazytrain.testing' is a setting for tests and benchmarks"):
        engine, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=cfg)
    engine.destroy()


def test_an_engines_testing_settings_end_with_its_destroy():
    """They are the process's (the copy paths read them), from an engine's initialize to its destroy(); then
    the newest live engine's are in force again, else what streams.configure() set."""
    from lazytrain.tiers import streams
    before = streams.settings()
    chaos = {"copy_threads": True, "chaos_seed": 1, "chaos_max_delay_ms": 5.0,
             "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=config(dict(), None, chaos))
        now = streams.settings()
        assert now.copy_threads and now.chaos.seed == 1 and sorted(now.links) == ["d2h", "h2d"]
        b, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=config(dict(), None, {"copy_threads": True}))
        assert streams.settings().chaos is None
        b.destroy()   # a's again, a alive
        assert streams.settings() is now
        c, _, _, _ = lazytrain.initialize(model=make_model("llama"), config=config(dict(), None, None))
        a.destroy()   # c's stay
        assert not streams.settings().copy_threads and streams.settings().chaos is None
        c.destroy()
    assert streams.settings() is before


@pytest.mark.parametrize("testing, message", [
    ({"chaos_seed": "1"}, "'lazytrain.testing.chaos_seed' must be an integer, got '1'"),
    ({"chaos_max_delay_ms": -1}, "'lazytrain.testing.chaos_max_delay_ms' must be a number of milliseconds in "
                                 "[0, 1000], got -1"),
    ({"copy_threads": 1}, "'lazytrain.testing.copy_threads' must be true or false, got 1"),
    ({"chaos_max_delay_ms": 5}, "'lazytrain.testing.chaos_max_delay_ms' needs 'lazytrain.testing.chaos_seed' (a test "
                                "setting: the seed turns the random delays on)"),
    ({"chaos": 1}, "chaos"),
])
def test_bad_testing_settings_are_named(testing, message):
    from lazytrain.config import ConfigError
    with pytest.raises(ConfigError, match=re.escape(message)):
        lazytrain.initialize(model=make_model("llama"), config=config(dict(), None, testing))


@pytest.mark.parametrize("seed", SEEDS)
def test_an_abandoned_prefetch_never_lands_in_a_slot_in_use(seed, tmp_path):
    """The case that once trained on wrong weights without a word: weights on NVMe read by several I/O
    threads, an evaluation forward under grad that is never differentiated (its backward's first prefetch
    is abandoned), then training. Against plain PyTorch, with every NVMe request delayed at random."""
    model = make_model("modulelist")
    data = batches(4)
    ref = reference_train(model, data, device=AUTO_DEVICE)
    case = dict(checkpoint_interval=2, weights_home="nvme")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=config(case, tmp_path, {"chaos_seed": seed}))
    for x, y in data:
        engine(x)   # evaluation under grad, never differentiated
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    assert max_rel_diff(engine.module, ref) < 1e-5
    engine.destroy()


def test_load_state_dict_waits_for_copies_reading_the_weights_it_rewrites(tmp_path):
    """fp32 weights on the host: the streamed copy is the master itself, which load_state_dict writes in
    place. A prefetch still reading it (backward's first layer, after a forward) must be done first."""
    model = make_model("llama")
    case = dict(checkpoint_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = lazytrain.initialize(model=model, config=config(
            case, tmp_path, {"copy_threads": True, "chaos_seed": 5, "chaos_max_delay_ms": 20.0}))
    x, _ = batches(1)[0]
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    in_flight_at_write = []
    layers = engine.module.model.layers

    def check(*_):   # runs after the engine's own pre-hook, before any value of the block is written
        # a read's completion: a Future or a host event on the CPU, a CUDA event (query(), no done()) on CUDA
        in_flight_at_write.append([d for reads in engine.stream._reads.values() for d in reads
                                   if not completion_reached(d)])
    hook = layers[5].register_load_state_dict_pre_hook(check)
    engine(x)   # a forward whose backward never comes: backward's first prefetch (layer 5) is in flight
    assert engine.stream._reads.get(5), "the test needs a copy of layer 5 issued"
    engine.module.load_state_dict(state)
    hook.remove()
    assert in_flight_at_write == [[]]
    engine.destroy()


def test_a_users_tier_is_read_on_a_copy_thread_of_its_own():
    import threading
    from engine_models import DictTier

    class Recording(DictTier):
        def _read(self, key, out, device):
            self.reader = threading.current_thread().name
            return super()._read(key, out, device)

    tier = Recording("mine")
    x = torch.arange(6.0)
    streams.configure(copy_threads=True, chaos=streams.Chaos(seed=0, max_delay_s=0.01))
    tier.write("x", x).wait()
    gate = threading.Event()
    streams.host_stream("tier-mine").submit(gate.wait)     # the tier's copy thread is busy
    handle = tier.read("x")
    assert not handle.done()                                 # issued, not run: the caller goes on
    gate.set()
    assert torch.equal(handle.wait(), x)
    assert tier.reader.startswith("lazytrain-copy-tier-mine")
    streams.configure()
    tier.read("x").wait()
    assert tier.reader == threading.current_thread().name   # calm: read where it is asked


def _engine(section: dict, testing: dict, tmp_path=None, model=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lazytrain.initialize(model=model if model is not None else make_model("llama"),
                                    config=config(section, tmp_path, testing))[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_block_grads_read_after_backward_are_the_whole_backwards(seed):
    """The gradients land on the sink's worker thread; .grad read when backward returned (to log a norm,
    to clip by hand) held part of them, and after destroy() they went on changing."""
    model = make_model("llama")
    x, y = batches(1)[0]
    ref = copy.deepcopy(model).to(AUTO_DEVICE)   # on a GPU: the same kernels as the engine's
    lm_loss(ref(x.to(AUTO_DEVICE)), y.to(AUTO_DEVICE)).backward()
    expect = {k: p.grad.cpu() for k, p in ref.named_parameters() if "layers" in k}
    engine = _engine(dict(checkpoint_interval=2), {"copy_threads": True, "chaos_seed": seed,
                                                   "chaos_max_delay_ms": 10.0})
    lm_loss(engine(x), y).backward()   # the direct backward: no engine call after it
    got = {k: p.grad.clone() for k, p in engine.module.named_parameters() if "layers" in k}
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], rtol=1e-5, atol=1e-7)
    engine.backward(lm_loss(engine(x), y))
    engine.destroy()
    handed_back = {k: p.grad.clone() for k, p in engine.module.named_parameters() if "layers" in k}
    for k in expect:
        torch.testing.assert_close(handed_back[k], 2 * expect[k], rtol=1e-5, atol=1e-7)
    assert engine.weights._grad_sink is None   # its thread stopped with destroy


@pytest.mark.parametrize("section", [dict(checkpoint_interval=2), dict(checkpoint_interval=2, overlap_optimizer=True)],
                         ids=["serial", "overlap"])
def test_an_interrupt_during_the_update_leaves_the_engine_refusing_to_go_on(section):
    """Ctrl-C landing in an optimizer step hook cut the update short with no mark: the next steps trained
    on weights of which some held the update and some did not (0.6-0.8 from PyTorch)."""
    engine = _engine(section, {"copy_threads": True, "chaos_seed": 1})

    def interrupt(*_):
        raise KeyboardInterrupt

    engine.optimizer.register_step_post_hook(interrupt)
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    with pytest.raises(lazytrain.StepFailedError, match=r"a training forward refused: step 1 failed during the "
                                                        r"optimizer update \(KeyboardInterrupt: \)"):
        engine(x)
    engine.destroy()


@pytest.mark.parametrize("section", [dict(checkpoint_interval=2), dict(checkpoint_interval=2, overlap_optimizer=True),
                                     dict(policy="keep_all", last_segment_graph=True),
                                     dict(checkpoint_interval=2, _bf16=True)],
                         ids=["every-2", "overlap", "graph", "bf16"])
def test_a_forward_taken_before_a_step_is_not_differentiated_after_it(section):
    """PyTorch refuses it (a variable needed for the gradient was modified in place); the engine re-ran the
    blocks with the new weights against boundaries the old ones made, and gave wrong gradients silently.
    The step writes the head and the final norm in place on every device (a copy from an fp32 master, or the
    host optimizer's own write, counted as an in-place op), so PyTorch's own check fires first, at the head;
    with those two frozen, the engine's, at the last block."""
    for head_trained in (True, False):
        model = make_model("llama")
        if not head_trained:
            model.lm_head.requires_grad_(False)
            model.model.norm.requires_grad_(False)
        engine = _engine(section, {"copy_threads": True}, model=model)
        (x1, y1), (x2, y2) = batches(2)
        first, second = lm_loss(engine(x1), y1), lm_loss(engine(x2), y2)
        engine.backward(first)
        engine.step()
        if head_trained:
            refusal = (RuntimeError, r"one of the variables needed for gradient computation has been modified by "
                                     r"an inplace operation")
        else:
            refusal = (lazytrain.engine.executor.ExecutorError,
                       r"block 5's weights changed \(an optimizer step or a load\) between this forward and its "
                       r"backward")
        with pytest.raises(refusal[0], match=refusal[1]):
            engine.backward(second)
        engine.zero_grad()
        engine.backward(lm_loss(engine(x2), y2))   # a forward taken again is
        engine.step()
        engine.destroy()


def test_an_interrupt_of_the_wait_for_the_gradients_propagates_and_leaves_the_add_pending(monkeypatch):
    """Ctrl-C while backward's end waits for the gradient adds was stored as a failed copy (backward
    returned as if nothing happened), and the add it was waiting for left the queue: a zero_grad then
    no longer waited for it, and it landed after the zeroing."""
    import collections
    from concurrent.futures import Future
    from lazytrain.engine import weights as weights_module
    sink = object.__new__(weights_module._GradientSink)
    sink.pending, sink.failure = collections.deque([Future()]), None
    waited = []

    def interrupted(fs):
        waited.append(fs)
        raise KeyboardInterrupt

    monkeypatch.setattr(weights_module, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sink.settle()
    assert len(sink.pending) == 1 and sink.failure is None and waited
    monkeypatch.undo()
    failed = RuntimeError("copy failed")
    sink.pending[0].set_exception(failed)
    sink.settle()   # a failure to land is kept for the step's flush
    assert not sink.pending and sink.failure is failed


@pytest.mark.parametrize("trained", ["embedding, norm and head", "embedding"])
def test_with_frozen_blocks_a_forward_from_before_a_step_is_differentiated_as_pytorch_does(trained):
    """A step that cannot change the blocks (every block frozen: prompt tuning) does not make the forwards
    before it stale by itself: the second forward's backward after the step goes as plain PyTorch's (its
    default AdamW, in place) on the same device goes. With the final norm and head trained the step changed
    weights that backward uses: autograd refuses it, in both, on every device (the engine counts its in-place
    writes as PyTorch's in-place steps do); with only the embedding trained (its backward uses no weight) it
    trains on."""
    model = make_model("llama")
    for layer in model.model.layers:
        layer.requires_grad_(False)
    if trained == "embedding":
        model.lm_head.requires_grad_(False)
        model.model.norm.requires_grad_(False)
    (x1, y1), (x2, y2) = batches(2)
    ref = copy.deepcopy(model).to(AUTO_DEVICE)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    first, second = lm_loss(ref(x1.to(AUTO_DEVICE)), y1), lm_loss(ref(x2.to(AUTO_DEVICE)), y2)
    first.backward()
    opt.step()
    try:
        second.backward()
        refused = None
    except RuntimeError as e:
        refused = e
    engine = _engine(dict(checkpoint_interval=2), {"copy_threads": True}, model=model)
    first, second = lm_loss(engine(x1), y1), lm_loss(engine(x2), y2)
    engine.backward(first)
    engine.step()
    assert (refused is None) == (trained == "embedding")
    if refused is None:
        engine.backward(second)
        engine.step()
        assert engine.global_steps == 2
    else:
        assert "modified by an inplace operation" in str(refused)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.backward(second)
    engine.destroy()
