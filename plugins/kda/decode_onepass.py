"""KDA decode, variant "onepass": both state reductions of the delta-rule step in one pass over the loaded state.

`kda_decode_fwd_kernel` (kernels.py) reduces the decayed state twice in sequence: err = v - (alpha S)^T k, then,
after the rank-1 write, o = S_new^T q. Each reduction over K crosses warps through shared memory, and the second
waits for the first. Expanding the write,

    S_new = alpha S + beta k err^T          err = v - S^T (alpha k)
    o     = S_new^T q = S^T (alpha q) + beta (k . q) err,

so both reductions read the *loaded* state, independent of each other, and the state store needs only err.
189 registers per thread at 4 warps (ptxas, sm_90a) against the fused kernel's 202; with `maxnreg` 168, three
programs fit on an SM (72 B spilled). (One two-operand `tl.reduce` instead of two sums materialised both product
tiles: 255 registers and 1.5 KB of spills.) Same op contract and roundings at the op's edges (o rounded to the
activation dtype before the head RMSNorm); inside, the fp32 sums are reassociated (tests: DECODE_*_BOUND).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _conv_step


@triton.jit
def kda_decode_onepass_fwd_kernel(
    qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,   # inputs
    o, conv_out, state_out,                                                          # outputs
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
    LOWER: tl.constexpr, EPS: tl.constexpr, EVICT: tl.constexpr = "",
):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    C: tl.constexpr = 3 * H * K
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BK)
    p_s = i_bh.to(tl.int64) * K * K + o_k[:, None] * K + o_v[None, :]
    m_s = m_k[:, None] & m_k[None, :]

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
    kq = tl.sum(b_k * b_q)
    S = tl.load(state + p_s, mask=m_s, other=0., eviction_policy=EVICT)             # [BK(k), BK(v)] fp32

    r_k = tl.sum(S * (alpha * b_k)[:, None], 0)                                    # [BK(v)], independent of
    r_q = tl.sum(S * (alpha * b_q)[:, None], 0)                                    # each other
    err = b_v - r_k
    tl.store(state_out + p_s, S * alpha[:, None] + (beta * b_k)[:, None] * err[None, :], mask=m_s,
             eviction_policy=EVICT)
    b_o = r_q + beta * kq * err

    # Head RMSNorm over V (shared weight) and output gate, with the op's roundings.
    b_o = b_o.to(o.dtype.element_ty).to(tl.float32)
    on = (b_o * tl.rsqrt(tl.sum(b_o * b_o) / K + EPS)).to(o.dtype.element_ty)
    wn = tl.load(o_norm_weight + o_v, mask=m_k, other=0.) * on
    b_g = tl.load(g + i_b.to(tl.int64) * H * K + i_h * K + o_v, mask=m_k, other=0.).to(tl.float32)
    y = wn.to(tl.float32) * tl.sigmoid(b_g)
    tl.store(o + i_b.to(tl.int64) * H * K + i_h * K + o_v, y.to(o.dtype.element_ty), mask=m_k)
