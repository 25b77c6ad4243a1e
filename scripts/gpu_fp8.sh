#!/usr/bin/env bash
# GPU machine (device tool, carry [".whl"]): the FP8 `cuda` tests, then a benchmark, both inside BUDGET seconds so
# that the logs and fp8.json come back even when the tail is cut.
#   bash scripts/gpu_fp8.sh [extra bench args]
#       `k3export bench fp8 --preset k3-small --batches 1,8,64` (k3-small decode, the full-width layer pair, the
#       weight-only threshold sweeps, prefill, accuracy report); BUDGET default 175
#   MODE=variants bash scripts/gpu_fp8.sh [extra bench args]
#       `k3export bench fp8 --no-model --variants --profile`: every named one-row linear launch at the full-width
#       pair's shapes and every weight-only expert scheme at one token (errors checked), the layer pair in bf16 and
#       FP8 (default, best linear launch, best expert scheme, both) and per-kernel profiles; BUDGET default 288, tests 100 s
# Logs, gpu.txt and fp8.json under $OUT (or ./out/gpu). Set-up as scripts/gpu.sh: the image's python3 (torch 2.11,
# triton 3.6), fla-core from .whl/ into /tmp/site.
set -uo pipefail
MODE=${MODE:-model}
if [ "$MODE" = variants ]; then BUDGET=${BUDGET:-288}; TEST_TIMEOUT=${TEST_TIMEOUT:-100}
  args=(--no-model --variants --profile)
else BUDGET=${BUDGET:-175}; TEST_TIMEOUT=${TEST_TIMEOUT:-60}; args=(--preset k3-small --batches 1,8,64); fi
source "$(dirname "$0")/gpu_setup.sh"
timeout "$TEST_TIMEOUT" python3 -m pytest -q -m cuda tests/test_fp8.py 2>&1 | tee "$OUT/test-fp8.log"
left=$((BUDGET - SECONDS - 3))
echo "== bench fp8 ${args[*]} $* with ${left}s left" | tee "$OUT/bench-fp8.log"
timeout "$left" python3 -m k3export.cli bench fp8 "${args[@]}" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/bench-fp8.log"
echo "== done after ${SECONDS}s" | tee -a "$OUT/bench-fp8.log"
