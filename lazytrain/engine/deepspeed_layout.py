"""LazyTrain's checkpoints written in DeepSpeed 0.19's layout, so that a run moves either way.

Why: a script that trained with LazyTrain can go back to ``deepspeed.initialize()`` with the same config
and ``load_checkpoint`` the same directory, and DeepSpeed's ``zero_to_fp32.py`` turns it into a plain
state dict, as with a checkpoint DeepSpeed wrote. The files are those a DeepSpeed run of as many ranks
writes for the config's ZeRO stage (``zero_optimization.stage``, default 0). Unsharded ranks hold the same
full state, and rank 0 writes it as one rank; a sharded engine's ranks each write their part
(:class:`Writer`, sharded_checkpoint.py).

* Stage 0: ``mp_rank_00_model_states.pt`` holds the module and, under ``optimizer``, the optimizer's
  state dict; in bf16/fp16 the module in 16 bits and DeepSpeed's fp16 wrapper's state (the fp32 masters
  and the inner optimizer's state over them).
* Stages 1 and 2: ``mp_rank_00_model_states.pt`` (the module in the training precision, ``param_shapes``,
  ``shared_params``, at stage 2 the frozen parameters) and ``zero_pp_rank_0_mp_rank_00_optim_states.pt``
  (``bf16_zero_pp_rank_...`` in bf16): per parameter group one flat fp32 partition of the masters, the
  inner optimizer's state over it padded to DeepSpeed's alignment, the paddings and slice mappings, the
  loss scaler.
* Stage 3: ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (parameters as DeepSpeed's empty placeholders,
  buffers, frozen parameters as fragments) and the optimizer file with one fp32 flat per sub-group
  (``zero_optimization.sub_group_size``) and the inner optimizer's state over them.

The client state is top-level keys of the model file, where DeepSpeed keeps it. What DeepSpeed has no
place for goes to ``lazytrain_state.pt`` in the same tag: the plan, ``micro_steps``, LazyTrain's loss
scaler, and the optimizer's own state (per-parameter steps, HybridAdamW's settings and 8-bit moment codes,
whose dequantized fp32 values the DeepSpeed files hold); an fp32 moment the DeepSpeed files hold exactly
is referenced there, not stored twice. LazyTrain resumes from the two bit-identically.

The inner optimizer is written as the one DeepSpeed builds from the same config holds it: torch's
AdamW/Adam with ``"torch_adam": true``, ``DeepSpeedCPUAdam`` when ZeRO offloads the optimizer, FusedAdam
otherwise (and at stage 0 in 16 bits, with ``FP16_Optimizer`` around it); an optimizer object passed to
``initialize`` is written as it is. Flat tensors and 16-bit copies are streamed into the files
(:class:`checkpoint.Streamed`), never whole in memory.

What DeepSpeed cannot represent is said, never written differently without a word: parameters of one
flat group that the optimizer stepped a different number of times (DeepSpeed keeps one step per group)
are written with the group's largest step and a warning naming them; a client state key that DeepSpeed
uses itself is refused.
"""
from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from . import checkpoint as ckpt
from ..config import GRADIENT_CLIPPING_DEFAULT
from .deepspeed_checkpoint import DEEPSPEED_KEYS

DS_VERSION = "0.19.8"
LAZYTRAIN_FILE = "lazytrain_state.pt"
FORMAT = "lazytrain-state"
FROM_DEEPSPEED = "<in the DeepSpeed files>"   # a moment of the LazyTrain file that the DeepSpeed files hold
_CHUNK = 1 << 24   # elements per piece of a streamed tensor


class LossScaler(ckpt.PickledByName):
    pickle_as = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScaler(ckpt.PickledByName):
    pickle_as = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(ckpt.PickledByName):
    pickle_as = "deepspeed.utils.tensor_fragment.fragment_address"


class ZeroStageEnum(ckpt.PickledByName):
    pickle_as = "deepspeed.runtime.zero.config.ZeroStageEnum"

    def __reduce__(self):   # an enum member pickles as its class called with its value
        return type(self), (self.value,)


@dataclass
class Export:
    """What a LazyTrain engine hands over to be written."""
    model: nn.Module
    config: dict                                   # the config as given (DeepSpeed keeps it as ds_config)
    compute_dtype: torch.dtype
    module_state: dict                             # name -> tensor: fp32 masters for parameters, buffers
    names: dict                                    # id(tensor the optimizer updates) -> parameter name
    masters: dict                                  # parameter name -> its fp32 master
    optimizer: torch.optim.Optimizer | None
    optimizer_from_config: bool                    # built from the config's 'optimizer' section
    lr_scheduler: dict | None
    counters: dict                                 # global_steps, global_samples, skipped_steps
    client_state: dict
    loss_scaler: object | None                     # LazyTrain's LossScaler (fp16)
    overflow: bool = False                         # the last step's gradients were not finite (it was skipped)
    exclude_frozen: bool = False
    lazytrain_state: dict = field(default_factory=dict)   # plan, micro_steps, ...: into the LazyTrain file
    # a sharded engine (zero_optimization.stage >= 1 over several ranks): every rank writes its own files
    rank: int = 0
    world: int = 1
    groups: list | None = None          # the optimizer's whole groups (``optimizer`` holds this rank's part)
    whole_index: dict | None = None     # this rank's optimizer index -> the whole optimizer's
    whole_param_groups: list | None = None   # the whole optimizer's param_groups as a state_dict holds them
    summaries: dict | None = None       # name -> every tensor's state without its moments (from its owner)
    pieces: dict | None = None          # (name, key, start) -> fp32 values of a Need (from their holders)

    @property
    def sharded(self) -> bool:
        return self.pieces is not None


RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def copy_recovery_scripts(save_dir: str, tag: str) -> None:
    """DeepSpeed's zero_to_fp32.py (and zero_to_torch.py) beside a ZeRO checkpoint, as DeepSpeed copies them
    with every save: its docs tell users to run ``<save_dir>/zero_to_fp32.py``. Only where DeepSpeed is
    installed (its scripts are its own); a copy that fails warns and leaves the checkpoint as saved."""
    import glob
    import importlib.util
    import os
    import shutil
    import stat
    if not glob.glob(os.path.join(save_dir, tag, "*_optim_states.pt")):
        return   # no ZeRO files: nothing for the scripts to convert
    spec = importlib.util.find_spec("deepspeed")   # found, not imported
    if spec is None or not spec.origin:
        return
    for script in RECOVERY_SCRIPTS:
        src = os.path.join(os.path.dirname(spec.origin), "utils", script)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(save_dir, script)
        try:
            shutil.copyfile(src, dst + ".tmp")
            os.chmod(dst + ".tmp", os.stat(dst + ".tmp").st_mode | stat.S_IEXEC)
            os.replace(dst + ".tmp", dst)
        except OSError as e:
            warnings.warn(f"lazytrain: the checkpoint is saved, but DeepSpeed's {script} could not be copied "
                          f"beside it ({e})", UserWarning, stacklevel=3)


def files(x: Export) -> dict[str, object]:
    """File name -> object for ``checkpoint.save``: the DeepSpeed files and the LazyTrain file."""
    return Writer(x).files()


def files_for_ranks(x: Export, world: int) -> dict[str, object]:
    """File name -> object for an engine whose optimizer state every one of ``world`` ranks holds whole (an
    optimizer passed to initialize, which LazyTrain does not shard): DeepSpeed's files of ``world`` ranks, each
    rank's partition cut here from the whole state, as DeepSpeed's ranks of the same config write them (so
    DeepSpeed loads them on as many ranks), and the LazyTrain file as a one-rank save writes it."""
    whole = Writer(x)
    if world == 1 or whole.stage == 0 or x.optimizer is None:
        return whole.files()
    out = whole.lazytrain_files()
    summaries = whole.summaries()
    for rank in range(world):
        part = replace(x, rank=rank, world=world, summaries=summaries)
        writer = Writer(part)
        # each range read as its file is written (a view of the masters; 8-bit moments dequantized then): the
        # ranks' files are built before any is written. Those outside the flat groups as a one-rank save takes
        # them (their own dtype: a frozen weight is not copied to fp32)
        outside = {writer._name(p): p for p in writer._outside_groups()}
        part.pieces = {(n.name, n.key, n.start): whole.served_as_written(n) if n.name not in outside
                       else whole._master(outside[n.name]).detach().reshape(-1) for n in writer.needs()}
        out.update(writer.deepspeed_files())
    return out


def model_file(stage: int, rank: int = 0) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def optim_file(bf16: bool, rank: int = 0) -> str:
    return ("bf16_" if bf16 else "") + f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def optimizer_shard_file(rank: int) -> str:
    """LazyTrain's own optimizer state of the tensors rank ``rank`` owned (a sharded save)."""
    return f"lazytrain_optimizer_rank_{rank}.pt"


@dataclass(frozen=True)
class Need:
    """A range of one tensor's flattened fp32 values that this rank's files hold: ``key`` is "master" (the
    fp32 weight) or a moment of the optimizer state."""
    name: str
    key: str
    start: int
    length: int


def trainable(p: torch.Tensor) -> bool:
    """DeepSpeed's ``is_optimized_parameter``: what its optimizer wrappers own."""
    return p.requires_grad and p.numel() > 0


