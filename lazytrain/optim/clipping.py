"""Fast gradient clipping: the global norm from per-tensor norms, and the clip coefficient.

The coefficient is not applied here: :class:`~lazytrain.optim.hybrid_adamw.HybridAdamW` multiplies each
gradient by it inside its fused update, so clipping costs one read-only pass over the gradients (the
norms) and no extra write pass. For fp32 gradients the norm and coefficient are computed with the same
operations as :func:`torch.nn.utils.clip_grad_norm_` (``torch._foreach_norm`` per device and dtype, then
the norm of the stacked norms; ``clamp(max_norm / (norm + 1e-6), max=1)``), so they are bit-identical
to it. bf16/fp16 gradients are accumulated in fp32 (``clip_grad_norm_`` accumulates them in their own
dtype).

A streaming engine computes the per-tensor norms layer by layer while the gradients are still hot
(:func:`tensor_norms`), then combines them once (:func:`combine_norms`).
"""
from __future__ import annotations

import math
from typing import Iterable, List, Sequence, Tuple, Union

import torch

__all__ = ["tensor_norms", "combine_norms", "global_grad_norm", "clip_coefficient", "is_finite"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def tensor_norms(tensors: Iterable[torch.Tensor], norm_type: float = 2.0) -> List[torch.Tensor]:
    """Per-tensor norms as 0-dim fp32 tensors, grouped by device and dtype like ``clip_grad_norm_``.

    The list is in group order (order of first appearance of each (device, dtype), then input order),
    which is the order ``clip_grad_norm_`` stacks them in.
    """
    tensors = [t for t in tensors if t is not None]
    norm_type = float(norm_type)
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    norms: List[torch.Tensor] = []
    for (device, dtype), ts in groups.items():
        use_foreach = device.type in ("cpu", "cuda") and all(not t.is_sparse for t in ts)
        if dtype in _LOW_PRECISION:
            if use_foreach:
                norms.extend(torch._foreach_norm(ts, norm_type, dtype=torch.float32))
            else:
                norms.extend(torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in ts)
        elif use_foreach:
            norms.extend(torch._foreach_norm(ts, norm_type))
        else:
            norms.extend(torch.linalg.vector_norm(t, norm_type) for t in ts)
    return [n.float() if n.dtype != torch.float32 and n.dtype != torch.float64 else n for n in norms]


def combine_norms(norms: Sequence[Union[torch.Tensor, float]], norm_type: float = 2.0,
                  device: Union[str, torch.device, None] = None) -> Tuple[torch.Tensor, bool]:
    """Global norm from per-tensor (or per-layer) norms: ``(norm as a 0-dim tensor, finite)``."""
    norm_type = float(norm_type)
    if len(norms) == 0:
        return torch.tensor(0.0), True
    first = next((n for n in norms if isinstance(n, torch.Tensor)), None)
    dev = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
    stacked = torch.stack([n.to(dev) if isinstance(n, torch.Tensor) else torch.tensor(float(n), device=dev)
                           for n in norms])
    total = torch.linalg.vector_norm(stacked, norm_type)
    return total, is_finite(total)


def global_grad_norm(tensors: Iterable[torch.Tensor], norm_type: float = 2.0) -> Tuple[torch.Tensor, bool]:
    """Norm of all ``tensors`` viewed as one vector, and whether it is finite (one pass, no copies)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return torch.tensor(0.0), True
    return combine_norms(tensor_norms(tensors, norm_type), norm_type, device=tensors[0].device)


def clip_coefficient(total_norm: Union[torch.Tensor, float], max_norm: float) -> torch.Tensor:
    """``min(max_norm / (total_norm + 1e-6), 1)`` in fp32, exactly as ``clip_grad_norm_`` computes it."""
    if not isinstance(total_norm, torch.Tensor):
        total_norm = torch.tensor(float(total_norm), dtype=torch.float32)
    clip_coef = float(max_norm) / (total_norm + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


def is_finite(x: Union[torch.Tensor, float]) -> bool:
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x).all())
    return math.isfinite(float(x))
