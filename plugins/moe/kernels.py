"""Triton LatentMoE kernels: the CUDA implementation of `k3::moe_routed` (see CONTRACT.md).

    router:  s = sigmoid(x @ gate^T) in fp32 (split over d for few   moe_router_fwd_kernel   [N, E]
             tokens, the partial sums added by the top-k kernel)
    top-k:   ids = topk(s + bias), w = s[ids] (renormalised)         moe_topk_fwd_kernel     [N, k] x2
    align:   row plan: (token, slot) pairs sorted by expert, cut     moe_align_fwd_kernel    [MB*R], [MB]
             into blocks of R = BLOCK_M + TAIL rows of one expert (one program for N k <= 4096; beyond,
             torch ops or count / scan / scatter kernels; no host sync; the block count MB is a static
             bound, so no shape depends on routing)
    gather:  ("aw" tilings) z rows in plan order                     moe_gather_fwd_kernel   [MB*R, L]
    gemm1:   h = SiTU_GLU(z W1_e^T, z W3_e^T) per block              moe_gemm1_fwd_kernel    [MB*R, I]
    gemm2:   y = h W2_e^T, scattered back to pair order in fp32      moe_gemm2_fwd_kernel    [N*k, L]
    combine: u[n] = sum_j w[n, j] y[n*k + j] in fp32 -> z.dtype      moe_combine_fwd_kernel  [N, L]

  or, for a few tokens (`MoeTiles.pairs`, the decode default up to 2 tokens), no row plan and no padding rows:
    gemm1:   h[p] = SiTU_GLU(z W1_e^T, z W3_e^T) per (token, expert)  moe_pair_gemm1_fwd_kernel  [N*k, I]
             pair p, one GEMV per weight
    gemm2:   y[p] = h[p] W2_e^T in fp32                               moe_pair_gemm2_fwd_kernel  [N*k, L]
    then the same combine. Fused variants (`MoeTiles.fuse_topk` / `fuse_combine`, 5 launches -> 3, the same bits):
    router + top-k: the last program of a token tile (a ticket per tile)    moe_router_topk_fwd_kernel
             runs the top-k
    gemm2 + combine: the last program of a (token, column tile) sums its    moe_pair_gemm2_combine_fwd_kernel
             k rows
    Their ticket counters live in one int32 buffer per device, zeroed once (`tickets`); each launch leaves them 0.

One grouped GEMM pair serves every regime; `MoeTiles` picks its tiling (block rows, tiles, tile order, TMA
descriptors or pointer loads) and `pick_regime` the default by rows per expert: decode (BLOCK_M = 16, each
selected expert's weights stream once), prefill (BLOCK_M = 64 or 128 with a tail, A rows and weights through
TMA, all column tiles of a block next to each other so the A rows and each expert's weight tiles are shared
through L2). Ties in s + bias
go to the lowest expert id.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from ..launch import INTERPRET, launch, pdl_args, pdl_wait, size_bound
from ..triton_common import check, dot_precision, pow2, tickets
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


@triton.jit
def _tanh_fast(x, HW: tl.constexpr):
    """HW: the MUFU instruction tanh.approx.f32 (relative error ~2^-11, below a bf16 half-ulp; no interpreter
    support), else `_tanh`."""
    if HW:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return _tanh(x)


@triton.jit
def _situ_glu(a, b, beta, linear_beta, FAST: tl.constexpr):
    """SiTU-GLU of the fp32 products a = z W1^T, b = z W3^T. FAST 0: `_tanh` / `_sigmoid` (the decode kernels'
    math); 1: reciprocal multiplies instead of a / beta, b / lb; 2: also the two tanh as tanh.approx.f32 (the
    sigmoid stays exp-based: its small values keep their relative accuracy). The prefill gemm1's epilogue runs
    once per output tile on the warps that then start the next tile (one CTA per SM); on sm_90 FAST 2 halves the
    m128t64 gemm1's PTX (3486 -> 1856 instructions: most of the rest is the epilogue)."""
    if FAST == 0:
        return beta * _tanh(a / beta) * _sigmoid(a) * (linear_beta * _tanh(b / linear_beta))
    else:
        inv_b = 1.0 / beta
        inv_lb = 1.0 / linear_beta
        return beta * _tanh_fast(a * inv_b, FAST == 2) * _sigmoid(a) * (linear_beta * _tanh_fast(b * inv_lb,
                                                                                                FAST == 2))


# ---------------------------------------------------------------------------------------------- routing
@triton.jit
def _router_partial(x, g, N, E, D, stride_xn, stride_ge, D_SPLIT, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, DESC: tl.constexpr = False):
    """Program (m, e, split)'s tile: (token rows, expert columns, x @ g^T `[BLOCK_M, BLOCK_E]` fp32 summed over its
    D_SPLIT columns of d). DESC (one split, wide tiles): x and g are TMA descriptors with [BLOCK_M | BLOCK_E,
    BLOCK_D] boxes (out-of-range rows and columns read as 0) instead of a pointer per element (a [128, 64] tile's
    64-bit pointers take 64 registers per thread for each operand: the sm_90 build spilled)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    d_lo = tl.program_id(2) * D_SPLIT
    d_hi = tl.minimum(D, d_lo + D_SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    if DESC:
        for d0 in range(d_lo, d_hi, BLOCK_D):
            a = x.load([tl.program_id(0) * BLOCK_M, d0])
            b = g.load([tl.program_id(1) * BLOCK_E, d0])
            acc = tl.dot(a, tl.trans(b), acc=acc, input_precision=DOT_PREC)
    else:
        for d0 in range(d_lo, d_hi, BLOCK_D):
            d_ok = (d0 + offs_d) < d_hi
            a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xn + d0 + offs_d[None, :],
                        mask=(offs_m[:, None] < N) & d_ok[None, :], other=0.0)
            b = tl.load(g + offs_e[:, None].to(tl.int64) * stride_ge + d0 + offs_d[None, :],
                        mask=(offs_e[:, None] < E) & d_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc=acc, input_precision=DOT_PREC)
    return offs_m, offs_e, acc


@triton.jit
def moe_router_fwd_kernel(x, g, s, N, E, D, stride_xn, stride_ge, D_SPLIT,
                          BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                          SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr, DESC: tl.constexpr = False,
                          PDL: tl.constexpr = False):
    """s `[N, E]` fp32 = sigmoid(x `[N, D]` @ g `[E, D]`^T); 16-bit products are exact in the fp32 sum.
    Split over D (grid axis 2, D_SPLIT columns each, few tokens: more programs): the raw partial sums go to
    s `[splits, N, E]` and the top-k kernel adds them in split order. PDL: `launch.pdl_wait` first."""
    pdl_wait(PDL)
    offs_m, offs_e, acc = _router_partial(x, g, N, E, D, stride_xn, stride_ge, D_SPLIT, BLOCK_M, BLOCK_E, BLOCK_D,
                                          DOT_PREC, DESC)
    if SIGMOID:
        acc = _sigmoid(acc)
    tl.store(s + tl.program_id(2).to(tl.int64) * N * E + offs_m[:, None].to(tl.int64) * E + offs_e[None, :], acc,
             mask=(offs_m[:, None] < N) & (offs_e[None, :] < E))


@triton.jit
def _topk_store(sc, bias, ids, w, n, E, scaling, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                RENORM: tl.constexpr, PACKED: tl.constexpr):
    """Token n's selection from its scores sc `[BLOCK_E]` fp32: ids[n] = the K largest sc + bias (ties -> lowest
    id), w[n] = their unbiased sc (renormalised) * scaling (`moe_topk_fwd_kernel`, and the fused router's last
    program)."""
    top, wt = _topk(sc, bias, E, K, BLOCK_K, BLOCK_E, RENORM, PACKED)
    slots = tl.arange(0, BLOCK_K)
    tl.store(ids + n * K + slots, top, mask=slots < K)
    tl.store(w + n * K + slots, wt * scaling, mask=slots < K)


@triton.jit
def _topk(sc, bias, E, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
          PACKED: tl.constexpr):
    """`_topk_store`'s selection without the stores: (ids `[BLOCK_K]` int32, weights `[BLOCK_K]` fp32 before the
    scaling), slots from K on unused. Also gemm1's own routing (`moe_pair_gemm1_fwd_kernel` ROUTE)."""
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    key = tl.where(ok, sc + tl.load(bias + offs, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], tl.int32)
    wt = tl.zeros([BLOCK_K], tl.float32)
    if PACKED:
        bits = key.to(tl.int32, bitcast=True)
        packed = (tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) << 32) | (BLOCK_E - 1 - offs)
        for j in tl.static_range(K):
            idx = BLOCK_E - 1 - (tl.max(packed, 0) & 0xFFFFFFFF).to(tl.int32)
            top = tl.where(slots == j, idx, top)
            packed = tl.where(offs == idx, tl.full([BLOCK_E], -(2 ** 63), tl.int64), packed)
        hit = (offs[None, :] == top[:, None]) & (slots < K)[:, None]                 # [BLOCK_K, BLOCK_E]
        wt = tl.sum(tl.where(hit, sc[None, :], 0.0), 1)
    else:
        for j in tl.static_range(K):
            best = tl.max(key, 0)
            idx = tl.min(tl.where(key == best, offs, BLOCK_E), 0)
            top = tl.where(slots == j, idx, top)
            wt = tl.where(slots == j, tl.sum(tl.where(offs == idx, sc, 0.0), 0), wt)
            key = tl.where(offs == idx, float("-inf"), key)
    if RENORM:
        wt = wt / (tl.sum(wt, 0) + 1e-20)
    return top, wt


@triton.jit
def moe_topk_fwd_kernel(s, part, bias, ids, w, N, E, scaling, K: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_E: tl.constexpr, RENORM: tl.constexpr, SPLITS: tl.constexpr,
                        PACKED: tl.constexpr, PDL: tl.constexpr = False):
    """One token: the K largest s + bias (ties -> lowest id), weights from the unbiased s.

    SPLITS > 1: s = sigmoid(sum of the router's partial sums `part[SPLITS, N, E]`), stored to s. PACKED: one
    max per round over (order-preserving int of the key) << 32 | (BLOCK_E - 1 - id), weights gathered after
    the K rounds (else three reductions per round). PDL: `launch.pdl_wait` first."""
    pdl_wait(PDL)
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    if SPLITS == 1:
        sc = tl.load(s + n.to(tl.int64) * E + offs, mask=ok, other=0.0)
    else:
        acc = tl.zeros([BLOCK_E], tl.float32)
        for sp in tl.static_range(SPLITS):
            acc += tl.load(part + (sp * N + n).to(tl.int64) * E + offs, mask=ok, other=0.0)
        sc = _sigmoid(acc)
        tl.store(s + n.to(tl.int64) * E + offs, sc, mask=ok)
    _topk_store(sc, bias, ids, w, n, E, scaling, K, BLOCK_K, BLOCK_E, RENORM, PACKED)


