"""A layer's trip to the device: the device buffers the streamed weights land in, every copy in flight
into them, and the order in which layers are fetched.

Invariants, each held by this one object:

* Every copy into a device buffer is owned by the buffer's :class:`_Slot` until it is known to be done.
  A sequence that changes (a forward that is never differentiated, a model that calls its blocks out of
  order) abandons a prefetch, never its copy: the next copy into that slot first waits for it.
* A copy into a slot starts after the slot's last reader: on CUDA, the compute-stream event recorded
  when compute moved off the slot (not everything queued on the stream); on the CPU, compute is
  synchronous, so moving off the slot is that point.
* A layer's host copy is not rewritten while a copy still reads it: the host update calls
  :meth:`before_host_write` first (the write fence) and :meth:`after_host_write` after, which marks a
  resident layer's device copy stale. The refresh is issued in the forward's order, when the compute
  side takes the layer before it (as the Plan's cost model has it: a refresh issued as soon as the
  update lands would take the link ahead of the layers the forward needs first), and is ordered by
  events, with no host synchronisation. Once the update thread marks the layer updated,
  :meth:`on_update_done` issues the prefetch that was deferred because the layer's update was pending.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..tiers import TransferHandle
from ..tiers.base import completion_reached, wait_completion
from ..tiers.streams import issued_after, wait_span
from .weights import LayerWeights


@dataclass
class _Slot:
    """One device buffer the streamed layers take turns in."""
    buf: torch.Tensor
    layer: int | None = None      # whose weights it holds or is receiving
    copy: TransferHandle | None = None   # the copy into it, until the compute side waited for it
    landed: object = None         # that copy's completion (a Future or an event), until known done
    freed: object = None          # CUDA: compute-stream event after the slot's last reader


class WeightStream:
    """Owns the streaming slots, the resident layers' device copies and every copy into them."""

    def __init__(self, weights: LayerWeights, resident_layers: tuple[int, ...] = (), prefetch: bool = True):
        self.weights = weights
        self.device = weights.device
        self.prefetch = prefetch
        self._lock = threading.RLock()   # the update thread publishes readiness while the forward runs
        self.resident: dict[int, torch.Tensor] = {}
        self._resident_copy: dict[int, TransferHandle] = {}   # layer -> refresh the compute side must wait for
        self._stale: dict[int, object] = {}   # resident layer -> the launch event its refresh must follow
        for i in resident_layers:
            buf = torch.empty(weights.layer_numels[i], dtype=weights.compute_dtype, device=self.device)
            weights.device_tier.write(f"weights.resident{i}", buf, owned=True)
            weights.fetch_into(i, buf).synchronize()
            self.resident[i] = buf
        self.slots: list[_Slot] = []
        if len(self.resident) < weights.num_layers:
            for s in range(2):   # sized for the largest layer; a smaller one uses the front
                buf = torch.empty(weights.max_layer_numel, dtype=weights.compute_dtype, device=self.device)
                weights.device_tier.write(f"weights.slot{s}", buf, owned=True)
                self.slots.append(_Slot(buf))
        self._reads: dict[int, list] = {}   # layer -> completions of copies reading its host copy
        self._seq: list[int] = []
        self._cursor = 0
        self._current: int | None = None     # slot the compute side is using
        self._prefetched: tuple[int, int] | None = None   # (sequence index, slot) of the prefetch in flight
        self._deferred: int | None = None    # sequence index whose prefetch waits for the layer's update

    @property
    def zero_copy(self) -> bool:
        return self.weights.zero_copy

    # ---- the order of fetches ----------------------------------------------------------------------
    def start(self, seq: list[int]) -> None:
        """Expect the layers in ``seq`` next. A prefetch of the old sequence is abandoned; its copy stays
        with its slot until a later copy into that slot waits for it."""
        with self._lock:
            self._seq, self._cursor, self._prefetched, self._deferred = list(seq), 0, None, None
            self._prefetch_next()

    def acquire(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s compute weights on the device (the compute side may use them at once), then
        the next layer of the sequence prefetched into the other slot."""
        with self._lock:
            on_seq = self._cursor < len(self._seq) and self._seq[self._cursor] == layer
            if not on_seq:   # the model left the expected order: fetch on demand from here on
                self._seq, self._prefetched, self._deferred = [], None, None
        if self.weights.update_pending(layer):
            with wait_span(f"update {layer}", self.device):
                self.weights.wait_updated(layer)   # outside the lock: the update thread takes it to publish
        else:
            self.weights.wait_updated(layer)       # raises a failed update
        with self._lock:
            if layer in self.resident:
                self._refresh_if_stale(layer)   # not yet issued: the model left the expected order
                refresh = self._resident_copy.get(layer)
                if refresh is not None:
                    with wait_span(f"refresh {layer}", self.device):
                        refresh.wait()     # the compute side follows the refresh's copy (no host wait on CUDA)
                    del self._resident_copy[layer]   # kept while it fails: every forward raises, none computes
                flat = self.resident[layer]
                self._move_to(None)
            elif self.zero_copy:
                flat = self.weights.stored_copy(layer)
                self._move_to(None)
            else:
                pending = self._prefetched
                if on_seq and pending is not None and pending[0] == self._cursor:
                    s = pending[1]
                    self._prefetched = None
                else:
                    if self._deferred is not None and self._deferred <= self._cursor:
                        self._deferred = None   # fetched here, now that its update is done
                    s = self._other_slot()
                    self._issue(layer, s)
                flat = self._take(s)
                self._move_to(s)
            if on_seq:
                self._cursor += 1
            self._prefetch_next()
        return flat

    def _other_slot(self) -> int:
        return 0 if self._current is None else 1 - self._current

    def _move_to(self, s: int | None) -> None:
        """Compute moves to slot ``s`` (None: a resident or in-place layer): the slot it leaves is free
        for a copy once what was queued on it so far has run."""
        prev = self._current
        if prev is not None and prev != s:
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self.slots[prev].freed = event
            else:
                self.slots[prev].freed = None   # CPU compute is synchronous: its reads are done
        self._current = s

    def _prefetch_next(self) -> None:
        seq, j = self._seq, self._cursor
        if j < len(seq) and seq[j] in self._stale and not self.weights.update_pending(seq[j]):
            self._refresh_if_stale(seq[j])   # the next layer is resident: its refresh goes now
        if not self.prefetch or self.zero_copy or self._prefetched is not None or not self.slots:
            return
        while j < len(seq) and seq[j] in self.resident:
            j += 1
        if j >= len(seq):
            return
        if self.weights.update_pending(seq[j]):
            self._deferred = j      # issued by on_update_done once the layer's update lands
            return
        s = self._other_slot()
        self._issue(seq[j], s)
        self._prefetched = (j, s)

    # ---- copies into slots -------------------------------------------------------------------------
    def _settle(self, slot: _Slot) -> None:
        """Wait until the copy last issued into ``slot`` is over, whoever issued it."""
        wait_completion(slot.landed)
        slot.landed = slot.copy = None

    def _issue(self, layer: int, s: int) -> None:
        slot = self.slots[s]
        self._settle(slot)
        n = self.weights.layer_numels[layer]
        with issued_after(slot.freed):
            handle = self.weights.fetch_into(layer, slot.buf[:n])
        slot.layer, slot.copy, slot.landed = layer, handle, handle.completion()
        self._note_read(layer, slot.landed)

    def _take(self, s: int) -> torch.Tensor:
        slot = self.slots[s]
        with wait_span(f"weights {slot.layer}", self.device):
            flat = slot.copy.wait()   # CUDA: the compute stream waits for the copy's event; CPU: the host does
        slot.copy = None
        return flat

    def _note_read(self, layer: int, done) -> None:
        if done is None:
            return
        reads = [d for d in self._reads.get(layer, ()) if not completion_reached(d)]
        reads.append(done)
        self._reads[layer] = reads

    # ---- the host update's side ----------------------------------------------------------------------
    def before_host_write(self, layers: Iterable[int]) -> None:
        """The write fence: returns once no copy reads the host copy of any of ``layers`` any more."""
        with self._lock:
            layers = list(layers)
            reads = [d for i in layers for d in self._reads.pop(i, ())]
            for i in layers:   # a refresh still due from an earlier write reads after this one instead
                self._stale.pop(i, None)
        for done in reads:
            wait_completion(done)

    def after_host_write(self, layer: int, launch_event=None) -> None:
        """Layer ``layer``'s host copy is new: its resident device copy is stale, to be refreshed after
        ``launch_event`` (the compute-stream point where the step began, so kernels still reading the old
        copy finish first) when the forward comes to it, or now if it already has."""
        if layer in self.resident:
            with self._lock:
                self._stale[layer] = launch_event
                if self._cursor < len(self._seq) and self._seq[self._cursor] == layer:
                    self._refresh_if_stale(layer)

    def _refresh_if_stale(self, layer: int) -> None:
        if layer not in self._stale:
            return
        with issued_after(self._stale[layer]):
            handle = self.weights.fetch_into(layer, self.resident[layer])
        del self._stale[layer]   # only once issued: a refresh that fails to start stays due, and every acquire raises
        self._resident_copy[layer] = handle
        self._note_read(layer, handle.completion())

    def on_update_done(self, layer: int) -> None:
        """Called by the update thread once layer ``layer`` is marked updated: issue its deferred prefetch."""
        with self._lock:
            j = self._deferred
            if j is None or j < self._cursor or j >= len(self._seq) or self._seq[j] != layer \
                    or self._prefetched is not None:
                return
            s = self._other_slot()
            try:
                self._issue(layer, s)
            except Exception:  # noqa: BLE001 - a prefetch is not the update: acquire fetches it and raises
                return
            self._deferred = None
            self._prefetched = (j, s)

    def settle_all(self) -> None:
        """Wait for every copy in flight into the device buffers (before they are freed or rewritten)."""
        with self._lock:
            for slot in self.slots:
                self._settle(slot)
            for handle in self._resident_copy.values():
                wait_completion(handle.completion())   # its failure, if any, was the forward's to report
            self._resident_copy.clear()
            self._prefetched = self._deferred = None
