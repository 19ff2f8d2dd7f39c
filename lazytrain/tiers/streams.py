"""Where a copy runs and what it waits for, on CUDA and on a machine without it.

On CUDA a copy runs on a side stream (one per direction per device) and its completion is a CUDA event.
Without CUDA the compute "device" is the host itself; with ``copy_threads`` on, a copy between what
stands for device memory and host memory runs on a worker thread per direction, in the order the copies
were queued, exactly as on a CUDA stream, and its completion is a :class:`HostEvent`. The engine's
ordering logic (who waits for which copy before reusing a buffer) then runs asynchronously in CI too,
and a :class:`Chaos` setting delays every copy by a random amount, so an ordering bug shows up as a
wrong result in a CPU test rather than on a user's GPU.

An :class:`EmulatedLink` per link ("h2d", "d2h", "nvme_read", "nvme_write") gives the copies on it a
bandwidth and a latency, so that a Plan whose transfers cost real time runs on the CPU as its cost model
says it would on a slower machine (``benchmarks/fidelity_cpu.py`` compares the two).

These settings are for tests and benchmarks: they make training on the CPU slower, never faster.
"""
from __future__ import annotations

import random
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class Chaos:
    """Delays each transfer and each layer update by a random time in ``[0, max_delay_s)``, drawn from
    one seeded generator (the draws are reproducible; which thread gets which draw is not)."""

    def __init__(self, seed: int, max_delay_s: float):
        if max_delay_s < 0:
            raise ValueError(f"chaos max delay must be >= 0, got {max_delay_s}")
        self.seed, self.max_delay_s = seed, max_delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def draw(self) -> float:
        with self._lock:
            return self._rng.random() * self.max_delay_s

    def delay(self) -> float:
        """Sleep a random time; returns it."""
        d = self.draw()
        if d > 0:
            time.sleep(d)
        return d

    def delay_stream(self, stream) -> None:
        """Queue a random delay on a CUDA stream (a spin kernel), so the copies after it run late."""
        d = self.draw()
        if d > 0:
            with on_cuda_stream(stream):
                torch.cuda._sleep(int(d * 1.5e9))   # cycles at about 1.5 GHz


@contextmanager
def on_cuda_stream(stream):
    """``torch.cuda.stream(stream)`` with the stream's device current inside. The stream context alone,
    entered on a thread whose current device is another GPU (a fresh thread's is GPU 0), restores that
    device's stream on exit, which makes GPU 0 current and so creates a CUDA context there, in every rank of
    a node; ``torch.cuda.device`` restores the previous device without creating one."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")


class EmulatedLink:
    """A link of ``gbps`` (1e9 bytes/s) and ``latency_s`` shared by every transfer on it, served in the
    order the transfers finish their real copy: a transfer ready at ``t`` occupies the link from
    ``max(t, when it is free)`` for ``latency_s + bytes / bandwidth``. The real copy runs inside that
    window; :meth:`hold` then sleeps until the window ends, so the transfer never finishes early."""

    def __init__(self, name: str, gbps: float, latency_s: float = 0.0):
        if not gbps > 0:
            raise ValueError(f"emulated link {name!r}: bandwidth must be > 0 GB/s, got {gbps!r}")
        if not latency_s >= 0:
            raise ValueError(f"emulated link {name!r}: latency must be >= 0 s, got {latency_s!r}")
        self.name, self.gbps, self.latency_s = name, float(gbps), float(latency_s)
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, ready: float) -> float:
        """Book the link for ``nbytes`` from ``ready`` (perf_counter seconds); returns when it completes."""
        with self._lock:
            self._free_at = max(ready, self._free_at) + self.seconds(nbytes)
            return self._free_at

    def seconds(self, nbytes: int) -> float:
        """How long the link takes for ``nbytes``, its latency included."""
        return self.latency_s + nbytes / (self.gbps * 1e9)

    def hold(self, nbytes: int, ready: float) -> float:
        """A transfer of ``nbytes`` that became ready at ``ready`` and has run: wait until the link would
        have delivered it. Returns when the link began it."""
        done = self.reserve(nbytes, ready)
        left = done - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return done - self.seconds(nbytes)


@dataclass
class TransferSettings:
    copy_threads: bool = False     # CPU: copies between "device" and host memory run on worker threads
    chaos: Chaos | None = None     # delay every transfer and layer update at random
    links: dict = None             # link name -> EmulatedLink (CPU copy threads and NVMe requests)

    def __post_init__(self):
        self.links = dict(self.links or {})
        unknown = sorted(set(self.links) - set(LINKS))
        if unknown:
            raise ValueError(f"unknown emulated link(s) {', '.join(unknown)}; links: {', '.join(LINKS)}")
        if self.links and not self.copy_threads:
            raise ValueError("emulated links need copy threads: the copies they slow down run on them")


_timeline = None   # the lazytrain.trace.Timeline being recorded, if any


def start_recording(timeline, device=None) -> None:
    """Record spans into ``timeline`` from now. On a CUDA ``device`` the device's clock is tied to the
    host's here, at the start (one wait for the work already queued), not inside the traced work; the
    timeline's origin moves to the end of that wait: the work queued before the trace (the last step's
    non-block update on the device, say) is not the traced step's, and would otherwise count as the rest of
    the model."""
    global _timeline
    if device is not None and torch.device(device).type == "cuda":
        _, host = _device_origin(timeline, torch.device(device))
        timeline.move_origin(host)
    _timeline = timeline   # after the move: a span recorded during the wait would be placed by the old origin


def stop_recording():
    global _timeline
    t, _timeline = _timeline, None
    return t


def recording():
    return _timeline


def record(lane: str, name: str, start: float, end: float, **args) -> None:
    """A span of work that ran (perf_counter seconds), when a step is being traced."""
    t = _timeline
    if t is not None:
        t.add(lane, name, start, end, **args)


class span:
    """``with span(lane, name): ...`` records the block's wall time on ``lane`` when tracing."""
    __slots__ = ("lane", "name", "args", "t0")

    def __init__(self, lane: str, name: str, **args):
        self.lane, self.name, self.args = lane, name, args

    def __enter__(self):
        self.t0 = time.perf_counter() if _timeline is not None else None
        return self

    def __exit__(self, *exc):
        if self.t0 is not None:
            record(self.lane, self.name, self.t0, time.perf_counter(), **self.args)
        return False


