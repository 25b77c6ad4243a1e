"""Stage `onnx`: the exported programs of a graph directory -> `prefill.onnx` and `decode.onnx`.

Each k3 op becomes one bare node: domain `k3`, op_type = the plugin name (`kda_prefill`, `kda_decode`,
`mla_prefill`, `mla_decode`, `moe_routed`, `attn_res`), the op's scalar arguments as attributes (bools as
ints). That is what a TensorRT plugin is matched on. The node schemas are registered with `onnx.defs` (domain
`k3`, version 1), so the model is checker-clean with `full_check`. Opset 20 for everything else; graph inputs
and outputs carry the names and the named dynamic axes of the manifest; weights go to `<graph>.onnx.data` when
the initializers exceed `EXTERNAL_BYTES`. A meta-device export (no weights) gives a structure-only ONNX in which
every weight is a named graph input.

Execution on CPU (`OrtGraph`): onnxruntime with the k3 ops registered as Python custom ops through
onnxruntime-extensions, whose implementations call our references (`torch.ops.k3.*` on CPU). Its PyOps live in
the fixed domain `ai.onnx.contrib` and take fp32 tensors only, so the session gets an in-memory copy whose k3
nodes are moved to that domain (the file on disk keeps `k3`); bf16/fp16 graphs cannot run there.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import click
import torch

from k3export.export import OUTPUTS
from k3export.manifest import check_graph_files, load_manifest, write_manifest

OPSET = 20
DOMAIN = "k3"
EXTERNAL_BYTES = 256 << 20
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
# op -> (inputs as name:type-var, outputs as name:type-var, attributes); type var I is int64, all others float.
# Inputs that may differ in dtype in a bf16 graph (fp32 state, fp32 gate parameters) get their own type var.
SIGNATURES: dict[str, tuple[list[str], list[str], dict[str, type]]] = {
    "kda_prefill": (["q:T", "k:T", "v:T", "f:T", "b:T", "A_log:F", "dt_bias:F", "initial_state:S", "lengths:I"],
                    ["o:T", "final_state:S"], {"lower_bound": float}),
    "kda_decode": (["qkv:T", "conv_state:C", "conv_weight:T", "f:T", "b:T", "g:T", "A_log:F", "dt_bias:F",
                    "o_norm_weight:W", "state:S"], ["o:T", "new_conv_state:C", "new_state:S"],
                   {"lower_bound": float, "eps": float}),
    "mla_prefill": (["q:T", "k:T", "v:T", "past_len:I"], ["o:T"], {"scale": float}),
    "mla_decode": (["q:T", "cache:C", "new_row:T", "cache_len:I"], ["o:T"], {"scale": float, "v_dim": int}),
    "moe_routed": (["x:T", "z:Z", "gate_weight:T", "bias:F", "w1:W", "w3:W", "w2:W"], ["u:Z"],
                   {"top_k": int, "renormalize": int, "scaling": float, "beta": float, "linear_beta": float}),
    "attn_res": (["bank:T", "p:P", "norm_weight:W", "proj_weight:W"], ["out:P"], {"eps": float}),
}


def register_schemas() -> None:
    """Register the k3 node schemas with onnx (idempotent)."""
    import onnx
    from onnx.defs import OpSchema
    AT = OpSchema.AttrType
    for op, (ins, outs, attrs) in SIGNATURES.items():
        if onnx.defs.has(op, DOMAIN):
            continue
        tvars = sorted({p.split(":")[1] for p in ins + outs} - {"I"})

        def params(ps):
            return [OpSchema.FormalParameter(p.split(":")[0], "tensor(int64)" if p.endswith(":I") else p.split(":")[1])
                    for p in ps]

        onnx.defs.register_schema(OpSchema(
            op, DOMAIN, 1, doc=f"k3::{op}; see plugins/*/CONTRACT.md", inputs=params(ins), outputs=params(outs),
            type_constraints=[(t, _FLOATS, "float tensor") for t in tvars],
            attributes=[OpSchema.Attribute(a, AT.INT if t is int else AT.FLOAT, "") for a, t in attrs.items()]))


def translation_table() -> dict:
    """torch op -> onnxscript function emitting one bare `k3` node (signatures mirror the torch ops)."""
    import onnxscript
    register_schemas()
    k3 = onnxscript.values.Opset(DOMAIN, 1)

    def kda_prefill(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound: float):
        return k3.kda_prefill(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound=lower_bound)

    def kda_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state, lower_bound: float,
                   eps: float):
        return k3.kda_decode(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state,
                             lower_bound=lower_bound, eps=eps)

    def mla_prefill(q, k, v, past_len, scale: float):
        return k3.mla_prefill(q, k, v, past_len, scale=scale)

    def mla_decode(q, cache, new_row, cache_len, scale: float, v_dim: int):
        return k3.mla_decode(q, cache, new_row, cache_len, scale=scale, v_dim=v_dim)

    def moe_routed(x, z, gate_weight, bias, w1, w3, w2, top_k: int, renormalize: bool, scaling: float, beta: float,
                   linear_beta: float):
        return k3.moe_routed(x, z, gate_weight, bias, w1, w3, w2, top_k=top_k, renormalize=int(renormalize),
                             scaling=scaling, beta=beta, linear_beta=linear_beta)

    def attn_res(bank, p, norm_weight, proj_weight, eps: float):
        return k3.attn_res(bank, p, norm_weight, proj_weight, eps=eps)

    fns = (kda_prefill, kda_decode, mla_prefill, mla_decode, moe_routed, attn_res)
    return {getattr(torch.ops.k3, f.__name__).default: f for f in fns}


def export_onnx(graph_dir: str | Path, log=print) -> dict:
    """Convert both graphs of `graph_dir` to ONNX beside them; records an `onnx` entry in the manifest."""
    import onnx
    graph_dir = Path(graph_dir)
    manifest = load_manifest(graph_dir)
    check_graph_files(graph_dir, manifest)
    table = translation_table()
    fp8 = bool(manifest.get("quant"))
    if fp8:                     # FP8 graphs: fp8_linear -> Q/DQ around a MatMul, moe_routed_fp8 -> one bare k3 node
        from k3export.fp8_onnx import fp8_translations
        table.update(fp8_translations())
    entry = {"opset": OPSET, "domain": DOMAIN, "graphs": {}}
    for name, g in manifest["graphs"].items():
        ep = torch.export.load(graph_dir / g["file"])
        t0 = time.perf_counter()
        prog = torch.onnx.export(ep, dynamo=True, opset_version=OPSET, custom_translation_table=table,
                                 output_names=list(OUTPUTS), optimize=not (manifest["meta"] or fp8), verbose=False)
        # (FP8: no optimizer, whose CSE would merge the Q/DQ pairs of linears sharing an input: one pair per GEMM)
        convert_s = time.perf_counter() - t0
        path = graph_dir / f"{name}.onnx"
        weight_bytes = sum(p.numel() * p.element_size() for p in ep.state_dict.values())
        external = weight_bytes > EXTERNAL_BYTES
        for stale in (path, path.with_name(path.name + ".data")):
            stale.unlink(missing_ok=True)
        if manifest["meta"]:      # no weights to write: they become named graph inputs (structure only)
            prog.save(str(path), include_initializers=False, keep_initializers_as_inputs=True)
        else:
            prog.save(str(path), external_data=external)
        passes = _postprocess(path, ep, g["inputs"])
        onnx.checker.check_model(str(path), full_check=True)
        counts = k3_node_counts(onnx.load(str(path), load_external_data=False))
        want = {op: n for op, n in g["k3_ops"].items() if op != "fp8_linear"}           # those became Q/DQ
        if counts != want:
            raise RuntimeError(f"{name}.onnx has k3 nodes {counts}, the exported program has {want}")
        total_s = time.perf_counter() - t0
        entry["graphs"][name] = {"file": path.name, "external_data": external and not manifest["meta"], "passes": passes,
                                 "weights_as_inputs": manifest["meta"], "k3_nodes": counts,
                                 "convert_s": round(convert_s, 2), "total_s": round(total_s, 2)}
        log(f"onnx {name}: {sum(counts.values())} k3 nodes {counts}, passes {passes}, checker clean, in {total_s:.1f}s -> {path}"
            + (f" (+ {path.name}.data)" if entry["graphs"][name]["external_data"] else ""))
    manifest["onnx"] = entry
    write_manifest(graph_dir, manifest)
    return entry


def k3_node_counts(model) -> dict[str, int]:
    """`{op_type: count}` of the k3-domain nodes of an onnx ModelProto."""
    counts: dict[str, int] = {}
    for n in model.graph.node:
        if n.domain == DOMAIN:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return dict(sorted(counts.items()))


def _postprocess(path: Path, ep, input_specs: list[dict]) -> dict[str, int]:
    """Two passes over the saved model; returns how many items each changed."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    changed = {"axes named": _name_axes(model, ep, input_specs), "bf16 Einsum -> fp32": _fp32_einsum(model)}
    onnx.save(model, str(path))
    return changed


