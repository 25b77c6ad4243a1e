"""ONNX: bare k3 nodes (counted), checker-clean, named dynamic axes; onnxruntime with the k3 ops as Python custom
ops matches eager; `verify` passes on good graphs and exits non-zero on a tampered one."""

import re
import shutil

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript (pip install -e '.[onnx]')")
pytest.importorskip("onnxruntime_extensions", reason="the CPU run needs onnxruntime-extensions ('.[onnx]')")

import onnx  # noqa: E402

from k3export.export import OUTPUTS, expected_k3_ops  # noqa: E402
from k3export.onnx_export import DOMAIN, OPSET, SIGNATURES, OrtGraph, export_onnx, k3_node_counts  # noqa: E402
from k3export.verify import TOL, case_inputs, verify, verify_cmd  # noqa: E402
from test_export import checkpoint, graph_dir, model, rel, small_tiny  # noqa: E402,F401


@pytest.fixture(scope="session")
def onnx_dir(graph_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "graphs"
    shutil.copytree(graph_dir, out)
    export_onnx(out, log=lambda *_: None)
    return out


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_onnx_has_bare_k3_nodes_named_axes_and_passes_the_checker(onnx_dir, graph):
    path = onnx_dir / f"{graph}.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    m = onnx.load(str(path))
    assert {i.domain: i.version for i in m.opset_import}[""] >= OPSET >= 20
    assert k3_node_counts(m) == expected_k3_ops(small_tiny(), graph)
    assert not m.functions                                     # bare nodes, not wrapped in local functions
    for n in m.graph.node:
        if n.domain == DOMAIN:
            assert {a.name for a in n.attribute} == set(SIGNATURES[n.op_type][2])
            assert len(n.input) == len(SIGNATURES[n.op_type][0])
    kda = next(n for n in m.graph.node if n.op_type == f"kda_{graph}")
    assert next(a.f for a in kda.attribute if a.name == "lower_bound") == -5.0
    assert [o.name for o in m.graph.output] == list(OUTPUTS)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(m.graph.input) + list(m.graph.output)}
    if graph == "prefill":
        assert shapes["input_ids"] == ["batch", "tokens"] and shapes["mla_cache"][1:3] == ["batch", "past"]
        assert shapes["mla_rows"][1:3] == ["batch", "tokens"]
    else:
        assert shapes["input_ids"] == ["batch"] and shapes["mla_cache"][1:3] == ["batch", "cache"]


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_onnxruntime_matches_eager(onnx_dir, model, graph):
    from k3export.manifest import load_manifest
    inputs = case_inputs(load_manifest(onnx_dir), graph)
    with torch.no_grad():
        fn = model.forward_prefill if graph == "prefill" else model.forward_decode
        eager = dict(zip(OUTPUTS, fn(**inputs)))
    got = OrtGraph(onnx_dir / f"{graph}.onnx").run(inputs)
    for k in OUTPUTS:
        assert got[k].shape == eager[k].shape
        assert rel(got[k], eager[k]) <= TOL[("onnx", "float32")], k


def test_verify_passes_then_fails_on_a_tampered_graph(onnx_dir, tmp_path):
    ok, table = verify(onnx_dir, run_onnx=True)
    assert ok, table
    assert table.count(" ok") == 2 * len(OUTPUTS) + 1                  # + the generation row
    bad = tmp_path / "tampered"
    shutil.copytree(onnx_dir, bad)
    ep = torch.export.load(bad / "prefill.pt2")
    w = ep.state_dict["model.lm_head.weight"]
    w[:5] += 0.05                                              # a small edit of one weight
    torch.export.save(ep, bad / "prefill.pt2")
    result = CliRunner().invoke(verify_cmd, ["--graphs", str(bad), "--no-onnx"])
    assert result.exit_code == 1, result.output
    assert re.search(r"prefill\s+prefill.pt2\s+sha256 differs from the manifest", result.output)
    assert re.search(r"prefill\s+logits\s.*FAIL", result.output)          # and the numbers show it
    assert not re.search(r"decode\s+logits\s.*FAIL", result.output)
    assert "verify: FAILED" in result.output


