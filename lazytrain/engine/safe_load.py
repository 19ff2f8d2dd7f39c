"""What loading a checkpoint may build: tensors and plain values, never code.

A pickle names the functions and classes that rebuild it, and ``torch.load(weights_only=False)`` calls
them: a checkpoint made by someone else can run anything during the load. LazyTrain loads with torch's
restricted unpickler (``weights_only=True``), which builds tensors, containers and plain values and refuses
any other global. DeepSpeed's checkpoints name a few classes of their own; those are allowed here as
records (their attributes, no code of DeepSpeed's and no need to install it), with ``argparse.Namespace``,
which DeepSpeed saves for the script's ``args``. Anything else is refused with an error naming each type
and the file, and the way to opt in for a checkpoint the user trusts.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import os
import pickle
import re
import stat
import types
import zipfile
import zlib

import torch

from . import record_crc


class UntrustedCheckpointError(RuntimeError):
    """A checkpoint file that names code to run when loaded; nothing of it was loaded or run."""


class UnreadableCheckpointError(RuntimeError):
    """A checkpoint file that cannot be read back as written: cut short, damaged (a record whose bytes do not
    match the CRC-32 the file keeps for it) or not a torch file. Nothing of it was loaded."""


class DeepSpeedRecord:
    """A DeepSpeed object as its checkpoint stores it (a loss scaler, a fragment address): its attributes."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __repr__(self) -> str:
        return f"DeepSpeedRecord({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def zero_stage(value) -> int:
    """DeepSpeed's ``ZeroStageEnum`` as the stage number it holds: a plain int made anew. (An enum class here
    handed the unpickler its shared members, and a BUILD after them rewrote one for the whole process.)"""
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise pickle.UnpicklingError(f"a ZeroStageEnum of {value!r}, which is no ZeRO stage")
    return int(value)


