"""The main job's second half, after `init`: export -> build (the best backend here) -> run -> bench, each step
writing its artifact and saying where. `k3export demo` calls `run_pipeline` on the checkpoint it just wrote."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from k3export.generate import generate

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7]]


def run_pipeline(root: Path, ckpt: Path, device: str, echo, first_step: int = 3, steps: int = 6,
                 backend: str = "best") -> dict:
    """Returns {artifact name: path}. Steps are numbered from `first_step` of `steps`; `backend` is the engine to
    build ("best": `build.best_backend` for the device)."""
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        # Tiny shapes gain nothing from intra-op threads, and on a busy CPU OpenMP threads spin against other
        # jobs (measured at load ~5 on 2 cores: a k3-tiny eager decode step 19 ms with 1 thread, 160 ms with 2;
        # the AOTI engine took 72 s for 16 tokens with 2 threads at load 7, 0.14 s on a quieter machine).
        torch.set_num_threads(1)
    try:
        return _pipeline(root, ckpt, device, echo, first_step, steps, backend)
    finally:
        torch.set_num_threads(threads)


def build_engine(backend: str, model, out: Path, graphs: Path, weights: str, echo) -> tuple[str, Path]:
    """Build `backend`; when its engine cannot be loaded on this machine (the build's load check: CUDA AOTI
    packages crash the loading process on the H200 image), say so and build `compile` instead.
    Returns (backend built, engine directory)."""
    from k3export.build import EngineLoadError, build
    indent = lambda s: echo("      " + s)                                  # noqa: E731
    try:
        return backend, build(backend, model, out, graphs=graphs, weights_id=weights, echo=indent)
    except EngineLoadError as e:
        echo(f"      WARNING: {e}")
        echo("      falling back to the compile backend (torch.compile; code generated on first use per shape)")
        return "compile", build("compile", model, out, weights_id=weights, echo=indent)


def _pipeline(root: Path, ckpt: Path, device: str, echo, first_step: int, steps: int, backend: str) -> dict:
    from k3export.bench.model import (add_speedups, ceilings, markdown, param_bytes, plot, run_backend)
    from k3export.build import best_backend, load_engine, open_backend, preset_name
    from k3export.export import ExportLimits, export_graphs
    from k3export.manifest import checkpoint_fingerprint
    from k3export.model import K3Model
    from k3export.runtime import EagerBackend, Generator
    n = iter(range(first_step, steps + 1))
    art: dict[str, Path] = {}
    model = K3Model.from_pretrained(ckpt, dtype=torch.float32, device=device)
    weights = checkpoint_fingerprint(ckpt)

    echo(f"[{next(n)}/{steps}] export: prefill + decode graphs (torch.export)")
    t0 = time.perf_counter()
    graphs = root / "graphs"
    export_graphs(model, graphs, ExportLimits(max_batch=4, max_tokens=64, max_cache=256),
                  {"weights": weights, "checkpoint": str(ckpt)}, log=lambda s: echo("      " + s))
    echo(f"      {time.perf_counter() - t0:.1f}s; wrote {graphs}/ (prefill.pt2, decode.pt2, manifest.json)")
    art["graphs"] = graphs

    why = "as asked"
    if backend == "best":
        backend, why = best_backend(device), f"best backend on {device}"
    cached = "; AOTI packages are cached by graph hash, so a rerun reuses them" if backend == "aoti" else ""
    echo(f"[{next(n)}/{steps}] build: {backend} engine ({why}{cached})")
    t0 = time.perf_counter()
    backend, engine_dir = build_engine(backend, model, root / "engines", graphs, weights, echo)
    secs = json.loads((engine_dir / "manifest.json").read_text())["build"]["seconds"]
    echo(f"      {time.perf_counter() - t0:.1f}s ({', '.join(f'{k} {v:.1f}s' for k, v in secs.items())}); "
         f"wrote {engine_dir}/")
    art["engine"] = engine_dir

    echo(f"[{next(n)}/{steps}] run: {backend} engine, continuous batching, vs eager generate")
    engine = load_engine(engine_dir, max_batch=2, max_len=32, device=device)
    t0 = time.perf_counter()
    toks = Generator(engine).generate(PROMPTS, 8)
    dt = time.perf_counter() - t0
    ref = generate(model, PROMPTS, 8)
    for p, o in zip(PROMPTS, toks):
        echo(f"      {p} -> {o}")
    echo(f"      {sum(map(len, toks))} tokens in {dt:.2f}s; same greedy tokens as eager: "
         f"{'yes' if toks == ref else 'NO: eager gave ' + str(ref)}")
    (root / "generate.json").write_text(json.dumps({"prompts": PROMPTS, "tokens": toks, "eager": ref,
                                                    "engine": str(engine_dir)}, indent=2))
    art["tokens"] = root / "generate.json"

    echo(f"[{next(n)}/{steps}] bench: prefill and decode latency, {backend} vs eager PyTorch")
    cuda = torch.device(device).type == "cuda"
    bw, rate, where = ceilings(cuda)
    pb = param_bytes(model.config, model.dtype)
    args = {"prefill_lengths": [16, 64], "batches": [1, 2, 4], "contexts": [64], "warmup": 2, "iters": 10,
            "decode_iters": 20}
    runs = [("eager", EagerBackend(model), False)] + ([("graph", EagerBackend(model), True)] if cuda else []) + \
        [(backend, open_backend(engine_dir, device), cuda)]

    class _Bar:
        def update(self, _):
            pass

    rows = []
    for name, be, graphs_on in runs:
        rows += run_backend(name, be, graphs_on, model, args, bw, rate, pb, _Bar())
    add_speedups(rows)
    table = markdown(rows)
    bench_dir = root / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / "model.json").write_text(json.dumps({"machine": where, "rows": rows}, indent=2))
    (bench_dir / "model.md").write_text(f"{where}\n\n{table}")
    png = plot(rows, bench_dir / "model.png", f"{preset_name(model.config)} fp32, {where}")
    echo(table)
    echo(f"      wrote {bench_dir / 'model.json'}, {bench_dir / 'model.md'}" + (f", {png}" if png else ""))
    art["bench"] = bench_dir
    return art
