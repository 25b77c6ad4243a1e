"""TensorRT side of the KDA kernels: the AOT launch contracts (TensorRT-independent, tested through cupy) and the
`tensorrt.plugin` definitions built on them (registered only when `import tensorrt` works; it cannot be installed
on our machines, see docs/deployment-notes).

An AOT plugin is exactly one kernel launch with no workspace, so:
- `k3::kda_decode` is one plugin (one fused launch), same inputs/attributes as the torch op.
- `k3::kda_prefill` becomes two plugins joined by explicit intermediate tensors:
  `k3::kda_prefill_intra` (q, k, v, f, b, A_log, dt_bias, lengths -> w, u, qg, kd, aqk, gl) and
  `k3::kda_prefill_chunks` (w, u, qg, kd, aqk, gl, initial_state, lengths -> o, final_state).
  An ONNX translation of `k3::kda_prefill` emits the two nodes in that order.
Kernel parameters are ordered inputs..., scalars..., outputs...; the only scalar is T (padded tokens, i32).
Grids are written with `+ // *` only, so they evaluate on ints and on TensorRT shape expressions alike.

No `from __future__ import annotations` here: `tensorrt.plugin` reads the registered functions' annotations as
classes (`inspect.signature`), so they must not be strings; every output is named in the result annotation and
every `aot_impl` annotates its (name, PTX, launch params, extra args) result, as its validator requires.
"""

import torch

from k3export.plugins.aot import Launch, compile_ptx, pointer_type, trt_kernel_result
from k3export.plugins.triton_common import cdiv

from .kernels import (INTRA_CONFIGS, compute_dtype, decode_config, intra_kernel, kda_decode_fwd_kernel,
                      kda_prefill_fwd_kernel, prefill_config)


# --- prefill ---------------------------------------------------------------------------------------------------

def prefill_intermediates(B, T, H, K: int, V: int, dtype: torch.dtype) -> dict:
    """Shapes and dtypes of the tensors passed from the intra launch to the chunk launch (contiguous; NT chunks
    of BT = 64 tokens; the kernels index them flat, rows = B*H*NT*BT)."""
    BT = prefill_config(K, V)["BT"]
    NT = cdiv(T, BT)
    cd = compute_dtype(dtype)
    return {"w": ((B, H, NT * BT, K), cd), "u": ((B, H, NT * BT, V), cd), "qg": ((B, H, NT * BT, K), cd),
            "kd": ((B, H, NT * BT, K), cd), "aqk": ((B, H, NT * BT, BT), cd), "gl": ((B, H, NT, K), torch.float32)}


def prefill_grids(B, T, H, K: int, V: int):
    """(intra grid, chunk grid) for inputs `[B, T, H, K]`, v `[B, T, H, V]`."""
    cfg = prefill_config(K, V)
    return (cdiv(T, cfg["BT"]), B * H, 1), (cdiv(V, cfg["BV"]), B * H, 1)


def prefill_launches(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, lower_bound: float = -5.0,
                     arch: int = 90) -> tuple[Launch, Launch]:
    """The two launches of `k3::kda_prefill` for these shapes (initial/final state fp32, lengths int64)."""
    cfg = prefill_config(K, V)
    if cfg["intra"] != "full":      # the split intra is two launches with a scratch: a plugin keeps the one launch
        cfg = {**cfg, **INTRA_CONFIGS["full"]}
    inter = prefill_intermediates(B, T, H, K, V, dtype)
    ptr = {n: pointer_type(dtype) for n in ("q", "k", "v", "f", "b")}
    ptr.update(A_log="*fp32", dt_bias="*fp32", lengths="*i64", h0="*fp32", o=pointer_type(dtype), ht="*fp32")
    ptr.update({n: pointer_type(dt) for n, (_, dt) in inter.items()})
    g_intra, g_chunk = prefill_grids(B, T, H, K, V)
    prec = "ieee" if compute_dtype(dtype) == torch.float32 else "tf32"      # as kda_prefill_fwd

    intra_fn, intra_cx = intra_kernel(cfg, K, V, dtype, lower_bound)     # the config's intra kernel
    intra = _launch(intra_fn, ptr, dict(intra_cx, H=H), g_intra, {"T": T}, cfg["intra_warps"], cfg["intra_stages"],
                    arch, cfg["intra_maxnreg"])
    chunk_cx = dict(H=H, K=K, V=V, BK=cfg["BK"], BV=cfg["BV"], BT=cfg["BT"], PREC=prec)
    chunk = _launch(kda_prefill_fwd_kernel, ptr, chunk_cx, g_chunk, {"T": T}, cfg["state_warps"],
                    cfg["state_stages"], arch)
    return intra, chunk


# --- decode ----------------------------------------------------------------------------------------------------

def decode_grid(B, H):
    return (B * H, 1, 1)


def decode_launch(B: int, H: int, K: int, W: int, dtype: torch.dtype, lower_bound: float = -5.0,
                  eps: float = 1e-5, arch: int = 90) -> Launch:
    """The launch of `k3::kda_decode` for B sequences (all activations and weights in `dtype`; A_log, dt_bias,
    state fp32). No scalars: everything shape-dependent is in the grid."""
    cfg = decode_config(K, W)
    ptr = {n: pointer_type(dtype) for n in ("qkv", "conv_state", "conv_weight", "f", "b", "g", "o_norm_weight",
                                           "o", "conv_out")}
    ptr.update(A_log="*fp32", dt_bias="*fp32", state="*fp32", state_out="*fp32")
    cx = dict(H=H, K=K, W=W, BK=cfg["BK"], BW=cfg["BW"], LOWER=float(lower_bound), EPS=float(eps),
              PDL=False)                                   # a plugin launch is plain (no programmatic dependent launch)
    return _launch(kda_decode_fwd_kernel, ptr, cx, decode_grid(B, H), {}, cfg["num_warps"], 1, arch,
                   cfg["maxnreg"])


