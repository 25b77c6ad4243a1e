"""Engine directories: each CPU backend gives eager's greedy tokens on k3-tiny; bad directories are refused."""

import json
import shlex
import shutil
from pathlib import Path

import click
import pytest
import torch

from k3export.build import (EngineError, EngineLoadError, TensorRTMissing, build, check_engine_dir, engine_name,
                            load_engine, open_backend, profiles_for)
from k3export.build_trt import profile_shapes
from k3export.config import K3Config
from k3export.generate import generate
from k3export.model.weights import random_model, save_checkpoint
from k3export.runtime import Generator

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
PROFILES = profiles_for(max_batch=4, max_tokens=16, max_len=32)


@pytest.fixture(scope="module")
def model():
    return random_model(K3Config.from_name("k3-tiny"), seed=0)


@pytest.fixture(scope="module")
def reference(model):
    return generate(model, PROMPTS, 5)


@pytest.fixture(scope="module")
def eager_dir(model, tmp_path_factory):
    return build("eager", model, tmp_path_factory.mktemp("engines"), profiles=PROFILES, echo=lambda *_: None)


def tokens(path, device="cpu"):
    return Generator(load_engine(path, max_batch=2, max_len=32, device=device)).generate(PROMPTS, 5)


def test_eager_engine_dir(eager_dir, reference):
    assert eager_dir.name == "k3-tiny-fp32-cpu-eager"
    m = json.loads((eager_dir / "manifest.json").read_text())
    assert m["backend"] == "eager" and m["config_hash"] == K3Config.from_name("k3-tiny").hash()
    assert set(m["files"]) == {"weights.safetensors"} and m["files"]["weights.safetensors"]["bytes"] > 0
    assert m["state_layout"]["mla_cache"]["shape"] == [3, "batch", "cache", 32]
    assert "write weights" in (eager_dir / "build.log").read_text()
    assert tokens(eager_dir) == reference


@pytest.mark.slow
def test_compile_engine_matches_eager(model, reference, tmp_path):
    """torch.compile backend (Inductor, CPU), with the packed projections and fused AttnRes norms it serves with,
    gives eager's greedy tokens. Two prompts in two slots, so prefill (batch 2) and decode (batch 2) compile once
    each (~1 min on 2 CPU cores). (It was also compiled apart from an engine directory in test_runtime.py: the same
    model and prompts, one compile fewer now.)"""
    import os
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    path = build("compile", model, tmp_path, profiles=PROFILES, echo=lambda *_: None)
    assert (path / "inductor-cache").is_dir()
    engine = load_engine(path, max_batch=2, max_len=32)
    # through both serving swaps (packed projections, `k3::attn_res_norm`), which Inductor traces
    assert engine.backend.packed > 0 and engine.backend.fused == 2
    out = Generator(engine).generate(PROMPTS[:2], 5)
    assert out == reference[:2]
    assert any((path / "inductor-cache").iterdir())                      # the compiles wrote their code there
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before          # and only they: the process's is unchanged


# The AOTI engine (compiled packages, load check, eager's tokens, the second build reusing the cached packages) is
# checked on the demo's engine in tests/test_cli.py::test_demo_runs_end_to_end: one AOTI compile for both.


# ---------------------------------------------------------------------------------------------- FP8 engines
def _scales_file(model, path):
    """`k3export calibrate`'s scales file for `model` on the embedded default set, written to `path`."""
    from k3export.calibrate import DEFAULT_RECIPE, Recipe, calibrate, default_batches, make_receipt, save_scales
    batches = default_batches(model.config.vocab_size)
    scales = calibrate(model, Recipe.load(DEFAULT_RECIPE), batches, progress=False)
    return save_scales(path, scales, make_receipt(model, Recipe.load(DEFAULT_RECIPE), batches, "embedded default",
                                                  scales)), scales


@pytest.fixture(scope="module")
def fp8_case(tmp_path_factory):
    """k3-tiny in bf16, a scales file calibrated on it (`k3export calibrate`'s writer) and the greedy tokens of
    the same model quantized in process."""
    import copy
    from k3export.fp8 import quantize_model
    model = random_model(K3Config.from_name("k3-tiny"), seed=0, dtype=torch.bfloat16)
    path, scales = _scales_file(model, tmp_path_factory.mktemp("scales") / "tiny.safetensors")
    fp8 = copy.deepcopy(model)
    quantize_model(fp8, scales)
    return model, path, generate(fp8, PROMPTS, 5)


def test_fp8_onnx_runs_in_onnxruntime(tmp_path):
    """A float32 FP8 export's ONNX runs end to end in onnxruntime: its Q/DQ nodes in onnxruntime's own kernels,
    each `k3.moe_routed_fp8` node as a Python op on the torch reference (E4M3 weights handed over as their bytes);
    `verify` runs it by default and it matches the re-quantized eager model (measured on k3-tiny: 1.8e-6 relative
    at worst, the decode's KDA state: the fp32 bound 1e-3 holds with room). On k3-tiny cut to 4 layers (every op
    kind, 3 MoE layers: half the nodes to export and convert)."""
    from click.testing import CliRunner
    from k3export.cli import main
    from test_export import small_tiny
    model = random_model(small_tiny(), seed=0, dtype=torch.float32)
    scales, _ = _scales_file(model, tmp_path / "tiny32.safetensors")
    ckpt = tmp_path / "ckpt"
    save_checkpoint(model, ckpt)
    d = tmp_path / "graphs"
    r = CliRunner().invoke(main, ["export", "--checkpoint", str(ckpt), "--dtype", "float32", "--scales", str(scales),
                                  "--max-batch", "4", "--max-tokens", "64", "--max-cache", "128", "--out", str(d)])
    assert r.exit_code == 0, r.output
    assert CliRunner().invoke(main, ["onnx", "--graphs", str(d)]).exit_code == 0
    r = CliRunner().invoke(main, ["verify", "--graphs", str(d)])
    assert r.exit_code == 0 and "verify: OK" in r.output and "onnx rel" in r.output, r.output
    assert "its k3.moe_routed_fp8 nodes on the torch reference" in r.output, r.output
    rows = [ln.split() for ln in r.output.splitlines() if ln.startswith(("prefill ", "decode "))]
    assert len(rows) == 8 and all(float(row[5]) < 1e-4 for row in rows), r.output      # onnx rel, far inside 1e-3