def _fp32_einsum(model) -> int:
    """ONNX Einsum takes bfloat16 only from opset 28 (onnx 1.23's newest); at our opset 20 each bf16 Einsum (the
    MLA decode BMM1/BMM2) runs in fp32 between Casts. fp32 accumulation is what a bf16 GEMM does anyway; the result is rounded back to bf16."""
    import onnx
    from onnx import TensorProto, helper
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    nodes, n_changed = [], 0
    for n in g.node:
        if n.op_type != "Einsum" or n.domain or types.get(n.output[0]) != TensorProto.BFLOAT16:
            nodes.append(n)
            continue
        ins = []
        for i in n.input:
            nodes.append(helper.make_node("Cast", [i], [f"{n.name}_{i}_fp32"], to=TensorProto.FLOAT,
                                          name=f"{n.name}_cast_{i}"))
            ins.append(f"{n.name}_{i}_fp32")
        wide = f"{n.output[0]}_fp32"
        nodes.append(helper.make_node("Einsum", ins, [wide], name=n.name,
                                      equation=onnx.helper.get_attribute_value(n.attribute[0])))
        nodes.append(helper.make_node("Cast", [wide], [n.output[0]], to=TensorProto.BFLOAT16, name=f"{n.name}_cast"))
        n_changed += 1
    del g.node[:]
    g.node.extend(nodes)
    return n_changed


