"""JSON config -> validated, frozen dataclasses.

Accepts DeepSpeed's config (dict, path to a JSON file, or base64-encoded JSON) plus a "lazytrain"
section for our own settings. Every error names the offending key and its section. What DeepSpeed 0.19
accepts, this accepts: settings of DeepSpeed features LazyTrain does not implement are listed in one
warning (a setting at its off value is silent), unknown top-level keys in another, as DeepSpeed ignores
them; unknown keys inside the sections we implement are errors (a typo must not silently change
training), and a setting LazyTrain cannot honour (bf16 masters, tensor parallelism) is refused by name.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from .launcher_env import launcher_int
from .tiers.base import parse_bytes


class ConfigError(ValueError):
    """A config value LazyTrain cannot accept; the message names the key."""


class BatchConfigError(ConfigError, AssertionError):
    """Batch triple inconsistent (an AssertionError too, as in DeepSpeed)."""


# --------------------------------------------------------------------------------------------
# Keys of DeepSpeed features that LazyTrain does not implement: accepted with one warning each.
_UNIMPLEMENTED_TOP = {
    "tensorboard": "write metrics yourself or use the engine's printed log",
    "wandb": "log from your training loop",
    "csv_monitor": "log from your training loop",
    "comet": "log from your training loop",
    "comms_logger": "LazyTrain has no communication logger",
    "flops_profiler": "use the planner's prediction (`lazytrain plan`)",
    "autotuning": "the MILP planner chooses the memory plan",
    "compression_training": "not supported",
    "sparse_attention": "not supported",
    "pipeline": "pipeline parallelism is not supported; layers stream on one GPU",
    "data_efficiency": "not supported",
    "curriculum_learning": "not supported",
    "elasticity": "not supported",
    "amp": "use bf16 or fp16",
    "prescale_gradients": "gradients are averaged after reduction",
    "gradient_predivide_factor": "gradients are averaged after reduction",
    "sparse_gradients": "not supported",
    "dump_state": "not supported",
    "memory_breakdown": "peak memory per tier is reported every steps_per_print steps",
    "zero_allow_untested_optimizer": "any torch optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "LazyTrain uses its own host optimizer",
    "checkpoint": "checkpoint tuning keys do not apply",
    "nebula": "not supported",
    "data_types": "gradients are accumulated in fp32",
    "compile": "not supported",
    "fp32_allreduce": "DeepSpeed itself replaced it by 'communication_data_type': \"fp32\" reduces gradients in fp32",
    "eigenvalue": "not supported",
    "progressive_layer_drop": "not supported",
    "quantize_training": "not supported",
    "weight_quantization": "not supported",
    "hybrid_engine": "not supported",
    "timers": "not supported",
    "torch_autocast": "use bf16 or fp16",
    "seq_parallel_communication_data_type": "sequence parallelism is not supported",
    "disable_allgather": "not applicable",
    "zero_quantized_weights": "not supported",
    "train_batch_size_per_gpu": "not a DeepSpeed key used by LazyTrain",
    "graph_harvesting": "not supported",
    "use_data_before_expert_parallelism": "expert parallelism is not supported",
    "expert_parallel": "expert parallelism is not supported",
    "vocabulary_size": "LazyTrain reads the model itself",
    "gradient_allreduce_op": "data-parallel gradients are averaged",
    "log_level": "LazyTrain reports through Python warnings and its step log",
    "disable_python_gc": "not supported",
}
_ZERO_UNIMPLEMENTED = {
    "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "elastic_checkpoint", "ignore_unused_parameters",
    "legacy_stage1", "load_from_fp32_weights", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "model_persistence_threshold", "stage3_model_persistence_threshold", "leaf_module", "cpu_offload_param",
    "parameter_alignment", "enable_sanity_checks", "compute_grad_norm", "use_multi_rank_bucket_allreduce",
    "save_muon_momentum_buffer_in_memory", "zenflow",
    "module_granularity_threshold", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory",
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "stage3_module_granularity_threshold", "zeropp_loco_param", "offload_optimizer_config",
}
# DeepSpeed's names for one setting: save_model gathers the 16-bit weights (accelerate and Hugging Face ask)
_GATHER_ON_SAVE_KEYS = ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                        "stage3_gather_fp16_weights_on_model_save")
_OFFLOAD_PARAM_KEYS = {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}
_OFFLOAD_OPT_KEYS = {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                     "fast_init", "ratio", "pipeline", "super_offload", "cpuadam_cores_perc"}
_AIO_KEYS = {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
             "overlap_events", "use_gds"}
_AC_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
            "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"}
_TOP_IMPLEMENTED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
    "managed_gradient_accumulation", "zero_optimization", "aio", "activation_checkpointing", "lazytrain",
    "dataloader_drop_last", "communication_data_type",
    "job",   # settings of the `lazytrain train` command (model, task, steps); not read by the engine
}

GRADIENT_CLIPPING_DEFAULT = 1.0   # DeepSpeed 0.19's (runtime/constants.py)

# torch.distributed's groups refuse a timeout past about 3e9 s (gloo's milliseconds), and a timedelta
# overflows near 1e14 s: a "never" larger than this failed at set-up with a misleading socket time-out
MAX_COLLECTIVE_TIMEOUT_S = 1e9
POLICIES = ("every_k", "keep_all", "offload_all", "plan", "milp", "auto")


class _Ignored:
    """The settings of a config that have no effect here, said once, in one warning, at the end of parsing
    (a stock Hugging Face ZeRO-3 config would otherwise print a line per ZeRO tuning key)."""

    def __init__(self):
        self.notes: dict[str, str] = {}
        self.unknown: list[str] = []

    def note(self, key: str, message: str) -> None:
        self.notes.setdefault(key, message)

    def emit(self) -> None:
        if self.unknown:
            warnings.warn(f"lazytrain config: unknown top-level key(s) {', '.join(repr(k) for k in self.unknown)}: "
                          f"not a DeepSpeed key LazyTrain knows; ignored, as DeepSpeed ignores them (check the "
                          f"spelling if you meant a setting)", UserWarning, stacklevel=3)
        if self.notes:
            warnings.warn(f"lazytrain config: {len(self.notes)} setting(s) have no effect in LazyTrain: "
                          + " ".join(self.notes.values()), UserWarning, stacklevel=3)


def _is_off(value) -> bool:
    """A setting at its off value (false, null, {} or {"enabled": false}): nothing to say about it."""
    return value is None or value is False or value == {} or (isinstance(value, dict) and value.get("enabled") is False)


def _check_keys(section: dict, allowed: set, name: str) -> None:
    if not isinstance(section, dict):
        raise ConfigError(f"config section '{name}' must be an object, got {type(section).__name__}")
    for key in section:
        if key not in allowed:
            raise ConfigError(f"unknown key '{key}' in config section '{name}' "
                              f"(allowed: {', '.join(sorted(allowed))})")


_TRUE, _FALSE = {"true", "yes", "on", "1", "t", "y"}, {"false", "no", "off", "0", "f", "n"}


def _flag(section: dict, key: str, default: bool, where: str) -> bool:
    """A true/false setting as DeepSpeed's config models read it: a JSON boolean, 0 or 1, or a string such as
    "true" or "false" (``bool("false")`` would be True: a setting turned on by the word that says off)."""
    value = section.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    name = f"{where}.{key}" if where else key   # a top-level key is named alone
    raise ConfigError(f"config key '{name}' must be true or false, got {value!r}")


def _quant_block_size(section: dict) -> int:
    """HybridAdamW's 8-bit block: a multiple of 32 from 32 to 16384 elements (its kernels' and bitsandbytes')."""
    size = _number(section, "quant_block_size", 256, "lazytrain", integer=True, minimum=32)
    if size % 32 or size > 16384:
        raise ConfigError(f"config key 'lazytrain.quant_block_size' must be a multiple of 32 from 32 to 16384, got "
                          f"{size}")
    return size


