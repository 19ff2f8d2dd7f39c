"""I/O backends of the NVMe tier, the ``aio`` settings that tune them, and block checksums.

* ``posix-odirect``: ``os.pwritev`` / ``os.preadv`` with ``O_DIRECT`` on 4 KiB-aligned host buffers
  (the page cache is bypassed, so NVMe bandwidth is what is measured and used), run on a thread pool.
* ``posix-buffered``: the same calls without ``O_DIRECT``, for filesystems that refuse it (tmpfs,
  some network and overlay filesystems answer ``EINVAL``).
* ``kvikio``: CUDA tensors go straight between GPU memory and the file through kvikio (GPUDirect
  Storage where the driver supports it, kvikio's compat mode otherwise). Host tensors still use POSIX.

The backend is chosen automatically when the tier starts, and the choice and its reason are reported
(``NVMeTier.backend_report``, ``NVMeTier.stats()``, ``lazytrain bench tiers``).
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import torch

from .base import parse_bytes
from .pool import ALIGNMENT, aligned_empty  # O_DIRECT alignment of offsets, lengths and addresses


# DeepSpeed's aio section. single_submit and overlap_events describe libaio submission details that
# have no counterpart here; they are accepted so DeepSpeed configs load unchanged.
AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
            "overlap_events", "use_gds")


@dataclass(frozen=True)
class AioSettings:
    """How the NVMe tier issues I/O.

    ``block_size``: bytes per block; each block carries its own checksum. ``queue_depth``: blocks per
    request; one ``preadv``/``pwritev`` call moves up to ``block_size * queue_depth`` bytes, which the
    kernel splits into that many device requests in flight. ``intra_op_parallelism`` (DeepSpeed's old
    name: ``thread_count``): threads serving requests, so the requests of one tensor run in parallel.
    ``use_gds``: None chooses kvikio when it works, True requires it, False never uses it.
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 4
    use_gds: bool | None = None

    @property
    def request_bytes(self) -> int:
        return self.block_size * self.queue_depth

    @classmethod
    def from_config(cls, aio: dict | None) -> "AioSettings":
        aio = dict(aio or {})
        for key in aio:
            if key not in AIO_KEYS:
                raise ValueError(f"aio.{key}: unknown key (known: {', '.join(AIO_KEYS)})")
        if "thread_count" in aio and "intra_op_parallelism" in aio \
                and aio["thread_count"] != aio["intra_op_parallelism"]:
            raise ValueError(f"aio.thread_count ({aio['thread_count']}) and aio.intra_op_parallelism "
                             f"({aio['intra_op_parallelism']}) disagree; thread_count is the old name, give one")
        fields = {}
        if "block_size" in aio:
            try:
                block = parse_bytes(aio["block_size"], "aio.block_size")
            except ValueError as e:
                raise ValueError(str(e)) from e
            if isinstance(aio["block_size"], bool) or not block or block % ALIGNMENT:
                raise ValueError(f"aio.block_size must be a positive multiple of {ALIGNMENT} bytes "
                                 f"(O_DIRECT alignment), got {aio['block_size']!r}")
            fields["block_size"] = block
        for key, field in (("queue_depth", "queue_depth"), ("thread_count", "intra_op_parallelism"),
                           ("intra_op_parallelism", "intra_op_parallelism")):
            if key in aio:
                value = aio[key]
                if isinstance(value, float) and value.is_integer():   # 8.0, as DeepSpeed reads it
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"aio.{key} must be an integer >= 1, got {aio[key]!r}")
                fields[field] = value
        for key in ("single_submit", "overlap_events"):
            if key in aio and not isinstance(aio[key], bool):
                raise ValueError(f"aio.{key} must be true or false, got {aio[key]!r}")
        if "use_gds" in aio:
            if aio["use_gds"] is not None and not isinstance(aio["use_gds"], bool):
                raise ValueError(f"aio.use_gds must be true, false or null, got {aio['use_gds']!r}")
            fields["use_gds"] = aio["use_gds"]
        return cls(**fields)


# ---- checksums ---------------------------------------------------------------------------------
_WEIGHTS: dict = {}


