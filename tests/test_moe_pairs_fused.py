"""The fused "pairs" MoE decode path (`MoeTiles.fuse_topk` / `fuse_combine` in `plugins/moe/kernels.py`): the top-k in
the split router's launch and the combine in gemm2's launch, each finished by the program that draws the last
ticket. 5 launches -> 3 at 1-2 tokens; the results must be the unfused pairs path's, bit for bit. Also the top-k
inside gemm1 (`MoeTiles.topk_gemm1`, tiling "pairs-n8-fc-g1": every gemm1 program selects its token's experts
from the router's partial sums; the top-k launch goes), bit for bit the same.

CPU: the kernels under TRITON_INTERPRET=1 at tiny shapes (fresh random inputs) vs the unfused path (bit-identical:
`torch.equal`) and vs the fp64 `moe_sorted` (the bounds of tests/test_moe_kernels.py); the new kernels compiled
for sm_90 (the interpreter accepts what the GPU compiler may reject). The interpreter runs programs one after
another, so it checks the arithmetic and the ticket bookkeeping, not the ordering between concurrent programs:
that is the GPU tests' job (repeated calls, CUDA-graph replays, K3 and k3-small shapes).

Error = max |kernel - reference| / max |reference| on the same inputs.
"""

from __future__ import annotations

import json
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.plugins.moe.naive import moe_sorted
from test_moe_kernels import BF16_BOUND, FP16_BOUND, FP32_BOUND, SITU, _rel, _weights   # bounds with their reasons

UNFUSED, FUSED, COMBINE_ONLY, IN_GEMM1 = "pairs-n8", "pairs-n8-fused", "pairs-n8-fc", "pairs-n8-fc-g1"


def _moe(x, z, w, k, tiling, scaling=2.5):
    from k3export.plugins.moe.kernels import TILINGS, moe_routed_fwd
    return moe_routed_fwd(x, z, *w, k, True, scaling, tiles=TILINGS["decode"][tiling], **SITU)


def _route_same(x, g, b, k) -> bool:
    """route_fwd(lean, fused) == route_fwd(lean): ids, weights and scores, bit for bit."""
    from k3export.plugins.moe.kernels import route_fwd
    return all(torch.equal(p, q) for p, q in zip(route_fwd(x, g, b, k, True, 2.5, True, True),
                                                 route_fwd(x, g, b, k, True, 2.5, True)))


def _gemm1_routes_same(x, z, w, k) -> bool:
    """route_fwd(defer=True) + pairs_fwd (gemm1 selecting the experts) writes the ids, weights and scores that
    route_fwd(lean) computes, bit for bit, and gives the same u."""
    from k3export.plugins.moe.kernels import TILINGS, pairs_fwd, route_fwd
    ids, wt, s, route = route_fwd(x, w[0], w[1], k, True, 2.5, True, defer=True)
    u = pairs_fwd(z, w[2], w[3], w[4], ids, SITU["beta"], SITU["linear_beta"], TILINGS["decode"][IN_GEMM1], wt, route)
    return route is not None and all(torch.equal(p, q) for p, q in zip((ids, wt, s), route_fwd(x, w[0], w[1], k, True,
                                                                                              2.5, True))) \
        and torch.equal(u, _moe(x, z, w, k, UNFUSED))


def _tickets_zero() -> bool:
    from k3export.plugins.triton_common import _TICKETS
    return bool(_TICKETS) and all(int(t.abs().sum()) == 0 for t in _TICKETS.values())


