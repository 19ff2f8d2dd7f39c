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

A file may hold :class:`Streamed` tensors (a flat concatenation of many parameters, a 16-bit copy of a
weight): torch.save writes the file with room for each tensor's bytes, which then go in piece by piece, so
such a tensor never exists whole in memory. :class:`PickledByName` records are written under another
package's class name (DeepSpeed's loss scaler, say) without importing it.
"""
from __future__ import annotations

import collections
import errno
import glob
import json
import math
import os
import pickle
import shutil
import struct
import time
import types
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..tiers import format_bytes
from . import safe_load, save_locks
from .record_crc import first_byte
from .tensor_storages import SPARSE_PARTS

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MANIFEST = "lazytrain_manifest.json"
FORMAT = "lazytrain-checkpoint"
_STAGING, _PREVIOUS = ".staging", ".previous"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the tag, the path and the cause."""


class IncompleteCheckpointError(CheckpointError):
    """A tag whose save never completed: nothing of it is loaded."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another model (other names or shapes, other parameter groups): refused before anything
    of it is applied, so the engine trains on as it was."""


class CheckpointSpaceError(CheckpointError):
    """Not enough space to save: the previous checkpoint is left as it was."""


def _create(path: str):
    """``path`` made anew for writing: an entry already there is removed first (not written through), and a
    link put in its place meanwhile is not followed, so that a file a checkpoint directory came with (a
    ``latest.tmp`` linking elsewhere) cannot lead a save's bytes outside it."""
    if os.path.lexists(path):
        os.unlink(path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666), "wb")


# the file a checkpoint file is written through (tests swap in one that runs out of space)
_open_for_write: Callable[[str], object] = _create


# ---- saving ---------------------------------------------------------------------------------------
MAX_TAG_BYTES = 255 - len(".") - max(len(_STAGING), len(_PREVIOUS))


def _leaves_its_directory(tag: str) -> bool:
    """Whether ``tag`` names no entry of its own in a directory (".", "..", a path) or one 'latest' cannot name
    (control characters): what a save refuses as a tag and a load refuses in 'latest'."""
    return tag in (".", "..") or "/" in tag or os.sep in tag or os.path.isabs(tag) or any(ord(c) < 32 for c in tag)


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in ("latest", "latest.tmp") or tag.startswith(".") or _leaves_its_directory(tag) \
            or tag != tag.strip():
        raise CheckpointError(f"checkpoint tag {tag!r} cannot name a directory of its own beside 'latest': use a "
                              f"name without path separators, control characters or surrounding spaces that does "
                              f"not start with '.'")
    if len(tag.encode()) > MAX_TAG_BYTES:   # the staging and previous directories' names add to it
        raise CheckpointError(f"checkpoint tag {tag[:40]!r}... is {len(tag.encode())} bytes long: at most "
                              f"{MAX_TAG_BYTES} (a file name holds 255, and a save names '.<tag>.previous' too)")
    return tag


# what a save removes its staging directory after: an error, a Ctrl-C or an exit (a process killed outright
# leaves it, and its lock, to the next save, which rolls it back)
CLEANED_UP_AFTER = (Exception, KeyboardInterrupt, SystemExit)


def save(save_dir: str, tag: str, files: dict[str, object], save_latest: bool) -> str:
    """Write ``files`` (file name -> object for ``torch.save``) as tag ``tag`` of ``save_dir``, atomically."""
    staging = begin(save_dir, tag, files_bytes(files))
    try:
        sizes = write_files(save_dir, tag, staging, files)
    except CLEANED_UP_AFTER:
        abort(staging)
        raise
    return finish(save_dir, tag, staging, sizes, save_latest)


def files_bytes(files: dict[str, object]) -> int:
    """About the bytes ``files`` take on disk."""
    return sum(_tensor_bytes(obj) for obj in files.values())


def refuse_a_file_for_a_directory(save_dir: str, what: str) -> None:
    """A save directory that is a file (or a link to one): named, where os.makedirs said only "File exists"."""
    if os.path.lexists(save_dir) and not os.path.isdir(save_dir):
        raise CheckpointError(f"{what}: {save_dir} is a file, not a directory, so nothing was saved. Give a "
                              f"directory (it is made if it does not exist)")


