"""Where a k3-small decode step's GPU time goes: one step (B sequences, `context` cached tokens) profiled with
torch.profiler after warm-up; prints the kernel count, the sum of kernel times against the step's wall time
(the rest is launch gaps), and the top kernels grouped by name; for the CUDA-graph replay also its critical path
(`bench.ceilings.critical_path`: what each kernel adds to the span once PDL overlaps them). GPU only.

    python3 scripts/profile_decode.py [--preset k3-small] [--batch 1] [--context 1024] [--top 25] [--backend graph]

`--backend graph` (default): the model's programs as they are (one kernel per aten/k3 op); `compile`: the same
programs through torch.compile (Inductor), as the `compile` backend of `k3export bench model` runs them;
`compile-frozen`: the same with Inductor freezing (weights as constants, matmuls sharing an input merged).
`megakernel` (and its `bench model` variants): the persistent decode kernel (`k3export.megakernel`, B = 1, prefill on
`compile`). `--timeline` also prints the replay's kernels in order, each with its start, length and the gap before
it; `--generate N` then profiles N tokens of a pipelined greedy `Generator` (what `bench model`'s "generate
pipelined" row times) and prints its GPU timeline the same way, with the time from one step's first kernel to the
next's.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from k3export.bench.ceilings import critical_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    from k3export.bench.model import BACKENDS, make_backend
    ap.add_argument("--backend", choices=[b for b in BACKENDS if b not in ("eager", "aoti")], default="graph")
    ap.add_argument("--timeline", action="store_true", help="the graph replay's kernels in order, with their gaps")
    ap.add_argument("--generate", type=int, default=0, help="also profile this many pipelined greedy tokens")
    ap.add_argument("--fp8", action="store_true", help="the model quantized by the default recipe first")
    a = ap.parse_args()
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from k3export.runtime import Engine
    model = random_model(K3Config.from_name(a.preset), seed=0, dtype=torch.bfloat16, device="cuda")
    if a.fp8:
        from k3export.calibrate import DEFAULT_RECIPE, Recipe, calibrate, default_batches
        from k3export.fp8 import quantize_model
        scales = calibrate(model, Recipe.load(DEFAULT_RECIPE), default_batches(model.config.vocab_size),
                           progress=False)
        print("quantized:", quantize_model(model, scales))
    max_len = a.context + 16 + a.generate
    backend = make_backend(a.backend, model, Path("engines"), {}, print, max_len)[0]     # (as `bench model` makes it)
    eng = Engine(backend, max_batch=a.batch, max_len=max_len, cuda_graphs=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (a.context,), generator=g).tolist() for _ in range(a.batch)]
    eng.prefill(list(range(a.batch)), prompts)
    tok = torch.zeros(a.batch, dtype=torch.int64, device="cuda")
    for _ in range(3):
        eng.decode(tok)
    torch.cuda.synchronize()
    captured = eng._graph
    for graphs in (False, True):
        eng._graph = captured if graphs else None           # the uncaptured step, then the CUDA-graph replay
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        eng.decode(tok)
        e.record()
        torch.cuda.synchronize()
        wall = s.elapsed_time(e)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.decode(tok)
            torch.cuda.synchronize()
        kern = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(ev.device_time for ev in kern) / 1e3
        print(f"\n== {a.preset}{' fp8' if a.fp8 else ''} decode ({a.backend}) B={a.batch} context={a.context} "
              f"{'CUDA graph' if graphs else 'no graph'}: "
              f"step {wall:.3f} ms, {len(kern)} kernels, kernel time {busy:.3f} ms "
              f"({100 * busy / wall:.0f}% of the step), mean {1e3 * busy / max(len(kern), 1):.1f} us/kernel")
        by = collections.defaultdict(lambda: [0, 0.0])
        for ev in kern:
            by[ev.name[:90]][0] += 1
            by[ev.name[:90]][1] += ev.device_time / 1e3
        print(f"{'count':>6} {'ms':>8} {'%':>5}  kernel")
        for name, (n, ms) in sorted(by.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"{n:6d} {ms:8.3f} {100 * ms / busy:5.1f}  {name}")
        if graphs and a.timeline:
            print("the replay in order:")
            print_timeline(kern)
        if graphs:                    # under PDL the kernels overlap: what each one adds to the step's span
            cp = critical_path([(ev.name[:90], ev.time_range.start, ev.time_range.end) for ev in kern])
            print(f"\n   critical path of the replay: span {cp['span'] / 1e3:.3f} ms = exposed kernel time "
                  f"{(cp['span'] - cp['idle']) / 1e3:.3f} + idle {cp['idle'] / 1e3:.3f} (kernels busy "
                  f"{cp['busy'] / 1e3:.3f} ms: {cp['busy'] / max(cp['span'], 1e-9):.2f}x overlapped)")
            print(f"{'count':>6} {'exposed ms':>11} {'us each':>8}  kernel")
            for name, (n, us) in list(cp["by_name"].items())[:a.top]:
                print(f"{n:6d} {us / 1e3:11.3f} {us / n:8.2f}  {name}")
    if a.generate:
        generate_timeline(eng, prompts[0], a.generate)


def print_timeline(kern) -> None:
    """Kernels (profiler events) in start order: start, gap after the previous ones, length, name."""
    kern = sorted(kern, key=lambda ev: ev.time_range.start)
    t0 = end = kern[0].time_range.start
    print(f"{'start us':>9} {'gap us':>7} {'us':>8}  kernel")
    for ev in kern:
        r = ev.time_range
        print(f"{r.start - t0:9.1f} {r.start - end:7.1f} {r.end - r.start:8.1f}  {ev.name[:90]}")
        end = max(end, r.end)


def generate_timeline(eng, prompt: list[int], n: int) -> None:
    """n tokens of a pipelined greedy Generator on slot 0 (after its prefill and first step), profiled: the GPU
    timeline, and per step the time between the starts of consecutive steps' largest kernels."""
    from k3export.runtime import Generator
    if eng._host_active[0]:
        eng.release(0)
    gen = Generator(eng, pipeline=True)
    gen.submit(prompt, n + 2)
    gen.step()                                           # the prefill and the first step: not profiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.run()
        torch.cuda.synchronize()
    kern = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\n== pipelined greedy generation, {n + 1} steps profiled: {len(kern)} GPU ops")
    print_timeline(kern)
    big = sorted((ev for ev in kern if ev.time_range.end - ev.time_range.start > 100),
                 key=lambda ev: ev.time_range.start)
    starts = [ev.time_range.start for ev in big]
    steps = [b - a for a, b in zip(starts, starts[1:])]
    if steps:
        print(f"step to step (the largest kernel's starts): {', '.join(f'{s:.1f}' for s in steps)} us; "
              f"kernel {', '.join(f'{ev.time_range.end - ev.time_range.start:.1f}' for ev in big)} us")


if __name__ == "__main__":
    main()
