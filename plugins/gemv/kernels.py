"""A decode GEMV (y = x W^T for a few rows of x) whose weight loads may start before its predecessor has finished.

At one decode token a linear layer is a GEMV that reads its weight once; on the H200 the small ones (2-10 MB) take
~6 us in cuBLAS where their bytes need ~2 us: the launch, the first DRAM round trips and the tail are exposed
(`scripts/gemv_triton_probe.py`, 2026-11-30 07:36). The weights do not depend on anything earlier in the step, so
under programmatic dependent launch (PDL, `plugins.launch`) the kernel can load them while the kernel before it
still runs, and wait only before it reads x:

    w tile -> registers;  griddepcontrol.wait;  launch_dependents;  x -> registers;  y = sum_k w x  (fp32);  store

Each program owns BLOCK_N output rows and holds their whole rows ([BLOCK_N, BLOCK_K >= K], bf16/fp16/fp32) in
registers, so the loads are one batch with nothing to wait for between them. That bounds K by the register file
(`gemv_tile`: BLOCK_N * BLOCK_K <= 16384 elements per program). The x rows (M of them, M small) reuse the tile.
Without PDL (`PDL` False: CPU interpreter, pre-Hopper GPUs, the switch off) the kernel is a plain GEMV whose wait
is absent; the order of its loads does not matter then.

Safety of the early loads: only the weight is read before the wait, and no kernel of a decode step writes a weight.
Everything the step writes (x, y) is touched after `griddepcontrol.wait`, which returns once the predecessor grid
has completed and its writes are visible; each of our kernels waits before it signals, so completion is
transitive along the stream.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..attn_res.kernels import MAX_SOURCES, _mix_row
from ..launch import pdl_args
from ..moe.kernels import _sigmoid, _tanh

MAX_TILE = 16384          # weight elements per program (BLOCK_N * BLOCK_K): 32 KB of bf16 in registers
# Under PDL, signal the dependents' launch before the weight loads (EARLY) instead of after the wait: the next
# kernel's launch and its own early loads then overlap this one's. Chain of the 52 k3-small decode GEMVs on the
# H200 (scripts/gemv_pdl_probe.py, 2026-11-30 11:25): 265 us early vs 294 after the wait (cuBLAS 407, floor 233).
EARLY = os.environ.get("K3_GEMV_EARLY", "1") == "1"


@triton.jit
def gemv_fwd_kernel(x, w, y, M, N, K, stride_xm, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = True, EARLY: tl.constexpr = False,
                    w_scale=None, SCALE: tl.constexpr = 0, L2_STRIDE: tl.constexpr = 0, L2_LINES: tl.constexpr = 0,
                    L2_EPL: tl.constexpr = 0):
    """y[m, n] = sum_k x[m, k] w[n, k] (* w_scale), rows n of this program, every m < M; w row-major [N, K]
    (contiguous; any float type, E4M3 included: widened to fp32 in registers). SCALE 0: none; 1: one fp32 scale;
    2: fp32 per output row (FP8 weight-only, `fp8.fp8_linear_wo_ref`). PREFETCH: the weight tile (and its scales)
    is loaded before the PDL wait (else after it); EARLY: the dependents' launch is signalled before anything else
    (else right after the wait). Both only matter with PDL. L2_STRIDE > 0 (with PDL and PREFETCH; experimental,
    `l2_prefetch_flags`): programs below L2_STRIDE also prefetch into L2, before the wait, the rows of the blocks
    that later programs will own (pid + L2_STRIDE, pid + 2 L2_STRIDE, ...), L2_LINES 128-byte lines of L2_EPL
    elements per block."""
    rows, ks, n_ok, k_ok, wf, sc = _weight_rows(w, w_scale, N, K, BLOCK_N, BLOCK_K, PDL, PREFETCH, EARLY, SCALE,
                                                L2_STRIDE, L2_LINES, L2_EPL)
    for m in range(M):
        acc = _row_dot(x + m * stride_xm, ks, k_ok, wf, sc, SCALE)
        tl.store(y + m * stride_ym + rows, acc.to(y.dtype.element_ty), mask=n_ok)


@triton.jit
def gemv_glu_fwd_kernel(x, w, y, h, M, N, K, N_PLAIN, stride_xm, stride_ym, stride_hm, beta, linear_beta,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                        PREFETCH: tl.constexpr = True, EARLY: tl.constexpr = False, w_scale=None,
                        SCALE: tl.constexpr = 0):
    """`gemv_fwd_kernel` over a weight whose rows [N_PLAIN, N) are gate / up pairs (gate_i at N_PLAIN + 2i, up_i
    at N_PLAIN + 2i + 1): rows below N_PLAIN go to y[m, n] as they are, each pair to
    h[m, i] = beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta) (SiTU-GLU, `moe.naive.situ_glu`)
    from the fp32 sums. N_PLAIN is a multiple of BLOCK_N (even), so a program is all plain or all pairs."""
    beta = tl.cast(beta, tl.float32)               # Inductor passes Python floats as fp64
    linear_beta = tl.cast(linear_beta, tl.float32)
    rows, ks, n_ok, k_ok, wf, sc = _weight_rows(w, w_scale, N, K, BLOCK_N, BLOCK_K, PDL, PREFETCH, EARLY, SCALE)
    r0 = tl.program_id(0) * BLOCK_N
    pair = (r0 - N_PLAIN) // 2 + tl.arange(0, BLOCK_N // 2)
    for m in range(M):
        acc = _row_dot(x + m * stride_xm, ks, k_ok, wf, sc, SCALE)
        if r0 < N_PLAIN:
            tl.store(y + m * stride_ym + rows, acc.to(y.dtype.element_ty), mask=rows < N_PLAIN)
        else:
            g, u = tl.split(tl.reshape(acc, [BLOCK_N // 2, 2]))
            act = beta * _tanh(g / beta) * _sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
            tl.store(h + m * stride_hm + pair, act.to(h.dtype.element_ty), mask=pair < (N - N_PLAIN) // 2)


@triton.jit
def gemv_norm_fwd_kernel(a, b, w, nw, y, M, N, K, KA, stride_am, stride_bm, stride_ym, eps,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                         PREFETCH: tl.constexpr = True, EARLY: tl.constexpr = False):
    """`gemv_fwd_kernel` whose input row is [rmsnorm(a[m]) * nw | b[m]] (a: KA elements, b: K - KA): every program
    reads the whole input row anyway, so it normalises a itself (a launch fewer than a norm kernel before it).
    The norm rounds as `RMSNorm` does: a * rsqrt(mean(a^2) + eps) in fp32, rounded to a's dtype, times nw, rounded."""
    eps = tl.cast(eps, tl.float32)                 # Inductor passes Python floats as fp64
    rows, ks, n_ok, k_ok, wf, sc = _weight_rows(w, None, N, K, BLOCK_N, BLOCK_K, PDL, PREFETCH, EARLY, 0)
    in_a = ks < KA
    in_b = (ks >= KA) & k_ok
    g = tl.load(nw + ks, mask=in_a, other=0.0).to(tl.float32)
    for m in range(M):
        av = tl.load(a + m * stride_am + ks, mask=in_a, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(av * av) / KA + eps)
        t = (av * r).to(a.dtype.element_ty).to(tl.float32)
        an = (g * t).to(a.dtype.element_ty).to(tl.float32)
        bv = tl.load(b + m * stride_bm + (ks - KA), mask=in_b, other=0.0).to(tl.float32)
        xv = tl.where(in_a, an, bv)
        acc = tl.sum(wf * xv[None, :], 1)
        tl.store(y + m * stride_ym + rows, acc.to(y.dtype.element_ty), mask=n_ok)


