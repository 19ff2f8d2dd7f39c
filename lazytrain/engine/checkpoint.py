"""DeepSpeed-layout checkpoints, ``<dir>/<tag>/`` with the model and optimizer state files and a ``latest``
file naming the last tag, saved atomically per tag whatever the tag.

A save writes the whole tag into a staging directory beside it (``.<tag>.staging``): each file streamed to
disk by ``torch.save`` and fsynced, then a manifest (:data:`MANIFEST`: every file and its size) written
last. Only then does the tag change: an existing tag is moved aside (``.<tag>.previous``), the staging
directory renamed to the tag, the parent directory fsynced, the previous copy removed, and ``latest``
replaced by an atomic rename. Whenever the process dies, the directory holds either the old tag or the new
one complete; what an interrupted save leaves beside it is finished or rolled back by the next save, and
a load reads the newest complete copy. A save that cannot fit names the path and the bytes needed and
free, and leaves the previous checkpoint as it was.

A tag directory without a manifest was written by DeepSpeed or by an earlier LazyTrain: it loads as
before, without the completeness check.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import warnings
from collections.abc import Callable

import torch

from ..tiers import format_bytes
from . import safe_load

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MANIFEST = "lazytrain_manifest.json"
FORMAT = "lazytrain-checkpoint"
_STAGING, _PREVIOUS = ".staging", ".previous"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the tag, the path and the cause."""


class IncompleteCheckpointError(CheckpointError):
    """A tag whose save never completed: nothing of it is loaded."""


class CheckpointSpaceError(CheckpointError):
    """Not enough space to save: the previous checkpoint is left as it was."""


# the file a checkpoint file is written through (tests swap in one that runs out of space)
_open_for_write: Callable[[str], object] = lambda path: open(path, "wb")   # noqa: E731


# ---- saving ---------------------------------------------------------------------------------------
def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..", "latest", "latest.tmp") or tag.startswith(".") or "/" in tag or os.sep in tag \
            or tag != tag.strip():
        raise CheckpointError(f"checkpoint tag {tag!r} cannot name a directory of its own beside 'latest': use a "
                              f"name without path separators or surrounding spaces that does not start with '.'")
    return tag


def save(save_dir: str, tag: str, files: dict[str, object], save_latest: bool) -> str:
    """Write ``files`` (file name -> object for ``torch.save``) as tag ``tag`` of ``save_dir``, atomically."""
    tag = check_tag(tag)
    if not os.path.isdir(save_dir):
        os.makedirs(save_dir)
        _fsync_dir(os.path.dirname(os.path.abspath(save_dir)))   # the new directory's own entry
    settle_leftovers(save_dir)
    need = sum(_tensor_bytes(obj) for obj in files.values())
    free = shutil.disk_usage(save_dir).free
    if need > free:
        raise CheckpointSpaceError(_space_message(save_dir, tag, need, free))
    staging = _aside(save_dir, tag, _STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    os.mkdir(staging)
    try:
        sizes = {name: _write(os.path.join(staging, name), obj) for name, obj in files.items()}
        _warn_if_unsafe(staging, tag)
        _write_json(os.path.join(staging, MANIFEST), {"format": FORMAT, "version": 1, "tag": tag, "files": sizes})
        _fsync_dir(staging)
    except Exception as e:   # (a process killed here leaves the staging directory to the next save)
        shutil.rmtree(staging, ignore_errors=True)
        if _out_of_space(e, save_dir):
            raise CheckpointSpaceError(_space_message(save_dir, tag, need, shutil.disk_usage(save_dir).free)) from e
        if isinstance(e, OSError):
            raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir} failed: {e}; the previous "
                                  f"checkpoint is left as it was") from e
        raise
    _commit(save_dir, tag, staging)
    if save_latest:
        _write_text_atomic(os.path.join(save_dir, "latest"), tag)
    return os.path.join(save_dir, tag)


