"""FP8 in ONNX: the Q/DQ translation of `k3::fp8_linear`, as TensorRT's strongly-typed builds expect.

One FP8 GEMM becomes

    x --QuantizeLinear(s_x, float8e4m3fn)--DequantizeLinear(s_x)--+
                                                                    MatMul --> y
    W (float8e4m3fn initializer) --DequantizeLinear(s_w, axis 0)--Transpose--+

so each quantized linear adds exactly one QuantizeLinear and two DequantizeLinear nodes, the weight is stored
as FP8 with its fp32 scales, and high-precision linears stay plain MatMul/Gemm. onnxruntime (CPU) executes
these nodes, which makes it a numerics oracle for the FP8 graphs. `TRANSLATIONS` is the table an exporter
passes to `torch.onnx.export(..., custom_translation_table=...)`; `export_qdq` exports a module with it.

Whole FP8 graphs (`export_fp8_graph`): the export stage's prefill/decode wrappers around an FP8 model give a
`.pt2` (torch.export, k3 ops opaque, `k3::fp8_linear` and `k3::moe_routed_fp8` among them) and an ONNX file whose
linears are Q/DQ and whose FP8 expert banks feed one bare `k3.moe_routed_fp8` node with E4M3 weight inputs (the
TensorRT plugin's contract). onnxruntime has no kernel for that node: `onnx_export.OrtGraph` runs it as a Python
op on the torch reference (E4M3 weights handed over as bytes), so `k3export verify` checks a float32 FP8 export's
whole ONNX against the re-quantized eager model.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import torch
from onnxscript import opset19 as op

import k3export.fp8_moe  # noqa: F401  (registers k3::fp8_linear and k3::moe_routed_fp8)

OPSET = 20      # as the export stage; Q/DQ-19 carries float8e4m3fn (zero point, per-axis scales)


def fp8_linear_onnx(x, x_scale, w, w_scale):
    """x `[M, K]` in the model dtype, x_scale `[]` fp32, w `[N, K]` E4M3, w_scale `[N]` or `[]` fp32 -> `[M, N]` in
    x's dtype. QuantizeLinear-19 needs x and its scale of one type and DequantizeLinear yields the scale's type
    (fp32), so a bf16/fp16 x is cast to fp32 first and the product cast back (as the reference: fp32 math)."""
    F = onnx.TensorProto.FLOAT
    low = getattr(x, "dtype", None) != F                              # model dtype not fp32 (or unknown here)
    xf = op.Cast(x, to=F) if low else x
    zero = op.Constant(value=onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0]))
    xd = op.DequantizeLinear(op.QuantizeLinear(xf, x_scale, zero), x_scale)
    wd = op.DequantizeLinear(w, w_scale, axis=0)                     # [N, K], per output channel or per tensor
    y = op.MatMul(xd, op.Transpose(wd, perm=[1, 0]))                  # [M, N] fp32
    return op.CastLike(y, x) if low else y


TRANSLATIONS = {torch.ops.k3.fp8_linear.default: fp8_linear_onnx}


def export_qdq(module: torch.nn.Module, args: tuple, path: str | Path, dynamic_shapes=None) -> Path:
    """Export `module` (with FP8Linear swapped in) to an ONNX file with Q/DQ nodes; returns the path."""
    prog = torch.onnx.export(module, args, dynamo=True, opset_version=OPSET, custom_translation_table=TRANSLATIONS,
                             dynamic_shapes=dynamic_shapes, verbose=False, optimize=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prog.save(str(path))   # optimize=False: no CSE merging the Q/DQ pairs of linears that share an input
    return path


def qdq_census(model: onnx.ModelProto) -> dict:
    """Counts of Q/DQ nodes and of FP8 initializers (weights stored as float8e4m3fn)."""
    ops = Counter(n.op_type for n in model.graph.node)
    fp8 = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN and i.dims]
    return {"QuantizeLinear": ops["QuantizeLinear"], "DequantizeLinear": ops["DequantizeLinear"],
            "MatMul": ops["MatMul"] + ops["Gemm"], "fp8_weights": sorted(fp8)}


def run_onnx(path: str | Path, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Run an exported graph with onnxruntime on CPU (the numerics oracle)."""
    import onnxruntime as ort
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(sess.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in sess.run(None, feeds)]


def register_fp8_schemas() -> None:
    """The `k3.moe_routed_fp8` node schema (idempotent): floats T (activations), Z (latent), F (fp32 router bias,
    scales), E4M3 Q (expert weights)."""
    from onnx.defs import OpSchema
    from k3export.onnx_export import FP8_SIGNATURES
    if onnx.defs.has("moe_routed_fp8", "k3"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    P = OpSchema.FormalParameter
    AT = OpSchema.AttrType
    ins, outs, attrs = FP8_SIGNATURES["moe_routed_fp8"]
    onnx.defs.register_schema(OpSchema(
        "moe_routed_fp8", "k3", 1, doc="k3::moe_routed_fp8; see k3export/fp8_moe.py",
        inputs=[P(*p.split(":")) for p in ins], outputs=[P(*p.split(":")) for p in outs],
        type_constraints=[("T", floats, ""), ("Z", floats, ""), ("F", floats, ""),
                          ("Q", ["tensor(float8e4m3fn)"], "E4M3 weights")],
        attributes=[OpSchema.Attribute(a, AT.INT if t is int else AT.FLOAT, "") for a, t in attrs.items()]))


def moe_routed_fp8_onnx(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k: int,
                        renormalize: bool, scaling: float, beta: float, linear_beta: float):
    import onnxscript
    k3 = onnxscript.values.Opset("k3", 1)
    return k3.moe_routed_fp8(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k=top_k,
                             renormalize=int(renormalize), scaling=scaling, beta=beta, linear_beta=linear_beta)


def fp8_translations() -> dict:
    """The FP8 ops' entries of a `torch.onnx.export` translation table (`k3::fp8_linear` as Q/DQ + MatMul,
    `k3::moe_routed_fp8` as one bare `k3` node); registers the node schema for the ONNX checker."""
    register_fp8_schemas()
    return {**TRANSLATIONS, torch.ops.k3.moe_routed_fp8.default: moe_routed_fp8_onnx}


def export_fp8_graph(model: torch.nn.Module, out: str | Path, graph: str = "decode") -> dict:
    """Export `graph` ('prefill' or 'decode') of an FP8 model (after `quantize_model`) to `<out>/<graph>_fp8.pt2`
    and `<out>/<graph>_fp8.onnx`. Returns {'pt2', 'onnx', 'args' (the example inputs), 'census'}."""
    from k3export.export import (EXAMPLE, DecodeGraph, ExportLimits, PrefillGraph, dynamic_shapes, example_inputs,
                                 io_specs)
    from k3export.onnx_export import translation_table
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = io_specs(model.config, model.dtype)[graph]["inputs"]
    args = tuple(example_inputs(spec, EXAMPLE, vocab=model.config.vocab_size).values())
    wrapper = (DecodeGraph if graph == "decode" else PrefillGraph)(model).eval()
    with torch.no_grad():
        ep = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes(spec, ExportLimits()))
    pt2 = out / f"{graph}_fp8.pt2"
    torch.export.save(ep, pt2)
    table = {**translation_table(), **fp8_translations()}
    prog = torch.onnx.export(ep, dynamo=True, opset_version=OPSET, custom_translation_table=table, optimize=False,
                             verbose=False)
    path = out / f"{graph}_fp8.onnx"
    prog.save(str(path))
    return {"pt2": pt2, "onnx": path, "args": args, "census": qdq_census(onnx.load(str(path)))}