def _name_axes(model, ep, input_specs: list[dict]) -> int:
    """Rename the exporter's symbols (s18, s70 + s35, ...) to the manifest's dim names in every value info."""
    names = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"][-len(input_specs):]
    for node, spec in zip(placeholders, input_specs):
        for d, want in zip(node.meta["val"].shape, spec["shape"]):
            if isinstance(want, str) and isinstance(d, torch.SymInt):
                names[str(d)] = want
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")
    g, n_changed = model.graph, 0
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param:
                new = pattern.sub(lambda m: names[m.group(1)], dim.dim_param)
                n_changed += new != dim.dim_param
                dim.dim_param = new
    return n_changed


# ---------------------------------------------------------------------------------------------- CPU execution
_PYOPS: set[str] = set()
# FP8 graphs' one k3 node (its ONNX schema: `fp8_onnx.register_fp8_schemas`): its expert weights are E4M3 ("Q"), a
# type onnxruntime-extensions' Python ops cannot receive, so `OrtGraph` hands them over as uint8 (the same bytes)
# and the op views them back.
FP8_SIGNATURES = {
    "moe_routed_fp8": (["x:T", "z:Z", "gate_weight:T", "bias:F", "w13:Q", "w2:Q", "w13_scale:F", "w2_scale:F",
                        "z_scale:F", "h_scale:F"], ["u:Z"],
                       {"top_k": int, "renormalize": int, "scaling": float, "beta": float, "linear_beta": float}),
}


