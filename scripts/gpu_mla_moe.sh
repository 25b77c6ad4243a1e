#!/usr/bin/env bash
# GPU run for the MLA and MoE kernels (device tool): cuda tests, then `k3export bench mla|moe|layer`.
# Logs and JSON go to $OUT (or out/gpu). Each step runs even if the previous one failed.
set -uo pipefail
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -m cuda -s tests/test_mla_kernels.py tests/test_moe_kernels.py 2>&1 | tee "$OUT/test.log" \
  | grep -E "rel err|passed|failed|Error|assert" | head -60
for b in ${BENCHES:-mla moe layer}; do
  echo "== bench $b"; python3 -m k3export.cli bench "$b" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-$b.log"
done
