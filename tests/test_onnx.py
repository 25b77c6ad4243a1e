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
    reason (one node per op against one plugin per kernel launch, no aot=1, no AttnRes / MoE-prefill chain); a node
    that is its one plugin with aot=1 passes the check (`build_trt.plugin_gaps`; TensorRT itself never runs here)."""
    import onnx
    from onnx import helper
    from k3export.build_trt import plugin_gaps
    pre, dec = plugin_gaps(onnx_dir / "prefill.onnx", "prefill"), plugin_gaps(onnx_dir / "decode.onnx", "decode")
    assert set(pre) == {"kda_prefill", "mla_prefill", "moe_routed", "attn_res"}
    assert set(dec) == {"kda_decode", "mla_decode", "moe_routed", "attn_res"}
    assert "k3::kda_prefill_intra, k3::kda_prefill_chunks" in pre["kda_prefill"]
    assert "no AOT chain" in pre["moe_routed"] and "6 plugins" in dec["moe_routed"]
    assert dec["kda_decode"] == "no aot=1 attribute on the node" and "no AttnRes plugin" in dec["attn_res"]
    nodes = [helper.make_node("kda_decode", ["a"], ["b"], domain="k3", aot=1),
             helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("mystery", ["c"], ["d"], domain="k3")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(g), tmp_path / "m.onnx")
    assert plugin_gaps(tmp_path / "m.onnx", "decode") == {"mystery": "no plugin registered under this name"}

