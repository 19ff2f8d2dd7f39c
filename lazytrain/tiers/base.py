"""The Tier contract: one asynchronous interface for every place a tensor can live.

A tier stores tensors by key. ``write`` and ``read`` return a :class:`TransferHandle` at once; the
caller waits on it (or awaits it from asyncio) only when it needs the data, so the engine never blocks
the compute stream on I/O it could have started earlier. A tier knows its capacity and its current
and peak use, and refuses a write that would exceed its budget with an error that names the tier,
its budget and the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from abc import ABC, abstractmethod
import concurrent.futures
from concurrent.futures import Future
from typing import Any

import torch

from ..units import parse_size as parse_bytes  # noqa: F401 - the tiers' name for it
from . import streams

_log = logging.getLogger("lazytrain.tiers")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class TierError(RuntimeError):
    """A tier operation failed; the message names the tier and the key."""


class TierBudgetError(TierError, MemoryError):
    """A write would exceed a tier's budget."""


class TransferHandle:
    """An asynchronous tier operation: ``wait()`` returns its result (the tensor, for reads).

    It wraps either a finished value, a ``concurrent.futures.Future`` (thread-pool I/O) or a CUDA
    event (copies on a side stream). For CUDA events, ``wait()`` orders the *current stream* after the
    copy without blocking the host, except when the result lives in host memory (``host=True``): the
    host is about to use it, so ``wait()`` blocks until the copy is done. ``synchronize()`` always
    blocks the host.
    """

    __slots__ = ("_value", "_future", "_event", "_keepalive", "_host", "_timing", "_moved")

    def __init__(self, value: Any = None, future: Future | None = None, event: Any = None, keepalive: Any = None,
                 host: bool = False, timing: tuple[Any, Any] | None = None, moved: bool = True):
        self._value, self._future, self._event, self._keepalive = value, future, event, keepalive
        self._host = host
        self._moved = moved   # False: no bytes were copied (a stored tensor handed out or kept as given)
        # (start, end) timing events around a copy queued on a side stream: the bandwidth meters time
        # the copy on the device, from when it starts to when it ends, not when the host queued it
        self._timing = timing

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        if self._event is not None:
            return self._event.query()
        return True

    def completion(self) -> Any:
        """What says the transfer is over (a Future, a CUDA or host event, or None when it is), for
        another thread to wait on with :func:`wait_completion` while this handle goes on being used."""
        return self._future if self._future is not None else self._event

    def wait(self) -> Any:
        if self._future is not None:
            self._value = _result_of(self._future)
            self._future = None
        if self._event is not None:
            if self._host or getattr(self._event, "on_host", False):   # the host uses it, or a host copy thread made it
                self._event.synchronize()
                self._event = self._keepalive = None
            else:
                device = self._event.device if hasattr(self._event, "device") else None
                torch.cuda.current_stream(device).wait_event(self._event)
        return self._value

    def synchronize(self) -> Any:
        # The host blocks until the copy is over, so no stream needs to wait for it too. A stream wait
        # (what ``wait`` queues for a device result) would land on the calling thread's current stream:
        # on a worker thread (an NVMe read's I/O thread) that is the default stream, the compute stream,
        # which would then stall on a copy it never asked for.
        if self._future is not None:
            self._value = _result_of(self._future)
            self._future = None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._keepalive = None
        return self._value

    def __await__(self):
        if self._future is not None:   # waited for without raising its error, then raised as wait() raises it
            future = self._future

            async def done():
                wrapped = asyncio.wrap_future(future)
                await asyncio.wait([wrapped])
                if not wrapped.cancelled():
                    wrapped.exception()   # retrieved: the loop does not report it as never retrieved
                return self.wait()
            return done().__await__()
        if self._event is not None:
            return asyncio.get_event_loop().run_in_executor(None, self.synchronize).__await__()
        async def ready():
            return self._value
        return ready().__await__()


