"""Export ladder: eager == exported programs re-loaded from disk, the graph contract (k3 op counts, no guards),
the driver that runs prefill -> decode -> decode from the graphs alone, and refusals of bad input."""

import dataclasses

import pytest
import torch

from k3export.config import K3Config
from k3export.export import ExportLimits, OUTPUTS, expected_k3_ops, export_graphs, guard_nodes, k3_op_counts
from k3export.exported import ExportedK3, GraphInputError
from k3export.generate import generate
from k3export.manifest import ManifestError, checkpoint_fingerprint, load_manifest
from k3export.model import K3Model
from k3export.model.weights import random_model, save_checkpoint

# Exported vs eager, fp32, relative (max-abs / max|eager|): the same aten ops in the same order; measured 0 for
# prefill and up to 3e-7 for decode (reductions over a differently sliced cache).
EXACT = 1e-6
LIMITS = ExportLimits(max_batch=4, max_tokens=32, max_cache=64)
SEED = 0


def small_tiny() -> K3Config:
    """k3-tiny cut to 4 layers (3 KDA + 1 MLA, dense layer 0, two AttnRes blocks): every op kind, half the nodes."""
    c = K3Config.from_name("k3-tiny")
    lac = dataclasses.replace(c.linear_attn_config, kda_layers=(), full_attn_layers=())
    return dataclasses.replace(c, num_hidden_layers=4, attn_res_block_size=2, linear_attn_config=lac)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint")
    save_checkpoint(random_model(small_tiny(), seed=SEED), out)
    return out


@pytest.fixture(scope="session")
def model(checkpoint):
    return K3Model.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="session")
def graph_dir(model, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("graphs")
    export_graphs(model, out, LIMITS, {"weights": checkpoint_fingerprint(checkpoint), "checkpoint": str(checkpoint)},
                  log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def exported(graph_dir):
    return ExportedK3(graph_dir)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def state_inputs(model, B, past, cache_len, seed):
    """A random (never zero) state with `past` cache rows, of which cache_len[b] are valid."""
    g = torch.Generator().manual_seed(seed)
    st = model.new_state(B, max(past, 1))
    return (torch.randn(st.kda_conv.shape, generator=g) * 0.5, torch.randn(st.kda_state.shape, generator=g) * 0.1,
            torch.randn(st.mla_cache[:, :, :past].shape, generator=g), torch.tensor(cache_len))


def test_graphs_hold_exactly_the_k3_ops_and_no_guards(exported, model):
    for name, ep in exported.programs.items():
        want = expected_k3_ops(model.config, name)
        assert k3_op_counts(ep) == want == exported.manifest["graphs"][name]["k3_ops"]
        assert guard_nodes(ep) == []
        # Only the named dims are symbolic, with the exported ranges (no extra data-dependent symbols).
        ranges = sorted((int(r.lower), int(r.upper)) for r in ep.range_constraints.values())
        dims = LIMITS.dims()
        want_ranges = sorted(dims[d] for d in (("batch", "tokens", "past") if name == "prefill" else ("batch", "cache")))
        assert ranges == want_ranges
    assert expected_k3_ops(model.config, "decode") == {"attn_res": 8, "kda_decode": 3, "mla_decode": 1,
                                                      "moe_routed": 3}


@pytest.mark.parametrize("B,T,past,lengths,cache_len", [
    (1, 1, 0, [1], [0]),                      # one token, fresh
    (2, 5, 0, [5, 2], [0, 0]),                # mixed lengths, fresh
    (3, 9, 7, [9, 4, 1], [7, 0, 3]),          # continued prefill, mixed cache lengths
    (4, 32, 64, [32, 32, 17, 3], [64, 5, 0, 40]),   # at the exported maxima
])
def test_prefill_matches_eager(exported, model, B, T, past, lengths, cache_len):
    conv, state, cache, clen = state_inputs(model, B, past, cache_len, seed=T)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(B))
    inputs = dict(input_ids=ids, lengths=torch.tensor(lengths), kda_conv=conv, kda_state=state, mla_cache=cache,
                  cache_len=clen)
    with torch.no_grad():
        eager = dict(zip(OUTPUTS, model.forward_prefill(**inputs)))
    got = exported.run("prefill", inputs)
    for k in OUTPUTS:
        assert got[k].shape == eager[k].shape and got[k].dtype == eager[k].dtype
        assert rel(got[k], eager[k]) <= EXACT, k


@pytest.mark.parametrize("B,L,cache_len", [(1, 1, [1]), (3, 9, [9, 4, 0]), (4, 64, [64, 1, 33, 7])])
def test_decode_matches_eager(exported, model, B, L, cache_len):
    conv, state, cache, clen = state_inputs(model, B, L, cache_len, seed=L)
    inputs = dict(input_ids=torch.arange(B) * 7 % model.config.vocab_size, kda_conv=conv, kda_state=state,
                  mla_cache=cache, cache_len=clen)
    with torch.no_grad():
        eager = dict(zip(OUTPUTS, model.forward_decode(**inputs)))
    got = exported.run("decode", inputs)
    for k in OUTPUTS:
        assert got[k].shape == eager[k].shape
        assert rel(got[k], eager[k]) <= EXACT, k


def test_generation_from_exported_programs_alone_matches_eager(exported, model):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 7], [200, 100, 50]]
    assert generate(exported, prompts, 5) == generate(model, prompts, 5)


