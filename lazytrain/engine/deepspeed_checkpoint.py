"""DeepSpeed's checkpoints read as plain state: full-precision weights and Adam moments by parameter name.

DeepSpeed keeps a run's state where its ZeRO stage puts it. Stage 0: the weights in the model file, the
optimizer's own ``state_dict`` beside them, by position (in bf16/fp16, DeepSpeed's fp16 wrapper's state:
the fp32 masters and the inner optimizer's state over them; given the optimizer's parameter names, both
are read by name). Stages 1 and 2: 16-bit weights in the model file, the fp32 masters and the moments as
flat partitions per parameter group, one file per rank, each parameter at its offset in the concatenated
partitions (with DeepSpeed's alignment padding after it). Stage 3: every parameter partitioned on its own
across the ranks. The parameters' names and shapes come from ``param_shapes`` in the model file, in flat
order; parameters the optimizer does not own (frozen), from ``frozen_param_fragments`` (stages 2, 3). This
module merges the ranks' files into one state by name, the way DeepSpeed's own ``zero_to_fp32.py`` reads
them; client state is what DeepSpeed keeps as top-level keys of the model file. Files are read with the
restricted loader (:mod:`safe_load`).
"""
from __future__ import annotations

import glob
import itertools
import math
import os
import re
import warnings
from dataclasses import dataclass, field

import torch

from . import safe_load