def test_tensorrt_build_names_what_each_k3_node_lacks(onnx_dir, tmp_path):
    """The k3-tiny ONNX as `k3export onnx` writes it is refused before TensorRT would parse it, each op with its
    reason (one node per op against one plugin per kernel launch, no aot=1, no AttnRes plugin); a node that is its
    one plugin with aot=1 passes the check (`build_trt.plugin_gaps`; TensorRT itself never runs here)."""
    import onnx
    from onnx import helper
    from k3export.build_trt import plugin_gaps
    pre, dec = plugin_gaps(onnx_dir / "prefill.onnx"), plugin_gaps(onnx_dir / "decode.onnx")
    assert set(pre) == {"kda_prefill", "mla_prefill", "moe_routed", "attn_res"}
    assert set(dec) == {"kda_decode", "mla_decode", "moe_routed", "attn_res"}
    assert "k3::kda_prefill_intra, k3::kda_prefill_chunks" in pre["kda_prefill"]
    assert "6 plugins" in pre["moe_routed"] and "6 plugins" in dec["moe_routed"]
    assert dec["kda_decode"] == "no aot=1 attribute on the node" and "no AttnRes plugin" in dec["attn_res"]
    nodes = [helper.make_node("kda_decode", ["a"], ["b"], domain="k3", aot=1),
             helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("mystery", ["c"], ["d"], domain="k3")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(g), tmp_path / "m.onnx")
    assert plugin_gaps(tmp_path / "m.onnx") == {"mystery": "no plugin registered under this name"}


def _registered_plugins(monkeypatch) -> dict:
    """name -> (desc fn, tensor params, attribute params, outputs) of every AOT plugin, registered against the
    `tensorrt.plugin` stand-in (tests/trt_standin.py)."""
    import trt_standin
    from k3export import build_trt
    _, trtp = trt_standin.install(monkeypatch)
    assert build_trt.register_plugins() == list(build_trt.PLUGIN_MODULES)      # what an engine build registers
    return trtp.registered