def test_fp8_onnx_needs_e4m3_initializers(tmp_path):
    """The CPU check hands E4M3 expert weights to its Python op as bytes: a `moe_routed_fp8` node whose weight
    is not an E4M3 initializer is refused by name."""
    import onnx
    from onnx import TensorProto, helper
    from k3export.onnx_export import _e4m3_inputs_as_uint8
    names = ["x", "z", "gw", "bias", "w13", "w2", "s13", "s2", "sz", "sh"]
    node = helper.make_node("moe_routed_fp8", names, ["u"], domain="k3", name="moe0")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                            for n in names], [helper.make_tensor_value_info("u", TensorProto.FLOAT,
                                                                                            None)])
    with pytest.raises(ValueError, match="moe0 input w13 .* is not an E4M3 initializer"):
        _e4m3_inputs_as_uint8(helper.make_model(graph), "m.onnx")
    w = helper.make_tensor("w13", TensorProto.FLOAT8E4M3FN, [2, 2], [0.5, 1.0, -2.0, 448.0])
    graph.initializer.append(w)
    graph.initializer.append(helper.make_tensor("w2", TensorProto.FLOAT8E4M3FN, [1, 2], [1.5, -0.25]))
    model = helper.make_model(graph)
    assert _e4m3_inputs_as_uint8(model, "m.onnx") == 2
    got = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert list(model.graph.node[0].input[4:6]) == ["w13__e4m3_bytes", "w2__e4m3_bytes"] and "w13" not in got
    e4m3 = torch.tensor([0.5, 1.0, -2.0, 448.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert got["w13__e4m3_bytes"].tolist() == e4m3.reshape(2, 2).tolist()


def test_fp8_engine_runs_the_calibrated_model_from_disk(fp8_case, tmp_path):
    """`build --scales`: the engine stores the E4M3 weights and scales and names the scales file in its manifest;
    re-loaded from disk (a fresh model skeleton, nothing from the build process) it gives the greedy tokens of
    the model quantized in process."""
    import copy
    from k3export.build import quantize_for_engine
    model, scales, want = fp8_case
    m = copy.deepcopy(model)
    quant = quantize_for_engine(m, scales)
    path = build("eager", m, tmp_path, profiles=PROFILES, echo=lambda *_: None, quant=quant)
    assert path.name == "k3-tiny-bf16-fp8-cpu-eager"
    man = json.loads((path / "manifest.json").read_text())
    assert man["quant"]["scheme"] == "fp8-e4m3" and man["quant"]["scales"] == scales.name
    assert man["quant"]["quantized"] == {"linear": 88, "experts": 8} and len(man["quant"]["scales_sha256"]) == 64
    from safetensors import safe_open
    with safe_open(str(path / "weights.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(("qweight", ".w13", ".w2"))}
    assert dtypes == {"F8_E4M3"}
    assert tokens(path) == want


@pytest.mark.cuda
def test_fp8_compile_engine_on_the_gpu(tmp_path):
    """FP8 engines built on the GPU: the `compile` one (packed projections, the FP8 GEMV and expert kernels,
    CUDA-graph decode) gives the greedy tokens of the `eager` one. The model is k3-tiny in fp32 (FP8 weights, fp32
    activations): random weights are chaotic in 16-bit activations, where compile and eager differ by O(1) in
    the logits within a few steps already in bf16 without FP8 (scripts/fp8_compile_probe.py, docs/perf.md)."""
    from k3export.build import quantize_for_engine
    model = random_model(K3Config.from_name("k3-tiny"), seed=0, device="cuda")
    path, _ = _scales_file(model, tmp_path / "s.safetensors")
    quant = quantize_for_engine(model, path)
    eager = build("eager", model, tmp_path, profiles=PROFILES, echo=lambda *_: None, quant=quant)
    comp = build("compile", model, tmp_path, profiles=PROFILES, echo=lambda *_: None, quant=quant)
    assert comp.name.startswith("k3-tiny-fp32-fp8-") and comp.name.endswith("-compile")
    assert json.loads((comp / "manifest.json").read_text())["device"] == "cuda"
    assert tokens(comp, "cuda") == tokens(eager, "cuda")


def test_fp8_engine_refuses_scales_of_other_weights_dtypes_and_backends(fp8_case, tmp_path):
    from click.testing import CliRunner
    from k3export.build import build_command, quantize_for_engine
    model, scales, _ = fp8_case
    other = random_model(K3Config.from_name("k3-tiny"), seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="calibrated on other weights"):
        quantize_for_engine(other, scales)
    with pytest.raises(ValueError, match="calibrated on the bf16 model, this one is fp32; build with --dtype bf16"):
        quantize_for_engine(random_model(K3Config.from_name("k3-tiny"), seed=0), scales)
    from test_export import small_tiny                            # k3-tiny cut to 4 layers: another config
    with pytest.raises(ValueError, match="calibrated for config .* recalibrate for this model"):
        quantize_for_engine(random_model(small_tiny(), seed=0, dtype=torch.bfloat16), scales)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable scales file"):
        quantize_for_engine(model, junk)
    for backend, why in (("aoti", "FP8 engines are built for the eager, compile and tensorrt backends, not aoti"),
                         ("tensorrt", "an FP8 TensorRT engine is built from FP8 ONNX graphs: `k3export export "
                                      "--scales FILE ...`, then `k3export onnx")):
        r = CliRunner().invoke(build_command, ["--backend", backend, "--dtype", "bf16", "--scales", str(scales),
                                               "--out", str(tmp_path)])
        assert r.exit_code == 1 and why in " ".join(r.output.split()), r.output
    assert not any(tmp_path.glob("*-fp8-*"))                     # refused before anything was written
    r = CliRunner().invoke(build_command, ["--backend", "eager", "--scales", str(scales), "--out", str(tmp_path)])
    assert r.exit_code == 1 and "--dtype bf16" in r.output, r.output                    # the default dtype is fp32
    r = CliRunner().invoke(build_command, ["--backend", "best", "--dtype", "bf16", "--scales", str(scales),
                                           "--out", str(tmp_path)])
    assert r.exit_code == 0 and "88 linears and 8 expert banks" in r.output, r.output
    assert (tmp_path / "k3-tiny-bf16-fp8-cpu-eager" / "manifest.json").exists()       # best = eager on a CPU


def test_fp8_graphs_for_tensorrt(tmp_path):
    """On k3-tiny cut to 4 layers (every op kind, 3 MoE layers; half of k3-tiny's nodes to export, convert and
    verify), the FP8 TensorRT path up to TensorRT itself: `export --scales` writes FP8 graphs (`k3::fp8_linear` and
    `k3::moe_routed_fp8` nodes, the manifest's `quant` entry); `onnx` turns them into Q/DQ + one bare
    `k3.moe_routed_fp8` node per MoE layer; `verify` re-quantizes the eager reference from the recorded scales
    file and the re-loaded .pt2 matches it; the builder's ONNX rewrite leaves no node TensorRT could not take in
    either graph, and `build --dry-run` builds every plugin node (FP8 and bf16 graphs); `build --backend tensorrt
    --scales` passes its FP8 checks and stops only at the missing TensorRT, and refuses unquantized graphs, graphs
    of other scales, and FP8 graphs without --scales."""
    import onnx
    from click.testing import CliRunner
    from k3export.build_trt import onnx_inputs, plugin_gaps, plugin_onnx
    from k3export.calibrate import DEFAULT_RECIPE, Recipe
    from k3export.cli import main
    from k3export.fp8_onnx import qdq_census
    from k3export.manifest import file_sha256, load_manifest, write_manifest
    from test_export import small_tiny
    cfg = small_tiny()
    model = random_model(cfg, seed=0, dtype=torch.bfloat16)
    targets = Recipe.load(DEFAULT_RECIPE).resolve(model)
    n_lin = sum(k == "linear" for k in targets.values())
    n_exp = len(targets) - n_lin
    assert n_exp == cfg.num_hidden_layers - cfg.first_k_dense_replace > 0 and n_lin > 0
    ckpt = tmp_path / "ckpt"
    save_checkpoint(model, ckpt)
    scales, _ = _scales_file(model, tmp_path / "small.safetensors")
    d = tmp_path / "graphs"
    common = ["--checkpoint", str(ckpt), "--dtype", "bfloat16", "--max-batch", "4", "--max-tokens", "64",
              "--max-cache", "128"]
    r = CliRunner().invoke(main, ["export", *common, "--scales", str(scales), "--out", str(d)])
    assert r.exit_code == 0 and f"FP8: quantized {{'linear': {n_lin}, 'experts': {n_exp}}}" in r.output, r.output
    gm = load_manifest(d)
    assert gm["quant"]["scales_sha256"] == file_sha256(scales) and gm["quant"]["quantized"]["experts"] == n_exp
    for g in ("prefill", "decode"):
        ops = gm["graphs"][g]["k3_ops"]
        assert ops["fp8_linear"] == n_lin and ops["moe_routed_fp8"] == n_exp and "moe_routed" not in ops, ops
    r = CliRunner().invoke(main, ["onnx", "--graphs", str(d)])
    assert r.exit_code == 0, r.output
    dec = onnx.load(str(d / "decode.onnx"), load_external_data=False)
    c = qdq_census(dec)
    assert (c["QuantizeLinear"], c["DequantizeLinear"], len(c["fp8_weights"])) == (n_lin, 2 * n_lin, n_lin + 2 * n_exp)
    assert sum(n.op_type == "moe_routed_fp8" for n in dec.graph.node) == n_exp
    r = CliRunner().invoke(main, ["verify", "--graphs", str(d)])   # bf16: the ONNX check is float32 only, so this
    assert r.exit_code == 0 and "FAIL" not in r.output, r.output    # is the --no-onnx check (pt2 vs eager)
    assert "the ONNX is not run: onnxruntime runs it on the CPU in float32" in r.output, r.output
    r = CliRunner().invoke(main, ["verify", "--graphs", str(d), "--onnx"])
    assert r.exit_code != 0 and "these are bfloat16: verify with --no-onnx" in r.output, r.output
    moved = tmp_path / "moved"                                  # the scales file gone: the reference cannot be built
    shutil.copytree(d, moved)
    gm_moved = load_manifest(moved)
    gm_moved["quant"]["scales_path"] = str(tmp_path / "nowhere.safetensors")
    write_manifest(moved, gm_moved)
    r = CliRunner().invoke(main, ["verify", "--graphs", str(moved), "--no-onnx"])
    assert r.exit_code != 0 and "nowhere.safetensors is gone" in r.output, r.output
    r = CliRunner().invoke(main, ["export", "--preset", "k3-tiny", "--meta", "--scales", str(scales), "--out",
                                  str(tmp_path / "meta")])
    assert r.exit_code == 1 and "--scales quantizes the weights" in r.output, r.output
    engine = {"config": gm["config"], "precision": "bf16", "config_hash": gm["config_hash"], "quant": gm["quant"]}
    profiles = {"decode": {"batch": [1, 4, 4], "cache": [1, 64, 128]},
                "prefill": {"batch": [1, 1, 4], "tokens": [1, 32, 64], "past": [0, 0, 64]}}
    _, files = onnx_inputs(d, engine)
    # decode: 4 tokens x top-3 = 12 pairs over 8 experts (weight-only); prefill: 4 x 64 tokens (W8A8)
    for g, gemm in (("prefill", "moe_fp8_gemm1"), ("decode", "moe_fp8_wo_gemm1")):
        written = plugin_onnx(files[g], g, engine, profiles)
        assert plugin_gaps(written) == {}
        ops = {n.op_type for n in onnx.load(str(written), load_external_data=False).graph.node if n.domain == "k3"}
        assert "moe_routed_fp8" not in ops and gemm in ops, ops
    with pytest.raises(EngineError, match="holds FP8 graphs .* build with --scales"):
        onnx_inputs(d, {**engine, "quant": None})
    # --dry-run: everything but TensorRT, on both graphs: every plugin node built against its registration on the
    # stand-in and its PTX compiled; trt-plan.json beside the graphs
    r = CliRunner().invoke(main, ["build", "--backend", "tensorrt", "--dry-run", "--graphs", str(d), "--scales",
                                  str(scales)])
    assert r.exit_code == 0 and "every plugin node builds and compiles" in r.output, r.output
    plan = json.loads((d / "trt-plan.json").read_text())
    assert plan["fp8"] and plan["plugins"]["prefill"]["moe_fp8_gemm1"]["nodes"] == n_exp
    assert plan["plugins"]["decode"]["moe_fp8_wo_gemm1"]["kernels"] == ["moe_fp8_wo_gemm1_trt_kernel"]
    assert plan["plugins"]["decode"]["kda_decode"]["nodes"] == len(cfg.kda_layers)
    build_args = ["build", "--backend", "tensorrt", "--checkpoint", str(ckpt), "--dtype", "bf16", "--scales",
                  str(scales), "--out", str(tmp_path / "engines")]
    r = CliRunner().invoke(main, [*build_args, "--graphs", str(d)])
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert r.exit_code == 1 and "TensorRT is not installed" in r.output, r.output   # past the FP8 checks
    plain = tmp_path / "plain"                                  # unquantized graphs of the same checkpoint
    r = CliRunner().invoke(main, ["export", *common, "--out", str(plain)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, [*build_args, "--graphs", str(plain)])
    assert r.exit_code == 1 and "holds unquantized graphs" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--backend", "tensorrt", "--dry-run", "--graphs", str(plain)])
    assert r.exit_code == 1 and "has no ONNX graphs; run `k3export onnx" in r.output, r.output
    assert CliRunner().invoke(main, ["onnx", "--graphs", str(plain)]).exit_code == 0
    r = CliRunner().invoke(main, ["build", "--backend", "tensorrt", "--dry-run", "--graphs", str(plain)])
    assert r.exit_code == 0, r.output
    assert "moe_gemm1" in json.loads((plain / "trt-plan.json").read_text())["plugins"]["prefill"]
    r = CliRunner().invoke(main, ["build", "--backend", "eager", "--dry-run", "--graphs", str(plain)])
    assert r.exit_code == 2 and "--dry-run is for --backend tensorrt" in r.output, r.output
    from k3export.build import check_fp8_backend
    with pytest.raises(EngineError, match="quantized with another scales file"):
        check_fp8_backend("tensorrt", d, "0" * 64)
    assert not (tmp_path / "engines").exists() or not any((tmp_path / "engines").iterdir())


def test_engine_name_and_profile_limits(eager_dir):
    cfg = K3Config.from_name("k3-small")
    assert engine_name(cfg, torch.bfloat16, "cpu", "aoti") == "k3-small-bf16-cpu-aoti"
    with pytest.raises(EngineError, match="cache <= 32"):
        load_engine(eager_dir, max_batch=1, max_len=64)


def _copy(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_refuses_missing_truncated_and_corrupt(eager_dir, tmp_path):
    with pytest.raises(EngineError, match="no such engine directory"):
        check_engine_dir(tmp_path / "nope")
    d = _copy(eager_dir, tmp_path)
    w = d / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="weights.safetensors is corrupt: sha256"):
        check_engine_dir(d)
    w.write_bytes(bytes(data[:-100]))
    with pytest.raises(EngineError, match="weights.safetensors is truncated or altered: .* manifest says"):
        load_engine(d)
    w.unlink()
    with pytest.raises(EngineError, match="weights.safetensors is missing"):
        check_engine_dir(d)
    (d / "manifest.json").write_text('{"format": "k3export.engine/1", "backe')
    with pytest.raises(EngineError, match="manifest.json is corrupt"):
        check_engine_dir(d)
    (d / "manifest.json").unlink()
    with pytest.raises(EngineError, match="no manifest.json"):
        check_engine_dir(d)


def test_refuses_mismatched_config_versions_and_device(eager_dir, tmp_path):
    with pytest.raises(EngineError, match="config mismatch: engine built for config .*k3-tiny.*k3-small"):
        check_engine_dir(eager_dir, config=K3Config.from_name("k3-small"))
    d = _copy(eager_dir, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m.update(backend="aoti", device="cuda", gpu={"name": "NVIDIA H200", "capability": "9.0"})
    m["versions"]["torch"] = "2.0.0"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="torch version mismatch: built with 2.0.0") as e:
        check_engine_dir(d, device="cpu")
    assert "device mismatch: built for cuda, asked to run on cpu" in str(e.value)


def test_tensorrt_missing_says_how_to_install(model, tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here; this test checks the message when it is not")
    except ImportError:
        pass
    with pytest.raises(TensorRTMissing, match="TensorRT is not installed: install TensorRT 11 .*pip install"):
        build("tensorrt", model, tmp_path, echo=lambda *_: None)
    assert not any(tmp_path.iterdir())                          # refused before writing anything


def test_tensorrt_profiles_from_named_dims():
    """The optimisation-profile shapes TensorRT would get (plain data: runs without TensorRT)."""
    inputs = [{"name": "input_ids", "shape": ["batch"]}, {"name": "mla_cache", "shape": [3, "batch", "cache", 32]}]
    shapes = profile_shapes(inputs, {"batch": [1, 8, 64], "cache": [1, 1024, 4096]})
    assert shapes["mla_cache"] == ((3, 1, 1, 32), (3, 8, 1024, 32), (3, 64, 4096, 32))
    assert shapes["input_ids"] == ((1,), (8,), (64,))
    with pytest.raises(EngineError, match="dim 'cache' has no profile entry"):
        profile_shapes(inputs, {"batch": [1, 8, 64]})


def test_tensorrt_engine_matches_eager(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (not obtainable on these machines: see "
                        "docs/deployment-notes.md); the tensorrt backend is written against the TensorRT 11 API "
                        "but has never run")
    pytest.skip("needs ONNX graphs with k3 plugin nodes and a GPU; run on a TensorRT machine")


def test_bench_model_writes_json_table_and_plot(tmp_path):
    """Smoke run of `k3export bench model` (eager only, tiny sweep; the new-length prefill and generation rows of
    the defaults too): the artifacts exist and the napkin math is consistent (times are never asserted on)."""
    from click.testing import CliRunner
    from k3export.cli import main
    out = tmp_path / "bench"
    threads = torch.get_num_threads()                                # --threads sets it process-wide
    r = CliRunner().invoke(main, ["bench", "model", "--backends", "eager", "--prefill-lengths", "8", "--batches",
                                  "1,2", "--contexts", "8", "--warmup", "0", "--iters", "2", "--threads", "1",
                                  "--device", "cpu", "--out", str(out)])
    torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    rows = json.loads((out / "model.json").read_text())["rows"]
    assert [(x["phase"], x["batch"]) for x in rows] == [("prefill", 1), ("prefill new length", 1), ("decode", 1),
                                                        ("decode", 2), ("generate", 1), ("generate pipelined", 1),
                                                        ("generate sampled", 1), ("generate sampled pipelined", 1)]
    assert all(x["speedup"] == 1.0 and x["floor_ms"] > 0 for x in rows)
    assert rows[1]["floor_ms"] == rows[0]["floor_ms"]                 # --new-lengths (default): no buckets on CPU
    assert rows[4]["floor_ms"] == rows[2]["floor_ms"] and rows[5]["ms"] > 0     # --generate-tokens 32 (default)
    assert all(x["floor_ms"] == rows[2]["floor_ms"] and x["ms"] > 0 for x in rows[6:8])
    assert rows[3]["floor_ms"] > rows[2]["floor_ms"]                  # more sequences move more bytes
    assert "| decode | eager | 2 | 8 |" in (out / "model.md").read_text()
    assert (out / "model.png").stat().st_size > 0


def test_bench_model_rounds_pool_the_decode_samples(tmp_path):
    """`bench model --rounds 3`: the decode cases run twice more after the first pass (the backends kept built, in
    a rotated order), each decode row pooling its rounds' samples and keeping each round's median; prefill rows are
    timed once and carry no rounds (times are never asserted on)."""
    from click.testing import CliRunner
    from k3export.cli import main
    out = tmp_path / "bench"
    threads = torch.get_num_threads()
    r = CliRunner().invoke(main, ["bench", "model", "--backends", "eager", "--prefill-lengths", "8", "--batches",
                                  "1", "--contexts", "8", "--warmup", "0", "--iters", "2", "--rounds", "3",
                                  "--generate-tokens", "0", "--no-new-lengths", "--threads", "1", "--device", "cpu",
                                  "--out", str(out)])
    torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    rows = json.loads((out / "model.json").read_text())["rows"]
    assert [x["phase"] for x in rows] == ["prefill", "decode"]
    dec = rows[1]
    assert len(dec["rounds"]) == 3 and all(v > 0 for v in dec["rounds"]) and "rounds" not in rows[0]
    assert dec["p10"] <= dec["ms"] <= dec["p90"] and dec["x_floor"] == pytest.approx(dec["ms"] / dec["floor_ms"])
    assert not any(k.startswith("_") for x in rows for k in x)
    cmd = json.loads((out / "model.json").read_text())["meta"]["command"]
    assert "--rounds 3" in cmd and "--no-new-lengths" in cmd and "False" not in cmd
    from k3export.bench.model import model_bench         # the recorded command parses as the options it ran with
    assert shlex.split(cmd)[:3] == ["k3export", "bench", "model"]
    again = model_bench.make_context("model", shlex.split(cmd)[3:]).params
    assert again["rounds"] == 3 and again["new_lengths"] is False and again["out"] == out
    assert "Decode medians per round (ms): eager B 1 context 8: " in (out / "model.md").read_text()


def test_bench_model_keeps_going_past_a_backend_that_fails_while_timed(tmp_path, monkeypatch):
    """A backend that raises while timed (first pass, or a later --rounds round) is reported in `builds` and on the
    bar, and the run goes on: the other backends' rows are written, one that failed in round 2 keeps round 1, and the
    bar still ends full (a failed backend's cases counted as skipped).
    (Two stand-ins for compile variants, both eager underneath, so that this runs in seconds.)"""
    from click.testing import CliRunner
    from k3export.bench import model as bm
    from k3export.cli import main
    from k3export.runtime import EagerBackend
    make, run, samples = bm.make_backend, bm.run_backend, bm.decode_samples
    monkeypatch.setattr(bm, "make_backend", lambda name, model, *a, **k: (EagerBackend(model), False, {})
                        if name.startswith("compile") else make(name, model, *a, **k))
    def run_backend(name, *a):
        if name == "compile":
            raise RuntimeError("launch failed: boom")
        return run(name, *a)
    calls = {"n": 0}
    def decode_samples(backend, *a):
        calls["n"] += 1
        if calls["n"] > 2 and getattr(backend, "doomed", False):
            raise RuntimeError("illegal address")
        return samples(backend, *a)
    orig_eager = EagerBackend.__init__
    monkeypatch.setattr(bm, "run_backend", run_backend)
    monkeypatch.setattr(bm, "decode_samples", decode_samples)
    built = {"n": 0}
    def init(self, model):
        orig_eager(self, model)
        built["n"] += 1
        self.doomed = built["n"] == 3                                 # eager, compile, compile-frozen: the third
    monkeypatch.setattr(EagerBackend, "__init__", init)
    import tqdm
    bars = []
    class Bar(tqdm.tqdm):
        def close(self):
            bars.append((self.n, self.total))
            super().close()
    monkeypatch.setattr(tqdm, "tqdm", Bar)
    out = tmp_path / "bench"
    threads = torch.get_num_threads()
    r = CliRunner().invoke(main, ["bench", "model", "--backends", "eager,compile,compile-frozen", "--prefill-lengths",
                                  "8", "--batches", "1,2", "--contexts", "8", "--warmup", "0", "--iters", "2",
                                  "--rounds", "3", "--generate-tokens", "0", "--no-new-lengths", "--threads", "1",
                                  "--device", "cpu", "--out", str(out)])
    torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    assert bars == [(3 * (1 + 3 * 2), 3 * (1 + 3 * 2))]    # the bar ends full: the failed backends' cases skipped
    assert "compile: timing failed, its rows left out (RuntimeError: launch failed: boom)" in r.output
    assert "compile-frozen: round 2 failed" in r.output
    res = json.loads((out / "model.json").read_text())
    builds = res["meta"]["builds"]
    assert builds["compile"]["error"] == "timing: RuntimeError: launch failed: boom"
    assert builds["compile-frozen"]["error"] == "round 2: RuntimeError: illegal address"
    rows = {(x["phase"], x["backend"]): x for x in res["rows"]}
    assert set(rows) == {("prefill", "eager"), ("decode", "eager"), ("prefill", "compile-frozen"),
                         ("decode", "compile-frozen")}
    assert len(rows["decode", "eager"]["rounds"]) == 3 and "rounds" not in rows["decode", "compile-frozen"]


def test_every_bench_records_a_command_that_reruns_it():
    """Each `bench` subcommand records `command_line(ctx, ...)` with its results (not sys.argv, which under a test
    runner is the runner's). For every subcommand, with its defaults and with each non-default value this test can
    make (a flag flipped, a choice's other value, a number changed), the recorded line parses back into the same
    options."""
    from k3export.bench import bench, command_line
    checked = 0
    for name, cmd in bench.commands.items():
        cases = [[]]
        for p in cmd.params:
            if not isinstance(p, click.Option):
                continue
            if p.is_flag:
                cases.append([p.opts[0]] if not p.default else list(p.secondary_opts[:1]))
            elif isinstance(p.type, click.Choice):
                other = [c for c in p.type.choices if c != p.default]
                cases.append([p.opts[0], other[0]] if other else [])
            elif isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType)):
                cases.append([p.opts[0], "3"])
            elif p.type is click.STRING or isinstance(p.type, click.Path):
                cases.append([p.opts[0], "a b,c"])      # (a space: quoted)
        for args in cases:
            try:
                ctx = cmd.make_context(name, list(args))
            except click.BadParameter:              # (a value its option's check refuses: not a case)
                continue
            checked += 1
            line = command_line(ctx, f"k3export bench {name}")
            assert shlex.split(line)[:3] == ["k3export", "bench", name], line
            again = cmd.make_context(name, shlex.split(line)[3:]).params
            assert again == ctx.params, (name, args, line)
    assert len(bench.commands) >= 6 and checked >= 50, (sorted(bench.commands), checked)


def test_bench_mla_table_and_plot(tmp_path):
    """`bench mla`'s markdown table and plot from decode rows (the GPU writes the rows; this checks the rendering):
    cache GB/s and TFLOP/s from the graph-replay time, baselines only where measured."""
    from k3export.bench.mla import decode_table, plot
    res = {"date": "2026-11-30", "machine": "test", "copy_TBps": 4.0, "decode": [
        {"H": 96, "B": 1, "L": 1024, "ms": 0.07, "graph_ms": 0.02, "graph_frac_copy": 0.0138, "eager_ms": 0.2},
        {"H": 96, "B": 8, "L": 1024, "ms": 0.07, "graph_ms": 0.04, "graph_frac_copy": 0.0552}]}
    table = decode_table(res)
    assert "| 96 | 1 | 1024 | 0.070 | 0.020 | 59 | 1.4% | 11 | 0.200 |  |" in table             # 1.18 MB / 20 us
    assert table.count("\n| 96 |") == 2
    png = plot(res, tmp_path / "mla.png")
    assert png is None or png.stat().st_size > 0


def test_bench_moe_plot_summary_and_merge_script(tmp_path, capsys):
    """`bench moe`'s plot and summary from bf16 and E4M3 prefill rows and decode rows (the GPU writes them; this
    checks the rendering): rows without a time (skipped, failed) are left out, the fastest tiling per token count is
    the one within the error bound, and scripts/plot_moe.py merges two runs' JSON keeping the named tilings."""
    import json
    import subprocess
    import sys
    from k3export.bench.moe import plot, summary
    pre = lambda t, n, ms, f, **k: {"tokens": t, "tiles": n, "ms": ms, "frac_matmul": f, **k}  # noqa: E731
    res = {"date": "2026-12-01", "machine": "test", "copy_TBps": 4.0, "matmul_TFLOPs": 700.0,
           "prefill": [pre(4096, "a", 17.0, 0.36, err_vs_old=0.0, cap_frac_matmul=0.44),
                       pre(4096, "c", 18.7, 0.33, err_vs_old=0.0, default=True),
                       pre(8192, "a", 22.0, 0.52, err_vs_old=0.0, cap_frac_matmul=0.86),
                       {"tokens": 4096, "tiles": "b", "error": "skipped: time budget"}],
           "prefill_fp8": [pre(4096, "ptr", 13.5, 0.46, err_vs_ref=0.014), pre(4096, "t", 9.9, 0.62, err_vs_ref=0.013),
                           pre(4096, "bad", 5.0, 1.2, err_vs_ref=0.5)],
           "decode": [{"tokens": 1, "tiles": "d", "graph_ms": 0.28, "graph_frac_copy": 0.9}]}
    png = plot(res, tmp_path / "moe.png")
    assert png is None or png.stat().st_size > 0
    summary(res)
    out = capsys.readouterr().out
    assert "fastest prefill_fp8 tiling at 4096 tokens: t (9.90 ms, 62.0% of the bf16 matmul rate" in out
    assert "fastest prefill tiling at 4096 tokens: a" in out and "skipped: time budget" in out
    assert "default prefill tiling at 4096 tokens: c (18.70 ms, 1.10x the fastest)" in out
    one = {**res, "prefill": res["prefill"][:1], "prefill_fp8": [], "decode": []}
    paths = []
    for i, r in enumerate((one, {**res, "prefill": []})):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    script = Path(__file__).resolve().parents[1] / "scripts" / "plot_moe.py"
    run = subprocess.run([sys.executable, str(script), *map(str, paths), "--out", str(tmp_path / "m.png"),
                          "--tiles", "a,t"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    from importlib.util import module_from_spec, spec_from_file_location
    spec = spec_from_file_location("plot_moe", script)
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    merged, title = mod.merged(paths, {"a", "t"})
    assert [r["tiles"] for r in merged["prefill"]] == ["a"] and [r["tiles"] for r in merged["prefill_fp8"]] == ["t"]
    assert merged["decode"] == [] and "700 TFLOP/s" in title


def test_prefill_flops_count_the_lm_head_the_engine_runs():
    """The engine's prefill runs the lm_head on the last token only (`prefill_last`): the bench's FLOPs (and so its
    floor and TFLOP/s) drop by the other T - 1 rows' lm_head, 2 (T - 1) V d, and nothing else."""
    from k3export.bench.model import param_bytes, prefill_flops
    from k3export.config import K3Config
    c = K3Config.from_name("k3-tiny")
    pb = param_bytes(c, torch.bfloat16)
    full, last = (prefill_flops(c, torch.bfloat16, pb, 64, last_only=b) for b in (False, True))
    assert full - last == 2 * 63 * c.vocab_size * c.hidden_size and last > 0


def test_bench_table_rates_keep_their_digits():
    """The table's GB/s / TFLOP/s column: whole numbers for large rates, significant digits for a tiny preset's
    (which printed as "0 GB/s" and "0.0 TFLOP/s")."""
    from k3export.bench.model import _rate
    assert [_rate(v) for v in (3412.4, 41.66, 5.23, 0.00342, 0.0)] == ["3412", "41.7", "5.2", "0.0034", "0"]


def test_bench_compile_variants_say_what_they_turn_off(tmp_path):
    """Each `bench model` compile variant reports its serving swaps (what its JSON and table notes record);
    torch.compile is lazy, so nothing compiles here."""
    from k3export.bench.model import COMPILE_VARIANTS, make_backend
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    m = random_model(K3Config.from_name("k3-tiny"), seed=0)
    infos = {name: make_backend(name, m, tmp_path, {}, print)[2] for name in COMPILE_VARIANTS}
    assert infos["compile"] == {"packed_groups": infos["compile"]["packed_groups"], "fused_norm_swaps": 2,
                                "inplace_decode": True} and infos["compile"]["packed_groups"] > 0
    assert infos["compile-copy"]["inplace_decode"] is False and infos["compile-unfused"]["fused_norm_swaps"] == 0
    assert infos["compile-noadd"]["fused_norm_swaps"] == 1 and infos["compile-frozen"]["freezing"] is True
    assert infos["compile-combo"]["options"] == {"combo_kernels": True}


def test_tensorrt_reads_the_onnx_files_the_graph_manifest_names(model, tmp_path):
    """Plain data (runs without TensorRT): the graph directory is checked like aoti's, and the ONNX files come
    from the manifest's `onnx` entry."""
    from k3export.build_trt import onnx_inputs
    from k3export.manifest import FORMAT, library_versions, write_manifest
    engine = {"config_hash": model.config.hash()}
    gm = {"format": FORMAT, "config_hash": model.config.hash(), "versions": library_versions(), "graphs": {},
          "source": {"weights": "x"}}
    write_manifest(tmp_path, gm)
    with pytest.raises(EngineError, match="has no ONNX graphs; run `k3export onnx"):
        onnx_inputs(tmp_path, engine)
    gm["onnx"] = {"graphs": {"prefill": {"file": "p.onnx"}, "decode": {"file": "d.onnx"}}}
    write_manifest(tmp_path, gm)
    with pytest.raises(EngineError, match="p.onnx, .*d.onnx missing"):
        onnx_inputs(tmp_path, engine)
    (tmp_path / "p.onnx").write_bytes(b"")
    (tmp_path / "d.onnx").write_bytes(b"")
    assert onnx_inputs(tmp_path, engine)[1] == {"prefill": tmp_path / "p.onnx", "decode": tmp_path / "d.onnx"}
    with pytest.raises(EngineError, match="config hash: graphs .*, checkpoint deadbeef"):
        onnx_inputs(tmp_path, {"config_hash": "deadbeef"})
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(EngineError, match="manifest.json is corrupt"):
        onnx_inputs(tmp_path, engine)


def test_build_writes_leave_no_temporary_files(eager_dir):
    assert sorted(p.name for p in eager_dir.iterdir()) == ["build.log", "manifest.json", "weights.safetensors"]


def test_run_queues_prompts_beyond_the_profile_batch(eager_dir, reference):
    """Five prompts, a decode profile of batch <= 4: `run` takes 4 slots and the fifth prompt queues; with
    `--no-pipeline` (the plain loop) the same tokens."""
    from click.testing import CliRunner
    from k3export.cli import main
    prompts = PROMPTS + [[4, 4], [5]]
    r = CliRunner().invoke(main, ["run", "--engine", str(eager_dir), "--ids", ";".join(",".join(map(str, p))
                                  for p in prompts), "--max-new-tokens", "5", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "4 slots" in r.output and "pipelined decode: on" in r.output and "decode buckets: off" in r.output
    assert "time to first token: median" in r.output and "between tokens: median" in r.output
    assert r.output.splitlines()[:3] == [f"{p} -> {o}" for p, o in zip(PROMPTS, reference)]
    plain = CliRunner().invoke(main, ["run", "--engine", str(eager_dir), "--ids", ";".join(",".join(map(str, p))
                                      for p in prompts), "--max-new-tokens", "5", "--device", "cpu", "--no-pipeline"])
    assert plain.exit_code == 0 and "pipelined decode: off" in plain.output, plain.output
    assert plain.output.splitlines()[:5] == r.output.splitlines()[:5]            # the same tokens either way
    buckets = CliRunner().invoke(main, ["run", "--engine", str(eager_dir), "--ids", ";".join(",".join(map(str, p))
                                        for p in prompts), "--max-new-tokens", "5", "--device", "cpu",
                                        "--decode-buckets"])
    assert buckets.exit_code == 0 and buckets.output.splitlines()[:5] == r.output.splitlines()[:5], buckets.output
    assert "decode buckets: on" in buckets.output


def test_decode_buckets_refused_for_whole_state_programs():
    """AOTI / TensorRT programs take the whole (contiguous) state: `decode_buckets` is refused, naming the backend."""
    from types import SimpleNamespace

    from k3export.config import K3Config
    from k3export.runtime import Engine
    fake = SimpleNamespace(name="aoti", config=K3Config.from_name("k3-tiny"), dtype=torch.float32,
                           device=torch.device("cpu"), max_prefill_tokens=None)
    with pytest.raises(ValueError, match="the aoti backend's decode program takes the whole state"):
        Engine(fake, max_batch=2, max_len=8, decode_buckets=True)


def test_engine_built_for_cuda_without_cuda_is_refused_clearly(eager_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    d = _copy(eager_dir, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["device"] = "cuda"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError, match="CUDA is not available here"):
        load_engine(d, max_batch=1, max_len=8)


def test_load_check_runs_a_decode_step_in_a_child(model, tmp_path):
    path = build("eager", model, tmp_path / "engines", profiles=PROFILES, echo=lambda *_: None, load_check=True)
    m = json.loads((path / "manifest.json").read_text())
    assert m["load_check"]["ok"] and m["load_check"]["seconds"] > 0
    assert "load check" in (path / "build.log").read_text()
    assert "load_check" not in json.loads(build("eager", model, tmp_path / "e2", profiles=PROFILES,
                                                echo=lambda *_: None).joinpath("manifest.json").read_text())


def test_a_crashing_load_check_is_recorded_and_the_engine_refused(model, tmp_path, monkeypatch):
    """What the H200 did with every CUDA AOTI package (SIGSEGV in aoti_load_package), simulated: the build says
    so, the manifest keeps it, and opening the engine is refused with the reason instead of crashing."""
    import k3export.build as B
    monkeypatch.setattr(B, "LOAD_CHECK", "import faulthandler, os, signal; faulthandler.enable(); "
                                         "os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(EngineLoadError, match="killed by SIGSEGV.*--backend compile"):
        build("eager", model, tmp_path / "engines", profiles=PROFILES, echo=lambda *_: None, load_check=True)
    path = tmp_path / "engines" / "k3-tiny-fp32-cpu-eager"
    m = json.loads((path / "manifest.json").read_text())
    assert m["load_check"]["ok"] is False and "SIGSEGV" in m["load_check"]["error"]
    with pytest.raises(EngineError, match="refusing engine.*killed by SIGSEGV"):
        open_backend(path)
    monkeypatch.setattr(B, "LOAD_CHECK", "import sys; sys.exit('no package here')")
    with pytest.raises(EngineLoadError, match="exited with 1: no package here"):
        build("eager", model, tmp_path / "engines", profiles=PROFILES, echo=lambda *_: None, load_check=True)


def test_main_job_falls_back_to_compile_when_the_engine_cannot_load(model, tmp_path, monkeypatch):
    import k3export.build as B
    from k3export.pipeline import build_engine
    real = B.build

    def fake(backend, *a, **kw):
        if backend == "aoti":
            raise EngineLoadError("built X, but a process that loads it fails on this machine: killed by SIGSEGV")
        return real(backend, *a, profiles=PROFILES, **kw)
    monkeypatch.setattr(B, "build", fake)
    said = []
    backend, path = build_engine("aoti", model, tmp_path / "engines", tmp_path / "graphs", "w", said.append)
    assert backend == "compile" and path.name == "k3-tiny-fp32-cpu-compile"
    assert any("WARNING" in s and "SIGSEGV" in s for s in said) and any("falling back" in s for s in said)


def test_critical_path_charges_each_kernel_what_it_adds_to_the_span():
    """`bench.ceilings.critical_path` on a constructed timeline: a kernel inside its predecessor adds nothing, one
    that overlaps adds its tail, a gap is idle; exposed + idle = span."""
    from k3export.bench.ceilings import critical_path
    cp = critical_path([("b", 5.0, 12.0), ("a", 0.0, 10.0), ("c", 6.0, 8.0), ("a", 15.0, 16.0)])
    assert cp["span"] == 16.0 and cp["idle"] == 3.0 and cp["busy"] == 20.0
    assert cp["by_name"] == {"a": [2, 11.0], "b": [1, 2.0], "c": [1, 0.0]}
    assert cp["span"] == cp["idle"] + sum(v[1] for v in cp["by_name"].values())
    assert critical_path([]) == {"span": 0.0, "idle": 0.0, "busy": 0.0, "by_name": {}}
