"""Measure the machine for the planner: each tier's read and write bandwidth, host<->device copies,
host memory, the host optimizer and the compute device's matrix throughput.

The result is the flat hardware-profile object that ``lazytrain.planner.hardware`` reads (GB/s are
1e9 bytes per second; a field that cannot be measured here is null). Every figure is measured on this
machine when the command runs, except ``peak_tflops``, which is a datasheet value looked up by GPU name.
"""
from __future__ import annotations

import os
import platform
import tempfile
import time
from typing import Callable

import torch

from .base import format_bytes
from .memory import DeviceTier, HostTier, pinned_memory_available

GB = 1e9

# Dense bf16 tensor-core peaks from NVIDIA datasheets (TFLOP/s), matched by a substring of the device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H100 PCIe": 756.0, "H800 PCIe": 756.0,
                    "H100 NVL": 835.0, "H200 NVL": 835.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0, "A10G": 70.0}


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 datasheet peak of the card named (the longest key it contains, so an "H100 PCIe" is not
    given the SXM card's peak); None for a card not listed."""
    keys = [key for key in PEAK_BF16_TFLOPS if key in device_name]
    return PEAK_BF16_TFLOPS[max(keys, key=len)] if keys else None


def _timed(fn: Callable[[], None], sync: Callable[[], None], min_seconds: float, max_iters: int = 1000) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), running for at least ``min_seconds``."""
    fn()
    sync()
    iters, start = 0, time.perf_counter()
    while True:
        fn()
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or iters >= max_iters:
            sync()
            return (time.perf_counter() - start) / iters


def _cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copies(nbytes: int, seconds: float) -> dict:
    """Pinned host <-> device copy bandwidth (GB/s); None without CUDA."""
    if not torch.cuda.is_available():
        return {"h2d_gbps": None, "d2h_gbps": None}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), _cuda_sync, seconds)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), _cuda_sync, seconds)
    return {"h2d_gbps": nbytes / h2d / GB, "d2h_gbps": nbytes / d2h / GB}


def measure_host_memory(nbytes: int, seconds: float) -> float:
    """Bytes read plus bytes written per second by a large host copy (GB/s)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), lambda: None, seconds)
    return 2 * nbytes / t / GB


def measure_host_optimizer(numel: int, seconds: float) -> tuple[float, str]:
    """Parameters per second (in 1e9) updated by LazyTrain's host optimizer as the engine runs it by default
    (HybridAdamW with fp32 states, no finiteness pass of its own: the engine checks the gradients once) on
    fp32 parameters, or torch's AdamW where it is not available; returns (rate, what was measured)."""
    p = torch.zeros(numel, dtype=torch.float32, requires_grad=True)
    p.grad = torch.randn(numel) * 1e-3
    try:
        from ..optim.hybrid_adamw import HybridAdamW
        opt = HybridAdamW([p], lr=1e-3, optimizer_states="fp32", check_finite=False)
        what = "lazytrain HybridAdamW (fp32 states, the engine's default)"
        opt.step()
    except Exception:  # noqa: BLE001 - the planner still gets a measured figure
        opt, what = torch.optim.AdamW([p], lr=1e-3), "torch AdamW (fp32 states)"
    t = _timed(opt.step, lambda: None, seconds, max_iters=200)
    return numel / t / 1e9, what


