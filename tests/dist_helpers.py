"""Launching ranks in tests: a free rendezvous port, and the environment torchrun gives a rank."""
import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_as(rank: int, world: int, port: int) -> None:
    """The launcher's environment for rank ``rank`` of ``world`` on this machine."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
