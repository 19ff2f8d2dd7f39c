"""Run a planning call in a child process with a hard deadline.

A MILP solver that overruns its own time limit (HiGHS 1.16's presolve did, by minutes, on some
models) must not hang a training job at start-up. The child is a fresh interpreter running this
module (``python -m lazytrain.planner.isolate``), not a multiprocessing worker: it never re-imports
the caller's script, so a training script needs no ``if __name__ == "__main__":`` guard, and nothing of
the caller's (torch, CUDA, threads) is inherited or needed: the planner is pure Python.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from typing import Any, Callable

from .milp import PlanningError

# what to do when the engine's planning call overran its deadline
ENGINE_PLANNING_ADVICE = ("Write a Plan with `lazytrain plan --json` and use policy \"plan\", "
                          "or use policy \"every_k\"")


class DeadlineExceededError(PlanningError):
    """The child did not answer within its deadline and was stopped."""


_LONGEST_WAIT_S = 1e6   # seconds (11.6 days)


def call_with_deadline(fn: Callable[..., Any], *args: Any, deadline_s: float, what: str = "planning",
                       advice: str = ENGINE_PLANNING_ADVICE, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a child interpreter; its result or its exception, re-raised here, and its
    warnings raised again here.

    Raises :class:`DeadlineExceededError` when the child has not answered within ``deadline_s`` seconds
    (the child is killed; ``advice`` ends the message), :class:`PlanningError` when it ends without an
    answer. ``fn``, its arguments and its result must be picklable (module-level functions, Plans,
    dataclasses)."""
    import lazytrain
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(lazytrain.__file__)))
    env = dict(os.environ)
    # the child finds what this process finds: lazytrain, and modules beside the caller's script
    paths = [package_root] + [os.path.abspath(p or os.curdir) for p in sys.path if os.path.isdir(p or os.curdir)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # a deadline of weeks is none: the OS's waits take at most about 24 days (a time limit of 1e8 s raised
    # OverflowError from deep in subprocess)
    wait = deadline_s if deadline_s < _LONGEST_WAIT_S else None
    try:
        done = subprocess.run([sys.executable, "-m", "lazytrain.planner.isolate"], env=env, capture_output=True,
                              input=pickle.dumps((fn, args, kwargs)), timeout=wait)
    except subprocess.TimeoutExpired:
        raise DeadlineExceededError(f"{what} did not finish within {deadline_s:g} s (the solver overran its "
                                    f"time limit); stopped it" + (f". {advice}" if advice else "")) from None
    try:
        ok, value, caught = pickle.loads(done.stdout)
    except Exception:   # noqa: BLE001 - the child died before answering
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise PlanningError(f"{what} ended without an answer (exit status {done.returncode}): "
                            + (" | ".join(tail) or "no output")) from None
    for message, category in caught:   # the child's warnings (a fallback plan, a model costed by analogy)
        warnings.warn(message, category, stacklevel=2)
    if ok:
        return value
    raise value


def _serve() -> None:
    """The child's side: read (fn, args, kwargs) on stdin, answer (ok, result or exception) on stdout.
    Whatever the solver prints goes to stderr, so stdout carries the answer alone."""
    answer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fn, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")   # the caller's filters decide when they are raised again there
        try:
            result = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            result = (False, e)
    relayed = []
    for w in caught:
        category = w.category
        try:
            pickle.loads(pickle.dumps(category))
        except Exception:  # noqa: BLE001 - a category the caller cannot rebuild: a plain UserWarning
            category = UserWarning
        relayed.append((str(w.message), category))
    relayed = list(dict.fromkeys(relayed))   # once each, as the default filter shows them
    try:
        payload = pickle.dumps((*result, relayed))
        pickle.loads(payload)        # an exception class may pickle but not rebuild (extra __init__ args)
    except Exception:  # noqa: BLE001 - then it still reaches the caller, as text
        payload = pickle.dumps((False, PlanningError(f"{type(result[1]).__name__}: {result[1]}"), relayed))
    answer.write(payload)
    answer.flush()


if __name__ == "__main__":
    _serve()
