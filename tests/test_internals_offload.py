"""Offloaded layers (a Plan's ``offloaded_layers``): a layer's forward records its graph with everything
autograd saves copied to the host tier as it is saved, and backward differentiates it from that graph, with
the saved tensors copied back from the window the Plan names and its weights streamed again, without
re-running it. Training is bit for bit the keep-every-boundary plan's (which re-runs each layer once from
its input) on the CPU's in-place path and over emulated links; the bytes sent are exactly what plain
PyTorch's autograd saves in those layers, minus their weights, and all of it is freed by the layer's
backward or with a forward never differentiated. Random transfer delays: tests/test_engine_chaos.py."""
import dataclasses
import gc
import time

import pytest
import torch

import lazytrain
from lazytrain.config import ConfigError
from lazytrain.engine.internals_offload import OffloadedInternals
from lazytrain.tiers.base import completion_reached
from lazytrain.engine.lean_norms import make_norms_lean
from lazytrain.engine.executor import ExecutorError
from lazytrain.planner.plan import RECOMPUTE, Plan, PlanError, keep_all_plan, offload_all_plan
from lazytrain.tiers import streams
from engine_models import (MLPBlock, ModuleListLM, batches, lm_loss, make_model, max_rel_diff, plan_engine, reference_train,
                           train_and_destroy)

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")
LINKS = {"copy_threads": True, "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}}}
# layers 2 and 5 offloaded, 0-1 and 3-4 re-run from boundaries 0 and 3
MIXED = Plan(num_layers=6, homes=("hbm", RECOMPUTE, RECOMPUTE, "host", RECOMPUTE, RECOMPUTE, "hbm"),
             offloaded_layers=(2, 5), policy="mixed")


@pytest.fixture(autouse=True)
def _calm_transfers_after():
    yield
    streams.configure()


def _lm_of(block_class):
    """A factory of ModuleListLM models whose blocks are ``block_class``, each built from seed 0."""
    class LM(ModuleListLM):
        block = block_class

    def model():
        torch.manual_seed(0)
        return LM()
    return model


def _engine(tmp_path, kind, plan, links, accumulation=1, model=None):
    model = model if model is not None else make_model(kind)
    return plan_engine(tmp_path, model, plan, LINKS if links else None, accumulation)


_train = train_and_destroy


@pytest.mark.parametrize("kind", ["llama", "decoder"])
@pytest.mark.parametrize("links", [False, True], ids=["in-place", "links"])
def test_offloaded_layers_train_bit_for_bit_as_the_plan_that_re_runs_them(tmp_path, kind, links):
    data = batches(4)
    plain = _train(_engine(tmp_path, kind, keep_all_plan(6), links), data)
    for plan in (offload_all_plan(6), MIXED):
        offloaded = _train(_engine(tmp_path, kind, plan, links), data)
        for k, v in plain.items():
            assert torch.equal(offloaded[k], v), (plan.policy, k)
    model = make_model(kind)
    model.load_state_dict(offloaded)
    assert max_rel_diff(model, reference_train(make_model(kind), data)) < 1e-4   # the engine's usual parity


def test_with_gradient_accumulation_and_frozen_layers_as_plain_pytorch(tmp_path):
    """Two micro-batches per step, each forward's internals its own; the first two blocks and the
    embedding frozen, so layer 0's graph has nothing to differentiate and layer 1's only its input's."""
    def frozen():
        m = make_model("llama")
        for p in [*m.model.embed_tokens.parameters(), *m.model.layers[0].parameters(), *m.model.layers[1].parameters()]:
            p.requires_grad_(False)
        return m
    data = batches(4)
    weights = _train(_engine(tmp_path, "llama", MIXED, True, accumulation=2, model=frozen()), data)
    model = frozen()
    model.load_state_dict(weights)
    assert max_rel_diff(model, reference_train(frozen(), data, gas=2)) < 1e-4


def _saved_bytes_per_layer(model, x) -> list[int]:
    """What plain PyTorch's autograd saves in each block of ``model``'s forward, without the tensors that
    are the model's parameters or views of them, each region of memory once (views of the same bytes in
    other shapes, as attention's output and its reshape for the output projection, hold it once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layer, seen, alive, sizes = [None], set(), [], [0] * len(model.model.layers)

    def pack(t):
        if layer[0] is not None and t.untyped_storage().data_ptr() not in params:
            reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), reach, t.dtype)
            if (layer[0], ident) not in seen:
                seen.add((layer[0], ident))
                sizes[layer[0]] += t.numel() * t.element_size()
        alive.append(t)   # nothing freed: no address is reused while counting
        return t

    hooks = []
    for i, block in enumerate(model.model.layers):   # each layer's graph holds its own (rotary cos and sin too)
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: layer.__setitem__(0, i)))
        hooks.append(block.register_forward_hook(lambda m, a, o: layer.__setitem__(0, None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    for h in hooks:
        h.remove()
    return sizes


@pytest.mark.parametrize("links", [False, True], ids=["in-place", "links"])
def test_the_host_gets_what_autograd_saves_without_the_weights_and_frees_it(tmp_path, links):
    engine = _engine(tmp_path, "llama", MIXED, links)
    x, y = batches(1)[0]
    reference = make_model("llama")
    make_norms_lean(reference.model.layers)          # as the engine runs them (lazytrain.lean_norms)
    expected = _saved_bytes_per_layer(reference, x)
    host = engine.tiers["host"]
    base_used, base_written = host.stats()["used_bytes"], host.stats()["bytes_written"]
    boundary_3 = 2 * 12 * 32 * 4                      # the plan keeps boundary 3 on the host too
    loss = lm_loss(engine(x), y)
    want = expected[2] + expected[5] + boundary_3
    deadline = time.monotonic() + 10   # copy-thread writes are counted as each one completes
    while host.stats()["bytes_written"] - base_written < want and time.monotonic() < deadline:
        time.sleep(0.001)
    sent = host.stats()["bytes_written"] - base_written
    assert sent == want
    assert expected[2] > boundary_3                   # more than its input: its internals went too
    engine.backward(loss)
    assert host.stats()["used_bytes"] == base_used    # freed by each layer's backward
    engine(x)                                         # an evaluation forward under grad, never differentiated
    gc.collect()
    assert host.stats()["used_bytes"] == base_used    # freed with its graph
    engine.step()
    engine.destroy()


def test_internals_come_back_in_the_window_the_plan_names(tmp_path):
    """Layer 0's internals read back at window 7 (layer 4's backward), not one window before its own."""
    plan = dataclasses.replace(offload_all_plan(6), internals_prefetch_window={0: 7})
    engine = _engine(tmp_path, "llama", plan, True)
    events = []
    host, executor = engine.tiers["host"], engine.executor
    read, backward_layer = host.read, executor.backward_layer

    def logged_read(key, *a, **kw):
        if ".saved" in key:   # not the weights' reads
            events.append(key.split(".")[1])   # "layer3"
        return read(key, *a, **kw)

    def logged_backward(p, layer, *a, **kw):
        events.append(f"bwd {layer}")
        return backward_layer(p, layer, *a, **kw)
    host.read, executor.backward_layer = logged_read, logged_backward
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    window_of_read = {}
    for n, e in enumerate(events):
        if e.startswith("layer"):
            running = next(b for b in reversed(events[:n]) if b.startswith("bwd"))
            window_of_read.setdefault(int(e[5:]), set()).add(11 - int(running[4:]))   # layer j's backward: 11 - j
    # the default: one window before the layer's backward (layer 4: window 6, the backward of layer 5)
    assert window_of_read == {0: {7}, 1: {9}, 2: {8}, 3: {7}, 4: {6}}
    engine.step()
    engine.destroy()


# the copies of layers 0, 1 and 3 to the host spread over forward windows (layer 2's all in window 3), those of layers 0, 2 and 4 back
# over several windows (layer 0's last share in its own backward window, 11: exposed; layer 4's first in
# the forward, window 5)
SPLIT = dataclasses.replace(
    offload_all_plan(6), policy="split",
    internals_offload_shares={0: {0: 0.4, 2: 0.3, 4: 0.3}, 1: {1: 0.5, 5: 0.5}, 2: {3: 1.0}, 3: {3: 0.2, 4: 0.8}},
    internals_prefetch_shares={0: {6: 0.3, 9: 0.3, 11: 0.4}, 2: {7: 0.5, 8: 0.5}, 4: {5: 0.5, 7: 0.5}})


@pytest.mark.parametrize("links", [False, True], ids=["in-place", "links"])
def test_copies_split_over_windows_train_bit_for_bit_as_the_plan_that_re_runs_them(tmp_path, links):
    data = batches(4)
    plain = _train(_engine(tmp_path, "llama", keep_all_plan(6), links), data)
    split = _train(_engine(tmp_path, "llama", SPLIT, links), data)
    for k, v in plain.items():
        assert torch.equal(split[k], v), k


class _SavesItsOutputBlock(torch.nn.Module):
    """tanh saves its own output: the block's output is a tensor its forward sent to the host."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x) + x)


