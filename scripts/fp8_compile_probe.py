"""Does the `compile` backend serve an FP8 model's numbers? k3-tiny (bf16 or fp32, calibrated on the embedded
default set, quantized with `quantize_model`) through `Engine` on the GPU: the same prompts prefilled into two
slots, then decode steps fed the eager backend's greedy tokens (teacher forcing: every backend sees the same
inputs), and each step's logits compared with the eager backend's (max |diff| / max |eager|). One row per
`CompileBackend` variant (each serving swap turned off in turn, and the packed model run eagerly), and the same for
the model without FP8 as the yardstick of what compile-vs-eager rounding gives; in bf16 and in fp32 activations.

    python3 scripts/fp8_compile_probe.py [--steps 6] [--preset k3-tiny] [--variants compile,no-pack,...]
        [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import copy

import torch

from k3export.calibrate import DEFAULT_RECIPE, Recipe, calibrate, default_batches
from k3export.config import K3Config
from k3export.fp8 import quantize_model
from k3export.model.weights import random_model
from k3export.runtime import CompileBackend, EagerBackend, Engine

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7]]
VARIANTS = {"compile": {}, "no-pack": dict(pack=False), "no-fp8-cols": dict(fp8_cols=False),
            "no-gemv": dict(gemv=False), "no-pdl": dict(pdl=False), "no-inplace": dict(inplace=False),
            "no-fuse-norms": dict(fuse_norms=False), "no-pair": dict(pair_experts=False)}


def run(backend, steps: int, forced=None):
    eng = Engine(backend, max_batch=2, max_len=32, cuda_graphs=True)
    logits = [eng.prefill([0, 1], PROMPTS).float().clone()]       # graph outputs: overwritten by the next call
    toks = []
    for i in range(steps):
        t = logits[-1].argmax(-1) if forced is None else forced[i]
        toks.append(t)
        logits.append(eng.decode(t)[:2].float().clone())
    return logits, toks


def compare(model, name: str, steps: int, variants) -> None:
    ref, toks = run(EagerBackend(copy.deepcopy(model)), steps)

    def rel(out):
        return " ".join(f"{((o - r).abs().max() / r.abs().max()).item():.1e}" for o, r in zip(out, ref))
    for var in variants:
        kw = VARIANTS[var]
        m = copy.deepcopy(model)
        out, _ = run(CompileBackend(m, **kw), steps, toks)
        print(f"{name:13s} {var:14s} prefill, steps: {rel(out)}", flush=True)
        if var == "compile":                       # the same serving swaps, run eagerly (no Inductor)
            out, _ = run(EagerBackend(m), steps, toks)
            print(f"{name:13s} {'packed-eager':14s} prefill, steps: {rel(out)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--variants", default="compile,no-pack,no-fp8-cols,no-gemv,no-inplace",
                    help=f"of {', '.join(VARIANTS)}; the bf16 model runs the first only")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="model dtypes (activations), each with and "
                    "without FP8")
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    for dt in a.dtypes.split(","):
        model = random_model(K3Config.from_name(a.preset), seed=0, dtype=getattr(torch, dt), device=a.device)
        compare(model, dt, a.steps, variants[:1])             # the yardstick: compile vs eager without FP8
        scales = calibrate(model, Recipe.load(DEFAULT_RECIPE), default_batches(model.config.vocab_size),
                           progress=False)
        fp8 = copy.deepcopy(model)
        quantize_model(fp8, scales)
        compare(fp8, f"{dt}+fp8", a.steps, variants)


if __name__ == "__main__":
    main()
