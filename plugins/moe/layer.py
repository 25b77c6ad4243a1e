"""`k3::moe_layer_decode`: a Stable LatentMoE sublayer after its input projection, at one decode row, as one
persistent launch (experimental, opt-in; not yet run on a GPU).

    phase 1  router logits  x G^T (fp32), rows of G spread over the programs             [E] fp32 scratch
    -- grid barrier --
    phase 2  every program: top-k of sigmoid(logits) + bias (as `moe_topk_fwd_kernel`); then the k experts'
             gemm1 rows: h[j] = SiTU-GLU(z W1_e^T, z W3_e^T), row blocks spread over the programs          [k, I]
    -- grid barrier --
    phase 3  gemm2 + combine: u[cols] = sum_j w_j h[j] W2_e[cols]^T in fp32, slot order, column blocks      [L]
    -- grid barrier --
    phase 4  y = [RMSNorm(u) * nw | h_s] W_out^T (as `k3::gemv_norm`), row blocks                           [d]

In a decode step the same work is six launches (router, top-k, gemm1, gemm2 + combine, the latent norm, the output
GEMV), each a dependent launch boundary; here three grid barriers (an arrive counter in global memory: the first of
the device's kept ticket counters, `triton_common.tickets`, left at 0 as its other users leave theirs; spun on with
acquire reads) stand in for them. `scripts/barrier_probe.py` measures what a barrier costs against a launch. The
programs must all be resident at once (grid <= SMs x programs per SM), or the first barrier never opens: the host
launches `programs` <= the SM count, one 4- or 8-warp program per SM by default.

PHASE (constexpr): 0 runs the four phases with barriers (the GPU launch); 1..4 runs only that phase, no barrier,
so four launches in turn give the same result (the Triton interpreter runs programs one after another, where a
barrier would wait forever: the CPU tests run the phases this way, and so can any caller).
The CPU / reference implementation is `k3::moe_routed` then `k3::gemv_norm`'s reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..gemv.op import gemv_norm_ref
from ..launch import INTERPRET, launch, pdl_args, pdl_wait
from ..triton_common import check, pow2, tickets
from .kernels import _sigmoid, _situ_glu, _topk
from .op import moe_routed


@torch.library.custom_op("k3::moe_layer_decode", mutates_args=())
def moe_layer_decode(x: Tensor, z: Tensor, hs: Tensor, gate_weight: Tensor, bias: Tensor, w1: Tensor, w3: Tensor,
                     w2: Tensor, w_out: Tensor, norm_weight: Tensor, eps: float, top_k: int, renormalize: bool,
                     scaling: float, beta: float, linear_beta: float) -> Tensor:
    """x `[N, d]` (router input), z `[N, L]` (routed down projection), hs `[N, I_s]` (the shared experts' SiTU-GLU),
    gate_weight / bias / w1 / w3 / w2 as `k3::moe_routed`, w_out `[d, L + I_s]` ([up | shared down]), norm_weight
    `[L]` (the latent RMSNorm's) -> `[N, d]` in z.dtype = up(RMSNorm(u)) + shared_down(hs), u the routed sum: what
    `LatentMoE` computes after its (glu-packed) input projection."""
    u = moe_routed(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)
    return gemv_norm_ref(u, hs, w_out, norm_weight, eps)


@moe_layer_decode.register_fake
def _(x, z, hs, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps, top_k, renormalize, scaling, beta,
      linear_beta):
    return z.new_empty((*z.shape[:-1], w_out.shape[0]))


@triton.jit
def _grid_sync(bar, target):
    """Wait until the arrive counter reaches target (every program has arrived target / grid times)."""
    tl.debug_barrier()                                    # every thread's stores of the phase issued
    tl.atomic_add(bar, 1, sem="release")
    seen = tl.atomic_add(bar, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(bar, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _selection(logits, bias, E, scaling, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
               RENORM: tl.constexpr):
    """(expert ids, weights * scaling) `[BLOCK_K]` from the router logits (read through L2: other programs wrote
    them)."""
    offs = tl.arange(0, BLOCK_E)
    lg = tl.load(logits + offs, mask=offs < E, other=0.0, cache_modifier=".cg")
    top, wt = _topk(_sigmoid(lg), bias, E, K, BLOCK_K, BLOCK_E, RENORM, False)
    return top, wt * scaling


@triton.jit
def _pick(v, slots, j):
    """v[j] of a `[BLOCK_K]` vector, as a scalar."""
    return tl.sum(tl.where(slots == j, v, 0), 0)


@triton.jit
def _gemm1_tile(w1, w3, top, slots, it, total, nb, I, L, stride_we, stride_wi, ol, BN1: tl.constexpr):
    """Work item it of phase 2 (slot it // nb, row block it % nb of I): its w1 / w3 rows `[BN1, BL]` as loaded
    (all masked off past the last item), the rows and their mask."""
    j = it // nb
    e = _pick(top, slots, j).to(tl.int64)
    rows = (it % nb) * BN1 + tl.arange(0, BN1)
    r_ok = (rows < I) & ((it + tl.zeros([BN1], tl.int32)) < total)     # a tensor in the interpreter too
    off = e * stride_we + rows[:, None].to(tl.int64) * stride_wi + ol[None, :]
    m = r_ok[:, None] & (ol < L)[None, :]
    return tl.load(w1 + off, mask=m, other=0.0), tl.load(w3 + off, mask=m, other=0.0), rows, r_ok


@triton.jit
def _out_tile(w_out, r0, D, K_OUT, oo, BN3: tl.constexpr):
    """Rows r0.. of W_out `[BN3, BO]` as loaded (masked past D), the rows and their mask."""
    rows = r0 + tl.arange(0, BN3)
    r_ok = rows < D
    wv = tl.load(w_out + rows[:, None].to(tl.int64) * K_OUT + oo[None, :],
                 mask=r_ok[:, None] & (oo < K_OUT)[None, :], other=0.0)
    return wv, rows, r_ok


@triton.jit
def moe_layer_decode_kernel(
    x, z, hs, g, bias, w1, w3, w2, w_out, nw, y,             # inputs, output
    logits, h, u, bar,                                      # scratch: [E] fp32, [K, I], [L]; bar: tickets[0]
    D, E, L, I, IS, stride_we, stride_wi, eps, scaling, beta, linear_beta,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BD: tl.constexpr, BL: tl.constexpr,
    BI: tl.constexpr, BO: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
    RENORM: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr = False,
):
    """See the module docstring. w1 / w3 `[E, I, L]` with strides (stride_we, stride_wi, 1) (the paired layout's
    views too), w2 `[E, L, I]` and w_out `[D, L + IS]` contiguous. BD / BL / BI / BO: powers of two >= D, L, I,
    L + IS (whole rows in registers); BN1 / BN2 / BN3 rows per work item of phases 2 / 3 / 4."""
    pdl_wait(PDL)
    eps = tl.cast(eps, tl.float32)
    scaling = tl.cast(scaling, tl.float32)
    beta = tl.cast(beta, tl.float32)
    linear_beta = tl.cast(linear_beta, tl.float32)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    slots = tl.arange(0, BLOCK_K)

    if PHASE == 0 or PHASE == 1:                          # router logits, one expert row per item
        od = tl.arange(0, BD)
        xv = tl.load(x + od, mask=od < D, other=0.0).to(tl.float32)
        for ex in range(pid, E, G):
            gv = tl.load(g + ex * D + od, mask=od < D, other=0.0).to(tl.float32)         # E * D < 2^31
            tl.store(logits + ex, tl.sum(gv * xv, 0))
    if PHASE == 0:
        _grid_sync(bar, G)

    if PHASE == 0 or PHASE == 2:                          # top-k, then the selected experts' gemm1 rows
        top, wt = _selection(logits, bias, E, scaling, K, BLOCK_K, BLOCK_E, RENORM)
        ol = tl.arange(0, BL)
        zv = tl.load(z + ol, mask=ol < L, other=0.0).to(tl.float32)
        nb = tl.cdiv(I, BN1)
        total = K * nb
        a1, a3, rows, r_ok = _gemm1_tile(w1, w3, top, slots, pid, total, nb, I, L, stride_we, stride_wi, ol, BN1)
        for it in range(pid, total, G):                   # the next item's weights load while this one computes
            n1, n3, n_rows, n_ok = _gemm1_tile(w1, w3, top, slots, it + G, total, nb, I, L, stride_we, stride_wi,
                                               ol, BN1)
            a = tl.sum(a1.to(tl.float32) * zv[None, :], 1)
            b = tl.sum(a3.to(tl.float32) * zv[None, :], 1)
            act = _situ_glu(a, b, beta, linear_beta, 0)
            tl.store(h + (it // nb) * I + rows, act.to(h.dtype.element_ty), mask=r_ok)
            a1, a3, rows, r_ok = n1, n3, n_rows, n_ok
    if PHASE == 0:
        _grid_sync(bar, 2 * G)

    if PHASE == 0 or PHASE == 3:                          # gemm2 + combine, column blocks of L
        top, wt = _selection(logits, bias, E, scaling, K, BLOCK_K, BLOCK_E, RENORM)
        oi = tl.arange(0, BI)
        i_ok = oi < I
        for c0 in range(pid * BN2, L, G * BN2):
            cols = c0 + tl.arange(0, BN2)
            c_ok = cols < L
            acc = tl.zeros([BN2], tl.float32)
            for j in tl.static_range(K):
                e = _pick(top, slots, j).to(tl.int64)
                hv = tl.load(h + j * I + oi, mask=i_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                wv = tl.load(w2 + e * L * I + cols[:, None].to(tl.int64) * I + oi[None, :],
                             mask=c_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
                acc += _pick(wt, slots, j) * tl.sum(wv * hv[None, :], 1)
            tl.store(u + cols, acc.to(u.dtype.element_ty), mask=c_ok)

    if PHASE == 0 or PHASE == 4:                          # [RMSNorm(u) * nw | hs] W_out^T, row blocks of D
        oo = tl.arange(0, BO)
        K_OUT = L + IS
        # this program's first W_out rows load before the barrier (they depend on nothing the phases write)
        wo, o_rows, o_ok = _out_tile(w_out, pid * BN3, D, K_OUT, oo, BN3)
    if PHASE == 0:
        _grid_sync(bar, 3 * G)

    if PHASE == 0 or PHASE == 4:
        in_u = oo < L
        in_h = (oo >= L) & (oo < K_OUT)
        uv = tl.load(u + oo, mask=in_u, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.rsqrt(tl.sum(uv * uv, 0) / L + eps)
        un = (uv * r).to(y.dtype.element_ty)
        wn = tl.load(nw + oo, mask=in_u, other=0.0).to(y.dtype.element_ty)
        un = (wn * un).to(tl.float32)                     # nw * normalised, rounded as torch multiplies two bf16
        hv = tl.load(hs + (oo - L), mask=in_h, other=0.0).to(tl.float32)
        v = tl.where(in_u, un, hv)
        for r0 in range(pid * BN3, D, G * BN3):
            n_wo, n_rows, n_ok = _out_tile(w_out, r0 + G * BN3, D, K_OUT, oo, BN3)
            tl.store(y + o_rows, tl.sum(wo.to(tl.float32) * v[None, :], 1).to(y.dtype.element_ty), mask=o_ok)
            wo, o_rows, o_ok = n_wo, n_rows, n_ok

    if PHASE == 0:                                        # the last program out puts the counter back to 0
        tl.debug_barrier()
        if tl.atomic_add(bar, 1, sem="acq_rel") == 4 * G - 1:
            tl.store(bar, 0)


def layer_config() -> dict:
    """programs (0: the SM count), warps and the work-item rows; env K3_MOE_LAYER="programs/warps/bn1/bn2/bn3"
    (read at each launch: an A/B switch). Unmeasured defaults; 8 warps at BN 4 compile to 191 registers without
    spills (ptxas sm_90a, k3-small shapes), one program per SM; 4 warps or BN 8 spill. More bytes in flight per SM
    (BN 8 at 16 warps: 128 registers, ~150 B spilled) is the first thing to try if gemm1 is slow."""
    cfg = dict(programs=0, warps=8, bn1=4, bn2=4, bn3=4)
    env = os.environ.get("K3_MOE_LAYER")
    if env:
        vals = [int(v) for v in env.split("/")]
        check(len(vals) == 5, f"K3_MOE_LAYER={env!r}: programs/warps/bn1/bn2/bn3")
        cfg.update(zip(("programs", "warps", "bn1", "bn2", "bn3"), vals))
    return cfg


def supported(x, z, hs, gate_weight, w1, w2, w_out) -> bool:
    """One row, 16/32-bit floats of one dtype (the router may be fp32), whole rows within the register tiles."""
    return (x.shape[0] == 1 and z.shape[0] == 1 and hs.shape[0] == 1 and z.dtype == hs.dtype == w1.dtype == w2.dtype
            == w_out.dtype and z.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and max(x.shape[1], w1.shape[2], w1.shape[1], w_out.shape[1]) <= 8192 and w1.shape[0] <= 1024)


def moe_layer_decode_fwd(x, z, hs, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps: float, top_k: int,
                         renormalize: bool, scaling: float, beta: float, linear_beta: float, phases: bool = False,
                         config: dict | None = None):
    """Launch the kernel: one persistent launch, or (`phases`, and always under the interpreter) four launches of
    one phase each. Shapes as the op; one row."""
    E, I, L = w1.shape
    D = x.shape[1]
    IS = hs.shape[1]
    check(w3.shape == w1.shape and w3.stride() == w1.stride() and w1.stride(2) == 1,
          f"moe_layer_decode: w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} must share shape and strides (unit "
          f"stride in L)")
    check(tuple(w2.shape) == (E, L, I) and tuple(w_out.shape) == (D, L + IS) and tuple(norm_weight.shape) == (L,),
          f"moe_layer_decode: w2 {tuple(w2.shape)}, w_out {tuple(w_out.shape)}, norm_weight "
          f"{tuple(norm_weight.shape)} disagree with E={E}, I={I}, L={L}, d={D}, I_s={IS}")
    cfg = {**layer_config(), **(config or {})}
    dev = z.device
    G = cfg["programs"] or (torch.cuda.get_device_properties(dev).multi_processor_count if z.is_cuda else 4)
    logits = torch.empty(E, device=dev, dtype=torch.float32)
    h = torch.empty(top_k, I, device=dev, dtype=z.dtype)
    u = torch.empty(L, device=dev, dtype=z.dtype)
    y = torch.empty(1, D, device=dev, dtype=z.dtype)
    args = (x.contiguous(), z.contiguous(), hs.contiguous(), gate_weight.contiguous(), bias.contiguous(), w1, w3,
            w2.contiguous(), w_out.contiguous(), norm_weight.contiguous(), y, logits, h, u, tickets(z, 1),
            D, E, L, I, IS, w1.stride(0), w1.stride(1), float(eps), float(scaling), float(beta), float(linear_beta))
    cx = dict(K=top_k, BLOCK_K=pow2(top_k, 2), BLOCK_E=pow2(E, 16), BD=pow2(D, 16), BL=pow2(L, 16),
              BI=pow2(I, 16), BO=pow2(L + IS, 16), BN1=cfg["bn1"], BN2=cfg["bn2"], BN3=cfg["bn3"],
              RENORM=bool(renormalize), num_warps=cfg["warps"])
    if phases or INTERPRET or not z.is_cuda:
        for phase in (1, 2, 3, 4):
            launch(moe_layer_decode_kernel)[(G,)](*args, PHASE=phase, **cx)
    else:
        launch(moe_layer_decode_kernel)[(G,)](*args, PHASE=0, **cx, **pdl_args(z))
    return y


@moe_layer_decode.register_kernel("cuda")
def _cuda(x, z, hs, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps, top_k, renormalize, scaling, beta,
          linear_beta):
    """The persistent launch; else (env K3_MOE_LAYER_KERNEL=0, read at each call: an A/B switch, or a call it does
    not take) the separate launches: `k3::moe_routed` and `k3::gemv_norm` on their kernels."""
    if torch.float64 in (x.dtype, z.dtype):
        return moe_layer_decode._init_fn(x, z, hs, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps, top_k,
                                         renormalize, scaling, beta, linear_beta)
    if os.environ.get("K3_MOE_LAYER_KERNEL", "1") == "0" or not supported(x, z, hs, gate_weight, w1, w2, w_out):
        from ..gemv.op import gemv_norm
        u = moe_routed(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)
        return gemv_norm(u, hs, w_out, norm_weight, eps)
    return moe_layer_decode_fwd(x, z, hs, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps, top_k,
                                renormalize, scaling, beta, linear_beta)
