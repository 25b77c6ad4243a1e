"""AOT launch contracts of the FP8 MoE chain (`plugins/moe/trt_fp8.py`): `k3::moe_routed_fp8` as TensorRT plugins,
the bf16 chain's routing / align / combine launches around the FP8 op's own expert kernels, weight-only up to
4 pairs per expert at max_tokens, W8A8 (E4M3 tensor cores) beyond.

CPU: the PTX for sm_90 compiles for every launch at K3 shapes (896 experts, top-16, L 3584, I 3072, bf16) and at a
tiny shape, each contract's parameters match its PTX entry; grids, constants, warps and scalars equal what the
op's launchers pass on the same path (`fp8_moe_kernels.moe_fp8_wo` "blocks" / `moe_fp8_w8a8` "ptr", routed by
`kernels.route_fwd` as the bf16 chain routes; recorded on meta tensors); `register_plugins` against the
`tensorrt.plugin` stand-in builds both regimes on a symbolic N. Interpreter (TRITON_INTERPRET=1, subprocess): the
weight-only chain's wrappers == the op's launchers bit for bit and vs the fp64 reference (the W8A8 chain is not
run there: the interpreter's fp32 -> E4M3 conversion is wrong at binade carries, `fp8_kernels`, so the op itself
runs other code under it). GPU (`cuda`): the PTX through the CUDA driver (cupy) at K3 size vs the op's launchers
and the contract's references. TensorRT itself: skipped, not installable here.

Error = max |chain - reference| / max |reference| on the same inputs.
"""

from __future__ import annotations

import json
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from test_moe_kernels import FP16_BOUND, FP32_BOUND, SITU
from test_moe_trt import (CHAIN_BOUND, K3, TINY, TRT_SKIP, _Recorder, _rel, build_on_stand_in, check_built,
                           check_launch, clear_token_errors, run_chain)
from trt_standin import Sym, install

# vs the contract's references on the GPU: those of tests/test_fp8.py, with their reasons there (same kernels).
BF16_OUT_BOUND = 4e-3            # weight-only vs `moe_fp8_wo_ref`
EXPERT_GPU_BOUND = 2e-2          # W8A8 vs `moe_fp8_sorted`
# With max_tokens > N the chain's router may run unsplit where the op's is split over d (lean routing up to
# ROUTE_SPLIT_MAX_N = 64 tokens): the routing weights then differ by fp32 ulps, which can flip the final bf16
# rounding of an element of u, at most one bf16 ulp: 2^-7 of max|u|. Measured on the H200 (2026-12-01 03:30):
# (5, PTX for 224) 1.49e-3, (64, PTX for 256) 2.75e-3; with max_tokens = N, and at (300, PTX for 16384) where both
# routers are unsplit, 0 (bit-equal).
ROUTE_ORDER_BOUND = 2.0 ** -7
WO_CHAIN = ["k3::moe_router", "k3::moe_topk", "k3::moe_align", "k3::moe_fp8_wo_gemm1", "k3::moe_fp8_wo_gemm2",
            "k3::moe_combine"]
W8A8_CHAIN = ["k3::moe_router", "k3::moe_topk", "k3::moe_align", "k3::moe_fp8_quant", "k3::moe_fp8_gemm1",
              "k3::moe_fp8_gemm2", "k3::moe_combine"]
CHUNKED = ["k3::moe_count", "k3::moe_plan", "k3::moe_scatter"]
W8A8_PREFILL_CHAIN = W8A8_CHAIN[:2] + CHUNKED + W8A8_CHAIN[3:]


def _steps(N, shape, dtype, **kw):
    from k3export.plugins.moe import trt_fp8
    return trt_fp8.fp8_chain_steps(N, shape["d"], shape["E"], shape["top_k"], shape["L"], shape["I"], dtype, **kw)


def _inputs(N, shape, dtype):
    """name -> (shape, dtype) of the chain's inputs and output (per-channel scales)."""
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    return dict(x=((N, d), dtype), gate_weight=((E, d), dtype), bias=((E,), f32), z=((N, L), dtype),
                w13=((E, 2 * I, L), e4m3), w2=((E, L, I), e4m3), w13_scale=((E, 2 * I), f32), w2_scale=((E, L), f32),
                z_scale=((), f32), h_scale=((), f32), u=((N, L), dtype))


