#!/usr/bin/env bash
# GPU machine entry point (device tool): `bash scripts/gpu.sh test|bench [extra pytest args | bench names]`.
#   test           every `cuda`-marked test (`make test-gpu`)
#   e2e            export k3-small (bf16) on the GPU, then verify the re-loaded graphs there: every k3 op on its
#                  Triton kernel, == eager, vs the float32 naive twins (logs in $OUT/e2e.log)
#   bench [names]  the benchmarks (default: kda mla moe layer model fp8), each under a time limit, results
#                  tarred into $OUT/bench.tar.gz (the device tool brings back at most 8 files)
# Uses the image's python3 (torch 2.11, triton 3.6); wheels in .whl/ (fla-core) are installed to /tmp/site.
# Logs go to $OUT (or ./out/gpu when run elsewhere).
set -uo pipefail
mode=${1:-test}; shift || true
source "$(dirname "$0")/gpu_setup.sh"
case "$mode" in
  test)  python3 -m pytest -q -m cuda "$@" 2>&1 | tee "$OUT/test-gpu.log" ;;
  e2e)
    d=/tmp/k3-small-cuda
    { python3 -m k3export.cli export --preset k3-small --dtype bfloat16 --device cuda --out "$d" \
        --max-batch 4 --max-tokens 512 --max-cache 2048 && t=$SECONDS \
      && python3 -m k3export.cli verify --graphs "$d" --no-onnx; rc=$?; echo "verify: $((SECONDS - t)) s (exit $rc)"; } 2>&1 \
      | tee "$OUT/e2e.log" ;;
  bench)
    names=${*:-kda mla moe layer model fp8}
    mkdir -p "$OUT/bench"
    for name in $names; do
      case "$name" in
        model) args=(--preset k3-small --dtype bf16 --backends eager,graph --prefill-lengths 512,2048
                     --batches 1,2,4,8,16,32,64 --contexts 1024 --warmup 2 --iters 5) ;;
        fp8)   args=(--preset k3-small --batches 1,8,64) ;;
        *)     args=() ;;
      esac
      echo "== k3export bench $name ${args[*]}" | tee -a "$OUT/bench.log"
      timeout "${BENCH_TIMEOUT:-300}" python3 -m k3export.cli bench "$name" --out "$OUT/bench/$name" "${args[@]}" \
        2>&1 | tee -a "$OUT/bench.log"
    done
    tar -C "$OUT" -czf "$OUT/bench.tar.gz" bench && rm -rf "$OUT/bench" ;;
  *) echo "usage: scripts/gpu.sh test|bench"; exit 2 ;;
esac
