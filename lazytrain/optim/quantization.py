"""Blockwise 8-bit dynamic quantization in the bitsandbytes layout, with an exact table-driven encoder.

Format (identical to ``bitsandbytes.functional.quantize_blockwise``): a tensor of ``n`` values is cut into
blocks of ``block_size`` consecutive elements (the last block may be shorter); each block stores its
absolute maximum as fp32 (``absmax[b]``) and each element one uint8 code into a 256-entry quantization
map (``values``). Decoding is ``values[code] * absmax[block]``.

Encoding picks, for ``x = a * (1 / absmax)`` (values beyond [-1, 1] count as +-1), the *nearest* map
value (ties go to the lower value). A binary search per element is slow, so the encoder uses a lookup
table indexed by the high bits of the fp32 representation of ``x``: the sign, the exponent and the
leading ``MANT_BITS`` mantissa bits select a bucket of floats; the dynamic map is coarse enough that at
most one decision boundary (the midpoint between two neighbouring map values) falls inside any bucket, so
each table entry stores the code at the bucket's start, the code after the boundary and the low 15
mantissa bits at which it is crossed. One table load and one integer compare per element give the exact
nearest code (checked against :func:`nearest_code_reference` in the tests). The same table drives the
C++ kernel and the torch code path here, so both produce identical codes.

Second moments use the unsigned map with one deliberate exception to "nearest": a positive value never
encodes to 0 (see :class:`QuantMap`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
import torch

__all__ = [
    "QuantMap",
    "create_dynamic_map",
    "get_qmap",
    "build_encoder_table",
    "nearest_code_reference",
    "encode",
    "quantize_blockwise",
    "dequantize_blockwise",
    "num_blocks",
    "MANT_BITS",
]

#: Leading mantissa bits that index the encoder table (together with sign and exponent).
MANT_BITS = 8
_SHIFT = 23 - MANT_BITS
_LOW_MASK = (1 << _SHIFT) - 1


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic quantization map (Dettmers, "8-bit approximations for parallelism in deep learning").

    Each decade ``10**(i - max_exponent_bits + 1)``, ``i = 0..max_exponent_bits-1``, holds a linear
    fraction grid whose resolution doubles with ``i``; 0 and 1.0 are added and the result is sorted.
    Produces the same fp32 values as ``bitsandbytes.functional.create_dynamic_map`` (checked in the tests),
    so codes are interchangeable with bitsandbytes.
    """
    non_sign_bits = total_bits - 1
    values: list = []
    last_decade = 0
    for i in range(max_exponent_bits):
        extra = 0 if signed else 1
        n_bounds = int(2 ** (i + non_sign_bits - max_exponent_bits + extra) + 1)
        bounds = torch.linspace(0.1, 1, n_bounds, dtype=torch.float32)
        mids = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        values += (scale * mids).tolist()
        if signed:
            values += (-scale * mids).tolist()
        last_decade = i
    # Codes left over when not every bit pattern is needed for exponents (fewer exponent bits).
    leftover = 2 ** (non_sign_bits - max_exponent_bits) - 1
    if leftover > 0:
        bounds = torch.linspace(0.1, 1, leftover + 1, dtype=torch.float32)
        mids = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + last_decade)
        values += (scale * mids).tolist()
        if signed:
            values += (-scale * mids).tolist()
    values += [0.0, 1.0]
    if len(values) != 2 ** total_bits:
        raise ValueError(f"dynamic map has {len(values)} values, expected {2 ** total_bits}")
    values += [0.0] * (256 - len(values))
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


