"""FP8 inference: the E4M3 GEMM op against an fp64 recomputation, FP8 linears and expert banks swapped into the
model, FP8 artifacts re-loaded from disk (eager state dict and Q/DQ ONNX run by onnxruntime), Q/DQ counts as the
recipe says, the weight-only (decode) references against W8A8, and the Triton kernels (weight-only FP8 linear,
weight-only and W8A8 grouped FP8 experts) against their references (CPU interpreter; real GPU under `cuda`).

Errors are relative: ||out - ref|| / ||ref|| unless named otherwise.
"""

from __future__ import annotations

import json
import os

if __name__ == "__main__":  # the interpreter run (see `test_fp8_kernels_interpreter`): set before triton loads
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.calibrate import DEFAULT_RECIPE, Recipe, calibrate, default_batches
from k3export.config import K3Config
from k3export.fp8 import (FP8, FP8Linear, fp8_linear_ref, fp8_linear_wo_ref, quantize, quantize_model,
                          scale_from_amax, weight_amax)
from k3export.fp8_moe import FP8ExpertBank, FP8LatentMoE, expert_weight_scales, moe_fp8_sorted, moe_fp8_wo_ref
from k3export.model.weights import random_model

CFG = K3Config.from_name("k3-tiny")
# fp32 sums vs fp64 sums of the same exactly-representable E4M3 products.
FP32_BOUND = 1e-6
# One E4M3 GEMM vs the unquantized one on Gaussian data: 3 mantissa bits round x and W each by <= 2^-4
# relative (~2.5% RMS each); measured 3.6-3.7% over 10 random 64x256x128 cases.
FP8_GEMM_BOUND = 0.05
# The FP8 model's decode path vs its own prefill path: the same quantized GEMMs on the same rows, fp32
# reordering only (chunked vs recurrent KDA, expanded vs absorbed MLA); measured 2e-7.
PATH_BOUND = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def scales():
    m = random_model(CFG, seed=0)
    return calibrate(m, Recipe.load(DEFAULT_RECIPE), default_batches(CFG.vocab_size, 2, 8, 2), progress=False)


@pytest.fixture(scope="module")
def fp8_model(scales):
    m = random_model(CFG, seed=0)
    quantize_model(m, scales)
    return m


# ------------------------------------------------------------------------------------------------ the GEMM
def test_quantize_saturates_and_zero_tensors_get_unit_scale():
    s = torch.tensor(1.0)
    q = quantize(torch.tensor([1000.0, -1000.0, 0.3]), s)
    assert q.dtype == FP8 and q.float().tolist() == [448.0, -448.0, 0.3125]
    assert scale_from_amax(torch.tensor(0.0)).item() == 1.0


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_reference_matches_fp64_recomputation(per_channel):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 48, generator=g), torch.randn(40, 48, generator=g) / 7
    xs, ws = scale_from_amax(x.abs().max() * 0.8), scale_from_amax(weight_amax(w, per_channel))   # some saturate
    wq = quantize(w, ws[:, None] if per_channel else ws)
    y = fp8_linear_ref(x, xs, wq, ws)
    xd = (x.double() / xs.double()).clamp(-448, 448).to(FP8).double() * xs.double()
    wd = wq.double() * (ws.double()[:, None] if per_channel else ws.double())
    assert rel(y, xd @ wd.T) < FP32_BOUND


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_module_error_is_fp8_sized(per_channel):
    g = torch.Generator().manual_seed(2)
    errs = []
    for _ in range(5):
        lin = torch.nn.Linear(256, 128, bias=False)
        torch.nn.init.normal_(lin.weight, std=256 ** -0.5, generator=g)
        x = torch.randn(64, 256, generator=g)
        f = FP8Linear.from_linear(lin, scale_from_amax(x.abs().max()),
                                  scale_from_amax(weight_amax(lin.weight, per_channel)))
        assert f.qweight.dtype == FP8 and f(x).dtype == x.dtype
        errs.append(rel(f(x), lin(x)))
    assert max(errs) < FP8_GEMM_BOUND, errs
    assert min(errs) > 1e-3            # it really is quantized


def test_weight_only_gemm_error_is_the_weight_rounding_alone():
    # decode on CUDA runs weight-only: its only error is W's E4M3 rounding, so it sits below W8A8's (x rounded too)
    g = torch.Generator().manual_seed(6)
    wo, w8a8 = [], []
    for _ in range(5):
        x, w = torch.randn(16, 256, generator=g), torch.randn(128, 256, generator=g) / 16
        ws, xs = scale_from_amax(weight_amax(w, True)), scale_from_amax(x.abs().max())
        wq = quantize(w, ws[:, None])
        wo.append(rel(fp8_linear_wo_ref(x, wq, ws), x @ w.T))
        w8a8.append(rel(fp8_linear_ref(x, xs, wq, ws), x @ w.T))
    assert max(wo) < FP8_GEMM_BOUND and all(a < b for a, b in zip(wo, w8a8)), (wo, w8a8)


