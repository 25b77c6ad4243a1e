"""Core CLI commands: `init` (random checkpoint), `generate` (eager decoding) and `demo` (the main job)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from k3export.config import PRESETS, ConfigError, K3Config

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}
DEFAULT_SEED = 0


def dtype_option(default="float32"):
    return click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=default, show_default=True,
                        help="Model dtype (the KDA state stays fp32 or wider).")


def device_option():
    """--device, checked when parsed (`check_device`): a bad name or CUDA without CUDA stops the command with a
    message before it loads anything."""
    def checked(ctx, param, value):
        check_device(value)
        return value
    return click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True,
                        help="Torch device to run on.", callback=checked)


def parse_ids(text: str) -> list[list[int]]:
    """'1,2,3' -> [[1,2,3]]; '1,2;4,5,6' -> two prompts; a JSON list (of lists) also works."""
    text = text.strip()
    try:
        if text.startswith("["):
            v = json.loads(text)
            prompts = [list(map(int, p)) for p in (v if v and isinstance(v[0], list) else [v])]
        else:
            prompts = [[int(t) for t in p.split(",") if t.strip()] for p in text.split(";") if p.strip()]
    except (ValueError, TypeError, json.JSONDecodeError):
        raise click.BadParameter(f"expected token ids like '1,2,3;4,5' or a JSON list, got {text[:40]!r}")
    if not prompts or not all(prompts):
        raise click.BadParameter(f"no prompt token ids in {text[:40]!r}: give at least one id per prompt, "
                                 "e.g. --ids '1,2,3;4,5'", param_hint="'--ids'")
    return prompts


def parse_stop(text: str) -> tuple[int, ...]:
    """'5,9' -> (5, 9); '' -> ()."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated token ids, got {text[:40]!r}", param_hint="'--stop'")