def _interpreter_cases() -> dict:
    """Every CPU case, run in this process under TRITON_INTERPRET=1 -> {case: relative error or flag}."""
    from k3export.plugins.moe.kernels import route_fwd
    res = {}
    # E 20, d 300 (the split router: 3 of its 8 splits of 128 (fp16) / 5 of 64 (fp32) hold columns), L 24 over 3
    # column tiles of 8 (several tickets per token), I 16.
    E, d, L, I = 20, 300, 24, 16
    for name, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        torch.manual_seed(0)
        w = _weights(E, d, L, I, dt)
        w64 = [t.double() for t in w]
        w64[1] = w[1]
        for N in (1, 2):
            for k in (2, 8):
                x, z = torch.randn(N, d, dtype=dt), torch.randn(N, L, dtype=dt)
                u = _moe(x, z, w, k, FUSED)
                ref = moe_sorted(x.double(), z.double(), *w64, k, True, 2.5, **SITU)
                case = f"{name}-n{N}-k{k}"
                res[f"equal-{case}"] = float(u.dtype == dt and torch.equal(u, _moe(x, z, w, k, UNFUSED)))
                if N == 2 and k == 8:
                    res[f"equal-fc-{name}"] = float(torch.equal(_moe(x, z, w, k, COMBINE_ONLY), u))
                res[f"gemm1-route-equal-{case}"] = float(_gemm1_routes_same(x, z, w, k) and
                                                         torch.equal(_moe(x, z, w, k, IN_GEMM1), u))
                res[f"route-equal-{case}"] = float(_route_same(x, w[0], w[1], k))
                res[f"ref-{case}"] = _rel(u, ref)
    # Ties: experts 2j and 2j+1 are copies (gate row, bias, weights), so their scores tie exactly; experts 4 and 5
    # are hot (bias 100: every token's first two slots, lower id first). The fused top-k picks the same ids.
    torch.manual_seed(1)
    w = list(_weights(E, d, L, I, torch.float32))
    for t in w:
        t[1::2] = t[0::2]
    w[1][4] = w[1][5] = 100.0
    ties = []
    for N in (1, 2):
        for k in (2, 8):
            x, z = torch.randn(N, d), torch.randn(N, L)
            ids = route_fwd(x, w[0], w[1], k, True, 2.5, True, True)[0]
            ties.append(_route_same(x, w[0], w[1], k) and bool((ids[:, :2] == torch.tensor([4, 5])).all())
                        and torch.equal(_moe(x, z, w, k, FUSED), _moe(x, z, w, k, UNFUSED))
                        and _gemm1_routes_same(x, z, w, k))
    res["ties-equal"] = float(all(ties))
    # Two consecutive fused calls on fresh inputs (the counters must be back at 0 after the first), each equal to
    # the unfused path on its own inputs; every counter 0 afterwards.
    torch.manual_seed(2)
    w = _weights(E, d, L, I, torch.float16)
    xs = [(torch.randn(2, d, dtype=torch.float16), torch.randn(2, L, dtype=torch.float16)) for _ in range(2)]
    outs = [_moe(x, z, w, 8, FUSED) for x, z in xs]
    res["consecutive-equal"] = float(all(torch.equal(u, _moe(x, z, w, 8, UNFUSED)) for u, (x, z) in zip(outs, xs)))
    res["tickets-zero"] = float(_tickets_zero())
    # defer with a router that is not split (lean=False): no route to hand gemm1, the top-k ran as usual
    x = torch.randn(1, d)
    ids, wt, sc, none = route_fwd(x, w[0].float(), w[1], 2, True, 2.5, False, defer=True)
    res["defer-unsplit"] = float(none is None and all(torch.equal(p, q) for p, q in zip(
        (ids, wt, sc), route_fwd(x, w[0].float(), w[1], 2, True, 2.5, False))))
    return res


@pytest.mark.parametrize("case", [f"{what}-{dt}-n{n}-k{k}"
                                  for what in ("equal", "route-equal", "gemm1-route-equal")
                                  for dt in ("fp32", "fp16") for n in (1, 2) for k in (2, 8)]
                         + ["equal-fc-fp32", "equal-fc-fp16", "ties-equal", "consecutive-equal", "tickets-zero",
                            "defer-unsplit"])
def test_interpreted_pairs_fused_bit_identical(interp, case):
    assert interp[case] == 1.0, interp