def begin(save_dir: str, tag: str, need: int) -> str:
    """Make the empty staging directory of a save of tag ``tag`` that writes about ``need`` bytes (after
    finishing or rolling back what an interrupted save left); returns its path."""
    tag = check_tag(tag)
    refuse_a_file_for_a_directory(save_dir, f"saving checkpoint tag {tag!r} to {save_dir}")
    try:
        if not os.path.isdir(save_dir):
            os.makedirs(save_dir)
            _fsync_dir(os.path.dirname(os.path.abspath(save_dir)))   # the new directory's own entry
        with save_locks.making_saves(save_dir):   # no other save sees the staging directory before its lock
            return _begin(save_dir, tag, need)
    except OSError as e:   # a directory that cannot be made or written (read-only, no permission)
        raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir} failed: {e}; nothing was saved, and "
                              f"the previous checkpoint is left as it was") from e


def _begin(save_dir: str, tag: str, need: int) -> str:
    settle_leftovers(save_dir)
    final = os.path.join(save_dir, tag)
    foreign = _foreign(final) if os.path.lexists(final) else None
    if foreign:
        raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir}: {final} exists and {foreign}: "
                              f"a save replaces its tag's directory whole, so nothing was saved. Choose another tag "
                              f"or save directory, or move what is not a checkpoint's away")
    free = shutil.disk_usage(save_dir).free
    if need > free:
        raise CheckpointSpaceError(_space_message(save_dir, tag, need, free))
    staging = staging_dir(save_dir, tag)
    if save_locks.saving_elsewhere(staging):
        raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir}: another process is saving that tag "
                              f"there now ({staging} is its save in progress); nothing was saved. Save each job's "
                              f"checkpoints under its own tags or save directory")
    for aside in (staging, _aside(save_dir, tag, _PREVIOUS)):   # a save removes both: never a user's own
        foreign = _foreign(aside) if os.path.lexists(aside) else None
        if foreign:
            raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir}: {aside} exists and {foreign}, "
                                  f"unlike what a save sets aside; a save would remove it, so nothing was saved. "
                                  f"Choose another tag or save directory, or move it away")
    shutil.rmtree(staging, ignore_errors=True)
    os.mkdir(staging)
    save_locks.hold(staging)
    return staging


def staging_dir(save_dir: str, tag: str) -> str:
    return _aside(save_dir, tag, _STAGING)


SHARED_DIR_PATIENCE_S = 10.0   # how long a rank looks for the staging directory rank 0 made


def wait_to_see(staging: str, who: str) -> None:
    """The staging directory another process made, once this one sees it (a shared file system may show a
    new directory to other machines a moment late); else an error saying what the save needs."""
    patience_s = SHARED_DIR_PATIENCE_S
    deadline = time.monotonic() + patience_s
    delay = 0.05
    while not os.path.isdir(staging):
        if time.monotonic() >= deadline:
            raise CheckpointError(f"{who} does not see {staging}, which rank 0 made {patience_s:g} s ago: with the "
                                  f"optimizer state sharded every rank writes its part of the checkpoint, so "
                                  f"save_dir must be on a file system every rank sees")
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def write_files(save_dir: str, tag: str, staging: str, files: dict[str, object]) -> dict[str, int]:
    """Write ``files`` into the staging directory, each fsynced; returns their sizes. A failure says what
    and removes nothing (:func:`abort` does, once no rank writes there any more)."""
    try:
        return {name: _write(os.path.join(staging, name), obj) for name, obj in files.items()}
    except CheckpointError as e:   # a value a checkpoint cannot hold
        raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir}: {e}; nothing was saved") from e
    except Exception as e:   # (a process killed here leaves the staging directory to the next save)
        if _out_of_space(e, save_dir):
            raise CheckpointSpaceError(_space_message(save_dir, tag, files_bytes(files),
                                                      shutil.disk_usage(save_dir).free)) from e
        if isinstance(e, OSError):
            raise CheckpointError(f"saving checkpoint tag {tag!r} to {save_dir} failed: {e}; the previous "
                                  f"checkpoint is left as it was") from e
        raise


