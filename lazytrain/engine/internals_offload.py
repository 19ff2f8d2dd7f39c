"""Offload of one streamed block's autograd internals to the host, and back for its backward.

Why: a block either keeps its internals on the device from its forward to its backward (costly in
memory), or drops them and re-runs its forward in backward (costly in compute). A Plan's
``offloaded_layers`` take a third way: the block's forward records its graph with every tensor autograd
saves copied to the host tier as it is saved (saved-tensor hooks; the copies run on the tier's copy
stream or threads while the forward goes on), and the copies come back from the window the Plan names,
so backward differentiates the block from its graph without re-running it.

The block's weights are not copied with its internals: a saved tensor that lies in the block's streamed
weight buffer is kept as a reference into it (byte offset, shape, strides) and resolved, in backward,
against the weights streamed to the device again for that backward.

Where the Plan splits the copies over windows (``Plan.internals_offload_shares``, and
``internals_prefetch_shares`` back), the saved tensors wait on the device and each window issues the
next of them, in the order they were saved, while the bytes issued stay within the running sum of its
shares (a tensor goes when at least half of it falls within; the last window issues the rest).

A window's copies to the host end before the next window computes (``wait_sent``), as the Plan's windows
do: the planner counts a saved tensor's device memory free once its window's copies are over, and the
simulator starts the next window then. A forward that ran on ahead of its copies would hold every
offloaded layer's internals on the device at once where the link is the bottleneck.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten

from ..tiers import Tier, TransferHandle
from ..tiers.base import TierError, wait_completions
from . import lean_norms


class InternalsOffloadError(RuntimeError):
    pass


class _WeightRef:
    """A saved tensor that is a view of the block's weight buffer: where in the buffer, and its shape."""
    __slots__ = ("byte_offset", "size", "stride", "dtype")

    def __init__(self, byte_offset: int, size, stride, dtype):
        self.byte_offset, self.size, self.stride, self.dtype = byte_offset, tuple(size), tuple(stride), dtype


