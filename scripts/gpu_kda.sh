#!/usr/bin/env bash
# One device call for the KDA prefill kernels (issue 4). Set-up as scripts/gpu.sh (fla-core wheel from .whl/ to
# /tmp/site, editable install). Then, each part under its own time limit, logs under $OUT as they go:
#   1. scripts/kda_warm.py, one process per prefill variant in parallel: compile (Triton's disk cache is shared),
#      run once at B=1, T=8192, H=96 against the eager reference (result to $KDA_CHECK_DIR), then compile the
#      intra variants at the cuda tests' shapes too. A variant that faults ends only its own process
#      (an illegal memory access ends a process's CUDA context for good);
#   2. our prefill variants that passed 1 (`k3export bench kda --sweep --phases prefill --checked`): each intra
#      launch and state pass timed alone and checked end to end, then the fastest within bounds combined;
#   3. the prefill `cuda` tests (K3 shapes, mixed lengths, strong decay, vs fla's naive recurrence; the AOT
#      contracts via cupy) with K3_KDA_INTRA = the fastest non-default intra variant of 2 within bounds
#      (the op, the AOT contract and the tests all follow that env), or the default if none ($KDA_TEST_INTRA
#      overrides the pick);
#   4. fla-core's chunk_kda on the same inputs, last, in $OUT/fla. Its first-call autotuning outran 45-50 s in
#      each run of 2026-11-30 (00:28, 01:00, 01:41: no figure), hence 110 s here; on 2026-11-29 it gave 2.62 ms.
# Device tool: `bash scripts/gpu_kda.sh`, carry [".whl"], timeout_s 270 (typical parts: set-up 10 s, warm 30 s,
# sweep 25 s, tests 45 s, then fla). (Decode sweep: `--phases decode`.)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
export KDA_CHECK_DIR=/tmp/kda_checks
t0=$SECONDS
python3 scripts/kda_warm.py --list | timeout "${WARM_TIMEOUT:-60}" xargs -d '\n' -P 16 -n 1 python3 scripts/kda_warm.py \
  2>&1 | grep -v Warning | tee "$OUT/warm-kda.log"
echo "warm + isolated checks: $((SECONDS - t0)) s" | tee -a "$OUT/warm-kda.log"
timeout "${SWEEP_TIMEOUT:-45}" python3 -m k3export.cli bench kda --sweep --phases prefill --checked "$KDA_CHECK_DIR" \
  --budget-s "${SWEEP_BUDGET:-35}" --out "$OUT/kda" 2>&1 | tee "$OUT/sweep-kda.log"
pick=$(python3 - "$OUT/kda/kda_sweep.json" <<'PY'
import json, sys
try:
    intra = json.load(open(sys.argv[1]))["prefill"]["intra_ms"]
except Exception:
    intra = {}
good = {n: r["ms"] for n, r in intra.items() if isinstance(r, dict) and r.get("ok") and n != "full"}
print(min(good, key=good.get) if good else "")
PY
)
export K3_KDA_INTRA="${KDA_TEST_INTRA:-$pick}"
echo "cuda tests with K3_KDA_INTRA='${K3_KDA_INTRA}' (empty: the default)" | tee "$OUT/test-kda.log"
timeout "${TEST_TIMEOUT:-75}" python3 -m pytest -q -m cuda tests/test_kda_kernels.py -rs \
  -k "${TEST_K:-prefill or aot_contracts}" 2>&1 | tee -a "$OUT/test-kda.log"
unset K3_KDA_INTRA
timeout "${FLA_TIMEOUT:-110}" python3 -m k3export.cli bench kda --sweep --phases fla --out "$OUT/fla" 2>&1 \
  | tee -a "$OUT/sweep-kda.log"
echo "total: $((SECONDS - t0)) s" | tee -a "$OUT/sweep-kda.log"
