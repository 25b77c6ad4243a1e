"""Can a plain Triton GEMV beat cuBLAS at one decode row? (k3-small decode shapes, bf16, GPU; a planning probe.)

At B = 1 the k3-small decode step spends ~0.4 ms in ~60 cuBLAS GEMVs (`nvjet_*_64x8_*`) that read ~0.9 GB, about
half of copy bandwidth: the small ones (2-10 MB) take ~5 us where their bytes need 1-2.5 us. This times, per
shape, `F.linear` against a one-pass Triton GEMV (`gemv_fwd_kernel`: each program reduces BLOCK_N output rows
over the whole K, fp32 FMAs into a [BLOCK_N, BLOCK_K] tile, one reduction at the end, bf16 store; no split-K, no
second launch) over a few tilings, each captured as a CUDA graph of REPS GEMVs with their own weights (more bytes
than L2 holds), replayed after warm-up and timed with CUDA events. Reports us per GEMV, % of the copy bandwidth
measured in the same run, and whether the Triton result equals cuBLAS's within bf16 rounding.

    python3 scripts/gemv_triton_probe.py [--out probe.json]
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemv_pack_probe import probe_start, timed, write_json   # CUDA-graph replay, CUDA-event medians (scripts/ on sys.path)

REPS = 16
# (name, N, K, GEMVs per k3-small decode step)
SHAPES = [("kda_in", 8336, 2048, 9), ("kda_o", 2048, 2048, 9), ("mla_in", 3392, 2048, 3), ("mla_q_b", 3072, 768, 3),
          ("mla_o", 2048, 2048, 3), ("moe_in", 2560, 2048, 11), ("moe_out", 2048, 1792, 11),
          ("dense_in", 16384, 2048, 1), ("dense_out", 2048, 8192, 1), ("lm_head", 32768, 2048, 1)]
TILINGS = [(8, 256, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (8, 512, 2)]   # (BLOCK_N, BLOCK_K, warps)


@triton.jit
def gemv_fwd_kernel(x, w, y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_k x[k] w[n, k] for this program's BLOCK_N rows; w row-major [N, K]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xv = tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w + rows[:, None].to(tl.int64) * K + ks[None, :], mask=n_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    tl.store(y + rows, tl.sum(acc, 1).to(y.dtype.element_ty), mask=n_ok)


def gemv(x, w, y, tiling):
    bn, bk, nw = tiling
    N, K = w.shape
    gemv_fwd_kernel[(triton.cdiv(N, bn),)](x, w, y, N, K, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)


def main() -> None:
    out, copy_gbs = probe_start()
    dev, dt = "cuda", torch.bfloat16
    print(f"copy {copy_gbs:.0f} GB/s; us per GEMV (graph of {REPS}), % of copy", flush=True)
    rows, step = [], {"cublas": 0.0, "best_triton": 0.0, "floor": 0.0}
    for name, N, K, per_step in SHAPES:
        g = torch.Generator(device=dev).manual_seed(N + K)
        xs = [torch.randn(1, K, device=dev, generator=g).to(dt) for _ in range(REPS)]
        ws = [(torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(dt) for _ in range(REPS)]
        ys = [torch.empty(1, N, device=dev, dtype=dt) for _ in range(REPS)]
        nbytes = N * K * 2
        floor_us = nbytes / copy_gbs / 1e3
        t_cublas = timed(lambda: [F.linear(x, w) for x, w in zip(xs, ws)]) / REPS * 1e3
        ref = F.linear(xs[0], ws[0]).float()
        row = dict(name=name, N=N, K=K, MB=nbytes / 1e6, floor_us=floor_us, cublas_us=t_cublas, triton={})
        for t in TILINGS:
            us = timed(lambda: [gemv(x, w, y, t) for x, w, y in zip(xs, ws, ys)]) / REPS * 1e3
            gemv(xs[0], ws[0], ys[0], t)
            err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
            row["triton"]["x".join(map(str, t))] = dict(us=us, rel_err=err)
        best = min(row["triton"].items(), key=lambda kv: kv[1]["us"])
        row["best"] = best[0]
        rows.append(row)
        for k, v in (("cublas", t_cublas), ("best_triton", best[1]["us"]), ("floor", floor_us)):
            step[k] += per_step * v
        print(f"{name:10s} N={N:5d} K={K:5d} {nbytes / 1e6:6.1f} MB floor {floor_us:5.1f} | cuBLAS {t_cublas:6.1f} "
              f"({floor_us / t_cublas:4.0%}) | Triton best {best[0]} {best[1]['us']:6.1f} "
              f"({floor_us / best[1]['us']:4.0%}, err {best[1]['rel_err']:.1e}) | "
              + " ".join(f"{k} {v['us']:.1f}" for k, v in row["triton"].items()), flush=True)
    print(f"per k3-small decode step (these GEMVs, counts as above): cuBLAS {step['cublas']:.0f} us, best Triton "
          f"tiling per shape {step['best_triton']:.0f} us, bytes floor {step['floor']:.0f} us")
    write_json(out, dict(copy_gbs=copy_gbs, reps=REPS, rows=rows, step_us=step))


if __name__ == "__main__":
    main()