class Writer:
    """Builds one rank's files. Unsharded, everything is at hand. Sharded, each rank writes its part of
    DeepSpeed's N-rank layout, whose ranges cross the owners' tensors: the engine hands every rank the
    others' :meth:`summaries`, asks the holders for the ranges :meth:`needs` lists (each holder answers with
    :meth:`serve`), and puts them in ``Export.pieces`` before :meth:`files`."""

    def __init__(self, x: Export):
        self.x = x
        cfg = x.config
        self.zero = dict(cfg.get("zero_optimization") or {})
        self.stage = int(self.zero.get("stage", 0))
        self.dtype = x.compute_dtype
        self.opt = x.optimizer
        self.rank, self.world = x.rank, x.world
        groups = x.groups if x.groups is not None else (self.opt.param_groups if self.opt is not None else [])
        # tensors the optimizer updates that are no parameter of the model (a loss's learnable temperature):
        # DeepSpeed's files name every tensor they hold, so these live in the LazyTrain file alone
        self.extras = [p for g in groups for p in g["params"] if id(p) not in x.names]
        self.groups = [{**g, "params": [p for p in g["params"] if id(p) in x.names]} for g in groups]
        self.groups = [g for g in self.groups if g["params"]]
        self.flavor = self._flavor()
        # DeepSpeed's optimizer wrappers own the trainable parameters of each group (stages 1-3, and stage 0
        # in 16 bits); at stage 0 in fp32 the optimizer is used as it is
        self.wrapped = self.stage > 0 or self.dtype != torch.float32
        self.flat_groups = [[p for p in g["params"] if trainable(p)] for g in self.groups]
        self.covered = {x.names[id(p)] for ps in self.flat_groups for p in ps} if self.wrapped else set()
        self._casts: dict[tuple, ckpt.Streamed] = {}
        first: dict[int, str] = {}
        self.first_names = {n: first.setdefault(id(p), n) for n, p in x.model.named_parameters(remove_duplicate=False)}
        self.by_name = {n: p for n, p in x.model.named_parameters()}
        self.by_name.update((x.names[id(p)], p) for g in self.groups for p in g["params"])
        self.uneven: list[str] = []
        if x.world > 1 and self.stage == 0:
            raise ValueError("a sharded save needs zero_optimization.stage >= 1")

    # ---- which optimizer DeepSpeed would hold ---------------------------------------------------
    def _flavor(self) -> str:
        """``torch``, ``cpu`` or ``fused``: the Adam DeepSpeed builds from the config; ``own``: the
        optimizer is written as it is (an object passed to initialize, or a type DeepSpeed builds from
        torch.optim by name)."""
        if self.opt is None:
            return "own"
        hybrid = type(self.opt).__name__ == "HybridAdamW"
        typ = str((self.x.config.get("optimizer") or {}).get("type", "")).lower()
        if not self.x.optimizer_from_config or typ not in ("adam", "adamw"):
            return "torch" if hybrid else "own"     # DeepSpeed has no HybridAdamW: torch's AdamW holds its state
        params = (self.x.config.get("optimizer") or {}).get("params") or {}
        if params.get("torch_adam"):
            return "torch"
        offload = str((self.zero.get("offload_optimizer") or {}).get("device", "none")).lower()
        return "cpu" if self.stage > 0 and offload in ("cpu", "nvme") else "fused"

    def _adamw_mode(self, group: dict) -> bool:
        if "adamw_mode" in group:
            return bool(group["adamw_mode"])
        return isinstance(self.opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))

    def _group(self, g: dict) -> dict:
        """The group's settings as the DeepSpeed-built optimizer holds them (without ``params``), in its
        order: the keys the script's group gave first, then the optimizer's defaults."""
        own = {k: v for k, v in g.items() if k != "params"}
        if self.flavor == "own":
            return own
        common = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}
        common["betas"] = tuple(common["betas"])
        if self.flavor == "torch":
            params = (self.x.config.get("optimizer") or {}).get("params") or {}
            kwargs = {k: params[k] for k in ("foreach", "fused") if params.get(k) is not None}
            cls = torch.optim.AdamW if self._adamw_mode(g) else torch.optim.Adam
            ref = cls([torch.zeros(1)], amsgrad=bool(g.get("amsgrad", False)), **common, **kwargs).param_groups[0]
            ref = {k: v for k, v in ref.items() if k != "params"}
        elif self.flavor == "fused":
            ref = {"lr": g["lr"], "bias_correction": True, "betas": common["betas"], "eps": g["eps"],
                   "weight_decay": g["weight_decay"]}
        else:
            ref = {**common, "bias_correction": True, "amsgrad": False}
        given, tail = self._script_keys(g)
        out = {k: ref.get(k, own[k]) for k in given}
        out.update((k, v) for k, v in ref.items() if k not in out)
        out.update((k, own[k]) for k in tail)
        if self.flavor == "fused" and (self._any_state() or self.wrapped and self.stage == 0):
            out["step"] = 0   # FusedAdam's first step gives each group a step it never advances
        return out

    def _script_keys(self, g: dict) -> tuple[list, list]:
        """The keys the script's group gave (torch fills in the optimizer's defaults after them, in their
        order) and keys added after that (a schedule's ``initial_lr``)."""
        defaults = list(self.opt.defaults)
        keys = [k for k in g if k != "params"]
        tail = []
        while keys and keys[-1] not in self.opt.defaults:
            tail.insert(0, keys.pop())
        for i in range(len(keys) + 1):
            if keys[i:] == [d for d in defaults if d not in keys[:i]]:
                return keys[:i], tail
        return [k for k in keys if k not in self.opt.defaults], tail

    def _state(self, p: torch.Tensor) -> dict | None:
        """``p``'s optimizer state as the DeepSpeed-built optimizer holds it: moments in fp32 (real tensors,
        or streamed where HybridAdamW keeps 8-bit codes), the step as that optimizer counts it."""
        st = self.opt.state.get(p)
        if not st:
            return None
        if type(self.opt).__name__ == "HybridAdamW":
            out = {"step": st["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                out[key] = st[key] if key in st else ckpt.Streamed(
                    tuple(p.shape), torch.float32, lambda p=p, key=key: self.opt.fp32_moment_chunks(p, key, _CHUNK))
        else:
            out = dict(st)
        out = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        if "step" in out and self.flavor != "own":
            n = int(float(out["step"]))
            out["step"] = torch.tensor(float(n), dtype=torch.float32) if self.flavor == "torch" else n
        return out

    def _any_state(self) -> bool:
        if self.x.summaries is not None:
            return any(v is not None for v in self.x.summaries.values())
        return any(self.opt.state.values())

    def _summary(self, p: torch.Tensor) -> dict | None:
        """``p``'s state as :meth:`_state` gives it, each moment tensor replaced by :data:`_MOMENT`: from the
        local optimizer, or (sharded) from the summaries of every rank's."""
        if self.x.summaries is not None:
            return self.x.summaries.get(self._name(p))
        return _summarised(self._state(p), p)

    def summaries(self) -> dict[str, dict]:
        """name -> :meth:`_summary` of each tensor whose state this rank's optimizer holds."""
        out = {}
        for g in (self.opt.param_groups if self.opt is not None else []):
            for p in g["params"]:
                if id(p) in self.x.names and self.opt.state.get(p):
                    out[self._name(p)] = _summarised(self._state(p), p)
        return out

    # ---- tensors ---------------------------------------------------------------------------------
    def _name(self, p) -> str:
        return self.x.names[id(p)]

    def _master(self, p) -> torch.Tensor:
        return self.x.masters.get(self._name(p), p)

    def _piece(self, p, key: str, start: int, length: int):
        """Elements ``start:start+length`` of ``p``'s flattened fp32 ``key`` ("master" or a moment): from the
        pieces gathered for a sharded save, else (a whole tensor) from this rank's own state."""
        if self.x.pieces is not None:
            return self.x.pieces[(self._name(p), key, start)]
        if (start, length) != (0, p.numel()):
            raise AssertionError(f"{self._name(p)}: a part of a tensor outside a sharded save")
        return self._master(p).detach() if key == "master" else self._state(p)[key]

    def serve(self, need: Need) -> torch.Tensor:
        """The fp32 values of ``need`` from this rank's own state (a master's are a view of it)."""
        p = self.by_name[need.name]
        if need.key == "master":
            source = self._master(p).detach().reshape(-1)
            return source.narrow(0, need.start, need.length).to("cpu", torch.float32)
        value = self._state(p)[need.key]
        if isinstance(value, torch.Tensor):
            return value.detach().reshape(-1).narrow(0, need.start, need.length).to("cpu", torch.float32)
        return _range(value.pieces(), need.start, need.length)

    def served_as_written(self, need: Need):
        """:meth:`serve`, read as a file that holds it is written: a tensor's range as a view of it (a copy where
        it is elsewhere or in another dtype), an 8-bit moment's as a :class:`~.checkpoint.Streamed` that
        dequantizes it then."""
        p = self.by_name[need.name]
        value = self._master(p) if need.key == "master" else self._state(p)[need.key]
        if isinstance(value, torch.Tensor):
            return self.serve(need)
        return ckpt.Streamed((need.length,), torch.float32,
                             lambda: _range_pieces(value.pieces(), need.start, need.length))

    def _whole(self, p) -> torch.Tensor:
        """``p``'s fp32 value whole (frozen parameters, parameters outside the optimizer's groups): this
        rank's, or (sharded) the one gathered from where it is kept."""
        if self.x.pieces is not None:
            return self.x.pieces[(self._name(p), "master", 0)].view(p.shape)
        return self._master(p)

    def _lowp(self, t: torch.Tensor):
        """The module entry of a parameter whose fp32 master the optimizer state holds: in the training
        precision, as DeepSpeed's module holds it (cast piece by piece)."""
        if not t.is_floating_point():
            return t
        return self._written_alone(t, self.dtype if self.dtype != torch.float32 else t.dtype)

    def _written_alone(self, t: torch.Tensor, dtype: torch.dtype):
        """``t`` in ``dtype`` as the file holds it, its own elements only: a view into a layer's flat buffer
        would make torch.save write the whole buffer (every layer's weights in a file meant to hold some:
        a save without frozen parameters, a LoRA run's adapters). Written as it is when it is its storage,
        or when it has none of its own (a sparse buffer: its parts are written, each whole)."""
        if t.layout != torch.strided:
            return t.to(dtype)
        if dtype == t.dtype and t.untyped_storage().nbytes() == t.numel() * t.element_size():
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), dtype)   # a tied weight: once
        if key not in self._casts:
            self._casts[key] = ckpt.Streamed(tuple(t.shape), dtype, lambda t=t: (c.to(dtype) for c in _chunks(t)))
        return self._casts[key]

    def _flat(self, parts: list, numel: int) -> ckpt.Streamed:
        """One flat fp32 tensor: ``parts`` are tensors (read flat), Streamed, or ints (that many zeros)."""
        def pieces():
            for part in parts:
                if isinstance(part, int):
                    for start in range(0, part, _CHUNK):
                        yield torch.zeros(min(_CHUNK, part - start), dtype=torch.float32)
                elif isinstance(part, ckpt.Streamed):
                    yield from (c.float() for c in part.pieces())
                else:
                    yield from (c.float() for c in _chunks(part))
        return ckpt.Streamed((numel,), torch.float32, pieces)

    # ---- the files -------------------------------------------------------------------------------
    def needs(self) -> list[Need]:
        """The ranges of fp32 values this rank's files hold (a sharded save gathers them before
        :meth:`files`): its partition of each flat group's masters and moments, and on the ranks that write
        them, the frozen parameters and those outside the optimizer's groups."""
        out: dict[tuple, Need] = {}

        def add(p, key, start, n):
            out.setdefault((self._name(p), key, start), Need(self._name(p), key, start, n))
        if self.stage > 0 and self.opt is not None:
            flats = self._flat_layout()
            for segments, _ in self._partitions(flats):
                for p, start, n in (seg for seg in segments if not isinstance(seg, int)):
                    add(p, "master", start, n)
                    for key, v in (self._summary(p) or {}).items():
                        if key != "step" and _is_moment(v, p):
                            add(p, key, start, n)
            if self.rank == 0:   # frozen parameters: every rank holds them whole (_frozen_fragment, _module)
                for p in self._outside_groups():
                    if trainable(p):
                        add(p, "master", 0, p.numel())
        return list(out.values())

    def _outside_groups(self) -> list[torch.Tensor]:
        """Parameters no flat group holds, whose fp32 values the module (stages 1, 2) or the LazyTrain file
        (stage 3) keeps: frozen ones, and trainable ones in none of the optimizer's groups."""
        if self.stage == 3:
            return [p for n, p in self.x.model.named_parameters() if n not in self.covered and trainable(p)]
        return [p for n, p in self.x.model.named_parameters() if n not in self.covered and n in self.x.module_state]

    def files(self) -> dict[str, object]:
        """This rank's files: unsharded (or rank 0), the model file, the optimizer file and the LazyTrain
        file; sharded, each rank its optimizer partition and LazyTrain optimizer shard (and at stage 3 its
        model file, as each of DeepSpeed's ranks writes one)."""
        return {**self.deepspeed_files(), **self.lazytrain_files()}

    def deepspeed_files(self) -> dict[str, object]:
        """This rank's DeepSpeed files of :meth:`files`: its model file (rank 0, or every rank at stage 3) and
        its optimizer file."""
        x = self.x
        clash = sorted(set(x.client_state) & DEEPSPEED_KEYS)
        if clash:
            raise ckpt.CheckpointError(
                f"client_state key {clash[0]!r} is one DeepSpeed's checkpoint uses itself (client state is kept as "
                f"top-level keys of the model file, beside module, optimizer, lr_scheduler, ...): rename it")
        zero = self.stage > 0 and self.opt is not None
        flats = self._flat_layout() if zero else None
        out = {}
        if self.rank == 0 or self.stage == 3:
            out[model_file(self.stage, self.rank)] = self._model_file(flats)
        if zero:
            inner = self._stage3(flats) if self.stage == 3 else self._stage12(flats)
            out[optim_file(self.dtype == torch.bfloat16, self.rank)] = \
                {"optimizer_state_dict": inner, "ds_config": x.config, "ds_version": DS_VERSION}
        if self.uneven and self.rank == 0:
            warnings.warn(f"lazytrain: checkpoint in DeepSpeed's layout: DeepSpeed keeps one optimizer step count per "
                          f"parameter group, and these parameters were stepped fewer times than others of their group: "
                          f"{', '.join(self.uneven[:8])}{' ...' if len(self.uneven) > 8 else ''}; the DeepSpeed files "
                          f"give them the group's count (LazyTrain resumes them exactly)", UserWarning, stacklevel=4)
        return out

    def lazytrain_files(self) -> dict[str, object]:
        """This rank's LazyTrain files of :meth:`files`: the LazyTrain file (rank 0) and, sharded, its optimizer
        shard."""
        x, out = self.x, {}
        if self.rank == 0:
            # stage 3: parameters nothing else holds (trainable, yet in no optimizer group)
            zero = self.stage > 0 and self.opt is not None
            lazy_extra = {self._name(p): self._whole(p).detach().to("cpu") for p in self._outside_groups()} \
                if zero and self.stage == 3 else {}
            out[LAZYTRAIN_FILE] = self._lazytrain_file(lazy_extra)
        if x.sharded and self.opt is not None:
            out[optimizer_shard_file(self.rank)] = {"format": FORMAT, "rank": self.rank, "ranks": self.world,
                                                    "state": self._optimizer_state()[0]}
        return out

    def _model_file(self, flats) -> OrderedDict:
        x = self.x
        zero = flats is not None
        model = OrderedDict()
        model["module"] = self._module()
        model["buffer_names"] = _buffer_names(x.model)
        model["optimizer"] = self._stage0_optimizer() if self.stage == 0 and self.opt is not None else None
        model["param_shapes"] = [OrderedDict((self._name(p), torch.Size(p.shape)) for p in ps) for ps in flats] \
            if zero else None
        frozen = self.stage >= 2 and self.opt is not None and not x.exclude_frozen
        model["frozen_param_shapes"] = OrderedDict((n, torch.Size(p.shape)) for n, p in x.model.named_parameters()
                                                   if not trainable(p)) if frozen else None
        # DeepSpeed's ranks other than 0 find no tied weights (it looks for them on rank 0 alone)
        model["shared_params"] = (shared_params(x.model) if self.rank == 0 else {}) if zero else None
        model["frozen_param_fragments"] = OrderedDict(
            (n, self._frozen_fragment(p)) for n, p in x.model.named_parameters() if not trainable(p)) \
            if frozen else None
        model["lr_scheduler"] = x.lr_scheduler
        model["data_sampler"] = None
        model["random_ltd"] = None
        for k in ("skipped_steps", "global_steps", "global_samples"):
            model[k] = int(x.counters.get(k, 0))
        model["dp_world_size"] = self.world
        model["mp_world_size"] = 1
        model["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 1}
        model["ds_config"] = x.config
        model["ds_version"] = DS_VERSION
        model.update(x.client_state)
        return model

    def _frozen_fragment(self, p):
        """DeepSpeed's frozen parameter fragment: the whole (stages 1, 2), or this rank's part of it,
        flat, padded to ``ceil(numel / ranks)`` (stage 3); in the training precision, as DeepSpeed's module
        holds it (and as LazyTrain keeps a frozen parameter in bf16/fp16 with the weights in host memory).
        Every rank holds the frozen parameters whole: nothing is gathered for them."""
        if self.stage != 3:
            return self._lowp(self._master(p).detach())
        start, n = self._stage3_range(p)
        dtype = self.dtype if self.dtype != torch.float32 else p.dtype
        part = self._master(p).detach().reshape(-1).narrow(0, start, n).to("cpu", dtype)
        pad = self._partition_numel(p) - n
        return torch.cat([part, torch.zeros(pad, dtype=part.dtype)]) if pad else part

    def _module(self) -> OrderedDict:
        out = OrderedDict()
        outside = {id(p) for p in self._outside_groups()} if self.x.sharded else set()
        for name, t in self.x.module_state.items():
            source = self.first_names.get(name)   # None: a buffer
            if not isinstance(t, torch.Tensor):   # a module's extra state that is not a tensor: as it is
                out[name] = t
            elif self.stage == 3 and source is not None and self.opt is not None:
                # DeepSpeed's partitioned parameters leave placeholders: the optimizer file holds them. Without
                # an optimizer there is none (DeepSpeed writes no weights at all there), and they are written
                # whole below, in the training precision, as frozen ones are
                out[name] = torch.empty(0, dtype=self.dtype if t.is_floating_point() else t.dtype)
            elif source in self.covered:
                out[name] = self._lowp(t)
            elif source is not None and id(self.by_name.get(source)) in outside and trainable(self.by_name[source]):
                out[name] = self._whole(self.by_name[source]).detach()   # fp32, from where it is kept
            elif source is not None:   # frozen: in the training precision, as DeepSpeed's module holds it
                out[name] = self._lowp(t)
            else:   # buffers: as LazyTrain holds them (DeepSpeed casts on load)
                out[name] = self._written_alone(t, t.dtype) if t.is_floating_point() else t
        return out

    # stage 0 ---------------------------------------------------------------------------------------
    def _stage0_optimizer(self) -> dict:
        if not self.wrapped:   # fp32: the optimizer's own state dict
            return self._per_parameter([g["params"] for g in self.groups])
        if self.flavor == "fused":
            return self._fp16_optimizer()
        return self._fp16_unfused_optimizer()

    def _loss_scale_entries(self, always: bool) -> dict:
        s = self.x.loss_scaler
        if s is None:
            steps = int(self.x.counters.get("global_steps", 0)) + int(self.x.counters.get("skipped_steps", 0))
            return {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": steps} if always else {}
        out = {"dynamic_loss_scale": bool(s.dynamic), "cur_scale": s.scale, "cur_iter": int(s.cur_iter)}
        if s.dynamic:
            out.update(last_overflow_iter=int(s.last_overflow_iter), scale_factor=2.0, scale_window=s.scale_window)
        return out

    def _fp16_unfused_optimizer(self) -> dict:
        """DeepSpeed's FP16_UnfusedOptimizer (what wraps torch's Adam in bf16/fp16): fp32 masters per
        parameter, the inner optimizer's state over the trainable parameters only."""
        return {**self._loss_scale_entries(always=True), "optimizer_state_dict": self._per_parameter(self.flat_groups),
                "fp32_groups": [[self._master(p).detach().to("cpu") for p in ps] for ps in self.flat_groups]}

    def _per_parameter(self, params_by_group: list[list[torch.Tensor]]) -> dict:
        """A state dict over these parameters of each group, numbered in order as torch numbers them."""
        state, groups, i = {}, [], 0
        for g, ps in zip(self.groups, params_by_group):
            for p in ps:
                st = self._state(p)
                if st is not None:
                    state[i] = st
                i += 1
            groups.append({**self._group(g), "params": list(range(i - len(ps), i))})
        return {"state": state, "param_groups": groups}

    def _fp16_optimizer(self) -> dict:
        """DeepSpeed's FP16_Optimizer (what wraps FusedAdam in bf16/fp16): one flat fp32 master per group.
        (Its set-up steps FusedAdam once with zero gradients, so a run of its own counts one step more;
        the count written is the updates applied, with which DeepSpeed continues LazyTrain's run.)"""
        state, flats = {}, []
        for i, ps in enumerate(self.flat_groups):
            numel = sum(p.numel() for p in ps)
            flats.append(self._flat([self._master(p).detach() for p in ps], numel))
            st = self._flat_state(ps, [(p, 0, p.numel()) for p in ps], numel)
            if st is not None:
                state[i] = st
        groups = [{**self._group(g), "params": [i]} for i, g in enumerate(self.groups)]
        clip = float(self.x.config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT) or 0.0)   # as trained
        return {**self._loss_scale_entries(always=False),
                "optimizer_state_dict": {"state": state, "param_groups": groups},
                "fp32_groups_flat": flats, "clip_grad": clip}

    # stages 1-3 ------------------------------------------------------------------------------------
    def _partition_numel(self, p) -> int:
        """What each rank holds of ``p`` at stage 3: ``ceil(numel / ranks)`` elements (the last rank's padded)."""
        return math.ceil(p.numel() / self.world)

    def _stage3_range(self, p) -> tuple[int, int]:
        """(start, length) of this rank's part of ``p`` at stage 3 (length 0: all of it is padding)."""
        w = self._partition_numel(p)
        start = self.rank * w
        return start, max(0, min(w, p.numel() - start))

    def _flat_layout(self) -> list[list[torch.Tensor]]:
        """The parameters of each flat group in order: per parameter group (stages 1, 2), per sub-group of
        ``sub_group_size`` elements of each rank's partitions (stage 3)."""
        if self.stage != 3:
            return self.flat_groups
        size = int(float(self.zero.get("sub_group_size", 1e9)))
        self.sub_of_group = []
        out = []
        for ps in self.flat_groups:
            subs, sub, n = [], [], 0
            for j, p in enumerate(ps):
                sub.append(p)
                n += self._partition_numel(p)
                if n >= size or j == len(ps) - 1:
                    subs.append(sub)
                    sub, n = [], 0
            self.sub_of_group.append(list(range(len(out), len(out) + len(subs))))
            out.extend(subs)
        return out

    def _stage12_layout(self, ps) -> tuple[list[int], list[int], int, int]:
        """DeepSpeed's flat group: each parameter's offset and the alignment padding after it, the padded
        numel, and the numel aligned to ``2 x ranks`` (each rank's partition is an equal share of it)."""
        elsize = torch.empty((), dtype=self.dtype).element_size()
        param_alignment = 16 // math.gcd(16, elsize) if self.zero.get("parameter_alignment") else 1
        pads, offsets, offset = [], [], 0
        for j, p in enumerate(ps):
            offsets.append(offset)
            offset += p.numel()
            pad = 0 if j == len(ps) - 1 else (-offset) % param_alignment
            pads.append(pad)
            offset += pad
        alignment = 2 * self.world   # nccl_start_alignment_factor (2) x ranks
        # DeepSpeed's flat buffer (flatten_dense_tensors_aligned): no padding after the last parameter
        return offsets, pads, offset, math.ceil(offset / alignment) * alignment

    def _segments(self, ps, pads, tail: int, lo: int, hi: int) -> list:
        """The flat group ``ps`` (each followed by its padding, then ``tail`` zeros) within ``[lo, hi)``:
        (parameter, start, length) for a parameter's elements, an int for that many zeros."""
        out, offset = [], 0

        def take(n, what):
            a, b = max(offset, lo), min(offset + n, hi)
            if a < b:
                out.append(b - a if what is None else (what, a - offset, b - a))
        for p, pad in zip(ps, pads):
            take(p.numel(), p)
            offset += p.numel()
            take(pad, None)
            offset += pad
        take(tail, None)
        return out

    def _stage3_segments(self, ps) -> list:
        out = []
        for p in ps:
            start, n = self._stage3_range(p)
            if n:
                out.append((p, start, n))
            if self._partition_numel(p) - n:
                out.append(self._partition_numel(p) - n)
        return out

    def _partitions(self, flats) -> list[tuple[list, int]]:
        """Per flat group: this rank's segments and its partition's numel."""
        out = []
        for ps in flats:
            if self.stage == 3:
                out.append((self._stage3_segments(ps), sum(self._partition_numel(p) for p in ps)))
            else:
                _, pads, padded, aligned = self._stage12_layout(ps)
                part = aligned // self.world
                lo = self.rank * part
                out.append((self._segments(ps, pads, aligned - padded, lo, lo + part), part))
        return out

    def _flat_masters(self, segments, numel: int) -> ckpt.Streamed:
        return self._flat([seg if isinstance(seg, int) else self._piece(seg[0], "master", seg[1], seg[2])
                           for seg in segments], numel)

    def _flat_state(self, ps, segments, numel: int) -> dict | None:
        """The inner optimizer's state over this rank's partition of one flat group: each moment laid out as
        the masters are (``segments``); the group's one step, the largest of its parameters' (``ps``, the
        whole group)."""
        states = {id(p): self._summary(p) for p in ps}
        if all(s is None for s in states.values()):
            return None
        keys = list(dict.fromkeys(k for p in ps if states[id(p)] is not None for k, v in states[id(p)].items()
                                  if k != "step" and _is_moment(v, p)))
        steps = [float(states[id(p)]["step"]) if states[id(p)] is not None and "step" in states[id(p)] else None
                 for p in ps]
        known = [s for s in steps if s is not None]
        top = max(known) if known else None
        self.uneven += [self._name(p) for p, s in zip(ps, steps) if s != top]
        out = {}
        if top is not None:
            out["step"] = next(states[id(p)]["step"] for p, s in zip(ps, steps) if s == top)
        for key in keys:
            parts = []
            for seg in segments:
                if isinstance(seg, int):
                    parts.append(seg)
                else:
                    p, start, n = seg
                    st = states[id(p)]
                    parts.append(self._piece(p, key, start, n) if st is not None and key in st
                                 and _is_moment(st[key], p) else n)
            out[key] = self._flat(parts, numel)
        for st in states.values():   # scalars other than the step, as the optimizer holds them
            for k, v in (st or {}).items():
                if k != "step" and k not in keys and k not in out and not (isinstance(v, torch.Tensor) and v.dim()):
                    out[k] = v
        return out

    def _stage12(self, flats) -> dict:
        """DeepSpeedZeroOptimizer.state_dict() of this rank (the rigid layout, which DeepSpeed loads with
        elastic_checkpoint on or off)."""
        base_state, fp32, group_pads, param_pads, mappings = {}, [], [], [], []
        for i, (ps, (segments, part)) in enumerate(zip(flats, self._partitions(flats))):
            offsets, pads, padded, _ = self._stage12_layout(ps)
            lo = self.rank * part
            # DeepSpeed's groups_padding: what of this rank's partition lies past the group's elements
            pad = part if padded <= lo else lo + part - padded if padded < lo + part else 0
            group_pads.append(pad)
            param_pads.append(pads)
            # the fp32 partition without its padding, as DeepSpeed saves it (the moments keep theirs)
            fp32.append(self._flat_masters(_without_tail(segments, pad), part - pad))
            st = self._flat_state(ps, segments, part)
            if st is not None:
                base_state[i] = st
            offset_of = {id(p): o for p, o in zip(ps, offsets)}
            mappings.append(OrderedDict((self._name(p), FragmentAddress(numel=n, start=offset_of[id(p)] + start - lo))
                                        for p, start, n in (seg for seg in segments if not isinstance(seg, int))))
        groups = [{**self._group(g), "params": [i]} for i, g in enumerate(self.groups)]
        clip = float(self.x.config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT) or 0.0)   # as trained
        return {"loss_scaler": self._ds_loss_scaler(), "dynamic_loss_scale": self._dynamic(),
                "overflow": bool(self.x.overflow), "clip_grad": clip,
                "base_optimizer_state": {"state": base_state, "param_groups": groups},
                "single_partition_of_fp32_groups": fp32,
                "zero_stage": ZeroStageEnum(value=self.stage), "group_paddings": group_pads,
                "param_alignment_paddings": param_pads, "partition_count": [self.world] * len(flats),
                "ds_version": DS_VERSION, "param_slice_mappings": mappings}

    def _stage3(self, flats) -> dict:
        """DeepSpeedZeroOptimizer_Stage3.state_dict() of this rank."""
        state, fp32 = {}, []
        for i, (ps, (segments, numel)) in enumerate(zip(flats, self._partitions(flats))):
            fp32.append(self._flat_masters(segments, numel))
            st = self._flat_state(ps, segments, numel)
            if st is not None:
                state[i] = st
        groups = [{**self._group(g), "params": subs} for g, subs in zip(self.groups, self.sub_of_group)]
        return {"zero_stage": ZeroStageEnum(value=3), "loss_scaler": self._ds_loss_scaler(),
                "dynamic_loss_scale": self._dynamic(), "overflow": bool(self.x.overflow),
                "partition_count": self.world,
                "optimizer_state_dict": {"state": state, "param_groups": groups}, "fp32_flat_groups": fp32}

    def _dynamic(self) -> bool:
        return bool(self.x.loss_scaler is not None and self.x.loss_scaler.dynamic)

    def _ds_loss_scaler(self):
        s = self.x.loss_scaler
        if s is None:
            return LossScaler(cur_scale=1.0, dynamic=False)
        if not s.dynamic:
            return LossScaler(cur_scale=s.scale, dynamic=False)
        return DynamicLossScaler(cur_scale=s.scale, dynamic=True, cur_iter=int(s.cur_iter),
                                 last_overflow_iter=int(s.last_overflow_iter), scale_factor=2.0,
                                 scale_window=s.scale_window, min_scale=s.min_scale, delayed_shift=s.hysteresis,
                                 cur_hysteresis=s.cur_hysteresis, consecutive_hysteresis=s.consecutive_hysteresis,
                                 raise_error_at_min_scale=True, dtype=torch.float16)

    # the LazyTrain file -----------------------------------------------------------------------------
    def _optimizer_state(self) -> tuple[dict, list]:
        """This rank's optimizer's state (by the whole optimizer's indices when sharded), each fp32 moment
        the DeepSpeed files hold exactly replaced by a reference to them; and its ``param_groups``."""
        sd = self.opt.state_dict()
        positions = [p for g in self.opt.param_groups for p in g["params"]]
        index = [i for g in sd["param_groups"] for i in g["params"]]
        in_ds = {id(p) for ps in self.flat_groups for p in ps} if self.wrapped else \
            {id(p) for g in self.groups for p in g["params"]}
        whole = self.x.whole_index if self.x.whole_index is not None else {i: i for i in index}
        state = {}
        for i, p in zip(index, positions):
            if i not in sd["state"]:
                continue
            held = self._state(p) if id(p) in in_ds else None
            state[whole[i]] = {k: (FROM_DEEPSPEED if held is not None and _exact_moment(v, held.get(k), p) else v)
                               for k, v in sd["state"][i].items()}
        groups = self.x.whole_param_groups if self.x.whole_param_groups is not None else sd["param_groups"]
        return state, groups

    def _lazytrain_file(self, module_extra: dict) -> dict:
        """LazyTrain's own state: the optimizer's state dict with each fp32 moment the DeepSpeed files hold
        exactly replaced by a reference to them. Sharded, the states are in each rank's
        :func:`optimizer_shard_file` and this file says how many there are."""
        sd, names, stage0, shards = None, [], None, 0
        if self.opt is not None:
            state, groups = self._optimizer_state()
            if self.x.sharded:
                state, shards = {}, self.world
            sd = {"state": state, "param_groups": groups}
            positions = [p for g in (self.x.groups if self.x.groups is not None else self.opt.param_groups)
                         for p in g["params"]]
            names = [self.x.names.get(id(p)) for p in positions]
            if self.stage == 0:   # the names of the DeepSpeed optimizer's parameters, in its order
                stage0 = [[self._name(p) for p in ps] for ps in self.flat_groups] if self.wrapped else \
                    [[self._name(p) for p in g["params"]] for g in self.groups]
        return {"format": FORMAT, "version": 2, "deepspeed_stage": self.stage, "optimizer": sd,
                "optimizer_names": names, "optimizer_shards": shards, "stage0_names": stage0,
                "module_extra": module_extra,
                "extra_params": [p.detach().to("cpu", copy=True) for p in self.extras], **self.x.lazytrain_state}


