"""Diagnose and time the STEP_LOOP build (several greedy steps a launch) on k3-small, B = 1, context 1024.

Stages, each checked (`be.check()` after a sync) and reported as it ends: the bench's decode (fill_slots, plain decode
graph replays), sampled steps after a prefill, plain decode after a launch of K steps, then the Generator's pipelined
greedy generation timed (mean ms a token over windows of K gaps, as `bench model`) against the default build in the
same process, rounds interleaved. Usage: python scripts/mkloop_probe.py [--steps 4,8] [--tokens 64] [--rounds 3]."""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", default="decode,sampled,mixed")
    a = ap.parse_args()
    from k3export.bench.fp8 import gpu_random_model
    from k3export.config import K3Config
    from k3export.generate import Sampling
    from k3export.megakernel import backend as mb
    from k3export.runtime import EagerBackend, Engine, Generator
    model = gpu_random_model(K3Config.from_name("k3-small"), 0)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1024,), generator=g).tolist()
    max_len = 1024 + a.tokens + 400
    pre = EagerBackend(model)
    ks = [int(k) for k in a.steps.split(",")]
    backs = {1: mb.MegakernelBackend(model, max_len=max_len, prefill_backend=pre)}
    for k in ks:
        backs[k] = mb.MegakernelBackend(model, max_len=max_len, prefill_backend=pre, steps_per_launch=k)
    tok = torch.tensor([7], device="cuda")

    def stage(name, k, fn):
        try:
            fn()
            torch.cuda.synchronize()
            backs[k].check()
            print(f"[k={k}] {name}: ok", flush=True)
        except Exception as e:                                          # noqa: BLE001
            print(f"[k={k}] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc()

    for k in ks:
        be = backs[k]
        if "decode" in a.stages:
            def bench_decode():
                eng = Engine(be, max_batch=1, max_len=max_len)
                print(f"[k={k}] graphed {eng.graphed} steps graph {eng._steps_graph is not None} "
                      f"error {eng.graph_error}", flush=True)
                eng.fill_slots(1024)
                for i in range(40):
                    eng.decode(tok)
                    if i in (0, 1, 5, 39):
                        torch.cuda.synchronize()
                        be.check()
                        print(f"  decode {i}: ok", flush=True)
            stage("bench decode (fill_slots, plain decode)", k, bench_decode)
        if "sampled" in a.stages:
            def sampled():
                eng = Engine(be, max_batch=1, max_len=max_len)
                eng.prefill([0], [prompt[:64]])
                eng.set_sampling([0], [Sampling(temperature=0.8, top_p=0.95)])
                for i in range(6):
                    eng.decode_sampled(tok if i == 0 else None)
                    torch.cuda.synchronize()
                    be.check()
            stage("sampled steps after a prefill", k, sampled)
        if "mixed" in a.stages:
            def mixed():
                eng = Engine(be, max_batch=1, max_len=max_len)
                eng.prefill([0], [prompt[:64]])
                eng.decode_greedy_steps(k, tok)
                torch.cuda.synchronize()
                be.check()
                eng.decode(tok)
                torch.cuda.synchronize()
                be.check()
                eng.decode_greedy()
                eng.decode_greedy_steps(k)
            stage("plain decode after a launch of K steps", k, mixed)

    # the device time a token: M greedy tokens after a 1024-token prompt as M single-step graph replays (every
    # build) and as M / K replays of the K-step graph (STEP_LOOP builds), back to back, CUDA events around them;
    # the last token of each run (a chain of M argmaxes) compared with the default build's
    M = a.tokens - a.tokens % 8
    for r in range(a.rounds):
        last = {}
        for k, be in backs.items():
            for kk in sorted({1, max(k, 1)}):
                try:
                    eng = Engine(be, max_batch=1, max_len=max_len)
                    first = int(eng.prefill([0], [prompt])[0].argmax())
                    ids = torch.tensor([first], device="cuda")
                    eng.decode_greedy(ids)                                  # (loads the state: outside the timing)
                    torch.cuda.synchronize()
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    for _ in range(M // kk):
                        eng.decode_greedy_steps(kk) if kk > 1 else eng.decode_greedy()
                    t1.record()
                    torch.cuda.synchronize()
                    be.check()
                    tok = int(eng._ids[0])
                    last.setdefault(1 if k == 1 else (k, kk), tok)
                    print(f"round {r} build k={k}, {kk} step(s) a launch: {t0.elapsed_time(t1) / M:.4f} ms a token "
                          f"(device, {M} tokens); last token {tok} (default's {last.get(1)})", flush=True)
                    del eng
                except Exception as e:                                  # noqa: BLE001
                    print(f"round {r} build k={k}, {kk} step(s): FAILED {type(e).__name__}: {str(e)[:300]}",
                          flush=True)

    # pipelined greedy generation, rounds interleaved
    res = {k: [] for k in backs}
    toks = {}
    for r in range(a.rounds):
        for k, be in backs.items():
            try:
                eng = Engine(be, max_batch=1, max_len=max_len)
                stamps = []
                gen = Generator(eng, on_token=lambda q, t: stamps.append(time.perf_counter()))
                req = gen.submit(prompt, a.tokens)
                gen.step()
                gen.run()
                be.check()
                ms = [(y - x) * 1e3 for x, y in zip(stamps[2:], stamps[3:])]
                kk = gen.steps_per_launch
                win = [sum(ms[i:i + kk]) / kk for i in range(len(ms) - kk + 1)]
                res[k].append((statistics.median(win), sum(ms) / len(ms)))
                toks.setdefault(k, req.tokens)
                print(f"round {r} k={k}: median window {res[k][-1][0]:.4f} ms, mean {res[k][-1][1]:.4f} ms",
                      flush=True)
                del gen, eng
            except Exception as e:                                      # noqa: BLE001
                print(f"round {r} k={k}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    for k in res:
        if res[k]:
            print(f"k={k}: pipelined greedy, median of rounds: window {statistics.median(x for x, _ in res[k]):.4f} "
                  f"ms, mean {statistics.median(y for _, y in res[k]):.4f} ms; tokens == default: "
                  f"{toks.get(k) == toks.get(1)}")


if __name__ == "__main__":
    main()
