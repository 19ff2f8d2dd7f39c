"""Host kernels for the hybrid optimizer (and the gradient sinks' add): a small C++ library built on first use
and called through ctypes.

The library (``hybrid_adam.cpp``) has no torch or pybind11 headers, so it compiles in a few seconds with
the system C++ compiler (``$CXX`` or ``c++``; OpenMP for multi-threading, ``-march=native`` for AVX2).
It is cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a file named by
a hash of the source, the flags and the CPU, so a change to any of them rebuilds it. If no compiler is
found or the build fails, :func:`cpu_kernels` warns once with the compiler's message and returns
``None``; the optimizer then runs its torch implementation (same results, slower). Set
``LAZYTRAIN_NO_CPP_KERNELS=1`` to skip the build.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Optional

import torch

__all__ = ["cpu_kernels", "CpuKernels", "build_error"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybrid_adam.cpp")
_ABI_VERSION = 6
_BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_COPY = 3


class Hyper(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in (
        "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "weight_decay", "decay",
        "step_size", "inv_bc2_sqrt", "clip")] + [("adamw", ctypes.c_int32), ("pad", ctypes.c_int32)]


def make_hyper(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
               clip: float, adamw: bool) -> Hyper:
    """Per-step scalars, each rounded once to fp32 (the torch implementation uses the same values)."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return Hyper(beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2, eps=eps,
                 weight_decay=weight_decay, decay=1.0 - lr * weight_decay, step_size=lr / bc1,
                 inv_bc2_sqrt=1.0 / bc2 ** 0.5, clip=clip, adamw=1 if adamw else 0, pad=0)


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):
                    flags = line
                    break
    except OSError:
        pass
    return platform.machine() + ":" + flags


def _build_dir() -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(root, "lazytrain_optim")


