"""`k3export bench moe`: the routed LatentMoE kernel at K3 size (896 experts, top-16, 3584 -> 3072 -> 3584, bf16).

Decode (1..64 tokens) is memory-bound: the floor is the bytes of the distinct experts hit (3 * 3072 * 3584 * 2
each, 66 MB) plus the router weights, over the measured copy bandwidth. Prefill (4096..16384 tokens) is
matmul-bound: useful FLOPs = tokens * 16 * 6 * 3584 * 3072, against the measured bf16 matmul rate; every expert
is hit there, so all 59 GB of expert weights are read at least once (a second floor: 59 GB / copy bandwidth).

Each tiling in kernels.TILINGS is timed per token count (do_bench median, L2 flushed), its output compared with the
first (baseline) tiling on the same inputs (same routing kernel, so the same selection), and its stages timed
alone (route, align, gemm1 incl. any gather, gemm2, combine). Decode is also timed as a CUDA-graph replay
(what a deployed step pays; the plain call includes the host's launch overhead).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import click
import torch

from k3export.bench import bench, command_line, require_cuda
from k3export.bench.ceilings import (bench_ms, copy_bandwidth, fp8_matmul_rate, graph_ms, kernel_times, machine,
                                     matmul_rate)
from k3export.manifest import atomic_write, replacing

E, D, L, I, K = 896, 7168, 3584, 3072, 16
ARGS = dict(top_k=K, renormalize=True, scaling=1.0, beta=4.0, linear_beta=25.0)
# Two tilings' outputs on the same inputs and selection: each rounds h to bf16 once after fp32 sums in another
# order, ~1 bf16 ulp (measured <= 1.5e-3); the tests' bf16 bound vs moe_sorted is 2e-2.
ERR_VS_OLD_BOUND = 2e-2


def k3_weights():
    """Random K3-size routed experts in bf16 (59 GB) and a router."""
    g = torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    b = torch.zeros(E, device="cuda")
    w1 = torch.empty(E, I, L, device="cuda", dtype=torch.bfloat16).normal_(0, L ** -0.5)
    w3 = torch.empty(E, I, L, device="cuda", dtype=torch.bfloat16).normal_(0, L ** -0.5)
    w2 = torch.empty(E, L, I, device="cuda", dtype=torch.bfloat16).normal_(0, I ** -0.5)
    return g, b, w1, w3, w2


def _fmt(r):
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())


def _once_ms(fn, n=2):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def _rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def stage_ms(w, x, z, cfg) -> dict:
    """Each stage of moe_routed_fwd timed alone on its real inputs."""
    from k3export.plugins.moe import kernels as Km
    g, b, w1, w3, w2 = w
    ids, wt, _ = Km.route_fwd(x, g, b, K, True, 1.0, cfg.lean_route, wide=cfg.wide_route)
    plan = Km.tiling_plan(ids, E, cfg)
    h = Km.gemm1_fwd(z, w1, w3, plan, K, 4.0, 25.0, cfg)
    y = Km.gemm2_fwd(h, w2, plan, ids.numel(), cfg)
    r = {"route": bench_ms(lambda: Km.route_fwd(x, g, b, K, True, 1.0, cfg.lean_route, wide=cfg.wide_route)),
         "align": bench_ms(lambda: Km.tiling_plan(ids, E, cfg)),
         "gemm1": bench_ms(lambda: Km.gemm1_fwd(z, w1, w3, plan, K, 4.0, 25.0, cfg)),
         "gemm2": bench_ms(lambda: Km.gemm2_fwd(h, w2, plan, ids.numel(), cfg)),
         "combine": bench_ms(lambda: Km.combine_fwd(y, wt, z.dtype))}
    if cfg.tma == "aw":
        r["gather"] = bench_ms(lambda: Km.gather_fwd(z, plan, K, cfg.rows))
    r["blocks_used"] = int((plan[1] >= 0).sum())
    r["rows_useful"] = ids.numel() / (r["blocks_used"] * cfg.rows)   # rows issued to the MMA: all of each block
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}


def run_sweep(w, regime: str, tokens, ceiling: float, deadline: float, eager: bool, tiles=None,
              paired=None, separate: bool = True) -> list[dict]:
    """Every tiling of `regime` (or those named in tiles) at every token count: ms, the physics figure, error vs
    the baseline tiling (the first one run). paired: the same weights with gate/up rows interleaved
    (`interleave_gate_up`): every tiling is run on them too, as "<name>+paired" (only on them: separate False)."""
    from k3export.plugins.moe import kernels as Km
    from k3export.plugins.moe.naive import moe_sorted
    g, b, w1, w3, w2 = w
    layouts = ([("", w)] if separate or paired is None else []) + ([("+paired", paired)] if paired is not None else [])
    chosen = [(n, c) for n, c in Km.TILINGS[regime].items() if tiles is None or n in tiles]
    rows = []
    for N in tokens:
        torch.manual_seed(N)
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
        ids, _, _ = Km.route_fwd(x, g, b, K, True, 1.0)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * I * L * 2 + g.numel() * 2
        flops = N * K * 6 * L * I
        floors = {}
        if regime == "prefill":      # the two floors: useful FLOPs at the matmul rate, expert weights once at copy bw
            floors = {"flop_floor_ms": flops / ceiling * 1e3,
                      "weights_floor_ms": 3 * E * I * L * 2 / copy_bandwidth() * 1e3}
            floors["cap_frac_matmul"] = floors["flop_floor_ms"] / max(floors.values())
            print(_fmt({"regime": regime, "tokens": N, **floors}), flush=True)
        base = None
        default = {sfx: Km.tiles_for(z, N * K, E, paired=bool(sfx)) for sfx, _ in layouts}   # what the op runs
        for (name, cfg), (suffix, wl) in ((t, lay) for t in chosen for lay in layouts):
            name += suffix
            if time.monotonic() > deadline:
                rows.append({"regime": regime, "tokens": N, "tiles": name, "error": "skipped: time budget"})
                print(_fmt(rows[-1]), flush=True)
                continue
            r = {"regime": regime, "tokens": N, "tiles": name, **({"default": True} if cfg == default[suffix] else {})}
            try:
                fn = lambda: Km.moe_routed_fwd(x, z, *wl, tiles=cfg, **ARGS)  # noqa: E731
                u = fn()
                base = u if base is None else base
                r["err_vs_old"] = _rel(u, base)
                r["ms"] = bench_ms(fn, rep=400 if regime == "prefill" else 100)   # prefill: ~7..16 calls
                if regime == "decode":
                    r.update({"experts_hit": hit, "GB/s": nbytes / r["ms"] / 1e6, "frac_copy": nbytes / r["ms"] / 1e-3
                              / ceiling, "graph_ms": graph_ms(fn)})
                    r["graph_frac_copy"] = nbytes / r["graph_ms"] / 1e-3 / ceiling
                else:
                    r.update({"TFLOP/s": flops / r["ms"] / 1e9, "frac_matmul": flops / r["ms"] / 1e-3 / ceiling,
                              **floors})
                if (name == "old" or N == (8192 if regime == "prefill" else 1) or cfg.tail) and \
                        not N <= cfg.pairs:                        # the stages are the row plan's
                    r["stages_ms"] = stage_ms(wl, x, z, cfg)
            except Exception as e:                                  # a tiling that does not compile / fit
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(r)
            print(_fmt(r), flush=True)
        if eager:
            rows.append({"regime": regime, "tokens": N, "tiles": "eager moe_sorted",
                         "ms": _once_ms(lambda: moe_sorted(x, z, g, b, w1, w3, w2, **ARGS), n=1)})
            print(_fmt(rows[-1]), flush=True)
        x = z = base = None                                          # free before the next size
        torch.cuda.empty_cache()
    return rows


def fp8_bank(w):
    """The routed experts of `k3_weights` in E4M3 as `FP8ExpertBank` stores them (w13 `[E, 2I, L]`, w2 `[E, L, I]`,
    per-output-channel scales), quantized a few experts at a time (no bank-sized fp32 temporaries)."""
    from k3export.fp8 import FP8, quantize
    from k3export.fp8_moe import CHUNK, _expand, expert_weight_scales
    _, _, w1, w3, w2 = w
    s = expert_weight_scales(w1, w3, w2, True)
    w13q = torch.empty(E, 2 * I, L, dtype=FP8, device="cuda")
    w2q = torch.empty(E, L, I, dtype=FP8, device="cuda")
    for c in range(0, E, CHUNK):
        sl = slice(c, c + CHUNK)
        w13 = torch.cat([w1[sl], w3[sl]], dim=1)
        w13q[sl] = quantize(w13, _expand(s["w13_scale"][sl], w13))
        w2q[sl] = quantize(w2[sl], _expand(s["w2_scale"][sl], w2[sl]))
    return w13q, w2q, s["w13_scale"], s["w2_scale"]


def run_fp8_prefill(w, bank, tokens, rate: float, fp8_rate: float, deadline: float, tiles=None) -> list[dict]:
    """Every W8A8 tiling (`fp8_moe_kernels.FP8_PREFILL_TILINGS`, or those named in tiles) of `k3::moe_routed_fp8`'s
    CUDA path at every token count on the E4M3 bank: ms, useful FLOPs against the bf16 matmul rate (#5's yardstick)
    and the E4M3 one, the floors (expert bytes are half of bf16's), error vs the contract's reference
    (`moe_fp8_sorted`, on the tokens whose selection equals the torch router's) and vs the bf16 kernel on the
    unquantized weights (the quantization error). Static scales from this draw: s_z = amax(z) / 448, s_h = amax of
    the bf16 gemm1's h / 448."""
    from k3export.fp8 import scale_from_amax
    from k3export.fp8_moe import moe_fp8_sorted
    from k3export.fp8_moe_kernels import FP8_PREFILL_TILINGS, moe_fp8_grouped
    from k3export.plugins.moe import kernels as Km
    from k3export.plugins.moe.naive import route
    g, b, w1, w3, w2 = w
    w13q, w2q, s13, s2 = bank
    chosen = [(n, t) for n, t in FP8_PREFILL_TILINGS.items() if tiles is None or n in tiles]
    rows = []
    bw = copy_bandwidth()
    for N in tokens:
        torch.manual_seed(N)
        x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
        ids, _, _ = Km.route_fwd(x, g, b, K, True, 1.0)
        cfg = Km.tiles_for(z, N * K, E)
        plan = Km.tiling_plan(ids, E, cfg)
        hb = Km.gemm1_fwd(z, w1, w3, plan, K, 4.0, 25.0, cfg)
        zs, hs = scale_from_amax(z.abs().amax().float()), scale_from_amax(hb[plan[0] >= 0].abs().amax().float())
        hb = None
        args = (x, z, g, b, w13q, w2q, s13, s2, zs, hs, K, True, 1.0, 4.0, 25.0)
        ref = moe_fp8_sorted(*args)
        bf16 = Km.moe_routed_fwd(x, z, *w, **ARGS)
        same = (route(x, g, b, K, True, 1.0)[0].sort(-1).values == ids.sort(-1).values).all(-1)
        flops = N * K * 6 * L * I
        floors = {"flop_floor_ms": flops / fp8_rate * 1e3, "weights_floor_ms": 3 * E * I * L / bw * 1e3}
        floors["cap_frac_matmul"] = flops / rate * 1e3 / max(floors.values())      # in bf16-rate terms
        print(_fmt({"regime": "prefill-fp8", "tokens": N, "rows_same_selection": int(same.sum()), **floors}),
              flush=True)
        base = None
        for name, t in chosen:
            r = {"regime": "prefill-fp8", "tokens": N, "tiles": name}
            if time.monotonic() > deadline:
                rows.append({**r, "error": "skipped: time budget"})
                print(_fmt(rows[-1]), flush=True)
                continue
            try:
                fn = lambda: moe_fp8_grouped(*args, weight_only=False, tiles=t)  # noqa: E731
                u = fn()
                base = u if base is None else base
                r.update(err_vs_ref=_rel(u[same], ref[same]), err_vs_first=_rel(u, base), err_vs_bf16=_rel(u, bf16))
                r["ms"] = bench_ms(fn, rep=400)
                r.update({"TFLOP/s": flops / r["ms"] / 1e9, "frac_matmul": flops / r["ms"] / 1e-3 / rate,
                          "frac_fp8_matmul": flops / r["ms"] / 1e-3 / fp8_rate,
                          "weights_GB/s": 3 * E * I * L / r["ms"] / 1e6, **floors})
                if name == chosen[0][0] or N == tokens[0]:
                    r["kernels_us"] = {k["kernel"][:48]: round(k["us"], 1) for k in kernel_times(fn, reps=3, warmup=1)
                                       [:8]}
            except Exception as e:                                  # a tiling that does not compile / fit
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(r)
            print(_fmt(r), flush=True)
        x = z = base = ref = bf16 = args = None
        torch.cuda.empty_cache()
    return rows


def _subset(names, tilings):
    """The named tilings among these (None: no names given, i.e. all; an empty set: none of these named)."""
    return None if names is None else names & set(tilings)


@bench.command("moe")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/bench"), show_default=True)
@click.option("--quick", is_flag=True, help="fewer token counts")
@click.option("--budget-s", type=float, default=150.0, show_default=True,
              help="tilings not started within this many seconds are skipped (reported as such)")
@click.option("--phases", default="prefill,decode", show_default=True, help="which sweeps to run")
@click.option("--tiles", default="", help="comma-separated tiling names to run (default: every tiling of the phase)")
@click.option("--tokens", default="", help="comma-separated prefill token counts (default 8192,4096,16384)")
@click.option("--layout", type=click.Choice(["separate", "paired", "both"]), default="separate", show_default=True,
              help="prefill expert weights: w1 / w3 as two tensors, gate/up rows interleaved in one (the compile "
                   "backend's layout, `packing.pair_experts`; +39.5 GB of GPU memory), or each tiling on both")
@click.option("--precision", type=click.Choice(["bf16", "fp8", "both"]), default="bf16", show_default=True,
              help="prefill expert weights: bf16, E4M3 (W8A8 `k3::moe_routed_fp8`, every FP8 tiling; +29.6 GB of "
                   "GPU memory), or both sweeps")
def moe(out: Path, quick: bool, budget_s: float, phases: str, tiles: str, tokens: str, layout: str,
        precision: str) -> None:
    """Routed MoE: every tiling in the sweep at prefill 4096..16384 tokens (TFLOP/s vs the bf16 matmul rate)
    and decode 1..64 tokens (expert bytes vs copy bandwidth, plain call and CUDA-graph replay), each vs the
    previous default tiling and the eager loop (`moe_sorted`), with per-stage times. --precision fp8: the prefill
    sweep of the E4M3 experts' tilings (vs the contract's reference and the bf16 kernel)."""
    want = {ph.strip() for ph in phases.split(",") if ph.strip()}
    if want - {"prefill", "decode"}:
        raise click.BadParameter(f"unknown phase(s) {', '.join(sorted(want - {'prefill', 'decode'}))}; choose from "
                                 "prefill, decode")
    from k3export.fp8_moe_kernels import FP8_PREFILL_TILINGS
    from k3export.plugins.moe import kernels as Km
    names = {t.strip() for t in tiles.split(",") if t.strip()} or None
    known = list(Km.TILINGS["decode"]) if "decode" in want else []              # what each sweep asked for runs
    if "prefill" in want:
        known += list(Km.TILINGS["prefill"]) if precision != "fp8" else []
        known += [n for n in FP8_PREFILL_TILINGS if n not in known] if precision != "bf16" else []
    unknown = (names or set()) - set(known)
    if unknown:
        raise click.BadParameter(f"unknown tiling(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}",
                                 param_hint="--tiles")
    try:
        counts = tuple(int(t) for t in tokens.split(",") if t.strip()) or ((8192,) if quick else (8192, 4096, 16384))
    except ValueError:
        raise click.BadParameter(f"{tokens!r} is not a comma-separated list of token counts", param_hint="--tokens")
    if min(counts) < 1:
        raise click.BadParameter(f"token counts must be >= 1, got {tokens!r}", param_hint="--tokens")
    require_cuda("moe")
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"{machine()}; copy {bw / 1e12:.2f} TB/s; bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    w = k3_weights()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "command": command_line(click.get_current_context(), "k3export bench moe"),
           "copy_TBps": bw / 1e12, "matmul_TFLOPs": rate / 1e12}
    res["defaults"] = {k: repr(v) for k, v in Km.CONFIGS.items()}
    if precision != "bf16":
        from k3export.fp8_moe_kernels import FP8_PREFILL, FP8_PREFILL_MIN_L
        res["fp8_defaults"] = {f">= {r} rows per expert, L >= {FP8_PREFILL_MIN_L}": repr(t)
                               for r, t in FP8_PREFILL.items()}
    res["layout"] = layout
    if "prefill" in want and precision != "bf16" and _subset(names, FP8_PREFILL_TILINGS) != set():
        bank, fp8_rate = fp8_bank(w), fp8_matmul_rate()
        res["fp8_matmul_TFLOPs"] = fp8_rate / 1e12
        print(f"E4M3 experts: {sum(t.numel() for t in bank[:2]) / 1e9:.1f} GB; E4M3 matmul {fp8_rate / 1e12:.0f} "
              "TFLOP/s", flush=True)
        share = 0.5 if precision == "both" else (0.7 if "decode" in want else 1.0)
        res["prefill_fp8"] = run_fp8_prefill(w, bank, counts, rate, fp8_rate, t0 + share * budget_s,
                                             _subset(names, FP8_PREFILL_TILINGS))
        bank = None
        torch.cuda.empty_cache()
        atomic_write(out / "moe.json", json.dumps(res, indent=1))
    if "prefill" in want and precision != "fp8" and _subset(names, Km.TILINGS["prefill"]) != set():
        wp = None
        if layout != "separate":         # the same values, gate/up rows interleaved: one weight tile per gemm1 step
            wp = (w[0], w[1], *Km.interleave_gate_up(w[2], w[3])[1:], w[4])
        res["prefill"] = run_sweep(w, "prefill", counts, rate, t0 + (0.7 if "decode" in want else 1.0) * budget_s,
                                   True, _subset(names, Km.TILINGS["prefill"]), wp, layout != "paired")
        wp = None
        torch.cuda.empty_cache()
        atomic_write(out / "moe.json", json.dumps(res, indent=1))     # written per section: a cut run keeps some
    if "decode" in want:
        res["decode"] = run_sweep(w, "decode", (1, 64) if quick else (1, 2, 4, 16, 64), bw, t0 + budget_s, True,
                                  _subset(names, Km.TILINGS["decode"]) or None)
        atomic_write(out / "moe.json", json.dumps(res, indent=1))
    png = plot(res, out / "moe.png")
    print(f"wrote {out / 'moe.json'}" + (f", {png}" if png else ""))
    summary(res)


def plot(res: dict, path: Path, title: str | None = None) -> Path | None:
    """Prefill: % of the bf16 matmul rate against tokens, one line per tiling (bf16 solid, E4M3 experts dashed),
    with #5's 50% line and the bf16 weight-bytes cap where the rows carry it; decode (if run): % of copy bandwidth
    of the CUDA-graph replay against tokens per tiling, with the 70% line. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [sec for sec in ("prefill", "decode") if any("ms" in r for r in res.get(sec, []))
              or (sec == "prefill" and any("ms" in r for r in res.get("prefill_fp8", [])))]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    for ax, sec in zip(axes[0], panels):
        series = [(sec, "-", "")] + ([("prefill_fp8", "--", "E4M3 ")] if sec == "prefill" else [])
        fig_key = "frac_matmul" if sec == "prefill" else "graph_frac_copy"
        for key, style, prefix in series:
            rows = [r for r in res.get(key, []) if fig_key in r]
            for name in dict.fromkeys(r["tiles"] for r in rows):
                pts = sorted((r["tokens"], 100 * r[fig_key]) for r in rows if r["tiles"] == name)
                ax.plot(*zip(*pts), style, marker="o", label=prefix + name)
        if sec == "prefill":
            caps = sorted({(r["tokens"], 100 * min(1.0, r["cap_frac_matmul"])) for r in res.get("prefill", [])
                           if "cap_frac_matmul" in r})
            if caps:
                ax.plot(*zip(*caps), "k-", linewidth=3, alpha=0.25, label="bf16 cap: FLOPs or weight bytes")
            ax.axhline(50, color="k", linestyle=":", label="50% (#5's target)")
            ax.set_ylabel("% of the measured bf16 matmul rate (useful FLOPs)")
            ax.set_title("MoE prefill, K3 size (896 experts, top-16)")
        else:
            ax.axhline(70, color="k", linestyle=":", label="70% (#5's target)")
            ax.set_ylabel("% of copy bandwidth (expert bytes), CUDA-graph replay")
            ax.set_title("MoE decode, K3 size")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["tokens"] for k in ("prefill", "prefill_fp8", "decode") if k.startswith(sec)
                        for r in res.get(k, []) if fig_key in r})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(0, 100)
        ax.set_xlabel("tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    import textwrap
    fig.suptitle(textwrap.fill(title or f"{res['machine']}, copy {res['copy_TBps']:.2f} TB/s, bf16 matmul "
                               f"{res['matmul_TFLOPs']:.0f} TFLOP/s, {res['date']}", 90 * len(panels)), fontsize=8)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def summary(res: dict) -> None:
    """The short table last: ms (and % of the ceiling) per tiling and token count, stage ms where timed."""
    for sec, key, fig in (("prefill_fp8", "ms", "frac_matmul"), ("prefill", "ms", "frac_matmul"),
                          ("decode", "graph_ms", "graph_frac_copy")):
        for r in res.get(sec, []):
            if key in r:
                st = r.get("stages_ms", {})
                extra = "  ".join(f"{k} {v}" for k, v in st.items())
                print(f"{sec:7s} {r['tokens']:6d} {r['tiles']:18s} {r[key]:9.3f} ms {100 * r.get(fig, 0):5.1f}%"
                      f"  {extra}")
            elif "error" in r:
                print(f"{sec:7s} {r['tokens']:6d} {r['tiles']:18s} {r['error'][:90]}")
    for sec, err, what in (("prefill", "err_vs_old", "baseline"), ("prefill_fp8", "err_vs_ref", "moe_fp8_sorted")):
        best = {}            # fastest tiling per token count whose output agrees with the baseline / the reference
        for r in res.get(sec, []):
            if "ms" in r and r.get(err, 1.0) < ERR_VS_OLD_BOUND and r["ms"] < best.get(r["tokens"], (0, 1e9))[1]:
                best[r["tokens"]] = (r["tiles"], r["ms"], r["frac_matmul"])
        for n, (name, ms, frac) in sorted(best.items()):
            print(f"fastest {sec} tiling at {n} tokens: {name} ({ms:.2f} ms, {100 * frac:.1f}% of the bf16 matmul "
                  f"rate; err vs {what} < {ERR_VS_OLD_BOUND})")
        for r in res.get(sec, []):         # the tiling the op picks by itself, where it was among those timed
            if r.get("default") and "ms" in r:
                fast = best.get(r["tokens"], (r["tiles"], r["ms"]))[1]
                print(f"default {sec} tiling at {r['tokens']} tokens: {r['tiles']} ({r['ms']:.2f} ms, "
                      f"{r['ms'] / fast:.2f}x the fastest)")
