"""HybridAdamW: parity with torch AdamW / Adam and bitsandbytes AdamW8bit, fused kernel vs torch path,
compute copies, state_dict round trip, hybrid selection rules, LR schedulers."""
import io
import math

import pytest
import torch

import lazytrain.optim.hybrid_adamw as H
from lazytrain.optim import kernels
from lazytrain.optim.hybrid_adamw import HybridAdamW
from lazytrain.optim.quantization import dequantize_blockwise


def make_params(seed=0, shapes=((48, 512), (300,), (40, 130))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.05) for s in shapes]


def set_grads(params, step, heavy=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=g) * 0.01
        if heavy:
            grad = grad * torch.exp(torch.randn(p.shape, generator=g))
        if dtype != p.dtype and hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # a bf16 gradient for an fp32 master weight
        p.grad = grad.to(dtype)


def run(opt, params, steps, **kw):
    for s in range(steps):
        set_grads(params, s, **kw)
        opt.step()


def step_both(oa, pa, ob, pb, steps):
    """The same gradients for two optimizers over two parameter lists, step by step."""
    for s in steps:
        set_grads(pa, s)
        set_grads(pb, s)
        oa.step()
        ob.step()


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(H, "cpu_kernels", lambda: None)


def states_equal(o1, p1, o2, p2):
    for a, b in zip(p1, p2):
        s1, s2 = o1.state[a], o2.state[b]
        assert s1.keys() == s2.keys()
        for key in s1:
            if isinstance(s1[key], torch.Tensor):
                assert torch.equal(s1[key], s2[key]), key
            else:
                assert s1[key] == s2[key], key


# ---------------------------------------------------------------- fused kernel == torch implementation
@pytest.mark.parametrize("states", ["8bit", "fp32"])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_bit_identical_to_torch_path(k, monkeypatch, states, adamw_mode, grad_dtype):
    shapes = ((37, 333), (300,), (64, 64))  # partial last block, 1-D fp32 tensor, exact blocks
    pa, pb = make_params(shapes=shapes), make_params(shapes=shapes)
    kw = dict(lr=3e-3, weight_decay=0.1, adamw_mode=adamw_mode, optimizer_states=states, min_8bit_size=1000,
              block_size=96, max_grad_norm=0.05)
    oa, ob = HybridAdamW(pa, **kw), HybridAdamW(pb, **kw)
    copies_a = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in pa}
    copies_b = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in pb}
    oa.set_compute_copies(copies_a)
    ob.set_compute_copies(copies_b)
    run(oa, pa, 4, heavy=True, dtype=grad_dtype)
    with monkeypatch.context() as m:
        m.setattr(H, "cpu_kernels", lambda: None)
        run(ob, pb, 4, heavy=True, dtype=grad_dtype)
    assert oa.last_clip_coef < 1.0  # clipping was active
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        assert torch.equal(copies_a[a], copies_b[b])
    states_equal(oa, pa, ob, pb)


def test_avx2_and_scalar_loops_bit_identical(k):
    if not k.has_avx2:
        pytest.skip("no AVX2 build")
    pa, pb = make_params(), make_params()
    oa, ob = HybridAdamW(pa, lr=1e-2, min_8bit_size=1000), HybridAdamW(pb, lr=1e-2, min_8bit_size=1000)
    run(oa, pa, 3, heavy=True)
    k.set_force_scalar(True)
    try:
        run(ob, pb, 3, heavy=True)
    finally:
        k.set_force_scalar(False)
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    states_equal(oa, pa, ob, pb)


@pytest.mark.parametrize("states", ["8bit", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_copy_written_in_the_same_pass(states, dtype):
    params = make_params()
    copies = {p: torch.full(p.shape, float("nan"), dtype=dtype) for p in params}
    opt = HybridAdamW(params, lr=1e-2, optimizer_states=states, min_8bit_size=1000)
    set_grads(params, 0)
    opt.step(compute_copies=copies)
    for p in params:
        assert torch.equal(copies[p], p.detach().to(dtype))  # round to nearest even, like torch


# ---------------------------------------------------------------- parity with reference optimizers
def test_fp32_states_match_torch_adamw():
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=1e-3, weight_decay=0.1, optimizer_states="fp32")
    ob = torch.optim.AdamW(pb, lr=1e-3, weight_decay=0.1, foreach=False)
    run(oa, pa, 20)
    run(ob, pb, 20)
    for a, b in zip(pa, pb):
        # same formula; torch's fp32 CPU sqrt is not correctly rounded, ours is: a few ulps apart
        torch.testing.assert_close(a, b, rtol=0, atol=2e-7)
        torch.testing.assert_close(oa.state[a]["exp_avg_sq"], ob.state[b]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_adam_mode_matches_torch_adam():
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=1e-3, weight_decay=0.1, adamw_mode=False, optimizer_states="fp32")
    ob = torch.optim.Adam(pb, lr=1e-3, weight_decay=0.1, foreach=False)
    run(oa, pa, 20)
    run(ob, pb, 20)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-7)


def test_8bit_one_step_matches_bitsandbytes_adamw8bit():
    bnb = pytest.importorskip("bitsandbytes")
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=1e-3, weight_decay=0.01, block_size=256, fp32_name_patterns=(), min_8bit_size=4096)
    ob = bnb.optim.AdamW8bit(pb, lr=1e-3, weight_decay=0.01, min_8bit_size=4096)
    set_grads(pa, 0, heavy=True)
    set_grads(pb, 0, heavy=True)
    oa.step()
    ob.step()
    for a, b in zip(pa, pb):
        # step 1 updates with the unquantized moments in both: identical up to fp32 rounding
        torch.testing.assert_close(a, b, rtol=0, atol=5e-8)
        sa, sb = oa.state[a], ob.state[b]
        if "state1" not in sa:  # small tensor: fp32 moments in both
            assert a.numel() < 4096 and sb["state1"].dtype == torch.float32
            torch.testing.assert_close(sa["exp_avg"], sb["state1"], rtol=1e-6, atol=0)
            continue
        # same layout and block maxima; moments decode within one code step of each other
        assert sa["state1"].dtype == sb["state1"].dtype == torch.uint8 and sa["state1"].shape == sb["state1"].shape
        assert torch.equal(sa["absmax1"], sb["absmax1"])
        torch.testing.assert_close(sa["absmax2"], sb["absmax2"], rtol=1e-6, atol=0)
        for i, qm in ((1, "dynamic"), (2, "udynamic")):
            da = dequantize_blockwise(sa[f"state{i}"], sa[f"absmax{i}"], qm, 256)
            db = dequantize_blockwise(sb[f"state{i}"], sb[f"absmax{i}"], qm, 256)
            scale = torch.repeat_interleave(sa[f"absmax{i}"], 256)[: a.numel()].view(a.shape)
            assert torch.all((da - db).abs() <= 0.0141 * scale)  # one step of the coarsest code spacing
            assert (sa[f"state{i}"] == sb[f"state{i}"]).float().mean() > 0.75


