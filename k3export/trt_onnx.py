"""The ONNX of `k3export onnx` rewritten for TensorRT's parser: each k3 op node (one per op) becomes the AOT plugin
nodes of its kernel launches, as `plugins/<op>/trt.py` registers them.

TensorRT makes a node the plugin named by its op_type in its domain, and an AOT plugin only with the attribute
aot=1 (docs/deployment-notes.md). Per op:

    kda_decode  -> k3::kda_decode (the same node, aot=1)
    mla_prefill -> k3::mla_prefill (the same node, aot=1)
    kda_prefill -> k3::kda_prefill_intra (w, u, qg, kd, aqk, gl) -> k3::kda_prefill_chunks (o padded to whole
                   chunks, final_state) -> Slice of o back to the prompt's T tokens
    mla_decode  -> k3::mla_decode_split (o_part, lse_part; num_splits fixed at build time, the `aoti` rule at the
                   largest cache) -> k3::mla_decode_combine
    moe_routed  -> up to 4096 (token, expert) pairs at `max_tokens` (the graph's largest token count: decode
                   batch, or prefill batch x tokens): k3::moe_router -> moe_topk -> moe_align -> moe_gemm1 ->
                   moe_gemm2 -> moe_combine; beyond: k3::moe_router -> moe_topk -> moe_count -> moe_plan ->
                   moe_scatter -> moe_gemm1 -> moe_gemm2 -> moe_combine (`plugins/moe/trt.py` `chain_steps`); the
                   align plugins carry the GEMMs' block rows (block_rows)
    moe_routed_fp8 (E4M3 experts, `export --scales` graphs) -> the same routing and align plugins, then up to 4
                   pairs per expert at max_tokens (weight-only) k3::moe_fp8_wo_gemm1 -> moe_fp8_wo_gemm2, beyond
                   (W8A8) k3::moe_fp8_quant -> moe_fp8_gemm1 -> moe_fp8_gemm2; then k3::moe_combine
                   (`plugins/moe/trt_fp8.py` `fp8_chain_steps`)
    fp8_linear  -> nothing to rewrite: the FP8 export writes Q/DQ nodes, which TensorRT takes natively
    attn_res    -> standard ONNX ops in fp32 (RMS of each source, its dot with norm_weight * proj_weight, softmax
                   over the sources, the weighted sum; cast back to p's dtype): TensorRT fuses such graphs itself

Written against TensorRT's rules and checked here against the registrations' signatures (tests, the
`tensorrt.plugin` stand-in) and, for the AttnRes ops, with onnxruntime; never parsed by TensorRT (not installable).
"""

from __future__ import annotations

import numpy as np

AOT_SAME = {"kda_decode", "mla_prefill"}
MOE_DECODE_MAX_PAIRS = 4096  # plugins/moe/trt.py: the decode chain's one-program align; beyond, the prefill chain


class Rewriter:
    """Builds the replacement nodes; constants become initializers with unique names."""

    def __init__(self, model, helper, numpy_helper):
        self.model, self.h, self.nh = model, helper, numpy_helper
        self.n = 0
        self.consts: dict = {}               # (dtype, values) -> initializer name: one per distinct constant

    def name(self, base: str) -> str:
        self.n += 1
        return f"trt_{self.n}_{base}"

    def const(self, base: str, values, dtype=np.int64) -> str:
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.consts:
            self.consts[key] = self.name(base)
            self.model.graph.initializer.append(self.nh.from_array(arr, self.consts[key]))
        return self.consts[key]

    def node(self, op: str, inputs, outputs=None, domain: str = "", **attrs):
        outputs = outputs or [self.name(op.lower())]
        return self.h.make_node(op, list(inputs), list(outputs), domain=domain, name=self.name(op), **attrs), outputs