def finish(save_dir: str, tag: str, staging: str, sizes: dict[str, int], save_latest: bool) -> str:
    """Complete a save whose files are all in ``staging``: the manifest last, then the tag put in place
    and ``latest`` pointed at it."""
    try:
        for name, size in sizes.items():   # every file, as its writer wrote it (several ranks may write here)
            path = os.path.join(staging, name)
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                raise CheckpointError(
                    f"saving checkpoint tag {tag!r} to {save_dir}: {name} ({size} bytes as written) is not in "
                    f"{staging}: the ranks did not write into one directory (save_dir must be on a file system "
                    f"every rank sees); the previous checkpoint is left as it was")
        _warn_if_unsafe(staging, tag)
        tails = {name: _tail_fingerprint(os.path.join(staging, name)) for name in sizes if name.endswith("_states.pt")}
        _write_json(os.path.join(staging, MANIFEST), {"format": FORMAT, "version": 1, "tag": tag, "files": sizes,
                                                      "tails": tails})
        _fsync_dir(staging)
    except CLEANED_UP_AFTER:
        abort(staging)
        raise
    _commit(save_dir, tag, staging)
    save_locks.let_go(staging)
    if save_latest:
        _write_text_atomic(os.path.join(save_dir, "latest"), tag)
    return os.path.join(save_dir, tag)


def abort(staging: str) -> None:
    """Remove a save's staging directory: the previous checkpoint stays as it was."""
    shutil.rmtree(staging, ignore_errors=True)
    save_locks.let_go(staging)


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
    streamed, named = _scan(obj)
    if not streamed:
        return _durable_write(path, lambda f: torch.save(obj, f, pickle_module=_pickling(None) if named else pickle))
    return _durable_write(path, lambda f: _save_streamed(obj, f, path))


# ---- files with streamed tensors ------------------------------------------------------------------
@dataclass(eq=False)
class Streamed:
    """A tensor a save writes into its file piece by piece: ``pieces()`` yields contiguous host tensors of
    ``dtype`` whose elements, one after the other, are the tensor's (say a flat concatenation of many
    parameters, or a weight cast to 16 bits). The whole never exists in memory; it loads as a tensor of
    ``shape``."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class PickledByName:
    """A record that a checkpoint file names as another package's class (``pickle_as``, "module.Class")
    without importing it: a loader with that package builds its object, LazyTrain's own loader a record."""
    pickle_as = ""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _scan(obj) -> tuple[bool, bool]:
    """(holds a Streamed tensor, holds a PickledByName record) in its dicts, lists and tuples."""
    streamed = named = False
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, Streamed):
            streamed = True
        elif isinstance(o, PickledByName):
            named = True
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return streamed, named


def _pickling(placeholders: "_Placeholders | None") -> types.ModuleType:
    """The pickle module torch.save writes a checkpoint file with: PickledByName records under their class
    names, and, with ``placeholders``, every tensor swapped for a placeholder of its shape (written with
    torch.serialization.skip_data, the bytes come after)."""
    class Pickler(pickle._Pickler):   # the Python pickler: its save_global and save can be extended
        def save(self, obj, save_persistent_id=True):
            if placeholders is not None and type(obj) is nn.Parameter and not torch._utils._get_obj_state(obj):
                # a parameter again when loaded, as torch.save keeps it (a client_state's EMA weights), once
                memoized = self.memo.get(id(obj))
                if memoized is not None:
                    self.write(self.get(memoized[0]))
                else:
                    self.save_reduce(torch._utils._rebuild_parameter,
                                     (obj.detach(), obj.requires_grad, collections.OrderedDict()), obj=obj)
                return
            if placeholders is not None and isinstance(obj, (torch.Tensor, Streamed)):
                obj = placeholders.of(obj)
            elif isinstance(obj, Streamed):
                raise TypeError("a streamed tensor outside the dicts, lists and tuples of a checkpoint file")
            super().save(obj, save_persistent_id)

        def save_global(self, obj, name=None):
            target = obj.__dict__.get("pickle_as") if isinstance(obj, type) else None
            if not target:
                return super().save_global(obj, name)
            module, _, qualname = target.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())   # as protocol 2 writes a class
            self.memoize(obj)

    module = types.ModuleType("lazytrain_checkpoint_pickle")
    module.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
    module.Pickler = Pickler
    return module


