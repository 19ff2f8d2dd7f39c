"""Step timelines in one format for what the engine did and what the planner predicted.

A :class:`Timeline` holds spans on named lanes (the simulator's: ``compute``, ``h2d``, ``d2h``,
``nvme_read``, ``nvme_write``, ``optimizer``; measured steps add ``wait``: the time the compute side sat
blocked, named by what it waited for). It is written as Chrome/Perfetto trace JSON (open it in
ui.perfetto.dev or chrome://tracing), one process per timeline, so a predicted and a measured step can be
put in one file and read side by side, and summarised as a table.

Pure Python (no torch): the planner writes Plans' predicted timelines with it.
"""
from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass, field

from . import files

# "host": the host's arithmetic on gradients outside the optimizer (the sinks' fp32 adds), on their workers
# "comm": the gradient path's collectives across ranks, from their start to when the thread that waits for
# them saw them done
LANES = ("compute", "wait", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer", "host", "comm")


@dataclass
class Span:
    lane: str
    name: str
    start: float          # seconds from the timeline's origin
    end: float
    args: dict = field(default_factory=dict)


class Timeline:
    """Spans on lanes; ``add`` may be called from any thread (copy threads, I/O threads, the update)."""

    def __init__(self, source: str, device: str | None = None, step_s: float | None = None):
        self.source = source
        self.device = device        # the compute device of a measured step ("cpu", "cuda"); None: simulated
        # a simulated step's time: its overlapped update runs on into the next step, past the step's end
        self.step_s = step_s
        self.written_to: str | None = None   # the file write_chrome_trace last wrote it into
        self.spans: list[Span] = []
        self.origin = time.perf_counter()
        self.wall_origin = time.time()   # the same instant on the wall clock: traces of several ranks line up
        self._lock = threading.Lock()
        self._deferred: list = []   # (lane, name, resolve() -> (start, end) seconds, args): device-timed spans
        self.device_origins: dict = {}   # device -> (its event, perf_counter time) taken together

    def move_origin(self, origin: float) -> None:
        """Start the timeline at ``origin`` (perf_counter seconds) instead, its wall-clock instant moved with it:
        the ranks' files line up only if both name the same instant."""
        with self._lock:
            self.wall_origin += origin - self.origin
            self.origin = origin

    def add(self, lane: str, name: str, start: float, end: float, **args) -> None:
        """A span from ``start`` to ``end`` (perf_counter seconds, absolute)."""
        with self._lock:
            self.spans.append(Span(lane, name, start - self.origin, end - self.origin, args))

    def add_relative(self, lane: str, name: str, start: float, end: float, **args) -> None:
        """A span whose times are already seconds from the origin (a simulated step)."""
        with self._lock:
            self.spans.append(Span(lane, name, start, end, args))

    def add_deferred(self, lane: str, name: str, resolve, **args) -> None:
        """A span timed on a device, resolved once the device has run it (``finish``)."""
        with self._lock:
            self._deferred.append((lane, name, resolve, args))

    def finish(self) -> "Timeline":
        with self._lock:
            for lane, name, resolve, args in self._deferred:
                start, end = resolve()
                self.spans.append(Span(lane, name, start, end, args))
            self._deferred.clear()
            self.spans.sort(key=lambda s: (s.start, s.lane))
        return self

    # ---- reading it ---------------------------------------------------------------------------
    @property
    def first_start(self) -> float:
        """Where the written trace's times start (seconds from the origin): the origin, the step's start (a
        measured step's first forward), or a span that began before it. Not the first span: the work before
        the first block (the embedding, the masks) is the step's."""
        return min([0.0] + [s.start for s in self.spans])

    @property
    def duration(self) -> float:
        if self.step_s is not None:
            return self.step_s
        return max((s.end for s in self.spans), default=0.0) - self.first_start

    def busy(self, lane: str) -> float:
        """Seconds during which at least one span of ``lane`` was open (overlapping spans count once)."""
        total, reach = 0.0, None
        for s in sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.start):
            if reach is None or s.start > reach:
                total += s.end - s.start
                reach = s.end
            elif s.end > reach:
                total += s.end - reach
                reach = s.end
        return total

    def chrome_events(self, pid: int = 1) -> list[dict]:
        """Each lane one track, or more where its spans overlap without nesting (concurrent NVMe requests):
        Chrome and Perfetto draw a track's events right only when each lies after or inside another."""
        lanes = [lane for lane in LANES if any(s.lane == lane for s in self.spans)] + \
            sorted({s.lane for s in self.spans} - set(LANES))
        tracks: list[tuple[str, int]] = []   # (lane, row) in display order
        row_of: dict[int, int] = {}
        for lane in lanes:
            rows: list[list[float]] = []     # per row, the ends of the spans still open at the current start
            for s in sorted((s for s in self.spans if s.lane == lane), key=lambda s: (s.start, -s.end)):
                for k, open_ends in enumerate(rows):
                    while open_ends and open_ends[-1] <= s.start:
                        open_ends.pop()
                    if not open_ends or s.end <= open_ends[-1]:   # after, or inside, what is open there
                        break
                else:
                    rows.append([])
                    k = len(rows) - 1
                rows[k].append(s.end)
                row_of[id(s)] = k
            tracks += [(lane, k) for k in range(len(rows))]
        tid = {track: n + 1 for n, track in enumerate(tracks)}
        events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": self.source}}]
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[(lane, k)],
                    "args": {"name": lane if k == 0 else f"{lane} {k + 1}"}} for lane, k in tracks]
        events += [{"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": n, "args": {"sort_index": n}}
                   for n in tid.values()]
        base = self.first_start
        for s in self.spans:   # both ends in integer ns, the duration taken from them: back to back stays so
            start = round((s.start - base) * 1e9)
            end = round((max(s.start, s.end) - base) * 1e9)
            events.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": pid, "tid": tid[(s.lane, row_of[id(s)])],
                           "ts": _us(start), "dur": _us(end - start), "args": s.args})
        return events

    def summary(self) -> str:
        """Per lane: spans, busy time and its share of the step; then the longest waits by what they
        waited for."""
        step = self.duration
        rows = [f"{self.source}: step {step * 1e3:.2f} ms",
                f"{'lane':<12}{'spans':>7}{'busy ms':>10}{'share':>8}{'bytes':>14}"]
        for lane in LANES:
            spans = [s for s in self.spans if s.lane == lane]
            if not spans:
                continue
            nbytes = sum(int(s.args.get("bytes", 0)) for s in spans)
            busy = self.busy(lane)
            rows.append(f"{lane:<12}{len(spans):>7}{busy * 1e3:>10.2f}{busy / step if step else 0:>8.0%}"
                        f"{nbytes if nbytes else '':>14}")
        waits: dict[str, float] = {}
        for s in self.spans:
            if s.lane == "wait":
                what = re.sub(r" \d+$", "", s.name)   # "weights 3" -> "weights"; "gradients to host" as it is
                waits[what] = waits.get(what, 0.0) + s.end - s.start
        if waits:
            rows.append("waits: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in
                                              sorted(waits.items(), key=lambda kv: -kv[1])))
        return "\n".join(rows)


