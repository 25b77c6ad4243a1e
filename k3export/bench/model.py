"""`k3export bench model`: end-to-end latency of every backend against eager PyTorch, through the runtime.

Prefill: one fresh prompt of T tokens into a slot (`Engine.prefill`). Decode: one step of B sequences that
each hold `context` tokens (`Engine.decode`, state commit included). Backends:

    eager     the model's Python forward, no CUDA graphs: the baseline ("eager PyTorch")
    graph     the same programs, decode (and repeated prefill shapes) captured as CUDA graphs
    compile   torch.compile (Inductor) programs, CUDA graphs on top
    compile-frozen  the same with Inductor's freezing (weights as constants: folded, shared-input matmuls merged)
    compile-nopdl   `compile` with programmatic dependent launch off (its GEMVs still `k3::gemv`)
    compile-cublas  `compile` with cuBLAS for the one-row linears (PDL on)
    compile-cublas-nopdl  both off: the `compile` backend until 2026-11-30 11:50 UTC
    compile-glu     `compile` with SiTU-GLU in the one-row GEMV of the MoE / MLP input projections (`k3::gemv_glu`)
    compile-moepdl  `compile` with the MoE decode kernels (router, top-k, pair GEMVs) on PDL too
    compile-nofp8cols `compile` with an FP8 model's MoE output pair (FP8 up + shared down) as two launches
    compile-gemv4   `compile` with linears of up to 4 rows (decode at B = 2-4) on `k3::gemv` too
    aoti      an AOTInductor engine from `k3export build` (built or reused under --engines), CUDA graphs on top
    megakernel  the persistent decode kernel (`k3export.megakernel`: the whole step in one launch, CUDA graphs on
              top; GPU, B = 1, decode and generation rows only: its prefill is the `compile` backend's)
    megakernel-host-inputs  the same with the token's embedding row, the key count and the epoch set by small
              kernels around the launch (`MegakernelBackend(step_inputs=False)`; the default reads them itself)
    megakernel-argmax  the same with the greedy token taken in the launch (`MegakernelBackend(argmax=True)`, chain.cu
              built with ARGMAX=1; the default runs the engine's argmax program after the launch). 12-05 07:51, H200:
              pipelined greedy 0.698 ms against 0.694, decode 0.747 against 0.735
    megakernel-argmax-after  the same with the launch's argmax keys taken after the phases, from the block's own
              stores (`argmax=2`, ARGMAX=2; the LM head's tile loop as in the default). 12-05 09:09, H100:
              pipelined greedy 0.792 ms against 0.788
    megakernel-commit-lengths  the same with the step's lengths advanced by the launch's last block, not by the
              engine's add after it (`commit_lengths=True`, COMMIT_LENGTHS=1). 12-05 09:09, H100: 0.791
    megakernel-argmax-after-commit  both (`argmax=2, commit_lengths=True`): neither the engine's argmax program nor
              its lengths add after the greedy step's launch. 12-05 09:09, H100: 0.789
    megakernel-stream  the same without the engine's CUDA graphs: each step's launches go to the stream one by one
              (`MegakernelBackend(cuda_graphs=False)`; its logits the default's bit for bit, 12-05 09:22). 12-05
              13:00, H100: pipelined greedy 0.791 against the graph's 0.781; decode 1.027 against 0.803 (the
              host's launch path is no longer hidden when each step is waited for)
    megakernel-pdl  the same, each launch a programmatic dependent launch (`pdl=True`, chain.cu built with PDL=1):
              its blocks take the SMs, and its producers stream the first phase's weights, while the engine's argmax
              program before it runs (no CUDA graphs: the overlap is between kernels of one stream). 12-05 13:00,
              H100: right (bit for bit), no faster: pipelined greedy 0.791 against the graph's 0.781
    megakernel-pdl-commit  the same with COMMIT_LENGTHS (no lengths add between launch and argmax). 13:00: 0.782
    megakernel-pdl-argmax-commit  PDL with ARGMAX=2 and COMMIT_LENGTHS: launch after launch, nothing between.
              13:00: 0.786
    megakernel-steps4, megakernel-steps8, megakernel-steps16  the pipelined greedy Generator runs 4 / 8 / 16 steps
              in one launch while the request has room for them (`steps_per_launch=K`, chain.cu built with
              STEP_LOOP=1, ARGMAX=2 and COMMIT_LENGTHS); its generation rows' ms is the mean a token over windows
              of K gaps (the tokens of a launch reach the host together: the plain mean of the gaps depends on
              where the first and last timed tokens fall in their launches). 12-06, H100: right, and slower than
              the default build (a token 0.800 ms in launches of 8 steps, 0.78 default; docs/megakernel.md)
    megakernel-router-first  the same with each MoE's router rows early in its packed projection
              (`MegakernelBackend(router_first=True)`; 12-03 14:04, 300 steps: 0.784 ms against 0.808, pipelined
              generation 0.779 both)
    megakernel-g-in-proj  the same with each KDA and MLA layer's gate rows in its input projection, as before
              12-04 14:50 (`MegakernelBackend(g_apart=False, mla_g_apart=False)`; the default has them in a phase
              of their own beside the step / attention: 300 steps x 3 rounds, decode 0.740 ms against 0.748,
              pipelined 0.731 against 0.738)
    megakernel-unpaired  the same with each block's MoE down tiles two experts' (`MegakernelBackend(pair_tiles=False)`:
              two x loads a block, not one; 12-03 14:43, 300 steps: 0.784 ms against the default's 0.769)
    megakernel-poll-sleep64, megakernel-poll-sleep256  the same with a consumer sleeping 64 / 256 ns between two
              polls of words not yet written (`MegakernelBackend(poll_sleep=N)`; 12-03 16:12, 300 steps: 0.762 ms
              both against the default's 0.764, pipelined 0.767 / 0.765 against 0.762)
    megakernel-attn-heads4  the same with the MLA attention's tiles 4 heads each, not 8, on CUDA cores
              (`MegakernelBackend(attn_heads=4, attn_mma=False)`: 132 tiles at 1024 keys, every block one; 12-03
              17:03, 300 steps, with LIVE_SPLITS: pipelined 0.755 ms against 0.760, decode 0.763 against 0.756; at
              max_len over 1056 rows its live tiles can outnumber 132 blocks)
    megakernel-dead-splits  the same with the attention's tiles past the launch's keys run and combined as
              before LIVE_SPLITS (`MegakernelBackend(live_splits=False)`; 12-03 17:03: 0.763 ms pipelined against
              0.760)
    megakernel-sums-apart  the same with the attention tile's score sums butterflied one after another (before
              ATTN_SUMS_TOGETHER, the default since 12-03 18:50: the same adds; layer step 0.7350 / 0.7341 ms against
              0.7326 / 0.7313)
    megakernel-attn-cuda-cores  the same with the attention tile on CUDA cores and its x in four round trips, as
              before 12-03 19:10 (`MegakernelBackend(attn_mma=False, x_tail=False)`; layer step 0.7421 ms against
              0.7317)
    megakernel-uncapped  the same with the producer keeping as many weight copies on their way as its ring holds
              (three), as before 12-04 evening (`MegakernelBackend(inflight=0)`; the default keeps one: layer step
              0.726 ms uncapped against 0.699)

Napkin math beside every time. Decode floor = bytes a step must move / measured copy bandwidth: every weight
except the routed experts and the embedding table, the routed experts a batch of B hits in expectation
(E (1 - (1 - k/E)^B) per layer; exactly k at B = 1), B embedding rows, the KDA state and conv window read and
written, the MLA cache rows read and one row written per sequence. Prefill floor = max(that byte count with
all experts, matmul FLOPs 2 T x active params + causal MLA attention / measured bf16 matmul rate).
Medians of --iters timed runs (decode: --decode-iters, default --iters) after --warmup (CUDA events on GPU), spread
as p10..p90. With --rounds N the decode cases run N - 1 more times after the first pass, the backends in a rotated
order each round (all kept built), every sample pooled into the row and each round's median kept ("rounds"): the
first backend timed in a process has been the slow one more than once (12-03), and the rounds spread that over
all of them. A repeated prefill shape replays a captured CUDA graph (graph backends); with --new-lengths (default)
each T also gets "prefill new length" rows, a prompt of a length not seen before at every call (T - 1, T - 2, ...),
as serving meets them: with the engine's length buckets (`runtime.prefill_bucket`) and, where the engine buckets,
without them.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import click
import torch

from k3export.bench import bench, command_line
from k3export.commands import device_option
from k3export.manifest import atomic_write, replacing
from k3export.runtime import dynamo_limit_watch

# The `compile` backend and variants that turn one of its serving choices off (or Inductor freezing on), for
# measuring what each choice is worth: CompileBackend keyword arguments per name.
COMPILE_VARIANTS = {"compile": {}, "compile-frozen": {"freezing": True}, "compile-unfused": {"fuse_norms": False},
                    "compile-copy": {"inplace": False}, "compile-noadd": {"fuse_adds": False},
                    "compile-combo": {"options": {"combo_kernels": True}}, "compile-nopdl": {"pdl": False},
                    "compile-cublas": {"gemv": False}, "compile-cublas-nopdl": {"gemv": False, "pdl": False},
                    "compile-glu": {"glu": True},
                    "compile-moepdl": {"moe_pdl": True}, "compile-norm": {"fold_norm": True},
                    "compile-nofp8cols": {"fp8_cols": False}, "compile-gemv1": {"gemv_rows": 1},
                    "compile-gemv4": {"gemv_rows": 4},
                    "compile-fast": {"glu": True, "moe_pdl": True, "fold_norm": True}}
MEGAKERNEL_VARIANTS = {"megakernel": {}, "megakernel-host-inputs": {"step_inputs": False},
                       "megakernel-router-first": {"router_first": True},
                       "megakernel-g-in-proj": {"g_apart": False, "mla_g_apart": False},
                       "megakernel-unpaired": {"pair_tiles": False},
                       "megakernel-poll-sleep64": {"poll_sleep": 64},
                       "megakernel-poll-sleep256": {"poll_sleep": 256},
                       "megakernel-attn-heads4": {"attn_heads": 4, "attn_mma": False},
                       "megakernel-dead-splits": {"live_splits": False},
                       "megakernel-sums-apart": {"sums_apart": True},
                       "megakernel-attn-cuda-cores": {"attn_mma": False, "x_tail": False},
                       "megakernel-uncapped": {"inflight": 0},
                       "megakernel-argmax": {"argmax": True},
                       "megakernel-argmax-after": {"argmax": 2},
                       "megakernel-commit-lengths": {"commit_lengths": True},
                       "megakernel-argmax-after-commit": {"argmax": 2, "commit_lengths": True},
                       "megakernel-stream": {"cuda_graphs": False},
                       "megakernel-pdl": {"pdl": True},
                       "megakernel-pdl-commit": {"pdl": True, "commit_lengths": True},
                       "megakernel-pdl-argmax-commit": {"pdl": True, "argmax": 2, "commit_lengths": True},
                       "megakernel-steps4": {"steps_per_launch": 4},
                       "megakernel-steps8": {"steps_per_launch": 8},
                       "megakernel-steps16": {"steps_per_launch": 16}}
BACKENDS = ("eager", "graph", *COMPILE_VARIANTS, "aoti", *MEGAKERNEL_VARIANTS)


# ---------------------------------------------------------------------------------------------- napkin math
def param_bytes(config, dtype) -> dict[str, int]:
    """Bytes of the embedding table, the routed experts (all layers) and everything else."""
    from k3export.model import K3Model
    from k3export.model.weights import param_dtype
    with torch.device("meta"):
        m = K3Model(config)
    out = {"embed": 0, "experts": 0, "other": 0}
    for name, p in m.named_parameters():
        b = p.numel() * torch.empty(0, dtype=param_dtype(name, dtype)).element_size()
        out["embed" if "embed_tokens" in name else "experts" if ".experts." in name else "other"] += b
    return out


def decode_bytes(config, dtype, pb: dict, B: int, context: int) -> int:
    from k3export.model.state import state_bytes
    E, k = config.num_experts, config.num_experts_per_token
    hit = E * (1 - (1 - k / E) ** B)
    sb = state_bytes(config, dtype)
    row = pb["embed"] // config.vocab_size
    return int(pb["other"] + pb["experts"] * hit / E + B * row +
               B * 2 * (sb["kda_conv_per_seq"] + sb["kda_state_per_seq"]) + B * (context + 1) * sb["mla_cache_per_token"])


def prefill_flops(config, dtype, pb: dict, T: int, last_only: bool = False) -> float:
    """FLOPs of a T-token prefill of one sequence; last_only: the lm_head on the last token only (what the engine's
    prefill computes through a backend's `prefill_last`)."""
    item = torch.empty(0, dtype=dtype).element_size()
    active = (pb["other"] + pb["experts"] * config.num_experts_per_token / config.num_experts) / item
    H = config.num_attention_heads
    attn = len(config.mla_layers) * H * T * T * (config.qk_head_dim + config.v_head_dim)   # causal: half of 2x
    skipped = (T - 1) * config.vocab_size * config.hidden_size if last_only else 0
    return 2 * (T * active - skipped) + attn


# ---------------------------------------------------------------------------------------------- timing
def time_ms(fn, warmup: int, iters: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return {"ms": statistics.median(ms), "p10": q[0], "p90": q[-1]}


def ceilings(cuda: bool) -> tuple[float, float | None, str]:
    """(copy bytes/s, bf16 matmul FLOP/s or None on CPU, machine description), measured now."""
    if cuda:
        from k3export.bench.ceilings import copy_bandwidth, machine, matmul_rate
        return copy_bandwidth(), matmul_rate(), machine()
    x = torch.empty(1 << 26, dtype=torch.float32)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (statistics.median(time_ms(lambda: y.copy_(x), 2, 5, False)) * 1e-3)
    return bw, None, f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}"


# ---------------------------------------------------------------------------------------------- backends
def make_backend(name: str, model, engines: Path, profiles: dict, log, max_len: int = 0) -> tuple[object, bool, dict]:
    """-> (runtime backend, use CUDA graphs, build info). max_len: the longest sequence the decode and generation
    engines hold (the megakernel sizes its caches for it)."""
    from k3export.runtime import CompileBackend, EagerBackend
    cuda = model.device.type == "cuda"
    if name in MEGAKERNEL_VARIANTS:
        from k3export.megakernel.backend import MegakernelBackend
        from k3export.megakernel.chain import kernel_report
        t0 = time.perf_counter()
        b = MegakernelBackend(model, max_len=max_len, **MEGAKERNEL_VARIANTS[name])
        return b, cuda, {"build_s": round(time.perf_counter() - t0, 2), "max_len": max_len,
                          "kernel": " | ".join(kernel_report(b.kernel.ptxas))}
    if name == "eager":
        return EagerBackend(model), False, {}
    if name == "graph":
        return EagerBackend(model), True, {}
    if name in COMPILE_VARIANTS:
        b = CompileBackend(model, **COMPILE_VARIANTS[name])
        info = {"packed_groups": b.packed, "fused_norm_swaps": b.fused, "inplace_decode": hasattr(b, "decode_"),
                **{k: v for k, v in COMPILE_VARIANTS[name].items() if k in ("freezing", "options")}}
        if b.gemv:
            info["gemv_linears"] = b.gemv
        if b.pdl:
            info["pdl"] = True
        return b, cuda, info
    if name == "aoti":
        from k3export.build import build, open_backend
        t0 = time.perf_counter()
        path = build("aoti", model, engines, profiles=profiles, echo=log)
        m = json.loads((path / "manifest.json").read_text())
        return open_backend(path, model.device), cuda, {"engine": str(path), "build_s": round(time.perf_counter() - t0, 2),
                                                        "build_steps_s": m["build"]["seconds"]}
    raise click.BadParameter(f"unknown backend '{name}'; choose from {', '.join(BACKENDS)}")


def run_backend(name, backend, graphs, model, args, bw, rate, pb, bar) -> list[dict]:
    from k3export.runtime import Engine
    cfg, dtype, dev = model.config, model.dtype, model.device
    cuda = dev.type == "cuda"
    rows = []
    g = torch.Generator().manual_seed(0)
    decode_only = hasattr(backend, "prefill_backend")          # (megakernel: its prefill is another backend's)
    if decode_only:
        bar.update(len(args["prefill_lengths"]))
    for T in [] if decode_only else args["prefill_lengths"]:
        t_first = time.perf_counter()
        eng = Engine(backend, max_batch=1, max_len=T + 1, cuda_graphs=graphs)
        prompt = torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist()
        ms = time_ms(lambda: (eng.prefill([0], [prompt]), eng.release(0)), args["warmup"], args["iters"], cuda)
        fl = prefill_flops(cfg, dtype, pb, T, last_only=hasattr(backend, "prefill_last"))
        floor = max(fl / rate if rate else 0.0, (pb["other"] + pb["experts"]) / bw) * 1e3

        def row(phase, ms, **extra):
            s = summary(ms)
            return {"phase": phase, "backend": name, "batch": 1, "tokens": T, **s, "tokens_per_s": T / s["ms"] * 1e3,
                    "tflops": fl / s["ms"] / 1e9, "floor_ms": floor, "x_floor": s["ms"] / floor, **extra}
        rows.append(row("prefill", ms, first_call_s=round(time.perf_counter() - t_first, 2)))
        if args.get("new_lengths"):          # a prompt length not seen before at every call: T - 1, T - 2, ...
            engines = [(eng, "prefill new length")]
            if eng.prefill_buckets:          # the same calls without the engine's length buckets, for comparison
                engines.append((Engine(backend, max_batch=1, max_len=T + 1, cuda_graphs=graphs,
                                       prefill_buckets=False), "prefill new length, no buckets"))
            for e, phase in engines:
                lens = iter(range(T - 1, 0, -1))
                ms = time_ms(lambda: (e.prefill([0], [prompt[:next(lens)]]), e.release(0)), args["warmup"],
                             args["iters"], cuda)
                rows.append(row(phase, ms))
            del engines, e
        del eng
        bar.update(1)
    for (B, ctx), (ms, graph) in decode_samples(backend, graphs, model, args, bar).items():
        nbytes = decode_bytes(cfg, dtype, pb, B, ctx)
        rows.append(decode_row({"phase": "decode", "backend": name, "batch": B, "context": ctx,
                                "floor_ms": nbytes / bw * 1e3, **graph, "_bytes": nbytes}, [ms]))
    if args.get("generate_tokens"):
        rows += generate_rows(name, backend, graphs, model, args, bw, pb, g)
        bar.update(2)
    return rows


def decode_samples(backend, graphs, model, args, bar) -> dict:
    """Every decode case of `backend` once: {(B, context): (ms samples, {"graphed", "graph_error"})}, the B
    sequences' tokens the same every call (a fixed seed). Batches past the backend's max_batch are skipped."""
    from k3export.runtime import Engine
    cfg, dev = model.config, model.device
    g = torch.Generator().manual_seed(1)
    out = {}
    ctx_max = max(args["contexts"])
    for B in args["batches"]:
        if B > getattr(backend, "max_batch", B):               # (megakernel: B = 1 only)
            bar.update(len(args["contexts"]))
            continue
        steps = args["warmup"] + args["decode_iters"]
        eng = Engine(backend, max_batch=B, max_len=ctx_max + len(args["contexts"]) * steps + 2, cuda_graphs=graphs)
        tok = torch.randint(0, cfg.vocab_size, (B,), generator=g).to(dev)
        for ctx in args["contexts"]:
            eng.fill_slots(ctx)
            ms = time_ms(lambda: eng.decode(tok), args["warmup"], args["decode_iters"], dev.type == "cuda")
            out[(B, ctx)] = (ms, {"graphed": eng.graphed, "graph_error": eng.graph_error})
            bar.update(1)
        del eng
    return out


def decode_row(row: dict, rounds: list[list[float]]) -> dict:
    """A decode row from its rounds' samples (pooled; each round's median kept when there are several), the napkin
    math from the step's bytes (`_bytes`, dropped before the row is written) and floor."""
    ms = [v for r in rounds for v in r]
    s = summary(ms)
    row.update(s, tokens_per_s=row["batch"] / s["ms"] * 1e3, gb_s=row["_bytes"] / s["ms"] / 1e6,
               x_floor=s["ms"] / row["floor_ms"], _rounds=rounds)
    if len(rounds) > 1:
        row["rounds"] = [statistics.median(r) for r in rounds]
    return row


def failed(name: str, stage: str, e: Exception, bar) -> str:
    """A backend that raised while being built or timed: said on the bar, and the text for its `builds` entry."""
    bar.write(f"{name}: {stage} failed, its rows left out ({type(e).__name__}: {str(e)[:200]})")
    return f"{stage}: {type(e).__name__}: {str(e)[:300]}"


def more_rounds(kept: list, rows: list[dict], model, args, bar, builds: dict | None = None) -> None:
    """--rounds: the decode cases of every kept (name, backend, graphs) again, args["rounds"] - 1 times, the
    backends' order rotated by one each round; each decode row pools its new samples (`decode_row`). A backend
    that raises in a later round keeps the rounds it finished, is noted in `builds` and is not run again."""
    by_key = {(r["backend"], r["batch"], r["context"]): r for r in rows if r["phase"] == "decode"}
    dropped = set()
    for k in range(1, args["rounds"]):
        for name, backend, graphs in kept[k % len(kept):] + kept[:k % len(kept)]:
            if name in dropped:
                continue
            bar.set_postfix_str(f"{name}, round {k + 1}")
            start = bar.n
            try:
                samples = decode_samples(backend, graphs, model, args, bar)
            except Exception as e:
                dropped.add(name)                    # (its cases of this round and the later ones: skipped)
                bar.update(start + (args["rounds"] - k) * len(args["batches"]) * len(args["contexts"]) - bar.n)
                if builds is not None:
                    builds.setdefault(name, {})["error"] = failed(name, f"round {k + 1}", e, bar)
                continue
            for (B, ctx), (ms, _) in samples.items():
                r = by_key[(name, B, ctx)]
                decode_row(r, r["_rounds"] + [ms])


SAMPLED = {"temperature": 0.8, "top_p": 0.95}     # the sampled generation row's settings (a common chat setting)


def generate_rows(name, backend, graphs, model, args, bw, pb, g) -> list[dict]:
    """Inter-token latency of a `Generator` at B = 1 (host timestamps of the tokens as the loop hands them out, after
    the prefill and first step), from a prompt of the smallest context: greedy plain and pipelined
    (`Generator(pipeline=True)`: step t + 1 queued before step t's token is read), then the same two sampled
    (`SAMPLED`: each token drawn on the device, `k3export.sampling.draw`, a sort of the row for top-p included)."""
    from k3export.generate import Sampling
    from k3export.runtime import Engine, Generator
    cfg, cuda = model.config, model.device.type == "cuda"
    N, ctx = args["generate_tokens"], min(args["contexts"])
    prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
    nbytes = decode_bytes(cfg, model.dtype, pb, 1, ctx)
    rows = []
    for phase, pipe, sampling in (("generate", False, Sampling()), ("generate pipelined", True, Sampling()),
                                  ("generate sampled", False, Sampling(**SAMPLED)),
                                  ("generate sampled pipelined", True, Sampling(**SAMPLED))):
        stamps: list[float] = []
        eng = Engine(backend, max_batch=1, max_len=ctx + N + 2, cuda_graphs=graphs)
        gen = Generator(eng, on_token=lambda r, t: stamps.append(time.perf_counter()), pipeline=pipe)
        gen.submit(prompt, N, sampling)
        gen.step()                                               # prefill and the first decode step: not timed
        gen.run()
        ms = [(b - a) * 1e3 for a, b in zip(stamps[2:], stamps[3:])]
        k = gen.steps_per_launch if pipe and sampling.temperature == 0 else 1
        if k > 1:       # (a launch's K tokens reach the host together: the gaps are ~0 and ~K steps; per token,
            ms = [sum(ms[i:i + k]) / k for i in range(len(ms) - k + 1)]    # the mean over each window of K)
        s = summary(ms)
        rows.append({"phase": phase, "backend": name, "batch": 1, "steps_per_launch": k,
                     "context": ctx, **s, "tokens_per_s": 1e3 / s["ms"], "gb_s": nbytes / s["ms"] / 1e6,
                     "floor_ms": nbytes / bw * 1e3, "x_floor": s["ms"] / (nbytes / bw * 1e3),
                     "graphed": eng.graphed})
        del gen, eng
        if cuda:
            torch.cuda.synchronize()
    return rows


# ---------------------------------------------------------------------------------------------- reports
def public(rows: list[dict]) -> list[dict]:
    """The rows without their working keys (those starting with "_")."""
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def add_speedups(rows: list[dict]) -> None:
    base = {(r["phase"], r["batch"], r.get("tokens"), r.get("context")): r["ms"] for r in rows
            if r["backend"] == "eager"}
    for r in rows:
        b = base.get((r["phase"], r["batch"], r.get("tokens"), r.get("context")))
        r["speedup"] = b / r["ms"] if b else None


def _rate(v: float) -> str:
    """A rate with its useful digits: 3412, 41.7, 5.2, 0.0034 (a tiny preset's rates are far below 1)."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2g}"


def markdown(rows: list[dict]) -> str:
    lines = ["| phase | backend | B | T / context | ms (median) | p10..p90 | tokens/s | GB/s or TFLOP/s | floor ms | x floor | vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        phys = f"{_rate(r['gb_s'])} GB/s" if "gb_s" in r else f"{_rate(r['tflops'])} TFLOP/s"
        sp = f"{r['speedup']:.1f}x" if r.get("speedup") else "-"
        lines.append(f"| {r['phase']} | {r['backend']} | {r['batch']} | {r.get('tokens') or r.get('context')} | "
                     f"{r['ms']:.3f} | {r['p10']:.3f}..{r['p90']:.3f} | {r['tokens_per_s']:.0f} | {phys} | "
                     f"{r['floor_ms']:.3f} | {r['x_floor']:.1f} | {sp} |")
    rounds = [f"{r['backend']} B {r['batch']} context {r['context']}: " + " / ".join(f"{v:.3f}" for v in r["rounds"])
              for r in rows if r.get("rounds")]
    if rounds:                                                  # (--rounds: each round's median, in order)
        lines += ["", "Decode medians per round (ms): " + "; ".join(rounds) + "."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for name in backends:
        pre = [r for r in rows if r["backend"] == name and r["phase"] == "prefill"]
        # (a backend without prefill rows, megakernel: its colour without a legend entry there)
        a.plot([r["tokens"] for r in pre], [r["ms"] for r in pre], "o-", label=name if pre else "_" + name)
        for i, ctx in enumerate(sorted({r["context"] for r in rows if r["phase"] == "decode"})):
            dec = [r for r in rows if r["backend"] == name and r["phase"] == "decode" and r["context"] == ctx]
            b.plot([r["batch"] for r in dec], [r["ms"] for r in dec], "o" + ("-", "--", ":")[i % 3],
                   label=f"{name}, ctx {ctx}", color=a.lines[-1].get_color())
        gen = [r for r in rows if r["backend"] == name and r["phase"] == "generate pipelined"]
        if gen:                                                  # inter-token latency of a generation, B = 1
            b.plot([r["batch"] for r in gen], [r["ms"] for r in gen], "*", markersize=11, linestyle="none",
                   label=f"{name}, generation (inter-token)", color=a.lines[-1].get_color())
    floor = [r for r in rows if r["backend"] == backends[0] and r["phase"] == "decode"]
    if floor:
        ctx0 = floor[0]["context"]
        at = [r for r in floor if r["context"] == ctx0]
        b.plot([r["batch"] for r in at], [r["floor_ms"] for r in at], "k:" if len(at) > 1 else "k_", markersize=14,
               label=f"bytes floor, ctx {ctx0}")
    for ax, xl, t in ((a, "prompt tokens", "prefill latency"), (b, "batch (sequences)", "decode step latency")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel("ms")
        ax.set_title(t)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path


def _ints(text: str, option: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]: positive integers, at least one (else a BadParameter naming the option)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option)
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"expected comma-separated integers >= 1, got {text!r}", param_hint=option)
    return vals


@bench.command("model")
@click.option("--preset", type=click.Choice(["k3-tiny", "k3-small"]), default="k3-tiny", show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None, help="Default: bf16 on GPU, fp32 on CPU.")
@device_option()
@click.option("--backends", default="eager,graph,aoti", show_default=True, help=f"Any of {','.join(BACKENDS)}.")
@click.option("--prefill-lengths", default="128,512,2048", show_default=True)
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True)
@click.option("--contexts", default="1024,4096", show_default=True, help="Tokens already in each sequence.")
@click.option("--warmup", default=3, show_default=True)
@click.option("--iters", default=10, show_default=True)
@click.option("--decode-iters", type=int, default=None,
              help="Timed decode steps per case (default: --iters); a decode step is ~1 ms, so more are cheap.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Decode timing rounds: after the first pass the decode cases run N - 1 more times, the backends "
                   "in a rotated order each round (all kept built), the samples pooled and each round's median "
                   "kept; for comparing backends whose first-timed rows drift.")
@click.option("--generate-tokens", default=32, show_default=True,
              help="Tokens per generation timed at B = 1 (inter-token latency, plain and pipelined Generator, "
                   "greedy and sampled at temperature 0.8, top-p 0.95); 0: none.")
@click.option("--new-lengths/--no-new-lengths", default=True, show_default=True,
              help="Also time prefills of a length not seen before at every call (T - 1, T - 2, ...), with and "
                   "without the engine's length buckets.")
@click.option("--engines", type=click.Path(file_okay=False, path_type=Path), default=Path("engines"), show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("out/bench/model"), show_default=True)
@click.option("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's).")
@click.option("--layer", is_flag=True, help="Instead: one full-width K3 layer pair (`k3export bench layer`).")
@click.pass_context
def model_bench(ctx, preset, dtype, device, backends, prefill_lengths, batches, contexts, warmup, iters, decode_iters,
                rounds, generate_tokens, new_lengths, engines, out, threads, layer):
    """Prefill and decode latency per backend against eager PyTorch: JSON, markdown table and PNG plot."""
    if layer:
        from k3export.bench import layer as layer_mod
        return ctx.invoke(layer_mod.layer, out=out)
    from tqdm import tqdm
    from k3export.build import PRECISIONS, profiles_for
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    if threads:
        torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"            # checked when parsed (`device_option`)
    dtype = dtype or ("bf16" if cuda else "fp32")
    names = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise click.BadParameter(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}",
                                 param_hint="'--backends'")
    if not cuda and "graph" in names:
        names.remove("graph")                                   # CUDA graphs need a GPU: same as eager here
    if "eager" not in names:
        names.insert(0, "eager")
    # the baselines first: `compile` packs the shared model's projections in place (runtime.CompileBackend)
    names.sort(key=lambda n: n not in ("eager", "graph"))
    args = {"prefill_lengths": _ints(prefill_lengths, "'--prefill-lengths'"), "batches": _ints(batches, "'--batches'"),
            "contexts": _ints(contexts, "'--contexts'"),
            "warmup": warmup, "iters": iters, "decode_iters": decode_iters or iters, "generate_tokens": generate_tokens,
            "new_lengths": new_lengths, "rounds": rounds}
    out.mkdir(parents=True, exist_ok=True)
    cfg = K3Config.from_name(preset)
    t0 = time.perf_counter()
    model = random_model(cfg, seed=0, dtype=PRECISIONS[dtype], device=device)
    click.echo(f"{preset} {dtype} random weights on {device} in {time.perf_counter() - t0:.1f}s")
    bw, rate, where = ceilings(cuda)
    click.echo(f"measured copy bandwidth {bw / 1e9:.0f} GB/s" + (f", bf16 matmul {rate / 1e12:.0f} TFLOP/s" if rate else ""))
    pb = param_bytes(cfg, PRECISIONS[dtype])
    profiles = profiles_for(max(args["batches"]), max(args["prefill_lengths"]),
                            max(args["contexts"]) + len(args["contexts"]) * (warmup + args["decode_iters"]) + 2)
    decode_len = max(max(args["contexts"]) + len(args["contexts"]) * (warmup + args["decode_iters"]) + 2,
                     min(args["contexts"]) + generate_tokens + 2)
    rows, builds = [], {}
    per_backend = (len(args["prefill_lengths"]) + rounds * len(args["batches"]) * len(args["contexts"]) +
                   2 * bool(generate_tokens))
    n_cases = len(names) * per_backend
    kept = []                                                   # (name, backend, graphs) for --rounds
    with tqdm(total=n_cases, desc="bench model", unit="case") as bar:
        for name in names:
            bar.set_postfix_str(name)
            start = bar.n                                           # (a backend that fails skips its other cases)
            try:
                backend, graphs, info = make_backend(name, model, engines, profiles, lambda s: bar.write(s),
                                                     max_len=decode_len)
            except Exception as e:                                  # a backend that cannot build is reported
                builds[name] = {"error": failed(name, "build", e, bar)}
                bar.update(start + per_backend - bar.n)
                continue
            builds[name] = info
            with dynamo_limit_watch() as watch:
                try:
                    rows += run_backend(name, backend, graphs, model, args, bw, rate, pb, bar)
                except Exception as e:                              # so is one that fails while timed: its rows
                    info["error"] = failed(name, "timing", e, bar)  # go, the other backends' rows stay
                    bar.update(start + per_backend - bar.n)
                    del backend
                    continue
            if watch["hits"]:                       # Dynamo fell back to running uncompiled: say so, loudly
                info["dynamo_recompile_limit_hit"] = watch["hits"]
                bar.write(f"WARNING {name}: Dynamo hit its recompile limit {watch['hits']} time(s): rows timed after "
                          "that ran uncompiled (raise torch._dynamo.config.recompile_limit)")
            (out / "model.partial.json").write_text(json.dumps({"builds": builds, "rows": public(rows)}, indent=2))
            if rounds > 1:
                kept.append((name, backend, graphs))
            del backend
            if cuda:
                torch.cuda.empty_cache()
        if kept:
            with dynamo_limit_watch() as watch:
                more_rounds(kept, rows, model, args, bar, builds)
            if watch["hits"]:
                bar.write(f"WARNING: Dynamo hit its recompile limit {watch['hits']} time(s) in the later rounds")
            del kept
    rows = public(rows)
    add_speedups(rows)
    cmd = command_line(ctx, "k3export bench model", skip=("layer",))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": where,
            "command": cmd, "preset": preset, "dtype": dtype, "copy_gb_s": bw / 1e9,
            "matmul_tflops": rate / 1e12 if rate else None, "param_bytes": pb, "builds": builds}
    atomic_write(out / "model.json", json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    table = markdown(rows)
    notes = "".join(f"- {name}: {json.dumps(info)}\n" for name, info in builds.items() if info)
    atomic_write(out / "model.md", f"{meta['date']}, {where}\n\n`{cmd}`\n\n{table}" + (f"\n{notes}" if notes else ""))
    png = plot(rows, out / "model.png", f"{preset} {dtype}, {where}")
    click.echo(table)
    for name, info in builds.items():
        if info:
            click.echo(f"{name}: {info}")
    click.echo(f"wrote {out / 'model.json'}, {out / 'model.md'}" + (f", {png}" if png else ""))