def _milp_time_limit(section: dict) -> float:
    """Seconds the MILP may search: a finite number > 0 (the planner stops it, and a child process running it,
    at a deadline that grows with this)."""
    limit = float(_number(section, "milp_time_limit", 30.0, "lazytrain", above=0))
    if not math.isfinite(limit):
        raise ConfigError(f"config key 'lazytrain.milp_time_limit' must be a finite number of seconds, got {limit!r}")
    return limit


def _number(section: dict, key: str, default, where: str, integer: bool = False, minimum: float | None = None,
            above: float | None = None, text: bool = False, finite: bool = False):
    """A number setting, refused by name when it is not one (a string, a fraction where a whole number is due, a
    value out of range) rather than converted or truncated behind the user's back. ``text``: a key DeepSpeed
    reads through a pydantic model, which takes a number written as a string ("0", "1e-3") as that number.
    ``finite``: infinity refused too (a whole number always refuses it)."""
    value = section.get(key, default)
    if text and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            value = int(number) if number.is_integer() else number
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"config key '{where}.{key}' must be a number, got {value!r}")
    if (finite or integer) and not math.isfinite(value):   # JSON's Infinity or 1e400
        raise ConfigError(f"config key '{where}.{key}' must be a finite {'whole ' if integer else ''}number, "
                          f"got {value!r}")
    if integer:
        if value != int(value):
            raise ConfigError(f"config key '{where}.{key}' must be a whole number, got {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"config key '{where}.{key}' must be >= {minimum:g}, got {value!r}")
    if above is not None and value <= above:
        raise ConfigError(f"config key '{where}.{key}' must be > {above:g}, got {value!r}")
    return value


_OFFLOAD_IGNORED = {"buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write", "fast_init",
                    "ratio", "pipeline", "super_offload", "cpuadam_cores_perc"}


def _drop_ignored_auto(d: dict) -> None:
    """"auto" left in a ZeRO tuning key LazyTrain ignores (TRL copies the config before Trainer fills them):
    dropped, as DeepSpeed's config models drop "auto" and take their defaults. Where LazyTrain uses the value,
    "auto" stays an error (_check_no_auto)."""
    zero = d.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for key in [k for k in zero if k in _ZERO_UNIMPLEMENTED and zero[k] == "auto"]:
        del zero[key]
    for name in ("offload_param", "offload_optimizer"):
        section = zero.get(name)
        if isinstance(section, dict):
            for key in [k for k in section if k in _OFFLOAD_IGNORED and section[k] == "auto"]:
                del section[key]


def _check_no_auto(d: Any, path: str) -> None:
    if isinstance(d, dict):
        for k, v in d.items():
            _check_no_auto(v, f"{path}.{k}" if path else k)
    elif d == "auto":
        raise ConfigError(f"config key '{path}' is \"auto\": replace it with a value (Hugging Face Trainer and "
                          f"accelerate fill \"auto\" before calling initialize; plain scripts must set it)")


def _positive_int(value: Any, key: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, float) and value.is_integer():   # 8.0, as DeepSpeed takes it
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    return value


def _section(value: Any) -> Any:
    """A config section set to null is a section not set, as DeepSpeed reads ``"bf16": null``."""
    return {} if value is None else value


# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerConfig:
    type: str | None = None
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    type: str | None = None
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0             # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False             # the forward's floating-point positional inputs cast to fp16 (DeepSpeed's)


@dataclass(frozen=True)
class OffloadConfig:
    device: str = "none"                # none | cpu | nvme
    nvme_path: str | None = None


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's ``aio`` section, read by the NVMe tier's own schema (``tiers.nvme_io.AioSettings``):
    one set of keys, defaults and checks. ``single_submit`` and ``overlap_events`` are accepted and kept
    for DeepSpeed configs; they have no counterpart here."""
    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 4
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool | None = None         # None: kvikio when it works; true: required; false: never

    def tier_settings(self) -> dict:
        """What the NVMe tier is built with."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "intra_op_parallelism": self.intra_op_parallelism, "use_gds": self.use_gds}


@dataclass(frozen=True)
class TestingConfig:
    """``lazytrain.testing``: settings for tests and benchmarks, never for training runs."""
    copy_threads: bool = False          # CPU: transfers run on copy threads, as on CUDA streams
    chaos_seed: int | None = None       # delay every transfer and layer update at random (seeded)
    chaos_max_delay_ms: float = 2.0
    # emulated links on the CPU: link name -> (GB/s, latency in ms); the copies on it take at least that long
    links: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.copy_threads or self.chaos_seed is not None or bool(self.links)


_TESTING_KEYS = {"copy_threads", "chaos_seed", "chaos_max_delay_ms", "links"}


@dataclass(frozen=True)
class AutoPlanConfig:
    """``lazytrain.auto``: policy "auto" measures this model on this machine, plans from the measurements,
    and plans again when the measured step drifts from the prediction."""
    warmup_steps: int = 3               # steps run before measuring (allocation, first use of the kernels)
    profile_steps: int = 2              # traced steps the costs are the medians of
    check_every: int = 50               # steps between comparisons of the measured step with the prediction
    drift_margin: float = 0.15          # |measured / predicted - 1| beyond this plans again
    max_replans: int = 3                # plans after the first, at most
    selective: bool = True              # also measure selective layers (profile_steps + 1 more steps), so
                                        # the plan may choose them on measured costs
    profile_path: str | None = None     # write the measured profile here (JSON, for `lazytrain plan --profile`)
    profile: str | None = None          # plan from this saved profile at start-up instead of measuring first


_AUTO_KEYS = {"warmup_steps", "profile_steps", "check_every", "drift_margin", "max_replans", "profile_path",
              "profile", "selective"}


@dataclass(frozen=True)
class LazyTrainSection:
    blocks: str | None = None           # dotted path of the block list, e.g. "transformer.h"
    policy: str = "every_k"             # every_k (MegaTrain) | keep_all | offload_all | plan | milp | auto
    auto: AutoPlanConfig = field(default_factory=AutoPlanConfig)   # policy auto
    checkpoint_interval: int | None = None   # None: from number_checkpoints, else 4 (MegaTrain)
    number_checkpoints: int | None = None    # activation_checkpointing.number_checkpoints
    boundary_home: str = "hbm"          # where kept boundaries live
    plan_path: str | None = None        # policy "plan": a Plan JSON written by `lazytrain plan --json`
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    prefetch: bool = True
    last_segment_graph: str | bool = "auto"   # auto (on when the CPU computes on weights in place) | true | false
    overlap_optimizer: str | bool = "auto"    # auto (on with a CUDA device) | true | false
    weights_home: str = "host"          # host | nvme | hbm (hbm = all layers resident, no streaming)
    tiers: tuple = ()                   # user tiers: ({"name", "class", "capacity", ...},)
    capacities: dict = field(default_factory=dict)  # tier name -> budget in bytes (None = unbounded)
    capacity_keys: dict = field(default_factory=dict)   # tier name -> the config key that gave its budget
    optimizer_states: str = "fp32"      # fp32 | 8bit (block tensors' Adam moments)
    hybrid_threshold: int = 4096        # tensors smaller than this keep fp32 states
    quant_block_size: int = 256         # HybridAdamW's measured default (bitsandbytes' CUDA block size)
    fp32_state_patterns: tuple | None = None   # None: HybridAdamW's defaults (norms, biases, ln_*)
    milp_time_limit: float = 30.0
    collective_timeout_s: float = 1800.0   # a rank that hangs fails the others after this long (torch's default)
    gradient_reduce: str = "auto"       # auto | device | host: where stage >= 2 reduces layer gradients to owners
    grad_norm_as_landed: bool = True    # trust the version counter on layer gradient buffers: the clipping norm
                                        # from sums taken as gradients land, a cleared buffer written unread
    trust_checkpoints: bool = False     # unpickle checkpoints without restriction (they may then run code)
    check_checkpoint_crcs: bool = True  # check each record's CRC-32 before a checkpoint file is loaded
    hardware: str = "auto"              # policy milp: catalog name or a `lazytrain bench tiers --json` file
    nvme_path: str | None = None
    seq_len: int | None = None          # for the planner; policy auto: the longest batch seen when absent
    loss_chunk_tokens: int = 0          # >0: a causal LM's head and loss in chunks of this many tokens (no full logits)
    non_block_state: str = "auto"       # auto (host) | host | device: the embedding's and head's fp32 masters and moments
    lean_norms: bool = True             # the blocks' RMSNorms keep only their inputs for backward (engine/lean_norms.py)
    # policy milp: the blocks below the first that trains, with nothing run before them training (the backward stops
    # above them); None ("auto"): counted from the parameters (engine._frozen_bottom_blocks). Policy auto measures it
    frozen_bottom_layers: int | None = None
    testing: TestingConfig = field(default_factory=TestingConfig)

    def head_tokens(self, micro_batch_tokens: int) -> int:
        """The tokens whose logits the LM head computes at once in a micro-batch of ``micro_batch_tokens``
        (in chunks when 'loss_chunk_tokens' is set, else all of them): what a plan must count."""
        return min(self.loss_chunk_tokens or micro_batch_tokens, micro_batch_tokens)


_LAZYTRAIN_KEYS = {"blocks", "policy", "checkpoint_interval", "boundary_home", "plan", "device", "prefetch",
                   "weights_home", "tiers", "gpu_memory", "host_memory", "nvme_memory", "optimizer_states",
                   "hybrid_threshold", "quant_block_size", "fp32_state_patterns", "milp_time_limit",
                   "nvme_path", "seq_len", "capacities", "hardware", "last_segment_graph",
                   "overlap_optimizer", "testing", "collective_timeout_s", "trust_checkpoints", "check_checkpoint_crcs",
                   "loss_chunk_tokens", "auto", "non_block_state", "lean_norms", "gradient_reduce",
                   "grad_norm_as_landed", "frozen_bottom_layers"}


@dataclass(frozen=True)
class EngineConfig:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int = 1
    gradient_clipping: float = GRADIENT_CLIPPING_DEFAULT   # 0 turns it off
    steps_per_print: float | None = None   # None: no progress lines (DeepSpeed's default)
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False   # the loader built from training_data keeps a last, smaller batch
    # false: every step() is the accumulation boundary (the script owns it), as DeepSpeed's unmanaged mode
    managed_gradient_accumulation: bool = True
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: bool = False
    zero_stage: int = 0
    communication_data_type: str | None = None   # the dtype gradients are summed over ranks in; None: the model's
    gather_16bit_weights_on_model_save: bool = False
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    lazytrain: LazyTrainSection = field(default_factory=LazyTrainSection)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def interval_for(self, num_layers: int) -> int:
        """Checkpoint interval k: explicit, else from activation_checkpointing.number_checkpoints, else 4."""
        lt = self.lazytrain
        if lt.checkpoint_interval is not None:
            return lt.checkpoint_interval
        if lt.number_checkpoints is not None:
            return max(1, math.ceil(num_layers / lt.number_checkpoints))
        return 4

    @property
    def compute_dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else ("float16" if self.fp16.enabled else "float32")

    @property
    def communication_dtype_name(self) -> str:
        """The dtype data-parallel gradients are summed over ranks in: 'communication_data_type' when set, else
        the model's dtype, as DeepSpeed 0.19 defaults it (bf16/fp16 training sends half the bytes of fp32)."""
        if self.communication_data_type is not None:
            return self.communication_data_type
        return "bf16" if self.bf16 else ("fp16" if self.fp16.enabled else "fp32")


# --------------------------------------------------------------------------------------------
def load_config_source(config: Any) -> dict:
    """dict | path to JSON | base64-encoded JSON | JSON text -> dict (a copy)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config, default=_json_default))
    if isinstance(config, (str, os.PathLike)):
        text = str(config)
        if os.path.exists(text):
            if os.path.isdir(text):
                raise ConfigError(f"config {text!r} is a directory, not a JSON file")
            try:
                with open(text, encoding="utf-8") as f:
                    source = f.read()
            except UnicodeDecodeError as e:
                raise ConfigError(f"config file {text} is not UTF-8 text: {e}") from None
            try:
                return json.loads(source, object_pairs_hook=_refuse_duplicate_keys)
            except json.JSONDecodeError as e:
                return _hjson(source, f"config file {text}", e)
        if text.lstrip().startswith("{"):
            try:
                return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config text is not valid JSON: {e}") from e
        try:   # DeepSpeed's launcher and autotuner write it URL-safe ("-" and "_" for "+" and "/"); the base64
            packed = "".join(text.split())   # command breaks its lines
            alphabet = b"-_" if any(c in packed for c in "-_") else None
            decoded = base64.b64decode(packed, altchars=alphabet, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            decoded = None
        if decoded is not None:
            try:
                return json.loads(decoded, object_pairs_hook=_refuse_duplicate_keys)
            except json.JSONDecodeError as e:
                try:
                    return _hjson(decoded, "base64 config", e)
                except _DuplicateKeys:
                    raise
                except ConfigError:   # not a config after all: said below as one
                    pass
        raise ConfigError(f"config {text!r} is neither an existing JSON file, JSON text, nor base64-encoded "
                          f"JSON") from None
    raise ConfigError(f"config must be a dict, a path to a JSON file or a base64 JSON string, "
                      f"got {type(config).__name__}")


def _hjson(source: str, what: str, error: json.JSONDecodeError) -> dict:
    """DeepSpeed reads config files and base64 configs with hjson (comments, trailing commas, unquoted keys):
    so does LazyTrain where hjson is installed (DeepSpeed installs it)."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"{what} is not valid JSON: {error} (DeepSpeed reads configs with hjson, which takes "
                          f"comments and trailing commas: pip install hjson to read it so)") from None
    try:
        parsed = hjson.loads(source, object_pairs_hook=_refuse_duplicate_keys)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON ({error}) nor hjson ({e})") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{what} is not valid JSON: {error}")
    return parsed


