"""`k3export build`: engine directories, one per target, and their refusal when they do not fit.

A target is (preset or checkpoint, precision, device, backend); its directory is named from them, e.g.
`engines/k3-small-bf16-h200-aoti/`. Every engine directory holds:

    manifest.json   format, backend, config (+ hash), weights fingerprint, precision, device/GPU, library
                    versions, every file with its size and sha256, the optimisation profiles (named dims
                    min/opt/max), the state layout, build timings and the reuse key
    build.log       what was done, with timings
    weights.safetensors   the model tensors in the engine's precision (the engine needs no checkpoint); in an FP8
                    engine (`--scales`, a `k3export calibrate` scales file) the quantized modules' E4M3
                    weights and fp32 scales, and the manifest's `quant` entry says which modules and from which
                    scales file, recipe and calibration data (eager and compile; tensorrt builds FP8 from the
                    FP8 ONNX graphs of `k3export export --scales` + `k3export onnx`; aoti: refused)
    + backend files: aoti: prefill.aoti.pt2 / decode.aoti.pt2 (AOTInductor packages, weights kept outside
      so prefill and decode share one copy); tensorrt: prefill.engine / decode.engine / timing.cache;
      compile: inductor-cache/ (Inductor's on-disk cache, so a later process skips code generation)

`open_engine` re-checks everything before anything runs: a missing/truncated/corrupt file, another config,
other library versions or another GPU is refused with a message that says which and what to do.

Load check (aoti on CUDA by default, `--load-check` anywhere): after writing the engine, a child process opens it
and runs one decode step. On the H200 image (torch 2.11 + CUDA 13, 2026-11-30) no CUDA AOTInductor package loads:
a toy Linear's, loaded by a process that imports only torch, crashes with SIGSEGV inside `aoti_load_package`, as
every package of ours did (docs/perf.md; scripts/aoti_toy.py probes a machine); the check keeps that crash out of the serving process: a failed check is
recorded in the manifest (the engine is then refused with the reason) and raised as `EngineLoadError`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from k3export.commands import device_option, load_model
from k3export.config import PRESETS, K3Config
from k3export.export import state_layout
from k3export.manifest import (atomic_write, checkpoint_fingerprint, file_sha256, library_versions, preset_fingerprint,
                               replacing, save_tensors)

FORMAT = "k3export.engine/1"
BACKENDS = ("eager", "compile", "aoti", "tensorrt", "megakernel")
# what the main job (`k3export demo`) builds and serves: its engines are fp32 / any-batch; `megakernel` is a bf16,
# one-sequence decode kernel for presets of its shapes (k3-small), served with `k3export run` / `bench model`
DEMO_BACKENDS = ("eager", "compile", "aoti", "tensorrt")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = "weights.safetensors"
DEFAULT_PROFILES = {"prefill": {"batch": [1, 1, 8], "tokens": [1, 128, 4096]},
                    "decode": {"batch": [1, 8, 64], "cache": [2, 1024, 4096]}}


class EngineError(RuntimeError):
    """An engine directory cannot be used; the message says what is wrong and how to fix it."""


class TensorRTMissing(EngineError):
    pass


class EngineLoadError(EngineError):
    """The engine was written but a process that loads it fails or crashes on this machine (the load check)."""


TENSORRT_INSTALL = ("TensorRT is not installed: install TensorRT 11 for CUDA 13 from NVIDIA's index, e.g. "
                    "`pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu13` (PyPI's "
                    "`tensorrt-cu13-libs` is a stub that downloads from there), then rebuild with "
                    "`k3export build --backend tensorrt`. On machines without that index use --backend aoti.")


# ---------------------------------------------------------------------------------------------- naming
def device_slug(device: str | torch.device) -> str:
    """'cpu', or the GPU's name in lower case without the vendor: 'h200', 'a100-sxm4-80gb'."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def preset_name(config: K3Config) -> str:
    """The preset a config equals, else 'custom-<hash>'."""
    for name, c in PRESETS.items():
        if c == config:
            return name
    return f"custom-{config.hash()[:8]}"


def precision_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in PRECISIONS.items()}[dtype]


