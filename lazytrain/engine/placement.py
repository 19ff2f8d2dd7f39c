"""Where things live: the compute device, the storage tiers, and the Plan the executor runs."""
from __future__ import annotations

import dataclasses
import os
import time
import warnings

import torch

from ..config import ConfigError, EngineConfig
from ..planner.models import DTYPE_BYTES, ModelShape, ModelShapeError
from ..planner.plan import DEVICE_HOME, Plan, PlanError, every_k_plan, keep_all_plan, offload_all_plan
from ..tiers import Tier
from ..tiers.base import format_bytes


def resolve_device(cfg: EngineConfig, local_rank: int) -> torch.device:
    name = cfg.lazytrain.device
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):   # streams, events and RNG replay exist for these two
        raise ConfigError(f"config 'lazytrain.device' must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config 'lazytrain.device' is {name!r} but CUDA is not available on this machine "
                          f"(use \"auto\" or \"cpu\")")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    return dev


def build_tiers(cfg: EngineConfig, device: torch.device) -> dict[str, Tier]:
    """hbm + host always; nvme when a path is configured; plus the user's tiers from config."""
    from ..tiers import create_tiers
    lt = cfg.lazytrain
    aio = cfg.aio.tier_settings()
    tiers = create_tiers(list(lt.tiers), device, nvme_path=lt.nvme_path, aio=aio if lt.nvme_path else None,
                         capacities=lt.capacities)
    for name, tier in tiers.items():   # its over-budget error names the key to raise
        if name in lt.capacity_keys and tier.capacity is not None:
            tier.capacity_source = lt.capacity_keys[name]
    return tiers


_NO_NVME = "; the NVMe tier exists when 'lazytrain.nvme_path' names a directory on the drive"


def build_plan(cfg: EngineConfig, num_layers: int, tiers: dict[str, Tier], model_config: dict | None,
               micro_batch: int, from_model: dict[str, float] | None = None, memory: RankMemory | None = None,
               layer_params: list[int] | None = None) -> Plan:
    """The policy's Plan, with ``lazytrain.last_segment_graph`` applied: "auto" turns it on for the
    built-in policies where the CPU computes on the host weights in place (there it costs no weight
    copies, and the last segment's recompute would hold the same internals a moment later anyway);
    a Plan file, the MILP and offload_all (the last layer's graph on the device) decide for themselves
    unless the config says true or false; policy auto's calibration plan has none whatever it says (its MILP
    plans with the key). ``from_model``: ``Budgets`` fields counted on the model: the shares of
    the blocks' parameters and of the others that train (``trainable_share``, ``non_block_trainable_share``: the
    MILP budgets the frozen ones as their compute copy alone) and of the trained ones with 8-bit moments
    (``hybrid_8bit_fraction``); None: the planner's defaults. ``memory``: what the MILP plans with, the least over
    the ranks (by default this rank's). ``layer_params``: each block's parameter count, which a Plan file's
    is compared with."""
    if num_layers == 0:   # nothing streams: every parameter stays on the device
        if cfg.lazytrain.policy == "plan":   # a Plan file is read and refused, not left unread without a word
            _plan_file(cfg, 0, tiers, micro_batch)
        return Plan(num_layers=0, homes=(DEVICE_HOME,), policy="nothing-streams", micro_batch_size=micro_batch)
    plan = _policy_plan(cfg, num_layers, tiers, model_config, micro_batch, from_model, memory)
    if cfg.lazytrain.policy == "plan":
        _warn_if_planned_for_another_model(plan, cfg, layer_params, model_config)
    choice = cfg.lazytrain.last_segment_graph
    if cfg.lazytrain.policy == "auto":   # its calibration measures every layer re-run; its MILP plans with the
        return plan                       # tail as the key says (plan_from_measurements)
    if choice == "auto":
        if cfg.lazytrain.policy in ("plan", "milp", "offload_all"):
            return plan
        choice = tiers["hbm"].device.type == "cpu" and cfg.lazytrain.weights_home in ("host", "hbm")
    try:
        return dataclasses.replace(plan, last_segment_graph=bool(choice))
    except PlanError as e:   # e.g. a selective or offloaded layer in what would become the graph tail
        raise ConfigError(f"config 'lazytrain.last_segment_graph' {str(choice).lower()} does not fit the "
                          f"{plan.policy!r} plan: {e}; leave the key \"auto\" to run the plan as it is") from e