def _warn_if_unsafe(staging: str, tag: str) -> None:
    """A checkpoint whose files name code (a client_state holding objects) saves, but a load refuses it
    unless told to trust it: say so now, while the script can still change what it saves."""
    for name in sorted(os.listdir(staging)):
        unsafe = safe_load.unsafe_globals(os.path.join(staging, name))
        if unsafe:
            warnings.warn(f"lazytrain: checkpoint tag {tag!r}: {name} holds {', '.join(unsafe)}, which a checkpoint "
                          f"load refuses unless trusted (engine.load_checkpoint(..., trust_checkpoint=True)); keep "
                          f"client_state to plain values (numbers, strings, lists, dicts, tensors)", UserWarning,
                          stacklevel=4)


def _durable_write(path: str, fill) -> int:
    """Create ``path``, write it with ``fill(f)`` and fsync it before returning its size."""
    with _open_for_write(path) as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def _write(path: str, obj) -> int:
    return _durable_write(path, lambda f: torch.save(obj, f))


def _write_json(path: str, data: dict) -> None:
    _durable_write(path, lambda f: f.write(json.dumps(data, indent=1).encode()))


def _replace_atomically(path: str, fill) -> None:
    """``path`` holds the old content or the new, whole: written under a temporary name, renamed, the
    directory fsynced. A failed write leaves the temporary file to the caller."""
    tmp = path + ".tmp"
    _durable_write(tmp, fill)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _write_text_atomic(path: str, text: str) -> None:
    _replace_atomically(path, lambda f: f.write(text.encode()))


def _commit(save_dir: str, tag: str, staging: str) -> None:
    """Put the complete staging directory in the tag's place: two renames, each atomic; a process that
    dies between them leaves the previous copy and the complete new one, which ``settle_leftovers`` and
    ``tag_dir`` know how to read."""
    final, previous = os.path.join(save_dir, tag), _aside(save_dir, tag, _PREVIOUS)
    if os.path.lexists(final):
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(final, previous)
    os.rename(staging, final)
    _fsync_dir(save_dir)
    shutil.rmtree(previous, ignore_errors=True)