def test_8bit_tracks_fp32_adamw_like_bitsandbytes():
    """20 steps on heavy-tailed gradients: deviation from fp32 AdamW, in units of lr, no worse than
    bitsandbytes' AdamW8bit at the median, 99th percentile and maximum."""
    bnb = pytest.importorskip("bitsandbytes")
    shapes = ((96, 512),)
    p8, pb, p32 = make_params(shapes=shapes), make_params(shapes=shapes), make_params(shapes=shapes)
    o8 = HybridAdamW(p8, lr=1e-3, weight_decay=0.01, block_size=256)
    ob = bnb.optim.AdamW8bit(pb, lr=1e-3, weight_decay=0.01)
    o32 = torch.optim.AdamW(p32, lr=1e-3, weight_decay=0.01)
    for o, ps in ((o8, p8), (ob, pb), (o32, p32)):
        run(o, ps, 20, heavy=True)
    d8 = ((p8[0] - p32[0]).detach().abs() / 1e-3).flatten()
    db = ((pb[0] - p32[0]).detach().abs() / 1e-3).flatten()
    q = torch.tensor([0.5, 0.99])
    assert torch.all(d8.quantile(q) <= db.quantile(q) * 1.05)
    assert d8.max() <= max(1.5, float(db.max()) * 1.05)
    assert d8.quantile(torch.tensor(0.5)) < 0.12  # median deviation after 20 steps: a tenth of one lr


# ---------------------------------------------------------------- clipping and non-finite gradients
def test_clipping_parity_with_clip_grad_norm():
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=1e-3, optimizer_states="fp32", max_grad_norm=0.05)
    ob = HybridAdamW(pb, lr=1e-3, optimizer_states="fp32", check_finite=False)
    for s in range(3):
        set_grads(pa, s, heavy=True)
        set_grads(pb, s, heavy=True)
        oa.step()
        total = torch.nn.utils.clip_grad_norm_(pb, 0.05)
        ob.step()
        assert oa.last_grad_norm == float(total)  # bit-identical norm
        for a, b in zip(pa, pb):
            assert torch.equal(a, b)  # coefficient inside the fused update == clip_grad_norm_ then step
    assert oa.last_clip_coef < 1.0


def test_clipping_8bit_equals_external_coefficient():
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=1e-3, min_8bit_size=1000, max_grad_norm=0.05)
    ob = HybridAdamW(pb, lr=1e-3, min_8bit_size=1000)
    set_grads(pa, 0, heavy=True)
    set_grads(pb, 0, heavy=True)
    oa.step()
    total = torch.nn.utils.clip_grad_norm_(pb, 0.05)
    ob.step(grad_norm=total)
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    states_equal(oa, pa, ob, pb)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("states", ["8bit", "fp32"])
def test_non_finite_gradient_skips_the_step(bad, states):
    params = make_params()
    opt = HybridAdamW(params, lr=1e-2, optimizer_states=states, min_8bit_size=1000)
    run(opt, params, 2)
    before = [p.detach().clone() for p in params]
    state_before = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
                    for p in params}
    set_grads(params, 5)
    params[1].grad[7] = bad
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        for key, v in state_before[id(p)].items():
            assert torch.equal(opt.state[p][key], v) if isinstance(v, torch.Tensor) else opt.state[p][key] == v
    set_grads(params, 6)
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert all(opt.state[p]["step"] == 3 for p in params)
    # a non-finite norm supplied by the caller skips the step too
    opt.step(grad_norm=torch.tensor(bad))
    assert opt.last_step_skipped and opt.skipped_steps == 2


def test_partial_step_needs_global_norm_when_clipping():
    params = make_params()
    opt = HybridAdamW(params, lr=1e-2, max_grad_norm=1.0)
    set_grads(params, 0)
    with pytest.raises(ValueError, match="global grad_norm"):
        opt.step(params=params[:1])
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    before = params[1].detach().clone()
    opt.step(params=params[:1], grad_norm=norm)
    assert opt.state[params[0]]["step"] == 1 and not opt.state[params[1]]
    assert torch.equal(params[1], before)


