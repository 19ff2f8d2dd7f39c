"""A slab pool of aligned (and, where an accelerator exists, pinned) host buffers.

Pinning memory is slow (it maps and locks pages) and pinning per tensor fragments the address space:
DeepSpeed users meet pinned-memory OOMs and tune ``buffer_size`` / ``buffer_count`` by hand. The pool
hands out slabs in a small set of size classes (at most 1/16 larger than asked, above 64 KiB), takes them back when a
tensor is freed and hands them out again; sizes follow the tensors actually stored, so nothing is asked
of the user. Every slab starts on an ``alignment`` boundary, which O_DIRECT I/O needs.

A slab is reused only when nothing outside the pool still views its memory (a tensor returned by a
read, say); otherwise it is dropped and freed by Python when its last user lets go.
"""
from __future__ import annotations

import threading

import torch

from .memory import pinned_memory_available, registered_host

ALIGNMENT = 4096  # O_DIRECT needs offsets, lengths and addresses aligned to the logical block size


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def size_class(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """The slab size serving a request of ``nbytes``: a multiple of ``alignment``, with sixteen classes per
    power of two above 64 KiB (waste <= 6.25%: the slab is pinned memory the tier's budget counts)."""
    n = round_up(max(nbytes, 1), alignment)
    if n <= 64 * 1024:
        return n
    step = 1 << (n.bit_length() - 5)  # a sixteenth of the power of two below n
    return round_up(n, max(step, alignment))


def _use_count(buf: torch.Tensor) -> int | None:
    try:
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return None


def aligned_empty(nbytes: int, pinned: bool, alignment: int = ALIGNMENT) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose data starts on an ``alignment`` boundary."""
    raw = registered_host(nbytes) if pinned else None   # registered memory of its own size, on a page
    if raw is not None and raw.data_ptr() % alignment == 0:
        return raw
    if pinned:
        # torch's pinned allocator rounds every request up to a power of two, and its blocks start on a page
        # (cudaHostAlloc): ask for the bytes alone, since ``alignment`` more would double a slab whose size
        # is a power of two. Over-allocate only where a block is not aligned after all.
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % alignment == 0:
            return raw
        del raw
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pinned)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset:offset + nbytes]


def empty_aligned(shape, dtype: torch.dtype, pinned: bool | None = None) -> torch.Tensor:
    """An uninitialised tensor whose memory starts on a 4 KiB boundary (pinned where an accelerator exists,
    unless ``pinned`` says otherwise). The NVMe tier reads into and writes from such buffers in place;
    torch's own allocations start 64 bytes past a boundary and go through a staging copy."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = aligned_empty(max(nbytes, 1), pinned_memory_available() if pinned is None else pinned)
    return raw[:nbytes].view(dtype).view(shape)


class SlabPool:
    """Aligned host slabs by size class; ``limit_bytes`` bounds what is kept cached for reuse."""

    def __init__(self, pinned: bool | None = None, alignment: int = ALIGNMENT, limit_bytes: int | None = None):
        self.pinned = pinned_memory_available() if pinned is None else pinned
        self.alignment = alignment
        self.limit_bytes = limit_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []  # slabs behind tensors handed out for good (see lend)
        self._baseline: dict[int, int | None] = {}  # data_ptr of a slab -> its storage use count when idle
        self._lock = threading.Lock()
        self.reserved_bytes = 0  # slabs alive and known to the pool (in use or cached)
        self.cached_bytes = 0  # slabs idle in the pool
        self.peak_reserved_bytes = 0
        self.hits = self.misses = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A slab of at least ``nbytes`` (uint8, aligned). Give it back with :meth:`release`."""
        size = size_class(nbytes, self.alignment)
        if self._lent:
            self._reclaim()  # lent slabs whose users are gone serve this request, or make room
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self.hits += 1
                self.cached_bytes -= size
                return bucket.pop()
            self.misses += 1
            if self.limit_bytes is not None and self.reserved_bytes + size > self.limit_bytes:
                self._trim_locked(self.reserved_bytes + size - self.limit_bytes)
        slab = aligned_empty(size, self.pinned, self.alignment)
        with self._lock:
            self._baseline[slab.data_ptr()] = _use_count(slab)
            self.reserved_bytes += size
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return slab

    def lend(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of a slab for a caller who will never give it back explicitly (a read's result):
        the pool takes it back by itself once nothing views it any more. Reusing memory this way spares
        the page faults (and, with CUDA, the pinning) of a fresh allocation on every read."""
        slab = self.acquire(nbytes)
        with self._lock:
            self._lent.append(slab)
        return slab[:nbytes]  # a view: while it (or a view of it) lives, the slab stays lent

    def _reclaim(self) -> None:
        with self._lock:
            lent, self._lent = self._lent, []
        for slab in lent:
            baseline, count = self._baseline.get(slab.data_ptr()), _use_count(slab)
            if baseline is not None and count is not None and count <= baseline:
                self.release(slab)
            else:
                with self._lock:
                    self._lent.append(slab)

    def release(self, slab: torch.Tensor, exclusive: bool = False) -> None:
        """Take ``slab`` back; it is reused only if no view of it is alive outside the pool, or if the
        caller vouches (``exclusive=True``) that the views still alive will never be used again."""
        size = slab.numel()
        with self._lock:
            baseline = self._baseline.get(slab.data_ptr())
            count = _use_count(slab)
            if baseline is None or (not exclusive and (count is None or count > baseline)):
                self._forget_locked(slab)  # still viewed elsewhere: let Python free it later
                return
            self._free.setdefault(size, []).append(slab)
            self.cached_bytes += size
            if self.limit_bytes is not None and self.reserved_bytes > self.limit_bytes:
                self._trim_locked(self.reserved_bytes - self.limit_bytes)

    def trim_idle_to(self, nbytes: int) -> None:
        """Drop idle slabs (the largest first) until at most ``nbytes`` are kept idle."""
        with self._lock:
            if self.cached_bytes > nbytes:
                self._trim_locked(self.cached_bytes - nbytes)

    def trim(self) -> None:
        """Drop every idle slab, and stop tracking lent ones (they are freed with their last user)."""
        with self._lock:
            for slab in self._lent:
                self._forget_locked(slab)
            self._lent = []
            self._trim_locked(self.cached_bytes)

    def _forget_locked(self, slab: torch.Tensor) -> None:
        self._baseline.pop(slab.data_ptr(), None)
        self.reserved_bytes -= slab.numel()

    def _trim_locked(self, nbytes: int) -> None:
        for size in sorted(self._free, reverse=True):
            bucket = self._free[size]
            while bucket and nbytes > 0:
                slab = bucket.pop()
                self.cached_bytes -= size
                nbytes -= size
                self._forget_locked(slab)
        self._free = {k: v for k, v in self._free.items() if v}

    def stats(self) -> dict:
        return {"pinned": self.pinned, "reserved_bytes": self.reserved_bytes, "cached_bytes": self.cached_bytes,
                "lent": len(self._lent),
                "peak_reserved_bytes": self.peak_reserved_bytes, "hits": self.hits, "misses": self.misses}
