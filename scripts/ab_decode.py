"""A/B of a process-wide switch on the k3-small decode step, in one process: the model and its backend are built
once, then an Engine (its CUDA graph captured with the switch set) is timed per setting, the settings interleaved
over several rounds so that clock and thermal drift fall on all of them alike. GPU only.

    python3 scripts/ab_decode.py --env NAME=A,B [--backend compile] [--batch 1] [--context 1024]
                                 [--rounds 4] [--steps 200] [--out ab.json]

Per setting: the median of every round's per-call times (CUDA events around `Engine.decode`, as `bench model`
times a decode step) and each round's median. Only switches read at launch time are meaningful here (the engine's
graph is captured after the switch is set); switches read at import are not."""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", required=True, help="NAME=V1,V2,...")
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    name, _, values = a.env.partition("=")
    values = values.split(",")
    from k3export.bench.model import COMPILE_VARIANTS, time_ms
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend, Engine
    model = random_model(K3Config.from_name(a.preset), seed=0, dtype=torch.bfloat16, device="cuda")
    backend = CompileBackend(model, **COMPILE_VARIANTS[a.backend])
    tok = torch.randint(0, model.config.vocab_size, (a.batch,), device="cuda")
    times: dict[str, list[list[float]]] = {v: [] for v in values}
    for r in range(a.rounds):
        for v in values:
            os.environ[name] = v
            eng = Engine(backend, max_batch=a.batch, max_len=a.context + a.steps + 16)
            assert eng.graphed, eng.graph_error
            eng.active.fill_(True)
            eng.state.lengths.fill_(a.context)
            times[v].append(time_ms(lambda: eng.decode(tok), 10, a.steps, True))
            del eng
            print(f"round {r} {name}={v}: median {statistics.median(times[v][-1]):.4f} ms", flush=True)
    res = {"env": name, "backend": a.backend, "batch": a.batch, "context": a.context, "rounds": a.rounds,
           "steps": a.steps, "device": torch.cuda.get_device_name(),
           "median_ms": {v: statistics.median(sum(t, [])) for v, t in times.items()},
           "round_medians_ms": {v: [statistics.median(x) for x in t] for v, t in times.items()}}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
