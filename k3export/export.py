"""Stage `export`: the eager model -> two `torch.export` graphs around the k3 ops, plus `manifest.json`.

Graph directory (the format every later stage reads; keep it stable):

    prefill.pt2    torch.export.save of PrefillGraph   (weights inside; a meta-device export has none)
    decode.pt2     torch.export.save of DecodeGraph
    manifest.json  see below
    prefill.onnx, decode.onnx (+ *.onnx.data when large)   added by `k3export onnx`

Graph signatures (inputs and outputs in this order; ONNX uses the same names):

    prefill(input_ids [batch, tokens] int64,          right padded
            lengths   [batch] int64,                  new tokens per sequence, 1..tokens
            kda_conv  [n_kda, batch, 3*H*K, W-1],     model dtype
            kda_state [n_kda, batch, H, K, K],        fp32
            mla_cache [n_mla, batch, past, R],        model dtype; rows below cache_len[b] are valid
            cache_len [batch] int64)                  tokens already in the state, 0..past
        -> logits [batch, tokens, vocab] fp32, kda_conv_out, kda_state_out (same shapes as the inputs),
           mla_rows [n_mla, batch, tokens, R]         the new latent rows for positions cache_len[b] + i
    decode(input_ids [batch] int64, kda_conv, kda_state, mla_cache [n_mla, batch, cache, R], cache_len)
        -> logits [batch, vocab] fp32, kda_conv_out, kda_state_out, mla_rows [n_mla, batch, 1, R]

Dynamic dims (named once here; they feed torch.export `Dim`s, the manifest, ONNX axis names and input checks):
batch in [1, max_batch]; tokens in [1, max_tokens]; past in [0, max_cache]; cache in [1, max_cache].

Continued prefill takes the old MLA rows as an input with its own dynamic length `past` (the used prefix of the
cache, `past >= max(cache_len)`; `past = 0` for a fresh prefill), so chunked prefill and fresh prefill are one
graph. Neither graph returns the whole cache: each returns only its new rows (`mla_rows`), which the runtime
writes at positions `cache_len[b] + i` (`K3State.commit`); the KDA state is small and fixed-size and is returned
whole (a runtime may ping-pong it between two buffers). The graphs never write their inputs.

manifest.json fields: `format` ("k3export.graphs/1"), `config` (the text_config dict), `config_hash`,
`source` {`weights` fingerprint, `checkpoint` path or `preset`/`seed`}, `dtype` (model dtype), `limits`
{max_batch, max_tokens, max_cache}, `dims` {name: {min, max}}, `graphs` {prefill|decode: {file, sha256,
inputs, outputs, k3_ops (node counts), export_s, save_s}}, each input/output `{name, dtype, shape}` with dynamic
dims given by name, `state` (the K3State layout), `versions` (torch, k3export, python), `meta` (true when exported
on the meta device: the .pt2 then carries no weights), `peak_rss_mib`; after `k3export onnx` also `onnx`
{opset, domain, graphs: {prefill|decode: {file, external_data, weights_as_inputs, passes, k3_nodes, convert_s,
total_s}}}.

Calling the programs: `torch.export.load(path).module()(*inputs in the order above)` returns the outputs as a
tuple in the order above (`k3export.exported.ExportedK3` wraps this with input checks against the manifest).
`mla_cache` may be the whole preallocated cache (rows at or past cache_len[b] are masked out but must be finite)
or its used prefix, as long as its length is within the exported range.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from torch import nn
from torch.export import Dim

from k3export.config import PRESETS, K3Config
from k3export.manifest import FORMAT, MANIFEST, dtype_name, file_sha256, library_versions, replacing, write_manifest
from k3export.model import K3Model
from k3export.model.packing import unpacked
from k3export.plugins.kda.naive import acc_dtype

PREFILL_INPUTS = ("input_ids", "lengths", "kda_conv", "kda_state", "mla_cache", "cache_len")
DECODE_INPUTS = ("input_ids", "kda_conv", "kda_state", "mla_cache", "cache_len")
OUTPUTS = ("logits", "kda_conv_out", "kda_state_out", "mla_rows")
# Example sizes for tracing: distinct primes, so no dynamic dim coincides with a static one or another dim.
EXAMPLE = {"batch": 2, "tokens": 13, "past": 11, "cache": 17}
# Nodes that would mean a data-dependent guard or a host sync inside a graph.
GUARD_OPS = {"_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size", "_local_scalar_dense", "item",
             "_assert_async"}


@dataclass(frozen=True)
class ExportLimits:
    """Upper bounds of the dynamic dims: the engines' max profile."""

    max_batch: int = 8
    max_tokens: int = 512
    max_cache: int = 4096

    def dims(self) -> dict[str, tuple[int, int]]:
        return {"batch": (1, self.max_batch), "tokens": (1, self.max_tokens), "past": (0, self.max_cache),
                "cache": (1, self.max_cache)}


