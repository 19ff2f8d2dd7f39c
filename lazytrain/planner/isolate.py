"""Run a planning call in a child process with a hard deadline.

A MILP solver that overruns its own time limit (HiGHS 1.16's presolve did, by minutes, on some
models) must not hang a training job at start-up. The child is a fresh interpreter ("spawn"): the
planner is pure Python, so nothing of the caller's (torch, CUDA, threads) is inherited or needed.
"""
from __future__ import annotations

import multiprocessing
from typing import Any, Callable

from .milp import PlanningError


def call_with_deadline(fn: Callable[..., Any], *args: Any, deadline_s: float, what: str = "planning",
                       **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned child; its result or its exception, re-raised here.

    Raises :class:`PlanningError` when the child has not answered within ``deadline_s`` seconds (the
    child is terminated) or dies without an answer. ``fn``, its arguments and its result must be
    picklable (module-level functions, Plans, dataclasses)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:   # leaving the block terminates the child, finished or not
        pending = pool.apply_async(fn, args, kwargs)
        try:
            return pending.get(deadline_s)
        except multiprocessing.TimeoutError:
            raise PlanningError(f"{what} did not finish within {deadline_s:g} s (the solver overran its time "
                                f"limit); stopped it. Write a Plan with `lazytrain plan --json` and use policy "
                                f"\"plan\", or use policy \"every_k\"") from None