def test_weight_only_kernel_rejects_bad_inputs():
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    w, s = torch.zeros(8, 32, dtype=FP8), torch.ones(8)
    with pytest.raises(ValueError, match="K=16"):
        fp8_linear_wo_fwd(torch.randn(2, 16), w, s)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_linear_wo_fwd(torch.randn(2, 32), w, torch.ones(4))
    with pytest.raises(ValueError, match="M=65"):
        fp8_linear_wo_fwd(torch.randn(65, 32), w, s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_wo_fwd(torch.randn(2, 32), w.float(), s)


# ------------------------------------------------------------------------------------------------ the model
def test_quantize_model_swaps_exactly_the_recipe_modules(fp8_model):
    m = fp8_model
    n_linear = sum(isinstance(x, FP8Linear) for x in m.modules())
    assert n_linear == 88 and sum(isinstance(x, FP8ExpertBank) for x in m.modules()) == 8
    kda, mla, moe = m.model.layers[0].self_attn, m.model.layers[3].self_attn, m.model.layers[1].block_sparse_moe
    for lin in (kda.f_a_proj, kda.f_b_proj, kda.b_proj, mla.kv_b_proj, m.lm_head):
        assert type(lin) is torch.nn.Linear and lin.weight.dtype == torch.float32
    assert isinstance(moe, FP8LatentMoE) and moe.experts.w13.dtype == FP8 and moe.gate.weight.dtype == torch.float32
    assert kda.A_log.dtype == torch.float32 and m.model.layers[0].input_layernorm.weight.dtype == torch.float32


def test_fp8_model_decode_matches_its_prefill(fp8_model):
    ids = default_batches(CFG.vocab_size, 2, 6, 2, seed=5678)[0]
    full = fp8_model(ids)
    assert torch.isfinite(full).all()
    st = fp8_model.new_state(2, 6)
    fp8_model.prefill(ids[:, :5], st)
    last = fp8_model.decode(ids[:, 5], st)
    assert rel(last, full[:, 5]) < PATH_BOUND


def test_fp8_state_dict_reloaded_from_disk_runs_identically(tmp_path, fp8_model, scales):
    from safetensors.torch import load_file, save_file
    sd = {k: v.contiguous() for k, v in fp8_model.state_dict().items()}
    assert sd["model.layers.1.block_sparse_moe.experts.w13"].dtype == FP8
    save_file(sd, str(tmp_path / "fp8.safetensors"))
    fresh = random_model(CFG, seed=7)                      # other weights, same structure once quantized
    quantize_model(fresh, scales)
    fresh.load_state_dict(load_file(str(tmp_path / "fp8.safetensors")))
    ids = default_batches(CFG.vocab_size, 1, 6, 1, seed=5678)[0]
    assert torch.equal(fresh(ids), fp8_model(ids))


# ------------------------------------------------------------------------------------------------ ONNX Q/DQ
def _mlp_recipe(quantize_names):
    return Recipe.from_dict({"name": "t", "quantize": [f"model.layers.0.mlp.{n}" for n in quantize_names],
                             "keep": {}})


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("up_proj",)])
def test_qdq_nodes_sit_exactly_where_the_recipe_says_and_the_graph_reloads(tmp_path, names):
    import onnx

    from k3export.fp8_onnx import export_qdq, qdq_census, run_onnx
    m = random_model(CFG, seed=0)
    s = calibrate(m, _mlp_recipe(names), default_batches(CFG.vocab_size, 1, 4, 1), progress=False)
    assert quantize_model(m, s) == {"linear": len(names), "experts": 0}
    mlp = m.model.layers[0].mlp
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    path = export_qdq(mlp, (x,), tmp_path / "mlp.onnx")
    census = qdq_census(onnx.load(str(path)))                # re-loaded from disk
    assert census["QuantizeLinear"] == len(names) and census["DequantizeLinear"] == 2 * len(names)
    assert census["MatMul"] == 3
    assert census["fp8_weights"] == sorted(f"{n}.qweight" for n in names)
    (y,) = run_onnx(path, x)
    # onnxruntime computes the same E4M3 values; fp32 sums in its own order
    assert rel(y, mlp(x)) < FP32_BOUND


def _run_onnx_16bit(path, x, out_shape):
    """onnxruntime on a bf16/fp16 graph (one input, one output): numpy has no bfloat16, so the bits travel as int16
    in OrtValues tagged with the ONNX element type."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    et = {torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float16: onnx.TensorProto.FLOAT16}[x.dtype]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = np.zeros(out_shape, np.int16)
    b = sess.io_binding()
    b.bind_ortvalue_input(sess.get_inputs()[0].name,
                          ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(torch.int16).numpy(), et))
    b.bind_ortvalue_output(sess.get_outputs()[0].name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, et))
    sess.run_with_iobinding(b)                                  # writes into `out` (the OrtValue wraps its memory)
    return torch.from_numpy(out).view(x.dtype)


# The ONNX graph and the reference both compute in fp32 (own summation orders, ~1e-7) and round once to the
# 16-bit dtype: a rounding flip is at most one ulp of an element, i.e. 2^-7 relative (bf16) or 2^-10 (fp16).
# Measured 0.0 (bit-identical) for both dtypes and both weight-scale kinds at 6x64x32.
ROUND_FLIP_BOUND = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_qdq_linear_in_a_16bit_model_passes_the_onnx_checker_and_runs(tmp_path, dtype, per_channel):
    import onnx

    from k3export.fp8_onnx import export_qdq
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(64, 32, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g))
    x = torch.randn(6, 64, generator=g).to(dtype)
    m = FP8Linear.from_linear(lin, scale_from_amax(x.abs().amax()), scale_from_amax(weight_amax(lin.weight,
                                                                                                per_channel)))
    path = export_qdq(m, (x,), tmp_path / "lin.onnx")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)         # Q/DQ-19 types consistent, shapes inferred
    assert model.graph.output[0].type.tensor_type.elem_type == model.graph.input[0].type.tensor_type.elem_type
    y = _run_onnx_16bit(path, x, (6, 32))
    assert rel(y, m(x)) < ROUND_FLIP_BOUND[dtype]


@pytest.fixture(scope="module")
def fp8_decode(fp8_model, tmp_path_factory):
    """`export_fp8_graph` of the FP8 model's decode graph (.pt2 and ONNX), exported once for the two tests below."""
    from k3export.fp8_onnx import export_fp8_graph
    return export_fp8_graph(fp8_model, tmp_path_factory.mktemp("fp8_decode"))


