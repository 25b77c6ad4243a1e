"""MLA decode at 96 heads: the default many-heads tile against the wide candidates of `DECODE_TILES` (kernel="wide",
`mla_decode_wide_kernel`), B in 1, 8, 32, 128 x cache 1k, 8k, 64k, bf16.

    python3 scripts/mla_decode_sweep.py OUT.json [--budget-s 140] [--variants name,...]   (GPU; names: VARIANTS, EXTRA)
    python3 scripts/mla_decode_sweep.py --ptx [name ...]                                   (CPU: offline sm_90)

GPU: per shape, every variant's `do_bench` median (L2 flushed), the cache bytes (B L 576 2) as a fraction of the
copy bandwidth measured in the same run, TFLOP/s of attention math (B L 96 (576 + 512) 2), and its output's
max|diff| / max|old| against the old tile's output on the same inputs (both round P and the output to bf16 once:
the GPU tests' bound 1e-2 marks a variant "ok"); where B L <= 64k also the old tile against the fp32 reference.
Shapes past --budget-s seconds are skipped (listed in the JSON), so the call ends in time; results are written
after every shape. At the end: the fastest ok variant per shape.

--ptx: compile every variant for sm_90 with the Triton that is importable (the H200 has 3.6.0: put an unpacked
3.6.0 wheel first on PYTHONPATH), integer arguments specialised as the JIT does for K3 shapes (divisible by 16),
and print ptxas's registers and spill bytes, shared memory and the wgmma / mma.sync count. ptxas: $PTXAS, else
/usr/local/cuda-13.0/bin/ptxas (fed the PTX with its `.version` lowered to 9.0), else Triton's own.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

SCALE = 1.0 / math.sqrt(192)
H = 96
# Largest first: compiles happen at the first shapes, and a budget cut drops the small, launch-bound ones.
SHAPES = sorted(((B, L) for L in (1024, 8192, 65536) for B in (1, 8, 32, 128)), key=lambda s: -s[0] * s[1])
MAX_BYTES = 40e9      # cache bytes per shape (128 x 64k is 9.7 GB)
ERR_BOUND = 1e-2      # the GPU tests' bf16 bound

# name -> DECODE_CONFIG entries set for the variant ("old" is the default many-heads tile).
VARIANTS = {
    "old": {},
    "wide32": {"many_heads_tile": "wide32"},
    "wide64-tma": {"many_heads_tile": "wide64-tma"},
    "wide64-tma-fill": {"many_heads_tile": "wide64-tma", "fill_waves": True},
    "trans128-tma": {"many_heads_tile": "trans128-tma"},
    "trans128-tma-fill": {"many_heads_tile": "trans128-tma", "fill_waves": True},
}
# Built by --ptx only (not timed by default, to keep the GPU run short; time them with --variants): the 32-row TMA
# tile (m64n16 score steps) and the transposed 64-row tile (one stage and the scores computed twice).
EXTRA = {
    "wide32-tma": {"many_heads_tile": "wide64-tma", "block_n": 32, "num_stages": 3},
    "trans64-tma": {"many_heads_tile": "trans128-tma", "block_n": 64},
}


ALL = VARIANTS | EXTRA


def _with(K, cfg: dict):
    """Set DECODE_CONFIG entries; returns the previous config to restore."""
    prev = dict(K.DECODE_CONFIG)
    K.DECODE_CONFIG.update(cfg)
    return prev


def _restore(K, prev: dict) -> None:
    K.DECODE_CONFIG.clear()
    K.DECODE_CONFIG.update(prev)


def sweep(path: str, budget_s: float, names: list[str]) -> None:
    import torch
    from k3export.bench.ceilings import bench_ms, copy_bandwidth, machine
    from k3export.plugins.mla import kernels as K
    from k3export.plugins.mla.naive import mla_decode_attention

    t0 = time.time()
    bw = copy_bandwidth()
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "copy_GBs": bw / 1e9,
           "heads": H, "variants": {n: ALL[n] for n in names}, "rows": [], "skipped": []}
    print(f"{res['machine']}; copy {bw / 1e9:.0f} GB/s", flush=True)
    for B, L in SHAPES:
        nbytes = B * L * 576 * 2
        if nbytes > MAX_BYTES or time.time() - t0 > budget_s:
            res["skipped"].append({"B": B, "L": L, "why": "size" if nbytes > MAX_BYTES else "budget"})
            continue
        torch.manual_seed(0)
        q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16)
        cache = torch.randn(B, L, 576, device="cuda", dtype=torch.bfloat16)
        row = torch.randn(B, 576, device="cuda", dtype=torch.bfloat16)
        cl = torch.full((B,), L, device="cuda", dtype=torch.int64)
        old = None
        for name in names:
            prev = _with(K, ALL[name])
            try:
                call = lambda: K.mla_decode_fwd(q, cache, row, cl, SCALE, 512)
                out = call().float()
                r = {"B": B, "L": L, "variant": name, "tile": K.decode_tiles(H),
                     "splits": K.decode_splits(B, H, L, K.decode_tiles(H)["block_h"], q.device,
                                               K.decode_tiles(H).get("fill_waves", False))}
                if old is None:
                    old = out
                    if B * L <= 65536:
                        ref = mla_decode_attention(q.float(), cache.float(), row.float(), cl, SCALE, 512)
                        r["rel_err_vs_fp32"] = ((out - ref).abs().max() / ref.abs().max()).item()
                r["rel_diff_vs_old"] = ((out - old).abs().max() / old.abs().max()).item()
                r["ok"] = r["rel_diff_vs_old"] < ERR_BOUND and bool(torch.isfinite(out).all())
                r["ms"] = bench_ms(call, rep=30)
                r["frac_copy"] = nbytes / (r["ms"] * 1e-3) / bw
                r["TFLOP/s"] = B * L * H * (576 + 512) * 2 / r["ms"] / 1e9
            except Exception as e:  # a variant that does not build or launch here: record it, go on
                r = {"B": B, "L": L, "variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                _restore(K, prev)
            res["rows"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tile"}), flush=True)
        del q, cache, row, old
        torch.cuda.empty_cache()
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
    best = {}
    for r in res["rows"]:
        key = f"B{r['B']}-L{r['L']}"
        if r.get("ok") and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = {"variant": r["variant"], "ms": r["ms"], "frac_copy": r["frac_copy"]}
    res["best"] = best
    res["wall_s"] = time.time() - t0
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    for key, b in best.items():
        old = next(r for r in res["rows"] if f"B{r['B']}-L{r['L']}" == key and r["variant"] == "old")
        print(f"{key}: best {b['variant']} {b['ms']:.3f} ms ({100 * b['frac_copy']:.1f}% copy); old "
              f"{old.get('ms', float('nan')):.3f} ms ({100 * old.get('frac_copy', float('nan')):.1f}%)")
    print(f"wrote {path} ({res['wall_s']:.0f} s)")


# ---------------------------------------------------------------------------------------------- offline sm_90
def _ptxas() -> tuple[str, bool]:
    """(ptxas path, whether the PTX's .version must be lowered for it)."""
    import triton
    if os.environ.get("PTXAS"):
        return os.environ["PTXAS"], True
    if os.path.exists("/usr/local/cuda-13.0/bin/ptxas"):
        return "/usr/local/cuda-13.0/bin/ptxas", True
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"), False


def ptx_report(names: list[str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from k3export.plugins.mla import kernels as K

    ptxas, lower = _ptxas()
    print(f"triton {triton.__version__}, sm_90, {ptxas}")
    common = dict(stride_qb="i32", stride_qh="i32", stride_cb="i32", stride_cl="i32", H="i32", num_splits="i32",
                  qk_scale="fp32", V_DIM="i32", R="i32", o_part="*fp32", lse_part="*fp32")
    for name in names:
        prev = _with(K, ALL[name])
        try:
            t = K.decode_tiles(H)
        finally:
            _restore(K, prev)
        cx = dict(BLOCK_H=t["block_h"], BLOCK_N=t["block_n"], BLOCK_V=512, BLOCK_PE=64, DOT_PREC="tf32", PDL=False)
        if t.get("kernel") == "wide":
            fn, tma = K.mla_decode_wide_kernel, t["tma"]
            desc = lambda cols: f"tensordesc<bf16[{t['block_n']},{cols}]>" if tma else "constexpr"
            sig = dict(q="*bf16", cache="*bf16", cache_len="*i32", kv_desc=desc(512), pe_desc=desc(64), **common)
            cx.update(TMA=tma, TRANS_S=t["trans_s"], **({} if tma else dict(kv_desc=None, pe_desc=None)))
        else:
            fn = K.mla_decode_fwd_kernel
            sig = dict(q="*bf16", cache="*bf16", cache_len="*i32", **common)
        sig.update({k: "constexpr" for k in cx if k not in sig})
        names_ = list(sig)
        attrs = {(names_.index(n),): [["tt.divisibility", 16]] for n, ty in sig.items()
                 if ty.startswith("*") or n.startswith("stride") or n in ("H", "V_DIM", "R")}
        c = triton.compile(ASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=t["num_warps"], num_stages=t["num_stages"]))
        ptx = c.asm["ptx"]
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
            fh.write(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, flags=re.M) if lower else ptx)
        run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", fh.name, "-o", os.devnull], capture_output=True,
                             text=True)
        os.unlink(fh.name)
        found = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
        shapes = " ".join(f"{m} x{found.count(m)}" for m in sorted(set(found)))
        regs = re.search(r"Used (\d+) registers", run.stderr)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
        print(f"{name:18s} {'wide' if t.get('kernel') == 'wide' else 'base':4s} h{t['block_h']} n{t['block_n']} "
              f"w{t['num_warps']} s{t['num_stages']}  regs {regs.group(1) if regs else '?':>3s}  spill "
              f"{spill.group(1) if spill else '?':>4s}/{spill.group(2) if spill else '?':>4s} B  shared "
              f"{c.metadata.shared:>6d} B  wgmma {ptx.count('wgmma.mma_async'):3d} ({shapes})  mma.sync "
              f"{ptx.count('mma.sync.aligned'):3d}" + ("" if run.returncode == 0 else f"  ptxas: {run.stderr[-200:]}"))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--ptx":
        ptx_report(args[1:] or list(VARIANTS) + list(EXTRA))
        sys.exit(0)
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    out, rest = args[0], args[1:]
    opts = dict(zip(rest[::2], rest[1::2]))
    chosen = opts.get("--variants", ",".join(VARIANTS)).split(",")
    if chosen[0] != "old":
        chosen = ["old"] + [n for n in chosen if n != "old"]
    sweep(out, float(opts.get("--budget-s", 140)), chosen)
