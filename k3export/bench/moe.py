"""`k3export bench moe`: the routed LatentMoE kernel at K3 size (896 experts, top-16, 3584 -> 3072 -> 3584, bf16).

Decode (1..64 tokens) is memory-bound: the floor is the bytes of the distinct experts hit (3 * 3072 * 3584 * 2
each, 66 MB) plus the router weights, over the measured copy bandwidth. Prefill (4096..16384 tokens) is
matmul-bound: useful FLOPs = tokens * 16 * 6 * 3584 * 3072, against the measured bf16 matmul rate.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import click
import torch

from k3export.bench import bench
from k3export.bench.ceilings import bench_ms, copy_bandwidth, machine, matmul_rate

E, D, L, I, K = 896, 7168, 3584, 3072, 16
ARGS = dict(top_k=K, renormalize=True, scaling=1.0, beta=4.0, linear_beta=25.0)


def k3_weights():
    """Random K3-size routed experts in bf16 (59 GB) and a router."""
    g = torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    b = torch.zeros(E, device="cuda")
    w1 = torch.empty(E, I, L, device="cuda", dtype=torch.bfloat16).normal_(0, L ** -0.5)
    w3 = torch.empty(E, I, L, device="cuda", dtype=torch.bfloat16).normal_(0, L ** -0.5)
    w2 = torch.empty(E, L, I, device="cuda", dtype=torch.bfloat16).normal_(0, I ** -0.5)
    return g, b, w1, w3, w2


def _fmt(r):
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())


def _once_ms(fn, n=2):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def decode_rows(w, bw, tokens=(1, 4, 16, 64)) -> list[dict]:
    from k3export.plugins.moe.kernels import moe_routed_fwd, route_fwd
    from k3export.plugins.moe.naive import moe_sorted
    g, b, w1, w3, w2 = w
    out = []
    for N in tokens:
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
        ids, _, _ = route_fwd(x, g, b, K, True, 1.0)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * I * L * 2 + g.numel() * 2
        ms = bench_ms(lambda: moe_routed_fwd(x, z, g, b, w1, w3, w2, **ARGS))
        r = {"tokens": N, "experts_hit": hit, "ms": ms, "GB/s": nbytes / ms / 1e6, "frac_copy": nbytes / (ms * 1e-3) / bw,
             "router_ms": bench_ms(lambda: route_fwd(x, g, b, K, True, 1.0))}
        r["eager_ms"] = _once_ms(lambda: moe_sorted(x, z, g, b, w1, w3, w2, **ARGS), n=3)
        out.append(r)
        print(_fmt(r), flush=True)
    return out


def prefill_rows(w, rate, tokens=(4096, 8192, 16384)) -> list[dict]:
    from k3export.plugins.moe import kernels as Km
    from k3export.plugins.moe.naive import moe_sorted
    g, b, w1, w3, w2 = w
    out = []
    for N in tokens:
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
        flops = N * K * 6 * L * I
        ms = bench_ms(lambda: Km.moe_routed_fwd(x, z, g, b, w1, w3, w2, **ARGS), rep=20)
        r = {"tokens": N, "ms": ms, "TFLOP/s": flops / ms / 1e9, "frac_matmul": flops / (ms * 1e-3) / rate}
        if N == tokens[0]:
            r["eager_ms"] = _once_ms(lambda: moe_sorted(x, z, g, b, w1, w3, w2, **ARGS), n=1)
        out.append(r)
        print(_fmt(r), flush=True)
        del x, z
        torch.cuda.empty_cache()
    return out


# Tilings tried per regime: (BN, BK, warps, stages) for each GEMM.
SWEEPS = {
    "prefill": [{"block_m": 128, "gemm1": (64, 64, 8, 3), "gemm2": (128, 64, 8, 3)},
                {"block_m": 128, "gemm1": (128, 64, 8, 3), "gemm2": (128, 64, 8, 4)},
                {"block_m": 64, "gemm1": (64, 64, 4, 4), "gemm2": (128, 64, 4, 4)},
                {"block_m": 128, "gemm1": (64, 64, 4, 4), "gemm2": (256, 64, 8, 3)}],
    "decode": [{"block_m": 16, "gemm1": (64, 128, 4, 4), "gemm2": (64, 128, 4, 4)},
               {"block_m": 16, "gemm1": (32, 256, 4, 4), "gemm2": (32, 256, 4, 4)},
               {"block_m": 16, "gemm1": (64, 256, 8, 3), "gemm2": (64, 256, 8, 3)},
               {"block_m": 16, "gemm1": (32, 128, 4, 6), "gemm2": (64, 128, 4, 6)}],
}


def sweep(w, regime: str, N: int, rep: int) -> list[dict]:
    """Time each tiling of `regime` at N tokens; leaves the fastest in CONFIGS[regime]."""
    from k3export.plugins.moe import kernels as Km
    g, b, w1, w3, w2 = w
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
    rows, best = [], (float("inf"), dict(Km.CONFIGS[regime]))
    for v in SWEEPS[regime]:
        Km.CONFIGS[regime] = v
        try:
            ms = bench_ms(lambda: Km.moe_routed_fwd(x, z, g, b, w1, w3, w2, regime=regime, **ARGS), rep=rep)
        except Exception as e:
            rows.append({**v, "error": type(e).__name__})
            continue
        rows.append({**v, "ms": ms, "TFLOP/s": N * K * 6 * L * I / ms / 1e9})
        best = min(best, (ms, v), key=lambda t: t[0])
    Km.CONFIGS[regime] = best[1]
    return rows


@bench.command("moe")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/bench"), show_default=True)
@click.option("--quick", is_flag=True, help="no tile sweeps, fewer shapes")
def moe(out: Path, quick: bool) -> None:
    """Routed MoE: decode 1..64 tokens (expert bytes vs copy bandwidth), prefill 4096..16384 tokens (TFLOP/s vs
    the bf16 matmul rate), each vs the eager loop (`moe_sorted`)."""
    out.mkdir(parents=True, exist_ok=True)
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"{machine()}; copy {bw / 1e12:.2f} TB/s; bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    w = k3_weights()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "copy_TBps": bw / 1e12, "matmul_TFLOPs": rate / 1e12}
    if not quick:
        res["sweep_decode"] = sweep(w, "decode", N=1, rep=50)
        print("decode sweep:", json.dumps(res["sweep_decode"]), flush=True)
    res["decode"] = decode_rows(w, bw, (1, 4, 16, 64) if not quick else (1, 64))
    if not quick:
        res["sweep_prefill"] = sweep(w, "prefill", N=8192, rep=10)
        print("prefill sweep:", json.dumps(res["sweep_prefill"]), flush=True)
    res["prefill"] = prefill_rows(w, rate, (4096, 8192, 16384) if not quick else (4096,))
    from k3export.plugins.moe.kernels import CONFIGS
    res["configs"] = CONFIGS
    (out / "moe.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'moe.json'}")
