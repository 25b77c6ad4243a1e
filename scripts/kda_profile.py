"""Per-kernel GPU time of one KDA prefill call (B=1, T=8192, H=96, K=V=128, bf16), ours by intra variant and
fla-core's `chunk_kda`, through torch.profiler: which launch of each pipeline takes the time. GPU only. (`bench kda
--sweep` records the same in its fla phase, as `prefill.kernel_us`.)

    python3 scripts/kda_profile.py [intra variant ...]     (default: the default config; then fla)
"""

import json
import sys

import torch

from k3export.bench.kda import _fla_chunk, _prefill_args, kernel_us
from k3export.plugins.kda import kernels

if __name__ == "__main__":
    args = _prefill_args(8192, 96)
    out = {}
    for variant in sys.argv[1:] or ["default"]:
        cfg = {} if variant == "default" else kernels.INTRA_CONFIGS[variant]
        out[f"ours {variant}"] = kernel_us(lambda: kernels.kda_prefill_fwd(*args, config=cfg))
    try:
        with torch.inference_mode():
            out["fla chunk_kda"] = kernel_us(_fla_chunk(args))
    except Exception as e:  # fla missing: report and go on
        out["fla chunk_kda"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(out, indent=1))