class _ScalesInPlaceLM(ModuleListLM):
    block = _SavesItsOutputBlock

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.stack[:-1]:   # (the last block keeps its graph: plain autograd refuses a change there)
            x = blk(x)
            x.mul_(0.5)   # the model changes each block's output in place
        return self.head(self.extra[0](self.stack[-1](x)))


@pytest.mark.parametrize("testing", [None, LINKS, {**LINKS, "chaos_seed": 3, "chaos_max_delay_ms": 5.0}],
                         ids=["in-place", "links", "links-chaos"])
def test_an_output_the_forward_saved_and_the_model_then_changes_in_place_trains_as_the_re_run_plan(tmp_path, testing):
    """The saved bytes' copy to the host may run after the model's in-place change (a copy stream, a
    window's share): the model gets a copy of such an output, and the layer is differentiated as its
    forward computed it, as the plan that re-runs it is. The async copy had read the changed values (a
    TierError here; on a CUDA stream, which checks no versions, a race)."""
    def model():
        torch.manual_seed(0)
        return _ScalesInPlaceLM(n_layers=6)
    data = batches(3)
    plain = _train(plan_engine(tmp_path, model(), keep_all_plan(6), testing), data)
    for plan in (offload_all_plan(6), SPLIT):
        offloaded = _train(plan_engine(tmp_path, model(), plan, testing), data)
        for k, v in plain.items():
            assert torch.equal(offloaded[k], v), (plan.policy, k)


