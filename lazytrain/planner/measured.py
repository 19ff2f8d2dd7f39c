"""Step costs measured by the engine on the machine it runs on, for the planner to use in place of FLOP
counts at a nominal rate.

A FLOP count divided by one calibrated rate cannot say what a block costs on a given machine (attention,
norms, the backward's own ratio to the forward, the host's update speed). The engine can: a traced step
(``engine.trace_next_step``, a :class:`~lazytrain.trace.Timeline`) holds every block's forward, re-run
and backward, the step's serial host phase and each layer's update. :meth:`MeasuredCosts.from_traces`
reads them from traced steps of a calibration run (a plan that keeps every boundary, so each layer has a
plain forward and a re-run with its backward), and :class:`~lazytrain.planner.problem.Problem` uses them
for every compute and update term of the cost model, while the links keep the hardware profile's
bandwidths. Pure Python, like the rest of the planner.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from .hardware import MAX_GBPS

_LAYER_SPAN = re.compile(r"^(fwd|diff|bwd|recompute) L(\d+)$")
_UPDATE_SPAN = re.compile(r"^update L(\d+)$")
STEP_SPANS = ("gradient norm", "embedding/head")   # the engine's serial host phase in step()


def _as_listed(values: Any) -> Any:
    """A sequence as the list a profile's JSON holds (a tuple as [1, 2]), anything else as it is."""
    return list(values) if isinstance(values, (list, tuple)) else values


class MeasurementError(ValueError):
    """Measured costs that cannot be used; the message says what is missing or wrong."""


