"""One layer's host update with its gradient buffer cleared after it, two ways: HybridAdamW's update, then a
pass of its own over the fp32 gradient (``zero_()``: what the engine did after each layer's update), against
the update clearing each block of the gradient as its compiled kernel reads it (``update(zero_grads=True)``,
what the engine's overlapped layer updates do). Both leave the same weights, moments and compute copy, bit
for bit (checked here), and a zero gradient.

The two ways run alternately, ``--reps`` times each, each repetition from the same gradient (the weights
and moments go on from one to the next: every repetition does the same work), and the medians are
compared. 8-bit moments with a bf16 compute copy, as the engine runs a streamed layer.

    python benchmarks/update_clear.py [--numel 51400000] [--reps 9]

The default size is one layer of the 0.95B Llama of benchmarks/engine_gpu.py (hidden 2048)."""
import argparse
import copy
import time

import torch

from lazytrain.optim.hybrid_adamw import HybridAdamW
from lazytrain.optim.kernels import build_error, cpu_kernels


def make(numel: int):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel) * 0.02)
    opt = HybridAdamW([p], lr=1e-4, weight_decay=0.01, optimizer_states="8bit")
    opt.set_compute_copies({p: torch.empty(numel, dtype=torch.bfloat16)})
    grad = torch.randn(numel) * 1e-3
    opt.update([p], clip_coef=1.0, groups=opt.snapshot(), grads={p: grad.clone()})   # moments exist
    return p, opt, grad


def one_update(p, opt, g: torch.Tensor, fused: bool) -> float:
    """Seconds of one update and its clear; ``g`` is cleared."""
    groups = opt.snapshot()
    t0 = time.perf_counter()
    if fused:
        opt.update([p], clip_coef=1.0, groups=groups, grads={p: g}, zero_grads=True)
    else:
        opt.update([p], clip_coef=1.0, groups=groups, grads={p: g})
        g.zero_()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=51_400_000)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    if cpu_kernels() is None:
        raise SystemExit(f"LazyTrain's host kernels did not build: {build_error()}")
    p, opt, grad = make(args.numel)
    start_p, start_state = p.detach().clone(), copy.deepcopy(opt.state[p])
    results = {}
    for fused in (False, True):   # the same result both ways
        p.data.copy_(start_p)
        opt.state[p] = copy.deepcopy(start_state)
        g = grad.clone()
        one_update(p, opt, g, fused)
        assert not g.any()
        results[fused] = (p.detach().clone(), copy.deepcopy(opt.state[p]), opt.compute_copies[p].clone())
    (pa, sa, ca), (pb, sb, cb) = results[False], results[True]
    assert torch.equal(pa, pb) and torch.equal(ca, cb)
    assert all(torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k] for k in sa)
    times = {False: [], True: []}
    g = torch.empty_like(grad)
    for _ in range(args.reps):
        for fused in (False, True):
            g.copy_(grad)
            times[fused].append(one_update(p, opt, g, fused))
    median = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    print(f"{args.numel / 1e6:.1f}M parameters, 8-bit moments, bf16 compute copy, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.reps} reps each, alternating; results bit-identical")
    print(f"update, then zero_() of the gradient: median {median[False]:.1f} ms")
    print(f"update clearing the gradient as it reads it: median {median[True]:.1f} ms")
    print(f"separate clear / cleared in the update (median): {median[False] / median[True]:.2f}x")


if __name__ == "__main__":
    main()
