"""`lazytrain train [CONFIG]`: train a small Llama-style model on generated arithmetic, end to end.

With no CONFIG it runs the embedded default job (the same as configs/tiny-cpu.json): a model built
from a config (transformers' LlamaForCausalLM when installed, else LazyTrain's own decoder), trained
through ``lazytrain.initialize`` with layer streaming, then evaluated by exact match on held-out
problems. It prints accuracy before and after, peak memory per tier, and where the weights went.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .launcher_env import launcher_int

FINAL_TAG = "final"   # the checkpoint tag the trained weights are saved under
MAX_OPERAND = 999   # the task lists every pair of operands: (999 + 1) ** 2 pairs take about 130 MB

DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 64,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 900, "warmup_num_steps": 50,
                                                        "warmup_type": "linear", "cos_min_ratio": 0.05}},
    "lazytrain": {"policy": "every_k", "checkpoint_interval": 2, "boundary_home": "host", "device": "auto"},
    "job": {
        "model": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 4},
        "task": {"max_operand": 99, "held_out_fraction": 0.1, "seed": 0},
        "steps": 900,
        "eval_examples": 500,
        "seed": 0,
        "out_dir": "lazytrain-out",
    },
}


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the embedded default job, or the job in CONFIG")
    p.add_argument("config", nargs="?", help="JSON engine config with a 'job' section (default: embedded tiny-cpu)")
    from .cli import positive
    p.add_argument("--steps", type=positive(int), help="override job.steps, and the schedule's "
                                                         "length (scheduler.params.total_num_steps, or a torch "
                                                         "OneCycleLR's total_steps, CosineAnnealingLR's T_max, "
                                                         "PolynomialLR's total_iters) where it has one: the "
                                                         "schedule is fitted to the steps run")
    p.add_argument("--out", help="override job.out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint an earlier run left in the "
                                                            "output directory (refused otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--trace", metavar="PATH", help="record the second training step as a Chrome/Perfetto trace "
                                                   "JSON at PATH and print its summary")
    p.set_defaults(func=run)


class JobError(ValueError):
    """A job file or a job setting `lazytrain train` cannot use; the message names the file or key."""


def load_job_config(path: str | None) -> dict:
    if path is None:
        return copy.deepcopy(DEFAULT_CONFIG)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise JobError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise JobError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:   # a UTF-16 file, say (what PowerShell 5's ">" writes)
        raise JobError(f"{path} is not UTF-8 JSON: {e}") from None
    if not isinstance(cfg, dict) or "job" not in cfg:
        raise JobError(f"{path} has no 'job' section (model, task, steps); see configs/tiny-cpu.json")
    return cfg


def _check_int(where: str, value, minimum: int = 1, below: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (below is not None and value >= below):
        bound = f" below 2**{below.bit_length() - 1}" if below is not None else ""
        raise JobError(f"'{where}' must be a {'non-negative' if minimum == 0 else 'positive'} integer{bound}, "
                       f"got {value!r}")


def _job_settings(job, steps_override: int | None) -> tuple[int, dict, dict]:
    """(steps, task settings, model settings), each checked and named on error."""
    if not isinstance(job, dict):
        raise JobError(f"'job' must be an object with model, task and steps, got {job!r}")
    known = {"model", "task", "steps", "eval_examples", "seed", "out_dir"}
    unknown = sorted(set(job) - known)
    if unknown:
        raise JobError(f"unknown key(s) in 'job': {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    steps = steps_override if steps_override is not None else job.get("steps")
    _check_int("job.steps", steps)
    _check_int("job.eval_examples", job.get("eval_examples", 500))
    _check_int("job.seed", job.get("seed", 0), minimum=0, below=2**64)   # torch.manual_seed's range
    out_dir = job.get("out_dir", "lazytrain-out")
    if not isinstance(out_dir, str) or not out_dir:
        raise JobError(f"'job.out_dir' must be a directory path, got {out_dir!r}")
    task, model = job.get("task", {}), job.get("model", {})
    for key, section in (("task", task), ("model", model)):
        if not isinstance(section, dict):
            raise JobError(f"'job.{key}' must be an object, got {section!r}")
    from lazytrain.data.arithmetic import ArithmeticTask
    from lazytrain.models.decoder import DecoderConfig
    for key, section, cls in (("task", task, ArithmeticTask), ("model", model, DecoderConfig)):
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_position_embeddings"}
        unknown = sorted(set(section) - fields)
        if unknown:
            raise JobError(f"unknown key(s) in 'job.{key}': {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
    _check_int("job.task.max_operand", task.get("max_operand", 99))
    _check_int("job.task.seed", task.get("seed", 0), minimum=0)
    if task.get("max_operand", 99) > MAX_OPERAND:   # the task lists every pair of operands
        raise JobError(f"'job.task.max_operand' must be at most {MAX_OPERAND} (the task holds every pair of operands "
                       f"in memory), got {task['max_operand']}")
    fraction = task.get("held_out_fraction", 0.1)
    if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise JobError(f"'job.task.held_out_fraction' must lie strictly between 0 and 1, got {fraction!r}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        _check_int(f"job.model.{key}", model.get(key, getattr(DecoderConfig, key)))
    h, heads = model.get("hidden_size", DecoderConfig.hidden_size), model.get("num_attention_heads", DecoderConfig.num_attention_heads)
    kv = model.get("num_key_value_heads", heads)
    if h % heads or heads % kv:
        raise JobError(f"'job.model': hidden_size ({h}) must be a multiple of num_attention_heads ({heads}), and "
                       f"num_attention_heads a multiple of num_key_value_heads ({kv})")
    if (h // heads) % 2:   # rotary embeddings turn pairs of a head's dimensions
        raise JobError(f"'job.model': hidden_size / num_attention_heads ({h} / {heads} = {h // heads}) must be even "
                       f"(rotary position embeddings rotate pairs of each head's dimensions)")
    for key in ("rope_theta", "rms_norm_eps"):   # a negative epsilon trained to NaN and saved it, exit status 0
        value = model.get(key, getattr(DecoderConfig, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise JobError(f"'job.model.{key}' must be a finite number > 0, got {value!r}")
    tied = model.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise JobError(f"'job.model.tie_word_embeddings' must be true or false, got {tied!r}")
    # unset, one key/value head per attention head, as transformers' LlamaConfig reads it
    model = {**model, "num_key_value_heads": kv}
    return steps, task, model


def _output_dir_problem(out_dir: str, overwrite: bool) -> str | None:
    """Why this rank cannot save the trained weights in ``out_dir`` (it cannot be made or take a file, or it holds
    an earlier run's checkpoint, or what its interrupted save left, that the save at the end would replace
    unasked), else None."""
    import tempfile
    from lazytrain.engine.checkpoint import tag_present
    if tag_present(out_dir, FINAL_TAG) and not overwrite:
        return (f"{os.path.abspath(os.path.join(out_dir, FINAL_TAG))} holds the checkpoint of an earlier run (or what "
                f"its interrupted save left), which this run's would replace: pass --overwrite, or another --out")
    latest = _latest_tag(out_dir)
    if latest is not None and latest != FINAL_TAG and not overwrite:   # what a load without a tag would load
        return (f"{os.path.abspath(os.path.join(out_dir, 'latest'))} names checkpoint tag {latest!r}, which this run's "
                f"save would point at its own '{FINAL_TAG}' instead: pass --overwrite, or another --out")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        return f"cannot create the output directory {out_dir}: {e.strerror or e}"
    try:
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".lazytrain-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"cannot write to the output directory {out_dir}: {e.strerror or e}"
    return None


def _latest_tag(out_dir: str) -> str | None:
    """The tag the directory's ``latest`` file names (a checkpoint directory's), or None."""
    try:
        with open(os.path.join(out_dir, "latest")) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _check_output_dir(out_dir: str, overwrite: bool, group: bool) -> None:
    """Before training, not after it, on every rank alike: each rank looks (a save directory may be a disk of
    each node's own, and the ranks must stop together, not some of them wait for the others), and the first
    problem any rank found is raised on all of them."""
    problem = _output_dir_problem(out_dir, overwrite)
    if group:
        seen = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(seen, problem)
        found = [(rank, p) for rank, p in enumerate(seen) if p is not None]
        if found and problem is None:
            rank, other = found[0]
            problem = f"rank {rank}: {other}"
    if problem is not None:
        raise JobError(problem)


def run(args) -> int:
    from lazytrain.config import ConfigError
    from lazytrain.planner.hardware import HardwareError
    from lazytrain.planner.milp import PlanningError
    from lazytrain.planner.problem import InfeasibleBudgetError
    from lazytrain.tiers.base import TierBudgetError
    from lazytrain.tiers.factory import TierSpecError
    from lazytrain.tiers.nvme import NVMeIOError
    from lazytrain.engine.blocks import BlockDiscoveryError
    from lazytrain.engine.checkpoint import CheckpointError
    from lazytrain.launcher_env import LaunchError
    try:
        return _run(args)
    # a problem with the user's job or config (a budget too small for the model, a hardware profile the
    # planner cannot read, no plan in time, an NVMe path or an output disk that cannot take the files, on this
    # rank or another, blocks or tiers the config names that the model or the tier specs lack, a launcher's
    # variables half set): one line
    # naming what to change, no traceback
    except (JobError, ConfigError, InfeasibleBudgetError, HardwareError, PlanningError, TierBudgetError,
            TierSpecError, NVMeIOError, BlockDiscoveryError, CheckpointError, LaunchError) as e:
        print(f"lazytrain train: {e}", file=sys.stderr)
        return 2


# schedules with a length, and what the steps past it train at: a schedule shorter than the run wastes them
class _ScheduleLength(NamedTuple):
    """Where a schedule keeps its length, what the steps past it train at, and torch's default for it."""
    key: str
    after: Optional[str]
    default: Optional[int] = None


_SCHEDULE_LENGTHS = {
    "WarmupDecayLR": _ScheduleLength("total_num_steps", "learning rate 0"),
    "WarmupCosineLR": _ScheduleLength("total_num_steps", "the schedule's floor (cos_min_ratio of the learning rate)"),
    "CosineAnnealingLR": _ScheduleLength("T_max", "a learning rate rising again (torch's cosine goes on past T_max)"),
    "PolynomialLR": _ScheduleLength("total_iters", "learning rate 0", default=5),
}


def _fit_schedule_length(sched, steps: int, overridden: bool) -> None:
    """With --steps the schedule's length is the steps run (DeepSpeed's ``total_num_steps``, torch's OneCycleLR
    ``total_steps``, CosineAnnealingLR ``T_max`` and PolynomialLR ``total_iters``); without it, a schedule shorter
    than ``job.steps`` is refused before training. Why: torch's OneCycleLR raises once stepped past its end,
    which stopped the run there with a traceback and nothing saved; the others trained the steps past their end
    at learning rate 0 (or their floor, or rising again), without a word."""
    if not isinstance(sched, dict) or not isinstance(sched.get("params"), dict):
        return   # the engine names what is wrong with it
    params, kind = sched["params"], sched.get("type")
    if kind == "OneCycleLR":
        if overridden:
            params["total_steps"] = steps   # taken before epochs x steps_per_epoch
            return
        length, where = params.get("total_steps"), "total_steps"
        if length is None and isinstance(params.get("epochs"), int) and isinstance(params.get("steps_per_epoch"), int):
            length, where = params["epochs"] * params["steps_per_epoch"], "epochs x steps_per_epoch"
        past = "torch's OneCycleLR raises when stepped past its end"
    else:
        key, after, default = _SCHEDULE_LENGTHS.get(kind, _ScheduleLength("total_num_steps", None))
        if overridden:
            if key in params or default is not None:
                params[key] = steps
            return
        length, where = params.get(key, default), key
        if key not in params and length is not None:
            where = f"{key}, torch's default"
        past = f"the last {steps - length} would train at {after}" if isinstance(length, int) and after else None
    if past is not None and isinstance(length, int) and 0 < length < steps:   # true is 1 to torch
        length = int(length)
        raise JobError(f"the scheduler {kind} runs {length} steps ('scheduler.params' {where}), fewer than "
                       f"job.steps ({steps}): {past}; give it {steps} steps, or run with --steps, which fits it "
                       f"to the steps run")


def _run(args) -> int:
    import lazytrain
    from lazytrain.data.arithmetic import VOCAB_SIZE, ArithmeticTask
    from lazytrain.models.decoder import DecoderConfig, build_causal_lm

    cfg = load_job_config(args.config)
    if not isinstance(cfg.get("optimizer"), dict):   # refused before the evaluation before training, not after it
        raise JobError("the config has no 'optimizer' section: lazytrain train trains the job's model with it (e.g. "
                       "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-3}})")
    job = cfg["job"]
    steps, task_settings, model_settings = _job_settings(job, args.steps)
    _fit_schedule_length(cfg.get("scheduler"), steps, overridden=bool(args.steps))
    out_dir = args.out if args.out is not None else job.get("out_dir", "lazytrain-out")
    if not out_dir:   # (job.out_dir was checked with the job's settings)
        raise JobError("'--out' must be a directory path, got ''")
    if not torch.distributed.is_initialized() and launcher_int("WORLD_SIZE", 1) == 1:
        _check_output_dir(out_dir, getattr(args, "overwrite", False), group=False)   # before the model is built
    trace_path = getattr(args, "trace", None)
    if launcher_int("RANK", 0) != 0:   # under a launcher rank 0 alone records (and reports) the trace
        trace_path = None
    if trace_path:
        from lazytrain.trace import check_writable
        try:   # before training, not after it
            check_writable(trace_path)
        except ValueError as e:
            raise JobError(str(e)) from None
        if args.config is not None and os.path.realpath(trace_path) == os.path.realpath(args.config):
            raise JobError(f"trace path {trace_path} is the config file this run reads: the trace would replace it; "
                           f"give another file name")
        out_real = os.path.realpath(out_dir)
        if os.path.commonpath([os.path.realpath(trace_path), out_real]) == out_real:
            # the checkpoint's 'latest' file would replace the trace, a trace named 'final' stop the save
            raise JobError(f"trace path {trace_path} is in the output directory {out_dir}, where the checkpoint is "
                           f"written: give a file outside it")
    torch.manual_seed(job.get("seed", 0))
    task = ArithmeticTask(**task_settings)
    model_cfg = DecoderConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=max(64, task.seq_len), **model_settings)
    try:
        model = build_causal_lm(model_cfg)
    except Exception as e:   # noqa: BLE001 - transformers validates its config its own way
        raise JobError(f"'job.model' does not build a model: {e}") from None
    n_params = sum(p.numel() for p in model.parameters())
    made_group = torch.distributed.is_available() and not torch.distributed.is_initialized()
    engine, _, _, _ = lazytrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    made_group = made_group and torch.distributed.is_initialized()   # initialize made it from the launcher's env
    try:
        return _train(args, cfg, job, steps, out_dir, trace_path, engine, model, n_params, task, made_group)
    except BaseException:
        if made_group and torch.distributed.is_initialized():   # the group it made goes with it, as at the end
            torch.distributed.destroy_process_group()
        raise


