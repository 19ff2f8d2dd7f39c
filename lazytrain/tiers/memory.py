"""Tiers that keep tensors in memory: the compute device's (``hbm``) and the host's (``host``).

Copies between device and host run on a side CUDA stream where CUDA exists, and the handle carries
the CUDA event; on a CPU-only machine the same code runs with plain synchronous copies.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
import warnings
import weakref

import numpy
import torch

from . import streams
from .base import Tier, TierError, TransferHandle, wait_completion

_pinned_warning_given = False


def pinned_memory_available() -> bool:
    """Pinned (page-locked) host memory needs an accelerator; a CPU-only torch raises on pin_memory."""
    return torch.cuda.is_available()


# below this many bytes a pinned buffer comes from torch's pinned allocator; from here on it is registered
# memory of its own size (registered_host): torch rounds every pinned block up to a power of two, which for
# the per-layer fp32 weights and gradients would pin up to twice the host memory the planner counts
REGISTER_FROM_BYTES = 1 << 20


def empty_host(shape, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer, pinned where an accelerator exists, pageable (with one warning) where not."""
    if pinned_memory_available():
        flat = registered_host(math.prod((shape,) if isinstance(shape, int) else shape) * dtype.itemsize)
        if flat is not None:
            return flat.view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    _warn_pageable(stacklevel=3)
    return torch.empty(shape, dtype=dtype)