# the keys DeepSpeed 0.19 writes into a model file itself: everything else there is the user's client state
DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "mp_rank", "ds_checkpoint_version", "universal_checkpoint_info",
}


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint this reader cannot map; the message says what and where."""


@dataclass
class DeepSpeedState:
    module: dict[str, torch.Tensor]                 # by name: fp32 masters where DeepSpeed keeps them
    moments: dict[str, dict] | None                 # by name: {"step", "exp_avg", "exp_avg_sq"} (ZeRO 1-3)
    optimizer_state_dict: dict | None               # stage 0: the optimizer's own state_dict, by position
    lr_scheduler: dict | None
    counters: dict[str, int]
    loss_scale: dict | None                         # DeepSpeed's loss scaler's attributes
    client_state: dict = field(default_factory=dict)
    stage: int = 0
    # by name: the settings (lr, betas, eps, weight_decay, ...; no 'params') of the checkpoint's optimizer group
    # that holds the parameter; None where the checkpoint keeps none (ZeRO 1-2's elastic layout)
    group_settings: dict[str, dict] | None = None


def is_deepspeed(tag_dir: str, trust: bool = False) -> bool:
    """A tag directory DeepSpeed wrote: no LazyTrain manifest, and a model file carrying ``ds_version``
    (an earlier LazyTrain's has none; the file is memory-mapped, so this reads little of it). A DeepSpeed
    save over a LazyTrain tag is told by ``checkpoint.find_tag``."""
    from .checkpoint import MANIFEST
    if os.path.isfile(os.path.join(tag_dir, MANIFEST)):
        return False
    files = _model_files(tag_dir)
    if not files:
        return False
    if _saved_per_rank(files):
        return True
    return "ds_version" in safe_load.load(files[0], trust, whole=False)   # read whole (checked) by read()


def _check_every_rank(tag_dir: str, model: dict, model_files: list[str], optim_files: list[str], stage: int) -> None:
    """A file per rank where DeepSpeed writes one (the optimizer's partitions; at stage 3 the model's too):
    a missing one would shift every rank's partition after it (DeepSpeed's own loader counts them too)."""
    world = model.get("dp_world_size")
    if not isinstance(world, int) or world < 1:
        return
    for kind, files, needed in (("optim", optim_files, bool(optim_files)), ("model", model_files, stage == 3)):
        if not needed:
            continue
        ranks = {_rank_of(f) for f in files}
        if sum(1 for r in ranks if 0 <= r < world) == world:
            continue
        # the first few absent ranks, found among at most len(ranks) + 4: not a list as long as the file's
        # dp_world_size says, which a file can make any length
        missing = list(itertools.islice((r for r in range(world) if r not in ranks), 5))
        names = ", ".join(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in missing[:4])
        raise DeepSpeedCheckpointError(f"{tag_dir} was saved by {world} ranks but holds {len(files)} {kind} "
                                       f"state file(s): {names}{' ...' if len(missing) > 4 else ''} missing")


def _model_files(tag_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")) +
                  glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_*_model_states.pt")), key=_rank_of)


def _saved_per_rank(model_files: list[str]) -> bool:
    """Whether each rank saved a model file of its own, as ZeRO-3 does."""
    return "zero_pp_rank" in os.path.basename(model_files[0])


def _optim_files(tag_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")), key=_rank_of)


def _rank_of(path: str) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path))
    return int(m.group(1)) if m else 0


def _zero_stage(model: dict, model_files: list[str], optim_files: list[str], trust: bool) -> int:
    """The ZeRO stage the checkpoint was saved at: its config's, where DeepSpeed saved the config itself (a
    dict); else (DeepSpeed saves the config's path where it was given one, and an old config's
    ``zero_optimization`` may be a bool) 3 where each rank saved a model file, or what its optimizer files
    record; 0 without optimizer files, or where they record none (DeepSpeed's 16-bit optimizers without
    ZeRO's, whose files read as stage 0's)."""
    config = model.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if isinstance(zero, dict):
        return int(zero.get("stage", 0))
    if isinstance(config, dict) and not zero:   # no ZeRO section, or zero_optimization: false
        return 0
    if _saved_per_rank(model_files):
        return 3
    if not optim_files:
        return 0
    # one key of a mapped file that read() loads whole (and checks) next
    recorded = safe_load.load(optim_files[0], trust, whole=False).get("optimizer_state_dict", {}).get("zero_stage")
    return int(recorded) if recorded is not None else 0


def read(tag_dir: str, want_optimizer: bool, trust: bool = False,
         stage0_names: list[list[str]] | None = None, wanted: set[str] | None = None,
         stage0_frozen: set[str] | None = None) -> DeepSpeedState:
    """The checkpoint in ``tag_dir`` by parameter name. ``stage0_names``: the names of the parameters of
    the stage-0 optimizer's groups in its order (a stage-0 checkpoint keeps its optimizer state by
    position): given, the stage-0 moments (and in 16 bits, the fp32 masters) are read by name too.
    ``stage0_frozen``: the names among them that DeepSpeed's 16-bit stage-0 wrappers leave out of their
    groups (frozen or empty parameters: its ``is_optimized_parameter``), when ``stage0_names`` lists every
    parameter of the groups. ``wanted``: the names whose moments to read (a rank of a sharded engine reads
    its own share; the files are memory-mapped, so the rest is never read); None: every one."""
    model_files = _model_files(tag_dir)
    if not model_files:
        raise DeepSpeedCheckpointError(f"{tag_dir} holds no DeepSpeed model file (mp_rank_*_model_states.pt)")
    model = safe_load.load(model_files[0], trust)
    if "ds_version" not in model:
        raise DeepSpeedCheckpointError(f"{model_files[0]} has no 'ds_version': not a DeepSpeed checkpoint")
    optim_files = _optim_files(tag_dir)
    stage = _zero_stage(model, model_files, optim_files, trust)
    counters = {k: int(model.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}
    client = {k: v for k, v in model.items() if k not in DEEPSPEED_KEYS}
    module = {k: v for k, v in model["module"].items()}
    full = _frozen(model, model_files, stage, trust)  # names whose full-precision value was found
    moments = None
    loss_scale = None
    settings = None
    _check_every_rank(tag_dir, model, model_files, optim_files, stage)
    if optim_files:                                   # ZeRO 1-3 (or bf16 at stage 0): fp32 partitions
        # a rank of a sharded engine reads its share of each mapped file: checked whole only where all is read
        states = [safe_load.load(f, trust, whole=wanted is None)["optimizer_state_dict"] for f in optim_files]
        shapes = model.get("param_shapes")
        if not shapes:
            raise DeepSpeedCheckpointError(f"{model_files[0]} has no param_shapes: its ZeRO partitions cannot be "
                                           f"mapped to parameter names")
        _check_partitions(states, shapes, stage, model_files[0], optim_files)
        masters, moments = _merge(states, shapes, want_optimizer, stage, wanted)
        full.update(masters)
        scaler = states[0].get("loss_scaler")
        loss_scale = dict(vars(scaler)) if scaler is not None else None
        base = states[0].get("base_optimizer_state", states[0].get("optimizer_state_dict"))
        if isinstance(base, dict):                    # the elastic layout (a list) keeps no group settings
            settings = _zero_group_settings(base.get("param_groups"), [list(g) for g in shapes], model_files[0])
    elif stage0_names is not None and model.get("optimizer") is not None:
        opt = model["optimizer"]
        masters, moments = _stage0(opt, stage0_names, module, want_optimizer, stage0_frozen or set())
        if moments is not None and wanted is not None:
            moments = {n: m for n, m in moments.items() if n in wanted}
        full.update(masters)
        settings = _group_settings(opt.get("optimizer_state_dict", opt).get("param_groups"), stage0_names)
        loss_scale = _stage0_loss_scale(opt)
    module.update(full)                               # fp32 masters over the 16-bit module weights
    for alias, source in (model.get("shared_params") or {}).items():
        if source in full:                            # a tied weight: its other name takes the same master
            module[alias] = full[source]
        elif stage == 3 and source not in module and alias in module and module[alias].numel() == 0:
            # its source left out (exclude_frozen_parameters): the other name holds only ZeRO-3's placeholder,
            # left out too, as a missing name (DeepSpeed's own load keeps the model's value)
            del module[alias]
    stage0 = model.get("optimizer") if want_optimizer and not optim_files and stage0_names is None else None
    return DeepSpeedState(module=module, moments=moments if want_optimizer else None, optimizer_state_dict=stage0,
                          lr_scheduler=model.get("lr_scheduler"), counters=counters, loss_scale=loss_scale,
                          client_state=client, stage=stage, group_settings=settings if want_optimizer else None)


def _zero_group_settings(groups: list[dict] | None, flat_names: list[list[str]], where: str) -> dict[str, dict] | None:
    """Each name's group settings in a ZeRO checkpoint: the inner optimizer's groups hold flat partitions,
    each group's ``params`` their indices into ``param_shapes`` (one per group at stages 1-2, one per
    sub-group at stage 3, several per group where ``sub_group_size`` splits it). Settings that cannot be
    mapped so are not guessed at: a warning says the config's are kept."""
    if not groups:
        return None
    indices = [g.get("params") for g in groups]
    flat = [i for ids in indices if isinstance(ids, list) for i in ids]
    if all(isinstance(ids, list) for ids in indices) and sorted(flat) == list(range(len(flat_names))):
        names = [[n for i in ids for n in flat_names[i]] for ids in indices]
        return _group_settings(groups, names)
    warnings.warn(f"lazytrain: the optimizer groups of {where} ({len(groups)}) do not map onto its "
                  f"{len(flat_names)} flat partitions; their settings (lr, betas, eps, weight_decay) are not "
                  f"restored and the config's stay", UserWarning, stacklevel=3)
    return None