def _register_pyops(fp8: bool = False) -> None:
    """Declare each k3 op to onnxruntime-extensions once per process (fp32 tensors, int64 lengths; with fp8 also
    `moe_routed_fp8`, its E4M3 weights as uint8)."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op
    sigs = dict(SIGNATURES)
    if fp8:
        import k3export.fp8_moe  # noqa: F401  (registers k3::moe_routed_fp8)
        sigs.update(FP8_SIGNATURES)
    kinds = {"I": PyCustomOpDef.dt_int64, "Q": PyCustomOpDef.dt_uint8}
    for op, (ins, outs, attrs) in sigs.items():
        if op in _PYOPS:
            continue
        ttype = [kinds.get(p.split(":")[1], PyCustomOpDef.dt_float) for p in ins]
        atype = {a: PyCustomOpDef.dt_int64 if t is int else PyCustomOpDef.dt_float for a, t in attrs.items()}
        e4m3 = [p.endswith(":Q") for p in ins]
        torch_op = getattr(torch.ops.k3, op)
        bools = {"renormalize"}

        def impl(*arrays, _op=torch_op, _e4m3=e4m3, **kw):
            kw = {k: bool(v) if k in bools else v for k, v in kw.items()}
            args = [torch.from_numpy(a.copy()) for a in arrays]
            args = [a.view(torch.float8_e4m3fn) if q else a for a, q in zip(args, _e4m3)]
            out = _op(*args, **kw)
            return tuple(o.numpy() for o in out) if isinstance(out, (tuple, list)) else out.numpy()

        onnx_op(op_type=op, inputs=ttype, outputs=[PyCustomOpDef.dt_float] * len(outs), attrs=atype)(impl)
        _PYOPS.add(op)


def _e4m3_inputs_as_uint8(model, path) -> int:
    """Rewire every E4M3 weight input of the k3 FP8 nodes to a uint8 initializer of the same bytes (see
    FP8_SIGNATURES); returns how many weights were handed over that way."""
    import numpy as np
    from onnx import TensorProto, numpy_helper
    inits = {t.name: t for t in model.graph.initializer}
    made: dict[str, str] = {}
    for n in model.graph.node:
        if n.domain != DOMAIN or n.op_type not in FP8_SIGNATURES:
            continue
        for i, p in enumerate(FP8_SIGNATURES[n.op_type][0]):
            if not p.endswith(":Q"):
                continue
            name = n.input[i]
            t = inits.get(name)
            if t is None or t.data_type != TensorProto.FLOAT8E4M3FN:
                raise ValueError(f"{path}: {n.name} input {p.split(':')[0]} ({name}) is not an E4M3 initializer; "
                                 "the CPU check runs FP8 graphs as `k3export onnx` writes them")
            if name not in made:
                raw = (np.frombuffer(t.raw_data, dtype=np.uint8) if t.raw_data else
                       np.asarray(t.int32_data, dtype=np.uint8))
                u8 = numpy_helper.from_array(raw.reshape(tuple(t.dims)), f"{name}__e4m3_bytes")
                model.graph.initializer.append(u8)
                made[name] = u8.name
            n.input[i] = made[name]
    used = {i for n in model.graph.node for i in n.input}
    keep = [t for t in model.graph.initializer if t.name in used or t.name not in made]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)                   # the E4M3 originals: now unused (onnxruntime warns)
    return len(made)


class OrtGraph:
    """One ONNX graph in an onnxruntime CPU session with the k3 ops as Python custom ops."""

    def __init__(self, path: str | Path):
        import onnx
        import onnxruntime as ort
        from onnxruntime_extensions import default_opset_domain, get_library_path
        model = onnx.load(str(path))
        fp8 = any(n.domain == DOMAIN and n.op_type in FP8_SIGNATURES for n in model.graph.node)
        _register_pyops(fp8)
        if fp8:
            _e4m3_inputs_as_uint8(model, path)
        for t in list(model.graph.input) + list(model.graph.output):
            et = t.type.tensor_type.elem_type
            if et not in (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64):
                raise ValueError(f"{path}: {t.name} is {onnx.TensorProto.DataType.Name(et)}; the CPU check runs "
                                 "fp32 graphs only (export with --dtype float32)")
        for n in model.graph.node:
            if n.domain == DOMAIN:
                n.domain = default_opset_domain()
        for imp in model.opset_import:
            if imp.domain == DOMAIN:
                imp.domain = default_opset_domain()
        so = ort.SessionOptions()
        so.log_severity_level = 3      # errors only: its constant folding warns of every CastLike it cannot fold
        so.register_custom_ops_library(get_library_path())
        self.session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        feed = {n: inputs[n].contiguous().numpy() for n in self.inputs}
        return {n: torch.from_numpy(a) for n, a in zip(self.outputs, self.session.run(None, feed))}


@click.command("onnx")
@click.option("--graphs", "graph_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Graph directory written by `k3export export`.")
def onnx_cmd(graph_dir):
    """Convert prefill.pt2 and decode.pt2 to ONNX (opset 20, k3 ops as bare `k3` nodes), checker-clean."""
    from k3export.manifest import ManifestError
    t0 = time.perf_counter()
    try:
        export_onnx(graph_dir, log=click.echo)
    except ManifestError as e:
        raise click.ClickException(str(e))
    click.echo(f"onnx: done in {time.perf_counter() - t0:.1f}s")