@pytest.mark.parametrize("dt,bound", [("fp32", FP32_BOUND), ("fp16", FP16_BOUND)])
def test_interpreted_pairs_fused_vs_reference(interp, dt, bound):
    errs = {c: v for c, v in interp.items() if c.startswith(f"ref-{dt}-")}
    assert len(errs) == 4 and max(errs.values()) < bound, errs


# ---------------------------------------------------------------------------------------------- sm_90 compile
def _compile(kernel: str, E: int, k: int, scaling: str):
    from k3export.plugins.aot import compile_ptx
    from k3export.plugins.moe import kernels as K
    from k3export.plugins.triton_common import pow2
    if kernel == "router":
        sig = {"x": "*bf16", "g": "*bf16", "bias": "*fp32", "part": "*fp32", "s": "*fp32", "ids": "*i32",
               "w": "*fp32", "tickets": "*i32", "N": "i32", "E": "i32", "D": "i32", "stride_xn": "i32",
               "stride_ge": "i32", "D_SPLIT": "i32", "scaling": scaling}
        consts = dict(K=k, BLOCK_K=pow2(k, 2), BLOCK_M=16, BLOCK_E=16, BLOCK_D=128, E_PAD=pow2(E), SPLITS=8,
                      RENORM=True, PACKED=True, DOT_PREC="ieee")
        return compile_ptx(K.moe_router_topk_fwd_kernel, {**sig, **{c: "constexpr" for c in consts}}, consts, 4, 3)
    sig = {"h": "*bf16", "w2": "*bf16", "ids": "*i32", "wt": "*fp32", "y": "*fp32", "u": "*bf16", "tickets": "*i32",
           "L": "i32", "I": "i32", "stride_h": "i32", "stride_we": "i32", "stride_wl": "i32", "stride_y": "i32",
           "stride_u": "i32"}
    bn, bk, _ = K.TILINGS["decode"][FUSED].pair_gemm[1]
    consts = dict(TOP_K=k, BLOCK_N=bn, BLOCK_K=bk)
    return compile_ptx(K.moe_pair_gemm2_combine_fwd_kernel, {**sig, **{c: "constexpr" for c in consts}}, consts, 4)


@pytest.mark.parametrize("kernel", ["router", "gemm2"])
@pytest.mark.parametrize("E,k,scaling", [(896, 16, "fp64"), (64, 8, "fp32")])
def test_pairs_fused_kernels_compile_sm90(kernel, E, k, scaling):
    """PTX for sm_90 at K3 / k3-small routing: one acq_rel gpu-scope ticket, the other programs' partials read
    through L2 (ld.global.cg: one per split per token-loop body, or one per slot). The router's float argument
    also as fp64 (how Inductor types Python floats in AOTI packages; eager passes fp32)."""
    ptx = _compile(kernel, E, k, scaling).ptx
    assert ptx.count("atom.global.gpu.acq_rel.add") == 1, ptx[-2000:]
    assert ptx.count("ld.global.cg") >= (8 if kernel == "router" else k)


def _reduce_layouts(kernel) -> list[str]:
    """The operand type (shape and resolved layout) of every tt.reduce in the kernel's TTGIR, in program order."""
    import re
    ttgir = kernel.asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    return [re.sub(r"#\w+", lambda m: aliases.get(m.group(0), m.group(0)), t)
            for t in re.findall(r"\}\) : \((tensor<[^)]*>)\) ->", ttgir)]


def _ttgir(fn, sig: dict, consts: dict, num_stages: int = 1):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in sig
                 and p.name not in consts}, **consts}               # e.g. PDL, at its default
    sig = {**sig, **{c: "constexpr" for c in consts}}
    sig = {n: sig[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=num_stages))