def _launch(fn, ptr_types: dict, constexprs: dict, grid, scalars: dict, num_warps: int, num_stages: int,
            arch: int, maxnreg: int | None = None) -> Launch:
    signature, params = {}, []
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = ptr_types.get(name, "i32")
            params.append((name, signature[name]))
    kernel = compile_ptx(fn, signature, constexprs, num_warps, num_stages, arch, maxnreg)
    return Launch(kernel, tuple(grid), tuple(params), dict(scalars))


# --- TensorRT plugins (only where TensorRT is importable) --------------------------------------------------------

def _trt_dtype_to_torch(dt) -> torch.dtype:
    import tensorrt as trt
    return {trt.bfloat16: torch.bfloat16, trt.float16: torch.float16, trt.float32: torch.float32}[dt]


def register_plugins() -> bool:
    """Register the three KDA plugins with `tensorrt.plugin`. Returns False when TensorRT is not importable."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        return False
    from typing import Tuple, Union

    TD = trtp.TensorDesc
    AOT = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]

    def kernel_result(launch: Launch, grid, scalars: dict):
        return trt_kernel_result(trtp, launch, grid, scalars.values())

    @trtp.register("k3::kda_decode")
    def _decode_desc(qkv: trtp.TensorDesc, conv_state: trtp.TensorDesc, conv_weight: trtp.TensorDesc,
                     f: trtp.TensorDesc, b: trtp.TensorDesc, g: trtp.TensorDesc, A_log: trtp.TensorDesc,
                     dt_bias: trtp.TensorDesc, o_norm_weight: trtp.TensorDesc, state: trtp.TensorDesc,
                     lower_bound: float, eps: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        o = g.like()                                            # [B, H*K], qkv's dtype
        o.dtype = qkv.dtype
        return o, conv_state.like(), state.like()

    @trtp.aot_impl("k3::kda_decode")
    def _decode_aot(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                    lower_bound: float, eps: float, outputs, tactic) -> AOT:
        H, K, W = b.shape[1], o_norm_weight.shape[0], conv_weight.shape[1]   # build-time constants
        launch = decode_launch(1, H, K, W, _trt_dtype_to_torch(qkv.dtype), lower_bound, eps)
        return kernel_result(launch, decode_grid(qkv.shape_expr[0], H), {})

    @trtp.register("k3::kda_prefill_intra")
    def _intra_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, f: trtp.TensorDesc,
                    b: trtp.TensorDesc, A_log: trtp.TensorDesc, dt_bias: trtp.TensorDesc, lengths: trtp.TensorDesc,
                    lower_bound: float) -> Tuple[TD, TD, TD, TD, TD, TD]:     # w, u, qg, kd, aqk, gl
        B, T, H, K = q.shape_expr
        outs = []
        for name, (shape, _) in prefill_intermediates(B, T, H, q.shape[3], v.shape[3], torch.bfloat16).items():
            d = q.like()
            d.shape_expr = trtp.ShapeExprs.from_tuple(shape)
            d.dtype = trt.float32 if name == "gl" else q.dtype
            outs.append(d)
        return tuple(outs)

    @trtp.aot_impl("k3::kda_prefill_intra")
    def _intra_aot(q, k, v, f, b, A_log, dt_bias, lengths, lower_bound: float, outputs, tactic) -> AOT:
        _, _, H, K = q.shape
        V = v.shape[3]
        launch, _ = prefill_launches(1, 64, H, K, V, _trt_dtype_to_torch(q.dtype), lower_bound)
        B, T = q.shape_expr[0], q.shape_expr[1]
        return kernel_result(launch, prefill_grids(B, T, H, K, V)[0], {"T": T})

    # o comes out padded to whole chunks, [B, NT*64, H, V]; the network slices it back to T tokens.
    @trtp.register("k3::kda_prefill_chunks")
    def _chunks_desc(w: trtp.TensorDesc, u: trtp.TensorDesc, qg: trtp.TensorDesc, kd: trtp.TensorDesc,
                     aqk: trtp.TensorDesc, gl: trtp.TensorDesc, initial_state: trtp.TensorDesc,
                     lengths: trtp.TensorDesc) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        B, H, Tp, V = u.shape_expr
        o = u.like()
        o.shape_expr = trtp.ShapeExprs.from_tuple((B, Tp, H, V))
        return o, initial_state.like()

    @trtp.aot_impl("k3::kda_prefill_chunks")
    def _chunks_aot(w, u, qg, kd, aqk, gl, initial_state, lengths, outputs, tactic) -> AOT:
        _, H, K, V = initial_state.shape
        launch = prefill_launches(1, 64, H, K, V, _trt_dtype_to_torch(u.dtype))[1]
        B, Tp = u.shape_expr[0], u.shape_expr[2]
        return kernel_result(launch, prefill_grids(B, Tp, H, K, V)[1], {"T": Tp})

    return True
