"""The serving runtime: one `Engine` over every backend, and a continuous-batching `Generator` on top.

A backend is a pair of functional programs with the signatures of `K3Model.forward_prefill` and
`K3Model.forward_decode` (state in; logits, new KDA tensors and new MLA rows out). Eager PyTorch, torch.compile
and the AOTInductor packages all fit that mould, so the engine never asks which one it runs.

The engine owns a fixed number of *slots*: one preallocated `K3State` of `max_batch` sequences x `max_len`
cache rows that is never reallocated (a captured CUDA graph holds its addresses). A request joins by being
prefilled (in one batch with the other joiners) into a free slot; a decode step runs the slots at once, each at
its own position, and only the active slots advance. On a GPU the decode step (program + state commit) is
captured as a CUDA graph for the engine's batch size and replayed; with eager / compile backends a step runs only
the slots up to the highest active one, rounded up to a power of two, each such bucket with its own graph
(`decode_buckets`), and prefill shapes are padded to length buckets whose graphs are replayed too.

    engine = Engine(EagerBackend(model), max_batch=4, max_len=256)
    gen = Generator(engine)
    gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=8)        # == k3export.generate.generate, greedy
"""

from __future__ import annotations

import contextlib
import os
import itertools
import json
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from k3export.config import K3Config
from k3export.generate import Sampling, check_prompts, filtered, sample, sampling_rows, width
from k3export.sampling import UNPOSTED, argmax_rows, draw
from k3export.model.state import K3State


def load_kernels(device_type: str) -> list[str]:
    """On a GPU, import each op's `kernels.py` (it registers the Triton kernels as the op's CUDA implementation).
    Returns the ops whose kernels loaded. A no-op elsewhere: the references serve every other device."""
    import importlib
    import importlib.util
    loaded = []
    if device_type != "cuda":
        return loaded
    for op in ("kda", "mla", "moe", "attn_res"):
        name = f"k3export.plugins.{op}.kernels"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
            loaded.append(op)
    return loaded


class Backend(Protocol):
    """Functional prefill/decode programs plus what the engine needs to allocate their state."""

    name: str
    config: K3Config
    dtype: torch.dtype            # model dtype: the conv window and the MLA cache use it
    device: torch.device
    max_prefill_tokens: int | None   # longest prefill chunk the program accepts (None: any)

    def prefill(self, input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len):
        """As `K3Model.forward_prefill`: -> (logits `[B, T, V]`, kda_conv, kda_state, rows `[n_mla, B, T, R]`)."""

    def decode(self, input_ids, kda_conv, kda_state, mla_cache, cache_len):
        """As `K3Model.forward_decode`: -> (logits `[B, V]`, kda_conv, kda_state, rows `[n_mla, B, 1, R]`)."""

    # Optional: `decode_(input_ids, kda_conv, kda_state, mla_cache, cache_len) -> (logits, rows)`, as
    # `K3Model.forward_decode_` (KDA state updated in place). The engine uses it when the backend has it. rows None:
    # the backend wrote each slot's new MLA row into mla_cache at cache_len itself (the engine only counts it).
    # Optional: `takes_argmax = True` (with `decode_`): the greedy step calls `decode_(..., argmax=(ids out, host ring
    # or None, active))` and the backend's own program writes each slot's argmax token to ids out and the ring (at
    # row (cache_len + active) mod rows), where the engine would run its argmax program after the step.
    # Optional: `launches_pdl = True`: the step's program is a programmatic dependent launch that waits before it
    # reads anything (the megakernel's `pdl`): the greedy step's argmax program then lets it begin early.
    # Optional: `commits_lengths = True` (with `decode_`, rows None): every step calls `decode_(..., active=active)`
    # and the backend's own program adds active to cache_len, where the engine would add it after the step.
    # Optional: `prefill_last(...)`: `prefill` returning only each sequence's last new token's logits `[B, V]`
    # (`K3Model.forward_prefill_last`); the engine uses it when the backend has it.
    # Optional: `state_views = True`: decode takes the state as strided views of the first n slots (what
    # `Engine(decode_buckets=True)` passes); programs compiled for contiguous inputs (AOTI, TensorRT) do not.
    # Optional: `check_engine(max_batch, max_len)` raises for an engine the backend cannot serve; `cuda_graphs = False`
    # keeps the engine from capturing its steps; `state_changed()` is called after the engine writes the slots' state
    # outside decode (prefill, `fill_slots`), `before_decode(state)` before every decode step, outside its CUDA
    # graph: `k3export.megakernel.backend.MegakernelBackend` uses them to keep the decode state in its own layouts.


class EagerBackend:
    """The model's own Python forward: the baseline every other backend is compared with."""

    name = "eager"
    state_views = True

    def __init__(self, model):
        load_kernels(model.device.type)
        self.model, self.config = model, model.config
        self.dtype, self.device = model.dtype, model.device
        self.max_prefill_tokens = None
        if hasattr(model, "forward_prefill_last"):
            self.prefill_last = self._prefill_last

    @torch.no_grad()
    def prefill(self, *args):
        return self.model.forward_prefill(*args)

    @torch.no_grad()
    def _prefill_last(self, *args):
        return self.model.forward_prefill_last(*args)

    @torch.no_grad()
    def decode(self, *args):
        return self.model.forward_decode(*args)


RECOMPILE_LIMIT = 64
POST_ROWS = 4          # rows of the engine's host ring of tokens (a queued step never laps a read one)


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let Dynamo keep up to `limit` compiled graphs per function (process-wide; never lowers it). The decode
    programs compile with static shapes, one graph per (rows, max_len), and Dynamo keeps them on the code object
    of `K3Model.forward_decode_`, shared by every model and engine in the process: an engine with decode buckets
    needs 1 + log2(max_batch) of them, each other engine or model adds its own. Past Dynamo's default of 8 it runs
    the function uncompiled from then on, with a log warning only: on the H200 (2026-11-30 22:45, `bench model`
    with 9 decode shapes in one process) the 9th, a B = 1 generation, took 1.35 ms per token instead of 0.87."""
    from torch._dynamo import config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


@contextlib.contextmanager
def dynamo_limit_watch():
    """Count Dynamo's "hit config.recompile_limit" warnings while the block runs (yields a dict whose "hits" is the
    count so far): past that limit a compiled function runs uncompiled, so a benchmark row timed after it is not
    the backend it names (`bench model` reports it per backend)."""
    import logging

    class Watch(logging.Handler):
        def emit(self, record):
            if "hit config." in record.getMessage():
                seen["hits"] += 1

    seen = {"hits": 0}
    log, handler = logging.getLogger("torch._dynamo.convert_frame"), Watch(logging.WARNING)
    log.addHandler(handler)
    try:
        yield seen
    finally:
        log.removeHandler(handler)


def check_inductor_options(options: dict | None) -> None:
    """Refuse Inductor options the k3 graphs are known to break under. `triton.enable_pdl` (Inductor's own kernels
    launched with PDL, loading what it deems independent of the previous kernel before their wait) gave wrong
    k3-small prefill logits next to the k3 ops on the H200 (max |diff| 6.6 vs bit-identical without it, 2026-11-30
    15:39 and 19:08 UTC, tests/test_pdl.py); our own kernels' PDL (`pdl`) is unaffected. Also refused when on in
    Inductor's global config (env TORCHINDUCTOR_ENABLE_PDL=1)."""
    from torch._inductor import config
    where = "options" if (options or {}).get("triton.enable_pdl") else \
        "TORCHINDUCTOR_ENABLE_PDL / torch._inductor.config" if getattr(config.triton, "enable_pdl", False) else None
    if where:
        raise ValueError(f"CompileBackend: Inductor's triton.enable_pdl (set in {where}) is not supported with the "
                         "k3 ops (it gave wrong k3-small logits on the H200); the k3 decode kernels use PDL already "
                         "(pdl=True)")