# ---------------------------------------------------------------- state_dict
def test_state_dict_round_trip_keeps_quantized_states():
    shapes = ((64, 1024), (300,))
    pa = make_params(shapes=shapes)
    oa = HybridAdamW(pa, lr=1e-3)
    run(oa, pa, 3)
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    n8 = pa[0].numel()
    # no blow-up to fp32: 2 bytes per 8-bit parameter + absmax + fp32 moments of the small tensor
    expected = 2 * n8 + 8 * (n8 // 256) + 8 * 300
    assert buf.tell() < expected + 16_000
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    ob = HybridAdamW(pb, lr=1e-3)
    ob.load_state_dict(sd)
    assert ob.state[pb[0]]["state1"].dtype == torch.uint8 and ob.state[pb[0]]["absmax1"].dtype == torch.float32
    states_equal(oa, pa, ob, pb)
    step_both(oa, pa, ob, pb, range(3, 6))
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
    states_equal(oa, pa, ob, pb)


def test_state_dict_keeps_checkpoint_block_size_and_kind():
    pa = make_params(shapes=((64, 1024),))
    oa = HybridAdamW(pa, lr=1e-3, block_size=2048)
    run(oa, pa, 2)
    pb = [torch.nn.Parameter(pa[0].detach().clone())]
    ob = HybridAdamW(pb, lr=1e-3, block_size=256)
    ob.load_state_dict(oa.state_dict())
    assert ob.state[pb[0]]["block_size"] == 2048 and ob.state[pb[0]]["absmax1"].numel() == 32
    pc = [torch.nn.Parameter(torch.zeros(10, 10))]
    with pytest.raises(ValueError):
        HybridAdamW(pc).load_state_dict(oa.state_dict())


def layout(opt, params):
    return [{k: (v.dtype, tuple(v.shape), v.is_contiguous()) if torch.is_tensor(v) else (type(v), v)
             for k, v in opt.state[p].items() if k != "step"} for p in params]


@pytest.mark.parametrize("chunk", [None, 512])
def test_fp32_moments_loaded_into_8bit_states_are_quantized_blockwise(monkeypatch, chunk):
    """A checkpoint with fp32 moments (an optimizer_states="fp32" run, torch's AdamW, DeepSpeed) resumes
    with the 8-bit states this optimizer is set up for, laid out as a fresh one lays them out, each block
    scaled to both ends of the map (_fitted); its groups' state settings stay this optimizer's (a chunk of
    512 converts whole blocks at a time)."""
    if chunk is not None:
        monkeypatch.setattr(H, "_CONVERT_CHUNK", chunk)
    pa = make_params()
    oa = HybridAdamW(pa, lr=1e-3, optimizer_states="fp32")
    run(oa, pa, 3)
    pb, pc = make_params(), make_params()
    ob, oc = HybridAdamW(pb, lr=1e-3), HybridAdamW(pc, lr=1e-3)
    ob.load_state_dict(oa.state_dict())
    run(oc, pc, 1)
    assert ob.param_groups[0]["optimizer_states"] == "8bit"
    assert layout(ob, pb) == layout(oc, pc)
    assert [sorted(ob.state[p]) for p in pb] == [["absmax1", "absmax2", "block_size", "state1", "state2", "step"],
                                                 ["exp_avg", "exp_avg_sq", "step"],   # 1-D: fp32
                                                 ["absmax1", "absmax2", "block_size", "state1", "state2", "step"]]
    for a, b in ((pa[0], pb[0]), (pa[2], pb[2])):
        for key, which, kind in (("exp_avg", "1", "dynamic"), ("exp_avg_sq", "2", "udynamic")):
            codes, absmax = H._fitted(oa.state[a][key].reshape(-1), H.get_qmap(kind, a.device), 256)
            assert torch.equal(ob.state[b]["state" + which].reshape(-1), codes)
            assert torch.equal(ob.state[b]["absmax" + which], absmax)
        assert ob.state[b]["step"] == 3
    assert torch.equal(ob.state[pb[1]]["exp_avg"], oa.state[pa[1]]["exp_avg"])
    run(ob, pb, 1)                                                 # and it steps as 8-bit
    assert ob.state[pb[0]]["state1"].dtype == torch.uint8 and ob.state[pb[0]]["step"] == 4


def test_8bit_moments_loaded_into_fp32_states_are_dequantized():
    pa = make_params()
    oa = HybridAdamW(pa, lr=1e-3)
    run(oa, pa, 3)
    assert "state1" in oa.state[pa[0]]
    pb = make_params()
    ob = HybridAdamW(pb, lr=1e-3, optimizer_states="fp32")
    ob.load_state_dict(oa.state_dict())
    assert ob.param_groups[0]["optimizer_states"] == "fp32"
    assert all(sorted(ob.state[p]) == ["exp_avg", "exp_avg_sq", "step"] for p in pb)
    for a, b in zip(pa, pb):
        for key in ("exp_avg", "exp_avg_sq"):
            st = ob.state[b][key]
            assert st.dtype == torch.float32 and st.shape == b.shape and st.is_contiguous()
            assert torch.equal(st.reshape(-1), torch.cat(list(oa.fp32_moment_chunks(a, key))))
    run(ob, pb, 1)
    assert ob.state[pb[0]]["step"] == 4


# ---------------------------------------------------------------- selection rules and report
def test_hybrid_selection_rules():
    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(100, 64),
        "fc": torch.nn.Linear(64, 256),
        "ln_1": torch.nn.LayerNorm(256),
        "input_layernorm": torch.nn.LayerNorm(8192),
        "small": torch.nn.Linear(8, 8, bias=False),
        "keep_fp32_proj": torch.nn.Linear(64, 128, bias=False),
    })
    opt = HybridAdamW(model.named_parameters(), fp32_name_patterns=(r"norm", r"bias", r"^ln_", r"keep_fp32"))
    kinds = {r["name"]: r["states"] for r in opt.state_report()}
    assert kinds == {"embed.weight": "8bit", "fc.weight": "8bit", "fc.bias": "fp32", "ln_1.weight": "fp32",
                     "ln_1.bias": "fp32", "input_layernorm.weight": "fp32", "input_layernorm.bias": "fp32",
                     "small.weight": "fp32", "keep_fp32_proj.weight": "fp32"}
    reasons = {r["name"]: r["reason"] for r in opt.state_report()}
    assert "min_8bit_size" in reasons["small.weight"] and "keep_fp32" in reasons["keep_fp32_proj.weight"]
    # unnamed: 1-D tensors keep fp32 states; optimizer_states="fp32" turns 8-bit off; threshold is configurable
    w, b = torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(8192))
    assert [r["states"] for r in HybridAdamW([w, b]).state_report()] == ["8bit", "fp32"]
    assert [r["states"] for r in HybridAdamW([w, b], optimizer_states="fp32").state_report()] == ["fp32", "fp32"]
    assert [r["states"] for r in HybridAdamW([w, b], min_8bit_size=5000).state_report()] == ["fp32", "fp32"]
    # names given separately, as (name, param) pairs or {id: name} (the engine's form)
    for named in ([("blocks.0.flat", b)], {id(b): "blocks.0.flat"}):
        assert HybridAdamW([b], named_parameters=named).state_report()[0]["states"] == "8bit"
    # per-group override
    opt = HybridAdamW([{"params": [w]}, {"params": [torch.nn.Parameter(torch.zeros(64, 64))],
                                          "optimizer_states": "fp32"}])
    assert [r["states"] for r in opt.state_report()] == ["8bit", "fp32"]
    text = opt.format_state_report()
    assert "1 tensors / 4,096 params with 8-bit states" in text


def test_state_bytes_per_parameter():
    params = [torch.nn.Parameter(torch.zeros(1024, 1024)) for _ in range(2)]
    for bs, limit in ((256, 2.032), (2048, 2.004)):
        opt = HybridAdamW(params, block_size=bs)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        real = sum(t.numel() * t.element_size() for p in params for t in opt.state[p].values()
                   if isinstance(t, torch.Tensor))
        assert real == opt.state_bytes()
        assert real / (2 * 1024 * 1024) <= limit


def test_invalid_arguments():
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="optimizer_states"):
        HybridAdamW(p, optimizer_states="4bit")
    with pytest.raises(ValueError, match="block_size"):
        HybridAdamW(p, block_size=100)
    with pytest.raises(ValueError, match="lr"):
        HybridAdamW(p, lr=-1.0)


@pytest.mark.parametrize("name, value, says", [("lr", float("nan"), "lr must be >= 0, got nan"),
                                               ("eps", float("nan"), "eps must be >= 0, got nan"),
                                               ("weight_decay", float("nan"), "weight_decay must be >= 0, got nan"),
                                               ("betas", (0.9, float("nan")), r"betas must be two numbers in \[0, 1\), "
                                                                              r"got \(0.9, nan\)")])
