"""TensorRT side of `k3::moe_routed_fp8` (E4M3 routed experts, `k3export/fp8_moe.py`): its AOT launch contracts
(plain data, tested on CPU and through cupy on the GPU) and the `tensorrt.plugin` definitions built on them
(registered only when `import tensorrt` works: never run against TensorRT, which cannot be installed here; the
tests use the stand-in of tests/trt_standin.py).

The chain shares the bf16 chain's routing and row-plan plugins (`trt.py`: k3::moe_router, k3::moe_topk, the align
plugins with this chain's block rows as their `block_rows` attribute, k3::moe_combine) and swaps the expert
GEMMs for the FP8 op's own kernels (`k3export.fp8_moe_kernels`, unchanged, pointer loads only). Like the op, it
has two regimes, fixed per engine by the pairs at max_tokens (the op picks per call; a chain is one launch
sequence, so an engine computes every N as the op computes its largest N):

  weight-only (max_tokens k <= WEIGHT_ONLY_PAIRS_PER_EXPERT E: decode; z and h stay in the model dtype; the op's
  "blocks" scheme, 16-row blocks; its one-token "pairs" scheme has no row plan and stays a torch-side choice):
    router, topk, align (16-row blocks)
    k3::moe_fp8_wo_gemm1 (z, w13, w13_scale, row_pair, block_expert)           -> h [MB*16, I] z.dtype
    k3::moe_fp8_wo_gemm2 (h, w2, w2_scale, row_pair, block_expert, ids)         -> y [N*k, L] fp32  (ids: shape)
    k3::moe_combine (y, w, z)                                                   -> u [N, L] z.dtype

  W8A8 (more pairs: E4M3 tensor cores, static activation scales; pointer tilings, `w8a8_tiles`: "ptr" (64-row
  blocks), from 64 rows per expert "ptr-m128-n128"; the op's TMA tilings need descriptors built on the host,
  which an AOT plugin cannot):
    router, topk, align (the tiling's block rows; the chunked align past 4096 pairs)
    k3::moe_fp8_quant (z, z_scale)                                    -> zq [N, L] e4m3, z_rows [N, 1] fp32 (unused)
    k3::moe_fp8_gemm1 (zq, z_scale, w13, w13_scale, h_scale, row_pair, block_expert, z) -> hq [N*k, I] e4m3
    k3::moe_fp8_gemm2 (hq, h_scale, w2, w2_scale, row_pair, block_expert, z)  -> y [N*k, L] z.dtype
    k3::moe_combine (y, w, z)                                                   -> u [N, L] z.dtype
  (z in gemm1 / gemm2: its dtype is the rounding of the contract, not read.)

Routing is the bf16 chain's at the same max_tokens (its lean / wide router options): the op routes the W8A8 path
unsplit, so at few tokens the two sum the router's dot products in other orders (ulps of fp32 in the scores).
With max_tokens = N every expert launch matches the op's launch on the same path exactly (tested).
"""

# No `from __future__ import annotations`: tensorrt.plugin reads the registered functions' annotations (see trt.py).
import torch
import triton
import triton.language as tl

from k3export.fp8_kernels import fp8_quant_fwd_kernel
from k3export.fp8_moe_kernels import (_TL, BLOCKS, FP8_PREFILL_TILINGS, moe_fp8_gemm1_fwd_kernel,
                                      moe_fp8_gemm2_fwd_kernel, moe_fp8_wo_gemm1_fwd_kernel,
                                      moe_fp8_wo_gemm2_fwd_kernel, use_weight_only)
from k3export.plugins.aot import pointer_type, trt_desc, trt_kernel_result
from k3export.plugins.launch import INTERPRET
from k3export.plugins.triton_common import cdiv, check, dot_precision

from .trt import (TRITON_DEFAULT_STAGES, Step, align_intermediates, align_steps, chain_types, check_max_tokens,
                  combine_step, plan_blocks, route_intermediates, route_steps, step_maker)

WO_ROWS = 16                        # `moe_fp8_wo`'s blocks (the bf16 decode kernels')
# The W8A8 tiling by the average rows per expert at max_tokens (pointer loads only). H200, K3 shapes, 2026-12-01
# 03:34 (`bench moe --precision fp8 --phases prefill`, docs/perf.md): 4096 / 8192 tokens (73 / 146 rows) "ptr"
# 13.72 / 21.15 ms, ptr-m128-n128 11.80 / 19.77, ptr-m128-n64 13.26 / 23.60, ptr-m64-n128 14.47 / 22.23 (the op's
# TMA defaults 9.98 / 16.22); below 64 rows per expert "ptr", the op's pointer tiling there.
W8A8_LARGE_ROWS = 64


