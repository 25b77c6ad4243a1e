#!/usr/bin/env bash
# One device call for the KDA kernels (issue 4): `k3export bench kda --sweep` (every prefill/decode variant checked
# against the eager reference and timed; then fla-core's chunk_kda and fused_recurrent_kda on the same inputs),
# then the kda `cuda` tests. Set-up as scripts/gpu.sh (fla-core wheel from .whl/ to /tmp/site, editable install).
# Device tool: `bash scripts/gpu_kda.sh`, carry [".whl"], timeout_s 270: sweep <= 140 s (ours within 80 s; fla's
# first-call autotuning takes the rest), tests <= 100 s (the defaults' kernels are the ones verified before; the
# tests mostly add the new variants at more shapes). Logs and kda/kda_sweep.{md,json} under $OUT, saved as they go.
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout "${SWEEP_TIMEOUT:-140}" python3 -m k3export.cli bench kda --sweep --budget-s "${SWEEP_BUDGET:-80}" \
  --batches 256,64,16,1 --out "$OUT/kda" 2>&1 | tee "$OUT/sweep-kda.log"
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -m cuda tests/test_kda_kernels.py -rs 2>&1 | tee "$OUT/test-kda.log"
