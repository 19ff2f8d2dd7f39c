"""The gradient sinks' host add: a layer's bf16 gradient added into its fp32 buffer, as torch's mixed-dtype
add does it (a whole-size fp32 temporary per add) and as lazytrain/engine/host_accumulate.py does it (a piece
at a time through a reused scratch). Same sums, bit for bit (checked here). Then what the step's clipping
norm costs: the buffer's sum of squares taken in that add (as the sinks take it as each layer's gradient
lands) against a pass over the buffer of its own (what the step read from every layer before), the two equal
bit for bit (checked).

    python benchmarks/host_add.py [--numel 51400000] [--reps 7]

The default size is one layer of the 0.95B Llama of benchmarks/engine_gpu.py (hidden 2048)."""
import argparse
import time

import torch

from lazytrain.engine.host_accumulate import add_into, scratch_for, sum_of_squares


def best_and_median(f, reps: int) -> tuple[float, float]:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0], times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=51_400_000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dst = torch.randn(args.numel)
    src = torch.randn(args.numel).to(torch.bfloat16)
    scratch = scratch_for(args.numel)
    start = dst.clone()
    dst.add_(src)
    mixed_result = dst.clone()
    dst.copy_(start)
    add_into(dst, src, scratch)
    assert torch.equal(dst, mixed_result), "the two adds differ"
    print(f"{args.numel / 1e6:.1f}M elements, bf16 into fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; results bit-identical")
    mixed = best_and_median(lambda: dst.add_(src), args.reps)
    pieces = best_and_median(lambda: add_into(dst, src, scratch), args.reps)
    print(f"{'add':<36}{'best ms':>10}{'median ms':>11}")
    print(f"{'torch mixed-dtype add_':<36}{mixed[0] * 1e3:>10.1f}{mixed[1] * 1e3:>11.1f}")
    print(f"{'add_into (pieces through a scratch)':<36}{pieces[0] * 1e3:>10.1f}{pieces[1] * 1e3:>11.1f}")
    print(f"speed-up (median): {mixed[1] / pieces[1]:.2f}x")
    assert add_into(dst, src, scratch, square_sum=True) == sum_of_squares(dst), "the two square sums differ"
    fused = best_and_median(lambda: add_into(dst, src, scratch, square_sum=True), args.reps)
    separate = best_and_median(lambda: sum_of_squares(dst), args.reps)
    print(f"{'add_into + square sum in the add':<36}{fused[0] * 1e3:>10.1f}{fused[1] * 1e3:>11.1f}")
    print(f"{'square sum, a pass of its own':<36}{separate[0] * 1e3:>10.1f}{separate[1] * 1e3:>11.1f}")
    print(f"the norm's cost in the add / in a pass of its own (median): "
          f"{(fused[1] - pieces[1]) / separate[1]:.2f}")


if __name__ == "__main__":
    main()
