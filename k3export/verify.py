"""Stage `verify`: eager model vs exported programs (re-loaded from disk) vs ONNX, on the same inputs.

One table: per graph and output, max-abs and relative error (max|a - b| / max|b|, b = eager) of the exported
program and of the ONNX graph; a graph file whose sha256 differs from the manifest is reported too. Any row
over its tolerance fails the run (non-zero exit from the CLI).

Graphs exported on cuda (`k3export export --device cuda`) run there with the k3 ops on their Triton kernels;
the table then also has one row per k3 op: every call of it inside the .pt2 run, checked against its naive twin
on the same inputs (`OpChecker`). Larger inputs are used there (CASES_CUDA) so the kernels' real paths run.
The ONNX runs in onnxruntime on the CPU, for float32 exports (FP8 ones included: `onnx_export.OrtGraph`).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import click
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
GEN_TOKENS_CUDA = 16
# CUDA graphs run the Triton kernels; each call is checked against its naive twin on the same inputs (relative
# RMS, worst output). bf16: the kernels round dot operands to bf16 where the twins keep fp32 (KDA's intra-chunk
# products, MoE's SiTU-GLU output before w2); their own GPU tests measure 2e-3..7e-3 at K3 shapes, so 2e-2
# leaves ~3x (k3-small on the H200: worst 4.6e-3). float32 graphs get the same bound (the kernels use tf32 dots
# for fp32 inputs where they apply; no fp32 graph has been verified on a GPU yet).
OP_TOL = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 2e-2}
# Inputs per graph: dim sizes and per-sequence lengths (mixed lengths, continued prefill, mixed cache lengths).
CASES = {
    "prefill": ({"batch": 2, "tokens": 7, "past": 5}, {"lengths": [7, 3], "cache_len": [5, 2]}),
    "decode": ({"batch": 3, "cache": 9}, {"cache_len": [9, 4, 1]}),
}
# On a GPU, sizes that reach the kernels' real code paths: several KDA chunks, MLA splits, many MoE tokens.
CASES_CUDA = {
    "prefill": ({"batch": 2, "tokens": 300, "past": 64}, {"lengths": [300, 171], "cache_len": [64, 0]}),
    "decode": ({"batch": 3, "cache": 1000}, {"cache_len": [1000, 257, 1]}),
}


def eager_model(manifest: dict, checkpoint: str | None = None):
    """The eager model the graphs claim to come from (on the export's device): `checkpoint`, or the manifest's
    source."""
    from k3export.config import K3Config
    from k3export.model import K3Model
    from k3export.model.weights import random_model
    dtype = getattr(torch, manifest["dtype"])
    device = graph_device(manifest)
    src = manifest["source"]
    if checkpoint is None and "checkpoint" in src:
        checkpoint = src["checkpoint"]
    if checkpoint is not None:
        model, weights = K3Model.from_pretrained(checkpoint, dtype=dtype).to(device), checkpoint_fingerprint(checkpoint)
    elif "preset" in src:
        from k3export.manifest import preset_fingerprint
        model = random_model(K3Config.from_dict(manifest["config"]), seed=src["seed"], dtype=dtype, device=device)
        weights = preset_fingerprint(src["preset"], src["seed"], dtype)
    else:
        raise ManifestError("the manifest names no checkpoint or preset; pass --checkpoint")
    if manifest.get("quant"):
        fp8_model(model, manifest["quant"])
    return model, weights


def fp8_model(model, quant: dict) -> None:
    """Quantize `model` in place as FP8 graphs were (`export --scales`): the scales file the manifest's `quant`
    entry names, refused when it is gone or no longer the file the graphs were made from."""
    from k3export.build import quantize_for_engine
    path = Path(quant.get("scales_path", quant["scales"]))
    if not path.is_file():
        raise ManifestError(f"FP8 graphs: their scales file {path} is gone; the eager reference needs it")
    if file_sha256(path) != quant["scales_sha256"]:
        raise ManifestError(f"FP8 graphs: {path} changed since the export (sha256 differs); re-export with it")
    quantize_for_engine(model, path)


def graph_device(manifest: dict) -> torch.device:
    dev = torch.device(manifest.get("device", "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ManifestError("these graphs were exported on cuda (their weights live there): run verify on a "
                            "machine with a GPU, or re-export with --device cpu")
    return dev


def case_inputs(manifest: dict, graph: str) -> dict[str, torch.Tensor]:
    device = graph_device(manifest)
    sizes, lens = (CASES_CUDA if device.type == "cuda" else CASES)[graph]
    lim = manifest["dims"]
    sizes = {k: min(v, lim[k]["max"]) for k, v in sizes.items()}
    inputs = example_inputs(manifest["graphs"][graph]["inputs"], sizes, vocab=manifest["config"]["vocab_size"],
                            seed=1, device=device)
    for name, vals in lens.items():
        cap = sizes["tokens"] if name == "lengths" else sizes.get("past", sizes.get("cache"))
        inputs[name] = torch.tensor([min(v, cap) for v in vals][:sizes["batch"]], device=device)
    return inputs


def errors(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - ref.double()).abs().max().item()
    return d, d / max(ref.double().abs().max().item(), 1e-30)


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| over the whole tensor (the kernels' own tests use this measure)."""
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("inf")                  # a NaN would otherwise compare as "not worse" everywhere
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def reference_ops(device_type: str = "cuda"):
    """Inside: every k3 op runs its plain-torch reference (the naive twin) on `device_type`, not its kernel."""
    with contextlib.ExitStack() as stack:
        for op in _kernel_ops(device_type).values():
            stack.enter_context(op.set_kernel_enabled(device_type, False))
        yield


def _kernel_ops(device_type: str) -> dict:
    """{qualified name: CustomOpDef} of the k3 ops with a kernel registered for `device_type`."""
    from torch._library.custom_ops import OPDEFS
    return {name: op for name, op in OPDEFS.items()
            if name.startswith("k3::") and device_type in getattr(op, "_backend_fns", {})}


class OpChecker(TorchDispatchMode):
    """Runs each k3 op call twice: its kernel (the result the program goes on with) and its naive twin on the
    same inputs, and keeps the worst relative RMS distance per op and output. The check sees every op on the
    activations the model really produces there, without the model's own amplification of earlier rounding."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.ops = _kernel_ops(device_type)
        self.worst: dict[str, list[float]] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name                       # e.g. "k3::kda_decode"
        op = self.ops.get(name)
        if op is None:
            return out
        with op.set_kernel_enabled(self.device_type, False):
            ref = func(*args, **kwargs)
        outs, refs = (out, ref) if isinstance(out, (tuple, list)) else ((out,), (ref,))
        outs, refs = _defined(name, args, outs), _defined(name, args, refs)
        errs = [rel_rms(o, r) for o, r in zip(outs, refs)]
        w = self.worst.setdefault(name, [0.0] * len(errs))
        self.worst[name] = [max(x, y) for x, y in zip(w, errs)]
        self.calls[name] = self.calls.get(name, 0) + 1
        return out


def _defined(name: str, args, outs):
    """The outputs with the rows the op's contract leaves unspecified zeroed: kda_prefill's o rows at or past a
    sequence's length (padding; the kernel and the twin may write anything finite there)."""
    if name != "k3::kda_prefill":
        return outs
    o, rest = outs[0], tuple(outs[1:])
    lengths = args[8]
    valid = torch.arange(o.shape[1], device=o.device)[None, :] < lengths.to(o.device)[:, None]     # [B, T]
    return (o * valid[:, :, None, None].to(o.dtype), *rest)


def _model_distances(model, f32, graph: str, inputs: dict, kernels: dict) -> dict[str, tuple[float, float]]:
    """For information (no bound): how far the kernels' outputs and the naive twins' outputs (same dtype) each
    sit from the naive twins in float32 on the same weights (`f32`: the model's float32 copy). A random-weight
    model amplifies any rounding (top-k router flips on near-tied random scores): these distances vary with the
    draw, which is why the kernels are judged per op (`OpChecker`). Returns {output: (kernels, twins)} relative
    RMS."""
    fn = "forward_prefill" if graph == "prefill" else "forward_decode"
    args32 = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad(), reference_ops():
        twins = dict(zip(OUTPUTS, getattr(model, fn)(**inputs)))
        ref = dict(zip(OUTPUTS, getattr(f32, fn)(**args32)))
    return {o: (rel_rms(kernels[o], ref[o]), rel_rms(twins[o], ref[o])) for o in OUTPUTS}


def verify(graph_dir: str | Path, checkpoint: str | None = None, run_onnx: bool | None = None,
           versions: dict | None = None) -> tuple[bool, str]:
    """Returns (ok, table). run_onnx: None = when the directory holds ONNX graphs.

    On graphs exported on cuda the k3 ops run their Triton kernels (eager and .pt2 alike): every k3 op call in
    the .pt2 run is also checked against its naive twin on the same inputs (`OpChecker`, bound OP_TOL), and two
    information-only columns give the distance of the whole model's outputs to the float32 twins."""
    from k3export.exported import ExportedK3
    graph_dir = Path(graph_dir)
    manifest = load_manifest(graph_dir)
    model, weights = eager_model(manifest, checkpoint)
    exported = ExportedK3(graph_dir, config_hash=model.config.hash(), weights=weights, versions=versions,
                          check_files=False)                   # a changed file is reported in the table below
    cuda = exported.device.type == "cuda"
    fp8 = bool(manifest.get("quant"))
    dt = manifest["dtype"]
    # onnxruntime runs the ONNX here on the CPU, in float32 (FP8 graphs too: their Q/DQ in onnxruntime's kernels,
    # `k3.moe_routed_fp8` as a Python op on the torch reference); by default only where that can run
    onnx_skip = ("" if "onnx" not in manifest or (not cuda and dt == "float32") else
                 f"the ONNX is not run: onnxruntime runs it on the CPU in float32, these graphs are {dt} on "
                 f"{exported.device.type} (export with --device cpu --dtype float32 to check the ONNX)")
    run_onnx = ("onnx" in manifest and not onnx_skip) if run_onnx is None else run_onnx
    if run_onnx and cuda:
        raise ManifestError("ONNX graphs run in onnxruntime on the CPU; verify cuda graphs with --no-onnx")
    if run_onnx and "onnx" not in manifest:
        raise ManifestError(f"{graph_dir} has no ONNX graphs; run `k3export onnx --graphs {graph_dir}` first")
    if run_onnx and dt != "float32":
        raise ManifestError(f"ONNX graphs run in onnxruntime on the CPU in float32; these are {dt}: verify with "
                            "--no-onnx, or export with --dtype float32 to check the ONNX")
    paths = ["pt2", "onnx"] if run_onnx else ["pt2"]
    rows, ok, op_rows = [], True, []
    f32 = copy.deepcopy(model).float() if cuda else None       # the float32 twin, built once for both graphs
    for graph, g in manifest["graphs"].items():
        if file_sha256(graph_dir / g["file"]) != g["sha256"]:
            rows.append((graph, g["file"], "sha256 differs from the manifest", *[""] * (2 * len(paths) - 1 +
                                                                                     2 * cuda), "FAIL"))
            ok = False
        inputs = case_inputs(manifest, graph)
        with torch.no_grad():
            fn = model.forward_prefill if graph == "prefill" else model.forward_decode
            eager = dict(zip(OUTPUTS, fn(**inputs)))
        if cuda:                      # the exported program, every k3 op call checked against its twin
            with OpChecker() as checker:
                got = {"pt2": exported.run(graph, inputs)}
            op_rows.append((graph, checker))
        else:
            got = {"pt2": exported.run(graph, inputs)}
        if run_onnx:
            from k3export.onnx_export import OrtGraph
            got["onnx"] = OrtGraph(graph_dir / manifest["onnx"]["graphs"][graph]["file"]).run(inputs)
        twins = _model_distances(model, f32, graph, inputs, got["pt2"]) if cuda else {}
        for out, ref in eager.items():
            cells, status = [], "ok"
            for path in paths:
                a, r = errors(got[path][out], ref)
                cells += [f"{a:.2e}", f"{r:.2e}"]
                if not r <= TOL.get((path, dt), 1e-2):
                    status = "FAIL"
            if cuda:
                cells += [f"{twins[out][0]:.2e}", f"{twins[out][1]:.2e}"]
            ok &= status == "ok"
            rows.append((graph, out, *cells, status))
    del f32
    # prefill -> decode -> decode driven by the exported programs alone, against eager generation.
    from k3export.generate import generate
    n_gen = GEN_TOKENS_CUDA if cuda else GEN_TOKENS
    prompts = [[1, 2, 3, 4, 5], [7, 7]] if not cuda else [list(range(3, 200)), [7, 7, 9]]
    mine, theirs = generate(exported, prompts, n_gen), generate(model, prompts, n_gen)
    ok &= mine == theirs
    rows.append(("generate", f"{n_gen} greedy tokens", "same" if mine == theirs else f"{mine} != {theirs}",
                 *["-"] * (2 * len(paths) - 1 + 2 * cuda), "ok" if mine == theirs else "FAIL"))
    for graph, checker in op_rows:           # one row per k3 op: worst output of its worst call
        in_graph = {f"k3::{n}" for n in manifest["graphs"][graph]["k3_ops"]}
        for name in sorted(in_graph - set(checker.ops)):
            rows.append((graph, f"{name}: no CUDA kernel registered", "runs its reference",
                         *["-"] * (2 * len(paths) - 1 + 2 * cuda), "ok"))
        for name in sorted(checker.worst):
            worst = max(checker.worst[name])
            bound = OP_TOL.get(dt, 1e-5)
            good = worst <= bound
            ok &= good
            rows.append((graph, f"{name} x{checker.calls[name]}", "kernel vs twin", f"{worst:.2e}",
                         *["-"] * (2 * len(paths) - 2 + 2 * cuda), "ok" if good else "FAIL"))
        missing = sorted((in_graph & set(checker.ops)) - set(checker.worst))
        if missing:
            ok = False
            rows.append((graph, f"no kernel call for {', '.join(missing)}", *["-"] * (2 * len(paths) + 2 * cuda),
                         "FAIL"))
    head = ("graph", "output", *[f"{p} {m}" for p in paths for m in ("max-abs", "rel")],
            *(("kernels vs fp32 twins", f"{dt} twins vs fp32") if cuda else ()), "status")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    tol = ", ".join(f"{p} {d} {t:g}" for (p, d), t in TOL.items() if d == dt and p in paths)
    cases = CASES_CUDA if cuda else CASES
    lines.append(f"tolerance (relative, max-abs / max|eager|): {tol or '1e-2'}; inputs: " +
                 "; ".join(f"{g} {cases[g][0]} {cases[g][1]}" for g in cases))
    if fp8:
        q = manifest["quant"]
        lines.append(f"FP8 graphs: the eager reference is the model quantized with {q['scales']} (sha256 "
                     f"{q['scales_sha256'][:12]}...)" + ("; the ONNX's Q/DQ nodes run in onnxruntime's kernels, "
                                                          "its k3.moe_routed_fp8 nodes on the torch reference"
                                                          if run_onnx else ""))
    if onnx_skip and not run_onnx:
        lines.append(onnx_skip)
    if cuda:
        lines.append(f"device {exported.device}, kernels registered for: {', '.join(sorted(_kernel_ops('cuda'))) or 'none'}; "
                     f"'kernel vs twin' rows: every call of the op inside the .pt2 against its naive twin on the "
                     f"same inputs, worst relative RMS over calls and outputs, bound {OP_TOL.get(dt, 1e-5):g}; "
                     f"the two 'vs fp32' columns are for information only (see `_model_distances`)")
    return ok, "\n".join(lines)


@click.command("verify")
@click.option("--graphs", "graph_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="Graph directory written by `k3export export`.")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False),
              help="Checkpoint to compare against (default: the manifest's source).")
@click.option("--onnx/--no-onnx", "run_onnx", default=None,
              help="Also run the ONNX graphs in onnxruntime on the CPU (default: when present and a float32 CPU "
                   "export).")
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
