"""``nvme``: tensors in files under the configured path (DeepSpeed's ``nvme_path`` maps here).

Each tier owns one run directory (``<path>/lazytrain-run-<pid>-<random>``), removed when the tier is
closed and at a clean interpreter exit. While the tier lives it holds a lock on a file inside; a run
directory whose lock nobody holds was left by a process that was killed, and the next NVMe tier
started on the same path removes it (and says so). Each key is one file, written in requests of
``block_size * queue_depth`` bytes by a pool of ``intra_op_parallelism`` threads. Every block carries a
checksum, kept in memory and verified on every read: a truncated or corrupted file raises
:class:`NVMeDataError` naming the file and key, never returns wrong data. A full disk, an I/O error, a
read-only or missing path raise :class:`NVMeIOError` with the file, key and what to do; a failed write
removes its file and gives its key up, so nothing half-written reads back as valid.
"""
from __future__ import annotations

import atexit
import collections
import errno
import fcntl
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
import zlib
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Callable
from dataclasses import dataclass, field

import torch

from .base import Tier, TierError, TransferHandle, format_bytes
from . import streams
from .memory import async_copy
from .nvme_io import (ALIGNMENT, AioSettings, KvikioBackend, PosixBackend, device_checksums, kvikio_status,
                      probe_direct_io)
from .pool import SlabPool, aligned_empty, round_up

log = logging.getLogger("lazytrain.tiers.nvme")

_ERRNO_ADVICE = {
    errno.ENOSPC: "no space left on device; free disk space, lower the tier's capacity, or point nvme_path "
                  "at a larger disk",
    errno.EDQUOT: "disk quota exceeded; free space under your quota or point nvme_path elsewhere",
    errno.EIO: "I/O error reported by the device; check the disk (dmesg, smartctl) or use another nvme_path",
    errno.EROFS: "the filesystem is read-only; point nvme_path at a writable directory",
    errno.EACCES: "permission denied; point nvme_path at a directory you can write",
    errno.EPERM: "operation not permitted; point nvme_path at a directory you can write",
    errno.ENOENT: "the file or directory does not exist (was the run directory removed while training?)",
    errno.EMFILE: "too many open files in this process: each transfer in flight holds its file open; wait for "
                  "transfers before issuing more, or raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on this machine; raise the system's limit (fs.file-max) or run fewer "
                  "processes",
}


class NVMeIOError(TierError, OSError):
    """An NVMe tier operation failed in the operating system (ENOSPC, EIO, EROFS, ...)."""

    def __init__(self, message: str, err: int | None = None):
        TierError.__init__(self, message)
        self.errno = err


class NVMeDataError(TierError):
    """A file of the NVMe tier does not hold what was written (truncated or corrupted)."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(_byte_view(t).numpy()) if t.numel() else memoryview(bytearray())


def _lazy(t: torch.Tensor) -> bool:
    """A conjugate or negative view: its memory holds other values than it reads as (``x.conj()``)."""
    return t.is_conj() or t.is_neg()


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor. Flattened by its strides, not ``view(-1)``:
    a 0-dim tensor, or a contiguous one of one element with another stride (``x[:, 1]`` of a 1-row ``x``),
    has no byte view by ``view``."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


class _Landing:
    """Where the bytes of one file live in memory: bytes [0, split) in ``head`` and [split, end) in
    ``tail``. With O_DIRECT both must be aligned: an aligned tensor of unaligned size is moved in place
    up to its last whole 4 KiB, and its last partial block goes through a one-block bounce buffer."""

    def __init__(self, head: memoryview, split: int, tail: memoryview | None = None):
        self.head, self.split, self.tail = head, split, tail

    def iov(self, offset: int, length: int) -> list[memoryview]:
        end = offset + length
        parts = []
        if offset < self.split:
            parts.append(self.head[offset:min(end, self.split)])
        if end > self.split:
            parts.append(self.tail[max(offset, self.split) - self.split:end - self.split])
        return parts

    def checksums(self, offset: int, nbytes: int, block: int) -> list[int]:
        """Checksums of the blocks of bytes [offset, offset + nbytes) (offset is block-aligned)."""
        sums = []
        for start in range(offset, offset + nbytes, block):
            crc = 0
            for part in self.iov(start, min(block, offset + nbytes - start)):
                crc = zlib.crc32(part, crc)
            sums.append(crc)
        return sums


def _in_place(t: torch.Tensor, nbytes: int, file_bytes: int) -> _Landing | None:
    """A landing in ``t``'s own memory (plus a one-block bounce for its tail) when ``t`` is a contiguous,
    4 KiB-aligned CPU tensor whose memory holds its values (not a lazy conjugate or negative view); else
    None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % ALIGNMENT or nbytes == 0 or _lazy(t):
        return None
    split = nbytes - nbytes % ALIGNMENT
    tail = None
    if split < file_bytes:
        bounce = aligned_empty(ALIGNMENT, pinned=False)
        bounce.zero_()
        tail = _as_bytes(bounce)
    return _Landing(_as_bytes(t), split, tail)