@pytest.mark.slow
def test_whole_fp8_decode_graph_pt2_reloads_and_onnx_has_qdq_where_the_recipe_says(fp8_decode, fp8_model):
    import collections

    import onnx

    from k3export.export import DecodeGraph
    targets = Recipe.load(DEFAULT_RECIPE).resolve(random_model(CFG, seed=0))
    n_lin = sum(k == "linear" for k in targets.values())
    n_exp = len(targets) - n_lin
    r = fp8_decode
    ep = torch.export.load(r["pt2"])                                       # re-loaded from disk, runs
    for a, b in zip(ep.module()(*r["args"]), DecodeGraph(fp8_model)(*r["args"])):
        assert torch.equal(a, b)
    c = r["census"]
    # every quantized linear runs once per decode step: one Q and two DQ each; E4M3 initializers: one weight per
    # linear, w13 and w2 per expert bank; kept linears (f_a, f_b, b per KDA layer, lm_head) stay plain MatMul
    assert (c["QuantizeLinear"], c["DequantizeLinear"]) == (n_lin, 2 * n_lin)
    assert len(c["fp8_weights"]) == n_lin + 2 * n_exp
    assert c["MatMul"] == n_lin + 3 * len(CFG.kda_layers) + 1
    model = onnx.load(str(r["onnx"]))
    k3 = collections.Counter(n.op_type for n in model.graph.node if n.domain == "k3")
    assert k3["moe_routed_fp8"] == n_exp and k3["moe_routed"] == 0
    onnx.checker.check_model(model)


def test_fp8_onnx_rewritten_for_tensorrt(tmp_path, fp8_decode, monkeypatch):
    """The FP8 decode graph's ONNX rewritten for TensorRT (`trt_onnx.rewrite`): each `moe_routed_fp8` node becomes
    the FP8 plugin chain of max_tokens' regime (k3-tiny: 8 experts, top-3; 8 tokens = 24 pairs: weight-only; 64:
    W8A8; 2048: W8A8 with the chunked align), no k3 op node is left, every plugin node has exactly the inputs,
    outputs and attributes (and aot=1) of its registration (`build_trt.register_plugins` on the `tensorrt.plugin`
    stand-in, which registers every plugin `build_trt.PLUGINS` names), the Q/DQ nodes stay as exported (TensorRT
    takes them natively), and `plugin_gaps` finds nothing."""
    import collections

    import onnx

    import trt_standin
    from k3export import build_trt
    from k3export.fp8_onnx import qdq_census
    from k3export.trt_onnx import rewrite
    _, trtp = trt_standin.install(monkeypatch)
    assert build_trt.register_plugins() == list(build_trt.PLUGIN_MODULES)
    assert set(trtp.registered) == {f"k3::{p}" for p in build_trt.PLUGINS}
    model = onnx.load(str(fp8_decode["onnx"]))
    n_moe = sum(n.op_type == "moe_routed_fp8" for n in model.graph.node)
    assert n_moe == CFG.num_hidden_layers - CFG.first_k_dense_replace > 0
    chains = {8: ["moe_align", "moe_fp8_wo_gemm1", "moe_fp8_wo_gemm2"],
              64: ["moe_align", "moe_fp8_quant", "moe_fp8_gemm1", "moe_fp8_gemm2"],
              2048: ["moe_count", "moe_plan", "moe_scatter", "moe_fp8_quant", "moe_fp8_gemm1", "moe_fp8_gemm2"]}
    for max_tokens, middle in chains.items():
        out, made = rewrite(model, "decode", onnx.TensorProto.FLOAT, max_tokens, 1)
        plugins = {k: v for k, v in made.items() if k.startswith("k3::moe")}
        assert plugins == {f"k3::{p}": n_moe for p in ["moe_router", "moe_topk", *middle, "moe_combine"]}
        assert qdq_census(out) == qdq_census(model)
        k3 = collections.Counter(n.op_type for n in out.graph.node if n.domain == "k3")
        assert not {"moe_routed_fp8", "moe_routed", "attn_res"} & set(k3)
        for node in out.graph.node:
            if node.domain != "k3":
                continue
            _, tensors, attrs, n_out = trtp.registered[f"k3::{node.op_type}"]
            assert len(node.input) == len(tensors) and len(node.output) == n_out, node.op_type
            assert {a.name for a in node.attribute} == set(attrs) | {"aot"}, node.op_type
            if node.op_type == "moe_align":
                rows = onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "block_rows"))
                assert rows == (16 if max_tokens == 8 else 64)
        onnx.save(out, tmp_path / f"d{max_tokens}.onnx")
        assert build_trt.plugin_gaps(tmp_path / f"d{max_tokens}.onnx") == {}


# ------------------------------------------------------------------------------------------------ expert kernel
def _expert_case(N, d, L, I, E, k, per_channel, seed=0, dtype=torch.float32, device="cpu", unquantized=False):
    """The op's arguments (random routing inputs, E4M3 experts, scales); with unquantized, also (w1, w3, w2)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, z, gw, b = r(N, d), r(N, L), r(E, d) / d ** 0.5, 0.3 * r(E)
    w1, w3, w2 = r(E, I, L) / L ** 0.5, r(E, I, L) / L ** 0.5, r(E, L, I) / I ** 0.5
    s = expert_weight_scales(w1, w3, w2, per_channel)
    w13 = torch.cat([w1, w3], 1)
    ex = lambda sc, w: sc[..., None] if sc.dim() == 2 else sc.view(-1, 1, 1)  # noqa: E731
    args = (x.to(dtype), z.to(dtype), gw, b, quantize(w13, ex(s["w13_scale"], w13)),
            quantize(w2, ex(s["w2_scale"], w2)), s["w13_scale"], s["w2_scale"], scale_from_amax(z.abs().max()),
            torch.tensor(0.05), k, True, 1.0, 4.0, 25.0)
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    return (args, (w1, w3, w2)) if unquantized else args


def _wo_args(M, N, K, per_channel, g, dtype=torch.float32):
    x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g) / K ** 0.5
    ws = scale_from_amax(weight_amax(w, per_channel))
    return x, quantize(w, ws[:, None] if per_channel else ws), ws


def _expert_wo(args):
    """`moe_fp8_wo_ref` takes the op's arguments without z_scale and h_scale (unused)."""
    return moe_fp8_wo_ref(*args[:8], *args[10:])


# The interpreter stores fp32 -> bf16 by truncation (measured: bit-identical to the truncated fp32 reference),
# so a bf16 output is within 1 bf16 ulp (2^-7 relative per element) of the fp32 reference, not half an ulp.
INTERP_BF16_BOUND = 2.0 ** -7


