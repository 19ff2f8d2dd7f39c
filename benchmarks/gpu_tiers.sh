#!/usr/bin/env bash
# LazyTrain tiers on a CUDA machine, within 6 minutes (its steps stop at 150, 120 and 90 s):
#   1. pinned and pageable host<->device copy bandwidth with plain torch (CUDA events);
#   2. the host tier round-tripping CUDA tensors (side-stream copies into pinned slabs);
#   3. the NVMe tier round-tripping CUDA tensors through kvikio (when kvikio imports; the report says
#      clearly when it is absent) and through POSIX O_DIRECT with pinned staging, beside dd O_DIRECT
#      moving the same random bytes on the same path;
#   4. the tier tests (GPU ones included; not with SKIP_TIER_TESTS=1, as gpu_suite.sh, whose section 2 runs
#      them) and `lazytrain bench tiers`, which writes the hardware profile.
# Each step's timeout runs in the foreground (in this script's process group), so that a timeout around
# this script (gpu_suite.sh's budget) stops the step under way too.
#
# usage: bash benchmarks/gpu_tiers.sh [DIR]     DIR: where the NVMe files go (default: $TMPDIR or /tmp)
# env:   OUT (default lazytrain-out): where hardware-gpu.json and gpu_tiers.md are written.
#        KVIKIO_WHEELS (default .whl/kvikio): wheels installed into a temporary directory when kvikio is not
#        importable (kvikio-cu13, libkvikio-cu13, rapids-logger; they need cupy and cuFile already there).
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${TMPDIR:-/tmp}}
OUT=${OUT:-lazytrain-out}
mkdir -p "$OUT"
WHEELS=${KVIKIO_WHEELS:-.whl/kvikio}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
t0=$(date +%s)

echo "# LazyTrain gpu_tiers.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), host $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"

