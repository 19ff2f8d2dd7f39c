"""Launching ranks in tests: a free rendezvous port, the environment torchrun gives a rank,
:func:`spawn_cases`, which runs several cases in turn in one set of ranks, and :func:`run_groups`, which
runs several process groups side by side. Their processes are forked by a forkserver that imported torch
and LazyTrain once (:func:`forked`)."""
import os
import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_group() -> None:
    """The end of a rank's run: every rank done with its collectives before any tears the process group down
    (torch's advice). A rank of a worker that tore its group down with no barrier once aborted (SIGABRT,
    "terminate called without an active exception") after its work was done."""
    import torch
    if torch.distributed.is_initialized():   # a single process makes no group
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def join_as(rank: int, world: int, port: int) -> None:
    """The launcher's environment for rank ``rank`` of ``world`` on this machine."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def forked():
    """The multiprocessing context the helpers start ranks with: a forkserver that imported torch (with its
    compiler, which torch.optim imports) and LazyTrain once forks each process. A fresh interpreter per rank
    spent about 5 s of CPU on these imports alone. The server starts with the first process of a test run,
    and its children get its environment, not their caller's: what a rank needs goes in its arguments."""
    import multiprocessing
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "lazytrain"])   # read when the server starts
    return ctx


def _join_ending_all_on_a_failure(procs: list) -> None:
    """Waits for every process; once one exits with an error, kills the others (which may wait for it in a
    collective), as ``torch.multiprocessing.spawn`` does."""
    from multiprocessing.connection import wait
    live = {p.sentinel: p for p in procs}
    while live:
        for sentinel in wait(list(live)):
            p = live.pop(sentinel)
            p.join()
            if p.exitcode != 0:
                for other in live.values():
                    other.kill()


