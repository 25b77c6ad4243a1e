"""FP8 calibration: a recipe says which GEMMs go to E4M3; a calibration set run through the eager model gives
each quantized GEMM's static input scale; weight scales come from the weights. The artifact is one safetensors
file of fp32 scales with a receipt (recipe, data hash, model hash) in its metadata.

Scales-file keys (all fp32):
    <linear>.input_amax, <linear>.input_scale `[]`, <linear>.weight_scale `[out]` (per channel) or `[]`
    <bank>.w13_input_amax/_scale, <bank>.w2_input_amax/_scale `[]`, <bank>.w13_scale `[E, 2I]` or `[E]`,
    <bank>.w2_scale `[E, L]` or `[E]`            (bank = `model.layers.{l}.block_sparse_moe.experts`)
scale = amax / 448 (E4M3's largest finite value): amax maps to the top of the FP8 range.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import fnmatch
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from tqdm import tqdm

from k3export.fp8 import scale_from_amax, weight_amax
from k3export.fp8_moe import expert_weight_scales
from k3export.manifest import save_tensors
from k3export.model.moe import ExpertBank, LatentMoE
from k3export.model.packing import unpacked
from k3export.plugins.moe.naive import route, situ_glu

RECIPES = Path(__file__).resolve().parent.parent / "calibration" / "recipes"
DEFAULT_RECIPE = RECIPES / "default.json"
STATE_NAMES = ("kda_state", "kda_conv", "mla_cache", "lengths", "state", "cache")
_RECIPE_KEYS = {"name", "format", "activations", "weights", "quantize", "keep"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class RecipeError(ValueError):
    """A recipe is malformed or does not fit the model; the message names the offending pattern or field."""


class CalibrationError(RuntimeError):
    """Calibration stopped (non-finite activations, bad data); the message names the module and layer."""


@dataclass(frozen=True)
class Recipe:
    """What to quantize (fnmatch patterns over module names), what stays high precision (with the reason), and
    how: activation amax by 'max' or 'percentile', weight scales 'per_channel' or 'per_tensor'."""

    name: str
    quantize: tuple[str, ...]
    keep: dict
    method: str = "max"
    percentile: float = 99.99
    granularity: str = "per_channel"

    @classmethod
    def load(cls, path: str | Path = DEFAULT_RECIPE) -> "Recipe":
        p = Path(path)
        if not p.exists():
            raise RecipeError(f"no recipe at {p} (the default is {DEFAULT_RECIPE})")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise RecipeError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        unknown = set(d) - _RECIPE_KEYS
        if unknown:
            raise RecipeError(f"unknown recipe field(s) {sorted(unknown)}; known: {sorted(_RECIPE_KEYS)}")
        if d.get("format", "float8_e4m3fn") != "float8_e4m3fn":
            raise RecipeError(f"format: only 'float8_e4m3fn' (E4M3) is supported, got {d['format']!r}")
        act, wts = d.get("activations", {}), d.get("weights", {})
        quant, keep = d.get("quantize"), d.get("keep", {})
        if not quant or not isinstance(quant, list) or not all(isinstance(q, str) for q in quant):
            raise RecipeError("quantize: must be a non-empty list of module-name patterns")
        if not isinstance(keep, dict) or not all(isinstance(v, str) and v for v in keep.values()):
            raise RecipeError("keep: must map each module-name pattern to the reason it stays high precision")
        for pat in quant:
            for s in STATE_NAMES:
                if fnmatch.fnmatchcase(s, pat) or s in pat.split(".")[-1]:
                    raise RecipeError(f"quantize pattern {pat!r} names decoding state ({s!r}): the KDA recurrent "
                                      "state and conv window and the MLA cache are never quantized (they stay "
                                      "fp32 / the model dtype); quantize only GEMM modules")
        r = cls(name=str(d.get("name", "unnamed")), quantize=tuple(quant), keep=dict(keep),
                method=act.get("method", "max"), percentile=float(act.get("percentile", 99.99)),
                granularity=wts.get("granularity", "per_channel"))
        r.check()
        return r

    def check(self) -> None:
        if self.method not in ("max", "percentile"):
            raise RecipeError(f"activations.method: 'max' or 'percentile', got {self.method!r}")
        if not 0 < self.percentile <= 100:
            raise RecipeError(f"activations.percentile: must lie in (0, 100], got {self.percentile}")
        if self.granularity not in ("per_channel", "per_tensor"):
            raise RecipeError(f"weights.granularity: 'per_channel' or 'per_tensor', got {self.granularity!r}")

    def to_dict(self) -> dict:
        return {"name": self.name, "format": "float8_e4m3fn",
                "activations": {"method": self.method, "percentile": self.percentile},
                "weights": {"granularity": self.granularity}, "quantize": list(self.quantize), "keep": self.keep}

    def replace(self, **kw) -> "Recipe":
        r = dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})
        r.check()
        return r

    def resolve(self, model: nn.Module) -> dict[str, str]:
        """Module name -> 'linear' or 'experts' for every module this recipe quantizes in `model`.
        Every pattern must match something; quantize patterns may match only GEMM modules."""
        mods = {n: m for n, m in model.named_modules() if n}
        params = [n for n, _ in model.named_parameters()]
        for pat in self.keep:
            if not any(fnmatch.fnmatchcase(n, pat) for n in [*mods, *params]):
                raise RecipeError(f"unknown module pattern {pat!r} in keep: matches no module or parameter"
                                  f"{_nearest(pat, mods)}")
        kept = {n for n in mods if any(fnmatch.fnmatchcase(n, p) for p in self.keep)}
        out = {}
        for pat in self.quantize:
            hits = [n for n in mods if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                ph = [n for n in params if fnmatch.fnmatchcase(n, pat)]
                if ph:
                    raise RecipeError(f"quantize pattern {pat!r} matches parameter(s) such as {ph[0]!r}, not a GEMM "
                                      "module; parameters (A_log, dt_bias, norms, the router bias) stay high "
                                      "precision")
                raise RecipeError(f"unknown module pattern {pat!r} in quantize: matches no module of this model"
                                  f"{_nearest(pat, mods)}")
            for n in hits:
                m = mods[n]
                if not isinstance(m, (nn.Linear, ExpertBank)):
                    raise RecipeError(f"quantize pattern {pat!r} matches {n!r} ({type(m).__name__}), which is not "
                                      "a GEMM: only nn.Linear modules and routed expert banks can be quantized")
                if n not in kept:
                    out[n] = "experts" if isinstance(m, ExpertBank) else "linear"
        return dict(sorted(out.items(), key=lambda kv: list(mods).index(kv[0])))


def _nearest(pat: str, names) -> str:
    near = difflib.get_close_matches(pat.replace("*", "0"), list(names), n=1, cutoff=0.5)
    return f"; nearest module name: {near[0]!r}" if near else ""


# ------------------------------------------------------------------------------------------------ observers
class AmaxObserver:
    """Running |x| max over calibration batches. 'max': the exact max. 'percentile': the p-th percentile of |x|
    within each batch, then the max over batches (robust to a few outliers per batch)."""

    def __init__(self, name: str, method: str, percentile: float):
        self.name, self.method, self.percentile = name, method, percentile
        self.amax = torch.zeros((), dtype=torch.float64)

    def update(self, x: Tensor) -> None:
        if not bool(torch.isfinite(x).all()):
            m = _LAYER.search(self.name + ".")
            where = f" (layer {m.group(1)})" if m else ""
            raise CalibrationError(f"non-finite activation (NaN/Inf) entering {self.name}{where}; calibration "
                                   "stopped: check the checkpoint and the calibration data")
        a = x.detach().abs().flatten().double()
        if self.method == "max" or a.numel() == 1:
            v = a.max()
        else:
            k = max(1, min(a.numel(), math.ceil(self.percentile / 100 * a.numel())))
            v = a.kthvalue(k).values
        self.amax = torch.maximum(self.amax, v.cpu())

    def hook(self, module, args) -> None:
        """A forward pre-hook observing the module's input."""
        self.update(args[0])


