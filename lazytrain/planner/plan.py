"""The Plan contract: one JSON-serializable decision for one training step of one model shape.

The planner produces Plans; the engine's executor runs any valid Plan. Baseline policies
(MegaTrain's keep-every-k, keep-all-on-host) are Plans too, so every policy runs through the same
executor and the same simulator. Pure Python: never imports torch.

Conventions (shared by the executor and the simulator):
- Layers 0..L-1; boundary i is the input of layer i (boundary 0 = stack input, boundary L = stack output).
- Forward window w (0 <= w < L) computes layer w. Backward window L + j (0 <= j < L) differentiates
  layer L-1-j. So layer i is differentiated in window 2L-1-i.
- A boundary's home is "hbm", "host", "nvme", a custom tier name, or "recompute". Boundaries 0 and L
  are always materialised (boundary L is the stack output, which lives in autograd on the device).
- Kept boundaries split the stack into segments [s, e). In backward, when window 2L-e begins (the
  window of layer e-1), the segment is recomputed forward from boundary s and then differentiated
  layer by layer. So boundary s is *needed* at window ``need_window(s) = 2L - e``.
- ``last_segment_graph``: the last segment [s, L) records its autograd graph in forward, so backward
  differentiates those layers from the graph without re-running them; boundaries s..L-1 are not
  stored, whatever their homes say. Layer j's internals, its input (boundary j, which the graph holds
  for RMSNorm's backward) and (when weights are streamed) its own copy of its weights stay on the
  device from its forward window j to its backward window 2L-1-j: the
  later the layer, the shorter that is. The segment has no length limit (it can be the whole stack).
- ``selective_layers``: layers whose forward keeps the outputs of its matrix multiplies and attention
  (selective checkpointing, engine/selective.py), so that its re-runs in backward (the no-grad recompute of
  a segment's interior, and the forward with autograd before its backward) recompute only the other ops
  (norms, activations, elementwise: little time). Those outputs stay on the device from the layer's
  forward window j to its backward window 2L-1-j. Only layers below the graph tail (a graph layer keeps
  everything already).
- ``offloaded_layers``: layers whose forward records its autograd graph with every tensor it saves for
  backward (its internals, its input among them; not its weights, which are streamed again) copied to
  the host as it is saved, in forward window j, and copied back from ``internals_prefetch_at(j)`` on, so
  that backward differentiates the layer from that graph without re-running it. Such a layer is a
  segment of its own: boundary j is not stored (the graph keeps it; it must be 'recompute', except
  boundary 0, whose home then goes unused) and boundary j+1 starts a segment (it is kept, is L, or
  starts another offloaded layer). Only layers below the graph tail, none of them selective.
- ``internals_offload_shares[j]``: the share of offloaded layer j's internals (bytes, its input among them)
  whose copy to the host is issued in each forward window ``w`` in ``[j, L-1]`` (default ``{j: 1}``: all
  of it when its forward has saved them). What is issued in a later window stays on the device until
  then: copies spread over the forward phase so that a slow link keeps pace with the compute.
  ``internals_prefetch_shares[j]``: likewise the share copied back in each window of ``[j+1, 2L-1-j]``,
  every one after its last offload window (default ``{internals_prefetch_at(j): 1}``); the share issued in
  its backward window is exposed. Shares are positive and sum to 1; the executor issues whole saved
  tensors, in the order the forward saved them, as long as the bytes issued stay within the running sum.
- ``offload_window[i]``: window in which boundary i leaves the device for its home (>= i, since
  boundary i is produced at the end of window i-1; < need_window). ``prefetch_window[i]``: window in
  which it is copied back (> offload window, <= need window; == need window means it is exposed).
"""
from __future__ import annotations

import json
import numbers
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

RECOMPUTE = "recompute"
DEVICE_HOME = "hbm"
BUILTIN_HOMES = ("hbm", "host", "nvme")


class PlanError(ValueError):
    """A Plan that the executor cannot run; the message names the field and the bad value."""