class _GatedSlicesBlock(torch.nn.Module):
    """Gate and up as slices of one matmul's output (DeepSeek-V3's experts chunk it): autograd saves views
    that are not dense, of an odd width, where the CPU's vectorized and scalar loops meet."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * 20), torch.nn.Linear(20, d)

    def forward(self, x):
        h = self.fc1(x)
        return x + self.fc2(torch.nn.functional.silu(h[..., :20]) * h[..., 20:])


def test_saved_slices_come_back_with_their_strides_and_train_bit_for_bit_as_the_re_run_plan(tmp_path):
    """A slice's values cross contiguous; given back contiguous, the backward's kernels ran on other strides
    and rounded otherwise (3e-8 off after a step)."""
    model = _lm_of(_GatedSlicesBlock)
    data = batches(3, seq=37)
    plain = _train(plan_engine(tmp_path, model(), keep_all_plan(6), None), data)
    offloaded = _train(plan_engine(tmp_path, model(), offload_all_plan(6, last_segment_graph=False), None), data)
    for k, v in plain.items():
        assert torch.equal(offloaded[k], v), k


def test_split_copies_leave_and_come_back_in_the_shares_the_plan_names(tmp_path):
    """Each window issues the saved tensors (in the order saved) that bring the bytes issued to its running
    share, each tensor whole: within half the largest tensor of it."""
    engine = _engine(tmp_path, "llama", SPLIT, True)
    host, executor = engine.tiers["host"], engine.executor
    write, read, enter = host.write, host.read, executor._enter_window
    window, sizes, writes, reads = [None], {}, [], []

    def logged_write(key, value, *a, **kw):
        if ".saved" in key:
            sizes[key] = value.numel() * value.element_size()
            writes.append((window[0], key))
        return write(key, value, *a, **kw)

    def logged_read(key, *a, **kw):
        if ".saved" in key:
            reads.append((window[0], key))
        return read(key, *a, **kw)

    def logged_enter(p, w):
        window[0] = w
        return enter(p, w)
    host.write, host.read, executor._enter_window = logged_write, logged_read, logged_enter
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    for j in range(5):
        keys = [k for _, k in writes if f".layer{j}." in k]
        assert keys == sorted(keys, key=lambda k: int(k.rsplit("saved", 1)[1]))   # in the order saved
        assert len(set(keys)) == len(keys) and {k for _, k in reads if f".layer{j}." in k} == set(keys)
        total, largest = sum(sizes[k] for k in keys), max(sizes[k] for k in keys)
        for log, split in ((writes, SPLIT.internals_offload_split(j)), (reads, SPLIT.internals_prefetch_split(j))):
            mine = [(w, k) for w, k in log if f".layer{j}." in k]
            assert {w for w, _ in mine} <= set(split), (j, mine)
            share = 0.0
            for w in sorted(split):
                share += split[w]
                issued = sum(sizes[k] for v, k in mine if v <= w)
                assert abs(issued - share * total) <= largest / 2 + 1e-6, (j, w, issued, share * total)
    engine.step()
    engine.destroy()


# boundaries kept on the host, two of them leaving the device in a later window than their own, beside
# layers 2 and 5 offloaded (MIXED)
DEFERRED = Plan(num_layers=6, homes=("hbm", "host", "host", "host", "host", "host", "hbm"),
                offload_window={1: 3, 3: 4}, policy="deferred")


@pytest.mark.parametrize("plan", [offload_all_plan(6), SPLIT, MIXED, DEFERRED],
                         ids=["whole", "split", "mixed", "boundaries"])
def test_a_window_begins_once_the_copies_out_before_it_have_ended_and_waits_for_none_of_its_own(tmp_path, plan,
                                                                                                monkeypatch):
    """The Plan's windows: the planner counts a saved tensor's or a boundary's device memory free, and the
    simulator starts the next window, once its window's copies to the host are over. With every copy delayed at
    random, each window begins with the copies out of the windows before it ended, and never waits for those
    it issues itself (that would serialise its compute with its own copies)."""
    import lazytrain.tiers.base as tiers_base
    testing = dict(LINKS, chaos_seed=3, chaos_max_delay_ms=5.0)
    engine = plan_engine(tmp_path, make_model("llama"), plan, testing)
    host, executor = engine.tiers["host"], engine.executor
    write, enter, wait = host.write, executor._enter_window, tiers_base.wait_completion
    window, issued, late, own = [None], [], [], []

    def logged_write(key, value, *a, **kw):
        handle = write(key, value, *a, **kw)
        if ".saved" in key or ".boundary" in key:
            issued.append((window[0], handle.completion()))
        return handle

    def logged_enter(p, w):
        window[0] = w   # what it issues is its own
        enter(p, w)
        late.extend(v for v, done in issued if v < w and not completion_reached(done))

    def logged_wait(done):
        own.extend(v for v, d in issued if d is done and v == window[0])
        wait(done)
    host.write, executor._enter_window = logged_write, logged_enter
    monkeypatch.setattr(tiers_base, "wait_completion", logged_wait)   # what wait_completions waits with
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    sent_in = {"whole": set(range(5)), "split": set(range(6)), "mixed": {2, 3, 5}, "deferred": {2, 3, 4, 5}}
    assert {v for v, _ in issued} == sent_in[plan.policy.replace("offload-all", "whole")]
    assert late == [] and own == []
    engine.step()
    engine.destroy()


class _FailsWhenTold(MLPBlock):
    """A block whose forward raises (as a CUDA out-of-memory error would) when its ``fail`` is set."""
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("out of memory (simulated)")
        return super().forward(x)


@pytest.mark.parametrize("plan", [offload_all_plan(6), SPLIT], ids=["whole", "split"])
def test_a_forward_that_fails_midway_frees_the_internals_it_holds(tmp_path, plan):
    """Block 3 raises: layers 0 and 1 still hold shares their windows 4 and 5 were to send. Those saved
    tensors, and the graphs that saved them, go with the failed forward, as they would in plain PyTorch."""
    engine = _engine(tmp_path, None, plan, True, model=_lm_of(_FailsWhenTold)())
    host = engine.tiers["host"]
    base_used = host.stats()["used_bytes"]
    x, y = batches(1)[0]
    engine.module.stack[3].fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        engine(x)
    engine.module.stack[3].fail = False
    engine.backward(lm_loss(engine(x), y))   # the next step drops the failed pass and runs as usual
    engine.step()
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, OffloadedInternals) and o._tier is host]
    assert host.stats()["used_bytes"] == base_used
    engine.destroy()


def test_policy_offload_all_from_the_config():
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "lazytrain": {"policy": "offload_all", "device": "cpu"}}
    engine = lazytrain.initialize(model=make_model("llama"), config=cfg)[0]
    assert engine.plan.offloaded_layers == (0, 1, 2, 3, 4) and engine.plan.graph_start() == 5
    engine.destroy()
    cfg["lazytrain"]["last_segment_graph"] = False     # the last layer re-run from its input instead
    engine = lazytrain.initialize(model=make_model("llama"), config=cfg)[0]
    assert engine.plan.offloaded_layers == (0, 1, 2, 3, 4) and engine.plan.graph_start() == 6
    assert engine.plan.homes[5] == "hbm"
    engine.destroy()
    cfg["lazytrain"]["policy"] = "offload_al"
    with pytest.raises(ConfigError, match="'lazytrain.policy' must be one of every_k, keep_all, offload_all, plan"):
        lazytrain.initialize(model=make_model("llama"), config=cfg)


def test_plans_that_cannot_offload_a_layer_are_refused_by_name():
    homes = ("hbm", RECOMPUTE, RECOMPUTE, "host", RECOMPUTE, RECOMPUTE, "hbm")
    cases = [
        (dict(offloaded_layers=(1,)), "offloaded layer 1 must be a segment of its own: boundary 2 after it must be "
                                      "kept or start another offloaded layer, got 'recompute'"),
        (dict(offloaded_layers=(3,)), "offloaded layer 3 needs boundary 3 to be 'recompute' (its graph keeps its "
                                      "input, on the host), got home 'host'"),
        (dict(offloaded_layers=(2,), selective_layers=(2,)), "layer 2 is in both offloaded_layers and "
                                                             "selective_layers"),
        (dict(offloaded_layers=(5,), last_segment_graph=True), "offloaded_layers holds 5: an offloaded layer must "
                                                               "lie in 0..2 (layers 3..5 keep their forward graph"),
        (dict(offloaded_layers=(2,), internals_prefetch_window={2: 10}), "internals_prefetch_window[2] = 10 must "
                                                                         "lie in [3, 9]"),
        (dict(internals_prefetch_window={2: 5}), "internals_prefetch_window[2] given, but layer 2 is not offloaded"),
        (dict(offloaded_layers=(2,), internals_offload_shares={2: {2: 0.5, 6: 0.5}}),
         "internals_offload_shares[2] names window 6, outside [2, 5]"),
        (dict(offloaded_layers=(2,), internals_offload_shares={2: {2: 0.5, 3: 0.4}}),
         "internals_offload_shares[2] shares sum to 0.9, not 1"),
        (dict(offloaded_layers=(2,), internals_prefetch_shares={2: {8: 0.0, 9: 1.0}}),
         "internals_prefetch_shares[2][8] = 0.0: a share must lie in (0, 1]"),
        (dict(offloaded_layers=(2,), internals_prefetch_shares={2: {8: 0.5, 9: float("nan")}}),
         "internals_prefetch_shares[2][9] = nan: a share must lie in (0, 1]"),
        (dict(offloaded_layers=(2,), internals_prefetch_shares={2: {}}),
         "internals_prefetch_shares[2] is empty"),
        (dict(internals_offload_shares={2: {2: 1.0}}), "internals_offload_shares[2] given, but layer 2 is not offloaded"),
        (dict(offloaded_layers=(2,), internals_offload_shares={2: {2: 0.5, 4: 0.5}},
              internals_prefetch_shares={2: {4: 0.5, 9: 0.5}}),
         "offloaded layer 2's internals start back in window 4, before their copy out ends in window 4"),
        (dict(offloaded_layers=(2,), internals_prefetch_window={2: 8}, internals_prefetch_shares={2: {8: 1.0}}),
         "internals_prefetch_window[2] and internals_prefetch_shares[2] both given"),
    ]
    for fields, message in cases:
        with pytest.raises(PlanError) as e:
            Plan(num_layers=6, homes=homes, **fields)
        assert str(e.value).startswith(message), (fields, str(e.value))
    plan = Plan(num_layers=6, homes=homes, offloaded_layers=(2, 5), internals_prefetch_window={2: 3})
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(SPLIT.to_json()) == SPLIT
    for bad in ({"2": {"x": 0.5}}, {"2": {"3": "half"}}, {"2": 0.5}, {"2": {"3": True}}):
        with pytest.raises(PlanError, match="internals_offload_shares"):
            Plan.from_dict({**plan.to_dict(), "internals_offload_shares": bad})
    assert plan.segments() == [(0, 2), (2, 3), (3, 5), (5, 6)] and plan.recomputed_layers() == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_offloaded_layers_train_bit_for_bit_as_the_plan_that_re_runs_them(tmp_path, precision):
    """On CUDA: saved tensors copied to pinned host memory on the copy stream in forward and back before
    each backward, weights streamed into slots again for it; with SPLIT, copies held on the device and
    issued from later windows (ordered after the compute that made them by the copy stream)."""
    data = batches(3)
    runs = {}
    for plan in (keep_all_plan(6), offload_all_plan(6), MIXED, SPLIT):
        engine = plan_engine(tmp_path, make_model("llama"), plan, device="cuda", bf16=precision == "bf16")
        written = engine.tiers["host"].stats()["bytes_written"]
        runs[plan.policy] = _train(engine, data)
        if plan.offloaded_layers:
            assert engine.tiers["host"].stats()["bytes_written"] > written
    for policy in ("offload-all", "mixed", "split"):
        for k, v in runs["keep-all-host"].items():
            assert torch.equal(runs[policy][k], v), (policy, k)


class _LooksThenChangesInPlace(torch.nn.Module):
    """Autograd saves ``h`` for an op whose result only steers a branch (its backward never runs), then
    ``h`` is changed in place by an op that saves it as changed: legal in plain PyTorch."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if h.abs().amax() > 1e4:      # AbsBackward saves h as it is now
            h = h / 1e4
        h.sigmoid_()                   # SigmoidBackward saves h as changed: the same tensor, a new version
        return x + self.fc2(h)