def record_device_copy(lane: str, name: str, start_event, end_event, nbytes: int) -> None:
    """A copy on a CUDA stream, timed by its events once it has run (resolved at the end of the trace)."""
    record_device_span(lane, name, start_event, end_event, bytes=nbytes)


def record_device_span(lane: str, name: str, start_event, end_event, **args) -> None:
    """Work queued on a CUDA stream between two timing events, placed on the trace once it has run."""
    t = _timeline
    if t is None:
        return
    base, base_host = _device_origin(t, start_event.device)

    def resolve():
        end_event.synchronize()
        return (base_host + base.elapsed_time(start_event) / 1e3 - t.origin,
                base_host + base.elapsed_time(end_event) / 1e3 - t.origin)
    t.add_deferred(lane, name, resolve, **args)


class device_span(span):
    """A span of the compute side on ``device``: on CUDA timed by events on the current stream (the host
    only queues the kernels, so its own clock would time the launches), elsewhere by the host."""
    __slots__ = ("device", "start_event")

    def __init__(self, lane: str, name: str, device, **args):
        super().__init__(lane, name, **args)
        self.device, self.start_event = device, None

    def __enter__(self):
        if _timeline is None or self.device.type != "cuda":
            return super().__enter__()
        self.t0 = None
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.start_event.record(torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc):
        if self.start_event is None:
            return super().__exit__(*exc)
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        record_device_span(self.lane, self.name, self.start_event, end, **self.args)
        return False


def compute_span(name: str, device, **args) -> device_span:
    """A block's compute on ``device`` (the ``compute`` lane)."""
    return device_span("compute", name, device, **args)


def wait_span(name: str, device, **args) -> device_span:
    """A wait of the compute side (the ``wait`` lane), named by what it waits for. On CUDA its events
    bracket the wait on the compute stream, so the span is the time the device's compute sat still for it:
    a stream waiting for a copy's event (the host queues the wait and goes on), or the host blocked (no
    work queued meanwhile) once the device has run out of queued work; on the CPU the host's blocked time."""
    return device_span("wait", name, device, **args)


def _device_origin(t, device):
    """(event, perf_counter time) taken together once per trace and device: device times are placed
    against it."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    origins = t.device_origins
    if device not in origins:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
        origins[device] = (event, time.perf_counter())
    return origins[device]


_settings = TransferSettings()
_base = _settings    # what configure() set: in force when no engine that set its own is alive
_engines: list[tuple[weakref.ref, TransferSettings]] = []   # live engines' own settings, oldest first


def configure(copy_threads: bool = False, chaos: Chaos | None = None,
              links: dict[str, EmulatedLink] | None = None) -> None:
    """Set how transfers run in this process (tests), in place of any engine's."""
    global _settings, _base
    _settings = _base = TransferSettings(copy_threads, chaos, links)
    _engines.clear()


