#!/usr/bin/env bash
# GPU machine (device tool): the aoti backend with the k3 Triton kernels compiled in. Builds a k3-small-cut (4
# layers, bf16) aoti engine, loads its packages in a process that never imports k3export, compares with eager
# (tests/test_aoti_cuda.py, prints build/lower/compile seconds and the errors). Log: $OUT/aoti.log.
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
python3 -m pytest -q -m cuda tests/test_aoti_cuda.py -s -x -p no:cacheprovider 2>&1 | tee "$OUT/aoti.log"
