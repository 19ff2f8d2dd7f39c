"""A small file system of a given size or mode for tests, where this machine lets them mount one."""
import contextlib
import gc
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(mountpoint, options: str):
    """Mount a tmpfs with ``options`` (e.g. "size=3m", "ro,size=1m") at ``mountpoint``; skip the test when
    mounting is not permitted here."""
    mountpoint.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {r.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        gc.collect()   # files a test's objects still hold open or mapped keep the mount busy
        if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)   # detached once they close
