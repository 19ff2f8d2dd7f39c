"""Host memory that every rank on a node maps: one copy of the streamed layers' weights per node.

With the optimizer state sharded (``zero_optimization.stage`` >= 1), every rank still computes every
layer, so each would keep a whole host copy of the streamed weights: on a node with 8 GPUs, 8 copies.
Instead the ranks of a node map one buffer. The lowest rank of the node creates a file in ``/dev/shm``
(its whole size reserved at once, so that a ``/dev/shm`` too small fails here, with a message, rather
than killing a rank with SIGBUS mid-run), the others map it, and once every rank has it mapped the file
is unlinked: the memory lives while a rank maps it, and nothing is left behind when the run ends or dies
after that. A leader killed in between (SIGTERM from torchrun when another rank fails at start-up ends a
process without its clean-up) leaves its files. The leader holds a lock on each (``flock``) until it unlinks
it, which the kernel lets go with the process, in any PID namespace: the next leader on the node removes
the files whose lock it can take.

Ranks are on the same node when they report the same host name and torchrun node rank (``GROUP_RANK``),
so two torchrun "nodes" on one machine keep a copy each, as two machines would.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import socket
import uuid
from dataclasses import dataclass

import numpy
import torch

from ..tiers.memory import register_pinned

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^lazytrain-(\d+-)?[0-9a-f]{32}-\d+$")
_LOCKED: dict[str, int] = {}   # path -> the open descriptor holding the lock on a file this process created


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


def create_shared_files(sizes: list[int], shm_dir: str | None = None) -> list[str]:
    """New files of ``sizes`` bytes in ``shm_dir`` (default :data:`SHM_DIR`), all their memory reserved;
    returns their paths. Nothing is left behind when it raises."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    if not os.path.isdir(shm_dir):
        raise SharedMemoryUnavailable(f"{shm_dir} does not exist")
    nbytes = sum(sizes)
    remove_stale_files(shm_dir)
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise SharedMemoryUnavailable(f"{shm_dir} has {free / 2**30:.2f} GiB free and the node's copy of the "
                                      f"streamed weights needs {nbytes / 2**30:.2f} GiB (a container's /dev/shm "
                                      f"is often 64 MiB: raise it, e.g. docker run --shm-size)")
    paths: list[str] = []
    try:
        for k, size in enumerate(sizes):
            path, fd = _create_locked(shm_dir, k)
            _LOCKED[path] = fd
            paths.append(path)
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
            except OSError as e:
                raise SharedMemoryUnavailable(f"reserving {nbytes / 2**30:.2f} GiB in {shm_dir} failed: {e}") from e
    except BaseException:
        remove_files(paths)
        raise
    return paths


def _create_locked(shm_dir: str, k: int) -> tuple[str, int]:
    """A new empty file in ``shm_dir`` under a fresh name, and its descriptor holding the file's lock (held
    until :func:`remove_files`: a file nobody holds was left behind). Between the file's creation and the
    lock, another leader on this machine (another job, or another torchrun node) may take the lock first
    and remove the file as left behind; a file whose name is gone once the lock is ours is made again."""
    for _ in range(100):
        path = os.path.join(shm_dir, f"lazytrain-{os.getpid()}-{uuid.uuid4().hex}-{k}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink > 0:   # a remover unlinks while holding the lock: still named, it stays
            return path, fd
        os.close(fd)
    raise SharedMemoryUnavailable(f"the files made in {shm_dir} were removed by another process before they "
                                  f"could be locked, 100 times")


def remove_stale_files(shm_dir: str) -> list[str]:
    """Remove the node-shared files in ``shm_dir`` that a leader killed before unlinking them left: named as
    :func:`create_shared_files` names them, their lock free (a live leader holds its files' until it unlinks
    them; the kernel drops a dead process's). Returns the paths removed."""
    removed = []
    for name in os.listdir(shm_dir):
        path = os.path.join(shm_dir, name)
        if _NAME.match(name) is None or path in _LOCKED:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:   # removed meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # held: a live leader's
            continue
        else:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        finally:
            os.close(fd)
    return removed


def remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = _LOCKED.pop(path, None)
        if fd is not None:   # after the unlink: the name is gone before the lock is
            os.close(fd)


def map_shared_file(path: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """The existing file at ``path`` as a flat uint8 tensor every process mapping it sees the writes of; on
    CUDA, registered as pinned so that copies from it run asynchronously, as from ``empty_host`` memory.
    A file that is not there (another machine's, under the same host name) is refused, never created."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError as e:
        raise SharedMemoryUnavailable(f"{path} is not on this machine (ranks that report the same host name "
                                      f"but do not share /dev/shm?)") from e
    if size < nbytes:
        raise SharedMemoryUnavailable(f"{path} holds {size} bytes, not {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with open(path, "r+b") as f:                   # the map outlives the file object (and the file's name)
        array = numpy.frombuffer(mmap.mmap(f.fileno(), nbytes), dtype=numpy.uint8)
    flat = torch.from_numpy(array)                 # its storage holds the array, the array the map
    if device.type == "cuda":
        code = register_pinned(flat, array)
        if code != 0:
            raise SharedMemoryUnavailable(f"cudaHostRegister of the node-shared weights failed (CUDA error {code})")
    return flat


def node_shared_buffers(sizes: list[int], dist_ctx, device: torch.device) -> tuple[list[torch.Tensor] | None, Nodes]:
    """Buffers of ``sizes`` bytes that the ranks of this node share, one storage each (so that saving one
    layer's tensors never writes the others'), and the nodes; a collective: every rank calls it. None when
    this rank is alone on its node. Raises :class:`SharedMemoryUnavailable` where this node could not make
    them (every rank of the node raises; other nodes are unaffected). The files are unlinked once every
    rank has mapped them, or failed to, or a collective on the way failed."""
    nodes = group_by_node(dist_ctx.all_gather_object(node_key(), "exchange of host names for node-shared "
                                                                 "weights"), dist_ctx.rank)
    created, problem = [], None
    try:
        if dist_ctx.rank == nodes.leader and len(nodes.mine) > 1:
            try:
                created = create_shared_files(sizes)
            except Exception as e:   # noqa: BLE001 - the other ranks of the node hear of it in the exchange below
                problem = str(e) if isinstance(e, (SharedMemoryUnavailable, OSError)) else f"{type(e).__name__}: {e}"
        made = dist_ctx.all_gather_object((created, problem), "exchange of the node-shared weights' files")
        paths, problem = made[nodes.leader]
        flats = None
        if paths:
            try:
                flats = [map_shared_file(path, size, device) for path, size in zip(paths, sizes)]
            except Exception as e:   # noqa: BLE001 - any failure here must reach the other ranks, not leave them waiting
                problem = f"mapping the node-shared weights failed: {type(e).__name__}: {e}"
        mapped = dist_ctx.all_gather_object(problem is None, "agreement that the node-shared weights are mapped")
    finally:   # every rank of the node has them mapped (or gave up): the names are no longer needed
        remove_files(created)
    if len(nodes.mine) == 1:
        return None, nodes
    if not all(mapped[r] for r in nodes.mine):
        raise SharedMemoryUnavailable(problem or "another rank of this node could not map the shared weights")
    return flats, nodes