def check_device(device: str) -> torch.device:
    """A usable torch device, or a click error that says why not (a bad name, or CUDA asked for without it)."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise click.BadParameter(str(e).splitlines()[0], param_hint="'--device'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.ClickException(f"--device {device}: CUDA is not available here (no NVIDIA GPU or a CPU-only "
                                   "torch); use --device cpu")
    return dev


def generation_options(f):
    """Prompt, length, sampling and stop options shared by `generate` and `run`."""
    for opt in reversed((
        click.option("--ids", "ids_text", required=True, help="Prompt token ids: '1,2,3' or several '1,2;3,4,5'."),
        click.option("--max-new-tokens", type=int, default=8, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off."),
        click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed."),
        click.option("--stop", "stop_text", default="", help="Stop token ids, comma separated."),
    )):
        f = opt(f)
    return f


def load_model(checkpoint: str | None, preset: str | None, dtype: torch.dtype, device: str, seed: int = DEFAULT_SEED):
    """A checkpoint directory, or a preset with deterministic random weights."""
    from k3export.model import K3Model
    from k3export.model.weights import random_model
    if checkpoint:
        return K3Model.from_pretrained(checkpoint, dtype=dtype, device=device)
    return random_model(K3Config.from_name(preset or "k3-tiny"), seed=seed, dtype=dtype, device=device)


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="k3-tiny", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Checkpoint directory to write.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="Weights are a function of it.")
@dtype_option()
@click.option("--experts-format", type=click.Choice(["plain", "mxfp4-blocks", "mxfp4-packed"]), default="plain",
              show_default=True, help="Routed experts in the model dtype, or in MXFP4 (as the release ships them) "
              "in one of the two layouts the loader decodes; MXFP4 needs expert dims that are multiples of 32.")
def init(preset: str, out: str, seed: int, dtype: str, experts_format: str) -> None:
    """Write a deterministic random checkpoint in the published layout (config.json + safetensors).

    The weights depend only on the preset and the seed; init scales keep activations O(1) through all layers.
    The full `k3` preset (2.8T parameters) cannot be materialised; use k3-tiny or k3-small."""
    from k3export.model.weights import MXFP4_GROUP, random_model, save_checkpoint
    config = K3Config.from_name(preset)
    if preset == "k3":
        raise click.UsageError("the full k3 preset (~2.8T parameters) cannot be materialised; "
                               "use --preset k3-small or k3-tiny (`k3export shapes --preset k3` works on meta)")
    fmt = None if experts_format == "plain" else experts_format
    dims = (config.moe_intermediate_size, config.routed_expert_hidden_size)
    if fmt and any(d % MXFP4_GROUP for d in dims):
        raise click.UsageError(f"--experts-format {fmt}: {preset}'s expert matrices are {dims[0]} x {dims[1]}; "
                               f"MXFP4 groups {MXFP4_GROUP} inputs, so both must be multiples of {MXFP4_GROUP} "
                               "(k3-small's are)")
    t0 = time.perf_counter()
    model = random_model(config, seed=seed, dtype=DTYPES[dtype])
    n = sum(p.numel() for p in model.parameters())
    files = save_checkpoint(model, Path(out), experts_format=fmt)
    size = sum(f.stat().st_size for f in files)
    click.echo(f"wrote {preset} checkpoint ({n / 1e6:.2f}M parameters, {dtype}, seed {seed}"
               f"{', routed experts ' + fmt if fmt else ''}) to {out}/ "
               f"[{', '.join(f.name for f in files)}; {size / 2**20:.1f} MiB] in {time.perf_counter() - t0:.1f}s")


@click.command()
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Random weights of a preset instead "
              "(default k3-tiny when no checkpoint is given).")
@generation_options
@dtype_option()
@device_option()
def generate(checkpoint, preset, ids_text, max_new_tokens, temperature, top_k, top_p, seed, stop_text, dtype,
             device) -> None:
    """Generate tokens with the eager model: one prefill over the prompts, then decode steps on the state."""
    from k3export.generate import Sampling, generate as run
    prompts = parse_ids(ids_text)
    try:
        sampling = Sampling(temperature, top_k, top_p, seed)
    except ValueError as e:
        raise click.BadParameter(str(e))
    stop = parse_stop(stop_text)
    if max_new_tokens < 1:
        raise click.BadParameter(f"must be >= 1, got {max_new_tokens}", param_hint="'--max-new-tokens'")
    try:
        model = load_model(checkpoint, preset, DTYPES[dtype], device)
        t0 = time.perf_counter()
        out = run(model, prompts, max_new_tokens, sampling, stop)
    except (ValueError, ConfigError) as e:
        raise click.ClickException(str(e))
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, out):
        click.echo(f"{p} -> {o}")
    click.echo(f"{sum(map(len, out))} tokens for {len(prompts)} prompt(s) in {dt:.2f}s "
               f"({'greedy' if temperature == 0 else f'T={temperature}, top-k={top_k}, top-p={top_p}, seed={seed}'})")


@click.command()
@click.option("--out", type=click.Path(file_okay=False), default="out/demo", show_default=True)
@click.option("--preset", type=click.Choice(["k3-tiny", "k3-small"]), default="k3-tiny", show_default=True)
@device_option()
@click.option("--backend", type=click.Choice(("best", "eager", "compile", "aoti", "tensorrt")), default="best",
              show_default=True, help="The engine to build and serve from; best: tensorrt when installed on a GPU, "
                                      "else aoti (falling back to compile where AOTI packages cannot load).")
def demo(out: str, preset: str, device: str, backend: str) -> None:
    """The main job on the embedded default: a deterministic random checkpoint and its shape table, then
    export -> build (best backend here, or --backend) -> run -> bench against eager PyTorch, saying where each
    artifact went."""
    from k3export.model.weights import random_model, save_checkpoint
    from k3export.shapes import shape_report
    root = Path(out)
    ckpt = root / "checkpoint"
    click.echo(f"[1/6] init: {preset} random checkpoint (seed {DEFAULT_SEED})")
    files = save_checkpoint(random_model(K3Config.from_name(preset), seed=DEFAULT_SEED), ckpt)
    click.echo(f"      wrote {ckpt}/ ({', '.join(f.name for f in files)})")
    click.echo("[2/6] shapes: per-module shapes and state bytes (meta device)")
    report = shape_report(K3Config.from_name(preset), tokens=8, batch=2)
    (root / "shapes.txt").write_text(report)
    click.echo(report)
    click.echo(f"      wrote {root / 'shapes.txt'}")
    from k3export.pipeline import run_pipeline
    art = run_pipeline(root, ckpt, device, click.echo, first_step=3, steps=6, backend=backend)
    click.echo(f"done: artifacts under {root}/: checkpoint {ckpt}/, shapes {root / 'shapes.txt'}, "
               + ", ".join(f"{k} {v}" for k, v in art.items()))
