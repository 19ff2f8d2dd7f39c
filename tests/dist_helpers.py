"""Launching ranks in tests: a free rendezvous port, the environment torchrun gives a rank, and
:func:`spawn_cases`, which runs several cases in turn in one set of spawned ranks."""
import os
import socket


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


class CaseFailed(Exception):
    """A case of a :func:`spawn_cases` run that did not complete on every rank: the failing rank's error."""


def _run_cases(rank: int, world: int, port: int, root: str, cases: list) -> None:
    """One rank: every case in turn, in this process. A case's result goes to ROOT/NAME/rank<R>.pt; a case
    that raises ends the process (mp.spawn then ends the other ranks and reports it)."""
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
        result = fn(rank, world, out_dir, **kwargs)
        streams.configure()   # transfers as configured by default, whatever the case set
        if torch.distributed.is_initialized():   # every rank done with the case before the next begins
            torch.distributed.barrier()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_group()


def spawn_cases(world: int, root, cases: dict) -> dict:
    """Runs ``cases`` (name: (fn, kwargs)) in order on ``world`` spawned ranks, all of them in the same
    processes (one start, one import and one process group for all): each ``fn(rank, world, out_dir,
    **kwargs)`` returns what its rank reports. Returns name: [each rank's report], or name: CaseFailed with the
    error of a case that failed (the cases after it run in new processes)."""
    import pathlib

    import torch
    import torch.multiprocessing as mp
    root = pathlib.Path(root)
    pending, outcomes = list(cases.items()), {}
    while pending:
        error = None
        try:
            mp.spawn(_run_cases, args=(world, free_port(), str(root), [(n, fn, kw) for n, (fn, kw) in pending]),
                     nprocs=world, join=True)
        except Exception as e:   # noqa: BLE001 - reported as the failing case's outcome
            error = f"{type(e).__name__}: {e}"
        while pending and all((root / pending[0][0] / f"rank{r}.pt").exists() for r in range(world)):
            name = pending.pop(0)[0]
            outcomes[name] = [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(world)]
        if pending:
            name = pending.pop(0)[0]
            outcomes[name] = CaseFailed(f"case {name!r} on {world} ranks failed: "
                                        f"{error or 'its ranks ended without reporting'}")
    return outcomes



def reports(outcomes: dict, name: str) -> list:
    """Each rank's report of case ``name`` of a :func:`spawn_cases` run; a failed case fails the test with the
    rank's error."""
    import pytest
    got = outcomes[name]
    if isinstance(got, CaseFailed):
        pytest.fail(str(got), pytrace=False)
    return got