class PrefillGraph(nn.Module):
    def __init__(self, model: K3Model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len):
        return self.model.forward_prefill(input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len)


class DecodeGraph(nn.Module):
    def __init__(self, model: K3Model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, kda_conv, kda_state, mla_cache, cache_len):
        return self.model.forward_decode(input_ids, kda_conv, kda_state, mla_cache, cache_len)


def io_specs(config: K3Config, dtype: torch.dtype) -> dict[str, dict[str, list[dict]]]:
    """Per graph, the inputs and outputs as `{name, dtype, shape}`; dynamic dims are given by name."""
    lac = config.linear_attn_config
    H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    n_kda, n_mla, R = len(config.kda_layers), len(config.mla_layers), config.latent_dim
    dt, st = dtype_name(dtype), dtype_name(acc_dtype(torch.empty(0, dtype=dtype)))
    logit = dtype_name(torch.promote_types(dtype, torch.float32))
    conv = ("kda_conv", dt, [n_kda, "batch", 3 * H * K, W - 1])
    state = ("kda_state", st, [n_kda, "batch", H, K, K])

    def spec(*rows):
        return [{"name": n, "dtype": d, "shape": s} for n, d, s in rows]

    prefill_in = spec(("input_ids", "int64", ["batch", "tokens"]), ("lengths", "int64", ["batch"]), conv, state,
                      ("mla_cache", dt, [n_mla, "batch", "past", R]), ("cache_len", "int64", ["batch"]))
    decode_in = spec(("input_ids", "int64", ["batch"]), conv, state, ("mla_cache", dt, [n_mla, "batch", "cache", R]),
                     ("cache_len", "int64", ["batch"]))
    prefill_out = spec(("logits", logit, ["batch", "tokens", config.vocab_size]), (OUTPUTS[1],) + conv[1:],
                       (OUTPUTS[2],) + state[1:], ("mla_rows", dt, [n_mla, "batch", "tokens", R]))
    decode_out = spec(("logits", logit, ["batch", config.vocab_size]), (OUTPUTS[1],) + conv[1:],
                      (OUTPUTS[2],) + state[1:], ("mla_rows", dt, [n_mla, "batch", 1, R]))
    return {"prefill": {"inputs": prefill_in, "outputs": prefill_out},
            "decode": {"inputs": decode_in, "outputs": decode_out}}


def example_inputs(specs: list[dict], sizes: dict[str, int], device="cpu", vocab: int = 2, seed: int = 0):
    """Random inputs for `specs` at `sizes` (dim name -> size): token ids below vocab, lengths = tokens,
    cache_len = the cache/past size, state tensors random (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        shape = [sizes[d] if isinstance(d, str) else d for d in s["shape"]]
        dtype = getattr(torch, s["dtype"])
        if s["name"] == "input_ids":
            t = torch.randint(0, vocab, shape, generator=g)
        elif s["name"] == "lengths":
            t = torch.full(shape, sizes["tokens"], dtype=torch.int64)
        elif s["name"] == "cache_len":
            t = torch.full(shape, sizes.get("past", sizes.get("cache")), dtype=torch.int64)
        else:
            t = (torch.randn(shape, generator=g) * 0.5).to(dtype)
        out[s["name"]] = t.to(device)
    return out


def dynamic_shapes(specs: list[dict], limits: ExportLimits) -> dict[str, dict[int, Dim]]:
    dims = {n: Dim(n, min=lo, max=hi) for n, (lo, hi) in limits.dims().items()}
    return {s["name"]: {i: dims[d] for i, d in enumerate(s["shape"]) if isinstance(d, str)} for s in specs}


def k3_op_counts(ep: torch.export.ExportedProgram) -> dict[str, int]:
    """`{op name: number of call nodes}` for the k3 ops in a graph."""
    c = Counter(n.target.name().split("::")[1].split(".")[0] for n in ep.graph.nodes
                if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and n.target.namespace == "k3")
    return dict(sorted(c.items()))


def expected_k3_ops(config: K3Config, graph: str) -> dict[str, int]:
    """One kda/mla op per layer of its kind, one routed MoE per MoE layer, two AttnRes mixes per layer except
    layer 0's attention side (it passes the embedding through), plus the output mix."""
    L = config.num_hidden_layers
    kind = "prefill" if graph == "prefill" else "decode"
    return dict(sorted({f"kda_{kind}": len(config.kda_layers), f"mla_{kind}": len(config.mla_layers),
                        "moe_routed": L - config.first_k_dense_replace, "attn_res": 2 * L}.items()))


