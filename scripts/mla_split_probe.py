"""How many splits the MLA decode should cut a long cache into at small B (planning; GPU only). The split rule
(`plugins.mla.kernels.split_rule`) asks for `waves` x SMs programs and chunks of at least `min_chunk` rows; every
split writes a 2 KB fp32 partial per head that the combine reads back (at 96 heads, B = 1, 64k rows: 88 splits,
34 MB of partials against a 75 MB cache). For each shape and setting: the split count, the CUDA-graph replay time
of `mla_decode_fwd` (split + combine) and its error against the default rule's output. Settings: waves 2 rounded up
for every head count (whole_wave_heads 0) and whole_wave_heads 16 (up to 16 heads, the most splits that fit one
wave; the default since this probe's run of 2026-11-30 22:20, docs/perf.md).

    python3 scripts/mla_split_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import math

import torch

from gemv_pack_probe import write_json      # scripts/ on sys.path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from k3export.bench.ceilings import copy_bandwidth, graph_ms
    from k3export.plugins.mla import kernels as K
    bw = copy_bandwidth()
    scale = 1.0 / math.sqrt(192)
    base = dict(K.DECODE_CONFIG)
    rows = []
    k3 = ((1, 8192), (1, 65536), (8, 8192), (8, 65536), (32, 8192), (32, 65536), (128, 8192), (128, 65536))
    small = ((1, 1024), (16, 1024), (64, 1024), (64, 8192))     # k3-small's MLA: 16 heads, its bench's caches
    for H, shapes in ((12, k3), (16, small), (96, k3)):
        for B, L in shapes:
            q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16)
            cache = torch.randn(B, L, 576, device="cuda", dtype=torch.bfloat16)
            row = torch.randn(B, 576, device="cuda", dtype=torch.bfloat16)
            cl = torch.full((B,), L, device="cuda", dtype=torch.int64)
            ref = K.mla_decode_fwd(q, cache, row, cl, scale, 512).float()
            for whole in (0, 16):                     # two waves for every head count; one wave up to 16 heads
                waves, min_chunk = base["waves"], base["min_chunk"]
                K.DECODE_CONFIG.update(whole_wave_heads=whole)
                try:
                    cfg = K.decode_tile_for(B, H, L, q.dtype)
                    S = K.decode_splits(B, H, L, cfg["block_h"], q.device, cfg.get("fill_waves", False))
                    out = K.mla_decode_fwd(q, cache, row, cl, scale, 512).float()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    ms = graph_ms(lambda: K.mla_decode_fwd(q, cache, row, cl, scale, 512))
                finally:
                    K.DECODE_CONFIG.clear()
                    K.DECODE_CONFIG.update(base)
                r = {"H": H, "B": B, "L": L, "waves": waves, "whole_wave_heads": whole, "min_chunk": min_chunk,
                     "splits": S, "graph_ms": ms,
                     "frac_copy": B * L * 1152 / (ms * 1e-3) / bw, "rel_err_vs_default": err}
                rows.append(r)
                print(f"H={H:3d} B={B:3d} L={L:6d} whole_wave_heads={whole:2d} S={S:4d}: {ms:.4f} ms "
                      f"({r['frac_copy']:.1%} of copy), vs default {err:.1e}", flush=True)
            del q, cache
    write_json(a.out, {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": rows})


if __name__ == "__main__":
    main()
