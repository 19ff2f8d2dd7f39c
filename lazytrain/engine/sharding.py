"""Host state sharded across data-parallel ranks (``zero_optimization.stage`` >= 1).

Each rank owns whole streamed layers (and whole non-block parameters), balanced by parameter count: it
alone keeps their Adam moments and updates them, then broadcasts the updated weights to the other ranks
(fp32, or in bf16/fp16 the compute copies: the other ranks keep no fp32 weights for its layers). The
clipping norm is the square root of the owners' summed squares. Gradients reach the owner by a reduce (half
an all-reduce's traffic): at stage 1 every rank's whole buffers at the step; at stage >= 2 one micro-batch
at a time as they are made (:class:`GradientsToOwners`: on a GPU with NCCL before they leave the device, else
as they reach the host), a rank keeping gradient buffers for its own layers only. Where the layers' weights
live (one copy per node) is engine.py's ``_shard_host_weights``.

A checkpoint is written by every rank, each its part (sharded_checkpoint.py); a load reads the whole
optimizer state by the order a single process's optimizer has it, and each rank keeps its own part of it,
so a checkpoint saved with N ranks loads with M ranks, or into one process. ``groups`` below are the optimizer's
whole groups: those it was built with, then any added since (whose tensors are replicated, every rank
holding and updating them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .host_accumulate import add_into


@dataclass(frozen=True)
class Ownership:
    """Which rank updates what: ``layer_owner[i]`` for streamed layer i, ``param_owner[id(p)]`` for every
    trainable tensor the optimizer holds (block parameters by their layer's owner)."""
    rank: int
    world_size: int
    layer_owner: tuple[int, ...]
    param_owner: dict[int, int]

    def owns_layer(self, i: int) -> bool:
        return self.layer_owner[i] == self.rank

    def owns(self, p: torch.Tensor) -> bool:
        """A tensor no rank owns (in a group added after the assignment) is every rank's: replicated."""
        return self.param_owner.get(id(p), self.rank) == self.rank


def assign(layer_params: list[list[torch.Tensor]], other_params: list[torch.Tensor], rank: int,
           world_size: int) -> Ownership:
    """Layers in forward order, then the other tensors largest first, each to the least-loaded rank (by
    parameter count; the lowest rank on a tie), so that every rank computes the same assignment."""
    load = [0] * world_size
    layer_owner = []
    owner: dict[int, int] = {}

    def least_loaded() -> int:
        return min(range(world_size), key=lambda r: (load[r], r))

    for params in layer_params:
        r = least_loaded()
        layer_owner.append(r)
        load[r] += sum(p.numel() for p in params)
        for p in params:
            owner[id(p)] = r
    for p in sorted(other_params, key=lambda t: -t.numel()):   # sorted() is stable: equal sizes keep their order
        r = least_loaded()
        owner[id(p)] = r
        load[r] += p.numel()
    return Ownership(rank, world_size, tuple(layer_owner), owner)


class GradientsToOwners:
    """Each micro-batch's gradient of a streamed layer, summed over the ranks into its owner's fp32 buffer as
    it is made (so a rank holds gradient buffers for its own layers only, and the reduces overlap the
    backward, as DeepSpeed's ZeRO-2 does). Every rank reduces the same layers in the same order: the order
    the backward reaches them, which data parallel makes the same on every rank.

    Where the sum is made: on the host, ``reduce(t, owner)`` (a collective on a group of the gradient path's
    own) once every rank copied the layer's gradient off its device; or, with ``start_on_device``, on the
    device before it leaves it (``start_on_device(t, owner)`` starts the collective and returns the call that
    waits for it), so only the owner copies the sum to its host. Each part is divided by the world size first,
    so that the sum is the mean and loss-scaled gradients cannot overflow it, in ``dtype`` (fp32, or the
    config's ``communication_data_type``); the host path reuses one send buffer, as the gradient path lands
    one layer at a time, in order."""

    def __init__(self, layer_owner: tuple[int, ...], rank: int, world_size: int, max_layer_numel: int,
                 reduce: Callable[[torch.Tensor, int], None], dtype: torch.dtype = torch.float32,
                 start_on_device: Callable[[torch.Tensor, int], Callable[[], None]] | None = None):
        self.layer_owner = layer_owner
        self.rank = rank
        self.world_size = world_size
        self.reduce = reduce
        self.dtype = dtype
        self.start_on_device = start_on_device
        self.max_layer_numel = max_layer_numel
        self._send: torch.Tensor | None = None   # the host path's, made when first used
        self.sequence = 0   # a digest of the layers reduced since the gradients were zeroed, in order

    def _reducing(self, i: int) -> None:
        """Layer i's reduce is the next one: the ranks' reduces pair by order alone, so a rank that skipped a
        layer pairs the next of the same size and owner with another layer's; the step compares the digests."""
        self.sequence = (self.sequence * _SEQUENCE_BASE + i + 1) % _SEQUENCE_MODULUS

    def restart_sequence(self) -> None:
        self.sequence = 0

    @property
    def on_device(self) -> bool:
        """Reduced on the device, before the gradients leave it (the device copies only its own layers')."""
        return self.start_on_device is not None

    def use_dtype(self, dtype: torch.dtype) -> None:
        """Sum in ``dtype`` from the next layer on (the host path's send buffer made again when first used)."""
        if dtype != self.dtype:
            self.dtype, self._send = dtype, None

    def owns(self, i: int) -> bool:
        return self.layer_owner[i] == self.rank

    def send_buffer(self, numel: int) -> torch.Tensor:
        """The buffer to flatten a layer's gradient into on the host, for :meth:`land` without another copy."""
        if self._send is None:
            self._send = torch.zeros(self.max_layer_numel, dtype=self.dtype)
        return self._send[:numel]

    def land(self, i: int, flat: torch.Tensor, target: torch.Tensor | None, scratch: torch.Tensor,
             square_sum: bool = True) -> float | None:
        """Reduce ``flat`` (layer i's gradient from this micro-batch, flat, on the host) to the layer's owner,
        which adds the sum into ``target`` (its fp32 buffer; None on the other ranks) through the caller's fp32
        ``scratch`` (host_accumulate.py); with ``square_sum``, returns ``target``'s sum of squares then, on
        the owner."""
        send = self.send_buffer(flat.numel())
        if flat.data_ptr() == send.data_ptr():
            send.div_(self.world_size)
        else:
            share_into(send, flat, self.world_size)
        self._reducing(i)   # (counted as its collective is made: a failure before it made none)
        self.reduce(send, self.layer_owner[i])
        if self.owns(i):
            return add_into(target, send, scratch, square_sum=square_sum)
        return None

    def flat_dtype(self, made_in: torch.dtype) -> torch.dtype:
        """The dtype to flatten a layer's gradient (made in ``made_in``) into on the device: the communication
        dtype where it holds every value of ``made_in`` (then divided in place), else ``made_in`` (divided
        into a buffer of the communication dtype: see :func:`share_into`)."""
        return self.dtype if _holds(self.dtype, made_in) else made_in

    def started_on_device(self, i: int, flat: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start reducing layer i's gradient from this micro-batch (``flat``: on the device, in
        :meth:`flat_dtype`) into its owner's; returns what is summed (``flat`` divided by the world size in
        place, or its share in :attr:`dtype`; on the owner it ends up holding the sum) and the call that waits
        for it. The owner then copies it to its host and adds it into the layer's buffer."""
        if flat.dtype == self.dtype:
            sent = flat.div_(self.world_size)
        else:
            sent = share_into(torch.empty(flat.shape, dtype=self.dtype, device=flat.device), flat, self.world_size)
        self._reducing(i)
        return sent, self.start_on_device(sent, self.layer_owner[i])