def _layer_of(name: str) -> str:
    m = _LAYER.search(name + ".")
    return f" (layer {m.group(1)})" if m else ""


@torch.no_grad()
def calibrate(model: nn.Module, recipe: Recipe, batches: list[Tensor], progress: bool = True) -> dict[str, Tensor]:
    """Run `batches` (token ids `[B, T]` each) through `model` (eager prefill) and return the scales dict.
    Every nn.Linear input is checked for NaN/Inf (the first offender is named); the quantized ones are observed."""
    targets = recipe.resolve(model)
    obs: dict[str, AmaxObserver] = {}
    handles = []
    mk = lambda n: obs.setdefault(n, AmaxObserver(n, recipe.method, recipe.percentile))   # noqa: E731

    def check_only(name):
        def hook(mod, args):
            if not bool(torch.isfinite(args[0]).all()):
                raise CalibrationError(f"non-finite activation (NaN/Inf) entering {name}{_layer_of(name)}; "
                                       "calibration stopped: check the checkpoint and the calibration data")
        return hook

    mods = dict(model.named_modules())
    for name, mod in mods.items():
        if isinstance(mod, nn.Linear):
            hook = mk(name).hook if targets.get(name) == "linear" else check_only(name)
            handles.append(mod.register_forward_pre_hook(hook))
    for name, kind in targets.items():
        if kind != "experts":
            continue
        moe = mods[name.rpartition(".")[0]]
        if not isinstance(moe, LatentMoE):
            raise RecipeError(f"expert bank {name!r} is not inside a LatentMoE")
        z_obs, h_obs = mk(name + ".w13_input"), mk(name + ".w2_input")
        handles += _observe_experts(moe, z_obs, h_obs)
    try:
        with unpacked(model):                      # the hooks sit on the checkpoint's own linears
            for ids in tqdm(batches, desc="calibrate", unit="batch", disable=not progress):
                logits = model(ids.to(model.device))
                if not bool(torch.isfinite(logits).all()):
                    raise CalibrationError("non-finite logits (lm_head output) although every GEMM input was "
                                           "finite")
    finally:
        for h in handles:
            h.remove()
    return _scales(model, recipe, targets, obs)


