#!/usr/bin/env bash
# One device call for the MoE kernels (run from the repo root, device tool `run`, carry .whl, timeout ~270 s):
#   the moe `cuda` tests (every named tiling vs moe_sorted at K3 size; tail tilings at 8192 tokens), the AOT
#   chain's cupy test and the FP8 grouped-expert cuda test (they share the row plan), then `k3export bench moe`
#   (copy and matmul ceilings, every tiling at prefill 8192/4096/16384 and decode 1/4/16/64 tokens, stage times)
#   under what is left of MOE_BUDGET_S (default 240) seconds. Logs and moe.json under $OUT. The bench ends with
#   a short table and the fastest prefill tiling per token count (output agreeing with the baseline tiling's).
set -uo pipefail
start=$SECONDS
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
bash scripts/gpu.sh test tests/test_moe_kernels.py tests/test_moe_trt.py \
  "tests/test_fp8.py::test_grouped_kernel_matches_sorted_cuda" -s -rs --durations=8
cp "$OUT/test-gpu.log" "$OUT/test-moe.log" 2>/dev/null
left=$(( ${MOE_BUDGET_S:-240} - (SECONDS - start) - 20 ))
echo "== k3export bench moe (budget ${left} s, tests took $((SECONDS - start)) s)" | tee "$OUT/bench-moe.log"
python3 -m k3export.cli bench moe --out "$OUT/bench" --budget-s "$(( left > 20 ? left : 20 ))" 2>&1 | tee -a "$OUT/bench-moe.log"
echo "== total $((SECONDS - start)) s" | tee -a "$OUT/bench-moe.log"
