"""tests/dist_helpers.py's spawn_cases: cases run in turn in one set of spawned ranks, a failing case is
reported with its rank's error, and the cases after it run in new processes."""
import os

import pytest

from dist_helpers import CaseFailed, reports, spawn_cases


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