# ---------------------------------------------------------------------------------------------- PTX (CPU)
CASES = {"k3-bf16-wo-n1": (1, K3, torch.bfloat16, WO_CHAIN), "k3-bf16-w8a8-n256": (256, K3, torch.bfloat16,
                                                                                     W8A8_CHAIN),
         "k3-bf16-w8a8-n16384": (16384, K3, torch.bfloat16, W8A8_PREFILL_CHAIN),
         "tiny-fp16-wo-n5": (5, TINY, torch.float16, WO_CHAIN), "tiny-fp16-w8a8-n20": (20, TINY, torch.float16,
                                                                                        W8A8_CHAIN),
         "tiny-bf16-w8a8-n1100": (1100, TINY, torch.bfloat16, W8A8_PREFILL_CHAIN)}


@pytest.fixture(scope="module")
def launches():
    return {c: [(s, s.launch()) for s in _steps(*args[:3])] for c, args in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_ptx_compiles_and_params_match_the_entry(launches, case):
    """The chain for the regime of N (weight-only up to 4 pairs per expert, W8A8 beyond; the chunked align past
    4096 pairs); every launch's PTX targets sm_90 and its entry has exactly the contract's parameters (inputs...,
    scalars..., outputs...; pointer = .u64, i32 = .u32) plus Triton's two trailing scratch pointers."""
    import re

    from k3export.plugins.aot import _entry_params
    assert [s.plugin for s, _ in launches[case]] == CASES[case][3]
    for step, launch in launches[case]:
        ptx = launch.kernel.ptx
        assert ".target sm_90" in ptx and launch.kernel.name == step.fn.__name__
        assert launch.block == (step.num_warps * 32, 1, 1) and launch.kernel.shared_mem <= 227 * 1024
        names = [n for n, _ in step.params]
        assert names == [p.name for p in step.fn.params if not p.is_constexpr]
        assert names == [*step.inputs, *step.scalars, *step.outputs], step.plugin
        entry = re.search(r"\.entry\s+" + launch.kernel.name + r"\s*\((.*?)\)", ptx, re.S).group(1)
        decls = [d.strip() for d in entry.split(",")]
        assert len(_entry_params(ptx, launch.kernel.name)) == len(decls) == len(step.params) + 2, step.plugin
        for (n, t), decl in zip(step.params, decls):
            assert decl.startswith(".param .u64 .ptr" if t.startswith("*") else ".param .u32"), (step.plugin, n)


# ---------------------------------------------------------------------------------------------- op launchers
# kernel param name -> chain tensor name, per kernel (where they differ)
_TENSOR_NAMES = {"moe_router_fwd_kernel": {"s": "part", "g": "gate_weight"},
                 "moe_fp8_wo_gemm1_fwd_kernel": {"s13": "w13_scale"}, "moe_fp8_wo_gemm2_fwd_kernel": {"s2": "w2_scale"},
                 "fp8_quant_fwd_kernel": {"x": "z", "scale": "z_scale", "xq": "zq", "row_scale": "z_rows"},
                 "moe_fp8_gemm1_fwd_kernel": {"z": "zq", "s13": "w13_scale", "h": "hq"},
                 "moe_fp8_gemm2_fwd_kernel": {"h": "hq", "s2": "w2_scale"}}
_ATOMIC_ALIGN = ("moe_count_fwd_kernel", "moe_scan_fwd_kernel", "moe_scatter_fwd_kernel")
_PLUGIN = {"moe_router_fwd_kernel": "k3::moe_router", "moe_topk_fwd_kernel": "k3::moe_topk",
           "moe_align_fwd_kernel": "k3::moe_align", "fp8_quant_fwd_kernel": "k3::moe_fp8_quant",
           "moe_fp8_wo_gemm1_fwd_kernel": "k3::moe_fp8_wo_gemm1", "moe_fp8_wo_gemm2_fwd_kernel": "k3::moe_fp8_wo_gemm2",
           "moe_fp8_gemm1_fwd_kernel": "k3::moe_fp8_gemm1", "moe_fp8_gemm2_fwd_kernel": "k3::moe_fp8_gemm2",
           "moe_combine_fwd_kernel": "k3::moe_combine"}


def _op_launches(N, shape, dtype, monkeypatch, max_tokens=None):
    """What the op's launchers run for the chain's regime and routing on meta tensors (nothing runs)."""
    import k3export.fp8_kernels as FK
    import k3export.fp8_moe_kernels as F
    from k3export.plugins.moe import kernels, trt, trt_fp8
    log = []
    for mod, names in ((kernels, ("moe_router_fwd_kernel", "moe_topk_fwd_kernel", "moe_align_fwd_kernel",
                                  *_ATOMIC_ALIGN)),
                       (F, ("moe_fp8_wo_gemm1_fwd_kernel", "moe_fp8_wo_gemm2_fwd_kernel", "moe_fp8_gemm1_fwd_kernel",
                            "moe_fp8_gemm2_fwd_kernel", "moe_combine_fwd_kernel")),
                       (FK, ("fp8_quant_fwd_kernel",))):
        for name in names:
            monkeypatch.setattr(mod, name, _Recorder(getattr(mod, name), log))
    monkeypatch.setattr(kernels, "_tma_rows_ok", lambda *ts: False)
    t = {n: torch.empty(s, device="meta", dtype=dt) for n, (s, dt) in _inputs(N, shape, dtype).items()}
    k, E, mt = shape["top_k"], shape["E"], max_tokens or N
    cfg = trt.chain_tiles(mt, k, dtype, E)
    ids, w, _ = kernels.route_fwd(t["x"], t["gate_weight"], t["bias"], k, True, 2.5, cfg.lean_route,
                                  wide=cfg.wide_route)
    experts = (t["z"], t["w13"], t["w2"], t["w13_scale"], t["w2_scale"])
    if trt_fp8.weight_only(mt, k, E):
        F.moe_fp8_wo(ids, w, *experts, k, SITU["beta"], SITU["linear_beta"], F.EXPERT_WO_TILINGS["blocks"])
    else:
        F.moe_fp8_w8a8(ids, w, *experts, t["z_scale"], t["h_scale"], k, SITU["beta"], SITU["linear_beta"],
                       trt_fp8.w8a8_tiles(mt, k, E))
    return log


@pytest.mark.parametrize("N,shape,dtype", [(1, K3, torch.bfloat16), (5, K3, torch.bfloat16),
                                           (224, K3, torch.bfloat16), (225, K3, torch.bfloat16),
                                           (256, K3, torch.bfloat16), (4096, K3, torch.bfloat16),
                                           (3, TINY, torch.float16), (16, TINY, torch.float16),
                                           (20, TINY, torch.bfloat16), (1100, TINY, torch.float16)])
def test_contract_equals_the_op_launchers(N, shape, dtype, monkeypatch):
    """Grid, num_warps / num_stages, every scalar and constant, and every tensor's numel and dtype equal what the
    op's launchers pass on the chain's path (224 tokens: the last weight-only N at K3, 3584 pairs; 225 the first
    W8A8 one). Past 4096 pairs the op aligns with atomics, the chain with the chunked align (the same plan up to the
    order of rows within an expert, which no row's result depends on): the align launches are compared below
    that only."""
    from k3export.plugins.moe import trt_fp8
    log = [e for e in _op_launches(N, shape, dtype, monkeypatch) if e[0] not in _ATOMIC_ALIGN]
    steps = {s.plugin: s for s in _steps(N, shape, dtype, scaling=2.5, **SITU) if s.plugin not in CHUNKED}
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    assert list(steps)[3 if N * k <= 4096 else 2] == ("k3::moe_fp8_wo_gemm1" if N * k <= 4 * E else "k3::moe_fp8_quant")
    assert sorted(_PLUGIN[e[0]] for e in log) == sorted(steps), ([e[0] for e in log], list(steps))
    chain = {**trt_fp8.fp8_chain_intermediates(N, E, k, L, I, dtype), **_inputs(N, shape, dtype)}
    for launch in log:
        check_launch(launch, steps[_PLUGIN[launch[0]]], chain, _TENSOR_NAMES)


def test_regime_and_block_rows_follow_max_tokens():
    """The regime is the op's rule at max_tokens, whatever N runs: 224 K3 tokens (3584 pairs, 4 per expert) are
    weight-only, 225 W8A8; a PTX for 256 tokens run on 1 token is W8A8; the align plugins get the regime's rows."""
    from k3export.plugins.moe import trt_fp8
    E, k = K3["E"], K3["top_k"]
    assert [s.plugin for s in _steps(224, K3, torch.bfloat16)][3] == "k3::moe_fp8_wo_gemm1"
    assert [s.plugin for s in _steps(1, K3, torch.bfloat16, max_tokens=225)][3] == "k3::moe_fp8_quant"
    assert trt_fp8.block_rows(224, k, E) == 16 and trt_fp8.block_rows(225, k, E) == 64        # "ptr"
    assert trt_fp8.block_rows(3583, k, E) == 64 and trt_fp8.block_rows(3584, k, E) == 128     # 64 rows per expert
    align = _steps(1, K3, torch.bfloat16, max_tokens=256)[2]
    assert align.plugin == "k3::moe_align" and align.constexprs["BLOCK_M"] == 64
    per_tensor = _steps(5, TINY, torch.float16, per_channel=False)
    assert per_tensor[3].constexprs["PER_CHANNEL"] is False and per_tensor[3].scalars["stride_se"] == 1


def test_tensorrt_plugins():
    pytest.importorskip("tensorrt", reason=TRT_SKIP)
    from k3export.plugins.moe import trt_fp8
    assert trt_fp8.register_plugins()


@pytest.mark.parametrize("max_tokens", [3, 20, 1100])
def test_plugin_registration_against_a_stand_in(monkeypatch, max_tokens):
    """Both registrations (`trt.register_plugins` for routing / align / combine, `trt_fp8.register_plugins` for the
    experts) on the stand-in, then the chain built on a symbolic N with the attributes the ONNX rewrite writes:
    each plugin's output descriptors feed the next, and at N = 1 and max_tokens every output shape / dtype, grid,
    block, shared memory, kernel name / PTX and extra argument equals the int contract. max_tokens 3: weight-only
    (12 pairs over 16 experts); 20: W8A8 with the one-program align; 1100: W8A8 with the chunked align."""
    from k3export.plugins.moe import trt, trt_fp8
    fake_trt, trtp = install(monkeypatch)
    assert trt.register_plugins() and trt_fp8.register_plugins()
    d, E, k, L, I = (TINY[n] for n in ("d", "E", "top_k", "L", "I"))
    N = Sym(lambda n: n)
    attrs = dict(max_tokens=max_tokens, top_k=k, renormalize=True, scaling=2.5, num_experts=E,
                 block_rows=trt_fp8.block_rows(max_tokens, k, E), **SITU)
    T = trtp.TensorDesc
    dtypes = {torch.float16: fake_trt.float16, torch.float32: fake_trt.float32, torch.int32: fake_trt.int32,
              torch.float8_e4m3fn: fake_trt.DataType.FP8}
    descs = {n: T(tuple(N if x == "N" else x for x in shp), dtypes[dt]) for n, (shp, dt) in
             _inputs("N", TINY, torch.float16).items()}
    built = build_on_stand_in(trtp, _steps(1, TINY, torch.float16, max_tokens=max_tokens), descs, attrs)
    for n in (1, max_tokens):
        inter = {**trt_fp8.fp8_chain_intermediates(n, E, k, L, I, torch.float16, max_tokens),
                 "u": ((n, L), torch.float16)}
        check_built(built, _steps(n, TINY, torch.float16, max_tokens=max_tokens, scaling=2.5, **SITU), inter, n,
                    dtypes)


# ---------------------------------------------------------------------------------------------- running it
def _run_chain(steps, tensors: dict, max_tokens, launch) -> torch.Tensor:
    from k3export.plugins.moe import trt_fp8
    N, L = tensors["z"].shape
    E, I = tensors["w13"].shape[0], tensors["w2"].shape[-1]
    inter = trt_fp8.fp8_chain_intermediates(N, E, steps[1].constexprs["K"], L, I, tensors["z"].dtype, max_tokens)
    return run_chain(steps, tensors, inter, launch)


def _twin(t: dict, top_k: int, max_tokens: int):
    """The op's launchers on the chain's path and routing: `route_fwd` as the bf16 chain routes at max_tokens,
    then `moe_fp8_wo` ("blocks") or `moe_fp8_w8a8` ("ptr")."""
    import k3export.fp8_moe_kernels as F
    from k3export.plugins.moe import kernels, trt, trt_fp8
    E = t["w13"].shape[0]
    cfg = trt.chain_tiles(max_tokens, top_k, t["z"].dtype, E)
    ids, w, _ = kernels.route_fwd(t["x"], t["gate_weight"], t["bias"], top_k, True, 1.0, cfg.lean_route,
                                  wide=cfg.wide_route)
    experts = (t["z"], t["w13"], t["w2"], t["w13_scale"], t["w2_scale"])
    if trt_fp8.weight_only(max_tokens, top_k, E):
        return F.moe_fp8_wo(ids, w, *experts, top_k, 4.0, 25.0, F.EXPERT_WO_TILINGS["blocks"])
    return F.moe_fp8_w8a8(ids, w, *experts, t["z_scale"], t["h_scale"], top_k, 4.0, 25.0,
                          trt_fp8.w8a8_tiles(max_tokens, top_k, E))


def _interpreter_cases() -> dict:
    """Weight-only chains under the interpreter: TINY (16 experts, top-4), PTX for max tokens run on N."""
    from k3export.fp8_moe import moe_fp8_wo_ref
    from test_fp8 import _expert_case
    res = {}
    s = TINY
    for name, dt in {"fp32": torch.float32, "fp16": torch.float16}.items():
        for N, max_tokens in ((1, None), (3, 16), (16, None)):
            a = _expert_case(N, s["d"], s["L"], s["I"], s["E"], s["top_k"], True, seed=N, dtype=dt)
            t = dict(x=a[0], z=a[1], gate_weight=a[2].to(dt), bias=a[3], w13=a[4], w2=a[5], w13_scale=a[6],
                     w2_scale=a[7], z_scale=a[8], h_scale=a[9])
            steps = _steps(N, s, dt, max_tokens=max_tokens, **SITU)
            u = _run_chain(steps, t, max_tokens, lambda step, b: step.fn[step.grid](
                **b, **step.scalars, **step.constexprs, num_warps=step.num_warps, num_stages=step.num_stages))
            ref = moe_fp8_wo_ref(t["x"].double(), t["z"].double(), t["gate_weight"].double(), t["bias"], t["w13"],
                                 t["w2"], t["w13_scale"], t["w2_scale"], s["top_k"], True, 1.0, **SITU)
            case = f"{name}-n{N}-max{max_tokens or N}"
            res[f"ref-{case}"] = _rel(u, ref)
            res[f"op-{case}"] = _rel(u, _twin(t, s["top_k"], max_tokens or N))
    return res


_INTERP = [f"{n}-n{N}-max{m}" for n in ("fp32", "fp16") for N, m in ((1, 1), (3, 16), (16, 16))]


@pytest.mark.parametrize("case", _INTERP)
def test_interpreted_wo_chain_vs_reference(interp, case):
    assert interp[f"ref-{case}"] < (FP32_BOUND if case.startswith("fp32") else FP16_BOUND), interp


@pytest.mark.parametrize("case", [c for c in _INTERP if c.split("-n")[1].split("-max")[0] == c.split("-max")[1]])
def test_interpreted_wo_chain_equals_the_op(interp, case):
    """max_tokens = N: the op's kernels with the op's arguments, so its result bit for bit."""
    assert interp[f"op-{case}"] == 0.0, interp


# ---------------------------------------------------------------------------------------------- GPU, K3 shapes
@pytest.fixture(scope="module")
def k3_fp8():
    """K3's router (bf16) and routed experts in E4M3 at full size (30 GB), random, per-channel scales near the
    unquantized init's (L^-1/2, I^-1/2), built on the GPU in slices."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    d, E, L, I = (K3[n] for n in ("d", "E", "L", "I"))
    c = dict(device="cuda", generator=gen)
    w = dict(gate_weight=(torch.randn(E, d, **c) * d ** -0.5).bfloat16(), bias=torch.randn(E, **c) * 0.1,
             w13=torch.empty(E, 2 * I, L, device="cuda", dtype=torch.float8_e4m3fn),
             w2=torch.empty(E, L, I, device="cuda", dtype=torch.float8_e4m3fn),
             w13_scale=(0.5 + torch.rand(E, 2 * I, **c)) * L ** -0.5,
             w2_scale=(0.5 + torch.rand(E, L, **c)) * I ** -0.5,
             h_scale=torch.tensor(0.05, device="cuda"))
    for e in range(0, E, 64):
        w["w13"][e:e + 64] = torch.randn(min(64, E - e), 2 * I, L, dtype=torch.bfloat16, **c).to(torch.float8_e4m3fn)
        w["w2"][e:e + 64] = torch.randn(min(64, E - e), L, I, dtype=torch.bfloat16, **c).to(torch.float8_e4m3fn)
    yield w
    del w
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("N,max_tokens", [(1, None), (5, 224), (64, 256), (4096, None), (300, 16384)])
def test_fp8_chain_through_cupy_k3(k3_fp8, N, max_tokens):
    """The PTX launched through the CUDA driver at K3 size vs the op's launchers on the chain's path and vs the
    contract's reference (`moe_fp8_wo_ref` weight-only, `moe_fp8_sorted` W8A8), on fresh random inputs, on the
    tokens whose top-16 is clear. 1 and (5, PTX for 224): weight-only; (64, 256): W8A8 with the one-program align;
    4096 and (300, 16384): W8A8 with the chunked align."""
    pytest.importorskip("cupy", reason="cupy launches the PTX through the CUDA driver")
    from k3export.fp8 import scale_from_amax
    from k3export.fp8_moe import moe_fp8_sorted, moe_fp8_wo_ref
    from k3export.plugins.aot import launch_cupy
    from k3export.plugins.moe import trt_fp8
    gen = torch.Generator(device="cuda").manual_seed(2000 + N)
    x = torch.randn(N, K3["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
    z = torch.randn(N, K3["L"], device="cuda", dtype=torch.bfloat16, generator=gen)
    t = dict(x=x, z=z, z_scale=scale_from_amax(z.float().abs().max()), **k3_fp8)
    k = K3["top_k"]
    steps = _steps(N, K3, torch.bfloat16, max_tokens=max_tokens, **SITU)
    u = _run_chain(steps, t, max_tokens, lambda step, b: launch_cupy(step.launch(), b))
    op = _twin(t, k, max_tokens or N)
    args = (x, z, t["gate_weight"], t["bias"], t["w13"], t["w2"], t["w13_scale"], t["w2_scale"])
    wo = trt_fp8.weight_only(max_tokens or N, k, K3["E"])
    ref = moe_fp8_wo_ref(*args, k, True, 1.0, **SITU) if wo else moe_fp8_sorted(*args, t["z_scale"], t["h_scale"], k,
                                                                                 True, 1.0, **SITU)
    clear, err_op, err_ref = clear_token_errors(u, op, ref, x, t["gate_weight"], t["bias"], k)
    print(f"moe fp8 trt chain N={N} max_tokens={max_tokens} ({'weight-only' if wo else 'W8A8'}): vs op "
          f"{err_op:.2e}, vs reference {err_ref:.2e} on {int(clear.sum())}/{N} clear tokens")
    assert u.shape == z.shape and err_op < (CHAIN_BOUND if max_tokens is None else ROUTE_ORDER_BOUND)
    assert err_ref < (BF16_OUT_BOUND if wo else EXPERT_GPU_BOUND)


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
