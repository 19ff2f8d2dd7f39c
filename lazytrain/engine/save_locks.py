"""Which checkpoint saves are in progress, so that one save never removes another's staging directory.

A save stages its tag in ``.<tag>.staging`` and the next save in the same directory finishes or removes
what interrupted saves left there. Two processes saving into one directory (two jobs, or a job and a
tool) would then take each other's save in progress for a left-over. So the process that makes a staging
directory holds a lock on it (``flock`` on the directory itself, released when the save ends or the
process dies) and a left-over is one whose lock is free; and the save directory itself is locked while a
save looks for left-overs and makes its staging directory, so no one sees a staging directory between its
making and its lock. On a file system without ``flock`` the locks are skipped and saves behave as before:
one save at a time per directory.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading

_HELD: dict[str, int] = {}   # staging directory's real path -> the descriptor holding its lock (this process's)
_HELD_LOCK = threading.Lock()


@contextlib.contextmanager
def making_saves(save_dir: str):
    """``save_dir`` locked for the duration: looking for left-overs and making a staging directory."""
    fd = _open_dir(save_dir)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:   # no flock here: unlocked, as before
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)   # the lock goes with it


def hold(staging: str) -> None:
    """This process's save owns ``staging`` (just made) until :func:`let_go`."""
    fd = _open_dir(staging)
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:   # no flock here
        os.close(fd)
        return
    with _HELD_LOCK:
        old = _HELD.pop(_key(staging), None)
        _HELD[_key(staging)] = fd
    if old is not None:
        os.close(old)


def let_go(staging: str) -> None:
    """The save that made ``staging`` ended (its directory renamed to the tag, or removed)."""
    with _HELD_LOCK:
        fd = _HELD.pop(_key(staging), None)
    if fd is not None:
        os.close(fd)


def saving_elsewhere(staging: str) -> bool:
    """Whether another process's save holds ``staging`` now. One of this process's is a left-over (its
    saves run one at a time: a save that failed after making it), and is let go."""
    with _HELD_LOCK:
        ours = _key(staging) in _HELD
    if ours:
        let_go(staging)
        return False
    fd = _open_dir(staging)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)
    return False


def _key(staging: str) -> str:
    """One name for a staging directory however the save directory was spelled ("ckpt", "./ckpt", a link)."""
    return os.path.realpath(staging)


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
