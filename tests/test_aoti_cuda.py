"""AOTI engine on the GPU: the k3 Triton kernels are compiled into the packages, which then load and run in a
process that never imports k3export (so no k3 op is registered there), and match the eager model.

Model: k3-small cut to 4 layers (3 KDA + 1 MLA, K3's head dims, so every k3 kernel applies), bf16. Bound: the
packages' outputs vs eager's (same kernels, same weights, same inputs), max-abs / max|eager| per output <=
AOTI_TOL. Eager rounds every op's output to bf16; Inductor fuses the norms, gates and residual adds around the
k3 ops and rounds once, and the lowering takes one MLA decode split count and the MoE tiling at the largest
batch (docs in k3export/aoti_lower.py), so the two differ by bf16 roundings: verify's eager-vs-graph bound for
bf16 (1e-2) doubled for the fused ops. Measured on the H200: printed by the test (not yet run at writing)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from k3export.build import build, profiles_for
from k3export.build_aoti import GRAPHS, package_name
from k3export.export import example_inputs, expected_k3_ops, io_specs
from k3export.model.weights import random_model
from test_gpu_graphs import small4

pytestmark = pytest.mark.cuda

AOTI_TOL = 2e-2
K3_OPS = ("attn_res", "kda_decode", "kda_prefill", "mla_decode", "mla_prefill", "moe_routed")
# Prefill: two sequences of different length (one past the KDA chunk of 64), one continuing a cached prefix.
# Decode: three sequences at different cache lengths.
PREFILL = ({"batch": 2, "tokens": 100, "past": 40}, {"lengths": [100, 37], "cache_len": [40, 0]})
DECODE = ({"batch": 3, "cache": 200}, {"cache_len": [200, 65, 1]})

LOADER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    engine, work, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    if sys.argv[5] == "plugins":             # a package with extern k3 calls (the build fell back): measure anyway
        import k3export.plugins
    weights = load_file(f"{engine}/weights.safetensors", device="cuda")
    inputs = torch.load(f"{work}/inputs.pt")
    out = {}
    for g in ("prefill", "decode"):
        pkg = torch._inductor.aoti_load_package(f"{engine}/{g}.aoti.pt2")
        fqns = pkg.get_constant_fqns()
        pkg.load_constants({f: weights[f.removeprefix(prefix)] for f in fqns}, check_full_update=True,
                           user_managed=True)
        out[g] = [t.cpu() for t in pkg(*[x.cuda() for x in inputs[g]])]
    torch.save({"out": out, "k3_ops": [op for op in sys.argv[4].split(",") if hasattr(torch.ops.k3, op)],
                "k3export": sorted(m for m in sys.modules if m.startswith("k3export"))}, f"{work}/out.pt")
""")


def case(cfg, dtype, graph: str, sizes: dict, lens: dict) -> list[torch.Tensor]:
    inputs = example_inputs(io_specs(cfg, dtype)[graph]["inputs"], sizes, vocab=cfg.vocab_size, seed=3,
                            device="cuda")
    for name, vals in lens.items():
        inputs[name] = torch.tensor(vals, device="cuda")
    return list(inputs.values())


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.xfail(reason="on the H200 (2026-11-30 01:35, torch 2.11, Triton 3.6) every k3 op compiled into the "
                          "packages, but loading them crashed (SIGSEGV in aoti_load_package), as does a toy Linear's "
                          "CUDA package in a process that imports only torch (scripts/aoti_toy.py, 03:10, "
                          "docs/perf.md); the build's load check now raises EngineLoadError there instead", strict=False)
def test_aoti_cuda_packages_hold_the_kernels_load_without_k3export_and_match_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("K3EXPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("K3EXPORT_AOTI_KERNELS", "1")                # compiling the kernels in is opt-in
    cfg, dtype = small4(), torch.bfloat16
    model = random_model(cfg, seed=0, dtype=dtype, device="cuda")
    path = build("aoti", model, tmp_path / "engines", profiles=profiles_for(max_batch=4, max_tokens=128, max_len=256),
                 echo=print)
    m = json.loads((path / "manifest.json").read_text())
    print("build seconds:", m["build"]["seconds"])
    reports = m["aoti"]["kernels"]
    for g in GRAPHS:
        print(f"{g}: {json.dumps(reports[g])}")
        assert (path / package_name(g)).stat().st_size > 0
    extern = m["aoti"]["extern_ops"]

    inputs = {"prefill": case(cfg, dtype, "prefill", *PREFILL), "decode": case(cfg, dtype, "decode", *DECODE)}
    with torch.no_grad():
        eager = {"prefill": model.forward_prefill(*inputs["prefill"]),
                 "decode": model.forward_decode(*inputs["decode"])}
    torch.save({g: [x.cpu() for x in v] for g, v in inputs.items()}, tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-c", LOADER, str(path), str(tmp_path), m["aoti"]["constant_prefix"],
                          ",".join(K3_OPS), "plugins" if extern else "none"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")

    lengths = PREFILL[1]["lengths"]
    valid = torch.arange(PREFILL[0]["tokens"])[None, :] < torch.tensor(lengths)[:, None]     # [B, T]
    worst = {}
    for g in GRAPHS:
        for name, a, ref in zip(("logits", "kda_conv", "kda_state", "mla_rows"), got["out"][g], eager[g]):
            ref = ref.cpu()
            if g == "prefill" and name == "logits":                           # padded rows are unspecified
                a, ref = a[valid], ref[valid]
            if g == "prefill" and name == "mla_rows":
                a, ref = a[:, valid], ref[:, valid]
            worst[f"{g}.{name}"] = rel(a, ref)
        logits = got["out"][g][0].float()
        ref = eager[g][0].float().cpu()
        if g == "prefill":
            logits, ref = logits[valid], ref[valid]
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{g}: greedy token agreement with eager {agree:.3f}")
    print("aoti vs eager, max-abs / max|eager|:", {k: f"{v:.2e}" for k, v in worst.items()})
    assert max(worst.values()) <= AOTI_TOL, worst
    for g in GRAPHS:                                                            # every k3 op compiled in
        assert reports[g]["compiled_in"] == expected_k3_ops(cfg, g) and reports[g]["extern"] == {}, reports[g]
    assert extern == [] and got["k3_ops"] == [] and got["k3export"] == [], got  # loaded without the model's code
