"""LazyTrain's planner: pure Python (never imports torch).

(model shape, hardware profile, budgets) -> :class:`Plan`: which boundaries to keep and on which tier,
which layers to recompute, in which window each transfer runs, which layers keep their weights on the
GPU. Modules: ``models`` / ``hardware`` (catalogs and readers), ``problem`` (the cost model shared by
everything), ``simulate`` (discrete-event replay of a Plan), ``policies`` (MegaTrain and other
baselines, calibration), ``milp`` (the step-time MILP), ``ceiling`` (step floors of whole plan spaces), ``search`` (``plan_for`` and the micro-batch
search), ``report`` / ``plot`` (tables and Gantt charts), ``cli`` (``lazytrain plan``).
"""
from .plan import Plan, PlanError, every_k_plan, keep_all_plan

__all__ = ["Plan", "PlanError", "every_k_plan", "keep_all_plan", "plan_for", "Budgets", "HardwareProfile",
           "ModelShape", "Problem", "simulate", "InfeasibleBudgetError"]


def __getattr__(name):   # lazy: importing the Plan contract does not load PuLP
    if name == "plan_for":
        from .search import plan_for
        return plan_for
    if name in ("Budgets", "Problem", "InfeasibleBudgetError"):
        from . import problem
        return getattr(problem, name)
    if name == "HardwareProfile":
        from .hardware import HardwareProfile
        return HardwareProfile
    if name == "ModelShape":
        from .models import ModelShape
        return ModelShape
    if name == "simulate":
        from .simulate import simulate
        return simulate
    raise AttributeError(f"module 'lazytrain.planner' has no attribute {name!r}")
