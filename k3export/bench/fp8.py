"""`k3export bench fp8`: a whole model (k3-small by default) in FP8 against the same weights in bf16.

One run does: random bf16 weights on the GPU, calibration with the default recipe, the FP8 copy
(`quantize_model`), a selfcheck of the GPU paths against their references, then timings: one decode step at each
batch size (CUDA graph of `forward_decode`, `--context` cache rows per sequence) and a prefill of --prefill
tokens (eager). Each time sits beside the weight bytes the step reads (napkin: every non-expert weight once, the
expected number of distinct routed experts for B random tokens, the KDA state read and written, the MLA cache
rows) and the achieved GB/s against the copy bandwidth measured in the same run. The full-width K3 layer pair at
B = 1 in bf16 and FP8 comes right after the decode steps (--layer-pair), then the sweeps that set the weight-only
thresholds (--sweep): the k3-small expert op at N tokens (weight-only vs W8A8) and every FP8 linear shape of that
pair at M rows (bf16 `F.linear`, weight-only, W8A8 = quantize + `_scaled_mm`), all CUDA-graph replays; last the
prefill, the accuracy report (FP8 vs bf16, greedy over --report-tokens tokens) and its noise floor (bf16 vs
--noise-dtype).

--variants (with --no-model: the full-width work alone) times every named one-row linear launch
(`fp8_kernels.GEMV_TILINGS`) at the pair's linear shapes and every weight-only expert scheme
(`fp8_moe_kernels.EXPERT_WO_TILINGS`) at one token on the pair's FP8 bank, each checked against its reference,
then the FP8 pair with the fastest launch and scheme within VARIANT_BOUND (alone and together); --profile adds
per-kernel device times of the pair steps.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import time
from pathlib import Path

import click
import torch

from k3export.bench import bench, command_line, require_cuda
from k3export.manifest import atomic_write


@torch.no_grad()
def gpu_random_model(config, seed: int, dtype=torch.bfloat16):
    """A K3Model with `init_random_`'s distributions drawn on the GPU (fast; not bitwise the CPU-seeded
    weights of `random_model`): linear N(0, 1/fan_in), norms 1 + N(0, 0.1^2), AttnRes queries N(0, 0.5^2),
    conv taps N(0, 0.5^2), A_log = log U(1, 16), dt_bias N(0, 1), router bias N(0, 0.3^2), embedding N(0, 1)."""
    from k3export.model.k3 import K3Model
    from k3export.model.weights import param_dtype
    with torch.device("meta"):
        model = K3Model(config)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in list(model.named_parameters()):
        t = torch.empty(p.shape, dtype=param_dtype(name, dtype), device="cuda")
        leaf = name.rsplit(".", 2)
        if name.endswith("A_log"):
            t.uniform_(1, 16, generator=g).log_()
        elif name.endswith(("dt_bias", "embed_tokens.weight")):
            t.normal_(0, 1, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t.normal_(0, 0.3, generator=g)
        elif name.endswith("_res_proj.weight") or "conv1d" in name:
            t.normal_(0, 0.5, generator=g)
        elif "norm" in leaf[-2] or name.endswith("o_norm.weight"):
            t.normal_(1, 0.1, generator=g)
        else:
            t.normal_(0, p.shape[-1] ** -0.5, generator=g)
        mod_name, _, attr = name.rpartition(".")
        model.get_submodule(mod_name)._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    return model.eval()


def step_bytes(model, B: int, context: int) -> int:
    """Napkin bytes one decode step reads (and writes, for the KDA state)."""
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_token
    distinct = E * (1 - (1 - k / E) ** B)
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        nb = t.numel() * t.element_size()
        if "embed_tokens" in name:
            total += B * t.shape[-1] * t.element_size()
        elif ".experts." in name:
            total += nb / E * distinct
        else:
            total += nb
    lac = cfg.linear_attn_config
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    total += B * n_kda * (2 * lac.num_heads * lac.head_dim ** 2 * 4 + 2 * 3 * cfg.kda_dim * 3 * 2)
    total += B * n_mla * context * cfg.latent_dim * 2
    return int(total)


def decode_ms(model, B: int, context: int, compiled: bool = False) -> tuple[float, str]:
    """Median ms of one decode step for B sequences holding `context` tokens: a CUDA graph replay when capture
    works, else eager. compiled: the step as the `compile` backend serves it (its serving swaps in place on the
    model: packed projections, fused norms and adds; torch.compile of the in-place decode step; then the graph).
    Before 2026-11-30 08:30 this timed `forward_decode` with the projections packed only."""
    if compiled:
        from k3export.model.packing import unpack_projections
        from k3export.runtime import CompileBackend
        backend = CompileBackend(model)
        try:
            return _decode_ms(model, B, context, getattr(backend, "decode_", backend.decode))
        finally:      # swapped for the timing only: the accuracy report and the noise floor's deep copy that
            unpack_projections(model)       # follow see the model as written
    return _decode_ms(model, B, context, model.forward_decode)


def _decode_ms(model, B: int, context: int, step) -> tuple[float, str]:
    from k3export.bench.ceilings import bench_ms
    st = model.new_state(B, context + 8)
    st.lengths.fill_(context)
    st.mla_cache.normal_()
    ids = torch.randint(0, model.config.vocab_size, (B,), device="cuda")
    args = (ids, st.kda_conv, st.kda_state, st.mla_cache, st.lengths)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(*args)
    torch.cuda.current_stream().wait_stream(s)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(*args)
        return bench_ms(graph.replay, rep=50), "graph"
    except Exception as e:                                                      # noqa: BLE001
        print(f"  (B={B}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing eager)")
        torch.cuda.synchronize()
        return bench_ms(lambda: step(*args), rep=50), "eager"


def prefill_ms(model, T: int, compiled: bool = False) -> float:
    """Median ms of a T-token prefill of one sequence: eager `forward_prefill`, or (compiled) a prompt into an
    `Engine` slot through the `compile` backend, as `bench model` times prefill (its serving swaps in place for the
    timing, undone after, as `decode_ms`)."""
    from k3export.bench.ceilings import bench_ms
    ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
    st = model.new_state(1, T)
    lengths = torch.full((1,), T, device="cuda")
    args = (ids, lengths, st.kda_conv, st.kda_state, st.mla_cache[:, :, :0], st.lengths)
    if not compiled:
        model.forward_prefill(*args)
        return bench_ms(lambda: model.forward_prefill(*args), rep=300)
    from k3export.model.packing import unpack_projections
    from k3export.runtime import CompileBackend, Engine
    backend = CompileBackend(model)
    try:
        eng = Engine(backend, max_batch=1, max_len=T + 1)
        prompt = ids[0].tolist()
        return bench_ms(lambda: (eng.prefill([0], [prompt]), eng.release(0)), rep=300)
    finally:
        unpack_projections(model)


def selfcheck(ref, fp8) -> dict:
    """The GPU paths against their references on this model's own tensors (relative errors)."""
    from k3export.fp8 import WEIGHT_ONLY_M, fp8_linear_ref, fp8_linear_wo_ref
    from k3export.fp8_moe import moe_fp8_sorted, moe_fp8_wo_ref
    from k3export.fp8_moe_kernels import use_weight_only
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())    # noqa: E731
    out = {}
    lin = fp8.model.layers[0].self_attn.q_proj
    for M in (1, 8, 128):                   # weight-only (GEMV, tl.dot), then W8A8 (Triton quantize + _scaled_mm)
        x = torch.randn(M, lin.in_features, device=ref.device, dtype=ref.dtype)
        args = (x, lin.input_scale, lin.qweight, lin.weight_scale)
        wo = M <= WEIGHT_ONLY_M
        want = fp8_linear_wo_ref(x.float(), *args[2:]) if wo else fp8_linear_ref(x.float(), *args[1:])
        out[f"fp8_linear_M{M}_{'wo' if wo else 'w8a8'}"] = rel(torch.ops.k3.fp8_linear(*args), want)
    moe = fp8.model.layers[1].block_sparse_moe
    e = moe.experts
    for N in (1, 64):
        x = torch.randn(N, ref.config.hidden_size, device=ref.device, dtype=ref.dtype)
        z = moe.routed_expert_down_proj(x)
        args = (x, z, moe.gate.weight, moe.gate.e_score_correction_bias, e.w13, e.w2, e.w13_scale, e.w2_scale,
                e.w13_input_scale, e.w2_input_scale, *moe.routing.values())
        wo = use_weight_only(N * moe.routing["top_k"], e.w13.shape[0])
        want = moe_fp8_wo_ref(*args[:8], *args[10:]) if wo else moe_fp8_sorted(*args)
        out[f"moe_fp8_N{N}_{'wo' if wo else 'w8a8'}"] = rel(torch.ops.k3.moe_routed_fp8(*args), want)
    return out


