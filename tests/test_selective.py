"""Selective layers (a Plan's ``selective_layers``): the forward keeps the outputs of a block's matrix
multiplies and attention, its re-runs in backward take them instead of recomputing them. The training is
bit for bit the same plan's without them, on the paths that re-run a block once (the CPU records a
segment's graph in one pass) and twice (weights copied over emulated links: a no-grad recompute, then the
forward with autograd), and what is kept is counted on the device tier until the layer's backward."""
import dataclasses
import warnings

import pytest
import torch

from lazytrain.engine.selective import SelectiveForward
from lazytrain.planner.plan import PlanError, every_k_plan
from lazytrain.tiers import streams
from engine_models import (VOCAB, batches, lm_loss, make_model, max_rel_diff, plan_engine, reference_train,
                           train_and_destroy)

pytestmark = pytest.mark.filterwarnings("ignore:lazytrain")
LINKS = {"copy_threads": True, "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}}}


@pytest.fixture(autouse=True)
def _calm_transfers_after():
    yield
    streams.configure()


class SeqFirstBlock(torch.nn.Module):
    """A projection of a non-contiguous input, which matmul computes one way when its weight requires
    grad and another when it does not."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x.transpose(0, 1))).transpose(0, 1)


class SeqFirstLM(torch.nn.Module):
    def __init__(self, d: int = 16):
        torch.manual_seed(0)
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.layers = torch.nn.ModuleList([SeqFirstBlock(d) for _ in range(6)])
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _model(kind):
    return SeqFirstLM() if kind == "seq-first" else make_model(kind)


def _engine(tmp_path, kind, selective, links, accumulation=1):
    plan = dataclasses.replace(every_k_plan(6, 3, home="host"), selective_layers=selective)
    return plan_engine(tmp_path, _model(kind), plan, LINKS if links else None, accumulation)


_train = train_and_destroy


@pytest.mark.parametrize("kind", ["llama", "decoder", "seq-first"])
@pytest.mark.parametrize("links", [False, True], ids=["one-re-run", "two-re-runs"])
def test_selective_layers_train_bit_for_bit_as_the_plan_without_them(tmp_path, kind, links):
    data = batches(4)
    plain = _train(_engine(tmp_path, kind, (), links), data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selective = _train(_engine(tmp_path, kind, (0, 1, 2, 4), links), data)
    # every re-run took its kept outputs (a changed one would make its layer re-run whole, with a warning)
    assert not [w for w in caught if "kept matmul output was changed" in str(w.message)]
    for k, v in plain.items():
        assert torch.equal(selective[k], v), k
    model = _model(kind)
    model.load_state_dict(selective)
    assert max_rel_diff(model, reference_train(_model(kind), data)) < 1e-4   # the engine's usual parity


class _InPlaceReluBlock(torch.nn.Module):
    """An activation applied in place to a Linear's output: the output a selective forward kept changes."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.relu(self.fc1(x), inplace=True))


def _plain_run_of_blocks(tmp_path, block, links):
    """A six-``block`` model's maker, two batches, the every-3 plan, and that plan's trained weights."""
    from engine_models import ModuleListLM

    class LM(ModuleListLM):
        pass
    LM.block = block

    def model():
        torch.manual_seed(0)
        return LM()
    data, plan = batches(2), every_k_plan(6, 3, home="host")
    return model, data, plan, _train(plan_engine(tmp_path, model(), plan, LINKS if links else None), data)


class RouterBlock(torch.nn.Module):
    """A router that divides its top-k weights in place, as Mixtral's and DeepSeek-V3's do: under autograd
    the division adds a clone that the forward without autograd never runs."""

    def __init__(self, d: int):
        super().__init__()
        self.lin, self.router = torch.nn.Linear(d, d), torch.nn.Linear(d, 4)

    def forward(self, x):
        weights, _ = self.router(x).softmax(-1).topk(2, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        return x + torch.tanh(self.lin(x)) * weights[..., :1]


class GradOnlyMatmulBlock(torch.nn.Module):
    """Runs one more matmul when autograd records (as a grad-mode-dependent integration might): its
    re-runs' kept ops no longer line up with its forward's."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        if torch.is_grad_enabled():
            x = x + 0.0 * (x @ self.lin.weight)
        return x + torch.tanh(self.lin(x))


class GradOnlySameShapeMatmulBlock(torch.nn.Module):
    """Runs one more matmul under autograd, of the same op and shapes as the next one: a shape check would
    serve it the next one's kept output and shift every later one (the re-run runs again without them)."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        if torch.is_grad_enabled():
            x = x + 0.1 * torch.tanh(torch.nn.functional.linear(x, self.a.weight))
        return x + torch.tanh(self.a(x)) * self.b(x)


@pytest.mark.parametrize("block", [RouterBlock, GradOnlyMatmulBlock, GradOnlySameShapeMatmulBlock],
                         ids=["router", "grad-only-matmul", "grad-only-same-shape-matmul"])
@pytest.mark.parametrize("links", [False, True], ids=["one-re-run", "two-re-runs"])
def test_a_block_that_runs_other_ops_under_autograd_trains_as_the_plan_without_selective_layers(
        tmp_path, block, links):
    model, data, plan, plain = _plain_run_of_blocks(tmp_path, block, links)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _train(plan_engine(tmp_path, model(), dataclasses.replace(plan, selective_layers=(0, 1, 3, 4)),
                                  LINKS if links else None), data)
    lined_up = [str(w.message) for w in caught if "did not repeat its forward's kept ops" in str(w.message)]
    again = [str(w.message) for w in caught if "runs again without them" in str(w.message)]
    if block is RouterBlock:   # its extra ops are cheap ones, which are never kept: every kept op lines up
        assert lined_up == [] and again == []
    elif block is GradOnlySameShapeMatmulBlock:   # served shifted outputs until the forward's ran out
        assert set(again) == {f"lazytrain: selective layer {i}'s re-run ran other kept ops than its forward after "
                              f"taking kept outputs; it runs again without them" for i in (0, 1, 3, 4)}
    else:   # the extra matmul (mm, no bias) meets the forward's addmm first: nothing served, computed from there
        assert again == []
        assert lined_up and lined_up[0] == ("lazytrain: a selective layer's re-run did not repeat its forward's kept "
                                            "ops (its kept op 0 is aten.mm.default, the forward's aten.addmm.default, "
                                            "or of another signature); it computes them again from there")
    for k, v in plain.items():
        assert torch.equal(kept[k], v), k


class _AddsIntoItsProjectionBlock(torch.nn.Module):
    """Falcon's ``mlp_output += attention_output``: an in-place add into a bias-free Linear's output, which reaches
    the kept matmul output through a view (aten._unsafe_view) that does not share its version counter."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        y = self.a(x)
        y += torch.tanh(self.b(x))
        return x + y


@pytest.mark.parametrize("links", [False, True], ids=["one-re-run", "two-re-runs"])
@pytest.mark.parametrize("block", [_InPlaceReluBlock, _AddsIntoItsProjectionBlock], ids=["relu", "through-a-view"])
def test_a_kept_output_the_model_changes_in_place_makes_its_layer_re_run_whole(tmp_path, links, block):
    """torch's selective checkpoint refuses a cached output changed in place: a plan with selective layers
    would fail where the same plan without them trains. The layer re-runs whole instead, with a warning. A change
    through a view without the output's version counter went unseen: the re-runs took the changed output for the
    matmul's (Falcon's selective layers trained 0.13-0.19 relative off plain PyTorch, without a word)."""
    model, data, plan, plain = _plain_run_of_blocks(tmp_path, block, links)
    selective = dataclasses.replace(plan, selective_layers=(0, 1, 3, 4))
    with pytest.warns(UserWarning, match="lazytrain: a selective layer's kept matmul output was changed in place by "
                                         "the model; that layer re-runs its whole forward in backward instead"):
        kept = _train(plan_engine(tmp_path, model(), selective, LINKS if links else None), data)
    for k, v in plain.items():
        assert torch.equal(kept[k], v), k


def _sparse_mul_(y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's "Sparse CSR tensor support is in beta state"
        torch.eye(3).to_sparse().mul_(2)
        torch.eye(3).to_sparse_csr().mul_(2)


def _wrapper_add_(y):
    from torch.testing._internal.two_tensor import TwoTensor
    TwoTensor(torch.zeros(3), torch.zeros(3)).add_(1)
    torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged).mul_(2)
    torch.empty(3, device="meta").add_(1)


@pytest.mark.parametrize("body, changed", [
    (_sparse_mul_, False), (_wrapper_add_, False),
    (lambda y: torch._foreach_add_([torch.zeros(3), y.view(-1)[:4]], 1.0), True),
    (lambda y: torch.add(torch.ones(4, 4), 1, out=y), True),
    (lambda y: torch.add(torch.ones(4, 4), 1, out=torch.empty(4, 4)), False)],
    ids=["sparse", "wrapper-nested-meta", "foreach-into-kept", "out-into-kept", "out-elsewhere"])
def test_what_an_op_writes_is_told_from_a_kept_output_by_storage_whatever_its_kind(body, changed):
    """A write into a sparse tensor, a wrapper subclass or a jagged nested tensor in a selective layer failed
    ("Cannot access storage of SparseTensorImpl") once ops were watched for writes into kept outputs."""
    kept = SelectiveForward(1)
    with torch.no_grad(), kept.recording():
        body(torch.randn(4, 4) @ torch.randn(4, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kept.next_rerun()
    assert [str(w.message).startswith("lazytrain: a selective layer's kept matmul output was changed in place")
            for w in seen] == ([True] if changed else [])


def test_falcons_selective_layers_train_bit_for_bit_as_the_plan_without_them(tmp_path):
    """Falcon with parallel attention (7B, 40B, 180B) adds its attention output into its bias-free MLP output."""
    import transformers as T

    def model():
        torch.manual_seed(0)
        return T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, parallel_attn=True,
            bias=False, new_decoder_architecture=False, multi_query=True, hidden_dropout=0.0,
            attention_dropout=0.0))
    data, plan = batches(2), every_k_plan(6, 3, home="host")
    plain = _train(plan_engine(tmp_path, model(), plan, LINKS), data)
    kept = _train(plan_engine(tmp_path, model(), dataclasses.replace(plan, selective_layers=(0, 1, 3, 4)), LINKS),
                  data)
    for k, v in plain.items():
        assert torch.equal(kept[k], v), k


def test_with_gradient_accumulation_each_micro_batch_keeps_its_own_outputs(tmp_path):
    data = batches(4)
    plain = _train(_engine(tmp_path, "llama", (), True, accumulation=2), data)
    selective = _train(_engine(tmp_path, "llama", (0, 1, 3, 4), True, accumulation=2), data)
    for k, v in plain.items():
        assert torch.equal(selective[k], v), k


# one llama layer (hidden 32, 4 heads of 8, 2 kv heads, MLP 64) on 2 x 12 tokens, fp32: the outputs of
# q, k, v, o, gate, up and down projections (24 x (32+16+16+32+64+64+32) elements), attention's output
# (2 x 4 x 12 x 8) and its log-sum-exp (2 x 4 x 12)
KEPT_PER_LAYER = 4 * (24 * 256 + 768 + 96)


def test_what_a_selective_layer_keeps_is_counted_on_the_device_until_its_backward(tmp_path):
    engines = {n: _engine(tmp_path, "llama", sel, False) for n, sel in (("plain", ()), ("selective", (0, 1, 4)))}
    x, y = batches(1)[0]
    used = {}
    for name, engine in engines.items():
        loss = lm_loss(engine(x), y)
        used[name] = engine.tiers["hbm"].stats()["used_bytes"]   # after the forward, before its backward
        engine.backward(loss)
        used[name + " after"] = engine.tiers["hbm"].stats()["used_bytes"]
        engine.step()
        engine.destroy()
    assert used["selective"] - used["plain"] == 3 * KEPT_PER_LAYER
    assert used["selective after"] == used["plain after"]          # freed with each layer's backward


def test_a_selective_forward_keeps_matmul_and_attention_outputs_for_each_re_run():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 3, 8)
    kept = SelectiveForward(reruns=2)
    with torch.no_grad(), kept.recording():
        q = torch.relu(lin(x)).view(2, 1, 3, 8)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert sorted(tuple(t.shape) for t in kept.tensors()) == [(2, 1, 3), (2, 1, 3, 8), (6, 8)]   # once each
    for _ in range(2):   # each re-run takes the kept outputs, with autograd recording through them
        with kept.next_rerun():
            out = lin(x.requires_grad_())
        out.sum().backward()
    with pytest.raises(RuntimeError, match="re-run more than the 2 time"):
        kept.next_rerun()


def test_a_re_run_run_again_without_its_kept_outputs_lets_the_first_runs_graph_go_first(tmp_path, monkeypatch):
    """The fallback's second run must not hold the first run's graph (a selective layer's served outputs and
    all it recomputed, an activation its ops saved among them) beside its own: the planner counts one."""
    import weakref
    from engine_models import ModuleListLM
    from lazytrain.engine import executor as executor_module
    real, first, alive, inner = executor_module.LayerStreamingExecutor._compute, {}, [], []

    def compute(self, layer, flat, hidden, call, tensors=None, requires_grad=False, replay=False, **kwargs):
        if replay and requires_grad and layer in first:
            # the first run's output and an activation its graph saved, as the second starts
            alive.append(tuple(ref() is not None for ref in first.pop(layer)))
        inner.clear()
        out, params = real(self, layer, flat, hidden, call, tensors, requires_grad, replay, **kwargs)
        if replay and requires_grad and "kept" in kwargs:
            first[layer] = (weakref.ref(out if isinstance(out, torch.Tensor) else out[0]), inner[0])
        return out, params
    monkeypatch.setattr(executor_module.LayerStreamingExecutor, "_compute", compute)

    class Block(GradOnlySameShapeMatmulBlock):
        def forward(self, x):
            if torch.is_grad_enabled():   # what the next matmul saves: held by the run's graph alone
                x = x + 0.1 * torch.tanh(torch.nn.functional.linear(x, self.a.weight))
                inner.append(weakref.ref(x))
            return x + torch.tanh(self.a(x)) * self.b(x)

    class LM(ModuleListLM):
        block = Block
    torch.manual_seed(0)
    plan = dataclasses.replace(every_k_plan(6, 3, home="host"), selective_layers=(0, 1, 3, 4))
    _train(plan_engine(tmp_path, LM(), plan), batches(1))
    assert alive == [(False, False)] * 4


def test_a_re_run_whose_kept_ops_shift_is_never_served_another_ops_output():
    """torch.matmul of a transposed input runs bmm without grad and mm with it: the forward keeps [bmm, mm],
    the re-run runs [mm, mm] with one signature (batch == sequence). Counted per op, the re-run's first mm
    would take the forward's mm (another projection's output); in one sequence it meets the forward's bmm
    and computes from there."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)
    x = torch.randn(4, 4, 8)

    def block(x, w1, w2):
        a = torch.nn.functional.linear(x.transpose(0, 1), w1).transpose(0, 1)
        return x + torch.tanh(a) * torch.nn.functional.linear(x, w2)
    kept = SelectiveForward(1)
    with torch.no_grad(), kept.recording():
        out = block(x, w1, w2)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    with pytest.warns(UserWarning, match=r"its kept op 0 is aten.mm.default, the forward's aten.bmm.default"), \
            kept.next_rerun():
        again = block(*leaves)
    plain = block(*[t.clone().requires_grad_() for t in (x, w1, w2)])
    assert torch.allclose(again, out, atol=1e-6) and torch.equal(again, plain)
    again.sum().backward()
    plain_leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    block(*plain_leaves).sum().backward()
    for mine, theirs in zip(leaves, plain_leaves):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_forward_kept_for_two_re_runs_runs_each_op_through_one_dispatch_mode(monkeypatch):
    """One recording serves every re-run (a re-run reads the kept outputs, it does not consume them), so
    the forward's ops pay one Python dispatch mode whatever the number of re-runs."""
    import lazytrain.engine.selective as selective
    asked, keeps = [], selective.keeps
    monkeypatch.setattr(selective, "keeps", lambda op, args, kwargs: asked.append(op) or keeps(op, args, kwargs))
    lin, x = torch.nn.Linear(8, 8), torch.randn(2, 3, 8)
    block = lambda: torch.relu(lin(x)) @ lin.weight   # noqa: E731
    counts = []
    for reruns in (1, 2):
        asked.clear()
        kept = SelectiveForward(reruns)
        with torch.no_grad(), kept.recording():
            out = block()
        counts.append(len(asked))
        for _ in range(reruns):   # each re-run takes the kept outputs
            with kept.next_rerun():
                again = block()
            assert torch.equal(again, out)
    assert counts[0] == counts[1] >= 3


