"""fp32 masters for the non-block parameters (in bf16/fp16 training, or kept on the host), and fp16 loss scaling.

Block parameters need no extra care here: their ``nn.Parameter`` objects already *are* fp32 master views
on the host (see weights.py), and only their streamed compute copies are bf16/fp16.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


class Masters:
    """Non-block parameters run on the device, in the compute dtype, while the optimizer updates fp32
    masters kept at ``home``: beside them on the device (bf16/fp16 training of a streamed model), or on the
    host (a model with nothing to stream on a GPU: its optimizer runs on the host, as the blocks' does).
    Each gradient is added into its master's fp32 ``.grad`` as soon as autograd produces it (so accumulation
    over micro-batches happens in fp32, as the blocks' does), and the weights are copied down after the
    update."""

    def __init__(self, params: list[nn.Parameter], compute_dtype: torch.dtype, home: torch.device | None = None):
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._hooks = {}
        self.elsewhere: set[int] = set()   # ids of parameters whose master another rank holds (partitioned_params.py)
        for p in params:
            where = p.device if home is None else home
            if compute_dtype == torch.float32 and where == p.device:   # stage 3 in fp32: the parameter is its master
                master = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            else:
                master = nn.Parameter(p.detach().to(where, torch.float32, copy=True), requires_grad=p.requires_grad)
                p.data = p.data.to(compute_dtype)
            if p.requires_grad:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(_into_master(master))
            self.pairs.append((p, master))
        self.by_param = {id(p): m for p, m in self.pairs}

    def remove_grad_hook(self, p: nn.Parameter) -> None:
        """``p``'s gradient goes elsewhere (partitioned_params.py reduces it to the master's owner)."""
        handle = self._hooks.pop(id(p), None)
        if handle is not None:
            handle.remove()

    def hand_back(self) -> None:
        """The model as it was given: its parameters in fp32 again (the masters' values, where the parameters
        live) and keeping their own ``.grad`` (after ``destroy()``, or a set-up that failed)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        with torch.no_grad():
            for p, m in self.pairs:
                if id(p) not in self.elsewhere:
                    p.data = m.data.to(p.device)

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        return self.by_param.get(id(p), p)

    def master_params(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def master_grads(self) -> list[torch.Tensor]:
        return [m.grad for _, m in self.pairs if m.grad is not None]

    @contextlib.contextmanager
    def params_showing_masters(self):
        """Meanwhile each parameter's storage is its fp32 master, so what code writes into the parameters
        lands in the masters at full precision; then the compute-dtype copies are refreshed from them."""
        here = [(p, m) for p, m in self.pairs if id(p) not in self.elsewhere]
        shown = [(p, p.data) for p, _ in here]
        for p, m in here:
            p.data = m.data
        try:
            yield
        finally:
            for p, data in shown:
                p.data = data
            self.masters_to_params()

    def masters_to_params(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                if id(p) not in self.elsewhere and p.data_ptr() != m.data_ptr():
                    p.copy_(m)

    def zero_grad(self) -> None:
        """No gradient at all, not a zero one: a parameter that gets none in the next step is skipped by
        the optimizer (no weight decay, no momentum), as in fp32 training and plain PyTorch."""
        for p, m in self.pairs:
            p.grad = None
            m.grad = None


def _into_master(master: nn.Parameter):
    def hook(p: torch.Tensor) -> None:
        # a host master: the copy waits for it, in the compute dtype (converted on the host, so that no fp32
        # copy of a large embedding's gradient is made on the device)
        grad = p.grad.detach().to(master.device)
        if master.grad is None:
            master.grad = grad.to(torch.float32)   # p.grad is dropped below: sharing its storage is safe
        else:
            master.grad.add_(grad)
        p.grad = None
    return hook


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