@dataclass
class _Entry:
    key: str
    path: str
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    file_bytes: int  # bytes on disk: nbytes rounded up to ALIGNMENT (POSIX) or nbytes (kvikio)
    via_kvikio: bool
    checksums: list = field(default_factory=list)
    written: Future | None = None  # done when the file is complete
    readers: int = 0               # reads issued and not finished: the file stays until they are
    freed: bool = False            # the key was freed (or overwritten) while reads were in flight
    device: torch.device | None = None   # kvikio: the CUDA device the tensor was written from


class _Op:
    """One tensor's requests on the pool: completes ``future`` after the last one, with the first error."""

    def __init__(self, parts: int, finish):
        self.future: Future = Future()
        self._left = parts
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._finish = finish  # finish(error or None) -> result; runs once, after the last part

    def part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        try:
            result = self._finish(self._error)
        except BaseException as e:  # noqa: BLE001 - delivered to the waiter
            self.future.set_exception(e)
        else:
            self.future.set_result(result)


class _StagingBudget:
    """Bounds the host staging memory held by writes in flight (back-pressure instead of OOM): a write
    waits while earlier ones hold more than the limit. The limit follows the tensors: at least
    256 MiB, and twice the largest write seen."""

    def __init__(self, floor: int = 256 << 20):
        self.limit = floor
        self.in_use = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            self.limit = max(self.limit, 2 * nbytes)
            while self.in_use and self.in_use + nbytes > self.limit:
                self._cond.wait()
            self.in_use += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= nbytes
            self._cond.notify_all()


class _OpenFiles:
    """The files the tier holds open for transfers in flight (each until its requests are done), bounded:
    a burst of small transfers waits for earlier ones instead of failing with EMFILE. A transfer a caller
    issues waits (:meth:`take`); one that starts on an I/O thread (a read queued behind its key's write)
    must not block that thread, which what it waits for may need: it is parked (:meth:`take_or_park`) and
    started by the :meth:`give_back` that frees a place, the place passing to it."""

    def __init__(self, limit: int):
        self.limit, self.open = limit, 0
        self._parked: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._starting = threading.local()   # the starts this thread runs for places given back

    def take(self) -> None:
        with self._cond:
            while self.open >= self.limit:
                self._cond.wait()
            self.open += 1

    def take_or_park(self, start: Callable[[], None]) -> bool:
        """True: a place is taken, the caller starts now; False: ``start`` runs when one is given back."""
        with self._cond:
            if self.open < self.limit:
                self.open += 1
                return True
            self._parked.append(start)
            return False

    def give_back(self) -> None:
        with self._cond:
            start = self._parked.popleft() if self._parked else None
            if start is None:
                self.open -= 1
                self._cond.notify_all()
                return
        # the place passes on, outside the lock; a start that gives its place back at once (its file missing)
        # hands it to the next one from this loop, not from a deeper call
        pending = getattr(self._starting, "pending", None)
        if pending is not None:
            pending.append(start)
            return
        self._starting.pending = pending = collections.deque([start])
        try:
            while pending:
                pending.popleft()()
        finally:
            self._starting.pending = None


