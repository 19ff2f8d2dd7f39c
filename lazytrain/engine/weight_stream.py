"""A layer's trip to the device: the device buffers the streamed weights land in, every copy in flight
into them, and the order in which layers are fetched.

Layers are fetched a window ahead, as the Plan's cost model has it: a sequence comes in windows (a
forward window is one layer; a backward window that re-runs a segment holds every layer it re-runs and
the one it differentiates), and when the compute side enters a window the copies of the whole next
window are issued, in order. Two buffers are kept for the stream's life; a window pair that needs more
(a multi-layer window ahead) takes extra buffers, each released as soon as compute leaves it, so the
device holds what the Plan charges each window (the layers of this window and the next), no more. Where
the device tier has no room for an extra buffer (a fixed policy on a budget no plan was checked against),
the prefetch stops there and the layer is fetched when compute comes to it, into a kept buffer.

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
  :meth:`on_update_done` issues the prefetch that was deferred because the layer's update was pending
  (and the ones after it: copies are issued in the sequence's order).
* An extra buffer is released only once no copy into it can still be running: taken by the compute side
  (which waited for its copy) or known to have landed. On CUDA it is allocated on the stream current
  where it is issued (the compute stream; the update thread's when a deferred prefetch needs one, which
  one-layer forward windows never do), so the memory returns to those allocations; its copy is ordered
  after all the work queued there when it was allocated (whose kernels may still read that memory under
  an earlier owner). That is later than a kept buffer's copy, which waits only for its last reader: the
  copies of a multi-layer window issued as the forward ends overlap the head, not the last layer.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..tiers import TierBudgetError, TransferHandle
from ..tiers.base import completion_reached, wait_completion
from ..tiers.streams import issued_after, wait_span
from .weights import LayerWeights


class ResidentRefreshError(RuntimeError):
    """A resident layer's device copy failed to take its updated weights: it is stale until a load."""


@dataclass(eq=False)   # a slot is itself: compared by identity
class _Slot:
    """One device buffer the streamed layers take turns in."""
    buf: torch.Tensor
    key: str                      # its name in the device tier
    extra: bool = False           # beyond the two kept: released once compute leaves it
    stream: object = None         # CUDA: the stream it was allocated on
    layer: int | None = None      # whose weights it holds or is receiving
    copy: TransferHandle | None = None   # the copy into it, until the compute side waited for it
    landed: object = None         # that copy's completion (a Future or an event), until known done
    freed: object = None          # CUDA: compute-stream event after the slot's last reader


