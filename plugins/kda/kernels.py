"""Triton KDA kernels: the CUDA implementations of `k3::kda_prefill`, `k3::kda_decode` and
`k3::kda_decode_inplace` (see CONTRACT.md).

Prefill runs over right-padded `[B, T, H, K]` inputs, chunk BT = 64, in two stages:
  1. intra, one program per (chunk, sequence*head), all chunks in parallel: L2 norm, lower-bound gate,
     in-chunk cumulative decay Gam, A_kk / A_qk from 16-row sub-tiles (every exponent <= 80, so nothing
     overflows fp32), the UT transform X = (I + A_kk)^-1 (block Neumann series, exact for the nilpotent
     strictly-lower A_kk), W = X beta exp(Gam) K, U = X beta V. Writes W, U, exp(Gam) Q, exp(Gam_C - Gam) K,
     A_qk (compute dtype) and Gam_C (fp32). At K = V = 128 (the default, "split-a4-wu4r168"): two launches,
     `kda_prefill_akk_fwd_kernel` (gate, Gam, A_kk / A_qk, the per-token stores; exp2 with per-block references,
     4 warps) then `kda_prefill_wu_fwd_kernel` (UT transform, W, U), joined by an fp32 A_kk scratch; 1.77 vs
     2.41 ms on the H200, end to end 2.485 ms vs fla's chunk_kda 2.622 ms (prefill_config). "full": one launch,
     `kda_prefill_intra_fwd_kernel` (the AOT contract's kernel: a plugin is one launch without workspace).
  2. `kda_prefill_fwd_kernel`, one program per (V block, sequence*head), chunks in order: the inter-chunk state
     pass Vn = U - W S, O = exp(Gam) Q S + A_qk Vn, S <- exp(Gam_C) S + (exp(Gam_C - Gam) K)^T Vn, fp32 state.
Decode is one launch, `kda_decode_fwd_kernel`, one program per (sequence, head) holding its [K, V] state; the
serving form `kda_decode_inplace_fwd_kernel` is the same step (`_decode_head`) writing the state over itself, with
the f_b_proj GEMV folded in.
Variants measured on the H200 and dropped for being slower or wrong there (sub-tiled and column-block intra
kernels, fla's split state pass, column-block decode, a column-split in-place decode with a ticketed head norm for
few sequences) are in docs/perf.md ("KDA kernels", "End-to-end") and the git history.

Each op's launch configuration lives in `*_config` functions shared with the AOT contract in `trt.py`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..launch import launch, pdl_args, pdl_wait
from ..triton_common import check
from .op import CHUNK, kda_decode, kda_decode_inplace, kda_prefill

# libdevice's approximate division in the akk kernel's gate (GPU); the interpreter has no libdevice.
FAST_MATH = os.environ.get("TRITON_INTERPRET") != "1"
BC = 16  # sub-tile rows: 16 steps of a gate > -5 decay by less than e^80, finite in fp32


@triton.jit
def _mm(a, b, low_dtype, PREC: tl.constexpr, LOW: tl.constexpr):
    """fp32 x fp32 product at PREC, or (LOW) with both operands rounded to low_dtype (bf16: same exponent range,
    so the e^80 diagonal-block factors stay finite), fp32 accumulation."""
    if LOW:
        return tl.dot(a.to(low_dtype), b.to(low_dtype))
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _a_column_block(b_q, b_k, b_G, J, b_Aqk, b_A, low_dtype, BT: tl.constexpr, BC: tl.constexpr,
                    PREC: tl.constexpr, LOW: tl.constexpr):
    """Add column block J (rows J*BC .. J*BC+BC-1 of K) of A_qk and A_kk, referenced to c_J = Gam at the block's
    last row: exp(Gam_i - Gam_j) = exp(Gam_i - c_J) * exp(c_J - Gam_j), the first factor <= e^80 on the diagonal
    block and <= 1 below it, the second <= 1; rows above block J get a -inf exponent."""
    r_t = tl.arange(0, BT)
    c_J = tl.sum(tl.where(r_t[:, None] == J * BC + BC - 1, b_G, 0.), 0)               # [BK]
    e_J = tl.exp(tl.where(r_t[:, None] >= J * BC, b_G - c_J[None, :], float("-inf")))
    in_J = (r_t[:, None] >= J * BC) & (r_t[:, None] < J * BC + BC)
    r_J = tl.trans(b_k * tl.exp(tl.where(in_J, c_J[None, :] - b_G, float("-inf"))))       # [BK, BT]
    b_Aqk += _mm(b_q * e_J, r_J, low_dtype, PREC, LOW)
    b_A += _mm(b_k * e_J, r_J, low_dtype, PREC, LOW)
    return b_Aqk, b_A


@triton.jit
def _a_products(b_q, b_k, b_G, low_dtype, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                LOW: tl.constexpr):
    """A_qk and A_kk ([BT, BT] fp32, before masking) from q, k, Gam [BT, BK] by column blocks of BC rows (the
    one-launch kernel's; a run-time loop over the blocks spilled less but was slower on the H200: 2.90 vs 2.41 ms)."""
    b_Aqk = tl.zeros((BT, BT), dtype=tl.float32)
    b_A = tl.zeros((BT, BT), dtype=tl.float32)
    for J in tl.static_range(BT // BC):
        b_Aqk, b_A = _a_column_block(b_q, b_k, b_G, J, b_Aqk, b_A, low_dtype, BT, BC, PREC, LOW)
    return b_Aqk, b_A


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _block_rows(v0, v1, v2, v3, blk):
    """[BT, BK] tile whose row i holds v_{blk(i)} (four [BK] vectors, one per BC-row block of the chunk)."""
    return tl.where(blk[:, None] == 0, v0[None, :], tl.where(blk[:, None] == 1, v1[None, :],
                    tl.where(blk[:, None] == 2, v2[None, :], v3[None, :])))


@triton.jit
def _a_block_ref(b_qE, b_kE, b_RT, blk, F, J: tl.constexpr, b_Aqk, b_A, low_dtype, PREC: tl.constexpr,
                 LOW: tl.constexpr):
    """Add column block J of A_qk and A_kk in `kda_prefill_akk_fwd_kernel` (R^T given): the left factor
    2^(G_i - c_J) = E_i F_i, with F_i = 2^(p_I - c_J) for row i of block I >= J and 0 above block J."""
    r_J = tl.where(blk[None, :] == J, b_RT, 0.).to(b_RT.dtype)      # [BK, BT], already in the operand dtype
    if LOW:
        b_Aqk = tl.dot((b_qE * F).to(low_dtype), r_J, b_Aqk)
        b_A = tl.dot((b_kE * F).to(low_dtype), r_J, b_A)
    else:
        b_Aqk = tl.dot(b_qE * F, r_J, b_Aqk, input_precision=PREC)
        b_A = tl.dot(b_kE * F, r_J, b_A, input_precision=PREC)
    return b_Aqk, b_A


@triton.jit
def _qk_gate(q, k, f, b, v, A_log, dt_bias, tok, i_h, m_t, m_valid, H: tl.constexpr, K: tl.constexpr,
             BK: tl.constexpr, LOWER: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, LOG2: tl.constexpr,
             FAST_MATH: tl.constexpr):
    """One chunk's per-token inputs, fp32 [BT, BK]: q L2-normed and scaled by K^-1/2, k L2-normed, Gam = the
    in-chunk cumsum of the lower-bound gate (0 on padding rows: alpha = 1), beta [BT] (0 on padding rows), and
    v [BT, BV] when V > 0 (else 0.), loaded after f as the full kernel always did (its instructions unchanged).
    LOG2: Gam in log2 units (Gam / ln 2, for exp2) and the row norms as one rsqrt per row times a multiply
    instead of a division per element. FAST_MATH (GPU only: the interpreter lacks libdevice): the gate's sigmoid
    as 1 / (1 + 2^(-x log2 e)) with an approximate division (`__fdividef`, 2 ulp), 5 instructions instead of 12."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_k = tok[:, None] * (H * K) + i_h * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_f = tl.load(f + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_v = 0.
    if V > 0:
        o_v = tl.arange(0, BV)
        b_v = tl.load(v + tok[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                      other=0.).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_beta = tl.where(m_valid, b_beta, 0.)
    if LOG2:
        b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6) * (K ** -0.5))[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    else:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None] * (K ** -0.5)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    if FAST_MATH:
        s = a * -1.4426950408889634                          # sigmoid(x) = 1 / (1 + 2^(-x log2 e)), x = a (f + bias)
        b_x = b_f * s + (b_bias * s)[None, :]
        b_g = (LOWER * 1.4426950408889634) * libdevice.fast_dividef(1., 1. + tl.exp2(b_x))
    elif LOG2:
        b_g = (LOWER * 1.4426950408889634) * tl.sigmoid(a * (b_f + b_bias[None, :]))
    else:
        b_g = LOWER * tl.sigmoid(a * (b_f + b_bias[None, :]))
    b_g = tl.where(m_valid[:, None] & m_k[None, :], b_g, 0.)
    return b_q, b_k, tl.cumsum(b_g, 0), b_beta, b_v


@triton.jit
def _ut_inverse(b_A, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """X = (I + A)^-1 for the strictly lower [BT, BT] A (fp32 products at PREC). D = I + A_bd (the diagonal
    BC-blocks) is nilpotent-shifted of order BC: D^-1 = (I - A_bd)(I + A_bd^2)(I + A_bd^4)(I + A_bd^8).
    N = D^-1 A_lo has N^4 = 0 (BT / BC = 4 blocks): X = (I - N)(I + N^2) D^-1."""
    r_t = tl.arange(0, BT)
    eye = tl.where(r_t[:, None] == r_t[None, :], 1., 0.)
    same = (r_t[:, None] // BC) == (r_t[None, :] // BC)
    A_bd = tl.where(same, b_A, 0.)
    A_lo = b_A - A_bd
    P2 = tl.dot(A_bd, A_bd, input_precision=PREC)
    P4 = tl.dot(P2, P2, input_precision=PREC)
    P8 = tl.dot(P4, P4, input_precision=PREC)
    D_inv = tl.dot(eye - A_bd, eye + P2, input_precision=PREC)
    D_inv = tl.dot(D_inv, eye + P4, input_precision=PREC)
    D_inv = tl.dot(D_inv, eye + P8, input_precision=PREC)
    N1 = tl.dot(D_inv, A_lo, input_precision=PREC)
    N2 = tl.dot(N1, N1, input_precision=PREC)
    return tl.dot(tl.dot(eye - N1, eye + N2, input_precision=PREC), D_inv, input_precision=PREC)


@triton.jit
def kda_prefill_intra_fwd_kernel(
    q, k, v, f, b, A_log, dt_bias, lengths,          # inputs
    T,                                                # scalar: padded tokens per sequence
    w, u, qg, kd, aqk, gl,                            # outputs
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    o_t = i_n * BT + tl.arange(0, BT)                                   # [BT] token index
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t = o_t < T
    m_valid = o_t < length
    m_k = o_k < K
    m_v = o_v < V
    tok = (i_b * T + o_t).to(tl.int64)                                  # [BT] row in [B*T]

    # Per-token inputs: [BT, BK] fp32.
    b_q, b_k, b_G, b_beta, b_v = _qk_gate(q, k, f, b, v, A_log, dt_bias, tok, i_h, m_t, m_valid, H, K, BK, LOWER,
                                          V, BV, False, False)

    # A_kk, A_qk by column blocks J of BC rows, referenced to c_J = Gam at J's last row:
    # exp(Gam_i - Gam_j) = exp(Gam_i - c_J) * exp(c_J - Gam_j); the first factor is <= e^80 on the
    # diagonal block and <= 1 below it, the second <= 1. Rows above block J are masked out (-inf exponent).
    r_t = tl.arange(0, BT)
    # Right operands are full [BT, BK] tiles with the rows outside block J zeroed. (Cutting [BC, BK] sub-tiles
    # with tl.reshape is 4x fewer MACs and exact under the interpreter, but gave a wrong U on the H200 with
    # Triton 3.6; cause not found.)
    b_Aqk, b_A = _a_products(b_q, b_k, b_G, w.dtype.element_ty, BT, BC, PREC, LOW)
    b_Aqk = tl.where(r_t[:, None] >= r_t[None, :], b_Aqk, 0.)
    tl.store(aqk + (i_bh * NT * BT + i_n * BT + r_t[:, None]).to(tl.int64) * BT + r_t[None, :],
             b_Aqk.to(aqk.dtype.element_ty))
    b_A = tl.where(r_t[:, None] > r_t[None, :], b_A * b_beta[:, None], 0.)

    X = _ut_inverse(b_A, BT, BC, PREC)                                                 # (I + A_kk)^-1

    b_eG = tl.exp(b_G)
    b_w = _mm(X, b_beta[:, None] * b_eG * b_k, w.dtype.element_ty, PREC, LOW)         # [BT, BK]
    b_u = _mm(X, b_beta[:, None] * b_v, w.dtype.element_ty, PREC, LOW)                # [BT, BV]
    G_last = tl.sum(tl.where(r_t[:, None] == BT - 1, b_G, 0.), 0)                     # [BK]

    row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)                               # [BT] in [B*H*NT*BT]
    p_o = row[:, None] * K + o_k[None, :]
    tl.store(w + p_o, b_w.to(w.dtype.element_ty), mask=m_k[None, :])
    tl.store(qg + p_o, (b_eG * b_q).to(qg.dtype.element_ty), mask=m_k[None, :])
    tl.store(kd + p_o, (tl.exp(G_last[None, :] - b_G) * b_k).to(kd.dtype.element_ty), mask=m_k[None, :])
    tl.store(u + row[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])
    tl.store(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, G_last, mask=m_k)


@triton.jit
def kda_prefill_akk_fwd_kernel(
    q, k, f, b, A_log, dt_bias, lengths,             # inputs
    T,                                                # scalar: padded tokens per sequence
    w, qg, kd, aqk, gl, akk,                          # outputs (w: beta exp(Gam) K, for kda_prefill_wu_fwd_kernel)
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    LOWER: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """First of the two launches of the split intra variant (`prefill_config(...)["intra"] == "split"`): the
    gate, Gam and A_kk / A_qk of `kda_prefill_intra_fwd_kernel` (the same quantities; Gam in log2 units and the
    exponentials factored through per-block references, see below, so two [BT, BK] exp2s replace ten exps), with
    every per-token store made before the column-block products. Writes qg, kd, gl, aqk as the full
    kernel, beta exp(Gam) K into w (compute dtype: the full kernel's bf16 operand of W) and the strictly lower,
    beta-scaled A_kk into the fp32 scratch akk `[B*H*NT*BT, BT]`. The UT transform and W, U are the second
    launch, `kda_prefill_wu_fwd_kernel`."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    o_t = i_n * BT + tl.arange(0, BT)                                   # [BT] token index
    o_k = tl.arange(0, BK)
    r_t = tl.arange(0, BT)
    m_t = o_t < T
    m_valid = o_t < length
    m_k = o_k < K
    tok = (i_b * T + o_t).to(tl.int64)                                  # [BT] row in [B*T]
    row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)                 # [BT] in [B*H*NT*BT]

    b_q, b_k, b_G, b_beta, _ = _qk_gate(q, k, f, b, None, A_log, dt_bias, tok, i_h, m_t, m_valid, H, K, BK, LOWER,
                                        0, 16, True, FAST_MATH)

    p_o = row[:, None] * K + o_k[None, :]
    # Gam is in log2 units here (b_G = Gam / ln 2). Two [BT, BK] exp2s instead of ten exps: with c_m = b_G at
    # block m's last row, p_I = c_{I-1} (c_{-1} = 0) for row i of block I, a_m = 2^(c_m - c_{m-1}) <= 1 and
    # ai_m = 1 / a_m <= e^80 (16 gates >= -5):
    #   E_i = 2^(G_i - p_I) in [e^-80, 1],  R_j = k_j 2^(c_J - G_j) <= k_j  (J the block of row j),
    #   exp(Gam_i) = E_i a_0..a_{I-1},  exp(Gam_last - Gam_i) = 2^(c_I - G_i) a_{I+1}..a_3,
    #   2^(G_i - c_J) = E_i 2^(p_I - c_J): ai_J for I = J, 1 for I = J + 1, a_{J+1}..a_{I-1} beyond.
    # Every factor but ai is <= 1, so a product that underflows is below e^-87 in exact arithmetic too.
    tl.static_assert(BT // BC == 4)
    blk = r_t // BC
    last = r_t[:, None] % BC == BC - 1                                               # [BT, 1]
    c0, c1, c2, c3 = tl.reduce((tl.where(last & (blk[:, None] == 0), b_G, 0.),       # [BK] each, one reduction
                                tl.where(last & (blk[:, None] == 1), b_G, 0.),
                                tl.where(last & (blk[:, None] == 2), b_G, 0.),
                                tl.where(last & (blk[:, None] == 3), b_G, 0.)), 0, _add4)  # c3: Gam_last / ln 2
    zero = tl.zeros_like(c0)
    one = zero + 1.
    a0, a1, a2, a3 = tl.exp2(c0), tl.exp2(c1 - c0), tl.exp2(c2 - c1), tl.exp2(c3 - c2)
    ai0, ai1, ai2, ai3 = tl.exp2(-c0), tl.exp2(c0 - c1), tl.exp2(c1 - c2), tl.exp2(c2 - c3)
    b_E = tl.exp2(b_G - _block_rows(zero, c0, c1, c2, blk))
    b_R = b_k * tl.exp2(_block_rows(c0, c1, c2, c3, blk) - b_G)
    b_eG = b_E * _block_rows(one, a0, a0 * a1, a0 * a1 * a2, blk)
    b_kd = b_R * _block_rows(a1 * a2 * a3, a2 * a3, a3, one, blk)
    tl.store(qg + p_o, (b_eG * b_q).to(qg.dtype.element_ty), mask=m_k[None, :])
    tl.store(kd + p_o, b_kd.to(kd.dtype.element_ty), mask=m_k[None, :])
    tl.store(w + p_o, (b_beta[:, None] * b_eG * b_k).to(w.dtype.element_ty), mask=m_k[None, :])
    tl.store(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, c3 * 0.6931471805599453, mask=m_k)
    b_qE = b_q * b_E
    b_kE = b_k * b_E
    b_RT = tl.trans(b_R).to(w.dtype.element_ty if LOW else tl.float32)   # [BK, BT], rounded to the operand dtype once
    b_Aqk = tl.zeros((BT, BT), dtype=tl.float32)
    b_A = tl.zeros((BT, BT), dtype=tl.float32)
    dt = w.dtype.element_ty
    b_Aqk, b_A = _a_block_ref(b_qE, b_kE, b_RT, blk, _block_rows(ai0, one, a1, a1 * a2, blk), 0, b_Aqk, b_A,
                              dt, PREC, LOW)
    b_Aqk, b_A = _a_block_ref(b_qE, b_kE, b_RT, blk, _block_rows(zero, ai1, one, a2, blk), 1, b_Aqk, b_A,
                              dt, PREC, LOW)
    b_Aqk, b_A = _a_block_ref(b_qE, b_kE, b_RT, blk, _block_rows(zero, zero, ai2, one, blk), 2, b_Aqk, b_A,
                              dt, PREC, LOW)
    b_Aqk, b_A = _a_block_ref(b_qE, b_kE, b_RT, blk, _block_rows(zero, zero, zero, ai3, blk), 3, b_Aqk, b_A,
                              dt, PREC, LOW)
    b_Aqk = tl.where(r_t[:, None] >= r_t[None, :], b_Aqk, 0.)
    tl.store(aqk + row[:, None] * BT + r_t[None, :], b_Aqk.to(aqk.dtype.element_ty))
    b_A = tl.where(r_t[:, None] > r_t[None, :], b_A * b_beta[:, None], 0.)
    tl.store(akk + row[:, None] * BT + r_t[None, :], b_A)


@triton.jit
def kda_prefill_wu_fwd_kernel(
    v, b, lengths,                                    # inputs
    T,                                                # scalar: padded tokens per sequence
    akk, w, u,                                        # in: A_kk, beta exp(Gam) K (w); out: W (w, in place), U
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
):
    """Second launch of the split intra variant: the UT transform X = (I + A_kk)^-1 of the full kernel (same
    products) on akk, then W = X (beta exp(Gam) K), written over its operand in w (each program reads and writes
    only its own chunk's rows; the product's operand staging orders every read before any write), and
    U = X beta V. Holds only [BT, BT] matrices and one [BT, BK|BV] operand at a time."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    o_t = i_n * BT + tl.arange(0, BT)
    r_t = tl.arange(0, BT)
    m_t = o_t < T
    tok = (i_b * T + o_t).to(tl.int64)
    row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)
    b_A = tl.load(akk + row[:, None] * BT + r_t[None, :])

    X = _ut_inverse(b_A, BT, BC, PREC)                                                 # as the full kernel

    o_k = tl.arange(0, BK)
    p_w = row[:, None] * K + o_k[None, :]
    b_kg = tl.load(w + p_w, mask=(o_k < K)[None, :], other=0.).to(tl.float32)
    b_w = _mm(X, b_kg, w.dtype.element_ty, PREC, LOW)                                 # [BT, BK]
    tl.store(w + p_w, b_w.to(w.dtype.element_ty), mask=(o_k < K)[None, :])
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    b_beta = tl.sigmoid(tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_beta = tl.where(o_t < length, b_beta, 0.)
    b_v = tl.load(v + tok[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.).to(tl.float32)
    b_u = _mm(X, b_beta[:, None] * b_v, w.dtype.element_ty, PREC, LOW)                # [BT, BV]
    tl.store(u + row[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])


@triton.jit
def kda_prefill_fwd_kernel(
    w, u, qg, kd, aqk, gl, h0, lengths,               # inputs
    T,                                                # scalar: padded tokens per sequence
    o, ht,                                            # outputs
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    NV = tl.minimum(tl.cdiv(length, BT), NT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    r_t = tl.arange(0, BT)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    causal = r_t[:, None] >= r_t[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(h0 + p_s, mask=m_kv, other=0.).to(tl.float32)                       # [BK, BV] fp32
    dt = w.dtype.element_ty
    for i_n in range(0, NV):
        row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)                           # [BT]
        p_k = row[:, None] * K + o_k[None, :]
        b_w = tl.load(w + p_k, mask=m_k[None, :], other=0.)
        b_qg = tl.load(qg + p_k, mask=m_k[None, :], other=0.)
        b_kdT = tl.load(kd + row[None, :] * K + o_k[:, None], mask=m_k[:, None], other=0.)     # [BK, BT]
        b_u = tl.load(u + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
        b_a = tl.load(aqk + row[:, None] * BT + r_t[None, :], mask=causal, other=0.)
        b_decay = tl.exp(tl.load(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, mask=m_k, other=0.))
        b_sd = b_s.to(dt)
        b_vn = b_u - tl.dot(b_w, b_sd, input_precision=PREC)                         # [BT, BV]
        b_vnd = b_vn.to(dt)
        b_o = tl.dot(b_qg, b_sd, input_precision=PREC) + tl.dot(b_a, b_vnd, input_precision=PREC)
        t = i_n * BT + r_t
        p_o = (i_b * T + t).to(tl.int64)[:, None] * (H * V) + i_h * V + o_v[None, :]
        tl.store(o + p_o, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None] & m_v[None, :])
        b_s = b_s * b_decay[:, None] + tl.dot(b_kdT, b_vnd, input_precision=PREC)
    for i_n in range(NV, NT):                # chunks wholly past the length: finite (zero) rows
        t = i_n * BT + r_t
        p_o = (i_b * T + t).to(tl.int64)[:, None] * (H * V) + i_h * V + o_v[None, :]
        tl.store(o + p_o, tl.zeros((BT, BV), dtype=o.dtype.element_ty), mask=(t < T)[:, None] & m_v[None, :])
    tl.store(ht + p_s, b_s.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, c0, C, K: tl.constexpr, W: tl.constexpr,
               BK: tl.constexpr, BW: tl.constexpr, SYNC: tl.constexpr):
    """Depthwise causal conv of channels c0..c0+K-1 over [previous W-1 inputs, new input], then SiLU (rounded to
    qkv's dtype as the op does). Stores the next window (inputs 1..W-1) to conv_out. Returns [BK] fp32.
    SYNC: conv_out is conv_state (in place): every thread's loads of the window finish before any store."""
    o_k = tl.arange(0, BK)
    o_w = tl.arange(0, BW)
    m_k = o_k < K
    c = c0 + o_k
    p_win = (i_b.to(tl.int64) * C + c)[:, None] * (W - 1) + o_w[None, :]           # [BK, BW]
    m_win = m_k[:, None] & (o_w[None, :] < W - 1)
    x_new = tl.load(qkv + i_b.to(tl.int64) * C + c, mask=m_k, other=0.)
    win = tl.load(conv_state + p_win, mask=m_win, other=0.).to(tl.float32)
    win = tl.where(o_w[None, :] == W - 1, x_new.to(tl.float32)[:, None], win)
    wt = tl.load(conv_weight + c[:, None] * W + o_w[None, :], mask=m_k[:, None] & (o_w[None, :] < W),
                 other=0.).to(tl.float32)
    y = tl.sum(win * wt, 1)
    nxt = tl.load(conv_state + p_win + 1, mask=m_k[:, None] & (o_w[None, :] < W - 2), other=0.)
    nxt = tl.where(o_w[None, :] == W - 2, x_new[:, None].to(nxt.dtype), nxt)
    if SYNC:
        tl.debug_barrier()
    tl.store(conv_out + p_win, nxt.to(conv_out.dtype.element_ty), mask=m_win)
    return (y * tl.sigmoid(y)).to(qkv.dtype.element_ty).to(tl.float32)


@triton.jit
def _fold_f(f_a, f_b_weight, i_b, i_h, out_dtype, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
            BK: tl.constexpr, BR: tl.constexpr):
    """f_b_proj inside the step: this head's decay-gate input f_a[i_b] @ f_b_weight[h K:(h+1) K, :]^T, [BK] fp32,
    rounded to out_dtype as the Linear's output is. Column blocks of 32 keep the weight tile small (the state tile
    that follows needs the registers)."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    acc = tl.zeros([BK], dtype=tl.float32)
    for r0 in tl.static_range(0, BR, 32):
        o_r = r0 + tl.arange(0, 32)
        m_r = o_r < R
        a = tl.load(f_a + i_b.to(tl.int64) * R + o_r, mask=m_r, other=0.).to(tl.float32)
        w = tl.load(f_b_weight + (i_h * K + o_k)[:, None] * R + o_r[None, :], mask=m_k[:, None] & m_r[None, :],
                    other=0.).to(tl.float32)
        acc += tl.sum(w * a[None, :], 1)
    return acc.to(out_dtype).to(tl.float32)


@triton.jit
def _decode_head(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight, state,
                 o, conv_out, state_out, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
                 BK: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr, LOWER: tl.constexpr, EPS: tl.constexpr,
                 FOLD: tl.constexpr, SYNC: tl.constexpr):
    """One (sequence, head) of the decode step; see `kda_decode_fwd_kernel`. FOLD: f is f_a `[B, R]` and the
    f_b_proj GEMV runs here; SYNC: the outputs are the inputs (in place)."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    C: tl.constexpr = 3 * H * K
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    # Short conv + SiLU on this head's q | k | v channels; writes their next windows.
    b_q = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 0 * H * K + i_h * K, C, K, W, BK, BW, SYNC)
    b_k = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 1 * H * K + i_h * K, C, K, W, BK, BW, SYNC)
    b_v = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 2 * H * K + i_h * K, C, K, W, BK, BW, SYNC)

    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * (K ** -0.5)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    if FOLD:
        b_f = _fold_f(f, f_b_weight, i_b, i_h, qkv.dtype.element_ty, H, K, R, BK, BR)
    else:
        b_f = tl.load(f + i_b.to(tl.int64) * H * K + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    alpha = tl.exp(LOWER * tl.sigmoid(a * (b_f + b_bias)))
    beta = tl.sigmoid(tl.load(b + i_bh).to(tl.float32))

    # Delta rule on the fp32 state: read once, write once (in place is safe: the tile's every load precedes the
    # reductions that its stores depend on).
    o_v = tl.arange(0, BK)
    p_s = i_bh.to(tl.int64) * K * K + o_k[:, None] * K + o_v[None, :]
    m_s = m_k[:, None] & m_k[None, :]
    S = tl.load(state + p_s, mask=m_s, other=0.).to(tl.float32) * alpha[:, None]    # [BK(k), BK(v)]
    err = b_v - tl.sum(S * b_k[:, None], 0)                                         # v - S'^T k
    S += beta * b_k[:, None] * err[None, :]
    b_o = tl.sum(S * b_q[:, None], 0)                                               # read after the write
    tl.store(state_out + p_s, S.to(state_out.dtype.element_ty), mask=m_s)

    # Head RMSNorm over V (shared weight) and output gate, with the op's roundings.
    b_o = b_o.to(o.dtype.element_ty).to(tl.float32)
    on = (b_o * tl.rsqrt(tl.sum(b_o * b_o) / K + EPS)).to(o.dtype.element_ty)
    wn = tl.load(o_norm_weight + o_v, mask=m_k, other=0.) * on
    b_g = tl.load(g + i_b.to(tl.int64) * H * K + i_h * K + o_v, mask=m_k, other=0.).to(tl.float32)
    y = wn.to(tl.float32) * tl.sigmoid(b_g)
    tl.store(o + i_b.to(tl.int64) * H * K + i_h * K + o_v, y.to(o.dtype.element_ty), mask=m_k)


@triton.jit
def kda_decode_fwd_kernel(
    qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,   # inputs
    o, conv_out, state_out,                                                          # outputs
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
    LOWER: tl.constexpr, EPS: tl.constexpr, PDL: tl.constexpr = False,
):
    """`k3::kda_decode`, one program per (sequence, head): conv window, gates, delta rule, head norm, gate.
    PDL (programmatic dependent launch, `launch.pdl_args`): wait for the stream predecessor before anything else."""
    pdl_wait(PDL)
    _decode_head(qkv, conv_state, conv_weight, f, f, b, g, A_log, dt_bias, o_norm_weight, state, o, conv_out,
                 state_out, H, K, K, W, BK, BK, BW, LOWER, EPS, False, False)


@triton.jit
def kda_decode_inplace_fwd_kernel(
    qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight,   # inputs
    state, o,                                                                            # state (in place), output
    H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    BW: tl.constexpr, LOWER: tl.constexpr, EPS: tl.constexpr, FOLD: tl.constexpr, PDL: tl.constexpr = False,
):
    """`k3::kda_decode_inplace`: the same step writing conv_state and state over themselves; FOLD: f is f_a and
    the f_b_proj GEMV runs inside (one launch fewer per KDA layer). PDL: as `kda_decode_fwd_kernel` (the wait
    also keeps this kernel's in-place writes after everything its predecessors read)."""
    pdl_wait(PDL)
    _decode_head(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight, state, o,
                 conv_state, state, H, K, R, W, BK, BR, BW, LOWER, EPS, FOLD, True)


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration (shared with the AOT contract in trt.py) and host wrappers.

def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def prefill_config(K: int, V: int) -> dict:
    """Block sizes and warps of the two prefill launches for head dims K, V (K = V = 128 is the tuned case): the
    intra kernel (`intra_warps`, `low_ab`) and the fused state pass (BV / state_warps / state_stages). Shared
    with the AOT contract in trt.py.
    `low_ab` (bf16 inputs only): bf16 operands for the A_kk/A_qk and W/U products, as fla does. H200, T=8192,
    H=96 (2026-11-29 21:10): 3.25 ms vs 4.90 ms with fp32/tf32 operands, o rel. RMS 4.4e-3 vs 3.5e-3: on.
    State pass, H200, B=1, T=8192, H=96 (2026-11-30 00:42, `bench kda --sweep`, each launch timed alone): BV 64 /
    4 warps / 1 stage 0.698 ms vs 2 stages 0.842 ms (end to end 3.14 vs 3.26 ms), errors identical, and the
    mixed-length `cuda` test (H = 96, lengths 3000/1717/1) passes: 1 stage at K = V = 128. BV = 32 with 1 stage
    gives wrong outputs there (o rel. RMS 1.2 at T = 8192; exact under the interpreter; cause not found, seen on
    2026-11-29 and 2026-11-30): do not use BV < 64. The `full` intra launch is 2.41 of the 3.14 ms; ptxas (sm_90a) gives
    it 255 registers with spills at 8 warps (one program per SM).
    Intra variants (`intra`, INTRA_CONFIGS, env K3_KDA_INTRA). H200, same shape (2026-11-30 01:41, `bash
    scripts/gpu_kda.sh`, intra launch alone): `full` 8 warps 2.40 ms (end to end 3.10 ms), 16 warps 7.02 ms; a
    K-blocked kernel (K, V in 32/64-channel blocks, 184-205 registers without spills offline) was slower at every
    setting: 8 warps 4.62 ms, 128-register cap (two programs per SM) 3.28 ms, 64-channel blocks 3.80 ms, and at 4
    warps gave NaN (32-channel) or an illegal memory access (16-channel) there; removed (git history, perf.md).
    H200, same shape (2026-11-30 02:01, `bash scripts/gpu_kda.sh`, each intra launch alone): `split-wu4r168`
    (two launches: gate and A_kk/A_qk at 8 warps, then the UT transform and W/U at 4 warps capped at 168
    registers, three programs per SM) 2.19 ms vs `full` 2.41 ms, end to end 2.89 vs 3.10 ms, errors identical
    (o 4.38e-3, state 2.86e-3); fla's chunk_kda 2.62 ms in the same run. The prefill `cuda` tests passed with it
    (7/7, K3_KDA_INTRA=split-wu4r168): the default at K = V = 128. Slower there: an 8-warp second launch 2.67,
    8 warps capped at 128 2.64, `full` with a run-time J loop 2.90, a 16-warp first launch 3.12-3.62 ms.
    2026-11-30 03:22 (same shape and command): the first launch rewritten with exp2 and per-block references (two
    [BT, BK] exp2s instead of ten exps, vector factors for the rest): the pair 2.04 vs 2.19 ms, end to end 2.74 ms
    (fla 2.63 in the same call), errors the same to 3 digits; the 4-warp first launch 2.09, capped at 128 registers
    3.54 ms; the cuda prefill tests passed with it (7/7). 2026-11-30 03:38, with the gate's sigmoid on exp2 and an
    approximate division and the block-end reductions as one: 8-warp pair 2.00 ms (end to end 2.70), **4-warp
    first launch (`split-a4-wu4r168`, two programs per SM despite 1.6 KB of spills) 1.77 ms, end to end 2.485 ms vs
    fla's chunk_kda 2.622 ms in the same call**, errors unchanged (o 4.38e-3, state 2.86e-3): the default at
    K = V = 128. The state pass at BV 128 / 8 warps / 2 stages (96 programs, one wave) 0.76 vs 0.70 ms.
    `intra_stages` / `intra_maxnreg`: the intra launch's pipeline stages and register cap."""
    big = max(K, V) >= 64
    cfg = dict(BT=CHUNK, BK=_pow2(K), BV_intra=_pow2(V), BV=min(_pow2(V), 64), intra_warps=8 if big else 4,
               low_ab=True, state_warps=4, state_stages=1, intra="full", intra_stages=1, intra_maxnreg=None,
               wu_warps=8, wu_maxnreg=None)
    if big:
        cfg.update(INTRA_CONFIGS["split-a4-wu4r168"])
    name = os.environ.get("K3_KDA_INTRA")
    if name:
        if name not in INTRA_CONFIGS:
            raise ValueError(f"K3_KDA_INTRA={name!r}: unknown intra variant; use one of {sorted(INTRA_CONFIGS)}")
        cfg.update(INTRA_CONFIGS[name])
    return cfg


# Named intra-launch variants (prefill_config overrides; env K3_KDA_INTRA=<name> selects one for the op and the
# tests). "full": `kda_prefill_intra_fwd_kernel`, one launch (the AOT contract's); "split*":
# `kda_prefill_akk_fwd_kernel` (gate, A_kk, A_qk; `intra_warps`) then `kda_prefill_wu_fwd_kernel` (UT transform, W,
# U; `wu_warps`, `wu_maxnreg`). Variants measured slower on the H200 and removed (docs/perf.md, 2026-11-30): the
# full kernel with a run-time J loop, 8-warp and 128-register second launches, 16-warp first launches, a 128-register
# cap on the first launch. ptxas sm_90a (offline, triton 3.9), registers / spill stores: full 8w 255 / 352 B;
# akk 8w 255 / 12 B, akk 4w 255 / 1.9 KB (two programs per SM); wu 4w cap 168 / 0 (three programs per SM).
INTRA_CONFIGS = {
    "full": dict(intra="full", intra_warps=8),
    "split-wu4r168": dict(intra="split", intra_warps=8, wu_warps=4, wu_maxnreg=168),
    "split-a4-wu4r168": dict(intra="split", intra_warps=4, wu_warps=4, wu_maxnreg=168),
}


def intra_kernel(cfg: dict, K: int, V: int, dtype: torch.dtype, lower_bound: float):
    """(kernel, constexprs but H) of the one-launch intra kernel for this config: the AOT contract's intra
    launch (trt.py) and `prefill_intra_fwd` alike. The split variant is two launches with an fp32 scratch, which
    an AOT plugin (one launch, no workspace) cannot express: its contract keeps the full kernel."""
    dt = compute_dtype(dtype)
    if cfg["intra"] not in ("full", "split"):
        raise ValueError(f"prefill config: unknown intra kernel {cfg['intra']!r} (full, split)")
    return kda_prefill_intra_fwd_kernel, dict(K=K, V=V, BK=cfg["BK"], BV=cfg["BV_intra"], BT=cfg["BT"], BC=BC,
                                              LOWER=float(lower_bound), PREC=_prec(dt),
                                              LOW=bool(cfg["low_ab"]) and dt == torch.bfloat16)


def decode_config(K: int, W: int) -> dict:
    """Warps and register cap of `kda_decode_fwd_kernel` (the whole [K, V] state per program; also the AOT
    contract's kernel). `maxnreg`: register cap per thread. At K = 128 the fused kernel needs 202 registers at 4 warps (ptxas,
    sm_90a), so 2 programs fit on an SM; capped at 168, 3 fit (112 B spilled). H200, H=96 (2026-11-30 00:24,
    `bench kda --sweep`): B=256 0.889 vs 0.968 ms (85% vs 78% of copy), B=64 0.231 vs 0.250 ms (81% vs 75%),
    errors unchanged. (A cap of 128, 4 programs per SM, spills 600 B and is slower: 58%. A variant with both
    state reductions on the loaded state, 189 registers, was no faster: 84% / 80% with the same cap; [K, BV]
    column-block variants were 36-52%.)"""
    # 4 warps: H200, H=96, B=1..256 (2026-11-29 21:10) 1.5-1.9x faster than 8 warps (B=256: 0.97 vs 1.81 ms).
    return dict(BK=_pow2(K), BW=triton.next_power_of_2(W), num_warps=4, maxnreg=168 if _pow2(K) == 128 else None)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the prefill intermediates and of the tensor-core operands: the input dtype when half-width."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def _check_prefill(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound) -> None:
    if q.dim() != 4:
        raise ValueError(f"kda_prefill: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    want = {"k": (k, (B, T, H, K)), "f": (f, (B, T, H, K)), "v": (v, (B, T, H, V)), "b": (b, (B, T, H)),
            "initial_state": (initial_state, (B, H, K, V)), "lengths": (lengths, (B,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"kda_prefill: {name} must have shape {shape} (from q {tuple(q.shape)}), "
                             f"got {tuple(t.shape)}")
    if A_log.numel() < H or dt_bias.numel() != H * K:
        raise ValueError(f"kda_prefill: need A_log with >= {H} entries and dt_bias with {H * K}, got "
                         f"{A_log.numel()} and {dt_bias.numel()}")
    if not -5.5 <= lower_bound < 0:
        raise ValueError(f"kda_prefill kernel: lower_bound must be in [-5.5, 0) (16-token sub-tile decays must "
                         f"stay below e^88), got {lower_bound}; use the reference op for other gates")


def prefill_intra_fwd(q, k, v, f, b, A_log, dt_bias, lengths, lower_bound: float, cfg: dict) -> dict:
    """The intra launch. Inputs contiguous `[B, T, H, K]`, lengths int64. Returns the intermediates w, u, qg, kd,
    aqk (`[B*H*NT*BT, K|V|BT]`, compute dtype) and gl (`[B*H*NT, K]` fp32)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = cfg["BT"]
    NT = triton.cdiv(T, BT)
    dt = compute_dtype(q.dtype)
    rows = B * H * NT * BT
    out = {n: q.new_empty(rows, K, dtype=dt) for n in ("w", "qg", "kd")}
    out.update(u=q.new_empty(rows, V, dtype=dt), aqk=q.new_empty(rows, BT, dtype=dt),
               gl=q.new_empty(B * H * NT, K, dtype=torch.float32))
    kernel, cx = intra_kernel(cfg, K, V, q.dtype, lower_bound)
    opts = dict(num_warps=cfg["intra_warps"], num_stages=cfg["intra_stages"], **_maxnreg(cfg["intra_maxnreg"]))
    if cfg["intra"] == "full":
        launch(kernel)[(NT, B * H)](
            q, k, v, f, b, A_log.contiguous(), dt_bias.contiguous(), lengths, T,
            out["w"], out["u"], out["qg"], out["kd"], out["aqk"], out["gl"], H=H, **cx, **opts)
        return out
    akk = q.new_empty(rows, BT, dtype=torch.float32)                   # scratch between the two launches
    launch(kda_prefill_akk_fwd_kernel)[(NT, B * H)](
        q, k, f, b, A_log.contiguous(), dt_bias.contiguous(), lengths, T,
        out["w"], out["qg"], out["kd"], out["aqk"], out["gl"], akk,
        H=H, K=K, BK=cx["BK"], BT=BT, BC=BC, LOWER=cx["LOWER"], PREC=cx["PREC"], LOW=cx["LOW"],
        FAST_MATH=FAST_MATH, **opts)
    launch(kda_prefill_wu_fwd_kernel)[(NT, B * H)](
        v, b, lengths, T, akk, out["w"], out["u"],
        H=H, K=K, V=V, BK=cx["BK"], BV=cx["BV"], BT=BT, BC=BC, PREC=cx["PREC"], LOW=cx["LOW"],
        num_warps=cfg["wu_warps"], num_stages=1, **_maxnreg(cfg["wu_maxnreg"]))
    return out


def prefill_state_fwd(inter: dict, initial_state, lengths, shape: tuple, out_dtype: torch.dtype, cfg: dict):
    """The inter-chunk state pass on the intra launch's intermediates. shape = (B, T, H, K, V); initial_state fp32
    `[B, H, K, V]`. Returns (o `[B, T, H, V]`, ht fp32)."""
    B, T, H, K, V = shape
    o = inter["w"].new_empty(B, T, H, V, dtype=out_dtype)
    ht = torch.empty(initial_state.shape, device=o.device, dtype=torch.float32)    # contiguous, as written
    launch(kda_prefill_fwd_kernel)[(triton.cdiv(V, cfg["BV"]), B * H)](
        inter["w"], inter["u"], inter["qg"], inter["kd"], inter["aqk"], inter["gl"], initial_state, lengths,
        T, o, ht, H=H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], BT=cfg["BT"], PREC=_prec(inter["w"].dtype),
        num_warps=cfg["state_warps"], num_stages=cfg["state_stages"])
    return o, ht


def _maxnreg(n: int | None) -> dict:
    """The launch option capping registers per thread, where a config sets one."""
    return {"maxnreg": n} if n else {}


def _prec(dt: torch.dtype) -> str:
    return "ieee" if dt == torch.float32 else "tf32"       # fp32 callers get fp32 products


def kda_prefill_fwd(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound: float,
                    config: dict | None = None):
    """Launch the prefill kernels (intra, then the state pass). Shapes as `k3::kda_prefill`; initial_state fp32.
    Returns (o, final_state). `config` overrides entries of `prefill_config` (benchmark sweeps)."""
    _check_prefill(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound)
    B, T, H, K = q.shape
    V = v.shape[-1]
    cfg = {**prefill_config(K, V), **(config or {})}
    q, k, v, f, b = (x.contiguous() for x in (q, k, v, f, b))
    lengths = lengths.to(torch.int64).contiguous()
    inter = prefill_intra_fwd(q, k, v, f, b, A_log, dt_bias, lengths, lower_bound, cfg)
    o, ht = prefill_state_fwd(inter, initial_state.to(torch.float32).contiguous(), lengths, (B, T, H, K, V),
                              q.dtype, cfg)
    return o, ht.to(initial_state.dtype)


def _check_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                  check_f: bool = True) -> None:
    B, H = b.shape
    C = qkv.shape[-1]
    if qkv.dim() != 2 or C % (3 * H):
        raise ValueError(f"kda_decode: qkv must be [B, 3*H*K] with H = b.shape[1] = {H}, got {tuple(qkv.shape)}")
    K = C // (3 * H)
    W = conv_weight.shape[-1]
    want = {"conv_state": (conv_state, (B, C, W - 1)), "conv_weight": (conv_weight, (C, W)),
            "g": (g, (B, H * K)), "o_norm_weight": (o_norm_weight, (K,)),
            "state": (state, (B, H, K, K)), "dt_bias": (dt_bias, (H * K,))}
    if check_f:
        want["f"] = (f, (B, H * K))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"kda_decode: {name} must have shape {shape} (from qkv {tuple(qkv.shape)}, "
                             f"b {tuple(b.shape)}), got {tuple(t.shape)}")
    if A_log.numel() < H:
        raise ValueError(f"kda_decode: A_log needs >= {H} entries, got {A_log.numel()}")
    if W < 2:
        raise ValueError(f"kda_decode: conv kernel size must be >= 2, got {W}")


def _decode_launch(H: int, K: int, W: int, lower_bound: float, eps: float, config: dict | None) -> dict:
    """The constexprs and launch options both decode kernels share (`decode_config`, `config` overriding)."""
    cfg = {**decode_config(K, W), **(config or {})}
    common = dict(H=H, K=K, W=W, BK=cfg["BK"], BW=cfg["BW"], LOWER=float(lower_bound), EPS=float(eps),
                  num_warps=cfg["num_warps"])
    if cfg.get("maxnreg"):
        common["maxnreg"] = cfg["maxnreg"]
    return common


def kda_decode_fwd(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                   lower_bound: float, eps: float, config: dict | None = None):
    """Launch the fused decode step. Shapes as `k3::kda_decode`; state fp32. Returns (o, new_conv, new_state)."""
    _check_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state)
    B, H = b.shape
    K = qkv.shape[-1] // (3 * H)
    args = [x.contiguous() for x in (qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight)]
    o = qkv.new_empty(B, H * K)
    conv_out = torch.empty(args[1].shape, device=qkv.device, dtype=args[1].dtype)   # contiguous, as written
    state_out = torch.empty(state.shape, device=qkv.device, dtype=torch.float32)
    common = _decode_launch(H, K, conv_weight.shape[-1], lower_bound, eps, config)
    launch(kda_decode_fwd_kernel)[(B * H,)](*args, state.to(torch.float32).contiguous(), o, conv_out, state_out,
                                            **common, **pdl_args(o))
    return o, conv_out, state_out.to(state.dtype)


def kda_decode_inplace_fwd(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight, state,
                           lower_bound: float, eps: float, config: dict | None = None):
    """`k3::kda_decode_inplace` in one launch: conv_state and state are overwritten with the step's new window and
    state (both must be contiguous, the state fp32: else the out-of-place kernel runs and its results are copied
    over them). With f_b_weight `[H*K, R]`, f is f_a `[B, R]`. Returns o."""
    B, H = b.shape
    K = qkv.shape[-1] // (3 * H)
    if f_b_weight is not None:
        check(f.dim() == 2 and f.shape[0] == B and tuple(f_b_weight.shape) == (H * K, f.shape[-1]),
              f"kda_decode_inplace: f_a {tuple(f.shape)} and f_b_weight {tuple(f_b_weight.shape)} must be [B={B}, r] "
              f"and [H*K={H * K}, r]")
    _check_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                  check_f=f_b_weight is None)
    if not (conv_state.is_contiguous() and state.is_contiguous() and state.dtype == torch.float32):
        if f_b_weight is not None:
            f = torch.nn.functional.linear(f, f_b_weight)
        o, new_conv, new_state = kda_decode_fwd(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias,
                                                o_norm_weight, state, lower_bound, eps, config)
        conv_state.copy_(new_conv)
        state.copy_(new_state)
        return o
    fold = f_b_weight is not None
    R = f.shape[-1] if fold else K
    args = [x.contiguous() for x in (qkv, conv_state, conv_weight, f, f_b_weight if fold else f, b, g, A_log,
                                     dt_bias, o_norm_weight)]
    o = qkv.new_empty(B, H * K)
    common = dict(_decode_launch(H, K, conv_weight.shape[-1], lower_bound, eps, config), R=R,
                  BR=max(32, triton.next_power_of_2(R)), FOLD=fold)
    launch(kda_decode_inplace_fwd_kernel)[(B * H,)](*args, state, o, **common, **pdl_args(o))
    return o



# ---------------------------------------------------------------------------------------------------------------
# The ops' CUDA implementations. Float64 calls (validation runs) keep the reference: the kernels compute in fp32.

def _wide(*ts: torch.Tensor) -> bool:
    return any(t.dtype == torch.float64 for t in ts)


def prefill_kernel_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """The prefill kernels serve bf16/fp16 inputs with K = V = 128 (K3; verified on the H200). Other head dims
    and fp32 inputs keep the reference (fp32 intra tiles at K = 128 exceed the 227 KB of shared memory)."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == v.shape[-1] == 128


def _prefill_cuda(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound):
    if _wide(q, k, v, f, initial_state) or not prefill_kernel_applies(q, v):
        return kda_prefill._init_fn(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound)
    return kda_prefill_fwd(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound)


def _decode_cuda(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state, lower_bound, eps):
    if _wide(qkv, conv_state, state):
        return kda_decode._init_fn(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                                   lower_bound, eps)
    return kda_decode_fwd(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                          lower_bound, eps)


def _decode_inplace_cuda(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight, state,
                         lower_bound, eps):
    if _wide(qkv, conv_state, state):
        return kda_decode_inplace._init_fn(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias,
                                           o_norm_weight, state, lower_bound, eps)
    return kda_decode_inplace_fwd(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight,
                                  state, lower_bound, eps)


# K3_KDA_TRITON=0 keeps the reference on CUDA too (escape hatch while the kernels are young).
if os.environ.get("K3_KDA_TRITON", "1") != "0":
    kda_prefill.register_kernel("cuda")(_prefill_cuda)
    kda_decode.register_kernel("cuda")(_decode_cuda)
    kda_decode_inplace.register_kernel("cuda")(_decode_inplace_cuda)
