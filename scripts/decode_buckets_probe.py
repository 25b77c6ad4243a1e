"""What `Engine(decode_buckets=True)` buys a partly filled engine: k3-small bf16 through the `compile` backend, an
engine of --slots slots whose first k slots hold a --context-token sequence each (prefilled through the engine, so
its host bookkeeping sees them), one decode step timed (CUDA events around `Engine.decode`, as `bench model`),
with and without the buckets, for each k of --active. GPU only; planning for #6 (not yet run).

    python3 scripts/decode_buckets_probe.py [--slots 64] [--active 1,3,17,64] [--context 1024] [--steps 50]
                                            [--out probe.json]

Per k: the median step in ms and the rows the step ran. The context is prefilled once per k (a 1024-token prompt
per slot), so each k costs a few seconds; the first use of a bucket compiles and captures its graph (not timed).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gemv_pack_probe import write_json      # scripts/ on sys.path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--active", default="1,3,17,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from k3export.bench.model import time_ms
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend, Engine

    model = random_model(K3Config.from_name("k3-small"), seed=0, dtype=torch.bfloat16, device="cuda")
    backend = CompileBackend(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (a.context,), generator=g).tolist()
    rows = []
    for buckets in (False, True):
        eng = Engine(backend, max_batch=a.slots, max_len=a.context + 2 * a.steps + 16, decode_buckets=buckets)
        assert eng.graphed, eng.graph_error
        for k in (int(x) for x in a.active.split(",")):
            for s in range(a.slots):
                eng.release(s)
            for s in range(k):
                eng.prefill([s], [prompt])
            tok = torch.zeros(a.slots, dtype=torch.int64, device="cuda")
            ms = time_ms(lambda: eng.decode(tok), 5, a.steps, True)      # the next k's prefills reset the lengths
            row = {"buckets": buckets, "active": k, "rows": eng.decode_rows(), "ms": statistics.median(ms)}
            rows.append(row)
            print(f"buckets={buckets!s:5} active={k:3d} rows={row['rows']:3d}: {row['ms']:.3f} ms", flush=True)
        del eng
    res = {"preset": "k3-small", "backend": "compile", "slots": a.slots, "context": a.context, "steps": a.steps,
           "device": torch.cuda.get_device_name(), "rows": rows}
    write_json(a.out, res)


if __name__ == "__main__":
    main()
