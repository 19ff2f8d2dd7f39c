"""How far the squared L2 norm of one large fp32 host gradient is from its fp64 value: torch's CPU norm
(``torch._foreach_norm``, what ``clip_grad_norm_`` and the engine used for the embedding's and head's host
gradients) against LazyTrain's sum of squares (``host_accumulate.sum_of_squares``: fp32 rows of 16384, fp64
across them, the layers' way), with the time each takes.

    python benchmarks/norm_accuracy.py [--max-log2 28]

A 128k-vocabulary embedding of width 4096 is 2^29 elements."""
import argparse
import time

import torch

from lazytrain.engine.host_accumulate import sum_of_squares


def timed(f):
    f()
    t0 = time.perf_counter()
    value = f()
    return value, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-log2", type=int, default=28)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; relative error of the squared norm")
    print(f"{'elements':>12}{'torch _foreach_norm':>22}{'ms':>8}{'sum_of_squares':>18}{'ms':>8}")
    g = torch.Generator().manual_seed(0)
    for log2 in range(20, args.max_log2 + 1, 2):
        t = torch.randn(1 << log2, generator=g)
        exact = float(t.double().square().sum())
        torch_value, torch_s = timed(lambda: float(torch._foreach_norm([t], 2.0)[0]) ** 2)
        ours, ours_s = timed(lambda: sum_of_squares(t))
        print(f"{t.numel():>12}{torch_value / exact - 1:>22.2e}{torch_s * 1e3:>8.1f}"
              f"{ours / exact - 1:>18.2e}{ours_s * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
