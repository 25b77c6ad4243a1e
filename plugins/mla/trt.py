"""TensorRT side of the MLA kernels: AOT launch contracts (TensorRT-independent plain data from `plugins/aot.py`,
tested on the GPU by launching the PTX through cupy against `torch.ops.k3.*`).

- `k3::mla_decode` is two launches, hence two AOT plugins joined by explicit fp32 intermediates:
  `k3::mla_decode_split` (q, cache, cache_len -> o_part `[B, H, S, 512]`, lse_part `[B, H, S]`) and
  `k3::mla_decode_combine` (q, new_row, o_part, lse_part -> o). S (splits) is fixed at build time from B, H, L
  and the SM count, so the intermediates have static shapes.
- `k3::mla_prefill` is one launch.
Parameters are ordered inputs..., scalars..., outputs...; the scalars are contiguous-layout strides and sizes.
The `tensorrt.plugin` registration itself is not written yet: TensorRT cannot be installed here
(docs/deployment-notes), so it could not be run; the KDA adapter (`plugins/kda/trt.py`) shows the wiring.
"""

from __future__ import annotations

import math

import torch

from k3export.plugins.aot import Launch, compile_ptx, pointer_type
from k3export.plugins.triton_common import cdiv, dot_precision, pow2

from .kernels import (LOG2E, PREFILL_CONFIG, decode_block_h, decode_tiles, mla_decode_combine_kernel,
                      mla_decode_fwd_kernel, mla_prefill_fwd_kernel, prefill_head_blocks, split_rule)

H200_SMS = 132


def decode_splits(B: int, H: int, L: int, sms: int = H200_SMS) -> int:
    """The wrapper's split rule (kernels.split_rule) with the SM count given instead of queried."""
    return split_rule(B, H, L, decode_block_h(H), sms)


def decode_launches(B: int, H: int, L: int, R: int, v_dim: int, dtype: torch.dtype, scale: float,
                    sms: int = H200_SMS, arch: int = 90) -> tuple[Launch, Launch, dict]:
    """(split launch, combine launch, intermediate shapes) of `k3::mla_decode` for contiguous q `[B, H, R]`,
    cache `[B, L, R]`, new_row `[B, R]`, cache_len `[B]` int64 (values 0..L), o `[B, H, v_dim]`."""
    S = decode_splits(B, H, L, sms)
    bh, bv, bpe = decode_block_h(H), pow2(v_dim), pow2(R - v_dim)
    p = pointer_type(dtype)
    cfg = decode_tiles(H)
    fp32 = dtype == torch.float32
    common = dict(H="i32", num_splits="i32", qk_scale="fp32", V_DIM="i32", R="i32")
    scalars = dict(H=H, num_splits=S, qk_scale=scale * LOG2E, V_DIM=v_dim, R=R)
    split_sig = dict(q=p, cache=p, cache_len="*i64", stride_qb="i32", stride_qh="i32", stride_cb="i32",
                     stride_cl="i32", **common, o_part="*fp32", lse_part="*fp32", BLOCK_H="constexpr",
                     BLOCK_N="constexpr", BLOCK_V="constexpr", BLOCK_PE="constexpr", DOT_PREC="constexpr")
    split_k = compile_ptx(mla_decode_fwd_kernel, split_sig,
                          dict(BLOCK_H=bh, BLOCK_N=16 if fp32 else cfg["block_n"], BLOCK_V=bv, BLOCK_PE=bpe,
                               DOT_PREC=dot_precision(dtype)),
                          num_warps=cfg["num_warps"], num_stages=1 if fp32 else cfg["num_stages"], arch=arch)
    split = Launch(split_k, (cdiv(H, bh), S, B), tuple((n, t) for n, t in split_sig.items() if t != "constexpr"),
                   dict(stride_qb=H * R, stride_qh=R, stride_cb=L * R, stride_cl=R, **scalars))
    comb_sig = dict(q=p, new_row=p, o_part="*fp32", lse_part="*fp32", stride_qb="i32", stride_qh="i32",
                    stride_nb="i32", stride_ob="i32", stride_oh="i32", **common, o=p, BLOCK_V="constexpr",
                    BLOCK_PE="constexpr", BLOCK_S="constexpr")
    comb_k = compile_ptx(mla_decode_combine_kernel, comb_sig, dict(BLOCK_V=bv, BLOCK_PE=bpe, BLOCK_S=pow2(S, 2)),
                         num_warps=4, num_stages=1, arch=arch)
    comb = Launch(comb_k, (H, B, 1), tuple((n, t) for n, t in comb_sig.items() if t != "constexpr"),
                  dict(stride_qb=H * R, stride_qh=R, stride_nb=R, stride_ob=H * v_dim, stride_oh=v_dim, **scalars))
    inter = {"o_part": ((B, H, S, bv), torch.float32), "lse_part": ((B, H, S), torch.float32)}
    return split, comb, inter


def prefill_launch(B: int, T: int, S: int, H: int, D: int, Dv: int, dtype: torch.dtype, scale: float,
                   arch: int = 90) -> Launch:
    """The launch of `k3::mla_prefill` for contiguous q `[B, T, H, D]`, k `[B, S, H, D]`, v `[B, S, H, Dv]`,
    past_len `[B]` int64, o `[B, T, H, Dv]` (D >= 16)."""
    p = pointer_type(dtype)
    fp32 = dtype == torch.float32
    cfg = PREFILL_CONFIG
    block_m = 32 if fp32 else min(cfg["block_m"], pow2(T))
    sig = dict(q=p, k=p, v=p, past_len="*i64", **{n: "i32" for n in (
        "stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
        "stride_vh", "stride_ob", "stride_ot", "stride_oh", "T", "S", "H")}, qk_scale="fp32", D_QK="i32",
        D_V="i32", o=p, **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_A", "BLOCK_B", "HAS_B",
                                                     "BLOCK_V", "DOT_PREC")})
    cx = dict(BLOCK_M=block_m, BLOCK_N=32 if fp32 else cfg["block_n"], **prefill_head_blocks(D),
              BLOCK_V=pow2(Dv), DOT_PREC=dot_precision(dtype))
    k = compile_ptx(mla_prefill_fwd_kernel, sig, cx, num_warps=4 if fp32 else cfg["num_warps"],
                    num_stages=1 if fp32 else cfg["num_stages"], arch=arch)
    scalars = dict(stride_qb=T * H * D, stride_qt=H * D, stride_qh=D, stride_kb=S * H * D, stride_ks=H * D,
                   stride_kh=D, stride_vb=S * H * Dv, stride_vs=H * Dv, stride_vh=Dv, stride_ob=T * H * Dv,
                   stride_ot=H * Dv, stride_oh=Dv, T=T, S=S, H=H, qk_scale=scale * LOG2E, D_QK=D, D_V=Dv)
    return Launch(k, (math.ceil(T / block_m), B * H, 1), tuple((n, t) for n, t in sig.items() if t != "constexpr"),
                  scalars)
