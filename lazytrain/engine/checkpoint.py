"""DeepSpeed-layout checkpoints: ``<dir>/<tag>/`` with model and optimizer state, and a ``latest`` file.

Files are written to a temporary name and renamed, so an interrupted save never leaves a file that
later loads as valid. Quantized optimizer states are saved as they are (no blow-up to fp32).
"""
from __future__ import annotations

import os
import warnings

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(save_dir: str, tag: str, model_state: dict, optim_state: dict | None, save_latest: bool) -> str:
    path = os.path.join(save_dir, tag)
    os.makedirs(path, exist_ok=True)
    _atomic_save(model_state, os.path.join(path, MODEL_FILE))
    if optim_state is not None:
        _atomic_save(optim_state, os.path.join(path, OPTIM_FILE))
    if save_latest:
        tmp = os.path.join(save_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
        os.replace(tmp, os.path.join(save_dir, "latest"))
    return path


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        warnings.warn(f"lazytrain: no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a specific "
                      f"checkpoint)")
        return None
    with open(latest) as f:
        return f.read().strip()


def load(load_dir: str, tag: str, want_optimizer: bool) -> tuple[str, dict, dict | None]:
    """(model file path, model state, optimizer state or None)."""
    path = os.path.join(load_dir, tag)
    model_file = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"checkpoint {path} has no {MODEL_FILE}")
    model_state = torch.load(model_file, map_location="cpu", weights_only=False)
    optim_state = None
    if want_optimizer:
        optim_file = os.path.join(path, OPTIM_FILE)
        if not os.path.isfile(optim_file):
            raise FileNotFoundError(f"checkpoint {path} has no {OPTIM_FILE} (load with load_optimizer_states=False "
                                    f"to load the weights alone)")
        optim_state = torch.load(optim_file, map_location="cpu", weights_only=False)
    return model_file, model_state, optim_state   # DeepSpeed returns the model file as the load path
