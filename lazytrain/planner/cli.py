"""`lazytrain plan`: plan one training step and compare it with the baseline policies.

    lazytrain plan --model qwen2.5-7b --hardware h800 --micro-batch 144 --seq 1024 --gpu-mem 70GB \
        [--host-mem 512GB] [--nvme 32GB] [--json plan.json] [--plot plan.png]
    lazytrain plan --profile measured.json [--hardware h200] [--gpu-mem ...] [--json plan.json]

``--profile``: what policy "auto" measured on a machine ('lazytrain.auto.profile_path'): the model, its
micro-batch and sequence length, each layer's measured times and the links' measured bandwidths.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..cli import fraction, nonnegative_int, positive
from ..files import check_writable


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="plan checkpoints, tier homes and transfer windows (MILP)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="catalog name (qwen2.5-3b, qwen2.5-7b, qwen2.5-14b, paper-27b) or a Hugging Face config.json")
    p.add_argument("--hardware", default=None,
                   help="catalog name (h800, rtx3090, h200) or a JSON profile written by `lazytrain bench tiers` "
                        "(with --profile: what the profile did not measure)")
    p.add_argument("--profile", default=None,
                   help="a machine profile policy \"auto\" measured (JSON): plan from its measured times and links")
    p.add_argument("--base", default=None, help="catalog entry that fills the --hardware profile's null fields (with "
                                                "--profile alone: what the measured profile did not measure)")
    p.add_argument("--micro-batch", default="auto",
                   help="micro-batch size, or 'auto' for the throughput-best one that fits (default)")
    p.add_argument("--global-batch", type=positive(int), default=None,
                   help="samples per optimizer step to keep fixed (a config's train_batch_size per GPU): "
                        "gradient accumulation fills it, and 'auto' tries only micro-batches dividing it")
    p.add_argument("--seq", type=positive(int), default=None,
                   help="sequence length (default 1024; with --profile, the profile's)")
    p.add_argument("--gpu-mem", default=None, help="GPU memory cap, e.g. 70GB (default: the card's size)")
    p.add_argument("--host-mem", default=None, help="host memory budget (default: the profile's host memory)")
    p.add_argument("--nvme", default="0", help="NVMe budget for activations (default 0: no NVMe)")
    p.add_argument("--time-limit", type=positive(float), default=10.0, help="MILP time limit in seconds (default 10)")
    p.add_argument("--max-segment", type=positive(int), default=8, help="longest recompute segment (default 8)")
    p.add_argument("--solver", choices=["auto", "highs", "cbc"], default="auto")
    p.add_argument("--no-resident", action="store_true", help="never keep layer weights resident on the GPU")
    p.add_argument("--no-offload", action="store_true",
                   help="never offload a layer's internals to the host (for an executor that does not run them)")
    p.add_argument("--no-lean-norms", action="store_true",
                   help="count the RMSNorms' internals as transformers saves them (for 'lazytrain.lean_norms': false)")
    p.add_argument("--trainable-share", type=fraction, default=None,
                   help="share of the layers' parameters that train (a LoRA run's adapters, e.g. 0.01): the frozen "
                        "rest is budgeted as its streamed bf16/fp16 copy alone (default 1, full fine-tuning; with "
                        "--profile, the share of the run measured)")
    p.add_argument("--non-block-trainable-share", type=fraction, default=None,
                   help="share of the parameters outside the layers (embedding, final norm, head) that train: 0 for "
                        "a LoRA run whose embedding and head are frozen, budgeted as their device copy alone (default "
                        "1; with --profile, the share of the run measured)")
    p.add_argument("--frozen-bottom-layers", type=nonnegative_int, default=None,
                   help="layers below the first one that trains, with nothing before them training (a frozen "
                        "embedding; training the top layers only): the backward reaches none of them, so they have "
                        "no backward, gradients or update; the embedding counts as frozen (default 0; with --profile, "
                        "the run measured's)")
    p.add_argument("--loss-chunk-tokens", type=nonnegative_int, default=None,
                   help="tokens per piece the LM head computes logits and loss in: the config's "
                        "'lazytrain.loss_chunk_tokens' (0: whole, the engine's default; default 2048; with --profile, "
                        "the run measured's)")
    p.add_argument("--json", default=None, help="write the Plan the engine loads to this file")
    p.add_argument("--plot", default=None,
                   help="draw a Gantt chart with memory per tier to this .png, .svg, .pdf, ... file (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .hardware import HardwareError, load_profile
    from .measured import MeasurementError
    from .milp import MilpOptions, PlanningError
    from .models import ModelShapeError, load_model
    from .plot import pyplot, unsupported_format
    from .problem import Budgets, InfeasibleBudgetError, Problem
    from .report import compare, table
    from .search import search_micro_batch
    from .simulate import simulate

    for flag, path in (("--json", args.json), ("--plot", args.plot)):   # before minutes of solving, not after
        # the file the write replaces: a symlink's target (files.py)
        folder = os.path.dirname(os.path.realpath(path)) if path else None
        if folder and not os.path.isdir(folder):
            what = "is not a directory" if os.path.exists(folder) else "does not exist"
            print(f"lazytrain plan: {flag} {path}: {folder} {what}", file=sys.stderr)
            return 2
        if path and os.path.isdir(path):
            print(f"lazytrain plan: {flag} {path} is a directory; give a file name", file=sys.stderr)
            return 2
        if path:
            try:   # a FIFO or a device (the rename would replace the node itself), a folder that takes no file
                check_writable(path, flag, "plan.json" if flag == "--json" else "plan.png")
            except ValueError as e:
                print(f"lazytrain plan: {e}", file=sys.stderr)
                return 2
        for source, given in (("--model", args.model), ("--hardware", args.hardware), ("--profile", args.profile)):
            if path and given and os.path.isfile(given) and os.path.realpath(path) == os.path.realpath(given):
                print(f"lazytrain plan: {flag} {path} is the {source} file this command reads: the output would "
                      f"replace it; give another file name", file=sys.stderr)
                return 2
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        print(f"lazytrain plan: --json {args.json} and --plot {args.plot} are one file: the plot would replace the "
              f"plan; give two names", file=sys.stderr)
        return 2
    why = unsupported_format(args.plot) if args.plot else None
    if why:
        print(f"lazytrain plan: --plot {args.plot}: {why}", file=sys.stderr)
        return 2
    if args.plot:
        try:   # the optional extra, asked for before solving, not after
            pyplot()
        except ImportError as e:
            print(f"lazytrain plan: --plot: {e}", file=sys.stderr)
            return 3
    if args.profile is None and (args.model is None or args.hardware is None):
        print("lazytrain plan: give --model and --hardware, or --profile", file=sys.stderr)
        return 2
    try:
        budgets = Budgets.of(gpu=args.gpu_mem, host=args.host_mem, nvme=args.nvme, lean_norms=not args.no_lean_norms,
                             sources={"gpu": "--gpu-mem", "host": "--host-mem", "nvme": "--nvme"},
                             trainable_share=1.0 if args.trainable_share is None else args.trainable_share,
                             non_block_trainable_share=1.0 if args.non_block_trainable_share is None
                             else args.non_block_trainable_share,
                             frozen_bottom_layers=args.frozen_bottom_layers or 0,
                             # 0: the whole logits (the planner counts at most a micro-batch's tokens in a piece)
                             **({} if args.loss_chunk_tokens is None else
                                {"loss_chunk_tokens": args.loss_chunk_tokens or sys.maxsize}))
        opts = MilpOptions(time_limit_s=args.time_limit, max_segment=args.max_segment, solver=args.solver,
                           allow_resident=not args.no_resident, allow_offload=not args.no_offload,
                           isolate=True)   # a solver overrunning its limit cannot hang the command
        if args.profile is not None:
            p, best, mb = _profile_problem(args, budgets), None, None
            if p.measured.selective_rerun_s is None:   # as the engine plans a profile: selective layers on measured
                opts = dataclasses.replace(opts, allow_selective=False)   # re-runs only
        else:
            p = None
            model = load_model(args.model)
            hw = load_profile(args.hardware, base=args.base)
        seq = args.seq if args.seq is not None else 1024
        if p is not None:
            pass
        elif _micro_batch(args.micro_batch) == "auto":
            best, trials = search_micro_batch(model, hw, budgets, seq, opts, global_batch=args.global_batch)
            print("micro-batch search: " + ", ".join(
                f"{t.micro_batch}: " + (f"{t.tokens_per_s:.0f} tok/s" if t.tokens_per_s else t.status) for t in trials))
            mb = best.micro_batch_size
        else:
            best, mb = None, _micro_batch(args.micro_batch)
        if p is None:
            if args.global_batch is not None and args.global_batch % mb:
                raise ValueError(f"--micro-batch {mb} does not divide --global-batch {args.global_batch}")
            accum = args.global_batch // mb if args.global_batch else 1
            p = Problem(model=model, hardware=hw, budgets=budgets, micro_batch=mb, seq_len=seq,
                        grad_accum=accum)
        mb = p.micro_batch
        rows = compare(p, opts, plan=best)
    except (InfeasibleBudgetError, PlanningError, HardwareError, ModelShapeError, MeasurementError, ValueError) as e:
        print(f"lazytrain plan: {e}", file=sys.stderr)
        return 2
    print(table(p, rows))
    plan = rows[0].plan
    if args.json:
        try:
            plan.to_json(args.json)
        except OSError as e:
            print(f"lazytrain plan: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import plot_step
        try:
            accum = f" x {p.grad_accum} accumulated" if p.grad_accum > 1 else ""
            plot_step(simulate(p, plan), args.plot,
                      title=f"{p.model.name} on {p.hardware.name}, micro-batch {mb}{accum}")
        except OSError as e:
            print(f"lazytrain plan: cannot write {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def _micro_batch(text: str) -> "int | str":
    """``--micro-batch``: "auto" or a whole number >= 1, refused by the flag's name otherwise."""
    if str(text).lower() == "auto":
        return "auto"
    try:
        mb = int(text)
    except ValueError:
        raise ValueError(f"--micro-batch must be a whole number or 'auto', got {text!r}") from None
    if mb < 1:
        raise ValueError(f"--micro-batch must be at least 1, got {mb}")
    return mb