@triton.jit
def gemv_mix_fwd_kernel(bank, p, dp, nw, pw, ow, w, p_out, x_out, y, n, N, K, stride_bj, eps, out_eps,
                        N_SRC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                        PREFETCH: tl.constexpr = True, EARLY: tl.constexpr = False):
    """`gemv_fwd_kernel` for one row whose input is `k3::attn_res_add_norm`'s output, computed by every program
    itself after the wait (`attn_res.kernels._mix_row`, the AttnRes kernel's one-chunk code): p_new = p + dp,
    x = RMSNorm_ow(mix(bank rows 0..n-1, p_new)), y = x w^T. Program 0 also stores p_new and x (the sublayer's
    partial sum and the input its other readers take). The weight tile streams before the PDL wait as in
    `gemv_fwd_kernel`; bank, p and dp are read after it."""
    rows, ks, n_ok, k_ok, wf, sc = _weight_rows(w, None, N, K, BLOCK_N, BLOCK_K, PDL, PREFETCH, EARLY, 0)
    offs_j = tl.arange(0, N_SRC)
    j_ok = offs_j < n
    b_row = bank + offs_j[:, None].to(tl.int64) * stride_bj
    vp, o = _mix_row(b_row, p, dp, nw, pw, ow, K, ks, j_ok, eps, out_eps, True, True, p_out, x_out)
    xq = o.to(x_out.dtype.element_ty)
    if tl.program_id(0) == 0:
        tl.store(p_out + ks, vp.to(p_out.dtype.element_ty), mask=k_ok)
        tl.store(x_out + ks, xq, mask=k_ok)
    acc = tl.sum(wf * xq.to(tl.float32)[None, :], 1)
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=n_ok)


