"""DeepSpeed's side of tests/test_deepspeed_export.py, run in a process of its own (DeepSpeed's import and
process group leave global state): for each case it loads the checkpoint LazyTrain saved with
``deepspeed.initialize`` on the same model and config, records what DeepSpeed then holds, takes one more
step, converts the directory with ``zero_to_fp32``, and trains the same model itself to save a checkpoint
of its own (the layout to compare with). DeepSpeed runs on the CPU with the gloo backend and torch's
AdamW (``"torch_adam": true``), so nothing is compiled.

Usage: ``python tests/deepspeed_runs.py JOB.json`` (written by the test; a case with a ``ready`` path is
taken once that file exists, so that the process can start while LazyTrain trains), with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (one process per rank), or ``main(JOB.json)`` on spawned
ranks done with LazyTrain's side (DeepSpeed joins their process group); results go to the job's ``out``
file (torch.save), with ``.rank<N>`` appended for ranks other than 0."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_models import MLPBlock  # noqa: E402

VOCAB, D = 32, 16


class Net(nn.Module):
    """Blocks LazyTrain streams, an embedding tied to the head, a frozen parameter, a persistent buffer
    and one that is not, and a one-element parameter."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([MLPBlock(D) for _ in range(3)])
        self.norm = nn.LayerNorm(D)
        self.norm.bias.requires_grad_(False)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        # one element, last: its group's size is no multiple of any alignment, so flat groups end padded
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x) * self.scale.to(x.dtype)) * self.gain.to(x.dtype)


def groups(model: nn.Module) -> list[dict]:
    """Two parameter groups, as scripts make them: no weight decay on norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def batches(n: int = 3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (2, 6), generator=g), torch.randint(0, VOCAB, (2, 6), generator=g))
            for _ in range(n)]


def loss_of(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def deepspeed_config(config: dict) -> dict:
    """The same config for DeepSpeed: without LazyTrain's own section."""
    return {k: v for k, v in config.items() if k != "lazytrain"}