def _policy_plan(cfg: EngineConfig, num_layers: int, tiers: dict[str, Tier], model_config: dict | None,
                 micro_batch: int, from_model: dict[str, float] | None, memory: RankMemory | None) -> Plan:
    lt = cfg.lazytrain
    home = lt.boundary_home
    if home not in tiers:
        raise ConfigError(f"config 'lazytrain.boundary_home' is {home!r}, which is not a configured tier "
                          f"(configured: {', '.join(tiers)})" + (_NO_NVME if home == "nvme" else ""))
    resident = tuple(range(num_layers)) if lt.weights_home == "hbm" else ()
    if lt.policy == "every_k":
        k = cfg.interval_for(num_layers)
        return every_k_plan(num_layers, k, home=home, resident_layers=resident, policy=f"megatrain-k{k}-{home}")
    if lt.policy == "keep_all":
        return keep_all_plan(num_layers, home=home, resident_layers=resident)
    if lt.policy == "offload_all":
        return offload_all_plan(num_layers, input_home=home, resident_layers=resident)
    if lt.policy == "plan":
        return _plan_file(cfg, num_layers, tiers, micro_batch)
    if lt.policy == "milp":
        return _milp_plan(cfg, num_layers, tiers, model_config, micro_batch, from_model, memory)
    if lt.policy == "auto":
        return calibration_plan(cfg, num_layers, micro_batch)
    raise ConfigError(f"config 'lazytrain.policy' {lt.policy!r} is unknown")


def _plan_file(cfg: EngineConfig, num_layers: int, tiers: dict[str, Tier], micro_batch: int) -> Plan:
    """The Plan file 'lazytrain.plan' names, checked against this run: refused where it cannot run here,
    warned of where it runs but its predictions do not hold."""
    lt = cfg.lazytrain
    try:
        plan = Plan.from_json(lt.plan_path)
        plan.validate(custom_tiers=tuple(tiers))
    except (OSError, PlanError) as e:
        raise ConfigError(f"config 'lazytrain.plan' ({lt.plan_path}): {e}") from e
    if plan.num_layers != num_layers:
        raise ConfigError(f"config 'lazytrain.plan' ({lt.plan_path}) is for {plan.num_layers} layers, but the "
                          f"model has {num_layers} blocks" + (" (no repeated blocks to stream)"
                                                              if num_layers == 0 else ""))
    if lt.weights_home == "hbm" and set(plan.resident_layers) != set(range(num_layers)):
        raise ConfigError(f"config 'lazytrain.weights_home' \"hbm\" keeps every layer resident, but "
                          f"'lazytrain.plan' ({lt.plan_path}) streams layers "
                          f"{_ranges(sorted(set(range(num_layers)) - set(plan.resident_layers)))}: set "
                          f"'weights_home' to \"host\" or \"nvme\" to run the plan, or plan with every layer "
                          f"resident")
    # a plan written with --nvme: refused here, naming the keys, not by the executor once the weights are set up
    # (a boundary the plan never stores needs no tier: the graph tail's, unless the config turns the tail off)
    runs_as = dataclasses.replace(plan, last_segment_graph=False) if lt.last_segment_graph is False else plan
    unstored = runs_as.unstored_boundaries()
    on_nvme = [i for i, h in enumerate(plan.homes) if h == "nvme" and i not in unstored]
    if on_nvme and "nvme" not in tiers:
        more = f" and {len(on_nvme) - 1} more" if len(on_nvme) > 1 else ""
        raise ConfigError(f"config 'lazytrain.plan' ({lt.plan_path}) puts boundary {on_nvme[0]}{more} on tier "
                          f"'nvme', which is not configured (configured: {', '.join(tiers)}){_NO_NVME}; or "
                          f"plan again without NVMe (`lazytrain plan --nvme 0`)")
    if plan.micro_batch_size is not None and plan.micro_batch_size != micro_batch:
        warnings.warn(f"lazytrain: config 'lazytrain.plan' ({lt.plan_path}) was planned for micro-batch "
                      f"{plan.micro_batch_size}, but this run trains micro-batch {micro_batch}: it runs, but its "
                      f"memory and time predictions do not hold (plan again with --micro-batch {micro_batch})")
    peak = (plan.prediction.get("peak_bytes") or {}).get(DEVICE_HOME) if isinstance(plan.prediction, dict) else None
    budget = tiers[DEVICE_HOME].capacity
    if isinstance(peak, (int, float)) and budget is not None and peak > budget:
        warnings.warn(f"lazytrain: config 'lazytrain.plan' ({lt.plan_path}) predicts {format_bytes(int(peak))} on the "
                      f"device, more than its budget here ({format_bytes(budget)}: 'lazytrain.gpu_memory' or "
                      f"'lazytrain.capacities.hbm'): it runs until a write would overrun that budget (plan again "
                      f"with --gpu-mem {budget})")
    if plan.seq_len is not None and lt.seq_len is not None and plan.seq_len != lt.seq_len:
        warnings.warn(f"lazytrain: config 'lazytrain.plan' ({lt.plan_path}) was planned for sequence length "
                      f"{plan.seq_len}, but 'lazytrain.seq_len' is {lt.seq_len}: it runs, but its memory and time "
                      f"predictions do not hold (plan again with --seq {lt.seq_len})")
    _warn_if_head_counted_smaller(plan, lt, micro_batch)
    return plan