class _Placeholders:
    """Each tensor of a streamed file in the order its storage is written (torch.save numbers storages as
    the pickler meets them), and the fake tensor standing in for it."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode
        self._mode = FakeTensorMode()
        self._by_key: dict = {}
        self.sources: list = []                       # Streamed or a real tensor, by storage number

    def of(self, t):
        if isinstance(t, torch.Tensor) and (_is_fake(t) or t.layout in SPARSE_PARTS):
            return t   # a sparse tensor pickles as its strided parts (indices, values), each met here in turn
        if isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_quantized or t.is_nested):
            kind = "quantized" if t.is_quantized else "nested" if t.is_nested else f"{t.layout}"
            raise CheckpointError(f"a {kind} tensor (shape {tuple(t.shape)}, {t.dtype}) cannot be saved in a "
                                  f"checkpoint: LazyTrain saves dense and sparse tensors; convert it first (a "
                                  f"quantized tensor's int_repr(), q_scale() and q_zero_point(), or dequantize())")
        if isinstance(t, Streamed):
            key, shape, dtype = id(t), t.shape, t.dtype
        else:   # views of one storage written alike share one placeholder (tied weights), as torch.save would
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
            shape, dtype = tuple(t.shape), t.dtype
        if key not in self._by_key:
            with self._mode:
                self._by_key[key] = torch.empty(shape, dtype=dtype)
            self.sources.append(t)
        return self._by_key[key]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _pieces(source) -> Iterable[torch.Tensor]:
    if isinstance(source, Streamed):
        return source.pieces()
    return [source.detach()]


def _save_streamed(obj, f, path: str) -> None:
    """torch.save with every tensor's bytes left out (the file keeps their room), then each tensor's
    bytes written in place, piece by piece, and each record's CRC-32 set to what it holds."""
    placeholders = _Placeholders()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, f, pickle_module=_pickling(placeholders))
    f.flush()
    records = _storage_records(path)
    if len(records) != len(placeholders.sources):
        raise RuntimeError(f"{path}: torch.save wrote {len(records)} tensor records for "
                           f"{len(placeholders.sources)} tensors")
    for (name, offset, size, crc_at), source in zip(records, placeholders.sources):
        crc, written = 0, 0
        f.seek(offset)
        for piece in _pieces(source):
            data = piece.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            crc, written = zlib.crc32(data, crc), written + data.nbytes
        if written != size:
            raise RuntimeError(f"{path}: {name} got {written} bytes from its pieces, its record holds {size}")
        for pos in crc_at:
            f.seek(pos)
            f.write(struct.pack("<I", crc))


def _storage_records(path: str) -> list[tuple[str, int, int, list[int]]]:
    """Each tensor record of a torch.save zip file, in storage order: its name, where its bytes start,
    how many, and where its CRC-32 is kept (its data descriptor, or its local header; its central
    directory entry)."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as raw:
        central = {}
        raw.seek(z.start_dir)
        for _ in z.infolist():
            entry = raw.tell()
            fixed = raw.read(46)
            n, e, c = struct.unpack("<HHH", fixed[28:34])
            central[raw.read(n).decode()] = entry + 16
            raw.seek(e + c, os.SEEK_CUR)
        out = []
        for info in z.infolist():
            head, _, key = info.filename.rpartition("/data/")
            if not head or "/" in head or not key.isdigit():
                continue
            offset = first_byte(raw.fileno(), info)
            crc_at = [info.header_offset + 14]
            if info.flag_bits & 0x08:                 # the CRC follows the bytes, in a data descriptor
                raw.seek(offset + info.compress_size)
                crc_at = [offset + info.compress_size + (4 if raw.read(4) == b"PK\x07\x08" else 0)]
            out.append((int(key), info.filename, offset, info.file_size, crc_at + [central[info.filename]]))
    return [record[1:] for record in sorted(out)]


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
    unstorable = [f"{k!r} ({_unstorable_kind(v)})" for k, v in state.items() if _unstorable_kind(v)]
    if unstorable:   # refused by name before anything is written (safetensors failed on its own terms)
        raise ValueError(f"safetensors holds dense tensors only; the state dict has {', '.join(unstorable)}: give a "
                         f"file name not ending in .safetensors (DeepSpeed's 'pytorch_model.bin', written by "
                         f"torch.save) for this model")
    data = to_safetensors({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt"})
    save_file_atomic(path, state, lambda f: f.write(data))


def _unstorable_kind(v) -> str | None:
    """Why safetensors cannot store ``v`` (None: it can): a module's non-tensor extra state, a sparse or nested
    tensor."""
    if not isinstance(v, torch.Tensor):
        return f"a {type(v).__name__}, a module's extra state"
    if v.is_nested:
        return "a nested tensor"
    return "a sparse tensor" if v.layout != torch.strided else None


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


def _a_saves_file(name: str) -> bool:
    """A file name a save (LazyTrain's or DeepSpeed's) writes into a tag's directory: DeepSpeed's
    ``*_states.pt`` (model, optimizer, expert and layer states), LazyTrain's ``lazytrain_*`` state and
    manifest, and any of them under a temporary name while written. Told apart by name, not by kind: a
    user's ``tokenizer_config.json`` or ``training_args.pt`` beside a checkpoint is not a save's."""
    name = name[:-len(".tmp")] if name.endswith(".tmp") else name
    return name.endswith("_states.pt") or (name.startswith("lazytrain_") and name.endswith((".pt", ".json")))


def _not_a_saves(path: str) -> list[str] | None:
    """What in directory ``path`` no save writes (its names, sorted): [] for a directory a save wrote,
    staged or set aside; None where it cannot be listed."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return None
    return sorted(e.name for e in entries if not (e.is_file(follow_symlinks=False) and _a_saves_file(e.name)))