def registered_host(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of zeroed, page-aligned host memory registered with CUDA as pinned (cudaHostRegister),
    as a flat uint8 tensor; unregistered when the last tensor over it is gone. None below
    ``REGISTER_FROM_BYTES`` (pages of its own would waste more than torch's rounding) and where CUDA refuses
    to register it: the caller then takes torch's pinned allocator."""
    if nbytes < REGISTER_FROM_BYTES:
        return None
    array = numpy.frombuffer(mmap.mmap(-1, nbytes), dtype=numpy.uint8)   # anonymous: its own pages, zeroed
    flat = torch.from_numpy(array)                 # its storage holds the array, the array the map
    return flat if register_pinned(flat, array) == 0 else None


def register_pinned(flat: torch.Tensor, owner) -> int:
    """Register the memory of ``flat`` with CUDA as pinned, so that copies from and to it run
    asynchronously. It is unregistered when ``owner`` goes: the object whose life bounds the memory's (the
    numpy array over a memory map, which the tensors' storage holds and which holds the map), so before
    the map is unmapped (an address left registered could not be registered again when a later map lands
    there). Returns CUDA's error code, 0 on success; -1 without CUDA."""
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, AttributeError, RuntimeError):   # a torch without CUDA
        return -1
    with torch.cuda.device(_device_with_context()):
        err = cudart.cudaHostRegister(flat.data_ptr(), flat.numel() * flat.element_size(), 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_cuda_error()
        return code
    weakref.finalize(owner, _unregister, cudart, flat.data_ptr())
    return 0


def _unregister(cudart, ptr: int) -> None:
    if torch.cuda._is_in_bad_fork():   # a forked child: the registration is its parent's CUDA's, not its own
        return
    with torch.cuda.device(_device_with_context()):
        try:   # a copy still queued on a stream may read or write these pages (torch's own pinned blocks are
            torch.cuda.synchronize()   # kept from reuse by events; nothing keeps registered memory)
        except RuntimeError:   # CUDA already torn down (interpreter exit): no copy runs any more
            pass
        err = cudart.cudaHostUnregister(ptr)
    if int(getattr(err, "value", err)) != 0:
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """Take back the error of a CUDA runtime call that failed: CUDA keeps it as the thread's last error, and
    torch's next kernel-launch check (cudaGetLastError) would raise it as that kernel's own. torch binds no
    cudaGetLastError: it is called in the runtime torch loaded, found by name (never loading another)."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", f"libcudart.so.{major}.0"):   # CUDA 12 and 13; CUDA 11
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):   # not loaded under that name (or statically linked); not Linux
            continue
        runtime.cudaGetLastError()
        return


def _device_with_context() -> int:
    """A CUDA device that already has a context in this process, the current one first, as torch's pinned
    allocator chooses: a thread that set no device (an NVMe tier's I/O thread, whichever thread drops a
    buffer's last view) has GPU 0 current, and a CUDA call there would create a context on GPU 0 in every
    rank of the node."""
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None or has_context(current):
        return current
    return next((i for i in range(torch.cuda.device_count()) if has_context(i)), current)


def release_cached_pinned_memory() -> None:
    """Hand the pinned host memory freed so far back to the system. torch keeps every freed pinned block
    cached for a later request of its power-of-two size and never returns it by itself, so the pinned
    buffers LazyTrain lets go of (other ranks' layers, weights moved into node-shared memory) would stay
    pinned in every process. A no-op without an accelerator."""
    if not pinned_memory_available():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _warn_pageable(stacklevel: int) -> None:
    global _pinned_warning_given
    if not _pinned_warning_given:
        _pinned_warning_given = True
        warnings.warn("lazytrain: no CUDA device, so host buffers use pageable memory instead of pinned memory "
                      "(expected on a CPU-only machine).", stacklevel=stacklevel + 1)


class _CopyStreams:
    """One side stream per direction per CUDA device, shared by the memory tiers (and by the threads that
    copy: the first two to ask at once must not each make one)."""
    _streams: dict = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, device: torch.device, direction: str):
        if device.type != "cuda":
            return None
        key = (device.index if device.index is not None else torch.cuda.current_device(), direction)
        stream = cls._streams.get(key)
        if stream is None:
            with cls._lock:
                stream = cls._streams.get(key)
                if stream is None:
                    stream = cls._streams[key] = torch.cuda.Stream(device=key[0])
        return stream


def async_copy(dst: torch.Tensor, src: torch.Tensor, value=None, after=None,
               follow_current: bool = True, direction: str | None = None, label: str | None = None) -> TransferHandle:
    """Copy ``src`` into ``dst`` on a side stream when a CUDA device is involved, else synchronously, or,
    with copy threads on (``streams.configure``), on the host copy thread of ``direction`` ("h2d": into
    what stands for device memory, "d2h": out of it; None: a copy within one memory, always synchronous).
    The copy follows the work queued on the current stream (``follow_current``) and ``after``, a CUDA or
    host event (the write that filled ``src``, or the point where the caller asked for the copy); inside
    :func:`~lazytrain.tiers.streams.issued_after` it follows that block's event instead of the stream.
    ``label`` names the copy in a trace (default: its shape and dtype)."""
    label = label or f"{tuple(src.shape)} {src.dtype}"
    follow, ordered_after = streams.ordering()
    follow_current = follow_current and follow
    afters = [e for e in (after, ordered_after) if e is not None]
    cuda_dev = dst.device if dst.device.type == "cuda" else (src.device if src.device.type == "cuda" else None)
    if cuda_dev is None:
        if direction is None or not streams.settings().copy_threads:
            for e in afters:
                e.synchronize()
            dst.copy_(src)
            return TransferHandle(value=dst if value is None else value)
        # a source still being filled by an ordered write (``after``) changes before the copy, by design
        return _host_thread_copy(dst, src, value, afters, direction, label, check_source=after is None)
    direction = "h2d" if dst.device.type == "cuda" and src.device.type != "cuda" else "d2h"
    stream = _CopyStreams.get(cuda_dev, direction)
    if follow_current:
        stream.wait_stream(torch.cuda.current_stream(cuda_dev))
    for e in afters:
        if getattr(e, "on_host", False):
            e.synchronize()
        else:
            stream.wait_event(e)
    chaos = streams.settings().chaos
    if chaos is not None:
        chaos.delay_stream(stream)
    with streams.on_cuda_stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
    streams.record_device_copy(direction, label, start, event,
                               src.numel() * src.element_size())
    if src.device.type == "cuda":
        src.record_stream(stream)
    if dst.device.type == "cuda":
        dst.record_stream(stream)
    return TransferHandle(value=dst if value is None else value, event=event, keepalive=src,
                          host=dst.device.type != "cuda", timing=(start, event))


def _failed(event) -> bool:
    """Whether a finished host copy (a copy thread's event) failed."""
    future = getattr(event, "future", None)
    return future is not None and (future.cancelled() or future.exception() is not None)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:   # an inference-mode tensor has no version counter
        return None


def _host_thread_copy(dst, src, value, afters, direction: str, label: str,
                      check_source: bool = True) -> TransferHandle:
    """The CPU counterpart of a side-stream copy: queued on the copy thread of ``direction``. As on a
    CUDA stream, the caller must not change ``src`` until the copy is done; a change is caught (the
    tensor's version moved) and fails the copy instead of copying half-changed data."""
    version = _version(src) if check_source else None
    queued, finished = time.perf_counter(), []

    def run():
        ready = streams.transfer_ready(queued, afters)
        t0 = time.perf_counter()
        if version is not None and _version(src) != version:
            raise TierError(f"a tensor of {tuple(src.shape)} {src.dtype} was modified in place before its "
                            f"asynchronous copy ({direction}) ran; a tensor handed to a transfer must not "
                            f"change until the transfer is done")
        dst.copy_(src)
        t0 = streams.emulate_link(direction, src.numel() * src.element_size(), ready, t0)
        finished.append(time.perf_counter())
        streams.record(direction, label, t0, finished[0], bytes=src.numel() * src.element_size())
        return dst if value is None else value
    future = streams.host_stream(direction).submit(run)
    return TransferHandle(future=future, event=streams.HostEvent(future, finished), keepalive=src,
                          host=direction == "d2h")


class _ReadBeingIssued:
    """A read's copy from its lookup (under the tier's lock) until it is issued (outside it), then that copy:
    what a free of the buffer meanwhile waits for before the buffer is recycled."""

    def __init__(self):
        self._issued = threading.Event()
        self._event = None

    def issued(self, event) -> None:
        """The copy is issued (``event``: its completion; None when it failed to issue or moves nothing)."""
        self._event = event
        self._issued.set()

    def query(self) -> bool:
        return self._issued.is_set() and (self._event is None or self._event.query())

    def synchronize(self) -> None:
        self._issued.wait()
        if self._event is not None:
            self._event.synchronize()

    @property
    def finished_at(self) -> float | None:
        return getattr(self._event, "finished_at", None) if self._event is not None else None


class MemoryTier(Tier):
    """Tensors kept in a dict on one device; reads copy into ``out`` or return the stored tensor.

    With CUDA (or copy threads), the event of the copy that fills each stored buffer is kept, and reads
    are ordered after it; the events of reads still copying out of a buffer are kept apart, so that a
    freed buffer is recycled only once they are done, and so that a read that failed (its source intact)
    never holds back the reads after it.
    """

    kind = "memory"
    runs_own_transfers = True
    # the host copy thread a copy into / out of this tier runs on when there is no CUDA (copy threads on)
    copy_in: str | None = None
    copy_out: str | None = None

    def __init__(self, name: str, capacity=None, device=None):
        super().__init__(name, capacity, device)
        self._store: dict[str, torch.Tensor] = {}
        self._events: dict[str, object] = {}  # key -> event of the copy that filled its buffer, until done
        self._reading: dict[str, list] = {}   # key -> events of reads out of its buffer, while in flight

    def _allocate(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(buffer for ``tensor``, what backs it for the tier's own bookkeeping or None)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device), None

    def _adopt(self, key: str, buf: torch.Tensor, backing, event) -> None:
        """Make ``buf`` the value of ``key`` unless another thread freed or rewrote the key while this
        write was under way; then the buffer is given up instead (it never shadows the newer state)."""
        with self._lock:
            if self._write_is_current(key):
                self._store[key] = buf
                if event is not None:
                    self._events[key] = event
                self._adopted(key, backing)
                return
        self._give_up(backing, event)

    def _adopted(self, key: str, backing) -> None:
        pass

    def _give_up(self, backing, event) -> None:
        pass

    def _keeps(self, tensor, owned) -> bool:
        """An owned, contiguous tensor already on this device is stored as it is (no copy)."""
        return owned and tensor.device == self.device and tensor.is_contiguous()

    def _write(self, key, tensor, owned):
        if self._keeps(tensor, owned):
            self._adopt(key, tensor, None, None)
            return TransferHandle(moved=False)
        buf, backing = self._allocate(key, tensor)
        handle = async_copy(buf, tensor, direction=self.copy_in if tensor.device.type == "cpu" else None, label=key)
        self._adopt(key, buf, backing, handle._event)
        # a copy on a host copy thread fails when its source changed before it ran: its future takes that
        # to Tier.write's bookkeeping, which gives the key up, so the unfilled buffer is never read as valid
        return TransferHandle(future=handle._future, event=handle._event, keepalive=handle._keepalive,
                              host=handle._host, timing=handle._timing)

    def _pending(self, key):
        event = self._events.get(key)
        if event is not None and event.query() and not _failed(event):
            self._events.pop(key, None)
            return None
        return event   # in flight, or failed: a read ordered after it waits on it and fails with it

    def _read(self, key, out, device):
        with self._lock:   # a free on another thread may have taken the key since read() checked it
            src = self._store.get(key)
            if src is None:
                raise TierError(f"tier {self.name!r} holds no tensor under key {key!r}")
            after = self._pending(key)
            if out is not None and (out.shape != src.shape or out.dtype != src.dtype):
                raise ValueError(f"tier {self.name!r}: read of {key!r} into a buffer of {tuple(out.shape)} "
                                 f"{out.dtype}, but it holds {tuple(src.shape)} {src.dtype}")
            on_host = device is not None and device.type == "cpu" and self.copy_out and streams.settings().copy_threads
            if out is None and not on_host and (device is None or device == self.device or
                                                device.type == self.device.type == "cpu"):
                return TransferHandle(value=src, event=after, host=src.device.type != "cuda", moved=False)
            # counted as reading the buffer before the lock goes: a free or overwrite meanwhile waits for the
            # copy it becomes. The copy is issued outside the lock: issuing may wait on host events (a write's
            # on a copy thread), whose failure clean-up takes this lock
            reading = _ReadBeingIssued()
            self._reading[key] = [e for e in self._reading.get(key, ()) if not e.query()] + [reading]
        handle = None
        try:
            if out is not None:
                handle = async_copy(out, src, after=after, direction=self.copy_out, label=key)
            elif on_host:   # the CPU standing in for a device: a read "to the device" is a copy, as on CUDA
                handle = async_copy(torch.empty(src.shape, dtype=src.dtype), src, after=after,
                                    direction=self.copy_out, label=key)
            else:   # a destination allocated now: the copy follows the stream it was allocated on
                with streams.following_current():
                    handle = async_copy(torch.empty(src.shape, dtype=src.dtype, device=device), src, after=after,
                                        label=key)
        finally:
            reading.issued(handle._event if handle is not None else None)
        return handle

    def _in_flight(self, key) -> list:
        """The copies into and out of ``key``'s buffer not yet over (failed ones are over)."""
        events = [self._events.get(key), *self._reading.get(key, ())]
        return [e for e in events if e is not None and not e.query()]

    def _free(self, key):
        self._store.pop(key, None)
        self._events.pop(key, None)
        self._reading.pop(key, None)


class DeviceTier(MemoryTier):
    """``hbm``: the compute device's memory, with accounting."""
    kind = "hbm"


class HostTier(MemoryTier):
    """``host``: pinned host memory where an accelerator exists, pageable (one warning) where it does not.

    Buffers come from a :class:`~lazytrain.tiers.pool.SlabPool`, so a freed tensor's pinned memory
    serves the next write of a similar size instead of being unpinned and pinned again. A write counts
    against ``capacity`` the slab it fills (its size class, at most 1/16 above the tensor above 64 KiB), so
    the slabs in use never exceed it; the pool keeps at most ``capacity`` bytes of slabs, in use or idle.
    """
    kind = "host"
    copy_in, copy_out = "d2h", "h2d"

    def __init__(self, name: str = "host", capacity=None, device=None):
        super().__init__(name, capacity, "cpu")
        from .pool import SlabPool
        if not pinned_memory_available():
            _warn_pageable(stacklevel=2)
        self.pool = SlabPool(limit_bytes=self.capacity)
        self._slabs: dict[str, torch.Tensor] = {}
        self._draining: list[tuple[torch.Tensor, list]] = []  # freed slabs and the copies in flight on them

    def _footprint(self, tensor, owned):
        from .pool import size_class
        nbytes = tensor.numel() * tensor.element_size()
        return nbytes if nbytes == 0 or self._keeps(tensor, owned) else size_class(nbytes, self.pool.alignment)

    def _allocate(self, key, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype), None
        self._drain()
        slab = self.pool.acquire(nbytes)
        return slab[:nbytes].view(tensor.dtype).view(tensor.shape), slab

    def _adopted(self, key, slab):
        if slab is not None:
            self._slabs[key] = slab

    def _give_up(self, slab, event):
        if slab is not None:
            self._return_slab(slab, [] if event is None else [event])

    def _return_slab(self, slab, events: list) -> None:
        """Back to the pool, once the copies still running on it (``events``) have ended, never before. The
        pool keeps idle at most what the tier held at its peak (since the engine's last reset, a step): with
        no capacity set nothing else bounds it, and sizes that vary (sequence lengths) would leave an idle
        slab of every size class ever seen, pinned on a GPU machine."""
        if not events:
            self.pool.release(slab)
            self.pool.trim_idle_to(self.peak_bytes)
        else:
            with self._lock:
                self._draining.append((slab, events))

    def _drain(self, wait: bool = False) -> None:
        if wait:   # outside the lock: a copy thread finishing a failed write takes it before the next copy runs
            with self._lock:
                draining = list(self._draining)
            for _, events in draining:
                for event in events:
                    wait_completion(event)   # over, failed or not: the slab is free either way
        with self._lock:   # frees and given-up writes on other threads append to the list
            keep = []
            for slab, events in self._draining:
                if all(event.query() for event in events):
                    self.pool.release(slab)
                else:
                    keep.append((slab, events))
            self._draining = keep

    def _free(self, key):
        events = self._in_flight(key)
        super()._free(key)
        slab = self._slabs.pop(key, None)
        if slab is not None:
            self._return_slab(slab, events)

    def close(self):
        super().close()
        self._drain(wait=True)
        self.pool.trim()

    def stats(self):
        return {**super().stats(), "pool": self.pool.stats()}