@pytest.mark.parametrize("links", [False, True], ids=["in-place", "links"])
def test_a_tensor_changed_in_place_after_it_was_saved_is_saved_again(tmp_path, links):
    model = _lm_of(_LooksThenChangesInPlace)
    data = batches(3)
    weights = _train(_engine(tmp_path, None, offload_all_plan(6), links, model=model()), data)
    trained = model()
    trained.load_state_dict(weights)
    assert max_rel_diff(trained, reference_train(model(), data)) < 1e-4


class _CtxLinear(torch.autograd.Function):
    """A linear layer whose Function keeps its input and weight on ctx, not through save_for_backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.x, ctx.w = x, w
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w, g.flatten(0, -2).t() @ ctx.x.flatten(0, -2), g.flatten(0, -2).sum(0)


class _CtxBlock(torch.nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(_CtxLinear.apply(self.norm(x), self.fc1.weight, self.fc1.bias)))


@pytest.mark.parametrize("links", [False, True], ids=["in-place", "links"])
def test_weights_a_function_keeps_on_ctx_are_refused_where_the_buffer_is_reused(tmp_path, links):
    """The hooks never see what a Function keeps on ctx: with the weights computed on in place that is the
    weights themselves, and training matches plain PyTorch; with the weights streamed into buffers other
    layers reuse before this one's backward, the layer is refused by name rather than trained on other
    layers' weights."""
    model = _lm_of(_CtxBlock)
    data = batches(3)
    engine = _engine(tmp_path, None, MIXED, links, model=model())
    if links:
        x, _ = data[0]
        with pytest.raises(ExecutorError, match=r"^block 2 is an offloaded layer, and autograd Function\(s\) "
                                                r"_CtxLinearBackward in it keep a view of its weights"):
            engine(x)
        engine.destroy()
        return
    trained = model()
    trained.load_state_dict(_train(engine, data))
    assert max_rel_diff(trained, reference_train(model(), data)) < 1e-4


