"""What a launcher (torchrun, DeepSpeed's) tells a process through its environment: its rank and the world's
size. Read in one place, without torch, so that a malformed value is an error naming the variable wherever it
is read (the config's batch arithmetic, the process group's set-up, ``lazytrain train``), not a bare
``ValueError: invalid literal for int()``."""
from __future__ import annotations

import os


class LaunchError(RuntimeError):
    """The launcher's variables describe several ranks but not how to reach them (WORLD_SIZE set without
    MASTER_ADDR or MASTER_PORT), or one of them is not a number."""


def launcher_int(name: str, default: int) -> int:
    """The launcher's variable ``name`` (RANK, WORLD_SIZE, LOCAL_RANK) as an integer; ``default`` where unset, and
    for a LOCAL_RANK of -1 (Hugging Face's "not distributed", which some single-process scripts export)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = -2
    if name == "LOCAL_RANK" and number == -1:
        return default
    if number < (1 if name == "WORLD_SIZE" else 0):
        raise LaunchError(f"the environment variable {name} must be a "
                          f"{'positive' if name == 'WORLD_SIZE' else 'non-negative'} whole number, got {value!r} "
                          f"(a launcher sets it; unset it for a single process)")
    return number