def measure_matmul(device: torch.device, seconds: float, n: int | None = None) -> tuple[float, str]:
    """Achieved TFLOP/s of a square matrix product on ``device`` (bf16 on CUDA, fp32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = _timed(lambda: torch.mm(a, b, out=c), _cuda_sync if device.type == "cuda" else (lambda: None), seconds)
    return 2 * n ** 3 / t / 1e12, f"{n}x{n} {str(dtype).replace('torch.', '')} matmul on {device.type}"


# measure_tier holds this many bytes of source tensors and as many of read buffers, whatever the total
ROUND_BYTES = 1 << 30


def measure_tier(tier, total_bytes: int, tensor_bytes: int, device: torch.device | None = None,
                 warmup_bytes: int = 0, round_bytes: int = ROUND_BYTES) -> dict:
    """Write ``total_bytes`` in tensors of ``tensor_bytes`` to ``tier``, then read them all back; GB/s each
    way, timed from the first issue to the last completion of each round. Both go in rounds of at most
    ``round_bytes`` (all of a round issued, then waited), through the same source tensors and read buffers,
    so the memory held is two rounds' whatever the total (a drive larger than RAM can be measured); every
    read is checked against what was written. A first, untimed pass of ``warmup_bytes`` fills the tier's
    buffer pools (pinning them where CUDA exists), so the figures are those of a training step after the
    first."""
    if warmup_bytes:
        measure_tier(tier, warmup_bytes, min(tensor_bytes, warmup_bytes), device)
    count = _tensor_count(total_bytes, tensor_bytes)
    per_round = max(1, min(count, round_bytes // tensor_bytes))
    rounds = [range(first, min(count, first + per_round)) for first in range(0, count, per_round)]
    src_device = device or torch.device("cpu")
    sync = _cuda_sync if src_device.type == "cuda" else (lambda: None)
    tensors = [torch.empty(tensor_bytes // 4, device=src_device) for _ in range(per_round)]
    outs = [torch.zeros_like(t) for t in tensors]  # touched before timing, like a reused buffer
    moved = _bytes_written(total_bytes, tensor_bytes)
    write_s = read_s = 0.0
    try:
        for keys in rounds:   # each key's tensor holds its own number: a read of another key is caught
            for t, i in zip(tensors, keys):
                t.fill_(float(i))
            sync()
            start = time.perf_counter()
            for h in [tier.write(f"bench-{i}", t) for t, i in zip(tensors, keys)]:
                h.synchronize()
            write_s += time.perf_counter() - start
        for keys in rounds:
            start = time.perf_counter()
            for h in [tier.read(f"bench-{i}", out=o) for o, i in zip(outs, keys)]:
                h.synchronize()
            read_s += time.perf_counter() - start
            for o, i in zip(outs, keys):
                if not bool((o == float(i)).all()):
                    raise RuntimeError(f"tier {tier.name!r} returned wrong data for bench-{i}")
    finally:
        for i in range(count):
            if f"bench-{i}" in tier:
                tier.free(f"bench-{i}")
    return {"write_gbps": moved / write_s / GB, "read_gbps": moved / read_s / GB, "bytes": moved}


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu-only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _tensor_count(total_bytes: int, tensor_bytes: int) -> int:
    """The tensors :func:`measure_tier` writes for ``total_bytes``: whole ones, at least one."""
    return max(1, total_bytes // tensor_bytes)


def _bytes_written(total_bytes: int, tensor_bytes: int) -> int:
    """What those tensors hold (fp32 tensors of ``tensor_bytes // 4`` elements)."""
    return _tensor_count(total_bytes, tensor_bytes) * (tensor_bytes // 4) * 4


def warmup_bytes_for(total_bytes: int) -> int:
    """The memory tiers' measurement size, and the NVMe measurement's untimed warm-up: less than the NVMe
    total is enough to measure memory well."""
    return min(total_bytes, 256 << 20)


def tier_bytes_held(total_bytes: int, tensor_bytes: int) -> int:
    """The most bytes :func:`measure_tier` holds in a tier at once (its warm-up comes first and is freed):
    whole tensors, at least one, so a total below one tensor writes a tensor."""
    small = warmup_bytes_for(total_bytes)
    return max(_bytes_written(total_bytes, tensor_bytes), _bytes_written(small, min(tensor_bytes, small)))


def run_bench(path: str | None = None, nvme_bytes: int = 1 << 30, tensor_bytes: int = 64 << 20,
              copy_bytes: int = 256 << 20, seconds: float = 1.0, optimizer_params: int = 16 << 20,
              log: Callable[[str], None] = print) -> tuple[dict, list[tuple]]:
    """Measure everything; returns (hardware profile dict, rows of (what, write GB/s, read GB/s, note))."""
    from .nvme import NVMeTier
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows: list[tuple] = []
    profile: dict = {"name": machine_name()}
    profile["peak_tflops"] = datasheet_peak_tflops(profile["name"])

    log(f"compute: matrix products on {device} for {seconds:g} s ...")
    tflops, what = measure_matmul(device, seconds)
    profile["achievable_tflops"] = tflops
    if profile["peak_tflops"] is not None and tflops > profile["peak_tflops"]:
        # the datasheet value looked up by name is another variant's (a profile refuses achievable > peak)
        log(f"compute: measured {tflops:.1f} TFLOP/s is above the {profile['peak_tflops']:g} looked up for "
            f"{profile['name']!r}; peak_tflops left unknown")
        profile["peak_tflops"] = None
    rows.append(("compute", None, None, f"{tflops:.2f} TFLOP/s ({what})"))

    copies = measure_copies(copy_bytes, seconds)
    profile.update(copies)
    rows.append(("host<->device (pinned)", copies["d2h_gbps"], copies["h2d_gbps"],
                 "write = device->host, read = host->device" if torch.cuda.is_available() else "no CUDA device"))

    small = warmup_bytes_for(nvme_bytes)
    hbm = DeviceTier("hbm", device=device)
    r = measure_tier(hbm, small, min(tensor_bytes, small), device, warmup_bytes=small)
    rows.append(("hbm tier", r["write_gbps"], r["read_gbps"], f"{format_bytes(r['bytes'])} on {device}"))
    host = HostTier("host")
    r = measure_tier(host, small, min(tensor_bytes, small), device, warmup_bytes=small)
    host.close()
    note = "pinned" if pinned_memory_available() else "pageable (no CUDA device)"
    rows.append(("host tier", r["write_gbps"], r["read_gbps"], f"{format_bytes(r['bytes'])} from {device}, {note}"))

    directory = path or tempfile.gettempdir()
    log(f"nvme: {format_bytes(nvme_bytes)} in {format_bytes(tensor_bytes)} tensors under {directory} ...")
    nvme = NVMeTier("nvme", path=directory)
    try:
        r = measure_tier(nvme, nvme_bytes, tensor_bytes, warmup_bytes=small)
        rows.append(("nvme tier", r["write_gbps"], r["read_gbps"],
                     f"{format_bytes(r['bytes'])} host tensors, {nvme.backend_report}"))
        profile["nvme_write_gbps"], profile["nvme_read_gbps"] = r["write_gbps"], r["read_gbps"]
        if nvme.kvikio_backend is not None:
            r = measure_tier(nvme, min(nvme_bytes, 1 << 30), tensor_bytes, device, warmup_bytes=small)
            rows.append(("nvme tier (GPU tensors)", r["write_gbps"], r["read_gbps"], "through kvikio"))
    finally:
        nvme.close()

    profile["host_mem_gbps"] = measure_host_memory(copy_bytes, seconds)
    rows.append(("host memory", None, None, f"{profile['host_mem_gbps']:.2f} GB/s read+write by a large copy"))
    rate, what = measure_host_optimizer(optimizer_params, seconds)
    profile["host_optimizer_gparams_per_s"] = rate
    rows.append(("host optimizer", None, None, f"{rate:.3f} Gparams/s ({what}, {optimizer_params} params)"))
    profile["gpu_mem_bytes"] = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    profile["host_mem_bytes"] = host_memory_bytes()
    order = ["name", "peak_tflops", "achievable_tflops", "h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps",
             "host_mem_gbps", "host_optimizer_gparams_per_s", "gpu_mem_bytes", "host_mem_bytes"]
    return {k: profile.get(k) for k in order}, rows


def format_rows(rows: list[tuple]) -> str:
    def cell(v):
        return "-" if v is None else f"{v:.2f}"
    lines = ["| what | write GB/s | read GB/s | notes |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {what} | {cell(w)} | {cell(r)} | {note} |" for what, w, r, note in rows]
    return "\n".join(lines)
