"""A/B of a process-wide switch on the k3-small decode step, in one process: the model and its backend are built
once, then an Engine (its CUDA graph captured with the switch set) is timed per setting, the settings interleaved
over several rounds so that clock and thermal drift fall on all of them alike. GPU only.

    python3 scripts/ab_decode.py --env NAME=A,B [--env NAME2=A,B,C ...] [--set NAME3=V ...] [--config FIELD=A,B]
                                 [--backends A,B] [--backend compile] [--batch 1] [--context 1024] [--rounds 4]
                                 [--steps 200] [--fp8] [--precisions] [--skeleton] [--on-skeleton]
                                 [--background 0,32,66] [--out ab.json]

Each --env is one experiment on the same compiled model, run in turn (each --set NAME=V holds a variable for all of
them, except an experiment over NAME itself); --config FIELD=A,B is one experiment over models whose K3Config
field FIELD (an int field of the preset) takes each value (one model and one compile per value: e.g.
num_shared_experts=2,0 to see what a part of the step costs on the chain); --backends A,B one over compile
variants (`bench model`'s names), one model each; --precisions one over the bf16 model and its FP8 copy
(default recipe, calibrated on the embedded set as `bench fp8` does), both through --backend; --skeleton one over
the preset and its skeleton (SKELETON below), with each one's bytes floor. --fp8 runs the other experiments on the
FP8 copy, --on-skeleton on the skeleton. --background N1,N2 one over a concurrent HBM reader (`hbm_background.py`)
of N programs on a side stream, with the rate it achieved beside the step and alone.
Per setting: the median of every round's per-call times (CUDA events around `Engine.decode`, as `bench model`
times a decode step) and each round's median. Only switches read at launch time are meaningful here (the engine's
graph is captured after the switch is set); switches read at import are not."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch

from gemv_pack_probe import write_json      # scripts/ on sys.path


# --skeleton / --on-skeleton: the preset with these widths (made for k3-small: d 2048 -> 256, q latent 768 -> 64,
# expert latent 1024 -> 128, expert and dense MLP widths 768 / 8192 -> 64 / 256, vocab 32768 -> 1024), every layer,
# head, expert count, head dim and kernel kept: k3-small's decode step at B = 1 then moves ~106 MB instead of
# ~1458 MB, so its time is what the chain of dependent kernels costs without the bytes.
SKELETON = dict(hidden_size=256, q_lora_rank=64, routed_expert_hidden_size=128, moe_intermediate_size=64,
                intermediate_size=256, vocab_size=1024)


def _time(backend, model, batch: int, context: int, steps: int, around=contextlib.nullcontext) -> list[float]:
    """Per-call ms of `steps` decode steps (after 10 warm-up steps) of a fresh Engine, its graph captured first;
    the warm-up and timing run inside `around()`."""
    from k3export.bench.model import time_ms
    from k3export.runtime import Engine
    tok = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
    eng = Engine(backend, max_batch=batch, max_len=context + steps + 16)
    assert eng.graphed, eng.graph_error
    eng.fill_slots(context)
    eng.decode(tok)
    torch.cuda.synchronize()
    with around():
        t = time_ms(lambda: eng.decode(tok), 10, steps, True)
    del eng
    return t


def _experiment(label: str, values: list[str], run, a) -> dict:
    """run(value) -> per-call ms of one round; the values interleaved over a.rounds rounds."""
    times: dict[str, list[list[float]]] = {v: [] for v in values}
    for r in range(a.rounds):
        for v in values:
            times[v].append(run(v))
            print(f"round {r} {label}={v}: median {statistics.median(times[v][-1]):.4f} ms", flush=True)
    return {"switch": label, "median_ms": {v: statistics.median(sum(t, [])) for v, t in times.items()},
            "round_medians_ms": {v: [statistics.median(x) for x in t] for v, t in times.items()}}


def _over_models(label: str, built: dict, a) -> dict:
    """`_experiment` over built {value: (model, backend)}: each value times its own model."""
    return _experiment(label, list(built), lambda v: _time(built[v][1], built[v][0], a.batch, a.context, a.steps),
                       a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", default=[], help="NAME=V1,V2,... (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE set for every --env experiment (except "
                    "one over NAME itself, which sets it per setting), e.g. the tiling whose own switch is A/B'd")
    ap.add_argument("--config", action="append", default=[], help="FIELD=V1,V2,... (int K3Config field)")
    ap.add_argument("--backends", default=None, help="B1,B2,...: compile variants, one model each")
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp8", action="store_true", help="time the FP8 model (default recipe, calibrated as `bench fp8`)")
    ap.add_argument("--precisions", action="store_true",
                    help="one more experiment: the bf16 model vs its FP8 copy, both through --backend")
    ap.add_argument("--on-skeleton", action="store_true",
                    help="run the --env / --config / --backends / --precisions experiments on the preset's skeleton "
                         "(SKELETON): what each change does to the chain of kernels alone")
    ap.add_argument("--skeleton", action="store_true",
                    help="one more experiment: the preset vs its skeleton (SKELETON: the same layers, heads, experts "
                         "and kernels at narrow widths, so its step moves almost no bytes), each with its bytes floor")
    ap.add_argument("--background", default=None,
                    help="N1,N2,...: one more experiment: the step with a concurrent HBM reader of N programs "
                         "(0: none) on a side stream, and the read rate it achieved")
    a = ap.parse_args()
    if not (a.env or a.config or a.backends or a.precisions or a.skeleton or a.background):
        ap.error("give at least one --env, --config, --backends, --precisions, --skeleton or --background "
                 "experiment")
    if a.background is not None:
        try:
            programs = [int(v) for v in a.background.split(",")]
        except ValueError:
            ap.error(f"--background takes program counts N1,N2,..., got {a.background!r}")
        if any(n < 0 for n in programs):
            ap.error(f"--background program counts must be >= 0, got {a.background!r}")
    if a.set and not a.env:
        ap.error("--set holds variables for --env experiments: give at least one --env")
    if any("=" not in spec for spec in a.set):
        ap.error(f"--set takes NAME=VALUE, got {a.set}")
    if a.skeleton and a.fp8:
        ap.error("--skeleton's bytes floors are bf16 ones: run it without --fp8")
    from dataclasses import replace

    from k3export.bench.model import COMPILE_VARIANTS
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend

    def build(config, variant=a.backend, fp8=a.fp8):
        model = random_model(config, seed=0, dtype=torch.bfloat16, device="cuda")
        if fp8:                                       # as `bench fp8` builds its FP8 copy
            from k3export.calibrate import DEFAULT_RECIPE, Recipe, calibrate, default_batches
            from k3export.fp8 import quantize_model
            quantize_model(model, calibrate(model, Recipe.load(DEFAULT_RECIPE), default_batches(config.vocab_size),
                                            progress=False))
        return model, CompileBackend(model, **COMPILE_VARIANTS[variant])

    base = K3Config.from_name(a.preset)
    preset_config = base
    if a.on_skeleton:
        base = replace(base, **SKELETON)
    experiments = []
    if a.env:
        model, backend = build(base)
        fixed = dict(spec.split("=", 1) for spec in a.set)
        os.environ.update(fixed)
        for spec in a.env:
            name, _, values = spec.partition("=")

            def run(v, name=name):
                os.environ[name] = v
                return _time(backend, model, a.batch, a.context, a.steps)
            experiments.append(_experiment(name, values.split(","), run, a))
            if name in fixed:
                os.environ[name] = fixed[name]
            else:
                os.environ.pop(name, None)
        del model, backend
    for spec in a.config:
        field, _, values = spec.partition("=")
        built = {v: build(replace(base, **{field: int(v)})) for v in values.split(",")}
        experiments.append(_over_models(field, built, a))
        del built
    if a.backends:
        built = {v: build(base, v) for v in a.backends.split(",")}
        experiments.append(_over_models("backend", built, a))
        del built
    if a.precisions:
        built = {"bf16": build(base, fp8=False), "fp8": build(base, fp8=True)}
        experiments.append(_over_models("precision", built, a))
        del built
    if a.skeleton:
        from k3export.bench.ceilings import copy_bandwidth
        from k3export.bench.model import decode_bytes, param_bytes
        configs = {a.preset: preset_config, "skeleton": replace(preset_config, **SKELETON)}
        built = {v: build(c) for v, c in configs.items()}
        exp = _over_models("model", built, a)
        bw = copy_bandwidth()
        exp["floor_ms"] = {v: decode_bytes(c, torch.bfloat16, param_bytes(c, torch.bfloat16), a.batch, a.context)
                           / bw * 1e3 for v, c in configs.items()}
        exp["skeleton_fields"] = SKELETON
        print(f"bytes floors (copy {bw / 1e12:.2f} TB/s): {exp['floor_ms']}", flush=True)
        experiments.append(exp)
        del built
    if a.background is not None:
        from hbm_background import Background, alone, new_buffer
        model, backend = build(base)
        buf = new_buffer()
        readers = {str(n): Background(n, buf=buf) for n in programs}      # built (and compiled) once
        rates: dict[str, list[float]] = {v: [] for v in readers}

        def run_bg(v):
            t = _time(backend, model, a.batch, a.context, a.steps, around=lambda: readers[v])
            rates[v].append(readers[v].bandwidth)
            return t
        exp = _experiment("background_programs", list(readers), run_bg, a)
        exp["reader_gbps_beside_step"] = {v: [r / 1e9 for r in rs] for v, rs in rates.items()}
        exp["reader_gbps_alone"] = {v: alone(bg) / 1e9 for v, bg in readers.items()}
        print(f"reader GB/s beside the step: {exp['reader_gbps_beside_step']}; alone: {exp['reader_gbps_alone']}",
              flush=True)
        experiments.append(exp)
        del model, backend, readers, buf
    res = {"backend": a.backend, "preset": a.preset, "on_skeleton": a.on_skeleton, "fp8": a.fp8, "batch": a.batch,
           "context": a.context,
           "rounds": a.rounds, "steps": a.steps, "device": torch.cuda.get_device_name(), "experiments": experiments}
    print(json.dumps(res, indent=1))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
