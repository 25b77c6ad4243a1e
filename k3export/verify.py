"""Stage `verify`: eager model vs exported programs (re-loaded from disk) vs ONNX, on the same inputs.

One table: per graph and output, max-abs and relative error (max|a - b| / max|b|, b = eager) of the exported
program and of the ONNX graph; a graph file whose sha256 differs from the manifest is reported too. Any row
over its tolerance fails the run (non-zero exit from the CLI).
"""

from __future__ import annotations

from pathlib import Path

import click
import torch

from k3export.export import OUTPUTS, example_inputs
from k3export.manifest import ManifestError, checkpoint_fingerprint, file_sha256, load_manifest

# Relative-error tolerances (max-abs / max|eager|), per path and model dtype, each with its reason.
TOL = {
    # Same aten ops in the same order as eager: measured 0 (prefill) to 3e-7 (decode) on k3-tiny fp32.
    ("pt2", "float32"): 1e-5,
    # bf16 activations: one bf16 rounding (2^-8) can flip between paths if op order differs at all.
    ("pt2", "bfloat16"): 1e-2,
    # onnxruntime's own CPU kernels (MLAS matmuls, other reductions): measured 3.6e-5 on k3-tiny prefill with
    # random state; fp32 eager itself sits 4.3e-5 from fp64 on those inputs, so 1e-3 is ~10x the noise.
    ("onnx", "float32"): 1e-3,
}
GEN_TOKENS = 3
# Inputs per graph: dim sizes and per-sequence lengths (mixed lengths, continued prefill, mixed cache lengths).
CASES = {
    "prefill": ({"batch": 2, "tokens": 7, "past": 5}, {"lengths": [7, 3], "cache_len": [5, 2]}),
    "decode": ({"batch": 3, "cache": 9}, {"cache_len": [9, 4, 1]}),
}


def eager_model(manifest: dict, checkpoint: str | None = None):
    """The eager model the graphs claim to come from: `checkpoint`, or the manifest's source."""
    from k3export.config import K3Config
    from k3export.model import K3Model
    from k3export.model.weights import random_model
    dtype = getattr(torch, manifest["dtype"])
    src = manifest["source"]
    if checkpoint is None and "checkpoint" in src:
        checkpoint = src["checkpoint"]
    if checkpoint is not None:
        return K3Model.from_pretrained(checkpoint, dtype=dtype), checkpoint_fingerprint(checkpoint)
    if "preset" in src:
        from k3export.manifest import preset_fingerprint
        return (random_model(K3Config.from_dict(manifest["config"]), seed=src["seed"], dtype=dtype),
                preset_fingerprint(src["preset"], src["seed"], dtype))
    raise ManifestError("the manifest names no checkpoint or preset; pass --checkpoint")


def case_inputs(manifest: dict, graph: str) -> dict[str, torch.Tensor]:
    sizes, lens = CASES[graph]
    lim = manifest["dims"]
    sizes = {k: min(v, lim[k]["max"]) for k, v in sizes.items()}
    inputs = example_inputs(manifest["graphs"][graph]["inputs"], sizes, vocab=manifest["config"]["vocab_size"],
                            seed=1)
    for name, vals in lens.items():
        cap = sizes["tokens"] if name == "lengths" else sizes.get("past", sizes.get("cache"))
        inputs[name] = torch.tensor([min(v, cap) for v in vals][:sizes["batch"]])
    return inputs


def errors(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - ref.double()).abs().max().item()
    return d, d / max(ref.double().abs().max().item(), 1e-30)


def verify(graph_dir: str | Path, checkpoint: str | None = None, run_onnx: bool | None = None,
           versions: dict | None = None) -> tuple[bool, str]:
    """Returns (ok, table). run_onnx: None = when the directory holds ONNX graphs."""
    from k3export.exported import ExportedK3
    graph_dir = Path(graph_dir)
    manifest = load_manifest(graph_dir)
    model, weights = eager_model(manifest, checkpoint)
    exported = ExportedK3(graph_dir, config_hash=model.config.hash(), weights=weights, versions=versions,
                          check_files=False)                   # a changed file is reported in the table below
    run_onnx = ("onnx" in manifest) if run_onnx is None else run_onnx
    if run_onnx and "onnx" not in manifest:
        raise ManifestError(f"{graph_dir} has no ONNX graphs; run `k3export onnx --graphs {graph_dir}` first")
    dt = manifest["dtype"]
    rows, ok = [], True
    for graph, g in manifest["graphs"].items():
        if file_sha256(graph_dir / g["file"]) != g["sha256"]:
            rows.append((graph, g["file"], "sha256 differs from the manifest", "", "", "", "FAIL"))
            ok = False
        inputs = case_inputs(manifest, graph)
        with torch.no_grad():
            fn = model.forward_prefill if graph == "prefill" else model.forward_decode
            eager = dict(zip(OUTPUTS, fn(**inputs)))
        got = {"pt2": exported.run(graph, inputs)}
        if run_onnx:
            from k3export.onnx_export import OrtGraph
            got["onnx"] = OrtGraph(graph_dir / manifest["onnx"]["graphs"][graph]["file"]).run(inputs)
        for out, ref in eager.items():
            cells, status = [], "ok"
            for path in ("pt2", "onnx"):
                if path not in got:
                    cells += ["-", "-"]
                    continue
                a, r = errors(got[path][out], ref)
                cells += [f"{a:.2e}", f"{r:.2e}"]
                if not r <= TOL.get((path, dt), 1e-2):
                    status = "FAIL"
            ok &= status == "ok"
            rows.append((graph, out, *cells, status))
    # prefill -> decode -> decode driven by the exported programs alone, against eager generation.
    from k3export.generate import generate
    prompts = [[1, 2, 3, 4, 5], [7, 7]]
    mine, theirs = generate(exported, prompts, GEN_TOKENS), generate(model, prompts, GEN_TOKENS)
    ok &= mine == theirs
    rows.append(("generate", f"{GEN_TOKENS} greedy tokens", "same" if mine == theirs else f"{mine} != {theirs}",
                 "", "-", "-", "ok" if mine == theirs else "FAIL"))
    head = ("graph", "output", "pt2 max-abs", "pt2 rel", "onnx max-abs", "onnx rel", "status")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    tol = ", ".join(f"{p} {d} {t:g}" for (p, d), t in TOL.items() if d == dt)
    lines.append(f"tolerance (relative): {tol}; inputs: " +
                 "; ".join(f"{g} {CASES[g][0]} {CASES[g][1]}" for g in CASES))
    return ok, "\n".join(lines)


@click.command("verify")
@click.option("--graphs", "graph_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Graph directory written by `k3export export`.")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False),
              help="Checkpoint to compare against (default: the manifest's source).")
@click.option("--onnx/--no-onnx", "run_onnx", default=None, help="Also run the ONNX graphs (default: if present).")
def verify_cmd(graph_dir, checkpoint, run_onnx):
    """Eager vs exported programs (from disk) vs ONNX on the same inputs; exits 1 on any failure."""
    try:
        ok, table = verify(graph_dir, checkpoint, run_onnx)
    except (ManifestError, ValueError) as e:
        raise click.ClickException(str(e))
    click.echo(table)
    click.echo("verify: OK" if ok else "verify: FAILED")
    if not ok:
        raise SystemExit(1)