@pytest.mark.parametrize("E,k", [(896, 16), (64, 8)])
def test_pairs_fused_reductions_match_unfused_sm90(E, k):
    """Bit-identity on the GPU needs the same fp32 reduction order: the fused kernels' reductions (top-k rounds, the
    renormalising sum, the GEMV's row sums) run on the same shapes and layouts as the unfused kernels' (sm_90 TTGIR;
    the fused router adds none, gemm2's combine is elementwise)."""
    from k3export.plugins.moe import kernels as K
    from k3export.plugins.triton_common import pow2
    topk = dict(K=k, BLOCK_K=pow2(k, 2), RENORM=True, PACKED=True)
    unfused = _ttgir(K.moe_topk_fwd_kernel, {"s": "*fp32", "part": "*fp32", "bias": "*fp32", "ids": "*i32",
                                             "w": "*fp32", "N": "i32", "E": "i32", "scaling": "fp32"},
                     dict(topk, BLOCK_E=pow2(E), SPLITS=8))
    fused = _ttgir(K.moe_router_topk_fwd_kernel,
                   {"x": "*bf16", "g": "*bf16", "bias": "*fp32", "part": "*fp32", "s": "*fp32", "ids": "*i32",
                    "w": "*fp32", "tickets": "*i32", "N": "i32", "E": "i32", "D": "i32", "stride_xn": "i32",
                    "stride_ge": "i32", "D_SPLIT": "i32", "scaling": "fp32"},
                   dict(topk, BLOCK_M=16, BLOCK_E=16, BLOCK_D=128, E_PAD=pow2(E), SPLITS=8, DOT_PREC="ieee"), 3)
    assert _reduce_layouts(fused) == _reduce_layouts(unfused) and len(_reduce_layouts(fused)) == k + 2
    bn, bk, _ = K.TILINGS["decode"][FUSED].pair_gemm[1]
    gemv = {"h": "*bf16", "w2": "*bf16"}
    rest = {"L": "i32", "I": "i32", "stride_h": "i32", "stride_we": "i32", "stride_wl": "i32", "stride_y": "i32"}
    unfused = _ttgir(K.moe_pair_gemm2_fwd_kernel, {**gemv, "y": "*fp32", "ids": "*i32", **rest},
                     dict(BLOCK_N=bn, BLOCK_K=bk))
    fused = _ttgir(K.moe_pair_gemm2_combine_fwd_kernel, {**gemv, "ids": "*i32", "wt": "*fp32", "y": "*fp32",
                                                         "u": "*bf16", "tickets": "*i32", **rest, "stride_u": "i32"},
                   dict(TOP_K=k, BLOCK_N=bn, BLOCK_K=bk))
    assert _reduce_layouts(fused) == _reduce_layouts(unfused) and len(_reduce_layouts(fused)) == 1


@pytest.mark.parametrize("E,k", [(896, 16), (64, 8)])
def test_gemm1_route_reductions_match_topk_kernel_sm90(E, k):
    """gemm1 selecting its own experts (ROUTE) gives the top-k kernel's ids and weights on the GPU only if its
    selection reductions run on the same shapes and layouts: the first k + 2 reductions of its sm_90 TTGIR (the
    top-k rounds and the renormalising sum) are the top-k kernel's, then its GEMV row sums follow."""
    from k3export.plugins.moe import kernels as K
    from k3export.plugins.triton_common import pow2
    topk = dict(BLOCK_K=pow2(k, 2), RENORM=True, PACKED=True)
    unfused = _reduce_layouts(_ttgir(K.moe_topk_fwd_kernel, {"s": "*fp32", "part": "*fp32", "bias": "*fp32",
                                                             "ids": "*i32", "w": "*fp32", "N": "i32", "E": "i32",
                                                             "scaling": "fp32"},
                                     dict(topk, K=k, BLOCK_E=pow2(E), SPLITS=8)))
    bn, bk, _ = K.TILINGS["decode"][IN_GEMM1].pair_gemm[0]
    sig = {"z": "*bf16", "w1": "*bf16", "w3": "*bf16", "h": "*bf16", "ids": "*i32", "L": "i32", "I": "i32",
           "stride_zn": "i32", "stride_we": "i32", "stride_wi": "i32", "stride_h": "i32", "beta": "fp32",
           "linear_beta": "fp32", "part": "*fp32", "bias": "*fp32", "s": "*fp32", "wt": "*fp32", "N": "i32",
           "E": "i32", "scaling": "fp32"}
    routed = _reduce_layouts(_ttgir(K.moe_pair_gemm1_fwd_kernel, sig,
                                    dict(TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, ROUTE=True, SPLITS=8, BLOCK_E=pow2(E),
                                         BLOCK_TK=pow2(k, 2), RENORM=True, PACKED=True)))
    assert len(unfused) == k + 2 and routed[:k + 2] == unfused, (routed, unfused)


