"""How the planner's MILP scales with the number of layers: build time, solve time and wall time against the
time limit, with the solver's status and gap, on the paper's 27B shape with its layer count varied.

    python benchmarks/planner_scale.py [--layers 32 64 128 256] [--limits 1 10]

The time limit bounds the whole call (building included); the solver starts from keep-all, so a plan exists
from its first moment. HiGHS is interrupted at the deadline through its callbacks, which it calls between
simplex iterations and B&B nodes but not inside every root phase: the wall column shows by how much a limit
is overrun."""
import argparse
import time
import warnings

from lazytrain.planner.hardware import load_profile
from lazytrain.planner.milp import MilpOptions
from lazytrain.planner.models import layers_of
from lazytrain.planner.problem import Budgets, Problem
from lazytrain.planner.search import solve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[32, 64, 96, 128, 256])
    ap.add_argument("--limits", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--micro-batch", type=int, default=32)
    args = ap.parse_args()
    hw = load_profile(args.hardware)
    print(f"{'layers':>6} {'limit s':>7} {'wall s':>7} {'build s':>7} {'solve s':>7}  {'status':<9} {'gap':>8}  "
          f"{'step s':>8}  policy")
    for L in args.layers:
        model = layers_of("paper-27b", L)
        p = Problem(model=model, hardware=hw, budgets=Budgets.of(gpu="140GB", host="2TB"),
                    micro_batch=args.micro_batch, seq_len=1024)
        for limit in args.limits:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = solve(p, MilpOptions(time_limit_s=limit))
            wall = time.perf_counter() - t0
            s = plan.prediction["solver"]
            gap = s.get("gap")
            print(f"{L:>6} {limit:>7g} {wall:>7.1f} {s.get('build_time_s', 0):>7.2f} {s.get('solve_time_s', 0):>7.2f}"
                  f"  {s['status'][:9]:<9} {('-' if gap is None else f'{gap:.2%}'):>8}  "
                  f"{plan.prediction['step_time_s']:>8.3f}  {plan.policy}", flush=True)


if __name__ == "__main__":
    main()
