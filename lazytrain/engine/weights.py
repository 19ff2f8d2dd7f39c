"""Block weights on the host: fp32 master + compute-dtype copy in one flat buffer per layer, plus the
gradient buffers and the path gradients take into them. Their trip to the device (slots, resident
copies, prefetch order) is :mod:`~lazytrain.engine.weight_stream`'s.

The user's trainable block ``nn.Parameter`` objects become views into the fp32 master buffer, so
``model.parameters()``, ``state_dict()`` and any optimizer built over them see the real master weights;
their ``.grad`` are views into one fp32 flat gradient buffer per layer. Frozen block parameters (a LoRA
run's base weights) have no gradient buffer and, unless the fp32 weights are the compute copy (fp32 training
with the copies in host memory), no fp32 weights either: they are kept in the compute dtype, as DeepSpeed's
bf16/fp16 module holds them (2 host bytes a parameter, not 10): views of the compute copy where it is in host
memory, else (the copies on NVMe) of a host buffer of the layer's frozen part, from which its stored copy is
written. Each layer lays out its trainable parameters first, so that their fp32 weights and
gradients are a prefix of the layer's layout and only that prefix crosses a link. With the state sharded over
data-parallel ranks, a rank may hold no gradient buffer (``send_grads_to_owners``) and, in bf16/fp16, no fp32
weights (``drop_foreign_masters``: the parameters are then views of the compute copy) for layers other
ranks own; the buffers may live in memory the node's ranks share (``move_masters``, ``move_compute_copies``).
"""
from __future__ import annotations

import collections
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..tiers import Tier, TransferHandle, empty_host
from ..tiers import streams
from ..tiers.memory import async_copy
from .distributed import CollectiveError
from .host_accumulate import add_into, scratch_for, sum_of_squares
from .layer_updates import LayerUpdates


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: torch.Size
    offset: int
    numel: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's view in a layer's flat buffer (weights, gradients or a compute copy)."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


def _layout(block: nn.Module) -> list[tuple[ParamSlot, nn.Parameter]]:
    """Where each of a block's parameters sits in its layer's flat buffers: the trainable ones first, then
    the frozen ones, each in ``named_parameters`` order (the trainable ones' fp32 weights and gradients are
    then the first elements of the layer's layout, what :class:`LayerWeights` stores and sends of them)."""
    named = list(block.named_parameters())
    ordered = [(n, p) for n, p in named if p.requires_grad] + [(n, p) for n, p in named if not p.requires_grad]
    out, offset = [], 0
    for name, p in ordered:
        out.append((ParamSlot(name, p.shape, offset, p.numel()), p))
        offset += p.numel()
    return out