def _group_settings(groups: list[dict] | None, names: list[list[str]]) -> dict[str, dict] | None:
    """Each name's group settings (not its 'params'), the checkpoint's optimizer groups in the order of
    ``names``' groups (DeepSpeed restores them with the optimizer state); None if they do not pair up."""
    if not groups or len(groups) != len(names):
        return None
    return {n: {k: v for k, v in g.items() if k != "params"} for g, group in zip(groups, names) for n in group}


def _stage0_loss_scale(opt: dict) -> dict | None:
    """The loss scale a stage-0 model file keeps in its 16-bit wrapper's state (FP16_Optimizer,
    FP16_UnfusedOptimizer: ``cur_scale``, ``cur_iter``, and when dynamic ``last_overflow_iter``), under
    the names of DeepSpeed's loss scaler's attributes as ZeRO saves them; None for a plain optimizer's."""
    if "cur_scale" not in opt:
        return None
    out = {"cur_scale": opt["cur_scale"], "dynamic": bool(opt.get("dynamic_loss_scale", False))}
    out.update({k: opt[k] for k in ("cur_iter", "last_overflow_iter", "scale_factor", "scale_window") if k in opt})
    return out


def _frozen(model: dict, model_files: list[str], stage: int, trust: bool) -> dict[str, torch.Tensor]:
    """The parameters the optimizer does not own, from the fragments DeepSpeed keeps of them (stages 2
    and 3; at stage 3 each rank's model file holds its part)."""
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    parts = [model.get("frozen_param_fragments") or {}]
    if stage == 3:
        parts += [safe_load.load(f, trust).get("frozen_param_fragments") or {} for f in model_files[1:]]
    out = {}
    for name, shape in shapes.items():
        if all(name in p for p in parts):
            out[name] = _joined([p[name].reshape(-1) for p in parts]).narrow(0, 0, math.prod(shape)).view(tuple(shape))
    return out