_SEQUENCE_MODULUS = (1 << 61) - 1   # a prime: digests fit an int64 collective, with their negatives
_SEQUENCE_BASE = 1_000_003


def _holds(dtype: torch.dtype, other: torch.dtype) -> bool:
    """Whether every value of ``other`` converts into ``dtype`` without overflow or lost bits."""
    a, b = torch.finfo(dtype), torch.finfo(other)
    return a.bits >= b.bits and a.max >= b.max and a.eps <= b.eps


def share_into(out: torch.Tensor, t: torch.Tensor, world_size: int) -> torch.Tensor:
    """``t / world_size`` into ``out`` (the communication dtype), computed in the wider of the two and rounded
    once: where ``out`` holds ``t``'s values, converted then divided; where it is narrower (fp16 for fp32
    gradients), divided then rounded, so that a share within its range is sent though the whole is not, as
    DistributedContext sends the step's gradients."""
    if _holds(out.dtype, t.dtype):
        out.copy_(t)
        return out.div_(world_size)
    return torch.div(t, world_size, out=out)


def owned_groups(groups: list[dict], ownership: Ownership) -> list[dict]:
    """The optimizer's parameter groups with only this rank's tensors (every group kept, so that the
    groups line up across ranks and with a single process's)."""
    return [{**g, "params": [p for p in g["params"] if ownership.owns(p)]} for g in groups]


