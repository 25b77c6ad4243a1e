"""Stress the STEP_LOOP build (several greedy steps a launch) for its intermittent hang (docs/megakernel.md, "Several
decode steps in one launch": one launch in 24 gave up on an H100, 12-06). k3-small, B = 1, a 1024-token prompt.

Patterns, each counted (launches, failures) and reported as it goes:
  cycle  the failing one: prefill, one plain greedy step, then --launches K-step launches, sync, check; the slot
         released and prefilled again each cycle (one Engine). Every cycle's tokens (each launch's last) are the same
         prompt's, so they must equal the default build's (one cycle of single steps first).
  long   --long K-step launches, checked every 25; the prompt prefilled again whenever the sequence is full.
  gen    the pipelined Generator (K-step bursts), --gens runs of --tokens tokens.
A failure prints `ChainKernel.check`'s message (for STEP_LOOP: the step the launch was in, from the token word and
the tail count) and the pattern goes on after the reset. Usage: python scripts/mkloop_stress.py [--steps 8]
[--cycles 60] [--launches 12] [--long 600] [--gens 10] [--tokens 96] [--patterns cycle,long,gen]."""

from __future__ import annotations

import argparse
import collections
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--launches", type=int, default=12)
    ap.add_argument("--long", type=int, default=600)
    ap.add_argument("--gens", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--patterns", default="cycle,long,gen")
    a = ap.parse_args()
    from k3export.bench.fp8 import gpu_random_model
    from k3export.config import K3Config
    from k3export.megakernel import backend as mb
    from k3export.megakernel import chain as mc
    from k3export.runtime import EagerBackend, Engine, Generator
    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    model = gpu_random_model(K3Config.from_name("k3-small"), 0)
    V, K = model.config.vocab_size, a.steps
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1024,), generator=g).tolist()
    max_len = mc.ATTN_SPLITS * mc.ATTN_ROWS         # (the most rows the backend's attention takes)
    if 1024 + 2 + K * max(a.launches, -(-a.tokens // K) + 2) > max_len:
        raise SystemExit(f"--launches / --tokens: a sequence holds {max_len} rows, 1024 of them the prompt")
    pre = EagerBackend(model)
    be = mb.MegakernelBackend(model, max_len=max_len, prefill_backend=pre, steps_per_launch=K)
    print(f"build: {' '.join(be.kernel.defines)}", flush=True)
    counts = collections.Counter()

    def failed(pattern, where, e):
        counts[pattern + " failures"] += 1
        print(f"{pattern} {where}: FAILED {type(e).__name__}: {e}", flush=True)

    def start(eng):                             # prefill slot 0, then one plain greedy step
        if eng._host_active[0]:
            eng.release(0)
        first = int(eng.prefill([0], [prompt])[0].argmax())
        eng.decode_greedy(torch.tensor([first], device="cuda"))

    if "cycle" in a.patterns:
        ref = mb.MegakernelBackend(model, max_len=max_len, prefill_backend=pre)
        eng = Engine(ref, max_batch=1, max_len=max_len)
        start(eng)
        want = [int(eng._ids[0])]
        for i in range(a.launches * K):
            tok = int(eng.decode_greedy()[0])
            if i % K == K - 1:                      # (where each launch of K steps ends)
                want.append(tok)
        ref.check()
        del eng, ref
        eng = Engine(be, max_batch=1, max_len=max_len)
        t0 = time.perf_counter()
        seen = collections.Counter()
        for c in range(a.cycles):
            try:
                start(eng)
                got = [int(eng._ids[0])]
                outs = torch.empty(a.launches, dtype=torch.int64, device="cuda")
                for j in range(a.launches):             # (back to back, as in the failing run: no sync between)
                    eng.decode_greedy_steps(K)
                    outs[j:j + 1].copy_(eng._ids[:1])    # (the launch's last step's token)
                be.check()
                got += outs.tolist()
                counts["cycle launches"] += a.launches
                seen[got == want] += 1
                if got != want:
                    d = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
                    print(f"cycle {c}: tokens differ from the default build's from launch {d}: {got[d:d + 4]} "
                          f"vs {want[d:d + 4]}", flush=True)
            except Exception as e:                                      # noqa: BLE001
                failed("cycle", f"{c}", e)
                eng = Engine(be, max_batch=1, max_len=max_len)
        print(f"cycle: {a.cycles} cycles in {time.perf_counter() - t0:.1f} s; {counts['cycle launches']} launches "
              f"clean, {counts['cycle failures']} failed; tokens == default's: {seen[True]}, differ: {seen[False]}",
              flush=True)

    if "long" in a.patterns:
        eng = Engine(be, max_batch=1, max_len=max_len)
        t0 = time.perf_counter()
        try:
            start(eng)
            for i in range(a.long):
                if eng._host_lengths[0] + K >= max_len:     # (full: the prompt again, as a new sequence)
                    start(eng)
                eng.decode_greedy_steps(K)
                if i % 25 == 24 or i == a.long - 1:
                    be.check()
                    counts["long launches"] = i + 1
        except Exception as e:                                          # noqa: BLE001
            failed("long", f"launch <= {counts['long launches'] + 25}", e)
        print(f"long: {counts['long launches']} launches clean in {time.perf_counter() - t0:.1f} s, "
              f"{counts['long failures']} failed", flush=True)

    if "gen" in a.patterns:
        toks = collections.Counter()
        for r in range(a.gens):
            try:
                eng = Engine(be, max_batch=1, max_len=max_len)
                gen = Generator(eng, steps_per_launch=K)
                req = gen.submit(prompt, a.tokens)
                gen.run()
                be.check()
                counts["gen runs"] += 1
                toks[tuple(req.tokens)] += 1
            except Exception as e:                                      # noqa: BLE001
                failed("gen", f"{r}", e)
        print(f"gen: {counts['gen runs']} runs clean, {counts['gen failures']} failed; distinct token lists: "
              f"{len(toks)}", flush=True)
    print("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)


if __name__ == "__main__":
    main()