def _traced(fn, rank: int, args: tuple, error_path: str) -> None:
    """``fn(rank, *args)``, its traceback written to ``error_path`` if it raises."""
    import traceback
    try:
        fn(rank, *args)
    except BaseException:
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn(fn, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with processes from :func:`forked`: ``fn(rank,
    *args)`` in each; once one fails, the others are killed and a RuntimeError carries its traceback."""
    import tempfile
    with tempfile.TemporaryDirectory() as errors:
        paths = [os.path.join(errors, f"rank{rank}") for rank in range(nprocs)]
        procs = [forked().Process(target=_traced, args=(fn, rank, tuple(args), paths[rank])) for rank in range(nprocs)]
        for p in procs:
            p.start()
        _join_ending_all_on_a_failure(procs)
        failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            told = [open(paths[rank]).read() for rank, _ in failed if os.path.exists(paths[rank])]
            raise RuntimeError(f"ranks that failed (rank, exit code): {failed}\n" + "\n".join(told))


class CaseFailed(Exception):
    """A case of a :func:`spawn_cases` run that did not complete on every rank: the failing rank's error."""


def _run_cases(rank: int, world: int, port: int, root: str, cases: list) -> None:
    """One rank: every case in turn, in this process. A case's result goes to ROOT/NAME/rank<R>.pt; a case
    that raises writes its traceback to ROOT/NAME/rank<R>.error and ends the process (spawn_cases then ends
    the other ranks and reports it)."""
    import traceback
    import warnings

    import torch

    from lazytrain.tiers import streams
    join_as(rank, world, port)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    fresh = torch.get_rng_state()   # each case starts from the generator state of a new process
    for name, fn, kwargs in cases:
        torch.set_rng_state(fresh)
        out_dir = os.path.join(root, name)
        os.makedirs(out_dir, exist_ok=True)
        try:
            result = fn(rank, world, out_dir, **kwargs)
        except BaseException:
            with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
                f.write(traceback.format_exc())
            raise
        streams.configure()   # transfers as configured by default, whatever the case set
        if torch.distributed.is_initialized():   # every rank done with the case before the next begins
            torch.distributed.barrier()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_group()


def spawn_cases(world: int, root, cases: dict) -> dict:
    """Runs ``cases`` (name: (fn, kwargs)) in order on ``world`` ranks, all of them in the same processes (one
    start and one process group for all): each ``fn(rank, world, out_dir, **kwargs)`` returns what its rank
    reports. Returns name: [each rank's report], or name: CaseFailed with the error of a case that failed (the
    cases after it run in new processes)."""
    import pathlib

    import torch
    root = pathlib.Path(root)
    pending, outcomes = list(cases.items()), {}
    while pending:
        port, todo = free_port(), [(n, fn, kw) for n, (fn, kw) in pending]
        ranks = [forked().Process(target=_run_cases, args=(rank, world, port, str(root), todo))
                 for rank in range(world)]
        for p in ranks:
            p.start()
        _join_ending_all_on_a_failure(ranks)
        while pending and all((root / pending[0][0] / f"rank{r}.pt").exists() for r in range(world)):
            name = pending.pop(0)[0]
            outcomes[name] = [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(world)]
        if pending:
            name = pending.pop(0)[0]
            errors = [(root / name / f"rank{r}.error").read_text() for r in range(world)
                      if (root / name / f"rank{r}.error").exists()]
            outcomes[name] = CaseFailed(f"case {name!r} on {world} ranks failed: " + (
                "\n".join(errors) or f"its ranks ended without reporting (exit codes {[p.exitcode for p in ranks]})"))
    return outcomes


def reports(outcomes: dict, name: str) -> list:
    """Each rank's report of case ``name`` of a :func:`spawn_cases` run; a failed case fails the test with the
    rank's error."""
    import pytest
    got = outcomes[name]
    if isinstance(got, CaseFailed):
        pytest.fail(str(got), pytrace=False)
    return got


class Group:
    """One process group for :func:`run_groups`: ``world`` processes ``target(rank, port, *args)``, of which
    those in ``awaited`` are waited for (the others are killed once they end: a rank stopped with SIGSTOP,
    for one)."""

    def __init__(self, target, args: tuple, world: int = 2, awaited=(0,)):
        self.target, self.args, self.world, self.awaited = target, tuple(args), world, tuple(awaited)


class GroupOutcome:
    """What :func:`run_groups` saw of one group: each rank's exit code (negative: the signal that ended it,
    ``-SIGKILL`` for a rank killed once the awaited ranks ended) and the seconds from the group's start to
    each awaited rank's end (None: not by the deadline)."""

    def __init__(self, exitcodes: list, seconds: dict):
        self.exitcodes, self.seconds = exitcodes, seconds


def run_groups(groups: list, timeout: float = 120.0) -> list:
    """Runs independent process groups side by side, each on a rendezvous port of its own. Each test that
    stops or fails a rank on purpose waits out a timeout; side by side, their waits overlap.

    Waits up to ``timeout`` seconds in all for the awaited ranks of every group, then kills every rank still
    running. Returns a :class:`GroupOutcome` per group, in order."""
    from multiprocessing.connection import wait
    ctx = forked()
    started, procs = [], []
    for group in groups:
        port = free_port()
        procs.append([ctx.Process(target=group.target, args=(rank, port, *group.args))
                      for rank in range(group.world)])
        for p in procs[-1]:
            p.start()
        started.append(time.monotonic())
    ended = {}
    deadline = time.monotonic() + timeout
    waiting = {p.sentinel: (g, rank) for g, (group, ps) in enumerate(zip(groups, procs))
               for rank, p in enumerate(ps) if rank in group.awaited}
    while waiting and time.monotonic() < deadline:
        for sentinel in wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
            g, rank = waiting.pop(sentinel)
            ended[g, rank] = time.monotonic() - started[g]
    outcomes = []
    for g, (group, ps) in enumerate(zip(groups, procs)):
        for p in ps:
            if p.is_alive():
                p.kill()
            p.join()
        outcomes.append(GroupOutcome([p.exitcode for p in ps], {rank: ended.get((g, rank)) for rank in group.awaited}))
    return outcomes