def _attrs(node, helper) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _shape_of(model, name: str) -> list[int] | None:
    """Static dims of an initializer or graph input (a weight), None when not found."""
    for t in model.graph.initializer:
        if t.name == name:
            return list(t.dims)
    for v in model.graph.input:
        if v.name == name:
            return [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
    return None


def _attn_res_ops(rw: Rewriter, node, dtype: int):
    """The AttnRes mix as standard ONNX ops (opset >= 18), fp32 inside, out in `dtype` (p's, the model dtype)."""
    import onnx
    bank, p, norm_w, proj_w = node.input
    eps = _attrs(node, rw.h)["eps"]
    nodes = []

    def add(op, inputs, **attrs):
        n, outs = rw.node(op, inputs, **attrs)
        nodes.append(n)
        return outs[0]
    f32 = onnx.TensorProto.FLOAT
    V = add("Concat", [add("Cast", [bank], to=f32), add("Unsqueeze", [add("Cast", [p], to=f32),
                                                                       rw.const("axis1", [1])])], axis=1)
    g = add("Mul", [add("Cast", [norm_w], to=f32), add("Reshape", [add("Cast", [proj_w], to=f32),
                                                                   rw.const("flat", [-1])])])
    last = rw.const("axis_last", [-1])
    ms = add("ReduceMean", [add("Mul", [V, V]), last], keepdims=0)                        # [N, n + 1]
    r = add("Reciprocal", [add("Sqrt", [add("Add", [ms, rw.const("eps", eps, np.float32)])])])
    s = add("Mul", [r, add("ReduceSum", [add("Mul", [V, g]), last], keepdims=0)])
    a = add("Unsqueeze", [add("Softmax", [s], axis=1), last])                             # [N, n + 1, 1]
    mixed = add("ReduceSum", [add("Mul", [V, a]), rw.const("axis1", [1])], keepdims=0)
    n, _ = rw.node("Cast", [mixed], outputs=[node.output[0]], to=dtype)
    return nodes + [n]


def _plugin(rw: Rewriter, op: str, inputs, outputs, **attrs):
    n, _ = rw.node(op, inputs, outputs, domain="k3", aot=1, **attrs)
    return n


ONNX_TORCH = {1: "float32", 16: "bfloat16", 10: "float16"}     # onnx.TensorProto element types -> torch dtype names


def _moe_chain(rw: Rewriter, model, node, at: dict, dtype: int, max_tokens: int) -> list:
    """The plugin nodes of one `moe_routed` (bf16 / fp16 experts: `plugins/moe/trt.py`) or `moe_routed_fp8` (E4M3
    experts: `plugins/moe/trt_fp8.py`) node: routing, the align plugins (one-program up to MOE_DECODE_MAX_PAIRS
    pairs at max_tokens, chunked beyond) with the expert GEMMs' block rows, the expert GEMMs, the combine."""
    import torch
    from k3export.plugins.moe import trt, trt_fp8
    fp8 = node.op_type == "moe_routed_fp8"
    if fp8:
        x, z, gw, bias, w13, w2, s13, s2, z_scale, h_scale = node.input
        w_first = w13
    else:
        x, z, gw, bias, w1, w3, w2 = node.input
        w_first = w1
    top_k = int(at["top_k"])
    E = next((sh[0] for sh in (_shape_of(model, gw), _shape_of(model, w_first)) if sh and sh[0] > 0), None)
    if E is None:
        raise ValueError(f"{node.op_type}: the number of experts is not a static shape of {gw} or {w_first} "
                         "(initializers or graph inputs): the align plugin needs it")
    if fp8:
        rows = trt_fp8.block_rows(max_tokens, top_k, E)
    else:
        rows = trt.chain_tiles(max_tokens, top_k, getattr(torch, ONNX_TORCH.get(dtype, "bfloat16")), E).rows
    part, ids, w, s, row_pair, block_expert, y = (rw.name(n) for n in (
        "part", "ids", "w", "s", "row_pair", "block_expert", "y"))
    common = dict(max_tokens=max_tokens, top_k=top_k)
    experts = dict(**common, num_experts=int(E), block_rows=int(rows))
    act = dict(beta=float(at["beta"]), linear_beta=float(at["linear_beta"]))
    if max_tokens * top_k <= MOE_DECODE_MAX_PAIRS:
        align = [_plugin(rw, "moe_align", [ids], [row_pair, block_expert, rw.name("off")], **experts)]
    else:
        hist, rank, base, end = (rw.name(n) for n in ("hist", "rank", "base", "end"))
        align = [_plugin(rw, "moe_count", [ids], [hist, rank], **experts),
                 _plugin(rw, "moe_plan", [hist, ids], [base, block_expert, end], **experts),
                 _plugin(rw, "moe_scatter", [ids, rank, base, block_expert, end], [row_pair], **experts)]
    if not fp8:
        h = rw.name("h")
        gemms = [_plugin(rw, "moe_gemm1", [z, w1, w3, row_pair, block_expert], [h], **common, **act),
                 _plugin(rw, "moe_gemm2", [h, w2, row_pair, block_expert, ids], [y], **common)]
    elif trt_fp8.weight_only(max_tokens, top_k, E):
        h = rw.name("h")
        gemms = [_plugin(rw, "moe_fp8_wo_gemm1", [z, w13, s13, row_pair, block_expert], [h], **common, **act),
                 _plugin(rw, "moe_fp8_wo_gemm2", [h, w2, s2, row_pair, block_expert, ids], [y], **common)]
    else:
        zq, z_rows, hq = rw.name("zq"), rw.name("z_rows"), rw.name("hq")
        gemms = [_plugin(rw, "moe_fp8_quant", [z, z_scale], [zq, z_rows], **common),
                 _plugin(rw, "moe_fp8_gemm1", [zq, z_scale, w13, s13, h_scale, row_pair, block_expert, z], [hq],
                         **common, **act),
                 _plugin(rw, "moe_fp8_gemm2", [hq, h_scale, w2, s2, row_pair, block_expert, z], [y], **common)]
    return [_plugin(rw, "moe_router", [x, gw], [part], **common),
            _plugin(rw, "moe_topk", [part, bias], [ids, w, s], **common, renormalize=int(at["renormalize"]),
                    scaling=float(at["scaling"])),
            *align, *gemms,
            _plugin(rw, "moe_combine", [y, w, z], node.output, **common)]


def rewrite(model, graph: str, dtype: int, max_tokens: int, mla_splits: int) -> tuple[object, dict[str, int]]:
    """(a copy of the ONNX model with its k3 nodes rewritten, plugin or op -> nodes made). graph: "prefill" or
    "decode"; dtype: the model's ONNX element type (AttnRes output); max_tokens: the most tokens the graph's MoE
    sees (decode: the profile's largest batch; prefill: largest batch x tokens): the MoE chain's PTX serves up to
    it, and it picks the chain; mla_splits: the MLA decode split count (`aoti_lower.mla_decode_splits` at the
    largest cache). Raises ValueError where the experts' count is not a static shape."""
    import onnx
    from onnx import helper, numpy_helper
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rw = Rewriter(out, helper, numpy_helper)
    made: dict[str, int] = {}
    new_nodes = []
    for node in model.graph.node:
        op = node.op_type
        if node.domain != "k3":
            new_nodes.append(node)
            continue
        at = _attrs(node, helper)
        if op in AOT_SAME:
            reps = [_plugin(rw, op, node.input, node.output, **at)]
        elif op == "attn_res":
            reps = _attn_res_ops(rw, node, dtype)
        elif op == "kda_prefill":
            q, k, v, f, b, A_log, dt_bias, init, lengths = node.input
            mid = [rw.name(n) for n in ("w", "u", "qg", "kd", "aqk", "gl")]
            o_pad = rw.name("o_padded")
            t = rw.name("T")
            reps = [_plugin(rw, "kda_prefill_intra", [q, k, v, f, b, A_log, dt_bias, lengths], mid,
                            lower_bound=at["lower_bound"]),
                    _plugin(rw, "kda_prefill_chunks", [*mid, init, lengths], [o_pad, node.output[1]]),
                    rw.node("Shape", [q], [t], start=1, end=2)[0],
                    rw.node("Slice", [o_pad, rw.const("zero", [0]), t, rw.const("axis1", [1])], [node.output[0]])[0]]
        elif op == "mla_decode":
            q, cache, new_row, cache_len = node.input
            parts = [rw.name("o_part"), rw.name("lse_part")]
            reps = [_plugin(rw, "mla_decode_split", [q, cache, cache_len], parts, scale=at["scale"],
                            v_dim=at["v_dim"], num_splits=int(mla_splits)),
                    _plugin(rw, "mla_decode_combine", [q, new_row, *parts], node.output, scale=at["scale"],
                            v_dim=at["v_dim"])]
        elif op in ("moe_routed", "moe_routed_fp8"):
            reps = _moe_chain(rw, model, node, at, dtype, int(max_tokens))
        else:
            new_nodes.append(node)                  # unknown k3 op: left for plugin_gaps to name
            continue
        for r in reps:
            key = f"{r.domain}::{r.op_type}" if r.domain else r.op_type
            made[key] = made.get(key, 0) + 1
        new_nodes.extend(reps)
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    return out, made