@triton.jit
def moe_router_topk_fwd_kernel(x, g, bias, part, s, ids, w, tickets, N, E, D, stride_xn, stride_ge, D_SPLIT, scaling,
                               K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                               BLOCK_D: tl.constexpr, E_PAD: tl.constexpr, SPLITS: tl.constexpr,
                               RENORM: tl.constexpr, PACKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """The split router and the top-k in one launch (few tokens). Each program stores its raw partial sums to part
    `[SPLITS, N, E]` (as `moe_router_fwd_kernel`) and takes a ticket on tickets[m] (its token tile); the program
    that draws the last ticket (all partials of the tile stored) runs `moe_topk_fwd_kernel`'s SPLITS > 1 body
    for each token of the tile (same split order and fp32 arithmetic: the same s, ids and w) and puts
    tickets[m] back to 0. Partials of other programs are read through L2 (.cg), after the acq_rel ticket."""
    scaling = tl.cast(scaling, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    offs_m, offs_e, acc = _router_partial(x, g, N, E, D, stride_xn, stride_ge, D_SPLIT, BLOCK_M, BLOCK_E, BLOCK_D,
                                          DOT_PREC)
    tl.store(part + tl.program_id(2).to(tl.int64) * N * E + offs_m[:, None].to(tl.int64) * E + offs_e[None, :], acc,
             mask=(offs_m[:, None] < N) & (offs_e[None, :] < E))
    tl.debug_barrier()                                  # every thread's partials stored before the release
    ticket = tl.atomic_add(tickets + tl.program_id(0), 1, sem="acq_rel")
    if ticket == tl.num_programs(1) * tl.num_programs(2) - 1:
        tl.debug_barrier()
        offs = tl.arange(0, E_PAD)
        ok = offs < E
        for i in range(BLOCK_M):                        # the tile's tokens
            n = tl.program_id(0) * BLOCK_M + i
            if n < N:
                acc_n = tl.zeros([E_PAD], tl.float32)
                for sp in tl.static_range(SPLITS):
                    acc_n += tl.load(part + (sp * N + n).to(tl.int64) * E + offs, mask=ok, other=0.0,
                                     cache_modifier=".cg")
                sc = _sigmoid(acc_n)
                tl.store(s + n.to(tl.int64) * E + offs, sc, mask=ok)
                _topk_store(sc, bias, ids, w, n, E, scaling, K, BLOCK_K, E_PAD, RENORM, PACKED)
        tl.store(tickets + tl.program_id(0), 0)


ROUTE_SPLIT_MAX_N = 64          # lean routing splits the router over D up to this many tokens

ROUTE_WIDE_MIN_N = 1024         # wide router tiles (MoeTiles.wide_route) from this many tokens


def route_fwd(x, gate_weight, bias, top_k: int, renormalize: bool, scaling: float, lean: bool = False,
              fused: bool = False, wide: bool = False, defer: bool = False):
    """x `[N, d]` -> (ids `[N, k]` int32, w `[N, k]` fp32, s `[N, E]` fp32). lean: the router split over d into
    8 parts for N <= ROUTE_SPLIT_MAX_N (few tokens: 8x the programs) and the packed top-k. fused (with a split
    router): the top-k in the router's launch (`moe_router_topk_fwd_kernel`: one launch, the same results).
    wide: 128 x 128 router tiles on 8 warps from ROUTE_WIDE_MIN_N tokens (prefill; else 64 x 64 on 4).
    defer (with a split router): no top-k launch; returns (ids, w, s, route) with ids / w / s not yet written and
    route the arguments with which `pairs_fwd` has gemm1 select and write them (`moe_pair_gemm1_fwd_kernel`
    ROUTE); None for route when the router is not split (then the top-k ran as usual)."""
    N, D = x.shape
    E = gate_weight.shape[0]
    if x.dtype != gate_weight.dtype:
        x, gate_weight = x.float(), gate_weight.float()
    x, gate_weight = x.contiguous(), gate_weight.contiguous()
    s = torch.empty(N, E, device=x.device, dtype=torch.float32)
    wide = wide and size_bound(N) >= ROUTE_WIDE_MIN_N and x.dtype != torch.float32
    block_m = 16 if size_bound(N) <= 16 else 128 if wide else 64      # size_bound: a traced N takes its largest value
    block_e = 16 if size_bound(N) <= 16 else 128 if wide else 64
    block_d = 64 if wide else 128 if x.dtype != torch.float32 else 32
    splits = 8 if lean and size_bound(N) <= ROUTE_SPLIT_MAX_N else 1
    part = torch.empty(splits, N, E, device=x.device, dtype=torch.float32) if splits > 1 else s
    ids = torch.empty(N, top_k, device=x.device, dtype=torch.int32)
    w = torch.empty(N, top_k, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, block_m), triton.cdiv(E, block_e), splits)
    d_split = triton.cdiv(D, splits * block_d) * block_d
    topk = dict(K=top_k, BLOCK_K=pow2(top_k, 2), RENORM=bool(renormalize and top_k > 1), PACKED=lean)
    gemm1_selects = defer and splits > 1
    if fused and splits > 1 and not gemm1_selects:
        launch(moe_router_topk_fwd_kernel)[grid](
            x, gate_weight, bias.contiguous(), part, s, ids, w, tickets(x, grid[0]), N, E, D, x.stride(0),
            gate_weight.stride(0), d_split, scaling, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_D=block_d,
            E_PAD=pow2(E), SPLITS=splits, DOT_PREC=dot_precision(x.dtype), num_warps=4,
            num_stages=3 if x.dtype != torch.float32 else 1, **topk)
        return ids, w, s
    xa, ga, desc = x, gate_weight, {}
    if wide and splits == 1 and _tma_rows_ok(x, gate_weight):
        xa, ga, desc = _desc(x, [block_m, block_d]), _desc(gate_weight, [block_e, block_d]), dict(DESC=True)
    launch(moe_router_fwd_kernel)[grid](
        xa, ga, part, N, E, D, x.stride(0), gate_weight.stride(0), d_split,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_D=block_d, SIGMOID=splits == 1, DOT_PREC=dot_precision(x.dtype),
        num_warps=8 if wide else 4, num_stages=3 if x.dtype != torch.float32 else 1, **desc, **pdl_args(x, moe=True))
    if gemm1_selects:
        route = dict(part=part, bias=bias.contiguous(), s=s, wt=w, N=N, E=E, scaling=scaling, ROUTE=True,
                     SPLITS=splits, BLOCK_E=pow2(E), BLOCK_TK=topk["BLOCK_K"], RENORM=topk["RENORM"],
                     PACKED=topk["PACKED"])
        return ids, w, s, route
    launch(moe_topk_fwd_kernel)[(N,)](s, part, bias.contiguous(), ids, w, N, E, scaling, BLOCK_E=pow2(E),
                                      SPLITS=splits, num_warps=4, **topk, **pdl_args(x, moe=True))
    return (ids, w, s, None) if defer else (ids, w, s)


# ---------------------------------------------------------------------------------------------- row plan
# The GEMMs below read a "row plan": the N*k (token, slot) pairs sorted by expert (stable) and cut into blocks of
# BM rows of one expert: row_pair `[MB * BM]` int32, the pair of each row of each block (-1: a padding row; the
# valid rows are a prefix of each block), and block_expert `[MB]` (-1: an unused block), with the static bound
# MB = ceil(N k / BM) + min(E, N k): each hit expert wastes at most one partial block.
ALIGN_FUSED_MAX = 4096          # pairs up to which the one-program align kernel runs (one launch, not ~20)


@triton.jit
def moe_align_fwd_kernel(ids, row_pair, block_expert, off, P, E, MB,
                         BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
                         MB_PAD: tl.constexpr, FILL: tl.constexpr):
    """One program: histogram of the P expert ids, prefix sums, block table, stable sort by (expert, pair).

    Row of the i-th pair in expert order: i + off[e_i], off[e] = first_block[e] * BM - first_pair[e]."""
    offs_p = tl.arange(0, P_PAD)
    e_of = tl.load(ids + offs_p, mask=offs_p < P, other=E)             # padding pairs -> sentinel expert E
    offs_e = tl.arange(0, E_PAD)
    cnt = tl.where(offs_e < E, tl.histogram(e_of, E_PAD), 0)           # [E_PAD] pairs per expert
    blk = (cnt + BLOCK_M - 1) // BLOCK_M
    bend = tl.cumsum(blk, 0)                                           # blocks end (exclusive), <= MB < MB_PAD
    pend = tl.cumsum(cnt, 0)
    tl.store(off + offs_e, (bend - blk) * BLOCK_M - (pend - cnt), mask=offs_e < E)
    offs_b = tl.arange(0, MB_PAD)
    eb = tl.cumsum(tl.histogram(bend, MB_PAD), 0)                      # expert of block b = #{e: bend[e] <= b}
    tl.store(block_expert + offs_b, tl.where(eb < E, eb, -1), mask=offs_b < MB)
    offs_f = tl.arange(0, FILL)
    for q0 in range(0, MB * BLOCK_M, FILL):
        tl.store(row_pair + q0 + offs_f, tl.full([FILL], -1, tl.int32), mask=q0 + offs_f < MB * BLOCK_M)
    key = tl.sort(e_of * P_PAD + offs_p)                               # expert-major, stable in the pair id
    tl.debug_barrier()                                                 # off[] and the -1 fill are visible
    e_s = key // P_PAD
    ok = e_s < E
    dst = offs_p + tl.load(off + e_s, mask=ok, other=0)
    tl.store(row_pair + dst, key % P_PAD, mask=ok)


@triton.jit
def moe_count_fwd_kernel(ids, cnt, rank, P, BLOCK: tl.constexpr):
    """Pairs [p0, p0 + BLOCK): cnt[e] += 1 for each (atomics); rank[p] = the count before, the pair's place among
    its expert's pairs (in arrival order, not pair order: rows of one expert are independent, so the GEMMs' results
    do not depend on it)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < P
    e = tl.load(ids + offs, mask=ok, other=0)
    tl.store(rank + offs, tl.atomic_add(cnt + e, tl.full([BLOCK], 1, tl.int32), mask=ok), mask=ok)


@triton.jit
def moe_scan_fwd_kernel(cnt, start, block_expert, E, MB, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                        MB_PAD: tl.constexpr):
    """One program: start[e] = first row of expert e's first block; the block table (as `moe_align_fwd_kernel`)."""
    offs_e = tl.arange(0, E_PAD)
    blk = (tl.load(cnt + offs_e, mask=offs_e < E, other=0) + BLOCK_M - 1) // BLOCK_M
    bend = tl.cumsum(blk, 0)                                           # blocks end (exclusive), <= MB < MB_PAD
    tl.store(start + offs_e, (bend - blk) * BLOCK_M, mask=offs_e < E)
    offs_b = tl.arange(0, MB_PAD)
    eb = tl.cumsum(tl.histogram(bend, MB_PAD), 0)                      # expert of block b = #{e: bend[e] <= b}
    tl.store(block_expert + offs_b, tl.where(eb < E, eb, -1), mask=offs_b < MB)


@triton.jit
def moe_scatter_fwd_kernel(ids, rank, start, row_pair, P, BLOCK: tl.constexpr):
    """row_pair[start[e_p] + rank[p]] = p for the pairs [p0, p0 + BLOCK)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < P
    e = tl.load(ids + offs, mask=ok, other=0)
    dst = tl.load(start + e, mask=ok, other=0) + tl.load(rank + offs, mask=ok, other=0)
    tl.store(row_pair + dst, offs, mask=ok)


# The chunked align: the stable row plan of any number of pairs in three launches, with no atomics, no zeroed
# buffer and no fill before the scatter (so each launch is one AOT plugin: `trt.chain_steps`' prefill chain).
ALIGN_CHUNK = 1024              # pairs per program of the chunked align's first and last launches


@triton.jit
def moe_chunk_count_fwd_kernel(ids, P, E, hist, rank, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Chunk c, the pairs [c CHUNK, (c + 1) CHUNK): hist[c, e] = how many of them go to expert e; rank[p] = how many
    pairs of the chunk before p go to p's expert (a stable sort of the chunk by (expert, pair))."""
    c = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    p = c * CHUNK + offs
    e_of = tl.load(ids + p, mask=p < P, other=E)                       # past P: the sentinel expert E
    cnt = tl.histogram(e_of, E_PAD)
    offs_e = tl.arange(0, E_PAD)
    tl.store(hist + c * E + offs_e, cnt, mask=offs_e < E)
    key = tl.sort(e_of * CHUNK + offs)                                 # expert-major, stable in the pair
    e_s = key // CHUNK
    first = tl.gather(tl.cumsum(cnt, 0) - cnt, e_s, 0)                 # sorted place of the expert's first pair
    tl.store(rank + c * CHUNK + key % CHUNK, offs - first, mask=e_s < E)


@triton.jit
def moe_chunk_plan_fwd_kernel(hist, NC, E, MB, base, block_expert, end, BLOCK_M: tl.constexpr,
                              E_PAD: tl.constexpr, MB_PAD: tl.constexpr):
    """One program over the NC chunks' histograms: the block table (as `moe_align_fwd_kernel`); base[c, e] = the
    row of chunk c's first pair of expert e (its expert's first row plus the pairs of earlier chunks); end[e] =
    the row after expert e's last pair."""
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    cnt = tl.zeros([E_PAD], tl.int32)
    for c in range(NC):
        cnt += tl.load(hist + c * E + offs_e, mask=e_ok, other=0)
    blk = (cnt + BLOCK_M - 1) // BLOCK_M
    bend = tl.cumsum(blk, 0)                                           # blocks end (exclusive), <= MB < MB_PAD
    row = (bend - blk) * BLOCK_M
    tl.store(end + offs_e, row + cnt, mask=e_ok)
    offs_b = tl.arange(0, MB_PAD)
    eb = tl.cumsum(tl.histogram(bend, MB_PAD), 0)                      # expert of block b = #{e: bend[e] <= b}
    tl.store(block_expert + offs_b, tl.where(eb < E, eb, -1), mask=offs_b < MB)
    for c in range(NC):
        tl.store(base + c * E + offs_e, row, mask=e_ok)
        row += tl.load(hist + c * E + offs_e, mask=e_ok, other=0)


@triton.jit
def moe_chunk_scatter_fwd_kernel(ids, rank, base, block_expert, end, P, E, MB, row_pair, BLOCK_M: tl.constexpr,
                                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The first cdiv(P, BLOCK) programs: row_pair[base[chunk, e_p] + rank[p]] = p. The others: -1 on every row
    that no pair takes (past its expert's end, or in an unused block), BLOCK rows each: disjoint stores, so the
    order of the programs does not matter."""
    pid = tl.program_id(0)
    n_pairs = tl.cdiv(P, BLOCK)
    if pid < n_pairs:
        p = pid * BLOCK + tl.arange(0, BLOCK)
        ok = p < P
        e = tl.load(ids + p, mask=ok, other=0)
        dst = tl.load(base + (p // CHUNK) * E + e, mask=ok, other=0) + tl.load(rank + p, mask=ok, other=0)
        tl.store(row_pair + dst, p, mask=ok)
    else:
        q = (pid - n_pairs) * BLOCK + tl.arange(0, BLOCK)
        ok = q < MB * BLOCK_M
        e = tl.load(block_expert + q // BLOCK_M, mask=ok, other=-1)
        used = q < tl.load(end + tl.maximum(e, 0), mask=ok & (e >= 0), other=0)
        tl.store(row_pair + q, tl.full([BLOCK], -1, tl.int32), mask=ok & ~used)


def chunked_align(flat: torch.Tensor, E: int, block_m: int, row_pair: torch.Tensor, block_expert: torch.Tensor,
                  chunk: int = ALIGN_CHUNK):
    """The chunked align's three launches into row_pair / block_expert (see `align_rows`). chunk: pairs per
    program, a power of two (tests under the interpreter, whose `tl.sort` takes seconds at 1024, pass 64)."""
    P, MB = flat.numel(), block_expert.numel()
    NC = triton.cdiv(P, chunk)
    hist = torch.empty(NC, E, device=flat.device, dtype=torch.int32)
    rank = torch.empty(P, device=flat.device, dtype=torch.int32)
    base = torch.empty(NC, E, device=flat.device, dtype=torch.int32)
    end = torch.empty(E, device=flat.device, dtype=torch.int32)
    launch(moe_chunk_count_fwd_kernel)[(NC,)](flat, P, E, hist, rank, CHUNK=chunk, E_PAD=pow2(E + 1),
                                              num_warps=8)
    launch(moe_chunk_plan_fwd_kernel)[(1,)](hist, NC, E, MB, base, block_expert, end, BLOCK_M=block_m,
                                            E_PAD=pow2(E + 1), MB_PAD=pow2(size_bound(MB) + 1), num_warps=8)
    launch(moe_chunk_scatter_fwd_kernel)[(triton.cdiv(P, chunk) + triton.cdiv(MB * block_m, chunk),)](
        flat, rank, base, block_expert, end, P, E, MB, row_pair, BLOCK_M=block_m, CHUNK=chunk, BLOCK=chunk,
        num_warps=4)


def tiling_plan(ids: torch.Tensor, E: int, cfg: "MoeTiles"):
    """`align_rows` as tiling `cfg` asks for it (its block rows and align kernels)."""
    return align_rows(ids, E, cfg.rows, cfg.fused_align, cfg.many_align, cfg.chunk_align)


def align_rows(ids: torch.Tensor, E: int, block_m: int, fused: bool = True, many: bool = False,
               chunked: int = 0):
    """ids `[N, k]` -> (row_pair `[MB * block_m]` int32, block_expert `[MB]` int32), MB the static bound above
    (block_m need not be a power of two). fused: one Triton program while N k <= ALIGN_FUSED_MAX (stable: rows of
    an expert in pair order); beyond that, chunked (pairs per chunk, a power of two, e.g. ALIGN_CHUNK): Triton
    per-chunk count / one-program plan / scatter, 3 launches, stable; many: Triton count (atomics) / scan /
    scatter, 5 launches, rows of an expert in atomic arrival order; otherwise torch ops (~20 launches, stable).
    No host sync either way."""
    flat = ids.reshape(-1)
    P = flat.numel()
    MB = triton.cdiv(P, block_m) + torch.sym_min(E, P)
    row_pair = torch.empty(MB * block_m, device=ids.device, dtype=torch.int32)
    block_expert = torch.empty(MB, device=ids.device, dtype=torch.int32)
    if fused and size_bound(P) <= ALIGN_FUSED_MAX:
        off = torch.empty(E, device=ids.device, dtype=torch.int32)
        launch(moe_align_fwd_kernel)[(1,)](flat, row_pair, block_expert, off, P, E, MB, BLOCK_M=block_m,
                                           P_PAD=pow2(size_bound(P)), E_PAD=pow2(E + 1),
                                           MB_PAD=pow2(size_bound(MB) + 1), FILL=1024, num_warps=8)
        return row_pair, block_expert
    if chunked:
        chunked_align(flat, E, block_m, row_pair, block_expert, chunked)
        return row_pair, block_expert
    if many:
        cnt = torch.zeros(E, device=ids.device, dtype=torch.int32)
        rank = torch.empty(P, device=ids.device, dtype=torch.int32)
        start = torch.empty(E, device=ids.device, dtype=torch.int32)
        launch(moe_count_fwd_kernel)[(triton.cdiv(P, 1024),)](flat, cnt, rank, P, BLOCK=1024, num_warps=4)
        launch(moe_scan_fwd_kernel)[(1,)](cnt, start, block_expert, E, MB, BLOCK_M=block_m, E_PAD=pow2(E + 1),
                                          MB_PAD=pow2(size_bound(MB) + 1), num_warps=8)
        row_pair.fill_(-1)
        launch(moe_scatter_fwd_kernel)[(triton.cdiv(P, 1024),)](flat, rank, start, row_pair, P, BLOCK=1024,
                                                                num_warps=4)
        return row_pair, block_expert
    flat = flat.long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, device=ids.device, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    bend = torch.cumsum(blocks, 0)
    off = (bend - blocks) * block_m - (torch.cumsum(counts, 0) - counts)
    row_pair.fill_(-1)
    row_pair[torch.arange(P, device=ids.device) + off[flat[order]]] = order.to(torch.int32)
    e = torch.searchsorted(bend, torch.arange(MB, device=ids.device), right=True)
    block_expert.copy_(torch.where(e < E, e, -1))
    return row_pair, block_expert


# ---------------------------------------------------------------------------------------------- experts
@triton.jit
def _plan_rows(row_pair, block_expert, BLOCK_M: tl.constexpr):
    """(used by k3export/fp8_moe_kernels.py) Program pb's expert (-1: an unused block), the pair ids of its
    BLOCK_M rows (0 on padding rows) and their row mask."""
    pb = tl.program_id(0)
    pair = tl.load(row_pair + pb * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(block_expert + pb), tl.maximum(pair, 0), pair >= 0


@triton.jit
def _tile(pid, MB, NT, group_m):
    """Program -> (block, column tile): groups of group_m blocks, columns outer, blocks inner. group_m = 1:
    all column tiles of one block run together (its A rows stay in L2); group_m >= MB: one column tile
    across all blocks (each expert's weight tile is shared by its adjacent blocks through L2)."""
    width = group_m * NT
    first = (pid // width) * group_m
    size = tl.minimum(MB - first, group_m)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _a_tile(desc, ptr, row, k0, ok, k_ok, A_DESC: tl.constexpr):
    """gemm1's A tile at column k0: rows [row, row + rows) through the TMA descriptor (A_DESC), else pointer loads
    (ptr: the rows' pointers at column 0; rows where ok is false and columns past L read as 0)."""
    if A_DESC:
        x = desc.load([row, k0])
    else:
        x = tl.load(ptr + k0, mask=ok[:, None] & k_ok[None, :], other=0.0)
    return x


@triton.jit
def _gemm1_accs(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr):
    """gemm1's fp32 zero accumulators (acc1, acc3 [BLOCK_M, BLOCK_N]; acc1t, acc3t [TAIL, BLOCK_N] for the tail
    rows, aliases of the first two when TAIL = 0). Also used by k3export/fp8_moe_kernels.py."""
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TAIL > 0:
        acc1t = tl.zeros([TAIL, BLOCK_N], tl.float32)
        acc3t = tl.zeros([TAIL, BLOCK_N], tl.float32)
    else:
        acc1t = acc1
        acc3t = acc3
    return acc1, acc3, acc1t, acc3t


@triton.jit
def _gemm1_paired_loop(a, a_tail, w13, a_ptr, at_ptr, m_ok, t_ok, e, pn, row0, L, I, offs_k,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr,
                       USE_TAIL: tl.constexpr, A_DESC: tl.constexpr, DOT_PREC: tl.constexpr):
    """`_gemm1_loop` over gate/up rows interleaved in one tensor (w13 a TMA descriptor over `[E * 2I, L]`, row
    2i = W1[i], row 2i + 1 = W3[i]): one [BLOCK_K, 2 BLOCK_N] weight tile and one dot per K step (N = 2 BLOCK_N,
    A read once from shared memory) instead of two; the accumulator's even / odd columns are the two products."""
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
    if TAIL > 0:
        acc_t = tl.zeros([TAIL, 2 * BLOCK_N], tl.float32)
    else:
        acc_t = acc
    for k0 in range(0, L, BLOCK_K):
        k_ok = (k0 + offs_k) < L
        x = _a_tile(a, a_ptr, row0, k0, m_ok, k_ok, A_DESC)
        b = w13.load([(e * I + pn * BLOCK_N) * 2, k0]).T                                   # [BK, 2 BN]
        acc = tl.dot(x, b, acc=acc, input_precision=DOT_PREC)
        if USE_TAIL:
            xt = _a_tile(a_tail, at_ptr, row0 + BLOCK_M, k0, t_ok, k_ok, A_DESC)
            acc_t = tl.dot(xt, b, acc=acc_t, input_precision=DOT_PREC)
    acc1, acc3 = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    if TAIL > 0:
        acc1t, acc3t = tl.split(tl.reshape(acc_t, [TAIL, BLOCK_N, 2]))
    else:
        acc1t = acc1
        acc3t = acc3
    return acc1, acc3, acc1t, acc3t


@triton.jit
def _gemm1_loop(a, a_tail, w1, w3, a_ptr, at_ptr, m_ok, t_ok, e, pn, row0, L, I, w_off, offs_k, n_ok,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr,
                USE_TAIL: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, DOT_PREC: tl.constexpr,
                PAIRED: tl.constexpr = False):
    """gemm1's loop over L: (z W1_e^T, z W3_e^T) in fp32 for the BLOCK_M rows and, USE_TAIL, the TAIL rows on the
    same weight tiles (else their accumulators stay 0; TAIL = 0: they alias the main ones, unused). PAIRED:
    `_gemm1_paired_loop` (w1 is the interleaved descriptor, w3 unused)."""
    if PAIRED:
        acc1, acc3, acc1t, acc3t = _gemm1_paired_loop(a, a_tail, w1, a_ptr, at_ptr, m_ok, t_ok, e, pn, row0, L, I,
                                                      offs_k, BLOCK_M, BLOCK_N, BLOCK_K, TAIL, USE_TAIL, A_DESC,
                                                      DOT_PREC)
    else:
        acc1, acc3, acc1t, acc3t = _gemm1_accs(BLOCK_M, BLOCK_N, TAIL)
        for k0 in range(0, L, BLOCK_K):
            k_ok = (k0 + offs_k) < L
            x = _a_tile(a, a_ptr, row0, k0, m_ok, k_ok, A_DESC)
            if W_DESC:
                b1 = w1.load([e * I + pn * BLOCK_N, k0]).T
                b3 = w3.load([e * I + pn * BLOCK_N, k0]).T
            else:
                b1 = tl.load(w1 + w_off + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                b3 = tl.load(w3 + w_off + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc1 = tl.dot(x, b1, acc=acc1, input_precision=DOT_PREC)
            acc3 = tl.dot(x, b3, acc=acc3, input_precision=DOT_PREC)
            if USE_TAIL:
                xt = _a_tile(a_tail, at_ptr, row0 + BLOCK_M, k0, t_ok, k_ok, A_DESC)
                acc1t = tl.dot(xt, b1, acc=acc1t, input_precision=DOT_PREC)
                acc3t = tl.dot(xt, b3, acc=acc3t, input_precision=DOT_PREC)
    return acc1, acc3, acc1t, acc3t


@triton.jit
def moe_gemm1_fwd_kernel(a, w1, w3, h, row_pair, block_expert, MB, L, I, stride_an, stride_we, stride_wi,
                         stride_hm, group_m, beta, linear_beta, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_DESC: tl.constexpr,
                         W_DESC: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr = 0, a_tail=None,
                         PAIRED: tl.constexpr = False, FAST_ACT: tl.constexpr = 0):
    """Block pb, columns [n0, n0 + BLOCK_N) of I: h = SiTU_GLU(z_rows W1_e^T, z_rows W3_e^T) -> h.dtype.

    a: z `[N, L]` (rows gathered by token) or, A_DESC, a TMA descriptor over z already in row-plan order
    `[MB * BM, L]`; W_DESC: w1/w3 are TMA descriptors over `[E * I, L]` (a tile past I reads the next expert's
    rows: those columns are computed and not stored). TAIL > 0: a block is BLOCK_M + TAIL rows, the last TAIL in
    a second, smaller dot on the same weight tiles (each weight tile is loaded once for all BLOCK_M + TAIL rows,
    and a block that needs a few rows past BLOCK_M issues TAIL more, not BLOCK_M; a block without tail rows
    skips that dot); with A_DESC their A tiles come through a_tail, a descriptor over the same rows with
    [TAIL, BLOCK_K] boxes. PAIRED (with W_DESC): w1 is one descriptor over gate/up rows interleaved `[E * 2I, L]`
    with [2 BLOCK_N, BLOCK_K] boxes (`paired_gate_up`), w3 is ignored. FAST_ACT: `_situ_glu`'s FAST."""
    beta = tl.cast(beta, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    linear_beta = tl.cast(linear_beta, tl.float32)
    pb, pn = _tile(tl.program_id(0), MB, tl.cdiv(I, BLOCK_N), group_m)
    e = tl.load(block_expert + pb)
    if e < 0:
        return
    row0 = pb * (BLOCK_M + TAIL)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair + offs_m)
    m_ok = pair >= 0
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = a
    if not A_DESC:
        a_ptr = a + (tl.maximum(pair, 0) // TOP_K)[:, None].to(tl.int64) * stride_an + offs_k[None, :]
    at_ptr, t_ok = a_ptr, m_ok                                          # TAIL = 0: unused
    if TAIL > 0:
        offs_t = row0 + BLOCK_M + tl.arange(0, TAIL)
        pair_t = tl.load(row_pair + offs_t)
        t_ok = pair_t >= 0
        if not A_DESC:
            at_ptr = a + (tl.maximum(pair_t, 0) // TOP_K)[:, None].to(tl.int64) * stride_an + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wi + offs_k[:, None]  # [BK, BN]
    if TAIL > 0:
        if tl.load(row_pair + row0 + BLOCK_M) >= 0:                    # tail rows (valid rows are a prefix)
            acc1, acc3, acc1t, acc3t = _gemm1_loop(a, a_tail, w1, w3, a_ptr, at_ptr, m_ok, t_ok, e, pn, row0, L, I,
                                                   w_off, offs_k, n_ok, BLOCK_M, BLOCK_N, BLOCK_K, TAIL, True,
                                                   A_DESC, W_DESC, DOT_PREC, PAIRED)
        else:
            acc1, acc3, acc1t, acc3t = _gemm1_loop(a, a_tail, w1, w3, a_ptr, at_ptr, m_ok, t_ok, e, pn, row0, L, I,
                                                   w_off, offs_k, n_ok, BLOCK_M, BLOCK_N, BLOCK_K, TAIL, False,
                                                   A_DESC, W_DESC, DOT_PREC, PAIRED)
    else:
        acc1, acc3, acc1t, acc3t = _gemm1_loop(a, a_tail, w1, w3, a_ptr, at_ptr, m_ok, t_ok, e, pn, row0, L, I,
                                               w_off, offs_k, n_ok, BLOCK_M, BLOCK_N, BLOCK_K, TAIL, False,
                                               A_DESC, W_DESC, DOT_PREC, PAIRED)
    act = _situ_glu(acc1, acc3, beta, linear_beta, FAST_ACT)
    h_ptr = h + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptr, act.to(h.dtype.element_ty), mask=n_ok[None, :])
    if TAIL > 0:                                                        # no tail rows: act(0) = 0 on padding
        act_t = _situ_glu(acc1t, acc3t, beta, linear_beta, FAST_ACT)
        tl.store(h + offs_t[:, None].to(tl.int64) * stride_hm + offs_n[None, :], act_t.to(h.dtype.element_ty),
                 mask=n_ok[None, :])


@triton.jit
def _gemm2_accs(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr):
    """gemm2's fp32 zero accumulators (acc [BLOCK_M, BLOCK_N], acc_t [TAIL, BLOCK_N], an alias of acc when TAIL =
    0). Also used by k3export/fp8_moe_kernels.py."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if TAIL > 0:
        acc_t = tl.zeros([TAIL, BLOCK_N], tl.float32)
    else:
        acc_t = acc
    return acc, acc_t


@triton.jit
def _gemm2_loop(h, a_tail, w2, a_ptr, at_ptr, w_ptr, e, pn, row0, L, I, offs_k, n_ok, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr, USE_TAIL: tl.constexpr,
                A_DESC: tl.constexpr, W_DESC: tl.constexpr, DOT_PREC: tl.constexpr):
    """gemm2's loop over I: h W2_e^T in fp32 for the BLOCK_M rows and, USE_TAIL, the TAIL rows (as `_gemm1_loop`)."""
    acc, acc_t = _gemm2_accs(BLOCK_M, BLOCK_N, TAIL)
    for k0 in range(0, I, BLOCK_K):
        k_ok = (k0 + offs_k) < I
        if A_DESC:
            x = h.load([row0, k0])
        else:
            x = tl.load(a_ptr + k0, mask=k_ok[None, :], other=0.0)
        if W_DESC:
            b = w2.load([e * L + pn * BLOCK_N, k0]).T
        else:
            b = tl.load(w_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, b, acc=acc, input_precision=DOT_PREC)
        if USE_TAIL:
            if A_DESC:
                xt = a_tail.load([row0 + BLOCK_M, k0])
            else:
                xt = tl.load(at_ptr + k0, mask=k_ok[None, :], other=0.0)
            acc_t = tl.dot(xt, b, acc=acc_t, input_precision=DOT_PREC)
    return acc, acc_t


@triton.jit
def moe_gemm2_fwd_kernel(h, w2, y, row_pair, block_expert, MB, L, I, stride_hm, stride_we, stride_wl, stride_yp,
                         group_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         A_DESC: tl.constexpr, W_DESC: tl.constexpr, DOT_PREC: tl.constexpr,
                         TAIL: tl.constexpr = 0, a_tail=None):
    """Block pb, columns [n0, n0 + BLOCK_N) of L: y[pair] = h_rows W2_e^T in fp32, rows back in pair order.
    A_DESC / W_DESC: h `[MB * BM, I]` / w2 `[E * L, I]` are TMA descriptors. TAIL, a_tail: as in gemm1."""
    pb, pn = _tile(tl.program_id(0), MB, tl.cdiv(L, BLOCK_N), group_m)
    e = tl.load(block_expert + pb)
    if e < 0:
        return
    row0 = pb * (BLOCK_M + TAIL)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair + offs_m)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < L
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = h
    if not A_DESC:
        a_ptr = h + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptr = w2
    if not W_DESC:
        w_ptr = w2 + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wl + offs_k[:, None]
    at_ptr = a_ptr                                                      # TAIL = 0: unused
    if TAIL > 0:
        offs_t = row0 + BLOCK_M + tl.arange(0, TAIL)
        pair_t = tl.load(row_pair + offs_t)
        if not A_DESC:
            at_ptr = h + offs_t[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    if TAIL > 0:
        if tl.load(row_pair + row0 + BLOCK_M) >= 0:                    # tail rows (valid rows are a prefix)
            acc, acc_t = _gemm2_loop(h, a_tail, w2, a_ptr, at_ptr, w_ptr, e, pn, row0, L, I, offs_k, n_ok, BLOCK_M,
                                     BLOCK_N, BLOCK_K, TAIL, True, A_DESC, W_DESC, DOT_PREC)
        else:
            acc, acc_t = _gemm2_loop(h, a_tail, w2, a_ptr, at_ptr, w_ptr, e, pn, row0, L, I, offs_k, n_ok, BLOCK_M,
                                     BLOCK_N, BLOCK_K, TAIL, False, A_DESC, W_DESC, DOT_PREC)
    else:
        acc, acc_t = _gemm2_loop(h, a_tail, w2, a_ptr, at_ptr, w_ptr, e, pn, row0, L, I, offs_k, n_ok, BLOCK_M,
                                 BLOCK_N, BLOCK_K, TAIL, False, A_DESC, W_DESC, DOT_PREC)
    tl.store(y + pair[:, None].to(tl.int64) * stride_yp + offs_n[None, :], acc,
             mask=(pair >= 0)[:, None] & n_ok[None, :])
    if TAIL > 0:
        tl.store(y + pair_t[:, None].to(tl.int64) * stride_yp + offs_n[None, :], acc_t,
                 mask=(pair_t >= 0)[:, None] & n_ok[None, :])


@triton.jit
def moe_gather_fwd_kernel(z, row_pair, block_expert, zp, L, stride_zn, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    """zp[r] = z[token of row r] for BLOCK_R rows (of one block: BLOCK_R divides ROWS) x BLOCK_L columns; padding
    rows get 0, rows of unused blocks are not written (the GEMMs never read them)."""
    r0 = tl.program_id(0) * BLOCK_R
    if tl.load(block_expert + r0 // ROWS) < 0:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    pair = tl.load(row_pair + offs_r)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    x = tl.load(z + (tl.maximum(pair, 0) // TOP_K)[:, None].to(tl.int64) * stride_zn + offs_l[None, :],
                mask=(pair >= 0)[:, None] & l_ok[None, :], other=0.0)
    tl.store(zp + offs_r[:, None].to(tl.int64) * L + offs_l[None, :], x, mask=l_ok[None, :])


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


@triton.jit
def _gemv_rows(x_row, w_rows, n_ok, offs_k, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32: W[n, :] . x over K, with w_rows `[BN, BK]` pointers (K contiguous) and x_row a pointer to
    one row. Accumulates `[BN, BK]` in fp32, reduced once; the next weight tile is loaded before this one is used
    (the pipeliner stages no load that feeds no tl.dot)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    v = tl.load(w_rows, mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k_next = k0 + BLOCK_K + offs_k
        v_next = tl.load(w_rows + k0 + BLOCK_K, mask=n_ok[:, None] & (k_next < K)[None, :], other=0.0)
        xv = tl.load(x_row + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
        acc += v.to(tl.float32) * xv[None, :]
        v = v_next
    return tl.sum(acc, 1)


@triton.jit
def _pair_tile(ids, n_cols, BLOCK_N: tl.constexpr):
    """The "pairs" programs' tile (here and in the FP8 twins): pair p = program 0, its expert ids[p] as int64, and
    columns [n0, n0 + BLOCK_N) of n_cols with their mask, n0 from program 1."""
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, e, offs_n, offs_n < n_cols


@triton.jit
def _pair_route(part, bias, s, ids, wt, N, E, scaling, n_cols, TOP_K: tl.constexpr, SPLITS: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr, RENORM: tl.constexpr, PACKED: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """`_pair_tile` for a gemm1 that routes itself (ROUTE, here and in the FP8 twin): pair p = program 0 selects its
    token's experts from the split router's partials part `[SPLITS, N, E]` as `moe_topk_fwd_kernel` does (same
    order and arithmetic) and takes slot p % TOP_K's; the token's first pair's first column tile stores s, ids and
    wt (scaled). Returns (p, expert as int64, columns [n0, n0 + BLOCK_N) of n_cols, their mask)."""
    p = tl.program_id(0)
    n = p // TOP_K
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    acc_e = tl.zeros([BLOCK_E], tl.float32)
    for sp in tl.static_range(SPLITS):
        acc_e += tl.load(part + (sp * N + n).to(tl.int64) * E + offs_e, mask=e_ok, other=0.0)
    sc = _sigmoid(acc_e)
    top, wtop = _topk(sc, bias, E, TOP_K, BLOCK_TK, BLOCK_E, RENORM, PACKED)
    slots = tl.arange(0, BLOCK_TK)
    e = tl.sum(tl.where(slots == p % TOP_K, top, 0), 0).to(tl.int64)
    if (p % TOP_K == 0) & (tl.program_id(1) == 0):
        tl.store(s + n.to(tl.int64) * E + offs_e, sc, mask=e_ok)
        tl.store(ids + n * TOP_K + slots, top, mask=slots < TOP_K)
        tl.store(wt + n * TOP_K + slots, wtop * tl.cast(scaling, tl.float32), mask=slots < TOP_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, e, offs_n, offs_n < n_cols


@triton.jit
def _ticket_combine(y, wt, u, tickets, p, offs_n, n_ok, stride_y, stride_u, TOP_K: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """After pair p stored its columns offs_n of y `[N k, L]` fp32: a ticket on its (token, column tile) counter;
    the program that draws the last of the TOP_K tickets sums the token's rows, u[n] = sum_j wt[n, j] y[n k + j] in
    fp32 (slot order: `moe_combine_fwd_kernel`'s bits) -> u.dtype, and puts the counter back to 0. Other programs'
    rows are read through L2 (.cg), after the acq_rel ticket (here and in the FP8 twin)."""
    tl.debug_barrier()                                  # every thread's columns stored before the release
    n = p // TOP_K
    counter = tickets + n * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(counter, 1, sem="acq_rel") == TOP_K - 1:
        tl.debug_barrier()
        out = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):
            out += tl.load(wt + n * TOP_K + j) * tl.load(y + (n * TOP_K + j).to(tl.int64) * stride_y + offs_n,
                                                         mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(u + n.to(tl.int64) * stride_u + offs_n, out.to(u.dtype.element_ty), mask=n_ok)
        tl.store(counter, 0)


@triton.jit
def moe_pair_gemm1_fwd_kernel(z, w1, w3, h, ids, L, I, stride_zn, stride_we, stride_wi, stride_h, beta,
                              linear_beta, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PDL: tl.constexpr = False, part=None, bias=None, s=None, wt=None, N=0, E=0,
                              scaling=1.0, ROUTE: tl.constexpr = False, SPLITS: tl.constexpr = 1,
                              BLOCK_E: tl.constexpr = 16, BLOCK_TK: tl.constexpr = 2, RENORM: tl.constexpr = False,
                              PACKED: tl.constexpr = False):
    """Pair p (token p // TOP_K, expert ids[p]), columns [n0, n0 + BLOCK_N) of I: two GEMVs over L,
    h[p] = SiTU_GLU(z W1_e^T, z W3_e^T) -> h.dtype ("pairs" decode: no row plan, no padding rows). PDL: wait
    first.
    ROUTE (`MoeTiles.topk_gemm1`: the top-k launch goes): every program selects its token's experts itself from
    the split router's partial sums part `[SPLITS, N, E]`, as `moe_topk_fwd_kernel` does (same order, same
    arithmetic: the same ids and weights), and takes expert `ids[p]` from that; the token's first pair's first
    column tile stores s, ids and wt (scaled) for gemm2 and the combine."""
    pdl_wait(PDL)
    beta = tl.cast(beta, tl.float32)
    linear_beta = tl.cast(linear_beta, tl.float32)
    if ROUTE:
        p, e, offs_n, n_ok = _pair_route(part, bias, s, ids, wt, N, E, scaling, I, TOP_K, SPLITS, BLOCK_E,
                                         BLOCK_TK, RENORM, PACKED, BLOCK_N)
    else:
        p, e, offs_n, n_ok = _pair_tile(ids, I, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    z_row = z + (p // TOP_K).to(tl.int64) * stride_zn
    w_off = e * stride_we + offs_n[:, None].to(tl.int64) * stride_wi + offs_k[None, :]              # [BN, BK]
    y1 = _gemv_rows(z_row, w1 + w_off, n_ok, offs_k, L, BLOCK_N, BLOCK_K)
    y3 = _gemv_rows(z_row, w3 + w_off, n_ok, offs_k, L, BLOCK_N, BLOCK_K)
    act = beta * _tanh(y1 / beta) * _sigmoid(y1) * (linear_beta * _tanh(y3 / linear_beta))
    tl.store(h + p.to(tl.int64) * stride_h + offs_n, act.to(h.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_pair_gemm2_fwd_kernel(h, w2, y, ids, L, I, stride_h, stride_we, stride_wl, stride_y,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Pair p, columns [n0, n0 + BLOCK_N) of L: y[p] = h[p] W2_{ids[p]}^T in fp32 (one GEMV over I). PDL: wait
    first."""
    pdl_wait(PDL)
    p, e, offs_n, n_ok = _pair_tile(ids, L, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w2 + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wl + offs_k[None, :]
    acc = _gemv_rows(h + p.to(tl.int64) * stride_h, w_rows, n_ok, offs_k, I, BLOCK_N, BLOCK_K)
    tl.store(y + p.to(tl.int64) * stride_y + offs_n, acc, mask=n_ok)


@triton.jit
def moe_pair_gemm2_combine_fwd_kernel(h, w2, ids, wt, y, u, tickets, L, I, stride_h, stride_we, stride_wl, stride_y,
                                      stride_u, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                      PDL: tl.constexpr = False):
    """`moe_pair_gemm2_fwd_kernel` with the combine folded in. Pair p (token n = p // TOP_K), columns
    [n0, n0 + BLOCK_N) of L: y[p] = h[p] W2_{ids[p]}^T in fp32 to the workspace y `[N k, L]`, then a ticket on
    tickets[n * column tiles + tile]; the program that draws the last of the TOP_K tickets sums its token's TOP_K
    rows as `moe_combine_fwd_kernel` does (u[n] = sum_j wt[n, j] y[n k + j] in fp32, slot order: the same bits)
    -> u.dtype and puts the counter back to 0. Other programs' rows are read through L2 (.cg), after the acq_rel
    ticket. PDL: wait first (the counters too are touched only after the predecessor completed)."""
    pdl_wait(PDL)
    p, e, offs_n, n_ok = _pair_tile(ids, L, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w2 + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wl + offs_k[None, :]
    acc = _gemv_rows(h + p.to(tl.int64) * stride_h, w_rows, n_ok, offs_k, I, BLOCK_N, BLOCK_K)
    tl.store(y + p.to(tl.int64) * stride_y + offs_n, acc, mask=n_ok)
    _ticket_combine(y, wt, u, tickets, p, offs_n, n_ok, stride_y, stride_u, TOP_K, BLOCK_N)


# ---------------------------------------------------------------------------------------------- launches
@dataclass(frozen=True)
class MoeTiles:
    """One tiling of the expert GEMMs. gemm1 / gemm2: (BLOCK_N, BLOCK_K, num_warps, num_stages). group_m: see
    `_tile` (a large value = one column tile across all blocks). tma: "" pointer loads; "w": expert weights
    through TMA descriptors; "aw": the A operand too (z gathered into row-plan order first, one extra pass).
    fused_align, many_align, chunk_align: `align_rows(fused=, many=, chunked=)` (Triton kernels, not torch ops, for
    <= / > 4096 pairs; chunk_align: pairs per chunk of the chunked align, 0 = not that one).
    lean_route: `route_fwd(lean=True)`.
    tail: rows of each block past block_m, in a second dot on the same weight tiles (kernel docstring).
    pairs: up to this many tokens, no row plan: one GEMV per (token, expert) pair and weight (`moe_pair_gemm*`,
    pair_gemm = gemm1 / gemm2 (BLOCK_N, BLOCK_K, num_warps)); each pair reads its expert's weights, so it is for
    a few tokens whose pairs rarely share an expert. 0: always the row plan. On the pairs path only: fuse_topk, up
    to this many tokens the top-k in the split router's launch (`route_fwd(fused=True)`; its last program selects
    for the tokens one after another); fuse_combine, the combine in gemm2's launch
    (`moe_pair_gemm2_combine_fwd_kernel`). Both give the unfused path's bits (5 launches -> 3). topk_gemm1
    (pairs path, split router): up to this many tokens, every gemm1 program selects its token's experts from the
    router's partial sums itself (`moe_pair_gemm1_fwd_kernel` ROUTE) instead of a top-k launch before it; the
    same bits (with fuse_combine: 4 launches -> 3, and no program waits on a ticket). y_half (row plan):
    gemm2 stores each pair's expert output in z.dtype, as the reference `moe_sorted` rounds it, instead of fp32
    (half the bytes written by gemm2 and read by the combine, which still sums in fp32). wide_route:
    `route_fwd(wide=True)`. fast_act: the row plan's gemm1 epilogue math (`_situ_glu` FAST; 2 runs as 1 under
    the interpreter, which has no inline PTX)."""
    block_m: int
    gemm1: tuple
    gemm2: tuple
    group_m: int = 1 << 30
    tma: str = ""
    fused_align: bool = True
    lean_route: bool = False
    tail: int = 0
    many_align: bool = False
    pairs: int = 0
    pair_gemm: tuple = ((16, 256, 4), (16, 256, 4))
    fuse_topk: int = 0
    fuse_combine: bool = False
    topk_gemm1: int = 0
    y_half: bool = False
    wide_route: bool = False
    fast_act: int = 0
    chunk_align: int = 0

    @property
    def rows(self) -> int:
        """Rows per block of the row plan."""
        return self.block_m + self.tail


# Tilings per regime, selectable by name (`k3export bench moe` times them all; tests check them all on the GPU).
# "old" is the tiling before the 2026-11-29 sweep; CONFIGS holds the defaults: the fastest measured on the
# H200 (docs/perf.md).
_ALL = 1 << 30
_AW = dict(tma="aw", lean_route=True, many_align=True)       # the 2026-11-30 prefill candidates' common part
_PTR = dict(fused_align=False, chunk_align=ALIGN_CHUNK, lean_route=True, y_half=True, wide_route=True, fast_act=2)
TILINGS = {
    "decode": {"old": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", False),
               "fused-align": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True),
               "fused-lean": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True),
               "fused-lean-tma": MoeTiles(16, (32, 64, 4, 6), (32, 64, 4, 6), _ALL, "w", True, True),
               "pairs": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True, pairs=2),
               "pairs-n8": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True, pairs=2,
                                    pair_gemm=((8, 256, 4), (8, 256, 4))),
               "pairs-k512": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True, pairs=2,
                                      pair_gemm=((16, 512, 4), (16, 512, 4))),
               "pairs-n8-fc": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True, pairs=2,
                                       pair_gemm=((8, 256, 4), (8, 256, 4)), fuse_combine=True),
               "pairs-n8-fused": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True, pairs=2,
                                          pair_gemm=((8, 256, 4), (8, 256, 4)), fuse_topk=2, fuse_combine=True),
               "pairs-n8-fc-g1": MoeTiles(16, (32, 256, 4, 4), (32, 256, 4, 4), _ALL, "", True, True, pairs=2,
                                          pair_gemm=((8, 256, 4), (8, 256, 4)), fuse_combine=True, topk_gemm1=2)},
    # Timed on 2026-11-30 09:19-09:34 and dropped: m128t64-aw with gemm1 in 3 or 5 stages, gemm2 in 5, and y_half
    # without the wide router (no faster, or slower: docs/perf.md).
    "prefill": {"old": MoeTiles(64, (64, 64, 4, 4), (128, 64, 4, 4), _ALL, "", False),
                "m128-tma-aw": MoeTiles(128, (128, 64, 8, 3), (256, 64, 8, 3), 1, "aw", False, True),
                "m128-tma-w": MoeTiles(128, (128, 64, 8, 3), (256, 64, 8, 3), 1, "w", False, True),
                "m128-n64-aw": MoeTiles(128, (64, 64, 8, 4), (128, 64, 8, 4), 1, **_AW),
                "m128t64-aw": MoeTiles(128, (64, 64, 8, 4), (128, 64, 8, 4), 1, **_AW, tail=64),
                "m128t64-aw-k128": MoeTiles(128, (64, 128, 8, 2), (128, 128, 8, 2), 1, **_AW, tail=64),
                "m128t64-aw-y16r": MoeTiles(128, (64, 64, 8, 4), (128, 64, 8, 4), 1, **_AW, tail=64, y_half=True,
                                            wide_route=True),
                "m64t32-n128-aw8-y16r": MoeTiles(64, (128, 64, 8, 3), (256, 64, 8, 3), 1, **_AW, tail=32, y_half=True,
                                                 wide_route=True),
                "m64t32-n128-aw8-y16r-f2": MoeTiles(64, (128, 64, 8, 3), (256, 64, 8, 3), 1, **_AW, tail=32,
                                                    y_half=True, wide_route=True, fast_act=2),
                "m128t64-aw-y16r-f2": MoeTiles(128, (64, 64, 8, 4), (128, 64, 8, 4), 1, **_AW, tail=64, y_half=True,
                                               wide_route=True, fast_act=2),
                "m128-tma-aw-y16r-f2": MoeTiles(128, (128, 64, 8, 3), (256, 64, 8, 3), 1, "aw", False, True,
                                                y_half=True, wide_route=True, fast_act=2),
                "m64t32-aw8": MoeTiles(64, (64, 64, 8, 4), (128, 64, 8, 4), 1, **_AW, tail=32),
                "m64t32-n128-aw8": MoeTiles(64, (128, 64, 8, 3), (256, 64, 8, 3), 1, **_AW, tail=32),
                # The TensorRT prefill chain's tilings (`trt.PREFILL_TILINGS`): pointer loads, the chunked align.
                "ptr-m64": MoeTiles(64, (64, 64, 4, 4), (128, 64, 4, 4), _ALL, **_PTR),
                "ptr-m128t64": MoeTiles(128, (64, 64, 8, 4), (128, 64, 8, 4), 1, tail=64, **_PTR),
                "ptr-m64t32-n128": MoeTiles(64, (128, 64, 8, 3), (256, 64, 8, 3), 1, tail=32, **_PTR)},
}
# Decode at 1-2 tokens, H200 2026-11-30 05:31 (`bench moe --phases decode`, K3 shapes, CUDA-graph replay):
# "pairs-n8" 0.279 / 0.494 ms = 90% / 98% of copy at 1 / 2 tokens (fused-lean 0.297 / 0.523, pairs 0.282 / 0.512,
# pairs-k512 0.289 / 0.523); from 4 tokens on the row plan runs, unchanged. k3-small decode step at B = 1 under
# `compile`: 1.239 -> 1.174 ms with "pairs".
# Measured 2026-11-29 (docs/perf.md): decode 1..64 tokens "fused-lean" (CUDA-graph replay 0.30 ms at 1 token,
# was 0.36; the plain call 0.37, was 0.64). Prefill, H200 2026-11-30 01:50 (`k3export bench moe`, K3 shapes,
# 896 experts top-16, every tiling's output equal to "old"'s): 4096 tokens (73 rows per expert) "m64t32-n128-aw8"
# 18.45 ms (m128-tma-w, the previous default, 21.46); 8192 (146 rows) "m128t64-aw" 26.79 ms = 45% of the
# matmul rate (m128-tma-w 30.46); 16384 (292 rows) "m128-tma-aw" 46.69 ms = 52% (m128t64-aw 46.86). The
# prefill / prefill-mid boundary at 128 rows is where m128t64-aw's 128-row blocks start to fill; the crossover
# between 73 and 146 rows was not measured. Between 16 and 64 rows per expert (~900..3600 tokens) the previous
# prefill tiling stayed until 2026-12-01 (see CONFIGS).
# "pairs-n8-fc" / "pairs-n8-fused": "pairs-n8" with the combine in gemm2's launch / and the top-k in the router's,
# 5 -> 4 / 3 launches at 1-2 tokens, bit-identical (H200 2026-11-30 07:36, tests/test_moe_pairs_fused.py: 15
# passed, incl. 10 calls and 3 graph replays at K3 and k3-small shapes). `bench moe --phases decode` (K3 shapes,
# graph replay), 1 / 2 tokens: pairs-n8 0.278 / 0.505 ms, pairs-n8-fc 0.278 / 0.507, pairs-n8-fused 0.282 / 0.517
# (at K3 size the fused router's single last program, which selects for every token in turn, costs more than the
# launch it saves). The default then "pairs-n8-fc"; K3_MOE_DECODE=<name> picks another decode tiling (read
# by `tiles_for` per call, so at CUDA-graph capture: an A/B switch for a whole model). k3-small decode at B = 1 under
# `compile` on the H200 (2026-11-30 13:36-13:49, `bench model`): "pairs-n8-fused" 0.888 ms with the MoE kernels on
# PDL vs 0.896 without it, 0.899 vs 0.908 under `compile-fast`: within the run-to-run spread, so the default stays.
# "pairs-n8-fc-g1" (the default since 2026-11-30 17:38): "pairs-n8-fc" with the top-k inside gemm1's programs
# (`MoeTiles.topk_gemm1`: 4 launches -> 3 per MoE layer at one token, the same bits; GPU tests 14 passed, 17:36).
# k3-small decode at B = 1 under `compile` (`scripts/ab_decode.py --env K3_MOE_DECODE=...`, 4 interleaved rounds
# of 200 steps): pairs-n8-fc 0.901 ms, pairs-n8-fc-g1 0.896 (faster in 4 of 4 rounds), pairs-n8-fused 0.913. Only
# timed at 64 experts: with more (K3: 896, top-16) every gemm1 program's selection grows (16 rounds over 1024
# scores), so the top-k stays a launch of its own above TOPK_GEMM1_MAX_E experts.
_DECODE = "pairs-n8-fc-g1"
TOPK_GEMM1_MAX_E = 64
# 2026-11-30 09:34 (`bench moe --layout paired`, K3 shapes, 400 ms per timing; docs/perf.md): y_half and the wide
# router ("-y16r") take the combine from 0.63 to 0.24 ms and the route from 0.46 to 0.34 ms at 8192 tokens (gemm2
# 7.52 -> 7.32): 4096 tokens 18.41 -> 17.99 ms (m64t32-n128-aw8), 8192 25.03 -> 24.83 (m128t64-aw), 16384 43.57
# -> 42.31 (m128t64-aw, paired). Those stages do not read w1 / w3, so the separate layout gets them too.
# 09:46 (same command): fast_act=2 ("-f2", gemm1's epilogue tanh as tanh.approx.f32) takes gemm1 at 8192 tokens
# from 16.4 to 14.7 ms: m128t64-aw-y16r-f2 22.58 ms = 52.2% of the 727 TFLOP/s matmul rate (y16r 24.2), 16384
# 39.27 ms = 60.0% (41.76), 4096 m64t32-n128-aw8-y16r-f2 17.80 (17.83); output vs the exact epilogue 4.8e-3..5.3e-3
# (about one bf16 ulp of the largest value), vs moe_sorted 4.98e-3 on the clear rows, the same as the exact path's.
# 2026-11-30 11:3x (`bench moe --phases prefill --layout separate --tokens 16384`, K3 shapes): the separate layout
# at 292 rows per expert, m128-tma-aw 45.43 ms = 53.9%, m128t64-aw-y16r-f2 41.22, m128-tma-aw-y16r-f2 39.88 = 61.4%
# (output vs m128-tma-aw 5.05e-3; cuda test vs moe_sorted 5.08e-3 on the clear rows): the prefill-large default.
# 2026-12-01 01:55 (`bench moe --phases prefill --tokens 1024,2048,3072`, K3 shapes; docs/perf.md): in the grouped
# regime (16..64 rows per expert) "m64t32-aw8" 15.08 / 15.43 / 15.81 ms against "old" 17.83 / 18.85 / 20.29 (the
# regime's tiling since 2026-11-29), m64t32-n128-aw8-y16r-f2 15.24 / 15.56 / 16.05, ptr-m64t32-n128 15.87 / 16.69 /
# 16.67: the grouped default.
CONFIGS = {"decode": TILINGS["decode"][_DECODE], "grouped": TILINGS["prefill"]["m64t32-aw8"],
           "prefill": TILINGS["prefill"]["m64t32-n128-aw8-y16r-f2"],
           "prefill-mid": TILINGS["prefill"]["m128t64-aw-y16r-f2"],
           "prefill-large": TILINGS["prefill"]["m128-tma-aw-y16r-f2"]}
# Gate/up rows paired in one tensor (`interleave_gate_up`; the `compile` backend's layout), H200 2026-11-30 09:19
# (`bench moe --paired`, K3 shapes; stage times summed, gemm1 alone in brackets): every tiling bit-identical to
# its separate-layout run; at 8192 tokens m128t64-aw 25.3 ms (gemm1 17.96 -> 16.30), at 16384 m128t64-aw 43.7 ms
# = 55% of the matmul rate (gemm1 31.9 -> 28.3) while m128-tma-aw gets slower paired (46.5 -> 55.1 ms: its
# N = 256 dot spills), at 4096 m64t32-n128-aw8 18.1 ms (gemm1 12.2 -> 11.8).
PAIRED_CONFIGS = {"prefill-large": TILINGS["prefill"]["m128t64-aw-y16r-f2"]}
# Wide latents (L >= WIDE_L), separate gate/up layout: the "prefill" regime (64..128 rows per expert) on 128-row TMA
# blocks. H200 2026-12-01 02:15 (`bench moe`, K3 shapes, L 3584): 4096 tokens (73 rows) m128-tma-aw-y16r-f2 17.47 ms
# vs m64t32-n128-aw8-y16r-f2 17.87 (01:45, another machine: 16.70 vs 17.15), 6144 (110 rows) 18.86 vs 26.03: the
# 96-row blocks split most experts in two, each re-reading its weights. At k3-small's L 1024 the other way round
# (`scripts/moe_grouped_probe.py`, CUDA-graph replays: 96 rows 0.289 vs 0.187 ms, 125 rows 0.310 vs 0.213), so
# narrow latents keep CONFIGS; the boundary between 1024 and 3584 is not measured.
WIDE_L = 2048
WIDE_CONFIGS = {"prefill": TILINGS["prefill"]["m128-tma-aw-y16r-f2"]}
FP32_TILES = MoeTiles(16, (32, 32, 4, 1), (32, 32, 4, 1))      # exact fp32 dots: small tiles, no pipelining


def pick_regime(n_pairs: int, E: int) -> str:
    """By the average rows per expert r = n_pairs / E: decode below 16, grouped 16..64, prefill 64..128,
    prefill-mid 128..256, prefill-large from 256 (measurements at 73, 146 and 292 rows: see CONFIGS)."""
    r = n_pairs / E
    return ("decode" if r < 16 else "grouped" if r < 64 else "prefill" if r < 128 else "prefill-mid" if r < 256
            else "prefill-large")


def _desc(t: torch.Tensor, block: list):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(t, block)


def _tma_rows_ok(*ts) -> bool:
    """TMA needs a 16-byte aligned base and 16-byte aligned row strides (2-D views below); else pointer loads."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0 for t in ts)


def gather_fwd(z, plan, top_k: int, rows: int):
    """zp `[MB * rows, L]` = z's rows in row-plan order (padding rows 0; rows of unused blocks unwritten)."""
    row_pair, block_expert = plan
    L = z.shape[1]
    zp = torch.empty(row_pair.numel(), L, device=z.device, dtype=z.dtype)
    block_r, block_l = min(32, rows & -rows), min(1024, pow2(L))
    launch(moe_gather_fwd_kernel)[(row_pair.numel() // block_r, triton.cdiv(L, block_l))](
        z, row_pair, block_expert, zp, L, z.stride(0), ROWS=rows, TOP_K=top_k, BLOCK_R=block_r, BLOCK_L=block_l,
        num_warps=8)
    return zp


def paired_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """w13 `[E, 2I, L]` (contiguous) when w1 and w3 `[E, I, L]` are its even and odd rows (`interleave_gate_up`'s
    views), else None. gemm1 then reads one [2 BN, BK] weight tile per step instead of two [BN, BK] ones."""
    if w1.dim() != 3 or w3.shape != w1.shape or w3.dtype != w1.dtype or w3.device != w1.device or \
            is_fake(w1) or is_fake(w3):                               # traced (AOTI lowering): no data pointers
        return None
    E, I, L = w1.shape
    es = w1.element_size()
    if w1.stride() != (2 * I * L, 2 * L, 1) or w3.stride() != w1.stride() or \
            w3.data_ptr() - w1.data_ptr() != L * es or w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr():
        return None
    return w1.as_strided((E, 2 * I, L), (2 * I * L, L, 1))


def interleave_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 `[E, 2I, L]`, its even rows = w1, its odd rows = w3): the paired layout `gemm1_fwd` reads in one
    tile per step. The views index like w1 / w3 (same shapes and values) and share w13's memory."""
    E, I, L = w1.shape
    w13 = torch.stack((w1, w3), dim=2).reshape(E, 2 * I, L)
    return w13, w13[:, 0::2], w13[:, 1::2]


def gemm1_fwd(z, w1, w3, plan, top_k: int, beta: float, linear_beta: float, cfg: MoeTiles):
    """h `[MB * rows, I]` in z.dtype = SiTU_GLU(z W1_e^T, z W3_e^T) for every row of the plan. w1 / w3: contiguous,
    or the paired views of `interleave_gate_up` (with TMA weights: one dot of N = 2 BLOCK_N per step)."""
    row_pair, block_expert = plan
    E, I, L = w1.shape
    MB, bm = block_expert.numel(), cfg.block_m
    bn, bk, warps, stages = cfg.gemm1
    h = torch.empty(MB * cfg.rows, I, device=z.device, dtype=z.dtype)
    if cfg.tma and not _tma_rows_ok(z, w1, w3, h):
        cfg = replace(cfg, tma="")
    a = z
    tail = dict(TAIL=cfg.tail, a_tail=z) if cfg.tail else {}      # no tail: the launch the AOT chain mirrors
    if cfg.tma == "aw":
        zp = gather_fwd(z, plan, top_k, cfg.rows)
        a = _desc(zp, [bm, bk])
        if cfg.tail:
            tail["a_tail"] = _desc(zp, [cfg.tail, bk])
    stride_we, stride_wi = w1.stride(0), w1.stride(1)
    w13 = paired_gate_up(w1, w3) if cfg.tma else None
    if w13 is not None:
        w1 = w3 = _desc(w13.view(E * 2 * I, L), [2 * bn, bk])
        tail["PAIRED"] = True
    elif cfg.tma:
        w1, w3 = _desc(w1.reshape(E * I, L), [bn, bk]), _desc(w3.reshape(E * I, L), [bn, bk])
    launch(moe_gemm1_fwd_kernel)[(MB * triton.cdiv(I, bn),)](
        a, w1, w3, h, row_pair, block_expert, MB, L, I, z.stride(0), stride_we, stride_wi, h.stride(0),
        torch.sym_min(cfg.group_m, MB), beta, linear_beta, TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        A_DESC=cfg.tma == "aw", W_DESC=bool(cfg.tma), DOT_PREC=dot_precision(z.dtype), num_warps=warps,
        num_stages=stages, **tail, **({"FAST_ACT": min(cfg.fast_act, 1 if INTERPRET else 2)} if cfg.fast_act else {}))
    return h


def gemm2_fwd(h, w2, plan, n_pairs: int, cfg: MoeTiles):
    """y `[N k, L]` = h W2_e^T summed in fp32 (stored in fp32, or h.dtype with cfg.y_half), each row at its
    (token, slot) pair."""
    row_pair, block_expert = plan
    E, L, I = w2.shape
    MB, bm = block_expert.numel(), cfg.block_m
    bn, bk, warps, stages = cfg.gemm2
    y = torch.empty(n_pairs, L, device=h.device, dtype=h.dtype if cfg.y_half else torch.float32)
    if cfg.tma and not _tma_rows_ok(h, w2):
        cfg = replace(cfg, tma="")
    a = _desc(h, [bm, bk]) if cfg.tma == "aw" else h
    tail = dict(TAIL=cfg.tail, a_tail=_desc(h, [cfg.tail, bk]) if cfg.tma == "aw" else h) if cfg.tail else {}
    w = _desc(w2.view(E * L, I), [bn, bk]) if cfg.tma else w2
    launch(moe_gemm2_fwd_kernel)[(MB * triton.cdiv(L, bn),)](
        a, w, y, row_pair, block_expert, MB, L, I, h.stride(0), L * I, I, y.stride(0),
        torch.sym_min(cfg.group_m, MB), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, A_DESC=cfg.tma == "aw",
        W_DESC=bool(cfg.tma), DOT_PREC=dot_precision(h.dtype), num_warps=warps, num_stages=stages, **tail)
    return y


def pairs_fwd(z, w1, w3, w2, ids, beta: float, linear_beta: float, cfg: MoeTiles, w=None, route=None):
    """The "pairs" experts: y `[N k, L]` fp32, row p = pair (token p // k, expert ids.flat[p]); no row plan.
    With w (the router weights `[N, k]`, cfg.fuse_combine): u `[N, L]` in z.dtype, the combine done by gemm2's
    last program per (token, column tile) (`moe_pair_gemm2_combine_fwd_kernel`; y is its workspace). route
    (`route_fwd(defer=True)`'s): gemm1 selects the experts itself and writes ids, w and s (they are outputs)."""
    N, top_k = ids.shape
    E, I, L = w1.shape
    P = N * top_k
    ids = ids.reshape(-1)
    h = torch.empty(P, I, device=z.device, dtype=z.dtype)
    y = torch.empty(P, L, device=z.device, dtype=torch.float32)
    (bn1, bk1, warps1), (bn2, bk2, warps2) = cfg.pair_gemm
    # A/B switch, read per launch: both GEMVs' BLOCK_K. k3-small decode at B = 1 on the H200 (2026-11-30 15:44 /
    # 15:49, scripts/ab_decode.py): the default 256 0.914 / 0.917 ms; 1024 0.969 (a one-shot gemm1 loading both
    # weight tiles at once), 512 0.937, 128 0.945, 64 1.002.
    bk_env = int(os.environ.get("K3_MOE_PAIR_BK", "0") or 0)
    if bk_env:
        check(bk_env >= 16 and bk_env & (bk_env - 1) == 0, f"K3_MOE_PAIR_BK={bk_env}: a power of two >= 16")
        bk1 = bk2 = bk_env
    launch(moe_pair_gemm1_fwd_kernel)[(P, triton.cdiv(I, bn1))](
        z, w1, w3, h, ids, L, I, z.stride(0), w1.stride(0), w1.stride(1), h.stride(0), beta, linear_beta, TOP_K=top_k,
        BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps1, **(route or {}), **pdl_args(z, moe=True))
    if w is None:
        launch(moe_pair_gemm2_fwd_kernel)[(P, triton.cdiv(L, bn2))](
            h, w2, y, ids, L, I, h.stride(0), L * I, I, y.stride(0), BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps2,
            **pdl_args(z, moe=True))
        return y
    u = torch.empty(N, L, device=z.device, dtype=z.dtype)
    tiles_n = triton.cdiv(L, bn2)
    launch(moe_pair_gemm2_combine_fwd_kernel)[(P, tiles_n)](
        h, w2, ids, w, y, u, tickets(z, N * tiles_n), L, I, h.stride(0), L * I, I, y.stride(0), u.stride(0),
        TOP_K=top_k, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps2, **pdl_args(z, moe=True))
    return u


def combine_fwd(y, w, dtype):
    """u `[N, L]` = sum_j w[:, j] y[n k + j] in fp32 -> dtype."""
    N, top_k = w.shape
    L = y.shape[1]
    u = torch.empty(N, L, device=y.device, dtype=dtype)
    block_l = min(1024, pow2(L))
    launch(moe_combine_fwd_kernel)[(N, triton.cdiv(L, block_l))](y, w, u, L, TOP_K=top_k, BLOCK_L=block_l, num_warps=4)
    return u


def tiles_for(z, n_pairs: int, E: int, regime: str | None = None, paired: bool = False) -> MoeTiles:
    """The default tiling for this call: `FP32_TILES` for fp32, else CONFIGS by regime (PAIRED_CONFIGS first when
    gate/up rows are paired, WIDE_CONFIGS first when they are not and the latent is at least WIDE_L wide)."""
    if z.dtype == torch.float32:
        return FP32_TILES
    regime = regime or pick_regime(n_pairs, E)
    env = os.environ.get("K3_MOE_DECODE") if regime == "decode" else None      # read per call: an A/B switch
    if env:
        check(env in TILINGS["decode"], f"K3_MOE_DECODE={env!r} is not a decode tiling: "
              f"{', '.join(TILINGS['decode'])}")
        return TILINGS["decode"][env]
    if paired:
        return PAIRED_CONFIGS.get(regime, CONFIGS[regime])
    return WIDE_CONFIGS.get(regime, CONFIGS[regime]) if z.shape[1] >= WIDE_L else CONFIGS[regime]


def moe_routed_fwd(x, z, gate_weight, bias, w1, w3, w2, top_k: int, renormalize: bool, scaling: float,
                   beta: float, linear_beta: float, regime: str | None = None, tiles: MoeTiles | None = None):
    """The op's contract (see op.py): u `[N, L]` in z.dtype, combine in fp32. regime / tiles override the
    tiling (sweeps, tests)."""
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
    if N == 0:
        return torch.empty(z.shape, device=z.device, dtype=z.dtype)
    z, w2 = z.contiguous(), w2.contiguous()                           # no-ops for the usual stacked weights
    paired = paired_gate_up(w1, w3) is not None                       # the paired layout's views stay as they are
    if not paired:
        w1, w3 = w1.contiguous(), w3.contiguous()
    cfg = tiles or tiles_for(z, N * top_k, E, regime, paired)
    pairs = size_bound(N) <= cfg.pairs
    route = None
    if pairs and size_bound(N) <= cfg.topk_gemm1 and E <= TOPK_GEMM1_MAX_E:   # gemm1 selects (router split)
        ids, w, _, route = route_fwd(x, gate_weight, bias, top_k, renormalize, scaling, cfg.lean_route,
                                     wide=cfg.wide_route, defer=True)
    else:
        ids, w, _ = route_fwd(x, gate_weight, bias, top_k, renormalize, scaling, cfg.lean_route,
                              pairs and size_bound(N) <= cfg.fuse_topk, cfg.wide_route)
    if pairs and cfg.fuse_combine:
        return pairs_fwd(z, w1, w3, w2, ids, beta, linear_beta, cfg, w, route)
    if pairs:
        return combine_fwd(pairs_fwd(z, w1, w3, w2, ids, beta, linear_beta, cfg, route=route), w, z.dtype)
    plan = tiling_plan(ids, E, cfg)
    h = gemm1_fwd(z, w1, w3, plan, top_k, beta, linear_beta, cfg)
    y = gemm2_fwd(h, w2, plan, N * top_k, cfg)
    return combine_fwd(y, w, z.dtype)


@moe_routed.register_kernel("cuda")
def _(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta):
    if torch.float64 in (x.dtype, z.dtype, w1.dtype):      # validation runs stay float64: the kernels are fp32
        return moe_routed._init_fn(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta,
                                   linear_beta)
    return moe_routed_fwd(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)