def save_safetensors_atomic(path: str, state: dict) -> None:
    """A state dict as a safetensors file (tensors only, no pickle), written like :func:`save_file_atomic`."""
    from safetensors.torch import save as to_safetensors
    data = to_safetensors({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"})
    save_file_atomic(path, state, lambda f: f.write(data))


def save_file_atomic(path: str, obj, fill=None) -> None:
    """One file (``save_16bit_model``): ``obj`` by ``torch.save``, or written by ``fill(f)``; under a
    temporary name, fsynced, renamed."""
    try:
        _replace_atomically(path, fill or (lambda f: torch.save(obj, f)))
    except Exception as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        directory = os.path.dirname(path) or "."
        if _out_of_space(e, directory):
            raise CheckpointSpaceError(
                f"saving {path} ran out of space: it needs about {format_bytes(_tensor_bytes(obj))}, "
                f"{format_bytes(shutil.disk_usage(directory).free)} are free there") from e
        raise


def _aside(save_dir: str, tag: str, suffix: str) -> str:
    return os.path.join(save_dir, f".{tag}{suffix}")


def settle_leftovers(save_dir: str) -> None:
    """Finish or roll back what interrupted saves left in ``save_dir``: a tag missing while its complete
    staging copy exists is put in place (the save had finished writing), else its previous copy is put
    back; then every staging and previous directory left is removed."""
    for entry in sorted(os.listdir(save_dir)):
        for suffix in (_STAGING, _PREVIOUS):
            if entry.startswith(".") and entry.endswith(suffix) and os.path.isdir(os.path.join(save_dir, entry)):
                tag = entry[1:-len(suffix)]
                final = os.path.join(save_dir, tag)
                if tag and not os.path.lexists(final):
                    staging, previous = _aside(save_dir, tag, _STAGING), _aside(save_dir, tag, _PREVIOUS)
                    if _manifest_problem(staging) is None:
                        os.rename(staging, final)
                    elif os.path.isdir(previous):
                        os.rename(previous, final)
                    _fsync_dir(save_dir)
                shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
    stale = os.path.join(save_dir, "latest.tmp")
    if os.path.exists(stale):
        os.remove(stale)


# ---- space ----------------------------------------------------------------------------------------
def _tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of the tensor storages in ``obj`` (each storage once): what ``torch.save`` writes, near enough."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def _out_of_space(error: BaseException, directory: str) -> bool:
    """The error is a full disk: ENOSPC or EDQUOT, or an error of torch's writer (which reports neither)
    while the file system has next to nothing left."""
    e = error
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    try:
        return isinstance(error, (OSError, RuntimeError)) and shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        return False


def _space_message(save_dir: str, tag: str, need: int, free: int) -> str:
    return (f"not enough space to save checkpoint tag {tag!r} in {save_dir}: it needs about {format_bytes(need)}, "
            f"{format_bytes(free)} are free on that file system (a tag being replaced is kept until its new copy "
            f"is complete). The previous checkpoint is left as it was; free space or save elsewhere.")


# ---- loading --------------------------------------------------------------------------------------
def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        warnings.warn(f"lazytrain: no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a specific "
                      f"checkpoint)")
        return None
    with open(latest) as f:
        return f.read().strip()


def _manifest_problem(path: str) -> str | None:
    """None when ``path`` holds a complete checkpoint by its manifest; else what is wrong."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        return "it does not exist"
    if not os.path.isfile(manifest):
        return f"it has no {MANIFEST} (written last by a save that completes)"
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({e})"
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, the manifest says {size}"
    return None


def tag_dir(load_dir: str, tag: str) -> str:
    """The directory to load tag ``tag`` from: the tag itself when complete (or written by DeepSpeed, with
    no manifest); else the complete copy an interrupted save left beside it; never a partial one."""
    final = os.path.join(load_dir, tag)
    if os.path.isdir(final) and not os.path.isfile(os.path.join(final, MANIFEST)) and \
            glob.glob(os.path.join(final, "*model_states.pt")):
        return final                                   # DeepSpeed's, or an earlier LazyTrain's
    problem = _manifest_problem(final)
    if problem is None:
        return final
    for suffix in (_STAGING, _PREVIOUS):               # a save died between its two renames
        aside = _aside(load_dir, tag, suffix)
        if not os.path.isdir(final) and _manifest_problem(aside) is None:
            return aside
    if not os.path.isdir(final) and not os.path.isdir(_aside(load_dir, tag, _STAGING)):
        raise FileNotFoundError(f"no checkpoint tag {tag!r} in {load_dir}")
    where = final if os.path.isdir(final) else _aside(load_dir, tag, _STAGING)
    why = problem if os.path.isdir(final) else _manifest_problem(where)
    raise IncompleteCheckpointError(f"checkpoint tag {tag!r} in {load_dir} is incomplete: {where}: {why}. Its save "
                                    f"was interrupted, or files were removed since; nothing of it was loaded")


def load(load_dir: str, tag: str, want_optimizer: bool, trust: bool = False) -> tuple[str, dict, dict | None]:
    """(model file path, model state, optimizer state or None); ``trust``: unrestricted unpickling."""
    path = tag_dir(load_dir, tag)
    model_file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"checkpoint {path} has no {MODEL_FILE}")
    model_state = safe_load.load(model_file, trust)
    optim_state = None
    if want_optimizer:
        optim_file = os.path.join(path, OPTIM_FILE)
        if not os.path.isfile(optim_file):
            raise FileNotFoundError(f"checkpoint {path} has no {OPTIM_FILE} (load with load_optimizer_states=False "
                                    f"to load the weights alone)")
        optim_state = safe_load.load(optim_file, trust)
    return os.path.join(load_dir, tag, MODEL_FILE), model_state, optim_state   # DeepSpeed returns the model file


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
