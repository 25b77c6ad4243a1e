"""Does loading the weights before the PDL wait hide a decode GEMV's launch and ramp? (k3-small, B = 1, bf16, GPU.)

The 52 GEMVs of one k3-small decode step (lm_head included), in step order (9 KDA layers: in, o; 3 MLA: in, q_b,
o; the dense MLP of layer 0; 11 MoE: in, out; lm_head), chained as a real step chains them: each reads its x from the previous
output (`y[i-1][:, :K_i]`). The chain is captured as one CUDA graph per variant and replayed after warm-up (CUDA
events, median of 50):

    cublas        torch.mm into the output buffers (the compile backend's GEMVs today)
    triton        `plugins.gemv` without PDL
    pdl-late      PDL, weights loaded after the wait: only the launch overlaps
    pdl           PDL, weights loaded before the wait, dependents signalled after it (the op's default)
    pdl-early     PDL, weights loaded before the wait, dependents signalled first (the chain may run ahead)

and, per variant, the chain is checked against an fp32 torch chain on the same inputs after every output buffer
was zeroed (a read of x before its producer finished would read zeros). Reports us per step, the bytes floor at
the copy bandwidth measured in the same run, and the relative error.

`--fp8`: the same chain with E4M3 weights (per-channel scales), weight-only as the FP8 decode path runs it:

    fp8-splitk    `fp8_kernels.fp8_linear_wo_fwd` (today's one-row FP8 path: split-K GEMV, sums in its launch)
    fp8-gemv      `plugins.gemv` with E4M3 weights, no PDL
    fp8-gemv-pdl  the same, weights and scales loaded before the PDL wait, early signal (`K3_FP8_GEMV=1`)

    python3 scripts/gemv_pdl_probe.py [--out probe.json] [--m 1] [--fp8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gemv_pack_probe import copy_bandwidth, replay_ms, write_json      # scripts/ on sys.path

SHAPES = {"kda_in": (8336, 2048), "kda_o": (2048, 2048), "mla_in": (3392, 2048), "mla_q_b": (3072, 768),
          "mla_o": (2048, 2048), "moe_in": (2560, 2048), "moe_out": (2048, 1792), "dense_in": (16384, 2048),
          "dense_out": (2048, 8192), "lm_head": (32768, 2048)}
VARIANTS = {"cublas": None, "triton": {}, "pdl-late": dict(PDL=True, PREFETCH=False, launch_pdl=True),
            "pdl": dict(PDL=True, launch_pdl=True), "pdl-early": dict(PDL=True, EARLY=True, launch_pdl=True)}
FP8_VARIANTS = {"fp8-splitk": None, "fp8-gemv": {}, "fp8-gemv-pdl": dict(PDL=True, EARLY=True, launch_pdl=True)}


def step_order() -> list[str]:
    names = []
    for layer in range(12):
        names += ["mla_in", "mla_q_b", "mla_o"] if layer % 4 == 3 else ["kda_in", "kda_o"]
        names += ["dense_in", "dense_out"] if layer == 0 else ["moe_in", "moe_out"]
    return names + ["lm_head"]


def main() -> None:
    from k3export.plugins.gemv.kernels import gemv_fwd
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--m", type=int, default=1, help="rows of x (decode batch)")
    ap.add_argument("--fp8", action="store_true", help="E4M3 weights, weight-only (the FP8 decode path)")
    a = ap.parse_args()
    copy_gbs = copy_bandwidth()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    names = step_order()
    ws = [(torch.randn(*SHAPES[n], device=dev, generator=g) * SHAPES[n][1] ** -0.5).to(dt) for n in names]
    scales = [None] * len(ws)
    if a.fp8:
        from k3export.fp8 import quantize
        scales = [(w.float().abs().amax(1) / 448).clamp_min(1e-12) for w in ws]
        ws = [quantize(w.float(), sc[:, None]) for w, sc in zip(ws, scales)]
    ys = [torch.empty(a.m, w.shape[0], device=dev, dtype=dt) for w in ws]
    x0 = torch.randn(a.m, 2048, device=dev, generator=g).to(dt)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    floor_us = nbytes / copy_gbs / 1e3
    ref = x0.float()
    for w, sc in zip(ws, scales):                    # the fp32 chain (the stored weights, fp32 activations)
        wf = w.float() if sc is None else w.float() * sc[:, None]
        ref = (ref[:, :w.shape[1]] @ wf.t())
    print(f"copy {copy_gbs:.0f} GB/s; {len(ws)} GEMVs, {nbytes / 1e6:.0f} MB, floor {floor_us:.0f} us per step; "
          f"M = {a.m}", flush=True)

    def chain(flags) -> list[torch.Tensor]:
        """The chained GEMVs; returns their outputs (ys, or the split-K kernel's own allocations: no copies)."""
        from k3export.fp8_kernels import fp8_linear_wo_fwd
        x, outs = x0, []
        for w, sc, y in zip(ws, scales, ys):
            xi = x[:, :w.shape[1]]
            if flags is None and sc is None:
                torch.mm(xi, w.t(), out=y)
            elif flags is None:
                y = fp8_linear_wo_fwd(xi, w, sc)
            else:
                gemv_fwd(xi, w, out=y, w_scale=sc, **flags)
            outs.append(y)
            x = y
        return outs

    rows = {}
    for name, flags in (FP8_VARIANTS if a.fp8 else VARIANTS).items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain(flags)                                 # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(flags)
        ms = replay_ms(graph.replay)
        for y in outs:
            y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = ((outs[-1].float() - ref).abs().max() / ref.abs().max()).item()
        us = statistics.median(ms) * 1e3
        q = statistics.quantiles(ms, n=10)
        rows[name] = dict(us=us, p10_us=q[0] * 1e3, p90_us=q[-1] * 1e3, per_gemv_us=us / len(ws),
                          floor_ratio=us / floor_us, rel_err=err)
        print(f"{name:10s} {us:7.1f} us per step (p10 {q[0] * 1e3:.1f}, p90 {q[-1] * 1e3:.1f}), "
              f"{us / len(ws):5.2f} us per GEMV, {us / floor_us:4.2f}x floor, chain vs fp32 {err:.1e}", flush=True)
        del graph, outs
    write_json(a.out, dict(copy_gbs=copy_gbs, m=a.m, fp8=a.fp8, gemvs=len(ws), mbytes=nbytes / 1e6,
                           floor_us=floor_us, variants=rows))


if __name__ == "__main__":
    main()
