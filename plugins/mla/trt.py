"""TensorRT side of the MLA kernels: the AOT launch contracts (TensorRT-independent plain data from
`plugins/aot.py`, tested through cupy against `torch.ops.k3.*`) and the `tensorrt.plugin` definitions built on them
(registered only when `import tensorrt` works; it cannot be installed on our machines, see docs/deployment-notes,
so `register_plugins` has never run against TensorRT: tests/test_mla_trt.py runs it against a stand-in with
tensorrt.plugin 11.4's registration checks, on symbolic B, L, T, S).

An AOT plugin is exactly one kernel launch with no workspace, so:
- `k3::mla_decode` is two plugins joined by explicit fp32 intermediates (an ONNX translation emits them in order):
    k3::mla_decode_split   (q, cache, cache_len)          -> o_part [B, H, S, 512] fp32, lse_part [B, H, S] fp32
    k3::mla_decode_combine (q, new_row, o_part, lse_part) -> o [B, H, v_dim] q.dtype
  S (splits) is the split plugin's explicit `num_splits` attribute, fixed when the graph is built. Why an explicit
  attribute and not a rule over the profile's bounds: S sizes the intermediates, so it must be static, and no
  single rule value serves a whole (B, L) profile (the torch op's `split_rule` at B = 1, L = 64k gives 88 splits
  at 96 heads, which at B = 128 would write a 2.2 GB o_part; at B = 128 it gives 1, which leaves B = 1 at 64k
  with 3 programs). The exporter knows which (B, L) it builds for and passes `decode_splits(B, H, L)` there; at
  that point the plugins launch exactly what the torch op launches. Any S is correct for every B and L: each
  sequence's chunk is `ceil(cache_len[b] / S)` rows rounded to BLOCK_N, taken on the device, and a split past the
  end writes lse = -inf, which the combine weighs 0. Cost of a large S: B*H*S*2 KiB of fp32 intermediates.
- `k3::mla_prefill` is one plugin. BLOCK_M is the full tuned block (128; 32 for fp32) for every T instead of the
  torch launcher's `min(128, pow2(T))`: the kernel masks query rows >= T on load and store, and a padded row sees
  new row 0, so no row is empty; identical to the torch launcher for T > 64, more idle rows below.

Each launch is a small `@triton.jit` wrapper (`mla_*_trt_kernel`) that calls the kernel of `kernels.py` unchanged,
with the float scale made a compile-time constant (TensorRT's extra kernel arguments are integers only), so
parameters are inputs..., i32 scalars..., outputs...; the scalars are contiguous-layout strides and sizes,
written with + - * // only, so they evaluate on ints and on TensorRT shape expressions alike. cache_len / past_len
are int64 and read as given: values must lie in 0..L (the torch op clamps them, the plugin does not).
"""

# No `from __future__ import annotations` here: tensorrt.plugin validates the registered functions' annotations
# with inspect.signature, which would see strings instead of TensorDesc / int (TensorRT 11.4 `_validate.py`).

import torch
import triton
import triton.language as tl

from k3export.plugins.aot import Launch, Plan, pointer_type, trt_desc, trt_kernel_result
from k3export.plugins.triton_common import cdiv, check, dot_precision, pow2

from .kernels import (LOG2E, PREFILL_CONFIG, combine_grid, combine_tile, decode_block_h, decode_tiles,
                      mla_decode_combine_kernel, mla_decode_fwd_kernel, mla_prefill_fwd_kernel, prefill_head_blocks,
                      split_rule)

H200_SMS = 132


# ---------------------------------------------------------------------------------------------- wrappers
@triton.jit
def mla_decode_split_trt_kernel(q, cache, cache_len, stride_qb, stride_qh, stride_cb, stride_cl, H, num_splits,
                                V_DIM, R, o_part, lse_part, qk_scale: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_PE: tl.constexpr,
                                DOT_PREC: tl.constexpr):
    mla_decode_fwd_kernel(q, cache, cache_len, stride_qb, stride_qh, stride_cb, stride_cl, H, num_splits, qk_scale,
                          V_DIM, R, o_part, lse_part, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V,
                          BLOCK_PE=BLOCK_PE, DOT_PREC=DOT_PREC)