def local_state(full: dict, groups: list[dict], ownership: Ownership) -> dict:
    """This rank's part of a whole optimizer ``state_dict`` (as one process saves it), renumbered for an
    optimizer built on :func:`owned_groups`."""
    full_ids = [i for g in full["param_groups"] for i in g["params"]]
    params = [p for g in groups for p in g["params"]]
    if len(full_ids) != len(params):
        raise ValueError(f"the checkpoint's optimizer holds {len(full_ids)} parameters, this model's {len(params)}")
    # torch's own checks (a single process loading it makes them): states matched by position are right only
    # when the groups are the same groups
    if len(full["param_groups"]) != len(groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(saved["params"]) != len(g["params"]) for saved, g in zip(full["param_groups"], groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
    for pid, p in zip(full_ids, params):   # and no fp32 Adam moment that is not its parameter's size
        st = full["state"].get(pid, {})
        for key in ("exp_avg", "exp_avg_sq"):
            v = st.get(key)
            if isinstance(v, torch.Tensor) and v.numel() != p.numel():
                raise ValueError(f"loaded state dict holds an {key} of shape {tuple(v.shape)} for a parameter of "
                                 f"shape {tuple(p.shape)}: the checkpoint is of another model or parameter order")
    index_of = dict(zip((id(p) for p in params), full_ids))
    state, out_groups, k = {}, [], 0
    for saved, g in zip(full["param_groups"], groups):
        local_ids = []
        for p in g["params"]:
            if ownership.owns(p):
                if index_of[id(p)] in full["state"]:
                    state[k] = full["state"][index_of[id(p)]]
                local_ids.append(k)
                k += 1
        out_groups.append({**saved, "params": local_ids})
    return {"state": state, "param_groups": out_groups}


def whole_indices(groups: list[dict], ownership: Ownership) -> dict[int, int]:
    """This rank's optimizer index -> the index of the same tensor in a single process's optimizer."""
    out, k, local_k = {}, 0, 0
    for g in groups:
        for p in g["params"]:
            if ownership.owns(p):
                out[local_k] = k
                local_k += 1
            k += 1
    return out


def whole_param_groups(local: dict, groups: list[dict]) -> list[dict]:
    """The local ``param_groups`` renumbered as a single process's optimizer numbers them."""
    out, k = [], 0
    for saved, g in zip(local["param_groups"], groups):
        out.append({**saved, "params": list(range(k, k + len(g["params"])))})
        k += len(g["params"])
    return out
