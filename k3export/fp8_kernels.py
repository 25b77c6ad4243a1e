"""Triton kernels behind `k3::fp8_linear` on CUDA.

    fp8_quant_fwd_kernel -> fp8_quant_fwd      large M (prefill): x `[M, K]` -> E4M3 `[M, K]` + row scales `[M, 1]`
                                               for `torch._scaled_mm` (one launch instead of four)
    fp8_wo_fwd_kernel    -> fp8_linear_wo_fwd  small M (decode): weight-only FP8 (W8A16), see below
    fp8_wo_gemv4_fwd_kernel                    its one-row packed variant (a tiling's choice, see below)
    fp8_wo_reduce_kernel                       its split-K sum as a second launch (split_sum "launch")

Weight-only: x stays in its own dtype (no activation quantization, so the activation scale is unused); each E4M3
weight tile `[BLOCK_N, BLOCK_K]` is read once with K-contiguous (16-byte) loads, widened in registers (exact:
every E4M3 value is a bf16, fp16 and fp32 value), multiplied with x in fp32 and scaled per output channel at the
end: y = x (W_q s_w)^T = (x W_q^T) s_w, as `k3export.fp8.fp8_linear_wo_ref`. One row (M = 1) uses FMAs into a
`[BLOCK_N, BLOCK_K]` fp32 tile reduced over K once at the end (a GEMV); 2..64 rows a `tl.dot` of x against the
widened tile (16-row blocks). Decode GEMMs are latency-bound when few CTAs stream long K loops (the old fused
kernel: one CTA per 32 columns, ~25 us per k3-small GEMM), so the grid also splits K into SPLIT slices until it
has about `WoTiles.ctas_per_sm` CTAs per SM (`wo_split`; `WoTiles.min_slice` can also bound the slice from below).
Split slices write fp32 partials `[SPLIT, M, N]` that are summed in slice order, scaled and rounded once, either
by a second launch (`fp8_wo_reduce_kernel`, split_sum "launch") or inside the GEMV launch (split_sum "fixup", the
serial fixup of stream-K, `_fixup`): each slice's CTA stores its partial tile, then (CTA barrier, then one
acq_rel gpu-scope atomic) takes a ticket on its column tile's int32 counter; the CTA that draws ticket SPLIT - 1
reads the SPLIT partials (L2 loads, `.cg`) in slice order, sums, scales, rounds, stores y and zeroes the counter.
Both give the same y bit for bit whatever order the CTAs finish in (the same fp32 additions in the same order).
The counters are one int32 buffer per device (`triton_common.tickets`, shared with the MoE decode kernels),
allocated zeroed once and kept (nothing is allocated or zeroed per call: CUDA-graph friendly; every launch leaves
them zero; a first call inside a CUDA-graph capture gets fresh zeros instead). They are per DEVICE, not per
stream: calls on one device must be stream-ordered (the model's case, graphs included); two fixup launches running
concurrently on two streams of one device could share a counter and give wrong sums. `SPLIT_SUM` is the default
(env K3_FP8_SPLIT_SUM overrides it, for A/B timing of a whole model); a `WoTiles.split_sum` or the `split_sum`
argument choose per launch.

The packed GEMV (one bf16 row) reads the weights as int32 words of 4 E4M3 and x as int64 words of 4 bf16, so its
fp32 tile has a quarter of the byte kernel's accumulator registers per weight byte, and unpacks each word into
4 fp32 in registers (`_unpack4`: plain Triton shifts, or PTX: packed E4M3 -> f16 converts, or integer bit moves
and one exact multiply); optionally the next weight tile is loaded before the current one is used. `WoTiles`
names a launch; `GEMV_TILINGS` holds the one-row launches that `k3export bench fp8 --variants` times at the
full-width shapes, `GEMV` the default.

`fp8_quant_fwd` computes exactly `k3export.fp8.quantize` (IEEE division by the scale, saturation at +-448, round
to nearest even). Under the CPU interpreter (triton 3.9) its fp32 -> E4M3 conversion is wrong when rounding
carries into the next binade (126.5 -> 64 instead of 128), so there the quantization runs in torch; E4M3 -> fp32
widening is exact there, but its bf16/fp16 `tl.dot` is wrong (measured: 2.8e10 off on a 16x16 bf16 product), so
the weight-only `tl.dot` widens both operands to fp32 under it (WIDEN): the same exact products as the 16-bit MMA.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3export.fp8 import quantize
from k3export.plugins.triton_common import check, dot_precision, pow2, tickets

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SPLIT_SUMS = ("fixup", "launch")
# How split-K partials are summed by default (THE place to flip it): "fixup" inside the GEMV launch, "launch" by
# `fp8_wo_reduce_kernel` after it. Both are bit-identical (tests/test_fp8_kernels_split.py); which is faster is
# for the H200 to say (`scripts/fp8_split_sum.py`). K3_FP8_SPLIT_SUM=launch|fixup overrides it for a process.
SPLIT_SUM = os.environ.get("K3_FP8_SPLIT_SUM") or "fixup"


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


# PTX for `_unpack4`: an int32 holding 4 E4M3 bytes (byte j = element j, little-endian) -> 4 fp32 in $0..$3.
# "cvt": two packed E4M3x2 -> f16x2 converts, then f16 -> fp32 (exact). "bits": byte j to the top byte (shl),
# arithmetic shift right by 4 and mask 0x87F00000 (sign at bit 31, exponent+mantissa at bits 26..20: the E4M3 value
# times 2^-120, an fp32 subnormal for E4M3 subnormals), then times 2^120 (0f7B800000; mul.rn.f32 has no
# flush-to-zero): exact for every finite E4M3 value, +-0 included.
_UNPACK_CVT_ASM = tl.constexpr(
    "{ .reg .b16 lo, hi, f0, f1, f2, f3; .reg .b32 p, q; mov.b32 {lo, hi}, $4; "
    "cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi; mov.b32 {f0, f1}, p; mov.b32 {f2, f3}, q; "
    "cvt.f32.f16 $0, f0; cvt.f32.f16 $1, f1; cvt.f32.f16 $2, f2; cvt.f32.f16 $3, f3; }")
_UNPACK_BITS_ASM = tl.constexpr("{ .reg .b32 t; " + " ".join(
    (f"shl.b32 t, $4, {24 - 8 * j}; shr.s32 t, t, 4; " if j < 3 else "shr.s32 t, $4, 4; ")
    + f"and.b32 t, t, 0x87F00000; mul.rn.f32 ${j}, t, 0f7B800000;" for j in range(4)) + " }")


@triton.jit
def _unpack4(v, UNPACK: tl.constexpr):
    """int32 tile holding 4 E4M3 bytes per element -> 4 fp32 tiles (element j from byte j), exact. UNPACK "shift":
    plain Triton (shift, mask, bitcast to E4M3, convert; also the interpreter's), "cvt" / "bits": the PTX above."""
    if UNPACK == "cvt":
        return tl.inline_asm_elementwise(_UNPACK_CVT_ASM, "=r,=r,=r,=r,r", [v], dtype=(tl.float32,) * 4,
                                         is_pure=True, pack=1)
    elif UNPACK == "bits":
        return tl.inline_asm_elementwise(_UNPACK_BITS_ASM, "=r,=r,=r,=r,r", [v], dtype=(tl.float32,) * 4,
                                         is_pure=True, pack=1)
    else:
        w0 = (v & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w1 = ((v >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w2 = ((v >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w3 = ((v >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return w0, w1, w2, w3


@triton.jit
def _bf16x4(xv):
    """int64 holding 4 bf16 (element j in bits 16j..16j+15) -> 4 fp32 (exact: a bf16 is the top half of its fp32)."""
    lo = xv.to(tl.int32)
    hi = (xv >> 32).to(tl.int32)
    return ((lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True),
            (hi << 16).to(tl.float32, bitcast=True), (hi & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _fma4(acc, v, xv, UNPACK: tl.constexpr):
    w0, w1, w2, w3 = _unpack4(v, UNPACK)
    x0, x1, x2, x3 = _bf16x4(xv)
    acc += w0 * x0[None, :]
    acc += w1 * x1[None, :]
    acc += w2 * x2[None, :]
    acc += w3 * x3[None, :]
    return acc


@triton.jit
def _gemv4(x4, w4, n_ok, offs_c, c_lo, c_hi, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
           UNPACK: tl.constexpr, PREFETCH: tl.constexpr):
    """[BLOCK_N] fp32: sum over the 4-byte columns c in [c_lo, c_hi) of W[n, 4c + j] x[4c + j], j < 4, with
    w4 `[BN, BC]` int32 pointers (4 E4M3 weights each, K contiguous) and x4 an int64 pointer (4 bf16 each).
    Accumulates `[BN, BC]` in fp32, reduced once at the end. PREFETCH: the next weight tile is loaded before this
    one is used (two tiles in flight per CTA: the pipeliner stages no load that feeds no tl.dot)."""
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    if PREFETCH:
        v = tl.load(w4 + c_lo, mask=n_ok[:, None] & ((c_lo + offs_c) < c_hi)[None, :], other=0)
        for c0 in range(c_lo, c_hi, BLOCK_C):
            v_next = tl.load(w4 + c0 + BLOCK_C, mask=n_ok[:, None] & ((c0 + BLOCK_C + offs_c) < c_hi)[None, :],
                             other=0)
            xv = tl.load(x4 + c0 + offs_c, mask=(c0 + offs_c) < c_hi, other=0)
            acc = _fma4(acc, v, xv, UNPACK)
            v = v_next
    else:
        for c0 in range(c_lo, c_hi, BLOCK_C):
            c_ok = (c0 + offs_c) < c_hi
            v = tl.load(w4 + c0, mask=n_ok[:, None] & c_ok[None, :], other=0)
            xv = tl.load(x4 + c0 + offs_c, mask=c_ok, other=0)
            acc = _fma4(acc, v, xv, UNPACK)
    return tl.sum(acc, 1)


@triton.jit
def _scale_out(acc, w_scale, offs_n, n_ok, PER_CHANNEL: tl.constexpr):
    """acc `[..., BLOCK_N]` times the weight scale of its columns (per output channel, or one per matrix)."""
    if PER_CHANNEL:
        return acc * tl.load(w_scale + offs_n, mask=n_ok, other=0.0)
    return acc * tl.load(w_scale)


@triton.jit
def _fixup(acc, part, y, mask, count, w_scale, offs_n, n_ok, stride_ps, PER_CHANNEL: tl.constexpr):
    """The in-launch split-K sum: acc (this slice's fp32 partial) goes to part (pointers of its elements in slice
    0; slices stride_ps apart); the CTA that takes the last ticket of its column tile's counter sums the tile's
    SPLIT partials in slice order (as `fp8_wo_reduce_kernel`), scales, stores y (pointers, y's dtype) and zeroes
    the counter for the next launch."""
    s = tl.program_id(1)
    split = tl.num_programs(1)
    tl.store(part + s.to(tl.int64) * stride_ps, acc, mask=mask)
    tl.debug_barrier()                          # every thread's partial stored before the release below
    ticket = tl.atomic_add(count + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    if ticket == split - 1:                     # the other SPLIT - 1 partials are stored and visible
        tot = tl.zeros_like(acc)
        # 4 L2 loads in flight, added in slice order. A slice past SPLIT loads +0.0 and changes nothing: tot starts
        # at +0.0 and a round-to-nearest sum is -0.0 only when both terms are, so tot is never -0.0 and tot + 0.0
        # == tot exactly. tl.where for the masks: the interpreter makes mask & (t + 1 < split) int32 and refuses it.
        for t in range(0, split, 4):
            p = part + t * stride_ps
            p0 = tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
            p1 = tl.load(p + stride_ps, mask=tl.where(t + 1 < split, mask, False), other=0.0, cache_modifier=".cg")
            p2 = tl.load(p + 2 * stride_ps, mask=tl.where(t + 2 < split, mask, False), other=0.0,
                         cache_modifier=".cg")
            p3 = tl.load(p + 3 * stride_ps, mask=tl.where(t + 3 < split, mask, False), other=0.0,
                         cache_modifier=".cg")
            tot += p0
            tot += p1
            tot += p2
            tot += p3
        tot = _scale_out(tot, w_scale, offs_n, n_ok, PER_CHANNEL)
        tl.store(y, tot.to(y.dtype.element_ty), mask=mask)
        tl.store(count + tl.program_id(0), 0)   # every ticket of this launch is taken: ready for the next one


@triton.jit
def _wo_epilogue(acc, y, part, mask, count, w_scale, offs_n, n_ok, stride_ps, PER_CHANNEL: tl.constexpr,
                 SPLIT_SUM: tl.constexpr):
    """acc `[..., BN]` fp32 of slice program_id(1) -> y (one slice: SPLIT_SUM ""), the partials part ("launch":
    `fp8_wo_reduce_kernel` sums them) or the partials then y (`_fixup`). y, part: pointers at slice 0."""
    if SPLIT_SUM == "fixup":
        _fixup(acc, part, y, mask, count, w_scale, offs_n, n_ok, stride_ps, PER_CHANNEL)
    elif SPLIT_SUM == "launch":
        tl.store(part + tl.program_id(1).to(tl.int64) * stride_ps, acc, mask=mask)
    else:
        acc = _scale_out(acc, w_scale, offs_n, n_ok, PER_CHANNEL)
        tl.store(y, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def fp8_wo_fwd_kernel(x, w, w_scale, y, part, count, M, N, K, K_SLICE, stride_x, stride_w, stride_ym, stride_ps,
                      PER_CHANNEL: tl.constexpr, SPLIT_SUM: tl.constexpr, GEMV: tl.constexpr,
                      DOT_PREC: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # part[s, m, n] = sum over k in slice s of x[m, k] W_q[n, k]; y[m, n] = s_w[n] sum_s part[s, m, n]
    # (`_wo_epilogue`: y directly when unsplit, SPLIT_SUM "")
    s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = s * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K)
    w_ptr = w + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]              # [BN, BK], K contiguous
    if GEMV:                                                                            # M == 1
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + offs_k) < k_hi
            b = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(x + k0 + offs_k, mask=k_ok, other=0.0)
            acc2 += b.to(tl.float32) * a.to(tl.float32)[None, :]
        acc = tl.sum(acc2, 1)                                                           # [BN]
        _wo_epilogue(acc, y + offs_n, part + offs_n, n_ok, count, w_scale, offs_n, n_ok, stride_ps, PER_CHANNEL,
                     SPLIT_SUM)
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
        offs_y = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]              # [BM, BN]
        _wo_epilogue(acc, y + offs_y, part + offs_y, m_ok[:, None] & n_ok[None, :], count, w_scale,
                     offs_n[None, :], n_ok[None, :], stride_ps, PER_CHANNEL, SPLIT_SUM)


@triton.jit
def fp8_wo_gemv4_fwd_kernel(x4, w4, w_scale, y, part, count, N, C, C_SLICE, stride_w4, stride_ps,
                            PER_CHANNEL: tl.constexpr, SPLIT_SUM: tl.constexpr, UNPACK: tl.constexpr,
                            PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    # one bf16 row, K = 4 C: part[s, n] = sum over 4-byte columns c in slice s of x W_q[n]^T;
    # y[n] = s_w[n] sum_s part[s, n] (`_wo_epilogue`)
    s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_c = tl.arange(0, BLOCK_C)
    c_lo = s * C_SLICE
    w_ptr = w4 + offs_n[:, None].to(tl.int64) * stride_w4 + offs_c[None, :]           # [BN, BC] int32
    acc = _gemv4(x4, w_ptr, n_ok, offs_c, c_lo, tl.minimum(c_lo + C_SLICE, C), BLOCK_N, BLOCK_C, UNPACK, PREFETCH)
    _wo_epilogue(acc, y + offs_n, part + offs_n, n_ok, count, w_scale, offs_n, n_ok, stride_ps, PER_CHANNEL,
                 SPLIT_SUM)


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


@dataclass(frozen=True)
class WoTiles:
    """One launch of the weight-only kernel: an E4M3 tile `[block_n, block_k]` (block_k in weights = bytes) per CTA
    and K step, num_warps, num_stages, the CTAs per SM that the K split aims for (`wo_split`); for one bf16 row also
    the packed GEMV (`fp8_wo_gemv4_fwd_kernel`: weights read as int32 words of 4, x as int64 words of 4 bf16) with
    its E4M3 unpacking ("shift", "cvt" or "bits": `_unpack4`; "cvt" and "bits" are PTX, the interpreter runs
    "shift") and prefetch (the next weight tile loaded before the current one is used). unpack "" = the byte
    kernel (`fp8_wo_fwd_kernel`). min_slice: K elements per slice at least (0: the CTA target alone decides);
    split_sum: how split slices are summed ("fixup" in the launch, "launch" a second one; "" = `SPLIT_SUM`)."""
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4
    ctas_per_sm: int = 4
    unpack: str = ""
    prefetch: bool = False
    min_slice: int = 0
    split_sum: str = ""


# One-row (GEMV) launches by name: "n16k512" is the byte kernel measured 2026-11-29 (8 KB E4M3 tile per CTA and K
# step, 16 bytes per thread and load); the "p*" names are the packed GEMV. `k3export bench fp8 --variants` times
# them all at the full-width pair's shapes (error checked against `fp8_linear_wo_ref`).
GEMV_TILINGS = {
    "n16k512": WoTiles(16, 512, 4, 4, 4),
    "n16k512-c16": WoTiles(16, 512, 4, 4, 16),
    "p-n16k512-shift": WoTiles(16, 512, 4, 1, 8, "shift"),
    "p-n16k512-cvt-pf": WoTiles(16, 512, 4, 1, 8, "cvt", True),
    "p-n16k512-cvt-pf-c16": WoTiles(16, 512, 4, 1, 16, "cvt", True),
    "p-n8k512-cvt-pf": WoTiles(8, 512, 4, 1, 8, "cvt", True),
    "p-n8k512-cvt-pf-c4": WoTiles(8, 512, 4, 1, 4, "cvt", True),      # fewer K slices: fewer split-K sums
    "p-n8k512-cvt-pf-c6": WoTiles(8, 512, 4, 1, 6, "cvt", True),
    "p-n16k512-bits-pf": WoTiles(16, 512, 4, 1, 8, "bits", True),
    "p-n16k1024-cvt-pf": WoTiles(16, 1024, 4, 1, 8, "cvt", True),
    "p-n16k1024-cvt-pf-c16": WoTiles(16, 1024, 4, 1, 16, "cvt", True),
    "p-n32k1024-w8-cvt-pf": WoTiles(32, 1024, 8, 1, 8, "cvt", True),
    "p-n16k2048-w8-cvt-pf": WoTiles(16, 2048, 8, 1, 8, "cvt", True),
    # the default's launch with each split-K sum named (the default follows SPLIT_SUM), and with no split below
    # 4096-element slices (k3-small: only its 8192-wide down_proj splits, in two)
    "p-n8k512-cvt-pf-c4-fixup": WoTiles(8, 512, 4, 1, 4, "cvt", True, split_sum="fixup"),
    "p-n8k512-cvt-pf-c4-launch": WoTiles(8, 512, 4, 1, 4, "cvt", True, split_sum="launch"),
    "p-n8k512-cvt-pf-c4-s4096": WoTiles(8, 512, 4, 1, 4, "cvt", True, min_slice=4096),
    "p-n8k512-cvt-pf-c4-s2048": WoTiles(8, 512, 4, 1, 4, "cvt", True, min_slice=2048),
}
# The default one-row launch. H200, 2026-11-30 (`k3export bench fp8 --no-model --variants`, docs/perf.md), the 9
# linear shapes of the full-width pair, us per GEMM back to back in one graph, summed: p-n8k512-cvt-pf 150.4,
# p-n16k512-cvt-pf 154.6, p-n16k512-shift 155.1, the byte kernel n16k512 164.0 (bf16 F.linear 225.8); in the
# FP8 layer pair 0.571 / 0.573 ms with it vs 0.589 / 0.600 (MLA + MoE / KDA + MoE, experts unchanged).
# 2026-11-30 03:45 (same command): p-n8k512-cvt-pf-c4 (4 CTAs per SM: fewer K slices to sum) 137.7 summed,
# -c6 140.5, p-n8k512-cvt-pf 150.6 (bf16 229.7); the pair 0.478 / 0.482 ms with it (experts default) vs
# 0.495 / 0.498 ms (bf16 0.714 / 0.771); every named launch passed its cuda test in that call.
# Those figures sum split slices with a second launch (split_sum "launch"); names without a split_sum follow
# SPLIT_SUM, so a run after the "fixup" default times them with the in-launch sum.
# 2026-11-30 07:36 (`scripts/fp8_split_sum.py`, in-launch "fixup" sum): slices shorter than ~2048 cost more than
# they gain. k3-small's K = 768..2048 GEMVs: unsplit 0.4-1.1 us faster each than 2-3 fixup slices (per decode step
# at M = 1: s4096 363 us, unsplit 366, fixup 397, launch 427); at K = 7168 / 8192 splitting still pays (576 x 7168:
# 7 slices 5.9 us, unsplit 10.6). Default: the c4 launch with slices of >= 2048 (k3-small: only the 8192-wide
# down_proj splits, as with fixup; K3: 576 x 7168 in 3 slices instead of 7, that one shape not measured).
GEMV = GEMV_TILINGS["p-n8k512-cvt-pf-c4-s2048"]
BYTE_GEMV = GEMV_TILINGS["n16k512"]            # the byte kernel's one-row launch where the packed one cannot run
DOT_TILE = WoTiles(32, 256, 4, 4, 4)           # 2..MAX_M rows (tl.dot of x against the widened tile)
MAX_M = 64           # rows the weight-only kernel takes (tl.dot blocks of up to 64 rows)
UNPACKS = ("shift", "cvt", "bits")


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wo_split(N: int, K: int, tiles: WoTiles, sms: int) -> int:
    """K slices for an `[N, K]` weight: enough CTAs (tiles.ctas_per_sm per SM), each slice at least one block_k
    (and tiles.min_slice)."""
    most = K // max(tiles.block_k, tiles.min_slice) if tiles.min_slice else triton.cdiv(K, tiles.block_k)
    return max(1, min(triton.cdiv(tiles.ctas_per_sm * sms, triton.cdiv(N, tiles.block_n)), most))


def wo_slices(K: int, split: int, block_k: int) -> tuple[int, int]:
    """(SPLIT, K per slice) launched for `split` slices asked: the slice rounded up to block_k (the last one
    shorter), so SPLIT <= split."""
    k_slice = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    return triton.cdiv(K, k_slice), k_slice


def packed_ok(x: Tensor, w: Tensor) -> bool:
    """The packed GEMV reads x as int64 words (4 bf16) and w as int32 words (4 E4M3): one bf16 row, K % 4 == 0,
    rows of w 4-byte aligned."""
    K = w.shape[1]
    return (x.dtype == torch.bfloat16 and x.shape[0] == 1 and K % 4 == 0 and x.stride(-1) == 1
            and x.data_ptr() % 8 == 0 and w.stride(-1) == 1 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0)


def fp8_linear_wo_fwd(x: Tensor, w: Tensor, w_scale: Tensor, split: int | None = None,
                      gemv: bool | None = None, tiles: WoTiles | None = None, split_sum: str | None = None) -> Tensor:
    """Weight-only FP8 GEMM for small M: x `[M, K]` (bf16, fp16 or fp32; M <= MAX_M), w `[N, K]` float8_e4m3fn,
    w_scale `[N]` or `[]` fp32 -> `[M, N]` in x.dtype, = `fp8_linear_wo_ref` up to fp32 summation order.
    split (K slices), gemv (the one-row FMA path; default: M == 1) and tiles (default GEMV or DOT_TILE) override
    the launch heuristic (tests, sweeps). A packed tiling falls back to the byte kernel (BYTE_GEMV, or DOT_TILE
    for several rows) where `packed_ok` fails (fp16 / fp32 x, K % 4, unaligned rows). split_sum ("fixup" or
    "launch"; default tiles.split_sum, else `SPLIT_SUM`): how split slices are summed; y is the same bit for bit.
    "fixup" uses the device's ticket counters (`triton_common.tickets`): calls on one device must be
    stream-ordered."""
    M, K = x.shape
    N = w.shape[0]
    check(w.dtype == torch.float8_e4m3fn and w.dim() == 2 and w.shape[1] == K,
          f"fp8_linear_wo: w must be float8_e4m3fn [N, K={K}], got {w.dtype} {tuple(w.shape)}")
    check(tuple(w_scale.shape) in ((N,), ()), f"fp8_linear_wo: w_scale {tuple(w_scale.shape)} must be [N={N}] or []")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"fp8_linear_wo: x dtype {x.dtype} unsupported")
    check(0 < M <= MAX_M, f"fp8_linear_wo: M={M} rows; the weight-only kernel takes 1..{MAX_M}")
    gemv = M == 1 if gemv is None else gemv
    check(not gemv or M == 1, "fp8_linear_wo: the GEMV path takes one row")
    t = tiles or (GEMV if gemv else DOT_TILE)
    check(t.unpack in ("", *UNPACKS), f"fp8_linear_wo: unpack '{t.unpack}' is not one of {UNPACKS} or ''")
    mode = split_sum or t.split_sum or SPLIT_SUM
    check(mode in SPLIT_SUMS, f"fp8_linear_wo: split_sum '{mode}' is not one of {SPLIT_SUMS} (argument, "
          f"WoTiles.split_sum or env K3_FP8_SPLIT_SUM)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    packed = gemv and bool(t.unpack) and packed_ok(x, w)
    if t.unpack and not packed:
        t = BYTE_GEMV if gemv else DOT_TILE
    if split is None:
        split = wo_split(N, K, t, 8 if INTERPRET else _sms(x.device.index or 0))
    split, k_slice = wo_slices(K, split, t.block_k)
    s = w_scale.float().contiguous()
    pc = w_scale.dim() == 1
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, t.block_n), split)             # one M block: BLOCK_M = pow2(M) rows
    mode = "" if split == 1 else mode
    part = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    count = tickets(x, grid[0]) if mode == "fixup" else y       # y: a placeholder, never read
    stages = 1 if INTERPRET else t.stages
    if packed:
        fp8_wo_gemv4_fwd_kernel[grid](
            x.view(torch.int64), w.view(torch.int32), s, y, part, count, N, K // 4, k_slice // 4, w.stride(0) // 4,
            M * N, PER_CHANNEL=pc, SPLIT_SUM=mode, UNPACK="shift" if INTERPRET else t.unpack, PREFETCH=t.prefetch,
            BLOCK_N=t.block_n, BLOCK_C=t.block_k // 4, num_warps=t.warps, num_stages=stages)
    else:
        fp8_wo_fwd_kernel[grid](
            x, w, s, y, part, count, M, N, K, k_slice, x.stride(0), w.stride(0), N, M * N, PER_CHANNEL=pc,
            SPLIT_SUM=mode, GEMV=gemv, DOT_PREC=dot_precision(x.dtype), WIDEN=INTERPRET, BLOCK_M=pow2(M),
            BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=stages)
    if mode == "launch":
        block_n = min(1024, pow2(N))
        fp8_wo_reduce_kernel[(M, triton.cdiv(N, block_n))](
            part, s, y, N, split, M * N, N, N, PER_CHANNEL=pc, BLOCK_N=block_n, num_warps=4)
    return y