def test_nan_hyperparameters_are_refused_wherever_they_come_from(name, value, says):
    """NaN compares false with everything: written as torch writes its checks, NaN fails them (it would turn
    every weight into NaN)."""
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match=says):
        HybridAdamW(p, **{name: value})
    opt = HybridAdamW(p, lr=1e-3)
    with pytest.raises(ValueError, match=says):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], name: value})
    opt.param_groups[0][name] = value   # edited before a step
    p[0].grad = torch.ones(4)
    with pytest.raises(ValueError, match=says):
        opt.step()
    assert torch.equal(p[0], torch.zeros(4))


@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_finite_gradients_whose_fp32_norm_overflows_are_stepped_as_torch_steps_them(states):
    """Without clipping the norm is computed only to find non-finite gradients; gradients of 1e18 are finite,
    though the fp32 sum of their squares is not: the step goes through, as torch's AdamW's."""
    ref, mine = (torch.nn.Parameter(torch.ones(64, 64)) for _ in range(2))
    torch_opt, opt = torch.optim.AdamW([ref], lr=1e-2), HybridAdamW([mine], lr=1e-2, optimizer_states=states,
                                                                     min_8bit_size=0)
    for _ in range(3):
        ref.grad, mine.grad = torch.full((64, 64), 1e18), torch.full((64, 64), 1e18)
        torch_opt.step()
        opt.step()
    assert opt.skipped_steps == 0 and opt.last_grad_norm == math.inf   # torch's get_total_norm's (it was stale)
    assert torch.allclose(mine, ref, rtol=1e-2)
    mine.grad = torch.full((64, 64), float("inf"))   # a non-finite one is still skipped
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    # a finite one whose square overflows too: stepped, its second moment would be inf and its weight stuck
    mine.grad = torch.ones(64, 64)
    mine.grad[0, 0] = 3e19
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 2
    mine.grad = torch.ones(64, 64)
    opt.step()
    assert not opt.last_step_skipped and all(bool(torch.isfinite(v).all()) for v in opt.state[mine].values()
                                             if torch.is_tensor(v))


# ---------------------------------------------------------------- works with schedulers and other dtypes
def test_lr_scheduler_drives_the_step():
    params = make_params()
    opt = HybridAdamW(params, lr=1e-2, weight_decay=0.0, min_8bit_size=1000)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    set_grads(params, 0)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = [p.detach().clone() for p in params]
    set_grads(params, 1)
    opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)  # lr 0: no update
    assert opt.state[params[0]]["step"] == 2  # the moments still advanced


def test_bf16_parameters_use_torch_path():
    params = [torch.nn.Parameter(torch.randn(64, 128).to(torch.bfloat16))]
    ref = [torch.nn.Parameter(params[0].detach().float())]
    opt = HybridAdamW(params, lr=1e-2, optimizer_states="fp32")
    oref = HybridAdamW(ref, lr=1e-2, optimizer_states="fp32")
    g = torch.randn(64, 128)
    params[0].grad = g.to(torch.bfloat16)
    ref[0].grad = g.to(torch.bfloat16).float()
    opt.step()
    oref.step()
    assert params[0].dtype == torch.bfloat16
    assert torch.equal(params[0], ref[0].detach().to(torch.bfloat16))


# ---------------------------------------------------------------- per-layer updates for an engine
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_fused_torch_path_for_device_tensors_matches_the_fp32_update(adamw_mode, coef):
    """The fp32 path for CUDA tensors (torch's fused Adam(W) kernel, in place, the clip coefficient as
    its gradient scale), run here on CPU tensors, follows the fp32 update within a few ulps."""
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=1e-3, weight_decay=0.1, adamw_mode=adamw_mode, optimizer_states="fp32")
    ob = HybridAdamW(pb, lr=1e-3, weight_decay=0.1, adamw_mode=adamw_mode, optimizer_states="fp32")
    for s in range(10):
        set_grads(pa, s)
        set_grads(pb, s)
        oa.step(clip_coef=coef)
        for p in pb:
            st = ob.state[p]
            if not st:
                st = ob._init_state(p, ob.param_groups[0])
            st["step"] += 1
            h = kernels.make_hyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=st["step"],
                                   clip=coef, adamw=adamw_mode)
            H.torch_fused_adam32(p, p.grad, st, 1e-3, h)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-7)


def test_update_uses_the_snapshot_and_the_given_gradients():
    """update(): the snapshot's learning rate (not the live one a scheduler already changed, even when it
    is a tensor changed in place) and the gradients passed in (not .grad, which may have been cleared)."""
    pa, pb = make_params(), make_params()
    oa = HybridAdamW(pa, lr=torch.tensor(1e-3), weight_decay=0.1, optimizer_states="fp32")
    ob = HybridAdamW(pb, lr=float(torch.tensor(1e-3)), weight_decay=0.1, optimizer_states="fp32")
    set_grads(pa, 0)
    set_grads(pb, 0)
    groups = oa.snapshot()
    grads = {p: p.grad for p in pa}
    for p in pa:
        p.grad = None
    oa.param_groups[0]["lr"].fill_(5.0)    # a scheduler moving on in place
    oa.update(pa[:2], clip_coef=0.5, groups=groups, grads=grads)
    oa.update(pa[2:], clip_coef=0.5, groups=groups, grads=grads)
    ob.step(clip_coef=0.5)
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_update_clearing_the_gradients_updates_bit_for_bit_as_without(monkeypatch, kernels_on, grad_dtype):
    """update(zero_grads=True): the same weights, moments and compute copies as update() then zero_() (8-bit
    and fp32 moments, partial last blocks), every given gradient zero afterwards, each clear counted by
    autograd's version counter (the engine's landed square sums trust it); a given gradient whose
    parameter no group holds is cleared too."""
    if kernels_on and kernels.cpu_kernels() is None:
        pytest.skip(f"C++ kernels unavailable: {kernels.build_error()}")
    if not kernels_on:
        monkeypatch.setattr(H, "cpu_kernels", lambda: None)
    shapes = ((37, 333), (300,), (64, 64), (5, 7))
    pa, pb = make_params(shapes=shapes), make_params(shapes=shapes)
    kw = dict(lr=3e-3, weight_decay=0.1, optimizer_states="8bit", min_8bit_size=1000, block_size=96)
    oa, ob = HybridAdamW(pa[:3], **kw), HybridAdamW(pb[:3], **kw)   # the last parameter: in no group
    for o, ps in ((oa, pa), (ob, pb)):
        o.set_compute_copies({p: torch.empty(p.shape, dtype=torch.bfloat16) for p in ps[:3]})
    for step in range(3):
        set_grads(pa, step, heavy=True, dtype=grad_dtype)
        set_grads(pb, step, heavy=True, dtype=grad_dtype)
        ga, gb = {p: p.grad for p in pa}, {p: p.grad for p in pb}
        versions = {p: g._version for p, g in ga.items()}
        oa.update(pa, clip_coef=0.7, groups=oa.snapshot(), grads=ga, zero_grads=True)
        ob.update(pb, clip_coef=0.7, groups=ob.snapshot(), grads=gb)
        for g in gb.values():
            g.zero_()
        assert all(torch.equal(g, torch.zeros_like(g)) and g._version > versions[p] for p, g in ga.items())
        for a, b in zip(pa, pb):
            assert torch.equal(a, b)
            assert torch.equal(oa.compute_copies[a], ob.compute_copies[b]) if a in oa.compute_copies else True
        states_equal(oa, pa[:3], ob, pb[:3])
    assert any("state1" in oa.state[p] for p in pa[:3]) and any("exp_avg" in oa.state[p] for p in pa[:3])


