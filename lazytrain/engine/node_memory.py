"""Host memory that every rank on a node maps: one copy of the streamed layers' weights per node.

With the optimizer state sharded (``zero_optimization.stage`` >= 1), every rank still computes every
layer, so each would keep a whole host copy of the streamed weights: on a node with 8 GPUs, 8 copies.
Instead the ranks of a node map one buffer. The lowest rank of the node creates a file in ``/dev/shm``
(its whole size reserved at once, so that a ``/dev/shm`` too small fails here, with a message, rather
than killing a rank with SIGBUS mid-run), the others map it, and once every rank has it mapped the file
is unlinked: the memory lives while a rank maps it, and nothing is left behind when the run ends or dies.

Ranks are on the same node when they report the same host name and torchrun node rank (``GROUP_RANK``),
so two torchrun "nodes" on one machine keep a copy each, as two machines would.
"""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Nodes:
    """Which ranks share a node: ``members[n]`` are node n's ranks, lowest first."""
    rank: int
    members: tuple[tuple[int, ...], ...]

    @property
    def mine(self) -> tuple[int, ...]:
        return next(m for m in self.members if self.rank in m)

    @property
    def leader(self) -> int:
        """The rank that creates (and unlinks) the node's shared file."""
        return self.mine[0]


def node_key() -> tuple[str, str]:
    return socket.gethostname(), os.environ.get("GROUP_RANK", "")


def group_by_node(keys: list, rank: int) -> Nodes:
    """``keys[r]`` is rank r's :func:`node_key`; nodes in order of their lowest rank."""
    members: dict = {}
    for r, key in enumerate(keys):
        members.setdefault(tuple(key), []).append(r)
    return Nodes(rank, tuple(tuple(m) for m in members.values()))


class SharedMemoryUnavailable(RuntimeError):
    """The node-shared buffer could not be made (no /dev/shm, or too little room in it)."""


def create_shared_file(nbytes: int, shm_dir: str | None = None) -> str:
    """A new file of ``nbytes`` in ``shm_dir`` (default :data:`SHM_DIR`) with all its memory reserved;
    returns its path."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    if not os.path.isdir(shm_dir):
        raise SharedMemoryUnavailable(f"{shm_dir} does not exist")
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise SharedMemoryUnavailable(f"{shm_dir} has {free / 2**30:.2f} GiB free and the node's copy of the "
                                      f"streamed weights needs {nbytes / 2**30:.2f} GiB (a container's /dev/shm "
                                      f"is often 64 MiB: raise it, e.g. docker run --shm-size)")
    path = os.path.join(shm_dir, f"lazytrain-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise SharedMemoryUnavailable(f"reserving {nbytes / 2**30:.2f} GiB in {shm_dir} failed: {e}") from e
    os.close(fd)
    return path


def map_shared_file(path: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """The file at ``path`` as a flat uint8 tensor every process mapping it sees the writes of; on CUDA,
    registered as pinned so that copies from it run asynchronously, as from ``empty_host`` memory."""
    flat = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
    if device.type == "cuda" and nbytes:
        err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            raise SharedMemoryUnavailable(f"cudaHostRegister of the node-shared weights failed (CUDA error {code})")
    return flat


def node_shared_buffer(nbytes: int, dist_ctx, device: torch.device) -> tuple[torch.Tensor | None, Nodes]:
    """``nbytes`` of host memory that the ranks of this node share (a collective: every rank calls it), and
    the nodes; None when this rank is alone on its node. Raises :class:`SharedMemoryUnavailable` where this node could not
    make it (every rank of the node raises; other nodes are unaffected)."""
    nodes = group_by_node(dist_ctx.all_gather_object(node_key(), "exchange of host names for node-shared "
                                                                 "weights"), dist_ctx.rank)
    path, problem = None, None
    if dist_ctx.rank == nodes.leader and len(nodes.mine) > 1:
        try:
            path = create_shared_file(nbytes)
        except (SharedMemoryUnavailable, OSError) as e:
            problem = str(e)
    made = dist_ctx.all_gather_object((path, problem), "exchange of the node-shared weights' file")
    path, problem = made[nodes.leader]
    flat = None
    if path is not None:
        try:
            flat = map_shared_file(path, nbytes, device)
        except (SharedMemoryUnavailable, RuntimeError, OSError) as e:
            problem = f"mapping {path} failed: {e}"
    mapped = dist_ctx.all_gather_object(problem is None, "agreement that the node-shared weights are mapped")
    if path is not None and dist_ctx.rank == nodes.leader:
        os.unlink(path)   # every rank of the node has it mapped (or gave up): the name is no longer needed
    if len(nodes.mine) == 1:
        return None, nodes
    if not all(mapped[r] for r in nodes.mine):
        raise SharedMemoryUnavailable(problem or "another rank of this node could not map the shared weights")
    return flat, nodes