def interp_errors() -> dict:
    from k3export.fp8_kernels import BYTE_GEMV, WoTiles, fp8_linear_wo_fwd
    from k3export.fp8_moe_kernels import EXPERT_WO_TILINGS, ExpertWo, moe_fp8_grouped
    out = {}
    g = torch.Generator().manual_seed(4)
    # (M, N, K, per_channel, split, gemv): GEMV and tl.dot paths, one K slice and several (partials + reduce),
    # ragged N and K tails, 20 rows (a 32-row block)
    for M, N, K, pc, split, gemv in ((1, 72, 1100, True, None, None), (1, 40, 1024, False, 1, None),
                                     (1, 40, 1024, True, 3, False), (5, 72, 600, True, 3, None),
                                     (20, 72, 608, False, 1, None)):
        x, wq, ws = _wo_args(M, N, K, pc, g)
        y = fp8_linear_wo_fwd(x, wq, ws, split=split, gemv=gemv)
        out[f"wo_M{M}_N{N}_K{K}_split{split}_{'gemv' if gemv or (gemv is None and M == 1) else 'dot'}"] = \
            rel(y, fp8_linear_wo_ref(x, wq, ws))
    x, wq, ws = _wo_args(3, 48, 512, True, g, torch.bfloat16)
    out["bf16:wo_M3"] = rel(fp8_linear_wo_fwd(x, wq, ws, split=2), fp8_linear_wo_ref(x.float(), wq, ws))
    # the packed one-row GEMV (bf16 x; the interpreter unpacks with shifts): ragged N and K, split K and one
    # slice, prefetch on and off, E4M3 zeros, subnormals and negatives in the first rows
    for N, K, pc, split, t in ((40, 1100, True, None, WoTiles(16, 64, 4, 1, 8, "shift", True)),
                               (72, 1024, False, 3, WoTiles(16, 128, 4, 1, 8, "shift")),
                               (33, 516, True, 1, WoTiles(8, 64, 4, 1, 8, "cvt", True))):
        x, wq, ws = _wo_args(1, N, K, pc, g, torch.bfloat16)
        wq.view(torch.uint8)[:2, :16] = torch.cat([torch.arange(16), torch.arange(128, 144)]).view(2, 16).byte()
        y = fp8_linear_wo_fwd(x, wq, ws, split=split, tiles=t)
        tag = f"N{N}_K{K}_split{split}_{'pf' if t.prefetch else 'nopf'}"
        out[f"bf16:packed_{tag}"] = rel(y, fp8_linear_wo_ref(x.float(), wq, ws))
        out[f"same:packed_vs_byte_{tag}"] = rel(y, fp8_linear_wo_fwd(x, wq, ws, split=split, tiles=BYTE_GEMV))
    # every finite E4M3 byte value through the packed GEMV's unpacking, each in byte lane n % 4 (the cuda test's
    # case): mismatches against torch's E4M3 -> fp32 (exact values, x = ones, scale 1)
    vals = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    wb = torch.zeros(len(vals), 64, dtype=torch.uint8)
    wb[torch.arange(len(vals)), 8 + torch.arange(len(vals)) % 4] = vals
    y = fp8_linear_wo_fwd(torch.ones(1, 64, dtype=torch.bfloat16), wb.view(FP8), torch.ones(()), split=1,
                          tiles=WoTiles(16, 64, 4, 1, 8, "shift", True))
    out["exact:packed_e4m3_bytes_mismatches"] = float((y[0].float() != wb.view(FP8).float().sum(1)).sum())
    # the "pairs" expert scheme (bf16 z): 1 and 2 tokens, per-channel and per-expert scales, ragged tiles
    pairs = ExpertWo("pairs", WoTiles(16, 64, unpack="shift", prefetch=True), WoTiles(8, 32, unpack="shift"),
                     pair_max_tokens=2)
    for N, k, pc in ((1, 3, True), (2, 2, False)):
        args = _expert_case(N, 32, 32, 48, 8, k, pc, dtype=torch.bfloat16)
        tag = f"N{N}_k{k}_{'pc' if pc else 'pt'}"
        y = moe_fp8_grouped(*args, weight_only=True, wo=pairs)
        out[f"bf16:experts_pairs_{tag}"] = rel(y, _expert_wo(args))
        out[f"same:experts_pairs_vs_blocks_{tag}"] = rel(y, moe_fp8_grouped(*args, weight_only=True,
                                                                            wo=EXPERT_WO_TILINGS["blocks"]))
    # the fused "pairs" scheme (top-k inside gemm1, combine inside gemm2; lean routing): bit for bit the unfused
    # scheme on route_fwd(lean)'s routing (the interpreter runs the Triton router here too)
    from dataclasses import replace

    from k3export.fp8_moe_kernels import _moe_fp8_wo_pairs
    from k3export.plugins.moe.kernels import route_fwd
    fused = ExpertWo("pairs", WoTiles(16, 64, unpack="shift", prefetch=True), WoTiles(8, 32, unpack="shift"), True,
                     pair_max_tokens=2, fuse=True)
    for N, k, pc in ((1, 3, True), (2, 2, False), (2, 8, True)):
        args = _expert_case(N, 32, 32, 48, 8, k, pc, seed=N + k, dtype=torch.bfloat16)
        tag = f"N{N}_k{k}_{'pc' if pc else 'pt'}"
        y = moe_fp8_grouped(*args, weight_only=True, wo=fused)
        top, w, _ = route_fwd(args[0], args[2], args[3], k, True, 1.0, True)
        ref = _moe_fp8_wo_pairs(top, w, args[1], *args[4:8], k, 4.0, 25.0, replace(fused, fuse=False))
        out[f"exact:experts_pairs_fused_vs_unfused_{tag}_mismatches"] = float((y != ref).sum())
        out[f"bf16:experts_pairs_fused_{tag}"] = rel(y, _expert_wo(args))
    for N, k, pc in ((3, 2, True), (11, 3, False), (20, 2, True)):      # 20*2 pairs > 4E: 64-row W8A8 blocks
        args = _expert_case(N, 32, 32, 48, 8, k, pc)
        tag = f"N{N}_k{k}_{'pc' if pc else 'pt'}"
        out[f"experts_w8a8_{tag}"] = rel(moe_fp8_grouped(*args, weight_only=False), moe_fp8_sorted(*args))
        out[f"experts_wo_{tag}"] = rel(moe_fp8_grouped(*args, weight_only=True), _expert_wo(args))
    # Every named W8A8 tiling (TMA ones: E4M3(z / s_z) gathered into row-plan order, blocks of block_m + tail rows)
    # and small TMA tilings, against the contract's reference: 150 tokens top-2 over 8 experts, expert 3 hot (150
    # rows: past a 128-row block into its tail, several 16 + 16-row blocks), the others ~20 rows (tails all padding).
    from k3export.fp8_moe_kernels import FP8_PREFILL_TILINGS, Fp8Tiles
    args = _expert_case(150, 32, 32, 48, 8, 2, True, seed=5)
    args[3][3] = 50.0
    ref = moe_fp8_sorted(*args)
    small = {"small-t16": Fp8Tiles(16, (32, 32, 4, 1), (32, 32, 4, 1), 16),
             "small-t16-f1": Fp8Tiles(16, (16, 32, 4, 1), (32, 16, 4, 1), 16, fast_act=1),
             "small-t0": Fp8Tiles(32, (32, 32, 4, 1), (16, 32, 4, 1))}
    for name, t in {**FP8_PREFILL_TILINGS, **small}.items():
        out[f"experts_w8a8_tiles_{name}"] = rel(moe_fp8_grouped(*args, weight_only=False, tiles=t), ref)
    return out