@pytest.mark.parametrize("E,k", [(896, 16), (64, 8)])
def test_fp8_gemm1_route_reductions_match_topk_kernel_sm90(E, k):
    """The FP8 "pairs" gemm1 that routes itself (`ExpertWo.fuse`, `_pair_route`): its first k + 2 sm_90 reductions
    are the top-k kernel's (same shapes and layouts at its default 4 warps), so it writes the same ids and weights."""
    from k3export.fp8_moe_kernels import EXPERT_WO_TILINGS, moe_fp8_wo_pair_gemm1_fwd_kernel
    from k3export.plugins.moe import kernels as K
    from k3export.plugins.triton_common import pow2
    unfused = _reduce_layouts(_ttgir(K.moe_topk_fwd_kernel, {"s": "*fp32", "part": "*fp32", "bias": "*fp32",
                                                             "ids": "*i32", "w": "*fp32", "N": "i32", "E": "i32",
                                                             "scaling": "fp32"},
                                     dict(K=k, BLOCK_K=pow2(k, 2), RENORM=True, PACKED=True, BLOCK_E=pow2(E),
                                          SPLITS=8)))
    t1 = EXPERT_WO_TILINGS["pairs-n16k512-shift-fused"].gemm1
    assert t1.warps == 4
    i32 = "i32"
    sig = {"z4": "*i64", "w13": "*i32", "s13": "*fp32", "h": "*bf16", "ids": "*i32", "I": i32, "C_L": i32,
           "stride_z4": i32, "stride_we4": i32, "stride_wn4": i32, "stride_se": i32, "stride_h": i32, "beta": "fp32",
           "linear_beta": "fp32", "part": "*fp32", "bias": "*fp32", "s": "*fp32", "wt": "*fp32", "N": i32, "E": i32,
           "scaling": "fp32"}
    routed = _reduce_layouts(_ttgir(moe_fp8_wo_pair_gemm1_fwd_kernel, sig,
                                    dict(TOP_K=k, PER_CHANNEL=True, UNPACK="shift", PREFETCH=False,
                                         BLOCK_N=t1.block_n, BLOCK_C=t1.block_k // 4, ROUTE=True, SPLITS=8,
                                         BLOCK_E=pow2(E), BLOCK_TK=pow2(k, 2), RENORM=True, PACKED=True)))
    assert routed[:k + 2] == unfused, (routed, unfused)


# ---------------------------------------------------------------------------------------------- GPU
SHAPES = {"k3": (896, 7168, 3584, 3072, 16), "k3-small": (64, 2048, 1024, 768, 8)}   # E, d, L, I, top_k


@pytest.fixture(scope="module")
def experts():
    """shape name -> random routed experts in bf16 (K3: 59 GB), built once per name for the GPU tests."""
    cache = {}

    def get(name):
        if name not in cache:
            E, d, L, I, _ = SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(17)
            cache[name] = _weights(E, d, L, I, torch.bfloat16, "cuda", gen)
        return cache[name]
    yield get
    cache.clear()
    torch.cuda.empty_cache()


def _inputs(name, N, seed):
    E, d, L, I, _ = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(N, d, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(N, L, device="cuda", dtype=torch.bfloat16, generator=gen))