def _graph_us(fn, rep: int = 20) -> float:
    """Median microseconds of fn as a CUDA-graph replay (eager when capture fails), L2 flushed."""
    from k3export.bench.ceilings import bench_ms
    from k3export.bench.layer import _graphed
    replay = _graphed(fn)
    return bench_ms(replay or fn, rep=rep) * 1e3


def expert_sweep(fp8, tokens=(1, 8, 32, 64)) -> list[dict]:
    """k3-small layer 1's FP8 expert op at N tokens, weight-only vs W8A8 (routing and combine included)."""
    from k3export.fp8_moe_kernels import moe_fp8_grouped, use_weight_only
    moe = fp8.model.layers[1].block_sparse_moe
    e = moe.experts
    rows = []
    for N in tokens:
        x = torch.randn(N, fp8.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        args = (x, moe.routed_expert_down_proj(x), moe.gate.weight, moe.gate.e_score_correction_bias, e.w13, e.w2,
                e.w13_scale, e.w2_scale, e.w13_input_scale, e.w2_input_scale, *moe.routing.values())
        r = {"N": N, "default": "wo" if use_weight_only(N * moe.routing["top_k"], e.w13.shape[0]) else "w8a8"}
        for tag, wo in (("wo", True), ("w8a8", False)):
            r[f"{tag}_us"] = _graph_us(lambda: moe_fp8_grouped(*args, weight_only=wo))       # noqa: B023
        rows.append(r)
    return rows


def pair_linear_shapes(recipe) -> list[tuple[int, int]]:
    """(N, K) of every linear the recipe quantizes in the full-width layer pair (built on the meta device)."""
    import fnmatch

    from k3export.config import K3Config
    from k3export.model.k3 import DecoderLayer
    strip = lambda p: p.split("model.layers.*.", 1)[-1]                               # noqa: E731
    pats, keep = [strip(p) for p in recipe.quantize], [strip(p) for p in recipe.keep]
    shapes = []
    with torch.device("meta"):
        for i in (3, 1):                                                            # MLA, KDA
            for n, m in DecoderLayer(K3Config(), i).named_modules():
                if isinstance(m, torch.nn.Linear) and any(fnmatch.fnmatchcase(n, p) for p in pats) \
                        and not any(fnmatch.fnmatchcase(n, k) for k in keep):
                    shapes.append(tuple(m.weight.shape))
    return sorted(set(shapes))


def linear_sweep(shapes, rows_m=(1, 4, 16, 32, 64)) -> list[dict]:
    """Each (N, K) at M rows: bf16 `F.linear`, weight-only (`fp8_linear_wo_fwd`; at M = 1 also its tl.dot path)
    and W8A8 (`fp8_linear_scaled_mm`), microseconds of CUDA-graph replays, L2 flushed."""
    from k3export.fp8 import fp8_linear_scaled_mm, quantize, scale_from_amax, weight_amax
    from k3export.fp8_kernels import MAX_M, fp8_linear_wo_fwd
    rows = []
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        ws = scale_from_amax(weight_amax(w, True))
        wq = quantize(w, ws[:, None])
        for M in rows_m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xs = scale_from_amax(x.float().abs().amax())
            fns = {"bf16": lambda: torch.nn.functional.linear(x, w),                                # noqa: B023
                   "w8a8": lambda: fp8_linear_scaled_mm(x, xs, wq, ws)}                             # noqa: B023
            if M <= MAX_M:
                fns["wo"] = lambda: fp8_linear_wo_fwd(x, wq, ws)                                    # noqa: B023
            if M == 1:
                fns["wo_dot"] = lambda: fp8_linear_wo_fwd(x, wq, ws, gemv=False)                    # noqa: B023
            r = {"N": N, "K": K, "M": M, **{f"{k}_us": _graph_us(fn) for k, fn in fns.items()}}
            r["wo_GBps"] = N * K / r["wo_us"] / 1e3 if "wo_us" in r else None
            rows.append(r)
    return rows


def _print_linear_sweep(rows, bw):
    for r in rows:
        extra = f", wo tl.dot {r['wo_dot_us']:.1f}" if "wo_dot_us" in r else ""
        click.echo(f"  {r['N']:5d} x {r['K']:5d} M={r['M']:2d}: bf16 {r['bf16_us']:7.1f} us, weight-only "
                   f"{r.get('wo_us', float('nan')):7.1f} us ({r['wo_GBps'] or 0:5.0f} GB/s, "
                   f"{(r['wo_GBps'] or 0) * 1e9 / bw:4.0%} of copy){extra}, W8A8 {r['w8a8_us']:7.1f} us")
    for M in sorted({r["M"] for r in rows}):
        tot = {k: sum(r.get(f"{k}_us", float("nan")) for r in rows if r["M"] == M) for k in ("bf16", "wo", "w8a8")}
        click.echo(f"  sum over the pair's linear shapes, M={M:2d}: bf16 {tot['bf16']:.1f} us, weight-only "
                   f"{tot['wo']:.1f} us, W8A8 {tot['w8a8']:.1f} us")


# Error bound a variant must meet to be picked: the `cuda` tests' bound for a bf16 output against the fp32
# reference (tests/test_fp8.py BF16_OUT_BOUND: one bf16 rounding plus fp32 summation order).
VARIANT_BOUND = 4e-3


def _graph_us_each(fns, rep: int = 20) -> float:
    """Median microseconds per call of the calls fns, captured back to back in one CUDA graph (the graph launch
    shared by all; each call reads its own tensors, so nothing repeats through L2), L2 flushed before each replay."""
    from k3export.bench.ceilings import bench_ms
    from k3export.bench.layer import _graphed
    run = lambda: [f() for f in fns]                                                      # noqa: E731
    replay = _graphed(run)
    return bench_ms(replay or run, rep=rep) * 1e3 / len(fns)


@functools.lru_cache(maxsize=None)
def _stream_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_kernel(w, out, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[n] = sum of the bytes of row n as integers: the byte kernel's tiles and K loop, nothing widened
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.int32)
        for k0 in range(0, K, BLOCK_K):
            ok = (offs_n[:, None] < N) & ((k0 + offs_k) < K)[None, :]
            acc += tl.load(w + offs_n[:, None].to(tl.int64) * K + k0 + offs_k[None, :], mask=ok, other=0).to(tl.int32)
        tl.store(out + offs_n, tl.sum(acc, 1), mask=offs_n < N)
    return stream_kernel


def _stream_us(copies, block_n: int, block_k: int, warps: int) -> float:
    """The byte kernel's access pattern alone (`[block_n, block_k]` E4M3 tiles, one whole K loop per CTA, bytes
    summed as integers, nothing widened): a load ceiling for that tiling, us per weight."""
    import triton
    kernel = _stream_kernel()
    N, K = copies[0].shape
    out = torch.empty(N, dtype=torch.int32, device=copies[0].device)
    return _graph_us_each([lambda c=c: kernel[(triton.cdiv(N, block_n),)](c, out, N, K, BLOCK_N=block_n,
                                                                           BLOCK_K=block_k, num_warps=warps)
                           for c in [t.view(torch.uint8) for t in copies]])


def gemv_variants(shapes, names=None, copies: int = 6) -> list[dict]:
    """Every named one-row launch (`fp8_kernels.GEMV_TILINGS`) at each (N, K): relative error against
    `fp8_linear_wo_ref` (fresh random x and weights per shape), then microseconds per GEMM over `copies` weight
    copies back to back in one graph; beside it bf16 `F.linear` over bf16 copies and the byte load ceiling."""
    from k3export.fp8 import fp8_linear_wo_ref, quantize, scale_from_amax, weight_amax
    from k3export.fp8_kernels import GEMV_TILINGS, fp8_linear_wo_fwd
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())    # noqa: E731
    names = names or list(GEMV_TILINGS)
    rows = []
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        ws = scale_from_amax(weight_amax(w, True))
        wqs = [quantize(w, ws[:, None])] + [None] * (copies - 1)
        wqs[1:] = [wqs[0].clone() for _ in range(copies - 1)]
        wbs = [w] + [w.clone() for _ in range(copies - 1)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ref = fp8_linear_wo_ref(x.float(), wqs[0], ws)
        r = {"N": N, "K": K, "MB_fp8": N * K / 1e6,
             "bf16_us": _graph_us_each([lambda b=b: torch.nn.functional.linear(x, b) for b in wbs]),
             "stream_n16k512_us": _stream_us(wqs, 16, 512, 4), "err": {}, "us": {}}
        del wbs
        for name in names:
            t = GEMV_TILINGS[name]
            try:
                r["err"][name] = rel(fp8_linear_wo_fwd(x, wqs[0], ws, tiles=t), ref)
                r["us"][name] = _graph_us_each([lambda q=q, t=t: fp8_linear_wo_fwd(x, q, ws, tiles=t) for q in wqs])
            except Exception as e:                                                # noqa: BLE001 (reported)
                r["err"][name] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(r)
        best = min(r["us"], key=r["us"].get) if r["us"] else None
        click.echo(f"  {N:5d} x {K:5d}: bf16 {r['bf16_us']:.1f} us, byte-load ceiling {r['stream_n16k512_us']:.1f}"
                   f", " + ", ".join(f"{n} {u:.1f}" for n, u in r["us"].items()) + f"; best {best}")
        del wqs, w
        torch.cuda.empty_cache()
    return rows


def best_variant(rows, bound: float) -> tuple[str | None, dict]:
    """The name with the least summed time over rows among those whose every error is a number below bound."""
    names = set.intersection(*(set(r["us"]) for r in rows)) if rows else set()
    ok = [n for n in names if all(isinstance(r["err"].get(n), float) and r["err"][n] < bound for r in rows)]
    tot = {n: sum(r["us"][n] for r in rows) for n in ok}
    return (min(tot, key=tot.get) if tot else None), tot


def layer_pair_fn(recipe, cache_len: int = 4096, variants: dict | None = None, profile: bool = False,
                  extra: dict | None = None, save=None) -> list[dict]:
    """Full-width K3 layer pair (`bench layer`'s MLA + MoE and KDA + MoE, one shared 896-expert bank), one decode
    step at B = 1 in bf16, then the same layers quantized by `recipe` (scales from one observed step).
    variants {"gemv": name or None}: also the expert schemes at one token on this bank (`expert_variants`) and the
    FP8 pair under each combination of default / best linear launch and expert scheme; profile: per-kernel device
    time of one step (torch profiler over graph replays). Those results go into extra (rows as "layer_pair" as
    they come, then save() when given)."""
    import fnmatch

    from k3export.bench.ceilings import bench_ms
    from k3export.bench.layer import _graphed, build_pair, decode_step
    from k3export.calibrate import AmaxObserver, _observe_experts, _scales
    from k3export.fp8 import quantize_model
    from k3export.model.moe import ExpertBank
    cfg, mla, kda, inputs = build_pair(cache_len)
    holder = torch.nn.ModuleDict({"mla": mla, "kda": kda})

    def step_bytes_layer(layer):
        moe = layer.block_sparse_moe
        ex = {id(t) for t in [*moe.experts.parameters(), *moe.experts.buffers()]}
        tensors = [*layer.parameters(), *layer.buffers()]
        total = sum(t.numel() * t.element_size() for t in tensors if id(t) not in ex)
        total += cfg.num_experts_per_token * sum(t[0].numel() * t.element_size() for t in
                                                 [*moe.experts.parameters(), *moe.experts.buffers()] if t.dim() > 1)
        return total

    def timings(tag, prof=False):
        rows = []
        for name, layer in (("MLA+MoE", mla), ("KDA+MoE", kda)):
            replay = _graphed(lambda: decode_step(cfg, layer, inputs))
            ms = bench_ms(replay) if replay else bench_ms(lambda: decode_step(cfg, layer, inputs))
            nb = step_bytes_layer(layer)
            rows.append({"pair": name, "precision": tag, "ms": ms, "GB": nb / 1e9, "GBps": nb / ms / 1e6,
                         "graph": replay is not None})
            if prof and replay is not None and extra is not None:
                extra.setdefault("profile", {})[f"{name} {tag}"] = kernel_profile(replay)
        return rows

    def calibrate_pair():
        strip = lambda p: p.split("model.layers.*.", 1)[-1]                       # noqa: E731
        pats, keep = [strip(p) for p in recipe.quantize], [strip(p) for p in recipe.keep]
        mods = dict(holder.named_modules())                  # the shared MoE appears once, under mla
        targets, obs, hooks = {}, {}, []
        for n, m in mods.items():
            rest = n.split(".", 1)[-1]
            if isinstance(m, (torch.nn.Linear, ExpertBank)) and any(fnmatch.fnmatchcase(rest, p) for p in pats) \
                    and not any(fnmatch.fnmatchcase(rest, k) for k in keep):
                targets[n] = "experts" if isinstance(m, ExpertBank) else "linear"
        for n, kind in targets.items():
            if kind == "linear":
                obs[n] = AmaxObserver(n, recipe.method, recipe.percentile)
                hooks.append(mods[n].register_forward_pre_hook(obs[n].hook))
            else:
                z, h = (obs.setdefault(f"{n}.{p}", AmaxObserver(n, recipe.method, recipe.percentile))
                        for p in ("w13_input", "w2_input"))
                hooks += _observe_experts(mods[n.rsplit(".", 1)[0]], z, h)
        decode_step(cfg, mla, inputs)
        decode_step(cfg, kda, inputs)
        for hk in hooks:
            hk.remove()
        return _scales(holder, recipe, targets, obs)

    def keep(new_rows):
        rows.extend(new_rows)
        if extra is not None:
            extra["layer_pair"] = rows
            if save:
                save()

    rows = []
    with torch.inference_mode():
        keep(timings("bf16", profile))
        if variants is not None:
            extra["bf16_experts_us"] = bf16_expert_us(mla.block_sparse_moe, cfg)
            click.echo(f"  bf16 expert op, 1 token (k3::moe_routed default): {extra['bf16_experts_us']:.1f} us")
        scales = calibrate_pair()
        quantize_model(holder, scales)
        torch.cuda.empty_cache()
        keep(timings("fp8", profile))
        for r in rows:
            click.echo(f"  {r['pair']} {r['precision']}: {r['ms']:.3f} ms")
        if variants is not None:
            try:
                pair_variants(variants.get("gemv"), extra, mla, cfg, timings, keep, profile)
            except Exception as e:                                                # noqa: BLE001 (reported)
                click.echo(f"pair variants failed: {type(e).__name__}: {str(e)[:300]}")
    return rows


def pair_variants(best_g, extra, mla, cfg, timings, keep, profile):
    """The expert schemes at one token on the FP8 bank, then the FP8 pair with the best linear launch (best_g),
    the best expert scheme, and both (module defaults swapped for the timing, then restored)."""
    import k3export.fp8_kernels as FK
    import k3export.fp8_moe_kernels as FM
    extra["expert_variants"] = expert_variants(mla.block_sparse_moe, cfg)
    best_e, _ = best_variant(extra["expert_variants"], VARIANT_BOUND)
    extra["best_experts"] = best_e
    gemv0, experts0 = FK.GEMV, FM.EXPERT_WO
    combos = {"linear": (best_g, None), "experts": (None, best_e), "both": (best_g, best_e)}
    for tag, (g, e) in combos.items():
        if (g is None and e is None) or (tag == "both" and (g is None or e is None)):
            continue
        FK.GEMV = FK.GEMV_TILINGS[g] if g else gemv0
        FM.EXPERT_WO = FM.EXPERT_WO_TILINGS[e] if e else experts0
        try:
            new = timings(f"fp8 [{tag}: gemv {g or 'default'}, experts {e or 'default'}]", profile and tag == "both")
        finally:
            FK.GEMV, FM.EXPERT_WO = gemv0, experts0
        keep(new)
        for r in new:
            click.echo(f"  {r['pair']} {r['precision']}: {r['ms']:.3f} ms")


def bf16_expert_us(moe, cfg, copies: int = 4) -> float:
    """`k3::moe_routed` (the bf16 default) at one token on this bank, us per call (copies tokens back to back)."""
    xs = [torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    args = [moe.routed_args(x, moe.routed_expert_down_proj(x)) for x in xs]
    return _graph_us_each([lambda a=a: torch.ops.k3.moe_routed(*a, **moe.routing) for a in args])


def expert_variants(moe, cfg, copies: int = 4) -> list[dict]:
    """Every weight-only expert scheme (`fp8_moe_kernels.EXPERT_WO_TILINGS`) at one token on the FP8 bank: error
    against `moe_fp8_wo_ref`, us per call (copies tokens with their own routing back to back; routing and combine
    included)."""
    from k3export.fp8_moe import moe_fp8_wo_ref
    from k3export.fp8_moe_kernels import EXPERT_WO_TILINGS, moe_fp8_grouped
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())    # noqa: E731
    e = moe.experts
    argss = []
    for _ in range(copies):
        x = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        argss.append((x, moe.routed_expert_down_proj(x), moe.gate.weight, moe.gate.e_score_correction_bias, e.w13,
                      e.w2, e.w13_scale, e.w2_scale, e.w13_input_scale, e.w2_input_scale, *moe.routing.values()))
    a0 = argss[0]
    ref = moe_fp8_wo_ref(*a0[:8], *a0[10:])
    r = {"N": 1, "err": {}, "us": {}}
    for name, wo in EXPERT_WO_TILINGS.items():
        try:
            r["err"][name] = rel(moe_fp8_grouped(*a0, weight_only=True, wo=wo), ref)
            r["us"][name] = _graph_us_each([lambda a=a, wo=wo: moe_fp8_grouped(*a, weight_only=True, wo=wo)
                                            for a in argss])
        except Exception as ex:                                                   # noqa: BLE001 (reported)
            r["err"][name] = f"{type(ex).__name__}: {str(ex)[:200]}"
        click.echo(f"  expert scheme {name}: {r['us'].get(name, float('nan')):.1f} us, rel. error "
                   f"{r['err'][name] if isinstance(r['err'][name], str) else format(r['err'][name], '.2e')}")
    return [r]


def kernel_profile(replay, reps: int = 5) -> list[dict]:
    """Device time per kernel name for one replay (torch profiler over reps replays, L2 not flushed), largest first."""
    from k3export.bench.ceilings import kernel_times
    try:
        return [{**r, "kernel": r["kernel"][:120]} for r in kernel_times(replay, reps)[:40]]
    except Exception as e:                                                        # noqa: BLE001 (reported)
        return [{"error": f"{type(e).__name__}: {str(e)[:200]}"}]


@bench.command("fp8")
@click.option("--preset", default="k3-small", show_default=True)
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True, help="Decode batch sizes.")
@click.option("--context", type=int, default=512, show_default=True, help="Cache rows per sequence in decode.")
@click.option("--prefill", "prefill_tokens", type=int, default=2048, show_default=True)
@click.option("--report-tokens", type=int, default=256, show_default=True)
@click.option("--noise-dtype", type=click.Choice(["float16", "float32", "none"]), default="float16",
              show_default=True, help="Precision of the noise-floor twin (bf16 vs it).")
