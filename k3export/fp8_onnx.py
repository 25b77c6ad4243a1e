"""FP8 in ONNX: the Q/DQ translation of `k3::fp8_linear`, as TensorRT's strongly-typed builds expect.

One FP8 GEMM becomes

    x --QuantizeLinear(s_x, float8e4m3fn)--DequantizeLinear(s_x)--+
                                                                    MatMul --> y
    W (float8e4m3fn initializer) --DequantizeLinear(s_w, axis 0)--Transpose--+

so each quantized linear adds exactly one QuantizeLinear and two DequantizeLinear nodes, the weight is stored
as FP8 with its fp32 scales, and high-precision linears stay plain MatMul/Gemm. onnxruntime (CPU) executes
these nodes, which makes it a numerics oracle for the FP8 graphs. `TRANSLATIONS` is the table an exporter
passes to `torch.onnx.export(..., custom_translation_table=...)`; `export_qdq` exports a module with it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import torch
from onnxscript import opset21 as op

OPSET = 21      # QuantizeLinear/DequantizeLinear with float8e4m3fn and a scalar zero point


def fp8_linear_onnx(x, x_scale, w, w_scale):
    zero = op.Constant(value=onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0]))
    xd = op.DequantizeLinear(op.QuantizeLinear(x, x_scale, zero), x_scale)
    wd = op.DequantizeLinear(w, w_scale, axis=0)                     # [N, K], per output channel or per tensor
    return op.MatMul(xd, op.Transpose(wd, perm=[1, 0]))


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