@triton.jit
def _l2_prefetch(w, N, K, BLOCK_N: tl.constexpr, STRIDE: tl.constexpr, LINES: tl.constexpr, EPL: tl.constexpr):
    """`prefetch.global.L2` of the weight rows of blocks pid + STRIDE, pid + 2 STRIDE, ... (programs pid < STRIDE):
    one 128-byte line (EPL elements) per thread and LINES lines per block, clamped to the block's rows."""
    pid = tl.program_id(0)
    if pid < STRIDE:
        offs = tl.arange(0, LINES).to(tl.int64) * EPL
        for b in range(pid + STRIDE, tl.cdiv(N, BLOCK_N), STRIDE):
            start = b.to(tl.int64) * BLOCK_N * K
            end = tl.minimum(b.to(tl.int64) * BLOCK_N + BLOCK_N, N) * K
            addr = (w + tl.where(start + offs < end, start + offs, start)).to(tl.int64, bitcast=True)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def _weight_rows(w, w_scale, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr, EARLY: tl.constexpr, SCALE: tl.constexpr, L2_STRIDE: tl.constexpr = 0,
                 L2_LINES: tl.constexpr = 0, L2_EPL: tl.constexpr = 0):
    """This program's BLOCK_N weight rows, whole, widened to fp32, and their scales; with PDL the loads come
    before `griddepcontrol.wait` (PREFETCH) and the dependents' launch is signalled first (EARLY) or after the
    wait. Returns (rows, ks, n_ok, k_ok, w fp32 [BLOCK_N, BLOCK_K], scales)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    n_ok = rows < N
    k_ok = ks < K
    w_ptrs = w + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_mask = n_ok[:, None] & k_ok[None, :]
    if PDL and EARLY:
        gdc_launch_dependents()
    if PREFETCH:
        wv = tl.load(w_ptrs, mask=w_mask, other=0.0)
        sc = _scales(w_scale, rows, n_ok, SCALE)
        if L2_STRIDE > 0:
            _l2_prefetch(w, N, K, BLOCK_N, L2_STRIDE, L2_LINES, L2_EPL)
    if PDL:
        gdc_wait()
        if not EARLY:
            gdc_launch_dependents()
    if not PREFETCH:
        wv = tl.load(w_ptrs, mask=w_mask, other=0.0)
        sc = _scales(w_scale, rows, n_ok, SCALE)
    return rows, ks, n_ok, k_ok, wv.to(tl.float32), sc


@triton.jit
def _row_dot(x_row, ks, k_ok, wf, sc, SCALE: tl.constexpr):
    """sum_k x_row[k] wf[:, k] in fp32 (* the scales)."""
    xv = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(wf * xv[None, :], 1)
    if SCALE != 0:
        acc = acc * sc
    return acc


@triton.jit
def _scales(w_scale, rows, n_ok, SCALE: tl.constexpr):
    """The weight scales of this program's rows (fp32 [BLOCK_N]), or 1.0 without scales."""
    if SCALE == 2:
        return tl.load(w_scale + rows, mask=n_ok, other=0.0)
    elif SCALE == 1:
        return tl.load(w_scale)
    else:
        return 1.0