def _warn_if_planned_for_another_model(plan: Plan, cfg: EngineConfig, layer_params: list[int] | None,
                                       model_config: dict | None) -> None:
    """A Plan file made for another model of as many layers runs (its homes and re-runs are layer by layer), but
    its memory and time predictions were counted for that model's layers: said where its blocks' parameter counts
    (`lazytrain plan` writes them) differ by more than 1% both from this model's and from what the planner counts
    from this model's config (`lazytrain plan --model config.json` costs some families by analogy, and counts no
    adapter a LoRA run adds), or it counted weights of another precision. A plan file written before it recorded
    them is not checked."""
    pred = plan.prediction if isinstance(plan.prediction, dict) else {}
    planned, path = pred.get("layer_params"), cfg.lazytrain.plan_path

    def first_differing(counts):
        if not isinstance(planned, list) or counts is None or len(planned) != len(counts):
            return None
        return next((i for i, (a, b) in enumerate(zip(planned, counts))
                     if isinstance(a, (int, float)) and abs(a - b) > 0.01 * max(b, 1)), None)
    off = first_differing(layer_params)
    if off is not None and first_differing(_counted_from_config(model_config)) is not None:
        named = f" ({pred['model']})" if isinstance(pred.get("model"), str) else ""
        warnings.warn(f"lazytrain: config 'lazytrain.plan' ({path}) was planned for a model{named} whose block "
                      f"{off} holds {int(planned[off]):,} parameters, and this model's holds "
                      f"{layer_params[off]:,}: it runs, but its memory and time predictions do not hold (plan "
                      f"again for this model: lazytrain plan --model its config.json)")
    planned_bytes = pred.get("dtype_bytes")
    here = DTYPE_BYTES[cfg.compute_dtype_name]
    if isinstance(planned_bytes, int) and not isinstance(planned_bytes, bool) and planned_bytes != here:
        warnings.warn(f"lazytrain: config 'lazytrain.plan' ({path}) counted {planned_bytes}-byte weights, and this run "
                      f"computes in {cfg.compute_dtype_name} ({here} bytes): it runs, but its memory and time "
                      f"predictions do not hold (plan again with the model config's torch_dtype "
                      f"{cfg.compute_dtype_name})")


def _counted_from_config(model_config: dict | None) -> list[int] | None:
    """Each layer's parameter count as `lazytrain plan --model config.json` counts it from this model's config
    (not from the blocks measured here); None where the planner cannot read the config."""
    if model_config is None:
        return None
    try:
        with warnings.catch_warnings():   # a family costed by analogy: said where a plan is made, not here
            warnings.simplefilter("ignore")
            shape = ModelShape.from_hf_config({k: v for k, v in model_config.items() if k != "layer_params"})
    except (ModelShapeError, ValueError, TypeError):
        return None
    return [layer.params for layer in shape.layers]