def _clear_rows(x, g, b, k):
    """Rows whose k-th and (k+1)-th selection keys differ by more than fp32 reordering could move them."""
    top = torch.topk(torch.sigmoid(x.float() @ g.float().T) + b, k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) > 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["k3", "k3-small"])
@pytest.mark.parametrize("N", [1, 2])
def test_pairs_fused_gpu_bit_identical(experts, name, N):
    """Fused == unfused (u, ids, w, s: bit for bit) over 10 calls each on fresh inputs (a race in the ticket
    hand-off would show as a call that differs), also with the top-k inside gemm1 (ids, w, s as gemm1 writes them),
    and within the bf16 bound of moe_sorted on clear rows."""
    w = experts(name)
    k = SHAPES[name][4]
    for seed in range(10):
        x, z = _inputs(name, N, 1000 * N + seed)
        u = _moe(x, z, w, k, FUSED, 1.0)
        assert torch.equal(u, _moe(x, z, w, k, UNFUSED, 1.0)), (name, N, seed)
        assert torch.equal(_moe(x, z, w, k, COMBINE_ONLY, 1.0), u), (name, N, seed)
        assert torch.equal(_moe(x, z, w, k, IN_GEMM1, 1.0), u), (name, N, seed)
        assert _route_same(x, w[0], w[1], k) and _gemm1_routes_same(x, z, w, k), (name, N, seed)
    assert _tickets_zero()
    clear = _clear_rows(x, w[0], w[1], k)
    ref = moe_sorted(x, z, *w, k, True, 1.0, **SITU)
    err = ((u.double() - ref.double())[clear].abs().max() / ref.double().abs().max()).item() if clear.any() else 0.0
    print(f"pairs fused {name} N={N}: rel err vs moe_sorted {err:.2e} on {int(clear.sum())}/{N} clear rows")
    assert err < BF16_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("tiling", [FUSED, IN_GEMM1])
@pytest.mark.parametrize("name", ["k3", "k3-small"])
@pytest.mark.parametrize("N", [1, 2])
def test_pairs_fused_gpu_cuda_graph(experts, name, N, tiling):
    """The fused path captured in a CUDA graph (after a warm-up call, as a decode step is) and replayed 3 times on
    fresh inputs copied into the captured buffers: each replay == the unfused path on those inputs, bit for bit
    (the counters go back to 0 inside every replay)."""
    w = experts(name)
    k = SHAPES[name][4]
    x, z = _inputs(name, N, 7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _moe(x, z, w, k, tiling, 1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        u = _moe(x, z, w, k, tiling, 1.0)
    for seed in range(3):
        xn, zn = _inputs(name, N, 100 + seed)
        x.copy_(xn)
        z.copy_(zn)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(u, _moe(xn, zn, w, k, UNFUSED, 1.0)), (name, N, seed)
    assert _tickets_zero()


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 2])
def test_pairs_fused_gpu_ties(N):
    """k3-small routing (64 experts, top-8) with experts 2j, 2j+1 copies (exact score ties) and 4, 5 hot: the fused
    top-k picks the unfused ids (lower id first), and the outputs are equal."""
    E, d, L, I, k = SHAPES["k3-small"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = list(_weights(E, d, 256, 384, torch.bfloat16, "cuda", gen))
    for t in w:
        t[1::2] = t[0::2].clone()
    w[1][4] = w[1][5] = 100.0
    from k3export.plugins.moe.kernels import route_fwd
    for seed in range(5):
        x = torch.randn(N, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        z = torch.randn(N, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = route_fwd(x, w[0], w[1], k, True, 1.0, True, True)[0]
        assert _route_same(x, w[0], w[1], k) and bool((ids[:, :2] == torch.tensor([4, 5], device="cuda")).all())
        assert torch.equal(_moe(x, z, w, k, FUSED, 1.0), _moe(x, z, w, k, UNFUSED, 1.0))
        assert _gemm1_routes_same(x, z, w, k)


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