def test_a_selective_layer_must_be_one_that_backward_re_runs():
    plan = every_k_plan(6, 3, home="host")
    with pytest.raises(PlanError, match=r"selective_layers holds 4: a selective layer must be re-run in backward, "
                                        r"so lie in 0\.\.2 \(layers 3\.\.5 keep their forward graph\)"):
        dataclasses.replace(plan, last_segment_graph=True, selective_layers=(4,))
    with pytest.raises(PlanError, match=r"selective_layers holds 6"):
        dataclasses.replace(plan, selective_layers=(6,))


def test_attention_that_drops_out_and_kernels_without_a_log_sum_exp_are_recomputed_not_kept():
    from lazytrain.engine.selective import keeps
    aten, q = torch.ops.aten, torch.zeros(1)
    assert keeps(aten.mm.default, (q, q), {})
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert keeps(flash, (q, q, q, 0.0), {})
    assert not keeps(flash, (q, q, q, 0.1), {})
    assert not keeps(flash, (q, q, q), {"dropout_p": 0.1})
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert not keeps(efficient, (q, q, q, None, False), {})
    assert not keeps(aten.relu.default, (q,), {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_selective_layers_train_bit_for_bit_as_the_plan_without_them(tmp_path, precision):
    """On CUDA: side-stream weight copies into two slots (two re-runs of a segment's interior), SDPA's
    CUDA kernels (the efficient one recomputed, its log-sum-exp existing only under autograd)."""
    data = batches(3)
    runs = {}
    for selective in ((), (0, 1, 2, 4)):
        plan = dataclasses.replace(every_k_plan(6, 3, home="host"), selective_layers=selective)
        engine = plan_engine(tmp_path, make_model("llama"), plan, device="cuda", bf16=precision == "bf16")
        runs[selective] = _train(engine, data)
    plain, selective = runs[()], runs[(0, 1, 2, 4)]
    for k, v in plain.items():
        assert torch.equal(selective[k], v), k