class WeightStream:
    """Owns the streaming buffers, the resident layers' device copies and every copy into them."""

    BUFFERS_KEPT = 2   # what a one-layer window pair needs: the layer computing and the next one landing

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
        self._slot_names = 0
        self.peak_slots = 0   # the most slots held at once (a Plan's window pair charges as many layers)
        if len(self.resident) < weights.num_layers:
            for _ in range(self.BUFFERS_KEPT):   # sized for the largest layer; a smaller one uses the front
                self._new_slot(weights.max_layer_numel, extra=False)
        self._reads: dict[int, list] = {}   # layer -> completions of copies reading its host copy
        self._seq: list[int] = []
        self._window_end: list[int] = []   # sequence index -> end (exclusive) of the window holding it
        self._cursor = 0                     # sequence index the compute side takes next
        self._next = 0                       # first sequence index not yet issued (nor resident)
        self._current: _Slot | None = None   # slot the compute side is using
        self._prefetched: dict[int, _Slot] = {}   # sequence index -> the slot its copy lands in
        self._deferred: int | None = None    # sequence index whose prefetch waits for the layer's update

    @property
    def zero_copy(self) -> bool:
        return self.weights.zero_copy

    # ---- the order of fetches ----------------------------------------------------------------------
    def start(self, windows: list[list[int]]) -> None:
        """Expect these layers next, window by window. A prefetch of the old sequence is abandoned; its copy
        stays with its slot until a later copy into that slot waits for it."""
        seq, ends = [], []
        for w in windows:
            seq.extend(w)
            ends.extend([len(seq)] * len(w))
        with self._lock:
            self._seq, self._window_end = seq, ends
            self._cursor = self._next = 0
            self._prefetched, self._deferred = {}, None
            # the layer last taken is done with once its queued compute has run: the new sequence takes
            # it again into a slot of its own (a graph layer computes on its own copy); extras are trimmed
            self._move_to(None)
            self._prefetch_next()

    def acquire(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s compute weights on the device (the compute side may use them at once), then
        the next window's layers prefetched if this one starts a window."""
        with self._lock:
            on_seq = self._cursor < len(self._seq) and self._seq[self._cursor] == layer
            if not on_seq:   # the model left the expected order: fetch on demand from here on
                self._seq, self._window_end, self._prefetched, self._deferred = [], [], {}, None
                self._cursor = self._next = 0
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
                        try:
                            refresh.wait()   # the compute side follows the refresh's copy (no host wait on CUDA)
                        except Exception as e:
                            raise ResidentRefreshError(
                                f"resident layer {layer}'s device copy could not be refreshed from its host copy "
                                f"({type(e).__name__}: {e}): it holds no valid weights, so every forward refuses "
                                f"until engine.load_checkpoint(...) rewrites them") from e
                    del self._resident_copy[layer]   # kept while it fails: every forward raises, none computes
                flat = self.resident[layer]
                self._move_to(None)
            elif self.zero_copy:
                flat = self.weights.stored_copy(layer)
                self._move_to(None)
            else:
                slot = self._prefetched.pop(self._cursor, None) if on_seq else None
                if slot is None:
                    if on_seq and self._deferred is not None and self._deferred <= self._cursor:
                        self._deferred = None   # fetched here, now that its update is done
                    slot = self._free_slot(layer)
                    self._issue(layer, slot)
                flat = self._take(slot)
                self._move_to(slot)
            if on_seq:
                self._cursor += 1
                self._next = max(self._next, self._cursor)
            self._prefetch_next()
        return flat

    def _horizon(self) -> int:
        """Sequence index up to which copies are issued: the end of the window after the one the compute
        side is in (before the first acquire, of the first window)."""
        if not self._seq:
            return 0
        if self._cursor == 0:
            return self._window_end[0]
        end = self._window_end[self._cursor - 1]
        return self._window_end[end] if end < len(self._seq) else end

    def _prefetch_next(self) -> None:
        seq, j = self._seq, self._cursor
        if j < len(seq) and seq[j] in self._stale and not self.weights.update_pending(seq[j]):
            self._refresh_if_stale(seq[j])   # the next layer is resident: its refresh goes now
        self._issue_ahead()

    def _issue_ahead(self) -> None:
        """Issue the copies up to the horizon, in the sequence's order, stopping at a layer whose update is
        still pending (``on_update_done`` goes on from there)."""
        if not self.prefetch or self.zero_copy or self._deferred is not None or not self.slots:
            return
        seq, horizon = self._seq, self._horizon()
        while self._next < horizon:
            j = self._next
            if seq[j] not in self.resident:
                if self.weights.update_pending(seq[j]):
                    self._deferred = j   # issued by on_update_done once the layer's update lands
                    return
                slot = self._free_slot(seq[j], allocate=False)
                if slot is None:
                    try:
                        slot = self._new_slot(self.weights.layer_numels[seq[j]], extra=True)
                    except (TierBudgetError, torch.OutOfMemoryError):
                        return   # no room for another buffer now: acquire fetches it into a kept one
                self._issue(seq[j], slot)
                self._prefetched[j] = slot
            self._next = j + 1

    # ---- the buffers -------------------------------------------------------------------------------
    def _new_slot(self, numel: int, extra: bool) -> _Slot:
        buf = torch.empty(numel, dtype=self.weights.compute_dtype, device=self.device)
        key = f"weights.slot{self._slot_names}"
        self._slot_names += 1
        self.weights.device_tier.write(key, buf, owned=True)
        slot = _Slot(buf, key, extra=extra)
        if self.device.type == "cuda":
            slot.stream = torch.cuda.current_stream(self.device)
            if extra:   # the allocator may hand out memory that queued kernels still read under an earlier owner
                event = torch.cuda.Event()
                event.record(slot.stream)
                slot.freed = event
        self.slots.append(slot)
        self.peak_slots = max(self.peak_slots, len(self.slots))
        return slot

    def _busy(self) -> list[_Slot]:
        return [self._current, *self._prefetched.values()]

    def _free_slot(self, layer: int, allocate: bool = True) -> _Slot | None:
        """A slot no one uses that fits layer ``layer``: a kept one first, else an extra, else a new extra
        (``allocate``; otherwise None)."""
        n = self.weights.layer_numels[layer]
        busy = self._busy()
        free = [s for s in self.slots if all(s is not b for b in busy) and s.buf.numel() >= n]
        if free:
            return min(free, key=lambda s: s.extra)
        return self._new_slot(n, extra=True) if allocate else None

    def _trim(self) -> None:
        """Release the extra slots no one uses whose copies cannot still be running."""
        busy = self._busy()
        for slot in [s for s in self.slots if s.extra and all(s is not b for b in busy)]:
            if slot.copy is not None and not completion_reached(slot.landed):
                continue   # an abandoned copy still lands in it: kept (and reused, or released later)
            if slot.stream is not None and slot.stream != torch.cuda.current_stream(self.device):
                slot.buf.record_stream(torch.cuda.current_stream(self.device))
            self.slots.remove(slot)
            self.weights.device_tier.free(slot.key)

    def _move_to(self, s: _Slot | None) -> None:
        """Compute moves to slot ``s`` (None: a resident or in-place layer): the slot it leaves is free
        for a copy once what was queued on it so far has run."""
        prev = self._current
        if prev is not None and prev is not s:
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                prev.freed = event
            else:
                prev.freed = None   # CPU compute is synchronous: its reads are done
        self._current = s
        if any(slot.extra for slot in self.slots):
            # the one compute left, and any an abandoned prefetch kept while its copy was in flight: once it
            # has landed, it goes now rather than at the next start (a whole forward later)
            self._trim()

    # ---- copies into slots -------------------------------------------------------------------------
    def _settle(self, slot: _Slot) -> None:
        """Wait until the copy last issued into ``slot`` is over, whoever issued it."""
        wait_completion(slot.landed)
        slot.landed = slot.copy = None

    def _issue(self, layer: int, slot: _Slot) -> None:
        self._settle(slot)
        n = self.weights.layer_numels[layer]
        with issued_after(slot.freed):
            handle = self.weights.fetch_into(layer, slot.buf[:n])
        slot.layer, slot.copy, slot.landed = layer, handle, handle.completion()
        self._note_read(layer, slot.landed)

    def _take(self, slot: _Slot) -> torch.Tensor:
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
        """The write fence: returns once no copy reads the host copy of any of ``layers`` any more. A refresh
        still due from an earlier write stays due (it is not issued during the write: only the compute side
        issues one, past a pending update, or :meth:`after_host_write` for the layer it marks): a layer fenced
        but left unwritten (a load that writes some layers only) keeps the refresh its last update needs."""
        with self._lock:
            reads = [d for i in layers for d in self._reads.pop(i, ())]
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
                    try:
                        self._refresh_if_stale(layer)
                    except Exception:  # noqa: BLE001 - not the update's failure (its copy could not be stored,
                        pass           # say): it stays due, and the forward's acquire tries again and raises

    def _refresh_if_stale(self, layer: int) -> None:
        if layer not in self._stale:
            return
        with issued_after(self._stale[layer]):
            handle = self.weights.fetch_into(layer, self.resident[layer])
        del self._stale[layer]   # only once issued: a refresh that fails to start stays due, and every acquire raises
        self._resident_copy[layer] = handle
        self._note_read(layer, handle.completion())

    def on_update_done(self, layer: int) -> None:
        """Called by the update thread once layer ``layer`` is marked updated: issue its deferred prefetch
        (and the ones after it up to the horizon)."""
        with self._lock:
            j = self._deferred
            if j is None or j < self._cursor or j >= len(self._seq) or self._seq[j] != layer:
                return
            self._deferred = None
            try:
                self._issue_ahead()
            except Exception:  # noqa: BLE001 - a prefetch is not the update: acquire fetches it and raises
                return

    def settle_all(self) -> None:
        """Wait for every copy in flight into the device buffers (before they are freed or rewritten)."""
        with self._lock:
            for slot in self.slots:
                self._settle(slot)
            for handle in self._resident_copy.values():
                wait_completion(handle.completion())   # its failure, if any, was the forward's to report
            self._resident_copy.clear()
            self._prefetched, self._deferred = {}, None
            self._next = self._cursor
            self._trim()
