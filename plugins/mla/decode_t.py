"""MLA decode, variant "t": the split kernel in transposed form, for many heads (96 on one GPU).

`mla_decode_fwd_kernel` computes S = Q K^T with the heads as the M dimension of its products; a head block of 32
is below the 64 rows a Hopper warpgroup MMA takes, and each head block re-reads the cache chunk. Here the cache
rows are M and the heads N (any multiple of 8 is a valid N):

    S^T [BN, BH] = C_v [BN, 512] Q_v^T [512, BH] + C_pe [BN, 64] Q_pe^T [64, BH]
    O^T [512, BH] += C_v^T [512, BN] P^T [BN, BH]          (online softmax down the columns of S^T)

Same grid, inputs and outputs as `mla_decode_fwd_kernel` (o_part `[B, H, S, BLOCK_V]` fp32 normalised partial
outputs, lse_part `[B, H, S]` log2 domain), so `mla_decode_combine_kernel` merges them unchanged. Selected by
`DECODE_CONFIG["kernel"] = "t"` (`k3export bench mla` sweeps it); not the default until the H200 says so.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_decode_t_fwd_kernel(q, cache, cache_len,
                            stride_qb, stride_qh, stride_cb, stride_cl,
                            H, num_splits, qk_scale, V_DIM, R,
                            o_part, lse_part,
                            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                            BLOCK_PE: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.load(cache_len + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, n)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_v = tl.arange(0, BLOCK_V)
    offs_pe = V_DIM + tl.arange(0, BLOCK_PE)
    v_ok = offs_v < V_DIM
    pe_ok = offs_pe < R
    q_col = q + b * stride_qb + heads[None, :] * stride_qh                                     # [1, BH]
    qt_v = tl.load(q_col + offs_v[:, None], mask=v_ok[:, None] & h_ok[None, :], other=0.0)     # [BV, BH]
    qt_pe = tl.load(q_col + offs_pe[:, None], mask=pe_ok[:, None] & h_ok[None, :], other=0.0)  # [BPE, BH]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_V, BLOCK_H], tl.float32)                                             # O^T
    c_base = cache + b.to(tl.int64) * stride_cb
    for j0 in range(start, end, BLOCK_N):
        rows = j0 + tl.arange(0, BLOCK_N)
        r_ok = rows < end
        c_row = c_base + rows[:, None].to(tl.int64) * stride_cl
        kv = tl.load(c_row + offs_v[None, :], mask=r_ok[:, None] & v_ok[None, :], other=0.0)     # [BN, BV]
        k_pe = tl.load(c_row + offs_pe[None, :], mask=r_ok[:, None] & pe_ok[None, :], other=0.0)  # [BN, BPE]
        s = tl.dot(kv, qt_v, input_precision=DOT_PREC)
        s = tl.dot(k_pe, qt_pe, acc=s, input_precision=DOT_PREC)                                # [BN, BH]
        s = tl.where(r_ok[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :]
        acc = tl.dot(tl.trans(kv), p.to(kv.dtype), acc=acc, input_precision=DOT_PREC)            # [BV, BH]
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[None, :]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * H + heads) * num_splits + pid_s                                                 # [BH]
    tl.store(o_part + part[None, :].to(tl.int64) * BLOCK_V + offs_v[:, None], out, mask=h_ok[None, :])
    tl.store(lse_part + part, lse, mask=h_ok)