def guard_nodes(ep: torch.export.ExportedProgram) -> list[str]:
    """Nodes that assert on data or read a tensor value on the host (there must be none)."""
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"
            and getattr(n.target, "__name__", str(n.target)).split(".")[0] in GUARD_OPS]


def export_graphs(model: K3Model, out: str | Path, limits: ExportLimits = ExportLimits(),
                  source: dict | None = None, log=print, quant: dict | None = None) -> dict:
    """Export prefill and decode of `model` (any device, meta included) into `out`; returns the manifest.
    quant: the model was quantized to FP8 (`build.quantize_for_engine`'s entry, recorded in the manifest): the
    graphs then carry `k3::fp8_linear` and `k3::moe_routed_fp8` nodes (`fp8_k3_ops`).

    Re-exporting over an existing directory is safe to interrupt: its manifest is removed first and written
    last, each graph file is replaced atomically, and the previous export's ONNX files (which belong to the old
    graphs) are removed; a directory without a manifest is refused by every reader."""
    out = Path(out)
    cfg = model.config
    _check_limits(limits)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    for stale in out.glob("*.onnx*"):
        stale.unlink()
    with unpacked(model):                 # the graphs carry the model as written (one GEMM per checkpoint linear)
        return _export_graphs(model, out, limits, source, log, quant)


def fp8_k3_ops(model: K3Model, want: dict[str, int]) -> dict[str, int]:
    """`want` (`expected_k3_ops`) for a model `fp8.quantize_model` has quantized: one `fp8_linear` per FP8
    linear, and `moe_routed_fp8` in place of `moe_routed` for each FP8 expert bank."""
    from k3export.fp8 import FP8Linear
    from k3export.fp8_moe import FP8LatentMoE
    n_lin = sum(isinstance(m, FP8Linear) for m in model.modules())
    n_exp = sum(isinstance(m, FP8LatentMoE) for m in model.modules())
    out = {**want, "fp8_linear": n_lin, "moe_routed_fp8": n_exp, "moe_routed": want.get("moe_routed", 0) - n_exp}
    return dict(sorted((k, v) for k, v in out.items() if v))


def _export_graphs(model: K3Model, out: Path, limits: ExportLimits, source: dict | None, log,
                   quant: dict | None = None) -> dict:
    cfg = model.config
    specs = io_specs(cfg, model.dtype)
    meta = model.device.type == "meta"
    graphs = {}
    for name, wrapper in (("prefill", PrefillGraph), ("decode", DecodeGraph)):
        spec = specs[name]
        args = example_inputs(spec["inputs"], EXAMPLE, device=model.device, vocab=cfg.vocab_size)
        t0 = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(wrapper(model).eval(), tuple(args.values()),
                                     dynamic_shapes=dynamic_shapes(spec["inputs"], limits))
        export_s = time.perf_counter() - t0
        ops, want, guards = k3_op_counts(ep), expected_k3_ops(cfg, name), guard_nodes(ep)
        if quant:
            want = fp8_k3_ops(model, want)
        if ops != want or guards:
            raise RuntimeError(f"{name} graph is not what the contract says: k3 ops {ops} (expected {want}), "
                               f"guard nodes {guards}")
        path = out / f"{name}.pt2"
        t1 = time.perf_counter()
        with replacing(path) as tmp:
            torch.export.save(ep, tmp)
        save_s = time.perf_counter() - t1
        graphs[name] = {"file": path.name, "sha256": file_sha256(path), **spec, "k3_ops": ops,
                        "export_s": round(export_s, 2), "save_s": round(save_s, 2)}
        log(f"exported {name}: {sum(ops.values())} k3 op nodes {ops} in {export_s:.1f}s (+{save_s:.1f}s save) "
            f"-> {path} [{path.stat().st_size / 2**20:.1f} MiB]")
    manifest = {
        "format": FORMAT,
        "config": cfg.to_hf(),
        "config_hash": cfg.hash(),
        "source": source or {"weights": "unknown"},
        "dtype": dtype_name(model.dtype),
        "limits": dataclasses.asdict(limits),
        "dims": {n: {"min": lo, "max": hi} for n, (lo, hi) in limits.dims().items()},
        "graphs": graphs,
        "state": state_layout(cfg, model.dtype),
        "versions": library_versions(),
        "meta": meta,
        "device": model.device.type,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if quant:
        manifest["quant"] = quant
    write_manifest(out, manifest)
    return manifest


def state_layout(cfg: K3Config, dtype: torch.dtype, rows: str = "max_len") -> dict:
    """The K3State tensors (see `k3export/model/state.py`) as the runtime must allocate them; `rows` names the
    cache-rows dim (graph manifests: 'max_len'; engine manifests: 'cache', the name of their profile dim)."""
    specs = io_specs(cfg, dtype)["decode"]["inputs"]
    layout = {s["name"]: {"dtype": s["dtype"], "shape": [(rows if d == "cache" else d) for d in s["shape"]]}
              for s in specs if s["name"] in ("kda_conv", "kda_state", "mla_cache")}
    layout["lengths"] = {"dtype": "int64", "shape": ["batch"]}
    layout["kda_layers"] = list(cfg.kda_layers)
    layout["mla_layers"] = list(cfg.mla_layers)
    layout["commit"] = "mla_rows[:, b, i] -> mla_cache[:, b, lengths[b] + i] for i < new tokens; lengths += new"
    return layout


def _check_limits(limits: ExportLimits) -> None:
    for f in dataclasses.fields(limits):
        v = getattr(limits, f.name)
        if v < 2:
            raise ValueError(f"{f.name} must be >= 2, got {v}")
    small = {k: v for k, v in EXAMPLE.items() if v > getattr(limits, "max_" + ("cache" if k == "past" else k))}
    if small:
        raise ValueError(f"limits too small to trace with the example sizes {small}; use max_batch >= "
                         f"{EXAMPLE['batch']}, max_tokens >= {EXAMPLE['tokens']}, max_cache >= {EXAMPLE['cache']}")


def _check_device(device: str, meta: bool) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device torch knows: use cpu or cuda (cuda:N)") from None
    if meta and dev.type != "cpu":
        raise ValueError("--meta builds graphs without weights; it takes no --device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: use cpu or cuda")
    return dev


@click.command("export")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Random weights of a preset instead (k3: meta).")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Graph directory to write.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed for --preset.")
@click.option("--meta", is_flag=True, help="Build on the meta device: graphs without weights (always for k3).")
@click.option("--max-batch", type=int, default=ExportLimits.max_batch, show_default=True)
@click.option("--max-tokens", type=int, default=ExportLimits.max_tokens, show_default=True)
@click.option("--max-cache", type=int, default=ExportLimits.max_cache, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True,
              help="Where the weights live and the graphs run (cuda: the k3 ops run their Triton kernels there).")