def _roundtrip(t: torch.Tensor, device=torch.device("cpu")):
    """Pack ``t`` as an offloaded layer's forward saves it, then unpack it as its backward does."""
    from lazytrain.tiers.memory import HostTier
    from lazytrain.engine.internals_offload import OffloadedInternals
    host, owned = HostTier("host"), set()
    internals = OffloadedInternals(host, "pass0.layer0", device, torch.zeros(4), owned)
    with internals.recording():
        packed = internals._pack(t)
    internals.prefetch()
    return internals._unpack(packed), host, internals


def test_slices_of_one_storage_come_back_into_one_buffer_of_their_span():
    """Gate and up, the halves of one matmul's output, cross as their values and come back as slices of one
    buffer the size of their base, as autograd's views share it: not a span each, nor a contiguous copy
    kept beside them."""
    from lazytrain.tiers.memory import HostTier
    host = HostTier("host")
    internals = OffloadedInternals(host, "pass0.layer0", torch.device("cpu"), torch.zeros(4), set())
    base = torch.randn(2, 8, 2 * 20)
    gate, up = base.chunk(2, dim=-1)
    with internals.recording():
        packed = [internals._pack(gate), internals._pack(up)]
    internals.prefetch()
    back = [internals._unpack(p) for p in packed]
    assert host.stats()["bytes_written"] == 4 * base.numel()
    for b, t in zip(back, (gate, up)):
        assert torch.equal(b, t) and b.stride() == t.stride()
    held = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in [*internals._values.values(), *back]}
    assert list(held.values()) == [base.untyped_storage().nbytes()]
    internals.release()


