"""How the planner's MILP scales with the number of layers: build time, solve time and wall time against the
time limit, with the solver's status and gap, on the paper's 27B shape with its layer count varied; with
``--paper``, also the paper's eight scenarios. Each row is solved with each way of writing the memory rows
given (``--memory-rows``: auto, dense, running; see MilpOptions.memory_rows), side by side.

    python benchmarks/planner_scale.py [--layers 32 64 128 256] [--limits 1 10] [--memory-rows dense running] [--paper]

The time limit bounds the whole call (building included); the solver starts from keep-all, so a plan exists
from its first moment. HiGHS is interrupted at the deadline through its callbacks, which it calls between
simplex iterations and B&B nodes but not inside every root phase or heuristic: the wall column shows by how
much a limit is overrun."""
import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lazytrain.planner.hardware import CATALOG, load_profile               # noqa: E402
from lazytrain.planner.milp import DENSE_ROWS_UP_TO, MilpOptions          # noqa: E402
from lazytrain.planner.models import catalog_model, layers_of            # noqa: E402
from lazytrain.planner.policies import PAPER, PAPER_GPU_CAP, PAPER_SEQ   # noqa: E402
from lazytrain.planner.problem import Budgets, Problem                    # noqa: E402
from lazytrain.planner.search import solve                                # noqa: E402


def run(name: str, p: Problem, limit: float, rows: str) -> float:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = solve(p, MilpOptions(time_limit_s=limit, memory_rows=rows))
    wall = time.perf_counter() - t0
    s = plan.prediction["solver"]
    gap = s.get("gap")
    used = rows if rows != "auto" else ("dense" if p.L <= DENSE_ROWS_UP_TO else "running")
    print(f"{name:<22} {limit:>7g} {used:<8} {wall:>7.1f} {s.get('build_time_s', 0):>7.2f} "
          f"{s.get('solve_time_s', 0):>7.2f}  {s['status'][:9]:<9} {('-' if gap is None else f'{gap:.2%}'):>8}  "
          f"{plan.prediction['step_time_s']:>8.3f}  {plan.policy}", flush=True)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[32, 64, 96, 128, 256])
    ap.add_argument("--limits", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--memory-rows", nargs="+", default=["auto"], choices=["auto", "dense", "running"])
    ap.add_argument("--paper", action="store_true", help="also the paper's eight scenarios (at the last limit)")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--micro-batch", type=int, default=32)
    args = ap.parse_args()
    hw = load_profile(args.hardware)
    print(f"{'problem':<22} {'limit s':>7} {'rows':<8} {'wall s':>7} {'build s':>7} {'solve s':>7}  {'status':<9} "
          f"{'gap':>8}  {'step s':>8}  policy")
    for L in args.layers:
        p = Problem(model=layers_of("paper-27b", L), hardware=hw, budgets=Budgets.of(gpu="140GB", host="2TB"),
                    micro_batch=args.micro_batch, seq_len=1024)
        for limit in args.limits:
            for rows in args.memory_rows:
                run(f"27B shape, {L} layers", p, limit, rows)
    if args.paper:
        total = {rows: 0.0 for rows in args.memory_rows}
        for (gpu, model), systems in PAPER.items():
            batch = systems["lazytrain"][0]
            p = Problem(model=catalog_model(model), hardware=CATALOG[gpu], budgets=Budgets.of(gpu=PAPER_GPU_CAP[gpu]),
                        micro_batch=batch, seq_len=PAPER_SEQ)
            for rows in args.memory_rows:
                total[rows] += run(f"{gpu} {model} x{batch}", p, args.limits[-1], rows)
        print("paper scenarios, total wall s: " + ", ".join(f"{rows} {t:.1f}" for rows, t in total.items()))


if __name__ == "__main__":
    main()
