"""NVMe tier throughput beside raw `dd` with O_DIRECT on the same path, in one run.

    python3 benchmarks/tiers.py [--path DIR] [--total 1GiB] [--tensor 64MiB] [--rounds 3] [--record FILE]

Each round, on the same directory: `dd ... of=F bs=64M count=16 oflag=direct` twice, once from
/dev/zero and once from a file of random bytes in RAM (/dev/shm); the NVMe tier writing 16 tensors of
64 MiB of random bits (all issued, then waited: the engine's pattern); `dd if=F of=/dev/null bs=64M
iflag=direct` on both dd files; the tier reading its tensors back into reused 4 KiB-aligned buffers,
and again into new tensors. Virtual and thin-provisioned disks often recognise all-zero writes and
skip them (and read never-written zero ranges back without touching the device), so dd from
/dev/zero can be several times faster than any real data allows: the ratios that count are those
against dd moving the same kind of data (random bytes); the /dev/zero figures are shown beside them.
dd's figures are its own (bytes over its reported seconds); the tier's are bytes over wall time from
the first issue to the last completion, checksums included. Goal: >= 80% of dd both ways. Medians over
rounds; every round is printed. All files live under a temporary directory, deleted at the end.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from lazytrain.tiers import NVMeTier, empty_aligned, format_bytes, parse_bytes  # noqa: E402

GOAL = 0.8


def dd(args: list[str]) -> float:
    """Run dd; bytes per second from its own summary line."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", done.stderr, re.M)
    if not m:
        raise RuntimeError(f"cannot read dd's summary: {done.stderr!r}")
    return int(m.group(1)) / float(m.group(2))