def _warn_if_head_counted_smaller(plan: Plan, lt, micro_batch: int) -> None:
    """A plan that counted the LM head's logits in smaller pieces than this run computes them (`lazytrain plan`
    counts 2048-token pieces unless told; the engine computes them whole unless 'lazytrain.loss_chunk_tokens'
    is set) predicts too little device memory."""
    counted = plan.prediction.get("loss_chunk_tokens") if isinstance(plan.prediction, dict) else None
    seq = lt.seq_len or plan.seq_len
    if isinstance(counted, bool) or not isinstance(counted, int) or not seq:
        return
    tokens = micro_batch * seq
    runs = lt.head_tokens(tokens)
    if runs > counted:
        how = f"in pieces of {runs} tokens" if runs < tokens else f"whole ({tokens} tokens a micro-batch)"
        warnings.warn(f"lazytrain: config 'lazytrain.plan' ({lt.plan_path}) counted the LM head's logits in pieces "
                      f"of {counted} tokens, but this run computes them {how}: its device memory prediction is too "
                      f"low. Set 'lazytrain.loss_chunk_tokens' to {counted}, or plan again with --loss-chunk-tokens "
                      f"{lt.loss_chunk_tokens}")


def _ranges(layers: list[int]) -> str:
    """Layer indices as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def calibration_plan(cfg: EngineConfig, num_layers: int, micro_batch: int) -> Plan:
    """Policy "auto" measures on this plan: every boundary kept on the host and no graph tail, so that a
    traced step holds each layer's plain forward, its re-run with its backward, and its own update."""
    if cfg.lazytrain.weights_home == "hbm":
        raise ConfigError("config 'lazytrain.policy' \"auto\" plans how the layers stream, and 'lazytrain.weights_home' "
                          "\"hbm\" keeps every layer resident: there is nothing for it to plan (use keep_all)")
    return dataclasses.replace(keep_all_plan(num_layers, home="host", micro_batch_size=micro_batch),
                               policy="auto-calibration", last_segment_graph=False)


_GPU_PROFILES = (("H800", "h800"), ("H200", "h200"), ("H100", "h800"), ("3090", "rtx3090"))


def _host_shares(cfg: EngineConfig, device: torch.device) -> dict[str, float]:
    """What one rank holds of the host state when the optimizer state is sharded (engine.py,
    ``_shard_host_weights``): the Adam moments of its share of the parameters; in bf16/fp16 the fp32 weights
    of its share of the layers too; at stage >= 2 their gradient buffers; of the parameters outside the layers
    the fp32 masters of its share where they are apart from the compute copies (bf16/fp16, or on the host
    beside a GPU's copies; partitioned_params.py), and at stage 3 their gradients too (below it every rank
    accumulates them whole); with the weights in host memory, its part of the node's one streamed copy (the
    launcher's ranks per node, when it says)."""
    sharded = cfg.zero_stage >= 1 and cfg.world_size > 1 and cfg.optimizer.type is not None
    if not sharded:
        return {}
    per_rank = 1 / cfg.world_size
    in_host = cfg.lazytrain.weights_home in ("host", "hbm")
    per_node = ranks_on_this_node()
    mixed = cfg.compute_dtype_name != "float32"
    return {"optimizer_state_share": per_rank,
            "master_share": per_rank if mixed and in_host else 1.0,
            "gradient_share": per_rank if cfg.zero_stage >= 2 else 1.0,
            "non_block_master_share": per_rank if cfg.zero_stage >= 3 or non_block_masters_apart(cfg, device) else 1.0,
            "non_block_gradient_share": per_rank if cfg.zero_stage >= 3 else 1.0,
            "weights_copy_share": 1 / per_node if in_host and per_node > 1 else 1.0}


def configured_hardware(cfg: EngineConfig):
    """'lazytrain.hardware' as a HardwareProfile (None for "auto"); a name, file or field the planner cannot
    use is refused naming the key."""
    from ..planner.hardware import HardwareError, load_profile
    if cfg.lazytrain.hardware == "auto":
        return None
    try:
        return load_profile(cfg.lazytrain.hardware)
    except HardwareError as e:
        raise ConfigError(f"config 'lazytrain.hardware': {e}") from None


def _hardware_profile(cfg: EngineConfig, device: torch.device):
    if cfg.lazytrain.hardware != "auto":
        return configured_hardware(cfg)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for needle, profile in _GPU_PROFILES:
            if needle in name:
                return profile
    raise ConfigError("config 'lazytrain.policy' \"milp\" needs 'lazytrain.hardware': a catalog name (h800, h200, "
                      "rtx3090) or the JSON written by `lazytrain bench tiers --json`")