def _a_saves_directory(path: str) -> bool:
    """A directory a save wrote, staged or set aside: files a save writes, nothing else (a save replaces it
    whole; a user's own files in it, or a hidden directory of theirs that ends in .staging, are left alone)."""
    return _not_a_saves(path) == []


def _foreign(path: str) -> str | None:
    """None where a save may replace ``path`` (a directory, not a link, that :func:`_a_saves_directory`);
    else why not, for an error message."""
    if os.path.islink(path) or not os.path.isdir(path):
        return "is not a directory"
    names = _not_a_saves(path)
    if names is None:
        return "cannot be listed"
    if not names:
        return None
    return f"holds what a save does not write ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"


def settle_leftovers(save_dir: str) -> None:
    """Finish or roll back what interrupted saves left in ``save_dir``: a tag missing while its complete
    staging copy exists is put in place (the save had finished writing), else its previous copy is put
    back; then every staging and previous directory left is removed. Another process's save in progress
    (its staging directory locked: save_locks.py) is left to finish."""
    for entry in sorted(os.listdir(save_dir)):
        for suffix in (_STAGING, _PREVIOUS):
            if entry.startswith(".") and entry.endswith(suffix) and _a_saves_directory(os.path.join(save_dir, entry)):
                tag = entry[1:-len(suffix)]
                if save_locks.saving_elsewhere(_aside(save_dir, tag, _STAGING)):
                    continue
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
    if os.path.lexists(stale):   # a link too, whether or not it leads anywhere
        os.remove(stale)


# ---- space ----------------------------------------------------------------------------------------
def _tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of the tensor storages in ``obj`` (each storage once): what ``torch.save`` writes, near enough."""
    seen = set() if seen is None else seen
    if isinstance(obj, Streamed):
        return obj.nbytes
    if isinstance(obj, torch.Tensor) and obj.layout in SPARSE_PARTS:   # what torch.save writes of it
        return sum(_tensor_bytes(part, seen) for part in SPARSE_PARTS[obj.layout](obj))
    if isinstance(obj, torch.Tensor) and (obj.layout != torch.strided or obj.is_nested):
        return 0   # refused when written
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
    with open(latest, "rb") as f:   # a tag's length at most: a file of any size is not read whole
        raw = f.read(MAX_TAG_BYTES + 2)
    if len(raw.strip()) > MAX_TAG_BYTES:
        raise CheckpointError(f"the 'latest' file in {load_dir} ({latest}) holds more than a checkpoint tag (a "
                              f"tag is at most {MAX_TAG_BYTES} bytes); pass tag= to load a specific checkpoint")
    tag = raw.decode("utf-8", errors="replace").strip()
    if not tag:   # truncated (a full disk, another tool): an empty tag would name load_dir itself
        raise CheckpointError(f"the 'latest' file in {load_dir} ({latest}) is empty: it names no checkpoint tag; "
                              f"pass tag= to load a specific checkpoint, or write the tag's name into it")
    if _leaves_its_directory(tag):
        # a file's content, not the caller's argument: it must not lead the load (and, with trust_checkpoints,
        # an unrestricted unpickling) outside the directory the caller named
        raise CheckpointError(f"the 'latest' file in {load_dir} ({latest}) names {tag[:80]!r}, which is not a "
                              f"checkpoint tag in that directory (a name without path separators or control "
                              f"characters); pass tag= to load a specific checkpoint")
    return tag


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


def rewritten_after_save(path: str) -> bool:
    """Whether every DeepSpeed-layout state file of a tag LazyTrain saved was written again since (by
    size and by the fingerprint of its last bytes, where a torch file keeps its zip directory with the
    CRC of every entry): DeepSpeed saved the same tag, and LazyTrain's own state beside them (its
    manifest, ``lazytrain_state.pt``) is stale. Raises when some were and some were not: the tag then
    holds files of two saves, which no one wrote together. A copy of the tag (new times) still matches. A
    manifest written before the fingerprints were recorded is checked by size alone."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        sizes, tails = manifest["files"], manifest.get("tails", {})
    except (OSError, ValueError, KeyError, TypeError):
        return False
    names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*_states.pt")))
    same = [n for n in names if sizes.get(n) == os.path.getsize(os.path.join(path, n)) and
            (n not in tails or tails[n] == _tail_fingerprint(os.path.join(path, n)))]
    if not names or len(same) == len(names):
        return False
    if not all(_whole_zip(os.path.join(path, n)) for n in names if n not in same):
        return False   # a damaged file (a copy cut short, a full disk): the manifest's check names it
    if same:
        changed = [n for n in names if n not in same]
        raise CheckpointError(f"checkpoint {path} holds state files written after LazyTrain saved it "
                              f"({', '.join(changed[:3])}: a DeepSpeed save of the same tag?) beside files of that "
                              f"save ({', '.join(same[:3])}): they are not one checkpoint; save to a new tag, or "
                              f"remove the tag's old files")
    return True


