"""Triton kernels behind `k3::fp8_linear` on CUDA: activation quantization and a fused small-M FP8 GEMM.

    fp8_quant_fwd_kernel  -> fp8_quant_fwd    x `[M, K]` -> E4M3 `[M, K]` (+ the scale per row, for
                                              `torch._scaled_mm`'s row-wise mode): one launch instead of four
    fp8_linear_fwd_kernel -> fp8_linear_fwd   decode GEMMs (M <= 64): quantize x in registers, E4M3 x E4M3
                                              `tl.dot` with fp32 accumulation, both scales, one launch

Both compute exactly `k3export.fp8.fp8_linear_ref`'s quantization (IEEE division by the scale, saturation at
+-448 = `k3export.fp8.FP8_MAX`, round to nearest even); the sums differ from the reference only in order.
Under the CPU interpreter (triton 3.9) two things differ, both measured: its fp32 -> E4M3 conversion is wrong
when rounding carries into the next binade (126.5 -> 64 instead of 128), so activations are quantized by torch
before the kernel (the kernel then loads E4M3 x), and it has no FP8 MMA, so tiles are widened to fp32 before
`tl.dot` (same exact products). The in-register quantization is therefore checked on the GPU only.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3export.fp8 import quantize

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def fp8_quant_fwd_kernel(x, scale, xq, row_scale, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    kb = tl.program_id(1)
    offs = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = offs < K
    s = tl.load(scale)
    v = tl.load(x + m.to(tl.int64) * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    q = tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)
    tl.store(xq + m.to(tl.int64) * stride_q + offs, q.to(xq.dtype.element_ty), mask=ok)
    if kb == 0:
        tl.store(row_scale + m, s)


def fp8_quant_fwd(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """x `[M, K]` (any float), scale `[]` fp32 -> (E4M3 `[M, K]`, row scales `[M, 1]` fp32 all equal to scale)."""
    M, K = x.shape
    if INTERPRET:
        return quantize(x, scale), scale.float().reshape(1, 1).expand(M, 1).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    xq = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    rows = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    BLOCK_K = 1024
    fp8_quant_fwd_kernel[(M, triton.cdiv(K, BLOCK_K))](x, scale.float().reshape(1), xq, rows, K, x.stride(0),
                                                       xq.stride(0), BLOCK_K=BLOCK_K, num_warps=4)
    return xq, rows


@triton.jit
def fp8_linear_fwd_kernel(x, x_scale, w, w_scale, y, M, N, K, stride_x, stride_w, stride_y,
                          X_FP8: tl.constexpr, PER_CHANNEL: tl.constexpr, FP8_DOT: tl.constexpr,
                          BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[m-block, n-block] = (q(x / s_x) s_x) (W_q s_w)^T; W `[N, K]` E4M3 read as [BK, BN] tiles
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    xs = tl.load(x_scale)
    a_ptr = x + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    b_ptr = w + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if X_FP8:                                        # quantized before the kernel
            aq = a
        else:
            aq = tl.clamp(tl.math.div_rn(a.to(tl.float32), xs), -448.0, 448.0).to(w.dtype.element_ty)
        b = tl.load(b_ptr + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_DOT:
            acc = tl.dot(aq, b, acc=acc)
        else:
            acc = tl.dot(aq.to(tl.float32), b.to(tl.float32), acc=acc)
    if PER_CHANNEL:
        s = tl.load(w_scale + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        s = tl.load(w_scale)
    out = acc * xs * s
    tl.store(y + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], out.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_fwd(x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """`k3::fp8_linear` for small M: x `[M, K]`, x_scale `[]`, w `[N, K]` E4M3, w_scale `[N]` or `[]` -> `[M, N]`
    in x.dtype."""
    M, K = x.shape
    N = w.shape[0]
    out_dtype = x.dtype
    if INTERPRET:
        x = quantize(x, x_scale)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N = 32 if N <= 4096 else 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    fp8_linear_fwd_kernel[grid](x, x_scale.float().reshape(1), w, w_scale.float().contiguous(), y, M, N, K,
                                x.stride(0), w.stride(0), y.stride(0), X_FP8=x.dtype == w.dtype,
                                PER_CHANNEL=w_scale.dim() == 1,
                                FP8_DOT=not INTERPRET, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=128,
                                num_warps=4, num_stages=1 if INTERPRET else 3)
    return y

