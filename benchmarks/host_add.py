"""The gradient sinks' host add: a layer's bf16 gradient added into its fp32 buffer, as torch's mixed-dtype
add does it (a whole-size fp32 temporary per add), as lazytrain/engine/host_accumulate.py does it with
torch's ops (a piece at a time through a reused scratch) and with LazyTrain's compiled host kernels (one pass,
lazytrain/optim/kernels). Same sums, bit for bit (checked here). Then what the step's clipping norm costs: the
buffer's sum of squares taken in that add (as the sinks take it as each layer's gradient lands), each way,
against a pass over the buffer of its own (what the step reads from a buffer whose sum was not taken so), the
two equal bit for bit within each way (checked). Last, the compiled pass into a buffer known zero (a
micro-batch's first gradient after the step cleared it: ``0 + src`` written without reading the buffer).

    python benchmarks/host_add.py [--numel 51400000] [--reps 7]

The default size is one layer of the 0.95B Llama of benchmarks/engine_gpu.py (hidden 2048)."""
import argparse
import contextlib
import time

import torch

from lazytrain.engine import host_accumulate
from lazytrain.engine.host_accumulate import add_into, scratch_for, sum_of_squares
from lazytrain.optim.kernels import build_error, cpu_kernels


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
    if cpu_kernels() is None:
        raise SystemExit(f"LazyTrain's host kernels did not build: {build_error()}")
    dst = torch.randn(args.numel)
    src = torch.randn(args.numel).to(torch.bfloat16)
    scratch = scratch_for(args.numel)
    start = dst.clone()
    dst.add_(src)
    mixed_result = dst.clone()
    for way in WAYS:
        with way_of_adding(way):
            dst.copy_(start)
            add_into(dst, src, scratch)
            assert torch.equal(dst, mixed_result), f"{way}: the add differs from torch's"
    print(f"{args.numel / 1e6:.1f}M elements, bf16 into fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; results bit-identical")
    print(f"{'add':<48}{'best ms':>10}{'median ms':>11}")
    mixed = best_and_median(lambda: dst.add_(src), args.reps)
    print(f"{'torch mixed-dtype add_':<48}{mixed[0] * 1e3:>10.1f}{mixed[1] * 1e3:>11.1f}")
    median = {}
    for way in WAYS:
        with way_of_adding(way):
            assert add_into(dst, src, scratch, square_sum=True) == sum_of_squares(dst), \
                f"{way}: the two square sums differ"
            for label, f in ((f"add_into ({way})", lambda: add_into(dst, src, scratch)),
                             (f"add_into + square sum ({way})", lambda: add_into(dst, src, scratch, square_sum=True)),
                             (f"square sum, a pass of its own ({way})", lambda: sum_of_squares(dst))):
                best, median[label] = best_and_median(f, args.reps)
                print(f"{label:<48}{best * 1e3:>10.1f}{median[label] * 1e3:>11.1f}")
    # a micro-batch's first gradient after the step's clear: the buffer is known zero, so the compiled pass
    # writes 0 + src without reading it (the same bits as the add into zeros: checked). Both ways into a buffer
    # just cleared, alternating, as the sinks meet it
    zeros, expected = torch.zeros_like(dst), torch.zeros_like(dst)
    assert add_into(zeros, src, scratch, square_sum=True, dst_is_zero=True) == \
        add_into(expected, src, scratch, square_sum=True) and torch.equal(zeros, expected)
    into_zero = {False: [], True: []}
    for _ in range(args.reps):
        for known in (False, True):
            zeros.zero_()
            t0 = time.perf_counter()
            add_into(zeros, src, scratch, square_sum=True, dst_is_zero=known)
            into_zero[known].append(time.perf_counter() - t0)
    cleared = {known: sorted(t)[len(t) // 2] for known, t in into_zero.items()}
    print(f"{'add_into + square sum, into a cleared buffer':<48}{'':>10}{cleared[False] * 1e3:>11.1f}")
    print(f"{'  the same, told the buffer is zero':<48}{'':>10}{cleared[True] * 1e3:>11.1f}")
    pieces, passes = (median[f"add_into + square sum ({way})"] for way in WAYS)
    print(f"add and square sum, torch pieces / compiled pass (median): {pieces / passes:.2f}x")
    print(f"into a cleared buffer, added / written unread (median, alternating): "
          f"{cleared[False] / cleared[True]:.2f}x")
    print(f"torch mixed add_ / compiled add (median): {mixed[1] / median['add_into (compiled pass)']:.2f}x")


WAYS = ("torch pieces", "compiled pass")


@contextlib.contextmanager
def way_of_adding(way: str):
    """host_accumulate's torch pieces (its compiled kernels set aside) or its compiled pass."""
    kept = host_accumulate._kernels_for
    if way == "torch pieces":
        host_accumulate._kernels_for = lambda dst: None
    try:
        yield
    finally:
        host_accumulate._kernels_for = kept


if __name__ == "__main__":
    main()