@click.option("--scales", type=click.Path(exists=True, dir_okay=False),
              help="FP8 graphs: quantize with this `k3export calibrate` scales file first (E4M3 weights and scales "
                   "in the graphs, `k3::fp8_linear` / `k3::moe_routed_fp8` nodes; `k3export onnx` then writes Q/DQ).")
def export_cmd(checkpoint, preset, out, seed, meta, max_batch, max_tokens, max_cache, dtype, device, scales):
    """Export prefill.pt2 and decode.pt2 (torch.export around the k3 ops) and manifest.json."""
    from k3export.manifest import checkpoint_fingerprint, preset_fingerprint
    from k3export.model.weights import random_model
    if bool(checkpoint) == bool(preset):
        raise click.UsageError("give exactly one of --checkpoint or --preset")
    dt = getattr(torch, dtype)
    meta = meta or preset == "k3"
    t0 = time.perf_counter()
    try:
        limits = ExportLimits(max_batch, max_tokens, max_cache)
        _check_limits(limits)
        device = _check_device(device, meta)
        if meta:
            config = K3Config.from_hf(checkpoint) if checkpoint else K3Config.from_name(preset)
            with torch.device("meta"):
                model = K3Model(config).to(dt)
            source = {"weights": f"meta:{checkpoint or preset}"}
        elif checkpoint:
            model = K3Model.from_pretrained(checkpoint, dtype=dt).to(device)
            source = {"weights": checkpoint_fingerprint(checkpoint), "checkpoint": str(Path(checkpoint).resolve())}
        else:
            model = random_model(K3Config.from_name(preset), seed=seed, dtype=dt, device=device)
            source = {"weights": preset_fingerprint(preset, seed, dt), "preset": preset, "seed": seed}
        n_params = sum(p.numel() for p in model.parameters())
        quant = None
        if scales:
            if meta:
                raise ValueError("--scales quantizes the weights: it needs a model with weights (not --meta, not k3)")
            from k3export.build import quantize_for_engine
            quant = quantize_for_engine(model, scales)
    except ValueError as e:
        raise click.ClickException(str(e))
    load_s = time.perf_counter() - t0
    click.echo(f"model: {checkpoint or preset} ({'meta device, no weights' if meta else dtype}), "
               f"{n_params / 1e9:.3f}B parameters, built in {load_s:.1f}s")
    if quant:
        click.echo(f"FP8: quantized {quant['quantized']} from {scales}")
    man = export_graphs(model, out, limits, source, log=click.echo, quant=quant)
    click.echo(f"wrote {Path(out) / 'manifest.json'} (config {man['config_hash']}); total "
               f"{time.perf_counter() - t0:.1f}s, peak RSS {man['peak_rss_mib'] / 1024:.2f} GiB")