@dataclass(frozen=True)
class Plan:
    num_layers: int
    homes: tuple[str, ...]                      # length L+1
    offload_window: dict[int, int] = field(default_factory=dict)
    prefetch_window: dict[int, int] = field(default_factory=dict)
    resident_layers: tuple[int, ...] = ()       # layers whose weights stay on the device
    micro_batch_size: int | None = None
    seq_len: int | None = None
    policy: str = "custom"                      # who made it: "megatrain-k4", "keep-all-host", "milp", ...
    prediction: dict[str, Any] = field(default_factory=dict)  # step_time_s, peak_bytes, solver status...
    # True: the host optimizer updates layer w and the next step's forward window w starts as soon as
    # its weights are updated and copied; False: the next step waits for the whole update (MegaTrain).
    overlap_optimizer: bool = True
    last_segment_graph: bool = False            # see the module docstring
    selective_layers: tuple[int, ...] = ()      # see the module docstring
    offloaded_layers: tuple[int, ...] = ()      # see the module docstring
    internals_prefetch_window: dict[int, int] = field(default_factory=dict)   # offloaded layer -> window
    internals_offload_shares: dict[int, dict[int, float]] = field(default_factory=dict)   # layer -> {window: share}
    internals_prefetch_shares: dict[int, dict[int, float]] = field(default_factory=dict)  # layer -> {window: share}

    def __post_init__(self):
        object.__setattr__(self, "homes", tuple(self.homes))
        object.__setattr__(self, "resident_layers", tuple(sorted(set(self.resident_layers))))
        object.__setattr__(self, "selective_layers", tuple(sorted(set(self.selective_layers))))
        object.__setattr__(self, "offloaded_layers", tuple(sorted(set(self.offloaded_layers))))
        object.__setattr__(self, "internals_prefetch_window",
                           {int(k): int(v) for k, v in self.internals_prefetch_window.items()})
        object.__setattr__(self, "offload_window", {int(k): int(v) for k, v in self.offload_window.items()})
        for name in ("internals_offload_shares", "internals_prefetch_shares"):
            object.__setattr__(self, name, {int(j): {int(w): float(x) for w, x in sorted(split.items())}
                                            for j, split in sorted(getattr(self, name).items())})
        object.__setattr__(self, "prefetch_window", {int(k): int(v) for k, v in self.prefetch_window.items()})
        self.validate()

    # ---- structure -------------------------------------------------------------------------
    @property
    def kept(self) -> tuple[int, ...]:
        """Materialised boundaries in increasing order (always includes 0 and L)."""
        return tuple(i for i, h in enumerate(self.homes) if h != RECOMPUTE)

    def segments(self) -> list[tuple[int, int]]:
        """Segments [s, e) between consecutive segment starts: kept boundaries and offloaded layers (each
        of which is a segment [j, j+1) of its own)."""
        starts = sorted(set(self.kept) | {j for j in self.offloaded_layers if 0 <= j < self.num_layers})
        return list(zip(starts[:-1], starts[1:]))

    def segment_end(self, boundary: int) -> int:
        """The next kept boundary after a kept ``boundary`` (< L)."""
        for s, e in self.segments():
            if s == boundary:
                return e
        raise PlanError(f"boundary {boundary} is not the start of a segment (home {self.homes[boundary]!r})")

    def need_window(self, boundary: int) -> int:
        """Backward window in which kept boundary ``boundary`` (< L) is first read."""
        return 2 * self.num_layers - self.segment_end(boundary)

    def graph_start(self) -> int:
        """First layer that keeps its forward graph (``num_layers`` when none does): the last kept
        boundary below L, when ``last_segment_graph``."""
        if not self.last_segment_graph or self.num_layers == 0:
            return self.num_layers
        return self.kept[-2]

    def unstored_boundaries(self) -> set[int]:
        """Boundaries the executor never stores, whatever their homes say: the graph tail's (its graph holds
        them) and an offloaded layer 0's input (its saved internals hold it)."""
        return set(range(self.graph_start(), self.num_layers)) | ({0} if 0 in self.offloaded_layers else set())

    def recomputed_layers(self) -> int:
        """Layer forwards repeated in backward: sum over recomputed segments of (length - 1)."""
        g = self.graph_start()
        return sum(e - s - 1 for s, e in self.segments() if s < g)

    def internals_prefetch_at(self, layer: int) -> int:
        """Window in which offloaded ``layer``'s internals start back to the device (default: one window
        before its backward window, and after its forward)."""
        if layer in self.internals_prefetch_shares:
            return min(self.internals_prefetch_shares[layer])
        return self.internals_prefetch_window.get(layer, max(layer + 1, 2 * self.num_layers - 2 - layer))

    def internals_offload_split(self, layer: int) -> dict[int, float]:
        """{window: share of offloaded ``layer``'s internals whose copy to the host is issued then}."""
        return self.internals_offload_shares.get(layer, {layer: 1.0})

    def internals_prefetch_split(self, layer: int) -> dict[int, float]:
        """{window: share of offloaded ``layer``'s internals whose copy back to the device is issued then}."""
        return self.internals_prefetch_shares.get(layer, {self.internals_prefetch_at(layer): 1.0})

    def offload_at(self, boundary: int) -> int:
        """Window the offload of ``boundary`` is issued in (default: as soon as it exists)."""
        return self.offload_window.get(boundary, boundary)

    def prefetch_at(self, boundary: int) -> int:
        """Window the prefetch of ``boundary`` is issued in (default: one window before it is needed)."""
        need = self.need_window(boundary)
        return self.prefetch_window.get(boundary, max(need - 1, self.offload_at(boundary) + 1))

    # ---- checking --------------------------------------------------------------------------
    def validate(self, custom_tiers: tuple[str, ...] = ()) -> None:
        L = self.num_layers
        if not isinstance(L, int) or L < 0:   # 0: a model with nothing to stream (one boundary, input = output)
            raise PlanError(f"num_layers must be an integer >= 0, got {L!r}")
        if len(self.homes) != L + 1:
            raise PlanError(f"homes must list {L + 1} boundaries (0..{L}), got {len(self.homes)}")
        for i in (0, L):
            if self.homes[i] == RECOMPUTE:
                raise PlanError(f"boundary {i} cannot be 'recompute': boundaries 0 and L are always kept")
        if self.homes[L] != DEVICE_HOME:
            raise PlanError(f"boundary {L} (the stack output) must have home 'hbm', got {self.homes[L]!r}")
        for i, h in enumerate(self.homes):
            if not isinstance(h, str) or not h:
                raise PlanError(f"homes[{i}] must be a tier name or 'recompute', got {h!r}")
            if custom_tiers and h not in BUILTIN_HOMES and h != RECOMPUTE and h not in custom_tiers:
                raise PlanError(f"homes[{i}] names tier {h!r}, which is not configured "
                                f"(known: {', '.join(BUILTIN_HOMES + tuple(custom_tiers))})")
        for layer in self.resident_layers:
            if not 0 <= layer < L:
                raise PlanError(f"resident_layers holds {layer}, outside 0..{L - 1}")
        for b, w in self.offload_window.items():
            self._check_boundary(b, "offload_window")
            if self.homes[b] in (RECOMPUTE, DEVICE_HOME):
                raise PlanError(f"offload_window[{b}] given, but boundary {b} has home {self.homes[b]!r}")
            if not b <= w < self.need_window(b):
                raise PlanError(f"offload_window[{b}] = {w} must lie in [{b}, {self.need_window(b) - 1}]")
        for b, w in self.prefetch_window.items():
            self._check_boundary(b, "prefetch_window")
            if self.homes[b] in (RECOMPUTE, DEVICE_HOME):
                raise PlanError(f"prefetch_window[{b}] given, but boundary {b} has home {self.homes[b]!r}")
            lo, hi = self.offload_at(b) + 1, self.need_window(b)
            if not lo <= w <= hi:
                raise PlanError(f"prefetch_window[{b}] = {w} must lie in [{lo}, {hi}]")
        if not isinstance(self.last_segment_graph, bool):
            raise PlanError(f"last_segment_graph must be true or false, got {self.last_segment_graph!r}")
        g = self.graph_start() if L else 0
        for layer in self.selective_layers:
            if not 0 <= layer < g:
                raise PlanError(f"selective_layers holds {layer}: a selective layer must be re-run in backward, "
                                f"so lie in 0..{g - 1}" + (f" (layers {g}..{L - 1} keep their forward graph)"
                                                           if g < L else ""))
        self._check_offloaded(g)
        for name in ("micro_batch_size", "seq_len"):   # what from_json reads back: whole numbers or null
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise PlanError(f"{name} must be an integer >= 1 or None, got {v!r}")

    def _check_offloaded(self, g: int) -> None:
        L, off = self.num_layers, set(self.offloaded_layers)
        for j in self.offloaded_layers:
            if not 0 <= j < g:
                raise PlanError(f"offloaded_layers holds {j}: an offloaded layer must lie in 0..{g - 1}"
                                + (f" (layers {g}..{L - 1} keep their forward graph on the device)" if g < L else ""))
            if j in self.selective_layers:
                raise PlanError(f"layer {j} is in both offloaded_layers and selective_layers: an offloaded layer "
                                f"keeps all its internals (on the host) and is never re-run")
            if j > 0 and self.homes[j] != RECOMPUTE:
                raise PlanError(f"offloaded layer {j} needs boundary {j} to be 'recompute' (its graph keeps its "
                                f"input, on the host), got home {self.homes[j]!r}")
            if j + 1 < L and self.homes[j + 1] == RECOMPUTE and j + 1 not in off:
                raise PlanError(f"offloaded layer {j} must be a segment of its own: boundary {j + 1} after it must "
                                f"be kept or start another offloaded layer, got 'recompute'")
        for j, w in self.internals_prefetch_window.items():
            if j not in off:
                raise PlanError(f"internals_prefetch_window[{j}] given, but layer {j} is not offloaded")
            lo, hi = j + 1, 2 * L - 1 - j
            if not lo <= w <= hi:
                raise PlanError(f"internals_prefetch_window[{j}] = {w} must lie in [{lo}, {hi}]")
        for name, bounds in (("internals_offload_shares", lambda j: (j, L - 1)),
                             ("internals_prefetch_shares", lambda j: (j + 1, 2 * L - 1 - j))):
            for j, split in getattr(self, name).items():
                if j not in off:
                    raise PlanError(f"{name}[{j}] given, but layer {j} is not offloaded")
                lo, hi = bounds(j)
                if not split:
                    raise PlanError(f"{name}[{j}] is empty: give at least one window's share")
                for w, x in split.items():
                    if not lo <= w <= hi:
                        raise PlanError(f"{name}[{j}] names window {w}, outside [{lo}, {hi}]")
                    if not 0 < x <= 1:   # NaN fails too
                        raise PlanError(f"{name}[{j}][{w}] = {x!r}: a share must lie in (0, 1]")
                if abs(sum(split.values()) - 1) > 1e-6:
                    raise PlanError(f"{name}[{j}] shares sum to {sum(split.values())!r}, not 1")
        for j in self.internals_prefetch_shares:
            if j in self.internals_prefetch_window:
                raise PlanError(f"internals_prefetch_window[{j}] and internals_prefetch_shares[{j}] both given: "
                                f"give one (a window is the share {{window: 1}})")
        for j in off:
            last_out, first_back = max(self.internals_offload_split(j)), self.internals_prefetch_at(j)
            if first_back <= last_out:
                raise PlanError(f"offloaded layer {j}'s internals start back in window {first_back}, before their "
                                f"copy out ends in window {last_out}: every copy back must come after it")

    def _check_boundary(self, b: int, name: str) -> None:
        if not 0 <= b < self.num_layers:
            raise PlanError(f"{name} names boundary {b}, outside 0..{self.num_layers - 1}")

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["homes"] = list(self.homes)
        d["resident_layers"] = list(self.resident_layers)
        d["selective_layers"] = list(self.selective_layers)
        d["offloaded_layers"] = list(self.offloaded_layers)
        d["internals_prefetch_window"] = {str(k): v for k, v in sorted(self.internals_prefetch_window.items())}
        for name in ("internals_offload_shares", "internals_prefetch_shares"):
            d[name] = {str(j): {str(w): x for w, x in split.items()} for j, split in getattr(self, name).items()}
        d["offload_window"] = {str(k): v for k, v in sorted(self.offload_window.items())}
        d["prefetch_window"] = {str(k): v for k, v in sorted(self.prefetch_window.items())}
        return d

    def to_json(self, path: str | None = None, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            from ..files import write_text_atomic
            write_text_atomic(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        known = {"num_layers", "homes", "offload_window", "prefetch_window", "resident_layers",
                 "micro_batch_size", "seq_len", "policy", "prediction", "overlap_optimizer",
                 "last_segment_graph", "selective_layers", "offloaded_layers", "internals_prefetch_window",
                 "internals_offload_shares", "internals_prefetch_shares"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"unknown Plan field(s): {', '.join(unknown)}")
        if "num_layers" not in d or "homes" not in d:
            raise PlanError("a Plan needs 'num_layers' and 'homes'")
        return cls(**_checked_fields(d))

    @classmethod
    def from_json(cls, text_or_path: str) -> "Plan":
        text = text_or_path
        # JSON text, unless a file goes by that name (a relative path such as "[run-1]/plan.json")
        if not text_or_path.lstrip().startswith(("{", "[")) or os.path.isfile(text_or_path):
            try:
                with open(text_or_path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError as e:
                raise PlanError(f"Plan file {text_or_path} is not UTF-8 JSON: {e}") from None
        try:
            d = json.loads(text, object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as e:
            raise PlanError(f"Plan JSON does not parse: {e}") from e
        if not isinstance(d, dict):
            raise PlanError(f"a Plan JSON must be an object, got {type(d).__name__}")
        return cls.from_dict(d)


def _whole(v) -> int | None:
    """An integer as JSON or numpy may spell it (3, 3.0, numpy.int64(3)), as an int; None for anything
    else, a bool included."""
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Integral) or (isinstance(v, float) and v.is_integer()):
        return int(v)
    return None


def _number_key(k):
    """A JSON object's key as the integer it spells in the one way JSON writes one ("3" -> 3); anything else
    ("--2", "²", and "02", " 2 ", "0_2", "٢", which int() reads too, so that "2" and "02" were one key, the
    last one's value kept) unchanged, for the field's check to name."""
    if isinstance(k, str) and re.fullmatch(r"0|-?[1-9][0-9]*", k):   # not "-0", a second spelling of 0
        return int(k)
    return k


def _no_repeated_keys(pairs: list) -> dict:
    """A JSON object whose keys are each given once: a repeated one (a hand-edited plan) kept the last value
    without a word."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise PlanError(f"Plan JSON gives the key {k!r} twice in one object")
        out[k] = v
    return out


def _checked_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A Plan's fields as read from JSON, each of the type it must have (window keys may be the strings
    JSON makes of integers); a wrong one is a PlanError naming the field and the value."""
    def bad(name, want, value):
        return PlanError(f"Plan field {name!r} must be {want}, got {value!r}")
    out = dict(d)
    out["num_layers"] = _whole(d["num_layers"])
    if out["num_layers"] is None:
        raise bad("num_layers", "an integer", d["num_layers"])
    if not isinstance(d["homes"], (list, tuple)):
        raise bad("homes", "a list of tier names", d["homes"])
    for name in ("offload_window", "prefetch_window", "internals_prefetch_window"):
        windows = d.get(name, {})
        if not isinstance(windows, dict):
            raise bad(name, "an object {boundary: window}", windows)
        out[name] = {}
        for k, v in windows.items():
            key = _whole(_number_key(k))
            if key is None or _whole(v) is None:
                raise PlanError(f"Plan field {name!r} must map {'layer' if name.startswith('internals') else 'boundary'} "
                                f"numbers to window numbers, got {k!r}: {v!r}")
            out[name][key] = _whole(v)
    for name in ("internals_offload_shares", "internals_prefetch_shares"):
        splits = d.get(name, {})
        if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
            raise bad(name, "an object {layer: {window: share}}", splits)
        out[name] = {}
        for j, split in splits.items():
            layer = _whole(_number_key(j))
            windows = {_whole(_number_key(w)): x for w, x in split.items()}
            if layer is None or None in windows or not all(
                    isinstance(x, numbers.Real) and not isinstance(x, bool) for x in windows.values()):
                raise PlanError(f"Plan field {name!r} must map layer numbers to {{window number: share}}, "
                                f"got {j!r}: {split!r}")
            out[name][layer] = {w: float(x) for w, x in windows.items()}
    for name in ("resident_layers", "selective_layers", "offloaded_layers"):
        given = d.get(name, ())
        layers = [_whole(x) for x in given] if isinstance(given, (list, tuple)) else [None]
        if None in layers:
            raise bad(name, "a list of layer numbers", given)
        out[name] = tuple(layers)
    for name in ("micro_batch_size", "seq_len"):
        if d.get(name) is not None:
            out[name] = _whole(d[name])
            if out[name] is None:
                raise bad(name, "an integer or null", d[name])
    for name in ("overlap_optimizer", "last_segment_graph"):
        if name in d and not isinstance(d[name], bool):
            raise bad(name, "true or false", d[name])
    if "policy" in d and not isinstance(d["policy"], str):
        raise bad("policy", "a string", d["policy"])
    if "prediction" in d and not isinstance(d["prediction"], dict):
        raise bad("prediction", "an object", d["prediction"])
    peaks = d.get("prediction", {}).get("peak_bytes")   # what the engine checks against its device's budget
    if peaks is not None and (not isinstance(peaks, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in peaks.values())):
        raise bad("prediction.peak_bytes", "an object of bytes by tier", peaks)
    return out


# ---- the simple policies, as Plans -------------------------------------------------------------
def every_k_plan(num_layers: int, k: int, home: str = DEVICE_HOME, **kw) -> Plan:
    """MegaTrain's policy: keep boundary 0 and every k-th boundary on ``home``; recompute the rest."""
    if k < 1:
        raise PlanError(f"checkpoint interval must be >= 1, got {k}")
    homes = [home if i % k == 0 else RECOMPUTE for i in range(num_layers)] + [DEVICE_HOME]
    return Plan(num_layers=num_layers, homes=tuple(homes), policy=kw.pop("policy", f"every-{k}-{home}"), **kw)


def keep_all_plan(num_layers: int, home: str = "host", **kw) -> Plan:
    """Keep every boundary on ``home`` (no recompute at all)."""
    return Plan(num_layers=num_layers, homes=tuple([home] * num_layers + [DEVICE_HOME]),
                policy=kw.pop("policy", f"keep-all-{home}"), **kw)


def offload_all_plan(num_layers: int, input_home: str = DEVICE_HOME, last_segment_graph: bool = True, **kw) -> Plan:
    """Every layer offloads its internals to the host and none is re-run (what
    ``torch.autograd.graph.save_on_cpu`` does for a whole model, with the transfers overlapped), except
    that the last layer, whose backward follows its forward at once, keeps its graph on the device (with
    ``last_segment_graph``; else it is re-run from its input, kept on the device)."""
    if num_layers == 0:
        return Plan(num_layers=0, homes=(DEVICE_HOME,), policy=kw.pop("policy", "offload-all"), **kw)
    homes = [input_home] + [RECOMPUTE] * (num_layers - 1) + [DEVICE_HOME]
    if num_layers > 1:
        homes[num_layers - 1] = DEVICE_HOME
    off = tuple(range(num_layers - 1)) if num_layers > 1 else ()
    return Plan(num_layers=num_layers, homes=tuple(homes), offloaded_layers=off, last_segment_graph=last_segment_graph,
                policy=kw.pop("policy", "offload-all"), **kw)