def _us(ns: int) -> float:
    """``ns`` as the trace's microseconds: the least float at or above ns / 1000. Perfetto reads ts and dur
    each as value * 1000 made integer ns, truncated (older releases) or rounded (newer ones), and gets ``ns``
    back either way; the float nearest ns / 1000 may lie below it, and truncate a nanosecond short
    (1056518.417 * 1000 is 1056518416.99...)."""
    us = ns / 1000
    return us if us * 1000 >= ns else math.nextafter(us, math.inf)


def measured_source(rank: int, world_size: int) -> str:
    """A measured step's process name: over several ranks, the rank's (each rank writes its own file)."""
    return "measured" if world_size <= 1 else f"measured (rank {rank})"


def write_chrome_trace(path: str, *timelines: Timeline) -> None:
    """Write timelines into one Chrome/Perfetto trace file, one process each (predicted beside measured). Each
    process's times start at the step's start (``Timeline.first_start``); for a measured one,
    ``otherData.start_unix_s`` gives that instant on the wall clock, so that the files of several ranks (or
    runs) can be lined up."""
    files.replaced_file(path, "trace path")   # refused before the events are gathered
    events, starts = [], {}
    for pid, t in enumerate(timelines, start=1):
        events += t.chrome_events(pid)
        if t.device is not None:   # measured: its spans are perf_counter times from its origin
            starts[t.source] = t.wall_origin + t.first_start
    files.write_text_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                        "otherData": {"start_unix_s": starts}}), "trace path")
    for t in timelines:
        t.written_to = path


def check_writable(path: str) -> None:
    """Refuse a trace path that cannot be written, before any training time is spent."""
    files.check_writable(path, "trace path", "step.json")