class _Kept:
    """A saved tensor that stays where it is: already in host memory beside a device's compute."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Sent:
    """A saved tensor sent to the host: its index, and how to give it back its shape and strides (the shape
    of its dense form when it is another view of the bytes sent under that index, else None; the
    permutation that undoes :func:`_compact`'s, None for none; where a slice lay, whose values crossed
    contiguous: (its storage's key, its first byte, its strides), None for other tensors; then its broadcast
    shape)."""
    __slots__ = ("index", "unpermute", "shape", "reshape", "place")

    def __init__(self, index: int, unpermute: tuple[int, ...] | None, shape: tuple[int, ...],
                 reshape: tuple[int, ...] | None = None, place: tuple | None = None):
        self.index, self.unpermute, self.shape, self.reshape = index, unpermute, shape, reshape
        self.place = place


def _compact(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """What of ``t`` to send: a view without its broadcast dimensions (stride 0: sent once, not expanded)
    and, when its memory is dense, with its dimensions in memory order, so that the contiguous copy the
    host holds comes back with ``t``'s strides (a transposed input stays transposed for its backward
    kernel). The order is None where the memory is not dense (a slice): its values come back contiguous."""
    v = t
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            v = v.narrow(d, 0, 1)
    order = tuple(sorted(range(v.dim()), key=lambda d: -v.stride(d)))
    dense = v.permute(order)
    return (dense, order) if dense.is_contiguous() else (v, None)


def _dense_span(t: torch.Tensor, sent: torch.Tensor) -> tuple | None:
    """What identifies the bytes ``t`` holds when ``sent`` (its :func:`_compact` form) is every byte of
    ``t``'s span in memory order: any view whose dense form is the same span holds the same values in the
    same order (a reshape, or a transpose then a reshape). None for other tensors (slices, broadcasts)."""
    if not sent.is_contiguous() or sent.numel() == 0:
        return None
    first, last = _byte_span(t)
    if last - first != sent.numel() * sent.element_size():
        return None
    return t.untyped_storage().data_ptr(), first, last, t.dtype, t._version


def _running_shares(split: dict[int, float]) -> dict[int, float]:
    """{window: share} -> {window: the shares of that window and those before it}; the last is exactly 1."""
    out, total = {}, 0.0
    for w in sorted(split):
        total += split[w]
        out[w] = total
    out[max(split)] = 1.0
    return out


def _due_upto(running: dict[int, float], window: int, sizes: list[int], upto: int) -> int:
    """How many saved tensors (in the order saved) are due by ``window``, ``upto`` being already issued: a
    tensor is due when at least half of it falls within the running share of the bytes (all of them at
    the split's last window)."""
    if window >= max(running):
        return len(sizes)
    reached = [x for w, x in running.items() if w <= window]
    target = sum(sizes) * reached[-1] if reached else 0.0
    k, before = upto, sum(sizes[:upto])
    while k < len(sizes) and before + sizes[k] / 2 <= target:
        before += sizes[k]
        k += 1
    return k


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte offsets within its storage that ``t`` can reach."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return start, start + (reach + 1) * t.element_size()


class OffloadedInternals:
    """The tensors one block's forward saved for its backward, held in a host tier under keys of their
    own. It owns every read of them it issues: each is waited on before the keys are freed."""

    def __init__(self, tier: Tier, key: str, device: torch.device, weights: torch.Tensor, owned: set,
                 window: int = 0, out_split: dict[int, float] | None = None,
                 back_split: dict[int, float] | None = None):
        """``window``: the forward window recording it; ``out_split``/``back_split``: {window: share} of the
        copies to the host and back (None: every copy to the host as its tensor is saved, every copy back
        at the first ``prefetch()``)."""
        self._tier, self._key, self._device, self._owned = tier, key, device, owned
        self._window = window
        self._out = _running_shares(out_split) if out_split else None
        self._back = _running_shares(back_split) if back_split else None
        self._pending: dict[int, tuple] = {}          # saved index -> (tensor sent, tensor saved, version): not yet written
        self._sizes: list[int] = []                  # saved index -> bytes
        self._sent_upto = self._read_upto = 0        # split copies: indices below these are issued
        self._weights_storage = weights.untyped_storage().data_ptr()
        self._weights_span = _byte_span(weights)
        self._keys: list[str] = []
        # (data_ptr, offset, shape, stride, dtype, version) -> (tensor, index, the shape it is viewed as or None)
        self._index: dict[tuple, tuple] = {}
        # (data_ptr, first byte, last byte, dtype, version) -> index, for tensors whose dense form is every byte
        # of that span in memory order: another view of the same bytes (a reshape of it) is not sent again
        self._spans: dict[tuple, int] = {}
        self._reads: dict[int, TransferHandle] = {}  # saved index -> read in flight
        # what says each copy to the host issued is over, until waited on (not its handle: that keeps the saved
        # tensor, device memory, alive until then)
        self._writes: list = []
        self._values: dict[int, torch.Tensor] = {}   # saved index -> on the device, for this backward
        self._changed: dict[int, tuple] = {}         # saved index -> (version saved, version after the forward)
        # the storages of the tensors the forward sent (data_ptr): an output in one reaches the model as a copy,
        # as its copy to the host may not have run yet (executor._handed_out)
        self.saved_storages: frozenset[int] = frozenset()
        # slices (tensors that are not dense) by their storage and dtype: the bytes their spans cover together,
        # and, in backward, one device buffer of that span they come back into, each at its place
        self._slice_spans: dict[tuple, tuple[int, int]] = {}
        self._slice_buffers: dict[tuple, torch.Tensor] = {}
        self._placed: set[int] = set()               # saved indices whose value is in its slice buffer
        self._weights_now: torch.Tensor | None = None
        self.nbytes = 0                              # bytes sent to the host

    # ---- forward -------------------------------------------------------------------------------
    @contextmanager
    def recording(self):
        """Run the block's forward with autograd inside this: what it saves goes to the host. The tensors
        sent stay referenced until the forward ends (as its graph would hold them), so that no address is
        reused while the forward runs and one tensor saved by several ops goes once."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    lean_norms.inputs_checked_as_forward_ends():
                yield
        finally:
            for ident, (t, n, _) in self._index.items():   # changed in place after it was saved, in the forward:
                if t._version != ident[-1]:               # plain autograd refuses it if backward uses it
                    self._changed[n] = (ident[-1], t._version)
            self.saved_storages = frozenset(ident[0] for ident in self._index)
            self._index.clear()
            self._spans.clear()
        if self._out is not None:   # the forward window's share leaves now its forward has saved everything
            self.send_through(self._window)

    def send_through(self, window: int) -> None:
        """Issue the copies to the host of the shares up to ``window`` (split copies only)."""
        if self._out is None or not self._pending:
            return
        upto = _due_upto(self._out, window, self._sizes, self._sent_upto)
        for n in range(self._sent_upto, upto):
            sent, t, version = self._pending.pop(n)
            if t._version != version:   # changed in place after the forward, before its copy: autograd's rule
                self._changed[n] = (version, t._version)
                continue
            self._writes.append(self._tier.write(self._keys[n], sent).completion())
            self._owned.add((self._tier.name, self._keys[n]))
        self._sent_upto = max(self._sent_upto, upto)

    def wait_sent(self) -> None:
        """Block until every copy to the host issued so far has ended (each window's, before the next window
        computes). A failed copy is not raised here: the tier records it against its key, and it is raised
        where backward reads that tensor, if it does (a tensor changed in place before its copy fails it, and
        plain autograd objects only when backward uses it)."""
        if self._writes:
            writes, self._writes = self._writes, []
            wait_completions(writes, f"internals out {self._key.rsplit('.', 1)[-1]}", self._device)

    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided:   # a sparse tensor has no one storage to copy: it stays where it is
            return _Kept(t)
        if t.untyped_storage().data_ptr() == self._weights_storage:
            first, last = _byte_span(t)
            lo, hi = self._weights_span
            if lo <= first and last <= hi:
                return _WeightRef(first - lo, t.shape, t.stride(), t.dtype)
        if t.device.type == "cpu" and self._device.type != "cpu":
            return _Kept(t)
        # the version too: a tensor changed in place after an op saved it (legal when that op's backward
        # never runs, as for a result only looked at) is another value for the ops that save it after
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                 t._version)
        sent, order = _compact(t)
        _, n, reshape = self._index.get(ident, (None, None, None))
        span = _dense_span(t, sent) if n is None else None
        if span is not None and span in self._spans:   # the bytes of a tensor already sent, in another shape
            n, reshape = self._spans[span], tuple(sent.shape)
            self._index[ident] = (t, n, reshape)
        elif n is None:
            n = len(self._keys)
            self._index[ident] = (t, n, None)
            if span is not None:
                self._spans[span] = n
            key = f"{self._key}.saved{n}"
            self._keys.append(key)
            self._sizes.append(sent.numel() * sent.element_size())
            if self._out is None:
                self._writes.append(self._tier.write(key, sent).completion())
                self._owned.add((self._tier.name, key))
            else:                  # held on the device until its window's share is issued; detached (the same
                # memory and version counter): ``t``'s graph holds what these hooks packed, so ``t`` itself here
                # would be a cycle through autograd that the collector cannot see, never freed if its window never
                # comes (a forward that fails midway)
                self._pending[n] = (sent.detach(), t.detach(), ident[-1])
            self.nbytes += self._sizes[-1]
        unpermute = None if order is None else tuple(sorted(range(len(order)), key=order.__getitem__))
        # a slice (gate and up of one matmul's chunk(2)) comes back with its strides, where it lay among the
        # other slices of its storage: a kernel given other strides may round otherwise (the CPU's vectorized
        # and scalar loops), and no longer bit for bit; the slices of one storage share one buffer of the span
        # they cover, as autograd's views share their base
        place = None
        if order is None and reshape is None and sent.numel() > 0:
            storage = (t.untyped_storage().data_ptr(), t.dtype)
            first, last = _byte_span(sent)
            lo, hi = self._slice_spans.get(storage, (first, last))
            self._slice_spans[storage] = (min(lo, first), max(hi, last))
            place = (storage, first, tuple(sent.stride()))
        return _Sent(n, unpermute, tuple(t.shape), reshape, place)

    def weights_kept_outside_saved_tensors(self, outputs) -> list[str]:
        """The autograd Functions of the recorded graph (reached from ``outputs``) that keep a view of the
        block's weight buffer as an attribute of their ctx, not through ``ctx.save_for_backward``: the
        hooks never see it, so it is neither copied nor a reference resolved against the weights streamed
        again, and their backward reads the buffer as it is then."""
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen, found = set(), []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            attrs = getattr(node, "__dict__", None)   # a Python Function's ctx attributes
            if attrs and any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == self._weights_storage
                             for v in tree_flatten(list(attrs.values()))[0]):
                found.append(type(node).__name__)
            stack.extend(fn for fn, _ in node.next_functions)
        return sorted(set(found))

    # ---- backward ------------------------------------------------------------------------------
    def prefetch(self, window: int | None = None) -> None:
        """Start the saved tensors' copies back to the device: the shares up to ``window`` where the copies
        back are split, else all of them (idempotent)."""
        upto = len(self._keys)
        if self._back is not None and window is not None:
            upto = _due_upto(self._back, window, self._sizes, self._read_upto)
        self._read_upto = max(self._read_upto, upto)
        for n in range(upto):
            if n not in self._reads and n not in self._values and n not in self._pending:
                try:
                    self._reads[n] = self._tier.read(self._keys[n], device=self._device)
                except TierError:   # its write failed: that is raised where backward needs it, if it does
                    pass

    def use_weights(self, weights: torch.Tensor) -> None:
        """The block's weight buffer on the device for its backward (same layout as in its forward)."""
        self._weights_now = weights

    def _unpack(self, packed):
        if isinstance(packed, _WeightRef):
            w = self._weights_now
            if w is None:
                raise InternalsOffloadError(f"{self._key}: the block's weights were not streamed back before its "
                                            f"backward (internal error)")
            base = w.storage_offset() * w.element_size() + packed.byte_offset
            size = packed.dtype.itemsize
            return torch.empty(0, dtype=packed.dtype, device=w.device).set_(
                w.untyped_storage(), base // size, packed.size, packed.stride)
        if isinstance(packed, _Kept):
            return packed.tensor
        n = packed.index
        if n in self._pending and self._pending[n][1]._version != self._pending[n][2]:   # never sent, changed
            self._changed[n] = (self._pending[n][2], self._pending[n][1]._version)
        if n in self._changed:
            saved, now = self._changed[n]
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: a tensor of shape {list(packed.shape)} that offloaded block "
                               f"{self._key.rsplit('layer', 1)[-1]} saved is at version {now}; expected version {saved} "
                               f"instead (it was changed in place after the block's forward saved it)")
        value = self._values.get(n)
        if value is None and n in self._pending:   # never sent (its window's share was not issued): still here,
            value = self._pending[n][0]             # as it was saved
            self._placed.add(n)
        if value is None:
            handle = self._reads.pop(n, None) or self._tier.read(self._keys[n], device=self._device)
            value = handle.wait()
            if value.device != self._device:
                value = value.to(self._device)
            self._values[n] = value
        if packed.place is not None and n not in self._placed:
            value = self._values[n] = self._in_slice_buffer(packed.place, value)
            self._placed.add(n)
        if packed.reshape is not None:
            value = value.view(packed.reshape)
        if packed.unpermute is not None:
            value = value.permute(packed.unpermute)
        return value.expand(packed.shape)

    def _in_slice_buffer(self, place: tuple, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a slice's values, contiguous) copied to its place in its storage's slice buffer: the
        slice again, with its strides; the contiguous copy is let go."""
        storage, first, strides = place
        (lo, hi), size = self._slice_spans[storage], value.element_size()
        if (first - lo) % size:   # another dtype's bytes between them: not one buffer of these
            return value
        buffer = self._slice_buffers.get(storage)
        if buffer is None:
            buffer = self._slice_buffers[storage] = torch.empty((hi - lo + size - 1) // size, dtype=value.dtype,
                                                                device=value.device)
        return buffer.as_strided(value.shape, strides, (first - lo) // size).copy_(value)

    def release(self) -> None:
        """Wait for the copies still in flight, then free the host copies (after the block's backward, or
        when its pass is dropped)."""
        reads, self._reads = self._reads, {}
        try:
            self.wait_sent()
            for handle in reads.values():
                try:
                    handle.wait()
                except Exception:  # noqa: BLE001 - a read backward never used: nobody's failure to report
                    pass
        finally:
            # no handle left before the keys go: one read to the device keeps a view of its host buffer, which
            # would then leave the host pool
            reads = handle = None
            self._values.clear()
            self._slice_buffers.clear()
            self._pending.clear()
            self._weights_now = None
            for key in self._keys:
                self._tier.free(key)
                self._owned.discard((self._tier.name, key))
            self._keys = []