def engine_started(engine, copy_threads: bool = False, chaos: Chaos | None = None,
                   links: dict[str, EmulatedLink] | None = None) -> None:
    """An engine's settings (its config's ``lazytrain.testing``), in force for the process from now until
    it ends or another engine starts: they are the process's, the copy paths read them."""
    global _settings
    _settings = TransferSettings(copy_threads, chaos, links)
    _engines.append((weakref.ref(engine), _settings))


def engine_ended(engine) -> None:
    """``engine`` is destroyed: the newest live engine's settings are in force again, else configure()'s."""
    global _settings
    _engines[:] = [(ref, s) for ref, s in _engines if ref() is not None and ref() is not engine]
    _settings = _engines[-1][1] if _engines else _base


def settings() -> TransferSettings:
    return _settings


def chaos_delay() -> float:
    """A random delay where a transfer or a layer update runs, when chaos is on; returns the seconds slept."""
    chaos = _settings.chaos
    return chaos.delay() if chaos is not None else 0.0


def transfer_ready(queued: float, afters=()) -> float:
    """Waits for the copies in ``afters``, then for the chaos delay. Returns when the transfer became ready
    for its link: when it was queued (``queued``, perf_counter seconds) or when the last copy of ``afters``
    ended, whichever is later (an event that does not say when it ended: when this thread saw it ended),
    plus the chaos delay. A copy thread's own lag, such as the last transfer's sleep overshooting, is not
    the transfer's. Booked from the thread's clock, small copies queued back to back ran at 0.040 of a
    0.05 GB/s link, and a chaos delay shorter than the link's time delayed nothing."""
    ready = queued
    for e in afters:
        e.synchronize()   # a failed one raises
        ended = getattr(e, "finished_at", None)
        ready = max(ready, ended if ended is not None else time.perf_counter())
    return ready + chaos_delay()


def emulate_link(link: str, nbytes: int, ready: float, started: float) -> float:
    """After a transfer on ``link`` that became ready at ``ready`` and started its real copy at ``started``
    has run: wait as long as the emulated link would have taken. Returns when the transfer began, for its
    trace span: on an emulated link when the link began it, else ``started``."""
    emulated = _settings.links.get(link)
    return started if emulated is None else emulated.hold(nbytes, ready)


class HostEvent:
    """Completion of a copy queued on a host copy thread: the CPU counterpart of a CUDA event.
    ``finished``: a list the copy appends its end time to (perf_counter seconds) before it completes."""
    on_host = True

    def __init__(self, future: Future, finished: list | None = None):
        self.future = future
        self._finished = finished

    @property
    def finished_at(self) -> float | None:
        """When the copy ended, once it has; None when not known."""
        return self._finished[0] if self._finished else None

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()


class HostCopyStream:
    """One worker thread that runs the copies queued on it, in order, as a CUDA stream does."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lazytrain-copy-{name}")

    def submit(self, fn) -> Future:
        return self._pool.submit(fn)


_host_streams: dict[str, HostCopyStream] = {}
_host_streams_lock = threading.Lock()


def host_stream(direction: str) -> HostCopyStream:
    with _host_streams_lock:
        if direction not in _host_streams:
            _host_streams[direction] = HostCopyStream(direction)
        return _host_streams[direction]


# ---- ordering of a copy a caller is about to issue --------------------------------------------------
_order = threading.local()


@contextmanager
def issued_after(event):
    """Copies issued inside this block wait for ``event`` (a CUDA or host event, or None: for nothing)
    instead of for all the work queued so far on the current stream. A buffer's owner uses it when it
    knows the last reader of the destination: a prefetch then starts as early as it safely can."""
    prev = getattr(_order, "after", _UNSET)
    _order.after = event
    try:
        yield
    finally:
        if prev is _UNSET:
            del _order.after
        else:
            _order.after = prev


_UNSET = object()


@contextmanager
def following_current():
    """Inside an :func:`issued_after` block, copies issued in this one follow the current stream again: a
    copy into memory allocated just now, which may be a block the stream's queued kernels still use."""
    prev = getattr(_order, "after", _UNSET)
    if prev is not _UNSET:
        del _order.after
    try:
        yield
    finally:
        if prev is not _UNSET:
            _order.after = prev


def ordering() -> tuple[bool, object]:
    """(follow the current stream, extra event to wait for) for a copy issued now."""
    after = getattr(_order, "after", _UNSET)
    if after is _UNSET:
        return True, None
    return False, after

