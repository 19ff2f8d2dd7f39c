"""Small files written whole (files.py): plans, machine profiles and traces replace the file their path leads
to, as the start-up check of a path judged it."""
import os

import pytest

from lazytrain.files import check_writable, write_bytes_atomic, write_text_atomic
from lazytrain.planner.plan import Plan, keep_all_plan


def test_a_written_json_file_holds_the_old_text_or_the_new_one_whole(tmp_path):
    """Plans, profiles and measured hardware were written in place: a write that failed half-way (a full
    disk) left a truncated file where the last good one was."""
    path = tmp_path / "plan.json"
    write_text_atomic(str(path), "old\n")

    class Unwritable:
        pass
    with pytest.raises(TypeError):
        write_bytes_atomic(str(path), Unwritable())   # fails inside the write (the text's is this one)
    assert path.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["plan.json"]
    write_text_atomic(str(path), "new\n")
    assert path.read_text() == "new\n" and sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_a_replaced_file_keeps_its_permissions(tmp_path, monkeypatch):
    """The new text was renamed over the file: a 0600 plan or profile became 0644 (the umask's)."""
    path = tmp_path / "profile.json"
    path.write_text("old")
    os.chmod(path, 0o600)
    made = []
    real_open = os.open

    def watched(name, flags, mode=0o777, *args, **kwargs):   # the new text's file is made 0600 (never readable)
        made.append(mode)
        return real_open(name, flags, mode, *args, **kwargs)
    monkeypatch.setattr(os, "open", watched)
    monkeypatch.setattr(os, "chmod", lambda *a: (_ for _ in ()).throw(PermissionError(1, "not permitted")))
    write_text_atomic(str(path), "new")   # a filesystem that refuses chmod: the file is written all the same
    assert made == [0o600] and path.read_text() == "new" and os.stat(path).st_mode & 0o777 == 0o600


def test_a_write_through_a_symlink_replaces_its_target_and_the_link_stays(tmp_path):
    """The profile and plan writers renamed their file over the link: the link was gone, its target never
    written (the trace writer already kept links)."""
    target = tmp_path / "runs" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    plan = keep_all_plan(4, home="host", micro_batch_size=2)
    plan.to_json(str(link))
    assert os.path.islink(link) and Plan.from_json(str(target)) == plan
    assert sorted(os.listdir(tmp_path)) == ["latest.json", "runs"] and os.listdir(target.parent) == ["plan.json"]


def test_a_path_with_a_trailing_slash_is_written_where_the_check_said(tmp_path):
    """'profile.json/' passed the start-up check (which resolves the path) and the write then failed with
    FileNotFoundError after the measured steps, writing nothing."""
    path = f"{tmp_path}/profile.json/"
    check_writable(path, "profile path")
    write_text_atomic(path, "{}")
    assert (tmp_path / "profile.json").read_text() == "{}" and os.listdir(tmp_path) == ["profile.json"]


def test_a_path_that_is_no_regular_file_is_refused_by_the_check_and_the_write(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as e:
        check_writable(str(fifo), "profile path")
    assert str(e.value) == f"profile path {fifo} is not a regular file; give the name of a file to write"
    with pytest.raises(OSError) as e:
        write_text_atomic(str(fifo), "{}", "plan file")
    assert str(e.value) == f"plan file {fifo} is not a regular file; give the name of a file to write"
    with pytest.raises(ValueError) as e:
        check_writable(str(tmp_path), "profile path", "profile.json")
    assert str(e.value) == (f"profile path {tmp_path} is a directory; give a file name such as "
                            f"{tmp_path}/profile.json")
    assert os.listdir(tmp_path) == ["fifo"]


def test_a_file_its_user_cannot_write_is_not_replaced(tmp_path, monkeypatch):
    """check_writable refused it (before the solve, the training), but the write itself renamed over it: the
    two disagreed. Neither replaces it now (os.access stands in for a read-only file: these tests run as
    root, who may write anything)."""
    path = tmp_path / "plan.json"
    path.write_text("kept")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if os.fspath(p) == str(path) and m == os.W_OK
                        else real_access(p, m, *a, **k))
    with pytest.raises(PermissionError) as e:
        write_text_atomic(str(path), "new")
    assert (e.value.strerror, e.value.filename) == ("Permission denied (a file its user cannot write is not "
                                                    "replaced)", str(path))
    assert path.read_text() == "kept" and sorted(os.listdir(tmp_path)) == ["plan.json"]