class _DuplicateKeys(ConfigError):
    """A config object that names a key twice (told apart from text that is no config at all)."""


def _refuse_duplicate_keys(pairs: list) -> dict:
    """A JSON object that names a key twice is refused, as DeepSpeed refuses it: json keeps the last one, so a
    pasted second section would change the run silently."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise _DuplicateKeys(f"config names {', '.join(map(repr, twice))} twice in one object; keep one")
    return dict(pairs)


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return o
    if isinstance(o, os.PathLike):   # nvme_path=pathlib.Path(...), as DeepSpeed takes it
        return os.fspath(o)
    if type(o).__module__ == "numpy" and getattr(o, "ndim", None) == 0:   # np.int64(8), np.float32(1e-3)
        return o.item()   # as DeepSpeed, which reads the dict as it is, takes them
    raise ConfigError(f"config value {o!r} is not JSON-serializable")


def resolve_batch_sizes(tb: int | None, mb: int | None, gas: int | None, world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rules: any one or two of the triple may be omitted and are derived."""
    if mb is not None and mb <= 0:   # before they divide the batch
        raise BatchConfigError(f"Micro batch size per gpu: {mb} has to be greater than 0")
    if gas is not None and gas <= 0:
        raise BatchConfigError(f"Gradient accumulation steps: {gas} has to be greater than 0")
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world_size
    elif tb is not None and gas is not None:
        mb = tb // world_size // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * world_size
    elif tb is not None:
        gas, mb = 1, tb // world_size
    elif mb is not None:
        tb, gas = mb * world_size, 1
    else:
        raise BatchConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    if tb <= 0:
        raise BatchConfigError(f"Train batch size: {tb} has to be greater than 0")
    if mb <= 0:
        raise BatchConfigError(f"Micro batch size per gpu: {mb} has to be greater than 0")
    if gas <= 0:
        raise BatchConfigError(f"Gradient accumulation steps: {gas} has to be greater than 0")
    if tb != mb * gas * world_size:
        raise BatchConfigError("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
                               f"* gradient_acc_step * world_size {tb} != {mb} * {gas} * {world_size}")
    return tb, mb, gas


