"""Triton grouped GEMMs for E4M3 routed experts: the CUDA path of `k3::moe_routed_fp8` (no host sync, so decode
CUDA graphs capture it). Two regimes, picked by the number of (token, expert) pairs P (`use_weight_only`):

    route:  the bf16 MoE kernels' fp32 router + top-k (`route_fwd`)             ids, w `[N, k]`
    align:  pairs sorted by expert, blocks of BLOCK_M rows of one expert (`align_rows`: one launch for <= 4096 pairs)
  weight-only (few pairs, decode; z and h stay in z.dtype, z_scale and h_scale unused), scheme "blocks":
    gemm1:  h = SiTU_GLU(z (W1_e s_1)^T, z (W3_e s_3)^T) -> z.dtype           moe_fp8_wo_gemm1_fwd_kernel [blocks*BM, I]
    gemm2:  y = h (W2_e s_2)^T in fp32, rows back in pair order                moe_fp8_wo_gemm2_fwd_kernel [P, L]
  or scheme "pairs" (one token, bf16: no row plan, one GEMV per pair and weight, `fp8_kernels._gemv4`):
    gemm1:  as above, rows in pair order                                  moe_fp8_wo_pair_gemm1_fwd_kernel [P, I]
    gemm2:  as above                                                      moe_fp8_wo_pair_gemm2_fwd_kernel [P, L]
  W8A8 (many pairs, prefill; `moe_fp8_w8a8`, tiling `Fp8Tiles` by rows per expert, `fp8_prefill_tiles`):
    quant:  zq = E4M3(z / s_z)                                                     fp8_quant_fwd_kernel [N, L]
    pointer tilings (below 64 rows per expert, and at latents under 2048):
    gemm1:  h = q(SiTU_GLU(z W1_e^T, z W3_e^T) / s_h)   E4M3 x E4M3 -> E4M3   moe_fp8_gemm1_fwd_kernel [P, I]
    gemm2:  y = (h s_h) (W2_e s_2)^T, rows back in pair order                 moe_fp8_gemm2_fwd_kernel [P, L]
    TMA tilings (K3's latent from 64 rows per expert: 1.5-1.7x the bf16 kernels on the H200):
    gather: zq rows into row-plan order (padding rows 0)                            moe_gather_fwd_kernel
    gemm1:  as above, blocks of block_m + tail rows, h in row-plan order    moe_fp8_tma_gemm1_fwd_kernel [rows, I]
    gemm2:  as above, every operand through TMA descriptors                   moe_fp8_tma_gemm2_fwd_kernel [P, L]
    combine u[n] = sum_j w[n, j] y[n*k + j] in fp32 (the bf16 kernels' `moe_combine_fwd_kernel`)

Each hit expert's E4M3 weight tiles stream once per block, at half the bytes of bf16. The weight-only kernels are
the bf16 decode kernels (same 16-row blocks and tiles) with E4M3 weight tiles widened in registers (exact) and
the per-channel scales applied to the fp32 accumulators; they compute `k3export.fp8_moe.moe_fp8_wo_ref` (under
the interpreter, whose 16-bit `tl.dot` is wrong, with both operands widened to fp32: the same exact products). At
one token every pair has its own expert, so the "pairs" kernels read each hit expert once without the row plan's
launch or its 16-row blocks (15 of 16 rows padding at one token), as exact FMA GEMVs (`ExpertWo` names the
schemes, `EXPERT_WO` is the default). The
W8A8 kernels follow `k3export.fp8_moe.moe_fp8_sorted` step by step (z quantized with s_z; the GEMM output
rounded to z.dtype before SiTU-GLU; h rounded to z.dtype, then quantized with s_h; y rounded to z.dtype). Under
the CPU interpreter their E4M3 tiles are widened to fp32 before `tl.dot` (same exact products) and gemm1 writes
h / s_h in fp32 for torch to round to E4M3 (the interpreter's own E4M3 conversion is wrong at binade carries; see
`fp8_kernels`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from k3export.fp8 import WEIGHT_ONLY_OK, weight_only_unavailable
from k3export.fp8_kernels import INTERPRET, WoTiles, _gemv4, fp8_quant_fwd
from k3export.plugins.moe.kernels import (TOPK_GEMM1_MAX_E, _desc, _gemm1_accs, _gemm2_accs, _pair_route, _pair_tile,
                                         _plan_rows, _sigmoid, _situ_glu, _tanh, _ticket_combine, _tile,
                                         _tma_rows_ok, align_rows, gather_fwd, moe_combine_fwd_kernel)
from k3export.plugins.moe.naive import route
from k3export.plugins.triton_common import dot_precision, pow2, tickets

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _w13_scales(s13, e, stride_se, I, offs_n, n_ok, PER_CHANNEL: tl.constexpr):
    """Expert e's weight scales of w1 and w3 for output columns offs_n: `[1, BN]` per channel, else scalars."""
    if PER_CHANNEL:
        s1 = tl.load(s13 + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
        s3 = tl.load(s13 + e * stride_se + I + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        s1 = tl.load(s13 + e)
        s3 = s1
    return s1, s3


@triton.jit
def moe_fp8_gemm1_fwd_kernel(z, z_scale, w13, s13, h, h_scale, row_pair, block_expert, I, L,
                             stride_z, stride_we, stride_wn, stride_se, stride_h, beta, linear_beta,
                             TOP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, FP8_DOT: tl.constexpr,
                             ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Block of one expert e, columns [n0, n0 + BLOCK_N) of I: h[pair] = E4M3 of SiTU_GLU(y1, y3) / s_h."""
    e, pair, m_ok = _plan_rows(row_pair, block_expert, BLOCK_M)
    if e < 0:
        return
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = z + token[:, None].to(tl.int64) * stride_z + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]   # [BK, BN]
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, L, BLOCK_K):
        k_ok = (k0 + offs_k) < L
        a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b1 = tl.load(w13 + w_off + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b3 = tl.load(w13 + w_off + I * stride_wn + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_DOT:
            acc1 = tl.dot(a, b1, acc=acc1)
            acc3 = tl.dot(a, b3, acc=acc3)
        else:
            acc1 = tl.dot(a.to(tl.float32), b1.to(tl.float32), acc=acc1)
            acc3 = tl.dot(a.to(tl.float32), b3.to(tl.float32), acc=acc3)
    s1, s3 = _w13_scales(s13, e, stride_se, I, offs_n, n_ok, PER_CHANNEL)
    zs = tl.load(z_scale)
    y1 = (acc1 * zs * s1).to(ROUND).to(tl.float32)
    y3 = (acc3 * zs * s3).to(ROUND).to(tl.float32)
    act = beta * _tanh(y1 / beta) * tl.sigmoid(y1) * (linear_beta * _tanh(y3 / linear_beta))
    act = act.to(ROUND).to(tl.float32)
    hq = tl.clamp(tl.math.div_rn(act, tl.load(h_scale)), -448.0, 448.0)
    tl.store(h + pair[:, None].to(tl.int64) * stride_h + offs_n[None, :], hq.to(h.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])                # E4M3 (fp32 under the interpreter)


@triton.jit
def moe_fp8_gemm2_fwd_kernel(h, h_scale, w2, s2, y, row_pair, block_expert, L, I,
                             stride_h, stride_we, stride_wn, stride_se, stride_y,
                             PER_CHANNEL: tl.constexpr, FP8_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block of one expert e, columns [n0, n0 + BLOCK_N) of L: y[pair] = (h[pair] s_h) (W2_e s_2)^T -> y.dtype."""
    e, pair, m_ok = _plan_rows(row_pair, block_expert, BLOCK_M)
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < L
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = h + pair[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    b_ptr = w2 + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = (k0 + offs_k) < I
        a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_DOT:
            acc = tl.dot(a, b, acc=acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc)
    if PER_CHANNEL:
        s = tl.load(s2 + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        s = tl.load(s2 + e)
    out = acc * tl.load(h_scale) * s
    tl.store(y + pair[:, None].to(tl.int64) * stride_y + offs_n[None, :], out.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_dot(a, b, acc, FP8_DOT: tl.constexpr):
    """acc + a b with E4M3 operands: on the tensor cores, or (interpreter) both widened to fp32 (the same exact
    products: the interpreter's 8-bit dot is not)."""
    if FP8_DOT:
        return tl.dot(a, b, acc=acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")


@triton.jit
def _fp8_tma_gemm1_loop(a, a_tail, w13, row0, w_row, I, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, TAIL: tl.constexpr, USE_TAIL: tl.constexpr, FP8_DOT: tl.constexpr):
    """gemm1's K loop through TMA descriptors: (z W1_e^T, z W3_e^T) of the BLOCK_M rows and, USE_TAIL, the TAIL
    rows, on one pair of [BLOCK_N, BLOCK_K] weight tiles per step (w1 rows at w_row, w3 rows at w_row + I)."""
    acc1, acc3, acc1t, acc3t = _gemm1_accs(BLOCK_M, BLOCK_N, TAIL)
    for k0 in range(0, L, BLOCK_K):
        x = a.load([row0, k0])
        b1 = w13.load([w_row, k0]).T
        b3 = w13.load([w_row + I, k0]).T
        acc1 = _fp8_dot(x, b1, acc1, FP8_DOT)
        acc3 = _fp8_dot(x, b3, acc3, FP8_DOT)
        if USE_TAIL:
            xt = a_tail.load([row0 + BLOCK_M, k0])
            acc1t = _fp8_dot(xt, b1, acc1t, FP8_DOT)
            acc3t = _fp8_dot(xt, b3, acc3t, FP8_DOT)
    return acc1, acc3, acc1t, acc3t


@triton.jit
def _fp8_tma_block(block_expert, MB, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr):
    """This program's (expert (-1: an unused block), first row, first output column) in the TMA kernels: blocks of
    BLOCK_M + TAIL rows, all column tiles of a block together."""
    pb, pn = _tile(tl.program_id(0), MB, tl.cdiv(N, BLOCK_N), 1)
    return tl.load(block_expert + pb), pb * (BLOCK_M + TAIL), pn * BLOCK_N


@triton.jit
def _fp8_glu_quant(acc1, acc3, zs, s1, s3, hs, beta, linear_beta, ROUND: tl.constexpr, FAST_ACT: tl.constexpr):
    """The W8A8 gemm1 epilogue of `moe_fp8_sorted`: y1, y3 scaled and rounded to z.dtype, SiTU-GLU rounded to
    z.dtype, then h / s_h clamped to the E4M3 range (fp32; the caller converts)."""
    y1 = (acc1 * zs * s1).to(ROUND).to(tl.float32)
    y3 = (acc3 * zs * s3).to(ROUND).to(tl.float32)
    act = _situ_glu(y1, y3, beta, linear_beta, FAST_ACT).to(ROUND).to(tl.float32)
    return tl.clamp(tl.math.div_rn(act, hs), -448.0, 448.0)


@triton.jit
def moe_fp8_tma_gemm1_fwd_kernel(a, a_tail, w13, s13, h, z_scale, h_scale, row_pair, block_expert, MB, I, L,
                                 stride_se, stride_h, beta, linear_beta, PER_CHANNEL: tl.constexpr,
                                 FP8_DOT: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr,
                                 FAST_ACT: tl.constexpr):
    """Block pb of BLOCK_M + TAIL rows (one expert e), columns [n0, n0 + BLOCK_N) of I: h[row] = E4M3 of
    SiTU_GLU(y1, y3) / s_h, rows in row-plan order (gemm2 reads them through a TMA descriptor).

    a / a_tail: TMA descriptors over E4M3(z / s_z) gathered into row-plan order `[MB * (BM + TAIL), L]` ([BLOCK_M,
    BLOCK_K] / [TAIL, BLOCK_K] boxes); w13: a descriptor over the bank `[E * 2I, L]` ([BLOCK_N, BLOCK_K] boxes; a
    tile past I reads w3's or the next expert's rows: computed, never stored). Blocks whose tail rows are all
    padding skip the tail dots (valid rows are a prefix of a block)."""
    beta = tl.cast(beta, tl.float32)
    linear_beta = tl.cast(linear_beta, tl.float32)
    e, row0, n0 = _fp8_tma_block(block_expert, MB, I, BLOCK_M, BLOCK_N, TAIL)
    if e < 0:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_row = e * 2 * I + n0
    use_tail = False
    if TAIL > 0:
        use_tail = tl.load(row_pair + row0 + BLOCK_M) >= 0
    if use_tail:
        acc1, acc3, acc1t, acc3t = _fp8_tma_gemm1_loop(a, a_tail, w13, row0, w_row, I, L, BLOCK_M, BLOCK_N,
                                                       BLOCK_K, TAIL, True, FP8_DOT)
    else:
        acc1, acc3, acc1t, acc3t = _fp8_tma_gemm1_loop(a, a_tail, w13, row0, w_row, I, L, BLOCK_M, BLOCK_N,
                                                       BLOCK_K, TAIL, False, FP8_DOT)
    s1, s3 = _w13_scales(s13, e, stride_se, I, offs_n, n_ok, PER_CHANNEL)
    zs, hs = tl.load(z_scale), tl.load(h_scale)
    hq = _fp8_glu_quant(acc1, acc3, zs, s1, s3, hs, beta, linear_beta, ROUND, FAST_ACT)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    tl.store(h + offs_m[:, None].to(tl.int64) * stride_h + offs_n[None, :], hq.to(h.dtype.element_ty),
             mask=n_ok[None, :])                                # E4M3 (fp32 under the interpreter)
    if TAIL > 0:                                                # all-padding tail rows: gemm2 stores none of them
        if use_tail:
            hqt = _fp8_glu_quant(acc1t, acc3t, zs, s1, s3, hs, beta, linear_beta, ROUND, FAST_ACT)
            offs_t = row0 + BLOCK_M + tl.arange(0, TAIL)
            tl.store(h + offs_t[:, None].to(tl.int64) * stride_h + offs_n[None, :], hqt.to(h.dtype.element_ty),
                     mask=n_ok[None, :])


@triton.jit
def _fp8_tma_gemm2_loop(h, h_tail, w2, row0, w_row, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, TAIL: tl.constexpr, USE_TAIL: tl.constexpr, FP8_DOT: tl.constexpr):
    acc, acc_t = _gemm2_accs(BLOCK_M, BLOCK_N, TAIL)
    for k0 in range(0, I, BLOCK_K):
        b = w2.load([w_row, k0]).T
        acc = _fp8_dot(h.load([row0, k0]), b, acc, FP8_DOT)
        if USE_TAIL:
            acc_t = _fp8_dot(h_tail.load([row0 + BLOCK_M, k0]), b, acc_t, FP8_DOT)
    return acc, acc_t


@triton.jit
def moe_fp8_tma_gemm2_fwd_kernel(h, h_tail, w2, s2, y, h_scale, row_pair, block_expert, MB, L, I, stride_se,
                                 stride_y, PER_CHANNEL: tl.constexpr, FP8_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL: tl.constexpr):
    """Block pb, columns [n0, n0 + BLOCK_N) of L: y[pair] = (h s_h) (W2_e s_2)^T -> y.dtype, rows back in pair
    order. h / h_tail: TMA descriptors over gemm1's E4M3 rows `[MB * (BM + TAIL), I]`; w2: over `[E * L, I]`."""
    e, row0, n0 = _fp8_tma_block(block_expert, MB, L, BLOCK_M, BLOCK_N, TAIL)
    if e < 0:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < L
    w_row = e * L + n0
    use_tail = False
    if TAIL > 0:
        use_tail = tl.load(row_pair + row0 + BLOCK_M) >= 0
    if use_tail:
        acc, acc_t = _fp8_tma_gemm2_loop(h, h_tail, w2, row0, w_row, I, BLOCK_M, BLOCK_N, BLOCK_K, TAIL, True,
                                         FP8_DOT)
    else:
        acc, acc_t = _fp8_tma_gemm2_loop(h, h_tail, w2, row0, w_row, I, BLOCK_M, BLOCK_N, BLOCK_K, TAIL, False,
                                         FP8_DOT)
    if PER_CHANNEL:
        s = tl.load(s2 + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :] * tl.load(h_scale)
    else:
        s = tl.load(s2 + e) * tl.load(h_scale)
    pair = tl.load(row_pair + row0 + tl.arange(0, BLOCK_M))
    tl.store(y + pair[:, None].to(tl.int64) * stride_y + offs_n[None, :], (acc * s).to(y.dtype.element_ty),
             mask=(pair >= 0)[:, None] & n_ok[None, :])
    if TAIL > 0:
        if use_tail:
            pair_t = tl.load(row_pair + row0 + BLOCK_M + tl.arange(0, TAIL))
            tl.store(y + pair_t[:, None].to(tl.int64) * stride_y + offs_n[None, :],
                     (acc_t * s).to(y.dtype.element_ty), mask=(pair_t >= 0)[:, None] & n_ok[None, :])


@triton.jit
def moe_fp8_wo_gemm1_fwd_kernel(z, w13, s13, h, row_pair, block_expert, I, L, stride_z,
                                stride_we, stride_wn, stride_se, stride_h, beta, linear_beta,
                                TOP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, DOT_PREC: tl.constexpr,
                                WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """Block pb of one expert e, columns [n0, n0 + BLOCK_N) of I: h = SiTU_GLU(z (W1_e s_1)^T, z (W3_e s_3)^T)."""
    pb = tl.program_id(0)
    e, pair, m_ok = _plan_rows(row_pair, block_expert, BLOCK_M)
    if e < 0:
        return
    token = pair // TOP_K
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = z + token[:, None].to(tl.int64) * stride_z + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]   # [BK, BN]
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, L, BLOCK_K):
        k_ok = (k0 + offs_k) < L
        a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b1 = tl.load(w13 + w_off + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b3 = tl.load(w13 + w_off + I * stride_wn + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if WIDEN:                       # interpreter: its 16-bit tl.dot is wrong (`fp8_kernels`); same products
            a = a.to(tl.float32)
        acc1 = tl.dot(a, b1.to(a.dtype), acc=acc1, input_precision=DOT_PREC)
        acc3 = tl.dot(a, b3.to(a.dtype), acc=acc3, input_precision=DOT_PREC)
    if PER_CHANNEL:
        y1 = acc1 * tl.load(s13 + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
        y3 = acc3 * tl.load(s13 + e * stride_se + I + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        y1 = acc1 * tl.load(s13 + e)
        y3 = acc3 * tl.load(s13 + e)
    act = beta * _tanh(y1 / beta) * _sigmoid(y1) * (linear_beta * _tanh(y3 / linear_beta))
    h_ptr = h + (pb * BLOCK_M + offs_m)[:, None].to(tl.int64) * stride_h + offs_n[None, :]
    tl.store(h_ptr, act.to(h.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def moe_fp8_wo_gemm2_fwd_kernel(h, w2, s2, y, row_pair, block_expert, L, I, stride_h,
                                stride_we, stride_wn, stride_se, stride_y, PER_CHANNEL: tl.constexpr,
                                DOT_PREC: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block pb of one expert e, columns [n0, n0 + BLOCK_N) of L: y[pair] = h_rows (W2_e s_2)^T in fp32."""
    pb = tl.program_id(0)
    e, pair, m_ok = _plan_rows(row_pair, block_expert, BLOCK_M)
    if e < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < L
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = h + (pb * BLOCK_M + offs_m)[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    b_ptr = w2 + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = (k0 + offs_k) < I
        a = tl.load(a_ptr + k0, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if WIDEN:
            a = a.to(tl.float32)
        acc = tl.dot(a, b.to(a.dtype), acc=acc, input_precision=DOT_PREC)
    if PER_CHANNEL:
        acc = acc * tl.load(s2 + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        acc = acc * tl.load(s2 + e)
    tl.store(y + pair[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_fp8_wo_pair_gemm1_fwd_kernel(z4, w13, s13, h, ids, I, C_L, stride_z4, stride_we4, stride_wn4, stride_se,
                                     stride_h, beta, linear_beta, TOP_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                                     UNPACK: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_C: tl.constexpr, part=None, bias=None, s=None, wt=None, N=0, E=0,
                                     scaling=1.0, ROUTE: tl.constexpr = False, SPLITS: tl.constexpr = 1,
                                     BLOCK_E: tl.constexpr = 16, BLOCK_TK: tl.constexpr = 2,
                                     RENORM: tl.constexpr = False, PACKED: tl.constexpr = False):
    """Pair p (token p // TOP_K, expert ids[p]), columns [n0, n0 + BLOCK_N) of I: one GEMV per weight,
    h[p] = SiTU_GLU(z (W1_e s_1)^T, z (W3_e s_3)^T) -> h.dtype. z4 / w13: int64 / int32 words (`_gemv4`).
    ROUTE (`ExpertWo.fuse`): the program selects its token's experts itself and writes ids, wt and s, as the bf16
    pairs gemm1 does (`moe.kernels._pair_route`; the top-k launch goes)."""
    if ROUTE:
        p, e, offs_n, n_ok = _pair_route(part, bias, s, ids, wt, N, E, scaling, I, TOP_K, SPLITS, BLOCK_E,
                                         BLOCK_TK, RENORM, PACKED, BLOCK_N)
    else:
        p, e, offs_n, n_ok = _pair_tile(ids, I, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    x4 = z4 + (p // TOP_K).to(tl.int64) * stride_z4
    w1 = w13 + e * stride_we4 + offs_n[:, None].to(tl.int64) * stride_wn4 + offs_c[None, :]        # [BN, BC]
    y1 = _gemv4(x4, w1, n_ok, offs_c, 0, C_L, BLOCK_N, BLOCK_C, UNPACK, PREFETCH)
    y3 = _gemv4(x4, w1 + I * stride_wn4, n_ok, offs_c, 0, C_L, BLOCK_N, BLOCK_C, UNPACK, PREFETCH)
    if PER_CHANNEL:
        y1 = y1 * tl.load(s13 + e * stride_se + offs_n, mask=n_ok, other=0.0)
        y3 = y3 * tl.load(s13 + e * stride_se + I + offs_n, mask=n_ok, other=0.0)
    else:
        y1 = y1 * tl.load(s13 + e)
        y3 = y3 * tl.load(s13 + e)
    act = beta * _tanh(y1 / beta) * _sigmoid(y1) * (linear_beta * _tanh(y3 / linear_beta))
    tl.store(h + p.to(tl.int64) * stride_h + offs_n, act.to(h.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_fp8_wo_pair_gemm2_fwd_kernel(h4, w2, s2, y, ids, L, C_I, stride_h4, stride_we4, stride_wn4, stride_se,
                                     stride_y, PER_CHANNEL: tl.constexpr, UNPACK: tl.constexpr,
                                     PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                                     wt=None, u=None, tickets=None, stride_u=0, TOP_K: tl.constexpr = 1,
                                     COMBINE: tl.constexpr = False):
    """Pair p, columns [n0, n0 + BLOCK_N) of L: y[p] = h[p] (W2_e s_2)^T in fp32 (one GEMV). COMBINE
    (`ExpertWo.fuse`): then the token's weighted sum into u by the last of its TOP_K programs per column tile, as
    the bf16 pairs gemm2 does (`moe.kernels._ticket_combine`; the combine launch goes)."""
    p, e, offs_n, n_ok = _pair_tile(ids, L, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    w = w2 + e * stride_we4 + offs_n[:, None].to(tl.int64) * stride_wn4 + offs_c[None, :]
    acc = _gemv4(h4 + p.to(tl.int64) * stride_h4, w, n_ok, offs_c, 0, C_I, BLOCK_N, BLOCK_C, UNPACK, PREFETCH)
    if PER_CHANNEL:
        acc = acc * tl.load(s2 + e * stride_se + offs_n, mask=n_ok, other=0.0)
    else:
        acc = acc * tl.load(s2 + e)
    tl.store(y + p.to(tl.int64) * stride_y + offs_n, acc, mask=n_ok)
    if COMBINE:
        _ticket_combine(y, wt, u, tickets, p, offs_n, n_ok, stride_y, stride_u, TOP_K, BLOCK_N)


def _route_cuda(x, gate_weight, bias, top_k, renormalize, scaling, lean=False):
    from k3export.plugins.moe.kernels import route_fwd
    ids, w, _ = route_fwd(x, gate_weight, bias, top_k, renormalize, scaling, lean)
    return ids, w


# Weight-only while the average expert gets at most this many pairs (the region where the W8A8 path used 16-row
# blocks); beyond, E4M3 tensor cores. On the H200 (`bench fp8` expert sweep, k3-small: 64 experts, top-8) the two
# paths are within 2% at N = 1 and 8 tokens (101 / 118 us), W8A8 5% / 9% faster at N = 32 / 64; every figure is
# dominated by routing + alignment launches (~100 us for <= 19 MB of expert weights), so the bound stays where
# accuracy favours weight-only (no activation rounding) and the bytes are fewest.
WEIGHT_ONLY_PAIRS_PER_EXPERT = 4
@dataclass(frozen=True)
class ExpertWo:
    """One weight-only expert launch scheme. path "blocks": the row plan's 16-row blocks of one expert and a tl.dot
    per weight tile (the bf16 decode kernels' scheme; gemm1 / gemm2 give (block_n, block_k, warps, stages));
    "pairs": no row plan, one GEMV per (token, expert) pair and weight (`_gemv4`: int32 words of 4 E4M3, bf16 z),
    taken up to pair_max_tokens tokens (each pair reads its expert's weights, so only one token's pairs are sure to
    be distinct), else "blocks" with BLOCKS. lean_route: `route_fwd(lean=True)` (router split over d, packed top-k),
    as the bf16 decode default. fuse ("pairs" with lean_route, on CUDA): the top-k inside gemm1 and the combine
    inside gemm2 (`moe_fp8_wo_pairs_fused`: router, gemm1, gemm2, 3 launches instead of 5), the same bits, for up to
    TOPK_GEMM1_MAX_E experts (more: the unfused launches)."""
    path: str
    gemm1: WoTiles
    gemm2: WoTiles
    lean_route: bool = False
    pair_max_tokens: int = 1
    fuse: bool = False


BLOCKS = WoTiles(32, 256, 4, 4)             # the bf16 decode kernels' tiles
_PF = dict(unpack="cvt", prefetch=True)
# Named schemes (`k3export bench fp8 --variants` times them all on the full-width bank at one token, error checked
# against `moe_fp8_wo_ref`); "blocks" is the scheme measured 2026-11-29.
EXPERT_WO_TILINGS = {
    "blocks": ExpertWo("blocks", BLOCKS, BLOCKS),
    "blocks-lean": ExpertWo("blocks", BLOCKS, BLOCKS, True),
    "blocks-k512-lean": ExpertWo("blocks", WoTiles(32, 512, 4, 3), WoTiles(32, 512, 4, 3), True),
    "pairs-n16k512-shift": ExpertWo("pairs", WoTiles(16, 512, unpack="shift"), WoTiles(16, 512, unpack="shift"),
                                    True),
    "pairs-n16k512-cvt-pf": ExpertWo("pairs", WoTiles(16, 512, **_PF), WoTiles(16, 512, **_PF), True),
    "pairs-n8k512-cvt-pf": ExpertWo("pairs", WoTiles(8, 512, **_PF), WoTiles(16, 512, **_PF), True),
    "pairs-n16k1024-cvt-pf": ExpertWo("pairs", WoTiles(16, 1024, **_PF), WoTiles(16, 1024, **_PF), True),
    "pairs-n16k512-bits-pf": ExpertWo("pairs", WoTiles(16, 512, unpack="bits", prefetch=True),
                                      WoTiles(16, 512, unpack="bits", prefetch=True), True),
    "pairs-n16k512-shift-fused": ExpertWo("pairs", WoTiles(16, 512, unpack="shift"),
                                          WoTiles(16, 512, unpack="shift"), True, fuse=True),
}
# The default scheme. H200, 2026-11-30 (`k3export bench fp8 --no-model --variants`, docs/perf.md), full-width bank
# (896 experts, top-16, L 3584, I 3072), one token, routing and combine included: pairs-n16k512-shift 158.7 us
# (pairs-n16k512-cvt-pf 158.8, bits 177.5), blocks 235.4, blocks-lean 216.5 (bf16 `k3::moe_routed` 291.1); in
# the FP8 layer pair 0.512 / 0.523 ms with it vs 0.589 / 0.600 (MLA + MoE / KDA + MoE, linears unchanged).
# Above one token it runs "blocks" with lean routing (the bf16 decode default's routing; not timed in FP8 there).
# Since 2026-11-30 19:25 the fused form of that scheme (top-k in gemm1, combine in gemm2; the same tiles and bits),
# for up to TOPK_GEMM1_MAX_E experts as the bf16 default (above, e.g. K3's 896, the top-k keeps its launch): k3-small
# FP8 decode at B = 1 0.808 -> 0.782 ms (19:18, 6 of 6 interleaved rounds; docs/perf.md).
EXPERT_WO = EXPERT_WO_TILINGS["pairs-n16k512-shift-fused"]


def expert_wo() -> ExpertWo:
    """The weight-only scheme for a call: EXPERT_WO, or the one env K3_FP8_EXPERT_WO names (read per call, so at
    CUDA-graph capture: an A/B switch, e.g. "pairs-n16k512-shift", the unfused default before 2026-11-30 19:25)."""
    name = os.environ.get("K3_FP8_EXPERT_WO")
    if not name:
        return EXPERT_WO
    if name not in EXPERT_WO_TILINGS:
        raise ValueError(f"K3_FP8_EXPERT_WO={name!r} is not a scheme: {', '.join(EXPERT_WO_TILINGS)}")
    return EXPERT_WO_TILINGS[name]


def use_weight_only(n_pairs: int, n_experts: int) -> bool:
    return n_pairs <= WEIGHT_ONLY_PAIRS_PER_EXPERT * n_experts


def _combine(y, w, N, L, top_k, dtype):
    """u `[N, L]` in dtype = sum_j w[n, j] y[n*k + j] in fp32 (y `[P, L]` contiguous, w `[N, k]`)."""
    u = torch.empty(N, L, dtype=dtype, device=y.device)
    block_l = min(1024, pow2(L))
    moe_combine_fwd_kernel[(N, triton.cdiv(L, block_l))](y, w.float().contiguous(), u, L, TOP_K=top_k,
                                                         BLOCK_L=block_l, num_warps=4)
    return u


def moe_fp8_wo(top, w, z, w13, w2, w13_scale, w2_scale, top_k, beta, linear_beta, cfg: ExpertWo | None = None):
    """Weight-only experts for routed pairs (top, w `[N, k]`) -> u `[N, L]` in z.dtype (`moe_fp8_wo_ref`);
    cfg (default EXPERT_WO) picks the scheme."""
    cfg = cfg or EXPERT_WO
    N, L = z.shape
    if cfg.path == "pairs" and N <= cfg.pair_max_tokens and _pairs_ok(z, w13, w2):
        return _moe_fp8_wo_pairs(top, w, z, w13, w2, w13_scale, w2_scale, top_k, beta, linear_beta, cfg)
    t1, t2 = (cfg.gemm1, cfg.gemm2) if cfg.path == "blocks" else (BLOCKS, BLOCKS)
    E, I = w13.shape[0], w2.shape[-1]
    bm = 16
    row_pair, block_expert = align_rows(top.int(), E, bm)
    MB = block_expert.shape[0]
    z = z.contiguous()
    h = torch.empty(MB * bm, I, dtype=z.dtype, device=z.device)                    # block-row order
    y = torch.empty(N * top_k, L, dtype=torch.float32, device=z.device)            # pair order
    pc = w13_scale.dim() == 2
    s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    prec = "ieee" if INTERPRET else dot_precision(z.dtype)
    common = dict(PER_CHANNEL=pc, DOT_PREC=prec, WIDEN=INTERPRET, BLOCK_M=bm)
    moe_fp8_wo_gemm1_fwd_kernel[(MB, triton.cdiv(I, t1.block_n))](
        z, w13, s13, h, row_pair, block_expert, I, L, z.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0) if pc else 1, h.stride(0), beta, linear_beta, TOP_K=top_k, **common,
        BLOCK_N=t1.block_n, BLOCK_K=t1.block_k, num_warps=t1.warps, num_stages=1 if INTERPRET else t1.stages)
    moe_fp8_wo_gemm2_fwd_kernel[(MB, triton.cdiv(L, t2.block_n))](
        h, w2, s2, y, row_pair, block_expert, L, I, h.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0) if pc else 1, y.stride(0), **common, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k,
        num_warps=t2.warps, num_stages=1 if INTERPRET else t2.stages)
    return _combine(y, w, N, L, top_k, z.dtype)


def _pairs_ok(z, w13, w2) -> bool:
    """The "pairs" kernels read z and h as int64 words (4 bf16) and the weights as int32 words (4 E4M3)."""
    return (z.dtype == torch.bfloat16 and z.shape[1] % 4 == 0 and w2.shape[-1] % 4 == 0 and z.is_contiguous()
            and z.data_ptr() % 8 == 0 and w13.is_contiguous() and w2.is_contiguous() and w13.data_ptr() % 4 == 0
            and w2.data_ptr() % 4 == 0)


def moe_fp8_wo_pairs_fused(x, gate_weight, bias, z, w13, w2, w13_scale, w2_scale, top_k, renormalize, scaling,
                           beta, linear_beta, cfg: ExpertWo):
    """`ExpertWo.fuse`: the split router (`route_fwd(lean=True, defer=True)`), then the "pairs" gemm1 selecting the
    experts itself and gemm2 combining (3 launches) -> u `[N, L]` in z.dtype, the bits of route_fwd(lean) and the
    unfused "pairs" scheme. A router that is not split (more than `ROUTE_SPLIT_MAX_N` tokens) selects as usual."""
    from k3export.plugins.moe.kernels import route_fwd
    top, w, _, route = route_fwd(x, gate_weight, bias, top_k, renormalize, scaling, True, defer=True)
    return _moe_fp8_wo_pairs(top, w, z, w13, w2, w13_scale, w2_scale, top_k, beta, linear_beta, cfg, route)


def _moe_fp8_wo_pairs(top, w, z, w13, w2, w13_scale, w2_scale, top_k, beta, linear_beta, cfg: ExpertWo,
                      route=None):
    """The "pairs" scheme: gemm1 `[P, I]` and gemm2 `[P, L]` over pairs p = token * k + slot, then the combine.
    route (`route_fwd(defer=True)`'s): gemm1 selects and writes top / w (outputs then) and gemm2 combines."""
    N, L = z.shape
    I = w2.shape[-1]
    P = N * top_k
    ids = top.reshape(-1).int()
    h = torch.empty(P, I, dtype=z.dtype, device=z.device)                         # pair order
    y = torch.empty(P, L, dtype=torch.float32, device=z.device)
    pc = w13_scale.dim() == 2
    s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    w13_4, w2_4 = w13.view(torch.int32), w2.view(torch.int32)                       # [E, 2I, L/4], [E, L, I/4]
    t1, t2 = cfg.gemm1, cfg.gemm2
    unpack = lambda t: "shift" if INTERPRET else t.unpack                          # noqa: E731
    moe_fp8_wo_pair_gemm1_fwd_kernel[(P, triton.cdiv(I, t1.block_n))](
        z.view(torch.int64), w13_4, s13, h, ids, I, L // 4, z.stride(0) // 4, w13_4.stride(0), w13_4.stride(1),
        s13.stride(0) if pc else 1, h.stride(0), beta, linear_beta, TOP_K=top_k, PER_CHANNEL=pc,
        UNPACK=unpack(t1), PREFETCH=t1.prefetch, BLOCK_N=t1.block_n, BLOCK_C=t1.block_k // 4,
        num_warps=t1.warps, num_stages=1 if INTERPRET else t1.stages, **(route or {}))
    combine = {}
    if route is not None:                                   # gemm2's last program per (token, tile) combines
        u = torch.empty(N, L, dtype=z.dtype, device=z.device)
        tiles_n = triton.cdiv(L, t2.block_n)
        combine = dict(wt=w, u=u, tickets=tickets(z, N * tiles_n), stride_u=u.stride(0), TOP_K=top_k, COMBINE=True)
    moe_fp8_wo_pair_gemm2_fwd_kernel[(P, triton.cdiv(L, t2.block_n))](
        h.view(torch.int64), w2_4, s2, y, ids, L, I // 4, h.stride(0) // 4, w2_4.stride(0), w2_4.stride(1),
        s2.stride(0) if pc else 1, y.stride(0), PER_CHANNEL=pc, UNPACK=unpack(t2), PREFETCH=t2.prefetch,
        BLOCK_N=t2.block_n, BLOCK_C=t2.block_k // 4, num_warps=t2.warps, num_stages=1 if INTERPRET else t2.stages,
        **combine)
    return combine["u"] if combine else _combine(y, w, N, L, top_k, z.dtype)


@dataclass(frozen=True)
class Fp8Tiles:
    """One W8A8 (prefill) expert tiling. tma False: the pointer kernels (`moe_fp8_gemm1/2_fwd_kernel`, 64-row blocks,
    z gathered by token inside gemm1); True: `moe_fp8_tma_gemm1/2_fwd_kernel`, E4M3(z / s_z) gathered into
    row-plan order first, every operand through TMA descriptors, blocks of block_m + tail rows (the tail in a
    second, smaller dot on the same weight tiles, skipped when it is all padding). gemm1 / gemm2: (BLOCK_N,
    BLOCK_K, num_warps, num_stages). fast_act: the SiTU-GLU epilogue's `_situ_glu` FAST (2: tanh.approx.f32)."""
    block_m: int
    gemm1: tuple
    gemm2: tuple
    tail: int = 0
    tma: bool = True
    fast_act: int = 0

    @property
    def rows(self) -> int:
        return self.block_m + self.tail


# Named W8A8 tilings (`k3export bench moe --precision fp8` times them at K3 size; the cuda tests check them all).
# "ptr" is the pointer kernel measured on 2026-11-29 (64-row blocks, BN 64, BK 128, 4 warps, 3 stages); the TMA
# tilings follow the bf16 prefill tilings' shapes (kernels.TILINGS["prefill"]) with BK 128: 128 bytes of E4M3 per
# row, the 128-byte swizzle the bf16 tiles get at BK 64.
FP8_PREFILL_TILINGS = {
    "ptr": Fp8Tiles(64, (64, 128, 4, 3), (64, 128, 4, 3), tma=False),
    "m64t32-n128": Fp8Tiles(64, (128, 128, 8, 3), (256, 128, 8, 3), 32),
    "m64t32-n128-f2": Fp8Tiles(64, (128, 128, 8, 3), (256, 128, 8, 3), 32, fast_act=2),
    "m64t32-n128-k256": Fp8Tiles(64, (128, 256, 8, 2), (256, 256, 8, 2), 32, fast_act=2),
    "m128t64-n64-f2": Fp8Tiles(128, (64, 128, 8, 4), (128, 128, 8, 4), 64, fast_act=2),
    "m128-n128-f2": Fp8Tiles(128, (128, 128, 8, 3), (256, 128, 8, 3), fast_act=2),
    "m64-n128-f2": Fp8Tiles(64, (128, 128, 4, 4), (128, 128, 4, 4), fast_act=2),
    "m64-n128-s2-f2": Fp8Tiles(64, (128, 128, 4, 2), (128, 128, 4, 2), fast_act=2),     # 80 KB: 2 CTAs per SM
    "m128-n128-s4-f2": Fp8Tiles(128, (128, 128, 8, 4), (256, 128, 8, 4), fast_act=2),
    "m128-n64-f2": Fp8Tiles(128, (64, 128, 8, 4), (128, 128, 8, 4), fast_act=2),
    # pointer-load candidates for the TensorRT chain (`plugins/moe/trt_fp8.py`: no host-built TMA descriptors)
    "ptr-m64-n128": Fp8Tiles(64, (128, 128, 4, 3), (128, 128, 4, 3), tma=False),
    "ptr-m128-n64": Fp8Tiles(128, (64, 128, 8, 4), (128, 128, 8, 4), tma=False),
    "ptr-m128-n128": Fp8Tiles(128, (128, 128, 8, 3), (256, 128, 8, 3), tma=False),
    "ptr-m64-n128-k256": Fp8Tiles(64, (128, 256, 8, 2), (128, 256, 8, 2), tma=False),
}
# The defaults by average rows per expert r = pairs / E, from `k3export bench moe --precision fp8 --phases prefill`
# on the H200 (K3 shapes: 896 experts top-16, 3584 -> 3072 -> 3584, per-channel E4M3 weights; docs/perf.md).
# 2026-11-30 23:51: 4096 tokens (r 73) ptr 13.47 ms, m64t32-n128 11.19, m64-n128-f2 11.34, m128-n128-f2 10.77; 8192
# (r 146) ptr 21.25, m128-n128-f2 17.49, m128t64-n64-f2 16.47; 16384 (r 292) ptr 36.23, m128-n128-f2 26.23,
# m128t64-n64-f2 26.03. 2026-12-01 00:06 (another H200): 4096 m128-n128-f2 10.37, **m128-n128-s4-f2 9.95**,
# m64-n128-s2-f2 10.97, m128-n64-f2 11.31, m128t64-n64-f2 11.25; 8192 **m128t64-n64-f2 14.92**, m64-n128-s2-f2
# 15.95, m128-n128-s4-f2 16.98. Below 64 rows per expert nothing new was measured: the pointer kernels stay there
# (16-row blocks up to 4 rows per expert, as before).
# At k3-small's latent (L 1024: 8 K steps of 128 per tile) the pointer kernels measured faster end to end: `bench fp8
# --compiled --prefill 2048` (11 MoE layers, 256 rows per expert) FP8 10.81 ms with them, 11.35 with m128t64-n64-f2
# (one run each, 2026-12-01 00:00; bf16 12.34 / 12.00 in the same runs), so the TMA tilings start at K3's latent.
FP8_PREFILL = {64: FP8_PREFILL_TILINGS["m128-n128-s4-f2"], 128: FP8_PREFILL_TILINGS["m128t64-n64-f2"]}
FP8_PREFILL_MIN_L = 2048


def fp8_prefill_tiles(n_pairs: int, E: int, L: int) -> Fp8Tiles:
    """The W8A8 tiling for a call: the one env K3_FP8_MOE_PREFILL names (read per call: an A/B switch), else by
    the average rows per expert (FP8_PREFILL's thresholds) for latents of at least FP8_PREFILL_MIN_L, the pointer
    kernels otherwise."""
    name = os.environ.get("K3_FP8_MOE_PREFILL")
    if name:
        if name not in FP8_PREFILL_TILINGS:
            raise ValueError(f"K3_FP8_MOE_PREFILL={name!r} is not a W8A8 tiling: {', '.join(FP8_PREFILL_TILINGS)}")
        return FP8_PREFILL_TILINGS[name]
    r = n_pairs / E
    chosen = [t for lo, t in sorted(FP8_PREFILL.items()) if r >= lo and L >= FP8_PREFILL_MIN_L]
    if chosen:
        return chosen[-1]
    return FP8_PREFILL_TILINGS["ptr"] if r > 4 else replace(FP8_PREFILL_TILINGS["ptr"], block_m=16)


def moe_fp8_w8a8(top, w, z, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, beta, linear_beta,
                 t: Fp8Tiles | None = None):
    """W8A8 experts for routed pairs (top, w `[N, k]`) -> u `[N, L]` in z.dtype (`moe_fp8_sorted`'s steps and
    roundings, fp32 accumulation); t (default `fp8_prefill_tiles`) picks the tiling. A TMA tiling whose operands
    cannot be TMA rows (16-byte aligned bases and row strides) runs the pointer kernels."""
    N, L = z.shape
    E, I = w13.shape[0], w2.shape[-1]
    P = N * top_k
    t = t or fp8_prefill_tiles(P, E, L)
    z = z.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pc = w13_scale.dim() == 2
    s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    zs, hs = z_scale.float().reshape(1), h_scale.float().reshape(1)
    zq, _ = fp8_quant_fwd(z, z_scale)                                               # [N, L] E4M3
    if t.tma and not _tma_rows_ok(zq, w13.view(-1, L), w2.view(-1, I)):
        t = FP8_PREFILL_TILINGS["ptr"]
    bm = t.block_m
    row_pair, block_expert = align_rows(top.int(), E, t.rows, True, True)
    MB = block_expert.shape[0]
    y = torch.empty(P, L, dtype=z.dtype, device=z.device)                           # pair order
    (bn1, bk1, warps1, stages1), (bn2, bk2, warps2, stages2) = t.gemm1, t.gemm2
    if not t.tma:
        h = torch.empty(P, I, dtype=torch.float32 if INTERPRET else w13.dtype, device=z.device)   # pair order
        moe_fp8_gemm1_fwd_kernel[(MB, triton.cdiv(I, bn1))](
            zq, zs, w13, s13, h, hs, row_pair, block_expert, I, L, zq.stride(0), w13.stride(0), w13.stride(1),
            s13.stride(0) if pc else 1, h.stride(0), beta, linear_beta, TOP_K=top_k, PER_CHANNEL=pc,
            FP8_DOT=not INTERPRET, ROUND=_TL[z.dtype], BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps1,
            num_stages=1 if INTERPRET else stages1)
        if INTERPRET:
            h = h.to(w13.dtype)
        moe_fp8_gemm2_fwd_kernel[(MB, triton.cdiv(L, bn2))](
            h, hs, w2, s2, y, row_pair, block_expert, L, I, h.stride(0), w2.stride(0), w2.stride(1),
            s2.stride(0) if pc else 1, y.stride(0), PER_CHANNEL=pc, FP8_DOT=not INTERPRET, BLOCK_M=bm, BLOCK_N=bn2,
            BLOCK_K=bk2, num_warps=warps2, num_stages=1 if INTERPRET else stages2)
        return _combine(y, w, N, L, top_k, z.dtype)
    zp = gather_fwd(zq.view(torch.uint8), (row_pair, block_expert), top_k, t.rows).view(w13.dtype)   # plan order
    h = torch.empty(MB * t.rows, I, dtype=torch.float32 if INTERPRET else w13.dtype, device=z.device)
    tail = t.tail or bm
    moe_fp8_tma_gemm1_fwd_kernel[(MB * triton.cdiv(I, bn1),)](
        _desc(zp, [bm, bk1]), _desc(zp, [tail, bk1]), _desc(w13.view(E * 2 * I, L), [bn1, bk1]), s13, h, zs, hs,
        row_pair, block_expert, MB, I, L, s13.stride(0) if pc else 1, h.stride(0), beta, linear_beta,
        PER_CHANNEL=pc, FP8_DOT=not INTERPRET, ROUND=_TL[z.dtype], BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, TAIL=t.tail,
        FAST_ACT=min(t.fast_act, 1) if INTERPRET else t.fast_act, num_warps=warps1,
        num_stages=1 if INTERPRET else stages1)
    if INTERPRET:
        h = h.to(w13.dtype)             # the interpreter's own E4M3 conversion is wrong at binade carries
    moe_fp8_tma_gemm2_fwd_kernel[(MB * triton.cdiv(L, bn2),)](
        _desc(h, [bm, bk2]), _desc(h, [tail, bk2]), _desc(w2.view(E * L, I), [bn2, bk2]), s2, y, hs, row_pair,
        block_expert, MB, L, I, s2.stride(0) if pc else 1, y.stride(0), PER_CHANNEL=pc, FP8_DOT=not INTERPRET,
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, TAIL=t.tail, num_warps=warps2, num_stages=1 if INTERPRET else stages2)
    return _combine(y, w, N, L, top_k, z.dtype)


def moe_fp8_grouped(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, renormalize,
                    scaling, beta, linear_beta, weight_only: bool | None = None, wo: ExpertWo | None = None,
                    tiles: Fp8Tiles | None = None):
    """`k3::moe_routed_fp8`'s signature; weight-only (`moe_fp8_wo_ref`) when `use_weight_only` (and its kernels
    work here: `k3export.fp8.WEIGHT_ONLY_OK`), else W8A8 (`moe_fp8_sorted`, static activation scales, `moe_fp8_w8a8`);
    weight_only True/False forces a path, wo (default EXPERT_WO) picks the weight-only scheme, tiles the W8A8
    tiling (default `fp8_prefill_tiles`). fp32 accumulation either way."""
    N, L = z.shape
    E, I = w13.shape[0], w2.shape[-1]
    P = N * top_k
    cfg = wo or expert_wo()
    run_wo = weight_only if weight_only is not None else (use_weight_only(P, E) and WEIGHT_ONLY_OK["experts"])
    fused = run_wo and cfg.fuse and cfg.path == "pairs" and cfg.lean_route and N <= cfg.pair_max_tokens \
        and E <= TOPK_GEMM1_MAX_E and _pairs_ok(z, w13, w2)

    def routed():
        if INTERPRET or not z.is_cuda:
            return route(x, gate_weight, bias, top_k, renormalize, scaling)           # [N, k]
        return _route_cuda(x, gate_weight, bias, top_k, renormalize, scaling, run_wo and cfg.lean_route)

    def experts():
        if fused:
            return moe_fp8_wo_pairs_fused(x, gate_weight, bias, z, w13, w2, w13_scale, w2_scale, top_k, renormalize,
                                          scaling, beta, linear_beta, cfg)
        return moe_fp8_wo(*routed(), z, w13, w2, w13_scale, w2_scale, top_k, beta, linear_beta, cfg)
    if run_wo and weight_only is None:
        try:
            return experts()
        except Exception as e:                                                  # noqa: BLE001 (reported)
            weight_only_unavailable("experts", e)
    elif run_wo:
        return experts()
    top, w = routed()
    return moe_fp8_w8a8(top, w, z, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, beta, linear_beta, tiles)
