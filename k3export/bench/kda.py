"""`k3export bench kda`: the KDA Triton kernels against fla-core and the eager PyTorch path (one H200 run).

Prefill (B=1, T, H, K = V = 128, bf16, lower-bound gate): ms and TFLOP/s for ours, fla-core's `chunk_kda`
(gate, L2 norm and beta sigmoid in its kernels, same inputs) and the eager reference op; a small sweep of the
chunk-pass launch configuration. Decode (one token, B = 1..256): GB/s of fp32 state traffic (read + write)
against the device copy bandwidth measured in the same run, ours vs fla's `fused_recurrent_kda` and eager.

FLOP count of chunked KDA, per chunk (C = 64) and head: A_kk, A_qk (lower halves) 2 C^2 K; W, U (triangular)
C^2 (K + V); W S, Q S, K^T Vn 6 C K V; A_qk Vn (lower half) C^2 V.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import time
from pathlib import Path

import click
import torch

from k3export.bench import bench, command_line, require_cuda
from k3export.bench.ceilings import bench_ms, copy_bandwidth, graph_ms, kernel_times   # median ms
from k3export.manifest import atomic_write
from k3export.plugins.kda.kernels import INTRA_CONFIGS


def _flops(B, T, H, K, V, C=64):
    NT = -(-T // C)
    return B * H * NT * (2 * C * C * K + C * C * (K + V) + 6 * C * K * V + C * C * V)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _try(fn):
    try:
        return fn()
    except Exception as e:  # a baseline that cannot run is reported, not fatal
        return f"{type(e).__name__}: {str(e)[:200]}"


def _fla_chunk(args):
    """fla-core 0.6.0's `chunk_kda` on our prefill inputs (same gate with its lower bound, q/k L2 norm, beta
    sigmoid, all inside its kernels) as a call without arguments."""
    from fla.ops.kda import chunk_kda
    q, k, v, f, b, A_log, dt_bias, S0 = args[:8]
    return lambda: chunk_kda(q, k, v, f, b, scale=q.shape[-1] ** -0.5, initial_state=S0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=True, lower_bound=args[9], A_log=A_log, dt_bias=dt_bias)


def bench_prefill(T: int, H: int, K: int = 128) -> dict:
    from k3export.plugins.kda import kernels
    from k3export.plugins.kda.op import kda_prefill

    args = _prefill_args(T, H, K)
    flop = _flops(1, T, H, K, K)
    res = {"shape": dict(B=1, T=T, H=H, K=K, V=K, dtype="bf16"), "gflop": flop / 1e9}

    o, S = kda_prefill(*args)
    o_ref, S_ref = kda_prefill._init_fn(*args)
    res["ours_vs_eager_rel_rms"] = {"o": _rel(o, o_ref), "state": _rel(S, S_ref)}
    ms = bench_ms(lambda: kda_prefill(*args))
    res["ours"] = {"ms": ms, "tflops": flop / ms / 1e9}
    print("prefill ours", res["ours"], res["ours_vs_eager_rel_rms"], flush=True)

    cfg = kernels.prefill_config(args[0].shape[-1], args[2].shape[-1])    # the intra launch alone
    res["ours_intra_only_ms"] = bench_ms(lambda: kernels.prefill_intra_fwd(*args[:5], args[5], args[6], args[8],
                                                                           args[9], cfg))

    sweep = []
    for cfg in (dict(BV=64, state_stages=2), dict(low_ab=False)):
        t = _try(lambda: bench_ms(lambda: kernels.kda_prefill_fwd(*args, config=cfg), rep=50))
        err = _try(lambda: _rel(kernels.kda_prefill_fwd(*args, config=cfg)[0], o_ref))
        sweep.append({**cfg, "ms": t, "o_rel_rms": err})     # a config is only usable if its error is too
        print("sweep", sweep[-1], flush=True)
    res["config_sweep"] = sweep

    def fla():
        call = _fla_chunk(args)
        with torch.inference_mode():
            o_f, S_f = call()
            ms_f = bench_ms(call)
        return {"ms": ms_f, "tflops": flop / ms_f / 1e9, "rel_rms_vs_eager": {"o": _rel(o_f, o_ref),
                                                                            "state": _rel(S_f, S_ref)}}
    res["fla_chunk_kda"] = _try(fla)
    print("fla", res["fla_chunk_kda"], flush=True)
    ms_e = bench_ms(lambda: kda_prefill._init_fn(*args), rep=20)
    res["eager"] = {"ms": ms_e, "tflops": flop / ms_e / 1e9}
    return res


def bench_decode(batches, H: int, K: int = 128, copy_gbs: float = 0.0) -> list[dict]:
    from k3export.plugins.kda import kernels
    from k3export.plugins.kda.op import kda_decode

    rows = []
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(B)
        r = lambda *s: torch.randn(*s, device="cuda", generator=g)
        C = 3 * H * K
        args = (r(B, C).bfloat16(), r(B, C, 3).bfloat16(), (r(C, 4) * 0.5).bfloat16(), r(B, H * K).bfloat16(),
                r(B, H).bfloat16(), r(B, H * K).bfloat16(), r(H) * 0.5, r(H * K), (r(K).abs() + 0.5).bfloat16(),
                r(B, H, K, K), -5.0, 1e-5)
        state_bytes = 2 * B * H * K * K * 4                         # fp32 state read + written
        row = {"B": B, "state_MB": state_bytes / 2 / 1e6}
        ms = bench_ms(lambda: kda_decode(*args))
        row["ours"] = {"ms": ms, "GBs": state_bytes / ms / 1e6, "frac_copy": state_bytes / ms / 1e6 / copy_gbs}
        for w in (8,):
            row[f"ours_warps{w}_ms"] = _try(lambda: bench_ms(lambda: kernels.kda_decode_fwd(
                *args, config={"num_warps": w})))

        def fla():
            from fla.ops.kda import fused_recurrent_kda
            qkv = args[0].view(B, 1, 3, H, K)
            q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
            f = args[3].view(B, 1, H, K)
            b = args[4].view(B, 1, H)
            call = lambda: fused_recurrent_kda(q, k, v, f, b, A_log=args[6], dt_bias=args[7], scale=K ** -0.5,
                                               initial_state=args[9], output_final_state=True,
                                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                               use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
            with torch.inference_mode():
                ms_f = bench_ms(call)
            return {"ms": ms_f, "GBs": state_bytes / ms_f / 1e6, "frac_copy": state_bytes / ms_f / 1e6 / copy_gbs}
        row["fla_fused_recurrent_kda"] = _try(fla)
        ms_e = bench_ms(lambda: kda_decode._init_fn(*args), rep=30)
        row["eager"] = {"ms": ms_e, "GBs": state_bytes / ms_e / 1e6}
        rows.append(row)
        print("decode", row, flush=True)
    return rows


def _markdown(res: dict) -> str:
    p = res["prefill"]
    fmt = lambda d: f"{d['ms']:.3f} ms, {d['tflops']:.1f} TFLOP/s" if isinstance(d, dict) else str(d)
    lines = [f"KDA kernels, {res['date']}, {res['device']}, torch {res['torch']}, triton {res['triton']}",
             f"command: `{res['command']}`", "",
             f"Prefill B=1 T={p['shape']['T']} H={p['shape']['H']} K=V=128 bf16 ({p['gflop']:.1f} GFLOP):", "",
             "| impl | time |", "|---|---|",
             f"| ours (Triton, 2 launches) | {fmt(p['ours'])} (intra launch alone {p['ours_intra_only_ms']:.3f} ms) |",
             f"| fla-core chunk_kda | {fmt(p['fla_chunk_kda'])} |", f"| eager reference | {fmt(p['eager'])} |", "",
             f"ours vs eager rel. RMS: o {p['ours_vs_eager_rel_rms']['o']:.2e}, state "
             f"{p['ours_vs_eager_rel_rms']['state']:.2e}", "",
             "config sweep: " + "; ".join(
                 f"{ {k: v for k, v in c.items() if k not in ('ms', 'o_rel_rms')} } {c['ms'] if isinstance(c['ms'], str) else round(c['ms'], 3)} ms (o rel. {c['o_rel_rms'] if isinstance(c['o_rel_rms'], str) else format(c['o_rel_rms'], '.1e')})"
                 for c in p["config_sweep"]), "",
             f"Decode H={res['decode_H']}, fp32 state read + write; copy bandwidth {res['copy_GBs']:.0f} GB/s:", "",
             "| B | state MB | ours ms | ours GB/s (of copy) | fla ms | fla GB/s (of copy) | eager ms |",
             "|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        fl = r["fla_fused_recurrent_kda"]
        fl_s = (f"{fl['ms']:.3f} | {fl['GBs']:.0f} ({fl['frac_copy']:.0%})" if isinstance(fl, dict)
                else f"{fl} | -")
        o = r["ours"]
        lines.append(f"| {r['B']} | {r['state_MB']:.0f} | {o['ms']:.3f} | {o['GBs']:.0f} ({o['frac_copy']:.0%}) | "
                     f"{fl_s} | {r['eager']['ms']:.3f} |")
    lines.append("")
    lines.append("decode warps sweep (ms): " + "; ".join(
        f"B={r['B']}: 8 warps {r['ours_warps8_ms']}" for r in res["decode"]))
    return "\n".join(lines) + "\n"


# --- `--sweep`: every kernel variant, checked and timed in one run ------------------------------------------------

# Bounds of tests/test_kda_kernels.py (named and explained there): a variant counts only if within them.
PREFILL_BOUND = {"o": 2e-2, "state": 2e-2}                # BF16_PREFILL_BOUND, BF16_STATE_BOUND
DECODE_BOUND = {"o": 1e-3, "state": 1e-5}                 # DECODE_O_BOUND[bf16], DECODE_STATE_BOUND

# Prefill sweep (kernels.prefill_config overrides): each intra launch timed alone and each state pass timed alone
# (on the default intra launch's intermediates), both checked end to end (with the default of the other launch);
# then the fastest of each that is within bounds, combined, end to end. Kernel variants tried on the H200 and
# dropped (sub-tiled / column-block intra kernels, fla's split state pass) are in docs/perf.md.
# Intra launches: kernels.INTRA_CONFIGS ("full": one launch, the AOT contract's; "split*": two launches, the first's
# warps "a4" (4; else 8), the second's "wu4" and register cap "r"; the default at K = V = 128 is split-a4-wu4r168).
# The same names select a variant for the op through env K3_KDA_INTRA (scripts/gpu_kda.sh runs the cuda tests with
# the fastest non-"full" one). Variants that lost on the H200 are in docs/perf.md and no longer swept.
INTRA_VARIANTS = dict(INTRA_CONFIGS)
# State pass: BV 32 in one stage gives wrong outputs on the H200; BV 64 in 2 stages (0.84 ms), BV 128 / 8 warps
# (0.85 ms; 2 stages 0.76 ms) and a next-chunk line prefetch (1.05 ms) lost to the default (0.70 ms) on 2026-11-30,
# and are no longer swept.
STATE_VARIANTS = {
    "BV64 s1": {},                                        # the default
}
PREFILL_VARIANTS = {**INTRA_VARIANTS, **STATE_VARIANTS}   # names are distinct


DECODE_VARIANTS = {                                       # name -> overrides of kernels.decode_config
    "4w": {},                                             # the default: maxnreg 168, 3 programs per SM
    "8w": dict(num_warps=8),
    "4w uncapped": dict(maxnreg=None),                    # 202 registers: 2 programs per SM
}


def _prefill_args(T: int, H: int, K: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    q, k, v, f = (r(1, T, H, K).bfloat16() for _ in range(4))
    b = r(1, T, H).bfloat16()
    A_log, dt_bias, S0 = r(H) * 0.5, r(H * K), r(1, H, K, K)
    return (q, k, v, f, b, A_log, dt_bias, S0, torch.tensor([T], device="cuda"), -5.0)


def _decode_args(B: int, H: int, K: int = 128):
    g = torch.Generator(device="cuda").manual_seed(B)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    C = 3 * H * K
    return (r(B, C).bfloat16(), r(B, C, 3).bfloat16(), (r(C, 4) * 0.5).bfloat16(), r(B, H * K).bfloat16(),
            r(B, H).bfloat16(), r(B, H * K).bfloat16(), r(H) * 0.5, r(H * K), (r(K).abs() + 0.5).bfloat16(),
            r(B, H, K, K), -5.0, 1e-5)


def _isolated_check(checked: Path | None, name: str):
    """None when `name` may run here: no check directory, or scripts/kda_warm.py's isolated check of it passed;
    else why not (an illegal memory access in one variant would end this process's CUDA context for all)."""
    if checked is None:
        return None
    f = checked / (re.sub(r"[^A-Za-z0-9]+", "_", name) + ".json")
    if not f.exists():
        return "not run: no isolated check result (faulted or timed out in scripts/kda_warm.py)"
    r = json.loads(f.read_text())
    return None if r.get("ok") else f"not run: isolated check out of bounds {r}"


def sweep_prefill(T: int, H: int, deadline: float, K: int = 128, checked: Path | None = None) -> dict:
    from k3export.plugins.kda import kernels
    from k3export.plugins.kda.op import kda_prefill

    args = _prefill_args(T, H, K)
    flop = _flops(1, T, H, K, K)
    o_ref, S_ref = kda_prefill._init_fn(*args)
    default = kernels.prefill_config(K, K)
    res = {"shape": dict(B=1, T=T, H=H, K=K, V=K, dtype="bf16"), "gflop": flop / 1e9, "default": default,
           "variants": {}, "intra_ms": {}, "state_ms": {}}
    q, k, v, f, b, A_log, dt_bias, S0, lengths, lb = args
    shape = (1, T, H, K, K)

    def check(cfg):
        o, S = kernels.kda_prefill_fwd(*args, config=cfg)
        err = {"o": _rel(o, o_ref), "state": _rel(S, S_ref)}
        return {**err, "ok": all(err[n] < PREFILL_BOUND[n] for n in err)}

    def whole(cfg):
        ms = bench_ms(lambda: kernels.kda_prefill_fwd(*args, config=cfg), rep=50)
        return {**check(cfg), "ms": ms, "tflops": flop / ms / 1e9}

    res["variants"]["default"] = _try(lambda: whole({}))
    print("prefill default", res["variants"]["default"], flush=True)
    def launch_alone(kind: str, variants: dict, run) -> None:
        """Time `run(cfg)` (one launch) per variant, each checked end to end; into res[f"{kind}_ms"]."""
        for name, over in variants.items():
            cfg = {**default, **over}
            why = None if cfg == default else _isolated_check(checked, name)   # the default ran above
            if time.monotonic() > deadline or why:
                res[f"{kind}_ms"][name] = why or "skipped (time)"
                continue
            res[f"{kind}_ms"][name] = _try(lambda: {"ms": bench_ms(lambda: run(cfg), rep=50), **check(cfg)})
            print(kind, name, res[f"{kind}_ms"][name], flush=True)

    launch_alone("intra", INTRA_VARIANTS,
                 lambda cfg: kernels.prefill_intra_fwd(q, k, v, f, b, A_log, dt_bias, lengths, lb, cfg))
    inter = kernels.prefill_intra_fwd(q, k, v, f, b, A_log, dt_bias, lengths, lb, default)
    launch_alone("state", STATE_VARIANTS,            # the state pass alone on the default intermediates
                 lambda cfg: kernels.prefill_state_fwd(inter, S0, lengths, shape, q.dtype, cfg))

    def best(table):
        good = {n: r for n, r in table.items() if isinstance(r, dict) and r["ok"]}
        return min(good, key=lambda n: good[n]["ms"]) if good else None
    bi, bs = best(res["intra_ms"]), best(res["state_ms"])
    res["best"] = {"intra": bi, "state": bs}
    if bi and bs and time.monotonic() < deadline + 30:
        cfg = {**INTRA_VARIANTS[bi], **STATE_VARIANTS[bs]}
        res["variants"][f"{bi} + {bs}"] = _try(lambda: whole(cfg))
        print("prefill best", bi, "+", bs, res["variants"][f"{bi} + {bs}"], flush=True)
    return res


def sweep_decode(batches, H: int, copy_gbs: float, deadline: float, K: int = 128) -> list[dict]:
    from k3export.plugins.kda import kernels
    from k3export.plugins.kda.op import kda_decode

    rows = []
    for B in batches:
        if time.monotonic() > deadline:
            rows.append({"B": B, "skipped": "time"})
            continue
        args = _decode_args(B, H, K)
        nbytes = 2 * B * H * K * K * 4                              # fp32 state read + written
        ref = kda_decode._init_fn(*args)
        row = {"B": B, "state_MB": nbytes / 2 / 1e6, "variants": {}, "fla_fused_recurrent_kda": "not run"}

        def one(cfg):
            out = kernels.kda_decode_fwd(*args, config=cfg)
            err = {"o": _rel(out[0], ref[0]), "state": _rel(out[2], ref[2]), "conv_exact": torch.equal(out[1], ref[1])}
            ok = err["conv_exact"] and err["o"] < DECODE_BOUND["o"] and err["state"] < DECODE_BOUND["state"]
            ms = graph_ms(lambda: kernels.kda_decode_fwd(*args, config=cfg))
            return {**err, "ok": ok, "graph_ms": ms, "GBs": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / copy_gbs}

        for name, cfg in DECODE_VARIANTS.items():
            row["variants"][name] = "skipped (time)" if time.monotonic() > deadline else _try(lambda: one(cfg))
        row["ours_op_ms"] = bench_ms(lambda: kda_decode(*args))
        rows.append(row)
        print("decode", row, flush=True)
    return rows


def kernel_us(call, reps: int = 5) -> dict:
    """Mean microseconds per call of each CUDA kernel `call` launches (torch.profiler, after warm-up)."""
    return {r["kernel"][:70]: round(r["us"], 1) for r in kernel_times(call, reps, warmup=3)}


def sweep_fla(res: dict, T: int, H: int, K: int = 128) -> None:
    """fla-core on the same inputs, last (its autotuning takes a minute or more on a fresh machine)."""
    from k3export.plugins.kda.op import kda_prefill
    p = res["prefill"]
    args = _prefill_args(T, H, K)

    def chunk():
        o_ref, S_ref = kda_prefill._init_fn(*args)
        call = _fla_chunk(args)
        with torch.inference_mode():
            o_f, S_f = call()
            ms = bench_ms(call, rep=50)
        return {"o": _rel(o_f, o_ref), "state": _rel(S_f, S_ref), "ms": ms, "tflops": p["gflop"] / ms}
    p["fla_chunk_kda"] = _try(chunk)
    print("fla chunk_kda", p["fla_chunk_kda"], flush=True)
    # Where each pipeline's time goes, per launch (fla's autotuning is done by now).
    from k3export.plugins.kda import kernels
    with torch.inference_mode():
        p["kernel_us"] = {"fla chunk_kda": _try(lambda: kernel_us(_fla_chunk(args)))}
    best = (p.get("best") or {}).get("intra")
    for name in dict.fromkeys(["split-a4-wu4r168"] + ([best] if best else [])):
        p["kernel_us"][f"ours {name}"] = _try(
            lambda: kernel_us(lambda: kernels.kda_prefill_fwd(*args, config=INTRA_VARIANTS[name])))
    print("kernel us", json.dumps(p["kernel_us"], indent=1), flush=True)
    for row in res["decode"]:
        if "skipped" in row:
            continue
        B = row["B"]
        a = _decode_args(B, H, K)
        nbytes = 2 * B * H * K * K * 4

        def rec():
            from fla.ops.kda import fused_recurrent_kda
            qkv = a[0].view(B, 1, 3, H, K)
            q_, k_, v_ = (qkv[:, :, i].contiguous() for i in range(3))
            call = lambda: fused_recurrent_kda(q_, k_, v_, a[3].view(B, 1, H, K), a[4].view(B, 1, H), A_log=a[6],
                                               dt_bias=a[7], scale=K ** -0.5, initial_state=a[9],
                                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                               lower_bound=-5.0)
            with torch.inference_mode():
                ms = bench_ms(call)
            return {"ms": ms, "GBs": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / res["copy_GBs"]}
        row["fla_fused_recurrent_kda"] = _try(rec)
        print("fla fused_recurrent B", B, row["fla_fused_recurrent_kda"], flush=True)


def _sweep_markdown(res: dict) -> str:
    p = res["prefill"]
    num = lambda x, f: format(x, f) if isinstance(x, float) else str(x)
    lines = [f"KDA variant sweep, {res['date']}, {res['device']}, torch {res['torch']}, triton {res['triton']}",
             f"command: `{res['command']}`; copy bandwidth {res['copy_GBs']:.0f} GB/s", "",
             f"Prefill B=1 T={p['shape']['T']} H={p['shape']['H']} K=V=128 bf16 ({p['gflop']:.1f} GFLOP), "
             f"rel. RMS vs eager, bounds o/state {PREFILL_BOUND['o']}/{PREFILL_BOUND['state']}:", "",
             "| variant | ms | TFLOP/s | o rel | state rel | within bounds |", "|---|---|---|---|---|---|"]
    for name, v in list(p["variants"].items()) + [("fla chunk_kda", p["fla_chunk_kda"])]:
        if isinstance(v, dict):
            lines.append(f"| {name} | {v['ms']:.3f} | {v['tflops']:.1f} | {v['o']:.2e} | {v['state']:.2e} | "
                         f"{v.get('ok', '-')} |")
        else:
            lines.append(f"| {name} | {v} | | | | |")
    for title, key in (("intra launch alone", "intra_ms"), ("state pass alone (default intra's intermediates)",
                                                              "state_ms")):
        lines += ["", f"{title}; errors end to end with the other launch's default:", "",
                  "| variant | ms | o rel | state rel | within bounds |", "|---|---|---|---|---|"]
        for name, v in p.get(key, {}).items():
            lines.append(f"| {name} | {v['ms']:.3f} | {v['o']:.2e} | {v['state']:.2e} | {v['ok']} |"
                         if isinstance(v, dict) else f"| {name} | {v} | | | |")
    lines += ["", f"fastest within bounds: {p.get('best')}", "",
              "Decode H=%d, fp32 state read + write, CUDA-graph replay times (ms, GB/s, fraction of copy):" % res["decode_H"],
              ""]
    names = list(DECODE_VARIANTS)
    lines += ["| B | " + " | ".join(names) + " | ours op (eager launch) | fla fused_recurrent (eager launch) |",
              "|---" * (len(names) + 3) + "|"]
    for r in res["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['B']} | skipped (time) |")
            continue
        cells = []
        for n in names:
            v = r["variants"][n]
            cells.append(f"{v['graph_ms']:.3f} {v['GBs']:.0f} ({v['frac_copy']:.0%}){'' if v['ok'] else ' WRONG'}"
                         if isinstance(v, dict) else str(v)[:40])
        fl = r["fla_fused_recurrent_kda"]
        fl_s = f"{fl['ms']:.3f} {fl['GBs']:.0f} ({fl['frac_copy']:.0%})" if isinstance(fl, dict) else str(fl)[:40]
        lines.append(f"| {r['B']} | " + " | ".join(cells) + f" | {num(r['ours_op_ms'], '.3f')} | {fl_s} |")
    return "\n".join(lines) + "\n"


def run_sweep(out: Path, T: int, H: int, batches, budget_s: float, res: dict,
              phases: tuple[str, ...] = ("prefill", "decode", "fla"), checked: Path | None = None) -> None:
    """Ours (prefill variants, then decode variants; each phase stops at its share of budget_s), then fla-core.
    JSON and markdown are rewritten after each phase, so a run cut short still leaves its results. `phases`
    picks a subset (e.g. decode alone: its kernels compile in seconds, fla's autotuning takes a minute)."""
    deadline = time.monotonic() + budget_s
    out.mkdir(parents=True, exist_ok=True)

    def save():
        atomic_write(out / "kda_sweep.json", json.dumps(res, indent=1, default=str))
        atomic_write(out / "kda_sweep.md", _sweep_markdown(res))
    res["decode_H"], res["decode"] = H, []
    if "prefill" in phases:
        res["prefill"] = sweep_prefill(T, H, deadline - (0.5 * budget_s if "decode" in phases else 0.),
                                       checked=checked)
    else:
        res["prefill"] = {"shape": dict(B=1, T=T, H=H), "gflop": _flops(1, T, H, 128, 128) / 1e9,
                          "variants": {}, "intra_only_ms": "not run"}
    res["prefill"]["fla_chunk_kda"] = "not run"
    save()
    if "decode" in phases:
        res["decode"] = sweep_decode(batches, H, res["copy_GBs"], deadline)
        save()
    click.echo(_sweep_markdown(res))
    if "fla" not in phases:
        return
    sweep_fla(res, T, H)
    save()
    click.echo(_sweep_markdown(res))

@bench.command("kda")
@click.option("--out", "out_dir", default="out/bench/kda", show_default=True, help="Directory for JSON + markdown.")
@click.option("--tokens", "T", default=8192, show_default=True, help="Prefill tokens (B=1).")
@click.option("--heads", "H", default=96, show_default=True, help="KDA heads (96 full width, 12 per TP-8 rank).")
@click.option("--batches", default="1,4,16,64,256", show_default=True, help="Decode batch sizes.")
@click.option("--sweep", is_flag=True, help="Check and time every kernel variant (PREFILL_/DECODE_VARIANTS) "
              "against the eager reference and fla-core instead of the default report.")
@click.option("--budget-s", default=100.0, show_default=True, help="--sweep: seconds before variants are skipped.")
@click.option("--phases", default="prefill,decode,fla", show_default=True,
              help="--sweep: which parts to run (any of prefill, decode, fla).")
@click.option("--checked", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="--sweep: time only the prefill variants whose isolated check (scripts/kda_warm.py) passed.")
def kda_bench(out_dir: str, T: int, H: int, batches: str, sweep: bool, budget_s: float, phases: str,
              checked: Path | None) -> None:
    """Prefill and decode KDA kernels vs fla-core and eager PyTorch (needs a CUDA GPU)."""
    require_cuda("kda")
    import triton
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
           "triton": triton.__version__, "command": command_line(click.get_current_context(), "k3export bench kda")}
    res["copy_GBs"] = copy_bandwidth() / 1e9
    click.echo(f"copy bandwidth {res['copy_GBs']:.0f} GB/s")
    if sweep:
        bad = set(phases.split(",")) - {"prefill", "decode", "fla"}
        if bad:
            raise click.BadParameter(f"unknown phases {sorted(bad)}; use prefill, decode, fla", param_hint="--phases")
        run_sweep(Path(out_dir), T, H, [int(x) for x in batches.split(",")], budget_s, res, tuple(phases.split(",")),
                  checked)
        return
    res["prefill"] = bench_prefill(T, H)
    click.echo(json.dumps(res["prefill"], indent=1))
    res["decode_H"] = H
    res["decode"] = bench_decode([int(x) for x in batches.split(",")], H, copy_gbs=res["copy_GBs"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "kda.json", json.dumps(res, indent=1))
    md = _markdown(res)
    atomic_write(out / "kda.md", md)
    click.echo(md)