def engine_name(config: K3Config, dtype: torch.dtype, device, backend: str, fp8: bool = False) -> str:
    return f"{preset_name(config)}-{precision_name(dtype)}{'-fp8' if fp8 else ''}-{device_slug(device)}-{backend}"


# ---------------------------------------------------------------------------------------------- FP8
FP8_BACKENDS = ("eager", "compile")      # FP8 engines whose k3 FP8 ops run inside the served model


def check_fp8_backend(backend: str, graphs=None, scales_sha256: str | None = None) -> None:
    """Refuse an FP8 build the backend cannot take: aoti (the FP8 expert op is not compiled in), and tensorrt
    without FP8 ONNX graphs (`graphs`, an export directory whose manifest's `quant` entry comes from the same
    scales file, sha256 `scales_sha256` when known): TensorRT builds what the ONNX carries."""
    if backend in FP8_BACKENDS:
        return
    if backend != "tensorrt":
        raise EngineError(f"FP8 engines are built for the {', '.join(FP8_BACKENDS)} and tensorrt backends, not "
                          f"{backend}: its graphs would need the FP8 expert op compiled in; build --backend compile "
                          "(on a GPU) or eager")
    how = ("`k3export export --scales FILE ...`, then `k3export onnx --graphs DIR`, and pass that DIR as --graphs")
    if graphs is None:
        raise EngineError(f"an FP8 TensorRT engine is built from FP8 ONNX graphs: {how}")
    from k3export.manifest import load_manifest
    try:
        quant = load_manifest(Path(graphs)).get("quant")
    except ValueError as e:
        raise EngineError(str(e)) from None
    if not quant:
        raise EngineError(f"--graphs {graphs} holds unquantized graphs; for an FP8 TensorRT engine: {how}")
    if scales_sha256 and quant.get("scales_sha256") != scales_sha256:
        raise EngineError(f"--graphs {graphs} was quantized with another scales file ({quant.get('scales')}, "
                          f"sha256 {str(quant.get('scales_sha256'))[:12]}...) than --scales; re-export with it")


def quantize_for_engine(model, scales_path: str | Path) -> dict:
    """Swap `model`'s modules for their FP8 forms from a `k3export calibrate` scales file (in place) and return
    the manifest's `quant` entry. Refused (ValueError) when the file's receipt names other weights or another
    config, or the file is not a scales file."""
    from k3export.calibrate import load_scales, model_hash
    from k3export.fp8 import quantize_model
    scales_path = Path(scales_path)
    try:
        scales, receipt = load_scales(scales_path)
    except Exception as e:                                        # noqa: BLE001  (safetensors raises its own)
        raise ValueError(f"--scales {scales_path}: not a readable scales file ({type(e).__name__}: {e}); "
                         "write one with `k3export calibrate`") from None
    if not receipt:
        raise ValueError(f"--scales {scales_path}: no receipt in its metadata; write it with `k3export calibrate`")
    if receipt.get("config_hash") != model.config.hash():
        raise ValueError(f"--scales {scales_path}: calibrated for config {receipt.get('config_hash')}, the model "
                         f"has {model.config.hash()} ({preset_name(model.config)}); recalibrate for this model")
    if receipt.get("model_dtype") not in (None, str(model.dtype)):
        dt = {str(v): k for k, v in PRECISIONS.items()}.get(receipt["model_dtype"], receipt["model_dtype"])
        raise ValueError(f"--scales {scales_path}: calibrated on the {dt} model, this one is "
                         f"{precision_name(model.dtype)}; build with --dtype {dt}, or recalibrate")
    mine = model_hash(model)                                      # reads every weight once
    if receipt.get("model_sha256") != mine:
        raise ValueError(f"--scales {scales_path}: calibrated on other weights (model sha256 "
                         f"{str(receipt.get('model_sha256'))[:12]}..., this model's {mine[:12]}...); "
                         "recalibrate with `k3export calibrate` on these weights")
    try:
        counts = quantize_model(model, scales)
    except KeyError as e:
        raise ValueError(f"--scales {scales_path}: {e.args[0]}") from None
    return {"scheme": "fp8-e4m3", "scales": scales_path.name, "scales_path": str(scales_path.resolve()),
            "scales_sha256": file_sha256(scales_path),
            "quantized": counts, **{k: receipt[k] for k in ("recipe_sha256", "data_sha256", "data_source",
                                                             "model_sha256") if k in receipt}}