def _compile(cxx: str, flags: list, out_path: str) -> None:
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out_path))
    os.close(fd)
    try:
        cmd = [cxx, *flags, _SOURCE, "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out_path)  # atomic: concurrent builders never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class CpuKernels:
    """Thin typed wrapper around the compiled library; all tensors must be contiguous CPU tensors."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib = lib
        self.path = path
        P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        lib.lt_abi_version.restype = ctypes.c_int
        lib.lt_has_avx2.restype = ctypes.c_int
        lib.lt_set_force_scalar.argtypes = [ctypes.c_int]
        lib.lt_quantize_blockwise.argtypes = [P, I64, I64, P, I32, I32, I32, I32, P, P, ctypes.c_int]
        lib.lt_dequantize_blockwise.argtypes = [P, P, P, I64, I64, P, ctypes.c_int]
        lib.lt_adam8bit.argtypes = [ctypes.POINTER(Hyper), P, P, ctypes.c_int, P, P, P, P, P, P,
                                    P, I32, I32, I32, P, I32, I32, P, ctypes.c_int, I64, I64, ctypes.c_int,
                                    ctypes.c_int]
        lib.lt_adam32.argtypes = [ctypes.POINTER(Hyper), P, P, ctypes.c_int, P, P, P, ctypes.c_int, I64,
                                  ctypes.c_int, ctypes.c_int]
        lib.lt_add_square_sum.argtypes = [P, P, ctypes.c_int, I64, I64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.lt_add_square_sum.restype = ctypes.c_double
        if lib.lt_abi_version() != _ABI_VERSION:
            raise RuntimeError(f"{path}: ABI version mismatch")
        self.has_avx2 = bool(lib.lt_has_avx2())

    @staticmethod
    def _threads() -> int:
        return max(1, torch.get_num_threads())

    def set_force_scalar(self, value: bool) -> None:
        """Use the portable scalar loop instead of AVX2 (for tests; results are bit-identical)."""
        self.lib.lt_set_force_scalar(1 if value else 0)

    def quantize_blockwise(self, x: torch.Tensor, qmap, block_size: int, codes: torch.Tensor,
                           absmax: torch.Tensor) -> None:
        self.lib.lt_quantize_blockwise(x.data_ptr(), x.numel(), block_size, qmap.table.data_ptr(), qmap.base,
                                       qmap.kmax, qmap.half, 1 if qmap.signed else 0, codes.data_ptr(), absmax.data_ptr(), self._threads())

    def dequantize_blockwise(self, codes: torch.Tensor, absmax: torch.Tensor, qmap, block_size: int,
                             out: torch.Tensor) -> None:
        self.lib.lt_dequantize_blockwise(codes.data_ptr(), absmax.data_ptr(), qmap.values.data_ptr(),
                                         codes.numel(), block_size, out.data_ptr(), self._threads())

    def adam8bit(self, hyper: Hyper, p: torch.Tensor, g: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
                 absmax1: torch.Tensor, absmax2: torch.Tensor, qmap1, qmap2, block_size: int,
                 copy: Optional[torch.Tensor], zero_grad: bool = False) -> None:
        """Fused step; ``qmap1`` must be signed (first moment), ``qmap2`` unsigned (second moment). With
        ``zero_grad``, ``g`` is cleared block by block as it is read (its writer must count the write)."""
        assert qmap1.signed and not qmap2.signed
        self.lib.lt_adam8bit(
            ctypes.byref(hyper), p.data_ptr(), g.data_ptr(), _DTYPE_CODE[g.dtype], c1.data_ptr(), c2.data_ptr(),
            absmax1.data_ptr(), absmax2.data_ptr(), qmap1.values.data_ptr(), qmap2.values.data_ptr(),
            qmap1.table.data_ptr(), qmap1.base, qmap1.kmax, qmap1.half,
            qmap2.table.data_ptr(), qmap2.base, qmap2.kmax,
            copy.data_ptr() if copy is not None else None,
            _DTYPE_CODE[copy.dtype] if copy is not None else _NO_COPY, p.numel(), block_size, int(zero_grad),
            self._threads())

    def adam32(self, hyper: Hyper, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               copy: Optional[torch.Tensor], zero_grad: bool = False) -> None:
        """The same step with fp32 moments; ``zero_grad`` as in :meth:`adam8bit`."""
        self.lib.lt_adam32(
            ctypes.byref(hyper), p.data_ptr(), g.data_ptr(), _DTYPE_CODE[g.dtype], m.data_ptr(), v.data_ptr(),
            copy.data_ptr() if copy is not None else None,
            _DTYPE_CODE[copy.dtype] if copy is not None else _NO_COPY, p.numel(), int(zero_grad), self._threads())

    def add_square_sum(self, dst: torch.Tensor, g: Optional[torch.Tensor], row: int, want_sum: bool,
                       from_zero: bool = False) -> float:
        """``dst += g`` (fp32 ``dst``; ``g`` fp32, bf16 or fp16 of as many elements, or None to add nothing)
        and, with ``want_sum``, ``dst``'s sum of squares after: rows of ``row`` elements, each one thread's,
        so the same value at every thread count (hybrid_adam.cpp). ``from_zero``: ``dst`` is zero (the caller
        knows), so ``0 + g`` is written without reading it, bit for bit the add."""
        return self.lib.lt_add_square_sum(dst.data_ptr(), g.data_ptr() if g is not None else None,
                                          _DTYPE_CODE[g.dtype] if g is not None else 0, dst.numel(), row,
                                          1 if want_sum else 0, 1 if from_zero and g is not None else 0,
                                          self._threads())


_lock = threading.Lock()
_loaded: Optional[CpuKernels] = None
_tried = False
_error: Optional[str] = None


def build_error() -> Optional[str]:
    """Why the kernels are unavailable (``None`` if they loaded or were not tried yet)."""
    return _error


def _load() -> CpuKernels:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX)")
    with open(_SOURCE, "rb") as f:
        src = f.read()
    attempts = [_BASE_FLAGS + ["-march=native"], _BASE_FLAGS]
    last_err = None
    for flags in attempts:
        key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), cxx.encode(),
                                         _cpu_tag().encode()])).hexdigest()[:16]
        path = os.path.join(_build_dir(), f"hybrid_adam_{key}.so")
        try:
            if not os.path.exists(path):
                _compile(cxx, flags, path)
            return CpuKernels(ctypes.CDLL(path), path)
        except (RuntimeError, OSError) as e:
            last_err = e
    raise RuntimeError(str(last_err))


def cpu_kernels() -> Optional[CpuKernels]:
    """The compiled host kernels, building them on first use; ``None`` if unavailable (warned once)."""
    global _loaded, _tried, _error
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        if os.environ.get("LAZYTRAIN_NO_CPP_KERNELS", "") not in ("", "0"):
            _error = "disabled by LAZYTRAIN_NO_CPP_KERNELS"
        else:
            try:
                _loaded = _load()
            except Exception as e:  # noqa: BLE001 - any failure falls back to torch, with a warning
                _error = str(e)
                warnings.warn(f"LazyTrain optimizer kernels unavailable, using the slower torch path: {e}",
                              RuntimeWarning, stacklevel=2)
        _tried = True
        return _loaded
