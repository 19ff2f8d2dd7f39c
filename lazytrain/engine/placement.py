"""Where things live: the compute device, the storage tiers, and the Plan the executor runs."""
from __future__ import annotations

import torch

from ..config import ConfigError, EngineConfig
from ..planner.plan import Plan, PlanError, every_k_plan, keep_all_plan
from ..tiers import Tier


def resolve_device(cfg: EngineConfig, local_rank: int) -> torch.device:
    name = cfg.lazytrain.device
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
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
    aio = {"block_size": cfg.aio.block_size, "queue_depth": cfg.aio.queue_depth,
           "intra_op_parallelism": cfg.aio.intra_op_parallelism}
    return create_tiers(list(lt.tiers), device, nvme_path=lt.nvme_path, aio=aio if lt.nvme_path else None,
                        capacities=lt.capacities)


def build_plan(cfg: EngineConfig, num_layers: int, tiers: dict[str, Tier], model_config: dict | None,
               micro_batch: int) -> Plan:
    lt = cfg.lazytrain
    home = lt.boundary_home
    if home not in tiers:
        raise ConfigError(f"config 'lazytrain.boundary_home' is {home!r}, which is not a configured tier "
                          f"(configured: {', '.join(tiers)})")
    resident = tuple(range(num_layers)) if lt.weights_home == "hbm" else ()
    if lt.policy == "every_k":
        k = cfg.interval_for(num_layers)
        return every_k_plan(num_layers, k, home=home, resident_layers=resident, policy=f"megatrain-k{k}-{home}")
    if lt.policy == "keep_all":
        return keep_all_plan(num_layers, home=home, resident_layers=resident)
    if lt.policy == "plan":
        try:
            plan = Plan.from_json(lt.plan_path)
            plan.validate(custom_tiers=tuple(tiers))
        except (OSError, PlanError) as e:
            raise ConfigError(f"config 'lazytrain.plan' ({lt.plan_path}): {e}") from e
        if plan.num_layers != num_layers:
            raise ConfigError(f"config 'lazytrain.plan' ({lt.plan_path}) is for {plan.num_layers} layers, but the "
                              f"model has {num_layers} blocks")
        return plan
    if lt.policy == "milp":
        try:
            from ..planner import plan_for_engine
        except ImportError as e:
            raise ConfigError(f"config 'lazytrain.policy' \"milp\" needs the planner: {e}") from e
        return plan_for_engine(cfg, num_layers, tiers, model_config, micro_batch)
    raise ConfigError(f"config 'lazytrain.policy' {lt.policy!r} is unknown")
