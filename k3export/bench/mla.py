"""`k3export bench mla`: MLA latent decode (and prefill) kernels against the cache-bytes floor, eager and SDPA.

Decode reads each cache row (576 bf16) once per head block; the floor is cache bytes / copy bandwidth. With 96
heads the kernel also does 96 * (576 + 512) * 2 = 209 kFLOP per 1152-byte row (181 FLOP/byte), close to the
H200's bf16 ridge: at 96 heads the ceiling is the tensor cores as much as memory. 12 heads (TP=8) is memory-bound.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import click
import torch

from k3export.bench import bench, command_line, require_cuda
from k3export.bench.ceilings import bench_ms, copy_bandwidth, graph_ms, machine
from k3export.manifest import atomic_write, replacing

SCALE = 1.0 / math.sqrt(192)
ERR_BOUND = 1e-2   # a sweep variant counts only within the GPU tests' bf16 bound (P and o rounded once each)


def _decode_inputs(B, H, L):
    q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(B, L, 576, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(B, 576, device="cuda", dtype=torch.bfloat16)
    return q, cache, row, torch.full((B,), L, device="cuda", dtype=torch.int64)


def sweep_decode(H: int, B: int, L: int) -> list[dict]:
    """Time a few DECODE_CONFIG variants at one shape; leaves the best in DECODE_CONFIG."""
    from k3export.plugins.mla import kernels as K
    q, cache, row, cl = _decode_inputs(B, H, L)
    base = dict(K.DECODE_CONFIG)
    variants = [dict(block_h=bh, block_n=bn, num_warps=w, num_stages=s)
                for bh, bn, w, s in ((16, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2),
                                     (16, 64, 4, 3), (32, 32, 4, 3))
                if not (H <= 16 and bh > 16)]
    from k3export.plugins.mla.naive import mla_decode_attention
    ref = mla_decode_attention(q.float(), cache.float(), row.float(), cl, SCALE, 512)
    rows, best = [], (float("inf"), base)
    for v in variants:
        K.DECODE_CONFIG.update(base | v)
        try:
            out = K.mla_decode_fwd(q, cache, row, cl, SCALE, 512)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            ms = bench_ms(lambda: K.mla_decode_fwd(q, cache, row, cl, SCALE, 512), rep=50)
        except Exception as e:  # out of shared memory / registers for this tile: report and skip
            rows.append({**v, "error": type(e).__name__})
            continue
        ok = err < ERR_BOUND
        rows.append({**v, "ms": ms, "rel_err": err, "ok": ok})
        if ok:
            best = min(best, (ms, base | v), key=lambda t: t[0])
    K.DECODE_CONFIG.clear()
    K.DECODE_CONFIG.update(best[1])
    return rows


def decode_rows(heads, batches, lengths, bw, baselines_up_to: int) -> list[dict]:
    """Per shape: ms / frac_copy of a plain call (the two launches from Python: host-bound for small shapes) and
    graph_ms / graph_frac_copy of its CUDA-graph replay (the device time, as the runtime's decode step runs it)."""
    from k3export.plugins.mla.kernels import mla_decode_fwd
    from k3export.plugins.mla.naive import mla_decode_attention
    out = []
    for H in heads:
        for B in batches:
            for L in lengths:
                if B * L * 576 * 2 > 12e9:
                    continue
                q, cache, row, cl = _decode_inputs(B, H, L)
                call = lambda: mla_decode_fwd(q, cache, row, cl, SCALE, 512)               # noqa: E731
                ms, gms = bench_ms(call), graph_ms(call)
                nbytes = cache.numel() * 2
                r = {"H": H, "B": B, "L": L, "ms": ms, "GB/s": nbytes / ms / 1e6,
                     "frac_copy": nbytes / (ms * 1e-3) / bw, "TFLOP/s": B * L * H * (576 + 512) * 2 / ms / 1e9,
                     "graph_ms": gms, "graph_frac_copy": nbytes / (gms * 1e-3) / bw}
                if B * L <= baselines_up_to:
                    r["eager_ms"] = bench_ms(lambda: mla_decode_attention(q, cache, row, cl, SCALE, 512), rep=20)
                    if B * L * H * 320 * 2 <= 16e9:   # expanded per-head K (192) and V (128) for the history
                        k = torch.randn(B, H, L + 1, 192, device="cuda", dtype=torch.bfloat16)
                        v = torch.randn(B, H, L + 1, 128, device="cuda", dtype=torch.bfloat16)
                        qe = torch.randn(B, H, 1, 192, device="cuda", dtype=torch.bfloat16)
                        sdpa = torch.nn.functional.scaled_dot_product_attention
                        r["sdpa_expanded_ms"] = bench_ms(lambda: sdpa(qe, k, v, scale=SCALE), rep=20)
                        del k, v
                out.append(r)
                print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                      flush=True)
                del q, cache
                torch.cuda.empty_cache()
    return out