if ! python3 -c "import kvikio" >/dev/null 2>&1 && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "kvikio is not installed; installing the wheels in $WHEELS into a temporary directory"
  if python3 -m pip install -q --no-deps --no-index --target "$SCRATCH/site" "$WHEELS"/*.whl; then
    export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "installing the kvikio wheels failed"
  fi
fi

timeout --foreground 150 python3 - "$DIR" "$OUT" <<'PY'
import os, re, subprocess, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import torch
from lazytrain.tiers import HostTier, NVMeTier, format_bytes
from lazytrain.tiers.nvme_io import kvikio_status

directory, out_dir = sys.argv[1], sys.argv[2]
rows = []
if not torch.cuda.is_available():
    print("no CUDA device: nothing to measure here (run benchmarks/tiers.py for the NVMe tier)")
    sys.exit(1)
dev = torch.device("cuda")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")


def cuda_copy_gbps(dst, src, iters=10):
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return src.numel() * src.element_size() * iters / (start.elapsed_time(end) / 1e3) / 1e9


for size in (64 << 20, 1 << 30):
    d = torch.empty(size, dtype=torch.uint8, device=dev)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.fill_(1)
    rows.append((f"torch copy, pinned, {format_bytes(size)}", cuda_copy_gbps(pinned, d), cuda_copy_gbps(d, pinned), "write = D2H, read = H2D"))
    rows.append((f"torch copy, pageable, {format_bytes(size)}", cuda_copy_gbps(pageable, d, 3), cuda_copy_gbps(d, pageable, 3), ""))
    del d, pinned, pageable

TOTAL, TENSOR = 1 << 30, 64 << 20
g = torch.Generator(device=dev).manual_seed(0)
tensors = [torch.randint(-2**31, 2**31 - 1, (TENSOR // 4,), dtype=torch.int32, device=dev, generator=g)
           for _ in range(TOTAL // TENSOR)]


def round_trip(tier, label, note):
    """Two passes: the first pins its slabs and staging buffers (cold), the second reuses them (warm)."""
    ok = True
    for when in ("cold", "warm"):
        ok &= one_pass(tier, f"{label}, {when}", note)
    return ok


def one_pass(tier, label, note):
    outs = [torch.zeros_like(t) for t in tensors]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for h in [tier.write(f"k{i}", x) for i, x in enumerate(tensors)]:
        h.synchronize()
    w = TOTAL / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    for h in [tier.read(f"k{i}", out=o) for i, o in enumerate(outs)]:
        h.synchronize()
    r = TOTAL / (time.perf_counter() - t) / 1e9
    ok = all(torch.equal(a, b) for a, b in zip(tensors, outs))
    for i in range(len(tensors)):
        tier.free(f"k{i}")
    rows.append((label, w, r, ("data verified; " if ok else "DATA MISMATCH; ") + note))
    return ok


host = HostTier()
good = round_trip(host, "host tier, CUDA tensors", f"pinned slabs: {host.pool.pinned}")
host.close()

module, why = kvikio_status()
print(("kvikio: PRESENT: " if module is not None else "kvikio: ABSENT: ") + why)
work = tempfile.mkdtemp(prefix="lazytrain-gpu-tiers-", dir=directory)
try:
    if module is not None:
        tier = NVMeTier(path=work)
        good &= round_trip(tier, "nvme tier via kvikio, CUDA tensors", tier.backend_report)
        tier.close()
    else:
        rows.append(("nvme tier via kvikio", None, None, "NOT MEASURED: " + why))
    tier = NVMeTier(path=work, aio={"use_gds": False})
    good &= round_trip(tier, "nvme tier via POSIX + pinned staging, CUDA tensors", tier.backend_report)
    tier.close()
    src = os.path.join(work, "random.bin")
    with open(src, "wb") as f:
        for x in tensors:
            f.write(x.cpu().numpy().tobytes())
    def dd(*args):
        err = subprocess.run(["dd", *args], capture_output=True, text=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", err)
        return int(m.group(1)) / float(m.group(2)) / 1e9 if m else None
    target = os.path.join(work, "dd.bin")
    w = dd(f"if={src}", f"of={target}", f"bs={TENSOR}", "oflag=direct")
    r = dd(f"if={target}", "of=/dev/null", f"bs={TENSOR}", "iflag=direct")
    rows.append(("dd O_DIRECT, same random bytes, same path", w, r, f"bs={format_bytes(TENSOR)} (source file in page cache)"))
finally:
    subprocess.run(["rm", "-rf", work])

cell = lambda v: "-" if v is None else f"{v:.2f}"
lines = [f"| what ({format_bytes(TOTAL)} in {format_bytes(TENSOR)} tensors for tiers) | write GB/s | read GB/s | notes |",
         "| --- | ---: | ---: | --- |"]
lines += [f"| {a} | {cell(w)} | {cell(r)} | {n} |" for a, w, r, n in rows]
table = "\n".join(lines)
print(table)
with open(os.path.join(out_dir, "gpu_tiers.md"), "w") as f:
    f.write(table + "\n")
sys.exit(0 if good else 1)
PY
measure=$?
echo "measurements: exit $measure ($(( $(date +%s) - t0 )) s so far)"

tests=0
if [ "${SKIP_TIER_TESTS:-0}" != 1 ]; then
  timeout --foreground 120 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/test_tiers.py \
    tests/test_tiers_nvme.py tests/test_tiers_gpu.py tests/test_tiers_custom.py > "$OUT/gpu_tiers_tests.log" 2>&1
  tests=$?
  tail -25 "$OUT/gpu_tiers_tests.log"
  echo "tier tests: exit $tests ($(( $(date +%s) - t0 )) s so far)"
fi

timeout --foreground 90 python3 -m lazytrain.cli bench tiers --path "$DIR" --json "$OUT/hardware-gpu.json" 2>&1 | grep -v "^  "
bench=${PIPESTATUS[0]}
[ -f "$OUT/hardware-gpu.json" ] && cat "$OUT/hardware-gpu.json"
echo "lazytrain bench tiers: exit $bench; total $(( $(date +%s) - t0 )) s"
exit $(( measure || tests || bench ))