def test_chunked_prefill_then_decode_matches_eager(exported, model):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    states = [model.new_state(2, 24), exported.new_state(2, 24)]
    logits = []
    for runner, st in zip((model, exported), states):
        a = runner.prefill(ids[:, :7], st, [7, 4])          # first chunk, mixed lengths
        b = runner.prefill(ids[:, 7:], st, [5, 5])          # continued from the cache
        c = runner.decode(b[:, -1].argmax(-1), st)
        logits.append((a, b, c))
    for x, y in zip(*logits):
        assert rel(y, x) <= EXACT
    assert torch.equal(states[0].lengths, states[1].lengths)
    assert rel(states[1].mla_cache, states[0].mla_cache) <= EXACT


def test_inputs_beyond_the_exported_maxima_are_refused(exported):
    st = exported.new_state(2, 80)
    with pytest.raises(GraphInputError, match=r"tokens\) = 33 is outside the exported range \[1, 32\].*--max-tokens"):
        exported.prefill(torch.zeros(2, 33, dtype=torch.int64), st)
    with pytest.raises(GraphInputError, match=r"batch\) = 5 .*\[1, 4\]"):
        exported.prefill(torch.zeros(5, 3, dtype=torch.int64), exported.new_state(5, 8))
    st.lengths.fill_(65)
    with pytest.raises(GraphInputError, match=r"cache\) = 65 .*\[1, 64\].*--max-cache"):
        exported.decode(torch.zeros(2, dtype=torch.int64), st)
    bad = dict(input_ids=torch.zeros(1, dtype=torch.int64), kda_conv=st.kda_conv[:, :1].double(),
               kda_state=st.kda_state[:, :1], mla_cache=st.mla_cache[:, :1, :4], cache_len=torch.tensor([4]))
    with pytest.raises(GraphInputError, match="kda_conv: dtype torch.float64.*float32"):
        exported.run("decode", bad)


def test_mismatched_manifest_is_refused_saying_what_differs(graph_dir, model, checkpoint, tmp_path):
    with pytest.raises(ManifestError, match="config hash: graphs .*, checkpoint deadbeef"):
        ExportedK3(graph_dir, config_hash="deadbeef")
    other = tmp_path / "other"                                # same config, other weights
    save_checkpoint(random_model(small_tiny(), seed=SEED + 1), other)
    theirs = checkpoint_fingerprint(other)
    with pytest.raises(ManifestError, match=f"weights: graphs exported from {checkpoint_fingerprint(checkpoint)}, "
                                            f"given {theirs}"):
        ExportedK3(graph_dir, config_hash=model.config.hash(), weights=theirs)
    have = load_manifest(graph_dir)["versions"]["torch"]
    with pytest.raises(ManifestError, match=f"torch version: graphs exported with {have}, running 2.0.0"):
        ExportedK3(graph_dir, versions={"torch": "2.0.0"})


def test_meta_device_export_has_the_same_graphs_and_cannot_run(tmp_path):
    with torch.device("meta"):
        meta = K3Model(small_tiny())
    man = export_graphs(meta, tmp_path, LIMITS, {"weights": "meta:test"}, log=lambda *_: None)
    assert man["meta"] and man["graphs"]["decode"]["k3_ops"] == expected_k3_ops(small_tiny(), "decode")
    with pytest.raises(ManifestError, match="meta device: its graphs carry no weights"):
        ExportedK3(tmp_path)


def _meta_model():
    with torch.device("meta"):
        return K3Model(small_tiny())