def test_a_saved_tensor_comes_back_with_its_strides_and_a_broadcast_goes_once():
    base = torch.arange(24.0).reshape(2, 3, 4)
    slice_ = base[:, 1:, :]   # not dense: its values cross contiguous, and come back with its strides
    for t in (base, base.transpose(1, 2), base.permute(2, 0, 1), slice_, torch.arange(4.0).expand(3, 4),
              torch.arange(8.0).reshape(2, 1, 4).expand(2, 5, 4).transpose(0, 2), torch.tensor(3.0)):
        back, host, _ = _roundtrip(t)
        assert torch.equal(back, t) and back.shape == t.shape
        assert back.stride() == t.stride(), (t.shape, t.stride())
        sent = 1
        for n, stride in zip(t.shape, t.stride()):   # a broadcast dimension is sent once
            sent *= n if stride else 1
        assert host.stats()["bytes_written"] == 4 * sent


def test_a_host_tensor_saved_beside_a_device_stays_where_it_is():
    t = torch.arange(3.0)
    back, host, _ = _roundtrip(t, device=torch.device("cuda"))   # the CUDA device need not exist: nothing moves
    assert back is t and host.stats()["bytes_written"] == 0



def test_views_of_the_same_bytes_in_other_shapes_go_once_and_come_back_as_they_were():
    """Attention's output (batch, heads, seq, dim) laid out as (batch, seq, heads, dim), and its reshape for
    the output projection: autograd saves both, the host gets their bytes once."""
    from lazytrain.tiers.memory import HostTier
    out = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 4, 3, 5).transpose(1, 2)   # (2, 3, 4, 5)
    views = [out, out.transpose(1, 2).reshape(8, 15), out.transpose(1, 2).reshape(2, 4, 15)]
    host = HostTier("host")
    internals = OffloadedInternals(host, "pass0.layer0", torch.device("cpu"), torch.zeros(4), set())
    with internals.recording():
        packed = [internals._pack(v) for v in views]
        packed.append(internals._pack(out[:, 1]))   # a slice of them: other bytes, sent on its own
    internals.prefetch()
    assert host.stats()["bytes_written"] == (out.numel() + out[:, 1].numel()) * 4 == internals.nbytes
    for v, p in zip(views, packed):
        back = internals._unpack(p)
        assert torch.equal(back, v) and back.stride() == v.stride()
    assert torch.equal(internals._unpack(packed[-1]), out[:, 1])   # a slice comes back contiguous
    internals.release()


