"""FP8 calibration: recipes (resolution and rejection), exact amax recording, deterministic scales, the scales
file and its receipt, NaN detection, token files and the CLI. All on k3-tiny with a few tokens (CPU, seconds)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from k3export.calibrate import (DEFAULT_RECIPE, AmaxObserver, CalibrationError, Recipe, RecipeError, calibrate,
                                default_batches, load_scales, load_token_file, make_receipt, model_hash,
                                save_scales)
from k3export.config import K3Config
from k3export.fp8 import FP8_MAX
from k3export.model.weights import random_model

CFG = K3Config.from_name("k3-tiny")


def small_batches(seed=1234):
    return default_batches(CFG.vocab_size, n_seqs=2, seq_len=8, batch=2, seed=seed)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def recipe():
    return Recipe.load(DEFAULT_RECIPE)


@pytest.fixture(scope="module")
def scales(model, recipe):
    return calibrate(model, recipe, small_batches(), progress=False)


def default_dict():
    return json.loads(DEFAULT_RECIPE.read_text())


# ------------------------------------------------------------------------------------------------ recipes
def test_default_recipe_resolves_to_the_gemms_and_keeps_the_sensitive_ones(model, recipe):
    targets = recipe.resolve(model)
    n_kda, n_mla = len(CFG.kda_layers), len(CFG.mla_layers)
    n_moe = CFG.num_hidden_layers - CFG.first_k_dense_replace
    # KDA: q, k, v, g, o; MLA: q_a, q_b, kv_a, g, o; dense MLP 3; MoE: down, up, shared 3; plus each expert bank
    expect_linear = 5 * n_kda + 5 * n_mla + 3 * CFG.first_k_dense_replace + 5 * n_moe
    assert sum(k == "linear" for k in targets.values()) == expect_linear
    assert sum(k == "experts" for k in targets.values()) == n_moe
    for kept in ("lm_head", ".f_a_proj", ".f_b_proj", ".b_proj", ".kv_b_proj", ".gate", "norm", "_res_proj"):
        assert not any(n.endswith(kept) for n in targets), kept


@pytest.mark.parametrize("pattern, message", [
    ("model.layers.*.self_attn.qq_proj", "unknown module pattern 'model.layers.*.self_attn.qq_proj'"),
    ("kda_state", "names decoding state ('kda_state')"),
    ("model.layers.*.mla_cache", "names decoding state ('mla_cache')"),
    ("model.layers.*.self_attn.A_log", "matches parameter(s)"),
    ("model.layers.*.input_layernorm", "which is not a GEMM"),
    ("model.layers.*.block_sparse_moe.gate", "which is not a GEMM"),
])
def test_bad_quantize_patterns_are_rejected_with_the_pattern_named(model, pattern, message):
    d = default_dict()
    d["quantize"].append(pattern)
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(d).resolve(model)
    assert message in str(e.value)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(quantise=[]), "unknown recipe field(s) ['quantise']"),
    (lambda d: d.update(format="float8_e5m2"), "only 'float8_e4m3fn'"),
    (lambda d: d["activations"].update(method="mse"), "activations.method"),
    (lambda d: d["activations"].update(percentile=0), "activations.percentile"),
    (lambda d: d["weights"].update(granularity="per_block"), "weights.granularity"),
    (lambda d: d["keep"].update({"lm_haed": "typo"}), "unknown module pattern 'lm_haed' in keep"),
    (lambda d: d["keep"].update({"lm_head": ""}), "keep: must map"),
    (lambda d: d.update(quantize=[]), "quantize: must be a non-empty list"),
])
def test_malformed_recipes_are_rejected(model, edit, message):
    d = default_dict()
    edit(d)
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(d).resolve(model)
    assert message in str(e.value)


# ------------------------------------------------------------------------------------------------ observers
def test_amax_is_exact_on_constructed_inputs():
    o = AmaxObserver("m", "max", 99.99)
    o.update(torch.tensor([[0.5, -7.25], [3.0, 1.0]]))
    o.update(torch.tensor([6.0, -2.0]))
    assert o.amax.item() == 7.25
    p = AmaxObserver("m", "percentile", 99.0)
    p.update(torch.arange(1, 1001, dtype=torch.float32).neg())        # |x| = 1..1000: 99th percentile is 990
    p.update(torch.arange(1, 101, dtype=torch.float32))               # 99th percentile 99: the max keeps 990
    assert p.amax.item() == 990.0


def test_model_amax_equals_the_directly_computed_input(model, scales):
    # Layer 0 attention sees the embedding itself (no bank yet): q_proj's input is input_layernorm(embed(ids)).
    ids = torch.cat(small_batches())
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    assert scales["model.layers.0.self_attn.q_proj.input_amax"].item() == x.abs().max().item()
    assert scales["model.layers.0.self_attn.q_proj.input_scale"].item() == pytest.approx(x.abs().max().item() / FP8_MAX,
                                                                                         rel=1e-7)
    # per-channel weight scales: |W| max per output row / 448
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(scales["model.layers.0.self_attn.q_proj.weight_scale"], w.abs().amax(1) / FP8_MAX)
    bank = "model.layers.1.block_sparse_moe.experts"
    assert 0 < scales[f"{bank}.w2_input_amax"].item() <= 4.0 * 25.0      # SiTU-GLU output is bounded by beta*lb
    assert scales[f"{bank}.w13_scale"].shape == (CFG.num_experts, 2 * CFG.moe_intermediate_size)


def test_scales_are_deterministic_for_a_seed(model, recipe, scales):
    again = calibrate(random_model(CFG, seed=0), recipe, small_batches(), progress=False)
    assert again.keys() == scales.keys()
    assert all(torch.equal(again[k], scales[k]) for k in scales)
    other = calibrate(model, recipe, small_batches(seed=99), progress=False)
    assert not torch.equal(other["model.layers.2.self_attn.o_proj.input_amax"],
                           scales["model.layers.2.self_attn.o_proj.input_amax"])


def test_per_tensor_and_percentile_options(model, recipe):
    s = calibrate(model, recipe.replace(granularity="per_tensor", method="percentile", percentile=90.0),
                  small_batches(), progress=False)
    assert s["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    assert s["model.layers.1.block_sparse_moe.experts.w13_scale"].shape == (CFG.num_experts,)


def test_nan_activation_stops_with_the_layer_named(recipe):
    bad = random_model(CFG, seed=0)
    with torch.no_grad():
        bad.model.layers[2].input_layernorm.weight[3] = float("nan")
    with pytest.raises(CalibrationError, match=r"model\.layers\.2\.self_attn\.\w+ \(layer 2\)"):
        calibrate(bad, recipe, small_batches(), progress=False)


# ------------------------------------------------------------------------------------------------ the file
def test_scales_file_roundtrip_with_receipt(tmp_path, model, recipe, scales):
    batches = small_batches()
    receipt = make_receipt(model, recipe, batches, "test", scales)
    path = save_scales(tmp_path / "s.safetensors", scales, receipt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]          # no temporary left behind
    table, r = load_scales(path)
    assert all(torch.equal(table[k], scales[k]) for k in scales)
    assert r["model_sha256"] == model_hash(model) != model_hash(random_model(CFG, seed=1))
    assert r["recipe"]["quantize"] == list(recipe.quantize) and len(r["data_sha256"]) == 64
    assert r["modules"] == {"linear": 88, "experts": 8}


def test_token_files(tmp_path):
    (tmp_path / "a.json").write_text("[[1, 2, 3, 4], [5, 6, 7]]")
    (tmp_path / "b.txt").write_text("1, 2, 3\n4 5 6 7\n\n")
    (tmp_path / "c.txt").write_text("1 2 999")
    assert torch.equal(load_token_file(tmp_path / "a.json", 256)[0], torch.tensor([[1, 2, 3], [5, 6, 7]]))
    assert torch.equal(load_token_file(tmp_path / "b.txt", 256)[0], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(CalibrationError, match="outside"):
        load_token_file(tmp_path / "c.txt", 256)


def test_cli_calibrate_and_report(tmp_path):
    from k3export.cli import main
    (tmp_path / "ids.txt").write_text("1 2 3 4 5 6 7 8\n9 10 11 12 13 14 15 16\n")
    out = tmp_path / "tiny.safetensors"
    r = CliRunner().invoke(main, ["calibrate", "--preset", "k3-tiny", "--dtype", "float32", "--device", "cpu",
                                  "--data", str(tmp_path / "ids.txt"), "--out", str(out), "--report",
                                  "--report-tokens", "2", "--report-len", "8"])
    assert r.exit_code == 0, r.output
    assert out.exists() and "88 linear(s) and 8 expert bank(s)" in r.output
    rep = json.loads((tmp_path / "tiny.report.json").read_text())
    assert set(rep["fp8"]) == {"logits", "greedy", "layers", "worst_layer"}
    assert len(rep["fp8"]["layers"]) == CFG.num_hidden_layers
    assert rep["onnx_oracle"]["QuantizeLinear"] == 3 and rep["onnx_oracle"]["rel_err"] < 1e-6
    bad = CliRunner().invoke(main, ["calibrate", "--preset", "k3-tiny", "--device", "cpu",
                                    "--recipe", str(tmp_path / "nope.json")])
    assert bad.exit_code != 0 and "no recipe at" in bad.output