def test_a_skipped_update_still_clears_the_gradients_it_was_given():
    """A non-finite clip coefficient skips the step; with zero_grads the gradients are zero all the same
    (the engine then skips its own pass over them)."""
    params = make_params()
    opt = HybridAdamW(params, lr=1e-3, optimizer_states="fp32")
    set_grads(params, 0)
    before = [p.detach().clone() for p in params]
    grads = {p: p.grad for p in params}
    opt.update(params, clip_coef=float("nan"), groups=opt.snapshot(), grads=grads, zero_grads=True)
    assert opt.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(not g.any() for g in grads.values())


def test_a_gradient_the_kernel_reads_through_a_copy_is_cleared_after(k):
    """A non-contiguous gradient reaches the kernel as a contiguous copy; zero_grads clears the given one,
    and the update is the one its contiguous copy gives."""
    p = torch.nn.Parameter(torch.randn(64, 96) * 0.05)
    ref = torch.nn.Parameter(p.detach().clone())
    g = (torch.randn(96, 64) * 0.01).t()
    assert not g.is_contiguous()
    oa, ob = (HybridAdamW([q], lr=1e-3, optimizer_states="8bit", min_8bit_size=1, block_size=64) for q in (p, ref))
    ob.update([ref], clip_coef=1.0, groups=ob.snapshot(), grads={ref: g.contiguous()})
    oa.update([p], clip_coef=1.0, groups=oa.snapshot(), grads={p: g}, zero_grads=True)
    assert torch.equal(p, ref) and not g.any()


def test_gradients_that_share_memory_are_not_cleared_as_they_are_read():
    """Clearing one of two gradients that share memory would give the other a zero gradient: refused,
    before any update. Views side by side in one buffer (the engine's layout) are cleared."""
    pa = make_params(shapes=((8, 16), (8, 16)))
    opt = HybridAdamW(pa, lr=1e-3, optimizer_states="fp32")
    before = [p.detach().clone() for p in pa]
    shared, flat = torch.randn(8, 16), torch.randn(256)
    for grads in ({pa[0]: shared, pa[1]: shared}, {pa[0]: flat[:128].view(8, 16), pa[1]: flat[64:192].view(8, 16)}):
        with pytest.raises(ValueError, match=r"two of the gradients share memory"):
            opt.update(pa, clip_coef=1.0, groups=opt.snapshot(), grads=grads, zero_grads=True)
        assert all(torch.equal(p, b) for p, b in zip(pa, before)) and shared.any() and flat.all()
    opt.update(pa, clip_coef=1.0, groups=opt.snapshot(), grads={pa[0]: flat[:128].view(8, 16),
                                                              pa[1]: flat[128:].view(8, 16)}, zero_grads=True)
    assert not flat.any() and not any(torch.equal(p, b) for p, b in zip(pa, before))


@pytest.mark.parametrize("states", ["8bit", "fp32"])
def test_clearing_kernels_split_over_threads_update_as_one_thread_does(k, states):
    """The kernels clear each block or chunk on the thread that read it: at 1 and 4 threads (each tensor
    spanning many blocks), the same update, bit for bit, and every gradient zero."""
    shapes = ((300, 1000), (70001,))
    results = []
    kept = torch.get_num_threads()
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            params = make_params(shapes=shapes)
            opt = HybridAdamW(params, lr=1e-3, optimizer_states=states, min_8bit_size=1, block_size=256)
            for step in range(2):
                set_grads(params, step, dtype=torch.bfloat16)
                grads = {p: p.grad for p in params}
                opt.update(params, clip_coef=0.9, groups=opt.snapshot(), grads=grads, zero_grads=True)
                assert all(not g.any() for g in grads.values())
            results.append([p.detach().clone() for p in params])
    finally:
        torch.set_num_threads(kept)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_without_given_gradients_every_grad_of_the_params_is_cleared():
    """update(zero_grads=True) without ``grads`` clears the ``.grad`` of each parameter passed, one in no group
    included, and updates as update() does."""
    pa, pb = make_params(), make_params()
    oa, ob = HybridAdamW(pa[:2], lr=1e-3, optimizer_states="fp32"), HybridAdamW(pb[:2], lr=1e-3, optimizer_states="fp32")
    set_grads(pa, 0)
    set_grads(pb, 0)
    oa.update(pa, clip_coef=1.0, groups=oa.snapshot(), zero_grads=True)
    ob.update(pb, clip_coef=1.0, groups=ob.snapshot())
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert all(not p.grad.any() for p in pa) and all(p.grad.any() for p in pb)


def test_update_runs_no_step_hooks_and_snapshot_keeps_its_groups():
    params = make_params()
    opt = HybridAdamW(params[:2], lr=1e-3, optimizer_states="fp32")
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    set_grads(params, 0)
    groups = opt.snapshot()
    opt.add_param_group({"params": [params[2]]})   # added after the snapshot: not part of this update
    opt.update(params, clip_coef=1.0, groups=groups)
    assert calls == [] and params[2] not in opt.state and all(opt.state[p]["step"] == 1 for p in params[:2])
    opt.step()
    assert calls == ["pre"] and opt.state[params[2]]["step"] == 1