@click.option("--layer-pair/--no-layer-pair", default=True, show_default=True,
              help="Also time a full-width K3 layer pair in bf16 and FP8 (needs ~90 GB).")
@click.option("--sweep/--no-sweep", default=True, show_default=True,
              help="Also time the pair's linear shapes at M = 1..64 and the expert op at N = 1..64 (thresholds).")
@click.option("--model/--no-model", default=True, show_default=True,
              help="The --preset model's steps (decode, k3-small sweeps, prefill, report); --no-model: the full-width "
                   "pair (and --variants) alone.")
@click.option("--variants/--no-variants", default=False, show_default=True,
              help="Time every named one-row linear launch at the pair's linear shapes and every expert scheme at one "
                   "token (errors checked), then the FP8 pair with the fastest within bounds.")
@click.option("--profile/--no-profile", default=False, show_default=True,
              help="Per-kernel device time of one pair step (torch profiler over graph replays).")
@click.option("--compiled/--eager", default=False, show_default=True,
              help="Decode steps as the compile backend serves them (packed projections, torch.compile, CUDA "
                   "graph) instead of the eager forward in a CUDA graph.")
@click.option("--out", type=click.Path(file_okay=False), default="out/bench", show_default=True)
def fp8_bench(preset, batches, context, prefill_tokens, report_tokens, noise_dtype, layer_pair, sweep, model,
              variants, profile, compiled, out):
    """FP8 vs bf16: accuracy report, decode step at B = 1..64 (CUDA graphs) and prefill, on one GPU; the
    full-width layer pair, its launch variants (--variants) and kernel profile (--profile)."""
    require_cuda("fp8")
    from k3export.bench.ceilings import copy_bandwidth, machine
    from k3export.calibrate import DEFAULT_RECIPE, HELDOUT_SEED, Recipe, calibrate, default_batches
    from k3export.config import K3Config
    from k3export.fp8 import WEIGHT_ONLY_OK, quantize_model
    from k3export.fp8_report import accuracy_report, format_report
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "command": command_line(click.get_current_context(), "k3export bench fp8"),
           "preset": preset}
    save = lambda: atomic_write(outdir / "fp8.json", json.dumps(res, indent=2))          # noqa: E731
    recipe = Recipe.load(DEFAULT_RECIPE)
    bw = copy_bandwidth()
    res["copy_GBps"] = bw / 1e9
    click.echo(f"{machine()}; copy {bw / 1e9:.0f} GB/s")
    if variants:
        click.echo("one-row FP8 linear launches at the pair's shapes (us per GEMM, back to back in one graph):")
        res["gemv_variants"] = gemv_variants(pair_linear_shapes(recipe))
        res["best_gemv"], res["gemv_totals_us"] = best_variant(res["gemv_variants"], VARIANT_BOUND)
        save()
        click.echo("  summed over the shapes: " + ", ".join(f"{n} {u:.1f}" for n, u in
                                                          sorted(res["gemv_totals_us"].items(), key=lambda x: x[1]))
                   + f"; bf16 {sum(r['bf16_us'] for r in res['gemv_variants']):.1f}; best {res['best_gemv']}")
    if model:
        cfg = K3Config.from_name(preset)
        t0 = time.perf_counter()
        ref = gpu_random_model(cfg, seed=0)
        scales = calibrate(ref, recipe, default_batches(cfg.vocab_size), progress=False)
        fp8 = copy.deepcopy(ref)
        counts = quantize_model(fp8, scales)
        gb = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) / 1e9  # noqa
        res["setup"] = {"seconds": time.perf_counter() - t0, "quantized": counts, "bf16_GB": gb(ref), "fp8_GB": gb(fp8)}
        click.echo(f"{machine()}; {preset}: bf16 {gb(ref):.2f} GB, fp8 {gb(fp8):.2f} GB ({counts}); "
                   f"setup {res['setup']['seconds']:.1f}s")
        res["selfcheck"] = selfcheck(ref, fp8)
        res["weight_only_active"] = dict(WEIGHT_ONLY_OK)           # False: a kernel failed here and W8A8 ran instead
        click.echo("selfcheck (rel. error vs reference): " + ", ".join(f"{k} {v:.1e}" for k, v in
                                                                       res["selfcheck"].items()))
        click.echo(f"weight-only kernels active: {res['weight_only_active']}")
        save()
        res["decode"] = []
        for B in [int(b) for b in batches.split(",")]:
            row = {"B": B}
            for tag, m in (("bf16", ref), ("fp8", fp8)):
                ms, how = decode_ms(m, B, context, compiled)
                how = f"compile+{how}" if compiled else how
                nbytes = step_bytes(m, B, context)
                row[tag] = {"ms": ms, "how": how, "MB": nbytes / 1e6, "GBps": nbytes / ms / 1e6,
                            "frac_copy": nbytes / ms * 1e3 / bw}
            row["speedup"] = row["bf16"]["ms"] / row["fp8"]["ms"]
            res["decode"].append(row)
            save()
            click.echo(f"decode B={B:3d} ctx={context}: bf16 {row['bf16']['ms']:.3f} ms "
                       f"({row['bf16']['GBps']:.0f} GB/s), fp8 {row['fp8']['ms']:.3f} ms "
                       f"({row['fp8']['GBps']:.0f} GB/s) [{row['fp8']['how']}]: "
                       f"{row['speedup']:.2f}x")
    if layer_pair:                          # first: the target figure (k3-small's 7 GB stay alongside)
        try:
            res["layer_pair"] = layer_pair_fn(recipe, variants={"gemv": res.get("best_gemv")} if variants else None,
                                              profile=profile, extra=res, save=save)
        except Exception as e:                                                    # noqa: BLE001 (reported)
            res.setdefault("layer_pair", [])
            click.echo(f"layer pair failed: {type(e).__name__}: {str(e)[:300]}")
        save()
        for r in res["layer_pair"]:
            click.echo(f"full-width {r['pair']} decode B=1 {r['precision']}: {r['ms']:.3f} ms, {r['GB']:.2f} GB "
                       f"({r['GBps']:.0f} GB/s, {r['GBps'] * 1e9 / bw:.0%} of copy)")
        ms = {(r["pair"], r["precision"]): r["ms"] for r in res["layer_pair"]}
        for pair in ("MLA+MoE", "KDA+MoE"):
            for prec in sorted({p for (q, p) in ms if q == pair and p != "bf16"}):
                if (pair, "bf16") in ms:
                    click.echo(f"full-width {pair} B=1: {prec} {ms[pair, 'bf16'] / ms[pair, prec]:.2f}x bf16")
        for name, prof in res.get("profile", {}).items():
            click.echo(f"kernels of one {name} step (us, torch profiler):")
            for r in prof[:14]:
                label = r.get("kernel", r.get("error", ""))[:100]
                click.echo(f"  {r.get('us', 0):7.1f} x{r.get('count', 0):4.1f}  {label}")
    if sweep and model:
        res["expert_sweep"] = expert_sweep(fp8)
        save()
        for r in res["expert_sweep"]:
            click.echo(f"expert op N={r['N']:3d}: weight-only {r['wo_us']:.1f} us, W8A8 {r['w8a8_us']:.1f} us "
                       f"(default {r['default']})")
        torch.cuda.empty_cache()
        res["linear_sweep"] = linear_sweep(pair_linear_shapes(recipe))
        save()
        click.echo("full-width FP8 linear shapes (us per GEMM):")
        _print_linear_sweep(res["linear_sweep"], bw)
    if prefill_tokens and model:
        p = {"T": prefill_tokens, "bf16_ms": prefill_ms(ref, prefill_tokens, compiled),
             "fp8_ms": prefill_ms(fp8, prefill_tokens, compiled), "how": "compile" if compiled else "eager"}
        p["speedup"] = p["bf16_ms"] / p["fp8_ms"]
        res["prefill"] = p
        save()
        click.echo(f"prefill T={prefill_tokens}: bf16 {p['bf16_ms']:.2f} ms, fp8 {p['fp8_ms']:.2f} ms: "
                   f"{p['speedup']:.2f}x")
    if report_tokens and model:
        held = torch.cat(default_batches(cfg.vocab_size, n_seqs=4, seq_len=64, seed=HELDOUT_SEED))
        prompts = held[:2, :16].tolist()
        rep = accuracy_report(fp8, ref, held, prompts, report_tokens)
        res["report"] = rep
        save()
        click.echo(format_report(rep, f"FP8 vs bf16 ({preset})"))
    if model:
        del fp8
    torch.cuda.empty_cache()
    if report_tokens and noise_dtype != "none" and model:
        hi = copy.deepcopy(ref)
        for p in hi.parameters():                       # the fp32-by-spec parameters stay fp32
            if p.dtype == torch.bfloat16:
                p.data = p.data.to(getattr(torch, noise_dtype))
        try:
            res["noise_floor"] = accuracy_report(ref, hi, held, prompts, report_tokens)
            res["noise_floor"]["twin"] = noise_dtype
            save()
            nf = res["noise_floor"]
            click.echo(f"noise floor bf16 vs {noise_dtype}: cosine {nf['logits']['cosine_mean']:.5f}, "
                       f"KL {nf['logits']['kl_mean']:.3e}, top-1 {nf['logits']['top1_agreement']:.4f}, "
                       f"greedy {nf['greedy']['agreement']:.4f} (first divergence "
                       f"{nf['greedy']['first_divergence']}); worst local layer error "
                       f"{nf['worst_layer']['rel_err']:.2e}")
        except Exception as e:                                                    # noqa: BLE001 (reported)
            res["noise_floor"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            click.echo(f"noise floor failed: {res['noise_floor']['error']}")
        del hi
    res["weight_only_active"] = dict(WEIGHT_ONLY_OK)
    save()
    click.echo(f"weight-only kernels active at the end: {res['weight_only_active']}; wrote {outdir / 'fp8.json'}")
