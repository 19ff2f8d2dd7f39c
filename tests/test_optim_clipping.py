"""Fast clipping: global norm and coefficient bit-identical to torch.nn.utils.clip_grad_norm_."""
import math

import torch

from lazytrain.optim.clipping import clip_coefficient, combine_norms, global_grad_norm, tensor_norms


def grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 3 for s in ((300, 70), (1000,), (17, 19, 3), (1,))]


def test_global_norm_and_coefficient_equal_clip_grad_norm():
    gs = grads()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
    for p, g in zip(params, gs):
        p.grad = g.clone()
    norm, finite = global_grad_norm(gs)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    assert finite and torch.equal(norm, total)
    coef = clip_coefficient(norm, 1.0)
    for p, g in zip(params, gs):
        assert torch.equal(p.grad, g * coef)  # what the fused update computes per element
    assert clip_coefficient(norm, 1e9).item() == 1.0


def test_per_tensor_norms_combine_to_the_global_norm():
    gs = grads(1)
    norms = tensor_norms(gs)
    assert len(norms) == len(gs) and all(n.dtype == torch.float32 for n in norms)
    total, finite = combine_norms(norms)
    assert finite and torch.equal(total, torch.nn.utils.get_total_norm(gs))
    # per-layer partial sums (what a streaming engine computes) agree to fp32 rounding
    layer_a, _ = global_grad_norm(gs[:2])
    layer_b, _ = global_grad_norm(gs[2:])
    combined, _ = combine_norms([layer_a, layer_b])
    assert math.isclose(combined.item(), total.item(), rel_tol=1e-6)


def test_low_precision_gradients_accumulate_in_fp32():
    g = torch.full((100_000,), 0.01).to(torch.bfloat16)
    norm, finite = global_grad_norm([g])
    assert norm.dtype == torch.float32 and finite
    exact = math.sqrt(100_000) * float(torch.tensor(0.01).to(torch.bfloat16))
    assert math.isclose(norm.item(), exact, rel_tol=2e-4)  # a bf16 result would be off by up to 4e-3


def test_non_finite_detected():
    for bad in (float("inf"), float("nan")):
        gs = grads()
        gs[2][1, 2, 0] = bad
        norm, finite = global_grad_norm(gs)
        assert not finite and not math.isfinite(norm.item())
    assert combine_norms([1.0, float("inf")])[1] is False
    assert global_grad_norm([]) == (torch.tensor(0.0), True)
