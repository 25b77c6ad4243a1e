"""TensorRT side of the MoE kernels: the AOT launch contracts of `k3::moe_routed` (TensorRT-independent plain data,
tested on CPU and through cupy on the GPU) and the `tensorrt.plugin` definitions built on them (registered only
when `import tensorrt` works; it cannot be installed on our machines, see docs/deployment-notes, so
`register_plugins` has never run against TensorRT: the tests run it against a stand-in with tensorrt.plugin 11.4's
registration checks, on a symbolic N).

An AOT plugin is exactly one kernel launch with no workspace, so `k3::moe_routed` becomes a chain of plugins
joined by explicit intermediate tensors (an ONNX translation emits them in this order). Up to ALIGN_FUSED_MAX
(4096) pairs at max_tokens, the decode chain (six plugins):

    k3::moe_router  (x, gate_weight)                    -> part [S, N, E] fp32   S = 8 partial sums over d, or
                                                                             S = 1: the sigmoid scores
    k3::moe_topk    (part, bias)                        -> ids [N, k] i32, w [N, k] fp32, s [N, E] fp32
    k3::moe_align   (ids)                               -> row_pair [MB*R] i32, block_expert [MB] i32, off [E] i32
    k3::moe_gemm1   (z, w1, w3, row_pair, block_expert) -> h [MB*R, I] z.dtype
    k3::moe_gemm2   (h, w2, row_pair, block_expert, ids) -> y [N*k, L] fp32   (ids: shape only, not read)
    k3::moe_combine (y, w, z)                           -> u [N, L] z.dtype      (z: shape/dtype only, not read)

Beyond, the prefill chain (eight): the align becomes the chunked align's three launches (`kernels.chunked_align`,
C = the tiling's chunk_align pairs per chunk, NC = ceil(N k / C)), and y is in z.dtype (the tiling's y_half):

    k3::moe_count   (ids)                               -> hist [NC, E] i32, rank [N*k] i32
    k3::moe_plan    (hist, ids)                         -> base [NC, E] i32, block_expert [MB] i32, end [E] i32
                                                           (ids: shape only, not read)
    k3::moe_scatter (ids, rank, base, block_expert, end) -> row_pair [MB*R] i32

MB = ceil(N k / R) + min(E, N k) (R rows per block) is the static block bound the kernels already use, so no shape
or grid depends on routing (`s` is written by the top-k launch only when the router is split over d, S > 1; with
S = 1 the scores are `part` itself; `off` is the align kernel's scratch; nothing downstream reads either).

Tilings. Decode: `kernels.CONFIGS["decode"]` (`FP32_TILES` for fp32) exactly as `moe_routed_fwd` picks it, on its
row plan (`decode_tiles`: the op's "pairs" path for <= 2 tokens is not part of the chain) (a model with few
experts may have >= 16 rows per expert under 4096 pairs: the chain keeps the decode tiling where the torch op
switches to the grouped one; same result, other speed). Prefill: `PREFILL_TILINGS` by the rows per expert at
max_tokens (`chain_tiles`), pointer loads (the op's prefill tilings pass TMA descriptors built on the host); one
tiling for every N of the engine.

Each launch is a small `@triton.jit` wrapper (`moe_*_trt_kernel`) that calls the kernel of `kernels.py` unchanged
with its parameters reordered to inputs..., scalars..., outputs... (TensorRT's order) and the float attributes
(scaling, beta, linear_beta) made compile-time constants (TensorRT's extra arguments are integers only). Grids
are written with + - * // and `minimum` (python `min`, or `tensorrt.plugin.min` on shape expressions).

Compile-time choices that depend on the token count (the chain, router block sizes, router split over d, the
align kernel's sort width) are taken from `max_tokens` (default N): the PTX is then valid for every N <=
max_tokens (everything is masked by the runtime N), which is what a dynamic-shape engine needs. With max_tokens =
N every launch matches the torch launcher on the same tiling exactly (grid, constants, warps, scalars; tested).
"""

# No `from __future__ import annotations` here: tensorrt.plugin validates the registered functions' annotations
# with inspect.signature, which would see strings instead of TensorDesc / int (TensorRT 11.4 `_validate.py`).
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from k3export.plugins.aot import Plan, pointer_type, trt_desc, trt_kernel_result
from k3export.plugins.launch import INTERPRET
from k3export.plugins.triton_common import cdiv, check, dot_precision, pow2

from .kernels import (ALIGN_CHUNK, ALIGN_FUSED_MAX, CONFIGS, FP32_TILES, ROUTE_SPLIT_MAX_N, ROUTE_WIDE_MIN_N,
                      TILINGS, MoeTiles, moe_align_fwd_kernel, moe_chunk_count_fwd_kernel, moe_chunk_plan_fwd_kernel,
                      moe_chunk_scatter_fwd_kernel, moe_combine_fwd_kernel, moe_gemm1_fwd_kernel, moe_gemm2_fwd_kernel,
                      moe_router_fwd_kernel, moe_topk_fwd_kernel)


