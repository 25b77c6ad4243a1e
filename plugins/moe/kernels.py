"""Triton LatentMoE kernels: the CUDA implementation of `k3::moe_routed` (see CONTRACT.md).

    router:  s = sigmoid(x @ gate^T) in fp32                         moe_router_fwd_kernel   [N, E]
    top-k:   ids = topk(s + bias), w = s[ids] (renormalised)         moe_topk_fwd_kernel     [N, k] x2
    align:   (token, slot) pairs sorted by expert, cut into blocks of BLOCK_M rows of one expert (torch ops,
             no host sync; the block count is a static bound, so no shape depends on routing)
    gemm1:   h = SiTU_GLU(z W1_e^T, z W3_e^T) per block              moe_gemm1_fwd_kernel    [blocks*BM, I]
    gemm2:   y = h W2_e^T, scattered back to pair order in fp32      moe_gemm2_fwd_kernel    [N*k, L]
    combine: u[n] = sum_j w[n, j] y[n*k + j] in fp32 -> z.dtype      moe_combine_fwd_kernel  [N, L]

One grouped GEMM serves both regimes: with few tokens (decode) BLOCK_M = 16 and every selected expert's weights
stream once from memory; with many tokens (prefill) BLOCK_M = 64 and the blocks of one expert sit next to
each other in the grid so its weight tiles are shared through L2. Ties in s + bias go to the lowest expert id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import check, dot_precision, pow2
from .op import moe_routed


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # (1 - e^-2|x|) / (1 + e^-2|x|), with the odd Taylor series below |x| = 0.1 where that form cancels:
    # relative error ~3e-7 in fp32 (2 * sigmoid(2x) - 1 loses all digits as x -> 0)
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    small = ax * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))))
    r = tl.where(ax < 0.1, small, big)
    return tl.where(x < 0, -r, r)


# ---------------------------------------------------------------------------------------------- routing
@triton.jit
def moe_router_fwd_kernel(x, g, s, N, E, D, stride_xn, stride_ge,
                          BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                          DOT_PREC: tl.constexpr):
    """s `[N, E]` fp32 = sigmoid(x `[N, D]` @ g `[E, D]`^T); 16-bit products are exact in the fp32 sum."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = (d0 + offs_d) < D
        a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xn + d0 + offs_d[None, :],
                    mask=(offs_m[:, None] < N) & d_ok[None, :], other=0.0)
        b = tl.load(g + offs_e[:, None].to(tl.int64) * stride_ge + d0 + offs_d[None, :],
                    mask=(offs_e[:, None] < E) & d_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc=acc, input_precision=DOT_PREC)
    tl.store(s + offs_m[:, None].to(tl.int64) * E + offs_e[None, :], _sigmoid(acc),
             mask=(offs_m[:, None] < N) & (offs_e[None, :] < E))