def tier_round(tier: NVMeTier, tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> dict:
    total = sum(t.numel() * t.element_size() for t in tensors)
    for o, t in zip(outs, tensors):
        o.copy_(t)
    start = time.perf_counter()  # tensors the caller gives up, in aligned memory: written in place
    for h in [tier.write(f"t{i}", o, owned=True) for i, o in enumerate(outs)]:
        h.wait()
    write_owned = total / (time.perf_counter() - start)
    start = time.perf_counter()  # ordinary tensors: each write takes a snapshot first
    for h in [tier.write(f"t{i}", t) for i, t in enumerate(tensors)]:
        h.wait()
    write = total / (time.perf_counter() - start)
    for o in outs:
        o.zero_()
    start = time.perf_counter()
    for h in [tier.read(f"t{i}", out=o) for i, o in enumerate(outs)]:
        h.wait()
    read = total / (time.perf_counter() - start)
    start = time.perf_counter()
    fresh = [h.wait() for h in [tier.read(f"t{i}") for i in range(len(tensors))]]
    read_new = total / (time.perf_counter() - start)
    for i, (t, o, f) in enumerate(zip(tensors, outs, fresh)):
        bits = t.view(torch.int32)  # random bit patterns include NaNs: compare bits
        if not (torch.equal(bits, o.view(torch.int32)) and torch.equal(bits, f.view(torch.int32))):
            raise RuntimeError(f"tensor {i} came back different")
        tier.free(f"t{i}")
    return {"write": write, "write_owned": write_owned, "read": read, "read_new": read_new}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=tempfile.gettempdir(), help="directory on the disk to measure")
    ap.add_argument("--total", default="1GiB", help="bytes per direction per round (default 1GiB)")
    ap.add_argument("--tensor", default="64MiB", help="tensor size (default 64MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, alternating dd and the tier (default 3)")
    ap.add_argument("--aio", default=None, help='aio settings as JSON, e.g. \'{"intra_op_parallelism": 8}\'')
    ap.add_argument("--record", default=None, help="append the markdown result to this file")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below when stopped
    total, tensor = parse_bytes(args.total, "--total"), parse_bytes(args.tensor, "--tensor")
    count = total // tensor
    import json
    aio = json.loads(args.aio) if args.aio else None

    work = tempfile.mkdtemp(prefix="lazytrain-bench-tiers-", dir=args.path)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * total else work
    source = tempfile.mkstemp(prefix="lazytrain-bench-random-", dir=shm)[1]
    try:
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randint(-2**31, 2**31 - 1, (tensor // 4,), dtype=torch.int32, generator=g).view(torch.float32)
                   for _ in range(count)]
        with open(source, "wb") as f:  # the same random bytes, for dd
            for t in tensors:
                f.write(t.numpy().tobytes())
        outs = [empty_aligned((tensor // 4,), torch.float32).zero_() for _ in range(count)]
        tier = NVMeTier("nvme", path=work, aio=aio)
        zero_file, random_file = os.path.join(work, "dd-zero.bin"), os.path.join(work, "dd-random.bin")
        bs = f"bs={tensor}"
        rounds = []
        try:
            for r in range(args.rounds):
                row = {"dd_write_zero": dd(["if=/dev/zero", f"of={zero_file}", bs, f"count={count}", "oflag=direct"]),
                       "dd_write": dd([f"if={source}", f"of={random_file}", bs, f"count={count}", "oflag=direct"])}
                row.update(tier_round(tier, tensors, outs))
                row["dd_read_zero"] = dd([f"if={zero_file}", "of=/dev/null", bs, "iflag=direct"])
                row["dd_read"] = dd([f"if={random_file}", "of=/dev/null", bs, "iflag=direct"])
                rounds.append(row)
                print(f"round {r + 1}: " + ", ".join(f"{k} {v / 1e6:.0f} MB/s" for k, v in row.items()), file=sys.stderr)
            report = tier.backend_report
            settings = tier.settings
        finally:
            tier.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.unlink(source)

    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}

    def row(label, dd_zero, dd_random, mine):
        ratio = med[mine] / med[dd_random]
        return (f"| {label} | {med[dd_zero] / 1e6:.0f} | {med[dd_random] / 1e6:.0f} | {med[mine] / 1e6:.0f} | "
                f"{ratio:.0%} | {med[mine] / med[dd_zero]:.0%} | {'met' if ratio >= GOAL else 'missed'} |")
    lines = [
        f"### NVMe tier vs dd O_DIRECT, {datetime.date.today().isoformat()}",
        "",
        f"- machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, path {args.path}",
        f"- command: `python3 benchmarks/{os.path.basename(__file__)} " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        f"- {format_bytes(count * tensor)} per direction in {count} tensors of {format_bytes(tensor)}, {args.rounds} "
        f"rounds alternating dd and the tier; medians below, MB/s = 1e6 B/s; dd's random source: {shm}",
        f"- tier: {report}; block_size {settings.block_size}, queue_depth {settings.queue_depth}, "
        f"intra_op_parallelism {settings.intra_op_parallelism}",
        "",
        "| direction | dd /dev/zero MB/s | dd random MB/s | tier MB/s | tier / dd random | tier / dd zero | goal >= 80% of dd random |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        row("write (tier: snapshot of each tensor, checksums)", "dd_write_zero", "dd_write", "write"),
        row("write, owned aligned tensors (no snapshot copy, checksums)", "dd_write_zero", "dd_write", "write_owned"),
        row("read into reused aligned buffers (checksums verified)", "dd_read_zero", "dd_read", "read"),
        row("read into new tensors (checksums verified)", "dd_read_zero", "dd_read", "read_new"),
        "",
        "Per round (MB/s): " + "; ".join(
            f"{i + 1}: dd write zero/random {r['dd_write_zero'] / 1e6:.0f}/{r['dd_write'] / 1e6:.0f}, tier write "
            f"{r['write'] / 1e6:.0f} / owned {r['write_owned'] / 1e6:.0f}, dd read zero/random {r['dd_read_zero'] / 1e6:.0f}/{r['dd_read'] / 1e6:.0f}, "
            f"tier read {r['read'] / 1e6:.0f} / new {r['read_new'] / 1e6:.0f}"
            for i, r in enumerate(rounds)),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.record:
        with open(args.record, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
