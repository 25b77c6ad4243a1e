"""The weight-only FP8 GEMM's split-K sum inside the launch ("fixup") against the second launch ("launch") and
against not splitting, at k3-small's decode GEMMs and the full-width K3 pair's (H200, CUDA graphs).

For each (N, K) and M: microseconds per GEMM of `fp8_linear_wo_fwd` back to back over COPIES weight copies in one
CUDA graph (L2 flushed before each replay; `bench.fp8._graph_us_each`) for
    launch   the default tiling, split-K partials summed by `fp8_wo_reduce_kernel` (the two-launch path)
    fixup    the same slices, summed in the GEMV launch by the CTA that finishes each column tile last
    unsplit  one slice (no partials, no sum)
    s4096    (M = 1) the default tiling with slices of 4096 K at least (`WoTiles.min_slice`), fixup
with the slices each ran, fixup vs launch bit mismatches (must be 0) and the relative error against
`fp8_linear_wo_ref`. k3-small's rows also carry how many GEMMs of that shape one decode step runs (the packed
FP8 model at B = 1: 62 GEMVs, 52 of them split under the default), and the summary weighs them per step.

    python3 scripts/fp8_split_sum.py --out DIR [--rows 1,4,16]      (writes DIR/fp8_split_sum.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

COPIES = 6
# k3-small FP8 linears as the packed model runs them (`model/packing.py`, recipe `calibration/`): (N, K) -> GEMMs
# per decode step. KDA q|k|v|g x9, MLA q_a|kv_a|g x3, o_proj x12, MLA q_b x3, MoE routed down|shared gate|up x11,
# MoE routed up and shared down x11 each (FP8 is not column-packed), dense MLP gate|up and down x1.
K3_SMALL = {(8192, 2048): 9, (3392, 2048): 3, (2048, 2048): 12, (3072, 768): 3, (4096, 2048): 11,
            (2048, 1024): 11, (2048, 1536): 11, (16384, 2048): 1, (2048, 8192): 1}


def shape_rows(N: int, K: int, rows_m, per_step: int | None) -> list[dict]:
    from k3export.bench.fp8 import _graph_us_each
    from k3export.fp8 import fp8_linear_wo_ref, quantize, scale_from_amax, weight_amax
    from k3export.fp8_kernels import (DOT_TILE, GEMV, GEMV_TILINGS, _sms, fp8_linear_wo_fwd, packed_ok, wo_slices,
                                      wo_split)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())       # noqa: E731
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    ws = scale_from_amax(weight_amax(w, True))
    wqs = [quantize(w, ws[:, None])]
    wqs += [wqs[0].clone() for _ in range(COPIES - 1)]
    del w
    out = []
    for M in rows_m:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        t = GEMV if M == 1 and packed_ok(x, wqs[0]) else DOT_TILE
        variants = {"launch": dict(split_sum="launch"), "fixup": dict(split_sum="fixup"), "unsplit": dict(split=1)}
        if M == 1:
            variants["s4096"] = dict(tiles=GEMV_TILINGS["p-n8k512-cvt-pf-c4-s4096"], split_sum="fixup")
        ref = fp8_linear_wo_ref(x.float(), wqs[0], ws)
        r = {"N": N, "K": K, "M": M, "per_step": per_step, "MB_fp8": N * K / 1e6, "slices": {}, "us": {}, "err": {}}
        ys = {}
        for name, kw in variants.items():
            tt = kw.get("tiles", t)
            r["slices"][name] = 1 if kw.get("split") == 1 else wo_slices(K, wo_split(N, K, tt, _sms(0)), tt.block_k)[0]
            ys[name] = fp8_linear_wo_fwd(x, wqs[0], ws, **kw)
            r["err"][name] = rel(ys[name], ref)
            r["us"][name] = _graph_us_each([lambda q=q, kw=kw: fp8_linear_wo_fwd(x, q, ws, **kw) for q in wqs])
        bits = {2: torch.int16, 4: torch.int32}[ys["fixup"].element_size()]
        r["fixup_vs_launch_bit_mismatches"] = int((ys["fixup"].view(bits) != ys["launch"].view(bits)).sum())
        out.append(r)
        print(f"  {N:6d} x {K:5d} M={M:2d} slices {r['slices']['launch']}: "
              + ", ".join(f"{n} {u:6.2f} us" for n, u in r["us"].items())
              + f"; fixup vs launch mismatches {r['fixup_vs_launch_bit_mismatches']}, "
              f"err {max(r['err'].values()):.1e}", flush=True)
    del wqs
    torch.cuda.empty_cache()
    return out


def main() -> None:
    from k3export.bench.fp8 import pair_linear_shapes
    from k3export.calibrate import DEFAULT_RECIPE, Recipe
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4,16", help="M values (1: the packed GEMV; 2..64: the tl.dot path)")
    a = ap.parse_args()
    rows_m = [int(m) for m in a.rows.split(",")]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{torch.cuda.get_device_name()} ({platform.node()})", "torch": torch.__version__,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "env_K3_FP8_SPLIT_SUM": os.environ.get("K3_FP8_SPLIT_SUM"), "k3_small": [], "k3_pair": []}
    print("k3-small decode GEMMs (us per GEMM):", flush=True)
    for (N, K), n in K3_SMALL.items():
        res["k3_small"] += shape_rows(N, K, rows_m, n)
    print("full-width K3 pair's FP8 linears:", flush=True)
    for N, K in pair_linear_shapes(Recipe.load(DEFAULT_RECIPE)):
        res["k3_pair"] += shape_rows(N, K, rows_m, None)
    res["summary"] = {}
    for key, rows in (("k3_small", res["k3_small"]), ("k3_pair", res["k3_pair"])):
        for M in rows_m:
            sel = [r for r in rows if r["M"] == M]
            names = set.intersection(*(set(r["us"]) for r in sel))
            tot = {n: sum(r["us"][n] * (r["per_step"] or 1) for r in sel) for n in sorted(names)}
            res["summary"][f"{key}_M{M}"] = tot
            print(f"{key} M={M}: {'per decode step' if key == 'k3_small' else 'summed over the shapes'}: "
                  + ", ".join(f"{n} {u:.1f} us" for n, u in tot.items()), flush=True)
    res["max_fixup_vs_launch_bit_mismatches"] = max(r["fixup_vs_launch_bit_mismatches"]
                                                    for r in res["k3_small"] + res["k3_pair"])
    print(f"fixup vs launch: max bit mismatches {res['max_fixup_vs_launch_bit_mismatches']} (must be 0)")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "fp8_split_sum.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