class _CheckedRead(TransferHandle):
    """A read from a user's tier: what it gives back is checked against what was written (a tensor of the
    same dtype and shape), so that a tier returning another precision or size fails naming itself and the
    key, instead of training on rounded values or failing later in a kernel. Every call goes to the tier's
    own handle (which may be a subclass of its own)."""

    __slots__ = ("_inner", "_check")

    def __init__(self, inner: TransferHandle, tier: "Tier", key: str, dtype: torch.dtype, shape: torch.Size):
        super().__init__(moved=inner._moved)   # its own fields stay unused
        self._inner = inner

        def check(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                got = f"a {type(value).__name__}"
            elif value.dtype != dtype or value.shape != shape:
                got = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            else:
                return value
            raise TierError(f"tier {tier.name!r} ({type(tier).__name__}) gave back {got} for {key!r}, which "
                            f"was written as a {dtype} tensor of shape {tuple(shape)}: a tier's read must return "
                            f"the tensor as written")
        self._check = check

    def done(self) -> bool:
        return self._inner.done()

    def completion(self) -> Any:
        return self._inner.completion()

    def wait(self) -> Any:
        return self._check(self._inner.wait())

    def synchronize(self) -> Any:
        return self._check(self._inner.synchronize())

    def __await__(self):
        value = yield from self._inner.__await__()
        return self._check(value)


def _result_of(future: Future) -> Any:
    """The future's result, or its error raised as this waiter's own copy. The stored error is shared (the
    future's other waiters, the tier's record of a failed key): raised itself, it would gain the frames of
    every caller it passes through (an executor's backward, holding its pass) and keep them alive as long
    as the future or the record lives."""
    error = future.exception()   # waits; unlike result(), adds no frame to the stored error's traceback
    if error is not None:
        raise _waiters_copy(error)
    return future.result()


def _waiters_copy(error: BaseException) -> BaseException:
    """``error`` with its type, arguments, attributes, cause and traceback so far, as a new object (the
    error itself where it cannot be copied: an exception whose constructor does not take its own args)."""
    try:
        fresh = copy.copy(error)
        if isinstance(error, OSError):   # fields an OSError may have set after it was made, outside its args
            for field in ("errno", "strerror", "filename", "filename2"):
                if getattr(fresh, field) != getattr(error, field):   # (setting None would change its message)
                    setattr(fresh, field, getattr(error, field))
    except Exception:   # noqa: BLE001 - any failure to rebuild it: raise the original
        return error
    if type(fresh) is not type(error) or str(fresh) != str(error):
        return error
    if isinstance(getattr(error, "__notes__", None), list):   # a waiter's add_note stays its own
        fresh.__notes__ = list(error.__notes__)
    fresh.__cause__, fresh.__context__ = error.__cause__, error.__context__
    fresh.__suppress_context__ = error.__suppress_context__
    return fresh.with_traceback(error.__traceback__)


def completion_reached(done: Any) -> bool:
    """Whether a :meth:`TransferHandle.completion` is reached (never blocks)."""
    if done is None:
        return True
    return done.done() if isinstance(done, Future) else done.query()


def wait_completion(done: Any) -> None:
    """Block until a :meth:`TransferHandle.completion` is reached; its outcome is the handle owner's to
    report, so a failure is not raised here."""
    if done is None:
        return
    if isinstance(done, Future):
        concurrent.futures.wait([done])
    else:
        try:
            done.synchronize()
        except Exception:  # noqa: BLE001 - the handle's owner reports it
            pass


def wait_completions(completions: list, what: str, device) -> None:
    """Block until every :meth:`TransferHandle.completion` in ``completions`` is reached, traced as one wait
    of the compute side named ``what`` where any is not yet; failures are the handles' owners' to report."""
    if all(completion_reached(done) for done in completions):
        return
    with streams.wait_span(what, device):
        for done in completions:
            wait_completion(done)


class _BandwidthMeter:
    """Bytes moved over the wall time during which at least one operation was in flight.

    Host-side operations are timed from issue to completion. Copies queued on a CUDA side stream return
    before they run, so they are timed by their own start and end events instead (``end_on_device``),
    once those events have completed; copies on one side stream run one after another, so their
    device times add up without overlap."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._queued: list[tuple[Any, Any, int]] = []  # device copies whose end event has not been seen yet
        self.seconds = 0.0
        self.nbytes = 0

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def end(self, nbytes: int) -> None:
        with self._lock:
            self._active -= 1
            self.nbytes += nbytes
            if self._active == 0:
                self.seconds += time.perf_counter() - self._since

    def _leave_untimed(self) -> None:
        """Close an operation without adding its host wall time (caller holds the lock)."""
        self._active -= 1
        if self._active == 0:
            self._since = time.perf_counter()

    def cancel(self) -> None:
        """Close an operation that moved no bytes: it adds neither bytes nor time."""
        with self._lock:
            self._leave_untimed()

    def end_on_device(self, start: Any, end: Any, nbytes: int) -> None:
        """Close an operation that was only queued: its time is ``start.elapsed_time(end)`` once it ran."""
        with self._lock:
            self._leave_untimed()  # the host only queued it: that wall time is not transfer time
            self._queued.append((start, end, nbytes))
            if len(self._queued) > 64:
                self._collect()

    def _collect(self) -> None:
        """Add the device times of queued copies that have finished (caller holds the lock)."""
        pending = []
        for start, end, nbytes in self._queued:
            if end.query():
                self.seconds += start.elapsed_time(end) / 1e3
                self.nbytes += nbytes
            else:
                pending.append((start, end, nbytes))
        self._queued = pending

    def bandwidth(self) -> float | None:
        with self._lock:
            self._collect()
            return self.nbytes / self.seconds if self.seconds > 0 and self.nbytes > 0 else None


class Tier(ABC):
    """Base class of every tier. Subclasses implement ``_write``, ``_read`` and ``_free``.

    Accounting (capacity, used, peak, bandwidth) lives here so that every tier, built-in or a
    user's own, enforces its budget the same way.
    """

    kind: str = "abstract"
    # the built-in tiers run their own transfers on copy threads or I/O threads (with chaos and emulated
    # links); a user's tier does not, so with copy threads on its reads run on a copy thread of its own
    # and its writes complete there, each after a chaos delay, for the engine's ordering to meet them late
    runs_own_transfers: bool = False
    # where the capacity was given ("config key 'lazytrain.nvme_memory'"), for the over-budget error to name it
    capacity_source: str | None = None

    def __init__(self, name: str, capacity: int | str | None = None, device: torch.device | str | None = None):
        self.name = name
        self.capacity = parse_bytes(capacity, f"capacity of tier {name!r}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())  # compare equal to tensors' devices
        self._sizes: dict[str, int] = {}     # key -> bytes it holds against the budget (see _footprint)
        self._payload: dict[str, int] = {}   # key -> bytes of the tensor itself
        self._lock = threading.RLock()
        self.used_bytes = 0
        self.peak_bytes = 0
        self._tokens: dict[str, object] = {}
        self._written_as: dict[str, tuple[torch.dtype, torch.Size]] = {}   # key -> what its read must give back
        self._failed: dict[str, BaseException] = {}  # keys whose asynchronous write failed, until rewritten
        self._writing = threading.local()   # .token: the reservation of the write this thread is issuing
        self._meters = {"read": _BandwidthMeter(), "write": _BandwidthMeter()}

    # ---- public API ------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, owned: bool = False) -> TransferHandle:
        """Store a snapshot of ``tensor`` under ``key``. ``owned=True``: the caller gives the tensor
        up, so a tier may keep it without copying. Overwriting a key frees the old value first; an
        overwrite the budget refuses leaves the old value in place.

        A CPU tensor may be reused as soon as ``write`` returns. A CUDA tensor is copied on a side stream
        ordered after the work already queued on the current stream: kernels queued later must not
        modify it until the handle is done (wait on it first, or let the tensor die: its memory is kept
        until the copy ends). A read of ``key`` issued before the write finishes sees the written data."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tier {self.name!r}: write of {key!r} needs a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach()   # the values, never autograd history (a Parameter is stored as plain data)
        nbytes = tensor.numel() * tensor.element_size()
        need = self._footprint(tensor, owned)
        with self._lock:  # atomic with a failed write's clean-up of the same key
            if key in self._sizes:
                # a refused overwrite keeps the old value: check the budget before letting it go
                self._check_budget(key, need, self.used_bytes - self._sizes[key], nbytes)
                self.free(key)
            self._failed.pop(key, None)
            token = self._reserve(key, need, nbytes)
            self._written_as[key] = (tensor.dtype, tensor.shape)
        meter = self._meters["write"]
        meter.begin()
        self._writing.token = token          # lets _write tell whether its reservation is still current
        try:
            with self._errors_named("writing", key):
                handle = self._write(key, tensor, owned)
                self._check_handle(handle, "_write", key)
                if self._on_copy_thread(tensor.device):
                    handle = self._completed_late(handle)
        except BaseException:
            meter.cancel()   # a failed operation moved nothing: its time is not the link's
            self._release(key)
            raise
        finally:
            self._writing.token = None
        self._track(handle, meter, nbytes, key, token)
        return handle

    def read(self, key: str, out: torch.Tensor | None = None, device: torch.device | str | None = None) -> TransferHandle:
        """Fetch ``key``: into ``out`` when given (no extra copy), else as a new tensor on ``device``
        (default: the tier's own device)."""
        nbytes = self._payload.get(key) if key in self._sizes else None   # one lookup: a free may come between
        if nbytes is None:
            failure = self._failed.get(key)
            if failure is not None:
                raise TierError(f"tier {self.name!r} holds no tensor under key {key!r}: its write failed: "
                                f"{failure}") from failure
            raise TierError(f"tier {self.name!r} holds no tensor under key {key!r}")
        written_as = self._written_as.get(key)
        device = torch.device(device) if device is not None else None
        if out is not None and not self.runs_own_transfers and written_as is not None and \
                (out.dtype, out.shape) != written_as:   # a user's tier is not asked to convert: the caller's mistake
            raise TierError(f"tier {self.name!r}: read of {key!r} into a buffer of {tuple(out.shape)} {out.dtype}, "
                            f"but it holds {tuple(written_as[1])} {written_as[0]}")
        meter = self._meters["read"]
        meter.begin()
        try:
            with self._errors_named("reading", key):
                if self._on_copy_thread(out.device if out is not None else device or self.device):
                    handle = self._completed_late(lambda: self._read_if_held(key, out, device))
                else:
                    handle = self._read(key, out, device)
                    self._check_handle(handle, "_read", key)
        except BaseException:
            meter.cancel()   # a failed operation moved nothing: its time is not the link's
            raise
        self._track(handle, meter, nbytes)
        if not self.runs_own_transfers and written_as is not None:   # a user's tier: what it gives back is checked
            handle = _CheckedRead(handle, self, key, *written_as)
        return handle

    def _check_handle(self, handle, method: str, key: str) -> None:
        """A user's tier that returned something else (the tensor, a Future) failed later on a bare
        AttributeError, with the key still holding its budget."""
        if not isinstance(handle, TransferHandle):
            raise TierError(f"tier {self.name!r} ({type(self).__name__}): {method} of {key!r} returned "
                            f"{type(handle).__name__}, not a TransferHandle (TransferHandle(value=tensor) for work "
                            f"done, TransferHandle(future=f) for work on a thread pool)")

    @contextlib.contextmanager
    def _errors_named(self, doing: str, key: str):
        """Around a call into a user's tier: its own error, raised as it was called, is raised as a TierError
        naming the tier and the key, with it as the cause (a built-in tier's, and a TierError, as they are)."""
        try:
            yield
        except Exception as e:
            if self.runs_own_transfers or isinstance(e, TierError):
                raise
            raise TierError(f"tier {self.name!r} ({type(self).__name__}) failed {doing} {key!r}: "
                            f"{type(e).__name__}: {e}") from e

    def free(self, key: str) -> None:
        """Drop ``key`` (no-op when absent); a tier may keep the memory or file for reuse."""
        with self._lock:
            self._failed.pop(key, None)
            if key not in self._sizes:
                return
            try:
                with self._errors_named("freeing", key):
                    self._free(key)
            finally:
                self._release(key)   # its budget given back either way: a key the tier failed to free is gone

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def keys(self) -> list[str]:
        return list(self._sizes)

    def close(self) -> None:
        """Free every key; every one is freed even where one fails, then the first failure is raised."""
        first = None
        for key in list(self._sizes):
            try:
                self.free(key)
            except Exception as e:   # noqa: BLE001 - raised below, once the rest are freed
                first = first or e
        if first is not None:
            raise first

    def reset_peak(self) -> None:
        self.peak_bytes = self.used_bytes

    @property
    def free_bytes(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used_bytes

    def read_bandwidth(self) -> float | None:
        """Bytes per second of reads so far: bytes over the wall time during which at least one read
        was in flight (so concurrent reads are not double-counted). Thread-pool tiers are timed to
        completion; copies on a CUDA side stream by their start and end events once they have run
        (bytes still in flight are not counted yet); reads that hand out a stored tensor without
        copying are not counted at all."""
        return self._meters["read"].bandwidth()

    def write_bandwidth(self) -> float | None:
        """Bytes per second of writes so far, measured like :meth:`read_bandwidth`."""
        return self._meters["write"].bandwidth()

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "capacity": self.capacity, "used_bytes": self.used_bytes,
                "peak_bytes": self.peak_bytes, "read_bandwidth": self.read_bandwidth(),
                "write_bandwidth": self.write_bandwidth(), "bytes_read": self._meters["read"].nbytes,
                "bytes_written": self._meters["write"].nbytes}

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else format_bytes(self.capacity)
        return f"{type(self).__name__}(name={self.name!r}, used={format_bytes(self.used_bytes)}, capacity={cap})"

    # ---- a user's tier under copy threads (a test setting) -----------------------------------
    def _on_copy_thread(self, device: torch.device) -> bool:
        """A user's tier moving host tensors with copy threads on (CUDA work stays on the caller's stream)."""
        return not self.runs_own_transfers and streams.settings().copy_threads and device.type == "cpu"

    def _read_if_held(self, key, out, device) -> "TransferHandle":
        if key not in self._sizes:
            raise TierError(f"tier {self.name!r}: key {key!r} was freed before its read ran; a key must not be "
                            f"freed until the reads issued of it are done")
        with self._errors_named("reading", key):
            return self._read(key, out, device)

    def _completed_late(self, op) -> "TransferHandle":
        """``op`` (a handle already issued, or a call that issues one) completing on this tier's copy
        thread after a chaos delay."""
        def run():
            streams.chaos_delay()
            inner = op() if callable(op) else op
            return inner.wait()
        return TransferHandle(future=streams.host_stream(f"tier-{self.name}").submit(run))

    # ---- accounting ------------------------------------------------------------------------
    def _check_budget(self, key: str, nbytes: int, used: int, payload: int | None = None) -> None:
        if self.capacity is not None and used + nbytes > self.capacity:
            held = "" if payload in (None, nbytes) else f", held in {format_bytes(nbytes)}"
            size = format_bytes(nbytes if payload is None else payload) + held
            use, cap = format_bytes(used + nbytes), format_bytes(self.capacity)
            if use == cap:   # rounded alike: the exact counts show the overshoot
                use, cap = f"{use} ({used + nbytes:,} bytes)", f"{cap} ({self.capacity:,} bytes)"
            source = self.capacity_source or "the tier's capacity in the config"
            raise TierBudgetError(
                f"tier {self.name!r} is over its budget: writing {key!r} ({size}) would bring "
                f"its use to {use}, but its capacity is {cap} ({format_bytes(used)} in use). Raise {source} or "
                f"place fewer tensors on it.")

    def _reserve(self, key: str, nbytes: int, payload: int) -> object:
        """Count ``nbytes`` (what storing the tensor takes) against the budget for ``key``, whose tensor
        has ``payload`` bytes; the returned token identifies this write."""
        with self._lock:
            self._check_budget(key, nbytes, self.used_bytes, payload)
            self._sizes[key], self._payload[key] = nbytes, payload
            self._tokens[key] = token = object()
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            return token

    def _footprint(self, tensor: torch.Tensor, owned: bool) -> int:
        """Bytes that storing ``tensor`` takes from the budget: the tensor's own by default; a tier whose
        storage rounds sizes up (host slabs) counts what it really holds."""
        return tensor.numel() * tensor.element_size()

    def _write_is_current(self, key: str) -> bool:
        """Called inside ``_write``: False when another thread freed or rewrote ``key`` since this write
        reserved it (the write's result must then not become the key's value). Call with the lock held."""
        token = getattr(self._writing, "token", None)
        return token is None or self._tokens.get(key) is token

    def _release(self, key: str) -> None:
        with self._lock:
            self._tokens.pop(key, None)
            self._written_as.pop(key, None)
            self._payload.pop(key, None)
            self.used_bytes -= self._sizes.pop(key, 0)

    def _track(self, handle: TransferHandle, meter: "_BandwidthMeter", nbytes: int,
               key: str | None = None, token: object = None) -> None:
        """Time ``handle`` to completion; a write that fails asynchronously gives its key up, so a
        failed write never reads back as valid and never holds budget."""
        future = handle._future
        if future is None:
            if not handle._moved:
                meter.cancel()
            elif handle._timing is not None and handle._event is not None:
                meter.end_on_device(*handle._timing, nbytes)
            else:
                meter.end(nbytes)
            return
        outer: Future = Future()  # completes only after the bookkeeping below, so waiters see its effects

        def finished(f: Future) -> None:
            error = f.exception() if not f.cancelled() else TierError(
                f"tier {self.name!r}: an operation on {key!r} was cancelled")
            if error is not None:
                meter.cancel()   # a failed operation moved nothing: its time is not the link's
            else:
                meter.end(nbytes)
            try:
                if error is not None and key is not None:
                    with self._lock:
                        if self._tokens.get(key) is token:  # not freed or rewritten since
                            self.free(key)
                            self._failed[key] = error  # a later read names the cause, even if nobody waited
            except Exception:  # noqa: BLE001 - the waiter must still hear about the write's own error
                _log.exception("tier %r: cleaning up after the failed write of %r failed", self.name, key)
            finally:
                if error is not None:
                    outer.set_exception(error)
                else:
                    outer.set_result(f.result())
        handle._future = outer
        future.add_done_callback(finished)

    # ---- to implement ------------------------------------------------------------------------
    @abstractmethod
    def _write(self, key: str, tensor: torch.Tensor, owned: bool) -> TransferHandle: ...

    @abstractmethod
    def _read(self, key: str, out: torch.Tensor | None, device: torch.device | None) -> TransferHandle: ...

    @abstractmethod
    def _free(self, key: str) -> None: ...


def close_tiers(tiers) -> TierError | None:
    """Close every tier, each even where one before it failed; the first failure, as a TierError naming its tier
    (to raise once the caller's own clean-up is done), or None."""
    first = None
    for tier in tiers:
        try:
            tier.close()
        except Exception as e:   # noqa: BLE001 - handed back, not lost
            if first is None:
                first = e if isinstance(e, TierError) and repr(tier.name) in str(e) else TierError(
                    f"tier {tier.name!r} ({type(tier).__name__}) failed to close: {type(e).__name__}: {e}")
                if first is not e:
                    first.__cause__ = e
    return first