def non_block_state_home(cfg: EngineConfig) -> str:
    """Where the parameters outside the streamed blocks (embeddings, final norm, head) keep their fp32
    masters, gradients and Adam moments: "host" or "device". "auto" is the host: with a large vocabulary
    they are 16 bytes a parameter beside the 2 of the compute copy (a 27B model's 2.5B embedding and head
    parameters: 40 GB of a GPU), which is GPU memory the layers' activations need more; the host updates
    them first, before the layers. On the CPU both are the same memory, and only the planner's accounting
    (``Budgets.non_block_state``: whose budget they count in) differs."""
    choice = cfg.lazytrain.non_block_state
    return "host" if choice == "auto" else choice


def non_block_masters_apart(cfg: EngineConfig, device: torch.device) -> bool:
    """Whether the parameters outside the streamed blocks keep fp32 masters apart from the copies they compute
    with (engine.py ``Masters``): in bf16/fp16, or in fp32 on a GPU with the masters on the host. Sharded
    (stages 1-2) those masters live on their owners alone; else, on the CPU in fp32, a parameter is its own."""
    return cfg.compute_dtype_name != "float32" or (non_block_state_home(cfg) == "host" and device.type != "cpu")


def planning_budgets(cfg: EngineConfig, tiers: dict[str, Tier], micro_batch: int, seq_len: int,
                     from_model: dict[str, float] | None = None, memory: RankMemory | None = None) -> dict:
    """The planner's budgets for this engine: the tiers' capacities (on CUDA the card's memory, the smallest
    of the ranks' in ``memory``), the LM
    head's logits as the engine computes them, what one rank holds of a sharded host state, and the shares
    of the parameters that train and that keep 8-bit moments (``from_model``, Budgets' field names)."""
    lt = cfg.lazytrain
    device = tiers["hbm"].device
    gpu = lt.capacities.get("hbm")
    if gpu is None:
        gpu = (memory or RankMemory.of_this_rank(device)).gpu_bytes
    budgets = {"gpu": gpu, "host": lt.capacities.get("host"), "nvme": lt.capacities.get("nvme", 0)
               if "nvme" in tiers else 0,
               # the logits as the engine computes them: in chunks when configured, else whole
               "loss_chunk_tokens": lt.head_tokens(micro_batch * seq_len),
               # where the engine keeps the embedding's and head's optimizer state
               "non_block_state": non_block_state_home(cfg),
               # what the blocks' RMSNorms save
               "lean_norms": lt.lean_norms,
               "quant_block_size": lt.quant_block_size,
               # where the streamed copies are kept (on NVMe the host holds the fp32 weights apart)
               "weights_in_host": lt.weights_home in ("host", "hbm"),
               **(from_model or {}),
               **_host_shares(cfg, device)}
    if device.type == "cpu":   # no CUDA context, workspace or allocator to hold back
        budgets["gpu_reserved_bytes"] = 0
    return {k: v for k, v in budgets.items() if v is not None}


def check_model_shape(model_config: dict, policy: str) -> None:
    """A config the planner cannot read refused at set-up, named by the policy that needs it (policy auto would
    calibrate, then keep its calibration plan for good with a warning)."""
    from ..planner.models import ModelShapeError
    from ..planner.search import as_model_shape
    try:
        as_model_shape(model_config)
    except ModelShapeError as e:
        raise ConfigError(f"config 'lazytrain.policy' \"{policy}\" plans from the model's shape, which its config "
                          f"does not give: {e} (or write a Plan with `lazytrain plan --json` and use policy "
                          f"\"plan\")") from None


