"""Mixed precision: fp32 masters for the device-resident (non-block) parameters, and fp16 loss scaling.

Block parameters need no extra care here: their ``nn.Parameter`` objects already *are* fp32 masters
on the host (see weights.py), and only their streamed compute copies are bf16/fp16.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class DeviceMasters:
    """bf16/fp16 training: non-block parameters run in the compute dtype on the device while the
    optimizer updates fp32 master copies; grads are copied up before, weights copied down after."""

    def __init__(self, params: list[nn.Parameter], compute_dtype: torch.dtype):
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for p in params:
            master = nn.Parameter(p.detach().to(torch.float32).clone(), requires_grad=p.requires_grad)
            p.data = p.data.to(compute_dtype)
            self.pairs.append((p, master))
        self.by_param = {id(p): m for p, m in self.pairs}

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        return self.by_param.get(id(p), p)

    def grads_to_masters(self) -> None:
        for p, m in self.pairs:
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.detach().to(torch.float32)
            else:
                m.grad.copy_(p.grad)

    def masters_to_params(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)

    def zero_grad(self) -> None:
        for p, m in self.pairs:
            p.grad = None
            m.grad = None


class LossScaler:
    """fp16 loss scale: static (``loss_scale`` > 0) or dynamic with DeepSpeed's window and hysteresis."""

    def __init__(self, static_scale: float = 0.0, initial_scale_power: int = 16, scale_window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, min_scale: float = 1.0):
        self.dynamic = static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.scale_window, self.hysteresis, self.min_scale = scale_window, hysteresis, min_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_hysteresis = hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)