# ---------------------------------------------------------------------------------------------- building
@dataclass
class BuildLog:
    """Timed steps, written to build.log and the manifest."""

    lines: list[str]
    seconds: dict[str, float]

    def step(self, name: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        dt = time.perf_counter() - t0
        self.seconds[name] = round(self.seconds.get(name, 0.0) + dt, 3)
        self.lines.append(f"{time.strftime('%H:%M:%S')} {name}: {dt:.2f}s")
        return out

    def note(self, text: str) -> None:
        self.lines.append(f"{time.strftime('%H:%M:%S')} {text}")


def build(backend: str, model, out_root: str | Path = "engines", *, graphs: str | Path | None = None,
          weights_id: str = "unknown", profiles: dict | None = None, echo=print,
          load_check: bool | None = None, quant: dict | None = None,
          steps_per_launch: int | None = None) -> Path:
    """Build `backend` for `model` (its config, dtype and device define the target) under `out_root`.
    `quant`: the model was quantized to FP8 (`quantize_for_engine`'s entry, recorded in the manifest; eager and
    compile backends only).
    `graphs`: an export directory (prefill.pt2, decode.pt2, manifest.json) for aoti/tensorrt; exported into
    the engine directory when not given. `load_check`: open the engine in a child process and run one decode
    step (default: aoti engines on CUDA; see the module docstring); raises EngineLoadError when that fails.
    `steps_per_launch`: megakernel only, the greedy steps one launch may run (default 8, `ENGINE_STEPS`).
    Returns the engine directory."""
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if steps_per_launch is not None and backend != "megakernel":
        raise EngineError(f"steps_per_launch is for the megakernel backend (several greedy steps a launch), not "
                          f"{backend}")
    if quant:
        check_fp8_backend(backend, graphs, quant["scales_sha256"])
    if backend == "tensorrt":
        from k3export.build_trt import import_tensorrt
        import_tensorrt()                                         # fail before any work when it is missing
    config, dtype, device = model.config, model.dtype, model.device
    out = Path(out_root) / engine_name(config, dtype, device, backend, fp8=bool(quant))
    out.mkdir(parents=True, exist_ok=True)
    log = BuildLog([f"k3export build --backend {backend} -> {out}"], {})
    manifest = {
        "format": FORMAT, "backend": backend, "preset": preset_name(config), "config_hash": config.hash(),
        "config": config.to_hf(), "weights": weights_id, "precision": precision_name(dtype),
        "device": torch.device(device).type, "gpu": _gpu(device), "versions": _versions(),
        "profiles": profiles or DEFAULT_PROFILES, "state_layout": state_layout(config, dtype, rows="cache"),
    }
    if quant:
        manifest["quant"] = quant
    files: dict[str, str] = {}
    weights_key = _weights_key(manifest)
    old = _read_manifest(out)
    if old and old.get("weights_key") == weights_key and _files_ok(out, old, WEIGHTS):
        log.note(f"{WEIGHTS}: unchanged (same weights, precision and config), reused")
    else:
        log.step("write weights", _save_weights, model, out / WEIGHTS)
    files[WEIGHTS] = WEIGHTS
    if backend == "compile":
        # Nothing to compile ahead: Inductor specialises on the serving shapes (slot count, cache rows), so it
        # compiles on first use and keeps the generated code in inductor-cache/ for later processes.
        (out / "inductor-cache").mkdir(exist_ok=True)
        log.note("compile: code is generated on first use per shape, cached in inductor-cache/")
        manifest["inductor_cache"] = "inductor-cache"
    elif backend == "aoti":
        from k3export.build_aoti import build_aoti
        files.update(build_aoti(model, out, graphs, manifest, log, echo))
    elif backend == "tensorrt":
        from k3export.build_trt import build_tensorrt
        files.update(build_tensorrt(out, graphs, manifest, log))
    elif backend == "megakernel":
        from k3export.megakernel.backend import ENGINE_STEPS, build_megakernel
        files.update(build_megakernel(model, out, manifest, log,
                                      ENGINE_STEPS if steps_per_launch is None else steps_per_launch))
    manifest["weights_key"] = weights_key
    manifest["files"] = {name: {"bytes": (out / rel).stat().st_size, "sha256": file_sha256(out / rel)}
                         for name, rel in files.items()}
    manifest["build"] = {"seconds": log.seconds, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    if load_check is None:
        load_check = backend == "aoti" and torch.device(device).type == "cuda"
    if load_check:
        manifest["load_check"] = log.step("load check (child process)", run_load_check, out, device)
        atomic_write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        log.note(f"load check: {manifest['load_check']}")
    log.note(f"total: {sum(log.seconds.values()):.2f}s")
    atomic_write(out / "build.log", "\n".join(log.lines) + "\n")
    if not manifest.get("load_check", {}).get("ok", True):
        raise EngineLoadError(f"built {out}, but {load_check_failure(manifest['load_check'])}")
    return out


LOAD_CHECK = """
import faulthandler, sys, torch
faulthandler.enable()
from k3export.build import open_backend
from k3export.export import example_inputs, io_specs
path, device = sys.argv[1:3]
backend = open_backend(path, device)
cfg = backend.config
args = example_inputs(io_specs(cfg, backend.dtype)["decode"]["inputs"], {"batch": 1, "cache": 2}, device=device,
                      vocab=cfg.vocab_size)
with torch.no_grad():
    out = backend.decode(*args.values())
bad = [i for i, t in enumerate(out) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
print("load check: decode outputs", len(out), "non-finite", bad, flush=True)
sys.exit(3 if bad else 0)
"""
LOAD_CHECK_TIMEOUT_S = 600


def run_load_check(path: Path, device) -> dict:
    """Open the engine at `path` in a child process (`LOAD_CHECK`) and run one decode step (batch 1, two cache
    rows) on `device`; returns {"ok", "seconds", and on failure "error"}."""
    import signal
    import subprocess
    import sys
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", LOAD_CHECK, str(path), str(device)], capture_output=True,
                           text=True, timeout=LOAD_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": round(time.perf_counter() - t0, 1),
                "error": f"the child did not finish within {LOAD_CHECK_TIMEOUT_S} s"}
    res = {"ok": r.returncode == 0, "seconds": round(time.perf_counter() - t0, 1)}
    if r.returncode < 0:
        name = signal.Signals(-r.returncode).name
        where = next((ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("File")), "")  # innermost
        res["error"] = f"the child process was killed by {name}" + (f" (last frame: {where})" if where else "")
    elif r.returncode == 3:
        res["error"] = "one decode step gave non-finite outputs"
    elif r.returncode:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        res["error"] = f"the child process exited with {r.returncode}: {tail[:300]}"
    return res


def load_check_failure(check: dict) -> str:
    """Why an engine whose load check failed cannot be used, and what to do instead."""
    return (f"a process that loads it fails on this machine: {check.get('error', 'unknown error')}. On the H200 "
            "image with torch 2.11 + CUDA 13 every CUDA AOTInductor package crashed `aoti_load_package`, a toy "
            "Linear's in a process that imports only torch too (docs/perf.md; scripts/aoti_toy.py checks a machine); serve this model with "
            "`--backend compile` there, or rebuild with a torch whose CUDA AOTI packages load")


def _gpu(device) -> dict | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return {"name": torch.cuda.get_device_name(device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))}