# The "pairs" expert scheme in bf16 under the interpreter: h and the output are both stored by truncation, so
# the output is within two truncations of the fp32 reference (measured 6.7e-3 / 7.1e-3); its tight check is
# "same:" (equal to the "blocks" kernels, which the fp32 cases hold to FP32_BOUND; measured 0).
INTERP_BF16_CHAIN_BOUND = 2 * INTERP_BF16_BOUND


def test_fp8_kernels_interpreter(interp):
    fp32 = {k: v for k, v in interp.items() if ":" not in k}
    assert max(fp32.values()) < FP32_BOUND, interp
    # same arithmetic, other kernel (fp32 sums in another order, then the same truncation): measured 0
    assert max(v for k, v in interp.items() if k.startswith("same:")) < FP32_BOUND, interp
    assert interp["exact:packed_e4m3_bytes_mismatches"] == 0, interp
    fused = [v for k, v in interp.items() if k.startswith("exact:experts_pairs_fused")]
    assert len(fused) == 3 and not any(fused), interp
    assert interp["bf16:wo_M3"] < INTERP_BF16_BOUND, interp
    assert all(v < INTERP_BF16_BOUND for k, v in interp.items() if k.startswith("bf16:packed")), interp
    assert all(v < INTERP_BF16_CHAIN_BOUND for k, v in interp.items() if k.startswith("bf16:experts")), interp


@pytest.mark.parametrize("E,k", [(64, 8), (896, 16)])
def test_fused_pair_kernels_compile_sm90(E, k):
    """The fused FP8 "pairs" kernels (`ExpertWo.fuse`) compile for sm_90 at k3-small and K3 routing: gemm1 with its
    own top-k (ROUTE), gemm2 with the ticketed combine (one acq_rel gpu-scope atomic, the other slots' rows read
    through L2)."""
    from k3export.fp8_moe_kernels import moe_fp8_wo_pair_gemm1_fwd_kernel, moe_fp8_wo_pair_gemm2_fwd_kernel
    from k3export.plugins.aot import compile_ptx
    from k3export.plugins.triton_common import pow2
    i32 = "i32"
    sig1 = dict(z4="*i64", w13="*i32", s13="*fp32", h="*bf16", ids="*i32", I=i32, C_L=i32, stride_z4=i32,
                stride_we4=i32, stride_wn4=i32, stride_se=i32, stride_h=i32, beta="fp32", linear_beta="fp32",
                part="*fp32", bias="*fp32", s="*fp32", wt="*fp32", N=i32, E=i32, scaling="fp32")
    c1 = dict(TOP_K=k, PER_CHANNEL=True, UNPACK="shift", PREFETCH=False, BLOCK_N=16, BLOCK_C=128, ROUTE=True,
              SPLITS=8, BLOCK_E=pow2(E), BLOCK_TK=pow2(k, 2), RENORM=True, PACKED=True)
    fn = moe_fp8_wo_pair_gemm1_fwd_kernel
    sig1 = {n: sig1.get(n, "constexpr") for n in fn.arg_names}
    assert "griddepcontrol" not in compile_ptx(fn, sig1, c1, 4).ptx
    sig2 = dict(h4="*i64", w2="*i32", s2="*fp32", y="*fp32", ids="*i32", L=i32, C_I=i32, stride_h4=i32,
                stride_we4=i32, stride_wn4=i32, stride_se=i32, stride_y=i32, wt="*fp32", u="*bf16", tickets="*i32",
                stride_u=i32)
    c2 = dict(PER_CHANNEL=True, UNPACK="shift", PREFETCH=False, BLOCK_N=16, BLOCK_C=128, TOP_K=k, COMBINE=True)
    fn = moe_fp8_wo_pair_gemm2_fwd_kernel
    ptx = compile_ptx(fn, {n: sig2.get(n, "constexpr") for n in fn.arg_names}, c2, 4).ptx
    assert ptx.count("atom.global.gpu.acq_rel.add") == 1 and ptx.count("ld.global.cg") >= k