def _open_files_limit() -> int:
    """Transfers in flight at once: a quarter of the process's descriptor limit (at least 16; Linux's
    default limit is 1024 descriptors)."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):   # no such limit here
        return 256
    return 4096 if soft == resource.RLIM_INFINITY else max(16, soft // 4)


_LIVE_TIERS: "weakref.WeakSet[NVMeTier]" = weakref.WeakSet()


@atexit.register
def _close_live_tiers() -> None:
    for tier in list(_LIVE_TIERS):
        tier.close()


class NVMeTier(Tier):
    """Tensors in files under ``path``; see the module docstring.

    ``aio``: DeepSpeed's aio section (block_size, queue_depth, intra_op_parallelism / thread_count,
    use_gds; single_submit and overlap_events are accepted and have no effect). ``backend``: "auto"
    (kvikio for CUDA tensors where it works, POSIX O_DIRECT where the filesystem allows, else buffered),
    or "posix-odirect" / "posix-buffered" to force one. ``device``: where reads land by default.
    """

    kind = "nvme"
    runs_own_transfers = True

    def __init__(self, name: str = "nvme", capacity=None, path: str | os.PathLike | None = None,
                 aio: dict | AioSettings | None = None, backend: str = "auto", device=None):
        super().__init__(name, capacity, device)
        if path is None:
            raise ValueError(f"tier {name!r}: NVMeTier needs a path (nvme_path in the config)")
        self.settings = aio if isinstance(aio, AioSettings) else AioSettings.from_config(aio)
        if backend not in ("auto", "posix-odirect", "posix-buffered"):
            raise ValueError(f"tier {name!r}: backend must be 'auto', 'posix-odirect' or 'posix-buffered', "
                             f"got {backend!r}")
        self.root = os.path.abspath(os.fspath(path))
        self.run_dir: str | None = None
        self._closed = False
        self._pid = os.getpid()   # a forked child inherits this object, not the run directory
        self._entries: dict[str, _Entry] = {}
        self._reads: set[Future] = set()   # reads issued and not delivered: close() waits for them
        self._seq = 0
        self._kv_streams: dict[int, object] = {}  # per CUDA device: where kvikio's checksums and copies run
        self._check_path()
        name_part = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.run_dir = os.path.join(self.root, f"{RUN_PREFIX}{name_part}")
        self._owner_fd: int | None = None
        try:
            self._owner_fd = _make_run_dir(self.root, name_part, self.run_dir)
        except OSError as e:
            raise self._os_error(e, f"creating the run directory {self.run_dir}") from e
        try:
            self._choose_backends(backend)
        except BaseException:
            self._remove_run_dir()
            raise
        try:   # left-overs of ended processes: a failure here is theirs, never this tier's start-up
            stale_dirs = remove_stale_run_dirs(self.root)
        except OSError as e:
            stale_dirs = []
            log.warning("tier %r: could not sweep %s for run directories of ended processes: %s", name, self.root, e)
        for stale, nbytes in stale_dirs:
            log.warning("tier %r: removed %s (%s) left by a process that ended without closing its NVMe tier",
                        name, stale, format_bytes(nbytes))
        # Host staging slabs and read results, pinned where CUDA exists; at most 1 GiB kept idle.
        self.pool = SlabPool(limit_bytes=1 << 30)
        self._staging = _StagingBudget()
        self._files_open = _OpenFiles(_open_files_limit())
        self._executor = ThreadPoolExecutor(self.settings.intra_op_parallelism,
                                            thread_name_prefix=f"lazytrain-{name}-io")
        _LIVE_TIERS.add(self)
        log.info("tier %r: %s", name, self.backend_report)

    # ---- start-up ----------------------------------------------------------------------------
    def _check_path(self) -> None:
        if not os.path.exists(self.root):
            raise NVMeIOError(f"tier {self.name!r}: nvme_path {self.root} does not exist; create it or point "
                              f"nvme_path at an existing directory on a fast disk", errno.ENOENT)
        if not os.path.isdir(self.root):
            raise NVMeIOError(f"tier {self.name!r}: nvme_path {self.root} is not a directory", errno.ENOTDIR)
        st = os.statvfs(self.root)
        if st.f_flag & os.ST_RDONLY:   # before the permission check, which a read-only mount also fails
            raise NVMeIOError(f"tier {self.name!r}: nvme_path {self.root} is on a read-only filesystem; "
                              f"{_ERRNO_ADVICE[errno.EROFS]}", errno.EROFS)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise NVMeIOError(f"tier {self.name!r}: nvme_path {self.root} is not writable by this user; "
                              f"{_ERRNO_ADVICE[errno.EACCES]}", errno.EACCES)
        free = st.f_bavail * st.f_frsize
        if self.capacity is not None and self.capacity > free:
            raise NVMeIOError(f"tier {self.name!r}: its capacity is {format_bytes(self.capacity)} but only "
                              f"{format_bytes(free)} is free under {self.root}; lower the capacity or free "
                              f"disk space", errno.ENOSPC)

    def _choose_backends(self, backend: str) -> None:
        reasons = []
        if backend == "auto":
            try:
                direct, why = probe_direct_io(self.run_dir)
            except OSError as e:
                raise self._os_error(e, f"writing a probe file in {self.run_dir}") from e
            reasons.append(why)
        else:
            direct = backend == "posix-odirect"
            reasons.append(f"backend {backend!r} chosen in the config")
        self.backend = PosixBackend(direct)
        self.kvikio_backend = None
        if self.settings.use_gds is False:
            reasons.append("kvikio not used: aio.use_gds is false")
        else:
            module, why = kvikio_status()
            reasons.append(why)
            if module is not None:
                self.kvikio_backend = KvikioBackend(module, why)
            elif self.settings.use_gds:
                raise TierError(f"tier {self.name!r}: aio.use_gds is true but {why}")
        host = self.backend.name
        self.backend_name = f"kvikio (CUDA tensors) + {host} (host tensors)" if self.kvikio_backend else host
        self.backend_report = f"{self.backend_name}: " + "; ".join(reasons)

    # ---- errors ------------------------------------------------------------------------------
    def _os_error(self, e: OSError, doing: str, key: str | None = None) -> NVMeIOError:
        what = f" key {key!r}:" if key is not None else ""
        return NVMeIOError(f"tier {self.name!r}:{what} {doing} failed with {_cause(e)}", e.errno)

    # ---- files -------------------------------------------------------------------------------
    def _new_path(self, key: str) -> str:
        with self._lock:
            self._seq += 1
            seq = self._seq
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[:80]
        return os.path.join(self.run_dir, f"{seq:08d}-{safe}.bin")

    def _close_file(self, fd: int) -> None:
        """Close a transfer's file and give its place among the open files back (even if the close fails)."""
        try:
            self.backend.close(fd)
        finally:
            self._files_open.give_back()

    def _requests(self, file_bytes: int) -> list[tuple[int, int]]:
        step = self.settings.request_bytes
        return [(off, min(step, file_bytes - off)) for off in range(0, file_bytes, step)]

    # ---- write -------------------------------------------------------------------------------
    def _write(self, key, tensor, owned):
        if self._closed:
            raise TierError(f"tier {self.name!r} is closed")
        if tensor.is_cuda and self.kvikio_backend is not None:
            return self._write_kvikio(key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        file_bytes = round_up(nbytes, ALIGNMENT)
        path = self._new_path(key)
        entry = _Entry(key, path, nbytes, tensor.shape, tensor.dtype, file_bytes, False,
                       [0] * -(-nbytes // self.settings.block_size))
        self._files_open.take()   # given back with the file, by _close_file
        try:
            if self._closed:   # closed while this waited
                raise TierError(f"tier {self.name!r} is closed")
            fd = self.backend.open(path, write=True)
        except BaseException as e:   # an interrupt too: the place goes back
            self._files_open.give_back()
            if isinstance(e, OSError) and not isinstance(e, TierError):
                raise self._os_error(e, f"creating {path}", key) from e
            raise

        try:
            self.backend.allocate(fd, file_bytes)
        except OSError as e:
            self._close_file(fd)
            _unlink(path)
            raise self._os_error(e, f"reserving {format_bytes(file_bytes)} for {path}", key) from e

        # The bytes to write: the tensor's own memory when it is ours to keep and aligned, else a staging
        # slab (a snapshot, so the caller may reuse its tensor at once; pinned where CUDA exists).
        try:
            landing = _in_place(tensor, nbytes, file_bytes) if owned else None
        except BaseException:
            self._close_file(fd)
            _unlink(path)
            raise
        event = slab = None
        if landing is not None:
            if landing.tail is not None:  # the last partial block, zero-padded
                landing.tail[:nbytes - landing.split] = landing.head[landing.split:nbytes]
            data = tensor
        else:
            staged_bytes = 0
            try:
                self._staging.acquire(file_bytes)   # (an interrupt while it waits gives back the file)
                staged_bytes = file_bytes
                slab = self.pool.acquire(file_bytes)
                staged = slab[:nbytes].view(tensor.dtype).view(tensor.shape)
                slab[nbytes:file_bytes].zero_()
                if tensor.is_cuda:
                    event = async_copy(staged, tensor)._event
                else:
                    staged.copy_(tensor)
            except BaseException:  # out of memory, say: give back what was taken, leave no file
                self._staging.release(staged_bytes)
                if slab is not None:
                    self.pool.release(slab, exclusive=True)
                self._close_file(fd)
                _unlink(path)
                raise
            landing = _Landing(_as_bytes(slab[:file_bytes]), file_bytes)
            data = slab

        def finish(error):
            try:
                self._close_file(fd)
            except OSError as e:
                error = error or e
            if slab is not None:
                self.pool.release(slab, exclusive=True)  # our requests are done with it
                self._staging.release(file_bytes)
            if error is not None:
                _unlink(path)
                if isinstance(error, OSError) and not isinstance(error, TierError):
                    raise self._os_error(error, f"writing {path}", key) from error
                raise error
            return None

        requests = self._requests(file_bytes)
        op = _Op(max(1, len(requests)), finish)
        entry.written = op.future
        self._register(key, entry)
        self._submit_all(op, requests, self._write_request, fd, landing, nbytes, entry, event, data)
        return TransferHandle(future=op.future)

    def _submit_all(self, op: "_Op", requests: list, fn, fd, landing, *args) -> None:
        """Queue one ``fn`` per request of ``op``. A request that cannot be queued (the tier closed on
        another thread meanwhile) completes its part with the error, so ``op``'s finish still runs once
        and gives back the descriptor and staging memory."""
        queued = time.perf_counter()   # when each request is ready for the link (streams.transfer_ready)
        for i, (offset, length) in enumerate(requests):
            try:
                self._executor.submit(fn, op, fd, landing, offset, length, queued, *args)
            except RuntimeError as e:   # cannot schedule new futures after shutdown
                error = TierError(f"tier {self.name!r} is closed")
                error.__cause__ = e
                for _ in requests[i:]:
                    op.part_done(error)
                return
        if not requests:
            op.part_done()  # an empty tensor: an empty file

    def _write_request(self, op, fd, landing: _Landing, offset, length, queued, nbytes, entry, event, keepalive):
        try:
            ready = streams.transfer_ready(queued, [event] if event is not None else [])
            t0 = time.perf_counter()
            block = self.settings.block_size
            sums = landing.checksums(offset, min(length, max(0, nbytes - offset)), block)
            entry.checksums[offset // block:offset // block + len(sums)] = sums
            done = 0
            while done < length:
                n = self.backend.pwritev(fd, landing.iov(offset + done, length - done), offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "write returned no progress")
                done += n
            t0 = streams.emulate_link("nvme_write", length, ready, t0)
        except BaseException as e:  # noqa: BLE001 - delivered through the op's future
            op.part_done(e)
        else:
            streams.record("nvme_write", entry.key, t0, time.perf_counter(), bytes=length)
            op.part_done()

    def _write_kvikio(self, key, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        path = self._new_path(key)
        entry = _Entry(key, path, nbytes, tensor.shape, tensor.dtype, nbytes, True, device=tensor.device)
        staged = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
        event = async_copy(staged.view(tensor.dtype).view(tensor.shape), tensor)._event

        def job():
            try:
                event.synchronize()
                with streams.on_cuda_stream(self._kvikio_stream(staged.device)):
                    entry.checksums = device_checksums(staged, self.settings.block_size)
                written = self.kvikio_backend.write(path, staged)
                if written != nbytes:
                    raise OSError(errno.EIO, f"kvikio wrote {written} of {nbytes} bytes")
            except OSError as e:
                _unlink(path)
                raise self._os_error(e, f"writing {path} through kvikio", key) from e
            except BaseException:
                _unlink(path)
                raise
        entry.written = self._executor.submit(job)
        self._register(key, entry)
        return TransferHandle(future=entry.written)

    # ---- read --------------------------------------------------------------------------------
    def _read(self, key, out, device):
        if self._closed:
            raise TierError(f"tier {self.name!r} is closed")
        with self._lock:   # looked up and counted as a reader at once: a free in between cannot unlink it
            entry = self._entries.get(key)
            if entry is None:
                raise TierError(f"tier {self.name!r} holds no tensor under key {key!r}")
            entry.readers += 1
        if out is not None and (out.shape != entry.shape or out.dtype != entry.dtype):
            self._reader_done(entry)
            raise ValueError(f"tier {self.name!r}: read of {key!r} into a buffer of {tuple(out.shape)} {out.dtype}, "
                             f"but it holds {tuple(entry.shape)} {entry.dtype}")
        target = out.device if out is not None else (device or self.device)
        follow, ordered_after = streams.ordering()
        issued = None
        try:
            if out is None and target.type == "cuda":
                # the destination is allocated here, on the caller's stream, and the copy follows what that
                # stream queued so far: allocated later on an I/O thread it could be a block the caller's kernels
                # freed after this call and have not run yet, which the copy (or kvikio's DMA) would overwrite
                out = torch.empty(entry.shape, dtype=entry.dtype, device=target)
                follow = True
            if not follow:   # the caller named what the copy must wait for (the destination's last reader)
                issued = ordered_after
            elif target.type == "cuda":  # the copy into device memory follows what the caller queued so far
                issued = torch.cuda.Event()
                issued.record(torch.cuda.current_stream(target))
        except BaseException:   # no read was started: the file may go
            self._reader_done(entry)
            raise
        result: Future = Future()
        with self._lock:
            self._reads.add(result)
        result.add_done_callback(self._read_delivered)

        def fail(error):   # the file is released before the caller sees the outcome
            self._reader_done(entry)
            result.set_exception(error)

        def deliver(inner):
            self._reader_done(entry)
            _chain(inner, result)

        def launch():   # a POSIX read holds a place among the open files: _start_read gives it back
            try:
                inner = self._start_read(entry, out, target, issued)
            except BaseException as e:  # noqa: BLE001
                fail(e)
                return
            inner.add_done_callback(deliver)

        def start(written=None):   # called with the write's future: on the thread that finished it
            if entry.written.exception() is not None:
                fail(TierError(f"tier {self.name!r}: key {key!r} cannot be read: its write "
                               f"failed ({entry.written.exception()})"))
            elif entry.via_kvikio:
                launch()
            elif written is None:
                self._files_open.take()
                launch()
            elif self._files_open.take_or_park(launch):
                launch()
        if entry.written.done():
            start()
        else:
            entry.written.add_done_callback(start)  # read after the write lands
        return TransferHandle(future=result)

    def _read_delivered(self, result: Future) -> None:
        with self._lock:
            self._reads.discard(result)

    def _start_read(self, entry: _Entry, out, target: torch.device, issued) -> Future:
        """A POSIX read is called with a place taken among the open files, which it gives back with its file."""
        if entry.via_kvikio:
            return self._executor.submit(self._read_kvikio, entry, out, target, issued)
        try:
            fd = self.backend.open(entry.path, write=False)
        except BaseException as e:   # an interrupt too: the place goes back
            self._files_open.give_back()
            if not isinstance(e, OSError):
                raise
            if e.errno == errno.ENOENT:
                raise NVMeDataError(f"tier {self.name!r}: key {entry.key!r}: its file {entry.path} is missing") from e
            raise self._os_error(e, f"opening {entry.path}", entry.key) from e

        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            self._close_file(fd)
            raise self._os_error(e, f"inspecting {entry.path}", entry.key) from e
        if size < entry.file_bytes:
            self._close_file(fd)
            raise NVMeDataError(f"tier {self.name!r}: key {entry.key!r}: file {entry.path} is truncated: "
                                f"{size} bytes on disk, {entry.file_bytes} written")

        # Land the bytes in their final place when that is aligned CPU memory (a new aligned tensor when
        # the caller gave no buffer). Else read into a staging slab and copy: each request copies its own
        # range into a contiguous CPU buffer; other buffers (CUDA, strided) get one copy at the end.
        slab = scatter = None
        try:
            landing = _in_place(out, entry.nbytes, entry.file_bytes) if out is not None else None
            if landing is not None:
                value = out
            elif out is None and target.type == "cpu":
                dest = self.pool.lend(entry.file_bytes)
                landing = _Landing(_as_bytes(dest), entry.file_bytes)
                value = dest[:entry.nbytes].view(entry.dtype).view(entry.shape)
            else:
                slab = self.pool.acquire(max(entry.file_bytes, 1))
                landing = _Landing(_as_bytes(slab[:entry.file_bytes]), entry.file_bytes)
                value = None
                if out is not None and out.device.type == "cpu" and out.is_contiguous() and not _lazy(out):
                    scatter = (_byte_view(out), slab)
                    value = out
        except BaseException:   # no memory to land in: the file goes back closed
            self._close_file(fd)
            if slab is not None:
                self.pool.release(slab, exclusive=True)
            raise

        def finish(error):
            try:
                self._close_file(fd)
            except OSError:
                pass
            try:
                if error is not None:
                    if isinstance(error, OSError) and not isinstance(error, TierError):
                        raise self._os_error(error, f"reading {entry.path}", entry.key) from error
                    raise error
                if value is not None:
                    return value
                staged = slab[:entry.nbytes].view(entry.dtype).view(entry.shape)
                dst = out if out is not None else torch.empty(entry.shape, dtype=entry.dtype, device=target)
                handle = async_copy(dst, staged, after=issued, follow_current=False)
                handle.synchronize()  # the slab goes back to the pool below
                return dst
            finally:
                if slab is not None:
                    self.pool.release(slab, exclusive=True)  # our requests are done with it

        requests = self._requests(entry.file_bytes)
        op = _Op(max(1, len(requests)), finish)
        self._submit_all(op, requests, self._read_request, fd, landing, entry, scatter)
        return op.future

    def _read_request(self, op, fd, landing: _Landing, offset, length, queued, entry: _Entry, scatter):
        try:
            ready = streams.transfer_ready(queued)
            t0 = time.perf_counter()
            done = 0
            while done < length:
                n = self.backend.preadv(fd, landing.iov(offset + done, length - done), offset + done)
                if n <= 0:
                    raise NVMeDataError(f"tier {self.name!r}: key {entry.key!r}: file {entry.path} is truncated: "
                                        f"it ends at byte {offset + done}, {entry.file_bytes} were written")
                done += n
            block = self.settings.block_size
            real = min(length, max(0, entry.nbytes - offset))
            sums = landing.checksums(offset, real, block)
            first = offset // block
            for i, s in enumerate(sums):
                if s != entry.checksums[first + i]:
                    start = (first + i) * block
                    raise NVMeDataError(
                        f"tier {self.name!r}: key {entry.key!r}: file {entry.path} is corrupted: checksum "
                        f"mismatch in block {first + i} (bytes {start}..{min(start + block, entry.nbytes) - 1})")
            if scatter is not None:
                dst, src = scatter
                dst[offset:offset + real].copy_(src[offset:offset + real])
            elif landing.tail is not None and offset + length > landing.split:  # the bounced last block
                landing.head[landing.split:entry.nbytes] = landing.tail[:entry.nbytes - landing.split]
            t0 = streams.emulate_link("nvme_read", length, ready, t0)
        except BaseException as e:  # noqa: BLE001
            op.part_done(e)
        else:
            streams.record("nvme_read", entry.key, t0, time.perf_counter(), bytes=length)
            op.part_done()

    def _read_kvikio(self, entry: _Entry, out, target: torch.device, issued):
        # a read to the host lands first on the GPU the tensor came from; "cuda" would mean this I/O thread's
        # current device, which is GPU 0 whatever device the caller's rank uses
        device = out.device if out is not None and out.is_cuda else (target if target.type == "cuda" else
                                                                      entry.device)
        if issued is not None:
            issued.synchronize()  # kvikio writes device memory outside any stream: the caller's work first
        if out is not None and out.is_cuda and out.is_contiguous():
            dest = _byte_view(out) if entry.nbytes else out
        else:   # a bounce buffer used on the kvikio stream alone, from its pool; kvikio's DMA runs outside any
            # stream, so the kernels other I/O threads queued there (whose freed temporaries the block may be)
            # finish first
            stream = self._kvikio_stream(device)
            with streams.on_cuda_stream(stream):
                dest = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
            stream.synchronize()
        try:
            got = self.kvikio_backend.read(entry.path, dest) if entry.nbytes else 0
        except FileNotFoundError as e:
            raise NVMeDataError(f"tier {self.name!r}: key {entry.key!r}: its file {entry.path} is missing") from e
        except OSError as e:
            raise self._os_error(e, f"reading {entry.path} through kvikio", entry.key) from e
        if got != entry.nbytes:
            raise NVMeDataError(f"tier {self.name!r}: key {entry.key!r}: file {entry.path} is truncated: read "
                                f"{got} of {entry.nbytes} bytes")
        with streams.on_cuda_stream(self._kvikio_stream(device)):  # off the compute stream
            sums = device_checksums(dest, self.settings.block_size)
            block = self.settings.block_size
            for i, (s, expected) in enumerate(zip(sums, entry.checksums)):
                if s != expected:
                    raise NVMeDataError(
                        f"tier {self.name!r}: key {entry.key!r}: file {entry.path} is corrupted: checksum mismatch "
                        f"in block {i} (bytes {i * block}..{min((i + 1) * block, entry.nbytes) - 1})")
            value = dest.view(entry.dtype).view(entry.shape)
            if out is not None:
                if value.data_ptr() != out.data_ptr() or not out.is_cuda:
                    out.copy_(value)
                value = out  # the caller's own tensor object, as from every other path
            elif target.type != "cuda":
                value = value.to(target)
            torch.cuda.current_stream(device).synchronize()
        return value

    def _kvikio_stream(self, device: torch.device):
        with self._lock:
            key = device.index if device.index is not None else torch.cuda.current_device()
            if key not in self._kv_streams:
                self._kv_streams[key] = torch.cuda.Stream(device=key)
            return self._kv_streams[key]

    # ---- free / close ------------------------------------------------------------------------
    def _free(self, key):
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None or not self._retire(entry):
                return
        _unlink(entry.path)        # writes in flight hold their own descriptors

    def _footprint(self, tensor, owned):
        """A file takes whole 4 KiB blocks of the disk: the budget counts those."""
        return round_up(tensor.numel() * tensor.element_size(), ALIGNMENT)

    def _register(self, key: str, entry: _Entry) -> None:
        """Make ``entry`` the file behind ``key``, unless another thread freed or rewrote the key while
        this write was being set up: then its file goes at once. A file it supersedes goes like a freed
        one. So no file outlives its key."""
        with self._lock:
            if self._write_is_current(key):
                stale = self._entries.get(key)
                self._entries[key] = entry
            else:
                stale = entry
            if stale is None or not self._retire(stale):
                return
        _unlink(stale.path)

    @staticmethod
    def _retire(entry: _Entry) -> bool:
        """With the lock held: ``entry`` no longer backs its key. True when its file can go now; else it
        goes when the last read issued on it is done (``_reader_done``)."""
        if entry.readers:
            entry.freed = True
            return False
        return True

    def _reader_done(self, entry: _Entry) -> None:
        with self._lock:
            entry.readers -= 1
            unlink = entry.freed and entry.readers == 0
        if unlink:
            _unlink(entry.path)

    def file_of(self, key: str) -> str:
        """The file holding ``key`` (for diagnostics)."""
        return self._entries[key].path

    def close(self) -> None:
        """Wait for I/O in flight, then remove the run directory. Safe to call twice. In a forked child (its
        atexit, or the object collected there) the tier is only marked closed: the files are the parent's."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            _LIVE_TIERS.discard(self)
            return
        for entry in list(self._entries.values()):
            if entry.written is not None:
                try:
                    entry.written.exception()  # wait
                except BaseException:  # noqa: BLE001
                    pass
        # a read issued before a write landed starts from that write's callback, which may run after the
        # waits above return: wait for every read to be delivered before the pool stops taking requests
        with self._lock:
            reads = list(self._reads)
        futures_wait(reads)
        self._executor.shutdown(wait=True)
        self._entries.clear()
        with self._lock:
            self._sizes.clear()
            self._tokens.clear()
            self.used_bytes = 0
        self._remove_run_dir()
        self.pool.trim()
        _LIVE_TIERS.discard(self)

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._owner_fd is not None:
            os.close(self._owner_fd)  # releases the lock that marked the directory as in use
            self._owner_fd = None

    def __del__(self):
        try:
            if not self._closed and self.run_dir is not None:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def stats(self):
        return {**super().stats(), "backend": self.backend_name, "backend_report": self.backend_report,
                "path": self.run_dir, "block_size": self.settings.block_size,
                "queue_depth": self.settings.queue_depth,
                "intra_op_parallelism": self.settings.intra_op_parallelism,
                "staging_pool": self.pool.stats()}


RUN_PREFIX = "lazytrain-run-"
STAGING_PREFIX = ".lazytrain-new-"
STAGING_STALE_S = 300.0   # a run directory still being prepared this long after it was made was left over
_OWNER_LOCK = ".owner.lock"


def _make_run_dir(root: str, name_part: str, run_dir: str) -> int | None:
    """Create ``run_dir`` holding a lock file locked (flock) by this process for the tier's lifetime, so
    that a run directory without a held lock is known to be left over. The directory is prepared under
    a temporary name and renamed, so no one ever sees it unlocked. Returns the lock's descriptor, or None
    on filesystems without flock (their directories are then never judged left over)."""
    staging = os.path.join(root, f"{STAGING_PREFIX}{name_part}")
    os.mkdir(staging, 0o700)
    fd = None
    try:
        fd = os.open(os.path.join(staging, _OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            fd = None
        os.rename(staging, run_dir)
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return fd


def remove_stale_run_dirs(root: str) -> list[tuple[str, int]]:
    """Remove run directories under ``root`` whose owner lock is not held: their process ended without
    closing its tier (killed, crashed). A directory still under its staging name (a process killed while
    making it) goes too once ``STAGING_STALE_S`` old with its lock free: younger, it may be another
    process's in the making. Returns (directory, bytes freed) for each one removed."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(STAGING_PREFIX):
            try:
                if time.time() - os.stat(path).st_mtime < STAGING_STALE_S:
                    continue
            except OSError:
                continue
        elif not name.startswith(RUN_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(path, _OWNER_LOCK), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            if name.startswith(STAGING_PREFIX) and os.path.isdir(path):
                removed.append(_remove_dir(path))   # killed before it made its lock file
            continue  # else no lock file: not a directory this version made, leave it alone
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its tier is alive
            try:   # another process starting beside this one may have removed the directory meanwhile (its
                if os.fstat(fd).st_ino != os.stat(os.path.join(path, _OWNER_LOCK)).st_ino:   # lock file too)
                    continue
            except OSError:
                continue
            removed.append(_remove_dir(path))
        finally:
            os.close(fd)
    return removed


def _remove_dir(path: str) -> tuple[str, int]:
    """Remove a left-over run directory: (its path, the bytes its files held). One already gone (removed by
    another process sweeping the same path) frees nothing and is no error."""
    nbytes = 0
    try:
        for entry in os.scandir(path):
            try:
                nbytes += entry.stat(follow_symlinks=False).st_size
            except OSError:
                pass
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    return path, nbytes


def _unlink(path: str) -> None:
    """Remove a file that backs no key any more. A failure is not the training's: the key is gone either
    way, so it is reported (with the cause and the fix) and the file left for the tier's close."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        warnings.warn(f"lazytrain: NVMe tier: could not remove {path}, which holds no tensor any more ({_cause(e)}); "
                      f"it stays on disk until the tier is closed", RuntimeWarning, stacklevel=2)


def _cause(e: OSError) -> str:
    """``CODE: what it means and what to do`` for an OS error (EROFS, ENOSPC, ...)."""
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "?"
    return f"{code}: {_ERRNO_ADVICE.get(e.errno, e.strerror or str(e))}"


def _chain(source: Future, target: Future) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