@triton.jit
def mla_decode_combine_trt_kernel(q, new_row, o_part, lse_part, stride_qb, stride_qh, stride_nb, stride_ob,
                                  stride_oh, H, num_splits, V_DIM, R, o, qk_scale: tl.constexpr,
                                  BLOCK_V: tl.constexpr, BLOCK_PE: tl.constexpr, BLOCK_S: tl.constexpr,
                                  BLOCK_VC: tl.constexpr, BLOCK_C: tl.constexpr):
    mla_decode_combine_kernel(q, new_row, o_part, lse_part, stride_qb, stride_qh, stride_nb, stride_ob, stride_oh,
                              H, num_splits, qk_scale, V_DIM, R, o, BLOCK_V=BLOCK_V, BLOCK_PE=BLOCK_PE,
                              BLOCK_S=BLOCK_S, BLOCK_VC=BLOCK_VC, BLOCK_C=BLOCK_C)


@triton.jit
def mla_prefill_trt_kernel(q, k, v, past_len, stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                           stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh, T, S, H, D_QK, D_V, o,
                           qk_scale: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, HAS_B: tl.constexpr, BLOCK_V: tl.constexpr,
                           DOT_PREC: tl.constexpr):
    mla_prefill_fwd_kernel(q, k, v, past_len, stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                           stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh, T, S, H, qk_scale,
                           D_QK, D_V, o, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_A=BLOCK_A, BLOCK_B=BLOCK_B,
                           HAS_B=HAS_B, BLOCK_V=BLOCK_V, DOT_PREC=DOT_PREC)


# ---------------------------------------------------------------------------------------------- contracts
def _plan(fn, types: dict, scalars: dict, constexprs: dict, grid, num_warps: int, num_stages: int) -> Plan:
    """params in the wrapper's order: pointers from `types`, every other non-constexpr param an i32 scalar."""
    params = tuple((n, types.get(n, "i32")) for n in fn.arg_names if n not in constexprs)
    check(set(scalars) == {n for n, t in params if t == "i32"}, f"{fn.__name__}: scalars {sorted(scalars)}")
    return Plan(fn, params, scalars, constexprs, tuple(grid), num_warps, num_stages)


def decode_splits(B: int, H: int, L: int, sms: int = H200_SMS) -> int:
    """The torch op's split rule (kernels.split_rule) with the SM count given instead of queried."""
    return split_rule(B, H, L, decode_block_h(H), sms)


def decode_split_plan(B, H: int, L, R: int, v_dim: int, dtype: torch.dtype, scale: float, num_splits: int) -> Plan:
    """`k3::mla_decode_split` for contiguous q `[B, H, R]`, cache `[B, L, R]`, cache_len `[B]` int64 -> o_part
    `[B, H, S, pow2(v_dim)]`, lse_part `[B, H, S]` fp32, S = num_splits. B and L may be shape expressions."""
    p = pointer_type(dtype)
    cfg = decode_tiles(H)
    fp32 = dtype == torch.float32
    bh = decode_block_h(H)
    cx = dict(qk_scale=scale * LOG2E, BLOCK_H=bh, BLOCK_N=16 if fp32 else cfg["block_n"], BLOCK_V=pow2(v_dim),
              BLOCK_PE=pow2(R - v_dim), DOT_PREC=dot_precision(dtype))
    scalars = dict(stride_qb=H * R, stride_qh=R, stride_cb=L * R, stride_cl=R, H=H, num_splits=num_splits,
                   V_DIM=v_dim, R=R)
    return _plan(mla_decode_split_trt_kernel, dict(q=p, cache=p, cache_len="*i64", o_part="*fp32",
                                                   lse_part="*fp32"),
                 scalars, cx, (cdiv(H, bh), num_splits, B), cfg["num_warps"], 1 if fp32 else cfg["num_stages"])


def decode_combine_plan(B, H: int, R: int, v_dim: int, dtype: torch.dtype, scale: float, num_splits: int,
                        sms: int = H200_SMS) -> Plan:
    """`k3::mla_decode_combine` for q `[B, H, R]`, new_row `[B, R]`, the split's o_part / lse_part -> o
    `[B, H, v_dim]` in dtype. B may be a shape expression (the tile is then the small-batch one)."""
    p = pointer_type(dtype)
    bv = pow2(v_dim)
    ct = combine_tile(H, B, num_splits, bv, sms)
    cx = dict(qk_scale=scale * LOG2E, BLOCK_V=bv, BLOCK_PE=pow2(R - v_dim), BLOCK_S=pow2(num_splits, 2), **ct)
    scalars = dict(stride_qb=H * R, stride_qh=R, stride_nb=R, stride_ob=H * v_dim, stride_oh=v_dim, H=H,
                   num_splits=num_splits, V_DIM=v_dim, R=R)
    return _plan(mla_decode_combine_trt_kernel, dict(q=p, new_row=p, o_part="*fp32", lse_part="*fp32", o=p),
                 scalars, cx, combine_grid(H, B, bv, ct["BLOCK_VC"]), 4, 1)