# ---------------------------------------------------------------------------------------------- wrappers
@triton.jit
def moe_router_trt_kernel(x, gate_weight, N, E, D, stride_xn, stride_ge, D_SPLIT, part, BLOCK_M: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, SIGMOID: tl.constexpr,
                          DOT_PREC: tl.constexpr):
    moe_router_fwd_kernel(x, gate_weight, part, N, E, D, stride_xn, stride_ge, D_SPLIT, BLOCK_M=BLOCK_M,
                          BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D, SIGMOID=SIGMOID, DOT_PREC=DOT_PREC)


@triton.jit
def moe_topk_trt_kernel(part, bias, N, E, ids, w, s, scaling: tl.constexpr, K: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, SPLITS: tl.constexpr,
                        PACKED: tl.constexpr):
    if SPLITS == 1:      # the router wrote sigmoid scores: read them from part, s stays unwritten
        moe_topk_fwd_kernel(part, part, bias, ids, w, N, E, scaling, K=K, BLOCK_K=BLOCK_K, BLOCK_E=BLOCK_E,
                            RENORM=RENORM, SPLITS=SPLITS, PACKED=PACKED)
    else:
        moe_topk_fwd_kernel(s, part, bias, ids, w, N, E, scaling, K=K, BLOCK_K=BLOCK_K, BLOCK_E=BLOCK_E,
                            RENORM=RENORM, SPLITS=SPLITS, PACKED=PACKED)


@triton.jit
def moe_align_trt_kernel(ids, P, E, MB, row_pair, block_expert, off, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, MB_PAD: tl.constexpr, FILL: tl.constexpr):
    moe_align_fwd_kernel(ids, row_pair, block_expert, off, P, E, MB, BLOCK_M=BLOCK_M, P_PAD=P_PAD, E_PAD=E_PAD,
                         MB_PAD=MB_PAD, FILL=FILL)


@triton.jit
def moe_gemm1_trt_kernel(z, w1, w3, row_pair, block_expert, MB, L, I, stride_an, stride_we, stride_wi, stride_hm,
                         group_m, h, beta: tl.constexpr, linear_beta: tl.constexpr, TOP_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         A_DESC: tl.constexpr, W_DESC: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr = 0,
                         FAST_ACT: tl.constexpr = 0):
    moe_gemm1_fwd_kernel(z, w1, w3, h, row_pair, block_expert, MB, L, I, stride_an, stride_we, stride_wi, stride_hm,
                         group_m, beta, linear_beta, TOP_K=TOP_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         A_DESC=A_DESC, W_DESC=W_DESC, DOT_PREC=DOT_PREC, TAIL=TAIL, a_tail=z, FAST_ACT=FAST_ACT)


@triton.jit
def moe_gemm2_trt_kernel(h, w2, row_pair, block_expert, ids, MB, L, I, stride_hm, stride_we, stride_wl, stride_yp,
                         group_m, y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         A_DESC: tl.constexpr, W_DESC: tl.constexpr, DOT_PREC: tl.constexpr, TAIL: tl.constexpr = 0):
    moe_gemm2_fwd_kernel(h, w2, y, row_pair, block_expert, MB, L, I, stride_hm, stride_we, stride_wl, stride_yp,
                         group_m, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, A_DESC=A_DESC, W_DESC=W_DESC,
                         DOT_PREC=DOT_PREC, TAIL=TAIL, a_tail=h)          # ids: for y's shape only (N k rows), not read


