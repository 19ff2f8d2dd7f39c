"""A sharded engine's checkpoint, written by every rank: DeepSpeed's layout of as many ranks.

Why: gathering the ranks' optimizer states on rank 0 to write them needs the whole state in its host
memory, the very thing sharding (``zero_optimization.stage`` >= 1) exists to avoid. Each rank writes what
DeepSpeed's rank of the same number writes instead: an equal share of each parameter group's flat fp32
masters and moments (stages 1, 2), or its share of every parameter (stage 3), and LazyTrain's own
optimizer state of the tensors it owns. Those shares cut across the owners' layers, so each rank first
gathers its ranges from the ranks that hold them, point to point, in one order every rank follows; a rank
holds about its share of the state while it writes. The files go into one staging directory that every
rank must see (a file system shared by the nodes, as DeepSpeed's checkpoints need), which rank 0 puts in
place once every rank has written its part.

A checkpoint saved with N ranks loads with M ranks, or into one process: every reader maps the ranks'
partitions back to parameters by name (deepspeed_checkpoint.py) and keeps what its rank owns.
"""
from __future__ import annotations

from typing import Callable

import torch

from .deepspeed_layout import Need, Writer
from .distributed import DistributedContext


def gather_pieces(writer: Writer, holder: Callable[[Need], int],
                  dist: DistributedContext) -> tuple[dict, BaseException | None]:
    """``(name, key, start) -> fp32 values`` of every range ``writer`` needs, from the rank ``holder`` names
    for it (this rank's own served here), and the first error this rank met. Every rank takes part:
    requests are exchanged first, then each transfer runs in the same order on every rank, so each pair
    of ranks meets in its turn and no rank waits on one that waits on it. A rank whose part fails still
    completes every transfer (sending zeros), so that the others are not left waiting; its error is
    raised on every rank at the next agreement."""
    what = "exchange of optimizer state partitions for save_checkpoint"
    pieces, remote, error = {}, [], None

    def served(need: Need) -> torch.Tensor:
        nonlocal error
        if error is None:
            try:
                return writer.serve(need).contiguous()
            except Exception as e:   # noqa: BLE001 - reported through the agreement that follows
                error = e
        return torch.zeros(need.length, dtype=torch.float32)
    try:
        for need in writer.needs():
            source = holder(need)
            if source == dist.rank:
                pieces[(need.name, need.key, need.start)] = served(need)
            else:
                remote.append((need, source))
    except Exception as e:   # noqa: BLE001
        error, remote = e, []
    for requester, requests in enumerate(dist.all_gather_object(remote, what)):
        for need, source in requests:
            if source == dist.rank:
                dist.send_to(served(need), requester, what)
            elif requester == dist.rank:
                buf = torch.empty(need.length, dtype=torch.float32)
                dist.receive_from(buf, source, what)
                pieces[(need.name, need.key, need.start)] = buf
    return pieces, error
