"""torch.distributed set-up from the launcher's environment, and gradient averaging across ranks.

A plain ``python train.py`` (no RANK/WORLD_SIZE) is a single process: no process group, no mpi4py.
Under torchrun, the group is created from the environment (NCCL on CUDA, gloo otherwise), and host
gradient buffers are reduced over a gloo group since NCCL cannot reduce host memory.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    """Ranks training together: the process group the script created itself (``mp.spawn`` and
    ``init_process_group`` by hand, as DeepSpeed accepts), else the launcher's ``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class DistributedContext:
    def __init__(self, device_type: str):
        self.world_size = world_size()
        own_group = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if own_group else int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank if own_group else 0))
        self.host_group = None
        if self.world_size > 1:
            if not dist.is_initialized():
                missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
                if missing:
                    raise RuntimeError(f"WORLD_SIZE={self.world_size} but {', '.join(missing)} is not set: launch with "
                                       f"torchrun, or unset WORLD_SIZE for a single process")
                dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
            self.host_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def average(self, host_tensors: list[torch.Tensor], device_tensors: list[torch.Tensor]) -> None:
        """Divide by the world size, then all-reduce (sum), in place: dividing first keeps loss-scaled
        gradients from overflowing in the sum."""
        if not self.enabled:
            return
        for t in host_tensors:
            t.div_(self.world_size)
            dist.all_reduce(t, group=self.host_group)
        for t in device_tensors:
            t.div_(self.world_size)
            dist.all_reduce(t)

    def fill_missing_grads(self, params: list[torch.Tensor]) -> None:
        """A parameter with a gradient on some ranks only (a branch or an expert that this rank's batch did
        not reach) gets a zero gradient on the others, so that every rank reduces the same tensors in the
        same order; without it the ranks' all-reduces pair up wrong tensors or hang. ``params`` must be in
        the same order on every rank. A parameter no rank has a gradient for stays without one."""
        if not self.enabled or not params:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.host_group)
        for p, anywhere in zip(params, has.tolist()):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()