def test_fp8_linear_cols_op_reference_and_fake():
    """`k3::fp8_linear_cols` (the FP8 MoE output pair at one row): on CPU its reference, the two weight-only products
    summed in fp32 and rounded once (within one output rounding of the two linears run apart and added); the fake
    has the output's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3export.fp8 import fp8_linear_cols, fp8_linear_cols_ref
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(1, 64, generator=g).to(torch.bfloat16), torch.randn(1, 96, generator=g).to(torch.bfloat16)
    wa, wb = torch.randn(40, 64, generator=g) / 8, torch.randn(40, 96, generator=g) / 10
    sa, sb = wa.abs().amax(1) / 448, wb.abs().max() / 448
    qa, qb = quantize(wa, sa[:, None]), quantize(wb, sb)
    y = fp8_linear_cols(a, b, qa, sa, qb, sb)
    assert y.shape == (1, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y, fp8_linear_cols_ref(a, b, qa, sa, qb, sb))
    apart = (fp8_linear_wo_ref(a, qa, sa) + fp8_linear_wo_ref(b, qb, sb)).float()
    assert ((y.float() - apart).abs() <= 2 ** -7 * apart.abs() + 1e-3 * apart.abs().max()).all()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        f = fp8_linear_cols(*(mode.from_tensor(t) for t in (a, b, qa, sa, qb, sb)))
    assert f.shape == (1, 40) and f.dtype == torch.bfloat16


@pytest.mark.parametrize("E,fused", [(8, True), (64, True), (72, False)])
def test_fused_expert_scheme_only_up_to_topk_gemm1_max_e(monkeypatch, E, fused):
    """The default fused scheme selects inside gemm1 only up to TOPK_GEMM1_MAX_E experts (as the bf16 default: above,
    e.g. K3's 896, every gemm1 program would run 16 selection rounds over 1024 scores, not timed); with more experts
    the same tiles run unfused, routing first. Which path runs, on CPU with the kernels replaced by markers."""
    from k3export import fp8_moe_kernels as F
    calls = []
    monkeypatch.setattr(F, "_pairs_ok", lambda *a: True)
    monkeypatch.setattr(F, "moe_fp8_wo_pairs_fused", lambda *a: calls.append("fused") or a[3])
    monkeypatch.setattr(F, "moe_fp8_wo", lambda top, w, z, *a: calls.append("unfused") or z)
    monkeypatch.delenv("K3_FP8_EXPERT_WO", raising=False)
    args = _expert_case(1, 32, 16, 8, E, 4, True, dtype=torch.bfloat16)
    F.moe_fp8_grouped(*args, weight_only=True)
    assert calls == ["fused" if fused else "unfused"]


def test_expert_wo_env_switch(monkeypatch):
    """K3_FP8_EXPERT_WO picks the weight-only scheme per call (an A/B switch); unset: EXPERT_WO (the fused "pairs"
    scheme); unknown: an error that lists the schemes."""
    from k3export.fp8_moe_kernels import EXPERT_WO, EXPERT_WO_TILINGS, expert_wo
    monkeypatch.delenv("K3_FP8_EXPERT_WO", raising=False)
    assert expert_wo() is EXPERT_WO and EXPERT_WO.fuse
    monkeypatch.setenv("K3_FP8_EXPERT_WO", "pairs-n16k512-shift")
    assert expert_wo() is EXPERT_WO_TILINGS["pairs-n16k512-shift"] and not expert_wo().fuse
    monkeypatch.setenv("K3_FP8_EXPERT_WO", "nope")
    with pytest.raises(ValueError, match="pairs-n16k512-shift-fused"):
        expert_wo()


def test_weight_only_experts_are_closer_to_unquantized_than_w8a8():
    # decode on CUDA runs the experts weight-only (z and h unquantized): less error than W8A8 against the
    # unquantized experts. Both chain two GEMMs, hence twice the one-GEMM bound.
    from k3export.plugins.moe.naive import moe_sorted
    errs = {}
    for N, k, pc in ((4, 2, True), (9, 3, False)):
        args, (w1, w3, w2) = _expert_case(N, 32, 32, 48, 8, k, pc, seed=N, unquantized=True)
        exact = moe_sorted(*args[:4], w1, w3, w2, *args[10:])
        errs[(N, k)] = (rel(_expert_wo(args), exact), rel(moe_fp8_sorted(*args), exact))
    assert all(wo < w8a8 < 2 * FP8_GEMM_BOUND for wo, w8a8 in errs.values()), errs


def test_w8a8_tiling_rule(monkeypatch):
    """W8A8 expert tilings by average rows per expert (measured at K3 size: 73 / 146 / 292 rows), the pointer
    kernels below 64 (16-row blocks up to 4), and K3_FP8_MOE_PREFILL as an A/B switch with a clear error."""
    from k3export.fp8_moe_kernels import FP8_PREFILL_TILINGS as T, fp8_prefill_tiles
    monkeypatch.delenv("K3_FP8_MOE_PREFILL", raising=False)
    E, L = 896, 3584
    assert fp8_prefill_tiles(4096 * 16, E, L) is T["m128-n128-s4-f2"]
    assert fp8_prefill_tiles(8192 * 16, E, L) is T["m128t64-n64-f2"] is fp8_prefill_tiles(16384 * 16, E, L)
    assert fp8_prefill_tiles(1024 * 16, E, L) is T["ptr"]                       # 18 rows per expert
    assert fp8_prefill_tiles(2048 * 8, 64, 1024) is T["ptr"]                    # k3-small's latent: pointer kernels
    assert fp8_prefill_tiles(4 * E, E, L).block_m == 16 and not fp8_prefill_tiles(4 * E, E, L).tma
    monkeypatch.setenv("K3_FP8_MOE_PREFILL", "m64t32-n128")
    assert fp8_prefill_tiles(8, E, L) is T["m64t32-n128"]
    monkeypatch.setenv("K3_FP8_MOE_PREFILL", "m65")
    with pytest.raises(ValueError, match="K3_FP8_MOE_PREFILL='m65' is not a W8A8 tiling: ptr, m64t32-n128"):
        fp8_prefill_tiles(8, E, L)


# ------------------------------------------------------------------------------------------------ GPU
# bf16 output vs the fp32 reference: one bf16 rounding (2^-9) apart at most, plus the sums in another order
# (Hopper's FP8 MMA accumulates with reduced precision). Measured on the H200 with k3-small's q_proj (`bench fp8`
# selfcheck): 1.6e-3 (the old fused W8A8 kernel, M = 1), 1.7e-3 (_scaled_mm, M = 128). The weight-only paths
# (exact products, fp32 sums, one bf16 rounding of the output; for the experts also h rounded to bf16 as the
# reference rounds it) are held to the same bound.
BF16_OUT_BOUND = 4e-3
# The grouped kernel rounds y13 and h to bf16 as the reference does, but sums in another order (and in the FP8
# MMA's reduced-precision accumulator): elements of h near an E4M3 rounding boundary can land one E4M3 step
# apart. Measured on the H200 (k3-small layer 1, `bench fp8` selfcheck): 0 at N = 1, 6.2e-3 at N = 64.
EXPERT_GPU_BOUND = 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 7, 64, 200])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_matches_reference_cuda(M, per_channel):
    from k3export.fp8 import WEIGHT_ONLY_M
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2048, generator=g).bfloat16().cuda()
    w = (torch.randn(3072, 2048, generator=g) / 45).cuda()
    ws = scale_from_amax(weight_amax(w, per_channel))
    wq = quantize(w, ws[:, None] if per_channel else ws)
    xs = scale_from_amax(x.float().abs().max())
    y = torch.ops.k3.fp8_linear(x, xs, wq, ws)
    assert y.dtype == torch.bfloat16
    want = fp8_linear_wo_ref(x.float(), wq, ws) if M <= WEIGHT_ONLY_M else fp8_linear_ref(x.float(), xs, wq, ws)
    assert rel(y, want) < BF16_OUT_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K,split,gemv", [(1, 576, 7168, None, None), (1, 576, 7168, 1, None),
                                              (1, 12288, 1536, None, False), (4, 1536, 7168, None, None),
                                              (16, 7168, 8192, 2, None), (64, 3072, 2048, None, None)])
def test_weight_only_kernel_matches_reference_cuda(M, N, K, split, gemv):
    # full-width K3 shapes (kv_a 576x7168, q_b 12288x1536, q_a 1536x7168, o 7168x8192): GEMV and tl.dot paths,
    # split K (partials + reduce) and one slice
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    g = torch.Generator().manual_seed(N + M)
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).cuda()
    ws = scale_from_amax(weight_amax(w, True))
    wq = quantize(w, ws[:, None])
    assert rel(fp8_linear_wo_fwd(x, wq, ws, split=split, gemv=gemv), fp8_linear_wo_ref(x.float(), wq, ws)) \
        < BF16_OUT_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("unpack", ["shift", "cvt", "bits"])
def test_packed_gemv_widens_every_e4m3_byte_exactly_cuda(unpack):
    # row n holds one finite E4M3 byte value (all 254, zeros, subnormals, negatives; 0x7F / 0xFF are NaN) in byte
    # lane n % 4 of a word, x = ones, scale 1: y[n] is that value, exact in fp32 and in bf16
    from k3export.fp8_kernels import WoTiles, fp8_linear_wo_fwd
    vals = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    w = torch.zeros(len(vals), 64, dtype=torch.uint8)
    w[torch.arange(len(vals)), 8 + torch.arange(len(vals)) % 4] = vals
    wq = w.view(FP8).cuda()
    x = torch.ones(1, 64, dtype=torch.bfloat16, device="cuda")
    for pf in (False, True):
        y = fp8_linear_wo_fwd(x, wq, torch.ones((), device="cuda"), split=1, tiles=WoTiles(16, 64, 4, 1, 8, unpack, pf))
        assert torch.equal(y[0].float(), wq.float()[:, 8:12].sum(1)), (unpack, pf)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["n16k512", "p-n16k512-shift", "p-n16k512-cvt-pf", "p-n16k512-bits-pf",
                                  "p-n16k1024-cvt-pf", "p-n32k1024-w8-cvt-pf", "p-n16k2048-w8-cvt-pf"])
@pytest.mark.parametrize("N,K", [(576, 7168), (7168, 1536 * 4 - 4)])
def test_gemv_tilings_match_reference_cuda(name, N, K):
    # the named one-row launches at a full-width shape and a ragged K (K % 16 != 0, split K)
    from k3export.fp8_kernels import GEMV_TILINGS, fp8_linear_wo_fwd
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, K, generator=g).bfloat16().cuda()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).cuda()
    ws = scale_from_amax(weight_amax(w, True))
    wq = quantize(w, ws[:, None])
    assert rel(fp8_linear_wo_fwd(x, wq, ws, tiles=GEMV_TILINGS[name]), fp8_linear_wo_ref(x.float(), wq, ws)) \
        < BF16_OUT_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("KA,KB,pc", [(1024, 1536, True), (1024, 1536, False), (3584, 6144, True)])
def test_fp8_linear_cols_cuda(KA, KB, pc):
    """`k3::fp8_linear_cols` on the GPU (k3-small's and K3's MoE output pair: latent + shared widths into d), one
    bf16 row, PDL on sm_90: within the output rounding of the fp64 reference (`_cols_worst` of tests/test_gemv.py
    with half an ulp)."""
    from test_gemv import _cols_inputs, _cols_worst

    from k3export.fp8 import fp8_linear_cols
    from k3export.plugins import launch as L
    from k3export.plugins.gemv import kernels as G
    N = 2048 if KA == 1024 else 7168
    a, b, wa, sa, wb, sb = _cols_inputs(N, KA, KB, True, pc, seed=KA, device="cuda")
    assert G.cols_supported(a, b, wa, sa, wb, sb)
    with L.pdl(torch.cuda.get_device_capability()[0] >= 9, early=True):
        y = fp8_linear_cols(a, b, wa, sa, wb, sb)
    assert _cols_worst(y, a, b, wa, sa, wb, sb, 2.0 ** -8) <= 1.0


@pytest.mark.cuda
@pytest.mark.parametrize("d,L,I,E,k", [(2048, 1024, 768, 64, 8), (512, 64, 64, 896, 16)])
def test_fused_pairs_scheme_bit_identical_cuda(d, L, I, E, k):
    """`ExpertWo.fuse` on the GPU (k3-small experts; K3's 896 experts / top-16 routing on small experts): the
    fused scheme's u == the unfused "pairs" scheme on route_fwd(lean)'s routing, bit for bit, on 5 fresh inputs,
    then captured in a CUDA graph and replayed 3 times on fresh inputs copied in (the ticket counters back at 0)."""
    from dataclasses import replace

    from k3export.fp8_moe_kernels import EXPERT_WO_TILINGS, _moe_fp8_wo_pairs, moe_fp8_grouped
    from k3export.plugins.moe.kernels import route_fwd
    fused = EXPERT_WO_TILINGS["pairs-n16k512-shift-fused"]

    def unfused(args):
        top, w, _ = route_fwd(args[0], args[2], args[3], k, True, 1.0, True)
        return _moe_fp8_wo_pairs(top, w, args[1], *args[4:8], k, 4.0, 25.0, replace(fused, fuse=False))
    for seed in range(5):
        args = _expert_case(1, d, L, I, E, k, True, seed=seed, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(moe_fp8_grouped(*args, weight_only=True, wo=fused), unfused(args)), seed
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        u = moe_fp8_grouped(*args, weight_only=True, wo=fused)
    for seed in range(3):
        fresh = _expert_case(1, d, L, I, E, k, True, seed=100 + seed, dtype=torch.bfloat16, device="cuda")
        args[0].copy_(fresh[0])
        args[1].copy_(fresh[1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(u, unfused(args)), seed


@pytest.mark.cuda
@pytest.mark.parametrize("name,N", [("blocks", 1), ("blocks-k512-lean", 1), ("pairs-n16k512-shift", 1),
                                    ("pairs-n16k512-shift-fused", 1),
                                    ("pairs-n16k512-cvt-pf", 1), ("pairs-n8k512-cvt-pf", 1),
                                    ("pairs-n16k512-bits-pf", 1), ("pairs-n16k512-cvt-pf", 3)])
def test_expert_wo_schemes_match_reference_cuda(name, N):
    # k3-small expert shapes, one token (the "pairs" regime) and three (pair_max_tokens = 1: "blocks" runs)
    from k3export.fp8_moe_kernels import EXPERT_WO_TILINGS, moe_fp8_grouped
    args = _expert_case(N, 2048, 1024, 768, 64, 8, True, seed=N, dtype=torch.bfloat16, device="cuda")
    out = moe_fp8_grouped(*args, weight_only=True, wo=EXPERT_WO_TILINGS[name])
    assert rel(out, _expert_wo(args)) < BF16_OUT_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("N,weight_only", [(1, None), (16, None), (16, False), (256, None)])
def test_grouped_kernel_matches_sorted_cuda(N, weight_only):
    # k3-small expert shapes: d 2048, latent 1024, expert hidden 768, 64 experts, top-8; N = 1, 16 run
    # weight-only by default (8, 128 pairs <= 4 * 64), 256 tokens W8A8
    from k3export.fp8_moe_kernels import moe_fp8_grouped, use_weight_only
    args = _expert_case(N, 2048, 1024, 768, 64, 8, True, dtype=torch.bfloat16, device="cuda")
    wo = use_weight_only(N * 8, 64) if weight_only is None else weight_only
    out = moe_fp8_grouped(*args, weight_only=weight_only)
    if weight_only is None:
        assert torch.equal(out, torch.ops.k3.moe_routed_fp8(*args))              # the op runs this path
    if wo:
        assert rel(out, _expert_wo(args)) < BF16_OUT_BOUND
    else:
        assert rel(out, moe_fp8_sorted(*args)) < EXPERT_GPU_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("N", [256, 2048])
@pytest.mark.parametrize("name", ["ptr", "m64t32-n128", "m64t32-n128-f2", "m64t32-n128-k256", "m128t64-n64-f2",
                                  "m128-n128-f2", "m64-n128-f2", "m64-n128-s2-f2", "m128-n128-s4-f2", "m128-n64-f2",
                                  "ptr-m64-n128", "ptr-m128-n64", "ptr-m128-n128", "ptr-m64-n128-k256"])
def test_w8a8_tilings_match_sorted_cuda(name, N):
    """Every named W8A8 tiling (`FP8_PREFILL_TILINGS`; the TMA ones gather E4M3(z / s_z) into row-plan order) at
    k3-small expert shapes (64 experts, top-8: 32 / 256 rows per expert, one expert hot) against the contract's
    reference, on the tokens whose selection the Triton and torch routers agree on."""
    from k3export.fp8_moe_kernels import FP8_PREFILL_TILINGS, moe_fp8_grouped
    from k3export.plugins.moe.kernels import route_fwd
    from k3export.plugins.moe.naive import route
    args = _expert_case(N, 2048, 1024, 768, 64, 8, True, dtype=torch.bfloat16, device="cuda")
    args[3][5] = 3.0                                         # expert 5 in (nearly) every token's selection
    out = moe_fp8_grouped(*args, weight_only=False, tiles=FP8_PREFILL_TILINGS[name])
    ref = moe_fp8_sorted(*args)
    same = (route(*args[:1], *args[2:4], 8, True, 1.0)[0].sort(-1).values ==
            route_fwd(args[0], args[2], args[3], 8, True, 1.0)[0].sort(-1).values).all(-1)
    assert same.sum() > 0.9 * N
    assert rel(out[same], ref[same]) < EXPERT_GPU_BOUND, rel(out[same], ref[same])
    print(f"{name} N={N}: rel err {rel(out[same], ref[same]):.2e} on {int(same.sum())} tokens")


if __name__ == "__main__":
    print(json.dumps(interp_errors()))


def test_bench_fp8_compiled_times_the_served_step_and_restores_the_model(monkeypatch, fp8_model):
    """`bench fp8 --compiled` times what the `compile` backend serves (every serving swap on, the in-place decode
    step), and leaves the model as written for the accuracy report that follows. Nothing is timed here: the
    timing function is replaced by one that records what it was given (torch.compile is lazy: no compile)."""
    from k3export.bench import fp8 as bench_fp8
    from k3export.model.packing import packed_count
    seen = {}

    def fake(model, B, context, step):
        seen.update(step=step.__name__, swaps=packed_count(model))
        return 1.0, "graph"
    monkeypatch.setattr(bench_fp8, "_decode_ms", fake)
    assert bench_fp8.decode_ms(fp8_model, 1, 8, compiled=True) == (1.0, "graph")
    assert seen["step"] == "_decode_inplace" and seen["swaps"] > 2       # packed groups + the two fused-norm swaps
    assert packed_count(fp8_model) == 0