def _moment_groups(state: dict) -> dict:
    """The inner optimizer's per-group state (flat moments of this rank's partition of each group)."""
    base = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
    if isinstance(base, list):
        if base and "state" in base[0]:               # older layouts: one state_dict per group
            return {g: s["state"][0] for g, s in enumerate(base)}
        step = state.get("base_optimizer_state_step")   # the elastic layout: one state per group
        return {g: s if step is None or "step" in s else {"step": step, **s} for g, s in enumerate(base)}
    return base["state"]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' parts one after the other (one rank's as it is: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _span(flats: list[torch.Tensor], offset: int, n: int) -> torch.Tensor:
    """Elements ``offset:offset+n`` of the ranks' partitions of one flat group laid end to end (a view of
    one partition where they lie in one; never the whole group joined)."""
    parts, start = [], 0
    for f in flats:
        a, b = max(offset - start, 0), min(offset + n - start, f.numel())
        if a < b:
            parts.append(f.narrow(0, a, b - a))
        start += f.numel()
    return _joined(parts)


def _tensor_keys(state: dict) -> list[str]:
    return [k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0]


def _check_partitions(states: list[dict], shapes: list[dict], stage: int, model_file: str, optim_files: list[str]):
    """Refuse, naming the files, a model file whose ``param_shapes`` the ranks' flat fp32 partitions cannot
    hold: other groups, or more elements than they keep (a model file and optimizer files of different saves,
    or of another model). Read on, a parameter would take another's values, or fail in a bare reshape."""
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = [len(s.get(key) or []) for s in states]
    where = f"{model_file} and its {len(optim_files)} optimizer state file(s)"
    if any(g != len(shapes) for g in groups):
        raise DeepSpeedCheckpointError(f"{where} do not match: param_shapes names {len(shapes)} parameter group(s), "
                                       f"the ranks' fp32 partitions hold {groups} (files of different saves?); "
                                       f"nothing was loaded")
    for state, file in zip(states, optim_files):
        _refuse_sparse_partitions(state, key, file)
    world = len(states)
    pads = states[0].get("param_alignment_paddings") if stage != 3 else None
    if pads is not None and [len(p) for p in pads] != [len(group) for group in shapes]:
        raise DeepSpeedCheckpointError(f"{where} do not match: param_shapes names {[len(group) for group in shapes]} "
                                       f"parameters per group, the alignment paddings {[len(p) for p in pads]} "
                                       f"(files of different saves?); nothing was loaded")
    for g, group_shapes in enumerate(shapes):
        numels = [math.prod(shape) for shape in group_shapes.values()]
        if stage == 3:   # each parameter split on its own: every rank's flat group holds ceil(n / world) of each
            needed, held = sum(math.ceil(n / world) for n in numels), min(s[key][g].numel() for s in states)
            what = f"{held} elements in the smallest rank's partition, {needed} needed there"
        else:            # the ranks' partitions end to end: each parameter, then its alignment padding
            needed = sum(numels) + (sum(pads[g]) if pads is not None else 0)
            held = sum(s[key][g].numel() for s in states)
            what = f"{held} elements over {world} rank(s), {needed} needed"
        if needed > held:
            raise DeepSpeedCheckpointError(
                f"{where} do not match: group {g}'s param_shapes ({len(numels)} parameters, {sum(numels)} elements) "
                f"does not fit its fp32 partitions ({what}; files of different saves?); nothing was loaded")