def _observe_experts(moe: LatentMoE, z_obs: AmaxObserver, h_obs: AmaxObserver) -> list:
    """Hooks recording the expert inputs: z (routed_expert_down_proj output, into w1/w3) and the SiTU-GLU
    output h (into w2), recomputed from the module's input and z for the pairs the router picks."""
    latent = {}

    def on_z(mod, args, z):
        z_obs.update(z)
        latent["z"] = z

    def on_moe(mod, args, out):
        h_obs.update(_expert_hidden(moe, args[0], latent.pop("z")))

    return [moe.routed_expert_down_proj.register_forward_hook(on_z), moe.register_forward_hook(on_moe)]


def _expert_hidden(moe: LatentMoE, x: Tensor, z: Tensor) -> Tensor:
    """The SiTU-GLU outputs h (inputs of w2) of every (token, hit expert) pair, rows concatenated `[P, I]`."""
    top, _ = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, **{k: moe.routing[k] for k in
                                                                           ("top_k", "renormalize", "scaling")})
    e = moe.experts
    hs = []
    for ex in top.unique().tolist():
        t = (top == ex).any(-1).nonzero().squeeze(-1)
        hs.append(situ_glu(z[t] @ e.w1[ex].T, z[t] @ e.w3[ex].T, moe.routing["beta"],
                           moe.routing["linear_beta"]).to(z.dtype))
    return torch.cat(hs)


def _scales(model, recipe: Recipe, targets: dict[str, str], obs: dict[str, AmaxObserver]) -> dict[str, Tensor]:
    per_channel = recipe.granularity == "per_channel"
    mods = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    for name, kind in targets.items():
        m = mods[name]
        if kind == "linear":
            amax = obs[name].amax.float()
            out |= {f"{name}.input_amax": amax, f"{name}.input_scale": scale_from_amax(amax),
                    f"{name}.weight_scale": scale_from_amax(weight_amax(m.weight, per_channel)).cpu()}
        else:
            for part in ("w13_input", "w2_input"):
                amax = obs[f"{name}.{part}"].amax.float()
                out |= {f"{name}.{part}_amax": amax, f"{name}.{part}_scale": scale_from_amax(amax)}
            out |= {f"{name}.{k}": v.cpu() for k, v in expert_weight_scales(m.w1, m.w3, m.w2, per_channel).items()}
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------------------------- data and hashes
DEFAULT_DATA_SEED, HELDOUT_SEED = 1234, 5678


