"""Triton KDA kernels: the CUDA implementations of `k3::kda_prefill` and `k3::kda_decode` (see CONTRACT.md).

Prefill is two launches over right-padded `[B, T, H, K]` inputs, chunk BT = 64:
  1. `kda_prefill_intra_fwd_kernel`, one program per (chunk, sequence*head), all chunks in parallel: L2 norm,
     lower-bound gate, in-chunk cumulative decay Gam, A_kk / A_qk from 16-row sub-tiles (every exponent <= 80,
     so nothing overflows fp32), the UT transform X = (I + A_kk)^-1 (block Neumann series, exact for the
     nilpotent strictly-lower A_kk), W = X beta exp(Gam) K, U = X beta V. Writes W, U, exp(Gam) Q,
     exp(Gam_C - Gam) K, A_qk (compute dtype) and Gam_C (fp32).
  2. `kda_prefill_fwd_kernel`, one program per (V block, sequence*head), chunks in order: the inter-chunk state
     pass Vn = U - W S, O = exp(Gam) Q S + A_qk Vn, S <- exp(Gam_C) S + (exp(Gam_C - Gam) K)^T Vn, fp32 state.
  Launch 1 has variants (`prefill_config()["intra"]`): `kda_prefill_intra_fwd_kernel` ("full": 64-wide tiles,
  the kernel of the AOT contract in trt.py), `kda_prefill_intra_sub_fwd_kernel` ("sub": 16-row sub-blocks loaded
  by their own pointers, 16x16 block inverses), `kda_prefill_intra_col_fwd_kernel` / `..._colk_fwd_kernel`
  ("col"/"colk": A_kk, A_qk by 16-column blocks with their own [16, K] right operands; colk also cuts K into
  slices); same outputs. Launch 2 has a split variant (`["state"] = "split"`, fla's): a sequential h-pass
  (`kda_prefill_h_fwd_kernel`: Vn and each chunk's entering state) and a parallel o-pass
  (`kda_prefill_o_fwd_kernel`). See `prefill_config` for what the H200 showed.
Decode is one launch, `kda_decode_fwd_kernel`, one program per (sequence, head) holding its [K, V] state
(variant "vblock", `kda_decode_vblock_fwd_kernel`: the same in [K, BV] column blocks).

Each op's launch configuration lives in `*_config` functions shared with the AOT contract in `trt.py`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..launch import launch
from .op import CHUNK, kda_decode, kda_prefill

BC = 16  # sub-tile rows: 16 steps of a gate > -5 decay by less than e^80, finite in fp32


@triton.jit
def _mm(a, b, low_dtype, PREC: tl.constexpr, LOW: tl.constexpr):
    """fp32 x fp32 product at PREC, or (LOW) with both operands rounded to low_dtype (bf16: same exponent range,
    so the e^80 diagonal-block factors stay finite), fp32 accumulation."""
    if LOW:
        return tl.dot(a.to(low_dtype), b.to(low_dtype))
    return tl.dot(a, b, input_precision=PREC)


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
    NC: tl.constexpr = BT // BC
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
    p_k = tok[:, None] * (H * K) + i_h * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_f = tl.load(f + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_v = tl.load(v + tok[:, None] * (H * V) + i_h * V + o_v[None, :],
                  mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_beta = tl.where(m_valid, b_beta, 0.)                              # padding: no write

    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None] * (K ** -0.5)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_g = LOWER * tl.sigmoid(a * (b_f + b_bias[None, :]))
    b_g = tl.where(m_valid[:, None] & m_k[None, :], b_g, 0.)           # padding: alpha = 1
    b_G = tl.cumsum(b_g, 0)                                             # [BT, BK] in-chunk Gam

    # A_kk, A_qk by column blocks J of BC rows, referenced to c_J = Gam at J's last row:
    # exp(Gam_i - Gam_j) = exp(Gam_i - c_J) * exp(c_J - Gam_j); the first factor is <= e^80 on the
    # diagonal block and <= 1 below it, the second <= 1. Rows above block J are masked out (-inf exponent).
    r_t = tl.arange(0, BT)
    # Right operands are full [BT, BK] tiles with the rows outside block J zeroed. (Cutting [BC, BK] sub-tiles
    # with tl.reshape is 4x fewer MACs and exact under the interpreter, but gave a wrong U on the H200 with
    # Triton 3.6; cause not found.)
    b_Aqk = tl.zeros((BT, BT), dtype=tl.float32)
    b_A = tl.zeros((BT, BT), dtype=tl.float32)
    for J in tl.static_range(NC):
        c_J = tl.sum(tl.where(r_t[:, None] == J * BC + BC - 1, b_G, 0.), 0)           # [BK]
        e_J = tl.exp(tl.where(r_t[:, None] >= J * BC, b_G - c_J[None, :], float("-inf")))
        in_J = (r_t[:, None] >= J * BC) & (r_t[:, None] < J * BC + BC)
        r_J = tl.trans(b_k * tl.exp(tl.where(in_J, c_J[None, :] - b_G, float("-inf"))))   # [BK, BT]
        b_Aqk += _mm(b_q * e_J, r_J, w.dtype.element_ty, PREC, LOW)
        b_A += _mm(b_k * e_J, r_J, w.dtype.element_ty, PREC, LOW)
    b_Aqk = tl.where(r_t[:, None] >= r_t[None, :], b_Aqk, 0.)
    tl.store(aqk + (i_bh * NT * BT + i_n * BT + r_t[:, None]).to(tl.int64) * BT + r_t[None, :],
             b_Aqk.to(aqk.dtype.element_ty))
    b_A = tl.where(r_t[:, None] > r_t[None, :], b_A * b_beta[:, None], 0.)

    # UT transform X = (I + A)^-1. D = I + A_bd (the diagonal BC-blocks) is nilpotent-shifted of order BC:
    # D^-1 = (I - A_bd)(I + A_bd^2)(I + A_bd^4)(I + A_bd^8). N = D^-1 A_lo has N^NC = 0 (NC = 4 blocks):
    # X = (I - N)(I + N^2) D^-1.
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
    X = tl.dot(tl.dot(eye - N1, eye + N2, input_precision=PREC), D_inv, input_precision=PREC)

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


# --- Prefill intra launch, sub-tiled variant (`intra="sub"`; correct on the H200 but slower, see prefill_config) ----
# The same outputs as `kda_prefill_intra_fwd_kernel`, computed on 16-row sub-blocks I = 0..3 of the chunk, each
# loaded with its own pointers (no tl.reshape): A_qk / A_kk as 10 lower [BC, BC] blocks, the UT transform as
# 16x16 block inverses merged by block forward substitution (X_IJ = -X_II sum_{J<=M<I} A_IM X_MJ), W_I, U_I as
# sum_J X_IJ R_J. Decays: G_I = in-chunk cumulative gate of block I's rows, c_I = G at block I's last row.

@triton.jit
def _sub_gate(f, tok, m_t, m_valid, i_h, o_k, m_k, a, b_bias, c_prev, H: tl.constexpr, K: tl.constexpr,
              LOWER: tl.constexpr, BC: tl.constexpr):
    """Block rows' in-chunk cumulative gate G = c_prev + cumsum(g) [BC, BK] and its last row c [BK]."""
    b_f = tl.load(f + tok[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.).to(tl.float32)
    b_g = LOWER * tl.sigmoid(a * (b_f + b_bias[None, :]))
    b_g = tl.where(m_valid[:, None] & m_k[None, :], b_g, 0.)           # padding: alpha = 1
    b_G = c_prev[None, :] + tl.cumsum(b_g, 0)
    c = tl.sum(tl.where(tl.arange(0, BC)[:, None] == BC - 1, b_G, 0.), 0)
    return b_G, c


@triton.jit
def _sub_block(q, k, v, f, b, lengths, T, i_b, i_h, i_n, I, a, b_bias, c_prev,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr):
    """Rows I*BC.. of chunk i_n: (qn, kn [BC, BK], v [BC, BV] fp32, G [BC, BK], c [BK], beta [BC])."""
    length = tl.load(lengths + i_b).to(tl.int32)
    o_t = i_n * BT + I * BC + tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t = o_t < T
    m_valid = o_t < length
    m_k = o_k < K
    tok = (i_b * T + o_t).to(tl.int64)
    p_k = tok[:, None] * (H * K) + i_h * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_v = tl.load(v + tok[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_t[:, None] & (o_v < V)[None, :],
                  other=0.).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_beta = tl.where(m_valid, b_beta, 0.)                              # padding: no write
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None] * (K ** -0.5)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_G, c = _sub_gate(f, tok, m_t, m_valid, i_h, o_k, m_k, a, b_bias, c_prev, H, K, LOWER, BC)
    return b_q, b_k, b_v, b_G, c, b_beta


@triton.jit
def _sub_diag(b_q, b_k, b_G, c, b_beta, low_dtype, PREC: tl.constexpr, LOW: tl.constexpr, BC: tl.constexpr):
    """Diagonal block: A_qk (i >= j), beta-scaled A_kk (i > j), referenced to c (factors <= e^80 and <= 1), and
    the block's right operand kr = kn exp(c - G) for the blocks below it."""
    o_i = tl.arange(0, BC)
    kr = b_k * tl.exp(c[None, :] - b_G)
    e = tl.exp(b_G - c[None, :])
    krT = tl.trans(kr)
    A_qk = tl.where(o_i[:, None] >= o_i[None, :], _mm(b_q * e, krT, low_dtype, PREC, LOW), 0.)
    A_kk = tl.where(o_i[:, None] > o_i[None, :], _mm(b_k * e, krT, low_dtype, PREC, LOW) * b_beta[:, None], 0.)
    return A_qk, A_kk, kr


@triton.jit
def _sub_inv(A, PREC: tl.constexpr, BC: tl.constexpr):
    """(I + A)^-1 for a strictly lower [BC, BC] block (A^16 = 0): (I - A)(I + A^2)(I + A^4)(I + A^8)."""
    o_i = tl.arange(0, BC)
    eye = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    P2 = tl.dot(A, A, input_precision=PREC)
    P4 = tl.dot(P2, P2, input_precision=PREC)
    P8 = tl.dot(P4, P4, input_precision=PREC)
    X = tl.dot(eye - A, eye + P2, input_precision=PREC)
    X = tl.dot(X, eye + P4, input_precision=PREC)
    return tl.dot(X, eye + P8, input_precision=PREC)


@triton.jit
def _sub_off(b_q, b_k, e, b_beta, kr, low_dtype, PREC: tl.constexpr, LOW: tl.constexpr):
    """Off-diagonal block (I, J < I): rows scaled by e = exp(G_I - c_J) <= 1, columns by kr_J."""
    krT = tl.trans(kr)
    return (_mm(b_q * e, krT, low_dtype, PREC, LOW),
            _mm(b_k * e, krT, low_dtype, PREC, LOW) * b_beta[:, None])


@triton.jit
def _sub_store(w, u, qg, kd, aqk, row0, b_q, b_k, b_G, c_last, b_w, b_u, A0, A1, A2, A3,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr):
    """Block rows of every intra output; A0..A3 are the A_qk blocks of columns 0..3 (zeros above the diagonal)."""
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    o_i = tl.arange(0, BC)
    m_k = o_k < K
    row = (row0 + o_i).to(tl.int64)
    p_o = row[:, None] * K + o_k[None, :]
    tl.store(w + p_o, b_w.to(w.dtype.element_ty), mask=m_k[None, :])
    tl.store(qg + p_o, (tl.exp(b_G) * b_q).to(qg.dtype.element_ty), mask=m_k[None, :])
    tl.store(kd + p_o, (tl.exp(c_last[None, :] - b_G) * b_k).to(kd.dtype.element_ty), mask=m_k[None, :])
    tl.store(u + row[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=(o_v < V)[None, :])
    p_a = aqk + row[:, None] * BT + o_i[None, :]
    dt = aqk.dtype.element_ty
    tl.store(p_a, A0.to(dt))
    tl.store(p_a + BC, A1.to(dt))
    tl.store(p_a + 2 * BC, A2.to(dt))
    tl.store(p_a + 3 * BC, A3.to(dt))


@triton.jit
def kda_prefill_intra_sub_fwd_kernel(
    q, k, v, f, b, A_log, dt_bias, lengths,          # inputs
    T,                                                # scalar: padded tokens per sequence
    w, u, qg, kd, aqk, gl,                            # outputs
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
):
    tl.static_assert(BT == 4 * BC, "the sub-tiled intra kernel is written for 4 sub-blocks")
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    ld = w.dtype.element_ty
    Z = tl.zeros((BC, BC), dtype=tl.float32)

    # Gate pass: c_I = G at the last row of block I (the chunk's G_C is c3), needed by every block's kd.
    c_m = tl.zeros((BK,), dtype=tl.float32)
    o_c = tl.arange(0, BC)
    _, c0 = _sub_gate(f, (i_b * T + i_n * BT + o_c).to(tl.int64), i_n * BT + o_c < T,
                      i_n * BT + o_c < length, i_h, o_k, m_k, a, b_bias, c_m, H, K, LOWER, BC)
    _, c1 = _sub_gate(f, (i_b * T + i_n * BT + BC + o_c).to(tl.int64), i_n * BT + BC + o_c < T,
                      i_n * BT + BC + o_c < length, i_h, o_k, m_k, a, b_bias, c0, H, K, LOWER, BC)
    _, c2 = _sub_gate(f, (i_b * T + i_n * BT + 2 * BC + o_c).to(tl.int64), i_n * BT + 2 * BC + o_c < T,
                      i_n * BT + 2 * BC + o_c < length, i_h, o_k, m_k, a, b_bias, c1, H, K, LOWER, BC)
    _, c3 = _sub_gate(f, (i_b * T + i_n * BT + 3 * BC + o_c).to(tl.int64), i_n * BT + 3 * BC + o_c < T,
                      i_n * BT + 3 * BC + o_c < length, i_h, o_k, m_k, a, b_bias, c2, H, K, LOWER, BC)
    row0 = (i_bh * NT + i_n) * BT                                      # first row of the chunk in [B*H*NT*BT]

    # Block 0.
    q0, k0, v0, G0, _, be0 = _sub_block(q, k, v, f, b, lengths, T, i_b, i_h, i_n, 0, a, b_bias, c_m,
                                        H, K, V, BK, BV, BT, BC, LOWER)
    Aq00, Ak00, kr0 = _sub_diag(q0, k0, G0, c0, be0, ld, PREC, LOW, BC)
    X00 = _sub_inv(Ak00, PREC, BC)
    R0 = (be0[:, None] * tl.exp(G0) * k0)                              # [BC, BK] right sides of W
    Rv0 = (be0[:, None] * v0)                                           # [BC, BV] right sides of U
    w0 = _mm(X00, R0, ld, PREC, LOW)
    u0 = _mm(X00, Rv0, ld, PREC, LOW)
    _sub_store(w, u, qg, kd, aqk, row0, q0, k0, G0, c3, w0, u0, Aq00, Z, Z, Z, K, V, BK, BV, BT, BC)

    # Block 1.
    q1, k1, v1, G1, _, be1 = _sub_block(q, k, v, f, b, lengths, T, i_b, i_h, i_n, 1, a, b_bias, c0,
                                        H, K, V, BK, BV, BT, BC, LOWER)
    e1 = tl.exp(G1 - c0[None, :])                                      # exp(G_1 - c_0) <= 1
    Aq10, Ak10 = _sub_off(q1, k1, e1, be1, kr0, ld, PREC, LOW)
    Aq11, Ak11, kr1 = _sub_diag(q1, k1, G1, c1, be1, ld, PREC, LOW, BC)
    X11 = _sub_inv(Ak11, PREC, BC)
    X10 = -tl.dot(X11, tl.dot(Ak10, X00, input_precision=PREC), input_precision=PREC)
    R1 = (be1[:, None] * tl.exp(G1) * k1)
    Rv1 = (be1[:, None] * v1)
    w1 = _mm(X10, R0, ld, PREC, LOW) + _mm(X11, R1, ld, PREC, LOW)
    u1 = _mm(X10, Rv0, ld, PREC, LOW) + _mm(X11, Rv1, ld, PREC, LOW)
    _sub_store(w, u, qg, kd, aqk, row0 + BC, q1, k1, G1, c3, w1, u1, Aq10, Aq11, Z, Z, K, V, BK, BV, BT, BC)

    # Block 2.
    q2, k2, v2, G2, _, be2 = _sub_block(q, k, v, f, b, lengths, T, i_b, i_h, i_n, 2, a, b_bias, c1,
                                        H, K, V, BK, BV, BT, BC, LOWER)
    e2 = tl.exp(G2 - c1[None, :])                                      # exp(G_2 - c_1) <= 1
    Aq21, Ak21 = _sub_off(q2, k2, e2, be2, kr1, ld, PREC, LOW)
    Aq20, Ak20 = _sub_off(q2, k2, e2 * tl.exp(c1 - c0)[None, :], be2, kr0, ld, PREC, LOW)
    Aq22, Ak22, kr2 = _sub_diag(q2, k2, G2, c2, be2, ld, PREC, LOW, BC)
    X22 = _sub_inv(Ak22, PREC, BC)
    X21 = -tl.dot(X22, tl.dot(Ak21, X11, input_precision=PREC), input_precision=PREC)
    X20 = -tl.dot(X22, tl.dot(Ak20, X00, input_precision=PREC) + tl.dot(Ak21, X10, input_precision=PREC),
                  input_precision=PREC)
    R2 = (be2[:, None] * tl.exp(G2) * k2)
    Rv2 = (be2[:, None] * v2)
    w2 = _mm(X20, R0, ld, PREC, LOW) + _mm(X21, R1, ld, PREC, LOW) + _mm(X22, R2, ld, PREC, LOW)
    u2 = _mm(X20, Rv0, ld, PREC, LOW) + _mm(X21, Rv1, ld, PREC, LOW) + _mm(X22, Rv2, ld, PREC, LOW)
    _sub_store(w, u, qg, kd, aqk, row0 + 2 * BC, q2, k2, G2, c3, w2, u2, Aq20, Aq21, Aq22, Z,
               K, V, BK, BV, BT, BC)

    # Block 3.
    q3, k3, v3, G3, _, be3 = _sub_block(q, k, v, f, b, lengths, T, i_b, i_h, i_n, 3, a, b_bias, c2,
                                        H, K, V, BK, BV, BT, BC, LOWER)
    e3 = tl.exp(G3 - c2[None, :])                                      # exp(G_3 - c_2) <= 1
    Aq32, Ak32 = _sub_off(q3, k3, e3, be3, kr2, ld, PREC, LOW)
    Aq31, Ak31 = _sub_off(q3, k3, e3 * tl.exp(c2 - c1)[None, :], be3, kr1, ld, PREC, LOW)
    Aq30, Ak30 = _sub_off(q3, k3, e3 * tl.exp(c2 - c0)[None, :], be3, kr0, ld, PREC, LOW)
    Aq33, Ak33, _ = _sub_diag(q3, k3, G3, c3, be3, ld, PREC, LOW, BC)
    X33 = _sub_inv(Ak33, PREC, BC)
    X32 = -tl.dot(X33, tl.dot(Ak32, X22, input_precision=PREC), input_precision=PREC)
    X31 = -tl.dot(X33, tl.dot(Ak31, X11, input_precision=PREC) + tl.dot(Ak32, X21, input_precision=PREC),
                  input_precision=PREC)
    X30 = -tl.dot(X33, tl.dot(Ak30, X00, input_precision=PREC) + tl.dot(Ak31, X10, input_precision=PREC)
                  + tl.dot(Ak32, X20, input_precision=PREC), input_precision=PREC)
    R3 = (be3[:, None] * tl.exp(G3) * k3)
    Rv3 = (be3[:, None] * v3)
    w3 = (_mm(X30, R0, ld, PREC, LOW) + _mm(X31, R1, ld, PREC, LOW) + _mm(X32, R2, ld, PREC, LOW)
          + _mm(X33, R3, ld, PREC, LOW))
    u3 = (_mm(X30, Rv0, ld, PREC, LOW) + _mm(X31, Rv1, ld, PREC, LOW) + _mm(X32, Rv2, ld, PREC, LOW)
          + _mm(X33, Rv3, ld, PREC, LOW))
    _sub_store(w, u, qg, kd, aqk, row0 + 3 * BC, q3, k3, G3, c3, w3, u3, Aq30, Aq31, Aq32, Aq33,
               K, V, BK, BV, BT, BC)
    tl.store(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, c3, mask=m_k)


# --- Prefill intra launch, column-block variant (`intra="col"`) ---------------------------------------------------
# `kda_prefill_intra_fwd_kernel` with A_kk / A_qk formed from [BT, BC] column blocks: the right operand of column
# block J is its own BC rows (loaded by their own pointers, no tl.reshape), [BC, BK], so the products are
# [BT, BK] x [BK, BC] (4x fewer MACs than the zero-padded [BK, BT] tiles). A_qk's blocks are stored straight into
# `aqk`; A_kk's are placed into the [BT, BT] tile for the UT transform by one-hot products [BT, BC] x [BC, BT]
# (exact in fp32, one tf32 rounding of A_kk under tf32). The UT transform, W and U are those of the full kernel
# (`LOW_UT`: its products with bf16 operands, a sweep option). Exact under the interpreter; on the H200 (Triton
# 3.6, 2026-11-30 00:28) an illegal memory access at T = 3072 and 8192 (not at T = 64): not usable there yet.

@triton.jit
def _col_block(k, f, T, length, i_b, i_h, i_n, J, a, b_bias, c_prev, c_J,
               H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               LOWER: tl.constexpr):
    """Column block J's right operand kn_j exp(c_J - G_j) [BC, BK] (factors <= 1): its rows' kn and in-chunk
    G = c_prev + cumsum(g) (c_prev = G at the row before the block, 0 for J = 0)."""
    o_t = i_n * BT + J * BC + tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_t = o_t < T
    m_k = o_k < K
    tok = (i_b * T + o_t).to(tl.int64)
    b_k = tl.load(k + tok[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.).to(tl.float32)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_G, _ = _sub_gate(f, tok, m_t, o_t < length, i_h, o_k, m_k, a, b_bias, c_prev, H, K, LOWER, BC)
    return b_k * tl.exp(c_J[None, :] - b_G)


@triton.jit
def _col_block_t(k, f, T, length, i_b, i_h, i_n, J, a, b_bias, c_prev, c_J, s_J, o_k,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr):
    """`_col_block` transposed at the load ([BK, BC] by pointers, no tl.trans: the `trans_load` option), over the
    K columns o_k; s_J: the block rows' k norm scales [BC], or None to compute them here (o_k must then be all K)."""
    o_t = i_n * BT + J * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_k = o_k < K
    tok = (i_b * T + o_t).to(tl.int64)
    p = tok[None, :] * (H * K) + i_h * K + o_k[:, None]                                  # [BK, BC]
    m = m_k[:, None] & m_t[None, :]
    b_k = tl.load(k + p, mask=m, other=0.).to(tl.float32)
    if s_J is None:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)[None, :]
    else:
        b_k = b_k * s_J[None, :]
    b_f = tl.load(f + p, mask=m, other=0.).to(tl.float32)
    b_g = LOWER * tl.sigmoid(a * (b_f + b_bias[:, None]))
    b_g = tl.where(m_k[:, None] & (o_t < length)[None, :], b_g, 0.)                    # padding: alpha = 1
    b_G = c_prev[:, None] + tl.cumsum(b_g, 1)
    return b_k * tl.exp(c_J[:, None] - b_G)


@triton.jit
def _col_place(a_kk, J, low_dtype, PREC: tl.constexpr, SPLIT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Column block J of A_kk ([BT, BC] fp32) placed into [BT, BT] by a one-hot product: at PREC, or (SPLIT) as two
    products in low_dtype of its high and low parts (no tf32; ~2^-16 relative in bf16). Only the strictly lower
    entries are kept (those on and above the diagonal can reach e^80, past fp16's range)."""
    r_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    a_kk = tl.where(r_t[:, None] > (J * BC + o_c)[None, :], a_kk, 0.)
    place = tl.where(o_c[:, None] + J * BC == r_t[None, :], 1., 0.)                     # [BC, BT]
    if SPLIT:
        hi = a_kk.to(low_dtype)
        lo = (a_kk - hi.to(tl.float32)).to(low_dtype)
        pl = place.to(low_dtype)
        return tl.dot(hi, pl) + tl.dot(lo, pl)
    return tl.dot(a_kk, place, input_precision=PREC)


@triton.jit
def kda_prefill_intra_col_fwd_kernel(
    q, k, v, f, b, A_log, dt_bias, lengths,          # inputs
    T,                                                # scalar: padded tokens per sequence
    w, u, qg, kd, aqk, gl,                            # outputs
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
    LOW_UT: tl.constexpr, TRANS_LOAD: tl.constexpr = False, PLACE_SPLIT: tl.constexpr = False,
):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    NC: tl.constexpr = BT // BC
    length = tl.load(lengths + i_b).to(tl.int32)
    o_t = i_n * BT + tl.arange(0, BT)                                   # [BT] token index
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t = o_t < T
    m_valid = o_t < length
    m_k = o_k < K
    m_v = o_v < V
    tok = (i_b * T + o_t).to(tl.int64)                                  # [BT] row in [B*T]
    ld = w.dtype.element_ty
    r_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)                               # [BT] in [B*H*NT*BT]

    # Ordered for short live ranges (the full kernel spills at 255 registers): q, k stay in the input dtype with
    # fp32 row scales, qg and kd are stored as soon as Gam exists, v is loaded after the UT transform.
    p_k = tok[:, None] * (H * K) + i_h * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_f = tl.load(f + p_k, mask=m_tk, other=0.).to(tl.float32)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_g = LOWER * tl.sigmoid(a * (b_f + b_bias[None, :]))
    b_g = tl.where(m_valid[:, None] & m_k[None, :], b_g, 0.)           # padding: alpha = 1
    b_G = tl.cumsum(b_g, 0)                                             # [BT, BK] in-chunk Gam
    G_last = tl.sum(tl.where(r_t[:, None] == BT - 1, b_G, 0.), 0)                     # [BK]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.)                                        # input dtype
    b_k = tl.load(k + p_k, mask=m_tk, other=0.)
    s_q = (K ** -0.5) / tl.sqrt(tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), 1) + 1e-6)     # [BT]
    s_k = 1. / tl.sqrt(tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), 1) + 1e-6)
    tl.store(qg + row[:, None] * K + o_k[None, :], (tl.exp(b_G) * (b_q.to(tl.float32) * s_q[:, None])).to(qg.dtype.element_ty),
             mask=m_k[None, :])
    tl.store(kd + row[:, None] * K + o_k[None, :], (tl.exp(G_last[None, :] - b_G) * (b_k.to(tl.float32) * s_k[:, None])).to(kd.dtype.element_ty),
             mask=m_k[None, :])
    b_beta = tl.sigmoid(tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_beta = tl.where(m_valid, b_beta, 0.)                              # padding: no write

    # Column blocks J, referenced to c_J = Gam at J's last row (factors as in the full kernel: <= e^80 on the
    # diagonal block, <= 1 below it; rows above block J masked out).
    b_A = tl.zeros((BT, BT), dtype=tl.float32)
    c_prev = tl.zeros((BK,), dtype=tl.float32)
    for J in tl.static_range(NC):
        c_J = tl.sum(tl.where(r_t[:, None] == J * BC + BC - 1, b_G, 0.), 0)           # [BK]
        e_J = tl.exp(tl.where(r_t[:, None] >= J * BC, b_G - c_J[None, :], float("-inf")))
        if TRANS_LOAD:
            r_J = _col_block_t(k, f, T, length, i_b, i_h, i_n, J, a, b_bias, c_prev, c_J, None, o_k,
                               H, K, BT, BC, LOWER)                                     # [BK, BC]
        else:
            r_J = tl.trans(_col_block(k, f, T, length, i_b, i_h, i_n, J, a, b_bias, c_prev, c_J,
                                      H, K, BK, BT, BC, LOWER))                         # [BK, BC]
        col = J * BC + o_c                                                              # [BC] chunk column
        a_qk = _mm(b_q.to(tl.float32) * (s_q[:, None] * e_J), r_J, ld, PREC, LOW)      # [BT, BC]
        tl.store(aqk + row[:, None] * BT + col[None, :],
                 tl.where(r_t[:, None] >= col[None, :], a_qk, 0.).to(aqk.dtype.element_ty))
        a_kk = _mm(b_k.to(tl.float32) * (s_k[:, None] * e_J), r_J, ld, PREC, LOW)      # [BT, BC]
        b_A += _col_place(a_kk, J, ld, PREC, PLACE_SPLIT, BT, BC)
        c_prev = c_J
    b_A = tl.where(r_t[:, None] > r_t[None, :], b_A * b_beta[:, None], 0.)
    # W = X R_w; R_w held in the compute dtype across the UT transform (the operand LOW rounds it to anyway;
    # fp16 callers: one extra fp16 rounding; fp32: none).
    R_w = (b_beta[:, None] * tl.exp(b_G) * (b_k.to(tl.float32) * s_k[:, None])).to(ld)   # [BT, BK]

    # UT transform X = (I + A)^-1, as the full kernel (block Neumann series).
    eye = tl.where(r_t[:, None] == r_t[None, :], 1., 0.)
    same = (r_t[:, None] // BC) == (r_t[None, :] // BC)
    A_bd = tl.where(same, b_A, 0.)
    A_lo = b_A - A_bd
    P2 = _mm(A_bd, A_bd, ld, PREC, LOW_UT)
    P4 = _mm(P2, P2, ld, PREC, LOW_UT)
    P8 = _mm(P4, P4, ld, PREC, LOW_UT)
    D_inv = _mm(eye - A_bd, eye + P2, ld, PREC, LOW_UT)
    D_inv = _mm(D_inv, eye + P4, ld, PREC, LOW_UT)
    D_inv = _mm(D_inv, eye + P8, ld, PREC, LOW_UT)
    N1 = _mm(D_inv, A_lo, ld, PREC, LOW_UT)
    N2 = _mm(N1, N1, ld, PREC, LOW_UT)
    X = _mm(_mm(eye - N1, eye + N2, ld, PREC, LOW_UT), D_inv, ld, PREC, LOW_UT)

    b_w = _mm(X, R_w.to(tl.float32), ld, PREC, LOW)                                    # [BT, BK]
    tl.store(w + row[:, None] * K + o_k[None, :], b_w.to(ld), mask=m_k[None, :])
    b_v = tl.load(v + tok[:, None] * (H * V) + i_h * V + o_v[None, :],
                  mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
    b_u = _mm(X, b_beta[:, None] * b_v, ld, PREC, LOW)                                # [BT, BV]
    tl.store(u + row[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])
    tl.store(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, G_last, mask=m_k)


# --- Prefill intra launch, column-block variant blocked over K (`intra="colk"`) ----------------------------------
# The "col" kernel with every [BT, K] tile cut into [BT, BKB] column slices (the gate cumsum is per column, so the
# in-chunk Gam of a slice needs only that slice): the full-width tiles held the 64 x 128 kernels at 255 registers
# with spills, one program per SM. Pass 1 accumulates the row norms; pass 2, per slice, stores qg, kd, Gam_C and
# adds the slice's share of the [BT, BC] column blocks of A_qk / A_kk; the UT transform follows on [BT, BT] tiles;
# pass 3 recomputes each slice's Gam for W = X beta exp(Gam) K, and U = X beta V by value slices. ptxas (offline):
# 223 registers at 8 warps, no spills (BKB = 32). Exact under the interpreter; not yet run to completion on the
# H200 (its only run was cut short by the "col" fault).

@triton.jit
def _colk_rows(x, J, BT: tl.constexpr, BC: tl.constexpr):
    """Entries J*BC.. J*BC+BC-1 of the [BT] vector x as a [BC] vector (exact: a masked sum of one term)."""
    r_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    return tl.sum(tl.where((J * BC + o_c)[:, None] == r_t[None, :], x[None, :], 0.), 1)


@triton.jit
def _colk_pair(k, f, s_kJ, T, length, i_b, i_h, i_n, J, a, b_bias, o_k, m_k, c_prev, b_q, b_k, b_G, low_dtype,
               H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr,
               PREC: tl.constexpr, LOW: tl.constexpr, TRANS_LOAD: tl.constexpr):
    """Column block J over the K columns o_k: (c_J, (q e_J) r_J^T, (k e_J) r_J^T), the products [BT, BC], with
    e_J = exp(Gam - c_J) on rows >= J*BC (<= e^80) and r_J = kn_J exp(c_J - Gam_J) (<= 1) from J's own rows."""
    r_t = tl.arange(0, BT)
    c_J = tl.sum(tl.where(r_t[:, None] == J * BC + BC - 1, b_G, 0.), 0)                # [BKB]
    e_J = tl.exp(tl.where(r_t[:, None] >= J * BC, b_G - c_J[None, :], float("-inf")))
    if TRANS_LOAD:
        r_J = _col_block_t(k, f, T, length, i_b, i_h, i_n, J, a, b_bias, c_prev, c_J, s_kJ, o_k,
                           H, K, BT, BC, LOWER)                                         # [BKB, BC]
    else:
        o_t = i_n * BT + J * BC + tl.arange(0, BC)
        m_t = o_t < T
        tok = (i_b * T + o_t).to(tl.int64)
        b_kJ = tl.load(k + tok[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                       other=0.).to(tl.float32) * s_kJ[:, None]
        G_J, _ = _sub_gate(f, tok, m_t, o_t < length, i_h, o_k, m_k, a, b_bias, c_prev, H, K, LOWER, BC)
        r_J = tl.trans(b_kJ * tl.exp(c_J[None, :] - G_J))                             # [BKB, BC]
    return c_J, _mm(b_q * e_J, r_J, low_dtype, PREC, LOW), _mm(b_k * e_J, r_J, low_dtype, PREC, LOW)


@triton.jit
def _colk_gate(f, dt_bias, tok, m_t, m_valid, i_h, a, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
               LOWER: tl.constexpr):
    """Columns o_k of the chunk: in-chunk Gam [BT, BKB] (padding rows: alpha = 1) and the slice's dt_bias."""
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_f = tl.load(f + tok[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                  other=0.).to(tl.float32)
    b_g = LOWER * tl.sigmoid(a * (b_f + b_bias[None, :]))
    return tl.cumsum(tl.where(m_valid[:, None] & m_k[None, :], b_g, 0.), 0), b_bias


@triton.jit
def kda_prefill_intra_colk_fwd_kernel(
    q, k, v, f, b, A_log, dt_bias, lengths,          # inputs
    T,                                                # scalar: padded tokens per sequence
    w, u, qg, kd, aqk, gl,                            # outputs
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, LOWER: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr,
    LOW_UT: tl.constexpr, BKB: tl.constexpr, TRANS_LOAD: tl.constexpr = False, PLACE_SPLIT: tl.constexpr = False,
):
    tl.static_assert(BT == 4 * BC, "the column-block kernel is written for 4 blocks")
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    r_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_t = i_n * BT + r_t                                                # [BT] token index
    m_t = o_t < T
    m_valid = o_t < length
    tok = (i_b * T + o_t).to(tl.int64)                                  # [BT] row in [B*T]
    row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)               # [BT] in [B*H*NT*BT]
    ld = w.dtype.element_ty
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))

    # Pass 1: row norms.
    ss_q = tl.zeros((BT,), dtype=tl.float32)
    ss_k = tl.zeros((BT,), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BKB)):
        o_k = kb * BKB + tl.arange(0, BKB)
        p = tok[:, None] * (H * K) + i_h * K + o_k[None, :]
        m = m_t[:, None] & (o_k < K)[None, :]
        x = tl.load(q + p, mask=m, other=0.).to(tl.float32)
        ss_q += tl.sum(x * x, 1)
        x = tl.load(k + p, mask=m, other=0.).to(tl.float32)
        ss_k += tl.sum(x * x, 1)
    s_q = (K ** -0.5) / tl.sqrt(ss_q + 1e-6)                           # qn = q s_q, kn = k s_k
    s_k = 1. / tl.sqrt(ss_k + 1e-6)
    s_k0 = _colk_rows(s_k, 0, BT, BC)
    s_k1 = _colk_rows(s_k, 1, BT, BC)
    s_k2 = _colk_rows(s_k, 2, BT, BC)
    s_k3 = _colk_rows(s_k, 3, BT, BC)
    b_beta = tl.sigmoid(tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32))
    b_beta = tl.where(m_valid, b_beta, 0.)                              # padding: no write

    # Pass 2, per column slice: qg, kd, Gam_C stored; the column blocks of A_qk / A_kk accumulated.
    aq0 = tl.zeros((BT, BC), dtype=tl.float32)
    aq1 = tl.zeros((BT, BC), dtype=tl.float32)
    aq2 = tl.zeros((BT, BC), dtype=tl.float32)
    aq3 = tl.zeros((BT, BC), dtype=tl.float32)
    ak0 = tl.zeros((BT, BC), dtype=tl.float32)
    ak1 = tl.zeros((BT, BC), dtype=tl.float32)
    ak2 = tl.zeros((BT, BC), dtype=tl.float32)
    ak3 = tl.zeros((BT, BC), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BKB)):
        o_k = kb * BKB + tl.arange(0, BKB)
        m_k = o_k < K
        b_G, b_bias = _colk_gate(f, dt_bias, tok, m_t, m_valid, i_h, a, o_k, m_k, H, K, LOWER)
        G_last = tl.sum(tl.where(r_t[:, None] == BT - 1, b_G, 0.), 0)                 # [BKB]
        p = tok[:, None] * (H * K) + i_h * K + o_k[None, :]
        m = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + p, mask=m, other=0.).to(tl.float32) * s_q[:, None]
        b_k = tl.load(k + p, mask=m, other=0.).to(tl.float32) * s_k[:, None]
        p_o = row[:, None] * K + o_k[None, :]
        tl.store(qg + p_o, (tl.exp(b_G) * b_q).to(qg.dtype.element_ty), mask=m_k[None, :])
        tl.store(kd + p_o, (tl.exp(G_last[None, :] - b_G) * b_k).to(kd.dtype.element_ty), mask=m_k[None, :])
        tl.store(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, G_last, mask=m_k)
        c0, dq, dk = _colk_pair(k, f, s_k0, T, length, i_b, i_h, i_n, 0, a, b_bias, o_k, m_k,
                                tl.zeros((BKB,), dtype=tl.float32), b_q, b_k, b_G, ld, H, K, BT, BC, LOWER, PREC,
                                LOW, TRANS_LOAD)
        aq0 += dq
        ak0 += dk
        c1, dq, dk = _colk_pair(k, f, s_k1, T, length, i_b, i_h, i_n, 1, a, b_bias, o_k, m_k, c0, b_q, b_k, b_G,
                                ld, H, K, BT, BC, LOWER, PREC, LOW, TRANS_LOAD)
        aq1 += dq
        ak1 += dk
        c2, dq, dk = _colk_pair(k, f, s_k2, T, length, i_b, i_h, i_n, 2, a, b_bias, o_k, m_k, c1, b_q, b_k, b_G,
                                ld, H, K, BT, BC, LOWER, PREC, LOW, TRANS_LOAD)
        aq2 += dq
        ak2 += dk
        _, dq, dk = _colk_pair(k, f, s_k3, T, length, i_b, i_h, i_n, 3, a, b_bias, o_k, m_k, c2, b_q, b_k, b_G,
                               ld, H, K, BT, BC, LOWER, PREC, LOW, TRANS_LOAD)
        aq3 += dq
        ak3 += dk
    p_a = aqk + row[:, None] * BT + o_c[None, :]
    da = aqk.dtype.element_ty
    tl.store(p_a, tl.where(r_t[:, None] >= o_c[None, :], aq0, 0.).to(da))
    tl.store(p_a + BC, tl.where(r_t[:, None] >= BC + o_c[None, :], aq1, 0.).to(da))
    tl.store(p_a + 2 * BC, tl.where(r_t[:, None] >= 2 * BC + o_c[None, :], aq2, 0.).to(da))
    tl.store(p_a + 3 * BC, tl.where(r_t[:, None] >= 3 * BC + o_c[None, :], aq3, 0.).to(da))
    # A_kk's blocks placed into [BT, BT] by one-hot products (exact in fp32; one tf32 rounding under tf32).
    b_A = _col_place(ak0, 0, ld, PREC, PLACE_SPLIT, BT, BC) + _col_place(ak1, 1, ld, PREC, PLACE_SPLIT, BT, BC)
    b_A += _col_place(ak2, 2, ld, PREC, PLACE_SPLIT, BT, BC) + _col_place(ak3, 3, ld, PREC, PLACE_SPLIT, BT, BC)
    b_A = tl.where(r_t[:, None] > r_t[None, :], b_A * b_beta[:, None], 0.)

    # UT transform X = (I + A)^-1, as the full kernel (block Neumann series).
    eye = tl.where(r_t[:, None] == r_t[None, :], 1., 0.)
    same = (r_t[:, None] // BC) == (r_t[None, :] // BC)
    A_bd = tl.where(same, b_A, 0.)
    A_lo = b_A - A_bd
    P2 = _mm(A_bd, A_bd, ld, PREC, LOW_UT)
    P4 = _mm(P2, P2, ld, PREC, LOW_UT)
    P8 = _mm(P4, P4, ld, PREC, LOW_UT)
    D_inv = _mm(eye - A_bd, eye + P2, ld, PREC, LOW_UT)
    D_inv = _mm(D_inv, eye + P4, ld, PREC, LOW_UT)
    D_inv = _mm(D_inv, eye + P8, ld, PREC, LOW_UT)
    N1 = _mm(D_inv, A_lo, ld, PREC, LOW_UT)
    N2 = _mm(N1, N1, ld, PREC, LOW_UT)
    X = _mm(_mm(eye - N1, eye + N2, ld, PREC, LOW_UT), D_inv, ld, PREC, LOW_UT)

    # Pass 3: W = X beta exp(Gam) kn per column slice (Gam recomputed), U = X beta v per value slice.
    for kb in range(0, tl.cdiv(K, BKB)):
        o_k = kb * BKB + tl.arange(0, BKB)
        m_k = o_k < K
        b_G, _ = _colk_gate(f, dt_bias, tok, m_t, m_valid, i_h, a, o_k, m_k, H, K, LOWER)
        b_k = tl.load(k + tok[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.).to(tl.float32) * s_k[:, None]
        b_w = _mm(X, b_beta[:, None] * tl.exp(b_G) * b_k, ld, PREC, LOW)
        tl.store(w + row[:, None] * K + o_k[None, :], b_w.to(ld), mask=m_k[None, :])
    for vb in range(0, tl.cdiv(V, BKB)):
        o_v = vb * BKB + tl.arange(0, BKB)
        m_v = o_v < V
        b_v = tl.load(v + tok[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                      other=0.).to(tl.float32)
        b_u = _mm(X, b_beta[:, None] * b_v, ld, PREC, LOW)
        tl.store(u + row[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])


# --- Prefill state pass, split variant (`state="split"`, fla's split) ---------------------------------------------
# `kda_prefill_fwd_kernel` as two launches: the sequential h-pass keeps only the recurrence (Vn = U - W S,
# S <- exp(Gam_C) S + (exp(Gam_C - Gam) K)^T Vn: two dots per chunk on the critical path) and stores each chunk's
# entering state S_n (compute dtype, as the fused kernel's dot operand) and Vn; the o-pass, one program per
# (V block, chunk, sequence*head), all in parallel, computes O = exp(Gam) Q S_n + A_qk Vn.

@triton.jit
def kda_prefill_h_fwd_kernel(
    w, u, kd, gl, h0, lengths,                        # inputs
    T,                                                # scalar: padded tokens per sequence
    h, vn, ht,                                        # outputs: h [B*H*NT, K, V], vn [B*H*NT*BT, V], ht
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    NV = tl.minimum(tl.cdiv(length, BT), NT)                # chunks past the length: the o-pass writes zeros
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    r_t = tl.arange(0, BT)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(h0 + p_s, mask=m_kv, other=0.).to(tl.float32)                       # [BK, BV] fp32
    dt = w.dtype.element_ty
    for i_n in range(0, NV):
        row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)                           # [BT]
        b_w = tl.load(w + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
        b_kdT = tl.load(kd + row[None, :] * K + o_k[:, None], mask=m_k[:, None], other=0.)     # [BK, BT]
        b_u = tl.load(u + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
        b_decay = tl.exp(tl.load(gl + (i_bh * NT + i_n).to(tl.int64) * K + o_k, mask=m_k, other=0.))
        b_sd = b_s.to(dt)
        tl.store(h + (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :], b_sd, mask=m_kv)
        b_vnd = (b_u - tl.dot(b_w, b_sd, input_precision=PREC)).to(dt)               # [BT, BV]
        tl.store(vn + row[:, None] * V + o_v[None, :], b_vnd, mask=m_v[None, :])
        b_s = b_s * b_decay[:, None] + tl.dot(b_kdT, b_vnd, input_precision=PREC)
    tl.store(ht + p_s, b_s.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def kda_prefill_o_fwd_kernel(
    qg, aqk, h, vn, lengths,                          # inputs
    T,                                                # scalar: padded tokens per sequence
    o,                                                # output [B, T, H, V]
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = tl.cdiv(T, BT)
    length = tl.load(lengths + i_b).to(tl.int32)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    r_t = tl.arange(0, BT)
    live = (i_n * BT + 0 * r_t) < length                    # [BT]; a chunk wholly past the length: zero rows
    m_k = (o_k < K) & ((i_n * BT + 0 * o_k) < length)
    m_v = o_v < V
    row = (i_bh * NT * BT + i_n * BT + r_t).to(tl.int64)                               # [BT]
    b_qg = tl.load(qg + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
    b_h = tl.load(h + (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.)                          # [BK, BV]
    b_a = tl.load(aqk + row[:, None] * BT + r_t[None, :], mask=(r_t[:, None] >= r_t[None, :]) & live[:, None],
                  other=0.)
    b_vn = tl.load(vn + row[:, None] * V + o_v[None, :], mask=live[:, None] & m_v[None, :], other=0.)
    b_o = tl.dot(b_qg, b_h, input_precision=PREC) + tl.dot(b_a, b_vn, input_precision=PREC)
    t = i_n * BT + r_t
    p_o = (i_b * T + t).to(tl.int64)[:, None] * (H * V) + i_h * V + o_v[None, :]
    tl.store(o + p_o, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None] & (o_v < V)[None, :])


@triton.jit
def _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, c0, C, K: tl.constexpr, W: tl.constexpr,
               BK: tl.constexpr, BW: tl.constexpr):
    """Depthwise causal conv of channels c0..c0+K-1 over [previous W-1 inputs, new input], then SiLU (rounded to
    qkv's dtype as the op does). Stores the next window (inputs 1..W-1) to conv_out. Returns [BK] fp32."""
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
    tl.store(conv_out + p_win, nxt.to(conv_out.dtype.element_ty), mask=m_win)
    return (y * tl.sigmoid(y)).to(qkv.dtype.element_ty).to(tl.float32)


@triton.jit
def kda_decode_fwd_kernel(
    qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,   # inputs
    o, conv_out, state_out,                                                          # outputs
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
    LOWER: tl.constexpr, EPS: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    C: tl.constexpr = 3 * H * K
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    # Short conv + SiLU on this head's q | k | v channels; writes their next windows.
    b_q = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 0 * H * K + i_h * K, C, K, W, BK, BW)
    b_k = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 1 * H * K + i_h * K, C, K, W, BK, BW)
    b_v = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 2 * H * K + i_h * K, C, K, W, BK, BW)

    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * (K ** -0.5)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_f = tl.load(f + i_b.to(tl.int64) * H * K + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    alpha = tl.exp(LOWER * tl.sigmoid(a * (b_f + b_bias)))
    beta = tl.sigmoid(tl.load(b + i_bh).to(tl.float32))

    # Delta rule on the fp32 state: read once, write once.
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
def kda_decode_vblock_fwd_kernel(
    qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,   # inputs
    o, conv_out, state_out,                                                          # outputs
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
    LOWER: tl.constexpr, EPS: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
):
    """`kda_decode_fwd_kernel` with the state walked in [K, BV] column blocks (the delta rule is independent per
    value column): smaller live tiles, a pipelined loop over blocks, optional eviction hint on the state stream.
    The head RMSNorm needs all V: each block's o (rounded as the op does) goes to `o`, is re-read after a
    barrier, normalised and gated."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    C: tl.constexpr = 3 * H * K
    NV: tl.constexpr = BK // BV
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_q = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 0 * H * K + i_h * K, C, K, W, BK, BW)
    b_k = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 1 * H * K + i_h * K, C, K, W, BK, BW)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * (K ** -0.5)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_f = tl.load(f + i_b.to(tl.int64) * H * K + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    alpha = tl.exp(LOWER * tl.sigmoid(a * (b_f + b_bias)))
    beta = tl.sigmoid(tl.load(b + i_bh).to(tl.float32))
    p_o = o + i_b.to(tl.int64) * H * K + i_h * K
    ss = tl.zeros((1,), dtype=tl.float32)
    for i_v in tl.range(0, NV, num_stages=STAGES):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < K
        b_v = _conv_step(qkv, conv_state, conv_weight, conv_out, i_b, 2 * H * K + i_h * K + i_v * BV, C, BV, W,
                         BV, BW)
        p_s = i_bh.to(tl.int64) * K * K + o_k[:, None] * K + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        S = tl.load(state + p_s, mask=m_s, other=0., eviction_policy=EVICT).to(tl.float32) * alpha[:, None]
        err = b_v - tl.sum(S * b_k[:, None], 0)                                     # [BV]
        S += beta * b_k[:, None] * err[None, :]
        b_o = tl.sum(S * b_q[:, None], 0).to(o.dtype.element_ty)                  # read after the write
        tl.store(state_out + p_s, S.to(state_out.dtype.element_ty), mask=m_s, eviction_policy=EVICT)
        tl.store(p_o + o_v, b_o, mask=m_v)
        b_o = b_o.to(tl.float32)
        ss += tl.sum(b_o * b_o)
    tl.debug_barrier()                          # every block's o is written before it is re-read
    b_o = tl.load(p_o + o_k, mask=m_k, other=0.).to(tl.float32)
    on = (b_o * tl.rsqrt(tl.sum(ss) / K + EPS)).to(o.dtype.element_ty)
    wn = tl.load(o_norm_weight + o_k, mask=m_k, other=0.) * on
    b_g = tl.load(g + i_b.to(tl.int64) * H * K + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
    tl.debug_barrier()                          # every read of o precedes the gated write
    tl.store(p_o + o_k, (wn.to(tl.float32) * tl.sigmoid(b_g)).to(o.dtype.element_ty), mask=m_k)


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration (shared with the AOT contract in trt.py) and host wrappers.

def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def prefill_config(K: int, V: int) -> dict:
    """Block sizes and warps of the prefill launches for head dims K, V (K = V = 128 is the tuned case).
    `intra`: "full" (`kda_prefill_intra_fwd_kernel`, 64-wide tiles, `intra_warps`; the kernel of the AOT contract
    in trt.py), "sub" (`kda_prefill_intra_sub_fwd_kernel`, 16-row sub-blocks, `sub_warps`), "col"
    (`kda_prefill_intra_col_fwd_kernel`: A_kk/A_qk by [BT, BC] column blocks with [BC, BK] right operands,
    `col_warps`) or "colk" (`kda_prefill_intra_colk_fwd_kernel`: "col" on [BT, BKB] column slices, `colk_warps`);
    `low_ut`: bf16 operands in the col kernels' UT transform; `intra_maxnreg`: register cap for the col kernels;
    `col_trans_load` / `col_place_split`: their right operands loaded transposed (no tl.trans) / A_kk placed by
    two bf16 products instead of one tf32 (both to avoid the suspected triggers of the fault below).
    `state`: "fused" (`kda_prefill_fwd_kernel`, one launch: BV / state_warps / state_stages; the AOT contract's
    kernel) or "split" (`kda_prefill_h_fwd_kernel` then `kda_prefill_o_fwd_kernel`, fla's split: BV_h / h_warps /
    h_stages, BV_o / o_warps). Env `K3_KDA_INTRA` / `K3_KDA_STATE` override the defaults.
    H200, B=1, T=8192, H=96, bf16 (`bench kda --sweep`):
    - 2026-11-29 22:20: "sub" 4.80 ms vs "full" 3.28 ms, o rel. RMS 4.38e-3 both: "full" stays the default.
    - 2026-11-30 00:28: default 3.24 ms end to end, of which the intra launch alone 2.41 ms (so the state pass
      ~0.83 ms): the intra launch is the part to cut. ptxas (offline, sm_90a): "full" at 8 warps holds 255
      registers with spills, so one program per SM. "col" hit an illegal memory access on the H200 (Triton 3.6)
      at T = 8192 and 3072 but not at T = 64; the interpreter finds no out-of-bounds access (a codegen fault is
      suspected, as in upstream reports of multi-dot kernels on sm_90). The "colk" and "split" variants were not
      measured (the fault ended the process). Defaults unchanged; `scripts/gpu_kda.sh` now checks each variant
      in its own process first.
    `low_ab` (bf16 inputs only): bf16 operands for the A_kk/A_qk and W/U products, as fla does. H200, T=8192,
    H=96 (2026-11-29 21:10): 3.25 ms vs 4.90 ms with fp32/tf32 operands, o rel. RMS 4.4e-3 vs 3.5e-3: on.
    Verified on the H200 for K = V = 128: BV 64 / 4 warps / 2 stages and BV 128 / 8 warps / 1 stage. BV = 32 with
    1 stage gave wrong outputs there (exact under the interpreter; cause not found): do not use BV < 64 in the
    fused kernel."""
    big = max(K, V) >= 64
    return dict(BT=CHUNK, BK=_pow2(K), BV_intra=_pow2(V), BV=min(_pow2(V), 64),
                intra=os.environ.get("K3_KDA_INTRA", "full"), sub_warps=4, col_warps=8 if big else 4, low_ut=False,
                colk_warps=4, BKB=32, intra_maxnreg=None, col_trans_load=False, col_place_split=False,
                intra_warps=8 if big else 4, low_ab=True, state_warps=4, state_stages=2 if big else 1,
                state=os.environ.get("K3_KDA_STATE", "fused"), BV_h=min(_pow2(V), 64), h_warps=4,
                h_stages=2 if big else 1, BV_o=min(_pow2(V), 64), o_warps=4)


def decode_config(K: int, W: int) -> dict:
    """`kernel`: "fused" (`kda_decode_fwd_kernel`, the whole [K, V] state per program; the AOT contract's kernel)
    or "vblock" (`kda_decode_vblock_fwd_kernel`: [K, BV] column blocks in a loop of `stages` pipeline stages,
    `evict` = "" or "evict_first" on the state stream). Env `K3_KDA_DECODE` overrides the kernel.
    `maxnreg`: register cap per thread. At K = 128 the fused kernel needs 202 registers at 4 warps (ptxas,
    sm_90a), so 2 programs fit on an SM; capped at 168, 3 fit (112 B spilled). H200, H=96 (2026-11-30 00:24,
    `bench kda --sweep`): B=256 0.889 vs 0.968 ms (85% vs 78% of copy), B=64 0.231 vs 0.250 ms (81% vs 75%),
    errors unchanged. (A cap of 128, 4 programs per SM, spills 600 B and is slower: 58%. A variant with both
    state reductions on the loaded state, 189 registers, was no faster: 84% / 80% with the same cap.)"""
    # 4 warps: H200, H=96, B=1..256 (2026-11-29 21:10) 1.5-1.9x faster than 8 warps (B=256: 0.97 vs 1.81 ms).
    return dict(BK=_pow2(K), BW=triton.next_power_of_2(W), num_warps=4, maxnreg=168 if _pow2(K) == 128 else None,
                kernel=os.environ.get("K3_KDA_DECODE", "fused"), BV=min(_pow2(K), 32), stages=2, evict="")


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


INTRA_KERNELS = ("full", "sub", "col", "colk")
STATE_PASSES = ("fused", "split")


def prefill_intra_fwd(q, k, v, f, b, A_log, dt_bias, lengths, lower_bound: float, cfg: dict) -> dict:
    """The intra launch (`cfg["intra"]` picks the kernel). Inputs contiguous `[B, T, H, K]`, lengths int64.
    Returns the intermediates w, u, qg, kd, aqk (`[B*H*NT*BT, K|V|BT]`, compute dtype) and gl (`[B*H*NT, K]` fp32)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = cfg["BT"]
    NT = triton.cdiv(T, BT)
    dt = compute_dtype(q.dtype)
    rows = B * H * NT * BT
    out = {n: q.new_empty(rows, K, dtype=dt) for n in ("w", "qg", "kd")}
    out.update(u=q.new_empty(rows, V, dtype=dt), aqk=q.new_empty(rows, BT, dtype=dt),
               gl=q.new_empty(B * H * NT, K, dtype=torch.float32))
    if cfg["intra"] not in INTRA_KERNELS:
        raise ValueError(f"kda_prefill_fwd: intra must be one of {INTRA_KERNELS}, got {cfg['intra']!r}")
    kind = cfg["intra"] if BT == 4 * BC else "full"          # the sub-block kernels are written for 4 blocks
    common = dict(H=H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV_intra"], BT=BT, BC=BC, LOWER=float(lower_bound),
                  PREC=_prec(dt), LOW=bool(cfg["low_ab"]) and dt == torch.bfloat16)
    args = (q, k, v, f, b, A_log.contiguous(), dt_bias.contiguous(), lengths, T,
            out["w"], out["u"], out["qg"], out["kd"], out["aqk"], out["gl"])
    if cfg.get("intra_maxnreg") and kind in ("col", "colk"):
        common["maxnreg"] = cfg["intra_maxnreg"]            # register cap: more programs per SM, some spills
    col = dict(LOW_UT=bool(cfg["low_ut"]) and dt == torch.bfloat16, TRANS_LOAD=bool(cfg["col_trans_load"]),
               PLACE_SPLIT=bool(cfg["col_place_split"]))
    if kind == "colk":
        launch(kda_prefill_intra_colk_fwd_kernel)[(NT, B * H)](
            *args, BKB=min(cfg["BKB"], cfg["BK"]), num_warps=cfg["colk_warps"], **col, **common)
    elif kind == "col":
        launch(kda_prefill_intra_col_fwd_kernel)[(NT, B * H)](*args, num_warps=cfg["col_warps"], **col, **common)
    elif kind == "sub":
        launch(kda_prefill_intra_sub_fwd_kernel)[(NT, B * H)](*args, num_warps=cfg["sub_warps"], **common)
    else:
        launch(kda_prefill_intra_fwd_kernel)[(NT, B * H)](*args, num_warps=cfg["intra_warps"], **common)
    return out


def prefill_state_fwd(inter: dict, initial_state, lengths, shape: tuple, out_dtype: torch.dtype, cfg: dict):
    """The inter-chunk pass (`cfg["state"]`: one fused launch or the h-pass + o-pass) on the intra launch's
    intermediates. shape = (B, T, H, K, V); initial_state fp32 `[B, H, K, V]`. Returns (o `[B, T, H, V]`, ht fp32)."""
    B, T, H, K, V = shape
    BT = cfg["BT"]
    NT = triton.cdiv(T, BT)
    prec = _prec(inter["w"].dtype)
    o = inter["w"].new_empty(B, T, H, V, dtype=out_dtype)
    ht = torch.empty(initial_state.shape, device=o.device, dtype=torch.float32)    # contiguous, as written
    if cfg["state"] not in STATE_PASSES:
        raise ValueError(f"kda_prefill_fwd: state must be one of {STATE_PASSES}, got {cfg['state']!r}")
    if cfg["state"] == "fused":
        launch(kda_prefill_fwd_kernel)[(triton.cdiv(V, cfg["BV"]), B * H)](
            inter["w"], inter["u"], inter["qg"], inter["kd"], inter["aqk"], inter["gl"], initial_state, lengths,
            T, o, ht, H=H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], BT=BT, PREC=prec,
            num_warps=cfg["state_warps"], num_stages=cfg["state_stages"])
        return o, ht
    h = inter["w"].new_empty(B * H * NT, K, V)               # each chunk's entering state, compute dtype
    vn = torch.empty_like(inter["u"])
    launch(kda_prefill_h_fwd_kernel)[(triton.cdiv(V, cfg["BV_h"]), B * H)](
        inter["w"], inter["u"], inter["kd"], inter["gl"], initial_state, lengths, T, h, vn, ht,
        H=H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV_h"], BT=BT, PREC=prec,
        num_warps=cfg["h_warps"], num_stages=cfg["h_stages"])
    launch(kda_prefill_o_fwd_kernel)[(triton.cdiv(V, cfg["BV_o"]), NT, B * H)](
        inter["qg"], inter["aqk"], h, vn, lengths, T, o, H=H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV_o"], BT=BT,
        PREC=prec, num_warps=cfg["o_warps"])
    return o, ht


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


def _check_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state) -> None:
    B, H = b.shape
    C = qkv.shape[-1]
    if qkv.dim() != 2 or C % (3 * H):
        raise ValueError(f"kda_decode: qkv must be [B, 3*H*K] with H = b.shape[1] = {H}, got {tuple(qkv.shape)}")
    K = C // (3 * H)
    W = conv_weight.shape[-1]
    want = {"conv_state": (conv_state, (B, C, W - 1)), "conv_weight": (conv_weight, (C, W)),
            "f": (f, (B, H * K)), "g": (g, (B, H * K)), "o_norm_weight": (o_norm_weight, (K,)),
            "state": (state, (B, H, K, K)), "dt_bias": (dt_bias, (H * K,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"kda_decode: {name} must have shape {shape} (from qkv {tuple(qkv.shape)}, "
                             f"b {tuple(b.shape)}), got {tuple(t.shape)}")
    if A_log.numel() < H:
        raise ValueError(f"kda_decode: A_log needs >= {H} entries, got {A_log.numel()}")
    if W < 2:
        raise ValueError(f"kda_decode: conv kernel size must be >= 2, got {W}")


def kda_decode_fwd(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                   lower_bound: float, eps: float, config: dict | None = None):
    """Launch the fused decode step. Shapes as `k3::kda_decode`; state fp32. Returns (o, new_conv, new_state)."""
    _check_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state)
    B, H = b.shape
    K = qkv.shape[-1] // (3 * H)
    W = conv_weight.shape[-1]
    cfg = {**decode_config(K, W), **(config or {})}
    args = [x.contiguous() for x in (qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight)]
    o = qkv.new_empty(B, H * K)
    conv_out = torch.empty(args[1].shape, device=qkv.device, dtype=args[1].dtype)   # contiguous, as written
    state_out = torch.empty(state.shape, device=qkv.device, dtype=torch.float32)
    common = dict(H=H, K=K, W=W, BK=cfg["BK"], BW=cfg["BW"], LOWER=float(lower_bound), EPS=float(eps),
                  num_warps=cfg["num_warps"])
    if cfg.get("maxnreg"):
        common["maxnreg"] = cfg["maxnreg"]
    if cfg["kernel"] not in ("fused", "vblock"):
        raise ValueError(f"kda_decode_fwd: kernel must be 'fused' or 'vblock', got {cfg['kernel']!r}")
    BV = min(cfg["BV"], cfg["BK"])
    if cfg["kernel"] == "vblock" and K % BV == 0:
        launch(kda_decode_vblock_fwd_kernel)[(B * H,)](
            *args, state.to(torch.float32).contiguous(), o, conv_out, state_out, BV=BV, STAGES=cfg["stages"],
            EVICT=cfg["evict"], **common)
    else:
        launch(kda_decode_fwd_kernel)[(B * H,)](*args, state.to(torch.float32).contiguous(), o, conv_out, state_out,
                                        **common)
    return o, conv_out, state_out.to(state.dtype)


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


# K3_KDA_TRITON=0 keeps the reference on CUDA too (escape hatch while the kernels are young).
if os.environ.get("K3_KDA_TRITON", "1") != "0":
    kda_prefill.register_kernel("cuda")(_prefill_cuda)
    kda_decode.register_kernel("cuda")(_decode_cuda)
