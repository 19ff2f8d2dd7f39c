"""What the layout guard's per-pass check costs (lazytrain/engine/layout_guard.py): a training pass verifies
the model's module tree and parameters by identity. Synthetic models of N two-parameter linear layers in
blocks of 8 (a MoE-like tree), the median of 50 checks each, on this CPU.

    python benchmarks/layout_guard_cost.py
"""
import argparse
import statistics
import time

from torch import nn

from lazytrain.engine.layout_guard import LayoutGuard


def model_of(linears: int) -> nn.Module:
    blocks = [nn.ModuleList([nn.Linear(2, 2) for _ in range(8)]) for _ in range(linears // 8)]
    return nn.ModuleDict({"blocks": nn.ModuleList(blocks), "head": nn.Linear(2, 2)})


def main() -> None:
    print(f"{'parameters':>10}  {'modules':>8}  {'check, training pass':>21}  {'per parameter':>13}  "
          f"{'evaluation pass, nothing assigned':>33}")
    for linears in (80, 5_800, 14_500):
        model = model_of(linears)
        guard = LayoutGuard(model, blocks=list(model["blocks"]))   # each group of 8 a streamed block
        n_params = sum(1 for _ in model.parameters())
        n_modules = sum(1 for _ in model.modules())

        def median(training: bool) -> float:
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                guard.check(training)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        train, evaluate = median(True), median(False)
        print(f"{n_params:>10}  {n_modules:>8}  {train * 1e3:>18.3f} ms  {train / n_params * 1e6:>10.3f} us  "
              f"{evaluate * 1e6:>30.2f} us")
        guard.remove()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
