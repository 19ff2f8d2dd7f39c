"""Launching ranks in tests: a free rendezvous port, the environment torchrun gives a rank,
:func:`spawn_cases`, which runs several cases in turn in one set of ranks, and :func:`run_groups`, which
runs several process groups side by side. Their processes are forked by a forkserver that imported torch
and LazyTrain once (:func:`forked`)."""
import os
import socket
import time


def free_port() -> int:
    """A rendezvous port free now, below the kernel's ephemeral range: one the kernel hands out (``bind`` to port
    0) may be taken, before rank 0 listens on it, by an outgoing connection of ranks already running (gloo opens
    many), and rank 0 then failed with EADDRINUSE."""
    import random
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for port in random.sample(range(10000, low), min(200, max(0, low - 10000))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # no such range here: the kernel's choice
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
    spent about 5 s of CPU on these imports alone. The server starts with the first process of a test run;
    each rank runs through :func:`_traced`, which gives it what a fresh interpreter would have but string
    hashing: every forked rank hashes strings alike (PYTHONHASHSEED is read at start). The torchrun tests
    (test_engine_sharded, test_huggingface) start interpreters of their own."""
    import multiprocessing
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "lazytrain"])   # read when the server starts
    return ctx


def _start(fn, args: tuple, error_path: str, label: str):
    """A started process of :func:`forked` running ``fn(*args)`` through :func:`_traced`, with the caller's
    environment as it is now."""
    p = forked().Process(target=_traced, args=(fn, tuple(args), error_path, label, dict(os.environ)))
    p.start()
    return p


def _traced(fn, args: tuple, error_path: str, label: str, env: dict) -> None:
    """``fn(*args)`` in a forked child as in a fresh interpreter: the caller's environment (the server's is
    the one it started with), and the random generators seeded anew (torch seeds each new process at random;
    forked children would share the server's state). A traceback goes to ``error_path``, headed ``label``."""
    import random
    import sys
    import traceback

    import torch
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        fn(*args)
    except BaseException:
        with open(error_path, "w") as f:
            f.write(f"{label}: {traceback.format_exc()}")
        raise


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


def _told(paths: list, procs: list) -> str:
    """What the ranks that failed said: each one's exit code, then the tracebacks written."""
    told = [open(path).read() for path in paths if os.path.exists(path)]
    return f"exit codes by rank: {[p.exitcode for p in procs]}" + "".join(f"\n{t}" for t in told)


def spawn(fn, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with processes from :func:`forked`: ``fn(rank,
    *args)`` in each; once one fails, the others are killed and a RuntimeError carries what each said."""
    import tempfile
    with tempfile.TemporaryDirectory() as errors:
        paths = [os.path.join(errors, f"rank{rank}") for rank in range(nprocs)]
        procs = [_start(fn, (rank, *args), paths[rank], f"rank {rank}") for rank in range(nprocs)]
        _join_ending_all_on_a_failure(procs)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"ranks failed: {_told(paths, procs)}")


class CaseFailed(Exception):
    """A case of a :func:`spawn_cases` run that did not complete on every rank: the failing rank's error."""


def _run_cases(rank: int, world: int, port: int, root: str, cases: list) -> None:
    """One rank: every case in turn, in this process. A case's result goes to ROOT/NAME/rank<R>.pt; a case
    that raises ends the process (spawn_cases then ends the other ranks and reports it)."""
    import warnings

    import torch

    from lazytrain.tiers import streams
    join_as(rank, world, port)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    fresh = torch.get_rng_state()   # each case starts from this process's first generator state
    for name, fn, kwargs in cases:
        torch.set_rng_state(fresh)
        out_dir = os.path.join(root, name)
        os.makedirs(out_dir, exist_ok=True)
        result = fn(rank, world, out_dir, **kwargs)
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
        errors = [root / f"rank{rank}.error" for rank in range(world)]   # what a rank raised, in a case or not
        for path in errors:
            path.unlink(missing_ok=True)
        ranks = [_start(_run_cases, (rank, world, port, str(root), todo), str(errors[rank]), f"rank {rank}")
                 for rank in range(world)]
        _join_ending_all_on_a_failure(ranks)
        while pending and all((root / pending[0][0] / f"rank{r}.pt").exists() for r in range(world)):
            name = pending.pop(0)[0]
            outcomes[name] = [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(world)]
        if pending:
            name = pending.pop(0)[0]
            outcomes[name] = CaseFailed(f"case {name!r} on {world} ranks failed: {_told(errors, ranks)}")
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
    each awaited rank's end (None: not by the deadline); ``said``: the exit codes and any rank's traceback,
    for an assertion's message."""

    def __init__(self, exitcodes: list, seconds: dict, said: str):
        self.exitcodes, self.seconds, self.said = exitcodes, seconds, said


def run_groups(groups: list, timeout: float = 120.0) -> list:
    """Runs independent process groups side by side, each on a rendezvous port of its own. Each test that
    stops or fails a rank on purpose waits out a timeout; side by side, their waits overlap.

    Waits up to ``timeout`` seconds in all for the awaited ranks of every group, then kills every rank still
    running (and every rank started, if this raises). Returns a :class:`GroupOutcome` per group, in order."""
    import tempfile
    from multiprocessing.connection import wait
    started, procs, ended = [], [], {}
    with tempfile.TemporaryDirectory() as errors:   # tracebacks: a rank's own .err files are the tests'
        try:
            for g, group in enumerate(groups):
                port = free_port()
                procs.append([_start(group.target, (rank, port, *group.args), os.path.join(errors, f"{g}.{rank}"),
                                     f"group {g} rank {rank}") for rank in range(group.world)])
                started.append(time.monotonic())
            deadline = time.monotonic() + timeout
            waiting = {p.sentinel: (g, rank) for g, (group, ps) in enumerate(zip(groups, procs))
                       for rank, p in enumerate(ps) if rank in group.awaited}
            while waiting and time.monotonic() < deadline:
                for sentinel in wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
                    g, rank = waiting.pop(sentinel)
                    ended[g, rank] = time.monotonic() - started[g]
        finally:
            for p in (p for ps in procs for p in ps):
                if p.is_alive():
                    p.kill()
                p.join()
        said = [_told([os.path.join(errors, f"{g}.{rank}") for rank in range(len(ps))], ps)
                for g, ps in enumerate(procs)]
    return [GroupOutcome([p.exitcode for p in ps], {rank: ended.get((g, rank)) for rank in group.awaited}, told)
            for g, (group, ps, told) in enumerate(zip(groups, procs, said))]