_MOMENT = "<a moment tensor>"   # stands for a moment in a state's summary (:meth:`Writer.summaries`)


def _is_moment(v, p) -> bool:
    """A per-element state (an Adam moment), laid out as the masters are: of ``p``'s shape (a 0-dim
    parameter's moments are 0-dim too; its step is never asked about). Other tensors of a state (Adafactor's
    row and column factors, even one of a one-row weight's element count; an 8-bit optimizer's block scales)
    are not laid out in DeepSpeed's flat groups: LazyTrain's own file keeps them."""
    if isinstance(v, ckpt.Streamed) or (isinstance(v, str) and v == _MOMENT):
        return True
    return isinstance(v, torch.Tensor) and v.shape == p.shape


def _summarised(st: dict | None, p: torch.Tensor) -> dict | None:
    if st is None:
        return None
    return {k: (_MOMENT if k != "step" and _is_moment(v, p) else v) for k, v in st.items()}


def _range(pieces, start: int, length: int) -> torch.Tensor:
    """Elements ``start:start+length`` of the concatenation of flat ``pieces``, as fp32."""
    out = list(_range_pieces(pieces, start, length))
    return torch.cat(out) if len(out) != 1 else out[0].clone()


def _range_pieces(pieces, start: int, length: int):
    """The parts of each of flat ``pieces`` that fall in elements ``start:start+length`` of their concatenation,
    in order, as fp32."""
    offset = 0
    for piece in pieces:
        a, b = max(start - offset, 0), min(start + length - offset, piece.numel())
        if a < b:
            yield piece.reshape(-1)[a:b].float()
        offset += piece.numel()
        if offset >= start + length:
            break