def _train(args, cfg, job, steps, out_dir, trace_path, engine, model, n_params, task, made_group) -> int:
    import lazytrain
    from lazytrain.data.arithmetic import exact_match
    from lazytrain.models.decoder import logits_of
    from lazytrain.tiers import format_bytes
    if torch.distributed.is_initialized():   # several ranks: checked once every rank can hear of the others' problem
        _check_output_dir(out_dir, getattr(args, "overwrite", False), group=True)
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    managed = engine.engine_config.managed_gradient_accumulation
    # under a launcher every rank trains on batches of its own, and rank 0 alone reports
    rank = engine.global_rank
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    say(f"LazyTrain {lazytrain.__version__}: {type(model).__name__}, {n_params / 1e6:.2f}M parameters, "
          f"{len(engine.plan.homes) - 1} streamed layers, plan {engine.plan.policy} "
          f"(kept boundaries {list(engine.plan.kept)}), device {engine.device}, "
          f"{engine.engine_config.compute_dtype_name}")

    def model_fn(ids):
        return logits_of(engine(ids))

    pairs = task.eval_set(job.get("eval_examples", 500))
    engine.eval()
    acc_before = exact_match(model_fn, task, pairs, engine.device)
    engine.train()

    bar = _progress(steps, disabled=args.no_progress, silent=rank != 0)
    batches = task.train_batches(micro, steps * gas, seed=job.get("seed", 0) + 1 + 1_000_003 * rank)
    tokens, t0 = 0, time.perf_counter()   # (the task's split made above: the throughput is the training's)
    loss_value = float("nan")   # each step's: the mean of its micro-batches' losses, as Trainer logs it
    traced_step = min(1, steps - 1) if trace_path else None   # the second step: the first warms up
    traced = None   # its trace, kept: auto-planning may trace later steps of its own
    for step in range(steps):
        if step == traced_step:
            engine.trace_next_step(trace_path)
        step_loss = 0.0
        for micro_batch in range(gas):
            x, y = next(batches)
            logits = model_fn(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(engine.device).flatten(), ignore_index=-100)
            step_loss = step_loss + loss.detach()
            engine.backward(loss)
            if managed or micro_batch == gas - 1:   # unmanaged, every step() is a boundary: one per training step
                engine.step()
            tokens += x.numel() * engine.world_size   # every rank trains a micro-batch of the same shape
        if step == traced_step:
            traced = engine.last_trace
        loss_value = (step_loss / gas).item()
        bar.update(loss_value, tokens / (time.perf_counter() - t0))
    bar.close()
    elapsed = time.perf_counter() - t0
    if engine.world_size > 1:   # the last step's loss over the ranks (on the engine's host group: the default
        loss_value = engine.dist.sum_over_ranks(loss_value) / engine.world_size   # one may be NCCL's)
    if traced is not None:
        say(traced.summary())
        if traced.written_to:
            say(f"trace of step {traced_step + 1} written to {os.path.abspath(trace_path)}")
        else:   # the engine's warning says why (it may be filtered out)
            print(f"lazytrain: the trace of step {traced_step + 1} could not be written to "
                  f"{os.path.abspath(trace_path)}; its summary is above", file=sys.stderr)

    engine.eval()
    acc_after = exact_match(model_fn, task, pairs, engine.device)
    engine.save_checkpoint(out_dir, tag=FINAL_TAG)
    ranks = f" over {engine.world_size} ranks" if engine.world_size > 1 else ""
    say(f"trained {steps} steps in {elapsed:.1f} s ({tokens / elapsed:,.0f} tokens/s{ranks}), final loss "
        f"{loss_value:.4f}")
    say(f"held-out exact match ({len(pairs)} problems): {acc_before:.1%} before -> {acc_after:.1%} after")
    peaks = ", ".join(f"{name} {format_bytes(b)}" for name, b in engine.last_step_peak_bytes.items())
    say(f"peak memory per tier (last step): {peaks}")
    say(f"trained weights saved to {os.path.abspath(os.path.join(out_dir, FINAL_TAG))}")
    engine.destroy()
    if made_group and torch.distributed.is_initialized():   # its threads torn down before the interpreter's exit,
        torch.distributed.barrier()                         # which else may abort the process after its work
        torch.distributed.destroy_process_group()           # (every rank done first, as torch advises)
    return 0


class _progress:
    """tqdm bar with loss and tokens/s; a plain line every 10% when tqdm is absent or disabled."""

    def __init__(self, total: int, disabled: bool, silent: bool = False):
        self.total, self.n, self.silent = total, 0, silent
        self.bar = None
        if not disabled and not silent:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, loss: float, tok_s: float) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif not self.silent and (self.n % max(1, self.total // 10) == 0 or self.n == self.total):
            print(f"step {self.n}/{self.total}: loss {loss:.4f}, {tok_s:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