# ---- DeepSpeed's side -----------------------------------------------------------------------------
class CPUFusedAdam(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam (deepspeed/ops/adam/fused_adam.py, which needs CUDA) on the CPU: the same
    settings, state and step counting (the group gets ``step`` 0, each parameter's state an int step, and
    only the group's last parameter's step advances: the kernel reads that one), with torch's arithmetic.
    It stands in for FusedAdam where DeepSpeed builds one (no "torch_adam", no offload), so that its
    layout, and DeepSpeed's FP16_Optimizer around it at stage 0 in 16 bits, are run here."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = 1 if adam_w_mode else 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = 0
            params = [p for p in group["params"] if p.grad is not None]
            state = None
            for p in params:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = group.get("step", 0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            if not params:
                continue
            state["step"] += 1
            t, (b1, b2) = state["step"], group["betas"]
            for p in params:
                st, g = self.state[p], p.grad.float()
                if not self.adam_w_mode:
                    g = g + group["weight_decay"] * p
                st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
                update = (st["exp_avg"] / bc1) / ((st["exp_avg_sq"] / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])


def stand_in_for_fused_adam() -> None:
    import deepspeed.ops.adam
    import deepspeed.runtime.engine
    import deepspeed.runtime.zero.utils
    deepspeed.ops.adam.FusedAdam = CPUFusedAdam
    deepspeed.runtime.engine.FusedAdam = CPUFusedAdam
    deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS.append(CPUFusedAdam)


def _held(engine, with_moments: bool = True) -> tuple[dict, dict, list]:
    """What a DeepSpeed engine holds: fp32 master and moments by parameter name, the optimizer's steps.
    (DeepSpeed's ZeRO 1-2 link the moments to the parameters at the first step: reading them works after
    a load, not after a run of its own, whose link was made before its optimizer had any state.)"""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    masters, moments = {}, {}
    if engine.zero_optimization_stage() > 0:
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):   # ZeRO 1-2 link the moments at the next step
            opt._lazy_init_hp_params_optimizer_state()
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                masters[n] = safe_get_full_fp32_param(p).detach().clone()
                if with_moments:
                    moments[n] = {k: safe_get_full_optimizer_state(p, k).detach().clone()
                                  for k in ("exp_avg", "exp_avg_sq")}
        inner = opt.optimizer
    elif hasattr(opt, "fp32_groups_flat"):   # FP16_Optimizer (stage 0 in bf16/fp16 around FusedAdam)
        inner = opt.optimizer
        for lows, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            offset = 0
            for low in lows:
                n, shape = low.numel(), low.shape
                masters[names[id(low)]] = flat.narrow(0, offset, n).view(shape).clone()
                if with_moments and flat in inner.state:
                    moments[names[id(low)]] = {k: inner.state[flat][k].narrow(0, offset, n).view(shape).clone()
                                               for k in ("exp_avg", "exp_avg_sq")}
                offset += n
    elif hasattr(opt, "fp32_groups"):   # FP16_UnfusedOptimizer (stage 0 in bf16/fp16)
        inner = opt.optimizer
        for lows, highs in zip(opt.fp16_groups, opt.fp32_groups):
            for low, high in zip(lows, highs):
                masters[names[id(low)]] = high.detach().clone()
                moments[names[id(low)]] = {k: inner.state[high][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    else:
        inner = opt
        for n, p in engine.module.named_parameters():
            masters[n] = p.detach().clone()
            if p in opt.state:
                moments[n] = {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    steps = sorted({float(s["step"]) for s in inner.state.values()})
    return masters, moments, steps


def unsupported_here(cfg: dict) -> str | None:
    """Why DeepSpeed cannot run ``cfg`` on this machine, or None: its CPU accelerator refuses fp16 where
    oneDNN has no fp16 kernels for the CPU (an AVX-512 CPU without AVX512-FP16, for one)."""
    from deepspeed.accelerator import get_accelerator
    if cfg.get("fp16", {}).get("enabled") and not get_accelerator().is_fp16_supported():
        return f"DeepSpeed's {get_accelerator().device_name()} accelerator does not support fp16 on this machine"
    return None


def run(case: dict) -> dict:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    cfg = deepspeed_config(case["config"])
    why = unsupported_here(cfg)
    if why:
        return {"unsupported": why}
    data = batches()
    out = {}
    model = Net(seed=1)                                 # other weights than the checkpoint's
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)
    path, client = engine.load_checkpoint(case["dir"])
    out["path"], out["client"] = path, client
    out["masters"], out["moments"], out["steps"] = _held(engine)
    out["global_steps"], out["global_samples"] = engine.global_steps, engine.global_samples
    out["lr_scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    out["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    x, y = data[2]
    engine.backward(loss_of(engine(x), y))
    engine.step()
    out["after_step"], _, _ = _held(engine, with_moments=False)
    if engine.zero_optimization_stage() > 0:
        out["zero_to_fp32"] = {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(case["dir"]).items()}
    engine.destroy()
    model = Net(seed=0)                                 # DeepSpeed's own run of the same training
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)
    for x, y in data[:2]:
        engine.backward(loss_of(engine(x), y))
        engine.step()
    out["own_masters"], _, _ = _held(engine, with_moments=False)
    engine.save_checkpoint(case["own_dir"], client_state={"epoch": 3, "seen": [1, 2]})
    engine.destroy()
    return out


def wait_for(path: str, timeout_s: float = 600.0) -> None:
    """Until ``path`` exists: the test writes it once LazyTrain's side of the case is saved."""
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"LazyTrain's side of the case did not finish within {timeout_s:g} s ({path})")
        time.sleep(0.02)


def main(job_file: str) -> None:
    import deepspeed
    with open(job_file) as f:
        job = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    stand_in_for_fused_adam()
    results = {}
    for name, case in job["cases"].items():
        try:
            if "ready" in case:
                wait_for(case["ready"])
            results[name] = run(case)
        except Exception as e:   # noqa: BLE001 - the test reports it per case
            import traceback
            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    rank = int(os.environ.get("RANK", "0"))
    torch.save(results, job["out"] + (f".rank{rank}" if rank else ""))


if __name__ == "__main__":
    main(sys.argv[1])
