"""What does a grid-wide barrier inside one persistent kernel cost, against a kernel boundary under PDL? Planning
for #6 (k3-small decode at B = 1 is a chain of ~200 dependent launches; docs/perf.md "Where the B = 1 decode
step's time is not"). GPU only (sm_90+); not run yet.

Both variants do the same R rounds of dependent work on G programs: in round r each program reads the value its
neighbour wrote in round r - 1 and writes it plus one, so a round cannot start anywhere before the previous one
has ended everywhere. `chain`: one launch per round (`round_kernel`), captured in a CUDA graph with PDL (each
launch waits for its predecessor, then lets the next one launch), as the decode step's kernels run. `persistent`:
one launch (`persistent_kernel`) with a grid barrier between rounds (an arrive counter in global memory: a CTA
barrier, one release add per program, spinning on acquire reads of the counter; the last program to finish
puts the counter back to 0 for the next launch). G must not exceed what is co-resident (`--programs`, default
the SM count), or the barrier never opens. Both end with every value = R (checked).

    python3 scripts/barrier_probe.py [--rounds 200] [--programs 0 (= SMs)] [--warps 4] [--iters 50] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from gemv_pack_probe import replay_ms, write_json      # scripts/ on sys.path
from k3export.plugins.launch import pdl_wait


@triton.jit
def _step(buf, r, pid, G):
    """Round r of program pid: buf[(r + 1) % 2][pid] = buf[r % 2][(pid + 1) % G] + 1 (.cg: other SMs wrote it)."""
    v = tl.load(buf + (r % 2) * G + (pid + 1) % G, cache_modifier=".cg")
    tl.store(buf + ((r + 1) % 2) * G + pid, v + 1)


@triton.jit
def round_kernel(buf, r, G, PDL: tl.constexpr):
    pdl_wait(PDL)
    _step(buf, r, tl.program_id(0), G)


@triton.jit
def persistent_kernel(buf, bar, R, G):
    pid = tl.program_id(0)
    for r in range(R):
        _step(buf, r, pid, G)
        tl.debug_barrier()                                    # this program's stores issued by every thread
        tl.atomic_add(bar, 1, sem="release")                 # arrive
        target = (r + 1) * G
        seen = tl.atomic_add(bar, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(bar, 0, sem="acquire")
        tl.debug_barrier()
    # every program has passed the last barrier once the counter reaches (R + 1) G: the last one resets it
    if tl.atomic_add(bar, 1, sem="acq_rel") == (R + 1) * G - 1:
        tl.store(bar, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--programs", type=int, default=0, help="0: one per SM")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    G = a.programs or props.multi_processor_count
    R = a.rounds
    print(torch.cuda.get_device_name(), "SMs", props.multi_processor_count, "programs", G, "rounds", R)
    res = {"device": torch.cuda.get_device_name(), "programs": G, "rounds": R, "warps": a.warps}

    def fresh():
        return torch.zeros(2, G, device="cuda", dtype=torch.int32)

    def measure(name, run, buf, check):
        """Capture run() (after an eager call: compiles), replay once from zeros and check, then time replays."""
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        buf.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ok = bool((buf[R % 2] == R).all()) and check()
        ms = statistics.median(replay_ms(graph.replay, a.iters))
        res[name] = {"ms": ms, "us_per_round": 1e3 * ms / R, "correct": ok}
        print(f"{name:11s} {ms:.3f} ms = {1e3 * ms / R:.2f} us per round; values == R (and the counter at 0): {ok}")

    for pdl in (False, True):
        buf = fresh()

        def chain(buf=buf, pdl=pdl):
            for r in range(R):
                round_kernel[(G,)](buf, r, G, PDL=pdl, num_warps=a.warps, **({"launch_pdl": True} if pdl else {}))
        measure("chain-pdl" if pdl else "chain", chain, buf, lambda: True)

    buf, bar = fresh(), torch.zeros(1, device="cuda", dtype=torch.int32)
    measure("persistent", lambda: persistent_kernel[(G,)](buf, bar, R, G, num_warps=a.warps), buf,
            lambda: int(bar.item()) == 0)
    print(json.dumps(res, indent=1))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