def device_checksums(data: torch.Tensor, block_size: int) -> list[int]:
    """A position-weighted sum per block, computed where ``data`` lives (GPU memory for kvikio).

    ``data`` is a flat uint8 tensor. Each block is read as little-endian int32 words (a short last block
    is zero-padded) and summed as int64 with odd weights 1, 3, 5, ...: a flipped bit changes its word by
    +-2**b, so the sum by an odd multiple of 2**b, which is never 0 modulo 2**64; swapped words change
    it too. One pass over the data on the device and one small copy to the host.
    """
    n = data.numel()
    if n == 0:
        return []
    words = block_size // 4
    key = (data.device, words)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(1, 2 * words, 2, dtype=torch.int64, device=data.device)
    weights = _WEIGHTS[key]
    full = n // block_size
    sums = []
    chunk = max(1, (64 << 20) // block_size)  # bound the int64 temporary to 2x 64 MiB
    for start in range(0, full, chunk):
        stop = min(full, start + chunk)
        part = data[start * block_size:stop * block_size]
        if part.data_ptr() % 4:
            part = part.clone()
        w = part.view(torch.int32).view(stop - start, words).to(torch.int64)
        sums.append((w * weights).sum(dim=1))
    if n > full * block_size:
        tail = torch.zeros(block_size, dtype=torch.uint8, device=data.device)
        tail[:n - full * block_size] = data[full * block_size:]
        sums.append((tail.view(torch.int32).to(torch.int64) * weights).sum().reshape(1))
    return torch.cat(sums).tolist()


# ---- backends ----------------------------------------------------------------------------------
class PosixBackend:
    """``os.pwritev`` / ``os.preadv`` on file descriptors, with or without ``O_DIRECT``.

    The methods are the seam where failures are injected in tests (``tier.backend.pwritev = ...``).
    """

    def __init__(self, direct: bool):
        self.direct = direct
        self.name = "posix-odirect" if direct else "posix-buffered"

    def open(self, path: str, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)

    def close(self, fd: int) -> None:
        os.close(fd)

    def allocate(self, fd: int, nbytes: int) -> None:
        """Reserve the file's blocks before writing: a full disk fails here, before any data moves, and
        parallel O_DIRECT writes then land inside the file instead of extending it one by one."""
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)


def probe_direct_io(directory: str) -> tuple[bool, str]:
    """Whether ``directory``'s filesystem accepts O_DIRECT: one aligned block written with it (a filesystem
    that refuses it does so at open or at the first aligned write). Raises OSError for anything but a
    refusal of O_DIRECT itself (ENOSPC, EROFS, EACCES, EIO)."""
    path = os.path.join(directory, ".lazytrain-probe")
    buf = aligned_empty(ALIGNMENT, pinned=False)
    buf.fill_(0x5A)
    mv = memoryview(buf.numpy())
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # raises ENOSPC, EROFS, ...
            os.write(fd, bytes(mv))
            os.close(fd)
            return False, f"the filesystem refused O_DIRECT ({errno.errorcode.get(e.errno, e.errno)})"
        try:
            os.pwritev(fd, [mv], 0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return False, "the filesystem refused an aligned O_DIRECT write (EINVAL)"
        finally:
            os.close(fd)
        return True, "O_DIRECT works on this filesystem"
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def kvikio_status() -> tuple[object | None, str]:
    """(the kvikio module, a description) when kvikio can serve CUDA tensors here, else (None, why not)."""
    if not torch.cuda.is_available():
        return None, "kvikio not used: no CUDA device"
    try:
        import kvikio  # noqa: F401
        import kvikio.defaults
    except ImportError as e:
        return None, f"kvikio not used: it is not installed (pip install 'lazytrain[gds]'): {e}"
    except OSError as e:  # e.g. libcuda.so.1 or libcufile.so missing
        return None, f"kvikio not used: it is installed but cannot load its libraries: {e}"
    try:
        compat = kvikio.defaults.is_compat_mode_preferred() if hasattr(kvikio.defaults, "is_compat_mode_preferred") \
            else kvikio.defaults.compat_mode()
    except Exception as e:  # the driver could not be queried
        return None, f"kvikio not used: it failed to query the cuFile driver: {e}"
    mode = "compat mode (POSIX I/O inside kvikio)" if compat else "GPUDirect Storage"
    return kvikio, f"kvikio {getattr(kvikio, '__version__', '?')} in {mode} for CUDA tensors"


class KvikioBackend:
    """Moves CUDA tensors between GPU memory and files with ``kvikio.CuFile``."""

    def __init__(self, kvikio_module, description: str):
        self.kvikio = kvikio_module
        self.description = description
        self.name = "kvikio"

    def write(self, path: str, data: torch.Tensor) -> int:
        with self.kvikio.CuFile(path, "w") as f:
            return f.write(data)

    def read(self, path: str, data: torch.Tensor) -> int:
        with self.kvikio.CuFile(path, "r") as f:
            return f.read(data)