def parse_config(config: Any, world_size: int | None = None) -> EngineConfig:
    """Validate a DeepSpeed-style config (plus the "lazytrain" section) into an :class:`EngineConfig`."""
    d = load_config_source(config)
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    _drop_ignored_auto(d)
    _check_no_auto({k: v for k, v in d.items() if k not in ("lazytrain", "job")}, "")
    seen = _Ignored()
    for key in d:
        if key in _TOP_IMPLEMENTED:
            continue
        if key == "tensor_parallel":
            _check_tensor_parallel(d[key])
            continue
        if key in _UNIMPLEMENTED_TOP:
            if not _is_off(d[key]):
                seen.note(key, f"'{key}' is a DeepSpeed feature LazyTrain does not implement; it is ignored "
                               f"({_UNIMPLEMENTED_TOP[key]}).")
            continue
        seen.unknown.append(key)
    if world_size is None:
        world_size = launcher_int("WORLD_SIZE", 1)
    tb, mb, gas = resolve_batch_sizes(_positive_int(d.get("train_batch_size"), "train_batch_size"),
                                      _positive_int(d.get("train_micro_batch_size_per_gpu"),
                                                    "train_micro_batch_size_per_gpu"),
                                      _positive_int(d.get("gradient_accumulation_steps"),
                                                    "gradient_accumulation_steps"),
                                      world_size)

    clip = d.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:   # NaN: clipping off, unsaid
        raise ConfigError(f"config key 'gradient_clipping' must be a number >= 0 (0 = off), got {clip!r}")
    spp = d.get("steps_per_print")   # unset: no progress lines, as DeepSpeed's default (None)
    if spp is not None and (isinstance(spp, bool) or not isinstance(spp, (int, float)) or not spp > 0):
        raise ConfigError(f"config key 'steps_per_print' must be a positive number (float('inf') allowed) or null, "
                          f"got {spp!r}")

    drop_last = _flag(d, "dataloader_drop_last", False, "")
    opt_section = d.get("optimizer")
    if isinstance(opt_section, dict) and "legacy_fusion" in opt_section:
        seen.note("optimizer.legacy_fusion", "'optimizer.legacy_fusion' selects DeepSpeed's old fused fp16 "
                                             "optimizer; LazyTrain ignores it.")
        opt_section = {k: v for k, v in opt_section.items() if k != "legacy_fusion"}
    optimizer = _parse_optimizer(opt_section)
    scheduler = _parse_scheduler(d.get("scheduler"))
    fp16 = _parse_fp16(_section(d.get("fp16")))
    bf16_section = _section(d["bf16"] if d.get("bf16") is not None else d.get("bfloat16"))
    _check_keys(bf16_section, _BF16_KEYS, "bf16")
    bf16 = _flag(bf16_section, "enabled", False, "bf16")
    for key, what in (("bf16_master_weights_and_grads", "master weights and gradients"),
                      ("bf16_optimizer_states", "optimizer states")):
        if bf16 and _flag(bf16_section, key, False, "bf16"):
            raise ConfigError(f"config key 'bf16.{key}' keeps the {what} in bf16, which LazyTrain does not do: its "
                              f"host optimizer keeps fp32 masters and gradients. Remove the key; to shrink the host "
                              f"state use \"lazytrain\": {{\"optimizer_states\": \"8bit\"}} (2 bytes of Adam state per "
                              f"parameter instead of 8)")
    if bf16 and fp16.enabled:
        raise ConfigError("config enables both 'fp16' and 'bf16'; enable one")

    zero = _section(d.get("zero_optimization"))
    if isinstance(zero, bool):   # DeepSpeed's deprecated form: true is stage 1, false stage 0
        warnings.warn(f"lazytrain: config 'zero_optimization': {str(zero).lower()} is DeepSpeed's deprecated form; "
                      f"read as {{\"stage\": {int(zero)}}}, as DeepSpeed reads it", UserWarning, stacklevel=3)
        zero = {"stage": int(zero)}
    _check_keys(zero, {"stage", "offload_param", "offload_optimizer", *_GATHER_ON_SAVE_KEYS} | _ZERO_UNIMPLEMENTED,
                "zero_optimization")
    gather_on_save = any([_flag(zero, key, False, "zero_optimization") for key in _GATHER_ON_SAVE_KEYS])
    for key in zero:
        if key in _ZERO_UNIMPLEMENTED and not _is_off(zero[key]):
            seen.note(f"zero.{key}", f"'zero_optimization.{key}' tunes DeepSpeed's ZeRO partitioning and has "
                                     f"no effect in LazyTrain (buffer sizes are derived from the model).")
    stage = zero.get("stage", 0)
    if isinstance(stage, str) and stage.strip() in ("0", "1", "2", "3"):   # "3", as DeepSpeed's model reads it
        stage = int(stage)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'zero_optimization.stage' must be 0, 1, 2 or 3, got {stage!r}")
    stage = int(stage)
    offload_param = _parse_offload(_section(zero.get("offload_param")), _OFFLOAD_PARAM_KEYS,
                                   "zero_optimization.offload_param", seen)
    offload_optimizer = _parse_offload(_section(zero.get("offload_optimizer")), _OFFLOAD_OPT_KEYS,
                                       "zero_optimization.offload_optimizer", seen)
    if offload_optimizer.device == "none" and zero.get("offload_optimizer") is not None:
        seen.note("offopt-none", "'zero_optimization.offload_optimizer.device' is \"none\", but LazyTrain "
                                 "always runs the optimizer on the host (that is how it trains models "
                                 "larger than GPU memory).")
    if offload_optimizer.device == "nvme":
        seen.note("offopt-nvme", "'zero_optimization.offload_optimizer.device' is \"nvme\": LazyTrain keeps "
                                 "optimizer states in host memory (8-bit states keep them small); set "
                                 "\"lazytrain\": {\"optimizer_states\": \"8bit\"} to shrink them.")

    aio = _parse_aio(_section(d.get("aio")))
    lt = _parse_lazytrain(_section(d.get("lazytrain")), _section(d.get("activation_checkpointing")), offload_param, seen)
    lt = _states_of_an_8bit_type(optimizer, lt, _section(d.get("lazytrain")).get("optimizer_states"))

    if lt.gradient_reduce == "device" and stage < 2:
        raise ConfigError(f"config key 'lazytrain.gradient_reduce' is \"device\", which reduces each micro-batch's "
                          f"layer gradients to their owners as they are made: that needs 'zero_optimization.stage' "
                          f">= 2 (it is {stage}; below 2 gradients are reduced once a step, from the host)")
    if _flag(d, "wall_clock_breakdown", False, ""):
        seen.note("wall_clock_breakdown", "'wall_clock_breakdown' prints DeepSpeed's per-phase timers, which "
                  "LazyTrain does not keep: trace a step instead (engine.trace_next_step(\"step.json\"), or "
                  "lazytrain train --trace), which times every layer's compute and transfer.")
    seen.emit()
    managed = _flag(d, "managed_gradient_accumulation", True, "")
    if not managed and lt.policy == "auto":
        raise ConfigError("config 'lazytrain.policy' \"auto\" measures steps of 'gradient_accumulation_steps' "
                          "micro-batches and plans for them, but with 'managed_gradient_accumulation' false the "
                          "script decides how many a step takes: choose another policy (\"milp\" plans at start-up)")
    comm = d.get("communication_data_type")
    comm = comm.lower() if isinstance(comm, str) else comm   # DeepSpeed lowers it
    if comm not in (None, "fp16", "bf16", "fp32"):   # DeepSpeed's values and message
        raise ConfigError(f"Invalid communication_data_type. Supported data types: ['fp16', 'bf16', 'fp32']. "
                          f"Got: {comm}")
    return EngineConfig(
        communication_data_type=comm, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
        world_size=world_size, gradient_clipping=float(clip), steps_per_print=spp,
        wall_clock_breakdown=_flag(d, "wall_clock_breakdown", False, ""), dataloader_drop_last=drop_last,
        managed_gradient_accumulation=managed,
        optimizer=optimizer, scheduler=scheduler, fp16=fp16, bf16=bf16, zero_stage=stage,
        gather_16bit_weights_on_model_save=gather_on_save, offload_param=offload_param,
        offload_optimizer=offload_optimizer, aio=aio, lazytrain=lt, raw=d)