def _whole_zip(path: str) -> bool:
    """Whether ``path`` is a whole zip file (its directory at the end reads): what a finished torch.save
    writes, and a file cut short is not."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile, NotImplementedError, KeyError, ValueError, EOFError):
        return False   # zipfile's errors on a damaged directory too (a version, a method, a flag)


TAIL_BYTES = 1 << 16


def _tail_fingerprint(path: str) -> str:
    """A hash of a file's last bytes (a torch zip file's directory: every entry's CRC and size)."""
    import hashlib
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
        return hashlib.sha256(f.read()).hexdigest()


def tag_present(save_dir: str, tag: str) -> bool:
    """Whether ``save_dir`` holds tag ``tag``, or what a save of it left when interrupted (its staging or
    previous copy, which a load or the next save of the tag takes up): a new save of ``tag`` replaces it."""
    return any(os.path.lexists(path) for path in (os.path.join(save_dir, tag), _aside(save_dir, tag, _STAGING),
                                                  _aside(save_dir, tag, _PREVIOUS)))


def tag_dir(load_dir: str, tag: str) -> str:
    """The directory to load tag ``tag`` from (see :func:`find_tag`)."""
    return find_tag(load_dir, tag)[0]


def find_tag(load_dir: str, tag: str) -> tuple[str, bool]:
    """(the directory to load tag ``tag`` from, whether DeepSpeed saved it over a LazyTrain save of the same
    tag). The directory: the tag itself when complete (or written by DeepSpeed, with no manifest or over
    LazyTrain's save); else the complete copy an interrupted save left beside it; never a partial one."""
    final = os.path.join(load_dir, tag)
    if os.path.isdir(final) and not os.path.isfile(os.path.join(final, MANIFEST)) and \
            glob.glob(os.path.join(final, "*model_states.pt")):
        return final, False                            # DeepSpeed's, or an earlier LazyTrain's
    if os.path.isdir(final) and rewritten_after_save(final):
        warnings.warn(f"lazytrain: checkpoint tag {tag!r} in {load_dir}: its DeepSpeed files were written after "
                      f"LazyTrain saved it (DeepSpeed saved the same tag since?): it loads as DeepSpeed's "
                      f"checkpoint, and LazyTrain's own state beside them ({MANIFEST}, lazytrain_state.pt) is "
                      f"ignored", UserWarning, stacklevel=3)
        return final, True
    problem = _manifest_problem(final)
    if problem is None:
        return final, False
    for suffix in (_STAGING, _PREVIOUS):               # a save died between its two renames
        aside = _aside(load_dir, tag, suffix)
        if not os.path.isdir(final) and _manifest_problem(aside) is None:
            return aside, False
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
