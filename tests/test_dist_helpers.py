"""tests/dist_helpers.py: spawn_cases runs cases in turn in one set of ranks, reports a failing case with its
rank's error and runs the cases after it in new processes; spawn reports a failing rank's traceback; run_groups
waits for the awaited ranks alone and kills the rest."""
import os
import time

import pytest

from dist_helpers import CaseFailed, Group, reports, run_groups, spawn, spawn_cases


def _pid(rank, world, out_dir, tag):
    return {"pid": os.getpid(), "tag": tag, "rank": rank, "dir": os.path.basename(out_dir)}


def _fails(rank, world, out_dir):
    raise ValueError(f"case meant to fail on rank {rank}")


def test_cases_share_a_process_and_a_failure_is_reported_then_the_rest_run_anew(tmp_path):
    outcomes = spawn_cases(1, tmp_path, {"a": (_pid, {"tag": 1}), "b": (_pid, {"tag": 2}), "fails": (_fails, {}),
                                         "c": (_pid, {"tag": 3})})
    assert list(outcomes) == ["a", "b", "fails", "c"]
    a, b, c = (reports(outcomes, name)[0] for name in ("a", "b", "c"))
    assert (a["tag"], b["tag"], c["tag"]) == (1, 2, 3) and (a["dir"], c["dir"]) == ("a", "c")
    assert a["pid"] == b["pid"] != c["pid"]          # one process for a and b; c after the failure, in a new one
    assert isinstance(outcomes["fails"], CaseFailed)
    assert "case 'fails' on 1 ranks failed" in str(outcomes["fails"]) and "case meant to fail on rank 0" in \
        str(outcomes["fails"])
    with pytest.raises(pytest.fail.Exception, match="case meant to fail"):
        reports(outcomes, "fails")


def _fails_on_rank_1(rank, tag):
    if rank == 1:
        raise ValueError(f"meant to fail on rank {rank} ({tag})")
    time.sleep(600)   # killed once rank 1 failed


def test_spawn_kills_the_other_ranks_once_one_fails_and_raises_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        spawn(_fails_on_rank_1, args=("x",), nprocs=2)
    assert time.monotonic() - t0 < 60
    assert str(e.value).startswith("ranks failed: exit codes by rank: [-9, 1]\nrank 1: Traceback")
    assert "ValueError: meant to fail on rank 1 (x)" in str(e.value)


def _ends_or_sleeps(rank, port, code):
    if rank == 0:
        if code == "raise":
            raise ValueError("meant to fail on rank 0")
        os._exit(code)
    time.sleep(600)


def test_run_groups_waits_for_the_awaited_ranks_and_kills_the_others():
    first, second, third = run_groups([Group(_ends_or_sleeps, (0,)), Group(_ends_or_sleeps, (3,)),
                                       Group(_ends_or_sleeps, ("raise",))], timeout=60)
    assert (first.exitcodes, second.exitcodes, third.exitcodes) == ([0, -9], [3, -9], [1, -9])
    assert list(first.seconds) == [0] and first.seconds[0] < 60
    assert first.said == "exit codes by rank: [0, -9]"
    assert third.said.startswith("exit codes by rank: [1, -9]\ngroup 2 rank 0: Traceback")
    assert third.said.endswith("ValueError: meant to fail on rank 0\n")


def _environment_and_draws(rank, out_dir):
    import random

    import torch
    torch.save({"env": os.environ.get("LAZYTRAIN_TEST_PROBE"), "torch": torch.rand(1), "random": random.random()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_spawned_ranks_get_the_callers_environment_and_generators_of_their_own(tmp_path, monkeypatch):
    """As fresh interpreters would: the forkserver's children would otherwise share its environment (from
    when it started) and its generators' states."""
    import torch
    spawn(_environment_and_draws, args=(str(tmp_path),), nprocs=2)   # the server is running after this
    monkeypatch.setenv("LAZYTRAIN_TEST_PROBE", "set after the server started")
    (tmp_path / "later").mkdir()
    spawn(_environment_and_draws, args=(str(tmp_path / "later"),), nprocs=2)
    first = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    later = [torch.load(tmp_path / "later" / f"rank{r}.pt") for r in range(2)]
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in later] == ["set after the server started"] * 2
    draws = [(r["torch"].item(), r["random"]) for r in first + later]
    assert len(set(draws)) == 4