class _SparseMixing(MLPBlock):
    """Mixes each position with the one before through a sparse matrix, which autograd saves (sparse.mm)."""

    def forward(self, x):
        h = self.fc1(self.norm(x))
        n = h.shape[1]
        mix = (torch.eye(n) + torch.diag(torch.ones(n - 1), -1)).to_sparse().to(h.device)
        return x + self.fc2(torch.nn.functional.gelu(torch.stack([torch.sparse.mm(mix, r) for r in h])))


def test_a_sparse_saved_tensor_stays_where_it_is_and_the_layer_trains_as_in_pytorch(tmp_path):
    sparse = torch.eye(3).to_sparse()
    back, host, _ = _roundtrip(sparse)
    assert back is sparse and host.stats()["bytes_written"] == 0
    model, data = _lm_of(_SparseMixing), batches(2)
    trained = model()
    trained.load_state_dict(_train(_engine(tmp_path, None, offload_all_plan(6), False, model=model()), data))
    assert max_rel_diff(trained, reference_train(model(), data)) < 1e-5


class _SigmoidThenScaledInPlace(torch.nn.Module):
    """sigmoid saves its output for its backward, which the block then scales in place: plain autograd
    refuses the backward; so must an offloaded layer, not train on the values as they were."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        h = torch.sigmoid(self.lin(x))
        h.mul_(2.0)
        return x + h


def test_a_saved_tensor_changed_in_place_later_in_the_forward_fails_its_backward_as_in_pytorch(tmp_path):
    model = _lm_of(_SigmoidThenScaledInPlace)()
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="one of the variables needed for gradient computation has been modified "
                                           "by an inplace operation"):
        lm_loss(model(x), y).backward()
    engine = plan_engine(tmp_path, model, MIXED)
    with pytest.raises(RuntimeError, match=r"one of the variables needed for gradient computation has been modified "
                                           r"by an inplace operation: a tensor of shape \[2, 12, 32\] that offloaded "
                                           r"block 5 saved is at version 1; expected version 0 instead"):
        engine.backward(lm_loss(engine(x), y))
    engine.destroy()


class _CheckpointingBlock(MLPBlock):
    """A block that checkpoints its own MLP (torch.utils.checkpoint, non-reentrant), as some models do:
    the backward re-runs the MLP from the block's attributes, which must be the streamed weights."""
    def _mlp(self, h):
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))

    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(self._mlp, self.norm(x), use_reentrant=False)


