"""Graph pass for CUDA AOTInductor builds: each k3 op node -> the Triton launches of its CUDA implementation.

The exported graphs keep the k3 ops opaque (ONNX and TensorRT match on them). AOTInductor would compile such a
node as an extern call through the op dispatcher, so its package would need `k3export.plugins` at load time.
This pass re-traces the graph (`ExportedProgram.run_decompositions`) with each k3 op replaced by its host
launcher (`<op>_fwd` in `plugins/<op>/kernels.py`) run under `plugins.launch.traced_launches()`: every launch
becomes a `triton_kernel_wrapper_functional` node and Inductor compiles the kernel into the package.

An op is lowered only when its CUDA kernel is registered (the K3_*_TRITON=0 escape hatches leave it out) and
the kernel serves every node of that op (the op's own dtype/shape conditions, decided from the static dims);
otherwise it stays an extern call and `lower_k3_ops` says why. The lowered program lives in this process only
(the kernels are referenced by index into a process-local table): compile it right away, never save it.

Numerics equal the eager CUDA path except where eager picks a launch setting from a dynamic size: MLA decode
uses one split count for every batch and cache length (`mla_decode_splits`), the MLA prefill query block comes
from the largest token count, and the MoE tiling from the largest token count (`plugins/launch.size_bound`).
Speed differs where a launch option is host-side: the MoE GEMMs use pointer loads instead of TMA descriptors
(`moe_tiles`) and the KDA decode kernel's register cap (maxnreg) is not carried (`plugins/launch.py`).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

REASON_NO_KERNEL = "no CUDA kernel registered (K3_*_TRITON=0 or triton missing): the reference runs as an extern call"


@dataclass(frozen=True)
class Lowering:
    """How one k3 op becomes launches: `fn(*op args)` traces them; `why_not(*fake args)` is None when the kernel
    serves the call, else the reason the op stays an extern call (the branch its CUDA implementation takes)."""

    fn: Callable
    why_not: Callable


def _wide(*ts) -> bool:
    return any(t.dtype == torch.float64 for t in ts)


def _attn_res() -> Lowering:
    from k3export.plugins.attn_res import kernels as K

    def why_not(bank, p, nw, pw, eps):
        if _wide(bank, p, nw, pw):
            return "float64 inputs keep the reference"
        if bank.shape[1] > K.MAX_SOURCES:
            return f"{bank.shape[1]} bank rows > {K.MAX_SOURCES}"
        return None

    return Lowering(lambda bank, p, nw, pw, eps: K.attn_res_fwd(bank, p, nw, pw, eps), why_not)


def mla_decode_splits(H: int, L, device: torch.device) -> int:
    """One split count for every (batch, cache length): the eager rule at batch 1 and the largest cache
    (the latency case; a larger batch only gets more, shorter chunks). SM count of the build GPU, or the
    H200's 132 when tracing without one (CPU structural tests)."""
    from k3export.plugins.launch import size_bound
    from k3export.plugins.mla import kernels as K
    block_h = K.decode_block_h(H)
    sms = K._sm_count(device) if torch.cuda.is_available() else 132
    return K.split_rule(1, H, size_bound(L), block_h, sms)


def _mla_decode() -> Lowering:
    from k3export.plugins.mla import kernels as K

    def fn(q, cache, new_row, cache_len, scale, v_dim):
        S = mla_decode_splits(q.shape[1], cache.shape[1], q.device)
        return K.mla_decode_fwd(q, cache, new_row, cache_len, scale, v_dim, num_splits=S)

    return Lowering(fn, lambda q, cache, *_: "float64 inputs keep the reference" if _wide(q, cache) else None)


def _mla_prefill() -> Lowering:
    from k3export.plugins.mla import kernels as K

    def why_not(q, k, v, past_len, scale):
        if q.dtype == torch.float64:
            return "float64 inputs keep the reference"
        return f"Dqk {q.shape[-1]} < 16 keeps the reference" if q.shape[-1] < 16 else None

    return Lowering(K.mla_prefill_fwd, why_not)


def _kda_prefill() -> Lowering:
    from k3export.plugins.kda import kernels as K

    def why_not(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound):
        if _wide(q, k, v, f, initial_state) or not K.prefill_kernel_applies(q, v):
            return (f"the kernel serves bf16/fp16 with K = V = 128 (got {q.dtype}, K {q.shape[-1]}, "
                    f"V {v.shape[-1]}): the reference runs as an extern call")
        return None

    return Lowering(K.kda_prefill_fwd, why_not)


def _kda_decode() -> Lowering:
    from k3export.plugins.kda import kernels as K

    def why_not(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state, lower_bound, eps):
        return "float64 inputs keep the reference" if _wide(qkv, conv_state, state) else None

    return Lowering(K.kda_decode_fwd, why_not)


def moe_tiles(z, top_k: int, E: int):
    """The eager tiling at the largest token count, with pointer loads instead of TMA descriptors (the launchers
    build those on the host from data pointers, which a traced launcher does not have)."""
    from dataclasses import replace
    from k3export.plugins.launch import size_bound
    from k3export.plugins.moe import kernels as K
    return replace(K.tiles_for(z, size_bound(z.shape[0]) * top_k, E), tma="")


def _moe_routed() -> Lowering:
    from k3export.plugins.moe import kernels as K

    def fn(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta):
        return K.moe_routed_fwd(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta,
                                tiles=moe_tiles(z, top_k, w1.shape[0]))

    def why_not(x, z, gate_weight, bias, w1, *_):
        return "float64 inputs keep the reference" if _wide(x, z, w1) else None

    return Lowering(fn, why_not)