@contextlib.contextmanager
def _environ(**values):
    """os.environ with `values` set inside the block, as it was after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class CompileBackend(EagerBackend):
    """torch.compile of the two forwards (Inductor). The k3 ops stay opaque calls into their registered kernels.
    Compilation happens on first use per shape; `cache_dir` (the engine directory) keeps Inductor's on-disk
    caches, so a later process reuses the generated code.

    `freezing`: Inductor treats the weights as constants: it folds what depends on weights alone (e.g. the KDA
    conv kernels concatenated per step) and merges matmuls that share an input into one (its concat-linear
    patterns), at the cost of a second copy of the merged weights. Dynamo reads the `freezing` switch while it
    traces (it then keeps the weights as attributes, not graph inputs), so the calls run under
    `torch._inductor.config.patch(freezing=True)` (`torch.compile(options={"freezing": True})` froze nothing, torch
    2.13), and they trace wrapper functions of their own: on the H200 (torch 2.11, 2026-11-30 03:50)
    `compile-frozen` after `compile` of the same model in one process reused the plain graph (no compile time, same
    step time). Dynamo's cache lives on the traced code object, and the default Inductor backend of both matched;
    torch 2.13 (CPU) did not reuse it. With their own code objects the frozen calls cannot hit the plain entries.

    `pack` (default): the projections that share an input run as one GEMM (`model.packing`; in place, so the
    model runs packed for every later user too). At one decode token this removes ~9 GEMV launches per layer.
    Inductor freezing alone merged few of them (k3-small decode on the H200: 387 -> 376 kernels, 1.80 -> 1.78 ms).
    `inplace` (default): the engine's decode step runs `K3Model.forward_decode_`: each KDA layer's state and conv
    window are updated where they lie (`k3::kda_decode_inplace`, with f_b_proj folded into its kernel) instead of
    being returned, stacked and copied back.

    `fuse_norms` (default): each AttnRes mix and the RMSNorm after it as one launch (`k3::attn_res_norm`). H200,
    k3-small decode, 2026-11-30 07:13: 282 -> 258 kernels per step, B = 1 / 16 / 64: 1.147 -> 1.113, 1.952 -> 1.908,
    3.127 -> 3.083 ms (bench backend `compile-unfused` keeps them apart). `fuse_adds` (with fuse_norms): the
    residual add before each mix joins that launch (`k3::attn_res_add_norm`), so the GEMM that produced the
    sublayer output runs without cuBLAS's add epilogue, which copies p into its output first (k3-small decode,
    B = 1: 20 GEMMs with the add and 22 copies in the 07:13 profile); bench backend `compile-noadd` leaves it off.
    `options`: Inductor options for torch.compile (instead of `mode`), e.g. {"combo_kernels": True}: independent
    small kernels horizontally fused into one launch (bench backend `compile-combo`).
    `pair_experts` (default, CUDA models): each expert bank's w1 / w3 stored as the even / odd rows of one tensor
    (`packing.pair_experts`), which the MoE prefill kernel reads as one weight tile per step (H200, K3 shapes,
    8192 tokens: its gemm1 17.96 -> 16.30 ms, the op's output bit-identical); False unpairs a paired model.
    `gemv` (default, CUDA models): one-row linears (decode at B = 1) run `k3::gemv` instead of cuBLAS
    (`packing.gemv_linears`); `gemv_rows` (default 2) up to that many rows (their x rows loaded in one batch;
    decode at B = 2 then runs every linear on the GEMV with its weight prefetch instead of cuBLAS). k3-small at
    B = 2 (`scripts/ab_decode.py --backends compile,compile-gemv4`, 3 interleaved rounds of 200 steps, H200
    2026-11-30 23:42): rows 1 1.298 ms, rows 4 1.205 (faster in 3 of 3 rounds); at B = 4 rows 1 1.466, rows 4
    1.503 (slower in 2 of 3), so 3-4 rows stay on cuBLAS. Bench `compile-gemv1` / `compile-gemv4` for A/B.
    `pdl` (default, sm_90+): the decode calls (and so the CUDA graphs the Engine captures from them) run inside
    `plugins.launch.pdl(True)`: our decode kernels are launched with programmatic dependent launch, and the GEMV
    loads its weights before it waits for its predecessor. H200, k3-small decode at
    B = 1 (`bench model`, 2026-11-30 11:39 and 12:00 UTC): cuBLAS without PDL 1.006 / 1.029 ms, GEMV without PDL
    1.002 / 0.964, GEMV + PDL 0.890 / 0.895 (bench backends `compile-cublas-nopdl`, `compile-nopdl`, `compile`);
    B = 16 unchanged (1.70-1.72). `pdl_early` (default, with `pdl`): our decode
    kernels signal their dependents' launch before their wait (`launch.EARLY`): k3-small B = 1 (`scripts/ab_decode.py
    --env K3_PDL_EARLY=0,1`, 4 interleaved rounds of 200 steps) 0.886 -> 0.872 ms (2026-11-30 15:36) and 0.925 ->
    0.920 (15:49, another machine); tokens and logits bit-identical to without PDL (tests/test_pdl.py). Prefill
    stays without PDL: its 2048-token times with PDL averaged 12.96 ms over four runs, 12.55 without (run-to-run
    spread ~0.5 ms).
    `glu` (CUDA models): the MoE's down | shared gate | shared up and the dense MLP's gate | up pack with gate / up
    rows interleaved, and at one row `k3::gemv_glu` applies SiTU-GLU in the GEMV's epilogue (`packing.PackedGlu`:
    one launch fewer per MoE / MLP layer, 12 per k3-small step). `moe_pdl` (with `pdl`): the MoE decode kernels
    (router, top-k, pair GEMVs) with PDL too. `fold_norm` (CUDA models): the LatentMoE's latent RMSNorm inside its
    one-row output GEMV (`packing.NormCols`, `k3::gemv_norm`: one launch fewer per MoE layer). All three are
    correct on the H200 (tokens / bit-identity tests) and off: none made the k3-small step at B = 1 faster
    (2026-11-30 17:05, `scripts/ab_decode.py --backends`, one process, interleaved rounds: compile 0.866 ms, glu
    0.881, fold_norm 0.872, moe_pdl 0.887, all three 0.868; fold_norm + moe_pdl 0.895 at 17:26). Neither did the
    shared experts on a second CUDA stream (graph branches per MoE layer): 0.901 -> 0.922 ms (15:58; git history,
    perf.md), nor the AttnRes mix inside the next GEMV (an Inductor graph pass, `k3::gemv_mix`: 0.963 -> 0.962 ms,
    17:12; git history). `fp8_cols` (default; FP8 models on CUDA): the MoE's FP8 up and shared down projections and
    their add as one one-row launch (`packing.Fp8Cols`, `k3::fp8_linear_cols`): k3-small FP8 at B = 1 0.844 ->
    0.802 ms (2026-11-30 19:12, `scripts/ab_decode.py --fp8`, 4 of 4 interleaved rounds; bench `compile-nofp8cols`
    turns it off). The same for KDA's FP8 q|k|v|g and bf16 f_a|b (`k3::fp8_linear_runs`) was no faster (0.846 ms;
    git history)."""

    name = "compile"

    def __init__(self, model, mode: str | None = None, cache_dir=None, freezing: bool = False, pack: bool = True,
                 fuse_norms: bool = True, inplace: bool = True, fuse_adds: bool = True, options: dict | None = None,
                 pair_experts: bool = True, gemv: bool = True, pdl: bool = True, glu: bool = False,
                 moe_pdl: bool = False, fold_norm: bool = False, pdl_early: bool = True, fp8_cols: bool = True,
                 gemv_rows: int = 2):
        check_inductor_options(options)
        super().__init__(model)
        from k3export.model import packing
        packing.unpack_projections(model)          # the swaps asked for here, no others (in place: later users too)
        dev = next(model.parameters()).device
        if pair_experts and dev.type == "cuda":
            self.paired = packing.pair_experts(model)
        else:
            packing.unpair_experts(model)
            self.paired = 0
        cuda = dev.type == "cuda"
        self.packed = packing.pack_projections(model, glu=glu and cuda, fold_norm=fold_norm and cuda,
                                               fp8_cols=fp8_cols and cuda) if pack else 0
        self.fused = packing.fuse_norms(model, adds=fuse_adds) if fuse_norms else 0
        self.gemv = packing.gemv_linears(model, rows=gemv_rows) if gemv and dev.type == "cuda" else 0
        self.pdl = bool(pdl and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9)
        self.moe_pdl = moe_pdl
        self.pdl_early = bool(pdl_early and self.pdl)
        # Inductor reads TORCHINDUCTOR_CACHE_DIR when it compiles, i.e. inside the calls: set there, then restored,
        # so that other compiles in this process keep their own cache.
        self._cache_dir = None if cache_dir is None else str(Path(cache_dir).resolve() / "inductor-cache")
        self._freezing = None
        fns = (model.forward_prefill, model.forward_decode, getattr(model, "forward_decode_", None),
               getattr(model, "forward_prefill_last", None))
        if freezing:
            from torch._inductor import config
            self._freezing = config.patch(freezing=True)          # re-entered around every call

            def frozen_prefill(*args):   # own code objects: Dynamo's cache lives on the code object it traces
                return model.forward_prefill(*args)

            def frozen_decode(*args):
                return model.forward_decode(*args)

            def frozen_decode_(*args):
                return model.forward_decode_(*args)

            def frozen_prefill_last(*args):
                return model.forward_prefill_last(*args)
            fns = (frozen_prefill, frozen_decode, frozen_decode_, frozen_prefill_last)
        opts = dict(mode=mode) if options is None else dict(options=options)    # torch.compile takes one of them
        raise_recompile_limit()
        self._prefill = torch.compile(fns[0], dynamic=None, **opts)   # static first, dynamic later
        if fns[3] is not None:
            self._prefill_last_fn = torch.compile(fns[3], dynamic=None, **opts)
        self._decode = torch.compile(fns[1], dynamic=False, **opts)
        if inplace and hasattr(model, "forward_decode_"):
            self._decode_ = torch.compile(fns[2], dynamic=False, **opts)
            self.decode_ = self._decode_inplace

    def _call(self, fn, args, decode: bool = True):
        from k3export.plugins.launch import pdl
        with contextlib.ExitStack() as stack:
            if self._cache_dir is not None:
                stack.enter_context(_environ(TORCHINDUCTOR_CACHE_DIR=self._cache_dir))
            if self._freezing is not None:
                stack.enter_context(self._freezing)
            if self.pdl and decode:
                stack.enter_context(pdl(True, moe=self.moe_pdl or None, early=self.pdl_early))
            return fn(*args)

    @torch.no_grad()
    def prefill(self, *args):
        return self._call(self._prefill, args, decode=False)

    @torch.no_grad()
    def _prefill_last(self, *args):
        return self._call(self._prefill_last_fn, args, decode=False)

    @torch.no_grad()
    def decode(self, *args):
        return self._call(self._decode, args)

    @torch.no_grad()
    def _decode_inplace(self, *args):
        return self._call(self._decode_, args)


# ---------------------------------------------------------------------------------------------- the engine
def prefill_bucket(T: int) -> int:
    """The padded length a first prefill chunk of T tokens runs at when the engine buckets prefill shapes: the next
    power of two from 16 up to 512, then the next multiple of 256 (at most 12.5% padding from 2048 tokens on)."""
    if T <= 512:
        return max(16, 1 << (T - 1).bit_length())
    return -(-T // 256) * 256


def batch_bucket(n: int, max_batch: int) -> int:
    """The slots a decode step runs when the engine buckets decode batches (`Engine(decode_buckets=True)`) and its
    highest active slot is n - 1: the next power of two from n, at most max_batch."""
    return min(max_batch, 1 << max(0, n - 1).bit_length())


class Engine:
    """Preallocated slots + a backend. `prefill` puts prompts into slots; `decode` advances every active slot by
    one token. All state lives in `self.state` (never reallocated) and `self.active` `[max_batch]` bool.

    Prefill shapes: with CUDA graphs, a first chunk of a shape seen before replays a captured graph (launched from
    the host, a k3-small prefill's kernels cost more than the GPU's work). `prefill_buckets` (default: with CUDA
    graphs) right-pads that chunk to `prefill_bucket(T)` tokens (never past the backend's `max_prefill_tokens`), so
    prompts of other lengths reuse a bucket's graph; the padding is masked as any shorter prompt of a batch is
    (per-sequence lengths), and costs its share of compute. H200, k3-small `compile`, a new ~2048-token length at
    every call: 23.65 ms without buckets, 12.65 with (2026-11-30 19:43, `bench model --new-lengths`).

    Decode rows: a step runs every slot (inactive rows: junk), so an engine of 64 slots serving one request pays the
    B = 64 step (k3-small: 2.46 ms vs 0.86 at B = 1). `decode_buckets` (default: with CUDA graphs, for backends
    whose decode takes state views, i.e. eager and compile) runs only the first `batch_bucket(highest active slot +
    1)` slots (the `Generator` fills the lowest free slots first), on views of the state, with a CUDA graph per
    bucket captured at its first use (the live slots' state is saved around the capture's warm-up runs and put back;
    the graphs share the full step's memory pool; the first step of a new bucket pays the capture, and under
    `compile` Inductor's compile of that batch size). H200, k3-small `compile`, 64 slots, 1 / 3 / 17 / 64 of them
    active: 0.871 / 1.340 / 1.757 / 2.186 ms per step, 2.146-2.188 without (2026-11-30 21:13,
    `scripts/decode_buckets_probe.py`). It reads the host copies that prefill / release keep: code that writes
    `active` directly must turn it off."""

    MAX_PREFILL_GRAPHS = 32
    PREFILL_AGE_EVERY = 256        # prefill calls between halvings of the shapes' sighting counts

    def __init__(self, backend: Backend, max_batch: int, max_len: int, cuda_graphs: bool = True,
                 prefill_buckets: bool | None = None, decode_buckets: bool | None = None):
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"need max_batch >= 1 and max_len >= 2, got {max_batch}, {max_len}")
        self.backend, self.config = backend, backend.config
        self.max_batch, self.max_len = max_batch, max_len
        if hasattr(backend, "check_engine"):             # a backend with limits of its own (megakernel: B = 1)
            backend.check_engine(max_batch, max_len)
        self.device = torch.device(backend.device)
        self.state = K3State.empty(self.config, max_batch, max_len, dtype=backend.dtype, device=self.device)
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=self.device)
        # Host-side copies of `active` and `state.lengths` as prefill/decode/release leave them, so the graph path
        # can refuse a full slot without reading the device (code that writes the tensors directly bypasses them).
        self._host_active = [False] * max_batch
        self._host_lengths = [0] * max_batch
        self._ids = torch.zeros(max_batch, dtype=torch.int64, device=self.device)     # decode input buffer
        # each slot's sampling for `decode_sampled` (set_sampling): temperature, top_k, top_p, seed
        self._sampling = sampling_rows([Sampling()] * max_batch, self.device)
        self._host_sampling = [Sampling()] * max_batch
        self._draw_graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}    # (logits, rows, filtered, width) -> graph
        self._draw_pool = None
        # Each greedy / sampled step's tokens also go to a ring in host memory (pinned on a GPU), by the argmax or
        # draw program itself: the pipelined Generator reads a queued step's tokens there (`post_mark`, `posted`)
        # rather than copying them out between steps (H200 12-03, mkrun-01.log: the copy and the graph boundary
        # around it left the GPU idle ~4-15 us a token). None once the Triton argmax has failed (`argmax_error`).
        # A backend that runs several greedy steps in one program (`steps_per_launch`: the megakernel's STEP_LOOP)
        # serves `decode_greedy_steps` up to that many; the ring then holds two such launches' tokens.
        self.steps_per_launch = max(1, int(getattr(backend, "steps_per_launch", 1)))
        self._ring_rows = max(POST_ROWS, 2 * self.steps_per_launch + 2)
        self._post: torch.Tensor | None = torch.zeros(self._ring_rows, max_batch, dtype=torch.int64,
                                                      pin_memory=self.device.type == "cuda")
        self._post_view = self._post.numpy()
        self._fail_host: torch.Tensor | None = None     # (`queue_fail_read`: the backend's post_fail word, copied)
        # whether a step's ring rows are cleared before it is queued (`unposted`): where the program that posts can
        # end without posting and without raising (one the backend runs itself, or one its post_fail word stops)
        self._clear_posts = bool(getattr(backend, "takes_argmax", False)) or \
            getattr(backend, "post_fail", None) is not None
        self.argmax_error: str | None = None
        self._replayed = False                          # whether the last step was a graph's replay
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_logits: torch.Tensor | None = None
        self._greedy_graph: torch.cuda.CUDAGraph | None = None            # `decode_greedy`'s
        self._greedy_logits: torch.Tensor | None = None
        self._steps_graph: torch.cuda.CUDAGraph | None = None    # `decode_greedy_steps(steps_per_launch)`'s
        self._steps_logits: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None                      # `decode_greedy`'s logits
        self.graph_error: str | None = None
        # (a backend whose step cannot be captured says so: `cuda_graphs = False`)
        self._graphs_on = cuda_graphs and self.device.type == "cuda" and getattr(backend, "cuda_graphs", True)
        self._prefill_graphs: OrderedDict[tuple[int, int], tuple] = OrderedDict()      # least recently used first
        self._prefill_pool = None                     # one memory pool for every prefill graph (replayed in turn)
        self._prefill_seen: dict[tuple[int, int], int] = {}        # sightings per shape, halved every so often
        self._prefill_calls = 0
        self.prefill_buckets = self._graphs_on if prefill_buckets is None else bool(prefill_buckets)
        views = getattr(backend, "state_views", False)
        self.decode_buckets = self._graphs_on and views if decode_buckets is None else bool(decode_buckets)
        if self.decode_buckets and not views:
            raise ValueError(f"decode_buckets: the {backend.name} backend's decode program takes the whole state "
                             "(contiguous inputs), not views of its first slots; use eager or compile")
        self._bucket_graphs: dict[int, tuple | None] = {}     # rows -> (graph, logits, greedy graph, its logits)
        if self._graphs_on:
            self._capture()
            self._graphs_on = self.graphed

    # ------------------------------------------------------------------ prefill: prompts into slots
    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Fresh prefill of `prompts` (any lengths) into `slots`, in one batch; long prompts go in chunks of
        the backend's `max_prefill_tokens`, continuing the state. Returns each prompt's last logits `[n, V]`."""
        check_prompts(prompts, self.config.vocab_size)
        if len(slots) != len(prompts) or len(set(slots)) != len(slots):
            raise ValueError(f"need one distinct slot per prompt, got slots {slots} for {len(prompts)} prompts")
        bad = [s for s in slots if not 0 <= s < self.max_batch]
        if bad:
            raise ValueError(f"slots {bad} outside [0, {self.max_batch})")
        busy = [s for s in slots if self._host_active[s]]          # the host copy: no wait on queued steps
        if busy:
            raise ValueError(f"slots {busy} hold active sequences; release them first (a prefill would overwrite "
                             "their state)")
        too_long = [len(p) for p in prompts if len(p) > self.max_len]
        if too_long:
            raise ValueError(f"prompt of {too_long[0]} tokens exceeds the engine's max_len={self.max_len}")
        dev, n = self.device, len(prompts)
        s = self.state
        idx = torch.tensor(slots, device=dev)
        done = torch.zeros(n, dtype=torch.int64, device=dev)
        total = torch.tensor([len(p) for p in prompts], device=dev)
        chunk = self.backend.max_prefill_tokens or max(map(len, prompts))
        run = self._prefill_program()
        last = None
        for start in range(0, max(map(len, prompts)), chunk):
            parts = [p[start:start + chunk] for p in prompts]
            T = max(map(len, parts))
            if start == 0 and self.prefill_buckets:
                T = max(T, min(prefill_bucket(T), chunk if self.backend.max_prefill_tokens else 1 << 62))
            ids = torch.zeros(n, T, dtype=torch.int64, device=dev)
            for i, p in enumerate(parts):
                ids[i, :len(p)] = torch.tensor(p, dtype=torch.int64)
            lengths = torch.tensor([len(p) for p in parts], device=dev)
            if start == 0:
                logits, conv, rec, rows = self._fresh_prefill(ids, lengths)
            else:
                cache = s.mla_cache[:, idx, :start].contiguous()                      # [n_mla, n, start, R]
                logits, conv, rec, rows = run(ids, lengths, conv, rec, cache, done)
            for i, (slot, p) in enumerate(zip(slots, parts)):
                s.mla_cache[:, slot, start:start + len(p)] = rows[:, i, :len(p)].to(s.mla_cache.dtype)
            if logits.dim() == 3:                                                     # all positions' logits
                logits = logits[torch.arange(n, device=dev), (lengths - 1).clamp(min=0)]
            step_last = logits                                                        # [n, V]
            last = step_last if last is None else torch.where((lengths > 0)[:, None], step_last, last)
            done = done + lengths
        s.kda_conv[:, idx] = conv.to(s.kda_conv.dtype)
        s.kda_state[:, idx] = rec.to(s.kda_state.dtype)
        s.lengths[idx] = total
        self.active[idx] = True
        for slot, p in zip(slots, prompts):
            self._host_active[slot], self._host_lengths[slot] = True, len(p)
        self._state_changed()
        return last.clone()               # a prefill graph's output buffer is the next prefill graph's memory

    def _fresh_prefill(self, ids, lengths):
        """The first prefill chunk (zero state, no cache rows). On a GPU a shape `(n, T)` seen a second time is
        captured as a CUDA graph and replayed from then on: the inputs other than ids/lengths are zeros, so the
        graph's static buffers need no refill. The graphs share one memory pool (their outputs are consumed before
        the next prefill), so the memory they hold is about the largest one's, not the sum. At most
        `MAX_PREFILL_GRAPHS` are kept; when full, a new shape takes the least recently used graph's place only if
        it has been seen more often (sightings halved every `PREFILL_AGE_EVERY` prefills, so a new workload's
        shapes get in): shapes cycling through more than the limit then keep a stable set of graphs and run the
        rest launched, instead of paying a capture (a launched run and more) at every call."""
        n, T = ids.shape
        key = (n, T)
        seen = self._prefill_seen
        self._prefill_calls += 1
        if self._prefill_calls % self.PREFILL_AGE_EVERY == 0:
            self._prefill_seen = seen = {k: c // 2 for k, c in seen.items() if c // 2}
        seen[key] = seen.get(key, 0) + 1
        g = self._prefill_graphs.get(key)
        if g is not None:
            self._prefill_graphs.move_to_end(key)
        elif self._graphs_on and seen[key] >= 2:
            graphs = self._prefill_graphs
            if len(graphs) >= self.MAX_PREFILL_GRAPHS:
                victim = next(iter(graphs))
                if seen[key] > seen.get(victim, 0):
                    del graphs[victim]
            if len(graphs) < self.MAX_PREFILL_GRAPHS:
                g = graphs[key] = self._capture_prefill(n, T)
        if g is not None:
            graph, ids_buf, len_buf, outs, _ = g
            ids_buf.copy_(ids)
            len_buf.copy_(lengths)
            graph.replay()
            return outs
        return self._prefill_program()(ids, lengths, *self._zero_state(n))

    def _prefill_program(self):
        """The backend's prefill returning only the last tokens' logits when it has one (`prefill_last`: the
        lm_head on one row per sequence), else its full prefill."""
        return getattr(self.backend, "prefill_last", None) or self.backend.prefill

    def _zero_state(self, n):
        s = self.state
        return (s.kda_conv.new_zeros((s.kda_conv.shape[0], n) + s.kda_conv.shape[2:]),
                s.kda_state.new_zeros((s.kda_state.shape[0], n) + s.kda_state.shape[2:]),
                s.mla_cache.new_zeros(s.mla_cache.shape[0], n, 0, s.mla_cache.shape[3]),
                torch.zeros(n, dtype=torch.int64, device=self.device))

    def _capture_prefill(self, n, T):
        ids = torch.zeros(n, T, dtype=torch.int64, device=self.device)
        lengths = torch.full((n,), T, dtype=torch.int64, device=self.device)
        zeros = self._zero_state(n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        run = self._prefill_program()
        with torch.cuda.stream(side):
            run(ids, lengths, *zeros)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._prefill_pool):
            outs = run(ids, lengths, *zeros)
        self._prefill_pool = graph.pool()
        return graph, ids, lengths, outs, zeros            # zeros too: the graph reads them at every replay

    def fill_slots(self, context: int) -> None:
        """Mark every slot active holding `context` cache rows (whatever they contain): how benchmarks time a full
        batch at a context length without prefilling it. Keeps the host copies `decode_rows` and the full-slot
        check read, which writing `active` / `state.lengths` directly would bypass."""
        if not 0 <= context < self.max_len:
            raise ValueError(f"context {context}: need 0 <= context < max_len = {self.max_len}")
        self.active.fill_(True)
        self.state.lengths.fill_(context)
        self._host_active = [True] * self.max_batch
        self._host_lengths = [context] * self.max_batch
        self._state_changed()

    def _state_changed(self) -> None:
        """Tell a backend that keeps the decode state in layouts of its own (`state_changed`) that the slots' state
        tensors were written outside decode: its next step starts from them."""
        if hasattr(self.backend, "state_changed"):
            self.backend.state_changed()

    def release(self, slot: int) -> None:
        """Free a slot; its state is left as is and overwritten by the next prefill into it."""
        self.active[slot] = False
        self._host_active[slot] = False

    # ------------------------------------------------------------------ decode: one token per slot
    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens `[max_batch]` (inactive slots: any id) -> logits `[max_batch, V]` (inactive rows: junk; with
        `decode_buckets`, `[decode_rows(), V]`: every active slot's row). Active slots write their new MLA row at
        their position and advance by one; an active slot already holding `max_len` rows is refused (ValueError)
        before anything runs."""
        self._advance(host=self._graph is not None)
        self._ids.copy_(tokens)
        return self._run(greedy=False)

    @torch.no_grad()
    def decode_greedy(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`decode` that also writes each slot's argmax token into the input buffer, so the next call can take it
        from there (tokens None) without the host: a greedy loop can queue step t + 1 before it reads step t's
        tokens (`Generator` does, when every running request samples greedily). Returns the buffer of the argmax
        ids `[max_batch]` (device, overwritten by the next call: copy it out first, e.g. non-blocking to the host,
        which the stream orders before that call; or read them from the host ring, `post_mark` / `posted`). The step's logits are `last_logits`, valid until the next
        `decode` / `decode_greedy` (with CUDA graphs the step is its own graph, captured with the decode graph in
        its memory pool)."""
        self._advance(host=True, post=True)             # the host copies: reading the device would wait
        if tokens is not None:
            self._ids.copy_(tokens)
        self.last_logits = self._run(greedy=True)
        return self._ids

    @torch.no_grad()
    def decode_greedy_steps(self, steps: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`decode_greedy` `steps` times in one program of the backend (at most its `steps_per_launch`; the
        megakernel's STEP_LOOP launch), each step fed the last one's tokens on the device: the same tokens, state
        and host ring rows as `steps` calls of `decode_greedy`, with one launch (one graph replay) for them all.
        Returns the ids buffer (the last step's tokens); `post_mark` / `posted_steps` give every step's;
        `last_logits` are the last step's. Refused where a slot would pass max_len within the steps."""
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= self.steps_per_launch:
            raise ValueError(f"steps is 1..{self.steps_per_launch} (the greedy steps the {self.backend.name} "
                             f"backend runs in one program), got {steps!r}")
        if steps == 1:
            return self.decode_greedy(tokens)
        self._advance(host=True, steps=steps, post=True)
        if tokens is not None:
            self._ids.copy_(tokens)
        self.last_logits = self._run(greedy=True, steps=steps)
        return self._ids

    def set_sampling(self, slots: list[int], samplings: list[Sampling]) -> None:
        """How `decode_sampled` draws each of these slots' tokens (a slot keeps its setting until the next)."""
        if len(slots) != len(samplings):
            raise ValueError(f"need one Sampling per slot, got {len(samplings)} for slots {slots}")
        for slot, s in zip(slots, samplings):
            self._host_sampling[slot] = s
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for buf, rows in zip(self._sampling, sampling_rows(samplings, self.device)):
            buf.index_copy_(0, idx, rows)

    @torch.no_grad()
    def decode_sampled(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`decode_greedy` with each slot's token drawn as `set_sampling` says (`k3export.sampling.draw`, greedy
        where the temperature is 0), on the device: its noise is keyed by the slot's seed and its length after the
        step, so a queued step draws what a plain one would, and the next call can take the tokens from the
        buffer (tokens None). Returns the buffer `[max_batch]` (overwritten by the next call). The draw runs
        after the step's graph, as a kernel or two of its own (with a sort a row, or a top-k when every filtered slot
        sets top_k, first)."""
        self._advance(host=True, post=True)
        if tokens is not None:
            self._ids.copy_(tokens)
        logits = self._run(greedy=False)
        rows = self._host_sampling[:logits.shape[0]]
        f = (filtered(rows), width(rows, logits.shape[1]))
        graph = self._draw_graph(logits, f) if self._replayed else None       # (a graph's logits: a fixed address)
        if graph is None:
            self._draw(logits, f)
        else:
            graph.replay()
        self.last_logits = logits
        return self._ids

    def _draw(self, logits: torch.Tensor, f: tuple[bool, int | None]) -> None:
        n = logits.shape[0]
        draw(logits, *(t[:n] for t in self._sampling), self.state.lengths[:n], out=self._ids[:n], filtered=f[0],
             width=f[1], post=self._post_rows(n))

    def _draw_graph(self, logits: torch.Tensor, f: tuple[bool, int | None]) -> torch.cuda.CUDAGraph | None:
        """The draw after a graphed step as a CUDA graph of its own (one replay instead of its launches from the
        host: the sort and the program when top-k / top-p filter; H200 12-03, when the thresholds were ~15 torch ops,
        ~1.7 ms of host time a draw launched op by op, more than the step), per step graph's logits and filter
        (with its width); captured at first use (it reads the logits, the slots'
        settings and lengths, and writes only the token buffer, so no state is touched)."""
        key = (logits.data_ptr(), logits.shape[0], *f)
        if key not in self._draw_graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):                      # (warm-up: the Triton program's compile)
                    self._draw(logits, f)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._draw_pool):
                    self._draw(logits, f)
                self._draw_pool = graph.pool()
                self._draw_graphs[key] = graph
            except Exception as e:                                                    # noqa: BLE001
                self._draw_graphs[key] = None
                self._capture_failed(e, "the draw: ")
        return self._draw_graphs[key]

    def _run(self, greedy: bool, steps: int = 1) -> torch.Tensor:
        """One step (greedy: `steps` of them in one program) over `decode_rows()` slots (its graph's replay when
        captured) -> its (last step's) logits."""
        if hasattr(self.backend, "before_decode"):        # (outside the graph: e.g. load the state it keeps)
            if steps == 1:
                self.backend.before_decode(self.state)
            else:
                self.backend.before_decode(self.state, steps=steps)
        n = self.decode_rows()
        if steps > 1:
            if self._steps_graph is not None and n == self.max_batch and steps == self.steps_per_launch:
                self._replayed = True
                self._steps_graph.replay()
                return self._steps_logits
            self._replayed = False
            return self._greedy_step(n, steps)
        if n < self.max_batch:
            g = self._bucket_graph(n)
        else:
            g = None if self._graph is None else (self._graph, self._graph_logits, self._greedy_graph,
                                                  self._greedy_logits)
        self._replayed = g is not None
        if g is None:
            return self._greedy_step(n) if greedy else self._step(n)
        graph, logits = g[2:] if greedy else g[:2]
        graph.replay()
        return logits

    def _advance(self, host: bool, steps: int = 1, post: bool = False) -> None:
        """Refuse the step (`steps` steps) if an active slot already holds max_len rows (would pass it; checked on
        the host copies, or on the device tensors when `host` is False), else count it in the host copies. post:
        the step posts its tokens to the host ring; the rows it will write are cleared first where its program can end
        without posting (`unposted`)."""
        if host:
            full = [b for b in range(self.max_batch)
                    if self._host_active[b] and self._host_lengths[b] + steps - 1 >= self.max_len]
        else:
            full = torch.nonzero(self.active & (self.state.lengths >= self.max_len)).flatten().tolist()
        if full:
            raise ValueError(f"slots {full} are full (max_len={self.max_len} cache rows); a decode step would "
                             "overwrite their last row: release them or use an engine with a larger max_len")
        if post and self._clear_posts and self._post is not None:     # (the rows it posts to: `unposted`)
            act = [b for b in range(self.max_batch) if self._host_active[b]]
            if act:
                rows = np.add.outer(np.arange(1, steps + 1), [self._host_lengths[b] for b in act]) % self._ring_rows
                self._post_view[rows, np.array(act)] = UNPOSTED
        for b in range(self.max_batch):
            self._host_lengths[b] += self._host_active[b] * steps

    def decode_rows(self) -> int:
        """The slots the next decode step runs: all, or with `decode_buckets` the bucket of the highest active
        slot (host copies; no device read)."""
        if not self.decode_buckets:
            return self.max_batch
        hi = max((b for b in range(self.max_batch) if self._host_active[b]), default=0)
        return batch_bucket(hi + 1, self.max_batch)

    def _greedy_step(self, n: int | None = None, steps: int = 1) -> torch.Tensor:
        if getattr(self.backend, "takes_argmax", False):       # (megakernel: the token is taken in its launch)
            ring = None if self._post is None else self._post[:, :n]
            return self._step(n, argmax=(self._ids[:n], ring, self.active[:n]), steps=steps)
        if steps != 1:
            raise ValueError(f"the {self.backend.name} backend takes no greedy token in its program: one step a call")
        logits = self._step(n)
        self._argmax(logits)
        return logits

    def _argmax(self, logits: torch.Tensor) -> None:
        """The greedy step's tokens into the input buffer (and the host ring): Triton programs over parts of each row
        of the logits as they lie (`k3export.sampling.argmax_rows`; H200, the megakernel's stride-2 logits at B = 1:
        torch's argmax 11.8 us a token on 12-03, the program 4.1 on 12-04), the same index as torch.argmax. Should
        the program fail to build or launch (the warm-up before a capture is its first call), this warns once and
        takes torch.argmax from then on, without the ring (`argmax_error` says why)."""
        n = logits.shape[0]
        if self.argmax_error is None:
            try:
                argmax_rows(logits, out=self._ids[:n], post=self._post_rows(n),
                            early=getattr(self.backend, "launches_pdl", False))
                return
            except Exception as e:                                                  # noqa: BLE001
                self.argmax_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self._post = None
                warnings.warn(f"the Triton argmax failed ({self.argmax_error}); greedy steps take torch.argmax "
                              "instead", RuntimeWarning, stacklevel=3)
        self._ids[:n].copy_(logits.argmax(-1))

    def _post_rows(self, n: int) -> tuple | None:
        """The post of a program that writes the first n slots' tokens to the host ring: (ring, lengths), and the
        backend's `post_fail` word when it has one (set when its step failed: the program posts UNPOSTED)."""
        if self._post is None:
            return None
        fail = getattr(self.backend, "post_fail", None)
        return (self._post[:, :n], self.state.lengths[:n]) + (() if fail is None else (fail,))

    def post_mark(self) -> list[int] | None:
        """Where the greedy or sampled step just queued (`decode_greedy`, `decode_sampled`) leaves each slot's token
        in the host ring: the slots' lengths after it (None when this engine does not post: copy the returned
        buffer out instead). Read them with `posted` once the step is done (an event recorded after it)."""
        return None if self._post is None else list(self._host_lengths)

    def posted(self, mark: list[int]) -> list[int]:
        """The tokens `[max_batch]` that the step with this `post_mark` left in the host ring (valid until the
        ring's rows less one later steps: at least POST_ROWS - 1; inactive slots' entries are junk). An active slot's
        UNPOSTED (-1): the step's program never wrote it (it failed; `unposted` raises for it)."""
        return [int(self._post_view[length % self._ring_rows, b]) for b, length in enumerate(mark)]

    def unposted(self, tokens: list[int], slots) -> None:
        """Raise if any of these slots' tokens, as `posted` read them, was never written: a greedy or sampled step
        clears its rows of the host ring (`UNPOSTED`) before it is queued, so a program that failed without saying
        so (the megakernel's launch that gave up waiting) leaves them so instead of an earlier step's tokens. The
        backend's own `check` speaks first (it names what failed)."""
        missing = [b for b in slots if tokens[b] == UNPOSTED]
        if missing:
            self._failed(f"left no token in the host ring for slot(s) {missing}: it did not run to its end")

    def _failed(self, what: str) -> None:
        """Raise for a decode program that failed: the backend's `check` first (it names the failure), else this."""
        check = getattr(self.backend, "check", None)
        if check is not None:
            check()
        raise RuntimeError(f"the {self.backend.name} backend's decode program {what}")

    def queue_fail_read(self) -> None:
        """After a step is queued whose tokens or logits the host will read from the device (not the host ring): a
        copy of the backend's `post_fail` word into host memory, queued behind it, for `failed_check`."""
        fail = getattr(self.backend, "post_fail", None)
        if fail is None:
            return
        if self._fail_host is None:
            self._fail_host = torch.zeros(1, dtype=torch.int32, pin_memory=fail.is_cuda)
        self._fail_host.copy_(fail.reshape(-1)[:1], non_blocking=True)

    def failed_check(self) -> None:
        """Once what the host read after `queue_fail_read` has arrived (a sync): raise if the backend's step had
        failed (its `check` names the failure), so that its stale logits give no request a token."""
        if self._fail_host is not None and int(self._fail_host[0]):
            self._fail_host.zero_()
            self._failed("failed (its post_fail word is set)")

    def posted_steps(self, mark: list[int], steps: int) -> list[list[int]]:
        """`posted` for `decode_greedy_steps(steps)`: each step's tokens `[max_batch]`, in order (the last is
        `posted(mark)`)."""
        if not 1 <= steps <= self._ring_rows // 2:
            raise ValueError(f"the host ring holds {self._ring_rows} rows: read at most {self._ring_rows // 2} "
                             f"steps a mark, not {steps}")
        return [self.posted([length - (steps - 1 - j) for length in mark]) for j in range(steps)]

    def _rows(self, n: int | None) -> tuple[torch.Tensor, ...]:
        """ids, KDA conv, KDA state, MLA cache, lengths, active of the first n slots (the tensors themselves for
        all slots, so the full step's program sees what it always saw)."""
        s = self.state
        full = (self._ids, s.kda_conv, s.kda_state, s.mla_cache, s.lengths, self.active)
        if n is None or n == self.max_batch:
            return full
        return tuple(t[:n] if t.dim() == 1 else t[:, :n] for t in full)

    def _step(self, n: int | None = None, argmax: tuple | None = None, steps: int = 1) -> torch.Tensor:
        """The decode program and its commit over the first n slots (default all); every op here is capturable
        (no host sync, fixed addresses). argmax: (ids out, host ring or None, active), for a backend that
        `takes_argmax` in its own program (greedy steps)."""
        ids, conv, rec, cache, lengths, active = self._rows(n)
        commits = False
        if hasattr(self.backend, "decode_"):                       # the KDA state is updated where it lies
            kw = {} if argmax is None else {"argmax": argmax}
            if steps != 1:
                kw["steps"] = steps
            commits = getattr(self.backend, "commits_lengths", False)
            if steps != 1 and not commits:
                raise RuntimeError(f"{type(self.backend).__name__} runs several steps a program, so it must advance "
                                   "the lengths itself (commits_lengths)")
            if commits:                                            # (megakernel: the launch adds active itself)
                kw["active"] = active
            logits, rows = self.backend.decode_(ids, conv, rec, cache, lengths, **kw)
            if commits and rows is not None:
                raise RuntimeError(f"{type(self.backend).__name__} commits the lengths in its step, so it must "
                                   "write the new MLA rows into the cache itself (decode_ returned rows)")
        else:
            logits, new_conv, new_rec, rows = self.backend.decode(ids, conv, rec, cache, lengths)
            conv.copy_(new_conv)
            rec.copy_(new_rec)
        n_mla, B, _, R = cache.shape
        if n_mla and rows is not None:                             # (None: the backend wrote them there)
            pos = lengths.clamp(max=self.max_len - 1).view(1, B, 1, 1).expand(n_mla, B, 1, R)
            cache.scatter_(2, pos, rows.to(cache.dtype))
        if not commits:
            lengths.add_(active)
        return logits

    def _bucket_graph(self, n: int) -> tuple | None:
        """The CUDA graphs of the n-slot step and its greedy form, captured at first use (None without graphs or
        when capture fails: the step then runs uncaptured). The warm-up runs advance the state of the first n
        slots, so it is saved before and put back after."""
        if not self._graphs_on:
            return None
        if n not in self._bucket_graphs:
            saved = [t.clone() for t in self._rows(n)[:5]]
            try:
                self._bucket_graphs[n] = self._capture_step(n, pool=self._graph.pool())
            except Exception as e:                                                    # noqa: BLE001
                self._bucket_graphs[n] = None
                self._capture_failed(e, f"{n} slots: ")
            for t, v in zip(self._rows(n)[:5], saved):
                t.copy_(v)
        return self._bucket_graphs[n]

    def _capture_failed(self, e: Exception, where: str = "") -> None:
        """Record why a capture failed (`graph_error`: its first line) and let the aborted capture's work drain."""
        self.graph_error = f"{where}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        torch.cuda.synchronize()

    def _capture_step(self, n: int | None = None, pool=None) -> tuple:
        """(graph, logits, greedy graph, greedy logits) of the n-slot step (default all), after warm-up runs on a
        side stream; the two graphs share one memory pool (never replayed at the same time)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(n)
            self._greedy_step(n)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._step(n)
        greedy = torch.cuda.CUDAGraph()
        with torch.cuda.graph(greedy, pool=graph.pool()):
            greedy_logits = self._greedy_step(n)
        return graph, logits, greedy, greedy_logits

    def _capture(self) -> None:
        """Capture `_step` for this batch size, and `_greedy_step` (`decode_greedy`'s). Warm-up runs touch the
        state, so it is zeroed afterwards. If the backend cannot be captured (a host sync inside an op), decoding
        stays uncaptured and `graph_error` says why."""
        s = self.state
        try:
            self._graph, self._graph_logits, self._greedy_graph, self._greedy_logits = self._capture_step()
            self.last_logits = self._greedy_logits
        except Exception as e:                                                        # noqa: BLE001
            self._graph, self._graph_logits, self._greedy_graph, self._greedy_logits = None, None, None, None
            self.last_logits = None
            self._capture_failed(e)
        if self._graph is not None and self.steps_per_launch > 1:
            try:                                # (the program of steps_per_launch greedy steps: one graph more)
                k = self.steps_per_launch
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._greedy_step(None, k)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._graph.pool()):
                    logits = self._greedy_step(None, k)
                self._steps_graph, self._steps_logits = graph, logits
            except Exception as e:                                                    # noqa: BLE001
                self._steps_graph = self._steps_logits = None
                self._capture_failed(e, f"{self.steps_per_launch} steps a program: ")
        for t in (s.kda_conv, s.kda_state, s.mla_cache, s.lengths):
            t.zero_()

    @property
    def graphed(self) -> bool:
        return self._graph is not None


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Request:
    """One generation request. `tokens` collects the new tokens; `finish` is None, 'stop' or 'length'."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_tokens: tuple[int, ...] = ()
    id: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    slot: int | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None


class Generator:
    """Continuous batching over an `Engine`: requests wait in a queue, join free slots (prefilled together),
    decode together at their own positions, and leave on a stop token or after max_new_tokens. Sampling and
    stopping follow `k3export.generate.generate`: a request's tokens are drawn from noise keyed by its seed and
    length (`k3export.sampling`), so they do not depend on what else shares the batch."""

    def __init__(self, engine: Engine, on_token: Callable[[Request, int], None] | None = None,
                 pipeline: bool = True, steps_per_launch: int | None = None):
        self.engine, self.on_token = engine, on_token
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}                       # slot -> request
        # pipeline: while no request can join, queue decode step t + 1 (its input the tokens that step t wrote on
        # the device: `Engine.decode_greedy` when every running request is greedy, else `decode_sampled`) before
        # reading step t's tokens, so the host's work overlaps the GPU's. Tokens and stops are read one step late
        # (a request that stopped costs one discarded step; on_token fires one step later); the tokens are those
        # of the plain loop.
        # H200, k3-small bf16, `compile`, B = 1, 1024-token prompt, 64 greedy tokens (`bench model
        # --generate-tokens 64`, 2026-11-30 14:08 UTC): inter-token latency 1.003 ms plain, 0.884 pipelined (the
        # engine's own decode call 0.881 in the same run): the default.
        self.pipeline = pipeline
        # steps_per_launch (default: the engine's; the megakernel with `steps_per_launch` > 1): a pipelined greedy
        # step runs that many steps in one program while every running request has room for them all (its
        # max_new_tokens), else one. A request that stops early discards the steps after its stop token (their
        # state is released with the slot); the tokens are those of the plain loop.
        k = engine.steps_per_launch if steps_per_launch is None else steps_per_launch
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= engine.steps_per_launch:
            raise ValueError(f"steps_per_launch is 1..{engine.steps_per_launch} (the engine's), got {k!r}")
        self.steps_per_launch = k
        # (tokens' place on the host, the event after the step, its requests, the steps it runs)
        self._inflight: tuple[object, object, list[tuple[int, Request]], int] | None = None

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
               stop_tokens: tuple[int, ...] = ()) -> Request:
        e = self.engine
        check_prompts([prompt], e.config.vocab_size)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prompt) + max_new_tokens - 1                     # the last sampled token is never fed back
        if need > e.max_len:
            raise ValueError(f"a {len(prompt)}-token prompt with max_new_tokens={max_new_tokens} needs {need} "
                             f"cache rows; the engine holds max_len={e.max_len}")
        r = Request(list(prompt), max_new_tokens, sampling, tuple(stop_tokens))
        self.waiting.append(r)
        return r

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> list[Request]:
        """Admit waiting requests into free slots (one prefill), then one decode step for the running ones.
        Returns the requests that finished during this step (pipelined: whose last token this step read)."""
        finished: list[Request] = []
        if self._pipelinable():
            return self._step_pipelined(finished)
        self._drain(finished)
        free = [s for s in range(self.engine.max_batch) if s not in self.running]
        joining = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        if joining:
            slots = free[:len(joining)]
            logits = self.engine.prefill(slots, [r.prompt for r in joining])
            self.engine.set_sampling(slots, [r.sampling for r in joining])
            for r, slot in zip(joining, slots):
                r.slot = slot
                self.running[slot] = r
            self._emit(joining, logits, finished)
        if self.running:
            ids = torch.zeros(self.engine.max_batch, dtype=torch.int64)
            for slot, r in self.running.items():
                ids[slot] = r.tokens[-1]
            reqs = list(self.running.values())
            if all(r.sampling.temperature == 0 for r in reqs):
                logits = self.engine.decode(ids.to(self.engine.device))
                self.engine.queue_fail_read()
                self._emit(reqs, logits[torch.tensor([r.slot for r in reqs], device=logits.device)], finished,
                           check=True)
            else:                               # (the draw on the device, as a queued step's: its graph on a GPU)
                out = self.engine.decode_sampled(ids.to(self.engine.device))
                self.engine.queue_fail_read()
                toks = out.tolist()
                self.engine.failed_check()
                self._accept(reqs, [toks[r.slot] for r in reqs], finished)
        return finished

    def _pipelinable(self) -> bool:
        """Whether the next decode step may be queued before the one in flight is read: no request can join (no
        free slot or no one waiting), and the token in flight finishes no one by length (the queued step would
        then write past the cache rows that request asked for)."""
        if not (self.pipeline and self.running):
            return False
        pending = 0 if self._inflight is None else self._inflight[3]
        if self.waiting and len(self.running) < self.engine.max_batch:
            return False
        return all(len(r.tokens) + pending < r.max_new_tokens for r in self.running.values())

    def _step_pipelined(self, finished: list[Request]) -> list[Request]:
        e = self.engine
        greedy = all(r.sampling.temperature == 0 for r in self.running.values())
        step = e.decode_greedy if greedy else e.decode_sampled
        steps, k = 1, self.steps_per_launch
        pending = 0 if self._inflight is None else self._inflight[3]
        if greedy and k > 1 and all(len(r.tokens) + pending + k <= r.max_new_tokens for r in self.running.values()):
            steps = k

            def step(tokens=None):
                return e.decode_greedy_steps(k, tokens)
        if self._inflight is None:                                   # the inputs come from the host once
            ids = torch.zeros(e.max_batch, dtype=torch.int64)
            for slot, r in self.running.items():
                ids[slot] = r.tokens[-1]
            out = step(ids.to(e.device))
        else:
            out = step()
        cuda = out.is_cuda
        host = e.post_mark()                      # (the step's program leaves its tokens in host memory itself)
        if host is None and steps > 1:
            raise RuntimeError("several steps a program need the engine's host ring (its tokens are posted there)")
        if host is None:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
            host.copy_(out, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        prev, self._inflight = self._inflight, (host, done, list(self.running.items()), steps)
        if prev is not None:
            self._read(prev, finished)
        if not self.running:                     # the step just queued serves only requests that have finished
            self._inflight = None
        return finished

    def _read(self, inflight, finished: list[Request]) -> None:
        host, done, reqs, steps = inflight
        if done is not None:
            done.synchronize()
        if steps > 1:
            rows = self.engine.posted_steps(host, steps)
        else:
            rows = [self.engine.posted(host) if isinstance(host, list) else host.tolist()]
        for toks in rows:                        # (a request that stops takes none of the later steps' tokens)
            live = [(slot, r) for slot, r in reqs if not r.done]
            if isinstance(host, list):
                self.engine.unposted(toks, [slot for slot, _ in live])
            self._accept([r for _, r in live], [toks[slot] for slot, _ in live], finished)

    def _drain(self, finished: list[Request]) -> None:
        """Read the step in flight, if any (before anything that needs every token on the host)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._read(inflight, finished)

    def _emit(self, reqs: list[Request], logits: torch.Tensor, finished: list[Request], check: bool = False) -> None:
        """Draw one token per request from its logits row `[len(reqs), V]` (counter: its length, prompt and
        tokens so far, as `decode_sampled` keys it); retire the finished. check: the logits are a decode step's
        after `queue_fail_read` (`failed_check` before the tokens are taken)."""
        counter = torch.tensor([len(r.prompt) + len(r.tokens) for r in reqs])
        toks = sample(logits, [r.sampling for r in reqs], counter).tolist()
        if check:
            self.engine.failed_check()
        self._accept(reqs, toks, finished)

    def _accept(self, reqs: list[Request], toks: list[int], finished: list[Request]) -> None:
        """Append each request's new token; retire those that stop or reach max_new_tokens."""
        for r, t in zip(reqs, toks):
            r.tokens.append(t)
            if self.on_token:
                self.on_token(r, t)
            if t in r.stop_tokens:
                r.finish = "stop"
            elif len(r.tokens) >= r.max_new_tokens:
                r.finish = "length"
            if r.done:
                self.engine.release(r.slot)
                del self.running[r.slot]
                finished.append(r)

    def run(self) -> None:
        while not self.idle:
            self.step()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_tokens: tuple[int, ...] = ()) -> list[list[int]]:
        """Same contract as `k3export.generate.generate`: new tokens per prompt (stop token kept)."""
        reqs = [self.submit(p, max_new_tokens, sampling, stop_tokens) for p in prompts]
        self.run()
        return [r.tokens for r in reqs]


