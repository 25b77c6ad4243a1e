"""Does programmatic dependent launch (PDL) survive CUDA-graph capture here, and what does it save per launch?
GPU only (sm_90+).

A CUDA graph of `--launches` dependent AttnRes add+norm launches at k3-small's decode shape (1 token, 4 sources,
d = 2048: ~3 us kernels, like most of a decode step's), captured with and without `plugins.launch.pdl(True)`;
prints the median replay time per launch for each, whether both give the same bits, and the lines of each graph's
DOT dump (cudaGraphDebugDotPrint, via torch's CUDAGraph.debug_dump) that mention programmatic edges.

    python3 scripts/pdl_probe.py [--launches 200] [--iters 50] [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import torch

from gemv_pack_probe import replay_ms      # scripts/ on sys.path


def capture(pdl_on: bool, x: dict, launches: int, dot: pathlib.Path | None):
    from k3export.plugins.attn_res.kernels import attn_res_add_norm_fwd
    from k3export.plugins.launch import pdl

    def chain():
        p, y = x["p0"], x["y0"]
        for _ in range(launches):
            p, y = attn_res_add_norm_fwd(x["bank"], p, y, x["nw"], x["pw"], 1e-5, x["ow"], 1e-5)
        return p, y

    with pdl(pdl_on):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()                                                   # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if dot is not None:
            graph.enable_debug_mode()
        with torch.cuda.graph(graph):
            out = chain()
    if dot is not None:
        graph.debug_dump(str(dot))
    return graph, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="directory for the two DOT dumps")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(), "torch", torch.__version__,
          "CUDA", torch.version.cuda)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf)
    x = dict(bank=r(1, 4, 2048), p0=r(1, 2048), y0=r(1, 2048, scale=0.1), nw=r(2048), pw=r(1, 2048, scale=0.05),
             ow=r(2048))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    res = {}
    for on in (False, True):
        dot = a.out / f"graph-pdl-{int(on)}.dot" if a.out else None
        graph, out = capture(on, x, a.launches, dot)
        ms = replay_ms(graph.replay, a.iters)
        res[on] = [t.clone() for t in out]
        med = statistics.median(ms)
        print(f"PDL {'on ' if on else 'off'}: replay {med:.3f} ms for {a.launches} launches = "
              f"{1e3 * med / a.launches:.2f} us per launch (p10 {sorted(ms)[len(ms) // 10]:.3f} ms)")
        if dot is not None and dot.exists():
            text = dot.read_text()
            hits = [ln.strip() for ln in text.splitlines() if "rogrammatic" in ln or "PROGRAMMATIC" in ln]
            print(f"  {dot}: {len(text.splitlines())} lines, {len(hits)} mention programmatic edges/attributes;"
                  f" first: {hits[:3]}")
    same = all(torch.equal(u, v) for u, v in zip(res[False], res[True]))
    print("same bits with and without PDL:", same)


if __name__ == "__main__":
    main()