def _differ_as_sizes(a, b) -> bool:
    """Whether two budgets that both read as sizes are different sizes ("5GB" and 5e9 agree); one that does
    not read is left to the error that names its key."""
    try:
        return parse_bytes(a, "size") != parse_bytes(b, "size")
    except (TypeError, ValueError):
        return False


def _states_of_an_8bit_type(optimizer: OptimizerConfig, lt: LazyTrainSection, given) -> LazyTrainSection:
    """The types ``HybridAdamW`` and ``AdamW8bit`` keep 8-bit moments unless ``lazytrain.optimizer_states``
    says otherwise: ``HybridAdamW`` with "fp32" keeps fp32 ones (it was read as "8bit" without a word);
    ``AdamW8bit`` with "fp32" contradicts its name and is refused."""
    kind = (optimizer.type or "").lower()
    if kind not in ("hybridadamw", "adamw8bit"):
        return lt
    if given is None:
        return dataclasses.replace(lt, optimizer_states="8bit")
    if given == "fp32" and kind == "adamw8bit":
        raise ConfigError(f"config 'optimizer.type' {optimizer.type!r} keeps 8-bit Adam moments, and "
                          f"'lazytrain.optimizer_states' is \"fp32\": for fp32 moments name the type \"AdamW\" "
                          f"(or \"HybridAdamW\"), or remove the key")
    return lt


def _patterns(section: dict) -> tuple[str, ...] | None:
    """``lazytrain.fp32_state_patterns``: a list of regular expressions (a lone string would be taken letter
    by letter, each letter a pattern that matches nearly every parameter name)."""
    patterns = section.get("fp32_state_patterns")
    if patterns is None:
        return None
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(x, str) for x in patterns):
        raise ConfigError(f"config key 'lazytrain.fp32_state_patterns' must be a list of regular expressions such "
                          f"as [\"norm\", \"bias\"], got {patterns!r}")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"config key 'lazytrain.fp32_state_patterns' holds {pattern!r}, which is not a regular "
                              f"expression: {e}") from None
    return tuple(patterns)


def _seq_len(section: dict) -> int | None:
    value = section.get("seq_len")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"config key 'lazytrain.seq_len' must be a whole number of tokens >= 1 (or absent: policy "
                          f"\"auto\" takes the longest batch it sees), got {value!r}")
    return value


def _loss_chunk_tokens(section: dict) -> int:
    value = section.get("loss_chunk_tokens", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config key 'lazytrain.loss_chunk_tokens' must be a whole number of tokens >= 0 "
                          f"(0: the model computes its logits whole), got {value!r}")
    return value


def _frozen_bottom_layers(section: dict) -> int | None:
    value = section.get("frozen_bottom_layers", "auto")
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config key 'lazytrain.frozen_bottom_layers' must be \"auto\" or a whole number of blocks "
                          f">= 0 (the blocks below the first that trains, with nothing run before them training), "
                          f"got {value!r}")
    return value