def default_batches(vocab_size: int, n_seqs: int = 8, seq_len: int = 64, batch: int = 4,
                    seed: int = DEFAULT_DATA_SEED) -> list[Tensor]:
    """The embedded default calibration set: deterministic pseudo-random token ids (a seeded generator, any
    machine) within the vocab. Random-weight models have no text distribution to prefer; for a real checkpoint
    pass real token ids with --data."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n_seqs, seq_len), generator=g)
    return list(ids.split(batch))


def load_token_file(path: str | Path, vocab_size: int, batch: int = 4) -> list[Tensor]:
    """Token ids from a file: JSON (a list of equal-length lists) or text (one sequence per line, ids separated
    by commas or spaces; lines are cut to the shortest). -> batches `[b, T]` int64."""
    p = Path(path)
    text = p.read_text()
    try:
        seqs = json.loads(text) if p.suffix == ".json" else [[int(t) for t in re.split(r"[,\s]+", line.strip()) if t]
                                                             for line in text.splitlines() if line.strip()]
    except (ValueError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{p}: cannot read token ids ({e})") from None
    if not seqs or not all(isinstance(s, list) and s for s in seqs):
        raise CalibrationError(f"{p}: expected one or more non-empty sequences of token ids")
    T = min(len(s) for s in seqs)
    ids = torch.tensor([s[:T] for s in seqs], dtype=torch.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise CalibrationError(f"{p}: token ids outside [0, {vocab_size}): {bad[:5].tolist()}")
    return list(ids.split(batch))


def data_hash(batches: list[Tensor]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(b.to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_hash(model: nn.Module) -> str:
    """sha256 over every weight (published key order, raw bytes): scales belong to exactly these weights."""
    from k3export.model.weights import published_state_dict
    h = hashlib.sha256()
    for k, t in published_state_dict(model).items():
        h.update(k.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -------------------------------------------------------------------------------------------------- the file
def save_scales(path: str | Path, scales: dict[str, Tensor], receipt: dict) -> Path:
    """Write the scales with the receipt as metadata, atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_tensors(scales, tmp, metadata={"receipt": json.dumps(receipt, sort_keys=True)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_scales(path: str | Path) -> tuple[dict[str, Tensor], dict]:
    with safe_open(str(path), framework="pt") as f:
        receipt = json.loads((f.metadata() or {}).get("receipt", "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, receipt


def make_receipt(model, recipe: Recipe, batches: list[Tensor], source: str, scales: dict[str, Tensor]) -> dict:
    from k3export.fp8 import quantized_modules
    recipe_text = json.dumps(recipe.to_dict(), sort_keys=True)
    kinds = list(quantized_modules(scales).values())
    return {
        "recipe": recipe.to_dict(), "recipe_sha256": hashlib.sha256(recipe_text.encode()).hexdigest(),
        "data_sha256": data_hash(batches), "data_source": source,
        "data_shape": [sum(b.shape[0] for b in batches), int(batches[0].shape[1])],
        "model_sha256": model_hash(model), "config_hash": model.config.hash(), "model_dtype": str(model.dtype),
        "modules": {"linear": kinds.count("linear"), "experts": kinds.count("experts")},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------------- the CLI
def _click():
    import click

    from k3export.commands import DTYPES, device_option, dtype_option, load_model
    from k3export.config import PRESETS

    @click.command("calibrate")
    @click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
    @click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Random weights of a preset instead "
                  "(default k3-tiny when no checkpoint is given).")
    @click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False), default=str(DEFAULT_RECIPE),
                  show_default=True, help="What to quantize and what stays high precision.")
    @click.option("--data", type=click.Path(exists=True, dir_okay=False), help="Calibration token ids (.json list "
                  "of lists, or text: one sequence per line). Default: the embedded 8 x 64 set.")
    @click.option("--method", type=click.Choice(["max", "percentile"]), help="Activation amax (overrides recipe).")
    @click.option("--percentile", type=float, help="For --method percentile (overrides recipe).")
    @click.option("--granularity", type=click.Choice(["per_channel", "per_tensor"]), help="Weight scales "
                  "(overrides recipe).")
    @click.option("--batch", type=int, default=4, show_default=True, help="Sequences per calibration batch.")
    @click.option("--out", type=click.Path(dir_okay=False), help="Scales file to write "
                  "[default: calibration/out/<model>-scales.safetensors].")
    @click.option("--scales", type=click.Path(exists=True, dir_okay=False), help="Use this scales file instead "
                  "of calibrating (with --report); refused if its receipt names other weights.")
    @click.option("--report", is_flag=True, help="Then compare the FP8 model with the unquantized one.")
    @click.option("--report-tokens", type=int, default=32, show_default=True, help="Greedy tokens per prompt.")
    @click.option("--report-len", type=int, default=64, show_default=True, help="Tokens per held-out sequence "
                  "(4 sequences, seed 5678; the first 16 tokens of two of them prompt the greedy generation).")
    @click.option("--noise-floor", type=click.Choice(["float16", "float32"]), help="Also report the model dtype "
                  "against this precision (same weights): the model's own sensitivity to rounding.")
    @dtype_option("bfloat16")
    @device_option()
    def calibrate_cmd(checkpoint, preset, recipe_path, data, method, percentile, granularity, batch, out, scales,
                      report, report_tokens, report_len, noise_floor, dtype, device):
        """Calibrate FP8 (E4M3) scales for the quantized GEMMs of a recipe, and optionally report accuracy.

        Runs the calibration token ids through the eager model, records the |input| amax of every quantized GEMM
        (max or percentile), computes weight scales, and writes one safetensors file with a receipt (recipe,
        data hash, model hash). --report then measures FP8 against the unquantized model on held-out inputs."""
        try:
            model = load_model(checkpoint, preset, DTYPES[dtype], device)
            recipe = Recipe.load(recipe_path).replace(method=method, percentile=percentile,
                                                      granularity=granularity)
            if scales:
                table, receipt = load_scales(scales)
                if receipt.get("model_sha256") and receipt["model_sha256"] != model_hash(model):
                    raise CalibrationError(f"{scales} was calibrated for other weights (model hash "
                                           f"{receipt['model_sha256'][:12]}...); recalibrate")
                path = Path(scales)
            else:
                vocab = model.config.vocab_size
                batches = load_token_file(data, vocab, batch) if data else default_batches(vocab, batch=batch)
                targets = recipe.resolve(model)
                n_lin = sum(k == "linear" for k in targets.values())
                click.echo(f"recipe {recipe.name!r}: {n_lin} linear(s) and {len(targets) - n_lin} expert bank(s) "
                           f"to FP8 ({recipe.method}, weights {recipe.granularity})")
                table = calibrate(model, recipe, batches)
                receipt = make_receipt(model, recipe, batches, str(data or "embedded default"), table)
                name = Path(checkpoint).name if checkpoint else (preset or "k3-tiny")
                path = save_scales(out or RECIPES.parent / "out" / f"{name}-scales.safetensors", table, receipt)
                click.echo(f"wrote {len(table)} scales to {path} (data sha256 {receipt['data_sha256'][:12]}, "
                           f"model sha256 {receipt['model_sha256'][:12]})")
            if report:
                _run_report(checkpoint, preset, dtype, device, model, table, path, report_tokens, report_len,
                            noise_floor)
        except (RecipeError, CalibrationError, ValueError) as e:
            raise click.ClickException(str(e))

    return calibrate_cmd


def _run_report(checkpoint, preset, dtype, device, ref, table, scales_path, tokens, seq_len, noise_floor):
    import click

    from k3export.commands import DTYPES, load_model
    from k3export.fp8 import quantize_model
    from k3export.fp8_report import accuracy_report, format_report
    fp8 = load_model(checkpoint, preset, DTYPES[dtype], device)
    counts = quantize_model(fp8, table)
    held = torch.cat(default_batches(ref.config.vocab_size, n_seqs=4, seq_len=seq_len, seed=HELDOUT_SEED))
    prompts = held[:2, :16].tolist()
    rep = {"fp8": accuracy_report(fp8, ref, held, prompts, tokens), "quantized": counts, "dtype": dtype}
    click.echo(format_report(rep["fp8"], f"FP8 vs {dtype} ({counts['linear']} linears, {counts['experts']} "
                                         "expert banks in E4M3)"))
    try:
        from k3export.fp8_report import onnx_oracle
        x0 = torch.randn(16, ref.config.hidden_size, generator=torch.Generator().manual_seed(HELDOUT_SEED))
        rep["onnx_oracle"] = onnx_oracle(fp8, x0, Path(scales_path).parent)
        o = rep["onnx_oracle"]
        click.echo(f"  onnx oracle (onnxruntime CPU, {o['graph']}): {o['QuantizeLinear']} Q / {o['DequantizeLinear']}"
                   f" DQ nodes, {o['fp8_weights']} FP8 weights; rel. error vs eager FP8 {o['rel_err']:.2e}")
    except ImportError as e:
        click.echo(f"  onnx oracle skipped: {e}")
    if noise_floor:
        del fp8
        hi = load_model(checkpoint, preset, DTYPES[noise_floor], device)
        rep["noise_floor"] = accuracy_report(ref, hi, held, prompts, tokens)
        click.echo(format_report(rep["noise_floor"], f"noise floor: {dtype} vs {noise_floor}"))
    out = Path(str(scales_path).removesuffix(".safetensors") + ".report.json")
    out.write_text(json.dumps(rep, indent=2))
    click.echo(f"wrote {out}")


calibrate_command = _click()