def decode_intermediates(B, H: int, v_dim: int, num_splits: int) -> dict:
    """name -> (shape, dtype) of the tensors between the two decode plugins (contiguous)."""
    check(isinstance(num_splits, int) and num_splits >= 1, f"mla decode trt: num_splits must be a positive int, "
          f"got {num_splits!r} (pick it with decode_splits(B, H, L) at the batch and cache length built for)")
    return {"o_part": ((B, H, num_splits, pow2(v_dim)), torch.float32),
            "lse_part": ((B, H, num_splits), torch.float32)}


def decode_launches(B: int, H: int, L: int, R: int, v_dim: int, dtype: torch.dtype, scale: float,
                    sms: int = H200_SMS, arch: int = 90, num_splits: int | None = None) -> tuple[Launch, Launch, dict]:
    """(split launch, combine launch, intermediate shapes) of `k3::mla_decode` for contiguous q `[B, H, R]`,
    cache `[B, L, R]`, new_row `[B, R]`, cache_len `[B]` int64 (values 0..L), o `[B, H, v_dim]`.
    num_splits: the plugin's attribute; None takes the torch op's rule for (B, H, L, sms)."""
    S = decode_splits(B, H, L, sms) if num_splits is None else num_splits
    inter = decode_intermediates(B, H, v_dim, S)
    split = decode_split_plan(B, H, L, R, v_dim, dtype, scale, S).launch(arch)
    comb = decode_combine_plan(B, H, R, v_dim, dtype, scale, S, sms).launch(arch)
    return split, comb, inter


def prefill_plan(B, T, S, H: int, D: int, Dv: int, dtype: torch.dtype, scale: float,
                 block_m: int | None = None) -> Plan:
    """`k3::mla_prefill` for contiguous q `[B, T, H, D]`, k `[B, S, H, D]`, v `[B, S, H, Dv]`, past_len `[B]`
    int64 -> o `[B, T, H, Dv]` (D >= 16). block_m None: the torch launcher's `min(128, pow2(T))` (int T only);
    the plugin passes the full block. B, T, S may be shape expressions."""
    p = pointer_type(dtype)
    fp32 = dtype == torch.float32
    cfg = PREFILL_CONFIG
    check(D >= 16, f"mla prefill trt: Dqk must be >= 16, got {D}")
    if block_m is None:
        check(isinstance(T, int), "mla prefill trt: T is a shape expression: pass block_m (the plugin's full block)")
        block_m = 32 if fp32 else min(cfg["block_m"], pow2(T))
    cx = dict(qk_scale=scale * LOG2E, BLOCK_M=block_m, BLOCK_N=32 if fp32 else cfg["block_n"],
              **prefill_head_blocks(D), BLOCK_V=pow2(Dv), DOT_PREC=dot_precision(dtype))
    scalars = dict(stride_qb=T * (H * D), stride_qt=H * D, stride_qh=D, stride_kb=S * (H * D), stride_ks=H * D,
                   stride_kh=D, stride_vb=S * (H * Dv), stride_vs=H * Dv, stride_vh=Dv, stride_ob=T * (H * Dv),
                   stride_ot=H * Dv, stride_oh=Dv, T=T, S=S, H=H, D_QK=D, D_V=Dv)
    return _plan(mla_prefill_trt_kernel, dict(q=p, k=p, v=p, past_len="*i64", o=p), scalars, cx,
                 (cdiv(T, block_m), B * H, 1), 4 if fp32 else cfg["num_warps"], 1 if fp32 else cfg["num_stages"])


def plugin_block_m(dtype: torch.dtype) -> int:
    """The prefill plugin's BLOCK_M: the full tuned block for every T (see the module docstring)."""
    return 32 if dtype == torch.float32 else PREFILL_CONFIG["block_m"]


def prefill_launch(B: int, T: int, S: int, H: int, D: int, Dv: int, dtype: torch.dtype, scale: float,
                   arch: int = 90, block_m: int | None = None) -> Launch:
    """The launch of `k3::mla_prefill` for contiguous q `[B, T, H, D]`, k `[B, S, H, D]`, v `[B, S, H, Dv]`,
    past_len `[B]` int64, o `[B, T, H, Dv]` (D >= 16); block_m None: the torch launcher's choice."""
    return prefill_plan(B, T, S, H, D, Dv, dtype, scale, block_m).launch(arch)