def prefill_rows(bw_flops=None) -> list[dict]:
    from k3export.plugins.mla.kernels import mla_prefill_fwd
    out = []
    for H, T, Lc in ((96, 4096, 0), (96, 8192, 0), (12, 16384, 0), (96, 4096, 4096)):
        q = torch.randn(1, T, H, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Lc + T, H, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, Lc + T, H, 128, device="cuda", dtype=torch.bfloat16)
        pl = torch.full((1,), Lc, device="cuda", dtype=torch.int64)
        ms = bench_ms(lambda: mla_prefill_fwd(q, k, v, pl, SCALE), rep=30)
        pairs = T * Lc + T * (T + 1) / 2                        # (query, key) pairs attended
        flops = pairs * H * (192 + 128) * 2
        r = {"H": H, "T": T, "Lc": Lc, "ms": ms, "TFLOP/s": flops / ms / 1e9}
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        if Lc == 0:
            sdpa = torch.nn.functional.scaled_dot_product_attention
            r["sdpa_causal_ms"] = bench_ms(lambda: sdpa(qs, ks, vs, is_causal=True, scale=SCALE), rep=30)
        out.append(r)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    return out


@bench.command("mla")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/bench"), show_default=True)
@click.option("--quick", is_flag=True, help="fewer shapes, no tile sweep")
@click.option("--sweep/--no-sweep", default=True, show_default=True,
              help="Sweep the base decode tiles at B = 32, L = 16k first and time the rows with the best; "
                   "--no-sweep times the tiles the runtime uses.")
def mla(out: Path, quick: bool, sweep: bool) -> None:
    """MLA decode: B in 1..128, cache 1k..64k, 96 and 12 heads, cache bytes vs copy bandwidth (plain calls and
    CUDA-graph replays); vs eager and vs SDPA on the expanded (per-head K/V) form. Prefill: TFLOP/s vs SDPA
    causal."""
    require_cuda("mla")
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"{machine()}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    sweep = {H: sweep_decode(H, 32, 16384) for H in (96, 12)} if sweep and not quick else {}
    print("decode config sweep (B=32, L=16k):", json.dumps(sweep), flush=True)
    from k3export.plugins.mla.kernels import DECODE_CONFIG
    print("decode config used (last sweep):", DECODE_CONFIG, flush=True)
    batches = (1, 8, 32, 128) if not quick else (1, 32)
    lengths = (1024, 8192, 65536) if not quick else (1024, 65536)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "command": command_line(click.get_current_context(), "k3export bench mla"),
           "copy_TBps": bw / 1e12, "sweep": sweep, "config": dict(DECODE_CONFIG)}
    rows = []
    for H in (96, 12):
        if sweep.get(H):   # the best config for this head count
            best = min((r for r in sweep[H] if r.get("ok")), key=lambda r: r["ms"])
            DECODE_CONFIG.update({k: best[k] for k in ("block_h", "block_n", "num_warps", "num_stages")})
        rows += decode_rows((H,), batches, lengths, bw, baselines_up_to=256 * 1024)
    res["decode"] = rows
    res["prefill"] = prefill_rows()
    atomic_write(out / "mla.json", json.dumps(res, indent=1))
    atomic_write(out / "mla.md", decode_table(res))
    print(decode_table(res))
    png = plot(res, out / "mla.png")
    print(f"wrote {out / 'mla.json'}, {out / 'mla.md'}" + (f", {png}" if png else " (no matplotlib: no plot)"))


def plot(res: dict, path: Path) -> Path | None:
    """Decode: % of copy bandwidth (CUDA-graph replay) against cache rows per sequence, one line per batch size,
    one panel per head count, with the 80% line of the target."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    heads = sorted({r["H"] for r in res["decode"]}, reverse=True)
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False)
    for ax, H in zip(axes[0], heads):
        for B in sorted({r["B"] for r in res["decode"] if r["H"] == H}):
            rs = sorted((r for r in res["decode"] if r["H"] == H and r["B"] == B), key=lambda r: r["L"])
            ax.plot([r["L"] for r in rs], [100 * r["graph_frac_copy"] for r in rs], "o-", label=f"B = {B}")
        ax.axhline(80, color="k", linestyle=":", label="80% (target, large B x L)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 100)
        ax.set_xlabel("cache rows per sequence")
        ax.set_ylabel("% of copy bandwidth (cache bytes)")
        ax.set_title(f"MLA decode, {H} heads")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['machine']}, copy {res['copy_TBps']:.2f} TB/s, {res['date']}")
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def decode_table(res: dict) -> str:
    """The decode rows as a markdown table (cache bytes B L 576 2 against the run's copy bandwidth)."""
    lines = [f"{res['date']}, {res['machine']}, copy {res['copy_TBps']:.2f} TB/s", "",
             "| H | B | L | plain ms | graph ms | graph GB/s | graph % copy | graph TFLOP/s | eager ms | SDPA ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        g = r["graph_ms"]
        fl = r["B"] * r["L"] * r["H"] * (576 + 512) * 2
        lines.append(f"| {r['H']} | {r['B']} | {r['L']} | {r['ms']:.3f} | {g:.3f} | "
                     f"{r['B'] * r['L'] * 1152 / g / 1e6:.0f} | {r['graph_frac_copy']:.1%} | {fl / g / 1e9:.0f} | "
                     + " | ".join(f"{r[k]:.3f}" if k in r else "" for k in ("eager_ms", "sdpa_expanded_ms")) + " |")
    return "\n".join(lines) + "\n"