def _milp_plan(cfg: EngineConfig, num_layers: int, tiers: dict[str, Tier], model_config: dict | None,
               micro_batch: int, from_model: dict[str, float] | None, memory: RankMemory | None = None) -> Plan:
    """The MILP planner's Plan for this model on this machine within the configured budgets."""
    from ..planner import plan_for
    from ..planner.isolate import call_with_deadline
    from ..planner.milp import MilpOptions
    lt = cfg.lazytrain
    if model_config is None:
        raise ConfigError("config 'lazytrain.policy' \"milp\" needs the model's shape: a model with a Hugging Face "
                          "`config` (or write a Plan with `lazytrain plan --json` and use policy \"plan\")")
    if lt.seq_len is None:
        raise ConfigError("config 'lazytrain.policy' \"milp\" needs 'lazytrain.seq_len' (the training sequence length)")
    if lt.weights_home == "hbm":
        raise ConfigError("config 'lazytrain.policy' \"milp\" plans which layers stream, and 'lazytrain.weights_home' "
                          "\"hbm\" keeps every layer resident: set 'weights_home' to \"host\" or \"nvme\" for the "
                          "MILP's plan (it keeps layers resident where that is faster), or use keep_all")
    check_model_shape(model_config, "milp")
    device = tiers["hbm"].device
    memory = memory or RankMemory.of_this_rank(device)
    budgets = planning_budgets(cfg, tiers, micro_batch, lt.seq_len, from_model, memory)
    # in a child process with a hard deadline: a solver overrunning its time limit cannot hang start-up
    from ..planner.hardware import load_profile
    hardware = load_profile(_hardware_profile(cfg, device))
    if device.type != "cuda":
        hardware = with_cpu_links(hardware)
    # the cards and RAM of this machine, whatever the catalog entry says of its model's
    sizes = memory.planned(hardware, _host_budget_given(cfg))
    hardware = dataclasses.replace(hardware, **{k: v for k, v in sizes.items() if v is not None})
    if budgets.get("gpu") is None and hardware.gpu_mem_bytes is None:   # the CPU's profile, as bench measures it
        raise ConfigError(f"config 'lazytrain.policy' \"milp\" needs the device's memory budget, which hardware "
                          f"profile {hardware.name!r} does not give (a profile `lazytrain bench tiers` measured "
                          f"without a GPU) and this {device.type} device has no card to read it from: set "
                          f"'lazytrain.gpu_memory' (for the CPU, the memory the plan may hold as the device's)")
    plan = call_with_deadline(plan_for, model_config, hardware, budgets, micro_batch=micro_batch,
                              # the config's batch triple fixes the step: planned with its accumulation
                              global_batch=micro_batch * cfg.gradient_accumulation_steps,
                              seq_len=lt.seq_len, time_limit_s=lt.milp_time_limit,
                              # each solve is stopped when it overruns (solved again, else its start plan
                              # used: planner search.solve); the outer deadline stops what else could hang
                              options=MilpOptions(allow_graph_tail=lt.last_segment_graph is not False,
                                                  require_graph_tail=lt.last_segment_graph is True,
                                                  isolate=True),
                              deadline_s=3 * lt.milp_time_limit + 60, what="the MILP planner")
    if plan.num_layers != num_layers:
        raise ConfigError(f"the planner planned {plan.num_layers} layers but the model streams {num_layers} blocks")
    return plan


def memory_copy_gbps(nbytes: int = 1 << 25, repeats: int = 3) -> float:
    """GB/s of a memory copy on this host (the fastest of a few 32 MiB copies)."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9) / 1e9


def with_cpu_links(hardware):
    """On the CPU the "device" is host memory: a profile's missing host-to-device and device-to-host links
    (``lazytrain bench tiers`` on a machine without a GPU measures none) are a memory copy, measured here, as
    policy "auto" takes them."""
    from ..planner.hardware import load_profile
    profile = load_profile(hardware)
    missing = {name: None for name in ("h2d_gbps", "d2h_gbps") if getattr(profile, name) is None}
    if not missing:
        return profile
    gbps = memory_copy_gbps()
    return dataclasses.replace(profile, **dict.fromkeys(missing, gbps))


def card_memory(device: torch.device) -> int | None:
    """The whole memory of the CUDA card ``device`` (None for another device)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):   # not POSIX: the profile's default stands
        return None


def _host_budget_given(cfg: EngineConfig) -> bool:
    """'lazytrain.host_memory' or 'capacities.host' set (null: unbounded, as not set)."""
    return cfg.lazytrain.capacities.get("host") is not None


