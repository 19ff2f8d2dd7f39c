"""Block weights: fp32 master + compute-dtype copy in one flat host buffer per layer, streamed to the
device through two device buffers (double buffering), plus the host gradient buffers.

The user's block ``nn.Parameter`` objects become views into the fp32 master buffer, so
``model.parameters()``, ``state_dict()`` and any optimizer built over them see the real master weights;
their ``.grad`` are views into one fp32 flat gradient buffer per layer.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..tiers import Tier, TransferHandle, empty_host
from ..tiers.memory import async_copy
from .layer_updates import LayerUpdates


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: torch.Size
    offset: int
    numel: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's view in a layer's flat buffer (weights, gradients or a compute copy)."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


def _layout(block: nn.Module) -> list[ParamSlot]:
    """Where each of a block's parameters sits in its layer's flat buffers, in ``named_parameters`` order."""
    slots, offset = [], 0
    for name, p in block.named_parameters():
        slots.append(ParamSlot(name, p.shape, offset, p.numel()))
        offset += p.numel()
    return slots


class LayerWeights:
    """Host-side storage of every streamed layer and the device buffers they stream through."""

    def __init__(self, blocks: nn.ModuleList, compute_dtype: torch.dtype, device: torch.device,
                 weights_tier: Tier, device_tier: Tier, resident_layers: tuple[int, ...] = ()):
        self.blocks = blocks
        self.num_layers = len(blocks)
        self.compute_dtype = compute_dtype
        self.device = device
        self.weights_tier = weights_tier
        self.device_tier = device_tier
        # each layer's parameter layout in its flat buffers; layers may differ (a dense first layer before
        # mixture-of-experts ones, sliding and global attention with different head sizes)
        self.layer_slots: list[list[ParamSlot]] = [_layout(block) for block in blocks]
        self.layer_numels = [sum(s.numel for s in slots) for slots in self.layer_slots]
        self.max_layer_numel = max(self.layer_numels)
        # which parameters train, per layer (a user may freeze some layers or some tensors)
        self.trainable = [[p.requires_grad for _, p in block.named_parameters()] for block in blocks]
        self.any_trainable = any(any(t) for t in self.trainable)
        self.master: list[torch.Tensor] = []
        self.grad: list[torch.Tensor] = []
        self.params: list[list[nn.Parameter]] = []
        for block, slots, numel in zip(blocks, self.layer_slots, self.layer_numels):
            master = empty_host(numel, torch.float32)
            grad = empty_host(numel, torch.float32).zero_()
            params = [p for _, p in block.named_parameters()]
            for slot, p in zip(slots, params):
                slot.of(master).copy_(p.detach())
                p.data = slot.of(master)
                if p.requires_grad:
                    p.grad = slot.of(grad)
            # buffers (e.g. rotary inv_freq) stay on the compute device
            for bname, buf in list(block.named_buffers()):
                mod_name, _, attr = bname.rpartition(".")
                owner = block.get_submodule(mod_name) if mod_name else block
                owner._buffers[attr] = buf.to(device)
            self.master.append(master)
            self.grad.append(grad)
            self.params.append(params)
        self.shares_master = compute_dtype == torch.float32 and weights_tier.kind == "host"
        self._staging: torch.Tensor | None = None
        for i in range(self.num_layers):
            self._store_compute_copy(i)
        # device buffers: two streaming slots + one per resident layer
        self.resident = {}
        for i in resident_layers:
            buf = torch.empty(self.layer_numels[i], dtype=compute_dtype, device=device)
            self.device_tier.write(f"weights.resident{i}", buf, owned=True)
            self._fetch_into(i, buf).synchronize()
            self.resident[i] = buf
        self.stream_slots = []
        if len(self.resident) < self.num_layers:
            for s in range(2):   # sized for the largest layer; a smaller one uses the front
                buf = torch.empty(self.max_layer_numel, dtype=compute_dtype, device=device)
                self.device_tier.write(f"weights.slot{s}", buf, owned=True)
                self.stream_slots.append(buf)
        self._grad_sink = _GradientSink(self) if device.type == "cuda" else None
        # With the CPU as compute device and the weights already in host memory in the compute dtype,
        # a "copy to the device" would copy memory onto itself: hand out the stored buffer instead.
        self.zero_copy = device.type == "cpu" and weights_tier.kind == "host"
        # set by the engine when the optimizer updates layers on another thread (layer_updates.py)
        self.updates: LayerUpdates | None = None

    # ---- readiness after an overlapped optimizer step ------------------------------------------
    def update_pending(self, i: int) -> bool:
        """Layer i's optimizer update is still running: its weights must not be read yet."""
        return self.updates is not None and self.updates.pending(i)

    def wait_updated(self, i: int) -> None:
        if self.updates is not None:
            self.updates.wait(i)

    # ---- compute copy ----------------------------------------------------------------------
    def _key(self, i: int) -> str:
        return f"weights.layer{i}"

    def _store_compute_copy(self, i: int) -> None:
        if self.shares_master:
            if self._key(i) not in self.weights_tier:
                self.weights_tier.write(self._key(i), self.master[i], owned=True)
            return
        if self.weights_tier.kind == "host" and self._key(i) in self.weights_tier:
            self.weights_tier.read(self._key(i)).wait().copy_(self.master[i])   # in place, same buffer
            return
        if self._staging is None:   # one staging buffer, reused: each write completes before the next
            self._staging = empty_host(self.max_layer_numel, self.compute_dtype)
        staging = self._staging[:self.layer_numels[i]]
        staging.copy_(self.master[i])
        self.weights_tier.write(self._key(i), staging).synchronize()

    def refresh_compute_copy(self, i: int, host_copy_current: bool = False) -> None:
        """After the optimizer updated layer i's master weights: rewrite the compute-dtype copy (unless
        the optimizer already wrote it in its update pass) and the resident device copy."""
        if not host_copy_current:
            self._store_compute_copy(i)
        if i in self.resident:
            self._fetch_into(i, self.resident[i]).synchronize()

    def refresh_all_compute_copies(self) -> None:
        """After the masters were written from outside an optimizer step (a checkpoint load)."""
        for i in range(self.num_layers):
            self.refresh_compute_copy(i)

    def compute_copy_views(self) -> dict[torch.Tensor, torch.Tensor] | None:
        """{block parameter: its view in the host compute-dtype copy}, for an optimizer that writes the
        copy in its update pass; None when the copy is not a separate buffer in host memory."""
        if self.shares_master or self.weights_tier.kind != "host":
            return None
        views = {}
        for i in range(self.num_layers):
            flat = self.weights_tier.read(self._key(i)).wait()
            for s, p in zip(self.layer_slots[i], self.params[i]):
                views[p] = s.of(flat)
        return views

    # ---- streaming -------------------------------------------------------------------------
    def _fetch_into(self, i: int, buf: torch.Tensor) -> TransferHandle:
        return self.weights_tier.read(self._key(i), out=buf)

    def fetch(self, i: int, slot: int) -> TransferHandle:
        """Start copying layer i's compute weights into streaming slot ``slot``."""
        if i in self.resident:
            return TransferHandle(value=self.resident[i])
        if self.zero_copy:
            return self.weights_tier.read(self._key(i))
        return self._fetch_into(i, self.stream_slots[slot][:self.layer_numels[i]])

    def views(self, flat: torch.Tensor, layer: int, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """Name -> tensor views of layer ``layer``'s weights in a flat device buffer, to swap into the
        block for one call; with ``requires_grad``, its trainable parameters become leaves that require
        grad (for backward)."""
        out = {}
        for k, s in enumerate(self.layer_slots[layer]):
            t = s.of(flat)
            if requires_grad and self.trainable[layer][k]:
                t = t.detach().requires_grad_(True)
            out[s.name] = t
        return out

    # ---- gradients -------------------------------------------------------------------------
    def accumulate_grads(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        """Add a layer's weight gradients (device, compute dtype) into its fp32 host buffer."""
        if self._grad_sink is not None:
            self._grad_sink.submit(i, grads)
            return
        flat = self.grad[i]
        for s in self.layer_slots[i]:
            g = grads.get(s.name)
            if g is not None:
                s.of(flat).add_(g)

    def flush_grads(self) -> None:
        if self._grad_sink is not None:
            self._grad_sink.flush()

    def grad_views(self, i: int) -> dict[nn.Parameter, torch.Tensor]:
        """{trainable parameter of layer i: its view in the layer's flat fp32 gradient buffer}."""
        return {p: s.of(self.grad[i]) for s, p, trains in zip(self.layer_slots[i], self.params[i],
                                                              self.trainable[i]) if trains}

    def attach_grads(self, i: int | None = None) -> None:
        """Make every trainable block parameter's ``.grad`` (of layer ``i``, or all) the view into its flat
        buffer again (an optimizer's ``zero_grad(set_to_none=True)`` may have cleared it)."""
        for j in range(self.num_layers) if i is None else (i,):
            for p, view in self.grad_views(j).items():
                p.grad = view

    def zero_grads(self) -> None:
        for i in range(self.num_layers):
            self.zero_layer_grads(i)

    def zero_layer_grads(self, i: int) -> None:
        self.grad[i].zero_()
        self.attach_grads(i)


class _GradientSink:
    """On CUDA: flatten a layer's gradients on the device, copy them to pinned host memory on the D2H
    stream, and add them into the fp32 buffer on a host thread, so the compute stream never waits."""

    def __init__(self, weights: LayerWeights, depth: int = 2):
        self.weights = weights
        self.staging = [empty_host(weights.max_layer_numel, weights.compute_dtype) for _ in range(depth)]
        self.busy: list[Future | None] = [None] * depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-grad")
        self.next = 0

    def submit(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        w = self.weights
        numel = w.layer_numels[i]
        flat = torch.empty(numel, dtype=w.compute_dtype, device=w.device)
        for s in w.layer_slots[i]:
            g = grads.get(s.name)
            part = s.of(flat)
            part.copy_(g) if g is not None else part.zero_()
        k = self.next
        self.next = (k + 1) % len(self.staging)
        if self.busy[k] is not None:
            self.busy[k].result()
        staging, target = self.staging[k][:numel], w.grad[i]
        handle = async_copy(staging, flat)

        def add():
            handle.synchronize()
            target.add_(staging)
        self.busy[k] = self.pool.submit(add)

    def flush(self) -> None:
        for k, f in enumerate(self.busy):
            if f is not None:
                f.result()
                self.busy[k] = None
