"""Triton grouped GEMM for E4M3 routed experts: the CUDA path of `k3::moe_routed_fp8` (no host sync, so decode
CUDA graphs capture it).

`moe_fp8_gemm_fwd_kernel` -> `moe_fp8_gemm_fwd` -> `moe_fp8_grouped` (the routed MoE built on it). The (token,
slot) pairs are sorted by expert and cut into blocks of BLOCK_M rows of one expert (`align_blocks` of the bf16
MoE kernels), so each hit expert's E4M3 weight tiles stream from memory once per block, at half the bytes of
bf16. Tiles are widened to bf16 in registers before `tl.dot`: every E4M3 value is exact in bf16 and products
accumulate in fp32, so the result is that of an FP8 MMA. Reference: `k3export.fp8_moe.moe_fp8_sorted`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3export.fp8 import quantize
from k3export.plugins.kda.naive import acc_dtype
from k3export.plugins.moe.kernels import align_blocks
from k3export.plugins.moe.naive import route, situ_glu

# E4M3 tiles are widened before tl.dot: bf16 on the GPU (exact for every E4M3 value); fp32 under the CPU
# interpreter, whose bf16 dot is wrong (numpy has no bf16). Same result either way: exact inputs, fp32 sums.
_WIDE = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


@triton.jit
def moe_fp8_gemm_fwd_kernel(x, x_scale, w, w_scale, y, order, block_expert, block_row, block_rows, N, K,
                            stride_x, stride_we, stride_wn, stride_se, stride_y,
                            ROW_DIV: tl.constexpr, PER_CHANNEL: tl.constexpr, WIDE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block pb of one expert e, columns [n0, n0 + BLOCK_N): y[pair] = (x[pair // ROW_DIV] s_x) (W_e s_e)^T."""
    pb = tl.program_id(0)
    e = tl.load(block_expert + pb)
    if e < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.load(block_rows + pb)
    pair = tl.load(order + tl.load(block_row + pb) + offs_m, mask=m_ok, other=0)
    row = pair // ROW_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = x + row[:, None].to(tl.int64) * stride_x + offs_k[None, :]                            # [BM, BK]
    b_ptr = w + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(WIDE)
        b = tl.load(b_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(WIDE)
        acc = tl.dot(a, b, acc=acc)
    if PER_CHANNEL:
        s = tl.load(w_scale + e * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        s = tl.load(w_scale + e)
    acc = acc * s * tl.load(x_scale)
    tl.store(y + pair[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def moe_fp8_gemm_fwd(x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, blocks, n_pairs: int, row_div: int,
                     block_m: int) -> Tensor:
    """x `[M, K]` E4M3 (row of pair p: p // row_div), x_scale `[]`, w `[E, N, K]` E4M3, w_scale `[E, N]` or `[E]`,
    blocks = align_blocks(...) -> y `[n_pairs, N]` fp32 in pair order."""
    order, block_expert, block_row, block_rows = blocks
    E, N, K = w.shape
    x, w_scale = x.contiguous(), w_scale.float().contiguous()
    y = torch.empty(n_pairs, N, dtype=torch.float32, device=x.device)
    BLOCK_N, BLOCK_K = 64, 128
    grid = (block_expert.shape[0], triton.cdiv(N, BLOCK_N))
    moe_fp8_gemm_fwd_kernel[grid](
        x, x_scale.float().reshape(1), w, w_scale, y, order, block_expert, block_row, block_rows, N, K,
        x.stride(0), w.stride(0), w.stride(1), w_scale.stride(0) if w_scale.dim() == 2 else 1, y.stride(0),
        ROW_DIV=row_div, PER_CHANNEL=w_scale.dim() == 2, WIDE=_WIDE, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=4)
    return y


def moe_fp8_grouped(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, renormalize,
                    scaling, beta, linear_beta):
    """Same math and signature as `moe_fp8_sorted` (static activation scales, fp32 accumulation)."""
    top, w = route(x, gate_weight, bias, top_k, renormalize, scaling)                  # [N, k]
    N, L = z.shape
    E, I = w13.shape[0], w2.shape[-1]
    P = N * top_k
    block_m = 16 if P <= 4 * E else 64
    blocks = align_blocks(top, E, block_m)
    y13 = moe_fp8_gemm_fwd(quantize(z, z_scale), z_scale, w13, w13_scale, blocks, P, top_k, block_m)
    y13 = y13.to(z.dtype)                                                               # [P, 2I], as fp8_linear
    h = situ_glu(y13[:, :I], y13[:, I:], beta, linear_beta).to(z.dtype)                # [P, I]
    y = moe_fp8_gemm_fwd(quantize(h, h_scale), h_scale, w2, w2_scale, blocks, P, 1, block_m).to(z.dtype)
    dt = acc_dtype(z)
    u = (y.to(dt).view(N, top_k, L) * w.to(dt).unsqueeze(-1)).sum(1)
    return u.to(z.dtype)
