"""How far one fp32 ulp of the gradient-clipping coefficient moves a test model's training: plain PyTorch
(tests/engine_models.py ``reference_train``: 3 steps, clipping at 1.0) against itself with
``clip_grad_norm_``'s coefficient moved one ulp up, then down, at every step; prints the largest relative
weight difference (``max_rel_diff``, the parity tests' measure) for each model kind and reference optimizer.

The engine sums its gradient norm in another order than torch (per layer buffer, not per parameter), so its
clip coefficient may sit an ulp from the reference's: where a model moves more than a parity test's tolerance
for one ulp, that tolerance can only pass by luck.

    python benchmarks/clip_sensitivity.py [--kinds parallel,between,in-place,modulelist]
"""
import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from engine_models import batches, make_model, max_rel_diff, reference_train  # noqa: E402


def _clip_moved(ulps: int):
    """torch's clip_grad_norm_ (norm of the per-parameter norms, coefficient max_norm / (norm + 1e-6) clamped
    at 1), its coefficient moved ``ulps`` (+1 or -1) fp32 ulp."""
    toward = torch.tensor(float("inf") if ulps > 0 else float("-inf"))

    def clip(parameters, max_norm, *args, **kwargs):
        params = [p for p in parameters if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        coef = torch.nextafter(torch.clamp(max_norm / (norm + 1e-6), max=1.0), toward)
        for p in params:
            p.grad.mul_(coef)
        return norm
    return clip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="parallel,between,in-place,modulelist")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    data = batches(3)
    real = torch.nn.utils.clip_grad_norm_
    print(f"{'model':<12}{'optimizer':<10}{'+1 ulp':>10}{'-1 ulp':>10}")
    for kind in args.kinds.split(","):
        for optimizer in ("torch", "hybrid"):
            base = reference_train(make_model(kind), data, optimizer=optimizer)
            moved = []
            for ulps in (1, -1):
                torch.nn.utils.clip_grad_norm_ = _clip_moved(ulps)
                try:
                    moved.append(max_rel_diff(reference_train(make_model(kind), data, optimizer=optimizer), base))
                finally:
                    torch.nn.utils.clip_grad_norm_ = real
            print(f"{kind:<12}{optimizer:<10}{moved[0]:>10.2e}{moved[1]:>10.2e}")


if __name__ == "__main__":
    main()