@pytest.mark.parametrize("links", [False, True], ids=["in-place", "links"])
def test_a_checkpoint_inside_a_block_re_runs_from_the_streamed_weights(tmp_path, links):
    """Every plan kind trains as plain PyTorch in fp32. In bf16 the module's own weights are fp32 masters,
    so a re-run from them failed with a dtype error; an offloaded layer's forward slot holds another layer's
    weights by its backward, so a re-run from the forward's views trained on wrong weights, silently."""
    model = _lm_of(_CheckpointingBlock)
    data = batches(3)
    reference = reference_train(model(), data)
    selective = dataclasses.replace(MIXED, offloaded_layers=(2,), selective_layers=(0, 3))
    plans = {"keep_all": keep_all_plan(6), "mixed_offload": MIXED, "selective": selective}
    for name, plan in plans.items():
        trained = model()
        trained.load_state_dict(_train(_engine(tmp_path, None, plan, links, model=model()), data))
        assert max_rel_diff(trained, reference) < 1e-5, name
    bf16 = {name: _train(plan_engine(tmp_path, model(), plan, LINKS if links else None, bf16=True), data)
            for name, plan in plans.items()}
    for name in ("mixed_offload", "selective"):
        for k, v in bf16["keep_all"].items():
            assert torch.equal(bf16[name][k], v), (name, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_a_checkpoint_inside_a_block_re_runs_from_the_streamed_weights(tmp_path, precision):
    """On CUDA the module's own weights are fp32 masters on the host: a re-run from them failed (device and,
    in bf16, dtype); an offloaded layer's re-run reads the slot its weights were streamed into again."""
    model, data = _lm_of(_CheckpointingBlock), batches(3)
    selective = dataclasses.replace(MIXED, offloaded_layers=(2,), selective_layers=(0, 3))
    runs = {name: _train(plan_engine(tmp_path, model(), plan, device="cuda", bf16=precision == "bf16"), data)
            for name, plan in (("keep_all", keep_all_plan(6)), ("mixed_offload", MIXED), ("selective", selective))}
    for name in ("mixed_offload", "selective"):
        for k, v in runs["keep_all"].items():
            assert torch.equal(runs[name][k], v), (name, k)
