#!/usr/bin/env bash
# One device call for the KDA prefill kernels (issue 4). Set-up as scripts/gpu.sh (fla-core wheel from .whl/ to
# /tmp/site, editable install). Then, each part under its own time limit, logs under $OUT as they go:
#   1. scripts/kda_warm.py, one process per prefill variant in parallel: compile (Triton's disk cache is shared),
#      then run once at B=1, T=8192, H=96 against the eager reference, result to $KDA_CHECK_DIR. A variant that
#      faults ends only its own process (an illegal memory access ends a process's CUDA context for good);
#   2. our prefill variants that passed 1 (`k3export bench kda --sweep --phases prefill --checked`): each intra
#      launch and state pass timed alone and checked end to end, then the fastest within bounds combined;
#   3. the prefill `cuda` tests (the defaults at K3 shapes, mixed lengths, strong decay, vs fla's naive
#      recurrence; the AOT contracts via cupy);
#   4. fla-core's chunk_kda on the same inputs, last (its first-call autotuning takes about a minute), in $OUT/fla.
# Device tool: `bash scripts/gpu_kda.sh`, carry [".whl"], timeout_s 270. (Decode sweep: `--phases decode`.)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
export KDA_CHECK_DIR=/tmp/kda_checks
t0=$SECONDS
python3 scripts/kda_warm.py --list | timeout "${WARM_TIMEOUT:-80}" xargs -d '\n' -P 16 -n 1 python3 scripts/kda_warm.py \
  2>&1 | grep -v Warning | tee "$OUT/warm-kda.log"
echo "warm + isolated checks: $((SECONDS - t0)) s" | tee -a "$OUT/warm-kda.log"
timeout "${SWEEP_TIMEOUT:-60}" python3 -m k3export.cli bench kda --sweep --phases prefill --checked "$KDA_CHECK_DIR" \
  --budget-s "${SWEEP_BUDGET:-45}" --out "$OUT/kda" 2>&1 | tee "$OUT/sweep-kda.log"
timeout "${TEST_TIMEOUT:-70}" python3 -m pytest -q -m cuda tests/test_kda_kernels.py -rs \
  -k "${TEST_K:-prefill or aot_contracts}" 2>&1 | tee "$OUT/test-kda.log"
timeout "${FLA_TIMEOUT:-50}" python3 -m k3export.cli bench kda --sweep --phases fla --out "$OUT/fla" 2>&1 \
  | tee -a "$OUT/sweep-kda.log"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/sweep-kda.log"