def test_loads_a_torch_adamw_checkpoint():
    """A torch AdamW state_dict (e.g. from a run before switching optimizers) continues as torch AdamW
    would: the group keys HybridAdamW needs come from its defaults, the step counter becomes an int."""
    pa, pb = make_params(), make_params()
    ta = torch.optim.AdamW(pa, lr=1e-3, weight_decay=0.1, foreach=False)
    tb = torch.optim.AdamW(pb, lr=1e-3, weight_decay=0.1, foreach=False)
    run(ta, pa, 3)
    run(tb, pb, 3)
    opt = HybridAdamW(pa, lr=1e-3, weight_decay=0.1, optimizer_states="fp32")
    opt.load_state_dict(ta.state_dict())
    assert opt.param_groups[0]["adamw_mode"] is True and isinstance(opt.state[pa[0]]["step"], int)
    step_both(opt, pa, tb, pb, range(3, 6))
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-7)


def test_loads_a_torch_adamw_checkpoint_of_a_transposed_parameter():
    """torch AdamW makes its moments with zeros_like, so a transposed parameter saves transposed moments;
    loaded as they are, the kernel (which reads state memory as contiguous) would scramble them."""
    pt = [torch.nn.Parameter(torch.randn(80, 48).t())]            # a transposed parameter
    ta = torch.optim.AdamW(pt, lr=1e-2, foreach=False)
    run(ta, pt, 2)
    assert not ta.state[pt[0]]["exp_avg"].is_contiguous()
    ph = [torch.nn.Parameter(pt[0].detach().contiguous())]       # the same values, laid out contiguously
    opt = HybridAdamW(ph, lr=1e-2, optimizer_states="fp32")
    opt.load_state_dict(ta.state_dict())
    assert opt.state[ph[0]]["exp_avg"].is_contiguous()
    step_both(opt, ph, ta, pt, range(2, 5))
    torch.testing.assert_close(ph[0], pt[0], rtol=0, atol=1e-6)


def test_torch_state_dict_goes_back_into_torch_adamw_and_continues_as_it():
    """A HybridAdamW state_dict() loads into torch's AdamW without a word, its 8-bit codes taken as fp32
    numbers, and torch's first step fails (KeyError 'exp_avg'). torch_state_dict() holds what torch's holds:
    fp32 moments (8-bit ones dequantized, as the next step would read them) and the step as a tensor."""
    pa = make_params()
    opt = HybridAdamW(pa, lr=1e-3, weight_decay=0.1)
    run(opt, pa, 3)
    assert {H._kind_of(opt.state[p]) for p in pa} == {"8bit", "fp32"}
    sd = opt.torch_state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is True and sd["param_groups"][0]["foreach"] is None
    adam = HybridAdamW([torch.nn.Parameter(torch.zeros(64, 64))], adamw_mode=False)   # Adam with L2 decay
    assert adam.torch_state_dict()["param_groups"][0]["decoupled_weight_decay"] is False
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    tb = torch.optim.AdamW(pb, lr=1e-3, weight_decay=0.1, foreach=False)
    tb.load_state_dict(sd)
    for i, p in enumerate(pa):
        st = opt.state[p]
        expected = st["exp_avg"] if H._kind_of(st) == "fp32" else dequantize_blockwise(
            st["state1"].reshape(-1), st["absmax1"], H.get_qmap("dynamic", "cpu"), int(st["block_size"])).view(p.shape)
        assert torch.equal(tb.state[pb[i]]["exp_avg"], expected)
        assert tb.state[pb[i]]["step"].item() == 3.0
    ta = torch.optim.AdamW(pa, lr=1e-3, weight_decay=0.1, foreach=False)   # the same state, kept in fp32
    ta.load_state_dict(opt.torch_state_dict())
    step_both(ta, pa, tb, pb, range(3, 6))
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_8bit_moment_written_through_fp32_comes_back_the_same():
    """The signed map ends at -0.99297: a block whose largest magnitude is negative, read as fp32 and
    written back (safe_set_full_optimizer_state, a load converting fp32 moments), was scaled by that
    value's magnitude and came back 0.7% smaller, every value of the block (6.8% after ten round trips)."""
    p = torch.nn.Parameter(torch.zeros(64, 64))
    opt = HybridAdamW([p], lr=1e-3)
    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    g.view(-1)[::256] = -10.0   # each block's largest magnitude negative
    p.grad = g
    opt.step()
    assert H._kind_of(opt.state[p]) == "8bit"
    first = next(opt.fp32_moment_chunks(p, "exp_avg")).clone()
    for _ in range(10):
        opt.set_fp32_moment(p, "exp_avg", next(opt.fp32_moment_chunks(p, "exp_avg")).clone().view(p.shape))
    torch.testing.assert_close(next(opt.fp32_moment_chunks(p, "exp_avg")), first, rtol=1e-6, atol=0)


def test_settings_it_cannot_run_are_refused_wherever_they_come_from():
    p, q = torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(64, 64))
    with pytest.raises(ValueError, match=r"HybridAdamW does not implement maximize=True \(set in a parameter group\)"):
        HybridAdamW([{"params": [p], "maximize": True}])
    opt = HybridAdamW([p])
    with pytest.raises(ValueError, match="block_size must be a multiple of 32 in \\[32, 16384\\], got 65536"):
        opt.add_param_group({"params": [q], "block_size": 65536})
    with pytest.raises(ValueError, match="optimizer_states must be '8bit' or 'fp32', got 'fp23'"):
        opt.add_param_group({"params": [q], "optimizer_states": "fp23"})
    with pytest.raises(ValueError, match="an fp64 parameter would be rounded to fp32 every step"):
        HybridAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))])
    opt.param_groups[0]["block_size"] = 65536                     # edited after construction
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        opt.step()
    torch_opt = torch.optim.AdamW([q], amsgrad=True)
    q.grad = torch.ones_like(q)
    torch_opt.step()
    fresh = HybridAdamW([q], optimizer_states="fp32")
    with pytest.raises(ValueError, match=r"amsgrad=True \(set in the checkpoint's parameter group\)"):
        fresh.load_state_dict(torch_opt.state_dict())
    assert not fresh.state                                        # nothing was loaded


# ---------------------------------------------------------------- non-finite moments in 8-bit blocks
def _huge_and_nan_grads(params, step, poison):
    set_grads(params, step)
    if step == 0:
        params[0].grad[0, 0] = poison