def _versions() -> dict[str, str]:
    v = library_versions()
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v


def _weights_key(manifest: dict) -> str:
    fp8 = f":fp8:{manifest['quant']['scales_sha256']}" if manifest.get("quant") else ""
    return f"{manifest['config_hash']}:{manifest['weights']}:{manifest['precision']}{fp8}"


def _save_weights(model, path: Path) -> None:
    with replacing(path) as tmp:
        save_tensors({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, tmp)


# ---------------------------------------------------------------------------------------------- opening
def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _files_ok(out: Path, manifest: dict, *names: str) -> bool:
    try:
        return all(file_sha256(out / n) == manifest["files"][n]["sha256"] for n in names)
    except (OSError, KeyError):
        return False


def check_engine_dir(path: str | Path, device=None, config: K3Config | None = None, hash_files: bool = True) -> dict:
    """Validate an engine directory and return its manifest; raise EngineError saying what is wrong.

    Checks: a readable manifest of this format; every listed file present, of the recorded size (else
    'truncated') and sha256 (else 'corrupt'); the config (when given) by hash; for compiled artifacts (aoti,
    tensorrt) the library versions and the device/GPU they were built for."""
    path = Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: no such engine directory (build one with `k3export build`)")
    mpath = path / "manifest.json"
    if not mpath.exists():
        raise EngineError(f"{path}: no manifest.json; not an engine directory, or its build did not finish "
                          "(rebuild with `k3export build`)")
    try:
        m = json.loads(mpath.read_text())
    except ValueError as e:
        raise EngineError(f"{mpath} is corrupt (not valid JSON: {e}); rebuild the engine") from None
    if m.get("format") != FORMAT:
        raise EngineError(f"{mpath}: format {m.get('format')!r}, this k3export reads {FORMAT!r}; rebuild")
    problems = []
    for name, rec in m.get("files", {}).items():
        f = path / name
        if not f.exists():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != rec["bytes"]:
            problems.append(f"{name} is truncated or altered: {f.stat().st_size} bytes, manifest says {rec['bytes']}")
        elif hash_files and file_sha256(f) != rec["sha256"]:
            problems.append(f"{name} is corrupt: sha256 {file_sha256(f)[:12]}..., manifest says {rec['sha256'][:12]}...")
    if config is not None and config.hash() != m["config_hash"]:
        problems.append(f"config mismatch: engine built for config {m['config_hash']} ({m['preset']}), "
                        f"the model given has {config.hash()} ({preset_name(config)})")
    if not m.get("load_check", {}).get("ok", True):
        problems.append(load_check_failure(m["load_check"]))
    if m["backend"] == "megakernel":
        from k3export.megakernel.backend import stale_build
        why = stale_build(m)
        if why:
            problems.append(why)
    if m["backend"] in ("aoti", "tensorrt", "megakernel"):
        now = _versions()
        for lib in ("torch", "triton", "cuda"):
            if m["versions"].get(lib) != now.get(lib) and (lib != "triton" or m["device"] == "cuda"):
                problems.append(f"{lib} version mismatch: built with {m['versions'].get(lib)}, running {now.get(lib)}")
        dev = torch.device(device) if device is not None else torch.device(m["device"])
        if dev.type != m["device"]:
            problems.append(f"device mismatch: built for {m['device']}, asked to run on {dev.type}")
        elif m["gpu"] and dev.type == "cuda":
            if not torch.cuda.is_available():
                problems.append(f"built for GPU {m['gpu']['name']}, but no GPU is visible")
            elif _gpu(dev) != m["gpu"]:
                problems.append(f"GPU mismatch: built for {m['gpu']['name']} (sm {m['gpu']['capability']}), "
                                f"running on {_gpu(dev)['name']} (sm {_gpu(dev)['capability']})")
    if problems:
        raise EngineError(f"refusing engine {path}: " + "; ".join(problems) +
                          f" (rebuild with `k3export build --backend {m['backend']}`)")
    return m


def open_backend(path: str | Path, device=None, config: K3Config | None = None):
    """Check the engine directory, then load its backend (a `runtime.Backend`)."""
    path = Path(path)
    m = check_engine_dir(path, device, config)
    device = torch.device(device if device is not None else m["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"{path}: asked to run on {device}, but CUDA is not available here (no NVIDIA GPU or a "
                          "CPU-only torch); use --device cpu, or an engine built for the CPU")
    if m["backend"] == "aoti":
        from k3export.build_aoti import AOTIBackend
        return AOTIBackend(path, m, device)
    if m["backend"] == "tensorrt":
        from k3export.build_trt import TensorRTBackend
        return TensorRTBackend(path, m, device)
    model = _load_model(path, m, device)
    if m["backend"] == "megakernel":
        from k3export.megakernel.backend import open_megakernel
        return open_megakernel(path, m, model)
    if m["backend"] == "compile":
        from k3export.runtime import CompileBackend
        return CompileBackend(model, cache_dir=path)
    from k3export.runtime import EagerBackend
    return EagerBackend(model)


# The scales' names in an FP8 model's state dict are those of a scales file (`fp8.quantize_model`'s input).
SCALE_LEAVES = ("input_scale", "weight_scale", "w13_scale", "w2_scale", "w13_input_scale", "w2_input_scale")


def _load_model(path: Path, m: dict, device):
    from safetensors.torch import load_file
    from k3export.model import K3Model
    state = load_file(str(path / WEIGHTS), device=str(device))
    with torch.device("meta"):
        model = K3Model(K3Config.from_dict(m["config"]))
        if m.get("quant"):              # the FP8 modules' skeleton (shapes only, on meta), filled by the load
            from k3export.fp8 import quantize_model
            quantize_model(model, {k: v for k, v in state.items() if k.rpartition(".")[2] in SCALE_LEAVES})
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def load_engine(path: str | Path, max_batch: int = 1, max_len: int = 1024, device=None, cuda_graphs: bool = True,
                fit_batch: bool = False, **engine_options):
    """An `Engine` over the engine directory's backend, within its decode profile. fit_batch: cap `max_batch`
    at the profile's batch maximum instead of refusing (more requests than slots then queue). engine_options go to
    `Engine` (prefill_buckets, decode_buckets)."""
    from k3export.runtime import Engine
    backend = open_backend(path, device)
    prof = json.loads((Path(path) / "manifest.json").read_text())["profiles"]["decode"]
    if fit_batch:
        max_batch = min(max_batch, prof["batch"][2])
    if max_batch > prof["batch"][2] or max_len > prof["cache"][2]:
        raise EngineError(f"{path}: asked for batch {max_batch} x {max_len} cache rows, the engine's decode "
                          f"profile allows batch <= {prof['batch'][2]}, cache <= {prof['cache'][2]}; rebuild "
                          "with larger --max-batch/--max-len")
    return Engine(backend, max_batch, max_len, cuda_graphs=cuda_graphs, **engine_options)


# ---------------------------------------------------------------------------------------------- CLI
def best_backend(device) -> str:
    """TensorRT when it is installed and a GPU is used, else AOTInductor."""
    if torch.device(device).type == "cuda":
        try:
            from k3export.build_trt import import_tensorrt
            import_tensorrt()
            return "tensorrt"
        except EngineError:
            pass
    return "aoti"


def profiles_for(max_batch: int, max_tokens: int, max_len: int) -> dict:
    return {"prefill": {"batch": [1, 1, max_batch], "tokens": [1, min(128, max_tokens), max_tokens]},
            "decode": {"batch": [1, min(8, max_batch), max_batch], "cache": [1, min(1024, max_len), max_len]}}


@click.command("build")
@click.option("--backend", type=click.Choice(BACKENDS + ("best",)), default="best", show_default=True,
              help="best: tensorrt when installed on a GPU, else aoti.")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Random weights of a preset (default k3-tiny).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the preset's random weights.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True)
@device_option()
@click.option("--graphs", type=click.Path(exists=True, file_okay=False),
              help="Export directory (aoti/tensorrt); exported into the engine directory when omitted.")
@click.option("--out", type=click.Path(file_okay=False), default="engines", show_default=True,
              help="Parent of the engine directory (named <preset>-<precision>-<gpu>-<backend>).")
@click.option("--max-batch", type=int, default=8, show_default=True)
@click.option("--max-tokens", type=int, default=512, show_default=True, help="Longest prefill chunk.")
@click.option("--max-len", type=int, default=4096, show_default=True, help="Cache rows per sequence.")
@click.option("--load-check/--no-load-check", default=None,
              help="Open the engine in a child process and run one decode step before reporting success "
                   "[default: on for aoti engines on CUDA].")
@click.option("--scales", type=click.Path(exists=True, dir_okay=False),
              help="An FP8 engine: quantize the recipe's modules with this `k3export calibrate` scales file "
                   "(calibrated on the same weights and dtype; eager / compile, or tensorrt from FP8 graphs).")
@click.option("--steps-per-launch", type=click.IntRange(min=1),
              help="megakernel only: greedy steps one kernel launch may run [default: 8; 1 for one step a launch, "
                   "which wastes no steps after a stop token].")
@click.option("--dry-run", is_flag=True,
              help="tensorrt only, needs no TensorRT: rewrite --graphs' ONNX into plugin nodes and build every "
                   "plugin node against its registration (PTX compiled, shapes checked); writes trt-plan.json "
                   "beside the graphs, no engine.")
def build_command(backend, checkpoint, preset, seed, dtype, device, graphs, out, max_batch, max_tokens, max_len,
                  load_check, scales, steps_per_launch, dry_run):
    """Build an engine directory: engine files, manifest.json (versions, GPU, config hash, file hashes,
    profiles, state layout) and build.log with timings. Unchanged inputs are reused (weights, AOTI packages)."""
    if dry_run:
        if backend != "tensorrt":
            raise click.UsageError("--dry-run is for --backend tensorrt")
        from k3export.build_trt import dry_run as trt_dry_run
        t0 = time.perf_counter()
        try:
            plan = trt_dry_run(graphs, file_sha256(scales) if scales else None, echo=click.echo)
        except (EngineError, ValueError) as e:
            raise click.ClickException(str(e))
        click.echo(f"dry run: every plugin node builds and compiles ({time.perf_counter() - t0:.1f}s); no TensorRT "
                   f"engine was built -> {plan}")
        return
    if backend == "best":
        backend = "compile" if scales and torch.device(device).type == "cuda" else \
            "eager" if scales else best_backend(device)
    if backend == "megakernel" and max_batch != 1:
        raise click.UsageError(f"--backend megakernel decodes one sequence: pass --max-batch 1 (not {max_batch})")
    if steps_per_launch is not None and backend != "megakernel":
        raise click.UsageError(f"--steps-per-launch is for --backend megakernel, not {backend}")
    try:
        if scales:
            check_fp8_backend(backend, graphs, file_sha256(scales))     # before loading the model
        model = load_model(checkpoint, preset, PRECISIONS[dtype], device, seed)
        wid = checkpoint_fingerprint(checkpoint) if checkpoint else \
            preset_fingerprint(preset or "k3-tiny", seed, PRECISIONS[dtype])
        t0 = time.perf_counter()
        quant = quantize_for_engine(model, scales) if scales else None
        path = build(backend, model, out, graphs=graphs, weights_id=wid,
                     profiles=profiles_for(max_batch, max_tokens, max_len), echo=click.echo, load_check=load_check,
                     quant=quant, steps_per_launch=steps_per_launch)
    except (EngineError, ValueError) as e:
        raise click.ClickException(str(e))
    m = json.loads((path / "manifest.json").read_text())
    click.echo(f"built {backend} engine in {time.perf_counter() - t0:.1f}s -> {path}/")
    if backend == "megakernel":
        k = m["megakernel"]["steps_per_launch"]
        click.echo(f"  megakernel: {k} greedy step(s) a launch" + (" (pipelined greedy generation runs bursts of "
                                                                  f"{k}; sampled and single steps run one)" if k > 1 else ""))
    if quant:
        q = quant["quantized"]
        click.echo(f"  FP8 (E4M3): {q['linear']} linears and {q['experts']} expert banks quantized with {scales}; "
                   "the rest stays in the model dtype (the recipe's high-precision modules)")
    for name, rec in m["files"].items():
        click.echo(f"  {name:24s} {rec['bytes'] / 2**20:9.1f} MiB  sha256 {rec['sha256'][:12]}")
    for step, s in m["build"]["seconds"].items():
        click.echo(f"  {step:40s} {s:8.2f}s")
    if "load_check" in m:
        click.echo(f"  load check: opened in a child process, one decode step ran ({m['load_check']['seconds']}s)")
    click.echo(f"  log: {path / 'build.log'}")