def test_trt_rewrite_makes_every_decode_node_a_registered_plugin(onnx_dir, tmp_path, monkeypatch):
    """The k3-tiny ONNX rewritten for TensorRT (`trt_onnx.rewrite`): no k3 op node is left in either graph, each
    plugin node has the inputs, outputs and attributes (plus aot=1) its registration takes; the MoE takes the
    decode chain up to 4096 (token, expert) pairs at the graph's largest token count and the prefill chain beyond;
    `build_trt.plugin_onnx` writes the rewritten graphs beside the ONNX, each with the chain its profile needs."""
    import onnx
    from k3export.build_trt import plugin_gaps, plugin_onnx
    from k3export.manifest import load_manifest
    from k3export.trt_onnx import rewrite
    reg = _registered_plugins(monkeypatch)
    F = onnx.TensorProto.FLOAT
    c = k3_node_counts(onnx.load(str(onnx_dir / "decode.onnx"), load_external_data=False))
    dec, made = rewrite(onnx.load(str(onnx_dir / "decode.onnx")), "decode", F, 8, 4)
    a = c["attn_res"]
    assert made == {"k3::kda_decode": c["kda_decode"], "k3::mla_decode_split": c["mla_decode"],
                    "k3::mla_decode_combine": c["mla_decode"],
                    **{f"k3::moe_{s}": c["moe_routed"] for s in ("router", "topk", "align", "gemm1", "gemm2",
                                                                  "combine")},
                    "Cast": 5 * a, "Concat": a, "Unsqueeze": 2 * a, "Mul": 5 * a, "Reshape": a, "ReduceMean": a,
                    "Add": a, "Sqrt": a, "Reciprocal": a, "ReduceSum": 2 * a, "Softmax": a}
    cp = k3_node_counts(onnx.load(str(onnx_dir / "prefill.onnx"), load_external_data=False))
    k = small_tiny().num_experts_per_token
    max_prefill = 4096 // k + 1                                   # the first token count past 4096 pairs
    pre, made_p = rewrite(onnx.load(str(onnx_dir / "prefill.onnx")), "prefill", F, max_prefill, 4)
    moe = cp["moe_routed"]
    assert moe > 0 and {k: v for k, v in made_p.items() if k.startswith("k3::")} == {
        "k3::kda_prefill_intra": cp["kda_prefill"], "k3::kda_prefill_chunks": cp["kda_prefill"],
        "k3::mla_prefill": cp["mla_prefill"],
        **{f"k3::moe_{s}": moe for s in ("router", "topk", "count", "plan", "scatter", "gemm1", "gemm2", "combine")}}
    assert made_p["Slice"] == made_p["Shape"] == cp["kda_prefill"]
    from k3export.plugins.moe.kernels import ALIGN_FUSED_MAX
    from k3export.trt_onnx import MOE_DECODE_MAX_PAIRS
    assert MOE_DECODE_MAX_PAIRS == ALIGN_FUSED_MAX == 4096             # the rewrite picks the chain the plugins do
    pre_small, made_s = rewrite(onnx.load(str(onnx_dir / "prefill.onnx")), "prefill", F, 4096 // k, 4)
    assert made_s["k3::moe_align"] == moe and "k3::moe_count" not in made_s        # 4096 pairs: the decode chain
    for m in (dec, pre, pre_small):
        for node in m.graph.node:
            if node.domain != "k3":
                continue
            assert node.op_type not in ("attn_res", "moe_routed")
            _, tensors, attrs, n_out = reg[f"k3::{node.op_type}"]
            names = {a.name for a in node.attribute}
            assert len(node.input) == len(tensors) and len(node.output) == n_out, node.op_type
            assert names == set(attrs) | {"aot"} and onnx.helper.get_attribute_value(
                next(a for a in node.attribute if a.name == "aot")) == 1, (node.op_type, names, attrs)
    onnx.save(dec, tmp_path / "d.onnx")
    onnx.save(pre, tmp_path / "p.onnx")
    assert plugin_gaps(tmp_path / "d.onnx") == {} and plugin_gaps(tmp_path / "p.onnx") == {}
    manifest = {"config": load_manifest(onnx_dir)["config"], "precision": "fp32"}
    profiles = {"decode": {"batch": [1, 8, 8], "cache": [1, 64, 64]},
                "prefill": {"batch": [1, 1, 4], "tokens": [1, 128, 512], "past": [0, 0, 64]}}
    copy = shutil.copytree(onnx_dir, tmp_path / "graphs")                 # the fixture's directory stays as it is
    for g, chain in (("decode", "k3::moe_align"), ("prefill", "k3::moe_count")):   # 8 / 2048 tokens at most
        written = plugin_onnx(copy / f"{g}.onnx", g, manifest, profiles)
        assert written == copy / f"{g}.trt.onnx" and plugin_gaps(written) == {}
        model = onnx.load(str(written))
        assert model.graph.initializer                                      # the weights resolve from there
        moe_nodes = [n for n in model.graph.node if n.domain == "k3" and n.op_type.startswith("moe_")]
        assert f"k3::{moe_nodes[2].op_type}" == chain
        max_tokens = {onnx.helper.get_attribute_value(a) for n in moe_nodes for a in n.attribute
                      if a.name == "max_tokens"}
        assert max_tokens == ({8} if g == "decode" else {4 * 512})


def test_trt_attn_res_as_onnx_ops_matches_the_op():
    """The AttnRes node rewritten into standard ONNX ops (what TensorRT gets: there is no AttnRes plugin), run by
    onnxruntime, against `k3::attn_res` in fp32: 3 sealed blocks + p, one source with a 1e3 norm."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    import k3export.plugins.attn_res.op  # noqa: F401
    from k3export.trt_onnx import rewrite
    torch.manual_seed(0)
    N, n, d = 5, 3, 64
    bank, p = torch.randn(N, n, d), torch.randn(N, d)
    bank[:, 1] *= 1e3
    nw, pw = torch.randn(d), torch.randn(1, d)
    node = helper.make_node("attn_res", ["bank", "p", "nw", "pw"], ["out"], domain="k3", eps=1e-6)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("bank", TensorProto.FLOAT, [N, n, d]),
                                        helper.make_tensor_value_info("p", TensorProto.FLOAT, [N, d])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [N, d])],
                          [numpy_helper.from_array(nw.numpy(), "nw"), numpy_helper.from_array(pw.numpy(), "pw")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)])
    out, made = rewrite(model, "decode", TensorProto.FLOAT, 1, 1)
    assert not any(k.startswith("k3::") for k in made)
    onnx.checker.check_model(out, full_check=True)
    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"bank": bank.numpy(), "p": p.numpy()})[0]
    ref = torch.ops.k3.attn_res(bank, p, nw, pw, 1e-6)
    assert (torch.from_numpy(got) - ref).abs().max() / ref.abs().max() < 1e-6