def _check_tensor_parallel(section) -> None:
    """DeepSpeed's AutoTP section: accepted when it asks for no tensor parallelism (size 1 or absent)."""
    size = section.get("autotp_size", section.get("tp_size", 1)) if isinstance(section, dict) else section
    if isinstance(section, dict) and "tp" in section and isinstance(section["tp"], dict):
        size = section["tp"].get("tp_size", size)
    if size not in (None, 0, 1):
        raise ConfigError(f"config key 'tensor_parallel' asks for tensor parallelism of size {size!r}, which LazyTrain "
                          f"does not implement (each rank streams the whole model); remove the section or set its "
                          f"size to 1")


def _parse_optimizer(section) -> OptimizerConfig:
    if section is None or section == {}:   # an empty section: none, as DeepSpeed reads it
        return OptimizerConfig()
    _check_keys(section, {"type", "params"}, "optimizer")
    params = _section(section.get("params"))
    if not isinstance(params, dict):
        raise ConfigError("config key 'optimizer.params' must be an object")
    params = dict(params)
    if "max_grad_norm" in params:
        raise ConfigError("'max_grad_norm' is not supported as an optimizer parameter in config 'optimizer.params'; "
                          "please use the top-level 'gradient_clipping' key instead")
    typ = section.get("type")
    if not isinstance(typ, str):
        raise ConfigError(f"config key 'optimizer.type' must be a string such as \"AdamW\" (or leave the section "
                          f"out), got {typ!r}")
    return OptimizerConfig(type=typ, params=params)


def _parse_scheduler(section) -> SchedulerConfig:
    if section is None or section == {}:
        return SchedulerConfig()
    _check_keys(section, {"type", "params"}, "scheduler")
    typ = section.get("type")
    if not isinstance(typ, str):
        raise ConfigError(f"config key 'scheduler.type' must be a string such as \"WarmupLR\" (or leave the section "
                          f"out), got {typ!r}")
    params = _section(section.get("params"))
    if not isinstance(params, dict):
        raise ConfigError("config key 'scheduler.params' must be an object")
    return SchedulerConfig(type=typ, params=dict(params))


def _parse_fp16(section) -> FP16Config:
    _check_keys(section, _FP16_KEYS, "fp16")
    enabled = _flag(section, "enabled", False, "fp16")
    if enabled and _flag(section, "fp16_master_weights_and_grads", False, "fp16"):
        raise ConfigError("config key 'fp16.fp16_master_weights_and_grads' keeps the master weights and gradients in "
                          "fp16, which LazyTrain does not do: its host optimizer keeps fp32 masters and gradients. "
                          "Remove the key")
    loss_scale = float(_number(section, "loss_scale", 0.0, "fp16", minimum=0, text=True, finite=True))
    # the dynamic scaler's settings are checked for their range only where it runs (fp16 on, loss_scale 0), as
    # DeepSpeed does: a static or disabled fp16 section may carry values it never uses
    dynamic = enabled and loss_scale == 0
    return FP16Config(
        enabled=enabled, loss_scale=loss_scale,
        initial_scale_power=_fp16_scale_power(section, dynamic),
        loss_scale_window=_number(section, "loss_scale_window", 1000, "fp16", integer=True,
                                  minimum=1 if dynamic else None, text=True),
        hysteresis=_number(section, "hysteresis", 2, "fp16", integer=True, minimum=1 if dynamic else None, text=True),
        consecutive_hysteresis=_flag(section, "consecutive_hysteresis", False, "fp16"),
        min_loss_scale=float(_number(section, "min_loss_scale", 1.0, "fp16", above=0 if dynamic else None, text=True,
                                     finite=True)),
        auto_cast=_flag(section, "auto_cast", False, "fp16"))


def _fp16_scale_power(section, dynamic: bool) -> int:
    """The dynamic loss scale starts at 2**power, which must be a float (2**1024 is not)."""
    power = _number(section, "initial_scale_power", 16, "fp16", integer=True, minimum=0 if dynamic else None,
                    text=True)
    if dynamic and power > 1023:
        raise ConfigError(f"config key 'fp16.initial_scale_power' must be at most 1023 (the loss scale is 2**power, "
                          f"a float), got {power!r}")
    return power


def _check_nvme_path(section: dict, where: str) -> None:
    path = section.get("nvme_path")
    if path is not None and not isinstance(path, str):   # a number would fail at the NVMe tier's first open
        raise ConfigError(f"config key '{where}.nvme_path' must be a directory path, got {path!r}")


def _parse_offload(section, allowed: set, name: str, seen: _Ignored) -> OffloadConfig:
    _check_keys(section, allowed, name)
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"config key '{name}.device' must be \"none\", \"cpu\" or \"nvme\", got {device!r}")
    _check_nvme_path(section, name)
    if device == "nvme" and not section.get("nvme_path"):
        raise ConfigError(f"config key '{name}.nvme_path' is required when '{name}.device' is \"nvme\"")
    for key in sorted(_OFFLOAD_IGNORED):
        if key in section:
            seen.note(f"{name}.{key}", f"'{name}.{key}' is ignored: LazyTrain derives buffer sizes and "
                                       f"counts from the model and the plan.")
    if section.get("pin_memory", True) is False:   # true is what LazyTrain does anyway
        seen.note(f"{name}.pin_memory", f"'{name}.pin_memory': false is not honoured: on a GPU LazyTrain keeps "
                                        f"its host copies in pinned memory, from which copies overlap compute.")
    return OffloadConfig(device=device, nvme_path=section.get("nvme_path"))


def _parse_aio(section) -> AioConfig:
    from .tiers.nvme_io import AioSettings
    if not isinstance(section, dict):
        raise ConfigError(f"config key 'aio' must be an object, got {section!r}")
    _check_keys(section, _AIO_KEYS, "aio")
    try:
        settings = AioSettings.from_config(section)
    except ValueError as e:
        raise ConfigError(f"config key {e}") from e
    return AioConfig(block_size=settings.block_size, queue_depth=settings.queue_depth,
                     intra_op_parallelism=settings.intra_op_parallelism,
                     single_submit=section.get("single_submit", False),
                     overlap_events=section.get("overlap_events", True), use_gds=settings.use_gds)