def test_reexport_removes_stale_onnx_and_an_interrupted_one_leaves_no_manifest(tmp_path, monkeypatch):
    for stale in ("prefill.onnx", "decode.onnx", "decode.onnx.data"):
        (tmp_path / stale).write_bytes(b"old")
    export_graphs(_meta_model(), tmp_path, LIMITS, {"weights": "meta:test"}, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.pt2", "manifest.json", "prefill.pt2"]
    save = torch.export.save

    def save_prefill_only(ep, path):                   # the process dies while saving the decode graph
        if "decode" in str(path):
            raise KeyboardInterrupt
        save(ep, path)

    monkeypatch.setattr(torch.export, "save", save_prefill_only)
    with pytest.raises(KeyboardInterrupt):
        export_graphs(_meta_model(), tmp_path, LIMITS, {"weights": "meta:test"}, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.pt2", "prefill.pt2"]   # no temp files either
    with pytest.raises(ManifestError, match="no manifest.json: not a graph directory"):
        ExportedK3(tmp_path)


def _copy_graphs(graph_dir, tmp_path):
    import shutil
    return shutil.copytree(graph_dir, tmp_path / "graphs")


def test_changed_missing_or_corrupt_graph_files_are_refused(graph_dir, tmp_path):
    d = _copy_graphs(graph_dir, tmp_path)
    with open(d / "decode.pt2", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ManifestError, match="decode.pt2 differs from the manifest \\(sha256\\)"):
        ExportedK3(d)
    (d / "prefill.pt2").unlink()
    with pytest.raises(ManifestError, match="prefill.pt2 is missing"):
        ExportedK3(d, check_files=False)
    (d / "manifest.json").write_text('{"format": "k3export.gr')
    with pytest.raises(ManifestError, match="manifest.json is corrupt \\(not valid JSON"):
        ExportedK3(d)


def test_cli_onnx_and_verify_name_a_missing_graph_file(graph_dir, tmp_path):
    from click.testing import CliRunner
    from k3export.cli import main
    d = _copy_graphs(graph_dir, tmp_path)
    (d / "decode.pt2").unlink()
    for cmd in ("onnx", "verify"):
        r = CliRunner().invoke(main, [cmd, "--graphs", str(d)])
        assert r.exit_code == 1 and "decode.pt2 is missing" in r.output and r.exception.__class__ is SystemExit, \
            (cmd, r.output, r.exception)


def test_aoti_build_refuses_a_graph_file_that_differs_from_its_manifest(model, graph_dir, tmp_path):
    """The AOTI package cache is keyed by the manifest's sha256, so a changed file must be refused first."""
    from k3export.build import EngineError, build
    d = _copy_graphs(graph_dir, tmp_path)
    with open(d / "prefill.pt2", "ab") as f:
        f.write(b"\0")
    with pytest.raises(EngineError, match="prefill.pt2 differs from the manifest"):
        build("aoti", model, tmp_path / "engines", graphs=d, echo=lambda *_: None)


def test_op_checker_catches_a_kernel_that_differs_from_its_twin():
    """verify's per-op check on a GPU (`OpChecker`), exercised on the CPU with a throwaway k3 op whose 'kernel'
    is 1% off its reference: the checker reports 1e-2 for it, the program still gets the kernel's result, and
    `reference_ops` switches the kernel off."""
    from k3export.verify import OpChecker, reference_ops

    @torch.library.custom_op("k3::selftest_scale", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    scale.register_kernel("cpu")(lambda x: x * 2.02)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with OpChecker("cpu") as checker:
        y = torch.ops.k3.selftest_scale(x)
    assert torch.equal(y, x * 2.02)
    assert checker.calls["k3::selftest_scale"] == 1
    assert checker.worst["k3::selftest_scale"][0] == pytest.approx(0.01, rel=1e-4)
    with reference_ops("cpu"):
        assert torch.equal(torch.ops.k3.selftest_scale(x), x * 2)


def test_op_checker_reports_a_non_finite_kernel_output_as_infinite():
    from k3export.verify import OpChecker

    @torch.library.custom_op("k3::selftest_nan", mutates_args=())
    def nan_op(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    nan_op.register_kernel("cpu")(lambda x: x + float("nan"))
    with OpChecker("cpu") as checker:
        torch.ops.k3.selftest_nan(torch.ones(4))
    assert checker.worst["k3::selftest_nan"] == [float("inf")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_export_device_refusals_and_cuda_graphs_on_a_cpu_machine(graph_dir, tmp_path):
    """`export --device cuda` without a GPU, a bad device and `--meta --device cuda` are refused by name; graphs
    whose manifest says cuda are refused by verify on a machine without one (before any model is built)."""
    import json

    from click.testing import CliRunner
    from k3export.cli import main
    for extra, words in ((["--device", "cuda"], "no CUDA device here"), (["--device", "tpu"], "use cpu or cuda"),
                         (["--device", "cuda", "--meta"], "takes no --device")):
        r = CliRunner().invoke(main, ["export", "--preset", "k3-tiny", "--out", str(tmp_path / "g"), *extra])
        assert r.exit_code != 0 and words in r.output, (extra, r.output)
        assert not (tmp_path / "g" / "manifest.json").exists()
    d = _copy_graphs(graph_dir, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    assert m["device"] == "cpu"
    m["device"] = "cuda"
    (d / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", "--graphs", str(d), "--no-onnx"])
    assert r.exit_code != 0 and "exported on cuda" in r.output, r.output
