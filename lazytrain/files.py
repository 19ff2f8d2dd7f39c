"""Small files written whole (plans, profiles, traces, plots): a reader of the path sees the old text or the new one,
never a part of either.

The text is written beside the file it replaces, under a name of this process's own, then renamed over it.
The file replaced is the one the path leads to: a symlink's target, so that the link stays a link, and a
path such as ``results/plan.json/`` names ``results/plan.json``. A path to something that is not a regular
file (a directory, a device such as /dev/null, a FIFO) is refused: the rename would replace the node itself;
so is a file its user cannot write (made read-only to keep it).
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat


def replaced_file(path: str, what: str = "path") -> str:
    """The file a write to ``path`` replaces (symlinks followed); raises OSError for one that is no regular
    file, naming the path as ``what``."""
    path = os.fspath(path)
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        named = path if target == os.path.abspath(path) else f"{path} (resolved: {target})"
        raise OSError(f"{what} {named} is not a regular file; give the name of a file to write")
    return target


def partial_name(target: str) -> str:
    """The name ``target``'s new text is written under before the rename: this process's own, so that
    processes writing one path (ranks given the same name) never share one."""
    return f"{target}.{os.getpid()}.tmp"


def write_text_atomic(path: str, text: str, what: str = "path") -> None:
    """Replace the file ``path`` leads to with ``text`` (UTF-8), as :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"), what)


def write_bytes_atomic(path: str, data: bytes, what: str = "path") -> None:
    """Replace the file ``path`` leads to with ``data``, keeping its permissions; a failed write (a full disk,
    say) leaves the old file and no temporary one."""
    target = replaced_file(path, what)
    partial = partial_name(target)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None   # a new file takes the umask's
    if mode is not None and not os.access(target, os.W_OK):   # the rename could, but check_writable refuses it
        raise PermissionError(errno.EACCES, "Permission denied (a file its user cannot write is not replaced)",
                              target)
    try:
        # made with the replaced file's mode, so a 0600 file's new text is never readable by others
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            with contextlib.suppress(OSError):   # the umask's bits back (a filesystem without modes: as it is)
                os.chmod(partial, mode)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


def check_writable(path: str, what: str = "path", example: str = "out.json") -> None:
    """Refuse a path that cannot be written, before any training time is spent: try what
    :func:`write_text_atomic` will do, create its temporary file beside the file it replaces (the folder must
    take new files), and open that file when it exists (a file the user cannot write is not replaced). Raises
    ValueError naming the path as ``what``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{what} {path} is a directory; give a file name such as {os.path.join(path, example)}")
    try:
        target = replaced_file(path, what)
    except OSError as e:
        raise ValueError(str(e)) from None
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path}: its directory {folder} does not exist")
    if os.path.exists(target):
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        except OSError as e:
            raise ValueError(f"{what} {path} cannot be written: {e.strerror or e}") from e
    partial = partial_name(target)
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written: its temporary file {partial} cannot be created "
                         f"({e.strerror or e}); the file is written there, then renamed over the path") from e
    with contextlib.suppress(FileNotFoundError):   # a write of this process's own to the path renamed it meanwhile
        os.remove(partial)
