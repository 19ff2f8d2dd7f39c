"""Adding a gradient that arrives in the compute dtype into an fp32 host buffer, fast.

``fp32.add_(bf16)`` on the CPU casts the whole right-hand side into a fresh fp32 temporary first (a layer's
worth of memory allocated and page-faulted on every add: 76 ms for a 51M-parameter layer on two cores, where
converting a piece at a time into a reused scratch and adding it takes 11 ms, bit for bit the same sums).
The gradient sinks add every layer's gradient of every micro-batch this way, on the thread the backward
waits for at its end."""
from __future__ import annotations

import torch

PIECE = 1 << 20   # elements: 4 MiB of fp32, in cache while it is converted and added


def scratch_for(numel: int) -> torch.Tensor:
    """The reusable fp32 scratch :func:`add_into` needs for gradients of up to ``numel`` elements."""
    return torch.empty(min(PIECE, max(1, numel)), dtype=torch.float32)


def add_into(dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor) -> None:
    """``dst += src`` for a flat fp32 ``dst`` and a flat ``src`` of any floating dtype, through ``scratch``
    (one caller at a time: it is overwritten)."""
    if src.numel() != dst.numel():   # the pieces would add into a part of dst, where add_ broadcasts or raises
        raise ValueError(f"add_into: a gradient of {src.numel()} elements into a buffer of {dst.numel()}")
    if src.dtype == dst.dtype:
        dst.add_(src)
        return
    size = scratch.numel()
    for start in range(0, src.numel(), size):
        end = min(src.numel(), start + size)
        piece = scratch[:end - start]
        piece.copy_(src[start:end])
        dst[start:end].add_(piece)