def _profile_problem(args: argparse.Namespace, budgets):
    """The problem of a measured profile; the flags that the profile fixes must agree with it."""
    from .measured import MachineProfile
    from .search import as_the_run_measured, profile_problem
    profile = MachineProfile.from_json(args.profile)
    if args.model is not None:
        raise ValueError("--profile gives the model it measured: leave --model out")
    mb = _micro_batch(args.micro_batch)
    if mb != "auto" and mb != profile.micro_batch:
        raise ValueError(f"--profile was measured at micro-batch {profile.micro_batch}, not {mb}: "
                         f"measure again at that micro-batch")
    if args.seq is not None and args.seq != profile.seq_len:
        raise ValueError(f"--profile was measured at sequence length {profile.seq_len}, not {args.seq}")
    hardware = None
    if args.hardware is not None:
        from .hardware import load_profile
        hardware = load_profile(args.hardware, base=args.base)
    elif args.base is not None:   # the catalog entry supplies what the profile did not measure
        from .hardware import catalog_profile
        hardware = catalog_profile(args.base)
    elif args.gpu_mem is None or args.host_mem is None:   # else planned for a 64 GiB card and host, whatever ran
        missing = " and ".join(f for f, v in (("--gpu-mem", args.gpu_mem), ("--host-mem", args.host_mem)) if v is None)
        raise ValueError(f"--profile holds the measured times, not the machine's memory sizes: give {missing} "
                         f"(the sizes to plan for, e.g. 24GB for the card measured), or --hardware / --base")
    # the run measured fixed its global batch: planned with its accumulation unless --global-batch says otherwise
    global_batch = args.global_batch if args.global_batch is not None else profile.micro_batch * profile.grad_accum
    if global_batch % profile.micro_batch:   # named by the flag, not by the library's keyword
        raise ValueError(f"--global-batch {global_batch}: the profile's micro-batch {profile.micro_batch} does not "
                         f"divide it")
    for k in ("trainable_share", "non_block_trainable_share"):
        given, measured_share = getattr(args, k), getattr(profile, k)
        if given is None:   # the run measured trained this share of the layers (of the others)
            budgets = dataclasses.replace(budgets, **{k: measured_share})
        elif measured_share is not None and abs(given - measured_share) > 1e-9:
            flag = "--" + k.replace("_", "-")
            raise ValueError(f"{flag} {given:g}: the profile was measured with {k} {measured_share:.6g}, and its "
                             f"backward and update times are that run's; leave the flag out, or measure a run that "
                             f"trains as the one to plan")
    measured_frozen = profile.costs.first_differentiated   # what its backwards reached is planned, measured
    if args.frozen_bottom_layers is not None and args.frozen_bottom_layers != measured_frozen:
        raise ValueError(f"--frozen-bottom-layers {args.frozen_bottom_layers}: the profile's backwards differentiated "
                         f"from layer {measured_frozen}, and a profile is planned as it was measured; leave the flag "
                         f"out, or measure a run that trains as the one to plan")
    if profile.hybrid_8bit_fraction is not None:   # its optimizer kept this share of the moments in 8 bits
        budgets = dataclasses.replace(budgets, hybrid_8bit_fraction=profile.hybrid_8bit_fraction)
    if args.loss_chunk_tokens is None and profile.loss_chunk_tokens is not None:   # its head, as it computed it
        budgets = dataclasses.replace(budgets, loss_chunk_tokens=profile.loss_chunk_tokens)
    return profile_problem(profile, as_the_run_measured(profile, budgets), hardware, global_batch)