def _refuse_sparse_partitions(state: dict, key: str, file: str) -> None:
    """DeepSpeed writes each flat partition (fp32 weights and moments) as a 1-D tensor over its own bytes. One
    whose strides repeat elements (a single value expanded to 2**27) passed the count checks, and its copy
    took the memory it claimed (1 GB from a 4 KB file) before a later check refused the checkpoint."""
    tensors = list(state.get(key) or []) + [v for group in _moment_groups(state).values() if isinstance(group, dict)
                                            for v in group.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_contiguous() or \
                t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
            what = f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else \
                f"shape {tuple(t.shape)}, strides {t.stride()}"
            raise DeepSpeedCheckpointError(f"{file} holds a flat partition that is not a 1-D tensor over its own "
                                           f"bytes ({what}): not what DeepSpeed writes (damaged or crafted); "
                                           f"nothing was loaded")


def _merge(states: list[dict], shapes: list[dict], want_optimizer: bool, stage: int,
           wanted: set[str] | None = None):
    """Each parameter's fp32 master (and moments, of the ``wanted`` names or all) from the ranks' flat
    partitions, as ``zero_to_fp32.py`` reads them. Stages 1-2: a group's partitions laid end to end form one
    flat vector, each parameter at its offset, followed by its alignment padding. Stage 3: every parameter
    is split on its own, ``ceil(numel / ranks)`` elements per rank, at the same offset in each rank's flat
    group. Masters are views of the (memory-mapped) files where they lie in one partition; moments are
    copies (an optimizer may keep a loaded tensor as its state)."""
    world = len(states)
    pads = states[0].get("param_alignment_paddings") if stage != 3 else None
    masters, moments = {}, {} if want_optimizer else None
    for g, group_shapes in enumerate(shapes):
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        parts = {"master": [s[key][g] for s in states]}
        kept = {}
        if want_optimizer:
            per_rank = [_moment_groups(s).get(g, {}) for s in states]   # a group never stepped has none
            parts.update({k: [r[k] for r in per_rank] for k in _tensor_keys(per_rank[0])})
            kept = {k: v for k, v in per_rank[0].items() if k not in parts}   # the step, scalars
        offset = 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            n = math.prod(shape)
            width = math.ceil(n / world) if stage == 3 else n
            keys = [k for k in parts if k == "master" or wanted is None or name in wanted]
            if stage == 3:
                full = {k: _joined([f.narrow(0, offset, width) for f in parts[k]]).narrow(0, 0, n) for k in keys}
            else:
                full = {k: _span(parts[k], offset, n) for k in keys}
            masters[name] = full.pop("master").view(tuple(shape))
            if want_optimizer and (wanted is None or name in wanted) and (full or kept):
                moments[name] = {**kept, **{k: v.view(tuple(shape)).clone() for k, v in full.items()}}
            offset += width + (pads[g][i] if pads is not None else 0)
    return masters, moments


def _stage0(opt: dict, names: list[list[str]], module: dict, want_optimizer: bool, frozen: set[str]):
    """Masters and moments by name from a stage-0 model file's ``optimizer``: the optimizer's own state
    dict (fp32), DeepSpeed's FP16_UnfusedOptimizer (fp32 masters per parameter) or FP16_Optimizer (one
    flat fp32 master per group). The 16-bit wrappers hold the ``frozen`` parameters nowhere (neither
    masters nor inner optimizer state): the others' positions skip them."""
    if "fp32_groups_flat" in opt or "fp32_groups" in opt:
        names = [[n for n in group if n not in frozen] for group in names]
    flat_names = [n for group in names for n in group]
    if "fp32_groups_flat" in opt:                     # one flat master, one flat state, per group
        masters, moments = {}, {} if want_optimizer else None
        inner = opt["optimizer_state_dict"]["state"]
        for g, group in enumerate(names):
            parts = {"master": opt["fp32_groups_flat"][g]}
            kept = {}
            if want_optimizer and g in inner:
                parts.update({k: inner[g][k] for k in _tensor_keys(inner[g])})
                kept = {k: v for k, v in inner[g].items() if k not in parts}
            offset = 0
            for name in group:
                shape = tuple(module[name].shape)
                n = math.prod(shape)
                full = {k: v.narrow(0, offset, n).view(shape).clone() for k, v in parts.items()}
                masters[name] = full.pop("master")
                if want_optimizer and (full or kept):
                    moments[name] = {**kept, **full}
                offset += n
        return masters, moments
    masters = {}
    inner = opt
    if "fp32_groups" in opt:                          # fp32 masters per trainable parameter
        held = [len(ts) for ts in opt["fp32_groups"]]
        if held != [len(group) for group in names]:
            raise DeepSpeedCheckpointError(f"the stage-0 fp32 masters hold {held} parameters per group, this "
                                           f"model's optimizer {[len(group) for group in names]} trainable ones")
        masters = {n: t for group, ts in zip(names, opt["fp32_groups"]) for n, t in zip(group, ts)}
        inner = opt["optimizer_state_dict"]
    if not want_optimizer:
        return masters, None
    index = [i for g in inner["param_groups"] for i in g["params"]]
    if len(index) != len(flat_names):
        raise DeepSpeedCheckpointError(f"the stage-0 optimizer state holds {len(index)} parameters, this model's "
                                       f"optimizer {len(flat_names)}")
    return masters, {n: dict(inner["state"][i]) for i, n in zip(index, flat_names) if i in inner["state"]}