@pytest.mark.parametrize("poison", [2e19, float("nan")])   # 2e19: finite, but its square overflows fp32
@pytest.mark.parametrize("scalar", [False, True])
def test_one_non_finite_moment_leaves_its_block_finite_on_the_kernel_and_torch_paths_alike(k, monkeypatch, poison,
                                                                                           scalar):
    """An overflowed moment made its block's absmax inf: every weight of the block NaN after the next step
    (0 * inf), where torch AdamW keeps the others finite; and the kernel's absmax skipped a NaN that the
    torch path's kept. Both now clamp to finite moments and skip NaN, with the same codes."""
    if scalar and not k.has_avx2:
        pytest.skip("no AVX2 build: the kernel runs its scalar loop anyway")
    pa, pb, pc = make_params(), make_params(), make_params()
    kw = dict(lr=1e-3, optimizer_states="8bit", min_8bit_size=0, check_finite=False)
    oa, ob, oc = HybridAdamW(pa, **kw), HybridAdamW(pb, **kw), torch.optim.AdamW(pc, lr=1e-3, weight_decay=0.0)
    k.set_force_scalar(scalar)
    try:
        for step in range(3):
            _huge_and_nan_grads(pa, step, poison)
            oa.step()
    finally:
        k.set_force_scalar(False)
    with monkeypatch.context() as m:
        m.setattr(H, "cpu_kernels", lambda: None)
        for step in range(3):
            _huge_and_nan_grads(pb, step, poison)
            ob.step()
    for step in range(3):
        _huge_and_nan_grads(pc, step, poison)
        oc.step()
    torch_bad = int((~torch.isfinite(pc[0])).sum())
    assert torch_bad == (0 if poison == 2e19 else 1)   # NaN: the poisoned weight alone, as torch's
    for a, b in zip(pa, pb):
        assert int((~torch.isfinite(a)).sum()) == int((~torch.isfinite(b)).sum()) == (torch_bad if a is pa[0] else 0)
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    states_equal(oa, pa, ob, pb)
    assert "absmax1" in oa.state[pa[0]]   # the poisoned tensor has 8-bit states
    assert all(bool(torch.isfinite(oa.state[p][key]).all()) for p in pa for key in ("absmax1", "absmax2")
               if key in oa.state[p])


def test_quantize_blockwise_refuses_non_finite_values():
    from lazytrain.optim.quantization import quantize_blockwise
    for bad in (float("inf"), float("nan")):
        x = torch.zeros(300)
        x[7] = bad
        for use_kernel in (True, False):
            with pytest.raises(ValueError, match="quantize_blockwise quantizes finite values only; the tensor holds "
                                                 "inf or NaN"):
                quantize_blockwise(x, use_kernel=use_kernel)



def test_an_overflowed_moment_keeps_its_codes_where_denormals_are_flushed(k, monkeypatch):
    """Clamped to FLT_MAX, a block's scale 1 / absmax was subnormal: flushed to 0, every code of the block
    read 0 and the next update of the overflowed weight was 5e19. Moments stop at 2**126."""
    flushed = torch.set_flush_denormal(True)
    try:
        for kernel in (True, False):
            params = make_params()
            opt = HybridAdamW(params, lr=1e-3, optimizer_states="8bit", min_8bit_size=0, check_finite=False)
            with monkeypatch.context() as m:
                if not kernel:
                    m.setattr(H, "cpu_kernels", lambda: None)
                before = None
                for step in range(3):
                    _huge_and_nan_grads(params, step, 2e19)
                    if step == 2:
                        before = params[0].detach().clone()
                    opt.step()
            assert float((params[0] - before).abs().max()) < 1e-2, kernel
            assert int(opt.state[params[0]]["state2"].view(-1)[0]) != 0
    finally:
        torch.set_flush_denormal(False)
    assert flushed in (True, False)


@pytest.mark.parametrize("states", ["8bit", "fp32"])
def test_a_refused_checkpoint_leaves_the_optimizer_as_it_was(states):
    """A checkpoint of another model (its second tensor smaller) is refused part-way through its tensors:
    the groups' settings and every state stay this optimizer's, and the next step is the one it would
    have taken (a moment of another size reached the native kernel before, which wrote past its end)."""
    params, twins = make_params(), make_params()
    opts = [HybridAdamW(ps, lr=1e-3, optimizer_states=states, min_8bit_size=0) for ps in (params, twins)]
    for opt, ps in zip(opts, (params, twins)):
        run(opt, ps, 2)
    other = make_params(shapes=((48, 512), (100,), (40, 130)))
    foreign = HybridAdamW(other, lr=5e-2, optimizer_states=states, min_8bit_size=0)
    run(foreign, other, 3)
    with pytest.raises(ValueError, match=r"checkpoint (state1|exp_avg) of parameter 1 does not match its shape"):
        opts[0].load_state_dict(foreign.state_dict())
    assert opts[0].param_groups[0]["lr"] == 1e-3 and opts[0].state[params[0]]["step"] == 2
    for opt, ps in zip(opts, (params, twins)):
        set_grads(ps, 7)
        opt.step()
    assert all(torch.equal(p, t) for p, t in zip(params, twins))


def test_the_native_kernel_is_never_given_a_state_of_another_size():
    if kernels.cpu_kernels() is None:
        pytest.skip("the compiled host kernels are not built here")
    p = torch.nn.Parameter(torch.zeros(64))
    opt = HybridAdamW([p], lr=1e-3, optimizer_states="fp32")
    p.grad = torch.ones(64)
    opt.step()
    opt.state[p]["exp_avg"] = torch.zeros(32)
    with pytest.raises(RuntimeError, match=r"^HybridAdamW: a parameter of shape \(64,\) has a moment of 32 "
                                           r"elements, not 64$"):
        opt.step()
    for bad in (torch.zeros(64, dtype=torch.bfloat16), torch.zeros(1).expand(64)):
        opt.state[p]["exp_avg"] = bad
        with pytest.raises(RuntimeError, match=r"^HybridAdamW: a parameter of shape \(64,\) has a moment that is "
                                               r"torch\.\S+, (not )?contiguous, on cpu: the host kernel needs "
                                               r"torch\.float32, contiguous, in host memory$"):
            opt.step()


def test_a_checkpoints_8bit_block_size_outside_the_kernels_range_is_refused_at_load():
    """The host kernel holds one block's moments in buffers of the largest block size (16384): a state whose
    block size is larger is refused by load_state_dict, naming it, and the optimizer keeps its own state."""
    p = torch.nn.Parameter(torch.randn(256, 256) * 0.02)
    opt = HybridAdamW([p], lr=1e-3, optimizer_states="8bit", min_8bit_size=64)
    p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sd = opt.state_dict()
    state = sd["state"][0]
    big = 65536
    state["block_size"] = big
    state["absmax1"] = state["absmax1"][:1].clone()   # as many blocks as that size makes: the sizes agree
    state["absmax2"] = state["absmax2"][:1].clone()
    fresh = HybridAdamW([p], lr=1e-3, optimizer_states="8bit", min_8bit_size=64)
    with pytest.raises(ValueError, match=r"^checkpoint state of parameter 0: block_size must be a multiple of 32 in "
                                         r"\[32, 16384\], got 65536$"):
        fresh.load_state_dict(sd)
    assert not fresh.state


