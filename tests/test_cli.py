"""The CLI: init -> generate round trip, shapes, and specific errors on bad input."""

import json

import torch
from click.testing import CliRunner

from k3export.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_init_then_generate_is_deterministic(tmp_path):
    r = run("init", "--preset", "k3-tiny", "--out", str(tmp_path / "a"))
    assert r.exit_code == 0 and "wrote k3-tiny checkpoint" in r.output and str(tmp_path / "a") in r.output
    run("init", "--preset", "k3-tiny", "--out", str(tmp_path / "b"))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    g = run("generate", "--checkpoint", str(tmp_path / "a"), "--ids", "1,2,3;4,5", "--max-new-tokens", "4")
    assert g.exit_code == 0 and g.output.count("->") == 2 and "8 tokens for 2 prompt(s)" in g.output
    s1 = run("generate", "--checkpoint", str(tmp_path / "a"), "--ids", "1,2", "--temperature", "0.8",
             "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    s2 = run("generate", "--checkpoint", str(tmp_path / "a"), "--ids", "1,2", "--temperature", "0.8",
             "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    assert s1.output.splitlines()[0] == s2.output.splitlines()[0]


def test_generate_bad_input_errors():
    r = run("generate", "--preset", "k3-tiny", "--ids", "1,999")
    assert r.exit_code != 0 and "outside [0, 256)" in r.output
    r = run("generate", "--preset", "k3-tiny", "--ids", "a,b")
    assert r.exit_code != 0 and "expected token ids" in r.output
    r = run("generate", "--preset", "k3-tiny", "--ids", "1", "--top-p", "0")
    assert r.exit_code != 0 and "top_p must lie in (0, 1]" in r.output


def test_init_refuses_full_model(tmp_path):
    r = run("init", "--preset", "k3", "--out", str(tmp_path / "x"))
    assert r.exit_code != 0 and "cannot be materialised" in r.output and not (tmp_path / "x").exists()


def test_init_mxfp4_experts_need_group_multiples(tmp_path):
    """k3-tiny's experts (24 x 32) cannot be grouped by 32: refused up front, nothing written (the MXFP4 writer and
    loader themselves are tested in tests/test_weights_mxfp4.py on a tiny config with 64 x 32 experts)."""
    r = run("init", "--preset", "k3-tiny", "--out", str(tmp_path / "x"), "--experts-format", "mxfp4-blocks")
    assert r.exit_code != 0 and "multiples of 32" in r.output and not (tmp_path / "x").exists()


def test_shapes_full_k3_tp8():
    r = run("shapes", "--preset", "k3", "--tp", "8", "--tokens", "16")
    assert r.exit_code == 0
    out = r.output
    assert "6284 columns, padded to 6288" in out
    assert "[4608, 3]" in out and "[12, 128, 128]" in out
    assert "576 latent values vs 30720" in out and "53.3x" in out
    assert "[16, 8, 7168]" in out
    j = run("shapes", "--preset", "k3-tiny", "--json", "--tokens", "4")
    data = json.loads(j.output)
    assert data["layers"]["MLA + LatentMoE"]["layer"] == 3


def test_demo_runs_end_to_end(tmp_path, monkeypatch):
    """`k3export demo` end to end; its engine (the best backend on a CPU: AOTInductor) is also the suite's AOTI
    engine test, so that the AOTI compile (~2 min on 2 cores) runs once: packages built from the exported graphs,
    loaded without the model code, eager's greedy tokens; a second build of the same graphs reuses the cached
    packages instead of compiling, and a child process opens that engine and runs a decode step (load check)."""
    from k3export.build import build, load_engine
    from k3export.generate import generate
    from k3export.model import K3Model
    from k3export.runtime import Generator
    monkeypatch.setenv("K3EXPORT_CACHE", str(tmp_path / "cache"))
    demo = tmp_path / "demo"
    r = run("demo", "--out", str(demo))
    assert r.exit_code == 0, r.output
    assert (demo / "checkpoint" / "model.safetensors").exists()
    gen = json.loads((demo / "generate.json").read_text())
    assert gen["tokens"] and gen["tokens"] == gen["eager"], gen
    path = demo / "engines" / "k3-tiny-fp32-cpu-aoti"
    m = json.loads((path / "manifest.json").read_text())
    assert {"prefill.aoti.pt2", "decode.aoti.pt2", "weights.safetensors"} <= set(m["files"])
    assert any(k.startswith("aoti compile") for k in m["build"]["seconds"])
    assert m["aoti"]["extern_ops"] == ["attn_res", "kda_decode", "kda_prefill", "mla_decode", "mla_prefill",
                                       "moe_routed"]           # CPU: every k3 op stays a call to its reference
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
    model = K3Model.from_pretrained(demo / "checkpoint", dtype=torch.float32)
    engine = load_engine(path, max_batch=2, max_len=32)       # three prompts in two slots
    assert Generator(engine).generate(prompts, 5) == generate(model, prompts, 5)
    again = build("aoti", model, tmp_path / "engines", graphs=demo / "graphs", echo=lambda *_: None,
                  load_check=True)
    log = (again / "build.log").read_text()
    assert "reused cached package" in log and "aoti compile" not in log
    assert json.loads((again / "manifest.json").read_text())["load_check"]["ok"]   # a child process ran a step


def test_demo_backend_choices_are_the_build_backends(tmp_path):
    """`demo --backend` offers `build`'s backends that the main job's pipeline serves (all but megakernel, a bf16
    one-sequence kernel) and "best"; an unknown one is refused before any work."""
    from k3export.build import BACKENDS, DEMO_BACKENDS
    from k3export.commands import demo
    opt = next(p for p in demo.params if p.name == "backend")
    assert tuple(opt.type.choices) == ("best", *DEMO_BACKENDS) and opt.default == "best"
    assert set(BACKENDS) - set(DEMO_BACKENDS) == {"megakernel"}
    r = run("demo", "--out", str(tmp_path / "d"), "--backend", "nope")
    assert r.exit_code != 0 and "nope" in r.output and not (tmp_path / "d").exists()


def test_more_bad_input_gives_a_message_not_a_traceback(tmp_path):
    cases = [(["generate", "--ids", "1,2", "--stop", "abc"], "expected comma-separated token ids"),
             (["generate", "--ids", "1,2", "--max-new-tokens", "-3"], "must be >= 1, got -3"),
             (["generate", "--ids", "1,2", "--max-new-tokens", "0"], "must be >= 1, got 0"),
             (["generate", "--ids", "", "--device", "cpu"], "no prompt token ids"),
             (["generate", "--ids", ";", "--device", "cpu"], "no prompt token ids"),
             (["generate", "--ids", "1", "--device", "nonsense"], "Invalid value for '--device'"),
             (["run", "--engine", str(tmp_path), "--ids", ""], "no prompt token ids"),
             (["run", "--engine", str(tmp_path), "--ids", "1", "--stop", "x"], "expected comma-separated"),
             (["bench", "moe", "--tiles", "m64t32-n128"], "unknown tiling(s) m64t32-n128"),      # FP8's, bf16 asked
             (["bench", "moe", "--precision", "fp8", "--phases", "prefill", "--tiles", "m64t32-aw8"],
              "unknown tiling(s) m64t32-aw8"),                                                # bf16's, FP8 asked
             (["bench", "moe", "--precision", "fp8", "--tiles", "m128-tma-aw"], "unknown tiling(s) m128-tma-aw"),
             (["bench", "moe", "--precision", "fp16"], "Invalid value for '--precision'"),
             (["bench", "model", "--device", "cpu", "--batches", "0"], "Invalid value for '--batches'"),
             (["bench", "moe", "--tokens", "4096,0"], "token counts must be >= 1"),
             (["bench", "model", "--device", "cpu", "--contexts", "8,x"], "Invalid value for '--contexts'"),
             (["bench", "model", "--device", "cpu", "--backends", "eager,nope"], "unknown backend(s) nope"),
             (["bench", "model", "--device", "cpu", "--rounds", "0"], "Invalid value for '--rounds'")]
    if not torch.cuda.is_available():
        cases.append((["generate", "--ids", "1", "--device", "cuda"], "CUDA is not available here"))
        cases += [(["bench", name], f"bench {name} needs a CUDA GPU") for name in ("kda", "mla", "moe", "layer", "fp8")]
        cases += [([*cmd, "--device", "cuda"], "--device cuda: CUDA is not available here")
                  for cmd in (["bench", "model"], ["build", "--backend", "eager", "--out", str(tmp_path)],
                              ["calibrate", "--preset", "k3-tiny"], ["demo", "--out", str(tmp_path)])]
    for args, msg in cases:
        r = CliRunner().invoke(main, args)
        assert r.exit_code in (1, 2) and isinstance(r.exception, SystemExit) and msg in r.output, (args, r.output)


def test_generate_and_run_sample_the_same_tokens(tmp_path):
    """Same preset weights (seed 0), prompts and sampling seed: `generate` (eager, one batch) and `run` (an
    eager engine, continuous batching with two slots for three prompts) print the same tokens."""
    b = run("build", "--backend", "eager", "--preset", "k3-tiny", "--device", "cpu", "--out", str(tmp_path),
            "--max-batch", "2", "--max-len", "64")
    assert b.exit_code == 0, b.output
    engine = tmp_path / "k3-tiny-fp32-cpu-eager"
    opts = ["--ids", "1,2,3;7,7;9,8,7,6", "--max-new-tokens", "5", "--temperature", "0.9", "--top-k", "30",
            "--seed", "4"]
    g = run("generate", "--preset", "k3-tiny", "--device", "cpu", *opts)
    r = run("run", "--engine", str(engine), *opts)
    assert g.exit_code == 0 and r.exit_code == 0, (g.output, r.output)
    assert "2 slots" in r.output
    assert g.output.splitlines()[:3] == r.output.splitlines()[:3]
    if not torch.cuda.is_available():
        c = CliRunner().invoke(main, ["run", "--engine", str(engine), "--device", "cuda", *opts])
        assert c.exit_code == 1 and "CUDA is not available here" in c.output, c.output
