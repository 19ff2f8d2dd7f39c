"""How often a node-shared weights file is lost to another leader's sweep of left-over files.

Two leaders on one machine (two jobs, or two torchrun nodes) each sweep /dev/shm for files a killed leader
left (lazytrain/engine/node_memory.py) while making their own. This creates and removes files in a loop
while other processes sweep the same directory, and counts the files handed out that no longer exist.

usage: python3 benchmarks/node_shared_race.py [--rounds 3000] [--sweepers 2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile

from lazytrain.engine import node_memory


def _sweep(directory: str, stop) -> None:
    while not stop.is_set():
        node_memory.remove_stale_files(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--sweepers", type=int, default=2)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(dir=node_memory.SHM_DIR if os.path.isdir(node_memory.SHM_DIR) else None)
    stop = mp.Event()
    sweepers = [mp.Process(target=_sweep, args=(directory, stop)) for _ in range(args.sweepers)]
    for p in sweepers:
        p.start()
    lost = 0
    try:
        for _ in range(args.rounds):
            paths = node_memory.create_shared_files([4096], directory)
            lost += sum(not os.path.exists(p) for p in paths)
            node_memory.remove_files(paths)
    finally:
        stop.set()
        for p in sweepers:
            p.join()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"files lost to a sweep: {lost} of {args.rounds} ({args.sweepers} sweepers)")


if __name__ == "__main__":
    main()