def test_loading_an_8bit_state_never_casts_its_codes_to_the_parameters_dtype(monkeypatch):
    """torch's Optimizer.load_state_dict casts every state tensor to its parameter's dtype (8-bit codes to
    fp32: four times their bytes, all at once, during a resume); HybridAdamW builds its states from the
    checkpoint's instead, so torch's load casts nothing. The loaded state is the saved one, bit for bit."""
    p = torch.nn.Parameter(torch.randn(128, 64) * 0.02)
    opt = HybridAdamW([p], lr=1e-3, optimizer_states="8bit", min_8bit_size=64)
    p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sd = opt.state_dict()
    cast = []
    policy = torch.optim.Optimizer._process_value_according_to_param_policy

    def counted(param, value, param_id, param_groups, key=None):
        cast.append(key)
        return policy(param, value, param_id, param_groups, key)
    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(counted))
    fresh = HybridAdamW([p], lr=1e-3, optimizer_states="8bit", min_8bit_size=64)
    fresh.load_state_dict(sd)
    assert cast == []
    for key, v in opt.state[p].items():
        w = fresh.state[p][key]
        assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w, key


@pytest.mark.parametrize("given", ["object-bf16", "callable-fp32"])
def test_an_optimizer_given_to_initialize_keeps_choosing_states_by_the_models_parameter_names(given):
    """A HybridAdamW passed to initialize (an object re-pointed at the fp32 masters in bf16, or a callable the
    engine hands the groups): its fp32_name_patterns still see the model's names, so the embedding and head
    they name keep fp32 moments where their size alone would give them 8-bit ones."""
    import lazytrain
    from engine_models import batches, lm_loss, make_model
    model = make_model("modulelist")
    options = dict(lr=1e-3, min_8bit_size=64, fp32_name_patterns=(r"emb", r"head"))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": float("inf")}
    if given == "object-bf16":
        cfg["bf16"] = {"enabled": True}
        optimizer = HybridAdamW(model.named_parameters(), **options)
    else:
        optimizer = lambda params: HybridAdamW(params, **options)   # noqa: E731
    engine, opt, _, _ = lazytrain.initialize(model=model, optimizer=optimizer, config=cfg,
                                             model_parameters=model.named_parameters())
    x, y = batches(1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    engine.wait_for_update()
    kinds = {r["name"]: r["states"] for r in opt.state_report()}
    assert kinds["emb.weight"] == kinds["head.weight"] == "fp32"
    assert kinds["extra.0.weight"] == "8bit"


def test_add_param_group_takes_named_parameters_as_the_constructor_does():
    a, b = torch.nn.Parameter(torch.zeros(128)), torch.nn.Parameter(torch.zeros(128))
    opt = HybridAdamW([a], lr=1e-3, min_8bit_size=64, fp32_name_patterns=(r"bias",))
    opt.add_param_group({"params": [("layer.bias", b)], "lr": 1e-2})
    assert opt.param_groups[1]["params"] == [b] and opt.param_name(b) == "layer.bias"
    a.grad, b.grad = torch.ones(128), torch.ones(128)
    opt.step()
    assert {r["name"]: r["states"] for r in opt.state_report()}["layer.bias"] == "fp32"


@pytest.mark.parametrize("grad_norm", [None, 2.0])
def test_a_non_finite_clip_coefficient_skips_the_step_beside_a_finite_norm_too(grad_norm):
    """Given with a finite norm, a NaN coefficient went on into the update and made every weight NaN."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = HybridAdamW([p], lr=1e-3, optimizer_states="fp32")
    p.grad = torch.ones(4)
    opt.step(grad_norm=grad_norm, clip_coef=float("nan"))
    assert opt.last_step_skipped and opt.skipped_steps == 1 and torch.equal(p.detach(), torch.ones(4))


@pytest.mark.parametrize("given", [{"grad_norm": -0.5}, {"clip_coef": -3.0}, {"grad_norm": torch.tensor(-1.0)}])
def test_a_negative_norm_or_clip_coefficient_is_refused_before_the_update(given):
    """It went through as a negative coefficient: the step went up the gradient."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = HybridAdamW([p], lr=0.1, max_grad_norm=1.0, optimizer_states="fp32")
    p.grad = torch.ones(4)
    (name, value), = given.items()
    with pytest.raises(ValueError, match=f"^HybridAdamW.step: {name} must be >= 0, got {float(value)}$"):
        opt.step(**given)
    assert torch.equal(p.detach(), torch.zeros(4)) and opt.state[p] == {}


_SET_MESSAGE = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
                "sets will change between runs. Please use a list instead.")


def test_parameters_in_a_set_or_a_bare_tensor_are_refused():
    """A set passed (torch refuses one inside a group only): its order follows id(), and a checkpoint pairs
    moments with parameters by order, so a resume gave same-shaped parameters each other's moments. A bare
    tensor was listed row by row (its rows trained, the tensor not), where torch refuses it."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    for make in (lambda: HybridAdamW({a, b}), lambda: HybridAdamW([{"params": {a, b}}]),
                 lambda: HybridAdamW([a]).add_param_group({"params": {b}})):
        with pytest.raises(TypeError) as e:
            make()
        assert str(e.value) == _SET_MESSAGE
    with pytest.raises(TypeError, match="^params argument given to the optimizer should be an iterable of Tensors "
                                        "or dicts, but got torch.FloatTensor$"):
        HybridAdamW(torch.ones(4, 3))
    assert len(HybridAdamW([{"params": a}]).param_groups[0]["params"]) == 1   # one tensor in a group: as torch


@pytest.mark.parametrize("how", ["model_parameters", "group"])
def test_initialize_refuses_parameters_in_a_set_for_every_optimizer(how):
    """initialize listed the parameters before the optimizer saw them, so torch's own optimizers took a set."""
    import lazytrain
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    params = set(model.parameters())
    with pytest.raises(TypeError) as e:
        lazytrain.initialize(model=model, model_parameters=params if how == "model_parameters" else
                             [{"params": params}], config={"train_batch_size": 2, "optimizer": {"type": "AdamW"}})
    assert str(e.value) == _SET_MESSAGE


def test_a_complex_parameter_is_refused():
    """Stepped through .float(), it lost its imaginary part every step (with torch's casting warning only)."""
    with pytest.raises(ValueError, match="^HybridAdamW keeps real fp32 moments: a complex parameter would lose its "
                                         "imaginary part every step; use torch.optim.AdamW for complex parameters$"):
        HybridAdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))])
