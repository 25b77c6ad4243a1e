"""Where a device-side draw's time goes (`k3export.sampling.draw`) at B = 1 and 64 over k3-small's 32768 logits
(--vocab 163840: K3's): host time per call (no sync between calls, then one), GPU time (CUDA events around a
CUDA-graph replay of the draw), for the Triton program with top-p (a sort, then the program), with top-k 50 (a
top-k instead of the sort) and without a filter, the torch form, the argmax program and torch.argmax; then
torch.profiler's table of one filtered call. GPU only.

    python3 scripts/sampling_probe.py [--vocab 32768] [--iters 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from k3export.sampling import argmax_rows, draw, draw_reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    for B in (1, 64):
        words = torch.randn(B, 2 * a.vocab, device="cuda") * 4
        x = words[:, 0::2]
        temp = torch.full((B,), 0.8, device="cuda")
        top_k = torch.zeros(B, dtype=torch.int64, device="cuda")
        top_p = torch.full((B,), 0.95, device="cuda")
        seed = torch.arange(B, device="cuda")
        counter = torch.full((B,), 7, device="cuda")
        out = torch.empty(B, dtype=torch.int64, device="cuda")
        k50 = torch.full((B,), 50, dtype=torch.int64, device="cuda")
        fns = {"draw (top-p)": lambda: draw(x, temp, top_k, top_p, seed, counter, out=out),
               "draw (top-k 50)": lambda: draw(x, temp, k50, top_p, seed, counter, out=out, width=50),
               "draw (no filter)": lambda: draw(x, temp, top_k, top_p, seed, counter, out=out, filtered=False),
               "torch form (top-p)": lambda: out.copy_(draw_reference(x, temp, top_k, top_p, seed, counter)),
               "argmax program": lambda: argmax_rows(x, out=out),
               "torch.argmax": lambda: out.copy_(x.argmax(-1))}
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                fn()
            host = (time.perf_counter() - t0) / a.iters * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.iters * 1e6
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            s.record()
            for _ in range(a.iters):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            print(f"B {B:3d} {name:20s} host {host:8.1f} us/call, host + GPU {wall:8.1f}, graph replay "
                  f"{s.elapsed_time(e) / a.iters * 1e3:8.1f} us", flush=True)
    from torch.profiler import ProfilerActivity, profile
    B = 1
    x = (torch.randn(B, 2 * a.vocab, device="cuda") * 4)[:, 0::2]
    args = (torch.full((B,), 0.8, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda"),
            torch.full((B,), 0.95, device="cuda"), torch.arange(B, device="cuda"), torch.full((B,), 7, device="cuda"))
    draw(x, *args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            draw(x, *args)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