def _without_tail(segments: list, n: int) -> list:
    """``segments`` less their last ``n`` elements, which are padding (ints)."""
    out = list(segments)
    while n:
        if not out or not isinstance(out[-1], int):
            raise AssertionError("a partition's padding is not at its end")
        drop = min(n, out[-1])
        n -= drop
        out[-1] -= drop
        if not out[-1]:
            out.pop()
    return out


def _exact_moment(value, held, p) -> bool:
    """The DeepSpeed files hold this moment exactly: the fp32 tensor itself (or its host copy)."""
    return isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and value.dim() > 0 and \
        value.dtype == held.dtype == torch.float32 and value.shape == p.shape and \
        (held is value or held.device != value.device)


def _chunks(t: torch.Tensor):
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        yield flat[start:start + _CHUNK].to("cpu")


def _buffer_names(model: nn.Module) -> list[str]:
    """DeepSpeed's ``_get_buffer_names``: the persistent buffers, module by module."""
    out = []

    def walk(module, prefix):
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append(prefix + name)
        for name, child in module.named_children():
            if child is not None:
                walk(child, prefix + name + ".")
    walk(model, "")
    return out


def shared_params(model: nn.Module) -> dict[str, str]:
    """DeepSpeed's ``_get_shared_params``: each further name of a tied parameter -> its first name."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out