def _f32_from_bits(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def nearest_code_reference(x, values, positive_floor: int = 0) -> np.ndarray:
    """Exact nearest-code encoder (the definition the fast encoder must match).

    ``x``: fp32 values (array-like or tensor), already normalised. ``values``: sorted fp32 map.
    Distances are compared in float64, which is exact for differences of nearby fp32 numbers; ties go
    to the lower code. ``positive_floor``: the smallest code a positive nonzero value may get (0: no
    floor). Returns int64 codes.
    """
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().float().numpy()
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().float().numpy()
    x = np.asarray(x, dtype=np.float32).astype(np.float64).ravel()
    code = np.asarray(values, dtype=np.float32).astype(np.float64)
    j = np.searchsorted(code, x, side="left")
    j = np.clip(j, 1, len(code) - 1)
    lo, hi = j - 1, j
    d_lo = np.abs(x - code[lo])
    d_hi = np.abs(code[hi] - x)
    out = np.where(d_hi < d_lo, hi, lo)
    # x below the smallest or above the largest value
    out = np.where(x <= code[0], 0, out)
    out = np.where(x >= code[-1], len(code) - 1, out)
    # the lowest index among equal map values (padding zeros)
    first_index = np.searchsorted(code, code, side="left")
    out = first_index[out].astype(np.int64)
    if positive_floor:
        out = np.where((x > 0) & (out < positive_floor), positive_floor, out)
    return out


@dataclass(frozen=True)
class EncoderTable:
    """Lookup table for :func:`encode`.

    ``raw = (bits >> 15) & 0xffff`` is the exponent and leading 8 mantissa bits of ``x``;
    ``k = min(max(raw - base, 0), kmax)``; the entry is ``entries[k]`` for ``x >= 0`` and
    ``entries[k + half]`` for negative ``x`` (signed maps; unsigned maps encode ``|x|``).
    ``entry = code_lo | code_hi << 8 | thr << 16``: the code is ``code_hi`` if the low 15 bits of ``x``
    exceed ``thr``, else ``code_lo``. With ``base > 0``, bucket 0 holds every ``|x| < 2**(emin - 127)``.
    """

    entries: np.ndarray  # int32
    base: int
    kmax: int
    half: int  # 0 for unsigned tables
    emin: int


def build_encoder_table(values, positive_floor: int = 0, signed: bool = True) -> EncoderTable:
    """Build the exact table-driven encoder for a sorted 256-entry map (see module docstring).

    ``signed=False`` builds a table for non-negative inputs only, covering every exponent down to 0 so
    that ``positive_floor`` is exact even for denormals.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().float().numpy()
    values = np.asarray(values, dtype=np.float32)
    if values.shape != (256,) or np.any(np.diff(values.astype(np.float64)) < 0):
        raise ValueError("quantization map must hold 256 values sorted ascending")
    if values.min() < -1.0 or values.max() > 1.0:
        raise ValueError("quantization map values must lie in [-1, 1]")

    def codes_of(abs_bits: np.ndarray, negative: bool) -> np.ndarray:
        bits = abs_bits.astype(np.uint32) | (np.uint32(0x80000000) if negative else np.uint32(0))
        return nearest_code_reference(_f32_from_bits(bits), values, positive_floor)

    signs = (False, True) if signed else (False,)
    if signed:
        # Largest exponent e such that every |x| < 2**(e-127) has the same code as 0, for both signs.
        emin = None
        for e in range(127, 0, -1):
            top = np.array([(e << 23) - 1], dtype=np.uint32)
            zero = np.array([0], dtype=np.uint32)
            if all(codes_of(zero, neg)[0] == codes_of(top, neg)[0] for neg in signs):
                emin = e
                break
        if emin is None:
            raise ValueError("quantization map has no single code around zero")
        base = (emin << (23 - _SHIFT)) - 1
        first_k = 1  # k = 0 is the bucket of tiny values
    else:
        emin, base, first_k = 0, 0, 0
    kmax = (0x3F800000 >> _SHIFT) - base  # bucket of |x| == 1.0 (and anything larger)
    half = kmax + 1
    entries = np.empty(len(signs) * half, dtype=np.int64)
    k = np.arange(first_k, half, dtype=np.int64)
    start = ((k + base) << _SHIFT).astype(np.uint32)
    for neg in signs:
        off = half if neg else 0
        if first_k:
            zero_code = codes_of(np.array([0], dtype=np.uint32), neg)[0]
            entries[off] = zero_code | (zero_code << 8) | (_LOW_MASK << 16)
        first = codes_of(start, neg)
        last = codes_of(start + np.uint32(_LOW_MASK), neg)
        step = -1 if neg else 1
        if np.any((last != first) & (last != first + step)):
            raise ValueError(
                f"quantization map is too fine for a {MANT_BITS}-bit-mantissa table "
                "(more than one code boundary in a bucket)")
        # binary search: largest low in [0, LOW_MASK] whose code equals `first`
        lo = np.zeros_like(k)
        hi = np.full_like(k, _LOW_MASK)
        for _ in range(_SHIFT + 1):
            mid = (lo + hi + 1) // 2
            same = codes_of(start + mid.astype(np.uint32), neg) == first
            lo = np.where(same, mid, lo)
            hi = np.where(same, hi, mid - 1)
        code_hi = np.where(last != first, last, first)
        entries[off + first_k: off + half] = first | (code_hi << 8) | (lo << 16)
    return EncoderTable(entries=entries.astype(np.int32), base=int(base), kmax=int(kmax),
                        half=int(half) if signed else 0, emin=int(emin))


@dataclass(frozen=True)
class QuantMap:
    """A 256-entry quantization map plus its encoder table, ready for the kernels.

    ``positive_floor`` is the smallest code a positive nonzero value may encode to (0: plain nearest).
    The unsigned map used for Adam's second moment sets it to the smallest positive code: a second
    moment that is small but nonzero must not decode to 0, which would shrink the Adam denominator to
    ``eps`` and turn a tiny first moment into a huge step.
    """

    name: str
    values: torch.Tensor  # fp32 [256], sorted
    table: torch.Tensor  # int32 encoder table (see EncoderTable)
    base: int
    kmax: int
    half: int
    signed: bool
    positive_floor: int = 0

    @property
    def zero_code(self) -> int:
        return int(nearest_code_reference(np.zeros(1, np.float32), self.values)[0])

    def reference(self, x) -> np.ndarray:
        """Exact codes for normalised ``x`` under this map's rule (nearest, with the positive floor)."""
        return nearest_code_reference(x, self.values, self.positive_floor)

    def to(self, device) -> "QuantMap":
        return _qmap_on(self.name, torch.device(device))


@functools.lru_cache(maxsize=None)
def _qmap_on(name: str, device: torch.device) -> QuantMap:
    if name == "dynamic":
        values = create_dynamic_map(signed=True)
    elif name == "udynamic":
        values = create_dynamic_map(signed=False)
    else:
        raise ValueError(f"unknown quantization map {name!r}; use 'dynamic' or 'udynamic'")
    signed = name == "dynamic"
    floor = 0 if signed else int(np.searchsorted(values.numpy(), 0.0, side="right"))
    tab = build_encoder_table(values, positive_floor=floor, signed=signed)
    return QuantMap(name=name, values=values.to(device), table=torch.from_numpy(tab.entries).to(device),
                    base=tab.base, kmax=tab.kmax, half=tab.half, signed=signed, positive_floor=floor)


def get_qmap(name: str = "dynamic", device: Union[str, torch.device] = "cpu") -> QuantMap:
    """``"dynamic"``: signed map (first moment); ``"udynamic"``: unsigned map with a positive floor
    (second moment)."""
    return _qmap_on(name, torch.device(device))


def num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _check_block_size(block_size: int) -> None:
    if not (isinstance(block_size, int) and 32 <= block_size <= 16384 and block_size % 32 == 0):
        raise ValueError(f"block_size must be a multiple of 32 in [32, 16384], got {block_size!r}")


def encode(x: torch.Tensor, qmap: QuantMap) -> torch.Tensor:
    """Torch implementation of the table encoder for normalised fp32 ``x`` (any device); uint8 codes.

    Values beyond [-1, 1] encode like +-1. Unsigned maps encode ``|x|`` (their inputs are >= 0).
    """
    bits = x.float().contiguous().view(torch.int32)
    raw = (bits >> _SHIFT) & 0xFFFF
    k = (raw - qmap.base).clamp_(0, qmap.kmax)
    if qmap.signed:
        k = k + torch.where(bits < 0, qmap.half, 0)
    table = qmap.table if qmap.table.device == x.device else qmap.table.to(x.device)
    entry = table[k]
    up = (bits & _LOW_MASK) > (entry >> 16)
    code = torch.where(up, entry >> 8, entry) & 0xFF
    return code.to(torch.uint8)


def _resolve(qmap, device) -> QuantMap:
    if qmap is None:
        return get_qmap("dynamic", device)
    if isinstance(qmap, str):
        return get_qmap(qmap, device)
    return qmap


def quantize_blockwise(A: torch.Tensor, qmap: Union[None, str, QuantMap] = None, block_size: int = 256,
                       use_kernel: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``A`` blockwise; returns ``(codes uint8 shaped like A, absmax fp32 [n_blocks])``.

    Uses the C++ kernel for CPU fp32 input when it is available (``use_kernel``), the torch encoder
    otherwise; both produce the same codes.
    """
    _check_block_size(block_size)
    qm = _resolve(qmap, A.device)
    n = A.numel()
    nb = num_blocks(n, block_size)
    flat = A.detach().reshape(-1)
    if not qm.signed and n and bool((flat < 0).any()):
        raise ValueError(f"the unsigned map {qm.name!r} quantizes non-negative values only")
    if n and not bool(torch.isfinite(flat).all()):   # inf makes the block's scale 0 and its values NaN
        raise ValueError("quantize_blockwise quantizes finite values only; the tensor holds inf or NaN")
    if use_kernel and A.device.type == "cpu":
        from .kernels import cpu_kernels
        k = cpu_kernels()
        if k is not None:
            x = flat.float().contiguous()
            codes = torch.empty(n, dtype=torch.uint8)
            absmax = torch.empty(nb, dtype=torch.float32)
            k.quantize_blockwise(x, qm, block_size, codes, absmax)
            return codes.view(A.shape), absmax
    x = flat.float()
    pad = nb * block_size - n
    xb = torch.nn.functional.pad(x, (0, pad)).view(nb, block_size)
    absmax = xb.abs().amax(dim=1)
    scale = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    codes = encode(xb * scale[:, None], qm).reshape(-1)[:n]
    return codes.view(A.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: Union[None, str, QuantMap] = None,
                         block_size: int = 256, dtype: torch.dtype = torch.float32,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``values[codes] * absmax[block]`` (computed in fp32)."""
    _check_block_size(block_size)
    qm = _resolve(qmap, codes.device)
    n = codes.numel()
    nb = num_blocks(n, block_size)
    if absmax.numel() != nb:
        raise ValueError(f"absmax has {absmax.numel()} blocks, expected {nb} for {n} codes of block {block_size}")
    flat = codes.reshape(-1).long()
    vals = qm.values[flat]
    pad = nb * block_size - n
    res = (torch.nn.functional.pad(vals, (0, pad)).view(nb, block_size) * absmax.float()[:, None]).reshape(-1)[:n]
    res = res.view(codes.shape).to(dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res