# ---------------------------------------------------------------------------------------------- TensorRT
def register_plugins() -> bool:
    """Register `k3::mla_decode_split`, `k3::mla_decode_combine` and `k3::mla_prefill` with `tensorrt.plugin`.
    Returns False when TensorRT is not importable.

    Attributes: scale (float; compiled into the PTX), v_dim (int, decode), num_splits (int, the split plugin; the
    combine reads S from o_part's static shape). An ONNX float attribute is float32, so scale may differ from the
    torch op's python float by an fp32 rounding (before the compiled-in scale * log2(e) is rounded again). Dtypes bf16 / fp16 / fp32 (the model dtype; cache_len and
    past_len int64). Never run against TensorRT (not installable on our machines, docs/deployment-notes);
    tests/test_mla_trt.py runs it against a stand-in."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        return False
    from typing import Tuple, Union

    TD = trtp.TensorDesc
    AOT = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]
    to_torch = {trt.bfloat16: torch.bfloat16, trt.float16: torch.float16, trt.float32: torch.float32}

    def model_dtype(plugin, dt) -> torch.dtype:
        check(dt in to_torch, f"{plugin}: registered for bf16 / fp16 / fp32 models, got {dt}")
        return to_torch[dt]

    def result(plan: Plan):
        scalars = [plan.scalars[n] for n, t in plan.params if not t.startswith("*")]     # in parameter order
        return trt_kernel_result(trtp, plan.launch(), plan.grid, scalars)

    def desc(like, shape, dtype):
        return trt_desc(trtp, like, shape, dtype)

    # B, L (decode) and B, T, S (prefill) are shape expressions; H, R, Dqk, Dv are static.
    @trtp.register("k3::mla_decode_split")
    def _split_desc(q: trtp.TensorDesc, cache: trtp.TensorDesc, cache_len: trtp.TensorDesc, scale: float,
                    v_dim: int, num_splits: int) -> Tuple[TD, TD]:                    # o_part, lse_part
        B, H = q.shape_expr[0], q.shape_expr[1]
        inter = decode_intermediates(B, H, v_dim, num_splits)
        return desc(q, inter["o_part"][0], trt.float32), desc(q, inter["lse_part"][0], trt.float32)

    @trtp.aot_impl("k3::mla_decode_split")
    def _split_aot(q, cache, cache_len, scale: float, v_dim: int, num_splits: int, outputs, tactic) -> AOT:
        H, R = q.shape[1], q.shape[2]
        dtype = model_dtype("k3::mla_decode_split", q.dtype)
        return result(decode_split_plan(q.shape_expr[0], H, cache.shape_expr[1], R, v_dim, dtype, scale,
                                        num_splits))

    @trtp.register("k3::mla_decode_combine")
    def _combine_desc(q: trtp.TensorDesc, new_row: trtp.TensorDesc, o_part: trtp.TensorDesc,
                      lse_part: trtp.TensorDesc, scale: float, v_dim: int) -> Tuple[TD]:           # o
        return (desc(q, (q.shape_expr[0], q.shape_expr[1], v_dim), q.dtype),)

    @trtp.aot_impl("k3::mla_decode_combine")
    def _combine_aot(q, new_row, o_part, lse_part, scale: float, v_dim: int, outputs, tactic) -> AOT:
        H, R, S = q.shape[1], q.shape[2], o_part.shape[2]
        dtype = model_dtype("k3::mla_decode_combine", q.dtype)
        return result(decode_combine_plan(q.shape_expr[0], H, R, v_dim, dtype, scale, S))

    @trtp.register("k3::mla_prefill")
    def _prefill_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, past_len: trtp.TensorDesc,
                      scale: float) -> Tuple[TD]:                                                   # o
        B, T, H = q.shape_expr[0], q.shape_expr[1], q.shape_expr[2]
        return (desc(q, (B, T, H, v.shape_expr[3]), q.dtype),)

    @trtp.aot_impl("k3::mla_prefill")
    def _prefill_aot(q, k, v, past_len, scale: float, outputs, tactic) -> AOT:
        H, D, Dv = q.shape[2], q.shape[3], v.shape[3]
        dtype = model_dtype("k3::mla_prefill", q.dtype)
        return result(prefill_plan(q.shape_expr[0], q.shape_expr[1], k.shape_expr[1], H, D, Dv, dtype, scale,
                                   plugin_block_m(dtype)))

    return True