def ranks_on_this_node() -> int:
    """The launcher's ranks on this node (torchrun's LOCAL_WORLD_SIZE, DeepSpeed's launcher's LOCAL_SIZE; 1 where
    neither says)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"))


def least_known(values) -> int | None:
    """The smallest of the values that are known (None: unknown, or unbounded), None if none is."""
    known = [v for v in values if v is not None]
    return min(known) if known else None


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """The memory a rank's plan may count on: its card's (None off CUDA), its node's RAM and that RAM's share of
    each of the node's ranks (None where unknown). Every rank runs rank 0's plan, so rank 0 plans with the
    :meth:`least` of each over the ranks: a plan made for rank 0's card alone would overrun a smaller card's."""
    gpu_bytes: int | None
    node_host_bytes: int | None
    host_share_bytes: int | None

    @classmethod
    def of_this_rank(cls, device: torch.device) -> "RankMemory":
        node = _physical_memory()
        return cls(card_memory(device), node, node // ranks_on_this_node() if node else None)

    @classmethod
    def least(cls, memories: list["RankMemory"]) -> "RankMemory":
        return cls(*(least_known(getattr(m, f.name) for m in memories) for f in dataclasses.fields(cls)))

    def planned(self, profile, host_budget_given: bool) -> dict:
        """The machine sizes to plan with, over a hardware profile's (``profile``, a HardwareProfile or None for
        none; the answer's ``gpu_mem_bytes``, ``host_mem_bytes``, None where the profile's stands): the card's
        memory, for a catalog entry's; and, with no host budget configured, no more host memory than this rank's
        share of its node's RAM (a catalog entry's is another machine's, and the node's ranks share the RAM). A
        configured host budget is checked as it was: against the profile's host memory, or without a profile
        the node's RAM."""
        if host_budget_given:
            host = self.node_host_bytes if profile is None else None
        else:
            host = least_known((profile.host_mem_bytes if profile is not None else None, self.host_share_bytes))
        return {"gpu_mem_bytes": self.gpu_bytes, "host_mem_bytes": host}


def plan_from_measurements(cfg: EngineConfig, tiers: dict[str, Tier], profile,
                           from_model: dict[str, float] | None = None, memory: RankMemory | None = None) -> Plan:
    """Policy "auto": the MILP's plan from what was measured here (planner ``plan_from_profile``), in a
    child process with a deadline as for policy "milp". Resident layers are left out (the running engine
    keeps the device copies it started with), selective layers are allowed where their costs were measured;
    links no traced copy used come from 'lazytrain.hardware' when
    given, else a tier whose link was not measured gets no budget. ``memory``: the least over the ranks (by
    default this rank's)."""
    from ..planner.isolate import call_with_deadline
    from ..planner.milp import MilpOptions
    from ..planner.search import plan_from_profile
    lt = cfg.lazytrain
    hardware = lt.hardware if lt.hardware != "auto" else None
    memory = memory or RankMemory.of_this_rank(tiers["hbm"].device)
    budgets = planning_budgets(cfg, tiers, profile.micro_batch, profile.seq_len, from_model, memory)
    if hardware is None and budgets.get("nvme") and "nvme_read_gbps" not in profile.links_gbps:
        warnings.warn("lazytrain: policy \"auto\" measured no NVMe transfer (the calibration plan keeps the "
                      "boundaries on the host) and 'lazytrain.hardware' gives no NVMe bandwidth: the plan keeps no "
                      "boundary on NVMe", UserWarning)
        budgets["nvme"] = 0
    # selective layers only on measured costs (their re-run's share of a forward varies too much to assume), and
    # not where 'auto.selective' is false (a saved profile may hold them)
    options = MilpOptions(allow_resident=False, allow_graph_tail=lt.last_segment_graph is not False,
                          require_graph_tail=lt.last_segment_graph is True,
                          allow_selective=lt.auto.selective and profile.costs.selective_rerun_s is not None,
                          isolate=True)
    # this machine's memory: the card's own (a catalog entry's size, or the profile's 64 GiB default, can be
    # below it, and a budget above the profile's memory is refused), and this rank's share of its RAM
    from ..planner.hardware import load_profile
    sizes = memory.planned(load_profile(hardware) if hardware is not None else None, _host_budget_given(cfg))
    plan = call_with_deadline(plan_from_profile, profile, budgets, hardware, time_limit_s=lt.milp_time_limit,
                              global_batch=profile.micro_batch * cfg.gradient_accumulation_steps, options=options,
                              memory=sizes, as_measured=False, deadline_s=3 * lt.milp_time_limit + 60,
                              what="the MILP planner")
    return dataclasses.replace(plan, policy=f"auto-{plan.policy}")
