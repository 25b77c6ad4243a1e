"""Triton kernels behind `k3::fp8_linear` on CUDA.

    fp8_quant_fwd_kernel -> fp8_quant_fwd      large M (prefill): x `[M, K]` -> E4M3 `[M, K]` + row scales `[M, 1]`
                                               for `torch._scaled_mm` (one launch instead of four)
    fp8_wo_fwd_kernel    -> fp8_linear_wo_fwd  small M (decode): weight-only FP8 (W8A16), see below
    fp8_wo_reduce_kernel                       its split-K sum (only when the K range is split)

Weight-only: x stays in its own dtype (no activation quantization, so the activation scale is unused); each E4M3
weight tile `[BLOCK_N, BLOCK_K]` is read once with K-contiguous (16-byte) loads, widened in registers (exact:
every E4M3 value is a bf16, fp16 and fp32 value), multiplied with x in fp32 and scaled per output channel at the
end: y = x (W_q s_w)^T = (x W_q^T) s_w, as `k3export.fp8.fp8_linear_wo_ref`. One row (M = 1) uses FMAs into a
`[BLOCK_N, BLOCK_K]` fp32 tile reduced over K once at the end (a GEMV); 2..64 rows a `tl.dot` of x against the
widened tile (16-row blocks). Decode GEMMs are latency-bound when few CTAs stream long K loops (the old fused
kernel: one CTA per 32 columns, ~25 us per k3-small GEMM), so the grid also splits K into SPLIT slices until it
has about `CTAS_PER_SM` CTAs per SM; split slices write fp32 partials `[SPLIT, M, N]` and a second launch sums
them in slice order (deterministic, no atomics), scales and rounds once.

`fp8_quant_fwd` computes exactly `k3export.fp8.quantize` (IEEE division by the scale, saturation at +-448, round
to nearest even). Under the CPU interpreter (triton 3.9) its fp32 -> E4M3 conversion is wrong when rounding
carries into the next binade (126.5 -> 64 instead of 128), so there the quantization runs in torch; E4M3 -> fp32
widening is exact there, but its bf16/fp16 `tl.dot` is wrong (measured: 2.8e10 off on a 16x16 bf16 product), so
the weight-only `tl.dot` widens both operands to fp32 under it (WIDEN): the same exact products as the 16-bit MMA.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3export.fp8 import quantize
from k3export.plugins.triton_common import check, dot_precision, pow2

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
def _scale_out(acc, w_scale, offs_n, n_ok, PER_CHANNEL: tl.constexpr):
    """acc `[..., BLOCK_N]` times the weight scale of its columns (per output channel, or one per matrix)."""
    if PER_CHANNEL:
        return acc * tl.load(w_scale + offs_n, mask=n_ok, other=0.0)
    return acc * tl.load(w_scale)


@triton.jit
def fp8_wo_fwd_kernel(x, w, w_scale, y, M, N, K, K_SLICE, stride_x, stride_w, stride_ys, stride_ym,
                      PER_CHANNEL: tl.constexpr, SCALE: tl.constexpr, GEMV: tl.constexpr, DOT_PREC: tl.constexpr,
                      WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[s, m, n] = sum over k in slice s of x[m, k] W_q[n, k] (times s_w[n] when SCALE: the unsplit case)
    s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = s * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K)
    w_ptr = w + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]              # [BN, BK], K contiguous
    y_row = y + s.to(tl.int64) * stride_ys
    if GEMV:                                                                            # M == 1
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + offs_k) < k_hi
            b = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(x + k0 + offs_k, mask=k_ok, other=0.0)
            acc2 += b.to(tl.float32) * a.to(tl.float32)[None, :]
        acc = tl.sum(acc2, 1)                                                           # [BN]
        if SCALE:
            acc = _scale_out(acc, w_scale, offs_n, n_ok, PER_CHANNEL)
        tl.store(y_row + offs_n, acc.to(y.dtype.element_ty), mask=n_ok)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        a_ptr = x + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]          # [BM, BK]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + offs_k) < k_hi
            a = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if WIDEN:                           # the interpreter's 16-bit tl.dot is wrong: same products in fp32
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc=acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b.to(a.dtype)), acc=acc, input_precision=DOT_PREC)
        if SCALE:
            acc = _scale_out(acc, w_scale, offs_n[None, :], n_ok[None, :], PER_CHANNEL)
        tl.store(y_row + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def fp8_wo_reduce_kernel(part, w_scale, y, N, SPLIT, stride_ps, stride_pm, stride_ym,
                         PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr):
    # y[m, n] = s_w[n] * sum_s part[s, m, n], slices summed in order
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    p = part + m.to(tl.int64) * stride_pm + offs_n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(p + s * stride_ps, mask=n_ok, other=0.0)
    acc = _scale_out(acc, w_scale, offs_n, n_ok, PER_CHANNEL)
    tl.store(y + m.to(tl.int64) * stride_ym + offs_n, acc.to(y.dtype.element_ty), mask=n_ok)


# (BLOCK_N, BLOCK_K, num_warps): an 8 KB E4M3 tile per CTA and K step, 16 bytes per thread and load
GEMV_TILE = (16, 512, 4)
DOT_TILE = (32, 256, 4)
CTAS_PER_SM = 4      # split K until the grid has this many CTAs per SM (each with one tile in flight per step)
MAX_M = 64           # rows the weight-only kernel takes (tl.dot blocks of up to 64 rows)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wo_split(N: int, K: int, gemv: bool, sms: int) -> int:
    """K slices for an `[N, K]` weight: enough CTAs (CTAS_PER_SM per SM), each slice at least one BLOCK_K."""
    bn, bk, _ = GEMV_TILE if gemv else DOT_TILE
    return max(1, min(triton.cdiv(CTAS_PER_SM * sms, triton.cdiv(N, bn)), triton.cdiv(K, bk)))


def fp8_linear_wo_fwd(x: Tensor, w: Tensor, w_scale: Tensor, split: int | None = None,
                      gemv: bool | None = None) -> Tensor:
    """Weight-only FP8 GEMM for small M: x `[M, K]` (bf16, fp16 or fp32; M <= MAX_M), w `[N, K]` float8_e4m3fn,
    w_scale `[N]` or `[]` fp32 -> `[M, N]` in x.dtype, = `fp8_linear_wo_ref` up to fp32 summation order.
    split (K slices) and gemv (the one-row FMA path; default: M == 1) override the launch heuristic (tests)."""
    M, K = x.shape
    N = w.shape[0]
    check(w.dtype == torch.float8_e4m3fn and w.dim() == 2 and w.shape[1] == K,
          f"fp8_linear_wo: w must be float8_e4m3fn [N, K={K}], got {w.dtype} {tuple(w.shape)}")
    check(tuple(w_scale.shape) in ((N,), ()), f"fp8_linear_wo: w_scale {tuple(w_scale.shape)} must be [N={N}] or []")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"fp8_linear_wo: x dtype {x.dtype} unsupported")
    check(0 < M <= MAX_M, f"fp8_linear_wo: M={M} rows; the weight-only kernel takes 1..{MAX_M}")
    gemv = M == 1 if gemv is None else gemv
    check(not gemv or M == 1, "fp8_linear_wo: the GEMV path takes one row")
    bn, bk, warps = GEMV_TILE if gemv else DOT_TILE
    if split is None:
        split = wo_split(N, K, gemv, 8 if INTERPRET else _sms(x.device.index or 0))
    k_slice = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_slice)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    s = w_scale.float().contiguous()
    pc = w_scale.dim() == 1
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    fp8_wo_fwd_kernel[(triton.cdiv(N, bn), split)](
        x, w, s, out, M, N, K, k_slice, x.stride(0), w.stride(0), M * N, N, PER_CHANNEL=pc, SCALE=split == 1,
        GEMV=gemv, DOT_PREC=dot_precision(x.dtype), WIDEN=INTERPRET, BLOCK_M=pow2(M), BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=1 if INTERPRET else 4)
    if split > 1:
        block_n = min(1024, pow2(N))
        fp8_wo_reduce_kernel[(M, triton.cdiv(N, block_n))](
            out, s, y, N, split, M * N, N, N, PER_CHANNEL=pc, BLOCK_N=block_n, num_warps=4)
    return y