@triton.jit
def moe_count_trt_kernel(ids, P, E, hist, rank, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    moe_chunk_count_fwd_kernel(ids, P, E, hist, rank, CHUNK=CHUNK, E_PAD=E_PAD)


@triton.jit
def moe_plan_trt_kernel(hist, ids, NC, E, MB, base, block_expert, end, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                        MB_PAD: tl.constexpr):
    # ids: for the shapes only (MB depends on the pair count, which hist's shape does not show), not read
    moe_chunk_plan_fwd_kernel(hist, NC, E, MB, base, block_expert, end, BLOCK_M=BLOCK_M, E_PAD=E_PAD, MB_PAD=MB_PAD)


@triton.jit
def moe_scatter_trt_kernel(ids, rank, base, block_expert, end, P, E, MB, row_pair, BLOCK_M: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    moe_chunk_scatter_fwd_kernel(ids, rank, base, block_expert, end, P, E, MB, row_pair, BLOCK_M=BLOCK_M,
                                 CHUNK=CHUNK, BLOCK=BLOCK)


@triton.jit
def moe_combine_trt_kernel(y, w, z, L, u, TOP_K: tl.constexpr, BLOCK_L: tl.constexpr):
    # z: for u's shape and dtype only, not read
    moe_combine_fwd_kernel(y, w, u, L, TOP_K=TOP_K, BLOCK_L=BLOCK_L)


# ---------------------------------------------------------------------------------------------- contracts
TRITON_DEFAULT_STAGES = 3       # what a launch that names no num_stages gets (router top-k, align, combine)


@dataclass(frozen=True)
class Step(Plan):
    """One plugin of the chain, TensorRT-independent: a `Plan` (the wrapper kernel's parameters inputs...,
    scalars..., outputs... as (name, triton type); `scalars` (i32) and `grid` are ints for int N, shape
    expressions for a TensorRT shape expression N; `constexprs` compiled into the PTX) plus the plugin's name and
    its input/output tensor names."""

    plugin: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


def decode_tiles(dtype: torch.dtype):
    """The tiling `moe_routed_fwd` uses in the decode regime (`kernels.tiles_for`), always on the row plan: a
    plugin chain is one fixed launch sequence, so the op's "pairs" path for a few tokens (no align launch) stays
    a torch/Inductor-side choice."""
    return replace(FP32_TILES if dtype == torch.float32 else CONFIGS["decode"], pairs=0)


# The prefill chain's expert tilings (`kernels.TILINGS["prefill"]["ptr-*"]`): pointer loads only (the op's prefill
# tilings pass TMA descriptors built on the host, which an AOT plugin cannot), otherwise the op's prefill options
# (tail rows, half-width expert outputs, the wide router, the approximate tanh). As op tilings
# (`moe_routed_fwd(tiles=)`) they run the chain's launches: the chunked align at every pair count (fused_align
# off), so the op is the chain's twin in the tests.
PREFILL_TILINGS = {n[4:]: t for n, t in TILINGS["prefill"].items() if n.startswith("ptr-")}
# H200 2026-12-01 01:45 (`bench moe`, K3 size, docs/perf.md): 4096 / 8192 / 16384 tokens (73 / 146 / 292 rows per
# expert) ptr-m128t64 18.63 / 25.40 / 44.02 ms, ptr-m64t32-n128 17.58 / 31.12 / 55.57, ptr-m64 25.26 / 35.03 / 55.69
# (the op's TMA defaults 17.15 / 24.47 / 39.62). One tiling serves every N of an engine, so it is chosen for the
# engine's largest N: 64 + 32-row blocks while most experts fit one (below PREFILL_SMALL_ROWS rows per expert on
# average; past 96 they split in two and re-read their weights: the TMA twins at 110 rows 26.03 vs 20.16 ms), else
# 128 + 64. The crossover between 73 and 110 rows is not measured.
PREFILL_SMALL_ROWS = 80


def chain_tiles(max_tokens: int, top_k: int, dtype: torch.dtype, E: int,
                tiles: MoeTiles | None = None) -> MoeTiles:
    """The chain's expert tiling: the decode one up to ALIGN_FUSED_MAX pairs (one-program align), else the prefill
    one (the chunked align, `chunk_align` pairs per chunk) by the rows per expert at max_tokens: `PREFILL_TILINGS`
    "m64t32-n128" below PREFILL_SMALL_ROWS, "m128t64" from there; `FP32_TILES` for fp32 (the op's rule). tiles: an
    override (prefill only: sweeps, tests)."""
    if max_tokens * top_k <= ALIGN_FUSED_MAX:
        return decode_tiles(dtype)
    if tiles is not None:
        return tiles
    if dtype == torch.float32:
        return replace(FP32_TILES, fused_align=False, chunk_align=ALIGN_CHUNK)
    return PREFILL_TILINGS["m64t32-n128" if max_tokens * top_k < PREFILL_SMALL_ROWS * E else "m128t64"]


def router_config(max_tokens: int, dtype: torch.dtype, lean: bool, wide: bool = False) -> dict:
    """`kernels.route_fwd`'s compile-time choices for up to max_tokens tokens (wide: its 128 x 128 tiles from
    ROUTE_WIDE_MIN_N tokens, here through pointer loads)."""
    small = max_tokens <= 16
    wide = wide and max_tokens >= ROUTE_WIDE_MIN_N and dtype != torch.float32
    block = 16 if small else 128 if wide else 64
    return dict(block_m=block, block_e=block, block_d=64 if wide else 128 if dtype != torch.float32 else 32,
                splits=8 if lean and max_tokens <= ROUTE_SPLIT_MAX_N else 1, warps=8 if wide else 4)


def plan_blocks(P, E: int, block_m: int, minimum=min):
    """MB, the static bound on row-plan blocks for P (token, slot) pairs: each hit expert wastes at most one
    partial block (`kernels.align_rows`)."""
    return cdiv(P, block_m) + minimum(E, P)


def align_intermediates(N, E: int, top_k: int, rows: int, max_tokens: int, minimum=min,
                        chunk: int = ALIGN_CHUNK) -> dict:
    """name -> (shape, dtype) of the align launches' tensors for blocks of `rows` rows: the one-program align up to
    ALIGN_FUSED_MAX pairs at max_tokens (its scratch `off`), else the chunked align (`chunk` pairs per chunk)."""
    P = N * top_k
    MB = plan_blocks(P, E, rows, minimum)
    if max_tokens * top_k <= ALIGN_FUSED_MAX:
        out = {"off": ((E,), torch.int32)}
    else:
        NC = cdiv(P, chunk)
        out = dict(hist=((NC, E), torch.int32), rank=((P,), torch.int32), base=((NC, E), torch.int32),
                   end=((E,), torch.int32))
    return {**out, "row_pair": ((MB * rows,), torch.int32), "block_expert": ((MB,), torch.int32)}


def route_intermediates(N, E: int, top_k: int, dtype: torch.dtype, max_tokens: int,
                        cfg: MoeTiles | None = None) -> dict:
    """name -> (shape, dtype) of the router / top-k launches' outputs (`route_steps`, same cfg)."""
    cfg = cfg or chain_tiles(max_tokens, top_k, dtype, E)
    S = router_config(max_tokens, dtype, cfg.lean_route)["splits"]
    return {"part": ((S, N, E), torch.float32), "ids": ((N, top_k), torch.int32), "w": ((N, top_k), torch.float32),
            "s": ((N, E), torch.float32)}


def chain_intermediates(N, E: int, top_k: int, L: int, I: int, dtype: torch.dtype, max_tokens: int | None = None,
                        minimum=min, tiles: MoeTiles | None = None) -> dict:
    """name -> (shape, dtype) of every tensor between the plugins (contiguous), for the chain `chain_steps` picks.
    Shapes depend on N and the weights' shapes only, never on routing."""
    max_tokens = N if max_tokens is None else max_tokens
    cfg = chain_tiles(max_tokens, top_k, dtype, E, tiles)
    MB = plan_blocks(N * top_k, E, cfg.rows, minimum)
    return {**route_intermediates(N, E, top_k, dtype, max_tokens, cfg),
            **align_intermediates(N, E, top_k, cfg.rows, max_tokens, minimum, cfg.chunk_align or ALIGN_CHUNK),
            "h": ((MB * cfg.rows, I), dtype), "y": ((N * top_k, L), dtype if cfg.y_half else torch.float32)}


def step_maker(types: dict):
    """A `Step` builder over `types` (tensor name -> triton pointer type): parameters are the inputs, the scalars
    (i32) and the outputs, in that order."""
    def step(plugin, fn, inputs, scalars, outputs, constexprs, grid, warps, stages):
        params = tuple((n, types[n]) for n in inputs) + tuple((n, "i32") for n in scalars) + \
            tuple((n, types[n]) for n in outputs)
        return Step(fn, params, scalars, constexprs, tuple(grid), warps, stages, plugin=plugin, inputs=tuple(inputs),
                    outputs=tuple(outputs))
    return step


def chain_types(inter: dict, dtype: torch.dtype, **inputs) -> dict:
    """Pointer types of the intermediates, of x / gate_weight / z / u in `dtype`, bias fp32, and of `inputs`
    (name -> dtype: the expert weights, scales)."""
    types = {n: pointer_type(dt) for n, (_, dt) in inter.items()}
    types.update({n: pointer_type(dtype) for n in ("x", "gate_weight", "z", "u")}, bias="*fp32")
    types.update({n: pointer_type(dt) for n, dt in inputs.items()})
    return types


def route_steps(N, d: int, E: int, top_k: int, dtype: torch.dtype, max_tokens: int, renormalize: bool,
                scaling: float, types: dict, cfg: MoeTiles | None = None) -> list[Step]:
    """k3::moe_router and k3::moe_topk: routing as `kernels.route_fwd` runs it with the lean / wide options of cfg
    (default: the tiling `chain_tiles` picks at max_tokens), on pointer loads."""
    cfg = cfg or chain_tiles(max_tokens, top_k, dtype, E)
    step = step_maker(types)
    r = router_config(max_tokens, dtype, cfg.lean_route, cfg.wide_route)
    S = r["splits"]
    return [step("k3::moe_router", moe_router_trt_kernel, ("x", "gate_weight"),
                 dict(N=N, E=E, D=d, stride_xn=d, stride_ge=d, D_SPLIT=cdiv(d, S * r["block_d"]) * r["block_d"]),
                 ("part",), dict(BLOCK_M=r["block_m"], BLOCK_E=r["block_e"], BLOCK_D=r["block_d"], SIGMOID=S == 1,
                              DOT_PREC=dot_precision(dtype)),
                 (cdiv(N, r["block_m"]), cdiv(E, r["block_e"]), S), r["warps"], 3 if dtype != torch.float32 else 1),
            step("k3::moe_topk", moe_topk_trt_kernel, ("part", "bias"), dict(N=N, E=E), ("ids", "w", "s"),
                 dict(scaling=float(scaling), K=top_k, BLOCK_K=pow2(top_k, 2), BLOCK_E=pow2(E),
                      RENORM=bool(renormalize and top_k > 1), SPLITS=S, PACKED=cfg.lean_route),
                 (N, 1, 1), 4, TRITON_DEFAULT_STAGES)]


def align_steps(N, E: int, top_k: int, rows: int, max_tokens: int, types: dict, minimum=min,
                chunk: int = ALIGN_CHUNK) -> list[Step]:
    """The row plan of blocks of `rows` rows from ids: k3::moe_align (one program) up to ALIGN_FUSED_MAX pairs at
    max_tokens, else the chunked align's k3::moe_count, k3::moe_plan, k3::moe_scatter (`chunk` pairs per chunk)."""
    check(chunk >= 16 and chunk & (chunk - 1) == 0, f"moe trt: the chunked align's chunk must be a power of two "
          f">= 16, got {chunk}")
    step = step_maker(types)
    P = N * top_k
    MB = plan_blocks(P, E, rows, minimum)
    MB_max = plan_blocks(max_tokens * top_k, E, rows)
    if max_tokens * top_k <= ALIGN_FUSED_MAX:
        return [step("k3::moe_align", moe_align_trt_kernel, ("ids",), dict(P=P, E=E, MB=MB),
                     ("row_pair", "block_expert", "off"),
                     dict(BLOCK_M=rows, P_PAD=pow2(max_tokens * top_k), E_PAD=pow2(E + 1), MB_PAD=pow2(MB_max + 1),
                          FILL=1024), (1, 1, 1), 8, TRITON_DEFAULT_STAGES)]
    NC = cdiv(P, chunk)                     # `kernels.chunked_align`'s three launches
    return [step("k3::moe_count", moe_count_trt_kernel, ("ids",), dict(P=P, E=E), ("hist", "rank"),
                 dict(CHUNK=chunk, E_PAD=pow2(E + 1)), (NC, 1, 1), 8, TRITON_DEFAULT_STAGES),
            step("k3::moe_plan", moe_plan_trt_kernel, ("hist", "ids"), dict(NC=NC, E=E, MB=MB),
                 ("base", "block_expert", "end"), dict(BLOCK_M=rows, E_PAD=pow2(E + 1), MB_PAD=pow2(MB_max + 1)),
                 (1, 1, 1), 8, TRITON_DEFAULT_STAGES),
            step("k3::moe_scatter", moe_scatter_trt_kernel, ("ids", "rank", "base", "block_expert", "end"),
                 dict(P=P, E=E, MB=MB), ("row_pair",), dict(BLOCK_M=rows, CHUNK=chunk, BLOCK=chunk),
                 (NC + cdiv(MB * rows, chunk), 1, 1), 4, TRITON_DEFAULT_STAGES)]


def combine_step(N, L: int, top_k: int, types: dict) -> Step:
    """k3::moe_combine: u[n] = sum_j w[n, j] y[n k + j] in fp32 (y in whatever dtype `types` gives it)."""
    block_l = min(1024, pow2(L))
    return step_maker(types)("k3::moe_combine", moe_combine_trt_kernel, ("y", "w", "z"), dict(L=L), ("u",),
                             dict(TOP_K=top_k, BLOCK_L=block_l), (N, cdiv(L, block_l), 1), 4, TRITON_DEFAULT_STAGES)


def check_max_tokens(N, max_tokens, E: int, top_k: int) -> int:
    """max_tokens (default N) checked: a positive int (required when N is a shape expression), >= an int N."""
    max_tokens = N if max_tokens is None else max_tokens
    check(isinstance(max_tokens, int) and max_tokens >= 1, f"moe trt: max_tokens must be a positive int, got "
          f"{max_tokens!r} (N is a shape expression: pass the profile's largest N)")
    check(0 < top_k <= E, f"moe trt: top_k {top_k} must be in 1..{E}")
    check(not isinstance(N, int) or N <= max_tokens, f"moe trt: N {N} > max_tokens {max_tokens}")
    return max_tokens


def chain_steps(N, d: int, E: int, top_k: int, L: int, I: int, dtype: torch.dtype, renormalize: bool = True,
                scaling: float = 1.0, beta: float = 4.0, linear_beta: float = 25.0, max_tokens: int | None = None,
                minimum=min, tiles: MoeTiles | None = None) -> list[Step]:
    """The launches of `k3::moe_routed` for x `[N, d]`, z `[N, L]`, gate_weight `[E, d]`, w1/w3 `[E, I, L]`,
    w2 `[E, L, I]`, u `[N, L]`, all in `dtype` (the model dtype) and contiguous, bias `[E]` fp32:

        decode  (max_tokens k <= 4096 pairs): router, topk, align (one program), gemm1, gemm2, combine
        prefill (more pairs): router, topk, count, plan, scatter (the chunked align), gemm1, gemm2, combine

    max_tokens (default N): the largest N the PTX must serve; token-count-dependent constants (and the chain) are
    chosen for it. N may be a TensorRT shape expression (then max_tokens is required, minimum =
    tensorrt.plugin.min). tiles: the prefill chain's tiling (default `chain_tiles`; pointer loads, chunked align)."""
    max_tokens = check_max_tokens(N, max_tokens, E, top_k)
    prefill = max_tokens * top_k > ALIGN_FUSED_MAX
    cfg = chain_tiles(max_tokens, top_k, dtype, E, tiles)
    chunk = cfg.chunk_align
    check(not prefill or (chunk >= 16 and chunk & (chunk - 1) == 0 and not cfg.fused_align), "moe trt: the "
          f"prefill chain's tiling must name the chunked align (chunk_align a power of two >= 16, got {chunk}; "
          "fused_align off)")
    check(not cfg.tma and not cfg.pairs, "moe trt: an AOT chain takes pointer-load row-plan tilings only (no TMA "
          "descriptor, no pairs path)")
    check(prefill or cfg.tail == 0, "moe trt: the decode chain's one-program align sizes blocks by block_m (no tail)")
    MB = plan_blocks(N * top_k, E, cfg.rows, minimum)
    inter = chain_intermediates(N, E, top_k, L, I, dtype, max_tokens, minimum, tiles)
    types = chain_types(inter, dtype, w1=dtype, w3=dtype, w2=dtype)
    step = step_maker(types)
    chain = route_steps(N, d, E, top_k, dtype, max_tokens, renormalize, scaling, types, cfg)
    chain += align_steps(N, E, top_k, cfg.rows, max_tokens, types, minimum, chunk or ALIGN_CHUNK)
    tail = dict(TAIL=cfg.tail) if cfg.tail else {}
    fast = dict(FAST_ACT=min(cfg.fast_act, 1 if INTERPRET else 2)) if cfg.fast_act else {}
    bn1, bk1, warps1, stages1 = cfg.gemm1
    bn2, bk2, warps2, stages2 = cfg.gemm2
    chain += [step("k3::moe_gemm1", moe_gemm1_trt_kernel, ("z", "w1", "w3", "row_pair", "block_expert"),
                   dict(MB=MB, L=L, I=I, stride_an=L, stride_we=I * L, stride_wi=L, stride_hm=I,
                        group_m=minimum(cfg.group_m, MB)), ("h",),
                   dict(beta=float(beta), linear_beta=float(linear_beta), TOP_K=top_k, BLOCK_M=cfg.block_m,
                        BLOCK_N=bn1, BLOCK_K=bk1, A_DESC=False, W_DESC=False, DOT_PREC=dot_precision(dtype), **tail,
                        **fast), (MB * cdiv(I, bn1), 1, 1), warps1, stages1),
              step("k3::moe_gemm2", moe_gemm2_trt_kernel, ("h", "w2", "row_pair", "block_expert", "ids"),
                   dict(MB=MB, L=L, I=I, stride_hm=I, stride_we=L * I, stride_wl=I, stride_yp=L,
                        group_m=minimum(cfg.group_m, MB)), ("y",),
                   dict(BLOCK_M=cfg.block_m, BLOCK_N=bn2, BLOCK_K=bk2, A_DESC=False, W_DESC=False,
                        DOT_PREC=dot_precision(dtype), **tail), (MB * cdiv(L, bn2), 1, 1), warps2, stages2),
              combine_step(N, L, top_k, types)]
    return chain


def decode_steps(N, d: int, E: int, top_k: int, L: int, I: int, dtype: torch.dtype, **kw) -> list[Step]:
    """`chain_steps` of the decode chain only (N k <= 4096 pairs; more: a ValueError naming the prefill chain)."""
    max_tokens = kw.get("max_tokens") or N
    check(not isinstance(max_tokens, int) or max_tokens * top_k <= ALIGN_FUSED_MAX,
          f"moe trt: {max_tokens} tokens x top-{top_k} = {max_tokens * top_k} pairs > {ALIGN_FUSED_MAX}: beyond the "
          "decode chain (one-program align); `chain_steps` gives the prefill chain")
    return chain_steps(N, d, E, top_k, L, I, dtype, **kw)


def bind(step: Step, tensors: dict) -> dict:
    """Pointer param -> tensor, from a dict of the chain's tensors by name (parameter names are the chain's names:
    x, gate_weight, bias, z, w1, w3, w2, the intermediates, u)."""
    return {n: tensors[n] for n, t in step.params if t.startswith("*")}


# ---------------------------------------------------------------------------------------------- TensorRT
def register_plugins() -> bool:
    """Register the MoE plugins of both chains with `tensorrt.plugin` (the chain of a graph follows from its
    max_tokens: `chain_steps`). Returns False when TensorRT is not importable.

    Attributes: every plugin takes max_tokens (the optimisation profile's largest N: the PTX is compiled for it)
    and top_k; k3::moe_topk also renormalize and scaling, k3::moe_gemm1 beta and linear_beta, the align plugins
    (k3::moe_align; k3::moe_count, _plan, _scatter) num_experts (ids do not carry E) and block_rows (the rows per
    block of the GEMMs that follow: `chain_tiles(...).rows` in this chain, the FP8 chain's own in `trt_fp8`; the
    combine takes y's dtype from its input, fp32 or the model's, for the same reason). Registered for 16-bit models
    (bf16/fp16: the tiling of every non-GEMM step is the same for both; an fp32 engine would need the fp32 tiling
    passed as an attribute). k3::moe_gemm2 also takes ids as an input for its shape only (y has N k rows, and N is
    not visible in h's shape), as does k3::moe_plan (its block bound depends on N k).
    Never run against TensorRT (not installable on our machines, docs/deployment-notes); tests/test_moe_trt.py
    runs it against a stand-in."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        return False
    from typing import Tuple

    AOT = Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]     # aot_impl must annotate its result

    to_torch = {trt.bfloat16: torch.bfloat16, trt.float16: torch.float16}

    def result(plugin, N, d, E, top_k, L, I, dtype, max_tokens, **attrs):
        """dtype: the model dtype where the plugin sees it, None where it does not (top-k, align: their
        constants are the same for bf16 and fp16)."""
        check(dtype is None or dtype in to_torch, f"{plugin}: the TensorRT MoE plugins are registered for bf16 / "
              f"fp16 models, got {dtype} (export the graphs with --dtype bfloat16 or float16)")
        chain = chain_steps(N, d, E, top_k, L, I, to_torch.get(dtype, torch.bfloat16), max_tokens=max_tokens,
                            minimum=trtp.min, **attrs)
        step = next(s for s in chain if s.plugin == plugin)
        return trt_kernel_result(trtp, step.launch(), step.grid, step.scalars.values())

    def desc(like, shape, dtype):
        return trt_desc(trtp, like, shape, dtype)

    # N is a shape expression (x, part, ids or z's first dim); E, d, L, I are the weights' static shapes. Dims a
    # step does not use are passed as 16.
    @trtp.register("k3::moe_router")
    def _router_desc(x: trtp.TensorDesc, gate_weight: trtp.TensorDesc, max_tokens: int, top_k: int
                     ) -> Tuple[trtp.TensorDesc]:
        S = router_config(max_tokens, torch.bfloat16, True)["splits"]
        return (desc(x, (S, x.shape_expr[0], gate_weight.shape[0]), trt.float32),)

    @trtp.aot_impl("k3::moe_router")
    def _router_aot(x, gate_weight, max_tokens: int, top_k: int, outputs, tactic) -> AOT:
        E, d = gate_weight.shape
        return result("k3::moe_router", x.shape_expr[0], d, E, top_k, 16, 16, x.dtype, max_tokens)

    @trtp.register("k3::moe_topk")
    def _topk_desc(part: trtp.TensorDesc, bias: trtp.TensorDesc, max_tokens: int, top_k: int, renormalize: bool,
                   scaling: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        N, E = part.shape_expr[1], part.shape_expr[2]
        return desc(part, (N, top_k), trt.int32), desc(part, (N, top_k), trt.float32), desc(part, (N, E), trt.float32)

    @trtp.aot_impl("k3::moe_topk")
    def _topk_aot(part, bias, max_tokens: int, top_k: int, renormalize: bool, scaling: float, outputs, tactic) -> AOT:
        return result("k3::moe_topk", part.shape_expr[1], 16, part.shape[2], top_k, 16, 16, None, max_tokens,
                      renormalize=renormalize, scaling=scaling)

    def align_result(plugin, ids, max_tokens, top_k, num_experts, block_rows):
        N = ids.shape_expr[0]
        inter = align_intermediates(N, num_experts, top_k, block_rows, max_tokens, trtp.min)
        types = {**chain_types(inter, torch.bfloat16), "ids": pointer_type(torch.int32)}
        steps = align_steps(N, num_experts, top_k, block_rows, max_tokens, types, trtp.min)
        step = next(s for s in steps if s.plugin == plugin)
        return trt_kernel_result(trtp, step.launch(), step.grid, step.scalars.values())

    def int_outs(ids, max_tokens, top_k, num_experts, block_rows, names):
        shapes = align_intermediates(ids.shape_expr[0], num_experts, top_k, block_rows, max_tokens, trtp.min)
        return tuple(desc(ids, shapes[n][0], trt.int32) for n in names)

    @trtp.register("k3::moe_align")
    def _align_desc(ids: trtp.TensorDesc, max_tokens: int, top_k: int, num_experts: int, block_rows: int
                    ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return int_outs(ids, max_tokens, top_k, num_experts, block_rows, ("row_pair", "block_expert", "off"))

    @trtp.aot_impl("k3::moe_align")
    def _align_aot(ids, max_tokens: int, top_k: int, num_experts: int, block_rows: int, outputs, tactic) -> AOT:
        return align_result("k3::moe_align", ids, max_tokens, top_k, num_experts, block_rows)

    @trtp.register("k3::moe_count")
    def _count_desc(ids: trtp.TensorDesc, max_tokens: int, top_k: int, num_experts: int, block_rows: int
                    ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return int_outs(ids, max_tokens, top_k, num_experts, block_rows, ("hist", "rank"))

    @trtp.aot_impl("k3::moe_count")
    def _count_aot(ids, max_tokens: int, top_k: int, num_experts: int, block_rows: int, outputs, tactic) -> AOT:
        return align_result("k3::moe_count", ids, max_tokens, top_k, num_experts, block_rows)

    @trtp.register("k3::moe_plan")
    def _plan_desc(hist: trtp.TensorDesc, ids: trtp.TensorDesc, max_tokens: int, top_k: int, num_experts: int,
                   block_rows: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return int_outs(ids, max_tokens, top_k, num_experts, block_rows, ("base", "block_expert", "end"))

    @trtp.aot_impl("k3::moe_plan")
    def _plan_aot(hist, ids, max_tokens: int, top_k: int, num_experts: int, block_rows: int, outputs,
                  tactic) -> AOT:
        return align_result("k3::moe_plan", ids, max_tokens, top_k, num_experts, block_rows)

    @trtp.register("k3::moe_scatter")
    def _scatter_desc(ids: trtp.TensorDesc, rank: trtp.TensorDesc, base: trtp.TensorDesc,
                      block_expert: trtp.TensorDesc, end: trtp.TensorDesc, max_tokens: int, top_k: int,
                      num_experts: int, block_rows: int) -> Tuple[trtp.TensorDesc]:
        return int_outs(ids, max_tokens, top_k, num_experts, block_rows, ("row_pair",))

    @trtp.aot_impl("k3::moe_scatter")
    def _scatter_aot(ids, rank, base, block_expert, end, max_tokens: int, top_k: int, num_experts: int,
                     block_rows: int, outputs, tactic) -> AOT:
        return align_result("k3::moe_scatter", ids, max_tokens, top_k, num_experts, block_rows)

    @trtp.register("k3::moe_gemm1")
    def _gemm1_desc(z: trtp.TensorDesc, w1: trtp.TensorDesc, w3: trtp.TensorDesc, row_pair: trtp.TensorDesc,
                    block_expert: trtp.TensorDesc, max_tokens: int, top_k: int, beta: float, linear_beta: float
                    ) -> Tuple[trtp.TensorDesc]:
        return (desc(z, (row_pair.shape_expr[0], w1.shape[1]), z.dtype),)

    @trtp.aot_impl("k3::moe_gemm1")
    def _gemm1_aot(z, w1, w3, row_pair, block_expert, max_tokens: int, top_k: int, beta: float, linear_beta: float,
                   outputs, tactic) -> AOT:
        E, I, L = w1.shape
        return result("k3::moe_gemm1", z.shape_expr[0], 16, E, top_k, L, I, z.dtype, max_tokens, beta=beta,
                      linear_beta=linear_beta)

    @trtp.register("k3::moe_gemm2")
    def _gemm2_desc(h: trtp.TensorDesc, w2: trtp.TensorDesc, row_pair: trtp.TensorDesc,
                    block_expert: trtp.TensorDesc, ids: trtp.TensorDesc, max_tokens: int, top_k: int
                    ) -> Tuple[trtp.TensorDesc]:
        y_half = chain_tiles(max_tokens, top_k, torch.bfloat16, w2.shape[0]).y_half     # the same for bf16 / fp16
        return (desc(h, (ids.shape_expr[0] * top_k, w2.shape[1]), h.dtype if y_half else trt.float32),)

    @trtp.aot_impl("k3::moe_gemm2")
    def _gemm2_aot(h, w2, row_pair, block_expert, ids, max_tokens: int, top_k: int, outputs, tactic) -> AOT:
        E, L, I = w2.shape
        return result("k3::moe_gemm2", ids.shape_expr[0], 16, E, top_k, L, I, h.dtype, max_tokens)

    @trtp.register("k3::moe_combine")
    def _combine_desc(y: trtp.TensorDesc, w: trtp.TensorDesc, z: trtp.TensorDesc, max_tokens: int, top_k: int
                      ) -> Tuple[trtp.TensorDesc]:
        return (z.like(),)

    @trtp.aot_impl("k3::moe_combine")
    def _combine_aot(y, w, z, max_tokens: int, top_k: int, outputs, tactic) -> AOT:
        y_type = {trt.float32: torch.float32, **to_torch}[y.dtype]      # fp32, or z.dtype (y_half, FP8 W8A8)
        step = combine_step(w.shape_expr[0], y.shape[1], top_k, {"y": pointer_type(y_type), "w": "*fp32",
                                                                 "z": pointer_type(to_torch[z.dtype]),
                                                                 "u": pointer_type(to_torch[z.dtype])})
        return trt_kernel_result(trtp, step.launch(), step.grid, step.scalars.values())

    return True