def _parse_testing(section) -> TestingConfig:
    if not isinstance(section, dict):
        raise ConfigError(f"config key 'lazytrain.testing' must be an object, got {section!r}")
    _check_keys(section, _TESTING_KEYS, "lazytrain.testing")
    copy_threads = section.get("copy_threads", False)
    if not isinstance(copy_threads, bool):
        raise ConfigError(f"config key 'lazytrain.testing.copy_threads' must be true or false, got {copy_threads!r}")
    seed = section.get("chaos_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"config key 'lazytrain.testing.chaos_seed' must be an integer, got {seed!r}")
    delay = section.get("chaos_max_delay_ms", 2.0)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 1000:
        raise ConfigError(f"config key 'lazytrain.testing.chaos_max_delay_ms' must be a number of milliseconds "
                          f"in [0, 1000], got {delay!r}")
    if "chaos_max_delay_ms" in section and seed is None:
        raise ConfigError("config key 'lazytrain.testing.chaos_max_delay_ms' needs "
                          "'lazytrain.testing.chaos_seed' (a test setting: the seed turns the random delays on)")
    links = _parse_links(section.get("links", {}))
    if links and not copy_threads:
        raise ConfigError("config key 'lazytrain.testing.links' needs 'lazytrain.testing.copy_threads': true (the "
                          "emulated links slow down the copies that run on the copy threads)")
    cfg = TestingConfig(copy_threads=copy_threads, chaos_seed=seed, chaos_max_delay_ms=float(delay), links=links)
    if cfg.active:
        warnings.warn("lazytrain: 'lazytrain.testing' is a setting for tests and benchmarks (copy threads, "
                      "random transfer delays and emulated links exercise the engine's ordering and timing on "
                      "the CPU); it only slows a training run down: remove it from a real config",
                      UserWarning, stacklevel=4)
    return cfg


def _parse_auto(section) -> AutoPlanConfig:
    where = "lazytrain.auto"
    if not isinstance(section, dict):
        raise ConfigError(f"config key '{where}' must be an object, got {section!r}")
    _check_keys(section, _AUTO_KEYS, where)
    kw: dict[str, Any] = {}
    for key, least in (("warmup_steps", 0), ("profile_steps", 1), ("check_every", 1), ("max_replans", 0)):
        if key in section:
            v = section[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"config key '{where}.{key}' must be an integer >= {least}, got {v!r}")
            kw[key] = v
    if "drift_margin" in section:
        v = section["drift_margin"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ConfigError(f"config key '{where}.drift_margin' must be a fraction > 0 (0.15: 15%), got {v!r}")
        kw["drift_margin"] = float(v)
    if "selective" in section:
        if not isinstance(section["selective"], bool):
            raise ConfigError(f"config key '{where}.selective' must be true or false, got {section['selective']!r}")
        kw["selective"] = section["selective"]
    for key in ("profile_path", "profile"):
        if section.get(key) is not None:
            if not isinstance(section[key], str) or not section[key]:
                raise ConfigError(f"config key '{where}.{key}' must be a file path, got {section[key]!r}")
            kw[key] = section[key]
    if "profile" in kw and not os.path.isfile(kw["profile"]):
        raise ConfigError(f"config key '{where}.profile': no file {kw['profile']!r} (a profile that policy \"auto\" "
                          f"wrote with '{where}.profile_path')")
    return AutoPlanConfig(**kw)


def _parse_links(section) -> dict:
    """``{"h2d": {"gbps": 0.2, "latency_ms": 0.05}, ...}`` -> {link: (gbps, latency_ms)}."""
    where = "lazytrain.testing.links"
    if not isinstance(section, dict):
        raise ConfigError(f"config key '{where}' must be an object of link name -> "
                          f"{{\"gbps\": ..., \"latency_ms\": ...}}, got {section!r}")
    from .tiers.streams import LINKS
    _check_keys(section, set(LINKS), where)
    links = {}
    for name, spec in section.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"config key '{where}.{name}' must be an object with 'gbps' and optionally "
                              f"'latency_ms', got {spec!r}")
        _check_keys(spec, {"gbps", "latency_ms"}, f"{where}.{name}")
        gbps, latency = spec.get("gbps"), spec.get("latency_ms", 0.0)
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < float("inf"):
            raise ConfigError(f"config key '{where}.{name}.gbps' must be a bandwidth in GB/s > 0, got {gbps!r}")
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency <= 1000:
            raise ConfigError(f"config key '{where}.{name}.latency_ms' must be a number of milliseconds in "
                              f"[0, 1000], got {latency!r}")
        links[name] = (float(gbps), float(latency))
    return links


def _parse_lazytrain(section, ac: dict, offload_param: OffloadConfig, seen: _Ignored) -> LazyTrainSection:
    _check_keys(section, _LAZYTRAIN_KEYS, "lazytrain")
    _check_keys(ac, _AC_KEYS, "activation_checkpointing")
    kw: dict[str, Any] = {}
    # activation_checkpointing is honoured: it maps onto the checkpoint plan (DeepSpeed ignores it
    # unless the model calls deepspeed.checkpointing).
    n_ckpt = ac.get("number_checkpoints")
    if isinstance(n_ckpt, float) and n_ckpt.is_integer():   # 2.0, as DeepSpeed reads it
        n_ckpt = int(n_ckpt)
    if n_ckpt is not None:
        if isinstance(n_ckpt, bool) or not isinstance(n_ckpt, int) or n_ckpt < 1:
            raise ConfigError(f"config key 'activation_checkpointing.number_checkpoints' must be an integer >= 1, "
                              f"got {n_ckpt!r}")
        kw["number_checkpoints"] = n_ckpt
    if _flag(ac, "cpu_checkpointing", False, "activation_checkpointing"):
        kw["boundary_home"] = "host"
    for key in ("partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                "profile"):
        if ac.get(key):
            seen.note(f"ac.{key}", f"'activation_checkpointing.{key}' has no effect in LazyTrain: kept "
                                   f"boundaries are placed by the plan (boundary_home / policy).")

    if "blocks" in section and section["blocks"] is not None and not isinstance(section["blocks"], str):
        raise ConfigError(f"config key 'lazytrain.blocks' must be a dotted path like \"transformer.h\", "
                          f"got {section['blocks']!r}")
    policy = section.get("policy", "every_k")
    if policy not in POLICIES:
        raise ConfigError(f"config key 'lazytrain.policy' must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "plan" and not section.get("plan"):
        raise ConfigError("config key 'lazytrain.plan' (path to a Plan JSON) is required when 'lazytrain.policy' "
                          "is \"plan\"")
    if section.get("plan") is not None and not isinstance(section["plan"], str):
        raise ConfigError(f"config key 'lazytrain.plan' must be the path of a Plan JSON written by `lazytrain plan "
                          f"--json` (or its text), got {section['plan']!r}")
    hardware = section.get("hardware", "auto")
    if not isinstance(hardware, str) or not hardware:
        raise ConfigError(f"config key 'lazytrain.hardware' must be \"auto\", a catalog name (h800, h200, rtx3090) or "
                          f"the path of a JSON written by `lazytrain bench tiers --json`, got {hardware!r}")
    if policy != "plan" and section.get("plan") is not None:   # else the plan would be left unread, unsaid
        raise ConfigError(f"config key 'lazytrain.plan' is read only with 'lazytrain.policy': \"plan\" (the policy "
                          f"here is {policy!r}): set the policy to \"plan\" to run it, or remove the key")
    interval = section.get("checkpoint_interval", 4)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"config key 'lazytrain.checkpoint_interval' must be an integer >= 1, got {interval!r}")
    states = section.get("optimizer_states", "fp32")
    if states not in ("fp32", "8bit"):
        raise ConfigError(f"config key 'lazytrain.optimizer_states' must be \"fp32\" or \"8bit\", got {states!r}")
    tiers = section.get("tiers", [])
    if not isinstance(tiers, list) or not all(isinstance(t, dict) and "name" in t for t in tiers):
        raise ConfigError("config key 'lazytrain.tiers' must be a list of objects, each with a 'name' "
                          "(and 'class', 'capacity', ...)")
    capacities = section.get("capacities", {})
    if not isinstance(capacities, dict):
        raise ConfigError(f"config key 'lazytrain.capacities' must be an object of tier names and sizes, got "
                          f"{capacities!r}")
    capacities = dict(capacities)
    given_by = {tier: f"config key 'lazytrain.capacities.{tier}'" for tier in capacities}   # what errors name
    for key, tier in (("gpu_memory", "hbm"), ("host_memory", "host"), ("nvme_memory", "nvme")):
        if section.get(key) is not None:   # null: not given (unbounded unless capacities says otherwise)
            if tier in capacities and _differ_as_sizes(capacities[tier], section[key]):   # one was dropped
                raise ConfigError(f"config keys 'lazytrain.{key}' and 'lazytrain.capacities.{tier}' both give tier "
                                  f"{tier!r} a budget ({section[key]!r} and {capacities[tier]!r}): give the budget "
                                  f"in one place")
            capacities[tier], given_by[tier] = section[key], f"config key 'lazytrain.{key}'"
    try:
        capacities = {k: parse_bytes(v, given_by[k]) for k, v in capacities.items()}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for tier in ("hbm", "host"):   # the device and the host always hold something (a layer, the fp32 weights)
        if capacities.get(tier) == 0:
            holds = "device holds the layer being computed" if tier == "hbm" else "host holds the weights and the " \
                                                                                  "optimizer state"
            raise ConfigError(f"{given_by[tier]} must be above 0 (the {holds}); leave it out for no limit")
    weights_home = section.get("weights_home")
    if weights_home is None:   # no offload section (device "none") still streams from the host
        weights_home = "nvme" if offload_param.device == "nvme" else "host"
    if weights_home not in ("host", "nvme", "hbm"):
        raise ConfigError(f"config key 'lazytrain.weights_home' must be \"host\", \"nvme\" or \"hbm\", "
                          f"got {weights_home!r}")
    last_graph = section.get("last_segment_graph", "auto")
    if not (last_graph == "auto" or isinstance(last_graph, bool)):   # 0 and 1 too are refused: read with `is`
        raise ConfigError(f"config key 'lazytrain.last_segment_graph' must be \"auto\", true or false, "
                          f"got {last_graph!r}")
    overlap = section.get("overlap_optimizer", "auto")
    if not (overlap == "auto" or isinstance(overlap, bool)):
        raise ConfigError(f"config key 'lazytrain.overlap_optimizer' must be \"auto\", true or false, got {overlap!r}")
    non_block = section.get("non_block_state", "auto")
    if non_block not in ("auto", "host", "device"):
        raise ConfigError(f"config key 'lazytrain.non_block_state' must be \"auto\", \"host\" or \"device\", "
                          f"got {non_block!r}")
    _check_nvme_path(section, "lazytrain")
    # DeepSpeed reads offload_param's path only where its device is "nvme" (its template spells both, and
    # users keep the path while offloading to the CPU): so does LazyTrain
    nvme_path = section.get("nvme_path") or (offload_param.nvme_path if offload_param.device == "nvme" else None)
    if weights_home == "nvme" and not nvme_path and not any(t.get("name") == "nvme" for t in tiers):
        raise ConfigError("config key 'lazytrain.nvme_path' is required when 'lazytrain.weights_home' is \"nvme\" "
                          "(the directory the streamed weights' files go to; DeepSpeed's "
                          "'zero_optimization.offload_param.nvme_path' serves as well where its device is \"nvme\")")
    timeout = section.get("collective_timeout_s", 1800.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_COLLECTIVE_TIMEOUT_S:
        raise ConfigError(f"config key 'lazytrain.collective_timeout_s' must be a number of seconds > 0 and at most "
                          f"{MAX_COLLECTIVE_TIMEOUT_S:g} (about 31 years; torch's process groups take no longer), "
                          f"got {timeout!r}")
    reduce_at = section.get("gradient_reduce", "auto")
    if reduce_at not in ("auto", "device", "host"):
        raise ConfigError(f"config key 'lazytrain.gradient_reduce' must be \"auto\", \"device\" or \"host\", "
                          f"got {reduce_at!r}")
    as_landed = section.get("grad_norm_as_landed", True)
    if not isinstance(as_landed, bool):
        raise ConfigError(f"config key 'lazytrain.grad_norm_as_landed' must be true or false, got {as_landed!r}")
    lean = section.get("lean_norms", True)
    if not isinstance(lean, bool):
        raise ConfigError(f"config key 'lazytrain.lean_norms' must be true or false, got {lean!r}")
    trust = section.get("trust_checkpoints", False)
    if not isinstance(trust, bool):
        raise ConfigError(f"config key 'lazytrain.trust_checkpoints' must be true or false, got {trust!r}")
    check_crcs = section.get("check_checkpoint_crcs", True)
    if not isinstance(check_crcs, bool):
        raise ConfigError(f"config key 'lazytrain.check_checkpoint_crcs' must be true or false, got {check_crcs!r}")
    testing = _parse_testing(section.get("testing", {}))
    if "auto" in section and policy != "auto":
        raise ConfigError(f"config key 'lazytrain.auto' sets up policy \"auto\", but 'lazytrain.policy' is {policy!r}")
    frozen_bottom = _frozen_bottom_layers(section)
    if frozen_bottom is not None and policy != "milp":
        raise ConfigError(f"config key 'lazytrain.frozen_bottom_layers' is for policy \"milp\", which plans at start-up; "
                          f"policy \"auto\" measures where the backward stops, and a Plan file is made for it with "
                          f"`lazytrain plan --frozen-bottom-layers` (policy is {policy!r})")
    if policy == "auto" and section.get("overlap_optimizer") is False:
        raise ConfigError("config 'lazytrain.policy' \"auto\" measures each layer's host update, which runs layer "
                          "by layer with 'lazytrain.overlap_optimizer' on: leave it \"auto\" or set it true")
    return LazyTrainSection(trust_checkpoints=trust, check_checkpoint_crcs=check_crcs, testing=testing, auto=_parse_auto(section.get("auto", {})),
        blocks=section.get("blocks"), policy=policy,
        checkpoint_interval=interval if "checkpoint_interval" in section else None,
        number_checkpoints=kw.get("number_checkpoints"),
        boundary_home=section.get("boundary_home", kw.get("boundary_home", "hbm")),
        plan_path=section.get("plan"), device=str(section.get("device", "auto")),
        prefetch=_flag(section, "prefetch", True, "lazytrain"), weights_home=weights_home, last_segment_graph=last_graph,
        overlap_optimizer=overlap,
        tiers=tuple(tiers), capacities=capacities, capacity_keys=given_by, optimizer_states=states,
        hybrid_threshold=_number(section, "hybrid_threshold", 4096, "lazytrain", integer=True, minimum=0),
        quant_block_size=_quant_block_size(section),
        fp32_state_patterns=_patterns(section),
        milp_time_limit=_milp_time_limit(section), nvme_path=nvme_path,
        seq_len=_seq_len(section), hardware=hardware,
        collective_timeout_s=float(timeout), loss_chunk_tokens=_loss_chunk_tokens(section),
        non_block_state=non_block, lean_norms=lean, gradient_reduce=reduce_at, grad_norm_as_landed=as_landed,
        frozen_bottom_layers=frozen_bottom)
