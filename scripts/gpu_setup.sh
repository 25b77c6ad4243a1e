# Sourced by the GPU entry points (scripts/gpu.sh, gpu_kda.sh, gpu_fp8.sh) on the GPU machine, from the repo root:
# $OUT (default ./out/gpu), unbuffered Python, the wheels in .whl/ (fla-core) into /tmp/site on PYTHONPATH, the
# editable install of k3export (offline: no index, no build isolation, so k3export.plugins maps onto plugins/),
# and the GPU / torch / triton versions into $OUT/gpu.txt. Uses the image's python3 (torch 2.11, triton 3.6).
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