def gemv_tile(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a [N, K] weight: whole rows (BLOCK_K = next power of two >= K), as many
    rows as fit MAX_TILE elements (at most 8), 4 warps up to 8192 elements per program, else 8."""
    bk = triton.next_power_of_2(K)
    if bk > MAX_TILE:
        raise ValueError(f"gemv: K = {K} exceeds the register tile ({MAX_TILE} elements per program); use F.linear")
    bn = max(1, min(8, MAX_TILE // bk))
    return bn, bk, 4 if bn * bk <= 8192 else 8


def _weight_ok(w: torch.Tensor, K: int) -> bool:
    """w [N, K] contiguous, its rows within the register tile."""
    return w.dim() == 2 and w.is_contiguous() and w.shape[1] == K and triton.next_power_of_2(K) <= MAX_TILE


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv_fwd` takes this call: x [..., K] with few rows, w [N, K] contiguous of x's dtype, K within
    the register tile."""
    return _weight_ok(w, x.shape[-1]) and x.dtype == w.dtype


def supported_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """Whether `gemv_fwd(x, w, w_scale=...)` takes an FP8 weight-only call: w [N, K] E4M3 contiguous, x a 16/32-bit
    float [..., K], w_scale fp32 `[]` or `[N]`, K within the register tile."""
    return (_weight_ok(w, x.shape[-1]) and w.dtype == torch.float8_e4m3fn
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w_scale.dtype == torch.float32
            and tuple(w_scale.shape) in ((), (w.shape[0],)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` as `[M, K]` rows with unit stride in K (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def gemv_fwd(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, tile=None,
             w_scale: torch.Tensor | None = None, **flags) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (* w_scale: `[]` or `[N]` fp32, for E4M3 weights) -> [..., N] in x's dtype (fp32
    accumulation). `tile` overrides `gemv_tile`; `flags` (PDL / PREFETCH / EARLY, and launch_pdl) go to the launch
    as they are (`plugins.launch.pdl_args` gives PDL's)."""
    K, N = x.shape[-1], w.shape[0]
    x2 = _rows(x)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out.view(M, N)
    bn, bk, nw = tile or gemv_tile(N, K)
    if w_scale is not None:
        flags.update(w_scale=w_scale.contiguous(), SCALE=2 if w_scale.dim() else 1)
    gemv_fwd_kernel[(triton.cdiv(N, bn),)](x2, w, y, M, N, K, x2.stride(0), y.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                            num_warps=nw, **flags)
    return y.view(*x.shape[:-1], N)


def glu_supported(x: torch.Tensor, w: torch.Tensor, n_plain: int) -> bool:
    """Whether `gemv_glu_fwd` takes this call: `supported`, an even pair region, and a tile of >= 2 rows that
    divides n_plain (no program straddles the plain and the pair rows)."""
    if not supported(x, w) or (w.shape[0] - n_plain) % 2 or n_plain < 0:
        return False
    bn = gemv_tile(*w.shape)[0]
    return bn >= 2 and n_plain % bn == 0


def gemv_glu_fwd(x: torch.Tensor, w: torch.Tensor, n_plain: int, beta: float, linear_beta: float,
                 tile=None, **flags) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] @ w[N, K]^T with the rows from n_plain on as gate / up pairs: -> (y [..., n_plain], h [...,
    (N - n_plain) / 2] = SiTU-GLU of each pair), both in x's dtype (`gemv_glu_fwd_kernel`)."""
    K, N = x.shape[-1], w.shape[0]
    x2 = _rows(x)
    M, I = x2.shape[0], (N - n_plain) // 2
    y = torch.empty(M, n_plain, dtype=x.dtype, device=x.device)
    h = torch.empty(M, I, dtype=x.dtype, device=x.device)
    bn, bk, nw = tile or gemv_tile(N, K)
    if n_plain % bn or bn % 2 or (N - n_plain) % 2:
        raise ValueError(f"gemv_glu: n_plain={n_plain} must be a multiple of the row tile {bn} (even), "
                         f"N - n_plain={N - n_plain} even")
    gemv_glu_fwd_kernel[(triton.cdiv(N, bn),)](x2, w, y, h, M, N, K, n_plain, x2.stride(0), y.stride(0), h.stride(0),
                                                float(beta), float(linear_beta), BLOCK_N=bn, BLOCK_K=bk,
                                                num_warps=nw, **flags)
    return y.view(*x.shape[:-1], n_plain), h.view(*x.shape[:-1], I)


def norm_supported(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, nw: torch.Tensor) -> bool:
    """Whether `gemv_norm_fwd` takes this call: a [..., KA] and b [..., KB] with the same leading shape and dtype,
    nw [KA] of that dtype, w [N, KA + KB] as `supported` wants it."""
    return (a.shape[:-1] == b.shape[:-1] and a.dtype == b.dtype == nw.dtype == w.dtype and a.shape[-1] > 0
            and tuple(nw.shape) == (a.shape[-1],) and _weight_ok(w, a.shape[-1] + b.shape[-1]))


def gemv_norm_fwd(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, nw: torch.Tensor, eps: float, tile=None,
                  **flags) -> torch.Tensor:
    """[rmsnorm(a) * nw | b] @ w^T -> [..., N] in a's dtype, the norm inside the GEMV (`gemv_norm_fwd_kernel`)."""
    KA, N = a.shape[-1], w.shape[0]
    K = w.shape[1]
    a2 = _rows(a)
    M = a2.shape[0]
    b2 = _rows(b) if b.shape[-1] else a2                     # no b columns: any valid pointer, never read
    y = torch.empty(M, N, dtype=a.dtype, device=a.device)
    bn, bk, nw_ = tile or gemv_tile(N, K)
    gemv_norm_fwd_kernel[(triton.cdiv(N, bn),)](a2, b2, w, nw.contiguous(), y, M, N, K, KA, a2.stride(0),
                                                 b2.stride(0), y.stride(0), float(eps), BLOCK_N=bn, BLOCK_K=bk,
                                                 num_warps=nw_, **flags)
    return y.view(*a.shape[:-1], N)


def mix_supported(bank, p, y, norm_weight, proj_weight, out_weight, w) -> bool:
    """Whether `gemv_mix_fwd` takes this call: one row (bank `[1, n, d]` with 1 <= n <= MAX_SOURCES and unit stride
    in d, p and y `[1, d]` contiguous), every tensor of p's dtype (bf16 / fp16 / fp32) on p's device, the weights
    `[d]` (proj_weight `[1, d]` or `[d]`), w as `supported` wants it with K = d, and the bank rows and the weight
    tile within the register budget of `attn_res.kernels.row_tiling`'s one-chunk path."""
    from ..attn_res.kernels import ONE_ROW_MAX
    from ..triton_common import pow2
    if bank.dim() != 3 or p.dim() != 2 or bank.shape[0] != 1 or p.shape[0] != 1:
        return False
    n, D = bank.shape[1], bank.shape[2]
    dt = p.dtype
    return (1 <= n <= MAX_SOURCES and bank.stride(-1) == 1 and tuple(p.shape) == (1, D) and p.is_contiguous()
            and y.shape == p.shape and y.is_contiguous() and dt in (torch.bfloat16, torch.float16, torch.float32)
            and all(t.dtype == dt and t.device == p.device for t in (bank, y, norm_weight, proj_weight, out_weight, w))
            and tuple(norm_weight.shape) == (D,) and tuple(out_weight.shape) == (D,)
            and proj_weight.numel() == D and _weight_ok(w, D) and pow2(D) * pow2(n, 2) <= ONE_ROW_MAX)


def gemv_mix_fwd(bank, p, y, norm_weight, proj_weight, eps: float, out_weight, out_eps: float, w, tile=None,
                 **flags) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`k3::gemv_mix` at one row (`mix_supported`): -> (p + y, x = attn_res_norm(bank, p + y, ...), x w^T), one
    launch (`gemv_mix_fwd_kernel`). On CUDA the launch caps registers at 128 (env K3_GEMV_MIX_MAXNREG, read at
    each launch; 0: no cap) unless flags give `maxnreg`: uncapped the kernel takes 171 registers at k3-small's
    8 x 2048 tile with 4 bank rows (ptxas, sm_90, Triton 3.6), one program per SM instead of the plain GEMV's two
    (123 registers); capped it spills 44 bytes (none with 2 rows). Which is faster is an A/B on the H200."""
    from ..triton_common import pow2
    cap = int(os.environ.get("K3_GEMV_MIX_MAXNREG", "128"))
    n, D = bank.shape[1], bank.shape[2]
    N = w.shape[0]
    p_new, x = torch.empty_like(p), torch.empty_like(p)
    out = torch.empty(1, N, dtype=p.dtype, device=p.device)
    bn, bk, nw_ = tile or gemv_tile(N, D)
    if cap and "maxnreg" not in flags and p.device.type == "cuda":
        flags["maxnreg"] = cap
    pw = proj_weight.reshape(-1).contiguous()
    gemv_mix_fwd_kernel[(triton.cdiv(N, bn),)](bank, p, y, norm_weight.contiguous(), pw, out_weight.contiguous(), w,
                                                p_new, x, out, n, N, D, bank.stride(1), float(eps), float(out_eps),
                                                N_SRC=pow2(n, 2), BLOCK_N=bn, BLOCK_K=bk, num_warps=nw_, **flags)
    return p_new, x, out


def launch_flags(x: torch.Tensor) -> dict:
    """The PDL launch options for a GEMV on x's device as the switch gives them (`launch.pdl_args`), with EARLY."""
    flags = pdl_args(x)
    if flags:
        flags.update(PDL=True, EARLY=EARLY)          # its own EARLY (the weights stream before the wait)
    return flags


_SMS: dict[int, int] = {}       # device index -> multiprocessor count


def l2_flags(x: torch.Tensor, w: torch.Tensor, flags: dict) -> dict:
    """With env K3_GEMV_L2PF=1 (read at each launch; experimental, off by default) and PDL in `flags`: the
    `gemv_fwd_kernel` options that make its first programs prefetch the later programs' weight rows into L2 before
    the wait (`_l2_prefetch`; stride: the programs resident at once, estimated as 2 per SM at 8 warps, 4 at 4);
    else {}."""
    if os.environ.get("K3_GEMV_L2PF", "0") != "1" or not flags.get("PDL"):
        return {}
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    bn, bk, nw = gemv_tile(*w.shape)
    epl = 128 // w.element_size()
    return dict(L2_STRIDE=_SMS[idx] * (2 if nw == 8 else 4), L2_LINES=max(1, bn * bk // epl), L2_EPL=epl)


def _cuda(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if not supported(x, w):
        from .op import gemv_ref
        return gemv_ref(x, w)                                # the op's contract, for shapes the kernel does not take
    flags = launch_flags(x)
    return gemv_fwd(x, w, **flags, **l2_flags(x, w, flags))


def _cuda_glu(x, w, n_plain: int, beta: float, linear_beta: float):
    if not glu_supported(x, w, n_plain):
        from .op import gemv_glu_ref
        return gemv_glu_ref(x, w, n_plain, beta, linear_beta)
    return gemv_glu_fwd(x, w, n_plain, beta, linear_beta, **launch_flags(x))


def _cuda_norm(a, b, w, nw, eps: float):
    if not norm_supported(a, b, w, nw):
        from .op import gemv_norm_ref
        return gemv_norm_ref(a, b, w, nw, eps)
    return gemv_norm_fwd(a, b, w, nw, eps, **launch_flags(a))


def _cuda_mix(bank, p, y, norm_weight, proj_weight, eps: float, out_weight, out_eps: float, w):
    if not mix_supported(bank, p, y, norm_weight, proj_weight, out_weight, w):
        from .op import gemv_mix_ref
        return gemv_mix_ref(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps, w)
    return gemv_mix_fwd(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps, w, **launch_flags(p))


def _register() -> None:
    from .op import gemv, gemv_glu, gemv_mix, gemv_norm
    gemv.register_kernel("cuda")(_cuda)
    gemv_mix.register_kernel("cuda")(_cuda_mix)
    gemv_glu.register_kernel("cuda")(_cuda_glu)
    gemv_norm.register_kernel("cuda")(_cuda_norm)


_register()
