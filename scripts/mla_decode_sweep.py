"""MLA decode split-kernel variants (base and transposed "t", tile shapes) at a few K3 shapes, each checked
against the fp32 reference (`k3export.bench.mla.sweep_decode`), with the cache bytes' fraction of the measured
copy bandwidth. GPU only. Usage: python3 scripts/mla_decode_sweep.py OUT.json"""
import json, sys
from k3export.bench.mla import sweep_decode
from k3export.bench.ceilings import copy_bandwidth
bw = copy_bandwidth()
out = {"copy_GBs": bw / 1e9}
for H, B, L in ((96, 32, 16384), (96, 128, 8192), (12, 32, 16384)):
    rows = sweep_decode(H, B, L)
    for r in rows:
        if "ms" in r:
            r["frac_copy"] = B * L * 576 * 2 / (r["ms"] * 1e-3) / bw
    out[f"H{H}-B{B}-L{L}"] = rows
    print(H, B, L, json.dumps(rows), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
