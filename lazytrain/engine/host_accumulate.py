"""Adding a gradient that arrives in the compute dtype into an fp32 host buffer, fast.

``fp32.add_(bf16)`` on the CPU casts the whole right-hand side into a fresh fp32 temporary first (a layer's
worth of memory allocated and page-faulted on every add: 76 ms for a 51M-parameter layer on two cores, where
converting a piece at a time into a reused scratch and adding it takes 11 ms, bit for bit the same sums).
The gradient sinks add every layer's gradient of every micro-batch this way, on the thread the backward
waits for at its end, and take the buffer's sum of squares while each piece is in cache: the step's gradient
norm then needs no pass over the host gradients of its own (:func:`sum_of_squares` gives the same value for a
buffer whose sum was not taken so, piece for piece).

Where LazyTrain's compiled host kernels load (lazytrain/optim/kernels) both are one pass of theirs over the
buffer (the add and the squares together, each row one thread's: 0.54x the time of torch's ops on two cores),
else torch's ops a piece at a time. For a contiguous fp32 host buffer and a host gradient in fp32, bf16 or
fp16 (every sink's) both values take the same way, so they agree bit for bit."""
from __future__ import annotations

import torch

from lazytrain.optim.kernels import CpuKernels, cpu_kernels

PIECE = 1 << 20   # elements: 4 MiB of fp32, in cache while it is converted and added
ROW = 1 << 14     # elements a thread sums alone (half ATen's grain: a reduction never splits it)


def scratch_for(numel: int) -> torch.Tensor:
    """The reusable fp32 scratch :func:`add_into` needs for gradients of up to ``numel`` elements; the compiled
    kernels are built now, at set-up (seconds, once), not in the first backward while other ranks wait."""
    cpu_kernels()
    return torch.empty(min(PIECE, max(1, numel)), dtype=torch.float32)


def add_into(dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor, square_sum: bool = False,
             dst_is_zero: bool = False) -> float | None:
    """``dst += src`` for a flat fp32 ``dst`` and a flat ``src`` of any floating dtype, through ``scratch``
    (one caller at a time: it is overwritten). With ``square_sum``, returns ``sum_of_squares(dst)`` after the
    add, bit for bit, taken a piece at a time as the pieces are added (scratch must then be a whole piece,
    or hold all of ``dst``: the pieces are sum_of_squares'). ``dst_is_zero``: the caller knows every element
    of ``dst`` is zero (a micro-batch's first gradient after the step cleared the buffer), so the compiled pass
    writes ``0 + src`` without reading ``dst`` (the same bits as the add); torch's pieces add as always."""
    if src.numel() != dst.numel():   # the pieces would add into a part of dst, where add_ broadcasts or raises
        raise ValueError(f"add_into: a gradient of {src.numel()} elements into a buffer of {dst.numel()}")
    if src.dtype == dst.dtype and not square_sum:
        dst.add_(src)
        return None
    size = scratch.numel()
    if square_sum and size != PIECE and dst.numel() > min(size, PIECE):
        raise ValueError(f"add_into: a scratch of {size} elements cuts a buffer of {dst.numel()} into other pieces "
                         f"than sum_of_squares' ({PIECE})")
    kernels = _kernels_for(dst)
    if kernels is not None and src.device.type == "cpu" and src.dtype in _KERNEL_DTYPES and \
            src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr():   # else torch's checks
        total = kernels.add_square_sum(dst, src.resolve_neg().contiguous(), ROW, square_sum, from_zero=dst_is_zero)
        torch.autograd.graph.increment_version(dst)   # written past autograd's counter, which readers trust
        return total if square_sum else None
    if kernels is not None:   # the add torch's way; the square sum as sum_of_squares takes it, bit for bit
        _add_in_pieces(dst, src, scratch)
        return kernels.add_square_sum(dst, None, ROW, True) if square_sum else None
    return _add_in_pieces(dst, src, scratch, square_sum)


def _add_in_pieces(dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor, square_sum: bool = False):
    """torch's ops a piece at a time (and, with ``square_sum``, the pieces' sums as sum_of_squares takes them
    without the compiled kernels)."""
    size = scratch.numel()
    total = 0.0
    for start in range(0, src.numel(), size):
        end = min(src.numel(), start + size)
        piece = scratch[:end - start]
        part = dst[start:end]
        if src.dtype == dst.dtype:
            part.add_(src[start:end])
        else:
            piece.copy_(src[start:end])
            part.add_(piece)
        if square_sum:
            total += _piece_square_sum(part, piece)
    return total if square_sum else None


def sum_of_squares(t: torch.Tensor, scratch: torch.Tensor | None = None) -> float:
    """The sum of the squares of flat fp32 ``t``, a piece of ``PIECE`` elements at a time, the same on every
    thread and at every thread count (where BLAS's dot, and ATen's sum of a whole piece, are not: they split
    the work by threads): each row of ``ROW`` squares summed in fp32 by one thread, the rows' sums in fp64,
    the pieces' in a Python float."""
    kernels = _kernels_for(t)
    if kernels is not None:
        return kernels.add_square_sum(t, None, ROW, True)
    if scratch is None:
        scratch = torch.empty(min(PIECE, max(1, t.numel())), dtype=torch.float32)
    total = 0.0
    for start in range(0, t.numel(), PIECE):
        part = t[start:start + PIECE]
        total += _piece_square_sum(part, scratch[:part.numel()])
    return total


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels_for(dst: torch.Tensor) -> CpuKernels | None:
    """The compiled kernels, for a contiguous fp32 host buffer (what the sinks add into); else None."""
    if dst.device.type != "cpu" or dst.dtype != torch.float32 or not dst.is_contiguous():
        return None
    return cpu_kernels()


def _piece_square_sum(part: torch.Tensor, out: torch.Tensor) -> float:
    squares = torch.mul(part, part, out=out)
    full = squares.numel() // ROW * ROW
    total = float(squares[:full].view(-1, ROW).sum(dim=1).double().sum()) if full else 0.0
    if full < squares.numel():   # under ATen's grain: summed by one thread
        total += float(squares[full:].double().sum())
    return total
