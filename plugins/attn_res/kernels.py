"""Triton AttnRes kernel: one launch for `k3::attn_res` (see CONTRACT.md), replacing ~18 small torch kernels, and
for `k3::attn_res_norm` (the same launch with the consumer's RMSNorm as a third pass).

    pass 1:  per source j (bank rows 0..n-1, then p), over d in BLOCK_D chunks, in fp32:
             ss_j = sum_d V_j^2,  dot_j = sum_d V_j * norm_weight * proj_weight
             s_j = rsqrt(ss_j / d + eps) * dot_j;  a = softmax_j(s)
    pass 2:  out = sum_j a_j V_j in fp32 -> p.dtype                  attn_res_fwd_kernel   [N, d]

One program per token row; the row's n + 1 sources are read twice (no fp32 copy of them is kept).

The kernel is the CUDA implementation of `k3::attn_res` unless K3_ATTN_RES_TRITON=0 is set when this module is
imported (the escape hatch, as K3_KDA_TRITON for KDA). float64 inputs always keep the plain-torch reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..launch import launch, pdl_args, pdl_wait
from ..triton_common import check, pow2
from .op import attn_res, attn_res_add_norm, attn_res_norm

MAX_SOURCES = 16                     # bank rows a launch takes (K3: n <= 8); N_SRC is a power of two >= n
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ENABLED = os.environ.get("K3_ATTN_RES_TRITON", "1") != "0"


@triton.jit
def _sources(b_row, p_row, r, D, d0, offs_d, j_ok, ADD: tl.constexpr, dp, p_out, STORE: tl.constexpr):
    """The chunk at d0 of the row's sources, fp32: bank rows vb `[N_SRC, BLOCK_D]` and p `[BLOCK_D]`; with ADD, p is
    p + dp as torch adds two tensors of p's dtype (in fp32, rounded once to that dtype), stored to p_out if STORE."""
    d_ok = (d0 + offs_d) < D
    vb = tl.load(b_row + d0 + offs_d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    vp = tl.load(p_row + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if ADD:
        vy = tl.load(dp + r * D + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        vp = (vp + vy).to(p_out.dtype.element_ty).to(tl.float32)
        if STORE:
            tl.store(p_out + r * D + d0 + offs_d, vp.to(p_out.dtype.element_ty), mask=d_ok)
    return vb, vp


@triton.jit
def attn_res_fwd_kernel(bank, p, nw, pw, out, n, D, stride_bn, stride_bj, stride_pn, eps,
                        N_SRC: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr = False, ow=None,
                        out_eps=0.0, ADD: tl.constexpr = False, dp=None, p_out=None, ONE: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """Row r: out[r] = sum_j softmax(s)_j V_j over V = (bank[r, 0..n-1], p[r]); the d axis has unit stride.
    NORM (`k3::attn_res_norm`): then out[r] = ow * (x * rsqrt(mean(x^2) + out_eps)) with x the mix rounded to
    out's dtype, as the model's RMSNorm computes it (a third pass over the row this program just wrote).
    ADD (`k3::attn_res_add_norm`): the source p is p + dp rounded to p's dtype (the residual add before the mix;
    dp, p_out contiguous `[N, d]`), stored to p_out in pass 1 and recomputed in pass 2.
    ONE (BLOCK_D >= D: the row is one chunk): the sources stay in registers from pass 1 on; passes 2 and 3 reuse
    them and the stored x instead of reloading (same arithmetic as the loops with one chunk: bit-identical to
    them at the same num_warps).
    PDL (programmatic dependent launch, `launch.pdl_args`): wait for the stream predecessor before anything else."""
    pdl_wait(PDL)
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    r = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, N_SRC)
    j_ok = offs_j < n
    offs_d = tl.arange(0, BLOCK_D)
    b_row = bank + r * stride_bn + offs_j[:, None].to(tl.int64) * stride_bj     # [N_SRC, 1] pointers
    p_row = p + r * stride_pn
    ss_b = tl.zeros([N_SRC], tl.float32)
    dot_b = tl.zeros([N_SRC], tl.float32)
    ss_p = tl.zeros([BLOCK_D], tl.float32)
    dot_p = tl.zeros([BLOCK_D], tl.float32)
    if ONE:                                                                      # pass 1 on the whole row, kept
        d_ok = offs_d < D
        gw = tl.load(nw + offs_d, mask=d_ok, other=0.0).to(tl.float32) * \
            tl.load(pw + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        vb1, vp1 = _sources(b_row, p_row, r, D, 0, offs_d, j_ok, ADD, dp, p_out, True)
        ss_b += tl.sum(vb1 * vb1, 1)
        dot_b += tl.sum(vb1 * gw[None, :], 1)
        ss_p += vp1 * vp1
        dot_p += vp1 * gw
    for d0 in range(0, D if not ONE else 0, BLOCK_D):                           # pass 1: the scores
        d_ok = (d0 + offs_d) < D
        gw = tl.load(nw + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32) * \
            tl.load(pw + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)       # [BLOCK_D]
        vb, vp = _sources(b_row, p_row, r, D, d0, offs_d, j_ok, ADD, dp, p_out, True)
        ss_b += tl.sum(vb * vb, 1)
        dot_b += tl.sum(vb * gw[None, :], 1)
        ss_p += vp * vp
        dot_p += vp * gw
    s_b = tl.where(j_ok, tl.rsqrt(ss_b / D + eps) * dot_b, float("-inf"))      # [N_SRC]
    s_p = tl.rsqrt(tl.sum(ss_p, 0) / D + eps) * tl.sum(dot_p, 0)
    m = tl.maximum(tl.max(s_b, 0), s_p)
    e_b = tl.exp(s_b - m)
    e_p = tl.exp(s_p - m)
    z = tl.sum(e_b, 0) + e_p
    a_b = e_b / z
    a_p = e_p / z
    o_row = out + r * D
    ss_o = tl.zeros([BLOCK_D], tl.float32)
    if ONE:                                                                      # passes 2 and 3 from registers
        d_ok = offs_d < D
        o = tl.sum(a_b[:, None] * vb1, 0) + a_p * vp1
        if NORM:
            x = o.to(out.dtype.element_ty).to(tl.float32)
            ss_o += x * x
            r_o = tl.rsqrt(tl.sum(ss_o, 0) / D + tl.cast(out_eps, tl.float32))
            y = (x * r_o).to(out.dtype.element_ty).to(tl.float32)
            w = tl.load(ow + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            o = w * y
        tl.store(o_row + offs_d, o.to(out.dtype.element_ty), mask=d_ok)
    for d0 in range(0, D if not ONE else 0, BLOCK_D):                           # pass 2: the mix
        d_ok = (d0 + offs_d) < D
        vb, vp = _sources(b_row, p_row, r, D, d0, offs_d, j_ok, ADD, dp, p_out, False)
        o = tl.sum(a_b[:, None] * vb, 0) + a_p * vp
        tl.store(o_row + d0 + offs_d, o.to(out.dtype.element_ty), mask=d_ok)
        if NORM:                                                                 # the norm sees the stored x
            x = o.to(out.dtype.element_ty).to(tl.float32)
            ss_o += x * x
    if NORM and not ONE:                                                         # pass 3: the consumer's RMSNorm
        r_o = tl.rsqrt(tl.sum(ss_o, 0) / D + tl.cast(out_eps, tl.float32))
        tl.debug_barrier()                                                       # the row's pass-2 stores
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + offs_d) < D
            x = tl.load(o_row + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            y = (x * r_o).to(out.dtype.element_ty).to(tl.float32)
            w = tl.load(ow + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            tl.store(o_row + d0 + offs_d, (w * y).to(out.dtype.element_ty), mask=d_ok)


ONE_ROW_MAX = 8192     # fp32 bank values a program keeps in registers for the one-chunk path (k3-small: 4 x 2048)


def row_tiling(D: int, n_src: int, block_d: int | None = None, single: bool | None = None,
               warps: int | None = None) -> tuple[int, bool, int]:
    """(BLOCK_D, ONE, num_warps). A row whose sources fit ONE_ROW_MAX values is one chunk held in registers
    (8 warps: 32 values per thread at 4 x 2048), else chunks of ~4096 bank values (8 x 512 for K3's n = 8:
    enough bytes in flight, few registers), 4 warps. block_d / single / warps override (tests: the warp count
    sets the order of the cross-thread sums, so only launches with equal warps can agree bit for bit)."""
    one = pow2(D) * n_src <= ONE_ROW_MAX if single is None else single
    bd = block_d or (pow2(D) if one else min(pow2(D), max(64, 4096 // n_src)))
    one = one and bd >= D
    return bd, one, warps or (8 if one else 4)


def attn_res_fwd(bank, p, norm_weight, proj_weight, eps: float, block_d: int | None = None, norm=None, add=None,
                 single: bool | None = None, warps: int | None = None):
    """The op's contract (see op.py): bank `[N, n, d]` (1 <= n <= 16), p `[N, d]`, norm_weight `[d]`,
    proj_weight `[1, d]` or `[d]` -> out `[N, d]` contiguous, in p.dtype; fp32 inside.

    bank and p may be row-strided views (the model passes `bank[:, :n]` of its `[N, blocks, d]` bank): only the d
    axis must have unit stride, else that tensor is copied. block_d (a power of two) overrides the chunk width."""
    check(bank.dim() == 3, f"attn_res: bank must be [N, n, d], got shape {tuple(bank.shape)}")
    N, n, D = bank.shape
    check(1 <= n <= MAX_SOURCES, f"attn_res: bank has n={n} sealed rows; the kernel takes 1..{MAX_SOURCES}")
    check(tuple(p.shape) == (N, D), f"attn_res: p {tuple(p.shape)} must be [N={N}, d={D}] like bank "
          f"{tuple(bank.shape)}")
    check(tuple(norm_weight.shape) == (D,), f"attn_res: norm_weight {tuple(norm_weight.shape)} must be [d={D}]")
    check(tuple(proj_weight.shape) in ((1, D), (D,)), f"attn_res: proj_weight {tuple(proj_weight.shape)} must be "
          f"[1, d={D}] or [d={D}]")
    for name, t in (("bank", bank), ("p", p), ("norm_weight", norm_weight), ("proj_weight", proj_weight)):
        check(t.dtype in DTYPES, f"attn_res: {name} is {t.dtype}; the kernel takes float32/float16/bfloat16 "
              f"(float64 runs use the reference, attn_res_mix)")
        check(t.device == p.device, f"attn_res: {name} is on {t.device}, p on {p.device}")
    check(block_d is None or (block_d >= 16 and block_d & (block_d - 1) == 0),
          f"attn_res: block_d={block_d} must be a power of two >= 16")
    out = torch.empty((N, D), device=p.device, dtype=p.dtype)
    if out.numel() == 0:
        return out
    bank = bank if bank.stride(-1) == 1 else bank.contiguous()
    p = p if p.stride(-1) == 1 else p.contiguous()
    nw = norm_weight.contiguous()
    pw = proj_weight.reshape(-1).contiguous()
    n_src = pow2(n, 2)
    bd, one, warps = row_tiling(D, n_src, block_d, single, warps)
    extra = dict(NORM=True, ow=norm[0], out_eps=float(norm[1])) if norm is not None else {}
    if add is not None:                                   # (dp, p_out): the source p is p + dp, written to p_out
        extra.update(ADD=True, dp=add[0], p_out=add[1])
    launch(attn_res_fwd_kernel)[(N,)](bank, p, nw, pw, out, n, D, bank.stride(0), bank.stride(1), p.stride(0),
                                      float(eps), N_SRC=n_src, BLOCK_D=bd, ONE=one, num_warps=warps, **extra,
                                      **pdl_args(p))
    return out


def attn_res_norm_fwd(bank, p, norm_weight, proj_weight, eps: float, out_weight, out_eps: float,
                      block_d: int | None = None, add=None, single: bool | None = None, warps: int | None = None):
    """`k3::attn_res_norm`: `attn_res_fwd`'s contract, then the consumer's RMSNorm (out_weight `[d]`, same dtype as
    p) in the same launch."""
    D = p.shape[-1]
    check(tuple(out_weight.shape) == (D,), f"attn_res_norm: out_weight {tuple(out_weight.shape)} must be [d={D}]")
    check(out_weight.dtype == p.dtype and out_weight.device == p.device,
          f"attn_res_norm: out_weight ({out_weight.dtype}, {out_weight.device}) must match p ({p.dtype}, {p.device})")
    return attn_res_fwd(bank, p, norm_weight, proj_weight, eps, block_d, norm=(out_weight.contiguous(), out_eps),
                        add=add, single=single, warps=warps)


def attn_res_add_norm_fwd(bank, p, y, norm_weight, proj_weight, eps: float, out_weight, out_eps: float,
                          block_d: int | None = None, single: bool | None = None, warps: int | None = None):
    """`k3::attn_res_add_norm`: p_new = p + y (p's dtype), then `attn_res_norm_fwd` on p_new, in one launch.
    Returns (p_new, out)."""
    check(y.shape == p.shape and y.dtype == p.dtype and y.device == p.device,
          f"attn_res_add_norm: y ({tuple(y.shape)}, {y.dtype}) must match p ({tuple(p.shape)}, {p.dtype})")
    p_new = torch.empty(p.shape, device=p.device, dtype=p.dtype)
    out = attn_res_norm_fwd(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps, block_d,
                            add=(y.contiguous(), p_new), single=single, warps=warps)
    return p_new, out


def _cuda(bank, p, norm_weight, proj_weight, eps):
    if torch.float64 in (bank.dtype, p.dtype, norm_weight.dtype, proj_weight.dtype):  # validation stays fp64
        return attn_res._init_fn(bank, p, norm_weight, proj_weight, eps)
    return attn_res_fwd(bank, p, norm_weight, proj_weight, eps)


def _cuda_norm(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps):
    if torch.float64 in (bank.dtype, p.dtype, out_weight.dtype) or out_weight.dtype != p.dtype:
        return attn_res_norm._init_fn(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps)
    return attn_res_norm_fwd(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps)


def _cuda_add_norm(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps):
    if torch.float64 in (bank.dtype, p.dtype, out_weight.dtype) or not out_weight.dtype == y.dtype == p.dtype:
        return attn_res_add_norm._init_fn(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps)
    return attn_res_add_norm_fwd(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps)


if ENABLED:
    attn_res.register_kernel("cuda")(_cuda)
    attn_res_norm.register_kernel("cuda")(_cuda_norm)
    attn_res_add_norm.register_kernel("cuda")(_cuda_add_norm)
