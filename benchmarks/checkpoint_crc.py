"""How long the CRC-32 check of a checkpoint file takes before it is loaded, side by side in one run: the
whole file read by zipfile's reader on one thread (the check as it was) vs the chunked check on a thread
pool (lazytrain.engine.record_crc) at 1, 2, ... threads; and torch.load of the same file, memory-mapped,
each tensor copied out (every page read, as a load into the engine's buffers reads it: what the check is
added to). Three layouts: 64 records of one size, 4000 records of random sizes (a model file: one record
per tensor, many shapes) and one record (a DeepSpeed rank's flat fp32 partition). The file is read once
first, so every figure is from the page cache: the check's compute, not the disk.

    python benchmarks/checkpoint_crc.py [--gib 1] [--repeats 3] [--threads 1 2 4 8]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lazytrain.engine import record_crc  # noqa: E402


def zipfile_reader(path: str) -> None:
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.CRC == 0 and info.file_size > 0:
                continue
            with z.open(info) as record:
                while record.read(16 << 20):
                    pass


def touch_load(path: str) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for t in state.values():
        torch.empty_like(t).copy_(t)   # every page read, as a load into the engine's own buffers reads it


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=None)
    args = ap.parse_args()
    threads = args.threads or sorted({1, 2, min(record_crc.MAX_THREADS, os.cpu_count() or 1)})
    numel = int(args.gib * (1 << 30)) // 4
    print(f"{os.cpu_count()} cores; {args.gib:g} GiB per file; median of {args.repeats}")
    print(f"{'layout':<12} {'what':<26} {'s':>7} {'GB/s':>6} {'vs zipfile':>10}")
    with tempfile.TemporaryDirectory() as d:
        rng = random.Random(0)
        varied = [rng.randint(1, 2 * numel // 4000) for _ in range(4000)]
        layouts = {"64 records": lambda: {f"w{i}": torch.randn(numel // 64) for i in range(64)},
                   "4000 sizes": lambda: {f"w{i}": torch.randn(n) for i, n in enumerate(varied)},
                   "one record": lambda: {"flat": torch.randn(numel)}}
        for layout, build in layouts.items():   # one at a time: a layout's tensors are freed once saved
            path = os.path.join(d, "state.pt")
            torch.save(build(), path)
            size = os.path.getsize(path)
            zipfile_reader(path)   # into the page cache
            base = median_s(lambda: zipfile_reader(path), args.repeats)
            rows = [("zipfile reader, 1 thread", base)]
            rows += [(f"record_crc, {n} thread{'s' if n > 1 else ''}",
                      median_s(lambda n=n: record_crc.check_records(path, threads=n), args.repeats)) for n in threads]
            rows += [("torch.load mmap + copy", median_s(lambda: touch_load(path), args.repeats))]
            for what, s in rows:
                print(f"{layout:<12} {what:<26} {s:>7.3f} {size / s / 1e9:>6.2f} {base / s:>9.2f}x")
            os.remove(path)


if __name__ == "__main__":
    main()