@triton.jit
def moe_topk_fwd_kernel(s, bias, ids, w, E, scaling, K: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """One token: the K largest s + bias (ties -> lowest id), weights from the unbiased s."""
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    sc = tl.load(s + n.to(tl.int64) * E + offs, mask=ok, other=0.0)
    key = tl.where(ok, sc + tl.load(bias + offs, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], tl.int32)
    wt = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(K):
        best = tl.max(key, 0)
        idx = tl.min(tl.where(key == best, offs, BLOCK_E), 0)
        top = tl.where(slots == j, idx, top)
        wt = tl.where(slots == j, tl.sum(tl.where(offs == idx, sc, 0.0), 0), wt)
        key = tl.where(offs == idx, float("-inf"), key)
    if RENORM:
        wt = wt / (tl.sum(wt, 0) + 1e-20)
    tl.store(ids + n * K + slots, top, mask=slots < K)
    tl.store(w + n * K + slots, wt * scaling, mask=slots < K)


def route_fwd(x, gate_weight, bias, top_k: int, renormalize: bool, scaling: float):
    """x `[N, d]` -> (ids `[N, k]` int32, w `[N, k]` fp32, s `[N, E]` fp32)."""
    N, D = x.shape
    E = gate_weight.shape[0]
    if x.dtype != gate_weight.dtype:
        x, gate_weight = x.float(), gate_weight.float()
    x, gate_weight = x.contiguous(), gate_weight.contiguous()
    s = torch.empty(N, E, device=x.device, dtype=torch.float32)
    block_m = 16 if N <= 16 else 64
    block_e = 16 if N <= 16 else 64
    moe_router_fwd_kernel[(triton.cdiv(N, block_m), triton.cdiv(E, block_e))](
        x, gate_weight, s, N, E, D, x.stride(0), gate_weight.stride(0), BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_D=128 if x.dtype != torch.float32 else 32, DOT_PREC=dot_precision(x.dtype), num_warps=4,
        num_stages=3 if x.dtype != torch.float32 else 1)
    ids = torch.empty(N, top_k, device=x.device, dtype=torch.int32)
    w = torch.empty(N, top_k, device=x.device, dtype=torch.float32)
    moe_topk_fwd_kernel[(N,)](s, bias.contiguous(), ids, w, E, scaling, K=top_k, BLOCK_K=pow2(top_k, 2),
                              BLOCK_E=pow2(E), RENORM=bool(renormalize and top_k > 1), num_warps=4)
    return ids, w, s


# ---------------------------------------------------------------------------------------------- alignment
def align_blocks(ids: torch.Tensor, E: int, block_m: int):
    """Sort the N*k (token, slot) pairs by expert and cut each expert's run into blocks of block_m rows.

    Returns order `[P]` (pair ids sorted by expert, stable), block_expert `[MB]` (-1 past the last block),
    block_row `[MB]` (first row of the block in `order`), block_rows `[MB]` (valid rows, <= block_m), with the
    static bound MB = ceil(P / block_m) + min(E, P): each hit expert wastes at most one partial block."""
    flat = ids.reshape(-1).long()
    P = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(E, device=ids.device, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    pair_end = torch.cumsum(counts, 0)
    MB = triton.cdiv(P, block_m) + min(E, P)
    b = torch.arange(MB, device=ids.device)
    e = torch.searchsorted(block_end, b, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    row = pair_end[ec] - counts[ec] + (b - (block_end[ec] - blocks[ec])) * block_m
    rows = (pair_end[ec] - row).clamp(0, block_m)
    return (order, torch.where(valid, e, -1).to(torch.int32), row.to(torch.int32),
            torch.where(valid, rows, 0).to(torch.int32))


# ---------------------------------------------------------------------------------------------- experts
@triton.jit
def _block_rows(order, block_expert, block_row, block_rows, BLOCK_M: tl.constexpr):
    """This program's expert (-1: an unused block), its (token, slot) pair ids and their row mask."""
    pb = tl.program_id(0)
    e = tl.load(block_expert + pb)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.load(block_rows + pb)
    pair = tl.load(order + tl.load(block_row + pb) + offs_m, mask=m_ok, other=0)    # invalid blocks: 0 rows
    return e, pair, m_ok


@triton.jit
def moe_gemm1_fwd_kernel(z, w1, w3, h, order, block_expert, block_row, block_rows,
                         L, I, stride_zn, stride_we, stride_wi, stride_hm, beta, linear_beta,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Block pb, columns [n0, n0 + BLOCK_N) of I: h = SiTU_GLU(z_rows W1_e^T, z_rows W3_e^T) -> h.dtype."""
    pb = tl.program_id(0)
    e, pair, m_ok = _block_rows(order, block_expert, block_row, block_rows, BLOCK_M)
    if e < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = z + token[:, None].to(tl.int64) * stride_zn + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wi + offs_k[:, None]  # [BK, BN]
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, L, BLOCK_K):
        k_ok = (k0 + offs_k) < L
        a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b1 = tl.load(w1 + w_off + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b3 = tl.load(w3 + w_off + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc1 = tl.dot(a, b1, acc=acc1, input_precision=DOT_PREC)
        acc3 = tl.dot(a, b3, acc=acc3, input_precision=DOT_PREC)
    act = beta * _tanh(acc1 / beta) * _sigmoid(acc1) * (linear_beta * _tanh(acc3 / linear_beta))
    h_ptr = h + (pb * BLOCK_M + offs_m)[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptr, act.to(h.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def moe_gemm2_fwd_kernel(h, w2, y, order, block_expert, block_row, block_rows,
                         L, I, stride_hm, stride_we, stride_wl, stride_yp,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    """Block pb, columns [n0, n0 + BLOCK_N) of L: y[pair] = h_rows W2_e^T in fp32, rows back in pair order."""
    pb = tl.program_id(0)
    e, pair, m_ok = _block_rows(order, block_expert, block_row, block_rows, BLOCK_M)
    if e < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < L
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = h + (pb * BLOCK_M + offs_m)[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptr = w2 + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wl + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = (k0 + offs_k) < I
        a = tl.load(a_ptr + k0, mask=k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PREC)
    tl.store(y + pair[:, None].to(tl.int64) * stride_yp + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_combine_fwd_kernel(y, w, u, L, TOP_K: tl.constexpr, BLOCK_L: tl.constexpr):
    """u[n, l] = sum_j w[n, j] y[n*k + j, l] in fp32 -> u.dtype (fixed slot order: deterministic)."""
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    ok = offs < L
    acc = tl.zeros([BLOCK_L], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(w + n * TOP_K + j) * tl.load(y + (n * TOP_K + j).to(tl.int64) * L + offs, mask=ok, other=0.0)
    tl.store(u + n.to(tl.int64) * L + offs, acc.to(u.dtype.element_ty), mask=ok)


# Tile configs per regime: the fastest of `k3export bench moe`'s sweeps on the H200 (docs/perf.md).
# "decode": few rows per expert, stream the weights; "prefill": many rows per expert, tensor-core bound.
CONFIGS = {
    "decode": {"block_m": 16, "gemm1": (32, 256, 4, 4), "gemm2": (32, 256, 4, 4)},       # (BN, BK, warps, stages)
    "prefill": {"block_m": 64, "gemm1": (64, 64, 4, 4), "gemm2": (128, 64, 4, 4)},
}


def pick_regime(n_pairs: int, E: int) -> str:
    """Decode tiles while the average expert gets fewer than 16 rows; grouped-GEMM tiles beyond."""
    return "decode" if n_pairs < 16 * E else "prefill"


def moe_routed_fwd(x, z, gate_weight, bias, w1, w3, w2, top_k: int, renormalize: bool, scaling: float,
                   beta: float, linear_beta: float, regime: str | None = None):
    """The op's contract (see op.py): u `[N, L]` in z.dtype, combine in fp32."""
    N, Lz = z.shape
    E, I, L = w1.shape
    check(x.shape[0] == N, f"moe_routed: x has {x.shape[0]} tokens, z has {N}")
    check(gate_weight.shape == (E, x.shape[1]), f"moe_routed: gate_weight {tuple(gate_weight.shape)} must be "
          f"[E={E}, d={x.shape[1]}]")
    check(Lz == L and w3.shape == w1.shape and w2.shape == (E, L, I), f"moe_routed: z {tuple(z.shape)}, "
          f"w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} disagree ([E, I, L] / [E, L, I])")
    check(0 < top_k <= E, f"moe_routed: top_k {top_k} must be in 1..{E}")
    check(z.dtype == w1.dtype == w3.dtype == w2.dtype, f"moe_routed: z/w1/w3/w2 dtypes differ: {z.dtype}, "
          f"{w1.dtype}, {w3.dtype}, {w2.dtype}")
    u = torch.empty(z.shape, device=z.device, dtype=z.dtype)     # contiguous, as the combine kernel writes it
    if N == 0:
        return u
    z = z.contiguous()
    w1, w3, w2 = (w if w.stride(-1) == 1 else w.contiguous() for w in (w1, w3, w2))
    if w3.stride() != w1.stride():                                   # gemm1 walks both with w1's strides
        w1, w3 = w1.contiguous(), w3.contiguous()
    ids, w, _ = route_fwd(x, gate_weight, bias, top_k, renormalize, scaling)
    P = N * top_k
    cfg = CONFIGS[regime or pick_regime(P, E)]
    bm = cfg["block_m"] if z.dtype != torch.float32 else 16
    order, block_expert, block_row, block_rows = align_blocks(ids, E, bm)
    MB = block_expert.numel()
    h = torch.empty(MB * bm, I, device=z.device, dtype=z.dtype)
    y = torch.empty(P, L, device=z.device, dtype=torch.float32)
    prec = dot_precision(z.dtype)
    fp32 = z.dtype == torch.float32
    bn, bk, warps, stages = cfg["gemm1"] if not fp32 else (32, 32, 4, 1)
    moe_gemm1_fwd_kernel[(MB, triton.cdiv(I, bn))](
        z, w1, w3, h, order, block_expert, block_row, block_rows, L, I, z.stride(0), w1.stride(0), w1.stride(1),
        h.stride(0), beta, linear_beta, TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec,
        num_warps=warps, num_stages=stages)
    bn, bk, warps, stages = cfg["gemm2"] if not fp32 else (32, 32, 4, 1)
    moe_gemm2_fwd_kernel[(MB, triton.cdiv(L, bn))](
        h, w2, y, order, block_expert, block_row, block_rows, L, I, h.stride(0), w2.stride(0), w2.stride(1),
        y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, num_warps=warps, num_stages=stages)
    block_l = min(1024, pow2(L))
    moe_combine_fwd_kernel[(N, triton.cdiv(L, block_l))](y, w, u, L, TOP_K=top_k, BLOCK_L=block_l, num_warps=4)
    return u


@moe_routed.register_kernel("cuda")
def _(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta):
    if torch.float64 in (x.dtype, z.dtype, w1.dtype):      # validation runs stay float64: the kernels are fp32
        return moe_routed._init_fn(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta,
                                   linear_beta)
    return moe_routed_fwd(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)