def _is_time(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


@dataclass(frozen=True)
class MeasuredCosts:
    """Seconds, per layer where it says so (medians over the traced steps)."""
    fwd_s: tuple[float, ...]       # layer i's forward without autograd
    diff_s: tuple[float, ...]      # layer i's forward with autograd and its backward
    nonlayer_s: float              # compute outside the blocks: embedding, head and loss, forward and backward
    step_s: float                  # step()'s serial host phase: gradient norm, the non-block update
    update_s: tuple[float, ...]    # layer i's host update (with its compute-copy refresh)
    source: str = "measured"
    # a selective layer (Plan.selective_layers): its forward, which keeps its matmul outputs, and its
    # re-run with autograd, which takes them (None: not measured; the planner assumes a share)
    selective_fwd_s: tuple[float, ...] | None = None
    selective_rerun_s: tuple[float, ...] | None = None
    # bytes layer i's autograd saves for its backward, its input and weights left out (None: not measured;
    # the planner takes its analytic estimate): what a graph layer holds, and an offloaded one sends
    saved_bytes: tuple[int, ...] | None = None
    # the engine's lazytrain.lean_norms when saved_bytes were measured (None: not known, as in profiles written
    # before it, taken as they are); planned with the other setting, they are shifted by the estimate's difference
    lean_norms: bool | None = None
    # the embedding's and head's gradient bytes the engine copies to their host masters each micro-batch, beside
    # its windows: (those made at the backward's start: head, final norm; those made last: the input embedding).
    # None: none cross a link (the masters are the parameters), or a profile from before the engine copied them
    # so (then inside the measured compute times)
    grads_beside_bytes: tuple[int, int] | None = None
    # the lowest layer the traced backwards differentiated: the layers below it were frozen with nothing before
    # them training, and no backward reached them (their diff_s is their fwd_s: no backward measured)
    first_differentiated: int = 0

    def __post_init__(self):
        for name in ("fwd_s", "diff_s", "update_s"):   # a number or null here would fail at len() unnamed
            if not isinstance(getattr(self, name), (list, tuple)):
                raise MeasurementError(f"measured costs: {name} must list one time per layer, got "
                                       f"{getattr(self, name)!r}")
        L = len(self.fwd_s)
        if L == 0:
            raise MeasurementError("measured costs need at least one layer")
        for name in ("diff_s", "update_s"):
            if len(getattr(self, name)) != L:
                raise MeasurementError(f"measured costs: {name} has {len(getattr(self, name))} layers, "
                                       f"fwd_s has {L}")
        for name in ("fwd_s", "diff_s", "update_s"):
            values = getattr(self, name)
            if not all(_is_time(v) for v in values):
                raise MeasurementError(f"measured costs: every {name} must be a finite time >= 0 s, got {list(values)!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        for name in ("nonlayer_s", "step_s"):
            v = getattr(self, name)
            if not _is_time(v):
                raise MeasurementError(f"measured costs: {name} must be a finite time >= 0 s, got {v!r}")
        for name in ("selective_fwd_s", "selective_rerun_s"):
            values = getattr(self, name)
            if values is None:
                continue
            if not isinstance(values, (list, tuple)) or len(values) != L or not all(_is_time(v) for v in values):
                raise MeasurementError(f"measured costs: {name} must hold a finite time >= 0 s for each of the "
                                       f"{L} layers, got {_as_listed(values)!r}")
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.saved_bytes is not None:
            values = self.saved_bytes
            if not isinstance(values, (list, tuple)) or len(values) != L or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise MeasurementError(f"measured costs: saved_bytes must hold a whole number of bytes >= 0 for each "
                                       f"of the {L} layers, got {_as_listed(values)!r}")
            object.__setattr__(self, "saved_bytes", tuple(values))
        if self.grads_beside_bytes is not None:
            values = self.grads_beside_bytes
            if not isinstance(values, (list, tuple)) or len(values) != 2 or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise MeasurementError(f"measured costs: grads_beside_bytes must be two whole numbers of bytes >= 0 "
                                       f"(head side, embedding), got {values!r}")
            object.__setattr__(self, "grads_beside_bytes", tuple(values))
        v = self.first_differentiated
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= L:
            raise MeasurementError(f"measured costs: first_differentiated must be a layer in 0..{L}, got {v!r}")
        if self.lean_norms is not None and not isinstance(self.lean_norms, bool):
            raise MeasurementError(f"measured costs: lean_norms must be true, false or null, got {self.lean_norms!r}")

    @property
    def num_layers(self) -> int:
        return len(self.fwd_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeasuredCosts":
        try:
            return cls(**d)
        except TypeError as e:
            raise MeasurementError(f"measured costs: {e}") from e

    @classmethod
    def from_traces(cls, traces: list, num_layers: int, source: str = "measured",
                    micro_batches: int = 1, lean_norms: bool | None = None,
                    grads_beside_bytes: tuple[int, int] | None = None) -> "MeasuredCosts":
        """The medians over traced steps. Each layer must have a plain forward and a re-run with autograd
        (a ``diff`` span) followed by its backward (``bwd``): trace a plan that keeps every boundary. Layers
        below the lowest one differentiated (a frozen bottom: ``first_differentiated``) have no backward; each
        step must differentiate from the same layer. With
        gradient accumulation a step runs ``micro_batches`` forwards and backwards: the compute times are
        per micro-batch (as the cost model counts them), the updates and the host phase per step.
        ``lean_norms``: the engine's ``lazytrain.lean_norms`` in the traced steps (what the layers' graphs
        saved depends on it). ``grads_beside_bytes``: what the engine's masters' gradient sink copies each
        micro-batch (see the field)."""
        if not traces:
            raise MeasurementError("no traced step to measure from")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise MeasurementError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        per_step = [_one_step(t, num_layers, micro_batches) for t in traces]
        firsts = sorted({s["first"] for s in per_step})
        if len(firsts) > 1:
            raise MeasurementError(f"the traced steps' backwards reached down to different layers ({firsts}): "
                                   f"measure steps that train the same parameters")
        first = firsts[0]

        def med(key, i=None, per=1):
            return statistics.median(s[key] if i is None else s[key][i] for s in per_step) / per
        k = micro_batches
        saved = None   # the most a layer's graph saved in any traced step (none on a trace without them)
        if all(None not in s["saved"][first:] for s in per_step):   # none saved below it: no backward
            saved = tuple(max(s["saved"][i] or 0 for s in per_step) for i in range(num_layers))
        fwd = tuple(med("fwd", i, k) for i in range(num_layers))
        return cls(fwd_s=fwd,
                   diff_s=tuple(med("diff", i, k) if i >= first else fwd[i] for i in range(num_layers)),
                   nonlayer_s=med("nonlayer", per=k), step_s=med("step"),
                   update_s=tuple(med("update", i) for i in range(num_layers)), source=source,
                   saved_bytes=saved, lean_norms=lean_norms, grads_beside_bytes=grads_beside_bytes,
                   first_differentiated=first)


def with_selective(costs: MeasuredCosts, traces: list, micro_batches: int = 1, layers=None,
                   kinds=None) -> MeasuredCosts:
    """``costs`` with the selective layers' times read from traced steps of a plan that keeps every
    boundary and makes ``layers`` selective (default: every layer): each such layer's forward (it keeps
    its matmul outputs) and its re-run with autograd before its backward (which takes them); medians per
    micro-batch. A layer not measured takes the times of its kind (``kinds[i]``: equal for layers of one
    shape) relative to its own forward: its forward times the median ratio of the measured layers of that
    kind (see :func:`layers_to_measure_selective`)."""
    L, first = costs.num_layers, costs.first_differentiated
    # a layer below the lowest one differentiated is never re-run: its selective times are its forward's
    layers = tuple(i for i in (range(L) if layers is None else layers) if i >= first)
    if not layers and first < L:
        raise MeasurementError("no layer to measure the selective layers' times on")
    per_step = []
    for t in traces:
        fwd, rerun = [0.0] * L, [0.0] * L
        for s in t.spans:
            m = _LAYER_SPAN.match(s.name) if s.lane == "compute" else None
            if m is None or int(m.group(2)) >= L:
                continue
            kind, i = m.group(1), int(m.group(2))
            if kind == "fwd":
                fwd[i] += s.end - s.start
            elif kind == "diff":
                rerun[i] += s.end - s.start
        if not all(fwd[i] for i in layers) or not all(rerun[i] for i in layers):
            raise MeasurementError("a traced step for the selective layers' times lacks a forward or a re-run of "
                                   "some layer: trace a keep-all plan with those layers selective")
        per_step.append((fwd, rerun))
    if not per_step:
        raise MeasurementError("no traced step to measure the selective layers from")
    med = lambda k, i: statistics.median(s[k][i] for s in per_step) / micro_batches   # noqa: E731
    sel_fwd = {i: med(0, i) for i in layers}
    sel_rerun = {i: med(1, i) for i in layers}
    if len(layers) < L:
        kinds = list(kinds) if kinds is not None else [None] * L
        if len(kinds) != L:
            raise MeasurementError(f"kinds names {len(kinds)} layers, the costs have {L}")
        for i in range(L):
            if i in sel_fwd:
                continue
            if i < first:
                sel_fwd[i] = sel_rerun[i] = costs.fwd_s[i]
                continue
            peers = [j for j in layers if kinds[j] == kinds[i]]
            if not peers:
                raise MeasurementError(f"layer {i} has no measured selective layer of its kind to take its times "
                                       f"from")
            sel_fwd[i] = costs.fwd_s[i] * _median_ratio(sel_fwd, costs.fwd_s, peers)
            sel_rerun[i] = costs.fwd_s[i] * _median_ratio(sel_rerun, costs.fwd_s, peers)
    return replace(costs, selective_fwd_s=tuple(sel_fwd[i] for i in range(L)),
                   selective_rerun_s=tuple(sel_rerun[i] for i in range(L)))


def _median_ratio(times: dict, fwd_s: tuple, peers: list) -> float:
    """The median over ``peers`` of a selective time over the layer's own plain forward."""
    ratios = [times[j] / fwd_s[j] for j in peers if fwd_s[j] > 0]
    if not ratios:
        raise MeasurementError(f"layers {peers} have no forward time to scale their selective times by")
    return statistics.median(ratios)


def layers_to_measure_selective(selective_bytes: list, kinds: list, room: int | None
                                ) -> tuple[tuple[int, ...], str | None]:
    """Which layers a calibration makes selective to measure their times: every layer when their kept
    outputs (``selective_bytes``, all held at the forward's end) fit in ``room`` bytes (None: no limit);
    else as many as fit, one kind (``kinds[i]``) after another in turn and spread evenly within each kind,
    the others taking their kind's times (:func:`with_selective`). Returns the layers, and why not every
    layer (None when every one); no layer, with why, when some kind cannot have even one."""
    L = len(selective_bytes)
    if len(kinds) != L:
        raise MeasurementError(f"kinds names {len(kinds)} layers, selective_bytes {L}")
    total = sum(selective_bytes)
    if room is None or total <= room:
        return tuple(range(L)), None
    groups: dict = {}
    for i, k in enumerate(kinds):
        groups.setdefault(k, []).append(i)
    count = dict.fromkeys(groups, 0)
    size = {k: max(selective_bytes[i] for i in members) for k, members in groups.items()}   # any member's
    used, grew = 0, True
    while grew:
        grew = False
        for k, members in groups.items():
            if count[k] < len(members) and used + size[k] <= room:
                used += size[k]
                count[k] += 1
                grew = True
    why = (f"every layer's kept matmul and attention outputs (about {total / 1e6:.1f} MB) do not fit on the "
           f"device tier beside the calibration plan's peak ({room / 1e6:.1f} MB free)")
    if not all(count.values()):
        return (), why
    chosen = []
    for k, members in groups.items():
        n, c = len(members), count[k]
        chosen += [members[round(j * (n - 1) / (c - 1))] for j in range(c)] if c > 1 else [members[n // 2]]
    return tuple(sorted(chosen)), why


def _one_step(timeline, L: int, micro_batches: int = 1) -> dict[str, Any]:
    """One traced step's times. The rest of the model (embedding, head, loss) runs outside the blocks' spans,
    so its time is what remains of the compute side's time before step() once the blocks and the waits are
    taken out. On CUDA the blocks and the waits are timed by events on the compute stream (a wait's span is
    the time the device sat still for it), on the CPU by the host: either way on the clock that the compute
    side spent."""
    fwd, diff, update = [0.0] * L, [0.0] * L, [0.0] * L
    saved: list[int | None] = [None] * L   # what a re-run with autograd saved (its span's saved_bytes)
    seen = {"fwd": set(), "diff": set(), "bwd": set(), "update": set()}
    step_start, step = None, 0.0
    layer_compute = waits = 0.0
    updates = []                       # (layer, span): the previous step's may still run in this forward
    # a forward never differentiated (an evaluation between the micro-batches, under grad or not) would add
    # its blocks' time to the layers' forwards and the rest of its time to the rest of the model's
    if ran_an_undifferentiated_forward(timeline, micro_batches):
        raise MeasurementError(f"the traced step {UNDIFFERENTIATED}")
    for s in timeline.spans:
        d = s.end - s.start
        if s.lane == "compute":
            m = _LAYER_SPAN.match(s.name)
            if m is None:
                continue
            kind, i = m.group(1), int(m.group(2))
            if i >= L:
                raise MeasurementError(f"the trace has {s.name!r} but the model has {L} layers")
            if kind == "recompute":
                raise MeasurementError("the traced step re-ran a segment (a 'recompute' span): measure with a plan "
                                       "that keeps every boundary (policy keep_all)")
            (fwd if kind == "fwd" else diff)[i] += d
            if kind == "diff" and "saved_bytes" in s.args:
                saved[i] = max(saved[i] or 0, int(s.args["saved_bytes"]))
            seen[kind].add(i)
            layer_compute += d
        elif s.lane == "wait":
            waits += d
        elif s.lane == "optimizer":
            m = _UPDATE_SPAN.match(s.name)
            if m is not None:
                updates.append((int(m.group(1)), s))
            elif s.name in STEP_SPANS:
                step += d
                step_start = s.start if step_start is None else min(step_start, s.start)
    # the layers below the lowest one differentiated (a frozen bottom) have no backward
    first = min(seen["diff"] | seen["bwd"], default=L)
    _all_layers_seen(seen, ("fwd",), L)
    _all_layers_seen(seen, ("diff", "bwd"), L, first)
    if step_start is None:
        raise MeasurementError("the traced step has no 'gradient norm' span: it must include engine.step()")
    for i, s in updates:
        if s.start >= step_start:                      # this step's own update, not the last one's
            update[i] += s.end - s.start
            seen["update"].add(i)
    _all_layers_seen(seen, ("update",), L)
    # the compute side's time up to step(), less the blocks and the waits, is the rest of the model
    nonlayer = step_start - layer_compute - waits
    if nonlayer < 0:
        raise MeasurementError(f"the traced step's blocks and waits ({layer_compute + waits:.4f} s) take longer "
                               f"than the time before step() ({step_start:.4f} s): spans overlap in this trace, so "
                               f"it was not recorded by the engine's trace_next_step")
    return {"fwd": fwd, "diff": diff, "update": update, "nonlayer": nonlayer, "step": step, "saved": saved,
            "first": first}


UNDIFFERENTIATED = ("ran a forward that was never differentiated (an evaluation between its micro-batches, with "
                    "gradients on or off?), whose time cannot be told apart from the step's: evaluate under "
                    "torch.no_grad() between optimizer steps (after engine.step()) while policy \"auto\" measures. "
                    "Where every block is frozen no forward is differentiated, and one forward more than the step's "
                    "micro-batches counts as such: a loss that runs the model twice a micro-batch cannot be measured "
                    "there (use a fixed policy)")


def ran_an_undifferentiated_forward(timeline, micro_batches: int | None = None) -> bool:
    """Whether a traced step holds a forward of the blocks that is not the step's: one under grad whose pass
    no backward re-ran (each block's spans name their pass), or one without autograd ("infer" spans). A
    step policy "auto" cannot measure, its time mixed with that forward's. Where no backward reaches a block
    (every block frozen, with nothing before them training), no pass has a backward span: then one pass more
    than the step's ``micro_batches`` (when given) is such a forward."""
    compute = [s for s in timeline.spans if s.lane == "compute"]
    if any(s.name.startswith("infer ") for s in compute):
        return True
    passes = {kind: {s.args["pass"] for s in compute if s.name.startswith(kind + " ") and "pass" in s.args}
              for kind in ("fwd", "diff")}   # (a "bwd" span names no pass)
    if not passes["diff"]:
        return micro_batches is not None and len(passes["fwd"]) > micro_batches
    return bool(passes["fwd"] - passes["diff"])


def _all_layers_seen(seen: dict[str, set], kinds: tuple, L: int, first: int = 0) -> None:
    for kind in kinds:
        missing = sorted(set(range(first, L)) - seen[kind])
        if missing:
            raise MeasurementError(f"the traced step has no {kind!r} span for layer(s) {missing[:8]}: measure "
                                   f"a whole training step (forward, backward and step()) of a plan that keeps "
                                   f"every boundary, with the layer updates overlapped")


# ---- a machine profile: what policy "auto" measured, saved for `lazytrain plan --profile` ----------------
PROFILE_FORMAT = "lazytrain-profile"
_DEVICE = re.compile(r"^(cpu|cuda|xpu|mps|hpu|npu|mtia|privateuseone)(:\d+)?$")   # torch's device types
LINK_LANES = {"h2d": "h2d_gbps", "d2h": "d2h_gbps", "nvme_read": "nvme_read_gbps", "nvme_write": "nvme_write_gbps"}


def link_bandwidths(traces: list) -> dict[str, float]:
    """GB/s each link moved while busy in the traced steps (bytes over the time at least one of its copies
    was open; a copy's latency counts as the link's), the median over the steps; links with no copy are
    left out."""
    out = {}
    for lane, field in LINK_LANES.items():
        rates = []
        for t in traces:
            nbytes = sum(int(s.args.get("bytes", 0)) for s in t.spans if s.lane == lane)
            busy = t.busy(lane)
            if nbytes > 0 and busy > 0:
                rates.append(nbytes / busy / 1e9)
        if rates:   # past MAX_GBPS, copies that moved no memory (in place): as fast as a plan can count a link
            out[field] = min(statistics.median(rates), MAX_GBPS)
    return out


def json_name(v) -> str:
    """``v`` as JSON writes it (true, "host")."""
    import json
    return json.dumps(v)


@dataclass(frozen=True)
class MachineProfile:
    """One model measured on one machine at one micro-batch: its costs, its links, and its shape (a
    Hugging Face config with the measured ``layer_params``), enough to plan it again elsewhere in time."""
    costs: MeasuredCosts
    links_gbps: dict                # HardwareProfile field -> GB/s, for the links the traced steps used
    model: dict                     # the model's config, as the engine planned it
    micro_batch: int
    seq_len: int
    device: str = "cpu"
    grad_accum: int = 1             # micro-batches per optimizer step in the run measured (its global batch)
    device_name: str | None = None  # the device's model (e.g. "NVIDIA H200"); None in profiles written before
    trainable_share: float = 1.0    # the share of the layers' parameters that trained (Budgets.trainable_share)
    non_block_trainable_share: float = 1.0   # and of the others (Budgets.non_block_trainable_share)
    hybrid_8bit_fraction: float | None = None   # of the trained ones, with 8-bit moments (None: not recorded)
    loss_chunk_tokens: int | None = None   # tokens per piece the LM head computed logits in (None: not recorded)
    world_size: int | None = None   # ranks of the run measured (its steps' times include their collectives)
    zero_stage: int | None = None   # and its ZeRO stage (what each rank updates); None: not recorded
    weights_in_host: bool | None = None   # the streamed copies in host memory, not on NVMe (Budgets'; None: not
    non_block_state: str | None = None    # recorded) and where the non-block optimizer state was kept

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": 1, "costs": self.costs.to_dict(),
                "links_gbps": dict(self.links_gbps), "model": self.model, "micro_batch": self.micro_batch,
                "seq_len": self.seq_len, "device": self.device, "grad_accum": self.grad_accum,
                "device_name": self.device_name, "trainable_share": self.trainable_share,
                "non_block_trainable_share": self.non_block_trainable_share,
                "hybrid_8bit_fraction": self.hybrid_8bit_fraction, "loss_chunk_tokens": self.loss_chunk_tokens,
                "world_size": self.world_size, "zero_stage": self.zero_stage,
                "weights_in_host": self.weights_in_host, "non_block_state": self.non_block_state}

    def to_json(self, path: str) -> None:
        import json

        from ..files import write_text_atomic
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "profile") -> "MachineProfile":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise MeasurementError(f"{where} is not a LazyTrain machine profile (no \"format\": "
                                   f"\"{PROFILE_FORMAT}\"); policy \"auto\" writes one with 'lazytrain.auto.profile_path'")
        if d.get("version") != 1:
            raise MeasurementError(f"{where} has version {d.get('version')!r}; this LazyTrain reads version 1")
        if not isinstance(d.get("costs"), dict):
            raise MeasurementError(f"{where}: costs must be an object, got {d.get('costs')!r}")
        missing = [k for k in ("costs", "links_gbps", "model", "micro_batch", "seq_len") if k not in d]
        if missing:
            raise MeasurementError(f"{where} has no {', '.join(repr(k) for k in missing)}")
        links = d["links_gbps"]
        if not isinstance(links, dict) or any(k not in LINK_LANES.values() for k in links) or \
                any(not _is_time(v) or v == 0 for v in links.values()):
            raise MeasurementError(f"{where}: links_gbps must map {', '.join(LINK_LANES.values())} to GB/s > 0, "
                                   f"got {links!r}")
        d = {"grad_accum": 1, **d}   # profiles written before it was recorded: one micro-batch a step
        for k in ("micro_batch", "seq_len", "grad_accum"):
            if isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 1:
                raise MeasurementError(f"{where}: {k} must be an integer >= 1, got {d[k]!r}")
        if not isinstance(d["model"], dict):
            raise MeasurementError(f"{where}: model must be the model's config object, got {type(d['model']).__name__}")
        device = d.get("device", "cpu")
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise MeasurementError(f"{where}: device must be a torch device such as \"cuda:0\" or \"cpu\", got "
                                   f"{device!r}")
        name = d.get("device_name")
        if name is not None and not isinstance(name, str):
            raise MeasurementError(f"{where}: device_name must be a string, got {name!r}")
        shares = {}
        for k, before in (("trainable_share", 1.0), ("non_block_trainable_share", 1.0),
                          ("hybrid_8bit_fraction", None)):
            share = d.get(k, before)   # profiles written before it was recorded: full fine-tuning, not recorded
            if share is None and before is None:
                shares[k] = None
                continue
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise MeasurementError(f"{where}: {k} must be a fraction in [0, 1], got {share!r}")
            shares[k] = float(share)
        chunk = d.get("loss_chunk_tokens")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise MeasurementError(f"{where}: loss_chunk_tokens must be an integer >= 1 or null, got {chunk!r}")
        run = {}
        for k, least in (("world_size", 1), ("zero_stage", 0)):
            v = d.get(k)   # profiles written before it was recorded: None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise MeasurementError(f"{where}: {k} must be an integer >= {least} or null, got {v!r}")
            run[k] = v
        for k, allowed in (("weights_in_host", (True, False)), ("non_block_state", ("host", "device"))):
            v = d.get(k)   # profiles written before it was recorded: None
            if v is not None and not any(type(v) is type(a) and v == a for a in allowed):   # (1 is not true)
                raise MeasurementError(f"{where}: {k} must be {' or '.join(json_name(a) for a in allowed)} or "
                                       f"null, got {v!r}")
            run[k] = v
        try:
            costs = MeasuredCosts.from_dict(d["costs"])
        except MeasurementError as e:   # named with the file it came from
            raise MeasurementError(f"{where}: {e}") from None
        return cls(costs=costs, links_gbps={k: float(v) for k, v in links.items()},
                   model=d["model"], micro_batch=d["micro_batch"], seq_len=d["seq_len"],
                   device=device, grad_accum=d["grad_accum"], device_name=name, loss_chunk_tokens=chunk, **shares,
                   **run)

    @classmethod
    def from_json(cls, path: str) -> "MachineProfile":
        import json
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise MeasurementError(f"machine profile {path}: {e}") from e
        return cls.from_dict(d, where=f"machine profile {path}")