LOWERINGS: dict[str, Callable[[], Lowering]] = {
    "attn_res": _attn_res, "mla_decode": _mla_decode, "mla_prefill": _mla_prefill,
    "kda_prefill": _kda_prefill, "kda_decode": _kda_decode, "moe_routed": _moe_routed,
}


def k3_nodes(gm: torch.fx.GraphModule) -> dict[torch._ops.OpOverload, list[torch.fx.Node]]:
    nodes: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "k3":
            nodes.setdefault(n.target, []).append(n)
    return nodes


def op_name(op: torch._ops.OpOverload) -> str:
    return op.name().split("::")[1].split(".")[0]


def triton_launches(gm: torch.fx.GraphModule) -> dict[str, int]:
    """`{kernel name: launch nodes}` of the `triton_kernel_wrapper_*` nodes in a graph."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    c = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("triton_kernel_wrapper"):
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            c[getattr(k, "__name__", None) or getattr(getattr(k, "fn", None), "__name__", str(k))] += 1
    return dict(sorted(c.items()))


def plan(ep: torch.export.ExportedProgram) -> tuple[dict, dict[str, str]]:
    """Which k3 ops of `ep` can be lowered: ({op overload: Lowering}, {op name: why it stays extern})."""
    from torch._library.custom_ops import _maybe_get_opdef
    lower, extern = {}, {}
    for op, nodes in k3_nodes(ep.graph_module).items():
        name = op_name(op)
        opdef = _maybe_get_opdef(op)
        if name not in LOWERINGS:
            extern[name] = "no lowering written for this op"
            continue
        if opdef is None or "cuda" not in opdef._backend_fns:
            extern[name] = REASON_NO_KERNEL
            continue
        rule = LOWERINGS[name]()
        reasons = {rule.why_not(*_fake_args(n)) for n in nodes} - {None}
        if reasons:
            extern[name] = "; ".join(sorted(reasons))
        else:
            lower[op] = rule
    return lower, extern


def _fake_args(node: torch.fx.Node) -> list:
    return [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]


# The re-trace runs each k3 op through FunctionalTensorMode; a rule registered there (as torch.library.triton_op
# does for its ops) runs the launcher with that mode active, so the `wrap_triton` launches are functionalized
# into `triton_kernel_wrapper_functional` nodes. (A `run_decompositions` table entry would run below
# functionalization: the launches would stay mutations that the graph's dead-code pass drops.) The rule acts
# only for the ops in _ACTIVE, i.e. during `lower_k3_ops`; otherwise the op goes through the mode unchanged.
_ACTIVE: dict = {}
_REGISTERED: set = set()


def _register(op: torch._ops.OpOverload) -> None:
    from torch._library.custom_ops import _maybe_get_opdef
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch._subclasses.fake_tensor import FakeTensor
    if op in _REGISTERED:
        return

    def lower(mode, func, types, args, kwargs):
        rule = _ACTIVE.get(op)
        if rule is None:
            return mode.__torch_dispatch__(func, types, args, kwargs)
        if any(not issubclass(t, (FakeTensor, FunctionalTensor)) and t is not torch.Tensor for t in types):
            return NotImplemented
        with mode:
            return rule.fn(*args, **kwargs)

    _maybe_get_opdef(op).register_torch_dispatch(FunctionalTensorMode, lower)
    _REGISTERED.add(op)


def lower_k3_ops(ep: torch.export.ExportedProgram) -> tuple[torch.export.ExportedProgram, dict]:
    """The pass. Returns the lowered program and a report: {"compiled_in": {op: nodes}, "extern": {op: reason},
    "launches": {kernel: nodes}}. Ops named in env K3EXPORT_AOTI_EXTERN (comma-separated) stay extern. If the
    re-trace fails, each op is tried alone and the ops that fail stay extern, their error in the report."""
    before = {op_name(op): len(ns) for op, ns in k3_nodes(ep.graph_module).items()}
    lower, extern = plan(ep)
    for name in filter(None, os.environ.get("K3EXPORT_AOTI_EXTERN", "").split(",")):
        for op in [op for op in lower if op_name(op) == name]:
            del lower[op]
            extern[name] = "kept extern by K3EXPORT_AOTI_EXTERN"
    try:
        lowered = _retrace(ep, lower)
    except Exception:                                   # noqa: BLE001 (any tracing error: find the ops)
        if len(lower) <= 1:
            raise
        for op in list(lower):
            try:
                _retrace(ep, {op: lower[op]})
            except Exception as e:                      # noqa: BLE001
                extern[op_name(op)] = f"lowering failed: {type(e).__name__}: {str(e).strip()[:400]}"
                del lower[op]
        lowered = _retrace(ep, lower)
    left = {op_name(op) for op in k3_nodes(lowered.graph_module)}
    done = {op_name(op) for op in lower}
    if left & done:
        raise RuntimeError(f"aoti lowering left k3 ops {sorted(left & done)} in the graph")
    return lowered, {"compiled_in": {n: before[n] for n in sorted(done)}, "extern": dict(sorted(extern.items())),
                     "launches": triton_launches(lowered.graph_module)}


def _retrace(ep: torch.export.ExportedProgram, lower: dict) -> torch.export.ExportedProgram:
    from k3export.plugins.launch import traced_launches
    if not lower:
        return ep
    for op, rule in lower.items():
        _register(op)
        _ACTIVE[op] = rule
    try:
        with traced_launches():
            return ep.run_decompositions({})
    finally:
        _ACTIVE.clear()
