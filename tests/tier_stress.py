"""Threads reading keys while others free and overwrite them, for any tier (shared by the tier tests)."""
from __future__ import annotations

import random
import threading
import time

import torch

from lazytrain.tiers import TierError


def race_reads_frees_and_writes(tier, seconds: float = 2.0, keys: int = 6, numel: int = 4096) -> tuple[list, int]:
    """(errors seen by readers, reads completed). A read that got a handle must return its key's data;
    a read of a key freed at that moment may only fail with TierError."""
    values = {f"k{i}": torch.full((numel,), float(i)) for i in range(keys)}
    for k, v in values.items():
        tier.write(k, v).wait()
    errors, reads, stop = [], [0], time.time() + seconds

    def reader(seed):
        rnd = random.Random(seed)
        while time.time() < stop:
            k = rnd.choice(list(values))
            try:
                out = tier.read(k).wait()
            except TierError:
                continue                  # absent at that moment
            except Exception as e:  # noqa: BLE001
                errors.append(f"{k}: {type(e).__name__}: {e}")
                continue
            if not torch.equal(out, values[k]):
                errors.append(f"{k}: wrong data")
            reads[0] += 1

    def writer(seed):
        rnd = random.Random(seed)
        while time.time() < stop:
            k = rnd.choice(list(values))
            if rnd.random() < 0.5:
                tier.free(k)
            else:
                tier.write(k, values[k])

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)] + \
        [threading.Thread(target=writer, args=(10 + i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in tier.keys():
        tier.read(k).wait()
    return errors, reads[0]