class LayerWeights:
    """Host-side storage of every streamed layer: masters, compute copies, gradient buffers."""

    def __init__(self, blocks: nn.ModuleList, compute_dtype: torch.dtype, device: torch.device,
                 weights_tier: Tier, device_tier: Tier):
        self.blocks = blocks
        self.num_layers = len(blocks)
        self.compute_dtype = compute_dtype
        self.device = device
        self.weights_tier = weights_tier
        self.device_tier = device_tier
        # each layer's parameter layout in its flat buffers; layers may differ (a dense first layer before
        # mixture-of-experts ones, sliding and global attention with different head sizes)
        layouts = [_layout(block) for block in blocks]
        self.layer_slots: list[list[ParamSlot]] = [[s for s, _ in layout] for layout in layouts]
        self.params: list[list[nn.Parameter]] = [[p for _, p in layout] for layout in layouts]
        self.layer_numels = [sum(s.numel for s in slots) for slots in self.layer_slots]
        self.max_layer_numel = max(self.layer_numels, default=0)
        # which parameters train, per layer (a user may freeze some layers or some tensors), and how many
        # elements of the layout they take (its first ones: the size of the layer's gradient buffer)
        self.trainable = [[p.requires_grad for p in params] for params in self.params]
        self.any_trainable = any(any(t) for t in self.trainable)
        self.trainable_numels = [sum(s.numel for s, t in zip(slots, trains) if t)
                                 for slots, trains in zip(self.layer_slots, self.trainable)]
        self.max_trainable_numel = max(self.trainable_numels, default=0)
        self.shares_master = compute_dtype == torch.float32 and weights_tier.kind == "host"
        # frozen parameters kept in the compute dtype, without fp32 weights (unless those are the copy itself)
        self.frozen_without_master = not self.shares_master
        # ... in the compute copy (it is in host memory, apart from the fp32 weights)
        self.frozen_in_copy = self.frozen_without_master and weights_tier.kind == "host"
        # ... or, the copy in another tier (NVMe), in a host buffer per layer of its frozen part (frozen_part)
        self.frozen_apart = self.frozen_without_master and weights_tier.kind != "host"
        # fp32 weights per layer: the trainable prefix, or the whole layer where the copy is the fp32 weights
        self.master_numels = self.layer_numels if self.shares_master else self.trainable_numels
        self.master: list[torch.Tensor | None] = []   # None: another rank's layer (drop_foreign_masters)
        # with frozen_apart: each layer's frozen parameters (the layout's elements past the trainable prefix)
        self.frozen_part: list[torch.Tensor | None] = []
        self.grad: list[torch.Tensor | None] = []   # None: a layer another rank owns (sharded gradients)
        self._staging: torch.Tensor | None = None
        # frozen parameters as the user gave them, until set-up is done (see hand_back_frozen): their storage
        # where it is host memory (the user's own), else None (a device's memory is not held through set-up)
        self._given: dict[int, tuple[torch.Tensor | None, torch.dtype]] = {}
        self._set_up_done = False
        # the sum of each layer's parameters' versions (autograd's counters, which a write through a parameter
        # moves and the engine's own writes into its flat buffers do not) when its compute copy was last written:
        # a write since (a script's in-place write to a block parameter) leaves the copy stale
        self._copied_version: list[int | None] = [None] * self.num_layers
        try:
            self._build(blocks, device)
        except BaseException:   # the frozen parameters moved so far go back to what they were given as
            self.hand_back_frozen()
            raise
        # with copy threads on, the CPU stands in for a device: gradients and weights are copied as on CUDA
        emulated = device.type == "cpu" and streams.settings().copy_threads
        self._grad_sink = _GradientSink(self) if device.type == "cuda" or emulated else None
        # With the CPU as compute device and the weights already in host memory in the compute dtype,
        # a "copy to the device" would copy memory onto itself: hand out the stored buffer instead.
        self.zero_copy = device.type == "cpu" and weights_tier.kind == "host" and not emulated
        # set by the engine when the optimizer updates layers on another thread (layer_updates.py)
        self.updates: LayerUpdates | None = None
        self._unstored: set[int] = set()   # see mark_unstored
        self._to_owners = None              # see send_grads_to_owners
        self._scratch: torch.Tensor | None = None   # the adds made on the autograd thread: _backward_scratch
        self.masters_sharded = False        # see drop_foreign_masters
        # layer -> (its gradient buffer, the buffer's version, its sum of squares then): taken as gradients
        # land, unless landed_sums is off (lazytrain.grad_norm_as_landed; or reduced only at the step)
        self._square_sums: list[tuple[torch.Tensor, int, float] | None] = [None] * self.num_layers
        # layer -> (its gradient buffer, the buffer's version) when it was last cleared: the first gradient to
        # land after, with the version unmoved, is written into it without reading it (landed_sums trusts the
        # counter as this does)
        self._cleared_at: list[tuple[torch.Tensor, int] | None] = [None] * self.num_layers
        self.landed_sums = True

    def _build(self, blocks: nn.ModuleList, device: torch.device) -> None:
        """Every layer's buffers, the block parameters made views into them (see the module docstring)."""
        for i, block in enumerate(blocks):
            slots, params = self.layer_slots[i], self.params[i]
            if self.frozen_in_copy:
                self._write_compute_copy(i, lambda flat: [s.of(flat).copy_(p.detach()) for s, p in zip(slots, params)])
            master = empty_host(self.master_numels[i], torch.float32)
            grad = empty_host(self.trainable_numels[i], torch.float32).zero_()
            self.master.append(master)
            self.grad.append(grad)
            self.frozen_part.append(empty_host(self.layer_numels[i] - self.trainable_numels[i], self.compute_dtype)
                                    if self.frozen_apart else None)
            for slot, p, trains in zip(slots, params, self.trainable[i]):
                if self.frozen_without_master and not trains:
                    self._given.setdefault(id(p), (p.data if p.device.type == "cpu" else None, p.dtype))
                    home = self.frozen_home(i, slot)
                    if self.frozen_apart:   # the compute copy was written with it already (frozen_in_copy)
                        home.copy_(p.detach())
                    p.data = home
                    continue
                slot.of(master).copy_(p.detach())
                p.data = slot.of(master)
                if trains:
                    p.grad = slot.of(grad)
            # buffers (e.g. rotary inv_freq) stay on the compute device
            for bname, buf in list(block.named_buffers()):
                mod_name, _, attr = bname.rpartition(".")
                owner = block.get_submodule(mod_name) if mod_name else block
                owner._buffers[attr] = buf.to(device)
        for i in range(self.num_layers):
            self._store_compute_copy(i)

    def frozen_home(self, i: int, slot: ParamSlot) -> torch.Tensor | None:
        """Where layer i keeps the frozen parameter at ``slot``: in its compute copy (``frozen_in_copy``), its
        frozen part (``frozen_apart``: the layout past the trainable prefix) or its fp32 weights; None for
        another rank's layer, whose fp32 weights this rank does not hold."""
        if self.frozen_apart:
            start = slot.offset - self.trainable_numels[i]
            return self.frozen_part[i][start:start + slot.numel].view(slot.shape)
        flat = self.weights_tier.read(self._key(i)).wait() if self.frozen_in_copy else self.master[i]
        return None if flat is None else slot.of(flat)

    def move_masters(self, homes: list[torch.Tensor], copy_values: bool = True) -> None:
        """Move every layer's fp32 weights into ``homes[i]`` (fp32 buffers of the layers' sizes: the node-shared
        ones of :mod:`~lazytrain.engine.node_memory`), the parameters with them. Before the optimizer is
        built; with ``shares_master`` the stored compute copy is that memory too. ``copy_values=False``: the
        values are already there (another rank of the node wrote them), only the parameters move."""
        self._check_homes(homes, torch.float32)
        for i, home in enumerate(homes):
            if copy_values:
                home.copy_(self.master[i])
            for slot, p in zip(self.layer_slots[i], self.params[i]):
                p.data = slot.of(home)
            self.master[i] = home
            if self.shares_master:
                self.weights_tier.free(self._key(i))
                self.weights_tier.write(self._key(i), home, owned=True)

    def move_compute_copies(self, homes: list[torch.Tensor], copy_values: bool = True) -> None:
        """Move every layer's stored compute copy (host tier, training precision) into ``homes[i]`` (the
        node-shared buffers), parameters that are views of a copy with it. ``copy_values=False``: another rank
        of the node wrote the values."""
        if self.weights_tier.kind != "host":
            raise ValueError(f"move_compute_copies needs compute copies in host memory, not {self.weights_tier.kind}")
        self._check_homes(homes, self.compute_dtype)
        for i, home in enumerate(homes):
            old = self.weights_tier.read(self._key(i)).wait()
            if copy_values:
                home.copy_(old)
            for slot, p in zip(self.layer_slots[i], self.params[i]):
                if p.data.data_ptr() == slot.of(old).data_ptr():
                    p.data = slot.of(home)
            self.weights_tier.free(self._key(i))
            self.weights_tier.write(self._key(i), home, owned=True)

    def _check_homes(self, homes: list[torch.Tensor], dtype: torch.dtype) -> None:
        got = [(h.numel(), h.dtype) for h in homes]
        if got != [(n, dtype) for n in self.layer_numels]:
            raise ValueError(f"the layers need {dtype} buffers of {self.layer_numels} elements, got {got}")

    def set_up_done(self) -> None:
        """The engine is set up: the storage the frozen parameters were given in (kept so that a set-up that
        fails hands them back as they were) is let go."""
        self._given.clear()
        self._set_up_done = True

    def hand_back_frozen(self) -> None:
        """Before the model is handed back (``destroy()``, a set-up that failed): frozen parameters kept in the
        compute copy get storage of their own again: during set-up the very storage they were given in (given
        in a device's memory, their values in the compute dtype, in the dtype given), after it the compute
        copy's values (what training computed with) in fp32, as the trained parameters."""
        if not self.frozen_without_master:
            return
        done = set()
        for params, trains in zip(self.params, self.trainable):
            for p, t in zip(params, trains):
                if t or id(p) in done:
                    continue
                done.add(id(p))
                given = self._given.get(id(p))
                if given is not None:
                    storage, dtype = given
                    p.data = storage if storage is not None else p.data.to(dtype, copy=True)
                elif not self._set_up_done:   # set-up never moved it (it failed before this layer)
                    continue
                else:
                    p.data = p.data.to(torch.float32, copy=True)
        self._given.clear()

    def drop_foreign_masters(self, owns) -> None:
        """Sharded state in mixed precision: the fp32 weights of the layers other ranks own (``owns(i)``
        false) are dropped, 4 bytes a parameter. Their parameters become views of the layers' compute copies,
        which the owners' broadcasts keep current (:meth:`published`)."""
        if self.shares_master or self.weights_tier.kind != "host":
            raise ValueError("drop_foreign_masters needs compute copies in host memory apart from the fp32 weights")
        self.masters_sharded = True
        for i in range(self.num_layers):
            if owns(i):
                continue
            copy = self.weights_tier.read(self._key(i)).wait()
            for slot, p in zip(self.layer_slots[i], self.params[i]):
                p.data = slot.of(copy)
            self.master[i] = None
            self._unstored.discard(i)

    def published(self, i: int) -> torch.Tensor:
        """What layer i's owner sends the other ranks after updating it: its fp32 weights, or with the
        masters sharded its compute copy (the others keep no fp32 weights for it); of the trainable
        parameters only, where the frozen ones are the copy's alone."""
        if self.masters_sharded:
            copy = self.weights_tier.read(self._key(i)).wait()
            return copy[:self.trainable_numels[i]] if self.frozen_in_copy else copy
        return self.master[i]

    # ---- readiness after an overlapped optimizer step ------------------------------------------
    def update_pending(self, i: int) -> bool:
        """Layer i's optimizer update is still running: its weights must not be read yet."""
        return self.updates is not None and self.updates.pending(i)

    def wait_updated(self, i: int) -> None:
        if self.updates is not None:
            self.updates.wait(i)

    # ---- compute copy ----------------------------------------------------------------------
    def _key(self, i: int) -> str:
        return f"weights.layer{i}"

    def _store_compute_copy(self, i: int) -> None:
        """Layer i's compute copy written from its fp32 weights (with ``frozen_in_copy``, their trainable
        prefix: the frozen rest is the copy's own)."""
        if self.master[i] is not None:   # else another rank's layer: the copy itself is what its owner sent
            self._write_copy_from_master(i)
        self._note_copied(i)

    def _note_copied(self, i: int) -> None:
        self._copied_version[i] = self._written(i)

    def _written(self, i: int) -> int:
        """How many writes went through layer i's parameters (versions only grow: any write moves the sum)."""
        return sum(p._version for p in self.params[i])

    def note_copies_current(self) -> None:
        """Every layer's compute copy holds its fp32 weights as they are (set-up is done)."""
        for i in range(self.num_layers):
            self._note_copied(i)

    def written_in_place(self) -> list[int]:
        """The layers whose parameters were written through since their compute copy was written: a script's
        in-place write to a block parameter (``p.copy_``, ``nn.init``, a pruning mask), which the parameter (its
        fp32 weights, or a frozen one's copy in host memory) shows but the copy the forward streams does not. A
        layer whose update is still running is not looked at (its update writes the copy from the weights as it
        finds them)."""
        return [i for i in range(self.num_layers) if self.written_since_copied(i)]

    def written_since_copied(self, i: int) -> bool:
        # a layer whose update is done noted its copy before its flag was set
        return not self.update_pending(i) and self._written(i) != self._copied_version[i]

    def _write_copy_from_master(self, i: int) -> None:
        master = self.master[i]
        if self.shares_master:
            if self._key(i) not in self.weights_tier:
                self.weights_tier.write(self._key(i), master, owned=True)
            return
        if self.weights_tier.kind == "host" and self._key(i) in self.weights_tier:
            self.weights_tier.read(self._key(i)).wait()[:master.numel()].copy_(master)   # in place, same buffer
            return
        frozen = self.frozen_part[i]
        if frozen is None:
            self._write_compute_copy(i, lambda flat: flat.copy_(master))
            return

        def fill(flat: torch.Tensor) -> None:   # the trainable prefix from the fp32 weights, then the frozen rest
            flat[:master.numel()].copy_(master)
            flat[master.numel():].copy_(frozen)
        self._write_compute_copy(i, fill)

    def _write_compute_copy(self, i: int, fill) -> None:
        """Write layer i's compute copy whole into its tier: ``fill(flat)`` writes its values into a
        compute-dtype buffer of the layer's size."""
        if self._staging is None:   # one staging buffer, reused: each write completes before the next
            self._staging = empty_host(self.max_layer_numel, self.compute_dtype)
        staging = self._staging[:self.layer_numels[i]]
        fill(staging)
        self.weights_tier.write(self._key(i), staging).synchronize()

    def copy_shared_frozen(self) -> None:
        """A frozen weight shared by several blocks is stored in each of their layers, the parameter a view of
        one of them: after a load wrote it there, the others are written the same (inside the weight stream's
        fence: in bf16/fp16 they are the compute copies)."""
        where: dict[int, list[tuple[int, ParamSlot]]] = {}
        params = {}
        for i in range(self.num_layers):
            for slot, p, trains in zip(self.layer_slots[i], self.params[i], self.trainable[i]):
                if not trains:
                    where.setdefault(id(p), []).append((i, slot))
                    params[id(p)] = p
        for key, places in where.items():
            if len(places) < 2:
                continue
            src = params[key].detach()
            for i, slot in places:
                dst = self.frozen_home(i, slot)
                if dst is None:   # another rank's layer, its copy written by its owner
                    continue
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)

    def mark_unstored(self, layers) -> None:
        """Layers whose compute copy could not be stored after their update: stored again, from the fp32
        weights, before anything reads them (``fetch_into``, ``stored_copy``)."""
        self._unstored.update(layers)

    def _store_if_unstored(self, i: int) -> None:
        if i in self._unstored:
            self._store_compute_copy(i)   # raises while it still cannot: the layer stays unstored
            self._unstored.discard(i)

    def refresh_compute_copy(self, i: int, host_copy_current: bool = False) -> None:
        """After the optimizer updated layer i's master weights: rewrite the host compute-dtype copy
        (unless the optimizer already wrote it in its update pass). Call inside the weight stream's fence
        (``WeightStream.before_host_write`` / ``after_host_write``)."""
        if not host_copy_current or i in self._unstored:
            self._store_compute_copy(i)
        else:   # the optimizer wrote it in its update pass
            self._note_copied(i)
        self._unstored.discard(i)

    def compute_copy_views(self) -> dict[torch.Tensor, torch.Tensor] | None:
        """{block parameter: its view in the host compute-dtype copy}, for an optimizer that writes the
        copy in its update pass; None when the copy is not a separate buffer in host memory."""
        if self.shares_master or self.weights_tier.kind != "host":
            return None
        views = {}
        for i in range(self.num_layers):
            flat = self.weights_tier.read(self._key(i)).wait()
            for s, p, trains in zip(self.layer_slots[i], self.params[i], self.trainable[i]):
                if trains:
                    views[p] = s.of(flat)
        return views

    # ---- what the weight stream copies -------------------------------------------------------
    def fetch_into(self, i: int, buf: torch.Tensor) -> TransferHandle:
        """Start copying layer i's compute-dtype weights into device buffer ``buf``."""
        self._store_if_unstored(i)
        return self.weights_tier.read(self._key(i), out=buf)

    def stored_copy(self, i: int) -> torch.Tensor:
        """Layer i's compute copy as stored (``zero_copy``: the CPU computes on it in place)."""
        self._store_if_unstored(i)
        return self.weights_tier.read(self._key(i)).wait()

    def views(self, flat: torch.Tensor, layer: int, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """Name -> tensor views of layer ``layer``'s weights in a flat device buffer, to swap into the
        block for one call; with ``requires_grad``, its trainable parameters become leaves that require
        grad (for backward)."""
        out = {}
        for k, s in enumerate(self.layer_slots[layer]):
            t = s.of(flat)
            if requires_grad and self.trainable[layer][k]:
                t = t.detach().requires_grad_(True)
            out[s.name] = t
        return out

    # ---- gradients -------------------------------------------------------------------------
    def accumulate_grads(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        """Add a layer's weight gradients (device, compute dtype) into its fp32 host buffer."""
        if self._grad_sink is not None:
            self._grad_sink.submit(i, grads)
            return
        if self._to_owners is not None:   # flattened into the send buffer
            flat = self.flatten_grads(i, grads, self._to_owners.send_buffer(self.trainable_numels[i]))
            self._note_square_sum(i, self._to_owners.land(i, flat, self.grad[i], self._backward_scratch(),
                                                          self.landed_sums))
            return
        flat = self.grad[i]
        for s in self._trainable_slots(i):
            g = grads.get(s.name)
            if g is not None:
                add_into(s.of(flat).view(-1), g.reshape(-1), self._backward_scratch())

    def _backward_scratch(self) -> torch.Tensor:
        """The fp32 scratch of the adds made on the autograd thread (no gradient sink)."""
        if self._scratch is None:
            self._scratch = scratch_for(self.max_trainable_numel)
        return self._scratch

    def _trainable_slots(self, i: int) -> list[ParamSlot]:
        return [s for s, trains in zip(self.layer_slots[i], self.trainable[i]) if trains]

    def flatten_grads(self, i: int, grads: dict[str, torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """Layer i's named gradients laid out in ``flat`` (``trainable_numels[i]`` elements) as its trainable
        weights are (zeros for a missing one)."""
        for s in self._trainable_slots(i):
            g = grads.get(s.name)
            s.of(flat).copy_(g) if g is not None else s.of(flat).zero_()
        return flat

    def land_grads(self, i: int, flat: torch.Tensor, scratch: torch.Tensor) -> None:
        """Add layer i's flat gradient of one micro-batch (on the host) into its fp32 buffer (through the
        caller's fp32 ``scratch``: host_accumulate.py), or reduce it to the layer's owner when the gradients
        are sharded."""
        if self._to_owners is not None:
            with streams.span("host", f"grad reduce L{i}", bytes=flat.numel() * flat.element_size()):
                self._note_square_sum(i, self._to_owners.land(i, flat, self.grad[i], scratch, self.landed_sums))
        else:
            with streams.span("host", f"grad add L{i}", bytes=flat.numel() * flat.element_size()):
                self._note_square_sum(i, add_into(self.grad[i], flat, scratch, square_sum=self.landed_sums,
                                                  dst_is_zero=self._still_cleared(i)))

    def _still_cleared(self, i: int) -> bool:
        """Whether layer i's buffer is zero as it was cleared, nothing having written it since as autograd's
        version counter sees it (trusted as ``landed_sums`` trusts it); the answer is spent: the caller writes."""
        cleared, self._cleared_at[i] = self._cleared_at[i], None
        buf = self.grad[i]
        return self.landed_sums and cleared is not None and cleared[0] is buf and cleared[1] == buf._version

    def _note_square_sum(self, i: int, value: float | None) -> None:
        """Layer i's gradient buffer has ``value`` as its sum of squares now (None: not known)."""
        if value is not None and self.landed_sums:
            buf = self.grad[i]
            self._square_sums[i] = (buf, buf._version, value)

    def grad_square_sum(self, i: int) -> float:
        """The sum of squares of layer i's fp32 gradient buffer, for the step's norm: the one taken as its last
        gradient landed, when nothing wrote the buffer since as autograd's version counter sees it (an
        in-place op on it or on a parameter's ``.grad``, the engine's own reduces and zeroing), else read from
        it now (the same value, bit for bit, as host_accumulate.py takes it). A write the counter does not
        see (through ``.data``, numpy, a collective writing its memory) is not seen here: with
        ``lazytrain.grad_norm_as_landed`` false every buffer is read at the step."""
        buf = self.grad[i]
        known = self._square_sums[i]
        if self.landed_sums and known is not None and known[0] is buf and known[1] == buf._version:
            return known[2]
        return sum_of_squares(buf)

    @property
    def reduced_as_landed(self):
        """The :class:`~lazytrain.engine.sharding.GradientsToOwners` reducing each layer's gradient to its
        owner as it lands (sharded data parallel), else None."""
        return self._to_owners

    @property
    def grads_to_owners(self) -> bool:
        """Each micro-batch's layer gradients are reduced to the layer's owner as they land (then every rank
        must land every trainable layer the backward reaches, zeros where it has none)."""
        return self._to_owners is not None

    def send_grads_to_owners(self, to_owners) -> None:
        """Sharded data parallel: from now on each micro-batch's layer gradients are reduced to the layer's
        owner as they land (:class:`~lazytrain.engine.sharding.GradientsToOwners`), and this rank drops the
        gradient buffers of the layers it does not own."""
        self.flush_grads()
        self._to_owners = to_owners
        if to_owners.on_device and self._grad_sink is not None:
            self._grad_sink.reduce_on_device(to_owners.dtype)
        for i in range(self.num_layers):
            if not to_owners.owns(i):
                self.grad[i] = None
                for p in self.params[i]:
                    p.grad = None

    def hand_back_grads(self, keep: bool) -> None:
        """The block parameters' ``.grad`` as the model is handed back: views of this object's buffers no more
        (copies where ``keep``, else None)."""
        for params in self.params:
            for p in params:
                g = p.grad   # none kept for a parameter given another tensor since (its next pass was refused)
                fits = g is not None and (g.shape, g.dtype, g.device) == (p.shape, p.dtype, p.device)
                p.grad = g.detach().clone() if keep and fits else None

    def set_comm_dtype(self, dtype: torch.dtype) -> None:
        """Gradients reduced to their owners are summed in ``dtype`` from now on (between steps: none in
        flight)."""
        if self._to_owners is None:
            return
        self.flush_grads()
        self._to_owners.use_dtype(dtype)
        if self._to_owners.on_device and self._grad_sink is not None:
            self._grad_sink.reduce_on_device(dtype)

    def flush_grads(self, discard: bool = False) -> None:
        """Every gradient in flight landed (``discard``: or given up, the buffers being zeroed next)."""
        if self._grad_sink is not None:
            self._grad_sink.flush(discard)

    def settle_grads(self) -> None:
        """Every gradient in flight landed or failed (a failure is kept for the next flush): at the end of a
        backward, so that the block parameters' ``.grad`` read after it hold the whole backward's gradients."""
        if self._grad_sink is not None:
            self._grad_sink.settle()

    def end_backward(self, settle: bool) -> None:
        """A backward that accumulated into the layers' buffers ended: ``settle``, its gradients landed first;
        then every trainable block parameter's ``.grad`` shows its buffer again, but a layer's whose overlapped
        update is still pending (a forward that skipped it): its ``.grad`` stays unset until the update is
        done and clears the buffer, so that no script's zero_grad reaches a buffer the update reads."""
        if settle:
            self.settle_grads()
        for i in range(self.num_layers):
            if not self.update_pending(i):
                self.attach_grads(i)

    @property
    def grads_in_flight(self) -> bool:
        """Gradients leave the device through the sink: they land after the backward that made them."""
        return self._grad_sink is not None

    def close_grad_sink(self) -> None:
        """Before the model is handed back: every add landed (or failed) and the sink's thread stopped, so no
        ``.grad`` of the handed-back parameters changes afterwards."""
        if self._grad_sink is not None:
            self._grad_sink.close()
            self._grad_sink = None

    def grad_views(self, i: int) -> dict[nn.Parameter, torch.Tensor]:
        """{trainable parameter of layer i: its view in the layer's flat fp32 gradient buffer}; empty for a
        layer whose gradients another rank holds, or whose fp32 weights it does (its parameters are then
        compute-copy views, and at stage 1 its buffer here only waits for the reduce to the owner)."""
        if self.grad[i] is None or self.master[i] is None:
            return {}
        return {p: s.of(self.grad[i]) for s, p, trains in zip(self.layer_slots[i], self.params[i],
                                                              self.trainable[i]) if trains}

    def attach_grads(self, i: int | None = None) -> None:
        """Make every trainable block parameter's ``.grad`` (of layer ``i``, or all) the view into its flat
        buffer again (an optimizer's ``zero_grad(set_to_none=True)`` may have cleared it)."""
        for j in range(self.num_layers) if i is None else (i,):
            for p, view in self.grad_views(j).items():
                p.grad = view

    def zero_grads(self) -> None:
        for i in range(self.num_layers):
            self.zero_layer_grads(i)

    def zero_layer_grads(self, i: int, cleared: bool = False) -> None:
        """Layer i's gradient buffer zero and attached to its parameters again; ``cleared``: it is zero already
        (the optimizer's update cleared it as it read it, a write autograd's counter saw)."""
        if self.grad[i] is not None:
            if not cleared:
                self.grad[i].zero_()
            self._note_square_sum(i, 0.0)
            self._cleared_at[i] = (self.grad[i], self.grad[i]._version)
            self.attach_grads(i)


_NO_SPAN = contextlib.nullcontext()


class _GradientSink:
    """Gradients off the device without holding up backward: the autograd thread only flattens a layer's
    gradients into one device buffer (queued on the compute stream) and records an event; a worker thread
    copies it into its pinned staging buffer on the device-to-host stream after that event, and adds it into
    the layer's fp32 buffer. Adds run in submission order, so micro-batches accumulate into
    one layer in order. At most ``max_in_flight`` layers wait for the worker (their device buffers are
    memory); past that, backward waits for the oldest (back-pressure, not a fixed two-layer lag). Where the
    gradients are reduced to their owners on the device (:meth:`reduce_on_device`), the autograd thread
    starts each layer's reduce and the worker copies off the device only the layers this rank owns.

    A copy that fails does not stop the backward: the failure is kept, and every flush raises it until
    the gradients are dropped (``flush(discard=True)``, from ``zero_grad``), so no step takes buffers that
    miss a gradient. When gradients go to their owners as they land, the failed layer still lands (as
    zeros): every rank takes part in the same reduces, in the same order, and the step fails on all of
    them together. Whatever fails on the worker is kept so (the backward goes on starting the reduces the
    other ranks pair with), except a collective that failed: then the ranks' group is broken, and the
    layers after it neither reduce nor wait (each would wait out the timeout)."""

    def __init__(self, weights: LayerWeights, max_in_flight: int = 4):
        self.weights = weights
        device = weights.device
        # the worker's CUDA calls on the engine's device (a fresh thread has device 0 current: a context there)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-grad",
                                       initializer=(lambda: torch.cuda.set_device(device))
                                       if device.type == "cuda" else None)
        self.scratch = scratch_for(weights.max_trainable_numel)   # the one worker's, for the fp32 adds
        self.max_in_flight = max_in_flight
        self.pending: collections.deque[Future] = collections.deque()
        self.failure: BaseException | None = None   # the first copy that failed since the last discard
        # a collective of the gradient path that failed: the ranks' group is gone (never discarded)
        self.broken_by: BaseException | None = None
        # the pinned buffer gradients of each dtype land in: the one worker lands one layer at a time
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._add_staging(weights.compute_dtype)
        self._wait_stream = None   # CUDA: where the worker waits for a device reduce (reduce_on_device)

    def reduce_on_device(self, dtype: torch.dtype) -> None:
        """From now on gradients reduced on the device reach this sink (in ``dtype``): their staging buffers
        made now, at set-up, and on CUDA a stream of the sink's own for the worker to wait for each reduce on
        (NCCL's wait makes the current stream wait; the compute stream would stall the backward behind the
        collective, the shared copy stream every device-to-host copy of the process); at most one layer
        waits for the worker, so that two layers' gradients in ``dtype`` are what the device holds for them."""
        self._add_staging(dtype)   # no gradient takes the host path any more, nor an earlier dtype
        self._staging = {dtype: self._staging[dtype]}
        if self.weights.device.type == "cuda" and self._wait_stream is None:
            self._wait_stream = torch.cuda.Stream(device=self.weights.device)
        self.max_in_flight = 1

    def _add_staging(self, dtype: torch.dtype) -> None:
        """The pinned buffer of a layer's size that gradients of ``dtype`` land in, made at set-up."""
        if dtype not in self._staging:
            self._staging[dtype] = empty_host(self.weights.max_trainable_numel, dtype)

    def submit(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        w = self.weights
        if w._to_owners is not None and w._to_owners.on_device:
            self._submit_reduced_on_device(i, grads, w._to_owners)
            return
        numel = w.trainable_numels[i]
        flat = w.flatten_grads(i, grads, torch.empty(numel, dtype=w.compute_dtype, device=w.device))
        ready = None
        if flat.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(flat.device))

        def add():
            if self.broken:
                return
            part = self._staging[w.compute_dtype][:numel]
            try:
                try:
                    async_copy(part, flat, after=ready, follow_current=False, direction="d2h",
                               label=f"grads L{i}").synchronize()
                except Exception as e:   # noqa: BLE001 - kept: every flush raises it until the gradients go
                    self._keep(e)
                    if not w.grads_to_owners:
                        return
                    part.zero_()         # the layer's reduce still pairs with the other ranks'
                w.land_grads(i, part, self.scratch)
            except Exception as e:   # noqa: BLE001 - the reduce, or the add after it
                self._keep(e)
        self._queue(add)

    def _submit_reduced_on_device(self, i: int, grads: dict[str, torch.Tensor], to_owners) -> None:
        """Layer i's gradient reduced to its owner on the device, before it leaves it: flattened in the
        communication dtype and the reduce started here, on the autograd thread (so every rank starts the
        layers' reduces in the backward's order); the worker waits for it, and only the owner copies the
        sum to its host and adds it."""
        if self.broken:   # an earlier reduce failed: no later one is started
            return
        w = self.weights
        numel = w.trainable_numels[i]
        flat = w.flatten_grads(i, grads, torch.empty(numel, dtype=to_owners.flat_dtype(w.compute_dtype),
                                                     device=w.device))
        started = time.perf_counter()
        flat, finish = to_owners.started_on_device(i, flat)   # flat: what is summed, in the communication dtype
        owned = to_owners.owns(i)

        def land():
            if self.broken:   # an earlier reduce failed: this one cannot complete, and is not waited out
                return
            try:
                reduced = None
                if self._wait_stream is not None:
                    with streams.on_cuda_stream(self._wait_stream):
                        finish()   # on the host, until the sum is made (or the timeout); and this stream waits
                        reduced = torch.cuda.Event()
                        reduced.record(self._wait_stream)   # the owner's copy follows it on the GPU too
                else:
                    finish()
                streams.record("comm", f"grad reduce L{i}", started, time.perf_counter(),
                               bytes=numel * flat.element_size())
                if owned:
                    self._land_owned(i, flat, reduced)
            except Exception as e:   # noqa: BLE001 - kept: every flush raises it until the gradients go
                self._keep(e)
        self._queue(land)

    def _land_owned(self, i: int, flat: torch.Tensor, reduced) -> None:
        """The owner's part of a reduce made on the device (``reduced``: its CUDA event, or None): its sum
        copied to the host and added."""
        w = self.weights
        part = self._staging[flat.dtype][:flat.numel()]
        async_copy(part, flat, after=reduced, follow_current=False, direction="d2h", label=f"grads L{i}").synchronize()
        with streams.span("host", f"grad add L{i}", bytes=flat.numel() * part.element_size()):
            w._note_square_sum(i, add_into(w.grad[i], part, self.scratch, square_sum=w.landed_sums))

    @property
    def broken(self) -> bool:
        return self.broken_by is not None

    def _keep(self, e: BaseException) -> None:
        if isinstance(e, CollectiveError):
            if self.broken_by is None:
                self.broken_by = e
        elif self.failure is None:
            self.failure = e

    def _queue(self, fn) -> None:
        """``fn`` to the worker, after back-pressure: at most ``max_in_flight`` layers wait for it. What the
        worker raised is kept, not raised here: the backward goes on (its reduces pair with the others')."""
        w = self.weights
        while len(self.pending) >= self.max_in_flight:
            with streams.wait_span("gradient sink", w.device):
                self._take_oldest()
        while self.pending and self.pending[0].done():
            self._take_oldest()
        self.pending.append(self.pool.submit(fn))

    def _take_oldest(self) -> None:
        """The oldest pending land waited for, then dropped, what it raised kept; an interrupt of the wait
        (Ctrl-C) propagates with the land still pending."""
        wait([self.pending[0]])
        error = self.pending.popleft().exception()
        if error is not None:
            self._keep(error)

    def flush(self, discard: bool = False) -> None:
        """Every submitted gradient is in its fp32 buffer, or (``discard``: the gradients are being dropped)
        done with. Raises what failed (a copy, an add) until discarded; a failed collective always: the
        ranks' group is gone, and no later gradient lands (the run cannot go on)."""
        while self.pending:
            self._take_oldest()
        if self.broken_by is not None:
            raise self.broken_by
        if discard:
            self.failure = None
        elif self.failure is not None:
            raise self.failure

    def settle(self) -> None:
        """Every submitted add done; a failure to land is kept as a failed copy is, for the next flush. An
        interrupt of the wait itself (Ctrl-C) propagates, the add it waited for still pending. Traced as a
        wait of the host (it ends the backward, on the thread that called it)."""
        with streams.span("wait", "gradients landing (end of backward)") if self.pending else _NO_SPAN:
            while self.pending:
                self._take_oldest()   # what failed is raised by the flush that takes the gradients

    def close(self) -> None:
        self.settle()
        self.pool.shutdown(wait=True)