def w8a8_tiles(max_tokens: int, top_k: int, E: int):
    """The chain's W8A8 expert tiling (`fp8_moe_kernels.FP8_PREFILL_TILINGS`) for an engine's largest N."""
    return FP8_PREFILL_TILINGS["ptr-m128-n128" if max_tokens * top_k >= W8A8_LARGE_ROWS * E else "ptr"]
QUANT_BLOCK = 1024                  # `fp8_quant_fwd`'s BLOCK_K


# ---------------------------------------------------------------------------------------------- wrappers
@triton.jit
def moe_fp8_wo_gemm1_trt_kernel(z, w13, w13_scale, row_pair, block_expert, I, L, stride_z, stride_we, stride_wn,
                                stride_se, stride_h, h, beta: tl.constexpr, linear_beta: tl.constexpr,
                                TOP_K: tl.constexpr, PER_CHANNEL: tl.constexpr, DOT_PREC: tl.constexpr,
                                WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    moe_fp8_wo_gemm1_fwd_kernel(z, w13, w13_scale, h, row_pair, block_expert, I, L, stride_z, stride_we, stride_wn,
                                stride_se, stride_h, beta, linear_beta, TOP_K=TOP_K, PER_CHANNEL=PER_CHANNEL,
                                DOT_PREC=DOT_PREC, WIDEN=WIDEN, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


@triton.jit
def moe_fp8_wo_gemm2_trt_kernel(h, w2, w2_scale, row_pair, block_expert, ids, L, I, stride_h, stride_we, stride_wn,
                                stride_se, stride_y, y, PER_CHANNEL: tl.constexpr, DOT_PREC: tl.constexpr,
                                WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    # ids: for y's shape only (N k rows), not read
    moe_fp8_wo_gemm2_fwd_kernel(h, w2, w2_scale, y, row_pair, block_expert, L, I, stride_h, stride_we, stride_wn,
                                stride_se, stride_y, PER_CHANNEL=PER_CHANNEL, DOT_PREC=DOT_PREC, WIDEN=WIDEN,
                                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


@triton.jit
def moe_fp8_quant_trt_kernel(z, z_scale, K, stride_x, stride_q, zq, z_rows, BLOCK_K: tl.constexpr):
    fp8_quant_fwd_kernel(z, z_scale, zq, z_rows, K, stride_x, stride_q, BLOCK_K=BLOCK_K)


@triton.jit
def moe_fp8_gemm1_trt_kernel(zq, z_scale, w13, w13_scale, h_scale, row_pair, block_expert, z, I, L, stride_z,
                             stride_we, stride_wn, stride_se, stride_h, hq, beta: tl.constexpr,
                             linear_beta: tl.constexpr, TOP_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                             FP8_DOT: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # z: for the model dtype only (ROUND, the contract's rounding), not read
    moe_fp8_gemm1_fwd_kernel(zq, z_scale, w13, w13_scale, hq, h_scale, row_pair, block_expert, I, L, stride_z,
                             stride_we, stride_wn, stride_se, stride_h, beta, linear_beta, TOP_K=TOP_K,
                             PER_CHANNEL=PER_CHANNEL, FP8_DOT=FP8_DOT, ROUND=ROUND, BLOCK_M=BLOCK_M,
                             BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


@triton.jit
def moe_fp8_gemm2_trt_kernel(hq, h_scale, w2, w2_scale, row_pair, block_expert, z, L, I, stride_h, stride_we,
                             stride_wn, stride_se, stride_y, y, PER_CHANNEL: tl.constexpr, FP8_DOT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # z: for y's dtype only, not read
    moe_fp8_gemm2_fwd_kernel(hq, h_scale, w2, w2_scale, y, row_pair, block_expert, L, I, stride_h, stride_we,
                             stride_wn, stride_se, stride_y, PER_CHANNEL=PER_CHANNEL, FP8_DOT=FP8_DOT,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


# ---------------------------------------------------------------------------------------------- contracts
def weight_only(max_tokens: int, top_k: int, E: int) -> bool:
    """The chain's regime: the op's rule (`fp8_moe_kernels.use_weight_only`) at the engine's largest N."""
    return use_weight_only(max_tokens * top_k, E)


def block_rows(max_tokens: int, top_k: int, E: int) -> int:
    """Rows per block of the chain's row plan (the align plugins' `block_rows` attribute)."""
    return WO_ROWS if weight_only(max_tokens, top_k, E) else w8a8_tiles(max_tokens, top_k, E).rows


def fp8_chain_intermediates(N, E: int, top_k: int, L: int, I: int, dtype: torch.dtype,
                            max_tokens: int | None = None, minimum=min) -> dict:
    """name -> (shape, dtype) of every tensor between the plugins, for the regime of max_tokens (default N)."""
    max_tokens = N if max_tokens is None else max_tokens
    rows = block_rows(max_tokens, top_k, E)
    out = {**route_intermediates(N, E, top_k, dtype, max_tokens),
           **align_intermediates(N, E, top_k, rows, max_tokens, minimum)}
    P = N * top_k
    if weight_only(max_tokens, top_k, E):
        MB = plan_blocks(P, E, rows, minimum)
        out.update(h=((MB * rows, I), dtype), y=((P, L), torch.float32))
    else:
        out.update(zq=((N, L), torch.float8_e4m3fn), z_rows=((N, 1), torch.float32),
                   hq=((P, I), torch.float8_e4m3fn), y=((P, L), dtype))
    return out


def quant_step(N, L: int, types: dict) -> Step:
    """k3::moe_fp8_quant: zq = E4M3(z / s_z) as `fp8_kernels.fp8_quant_fwd` launches it (z_rows: its row scales,
    unused here)."""
    return step_maker(types)("k3::moe_fp8_quant", moe_fp8_quant_trt_kernel, ("z", "z_scale"),
                             dict(K=L, stride_x=L, stride_q=L), ("zq", "z_rows"), dict(BLOCK_K=QUANT_BLOCK),
                             (N, cdiv(L, QUANT_BLOCK), 1), 4, TRITON_DEFAULT_STAGES)


def fp8_chain_steps(N, d: int, E: int, top_k: int, L: int, I: int, dtype: torch.dtype, per_channel: bool = True,
                    renormalize: bool = True, scaling: float = 1.0, beta: float = 4.0, linear_beta: float = 25.0,
                    max_tokens: int | None = None, minimum=min) -> list[Step]:
    """The launches of `k3::moe_routed_fp8` for x `[N, d]`, z `[N, L]`, gate_weight `[E, d]` (all in `dtype`, the
    model dtype, contiguous), bias `[E]` fp32, w13 `[E, 2I, L]` and w2 `[E, L, I]` E4M3, w13_scale `[E, 2I]` / w2_scale
    `[E, L]` fp32 (per_channel; else `[E]`), z_scale / h_scale `[]` fp32, u `[N, L]` in dtype. max_tokens, minimum:
    as `trt.chain_steps` (the regime, the align and the routing constants follow max_tokens)."""
    max_tokens = check_max_tokens(N, max_tokens, E, top_k)
    rows = block_rows(max_tokens, top_k, E)
    inter = fp8_chain_intermediates(N, E, top_k, L, I, dtype, max_tokens, minimum)
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    types = chain_types(inter, dtype, w13=e4m3, w2=e4m3, w13_scale=f32, w2_scale=f32, z_scale=f32, h_scale=f32)
    step = step_maker(types)
    chain = route_steps(N, d, E, top_k, dtype, max_tokens, renormalize, scaling, types)
    chain += align_steps(N, E, top_k, rows, max_tokens, types, minimum)
    MB = plan_blocks(N * top_k, E, rows, minimum)
    se13, se2 = (2 * I, L) if per_channel else (1, 1)
    if weight_only(max_tokens, top_k, E):
        t1 = t2 = BLOCKS
        common = dict(PER_CHANNEL=per_channel, DOT_PREC="ieee" if INTERPRET else dot_precision(dtype),
                      WIDEN=INTERPRET, BLOCK_M=rows)
        chain += [step("k3::moe_fp8_wo_gemm1", moe_fp8_wo_gemm1_trt_kernel,
                       ("z", "w13", "w13_scale", "row_pair", "block_expert"),
                       dict(I=I, L=L, stride_z=L, stride_we=2 * I * L, stride_wn=L, stride_se=se13, stride_h=I),
                       ("h",), dict(beta=float(beta), linear_beta=float(linear_beta), TOP_K=top_k, **common,
                                    BLOCK_N=t1.block_n, BLOCK_K=t1.block_k),
                       (MB, cdiv(I, t1.block_n), 1), t1.warps, 1 if INTERPRET else t1.stages),
                  step("k3::moe_fp8_wo_gemm2", moe_fp8_wo_gemm2_trt_kernel,
                       ("h", "w2", "w2_scale", "row_pair", "block_expert", "ids"),
                       dict(L=L, I=I, stride_h=I, stride_we=L * I, stride_wn=I, stride_se=se2, stride_y=L),
                       ("y",), dict(**common, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k),
                       (MB, cdiv(L, t2.block_n), 1), t2.warps, 1 if INTERPRET else t2.stages)]
    else:
        t = w8a8_tiles(max_tokens, top_k, E)
        (bn1, bk1, warps1, stages1), (bn2, bk2, warps2, stages2) = t.gemm1, t.gemm2
        common = dict(PER_CHANNEL=per_channel, FP8_DOT=not INTERPRET, BLOCK_M=rows)
        chain += [quant_step(N, L, types),
                  step("k3::moe_fp8_gemm1", moe_fp8_gemm1_trt_kernel,
                       ("zq", "z_scale", "w13", "w13_scale", "h_scale", "row_pair", "block_expert", "z"),
                       dict(I=I, L=L, stride_z=L, stride_we=2 * I * L, stride_wn=L, stride_se=se13, stride_h=I),
                       ("hq",), dict(beta=float(beta), linear_beta=float(linear_beta), TOP_K=top_k,
                                     ROUND=_TL[dtype], **common, BLOCK_N=bn1, BLOCK_K=bk1),
                       (MB, cdiv(I, bn1), 1), warps1, 1 if INTERPRET else stages1),
                  step("k3::moe_fp8_gemm2", moe_fp8_gemm2_trt_kernel,
                       ("hq", "h_scale", "w2", "w2_scale", "row_pair", "block_expert", "z"),
                       dict(L=L, I=I, stride_h=I, stride_we=L * I, stride_wn=I, stride_se=se2, stride_y=L),
                       ("y",), dict(**common, BLOCK_N=bn2, BLOCK_K=bk2), (MB, cdiv(L, bn2), 1), warps2,
                       1 if INTERPRET else stages2)]
    return chain + [combine_step(N, L, top_k, types)]


# ---------------------------------------------------------------------------------------------- TensorRT
def register_plugins() -> bool:
    """Register the FP8 expert plugins with `tensorrt.plugin` (the routing, align and combine plugins are
    `trt.register_plugins`'s). Returns False when TensorRT is not importable.

    Attributes: max_tokens (the profile's largest N: it fixes the regime and the PTX) and top_k; the first GEMM
    also beta and linear_beta. E, I, L and per-channel scales come from the weights' and scales' static shapes.
    Registered for 16-bit models (bf16 / fp16 activations). Never run against TensorRT (not installable on our
    machines, docs/deployment-notes); tests/test_moe_trt_fp8.py runs it against a stand-in."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        return False
    from typing import Tuple

    AOT = Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]     # aot_impl must annotate its result
    to_torch = {trt.bfloat16: torch.bfloat16, trt.float16: torch.float16}
    fp8 = trt.DataType.FP8

    def result(plugin, N, w13_shape, scales, top_k, dtype, max_tokens, **attrs):
        """scales: the plugin's weight scales ([E, out] per channel, [E] per expert)."""
        check(dtype in to_torch, f"{plugin}: the TensorRT FP8 MoE plugins are registered for bf16 / fp16 models, "
              f"got {dtype}")
        E, I2, L = w13_shape
        steps = fp8_chain_steps(N, 16, E, top_k, L, I2 // 2, to_torch[dtype], len(scales.shape) == 2,
                                max_tokens=max_tokens, minimum=trtp.min, **attrs)
        step = next(s for s in steps if s.plugin == plugin)
        return trt_kernel_result(trtp, step.launch(), step.grid, step.scalars.values())

    def desc(like, shape, dtype):
        return trt_desc(trtp, like, shape, dtype)

    # The w13 shape [E, 2I, L] where a plugin does not see w13: from w2 [E, L, I].
    def w13_of(w2):
        E, L, I = w2.shape
        return E, 2 * I, L

    @trtp.register("k3::moe_fp8_wo_gemm1")
    def _wo1_desc(z: trtp.TensorDesc, w13: trtp.TensorDesc, w13_scale: trtp.TensorDesc, row_pair: trtp.TensorDesc,
                  block_expert: trtp.TensorDesc, max_tokens: int, top_k: int, beta: float, linear_beta: float
                  ) -> Tuple[trtp.TensorDesc]:
        return (desc(z, (row_pair.shape_expr[0], w13.shape[1] // 2), z.dtype),)

    @trtp.aot_impl("k3::moe_fp8_wo_gemm1")
    def _wo1_aot(z, w13, w13_scale, row_pair, block_expert, max_tokens: int, top_k: int, beta: float,
                 linear_beta: float, outputs, tactic) -> AOT:
        return result("k3::moe_fp8_wo_gemm1", z.shape_expr[0], w13.shape, w13_scale, top_k, z.dtype, max_tokens,
                      beta=beta, linear_beta=linear_beta)

    @trtp.register("k3::moe_fp8_wo_gemm2")
    def _wo2_desc(h: trtp.TensorDesc, w2: trtp.TensorDesc, w2_scale: trtp.TensorDesc, row_pair: trtp.TensorDesc,
                  block_expert: trtp.TensorDesc, ids: trtp.TensorDesc, max_tokens: int, top_k: int
                  ) -> Tuple[trtp.TensorDesc]:
        return (desc(h, (ids.shape_expr[0] * top_k, w2.shape[1]), trt.float32),)

    @trtp.aot_impl("k3::moe_fp8_wo_gemm2")
    def _wo2_aot(h, w2, w2_scale, row_pair, block_expert, ids, max_tokens: int, top_k: int, outputs, tactic) -> AOT:
        return result("k3::moe_fp8_wo_gemm2", ids.shape_expr[0], w13_of(w2), w2_scale, top_k, h.dtype, max_tokens)

    @trtp.register("k3::moe_fp8_quant")
    def _quant_desc(z: trtp.TensorDesc, z_scale: trtp.TensorDesc, max_tokens: int, top_k: int
                    ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        N, L = z.shape_expr[0], z.shape_expr[1]
        return desc(z, (N, L), fp8), desc(z, (N, 1), trt.float32)

    @trtp.aot_impl("k3::moe_fp8_quant")
    def _quant_aot(z, z_scale, max_tokens: int, top_k: int, outputs, tactic) -> AOT:
        check(z.dtype in to_torch, f"k3::moe_fp8_quant: registered for bf16 / fp16 models, got {z.dtype}")
        step = quant_step(z.shape_expr[0], z.shape[1], {"z": pointer_type(to_torch[z.dtype]), "z_scale": "*fp32",
                                                        "zq": pointer_type(torch.float8_e4m3fn), "z_rows": "*fp32"})
        return trt_kernel_result(trtp, step.launch(), step.grid, step.scalars.values())

    @trtp.register("k3::moe_fp8_gemm1")
    def _g1_desc(zq: trtp.TensorDesc, z_scale: trtp.TensorDesc, w13: trtp.TensorDesc, w13_scale: trtp.TensorDesc,
                 h_scale: trtp.TensorDesc, row_pair: trtp.TensorDesc, block_expert: trtp.TensorDesc,
                 z: trtp.TensorDesc, max_tokens: int, top_k: int, beta: float, linear_beta: float
                 ) -> Tuple[trtp.TensorDesc]:
        return (desc(zq, (zq.shape_expr[0] * top_k, w13.shape[1] // 2), fp8),)

    @trtp.aot_impl("k3::moe_fp8_gemm1")
    def _g1_aot(zq, z_scale, w13, w13_scale, h_scale, row_pair, block_expert, z, max_tokens: int, top_k: int,
                beta: float, linear_beta: float, outputs, tactic) -> AOT:
        return result("k3::moe_fp8_gemm1", zq.shape_expr[0], w13.shape, w13_scale, top_k, z.dtype, max_tokens,
                      beta=beta, linear_beta=linear_beta)

    @trtp.register("k3::moe_fp8_gemm2")
    def _g2_desc(hq: trtp.TensorDesc, h_scale: trtp.TensorDesc, w2: trtp.TensorDesc, w2_scale: trtp.TensorDesc,
                 row_pair: trtp.TensorDesc, block_expert: trtp.TensorDesc, z: trtp.TensorDesc, max_tokens: int,
                 top_k: int) -> Tuple[trtp.TensorDesc]:
        return (desc(z, (hq.shape_expr[0], w2.shape[1]), z.dtype),)

    @trtp.aot_impl("k3::moe_fp8_gemm2")
    def _g2_aot(hq, h_scale, w2, w2_scale, row_pair, block_expert, z, max_tokens: int, top_k: int, outputs,
                tactic) -> AOT:
        return result("k3::moe_fp8_gemm2", z.shape_expr[0], w13_of(w2), w2_scale, top_k, z.dtype, max_tokens)

    return True