# the globals DeepSpeed 0.19's checkpoints name (found with torch.serialization.get_unsafe_globals_in_checkpoint
# on checkpoints of ZeRO stages 0-2 in fp32, fp16 and bf16; tests/data/deepspeed_0_19), as what they become here
DEEPSPEED_GLOBALS = [
    argparse.Namespace,
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DeepSpeedRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
    (zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


class _TrustingUnpickler(pickle.Unpickler):
    """Builds anything (a trusted checkpoint), but DeepSpeed's record types as the records above: a
    trusted load neither needs DeepSpeed installed nor runs its code."""

    def find_class(self, module, name):
        record = _RECORDS.get(f"{module}.{name}")
        return record if record is not None else super().find_class(module, name)


_RECORDS = {g[1]: g[0] for g in DEEPSPEED_GLOBALS if isinstance(g, tuple)}
_TRUSTING = types.ModuleType("lazytrain_trusting_pickle")
_TRUSTING.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
_TRUSTING.Unpickler = _TrustingUnpickler


def verify_records(path: str) -> None:
    """Raise :class:`UnreadableCheckpointError` unless every record of a zip-format checkpoint file holds the
    bytes its CRC-32 says (torch writes one for each; torch's reader never checks them, and a memory-mapped
    load reads the bytes as they are: a flipped bit would load as a wrong weight). One more read of the file,
    on several threads (:mod:`record_crc`). Nothing to check in a legacy-format file (no CRCs; one whose last
    bytes read as a zip directory but are none is left to torch), nor in a record saved with torch's CRCs
    turned off (``torch.serialization.set_crc32_options(False)`` writes 0)."""
    try:
        record_crc.check_records(path)
    except zipfile.BadZipFile as e:   # not a zip file: torch's legacy format, or none torch reads (it says so)
        if _starts_as_a_zip(path):     # one that begins as a zip file is a damaged one, not the legacy format
            raise UnreadableCheckpointError(f"checkpoint file {path} cannot be read back as written: it begins as "
                                            f"a zip file, and its zip directory cannot be read ({e}) (the file is "
                                            f"cut short or damaged); nothing of it was loaded") from None
        return
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnreadableCheckpointError(f"checkpoint file {path} cannot be read: {e}") from None
    except (record_crc.RecordCheckError, EOFError, ValueError, KeyError, NotImplementedError) as e:
        # the last three: zipfile's own on a damaged directory (a compression method, a version, a flag)
        what = str(e) if isinstance(e, record_crc.RecordCheckError) else f"{type(e).__name__}: {e}"
        raise UnreadableCheckpointError(f"checkpoint file {path} cannot be read back as written: {what} (the file "
                                        f"is cut short or damaged); nothing of it was loaded") from None


def _starts_as_a_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _refuse_other_than_a_file(path: str) -> None:
    """A checkpoint file is a regular file (or a link to one): a FIFO named like one blocked the load forever
    on its open, a device would be read as one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnreadableCheckpointError(f"checkpoint file {path} cannot be read: {e}") from None
    if not stat.S_ISREG(mode):
        raise UnreadableCheckpointError(f"checkpoint file {path} is not a regular file (a FIFO, a device or a "
                                        f"directory); nothing of it was loaded")


# whether load() checks the records' CRC-32s of a file read whole (the config's 'lazytrain.check_checkpoint_crcs',
# set for the duration of one engine.load_checkpoint by records_checked)
_CHECK_RECORDS: contextvars.ContextVar[bool] = contextvars.ContextVar("lazytrain_check_records", default=True)


@contextlib.contextmanager
def records_checked(enabled: bool):
    """Within this, :func:`load` checks the records of the files it reads whole only if ``enabled``."""
    token = _CHECK_RECORDS.set(bool(enabled))
    try:
        yield
    finally:
        _CHECK_RECORDS.reset(token)


def load(path: str, trust: bool = False, whole: bool = True):
    """``torch.load`` of one checkpoint file on the host, restricted unless ``trust``; memory-mapped where
    the file's format allows (its pages are read as the state is copied in, not all at once first). With
    ``whole`` (the caller reads all of it), every record's CRC-32 is checked first (:func:`verify_records`);
    a caller that reads a part of a mapped file (a rank's share of a sharded state, a glance at one key)
    passes False, as the check would read every byte of it; within ``records_checked(False)`` none is
    checked. A file torch's reader fails on is named."""
    _refuse_other_than_a_file(path)
    if whole and _CHECK_RECORDS.get():
        verify_records(path)

    def attempt(mmap: bool):
        if trust:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_TRUSTING)
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    try:
        try:
            return attempt(mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return attempt(mmap=False)   # torch's legacy format cannot be mapped
    except pickle.UnpicklingError as e:
        names = [] if trust else unsafe_globals(path) or _globals_in_message(str(e))
        if not names:
            # trusted, or naming no code: damage (a flag of the zip directory turned the pickle's record into a
            # directory, and the unpickler read other bytes), not a file to trust
            said = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(e))   # torch's own, past its advice
            raise UnreadableCheckpointError(f"checkpoint file {path} cannot be unpickled: "
                                            f"{said.group(1) if said else str(e).strip()[:300]} (damaged, or not a "
                                            f"torch checkpoint); nothing of it was loaded") from e
        raise UntrustedCheckpointError(_refusal(path, names)) from None
    except (RuntimeError, EOFError, zlib.error, UnicodeDecodeError, zipfile.BadZipFile, NotImplementedError,
            IndexError) as e:   # the last: torch's restricted unpickler on other bytes than a pickle's
        if isinstance(e, RuntimeError) and "PytorchStreamReader" not in str(e):
            raise   # not the file's bytes (out of memory, a trusted pickle's own class): as it is
        raise UnreadableCheckpointError(f"checkpoint file {path} cannot be read: {type(e).__name__}: {e} (cut short, "
                                        f"damaged, or not a torch file)") from e


def unsafe_globals(path: str) -> list[str]:
    """The globals a checkpoint file names beyond what a restricted load builds (zip-format files)."""
    allowed = {f"{g.__module__}.{g.__qualname__}" if not isinstance(g, tuple) else g[1] for g in DEEPSPEED_GLOBALS}
    try:
        return [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:   # noqa: BLE001 - a legacy-format file: torch's own message names the global
        return []


def _globals_in_message(message: str) -> list[str]:
    """The globals torch's refusal names (``GLOBAL posix.system``): a legacy-format file is not listed by
    ``get_unsafe_globals_in_checkpoint``."""
    return list(dict.fromkeys(re.findall(r"GLOBAL ([\w.]+)", message)))


def _refusal(path: str, names: list[str]) -> str:
    return (f"checkpoint file {path} names {', '.join(names)}, which a checkpoint load does not build: loading it "
            f"would run that code. Nothing of the checkpoint was loaded. If you trust where this checkpoint came from, "
            f"load it with engine.load_checkpoint(..., trust_checkpoint=True) or set "
            f"'lazytrain.trust_checkpoints': true in the config")
