#!/usr/bin/env bash
# Every LazyTrain check that needs a CUDA GPU, in sections of a few minutes each:
#   1. the chaos tests first (every copy delayed on its CUDA stream by a spin kernel, every NVMe request
#      and layer update on the host: results must be bit-identical to the calm run), step traces timed by
#      CUDA events (copies, the blocks' compute and the waits: delayed copies measured as waits), a
#      resident layer's refresh in forward order on the CUDA stream, what each layer's graph saves measured
#      on CUDA, emulated links refused on CUDA; then
#      the tests named on_a_gpu: two processes on the one GPU copying from node-shared host weights
#      registered as pinned; selective and offloaded layers bit-identical to the plans without them; policy
#      auto measuring (stream-event traces), planning and training bit for bit as a fixed plan, also where a
#      frozen bottom stops the backward above block 0; lean RMSNorms
#      bit for bit in bf16 and, under the fused attention kernels, saving what the planner counts (within 10%)
#      on CUDA; a block that checkpoints
#      its own MLP re-run from the streamed weights (keep-all, offloaded and selective layers alike); stages 2
#      and 3 with two processes on the one GPU (at stage 3 the non-block parameters partitioned between them,
#      at stage 2 their fp32 host masters, the owners sending the updated device copies) bit for bit as
#      stage 0; an NCCL group of one training bit for bit as one process; stage 2's gradient reduce on the
#      device (NCCL, a group of one: started from the backward, the owner's copy after it) bit for bit as on
#      the host; an NVMe read into new device memory not overwritten by kernels queued after it; a tier
#      write from the device, once waited for, on the host;
#   2. the engine's parity tests on the CUDA path (side-stream copies, events, pinned memory, the gradient
#      sink, a layer gradient's failed copy refused by every step until zero_grad, host boundaries' pinned
#      buffers back in the host pool every step, the optimizer update
#      overlapping the next forward, resident layers' refreshes due from a step kept across a write of some
#      weights (safe_set_full_fp32_param, a partial load_state_dict), a window of re-run layers prefetched whole
#      into extra buffers allocated on the compute stream and released after) against plain PyTorch on the
#      same device, a
#      block-less model with its optimizer on the host, the embedding's and head's fp32 state on the host by
#      default and on the device when asked, the optimizer and tier tests;
#   3. benchmarks/gpu_tiers.sh (pinned host<->device bandwidth, host/NVMe tiers, kvikio when present, and
#      `lazytrain bench tiers`; its tier tests left to section 2), then
#      benchmarks/host_add.py (the gradient sinks' host add, torch's pieces against the compiled pass, on the
#      GPU machine's cores) and benchmarks/update_clear.py (a layer's update clearing its gradient as it reads
#      it, against a zero_ pass after);
#   4. benchmarks/engine_gpu.py (plain PyTorch vs LazyTrain Plans on a ~1B Llama, policy auto's predicted vs
#      measured step, and the device peak the planner predicted beside the one measured), each LazyTrain row's
#      last step traced (summaries printed: where the time over plain PyTorch's goes; the Chrome traces in
#      $OUT/traces).
# usage: bash benchmarks/gpu_suite.sh      env: OUT (default lazytrain-out) receives the logs; ONLY (default
# 1234) runs those sections only, in the order 1, 2, 4, 3 (the throughput check before the tier benchmarks);
# BUDGET (default 540) caps the whole run in seconds: each section's timeout is cut to what is left of it and a
# section with under 30 s left is skipped, saying so. The sections' own timeouts add up to more than a device
# session holds (one call runs at most 600 s, a session 900 s of device time in all, start-up included):
# run BUDGET=520 ONLY=12 first, then ONLY=4, then ONLY=3, each with BUDGET set to what the device's status says
# is left, less a minute (the sections skipped say so).
# Deterministic kernels are asked for (CUBLAS_WORKSPACE_CONFIG; LAZYTRAIN_TEST_DETERMINISTIC makes the tests
# call torch.use_deterministic_algorithms, warning where an op has none): the bit-for-bit tests compare runs.
# Python packages missing on the GPU machine (pulp, highspy, kvikio) may be given as wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lazytrain-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} LAZYTRAIN_TEST_DETERMINISTIC=1
SITE=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    && echo "installed $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "# LazyTrain gpu_suite.sh, $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

ONLY=${ONLY:-1234}
BUDGET=${BUDGET:-540}
# The timeout for a section: its own default, cut to what is left of BUDGET; 0 when under 30 s are left.
limit() {
  local left=$((BUDGET - SECONDS))
  if (( left < 30 )); then echo 0; elif (( $1 < left )); then echo "$1"; else echo "$left"; fi
}
# Runs "$@" under the section's limit, or says it was skipped for want of time.
run_within() {
  local t
  t=$(limit "$1"); shift
  if (( t == 0 )); then echo "skipped for want of time (BUDGET=$BUDGET s, $SECONDS s used): $*"; return 0; fi
  timeout "$t" "$@"
}
if [[ $ONLY == *1* ]]; then
echo "## 1. chaos, traces and the on_a_gpu tests"
# the frozen-weights tests first (one is CUDA-only): a timeout then cuts into the chaos seeds instead; the
# slowest tests are listed, to size this section's limit once it has run
run_within "${CHAOS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_frozen_weights.py \
  tests/test_engine_chaos.py tests/test_trace.py tests/test_fidelity.py \
  2>&1 | tee "$OUT/gpu_chaos.log" | tail -25
run_within "${SHARED_TIMEOUT:-165}" python3 -m pytest -q -p no:cacheprovider tests/test_engine_sharded.py \
  tests/test_selective.py tests/test_internals_offload.py tests/test_auto_plan.py tests/test_lean_norms.py \
  tests/test_master_grad_sink.py tests/test_tiers_gpu.py tests/test_planner_frozen_bottom.py -k on_a_gpu 2>&1 | tee "$OUT/gpu_shared.log" | tail -5
fi

if [[ $ONLY == *2* ]]; then
echo "## 2. parity, optimizer and tier tests on the CUDA path"
run_within "${TEST_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider tests/test_engine_parity.py tests/test_engine_overlap.py \
  tests/test_no_blocks.py tests/test_param_access.py tests/test_inplace_writes.py tests/test_engine_layout_guard.py \
  tests/test_optim*.py tests/test_tiers*.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi

if [[ $ONLY == *4* ]]; then
echo "## 4. engine throughput (and policy auto's predicted vs measured step)"
run_within "${ENGINE_TIMEOUT:-240}" python3 benchmarks/engine_gpu.py --trace "$OUT/traces" 2>&1 | tee "$OUT/engine_gpu.log" \
  | tail -80
fi

if [[ $ONLY == *3* ]]; then
echo "## 3. tiers"
OUT="$OUT" SKIP_TIER_TESTS=1 run_within "${TIERS_TIMEOUT:-250}" bash benchmarks/gpu_tiers.sh 2>&1 | tee "$OUT/gpu_tiers.log" | tail -40
run_within "${HOST_ADD_TIMEOUT:-60}" python3 benchmarks/host_add.py --reps 5 2>&1 | tee "$OUT/host_add.log"
run_within "${UPDATE_CLEAR_TIMEOUT:-60}" python3 benchmarks/update_clear.py --reps 7 2>&1 | tee "$OUT/update_clear.log"
fi
