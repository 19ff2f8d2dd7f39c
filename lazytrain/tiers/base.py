"""The Tier contract: one asynchronous interface for every place a tensor can live.

A tier stores tensors by key. ``write`` and ``read`` return a :class:`TransferHandle` at once; the
caller waits on it (or awaits it from asyncio) only when it needs the data, so the engine never blocks
the compute stream on I/O it could have started earlier. A tier knows its capacity and its current
and peak use, and refuses a write that would exceed its budget with an error that names the tier,
its budget and the request.
"""
from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

import torch


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_bytes(value: int | float | str | None, what: str = "size") -> int | None:
    """'64GB', '512MiB', 1e9 or None (no limit) -> bytes. Decimal units are powers of 1000, binary of 1024."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{what} must be >= 0, got {value}")
        return int(value)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    try:
        n = float(num)
    except ValueError:
        n = None
    if n is None or unit not in units or n < 0:
        raise ValueError(f"{what}: cannot read {value!r} as a size (examples: 1073741824, '64GB', '512MiB')")
    return int(n * units[unit])


class TierError(RuntimeError):
    """A tier operation failed; the message names the tier and the key."""


class TierBudgetError(TierError, MemoryError):
    """A write would exceed a tier's budget."""


class TransferHandle:
    """An asynchronous tier operation: ``wait()`` returns its result (the tensor, for reads).

    It wraps either a finished value, a ``concurrent.futures.Future`` (thread-pool I/O) or a CUDA
    event (copies on a side stream). For CUDA events, ``wait()`` orders the *current stream* after the
    copy without blocking the host; ``synchronize()`` blocks the host.
    """

    __slots__ = ("_value", "_future", "_event", "_keepalive", "_callbacks")

    def __init__(self, value: Any = None, future: Future | None = None, event: Any = None, keepalive: Any = None):
        self._value, self._future, self._event, self._keepalive = value, future, event, keepalive

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        if self._event is not None:
            return self._event.query()
        return True

    def wait(self) -> Any:
        if self._future is not None:
            self._value = self._future.result()
            self._future = None
        if self._event is not None:
            torch.cuda.current_stream(self._event.device if hasattr(self._event, "device") else None).wait_event(self._event)
        return self._value

    def synchronize(self) -> Any:
        value = self.wait()
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._keepalive = None
        return value

    def __await__(self):
        if self._future is not None:
            return asyncio.wrap_future(self._future).__await__()
        if self._event is not None:
            return asyncio.get_event_loop().run_in_executor(None, self.synchronize).__await__()
        async def ready():
            return self._value
        return ready().__await__()


class Tier(ABC):
    """Base class of every tier. Subclasses implement ``_write``, ``_read`` and ``_free``.

    Accounting (capacity, used, peak, bandwidth) lives here so that every tier, built-in or a
    user's own, enforces its budget the same way.
    """

    kind: str = "abstract"

    def __init__(self, name: str, capacity: int | str | None = None, device: torch.device | str | None = None):
        self.name = name
        self.capacity = parse_bytes(capacity, f"capacity of tier {name!r}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.peak_bytes = 0
        self._bytes_read = self._bytes_written = 0
        self._seconds_read = self._seconds_written = 0.0

    # ---- public API ------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, owned: bool = False) -> TransferHandle:
        """Store a snapshot of ``tensor`` under ``key``. ``owned=True``: the caller gives the tensor
        up, so a tier may keep it without copying. Overwriting a key frees the old value first."""
        if key in self._sizes:
            self.free(key)
        nbytes = tensor.numel() * tensor.element_size()
        self._reserve(key, nbytes)
        t0 = time.perf_counter()
        try:
            handle = self._write(key, tensor, owned)
        except BaseException:
            self._release(key)
            raise
        self._account("write", nbytes, t0)
        return handle

    def read(self, key: str, out: torch.Tensor | None = None, device: torch.device | str | None = None) -> TransferHandle:
        """Fetch ``key``: into ``out`` when given (no extra copy), else as a new tensor on ``device``
        (default: the tier's own device)."""
        if key not in self._sizes:
            raise TierError(f"tier {self.name!r} holds no tensor under key {key!r}")
        t0 = time.perf_counter()
        handle = self._read(key, out, torch.device(device) if device is not None else None)
        self._account("read", self._sizes[key], t0)
        return handle

    def free(self, key: str) -> None:
        if key not in self._sizes:
            return
        self._free(key)
        self._release(key)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def keys(self) -> list[str]:
        return list(self._sizes)

    def close(self) -> None:
        for key in list(self._sizes):
            self.free(key)

    def reset_peak(self) -> None:
        self.peak_bytes = self.used_bytes

    @property
    def free_bytes(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used_bytes

    def read_bandwidth(self) -> float | None:
        """Bytes per second over the reads issued so far (issue time for async tiers)."""
        return self._bytes_read / self._seconds_read if self._seconds_read > 0 else None

    def write_bandwidth(self) -> float | None:
        return self._bytes_written / self._seconds_written if self._seconds_written > 0 else None

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "capacity": self.capacity, "used_bytes": self.used_bytes,
                "peak_bytes": self.peak_bytes, "read_bandwidth": self.read_bandwidth(),
                "write_bandwidth": self.write_bandwidth()}

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else format_bytes(self.capacity)
        return f"{type(self).__name__}(name={self.name!r}, used={format_bytes(self.used_bytes)}, capacity={cap})"

    # ---- accounting ------------------------------------------------------------------------
    def _reserve(self, key: str, nbytes: int) -> None:
        with self._lock:
            if self.capacity is not None and self.used_bytes + nbytes > self.capacity:
                raise TierBudgetError(
                    f"tier {self.name!r} is over its budget: writing {key!r} ({format_bytes(nbytes)}) would bring "
                    f"its use to {format_bytes(self.used_bytes + nbytes)}, but its capacity is "
                    f"{format_bytes(self.capacity)} ({format_bytes(self.used_bytes)} in use). Raise the tier's "
                    f"capacity in the config or place fewer tensors on it.")
            self._sizes[key] = nbytes
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _release(self, key: str) -> None:
        with self._lock:
            self.used_bytes -= self._sizes.pop(key, 0)

    def _account(self, op: str, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        if op == "read":
            self._bytes_read += nbytes
            self._seconds_read += dt
        else:
            self._bytes_written += nbytes
            self._seconds_written += dt

    # ---- to implement ------------------------------------------------------------------------
    @abstractmethod
    def _write(self, key: str, tensor: torch.Tensor, owned: bool) -> TransferHandle: ...

    @abstractmethod
    def _read(self, key: str, out: torch.Tensor | None, device: torch.device | None) -> TransferHandle: ...

    @abstractmethod
    def _free(self, key: str) -> None: ...