# ---------------------------------------------------------------------------------------------- CLI
def latency_line(t0: float, stamps: dict[int, list[float]]) -> str:
    """What `k3export run` reports about latency: the median time to first token (from t0, when every request was
    submitted; first tokens wait for the prefill of everything ahead of them) and the median time between tokens
    of a request, from the host timestamps of the tokens as the generator handed them out."""
    import statistics
    first = [s[0] - t0 for s in stamps.values() if s]
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    line = f"time to first token: median {statistics.median(first) * 1e3:.1f} ms" if first else "no tokens"
    if gaps:
        line += f"; between tokens: median {statistics.median(gaps) * 1e3:.2f} ms ({len(gaps)} gaps)"
    return line


def _run_command():
    import time

    import click

    from k3export.commands import check_device, generation_options, parse_ids, parse_stop

    @click.command("run")
    @click.option("--engine", "engine_dir", required=True, type=click.Path(file_okay=False),
                  help="Engine directory from `k3export build`.")
    @generation_options
    @click.option("--max-batch", type=int, default=None,
                  help="Slots (default: the number of prompts, at most the engine's batch maximum).")
    @click.option("--device", default=None, help="Default: the device the engine was built for.")
    @click.option("--no-cuda-graphs", is_flag=True, help="Decode without CUDA-graph capture.")
    @click.option("--no-pipeline", is_flag=True,
                  help="Read each decode step's tokens before queueing the next (by default steps are queued one "
                       "ahead, greedy or sampled: the same tokens, the host's work off the GPU's path).")
    @click.option("--decode-buckets/--no-decode-buckets", default=None,
                  help="Decode only the slots up to the highest active one, rounded up to a power of two, instead "
                       "of every slot (eager / compile engines; default: on with CUDA graphs).")
    def run(engine_dir, ids_text, max_new_tokens, temperature, top_k, top_p, seed, stop_text, max_batch, device,
            no_cuda_graphs, no_pipeline, decode_buckets):
        """Generate from an engine directory (any backend) with continuous batching: the prompts queue for
        `--max-batch` slots, are prefilled into free slots and decoded together."""
        from k3export.build import EngineError, load_engine
        prompts = parse_ids(ids_text)
        stop = parse_stop(stop_text)
        if device is not None:
            check_device(device)
        try:
            sampling = Sampling(temperature, top_k, top_p, seed)
            max_len = max(map(len, prompts)) + max_new_tokens
            t0 = time.perf_counter()
            engine = load_engine(engine_dir, max_batch or len(prompts), max_len, device, not no_cuda_graphs,
                                 fit_batch=max_batch is None, decode_buckets=decode_buckets)
            t_load = time.perf_counter() - t0
            stamps: dict[int, list[float]] = {}
            gen = Generator(engine, on_token=lambda r, t: stamps.setdefault(r.id, []).append(time.perf_counter()),
                            pipeline=not no_pipeline)
            t0 = time.perf_counter()
            out = gen.generate(prompts, max_new_tokens, sampling, stop)
            dt = time.perf_counter() - t0
        except (EngineError, ValueError) as e:
            raise click.ClickException(str(e))
        for p, o in zip(prompts, out):
            click.echo(f"{p} -> {o}")
        m = json.loads((Path(engine_dir) / "manifest.json").read_text())       # checked by load_engine
        precision = m["precision"] + (" + FP8 E4M3 (" + m["quant"]["scales"] + ")" if m.get("quant") else "")
        click.echo(f"{engine.backend.name} engine {engine_dir} ({precision}) on {engine.device} (loaded in "
                   f"{t_load:.2f}s, "
                   f"{engine.max_batch} slots, CUDA graph: {engine.graphed or engine.graph_error or 'off'}, "
                   f"pipelined decode: {'off' if no_pipeline else 'on'}, decode buckets: "
                   f"{'on' if engine.decode_buckets else 'off'}): "
                   f"{sum(map(len, out))} tokens in {dt:.2f}s")
        click.echo(latency_line(t0, stamps))

    return run


run_command = _run_command()
