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

from ..launch import launch, pdl_args
from ..moe.kernels import _sigmoid, _tanh

MAX_TILE = 16384          # weight elements per program (BLOCK_N * BLOCK_K): 32 KB of bf16 in registers
# Under PDL, signal the dependents' launch before the weight loads (EARLY) instead of after the wait: the next
# kernel's launch and its own early loads then overlap this one's. Chain of the 52 k3-small decode GEMVs on the
# H200 (scripts/gemv_pdl_probe.py, 2026-11-30 11:25): 265 us early vs 294 after the wait (cuBLAS 407, floor 233).
EARLY = os.environ.get("K3_GEMV_EARLY", "1") == "1"


@triton.jit
def gemv_fwd_kernel(x, w, y, M, N, K, stride_xm, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = True, EARLY: tl.constexpr = False,
                    w_scale=None, SCALE: tl.constexpr = 0, BLOCK_M: tl.constexpr = 0):
    """y[m, n] = sum_k x[m, k] w[n, k] (* w_scale), rows n of this program, every m < M; w row-major [N, K]
    (contiguous; any float type, E4M3 included: widened to fp32 in registers). SCALE 0: none; 1: one fp32 scale;
    2: fp32 per output row (FP8 weight-only, `fp8.fp8_linear_wo_ref`). PREFETCH: the weight tile (and its scales)
    is loaded before the PDL wait (else after it); EARLY: the dependents' launch is signalled before anything else
    (else right after the wait). Both only matter with PDL.
    BLOCK_M 0: the x rows one after another, each loaded when its turn comes (M dependent round trips after the
    wait); BLOCK_M >= M (a power of two): all M rows loaded in one batch, then the same per-row sums (bit-identical
    to the loop: each row is taken out of the batch exactly)."""
    rows, ks, n_ok, k_ok, wf, sc = _weight_rows(w, w_scale, N, K, BLOCK_N, BLOCK_K, PDL, PREFETCH, EARLY, SCALE)
    if BLOCK_M == 0:
        for m in range(M):
            acc = _row_dot(x + m * stride_xm, ks, k_ok, wf, sc, SCALE)
            tl.store(y + m * stride_ym + rows, acc.to(y.dtype.element_ty), mask=n_ok)
    else:
        ms = tl.arange(0, BLOCK_M)
        xt = tl.load(x + ms[:, None] * stride_xm + ks[None, :], mask=(ms < M)[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            xm = tl.sum(tl.where(ms[:, None] == m, xt, 0.0), 0)          # row m: one value and zeros per column
            acc = tl.sum(wf * xm[None, :], 1)
            if SCALE != 0:
                acc = acc * sc
            tl.store(y + m * stride_ym + rows, acc.to(y.dtype.element_ty), mask=n_ok & (rows * 0 + m < M))


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
def gemv_cols_fwd_kernel(a, b, wa, wb, sa, sb, y, N, KA, KB, BLOCK_N: tl.constexpr, BLOCK_KA: tl.constexpr,
                         BLOCK_KB: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr = False,
                         EARLY: tl.constexpr = False):
    """One row, two linears whose outputs are summed (their inputs concatenated): y[n] = (sum_k wa[n, k] a[k]) * sa
    + (sum_k wb[n, k] b[k]) * sb in fp32, rounded once to y's dtype. wa `[N, KA]`, wb `[N, KB]` contiguous, any float
    type (E4M3 included); SA / SB as `gemv_fwd_kernel`'s SCALE (0 none, 1 one fp32 scale, 2 one per row). Both
    weight tiles (and their scales) stream before the PDL wait, a and b are read after it."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    ka = tl.arange(0, BLOCK_KA)
    kb = tl.arange(0, BLOCK_KB)
    if PDL and EARLY:
        gdc_launch_dependents()
    va = tl.load(wa + rows[:, None].to(tl.int64) * KA + ka[None, :], mask=n_ok[:, None] & (ka < KA)[None, :],
                 other=0.0)
    vb = tl.load(wb + rows[:, None].to(tl.int64) * KB + kb[None, :], mask=n_ok[:, None] & (kb < KB)[None, :],
                 other=0.0)
    s_a = _scales(sa, rows, n_ok, SA)
    s_b = _scales(sb, rows, n_ok, SB)
    if PDL:
        gdc_wait()
        if not EARLY:
            gdc_launch_dependents()
    xa = tl.load(a + ka, mask=ka < KA, other=0.0).to(tl.float32)
    xb = tl.load(b + kb, mask=kb < KB, other=0.0).to(tl.float32)
    acc = tl.sum(va.to(tl.float32) * xa[None, :], 1) * s_a + tl.sum(vb.to(tl.float32) * xb[None, :], 1) * s_b
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=n_ok)


@triton.jit
def _weight_rows(w, w_scale, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr, EARLY: tl.constexpr, SCALE: tl.constexpr):
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


MAX_BATCHED_ROWS = 4      # up to this many x rows are loaded in one batch (`gemv_fwd_kernel` BLOCK_M), more in turn


def gemv_fwd(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, tile=None,
             w_scale: torch.Tensor | None = None, **flags) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T (* w_scale: `[]` or `[N]` fp32, for E4M3 weights) -> [..., N] in x's dtype (fp32
    accumulation). `tile` overrides `gemv_tile`; `flags` (PDL / PREFETCH / EARLY, and launch_pdl) go to the launch
    as they are (`plugins.launch.pdl_args` gives PDL's). 2 to `MAX_BATCHED_ROWS` rows load their x in one batch
    (BLOCK_M; one row and more than that many: one row at a time, as before)."""
    K, N = x.shape[-1], w.shape[0]
    x2 = _rows(x)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out.view(M, N)
    bn, bk, nw = tile or gemv_tile(N, K)
    if w_scale is not None:
        flags.update(w_scale=w_scale.contiguous(), SCALE=_scale_mode(w_scale))
    flags.setdefault("BLOCK_M", batched_rows(M))
    launch(gemv_fwd_kernel)[(triton.cdiv(N, bn),)](x2, w, y, M, N, K, x2.stride(0), y.stride(0), BLOCK_N=bn,
                                                    BLOCK_K=bk, num_warps=nw, **flags)
    return y.view(*x.shape[:-1], N)


def batched_rows(M: int) -> int:
    """`gemv_fwd_kernel`'s BLOCK_M for M rows: the next power of two for 2..MAX_BATCHED_ROWS, else 0 (in turn)."""
    return triton.next_power_of_2(M) if 2 <= M <= MAX_BATCHED_ROWS else 0


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


def cols_tile(N: int, KA: int, KB: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_KA, BLOCK_KB, num_warps) for `gemv_cols_fwd_kernel`: whole rows of both weights, as many rows
    (a power of two, at most 8) as fit MAX_TILE elements together, 4 warps up to 8192 elements, else 8."""
    bka, bkb = triton.next_power_of_2(KA), triton.next_power_of_2(KB)
    if bka + bkb > MAX_TILE:
        raise ValueError(f"gemv_cols: KA + KB = {KA} + {KB} exceed the register tile ({MAX_TILE} elements)")
    bn = 1
    while bn < 8 and 2 * bn * (bka + bkb) <= MAX_TILE:
        bn *= 2
    return bn, bka, bkb, 4 if bn * (bka + bkb) <= 8192 else 8


def _scale_mode(s: torch.Tensor | None) -> int:
    """The kernels' SCALE constexpr for a weight scale: 0 none, 1 one fp32 scale, 2 one per row."""
    return 0 if s is None else 2 if s.dim() else 1


def _kind_ok(w: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """A weight of the activations' dtype without a scale, or E4M3 with an fp32 scale `[]` or `[N]`."""
    if s is None:
        return w.dtype == dtype
    return w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) in ((), (w.shape[0],))


def cols_supported(a, b, wa, sa, wb, sb) -> bool:
    """Whether `gemv_cols_fwd` takes this call: one row each of a `[1, KA]` and b `[1, KB]` (16-/32-bit floats of one
    dtype), wa `[N, KA]` and wb `[N, KB]` contiguous (of a's dtype, or E4M3 with fp32 scales `[]` / `[N]`), both
    weights' rows together within the register tile."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != 1 or b.shape[0] != 1 or a.dtype != b.dtype:
        return False
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or wa.dim() != 2 or wb.dim() != 2:
        return False
    N = wa.shape[0]
    ok_w = all(w.is_contiguous() and _kind_ok(w, s, a.dtype) for w, s in ((wa, sa), (wb, sb)))
    return (ok_w and wb.shape[0] == N and wa.shape[1] == a.shape[1] and wb.shape[1] == b.shape[1]
            and triton.next_power_of_2(wa.shape[1]) + triton.next_power_of_2(wb.shape[1]) <= MAX_TILE)


def gemv_cols_fwd(a, b, wa, sa, wb, sb, tile=None, **flags) -> torch.Tensor:
    """a @ (wa * sa)^T + b @ (wb * sb)^T for one row -> `[1, N]` in a's dtype, one fp32 sum rounded once
    (`gemv_cols_fwd_kernel`; sa / sb None: unscaled weights of a's dtype)."""
    N, KA, KB = wa.shape[0], wa.shape[1], wb.shape[1]
    y = torch.empty(1, N, dtype=a.dtype, device=a.device)
    bn, bka, bkb, nw = tile or cols_tile(N, KA, KB)
    launch(gemv_cols_fwd_kernel)[(triton.cdiv(N, bn),)](
        a.contiguous(), b.contiguous(), wa, wb, sa if sa is not None else wa, sb if sb is not None else wb, y, N, KA,
        KB, BLOCK_N=bn, BLOCK_KA=bka, BLOCK_KB=bkb, SA=_scale_mode(sa), SB=_scale_mode(sb), num_warps=nw, **flags)
    return y


def launch_flags(x: torch.Tensor) -> dict:
    """The PDL launch options for a GEMV on x's device as the switch gives them (`launch.pdl_args`), with EARLY."""
    flags = pdl_args(x)
    if flags:
        flags.update(PDL=True, EARLY=EARLY)          # its own EARLY (the weights stream before the wait)
    return flags


def _cuda(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if not supported(x, w):
        from .op import gemv_ref
        return gemv_ref(x, w)                                # the op's contract, for shapes the kernel does not take
    return gemv_fwd(x, w, **launch_flags(x))


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


def _register() -> None:
    from .op import gemv, gemv_glu, gemv_norm
    gemv.register_kernel("cuda")(_cuda)
    gemv_glu.register_kernel("cuda")(_cuda_glu)
    gemv_norm.register_kernel("cuda")(_cuda_norm)


_register()
