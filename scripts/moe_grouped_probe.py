"""MoE prefill tilings at a preset's own expert shapes (k3-small: 64 experts, top-8, 1024 -> 768 -> 1024), token
counts in the "grouped" regime (16..64 rows per expert) and around it: each tiling's time (`do_bench` median, L2
flushed; plain calls and CUDA-graph replays) and its output vs the first tiling's. Random bf16 weights and inputs.

    python3 scripts/moe_grouped_probe.py [--preset k3-small] [--tokens 128,256,384,512] [--tiles old,m64t32-aw8]
        [--paired] [--out FILE.json]

`bench moe` does the same at K3 size; this is the check that a default chosen there holds at the smaller shapes the
same regime covers in the presets we serve.
"""

from __future__ import annotations

import argparse
import json

import torch

from k3export.bench.ceilings import bench_ms, graph_ms
from k3export.config import K3Config
from k3export.plugins.moe import kernels as Km

SITU = dict(beta=4.0, linear_beta=25.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--tokens", default="128,256,384,512")
    ap.add_argument("--tiles", default="old,m64t32-aw8,m64t32-n128-aw8-y16r-f2,m128t64-aw-y16r-f2")
    ap.add_argument("--paired", action="store_true", help="gate/up rows interleaved (the compile backend's layout)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    c = K3Config.from_name(a.preset)
    d, E, k, L, I = (c.hidden_size, c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size,
                     c.moe_intermediate_size)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    gate, bias = torch.randn(E, d, **bf) * d ** -0.5, torch.randn(E, device="cuda", generator=g) * 0.1
    w1, w3 = torch.randn(E, I, L, **bf) * L ** -0.5, torch.randn(E, I, L, **bf) * L ** -0.5
    w2 = torch.randn(E, L, I, **bf) * I ** -0.5
    if a.paired:
        w1, w3 = Km.interleave_gate_up(w1, w3)[1:]
    rows = []
    for T in map(int, a.tokens.split(",")):
        x, z = torch.randn(T, d, **bf), torch.randn(T, L, **bf)
        default = [n for n, t in Km.TILINGS["prefill"].items() if t == Km.tiles_for(z, T * k, E)]
        print(f"{a.preset} T={T}: {T * k / E:.0f} rows per expert, regime {Km.pick_regime(T * k, E)}, default "
              f"{default[0] if default else '(not a prefill tiling)'}", flush=True)
        base = None
        for name in a.tiles.split(","):
            t = Km.TILINGS["prefill"][name]
            fn = lambda: Km.moe_routed_fwd(x, z, gate, bias, w1, w3, w2, k, True, 1.0, tiles=t, **SITU)  # noqa: E731
            u = fn()
            base = u if base is None else base
            err = ((u.float() - base.float()).abs().max() / base.float().abs().max()).item()
            r = {"tokens": T, "tiles": name, "ms": bench_ms(fn), "graph_ms": graph_ms(fn), "err_vs_first": err}
            rows.append(r)
            print(f"  {name:28s} {r['ms']:7.3f} ms  graph {r['graph_ms']:7.3f} ms  err vs first {err:.1e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "paired": a.paired, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
